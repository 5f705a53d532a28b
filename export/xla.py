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
import shutil
import time
from functools import partial
from pathlib import Path
from typing import Any, Sequence

import numpy as np

from edgespec.errors import InvalidArgumentError, OutputExistsError
from edgespec.outputs import usual_permissions

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
        atol: largest logit difference allowed between the CPU artifacts and a PyTorch forward
            of the checkpoint (:func:`validate_xla`); the folder is removed when it is exceeded.
    """
    from edgespec.runtimes import xla_models as xm

    checkpoint_dir, out_dir = Path(checkpoint_dir), Path(out_dir)
    if isinstance(platforms, str):
        platforms = [platforms]
    platforms = [str(p).lower() for p in platforms]
    bad = [p for p in platforms if p not in PLATFORMS]
    if not platforms or bad:
        raise InvalidArgumentError(f"unknown XLA platform(s) {bad or platforms}; choose from {', '.join(PLATFORMS)}")
    platforms = list(dict.fromkeys(platforms))
    verify_width = _check_int("verify_width", verify_width, 1)

    spec, params = xm.load_model(checkpoint_dir)
    if max_length is None:
        max_length = min(spec.max_positions, 2048) if spec.max_positions else 512
    max_length = _check_int("max_length", max_length, 2)
    xm.check_max_length(spec, max_length)
    if verify_width > max_length:
        raise InvalidArgumentError(f"verify_width={verify_width} exceeds max_length={max_length}")
    widths = sorted({_check_int("width", w, 1) for w in (widths or range(1, verify_width + 1))})
    if 1 not in widths or widths[-1] > verify_width:
        raise InvalidArgumentError(f"widths {widths} must contain 1 and none may exceed verify_width={verify_width}")
    if verify_width not in widths:
        widths.append(verify_width)

    dest = out_dir / XLA_SUBDIR
    if dest.exists() and any(dest.iterdir()):
        if not overwrite:
            raise OutputExistsError(f"{dest} exists; remove it or pass overwrite=True (--overwrite)")
        shutil.rmtree(dest)
    dest.mkdir(parents=True, exist_ok=True)
    try:
        return _write_xla(dest, checkpoint_dir, spec, params, platforms, max_length, verify_width, widths,
                          prefill_buckets, max_source_length, atol)
    except BaseException:
        shutil.rmtree(dest, ignore_errors=True)  # nothing half-written (a failed check, Ctrl-C, a full disk)
        raise


def _write_xla(dest: Path, checkpoint_dir: Path, spec, params, platforms: list[str], max_length: int,
               verify_width: int, widths: list[int], prefill_buckets, max_source_length, atol: float) -> dict[str, Any]:
    import jax
    import jax.numpy as jnp
    from jax import export as jexport
    from safetensors.numpy import save_file

    from edgespec.runtimes import xla_models as xm

    t0 = time.perf_counter()
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
        E = _check_int("max_source_length", 512 if max_source_length is None else max_source_length, 1)
        cross_sh = (spec.n_layers, 1, spec.kv_heads, E, spec.head_dim)
        cross_aval = (jax.ShapeDtypeStruct(cross_sh, f32),) * 2
        emit("encode", E, partial(xm.t5_encode, spec, max_length),
             (p_avals, jax.ShapeDtypeStruct((E,), i32), scalar))
        for k in widths:
            emit("extend", k, partial(xm.t5_step, spec),
                 (p_avals, kv_aval, cross_aval, scalar, jax.ShapeDtypeStruct((k,), i32), scalar))
        extra = {"max_source_length": E, "cross_kv_shape": list(cross_sh)}
        buckets: list[int] = []
    else:
        buckets = sorted({_check_int("prefill bucket", b, 1) for b in (prefill_buckets or _default_buckets(max_length))})
        if buckets[-1] > max_length:
            raise InvalidArgumentError(f"prefill bucket {buckets[-1]} exceeds max_length={max_length}")
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
    manifest["validation"] = validate_xla(checkpoint_dir, dest, spec.encoder_decoder, platforms, atol)
    manifest["export_seconds"] = round(time.perf_counter() - t0, 2)
    (dest / MANIFEST).write_text(json.dumps(manifest, indent=2) + "\n")
    return manifest


def validate_xla(checkpoint_dir: Path, dest: Path, seq2seq: bool, platforms: Sequence[str], atol: float,
                 seed: int = 0) -> dict[str, Any]:
    """The written CPU artifacts, run by the XLA backend, against ONE cache-free PyTorch forward of
    the checkpoint, on the calls the speculative loop makes (as the ONNX validation: a 7-token
    prefill, a 1-token step, a 4-token verify). The JAX functions re-implement each architecture,
    so this is what catches a config field they read wrongly. Returns the max abs logit difference
    per stage; ValidationError when one exceeds ``atol``."""
    import torch

    from edgespec.errors import ValidationError
    from edgespec.runtimes.xla_backend import XlaBackend

    from .onnx_export import load_torch_model_at

    if "cpu" not in platforms:
        return {"skipped": "no cpu artifact to run here; add cpu to --platforms to validate against PyTorch"}
    model = load_torch_model_at(checkpoint_dir, seq2seq)
    be = XlaBackend.from_dir(dest, platform="cpu")
    k = min(4, be.verify_width)
    rng = np.random.default_rng(seed)
    ids = rng.integers(0, be.vocab_size, size=16)
    stages: dict[str, float] = {}

    def check(stage: str, got: np.ndarray, want: torch.Tensor) -> None:
        d = np.abs(np.asarray(got, np.float64) - want.double().numpy())
        stages[stage] = float(d.max()) if np.all(np.isfinite(d)) else float("nan")

    with torch.no_grad():
        if seq2seq:
            src = ids[:min(7, be.max_prompt_length)]
            dec = np.concatenate([[be.decoder_start_token_id], ids[7:7 + min(1 + k, be.max_length - 1)]])
            ref = model(input_ids=torch.from_numpy(src[None]), decoder_input_ids=torch.from_numpy(dec[None])).logits[0]
            check("prefill", be.prefill(src), ref[0])
            n = 1
        else:
            n = max(1, min(7, be.max_length - 1 - k))
            seq = ids[:min(n + 1 + k, be.max_length)]
            ref = model(input_ids=torch.from_numpy(seq[None])).logits[0]
            check("prefill", be.prefill(seq[:n]), ref[n - 1])
            dec = seq
        for width in dict.fromkeys((1, k)):
            if n + width <= len(dec):
                check(f"step_{width}", be.extend(dec[n:n + width]), ref[n:n + width])
                n += width
    worst = max(stages, key=lambda s: np.inf if not np.isfinite(stages[s]) else stages[s])
    if not np.isfinite(stages[worst]) or stages[worst] > atol:
        raise ValidationError(
            f"{checkpoint_dir}: the XLA artifacts' logits ({worst}) differ from PyTorch by {stages[worst]:.3g} "
            f"(tolerance {atol:g}); nothing was written. The XLA path re-implements the architecture in JAX and "
            "reads this config differently: export ONNX only (--format onnx) and report the model's config.json")
    return {"platform": "cpu", "atol": atol, "max_abs_diff": stages[worst], "worst_stage": worst, "stages": stages}


# --------------------------------------------------------------------------------------------
# CLI hooks (``edgespec export --format xla``)
# --------------------------------------------------------------------------------------------

def _parse_ints(text: str) -> list[int]:
    try:
        return [int(x) for x in str(text).replace(",", " ").split()]
    except ValueError as exc:
        raise argparse.ArgumentTypeError(f"expected comma-separated integers, got {text!r}") from exc


def add_xla_arguments(parser: argparse.ArgumentParser) -> None:
    """Options of the XLA export. Options the caller already defined (e.g. --max-length) are kept."""
    have = set(getattr(parser, "_option_string_actions", {}))
    g = parser.add_argument_group("XLA export (--format onnx+xla)")

    def add(flag: str, **kw: Any) -> None:
        if flag not in have:
            g.add_argument(flag, **kw)

    add("--platforms", default="cpu",
        help="comma-separated XLA platforms to lower for: cpu, cuda, rocm, tpu (default: cpu)")
    add("--max-length", type=int, default=None,
        help="static KV buffer length in tokens (prompt + generated); default min(model positions, 2048), T5: 512")
    add("--verify-width", type=int, default=None, help="widest verify block, max gamma + 1 (default 9)")
    add("--prefill-buckets", type=_parse_ints, default=None,
        help="padded prompt sizes for prefill, e.g. 16,64,256 (default: 16,64,256,1024 below max-length, plus max-length)")
    add("--max-source-length", type=int, default=None, help="T5: longest prompt (encoder bucket), default 512")
    add("--overwrite", action="store_true", help="replace an existing xla/ folder")
    add("--atol", type=float, default=None,
        help="largest logit difference from PyTorch allowed when the cpu artifacts are checked (default 1e-3)")


def run_xla_export(args: argparse.Namespace) -> dict[str, dict[str, Any]]:
    """Export ``args.target`` (and ``args.draft`` if given) to ``<args.out>/<role>/xla``.

    Also accepts ``args.checkpoint`` (a single model, written to ``<args.out>/xla``).
    Returns {role: manifest}.
    """
    platforms = [p for p in str(getattr(args, "platforms", "cpu") or "cpu").replace(",", " ").split()]
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
        return {"model": export_xla(Path(single), out, **kw)}
    result = {}
    for role in ("target", "draft"):
        ckpt = getattr(args, role, None)
        if ckpt:
            result[role] = export_xla(Path(ckpt), out / role, **kw)
    if not result:
        raise InvalidArgumentError("nothing to export: pass a target (and optionally a draft) checkpoint")
    return result


def main(argv: Sequence[str] | None = None) -> int:
    """``python -m edgespec.export.xla CHECKPOINT OUT [options]`` (standalone use)."""
    import sys

    from edgespec.errors import EdgeSpecError

    parser = argparse.ArgumentParser(prog="python -m edgespec.export.xla", description=__doc__.splitlines()[0])
    parser.add_argument("checkpoint", help="Hugging Face checkpoint folder")
    parser.add_argument("out", help="output folder (artifacts go to OUT/xla)")
    add_xla_arguments(parser)
    args = parser.parse_args(argv)
    try:
        m = run_xla_export(args)["model"]
    except EdgeSpecError as exc:
        print(f"edgespec export: error: {exc}", file=sys.stderr)
        return exc.exit_code
    v = m["validation"]
    check = v["skipped"] if "skipped" in v else f"max |logits - PyTorch| {v['max_abs_diff']:.2e} on cpu"
    print(f"wrote {Path(args.out) / XLA_SUBDIR} ({m['model_type']}, platforms {','.join(m['platforms'])}, "
          f"max_length {m['max_length']}, widths {m['widths']}, {m['export_seconds']}s; {check})")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
