"""``edgespec.load(bundle)``: the Python entry point for generation from an exported bundle.

Needs only numpy, onnxruntime and tokenizers (no torch, no transformers)::

    gen = edgespec.load("bundles/llama", providers=["cpu"], threads=4)
    out = gen.generate("The quick brown fox", max_new_tokens=32, temperature=0, seed=0)
    print(out.text, out.stats.to_dict())
    for piece in gen.generate("Hello", stream=True):   # pieces as they are committed
        print(piece, end="", flush=True)

An ``Engine`` owns one sequence's KV caches. It may be shared across threads: generate calls are
serialized (a call waits until the running one, or an open stream of another thread, finishes).
A stream holds the engine from its first step until it is exhausted, closed (``stream.close()``,
``with`` block, ``break`` out of the ``for`` loop) or garbage-collected. In one thread, a new
generate call supersedes a stream that is still open there, when the new call starts generating
(a new stream: at its first step): the old stream then raises EngineBusyError instead of
continuing from caches it no longer owns.
"""
from __future__ import annotations

import math
import os
import threading
import time
import weakref
from dataclasses import dataclass
from pathlib import Path
from typing import Iterable, Iterator, Sequence

import numpy as np

from . import contract
from .adaptive import AdaptiveGamma
from .backend import draft_limit_words, draft_prompt_limit, prompt_limit
from .bundle import BundleManifest, load_bundle
from .config import DRAFTERS, GenerationConfig, SamplingConfig, as_float, as_int
from .drafters import HybridDrafter, LookaheadDrafter, NgramDrafter
from .report import usable_cores
from .errors import (BundleError, EdgeSpecError, EngineBusyError, InvalidArgumentError, PromptTooLongError,
                     TokenizerMismatchError, warn)

DEFAULT_MAX_GAMMA = 8
# A verify call's cost per extra token, in target steps, for a seeded adaptive run (which does not
# measure): 0.09 on the benchmark CPU (fp32, one core); an accelerator's is near 0, so this errs
# toward shorter drafts there.
VERIFY_SLOPE = 0.1


@dataclass(frozen=True)
class GenerationOutput:
    """One finished generation: new text and ids, per-token sources, why it stopped, statistics."""

    text: str
    ids: list[int]
    sources: list[str]  # per token: accepted / recovered / bonus / target
    finish_reason: str  # eos / stop / length
    stats: object  # edgespec.loop.GenerationStats
    prompt_ids: list[int]
    drafter: str | None = None  # the drafter that ran (model, lookahead, hybrid, ngram); None: plain decoding


class StreamChunk(str):
    """Tokens committed in one step and the text they completed. It is that text (a ``str``, so
    ``"".join(stream)`` is the generated text); ``.ids`` are the tokens. Two chunks are equal when
    text and ids are; a chunk is true when it commits tokens, even if its text is held back (an
    incomplete UTF-8 character)."""

    ids: list[int]

    def __new__(cls, text: str, ids: list[int]):
        self = super().__new__(cls, text)
        self.ids = ids
        return self

    @property
    def text(self) -> str:
        return str.__str__(self)

    def __getnewargs__(self):  # copy and pickle
        return (self.text, self.ids)

    def __eq__(self, other):
        if isinstance(other, StreamChunk):
            return self.text == other.text and self.ids == other.ids
        return str.__eq__(self, other)

    def __ne__(self, other):
        return not self == other

    __hash__ = str.__hash__  # equal chunks have equal text

    def __bool__(self) -> bool:
        return bool(self.ids) or bool(self.text)

    def __repr__(self) -> str:
        return f"StreamChunk(text={self.text!r}, ids={self.ids!r})"


class _Detokenizer:
    """Incremental decoding: emit the text that the newest tokens added, holding back an
    incomplete UTF-8 sequence (byte-level BPE splits characters across tokens)."""

    def __init__(self, tokenizer):
        self._tok = tokenizer
        self.ids: list[int] = []
        self._emitted = 0

    def push(self, ids: list[int]) -> str:
        self.ids.extend(ids)
        text = self.text()
        return "" if text.endswith("\ufffd") else self._take(text)

    def text(self) -> str:
        return self._tok.decode(self.ids, skip_special_tokens=True)

    def flush(self) -> str:
        """At the end: the text held back because it ended inside a character (it never will be completed)."""
        return self._take(self.text())

    def _take(self, text: str) -> str:
        piece, self._emitted = text[self._emitted:], len(text)
        return piece


class _Lease:
    """The right to use an Engine's backends for one generate call (or one stream)."""

    __slots__ = ("thread", "revoked", "stepping", "closed")

    def __init__(self):
        self.thread = threading.get_ident()
        self.revoked = False
        self.stepping = False  # a step is running on the backends now (in whichever thread)
        self.closed = False    # released while a step ran: the engine is given back when that step ends


class _EngineGuard:
    """Serializes generate calls on one Engine. A call waits while another thread holds the engine;
    a holder of the *same* thread is an open stream, which is revoked rather than waited for (that
    would deadlock), once the step it may be running in another thread (a stream handed to a
    worker) has ended."""

    def __init__(self):
        self._cond = threading.Condition(threading.Lock())
        self._holder: _Lease | None = None
        self.timeout: float | None = None  # seconds to wait for another thread; None = forever

    def acquire(self) -> _Lease:
        lease = _Lease()
        # (one deadline: each step of the holder wakes the waiters, which restarted the full timeout)
        deadline = None if self.timeout is None else time.monotonic() + self.timeout
        with self._cond:
            while self._holder is not None:
                if self._holder.thread == lease.thread:
                    self._holder.revoked = True   # its next step raises; one running now ends first
                    if not self._holder.stepping:
                        break
                    self._cond.wait()
                    continue
                if deadline is None:
                    self._cond.wait()
                    continue
                left = deadline - time.monotonic()
                if (left <= 0 or not self._cond.wait(left)) and self._holder is not None:
                    raise EngineBusyError(
                        f"the engine is still busy with another thread's generate call after {self.timeout} s; "
                        "finish or close that stream first, or load one engine per thread (edgespec.load)")
            self._holder = lease
        return lease

    def begin_step(self, lease: _Lease) -> None:
        """Mark a stream's step as running, unless the stream was superseded (checked under the same
        lock as the revocation, so a step never starts on caches another call has taken)."""
        with self._cond:
            if lease.revoked:
                raise EngineBusyError(_SUPERSEDED)
            lease.stepping = True

    def end_step(self, lease: _Lease) -> None:
        with self._cond:
            lease.stepping = False
            if lease.closed and self._holder is lease:
                self._holder = None
            self._cond.notify_all()

    def release(self, lease: _Lease | None) -> None:
        if lease is None:
            return
        with self._cond:
            if lease.stepping:
                # Closed from another thread (a cancel button) while the stream's step runs in its
                # consumer's: giving the engine back now let the next call prefill caches that step
                # then wrote to (a review's find). The step ends first; end_step gives it back.
                lease.revoked = lease.closed = True
                return
            if self._holder is lease:
                self._holder = None
                self._cond.notify_all()


_SUPERSEDED = ("this stream was superseded: a later generate call or engine.close() on the same engine (in this "
               "thread) took over the model's caches before the stream was finished; finish or close() a stream "
               "before starting another generate call, or start this generation again")


class _StreamCore:
    """What a stream's generator works on: the blocks, the engine lease, the result. The generator
    refers to this, never to the TextStream, so that dropping a stream (even one whose iterator
    ``next(stream)`` holds) frees it at once and its ``__del__`` gives the engine back."""

    def __init__(self, blocks, detok: _Detokenizer | None, finish, guard: _EngineGuard | None):
        self.blocks, self.detok, self.finish, self.guard = blocks, detok, finish, guard
        self.result: GenerationOutput | None = None
        self.lease: _Lease | None = None
        self.closed = False

    def steps(self) -> Iterator[StreamChunk]:
        try:
            if self.closed:
                return
            if self.guard is not None:
                self.lease = self.guard.acquire()
            lease = self.lease
            while not self.closed:
                if lease is not None:
                    self.guard.begin_step(lease)
                try:
                    block, ended = next(self.blocks), None
                except StopIteration as stop:
                    ended = stop
                finally:
                    if lease is not None:
                        self.guard.end_step(lease)
                if ended is not None:
                    self.result = self.finish(ended.value)
                    tail = self.detok.flush() if self.detok is not None else ""
                    if tail:  # generation ended inside a multi-byte character: its bytes decode as U+FFFD
                        yield StreamChunk(tail, [])
                    return
                # without a detokenizer (the non-streaming call) no text is decoded per block
                yield StreamChunk(self.detok.push(block) if self.detok is not None else "", list(block))
        finally:  # exhausted, error, KeyboardInterrupt in the consumer, break (generator closed), or GC
            self.close()

    def close(self) -> None:
        self.closed = True
        lease, self.lease = self.lease, None
        if self.guard is not None:
            self.guard.release(lease)


class TextStream:
    """Iterator over ``StreamChunk`` s as tokens are committed; ``.result`` once it is exhausted.

    The stream holds its engine from its first step until it is exhausted or closed (``close()``,
    a ``with`` block, dropping the stream, or leaving a ``for`` loop over it early). ``next(stream)``
    takes one chunk at a time and keeps the stream open between calls: a ``for`` loop over it then
    goes on from there, and leaving that loop early no longer ends it (``close()`` does)."""

    def __init__(self, blocks, detok: _Detokenizer | None, finish, guard: _EngineGuard | None = None):
        self._core = _StreamCore(blocks, detok, finish, guard)
        self._steps_ref: weakref.ref | None = None
        self._held: Iterator[StreamChunk] | None = None  # the iterator next(stream) uses, held strongly

    def __next__(self) -> StreamChunk:
        if self._held is None:
            self._held = iter(self)
        return next(self._held)

    def __iter__(self) -> Iterator[StreamChunk]:
        # One pass: iterating again goes on where a live iterator stopped (``it = iter(s); next(it);
        # for c in s``). Only a weak reference is kept, so that an iterator dropped early (leaving a
        # for loop with break) is collected, which closes the stream and gives the engine back.
        core = self._core
        steps = self._steps_ref() if self._steps_ref is not None else None
        if steps is not None and not core.closed:
            return steps
        if core.closed and core.result is None:  # (closed before its first step too)
            raise InvalidArgumentError(
                "the stream was closed before it finished, so it cannot be iterated again (closing it, leaving a "
                "for loop over it early or dropping its iterator, as next(iter(stream)) does, ends it); call "
                "generate(..., stream=True) again, and use next(stream) to take one chunk at a time")
        if self._steps_ref is not None and core.result is not None:
            return iter(())  # finished: nothing more
        steps = core.steps()
        self._steps_ref = weakref.ref(steps)
        return steps

    def close(self) -> None:
        """Stop generating and give the engine back (idempotent)."""
        self._core.close()
        held, self._held = self._held, None
        if held is not None:
            try:
                held.close()  # its generator ends here (a closed stream's next() then says it was closed)
            except ValueError:  # "generator already executing": next(stream) runs in another thread, and
                pass            # its loop ends after the running step (the core is closed)

    def __enter__(self) -> "TextStream":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def __del__(self) -> None:
        # A for loop over a temporary stream (for c in engine.generate(..., stream=True)) holds only
        # the generator: that one lives on, and ends (closing the core) when it is exhausted or dropped.
        try:
            if self._held is not None or self._steps_ref is None or self._steps_ref() is None:
                self.close()
        except Exception:
            pass

    @property
    def result(self) -> GenerationOutput:
        if self._core.result is None and self._core.closed:
            raise InvalidArgumentError("the stream was closed before it finished, so it has no result; "
                                       "start the generation again and iterate over it to the end")
        if self._core.result is None:
            raise InvalidArgumentError("the stream is not finished: iterate over it to the end before reading .result")
        return self._core.result


_MAX_POLICIES = 32  # adaptive policies an engine keeps (one per sampling setting seen)


class Engine:
    """Target (and optional draft) backends of one bundle plus its tokenizer."""

    def __init__(self, root: Path, manifest: BundleManifest, target, draft, tokenizer,
                 target_threads: int | None = None):
        self.root, self.manifest = root, manifest
        self.target, self.draft, self.tokenizer = target, draft, tokenizer
        self._guard = _EngineGuard()
        # Adaptive draft-length policies, one per (sampling, lenience, drafter, max_gamma): what one
        # learns (keep rate by draft confidence, call times) is a property of the pair and the
        # machine, so later calls start from it instead of from scratch.
        self._policies: dict[tuple, AdaptiveGamma] = {}
        self._lookahead: LookaheadDrafter | None = None
        self._hybrid: HybridDrafter | None = None
        self._target_threads = target_threads   # ONNX Runtime intra-op threads of the target (0: ORT's default)

    @property
    def busy_timeout(self) -> float | None:
        """Seconds a generate call waits for another thread's call (None: forever); then EngineBusyError."""
        return self._guard.timeout

    @busy_timeout.setter
    def busy_timeout(self, value: float | None) -> None:
        value = as_float(value)
        if value is not None and (not isinstance(value, float) or not value >= 0 or math.isinf(value)):
            raise InvalidArgumentError(f"busy_timeout must be a number of seconds >= 0, or None to wait as long as "
                                       f"it takes; got {value!r:.40}")
        self._guard.timeout = value

    def verify_width(self) -> int | None:
        """Most tokens one target call may take (XLA artifacts have a fixed width); None: any (ONNX)."""
        widths = [w for w in (getattr(b, "verify_width", None) for b in (self.target, self.draft) if b is not None)
                  if w is not None]
        return min(widths) if widths else None

    @property
    def has_draft(self) -> bool:
        return self.draft is not None

    @property
    def vocab_size(self) -> int:
        """The ids generation samples from (``BundleManifest.sample_vocab_size``: the tokenizer's)."""
        return self.manifest.sample_vocab_size

    def _draft_cost(self) -> float:
        """A draft step in target steps, from the bytes each forward reads (decoding is memory
        bound): on the benchmark pair 0.014 against a measured c of 0.02-0.03."""
        t = self.manifest.target.parameter_bytes.get("per_forward", 0)
        d = self.manifest.draft.parameter_bytes.get("per_forward", 0) if self.manifest.draft is not None else 0
        return d / t if t > 0 and d > 0 else 0.05  # sizes unknown (a hand-made manifest): a small draft

    def encode(self, text: str) -> list[int]:
        _check_text(text)
        return list(self.tokenizer.encode(text, add_special_tokens=True).ids)

    def decode(self, ids: Sequence[int]) -> str:
        """Text of token ids (this bundle's tokenizer; special tokens left out)."""
        ids = [as_int(i) for i in ids] if not isinstance(ids, (str, bytes)) and isinstance(ids, Iterable) else ids
        size = self.manifest.target.tokenizer_size
        if not isinstance(ids, list) or not all(isinstance(i, int) and not isinstance(i, bool) and 0 <= i < size
                                                for i in ids):
            raise InvalidArgumentError(f"decode takes a sequence of token ids in [0, {size}) (this bundle's "
                                       f"tokenizer); got {ids!r:.80}")
        return self.tokenizer.decode(ids, skip_special_tokens=True)

    def _prompt_ids(self, prompt) -> list[int]:
        if isinstance(prompt, str):
            if not prompt:  # whitespace is text: "\n" encodes to tokens
                raise InvalidArgumentError("the prompt is empty; pass some text (CLI: a non-empty --prompt or --prompt-file) "
                                           "or a non-empty list of token ids")
            self._check_text_fits(prompt)
            ids = self.encode(prompt)
            if not ids:
                raise InvalidArgumentError(f"the prompt {prompt[:40]!r} encodes to no tokens with this bundle's tokenizer; use other text")
        elif prompt is None or isinstance(prompt, (int, float, np.number)):  # (said "a non-empty 1-D sequence")
            one = f" ([{prompt!r}] for one token id)" if isinstance(prompt, (int, np.integer)) \
                and not isinstance(prompt, (bool, np.bool_)) else ""
            raise InvalidArgumentError(f"the prompt is {prompt!r}; pass text (a str) or a sequence of token ids{one}")
        elif isinstance(prompt, (bytes, bytearray, memoryview)):  # (numpy would read bytes as one scalar)
            raise InvalidArgumentError(f"the prompt is {type(prompt).__name__}; pass text (a str: decode it first, e.g. "
                                       "prompt.decode('utf-8')) or a sequence of token ids")
        else:
            try:
                arr = np.asarray(prompt)
            except Exception as exc:
                raise InvalidArgumentError(f"prompt must be a string or a sequence of token ids; got {type(prompt).__name__}") from exc
            # the items as given (numpy makes [True, 2] an int array, and [2**70] an object one whose
            # ints reach the range check below)
            items = (arr.tolist() if isinstance(prompt, np.ndarray) else list(prompt)) if arr.ndim == 1 else []
            if not items or any(isinstance(i, (bool, np.bool_)) or not isinstance(i, (int, np.integer)) for i in items):
                raise InvalidArgumentError("prompt ids must be a non-empty 1-D sequence of integers (not floats, not bools)")
            ids = [int(i) for i in items]
        # This bundle's token ids, with or without a draft (which has a stand-in for ids past its own
        # rows): rows past the tokenizer are padding that no text encodes to and decode() refuses.
        limit = self.vocab_size
        bad = [i for i in ids if not 0 <= i < limit]
        if bad:
            raise InvalidArgumentError(f"prompt token ids must be in [0, {limit}) (this bundle's tokenizer: "
                                       f"engine.encode(text) gives them); got {bad[:5]}")
        return ids

    def _check_text_fits(self, text: str) -> None:
        """Refuse a text far too long for the target's positions before tokenizing all of it (a 27 MB
        prompt file took 49 s to tokenize, then was refused): a prefix of it is tokenized, and if that
        alone holds more tokens than the model takes, so does the text (a tokenization of the whole
        differs from the prefix's at most by the tokens across the cut). No assumption is made about
        characters per token: a tokenizer that fuses unknown characters into one token just makes
        the prefix short of the limit, and the whole text is then tokenized as before."""
        limit = prompt_limit(self.target)
        cut = 64 * (limit + 64)   # characters: many times `limit` tokens of ordinary text
        if len(text) <= 2 * cut:
            return
        _check_text(text[:cut])   # (encode() checks the whole text; this prefix reaches the tokenizer first)
        n = len(self.tokenizer.encode(text[:cut], add_special_tokens=False).ids)
        if n > limit + 8:         # (8: tokens that the cut may split or merge, special tokens)
            raise PromptTooLongError(f"the prompt has {len(text)} characters; its first {cut} alone are {n} tokens, more "
                                     f"than the {limit} the model takes; shorten it", "prompt")

    def _check_lengths(self, n_prompt: int, max_new: int) -> None:
        # the target's positions (generate checks the draft's: the default then decodes without it)
        seq2seq = self.manifest.target.kind == contract.KIND_SEQ2SEQ
        limit = self.target.max_length
        if seq2seq:  # the prompt goes to the encoder; the decoder's positions hold the start token + new tokens
            encoder = prompt_limit(self.target)
            if n_prompt > encoder:
                more = ("re-export with a larger --max-source-length" if hasattr(self.target, "max_prompt_length") else
                        "re-export with a larger n_positions in the checkpoint's config.json: T5's relative attention "
                        "takes longer inputs, and the export copies that count")  # (XLA's encoder has one compiled length)
                raise PromptTooLongError(f"prompt has {n_prompt} tokens but the encoder takes at most {encoder}; shorten it "
                                         f"(or {more})", "prompt")
            if max_new > limit:
                raise PromptTooLongError(f"max_new_tokens ({max_new}) exceeds the decoder's {limit} positions (the prompt "
                                         f"does not count: it goes to the encoder); lower max_new_tokens to at most {limit}",
                                         "max_new_tokens")
            return
        # XLA artifacts hold --max-length positions, which may be fewer than the model's (a trial was told
        # "the target's 32 positions" of a 128-position model exported with --max-length 32)
        model = self.manifest.target.max_positions
        xla = getattr(self.target, "platform", None) is not None and limit < model
        whose = "the XLA artifacts'" if xla else "the target's"
        also = (f"; or re-export with a larger --max-length (the model has {model} positions), or drop runtime='xla' "
                "(CLI --runtime xla): the ONNX graphs take them all") if xla else ""
        if n_prompt > limit:
            raise PromptTooLongError(
                f"prompt has {n_prompt} tokens but {'the XLA artifacts have' if xla else 'the target has'} {limit} "
                f"positions; shorten the prompt so that "
                f"prompt tokens + max_new_tokens - 1 <= {limit} (the last new token is not fed back){also}", "prompt")
        if n_prompt + max_new - 1 > limit:
            raise PromptTooLongError(
                f"prompt ({n_prompt} tokens) + max_new_tokens ({max_new}) needs {n_prompt + max_new - 1} of {whose} "
                f"{limit} positions (the last new token is not fed back); shorten the prompt or lower max_new_tokens "
                f"to at most {max(limit - n_prompt + 1, 0)}{also}"
            )

    def generate(self, prompt_or_ids, max_new_tokens: int = 64, temperature: float = 1.0, top_k: int = 0,
                 top_p: float = 1.0, gamma: int | None = None, lenience: float = 1.0, seed: int | None = None,
                 stream: bool = False, use_draft: bool = True, stop_token_ids: Sequence[int] = (),
                 drafter: str | None = None):
        """Generate from text or token ids.

        ``drafter=None`` (the default) drafts with the draft model when the engine has one and
        decodes plainly when it has none; ``drafter="model"`` drafts with the draft model and is an
        error without one; ``drafter="lookahead"`` too, and
        keeps drafting on a second thread while the target verifies, so rounds that keep every draft
        start with their drafts made (worth it where the target runs on fewer cores than the machine
        has); ``drafter="ngram"`` drafts by prompt lookup (continuations of earlier text; no second
        model); ``drafter="hybrid"`` drafts with the model and puts a prompt-lookup token in its place
        wherever the run so far says that one is kept more often (repetitive text, such as code at
        greedy). All four are exact.

        ``temperature=0`` is greedy. ``gamma=None`` (the default) lets edgespec choose the draft
        length per round from the draft's confidence, the acceptance rate so far and the measured
        call times; the policy keeps what it learned for later calls with the same settings. With
        sampling and a ``seed``, it prices calls from the bundle instead of measuring them and starts
        afresh, so the seed fixes the text (for the same settings, max_new_tokens included: the last
        rounds draft fewer tokens, so a shorter run is not always the start of a longer one with the
        same seed); ``gamma=k`` drafts k tokens every round.
        With the ONNX runtime any gamma >= 1 works (the graphs take any number of new tokens); with
        ``runtime="xla"`` gamma + 1 may not exceed the artifacts' verify width (xla.json, default 9);
        ``use_draft=False`` (or a single-model bundle) decodes plainly with the target.
        ``lenience`` < 1 (Appendix A.5) keeps more drafts and is NOT exact; 1 (the default) is.
        ``stop_token_ids``: generation ends after the first of these ids, which is the last of ``.ids``
        (as an EOS token is). Numbers may be numpy scalars; ``gamma="auto"`` is ``None``.
        Returns a GenerationOutput, or with ``stream=True`` a TextStream of StreamChunks whose
        ``.result`` is the GenerationOutput once the stream is exhausted.
        """
        from .loop import iter_generate

        seed, gamma = as_int(seed), None if gamma == "auto" else as_int(gamma)
        if seed is not None and (isinstance(seed, bool) or not isinstance(seed, int) or seed < 0):
            raise InvalidArgumentError(f"seed must be a non-negative integer or None; got {seed!r}")
        for name, flag in (("use_draft", use_draft), ("stream", stream)):
            if not isinstance(flag, (bool, np.bool_)):
                raise InvalidArgumentError(f"{name} must be True or False; got {flag!r:.40}")
        drafter, asked, idle = self._resolve_drafter(drafter, bool(use_draft), gamma, lenience)
        ngram = drafter == "ngram"
        use_draft = drafter is not None and self.draft is not None and not ngram  # the draft model takes part
        fixed = [gamma] if isinstance(gamma, int) and not isinstance(gamma, bool) else []
        max_gamma = gamma_bound(fixed, self.verify_width() if use_draft or ngram else None)
        config = GenerationConfig(
            max_new_tokens=max_new_tokens,
            sampling=SamplingConfig(temperature=temperature, top_k=top_k, top_p=top_p),
            gamma=gamma,
            lenience=lenience,
            eos_token_ids=tuple(self.manifest.target.eos_token_ids),
            stop_token_ids=self._stop_ids(stop_token_ids),
            max_gamma=max_gamma,
            vocab_size=self.vocab_size,
        )
        ignored = [f"{n} (CLI --{n.replace('_', '-')})" for n, on in (("top_k", top_k != 0), ("top_p", top_p != 1),
                                                                     ("lenience", config.lenience != 1))
                   if on and config.sampling.greedy]  # (lenience: a one-hot p keeps the argmax draft whatever l)
        if ignored:  # as Hugging Face's generate does, a warning: scripts sweep temperatures with one set of keywords
            warn(f"{' and '.join(ignored)} {'has' if len(ignored) == 1 else 'have'} no effect at temperature 0: greedy "
                 f"decoding takes the target's argmax; drop {'it' if len(ignored) == 1 else 'them'} or set a temperature above 0")
        ids = self._prompt_ids(prompt_or_ids)
        self._check_lengths(len(ids), config.max_new_tokens)
        # The draft cannot take the prompt, or takes it but has no position left to draft from: only
        # said where the target itself leaves room for a drafted round (3+ new tokens, 2+ free positions).
        target_room = config.max_new_tokens >= 3 and (self.manifest.target.kind == contract.KIND_SEQ2SEQ
                                                      or len(ids) + 2 <= self.target.max_length)
        if use_draft and (len(ids) > prompt_limit(self.draft) or (len(ids) > draft_prompt_limit(self.draft) and target_room)):
            if asked is not None or idle:  # the draft was asked for
                raise PromptTooLongError(
                    f"prompt has {len(ids)} tokens but the draft model {draft_limit_words(self.draft)}; "
                    "shorten the prompt or decode without the draft (use_draft=False; CLI: --no-draft)", "prompt")
            # The default drafts where the draft can help; a prompt that fills its positions leaves it no room.
            warn(f"the prompt has {len(ids)} tokens and the draft model {draft_limit_words(self.draft)}: "
                 "decoding without the draft (plain speed); shorten the prompt to draft, or export a draft "
                 "with as many positions as the target")
            use_draft = False
        rng = np.random.default_rng(seed)
        draft = NgramDrafter() if ngram else self._model_drafter(drafter, seed, config) if use_draft else None
        policy = self._policy(draft, config, drafter, seed) if gamma is None else None
        # (ids are checked above: an int64 array spares iter_generate's scan of a list for bools)
        blocks = iter_generate(self.target, np.asarray(ids, dtype=np.int64), config, rng, draft=draft, policy=policy)
        detok = _Detokenizer(self.tokenizer) if stream else None

        def finish(result) -> GenerationOutput:
            return GenerationOutput(text=self.decode(result.tokens), ids=list(result.tokens), sources=list(result.sources),
                                    finish_reason=result.finish_reason, stats=result.stats, prompt_ids=ids,
                                    drafter=None if draft is None else drafter)

        stream_obj = TextStream(blocks, detok, finish, self._guard)
        if stream:
            return stream_obj
        for _ in stream_obj:
            pass
        return stream_obj.result

    def _resolve_drafter(self, drafter: str | None, use_draft: bool, gamma: int | None,
                         lenience: float) -> tuple[str | None, str | None, list[str]]:
        """(the drafter that runs, None for plain decoding; the one asked for; the drafting settings
        given). Settings that would do nothing are refused, as the CLI refuses them."""
        if drafter is not None and drafter not in DRAFTERS:
            raise InvalidArgumentError(f"drafter must be one of {', '.join(map(repr, DRAFTERS))} or None; got {drafter!r}")
        if drafter is not None and not use_draft:
            raise InvalidArgumentError(f"use_draft=False decodes with the target alone, so drafter={drafter!r} has no "
                                       "effect; drop one of them")
        if drafter in ("model", "lookahead", "hybrid") and self.draft is None:
            raise InvalidArgumentError(
                f"drafter={drafter!r} drafts with the bundle's draft model, and this engine has none ("
                + ("a single-model bundle: export one with --draft" if self.manifest.draft is None else "loaded with load_draft=False")
                + "); use drafter='ngram' (prompt lookup, no model; CLI --draft ngram) or use_draft=False (CLI --no-draft)")
        asked, runs = drafter, (drafter or "model") if use_draft else None
        idle = [n for n, on in (("gamma", gamma is not None), ("lenience", lenience != 1)) if on]
        has = "has" if len(idle) == 1 else "have"
        if idle and not use_draft:
            raise InvalidArgumentError(f"use_draft=False decodes with the target alone, so {' and '.join(idle)} {has} no "
                                       f"effect; drop {' and '.join(idle)} or use_draft=False")
        if idle and runs == "model" and self.draft is None:
            raise InvalidArgumentError(
                "this engine has no draft model (" + ("a single-model bundle" if self.manifest.draft is None else
                                                       "loaded with load_draft=False")
                + f"), so {' and '.join(idle)} {has} no effect (plain decoding); draft by prompt lookup with "
                f"drafter='ngram' (CLI --draft ngram), or drop {' and '.join(idle)}")
        return runs, asked, idle

    def _stop_ids(self, stop_token_ids) -> tuple[int, ...]:
        stop_token_ids = () if stop_token_ids is None else stop_token_ids
        if not isinstance(stop_token_ids, (str, bytes)) and isinstance(stop_token_ids, Iterable):
            stop_token_ids = tuple(stop_token_ids)  # (an iterator is read once: by the check below, it was)
        if not isinstance(stop_token_ids, tuple) or not all(
                isinstance(s, (int, np.integer)) and not isinstance(s, bool) for s in stop_token_ids):
            raise InvalidArgumentError(f"stop_token_ids must be a sequence of integer token ids; got {stop_token_ids!r:.80}")
        never = [int(s) for s in stop_token_ids if s >= self.vocab_size]
        if never:
            raise InvalidArgumentError(f"stop_token_ids (CLI --stop-token-ids) {never[:5]} can never be generated (this "
                                       f"bundle's token ids are < {self.vocab_size}); pass ids of its tokenizer "
                                       "(engine.encode(text))")
        return tuple(int(s) for s in stop_token_ids)

    def _model_drafter(self, drafter: str, seed: int | None, config: GenerationConfig):
        """The draft model, or a drafter built on it (lookahead, hybrid)."""
        if drafter == "lookahead":
            if self._lookahead is None:  # one per engine: it owns the worker thread
                self._lookahead = LookaheadDrafter(self.draft)
                warn_if_no_spare_core(self._target_threads)
            return self._lookahead
        if drafter == "hybrid":
            if seed is not None and not config.sampling.greedy:
                return HybridDrafter(self.draft)  # learns afresh, so that the seed fixes the text
            self._hybrid = self._hybrid or HybridDrafter(self.draft)  # keeps what it learned for later calls
            return self._hybrid
        return self.draft

    def _policy(self, draft, config: GenerationConfig, drafter: str | None, seed: int | None) -> AdaptiveGamma | None:
        """The adaptive draft-length policy of a call without a gamma (None: plain decoding)."""
        if draft is None:
            return None
        if seed is not None and not config.sampling.greedy:
            # Measured times vary from run to run, and with them the draft lengths and so which
            # uniform decides which token: a reproducible run prices calls from the bundle instead.
            cost = 0.0 if isinstance(draft, NgramDrafter) else self._draft_cost()
            return AdaptiveGamma(config.max_gamma, fixed_costs=(cost, VERIFY_SLOPE))
        key = (config.sampling, config.lenience, drafter, config.max_gamma)
        if key not in self._policies and len(self._policies) >= _MAX_POLICIES:
            self._policies.pop(next(iter(self._policies)))  # the oldest setting
        return self._policies.setdefault(key, AdaptiveGamma(config.max_gamma))

    def close(self) -> None:
        """Forget the cached context and give the KV cache's memory back (after calls in other
        threads finish). The engine stays usable (the next call allocates the cache again);
        ``with edgespec.load(...) as engine:`` calls this on leaving the block."""
        lease = self._guard.acquire()  # waits for other threads' calls; supersedes this thread's stream
        try:
            self._close_backends()
        finally:
            self._guard.release(lease)

    def __enter__(self) -> "Engine":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def _close_backends(self) -> None:
        if self._lookahead is not None:
            self._lookahead.close()  # its worker thread ends; the next lookahead call makes a new one
            self._lookahead = None
        self.target.free()
        if self.draft is not None:
            self.draft.free()


def gamma_bound(fixed_gammas: Sequence[int], width: int | None, name: str = "gamma") -> int:
    """The adaptive policy's bound: DEFAULT_MAX_GAMMA or the largest fixed gamma asked for, within
    what one target call verifies (XLA artifacts: the pending token + gamma drafts <= verify width;
    None: any). A fixed gamma beyond the width is an error."""
    bound = max([DEFAULT_MAX_GAMMA, *fixed_gammas])
    if width is None:
        return bound
    wide = max(fixed_gammas, default=0)
    if wide > width - 1 and width <= 1:  # "gamma <= 0" is no advice
        raise InvalidArgumentError(
            f"this bundle's XLA artifacts verify one token per call (verify_width={width}): no room for a draft token, "
            f"so {name}={wide} cannot run; re-export with `--verify-width {wide + 1}` or decode without the draft")
    if wide > width - 1:
        raise InvalidArgumentError(
            f"{name}={wide} exceeds what this bundle's XLA artifacts verify in one call (verify_width={width}, "
            f"so gamma <= {width - 1}); lower {name} or re-export with `--verify-width {wide + 1}`")
    if width < 2:
        raise InvalidArgumentError(f"this bundle's XLA artifacts have verify_width={width}: no room for a draft "
                                   "token; decode without a draft or re-export with --verify-width 9")
    return min(bound, width - 1)


def default_target_threads(lookahead: bool) -> int:
    """The CLI's default target threads: ORT's (0), or with the lookahead drafter all cores but one
    (its drafting thread needs a core of its own)."""
    return max(1, usable_cores() - 1) if lookahead else 0


def warn_if_no_spare_core(threads: int | None) -> None:
    """The lookahead drafter's worker needs a core the target leaves free."""
    if threads is None:
        return
    cores = usable_cores()
    if threads == 0 or threads >= cores:
        warn(
            f"the lookahead drafter (drafter='lookahead', CLI --draft lookahead) with the target on "
            f"{f'{threads} threads ({cores} cores)' if threads > cores else f'all {cores} cores'}: the draft's thread competes with the target's (11% "
            f"slower than the model drafter on the 2-core benchmark machine); give the target fewer threads "
            f"(threads={max(1, cores - 1)}, CLI --threads {max(1, cores - 1)}) or use the model drafter (drafter='model', "
            "CLI --draft model)")


def load(bundle: str | os.PathLike, providers: Sequence[str] | str = ("cpu",), draft_providers: Sequence[str] | str | None = None,
         threads: int = 0, draft_threads: int | None = 1, spinning: bool | None = None,
         draft_spinning: bool | None = None, load_draft: bool = True, runtime: str = "onnx",
         platform: str | None = None, huge_pages: bool = True) -> Engine:
    """Open a bundle: verify it, build ONNX Runtime sessions for the target (and the draft).

    ``providers`` / ``draft_providers``: ordered execution providers (``cpu``, ``cuda``, ``coreml``,
    ``openvino``, ``dml``, ``qnn``, ``xnnpack``, ... or ORT names); an unavailable one raises
    ProviderError, there is no silent fallback; the draft defaults to the target's providers.
    ``threads``: the target's intra-op threads (0 = ORT default: one per physical core);
    ``draft_threads``: the draft's (None: as the target; default 1: a draft step is too small to split, and a second
    multi-threaded pool would contend for the cores with the target's spin-waiting threads; on
    the benchmark machine a 2-thread draft cut speculative tokens/s by a third);
    ``spinning``: thread spin-waiting on/off (None: ORT default, on).
    ``huge_pages``: on Linux with the CPU provider, move the weights ONNX Runtime loaded onto
    transparent huge pages (fewer TLB misses while a step streams them; on the bench pair plain
    decoding ran 13-15% faster, speculative 7-8%); False leaves ONNX Runtime's memory as it was.
    ``runtime="xla"`` runs the bundle's jax.export artifacts instead (``edgespec export --format
    onnx+xla``) on ``platform`` (cpu, cuda, rocm, tpu; default: JAX's default device); the ONNX Runtime
    settings (providers, threads, spinning, huge_pages) are refused with it, as ``platform`` is without it.
    """
    from .runtimes.onnx_backend import SessionConfig, resolve_providers

    threads, draft_threads = _check_load_options(providers, draft_providers, threads, draft_threads, spinning,
                                                 draft_spinning, load_draft, runtime, platform, huge_pages)
    if isinstance(bundle, bytes) or not isinstance(bundle, (str, os.PathLike)) or not str(bundle):
        raise InvalidArgumentError(f"load takes the bundle's folder (a path from `edgespec export --out`); got {bundle!r:.80}")
    root = Path(bundle)
    manifest = load_bundle(root, roles=None if load_draft else (contract.ROLE_TARGET,))  # plain decoding needs no draft files
    unused = [n for n, given in (("draft_providers (CLI --draft-provider)", draft_providers is not None),
                                 ("draft_threads (CLI --draft-threads)", draft_threads != 1),
                                 ("draft_spinning", draft_spinning is not None)) if given]
    if (manifest.draft is None or not load_draft) and unused:  # (a script loading bundles of either kind alike)
        why = ("load_draft=False (CLI --no-draft, --draft ngram) loads no draft model" if manifest.draft is not None else
               f"{str(root)!r} holds no draft model (export it with --draft to speculate with one)")
        warn(f"{', '.join(unused)} {'has' if len(unused) == 1 else 'have'} no effect: {why}; drop "
             f"{'it' if len(unused) == 1 else 'them'}")
    if runtime == "xla":  # the ONNX Runtime session settings below do not apply
        providers, draft_providers = ("cpu",), None
    target_cfg = SessionConfig(providers=resolve_providers(providers), intra_op_threads=threads, spinning=spinning,
                               huge_pages=huge_pages)
    draft_cfg = SessionConfig(
        providers=resolve_providers(providers if draft_providers is None else draft_providers),
        intra_op_threads=threads if draft_threads is None else draft_threads,  # None: same as the target
        spinning=spinning if draft_spinning is None else draft_spinning,
        huge_pages=huge_pages,
    )
    if runtime == "onnx":
        _warn_oversubscribed(target_cfg, draft_cfg if load_draft and manifest.draft and draft_threads is not None else None)
    tm = manifest.target
    tokenizer = _load_tokenizer(root, manifest, load_draft)
    open_model = _model_opener(root, manifest, runtime, platform)
    if load_draft and manifest.draft is not None:
        _check_same_tokenizer(root, manifest)
    target = open_model(tm, target_cfg)
    draft = open_model(manifest.draft, draft_cfg) if load_draft and manifest.draft is not None else None
    if tm.quantization == contract.QUANT_DYNAMIC_INT8 and runtime == "onnx":  # any drafter, ngram included
        warn(
            f"{root}: the target was quantized with dynamic int8 (edgespec before 2026-11-30), whose logits at a "
            "position depend on the other tokens in the same call, so speculative output (draft model or ngram) is "
            "not distributed exactly as plain decoding's; re-export the bundle (`edgespec export --quantize-target "
            "int8` now writes a causal per-token int8 target)")
    return Engine(root, manifest, target, draft, tokenizer, target_threads=threads if runtime == "onnx" else None)


def _check_load_options(providers, draft_providers, threads, draft_threads, spinning, draft_spinning, load_draft,
                        runtime, platform, huge_pages) -> tuple[int | None, int | None]:
    """load()'s settings, checked before any file is read; returns (threads, draft_threads) as ints."""
    from .runtimes.onnx_backend import MAX_THREADS, PROVIDER_ALIASES, provider_names

    threads, draft_threads = as_int(threads), as_int(draft_threads)
    for name, v in (("threads", threads), ("draft_threads", draft_threads)):
        if (v is not None or name == "threads") and (isinstance(v, bool) or not isinstance(v, int) or not
                                                     0 <= v <= MAX_THREADS):
            raise InvalidArgumentError(f"{name} (CLI --{name.replace('_', '-')}) must be an integer from 0 to "
                                       f"{MAX_THREADS} (0 = ONNX Runtime's default{'' if name == 'threads' else '; None: as the target'}; "
                                       f"this process may use {usable_cores()} cores); got {v!r}")
    for name, v, optional in (("load_draft", load_draft, False), ("spinning", spinning, True),
                              ("draft_spinning", draft_spinning, True)):
        if not isinstance(v, (bool, np.bool_)) and not (optional and v is None):
            raise InvalidArgumentError(f"{name} must be True or False{' (or None: ONNX Runtime default)' if optional else ''}; "
                                       f"got {v!r:.40}")
    for name, v in (("providers", providers), ("draft_providers", draft_providers)):
        if not (isinstance(v, str) or (isinstance(v, Sequence) and all(isinstance(n, str) for n in v))) and not (
                v is None and name == "draft_providers"):
            raise InvalidArgumentError(f"{name} must be provider names in order, e.g. ['cpu'] or 'cuda,cpu'"
                                       f"{' (or None: as the target)' if name == 'draft_providers' else ''}; got {v!r:.40}")
    if runtime not in ("onnx", "xla"):
        raise InvalidArgumentError(f"runtime must be 'onnx' or 'xla'; got {runtime!r}")
    ort_names = [PROVIDER_ALIASES.get(n.lower(), n) for n in provider_names(providers)]
    if runtime == "xla" and (ort_names != [PROVIDER_ALIASES["cpu"]] or draft_providers is not None):
        raise InvalidArgumentError("providers configure ONNX Runtime; with runtime='xla' choose the device with "
                                   "platform= (CLI --platform) and drop providers (CLI --provider/--draft-provider)")
    ort_only = [n for n, changed in (("threads", threads != 0), ("draft_threads", draft_threads != 1),
                                     ("spinning", spinning is not None), ("draft_spinning", draft_spinning is not None),
                                     ("huge_pages", huge_pages is not True)) if changed]
    if runtime == "xla" and ort_only:
        one = len(ort_only) == 1
        raise InvalidArgumentError(f"{', '.join(ort_only)} {'configures' if one else 'configure'} ONNX Runtime and "
                                   f"{'does' if one else 'do'} nothing with runtime='xla'; drop {'it' if one else 'them'} "
                                   "(platform= picks the XLA device)")
    if runtime == "onnx" and platform is not None:
        raise InvalidArgumentError("platform= picks the XLA device (runtime='xla'); with ONNX Runtime choose "
                                   "providers= instead, or drop platform")
    return threads, draft_threads


def _warn_oversubscribed(target_cfg, draft_cfg) -> None:
    cores = usable_cores()
    for name, cfg in (("threads", target_cfg), ("draft_threads", draft_cfg)):
        n = cfg.intra_op_threads if cfg is not None else 0
        if n > cores:  # (a trial: threads=500 on 2 cores loaded in 10 s and generated 20 tokens in 4.5 s, not 10 ms;
            # plain decoding of the quick target, 2 cores: 2218 tok/s with 2 threads, 1257 / 783 / 371 with 3 / 4 / 8
            # spinning, 1436 / 1261 with 3 / 8 not spinning)
            spin = cfg.spinning is not False
            warn(f"{name}={n} (CLI --{name.replace('_', '-')}) on a machine where this process may use {cores} "
                 f"cores: ONNX Runtime starts {n} threads that take turns on them"
                 + (", spin-waiting (the default) for each other, which grows with the count (the quick "
                    "target on 2 cores: 3 threads 1.8x slower than 2, 8 threads 6x, 500 threads 450x)" if spin
                    else f", slower than {cores} threads")
                 + f"; use at most {cores} (0: ONNX Runtime's choice)"
                 + (f" or turn spin-waiting off ({'' if name == 'threads' else 'draft_'}spinning=False, CLI --no-spin)"
                    if spin else ""))


def _load_tokenizer(root: Path, manifest: BundleManifest, load_draft: bool):
    """The target's tokenizer.json, checked against the manifest's token counts."""
    from tokenizers import Tokenizer

    from .export.tokenizer_check import tokenizer_size

    tm = manifest.target
    tok_path = root / tm.path / contract.TOKENIZER_FILE
    try:
        tokenizer = Tokenizer.from_file(str(tok_path))
    except Exception as exc:  # tokenizers raises a bare Exception on malformed JSON
        raise BundleError(f"{tok_path} cannot be read ({exc}); re-export the bundle") from exc
    # the ids generation samples from are the tokenizer's (BundleManifest.sample_vocab_size)
    size = tokenizer_size(tokenizer.get_vocab(with_added_tokens=True))
    for m in (tm, manifest.draft if load_draft else None):
        if m is not None and m.tokenizer_size != size:
            shared = "" if m is tm else f", which the {m.path} model shares (its own is checked to be the same)"
            raise BundleError(f"{root}: the manifest says the {m.path} tokenizer has {m.tokenizer_size} ids; the target's "
                              f"tokenizer ({tok_path}{shared}) has {size}: the manifest was edited or the files mixed: "
                              "re-export the bundle")
    return tokenizer


def _model_opener(root: Path, manifest: BundleManifest, runtime: str, platform: str | None):
    """A function (model manifest, SessionConfig) -> backend of the chosen runtime."""
    if runtime == "onnx":
        from .runtimes.onnx_backend import open_backend

        return lambda m, cfg: open_backend(root / m.path, m, cfg)
    from .runtimes.xla_backend import XlaBackend  # "xla" (checked by _check_load_options)

    if "xla" not in manifest.formats:
        raise BundleError(f"{root} has no XLA artifacts; re-export it with `edgespec export ... --format onnx+xla`")

    def open_model(m, cfg):
        _check_xla_is_the_onnx_model(root / m.path)
        be = XlaBackend.from_dir(root / m.path, platform=platform)
        if be.vocab_size != m.vocab_size:  # the ONNX backends check their logits' shape the same way
            raise BundleError(f"{root / m.path}: the XLA artifacts give {be.vocab_size} logits per position, the "
                              f"manifest says vocab_size {m.vocab_size}; re-export the bundle")
        return be
    return open_model


def _check_text(text) -> None:
    """Text the tokenizer can take, else a typed error."""
    if not isinstance(text, str):
        raise InvalidArgumentError(f"encode takes text (str); got {type(text).__name__}")
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as exc:  # lone surrogates: bytes that were not UTF-8 (e.g. a shell's $'\xff')
        raise InvalidArgumentError(f"the prompt is not valid Unicode text (character {exc.start}: "
                                   f"{text[exc.start:exc.end]!r}); pass UTF-8 text or token ids") from None


def _check_xla_is_the_onnx_model(model_dir: Path) -> None:
    """The XLA artifacts in model_dir/xla must be the model whose ONNX graphs sit beside them (the
    export writes both from one checkpoint; a folder copied or re-exported by hand may not be):
    their config.json files must describe the same architecture."""
    from .runtimes import xla_models as xm

    if not (model_dir / contract.CONFIG_FILE).is_file() or not (model_dir / "xla" / contract.CONFIG_FILE).is_file():
        return  # nothing to compare (the XLA loader reports a missing xla/ itself)
    try:
        onnx, xla = (xm.spec_from_config(xm.read_config(d)) for d in (model_dir, model_dir / "xla"))
    except EdgeSpecError as exc:
        raise BundleError(f"{model_dir}: cannot compare the XLA artifacts with the ONNX model ({exc}); re-export the "
                          "bundle") from exc
    if onnx != xla:
        diff = [f"{k} {getattr(onnx, k)!r} vs {getattr(xla, k)!r}" for k in onnx.__dataclass_fields__
                if getattr(onnx, k) != getattr(xla, k)]
        raise BundleError(f"{model_dir}: the XLA artifacts in xla/ are another model than the ONNX graphs beside them "
                          f"(ONNX vs XLA: {'; '.join(diff[:4])}); re-export both from one checkpoint (`edgespec export "
                          "--format onnx+xla`, or `python -m edgespec.export.xla CHECKPOINT MODEL_FOLDER --overwrite` "
                          "with the checkpoint the ONNX graphs came from)")


def _check_same_tokenizer(root: Path, manifest: BundleManifest) -> None:
    """Draft and target must map the same text to the same ids (the export checked it; a bundle
    assembled or edited by hand may not)."""
    from tokenizers import Tokenizer

    paths = [root / m.path / contract.TOKENIZER_FILE for m in (manifest.target, manifest.draft)]
    try:
        if paths[0].read_bytes() == paths[1].read_bytes():
            return
        vocabs = [Tokenizer.from_file(str(p)).get_vocab(with_added_tokens=True) for p in paths]
    except Exception as exc:  # tokenizers raises a bare Exception on malformed JSON
        raise BundleError(f"{paths[1]} cannot be read ({str(exc)[:200]}); re-export the bundle") from exc
    if vocabs[0] != vocabs[1]:
        diff = len(set(vocabs[0].items()) ^ set(vocabs[1].items()))
        raise TokenizerMismatchError(
            f"{root}: the draft's tokenizer differs from the target's ({diff} differing token/id entries); speculative "
            "decoding needs one tokenizer: re-export the bundle with a draft of the target's family, or load it with "
            "load_draft=False (--no-draft)")
