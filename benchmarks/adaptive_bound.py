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
- edgespec's adaptive policy (`edgespec/adaptive.py`, learning online, as shipped), and the same
  policy with its keep table split by the run's recent keep rate (does the text's local "regime",
  which the run knows without the target's verdict on this round, say more than the confidence?);
- the best "draft while the predicted all-kept probability exceeds a threshold" policy, with the
  keep probability per confidence bin taken from the trace itself (in-sample: an upper bound for
  policies that see only the draft's confidence; optimal stopping for a ratio objective has this form);
- with ``--calibration N``: the same threshold policy with better predictors of a draft's fate, fitted
  (with the threshold and cap) on the target's greedy continuations of N held-out corpus prefixes and
  replayed on the prompts: confidence bins; a logistic regression on the draft's max probability, its
  margin over the runner-up and its entropy; the same plus per-token keep rates of the drafted and the
  previous token. Each is also given its best in-sample threshold (an upper bound for that predictor);
- an oracle that knows which drafts will be kept (drafts exactly the kept run; unreachable).
"""
from __future__ import annotations

import argparse
import collections
import statistics
import sys
import time
from pathlib import Path

import numpy as np

from edgespec import adaptive
from edgespec.adaptive import AdaptiveGamma
from edgespec.api import load
from edgespec.cli import at_least
from edgespec.outputs import check_report_folder
from edgespec.prompts import CODE_PROMPTS
from edgespec.report import machine_description, write_json

BINS = 10


def trace(engine, prompts: list[list[int]], new_tokens: int, vocab: int) -> list[dict]:
    """Per prompt: the target's greedy output and, per position, whether the draft's argmax matches it
    and what the draft knew when it proposed it (its max probability, runner-up, entropy, token ids)."""
    out = []
    for ids in prompts:
        path = engine.generate(ids, max_new_tokens=new_tokens, temperature=0, use_draft=False).ids
        d = engine.draft
        first = d.prefill(ids)[:vocab]                                       # [V] predicts path[0]
        rest = d.extend(path[:-1])[:, :vocab] if len(path) > 1 else np.zeros((0, vocab))
        logits = np.concatenate([first[None], rest]).astype(np.float64)     # [n, V]
        q = np.exp(logits - logits.max(-1, keepdims=True))
        q /= q.sum(-1, keepdims=True)                                        # [n, V] draft's distribution
        top2 = np.sort(q, -1)[:, -2:]                                        # [n, 2] runner-up, max
        out.append({"match": (logits.argmax(-1) == np.asarray(path)).tolist(), "conf": top2[:, 1].tolist(),
                    "second": top2[:, 0].tolist(), "entropy": (-(q * np.log(q + 1e-30)).sum(-1)).tolist(),
                    "token": logits.argmax(-1).tolist(), "prev": [int(ids[-1]), *map(int, path[:-1])]})
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


def replay(tr: list[dict], gamma_max: int, t_draft: float, t_target, policy=None, shared=False,
           signal: str = "conf") -> float:
    """Tokens per modelled second over the whole trace under a policy (None: static gamma_max).
    ``shared``: one policy for all prompts (as an Engine keeps one across calls); ``signal``: the
    per-position value the policy is shown (the draft's confidence, or a predicted keep probability)."""
    tokens, seconds = 0, 0.0
    pol = policy() if policy is not None and shared else None
    for r in tr:
        match, conf = np.asarray(r["match"]), np.asarray(r[signal])
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
    """Draft while the predicted probability that every draft so far is kept exceeds ``threshold``.
    ``keep_by_bin``: keep rate per confidence bin; None: the signal already is a keep probability."""

    def __init__(self, keep_by_bin: np.ndarray | None, threshold: float):
        self.keep, self.threshold, self.prob = keep_by_bin, threshold, 1.0

    def start_round(self) -> None:
        self.prob = 1.0

    def keep_going(self, i: int, signal: float) -> bool:
        self.prob *= signal if self.keep is None else self.keep[min(int(signal * BINS), BINS - 1)]
        return self.prob > self.threshold

    def update(self, *args) -> None:
        pass


class RegimeAdaptive(AdaptiveGamma):
    """The shipped policy with one keep-rate table per regime: the keep rate of the last ``window``
    drafts the target examined, below or at/above ``split``. Everything it uses is known before the
    round is verified (past rounds only), so it is a policy the engine could run."""

    def __init__(self, max_gamma: int, window: int = 16, split: float = 0.8):
        super().__init__(max_gamma)
        self._split = split
        self._recent = collections.deque(maxlen=window)             # [<= window] 1.0 kept / 0.0 rejected
        self._kept_r = np.zeros((2, adaptive._BINS))               # [regime, bins] decayed counts
        self._seen_r = np.zeros((2, adaptive._BINS))               # [regime, bins]
        self._regime = 1
        self._regimes: collections.deque = collections.deque()      # regimes of the rounds not learned yet

    def _keep_prob(self, confidence: float) -> float:
        # as the shipped policy's bins: shrunk towards the mean keep rate (adaptive._SHRINK)
        b = min(int(confidence * adaptive._BINS), adaptive._BINS - 1)
        return float((self._kept_r[self._regime, b] + adaptive._SHRINK * self._mean_keep)
                     / (self._seen_r[self._regime, b] + adaptive._SHRINK))

    def start_round(self):
        keep_going = super().start_round()
        self._regime = int(not self._recent or np.mean(self._recent) >= self._split)
        return keep_going

    def update(self, confidences: np.ndarray, n_accepted: int, draft_s: float, target_s: float,
               keep: np.ndarray | None = None) -> None:
        self._regimes.append(self._regime)                          # the round's regime, for _learn
        super().update(confidences, n_accepted, draft_s, target_s, keep)

    def _learn(self, conf: list[float], keep: list[float], *timings) -> None:
        # Its own table learns when the shipped one does (rounds in batches, adaptive._BATCH) and
        # counts the drawn outcome: the replay is greedy, where keep is that outcome (1 or 0).
        regime = self._regimes.popleft()
        self._kept_r *= adaptive._FORGET
        self._seen_r *= adaptive._FORGET
        for c, k in zip(conf, keep):                                # the drafts the target examined
            b = min(int(c * adaptive._BINS), adaptive._BINS - 1)
            self._seen_r[regime, b] += 1.0
            self._kept_r[regime, b] += k
            self._recent.append(k)
            if not k:
                break
        super()._learn(conf, keep, *timings)


# --------------------------------------------------------------------------- better predictors
# Can a policy that sees only the draft do much better than confidence bins? Fit richer predictors
# of "this draft is kept" on one set of greedy continuations and replay them on another.

def calibration_prompts(engine, n: int, length: int = 64, seed: int = 0) -> list[list[int]]:
    """n prefixes of ``length`` tokens at random places in the held-out part of the corpus."""
    from edgespec.corpus import load_corpus

    _, held, _ = load_corpus()
    ids = engine.encode(held)
    if len(ids) < 2 * length:
        raise SystemExit(f"[adaptive-bound] the held-out corpus has only {len(ids)} tokens; lower --calibration")
    starts = np.random.default_rng(seed).choice(len(ids) - length, n, replace=n > len(ids) - length)
    return [ids[s:s + length] for s in starts]


def _cat(tr: list[dict], key: str) -> np.ndarray:
    return np.concatenate([np.asarray(r[key]) for r in tr])


def token_rates(tr: list[dict], key: str, vocab: int, prior: float = 5.0) -> np.ndarray:
    """[vocab] keep rate of drafts by the token id in ``key``, shrunk towards the mean by ``prior`` pseudo-counts."""
    ids, y = _cat(tr, key).astype(int), _cat(tr, "match").astype(float)
    return (np.bincount(ids, y, vocab) + prior * y.mean()) / (np.bincount(ids, None, vocab) + prior)


def features(tr: list[dict], rates: tuple[np.ndarray, np.ndarray] | None = None) -> np.ndarray:
    """[n, f] log max prob, log margin over the runner-up, entropy, max prob and its square (+ token keep rates), 1."""
    conf, second = _cat(tr, "conf"), _cat(tr, "second")
    cols = [np.log(conf), np.log(conf - second + 1e-9), _cat(tr, "entropy"), conf, conf ** 2]
    if rates is not None:
        cols += [rates[0][_cat(tr, "token").astype(int)], rates[1][_cat(tr, "prev").astype(int)]]
    return np.stack(cols + [np.ones_like(conf)], 1)


def fit_logistic(x: np.ndarray, y: np.ndarray, l2: float = 1e-3, iters: int = 30):
    """Logistic regression by Newton's method on standardised columns; returns x -> P(kept)."""
    mu, sd = x.mean(0), x.std(0) + 1e-9
    mu[-1], sd[-1] = 0.0, 1.0                            # the constant column stays 1
    z = (x - mu) / sd                                     # [n, f]
    w = np.zeros(x.shape[1])                              # [f]
    for _ in range(iters):
        pr = 1.0 / (1.0 + np.exp(-z @ w))                 # [n]
        hess = (z * (pr * (1 - pr))[:, None]).T @ z + l2 * np.eye(len(w))
        w -= np.linalg.solve(hess, z.T @ (pr - y) + l2 * w)
    return lambda xn: 1.0 / (1.0 + np.exp(-((xn - mu) / sd) @ w))


def auc(score: np.ndarray, y: np.ndarray) -> float:
    """Probability that a kept draft scores above a rejected one (ties count half)."""
    from scipy.stats import rankdata

    r, n1 = rankdata(score), int(y.sum())
    n0 = len(y) - n1
    return float((r[y].sum() - n1 * (n1 + 1) / 2) / (n1 * n0)) if n1 and n0 else float("nan")


def _set_signal(tr: list[dict], name: str, probs: np.ndarray) -> None:
    i = 0
    for r in tr:
        n = len(r["match"])
        r[name], i = probs[i:i + n].tolist(), i + n


def _best_threshold(tr, t_draft, t_target, signal, keep=None) -> tuple[float, float, int]:
    grid = [(replay(tr, cap, t_draft, t_target, policy=lambda th=th: ThresholdPolicy(keep, th), signal=signal),
             float(th), cap) for th in np.arange(0.05, 0.95, 0.05) for cap in (4, 6, 8, 12, 16)]
    return max(grid)


def predictor_rows(cal: list[dict], test: list[dict], vocab: int, t_draft, t_target) -> list[tuple[str, float, float]]:
    """(name, modelled tok/s on ``test`` with the threshold and cap chosen on ``cal``, best in-sample tok/s)."""
    y_cal, y_test = _cat(cal, "match").astype(bool), _cat(test, "match").astype(bool)
    rates = (token_rates(cal, "token", vocab), token_rates(cal, "prev", vocab))
    bins_cal = np.minimum((_cat(cal, "conf") * BINS).astype(int), BINS - 1)
    keep = np.array([y_cal[bins_cal == b].mean() if (bins_cal == b).any() else y_cal.mean() for b in range(BINS)])
    preds = {"confidence bins": lambda tr: keep[np.minimum((_cat(tr, "conf") * BINS).astype(int), BINS - 1)]}
    lr = fit_logistic(features(cal), y_cal.astype(float))
    preds["logistic: max prob, margin, entropy"] = lambda tr: lr(features(tr))
    lr_tok = fit_logistic(features(cal, rates), y_cal.astype(float))
    preds["logistic + drafted/previous token keep rates"] = lambda tr: lr_tok(features(tr, rates))
    rows = []
    for name, pred in preds.items():
        for tr in (cal, test):
            _set_signal(tr, "signal", pred(tr))
        _, th, cap = _best_threshold(cal, t_draft, t_target, "signal")
        held_out = replay(test, cap, t_draft, t_target, policy=lambda: ThresholdPolicy(None, th), signal="signal")
        in_sample = _best_threshold(test, t_draft, t_target, "signal")[0]
        rows.append((f"{name} (AUC {auc(_cat(test, 'signal'), y_test):.3f}; threshold {th:.2f}, cap {cap})",
                     held_out, in_sample))
    return rows


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
    ap.add_argument("--new-tokens", type=at_least(2), default=200, help="greedy tokens traced per prompt (default 200)")
    ap.add_argument("--threads", type=at_least(0), default=1, help="target intra-op threads (default 1)")
    ap.add_argument("--max-gamma", type=at_least(1), default=8,
                    help="the adaptive rows' bound (default 8; the static rows run gamma 1-10)")
    ap.add_argument("--calibration", type=at_least(0), default=0,
                    help="also fit richer keep predictors on the target's continuations of this many held-out "
                         "corpus prefixes and replay them on the prompts (0: skip)")
    args = ap.parse_args(argv)
    if args.out is not None:  # before the measurement, not after it
        check_report_folder(args.out)

    eng = load(args.bundle, threads=args.threads, spinning=False)
    vocab = eng.vocab_size
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
    # one policy across prompts, as an Engine keeps one across calls with the same settings
    shipped = {cap: replay(tr, cap, t_draft, t_target, policy=lambda cap=cap: AdaptiveGamma(cap), shared=True)
                for cap in sorted({args.max_gamma, 16})}
    regime = {cap: replay(tr, cap, t_draft, t_target, policy=lambda cap=cap: RegimeAdaptive(cap), shared=True)
              for cap in sorted({args.max_gamma, 16})}
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
    rows += [(f"adaptive (online, max_gamma {cap})", v) for cap, v in shipped.items()]
    rows += [(f"adaptive, keep table split by the last 16 drafts' keep rate (online, max_gamma {cap})", v)
             for cap, v in regime.items()]
    rows += [(f"best threshold policy, in-sample calibration (threshold {th_best:.2f}, cap {cap_best})", bound)]
    prefix = 0
    if args.calibration:
        print(f"[adaptive-bound] tracing {args.calibration} held-out corpus prefixes", file=sys.stderr)
        prefix = max(8, min(64, eng.target.max_length + 1 - args.new_tokens))  # prefix + continuation fit the positions
        cal = trace(eng, calibration_prompts(eng, args.calibration, prefix), args.new_tokens, vocab)
        for name, held_out, in_sample in predictor_rows(cal, tr, vocab, t_draft, t_target):
            rows += [(f"threshold policy, {name}, fitted on held-out text", held_out),
                     (f"  {name.split(' (AUC')[0]}, best in-sample threshold", in_sample)]  # unique: JSON keys
    rows += [(f"oracle (cap {c})", v) for c, v in orc.items()]
    lines = [f"Bundle {args.bundle}; {len(prompts)} prompts x {args.new_tokens} greedy tokens; {args.threads} thread(s); "
             f"t_draft {t_draft * 1e3:.3f} ms, t_target(1) {t_target(1) * 1e3:.2f} ms, +{slope * 1e3:.3f} ms per extra "
             f"verified token; greedy keep rate along the target's output {match.mean():.3f}."
             + (f" Predictors fitted on the target's greedy continuations ({args.new_tokens} tokens) of {args.calibration} "
                f"{prefix}-token prefixes of held-out corpus text." if args.calibration else ""), "",
             "| policy | modelled tok/s | vs plain | vs best static gamma |", "|---|---|---|---|"]
    lines += [f"| {name} | {v:.0f} | {v / plain:.2f}x | {v / static[best_g]:.3f} |" for name, v in rows]
    lines += ["", "keep rate by draft-confidence bin: " + ", ".join(
        f"[{b / BINS:.1f},{(b + 1) / BINS:.1f}) " + (f"{keep[b]:.2f}" if (bins == b).any() else "n/a")  # (keep: prior)
        + f" (n={int((bins == b).sum())})" for b in range(BINS))]
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "adaptive_bound.md").write_text("\n".join(lines) + "\n")
    write_json(args.out / "adaptive_bound.json", {
        "machine": machine_description(), "bundle": str(args.bundle), "threads": args.threads,
        "t_draft_s": t_draft, "t_target_s": {str(k): v for k, v in tt_meas.items()}, "plain_tok_s": plain,
        "policies": {name: v for name, v in rows}, "best_static_gamma": best_g,
        "calibration_prefixes": args.calibration, "calibration_prefix_tokens": prefix, "keep_by_bin": keep.tolist(),
        "command": " ".join(sys.argv)})
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    from edgespec.cli import run_script

    sys.exit(run_script(main, "adaptive_bound.py"))
