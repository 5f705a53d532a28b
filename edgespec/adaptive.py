"""Adaptive draft length: choose gamma each round to maximise expected tokens per second.

The paper fixes gamma per run and notes that choosing it per step from a predicted beta could
add up to ~60% (section 3.5). We predict, online, the probability that the i-th draft is kept
from the draft's own confidence in it (the probability it gave the drafted token), and stop
drafting when one more draft token is expected to lower the round's rate

    rate(i) = E[tokens | verify i drafts] / (i * t_draft + t_target(i + 1)),
    E[tokens | i] = 1 + sum_{j <= i} prod_{m <= j} a_m        (a_m: predicted keep probability).

Adding draft i + 1 raises the rate iff its marginal gain over marginal cost beats the current
rate (a ratio of sums). The decision uses only the draft's information and past rounds, never
the target's verdict on this round, so exactness is untouched (Appendix A.1 holds for any gamma
fixed before the target is consulted).
"""
from __future__ import annotations

import numpy as np

_BINS = 10
_FORGET = 0.995   # per-round decay of the acceptance counts: follows drifting text
_EWMA = 0.2
_FORGET_TIME = 0.98  # per-round decay of the target-time fit


class _LinearTime:
    """t_target(k) = a + b k, a least-squares fit over past rounds with exponential forgetting.

    A verify call of k tokens reads the weights once (the a part, memory bound) and does k times
    the arithmetic (the b part, compute bound); on a CPU b is far from 0 (one extra token in a
    call cost about 10% of a 1-token step on the benchmark target), so unmeasured widths must be
    extrapolated from the measured ones, not taken as equal to the nearest one."""

    def __init__(self):
        self._s = np.zeros(5)  # [5] sums of 1, k, k^2, t, k t

    def add(self, k: int, t: float) -> None:
        self._s *= _FORGET_TIME
        self._s += (1.0, k, k * k, t, k * t)

    def __call__(self, k: int) -> float:
        n, sk, skk, st, skt = self._s
        if n == 0:
            return 1.0
        var = n * skk - sk * sk
        if var <= 1e-9 * n * n:  # one width seen so far: no slope yet
            return st / n
        b = max(0.0, (n * skt - sk * st) / var)
        return max(1e-9, (st - b * sk) / n + b * k)


class AdaptiveGamma:
    def __init__(self, max_gamma: int):
        self.max_gamma = max_gamma
        self._kept = np.full(_BINS, 1.0)     # [bins] Beta(1, 1) prior on each bin's keep rate
        self._seen = np.full(_BINS, 2.0)     # [bins]
        self._t_draft: float | None = None   # seconds per draft call
        self._target_time = _LinearTime()     # verify width k -> seconds per target call
        self._prob = 1.0
        self._expected = 1.0

    # ---------------------------------------------------------------- predictions
    def _keep_prob(self, confidence: float) -> float:
        b = min(int(confidence * _BINS), _BINS - 1)
        return float(self._kept[b] / self._seen[b])

    # ---------------------------------------------------------------- per round
    def start_round(self) -> None:
        self._prob, self._expected = 1.0, 1.0

    def keep_going(self, i: int, confidence: float) -> bool:
        """After drafting token i with the given confidence: draft token i + 1?"""
        a = self._keep_prob(confidence)
        self._prob *= a
        self._expected += self._prob
        if self._t_draft is None:          # nothing measured yet: explore the full length
            return True
        mean_keep = float(self._kept.sum() / self._seen.sum())
        gain = self._prob * mean_keep       # expected extra tokens from draft i + 1
        cost = self._t_draft + max(0.0, self._target_time(i + 2) - self._target_time(i + 1))
        spent = i * self._t_draft + self._target_time(i + 1)
        return gain * spent > self._expected * cost

    def update(self, confidences: np.ndarray, n_accepted: int, draft_s: float, target_s: float) -> None:
        """Learn from a finished round: which drafts were examined and kept, and the timings."""
        g = confidences.shape[0]
        self._kept *= _FORGET
        self._seen *= _FORGET
        for j in range(min(n_accepted + 1, g)):   # drafts after the first rejection were not examined
            b = min(int(confidences[j] * _BINS), _BINS - 1)
            self._seen[b] += 1.0
            self._kept[b] += float(j < n_accepted)
        if g:
            per_call = draft_s / g
            self._t_draft = per_call if self._t_draft is None else (1 - _EWMA) * self._t_draft + _EWMA * per_call
        self._target_time.add(g + 1, target_s)
