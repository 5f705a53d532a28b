"""Where prompt lookup beats the draft model at greedy: the case for the hybrid drafter.

Along the target's own greedy continuations of the built-in code prompts (teacher forcing: at every
position the draft model and the n-gram index see the target's text so far), this records the draft
model's argmax and its confidence (softmax probability), and the token the n-gram index proposes
(the continuation of the latest earlier 2-4-gram, as ``HybridDrafter`` looks it up). It reports, per
(match length, confidence decile) where the two tokens differ, how often each is the target's token,
and the greedy agreement with the target of: the model alone; the best fixed choice per cell
(chosen on these very positions: an upper bound); and HybridDrafter's online rule, replayed over the
positions in order (its priors and forgetting; every position counted, as if every draft were
examined).

    python benchmarks/lookup_agreement.py BUNDLE [--max-new-tokens 200] [--out DIR]
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

def trace(engine, prompt: str, max_new_tokens: int, max_ngram: int, min_ngram: int) -> list[tuple]:
    """Per generated position: (model argmax, its probability, lookup token or None, match length, target token)."""
    from edgespec.drafters import NgramIndex, _confidence

    ids = engine.encode(prompt)
    out = engine.generate(prompt, max_new_tokens=max_new_tokens, temperature=0, use_draft=False).ids
    seq = list(ids) + list(out)
    index = NgramIndex(np.array(ids), max_ngram, min_ngram)
    logits = engine.draft.prefill(np.array(ids))
    rows = []
    for j in range(len(ids), len(seq)):
        lg = logits[:engine.vocab_size]
        top = int(lg.argmax())
        toks = index.sync(seq[len(ids):j])
        nxt, n = index.follower(toks[-max_ngram:])
        rows.append((top, _confidence(lg, top), toks[nxt] if nxt is not None else None, n, seq[j]))
        logits = engine.draft.extend(np.array([seq[j]]))[-1]
    return rows


def replay_online(rows: list[tuple], max_ngram: int, per_round: int = 5) -> float:
    """Greedy agreement of HybridDrafter's rule learned online over ``rows`` in order (its priors
    and forgetting; the statistics decay once per ``per_round`` positions, about a round)."""
    from edgespec.drafters import _BINS, _FORGET, prefers_lookup, sureness_bin

    keeps = np.zeros((2, max_ngram + 1, _BINS))
    ok = 0
    for i, (model, conf, look, n, target) in enumerate(rows):
        b = sureness_bin(conf)
        differs = look is not None and look != model
        ok += (look if differs and prefers_lookup(keeps, n, b) else model) == target
        if i % per_round == 0:
            keeps *= _FORGET
        if differs:
            keeps[0, n, b] += look == target
            keeps[1, n, b] += model == target
    return ok / len(rows)


def main(argv=None) -> int:
    import edgespec
    from edgespec.cli import at_least
    from edgespec.outputs import check_report_folder
    from edgespec.drafters import _BINS, sureness_bin
    from edgespec.errors import InvalidArgumentError
    from edgespec.prompts import CODE_PROMPTS
    from edgespec.report import machine_description, write_json

    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("bundle", type=Path)
    ap.add_argument("--max-new-tokens", type=at_least(1), default=200)
    ap.add_argument("--out", type=Path, default=None)
    args = ap.parse_args(argv)
    if args.out is not None:  # before the measurement, not after it
        check_report_folder(args.out)
    engine = edgespec.load(args.bundle, threads=1)
    if engine.draft is None:
        raise InvalidArgumentError(f"{args.bundle} has no draft model; pass a bundle exported with --draft")
    max_ngram, min_ngram = 4, 2
    rows = [r for prompt in CODE_PROMPTS for r in trace(engine, prompt, args.max_new_tokens, max_ngram, min_ngram)]
    model_ok = np.array([r[0] == r[4] for r in rows])
    cells, best_gain = [], 0
    for n in range(min_ngram, max_ngram + 1):
        for b in range(_BINS):
            sel = [r for r in rows if r[2] is not None and r[2] != r[0] and r[3] == n and sureness_bin(r[1]) == b]
            if not sel:
                continue
            look, model = sum(r[2] == r[4] for r in sel), sum(r[0] == r[4] for r in sel)
            best_gain += max(0, look - model)
            cells.append({"match_length": n, "confidence_bin": b, "positions": len(sel),
                          "lookup_right": look / len(sel), "model_right": model / len(sel)})
    result = {"positions": len(rows), "model_agreement": float(model_ok.mean()),
              "lookup_found": float(np.mean([r[2] is not None for r in rows])),
              "differ": float(np.mean([r[2] is not None and r[2] != r[0] for r in rows])),
              "best_per_cell_agreement": float((model_ok.sum() + best_gain) / len(rows)),
              "online_rule_agreement": replay_online(rows, max_ngram), "cells": cells}
    print(f"{len(rows)} positions ({len(CODE_PROMPTS)} prompts x {args.max_new_tokens} greedy tokens of the target); a lookup found at "
          f"{result['lookup_found']:.3f}, differing from the model's argmax at {result['differ']:.3f}")
    print("| match length | model's confidence | positions | lookup right | model right |\n|---|---|---|---|---|")
    for c in cells:
        print(f"| {c['match_length']} | [{c['confidence_bin'] / _BINS:.1f}, {(c['confidence_bin'] + 1) / _BINS:.1f}) | "
              f"{c['positions']} | {c['lookup_right']:.2f} | {c['model_right']:.2f} |")
    print(f"greedy agreement with the target: model {result['model_agreement']:.4f}; best choice per cell (in-sample "
          f"bound) {result['best_per_cell_agreement']:.4f}; HybridDrafter's rule online {result['online_rule_agreement']:.4f}")
    if args.out is not None:
        write_json(args.out / "lookup_agreement.json", {"machine": machine_description(), "bundle": str(args.bundle),
                                                        "max_new_tokens": args.max_new_tokens, **result,
                                                        "command": " ".join(sys.argv)})
    return 0


if __name__ == "__main__":
    from edgespec.cli import run_script

    sys.exit(run_script(main, "lookup_agreement.py"))
