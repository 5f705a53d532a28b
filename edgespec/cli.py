"""The ``edgespec`` command line. Each subcommand lives in its own module, imported lazily so
that ``edgespec generate`` never imports torch. A module exposes ``add_arguments(parser)`` and
``run(args) -> int``."""
from __future__ import annotations

import argparse
import importlib
import os
import sys
import warnings

from .errors import EdgeSpecError

# name -> (module, one-line help)
COMMANDS: dict[str, tuple[str, str]] = {
    "plan": ("edgespec.theory", "expected tokens per round and Theorem 3.8 speedup for each gamma"),
    "toy": ("edgespec.toy", "run the speculative loop on a built-in toy model pair (no ONNX)"),
    "export": ("edgespec.export.cli", "convert Hugging Face target/draft checkpoints to a validated ONNX bundle"),
    "generate": ("edgespec.generate_cli", "generate text from a bundle, with or without speculation"),
    "demo": ("edgespec.demo", "train (or reuse) the default pair, export it, and compare plain vs speculative"),
    "train-pair": ("edgespec.pair", "train the default Llama target/draft pair on a local corpus"),
    "distill": ("edgespec.distill", "train a draft that matches a target's distributions"),
    "bench": ("edgespec.bench", "measure alpha, c, speedup and memory reads per token on a bundle"),
}


def build_parser(argv: list[str]) -> argparse.ArgumentParser:
    from . import __version__

    parser = argparse.ArgumentParser(prog="edgespec", description="Exact speculative decoding for edge and accelerator hardware.")
    parser.add_argument("--version", action="version", version=f"edgespec {__version__}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    wanted = next((a for a in argv if not a.startswith("-")), None)
    for name, (module, help_text) in COMMANDS.items():
        p = sub.add_parser(name, help=help_text, description=help_text)
        if name == wanted:  # import only the module of the command being run
            importlib.import_module(module).add_arguments(p)
    return parser


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    parser = build_parser(argv)
    args = parser.parse_args(argv)
    if args.command is None:
        parser.print_help()
        return 2
    module = importlib.import_module(COMMANDS[args.command][0])

    def show(message, category, filename, lineno, file=None, line=None):  # one line, no source location
        print(f"edgespec {args.command}: warning: {message}", file=sys.stderr)

    shown, warnings.showwarning = warnings.showwarning, show
    try:
        return int(module.run(args) or 0)
    except EdgeSpecError as exc:
        print(f"edgespec {args.command}: error: {exc}", file=sys.stderr)
        return exc.exit_code
    except KeyboardInterrupt:
        print(f"edgespec {args.command}: interrupted", file=sys.stderr)
        return 130
    except BrokenPipeError:
        # the reader went away (`edgespec generate ... | head`): stop quietly, as Unix tools do
        try:
            sys.stdout = open(os.devnull, "w")
        except OSError:
            pass
        return 141
    finally:
        warnings.showwarning = shown


if __name__ == "__main__":
    sys.exit(main())
