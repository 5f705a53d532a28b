"""Lean JAX definitions of GPT-2, Llama and T5 over a flat params dict (the XLA reference path).

Pure ``jax.numpy`` functions; no flax and no Hugging Face Flax classes. The params dict is keyed by
the Hugging Face tensor names (``transformer.`` prefixes stripped for GPT-2; tied output layers
resolved), so the weights load straight from a checkpoint's ``model.safetensors``.

KV cache discipline (what XLA and TPUs want): static buffers, a pair ``(K, V)`` of arrays shaped
``[layers, 1, kv_heads, max_len, head_dim]``. A step writes ``k`` new entries at position ``pos``
with ``lax.dynamic_update_slice`` and attends with a causal mask derived from ``pos``, so entries at
or beyond the current length are ignored: rolling back is changing ``pos``, never copying data.

Every function here is shape-polymorphic only through Python (static) shapes; ``export/xla.py``
lowers one artifact per width. All matmuls use ``Precision.HIGHEST`` (TPUs would otherwise use
bf16 passes for float32 matmuls), computation is float32.

Callers must keep ``pos + k <= max_len``: ``dynamic_update_slice`` clamps an out-of-range start
index, which would silently overwrite the wrong entries. ``XlaBackend`` checks this.
"""
from __future__ import annotations

import json
import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from edgespec.errors import CheckpointError, InvalidArgumentError, UnsupportedArchitectureError

SUPPORTED_MODEL_TYPES = ("gpt2", "llama", "t5")


# --------------------------------------------------------------------------------------------
# Checkpoint reading (numpy only; no torch)
# --------------------------------------------------------------------------------------------

def read_config(checkpoint_dir: str | Path) -> dict[str, Any]:
    folder = Path(checkpoint_dir)
    path = folder / "config.json"
    if not folder.is_dir():
        raise CheckpointError(f"checkpoint folder {folder} does not exist; pass a Hugging Face model folder "
                              "(config.json + model.safetensors)")
    if not path.is_file():
        raise CheckpointError(f"{folder} has no config.json; save the model with save_pretrained() first")
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError) as exc:
        raise CheckpointError(f"{path} is not valid JSON ({exc}); re-save the model with save_pretrained()") from exc


def load_safetensors(checkpoint_dir: str | Path) -> dict[str, np.ndarray]:
    """All tensors of ``model.safetensors`` (or the shards of ``model.safetensors.index.json``)."""
    from safetensors.numpy import load_file

    folder = Path(checkpoint_dir)
    single = folder / "model.safetensors"
    index = folder / "model.safetensors.index.json"
    if single.is_file():
        files = [single]
    elif index.is_file():
        try:
            weight_map = json.loads(index.read_text())["weight_map"]
        except (OSError, ValueError, KeyError) as exc:
            raise CheckpointError(f"{index} is unreadable ({exc}); re-save the model with save_pretrained()") from exc
        names = sorted(set(weight_map.values()))
        for n in names:
            if "/" in n or "\\" in n or n.startswith("."):
                raise CheckpointError(f"{index} names a shard outside the folder ({n!r}); refusing to read it")
        files = [folder / n for n in names]
    else:
        pickles = [p.name for p in folder.glob("*.bin")] + [p.name for p in folder.glob("*.pt")]
        hint = (f" (found pickle-only weights {pickles}; re-save with save_pretrained(safe_serialization=True))"
                if pickles else "; save the model with save_pretrained(safe_serialization=True)")
        raise CheckpointError(f"{folder} has no model.safetensors{hint}")
    tensors: dict[str, np.ndarray] = {}
    for f in files:
        try:
            tensors.update(load_file(str(f)))
        except Exception as exc:  # safetensors raises its own error types
            raise CheckpointError(f"cannot read {f} ({exc}); re-save the model with save_pretrained()") from exc
    return tensors


# --------------------------------------------------------------------------------------------
# Model description
# --------------------------------------------------------------------------------------------

@dataclass(frozen=True)
class ModelSpec:
    """Everything static about one model (hashable; closed over by the traced functions)."""

    model_type: str
    encoder_decoder: bool
    vocab_size: int          # rows of the output layer (logits per position)
    d_model: int
    n_layers: int            # decoder layers (the ones with a self-attention KV cache)
    n_heads: int
    kv_heads: int
    head_dim: int
    eps: float
    act: str
    max_positions: int | None  # hard position limit (GPT-2 wpe, Llama max_position_embeddings), None for T5
    # Llama
    rope_inv_freq: tuple[float, ...] = ()
    attention_bias: bool = False
    mlp_bias: bool = False
    tied: bool = False
    # T5
    n_enc_layers: int = 0
    gated: bool = False
    rel_buckets: int = 32
    rel_max_distance: int = 128
    special_tokens: dict = field(default_factory=dict, compare=False, hash=False)


def _rope_inv_freq(cfg: dict) -> tuple[float, ...]:
    heads = cfg["num_attention_heads"]
    head_dim = cfg.get("head_dim") or cfg["hidden_size"] // heads
    dim = int(head_dim * cfg.get("partial_rotary_factor", 1.0))
    if dim != head_dim:
        raise UnsupportedArchitectureError("partial rotary embeddings are not supported by the XLA path")
    base = float(cfg.get("rope_theta", 10000.0))
    inv = (1.0 / (np.float32(base) ** (np.arange(0, dim, 2, dtype=np.int64).astype(np.float32) / np.float32(dim))))
    inv = inv.astype(np.float32)
    scaling = cfg.get("rope_scaling") or {}
    kind = scaling.get("rope_type", scaling.get("type", "default")) if scaling else "default"
    if kind == "default":
        pass
    elif kind == "linear":
        inv = (inv / np.float32(scaling["factor"])).astype(np.float32)
    elif kind == "llama3":
        factor = scaling["factor"]
        low, high = scaling["low_freq_factor"], scaling["high_freq_factor"]
        old = scaling["original_max_position_embeddings"]
        low_wl, high_wl = old / low, old / high
        wavelen = 2 * math.pi / inv
        inv_l = np.where(wavelen > low_wl, inv / factor, inv)
        smooth = (old / wavelen - low) / (high - low)
        smoothed = (1 - smooth) * inv_l / factor + smooth * inv_l
        medium = ~(wavelen < high_wl) & ~(wavelen > low_wl)
        inv = np.where(medium, smoothed, inv_l).astype(np.float32)
    else:
        raise UnsupportedArchitectureError(
            f"rope_scaling type {kind!r} is not supported by the XLA path (supported: default, linear, llama3)")
    return tuple(float(x) for x in inv)


def spec_from_config(cfg: dict[str, Any]) -> ModelSpec:
    mt = cfg.get("model_type")
    specials = {k: cfg.get(k) for k in ("bos_token_id", "eos_token_id", "pad_token_id", "decoder_start_token_id")}
    if mt == "gpt2":
        if cfg.get("scale_attn_by_inverse_layer_idx") or cfg.get("reorder_and_upcast_attn") \
                or cfg.get("scale_attn_weights") is False:
            raise UnsupportedArchitectureError(
                "GPT-2 with scale_attn_by_inverse_layer_idx, reorder_and_upcast_attn or scale_attn_weights=false is not "
                "supported by the XLA path (transformers' attention implementations disagree on the last); export "
                "it to ONNX only")
        d, h = cfg["n_embd"], cfg["n_head"]
        return ModelSpec(
            model_type="gpt2", encoder_decoder=False, vocab_size=cfg["vocab_size"], d_model=d,
            n_layers=cfg["n_layer"], n_heads=h, kv_heads=h, head_dim=d // h, eps=cfg.get("layer_norm_epsilon", 1e-5),
            act=cfg.get("activation_function", "gelu_new"), max_positions=cfg.get("n_positions", 1024),
            tied=bool(cfg.get("tie_word_embeddings", True)), special_tokens=specials)
    if mt == "llama":
        h = cfg["num_attention_heads"]
        return ModelSpec(
            model_type="llama", encoder_decoder=False, vocab_size=cfg["vocab_size"], d_model=cfg["hidden_size"],
            n_layers=cfg["num_hidden_layers"], n_heads=h, kv_heads=cfg.get("num_key_value_heads") or h,
            head_dim=cfg.get("head_dim") or cfg["hidden_size"] // h, eps=cfg.get("rms_norm_eps", 1e-6),
            act=cfg.get("hidden_act", "silu"), max_positions=cfg.get("max_position_embeddings", 2048),
            rope_inv_freq=_rope_inv_freq(cfg), attention_bias=bool(cfg.get("attention_bias", False)),
            mlp_bias=bool(cfg.get("mlp_bias", False)), tied=bool(cfg.get("tie_word_embeddings", False)),
            special_tokens=specials)
    if mt == "t5":
        proj = cfg.get("feed_forward_proj", "relu")
        parts = proj.split("-")
        gated = parts[0] == "gated"
        act = "gelu_new" if proj == "gated-gelu" else parts[-1]
        if len(parts) > 2 or (len(parts) == 2 and not gated):
            raise UnsupportedArchitectureError(f"T5 feed_forward_proj {proj!r} is not supported by the XLA path")
        n_layers = cfg.get("num_decoder_layers") or cfg["num_layers"]
        return ModelSpec(
            model_type="t5", encoder_decoder=True, vocab_size=cfg["vocab_size"], d_model=cfg["d_model"],
            n_layers=n_layers, n_heads=cfg["num_heads"], kv_heads=cfg["num_heads"], head_dim=cfg["d_kv"],
            eps=cfg.get("layer_norm_epsilon", 1e-6), act=act, max_positions=None,
            tied=bool(cfg.get("tie_word_embeddings", True)), n_enc_layers=cfg["num_layers"], gated=gated,
            rel_buckets=cfg.get("relative_attention_num_buckets", 32),
            rel_max_distance=cfg.get("relative_attention_max_distance", 128), special_tokens=specials)
    raise UnsupportedArchitectureError(
        f"model_type {mt!r} is not supported by the XLA path (supported: {', '.join(SUPPORTED_MODEL_TYPES)}); "
        "export it to ONNX instead")


def param_names(spec: ModelSpec) -> list[str]:
    """The tensors the JAX functions read, by (normalized) Hugging Face name."""
    n: list[str] = []
    if spec.model_type == "gpt2":
        n += ["wte.weight", "wpe.weight", "ln_f.weight", "ln_f.bias"] + ([] if spec.tied else ["lm_head.weight"])
        for i in range(spec.n_layers):
            p = f"h.{i}."
            for m in ("ln_1", "ln_2", "attn.c_attn", "attn.c_proj", "mlp.c_fc", "mlp.c_proj"):
                n += [p + m + ".weight", p + m + ".bias"]
    elif spec.model_type == "llama":
        n += ["model.embed_tokens.weight", "model.norm.weight", "lm_head.weight"]
        for i in range(spec.n_layers):
            p = f"model.layers.{i}."
            n += [p + "input_layernorm.weight", p + "post_attention_layernorm.weight"]
            for m in ("q_proj", "k_proj", "v_proj", "o_proj"):
                n.append(p + f"self_attn.{m}.weight")
                if spec.attention_bias:
                    n.append(p + f"self_attn.{m}.bias")
            for m in ("gate_proj", "up_proj", "down_proj"):
                n.append(p + f"mlp.{m}.weight")
                if spec.mlp_bias:
                    n.append(p + f"mlp.{m}.bias")
    else:  # t5
        n += ["shared.weight", "encoder.final_layer_norm.weight", "decoder.final_layer_norm.weight",
              "encoder.block.0.layer.0.SelfAttention.relative_attention_bias.weight",
              "decoder.block.0.layer.0.SelfAttention.relative_attention_bias.weight"]
        if not spec.tied:
            n.append("lm_head.weight")
        ff = ["wi_0", "wi_1", "wo"] if spec.gated else ["wi", "wo"]
        for i in range(spec.n_enc_layers):
            p = f"encoder.block.{i}.layer."
            n += [p + f"0.SelfAttention.{m}.weight" for m in "qkvo"]
            n += [p + "0.layer_norm.weight", p + "1.layer_norm.weight"]
            n += [p + f"1.DenseReluDense.{m}.weight" for m in ff]
        for i in range(spec.n_layers):
            p = f"decoder.block.{i}.layer."
            n += [p + f"0.SelfAttention.{m}.weight" for m in "qkvo"]
            n += [p + f"1.EncDecAttention.{m}.weight" for m in "qkvo"]
            n += [p + "0.layer_norm.weight", p + "1.layer_norm.weight", p + "2.layer_norm.weight"]
            n += [p + f"2.DenseReluDense.{m}.weight" for m in ff]
    return n


def select_params(spec: ModelSpec, tensors: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    """Pick (and normalize names of) the tensors the model needs, as float32 numpy arrays."""
    t = dict(tensors)
    if spec.model_type == "gpt2":
        t = {(k[len("transformer."):] if k.startswith("transformer.") else k): v for k, v in t.items()}
    if spec.model_type == "gpt2" and not spec.tied and "lm_head.weight" not in t:
        raise CheckpointError("the checkpoint has no lm_head.weight but tie_word_embeddings is false; "
                              "re-save the model with save_pretrained()")
    if spec.model_type == "llama" and "lm_head.weight" not in t and "model.embed_tokens.weight" in t:
        if not spec.tied:
            raise CheckpointError("the checkpoint has no lm_head.weight but tie_word_embeddings is false; "
                                  "re-save the model with save_pretrained()")
        t["lm_head.weight"] = t["model.embed_tokens.weight"]
    out: dict[str, np.ndarray] = {}
    missing = []
    for name in param_names(spec):
        if name not in t:
            missing.append(name)
            continue
        out[name] = np.ascontiguousarray(np.asarray(t[name]).astype(np.float32))
    if missing:
        raise CheckpointError(f"the checkpoint lacks {len(missing)} tensors the {spec.model_type} definition needs "
                              f"(first: {missing[:3]}); re-save it with save_pretrained(safe_serialization=True)")
    return out


def output_vocab(spec: ModelSpec, params: dict[str, Any]) -> int:
    key = {"gpt2": "wte.weight" if spec.tied else "lm_head.weight", "llama": "lm_head.weight"}.get(spec.model_type)
    if key is None:
        key = "shared.weight" if spec.tied else "lm_head.weight"
    return int(params[key].shape[0])


# --------------------------------------------------------------------------------------------
# Building blocks
# --------------------------------------------------------------------------------------------

def _jnp():
    import jax.numpy as jnp
    return jnp


def _mm(a, b):
    from jax import lax
    return _jnp().matmul(a, b, precision=lax.Precision.HIGHEST)


def _einsum(expr, a, b):
    from jax import lax
    return _jnp().einsum(expr, a, b, precision=lax.Precision.HIGHEST)


def _act(name: str):
    import jax
    jnp = _jnp()
    if name in ("gelu_new", "gelu_pytorch_tanh"):
        return lambda x: jax.nn.gelu(x, approximate=True)
    if name == "gelu":
        return lambda x: jax.nn.gelu(x, approximate=False)
    if name == "relu":
        return jax.nn.relu
    if name in ("silu", "swish"):
        return jax.nn.silu
    if name == "quick_gelu":
        return lambda x: x * jax.nn.sigmoid(1.702 * x)
    if name == "tanh":
        return jnp.tanh
    raise UnsupportedArchitectureError(f"activation {name!r} is not supported by the XLA path")


def _layer_norm(x, w, b, eps):
    jnp = _jnp()
    mu = x.mean(-1, keepdims=True)
    var = ((x - mu) ** 2).mean(-1, keepdims=True)
    return (x - mu) / jnp.sqrt(var + eps) * w + b


def _rms_norm(x, w, eps):
    jnp = _jnp()
    return w * (x * (1.0 / jnp.sqrt((x * x).mean(-1, keepdims=True) + eps)))


_NEG = -3.0e38  # a large finite negative (masked scores; avoids NaN when a row were fully masked)


def _attend(q, K, V, mask, scale, bias=None):
    """q [H, k, dh]; K, V [Hkv, M, dh]; mask [k, M] bool (True = attend); bias [H, k, M] or None."""
    import jax
    jnp = _jnp()
    H, k, dh = q.shape
    Hkv = K.shape[0]
    g = H // Hkv
    qg = q.reshape(Hkv, g, k, dh)
    s = _einsum("hgqd,hmd->hgqm", qg, K)
    if scale != 1.0:
        s = s * scale
    if bias is not None:
        s = s + bias.reshape(Hkv, g, k, -1)
    s = jnp.where(mask[None, None], s, _NEG)
    p = jax.nn.softmax(s, axis=-1)
    o = _einsum("hgqm,hmd->hgqd", p, V)
    return o.reshape(H, k, dh)


def _write(buf, layer: int, new, pos):
    """buf [L, 1, Hkv, M, dh]; new [Hkv, k, dh] -> write at [layer, 0, :, pos:pos+k, :]."""
    from jax import lax
    jnp = _jnp()
    z = jnp.int32(0)
    return lax.dynamic_update_slice(buf, new[None, None].astype(buf.dtype), (jnp.int32(layer), z, z, pos, z))


def _heads(x, n, dh):
    """[k, n*dh] -> [n, k, dh]"""
    return x.reshape(x.shape[0], n, dh).transpose(1, 0, 2)


def _merge(x):
    """[n, k, dh] -> [k, n*dh]"""
    n, k, dh = x.shape
    return x.transpose(1, 0, 2).reshape(k, n * dh)


def init_kv(spec: ModelSpec, max_len: int):
    jnp = _jnp()
    shape = (spec.n_layers, 1, spec.kv_heads, max_len, spec.head_dim)
    return (jnp.zeros(shape, jnp.float32), jnp.zeros(shape, jnp.float32))


def kv_shape(spec: ModelSpec, max_len: int) -> tuple[int, ...]:
    return (spec.n_layers, 1, spec.kv_heads, max_len, spec.head_dim)


# --------------------------------------------------------------------------------------------
# GPT-2
# --------------------------------------------------------------------------------------------

def gpt2_step(spec: ModelSpec, p, kv, ids, pos):
    jnp = _jnp()
    K, V = kv
    k = ids.shape[0]
    M = K.shape[3]
    H, dh = spec.n_heads, spec.head_dim
    act = _act(spec.act)
    positions = pos + jnp.arange(k, dtype=jnp.int32)
    x = p["wte.weight"][ids] + p["wpe.weight"][positions]
    mask = jnp.arange(M, dtype=jnp.int32)[None, :] <= positions[:, None]
    scale = 1.0 / math.sqrt(dh)
    for i in range(spec.n_layers):
        pre = f"h.{i}."
        h = _layer_norm(x, p[pre + "ln_1.weight"], p[pre + "ln_1.bias"], spec.eps)
        qkv = _mm(h, p[pre + "attn.c_attn.weight"]) + p[pre + "attn.c_attn.bias"]
        q, kk, vv = (_heads(t, H, dh) for t in jnp.split(qkv, 3, axis=-1))
        K = _write(K, i, kk, pos)
        V = _write(V, i, vv, pos)
        a = _merge(_attend(q, K[i, 0], V[i, 0], mask, scale))
        x = x + _mm(a, p[pre + "attn.c_proj.weight"]) + p[pre + "attn.c_proj.bias"]
        h = _layer_norm(x, p[pre + "ln_2.weight"], p[pre + "ln_2.bias"], spec.eps)
        h = act(_mm(h, p[pre + "mlp.c_fc.weight"]) + p[pre + "mlp.c_fc.bias"])
        x = x + _mm(h, p[pre + "mlp.c_proj.weight"]) + p[pre + "mlp.c_proj.bias"]
    x = _layer_norm(x, p["ln_f.weight"], p["ln_f.bias"], spec.eps)
    return _mm(x, (p["wte.weight"] if spec.tied else p["lm_head.weight"]).T), (K, V)


# --------------------------------------------------------------------------------------------
# Llama (grouped-query attention, RoPE, RMSNorm)
# --------------------------------------------------------------------------------------------

def _linear(x, p, name, bias: bool):
    y = _mm(x, p[name + ".weight"].T)
    return y + p[name + ".bias"] if bias else y


def _rotate_half(x):
    jnp = _jnp()
    h = x.shape[-1] // 2
    return jnp.concatenate([-x[..., h:], x[..., :h]], axis=-1)


def llama_step(spec: ModelSpec, p, kv, ids, pos):
    jnp = _jnp()
    K, V = kv
    k = ids.shape[0]
    M = K.shape[3]
    H, Hkv, dh = spec.n_heads, spec.kv_heads, spec.head_dim
    act = _act(spec.act)
    positions = pos + jnp.arange(k, dtype=jnp.int32)
    inv = jnp.asarray(np.asarray(spec.rope_inv_freq, np.float32))
    freqs = positions.astype(jnp.float32)[:, None] * inv[None, :]
    emb = jnp.concatenate([freqs, freqs], axis=-1)  # [k, dh]
    cos, sin = jnp.cos(emb)[None], jnp.sin(emb)[None]
    x = p["model.embed_tokens.weight"][ids]
    mask = jnp.arange(M, dtype=jnp.int32)[None, :] <= positions[:, None]
    scale = 1.0 / math.sqrt(dh)
    for i in range(spec.n_layers):
        pre = f"model.layers.{i}."
        h = _rms_norm(x, p[pre + "input_layernorm.weight"], spec.eps)
        q = _heads(_linear(h, p, pre + "self_attn.q_proj", spec.attention_bias), H, dh)
        kk = _heads(_linear(h, p, pre + "self_attn.k_proj", spec.attention_bias), Hkv, dh)
        vv = _heads(_linear(h, p, pre + "self_attn.v_proj", spec.attention_bias), Hkv, dh)
        q = q * cos + _rotate_half(q) * sin
        kk = kk * cos + _rotate_half(kk) * sin
        K = _write(K, i, kk, pos)
        V = _write(V, i, vv, pos)
        a = _merge(_attend(q, K[i, 0], V[i, 0], mask, scale))
        x = x + _linear(a, p, pre + "self_attn.o_proj", spec.attention_bias)
        h = _rms_norm(x, p[pre + "post_attention_layernorm.weight"], spec.eps)
        g = act(_linear(h, p, pre + "mlp.gate_proj", spec.mlp_bias)) * _linear(h, p, pre + "mlp.up_proj", spec.mlp_bias)
        x = x + _linear(g, p, pre + "mlp.down_proj", spec.mlp_bias)
    x = _rms_norm(x, p["model.norm.weight"], spec.eps)
    return _mm(x, p["lm_head.weight"].T), (K, V)


# --------------------------------------------------------------------------------------------
# T5 (encoder-decoder; relative position buckets; no attention scaling)
# --------------------------------------------------------------------------------------------

def _t5_bucket(rel, bidirectional: bool, num_buckets: int, max_distance: int):
    """Hugging Face's T5Attention._relative_position_bucket in jax.numpy (rel = key - query)."""
    jnp = _jnp()
    buckets = jnp.zeros_like(rel)
    if bidirectional:
        num_buckets //= 2
        buckets = buckets + (rel > 0).astype(rel.dtype) * num_buckets
        rel = jnp.abs(rel)
    else:
        rel = -jnp.minimum(rel, 0)
    max_exact = num_buckets // 2
    is_small = rel < max_exact
    safe = jnp.maximum(rel, 1).astype(jnp.float32)
    large = max_exact + (jnp.log(safe / max_exact) / math.log(max_distance / max_exact)
                         * (num_buckets - max_exact)).astype(rel.dtype)
    large = jnp.minimum(large, num_buckets - 1)
    return buckets + jnp.where(is_small, rel, large)


def _t5_bias(spec: ModelSpec, table, rel, bidirectional: bool):
    """table [buckets, H]; rel [q, m] int -> bias [H, q, m]."""
    b = _t5_bucket(rel, bidirectional, spec.rel_buckets, spec.rel_max_distance)
    return table[b].transpose(2, 0, 1)


def _t5_ff(spec: ModelSpec, p, pre, h):
    act = _act(spec.act)
    if spec.gated:
        g = act(_mm(h, p[pre + "wi_0.weight"].T)) * _mm(h, p[pre + "wi_1.weight"].T)
    else:
        g = act(_mm(h, p[pre + "wi.weight"].T))
    return _mm(g, p[pre + "wo.weight"].T)


def t5_encode(spec: ModelSpec, max_len: int, p, ids, n, out_len: int | None = None):
    """ids [E] int32 (padded), n = real length -> (cross (K, V) [L, 1, H, out_len, dh], fresh self KV [L, 1, H, M, dh]).
    ``out_len`` (default E): the cross KV is zero-padded to it, so that one decoder step artifact serves
    encoder buckets of every size (the step masks encoder positions >= n)."""
    jnp = _jnp()
    E = ids.shape[0]
    H, dh = spec.n_heads, spec.head_dim
    x = p["shared.weight"][ids]
    pos = jnp.arange(E, dtype=jnp.int32)
    bias = _t5_bias(spec, p["encoder.block.0.layer.0.SelfAttention.relative_attention_bias.weight"],
                    pos[None, :] - pos[:, None], True)
    mask = jnp.broadcast_to((pos < n)[None, :], (E, E))
    for i in range(spec.n_enc_layers):
        pre = f"encoder.block.{i}.layer."
        h = _rms_norm(x, p[pre + "0.layer_norm.weight"], spec.eps)
        q, kk, vv = (_heads(_mm(h, p[pre + f"0.SelfAttention.{m}.weight"].T), H, dh) for m in "qkv")
        a = _merge(_attend(q, kk, vv, mask, 1.0, bias))
        x = x + _mm(a, p[pre + "0.SelfAttention.o.weight"].T)
        h = _rms_norm(x, p[pre + "1.layer_norm.weight"], spec.eps)
        x = x + _t5_ff(spec, p, pre + "1.DenseReluDense.", h)
    x = _rms_norm(x, p["encoder.final_layer_norm.weight"], spec.eps)
    ck, cv = [], []
    for i in range(spec.n_layers):
        pre = f"decoder.block.{i}.layer.1.EncDecAttention."
        ck.append(_heads(_mm(x, p[pre + "k.weight"].T), H, dh))
        cv.append(_heads(_mm(x, p[pre + "v.weight"].T), H, dh))
    pad = ((0, 0), (0, 0), (0, 0), (0, (out_len or E) - E), (0, 0))
    cross = (jnp.pad(jnp.stack(ck)[:, None], pad), jnp.pad(jnp.stack(cv)[:, None], pad))
    return cross, init_kv(spec, max_len)


def t5_step(spec: ModelSpec, p, kv, cross, enc_len, ids, pos):
    """Decoder step: ids [k] at positions pos..pos+k-1 -> (logits [k, V], kv')."""
    jnp = _jnp()
    K, V = kv
    CK, CV = cross
    k = ids.shape[0]
    M = K.shape[3]
    E = CK.shape[3]
    H, dh = spec.n_heads, spec.head_dim
    positions = pos + jnp.arange(k, dtype=jnp.int32)
    keys = jnp.arange(M, dtype=jnp.int32)
    bias = _t5_bias(spec, p["decoder.block.0.layer.0.SelfAttention.relative_attention_bias.weight"],
                    keys[None, :] - positions[:, None], False)
    mask = keys[None, :] <= positions[:, None]
    cmask = jnp.broadcast_to((jnp.arange(E, dtype=jnp.int32) < enc_len)[None, :], (k, E))
    x = p["shared.weight"][ids]
    for i in range(spec.n_layers):
        pre = f"decoder.block.{i}.layer."
        h = _rms_norm(x, p[pre + "0.layer_norm.weight"], spec.eps)
        q, kk, vv = (_heads(_mm(h, p[pre + f"0.SelfAttention.{m}.weight"].T), H, dh) for m in "qkv")
        K = _write(K, i, kk, pos)
        V = _write(V, i, vv, pos)
        a = _merge(_attend(q, K[i, 0], V[i, 0], mask, 1.0, bias))
        x = x + _mm(a, p[pre + "0.SelfAttention.o.weight"].T)
        h = _rms_norm(x, p[pre + "1.layer_norm.weight"], spec.eps)
        q = _heads(_mm(h, p[pre + "1.EncDecAttention.q.weight"].T), H, dh)
        a = _merge(_attend(q, CK[i, 0], CV[i, 0], cmask, 1.0))
        x = x + _mm(a, p[pre + "1.EncDecAttention.o.weight"].T)
        h = _rms_norm(x, p[pre + "2.layer_norm.weight"], spec.eps)
        x = x + _t5_ff(spec, p, pre + "2.DenseReluDense.", h)
    x = _rms_norm(x, p["decoder.final_layer_norm.weight"], spec.eps)
    if spec.tied:
        logits = _mm(x * (spec.d_model ** -0.5), p["shared.weight"].T)
    else:
        logits = _mm(x, p["lm_head.weight"].T)
    return logits, (K, V)


# --------------------------------------------------------------------------------------------
# Entry points used by the exporter (and by tests directly)
# --------------------------------------------------------------------------------------------

def decoder_step(spec: ModelSpec, p, kv, ids, pos):
    """Decoder-only models: write ``ids`` at ``pos``; return (logits [k, V] float32, kv')."""
    if spec.model_type == "gpt2":
        return gpt2_step(spec, p, kv, ids, pos)
    if spec.model_type == "llama":
        return llama_step(spec, p, kv, ids, pos)
    raise UnsupportedArchitectureError(f"{spec.model_type} is not a decoder-only model")


def decoder_prefill(spec: ModelSpec, max_len: int, p, ids, n):
    """Fresh buffers, ``ids`` [P] (padded; first ``n`` real) at position 0 -> (logits [V] of token n-1, kv)."""
    jnp = _jnp()
    logits, kv = decoder_step(spec, p, init_kv(spec, max_len), ids, jnp.int32(0))
    return logits[n - 1], kv


def load_model(checkpoint_dir: str | Path) -> tuple[ModelSpec, dict[str, np.ndarray]]:
    """Read a Hugging Face checkpoint folder: (spec, float32 numpy params)."""
    cfg = read_config(checkpoint_dir)
    spec = spec_from_config(cfg)
    return spec, select_params(spec, load_safetensors(checkpoint_dir))


def check_max_length(spec: ModelSpec, max_length: int) -> None:
    if isinstance(max_length, bool) or not isinstance(max_length, int) or max_length < 2:
        raise InvalidArgumentError(f"max_length must be an integer >= 2; got {max_length!r}")
    if spec.max_positions is not None and max_length > spec.max_positions:
        raise InvalidArgumentError(
            f"max_length={max_length} exceeds the model's {spec.max_positions} positions; "
            f"pass --max-length {spec.max_positions} or less")
