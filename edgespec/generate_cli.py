"""``edgespec generate BUNDLE --prompt ... | --prompt-file PATH``: stream text from a bundle (torch is never imported)."""
from __future__ import annotations

import argparse
import json
import math
import os
import sys
import unicodedata

from .config import DRAFTERS
from .cli import parse_list
from .errors import EdgeSpecError, InvalidArgumentError

# --show-drafts marks: ANSI colors on a terminal, brackets otherwise.
_ANSI = {"accepted": "\x1b[32m", "recovered": "\x1b[33m", "bonus": "\x1b[36m"}
_BRACKETS = {"accepted": ("[", "]"), "recovered": ("{", "}"), "bonus": ("<", ">")}
_ESCAPED = frozenset("\\[]{}<>")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("bundle", help="bundle folder written by `edgespec export`")
    source = parser.add_mutually_exclusive_group(required=True)
    source.add_argument("--prompt", help="prompt text")
    source.add_argument("--prompt-file", metavar="PATH",
                        help="read the prompt from a UTF-8 text file ('-': standard input), as written (a final "
                             "newline is part of it), e.g. code that the output will repeat, for --draft ngram")
    parser.add_argument("--max-new-tokens", type=int, default=64,
                        help="tokens to generate at most (default 64); generation also ends at the bundle's EOS token")
    parser.add_argument("--stop-token-ids", default=None, metavar="ID[,ID...]",
                        help="comma-separated token ids that also end generation (kept as the last token), "
                             "as the API's stop_token_ids")
    parser.add_argument("--temperature", type=float, default=1.0, help="0 = greedy (default 1.0)")
    parser.add_argument("--top-k", type=int, default=0, help="0 = off")
    parser.add_argument("--top-p", type=float, default=1.0, help="1.0 = off")
    parser.add_argument("--gamma", default="auto",
                        help="draft tokens per round, or 'auto': chosen every round (default auto)")
    parser.add_argument("--lenience", type=float, default=1.0, help="1.0 = exact (Appendix A.5 of the paper)")
    parser.add_argument("--seed", type=int, default=None,
                        help="seed for sampling: the same seed gives the same text (default: a fresh one)")
    parser.add_argument("--no-draft", action="store_true", help="plain decoding with the target only")
    parser.add_argument("--draft", choices=DRAFTERS, default=None,
                        help="model: the bundle's draft model (the default when the bundle has one; without one "
                             "the default is plain decoding); lookahead: the draft model, drafting "
                             "on a second thread while the target verifies (for a target on fewer threads than "
                             "cores); ngram: prompt lookup, no second model; hybrid: the draft model, with a "
                             "prompt-lookup token wherever the run so far says it is kept more often")
    parser.add_argument("--provider", default=None, help="comma-separated execution providers for the target, in order (default cpu)")
    parser.add_argument("--draft-provider", default=None, help="providers for the draft (default: --provider)")
    parser.add_argument("--threads", type=int, default=None,
                        help="intra-op threads for the target (0 = ORT default: one per physical core; default 0, or "
                             "with --draft lookahead all cores but one, which the drafting thread needs)")
    parser.add_argument("--draft-threads", type=int, default=None, help="intra-op threads for the draft (default 1; 0: ONNX Runtime's default, one per physical core)")
    parser.add_argument("--no-spin", action="store_true", help="disable ONNX Runtime thread spin-waiting")
    parser.add_argument("--no-huge-pages", action="store_true",
                        help="leave ONNX Runtime's weights on the pages it allocated (default: moved onto transparent "
                             "huge pages where Linux allows it)")
    parser.add_argument("--runtime", choices=("onnx", "xla"), default="onnx",
                        help="onnx (default) or xla (jax.export artifacts: export with --format onnx+xla)")
    parser.add_argument("--platform", default=None, help="XLA platform: cpu, cuda, rocm, tpu (default: JAX's default)")
    parser.add_argument("--json", action="store_true", help="print one JSON object: text, ids, sources, statistics")
    parser.add_argument("--show-drafts", action="store_true",
                        help="print the text when generation ends with each token marked by where it came from: "
                             "accepted draft token [x], recovered after a rejection {x}, bonus <x>, with the text's own "
                             "brackets and backslashes escaped as \\[ (on a terminal: green, yellow, cyan instead, "
                             "unless NO_COLOR is set); unmarked tokens are the target's "
                             "alone (the first token, plain steps: where adaptive gamma found them faster than "
                             "drafting, or there was nothing to draft)")


def parse_gamma(value: str, flag: str = "--gamma") -> int | None:
    """A command line's gamma: an integer >= 1, or 'auto' (adaptive: None)."""
    if value.strip() in ("auto", "adaptive"):
        return None
    try:
        g = int(value)
    except ValueError:
        g = 0
    if g < 1:
        raise InvalidArgumentError(f"{flag}: gamma must be an integer >= 1 or 'auto' (chosen every round); got {value!r}")
    return g


def parse_token_ids(value: str | None, flag: str) -> tuple[int, ...]:
    """A comma-separated list of token ids (None: none)."""
    def token_id(text: str) -> int:
        text = text.strip()
        if not (text.isascii() and text.isdigit()):  # ('²'.isdigit() is True, int('²') fails)
            raise InvalidArgumentError(f"{flag} takes comma-separated non-negative integer token ids (e.g. {flag} "
                                       f"13,198); got {value!r}")
        return int(text)

    return () if value is None else tuple(parse_list(value, token_id, flag.lstrip("-")))


def render_marked(engine, ids: list[int], sources: list[str], color: bool) -> str:
    """Text with every token marked by its source (target/plain tokens unmarked)."""
    parts, prev = [], ""
    for i, src in enumerate(sources):
        # the token's text is what it adds to the decoded prefix
        text = engine.decode(ids[: i + 1])
        if i + 1 < len(sources):  # a character whose bytes go on in the next token: shown (and marked) with that one
            text = text.rstrip("\ufffd")
        piece, prev = text[len(prev):], text
        if not color:  # the text's own brackets (and backslashes) escaped: a mark is then never text
            piece = "".join("\\" + ch if ch in _ESCAPED else ch for ch in piece)
        # control characters (other than line breaks and tabs) shown escaped, not sent to the terminal
        piece = "".join(ch.encode("unicode_escape").decode("ascii") if unicodedata.category(ch) == "Cc" and
                        ch not in "\n\t" else ch for ch in piece)
        if src in _ANSI and piece:
            lead = piece[: len(piece) - len(piece.lstrip())]
            body = piece[len(lead):]
            piece_end = ""
            if not body:  # a whitespace-only token (a newline, an indent): mark it visibly, keep the layout
                lead, body = "", piece.encode("unicode_escape").decode("ascii")
                if "\n" in piece:   # the line breaks, then the indent after the last one
                    piece_end = "\n" * piece.count("\n") + piece[piece.rfind("\n") + 1:]
            piece = lead + (f"{_ANSI[src]}{body}\x1b[0m" if color else f"{_BRACKETS[src][0]}{body}{_BRACKETS[src][1]}")
            piece += piece_end
        parts.append(piece)
    return "".join(parts)


def _check_flags(args: argparse.Namespace, gamma: int | None) -> None:
    """Flags that contradict each other or do nothing in this combination are errors, not ignored."""
    if args.no_draft and args.draft is not None:
        raise InvalidArgumentError(f"--no-draft decodes with the target alone; drop --draft {args.draft} "
                                   "(or drop --no-draft to draft with it)")
    if args.no_draft and gamma is not None:
        raise InvalidArgumentError("--no-draft decodes with the target alone: --gamma has no effect; drop one of them")
    if args.json and args.show_drafts:
        raise InvalidArgumentError("--json already gives each token's source ('sources'); drop --show-drafts or --json")
    if args.no_draft and args.show_drafts:
        raise InvalidArgumentError("--no-draft decodes with the target alone: every token is the target's, so "
                                   "--show-drafts has nothing to mark; drop one of them")
    if args.no_draft and args.lenience != 1.0:
        raise InvalidArgumentError("--no-draft decodes with the target alone: --lenience has no effect; drop one of them")
    draft_flags = [f for f, on in (("--draft-threads", args.draft_threads is not None),
                                   ("--draft-provider", args.draft_provider is not None)) if on]
    if draft_flags and (args.no_draft or args.draft == "ngram"):
        why = "--no-draft decodes with the target alone" if args.no_draft else "--draft ngram uses no draft model"
        raise InvalidArgumentError(f"{why}: {', '.join(draft_flags)} {'has' if len(draft_flags) == 1 else 'have'} no "
                                   f"effect; drop {'it' if len(draft_flags) == 1 else 'them'}")
    if args.platform is not None and args.runtime != "xla":
        raise InvalidArgumentError("--platform picks the XLA device; add --runtime xla or drop --platform")
    refuse_ort_flags(args.runtime, {"--provider": args.provider is not None, "--draft-provider": args.draft_provider,
                                    "--threads": args.threads is not None,
                                    "--draft-threads": args.draft_threads is not None, "--no-spin": args.no_spin,
                                    "--no-huge-pages": args.no_huge_pages})


def refuse_ort_flags(runtime: str, given: dict) -> None:
    """ONNX Runtime's session flags do nothing with the XLA runtime: an error, not ignored."""
    ort_only = [flag for flag, on in given.items() if on]
    if runtime == "xla" and ort_only:
        verb = ("configures", "does", "it") if len(ort_only) == 1 else ("configure", "do", "them")
        raise InvalidArgumentError(f"{', '.join(ort_only)} {verb[0]} ONNX Runtime and {verb[1]} nothing with --runtime xla; "
                                   f"drop {verb[2]} (--platform picks the XLA device)")


def read_prompt(args: argparse.Namespace) -> str:
    """--prompt's text, or --prompt-file's (a path, or '-' for standard input)."""
    if args.prompt is not None:
        return args.prompt
    path = args.prompt_file
    try:
        if path == "-":
            if sys.stdin is None:  # (fd 0 closed at start, `<&-`: Python leaves sys.stdin None)
                raise InvalidArgumentError("--prompt-file -: standard input is closed; pipe the prompt in, or use "
                                           "--prompt TEXT or --prompt-file PATH")
            if sys.stdin.isatty():
                print("[reading the prompt from standard input; end it with Ctrl-D]", file=sys.stderr)
            stdin = getattr(sys.stdin, "buffer", None)
            data = stdin.read() if stdin is not None else sys.stdin.read().encode("utf-8")
        else:
            with open(path, "rb") as f:
                data = f.read()
        if data.startswith((b"\xff\xfe", b"\xfe\xff")):
            raise InvalidArgumentError(f"--prompt-file {path!r} is UTF-16 text; convert it to UTF-8 (e.g. iconv -f "
                                       "UTF-16 -t UTF-8)")
        text = data.decode("utf-8-sig")  # as written, a final newline included; a UTF-8 byte-order mark is dropped
    except UnicodeDecodeError as exc:
        raise InvalidArgumentError(f"--prompt-file {path!r} is not UTF-8 text (byte {exc.start}); convert it to "
                                   "UTF-8") from None
    except OSError as exc:
        raise InvalidArgumentError(f"cannot read --prompt-file {path!r}: {exc.strerror or exc}; pass a readable text "
                                   "file, or '-' for standard input") from None
    if not text:
        raise InvalidArgumentError(f"--prompt-file {path!r} is empty; the prompt needs at least one character")
    return text


def run(args: argparse.Namespace) -> int:
    from .api import default_target_threads, load
    from .cli import _Terminated
    from .report import json_safe

    gamma = parse_gamma(args.gamma)
    stop_ids = parse_token_ids(args.stop_token_ids, "--stop-token-ids")
    _check_flags(args, gamma)
    if args.seed is not None and args.seed < 0:
        raise InvalidArgumentError(f"--seed must be a non-negative integer (or left out for a fresh seed); got {args.seed}")
    prompt = read_prompt(args)  # before the bundle's seconds of loading
    spin = False if args.no_spin else None
    threads = default_target_threads(args.draft == "lookahead") if args.threads is None else args.threads
    threads = 0 if args.runtime == "xla" else threads  # ONNX Runtime's setting (--threads is refused with xla)
    providers = "cpu" if args.provider is None else args.provider   # (--provider "" is refused by load, not cpu)
    engine = load(args.bundle, providers=providers, draft_providers=args.draft_provider, threads=threads,
                  draft_threads=1 if args.draft_threads is None else args.draft_threads, spinning=spin,
                  load_draft=not args.no_draft and args.draft != "ngram",
                  runtime=args.runtime, platform=args.platform, huge_pages=not args.no_huge_pages)
    if not engine.has_draft and args.draft in ("model", "lookahead", "hybrid") and not args.no_draft:
        raise InvalidArgumentError(f"--draft {args.draft} drafts with the bundle's draft model, and {args.bundle} has "
                                   "none; use --draft ngram (prompt lookup, no model) or --no-draft, or export the "
                                   "bundle with --draft")
    if not engine.has_draft and args.draft != "ngram" and not args.no_draft:
        idle = [f for f, on in (("--gamma", gamma is not None), ("--show-drafts", args.show_drafts),
                                ("--lenience", args.lenience != 1.0), ("--draft-threads", args.draft_threads is not None),
                                ("--draft-provider", args.draft_provider is not None)) if on]
        if idle:
            # prompt lookup takes --gamma, --show-drafts and --lenience, not the draft model's flags
            ngram = "" if {"--draft-threads", "--draft-provider"} & set(idle) else ", draft by prompt lookup with --draft ngram"
            raise InvalidArgumentError(f"{args.bundle} has no draft model, so {' and '.join(idle)} "
                                       f"{'has' if len(idle) == 1 else 'have'} no effect (plain decoding); export it "
                                       f"with --draft{ngram}, or drop {' and '.join(idle)}")
    kwargs = dict(max_new_tokens=args.max_new_tokens, temperature=args.temperature, top_k=args.top_k, top_p=args.top_p,
                  gamma=gamma, lenience=args.lenience, seed=args.seed, use_draft=not args.no_draft,
                  drafter=args.draft, stop_token_ids=stop_ids)
    # Appendix A.5: l < 1 keeps more drafts, so the output is no longer the target's distribution
    # (greedy is unaffected: a draft is kept only if it is the target's argmax).
    exact = args.no_draft or args.lenience == 1.0 or args.temperature == 0
    if 0 < args.lenience < 1 and args.temperature != 0:
        print(f"[note: --lenience {args.lenience:g} < 1 is not exact: the output is not distributed as the target's "
              "(Appendix A.5); 1 is exact]", file=sys.stderr)
    if args.json or args.show_drafts:
        out = engine.generate(prompt, **kwargs)
        if args.json:
            print(json.dumps(json_safe({
                "text": out.text, "prompt_ids": out.prompt_ids, "ids": out.ids, "sources": out.sources,
                # (what ran: a prompt past the draft's positions decodes plainly, which "speculative" said it did not)
                "finish_reason": out.finish_reason, "speculative": out.drafter is not None, "drafter": out.drafter,
                "exact": exact,
                "stats": out.stats.to_dict()}), allow_nan=False))  # strict JSON: a statistic without data is null
        else:
            color = sys.stdout.isatty() and not os.environ.get("NO_COLOR")  # https://no-color.org
            print(render_marked(engine, out.ids, out.sources, color))
            _summary(out)
        return 0
    stream = engine.generate(prompt, stream=True, **kwargs)
    shown = 0
    try:
        for chunk in stream:
            sys.stdout.write(chunk.text)
            sys.stdout.flush()
            shown += len(chunk.ids)
    except (EdgeSpecError, KeyboardInterrupt, _Terminated):  # (SIGTERM too: its text was left without the note)
        if shown:  # text already streamed: end its line, and say it is cut short (then the error)
            sys.stdout.write("\n")
            sys.stdout.flush()
            print(f"[stopped after {shown} token{'s' * (shown != 1)}: the text above is incomplete]", file=sys.stderr)
        raise
    sys.stdout.write("\n")
    _summary(stream.result)
    return 0


def _summary(out) -> None:
    s = out.stats.to_dict()
    keys = ("alpha", "acceptance_rate", "tokens_per_target_call", "target_calls", "draft_calls")
    info = ", ".join(f"{k}={_fmt(s[k])}" for k in keys if k in s)
    print(f"[{len(out.ids)} tokens, finish={out.finish_reason}; {info}]", file=sys.stderr)


def _fmt(v) -> str:
    if isinstance(v, float):
        return f"{v:.3g}" if math.isfinite(v) else "n/a"  # e.g. no draft: no acceptance rate
    return str(v)
