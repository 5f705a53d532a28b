"""A toy n-gram language model pair in numpy: the speculative loop runs and is tested on it
without ONNX, and ``edgespec toy`` shows the loop end to end in a second."""
from __future__ import annotations

import argparse
import math

import numpy as np

from .config import GenerationConfig, SamplingConfig
from .errors import InvalidArgumentError
from .cli import at_least
from .loop import generate
from . import theory


class ToyLM:
    """Logits that depend on the last ``order - 1`` tokens through a random table.

    ``logits(prefix)`` is a pure function, so tests can enumerate the exact output distribution.
    """

    def __init__(self, vocab_size: int, order: int = 2, seed: int = 0, scale: float = 2.0,
                 table: np.ndarray | None = None):
        if vocab_size < 2 or order < 1:
            raise InvalidArgumentError("ToyLM needs vocab_size >= 2 and order >= 1")
        self.vocab_size, self.order = vocab_size, order
        rows = vocab_size ** (order - 1)
        self.table = (table if table is not None else
                      np.random.default_rng(seed).normal(0.0, scale, (rows, vocab_size))).astype(np.float32)  # [rows, V]
        self._weights = [vocab_size ** j for j in range(order - 1)]  # context digit weights

    def perturbed(self, noise: float, seed: int = 1) -> "ToyLM":
        """A draft: the same table plus Gaussian noise (more noise, lower alpha)."""
        rng = np.random.default_rng(seed)
        return ToyLM(self.vocab_size, self.order, table=self.table + rng.normal(0.0, noise, self.table.shape))

    def context_row(self, prefix) -> int:
        ctx = list(prefix)[-(self.order - 1):] if self.order > 1 else []
        ctx = [0] * (self.order - 1 - len(ctx)) + ctx
        # the newest token is the lowest digit, as in ToyBackend.extend
        return sum(tok * w for tok, w in zip(reversed(ctx), self._weights))

    def logits(self, prefix) -> np.ndarray:
        return self.table[self.context_row(prefix)]


class ToyBackend:
    """Backend protocol over a ToyLM: a preallocated token buffer indexed by position."""

    def __init__(self, model: ToyLM, max_length: int = 4096):
        self.model = model
        self.vocab_size = model.vocab_size
        self.max_length = max_length
        self._tokens = np.zeros(max_length, dtype=np.int64)     # [max_length]
        self._weights = model._weights
        self._n = 0
        self.calls = 0

    @property
    def length(self) -> int:
        return self._n

    def prefill(self, ids: np.ndarray) -> np.ndarray:
        self._n = 0
        return self.extend(ids)[-1]

    def extend(self, ids: np.ndarray) -> np.ndarray:
        ids = np.asarray(ids, dtype=np.int64).reshape(-1)        # [k]
        k, n, o = ids.shape[0], self._n, self.model.order
        if k < 1 or n + k > self.max_length:
            raise InvalidArgumentError(f"extend needs 1..{self.max_length - n} tokens; got {k}")
        self._tokens[n:n + k] = ids
        self._n = n + k
        self.calls += 1
        # Row of the new token at position t: the tokens t-o+2..t (zero-padded on the left).
        toks, w = self._tokens, self._weights
        rows = [sum(int(toks[t - j]) * w[j] for j in range(o - 1) if t - j >= 0) for t in range(n, n + k)]
        return self.model.table[rows]                            # [k, V]

    def rewind_to(self, n: int) -> None:
        if not 0 <= n <= self._n:
            raise InvalidArgumentError(f"rewind_to({n}) outside 0..{self._n}")
        self._n = n

    def free(self) -> None:
        self._n = 0


def toy_pair(vocab_size: int = 32, order: int = 2, noise: float = 0.7, seed: int = 0,
             max_length: int = 4096) -> tuple[ToyBackend, ToyBackend]:
    """A target and a draft (the target's table plus noise)."""
    target = ToyLM(vocab_size, order, seed=seed)
    return ToyBackend(target, max_length), ToyBackend(target.perturbed(noise, seed + 1), max_length)


# ----------------------------------------------------------------------------- CLI: edgespec toy
TOY_MAX_ENTRIES = 1 << 24   # 64 MB of float32 per model table
TOY_MAX_TOKENS = 1_000_000
TOY_MAX_NOISE = 1e6        # N(0, 1e6) stays far inside float32 (it overflowed to inf at 1e300)


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--vocab", type=int, default=64, help="vocabulary size of the toy models (default 64)")
    p.add_argument("--order", type=int, default=2, help="n-gram order of the toy models (default 2)")
    p.add_argument("--noise", type=float, default=0.7,
                   help=f"draft = target table + N(0, noise) (lower: higher alpha; 0 to {TOY_MAX_NOISE:g}, default 0.7)")
    p.add_argument("--gamma", type=int, default=4, help="draft tokens per round (default 4)")
    p.add_argument("--temperature", type=float, default=1.0, help="0 = greedy (default 1.0)")
    p.add_argument("--top-k", type=int, default=0, help="sample from the k likeliest tokens (default 0: all)")
    p.add_argument("--top-p", type=float, default=1.0, help="nucleus sampling (default 1.0: off)")
    p.add_argument("--max-new-tokens", type=int, default=2000, help="tokens to generate, plain and speculative (default 2000)")
    p.add_argument("--seed", type=at_least(0), default=0, help="seed of the tables and of the sampling (default 0)")


def run(args: argparse.Namespace) -> int:
    if args.gamma < 1:
        raise InvalidArgumentError(f"--gamma must be an integer >= 1 (the toy drafts a fixed number per round); got {args.gamma}")
    if not math.isfinite(args.noise) or not 0 <= args.noise <= TOY_MAX_NOISE:
        # (the tables are float32: 1e300 overflowed to inf, and the loop then blamed an exported model)
        raise InvalidArgumentError(f"--noise must be a number in [0, {TOY_MAX_NOISE:g}] (0: the draft is the target; "
                                   f"from about 10 up it is unrelated to the target); got {args.noise}")
    if args.vocab < 2 or args.order < 1:
        raise InvalidArgumentError(f"--vocab must be >= 2 and --order >= 1; got --vocab {args.vocab} --order {args.order}")
    # the models are tables of vocab ** order logits, held in memory (twice: target and draft)
    if args.vocab ** args.order > TOY_MAX_ENTRIES:
        raise InvalidArgumentError(f"--vocab {args.vocab} --order {args.order} makes tables of {args.vocab ** args.order:,} "
                                   f"logits; keep vocab ** order <= {TOY_MAX_ENTRIES:,} (e.g. --vocab 4096 --order 2)")
    if not 1 <= args.max_new_tokens <= TOY_MAX_TOKENS:
        raise InvalidArgumentError(f"--max-new-tokens must be in [1, {TOY_MAX_TOKENS:,}]; got {args.max_new_tokens}")
    cfg = GenerationConfig(max_new_tokens=args.max_new_tokens, gamma=args.gamma,
                           max_gamma=max(8, args.gamma),
                           sampling=SamplingConfig(args.temperature, args.top_k, args.top_p))
    target, draft = toy_pair(args.vocab, args.order, args.noise, args.seed, args.max_new_tokens + 8)
    plain = generate(target, [0], cfg, np.random.default_rng(args.seed))
    spec = generate(target, [0], cfg, np.random.default_rng(args.seed), draft=draft)
    s = spec.stats
    print(f"toy pair: vocab {args.vocab}, order {args.order}, draft noise {args.noise}, gamma {args.gamma}, "
          f"T={args.temperature}, top_k={args.top_k}, top_p={args.top_p}")
    print(f"  plain:       {plain.stats.emitted} tokens in {plain.stats.target_calls} target calls")
    print(f"  speculative: {s.emitted} tokens in {s.target_calls} target calls "
          f"({s.tokens_per_target_call:.2f} tokens per target call)")
    if not s.rounds:  # the first token is the prompt's; a round drafts at least one token before the last
        print("  no speculative round ran: too few new tokens to draft any (raise --max-new-tokens)")
        return 0
    print(f"  alpha (mean sum min(p, q)) = {s.alpha:.3f}, acceptance rate = {s.acceptance_rate:.3f}")
    print(f"  tokens per round: measured {s.tokens_per_round:.3f}, "
          f"(1 - a^(g+1)) / (1 - a) = {theory.expected_tokens(min(s.alpha, 1.0), args.gamma):.3f}")
    print(f"  accepted-length histogram (rounds that kept n = 0, 1, ... drafts): {s.accepted_hist}")
    print("  (toy models cost nothing to run, so no wall-clock speedup is claimed here; see `edgespec demo`)")
    return 0
