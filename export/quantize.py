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
BLOCK = 128  # weights per scale along K: 1-token steps were fastest at 128-256 (block 32: 20% slower)


def quantize_int8(graph: Path) -> None:
    """Dynamic int8 quantization of MatMul/Gemm weights (activations quantized at run time), in place.

    onnxruntime.quantization stores int8 weights with per-tensor scale/zero point; the KV cache
    and logits stay fp32, so the runtime contract is unchanged.
    """
    import onnx
    from onnxruntime.quantization import QuantType, quantize_dynamic

    from edgespec.bundle import onnx_external_data_locations

    tmp = graph.with_name(graph.stem + ".int8.onnx")
    old_data = set(onnx_external_data_locations(graph))
    root = logging.getLogger()
    level = root.level
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        root.setLevel(logging.ERROR)  # the quantizer logs a pre-processing suggestion on the root logger
        # DefaultTensorType: ONNX shape inference stops at contrib ops (GroupQueryAttention in
        # static-KV graphs); every activation in these graphs is fp32.
        try:
            quantize_dynamic(str(graph), str(tmp), weight_type=QuantType.QInt8, op_types_to_quantize=["MatMul", "Gemm"],
                             extra_options={"DefaultTensorType": onnx.TensorProto.FLOAT})
        finally:
            root.setLevel(level)
    os.replace(tmp, graph)
    for loc in old_data - set(onnx_external_data_locations(graph)):  # fp32 weights now unused
        (graph.parent / loc).unlink(missing_ok=True)


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
    inits = {t.name: t for t in model.graph.initializer}
    packed: dict[str, tuple[str, str, int, int]] = {}
    nodes, converted = [], 0
    for node in model.graph.node:
        w_name = node.input[1] if node.op_type == "MatMul" and node.domain in ("", "ai.onnx") else None
        w = numpy_helper.to_array(inits[w_name]) if w_name in inits else None
        if w is None or w.ndim != 2 or w.dtype != np.float32 or w.shape[0] < 16:
            nodes.append(node)
            continue
        if w_name not in packed:
            k, n = w.shape
            blocks = -(-k // block)
            wt = np.zeros((n, blocks * block), np.float32)
            wt[:, :k] = w.T
            wt = wt.reshape(n, blocks, block)                                   # [N, blocks, block]
            scale = np.abs(wt).max(-1) / 127.0                                  # [N, blocks] symmetric
            scale[scale == 0] = 1.0
            q = np.clip(np.rint(wt / scale[..., None]), -127, 127).astype(np.int16) + 128   # zero point 128
            b_name, s_name = w_name + ".int8", w_name + ".scales"
            model.graph.initializer.extend([numpy_helper.from_array(q.astype(np.uint8), b_name),       # [N, blocks, block]
                                            numpy_helper.from_array(scale.reshape(-1), s_name)])      # [N * blocks]
            packed[w_name] = (b_name, s_name, k, n)
        b_name, s_name, k, n = packed[w_name]
        nodes.append(helper.make_node("MatMulNBits", [node.input[0], b_name, s_name], list(node.output), name=node.name,
                                      domain="com.microsoft", K=k, N=n, bits=8, block_size=block, accuracy_level=4))
        converted += 1
    used = {i for n in nodes for i in n.input} | {o.name for o in model.graph.output}
    kept = [t for t in model.graph.initializer if t.name in used]
    del model.graph.node[:]
    model.graph.node.extend(nodes)
    del model.graph.initializer[:]
    model.graph.initializer.extend(kept)
    if not any(o.domain == "com.microsoft" for o in model.opset_import):
        model.opset_import.append(helper.make_opsetid("com.microsoft", 1))
    _save_replacing(model, graph)
    return converted


def _save_replacing(model, graph: Path) -> None:
    """Write ``model`` over ``graph`` (through a temporary file) and drop weight files it no longer uses."""
    import onnx

    from edgespec.bundle import onnx_external_data_locations

    old_data = set(onnx_external_data_locations(graph))
    tmp = graph.with_name(graph.stem + ".int8.onnx")
    for t in model.graph.initializer:  # everything inline (onnx.load kept the external-data fields)
        if t.data_location == onnx.TensorProto.EXTERNAL:
            t.data_location = onnx.TensorProto.DEFAULT
            del t.external_data[:]
    big = model.ByteSize() > 1 << 30  # protobuf's 2 GiB limit: large graphs keep their weights beside them
    data_name = graph.name + ".int8.data"
    if big:
        onnx.save(model, str(tmp), save_as_external_data=True, all_tensors_to_one_file=True, location=data_name, size_threshold=1024)
    else:
        onnx.save(model, str(tmp))
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
