"""ONNX Runtime vs the XLA reference path on one bundle exported with --format onnx+xla:
greedy output compared token for token, the largest logits difference, and tokens/s of plain and
speculative decoding on each runtime, interleaved in one run (medians after a warm-up). Threads:
ONNX Runtime gets 1 intra-op thread per model, XLA its own default (the CPU client's thread pool,
all cores); the speeds are each runtime as configured, not a same-threads comparison.

    python benchmarks/runtimes.py --bundle BUNDLE --out benchmarks/results/<tag>/runtimes
"""
from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import numpy as np

import edgespec
from edgespec.cli import at_least
from edgespec.outputs import check_report_folder
from edgespec.prompts import CODE_PROMPTS
from edgespec.report import machine_description, write_json


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--bundle", type=Path, required=True)
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--gamma", type=at_least(1), default=4)
    ap.add_argument("--max-new-tokens", type=at_least(1), default=64)
    ap.add_argument("--repeats", type=at_least(1), default=3)
    args = ap.parse_args()
    if args.out is not None:  # before the measurement, not after it
        check_report_folder(args.out)
    engines = {"onnx": edgespec.load(args.bundle, threads=1, spinning=False),
               "xla": edgespec.load(args.bundle, runtime="xla")}
    prompts = [engines["onnx"].encode(p) for p in CODE_PROMPTS[:4]]
    identity = []
    for i, ids in enumerate(prompts):
        outs = {rt: e.generate(ids, max_new_tokens=args.max_new_tokens, temperature=0.0, gamma=args.gamma).ids
                for rt, e in engines.items()}
        plain = engines["onnx"].generate(ids, max_new_tokens=args.max_new_tokens, temperature=0.0, use_draft=False).ids
        identity.append({"prompt": i, "onnx_equals_xla": outs["onnx"] == outs["xla"], "spec_equals_plain": outs["onnx"] == plain})
    la = engines["onnx"].target.prefill(np.asarray(prompts[0]))
    lb = engines["xla"].target.prefill(np.asarray(prompts[0]))
    max_diff = float(np.abs(la - lb).max())
    tps: dict[str, list[float]] = {}
    for t in (0.0, 1.0):
        for rep in range(args.repeats + 1):
            for rt, e in engines.items():
                for mode in ("plain", "speculative"):
                    n, t0 = 0, time.perf_counter()
                    for i, ids in enumerate(prompts):
                        spec = mode == "speculative"   # (gamma with use_draft=False is refused: it does nothing)
                        n += len(e.generate(ids, max_new_tokens=args.max_new_tokens, temperature=t,
                                            gamma=args.gamma if spec else None, seed=rep * 100 + i, use_draft=spec).ids)
                    if rep:
                        tps.setdefault(f"{rt} {mode} T={t:g}", []).append(n / (time.perf_counter() - t0))
    summary = {k: statistics.median(v) for k, v in tps.items()}
    payload = {"bundle": str(args.bundle), "machine": machine_description(), "gamma": args.gamma,
               "max_new_tokens": args.max_new_tokens, "repeats": args.repeats, "identity": identity,
               "threads": {"onnx": "1 intra-op thread per model, no spinning", "xla": "JAX's default (all cores)"},
               "max_abs_logits_diff_prefill": max_diff, "tokens_per_s_median": summary, "tokens_per_s_all": tps,
               "command": " ".join(sys.argv)}
    write_json(args.out / "runtimes.json", payload)
    print(f"greedy identity onnx vs xla: {sum(r['onnx_equals_xla'] for r in identity)}/{len(identity)} prompts; "
          f"max |logits| diff {max_diff:.2e}")
    for k, v in summary.items():
        print(f"  {k:<28} {v:8.1f} tok/s")
    print("threads: onnx 1 per model; xla JAX's default (all cores)")
    return 0


if __name__ == "__main__":
    from edgespec.cli import run_script

    sys.exit(run_script(main, "runtimes.py"))
