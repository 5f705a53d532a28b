"""Post-export precision changes, per model."""
from __future__ import annotations

import logging
import os
import warnings
from pathlib import Path

from edgespec.errors import InvalidArgumentError

QUANT_CHOICES = ("none", "int8")
QUANT_LABEL = {"none": "none", "int8": "int8-dynamic"}


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


def check_dtype(dtype: str) -> None:
    if dtype == "fp32":
        return
    if dtype == "fp16":
        raise InvalidArgumentError(
            "--dtype fp16 is not supported by this exporter yet: ONNX Runtime's CPU provider runs most fp16 "
            "ops slowly or not at all and validation needs a GPU. Export fp32 (default) or use --quantize int8"
        )
    raise InvalidArgumentError(f"--dtype must be fp32 or fp16; got {dtype!r}")
