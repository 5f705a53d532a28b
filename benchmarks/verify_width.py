"""Why a verify call costs more than one plain step on a CPU: the fp32 MatMul kernel's time by the
number of rows (tokens) in the call, against what memory and arithmetic alone would allow.

    python benchmarks/verify_width.py --out benchmarks/results/bench/verify-width

The graph of `int8_rows.py` (twelve [512, 4096] fp32 MatMuls, 101 MB of weights, like the bench
target's), one intra-op thread, medians. Per width k: the call's time, its rate in GFLOP/s and
V(k) = time(k) / time(1), the verify cost in plain steps that Theorem 3.8 takes to be 1. Two
references: the kernel's own best rate (a wide call, compute bound) and numpy's matrix-vector
product on the same weights (1 row: how fast the weights can be streamed from memory here). If the
kernel streamed the weights once and overlapped the extra rows' arithmetic with it, a k-row call
would take max(time(1), k x FLOPs / best rate), i.e. V = 1 up to the width where the arithmetic
outlasts the stream; the "ideal V" column is that bound.
"""
from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import int8_rows  # noqa: E402  (the graph)
from edgespec.errors import InvalidArgumentError  # noqa: E402


def _median_ms(fn, calls: int) -> float:
    for _ in range(3):
        fn()
    ts = []
    for _ in range(calls):
        t0 = time.perf_counter()
        fn()
        ts.append(time.perf_counter() - t0)
    return statistics.median(ts) * 1e3


def main(argv=None) -> int:
    import onnxruntime as ort

    from edgespec.cli import at_least
    from edgespec.outputs import check_report_folder
    from edgespec.report import machine_description, write_json

    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--widths", default="1,2,4,6,8,16", help="rows per call to time (comma list; must include 1)")
    ap.add_argument("--peak-width", type=int, default=256, help="a wide call for the kernel's best rate")
    ap.add_argument("--calls", type=at_least(1), default=30, help="timed calls per width (median, after 3 warm-up calls)")
    ap.add_argument("--out", type=Path, default=None)
    args = ap.parse_args(argv)
    if args.out is not None:  # before the measurement, not after it
        check_report_folder(args.out)
    try:
        widths = sorted({int(w) for w in args.widths.split(",")})
    except ValueError:
        raise InvalidArgumentError(f"--widths takes comma-separated integers; got {args.widths!r}") from None
    if 1 not in widths or min(widths) < 1 or args.calls < 1 or args.peak_width < 1:
        raise InvalidArgumentError("--widths must include 1 and be >= 1; --calls and --peak-width >= 1")
    K, N, L = int8_rows.K, int8_rows.N, int8_rows.LAYERS
    flops_per_row = 2 * K * N * L
    rng = np.random.default_rng(1)
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "fp32.onnx"
        int8_rows.build(path)
        opts = ort.SessionOptions()
        opts.intra_op_num_threads = 1
        sess = ort.InferenceSession(str(path), opts, providers=["CPUExecutionProvider"])

        def ort_ms(k: int) -> float:
            x = rng.normal(size=(1, k, K)).astype(np.float32)
            return _median_ms(lambda: sess.run(None, {"x": x}), args.calls)

        ms = {k: ort_ms(k) for k in widths}
        peak_ms = ort_ms(args.peak_width)
    weights = [np.random.default_rng(0).normal(0, 0.02, (K, N)).astype(np.float32) for _ in range(L)]
    v = rng.normal(size=K).astype(np.float32)
    numpy_1row_ms = _median_ms(lambda: [v @ w for w in weights], args.calls)
    best_gflops = flops_per_row * args.peak_width / peak_ms / 1e6
    rows = []
    for k in widths:
        compute_ms = flops_per_row * k / best_gflops / 1e6
        rows.append({"rows": k, "ms": ms[k], "gflops": flops_per_row * k / ms[k] / 1e6, "V": ms[k] / ms[1],
                     "ideal_V": max(ms[1], compute_ms) / ms[1],
                     "extra_ms_per_row": (ms[k] - ms[1]) / (k - 1) if k > 1 else None})
    weight_mb = 4 * K * N * L / 1e6
    res = {"weights_mb": weight_mb, "rows": rows, "peak_width": args.peak_width, "peak_ms": peak_ms,
           "kernel_best_gflops": best_gflops, "ort_1row_gb_per_s": weight_mb / ms[1],
           "numpy_1row_ms": numpy_1row_ms, "numpy_1row_gb_per_s": weight_mb / numpy_1row_ms}
    lines = [f"{L} fp32 MatMuls of [{K}, {N}] ({weight_mb:.0f} MB), ONNX Runtime, 1 thread, median of {args.calls} calls",
             "", "| rows | ms | GFLOP/s | V | extra ms per row | ideal V (stream once, overlap arithmetic) |",
             "|---|---|---|---|---|---|"]
    lines += [f"| {r['rows']} | {r['ms']:.2f} | {r['gflops']:.1f} | {r['V']:.2f} | "
              f"{'-' if r['extra_ms_per_row'] is None else format(r['extra_ms_per_row'], '.3f')} | {r['ideal_V']:.2f} |"
              for r in rows]
    lines += ["", f"kernel's best rate: {best_gflops:.1f} GFLOP/s ({args.peak_width} rows, {peak_ms:.1f} ms)",
              f"1 row streams the weights at {res['ort_1row_gb_per_s']:.1f} GB/s in ONNX Runtime, "
              f"{res['numpy_1row_gb_per_s']:.1f} GB/s in numpy's matrix-vector product ({numpy_1row_ms:.2f} ms)"]
    print("\n".join(lines))
    if args.out is not None:
        args.out.mkdir(parents=True, exist_ok=True)
        (args.out / "verify_width.md").write_text("\n".join(lines) + "\n")
        write_json(args.out / "verify_width.json", {"machine": machine_description(), "calls": args.calls,
                                                      **res, "command": " ".join(sys.argv)})
    return 0


if __name__ == "__main__":
    from edgespec.cli import run_script

    sys.exit(run_script(main, "verify_width.py"))
