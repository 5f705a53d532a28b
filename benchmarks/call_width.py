"""How far a bundle's target logits move with the width of the call, and what that does to greedy
speculative output against plain decoding.

    python benchmarks/call_width.py BUNDLE --out benchmarks/results/bench/call-width-NAME

Speculative decoding takes p from verify calls of gamma + 1 tokens; plain decoding takes it from
1-token calls. Appendix A.1 makes the output follow the p it is given, so the two decodings agree
exactly only if a position's logits are the same in both calls. Per built-in prompt, along the
target's own greedy continuation, two measurements:
- one call: at every position, over the same cache (built by 1-token calls), the logits of a 1-token
  call against row 0 of a --width-token call: the noise a single verify call adds;
- along the sequence: every position fed by 1-token calls against the same positions fed in blocks
  of --width, each pass building its own cache: what a whole decoding sees, since a verify call's
  keys and values are the cache of the calls after it (one rounding flip moves every later row).
For both, the largest |logits| difference and the total variation distance between the two
softmaxes (what sampling at T=1 sees); then whether a row changes when only a later token of the
same call does (it must not: a model may not see the future). Last, greedy speculative decoding
(gamma 3, 6 and adaptive) against plain decoding: where they first differ, the plain logit gap
between the two tokens there (a near-tie flipped by the width noise, or a bug if the gap is large).
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


def _softmax(x: np.ndarray) -> np.ndarray:
    e = np.exp(x - x.max(-1, keepdims=True))                                     # [n, V]
    return e / e.sum(-1, keepdims=True)


def _compare(a: np.ndarray, b: np.ndarray, prefix: str) -> dict:
    a, b = a.astype(np.float64), b.astype(np.float64)                            # [n, V] each
    diff = np.abs(a - b).max(-1)                                                 # [n]
    tv = 0.5 * np.abs(_softmax(a) - _softmax(b)).sum(-1)                         # [n]
    return {f"{prefix}_max_abs": float(diff.max()), f"{prefix}_median_abs": float(np.median(diff)),
            f"{prefix}_positions_over_1e-3": int((diff > 1e-3).sum()), f"{prefix}_max_tv": float(tv.max()),
            f"{prefix}_median_tv": float(np.median(tv))}


def width_noise(engine, prompt_ids: list[int], continuation: list[int], width: int) -> dict:
    """The two comparisons of the module docstring at the positions that predict ``continuation[1:]``
    (the logits plain decoding computes after ``prompt_ids``), fed one or ``width`` tokens per call."""
    t = engine.target
    continuation = list(continuation[:-1])  # the tokens plain decoding feeds: the last one is only output
    n = len(continuation)
    out = {"positions": n}
    if n == 0:
        return out
    t.prefill(prompt_ids)
    n0 = t.length                                                                # decoder positions after the prompt
    one, single = [], []
    for j, x in enumerate(continuation):
        block = continuation[j:j + width]
        single.append(t.extend(block)[0])                                        # row 0 of a wide call ...
        t.rewind_to(n0 + j)
        one.append(t.extend([x])[0])                                             # ... and the 1-token call, same cache
    one, single = np.stack(one), np.stack(single)                               # [n, V] each
    t.rewind_to(n0)
    wide = np.concatenate([t.extend(continuation[k:k + width]) for k in range(0, n, width)])  # [n, V]
    out.update(_compare(one, single, "one_call"))
    out.update(_compare(one, wide, "sequence"))
    if n >= 2:
        t.rewind_to(n0)
        block = list(continuation[:width])
        a = t.extend(block)                                                      # [w, V]
        t.rewind_to(n0)
        b = t.extend(block[:-1] + [(block[-1] + 1) % t.vocab_size])             # only the last token differs
        out["earlier_rows_when_last_changes"] = float(np.abs(a[:-1] - b[:-1]).max())
    t.rewind_to(0)
    return out


def greedy_identity(engine, prompt: str, max_new_tokens: int, gammas) -> list[dict]:
    plain = engine.generate(prompt, max_new_tokens=max_new_tokens, temperature=0, use_draft=False)
    rows = []
    for gamma in gammas:
        spec = engine.generate(prompt, max_new_tokens=max_new_tokens, temperature=0, gamma=gamma).ids
        row = {"gamma": "auto" if gamma is None else gamma, "identical": spec == plain.ids}
        if not row["identical"]:
            i = next((j for j, (x, y) in enumerate(zip(spec, plain.ids)) if x != y), min(len(spec), len(plain.ids)))
            row["first_difference"] = i
            if i < min(len(spec), len(plain.ids)):
                t = engine.target                                                # plain decoding's own 1-token steps
                logits = t.prefill(list(plain.prompt_ids))
                for x in plain.ids[:i]:
                    logits = t.extend([x])[0]
                row["plain_logit_gap"] = float(logits[plain.ids[i]] - logits[spec[i]])
                t.rewind_to(0)
        rows.append(row)
    return rows


def main(argv=None) -> int:
    import edgespec
    from edgespec.cli import at_least
    from edgespec.outputs import check_report_folder
    from edgespec.prompts import CODE_PROMPTS
    from edgespec.report import machine_description, write_json

    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("bundle", type=Path)
    ap.add_argument("--width", type=at_least(2), default=4, help="tokens per call to compare with 1-token calls")
    ap.add_argument("--max-new-tokens", type=at_least(2), default=96)
    ap.add_argument("--out", type=Path, default=None)
    args = ap.parse_args(argv)
    if args.width >= args.max_new_tokens:  # the calls feed the continuation's tokens: one of W needs W of them
        ap.error(f"--width {args.width} needs a continuation longer than the width; raise --max-new-tokens above "
                 f"{args.width} or lower --width (--max-new-tokens is {args.max_new_tokens})")
    if args.out is not None:  # before the measurement, not after it
        check_report_folder(args.out)
    engine = edgespec.load(args.bundle, threads=1)
    if engine.draft is None:
        raise SystemExit(f"call_width.py: {args.bundle} has no draft model; greedy identity needs one")
    prompts, results = list(CODE_PROMPTS), []
    for n, prompt in enumerate(prompts, 1):
        print(f"[call_width] prompt {n}/{len(prompts)}", file=sys.stderr, flush=True)
        plain = engine.generate(prompt, max_new_tokens=args.max_new_tokens, temperature=0, use_draft=False)
        row = {"prompt": n, **width_noise(engine, list(plain.prompt_ids), list(plain.ids), args.width)}
        row["greedy"] = greedy_identity(engine, prompt, args.max_new_tokens, (3, 6, None))
        results.append(row)
    runs = [g for r in results for g in r["greedy"]]
    flips = [g for g in runs if not g["identical"]]
    lines = [f"{args.bundle}: target quantization {engine.manifest.target.quantization}; 1-token vs {args.width}-token calls "
             f"along {len(prompts)} greedy continuations of up to {args.max_new_tokens} tokens", "",
             "| prompt | one call: max abs logits diff | positions > 1e-3 | max TV | along the sequence: max abs | median abs | max TV "
             "| earlier rows when the last token changes | greedy runs identical |",
             "|---|---|---|---|---|---|---|---|---|"]
    for r in results:
        same = sum(g["identical"] for g in r["greedy"])
        if not r["positions"]:
            lines.append(f"| {r['prompt']} | (nothing fed: one new token or none) | | | | | | | {same} of {len(r['greedy'])} |")
            continue
        lines.append(f"| {r['prompt']} | {r['one_call_max_abs']:.3g} | {r['one_call_positions_over_1e-3']} of {r['positions']} | "
                     f"{r['one_call_max_tv']:.3g} | {r['sequence_max_abs']:.3g} | {r['sequence_median_abs']:.3g} | "
                     f"{r['sequence_max_tv']:.3g} | {r.get('earlier_rows_when_last_changes', float('nan')):.3g} | "
                     f"{same} of {len(r['greedy'])} |")
    lines.append("")
    lines.append(f"greedy speculative (gamma 3, 6, adaptive) identical to plain in {len(runs) - len(flips)} of {len(runs)} runs")
    for r in results:
        for g in r["greedy"]:
            if not g["identical"]:
                gap = g.get("plain_logit_gap")
                lines.append(f"  prompt {r['prompt']}, gamma {g['gamma']}: first difference at new token {g['first_difference']}"
                             + (f", plain logit gap {gap:.3g}" if gap is not None else " (one output is shorter)"))
    print("\n".join(lines))
    if args.out is not None:
        args.out.mkdir(parents=True, exist_ok=True)
        (args.out / "call_width.md").write_text("\n".join(lines) + "\n")
        write_json(args.out / "call_width.json", {"machine": machine_description(), "bundle": str(args.bundle),
                                                    "width": args.width, "max_new_tokens": args.max_new_tokens,
                                                    "results": results, "command": " ".join(sys.argv)})
    return 0


if __name__ == "__main__":
    from edgespec.cli import run_script

    sys.exit(run_script(main, "call_width.py"))
