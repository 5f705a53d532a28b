"""Huge pages on and off, side by side in one process: two engines on the same bundle, one whose
sessions moved their weights onto transparent huge pages (edgespec.load's default on Linux) and one
that did not (huge_pages=False), run alternately, plain and speculative decoding each.

    python benchmarks/huge_pages_ab.py BUNDLE --temperature 0 --gamma 5 --repeats 6 --out DIR

The 8 built-in code prompts x 96 tokens, 1 thread per model, one warm-up repeat; ratios are taken
repeat by repeat (on / off). Writes DIR/huge_pages_ab.json.
"""
from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import edgespec  # noqa: E402
from edgespec.cli import at_least  # noqa: E402
from edgespec.outputs import check_report_folder  # noqa: E402
from edgespec.prompts import CODE_PROMPTS  # noqa: E402
from edgespec.report import machine_description, write_json  # noqa: E402


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("bundle", type=Path)
    ap.add_argument("--temperature", type=float, default=0.0)
    ap.add_argument("--gamma", type=at_least(1), default=5)
    ap.add_argument("--repeats", type=at_least(1), default=6)
    ap.add_argument("--out", type=Path, required=True)
    args = ap.parse_args()
    if args.out is not None:  # before the measurement, not after it
        check_report_folder(args.out)
    engines = {"off": edgespec.load(args.bundle, threads=1, draft_threads=1, huge_pages=False)}
    from edgespec.runtimes import huge_pages
    before = huge_pages.anonymous_ranges()
    engines["on"] = edgespec.load(args.bundle, threads=1, draft_threads=1, huge_pages=True)
    collapsed = sum(hi - lo for lo, hi in huge_pages.new_ranges(before, huge_pages.anonymous_ranges()))
    prompts = [engines["on"].encode(p) for p in CODE_PROMPTS]

    def rate(eng, **kw) -> float:
        t0, n = time.perf_counter(), 0
        for p in prompts:
            n += eng.generate(p, max_new_tokens=96, temperature=args.temperature, seed=1, **kw).stats.emitted
        return n / (time.perf_counter() - t0)

    runs = {f"{side} {mode}": [] for side in engines for mode in ("plain", "speculative")}
    for i in range(args.repeats + 1):
        for side in (("off", "on") if i % 2 == 0 else ("on", "off")):
            print(f"[huge_pages_ab] repeat {i}/{args.repeats} {side}", file=sys.stderr, flush=True)
            plain, spec = rate(engines[side], use_draft=False), rate(engines[side], gamma=args.gamma)
            if i:  # repeat 0 warms up
                runs[f"{side} plain"].append(plain)
                runs[f"{side} speculative"].append(spec)
    r = {k: np.asarray(v) for k, v in runs.items()}
    summary = {
        "plain on / off": float(np.median(r["on plain"] / r["off plain"])),
        "speculative on / off": float(np.median(r["on speculative"] / r["off speculative"])),
        "speculative / plain, off": float(np.median(r["off speculative"] / r["off plain"])),
        "speculative / plain, on": float(np.median(r["on speculative"] / r["on plain"])),
    }
    for k, v in summary.items():
        print(f"{k}: {v:.3f}")
    write_json(args.out / "huge_pages_ab.json", {
        "bundle": str(args.bundle), "temperature": args.temperature, "gamma": args.gamma, "repeats": args.repeats,
        "machine": machine_description(), "new_anonymous_bytes_on_load": collapsed,
        "tokens_per_s": runs, "medians_of_ratios": summary,
        "command": "python benchmarks/huge_pages_ab.py " + " ".join(sys.argv[1:])})
    return 0


if __name__ == "__main__":
    from edgespec.cli import run_script

    sys.exit(run_script(main, "huge_pages_ab.py"))
