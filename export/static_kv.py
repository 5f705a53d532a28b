"""Decoder graphs with an in-place ("static") KV cache, ``contract.KV_STATIC``: Llama and GPT-2.

Why not optimum's graph: it returns present = concat(past, new), so the cache moves through a new
buffer every call, and after a rejected draft the runtime must compact the kept prefix (a copy)
before the next call. Here each layer's attention is one GroupQueryAttention node (an ONNX Runtime
contrib op) whose past and present are bound to the SAME [1, kv_heads, max_positions, head]
buffer: a call writes the k new tokens' keys/values at positions [P, P + k) and attends over
[0, P + k). Rolling back after a rejection is then only a shorter attention mask on the next call
(O(1), nothing copied; the stale tail is overwritten by the next tokens), which is what the
speculative loop needs after every round that rejects a draft.

The rest of the graph is written directly too (as onnxruntime-genai's model builder does rather
than traced): packed QKV (and gate/up) MatMuls, rotary embedding inside the attention op, RMSNorm
as SimplifiedLayerNormalization (GPT-2: LayerNormalization), with the residual Adds fused into
it (SkipSimplifiedLayerNormalization, SkipLayerNormalization). It has a fraction of the nodes of
the traced graph, which matters for small models, where per-node overhead is a large part of a step.

Inputs and outputs follow the contract: ``input_ids`` [1, k], ``attention_mask`` [1, P + k]
(all ones; the graph derives the attention op's seqlens_k = P + k - 1 and total length from it,
and GPT-2's positions P..P+k-1), ``past_key_values.{i}.key|value`` -> ``present.{i}.key|value``
[1, kv_heads, max_positions, head], ``logits`` [1, k, vocab]. The exporter validates the graph
against PyTorch like every export.
"""
from __future__ import annotations

from pathlib import Path

import numpy as np

from edgespec import contract

from .external_data import DataFile

OPSET = 17
DATA_SUFFIX = ".data"  # weights live in <graph>.data next to the graph (external data, same folder)
GQA_HEAD_MULTIPLE = 16  # ONNX Runtime's CPU GroupQueryAttention kernel requires it


def unsupported_reason(model_type: str, config: dict) -> str | None:
    """Why this checkpoint cannot get a static-KV graph (None if it can)."""
    if model_type == "llama":
        if config.get("hidden_act", "silu") != "silu":
            return f"hidden_act {config.get('hidden_act')!r} (needs silu)"
        for key in ("attention_bias", "mlp_bias"):
            if config.get(key):
                return f"{key}=true (needs bias-free projections)"
        if config.get("rope_scaling"):
            return f"rope_scaling {config.get('rope_scaling')!r} (needs plain rotary embeddings)"
        heads, hidden = config.get("num_attention_heads"), config.get("hidden_size")
        head = config.get("head_dim") or (hidden // heads if isinstance(hidden, int) and isinstance(heads, int) and heads else 0)
    elif model_type == "gpt2":
        if config.get("activation_function", "gelu_new") not in ("gelu_new", "gelu_pytorch_tanh"):
            return f"activation_function {config.get('activation_function')!r} (needs gelu_new)"
        for key in ("scale_attn_by_inverse_layer_idx", "reorder_and_upcast_attn", "add_cross_attention"):
            if config.get(key):
                return f"{key}=true"
        if config.get("scale_attn_weights") is False:
            return "scale_attn_weights=false"
        heads, hidden = config.get("n_head"), config.get("n_embd")
        head = hidden // heads if isinstance(hidden, int) and isinstance(heads, int) and heads else 0
    else:
        return f"model_type {model_type!r} (static-KV graphs are built for llama and gpt2)"
    if not head:
        return "config.json lacks the attention head count / hidden size"
    if head % GQA_HEAD_MULTIPLE:
        return f"head size {head} (ONNX Runtime's GroupQueryAttention needs a multiple of {GQA_HEAD_MULTIPLE})"
    return None


class _Graph:
    """Nodes, initializers and IO of the graph being written."""

    def __init__(self, state: dict[str, np.ndarray], data: DataFile):
        from onnx import TensorProto, helper

        self.oh, self.tp = helper, TensorProto
        self.state, self.data = state, data
        self.nodes, self.inits = [], []
        self.inputs = [helper.make_tensor_value_info(contract.INPUT_IDS, TensorProto.INT64, [1, "new"]),
                       helper.make_tensor_value_info(contract.ATTENTION_MASK, TensorProto.INT64, [1, "total"])]
        self.outputs = []

    def weight(self, name: str, arr: np.ndarray, dtype=np.float32) -> str:
        self.inits.append(self.data.tensor(name, np.asarray(arr, dtype=dtype)))  # large ones: written now
        return name

    def op(self, op_type: str, inputs: list[str], outputs: list[str], domain: str = "", **attrs):
        self.nodes.append(self.oh.make_node(op_type, inputs, outputs, domain=domain, **attrs))
        return outputs[0] if len(outputs) == 1 else outputs

    def linear(self, x: str, name: str, w: np.ndarray, b: np.ndarray | None = None) -> str:
        """x @ w (+ b); w is [in, out]."""
        y = self.op("MatMul", [x, self.weight(name + ".w", w)], [name + ".mm"])
        return y if b is None else self.op("Add", [y, self.weight(name + ".b", b)], [name])

    def lengths(self) -> None:
        """seqlens_k [1] = P + k - 1 and total_len [] = P + k (int32) from the all-ones mask [1, P + k]."""
        self.weight("axis0", np.array([0]), np.int64)
        self.weight("axis1", np.array([1]), np.int64)
        self.weight("one", np.array(1), np.int64)
        mask_sum = self.op("ReduceSum", [contract.ATTENTION_MASK, "axis1"], ["mask_sum"], keepdims=0)  # [1]
        self.op("Cast", [self.op("Sub", [mask_sum, "one"], ["last_index"])], ["seqlens_k"], to=self.tp.INT32)
        self.op("Cast", [self.seq_len(contract.ATTENTION_MASK, "total_len64")], ["total_len"], to=self.tp.INT32)

    def seq_len(self, tensor: str, name: str) -> str:
        """Axis 1 of a [1, n] input as an int64 scalar ``name`` and 1-D ``name.1d`` (Shape with start/end, then Squeeze: a Gather
        on a Shape output is rewritten by ONNX Runtime's optimizer into a Slice it then rejects)."""
        dim = self.op("Shape", [tensor], [name + ".1d"], start=1, end=2)                                # [1]
        return self.op("Squeeze", [dim, "axis0"], [name])                                                # []

    def attention(self, i: int, qkv: str, heads: int, kv_heads: int, head: int, rotary: bool) -> str:
        """One layer's GroupQueryAttention over packed QKV, past and present sharing the buffer."""
        past, present = contract.decoder_past_names(i + 1)[-2:], contract.decoder_present_names(i + 1)[-2:]
        kv_shape = [1, kv_heads, "max_positions", head]
        self.inputs += [self.oh.make_tensor_value_info(n, self.tp.FLOAT, kv_shape) for n in past]
        self.outputs += [self.oh.make_tensor_value_info(n, self.tp.FLOAT, kv_shape) for n in present]
        # key/value inputs empty: qkv is packed [1, k, (heads + 2 kv_heads) * head]. With rotary, the
        # op rotates q and k at positions seqlens_k + 1 - k + j (the tables are cos_cache / sin_cache).
        tables = ["cos_cache", "sin_cache"] if rotary else []
        return self.op("GroupQueryAttention", [qkv, "", "", *past, "seqlens_k", "total_len", *tables],
                       [f"l{i}.attn", *present], domain="com.microsoft",
                       num_heads=heads, kv_num_heads=kv_heads, do_rotary=int(rotary), rotary_interleaved=0)[0]

    def save(self, out_path: Path, vocab: int) -> int:
        import onnx

        self.outputs.insert(0, self.oh.make_tensor_value_info(contract.LOGITS, self.tp.FLOAT, [1, "new", vocab]))
        graph = self.oh.make_graph(self.nodes, "edgespec_static_kv", self.inputs, self.outputs, self.inits)
        model = self.oh.make_model(graph, opset_imports=[self.oh.make_opsetid("", OPSET), self.oh.make_opsetid("com.microsoft", 1)],
                                   producer_name="edgespec")
        model.ir_version = 8
        onnx.save(model, str(out_path))  # the weights are in the data file already
        return OPSET


def _llama(g: _Graph, config: dict, max_positions: int) -> int:
    s = g.state
    layers, hidden, heads = config["num_hidden_layers"], config["hidden_size"], config["num_attention_heads"]
    kv_heads = config.get("num_key_value_heads") or heads
    head = config.get("head_dim") or hidden // heads
    eps, theta = float(config.get("rms_norm_eps", 1e-6)), float(config.get("rope_theta", 10000.0))

    def rms_norm(x: str, w: np.ndarray, name: str) -> str:
        return g.op("SimplifiedLayerNormalization", [x, g.weight(name + ".w", w)], [name], axis=-1, epsilon=eps, stash_type=1)

    def add_rms_norm(x: str, residual: str, w: np.ndarray, name: str) -> tuple[str, str]:
        """(RMSNorm(residual + x), residual + x) in one node: the residual Add is fused in."""
        out = g.op("SkipSimplifiedLayerNormalization", [x, residual, g.weight(name + ".w", w)],
                   [name, "", "", name + ".sum"], domain="com.microsoft", epsilon=eps)
        return out[0], out[3]

    # Rotary tables [max_positions, head / 2], HF Llama's non-interleaved halves.
    angles = np.arange(max_positions, dtype=np.float64)[:, None] / theta ** (np.arange(0, head, 2) / head)[None, :]
    g.weight("cos_cache", np.cos(angles))
    g.weight("sin_cache", np.sin(angles))
    x = g.op("Gather", [g.weight("embed_tokens", s["model.embed_tokens.weight"]), contract.INPUT_IDS], ["h0"])
    # x is the residual stream; h its normalised copy that feeds the next block. Each residual Add
    # is fused into the norm that follows it (the last one into the final norm): per-node overhead
    # is a large part of a small model's step.
    h = rms_norm(x, s["model.layers.0.input_layernorm.weight"], "l0.ln1")
    for i in range(layers):
        p = f"model.layers.{i}."
        qkv = np.concatenate([s[p + f"self_attn.{m}_proj.weight"] for m in "qkv"], axis=0).T  # [hidden, (H + 2 Hkv) d]
        attn = g.attention(i, g.linear(h, f"l{i}.qkv", qkv), heads, kv_heads, head, rotary=True)
        h, x = add_rms_norm(g.linear(attn, f"l{i}.o", s[p + "self_attn.o_proj.weight"].T), x,
                            s[p + "post_attention_layernorm.weight"], f"l{i}.ln2")
        inter = s[p + "mlp.gate_proj.weight"].shape[0]
        gate_up = np.concatenate([s[p + "mlp.gate_proj.weight"], s[p + "mlp.up_proj.weight"]], axis=0).T
        gu = g.linear(h, f"l{i}.gate_up", gate_up)
        gate, up = g.op("Split", [gu, g.weight(f"l{i}.split", np.array([inter, inter]), np.int64)],
                        [f"l{i}.gate", f"l{i}.up"], axis=-1)
        silu = g.op("Mul", [gate, g.op("Sigmoid", [gate], [f"l{i}.sig"])], [f"l{i}.silu"])
        act = g.op("Mul", [silu, up], [f"l{i}.act"])
        last = i + 1 == layers
        norm_w, norm_name = (s["model.norm.weight"], "final_norm") if last else (s[f"model.layers.{i + 1}.input_layernorm.weight"], f"l{i + 1}.ln1")
        h, x = add_rms_norm(g.linear(act, f"l{i}.down", s[p + "mlp.down_proj.weight"].T), x, norm_w, norm_name)
    g.op("MatMul", [h, g.weight("lm_head", s["lm_head.weight"].T)], [contract.LOGITS])
    return int(s["lm_head.weight"].shape[0])


def _gpt2(g: _Graph, config: dict, max_positions: int) -> int:
    s = g.state
    layers, hidden, heads = config["n_layer"], config["n_embd"], config["n_head"]
    eps = float(config.get("layer_norm_epsilon", 1e-5))

    def layer_norm(x: str, prefix: str, name: str) -> str:
        return g.op("LayerNormalization", [x, g.weight(name + ".w", s[prefix + ".weight"]), g.weight(name + ".b", s[prefix + ".bias"])],
                    [name], axis=-1, epsilon=eps)

    def add_layer_norm(x: str, bias: np.ndarray, residual: str, prefix: str, name: str) -> tuple[str, str]:
        """(LayerNorm(residual + x + bias), residual + x + bias) in one node: the projection's bias
        Add and the residual Add are fused in."""
        out = g.op("SkipLayerNormalization", [x, residual, g.weight(name + ".w", s[prefix + ".weight"]),
                                              g.weight(name + ".b", s[prefix + ".bias"]), g.weight(name + ".bias", bias)],
                   [name, "", "", name + ".sum"], domain="com.microsoft", epsilon=eps)
        return out[0], out[3]

    # Learned absolute positions P..P+k-1, P = total - k: rows [P, total) of the table (a Slice
    # with 1-D bounds from the mask's and the ids' lengths).
    g.seq_len(contract.INPUT_IDS, "new_len")
    start = g.op("Sub", ["total_len64.1d", "new_len.1d"], ["past_len.1d"])                              # [1]
    pos_emb = g.op("Slice", [g.weight("wpe", s["transformer.wpe.weight"]), start, "total_len64.1d", "axis0"], ["pos_emb"])
    tok = g.op("Gather", [g.weight("wte", s["transformer.wte.weight"]), contract.INPUT_IDS], ["tok_emb"])
    x = g.op("Add", [tok, pos_emb], ["h0"])
    # As in _llama: x is the residual stream, h the normalised copy feeding the next block; the
    # output projections' biases and the residual Adds are fused into the norms that follow them.
    h = layer_norm(x, "transformer.h.0.ln_1", "l0.ln1")
    for i in range(layers):
        p = f"transformer.h.{i}."
        qkv = g.linear(h, f"l{i}.qkv", s[p + "attn.c_attn.weight"], s[p + "attn.c_attn.bias"])
        attn = g.attention(i, qkv, heads, heads, hidden // heads, rotary=False)
        h, x = add_layer_norm(g.linear(attn, f"l{i}.o", s[p + "attn.c_proj.weight"]), s[p + "attn.c_proj.bias"], x,
                              p + "ln_2", f"l{i}.ln2")
        up = g.linear(h, f"l{i}.fc", s[p + "mlp.c_fc.weight"], s[p + "mlp.c_fc.bias"])
        act = g.op("FastGelu", [up], [f"l{i}.gelu"], domain="com.microsoft")  # gelu_new: the tanh approximation
        norm_prefix, norm_name = ("transformer.ln_f", "final_norm") if i + 1 == layers else (f"transformer.h.{i + 1}.ln_1", f"l{i + 1}.ln1")
        h, x = add_layer_norm(g.linear(act, f"l{i}.down", s[p + "mlp.c_proj.weight"]), s[p + "mlp.c_proj.bias"], x,
                              norm_prefix, norm_name)
    g.op("MatMul", [h, g.weight("lm_head", s["lm_head.weight"].T)], [contract.LOGITS])
    return int(s["lm_head.weight"].shape[0])


BUILDERS = {"llama": _llama, "gpt2": _gpt2}


def build(model, model_type: str, config: dict, out_path: Path, max_positions: int) -> int:
    """Write the static-KV graph of a transformers ``model`` to ``out_path``; return the opset."""
    state = {k: v.detach().float().numpy() for k, v in model.state_dict().items()}
    with DataFile(out_path.with_name(out_path.name + DATA_SUFFIX)) as data:
        g = _Graph(state, data)
        g.lengths()
        vocab = BUILDERS[model_type](g, config, max_positions)
    return g.save(out_path, vocab)
