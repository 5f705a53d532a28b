"""The paper's formulas (section 3), with ``edgespec plan`` to print them per gamma.

alpha: acceptance rate E[sum_x min(p(x), q(x))] (Definition 3.2); c: time of a draft step over
time of a target step; gamma: draft tokens per round.
"""
from __future__ import annotations

import argparse
import math

from .errors import InvalidArgumentError


def _check(alpha: float, gamma: int | None = None, c: float | None = None) -> None:
    if not isinstance(alpha, (int, float)) or math.isnan(alpha) or not 0 <= alpha <= 1:
        raise InvalidArgumentError(f"alpha must be in [0, 1]; got {alpha!r}")
    if gamma is not None and (not isinstance(gamma, int) or gamma < 0):
        raise InvalidArgumentError(f"gamma must be an integer >= 0; got {gamma!r}")
    if c is not None and (not isinstance(c, (int, float)) or not math.isfinite(c) or c < 0):
        raise InvalidArgumentError(f"c must be a finite number >= 0; got {c!r}")


def expected_tokens(alpha: float, gamma: int) -> float:
    """Equation 1: expected tokens per round, a capped geometric mean (1 - a^(g+1)) / (1 - a)."""
    _check(alpha, gamma)
    if alpha == 1:
        return float(gamma + 1)
    return (1 - alpha ** (gamma + 1)) / (1 - alpha)


def speedup(alpha: float, gamma: int, c: float) -> float:
    """Theorem 3.8: expected walltime improvement (1 - a^(g+1)) / ((1 - a)(g c + 1))."""
    _check(alpha, gamma, c)
    return expected_tokens(alpha, gamma) / (gamma * c + 1)


def paper_c(c_verify: float, verify_cost: float) -> float:
    """Section 3's c, a draft step over a (plain) target step, from a measured draft step over a
    verify call (bench's c) and the verify call's cost in plain steps V; V unknown (NaN): as if 1."""
    return c_verify * verify_cost if verify_cost == verify_cost else c_verify


def memory_read_reduction(alpha: float, gamma: int) -> float:
    """Section 3.4: target weights and KV cache are read once per round instead of once per
    token, so reads per token shrink by the expected tokens per round."""
    return expected_tokens(alpha, gamma)


def arithmetic_factor(alpha: float, gamma: int, c_hat: float) -> float:
    """Theorem 3.11: expected growth of arithmetic operations,
    (1 - a)(g c_hat + g + 1) / (1 - a^(g+1)), c_hat = ops of a draft step / ops of a target step."""
    _check(alpha, gamma, c_hat)
    return (gamma * c_hat + gamma + 1) / expected_tokens(alpha, gamma)


def optimal_gamma(alpha: float, c: float, max_gamma: int = 64) -> int:
    """The integer gamma in 1..max_gamma maximising Theorem 3.8 (Figure 3)."""
    _check(alpha, None, c)
    return max(range(1, max_gamma + 1), key=lambda g: speedup(alpha, g, c))


def corollary_bound(alpha: float, c: float) -> float | None:
    """Corollary 3.9: if alpha > c some gamma gives an improvement >= (1 + alpha) / (1 + c)."""
    _check(alpha, None, c)
    return (1 + alpha) / (1 + c) if alpha > c else None


# ----------------------------------------------------------------------------- CLI: edgespec plan
def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--alpha", type=float, required=True, help="acceptance rate in [0, 1]")
    p.add_argument("--c", type=float, required=True,
                   help="draft step time / target step time (>= 0; the paper's c: edgespec bench's c is over a verify "
                        "call, so pass its c x V)")
    p.add_argument("--max-gamma", type=int, default=12, help="largest gamma to tabulate (default 12)")
    p.add_argument("--c-hat", type=float, default=None, help="draft/target arithmetic ratio for Theorem 3.11 (default: c)")


def _fixed_or_sci(v: float) -> str:
    """3 decimals, or 3 significant digits where that would run past a column (--c 1e308 printed
    a 300-digit factor)."""
    return f"{v:.3f}" if abs(v) < 1e9 else f"{v:.3g}"


def run(args: argparse.Namespace) -> int:
    if not 1 <= args.max_gamma <= 256:  # one table row per gamma
        raise InvalidArgumentError(f"--max-gamma must be in [1, 256]; got {args.max_gamma}")
    a, c = args.alpha, args.c
    c_hat = c if args.c_hat is None else args.c_hat
    _check(a, None, c)
    if not isinstance(c_hat, (int, float)) or not math.isfinite(c_hat) or c_hat < 0:
        raise InvalidArgumentError(f"--c-hat must be a finite number >= 0; got {c_hat!r}")
    best = optimal_gamma(a, c, args.max_gamma)
    print(f"alpha = {a:g}, c = {c:g}" + (f", c-hat = {c_hat:g}" if args.c_hat is not None else ""))
    print(f"{'gamma':>5}  {'tokens/round':>12}  {'speedup (Thm 3.8)':>17}  {'ops factor (3.11)':>17}  {'reads/token':>11}")
    for g in range(1, args.max_gamma + 1):
        mark = "  <- best" if g == best else ""
        print(f"{g:>5}  {expected_tokens(a, g):>12.3f}  {speedup(a, g, c):>16.3f}x  "
              f"{_fixed_or_sci(arithmetic_factor(a, g, c_hat)):>16}x  {1 / memory_read_reduction(a, g):>10.3f}x{mark}")
    bound = corollary_bound(a, c)
    edge = " (the largest tabulated: the speedup still rises; raise --max-gamma)" \
        if best == args.max_gamma and args.max_gamma > 1 and speedup(a, best, c) > speedup(a, best - 1, c) else ""
    if speedup(a, best, c) <= 1:
        print(f"no gamma speeds decoding up here (best: gamma {best}, {speedup(a, best, c):.3f}x): decode without a draft")
    else:
        print(f"best gamma: {best} ({speedup(a, best, c):.3f}x expected){edge}")
    if bound is None:
        print("alpha <= c: no gamma is guaranteed to help (Corollary 3.9); use a cheaper or better draft")
    else:
        print(f"Corollary 3.9 lower bound for the best gamma: {bound:.3f}x")
    print("tokens/round: (1 - alpha^(g+1)) / (1 - alpha); speedup: Theorem 3.8, tokens/round / (g c + 1)\n"
          "ops factor: Theorem 3.11, arithmetic operations per token over plain decoding's (c-hat: a draft "
          "step's operations over a target step's)\n"
          "reads/token: the target's weight and KV bytes read per token over plain decoding's, 1 / tokens/round")
    return 0
