"""edgespec export: tiny GPT-2 / Llama (GQA) / T5 pairs, manifest contents, and every bad input."""
from __future__ import annotations

import json
import shutil
from pathlib import Path

import numpy as np
import pytest

import tiny_models
from edgespec import contract
from edgespec.cli import main
from edgespec.errors import (CheckpointError, EdgeSpecWarning, OutputExistsError, TokenizerMismatchError, UnsafeFileError,
                             UnsupportedArchitectureError, ValidationError)
from edgespec.export.pipeline import ExportOptions, export_bundle

pytestmark = pytest.mark.slow


def _manifest(bundle: Path) -> dict:
    return json.loads((bundle / contract.MANIFEST_NAME).read_text())


@pytest.mark.parametrize("arch", ["gpt2", "llama", "t5"])
def test_pair_export_manifest(tiny_bundle, arch):
    bundle = tiny_bundle(arch)
    m = _manifest(bundle)
    assert m["schema_version"] == contract.SCHEMA_VERSION
    assert set(m["models"]) == {"target", "draft"}
    kind = contract.KIND_SEQ2SEQ if arch == "t5" else contract.KIND_DECODER
    for role, model in m["models"].items():
        assert model["kind"] == kind and model["model_type"] == arch
        assert model["files"] == contract.GRAPH_FILES[kind]
        for f in [*model["files"].values(), contract.TOKENIZER_FILE]:
            assert (bundle / role / f).is_file()
        assert model["dtype"] == "fp32" and model["quantization"] == "none"
        assert model["tokenizer_size"] == tiny_models.TOKENIZER_SIZE
        assert model["eos_token_ids"] == [1]
        assert model["parameter_bytes"]["per_forward"] > 0
        assert model["parameter_bytes"]["total"] >= model["parameter_bytes"]["per_forward"]
        v = model["validation"]["fp32"]
        assert v["max_abs_diff"] < v["atol"]
        stages = v["stages"]
        assert {"prefill", "step_1", "step_4"} <= set(stages)
        assert contract.LOGITS in stages["step_4"]
    t, d = m["models"]["target"], m["models"]["draft"]
    assert (t["vocab_size"], d["vocab_size"]) == (96, 80)
    assert m["shared_vocab_size"] == 80  # embedding rows both models have (generation samples the tokenizer's ids)
    assert m["tokenizer_check"]["identical_token_to_id_mapping"] is True
    assert t["num_layers"] == 2 and d["num_layers"] == 1
    if arch == "llama":
        assert (t["num_kv_heads"], t["head_size"]) == (2, 16)  # 4 query heads, 2 KV heads
        assert t["kv_layout"] == d["kv_layout"] == "static"  # edgespec's in-place KV graph
    if arch == "t5":
        assert t["decoder_start_token_id"] == 0 and "encoder" in t["parameter_bytes"]
    assert not [p for p in bundle.parent.iterdir() if ".partial-" in p.name]


def test_single_model_cli_and_int8(tiny_checkpoints, tmp_path, capsys):
    target, _ = tiny_checkpoints("llama")
    out = tmp_path / "single"
    assert main(["export", "--model", str(target), "--out", str(out), "--quantize", "int8", "--quiet"]) == 0
    m = _manifest(out)
    assert set(m["models"]) == {"target"}
    t = m["models"]["target"]
    assert t["quantization"] == "int8-rowwise" and "int8" in t["validation"]
    assert m["shared_vocab_size"] == t["vocab_size"]
    assert f"; {tiny_models.TOKENIZER_SIZE} token ids (embedding rows: target 96)" in capsys.readouterr().out
    # each model's rows, named (the line gave the smaller of the two, which read as the target's)
    draft = tiny_models.make_llama(tmp_path / "d80", layers=1, vocab_size=80, seed=2)
    assert main(["export", "--target", str(target), "--draft", str(draft), "--out", str(tmp_path / "pair"), "--quiet"]) == 0
    assert "token ids (embedding rows: target 96, draft 80)" in capsys.readouterr().out


def test_per_model_quantization(tiny_checkpoints, tiny_bundle, tmp_path):
    target, draft = tiny_checkpoints("gpt2")
    out = tmp_path / "q"
    assert main(["export", "--target", str(target), "--draft", str(draft), "--out", str(out),
                 "--quantize-draft", "int8", "--quiet"]) == 0
    m = _manifest(out)
    assert m["models"]["target"]["quantization"] == "none"
    assert m["models"]["draft"]["quantization"] == "int8-dynamic"
    # int8 weights: fewer bytes read per forward than the same fp32 draft
    fp32 = _manifest(tiny_bundle("gpt2"))["models"]["draft"]["parameter_bytes"]["per_forward"]
    assert m["models"]["draft"]["parameter_bytes"]["per_forward"] < fp32


def test_dynamic_int8_of_a_large_graph_keeps_its_weights_outside(tiny_checkpoints, tmp_path, monkeypatch):
    """Above EXTERNAL_DATA_ABOVE (1 GB) the quantized graph is written with external data (a
    protobuf cannot hold 2 GB: a large-vocabulary draft crashed in the quantizer's save); the
    threshold is lowered here so a tiny draft takes that path."""
    import edgespec
    from edgespec.bundle import onnx_external_data_locations
    from edgespec.export import quantize
    from edgespec.outputs import BUNDLE_FILES, foreign_names

    monkeypatch.setattr(quantize, "EXTERNAL_DATA_ABOVE", 0)
    target, draft = tiny_checkpoints("llama")
    out = tmp_path / "q"
    export_bundle(target, out, draft=draft, options=ExportOptions(quantize_draft="int8"), progress=None)
    graph = out / "draft" / contract.DECODER_FILE
    assert onnx_external_data_locations(graph) and _manifest(out)["models"]["draft"]["quantization"] == "int8-dynamic"
    assert {p.name for p in graph.parent.iterdir() if p.name.startswith(graph.stem)} == \
        {graph.name, *onnx_external_data_locations(graph)}                # the fp32 weights' file is gone
    # --overwrite knows the int8 data file (model.onnx.int8.data) as the export's own, not a user's .onnx beside it
    assert foreign_names(out, BUNDLE_FILES) == []
    shutil.copy(graph, graph.parent / "my-finetune.onnx")  # (it names the same data file: that stays the export's)
    (graph.parent / "old.onnx.data").write_text("mine")
    assert foreign_names(out, BUNDLE_FILES) == ["draft/my-finetune.onnx", "draft/old.onnx.data"]
    (graph.parent / "my-finetune.onnx").unlink()
    (graph.parent / "old.onnx.data").unlink()
    export_bundle(target, out, draft=draft, options=ExportOptions(quantize_draft="int8", overwrite=True), progress=None)
    eng = edgespec.load(out)
    ids = [5, 9, 4, 7]
    assert eng.generate(ids, max_new_tokens=12, temperature=0).ids == \
        eng.generate(ids, max_new_tokens=12, temperature=0, use_draft=False).ids


def test_a_dangling_weights_link_and_a_config_without_vocab_size(tiny_checkpoints, tmp_path, capsys):
    """A model.safetensors that is a dangling link (a hub cache cleaned under a --local-dir download)
    took a FileNotFoundError traceback; a pair whose config.json has no vocab_size was refused for "0
    embedding rows" (the model class's default applies), and a null one took a TypeError traceback
    (a review's finds)."""
    from edgespec.export.pipeline import _config_rows
    from edgespec.export.tokenizer_check import shared_vocab

    target, draft = tiny_checkpoints("llama")
    dangling = tmp_path / "dangling"
    shutil.copytree(draft, dangling)
    (dangling / "model.safetensors").unlink()
    (dangling / "model.safetensors").symlink_to(tmp_path / "gone.safetensors")
    _cli_fails(["export", "--model", str(dangling), "--out", str(tmp_path / "o-d")], capsys, "a dangling link or not a file")
    assert _nothing_written(tmp_path / "o-d")
    # vocab_size absent or null: not known before the export (the graphs' rows are checked after it)
    assert _config_rows({}) is None and _config_rows({"vocab_size": None}) is None and _config_rows({"vocab_size": 64}) == 64
    vocab = {"a": 0, "b": 1}
    assert shared_vocab(vocab, vocab, None, None)["identical_token_to_id_mapping"]
    null = tmp_path / "null-vocab"
    shutil.copytree(draft, null)
    cfg = json.loads((null / "config.json").read_text())
    cfg["vocab_size"] = None
    (null / "config.json").write_text(json.dumps(cfg))
    _cli_fails(["export", "--target", str(target), "--draft", str(null), "--out", str(tmp_path / "o-n")], capsys, "error:")
    assert _nothing_written(tmp_path / "o-n")


def _nothing_written(out: Path) -> bool:
    return not out.exists() and not [p for p in out.parent.iterdir() if p.name.startswith(f".{out.name}.")]


def _cli_fails(argv, capsys, needle: str) -> None:
    rc = main(argv)
    err = capsys.readouterr().err
    assert rc != 0
    assert needle in err, err
    assert "Traceback" not in err


def test_missing_folder(tmp_path, capsys):
    out = tmp_path / "out"
    with pytest.raises(CheckpointError, match="does not exist"):
        export_bundle(tmp_path / "nope", out, progress=None)
    _cli_fails(["export", "--model", str(tmp_path / "nope"), "--out", str(out)], capsys, "does not exist")
    _cli_fails(["export", "--draft", str(tmp_path / "nope"), "--out", str(out)], capsys, "--draft DIR needs the target")
    _cli_fails(["export", "--out", str(out)], capsys, "nothing to export")
    assert _nothing_written(out)


def test_config_with_more_or_fewer_layers_than_the_weights(tiny_checkpoints, tmp_path, capsys):
    """transformers fills missing weights with random values and drops unused ones, warning only;
    the export would then validate a random model against itself. Both are typed errors."""
    target, _ = tiny_checkpoints("llama")
    layers = json.loads((target / "config.json").read_text())["num_hidden_layers"]
    for name, n, needle in (("more", layers + 1, f"has no weights for model.layers.{layers}."),
                            ("fewer", layers - 1, f"has weights the model has no place for: model.layers.{layers - 1}.")):
        bad = tmp_path / name
        shutil.copytree(target, bad)
        cfg = json.loads((bad / "config.json").read_text())
        cfg["num_hidden_layers"] = n
        (bad / "config.json").write_text(json.dumps(cfg))
        out = tmp_path / f"o-{name}"
        with pytest.raises(CheckpointError, match="config.json belongs to them"):
            export_bundle(bad, out, progress=None)
        _cli_fails(["export", "--model", str(bad), "--out", str(out)], capsys, needle)
        assert _nothing_written(out)
    typed = tmp_path / "typed"  # a value of the wrong type: transformers raises TypeError
    shutil.copytree(target, typed)
    cfg = json.loads((typed / "config.json").read_text())
    (typed / "config.json").write_text(json.dumps({**cfg, "num_hidden_layers": str(layers)}))
    _cli_fails(["export", "--model", str(typed), "--out", str(tmp_path / "o-typed")], capsys,
               "check the values in config.json (one has the wrong type or is missing)")


def test_a_checkpoint_without_its_lm_head(tiny_checkpoints, tmp_path, capsys):
    """A LlamaModel or LlamaForSequenceClassification checkpoint (no lm_head) was refused with the
    advice that config.json does not describe the weights (a trial's find); so was an untied model
    whose lm_head.weight is missing. Each now says what is missing and what to export instead."""
    from safetensors.torch import load_file, save_file
    from transformers import LlamaConfig, LlamaForSequenceClassification, LlamaModel

    target, _ = tiny_checkpoints("llama")
    cfg = LlamaConfig(**{k: v for k, v in json.loads((target / "config.json").read_text()).items()
                         if k not in ("architectures", "model_type", "transformers_version")})
    for cls, needle in ((LlamaModel, "holds a LlamaModel checkpoint (config.json \"architectures\"), which has no "
                                     "language-model head: edgespec generates tokens, so export the model's causal-LM "
                                     "checkpoint (architectures such as LlamaForCausalLM"),
                        (LlamaForSequenceClassification, "holds a LlamaForSequenceClassification checkpoint (config.json "
                                                         "\"architectures\"), which has no language-model head (its "
                                                         "score.weight belongs to a head of another task)")):
        folder = tmp_path / cls.__name__
        cls(cfg).save_pretrained(folder, safe_serialization=True)
        shutil.copy(target / "tokenizer.json", folder)
        _cli_fails(["export", "--model", str(folder), "--out", str(tmp_path / "o")], capsys, needle)
        assert _nothing_written(tmp_path / "o")
    untied = tmp_path / "untied"  # tie_word_embeddings false, and no lm_head.weight in the file
    shutil.copytree(target, untied)
    w = load_file(untied / "model.safetensors")
    del w["lm_head.weight"]
    save_file(w, untied / "model.safetensors", metadata={"format": "pt"})
    with pytest.raises(CheckpointError, match="has no weights for lm_head.weight and its config.json says "
                                              "tie_word_embeddings false"):
        export_bundle(untied, tmp_path / "o", progress=None)


def test_quiet_silences_transformers_too(tiny_checkpoints, tmp_path, capsys):
    """--quiet: no progress line, and no progress bar of transformers' over a sharded checkpoint
    (which shows without --quiet)."""
    from transformers import AutoModelForCausalLM

    target, _ = tiny_checkpoints("llama")
    sharded = tmp_path / "sharded"
    shutil.copytree(target, sharded)
    (sharded / "model.safetensors").unlink()
    AutoModelForCausalLM.from_pretrained(target).save_pretrained(sharded, max_shard_size="20KB", safe_serialization=True)
    assert len(list(sharded.glob("*.safetensors"))) > 1
    assert main(["export", "--model", str(sharded), "--out", str(tmp_path / "loud")]) == 0
    assert "Loading checkpoint shards" in capsys.readouterr().err
    assert main(["export", "--model", str(sharded), "--out", str(tmp_path / "quiet"), "--quiet"]) == 0
    assert capsys.readouterr().err == ""


def test_missing_config_and_tokenizer(tiny_checkpoints, tmp_path):
    target, _ = tiny_checkpoints("gpt2")
    no_cfg = tmp_path / "no_cfg"
    shutil.copytree(target, no_cfg)
    (no_cfg / "config.json").unlink()
    with pytest.raises(CheckpointError, match="config.json"):
        export_bundle(no_cfg, tmp_path / "o1", progress=None)
    no_tok = tmp_path / "no_tok"
    shutil.copytree(target, no_tok)
    (no_tok / "tokenizer.json").unlink()
    with pytest.raises(CheckpointError, match="tokenizer.json"):
        export_bundle(no_tok, tmp_path / "o2", progress=None)
    assert _nothing_written(tmp_path / "o1") and _nothing_written(tmp_path / "o2")


def test_pickle_only_weights_refused(tiny_checkpoints, tmp_path, capsys):
    target, _ = tiny_checkpoints("gpt2")
    ck = tmp_path / "pickle"
    shutil.copytree(target, ck)
    (ck / "model.safetensors").rename(ck / "pytorch_model.bin")
    with pytest.raises(UnsafeFileError, match="pickle"):
        export_bundle(ck, tmp_path / "o", progress=None)
    _cli_fails(["export", "--model", str(ck), "--out", str(tmp_path / "o")], capsys, "safetensors")
    assert _nothing_written(tmp_path / "o")


def test_unsupported_architecture(tiny_checkpoints, tmp_path):
    target, _ = tiny_checkpoints("gpt2")
    ck = tmp_path / "bert"
    shutil.copytree(target, ck)
    cfg = json.loads((ck / "config.json").read_text())
    cfg["model_type"] = "bert"
    (ck / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(UnsupportedArchitectureError, match="gpt2.*llama|llama.*t5"):
        export_bundle(ck, tmp_path / "o", progress=None)
    del cfg["model_type"]  # no model_type at all: a damaged config, not an unsupported architecture None
    (ck / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(CheckpointError, match=r"config.json names no model_type; .*save the checkpoint with save_pretrained"):
        export_bundle(ck, tmp_path / "o", progress=None)
    for damaged, needle in (({**cfg, "model_type": ["llama"]}, r"model_type \['llama'\], not a string"),
                            ([cfg], "holds a JSON list, not an object")):  # (both raised a TypeError traceback)
        (ck / "config.json").write_text(json.dumps(damaged))
        with pytest.raises(CheckpointError, match=needle):
            export_bundle(ck, tmp_path / "o", progress=None)
    assert not (tmp_path / "o").exists()


def test_special_token_ids_of_the_config(tiny_checkpoints, tmp_path):
    """pad_token_id -1 (old Llama configs: no padding token) is no token; a list or a string is
    refused before the export (the manifest refused both after all the work, naming a deleted folder)."""
    for arch, key, value in (("gpt2", "bos_token_id", [1, 2]), ("gpt2", "pad_token_id", "0"),
                             ("t5", "decoder_start_token_id", -1)):
        ck = tmp_path / arch
        if not ck.exists():
            shutil.copytree(tiny_checkpoints(arch)[0], ck)
        cfg = json.loads((ck / "config.json").read_text())
        (ck / "config.json").write_text(json.dumps({**cfg, key: value}))
        with pytest.raises(CheckpointError, match=rf"{key} .* is not a token id; set it to one id, or null"):
            export_bundle(ck, tmp_path / "o", progress=None)
        assert not (tmp_path / "o").exists()
        (ck / "config.json").write_text(json.dumps(cfg))
    ck = tmp_path / "gpt2"
    cfg = json.loads((ck / "config.json").read_text())
    # the file a bad value came from is named; a position count written as a string is not "missing"
    (ck / "generation_config.json").write_text(json.dumps({"eos_token_id": "2"}))
    with pytest.raises(CheckpointError, match=r"generation_config.json: eos_token_id '2' is not a token id .*fix it in "
                                              r"generation_config.json"):
        export_bundle(ck, tmp_path / "o", progress=None)
    (ck / "generation_config.json").unlink()
    (ck / "config.json").write_text(json.dumps({**cfg, "n_positions": "128"}))
    with pytest.raises(CheckpointError, match=r"n_positions '128' is not a count of positions"):
        export_bundle(ck, tmp_path / "o", progress=None)
    (ck / "config.json").write_text(json.dumps({**cfg, "pad_token_id": -1, "bos_token_id": 0, "eos_token_id": 10**6}))
    with pytest.warns(EdgeSpecWarning, match=r"target: eos_token_id \[1000000\] is not among the tokenizer's \d+ ids"):
        export_bundle(ck, tmp_path / "o", progress=None)
    model = _manifest(tmp_path / "o")["models"]["target"]
    assert model["pad_token_id"] is None and model["bos_token_id"] == 0


def test_output_exists_and_overwrite(tiny_checkpoints, tmp_path, capsys):
    target, _ = tiny_checkpoints("gpt2")
    out = tmp_path / "busy"
    out.mkdir()
    (out / "keep.txt").write_text("x")
    with pytest.raises(OutputExistsError, match="--overwrite"):
        export_bundle(target, out, progress=None)
    assert (out / "keep.txt").exists()
    _cli_fails(["export", "--model", str(target), "--out", str(out)], capsys, "not empty")
    # --overwrite replaces a bundle, never a folder of other files
    with pytest.raises(OutputExistsError, match="not an edgespec bundle"):
        export_bundle(target, out, options=ExportOptions(overwrite=True), progress=None)
    _cli_fails(["export", "--model", str(target), "--out", str(out), "--overwrite"], capsys, "replaces only an edgespec bundle")
    assert (out / "keep.txt").read_text() == "x"
    bundle = tmp_path / "bundle"
    export_bundle(target, bundle, progress=None)
    (bundle / "notes.txt").write_text("mine")  # a bundle with something else in it: never deleted with it
    with pytest.raises(OutputExistsError, match=r"also holds what this command did not write \(notes.txt\)"):
        export_bundle(target, bundle, options=ExportOptions(overwrite=True), progress=None)
    assert (bundle / "notes.txt").read_text() == "mine"
    (bundle / "notes.txt").unlink()
    export_bundle(target, bundle, options=ExportOptions(overwrite=True), progress=None)
    assert (bundle / contract.MANIFEST_NAME).is_file()


def test_overwrite_keeps_files_inside_a_bundles_model_folders(tiny_checkpoints, tiny_bundle, tmp_path, capsys):
    """--overwrite checked only the bundle's top-level names, then deleted a user's files put in its
    target/ or draft/ with it."""
    from edgespec.outputs import BUNDLE_FILES, foreign_names

    for arch in ("gpt2", "llama", "t5"):  # an export's own files, every layout: its --overwrite replaces them
        assert foreign_names(tiny_bundle(arch), BUNDLE_FILES) == [], arch
    target, draft = tiny_checkpoints("gpt2")
    bundle = tmp_path / "bundle"
    export_bundle(target, bundle, draft=draft, progress=None)
    (bundle / "target" / "notes.txt").write_text("mine")
    (bundle / "draft" / "mine").mkdir()
    (bundle / "draft" / "mine" / "w.bin").write_bytes(b"1")
    with pytest.raises(OutputExistsError, match=r"did not write \(draft/mine, target/notes.txt\)"):
        export_bundle(target, bundle, draft=draft, options=ExportOptions(overwrite=True), progress=None)
    _cli_fails(["export", "--model", str(target), "--out", str(bundle), "--overwrite"], capsys, "target/notes.txt")
    assert (bundle / "target" / "notes.txt").read_text() == "mine" and (bundle / "draft" / "mine" / "w.bin").exists()
    shutil.rmtree(bundle / "draft" / "mine")
    (bundle / "target" / "notes.txt").unlink()
    export_bundle(target, bundle, draft=draft, options=ExportOptions(overwrite=True), progress=None)
    assert (bundle / contract.MANIFEST_NAME).is_file()


def test_overwrite_repairs_a_bundle_whose_graph_is_damaged_or_gone(tiny_checkpoints, tmp_path):
    """A truncated or deleted model.onnx names no external data, so its model.onnx.data was called
    the user's and `export --overwrite`, the fix every load error gives, refused the bundle."""
    from edgespec.outputs import BUNDLE_FILES, foreign_names

    target, draft = tiny_checkpoints("llama")
    bundle = tmp_path / "bundle"
    export_bundle(target, bundle, draft=draft, progress=None)
    assert (bundle / "target" / "model.onnx.data").is_file()
    (bundle / "draft" / "model.onnx").unlink()
    with open(bundle / "target" / "model.onnx", "r+b") as fh:
        fh.truncate(100)
    (bundle / "target" / "model.onnx.backup.data").write_bytes(b"mine")   # not a name the exporter writes
    assert foreign_names(bundle, BUNDLE_FILES) == ["target/model.onnx.backup.data"]
    (bundle / "target" / "model.onnx.backup.data").unlink()
    export_bundle(target, bundle, draft=draft, options=ExportOptions(overwrite=True), progress=None)
    from edgespec.api import load

    assert load(bundle, threads=1).generate([5, 9], max_new_tokens=3, temperature=0).ids


def test_an_empty_output_folder_keeps_its_mode_and_a_mount_point_is_refused(tmp_path, monkeypatch, tiny_checkpoints):
    """An empty --out the user made was removed and replaced by the new folder: its mode went. A
    mount point cannot be renamed onto (EBUSY) nor into (EXDEV): it failed with a traceback after
    all the work; it is refused before it."""
    import errno
    import os

    from edgespec import outputs
    from edgespec.errors import OutputPathError

    def made(name: str) -> Path:
        new = tmp_path / name
        new.mkdir()
        (new / "edgespec.json").write_text("{}")
        return new

    dest = tmp_path / "out"
    dest.mkdir()
    dest.chmod(0o750)
    outputs.swap_into_place(made("new"), dest, False, "edgespec.json", "an edgespec bundle")
    assert (dest / "edgespec.json").is_file() and dest.stat().st_mode & 0o7777 == 0o750
    mount = tmp_path / "mount"
    mount.mkdir()
    real_ismount, real_rmdir = os.path.ismount, os.rmdir
    monkeypatch.setattr(outputs.os.path, "ismount", lambda p: Path(p) == mount or real_ismount(p))
    target, _ = tiny_checkpoints("gpt2")
    with pytest.raises(OutputPathError, match=r"is a mount point; .*give a folder inside it \('.*mount/out'\)"):
        export_bundle(target, mount, progress=None)
    monkeypatch.setattr(outputs.os.path, "ismount", real_ismount)

    def busy(path, *a, **k):  # (it became one while the command ran)
        if Path(path) == mount:
            raise OSError(errno.EBUSY, "Device or resource busy", str(path))
        return real_rmdir(path, *a, **k)

    monkeypatch.setattr(outputs.os, "rmdir", busy)
    new = made("new2")
    with pytest.raises(OutputPathError, match="is a mount point"):
        outputs.swap_into_place(new, mount, False, "edgespec.json", "an edgespec bundle")
    assert new.is_dir() and os.listdir(mount) == []


def test_owned_names_at_any_depth(tmp_path):
    """The rename's own check (the output may change while a command runs): a file that appeared in
    the old bundle's target/ is refused; one the new export also wrote is its own; a symbolic link is
    judged by its name (replacing the folder removes the link, not what it points to)."""
    from edgespec.errors import OutputExistsError
    from edgespec.export.xla import MANIFEST, WEIGHTS
    from edgespec.outputs import BUNDLE_FILES, foreign_names, swap_into_place

    old, new = tmp_path / "old", tmp_path / "new"
    for root in (old, new):
        (root / "target" / "xla").mkdir(parents=True)
        for name in ("target/model.onnx", "target/xla/" + WEIGHTS):
            (root / name).write_text("x")
        (root / "edgespec.json").write_text(json.dumps({"models": {"target": {"path": "target", "files": {"decoder": "model.onnx"}}}}))
        (root / "target" / "xla" / MANIFEST).write_text(json.dumps({"artifacts": {"prefill": {"16": {"file": "prefill_16.bin"}}}}))
        (root / "target" / "xla" / "prefill_16.bin").write_text("x")
    # an XLA artifact is the export's own where xla.json lists it; a graph's data file where the graph names it
    (old / "target" / "xla" / "prefill_32.bin").write_text("mine")
    # (model.onnx here is no graph: it names nothing; only the data names the exporter writes beside it are its own)
    (old / "target" / "model.onnx.mine.data").write_text("mine")
    (old / "target" / "encoder_model.onnx").mkdir()  # a folder of a graph's name is not the export's
    (old / "target" / "decoder_model.onnx").write_text("mine")  # nor a graph the manifest does not list
    (old / "target" / ".xla.partial-k3").mkdir()  # a killed XLA export's work folder is
    (old / "target" / ".xla.partial-k3" / "prefill_16.bin").write_text("x")
    assert foreign_names(old, BUNDLE_FILES) == ["target/decoder_model.onnx", "target/encoder_model.onnx",
                                                "target/model.onnx.mine.data", "target/xla/prefill_32.bin"]
    (old / "target" / "encoder_model.onnx").rmdir()
    (old / "target" / "decoder_model.onnx").unlink()
    (old / "target" / "xla" / "prefill_32.bin").unlink()
    (old / "target" / "model.onnx.mine.data").unlink()
    (new / "target" / "vocab.bpe").write_text("new")
    (old / "target" / "vocab.bpe").write_text("old")   # not an owned name, but the new export writes it too
    (old / "target" / "xla" / "notes.md").write_text("mine")
    (tmp_path / "elsewhere").mkdir()
    (tmp_path / "elsewhere" / "keep.txt").write_text("mine")
    (old / "draft").symlink_to(tmp_path / "elsewhere")
    assert foreign_names(old, BUNDLE_FILES) == ["target/vocab.bpe", "target/xla/notes.md"]
    with pytest.raises(OutputExistsError, match=r"did not write \(target/xla/notes.md\)"):
        swap_into_place(new, old, True, "edgespec.json", "an edgespec bundle", owned=BUNDLE_FILES)
    assert (old / "target" / "xla" / "notes.md").exists() and (new / "target" / "vocab.bpe").exists()
    (old / "target" / "xla" / "notes.md").unlink()
    swap_into_place(new, old, True, "edgespec.json", "an edgespec bundle", owned=BUNDLE_FILES)
    assert (old / "target" / "vocab.bpe").read_text() == "new" and not (old / "draft").exists()
    assert (tmp_path / "elsewhere" / "keep.txt").read_text() == "mine"


def test_non_finite_weights_are_named(tiny_checkpoints, tmp_path, capsys):
    """NaN or inf weights made NaN logits on both sides, and the validation advised another graph."""
    from safetensors.numpy import load_file, save_file

    target, _ = tiny_checkpoints("gpt2")
    bad = tmp_path / "bad"
    shutil.copytree(target, bad)
    weights = load_file(str(bad / "model.safetensors"))
    name = next(k for k in sorted(weights) if k.endswith("mlp.c_fc.weight"))
    weights[name][0, :2] = [np.nan, np.inf]
    save_file(weights, str(bad / "model.safetensors"), metadata={"format": "pt"})
    with pytest.raises(CheckpointError, match=rf"NaN or infinite weights: \S*{name} \(2 values\)"):
        export_bundle(bad, tmp_path / "out", progress=None)
    assert not (tmp_path / "out").exists()
    _cli_fails(["export", "--model", str(bad), "--out", str(tmp_path / "out")], capsys, "saved before the training diverged")
    # a bad draft is found before the target's export starts (it was found only after it)
    seen: list[str] = []
    with pytest.raises(CheckpointError, match=rf"{bad}.*NaN or infinite weights"):
        export_bundle(target, tmp_path / "out", draft=bad, progress=seen.append)
    assert seen == [] and not (tmp_path / "out").exists()


def test_corrupt_or_mismatched_weights_fail_before_any_work(tiny_checkpoints, tmp_path, capsys):
    """A truncated or empty safetensors file is found by reading its header, before the target is
    exported; a config.json that does not match the weights is a typed error, not a traceback."""
    target, draft = tiny_checkpoints("llama")
    for name, cut in (("half", 0.5), ("empty", 0.0)):
        bad = tmp_path / name
        shutil.copytree(draft, bad)
        w = bad / "model.safetensors"
        w.write_bytes(w.read_bytes()[: int(w.stat().st_size * cut)])
        out = tmp_path / f"o-{name}"
        steps = []
        with pytest.raises(CheckpointError, match="truncated or corrupt"):
            export_bundle(target, out, draft=bad, progress=steps.append)
        assert steps == [] and _nothing_written(out)
        _cli_fails(["export", "--target", str(target), "--draft", str(bad), "--out", str(out)], capsys, str(w))
    wrong = tmp_path / "wrong-config"
    shutil.copytree(draft, wrong)
    cfg = json.loads((wrong / "config.json").read_text())
    cfg["hidden_size"] *= 2
    (wrong / "config.json").write_text(json.dumps(cfg))
    _cli_fails(["export", "--model", str(wrong), "--out", str(tmp_path / "o-wrong")], capsys, "config.json belongs to these weights")
    assert _nothing_written(tmp_path / "o-wrong")
    # files read after the export are read before it: a broken generation_config.json, too few positions
    gen = tmp_path / "bad-gen"
    shutil.copytree(draft, gen)
    (gen / "generation_config.json").write_text('{"eos_token_id": 1,')
    steps = []
    with pytest.raises(CheckpointError, match="generation_config.json is not a JSON object"):
        export_bundle(gen, tmp_path / "o-gen", progress=steps.append)
    assert steps == [] and _nothing_written(tmp_path / "o-gen")
    short = tmp_path / "short"
    shutil.copytree(draft, short)
    cfg = json.loads((short / "config.json").read_text())
    cfg["max_position_embeddings"] = 8
    (short / "config.json").write_text(json.dumps(cfg))
    _cli_fails(["export", "--model", str(short), "--out", str(tmp_path / "o-short")], capsys, "has 8 positions")


def test_unwritable_output_and_xla_flags(tiny_checkpoints, tmp_path, monkeypatch, capsys):
    import os

    target, _ = tiny_checkpoints("gpt2")
    _cli_fails(["export", "--model", str(target), "--out", str(tmp_path / "o"), "--max-length", "64"], capsys,
               "--max-length only applies to XLA artifacts; add --format onnx+xla or drop it")
    _cli_fails(["export", "--model", str(target), "--out", str(tmp_path / "o"), "--platforms", "cpu"], capsys,
               "--platforms only applies to XLA artifacts")   # its default value too, given explicitly
    real_access = os.access
    monkeypatch.setattr(os, "access", lambda p, mode: False if str(p) == str(tmp_path) else real_access(p, mode))
    _cli_fails(["export", "--model", str(target), "--out", str(tmp_path / "o" / "b")], capsys, "is not a writable folder")
    assert _nothing_written(tmp_path / "o")
    # a folder whose permission bits allow writing but where nothing can be made (as /proc answers
    # root with ENOENT): the message says what was tried
    import errno
    import tempfile

    monkeypatch.setattr(os, "access", real_access)
    def refuse(*a, **k):
        raise OSError(errno.ENOENT, os.strerror(errno.ENOENT))
    monkeypatch.setattr(tempfile, "mkdtemp", refuse)
    _cli_fails(["export", "--model", str(target), "--out", str(tmp_path / "o" / "b")], capsys,
               f"{str(tmp_path)!r} is not a writable folder (creating a folder in it failed: No such file or directory)")


def test_output_inside_input(tiny_checkpoints, tmp_path):
    target, _ = tiny_checkpoints("gpt2")
    ck = tmp_path / "ck"
    shutil.copytree(target, ck)
    with pytest.raises(OutputExistsError, match="inside"):
        export_bundle(ck, ck / "bundle", progress=None)
    assert not (ck / "bundle").exists()


def test_incompatible_tokenizers(tiny_checkpoints, tmp_path, capsys):
    target, _ = tiny_checkpoints("gpt2")
    other = tiny_models.make_gpt2(tmp_path / "other", n_layer=1, seed=3)
    # same size, same token texts, but two ids swapped: sizes alone would not catch it
    tok = json.loads((other / "tokenizer.json").read_text())
    vocab = tok["model"]["vocab"]
    vocab["fox"], vocab["dog"] = vocab["dog"], vocab["fox"]
    (other / "tokenizer.json").write_text(json.dumps(tok))
    with pytest.raises(TokenizerMismatchError, match="tokenizers differ"):
        export_bundle(target, tmp_path / "o", draft=other, progress=None)
    _cli_fails(["export", "--target", str(target), "--draft", str(other), "--out", str(tmp_path / "o")], capsys, "differ")
    assert _nothing_written(tmp_path / "o")


def _copy_with_config(src: Path, dest: Path, **changes) -> Path:
    """A copy of checkpoint folder ``src`` at ``dest`` whose config.json has ``changes``."""
    shutil.copytree(src, dest)
    cfg = json.loads((dest / "config.json").read_text())
    (dest / "config.json").write_text(json.dumps({**cfg, **changes}))
    return dest


def test_a_draft_config_with_too_few_rows_is_blamed_on_its_config(tiny_checkpoints, tmp_path):
    """Before the weights are loaded, a pair's rows come from the configs' vocab_size: a config that
    says fewer rows than the tokenizer has ids is named as what may be wrong, not only the tokenizer."""
    target, draft = tiny_checkpoints("gpt2")
    bad = _copy_with_config(draft, tmp_path / "draft", vocab_size=10)
    with pytest.raises(TokenizerMismatchError, match=r"only 10 embedding rows \(its config.json's vocab_size\); use the "
                       r"tokenizer that was trained with this model, or correct vocab_size in config.json"):
        export_bundle(target, tmp_path / "o", draft=bad, progress=None)
    assert _nothing_written(tmp_path / "o")


def test_validation_over_tolerance_fails_and_leaves_nothing(tiny_checkpoints, tmp_path, monkeypatch, capsys):
    from edgespec.export import validate

    target, _ = tiny_checkpoints("gpt2")
    monkeypatch.setattr(validate, "_diff", lambda a, b, name: 0.5)  # a graph that disagrees with PyTorch
    out = tmp_path / "bad"
    with pytest.raises(ValidationError, match="differs from PyTorch"):
        export_bundle(target, out, progress=None)
    assert _nothing_written(out)
    _cli_fails(["export", "--model", str(target), "--out", str(out), "--quiet"], capsys, "tolerance")
    assert _nothing_written(out)
    deep = tmp_path / "new" / "deeper" / "bundle"  # the folders made above --out go too (they were left, empty)
    (tmp_path / "new").mkdir()
    (tmp_path / "new" / "mine.txt").write_text("x")
    _cli_fails(["export", "--model", str(target), "--out", str(deep), "--quiet"], capsys, "tolerance")
    assert sorted(p.name for p in (tmp_path / "new").iterdir()) == ["mine.txt"]
    # the advice is for this export (a trial saw --quantize advice for fp32 and --opset for a static graph)
    for options, wanted, unwanted in ((ExportOptions(), "Try --graph optimum", ("--quantize", "--opset")),
                                      (ExportOptions(graph="optimum"), "Try another --opset", ("--quantize", "--graph"))):
        with pytest.raises(ValidationError) as e:
            export_bundle(target, out, options=options, progress=None)
        assert wanted in str(e.value) and not any(u in str(e.value) for u in unwanted), str(e.value)
    from edgespec.export.pipeline import _validation_fix  # an int8 graph's (its fp32 one passed)

    fix = _validation_fix(True, contract.KV_STATIC, "draft")
    assert "--quantize-draft none" in fix and "--quantized-atol" in fix and "--graph" not in fix


@pytest.mark.parametrize("arch,graph", [("llama", "static"), ("llama", "optimum"), ("t5", "auto")])
def test_the_runtimes_own_calls_are_validated(tiny_checkpoints, tmp_path, monkeypatch, arch, graph):
    """Export also runs the written graphs through the runtime's backend (its IOBinding, its KV
    buffers, rewind_to) against PyTorch: a backend that forgets to rewind fails the export."""
    from edgespec.runtimes import onnx_backend

    target, _ = tiny_checkpoints(arch)
    options = ExportOptions(graph=graph)
    ok = export_bundle(target, tmp_path / "ok", options=options, progress=None).models["target"].validation
    assert ok["runtime"]["max_abs_diff"] < 1e-4 and "after_rewind" in ok["runtime"]["stages"]
    monkeypatch.setattr(onnx_backend._PositionCache, "rewind_to", lambda self, n: None)
    with pytest.raises(ValidationError, match=r"target \(runtime\): ONNX Runtime output after_rewind/logits differs"):
        export_bundle(target, tmp_path / "bad", options=options, progress=None)
    assert _nothing_written(tmp_path / "bad")


def test_t5_with_fewer_decoder_positions_than_the_validation_walk(tiny_checkpoints, tmp_path):
    """The runtime's T5 buffers hold max_positions decoder tokens: a T5 with 32 (n_positions) is
    validated over 32, not refused for the 64 that validation walks otherwise (a reviewer's find)."""
    target, _ = tiny_checkpoints("t5")
    short = tmp_path / "t5-32"
    shutil.copytree(target, short)
    cfg = json.loads((short / "config.json").read_text())
    (short / "config.json").write_text(json.dumps({**cfg, "n_positions": 32}))
    m = export_bundle(short, tmp_path / "o", progress=None).models["target"]
    assert m.max_positions == 32 and m.validation["runtime"]["max_abs_diff"] < 1e-4


def test_fp16_is_a_clear_error(tiny_checkpoints, tmp_path, capsys):
    target, _ = tiny_checkpoints("gpt2")
    _cli_fails(["export", "--model", str(target), "--out", str(tmp_path / "o"), "--dtype", "fp16", "--quantize", "int8"],
               capsys, "Drop --dtype")
    assert _nothing_written(tmp_path / "o")


def test_quantize_draft_without_a_draft_is_refused(tiny_checkpoints, tmp_path, capsys):
    """--quantize-draft on an export with no draft did nothing, silently."""
    target, _ = tiny_checkpoints("llama")
    for args in (["--model", str(target)], ["--target", str(target)]):
        _cli_fails(["export", *args, "--out", str(tmp_path / "o"), "--quantize-draft", "int8"], capsys, "no draft")
        assert _nothing_written(tmp_path / "o")
    # the Python API refuses it too (the CLI's --quantize, for both models, no longer reaches it as a draft setting)
    from edgespec.errors import InvalidArgumentError

    with pytest.raises(InvalidArgumentError, match="no draft; pass draft="):
        export_bundle(target, tmp_path / "o", options=ExportOptions(quantize_draft="int8"), progress=None)
    assert _nothing_written(tmp_path / "o")
    # --quantize overridden for every model it would reach did nothing, silently (a trial's find)
    for args in (["--model", str(target), "--quantize-target", "none"],
                 ["--target", str(target), "--draft", str(target), "--quantize-target", "none", "--quantize-draft", "int8"]):
        _cli_fails(["export", *args, "--out", str(tmp_path / "o"), "--quantize", "int8"], capsys, "does nothing here")
        assert _nothing_written(tmp_path / "o")


def test_mixed_kinds_refused(tiny_checkpoints, tmp_path):
    target, _ = tiny_checkpoints("gpt2")
    t5, _ = tiny_checkpoints("t5")
    with pytest.raises(UnsupportedArchitectureError, match="decoder-only"):
        export_bundle(target, tmp_path / "o", draft=t5, progress=None)


def test_target_as_its_own_draft_warns(tiny_checkpoints, tmp_path):
    from edgespec.errors import EdgeSpecWarning

    target, _ = tiny_checkpoints("gpt2")
    with pytest.warns(EdgeSpecWarning, match="the draft is the target itself") as seen:
        export_bundle(target, tmp_path / "self", draft=target, progress=None)
    # named after the caller's line (it named pipeline.py's export_bundle: a stacklevel counted by hand)
    assert [w.filename for w in seen] == [__file__]


def test_a_t5_draft_with_another_start_token_warns(tiny_checkpoints, tmp_path, monkeypatch):
    """A T5 draft whose decoder starts from another token than the target's exported silently (a
    trial: alpha 0.50 against 0.625); the output stays exact, so export warns."""
    import warnings

    from edgespec.errors import EdgeSpecWarning
    from edgespec.export import pipeline

    target, draft = tiny_checkpoints("t5")
    other = _copy_with_config(draft, tmp_path / "draft", decoder_start_token_id=3)

    def stop(*a, **k):
        raise RuntimeError("checks done")

    monkeypatch.setattr(pipeline, "_export_one", stop)
    with pytest.warns(EdgeSpecWarning, match="the draft's decoder starts from token 3 and the target's from 0"):
        with pytest.raises(RuntimeError, match="checks done"):
            export_bundle(target, tmp_path / "b", draft=other, progress=None)
    with warnings.catch_warnings():
        warnings.simplefilter("error", EdgeSpecWarning)
        with pytest.raises(RuntimeError, match="checks done"):
            export_bundle(target, tmp_path / "b", draft=draft, progress=None)


def test_large_logits_failing_validation_are_called_rounding(tmp_path):
    """A model with large logits fails --atol by float32 rounding alone (a trial's T5 with logits up
    to 231 differed by 6.4e-3 and decoded token-identically); the message said to try another graph or
    opset. It now says what the difference is against the logits' range and which --atol accepts it."""
    import re

    from safetensors.torch import load_file, save_file

    from edgespec.errors import ValidationError
    from tiny_models import make_llama

    t = make_llama(tmp_path / "t", seed=1)
    w = load_file(t / "model.safetensors")
    w["lm_head.weight"] = w["lm_head.weight"] * 90000  # logits of order 1e4: a float32 ulp is ~1e-3
    save_file(w, t / "model.safetensors", metadata={"format": "pt"})
    with pytest.raises(ValidationError, match=r"of the logits' range .*: float32 rounding .* --atol \S+ accepts it") as exc:
        export_bundle(t, tmp_path / "b", progress=None)
    assert "--graph optimum" not in str(exc.value) and not (tmp_path / "b").exists()
    atol = float(re.search(r"--atol (\S+) accepts", str(exc.value)).group(1))
    m = export_bundle(t, tmp_path / "b", options=ExportOptions(atol=atol), progress=None)
    assert m.target.validation["fp32"]["max_abs_diff"] <= atol


def test_a_draft_with_fewer_positions_warns(tmp_path):
    """Export said nothing when the draft took fewer positions than the target, though speculation
    then stops there (a trial's find); the bundle is still written and decodes exactly."""
    import warnings

    from edgespec.errors import EdgeSpecWarning
    from tiny_models import make_llama

    target = make_llama(tmp_path / "t", max_positions=128, seed=1)
    short = make_llama(tmp_path / "d", layers=1, max_positions=32, seed=2)
    with pytest.warns(EdgeSpecWarning, match="the draft takes 32 positions and the target 128: past 32 tokens"):
        m = export_bundle(target, tmp_path / "b", draft=short, progress=None)
    assert m.draft.max_positions == 32 and m.target.max_positions == 128
    # A prompt longer than the draft's positions: the default decodes without the draft and says so
    # (it used to refuse); a drafter or gamma named asks for the draft, and is refused.
    import edgespec
    from edgespec.errors import PromptTooLongError

    eng = edgespec.load(tmp_path / "b")
    ids = [3 + i % 50 for i in range(40)]
    with pytest.warns(EdgeSpecWarning, match="the prompt has 40 tokens and the draft model takes at most 31 .the last "
                                             "of its 32 positions is for the token it reads to draft.: decoding without") as seen:
        out = eng.generate(ids, max_new_tokens=8, temperature=0)
    assert [w.filename for w in seen] == [__file__]
    assert out.stats.draft_calls == 0 and out.ids == eng.generate(ids, max_new_tokens=8, temperature=0, use_draft=False).ids
    assert out.drafter is None  # what ran (the CLI's --json said "speculative": true here: a review's find)
    # A prompt of 32 tokens fits the draft but leaves it no position to draft from: gamma=3 was ignored
    # (no round drafted, no word said) while 33 tokens were refused (a trial's find); 31 drafts once.
    for n in (40, 32):
        for kw in ({"drafter": "model"}, {"gamma": 3}):
            with pytest.raises(PromptTooLongError, match=f"prompt has {n} tokens but the draft model takes at most 31"):
                eng.generate(ids[:n], max_new_tokens=8, temperature=0, **kw)
    with pytest.warns(EdgeSpecWarning, match="the prompt has 32 tokens and the draft model takes at most 31"):
        assert eng.generate(ids[:32], max_new_tokens=8, temperature=0).stats.rounds == 0
    with warnings.catch_warnings():
        warnings.simplefilter("error", EdgeSpecWarning)
        assert eng.generate(ids[:31], max_new_tokens=8, temperature=0, gamma=3).stats.rounds == 1
    with warnings.catch_warnings():
        warnings.simplefilter("error", EdgeSpecWarning)  # a prompt that fits: the draft, no warning
        fits = eng.generate(ids[:20], max_new_tokens=8, temperature=0)
        assert fits.stats.draft_calls > 0 and fits.drafter == "model"
        with pytest.raises(PromptTooLongError, match="the target has 128 positions"):  # too long for both: the target's error
            eng.generate(ids * 4, max_new_tokens=8, temperature=0)
    with warnings.catch_warnings():
        warnings.simplefilter("error", EdgeSpecWarning)  # the same positions: no warning
        export_bundle(target, tmp_path / "b2", draft=make_llama(tmp_path / "d2", layers=1, seed=2), progress=None)


@pytest.mark.parametrize("arch", ["llama", "gpt2", "t5"])
def test_int8_target_is_causal_and_exact(tiny_checkpoints, tmp_path, arch):
    """An int8 target must stay one fixed causal model: a position's logits may not depend on the
    other tokens in the same call (dynamic activation quantization, one scale per call, broke this:
    changing a later token moved an earlier row's logits by O(1)), and greedy speculative output is
    token-identical to plain decoding of the same int8 bundle (on these tiny models; the call
    width's rounding noise, which int8 activations amplify, flips near-ties on larger ones:
    benchmarks/call_width.py)."""

    import edgespec

    target, draft = tiny_checkpoints(arch)
    out = tmp_path / "q8"
    assert main(["export", "--target", str(target), "--draft", str(draft), "--out", str(out), "--quantize", "int8", "--quiet"]) == 0
    m = _manifest(out)
    assert m["models"]["target"]["quantization"] == "int8-rowwise"
    assert m["models"]["draft"]["quantization"] == "int8-dynamic"
    eng = edgespec.load(out, threads=1)
    t = eng.target
    prompt = [5, 9, 13, 22, 31, 7]
    t.prefill(prompt)
    n0 = t.length
    block = t.extend([40, 41, 42, 43])                                          # [4, V]
    t.rewind_to(n0)
    changed = t.extend([40, 41, 42, 3 if 43 != 3 else 4])                       # [4, V]: only the last token differs
    t.rewind_to(n0)
    alone = t.extend([40])                                                      # [1, V]
    assert np.abs(block[:3] - changed[:3]).max() == 0.0
    assert np.abs(block[0] - alone[0]).max() < 1e-4
    for ids in ([5, 9, 13, 22, 31, 7], [1, 2, 3], [55, 8, 56, 9, 57]):
        plain = eng.generate(ids, max_new_tokens=24, temperature=0, use_draft=False).ids
        for gamma in (3, None):
            assert eng.generate(ids, max_new_tokens=24, temperature=0, gamma=gamma).ids == plain, (ids, gamma)


def test_longrope_checkpoint_is_capped_where_its_rotary_factors_switch(tmp_path, capsys):
    """Phi-3's longrope uses short rotary factors up to original_max_position_embeddings tokens and
    long ones past it; the traced graph keeps the short ones. The bundle must stop at that length
    (with a warning), and up to it the graph must match PyTorch."""
    import torch
    from transformers import Phi3Config, Phi3ForCausalLM

    import edgespec
    from edgespec.errors import PromptTooLongError

    torch.manual_seed(0)
    cfg = Phi3Config(vocab_size=96, hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2,
                     num_key_value_heads=2, max_position_embeddings=64, original_max_position_embeddings=16,
                     rope_scaling={"type": "longrope", "short_factor": [1.0] * 8, "long_factor": [4.0] * 8},
                     bos_token_id=3, eos_token_id=1, pad_token_id=0)
    model = Phi3ForCausalLM(cfg).eval()
    ckpt = tiny_models._save(model, tmp_path / "phi3")
    out = tmp_path / "b"
    assert main(["export", "--model", str(ckpt), "--out", str(out), "--quiet"]) == 0
    assert "limited to 16 positions" in capsys.readouterr().err
    assert _manifest(out)["models"]["target"]["max_positions"] == 16
    eng = edgespec.load(out, load_draft=False)
    ids = [5 + (i * 7) % 50 for i in range(16)]
    with torch.no_grad():
        ref = model(torch.tensor([ids])).logits[0, -1].numpy()
    assert np.abs(eng.target.prefill(ids)[:96] - ref).max() < 1e-3
    with pytest.raises(PromptTooLongError):
        eng.generate(ids, max_new_tokens=4)


def test_sliding_window_shorter_than_the_validation_pass(tmp_path):
    """A sliding-window model whose window is shorter than the validation pass: PyTorch's cache
    keeps only the window's last positions, so validation compares those (it failed with a shape
    mismatch before); the bundle's greedy output matches transformers' generate past the window."""
    import torch
    from transformers import MistralConfig, MistralForCausalLM

    import edgespec

    torch.manual_seed(0)
    cfg = MistralConfig(vocab_size=tiny_models.TOKENIZER_SIZE, hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2,
                        num_key_value_heads=1, max_position_embeddings=64, sliding_window=4,
                        bos_token_id=3, eos_token_id=1, pad_token_id=0, tie_word_embeddings=False)
    model = MistralForCausalLM(cfg).eval()
    with torch.no_grad():  # sharper logits than the default init: no near-ties over 24 tokens
        for p in model.parameters():
            if p.dim() >= 2:
                p.normal_(0, 0.3)
    ckpt = tiny_models._save(model, tmp_path / "mistral")  # no padding rows: HF samples the same ids
    out = tmp_path / "b"
    assert main(["export", "--model", str(ckpt), "--out", str(out), "--quiet"]) == 0
    ids = [5, 9, 13, 22, 31, 7]
    with torch.no_grad():
        ref = model.generate(torch.tensor([ids]), max_new_tokens=24, do_sample=False, pad_token_id=0,
                             eos_token_id=1)[0, len(ids):].tolist()                # ends with eos, as ours does
    assert edgespec.load(out, load_draft=False).generate(ids, max_new_tokens=24, temperature=0).ids == ref


def test_int8_target_with_nothing_to_quantize_is_labelled_fp32(tiny_checkpoints, tmp_path, monkeypatch):
    """When no weight product of the target can be quantized, the export says why and the manifest
    says "none" (it said int8-rowwise over an fp32 graph); when some cannot, it says how many."""
    from edgespec.errors import EdgeSpecWarning
    from edgespec.export import quantize
    from edgespec.export.pipeline import ExportOptions, export_bundle

    target, _ = tiny_checkpoints("llama")
    real = quantize._weight_product
    monkeypatch.setattr(quantize, "_weight_product", lambda node, inits: "K < 16 (too few inputs per output for int8)"
                        if isinstance(real(node, inits), tuple) else real(node, inits))
    with pytest.warns(EdgeSpecWarning, match=r"no MatMul or Gemm .* could be quantized \(\d+ x K < 16"):
        m = export_bundle(target, tmp_path / "none", options=ExportOptions(quantize_target="int8"), progress=None)
    assert m.target.quantization == "none"
    seen = []

    def first_only(node, inits):
        found = real(node, inits)
        if isinstance(found, tuple) and not seen:
            seen.append(node.name)
            return "Gemm with transA=1"
        return found

    monkeypatch.setattr(quantize, "_weight_product", first_only)
    with pytest.warns(EdgeSpecWarning, match=r"1 of \d+ weight products stay fp32 \(1 x Gemm with transA=1\)"):
        m = export_bundle(target, tmp_path / "some", options=ExportOptions(quantize_target="int8"), progress=None)
    assert m.target.quantization == "int8-rowwise"


def test_rowwise_int8_converts_gemm_and_names_what_stays_fp32(tmp_path):
    """Gemm by a constant weight (GPT-2's and OPT's traced graphs) is converted too: transB, alpha
    and beta * C as ONNX defines them, a bias that is a graph input scaled by a node. A Gemm with
    transA and a weight with fewer than 16 inputs stay fp32, and the report says why."""
    import onnx
    import onnxruntime as ort
    from onnx import TensorProto, helper, numpy_helper

    from edgespec.export.quantize import quantize_int8_rowwise

    rng = np.random.default_rng(1)
    wt = rng.normal(size=(24, 64)).astype(np.float32)                 # [N, K]: Gemm transB=1
    c = rng.normal(size=(24,)).astype(np.float32)
    w2 = rng.normal(size=(24, 24)).astype(np.float32)
    small = rng.normal(size=(5, 8)).astype(np.float32)                # read by a transA Gemm: stays fp32
    tiny_k = rng.normal(size=(8, 4)).astype(np.float32)               # K = 8 < 16: stays fp32
    nodes = [helper.make_node("Gemm", ["x", "Wt", "C"], ["a"], transB=1, alpha=0.5, beta=2.0),
             helper.make_node("Gemm", ["a", "W2", "c_in"], ["b"], beta=3.0),
             helper.make_node("Gemm", ["b", "S"], ["d"], transA=1),
             helper.make_node("MatMul", ["d", "T"], ["y"])]
    graph = helper.make_graph(
        nodes, "g", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [5, 64]),
                     helper.make_tensor_value_info("c_in", TensorProto.FLOAT, [24])],
        [helper.make_tensor_value_info("b", TensorProto.FLOAT, [5, 24]), helper.make_tensor_value_info("y", TensorProto.FLOAT, [24, 4])],
        [numpy_helper.from_array(a, n) for a, n in ((wt, "Wt"), (c, "C"), (w2, "W2"), (small, "S"), (tiny_k, "T"))])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    model.ir_version = 8
    path = tmp_path / "g.onnx"
    onnx.save(model, str(path))
    converted, skipped = quantize_int8_rowwise(path)
    assert converted == 2 and sorted(skipped) == ["Gemm with transA=1", "K < 16 (too few inputs per output for int8)"]
    q = onnx.load(str(path))
    onnx.checker.check_model(q)
    assert [n.op_type for n in q.graph.node].count("MatMulInteger") == 2 and [n.op_type for n in q.graph.node].count("Gemm") == 1
    xs = rng.normal(size=(5, 64)).astype(np.float32)
    c_in = rng.normal(size=(24,)).astype(np.float32)
    got_b, got_y = ort.InferenceSession(str(path), providers=["CPUExecutionProvider"]).run(None, {"x": xs, "c_in": c_in})
    a = 0.5 * xs @ wt.T + 2.0 * c
    b = a @ w2 + 3.0 * c_in
    assert np.abs(got_b - b).max() < 0.03 * np.abs(b).max()
    assert np.abs(got_y - (got_b.T @ small) @ tiny_k).max() < 1e-3 * np.abs(got_y).max()


def test_rowwise_int8_weight_shared_by_matmul_and_gemms(tmp_path):
    """One weight read by a MatMul, by a Gemm with transB and by a Gemm with alpha 2 gets one packed
    copy per way of reading it (a shared copy gave a shape error or a 2x error), and a Gemm whose C
    input is the empty name adds no bias."""
    import onnx
    import onnxruntime as ort
    from onnx import TensorProto, helper, numpy_helper

    from edgespec.export.quantize import quantize_int8_rowwise

    rng = np.random.default_rng(2)
    w = rng.normal(size=(32, 32)).astype(np.float32)
    nodes = [helper.make_node("MatMul", ["x", "W"], ["a"]),
             helper.make_node("Gemm", ["x", "W"], ["b"], transB=1),
             helper.make_node("Gemm", ["x", "W", ""], ["c"], alpha=2.0)]
    graph = helper.make_graph(nodes, "g", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [3, 32])],
                              [helper.make_tensor_value_info(n, TensorProto.FLOAT, [3, 32]) for n in "abc"],
                              [numpy_helper.from_array(w, "W")])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    model.ir_version = 8
    path = tmp_path / "g.onnx"
    onnx.save(model, str(path))
    assert quantize_int8_rowwise(path) == (3, [])
    q = onnx.load(str(path))
    onnx.checker.check_model(q)
    assert [n.op_type for n in q.graph.node].count("Add") == 1                    # the quantizer's +128; the empty C adds nothing
    xs = rng.normal(size=(3, 32)).astype(np.float32)
    got = ort.InferenceSession(str(path), providers=["CPUExecutionProvider"]).run(None, {"x": xs})
    for y, want in zip(got, (xs @ w, xs @ w.T, 2 * xs @ w)):
        assert np.abs(y - want).max() < 0.03 * np.abs(want).max()


@pytest.mark.parametrize("scheme,opset", [("rowwise", 17), ("rowwise", 18), ("blockwise", 17)])
def test_target_int8_on_hand_made_graphs(tmp_path, scheme, opset):
    """The causal int8 schemes: K not a multiple of 128, one weight shared by two MatMuls (packed
    once; rowwise also quantizes their shared input once), a weight that is also a graph input
    (overridable, so left fp32), ReduceMax's two forms (axes attribute before opset 18, input from
    18), and the result close to fp32 with each row bit-identical whatever the other rows hold, an
    all-zero row included."""
    import onnx
    import onnxruntime as ort
    from onnx import TensorProto, helper, numpy_helper

    from edgespec.export.quantize import quantize_int8_blockwise, quantize_int8_rowwise

    rng = np.random.default_rng(0)
    w, v = rng.normal(size=(200, 48)).astype(np.float32), rng.normal(size=(48, 48)).astype(np.float32)
    x = helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, "k", 200])
    nodes = [helper.make_node("MatMul", ["x", "W"], ["a"]), helper.make_node("MatMul", ["x", "W"], ["b"]),
             helper.make_node("Add", ["a", "b"], ["c"]), helper.make_node("MatMul", ["c", "V"], ["y"])]
    graph = helper.make_graph(nodes, "g", [x, helper.make_tensor_value_info("V", TensorProto.FLOAT, [48, 48])],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, [1, "k", 48])],
                              [numpy_helper.from_array(w, "W"), numpy_helper.from_array(v, "V")])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", opset)])
    model.ir_version = 8
    path = tmp_path / "m.onnx"
    onnx.save(model, str(path))
    if scheme == "rowwise":
        assert quantize_int8_rowwise(path) == (2, [])                              # V is a graph input
    else:
        assert quantize_int8_blockwise(path) == 2
    q = onnx.load(str(path))
    onnx.checker.check_model(q)
    ops = [n.op_type for n in q.graph.node]
    if scheme == "rowwise":
        assert ops.count("MatMulInteger") == 2 and ops.count("ReduceMax") == 1 and ops[-1] == "MatMul"
        assert {"W.int8", "W.col_scales", "V"} <= {t.name for t in q.graph.initializer} and "W" not in {t.name for t in q.graph.initializer}
    else:
        assert ops == ["MatMulNBits", "MatMulNBits", "Add", "MatMul"]
        assert sorted(t.name for t in q.graph.initializer) == ["V", "W.int8", "W.scales"]
    if scheme == "rowwise":                                                        # expose the quantized rows
        q.graph.output.append(helper.make_tensor_value_info("x.rowq.q", TensorProto.UINT8, None))
        onnx.save(q, str(path))
    sess = ort.InferenceSession(str(path), providers=["CPUExecutionProvider"])
    xs = rng.normal(size=(1, 5, 200)).astype(np.float32)
    xs[0, 2] = 0.0                                                                 # an all-zero row
    outs = sess.run(None, {"x": xs, "V": v})
    got = outs[0]
    want = (2 * xs @ w) @ v
    assert np.isfinite(got).all() and np.abs(got[0, 2]).max() == 0.0
    assert np.abs(got - want).max() < 0.02 * np.abs(want).max()
    if scheme == "rowwise":
        # the scheme itself, in numpy: s = max|x| / 127 per row, q = round_half_even(x / s) + 128,
        # weights per column in [-63, 63], an exact integer product, then both scales
        from edgespec.export.quantize import _quantize_columns

        q_w, s_w = _quantize_columns(w)
        assert np.abs(q_w).max() == 63
        s_x = np.maximum(np.abs(xs).max(-1, keepdims=True), np.float32(1e-30)) * np.float32(1 / 127)   # [1, 5, 1]
        q_x = np.clip(np.rint(xs / s_x) + 128, 0, 255)                                                   # [1, 5, 200]
        assert np.array_equal(outs[1], q_x.astype(np.uint8)) and (outs[1][0, 2] == 128).all()
        a = ((q_x - 128).astype(np.int64) @ q_w.astype(np.int64)).astype(np.float32) * s_x * s_w       # [1, 5, 48]
        assert np.abs(got - (2 * a) @ v).max() < 1e-4 * np.abs(want).max()
    changed = xs.copy()
    changed[0, 4] *= 30
    assert np.array_equal(sess.run(None, {"x": changed, "V": v})[0][:, :4], got[:, :4])


def test_a_bundles_model_folder_given_as_a_checkpoint(tiny_bundle, tmp_path, capsys):
    """export or distill given a bundle's target/ (ONNX graphs, no weights) were told to save the
    model with safe_serialization=True; they are told to pass the checkpoint it came from."""
    from edgespec.distill import distill

    folder = tiny_bundle("llama") / "target"
    with pytest.raises(CheckpointError, match=r"holds exported ONNX graphs \(a bundle's model folder\): pass the "
                                              r"Hugging Face checkpoint"):
        distill(folder, tmp_path / "d", steps=1)
    _cli_fails(["export", "--model", str(folder), "--out", str(tmp_path / "o")], capsys, "holds exported ONNX graphs")
    assert not (tmp_path / "d").exists() and not (tmp_path / "o").exists()
