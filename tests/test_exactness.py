"""Speculative sampling is exact: committed tokens follow the processed target distribution at
every output position, the bonus token included; mutants of the algorithm are caught."""
from __future__ import annotations

import numpy as np
import pytest

from edgespec import loop as loop_mod
from edgespec.adaptive import AdaptiveGamma
from edgespec.config import GenerationConfig, SamplingConfig
from edgespec.drafters import HybridDrafter, LookaheadDrafter, ModelDrafter, NgramDrafter
from edgespec.loop import generate
from edgespec.rejection import BONUS, RECOVERED, Verdict
from edgespec.sampling import process_logits, sample_index
from edgespec.toy import ToyBackend, ToyLM

from stats_helpers import ALPHA_LEVEL, chi2_pvalue, exact_sequences, min_power_against_tv

V, ORDER = 4, 3            # context-dependent target: logits depend on the last two tokens
PROMPT = [1, 2]
N_SAMPLES = 80_000         # >= 0.89 power per position against a TV error of 0.01 (checked below;
                           # 0.56 for a pair of positions, whose table has 15 degrees of freedom)


def make_pair(noise: float = 2.0):
    target = ToyLM(V, ORDER, seed=3, scale=1.5)
    draft = target.perturbed(noise, seed=4)
    return target, draft


def sample_outputs(gamma: int, sampling: SamplingConfig, n: int, draft_factory=ModelDrafter,
                   seed: int = 0, lenience: float = 1.0, adaptive: bool = False, length: int | None = None,
                   policy=None):
    """Outputs of length gamma + 2 (or ``length``): token 1 comes from the prefill, tokens
    2..gamma+2 from the first round (token gamma+2 is the bonus when every draft is kept), later
    rounds fill the rest. ``policy``: one adaptive policy for every sample (with ``adaptive``)."""
    target, draft = make_pair()
    tb, db = ToyBackend(target, 64), ToyBackend(draft, 64)
    length = length or gamma + 2
    cfg = GenerationConfig(max_new_tokens=length, gamma=None if adaptive else gamma,
                           max_gamma=max(gamma, 1), sampling=sampling, lenience=lenience)
    rng = np.random.default_rng(seed)
    outs = np.empty((n, length), dtype=np.int64)
    first_round = np.zeros(gamma + 1, dtype=np.int64)  # accepted-count histogram of round 1
    kinds = set()
    for i in range(n):
        res = generate(tb, PROMPT, cfg, rng, draft=draft_factory(db), policy=policy)
        outs[i] = res.tokens
        kinds.update(res.sources)
        n_acc = 0
        while n_acc < len(res.sources) - 1 and res.sources[1 + n_acc] == "accepted":
            n_acc += 1
        first_round[min(n_acc, gamma)] += 1
    return target, outs, first_round, kinds


def assert_matches_target(target, outs, sampling, label):
    L = outs.shape[1]
    exact = exact_sequences(target, PROMPT, L, sampling)            # [V]*L
    failures = []
    for j in range(L):
        marg = exact.sum(axis=tuple(a for a in range(L) if a != j))  # [V]
        counts = np.bincount(outs[:, j], minlength=V)
        p = chi2_pvalue(counts, marg)
        if p < ALPHA_LEVEL:
            failures.append(f"position {j + 1}: p={p:.2e} counts={counts.tolist()} expected={np.round(marg * len(outs)).tolist()}")
    for j in range(L - 1):  # joint of consecutive positions catches wrong dependence
        pair = exact.sum(axis=tuple(a for a in range(L) if a not in (j, j + 1)))  # [V, V]
        counts = np.bincount(outs[:, j] * V + outs[:, j + 1], minlength=V * V)
        p = chi2_pvalue(counts, pair)
        if p < ALPHA_LEVEL:
            failures.append(f"positions {j + 1},{j + 2} jointly: p={p:.2e}")
    assert not failures, f"{label}: output differs from the target distribution:\n" + "\n".join(failures)


CONFIGS = [
    pytest.param(1, SamplingConfig(1.0), id="gamma1-T1"),
    pytest.param(3, SamplingConfig(1.0), id="gamma3-T1"),
    pytest.param(5, SamplingConfig(1.0), id="gamma5-T1"),
    pytest.param(3, SamplingConfig(0.6, top_k=3), id="gamma3-T0.6-topk3"),
    pytest.param(3, SamplingConfig(1.4, top_p=0.8), id="gamma3-T1.4-topp0.8"),
]


def test_sample_size_catches_tv_0_01():
    assert min_power_against_tv(N_SAMPLES, df=V - 1) >= 0.89


@pytest.mark.parametrize("gamma,sampling", CONFIGS)
def test_speculative_output_is_target_distribution(gamma, sampling):
    target, outs, first_round, kinds = sample_outputs(gamma, sampling, N_SAMPLES)
    # Every block position was exercised: rejections at each draft and full acceptance (bonus).
    assert (first_round > 100).all(), first_round
    assert {"accepted", "recovered", "bonus", "target"} <= kinds
    assert_matches_target(target, outs, sampling, f"gamma={gamma} {sampling}")


def test_ngram_drafter_is_exact():
    # prompt lookup: q is one-hot on earlier text's continuation
    sampling = SamplingConfig(1.0)
    target, outs, _, kinds = sample_outputs(3, sampling, N_SAMPLES, seed=12,
                                            draft_factory=lambda _db: NgramDrafter(max_ngram=2))
    assert {"accepted", "recovered"} <= kinds
    assert_matches_target(target, outs, sampling, "n-gram drafter")


@pytest.mark.parametrize("draft_vocab", [3, 6], ids=["draft-fewer-ids", "draft-more-ids"])
def test_draft_with_another_vocabulary_size_is_exact(draft_vocab):
    """Target and draft with different row counts (padding rows, a resized embedding): the sample
    space is the target's ids; ids the draft lacks get q = 0 (reachable through the residual and the
    bonus), ids only the draft has are never proposed. The output is the target's distribution over
    all its ids (it used to be restricted to the ids both models have)."""
    sampling = SamplingConfig(1.0)
    target, _ = make_pair()
    class Strict(ToyBackend):  # an embedding has no row for an id past its vocabulary: refuse it
        def extend(self, ids):
            assert max(ids) < self.vocab_size, f"the draft was fed id {max(ids)} (it has {self.vocab_size})"
            return super().extend(ids)

    db = Strict(ToyLM(draft_vocab, ORDER, seed=5, scale=1.5), 64)
    cls = lambda _db: ModelDrafter(db)  # noqa: E731
    target, outs, _, kinds = sample_outputs(3, sampling, N_SAMPLES, seed=13, draft_factory=cls)  # (half: power 0.36)
    assert {"accepted", "recovered", "bonus"} <= kinds
    assert (outs == V - 1).any()  # the target's last id appears (the draft with 3 ids never proposes it)
    assert_matches_target(target, outs, sampling, f"draft vocabulary {draft_vocab}, target {V}")


class _Stops(AdaptiveGamma):
    """The adaptive policy, counting how often it stops a round early and how often it goes on."""

    def __init__(self, max_gamma: int, fixed_costs: tuple[float, float] | None = None):
        super().__init__(max_gamma, fixed_costs=fixed_costs)
        self.stops = self.goes = 0

    def keep_going(self, i: int, confidence: float) -> bool:
        go = self._go(i, confidence)
        self.goes += go
        self.stops += not go
        return go

    def _go(self, i: int, confidence: float) -> bool:
        return super().keep_going(i, confidence)


class _Threshold(_Stops):
    """Always drafts, and stops after a draft the draft gave less than 0.5: an early stop that
    engages in every round, from the first (the shipped policy learns first), so that a drafter
    that asks it about the wrong draft is caught. A lookahead drafter's worker stops the next
    round's drafts by the same threshold (``ahead``), counted in ``ahead_stops``."""

    ahead_stops = 0

    def draft_next(self) -> bool:
        return True

    def _go(self, i: int, confidence: float) -> bool:
        return confidence >= 0.5

    def ahead(self):
        def keep_going(i: int, confidence: float) -> bool:
            go = self._go(i, confidence)
            self.ahead_stops += not go
            return go
        return keep_going


def test_adaptive_gamma_is_exact():
    """One policy for every sample, as an Engine keeps one, priced so that it both stops rounds
    early and goes on (a fresh policy per 6-token call never stops: it learns first)."""
    sampling = SamplingConfig(1.0)
    policy = _Stops(4, fixed_costs=(0.05, 0.1))
    target, outs, _, kinds = sample_outputs(4, sampling, N_SAMPLES, adaptive=True, seed=11, policy=policy)
    assert {"accepted", "recovered", "bonus"} <= kinds
    assert policy.stops > N_SAMPLES // 10 and policy.goes > N_SAMPLES // 10, (policy.stops, policy.goes)
    assert_matches_target(target, outs, sampling, "adaptive gamma")


class _Counting(AdaptiveGamma):
    """The adaptive policy, counting its choices between a drafted round and a plain step."""

    def __init__(self, max_gamma: int, fixed_costs: tuple[float, float]):
        super().__init__(max_gamma, fixed_costs=fixed_costs)
        self.plain = self.drafted = 0

    def draft_next(self) -> bool:
        drafted = self._choose()
        self.drafted += drafted
        self.plain += not drafted
        return drafted

    def _choose(self) -> bool:
        return super().draft_next()


class _Coin(_Counting):
    """Drafts a round or takes a plain step by a coin of its own (independent of the run's tokens
    and uniforms, as the real choice depends only on earlier rounds): rounds follow plain steps at
    every position."""

    def __init__(self, max_gamma: int, fixed_costs: tuple[float, float]):
        super().__init__(max_gamma, fixed_costs)
        self._coin = np.random.default_rng(99)

    def _choose(self) -> bool:
        return bool(self._coin.random() < 0.5)


@pytest.mark.parametrize("drafter,policy_cls", [("model", _Counting), ("lookahead", _Coin)],
                         ids=["model-policy", "lookahead-coin"])
def test_plain_steps_between_rounds_are_exact(drafter, policy_cls):
    """The adaptive policy may take plain target steps where those are faster (gamma = 0 in
    Theorem 3.8's objective); rounds after them draft from a draft model that missed those
    tokens (the lookahead drafter's drafts made during the last verify assumed none came). One
    policy for all samples, priced so that it takes both (a draft step 0.2 of a target step, each
    extra verified token 0.3), or a coin."""
    sampling = SamplingConfig(1.0)
    factory = _shared(LookaheadDrafter) if drafter == "lookahead" else ModelDrafter
    policy = policy_cls(2, fixed_costs=(0.2, 0.3))
    target, outs, _, kinds = sample_outputs(2, sampling, N_SAMPLES, factory, seed=15, adaptive=True, length=7,
                                            policy=policy)
    assert {"accepted", "recovered", "bonus", "target"} <= kinds
    assert policy.plain > N_SAMPLES and policy.drafted > N_SAMPLES, (policy.plain, policy.drafted)
    assert_matches_target(target, outs, sampling, f"plain steps between rounds ({drafter})")


def _shared(cls):
    """One drafter for every sample, as an Engine keeps one (a LookaheadDrafter owns a thread)."""
    made = []

    def factory(db):
        if not made:
            made.append(cls(db))
        return made[0]
    return factory


@pytest.mark.parametrize("sampling,adaptive", [(SamplingConfig(1.0), False),
                                               (SamplingConfig(1.4, top_k=3, top_p=0.8), True)],
                         ids=["T1", "T1.4-topk3-topp0.8-adaptive"])
def test_lookahead_drafter_is_exact(sampling, adaptive):
    """Drafts made while the target verified are reused when the round's last token is the one
    they assumed; outputs of 7 tokens span several rounds, so reused rounds are in the sample."""
    factory = _shared(LookaheadDrafter)
    policy = _Threshold(2) if adaptive else None   # reused rounds too are cut by the policy
    target, outs, _, kinds = sample_outputs(2, sampling, N_SAMPLES, factory, seed=13, adaptive=adaptive, length=7,
                                            policy=policy)
    assert factory(None).reused_rounds > N_SAMPLES // 10, factory(None).reused_rounds
    assert policy is None or policy.stops > N_SAMPLES // 10, policy.stops
    assert policy is None or policy.ahead_stops > N_SAMPLES // 10, policy.ahead_stops  # workers cut short too
    assert {"accepted", "recovered", "bonus"} <= kinds
    assert_matches_target(target, outs, sampling, "lookahead drafter")


class _StaleQ(LookaheadDrafter):
    """Mutant: reused drafts are reported with the q row one position early (y_2 with y_1's q).
    (Reusing y_2.. after a bonus other than y_1 would not be a mutant: any proposal drawn
    independently of the target's uniforms and reported with its own q is exact, only less often
    kept.)"""

    def propose(self, generated, gamma, sampling, rng, vocab, keep_going=None):
        self._join()
        if self._ahead is not None and self._ahead[2].shape[0] > 1:
            self._ahead[2][1:] = self._ahead[2][:-1].copy()
        return super().propose(generated, gamma, sampling, rng, vocab, keep_going)


class _BonusIsNextDraft(LookaheadDrafter):
    """Mutant: the bonus is y_1 without the test (q reported as 0 there, so the test always keeps
    y_1 where p(y_1) > 0). (Reporting q one-hot on y_1 would not be a mutant: like prompt lookup,
    a one-hot proposal is exact for any token chosen independently of the target's uniforms.)"""

    def next_draft(self):
        got = super().next_draft()
        return None if got is None else (got[0], np.zeros_like(got[1]))


@pytest.mark.parametrize("mutant", [_StaleQ, _BonusIsNextDraft], ids=["stale-q", "bonus-is-next-draft"])
def test_lookahead_mutants_are_caught(mutant):
    sampling = SamplingConfig(1.0)
    target, outs, _, _ = sample_outputs(2, sampling, N_MUTANT, _shared(mutant), seed=14, length=7)
    with pytest.raises(AssertionError, match="differs from the target"):
        assert_matches_target(target, outs, sampling, mutant.__name__)


def _peeking(cls):
    """Mutant of a drafter: whether draft i + 1 is proposed is decided from draft i + 1's own
    confidence, after it was drawn (the policy is asked about the draft it decides on, one
    position late). A draft length chosen from the draft's own information is exact only if
    drafting token i + 1 is decided before x_{i+1} is drawn, from x_1..x_i: this keeps a draft
    more often when the draft liked it, which biases the output although the target was never
    consulted."""
    class Peeking(cls):
        def propose(self, generated, gamma, sampling, rng, vocab, keep_going=None):
            go_on = None if keep_going is None else (lambda i, c: True)  # (asked, the draft computes confidences)
            ids, q, conf = super().propose(generated, gamma, sampling, rng, vocab, go_on)  # [g], [g, V], [g]
            m = next((i for i in range(1, ids.shape[0]) if keep_going is not None and not keep_going(i, conf[i])),
                     ids.shape[0])
            return ids[:m], q[:m], conf[:m]
    Peeking.__name__ = f"Peeking{cls.__name__}"
    return Peeking


@pytest.mark.parametrize("base", [ModelDrafter, LookaheadDrafter], ids=["model", "lookahead"])
def test_early_stop_mutants_are_caught(base):
    sampling = SamplingConfig(1.0)
    policy = _Threshold(3)
    target, outs, _, _ = sample_outputs(3, sampling, N_MUTANT, _shared(_peeking(base)), seed=17, adaptive=True,
                                        length=7, policy=policy)
    assert policy.stops > N_MUTANT // 10, policy.stops
    with pytest.raises(AssertionError, match="differs from the target"):
        assert_matches_target(target, outs, sampling, f"early stop one draft late ({base.__name__})")


class _Forced(HybridDrafter):
    """Learns nothing: a lookup token takes every position where it differs and the model's
    sureness is 0.5 or more (bins 5-9), and none elsewhere, so that the bin decides."""

    def propose(self, generated, gamma, sampling, rng, vocab, keep_going=None):
        if sampling not in self._stats:
            keeps = np.zeros((2, self.max_ngram + 1, 10))
            keeps[0, :, 5:], keeps[1, :, :5] = 10.0, 10.0
            self._stats[sampling] = (keeps, np.full((self.max_ngram + 1, 10), 10.0))
        return super().propose(generated, gamma, sampling, rng, vocab, keep_going)

    def learn(self, examined, target_rows, greedy):
        pass


class _BinByDraw(_Forced):
    """Mutant: with sampling, the sureness bin from q(drawn token), not max q: whether the lookup
    token replaces the draw depends on the draw."""

    @staticmethod
    def _sureness(logits, q_row, drawn, conf, greedy):
        return float(q_row[drawn])


@pytest.mark.parametrize("cls,sampling,adaptive", [
    (HybridDrafter, SamplingConfig(1.0), False), (_Forced, SamplingConfig(1.0), False),
    (_Forced, SamplingConfig(1.4, top_k=3, top_p=0.8), True)],
    ids=["T1-learned", "T1-forced", "T1.4-topk3-topp0.8-adaptive-forced"])
def test_hybrid_drafter_is_exact(cls, sampling, adaptive):
    """The draft model with prompt-lookup tokens in its place: as learned over the samples, and
    with lookup forced in half the sureness bins (so replaced positions, and the bin rule, are in
    the sample)."""
    factory = _shared(cls)  # one for every sample, as an Engine keeps one
    policy = _Threshold(3) if adaptive else None
    target, outs, _, kinds = sample_outputs(3, sampling, N_SAMPLES, factory, seed=15, adaptive=adaptive, length=7,
                                            policy=policy)
    assert factory(None).replaced > N_SAMPLES // 20, factory(None).replaced
    assert policy is None or policy.stops > N_SAMPLES // 10, policy.stops
    assert {"accepted", "recovered", "bonus"} <= kinds
    assert_matches_target(target, outs, sampling, f"hybrid drafter ({cls.__name__})")


class _DrawDecides(HybridDrafter):
    """Mutant: the lookup token replaces the model's only where the model drew a token it gave
    less than 0.5 (the choice depends on the draw, so the position's proposal is not the one-hot
    q it reports, nor the model's q)."""

    def _pick(self, g, logits, ids, q_row, sampling, uniform, want_conf):
        conf = ModelDrafter._pick(self, g, logits, ids, q_row, sampling, uniform, True)
        nxt, n = self._index.follower(self._tail)
        self._round.append((q_row, 0, None, 0))
        if nxt is not None and q_row[ids[g]] < 0.5:
            ids[g] = self._index.tokens[nxt]
            q_row.fill(0.0)
            q_row[ids[g]] = 1.0
            self.replaced += 1
        self._tail = self._tail[1:] + [int(ids[g])]
        return conf


class _ModelQKept(HybridDrafter):
    """Mutant: a replaced position reports the model's q instead of one-hot on the lookup token."""

    def _pick(self, g, logits, ids, q_row, sampling, uniform, want_conf):
        conf = ModelDrafter._pick(self, g, logits, ids, q_row, sampling, uniform, True)
        nxt, n = self._index.follower(self._tail)
        self._round.append((q_row, 0, None, 0))
        if nxt is not None:
            ids[g] = self._index.tokens[nxt]
            self.replaced += 1
        self._tail = self._tail[1:] + [int(ids[g])]
        return conf


@pytest.mark.parametrize("mutant", [_DrawDecides, _ModelQKept, _BinByDraw], ids=["draw-decides", "model-q-kept", "bin-by-draw"])
def test_hybrid_mutants_are_caught(mutant):
    sampling = SamplingConfig(1.0)
    target, outs, _, _ = sample_outputs(3, sampling, N_MUTANT, _shared(mutant), seed=16, length=7)
    with pytest.raises(AssertionError, match="differs from the target"):
        assert_matches_target(target, outs, sampling, mutant.__name__)


# ------------------------------------------------------------------------------------ mutants
N_MUTANT = 20_000


def _always_accept(draft_ids, q, p, rng, lenience=1.0, next_draft=None):
    g = len(draft_ids)
    return Verdict(g, sample_index(p[g], rng.random()), BONUS)


def _residual_from_p(draft_ids, q, p, rng, lenience=1.0, next_draft=None):
    g = len(draft_ids)
    r = rng.random(g)
    keep = r * q[np.arange(g), draft_ids] < p[np.arange(g), draft_ids]
    n = g if keep.all() else int(np.argmin(keep))
    if n == g:
        return Verdict(n, sample_index(p[g], rng.random()), BONUS)
    return Verdict(n, sample_index(p[n], rng.random()), RECOVERED)  # the bug: p, not max(0, p - q)


class _ArgmaxDrafter(ModelDrafter):
    """Mutant: the draft token is the argmax while q is reported as the softmax."""

    def propose(self, generated, gamma, sampling, rng, vocab, keep_going=None):
        b = self.backend
        feed = np.asarray(generated[b.length - self._base:], dtype=np.int64)
        ids, q = np.empty(gamma, dtype=np.int64), np.empty((gamma, vocab))
        for i in range(gamma):
            q[i] = process_logits(b.extend(feed)[-1:, :vocab], sampling)[0]
            ids[i] = int(np.argmax(q[i]))
            feed = ids[i:i + 1]
        return ids, q, q[np.arange(gamma), ids]


@pytest.mark.parametrize("mutant", ["always-accept", "argmax-draft-softmax-q", "residual-from-p", "lenience-0.3"])
def test_mutants_are_caught(mutant, monkeypatch):
    sampling, kwargs = SamplingConfig(1.0), {}
    if mutant == "always-accept":
        monkeypatch.setattr(loop_mod, "speculative_sample", _always_accept)
    elif mutant == "residual-from-p":
        monkeypatch.setattr(loop_mod, "speculative_sample", _residual_from_p)
    elif mutant == "argmax-draft-softmax-q":
        kwargs["draft_factory"] = _ArgmaxDrafter
    else:
        kwargs["lenience"] = 0.3  # not a bug: lenience < 1 trades exactness away (A.5)
    target, outs, _, _ = sample_outputs(3, sampling, N_MUTANT, seed=5, **kwargs)
    with pytest.raises(AssertionError, match="differs from the target"):
        assert_matches_target(target, outs, sampling, mutant)
