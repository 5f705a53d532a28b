"""The small protocol every model backend implements (toy, ONNX Runtime, XLA).

A backend owns one model and its KV cache for one sequence (batch 1). The cache holds the
first ``length`` tokens of the sequence; rolling back after a rejected draft moves that position,
it does not copy data.
"""
from __future__ import annotations

from typing import Protocol, runtime_checkable

import numpy as np


@runtime_checkable
class Backend(Protocol):
    """One causal language model with a KV cache, driven token-block by token-block.

    Attributes:
        vocab_size: number of logits per position.
        max_length: the most tokens the cache can hold (model positions or static buffers).
        length: tokens currently in the cache.
        is_encoder_decoder (optional): True when ``prefill`` sends the prompt to an encoder and
            ``length`` counts decoder tokens only (T5); absent means decoder-only.
        verify_width (optional): the most tokens one ``extend`` call takes (XLA artifacts are
            compiled for fixed widths); absent means any number.
        max_prompt_length (optional): the most tokens ``prefill`` takes where that differs from
            ``max_length`` (a T5 encoder exported for longer inputs than its decoder buffer);
            absent means ``max_length``. Read it through ``prompt_limit``.
    """

    vocab_size: int
    max_length: int

    @property
    def length(self) -> int: ...

    def prefill(self, ids: np.ndarray) -> np.ndarray:
        """Reset the cache, process ``ids`` ([n] int64, n >= 1); return the last position's logits [V]."""

    def extend(self, ids: np.ndarray) -> np.ndarray:
        """Append ``ids`` ([k] int64, k >= 1) to the cache; return logits for each new position [k, V]."""

    def rewind_to(self, n: int) -> None:
        """Forget every cached token after the first ``n`` (0 <= n <= length); O(1)."""

    def free(self) -> None:
        """Release the cache (the backend may be used again after ``prefill``)."""


def prompt_limit(backend) -> int:
    """The most prompt tokens ``backend.prefill`` takes."""
    return getattr(backend, "max_prompt_length", backend.max_length)


def draft_prompt_limit(draft) -> int:
    """The longest prompt after which a draft model can still propose a token: a decoder-only
    draft's positions hold the prompt and then the pending token it reads to draft (the drafters'
    ``room``), so a prompt filling all of them leaves it nothing to draft."""
    if getattr(draft, "is_encoder_decoder", False):
        return prompt_limit(draft)  # the prompt goes to the encoder
    return min(prompt_limit(draft), draft.max_length - 1)


def draft_limit_words(draft) -> str:
    """'takes at most N' for messages about draft_prompt_limit, saying why where it is one short of the positions."""
    n = draft_prompt_limit(draft)
    why = (f" (the last of its {draft.max_length} positions is for the token it reads to draft)"
           if n == draft.max_length - 1 and n < prompt_limit(draft) else "")
    return f"takes at most {n}{why}"
