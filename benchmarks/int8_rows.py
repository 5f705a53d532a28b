"""Does a row's output depend on the other rows of the call, and what does an extra row cost? fp32
vs the int8 schemes edgespec's exporter writes (dynamic for drafts, rowwise for targets) and the
blockwise scheme it wrote for targets before.

    python benchmarks/int8_rows.py --out benchmarks/results/bench/int8-rows

A graph of twelve independent [512, 4096] MatMuls (101 MB of fp32 weights, like the bench target),
converted with edgespec's own `quantize_int8` (ONNX Runtime dynamic quantization),
`quantize_int8_rowwise` (MatMulInteger, one activation scale per row) and `quantize_int8_blockwise`
(MatMulNBits, 8 bits). Per scheme, one intra-op thread: the median time of
a call with 1 and with k rows, and two exactness checks on row 0: a 1-row call against the first row
of a k-row call, and a k-row call against the same call with only its last row changed. A speculative
target must pass the second check exactly (0.0); the first differs by kernel rounding at most.
"""
from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


K, N, LAYERS = 512, 4096, 12


def build(path: Path, seed: int = 0) -> None:
    import onnx
    from onnx import TensorProto, helper, numpy_helper

    rng = np.random.default_rng(seed)
    inits = [numpy_helper.from_array(rng.normal(0, 0.02, (K, N)).astype(np.float32), f"w{i}") for i in range(LAYERS)]
    nodes = [helper.make_node("MatMul", ["x", f"w{i}"], [f"o{i}"]) for i in range(LAYERS)]
    nodes.append(helper.make_node("Sum", [f"o{i}" for i in range(LAYERS)], ["y"]))
    graph = helper.make_graph(nodes, "rows", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, "k", K])],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, [1, "k", N])], inits)
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    model.ir_version = 8
    onnx.save(model, str(path))


def measure(path: Path, rows: int, calls: int) -> dict:
    import onnxruntime as ort

    opts = ort.SessionOptions()
    opts.intra_op_num_threads = 1
    sess = ort.InferenceSession(str(path), opts, providers=["CPUExecutionProvider"])
    x = np.random.default_rng(1).normal(size=(1, rows, K)).astype(np.float32)
    changed = x.copy()
    changed[0, -1] *= 50.0
    full = sess.run(None, {"x": x})[0]
    out = {"row0_1_vs_k": float(np.abs(sess.run(None, {"x": x[:, :1]})[0][0, 0] - full[0, 0]).max()),
           "row0_when_last_row_changes": float(np.abs(sess.run(None, {"x": changed})[0][0, 0] - full[0, 0]).max())}
    for k in (1, rows):
        feed = {"x": x[:, :k]}
        for _ in range(5):
            sess.run(None, feed)
        ts = []
        for _ in range(calls):
            t0 = time.perf_counter()
            sess.run(None, feed)
            ts.append(time.perf_counter() - t0)
        out[f"ms_{k}_rows"] = statistics.median(ts) * 1e3
    out["V"] = out[f"ms_{rows}_rows"] / out["ms_1_rows"]
    return out


def main(argv=None) -> int:
    from edgespec.cli import at_least
    from edgespec.outputs import check_report_folder
    from edgespec.export.quantize import quantize_int8, quantize_int8_blockwise, quantize_int8_rowwise
    from edgespec.report import machine_description, write_json

    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rows", type=at_least(2, 256), default=6,
                    help="rows of the multi-row call, 2-256 (default 6: a verify of gamma + 1 = 6 tokens)")
    ap.add_argument("--calls", type=at_least(1), default=40, help="timed calls per width (median; after 5 warm-up calls)")
    ap.add_argument("--out", type=Path, default=None)
    args = ap.parse_args(argv)
    if args.out is not None:  # before the measurement, not after it
        check_report_folder(args.out)
    results = {}
    with tempfile.TemporaryDirectory() as tmp:
        for name, convert in (("fp32", None), ("int8 dynamic (drafts)", quantize_int8),
                              ("int8 rowwise (targets)", quantize_int8_rowwise),
                              ("int8 blockwise (targets before 2026-11-30)", quantize_int8_blockwise)):
            path = Path(tmp) / f"{len(results)}.onnx"
            build(path)
            if convert is not None:
                convert(path)
            results[name] = measure(path, args.rows, args.calls)
    lines = [f"{LAYERS} MatMuls of [{K}, {N}], 1 thread, median of {args.calls} calls", "",
             f"| scheme | 1 row ms | {args.rows} rows ms | V | row 0: 1-row vs {args.rows}-row call | row 0 when the last row changes |",
             "|---|---|---|---|---|---|"]
    lines += [f"| {n} | {r['ms_1_rows']:.2f} | {r[f'ms_{args.rows}_rows']:.2f} | {r['V']:.2f} | {r['row0_1_vs_k']:.2e} | "
              f"{r['row0_when_last_row_changes']:.2e} |" for n, r in results.items()]
    print("\n".join(lines))
    if args.out is not None:
        args.out.mkdir(parents=True, exist_ok=True)
        (args.out / "int8_rows.md").write_text("\n".join(lines) + "\n")
        write_json(args.out / "int8_rows.json", {"machine": machine_description(), "rows": args.rows,
                                                  "calls": args.calls, "results": results,
                                                  "command": " ".join(sys.argv)})
    return 0


if __name__ == "__main__":
    from edgespec.cli import run_script

    sys.exit(run_script(main, "int8_rows.py"))
