"""Peers side by side on the same pair, prompts and machine: Hugging Face transformers plain
generate vs assisted generation (PyTorch, CPU), and onnxruntime-genai if it is installed.

    python benchmarks/peers.py --pair ~/.cache/edgespec/pairs/<pair> --out benchmarks/results/<tag>

edgespec's own plain and speculative tokens/s are measured in the same run, interleaved with the
peers prompt by prompt (the systems' order rotating per repeat), so every ratio compares numbers
taken seconds apart on one machine.
A peer that is not installed is skipped and the output says so.
"""
from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

from edgespec.cli import at_least
from edgespec.outputs import check_report_folder
from edgespec.pair import refuse_bundle_as_pair
from edgespec.errors import InvalidArgumentError
from edgespec.prompts import CODE_PROMPTS
from edgespec.report import machine_description, write_json


def log(msg: str) -> None:
    print(f"[peers] {msg}", file=sys.stderr, flush=True)


def _stop_child(proc) -> None:
    """EOF on stdin ends a child's request loop (genai's then removes its temporary folder)."""
    try:
        proc.stdin.close()
        proc.wait(timeout=10)
    except Exception:
        proc.kill()


def _hf_models(pair: Path, threads: int, draft_dir: Path | None):
    import torch
    from transformers import AutoModelForCausalLM

    torch.set_num_threads(threads)
    target = AutoModelForCausalLM.from_pretrained(pair / "target", use_safetensors=True).eval()
    draft = AutoModelForCausalLM.from_pretrained(draft_dir or pair / "draft", use_safetensors=True).eval()

    def run(ids, max_new, temperature, assisted, seed, gamma):
        torch.manual_seed(seed)
        kw = dict(max_new_tokens=max_new, pad_token_id=0)  # stops at EOS like edgespec (assisted mode refuses min_new_tokens)
        kw.update(do_sample=False) if temperature == 0 else kw.update(do_sample=True, temperature=temperature, top_k=0)
        if assisted:
            draft.generation_config.num_assistant_tokens = gamma
            draft.generation_config.num_assistant_tokens_schedule = "constant"
            kw["assistant_model"] = draft
        with torch.no_grad():
            out = target.generate(torch.tensor([ids]), **kw)
        return out.shape[1] - len(ids)

    return run


def _hf_serve(args) -> int:
    """The transformers peer's child: one JSON request per stdin line, (tokens, seconds) back."""
    import json

    run = _hf_models(args.pair, args.threads, args.draft_dir)
    print('{"ready": true}', flush=True)
    for line in sys.stdin:
        q = json.loads(line)
        t0 = time.perf_counter()
        n = run(q["ids"], q["max_new_tokens"], q["temperature"], q["assisted"], q["seed"], q["gamma"])
        print(json.dumps({"n": n, "seconds": time.perf_counter() - t0}), flush=True)
    return 0


def hf_runner(pair: Path, threads: int, draft_dir: Path | None = None):
    """transformers (PyTorch) in a child process, like genai: with torch merely imported and the
    models loaded in edgespec's own process, edgespec's ONNX Runtime calls measured about 8% slower
    (an interleaved A/B on this machine: 0.89x of genai's plain speed against 0.98x without torch),
    which would charge a peer's footprint to edgespec."""
    import atexit
    import importlib.util
    import json
    import subprocess

    if importlib.util.find_spec("torch") is None or importlib.util.find_spec("transformers") is None:
        return None, "transformers/torch not installed (pip install 'edgespec[export]')"
    cmd = [sys.executable, str(Path(__file__).resolve()), "--hf-serve", "--pair", str(pair), "--threads", str(threads),
           "--out", "-"]
    if draft_dir is not None:
        cmd += ["--draft-dir", str(draft_dir)]
    proc = subprocess.Popen(cmd, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, bufsize=1)
    atexit.register(_stop_child, proc)
    if not proc.stdout.readline().startswith('{"ready"'):
        return None, f"the transformers child ({' '.join(cmd)}) did not start (exit {proc.wait()})"

    def run(ids, max_new, temperature, assisted, seed, gamma):
        proc.stdin.write(json.dumps({"ids": [int(i) for i in ids], "max_new_tokens": max_new, "temperature": temperature,
                                     "assisted": assisted, "seed": seed, "gamma": gamma}) + "\n")
        reply = proc.stdout.readline()
        if not reply:
            raise RuntimeError(f"the transformers child exited (code {proc.wait()})")
        r = json.loads(reply)
        return r["n"], r["seconds"]

    return run, "measured (in a child process)"


def genai_runner(bundle: Path, threads: int = 1, draft_threads: int = 1):
    """onnxruntime-genai on the bundle's own ONNX graphs, run by benchmarks/genai_peer.py in genai's own
    environment (EDGESPEC_GENAI_PYTHON, else <repo>/.venv-genai/bin/python, else this python if it has
    onnxruntime_genai). One long-lived child per mode keeps the model loaded; each call sends one prompt
    and waits for its ids. The child times generation itself (``run.child_seconds``); what the caller
    times on top is one pipe round trip per prompt, not process start-up or model loading."""
    import atexit
    import importlib.util
    import json
    import os
    import subprocess

    script = Path(__file__).resolve().with_name("genai_peer.py")
    chosen = os.environ.get("EDGESPEC_GENAI_PYTHON")
    if chosen and not Path(chosen).is_file():
        return None, (f"EDGESPEC_GENAI_PYTHON={chosen} is not a file; point it at the python of the environment "
                      "that has onnxruntime-genai")
    python = chosen or str(script.parents[1] / ".venv-genai" / "bin" / "python")
    if not Path(python).is_file():
        if importlib.util.find_spec("onnxruntime_genai") is None:
            return None, ("onnxruntime-genai not installed (its builder needs transformers 5: install it in its own "
                          "environment, .venv-genai, or point EDGESPEC_GENAI_PYTHON at its python)")
        python = sys.executable
    probe = subprocess.run([python, "-c", "import onnxruntime_genai as og; "
                            "print(og.__version__, hasattr(og.GeneratorParams, 'set_speculative_options'))"],
                           capture_output=True, text=True)
    if probe.returncode != 0:
        last = (probe.stderr.strip().splitlines() or ["(no message)"])[-1]
        return None, f"onnxruntime-genai not importable by {python}: {last}"
    version, has_spec = probe.stdout.split()
    workers: dict = {}

    def worker(speculative: bool, gamma: int):
        key = (speculative, gamma if speculative else None)
        if key not in workers:
            cmd = [python, str(script), "--serve", "--bundle", str(bundle), "--threads", str(threads),
                   "--draft-threads", str(draft_threads)]
            if speculative:
                cmd += ["--speculative", "--gamma", str(gamma)]
            proc = subprocess.Popen(cmd, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, bufsize=1)
            atexit.register(_stop_child, proc)
            ready = proc.stdout.readline()
            if not ready.startswith('{"ready"'):
                raise RuntimeError(f"genai worker {' '.join(cmd)} did not start (exit {proc.wait()})")
            workers[key] = proc
        return workers[key]

    def run(ids, max_new, temperature, speculative, seed, gamma):
        proc = worker(speculative, gamma)
        proc.stdin.write(json.dumps({"ids": [int(i) for i in ids], "max_new_tokens": max_new,
                                     "temperature": temperature, "seed": seed}) + "\n")
        reply = json.loads(proc.stdout.readline() or '{"error": "genai worker exited"}')
        if "error" in reply:
            raise RuntimeError(f"onnxruntime-genai: {reply['error']}")
        run.child_seconds.append(reply["seconds"])
        run.last_ids = reply["ids"]
        return len(reply["ids"]), reply["seconds"]

    run.child_seconds, run.last_ids = [], None
    run.has_speculative = has_spec == "True"
    note = f"measured (onnxruntime-genai {version}, bundle's ONNX graphs)"
    if not run.has_speculative:
        note += "; this version has no speculative decoding API: plain only"
    return run, note


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--pair", type=Path, required=True)
    ap.add_argument("--bundle", type=Path, default=None, help="exported bundle of the pair (default <pair>/bundle)")
    ap.add_argument("--draft-dir", type=Path, default=None,
                    help="Hugging Face folder of the bundle's draft, for the PyTorch peers (default <pair>/draft)")
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--gamma", type=at_least(1), default=4)
    ap.add_argument("--repeats", type=at_least(1), default=3)
    ap.add_argument("--max-new-tokens", type=at_least(1), default=64)
    ap.add_argument("--threads", type=at_least(1), default=1, help="target intra-op threads, every system (default 1)")
    ap.add_argument("--draft-threads", type=at_least(0), default=1, help="draft intra-op threads, edgespec and genai (default 1)")
    ap.add_argument("--spin", choices=("on", "off"), default="on",
                    help="edgespec's ORT spin-waiting (default on, ORT's default, which genai keeps)")
    ap.add_argument("--hf-serve", action="store_true", help=argparse.SUPPRESS)  # the transformers child
    args = ap.parse_args()
    if args.out is not None:  # before the measurement, not after it
        check_report_folder(args.out)
    if args.hf_serve:
        return _hf_serve(args)
    import edgespec

    # the PyTorch peers load these (when transformers is installed; else they are skipped): checked
    # before any measurement (a missing one used to surface as a child process that "did not start",
    # after the other systems had run)
    import importlib.util

    refuse_bundle_as_pair(args.pair)
    checked = (("--pair's target", args.pair / "target"),
               ("--draft-dir" if args.draft_dir else "--pair's draft", args.draft_dir or args.pair / "draft"))
    for what, folder in checked if importlib.util.find_spec("transformers") else ():
        if not (folder / "config.json").is_file():
            raise InvalidArgumentError(f"{what} {str(folder)!r} is not a model folder (no config.json); --pair takes the "
                                       "folder `edgespec train-pair --print-path` prints, --draft-dir the Hugging Face "
                                       "folder of the bundle's draft")
    bundle = args.bundle or args.pair / "bundle"
    eng = edgespec.load(bundle, threads=args.threads, draft_threads=args.draft_threads, spinning=args.spin == "on")
    prompts = [eng.encode(p) for p in CODE_PROMPTS[:4]]
    hf, hf_note = hf_runner(args.pair, args.threads, args.draft_dir)
    genai, genai_note = genai_runner(bundle, args.threads, args.draft_threads)
    notes = {"transformers": hf_note, "onnxruntime-genai": genai_note}
    for k, v in notes.items():
        log(f"{k}: {v}")
    systems = {
        "edgespec plain": lambda ids, t, s: len(eng.generate(ids, max_new_tokens=args.max_new_tokens, temperature=t,
                                                             seed=s, use_draft=False).ids),
        "edgespec speculative": lambda ids, t, s: len(eng.generate(ids, max_new_tokens=args.max_new_tokens,
                                                                   temperature=t, seed=s, gamma=args.gamma).ids),
        # the draft keeps drafting on another thread while the target verifies
        "edgespec lookahead": lambda ids, t, s: len(eng.generate(ids, max_new_tokens=args.max_new_tokens, temperature=t,
                                                                 seed=s, gamma=args.gamma, drafter="lookahead").ids),
    }
    if hf is not None:
        systems["transformers plain"] = lambda ids, t, s: hf(ids, args.max_new_tokens, t, False, s, args.gamma)
        systems["transformers assisted"] = lambda ids, t, s: hf(ids, args.max_new_tokens, t, True, s, args.gamma)
    if genai is not None:
        systems["genai plain"] = lambda ids, t, s: genai(ids, args.max_new_tokens, t, False, s, args.gamma)
        if genai.has_speculative:
            systems["genai speculative"] = lambda ids, t, s: genai(ids, args.max_new_tokens, t, True, s, args.gamma)
    results = {}
    for t in (0.0, 1.0):
        tps = {name: [] for name in systems}
        for rep in range(args.repeats + 1):
            # Prompt by prompt, every system back to back (the order rotating per repeat), so that a
            # drift in the shared host's speed hits every system alike.
            totals = {name: [0, 0.0] for name in systems}
            names = list(systems)
            names = names[rep % len(names):] + names[:rep % len(names)]
            for i, ids in enumerate(prompts):
                for name in names:
                    # a pause between systems: another process's ONNX Runtime threads keep spin-waiting
                    # for a while after its call returns, and would be charged to whoever runs next
                    time.sleep(0.1)
                    t0 = time.perf_counter()
                    got = systems[name](ids, t, 1000 * rep + i)
                    # a runner in another process reports (tokens, its own generation seconds), so the
                    # pipe round trip is not charged to it; in-process runners are timed here
                    k, dt = got if isinstance(got, tuple) else (got, time.perf_counter() - t0)
                    totals[name][0] += k
                    totals[name][1] += dt
            if rep:  # repeat 0 is the warm-up
                for name, (n, secs) in totals.items():
                    tps[name].append(n / secs)
            log(f"T={t:g} repeat {rep}/{args.repeats}" + (" (warm-up)" if rep == 0 else ""))
        base = statistics.median(tps["edgespec speculative"])
        results[f"T={t:g}"] = {name: {"tokens_per_s": statistics.median(v), "all": v,
                                      "ratio_to_edgespec_speculative": statistics.median(v) / base}
                               for name, v in tps.items()}
    payload = {"pair": str(args.pair), "machine": machine_description(), "threads": args.threads,
               "draft_threads": args.draft_threads, "spin": args.spin, "gamma": args.gamma,
               "repeats": args.repeats, "max_new_tokens": args.max_new_tokens, "notes": notes, "results": results,
               "command": " ".join(sys.argv)}
    write_json(args.out / "peers.json", payload)
    for temp, res in results.items():
        print(f"{temp}:")
        for name, r in res.items():
            print(f"  {name:<24} {r['tokens_per_s']:8.1f} tok/s   {r['ratio_to_edgespec_speculative']:.2f}x of edgespec speculative")
    for k, v in notes.items():
        print(f"{k}: {v}")
    return 0


if __name__ == "__main__":
    from edgespec.cli import run_script

    sys.exit(run_script(main, "peers.py"))
