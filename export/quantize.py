"""Post-export precision changes, per model."""
from __future__ import annotations

import logging
import os
import warnings
from pathlib import Path

from edgespec import contract
from edgespec.errors import InvalidArgumentError

QUANT_CHOICES = ("none", "int8")
# What "int8" means per role (see quantize_int8_blockwise for why the target's differs).
QUANT_LABEL = {contract.ROLE_TARGET: {"none": "none", "int8": "int8-blockwise"},
               contract.ROLE_DRAFT: {"none": "none", "int8": contract.QUANT_DYNAMIC_INT8}}
# Graphs above this size are quantized to a graph with external data: a protobuf cannot hold 2 GB
# (the embedding tables stay fp32, so a large-vocabulary draft can exceed it).
EXTERNAL_DATA_ABOVE = 1 << 30
BLOCK = 128  # weights per scale along K: 1-token steps were fastest at 128-256 (block 32: 20% slower)


def quantize_int8(graph: Path) -> None:
    """Dynamic int8 quantization of MatMul/Gemm weights (activations quantized at run time), in place.

    onnxruntime.quantization stores int8 weights with per-tensor scale/zero point; the KV cache
    and logits stay fp32, so the runtime contract is unchanged.
    """
    import onnx
    from onnxruntime.quantization import QuantType, quantize_dynamic

    from edgespec.bundle import onnx_external_data_locations

    size = graph.stat().st_size + sum((graph.parent / loc).stat().st_size for loc in set(onnx_external_data_locations(graph)))
    tmp = graph.with_name(graph.stem + ".int8.onnx")
    root = logging.getLogger()
    level = root.level
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        root.setLevel(logging.ERROR)  # the quantizer logs a pre-processing suggestion on the root logger
        # DefaultTensorType: ONNX shape inference stops at contrib ops (GroupQueryAttention in
        # static-KV graphs); every activation in these graphs is fp32.
        try:
            quantize_dynamic(str(graph), str(tmp), weight_type=QuantType.QInt8, op_types_to_quantize=["MatMul", "Gemm"],
                             extra_options={"DefaultTensorType": onnx.TensorProto.FLOAT},
                             use_external_data_format=size > EXTERNAL_DATA_ABOVE)
        finally:
            root.setLevel(level)
    _replace(tmp, graph)  # the fp32 weights' file goes


def quantize_int8_blockwise(graph: Path, block: int = BLOCK) -> int:
    """Weight-only int8 for a target, in place: every MatMul with a constant [K, N] fp32 weight becomes
    an ONNX Runtime MatMulNBits (8 bits, one scale per ``block`` weights along K, accuracy level 4).
    Returns the number of MatMuls converted.

    Why not dynamic quantization (used for drafts): it quantizes a call's activations with ONE scale
    over all its tokens, so the logits at a position depend on the other tokens in the same call,
    later ones included. The target then is not a fixed causal model: a verify call of gamma + 1
    tokens and plain decoding's 1-token calls see different logits, and the speculative output is not
    distributed as plain decoding's (Appendix A.1 needs the p of the plain model). Here each row of
    activations is quantized on its own (per row and block, inside the kernel), so a position's
    logits do not depend on what else is in the call. A draft may be any function of its context:
    q only has to be the distribution the drafted token was sampled from, so drafts keep the faster
    dynamic scheme.
    """
    import onnx
    import numpy as np
    from onnx import helper, numpy_helper

    model = onnx.load(str(graph))  # with its external data
    g = model.graph
    # A weight that is also a graph input can be overridden at run time: not a constant, left alone.
    inputs = {i.name for i in g.input}
    inits = {t.name: t for t in g.initializer if t.name not in inputs}
    packed: dict[str, tuple[str, str, int, int]] = {}
    nodes, converted = [], 0
    for node in g.node:
        w_name = node.input[1] if node.op_type == "MatMul" and node.domain in ("", "ai.onnx") else None
        if w_name in inits and w_name not in packed:
            w = numpy_helper.to_array(inits[w_name])
            if w.ndim == 2 and w.dtype == np.float32 and w.shape[0] >= 16:
                packed[w_name] = _pack_int8(g, w_name, w, block)
        if w_name not in packed:
            nodes.append(node)
            continue
        b_name, s_name, k, n = packed[w_name]
        nodes.append(helper.make_node("MatMulNBits", [node.input[0], b_name, s_name], list(node.output), name=node.name,
                                      domain="com.microsoft", K=k, N=n, bits=8, block_size=block, accuracy_level=4))
        converted += 1
    used = _names_used(nodes) | {o.name for o in g.output}
    kept = [t for t in g.initializer if t.name in used]
    del g.node[:]
    g.node.extend(nodes)
    del g.initializer[:]
    g.initializer.extend(kept)
    if not any(o.domain == "com.microsoft" for o in model.opset_import):
        model.opset_import.append(helper.make_opsetid("com.microsoft", 1))
    tmp = graph.with_name(graph.stem + ".int8.onnx")
    if model.ByteSize() > 1 << 30:  # protobuf's 2 GiB limit: large graphs keep their weights beside them
        onnx.save(model, str(tmp), save_as_external_data=True, all_tensors_to_one_file=True,
                  location=graph.name + ".int8.data", size_threshold=1024)
    else:
        onnx.save(model, str(tmp))
    _replace(tmp, graph)
    return converted


def _pack_int8(g, name: str, w, block: int) -> tuple[str, str, int, int]:
    """Add MatMulNBits' B and scales for a [K, N] weight to graph ``g``; return (B name, scales name, K, N)."""
    import numpy as np
    from onnx import numpy_helper

    k, n = w.shape
    blocks = -(-k // block)
    wt = np.zeros((n, blocks * block), np.float32)                          # K padded with zero weights
    wt[:, :k] = w.T
    wt = wt.reshape(n, blocks, block)                                       # [N, blocks, block]
    scale = np.abs(wt).max(-1) / 127.0                                      # [N, blocks] symmetric
    scale[scale == 0] = 1.0
    q = np.clip(np.rint(wt / scale[..., None]), -127, 127).astype(np.int16) + 128   # zero point 128
    b_name, s_name = name + ".int8", name + ".scales"
    g.initializer.extend([numpy_helper.from_array(q.astype(np.uint8), b_name),      # [N, blocks, block]
                          numpy_helper.from_array(scale.reshape(-1), s_name)])     # [N * blocks]
    return b_name, s_name, k, n


def _names_used(nodes) -> set[str]:
    """Every tensor name the nodes read, sub-graphs (If/Loop/Scan bodies) included."""
    from onnx import AttributeProto

    used = set()
    for node in nodes:
        used.update(node.input)
        for attr in node.attribute:
            graphs = [attr.g] if attr.type == AttributeProto.GRAPH else list(attr.graphs) if attr.type == AttributeProto.GRAPHS else []
            for sub in graphs:
                used |= _names_used(sub.node) | {o.name for o in sub.output}
    return used


def _replace(tmp: Path, graph: Path) -> None:
    """Move the rewritten ``tmp`` over ``graph`` and delete weight files only the old graph used."""
    from edgespec.bundle import onnx_external_data_locations

    old_data = set(onnx_external_data_locations(graph))
    os.replace(tmp, graph)
    for loc in old_data - set(onnx_external_data_locations(graph)):
        (graph.parent / loc).unlink(missing_ok=True)


def check_dtype(dtype: str) -> None:
    if dtype == "fp32":
        return
    if dtype == "fp16":
        raise InvalidArgumentError(
            "--dtype fp16 is not supported by this exporter yet: ONNX Runtime's CPU provider runs most fp16 "
            "ops slowly or not at all and validation needs a GPU. Export fp32 (default) or use --quantize int8"
        )
    raise InvalidArgumentError(f"--dtype must be fp32 or fp16; got {dtype!r}")
