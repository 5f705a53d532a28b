"""Exact output distributions of toy models and chi-square checks against them."""
from __future__ import annotations

import itertools

import numpy as np
from scipy.stats import chi2, chisquare

from edgespec.config import SamplingConfig
from edgespec.sampling import process_logits

# One check's false-alarm rate. Seeds are fixed, so a run is deterministic; the exactness tests
# make about 175 checks (each of L positions and L - 1 adjacent pairs), so by the union bound the
# suite had at most a ~2% chance of having been unlucky with the chosen seeds.
ALPHA_LEVEL = 1e-4


def exact_sequences(model, prompt, length: int, sampling: SamplingConfig) -> np.ndarray:
    """Probability of every continuation of ``length`` tokens: [V] * length array."""
    V = model.vocab_size
    probs = np.ones(())
    for depth in range(length):
        nxt = np.empty(probs.shape + (V,))
        for prefix in itertools.product(range(V), repeat=depth):
            row = process_logits(model.logits(list(prompt) + list(prefix))[None], sampling)[0]
            nxt[prefix] = probs[prefix] * row
        probs = nxt
    return probs


def chi2_pvalue(counts: np.ndarray, expected_p: np.ndarray) -> float:
    """Goodness of fit of counts to a distribution; a count where p == 0 is an outright failure."""
    counts, expected_p = counts.ravel().astype(float), expected_p.ravel()
    if counts[expected_p <= 0].sum() > 0:
        return 0.0
    keep = expected_p > 0
    n = counts.sum()
    exp = expected_p[keep] * n
    obs = counts[keep]
    # Merge cells with expected count < 5 into one, the usual validity condition.
    small = exp < 5
    if small.any():
        obs = np.append(obs[~small], obs[small].sum())
        exp = np.append(exp[~small], exp[small].sum())
    if len(exp) < 2:
        return 1.0
    exp = exp * obs.sum() / exp.sum()
    return float(chisquare(obs, exp).pvalue)


def min_power_against_tv(n: int, df: int, tv: float = 0.01) -> float:
    """Power of one chi-square test at ALPHA_LEVEL against the hardest-to-see perturbation of
    total variation ``tv``: by Cauchy-Schwarz sum(d^2 / p) >= (sum |d|)^2 = (2 tv)^2, so the
    noncentrality is at least n (2 tv)^2."""
    from scipy.stats import ncx2

    return float(ncx2.sf(chi2.isf(ALPHA_LEVEL, df), df, n * (2 * tv) ** 2))
