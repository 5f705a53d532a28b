"""onnxruntime-genai as a peer, run on edgespec's own exported bundle.

Runs with the python of the environment that has ``onnxruntime-genai`` (kept apart from edgespec's,
because genai's model builder needs transformers 5), e.g.::

    .venv-genai/bin/python benchmarks/genai_peer.py --bundle B --prompt-ids-file F \
        --max-new-tokens 64 --temperature 0 --repeats 3 [--speculative --gamma 4]

It needs nothing from edgespec (where edgespec is importable it only borrows its error printing): it reads ``edgespec.json`` and the models' ``config.json`` and
writes a hand-made ``genai_config.json`` into a temporary folder that links (never writes) the
bundle's ONNX and tokenizer files, so genai runs exactly the graphs edgespec runs. Prompts are
token ids (a JSON list of lists in F), so tokenization is identical to edgespec's.

Output: one JSON line on stdout with the generated token count and the seconds of generation
(generator creation, prefill and decode; not model loading) per repeat after one warm-up pass
over all prompts, and the generated ids of the first measured repeat.

``--serve`` instead keeps the model loaded and answers one request per line on stdin
(``{"ids": [...], "max_new_tokens": N, "temperature": T, "seed": S}``) with one JSON line
(``{"ids": [...], "seconds": s}``); ``benchmarks/peers.py`` drives it that way so that process
start-up and model loading are paid once, outside the timed calls.
"""
from __future__ import annotations

import argparse
import atexit
import json
import os
import shutil
import sys
import tempfile
import time
from pathlib import Path

DECODER_FILE = "model.onnx"  # edgespec.contract.DECODER_FILE (not imported: no edgespec here)
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json")


def _decoder_block(bundle: Path, role: str, m: dict, threads: int) -> dict:
    """genai ``model.decoder`` block for one model of the bundle (optimum's decoder-only names)."""
    cfg = json.loads((bundle / m["path"] / "config.json").read_text())
    if m.get("kind", "decoder") != "decoder":
        raise SystemExit(f"genai peer: {role} is a {m.get('kind')} model; only decoder-only bundles are supported")
    if m.get("dtype", "fp32") != "fp32":
        raise SystemExit(f"genai peer: {role} has dtype {m.get('dtype')}; only fp32 bundles are wired here")
    return {
        "session_options": {"intra_op_num_threads": threads, "inter_op_num_threads": 1,
                            "log_severity_level": 3, "provider_options": []},
        "filename": f"{role}/{m['files']['decoder']}",
        "head_size": m["head_size"],
        "hidden_size": cfg["hidden_size"],
        "num_attention_heads": cfg["num_attention_heads"],
        "num_hidden_layers": m["num_layers"],
        "num_key_value_heads": m["num_kv_heads"],
        "inputs": {"input_ids": "input_ids", "attention_mask": "attention_mask", "position_ids": "position_ids",
                   "past_key_names": "past_key_values.%d.key", "past_value_names": "past_key_values.%d.value"},
        "outputs": {"logits": "logits", "present_key_names": "present.%d.key",
                    "present_value_names": "present.%d.value"},
    }


def build_genai_folder(bundle: Path, speculative: bool, gamma: int, threads: int, draft_threads: int | None = None) -> Path:
    """A temporary genai model folder for the bundle: links to its files plus genai_config.json."""
    manifest = json.loads((bundle / "edgespec.json").read_text())
    models = manifest["models"]
    roles = ["target", "draft"] if speculative else ["target"]
    if speculative and "draft" not in models:
        raise SystemExit("genai peer: --speculative needs a bundle with a draft model")
    t = models["target"]
    if t.get("model_type") != "llama":
        print(f"[genai] warning: model_type {t.get('model_type')!r} is not llama; trying the llama config anyway",
              file=sys.stderr)
    folder = Path(tempfile.mkdtemp(prefix="edgespec-genai-"))
    atexit.register(shutil.rmtree, folder, True)
    for role in roles:
        src = (bundle / models[role]["path"]).resolve()
        (folder / role).mkdir()
        for f in src.iterdir():  # the graph, its external data if any, configs: links, one by one
            if f.is_file():
                os.symlink(f, folder / role / f.name)
    tok_src = (bundle / t["path"]).resolve()
    for name in TOKENIZER_FILES:  # genai looks for the tokenizer beside genai_config.json
        if (tok_src / name).is_file():
            os.symlink(tok_src / name, folder / name)
    eos = t["eos_token_ids"] or [0]
    model = {
        "type": "llama",
        "vocab_size": t["vocab_size"],
        "context_length": t["max_positions"],
        "bos_token_id": t["bos_token_id"] if t["bos_token_id"] is not None else 0,
        "eos_token_id": eos if len(eos) > 1 else eos[0],
        # genai derives attention_mask / position_ids from ``id != pad_token_id``; edgespec feeds one
        # unpadded sequence with an all-ones mask, so a prompt token equal to the bundle's pad (or eos)
        # id must still be attended to. -1 is no token id: genai then masks nothing, as edgespec.
        "pad_token_id": -1,
        "decoder": _decoder_block(bundle, "target", t, threads),
    }
    config = {"model": model,
              "search": {"do_sample": False, "temperature": 1.0, "top_k": 0, "top_p": 1.0, "num_beams": 1,
                         "num_return_sequences": 1, "max_length": t["max_positions"], "min_length": 0,
                         "repetition_penalty": 1.0, "past_present_share_buffer": False}}
    if speculative:
        model["draft"] = _decoder_block(bundle, "draft", models["draft"], threads if draft_threads is None else draft_threads)
        config["speculative"] = {"max_draft_tokens": gamma}
    (folder / "genai_config.json").write_text(json.dumps(config, indent=2))
    return folder


class GenaiPeer:
    def __init__(self, bundle: Path, speculative: bool, gamma: int, threads: int, draft_threads: int | None = None):
        import onnxruntime_genai as og

        self.og = og
        self.speculative = speculative
        self.gamma = gamma
        self.folder = build_genai_folder(bundle, speculative, gamma, threads, draft_threads)
        target = json.loads((bundle / "edgespec.json").read_text())["models"]["target"]
        self.max_positions = target["max_positions"]
        self.eos_ids = set(target["eos_token_ids"])
        self.model = og.Model(str(self.folder))

    def generate(self, ids: list[int], max_new: int, temperature: float, seed: int) -> tuple[list[int], float]:
        """Generated ids (EOS included if reached, as edgespec counts it) and seconds spent generating."""
        og = self.og
        max_length = len(ids) + max_new
        if max_length > self.max_positions:
            raise ValueError(f"prompt ({len(ids)}) + max_new_tokens ({max_new}) exceeds the model's "
                             f"{self.max_positions} positions")
        t0 = time.perf_counter()
        params = og.GeneratorParams(self.model)
        opts = dict(max_length=max_length, past_present_share_buffer=False, random_seed=int(seed) % (2**31))
        if temperature == 0:
            opts.update(do_sample=False)
        else:
            opts.update(do_sample=True, temperature=float(temperature), top_k=0, top_p=1.0)
        params.set_search_options(**opts)
        if self.speculative:
            params.set_speculative_options(max_draft_tokens=self.gamma)
        gen = og.Generator(self.model, params)
        gen.append_tokens([ids])
        while not gen.is_done():
            gen.generate_next_token()
        seq = gen.get_sequence(0)
        out = [int(i) for i in seq[len(ids):]]
        if len(out) < max_new:  # stopped on EOS: genai leaves it out of the sequence, edgespec keeps it
            last = int(gen.get_next_tokens()[0])
            if last in self.eos_ids:
                out.append(last)
        secs = time.perf_counter() - t0
        self.last_stats = gen.get_speculative_stats() if self.speculative else None
        del gen, params
        return out, secs


def _args(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--bundle", type=Path, required=True)
    ap.add_argument("--prompt-ids-file", type=Path, help="JSON list of prompts, each a list of token ids")
    ap.add_argument("--max-new-tokens", type=int, default=64)
    ap.add_argument("--temperature", type=float, default=0.0)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--seed", type=int, default=0, help="seed of prompt i in repeat r: seed + 1000 * r + i")
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--draft-threads", type=int, default=None, help="intra-op threads of genai's draft session (default --threads)")
    ap.add_argument("--speculative", action="store_true", help="genai's draft-model speculative decoding")
    ap.add_argument("--gamma", type=int, default=4, help="draft tokens per round (speculative.max_draft_tokens)")
    ap.add_argument("--serve", action="store_true", help="answer JSON requests on stdin (used by peers.py)")
    args = ap.parse_args(argv)
    if not args.serve and args.prompt_ids_file is None:
        ap.error("--prompt-ids-file is required unless --serve")
    return args


def serve(peer: GenaiPeer) -> int:
    # Native code may print to fd 1; keep the protocol on a private copy of it and send fd 1 to stderr.
    out = os.fdopen(os.dup(1), "w", buffering=1)
    os.dup2(2, 1)
    out.write(json.dumps({"ready": True, "version": peer.og.__version__}) + "\n")
    for line in sys.stdin:
        if not line.strip():
            continue
        req = json.loads(line)
        try:
            ids, secs = peer.generate(req["ids"], req["max_new_tokens"], req["temperature"], req.get("seed", 0))
            out.write(json.dumps({"ids": ids, "seconds": secs}) + "\n")
        except Exception as exc:  # report, keep serving
            out.write(json.dumps({"error": f"{type(exc).__name__}: {exc}"}) + "\n")
    return 0


def main(argv=None) -> int:
    args = _args(argv)
    if not (args.bundle / "edgespec.json").is_file():
        print(f"genai_peer.py: error: {args.bundle} is not an edgespec bundle (no edgespec.json); pass the folder "
              "written by `edgespec export --out`", file=sys.stderr)
        return 2
    try:
        import onnxruntime_genai  # noqa: F401
    except ImportError:
        print("genai_peer.py: error: onnxruntime-genai is not installed in this Python; run the script with the "
              "environment that has it (see benchmarks/README.md, 'onnxruntime-genai peer'), e.g. "
              ".venv-genai/bin/python benchmarks/genai_peer.py ...", file=sys.stderr)
        return 2
    peer = GenaiPeer(args.bundle, args.speculative, args.gamma, args.threads, args.draft_threads)
    if args.serve:
        return serve(peer)
    prompts = json.loads(args.prompt_ids_file.read_text())
    if not prompts or not all(isinstance(p, list) and p for p in prompts):
        raise SystemExit("--prompt-ids-file must hold a JSON list of non-empty lists of token ids")
    tokens, seconds, first_ids, stats = [], [], None, []
    for rep in range(args.repeats + 1):  # repeat 0 is the warm-up
        n, secs, ids_rep = 0, 0.0, []
        for i, ids in enumerate(prompts):
            out, s = peer.generate(ids, args.max_new_tokens, args.temperature, args.seed + 1000 * rep + i)
            n, secs = n + len(out), secs + s
            ids_rep.append(out)
            if rep == 1 and peer.last_stats is not None:
                stats.append({k: peer.last_stats.get(k) for k in ("acceptance_rate", "rounds", "draft_tokens_accepted",
                                                                   "draft_tokens_proposed", "target_forward_passes")})
        if rep:
            tokens.append(n)
            seconds.append(secs)
            if first_ids is None:
                first_ids = ids_rep
    payload = {"system": "onnxruntime-genai " + ("speculative" if args.speculative else "plain"),
               "genai_version": peer.og.__version__, "bundle": str(args.bundle), "gamma": args.gamma if args.speculative else None,
               "temperature": args.temperature, "max_new_tokens": args.max_new_tokens, "threads": args.threads,
               "repeats": args.repeats, "tokens": tokens, "seconds": seconds, "ids": first_ids}
    if stats:
        payload["speculative_stats_first_repeat"] = stats
    print(json.dumps(payload), flush=True)
    return 0


if __name__ == "__main__":
    # It runs in genai's environment, without edgespec (see the docstring); there, errors are printed
    # as they come (peers.py reports the worker's stderr).
    try:
        from edgespec.cli import run_script
    except ImportError:
        sys.exit(main())
    sys.exit(run_script(main, "genai_peer.py"))
