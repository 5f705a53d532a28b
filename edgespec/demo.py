"""``edgespec demo``: the whole product on the default pair. Train (or reuse) the quick Llama pair,
export it with the real exporter, stream a speculative generation, then measure plain against
speculative decoding side by side and print alpha, c, tokens per target call, tokens/s, the
speedup next to Theorem 3.8, and the memory reads per token."""
from __future__ import annotations

import argparse
import math
import shlex
import sys
import time
from pathlib import Path

from . import contract
from .bench import DEFAULT_MAX_NEW_TOKENS, plain_step_causes
from .config import SamplingConfig
from .errors import BundleError, InvalidArgumentError, OutputExistsError
from .cli import at_least, parse_list
from .measure import Setting, hardware_counters_note, run_settings
from .prompts import CODE_PROMPTS
from .report import OtherLoad, cell, machine_description, ratio_cell, warn_if_busy


def add_arguments(p: argparse.ArgumentParser) -> None:
    from .pair import PRESETS

    p.add_argument("--preset", default="quick", choices=sorted(PRESETS),
                   help="pair preset: quick (default, minutes), bench (about 40 minutes on 2 cores) or tiny (seconds; a smoke test)")
    p.add_argument("--corpus", nargs="*", type=Path, default=None,
                   help="text files or folders to train on (default: this Python's standard library source)")
    p.add_argument("--gamma", default="4,auto",
                   help="draft tokens per round, or 'auto' (adaptive, the default of `edgespec generate` and the API); "
                        "a comma list measures each side by side, and the streamed generation uses the first "
                        "(default 4,auto)")
    p.add_argument("--max-new-tokens", type=at_least(1), default=None,
                   help=f"tokens per prompt (default {DEFAULT_MAX_NEW_TOKENS}, at most half the pair's positions: "
                        f"{PRESETS['tiny'].context // 2} for tiny)")
    p.add_argument("--repeats", type=at_least(1), default=3, help="measured repeats after one warm-up (default 3)")
    p.add_argument("--threads", type=at_least(0), default=1,
                   help="ONNX Runtime intra-op threads of the target (default 1; 0: ONNX Runtime's default); the draft runs on 1")
    p.add_argument("--seed", type=at_least(0), default=0,
                   help="seed of the pair's training and of the sampled runs (default 0)")


def ensure_bundle(pair_dir: Path, log) -> Path:
    """Export the pair once into <pair>/bundle; reuse it while it loads. A damaged one is exported
    again, under --overwrite's rules: a file of the user's in that folder is named, never deleted."""
    from .bundle import PARTIAL_MARKER, load_bundle
    from .outputs import BUNDLE_FILES, foreign_names, named

    bundle = pair_dir / "bundle"
    redo = f"move it away (or delete it) and run edgespec demo again, which exports the pair to {str(bundle)!r}"
    if bundle.is_symlink() or (bundle.exists() and not bundle.is_dir()):
        raise OutputExistsError(f"{str(bundle)!r} is a {'symbolic link' if bundle.is_symlink() else 'file'}, not the "
                                f"pair's exported bundle: {redo}")
    if bundle.exists():
        try:
            load_bundle(bundle)
            log(f"reusing the exported bundle in {bundle}")
            return bundle
        except BundleError as exc:
            log(f"re-exporting: {exc}")
        if any(bundle.iterdir()) and not (bundle / contract.MANIFEST_NAME).is_file():
            raise OutputExistsError(f"{str(bundle)!r} holds files but no {contract.MANIFEST_NAME}, so which of them an "
                                    f"export wrote is unknown: {redo}")
        extra = foreign_names(bundle, BUNDLE_FILES | {PARTIAL_MARKER})
        if extra:
            raise OutputExistsError(f"{str(bundle)!r} needs exporting again but also holds what the export did not "
                                    f"write ({named(extra)}); move that out of the folder and run edgespec demo again")
    from .export.pipeline import ExportOptions, export_bundle

    export_bundle(pair_dir / "target", bundle, draft=pair_dir / "draft",
                  options=ExportOptions(overwrite=bundle.exists()), progress=log)
    return bundle


def _fmt(x: float, spec: str = ".3f") -> str:
    return cell(x, spec, "n/a")


def _ratio(x: float) -> str:
    return ratio_cell(x, "n/a")


def _print_row(row: dict, auto_shown: bool = False) -> None:
    if row["gamma"] is not None:
        g = row["gamma"]
    else:  # (no drafted round: no mean to show)
        g = "auto (nothing drafted)" if math.isnan(row["mean_gamma"]) else f"auto (mean {row['mean_gamma']:.1f})"
    print(f"\n  temperature {row['temperature']:g}, gamma {g}:")
    print(f"    alpha (E[sum min(p, q)])       {_fmt(row['alpha'])}")
    print(f"    c (draft step / verify call)   {_fmt(row['c'])}")
    print(f"    tokens per round               {_fmt(row['tokens_per_round'], '.2f')} "
          f"(theory (1 - a^(g+1))/(1 - a) at each round's own gamma: {_fmt(row['expected_tokens_per_round'], '.2f')})")
    print(f"    tokens/s plain                 {_fmt(row['plain_tokens_per_s'], '.1f')} (median of the repeats)")
    print(f"    tokens/s speculative           {_fmt(row['spec_tokens_per_s'], '.1f')}")
    # each repeat's ratio is taken within the repeat, so this is not the ratio of the two medians above
    ratios = ", ".join(f"{r:.2f}" for r in row.get("speedup_all") or [])
    print(f"    speedup (each repeat, median)  {_ratio(row['speedup'])}   "
          f"Theorem 3.8 predicts {_ratio(row['predicted_speedup'])}"
          + (f"   (per repeat: {ratios})" if ratios else ""))
    print(f"    decode speedup (after 1st tok) {_ratio(row['decode_speedup'])}   "
          f"(prefill and first token: {_fmt(row['plain_ttft_s'] * 1e3, '.1f')} ms plain, "
          f"{_fmt(row['spec_ttft_s'] * 1e3, '.1f')} ms speculative)")
    if "target_read_reduction" in row:
        print(f"    target bytes read per token    {row['target_bytes_per_token_plain'] / 1e6:.2f} MB plain -> "
              f"{row['target_bytes_per_token_spec'] / 1e6:.2f} MB speculative "
              f"({row['target_read_reduction']:.2f}x fewer; draft adds {row['draft_bytes_per_token_spec'] / 1e6:.2f} MB)")
    if row["gamma"] is None and row["plain_step_share"] > 0.05:
        print(f"    plain target steps             {row['plain_step_share']:.0%} of the tokens ({plain_step_causes(row)})")
    elif row["gamma"] is not None and row["speedup"] < 1 and not math.isnan(row["verify_cost_steps"]):
        # (with no round drafted, e.g. --max-new-tokens 1, the two ran the same steps: nothing to explain)
        print(f"    slower than plain decoding here: a verify call cost {_fmt(row['verify_cost_steps'], '.2f')} plain "
              "steps. Adaptive gamma (the default of `edgespec generate` and the API) takes plain steps where "
              "drafting loses: " + ("the gamma auto row at this temperature" if auto_shown
                                     else "`edgespec demo --gamma auto`"))


def run(args: argparse.Namespace) -> int:
    from .api import load
    from .bench import open_bundle
    from .generate_cli import parse_gamma
    from .pair import get_preset, train_pair

    def log(msg: str) -> None:
        print(f"[demo] {msg}", file=sys.stderr, flush=True)

    # every option is checked before minutes of training
    gammas = parse_list(args.gamma, lambda x: parse_gamma(x, "--gamma"), "gamma")
    positions = get_preset(args.preset).context  # the pair's models are trained for this many positions
    if args.max_new_tokens is None:  # (96 left the tiny pair's 32 positions no room: a trial's find)
        args.max_new_tokens = min(DEFAULT_MAX_NEW_TOKENS, positions // 2)
    if args.max_new_tokens >= positions:
        raise InvalidArgumentError(f"--max-new-tokens {args.max_new_tokens} leaves no room for a prompt in the "
                                   f"{args.preset} pair's {positions} positions; lower it")
    t_all = time.perf_counter()
    log(f"step 1/4: the {args.preset} pair (trained once, then cached)")
    pair_dir = train_pair(args.preset, args.corpus, seed=args.seed, progress=True)
    log("step 2/4: export to ONNX with KV-cache IO, validated against PyTorch")
    bundle = ensure_bundle(pair_dir, log)

    log("step 3/4: a speculative generation (T=0.7, top-p 0.9, exact), streamed as tokens are committed")
    eng = load(bundle, threads=args.threads, spinning=False)
    room = eng.manifest.target.max_positions - args.max_new_tokens

    def fit(text: str) -> list[int]:  # keep the prompt's tail when the model's positions are few
        return eng.encode(text)[-room:]

    prompt = eng.decode(fit(CODE_PROMPTS[0]))
    sys.stdout.write(prompt)
    stream = eng.generate(prompt, max_new_tokens=args.max_new_tokens, temperature=0.7, top_p=0.9, gamma=gammas[0],
                          seed=args.seed, stream=True)
    for chunk in stream:
        sys.stdout.write(str(chunk))
        sys.stdout.flush()
    res = stream.result
    print(f"\n--- {len(res.ids)} tokens, {res.stats.target_calls} target calls "
          f"({res.stats.tokens_per_target_call:.2f} tokens per target call), finish: {res.finish_reason}\n")

    log(f"step 4/4: plain vs speculative, interleaved, {args.repeats} repeat{'s' if args.repeats != 1 else ''} after a warm-up")
    ob = open_bundle(bundle, engine=eng)  # the same sessions, wrapped in read counters
    prompts = [fit(p) for p in CODE_PROMPTS[:4]]
    eos = tuple(ob.manifest.target.eos_token_ids)
    rows, others_cpu = [], OtherLoad()
    for temperature in (0.0, 1.0):  # the gammas side by side, sharing each prompt's plain run
        settings = [Setting(g, SamplingConfig(temperature)) for g in gammas]
        rows += [r.summary() for r in run_settings(ob.target, ob.draft, prompts, settings, args.max_new_tokens,
                                                   args.repeats, eos_token_ids=eos, seed=args.seed, progress=log,
                                                   vocab_size=ob.manifest.sample_vocab_size)]
    others = others_cpu.cores()
    m = ob.manifest
    mach = machine_description()
    print(f"edgespec demo: {args.preset} pair in {pair_dir}")
    print(f"machine: {mach.get('cpu_model', mach['processor'])}, {mach['cpu_count']} cores, "
          f"onnxruntime {mach.get('onnxruntime', '?')}, target on "
          + (f"{args.threads} thread{'s' * (args.threads != 1)}" if args.threads else "ONNX Runtime's default threads")
          + ", draft on 1")
    def layers(n: int) -> str:
        return f"{n} layer" + ("s" if n != 1 else "")

    print(f"target: {m.target.architecture}, {layers(m.target.num_layers)}, "
          f"{m.target.parameter_bytes.get('per_forward', 0) / 1e6:.1f} MB weights read per forward; "
          f"draft: {layers(m.draft.num_layers)}, {m.draft.parameter_bytes.get('per_forward', 0) / 1e6:.1f} MB")
    for row in rows:
        _print_row(row, auto_shown=None in gammas)
    print(f"\n{hardware_counters_note()}")
    warn_if_busy(others)
    longest = max(len(eng.encode(p)) for p in CODE_PROMPTS)
    fits = longest + DEFAULT_MAX_NEW_TOKENS <= eng.manifest.target.max_positions  # bench's prompts, untrimmed
    print(f"total demo time {time.perf_counter() - t_all:.0f} s. Next: `edgespec bench {shlex.quote(str(bundle))}"
          + ("` for the full grid." if fits else " --prompts FILE --max-new-tokens N` for the full grid (the built-in "
             f"prompts, up to {longest} tokens, and {DEFAULT_MAX_NEW_TOKENS} new tokens do not fit this model's "
             f"{eng.manifest.target.max_positions} positions)."))
    return 0
