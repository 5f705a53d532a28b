"""Drafters propose the tokens a speculative round verifies: a second model (the paper's M_q)
or, with no second model, earlier text (prompt lookup / n-gram).

A drafter has ``vocab_size`` (None if it has no vocabulary of its own), ``start(prompt)``,
``room(n_generated)``, ``propose(...) -> (ids [g], q [g, V], confidences [g])`` and
``rollback(kept)``; optionally ``learn(examined, target_rows, greedy)``, which the loop calls after
each verify call (HybridDrafter learns from it: what it learns may shape later rounds only).
``propose`` may return fewer tokens than asked (even none). The round stays exact if whether
x_{i+1} is verified does not depend on x_{i+1} itself, given x_1..x_i: it may depend on those, their
q rows and earlier rounds (never the target's verdict on this round). Deciding before x_{i+1} is
drawn is the simple way to ensure it (ModelDrafter, the adaptive policy); the lookahead drafter
decides after its draws, on what does not depend on them. Each position is then an ordinary step
of speculative sampling (Appendix A.1). Dropping x_{i+1} after drawing it, because of its own
confidence, biases the output although the target was never consulted (a mutant in
tests/test_exactness.py)."""
from __future__ import annotations

import math
import queue
import threading
import time
import weakref
from typing import Callable

import numpy as np

from .backend import Backend
from .config import SamplingConfig
from .errors import NonFiniteLogitsError
from .sampling import argmax_token, sample_row

# keep_going(i, confidence) -> bool: after drafting token i (1-based), draft another one? A
# keep_going whose ``needs_confidence`` attribute is False is given NaN: the drafter does not compute
# the confidence (at greedy a softmax over the vocabulary, ~10 us a draft on a CPU; see AdaptiveGamma).
KeepGoing = Callable[[int, float], bool]


class ModelDrafter:
    """Drafts autoregressively with a draft model through the Backend protocol."""

    # EOS and stop ids (the loop sets them per call): nothing after one can be emitted, so drafting
    # stops there, decided from the drafts so far before the next is drawn (exact, see above).
    end_ids: frozenset[int] = frozenset()

    def __init__(self, backend: Backend):
        self.backend = backend
        self.vocab_size = backend.vocab_size
        self._base = 0
        self.catch_up_s = 0.0   # time spent feeding tokens committed by plain steps (not drafting)
        # time spent computing greedy confidences, a part of drafting (a lookahead worker's, which
        # drafts while the target verifies, counts too: the adaptive policy then overrates their cost)
        self.confidence_s = 0.0

    def start(self, prompt: np.ndarray) -> None:
        # ids the draft has no row for get a stand-in, as in propose (the output stays exact)
        self.backend.prefill(np.minimum(prompt, self.vocab_size - 1))
        self._base = self.backend.length

    def room(self, generated: int) -> int:
        """How many drafts fit: the draft processes the unseen tokens and gamma - 1 drafts."""
        return self.backend.max_length - self._base - generated + 1

    def propose(self, generated: list[int], gamma: int, sampling: SamplingConfig,
                rng: np.random.Generator, vocab: int,
                keep_going: KeepGoing | None = None) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """Draw up to gamma tokens autoregressively from q (the processed draft distribution)."""
        # [u] unseen tokens: 1 or 2 after a round, more after plain steps the adaptive policy took
        feed = np.asarray(generated[self.backend.length - self._base:], dtype=np.int64)
        if vocab > self.vocab_size and feed.max(initial=0) >= self.vocab_size:
            # A target with more rows than the draft can commit an id the draft has no row for.
            # Any stand-in keeps the output exact: q only has to be what the drafts were drawn from.
            feed = np.minimum(feed, self.vocab_size - 1)
        if feed.shape[0] > 2:  # tokens of plain steps: read before drafting, timed apart (a one-off cost)
            t0 = time.perf_counter()
            width = getattr(self.backend, "verify_width", None) or feed.shape[0]  # XLA: at most this many per call
            while feed.shape[0] > 1:  # the last one is fed with the first draft
                n = min(width, feed.shape[0] - 1)
                self.backend.extend(feed[:n])
                feed = feed[n:]
            self.catch_up_s += time.perf_counter() - t0
        return self._draft(feed, gamma, sampling, rng.random, vocab, keep_going)

    def _draft(self, feed: np.ndarray, gamma: int, sampling: SamplingConfig, uniform: Callable[[], float],
               vocab: int, keep_going: KeepGoing | None = None,
               stop: Callable[[], bool] | None = None) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """Feed the unseen tokens, then draft up to gamma tokens; ``uniform()`` gives each draw's u."""
        b = self.backend
        # The target's ids [0, V) are the sample space; the draft has rows for [0, dv). q is 0 on
        # ids the draft has no row for (the residual norm(max(0, p - q)) can still reach them).
        dv = min(vocab, b.vocab_size)
        ids = np.empty(gamma, dtype=np.int64)                                  # [gamma]
        q = np.empty((gamma, vocab))                                           # [gamma, V]
        conf = np.zeros(gamma)                                                 # [gamma] q_i(x_i), NaN: not computed
        want_conf = keep_going is not None and getattr(keep_going, "needs_confidence", True)
        g = 0
        zero = sampling.greedy or dv < vocab  # rows _pick does not fully write: zeroed as drafted
        while g < gamma:                      # (an adaptive round may stop long before gamma)
            logits = b.extend(feed)[-1:, :dv]                                  # [1, dv]
            if zero:
                q[g] = 0.0
            conf[g] = self._pick(g, logits[0], ids, q[g], sampling, uniform, want_conf)
            feed = ids[g:g + 1]
            g += 1
            if int(ids[g - 1]) in self.end_ids:
                break
            if keep_going is not None and g < gamma and not keep_going(g, conf[g - 1]):
                break
            if stop is not None and stop():
                break
        return ids[:g], q[:g], conf[:g]

    def _pick(self, g: int, logits: np.ndarray, ids: np.ndarray, q_row: np.ndarray, sampling: SamplingConfig,
              uniform: Callable[[], float], want_conf: bool) -> float:
        """Draft token g from the draft's logits [dv]: write it to ids[g] and the distribution it was
        drawn from to q_row [V] (zeroed beforehand at greedy); return its confidence if ``want_conf``
        (else NaN)."""
        if not sampling.greedy:
            ids[g] = sample_row(logits, sampling, uniform(), q_row[:logits.shape[0]], "draft model")
            return float(q_row[ids[g]]) if want_conf else math.nan
        ids[g] = argmax_token(logits, "draft model")  # q one-hot on the argmax, written into the zeroed row
        q_row[ids[g]] = 1.0
        if not want_conf:
            return math.nan
        t0 = time.perf_counter()
        conf = _confidence(logits, int(ids[g]))
        self.confidence_s += time.perf_counter() - t0
        return conf

    def rollback(self, kept: int) -> None:
        """Keep only the first ``kept`` generated tokens (the draft may hold fewer already)."""
        self.backend.rewind_to(min(self.backend.length, self._base + kept))


def _confidence(logits: np.ndarray, token: int) -> float:
    """The greedy draft's confidence in its argmax ``token``: its softmax probability (q is one-hot
    there, so q(x) says nothing; with sampling the confidence is q(x) itself, read from q)."""
    return float(1.0 / np.exp(logits - logits[token]).sum())


class LookaheadDrafter(ModelDrafter):
    """A draft model that keeps drafting on a second thread while the target verifies.

    When a round's drafts x_1..x_g are proposed, a worker thread feeds x_g to the draft and drafts
    y_1..y_k on from there while the target's verify call runs (ONNX Runtime releases the GIL, so
    with the target on one core the worker uses another). A round that keeps all g drafts decides
    its bonus by testing y_1 against p_{g+1} (``next_draft``, see ``speculative_sample``). If the
    bonus is y_1, the next round's drafts are y_2..y_k, already made: their drafting cost no wall
    time. Otherwise they are dropped and the draft rewinds (a position move). This is the
    post-verify half of PEARL (Liu et al., 2024).

    Exactness: y_2.. were drawn from q given the prefix ending in y_1 = the committed bonus, with
    uniforms drawn from the run's generator before the worker started, so they are distributed as
    fresh drafts would be; whether they are used depends only on the committed tokens. The
    acceptance test is the paper's (Appendix A.1), at the bonus position too. At temperature 0 the
    bonus is the target's argmax and y_1 the draft's, so reuse happens exactly when the draft's next
    guess would be kept.
    """

    def __init__(self, backend: Backend):
        super().__init__(backend)
        # a Queue, not a SimpleQueue: its join() waits for exactly the jobs that were queued (abandon)
        self._jobs: queue.Queue = queue.Queue()
        self._done = threading.Event()
        self._busy = False
        self._cancel = False
        self._result: tuple | BaseException | None = None
        self._at = 0                         # committed tokens the running job's drafts assume
        self._ahead: tuple | None = None     # a finished job: (assumed count, ids [k], q [k, V], conf [k])
        self._thread: threading.Thread | None = None
        self.reused_rounds = 0               # rounds whose drafts were made during the previous verify
        self.wait_s = 0.0                    # time the caller spent waiting for the worker (draft time it saw)
        self.starts = 0                      # generations started: the loop abandons only its own (see abandon)

    def start(self, prompt: np.ndarray) -> None:
        self._join()
        self._ahead = None
        super().start(prompt)
        self.starts += 1

    def propose(self, generated: list[int], gamma: int, sampling: SamplingConfig,
                rng: np.random.Generator, vocab: int,
                keep_going: KeepGoing | None = None) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        self._join()
        ahead, self._ahead = self._ahead, None
        if ahead is not None and len(generated) == ahead[0] + 1 and generated[-1] == ahead[1][0] and ahead[1].shape[0] > 1:
            # the bonus is y_1: y_2.. are this round's drafts (the policy may take fewer)
            ids, q, conf = ahead[1][1:gamma + 1], ahead[2][1:gamma + 1], ahead[3][1:gamma + 1]  # [m], [m, V], [m]
            m = ids.shape[0]
            if keep_going is not None:
                m = next((i for i in range(1, m) if not keep_going(i, conf[i - 1])), m)
            ids, q, conf = ids[:m], q[:m], conf[:m]
            self.reused_rounds += 1
            # the cache holds the prefix and y_1..y_{k-1}: keep what drafting ids[:m] would have fed
            self.backend.rewind_to(self._base + len(generated) + m - 1)
        else:
            # The cache is right up to the committed tokens the worker's drafts assumed (y_1.. follow
            # them); plain steps since then may have committed more, which propose feeds.
            known = len(generated) - 1 if ahead is None else min(len(generated) - 1, ahead[0])
            self.backend.rewind_to(min(self.backend.length, self._base + known))
            ids, q, conf = super().propose(generated, gamma, sampling, rng, vocab, keep_going)
        k = min(gamma + 1, self.backend.max_length - self.backend.length - 1)
        if ids.shape[0] and k > 0 and int(ids[-1]) not in self.end_ids:  # (nothing follows an EOS or stop id)
            # Uniforms drawn here, in the main thread, so the run's generator is consumed the same
            # way whatever the worker gets done before it is stopped.
            us = iter(rng.random(k).tolist()) if not sampling.greedy else None
            # An adaptive policy's rule for the next round (its drafts are y_2..): the worker stops
            # where that round would by what the policy has learned so far (AdaptiveGamma.ahead).
            # Drafting on to gamma + 1 made jobs longer than the rounds that
            # use them, and the second core's work slows the verify call it runs beside (quick pair,
            # T=1: verify calls 12% dearer; adaptive gamma 0.84 of static gamma 5, see benchmarks/README.md).
            ahead = getattr(keep_going, "ahead", None)
            self._launch((ids[-1:], k, sampling, us, vocab, ahead() if ahead is not None else None),
                         len(generated) + ids.shape[0])
        return ids, q, conf

    def next_draft(self) -> tuple[int, np.ndarray] | None:
        """(y_1, q [V]) of the drafts made while the target verified (the round kept every draft)."""
        self._join()
        a = self._ahead
        return (int(a[1][0]), a[2][0]) if a is not None and a[1].shape[0] else None

    def rollback(self, kept: int) -> None:
        if self._busy and kept < self._at:   # a draft was rejected: y_1.. assume a prefix that did not happen
            self._cancel = True
        self._join()
        if self._ahead is not None and kept == self._ahead[0]:
            return                           # every draft kept: y_1.. stand if the bonus is y_1 (next propose)
        self._ahead = None
        super().rollback(kept)

    def abandon(self) -> None:
        """Stop and wait for the worker's job when a round ends in an error (the draft is then free
        for other callers); its drafts are dropped. The worker's own error, if any, is not raised:
        the caller is already raising the one that ended the round.

        It waits for every job that reached the queue, not for ``_busy``: an interrupt inside
        ``_launch`` can leave ``_busy`` set for a job that was never queued (waiting for it would
        hang) or a queued job unrecorded (using the draft beside it would corrupt its cache)."""
        self._cancel = True
        self._jobs.join()
        self._busy, self._result, self._ahead = False, None, None

    def close(self) -> None:
        """Stop the worker thread (a later round starts a new one)."""
        self._cancel = True
        try:
            self._join()
        finally:
            if self._thread is not None and self._thread.is_alive():
                self._jobs.put(None)
                self._thread.join()
            self._thread = None
            self._ahead = None

    # ---------------------------------------------------------------- the worker
    def _launch(self, job: tuple, at: int) -> None:
        if self._thread is None or not self._thread.is_alive():
            # (not alive: a start that failed or was interrupted, or a close() cut short: a job queued
            # with no worker to take it would hang the next wait.) The thread holds only a weak
            # reference, and stops once the drafter is collected.
            worker = threading.Thread(target=_lookahead_worker, name="edgespec-lookahead", daemon=True,
                                      args=(self._jobs, self._done, weakref.ref(self)))
            worker.start()
            self._thread = worker
            weakref.finalize(self, self._jobs.put, None)
        self._at, self._cancel, self._busy = at, False, True
        self._done.clear()
        self._jobs.put(job)

    def _join(self) -> None:
        """Wait for the worker; its drafts become ``_ahead`` unless it was stopped. Its error is
        raised, unless the job was stopped and the error is non-finite logits: a stopped job drafted
        after a prefix that did not happen (a draft was rejected), which the model drafter never
        evaluates. Any other error (a device's, or one that left the cache unusable) is the
        draft's own, whatever the prefix, and is raised."""
        if not self._busy:
            return
        t0 = time.perf_counter()
        self._done.wait()
        self.wait_s += time.perf_counter() - t0
        self._busy = False
        result, self._result = self._result, None
        if isinstance(result, BaseException):
            self._ahead = None
            if not (self._cancel and isinstance(result, NonFiniteLogitsError)):
                raise result
            return
        self._ahead = None if self._cancel else (self._at, *result)


def _lookahead_worker(jobs: queue.Queue, done: threading.Event, ref: weakref.ref) -> None:
    always = lambda i, c: True  # noqa: E731  (confidences are needed by the next round's policy)
    while True:
        job = jobs.get()
        me = ref() if job is not None else None
        if me is None:
            jobs.task_done()
            return
        feed, k, sampling, us, vocab, rule = job
        # y_1 is drafted in any case (the bonus test); after it, y_{i+1} is the next round's draft i
        go = always if rule is None else (lambda i, c: i < 2 or rule(i - 1, c))  # noqa: E731
        try:
            me._result = me._draft(feed, k, sampling, us.__next__ if us is not None else None, vocab,
                                   go, stop=lambda: me._cancel)
        except BaseException as e:  # handed to the main thread by _join
            me._result = e
        del me
        done.set()
        jobs.task_done()


class NgramDrafter:
    """Prompt lookup: propose the continuation of the longest earlier match of the last tokens.

    q is one-hot on the proposed token, so the acceptance test keeps x with probability p(x)
    and a rejection draws from norm(max(0, p - onehot(x))): p without x. Still exact.
    """

    vocab_size = None
    end_ids: frozenset[int] = frozenset()   # as ModelDrafter's: the proposal ends at the first one

    def __init__(self, max_ngram: int = 4, min_ngram: int = 1):
        NgramIndex.check(max_ngram, min_ngram)
        self.max_ngram, self.min_ngram = max_ngram, min_ngram

    def start(self, prompt: np.ndarray) -> None:
        self._index = NgramIndex(prompt, self.max_ngram, self.min_ngram)

    def room(self, generated: int) -> int:
        return 1 << 30

    def propose(self, generated: list[int], gamma: int, sampling: SamplingConfig,
                rng: np.random.Generator, vocab: int,
                keep_going: KeepGoing | None = None) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        toks = self._index.sync(generated)
        nxt = self._index.follower(toks)[0]
        found = toks[nxt:nxt + gamma] if nxt is not None else []
        # up to the first id outside the sample space (dropping it would shift the later ones)
        found = found[:next((j for j, t in enumerate(found) if t >= vocab), len(found))]
        found = found[:next((j + 1 for j, t in enumerate(found) if t in self.end_ids), len(found))]
        ids = np.asarray(found, dtype=np.int64)                                # [g]
        q = np.zeros((ids.shape[0], vocab))                                    # [g, V] one-hot
        q[np.arange(ids.shape[0]), ids] = 1.0
        return ids, q, np.ones(ids.shape[0])

    def rollback(self, kept: int) -> None:
        pass


_BINS = 10          # bins of the draft model's sureness, in tenths
_FORGET = 0.995     # per-round decay of the keep statistics (as the adaptive policy's): follows the text
# Priors, added to the decayed sums (so they never fade): a lookup token kept 1 time in 4, the
# model's 1 in 2, over 2 positions, so that lookup takes over only where the run has shown it wins.
_PRIOR_LOOKUP, _PRIOR_MODEL, _PRIOR_SEEN = 0.5, 1.0, 2.0
_MAX_SETTINGS = 32  # sampling settings a HybridDrafter keeps statistics for (as an Engine's policies)


def sureness_bin(sure: float) -> int:
    """The bin of the draft model's sureness (the probability of its argmax, or the largest of q)."""
    return min(int(sure * _BINS), _BINS - 1)


def prefers_lookup(keeps: np.ndarray, n: int, b: int) -> bool:
    """Whether lookup tokens of match length ``n`` have been kept more often than the model's tokens
    in sureness bin ``b`` (keeps [2, lengths, bins]: lookup's, the model's; both over the same positions)."""
    return keeps[0, n, b] + _PRIOR_LOOKUP > keeps[1, n, b] + _PRIOR_MODEL


class HybridDrafter(ModelDrafter):
    """The draft model, with a prompt-lookup token wherever that is more likely to be kept.

    At each draft position the model computes q as usual; the n-gram index proposes the token that
    followed the latest earlier occurrence of the last 2-4 tokens (committed output and the drafts
    so far). The lookup token takes the position when, in what this run has seen, lookup tokens
    were kept more often than the model's in the same situation: per (match length, bin of the
    model's sureness), where at greedy only positions at which the two differ count. Both keep
    rates are learned after every round from the positions the target examined, whichever token was
    drafted (the target's p scores both), with exponential forgetting.

    Exactness: the choice depends only on the context, the draft's q (its sureness is the largest
    probability of q, not the probability of the token it drew) and earlier rounds, never on this
    round's target call or this position's draw; a replaced position reports q one-hot on the lookup
    token (the distribution it was drawn from), as prompt lookup does. Appendix A.1 holds position
    by position.
    """

    def __init__(self, backend: Backend, max_ngram: int = 4, min_ngram: int = 2):
        super().__init__(backend)
        self.max_ngram, self.min_ngram = max_ngram, min_ngram
        NgramIndex.check(max_ngram, min_ngram)
        # per sampling setting (keep rates depend on it): [2, max_ngram + 1, bins] decayed sums of
        # keeps, row 0 of lookup tokens, row 1 of the model's, and [max_ngram + 1, bins] positions seen
        self._stats: dict[SamplingConfig, tuple[np.ndarray, np.ndarray]] = {}
        self.replaced = 0                                                      # lookup tokens drafted

    def start(self, prompt: np.ndarray) -> None:
        super().start(prompt)
        self._index = NgramIndex(prompt, self.max_ngram, self.min_ngram)
        self._index.sync([])  # the prompt indexed now, not inside the first round's drafting time

    def propose(self, generated: list[int], gamma: int, sampling: SamplingConfig,
                rng: np.random.Generator, vocab: int,
                keep_going: KeepGoing | None = None) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        self._tail = self._index.sync(generated)[-self.max_ngram:]          # the last tokens, then the drafts
        if sampling not in self._stats:
            if len(self._stats) >= _MAX_SETTINGS:
                self._stats.pop(next(iter(self._stats)))  # the oldest setting
            shape = (self.max_ngram + 1, _BINS)
            self._stats[sampling] = (np.zeros((2, *shape)), np.zeros(shape))
        self._rates = self._stats[sampling]
        self._round: list[tuple] = []   # per draft: (model's token at greedy / q [V] otherwise, bin, lookup, length)
        return super().propose(generated, gamma, sampling, rng, vocab, keep_going)

    def _pick(self, g: int, logits: np.ndarray, ids: np.ndarray, q_row: np.ndarray, sampling: SamplingConfig,
              uniform: Callable[[], float], want_conf: bool) -> float:
        conf = super()._pick(g, logits, ids, q_row, sampling, uniform, want_conf)   # the model's draft and q
        model = int(ids[g]) if sampling.greedy else None
        nxt, n = self._index.follower(self._tail)
        look = self._index.tokens[nxt] if nxt is not None else None
        if look is None or look >= logits.shape[0] or look == model:   # (the draft is fed the token next: it needs a row)
            self._round.append((model, 0, None, 0))                    # nothing to choose, nothing to learn
        else:
            b = sureness_bin(self._sureness(logits, q_row, int(ids[g]), conf if want_conf else None, sampling.greedy))
            use = prefers_lookup(self._rates[0], n, b)
            # learn() scores the model against p: at greedy by its token, otherwise by its q (copied
            # when the row is overwritten below)
            self._round.append((model if sampling.greedy else q_row.copy() if use else q_row, b, look, n))
            if use:  # q one-hot on the lookup token: what this position's draft was drawn from
                q_row.fill(0.0)
                q_row[look] = 1.0
                ids[g] = look
                self.replaced += 1
                keeps, seen = self._rates
                conf = float((keeps[0, n, b] + _PRIOR_LOOKUP) / (seen[n, b] + _PRIOR_SEEN))  # the length policy's signal
        self._tail = (self._tail + [int(ids[g])])[-self.max_ngram:]  # (grows while the text is shorter than max_ngram)
        return conf

    @staticmethod
    def _sureness(logits: np.ndarray, q_row: np.ndarray, drawn: int, conf: float | None, greedy: bool) -> float:
        """The model's sureness at this position: at greedy the probability of its argmax (``drawn``);
        with sampling the largest probability of q, NOT q(drawn), so that the choice does not depend
        on the draw (it would then not be the one-hot or the q the position reports)."""
        if not greedy:
            return float(q_row.max())
        return conf if conf is not None else _confidence(logits, drawn)

    def learn(self, examined: int, target_rows: np.ndarray, greedy: bool) -> None:
        """After the verify call: ``target_rows`` are the target's argmaxes [g + 1] at greedy, else
        its processed p [g + 1, V]; the first ``examined`` drafts had the target's own prefix."""
        keeps, seen = self._rates
        keeps *= _FORGET
        seen *= _FORGET
        for j, (model, b, look, n) in enumerate(self._round[:examined]):
            if look is None:
                continue
            if greedy:
                keeps[0, n, b] += float(look == target_rows[j])
                keeps[1, n, b] += float(model == target_rows[j])
            else:
                keeps[0, n, b] += float(target_rows[j][look])                    # q one-hot: kept w.p. p(look)
                keeps[1, n, b] += float(np.minimum(model, target_rows[j]).sum())  # sum_x min(p, q)
            seen[n, b] += 1.0


class NgramIndex:
    """The prompt and the committed output, with the latest occurrence of each of their n-grams
    (min_ngram..max_ngram tokens) that some token follows; indexed incrementally as output grows."""

    def __init__(self, prompt: np.ndarray, max_ngram: int, min_ngram: int):
        self.tokens = [int(t) for t in prompt]
        self._n_prompt = len(self.tokens)
        self.max_ngram, self.min_ngram = max_ngram, min_ngram
        # ngram (tuple) -> index just after its latest occurrence; ngrams ending at positions
        # < self._indexed are in the table. The last position is never indexed: its ngrams are the
        # suffixes we look up, and an occurrence needs at least one following token.
        self._table: dict[tuple[int, ...], int] = {}
        self._indexed = 0

    @staticmethod
    def check(max_ngram: int, min_ngram: int) -> None:
        if not 1 <= min_ngram <= max_ngram:
            from .errors import InvalidArgumentError
            raise InvalidArgumentError(f"need 1 <= min_ngram <= max_ngram; got {min_ngram}, {max_ngram}")

    def sync(self, generated: list[int]) -> list[int]:
        """Make the tokens prompt + ``generated`` (a rollback may have shortened them); return them."""
        toks = self.tokens
        del toks[self._n_prompt:]
        toks.extend(generated)
        end = len(toks) - 1
        for i in range(self._indexed, end):          # index ngrams ending at i (followed by i + 1)
            for n in range(self.min_ngram, min(self.max_ngram, i + 1) + 1):
                self._table[tuple(toks[i - n + 1:i + 1])] = i + 1
        self._indexed = max(self._indexed, end)
        return toks

    def follower(self, tail: list[int]) -> tuple[int | None, int]:
        """(index in ``tokens`` of the token after the latest occurrence of the longest suffix of
        ``tail`` that occurs, its length), or (None, 0)."""
        for n in range(min(self.max_ngram, len(tail)), self.min_ngram - 1, -1):
            nxt = self._table.get(tuple(tail[len(tail) - n:]))
            if nxt is not None:
                return nxt, n
        return None, 0


def lookup(tokens: list[int], gamma: int, max_ngram: int, min_ngram: int) -> list[int]:
    """The up-to-gamma tokens that followed the most recent earlier occurrence of the longest
    suffix (max_ngram down to min_ngram tokens) of ``tokens``; [] if none occurs."""
    n_tok = len(tokens)
    for n in range(min(max_ngram, n_tok - 1), min_ngram - 1, -1):
        suffix = tokens[n_tok - n:]
        # scan right to left for the latest earlier match (recent text predicts best)
        for start in range(n_tok - n - 1, -1, -1):
            if tokens[start:start + n] == suffix:
                return tokens[start + n:start + n + gamma]
    return []
