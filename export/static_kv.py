"""Llama decoder graphs with an in-place ("static") KV cache: ``contract.KV_STATIC``.

Why not optimum's graph: it returns present = concat(past, new), so the cache moves through a new
buffer every call, and after a rejected draft the runtime must compact the kept prefix (a copy)
before the next call. Here each layer's attention is one GroupQueryAttention node (an ONNX Runtime
contrib op) whose past and present are bound to the SAME [1, kv_heads, max_positions, head]
buffer: a call writes the k new tokens' keys/values at positions [P, P + k) and attends over
[0, P + k). Rolling back after a rejection is then only a shorter attention mask on the next call
(O(1), nothing copied; the stale tail is overwritten by the next tokens), which is what the
speculative loop needs after every round that rejects a draft.

The rest of the graph is written directly too (as onnxruntime-genai's model builder does rather
than traced): packed QKV and gate/up MatMuls, rotary embedding inside the attention op, RMSNorm as
SimplifiedLayerNormalization. It has about 1/6 of the nodes of the traced graph, which matters for
small models where per-node overhead is a large part of a step.

Inputs and outputs follow the contract: ``input_ids`` [1, k], ``attention_mask`` [1, P + k]
(all ones; the graph derives the attention op's seqlens_k = P + k - 1 and total length from it),
``past_key_values.{i}.key|value`` -> ``present.{i}.key|value`` [1, kv_heads, max_positions, head],
``logits`` [1, k, vocab]. The graph is numerically validated against PyTorch like every export.
"""
from __future__ import annotations

from pathlib import Path

import numpy as np

from edgespec import contract

OPSET = 17
DATA_SUFFIX = ".data"  # weights live in <graph>.data next to the graph (external data, same folder)


def unsupported_reason(model_type: str, config: dict) -> str | None:
    """Why this checkpoint cannot get a static-KV graph (None if it can)."""
    if model_type != "llama":
        return f"model_type {model_type!r} (static-KV graphs are built for llama)"
    if config.get("hidden_act", "silu") != "silu":
        return f"hidden_act {config.get('hidden_act')!r} (needs silu)"
    for key in ("attention_bias", "mlp_bias"):
        if config.get(key):
            return f"{key}=true (needs bias-free projections)"
    if config.get("rope_scaling"):
        return f"rope_scaling {config.get('rope_scaling')!r} (needs plain rotary embeddings)"
    heads, hidden = config.get("num_attention_heads"), config.get("hidden_size")
    if not isinstance(heads, int) or not isinstance(hidden, int) or heads < 1:
        return "config.json lacks num_attention_heads / hidden_size"
    head = config.get("head_dim") or hidden // heads
    if head % 16:
        return f"head size {head} (ONNX Runtime's GroupQueryAttention needs a multiple of 16)"
    return None


def build_llama(model, config: dict, out_path: Path, max_positions: int) -> int:
    """Write the static-KV graph of a transformers Llama ``model`` to ``out_path``; return the opset."""
    import onnx
    from onnx import TensorProto
    from onnx import helper as oh
    from onnx import numpy_helper

    state = {k: v.detach().float().numpy() for k, v in model.state_dict().items()}
    layers, hidden = config["num_hidden_layers"], config["hidden_size"]
    heads = config["num_attention_heads"]
    kv_heads = config.get("num_key_value_heads") or heads
    head = config.get("head_dim") or hidden // heads
    vocab, eps = int(state["lm_head.weight"].shape[0]), float(config.get("rms_norm_eps", 1e-6))
    theta = float(config.get("rope_theta", 10000.0))
    inits, nodes = [], []

    def weight(name: str, arr: np.ndarray) -> str:
        inits.append(numpy_helper.from_array(np.ascontiguousarray(arr, dtype=np.float32), name))
        return name

    def op(op_type: str, inputs: list[str], outputs: list[str], domain: str = "", **attrs):
        nodes.append(oh.make_node(op_type, inputs, outputs, domain=domain, **attrs))
        return outputs[0] if len(outputs) == 1 else outputs

    def rms_norm(x: str, w: np.ndarray, name: str) -> str:
        return op("SimplifiedLayerNormalization", [x, weight(name + ".w", w)], [name], axis=-1, epsilon=eps, stash_type=1)

    # Rotary tables [max_positions, head / 2] as in HF Llama (non-interleaved halves, section 3.4 of RoFormer).
    inv_freq = 1.0 / theta ** (np.arange(0, head, 2, dtype=np.float64) / head)
    angles = np.arange(max_positions, dtype=np.float64)[:, None] * inv_freq[None, :]
    weight("cos_cache", np.cos(angles))
    weight("sin_cache", np.sin(angles))
    # seqlens_k [1] = P + k - 1 and total_sequence_length [] = P + k, from the all-ones mask [1, P + k].
    nodes.append(oh.make_node("Constant", [], ["axis1"], value=numpy_helper.from_array(np.array([1], np.int64))))
    nodes.append(oh.make_node("Constant", [], ["one"], value=numpy_helper.from_array(np.array(1, np.int64))))
    mask_sum = op("ReduceSum", [contract.ATTENTION_MASK, "axis1"], ["mask_sum"], keepdims=0)   # [1]
    op("Cast", [op("Sub", [mask_sum, "one"], ["last_index"])], ["seqlens_k"], to=TensorProto.INT32)
    shape = op("Shape", [contract.ATTENTION_MASK], ["mask_shape"])                              # [2]
    op("Cast", [op("Gather", [shape, "one"], ["mask_len"], axis=0)], ["total_len"], to=TensorProto.INT32)

    x = op("Gather", [weight("embed_tokens", state["model.embed_tokens.weight"]), contract.INPUT_IDS], ["h0"])
    kv_shape = [1, kv_heads, "max_positions", head]
    inputs = [oh.make_tensor_value_info(contract.INPUT_IDS, TensorProto.INT64, [1, "new"]),
              oh.make_tensor_value_info(contract.ATTENTION_MASK, TensorProto.INT64, [1, "total"])]
    outputs = [oh.make_tensor_value_info(contract.LOGITS, TensorProto.FLOAT, [1, "new", vocab])]
    past, present = contract.decoder_past_names(layers), contract.decoder_present_names(layers)
    for i in range(layers):
        p = f"model.layers.{i}."
        n = rms_norm(x, state[p + "input_layernorm.weight"], f"l{i}.attn_norm")
        qkv = np.concatenate([state[p + f"self_attn.{m}_proj.weight"] for m in "qkv"], axis=0).T  # [hidden, (H + 2 Hkv) d]
        qkv_out = op("MatMul", [n, weight(f"l{i}.qkv", qkv)], [f"l{i}.qkv_out"])
        pk, pv, ok, ov = past[2 * i], past[2 * i + 1], present[2 * i], present[2 * i + 1]
        inputs += [oh.make_tensor_value_info(name, TensorProto.FLOAT, kv_shape) for name in (pk, pv)]
        outputs += [oh.make_tensor_value_info(name, TensorProto.FLOAT, kv_shape) for name in (ok, ov)]
        # Packed QKV (key/value inputs empty); rotary applied inside at positions seqlens_k + 1 - k + j.
        attn = op("GroupQueryAttention", [qkv_out, "", "", pk, pv, "seqlens_k", "total_len", "cos_cache", "sin_cache"],
                  [f"l{i}.attn", ok, ov], domain="com.microsoft",
                  num_heads=heads, kv_num_heads=kv_heads, do_rotary=1, rotary_interleaved=0)[0]
        o = op("MatMul", [attn, weight(f"l{i}.o", state[p + "self_attn.o_proj.weight"].T)], [f"l{i}.o_out"])
        x = op("Add", [x, o], [f"l{i}.resid"])
        n = rms_norm(x, state[p + "post_attention_layernorm.weight"], f"l{i}.mlp_norm")
        inter = state[p + "mlp.gate_proj.weight"].shape[0]
        gate_up = np.concatenate([state[p + "mlp.gate_proj.weight"], state[p + "mlp.up_proj.weight"]], axis=0).T
        gu = op("MatMul", [n, weight(f"l{i}.gate_up", gate_up)], [f"l{i}.gu"])
        split = f"l{i}.split"
        inits.append(numpy_helper.from_array(np.array([inter, inter], np.int64), split))
        g, u = op("Split", [gu, split], [f"l{i}.g", f"l{i}.u"], axis=-1)
        silu = op("Mul", [g, op("Sigmoid", [g], [f"l{i}.sig"])], [f"l{i}.silu"])
        down = op("MatMul", [op("Mul", [silu, u], [f"l{i}.act"]), weight(f"l{i}.down", state[p + "mlp.down_proj.weight"].T)],
                  [f"l{i}.down_out"])
        x = op("Add", [x, down], [f"h{i + 1}"])
    n = rms_norm(x, state["model.norm.weight"], "final_norm")
    op("MatMul", [n, weight("lm_head", state["lm_head.weight"].T)], [contract.LOGITS])

    graph = oh.make_graph(nodes, "edgespec_llama_static_kv", inputs, outputs, inits)
    onnx_model = oh.make_model(graph, opset_imports=[oh.make_opsetid("", OPSET), oh.make_opsetid("com.microsoft", 1)],
                               producer_name="edgespec")
    onnx_model.ir_version = 8
    onnx.save(onnx_model, str(out_path), save_as_external_data=True, all_tensors_to_one_file=True,
              location=out_path.name + DATA_SUFFIX, size_threshold=1024)
    return OPSET
