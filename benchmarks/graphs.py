"""Per-call cost of the same model exported two ways (static-KV graph vs optimum's concat graph),
measured interleaved call by call so that a noisy machine affects both alike.

    python benchmarks/graphs.py --static BUNDLE_A --concat BUNDLE_B --out benchmarks/results/<tag>/graphs

For each role (target, draft) and width k: prefill 100 random tokens, then repeat {rewind to 100,
one k-token call} alternating between the two bundles; medians over the calls after 5 warm-ups.
Both bundles must hold the same checkpoints (e.g. `edgespec export ... --graph optimum` for B).
"""
from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import numpy as np

from edgespec import contract
from edgespec.bundle import load_bundle
from edgespec.cli import at_least
from edgespec.outputs import check_report_folder
from edgespec.errors import InvalidArgumentError
from edgespec.report import machine_description, write_json
from edgespec.runtimes.onnx_backend import SessionConfig, open_backend

WIDTHS = (1, 2, 3, 5, 8)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--static", type=Path, required=True)
    ap.add_argument("--concat", type=Path, required=True)
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--calls", type=at_least(1), default=60)
    ap.add_argument("--threads", type=at_least(0), default=1)
    args = ap.parse_args(argv)
    if args.out is not None:  # before the measurement, not after it
        check_report_folder(args.out)
    import onnx

    bundles = {"static": args.static, "concat": args.concat}
    manifests = {k: load_bundle(b) for k, b in bundles.items()}
    for k, m in manifests.items():  # each flag must name a bundle of that layout, of the same models
        if m.draft is None:
            raise InvalidArgumentError(f"--{k} {bundles[k]} has no draft; export the pair with --target and --draft")
        if m.target.kv_layout != k or m.draft.kv_layout != k:
            raise InvalidArgumentError(f"--{k} {bundles[k]} must be a target + draft bundle with {k} KV graphs "
                                       f"(it has {m.target.kv_layout}); export it with --graph "
                                       f"{'static' if k == 'static' else 'optimum'}")
    for role in ("target", "draft"):
        a, b = (manifests[k].models[role] for k in bundles)
        if (a.architecture, a.num_layers, a.vocab_size, a.num_kv_heads, a.head_size) != \
                (b.architecture, b.num_layers, b.vocab_size, b.num_kv_heads, b.head_size):
            raise InvalidArgumentError(f"the two bundles' {role}s differ (architecture, layers, vocabulary or attention shape); "
                                       "export the same checkpoints twice, with --graph static and --graph optimum")
    results: dict = {}
    for role in ("target", "draft"):
        backends = {}
        for k, b in bundles.items():
            m = manifests[k].models[role]
            backends[k] = open_backend(b / m.path, m, SessionConfig(intra_op_threads=args.threads, spinning=False))
            nodes = len(onnx.load(str(b / m.path / contract.DECODER_FILE), load_external_data=False).graph.node)
            results.setdefault(role, {}).setdefault(k, {"layout": m.kv_layout, "nodes": nodes, "ms": {}})
        vocab = manifests["static"].models[role].vocab_size
        rng = np.random.default_rng(0)
        prompt = rng.integers(0, vocab, 100)
        for be in backends.values():
            be.prefill(prompt)
        for width in WIDTHS:
            times = {k: [] for k in backends}
            for _ in range(args.calls + 5):
                ids = rng.integers(0, vocab, width)
                for k, be in backends.items():
                    be.rewind_to(100)
                    t0 = time.perf_counter()
                    be.extend(ids)
                    times[k].append(time.perf_counter() - t0)
            for k, ts in times.items():
                results[role][k]["ms"][width] = 1e3 * statistics.median(ts[5:])
    lines = ["| model | graph (kv_layout) | nodes in the file | " + " | ".join(f"{w} token{'s' * (w > 1)}" for w in WIDTHS) + " |",
             "|---|---|---|" + "---|" * len(WIDTHS)]
    for role, per in results.items():
        for k, r in per.items():
            lines.append(f"| {role} | {k} ({r['layout']}) | {r['nodes']} | " + " | ".join(f"{r['ms'][w]:.3f} ms" for w in WIDTHS) + " |")
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "graphs.md").write_text("\n".join(lines) + "\n")
    write_json(args.out / "graphs.json", {"machine": machine_description(), "threads": args.threads, "calls": args.calls,
                                          "bundles": {k: str(v) for k, v in bundles.items()}, "results": results,
                                          "command": " ".join(sys.argv)})
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    from edgespec.cli import run_script

    sys.exit(run_script(main, "graphs.py"))
