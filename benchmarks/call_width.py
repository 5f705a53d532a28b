"""How far a bundle's target logits move with the width of the call, and what that does to greedy
speculative output against plain decoding.

    python benchmarks/call_width.py BUNDLE --out benchmarks/results/bench/call-width-NAME

Speculative decoding takes p from verify calls of gamma + 1 tokens; plain decoding takes it from
1-token calls. Appendix A.1 makes the output follow the p it is given, so the two decodings agree
exactly only if a position's logits are the same in both calls. Per built-in prompt, along the
target's own greedy continuation: the largest |logits| difference per position between 1-token calls
and calls of --width tokens, the total variation distance between the two softmaxes (what sampling
at T=1 sees), and whether a position's logits change when only a later token of the same call does
(they must not: a model may not see the future). Then greedy speculative decoding (gamma 3, 6 and
adaptive) against plain decoding: where they first differ, the plain logit gap between the two
tokens there (a near-tie that the width noise flipped, or a bug if the gap is large).
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


def width_noise(engine, prompt_ids: list[int], continuation: list[int], width: int) -> dict:
    """Logits of ``continuation`` fed 1 token per call and ``width`` tokens per call, after the prompt."""
    t = engine.target
    t.prefill(prompt_ids)
    n0 = t.length                                                                # decoder positions after the prompt
    one = np.stack([t.extend([x])[0] for x in continuation])                    # [n, V]
    t.rewind_to(n0)
    wide = np.concatenate([t.extend(continuation[k:k + width]) for k in range(0, len(continuation), width)])  # [n, V]
    t.rewind_to(n0)
    block = list(continuation[:width])
    a = t.extend(block)                                                          # [width, V]
    t.rewind_to(n0)
    b = t.extend(block[:-1] + [(block[-1] + 1) % t.vocab_size])                 # only the last token differs
    t.rewind_to(0)
    diff = np.abs(one.astype(np.float64) - wide).max(-1)                         # [n]
    tv = 0.5 * np.abs(_softmax(one.astype(np.float64)) - _softmax(wide.astype(np.float64))).sum(-1)  # [n]
    return {"max_abs": float(diff.max()), "median_abs": float(np.median(diff)), "max_tv": float(tv.max()),
            "median_tv": float(np.median(tv)), "earlier_rows_when_last_changes": float(np.abs(a[:-1] - b[:-1]).max())}


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
    from edgespec.prompts import CODE_PROMPTS
    from edgespec.report import machine_description, write_json

    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("bundle", type=Path)
    ap.add_argument("--width", type=at_least(2), default=4, help="tokens per call to compare with 1-token calls")
    ap.add_argument("--max-new-tokens", type=at_least(2), default=96)
    ap.add_argument("--out", type=Path, default=None)
    args = ap.parse_args(argv)
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
             f"along {len(prompts)} greedy continuations of {args.max_new_tokens} tokens", "",
             "| prompt | max abs logits diff | median | max TV | median TV | earlier rows when the last token changes | greedy runs identical |",
             "|---|---|---|---|---|---|---|"]
    for r in results:
        same = sum(g["identical"] for g in r["greedy"])
        lines.append(f"| {r['prompt']} | {r['max_abs']:.3g} | {r['median_abs']:.3g} | {r['max_tv']:.3g} | {r['median_tv']:.3g} | "
                     f"{r['earlier_rows_when_last_changes']:.3g} | {same} of {len(r['greedy'])} |")
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
