"""The speculative decoding loop and the plain autoregressive loop, over the Backend protocol.

Bookkeeping: ``generated`` holds the committed new tokens. The target's cache always holds the
prompt and every committed token except the last one (the "pending" token): a round feeds the
pending token plus the gamma drafts in ONE target call and gets p_1..p_{gamma+1} back.
"""
from __future__ import annotations

import time
from dataclasses import asdict, dataclass, field
from typing import Callable, Generator, Sequence

import numpy as np

from .backend import Backend, prompt_limit
from .config import GenerationConfig
from .errors import InvalidArgumentError, PromptTooLongError
from .adaptive import AdaptiveGamma
from .drafters import ModelDrafter, NgramDrafter  # noqa: F401  (re-exported)
from .rejection import TARGET, greedy_verdict, overlap, speculative_sample
from .sampling import argmax_rows, argmax_token, process_logits, sample_row


@dataclass
class GenerationStats:
    """Counters and timings of one generate call (all times in seconds)."""

    rounds: int = 0                  # speculative rounds (one target call each)
    target_calls: int = 0            # all target forward calls, prefill included
    draft_calls: int = 0             # draft steps, one per drafted token (a model drafter: one forward call each)
    drafted: int = 0                 # draft tokens proposed
    accepted: int = 0                # draft tokens the target kept (an EOS/stop id may cut some from the output)
    emitted: int = 0                 # tokens committed (the output length)
    round_tokens: int = 0            # tokens committed by speculative rounds (1 + plain_steps + this = emitted)
    plain_steps: int = 0             # target steps without drafts: declined_steps + empty_drafts + those
                                     # with no room to draft (a run's last token, the draft's last positions)
    declined_steps: int = 0          # plain steps the adaptive policy chose (faster than drafted rounds)
    empty_drafts: int = 0            # plain steps after the drafter proposed nothing (a lookup found no match)
    accepted_hist: list[int] = field(default_factory=list)  # [n] rounds that kept n drafts
    gamma_hist: list[int] = field(default_factory=list)     # [g] rounds drafted with gamma g
    beta_sum: float = 0.0            # sum of sum_x min(p, q) over examined draft positions
    beta_count: int = 0
    keep_sum: float = 0.0            # sum of the test's keep probability sum_x min(q, p / l) (= beta_sum at l = 1)
    prefill_s: float = 0.0
    draft_s: float = 0.0
    target_s: float = 0.0
    plain_step_s: float = 0.0        # the part of target_s spent on plain steps (no drafts) inside the run
    catch_up_s: float = 0.0          # the draft reading tokens committed by plain steps (before a round drafts)
    empty_draft_s: float = 0.0       # proposals that came back empty (not in draft_s: no draft step to divide by)
    sample_s: float = 0.0
    total_s: float = 0.0
    ttft_s: float = 0.0              # time to first token

    @property
    def acceptance_rate(self) -> float:
        """Kept drafts over examined drafts (each round examines up to the first rejection)."""
        return self.accepted / self.beta_count if self.beta_count else float("nan")

    @property
    def draft_efficiency(self) -> float:
        """Kept drafts over all drafts proposed (drafts after a rejection count as wasted)."""
        return self.accepted / self.drafted if self.drafted else float("nan")

    @property
    def alpha(self) -> float:
        """alpha = E[beta], estimated over the processed distributions of examined positions."""
        return self.beta_sum / self.beta_count if self.beta_count else float("nan")

    @property
    def tokens_per_round(self) -> float:
        return self.round_tokens / self.rounds if self.rounds else float("nan")

    @property
    def tokens_per_target_call(self) -> float:
        return self.emitted / self.target_calls if self.target_calls else float("nan")

    @property
    def c(self) -> float:
        """Measured cost coefficient: time of one draft call / time of one verify call (the
        target's calls of the speculative rounds; prefill and plain steps excluded).

        The draft time is what the loop waited for drafts: with the lookahead drafter, drafting in
        the caller's thread plus waiting for its worker, over all drafted tokens (reused ones too)."""
        verify_s, verify_calls = self.verify
        if not self.draft_calls or verify_calls <= 0 or verify_s <= 0:
            return float("nan")
        return (self.draft_s / self.draft_calls) / (verify_s / verify_calls)

    @property
    def verify(self) -> tuple[float, int]:
        """(seconds, calls) of the target's verify calls: all calls but the prefill and plain steps."""
        return self.target_s - self.plain_step_s, self.target_calls - 1 - self.plain_steps

    @property
    def tokens_per_second(self) -> float:
        return self.emitted / self.total_s if self.total_s > 0 else float("nan")

    def record_round(self, gamma: int, n: int, emitted: int) -> None:
        for hist, i in ((self.accepted_hist, n), (self.gamma_hist, gamma)):
            if len(hist) <= i:
                hist.extend([0] * (i + 1 - len(hist)))
            hist[i] += 1
        self.rounds += 1
        self.drafted += gamma
        self.accepted += n
        self.round_tokens += emitted

    def to_dict(self) -> dict:
        d = asdict(self)
        for name in ("acceptance_rate", "draft_efficiency", "alpha", "tokens_per_round", "tokens_per_target_call", "c", "tokens_per_second"):
            d[name] = getattr(self, name)
        return d


class Block(list):
    """A list of newly committed token ids, with ``sources`` (accepted/recovered/bonus/target)."""

    sources: list[str]


@dataclass
class GenerationResult:
    tokens: list[int]          # new tokens only
    sources: list[str]         # per token: accepted / recovered / bonus / target
    finish_reason: str         # eos / stop / length
    stats: GenerationStats


def _check_prompt(prompt_ids: Sequence[int], target: Backend) -> np.ndarray:
    if isinstance(prompt_ids, (str, bytes, bytearray)):
        raise InvalidArgumentError("prompt_ids takes token ids; encode text first (engine.encode(text)), or call "
                                   "engine.generate(text), which does")
    try:
        given = np.asarray(prompt_ids)
    except (TypeError, ValueError) as exc:  # (ragged nesting)
        raise InvalidArgumentError(f"prompt_ids must be a 1-D sequence of integer token ids; got {prompt_ids!r:.80}") from exc
    if given.size == 0:
        raise InvalidArgumentError("the prompt is empty; pass at least one token (or non-empty text)")
    # (int64 casting would truncate 1.7 to 1 and read True as 1: a caller's bug, not a token)
    if given.ndim != 1 or given.dtype.kind not in "iu" or (  # (numpy makes [True, 2] an int array)
            not isinstance(prompt_ids, np.ndarray) and any(isinstance(i, (bool, np.bool_)) for i in prompt_ids)):
        raise InvalidArgumentError(f"prompt_ids must be a 1-D sequence of integer token ids (not floats or bools); got "
                                   f"{prompt_ids!r:.80}")
    if given.dtype.kind == "u" and given.max() > np.iinfo(np.int64).max:
        raise InvalidArgumentError(f"prompt token ids must be in [0, {target.vocab_size}); got max {given.max()}")
    prompt = given.astype(np.int64)                                            # [P]
    if prompt.min() < 0 or prompt.max() >= target.vocab_size:
        raise InvalidArgumentError(
            f"prompt token ids must be in [0, {target.vocab_size}); got min {prompt.min()}, max {prompt.max()}")
    if prompt.size > prompt_limit(target):
        raise PromptTooLongError(
            f"the prompt has {prompt.size} tokens but the model takes at most {prompt_limit(target)}; shorten it", "prompt")
    return prompt


def speculative_step(target: Backend, drafter, generated: list[int], gamma: int,
                     config: GenerationConfig, rng: np.random.Generator, vocab: int,
                     stats: GenerationStats, policy: AdaptiveGamma | None = None) -> tuple[list[int], list[str]]:
    """One round of Algorithm 1: draft up to gamma tokens, verify them in one target call, accept.

    ``generated`` is the committed output so far (its last token is pending: not yet in the
    target's cache). Returns the new tokens (1..gamma+1) and their sources.
    """
    sampling, t0 = config.sampling, time.perf_counter()
    caught = getattr(drafter, "catch_up_s", 0.0)  # a draft model reading tokens of plain steps first
    conf_s = getattr(drafter, "confidence_s", 0.0)
    # 1. draft: x_1..x_g ~ q autoregressively (g <= gamma; the policy may stop early).
    keep_going = policy.start_round() if policy is not None else None
    reused = getattr(drafter, "reused_rounds", 0)  # a lookahead drafter's rounds drafted during the last verify
    x, q, conf = drafter.propose(generated, gamma, sampling, rng, vocab, keep_going)  # [g], [g, V], [g]
    g = x.shape[0]
    t1 = time.perf_counter()
    reused = getattr(drafter, "reused_rounds", 0) != reused
    caught = getattr(drafter, "catch_up_s", 0.0) - caught
    conf_s = getattr(drafter, "confidence_s", 0.0) - conf_s
    t0 += caught  # not drafting: a one-off cost of the plain steps before (stats.catch_up_s)
    # 2. verify: one target call over [pending, x_1..x_g] gives p_1..p_{g+1}.
    logits = target.extend(np.concatenate(([generated[-1]], x)))[:, :vocab]     # [g+1, V]
    t2 = time.perf_counter()
    waited = getattr(drafter, "wait_s", 0.0)  # a lookahead drafter's waits for its worker (draft time)
    # 3. accept: leading drafts kept, then a recovered or bonus token.
    if sampling.greedy:  # p one-hot: the test reduces to comparing argmaxes (greedy_verdict)
        a = argmax_rows(logits, "target model")                                 # [g+1]
        verdict = greedy_verdict(x, a)
    else:
        p = process_logits(logits, sampling, "target model")                    # [g+1, V]
        verdict = speculative_sample(x, q, p, rng, config.lenience, getattr(drafter, "next_draft", None))
    n = verdict.n_accepted
    examined = min(n + 1, g)  # positions whose prefix the target agreed with
    learn = getattr(drafter, "learn", None)  # a drafter that learns from the target's verdicts (HybridDrafter)
    if learn is not None:
        learn(examined, a if sampling.greedy else p, sampling.greedy)
    # beta = sum_x min(p, q) per examined position; with p one-hot on a that is q(a).
    if sampling.greedy:  # (examined <= gamma scalars: Python, not numpy calls; see argmax_rows)
        beta_total = float(sum(q[i, t] for i, t in enumerate(a[:examined].tolist())))
    else:
        beta_total = float(overlap(p[:examined], q[:examined]).sum())
    stats.beta_sum += beta_total
    stats.beta_count += examined
    # The test keeps x with probability min(1, p(x) / (l q(x))): on average sum_x min(q, p / l) per
    # position (Appendix A.5), beta itself at l = 1 and at greedy (greedy_verdict ignores l). For a
    # lenience near 1e-308, p / l overflows to inf and the minimum is q, as it should be (the numpy
    # warning is not the user's concern).
    lenient = not sampling.greedy and config.lenience < 1
    if lenient:
        with np.errstate(over="ignore"):
            stats.keep_sum += float(np.minimum(q[:examined], p[:examined] / config.lenience).sum())
    else:
        stats.keep_sum += beta_total
    # Roll back by moving positions: the target keeps pending + x_1..x_n, the new pending token
    # is the verdict's; the draft keeps at most the same prefix.
    target.rewind_to(target.length - g + n)
    drafter.rollback(len(generated) + n)
    t3 = time.perf_counter()
    waited = getattr(drafter, "wait_s", 0.0) - waited
    stats.target_calls += 1
    stats.catch_up_s += caught
    stats.target_s += t2 - t1
    stats.sample_s += t3 - t2 - waited
    if policy is not None:  # the verify side of a round: the target call and the acceptance test
        policy.update(conf, n, t1 - t0, t3 - t1, verdict.keep, confidence_s=conf_s, reused=reused)
    tokens = [int(t) for t in x[:n]] + [verdict.token]
    if g == 0:  # the drafter had nothing to propose: this was a plain target step
        # (its lookup time is kept apart: charged to draft_s it raised c, with no draft step
        # counted to divide it by)
        stats.empty_drafts += 1
        stats.empty_draft_s += t1 - t0 + waited
        stats.plain_steps += 1
        stats.plain_step_s += t2 - t1
        return tokens, [TARGET]
    stats.draft_calls += g
    stats.draft_s += t1 - t0 + waited
    stats.record_round(g, n, len(tokens))
    return tokens, ["accepted"] * n + [verdict.kind]


def _plain_step(target: Backend, generated: list[int], config: GenerationConfig,
                rng: np.random.Generator, vocab: int, stats: GenerationStats,
                policy: AdaptiveGamma | None = None) -> int:
    t0 = time.perf_counter()
    logits = target.extend(np.asarray(generated[-1:], dtype=np.int64))[:, :vocab]  # [1, V]
    t1 = time.perf_counter()
    if config.sampling.greedy:
        token = argmax_token(logits[0], "target model")
    else:
        token = sample_row(logits[0], config.sampling, rng.random(), np.empty(vocab), "target model")
    stats.target_calls += 1
    stats.plain_steps += 1
    stats.target_s += t1 - t0
    stats.plain_step_s += t1 - t0
    t2 = time.perf_counter()
    stats.sample_s += t2 - t1
    if policy is not None:
        policy.record_plain(t2 - t0)
    return token


def iter_generate(target: Backend, prompt_ids: Sequence[int], config: GenerationConfig,
                  rng: np.random.Generator, draft=None,
                  policy: AdaptiveGamma | None = None) -> Generator[Block, None, GenerationResult]:
    """Generate, yielding each Block of committed tokens as soon as it is committed.

    ``draft`` is a Backend (a draft model), a drafter object (``start``/``propose``/``rollback``),
    or None for plain autoregressive decoding. With ``config.gamma=None``, ``policy`` chooses the
    draft length per round and keeps learning (pass the same one to later calls to carry what it
    learned over; default: a fresh AdaptiveGamma). The generator's return value is the
    GenerationResult. Randomness comes only from ``rng``: the same seed gives the same output
    (except with an adaptive policy at temperature > 0: its draft lengths follow measured call
    times, so the same seed may consume the generator differently; the distribution is unchanged).
    """
    if not isinstance(rng, np.random.Generator):
        raise InvalidArgumentError("rng must be a numpy.random.Generator, e.g. np.random.default_rng(seed)")
    if not isinstance(config, GenerationConfig):
        raise InvalidArgumentError(f"config must be an edgespec.GenerationConfig, e.g. GenerationConfig(max_new_tokens=32, "
                                   f"sampling=SamplingConfig(temperature=0)); got {type(config).__name__}")
    prompt = _check_prompt(prompt_ids, target)
    # A drafter has propose(); anything else is taken as a draft model's Backend.
    drafter = draft if draft is None or hasattr(draft, "propose") else ModelDrafter(draft)
    # The sample space is the target's ids (a draft with fewer rows gives the others q = 0), so the
    # output is distributed as plain decoding's whatever the draft's vocabulary.
    vocab = min(v for v in (target.vocab_size, config.vocab_size) if v is not None)
    stats = GenerationStats()
    out: list[int] = []
    sources: list[str] = []
    start = time.perf_counter()

    def commit(tokens: list[int], kinds: list[str]) -> tuple[list[int], str | None]:
        """Append tokens, cutting at EOS, a stop id or max_new_tokens inside the block."""
        block = Block()
        block.sources = []
        for tok, kind in zip(tokens, kinds):
            out.append(tok)
            sources.append(kind)
            block.append(tok)
            block.sources.append(kind)
            if tok in config.eos_token_ids:
                return block, "eos"
            if tok in config.stop_token_ids:
                return block, "stop"
            if len(out) >= config.max_new_tokens:
                return block, "length"
        return block, None

    # Prefill the target; the first token comes from its prefill logits (a plain step). The draft
    # is prefilled at the first drafted round, after that token is out: the first token costs what it
    # costs without a draft (and a call the adaptive policy runs on plain steps only never needs it).
    t0 = time.perf_counter()
    logits = target.prefill(prompt)[None, :vocab]                                 # [1, V]
    stats.prefill_s = time.perf_counter() - t0
    # The last committed token is never fed to the target, hence the -1. (For an encoder-decoder
    # the backend's length counts decoder positions only, so the prompt does not count here.)
    if target.length + config.max_new_tokens - 1 > target.max_length:
        room = target.max_length - target.length + 1
        if getattr(target, "is_encoder_decoder", target.length < prompt.size):  # the prompt went to the encoder
            raise PromptTooLongError(f"max_new_tokens ({config.max_new_tokens}) exceeds the decoder's {target.max_length} "
                                     f"positions; lower max_new_tokens to at most {max(room, 0)}", "max_new_tokens")
        raise PromptTooLongError(
            f"prompt ({prompt.size} tokens) + max_new_tokens ({config.max_new_tokens}) needs "
            f"{prompt.size + config.max_new_tokens - 1} of the model's {target.max_length} positions (the last new token "
            f"is not fed back); shorten the prompt or lower max_new_tokens to at most {max(room, 0)}")
    stats.target_calls = 1
    first = sample_row(logits[0], config.sampling, rng.random(), np.empty(vocab), "target model")
    block, reason = commit([first], [TARGET])
    stats.ttft_s = time.perf_counter() - start
    yield block
    if config.gamma is None and drafter is not None:
        policy = policy if policy is not None else AdaptiveGamma(config.max_gamma)
    else:
        policy = None
    started, mine = False, None  # the draft's prefill waits for the first drafted round (there may be none)
    if hasattr(drafter, "end_ids"):  # drafting stops at an EOS or stop id: nothing after it is emitted
        drafter.end_ids = frozenset(config.eos_token_ids) | frozenset(config.stop_token_ids)
    try:
        while reason is None:
            remaining = config.max_new_tokens - len(out)
            gamma = 0
            if drafter is not None:
                # Never draft past what can be emitted or what the caches can hold.
                gamma = max(0, min(config.gamma or config.max_gamma, remaining - 1, target.max_length - target.length - 1))
            if gamma > 0 and policy is not None and not policy.draft_next():
                gamma = 0  # plain steps have been faster than drafted rounds (gamma = 0 in Theorem 3.8's objective)
                stats.declined_steps += 1
            if gamma > 0:
                if not started:
                    t0 = time.perf_counter()
                    drafter.start(prompt)
                    stats.prefill_s += time.perf_counter() - t0
                    started, mine = True, getattr(drafter, "starts", None)
                gamma = min(gamma, drafter.room(len(out)))
            if gamma > 0:
                tokens, kinds = speculative_step(target, drafter, out, gamma, config, rng, vocab, stats, policy)
            else:
                tokens, kinds = [_plain_step(target, out, config, rng, vocab, stats, policy)], [TARGET]
            block, reason = commit(tokens, kinds)
            # An EOS or stop id inside a round cuts the tokens after it from the output: round_tokens
            # counts the output; accepted/beta keep the target's verdict (a property of the pair).
            stats.round_tokens -= len(tokens) - len(block)
            yield block
    except BaseException:  # an error, Ctrl-C or a stream closed early: no drafting thread may outlive the round
        # Only if the drafter still runs this generation: a stream closed (or superseded) and
        # collected later must not stop the worker of the generation that took the engine since.
        if started and hasattr(drafter, "abandon") and getattr(drafter, "starts", None) == mine:
            drafter.abandon()
        raise
    stats.emitted = len(out)
    stats.total_s = time.perf_counter() - start
    return GenerationResult(out, sources, reason, stats)


def generate(target: Backend, prompt_ids: Sequence[int], config: GenerationConfig,
             rng: np.random.Generator, draft=None,
             on_tokens: Callable[[list[int]], None] | None = None,
             policy: AdaptiveGamma | None = None) -> GenerationResult:
    """Run :func:`iter_generate` to the end; ``on_tokens`` receives each committed block."""
    it = iter_generate(target, prompt_ids, config, rng, draft, policy)
    while True:
        try:
            block = next(it)
        except StopIteration as stop:
            return stop.value
        if on_tokens is not None:
            on_tokens(block)
