"""Speculative sampling (Algorithm 1, Appendix A.1), pure numpy with an explicit Generator.

For drafted tokens x_1..x_g with processed draft distributions q_1..q_g and target
distributions p_1..p_{g+1} (all from one target pass):
  - keep x_i while r_i < p_i(x_i) / (l * q_i(x_i)), r_i ~ U[0, 1)   (accepted);
  - at the first rejection, draw from norm(max(0, p_i - l * q_i))  (recovered);
  - if every draft is kept, draw one more token from p_{g+1}        (bonus).
With l = 1 the committed tokens are distributed exactly as the target's (A.1): token x is emitted
with probability q(x) * min(1, p(x)/q(x)) + (1 - sum_y min(p(y), q(y))) * norm(max(0, p - q))(x)
= min(p, q)(x) + max(0, p - q)(x) = p(x). With l < 1 (A.5) acceptance is more lenient and the
output is no longer distributed as p.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import numpy as np

from .sampling import draw_from_cdf, sample_index

ACCEPTED, RECOVERED, BONUS, TARGET = "accepted", "recovered", "bonus", "target"


@dataclass(frozen=True, eq=False)
class Verdict:
    n_accepted: int   # leading drafts kept, 0..g
    token: int        # the recovered token (n < g) or the bonus token (n == g)
    kind: str         # RECOVERED or BONUS
    # [g] the test's probability of keeping each draft once the ones before it are kept,
    # min(1, p_i(x_i) / (l q_i(x_i))) (1 or 0 at greedy); None where not computed. The expected
    # number kept is sum_j prod_{i <= j} keep_i, of which n_accepted is one draw.
    keep: np.ndarray | None = None


def speculative_sample(draft_ids: np.ndarray, q: np.ndarray, p: np.ndarray,
                       rng: np.random.Generator, lenience: float = 1.0,
                       next_draft: Callable[[], tuple[int, np.ndarray] | None] | None = None) -> Verdict:
    """Run the acceptance test of one speculative round.

    draft_ids: [g] int, q: [g, V] processed draft distributions, p: [g + 1, V] processed target
    distributions; g may be 0 (then the round is a plain target step and the token is a bonus draw).
    ``next_draft()``, called only when every draft is kept, may return a further draft (y, q_y [V])
    with y ~ q_y, drawn independently of this round's test: the bonus is then decided by testing y
    against p_{g+1} instead of a direct draw from it.
    """
    g = draft_ids.shape[0]
    # g <= gamma scalars per round: Python floats, not a dozen numpy calls on [g] arrays (each costs
    # microseconds right after the target call has evicted numpy from the caches)
    xs = draft_ids.tolist()                                       # [g]
    r = rng.random(g).tolist()                                    # [g] r_i ~ U[0, 1)
    keep_p = [0.0] * g                                            # [g] P(keep x_i | x_<i kept)
    n = g
    for i, x in enumerate(xs):
        px, lqx = float(p[i, x]), lenience * float(q[i, x])       # p_i(x_i), l q_i(x_i)
        keep_p[i] = min(1.0, px / max(lqx, 1e-300))
        # r < p / (l q) without dividing: q(x) > 0 since x was drawn from q; p(x) = 0 never keeps.
        if n == g and not r[i] * lqx < px:
            n = i
    keep_p = np.array(keep_p)                                     # [g]
    if n < g:
        return Verdict(n, _recover(p[n], q[n], lenience, rng), RECOVERED, keep_p)
    extra = next_draft() if next_draft is not None else None
    if extra is None:
        return Verdict(n, sample_index(p[g], rng.random()), BONUS, keep_p)
    # A one-position round on the bonus: keep y with probability min(1, p(y) / q(y)), else draw from
    # norm(max(0, p - q)): the token is distributed as p_{g+1}, like the direct draw (Appendix A.1
    # with gamma = 1), and it is y as often as beta allows, which is what lets a LookaheadDrafter
    # reuse the drafts it made after y. Lenience stays out of it: A.5 relaxes the test of drafted
    # tokens only, and the bonus is a draw from p whichever drafter runs (at l < 1 a lenient test
    # here skewed the bonus toward the lookahead's guess: a review's find).
    y, qy = extra                                                 # int, [V]
    if rng.random() * qy[y] < p[g, y]:
        return Verdict(n, int(y), BONUS, keep_p)
    return Verdict(n, _recover(p[g], qy, 1.0, rng), BONUS, keep_p)


def _recover(p: np.ndarray, q: np.ndarray, lenience: float, rng: np.random.Generator) -> int:
    """Draw from norm(max(0, p - l q)) (p, q: [V]), the correction after a rejection."""
    residual = np.subtract(p, q if lenience == 1.0 else lenience * q)  # [V] p - l q
    np.maximum(residual, 0.0, out=residual)                       # [V] max(0, p - l q)
    cdf = np.cumsum(residual, out=residual)                       # [V] its CDF, in place
    u = rng.random()
    if not cdf[-1] > 0.0:
        # Only reachable through rounding when p == q (a rejection then has probability 0).
        return sample_index(p, u)
    return draw_from_cdf(cdf, u)


def greedy_verdict(draft_ids: np.ndarray, target_ids: np.ndarray) -> Verdict:
    """speculative_sample when p is one-hot (greedy): draft_ids [g], target_ids [g + 1] the
    target's argmax at each position.

    With p_i one-hot on a_i the test keeps x_i iff r * l * q(x_i) < p(x_i): always when x_i = a_i
    (r < 1, l q <= 1), never otherwise (p(x_i) = 0); the residual max(0, p - l q) at the first
    rejection has mass only on a_n, and the bonus draw from p_{g+1} is a_g. So neither q nor the
    uniforms matter; none are drawn.
    """
    xs, ts = draft_ids.tolist(), target_ids.tolist()
    g, n = len(xs), 0
    while n < g and xs[n] == ts[n]:
        n += 1
    keep = np.array([float(x == t) for x, t in zip(xs, ts)])     # [g] 1 where the draft is the target's argmax
    return Verdict(n, int(ts[n]), BONUS if n == g else RECOVERED, keep)


def overlap(p: np.ndarray, q: np.ndarray) -> np.ndarray:
    """beta = sum_x min(p(x), q(x)) = 1 - D_LK(p, q) per row (Definition 3.2). p, q: [k, V] -> [k]."""
    # (a sum of V rounded terms can exceed 1 by an ulp where p == q; beta is at most 1)
    return np.minimum(np.minimum(p, q).sum(axis=-1), 1.0)
