"""What the adaptive policy's machinery costs, apart from its choices: static gamma G against the
same rounds with the draft's confidence computed, with all of the policy's work done, and the
shipped policy choosing, side by side on one bundle.

    python benchmarks/policy_overhead.py BUNDLE --temperature 0 --gamma 5 --repeats 8

Four ways of decoding the built-in code prompts (their tails, where the model's positions are
few), interleaved prompt by prompt with the order rotating between repeats (the first repeat warms
up and is not reported):
- ``static``: gamma G, no policy;
- ``confidence``: G drafts every round, the drafter asked for its confidence in each (at greedy a
  softmax over the draft's logits; at T > 0 a lookup in q), nothing else;
- ``policy work``: the shipped policy doing all of its work each round (start_round, keep_going,
  update, draft_next) but G drafts every round whatever it decides (a subclass: its super() calls
  add ~0.3 us each);
- ``adaptive``: the shipped policy, choosing.
The gaps between neighbouring rows are the confidence's cost, the policy's bookkeeping, and what
its choices gain. At T > 0 each way samples its own text (draft lengths decide which uniform
decides which token), so compare over many repeats.
"""
from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import edgespec  # noqa: E402
from edgespec.adaptive import AdaptiveGamma  # noqa: E402
from edgespec.cli import at_least  # noqa: E402
from edgespec.config import GenerationConfig, SamplingConfig  # noqa: E402
from edgespec.loop import generate  # noqa: E402
from edgespec.prompts import CODE_PROMPTS  # noqa: E402

MAX_GAMMA = 8


class FixedLength:
    """G drafts a round; its keep_going makes the drafter compute each draft's confidence."""

    def __init__(self, gamma: int):
        self.max_gamma, self._gamma = MAX_GAMMA, gamma

    def draft_next(self) -> bool:
        return True

    def start_round(self):
        return self.keep_going

    def keep_going(self, i: int, confidence: float) -> bool:
        return i < self._gamma

    def update(self, *args, **kwargs) -> None:
        pass

    def record_plain(self, seconds: float) -> None:
        pass


def working(gamma: int, cls: type = AdaptiveGamma, max_gamma: int = MAX_GAMMA) -> AdaptiveGamma:
    """The shipped policy (or ``cls``, another revision's), all its work done, its decisions
    overridden: G drafts, no plain steps."""

    class Working(cls):
        def keep_going(self, i: int, confidence: float) -> bool:
            super().keep_going(i, confidence)
            return i < gamma

        def draft_next(self) -> bool:
            super().draft_next()
            # It never takes the plain steps a probe asks for; a probe left pending would keep the
            # policy from learning in batches (adaptive._BATCH), which it does once a probe is done.
            self._probe = 0
            return True

    return Working(max_gamma)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("bundle", type=Path)
    ap.add_argument("--temperature", type=float, default=0.0)
    ap.add_argument("--gamma", type=at_least(1), default=5, help=f"the static draft length (at most {MAX_GAMMA})")
    ap.add_argument("--repeats", type=at_least(1), default=8)
    ap.add_argument("--max-new-tokens", type=at_least(1), default=96)
    args = ap.parse_args(argv)
    if args.gamma > MAX_GAMMA or not args.temperature >= 0:
        ap.error(f"--gamma must be at most {MAX_GAMMA}, --temperature >= 0")
    eng = edgespec.load(args.bundle, threads=1, draft_threads=1, spinning=False)  # errors: run_script prints them
    if not eng.has_draft:
        ap.error(f"{args.bundle} has no draft model")
    room = eng.manifest.target.max_positions - args.max_new_tokens
    if room < 1:
        ap.error(f"--max-new-tokens leaves no room for a prompt in the model's {eng.manifest.target.max_positions} positions")
    prompts = [eng.encode(p)[-room:] for p in CODE_PROMPTS]
    ways = {"static": None, "confidence": FixedLength(args.gamma), "policy work": working(args.gamma),
            "adaptive": AdaptiveGamma(MAX_GAMMA)}
    names = list(ways)
    rows = {name: [] for name in names}  # per repeat: tokens, seconds, draft seconds, draft steps, rounds
    for rep in range(args.repeats + 1):
        tally = {name: np.zeros(5) for name in names}
        for i, ids in enumerate(prompts):
            turn = (rep * len(prompts) + i) % len(names)
            for name in names[turn:] + names[:turn]:
                policy = ways[name]
                cfg = GenerationConfig(max_new_tokens=args.max_new_tokens, gamma=args.gamma if policy is None else None,
                                       max_gamma=MAX_GAMMA, sampling=SamplingConfig(args.temperature))
                t0 = time.perf_counter()
                s = generate(eng.target, ids, cfg, np.random.default_rng(1000 * rep + i), draft=eng.draft,
                             policy=policy).stats
                tally[name] += [s.emitted, time.perf_counter() - t0, s.draft_s, s.draft_calls, s.rounds]
        if rep:  # the first repeat warms up
            for name in names:
                rows[name].append(tally[name])
        print(f"[policy_overhead] repeat {rep}/{args.repeats}{' (warm-up)' if rep == 0 else ''}", file=sys.stderr)
    print(f"T={args.temperature:g}, gamma {args.gamma}, {args.repeats} repeats, the {len(prompts)} built-in code "
          f"prompts x {args.max_new_tokens} tokens, 1 thread per model")
    base = np.array(rows["static"])
    for name in names:
        r = np.array(rows[name])
        ratio = (r[:, 0] / r[:, 1]) / (base[:, 0] / base[:, 1])
        print(f"{name:>12}: {np.median(r[:, 0] / r[:, 1]):.0f} tok/s, / static {np.median(ratio):.3f} "
              f"[IQR {np.percentile(ratio, 25):.3f}-{np.percentile(ratio, 75):.3f}]; draft "
              f"{1e6 * np.median(r[:, 2] / r[:, 3]):.1f} us/step; mean gamma {np.median(r[:, 3] / r[:, 4]):.2f}")
    return 0


if __name__ == "__main__":
    from edgespec.cli import run_script

    sys.exit(run_script(main, "policy_overhead.py"))
