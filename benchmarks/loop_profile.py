"""Where the time of a generated token goes: prefill, drafting, target calls, sampling and the rest,
per token, for plain and speculative decoding, from the loop's own GenerationStats.

    python benchmarks/loop_profile.py BUNDLE --temperature 0 --gamma 6 [--threads 1] [--repeats 3]

The 4 built-in bench prompts, 96 new tokens each, seed 1; the last repeat is printed (the earlier
ones warm up). Not a speed claim: it says which part of a round a change moved.
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import edgespec  # noqa: E402
from edgespec.cli import at_least  # noqa: E402
from edgespec.prompts import CODE_PROMPTS  # noqa: E402

PARTS = ("prefill_s", "draft_s", "empty_draft_s", "target_s", "sample_s")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("bundle", type=Path)
    ap.add_argument("--temperature", type=float, default=0.0)
    ap.add_argument("--gamma", type=at_least(1), default=5)
    ap.add_argument("--threads", type=at_least(0), default=1, help="target intra-op threads (the draft gets 1)")
    ap.add_argument("--repeats", type=at_least(1), default=3)
    args = ap.parse_args()
    eng = edgespec.load(args.bundle, threads=args.threads, draft_threads=1)  # errors: run_script prints them
    for _ in range(args.repeats):
        agg = {mode: np.zeros(2 + len(PARTS)) for mode in ("plain", "spec")}  # tokens, total, parts
        for prompt in CODE_PROMPTS[:4]:
            for mode in agg:
                spec = mode == "spec"   # (gamma with use_draft=False is refused: it does nothing)
                s = eng.generate(prompt, max_new_tokens=96, temperature=args.temperature,
                                 gamma=args.gamma if spec else None, seed=1, use_draft=spec).stats
                agg[mode] += [s.emitted, s.total_s, *(getattr(s, p) for p in PARTS)]
    for mode, (n, total, *parts) in agg.items():
        other = total - sum(parts)
        cells = " ".join(f"{p[:-2]} {v / n * 1e3:.3f}" for p, v in zip(PARTS, parts))
        print(f"{mode}: {n / total:.1f} tok/s; ms per token: total {total / n * 1e3:.3f} {cells} other {other / n * 1e3:.3f}")
    return 0


if __name__ == "__main__":
    from edgespec.cli import run_script

    sys.exit(run_script(main, "loop_profile.py"))
