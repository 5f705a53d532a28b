"""The XLA runtime inside a bundle: `edgespec export --format onnx+xla`, then the same loop over
jax.export artifacts gives token-identical greedy output to the ONNX Runtime path."""
from __future__ import annotations

import json

import numpy as np
import pytest

pytest.importorskip("jax")

from edgespec.api import load  # noqa: E402
from edgespec.bundle import load_bundle  # noqa: E402
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
    if arch != "t5":  # the artifacts' 64 positions, not the model's 128, are what is short (a trial was told "the target's")
        from edgespec.errors import PromptTooLongError

        long = [3 + i % 50 for i in range(60)]
        with pytest.raises(PromptTooLongError, match=r"needs 79 of the XLA artifacts' 64 positions .*larger --max-length "
                                                     r"\(the model has 128 positions\), or drop runtime='xla'"):
            xla.generate(long, max_new_tokens=20, temperature=0.0)
        assert len(onnx.generate(long, max_new_tokens=20, temperature=0.0).ids) == 20
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


def test_t5_engine_takes_prompts_up_to_the_encoder_length(tiny_checkpoints, tmp_path):
    """XLA artifacts of a T5 exported for long inputs and short outputs: the Engine checks the prompt
    against the encoder (40), not the decoder buffer (16)."""
    from edgespec.errors import PromptTooLongError
    from edgespec.export.pipeline import export_bundle

    t, d = tiny_checkpoints("t5")
    export_bundle(t, tmp_path / "b", draft=d, progress=None, xla=dict(max_length=16, verify_width=4, max_source_length=40))
    prompt = [int(x) for x in np.random.default_rng(0).integers(4, 59, size=30)]
    with load(tmp_path / "b") as onnx:  # the reference: the ONNX graphs of the same bundle
        want = {n: onnx.target.prefill(np.array(prompt[:n])) for n in (5, 16, 17, 30)}
    with load(tmp_path / "b", runtime="xla") as eng:
        plain = eng.generate(prompt, max_new_tokens=8, temperature=0, use_draft=False).ids
        assert eng.generate(prompt, max_new_tokens=8, temperature=0).ids == plain
        with pytest.raises(PromptTooLongError, match="encoder takes at most 40; shorten it .*larger --max-source-length"):
            eng.generate(prompt * 2, max_new_tokens=8, temperature=0)
        # encoder buckets (default: 16 and the longest, 40): a short prompt runs the small one, whose
        # cross KV is padded to 40 for the shared decoder steps; the logits are the ONNX graphs'
        assert sorted(eng.target._encode) == [16, 40]
        ran = []
        for size, fn in list(eng.target._encode.items()):
            eng.target._encode[size] = lambda *a, _f=fn, _s=size: ran.append(_s) or _f(*a)
        for n, ref in want.items():
            got = eng.target.prefill(np.array(prompt[:n]))
            assert np.abs(got - ref).max() < 1e-4, n
        assert ran == [16, 16, 40, 40]
        ran.clear()
        eng.target.warmup()  # compiles every bucket before a timed call (it compiled the smallest only)
        assert ran == [16, 40]
    for role in ("target", "draft"):  # export checked both encoder buckets against PyTorch (it checked the smallest)
        v = json.loads((tmp_path / "b" / role / "xla" / "xla.json").read_text())["validation"]
        assert {"prefill", "prefill_longest_prompt"} <= set(v["stages"]) and v["max_abs_diff"] < 1e-4, role
    # left to its default, the one encoder bucket is 512 tokens long, which every prompt pays for (a trial's find)
    from edgespec.errors import EdgeSpecWarning
    from edgespec.export.xla import check_xla_options

    with pytest.warns(EdgeSpecWarning, match="512 tokens by default.*pass --max-source-length"):
        assert check_xla_options(t, max_length=16, verify_width=4)["max_source_length"] == 512
    import warnings

    with warnings.catch_warnings():
        warnings.simplefilter("error", EdgeSpecWarning)
        check_xla_options(t, max_length=16, verify_width=4, max_source_length=40)


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
    for flags in (["--provider", "cuda"], ["--provider", "cpu"], ["--threads", "1"], ["--draft-threads", "2"], ["--no-spin"], ["--no-huge-pages"]):
        assert main(["generate", str(xla_bundle("gpt2")), "--prompt", "the cat", "--runtime", "xla", *flags]) == 2
        err = capsys.readouterr().err
        assert f"{flags[0]} configures ONNX Runtime and does nothing with --runtime xla; drop it" in err, err
    from edgespec.errors import InvalidArgumentError

    with pytest.raises(InvalidArgumentError, match="platform="):
        load(xla_bundle("gpt2"), runtime="xla", providers="cuda")


def test_bench_runs_on_xla_runtime(xla_bundle, tiny_checkpoints, tmp_path, capsys, monkeypatch):
    """Adaptive gamma stays within the artifacts' verify width (6 here: gamma <= 5, below the default
    bound of 8); a static gamma beyond it is refused before any measurement, as generate does.
    Every artifact is compiled before the timed runs (a first call compiles, ~0.4 s a width)."""
    from edgespec.runtimes.xla_backend import XlaBackend

    warmed, real_warmup = [], XlaBackend.warmup
    monkeypatch.setattr(XlaBackend, "warmup", lambda self: (warmed.append(self), real_warmup(self))[1])
    argv = ["bench", str(xla_bundle("llama")), "--runtime", "xla", "--temperatures", "0", "--repeats", "1",
            "--max-new-tokens", "24", "--quiet"]
    assert main(argv + ["--gammas", "2,auto", "--out", str(tmp_path)]) == 0
    assert len(warmed) == 2  # target and draft
    data = json.loads((tmp_path / "bench.json").read_text())
    assert data["verify_width"] == 6 and data["jax"]
    # the platform it ran on; no ONNX Runtime settings, which an XLA run does not use (it recorded them)
    assert data["platform"] == "cpu" and all(data[k] is None for k in ("providers", "threads", "draft_threads", "spin",
                                                                        "huge_pages"))
    auto = next(r for r in data["results"] if r["gamma"] is None)
    assert 0 < auto["mean_gamma"] <= 5
    # bytes read: the artifacts' fp32 weights and, every call, the whole static KV buffer (they were
    # the ONNX graphs' weights and the cache's real length); plain decoding makes one call per token
    from edgespec.bench import kv_bytes_per_token

    t = warmed[0]
    kv = kv_bytes_per_token(load_bundle(xla_bundle("llama")).target)
    assert t.parameter_bytes > 0 and all(r["target_bytes_per_token_plain"] == pytest.approx(t.parameter_bytes + kv * t.max_length)
                                         for r in data["results"])
    capsys.readouterr()
    # artifacts that verify one token per call leave bench nothing to measure (it was told to "decode without the draft")
    from edgespec.export.pipeline import export_bundle

    narrow = tmp_path / "narrow"
    t, d = tiny_checkpoints("llama")
    with pytest.warns(Warning, match="no room for a draft token"):
        export_bundle(t, narrow, draft=d, progress=None, xla=dict(platforms=["cpu"], max_length=16, verify_width=1))
    assert main(["bench", str(narrow), "--runtime", "xla", "--repeats", "1", "--quiet"]) == 2
    assert "verify_width=1): no room for a draft token, and bench measures speculative decoding; re-export with " \
           "`--verify-width 9`" in capsys.readouterr().err
    # the default --gammas (up to 8) within the artifacts' width: it failed, blaming --gammas, which was not given
    assert main(argv + ["--out", str(tmp_path / "default")]) == 0
    assert "--gammas defaults to 1,2,4,auto here: the XLA artifacts verify at most 6 tokens" in capsys.readouterr().err
    rows = json.loads((tmp_path / "default" / "bench.json").read_text())["results"]
    assert [r["gamma"] for r in rows] == [1, 2, 4, None]
    assert main(argv + ["--gammas", "2,6"]) == 2
    err = capsys.readouterr().err
    assert "verify_width=6, so gamma <= 5" in err and "Traceback" not in err
    assert main(argv + ["--gammas", "2", "--threads", "1", "--spin", "off"]) == 2
    err = capsys.readouterr().err
    assert "--threads, --spin configure ONNX Runtime and do nothing with --runtime xla" in err, err
    # the lookahead drafter with XLA: no advice about --threads, which XLA does not take
    assert main(argv + ["--gammas", "2", "--draft", "lookahead"]) == 0
    assert "--threads" not in capsys.readouterr().err


def test_xla_options_are_checked_before_the_onnx_work(tiny_checkpoints, tmp_path, capsys, monkeypatch):
    """Bad XLA options fail in a fraction of a second, before any ONNX export; an int8 target is
    refused with the XLA format (two runtimes, two targets); the CLI reports the XLA check."""
    import edgespec.export.pipeline as pipeline

    t, d = tiny_checkpoints("llama")

    def no_onnx(*a, **k):
        raise AssertionError("the ONNX export started before the XLA options were checked")

    monkeypatch.setattr(pipeline, "_export_one", no_onnx)
    base = ["export", "--target", str(t), "--draft", str(d), "--out", str(tmp_path / "b"), "--format", "onnx+xla"]
    for extra, words in ((["--verify-width", "0"], "verify_width"), (["--max-length", "100000"], "positions"),
                         (["--platforms", "cpu,foo"], "foo"), (["--prefill-buckets", "0"], "prefill bucket"),
                         (["--atol", "inf"], "atol"), (["--quantize", "int8"], "two different targets"),
                         (["--max-source-length", "16"], "sizes a T5 encoder")):
        assert main(base + extra) == 2, extra
        err = capsys.readouterr().err
        assert words in err and "Traceback" not in err, (extra, err)
    for flag in ("--platforms", "--prefill-buckets"):   # empty: a usage error (it fell back to the defaults silently)
        with pytest.raises(SystemExit) as exc:
            main(base + [f"{flag}=", "--max-length", "32"])
        assert exc.value.code == 2 and f"argument {flag}: is empty; give at least one" in capsys.readouterr().err
    assert not (tmp_path / "b").exists()
    with pytest.warns(Warning, match="no room for a draft token"):
        with pytest.raises(AssertionError, match="ONNX export started"):  # the warning comes before any work
            pipeline.export_bundle(t, tmp_path / "b", draft=d, progress=None, xla=dict(verify_width=1, max_length=16))
    monkeypatch.undo()
    assert main(base + ["--max-length", "32", "--verify-width", "3"]) == 0
    err = capsys.readouterr().err
    assert err.count("XLA artifacts vs PyTorch: max |logits diff|") == 2  # target and draft


def test_standalone_xla_export_output_paths(tiny_checkpoints, tmp_path, capsys):
    from edgespec.export.xla import main as xla_main

    t, _ = tiny_checkpoints("gpt2")
    afile = tmp_path / "afile"
    afile.write_text("hi")
    assert xla_main([str(t), str(afile), "--max-length", "16"]) == 2
    assert "not a folder" in capsys.readouterr().err and afile.read_text() == "hi"
    user = tmp_path / "user"
    (user / "xla").mkdir(parents=True)
    (user / "xla" / "notes.txt").write_text("precious")
    assert xla_main([str(t), str(user), "--max-length", "16", "--overwrite"]) == 2
    assert "not XLA artifacts" in capsys.readouterr().err
    assert (user / "xla" / "notes.txt").read_text() == "precious"
    assert xla_main([str(t), "/proc/edgespec-no", "--max-length", "16"]) == 2
    err = capsys.readouterr().err
    assert "cannot write" in err and "Traceback" not in err


def test_xla_logits_must_match_the_manifest_vocab(xla_bundle, tmp_path):
    """A manifest edited to a smaller vocab_size would make the XLA path sample from fewer ids
    (the ONNX path checks its logits' shape against it): both refuse the bundle."""
    import shutil

    from edgespec.errors import BundleError

    b = tmp_path / "b"
    shutil.copytree(xla_bundle("llama"), b)
    data = json.loads((b / "edgespec.json").read_text())
    data["models"]["target"]["vocab_size"] = data["models"]["target"]["tokenizer_size"] = 10
    (b / "edgespec.json").write_text(json.dumps(data))
    with pytest.raises(BundleError):   # the tokenizer has more ids than 10
        load(b, runtime="xla")
    data["models"]["target"]["tokenizer_size"] = json.loads((xla_bundle("llama") / "edgespec.json").read_text())[
        "models"]["target"]["tokenizer_size"]
    data["models"]["target"]["vocab_size"] += 1
    (b / "edgespec.json").write_text(json.dumps(data))
    with pytest.raises(BundleError, match="XLA artifacts give .* logits per position, the manifest says vocab_size"):
        load(b, runtime="xla")


def test_xla_artifacts_of_another_model_are_refused(xla_bundle, tmp_path):
    """The draft's xla/ copied over the target's: each folder's checksums hold, yet the XLA path
    would decode with another model than the ONNX one beside it (it did, exit 0)."""
    import shutil

    from edgespec.errors import BundleError

    b = tmp_path / "b"
    shutil.copytree(xla_bundle("llama"), b)
    shutil.rmtree(b / "target" / "xla")
    shutil.copytree(b / "draft" / "xla", b / "target" / "xla")
    with pytest.raises(BundleError, match=r"target: the XLA artifacts in xla/ are another model .*re-export both"):
        load(b, runtime="xla")
    load(b)   # the ONNX path does not read xla/


def test_xla_files_outside_the_model_folder_are_refused(xla_bundle, tmp_path):
    """A symbolic link in place of a model's xla/ folder (or a hard-linked artifact) was read, where
    the same link for one artifact or for ONNX external data is refused."""
    import os
    import shutil

    from edgespec.errors import UnsafeFileError

    b = tmp_path / "b"
    shutil.copytree(xla_bundle("llama"), b)
    shutil.move(b / "target" / "xla", tmp_path / "elsewhere")
    (b / "target" / "xla").symlink_to(tmp_path / "elsewhere")
    with pytest.raises(UnsafeFileError, match=r"target/xla is a symbolic link .*cp -rL"):
        load(b, runtime="xla")
    (b / "target" / "xla").unlink()
    shutil.copytree(tmp_path / "elsewhere", b / "target" / "xla")
    os.link(b / "target" / "xla" / "weights.safetensors", tmp_path / "shared")
    with pytest.raises(UnsafeFileError, match=r"weights.safetensors is a hard link"):
        load(b, runtime="xla")
    (tmp_path / "shared").unlink()
    assert load(b, runtime="xla").generate([3, 9], max_new_tokens=2, temperature=0).ids


def test_same_model_check_compares_what_both_configs_give(tmp_path):
    """save_pretrained fills a null (num_key_value_heads: null becomes the head count) and adds
    defaults: only values both configs give are compared (a null made a bundle's own checkpoint
    'another model')."""
    from edgespec.errors import InvalidArgumentError
    from edgespec.export.xla import _check_same_model

    ck, folder = tmp_path / "ck", tmp_path / "target"
    ck.mkdir()
    folder.mkdir()
    (ck / "config.json").write_text(json.dumps({"model_type": "llama", "num_key_value_heads": None, "num_hidden_layers": 2}))
    (folder / "config.json").write_text(json.dumps({"model_type": "llama", "num_key_value_heads": 4, "num_hidden_layers": 2,
                                                    "rope_theta": 10000.0}))
    _check_same_model(ck, folder)
    (folder / "config.json").write_text(json.dumps({"model_type": "llama", "num_hidden_layers": 3}))
    with pytest.raises(InvalidArgumentError, match=r"holds another model than .*num_hidden_layers 2 vs 3"):
        _check_same_model(ck, folder)


def test_standalone_reexport_updates_the_bundle_summary(xla_bundle, tiny_checkpoints, tmp_path, capsys):
    """Re-exporting one model of a bundle with the standalone tool keeps edgespec.json's formats.xla true."""
    import shutil

    from edgespec.export.xla import main as xla_main

    b = tmp_path / "b"
    shutil.copytree(xla_bundle("gpt2"), b)
    before = json.loads((b / "edgespec.json").read_text())["formats"]["xla"]
    t, d = tiny_checkpoints("gpt2")
    # the draft's checkpoint into the target's folder: refused before any work (load refused it after)
    assert xla_main([str(d), str(b / "target"), "--max-length", "32", "--overwrite"]) == 2
    assert "holds another model than" in capsys.readouterr().err
    # --overwrite replaces the artifacts only while xla/ holds nothing the export did not write
    (b / "target" / "xla" / "notes.txt").write_text("precious")
    assert xla_main([str(t), str(b / "target"), "--max-length", "32", "--verify-width", "4", "--overwrite"]) == 2
    assert "also holds what this command did not write (notes.txt)" in capsys.readouterr().err
    assert (b / "target" / "xla" / "notes.txt").read_text() == "precious"
    (b / "target" / "xla" / "notes.txt").unlink()
    assert xla_main([str(t), str(b / "target"), "--max-length", "32", "--verify-width", "4", "--overwrite"]) == 0
    assert "updated the target's XLA summary" in capsys.readouterr().out
    after = json.loads((b / "edgespec.json").read_text())["formats"]["xla"]
    assert (after["target"]["max_length"], after["target"]["verify_width"]) == (32, 4)
    assert after["draft"] == before["draft"] and before["target"]["max_length"] == 64
    out = load(b, runtime="xla").generate([3, 9, 4], max_new_tokens=8, temperature=0.0, gamma=3)
    assert out.ids == load(b).generate([3, 9, 4], max_new_tokens=8, temperature=0.0, gamma=3).ids


def test_ctrl_c_while_xla_compiles_exits_130_not_a_crash(xla_bundle):
    """Interrupted while XLA compiled the artifacts, Python's shutdown ended in a segmentation fault
    inside JAX's unfinished work (exit 139; here, with these tiny artifacts, for a Ctrl-C 0.2-0.3 s
    into the target's compile); the program now leaves with 130 wherever the Ctrl-C lands."""
    import signal
    import subprocess
    import sys
    import time

    code = ("import signal, sys; signal.signal(signal.SIGINT, signal.default_int_handler)\n"
            "from edgespec.cli import console_main\n"
            f"sys.argv = ['edgespec', 'bench', {str(xla_bundle('llama'))!r}, '--runtime', 'xla', '--repeats', '1', "
            "'--gammas', '1,2,3,4,5,auto']\n"
            "sys.exit(console_main())\n")
    for delay in (0.1, 0.2, 0.3, 0.4):
        proc = subprocess.Popen([sys.executable, "-c", code], stderr=subprocess.PIPE, stdout=subprocess.DEVNULL, text=True)
        lines = []
        for line in proc.stderr:
            lines.append(line)
            if "compiling the target's XLA artifacts" in line:
                time.sleep(delay)
                proc.send_signal(signal.SIGINT)
                break
        err = "".join(lines) + proc.stderr.read()
        assert proc.wait(timeout=120) == 130, (delay, err)
        assert "edgespec bench: interrupted" in err and "Traceback" not in err
