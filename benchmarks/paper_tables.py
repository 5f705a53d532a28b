"""Reproduce the paper's Tables 2-5 and Figure 3 on our own models.

    python benchmarks/paper_tables.py --pair ~/.cache/edgespec/pairs/<pair> --out benchmarks/results/<tag>

Drafts compared against one target: every model draft given with --draft NAME=DIR (a Hugging Face
checkpoint folder; the pair's own draft is always included; each is exported with the pair's target
to PAIR/bundles/NAME once, and reused while it loads), count-based unigram and bigram drafts
estimated from the training corpus (the paper's Table 3 baselines), and the model-free prompt-lookup
drafter. For each draft and temperature (0 and 1) a gamma sweep is measured with plain and
speculative decoding interleaved in the same run (medians over repeats after a warm-up).

Table 2: alpha, c and the best measured speedup per draft and temperature.
Table 3: alpha per draft.
Table 4: Theorem 3.8's expected speedup (from the measured alpha and c) against the measured one.
Table 5: lenience l = 1, 0.5, 0.3, 0.2, 0.1 (T = 1): speedup and the total-variation distance of the
         output distribution from the target's, computed exactly per position on held-out text.
Figure 3: the optimal gamma against alpha for several c (theory), with our measured points.
"""
from __future__ import annotations

import argparse
import json
import re
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).parent))

from count_drafts import count_backends  # noqa: E402

from edgespec import theory  # noqa: E402
from edgespec.bench import open_bundle  # noqa: E402
from edgespec.config import SamplingConfig  # noqa: E402
from edgespec.errors import InvalidArgumentError  # noqa: E402
from edgespec.measure import ReadCounter, Setting, run_setting  # noqa: E402
from edgespec.outputs import check_report_folder  # noqa: E402
from edgespec.pair import refuse_bundle_as_pair  # noqa: E402
from edgespec.prompts import CODE_PROMPTS  # noqa: E402
from edgespec.report import machine_description, write_json  # noqa: E402
from edgespec.sampling import process_logits  # noqa: E402

LENIENCE = (1.0, 0.5, 0.3, 0.2, 0.1)


def log(msg: str) -> None:
    print(f"[tables] {msg}", file=sys.stderr, flush=True)


def ensure_bundle(pair: Path, name: str, draft_dir: Path) -> Path:
    from edgespec.bundle import load_bundle
    from edgespec.errors import BundleError
    from edgespec.export.pipeline import export_bundle

    from edgespec.export.pipeline import ExportOptions

    out = pair / "bundles" / name
    try:
        if load_bundle(out).target.kv_layout == "static":  # else an export from before static-KV graphs
            return out
    except BundleError:
        if out.exists() and (not out.is_dir() or any(out.iterdir())) and not (out / "edgespec.json").exists():
            raise InvalidArgumentError(f"{out} exists and is not a bundle; --draft {name}=... exports into it: "
                                       "choose another NAME or move that folder away") from None
    log(f"exporting target + {name} draft to {out}")
    export_bundle(pair / "target", out, draft=draft_dir, progress=log, options=ExportOptions(overwrite=True))
    return out


def lenient_tv(p: np.ndarray, q: np.ndarray, l: float) -> np.ndarray:
    """Exact TV(P_l, p) per row, where P_l is the output distribution of one lenient step:
    P_l(x) = q(x) min(1, p(x) / (l q(x))) + (1 - sum_y q(y) min(1, p(y)/(l q(y)))) norm(max(0, p - l q))(x).
    p, q: [n, V] -> [n]."""
    with np.errstate(divide="ignore", invalid="ignore"):
        keep = np.where(q > 0, np.minimum(1.0, p / (l * q)), 0.0)          # [n, V]
    kept = q * keep                                                        # [n, V]
    resid = np.maximum(p - l * q, 0.0)                                     # [n, V]
    mass = resid.sum(axis=1, keepdims=True)                                # [n, 1]
    resid = np.where(mass > 0, resid / np.where(mass > 0, mass, 1.0), p)
    out = kept + (1.0 - kept.sum(axis=1, keepdims=True)) * resid
    return 0.5 * np.abs(out - p).sum(axis=1)


def teacher_forced_probs(backend, ids: list[int], vocab: int, sampling: SamplingConfig) -> np.ndarray:
    """Processed distributions at every position of ``ids`` after the first: [len(ids) - 1, V]."""
    first = backend.prefill(np.asarray(ids[:1]))[None, :vocab]
    rest = backend.extend(np.asarray(ids[1:-1]))[:, :vocab]
    return process_logits(np.concatenate([first, rest]), sampling)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--pair", type=Path, required=True, help="pair folder from `edgespec train-pair` (target/, draft/)")
    ap.add_argument("--draft", action="append", default=[], help="extra model draft NAME=DIR (repeatable)")
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--gammas", default="1,2,3,4,6,8")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--max-new-tokens", type=int, default=64)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--no-count-drafts", action="store_true")
    args = ap.parse_args(argv)
    if args.out is not None:  # before the measurement, not after it
        check_report_folder(args.out)
    try:
        gammas = sorted({int(g) for g in args.gammas.split(",") if g.strip()})
    except ValueError:
        raise InvalidArgumentError(f"--gammas takes integers >= 1 (adaptive gamma is always measured too); got "
                                   f"{args.gammas!r}") from None
    if not gammas or gammas[0] < 1 or args.repeats < 1 or args.max_new_tokens < 1 or args.threads < 0:
        raise InvalidArgumentError("--gammas (integers) and --repeats, --max-new-tokens must be >= 1, --threads >= 0")
    drafts = {"pair-draft": args.pair / "draft"}
    for spec in args.draft:
        name, eq, path = spec.partition("=")
        if not eq or not path or not re.fullmatch(r"[A-Za-z0-9_][A-Za-z0-9_.-]*", name) or name in drafts:
            raise InvalidArgumentError(f"--draft takes NAME=DIR, NAME a new plain name (letters, digits, _ . -; it names "
                                       f"the bundle folder PAIR/bundles/NAME); got {spec!r}")
        drafts[name] = Path(path)
    # every folder is checked before the first export: a missing one must not cost the others' exports
    refuse_bundle_as_pair(args.pair)
    if not (args.pair / "target" / "config.json").is_file():
        raise InvalidArgumentError(f"--pair {str(args.pair)!r} holds no target model (target/config.json); pass the "
                                   "folder `edgespec train-pair --print-path` prints")
    for name, folder in drafts.items():
        if not (folder / "config.json").is_file():
            raise InvalidArgumentError(f"draft {name!r}: {str(folder)!r} is not a model folder (no config.json); "
                                       "--draft takes NAME=DIR with DIR a Hugging Face checkpoint folder")
    t_start = time.perf_counter()
    rows: list[dict] = []
    bundles = {name: ensure_bundle(args.pair, name, d) for name, d in drafts.items()}
    first = open_bundle(next(iter(bundles.values())), threads=args.threads, spinning=False)
    tok, manifest = first.tokenizer, first.manifest
    vocab = manifest.sample_vocab_size
    prompts = [tok.encode(p).ids for p in CODE_PROMPTS[:4]]
    eos = tuple(manifest.target.eos_token_ids)

    def sweep(name: str, target, draft, kind: str = "model"):
        for t in (0.0, 1.0):
            for g in gammas + [None]:
                s = Setting(g, SamplingConfig(t), 1.0, kind)
                r = run_setting(target, draft, prompts, s, args.max_new_tokens, args.repeats, eos_token_ids=eos,
                                vocab_size=vocab, progress=log)
                row = {"draft_name": name, **r.summary()}
                rows.append(row)
                log(f"{name} {s.label}: alpha {row['alpha']:.3f} c {row['c']:.3f} speedup {row['speedup']:.2f}x "
                    f"(Thm 3.8 {row['predicted_speedup']:.2f}x)")

    for name, b in bundles.items():
        ob = first if name == "pair-draft" else open_bundle(b, threads=args.threads, spinning=False)
        sweep(name, ob.target, ob.draft)
    if not args.no_count_drafts:
        from edgespec.corpus import load_documents

        corpus = load_documents(None)
        log(f"counting unigrams and bigrams over {len(corpus.train_docs)} training files")
        docs = [e.ids for e in tok.encode_batch(list(corpus.train_docs))]
        for name, backend in count_backends(docs, vocab, first.target.max_length).items():
            table_bytes = backend.model.table.nbytes // backend.model.table.shape[0]  # one row read per step
            sweep(name, first.target, ReadCounter(backend, table_bytes, 0))
    sweep("prompt-lookup", first.target, None, kind="ngram")

    # Table 5: lenience at T = 1 with the pair's draft, best gamma of the T = 1 sweep.
    pair_t1 = [r for r in rows if r["draft_name"] == "pair-draft" and r["temperature"] == 1.0 and r["gamma"]]
    g_best = max(pair_t1, key=lambda r: r["speedup"])["gamma"]
    held = [tok.encode(p).ids for p in CODE_PROMPTS[4:]]
    sampling = SamplingConfig(1.0)
    ps, qs = [], []
    for ids in held:
        ps.append(teacher_forced_probs(first.target, ids, vocab, sampling))
        qs.append(teacher_forced_probs(first.draft, ids, vocab, sampling))
    p_all, q_all = np.concatenate(ps), np.concatenate(qs)
    lenience_rows = []
    for l in LENIENCE:
        r = run_setting(first.target, first.draft, prompts, Setting(g_best, sampling, l), args.max_new_tokens,
                        args.repeats, eos_token_ids=eos, vocab_size=vocab, progress=log)
        row = r.summary()
        row["tv_from_target_mean"] = float(lenient_tv(p_all, q_all, l).mean())
        row["tv_positions"] = int(p_all.shape[0])
        lenience_rows.append(row)
        log(f"lenience {l}: speedup {row['speedup']:.2f}x, mean TV {row['tv_from_target_mean']:.4f}")

    payload = {"pair": str(args.pair), "machine": machine_description(), "threads": args.threads,
               "repeats": args.repeats, "warmup": 1, "max_new_tokens": args.max_new_tokens,
               "prompts": len(prompts), "command": " ".join(sys.argv), "seconds": time.perf_counter() - t_start,
               "pair_meta": json.loads((args.pair / "pair.json").read_text()) if (args.pair / "pair.json").exists() else {},
               "sweep": rows, "lenience": lenience_rows}
    write_json(args.out / "tables.json", payload)
    (args.out / "tables.md").write_text(render_markdown(payload))
    plot_figure3(rows, args.out / "figure3.png")
    print(render_markdown(payload))
    return 0


def _best(rows, name, t):
    cands = [r for r in rows if r["draft_name"] == name and r["temperature"] == t]
    return max(cands, key=lambda r: r["speedup"]) if cands else None


def render_markdown(payload: dict) -> str:
    rows, lrows = payload["sweep"], payload["lenience"]
    names = list(dict.fromkeys(r["draft_name"] for r in rows))
    m = payload["machine"]
    out = [f"Machine: {m.get('cpu_model', m['processor'])}, {m['cpu_count']} cores, onnxruntime "
           f"{m.get('onnxruntime')}, {payload['threads']} thread(s) per model; {payload['repeats']} repeats after 1 "
           f"warm-up, {payload['prompts']} prompts x {payload['max_new_tokens']} new tokens; medians.", "",
           "Table 2 (best gamma of the sweep per draft and temperature; speedup = speculative / plain tokens/s, same run)",
           "", "| draft | T | best gamma | alpha | c | speedup | Thm 3.8 |", "|---|---|---|---|---|---|---|"]
    for n in names:
        for t in (0.0, 1.0):
            b = _best(rows, n, t)
            if b:
                g = b["gamma"] if b["gamma"] is not None else f"auto ({b['mean_gamma']:.1f})"
                out.append(f"| {n} | {t:g} | {g} | {b['alpha']:.3f} | {b['c']:.3f} | {b['speedup']:.2f}x | "
                           f"{b['predicted_speedup']:.2f}x |")
    out += ["", "Table 3 (alpha per draft, mean over the sweep's runs)", "", "| draft | alpha T=0 | alpha T=1 |", "|---|---|---|"]
    for n in names:
        a = [np.mean([r["alpha"] for r in rows if r["draft_name"] == n and r["temperature"] == t]) for t in (0.0, 1.0)]
        out.append(f"| {n} | {a[0]:.3f} | {a[1]:.3f} |")
    out += ["", "Table 4 (expected vs measured, every cell of the sweep)", "",
            "| draft | T | gamma | alpha | c | tokens/round (theory) | expected speedup | measured speedup |",
            "|---|---|---|---|---|---|---|---|"]
    for r in rows:
        g = r["gamma"] if r["gamma"] is not None else f"auto ({r['mean_gamma']:.1f})"
        out.append(f"| {r['draft_name']} | {r['temperature']:g} | {g} | {r['alpha']:.3f} | {r['c']:.3f} | "
                   f"{r['tokens_per_round']:.2f} ({r['expected_tokens_per_round']:.2f}) | "
                   f"{r['predicted_speedup']:.2f}x | {r['speedup']:.2f}x |")
    out += ["", "Table 5 (lenience, T=1, pair draft; TV = mean exact total variation of one step's output "
            "distribution from the target's, over held-out positions)", "",
            "| l | acceptance | speedup | mean TV from target |", "|---|---|---|---|"]
    for r in lrows:
        out.append(f"| {r['lenience']:g} | {r['acceptance_rate']:.3f} | {r['speedup']:.2f}x | {r['tv_from_target_mean']:.4f} |")
    return "\n".join(out) + "\n"


def plot_figure3(rows: list[dict], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6.4, 4.2))
    alphas = np.linspace(0.05, 0.97, 200)
    for c in (0.01, 0.05, 0.1, 0.2, 0.5):
        ax.plot(alphas, [theory.optimal_gamma(float(a), c, 32) for a in alphas], label=f"c = {c}")
    best = {}
    for r in rows:
        if r["gamma"] and r["draft_name"] != "prompt-lookup":
            key = (r["draft_name"], r["temperature"])
            if key not in best or r["speedup"] > best[key]["speedup"]:
                best[key] = r
    if best:
        ax.scatter([r["alpha"] for r in best.values()], [r["gamma"] for r in best.values()], color="k", zorder=5,
                   label="measured best gamma (ours)")
    ax.set_xlabel("alpha")
    ax.set_ylabel("optimal gamma (Theorem 3.8)")
    ax.set_yscale("log")
    ax.legend(fontsize=8)
    ax.set_title("Figure 3: optimal gamma against alpha and c")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


if __name__ == "__main__":
    from edgespec.cli import run_script

    sys.exit(run_script(main, "paper_tables.py"))
