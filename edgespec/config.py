"""Frozen configuration dataclasses. Validation happens at construction, with fix-it messages."""
from __future__ import annotations

import math
import numbers
from dataclasses import dataclass, field

from .errors import InvalidArgumentError

DRAFTERS = ("model", "lookahead", "ngram", "hybrid")  # Engine.generate(drafter=...), the CLI's --draft


def as_int(v):
    """A numpy integer (np.int64(3)) as a Python int; anything else unchanged, for the checks to judge."""
    return int(v) if isinstance(v, numbers.Integral) and not isinstance(v, bool) else v


def as_float(v):
    """A numpy or Python real (np.float32(0.7), 1) as a Python float; anything else unchanged."""
    return float(v) if isinstance(v, numbers.Real) and not isinstance(v, bool) else v


def _normalise(obj, ints: tuple[str, ...], floats: tuple[str, ...]) -> None:
    for name in ints:
        object.__setattr__(obj, name, as_int(getattr(obj, name)))
    for name in floats:
        object.__setattr__(obj, name, as_float(getattr(obj, name)))


@dataclass(frozen=True)
class SamplingConfig:
    """How logits become the distribution a token is drawn from (paper section 2.2).

    temperature 0 means greedy (argmax); top_k 0 and top_p 1.0 mean "off". The same transform is
    applied to the target's and the draft's logits; the processed p and q enter the acceptance test.
    """

    temperature: float = 1.0
    top_k: int = 0
    top_p: float = 1.0

    def __post_init__(self) -> None:
        _normalise(self, ("top_k",), ("temperature", "top_p"))
        t = self.temperature
        if isinstance(t, bool) or not isinstance(t, (int, float)) or math.isnan(t) or t < 0 or math.isinf(t):
            raise InvalidArgumentError(f"temperature (CLI --temperature) must be a finite number >= 0 (0 = greedy); got {t!r}")
        k = self.top_k
        if isinstance(k, bool) or not isinstance(k, int) or k < 0:
            raise InvalidArgumentError(f"top_k (CLI --top-k) must be an integer >= 0 (0 = off); got {k!r}")
        p = self.top_p
        if isinstance(p, bool) or not isinstance(p, (int, float)) or math.isnan(p) or not (0 < p <= 1):
            raise InvalidArgumentError(f"top_p (CLI --top-p) must be in (0, 1] (1 = off); got {p!r}")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0


@dataclass(frozen=True)
class GenerationConfig:
    """One generate call. ``gamma=None`` lets edgespec choose the draft length each round."""

    max_new_tokens: int = 64
    sampling: SamplingConfig = field(default_factory=SamplingConfig)
    gamma: int | None = 4
    lenience: float = 1.0
    eos_token_ids: tuple[int, ...] = ()
    stop_token_ids: tuple[int, ...] = ()
    max_gamma: int = 8  # upper bound for adaptive gamma (and the verify width a bundle was exported for)
    vocab_size: int | None = None  # sample only ids < vocab_size (the tokenizer's; None: every id the target has)

    def __post_init__(self) -> None:
        _normalise(self, ("max_new_tokens", "gamma", "max_gamma", "vocab_size"), ("lenience",))
        object.__setattr__(self, "eos_token_ids", tuple(as_int(i) for i in self.eos_token_ids))
        object.__setattr__(self, "stop_token_ids", tuple(as_int(i) for i in self.stop_token_ids))
        m = self.max_new_tokens
        if isinstance(m, bool) or not isinstance(m, int) or m < 1:
            raise InvalidArgumentError(f"max_new_tokens (CLI --max-new-tokens) must be an integer >= 1; got {m!r}")
        g = self.gamma
        if g is not None and (isinstance(g, bool) or not isinstance(g, int) or g < 1):
            raise InvalidArgumentError(f"gamma (CLI --gamma) must be an integer >= 1 (or None for adaptive; CLI auto); got {g!r}")
        if isinstance(self.max_gamma, bool) or not isinstance(self.max_gamma, int) or self.max_gamma < 1:
            raise InvalidArgumentError(f"max_gamma must be an integer >= 1; got {self.max_gamma!r}")
        if g is not None and g > self.max_gamma:
            raise InvalidArgumentError(f"gamma={g} exceeds max_gamma={self.max_gamma}; lower gamma or raise max_gamma")
        l = self.lenience
        if isinstance(l, bool) or not isinstance(l, (int, float)) or math.isnan(l) or not (0 < l <= 1):
            raise InvalidArgumentError(f"lenience (CLI --lenience) must be in (0, 1] (1 = exact, Appendix A.5); got {l!r}")
        v = self.vocab_size
        if v is not None and (isinstance(v, bool) or not isinstance(v, int) or v < 1):
            raise InvalidArgumentError(f"vocab_size must be a positive integer or None; got {v!r}")
        for name in ("eos_token_ids", "stop_token_ids"):
            ids = getattr(self, name)
            if not all(isinstance(i, int) and not isinstance(i, bool) and i >= 0 for i in ids):
                raise InvalidArgumentError(f"{name} must be non-negative integers; got {ids!r}")
            object.__setattr__(self, name, tuple(dict.fromkeys(ids)))  # a set of ids, kept in the caller's order
