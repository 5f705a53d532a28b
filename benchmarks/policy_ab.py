"""Adaptive gamma, this checkout's policy against another revision's, side by side on one bundle.

    python benchmarks/policy_ab.py BUNDLE --against HEAD --temperature 1 --repeats 10

`edgespec bench` compares settings within one policy; a change to the policy itself is compared
here. Each repeat runs the built-in code prompts three ways back to back: plain decoding, then the
two policies (the order alternating between repeats), one policy object per side for the whole run
(as an Engine keeps one). The host's drift then hits all three alike, and the ratio that matters is
taken repeat by repeat. The other revision's ``edgespec/adaptive.py`` is read with ``git show`` and
run inside this checkout's loop (its ``update`` gets the loop's arguments it knows). The first
repeat is a warm-up and is not reported.

With ``--work G`` both policies do all their work but G drafts every round whatever they decide
(benchmarks/policy_overhead.py's "policy work"): both sides then decode the same text (checked),
at T > 0 too, and the ratio is what the policies' work costs, apart from their choices. With
``--fresh`` each call gets a new policy on each side, as a one-shot `edgespec generate`, an engine's
first call or a seeded sampled call does: what the policies do before they have learned the pair.
With ``--static G`` the other side is static gamma G instead of a revision's policy (with ``--fresh``:
what a call with a new policy costs against the static gamma a sweep found best). With ``--draft
lookahead`` both sides draft with the lookahead drafter (one each), as `edgespec bench --draft
lookahead` does; a revision whose policy hands its worker no rule for the next round (before
``AdaptiveGamma.ahead``) then has it draft gamma + 1 tokens, as that revision did.
"""
from __future__ import annotations

import inspect
import math
import subprocess
import sys
import time
import types
from dataclasses import replace
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).parent))

from policy_overhead import working  # noqa: E402  (a sibling script: the policy with its choices overridden)
from revision_ab import ab_parser  # noqa: E402  (the options both A/B scripts take)

from edgespec.cli import at_least  # noqa: E402
from edgespec.errors import InvalidArgumentError  # noqa: E402
from edgespec.prompts import CODE_PROMPTS  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]


def policy_class(revision: str):
    """AdaptiveGamma as of ``revision`` (a git revision of this repository)."""
    try:
        source = subprocess.run(["git", "show", f"{revision}:edgespec/adaptive.py"], cwd=ROOT, check=True,
                                capture_output=True, text=True).stdout
    except (OSError, subprocess.CalledProcessError) as exc:
        detail = (getattr(exc, "stderr", None) or str(exc)).strip()
        raise InvalidArgumentError(f"cannot read edgespec/adaptive.py at {revision!r} with git ({detail}); give a "
                                   "revision of this repository, e.g. HEAD or a commit (a shallow clone may lack it: "
                                   "git fetch --unshallow)") from None
    if source == (ROOT / "edgespec" / "adaptive.py").read_text():
        print(f"[policy_ab] note: the policy at {revision!r} is this checkout's: both sides run the same code",
              file=sys.stderr)
    module = types.ModuleType(f"adaptive_at_{revision}")
    exec(compile(source, f"{revision}:edgespec/adaptive.py", "exec"), module.__dict__)
    cls = module.AdaptiveGamma
    if not all(hasattr(cls, name) for name in ("draft_next", "record_plain")):
        raise InvalidArgumentError(f"the adaptive policy at {revision!r} predates plain steps (draft_next, "
                                   "record_plain: commit 6b7cb21); this loop cannot run it: give a later --against")
    return adapt(cls)


def adapt(cls):
    """``cls`` if this checkout's loop can run it, else a subclass that it can: its update() is
    given only the arguments it takes (a revision before Verdict.keep learns from the drawn outcome,
    one before confidence_s does not time confidences, one before reused fits a lookahead drafter's
    reused rounds into its draft time), and its start_round() returns the round's keep_going (a
    revision before confidence_s returned nothing)."""
    takes = inspect.signature(cls.update).parameters
    if "reused" in takes:
        return cls

    class Adapted(cls):
        def update(self, confidences, n_accepted, draft_s, target_s, keep=None, confidence_s=0.0, reused=False):
            extra = {k: v for k, v in (("keep", keep), ("confidence_s", confidence_s)) if k in takes}
            return super().update(confidences, n_accepted, draft_s, target_s, **extra)

        def start_round(self):
            keep_going = super().start_round()
            return self.keep_going if keep_going is None else keep_going

    return Adapted


STALL_S = 0.004  # an injected stall: about a time slice of another process on a busy host


def add_stalls(backend, per_second: float, rng: np.random.Generator) -> None:
    """Make ``backend``'s extend calls stall now and then, as a busy host does: after a call of d
    seconds, a STALL_S sleep with probability per_second * d (stalls in proportion to the time the
    models run, as another process's time slices would land)."""
    call = backend.extend

    def extend(ids):
        t0 = time.perf_counter()
        out = call(ids)
        if rng.random() < per_second * (time.perf_counter() - t0):
            time.sleep(STALL_S)
        return out

    backend.extend = extend


def run(bundle: str, against: str, temperature: float, repeats: int, max_new_tokens: int, max_gamma: int = 8,
        stalls: float = 0.0, work: int = 0, fresh: bool = False, static: int = 0, drafter: str = "model"):
    """Per repeat: tokens/s of plain decoding and of both policies, and each policy's plain-step share
    (``work`` > 0: both policies' choices overridden, that many drafts every round; ``fresh``: a new
    policy for every call; ``static`` > 0: the other side drafts that many every round, no policy,
    and ``against`` is not read; ``drafter``: "model" or "lookahead", a drafter of its own per side)."""
    import edgespec
    from edgespec.adaptive import AdaptiveGamma
    from edgespec.bundle import load_bundle
    from edgespec.config import GenerationConfig, SamplingConfig
    from edgespec.drafters import LookaheadDrafter
    from edgespec.loop import generate

    load_bundle(Path(bundle))  # a missing bundle is reported first, before the note about the revision
    other = None if static else policy_class(against)  # then a bad revision, before the sessions' seconds of loading
    eng = edgespec.load(bundle, threads=1, draft_threads=1)
    if stalls > 0:  # (the same generator for both models: one host)
        rng = np.random.default_rng(123)
        add_stalls(eng.target, stalls, rng)
        add_stalls(eng.draft, stalls, rng)
    if not eng.has_draft:
        raise InvalidArgumentError(f"{bundle} has no draft model; export the bundle with --draft")
    prompts = [eng.encode(p) for p in CODE_PROMPTS]
    if work:
        make = {"this": lambda: working(work, AdaptiveGamma, max_gamma), "other": lambda: working(work, other, max_gamma)}
    else:
        make = {"this": lambda: AdaptiveGamma(max_gamma), "other": lambda: other(max_gamma)}
    if static:
        make["other"] = lambda: None  # the loop drafts config.gamma every round
    policies = {side: new() for side, new in make.items()}
    cfg = GenerationConfig(max_new_tokens=max_new_tokens, gamma=None, max_gamma=max_gamma,
                           sampling=SamplingConfig(temperature=temperature))
    side_cfg = {"plain": cfg, "this": cfg, "other": replace(cfg, gamma=static) if static else cfg}
    drafters = {"plain": None, "this": eng.draft, "other": eng.draft}
    if drafter == "lookahead":  # one each: a worker's drafts belong to its side's last round
        drafters.update(this=LookaheadDrafter(eng.draft), other=LookaheadDrafter(eng.draft))
    rows = []
    for rep in range(repeats + 1):
        tally = {k: [0, 0.0, 0] for k in ("plain", "this", "other")}  # tokens, seconds, plain steps
        order = ("plain", "this", "other") if rep % 2 else ("plain", "other", "this")
        for i, ids in enumerate(prompts):
            texts = {}
            for side in order:
                t0 = time.perf_counter()
                policy = make[side]() if fresh and side != "plain" else policies.get(side)
                res = generate(eng.target, ids, side_cfg[side], np.random.default_rng(1000 * rep + i),
                               draft=drafters[side], policy=policy)
                tally[side][0] += res.stats.emitted
                tally[side][1] += time.perf_counter() - t0
                tally[side][2] += res.stats.plain_steps
                texts[side] = res.tokens
            if work and texts["this"] != texts["other"]:  # same seed, same draft lengths: same tokens
                raise RuntimeError(f"--work {work}: the two sides decoded prompt {i} differently; a policy's choice "
                                   "was not overridden (its keep_going or draft_next decided)")
        if rep:  # the first repeat warms up
            rows.append({k: {"tokens_per_s": n / s, "plain_step_share": p / n} for k, (n, s, p) in tally.items()})
        print(f"[policy_ab] repeat {rep}/{repeats}{' (warm-up)' if rep == 0 else ''}", file=sys.stderr)
    return rows


def main(argv=None) -> int:
    ap = ab_parser(__doc__.split("\n\n")[0], "git revision whose adaptive policy is the other side", 10)
    ap.add_argument("--stalls", type=float, default=0.0,
                    help=f"inject {STALL_S * 1e3:g} ms stalls into model calls, this many per second of model time "
                         "(a busy host; default 0: none)")
    ap.add_argument("--work", type=at_least(1, 8), default=0, metavar="G",
                    help="override both policies' choices, G drafts every round (at most 8, the policies' bound "
                         "here): compare their work alone")
    ap.add_argument("--fresh", action="store_true",
                    help="a new policy for every call on both sides (before they have learned the pair)")
    ap.add_argument("--static", type=at_least(1, 8), default=0, metavar="G",
                    help="the other side is static gamma G (at most 8), not a revision's policy (--against is not read)")
    ap.add_argument("--draft", choices=("model", "lookahead"), default="model",
                    help="the drafter of both sides (default model; lookahead: one each, the draft model drafting "
                         "on a second thread while the target verifies)")
    args = ap.parse_args(argv)
    if not 0 <= args.stalls < math.inf:
        ap.error("--stalls must be finite and >= 0")
    if args.static and args.work:
        ap.error("--static and --work exclude each other (--work overrides both sides' policies)")
    rows = run(args.bundle, args.against, args.temperature, args.repeats, args.max_new_tokens, stalls=args.stalls,
               work=args.work, fresh=args.fresh, static=args.static, drafter=args.draft)
    other = f"gamma {args.static}" if args.static else args.against
    ratio = np.array([r["this"]["tokens_per_s"] / r["other"]["tokens_per_s"] for r in rows])
    print(f"T={args.temperature:g}, {len(rows)} repeats, the {len(CODE_PROMPTS)} built-in code prompts x "
          f"{args.max_new_tokens} tokens, 1 thread per model"
          + (f", {STALL_S * 1e3:g} ms stalls injected at {args.stalls:g} per second of model time" if args.stalls else "")
          + (f", both policies' choices overridden: {args.work} drafts every round" if args.work else "")
          + (", a new policy for every call" if args.fresh else "")
          + (", the lookahead drafter on both sides" if args.draft == "lookahead" else ""))
    for side in ("plain", "this", "other"):
        rates = " ".join(f"{r[side]['tokens_per_s']:.0f}" for r in rows)
        share = np.median([r[side]["plain_step_share"] for r in rows])
        print(f"{side:>6}: tok/s {rates}  (plain-step share, median {share:.2f})")
    over_plain = {s: np.median([r[s]["tokens_per_s"] / r["plain"]["tokens_per_s"] for r in rows]) for s in ("this", "other")}
    print(f"this / {other}: median {np.median(ratio):.3f} [IQR {np.percentile(ratio, 25):.3f}-"
          f"{np.percentile(ratio, 75):.3f}]; over plain: this {over_plain['this']:.3f}, {other} {over_plain['other']:.3f}")
    return 0


if __name__ == "__main__":
    from edgespec.cli import run_script

    sys.exit(run_script(main, "policy_ab.py"))
