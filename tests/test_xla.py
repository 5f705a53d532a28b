"""XLA reference path: lean JAX GPT-2 / Llama / T5 definitions, jax.export artifacts, XlaBackend."""
from __future__ import annotations

import json
import shutil
from functools import partial
from pathlib import Path

import numpy as np
import pytest

jax = pytest.importorskip("jax")
torch = pytest.importorskip("torch")
pytest.importorskip("transformers")
pytest.importorskip("safetensors")

import jax.numpy as jnp  # noqa: E402

from edgespec.errors import (  # noqa: E402
    BundleError,
    CheckpointError,
    InvalidArgumentError,
    OutputExistsError,
    PromptTooLongError,
    ProviderError,
    UnsupportedArchitectureError,
    ValidationError,
)
from edgespec.export.xla import export_xla  # noqa: E402
from edgespec.runtimes import xla_models as xm  # noqa: E402
from edgespec.runtimes.xla_backend import XlaBackend  # noqa: E402

from tiny_models import make_gpt2, make_llama, make_pair, make_t5  # noqa: E402

TOL = 1e-4
MAX_LEN = 40
VERIFY = 4
WIDTHS = (1, 2, 4)        # width 3 runs the width-4 artifact, padded
BUCKETS = (8, 32)         # prompts of 33..40 tokens: bucket 32, then chunked extends
MAX_SRC = 16
ARCHS = ["gpt2", "gpt2_untied", "llama", "llama_tied", "t5", "t5_v11"]
MAX_DIFF: dict[str, float] = {}


def _make_llama_tied(folder: Path) -> Path:
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(3)
    cfg = LlamaConfig(vocab_size=96, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=1, max_position_embeddings=128,
                      bos_token_id=3, eos_token_id=1, pad_token_id=0, tie_word_embeddings=True,
                      rope_theta=500.0)
    m = LlamaForCausalLM(cfg).eval()
    m.save_pretrained(str(folder), safe_serialization=True)
    return folder


def _make_gpt2_untied(folder: Path) -> Path:
    """GPT-2 with its own output layer (tie_word_embeddings=false; the XLA path once always used wte)."""
    from transformers import GPT2Config, GPT2LMHeadModel

    torch.manual_seed(5)
    cfg = GPT2Config(vocab_size=96, n_positions=128, n_embd=32, n_layer=2, n_head=2, bos_token_id=3, eos_token_id=1,
                     pad_token_id=0, tie_word_embeddings=False)
    m = GPT2LMHeadModel(cfg).eval()
    assert m.lm_head.weight.data_ptr() != m.transformer.wte.weight.data_ptr()
    m.save_pretrained(str(folder), safe_serialization=True)
    return folder


def _make_t5_v11(folder: Path) -> Path:
    """T5 v1.1 layout: gated-gelu feed-forward, untied lm_head, fewer decoder than encoder layers (HF generate breaks on the converse)."""
    from transformers import T5Config, T5ForConditionalGeneration

    torch.manual_seed(4)
    cfg = T5Config(vocab_size=96, d_model=32, d_kv=8, d_ff=48, num_layers=2, num_decoder_layers=1,
                   num_heads=4, pad_token_id=0, eos_token_id=1, decoder_start_token_id=0,
                   relative_attention_num_buckets=8, relative_attention_max_distance=16,
                   feed_forward_proj="gated-gelu", tie_word_embeddings=False)
    m = T5ForConditionalGeneration(cfg).eval()
    m.save_pretrained(str(folder), safe_serialization=True)
    return folder


@pytest.fixture(scope="module")
def root(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("xla")


@pytest.fixture(scope="module")
def checkpoints(root) -> dict[str, Path]:
    return {
        "gpt2": make_gpt2(root / "gpt2", seed=1),
        "llama": make_llama(root / "llama", seed=1),
        "gpt2_untied": _make_gpt2_untied(root / "gpt2_untied"),
        "llama_tied": _make_llama_tied(root / "llama_tied"),
        "t5": make_t5(root / "t5", seed=1),
        "t5_v11": _make_t5_v11(root / "t5_v11"),
    }


@pytest.fixture(scope="module")
def hf_models(checkpoints):
    from transformers import AutoModelForCausalLM, AutoModelForSeq2SeqLM

    out = {}
    for name, path in checkpoints.items():
        cls = AutoModelForSeq2SeqLM if name.startswith("t5") else AutoModelForCausalLM
        out[name] = cls.from_pretrained(str(path)).eval()
    return out


def prompt_sizes(arch: str, buckets=(16,), max_source_length=None) -> dict:
    """Decoder-only models take prefill buckets, T5 an encoder length (either for the other is an error)."""
    return {"max_source_length": max_source_length or MAX_SRC} if arch.startswith("t5") else {"prefill_buckets": buckets}


@pytest.fixture(scope="module")
def exported(root, checkpoints) -> dict[str, Path]:
    out = {}
    for name, path in checkpoints.items():
        export_xla(path, root / f"bundle-{name}", platforms=("cpu",), max_length=MAX_LEN, verify_width=VERIFY,
                   widths=WIDTHS, **prompt_sizes(name, BUCKETS))
        out[name] = root / f"bundle-{name}"
    return out


@pytest.fixture(scope="module")
def backends(exported) -> dict[str, XlaBackend]:
    return {name: XlaBackend.from_dir(path) for name, path in exported.items()}


def _hf_logits(model, name: str, seq: np.ndarray, src: np.ndarray | None = None) -> np.ndarray:
    """Logits of every position of ``seq`` (decoder sequence for T5; ``src`` = encoder input)."""
    with torch.no_grad():
        if name.startswith("t5"):
            return model(input_ids=torch.tensor(src[None]), decoder_input_ids=torch.tensor(seq[None])).logits[0].numpy()
        return model(torch.tensor(seq[None])).logits[0].numpy()


def _record(name: str, diff: float) -> None:
    MAX_DIFF[name] = max(MAX_DIFF.get(name, 0.0), float(diff))


RNG = np.random.default_rng(0)
PROMPT = RNG.integers(4, 60, size=11)
CONT = RNG.integers(4, 60, size=9)


# ----------------------------------------------------------------------------------------- (a)

@pytest.mark.parametrize("name", ARCHS)
def test_jax_definition_matches_torch(name, checkpoints, hf_models):
    spec, params = xm.load_model(checkpoints[name])
    p = {k: jnp.asarray(v) for k, v in params.items()}
    model = hf_models[name]
    if spec.encoder_decoder:
        src = PROMPT[:7]
        seq = np.concatenate([[0], CONT])
        ref = _hf_logits(model, name, seq, src)
        padded = np.zeros(MAX_SRC, np.int32)
        padded[:7] = src
        cross, kv = jax.jit(partial(xm.t5_encode, spec, MAX_LEN))(p, jnp.asarray(padded), jnp.int32(7))
        t5_step = jax.jit(partial(xm.t5_step, spec))
        step = lambda kv, ids, pos: t5_step(p, kv, cross, jnp.int32(7), ids, pos)  # noqa: E731
    else:
        seq = np.concatenate([PROMPT, CONT])
        ref = _hf_logits(model, name, seq)
        kv = xm.init_kv(spec, MAX_LEN)
        dec_step = jax.jit(partial(xm.decoder_step, spec))
        step = lambda kv, ids, pos: dec_step(p, kv, ids, pos)  # noqa: E731
    # a "prefill" block, then a 1-token extend, then a multi-token extend
    cuts = [0, 5, 6, len(seq)]
    got = []
    for a, b in zip(cuts, cuts[1:]):
        logits, kv = step(kv, jnp.asarray(seq[a:b], jnp.int32), jnp.int32(a))
        got.append(np.asarray(logits))
    got = np.concatenate(got)
    diff = np.abs(got - ref).max()
    _record(f"{name}/definition", diff)
    assert got.shape == ref.shape
    assert diff < TOL, f"{name}: max |jax - torch| = {diff}"
    if not spec.encoder_decoder:  # padded prefill: logits of the last real token
        padded = np.zeros(16, np.int32)
        padded[:11] = PROMPT
        last, _ = jax.jit(partial(xm.decoder_prefill, spec, MAX_LEN))(p, jnp.asarray(padded), jnp.int32(11))
        d2 = np.abs(np.asarray(last) - _hf_logits(model, name, PROMPT)[-1]).max()
        _record(f"{name}/definition", d2)
        assert d2 < TOL


# ----------------------------------------------------------------------------------------- (b)

def test_manifest_is_self_describing(exported):
    m = json.loads((exported["llama"] / "xla" / "xla.json").read_text())
    assert m["format"] == "edgespec-xla" and m["format_version"] == 1
    assert m["model_type"] == "llama" and m["platforms"] == ["cpu"]
    assert m["max_length"] == MAX_LEN and m["verify_width"] == VERIFY and m["widths"] == list(WIDTHS)
    assert m["prefill_buckets"] == list(BUCKETS) and m["jax_version"] == jax.__version__
    assert m["kv_shape"] == [2, 1, 2, MAX_LEN, 16]  # 2 layers, batch 1, 2 KV heads, head size 16
    for kind in ("prefill", "extend"):
        for entry in m["artifacts"][kind].values():
            assert (exported["llama"] / "xla" / entry["file"]).stat().st_size > 0
    # weights are arguments, not constants: the artifacts are far smaller than the weights
    wsize = (exported["llama"] / "xla" / "weights.safetensors").stat().st_size
    assert all((exported["llama"] / "xla" / e["file"]).stat().st_size < wsize for e in m["artifacts"]["extend"].values())
    t5 = json.loads((exported["t5"] / "xla" / "xla.json").read_text())
    assert t5["encoder_decoder"] and t5["max_source_length"] == MAX_SRC and "encode" in t5["artifacts"]


@pytest.mark.parametrize("name", ARCHS)
def test_export_validates_the_artifacts_against_torch(name, exported):
    v = json.loads((exported[name] / "xla" / "xla.json").read_text())["validation"]
    longest = {"prefill_longest_prompt"} if name.startswith("t5") else set()  # T5: the largest encoder bucket too
    assert v["platform"] == "cpu" and set(v["stages"]) == {"prefill", "step_1", f"step_{VERIFY}"} | longest
    assert 0 <= v["max_abs_diff"] == max(v["stages"].values()) < TOL
    _record(f"{name}/export-validation", v["max_abs_diff"])


@pytest.mark.parametrize("name", ["llama", "t5"])
def test_export_refuses_artifacts_that_differ_from_torch(name, root, checkpoints, monkeypatch):
    """A mutant JAX reading of the checkpoint (one weight off by 1%, as a misread config field would
    be): the export fails and leaves no folder."""
    real = xm.load_model

    def misread(path):
        spec, params = real(path)
        key = "model.norm.weight" if name == "llama" else "decoder.final_layer_norm.weight"
        return spec, {**params, key: params[key] * np.float32(1.01)}

    monkeypatch.setattr(xm, "load_model", misread)
    out = root / f"mutant-{name}"
    with pytest.raises(ValidationError, match="differ from PyTorch.*raise --atol.*without --format onnx[+]xla"):
        export_xla(checkpoints[name], out, max_length=16, verify_width=4, **prompt_sizes(name, (16,), 8))
    assert not out.exists()  # the folder it made is gone too
    # --overwrite over a good export: the failed one leaves the good one as it was
    monkeypatch.setattr(xm, "load_model", real)
    export_xla(checkpoints[name], out, max_length=16, verify_width=4, **prompt_sizes(name, (16,), 8))
    before = (out / "xla" / "xla.json").read_text()
    monkeypatch.setattr(xm, "load_model", misread)
    with pytest.raises(ValidationError):
        export_xla(checkpoints[name], out, max_length=16, verify_width=4, **prompt_sizes(name, (16,), 8),
                   overwrite=True)
    assert (out / "xla" / "xla.json").read_text() == before
    assert [p.name for p in out.iterdir()] == ["xla"]  # no partial or old folder left beside it


def test_export_validation_edge_cases(root, checkpoints, monkeypatch):
    import sys

    # buffers too small for a prefill, a 1-token step and the verify width: the verify width is kept
    m = export_xla(checkpoints["gpt2"], root / "tiny-buffers", max_length=3, verify_width=2, prefill_buckets=(2,))
    assert set(m["validation"]["stages"]) == {"prefill", "step_2"}
    for bad in (0, -1.0, float("nan"), True):
        with pytest.raises(InvalidArgumentError, match="atol"):
            export_xla(checkpoints["gpt2"], root / "bad-atol", max_length=16, atol=bad)
    assert not (root / "bad-atol").exists()
    # the xla extra alone (no PyTorch): the artifacts are written, the check says why it did not run
    monkeypatch.setitem(sys.modules, "torch", None)
    m = export_xla(checkpoints["gpt2"], root / "no-torch", max_length=16, verify_width=2, prefill_buckets=(16,))
    assert "edgespec[export]" in m["validation"]["skipped"]
    assert (root / "no-torch" / "xla" / "xla.json").is_file()


@pytest.mark.parametrize("name", ARCHS)
def test_backend_prefill_extend_rewind(name, backends, hf_models):
    be = backends[name]
    model = hf_models[name]
    enc = name.startswith("t5")
    src = PROMPT[:7] if enc else PROMPT
    seq = np.concatenate([[0], CONT]) if enc else np.concatenate([PROMPT, CONT])
    ref = _hf_logits(model, name, seq, src if enc else None)
    base = 1 if enc else len(PROMPT)

    first = be.prefill(src.astype(np.int64))
    assert first.dtype == np.float32 and first.shape == (be.vocab_size,)
    assert be.length == base
    diffs = [np.abs(first - ref[base - 1]).max()]
    # 1, 3 (padded to 4), 4 tokens
    pos = base
    for k in (1, 3, 4):
        rows = be.extend(CONT[pos - base: pos - base + k])
        assert rows.shape == (k, be.vocab_size)
        diffs.append(np.abs(rows - ref[pos:pos + k]).max())
        pos += k
    assert be.length == pos
    # reject the last 5 tokens, extend different ones, then compare with a fresh prefill
    be.rewind_to(pos - 5)
    alt = np.array([7, 8, 9], np.int64)
    rows = be.extend(alt)
    full = np.concatenate([seq[:pos - 5], alt])
    ref2 = _hf_logits(model, name, full, src if enc else None)
    diffs.append(np.abs(rows - ref2[-3:]).max())
    if not enc:
        fresh = be.prefill(full)
        diffs.append(np.abs(fresh - rows[-1]).max())
        assert be.length == len(full)
    diff = max(diffs)
    _record(f"{name}/backend", diff)
    assert diff < TOL, f"{name}: {diffs}"
    be.free()
    assert be.length == 0


@pytest.mark.parametrize("name", ["gpt2", "llama"])
def test_prompt_longer_than_largest_bucket_is_chunked(name, backends, hf_models):
    be = backends[name]
    prompt = np.random.default_rng(1).integers(4, 60, size=37)  # > bucket 32, <= max_length 40
    got = be.prefill(prompt)
    ref = _hf_logits(hf_models[name], name, prompt)[-1]
    assert be.length == 37
    diff = np.abs(got - ref).max()
    _record(f"{name}/backend", diff)
    assert diff < TOL


# ----------------------------------------------------------------------------------------- (c)

def _hf_greedy(model, name, prompt, n):
    with torch.no_grad():
        ids = torch.tensor(prompt[None])
        out = model.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False, max_new_tokens=n,
                             pad_token_id=0, num_beams=1)[0].numpy()
    out = [int(t) for t in (out[1:] if name.startswith("t5") else out[len(prompt):])]
    assert len(out) == n or out[-1] == 1, out  # stopped early only at EOS (id 1)
    assert len(out) >= 3, "the tiny model emits EOS almost at once; pick another seed/prompt"
    return out


def _backend_greedy(be, prompt, n):
    tok = int(np.argmax(be.prefill(prompt)))
    out = [tok]
    while len(out) < n:
        tok = int(np.argmax(be.extend(np.array([tok]))[0]))
        out.append(tok)
    return out


@pytest.mark.parametrize("name", ARCHS)
def test_greedy_matches_hf_generate(name, backends, hf_models):
    n = 12
    prompt = PROMPT[:7] if name.startswith("t5") else PROMPT
    ref = _hf_greedy(hf_models[name], name, prompt, n)
    got = _backend_greedy(backends[name], prompt.astype(np.int64), n)
    assert got[:len(ref)] == ref


def _speculative_greedy(target, draft, prompt, n, gamma):
    """Greedy speculative decoding over two backends (exercises multi-token verify + rewind)."""
    t_logits = target.prefill(prompt)
    draft.prefill(prompt)
    out: list[int] = []
    pending = int(np.argmax(t_logits))  # next token, decided by the target
    while len(out) < n:
        out.append(pending)
        base_t = target.length
        base_d = draft.length
        drafts = []
        tok = pending
        for _ in range(gamma):
            tok = int(np.argmax(draft.extend(np.array([tok]))[0]))
            drafts.append(tok)
        rows = target.extend(np.array([pending, *drafts]))
        accepted = 0
        for i, d in enumerate(drafts):
            if int(np.argmax(rows[i])) != d or len(out) >= n:
                break
            out.append(d)
            accepted += 1
        pending = int(np.argmax(rows[accepted]))
        target.rewind_to(base_t + 1 + accepted)
        if accepted == gamma:  # all drafts accepted: the draft has not seen the last one yet
            draft.extend(np.array([drafts[-1]]))
        else:
            draft.rewind_to(base_d + 1 + accepted)
    return out[:n]


@pytest.mark.parametrize("arch", ["gpt2", "llama", "t5"])
def test_speculative_greedy_over_xla_equals_hf_generate(arch, root, hf_models):
    from transformers import AutoModelForCausalLM, AutoModelForSeq2SeqLM

    target_ckpt, draft_ckpt = make_pair(root / f"pair-{arch}", arch)
    bes = []
    for ckpt in (target_ckpt, draft_ckpt):
        export_xla(ckpt, ckpt.parent / f"{ckpt.name}-xla", max_length=MAX_LEN, verify_width=VERIFY, widths=WIDTHS,
                   **prompt_sizes(arch))
        bes.append(XlaBackend.from_dir(ckpt.parent / f"{ckpt.name}-xla"))
    cls = AutoModelForSeq2SeqLM if arch == "t5" else AutoModelForCausalLM
    model = cls.from_pretrained(str(target_ckpt)).eval()
    prompt = PROMPT[:7]
    n = 15
    ref = _hf_greedy(model, arch, prompt, n)
    for gamma in (1, 3):
        got = _speculative_greedy(bes[0], bes[1], prompt.astype(np.int64), n, gamma)
        assert got[:len(ref)] == ref


@pytest.mark.parametrize("name", ["llama", "t5"])
def test_speculative_self_draft_accepts_everything(name, exported, hf_models):
    """Target as its own draft: every block is accepted (the draft catches up by one token)."""
    target = XlaBackend.from_dir(exported[name])
    draft = XlaBackend.from_dir(exported[name])
    prompt = PROMPT[:7]
    ref = _hf_greedy(hf_models[name], name, prompt, 13)
    got = _speculative_greedy(target, draft, prompt.astype(np.int64), 13, VERIFY - 1)
    assert got[:len(ref)] == ref


def test_cli_hook(root, checkpoints, capsys):
    from edgespec.export.xla import main

    out = root / "cli"
    rc = main([str(checkpoints["llama"]), str(out), "--platforms", "cpu,tpu", "--max-length", "24",
               "--verify-width", "2", "--prefill-buckets", "8,24", "--atol", "2e-4"])
    assert rc == 0
    assert "max |logits - PyTorch|" in capsys.readouterr().out
    m = json.loads((out / "xla" / "xla.json").read_text())
    assert m["platforms"] == ["cpu", "tpu"] and m["widths"] == [1, 2] and m["prefill_buckets"] == [8, 24]
    assert m["validation"]["atol"] == 2e-4 and set(m["validation"]["stages"]) == {"prefill", "step_1", "step_2"}
    assert main([str(checkpoints["llama"]), str(out)]) == OutputExistsError.exit_code


# ----------------------------------------------------------------------------------------- (d)

def test_prompt_too_long(backends):
    with pytest.raises(PromptTooLongError, match="--max-length"):
        backends["gpt2"].prefill(np.arange(MAX_LEN + 1) % 50)
    with pytest.raises(PromptTooLongError, match="--max-source-length"):
        backends["t5"].prefill(np.arange(MAX_SRC + 1) % 50)


def test_t5_prompt_limit_is_the_encoders(root, checkpoints, hf_models):
    """A T5 exported for inputs longer than its decoder buffer (summarisation: long in, short out)
    takes such a prompt: the prompt is checked against the encoder, not the decoder positions."""
    from edgespec.config import GenerationConfig, SamplingConfig
    from edgespec.loop import generate

    out = root / "t5-long-source"
    export_xla(checkpoints["t5"], out, platforms=("cpu",), max_length=16, verify_width=VERIFY, widths=WIDTHS,
               max_source_length=40)
    target, draft = XlaBackend.from_dir(out), XlaBackend.from_dir(out)
    assert (target.max_length, target.max_prompt_length) == (16, 40)
    prompt = np.random.default_rng(0).integers(4, 59, size=30)
    ref = _hf_greedy(hf_models["t5"], "t5", prompt, 8)
    config = GenerationConfig(max_new_tokens=8, gamma=3, sampling=SamplingConfig(temperature=0))
    assert generate(target, prompt, config, np.random.default_rng(0), draft=draft).tokens[:len(ref)] == ref
    with pytest.raises(PromptTooLongError, match="at most 40"):
        generate(target, np.arange(41) % 50 + 4, config, np.random.default_rng(0), draft=draft)


def test_extend_past_buffers_and_too_wide(backends):
    be = backends["llama"]
    be.prefill(np.arange(MAX_LEN - 2) % 50 + 4)
    with pytest.raises(PromptTooLongError, match="--max-length"):
        be.extend(np.array([5, 6, 7]))
    assert be.length == MAX_LEN - 2
    be.extend(np.array([5, 6]))  # exactly fills the buffers (width 2 fits; no clamped write)
    assert be.length == MAX_LEN
    be.rewind_to(3)
    with pytest.raises(InvalidArgumentError, match=f"verify_width={VERIFY}"):
        be.extend(np.arange(VERIFY + 1) + 4)
    with pytest.raises(InvalidArgumentError, match="rewind_to"):
        be.rewind_to(4)
    with pytest.raises(InvalidArgumentError, match=r"\[0, 96\)"):
        be.extend(np.array([96]))
    be.free()
    with pytest.raises(InvalidArgumentError, match="prefill"):
        be.extend(np.array([5]))


def test_a_failed_extend_leaves_no_half_moved_cache(backends, hf_models, monkeypatch):
    """A block split over two artifact calls (near the end of the buffers) whose second call fails
    had moved the length by the first chunk and given its KV buffer away (donated to the failed
    call): later calls met jax's "Array has been deleted". The cache is now dropped: extend asks
    for a prefill, and a prefill works as before (a review's find)."""
    be = backends["gpt2"]
    seq = np.random.default_rng(2).integers(4, 60, size=MAX_LEN)
    be.prefill(seq[:MAX_LEN - 3])
    calls, real = [], dict(be._extend)

    def failing(w):
        def call(*a):
            calls.append(w)
            if len(calls) == 2:
                raise RuntimeError("device lost")
            return real[w](*a)
        return call

    for w in real:
        monkeypatch.setitem(be._extend, w, failing(w))
    with pytest.raises(RuntimeError, match="device lost"):
        be.extend(seq[MAX_LEN - 3:])  # 3 tokens, 3 positions left: width 2, then width 1
    assert len(calls) == 2 and be.length == 0
    with pytest.raises(InvalidArgumentError, match="prefill"):
        be.extend(seq[:1])
    monkeypatch.undo()
    be.prefill(seq[:MAX_LEN - 3])
    rows = be.extend(seq[MAX_LEN - 3:])
    assert np.abs(rows - _hf_logits(hf_models["gpt2"], "gpt2", seq)[-3:]).max() < TOL


def test_near_full_buffer_uses_exact_widths(backends, hf_models):
    """At length max_length-3 a 3-token block cannot be padded to width 4: it is split, still exact."""
    be = backends["gpt2"]
    seq = np.random.default_rng(2).integers(4, 60, size=MAX_LEN)
    be.prefill(seq[:MAX_LEN - 3])
    rows = be.extend(seq[MAX_LEN - 3:])
    ref = _hf_logits(hf_models["gpt2"], "gpt2", seq)
    diff = np.abs(rows - ref[-3:]).max()
    _record("gpt2/backend", diff)
    assert diff < TOL


def test_platform_not_in_artifact(root, checkpoints):
    out = root / "tpu-only"
    m = export_xla(checkpoints["gpt2"], out, platforms=("tpu",), max_length=16, verify_width=1, prefill_buckets=(16,))
    assert "add cpu to --platforms" in m["validation"]["skipped"]
    with pytest.raises(ProviderError) as ei:
        XlaBackend.from_dir(out)
    assert "tpu" in str(ei.value) and "cpu" in str(ei.value)


def test_platform_not_available_here(root, checkpoints, exported):
    out = root / "cpu-cuda"
    m = export_xla(checkpoints["gpt2"], out, platforms=("cpu", "cuda"), max_length=16, verify_width=1,
                   prefill_buckets=(16,))
    assert m["platforms"] == ["cpu", "cuda"]
    be = XlaBackend.from_dir(out)  # cpu is picked here
    assert be.platform == "cpu"
    prompt = PROMPT[:9].astype(np.int64)
    ref = XlaBackend.from_dir(exported["gpt2"]).prefill(prompt)  # the fixture, not whichever test ran first
    assert np.abs(be.prefill(prompt) - ref).max() < 1e-6  # the multi-platform artifact runs its cpu lowering
    try:
        jax.devices("gpu")
        pytest.skip("a GPU is present")
    except RuntimeError:
        pass
    with pytest.raises(ProviderError, match="cuda"):
        XlaBackend.from_dir(out, platform="cuda")


def _copy(src: Path, dst: Path) -> Path:
    shutil.copytree(src, dst)
    return dst


def test_unreadable_artifact_names_jax_version(root, exported, monkeypatch):
    bad = _copy(exported["gpt2"], root / "old-jax")
    mpath = bad / "xla" / "xla.json"
    m = json.loads(mpath.read_text())
    m["jax_version"] = "0.4.1"
    mpath.write_text(json.dumps(m))

    def refuse(_data):
        raise ValueError("Unsupported serialization version 99")

    monkeypatch.setattr(jax.export, "deserialize", refuse)
    with pytest.raises(BundleError, match=r"made by jax 0\.4\.1"):
        XlaBackend.from_dir(bad)


def test_corrupted_artifact(root, exported):
    bad = _copy(exported["gpt2"], root / "corrupt")
    art = bad / "xla" / "extend_1.bin"
    art.write_bytes(b"not a flatbuffer" * 4)
    with pytest.raises(BundleError, match="checksum"):
        XlaBackend.from_dir(bad)
    mpath = bad / "xla" / "xla.json"
    m = json.loads(mpath.read_text())
    m["artifacts"]["extend"]["1"]["sha256"] = None
    mpath.write_text(json.dumps(m))
    with pytest.raises(BundleError, match="cannot deserialize"):
        XlaBackend.from_dir(bad)


def test_missing_and_unsafe_bundles(root, exported):
    with pytest.raises(BundleError, match="--format onnx\\+xla"):
        XlaBackend.from_dir(root / "nowhere")
    bad = _copy(exported["gpt2"], root / "unsafe")
    mpath = bad / "xla" / "xla.json"
    m = json.loads(mpath.read_text())
    m["artifacts"]["extend"]["1"]["file"] = "../../etc/passwd"
    mpath.write_text(json.dumps(m))
    with pytest.raises(BundleError, match="outside"):
        XlaBackend.from_dir(bad)


@pytest.mark.parametrize("edit,needle", [
    (lambda m: m.pop("vocab_size"), "vocab_size must be a positive integer"),
    (lambda m: m.update(max_length="abc"), "max_length must be a positive integer"),
    (lambda m: m.update(artifacts=[]), "artifacts must map kind"),
    (lambda m: m["artifacts"]["extend"].update({"\u00b2": m["artifacts"]["extend"]["1"]}), "artifacts must map kind"),  # (a
    # size "²" passed isdigit() and int("²") raised a bare ValueError: a review's find)
    (lambda m: m["weights"].update(tensors={}), "weights.tensors"),
    (lambda m: m.update(max_length=m["max_length"] + 60), "do not match xla.json"),   # writes would clamp silently
    (lambda m: m.update(vocab_size=50), "do not match xla.json"),
])
def test_xla_manifest_is_checked_against_its_artifacts(tmp_path, exported, edit, needle):
    """xla.json has no checksum of its own: its fields are type-checked and compared with the
    artifacts' own shapes (an edited max_length let extends run past the buffer, clamped)."""
    bad = _copy(exported["gpt2"], tmp_path / "edited")
    mpath = bad / "xla" / "xla.json"
    m = json.loads(mpath.read_text())
    edit(m)
    mpath.write_text(json.dumps(m))
    with pytest.raises(BundleError, match=needle):
        XlaBackend.from_dir(bad)


def test_export_bad_inputs(root, checkpoints, exported):
    with pytest.raises(OutputExistsError):
        export_xla(checkpoints["gpt2"], exported["gpt2"], max_length=MAX_LEN)
    with pytest.raises(InvalidArgumentError, match="platform"):
        export_xla(checkpoints["gpt2"], root / "x1", platforms=("metal",))
    with pytest.raises(InvalidArgumentError, match="positions"):
        export_xla(checkpoints["gpt2"], root / "x2", max_length=4096)
    # T5 has no position table, but its bundle's ONNX decoder takes n_positions (512): the XLA path may not take more
    with pytest.raises(InvalidArgumentError, match="512 decoder positions of this T5 model.s bundle"):
        export_xla(checkpoints["t5"], root / "x2", max_length=100_000)
    with pytest.raises(InvalidArgumentError, match="lower --verify-width or raise --max-length"):
        export_xla(checkpoints["gpt2"], root / "x2", max_length=4, verify_width=9)
    # the messages name the flags, and a bucket too large says what to do (a trial's find)
    with pytest.raises(InvalidArgumentError, match=r"verify_width \(--verify-width\) must be an integer >= 1"):
        export_xla(checkpoints["gpt2"], root / "x2", verify_width=0)
    with pytest.raises(InvalidArgumentError, match=r"exceeds max_length=16 \(--max-length\).*at most 16, or raise --max-length"):
        export_xla(checkpoints["gpt2"], root / "x2", max_length=16, prefill_buckets=(8, 20))
    odd = root / "bert"
    odd.mkdir()
    (odd / "config.json").write_text(json.dumps({"model_type": "bert"}))
    with pytest.raises(UnsupportedArchitectureError, match="bert"):
        export_xla(odd, root / "x3")
    nows = root / "no-weights"
    nows.mkdir()
    shutil.copy(checkpoints["gpt2"] / "config.json", nows / "config.json")
    (nows / "pytorch_model.bin").write_bytes(b"")
    with pytest.raises(CheckpointError, match="safe_serialization"):
        export_xla(nows, root / "x4")


def test_report_max_differences():
    """Prints the max |logits| differences measured above (run with -s to see them)."""
    for k, v in sorted(MAX_DIFF.items()):
        print(f"max |xla - torch| {k}: {v:.3e}")
    assert all(v < TOL for v in MAX_DIFF.values())
