"""The ONNX naming contract between the exporter (``edgespec.export``) and the runtimes.

This is the only place that knows file names and graph input/output names. Both sides import
it; neither spells a name by hand. The names follow optimum's exporter: decoder-only models take
``past_key_values.{i}.key`` and return ``present.{i}.key``, with KV tensors laid out
[batch, kv_heads, seq, head]; how present relates to past is the model's KV layout (below).
"""
from __future__ import annotations

MANIFEST_NAME = "edgespec.json"
SCHEMA_VERSION = 1
SUPPORTED_SCHEMA_VERSIONS = (1,)

ROLE_TARGET = "target"
ROLE_DRAFT = "draft"

# Manifest "quantization" of a model quantized with ONNX Runtime's dynamic int8 (one activation
# scale per call): fine for a draft, not for a target (see export/quantize.py).
QUANT_DYNAMIC_INT8 = "int8-dynamic"
# A target's int8: activations quantized per token (rowwise: MatMulInteger; blockwise: MatMulNBits,
# written before 2026-11-30), so a position's logits do not depend on the rest of the call.
QUANT_ROWWISE_INT8 = "int8-rowwise"
QUANT_LABELS = ("none", QUANT_ROWWISE_INT8, "int8-blockwise", QUANT_DYNAMIC_INT8)  # a model's "quantization" in the manifest
DTYPES = ("fp32", "fp16")  # a model's "dtype": activations and KV cache
BUNDLE_FORMAT = "edgespec-bundle"  # the manifest's "format"

KIND_DECODER = "decoder"  # decoder-only causal LM: one graph, past may be empty
KIND_SEQ2SEQ = "seq2seq"  # encoder-decoder (T5): encoder, first decoder step, decoder with past
# A T5 bundle's decoder positions where its config names none (relative attention has no hard
# limit; T5 was trained on 512 tokens).
T5_MAX_POSITIONS = 512
POSITION_KEYS = ("max_position_embeddings", "n_positions", "n_ctx")  # config.json's position count, by family


def seq2seq_positions(config: dict) -> int:
    """An encoder-decoder's decoder positions in its bundle (the ONNX manifest's max_positions, the
    most an XLA export may take): the config's count, else T5_MAX_POSITIONS."""
    return next((int(config[k]) for k in POSITION_KEYS if _count(config.get(k))), T5_MAX_POSITIONS)


def _count(v) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def rope_switch(config: dict) -> int | None:
    """Length at which the checkpoint's rotary factors change (Phi-3's longrope: short factors up to
    original_max_position_embeddings tokens, long ones past it). The traced graph keeps the short
    ones, so a bundle must stop there; None when the factors do not depend on the length."""
    rope = config.get("rope_scaling") or config.get("rope_parameters")  # the latter: newer transformers
    kind = (rope.get("rope_type") or rope.get("type")) if isinstance(rope, dict) else None
    orig = config.get("original_max_position_embeddings") or (rope.get("original_max_position_embeddings") if kind else None)
    if kind in ("longrope", "su") and isinstance(orig, int) and orig < (config.get("max_position_embeddings") or 0):
        return orig
    return None


def config_positions(config: dict, kind: str) -> int | None:
    """The positions a model's bundle takes, from its config.json (the manifest's max_positions as
    the exporter writes it); None for a decoder-only config that names none."""
    if kind == KIND_SEQ2SEQ:
        return seq2seq_positions(config)
    for key in POSITION_KEYS:
        if _count(config.get(key)):
            n = int(config[key])
            return min(n, rope_switch(config) or n)
    return None

# ---- files inside a model folder (bundle/target, bundle/draft) --------------------------------
DECODER_FILE = "model.onnx"
ENCODER_FILE = "encoder_model.onnx"
SEQ2SEQ_DECODER_FILE = "decoder_model.onnx"  # no past: first decoder call, also emits cross-attention KV
SEQ2SEQ_DECODER_WITH_PAST_FILE = "decoder_with_past_model.onnx"
TOKENIZER_FILE = "tokenizer.json"
CONFIG_FILE = "config.json"

# Per kind: role of each graph -> file name (the manifest records this mapping).
GRAPH_FILES = {
    KIND_DECODER: {"decoder": DECODER_FILE},
    KIND_SEQ2SEQ: {
        "encoder": ENCODER_FILE,
        "decoder": SEQ2SEQ_DECODER_FILE,
        "decoder_with_past": SEQ2SEQ_DECODER_WITH_PAST_FILE,
    },
}

# ---- decoder-only graph -------------------------------------------------------------------------
INPUT_IDS = "input_ids"
ATTENTION_MASK = "attention_mask"  # [batch, past + new], all ones for one unpadded sequence
POSITION_IDS = "position_ids"  # optional (GPT-2, Llama have it; some architectures derive it)
LOGITS = "logits"  # [batch, new, vocab]

# How a decoder graph's KV inputs relate to its outputs (the manifest's ``kv_layout``):
# - concat: past [1, kv_heads, P, head] in, present = concat(past, new) [1, kv_heads, P + k, head]
#   out (optimum's graphs); the runtime ping-pongs two buffers.
# - static: past and present are the same [1, kv_heads, max_positions, head] buffer; the graph
#   writes the new tokens at positions [P, P + k) in place and reads P from attention_mask
#   (export/static_kv.py). Rollback needs no copy at all.
KV_CONCAT = "concat"
KV_STATIC = "static"
KV_LAYOUTS = (KV_CONCAT, KV_STATIC)


def decoder_past_names(num_layers: int) -> tuple[str, ...]:
    """past_key_values.{i}.key, past_key_values.{i}.value for every layer, in graph order."""
    return tuple(f"past_key_values.{i}.{kv}" for i in range(num_layers) for kv in ("key", "value"))


def decoder_present_names(num_layers: int) -> tuple[str, ...]:
    """present.{i}.key, present.{i}.value: the outputs matching ``decoder_past_names`` one to one."""
    return tuple(f"present.{i}.{kv}" for i in range(num_layers) for kv in ("key", "value"))


# ---- encoder-decoder graphs (T5) ----------------------------------------------------------------
ENCODER_INPUT_IDS = "input_ids"
ENCODER_ATTENTION_MASK = "attention_mask"
ENCODER_OUTPUT = "last_hidden_state"
DECODER_ENCODER_ATTENTION_MASK = "encoder_attention_mask"
DECODER_ENCODER_HIDDEN_STATES = "encoder_hidden_states"  # input of the first decoder call only
DECODER_INPUT_IDS = "input_ids"


def seq2seq_self_past_names(num_layers: int) -> tuple[str, ...]:
    """Decoder self-attention past: past_key_values.{i}.decoder.{key,value}."""
    return tuple(f"past_key_values.{i}.decoder.{kv}" for i in range(num_layers) for kv in ("key", "value"))


def seq2seq_self_present_names(num_layers: int) -> tuple[str, ...]:
    return tuple(f"present.{i}.decoder.{kv}" for i in range(num_layers) for kv in ("key", "value"))


def seq2seq_cross_past_names(num_layers: int) -> tuple[str, ...]:
    """Cross-attention KV (computed once from the encoder output): past_key_values.{i}.encoder.*."""
    return tuple(f"past_key_values.{i}.encoder.{kv}" for i in range(num_layers) for kv in ("key", "value"))


def seq2seq_cross_present_names(num_layers: int) -> tuple[str, ...]:
    return tuple(f"present.{i}.encoder.{kv}" for i in range(num_layers) for kv in ("key", "value"))
