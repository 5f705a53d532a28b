"""Weights written beside the graph one tensor at a time (export/external_data.py): a protobuf cannot be
serialized past 2 GiB, so a graph must never hold a large weight inline, not even while it is built."""
from __future__ import annotations

import os

import numpy as np
import pytest

from edgespec.export.external_data import ALIGN, INLINE_BELOW, DataFile


def _run(graph_path, names):
    """The arrays of initializers ``names`` as ONNX Runtime reads them (each through an Identity)."""
    import onnxruntime as ort

    sess = ort.InferenceSession(str(graph_path), providers=["CPUExecutionProvider"])
    return dict(zip(names, sess.run(list(names), {})))


def _save_identity_graph(path, tensors):
    import onnx
    from onnx import helper

    outs = [helper.make_tensor_value_info(t.name, t.data_type, list(t.dims)) for t in tensors]
    nodes = [helper.make_node("Identity", [t.name + ".w"], [t.name]) for t in tensors]
    for t in tensors:
        t.name += ".w"
    model = helper.make_model(helper.make_graph(nodes, "g", [], outs, tensors), opset_imports=[helper.make_opsetid("", 17)])
    model.ir_version = 8
    onnx.save(model, str(path))


def test_data_file_writes_aligned_external_tensors(tmp_path):
    from onnx import TensorProto

    rng = np.random.default_rng(0)
    arrays = {"small": np.arange(5, dtype=np.int64), "big": rng.standard_normal((300, 7)).astype(np.float32),
              "bytes": rng.integers(-128, 127, (40, 33)).astype(np.int8)}
    with DataFile(tmp_path / "g.onnx.data") as data:
        tensors = [data.tensor(name, a) for name, a in arrays.items()]
    inline = {t.name: t.data_location != TensorProto.EXTERNAL for t in tensors}
    assert inline == {"small": True, "big": False, "bytes": False}
    with DataFile(tmp_path / "other.data") as data:
        scalar, words = data.tensor("s", np.array(2.0, np.float32)), data.tensor("w", np.array(["x" * 40] * 40, object))
    assert list(scalar.dims) == [] and words.data_location != TensorProto.EXTERNAL and len(words.string_data) == 40
    with pytest.raises(FileExistsError):                        # never truncates a file a graph may read
        DataFile(tmp_path / "other.data")
    offsets = [int(dict((e.key, e.value) for e in t.external_data)["offset"]) for t in tensors[1:]]
    assert all(o % ALIGN == 0 for o in offsets) and offsets[1] > offsets[0]
    assert all(not t.raw_data for t in tensors[1:])         # the graph holds no weight bytes
    _save_identity_graph(tmp_path / "g.onnx", tensors)
    got = _run(tmp_path / "g.onnx", list(arrays))
    for name, a in arrays.items():
        assert got[name].dtype == a.dtype and np.array_equal(got[name], a), name


def test_data_file_adopts_tensors_of_another_graph(tmp_path):
    """A rewrite copies the weights it keeps from the old graph's data file (or from inside the old
    graph) into the new file, byte for byte; a data file that ends early is an error, not a short tensor."""
    from onnx import numpy_helper

    rng = np.random.default_rng(1)
    a, b = rng.standard_normal((64, 9)).astype(np.float32), rng.standard_normal((50, 11)).astype(np.float32)
    old = tmp_path / "old"
    old.mkdir()
    with DataFile(old / "m.onnx.data") as data:
        first = data.tensor("first", b)                         # so that "a" starts past offset 0
        external = data.tensor("a", a)
    assert int(external.external_data[1].value) > 0
    inline = numpy_helper.from_array(b, "b")
    assert inline.ByteSize() >= INLINE_BELOW
    new = tmp_path / "new"
    new.mkdir()
    with DataFile(new / "m.onnx.int8.data") as data:
        tensors = [data.adopt(external, old), data.adopt(inline, old),
                   data.adopt(numpy_helper.from_array(np.ones(3, np.float32), "c"), old)]
    assert [t.external_data[0].value for t in tensors[:2]] == ["m.onnx.int8.data"] * 2 and not tensors[2].external_data
    assert not first.raw_data and not any(t.raw_data for t in tensors[:2])
    (old / "m.onnx.data").unlink()                              # the new graph does not need the old file
    _save_identity_graph(new / "m.onnx", tensors)
    got = _run(new / "m.onnx", ["a", "b", "c"])
    assert np.array_equal(got["a"], a) and np.array_equal(got["b"], b) and np.array_equal(got["c"], np.ones(3, np.float32))

    with DataFile(old / "m2.onnx.data") as data:
        external = data.tensor("a", a)
    with open(old / "m2.onnx.data", "r+b") as fh:
        fh.truncate(a.nbytes // 2)
    with DataFile(new / "other.data") as data, pytest.raises(OSError, match="ends before tensor 'a'"):
        data.adopt(external, old)


@pytest.mark.slow
@pytest.mark.parametrize("arch", ["llama", "gpt2"])
def test_static_graph_never_holds_a_weight_inline(tiny_checkpoints, tmp_path, monkeypatch, arch):
    """The static-KV builder hands the graph only pointers to weights already on disk. It used to build
    every weight inline and let onnx.save move them out, which fails for a single weight of 2 GiB or
    more (a 128k-vocabulary embedding at hidden 4096 in fp32) before save is reached."""
    from onnx import TensorProto, helper

    from edgespec.export.pipeline import ExportOptions, export_bundle

    seen = []
    real = helper.make_graph

    def spy(nodes, name, inputs, outputs, initializer=None, *args, **kwargs):
        seen.extend((t.name, t.data_location == TensorProto.EXTERNAL, t.ByteSize()) for t in initializer or [])
        return real(nodes, name, inputs, outputs, initializer, *args, **kwargs)

    monkeypatch.setattr(helper, "make_graph", spy)
    target, _ = tiny_checkpoints(arch)
    export_bundle(target, tmp_path / "b", options=ExportOptions(graph="static"), progress=None)
    external = [name for name, ext, _ in seen if ext]
    assert len(external) >= 4, seen                                    # embeddings, projections, LM head
    assert all(ext or size < INLINE_BELOW for _, ext, size in seen), [s for s in seen if not s[1] and s[2] >= INLINE_BELOW]


@pytest.mark.slow
def test_large_graph_rewrite_streams_its_weights(tiny_checkpoints, tmp_path, monkeypatch):
    """Past EXTERNAL_DATA_ABOVE an int8 rewrite writes every weight, kept or new, into
    ``<graph>.int8.data`` without loading the graph's external data; the model is the same as the
    one-file rewrite below the threshold, bit for bit, and the old data file is gone."""
    from edgespec.bundle import load_bundle
    from edgespec.export import quantize
    from edgespec.export.pipeline import ExportOptions, export_bundle
    from edgespec.runtimes.onnx_backend import SessionConfig, open_backend

    target, _ = tiny_checkpoints("llama")
    export_bundle(target, tmp_path / "one-file", options=ExportOptions(quantize_target="int8"), progress=None)
    monkeypatch.setattr(quantize, "EXTERNAL_DATA_ABOVE", 0)
    export_bundle(target, tmp_path / "streamed", options=ExportOptions(quantize_target="int8"), progress=None)
    files = {b: sorted(p.name for p in (tmp_path / b / "target").glob("model.onnx*")) for b in ("one-file", "streamed")}
    assert files == {"one-file": ["model.onnx"], "streamed": ["model.onnx", "model.onnx.int8.data"]}
    assert (tmp_path / "streamed" / "target" / "model.onnx").stat().st_size < 16 << 10

    logits = {}
    for b in ("one-file", "streamed"):
        m = load_bundle(tmp_path / b).models["target"]
        backend = open_backend(tmp_path / b / m.path, m, SessionConfig(intra_op_threads=1))
        logits[b] = [backend.prefill(np.array([3, 5, 8, 13])), backend.extend(np.array([21, 34])), backend.extend(np.array([7]))]
    assert all(np.array_equal(x, y) for x, y in zip(logits["one-file"], logits["streamed"]))
    import onnx

    graphs = {b: onnx.load(str(tmp_path / b / "target" / "model.onnx"), load_external_data=False).graph for b in logits}
    assert ({t.name: (list(t.dims), t.data_type) for t in graphs["one-file"].initializer}
            == {t.name: (list(t.dims), t.data_type) for t in graphs["streamed"].initializer})  # scalars stay scalars
    assert graphs["one-file"].node == graphs["streamed"].node


def test_rewriting_a_streamed_graph_again(tmp_path, monkeypatch):
    """A second int8 rewrite of a graph whose weights are already in ``<graph>.int8.data`` writes a
    new file instead of truncating the one it reads from (it emptied it, and the graph was lost)."""
    import onnx
    import onnxruntime as ort
    from onnx import TensorProto, helper, numpy_helper

    from edgespec.export import quantize

    rng = np.random.default_rng(2)
    w1, w2 = rng.standard_normal((64, 64)).astype(np.float32), rng.standard_normal((64, 48)).astype(np.float32)
    graph = helper.make_graph(
        [helper.make_node("MatMul", ["x", "w1"], ["h"]), helper.make_node("MatMul", ["h", "w2"], ["y"])], "g",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, [3, 64])], [helper.make_tensor_value_info("y", TensorProto.FLOAT, [3, 48])],
        [numpy_helper.from_array(w1, "w1"), numpy_helper.from_array(w2, "w2")])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    model.ir_version = 8
    path = tmp_path / "model.onnx"
    onnx.save(model, str(path))
    monkeypatch.setattr(quantize, "EXTERNAL_DATA_ABOVE", 0)
    x = rng.standard_normal((3, 64)).astype(np.float32)
    assert quantize.quantize_int8_rowwise(path) == (2, [])
    once = ort.InferenceSession(str(path), providers=["CPUExecutionProvider"]).run(None, {"x": x})[0]
    # a rewrite that reads and keeps the int8 weights (nothing left to convert), then a failing one
    assert quantize.quantize_int8_rowwise(path) == (0, [])
    again = ort.InferenceSession(str(path), providers=["CPUExecutionProvider"]).run(None, {"x": x})[0]
    assert np.array_equal(once, again)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["model.onnx", "model.onnx.int8.1.data"]
    monkeypatch.setattr(quantize, "DataFile", _Failing)
    with pytest.raises(OSError, match="disk full"):
        quantize.quantize_int8_rowwise(path)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["model.onnx", "model.onnx.int8.1.data"]   # nothing left behind


class _Failing(DataFile):
    """Writes one tensor, then the disk is full."""

    def adopt(self, tensor, base_dir):
        if getattr(self, "_wrote", False):
            raise OSError("disk full")
        self._wrote = True
        return super().adopt(tensor, base_dir)


@pytest.mark.skipif(not os.environ.get("EDGESPEC_LARGE_TESTS"), reason="writes 7 GB and needs about 14 GB of memory: "
                    "set EDGESPEC_LARGE_TESTS=1 to run")
def test_weight_over_2gib_exports(tmp_path):
    """A Llama whose embedding alone is 2.3 GB (vocabulary 140,000 x hidden 4096, fp32) exports,
    validates and generates, fp32 and int8. Before DataFile the fp32 export crashed in onnx's
    make_graph ("Failed to serialize proto")."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    import tiny_models
    from edgespec.export.pipeline import ExportOptions, export_bundle

    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=140_000, hidden_size=4096, intermediate_size=256, num_hidden_layers=1,
                      num_attention_heads=32, num_key_value_heads=8, max_position_embeddings=128,
                      bos_token_id=3, eos_token_id=1, pad_token_id=0, tie_word_embeddings=True)
    ckpt = tiny_models._save(LlamaForCausalLM(cfg).eval(), tmp_path / "ckpt")
    for quant in ("none", "int8"):
        out = tmp_path / quant
        m = export_bundle(ckpt, out, options=ExportOptions(quantize_target=quant), progress=None)
        assert m.target.quantization == ("none" if quant == "none" else "int8-rowwise")
        assert max(p.stat().st_size for p in (out / "target").iterdir()) > 2 << 30
