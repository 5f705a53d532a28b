"""Issue 9, bad inputs: each case raises a typed EdgeSpecError whose message says how to fix it,
through the API and through the CLI (non-zero exit, message on stderr, no traceback, nothing
written). Cases already covered elsewhere are not repeated here; see the map in the issue report:

  test_api.py::test_bad_inputs / test_load_errors, test_generate_cli.py::test_cli_errors,
  test_core.py::test_bad_sampling_parameters / test_bad_generation_parameters / test_bad_prompts /
  test_non_finite_logits_fail_clearly, test_bundle.py (schema version, truncated/garbage/LFS .onnx,
  external data outside/symlink/hard link/missing), test_export.py (pickle-only, missing config /
  tokenizer, output exists, output inside input, tokenizer mismatch at export).
"""
from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import numpy as np
import pytest

from edgespec import contract
from edgespec.api import load
from edgespec.cli import main
from edgespec.errors import (BundleError, EdgeSpecError, InvalidArgumentError, ModelExecutionError, NonFiniteLogitsError,
                             PromptTooLongError, TokenizerMismatchError, UnsafeFileError)
from tiny_models import external_data_model

pytestmark = pytest.mark.slow

PROMPT = "the quick brown fox"


@pytest.fixture(scope="module")
def engine(tiny_bundle):
    return load(tiny_bundle("gpt2"), threads=1)


def cli_fails(argv, capsys, *needles, err_type=None):
    """Run the CLI; it must fail with every needle in stderr, no traceback, and print nothing on stdout."""
    rc = main([str(a) for a in argv])
    cap = capsys.readouterr()
    assert rc != 0, cap.err
    for needle in needles:
        assert needle in cap.err, cap.err
    assert "Traceback" not in cap.err and "Traceback" not in cap.out
    assert cap.out == "", cap.out
    return cap.err


def gen_argv(bundle, *extra, prompt=PROMPT):
    return [str(a) for a in ("generate", bundle, "--prompt", prompt, "--threads", "1", *extra)]


# ------------------------------------------------------------------------ prompts and lengths
def test_prompt_that_encodes_to_no_tokens(engine, tiny_bundle, capsys, monkeypatch):
    # a tokenizer that drops everything it has no pieces for (the tiny WordLevel one maps them to <unk>)
    from edgespec import api

    monkeypatch.setattr(api.Engine, "encode", lambda self, text: [])
    with pytest.raises(InvalidArgumentError, match="encodes to no tokens.*use other text"):
        engine.generate("\u2603\u2603")
    cli_fails(gen_argv(tiny_bundle("gpt2"), prompt="\u2603\u2603"), capsys, "encodes to no tokens")


def test_prompt_exactly_at_the_position_limit(engine, tiny_bundle, capsys):
    limit = engine.target.max_length                        # 128 for the tiny models
    out = engine.generate([4] * limit, max_new_tokens=1, temperature=0)  # fills every position: allowed
    assert len(out.ids) == 1
    with pytest.raises(PromptTooLongError, match=f"needs {limit + 1} of the target's {limit} positions .*at most 1"):
        engine.generate([4] * limit, max_new_tokens=2)  # (the numbers say why 1 is the most: the last token is not fed)
    with pytest.raises(PromptTooLongError, match=f"at most {limit}; shorten it|{limit} positions"):
        engine.generate([4] * (limit + 1), max_new_tokens=1)
    with pytest.raises(PromptTooLongError, match=f"shorten the prompt so that prompt tokens \\+ max_new_tokens - 1 <= {limit}") as e:
        engine.generate([4] * (limit + 50), max_new_tokens=5)    # no room at all: no "max_new_tokens <= 0" advice
    assert "at most 0" not in str(e.value)
    b = tiny_bundle("gpt2")
    words = " ".join(["fox"] * limit)
    assert main(gen_argv(b, "--max-new-tokens", "1", "--temperature", "0", "--json", prompt=words)) == 0
    capsys.readouterr()
    cli_fails(gen_argv(b, "--max-new-tokens", "2", prompt=words), capsys, "lower max_new_tokens to at most 1")
    cli_fails(gen_argv(b, "--max-new-tokens", "1", prompt=words + " fox"), capsys, str(limit))
    cli_fails(gen_argv(b, "--max-new-tokens", "100", prompt=" ".join(["fox"] * 60)), capsys, "at most 69")


def test_t5_takes_longer_prompts_when_its_config_says_so(tmp_path):
    """The seq2seq limit message says a larger n_positions in config.json lets a T5 take longer
    prompts (relative attention has no position table): exported so, it matches PyTorch past 512."""
    import json

    import numpy as np
    import torch
    from transformers import T5ForConditionalGeneration

    from edgespec.export.pipeline import export_bundle
    from tiny_models import make_t5

    t = make_t5(tmp_path / "t", seed=1)
    cfg = json.loads((t / "config.json").read_text())
    cfg["n_positions"] = 700
    (t / "config.json").write_text(json.dumps(cfg))
    export_bundle(t, tmp_path / "b", progress=None)
    eng = load(tmp_path / "b", threads=1)
    ids = [int(x) for x in np.random.default_rng(0).integers(4, 59, size=640)]
    got = np.stack([eng.target.prefill(np.array(ids)), *eng.target.extend(np.array([5, 7]))])   # [3, V]
    with torch.no_grad():
        ref = T5ForConditionalGeneration.from_pretrained(t).eval()(
            input_ids=torch.tensor([ids]), decoder_input_ids=torch.tensor([[0, 5, 7]])).logits[0].numpy()
    assert np.abs(got[:, :ref.shape[1]] - ref).max() < 1e-4


def test_seq2seq_prompt_limit(tiny_bundle, capsys):
    eng = load(tiny_bundle("t5"), threads=1)
    limit = eng.target.max_length
    assert len(eng.generate([5] * limit, max_new_tokens=2, temperature=0).ids) <= 2
    with pytest.raises(PromptTooLongError, match="encoder takes at most .*a larger n_positions in the checkpoint's config"):
        eng.generate([5] * (limit + 1), max_new_tokens=2)  # (relative attention: the count is the only limit)
    with pytest.raises(PromptTooLongError, match="decoder's .* positions .*the prompt does not count") as info:
        eng.generate([5] * 4, max_new_tokens=limit + 1)
    assert "shorten the prompt" not in str(info.value)
    # a 1-token prompt (as long as the decoder's start) straight through the core loop: same wording
    from edgespec.config import GenerationConfig
    from edgespec.loop import generate

    with pytest.raises(PromptTooLongError, match="decoder's .* positions") as info:
        generate(eng.target, [5], GenerationConfig(max_new_tokens=limit + 1), np.random.default_rng(0))
    assert "shorten the prompt" not in str(info.value)


# ------------------------------------------------------------------------- sampling settings
BAD_SETTINGS = [
    ({"temperature": -0.5}, ["--temperature", "-0.5"], "temperature (CLI --temperature) must be a finite number >= 0"),
    ({"temperature": float("nan")}, ["--temperature", "nan"], "temperature (CLI --temperature) must be a finite number >= 0"),
    ({"temperature": float("inf")}, ["--temperature", "inf"], "temperature"),
    ({"top_p": 0.0}, ["--top-p", "0"], "top_p (CLI --top-p) must be in (0, 1]"),
    ({"top_p": 1.5}, ["--top-p", "1.5"], "top_p (CLI --top-p) must be in (0, 1]"),
    ({"top_p": float("nan")}, ["--top-p", "nan"], "top_p (CLI --top-p) must be in (0, 1]"),
    ({"top_k": -1}, ["--top-k", "-1"], "top_k (CLI --top-k) must be an integer >= 0"),
    ({"top_k": 2.5}, None, "top_k (CLI --top-k) must be an integer >= 0"),
    ({"gamma": 0}, ["--gamma", "0"], "must be an integer >= 1"),
    ({"gamma": -3}, ["--gamma", "-3"], "must be an integer >= 1"),
    ({"gamma": 2.5}, ["--gamma", "2.5"], "gamma"),
    ({"lenience": 0.0}, ["--lenience", "0"], "lenience (CLI --lenience) must be in (0, 1]"),
    ({"lenience": 1.5}, ["--lenience", "1.5"], "lenience (CLI --lenience) must be in (0, 1]"),
    ({"lenience": float("nan")}, ["--lenience", "nan"], "lenience (CLI --lenience) must be in (0, 1]"),
    ({"max_new_tokens": 0}, ["--max-new-tokens", "0"], "max_new_tokens (CLI --max-new-tokens) must be an integer >= 1"),
    ({"seed": -1}, ["--seed", "-1"], "seed must be a non-negative integer"),
    ({"stop_token_ids": ["x"]}, None, "stop_token_ids must be a sequence of integer"),
    ({"stop_token_ids": [-1]}, None, "stop_token_ids must be non-negative"),
    ({"stop_token_ids": "12"}, None, "stop_token_ids must be a sequence of integer"),
]


@pytest.mark.parametrize("kwargs,argv,needle", BAD_SETTINGS, ids=[str(k) for k, _, _ in BAD_SETTINGS])
def test_bad_settings_api_and_cli(engine, tiny_bundle, capsys, kwargs, argv, needle):
    with pytest.raises(InvalidArgumentError) as info:
        engine.generate(PROMPT, **kwargs)
    assert needle in str(info.value)
    if argv is not None:
        cli_fails(gen_argv(tiny_bundle("gpt2"), *argv), capsys, needle)


def test_thread_counts_beyond_the_limit_are_refused(tiny_bundle, capsys):
    """A count ONNX Runtime's binding cannot take (int32) was a TypeError traceback."""
    from edgespec.runtimes.onnx_backend import MAX_THREADS
    for opt in ("--threads", "--draft-threads"):
        cli_fails(gen_argv(tiny_bundle("gpt2"), opt, "3000000000"), capsys, f"must be an integer from 0 to {MAX_THREADS}")
    cli_fails(["bench", tiny_bundle("gpt2"), "--threads", "3000000000"], capsys, f"from 0 to {MAX_THREADS}")


def test_non_integer_top_k_on_the_command_line_is_a_usage_error(tiny_bundle, capsys):
    with pytest.raises(SystemExit) as info:  # argparse: exit 2 with a usage line, no traceback
        main(gen_argv(tiny_bundle("gpt2"), "--top-k", "2.5"))
    err = capsys.readouterr().err
    assert info.value.code == 2 and "--top-k: invalid int value" in err and "Traceback" not in err


@pytest.mark.parametrize("argv", [["export", "--model", "m"], ["bench", "b"], ["distill", "--target", "t"], ["train-pair"]])
def test_an_empty_out_is_a_usage_error(argv, capsys, tmp_path, monkeypatch):
    """--out '' was the current folder (an export into an empty working folder wrote the bundle there)."""
    monkeypatch.chdir(tmp_path)
    with pytest.raises(SystemExit) as exc:
        main([*argv, "--out", ""])
    assert exc.value.code == 2 and "argument --out: is empty; give a folder path" in capsys.readouterr().err
    assert os.listdir(tmp_path) == []


def test_token_ids_outside_the_vocabulary(engine):
    for ids in ([-1, 4], [4, engine.target.vocab_size], [4, 10**12], np.array([4, -7], dtype=np.int8)):
        with pytest.raises(InvalidArgumentError, match=rf"\[0, {engine.vocab_size}\)|integers"):
            engine.generate(ids, max_new_tokens=2)
    with pytest.raises(InvalidArgumentError, match="integers"):
        engine.generate([[4, 5]], max_new_tokens=2)
    with pytest.raises(InvalidArgumentError, match="integers"):
        engine.generate([4.0, 5.0], max_new_tokens=2)
    with pytest.raises(InvalidArgumentError):
        engine.generate(None, max_new_tokens=2)


def test_gamma_width_onnx_any_width_works(engine):
    """ONNX graphs take any number of new tokens: gamma above the default max (8) is fine."""
    plain = engine.generate(PROMPT, max_new_tokens=40, temperature=0, use_draft=False)
    wide = engine.generate(PROMPT, max_new_tokens=40, temperature=0, gamma=30)
    assert wide.ids == plain.ids
    assert len(wide.stats.gamma_hist) > 9  # rounds really drafted more than 8 tokens


class _Width:
    """A backend with a fixed verify width (as the XLA runtime's artifacts have), over an ONNX one."""

    def __init__(self, inner, width):
        self._inner, self.verify_width = inner, width

    def __getattr__(self, name):
        return getattr(self._inner, name)

    def extend(self, ids):
        assert len(ids) <= self.verify_width, f"{len(ids)} tokens > verify width {self.verify_width}"
        self.widest = max(getattr(self, "widest", 0), len(ids))
        return self._inner.extend(ids)


def test_gamma_above_the_exported_verify_width(tiny_bundle):
    eng = load(tiny_bundle("gpt2"), threads=1)
    eng.target, eng.draft = _Width(eng.target, 4), _Width(eng.draft, 4)
    with pytest.raises(InvalidArgumentError, match=r"gamma=4 exceeds .*verify_width=4.*--verify-width 5"):
        eng.generate(PROMPT, gamma=4)
    plain = eng.generate(PROMPT, max_new_tokens=30, temperature=0, use_draft=False).ids
    assert eng.generate(PROMPT, max_new_tokens=30, temperature=0, gamma=3).ids == plain
    adaptive = eng.generate(PROMPT, max_new_tokens=30, temperature=0, gamma=None)  # capped at width - 1
    assert adaptive.ids == plain and len(adaptive.stats.gamma_hist) <= 4


@pytest.mark.parametrize("arch", ["llama", "t5"])
def test_plain_steps_between_rounds_keep_greedy_output(tiny_bundle, monkeypatch, arch):
    """The adaptive policy may take plain steps between rounds (where those are faster); a coin
    decides here. Greedy output stays plain decoding's for each drafter, and the draft catches up on
    the tokens it missed in calls of at most verify_width tokens (XLA artifacts' limit)."""
    from edgespec import adaptive

    coin = np.random.default_rng(0)
    monkeypatch.setattr(adaptive.AdaptiveGamma, "draft_next", lambda self: bool(coin.random() < 0.4))
    eng = load(tiny_bundle(arch), threads=1)
    eng.target, eng.draft = _Width(eng.target, 4), _Width(eng.draft, 4)
    plain = eng.generate(PROMPT, max_new_tokens=40, temperature=0, use_draft=False)
    for drafter in ("model", "lookahead", "hybrid"):
        out = eng.generate(PROMPT, max_new_tokens=40, temperature=0, drafter=drafter)
        assert out.ids == plain.ids, drafter
        assert out.stats.plain_steps >= 5 and out.stats.rounds >= 3, (drafter, out.stats)
    assert eng.draft.widest == 4  # the draft read missed tokens in calls as wide as allowed (rounds feed 1-2)
    eng.close()


# ---------------------------------------------------------------------------- model outputs
@pytest.mark.parametrize("where", ["prefill", "round"])
@pytest.mark.parametrize("bad", [np.nan, np.inf, "allneginf"])
def test_non_finite_logits_from_an_onnx_model(tiny_bundle, capsys, monkeypatch, where, bad):
    from edgespec.runtimes import onnx_backend

    bundle = tiny_bundle("gpt2")  # before the poison: the fixture's first use exports (and validates through _forward)
    real = onnx_backend.OnnxDecoderBackend._forward
    state = {"calls": 0}

    def poisoned(self, arr):
        out = real(self, arr)
        state["calls"] += 1
        if where == "prefill" or state["calls"] > 3:
            if isinstance(bad, str):
                out[-1, :] = -np.inf
            else:
                out[-1, 7] = bad
        return out

    monkeypatch.setattr(onnx_backend.OnnxDecoderBackend, "_forward", poisoned)
    eng = load(bundle, threads=1)
    for kwargs in ({"temperature": 0}, {"temperature": 1.0, "top_k": 5}, {"use_draft": False}):
        state["calls"] = 0
        with pytest.raises(NonFiniteLogitsError, match="NaN or \\+inf|-inf everywhere"):
            eng.generate(PROMPT, max_new_tokens=20, seed=0, **kwargs)
    state["calls"] = 0
    # seeded: unseeded sampling could hit EOS before the poisoned call and make the check flaky
    rc = main(gen_argv(bundle, "--max-new-tokens", "20", "--seed", "0"))
    cap = capsys.readouterr()
    assert rc != 0 and ("NaN or +inf" in cap.err or "-inf everywhere" in cap.err) and "Traceback" not in cap.err
    if where == "prefill":
        assert cap.out == ""  # nothing was generated before the failure


# ----------------------------------------------------------------------- files in the bundle
def _edit_onnx(path: Path, edit) -> None:
    import onnx

    m = onnx.load(str(path))
    edit(m)
    path.write_bytes(m.SerializeToString())


def test_unsupported_opset(bundle_copy, capsys):
    b = bundle_copy()

    def opset_99(m):
        for o in m.opset_import:
            if o.domain in ("", "ai.onnx"):
                o.version = 99

    _edit_onnx(b / "target" / contract.DECODER_FILE, opset_99)
    with pytest.raises(BundleError, match=r"opset\(s\) ai.onnx 99.*upgrade onnxruntime.*--opset"):
        load(b)
    cli_fails(gen_argv(b), capsys, "ai.onnx 99", "upgrade onnxruntime")


def test_corrupted_graph_that_still_parses(bundle_copy, capsys):
    b = bundle_copy()

    def bad_op(m):
        m.graph.node[len(m.graph.node) // 2].op_type = "NoSuchOperator"

    _edit_onnx(b / "draft" / contract.DECODER_FILE, bad_op)
    with pytest.raises(BundleError, match="ONNX Runtime cannot load.*re-export"):
        load(b)
    cli_fails(gen_argv(b), capsys, "cannot load", "re-export")


def _handmade_decoder(path: Path, layers=2, heads=2, head=16, vocab=96, drop=(), extra=(), drop_out=(), kv_heads=None):
    """A hand-made decoder graph with the edgespec IO contract (minus ``drop``) built with onnx.helper."""
    from onnx import TensorProto, helper

    kvh = kv_heads or heads
    ins = [helper.make_tensor_value_info("input_ids", TensorProto.INT64, ["b", "s"]),
           helper.make_tensor_value_info("attention_mask", TensorProto.INT64, ["b", "t"]),
           helper.make_tensor_value_info("position_ids", TensorProto.INT64, ["b", "s"])]
    outs, nodes = [], []
    for name in contract.decoder_past_names(layers):
        ins.append(helper.make_tensor_value_info(name, TensorProto.FLOAT, ["b", kvh, "p", head]))
        present = name.replace("past_key_values", "present")
        nodes.append(helper.make_node("Identity", [name], [present]))
        outs.append(helper.make_tensor_value_info(present, TensorProto.FLOAT, ["b", kvh, "p", head]))
    for name in extra:
        ins.append(helper.make_tensor_value_info(name, TensorProto.FLOAT, [1]))
    shape = helper.make_tensor("shape", TensorProto.INT64, [3], [1, 1, vocab])
    nodes += [helper.make_node("Cast", ["input_ids"], ["f"], to=TensorProto.FLOAT),
              helper.make_node("Unsqueeze", ["f", "axes"], ["f3"]),
              helper.make_node("Expand", ["f3", "shape"], ["logits"])]
    axes = helper.make_tensor("axes", TensorProto.INT64, [1], [2])
    outs.insert(0, helper.make_tensor_value_info("logits", TensorProto.FLOAT, ["b", "s", vocab]))
    ins = [i for i in ins if i.name not in drop]
    outs = [o for o in outs if o.name not in drop_out]
    nodes = [n for n in nodes if not set(n.input) & set(drop) and not set(n.output) & set(drop_out)]
    graph = helper.make_graph(nodes, "handmade", ins, outs, initializer=[shape, axes])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    model.ir_version = 8
    path.write_bytes(model.SerializeToString())


HANDMADE = [
    (dict(), None),  # the contract as written: loads
    (dict(drop=("position_ids",)), "no position_ids input"),
    (dict(drop=("past_key_values.1.value",), drop_out=("present.1.value",)), "missing input(s) past_key_values.1.value"),
    (dict(drop=contract.decoder_past_names(2), drop_out=contract.decoder_present_names(2)),
     "missing input(s) past_key_values.0.key"),  # a graph without a KV cache
    (dict(drop_out=("present.0.key",)), "missing output(s) present.0.key"),
    (dict(extra=("secret_input",)), "unexpected input(s) secret_input"),
    (dict(kv_heads=4), "the manifest says [batch, 2, seq, 16]"),
    (dict(vocab=50), "manifest says vocab 96"),
    # the same optimum-style graph under a manifest that promises the static (in-place KV) layout
    (dict(layout="static"), "unexpected input(s) position_ids"),
]


@pytest.mark.parametrize("status,error,needle", [
    ("Failed to allocate memory for requested buffer of size 2147483648", "InsufficientMemoryError",
     "do not fit in memory: free memory"),
    ("CUDA error cudaErrorLaunchFailure:unspecified launch failure", "ModelExecutionError",
     "the execution provider's device or libraries failed"),
    ("Got invalid dimensions for input: past_key_values.0.key", "ModelExecutionError", "re-export the bundle"),
])
def test_onnx_runtime_failures_get_the_advice_of_their_cause(status, error, needle):
    """Every ONNX Runtime run failure said "the graph does not match its manifest: re-export", an
    allocation failure included, which no re-export fixes (a review's find)."""
    import edgespec.errors
    from edgespec.runtimes.onnx_backend import _Binder

    def run(_c, _opts):  # what ORT raises, as it words it
        raise RuntimeError("[ONNXRuntimeError] : 6 : RUNTIME_EXCEPTION : Non-zero status code returned while running "
                           f"MatMul node. Name:'/lm_head/MatMul' Status Message: {status}")

    binder = _Binder.__new__(_Binder)
    binder._where, binder._c, binder._opts, binder._run = "decoder.onnx", None, None, run
    with pytest.raises(getattr(edgespec.errors, error), match=f"ONNX Runtime failed running decoder.onnx: .*{needle}") as info:
        binder.run()
    assert isinstance(info.value, EdgeSpecError) and type(info.value).__name__ == error


def test_a_corrupt_graph_in_a_folder_named_after_a_provider_is_still_told_to_re_export(tmp_path):
    """ONNX Runtime's load message holds the model's path: its words must not make a corrupt file
    read as a device failure (a folder named qnn_models or rocm)."""
    from edgespec.runtimes.onnx_backend import SessionConfig, make_session

    for name in ("qnn_models", "rocm", "out_of_memory"):
        path = tmp_path / name / contract.DECODER_FILE
        path.parent.mkdir()
        path.write_bytes(b"not a protobuf at all")
        with pytest.raises(BundleError, match="the file is corrupt or not an edgespec export: re-export") as info:
            make_session(path, SessionConfig())
        assert type(info.value) is BundleError, name


@pytest.mark.parametrize("kwargs,needle", HANDMADE, ids=[n or "ok" for _, n in HANDMADE])
def test_handmade_onnx_with_missing_inputs(bundle_copy, capsys, kwargs, needle):
    b = bundle_copy()
    kwargs = dict(kwargs)
    layout = kwargs.pop("layout", contract.KV_CONCAT)
    _handmade_decoder(b / "target" / contract.DECODER_FILE, **kwargs)
    manifest = json.loads((b / contract.MANIFEST_NAME).read_text())
    manifest["models"]["target"]["kv_layout"] = layout  # the handmade graph follows the concat contract
    (b / contract.MANIFEST_NAME).write_text(json.dumps(manifest))
    if needle is None:
        # the IO contract holds, so it loads; but its KV outputs do not grow: ONNX Runtime's failure
        # at run time is a ModelExecutionError, not a raw onnxruntime exception
        eng = load(b, threads=1)
        with pytest.raises(ModelExecutionError, match="ONNX Runtime failed running model.onnx.*re-export"):
            eng.generate(PROMPT, max_new_tokens=4)
        cli_fails(gen_argv(b), capsys, "ONNX Runtime failed running")
        return
    with pytest.raises(BundleError, match="re-export") as info:
        load(b, threads=1)
    assert needle in str(info.value)
    cli_fails(gen_argv(b), capsys, needle)


def _external(bundle: Path, location: str) -> None:
    external_data_model(bundle / "target" / contract.DECODER_FILE, location)


@pytest.mark.parametrize("case", ["missing", "dotdot", "absolute", "symlink", "hardlink", "dir-symlink"])
def test_external_data_api_and_cli(bundle_copy, tmp_path, capsys, case):
    b = bundle_copy()
    secret = tmp_path / "secret.bin"
    secret.write_bytes(b"\0" * 16)
    loc = {"missing": "w.bin", "dotdot": "../../secret.bin", "absolute": str(secret), "symlink": "w.bin",
           "hardlink": "w.bin", "dir-symlink": "sub/secret.bin"}[case]
    if case == "symlink":
        os.symlink(secret, b / "target" / "w.bin")
    elif case == "hardlink":
        os.link(secret, b / "target" / "w.bin")
    elif case == "dir-symlink":
        os.symlink(tmp_path, b / "target" / "sub")
    _external(b, loc)
    err_type = BundleError if case == "missing" else UnsafeFileError
    needle = {"missing": "missing", "dotdot": "outside", "absolute": "outside", "symlink": "symbolic link",
              "hardlink": "hard link", "dir-symlink": "outside"}[case]
    with pytest.raises(err_type, match=needle):
        load(b)
    cli_fails(gen_argv(b), capsys, needle)


@pytest.mark.parametrize("what", ["draft-folder", "graph", "tokenizer", "config"])
def test_bundle_files_linked_from_outside_are_refused(bundle_copy, tmp_path, capsys, what):
    """As external data: a model folder, graph, tokenizer or config.json that resolves outside the
    bundle (a symbolic link out of it) is refused; a link that stays inside is fine."""
    b = bundle_copy()
    rel = {"draft-folder": "draft", "graph": f"target/{contract.DECODER_FILE}", "tokenizer": f"target/{contract.TOKENIZER_FILE}",
           "config": f"target/{contract.CONFIG_FILE}"}[what]
    real = tmp_path / "elsewhere" / Path(rel).name
    real.parent.mkdir()
    shutil.move(b / rel, real)
    os.symlink(real, b / rel)
    with pytest.raises(UnsafeFileError, match="resolves outside the bundle"):
        load(b)
    cli_fails(gen_argv(b), capsys, "resolves outside the bundle")
    os.unlink(b / rel)
    shutil.move(real, b / "inside")
    os.symlink(b / "inside", b / rel)                       # a link within the bundle
    assert load(b).generate(PROMPT, max_new_tokens=2, temperature=0).ids


def test_bundle_tokenizer_files(bundle_copy, capsys):
    b = bundle_copy()
    (b / "target" / contract.TOKENIZER_FILE).unlink()
    with pytest.raises(BundleError, match="missing.*tokenizer.json.*re-export"):
        load(b)
    cli_fails(gen_argv(b), capsys, "tokenizer.json")
    (b / "target" / contract.TOKENIZER_FILE).mkdir()  # a folder where the file should be: said so, not "missing"
    with pytest.raises(BundleError, match="tokenizer.json is a folder, not the file"):
        load(b)
    (b / "target" / contract.TOKENIZER_FILE).rmdir()
    (b / "target" / contract.TOKENIZER_FILE).write_text("{ not a tokenizer")
    with pytest.raises(BundleError, match="cannot be read.*re-export"):
        load(b)
    cli_fails(gen_argv(b), capsys, "cannot be read")


def test_draft_with_a_different_tokenizer_in_the_bundle(bundle_copy, capsys):
    """A bundle assembled by hand: the draft's tokenizer maps text to other ids than the target's."""
    b = bundle_copy()
    path = b / "draft" / contract.TOKENIZER_FILE
    tok = json.loads(path.read_text())
    vocab = tok["model"]["vocab"]
    vocab["fox"], vocab["dog"] = vocab["dog"], vocab["fox"]
    path.write_text(json.dumps(tok))
    with pytest.raises(TokenizerMismatchError, match="draft's tokenizer differs.*load_draft=False"):
        load(b)
    cli_fails(gen_argv(b), capsys, "tokenizer differs")
    assert load(b, load_draft=False).generate(PROMPT, max_new_tokens=3, temperature=0).ids  # the fix it names works


@pytest.mark.parametrize("mutate,needle", [
    (lambda d: d["models"]["target"].update(files={"decoder": "../../x.onnx"}), "not a plain file name"),
    (lambda d: d["models"]["target"].update(path="../target"), "leaves the bundle"),
    (lambda d: d["models"]["target"].update(num_layers=10**9), "num_layers must be an integer"),
    (lambda d: d["models"]["target"].update(max_positions=2**40), "max_positions must be an integer"),
    (lambda d: d["models"]["target"].update(vocab_size="96"), "vocab_size must be an integer"),
    (lambda d: d.update(models=[]), "'models' must be an object"),
    (lambda d: d.update(schema_version="1"), "schema_version is the string '1'; it must be the integer 1"),
    (lambda d: d.update(shared_vocab_size=0), "shared_vocab_size"),
    (lambda d: d["models"]["target"].pop("parameter_bytes"), "model 'target' lacks parameter_bytes"),
    (lambda d: d["models"]["target"].update(colour="red"), "has unknown fields colour"),
    (lambda d: d.pop("shared_vocab_size"), "it lacks shared_vocab_size"),
    (lambda d: d["models"]["target"].update(kind="bogus"), "target.kind must be one of"),
    (lambda d: d["models"]["target"].update(quantization="int3"), "target.quantization one of"),
    (lambda d: d["models"]["target"].update(dtype="fp8"), "target.dtype must be one of"),
    (lambda d: d.update(format="other"), "format is 'other'"),
    (lambda d: d["models"]["target"].update(tokenizer_size=500), "tokenizer has 500 ids"),
    # a static-KV graph whose manifest lost its kv_layout (concat by default): the manifest is named
    (lambda d: d["models"]["target"].pop("kv_layout"), "the manifest lost this model's kv_layout"),
    # the draft shares the target's tokenizer file: the message names that file as the target's
    (lambda d: d["models"]["draft"].update(tokenizer_size=500),
     "draft tokenizer has 500 ids; the target's tokenizer ("),
])
def test_manifest_fields_are_validated(bundle_copy, capsys, mutate, needle):
    b = bundle_copy()
    data = json.loads((b / contract.MANIFEST_NAME).read_text())
    mutate(data)
    (b / contract.MANIFEST_NAME).write_text(json.dumps(data))
    with pytest.raises(BundleError) as info:
        load(b)
    assert needle in str(info.value) and "re-export" in str(info.value)
    cli_fails(gen_argv(b), capsys, needle)


def test_bundle_with_a_dynamic_int8_target_warns(bundle_copy, capsys):
    """Bundles from before the causal int8 target warn that speculation is not exact for them, with
    the draft model or without it (prompt lookup verifies several tokens per call too)."""
    from edgespec.errors import EdgeSpecWarning

    b = bundle_copy()
    data = json.loads((b / contract.MANIFEST_NAME).read_text())
    data["models"]["target"]["quantization"] = contract.QUANT_DYNAMIC_INT8
    (b / contract.MANIFEST_NAME).write_text(json.dumps(data))
    for kw in ({}, {"load_draft": False}):
        with pytest.warns(EdgeSpecWarning, match="re-export"):
            load(b, **kw)
    assert main(gen_argv(b)) == 0
    assert "not distributed exactly" in capsys.readouterr().err


def test_unknown_runtime_and_missing_xla_artifacts(tiny_bundle, capsys):
    with pytest.raises(InvalidArgumentError, match="runtime must be"):
        load(tiny_bundle("gpt2"), runtime="tpu-magic")
    argv = ["generate", str(tiny_bundle("gpt2")), "--prompt", PROMPT, "--runtime", "xla"]  # no --threads: ORT only
    cli_fails(argv, capsys, "no XLA artifacts", "--format onnx+xla")


# ------------------------------------------------------------------------------ export inputs
def _nothing(out: Path) -> bool:
    return not out.exists() and not list(out.parent.glob(f".{out.name}.partial-*"))


def test_export_output_equal_to_or_containing_the_input(tiny_checkpoints, tmp_path, capsys):
    target, _ = tiny_checkpoints("gpt2")
    ck = tmp_path / "ck"
    shutil.copytree(target, ck)
    before = sorted(p.name for p in ck.iterdir())
    cli_fails(["export", "--model", ck, "--out", ck, "--overwrite"], capsys, "inside the input checkpoint")
    cli_fails(["export", "--model", ck, "--out", ck / "sub" / "b"], capsys, "inside the input checkpoint")
    cli_fails(["export", "--model", ck, "--out", tmp_path, "--overwrite"], capsys, "lies inside the output folder")
    assert sorted(p.name for p in ck.iterdir()) == before
    assert not list(tmp_path.glob(".*partial-*"))


def test_export_missing_tokenizer_and_existing_output_cli(tiny_checkpoints, tmp_path, capsys):
    target, _ = tiny_checkpoints("gpt2")
    ck = tmp_path / "ck"
    shutil.copytree(target, ck)
    (ck / "tokenizer.json").unlink()
    cli_fails(["export", "--model", ck, "--out", tmp_path / "o"], capsys, "has no tokenizer.json", "save_pretrained")
    assert _nothing(tmp_path / "o")
    (tmp_path / "busy").mkdir()
    (tmp_path / "busy" / "x").write_text("keep")
    cli_fails(["export", "--model", target, "--out", tmp_path / "busy"], capsys, "--overwrite")
    assert (tmp_path / "busy" / "x").read_text() == "keep"


def test_provider_not_installed_for_export_free_paths(tiny_bundle, capsys):
    with pytest.raises(EdgeSpecError, match="not available.*available:.*cpu"):
        load(tiny_bundle("gpt2"), providers="cpu,tensorrt")
    cli_fails(gen_argv(tiny_bundle("gpt2"), "--provider", "openvino"), capsys, "not available", "Install")


def test_a_hand_edited_max_positions_is_refused_at_load(bundle_copy, capsys):
    """A manifest promising more positions than the model was exported for failed only when
    generation got there (text already streamed; a trial's find): it is refused at load, from the
    config.json export writes beside the graphs. Fewer positions than exported stay allowed."""
    for arch in ("llama", "gpt2", "t5"):
        b = bundle_copy(arch)
        manifest = json.loads((b / contract.MANIFEST_NAME).read_text())
        n = manifest["models"]["target"]["max_positions"]
        manifest["models"]["target"]["max_positions"] = n + 1
        (b / contract.MANIFEST_NAME).write_text(json.dumps(manifest))
        with pytest.raises(BundleError, match=f"max_positions {n + 1}, but the model takes {n} positions"):
            load(b, threads=1)
        cli_fails(gen_argv(b), capsys, "the manifest was edited, or an older exporter wrote it")
        manifest["models"]["target"]["max_positions"] = n - 1
        (b / contract.MANIFEST_NAME).write_text(json.dumps(manifest))
        assert load(b, threads=1).generate(PROMPT, max_new_tokens=2).ids


def test_a_model_past_its_graph_positions_fails_typed_and_once(bundle_copy, capfd):
    """Where the cross-check cannot see it (no config.json beside the graph), a manifest promising
    more positions than the static graph's rotary tables hold fails when generation gets there, as a
    ModelExecutionError naming the fix; ONNX Runtime's own log line of the same error (colored, on
    stderr) no longer prints it a second time."""
    b = bundle_copy("llama")
    (b / "target" / contract.CONFIG_FILE).unlink()
    (b / "draft" / contract.CONFIG_FILE).unlink()
    manifest = json.loads((b / contract.MANIFEST_NAME).read_text())
    assert manifest["models"]["target"]["kv_layout"] == contract.KV_STATIC
    n = manifest["models"]["target"]["max_positions"]
    for m in manifest["models"].values():
        m["max_positions"] = 2 * n
    (b / contract.MANIFEST_NAME).write_text(json.dumps(manifest))
    eng = load(b, threads=1)
    capfd.readouterr()
    with pytest.raises(ModelExecutionError, match="cos_cache.*re-export the bundle"):
        eng.generate([4 + i % 50 for i in range(n - 2)], max_new_tokens=8, temperature=0)
    err = capfd.readouterr().err
    assert "onnxruntime" not in err and "GroupQueryAttention" not in err, err
