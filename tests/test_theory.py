import re

import pytest

from edgespec import theory
from edgespec.cli import main
from edgespec.errors import InvalidArgumentError


def test_expected_tokens_hand_computed():
    # alpha 0.5, gamma 2: 1 + 0.5 + 0.25 = 1.75
    assert theory.expected_tokens(0.5, 2) == pytest.approx(1.75)
    assert theory.expected_tokens(0.0, 5) == pytest.approx(1.0)
    assert theory.expected_tokens(1.0, 5) == pytest.approx(6.0)
    assert theory.expected_tokens(0.8, 3) == pytest.approx(1 + 0.8 + 0.64 + 0.512)


def test_speedup_matches_paper_table():
    # Paper Table 2, En-De T5-small, T=0: alpha 0.75, gamma 7, c ~ 0.02 -> 3.4x measured;
    # Theorem 3.8: (1 - .75^8) / (.25 * (7 * .02 + 1)) = 3.5997 / 1.14 = 3.158
    assert theory.speedup(0.75, 7, 0.02) == pytest.approx((1 - 0.75 ** 8) / (0.25 * 1.14))
    assert theory.speedup(0.5, 2, 0.1) == pytest.approx(1.75 / 1.2)


def test_optimal_gamma_and_corollary():
    assert theory.optimal_gamma(0.5, 0.1) == max(range(1, 65), key=lambda g: theory.speedup(0.5, g, 0.1))
    assert theory.optimal_gamma(0.9, 0.01) > theory.optimal_gamma(0.6, 0.01) > theory.optimal_gamma(0.6, 0.2) - 1
    assert theory.corollary_bound(0.6, 0.1) == pytest.approx(1.6 / 1.1)
    assert theory.corollary_bound(0.1, 0.2) is None
    best = theory.optimal_gamma(0.6, 0.1)
    assert theory.speedup(0.6, best, 0.1) >= theory.corollary_bound(0.6, 0.1)


def test_arithmetic_and_memory_factors():
    # alpha 0.5, gamma 2, c_hat 0.1: (2 * 0.1 + 3) / 1.75
    assert theory.arithmetic_factor(0.5, 2, 0.1) == pytest.approx(3.2 / 1.75)
    assert theory.memory_read_reduction(0.5, 2) == pytest.approx(1.75)


def test_bad_theory_input():
    for args in ((1.5, 2, 0.1), (-0.1, 2, 0.1), (0.5, -1, 0.1), (0.5, 2, -1.0)):
        with pytest.raises(InvalidArgumentError):
            theory.speedup(*args)


def test_plan_cli(capsys):
    assert main(["plan", "--alpha", "0.75", "--c", "0.02", "--max-gamma", "8"]) == 0
    out = capsys.readouterr().out
    assert "best gamma: 8" in out and "3.189x" in out
    assert main(["plan", "--alpha", "1.5", "--c", "0.02"]) == 2
    err = capsys.readouterr().err
    assert "alpha must be in [0, 1]" in err and "Traceback" not in err


def test_toy_cli(capsys):
    assert main(["toy", "--max-new-tokens", "300", "--gamma", "3"]) == 0
    out = capsys.readouterr().out
    assert "alpha" in out and "tokens per target call" in out


def test_plan_and_toy_edge_cases(capsys):
    assert main(["plan", "--alpha", "0", "--c", "0.1"]) == 0
    assert "no gamma speeds decoding up here" in capsys.readouterr().out
    assert main(["plan", "--alpha", "1", "--c", "0", "--max-gamma", "5"]) == 0
    assert "best gamma: 5 (6.000x expected) (the largest tabulated" in capsys.readouterr().out
    assert main(["plan", "--alpha", "0.8", "--c", "0.05", "--max-gamma", "30"]) == 0
    assert "largest tabulated" not in capsys.readouterr().out      # an interior optimum
    for argv, needle in ((["plan", "--alpha", "0.8", "--c", "0.05", "--c-hat", "-1"], "--c-hat must be"),
                         (["plan", "--alpha", "0.8", "--c", "inf"], "c must be a finite number"),
                         (["toy", "--noise", "-1"], "--noise must be"),
                         (["toy", "--noise", "1e300"], "--noise must be a number in [0, 1e+06]"),  # (was inf in float32)
                         (["toy", "--gamma", "0"], "--gamma must be an integer >= 1")):
        assert main(argv) == 2
        err = capsys.readouterr().err
        assert needle in err and "Traceback" not in err, err


# (the tests below pin what a mutation audit's surviving mutants changed: each fails on its mutant)
def test_paper_c_unknown_verify_cost_is_as_if_one():
    assert theory.paper_c(0.1, 2.0) == pytest.approx(0.2)
    assert theory.paper_c(0.1, float("nan")) == 0.1


def test_corollary_needs_alpha_strictly_above_c():
    assert theory.corollary_bound(0.2, 0.2) is None


def test_plan_with_no_speedup_at_all(capsys):
    assert main(["plan", "--alpha", "0", "--c", "0"]) == 0
    out = capsys.readouterr().out
    assert "no gamma speeds decoding up here (best: gamma 1, 1.000x)" in out


def test_plan_table_columns(capsys):
    assert main(["plan", "--alpha", "0.5", "--c", "0.1", "--max-gamma", "2"]) == 0
    rows = {int(l.split()[0]): l.split() for l in capsys.readouterr().out.splitlines() if re.match(r"\s+\d+\s", l)}
    # gamma 2: tokens 1.75, speedup 1.75/1.2, ops (2*0.1 + 3)/1.75 (c-hat defaults to c), reads 1/1.75
    assert rows[2][:5] == ["2", "1.750", "1.458x", "1.829x", "0.571x"]
    assert main(["plan", "--alpha", "0.75", "--c", "1e308", "--max-gamma", "2"]) == 0  # (a 300-digit factor before)
    rows = {int(l.split()[0]): l.split() for l in capsys.readouterr().out.splitlines() if re.match(r"\s+\d+\s", l)}
    assert rows[1][3] == "5.71e+307x" and rows[2][3] == "infx"
