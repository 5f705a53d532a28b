"""Post-export precision changes, per model."""
from __future__ import annotations

import logging
import os
import warnings
from pathlib import Path

from edgespec import contract
from edgespec.errors import InvalidArgumentError

from .external_data import DataFile, initializer_bytes

QUANT_CHOICES = ("none", "int8")
# What "int8" means per role (see quantize_int8_rowwise for why the target's differs).
QUANT_LABEL = {contract.ROLE_TARGET: {"none": "none", "int8": contract.QUANT_ROWWISE_INT8},
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


def quantize_int8_rowwise(graph: Path) -> tuple[int, list[str]]:
    """Per-token int8 for a target, in place: every MatMul, and every Gemm (GPT-2's and OPT's traced
    graphs), with a constant [K, N] fp32 weight becomes an int8 MatMulInteger between per-row
    quantized activations (8 bits) and per-column quantized weights (7 bits, see WEIGHT_LEVELS),
    followed by the two scales (and a Gemm's bias). Returns (the number converted, why each weight
    product that stays fp32 does).

    Why not dynamic quantization (used for drafts): it quantizes a call's activations with ONE scale
    over all its tokens, so the logits at a position depend on the other tokens in the same call,
    later ones included. The target then is not a fixed causal model: a verify call of gamma + 1
    tokens and plain decoding's 1-token calls see different logits, and the speculative output is not
    distributed as plain decoding's (Appendix A.1 needs the p of the plain model). Here each row
    (token) of activations gets its own scale, max |x| / 127, computed by row-wise ops, and the int8
    product is exact integer arithmetic, so a position's logits do not depend on the other tokens of
    the call (bit for bit: tested). Unlike MatMulNBits (the blockwise scheme below, which also
    quantizes per token) the k rows of a verify call run as one int8 GEMM: on the twelve [512, 4096]
    MatMuls of ``benchmarks/int8_rows.py``, 6 rows cost 1.1-1.2x one row here against about 2x blockwise.
    A draft may be any function of its context (q only has to be the distribution the drafted token
    was sampled from), so drafts keep the dynamic scheme.

    What stays (both schemes): a position's logits depend on the call's width by more than an fp32
    graph's do. ONNX Runtime's CPU attention multiplies a 1-token call's probabilities by V with
    another GEMM kernel than a k-token call's (MLAS's M = 1 path), about 1e-7 apart; when such a
    difference moves an activation across a rounding boundary of its int8 grid, the row changes by
    one quantization step. On the bench target: in one call up to 0.07 in the logits at a few
    positions (total variation at most 0.005; fp32: 1e-5 and 1e-6), and up to 0.14 along a decoding,
    whose later calls attend to the keys and values such a call wrote (``benchmarks/call_width.py``).
    """
    import numpy as np
    from onnx import TensorProto, helper

    model, g, opset = _load_for_rewrite(graph)
    names = _names_taken(g)

    def fresh(base: str) -> str:
        name, i = base, 1
        while name in names:
            name, i = f"{base}.{i}", i + 1
        names.add(name)
        return name

    consts = {key: fresh(f"edgespec.rowq.{key}") for key in ("tiny", "inv127", "zp", "offset", "lo", "hi", "axes")}
    added = {consts["tiny"]: np.array(1e-30, np.float32),     # an all-zero row: scale > 0
             consts["inv127"]: np.array(1 / 127, np.float32),
             consts["zp"]: np.array(128, np.uint8),           # uint8 x int8: the fast kernel
             consts["offset"]: np.array(128, np.float32),
             consts["lo"]: np.array(0, np.float32),
             consts["hi"]: np.array(255, np.float32),
             consts["axes"]: np.array([-1], np.int64)}        # new initializers: name -> array
    rows: dict[str, tuple[str, str]] = {}    # activation name -> (uint8 rows, row scales)

    def quantize_rows(x: str) -> tuple[str, str]:
        # Symmetric per row: s = max_k |x_k| / 127 (shape [..., 1]), q = round(x / s) + 128 in [1, 255].
        # Every op here reads one row, so a row's q and s depend on that row only.
        if x not in rows:
            t = {k: fresh(f"{x}.rowq.{k}") for k in ("abs", "max", "pos", "s", "div", "round", "shift", "clip", "q")}
            reduce = (helper.make_node("ReduceMax", [t["abs"], consts["axes"]], [t["max"]], keepdims=1) if opset >= 18
                      else helper.make_node("ReduceMax", [t["abs"]], [t["max"]], axes=[-1], keepdims=1))
            new_nodes.extend([
                helper.make_node("Abs", [x], [t["abs"]]), reduce,
                helper.make_node("Max", [t["max"], consts["tiny"]], [t["pos"]]),
                helper.make_node("Mul", [t["pos"], consts["inv127"]], [t["s"]]),
                helper.make_node("Div", [x, t["s"]], [t["div"]]),
                helper.make_node("Round", [t["div"]], [t["round"]]),                # half to even, like QuantizeLinear
                helper.make_node("Add", [t["round"], consts["offset"]], [t["shift"]]),
                helper.make_node("Clip", [t["shift"], consts["lo"], consts["hi"]], [t["clip"]]),
                helper.make_node("Cast", [t["clip"]], [t["q"]], to=TensorProto.UINT8)])
            rows[x] = (t["q"], t["s"])
        return rows[x]

    packed: dict[tuple, tuple[str, str]] = {}   # (weight name, transposed, alpha) -> (int8 weight, column scales)
    new_nodes: list = []
    converted, skipped = 0, []
    inits = _Constants(g, graph.parent)
    for node in list(g.node):
        found = _weight_product(node, inits)
        if isinstance(found, str) or found is None:
            skipped += [found] if found else []
            new_nodes.append(node)
            continue
        w_name, w, trans_b, alpha, bias = found
        key = (w_name, trans_b, alpha)
        if key not in packed:
            q, scale = _quantize_columns(w)
            packed[key] = (fresh(w_name + ".int8"), fresh(w_name + ".col_scales"))
            added[packed[key][0]], added[packed[key][1]] = q, (scale * np.float32(alpha)).astype(np.float32)
        q_x, s_x = quantize_rows(node.input[0])
        q_w, s_w = packed[key]
        out = node.output[0]
        acc, acc_f, row_scaled = fresh(out + ".int32"), fresh(out + ".float"), fresh(out + ".row_scaled")
        product = fresh(out + ".product") if bias is not None else out
        # y = (sum_k (q_x - 128) q_w) * s_x * s_w: exact int32 accumulation, then per-row and per-column
        # scales (a Gemm's alpha folded into the latter), then a Gemm's beta * C.
        new_nodes.extend([helper.make_node("MatMulInteger", [q_x, q_w, consts["zp"]], [acc], name=node.name),
                          helper.make_node("Cast", [acc], [acc_f], to=TensorProto.FLOAT),
                          helper.make_node("Mul", [acc_f, s_x], [row_scaled]),
                          helper.make_node("Mul", [row_scaled, s_w], [product])])
        if bias is not None:
            c_name, beta = bias
            if beta != 1.0:
                scaled = fresh(c_name + ".beta")
                if c_name in inits:
                    added[scaled] = (inits.array(c_name) * np.float32(beta)).astype(np.float32)
                else:
                    beta_name = fresh(c_name + ".beta_value")
                    added[beta_name] = np.array(beta, np.float32)
                    new_nodes.append(helper.make_node("Mul", [c_name, beta_name], [scaled]))
                c_name = scaled
            new_nodes.append(helper.make_node("Add", [product, c_name], [out]))
        converted += 1
    _save_rewrite(model, g, new_nodes, added, graph)
    return converted, skipped


class _Constants(dict):
    """A graph's initializers that are not graph inputs (an input can be overridden at run time:
    not a constant), by name, with each one's numpy array made once however many nodes read it."""

    def __init__(self, g, base_dir: Path):
        inputs = {i.name for i in g.input}
        super().__init__((t.name, t) for t in g.initializer if t.name not in inputs)
        self._arrays: dict = {}
        self._base_dir = base_dir  # where the graph's external data lives

    def array(self, name: str):
        from onnx import numpy_helper

        if name not in self._arrays:
            self._arrays[name] = numpy_helper.to_array(self[name], base_dir=str(self._base_dir))
        return self._arrays[name]


def _weight_product(node, inits: _Constants):
    """For a MatMul or Gemm by a constant fp32 weight: (weight name, [K, N] weight, transposed,
    alpha, (bias name, beta) or None); a reason string when such a product cannot be converted;
    None for every other node."""
    import numpy as np
    from onnx import helper

    if node.domain not in ("", "ai.onnx") or node.op_type not in ("MatMul", "Gemm") or node.input[1] not in inits:
        return None
    w = inits.array(node.input[1])
    attrs = {a.name: helper.get_attribute_value(a) for a in node.attribute}
    if w.dtype != np.float32 or w.ndim != 2:
        return f"{node.op_type} weight of {w.ndim} dimensions, {w.dtype}"
    if node.op_type == "Gemm":
        if attrs.get("transA", 0):
            return "Gemm with transA=1"
        trans_b = bool(attrs.get("transB", 0))
        w = w.T if trans_b else w
        bias = (node.input[2], float(attrs.get("beta", 1.0))) if len(node.input) > 2 and node.input[2] else None
        alpha = float(attrs.get("alpha", 1.0))
    else:
        trans_b, bias, alpha = False, None, 1.0
    if w.shape[0] < 16:
        return "K < 16 (too few inputs per output for int8)"
    return node.input[1], np.ascontiguousarray(w), trans_b, alpha, bias


# Weights use 7 bits (+-63). On x86 CPUs without VNNI, MLAS's uint8 x int8 kernel multiplies with
# vpmaddubsw, which adds the products of two neighbouring k into a saturating int16: with the raw
# uint8 activations (up to 255) and +-127 weights a pair reaches 64770 and is clipped, so the
# "exact" integer product would depend on the CPU the bundle runs on. 255 * 63 * 2 = 32130 cannot
# saturate (ONNX Runtime's own quantizer calls this reduce_range).
WEIGHT_LEVELS = 63


def _quantize_columns(w):
    """Symmetric int8 per output column of a [K, N] weight, in [-63, 63]: (q [K, N] int8, scale [N] float32)."""
    import numpy as np

    scale = np.abs(w).max(0).astype(np.float64) / WEIGHT_LEVELS                   # [N]
    scale[scale == 0] = 1.0
    q = np.clip(np.rint(w / scale), -WEIGHT_LEVELS, WEIGHT_LEVELS).astype(np.int8)  # [K, N]
    return q, scale.astype(np.float32)


def quantize_int8_blockwise(graph: Path, block: int = BLOCK) -> int:
    """Weight-only int8, in place: every MatMul with a constant [K, N] fp32 weight becomes an ONNX
    Runtime MatMulNBits (8 bits, one scale per ``block`` weights along K, accuracy level 4, which
    quantizes activations per token inside the kernel: causal, like the rowwise scheme). Returns the
    number of MatMuls converted. The exporter wrote targets this way before the rowwise scheme; it
    stays for ``benchmarks/int8_rows.py``, whose comparison is why targets changed: its verify calls
    cost far more than its 1-token steps (each extra row is another pass of the kernel).
    """
    from onnx import helper

    model, g, _ = _load_for_rewrite(graph)
    packed: dict[str, tuple[str, str, int, int]] = {}
    nodes, converted, added = [], 0, {}
    inits = _Constants(g, graph.parent)
    for node in list(g.node):
        found = _weight_product(node, inits)
        if node.op_type != "MatMul" or not isinstance(found, tuple):   # MatMulNBits has no bias or transposes
            nodes.append(node)
            continue
        w_name, w = found[:2]
        if w_name not in packed:
            packed[w_name] = _pack_int8(added, w_name, w, block)
        b_name, s_name, k, n = packed[w_name]
        nodes.append(helper.make_node("MatMulNBits", [node.input[0], b_name, s_name], list(node.output), name=node.name,
                                      domain="com.microsoft", K=k, N=n, bits=8, block_size=block, accuracy_level=4))
        converted += 1
    if not any(o.domain == "com.microsoft" for o in model.opset_import):
        model.opset_import.append(helper.make_opsetid("com.microsoft", 1))
    _save_rewrite(model, g, nodes, added, graph)
    return converted


def _load_for_rewrite(graph: Path):
    """(model, its graph, its default-domain opset); external weights stay on disk until read."""
    import onnx

    model = onnx.load(str(graph), load_external_data=False)
    opset = next((o.version for o in model.opset_import if o.domain in ("", "ai.onnx")), 0)
    if opset < 11:  # Round, Clip with min/max inputs
        raise InvalidArgumentError(f"{graph}: int8 quantization needs ONNX opset 11 or later; this graph has opset {opset}. "
                                   "Re-export with --opset 14 or later")
    return model, model.graph, opset


def _save_rewrite(model, g, nodes: list, added: dict, graph: Path) -> None:
    """Give ``g`` its new nodes and the new initializers ``added`` (name -> array), drop initializers
    nothing reads any more, and write it over ``graph``: in one file, or, past EXTERNAL_DATA_ABOVE,
    with its weights streamed into ``<graph>.int8.data`` (see external_data.py: protobuf's 2 GiB)."""
    import onnx
    from onnx import external_data_helper, numpy_helper

    used = _names_used(nodes) | {o.name for o in g.output}
    kept = [t for t in g.initializer if t.name in used]
    added = {name: array for name, array in added.items() if name in used}
    del g.node[:]
    g.node.extend(nodes)
    if initializer_bytes(kept) + sum(a.nbytes for a in added.values()) > EXTERNAL_DATA_ABOVE:
        data_path = _unused_path(graph.with_name(graph.name + ".int8.data"))  # not the file being adopted from
        try:
            with DataFile(data_path) as data:
                tensors = [data.adopt(t, graph.parent) for t in kept] + [data.tensor(n, a) for n, a in added.items()]
        except BaseException:
            data_path.unlink(missing_ok=True)
            raise
    else:
        for t in kept:
            if external_data_helper.uses_external_data(t):
                external_data_helper.load_external_data_for_tensor(t, str(graph.parent))
                t.data_location = onnx.TensorProto.DEFAULT
                del t.external_data[:]
        tensors = kept + [numpy_helper.from_array(a, n) for n, a in added.items()]
    del g.initializer[:]
    g.initializer.extend(tensors)
    tmp = graph.with_name(graph.stem + ".int8.onnx")
    onnx.save(model, str(tmp))
    _replace(tmp, graph)


def _unused_path(path: Path) -> Path:
    """``path``, or ``<stem>.1<suffix>``, ``.2``, ... if that file exists (a graph rewritten twice)."""
    candidate, i = path, 1
    while candidate.exists():
        candidate, i = path.with_name(f"{path.stem}.{i}{path.suffix}"), i + 1
    return candidate


def _pack_int8(added: dict, name: str, w, block: int) -> tuple[str, str, int, int]:
    """Add MatMulNBits' B and scales for a [K, N] weight to ``added``; return (B name, scales name, K, N)."""
    import numpy as np

    k, n = w.shape
    blocks = -(-k // block)
    wt = np.zeros((n, blocks * block), np.float32)                          # K padded with zero weights
    wt[:, :k] = w.T
    wt = wt.reshape(n, blocks, block)                                       # [N, blocks, block]
    scale = np.abs(wt).max(-1) / 127.0                                      # [N, blocks] symmetric
    scale[scale == 0] = 1.0
    q = np.clip(np.rint(wt / scale[..., None]), -127, 127).astype(np.int16) + 128   # zero point 128
    b_name, s_name = name + ".int8", name + ".scales"
    added[b_name] = q.astype(np.uint8)                                      # [N, blocks, block]
    added[s_name] = scale.reshape(-1)                                       # [N * blocks]
    return b_name, s_name, k, n


def _subgraphs(node):
    """The bodies of a node's If/Loop/Scan attributes."""
    from onnx import AttributeProto

    for attr in node.attribute:
        if attr.type == AttributeProto.GRAPH:
            yield attr.g
        elif attr.type == AttributeProto.GRAPHS:
            yield from attr.graphs


def _names_taken(g) -> set[str]:
    """Every tensor name in graph ``g``: what its nodes read and write, its inputs, outputs and initializers."""
    def written(nodes) -> set[str]:
        out = set()
        for node in nodes:
            out.update(node.output)
            for sub in _subgraphs(node):
                out |= written(sub.node) | {i.name for i in sub.input}
        return out

    return (_names_used(g.node) | written(g.node) | {i.name for i in g.input} | {o.name for o in g.output}
            | {t.name for t in g.initializer} | {v.name for v in g.value_info})


def _names_used(nodes) -> set[str]:
    """Every tensor name the nodes read, sub-graphs (If/Loop/Scan bodies) included."""
    used = set()
    for node in nodes:
        used.update(node.input)
        for sub in _subgraphs(node):
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
            "ops slowly or not at all and validation needs a GPU. Drop --dtype fp16: export fp32 (the default), "
            "with or without --quantize int8"
        )
    raise InvalidArgumentError(f"--dtype must be fp32 or fp16; got {dtype!r}")
