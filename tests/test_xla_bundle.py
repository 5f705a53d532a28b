"""The XLA runtime inside a bundle: `edgespec export --format onnx+xla`, then the same loop over
jax.export artifacts gives token-identical greedy output to the ONNX Runtime path."""
from __future__ import annotations

import json

import numpy as np
import pytest

pytest.importorskip("jax")

from edgespec.api import load  # noqa: E402
from edgespec.cli import main  # noqa: E402

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def xla_bundle(tmp_path_factory, tiny_checkpoints):
    from edgespec.export.pipeline import export_bundle

    root = tmp_path_factory.mktemp("xla-bundles")
    cache = {}

    def get(arch):
        if arch not in cache:
            t, d = tiny_checkpoints(arch)
            export_bundle(t, root / arch, draft=d, progress=None,
                          xla=dict(platforms=["cpu"], max_length=64, verify_width=6))
            cache[arch] = root / arch
        return cache[arch]

    return get


@pytest.mark.parametrize("arch", ["gpt2", "llama", "t5"])
def test_greedy_identical_across_runtimes(xla_bundle, arch):
    bundle = xla_bundle(arch)
    for role, fmt in json.loads((bundle / "edgespec.json").read_text())["formats"]["xla"].items():
        assert fmt["validation"]["max_abs_diff"] < 1e-4, role  # validated against PyTorch at export
    onnx, xla = load(bundle), load(bundle, runtime="xla")
    prompt = [3, 9, 4, 17, 5]
    max_logit_diff = 0.0
    for gamma in (1, 3, 5):
        a = onnx.generate(prompt, max_new_tokens=20, temperature=0.0, gamma=gamma, seed=0)
        b = xla.generate(prompt, max_new_tokens=20, temperature=0.0, gamma=gamma, seed=0)
        assert a.ids == b.ids, f"{arch} gamma={gamma}: onnx {a.ids} vs xla {b.ids}"
        # the lookahead drafter's worker thread drives the XLA draft while the XLA target verifies
        c = xla.generate(prompt, max_new_tokens=20, temperature=0.0, gamma=gamma, drafter="lookahead")
        assert c.ids == a.ids, f"{arch} gamma={gamma}: lookahead on xla {c.ids}"
    plain = xla.generate(prompt, max_new_tokens=20, temperature=0.0, use_draft=False)
    assert plain.ids == a.ids
    # the models themselves: logits of a prefill and a 3-token extend agree closely
    for backend in (onnx.target, xla.target):
        backend.free()
    la = onnx.target.prefill(np.array(prompt))
    lb = xla.target.prefill(np.array(prompt))
    ea = onnx.target.extend(np.array([7, 8, 9]))
    eb = xla.target.extend(np.array([7, 8, 9]))
    max_logit_diff = max(float(np.abs(la - lb).max()), float(np.abs(ea - eb).max()))
    print(f"{arch}: max |logits onnx - xla| = {max_logit_diff:.2e}")
    assert max_logit_diff < 1e-4


def test_generate_cli_xla_and_missing_artifacts(xla_bundle, tiny_bundle, capsys):
    assert main(["generate", str(xla_bundle("gpt2")), "--prompt", "the cat", "--runtime", "xla",
                 "--temperature", "0", "--max-new-tokens", "8"]) == 0
    capsys.readouterr()
    assert main(["generate", str(tiny_bundle("gpt2")), "--prompt", "the cat", "--runtime", "xla"]) == 2
    err = capsys.readouterr().err
    assert "--format onnx+xla" in err and "Traceback" not in err
    assert main(["generate", str(xla_bundle("gpt2")), "--prompt", "the cat", "--runtime", "xla", "--platform", "foo"]) == 2
    err = capsys.readouterr().err
    assert "unknown XLA platform 'foo': use one of cpu, cuda, rocm, tpu" in err and "re-export" not in err


def test_bench_runs_on_xla_runtime(xla_bundle, tmp_path, capsys):
    """Adaptive gamma stays within the artifacts' verify width (6 here: gamma <= 5, below the default
    bound of 8); a static gamma beyond it is refused before any measurement, as generate does."""
    argv = ["bench", str(xla_bundle("llama")), "--runtime", "xla", "--temperatures", "0", "--repeats", "1",
            "--max-new-tokens", "24", "--quiet"]
    assert main(argv + ["--gammas", "2,auto", "--out", str(tmp_path)]) == 0
    data = json.loads((tmp_path / "bench.json").read_text())
    assert data["verify_width"] == 6 and data["jax"]
    auto = next(r for r in data["results"] if r["gamma"] is None)
    assert 0 < auto["mean_gamma"] <= 5
    capsys.readouterr()
    assert main(argv + ["--gammas", "2,6"]) == 2
    err = capsys.readouterr().err
    assert "verify_width=6, so gamma <= 5" in err and "Traceback" not in err
