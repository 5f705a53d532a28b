"""Facts read from an exported ONNX graph: KV geometry and weight bytes per forward."""
from __future__ import annotations

from pathlib import Path

import numpy as np


def kv_geometry(path: Path, past_name: str) -> tuple[int, int]:
    """(kv_heads, head_size) from the static dims of a past input [batch, heads, past, head]."""
    import onnx

    model = onnx.load(str(path), load_external_data=False)
    for inp in model.graph.input:
        if inp.name == past_name:
            dims = inp.type.tensor_type.shape.dim
            return int(dims[1].dim_value), int(dims[3].dim_value)
    raise RuntimeError(f"{path} has no input {past_name}")  # exporter bug, not user error


def parameter_bytes(path: Path) -> dict[str, int]:
    """Weight bytes of one graph: ``total`` and ``per_forward``.

    ``per_forward`` is what one forward actually reads from memory: every initializer except those
    consumed only as the data table of a Gather (token embeddings: a forward reads k rows of V, a
    negligible k/V fraction), and position tables (a static-KV graph's Slice of GPT-2's wpe, the
    cos/sin inputs 7 and 8 of its attention op: k rows of max_positions are read). Tied embeddings also feed the LM head
    MatMul, so they count there.
    """
    import onnx
    from onnx.helper import tensor_dtype_to_np_dtype

    model = onnx.load(str(path), load_external_data=False)
    consumers: dict[str, list[tuple[str, int]]] = {}
    for node in model.graph.node:
        for pos, name in enumerate(node.input):
            consumers.setdefault(name, []).append((node.op_type, pos))
    total = per_forward = 0
    for init in model.graph.initializer:
        size = int(np.prod(init.dims, dtype=np.int64)) * np.dtype(tensor_dtype_to_np_dtype(init.data_type)).itemsize
        total += size
        uses = consumers.get(init.name, [])
        if uses and all(op in ("Gather", "Slice") and pos == 0 or (op == "GroupQueryAttention" and pos in (7, 8)) for op, pos in uses):
            continue
        per_forward += size
    return {"total": int(total), "per_forward": int(per_forward)}
