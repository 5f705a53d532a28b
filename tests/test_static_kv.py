"""Static-KV Llama and GPT-2 graphs (export/static_kv.py): same numbers as the traced graph, in-place rollback,
and clear errors where the architecture has no static graph."""
from __future__ import annotations

import json

import numpy as np
import pytest

from edgespec import contract
from edgespec.bundle import load_bundle
from edgespec.cli import main
from edgespec.errors import BundleError, UnsupportedArchitectureError
from edgespec.runtimes.onnx_backend import SessionConfig, open_backend

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module", params=["llama", "gpt2"])
def both_layouts(request, tiny_checkpoints, tmp_path_factory):
    """A tiny pair exported twice: static (the default) and optimum's concat graph."""
    from edgespec.export.pipeline import ExportOptions, export_bundle

    target, draft = tiny_checkpoints(request.param)
    root = tmp_path_factory.mktemp(f"layouts-{request.param}")
    out = {}
    for graph in ("static", "optimum"):
        out[graph] = root / graph
        export_bundle(target, out[graph], draft=draft, options=ExportOptions(graph=graph), progress=None)
    return out


def _open(bundle, role="target"):
    m = load_bundle(bundle).models[role]
    return open_backend(bundle / m.path, m, SessionConfig(intra_op_threads=1)), m


def test_layouts_recorded(both_layouts):
    for graph, layout in (("static", contract.KV_STATIC), ("optimum", contract.KV_CONCAT)):
        m = load_bundle(both_layouts[graph])
        assert {mm.kv_layout for mm in m.models.values()} == {layout}
    nodes = {}
    import onnx
    for graph in ("static", "optimum"):
        nodes[graph] = len(onnx.load(str(both_layouts[graph] / "target" / contract.DECODER_FILE), load_external_data=False).graph.node)
    assert nodes["static"] * 3 < nodes["optimum"], nodes  # the point of writing the graph by hand


@pytest.mark.parametrize("role", ["target", "draft"])
def test_static_matches_concat_through_rewinds(both_layouts, role):
    """A random schedule of k-token calls and rollbacks (the speculative loop's call pattern) gives
    the same logits on both layouts; the static cache's buffers never move."""
    static, ms = _open(both_layouts["static"], role)
    concat, _ = _open(both_layouts["optimum"], role)
    rng = np.random.default_rng(3)
    prompt = rng.integers(4, 60, size=9)
    assert np.abs(static.prefill(prompt) - concat.prefill(prompt)).max() < 1e-4
    ptrs = [b.ctypes.data for b in static._kv.buffers]
    worst = 0.0
    for _ in range(30):
        k = int(rng.integers(1, 6))
        if static.length + k > ms.max_positions:
            break
        ids = rng.integers(4, 60, size=k)
        a, b = static.extend(ids), concat.extend(ids)
        worst = max(worst, float(np.abs(a - b).max()))
        back = int(rng.integers(0, k + 1))  # reject the last `back` tokens
        static.rewind_to(static.length - back)
        concat.rewind_to(concat.length - back)
    assert worst < 1e-4, worst
    assert [b.ctypes.data for b in static._kv.buffers] == ptrs


def test_static_greedy_speculative_equals_plain(both_layouts):
    import edgespec

    prompt = [5, 9, 13, 22, 31, 7]
    outs = []
    for graph in ("static", "optimum"):
        eng = edgespec.load(both_layouts[graph], threads=1)
        plain = eng.generate(prompt, max_new_tokens=40, temperature=0, use_draft=False)
        spec = eng.generate(prompt, max_new_tokens=40, temperature=0, gamma=3)
        assert spec.ids == plain.ids, graph
        outs.append(plain.ids)
    assert outs[0] == outs[1]


def test_static_graph_refused_where_unsupported(tiny_checkpoints, tmp_path, capsys):
    target, _ = tiny_checkpoints("t5")
    rc = main(["export", "--model", str(target), "--out", str(tmp_path / "b"), "--graph", "static", "--quiet"])
    assert rc != 0
    err = capsys.readouterr().err
    assert "--graph" in err and "t5" in err and "Traceback" not in err
    assert not (tmp_path / "b").exists()

    from tiny_models import make_llama
    from edgespec.export.pipeline import ExportOptions, export_bundle

    odd = make_llama(tmp_path / "head8", hidden=32, heads=4, kv_heads=2)  # head size 8
    with pytest.raises(UnsupportedArchitectureError, match="multiple of 16"):
        export_bundle(odd, tmp_path / "b8", options=ExportOptions(graph="static"), progress=None)
    said: list[str] = []
    m = export_bundle(odd, tmp_path / "b8auto", progress=said.append)  # auto falls back to the traced graph, and says why
    assert m.target.kv_layout == contract.KV_CONCAT
    assert any("(optimum); no static-KV graph for head size 8 (ONNX Runtime's GroupQueryAttention needs a multiple "
               "of 16), so a rejection compacts the cache" in line for line in said), said


def test_opset_applies_to_optimum_graphs_only(tiny_checkpoints, tmp_path, capsys):
    target, _ = tiny_checkpoints("llama")
    assert main(["export", "--model", str(target), "--out", str(tmp_path / "a"), "--opset", "14"]) == 2
    assert "drop --opset, or add --graph optimum" in capsys.readouterr().err
    for bad in ("13", "99"):   # 99: beyond what torch exports (it failed deep in its tracer, with a traceback)
        assert main(["export", "--model", str(target), "--out", str(tmp_path / "a"), "--opset", bad, "--graph",
                     "optimum"]) == 2
        assert "--opset must be an integer from 14 to" in capsys.readouterr().err
    assert main(["export", "--model", str(target), "--out", str(tmp_path / "b"), "--opset", "17", "--graph", "optimum",
                 "--quiet"]) == 0
    assert load_bundle(tmp_path / "b").opset == 17
    # a static target (opset 17) with a traced draft at opset 14: the manifest gives the highest (it gave the last)
    from tiny_models import make_llama

    odd = make_llama(tmp_path / "head8", hidden=32, heads=4, kv_heads=2)  # head size 8: no static graph
    assert main(["export", "--target", str(target), "--draft", str(odd), "--out", str(tmp_path / "c"), "--opset", "14",
                 "--quiet"]) == 0
    m = load_bundle(tmp_path / "c")
    assert (m.target.kv_layout, m.models["draft"].kv_layout, m.opset) == (contract.KV_STATIC, contract.KV_CONCAT, 17)


def test_manifest_kv_layout_checked(bundle_copy):
    b = bundle_copy("llama")
    path = b / contract.MANIFEST_NAME
    data = json.loads(path.read_text())
    data["models"]["target"]["kv_layout"] = "paged"
    path.write_text(json.dumps(data))
    with pytest.raises(BundleError, match="kv_layout"):
        load_bundle(b)


def test_validation_reaches_far_positions_and_rewinds(tiny_checkpoints, tmp_path, monkeypatch):
    """A graph wrong only past the first 12 positions (rotary rows scrambled from 12 on) used to
    pass validation; the rewound round and the run to 64 positions catch it."""
    from edgespec.errors import ValidationError
    from edgespec.export import static_kv
    from edgespec.export.pipeline import export_bundle

    target, _ = tiny_checkpoints("llama")
    m = export_bundle(target, tmp_path / "good", progress=None)
    stages = m.target.validation["fp32"]["stages"]
    assert {"prefill", "step_1", "step_4", "after_rewind"} <= set(stages) and "rejected" not in stages
    real = static_kv._Graph.weight

    def scrambled(self, name, arr, dtype=np.float32):
        if name in ("cos_cache", "sin_cache"):
            arr = np.concatenate([arr[:12], arr[12:][::-1]])
        return real(self, name, arr, dtype)

    monkeypatch.setattr(static_kv._Graph, "weight", scrambled)
    with pytest.raises(ValidationError, match="after_rewind"):
        export_bundle(target, tmp_path / "bad", progress=None)
    assert not (tmp_path / "bad").exists()


def test_broken_int8_graph_fails_validation(tiny_checkpoints, tmp_path, monkeypatch):
    """int8 is judged against the logits' range: an all-zero quantized graph of a tiny model
    (logits within ~1) stayed under the absolute bound of 1.0."""
    import warnings

    from edgespec.errors import ValidationError
    from edgespec.export import quantize
    from edgespec.export.pipeline import ExportOptions, export_bundle

    target, _ = tiny_checkpoints("llama")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        m = export_bundle(target, tmp_path / "good", options=ExportOptions(quantize_target="int8"), progress=None)
    v = m.target.validation["int8"]
    assert v["max_abs_diff"] < 0.05 * v["logits_range"] and v["rtol"] == 0.25
    real = quantize._quantize_columns
    monkeypatch.setattr(quantize, "_quantize_columns", lambda w: real(np.zeros_like(w)))
    with pytest.raises(ValidationError, match="of the logits' range.*Export the target without int8 .--quantize-target none"):
        export_bundle(target, tmp_path / "bad", options=ExportOptions(quantize_target="int8"), progress=None)
    assert not (tmp_path / "bad").exists()
