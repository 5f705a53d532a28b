"""How well does the draft's own view predict whether its token is kept, at a temperature > 0?

    python benchmarks/acceptance_signals.py BUNDLE --out benchmarks/results/<tag>/acceptance-signals

An adaptive draft length (issue 8) can only gain over a fixed gamma by drafting more where the
next token is likely kept and less where it is not, and it must decide from the draft's side.
Along the target's own sampled continuations of the code prompts, at each position we draw
x ~ q (several draws) and record the exact keep probability a(x) = min(1, p(x) / q(x))
(section 2.3; its mean over x is beta = sum_x min(p, q)), together with three signals the draft has
when it decides: q(x), max q and the entropy of q. Each signal's predictive power is the R^2 of
a binned predictor (the mean a(x) per decile of the signal): the share of the variance of a(x) it
explains. At temperature 0 the same question is answered exactly by `adaptive_bound.py`.
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

import numpy as np

from edgespec.api import load
from edgespec.cli import at_least
from edgespec.outputs import check_report_folder
from edgespec.prompts import CODE_PROMPTS
from edgespec.config import SamplingConfig
from edgespec.report import machine_description, write_json
from edgespec.sampling import process_logits

BINS = 10


def binned_r2(a: np.ndarray, signal: np.ndarray, bins: int = BINS) -> tuple[float, list[float]]:
    """R^2 of predicting a [n] by its mean within quantile bins of signal [n]; and those means."""
    edges = np.quantile(signal, np.linspace(0, 1, bins + 1))                 # [bins + 1]
    b = np.clip(np.searchsorted(edges, signal, side="right") - 1, 0, bins - 1)  # [n]
    means = np.array([a[b == j].mean() if (b == j).any() else a.mean() for j in range(bins)])  # [bins]
    return float(1.0 - ((a - means[b]) ** 2).mean() / a.var()), means.tolist()


def collect(engine, prompts, new_tokens: int, temperature: float, draws: int, seed: int) -> dict[str, np.ndarray]:
    vocab = engine.vocab_size
    cfg = SamplingConfig(temperature)
    rng = np.random.default_rng(seed)
    rows: dict[str, list] = {"a": [], "q_x": [], "max_q": [], "entropy_q": []}
    for k, ids in enumerate(prompts):
        path = engine.generate(ids, max_new_tokens=new_tokens, temperature=temperature, seed=seed + k,
                               use_draft=False).ids
        t, d = engine.target, engine.draft
        # p and q at every position of the path, both conditioned on the same prefix
        p = process_logits(np.concatenate([t.prefill(ids)[None, :vocab], t.extend(path[:-1])[:, :vocab]]), cfg)  # [n, V]
        q = process_logits(np.concatenate([d.prefill(ids)[None, :vocab], d.extend(path[:-1])[:, :vocab]]), cfg)  # [n, V]
        ent = -(q * np.log(np.where(q > 0, q, 1.0))).sum(-1)                 # [n]
        for i in range(len(path)):
            xs = rng.choice(vocab, size=draws, p=q[i])                        # [draws]
            rows["a"] += np.minimum(1.0, p[i, xs] / q[i, xs]).tolist()
            rows["q_x"] += q[i, xs].tolist()
            rows["max_q"] += [float(q[i].max())] * draws
            rows["entropy_q"] += [float(ent[i])] * draws
    return {k: np.asarray(v) for k, v in rows.items()}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("bundle", type=Path)
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--temperature", type=float, default=1.0)
    ap.add_argument("--new-tokens", type=at_least(2), default=200, help="tokens sampled per prompt (default 200)")
    ap.add_argument("--draws", type=at_least(1), default=4, help="draws of x ~ q per position")
    ap.add_argument("--seed", type=at_least(0), default=0)
    args = ap.parse_args(argv)
    if args.out is not None:  # before the measurement, not after it
        check_report_folder(args.out)
    if args.temperature <= 0:
        ap.error("--temperature must be > 0 (at 0 use benchmarks/adaptive_bound.py, which is exact)")

    eng = load(args.bundle, threads=1, spinning=False)  # errors: run_script prints them
    if eng.draft is None:
        print(f"acceptance_signals: {args.bundle} has no draft model; export one with `edgespec export --draft`",
              file=sys.stderr)
        return 2
    prompts = [eng.encode(p) for p in CODE_PROMPTS]
    print(f"[acceptance-signals] {len(prompts)} prompts x {args.new_tokens} tokens at T={args.temperature:g}",
          file=sys.stderr)
    data = collect(eng, prompts, args.new_tokens, args.temperature, args.draws, args.seed)
    a = data["a"]
    signals = {name: binned_r2(a, data[name]) for name in ("q_x", "max_q", "entropy_q")}
    lines = [f"Bundle {args.bundle}; {len(prompts)} prompts x {args.new_tokens} tokens of the target's own output at "
             f"T={args.temperature:g}, {args.draws} draws of x ~ q per position ({a.size} samples); mean keep "
             f"probability {a.mean():.3f}.", "",
             "| signal | R^2 of a(x) by decile | mean a(x) per decile, lowest to highest signal |", "|---|---|---|"]
    lines += [f"| {name} | {r2:.3f} | {', '.join(f'{m:.2f}' for m in means)} |" for name, (r2, means) in signals.items()]
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "acceptance_signals.md").write_text("\n".join(lines) + "\n")
    write_json(args.out / "acceptance_signals.json", {
        "machine": machine_description(), "bundle": str(args.bundle), "temperature": args.temperature,
        "samples": int(a.size), "mean_keep": float(a.mean()),
        "signals": {name: {"r2": r2, "decile_means": means} for name, (r2, means) in signals.items()},
        "command": " ".join(sys.argv)})
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    from edgespec.cli import run_script

    sys.exit(run_script(main, "acceptance_signals.py"))
