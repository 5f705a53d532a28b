"""Export a Hugging Face checkpoint to serialized ``jax.export`` artifacts (the XLA reference path).

Layout written under ``out_dir/xla/``::

    xla.json                 self-describing manifest (see ``export_xla``)
    weights.safetensors      float32 params, keyed by (normalized) Hugging Face tensor names
    config.json              copy of the source config (for reference only)
    prefill_<P>.bin          decoder-only: f(params, ids[P] i32, n i32) -> (logits[V], kv)
    encode_<E>.bin           T5: f(params, ids[E] i32, n i32) -> (cross_kv, kv)
    extend_<k>.bin           decoder-only: f(params, kv, ids[k] i32, pos i32) -> (logits[k, V], kv)
                             T5: f(params, kv, cross_kv, enc_len i32, ids[k] i32, pos i32) -> (logits[k, V], kv)

``kv`` and ``cross_kv`` are pairs (K, V) of float32 arrays ``[layers, 1, kv_heads, length, head_dim]``.
Weights are arguments of every artifact (never baked-in constants), so one weights file serves all
artifacts and the ``.bin`` files stay small. Each ``.bin`` is ``Exported.serialize()`` (StableHLO plus
jax's calling convention), lowered for every platform asked for (cpu, cuda, rocm, tpu).
"""
from __future__ import annotations

import argparse
import json
import math
import shutil
import tempfile
import time
from functools import partial
from pathlib import Path
from typing import Any, Sequence

import numpy as np

from edgespec import contract
from edgespec.cli import folder
from edgespec.errors import InvalidArgumentError, OutputExistsError, warn
from edgespec.outputs import XLA_FILES, check_output_folder, check_writable, swap_into_place, usual_permissions

FORMAT = "edgespec-xla"
FORMAT_VERSION = 1
PLATFORMS = ("cpu", "cuda", "rocm", "tpu")
XLA_SUBDIR = "xla"
MANIFEST = "xla.json"
WEIGHTS = "weights.safetensors"


from edgespec.runtimes.xla_backend import _sha256  # noqa: E402  (one digest helper for writer and reader)


def _check_int(name: str, v: Any, lo: int) -> int:
    if isinstance(v, bool) or not isinstance(v, (int, np.integer)) or v < lo:
        raise InvalidArgumentError(f"{name} must be an integer >= {lo}; got {v!r}")
    return int(v)


def _default_buckets(max_len: int) -> list[int]:
    return sorted({b for b in (16, 64, 256, 1024) if b < max_len} | {max_len})


def check_xla_options(checkpoint_dir: str | Path, platforms: Sequence[str] = ("cpu",), max_length: int | None = None,
                      verify_width: int = 9, *, widths: Sequence[int] | None = None,
                      prefill_buckets: Sequence[int] | None = None, max_source_length: int | None = None,
                      atol: float = 1e-3, **_other: Any) -> dict[str, Any]:
    """:func:`export_xla`'s options checked against the checkpoint's config.json and resolved
    (defaults filled in), without loading weights: ``edgespec export`` runs it before any work."""
    from edgespec.runtimes import xla_models as xm

    if isinstance(platforms, str):
        platforms = [platforms]
    platforms = [str(p).lower() for p in platforms]
    bad = [p for p in platforms if p not in PLATFORMS]
    if not platforms or bad:
        raise InvalidArgumentError(f"unknown XLA platform(s) {bad or platforms}; choose from {', '.join(PLATFORMS)}")
    platforms = list(dict.fromkeys(platforms))
    verify_width = _check_int("verify_width (--verify-width)", verify_width, 1)
    config = xm.read_config(Path(checkpoint_dir))
    spec = xm.spec_from_config(config)
    # T5 has no position table; its bundle's ONNX graphs take the config's n_positions (512 without
    # one, export.pipeline._max_positions): the XLA artifacts may not take more
    t5_limit = contract.seq2seq_positions(config) if spec.encoder_decoder else None
    if max_length is None:
        max_length = min(spec.max_positions, 2048) if spec.max_positions else min(t5_limit or 512, 512)
    max_length = _check_int("max_length (--max-length)", max_length, 2)
    xm.check_max_length(spec, max_length)
    if t5_limit is not None and max_length > t5_limit:
        raise InvalidArgumentError(f"max_length={max_length} exceeds the {t5_limit} decoder positions of this T5 model's "
                                   f"bundle (its config's n_positions); pass --max-length {t5_limit} or less")
    if verify_width > max_length:
        raise InvalidArgumentError(f"verify_width={verify_width} (--verify-width, default 9) exceeds max_length="
                                   f"{max_length} (--max-length); lower --verify-width or raise --max-length")
    widths = sorted({_check_int("width", w, 1) for w in (widths or range(1, verify_width + 1))})
    if 1 not in widths or widths[-1] > verify_width:
        raise InvalidArgumentError(f"widths {widths} must contain 1 and none may exceed verify_width={verify_width}")
    if verify_width not in widths:
        widths.append(verify_width)
    if max_source_length is not None and not spec.encoder_decoder:
        raise InvalidArgumentError(f"max_source_length (--max-source-length) sizes a T5 encoder; {checkpoint_dir} is a "
                                   "decoder-only model (its prompt shares max_length): drop it")
    E = _check_int("max_source_length (--max-source-length)", 512 if max_source_length is None else max_source_length, 1)
    # Decoder-only: padded prompt sizes of the prefill, within the KV buffer. T5: of the encoder, up to
    # max_source_length (each encoder bucket pads its cross KV to E, so the decoder steps are shared).
    top, flag, holds = ((E, "--max-source-length", "max_source_length={} (--max-source-length), the longest prompt the encoder takes")
                        if spec.encoder_decoder else
                        (max_length, "--max-length", "max_length={} (--max-length), the tokens the artifacts' buffers hold"))
    buckets = sorted({_check_int("a prefill bucket (--prefill-buckets)", b, 1) for b in (prefill_buckets or _default_buckets(top))})
    if buckets[-1] > top:
        raise InvalidArgumentError(f"prefill bucket {buckets[-1]} (--prefill-buckets) exceeds {holds.format(top)}; use "
                                   f"buckets of at most {top}, or raise {flag}")
    if spec.encoder_decoder:
        buckets = sorted(set(buckets) | {E})  # the longest prompt has a bucket
    if spec.encoder_decoder and max_source_length is None:
        # every decoder step attends over the E encoder positions (masked past the prompt)
        warn("the XLA encoder takes prompts of up to 512 tokens by default, and each decoder step attends over "
             "all 512 positions, whatever the prompt's length (a trial's tiny T5 stepped 2x slower than with "
             "--max-source-length 32); pass --max-source-length with your longest prompt")
    if isinstance(atol, bool) or not isinstance(atol, (int, float)) or not math.isfinite(atol) or atol <= 0:
        raise InvalidArgumentError(f"atol must be a finite number > 0; got {atol!r}")
    return {"platforms": platforms, "max_length": max_length, "verify_width": verify_width, "widths": widths,
            "prefill_buckets": buckets, "max_source_length": E, "atol": atol}


def export_xla(
    checkpoint_dir: str | Path,
    out_dir: str | Path,
    platforms: Sequence[str] = ("cpu",),
    max_length: int | None = None,
    verify_width: int = 9,
    *,
    widths: Sequence[int] | None = None,
    prefill_buckets: Sequence[int] | None = None,
    max_source_length: int | None = None,
    overwrite: bool = False,
    atol: float = 1e-3,
    vocab_limit: int | None = None,
) -> dict[str, Any]:
    """Write ``out_dir/xla/`` (artifacts, weights, manifest) for one checkpoint; return the manifest.

    Args:
        checkpoint_dir: Hugging Face folder with config.json + model.safetensors (gpt2, llama, t5).
        out_dir: the bundle (or model) folder; artifacts go to ``out_dir/xla``.
        platforms: lowering targets, any of cpu, cuda, rocm, tpu (one artifact serves all).
        max_length: static KV buffer length (decoder tokens). Default: min(model positions, 2048)
            for decoder-only models, 512 for T5.
        verify_width: widest extend (max gamma + 1).
        widths: extend widths to export (default 1..verify_width; must contain 1). A call with a
            width that was not exported runs the next wider artifact (padded) or splits.
        prefill_buckets: padded prompt sizes for decoder-only prefill (default 16, 64, 256, 1024
            below max_length, plus max_length). Longer prompts (<= max_length) are prefilled by
            the largest bucket, then extended in verify-width chunks.
        max_source_length: T5 encoder bucket (longest prompt); default 512.
        overwrite: replace an existing ``out_dir/xla``.
        atol: largest logit difference allowed between the cpu artifacts and a PyTorch forward
            of the checkpoint (:func:`validate_xla`); nothing is written when it is exceeded.
        vocab_limit: the validation feeds token ids below it (the tokenizer's size; default all
            embedding rows).
    """
    from edgespec.runtimes import xla_models as xm

    checkpoint_dir, out_dir = Path(checkpoint_dir), Path(out_dir)
    o = check_xla_options(checkpoint_dir, platforms, max_length, verify_width, widths=widths,
                          prefill_buckets=prefill_buckets, max_source_length=max_source_length, atol=atol)
    dest = out_dir / XLA_SUBDIR
    if out_dir.exists() and not out_dir.is_dir():
        raise OutputExistsError(f"{out_dir} exists and is not a folder; choose another output folder")
    check_output_folder(dest, overwrite, MANIFEST, "XLA artifacts", flag="output", owned=XLA_FILES)
    check_writable(out_dir)
    t0 = time.perf_counter()
    spec, params = xm.load_model(checkpoint_dir)
    platforms, max_length, verify_width, widths = o["platforms"], o["max_length"], o["verify_width"], o["widths"]
    made_out = not out_dir.exists()
    out_dir.mkdir(parents=True, exist_ok=True)
    # Written beside, renamed into place once validated: a failed check, Ctrl-C or a full disk
    # leaves the previous xla/ (if any) as it was and nothing half-written.
    tmp = Path(tempfile.mkdtemp(prefix=f".{XLA_SUBDIR}.partial-", dir=out_dir))
    try:
        manifest = _write_xla(tmp, checkpoint_dir, spec, params, platforms, max_length, verify_width, widths,
                              o["prefill_buckets"], o["max_source_length"])
        del params  # the check below loads the weights twice more, one copy at a time
        manifest["validation"] = validate_xla(checkpoint_dir, tmp, spec.encoder_decoder, platforms, atol, vocab_limit)
        manifest["export_seconds"] = round(time.perf_counter() - t0, 2)
        (tmp / MANIFEST).write_text(json.dumps(manifest, indent=2) + "\n")
        usual_permissions(tmp, recursive=True)  # mkdtemp (0700), safetensors (0600)
        swap_into_place(tmp, dest, overwrite, MANIFEST, "XLA artifacts", flag="output", owned=XLA_FILES)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        if made_out:
            shutil.rmtree(out_dir, ignore_errors=True)
        raise
    return manifest


def _write_xla(dest: Path, checkpoint_dir: Path, spec, params, platforms: list[str], max_length: int,
               verify_width: int, widths: list[int], prefill_buckets, max_source_length) -> dict[str, Any]:
    import jax
    import jax.numpy as jnp
    from jax import export as jexport
    from safetensors.numpy import save_file

    from edgespec.runtimes import xla_models as xm

    f32, i32 = jnp.float32, jnp.int32
    p_avals = {k: jax.ShapeDtypeStruct(v.shape, f32) for k, v in params.items()}
    kv_sh = xm.kv_shape(spec, max_length)
    kv_aval = (jax.ShapeDtypeStruct(kv_sh, f32),) * 2
    scalar = jax.ShapeDtypeStruct((), i32)
    vocab = xm.output_vocab(spec, params)
    artifacts: dict[str, dict[str, Any]] = {"extend": {}}

    def emit(kind: str, size: int, fn, args) -> None:
        exp = jexport.export(jax.jit(fn), platforms=platforms)(*args)
        name = f"{kind}_{size}.bin"
        (dest / name).write_bytes(bytes(exp.serialize()))
        artifacts.setdefault(kind, {})[str(size)] = {
            "file": name,
            "sha256": _sha256(dest / name),
            "inputs": [f"{a.dtype}{list(a.shape)}" for a in exp.in_avals],
            "outputs": [f"{a.dtype}{list(a.shape)}" for a in exp.out_avals],
        }

    extra: dict[str, Any] = {}
    if spec.encoder_decoder:
        E = max_source_length
        cross_sh = (spec.n_layers, 1, spec.kv_heads, E, spec.head_dim)
        cross_aval = (jax.ShapeDtypeStruct(cross_sh, f32),) * 2
        for b in prefill_buckets:  # encoder buckets, the largest E; each pads its cross KV to E
            emit("encode", b, partial(xm.t5_encode, spec, max_length, out_len=E),
                 (p_avals, jax.ShapeDtypeStruct((b,), i32), scalar))
        for k in widths:
            emit("extend", k, partial(xm.t5_step, spec),
                 (p_avals, kv_aval, cross_aval, scalar, jax.ShapeDtypeStruct((k,), i32), scalar))
        extra = {"max_source_length": E, "cross_kv_shape": list(cross_sh)}
        buckets = prefill_buckets
    else:
        buckets = prefill_buckets
        for b in buckets:
            emit("prefill", b, partial(xm.decoder_prefill, spec, max_length),
                 (p_avals, jax.ShapeDtypeStruct((b,), i32), scalar))
        for k in widths:
            emit("extend", k, partial(xm.decoder_step, spec),
                 (p_avals, kv_aval, jax.ShapeDtypeStruct((k,), i32), scalar))

    save_file(params, str(dest / WEIGHTS), metadata={"format": FORMAT})
    usual_permissions(dest / WEIGHTS)  # safetensors writes 0600
    shutil.copyfile(checkpoint_dir / "config.json", dest / "config.json")

    import jaxlib

    manifest: dict[str, Any] = {
        "format": FORMAT,
        "format_version": FORMAT_VERSION,
        "model_type": spec.model_type,
        "encoder_decoder": spec.encoder_decoder,
        "jax_version": jax.__version__,
        "jaxlib_version": getattr(jaxlib, "__version__", None),
        "platforms": platforms,
        "dtype": "float32",
        "vocab_size": vocab,
        "max_length": max_length,
        "verify_width": verify_width,
        "widths": widths,
        "prefill_buckets": buckets,
        **extra,
        "kv_shape": list(kv_sh),
        "kv_layout": "(K, V), each [layers, batch=1, kv_heads, max_length, head_dim]",
        "special_tokens": {k: v for k, v in spec.special_tokens.items() if v is not None},
        "weights": {"file": WEIGHTS, "sha256": _sha256(dest / WEIGHTS),
                    "tensors": {k: list(v.shape) for k, v in params.items()}},
        "artifacts": artifacts,
        "signatures": {
            "prefill": "(params, ids[P] i32, n i32) -> (logits[V] f32, kv)",
            "encode": "(params, ids[E] i32, n i32) -> (cross_kv, kv)",
            "extend": ("(params, kv, ids[k] i32, pos i32) -> (logits[k,V] f32, kv)" if not spec.encoder_decoder else
                       "(params, kv, cross_kv, enc_len i32, ids[k] i32, pos i32) -> (logits[k,V] f32, kv)"),
        },
        "source": {"checkpoint": str(checkpoint_dir.resolve()), "config": "config.json"},
    }
    (dest / MANIFEST).write_text(json.dumps(manifest, indent=2) + "\n")
    return manifest


def validate_xla(checkpoint_dir: Path, folder: Path, seq2seq: bool, platforms: Sequence[str], atol: float,
                 vocab_limit: int | None = None, seed: int = 0) -> dict[str, Any]:
    """The written cpu artifacts, run by the XLA backend, against ONE cache-free PyTorch forward of
    the checkpoint, on the calls the speculative loop makes: a prefill, a 1-token step (the draft)
    and a verify_width-token step (the target's widest verify). The JAX functions re-implement each
    architecture, so this is what catches a config field they read differently. Returns the max abs
    logit difference per stage, or why the check was skipped; ValidationError over ``atol``.
    ``vocab_limit``: token ids are drawn below it (the tokenizer's size; default all rows)."""
    import jax

    from edgespec.errors import ValidationError
    from edgespec.runtimes.xla_backend import XlaBackend

    from . import validate

    if "cpu" not in platforms:
        return {"skipped": "no cpu artifact to run here; add cpu to --platforms to validate against PyTorch"}
    try:
        import torch
        import transformers  # noqa: F401
    except ImportError:
        return {"skipped": "PyTorch and transformers are not installed; pip install 'edgespec[export]' to validate "
                           "the artifacts against PyTorch"}
    try:
        jax.devices("cpu")
    except RuntimeError:
        return {"skipped": "JAX has no cpu device here (JAX_PLATFORMS?); the cpu artifacts could not be run"}

    # The XLA side first, then PyTorch: one copy of the weights alive at a time.
    be = XlaBackend.from_dir(folder, platform="cpu")
    k, room = be.verify_width, be.max_length  # decoder tokens the buffers hold
    first = 1 if seq2seq else max(1, min(validate.PREFILL_TOKENS, room - 1 - k))  # T5: the start token
    widths = list(dict.fromkeys((1, k)))
    if first + sum(widths) > room:  # tiny buffers: the verify width matters more than the 1-token step
        widths = [k] if first + k <= room else [1]
    rng = np.random.default_rng(seed)
    ids = rng.integers(0, min(vocab_limit or be.vocab_size, be.vocab_size), size=validate.PREFILL_TOKENS + room)
    src = ids[:min(validate.PREFILL_TOKENS, be.max_prompt_length)] if seq2seq else None
    dec = (np.concatenate([[be.decoder_start_token_id], ids[-sum(widths):]]) if seq2seq
           else ids[:first + sum(widths)])
    got = {"prefill": (first - 1, be.prefill(src if seq2seq else dec[:first])[None])}
    n = first
    for w in widths:
        got[f"step_{w}"] = (n, be.extend(dec[n:n + w]))
        n += w
    # T5: the prompt above runs the smallest encoder bucket; the longest prompt runs the largest
    longest = rng.integers(0, min(vocab_limit or be.vocab_size, be.vocab_size), size=be.max_prompt_length) \
        if seq2seq and be.max_prompt_length > src.size else None
    long_logits = be.prefill(longest)[None] if longest is not None else None
    del be

    from .onnx_export import load_torch_model_at

    model = load_torch_model_at(checkpoint_dir, seq2seq)
    with torch.no_grad():
        feed = dict(input_ids=torch.from_numpy(src[None]), decoder_input_ids=torch.from_numpy(dec[None])) if seq2seq \
            else dict(input_ids=torch.from_numpy(dec[None]))
        ref = model(**feed).logits[0].double().numpy()
        if longest is not None:
            long_ref = model(input_ids=torch.from_numpy(longest[None]),
                             decoder_input_ids=torch.tensor([[int(dec[0])]])).logits[0].double().numpy()
    del model
    stages = {stage: validate._diff(np.asarray(logits), ref[pos:pos + len(logits)], stage)
              for stage, (pos, logits) in got.items()}
    if longest is not None:
        stages["prefill_longest_prompt"] = validate._diff(np.asarray(long_logits), long_ref, "prefill_longest_prompt")
    worst, worst_d = validate.worst(stages)
    worst = worst or next(iter(stages))  # every stage exact
    if not np.isfinite(worst_d) or worst_d > atol:
        raise ValidationError(
            f"{checkpoint_dir}: the XLA artifacts' logits ({worst}) differ from PyTorch by {worst_d:.3g} "
            f"(tolerance {atol:g}); nothing was written.{validate.rounding_hint('logits', worst_d, validate.logits_range(ref))} The XLA path re-implements the architecture in "
            "JAX: if the difference is numerical noise (a deep fp32 model), raise --atol; otherwise it reads this "
            "config differently: export ONNX only (`edgespec export` without --format onnx+xla) and report the "
            "model's config.json")
    return {"platform": "cpu", "atol": atol, "max_abs_diff": worst_d, "worst_stage": worst, "stages": stages}


# --------------------------------------------------------------------------------------------
# CLI hooks (``edgespec export --format onnx+xla``)
# --------------------------------------------------------------------------------------------

def _comma_list(cast, kind: str, empty_fix: str):
    """An argparse type: a comma (or space) separated list of ``cast`` values, not empty (an empty
    value fell back to the defaults without a word)."""
    def parse(text: str) -> list:
        try:
            values = [cast(x) for x in str(text).replace(",", " ").split()]
        except ValueError as exc:
            raise argparse.ArgumentTypeError(f"expected comma-separated {kind}, got {text!r}") from exc
        if not values:
            raise argparse.ArgumentTypeError(f"is empty; {empty_fix}")
        return values
    return parse


_parse_ints = _comma_list(int, "integers", "give at least one size (e.g. 16,64,256), or drop the option for the defaults")
_parse_names = _comma_list(str, "names", f"give at least one of {', '.join(PLATFORMS)}, or drop the option (cpu)")


def add_xla_arguments(parser: argparse.ArgumentParser, title: str = "XLA export (--format onnx+xla)") -> None:
    """Options of the XLA export. Options the caller already defined (e.g. --max-length) are kept."""
    have = set(getattr(parser, "_option_string_actions", {}))
    g = parser.add_argument_group(title)

    def add(flag: str, **kw: Any) -> None:
        if flag not in have:
            g.add_argument(flag, **kw)

    add("--platforms", type=_parse_names, default=None,
        help="comma-separated XLA platforms to lower for: cpu, cuda, rocm, tpu (default: cpu)")
    add("--max-length", type=int, default=None,
        help="static KV buffer length in tokens (prompt + generated); default min(model positions, 2048), T5: 512")
    add("--verify-width", type=int, default=None, help="widest verify block, max gamma + 1 (default 9)")
    add("--prefill-buckets", type=_parse_ints, default=None,
        help="padded prompt sizes for prefill, e.g. 16,64,256 (default: 16,64,256,1024 below max-length, plus max-length; "
             "T5: the encoder's, the same below --max-source-length, plus it)")
    add("--max-source-length", type=int, default=None, help="T5: longest prompt (the largest encoder bucket), default 512")
    add("--overwrite", action="store_true", help="replace an existing xla/ folder")
    add("--atol", type=float, default=None,
        help="largest logit difference from PyTorch allowed when the cpu artifacts are checked (default 1e-3)")


# config.json settings that fix a model's shape: a folder that already holds a model (a bundle's
# target/) and a checkpoint that differ in one are two models
_SHAPE_KEYS = ("model_type", "vocab_size", "hidden_size", "n_embd", "d_model", "num_hidden_layers", "n_layer",
               "num_layers", "num_decoder_layers", "num_attention_heads", "n_head", "num_heads", "num_key_value_heads",
               "intermediate_size", "n_inner", "d_ff", "d_kv", "max_position_embeddings", "n_positions")


def _check_same_model(checkpoint_dir: Path, out_dir: Path) -> None:
    """Writing ``out_dir/xla`` into a folder that holds another model's config.json (a bundle's
    draft/ given for the target's checkpoint) would give the bundle's two runtimes different models.
    Only settings both configs give are compared (save_pretrained adds defaults, fills nulls). The
    standalone exporter's check (``export --format onnx+xla`` writes both from one checkpoint)."""
    try:
        theirs = json.loads((out_dir / contract.CONFIG_FILE).read_text(encoding="utf-8"))
        ours = json.loads((checkpoint_dir / contract.CONFIG_FILE).read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return  # no model there (or no config here: load_model names that)
    if not isinstance(theirs, dict) or not isinstance(ours, dict):
        return
    differ = [f"{k} {ours[k]!r:.20} vs {theirs[k]!r:.20}" for k in _SHAPE_KEYS  # (null: save_pretrained fills it)
              if ours.get(k) is not None and theirs.get(k) is not None and ours[k] != theirs[k]]
    if differ:
        raise InvalidArgumentError(
            f"{out_dir} holds another model than {checkpoint_dir} (config.json: {', '.join(differ[:3])}); its XLA "
            "artifacts must come from the checkpoint that folder was exported from: pass that checkpoint, or another "
            "output folder")


def run_xla_export(args: argparse.Namespace) -> dict[str, dict[str, Any]]:
    """Export ``args.target`` (and ``args.draft`` if given) to ``<args.out>/<role>/xla``.

    Also accepts ``args.checkpoint`` (a single model, written to ``<args.out>/xla``).
    Returns {role: manifest}.
    """
    platforms = getattr(args, "platforms", None) or ["cpu"]
    vw = getattr(args, "verify_width", None)
    if vw is None:
        vw = getattr(args, "max_gamma", 8) + 1 if getattr(args, "max_gamma", None) else 9
    kw = dict(platforms=platforms, max_length=getattr(args, "max_length", None), verify_width=vw,
              prefill_buckets=getattr(args, "prefill_buckets", None),
              max_source_length=getattr(args, "max_source_length", None),
              overwrite=bool(getattr(args, "overwrite", False)))
    if getattr(args, "atol", None) is not None:
        kw["atol"] = args.atol
    out = Path(getattr(args, "out"))
    single = getattr(args, "checkpoint", None)
    if single:
        _check_same_model(Path(single), out)
        return {"model": export_xla(Path(single), out, **kw)}
    roles = {role: Path(getattr(args, role)) for role in ("target", "draft") if getattr(args, role, None)}
    for role, ckpt in roles.items():
        _check_same_model(ckpt, out / role)
    result = {role: export_xla(ckpt, out / role, **kw) for role, ckpt in roles.items()}
    if not result:
        raise InvalidArgumentError("nothing to export: pass a target (and optionally a draft) checkpoint")
    return result


# What a bundle's manifest records of each model's XLA export (``formats.xla.<role>``); the runtime
# itself reads xla.json, this is the summary a reader of edgespec.json sees.
SUMMARY_KEYS = ("platforms", "max_length", "verify_width", "jax_version", "validation")


def xla_summary(manifest: dict[str, Any]) -> dict[str, Any]:
    return {k: manifest[k] for k in SUMMARY_KEYS if k in manifest}


def refresh_bundle_summary(model_dir: Path, manifest: dict[str, Any]) -> str | None:
    """If ``model_dir`` is a model folder of a bundle, record the new export in the bundle's
    ``formats.xla`` (else a re-export leaves a stale summary there). Returns the role updated."""
    import sys

    from edgespec import contract
    from edgespec.bundle import load_bundle, write_manifest
    from edgespec.errors import BundleError

    root = model_dir.resolve().parent
    if not (root / contract.MANIFEST_NAME).is_file():
        return None
    try:
        bundle = load_bundle(root)
    except BundleError as exc:
        print(f"warning: {root} looks like a bundle but cannot be read, so its XLA summary was not updated: {exc}",
              file=sys.stderr)
        return None
    for role, m in bundle.models.items():
        if (root / m.path).resolve() == model_dir.resolve():
            bundle.formats.setdefault("xla", {})[role] = xla_summary(manifest)
            write_manifest(root, bundle)
            return role
    return None


def main(argv: Sequence[str] | None = None) -> int:
    """``python -m edgespec.export.xla CHECKPOINT OUT [options]`` (standalone use)."""
    import sys

    from edgespec.errors import EdgeSpecError

    parser = argparse.ArgumentParser(prog="python -m edgespec.export.xla", description=__doc__.splitlines()[0])
    parser.add_argument("checkpoint", help="Hugging Face checkpoint folder")
    parser.add_argument("out", type=folder, help="output folder (artifacts go to OUT/xla)")
    add_xla_arguments(parser, "XLA export")
    args = parser.parse_args(argv)
    try:
        m = run_xla_export(args)["model"]
        role = refresh_bundle_summary(Path(args.out), m)
    except EdgeSpecError as exc:
        print(f"{parser.prog}: error: {exc}", file=sys.stderr)
        return exc.exit_code
    v = m["validation"]
    check = v["skipped"] if "skipped" in v else f"max |logits - PyTorch| {v['max_abs_diff']:.2e} on cpu"
    print(f"wrote {Path(args.out) / XLA_SUBDIR} ({m['model_type']}, platforms {','.join(m['platforms'])}, "
          f"max_length {m['max_length']}, widths {m['widths']}, {m['export_seconds']}s; {check})")
    if role is not None:
        print(f"updated the {role}'s XLA summary (formats.xla) in {Path(args.out).resolve().parent}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
