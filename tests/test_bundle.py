"""Bundle loading: manifest versions, missing/corrupt/LFS files, unsafe ONNX external data."""
from __future__ import annotations

import json
import os

import pytest

from edgespec import contract
from edgespec.bundle import load_bundle, onnx_external_data_locations
from edgespec.errors import BundleError, UnsafeFileError
from tiny_models import external_data_model

pytestmark = pytest.mark.slow


def test_loads_good_bundles(tiny_bundle):
    for arch in ("gpt2", "t5"):
        m = load_bundle(tiny_bundle(arch))
        assert m.target.kind == (contract.KIND_SEQ2SEQ if arch == "t5" else contract.KIND_DECODER)
        assert m.draft is not None and m.shared_vocab_size == 80


def test_missing_bundle_and_manifest(tmp_path, bundle_copy):
    with pytest.raises(BundleError, match="does not exist"):
        load_bundle(tmp_path / "nope")
    b = bundle_copy()
    (b / contract.MANIFEST_NAME).unlink()
    with pytest.raises(BundleError, match="not an edgespec bundle"):
        load_bundle(b)
    with pytest.raises(BundleError, match=r"is the target/ folder inside a bundle; pass the bundle folder itself"):
        load_bundle(bundle_copy("t5") / "target")


def test_unknown_schema_version(bundle_copy):
    b = bundle_copy()
    data = json.loads((b / contract.MANIFEST_NAME).read_text())
    data["schema_version"] = 99
    (b / contract.MANIFEST_NAME).write_text(json.dumps(data))
    with pytest.raises(BundleError, match=r"version 99 is newer than this edgespec reads \(at most 1\); upgrade edgespec"):
        load_bundle(b)
    data["schema_version"] = 0  # older than any this edgespec reads: re-export
    (b / contract.MANIFEST_NAME).write_text(json.dumps(data))
    with pytest.raises(BundleError, match=r"version 0 is not supported.*supported: 1.*re-export"):
        load_bundle(b)
    data["schema_version"] = "1"  # a string: said "version '1' is not supported (supported: 1)"
    (b / contract.MANIFEST_NAME).write_text(json.dumps(data))
    with pytest.raises(BundleError, match=r"schema_version is the string '1'; it must be the integer 1 \(no quotes\)"):
        load_bundle(b)
    for value, shown in ((True, "true"), (1.0, "1.0"), (2.0, "2.0")):  # true and 1.0 loaded as 1; 2.0 was "re-export"
        data["schema_version"] = value
        (b / contract.MANIFEST_NAME).write_text(json.dumps(data))
        with pytest.raises(BundleError, match=rf"schema_version is {shown}, not an integer; write it as an integer "
                                              r"\(this edgespec reads 1\)"):
            load_bundle(b)
    data["schema_version"] = None  # null or absent: said "version None is not supported"
    for manifest, shown in ((data, "null"), ({k: v for k, v in data.items() if k != "schema_version"}, "missing")):
        (b / contract.MANIFEST_NAME).write_text(json.dumps(manifest))
        with pytest.raises(BundleError, match=rf"schema_version is {shown}; an edgespec manifest names its version"):
            load_bundle(b)


def test_manifest_edited_by_hand(bundle_copy):
    """A byte-order mark (Windows editors write one) is read past; a count written as a string or a
    fraction is refused (int() took "17" and 17.9)."""
    b = bundle_copy()
    raw = (b / contract.MANIFEST_NAME).read_bytes()
    (b / contract.MANIFEST_NAME).write_bytes(b"\xef\xbb\xbf" + raw)
    assert load_bundle(b).opset == json.loads(raw)["opset"]
    for key, value in (("opset", "17"), ("opset", 17.5), ("shared_vocab_size", True)):
        (b / contract.MANIFEST_NAME).write_text(json.dumps({**json.loads(raw), key: value}))
        with pytest.raises(BundleError, match=rf"{key} must be an integer, got {json.dumps(value)}"):
            load_bundle(b)


def test_malformed_manifest(bundle_copy):
    b = bundle_copy()
    (b / contract.MANIFEST_NAME).write_text("{not json")
    with pytest.raises(BundleError, match="not valid JSON"):
        load_bundle(b)
    data = {"schema_version": 1, "models": {"target": {"path": "target"}}}
    (b / contract.MANIFEST_NAME).write_text(json.dumps(data))
    with pytest.raises(BundleError, match="malformed"):
        load_bundle(b)


def test_missing_onnx_file(bundle_copy):
    b = bundle_copy("t5")
    (b / "draft" / contract.SEQ2SEQ_DECODER_WITH_PAST_FILE).unlink()
    with pytest.raises(BundleError, match="missing"):
        load_bundle(b)


def test_truncated_onnx(bundle_copy):
    b = bundle_copy()
    f = b / "target" / contract.DECODER_FILE
    data = f.read_bytes()
    f.write_bytes(data[: len(data) * 2 // 3])
    with pytest.raises(BundleError, match="truncated or corrupt"):
        load_bundle(b)


def test_truncated_external_data(bundle_copy):
    """ONNX Runtime's own message blamed the .onnx file ('Deserialize tensor ... failed')."""
    b = bundle_copy()
    graph = b / "target" / contract.DECODER_FILE
    (data,) = set(onnx_external_data_locations(graph))
    with open(graph.parent / data, "r+b") as fh:
        fh.truncate(100)
    with pytest.raises(BundleError, match=f"external data file '{data}' is truncated .100 bytes"):
        load_bundle(b)


def test_garbage_onnx(bundle_copy):
    b = bundle_copy()
    (b / "target" / contract.DECODER_FILE).write_bytes(b"\xff" * 100)
    with pytest.raises(BundleError, match="corrupt"):
        load_bundle(b)


def test_lfs_pointer(bundle_copy):
    b = bundle_copy()
    (b / "draft" / contract.DECODER_FILE).write_text(
        "version https://git-lfs.github.com/spec/v1\noid sha256:abc\nsize 123\n")
    with pytest.raises(BundleError, match="git lfs pull"):
        load_bundle(b)


def test_lfs_pointer_as_external_data(bundle_copy):
    """A pointer in place of model.onnx.data was called 'truncated': copying it again would not help."""
    b = bundle_copy()
    graph = b / "target" / contract.DECODER_FILE
    (data,) = set(onnx_external_data_locations(graph))
    (graph.parent / data).write_text("version https://git-lfs.github.com/spec/v1\noid sha256:abc\nsize 123\n")
    with pytest.raises(BundleError, match=f"external data file '{data}' is a Git LFS pointer file.*git lfs pull"):
        load_bundle(b)


@pytest.mark.parametrize("location", ["../secret.bin", "/etc/passwd", "sub/../../secret.bin"])
def test_external_data_outside_folder(bundle_copy, location):
    b = bundle_copy()
    (b / "secret.bin").write_bytes(b"\0" * 16)
    external_data_model(b / "target" / contract.DECODER_FILE, location)
    assert onnx_external_data_locations(b / "target" / contract.DECODER_FILE) == [location]
    with pytest.raises(UnsafeFileError, match="outside"):
        load_bundle(b)


@pytest.mark.parametrize("where", ["sparse_value", "sparse_initializer", "function_attribute", "training_info"])
def test_external_data_in_every_place_a_tensor_can_sit(tmp_path, where):
    """A Constant's sparse_value (AttributeProto field 22) with external data passed the check unseen,
    and ONNX Runtime read it: from outside the folder through a hard link even on 1.32 (a review's
    find). Every place ONNX keeps a tensor is walked now."""
    from onnx import TensorProto, helper

    from edgespec.bundle import check_onnx_file

    values = TensorProto(name="v", data_type=TensorProto.FLOAT, dims=[4])
    values.data_location = TensorProto.EXTERNAL
    for k, v in (("location", "../secret.bin"), ("offset", "0"), ("length", "16")):
        e = values.external_data.add()
        e.key, e.value = k, v
    sparse = helper.make_sparse_tensor(values, helper.make_tensor("i", TensorProto.INT64, [4], [0, 1, 2, 3]), [1, 4])
    out = helper.make_tensor_value_info("y", TensorProto.FLOAT, [1, 4])
    node = helper.make_node("Constant", [], ["y"], sparse_value=sparse) if where == "sparse_value" else \
        helper.make_node("Identity", ["v"], ["y"])
    graph = helper.make_graph([node], "g", [], [out], sparse_initializer=[sparse] if where == "sparse_initializer" else [])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    if where == "function_attribute":
        fn = helper.make_function("custom", "f", [], ["z"], [helper.make_node("Constant", [], ["z"], value_float=1.0)],
                                  [helper.make_opsetid("", 17)])
        fn.attribute_proto.append(helper.make_attribute("w", values))
        model.functions.append(fn)
    elif where == "training_info":
        model.training_info.add().initialization.CopyFrom(helper.make_graph([], "init", [], [], initializer=[values]))
    path = tmp_path / "model" / "decoder_model.onnx"
    path.parent.mkdir()
    path.write_bytes(model.SerializeToString())
    assert onnx_external_data_locations(path) == ["../secret.bin"]
    with pytest.raises(UnsafeFileError, match="outside its model folder"):
        check_onnx_file(path)


def test_static_kv_graphs_refused_on_an_onnxruntime_that_computes_them_wrongly(tiny_bundle, monkeypatch):
    """onnxruntime 1.18-1.19 load the static-KV graphs but get every verify call (k > 1 tokens over a
    cache) wrong while plain steps are right: speculative output would silently not be the target's
    (a review's find; 1.17 failed to load them, advised to re-export). pyproject asks for >= 1.20."""
    import onnxruntime

    import edgespec

    bundle = tiny_bundle("llama")
    assert edgespec.load(bundle).manifest.target.kv_layout == contract.KV_STATIC
    for old in ("1.19.2", "1.17.3"):
        monkeypatch.setattr(onnxruntime, "__version__", old)
        with pytest.raises(BundleError, match=rf"static-KV graph .GroupQueryAttention., which needs onnxruntime >= 1.20; "
                                              rf"this is {old}.*pip install -U 'onnxruntime>=1.20'"):
            edgespec.load(bundle)
    monkeypatch.setattr(onnxruntime, "__version__", "1.20.1")
    edgespec.load(bundle)


def test_external_data_symlink_and_hardlink(bundle_copy, tmp_path):
    b = bundle_copy()
    secret = tmp_path / "secret.bin"
    secret.write_bytes(b"\0" * 16)
    model = b / "target" / contract.DECODER_FILE
    external_data_model(model, "weights.bin")
    os.symlink(secret, b / "target" / "weights.bin")
    with pytest.raises(UnsafeFileError, match="symbolic link"):
        load_bundle(b)
    (b / "target" / "weights.bin").unlink()
    os.link(secret, b / "target" / "weights.bin")
    with pytest.raises(UnsafeFileError, match="hard link"):
        load_bundle(b)
    (b / "target" / "weights.bin").unlink()
    (b / "target" / "weights.bin").write_bytes(b"\0" * 16)
    load_bundle(b)  # a plain file next to the model is fine


def test_external_data_missing(bundle_copy):
    b = bundle_copy()
    external_data_model(b / "target" / contract.DECODER_FILE, "weights.bin")
    with pytest.raises(BundleError, match="missing"):
        load_bundle(b)


def test_outputs_keep_the_umask_permissions(tiny_bundle, tmp_path):
    """Bundles and JSON reports are staged with tempfile (private: 0700 / 0600) and renamed into
    place; they must end up as readable as any folder or file the user makes, and strict JSON."""
    import stat

    from edgespec.report import write_json

    mask = os.umask(0o022)
    os.umask(mask)
    bundle = tiny_bundle("gpt2")
    for p in [bundle, *bundle.rglob("*")]:   # onnx writes external weights (model.onnx.data) 0600
        assert stat.S_IMODE(p.stat().st_mode) == (0o777 if p.is_dir() else 0o666) & ~mask, p
    assert any(p.name.endswith(".data") for p in bundle.rglob("*"))
    write_json(tmp_path / "r.json", {"alpha": float("nan"), "runs": [1.5, float("inf")]})
    assert stat.S_IMODE((tmp_path / "r.json").stat().st_mode) == 0o666 & ~mask
    assert json.loads((tmp_path / "r.json").read_text(), parse_constant=lambda c: pytest.fail(c)) == {
        "alpha": None, "runs": [1.5, None]}
