"""How much can a draft-length policy gain at greedy decoding? Static gamma vs edgespec's adaptive
policy vs the best confidence-threshold policy vs an oracle, on one bundle.

    python benchmarks/adaptive_bound.py BUNDLE --out benchmarks/results/<tag>/adaptive-bound

At temperature 0 a round's outcome is deterministic: along the target's greedy output, the draft
proposes its argmax at each position (its cache holds the accepted prefix, which is the target's
output) and the round keeps drafts while they equal the target's tokens. So one greedy run of the
target plus one draft pass over it gives, for every position, whether the draft's token is kept and
the draft's confidence in it, and any policy can be replayed on that trace exactly. Only the clock
is modelled: a round costs g * t_draft + t_target(g + 1), with both measured on this machine
(median of per-call timings, each verify after a rewind; a least-squares line over widths 1..11). This gives the ceiling of each kind of
policy, not a speed claim (speed claims are `edgespec bench` runs).

Policies replayed:
- static gamma 1..10 (the sweep);
- edgespec's adaptive policy (`edgespec/adaptive.py`, learning online, as shipped);
- the best "draft while the predicted all-kept probability exceeds a threshold" policy, with the
  keep probability per confidence bin taken from the trace itself (in-sample: an upper bound for
  policies that see only the draft's confidence; optimal stopping for a ratio objective has this form);
- an oracle that knows which drafts will be kept (drafts exactly the kept run; unreachable).
"""
from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import numpy as np

from edgespec.adaptive import AdaptiveGamma
from edgespec.api import load
from edgespec.prompts import CODE_PROMPTS
from edgespec.report import machine_description, write_json

BINS = 10


def trace(engine, prompts: list[list[int]], new_tokens: int, vocab: int) -> list[dict]:
    """Per prompt: the target's greedy output and, per position, the draft's match and confidence."""
    out = []
    for ids in prompts:
        path = engine.generate(ids, max_new_tokens=new_tokens, temperature=0, use_draft=False).ids
        d = engine.draft
        first = d.prefill(ids)[:vocab]                                       # [V] predicts path[0]
        rest = d.extend(path[:-1])[:, :vocab] if len(path) > 1 else np.zeros((0, vocab))
        logits = np.concatenate([first[None], rest]).astype(np.float64)     # [n, V]
        conf = 1.0 / np.exp(logits - logits.max(-1, keepdims=True)).sum(-1)  # [n] draft's max probability
        out.append({"match": (logits.argmax(-1) == np.asarray(path)).tolist(), "conf": conf.tolist()})
    return out


def call_times(backend, vocab: int, widths, calls: int = 40, context: int = 100) -> dict[int, float]:
    """Median seconds of one call of each width at a fixed context, every call after a rewind."""
    rng = np.random.default_rng(0)
    backend.prefill(rng.integers(0, vocab, context))
    out = {}
    for k in widths:
        ts = []
        for _ in range(calls + 5):
            backend.rewind_to(context)
            ids = rng.integers(0, vocab, k)
            t0 = time.perf_counter()
            backend.extend(ids)
            ts.append(time.perf_counter() - t0)
        out[k] = statistics.median(ts[5:])
    return out


def replay(tr: list[dict], gamma_max: int, t_draft: float, t_target, policy=None, shared=False) -> float:
    """Tokens per modelled second over the whole trace under a policy (None: static gamma_max)."""
    tokens, seconds = 0, 0.0
    pol = policy() if policy is not None and shared else None
    for r in tr:
        match, conf = np.asarray(r["match"]), np.asarray(r["conf"])
        n, s = len(match), 1           # position 0 comes from the prefill
        tokens += 1
        p = pol if shared else (policy() if policy is not None else None)
        while s < n:
            cap = min(gamma_max, n - s - 1)
            if cap <= 0:
                seconds += t_target(1)
                tokens, s = tokens + 1, s + 1
                continue
            if p is not None:
                p.start_round()
            g = 0
            while g < cap:
                g += 1
                if p is not None and g < cap and not p.keep_going(g, conf[s + g - 1]):
                    break
            kept = 0
            while kept < g and match[s + kept]:
                kept += 1
            dt, tt = g * t_draft, t_target(g + 1)
            seconds += dt + tt
            if p is not None:
                p.update(conf[s: s + g], kept, dt, tt)
            tokens, s = tokens + kept + 1, s + kept + 1
    return tokens / seconds


class ThresholdPolicy:
    """Draft while the predicted probability that every draft so far is kept exceeds ``threshold``."""

    def __init__(self, keep_by_bin: np.ndarray, threshold: float):
        self.keep, self.threshold, self.prob = keep_by_bin, threshold, 1.0

    def start_round(self) -> None:
        self.prob = 1.0

    def keep_going(self, i: int, confidence: float) -> bool:
        self.prob *= self.keep[min(int(confidence * BINS), BINS - 1)]
        return self.prob > self.threshold

    def update(self, *args) -> None:
        pass


def oracle(tr: list[dict], cap: int, t_draft: float, t_target) -> float:
    tokens, seconds = 0, 0.0
    for r in tr:
        match, n, s = np.asarray(r["match"]), len(r["match"]), 1
        tokens += 1
        while s < n:
            kept = 0
            while kept < cap and s + kept < n - 1 and match[s + kept]:
                kept += 1
            seconds += kept * t_draft + t_target(kept + 1)
            tokens, s = tokens + kept + 1, s + kept + 1
    return tokens / seconds


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("bundle", type=Path)
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--new-tokens", type=int, default=200)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--max-gamma", type=int, default=8)
    args = ap.parse_args(argv)

    eng = load(args.bundle, threads=args.threads, spinning=False)
    vocab = eng.manifest.shared_vocab_size
    prompts = [eng.encode(p) for p in CODE_PROMPTS]
    print(f"[adaptive-bound] tracing {len(prompts)} prompts x {args.new_tokens} greedy tokens", file=sys.stderr)
    tr = trace(eng, prompts, args.new_tokens, vocab)
    print("[adaptive-bound] timing calls", file=sys.stderr)
    widths = list(range(1, 12))
    tt_meas = call_times(eng.target, vocab, widths)
    t_draft = call_times(eng.draft, vocab, [1])[1]
    ks = np.array(widths, dtype=float)
    slope, intercept = np.polyfit(ks, [tt_meas[k] for k in widths], 1)

    def t_target(k: int) -> float:  # the least-squares line over widths 1..11 (single medians are noisy)
        return intercept + slope * k

    plain = 1.0 / t_target(1)
    static = {g: replay(tr, g, t_draft, t_target) for g in range(1, 11)}
    best_g = max(static, key=static.get)
    adaptive = replay(tr, args.max_gamma, t_draft, t_target, policy=lambda: AdaptiveGamma(args.max_gamma))
    match = np.concatenate([r["match"] for r in tr])
    conf = np.concatenate([r["conf"] for r in tr])
    bins = np.minimum((conf * BINS).astype(int), BINS - 1)
    keep = np.array([match[bins == b].mean() if (bins == b).any() else match.mean() for b in range(BINS)])
    thresholds = []
    for th in np.arange(0.05, 0.95, 0.05):
        for cap in (4, 6, 8, 12):
            v = replay(tr, cap, t_draft, t_target, policy=lambda th=th: ThresholdPolicy(keep, th))
            thresholds.append((v, float(th), cap))
    bound, th_best, cap_best = max(thresholds)
    orc = {cap: oracle(tr, cap, t_draft, t_target) for cap in (4, 8, 16)}
    rows = [("static gamma " + str(g), v) for g, v in static.items()]
    rows += [(f"adaptive (online, max_gamma {args.max_gamma})", adaptive),
             (f"best threshold policy, in-sample calibration (threshold {th_best:.2f}, cap {cap_best})", bound)]
    rows += [(f"oracle (cap {c})", v) for c, v in orc.items()]
    lines = [f"Bundle {args.bundle}; {len(prompts)} prompts x {args.new_tokens} greedy tokens; {args.threads} thread(s); "
             f"t_draft {t_draft * 1e3:.3f} ms, t_target(1) {t_target(1) * 1e3:.2f} ms, +{slope * 1e3:.3f} ms per extra "
             f"verified token; greedy keep rate along the target's output {match.mean():.3f}.", "",
             "| policy | modelled tok/s | vs plain | vs best static gamma |", "|---|---|---|---|"]
    lines += [f"| {name} | {v:.0f} | {v / plain:.2f}x | {v / static[best_g]:.3f} |" for name, v in rows]
    lines += ["", "keep rate by draft-confidence bin: " + ", ".join(
        f"[{b / BINS:.1f},{(b + 1) / BINS:.1f}) {keep[b]:.2f} (n={int((bins == b).sum())})" for b in range(BINS))]
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "adaptive_bound.md").write_text("\n".join(lines) + "\n")
    write_json(args.out / "adaptive_bound.json", {
        "machine": machine_description(), "bundle": str(args.bundle), "threads": args.threads,
        "t_draft_s": t_draft, "t_target_s": {str(k): v for k, v in tt_meas.items()}, "plain_tok_s": plain,
        "policies": {name: v for name, v in rows}, "best_static_gamma": best_g, "keep_by_bin": keep.tolist(),
        "command": " ".join(sys.argv)})
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    sys.exit(main())
