"""Adaptive draft length: choose gamma each round to maximise expected tokens per second.

The paper fixes gamma per run and notes that choosing it per step from a predicted beta could
add up to ~60% (section 3.5). We predict, online, the probability that the i-th draft is kept
from the draft's own confidence in it (the probability it gave the drafted token), and stop
drafting when no longer round is expected to beat the round's rate so far

    rate(i) = E[tokens | verify i drafts] / (t_draft(i) + t_target(i + 1)),
    E[tokens | i] = 1 + sum_{j <= i} prod_{m <= j} a_m        (a_m: predicted keep probability),

the drafts not drawn yet predicted at the mean keep rate (their confidences are unknown). Whether
to draft token i + 1 is decided before it is drawn, from the
draft's information up to token i and past rounds, never the target's verdict on this round, so
exactness is untouched: each drafted position is an ordinary step of speculative sampling
(Appendix A.1). Deciding after the draw (dropping a draft for its own low confidence) would not be.
Where the confidence costs more to compute than it is worth (a softmax at greedy, next to a small
target), rounds go without it: a_m is then the mean keep rate (see _CONF_WORTH).

Theorem 3.8's objective includes gamma = 0. Before each round the policy compares the rate its
drafted rounds achieved (tokens committed over the seconds they took, recent rounds) with a plain
target step's (one token per step) and takes plain steps where those are faster: a small model
whose weights stay in cache verifies k tokens for nearly k times the cost of one, and a draft the
target rarely agrees with wastes its rounds. A plain step is plain decoding, so this too is exact.
"""
from __future__ import annotations

import math
from typing import Callable

import numpy as np

_BINS = 10
_FORGET = 0.995   # per-round decay of the acceptance counts: follows drifting text
# A fresh policy knows nothing of the pair. Its mean keep rate starts from _PRIOR_SEEN drafts at
# 0.5, and each confidence bin's rate is its own counts shrunk towards that mean by _SHRINK drafts'
# worth. Each bin used to start from Beta(1, 1) on its own (two drafts at 0.5 per bin, twenty in the
# mean): over its first 96 tokens a fresh policy then drafted 3.6-3.7 tokens a round where 5 was
# best, and a call with a policy of its own (a seeded sampled call, the first calls of an engine)
# ran at 0.80 of static gamma 5 at T=0 and 0.85-0.86 at T=1 on the quick pair; 0.875 and 0.870
# with this prior (benchmarks/README, "Session 31"; see _WARM_LENGTH for what came after).
_PRIOR_SEEN = 2.0
_SHRINK = 2.0
_FORGET_TIME = 0.98  # per-round decay of the time fits (draft and target)
# A call that stalls (the host ran something else: a time slice is milliseconds, a quick-pair verify
# call 0.7 ms) enters the time fits as at most _CLIP times what they predicted, once they have
# _CLIP_AFTER measurements. Taken whole, a stall made the widths it landed in look dear for the ~50
# rounds the fits remember, and the policy drafted shorter than its best length. A host that gets
# slower for good still moves the fits (by up to _CLIP times a round), and what the policy compares
# drafting with plain steps on is not clipped. On the quick pair with 4 ms stalls injected at 20 per
# second of model time (benchmarks/policy_ab.py --stalls 20, against the unclipped policy): 1.040 at
# T=1, 1.020 at T=0 (IQRs 0.97-1.06); on a quiet host 1.004 and 0.998.
_CLIP = 2.0
_CLIP_AFTER = 5.0
# The first calls of a new session are slow (allocation, cold caches: on the quick pair a first
# 9-token verify took 2.8 ms, a warm one ~1.5). Timed, such a round makes extra tokens look dear,
# the policy then drafts 1 token and never measures a longer round again. So the first rounds are
# not timed. They draft _WARM_LENGTH tokens, a middle length: with nothing learned yet, the full
# length (max_gamma, 8 by default) spent its drafts where the first tokens of a text are often
# rejected (quick pair, a new policy for every 96-token call: 0 of 8 kept in a first round at
# greedy). The first timed round then sees one width, prices extra drafts at their draft time only
# and drafts longer, so longer widths are still measured.
_UNTIMED_ROUNDS = 2
_WARM_LENGTH = 4
_SPEC_FORGET = 0.95   # per drafted round: the decay of its (tokens, seconds) sums (about the last 20 rounds)
_PLAIN_FORGET = 0.9   # per plain step: the decay of the plain step time's sums (about the last 10 steps)
# A plain step's time is measured by a probe: _PROBE timed plain steps (after the _COLD_PLAIN cold
# ones), once after the first drafted rounds, then again every _REMEASURE rounds while drafting wins
# by less than _CLEAR_WIN (a clear win needs no new check). It is not estimated from the verify
# calls: on the quick pair (verify calls of 3, 4, 5 tokens at 1.75, 1.99, 2.15 plain steps) the line
# through them reaches 1.36 at one token, 36% above a plain step, and the policy then drafted where
# plain steps were faster. Only where that line says drafting wins
# by _SURE_WIN or more (well beyond that 36%) is the first probe skipped: its 10 plain steps cost a
# short call on the bench pair, where drafting is 2-2.5x faster (64-token calls, a policy each: 1.13x
# faster without it). Where the line says drafting wins by _CLEAR_WIN or more, the first probe waits
# for _FIRST_PROBE timed rounds instead of _MIN_EVIDENCE: on the quick pair (2-core Xeon) the line's
# ratio after 8 rounds was 1.3-1.5 on 5 of 8 prompts at T=1, drafting won by 1.45-1.7x, and the
# probe cost a 96-token call 3-5%. Drafting that wins by the line's 1.25 and still loses (the 36%
# above) runs at 0.92x plain steps or better until the probe, 24 rounds later. While plain steps
# are faster, a round is drafted anyway after _EXPLORE plain steps, so that a change (text that
# gets easier, a host that gets busier) is seen: a trial of up to _TRIAL timed rounds (after the
# cold first one), ended by the first point where the trial's rounds
# together lose to plain steps (then the wait doubles, up to _EXPLORE_MAX); a trial whose rounds all
# win together replaces what the policy knew of drafted rounds (the text changed), and drafting
# resumes. One round decides little at T > 0: where drafting ran at 0.67-0.72x of plain steps on the
# quick pair (T=1), 26-29% of single rounds still beat a plain step.
_CLEAR_WIN = 1.25
_SURE_WIN = 1.6
_MIN_EVIDENCE = 8      # timed drafted rounds before plain steps are considered (one round says little)
_FIRST_PROBE = 32
_REMEASURE = 64
_EXPLORE, _EXPLORE_MAX = 16, 128
_TRIAL = 4
# The draft's confidence costs a softmax over the vocabulary at greedy (at T > 0 it is a lookup in q):
# ~10 us a draft in the loop on a CPU (2048 ids, numpy cold after each model call), 4-5% of the quick
# pair's tokens/s at gamma 5 (benchmarks/policy_overhead.py). What it buys, stopping a round at a
# draft the draft doubts: this policy replayed at 1.016-1.023x the best static gamma on exact greedy
# traces of the bench pair, and no rule on the confidence above 1.031x held out
# (benchmarks/adaptive_bound.py). So where it costs more than _CONF_WORTH of a round's time, the
# drafter is told not to compute it and the round treats every draft as one of unknown confidence
# (the mean keep rate); one round in _CONF_SAMPLE still computes it, which keeps its cost measured
# and the per-bin keep rates learning. A seeded run (fixed costs) always computes it.
_CONF_WORTH = 0.02
_CONF_SAMPLE = 16
_COLD_PLAIN = 6        # plain steps after a drafted round that are not timed (see AdaptiveGamma._last)
# The policy learns from drafted rounds _BATCH at a time once it has settled (past its warm-up,
# not in a trial or a probe, not just back from plain steps). Its work comes right after a model
# call, when the caches hold the model's data instead of the policy's: there, in the loop, the
# same work cost ~3x what it costs in a tight loop (T=1 on the quick pair: learning from a round
# 24 us, pricing a round 9 us, its stop test 5 us a draft; with static gamma 4 the policy's work
# was 4.4% of the rounds' time). Learned in a batch, the first round pays for the cold caches and
# the others run warm; pricing happens once per batch. About 1% faster there (benchmarks/policy_ab.py
# --work, both sides decoding the same tokens). The fits forget over ~20-200 rounds, so rounds
# priced on what was learned up to _BATCH - 1 rounds before decide as well; their choices still use
# past rounds only, never the target's verdict on the round being drafted (exactness, see above).
_BATCH = 8
_PROBE = 4             # timed plain steps of a probe


class _LinearTime:
    """t(k) = a + b k, a least-squares fit over past rounds with exponential forgetting.

    Target: a verify call of k tokens reads the weights once (the a part, memory bound) and does k
    times the arithmetic (the b part, compute bound); on a CPU b is far from 0 (one extra token in a
    call cost about 10% of a 1-token step on the benchmark target), so unmeasured widths must be
    extrapolated from the measured ones, not taken as equal to the nearest one.
    Draft: drafting k tokens costs k calls (b) plus a per-round part (a: the first call may feed two
    unseen tokens, buffers are set up). Dividing the round's time by k instead charges that fixed
    part to every draft and biases the policy towards short drafts, which then look even dearer.
    ``proportional``: until two widths are seen, t(k) = k * mean time per unit (a draft call costs
    something); otherwise the mean of what was seen (one verify width says nothing about others)."""

    def __init__(self, proportional: bool = False):
        self._s = (0.0, 0.0, 0.0, 0.0, 0.0)  # sums of 1, k, k^2, t, k t
        self._proportional = proportional

    def add(self, k: int, t: float) -> None:
        if self._s[0] >= _CLIP_AFTER:   # a stall (see _CLIP) counts as _CLIP times the prediction at most
            t = min(t, _CLIP * self.predicted(k))
        self._record(k, t)

    def predicted(self, k: int) -> float:
        return self(k)

    def _record(self, k: int, t: float) -> None:
        f = _FORGET_TIME
        n, sk, skk, st, skt = self._s
        self._s = (n * f + 1.0, sk * f + k, skk * f + k * k, st * f + t, skt * f + k * t)

    def line(self) -> tuple[float, float]:
        """(a, b) of the current fit; t(k) = max(1e-9, a + b k)."""
        n, sk, skk, st, skt = self._s
        if n == 0:
            return 1.0, 0.0
        var = n * skk - sk * sk
        if var <= 1e-9 * n * n:  # one width seen so far: no slope yet
            return (0.0, st / sk) if self._proportional else (st / n, 0.0)
        b = max(0.0, (n * skt - sk * st) / var)
        return (st - b * sk) / n, b

    def __call__(self, k: int) -> float:
        a, b = self.line()
        return max(1e-9, a + b * k)


class _WidthTime(_LinearTime):
    """Verify time per width: the mean of what that width measured (decayed like the line), the
    linear fit where a width has too few measurements.

    A CPU's cost is not linear in the width: GEMM kernels work on row blocks, so one more token can
    cost nothing or a whole block (measured on the bench target, 1 thread: 8.78 ms for 6 tokens,
    9.81 for 7, 9.63 for 8). The line alone would price every width alike and make the policy draft
    into the expensive steps."""

    _MIN_SEEN = 3.0

    def __init__(self, max_width: int):
        super().__init__()
        self._n = [0.0] * (max_width + 1)   # [widths] decayed counts
        self._t = [0.0] * (max_width + 1)   # [widths] decayed sums of seconds

    def predicted(self, k: int) -> float:
        if k < len(self._n) and self._n[k] >= self._MIN_SEEN:
            return self._t[k] / self._n[k]
        return self(k)

    def _record(self, k: int, t: float) -> None:
        super()._record(k, t)
        f = _FORGET_TIME
        self._n = [x * f for x in self._n]
        self._t = [x * f for x in self._t]
        if k < len(self._n):
            self._n[k] += 1.0
            self._t[k] += t

    def table(self) -> list[float]:
        """Predicted seconds of a verify call of each width 0..max_width."""
        a, b = self.line()
        return [t / n if n >= self._MIN_SEEN else max(1e-9, a + b * k)
                for k, (n, t) in enumerate(zip(self._n, self._t))]


def _rule(keep_going: Callable[[int, float], bool], needs_confidence: bool,
          ahead: Callable[[], Callable[[int, float], bool]]) -> Callable[[int, float], bool]:
    def rule(i: int, confidence: float) -> bool:
        return keep_going(i, confidence)
    rule.needs_confidence = needs_confidence  # type: ignore[attr-defined]
    rule.ahead = ahead                        # type: ignore[attr-defined]
    return rule


class AdaptiveGamma:
    """``fixed_costs=(c, s)``: price a draft step at c target steps and a verify call of k tokens at
    1 + s (k - 1) steps instead of measuring them. The decisions then depend only on the run's own
    tokens and the models' probabilities for them, so a seeded sampled run is reproducible (measured
    times differ from run to run, and with them the draft lengths, which change which uniforms decide
    which token)."""

    def __init__(self, max_gamma: int, fixed_costs: tuple[float, float] | None = None):
        self.max_gamma = max_gamma
        self._fixed = fixed_costs
        self._untimed = 0 if fixed_costs is not None else _UNTIMED_ROUNDS  # fixed costs: nothing to warm up
        # Plain Python floats and lists here, not numpy: the policy runs a few dozen small steps
        # per round, and numpy's per-call cost, cold after each model call, made them ~100 us a
        # round, 10% of a round on the quick pair.
        self._kept = [0.0] * _BINS           # [bins] decayed counts of kept drafts (expected, see update)
        self._seen = [0.0] * _BINS           # [bins] and of examined ones
        self._all = [0.5 * _PRIOR_SEEN, _PRIOR_SEEN]  # (kept, seen) of every draft, its confidence known or not
        self._conf = [0.0, 0.0]       # decayed (seconds computing confidences, seconds) of timed rounds that did
        self._with_conf = True        # this round's drafter computes confidences
        self._blind = 0               # rounds since one did
        self._rounds = 0
        self._draft_time = _LinearTime(proportional=True)  # drafts k -> seconds drafting a round
        self._target_time = _WidthTime(max_gamma + 2)       # verify width k -> seconds per target call
        self._prob = 1.0
        self._expected = 1.0
        self._spec = [0.0, 0.0]       # decayed (tokens, seconds) of timed drafted rounds
        self._plain = [0.0, 0.0]      # decayed (steps, seconds) of plain steps
        self._since_plain = 0         # drafted rounds since a plain step was timed
        self._probe = 0               # timed plain steps still to take for a probe
        self._plain_run = 0           # plain steps taken since the last drafted round
        self._explore = _EXPLORE      # plain steps before the next drafted round, while plain steps win
        self._exploring = False       # drafting a trial: plain steps were faster, look again (see _TRIAL)
        self._trial = [0.0, 0.0, 0.0]  # the trial's (tokens, seconds, timed rounds)
        # The first plain steps after a drafted round, and the first round after a plain step, run
        # cold: a call of another shape (ONNX Runtime plans its buffers again), the other model's
        # data in the caches. On the quick pair (AMD EPYC, 1 thread), plain steps after a round took
        # 0.57, 0.54, 0.52, 0.48, 0.47, 0.47 ms (medians of the 1st to 6th), then 0.44 and, after a
        # dozen, 0.42. They are not timed, so that each mode is priced at what it costs while it
        # lasts: timed, they made drafting look as fast as plain steps where it was 15% slower.
        self._last: tuple[str, int] = ("", 0)  # ("draft" or "plain", how many in a row)
        self._pending: list[tuple] = []         # drafted rounds not learned yet (see _BATCH)
        # What start_round hands the drafter, [with_conf]: keep_going, or the same rule marked to be
        # given NaN (see KeepGoing; a lookahead drafter's reused drafts still come with theirs).
        # Both carry ``ahead`` (see there).
        self._rules = (_rule(self.keep_going, False, self.ahead), _rule(self.keep_going, True, self.ahead))
        self._refresh()

    # ---------------------------------------------------------------- draft or not
    def draft_next(self) -> bool:
        """Draft this round (True), or take a plain target step (False) because plain steps have
        been committing tokens faster than drafted rounds."""
        if self._rounds < self._untimed + _MIN_EVIDENCE or self._spec[1] <= 0 or self._exploring:
            return True
        if self._probe > 0:
            return False                                  # timing plain steps (record_plain counts them)
        spec_rate = self._spec[0] / self._spec[1]          # tokens per second (per target step: fixed costs)
        if self._fixed is None and self._plain[0] <= 0:   # never measured
            by_line = spec_rate * self._target_time(1)     # drafting over plain steps, by the verify line
            if by_line >= _SURE_WIN or (by_line >= _CLEAR_WIN and self._rounds < self._untimed + _FIRST_PROBE):
                return self._drafting()                   # far ahead even if the line is well off, or not yet
            self._probe = _PROBE
            return False
        ratio = spec_rate * self._plain_seconds()
        if ratio >= _CLEAR_WIN:
            return self._drafting()
        if ratio > 1.0:                                   # drafting wins, but not by much: check now and then
            if self._fixed is None and self._since_plain >= _REMEASURE:
                self._probe = _PROBE
                self._plain = [0.0, 0.0]                  # a fresh estimate: the host's speed may have changed
                return False
            return self._drafting()
        self._plain_run += 1
        if self._plain_run <= self._explore:
            return False
        self._flush()                                     # (a trial counts its own rounds only)
        self._plain_run, self._exploring = 0, True
        return True                                       # a drafted round to see whether that changed

    def _plain_seconds(self) -> float:
        """A plain step's time (target steps with fixed costs); call once one is measured."""
        return 1.0 if self._fixed is not None else self._plain[1] / self._plain[0]

    def _drafting(self) -> bool:
        self._plain_run, self._explore, self._exploring = 0, _EXPLORE, False
        return True

    def _end_trial(self, tokens: float, seconds: float) -> None:
        """A timed round of a trial (see _TRIAL): go on, or decide, and end it."""
        self._trial = [self._trial[0] + tokens, self._trial[1] + seconds, self._trial[2] + 1.0]
        ahead = self._trial[0] * self._plain_seconds() > self._trial[1]
        if ahead and self._trial[2] < _TRIAL:
            return                                        # winning so far: one more round
        if ahead:                                         # drafting wins again: start from the trial's rounds
            self._spec = self._trial[:2]                  # (draft_next then resets the wait)
        else:
            self._explore = min(2 * self._explore, _EXPLORE_MAX)
        self._exploring = False
        self._trial = [0.0, 0.0, 0.0]

    def record_plain(self, seconds: float) -> None:
        """Learn from a plain target step (no drafts): its time, sampling included."""
        self._flush()                                     # the rounds before it come first
        n = self._last[1] + 1 if self._last[0] == "plain" else 1
        self._last = ("plain", n)
        if n <= _COLD_PLAIN:  # cold (see _last)
            return
        self._plain = [self._plain[0] * _PLAIN_FORGET + 1.0, self._plain[1] * _PLAIN_FORGET + seconds]
        self._since_plain = 0
        self._probe = max(0, self._probe - 1)

    # ---------------------------------------------------------------- predictions
    def _keep_prob(self, confidence: float) -> float:
        if confidence != confidence:        # NaN: not computed this round (see _CONF_WORTH)
            return self._mean_keep
        return self._bin_keep[min(int(confidence * _BINS), _BINS - 1)]

    # ---------------------------------------------------------------- per round
    # (-> drafters.KeepGoing, not imported: benchmarks/policy_ab.py runs this file on its own)
    def start_round(self) -> Callable[[int, float], bool]:
        """Start a drafted round; returns what the drafter asks after each draft (``keep_going``,
        or the same rule without the draft's confidence where computing it costs more than it
        is worth, see _CONF_WORTH)."""
        self._prob, self._expected = 1.0, 1.0
        conf_s, round_s = self._conf
        self._with_conf = bool(self._fixed is not None or round_s <= 0.0 or conf_s < _CONF_WORTH * round_s
                               or self._blind + 1 >= _CONF_SAMPLE)  # (a caller's numpy timings give numpy bools)
        self._blind = 0 if self._with_conf else self._blind + 1
        return self._rules[self._with_conf]

    def _refresh(self) -> None:
        """Price the next rounds' drafts from what has been learned (only learning changes it)."""
        if self._fixed is not None:
            c, slope = self._fixed
            ad, bd = 0.0, c
            verify = [1.0 + slope * max(0, k - 1) for k in range(self.max_gamma + 3)]
        else:
            ad, bd = self._draft_time.line()
            verify = self._target_time.table()                                 # [k] t_target(k)
        draft = [max(1e-9, ad + bd * i) for i in range(self.max_gamma + 2)]     # [i] t_draft(i)
        self._spent = spent = [draft[i] + verify[i + 1] for i in range(self.max_gamma + 1)]  # [i] i drafts, verified
        self._mean_keep = m = self._all[0] / self._all[1]
        self._bin_keep = [(k + _SHRINK * m) / (n + _SHRINK) for k, n in zip(self._kept, self._seen)]  # [bins]
        # After i drafts a round expects E tokens, all i kept with probability P. Drafting on to j
        # drafts, each further one kept with the mean keep rate (its confidence is not known yet),
        # expects E + P S[j - i] tokens, S[k] = m + m^2 + ... + m^k. Some j beats stopping iff
        # (E + P S[j - i]) / spent[j] > E / spent[i], i.e. P > E bar[i] with
        # bar[i] = min_j (spent[j] - spent[i]) / (S[j - i] spent[i]). Looking beyond j = i + 1 lets
        # a round draft through a width that costs a step of its own (a GEMM row block, see
        # _WidthTime) to the cheap widths after it: on the quick pair at greedy, verify calls of 7
        # tokens cost nearly what 8 do (static gamma 5, 6, 7: 2.64x, 2.52x, 2.65x, one bench run).
        S = [0.0]                                                               # [k] S[k]
        for _ in range(self.max_gamma):
            S.append(m * (1.0 + S[-1]))
        self._bar = [min(((spent[j] - spent[i]) / (S[j - i] * spent[i]) if S[j - i] > 0.0 else math.inf)
                         for j in range(i + 1, self.max_gamma + 1)) for i in range(self.max_gamma)]  # [i]

    def keep_going(self, i: int, confidence: float) -> bool:
        """After drafting token i with the given confidence: draft token i + 1?"""
        if i >= self.max_gamma:            # never past its own bound (its verify table ends there)
            return False
        self._prob *= self._keep_prob(confidence)
        self._expected += self._prob
        return self._go_on(i, self._prob, self._expected)

    def _go_on(self, i: int, prob: float, expected: float) -> bool:
        if self._rounds <= self._untimed:  # nothing timed yet: a middle length (see _WARM_LENGTH)
            return i < _WARM_LENGTH
        return prob > expected * self._bar[i]   # some longer round has the higher rate (_refresh)

    def ahead(self) -> Callable[[int, float], bool]:
        """The next round's keep_going, for a drafter that drafts it while this round is verified
        (LookaheadDrafter): the same rule on what has been learned before this round, with a state of
        its own (this round's lesson may change the rule before the next round; a reused round is
        then cut by both, so it can only be shorter, and stays exact).
        It runs on the drafter's worker thread; the policy learns (update) only after the drafter's
        rollback has waited for that thread, so the tables it reads do not change under it."""
        state = [1.0, 1.0]                 # P(every draft so far kept), E[tokens]: as _prob, _expected

        def keep_going(i: int, confidence: float) -> bool:
            if i >= self.max_gamma:
                return False
            state[0] *= self._keep_prob(confidence)
            state[1] += state[0]
            return self._go_on(i, state[0], state[1])
        return keep_going

    def update(self, confidences: np.ndarray, n_accepted: int, draft_s: float, target_s: float,
               keep: np.ndarray | None = None, confidence_s: float = 0.0, reused: bool = False) -> None:
        """Learn from a finished round: which drafts were examined and kept, and the timings.
        ``keep`` [g]: the test's probability of keeping each draft once the ones before it are
        kept (``Verdict.keep``); with it the policy learns the round's expected outcome instead of
        the one its uniforms drew (n_accepted). ``confidences`` [g] may hold NaN (not computed);
        ``confidence_s``: the part of ``draft_s`` spent computing them; ``reused``: the drafts were
        made before the round began (a lookahead drafter's), so ``draft_s`` does not price drafting.
        Once the policy has settled, rounds are learned _BATCH at a time."""
        conf = np.asarray(confidences, dtype=np.float64).tolist()     # [g] (copied: a drafter may reuse its buffers)
        g = len(conf)
        # [g] the drawn outcome (the first n kept, the next one rejected) unless keep is given
        keep = [float(j < n_accepted) for j in range(g)] if keep is None else np.asarray(keep, dtype=np.float64).tolist()
        self._pending.append((conf, keep, draft_s, target_s, confidence_s, self._with_conf, reused))
        if (len(self._pending) >= _BATCH or not g or self._last[0] == "plain" or self._exploring or self._probe
                or self._rounds + len(self._pending) <= self._untimed + _MIN_EVIDENCE):
            self._flush()

    def _flush(self) -> None:
        """Learn from the pending rounds, in order, and price the next rounds with it."""
        if self._pending:
            pending, self._pending = self._pending, []
            for r in pending:
                self._learn(*r)
            self._refresh()

    def _learn(self, conf: list[float], keep: list[float], draft_s: float, target_s: float,
               confidence_s: float, with_conf: bool, reused: bool) -> None:
        g = len(conf)
        # Draft j is examined iff every draft before it is kept: probability reach_j = prod_{i < j}
        # keep_i. Crediting each bin with that probability (seen) and with it times keep_j (kept) is
        # the expectation of counting the examined drafts and the kept ones over the test's uniforms:
        # the same estimate on average, without the coin flips' noise (at T = 1 a round's count of
        # kept drafts varies more than its mean). At greedy keep is 1 or 0 and the two coincide.
        kept = [x * _FORGET for x in self._kept]
        seen = [x * _FORGET for x in self._seen]
        kept_all, seen_all = self._all[0] * _FORGET, self._all[1] * _FORGET
        reach, tokens = 1.0, 1.0                      # P(draft j examined); expected tokens committed
        for j in range(g):
            if reach <= 0.0:
                break                                 # no later draft is examined either
            c, was = conf[j], reach
            reach *= keep[j]
            seen_all += was
            kept_all += reach
            tokens += reach
            if c == c:                                # (NaN: confidence not computed, no bin)
                b = min(int(c * _BINS), _BINS - 1)
                seen[b] += was
                kept[b] += reach
        self._kept, self._seen, self._all = kept, seen, [kept_all, seen_all]
        switched = False
        if g:
            self._rounds += 1
            switched, self._last = self._last[0] == "plain", ("draft", 1)
        else:                                # the drafter had nothing to propose: a plain step
            self.record_plain(draft_s + target_s)
        if self._rounds <= self._untimed or switched:  # warm-up rounds (see _UNTIMED_ROUNDS), or cold (_last)
            return
        if g:
            # A lookahead drafter's reused drafts were made while the last round was verified: ~0 s
            # here, whatever their number, their confidences included. Fitted with the others, they
            # made the draft line's slope a matter of which rounds were reused (intercept -0.16 ms,
            # slope 0.13 ms a draft against ~0.09 in one quick-pair run), drafting look cheaper than
            # it is in the rounds that pay for it, and confidences too.
            if with_conf and self._fixed is None and not reused:
                self._conf = [self._conf[0] * _SPEC_FORGET + confidence_s,
                              self._conf[1] * _SPEC_FORGET + draft_s + target_s]
            if not reused:
                self._draft_time.add(g, draft_s)
            if self._fixed is not None:      # priced in target steps, as start_round does
                c, slope = self._fixed
                seconds = c * g + 1.0 + slope * g
            else:
                seconds = draft_s + target_s
            self._spec = [self._spec[0] * _SPEC_FORGET + tokens, self._spec[1] * _SPEC_FORGET + seconds]
            self._since_plain += 1
            if self._exploring:
                self._end_trial(tokens, seconds)
        self._target_time.add(g + 1, target_s)
