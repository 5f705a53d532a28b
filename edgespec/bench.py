"""``edgespec bench BUNDLE``: alpha, c, tokens per round, tokens/s plain vs speculative (same run,
interleaved, warm-up discarded, medians and IQR), Theorem 3.8 next to the measured speedup,
target/draft bytes read per generated token, and adaptive against the best static gamma (every
setting of a temperature runs side by side, prompt by prompt)."""
from __future__ import annotations

import argparse
import hashlib
import math
import shlex
import sys
import time
from dataclasses import dataclass
from pathlib import Path

from . import __version__
from .backend import draft_limit_words, draft_prompt_limit, prompt_limit
from .config import SamplingConfig
from .errors import InvalidArgumentError, PromptTooLongError, warn
from .cli import at_least, folder, parse_list
from .measure import ReadCounter, Setting, adaptive_vs_static, hardware_counters_note, run_settings
from .prompts import CODE_PROMPTS
from .report import (PLOT_FILES, OtherLoad, format_table, machine_description, plot, source_commit, warn_if_busy,
                     write_json)


@dataclass
class OpenedBundle:
    """A bundle opened for measurement: backends wrapped in read counters, and its tokenizer."""

    target: ReadCounter
    draft: ReadCounter | None
    tokenizer: object
    manifest: object
    runtime: str
    verify_width: int | None = None  # most tokens one target call takes (XLA artifacts); None: any


def kv_bytes_per_token(model) -> int:
    """K and V for every layer, for one position, in the cache's dtype."""
    width = 2 if model.dtype == "fp16" else 4
    return 2 * model.num_layers * model.num_kv_heads * model.head_size * width


def open_bundle(bundle: str | Path, runtime: str = "onnx", providers=("cpu",), threads: int = 0,
                draft_threads: int | None = 1, spinning: bool | None = None, engine=None,
                platform: str | None = None, huge_pages: bool = True) -> OpenedBundle:
    """Wrap the backends of ``engine`` (an already loaded Engine) or of a newly loaded one."""
    from .api import load

    eng = engine or load(bundle, providers=providers, threads=threads, draft_threads=draft_threads,
                         spinning=spinning, runtime=runtime, platform=platform, huge_pages=huge_pages)
    target, draft, tokenizer, manifest = eng.target, eng.draft, eng.tokenizer, eng.manifest

    def counter(backend, model):
        if runtime == "xla":  # the artifacts' own (fp32) weights, and attention over the whole static buffer
            return ReadCounter(backend, backend.parameter_bytes, kv_bytes_per_token(model), backend.max_length)
        return ReadCounter(backend, int(model.parameter_bytes.get("per_forward", model.parameter_bytes.get("total", 0))),
                           kv_bytes_per_token(model))

    wrap_t = counter(target, manifest.target)
    wrap_d = counter(draft, manifest.draft) if draft is not None else None
    return OpenedBundle(wrap_t, wrap_d, tokenizer, manifest, runtime, eng.verify_width())


DEFAULT_MAX_NEW_TOKENS = 96  # per prompt; the demo's follow-up suggestion checks that it fits
DEFAULT_GAMMAS = "1,2,4,6,8,auto"


def _gamma(x: str):
    from .generate_cli import parse_gamma

    return parse_gamma(x, "--gammas")


def build_grid(gammas, temperatures, top_k: int, top_p: float, lenience, drafts) -> list[Setting]:
    grid = []
    for draft in drafts:
        for t in temperatures:
            sampling = SamplingConfig(t, top_k, top_p)
            for g in gammas:
                # greedy keeps a draft iff it is the target's argmax, whatever l: one setting, not copies
                for l in ([1.0] if sampling.greedy else lenience):
                    grid.append(Setting(g, sampling, l, draft))
    return grid


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("bundle", help="bundle folder written by `edgespec export` (target + draft)")
    p.add_argument("--runtime", choices=("onnx", "xla"), default="onnx",
                   help="ONNX Runtime, or the bundle's XLA artifacts (export --format onnx+xla) (default onnx)")
    p.add_argument("--platform", default=None, help="XLA platform: cpu, cuda, rocm, tpu (--runtime xla; default: JAX's default)")
    p.add_argument("--gammas", default=None, help=f"comma list; 'auto' = adaptive (default {DEFAULT_GAMMAS}; with XLA "
                                                  "artifacts, those their verify width takes)")
    p.add_argument("--temperatures", default="0,1", help="comma list; 0 = greedy (default 0,1)")
    p.add_argument("--top-k", type=int, default=0, help="sample from the k likeliest tokens (default 0: all)")
    p.add_argument("--top-p", type=float, default=1.0, help="nucleus sampling (default 1: off)")
    p.add_argument("--lenience", default="1", help="comma list of l in (0, 1] (Appendix A.5; 1 = exact)")
    p.add_argument("--draft", default="model", help="comma list of drafters: model, ngram, lookahead (the draft model drafting on while "
                   "the target verifies, on a second thread), hybrid (the draft model with prompt-lookup tokens where "
                   "those are kept more often) (default model)")
    p.add_argument("--prompts", type=Path, default=None,
                   help="text file, prompts separated by lines holding only '---' (default: built-in held-out code prompts)")
    p.add_argument("--max-new-tokens", type=at_least(1), default=DEFAULT_MAX_NEW_TOKENS,
                   help=f"tokens generated per prompt (default {DEFAULT_MAX_NEW_TOKENS})")
    p.add_argument("--repeats", type=at_least(1), default=5, help="measured repeats after one warm-up (default 5)")
    p.add_argument("--seed", type=at_least(0), default=0, help="seed of each prompt's sampling (default 0)")
    p.add_argument("--provider", default=None, help="execution providers, comma list in priority order (default cpu)")
    p.add_argument("--threads", type=int, default=None,
                   help="target intra-op threads (0 = ORT default; default 0, or with the lookahead drafter in "
                        "--draft all cores but one, for every setting alike)")
    p.add_argument("--draft-threads", type=int, default=None, help="draft intra-op threads (default 1; 0: ONNX Runtime's default, one per physical core)")
    p.add_argument("--spin", choices=("on", "off"), default=None,
                   help="ORT thread spin-waiting (default: ORT's, on; it only matters with more than one thread)")
    p.add_argument("--no-huge-pages", action="store_true",
                   help="leave ONNX Runtime's weights on the pages it allocated (default: moved onto transparent "
                        "huge pages where Linux allows it; plain and speculative decoding are then faster)")
    p.add_argument("--out", type=folder, default=None, help="folder for bench.json and PNG plots")
    p.add_argument("--quiet", "--no-progress", dest="quiet", action="store_true", help="no [bench] progress lines on stderr (the table and files are unchanged)")


def read_prompts(path: Path | None) -> list[str]:
    if path is None:
        return list(CODE_PROMPTS)
    if not path.is_file():
        raise InvalidArgumentError(f"--prompts {path} is not a file; give a text file with prompts separated by '---' lines")
    try:
        text = path.read_text(encoding="utf-8")
    except UnicodeDecodeError as exc:
        raise InvalidArgumentError(f"--prompts {path} is not UTF-8 text (byte {exc.start}); save it as UTF-8") from None
    parts, lines = [], []
    for line in text.splitlines() + ["---"]:   # a line holding only --- ends a prompt (the last one too)
        if line.strip() == "---":
            parts.append("\n".join(lines).strip("\n"))
            lines = []
        else:
            lines.append(line)
    kept = [i for i, p in enumerate(parts) if p.strip()]
    if not kept:
        raise InvalidArgumentError(f"--prompts {path} holds no prompt (prompts are separated by lines holding only ---)")
    blank = sum(not p.strip() for p in parts[kept[0]:kept[-1]])  # (a --- before the first or after the last is no prompt)
    if blank:
        warn(f"--prompts {path}: {blank} blank prompt{'s' * (blank != 1)} between '---' lines skipped; "
             f"measuring the other {len(kept)}")
    return [parts[i] for i in kept]


def _grid(args: argparse.Namespace) -> list:
    """The settings --gammas x --temperatures x --lenience x --draft (x top-k, top-p) asks for."""
    from .config import DRAFTERS

    temperatures, leniences = parse_list(args.temperatures, float, "temperatures"), parse_list(args.lenience, float, "lenience")
    if any(not (math.isfinite(t) and t >= 0) for t in temperatures):  # (SamplingConfig's message names --temperature)
        raise InvalidArgumentError(f"--temperatures takes finite numbers >= 0 (0 = greedy); got {args.temperatures!r}")
    bad = [x for x in leniences if not 0 < x <= 1]
    if bad:
        raise InvalidArgumentError(f"--lenience takes values in (0, 1] (Appendix A.5; 1 = exact); got {bad[0]:g}")
    if 0.0 in temperatures and min(leniences) < 1:
        print("[note: lenience has no effect at temperature 0 (a draft is kept iff it is the target's argmax): T=0 runs "
              "at l=1 only]", file=sys.stderr)
    gammas = parse_list(DEFAULT_GAMMAS if args.gammas is None else args.gammas, _gamma, "gammas")  # ("" is refused)
    grid = build_grid(gammas, temperatures, args.top_k, args.top_p, leniences,
                      parse_list(args.draft, str, "draft"))
    for s in grid:
        if s.draft not in DRAFTERS:
            raise InvalidArgumentError(f"--draft takes {', '.join(DRAFTERS)} (a comma list); got {s.draft!r}")
    return grid


# why a plain target step ran inside a speculative run (measure's plain_step_causes)
_CAUSES = {"adaptive_policy": "the adaptive policy finding them faster than drafted rounds",
           "nothing_drafted": "lookups that found nothing",
           "no_room": "no room to draft: a prompt's last new token, the draft's last positions"}


def plain_step_causes(row: dict) -> str:
    """Where a row's plain target steps came from, largest share first: "12% lookups that found nothing, ..."."""
    shares = sorted(((v, k) for k, v in (row.get("plain_step_causes") or {}).items() if v > 0), reverse=True)
    return ", ".join(f"{v:.0%} {_CAUSES[k]}" for v, k in shares)


def _print_notes(rows: list[dict], versus: list[dict]) -> None:
    """Below the table: adaptive against the best static gamma, and where plain target steps came from."""
    for v in versus:
        lo, hi = v["iqr"]
        iqr = f"[{lo:.3f}-{hi:.3f}]" if lo == lo and hi == hi else "[---]"  # one repeat: no spread
        lenient = f" l={v['lenience']:g}" if v["lenience"] != 1 else ""
        print(f"T={v['temperature']:g}{lenient} {v['draft']}: adaptive gamma / best static gamma ({v['best_static_gamma']}) "
              f"= {v['adaptive_over_best_static']:.3f} {iqr} (speculative tokens/s, same run)")
    for r in rows:  # plain target steps inside a run: where they came from
        why = plain_step_causes(r)
        if math.isnan(r["alpha"]) and r["plain_step_share"] > 0:  # no drafted round (each first token is the prefill's)
            print(f"{r['setting']}: no round was drafted: after each prompt's first token, every token came from plain "
                  f"target steps ({why}); the theory columns are empty")
        elif r["plain_step_share"] > 0.05:
            print(f"{r['setting']}: {r['plain_step_share']:.0%} of the tokens came from plain target steps ({why}; the "
                  "theory columns describe the drafted rounds)")


def run(args: argparse.Namespace) -> int:
    from .api import default_target_threads, gamma_bound, warn_if_no_spare_core
    from .generate_cli import refuse_ort_flags
    from .outputs import check_report_folder

    grid = _grid(args)
    if args.platform is not None and args.runtime != "xla":
        raise InvalidArgumentError("--platform picks the XLA device; add --runtime xla or drop --platform")
    refuse_ort_flags(args.runtime, {"--provider": args.provider is not None, "--threads": args.threads is not None,
                                    "--draft-threads": args.draft_threads is not None, "--spin": args.spin is not None,
                                    "--no-huge-pages": args.no_huge_pages})
    if args.draft_threads is not None and all(s.draft == "ngram" for s in grid):
        raise InvalidArgumentError("--draft ngram uses no draft model: --draft-threads has no effect; drop it")
    draft_threads = 1 if args.draft_threads is None else args.draft_threads
    if args.out is not None:   # before the measurement, not after it
        check_report_folder(args.out)
    lookahead = any(s.draft == "lookahead" for s in grid)
    threads = default_target_threads(lookahead) if args.threads is None else args.threads
    threads = 0 if args.runtime == "xla" else threads  # ONNX Runtime's setting (--threads is refused with xla)
    spin = {"on": True, "off": False, None: None}[args.spin]
    providers = "cpu" if args.provider is None else args.provider   # parsed (and an empty list refused) by load()
    ob = open_bundle(args.bundle, args.runtime, providers, threads, draft_threads, spin,
                     platform=args.platform, huge_pages=not args.no_huge_pages)
    if lookahead and args.runtime == "onnx":  # XLA has no thread setting to change
        warn_if_no_spare_core(threads)
    width = ob.verify_width
    if width is not None and width < 2:
        raise InvalidArgumentError(f"this bundle's XLA artifacts verify one token per call (verify_width={width}): no "
                                   "room for a draft token, and bench measures speculative decoding; re-export with "
                                   "`--verify-width 9`")
    if args.gammas is None and width is not None:  # the default list, within what the artifacts verify
        kept = [s for s in grid if s.gamma is None or s.gamma <= width - 1]
        if len(kept) < len(grid):
            print(f"[note: --gammas defaults to {','.join(str(g) for g in sorted({s.gamma for s in kept if s.gamma}))},"
                  f"auto here: the XLA artifacts verify at most {width} tokens per call]", file=sys.stderr)
        grid = kept
    # the adaptive settings' bound: 8, within what the XLA artifacts verify in one call
    gamma_bound([s.gamma for s in grid if s.gamma is not None], width, "--gammas")
    max_gamma = gamma_bound([], width)
    if ob.draft is None and any(s.draft != "ngram" for s in grid):
        raise InvalidArgumentError(f"{args.bundle} has no draft model; export one with --draft, or use --draft ngram")
    texts = read_prompts(args.prompts)
    prompts = [ob.tokenizer.encode(p).ids for p in texts]
    longest = max(len(p) for p in prompts)
    # (a prompt too long for the target too is reported by the run, as the target's)
    if ob.draft is not None and any(s.draft != "ngram" for s in grid) and \
            draft_prompt_limit(ob.draft.backend) < longest <= prompt_limit(ob.target.backend):
        which = "the built-in prompts" if args.prompts is None else f"--prompts {args.prompts}"
        raise PromptTooLongError(f"a prompt has {longest} tokens but the draft model {draft_limit_words(ob.draft.backend)} "
                                 f"({which}): pass --prompts FILE with shorter prompts, or measure the "
                                 "prompt-lookup drafter alone (--draft ngram)", "prompt")
    log = (lambda m: None) if args.quiet else (lambda m: print(f"[bench] {m}", file=sys.stderr, flush=True))
    for name, backend in (("target", ob.target.backend), ("draft", ob.draft.backend if ob.draft else None)):
        if hasattr(backend, "warmup"):  # XLA: each artifact compiles on first use, which must not land in a timed call
            log(f"compiling the {name}'s XLA artifacts")
            backend.warmup()
    t0, others_cpu = time.perf_counter(), OtherLoad()
    # Settings that sample alike are measured side by side (one shared plain run per prompt), so
    # they can be compared with each other too (adaptive vs static gamma below).
    try:
        results = run_settings(ob.target, ob.draft, prompts, grid, args.max_new_tokens, args.repeats, warmup=1,
                               eos_token_ids=tuple(ob.manifest.target.eos_token_ids), seed=args.seed, progress=log,
                               vocab_size=ob.manifest.sample_vocab_size, max_gamma=max_gamma)
    except PromptTooLongError as exc:  # the user may not have written these prompts: say which knob to turn
        which = "the built-in prompts" if args.prompts is None else f"a prompt of {args.prompts}"
        fix = {"prompt": f"{which}: pass --prompts FILE with shorter prompts",
               "max_new_tokens": "lower --max-new-tokens"}.get(exc.knob, f"{which}: pass --prompts FILE with shorter "
                                                                          "prompts, or lower --max-new-tokens")
        raise PromptTooLongError(f"{exc} ({fix})", exc.knob) from None
    rows = [r.summary() for r in results]
    others = others_cpu.cores()
    versus = adaptive_vs_static(results)
    note = hardware_counters_note()
    ort = args.runtime == "onnx"  # ONNX Runtime's settings; with XLA, the platform the artifacts ran on
    payload = {"bundle": str(args.bundle), "runtime": args.runtime, "machine": machine_description(),
               "providers": providers if ort else None, "threads": threads if ort else None,
               "draft_threads": draft_threads if ort else None,
               "platform": None if ort else ob.target.backend.platform, "verify_width": ob.verify_width,
               "jax": None if ort else __import__("jax").__version__,
               "spin": (args.spin or "default") if ort else None, "huge_pages": (not args.no_huge_pages) if ort else None,
               "prompts": len(prompts), "max_new_tokens": args.max_new_tokens,
               "repeats": args.repeats, "warmup": 1, "seconds": time.perf_counter() - t0,
               "other_cpu_load_cores": others,
               "hardware_counters": note, "results": rows, "adaptive_vs_static": versus,
               "seed": args.seed, "prompts_sha256": hashlib.sha256("\n---\n".join(texts).encode()).hexdigest(),
               "edgespec": {"version": __version__, "commit": source_commit()},
               "command": shlex.join(["edgespec", *getattr(args, "argv", ["bench"])])}
    written = []
    if args.out is not None:
        # Written before anything is printed (`edgespec bench ... | head` closed stdout and lost the
        # run). An earlier run's report goes first: interrupted while plotting (or without
        # matplotlib), the folder held this run's bench.json beside the last run's plots.
        for name in ("bench.json", *PLOT_FILES):
            (args.out / name).unlink(missing_ok=True)
        try:
            write_json(args.out / "bench.json", payload)
            written = plot(rows, args.out)
        finally:  # (a full disk: the measurement is not lost with the file; the error follows the table)
            print(format_table(rows))
    else:
        print(format_table(rows))
    _print_notes(rows, versus)
    print(note)
    warn_if_busy(others)  # after the table
    if args.out is not None:
        print(f"wrote {args.out / 'bench.json'}" + "".join(f", {p}" for p in written or []))
        if written is None:
            print("plots skipped: matplotlib is not installed (pip install 'edgespec[bench]')", file=sys.stderr)
    return 0
