"""ONNX Runtime vs PyTorch on the call shapes the speculative loop makes.

The reference is ONE cache-free PyTorch forward over the whole sequence; the ONNX graphs are run
incrementally: prefill (n tokens, empty past), a 1-token step (the draft's call), a k-token step
(the target verifying gamma + 1 tokens), then a rejected round: k junk tokens are fed, the cache
is rewound past them as the runtime does (a shorter mask over a stale tail for static-KV graphs, a
shorter past for concat graphs) and the sequence goes on in k-token steps to LONG_TOKENS
positions (or the model's limit), so positions far from the start and rewinds are checked too.
Every logits and present output of every stage is compared with the matching slice of the
reference; the max abs diff of each is recorded.
"""
from __future__ import annotations

from pathlib import Path

import numpy as np

from edgespec import contract
from edgespec.errors import EdgeSpecError, ValidationError

PREFILL_TOKENS = 7
MULTI_STEP_TOKENS = 4  # the k-token step (gamma + 1 with gamma = 3)
MIN_POSITIONS = PREFILL_TOKENS + 1 + MULTI_STEP_TOKENS  # the shortest sequence validated
LONG_TOKENS = 64  # decoder tokens reached after the rejected round (when the model has the positions)


def _kv_pairs(cache) -> list[tuple[np.ndarray, np.ndarray]]:
    """(key, value) per layer of a transformers cache, as numpy [1, kv_heads, seq, head]."""
    if hasattr(cache, "layers"):
        pairs = [(layer.keys, layer.values) for layer in cache.layers]
    elif hasattr(cache, "to_legacy_cache"):
        pairs = [tuple(kv[:2]) for kv in cache.to_legacy_cache()]
    else:
        pairs = [tuple(kv[:2]) for kv in cache]
    return [(k.detach().float().numpy(), v.detach().float().numpy()) for k, v in pairs]


def _diff(a: np.ndarray, b: np.ndarray, name: str) -> float:
    if a.shape != b.shape:
        raise ValidationError(f"output {name}: ONNX shape {a.shape} differs from PyTorch {b.shape}; the export is broken, report it")
    d = np.abs(a.astype(np.float64) - b.astype(np.float64))
    return float("nan") if not np.all(np.isfinite(d)) else float(d.max(initial=0.0))


def _session(path: Path):
    import onnxruntime as ort

    opts = ort.SessionOptions()
    opts.intra_op_num_threads = 1
    opts.log_severity_level = 3
    return ort.InferenceSession(str(path), opts, providers=["CPUExecutionProvider"])


def _run(sess, outputs: list[str], feed: dict, stage: str) -> list:
    try:
        return sess.run(outputs, feed)
    except Exception as exc:  # ORT's Fail / InvalidArgument / RuntimeException
        msg = " ".join(str(exc).split())[:600]
        raise ValidationError(f"ONNX Runtime could not run the exported graph ({stage}): {msg}; no bundle was written. "
                              "Try `edgespec export --graph optimum`, another --opset, or report the model config") from exc


def _float_type(sess, name: str):
    t = next(i.type for i in sess.get_inputs() if i.name == name)
    return np.float16 if "float16" in t else np.float32


def validated_positions(max_positions: int | None) -> int:
    """How far validation runs: LONG_TOKENS, or the model's positions if fewer (None: no limit,
    T5's relative positions). Callers refuse models below MIN_POSITIONS first."""
    return LONG_TOKENS if max_positions is None else min(max_positions, LONG_TOKENS)


def _plan(positions: int, prefill: int = PREFILL_TOKENS) -> list[tuple[str, int, bool]]:
    """(stage, tokens, junk) in call order for a sequence of ``positions`` tokens: a prefill of
    ``prefill`` tokens, a 1-token step, a k-token step, then (room permitting) k junk tokens that
    are rewound, and the steps after the rewind."""
    plan = [("prefill", prefill, False), ("step_1", 1, False), (f"step_{MULTI_STEP_TOKENS}", MULTI_STEP_TOKENS, False)]
    done = prefill + 1 + MULTI_STEP_TOKENS
    if positions >= done + MULTI_STEP_TOKENS:
        # after the junk, a 1- and a 2-token step: the stale junk tail lies past the next calls' mask
        plan.append(("rejected", MULTI_STEP_TOKENS, True))
        widths = iter((1, 2))
        while done < positions:
            k = min(next(widths, MULTI_STEP_TOKENS), positions - done)
            plan.append(("after_rewind", k, False))
            done += k
    return plan


def rounding_hint(name: str | None, diff: float, logits_scale: float | None, flag: str = "--atol") -> str:
    """Where the worst difference is in the logits and tiny against their range: say that it looks like
    float32 rounding (it grows with the values: a T5 with logits up to 231 differed by 6.4e-3, 1.6e-5 of
    their range, and decoded token-identically) and what accepting it means; a wrong graph errs by a
    large part of the range. Empty otherwise."""
    if not name or not name.endswith(contract.LOGITS) or not logits_scale or not np.isfinite(diff) \
            or diff > 1e-4 * logits_scale:
        return ""
    accept = float(f"{2 * diff:.1g}")
    # logits off by up to d move a probability by a factor up to e^(2d) (its logit and the normaliser's)
    return (f" That is {diff / logits_scale:.1e} of the logits' range ({logits_scale:.3g}): float32 rounding in a model "
            f"with large logits, most likely, not a wrong graph; {flag} {accept:g} accepts it (a probability may then "
            f"be off by a factor up to e^{2 * accept:g}).")


def logits_range(ref_logits: np.ndarray) -> float:
    """The spread of the reference logits (largest max - min over positions): the scale a
    quantized model's differences are judged against."""
    return float((ref_logits.max(axis=-1) - ref_logits.min(axis=-1)).max())


def validate_decoder(model, folder: Path, num_layers: int, vocab_limit: int, seed: int = 0,
                     static: bool = False, max_positions: int | None = None,
                     refs: dict | None = None) -> tuple[dict, float]:
    """``static``: a static-KV graph (past and present are buffers of a fixed capacity; here the
    validated length, present[:, :, :end] is compared), else a concat graph (past starts empty).
    ``refs``: a dict that keeps PyTorch's reference passes for the other validations of the same
    model (int8 graphs, the runtime's calls). Returns the stages' differences and the reference's
    logits_range."""
    sess = _session(folder / contract.DECODER_FILE)
    in_names = {i.name for i in sess.get_inputs()}
    past_names = contract.decoder_past_names(num_layers)
    present_names = contract.decoder_present_names(num_layers)
    shapes = {i.name: i.shape for i in sess.get_inputs()}
    heads, head = shapes[past_names[0]][1], shapes[past_names[0]][3]
    ftype = _float_type(sess, past_names[0])

    total = validated_positions(max_positions)
    ids, junk, ref = _decoder_reference(model, vocab_limit, total, seed, refs)
    ref_logits = ref.logits.float().numpy()
    ref_kv = [a for pair in _kv_pairs(ref.past_key_values) for a in pair]

    past = [np.zeros((1, heads, total if static else 0, head), dtype=ftype) for _ in past_names]
    stages, start = {}, 0
    for stage, k, rejected in _plan(total):
        end = start + k
        feed = {contract.INPUT_IDS: junk if rejected else ids[:, start:end], **dict(zip(past_names, past))}
        if contract.ATTENTION_MASK in in_names:
            feed[contract.ATTENTION_MASK] = np.ones((1, end), dtype=np.int64)
        if contract.POSITION_IDS in in_names:
            feed[contract.POSITION_IDS] = np.arange(start, end, dtype=np.int64)[None, :]
        outs = _run(sess, [contract.LOGITS, *present_names], feed, stage)
        if rejected:  # rewind to ``start``: static, the next mask is shorter (the tail goes stale); concat, cut
            past = outs[1:] if static else [np.ascontiguousarray(p[:, :, :start]) for p in outs[1:]]
            continue
        diffs = {contract.LOGITS: _diff(outs[0], ref_logits[:, start:end], contract.LOGITS)}
        for name, got, want in zip(present_names, outs[1:], ref_kv):
            # A sliding-window cache (Mistral, Phi-3, ...) keeps only the last positions of the
            # reference pass: [offset, total). Compare the positions both hold.
            offset = total - want.shape[2]
            lo = max(offset, 0)
            if not static and got.shape[2] != end:
                diffs[name] = _diff(got, want[:, :, :end], name)  # a wrong length: the shape error
            elif end > lo:
                diffs[name] = _diff(got[:, :, lo:end], want[:, :, lo - offset:end - offset], name)
        stages[stage] = _merge(stages.get(stage), diffs)
        past, start = outs[1:], end
    return stages, logits_range(ref_logits)


def _decoder_reference(model, vocab_limit: int, total: int, seed: int, refs: dict | None = None):
    """The validated sequence ids [1, total], the junk of the rejected round [1, k], and PyTorch's
    one cache-free forward over the sequence (kept in ``refs`` for the model's other validations)."""
    key = ("decoder", vocab_limit, total, seed)
    if refs is not None and key in refs:
        return refs[key]
    import torch

    rng = np.random.default_rng(seed)
    ids = rng.integers(0, vocab_limit, size=(1, total), dtype=np.int64)
    junk = rng.integers(0, vocab_limit, size=(1, MULTI_STEP_TOKENS), dtype=np.int64)
    with torch.no_grad():
        out = ids, junk, model(input_ids=torch.from_numpy(ids), use_cache=True)
    if refs is not None:
        refs[key] = out
    return out


def _seq2seq_reference(model, vocab_limit: int, decoder_start: int, total: int, seed: int, refs: dict | None = None):
    """The encoder input [1, P] and its mask, the decoder sequence [1, total] (the start token
    first), the rejected round's junk [1, k], and PyTorch's one cache-free pass over them (kept in
    ``refs`` as _decoder_reference's)."""
    key = ("seq2seq", vocab_limit, decoder_start, total, seed)
    if refs is not None and key in refs:
        return refs[key]
    import torch

    rng = np.random.default_rng(seed)
    src = rng.integers(0, vocab_limit, size=(1, PREFILL_TOKENS), dtype=np.int64)
    mask = np.ones_like(src)
    tgt = np.concatenate([[[decoder_start]], rng.integers(0, vocab_limit, size=(1, total - 1))], axis=1).astype(np.int64)
    junk = rng.integers(0, vocab_limit, size=(1, MULTI_STEP_TOKENS), dtype=np.int64)
    with torch.no_grad():
        # The encoder is called explicitly: after optimum's export the encoder stack's config may
        # carry use_cache=True, which T5Stack refuses for an encoder.
        encoded = model.get_encoder()(input_ids=torch.from_numpy(src), attention_mask=torch.from_numpy(mask),
                                      use_cache=False, return_dict=True)
        ref = model(encoder_outputs=encoded, attention_mask=torch.from_numpy(mask),
                    decoder_input_ids=torch.from_numpy(tgt), use_cache=True)
    if refs is not None:
        refs[key] = src, mask, tgt, junk, ref
    return src, mask, tgt, junk, ref


def validate_runtime(model, backend, vocab_limit: int, seed: int = 0, max_positions: int | None = None,
                     decoder_start: int | None = None, refs: dict | None = None) -> tuple[dict, float]:
    """The calls of validate_decoder (validate_seq2seq with a ``decoder_start``) made through the
    runtime's backend over the written graphs (its IOBinding, its KV buffers, in place for
    static-KV graphs, and ``rewind_to`` after the rejected round), so that the path generation runs
    is what is checked; the raw-session validation passes past and present as separate arrays.
    Logits only (the cache is the backend's own)."""
    total = validated_positions(max_positions)  # (the backend's buffers hold max_positions tokens, T5's too)
    if decoder_start is None:
        ids, junk, ref = _decoder_reference(model, vocab_limit, total, seed, refs)
        plan, src = _plan(total), None
    else:  # the prompt goes to the encoder; the backend's prefill returns the decoder start's logits
        src, _, ids, junk, ref = _seq2seq_reference(model, vocab_limit, decoder_start, total, seed, refs)
        plan = _plan(total, prefill=1)
    ref_logits = ref.logits.float().numpy()
    stages, start = {}, 0
    for stage, k, rejected in plan:
        end = start + k
        try:
            if stage == "prefill":
                got = backend.prefill(ids[0, :end] if src is None else src[0])[None, None]
                want = ref_logits[:, end - 1:end]
            else:
                got, want = backend.extend(junk[0] if rejected else ids[0, start:end])[None], ref_logits[:, start:end]
        except EdgeSpecError as exc:
            raise ValidationError(f"the runtime could not run the exported graph ({stage}): {exc}; no bundle was "
                                  "written. Try `edgespec export --graph optimum`, or report the model config") from exc
        if rejected:
            backend.rewind_to(start)
            continue
        stages[stage] = _merge(stages.get(stage), {contract.LOGITS: _diff(got, want, contract.LOGITS)})
        start = end
    return stages, logits_range(ref_logits)


def _merge(old: dict | None, new: dict) -> dict:
    """A stage run several times (after_rewind) records the worst difference per output."""
    if old is None:
        return new
    return {k: max(old.get(k, 0.0), v) if np.isfinite(v) and np.isfinite(old.get(k, 0.0)) else float("nan")
            for k, v in new.items()}


def validate_seq2seq(model, folder: Path, num_layers: int, vocab_limit: int, decoder_start: int,
                     seed: int = 0, refs: dict | None = None) -> tuple[dict, float]:
    """As validate_decoder, for an encoder-decoder: the encoder, the first decoder step, then the
    decoder-with-past graph over LONG_TOKENS decoder tokens (with the rejected round)."""
    enc = _session(folder / contract.ENCODER_FILE)
    dec = _session(folder / contract.SEQ2SEQ_DECODER_FILE)
    dec_past = _session(folder / contract.SEQ2SEQ_DECODER_WITH_PAST_FILE)
    self_past = contract.seq2seq_self_past_names(num_layers)
    self_present = contract.seq2seq_self_present_names(num_layers)
    cross_past = contract.seq2seq_cross_past_names(num_layers)
    cross_present = contract.seq2seq_cross_present_names(num_layers)

    total = validated_positions(None)
    src, mask, tgt, junk, ref = _seq2seq_reference(model, vocab_limit, decoder_start, total, seed, refs)
    ref_logits = ref.logits.float().numpy()
    cache = ref.past_key_values
    ref_self = [a for pair in _kv_pairs(cache.self_attention_cache) for a in pair]
    ref_cross = [a for pair in _kv_pairs(cache.cross_attention_cache) for a in pair]

    stages = {}
    (hidden,) = _run(enc, [contract.ENCODER_OUTPUT], {contract.ENCODER_INPUT_IDS: src, contract.ENCODER_ATTENTION_MASK: mask}, "encoder")
    stages["encoder"] = {contract.ENCODER_OUTPUT: _diff(hidden, ref.encoder_last_hidden_state.float().numpy(), contract.ENCODER_OUTPUT)}

    outs = _run(dec, [contract.LOGITS, *self_present, *cross_present], {
        contract.DECODER_INPUT_IDS: tgt[:, :1], contract.DECODER_ENCODER_HIDDEN_STATES: hidden,
        contract.DECODER_ENCODER_ATTENTION_MASK: mask}, "prefill")
    n = num_layers * 2
    logits, past, cross = outs[0], outs[1:1 + n], outs[1 + n:]
    diffs = {contract.LOGITS: _diff(logits, ref_logits[:, :1], contract.LOGITS)}
    diffs.update({nm: _diff(g, w[:, :, :1], nm) for nm, g, w in zip(self_present, past, ref_self)})
    diffs.update({nm: _diff(g, w, nm) for nm, g, w in zip(cross_present, cross, ref_cross)})
    stages["prefill"] = diffs

    start = 1
    for stage, k, rejected in _plan(total, prefill=1)[1:]:  # the decoder's prefill (1 token) ran above
        end = start + k
        feed = {contract.DECODER_INPUT_IDS: junk[:, :k] if rejected else tgt[:, start:end],
                contract.DECODER_ENCODER_ATTENTION_MASK: mask, **dict(zip(self_past, past)), **dict(zip(cross_past, cross))}
        outs = _run(dec_past, [contract.LOGITS, *self_present], feed, stage)
        if rejected:  # rewind: the concat graph's past is cut back to ``start``
            past = [np.ascontiguousarray(p[:, :, :start]) for p in outs[1:]]
            continue
        diffs = {contract.LOGITS: _diff(outs[0], ref_logits[:, start:end], contract.LOGITS)}
        diffs.update({nm: _diff(g, w[:, :, :end], nm) for nm, g, w in zip(self_present, outs[1:], ref_self)})
        stages[stage] = _merge(stages.get(stage), diffs)
        past, start = outs[1:], end
    return stages, logits_range(ref_logits)


def worst(diffs: dict) -> tuple[str | None, float]:
    """(name, value) of the largest difference in ``{name: diff}``; a NaN (non-finite output) wins."""
    worst_name, worst_d = None, 0.0
    for name, d in diffs.items():
        if not np.isfinite(d):
            return name, d
        if d > worst_d:
            worst_name, worst_d = name, d
    return worst_name, worst_d


def summarize(stages: dict, atol: float, what: str, logits_scale: float | None = None,
              rtol: float | None = None, fix: str = "raise --atol only if you accept the error") -> dict:
    """Worst diff over all stages/outputs; ValidationError if it exceeds ``atol`` (or is NaN), or,
    with ``rtol``, if the worst logits diff exceeds rtol x ``logits_scale`` (the reference's
    logits_range): a quantized model is judged against the size of its logits, so that a broken
    graph of a model with small logits cannot pass an absolute bound. ``fix``: what to try, for
    this model's export (quantized or not, which graph)."""
    worst_name, worst_d = worst({f"{stage}/{name}": d for stage, diffs in stages.items() for name, d in diffs.items()})
    if not np.isfinite(worst_d) or worst_d > atol:
        advice = rounding_hint(worst_name, worst_d, logits_scale, "--quantized-atol" if rtol is not None else "--atol") \
            or f" {fix[0].upper()}{fix[1:]}"
        raise ValidationError(f"{what}: ONNX Runtime output {worst_name} differs from PyTorch by {worst_d:.3g} (tolerance "
                              f"{atol:g}); no bundle was written.{advice}")
    record = {"atol": atol, "max_abs_diff": worst_d, "worst_output": worst_name, "stages": stages}
    if rtol is not None and logits_scale is not None:
        logits_d = max(diffs.get(contract.LOGITS, 0.0) for diffs in stages.values())
        if logits_d > rtol * logits_scale:
            raise ValidationError(
                f"{what}: the quantized logits differ from PyTorch by {logits_d:.3g}, {logits_d / logits_scale:.0%} of "
                f"the logits' range ({logits_scale:.3g}; at most {rtol:.0%} allowed): the quantized graph is broken "
                f"or this model does not survive int8; no bundle was written. {fix[0].upper()}{fix[1:]}")
        record.update(logits_range=logits_scale, rtol=rtol)
    return record
