"""Standardized sampling (paper section 2.2): argmax, temperature, top-k and top-p are all
"transform the logits into a distribution, then sample". The same transform is applied to the
target's logits (giving p) and the draft's (giving q); speculative sampling then runs on the
processed p and q, which is what keeps the output exactly distributed as the processed target."""
from __future__ import annotations

import math

import numpy as np

from .config import SamplingConfig
from .errors import NonFiniteLogitsError


def _raise_non_finite(logits: np.ndarray, who: str) -> None:
    if np.isnan(logits).any() or np.isposinf(logits).any():
        raise NonFiniteLogitsError(
            f"the {who} produced NaN or +inf logits; check the exported model (re-export in fp32, "
            "or validate it with `edgespec export` against its source checkpoint)")
    raise NonFiniteLogitsError(f"the {who} produced a row of logits that is -inf everywhere; no token can be sampled")


def process_logits(logits: np.ndarray, cfg: SamplingConfig, who: str = "model") -> np.ndarray:
    """Turn raw logits into the processed distribution the token is sampled from.

    logits: [k, V] (any float dtype). Returns probs: [k, V] float64, rows sum to 1.
    """
    k, V = logits.shape
    m = logits.max(axis=-1, keepdims=True)                        # [k, 1]
    if not np.isfinite(m).all():                                  # NaN, +inf, or a row all -inf
        _raise_non_finite(logits, who)
    if cfg.greedy:
        # temperature -> 0: a one-hot distribution on the argmax. With tied maxima the limit would
        # be uniform over them; greedy takes the first index, the same rule everywhere (draft,
        # verify rows, plain steps), so speculative greedy output equals plain greedy output.
        probs = np.zeros((k, V))                                  # [k, V]
        probs[np.arange(k), np.argmax(logits, axis=-1)] = 1.0
        return probs
    z = np.subtract(logits, m, dtype=np.float64)                  # [k, V], max 0
    if cfg.temperature != 1.0:
        _divide(z, cfg.temperature)
    if 0 < cfg.top_k < V:
        # keep every logit >= the k-th largest (ties at the threshold are kept, as in HF).
        kth = np.partition(z, V - cfg.top_k, axis=-1)[:, V - cfg.top_k: V - cfg.top_k + 1]  # [k, 1]
        z[z < kth] = -np.inf
    probs = np.exp(z, out=z)                                      # [k, V]
    probs /= probs.sum(axis=-1, keepdims=True)
    if cfg.top_p < 1.0:
        # nucleus: the smallest set of most likely tokens whose mass reaches top_p.
        order = np.argsort(-probs, axis=-1, kind="stable")        # [k, V]
        sorted_p = np.take_along_axis(probs, order, axis=-1)      # [k, V]
        before = np.cumsum(sorted_p, axis=-1) - sorted_p          # [k, V] mass strictly before
        keep = np.empty(probs.shape, dtype=bool)                  # [k, V]
        np.put_along_axis(keep, order, before < cfg.top_p, axis=-1)
        probs[~keep] = 0.0
        probs /= probs.sum(axis=-1, keepdims=True)
    return probs


def _divide(z: np.ndarray, temperature: float) -> None:
    """z /= T in place (z <= 0). Not z *= 1/T: 1/T overflows to inf for subnormal T, and 0 * inf is
    NaN. For such a T (below ~1e-300) a negative z / T overflows to -inf, which is right (its
    probability is 0) and which numpy would report as an overflow warning."""
    if temperature >= 1e-300:
        z /= temperature
    else:
        with np.errstate(over="ignore"):
            z /= temperature


def argmax_token(logits: np.ndarray, who: str = "model") -> int:
    """The greedy token of one row of logits [V]: what process_logits' one-hot (first index on
    ties) followed by sample_index returns, without building or scanning a distribution. Same
    NonFiniteLogitsError as process_logits."""
    i = int(np.argmax(logits))  # a NaN or +inf is its own argmax; an all -inf row gives -inf
    if not math.isfinite(logits[i]):
        _raise_non_finite(logits[None], who)
    return i


def argmax_rows(logits: np.ndarray, who: str = "model") -> np.ndarray:
    """argmax_token of every row: logits [k, V] -> ids [k] (int64)."""
    ids = np.argmax(logits, axis=-1)                              # [k]
    # k scalars: a Python loop, not four numpy calls (17 us in the loop, where numpy is cold after
    # each model call, against ~1 us for this)
    for i, j in enumerate(ids.tolist()):
        if not math.isfinite(logits[i, j]):
            _raise_non_finite(logits, who)
    return ids


def sample_row(logits: np.ndarray, cfg: SamplingConfig, u: float, out: np.ndarray,
               who: str = "model") -> int:
    """process_logits of one row of logits [V], written into ``out`` [V] (float64), then the
    inverse-CDF draw of sample_index with u: the same distribution (to rounding) and draw in fewer
    numpy operations. It runs right after a model call has evicted numpy's code and data from the
    caches, where each operation costs several times what it does warm (measured on the bench
    target: 50-70 us for process_logits + sample_index after a call, 10-20 us in a warm loop)."""
    i = argmax_token(logits, who)                                 # also the non-finite check
    if cfg.greedy:
        out.fill(0.0)
        out[i] = 1.0
        return i
    if 0 < cfg.top_k < out.shape[0] or cfg.top_p < 1.0:
        out[:] = process_logits(logits[None], cfg, who)[0]
        return sample_index(out, u)
    np.subtract(logits, logits[i], out=out, dtype=np.float64)     # [V] float64, max 0 (fp16 logits: as process_logits)
    if cfg.temperature != 1.0:
        _divide(out, cfg.temperature)
    np.exp(out, out=out)                                          # [V] unnormalised, max 1
    cdf = np.cumsum(out)                                          # [V]; cdf[-1] in [1, V]
    i = draw_from_cdf(cdf, u)
    out *= 1.0 / cdf[-1]  # normalised after the draw: one pass fewer (no separate sum), no divide
    if out[i] == 0.0:
        # The drawn mass was a subnormal that underflowed in the scaling (the first nonzero mass,
        # u = 0): q(x) = 0 must not be drawn, so draw on the normalised row, where it cannot be.
        return sample_index(out, u)
    return i


def sample_index(probs: np.ndarray, u: float) -> int:
    """Inverse-CDF draw from one distribution. probs: [V] (need not be normalised); u in [0, 1).

    side='right' returns the first index whose CDF exceeds u * total, which always has positive
    mass, so a zero-probability id (or one outside the vocabulary) is never returned.
    """
    return draw_from_cdf(np.cumsum(probs), u)


def draw_from_cdf(cdf: np.ndarray, u: float) -> int:
    """sample_index's draw from the running sums of its masses, cdf [V] (cdf[-1] > 0): the first
    index whose CDF exceeds u * cdf[-1] (side='right', see sample_index)."""
    return int(min(np.searchsorted(cdf, u * cdf[-1], side="right"), cdf.shape[0] - 1))
