"""Drafters propose the tokens a speculative round verifies: a second model (the paper's M_q)
or, with no second model, earlier text (prompt lookup / n-gram).

A drafter has ``vocab_size`` (None if it has no vocabulary of its own), ``start(prompt)``,
``room(n_generated)``, ``propose(...) -> (ids [g], q [g, V], confidences [g])`` and
``rollback(kept)``. ``propose`` may return fewer tokens than asked (even none): a draft length
chosen from the draft's own information keeps the round exact (Appendix A.1 holds for any gamma
fixed before the target is consulted)."""
from __future__ import annotations

from typing import Callable

import numpy as np

from .backend import Backend
from .config import SamplingConfig
from .sampling import argmax_token, sample_row

# keep_going(i, confidence) -> bool: after drafting token i (1-based), draft another one?
KeepGoing = Callable[[int, float], bool]


class ModelDrafter:
    """Drafts autoregressively with a draft model through the Backend protocol."""

    def __init__(self, backend: Backend):
        self.backend = backend
        self.vocab_size = backend.vocab_size
        self._base = 0

    def start(self, prompt: np.ndarray) -> None:
        self.backend.prefill(prompt)
        self._base = self.backend.length

    def room(self, generated: int) -> int:
        """How many drafts fit: the draft processes the unseen tokens and gamma - 1 drafts."""
        return self.backend.max_length - self._base - generated + 1

    def propose(self, generated: list[int], gamma: int, sampling: SamplingConfig,
                rng: np.random.Generator, vocab: int,
                keep_going: KeepGoing | None = None) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """Draw up to gamma tokens autoregressively from q (the processed draft distribution)."""
        b = self.backend
        feed = np.asarray(generated[b.length - self._base:], dtype=np.int64)  # [1 or 2] unseen tokens
        ids = np.empty(gamma, dtype=np.int64)                                  # [gamma]
        q = np.empty((gamma, vocab))                                           # [gamma, V]
        conf = np.zeros(gamma)                                                 # [gamma] q_i(x_i)
        g = 0
        greedy = sampling.greedy
        if greedy:
            q.fill(0.0)
        while g < gamma:
            logits = b.extend(feed)[-1:, :vocab]                               # [1, V]
            if greedy:  # q one-hot on the argmax, written into the zeroed row
                ids[g] = argmax_token(logits[0], "draft model")
                q[g, ids[g]] = 1.0
            else:
                ids[g] = sample_row(logits[0], sampling, rng.random(), q[g], "draft model")
            # confidence (only for a length policy): the probability the draft gave its token; for
            # greedy (q one-hot) the draft's softmax probability of its argmax, still a sureness signal.
            if keep_going is not None:
                conf[g] = q[g, ids[g]] if not greedy else 1.0 / np.exp(logits - logits[0, ids[g]]).sum()
            feed = ids[g:g + 1]
            g += 1
            if keep_going is not None and g < gamma and not keep_going(g, conf[g - 1]):
                break
        return ids[:g], q[:g], conf[:g]

    def rollback(self, kept: int) -> None:
        """Keep only the first ``kept`` generated tokens (the draft may hold fewer already)."""
        self.backend.rewind_to(min(self.backend.length, self._base + kept))


class NgramDrafter:
    """Prompt lookup: propose the continuation of the longest earlier match of the last tokens.

    q is one-hot on the proposed token, so the acceptance test keeps x with probability p(x)
    and a rejection draws from norm(max(0, p - onehot(x))): p without x. Still exact.
    """

    vocab_size = None

    def __init__(self, max_ngram: int = 4, min_ngram: int = 1):
        if not 1 <= min_ngram <= max_ngram:
            from .errors import InvalidArgumentError
            raise InvalidArgumentError(f"need 1 <= min_ngram <= max_ngram; got {min_ngram}, {max_ngram}")
        self.max_ngram, self.min_ngram = max_ngram, min_ngram
        self._prompt: list[int] = []

    def start(self, prompt: np.ndarray) -> None:
        self._tokens = [int(t) for t in prompt]
        self._n_prompt = len(self._tokens)
        # ngram (tuple) -> index just after its latest occurrence; ngrams ending at positions
        # < self._indexed are in the table. The last position is never indexed: its ngrams are the
        # suffixes we look up, and an occurrence needs at least one following token.
        self._table: dict[tuple[int, ...], int] = {}
        self._indexed = 0

    def room(self, generated: int) -> int:
        return 1 << 30

    def propose(self, generated: list[int], gamma: int, sampling: SamplingConfig,
                rng: np.random.Generator, vocab: int,
                keep_going: KeepGoing | None = None) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        toks = self._tokens
        del toks[self._n_prompt:]
        toks.extend(generated)
        end = len(toks) - 1
        for i in range(self._indexed, end):          # index ngrams ending at i (followed by i + 1)
            for n in range(self.min_ngram, min(self.max_ngram, i + 1) + 1):
                self._table[tuple(toks[i - n + 1:i + 1])] = i + 1
        self._indexed = max(self._indexed, end)
        found: list[int] = []
        for n in range(min(self.max_ngram, len(toks)), self.min_ngram - 1, -1):
            nxt = self._table.get(tuple(toks[len(toks) - n:]))
            if nxt is not None:
                found = toks[nxt:nxt + gamma]
                break
        ids = np.asarray([t for t in found if t < vocab], dtype=np.int64)     # [g]
        q = np.zeros((ids.shape[0], vocab))                                    # [g, V] one-hot
        q[np.arange(ids.shape[0]), ids] = 1.0
        return ids, q, np.ones(ids.shape[0])

    def rollback(self, kept: int) -> None:
        pass


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
