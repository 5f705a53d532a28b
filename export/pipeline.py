"""``export_bundle``: checkpoints -> validated bundle, written atomically.

Order: every cheap check first (folders, files, architecture, output path, tokenizers), then the
slow work inside a temporary folder next to the destination, renamed into place only when every
model is exported, validated and described in the manifest. A failure or an interrupt removes the
temporary folder, so nothing that looks like a bundle is ever left behind.
"""
from __future__ import annotations

import collections
import dataclasses
import errno
import json
import math
import os
import shutil
import socket
import uuid
import sys
import tempfile
import time
from dataclasses import dataclass
from importlib import metadata
from pathlib import Path
from typing import Callable

from edgespec import contract
from edgespec.bundle import PARTIAL_MARKER, BundleManifest, ModelManifest, load_bundle, write_manifest
from edgespec.errors import (CheckpointError, DiskFullError, EdgeSpecError, InvalidArgumentError,
                             OutputExistsError, UnsupportedArchitectureError, ValidationError, warn)
from edgespec.outputs import (BUNDLE_FILES, check_output_folder, check_writable, foreign_names, swap_into_place,
                              usual_permissions)

from . import graph_info, static_kv, validate
from .checkpoint import Checkpoint, inspect_checkpoint
from .quantize import QUANT_CHOICES, QUANT_LABEL, check_dtype, quantize_int8, quantize_int8_rowwise
from .tokenizer_check import check_model_covers_tokenizer, load_vocab, shared_vocab, tokenizer_size

DEFAULT_ATOL = 1e-3  # fp32 ORT vs PyTorch on logits and KV (typical real-model diffs: 1e-5..1e-4)
DEFAULT_QUANTIZED_ATOL = 1.0  # int8 weights: logits move by O(0.1); this only catches broken graphs
# ... and relative to the logits' range (validate.summarize): a broken graph of a model with small
# logits stays under any absolute bound (an int8 graph with all-zero weights: 0.57 on a tiny Llama)
QUANTIZED_RTOL = 0.25
# auto: the static-KV graph where the architecture has one (llama, gpt2), optimum's traced graph
# otherwise; static: require it; optimum: always the traced graph (KV concat layout).
GRAPH_CHOICES = ("auto", "static", "optimum")


@dataclass(frozen=True)
class ExportOptions:
    """Everything ``export_bundle`` needs besides the paths."""

    quantize_target: str = "none"
    quantize_draft: str = "none"
    dtype: str = "fp32"
    opset: int | None = None
    atol: float = DEFAULT_ATOL
    quantized_atol: float = DEFAULT_QUANTIZED_ATOL
    overwrite: bool = False
    graph: str = "auto"  # GRAPH_CHOICES: how decoder graphs are written (see export/static_kv.py)

    def __post_init__(self) -> None:
        if self.graph not in GRAPH_CHOICES:
            raise InvalidArgumentError(f"--graph must be one of {', '.join(GRAPH_CHOICES)}; got {self.graph!r}")
        for name in ("quantize_target", "quantize_draft"):
            if getattr(self, name) not in QUANT_CHOICES:
                raise InvalidArgumentError(f"{name.replace('_', '-')} must be one of {', '.join(QUANT_CHOICES)}; got {getattr(self, name)!r}")
        check_dtype(self.dtype)
        for name in ("atol", "quantized_atol"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v) or not v > 0:
                raise InvalidArgumentError(f"--{name.replace('_', '-')} must be a finite number > 0; got {v!r}")
        if self.opset is not None:
            top = _max_opset()
            if isinstance(self.opset, bool) or not isinstance(self.opset, int) or not 14 <= self.opset <= (top or self.opset):
                raise InvalidArgumentError(f"--opset must be an integer from 14 to {top} (the highest this torch "
                                           f"exports); got {self.opset!r}" if top else
                                           f"--opset must be an integer >= 14; got {self.opset!r}")


def _max_opset() -> int | None:
    """The highest ONNX opset the installed torch exports (a higher one fails deep in its tracer)."""
    try:
        from torch.onnx._constants import ONNX_MAX_OPSET
        return int(ONNX_MAX_OPSET)
    except Exception:  # noqa: BLE001  (a private constant: without it only the lower bound is checked)
        return None


def _stderr_progress(message: str) -> None:
    print(f"[edgespec export] {message}", file=sys.stderr, flush=True)


def _inside(child: Path, parent: Path) -> bool:
    return child == parent or parent in child.parents


def check_output(out: Path, inputs: list[Path], overwrite: bool) -> Path:
    dest = out.expanduser().resolve()
    for src in inputs:
        s = src.resolve()
        if _inside(dest, s):
            raise OutputExistsError(f"output folder {str(out)!r} lies inside the input checkpoint {str(src)!r}; choose an output outside it")
        if _inside(s, dest):
            raise OutputExistsError(f"input checkpoint {str(src)!r} lies inside the output folder {str(out)!r}; choose another output folder")
    if dest.exists() and not dest.is_dir():
        raise OutputExistsError(f"output {str(out)!r} exists and is not a folder; choose another path")
    if dest.is_dir() and _is_stale_partial(dest):  # a killed export's folder: removed before writing, if only that
        extra = foreign_names(dest, BUNDLE_FILES | {PARTIAL_MARKER})
        if extra:
            raise OutputExistsError(f"output folder {str(out)!r} is an unfinished export that also holds what an export "
                                    f"does not write ({', '.join(extra[:5])}); move that out of it, or choose another path")
    if dest.is_dir() and os.path.lexists(dest / PARTIAL_MARKER) and not _is_stale_partial(dest):
        # (its marker was called a file the user put there)
        raise OutputExistsError(f"output folder {str(out)!r} is being written by another export ({_marker_owner(dest)}: "
                                "running, or on another machine, where that cannot be checked); wait for it to finish, "
                                "or choose another path")
    if not _is_stale_partial(dest):
        check_output_folder(dest, overwrite, contract.MANIFEST_NAME, "an edgespec bundle", owned=BUNDLE_FILES)
    check_writable(dest)
    return dest


def _eos_ids(folder: Path, config: dict) -> list[int]:
    eos, source = None, "generation_config.json"
    gen = folder / source
    if gen.is_file():
        try:
            eos = json.loads(gen.read_text(encoding="utf-8")).get("eos_token_id")
        except (ValueError, AttributeError) as exc:
            raise CheckpointError(f"{gen} is not a JSON object ({exc}); fix or delete it (the EOS ids are read from "
                                  "it, else from config.json)") from None
    if eos is None:
        eos, source = config.get("eos_token_id"), "config.json"
    if eos is None:
        return []
    ids = eos if isinstance(eos, list) else [eos]
    if not all(isinstance(e, int) and not isinstance(e, bool) and e >= 0 for e in ids):
        raise CheckpointError(f"{folder / source}: eos_token_id {eos!r:.60} is not a token id (or a list of them); "
                              f"fix it in {source}")
    return ids


def _optional_id(ckpt: Checkpoint, key: str) -> int | None:
    """config.json's bos_token_id / pad_token_id (an int or null: inspect_checkpoint); a negative
    one is no such token (old Llama configs write pad_token_id -1; the manifest refused it)."""
    v = ckpt.config.get(key)
    return None if v is None or v < 0 else v


def _max_positions(ckpt: Checkpoint) -> int:
    n = contract.config_positions(ckpt.config, ckpt.kind)
    if n is None:
        given = {k: ckpt.config[k] for k in contract.POSITION_KEYS if ckpt.config.get(k) is not None}
        if given:  # (a string "128" was called missing)
            raise CheckpointError(f"{ckpt.path}/config.json: {', '.join(f'{k} {v!r:.20}' for k, v in given.items())} "
                                  "is not a count of positions; write it as a positive integer, and export again")
        raise UnsupportedArchitectureError(f"{ckpt.path}/config.json has no max_position_embeddings / n_positions; add it and export again")
    return n


def _validation_fix(quantized: bool, layout: str, role: str) -> str:
    """What to try when a graph differs from PyTorch: the options that change this export."""
    if quantized:
        return (f"export the {role} without int8 (--quantize-{role} none, or no --quantize) or raise "
                "--quantized-atol only if you accept the error")
    if layout == contract.KV_STATIC:
        return ("try --graph optimum (optimum's traced graph instead of edgespec's static-KV one), or raise --atol "
                "only if you accept the error")
    return "try another --opset, or raise --atol only if you accept the error"


def _kv_layout(ckpt: Checkpoint, opts: ExportOptions) -> str:
    if ckpt.kind != contract.KIND_DECODER or opts.graph == "optimum":
        if opts.graph == "static":
            raise UnsupportedArchitectureError(f"{ckpt.path}: --graph static is for decoder-only checkpoints (llama, gpt2), "
                                               f"not {ckpt.model_type}; use --graph auto")
        return contract.KV_CONCAT
    reason = static_kv.unsupported_reason(ckpt.model_type, ckpt.config)
    if reason is None:
        return contract.KV_STATIC
    if opts.graph == "static":
        raise UnsupportedArchitectureError(f"{ckpt.path}: no static-KV graph for {reason}; use --graph auto or --graph optimum")
    return contract.KV_CONCAT


def _quantize(role: str, folder: Path, names, progress: Callable[[str], None]) -> str:
    """int8 graphs in place of ``folder/<names>``; returns the manifest's quantization label ("none"
    when no weight product could be converted)."""
    causal, label = role == contract.ROLE_TARGET, QUANT_LABEL[role]["int8"]  # a target must stay causal (quantize_int8_rowwise)
    progress(f"{role}: int8 {'per-token (rowwise)' if causal else 'dynamic'} quantization")
    if not causal:
        for name in names:
            quantize_int8(folder / name)
        return label
    results = [quantize_int8_rowwise(folder / name) for name in names]
    converted, skipped = sum(n for n, _ in results), collections.Counter(r for _, why in results for r in why)
    reasons = "; ".join(f"{n} x {why}" for why, n in skipped.items())
    if not converted:
        warn(f"{role}: no MatMul or Gemm by a constant fp32 weight could be quantized"
             f"{f' ({reasons})' if reasons else ''}; the target is exported in fp32")
        return "none"
    if skipped:
        warn(f"{role}: {sum(skipped.values())} of {converted + sum(skipped.values())} weight products "
             f"stay fp32 ({reasons}); the others are int8")
    return label


def _export_one(ckpt: Checkpoint, role: str, folder: Path, quant: str, layout: str, opts: ExportOptions,
                progress: Callable[[str], None]) -> tuple[ModelManifest, int]:
    from .onnx_export import export_graphs, load_torch_model

    t0 = time.perf_counter()
    progress(f"{role}: loading {ckpt.architecture} from {ckpt.path} (safetensors)")
    model = load_torch_model(ckpt)
    rows = int(model.get_output_embeddings().weight.shape[0])
    vocab = load_vocab(ckpt.path)
    check_model_covers_tokenizer(vocab, rows, role)
    folder.mkdir(parents=True)
    if layout == contract.KV_STATIC:
        progress(f"{role}: writing the static-KV ONNX graph (in-place cache, GroupQueryAttention)")
        opset = static_kv.build(model, ckpt.model_type, ckpt.config, folder / contract.DECODER_FILE, _max_positions(ckpt))
        shutil.copy2(ckpt.path / contract.CONFIG_FILE, folder / contract.CONFIG_FILE)
    else:
        # (for a decoder under --graph auto, say why: its static-KV graph copies no cache on a rejection)
        why = static_kv.unsupported_reason(ckpt.model_type, ckpt.config) if ckpt.kind == contract.KIND_DECODER \
            and opts.graph == "auto" else None
        progress(f"{role}: exporting ONNX graphs with KV-cache IO (optimum)"
                 + (f"; no static-KV graph for {why}, so a rejection compacts the cache" if why else ""))
        opset = export_graphs(model, ckpt, folder, opts.opset)
    shutil.copy2(ckpt.path / contract.TOKENIZER_FILE, folder / contract.TOKENIZER_FILE)

    seq2seq = ckpt.kind == contract.KIND_SEQ2SEQ
    files = dict(contract.GRAPH_FILES[ckpt.kind])
    step_graph = folder / files["decoder_with_past" if seq2seq else "decoder"]
    num_layers = int(ckpt.config.get("num_decoder_layers") or ckpt.config.get("num_layers")) if seq2seq else None
    if not seq2seq:
        import onnx

        inputs = [i.name for i in onnx.load(str(step_graph), load_external_data=False).graph.input]
        num_layers = sum(1 for n in inputs if n.startswith("past_key_values.")) // 2
    past0 = (contract.seq2seq_self_past_names if seq2seq else contract.decoder_past_names)(num_layers)[0]
    kv_heads, head_size = graph_info.kv_geometry(step_graph, past0)
    dec_start = ckpt.config.get("decoder_start_token_id")
    limit = tokenizer_size(vocab)
    eos_ids = _eos_ids(ckpt.path, ckpt.config)
    never = [e for e in eos_ids if e >= limit]
    if never:  # the runtime samples below the tokenizer's size: such an EOS never ends a generation
        warn(f"{role}: eos_token_id {never} is not among the tokenizer's {limit} ids, so it never ends a "
             "generation (max_new_tokens or stop_token_ids will); fix eos_token_id in generation_config.json / "
             "config.json if the model has another EOS")

    refs: dict = {}  # PyTorch's reference passes, computed once for every validation of this model

    def run_validation(what: str, atol: float, rtol: float | None = None) -> dict:
        fix = _validation_fix(rtol is not None, layout, role)
        if seq2seq:
            stages, scale = validate.validate_seq2seq(model, folder, num_layers, limit, int(dec_start or 0), refs=refs)
        else:
            stages, scale = validate.validate_decoder(model, folder, num_layers, limit, static=layout == contract.KV_STATIC,
                                                      max_positions=_max_positions(ckpt), refs=refs)
        return validate.summarize(stages, atol, what, scale, rtol, fix)

    switch = contract.rope_switch(ckpt.config)
    if switch is not None:
        warn(f"{role}: {ckpt.path} uses length-dependent rotary scaling (longrope): its factors change past "
             f"{switch} tokens and the exported graph keeps the short ones, so the bundle is limited to "
             f"{switch} positions (prompt + new tokens); longer contexts are refused at run time")
    reach = validate.validated_positions(None if seq2seq else _max_positions(ckpt))
    progress(f"{role}: validating ONNX Runtime vs PyTorch (prefill, 1-token and {validate.MULTI_STEP_TOKENS}-token steps, "
             f"a rewound round, {reach} {'decoder ' if seq2seq else ''}positions)")
    record = {"fp32": run_validation(f"{role} (fp32)", opts.atol)}
    quant_label = _quantize(role, folder, files.values(), progress) if quant == "int8" else QUANT_LABEL[role][quant]
    if quant_label != "none":  # (nothing converted: the graphs are the fp32 ones validated above)
        progress(f"{role}: validating the int8 graphs vs PyTorch")
        record["int8"] = run_validation(f"{role} (int8)", opts.quantized_atol, QUANTIZED_RTOL)

    pbytes = graph_info.parameter_bytes(step_graph)
    bytes_record = {"total": sum(graph_info.parameter_bytes(folder / f)["total"] for f in files.values()),
                    "per_forward": pbytes["per_forward"]}
    if seq2seq:
        bytes_record["encoder"] = graph_info.parameter_bytes(folder / files["encoder"])["per_forward"]
    manifest = ModelManifest(
        path=role,
        architecture=ckpt.architecture,
        model_type=ckpt.model_type,
        kind=ckpt.kind,
        files=files,
        vocab_size=rows,
        tokenizer_size=limit,
        bos_token_id=_optional_id(ckpt, "bos_token_id"),
        eos_token_ids=eos_ids,
        pad_token_id=_optional_id(ckpt, "pad_token_id"),
        decoder_start_token_id=dec_start if seq2seq else None,
        num_layers=num_layers,
        num_kv_heads=kv_heads,
        head_size=head_size,
        max_positions=_max_positions(ckpt),
        dtype=opts.dtype,
        quantization=quant_label,
        parameter_bytes=bytes_record,
        validation=record,
        kv_layout=layout,
    )
    progress(f"{role}: validating the runtime's own calls (its KV buffers, a rewind) vs PyTorch")
    quantized = quant_label != "none"
    stages, scale = _validate_runtime(model, folder, manifest, limit, int(dec_start or 0) if seq2seq else None, refs)
    record = {**record, "runtime": validate.summarize(stages, opts.quantized_atol if quantized else opts.atol,
                                                      f"{role} ({'int8, ' if quantized else ''}runtime)", scale,
                                                      QUANTIZED_RTOL if quantized else None,
                                                      _validation_fix(quantized, layout, role))}
    manifest = dataclasses.replace(manifest, validation=record)
    diffs = ", ".join(f"{k} {v['max_abs_diff']:.2e}" for k, v in record.items())
    took = time.perf_counter() - t0  # (a tiny draft's 34 ms read "0.0s": as if it had been skipped)
    progress(f"{role}: done in {f'{took:.1f} s' if took >= 1 else f'{took * 1000:.0f} ms'} (max abs diff vs PyTorch: {diffs})")
    return manifest, opset


def _validate_runtime(model, folder: Path, manifest: ModelManifest, limit: int,
                      decoder_start: int | None, refs: dict) -> tuple[dict, float]:
    """validate.validate_runtime over the runtime's backend of the graphs just written."""
    from edgespec.runtimes.onnx_backend import OnnxDecoderBackend, OnnxSeq2SeqBackend, SessionConfig

    cls = OnnxDecoderBackend if decoder_start is None else OnnxSeq2SeqBackend
    try:
        backend = cls(folder, manifest, SessionConfig(intra_op_threads=1, huge_pages=False))
    except EdgeSpecError as exc:  # (its messages speak to a bundle's user: "re-export the bundle")
        raise ValidationError(f"the runtime could not load the exported graphs: {exc}; no bundle was written. "
                              "Report the model config") from exc
    try:
        return validate.validate_runtime(model, backend, limit, max_positions=manifest.max_positions,
                                         decoder_start=decoder_start, refs=refs)
    finally:
        backend.free()


def _versions() -> dict[str, str]:
    out = {}
    for dist in ("edgespec", "torch", "transformers", "optimum-onnx", "optimum", "onnx", "onnxruntime", "tokenizers"):
        try:
            out[dist] = metadata.version(dist)
        except metadata.PackageNotFoundError:
            out[dist] = "not installed"
    return out


def export_bundle(target: str | Path, out: str | Path, draft: str | Path | None = None,
                  options: ExportOptions = ExportOptions(),
                  progress: Callable[[str], None] | None = _stderr_progress,
                  xla: dict | None = None) -> BundleManifest:
    """Export ``target`` (and ``draft``) checkpoints into the bundle folder ``out``; return its manifest.

    ``xla``: keyword arguments of :func:`edgespec.export.xla.export_xla` (platforms, max_length,
    verify_width, ...) to also write jax.export artifacts into ``<role>/xla`` of the same bundle.
    ``progress=None``: quiet, transformers' progress bars (loading a sharded checkpoint) included.
    """
    from .onnx_export import transformers_progress_bars

    with transformers_progress_bars(progress is not None):
        return _export_bundle(target, out, draft, options, progress or (lambda message: None), xla)


def _check_pair(t: Checkpoint, d: Checkpoint) -> None:
    """A target and its draft: one family, else refused; warnings where the draft can gain little."""
    if t.kind != d.kind:
        raise UnsupportedArchitectureError(
            f"target is {t.kind} ({t.model_type}) but draft is {d.kind} ({d.model_type}); both must be "
            "decoder-only or both encoder-decoder: pick a draft of the target's family"
        )
    if t.path.resolve() == d.path.resolve():
        warn("the draft is the target itself: every draft token is kept, but each costs a full target "
             "step, so speculation is slower than plain decoding; pass a smaller draft")
    ts, ds = (int(m.config.get("decoder_start_token_id") or 0) for m in (t, d))  # (none: 0, as the runtime)
    if t.kind == contract.KIND_SEQ2SEQ and ts != ds:  # (both: the kinds are equal)
        warn(f"the draft's decoder starts from token {ds} and the target's from {ts}: the draft guesses "
             "after another start (the output stays exact; fewer drafts may be kept): pass a draft that "
             f"starts from token {ts} (decoder_start_token_id)")
    tp, dp = contract.config_positions(t.config, t.kind), contract.config_positions(d.config, d.kind)
    if tp is not None and dp is not None and dp < tp:
        warn(f"the draft takes {dp} positions and the target {tp}: past {dp} tokens (prompt and output) "
             "generation decodes plainly (so does a longer prompt, unless a drafter, gamma or lenience "
             "is given: then it is refused); pass a draft with as many positions as the target for speculation "
             "over the whole context")


def _lower_xla(roles: dict[str, Checkpoint], tmp: Path, xla: dict, checked: dict, options: ExportOptions,
               progress: Callable[[str], None]) -> dict:
    """jax.export artifacts of each model into ``tmp/<role>/xla``; returns the manifest's summary per role."""
    from .xla import export_xla, xla_summary

    summary = {}
    for role, ckpt in roles.items():
        progress(f"{role}: lowering jax.export artifacts for {', '.join(xla.get('platforms', ('cpu',)))}")
        # (a T5's encoder length as resolved by the check above: it warned about the default once)
        source = {"max_source_length": checked[role]["max_source_length"]} if ckpt.kind == contract.KIND_SEQ2SEQ else {}
        m = export_xla(ckpt.path, tmp / role,
                       **{"atol": options.atol, "vocab_limit": tokenizer_size(load_vocab(ckpt.path)), **xla, **source})
        v = m["validation"]
        progress(f"{role}: XLA artifacts " + (f"not validated: {v['skipped']}" if "skipped" in v else
                                              f"vs PyTorch: max |logits diff| {v['max_abs_diff']:.2e}"))
        summary[role] = xla_summary(m)
    return summary


def _config_rows(config: dict) -> int | None:
    """A config's vocab_size where it is a positive integer; None where it is absent or null (the
    model class's default then applies: a pair was refused for "0 embedding rows", and a null took
    a traceback; the rows are checked again from the exported graphs)."""
    rows = config.get("vocab_size")
    return rows if isinstance(rows, int) and not isinstance(rows, bool) and rows > 0 else None


def _export_bundle(target, out, draft, options: ExportOptions, progress: Callable[[str], None],
                   xla: dict | None) -> BundleManifest:
    roles: dict[str, Checkpoint] = {contract.ROLE_TARGET: inspect_checkpoint(target, contract.ROLE_TARGET)}
    if draft is None and options.quantize_draft != "none":
        raise InvalidArgumentError(f"quantize_draft={options.quantize_draft!r}: this export has no draft; pass draft=, or "
                                   "drop quantize_draft (quantize_target sets the target's precision)")
    if draft is not None:
        roles[contract.ROLE_DRAFT] = inspect_checkpoint(draft, contract.ROLE_DRAFT)
        _check_pair(roles[contract.ROLE_TARGET], roles[contract.ROLE_DRAFT])
    layouts = {role: _kv_layout(ckpt, options) for role, ckpt in roles.items()}  # --graph refusals, before any loading
    if options.opset is not None and all(layout == contract.KV_STATIC for layout in layouts.values()):
        raise InvalidArgumentError(f"--opset sets the opset of optimum's traced graphs; these models get static-KV graphs "
                                   f"(opset {static_kv.OPSET}): drop --opset, or add --graph optimum")
    for ckpt in roles.values():  # cheap checks of what is read after the export, before it
        _eos_ids(ckpt.path, ckpt.config)
        positions = _max_positions(ckpt) if ckpt.kind == contract.KIND_DECODER else None
        if positions is not None and positions < validate.MIN_POSITIONS:
            raise UnsupportedArchitectureError(
                f"{ckpt.path} has {positions} positions; edgespec validates and speculates over at least "
                f"{validate.MIN_POSITIONS} tokens: export a model with more positions")
    if xla is not None:
        if options.quantize_target != "none":
            raise InvalidArgumentError(
                "--format onnx+xla with an int8 target would hold two different targets (the XLA artifacts are "
                "fp32, so the two runtimes would sample from different models); export the XLA bundle without "
                "--quantize (a draft may still be int8: --quantize-draft int8)")
        from .xla import check_xla_options

        # XLA options, checked against each config before the ONNX work
        checked = {role: check_xla_options(ckpt.path, **{"atol": options.atol, **xla}) for role, ckpt in roles.items()}
        if draft is not None and checked[contract.ROLE_TARGET]["verify_width"] == 1:
            warn("--verify-width 1 leaves no room for a draft token: the XLA runtime can only decode plainly "
                 "with this bundle; pass --verify-width 2 or more (max gamma + 1; default 9)")
    dest = check_output(Path(out), [c.path for c in roles.values()], options.overwrite)
    if draft is not None:  # (the target's are checked as it loads, first; the draft's only after the target's export)
        from .onnx_export import check_finite_weights

        check_finite_weights(roles[contract.ROLE_DRAFT].path)

    tok_record: dict = {}
    if draft is not None:
        t, d = roles[contract.ROLE_TARGET], roles[contract.ROLE_DRAFT]
        tok_record = shared_vocab(load_vocab(t.path), load_vocab(d.path),
                                  _config_rows(t.config), _config_rows(d.config), from_config=True)

    quantized = frozenset(role for role in roles if (options.quantize_target if role == contract.ROLE_TARGET
                                                      else options.quantize_draft) != "none")
    need = _estimate_bytes(roles, xla is not None, layouts, quantized)
    # the folders above --out that this export makes: a failed export removes them again (if empty)
    made = [d for d in (dest.parent, *dest.parent.parents) if not d.exists()]
    try:
        for attempt in range(3):
            dest.parent.mkdir(parents=True, exist_ok=True)
            _remove_stale_partials(dest)
            _check_free_space(dest.parent, need)
            try:
                tmp = Path(tempfile.mkdtemp(prefix=f".{dest.name}.partial-", dir=dest.parent))
                break
            except FileNotFoundError:  # another export's failure removed the folder it made above --out
                if attempt == 2:
                    raise
    except OSError as exc:
        _discard(None, made)
        raise _as_disk_full(exc, dest.parent, need) or exc
    token = uuid.uuid4().hex
    _LIVE_EXPORTS.add(token)
    try:
        # The marker makes the folder "not a bundle" for load_bundle until it is renamed into place.
        (tmp / PARTIAL_MARKER).write_text(json.dumps({"pid": os.getpid(), "host": socket.gethostname(), "token": token}))
        models, opset = {}, 0
        for role, ckpt in roles.items():
            quant = options.quantize_target if role == contract.ROLE_TARGET else options.quantize_draft
            models[role], model_opset = _export_one(ckpt, role, tmp / role, quant, layouts[role], options, progress)
            opset = max(opset, model_opset)  # the manifest's: the highest, what the runtime must support
        if draft is not None:
            # Actual embedding rows (config vocab_size may be absent or stale).
            tok_record = shared_vocab(load_vocab(tmp / contract.ROLE_TARGET), load_vocab(tmp / contract.ROLE_DRAFT),
                                      models[contract.ROLE_TARGET].vocab_size, models[contract.ROLE_DRAFT].vocab_size)
        formats = {} if xla is None else {"xla": _lower_xla(roles, tmp, xla, checked, options, progress)}
        manifest = BundleManifest(
            formats=formats,
            schema_version=contract.SCHEMA_VERSION,
            models=models,
            shared_vocab_size=tok_record.get("shared_vocab_size", models[contract.ROLE_TARGET].vocab_size),
            opset=opset,
            library_versions=_versions(),
            tokenizer_check=tok_record,
        )
        write_manifest(tmp, manifest)
        load_bundle(tmp, allow_partial=True)  # the reader must accept what the writer wrote
        usual_permissions(tmp, recursive=True)  # mkdtemp (0700), onnx's external data and XLA weights (0600)
        progress(f"writing {dest}")
        swap_into_place(tmp, dest, options.overwrite, contract.MANIFEST_NAME, "an edgespec bundle", owned=BUNDLE_FILES)
        # Killed before this line: dest holds the marker, does not load, and the next export of
        # the same --out replaces it (check_output treats it as our own stale leftover).
        (dest / PARTIAL_MARKER).unlink()
        _fsync_dir(dest.parent)
    except OSError as exc:
        _discard(tmp, made)
        full = _as_disk_full(exc, dest.parent, need)
        if full is not None:
            raise full from exc
        raise
    except BaseException as exc:
        _discard(tmp, made)
        full = _as_disk_full(exc, dest.parent, need)  # a library may wrap the OSError in its own error
        if full is not None:
            raise full from exc
        raise
    finally:
        _LIVE_EXPORTS.discard(token)
    return manifest


def _discard(tmp: Path | None, made: list[Path]) -> None:
    """A failed export's work folder, and the folders above --out it made (deepest first, if still empty)."""
    if tmp is not None:
        shutil.rmtree(tmp, ignore_errors=True)
    for folder in made:
        try:
            folder.rmdir()
        except OSError:
            break  # something else is in it now, or it is gone: the folders above it stay too


# ---- interrupted exports and full disks ----------------------------------------------------------
_DISK_FULL_ERRNOS = {errno.ENOSPC, errno.EFBIG, getattr(errno, "EDQUOT", errno.ENOSPC)}
_DISK_FULL_TEXT = ("No space left on device", "File too large", "Disk quota exceeded")


_LIVE_EXPORTS: set[str] = set()  # marker tokens of this process's exports in progress


def _marker_owner_alive(folder: Path) -> bool:
    """Whether the export that wrote ``folder``'s marker may still be running (unknown -> True)."""
    info = _read_marker(folder)
    if info is None:
        return False  # unreadable marker: the process died while writing it
    pid, host = info["pid"], info["host"]
    if host != socket.gethostname():
        return True  # another machine (shared disk): cannot tell, leave it
    if pid == os.getpid():  # this process: alive while that export runs (another thread's)
        return info.get("token") in _LIVE_EXPORTS
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def _read_marker(folder: Path) -> dict | None:
    """The marker's pid (int), host (str) and token; None if it cannot be read."""
    try:
        info = json.loads((folder / PARTIAL_MARKER).read_text())
        return {**info, "pid": int(info["pid"]), "host": str(info["host"])}
    except (OSError, ValueError, KeyError, TypeError, AttributeError):
        return None


def _marker_owner(folder: Path) -> str:
    info = _read_marker(folder)
    return "unknown" if info is None else f"pid {info['pid']} on {info['host'][:60]}"


def _is_stale_partial(folder: Path) -> bool:
    return os.path.lexists(folder / PARTIAL_MARKER) and not _marker_owner_alive(folder)


def _remove_stale_partials(dest: Path) -> None:
    """Delete temporary folders of earlier exports to ``dest`` that were killed (SIGKILL, power loss)."""
    for p in dest.parent.glob(f".{dest.name}.partial-*"):
        if p.is_dir() and not p.is_symlink() and _is_stale_partial(p):
            shutil.rmtree(p, ignore_errors=True)
    if dest.is_dir() and _is_stale_partial(dest):
        shutil.rmtree(dest, ignore_errors=True)


def _fsync_dir(folder: Path) -> None:
    try:
        fd = os.open(folder, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


def _estimate_bytes(roles: dict[str, Checkpoint], with_xla: bool, layouts: dict[str, str] | None = None,
                    quantized: frozenset[str] = frozenset()) -> int:
    """Rough peak disk use of the export: fp32 weights per model (ONNX graphs hold them once, and a
    static-KV graph holds a tied embedding twice, table and LM head, plus its rotary tables; XLA once
    more), plus, for a role quantized to int8, its rewrite beside the fp32 graph until it replaces it
    (the embedding and the rotary tables in fp32, a quarter of the rest)."""
    total = 0
    for role, ckpt in roles.items():
        weights = sum(p.stat().st_size for p in ckpt.path.glob("*.safetensors"))
        dtype = str(ckpt.config.get("torch_dtype") or ckpt.config.get("dtype") or "float32")
        fp32 = weights * (2 if ("16" in dtype) else 1)
        cfg = ckpt.config
        hidden = cfg.get("hidden_size") or cfg.get("n_embd") or cfg.get("d_model") or 0
        embedding = 4 * int(cfg.get("vocab_size") or 0) * int(hidden) if isinstance(hidden, int) else 0
        graph, fp32_kept = fp32, embedding
        if (layouts or {}).get(role) == contract.KV_STATIC:
            graph += embedding if cfg.get("tie_word_embeddings", True) else 0
            if ckpt.model_type == "llama":  # cos and sin tables [max_positions, head / 2], fp32
                heads = cfg.get("num_attention_heads") or 1
                rotary = 4 * _max_positions(ckpt) * int(cfg.get("head_dim") or int(hidden) // int(heads))
                graph, fp32_kept = graph + rotary, fp32_kept + rotary
        copies = 2 if ckpt.kind == contract.KIND_SEQ2SEQ else 1  # two decoder graphs
        rewrite = fp32_kept + (graph - fp32_kept) // 4 if role in quantized else 0  # one graph at a time
        total += graph * copies + rewrite + (fp32 if with_xla else 0) + (1 << 20)
    return total


def _check_free_space(folder: Path, need: int) -> None:
    free = shutil.disk_usage(folder).free
    if free < need:
        raise DiskFullError(
            f"not enough disk space for the export: about {_mib(need)} needed, {_mib(free)} free on the disk "
            f"holding {str(folder)!r}; free some space or choose an --out on another disk")


def _mib(n: int) -> str:
    return f"{n / 2**20:.1f} MiB" if n < 2**30 else f"{n / 2**30:.2f} GiB"


def _as_disk_full(exc: BaseException, folder: Path, need: int) -> DiskFullError | None:
    """A DiskFullError if ``exc`` (or an exception it wraps) says the disk or a file-size limit ran out
    (``need``: the estimate checked before the export)."""
    seen = set()
    e: BaseException | None = exc
    while e is not None and id(e) not in seen:
        seen.add(id(e))
        if isinstance(e, DiskFullError):
            return None
        if (isinstance(e, OSError) and e.errno in _DISK_FULL_ERRNOS) or any(t in str(e) for t in _DISK_FULL_TEXT):
            try:
                free = _mib(shutil.disk_usage(folder).free)
            except OSError:
                free = "unknown"
            what = ("a file-size limit (ulimit -f) was reached" if isinstance(e, OSError) and e.errno == errno.EFBIG
                    else "the disk is full")
            return DiskFullError(
                f"export failed: {what} while writing into {str(folder)!r} ({e}); the export needs about "
                f"{_mib(need)} (free now: {free}). Nothing was written: free some space "
                "(or raise the limit) or choose an --out on another disk, then run the export again")
        e = e.__cause__ or e.__context__
    return None
