"""The ``edgespec`` command line. Each subcommand lives in its own module, imported lazily so
that ``edgespec generate`` never imports torch. A module exposes ``add_arguments(parser)`` and
``run(args) -> int``."""
from __future__ import annotations

import argparse
import contextlib
import errno
import importlib
import importlib.util
import os
import re
import signal
import sys
import threading
import warnings
from pathlib import Path
from typing import Callable

from . import errors
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


class _Parser(argparse.ArgumentParser):
    def __init__(self, *args, argv: list[str], **kwargs):
        super().__init__(*args, **kwargs)
        self.argv = argv   # the command line being parsed

    def error(self, message: str):
        # argparse reads `--prompt -x` as a missing value followed by an option
        m = re.fullmatch(r"argument (--[\w-]+)(?:/[^:]*)?: expected one argument", message)
        if m and any(a == m.group(1) and b.startswith("-") for a, b in zip(self.argv, self.argv[1:])):
            message += f" (a value that starts with '-' is written {m.group(1)}=VALUE)"
        super().error(message)


def build_parser(argv: list[str]) -> argparse.ArgumentParser:
    """The top-level parser; ``parser.commands`` maps each command to its own parser."""
    from . import __version__

    parser = _Parser(prog="edgespec", description="Exact speculative decoding for edge and accelerator hardware.",
                     argv=argv)
    parser.add_argument("--version", action="version", version=f"edgespec {__version__}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", parser_class=_Parser)
    wanted = next((a for a in argv if not a.startswith("-")), None)
    parser.commands = {}
    for name, (module, help_text) in COMMANDS.items():
        p = parser.commands[name] = sub.add_parser(name, help=help_text, description=help_text, argv=argv)
        if name == wanted:  # import only the module of the command being run
            importlib.import_module(module).add_arguments(p)
    return parser


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    parser = build_parser(argv)
    args, unknown = parser.parse_known_args(argv)
    if unknown:  # the command's own usage line, not the top-level one
        parser.commands.get(args.command, parser).error(f"unrecognized arguments: {' '.join(unknown)}")
    if args.command is None:
        parser.print_help()
        return 2
    module = importlib.import_module(COMMANDS[args.command][0])
    args.argv = argv  # what was run, for result files (bench.json's command)

    def show(message, category, filename, lineno, file=None, line=None):  # one line, no source location
        print(f"edgespec {args.command}: warning: {message}", file=sys.stderr)

    shown, warnings.showwarning = warnings.showwarning, show
    try:
        return run_script(lambda: module.run(args), f"edgespec {args.command}")
    finally:
        warnings.showwarning = shown


def console_main() -> int:
    """The ``edgespec`` program (``main`` is for callers in the same process, tests included)."""
    code = main()
    if code in (130, 143) and "jax" in sys.modules:
        # Interrupted while XLA compiled, Python's own shutdown then ends in a segmentation fault
        # inside JAX's unfinished work (exit 139 instead of 130). Every clean-up of ours has run by
        # now (folders are removed as the exception unwinds), so leave without that shutdown.
        for stream in (sys.stdout, sys.stderr):
            try:
                stream.flush()
            except (OSError, ValueError):
                pass
        os._exit(code)
    return code


def at_least(low: int, high: int | None = None) -> Callable[[str], int]:
    """An argparse type: an integer >= ``low`` and, if given, <= ``high`` (a usage error otherwise,
    not a traceback later)."""
    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected an integer, got {text!r}") from None
        if value < low or (high is not None and value > high):
            raise argparse.ArgumentTypeError(f"must be >= {low}{'' if high is None else f' and <= {high}'}, got {value}")
        return value
    parse.__name__ = f"integer >= {low}" + ("" if high is None else f" and <= {high}")
    return parse


def folder(text: str) -> Path:
    """An argparse type: a folder path, not empty (``--out ''`` was the current folder)."""
    if not text.strip():
        raise argparse.ArgumentTypeError("is empty; give a folder path")
    return Path(text)


def parse_list(text: str, cast, name: str) -> list:
    """The values of a comma-separated option ``--name`` (each through ``cast``; a ValueError from
    it is a typed error naming the option): none empty, none twice, at least one."""
    items = text.split(",")
    if any(not x.strip() for x in items) and any(x.strip() for x in items):  # all blank: "is empty" below
        raise errors.InvalidArgumentError(f"--{name} has an empty item ({text!r}); separate values with single commas: "
                                   f"{','.join(x.strip() for x in items if x.strip())}")
    try:
        values = [cast(x) for x in items if x.strip()]
    except errors.InvalidArgumentError:
        raise
    except ValueError:
        raise errors.InvalidArgumentError(f"--{name} takes a comma-separated list; got {text!r}") from None
    if not values:
        raise errors.InvalidArgumentError(f"--{name} is empty; give at least one value (a comma-separated list)")
    if len(set(values)) < len(values):
        raise errors.InvalidArgumentError(f"--{name} lists a value twice ({text!r}); give each once")
    return values


def run_script(main: Callable[[], int | None], name: str) -> int:
    """Run ``main`` (a command's ``run``, a benchmarks/*.py script's ``main``) the way every edgespec
    program ends: an EdgeSpecError or a path the user named that cannot be read or written is one
    line and a non-zero exit, Ctrl-C is 130, SIGTERM 143, a closed pipe 141; never a traceback for
    those. SIGTERM (docker stop, systemd, CI timeouts) unwinds like Ctrl-C, so temporary folders are
    removed."""
    terminate = threading.current_thread() is threading.main_thread()
    previous = signal.getsignal(signal.SIGTERM) if terminate else None
    previous_hook = sys.unraisablehook
    running = threading.Event()  # a dropped signal is sent again only while main() runs
    try:
        if terminate:
            signal.signal(signal.SIGTERM, _raise_terminated)
            running.set()
            sys.unraisablehook = lambda u: _deliver_again(u, previous_hook, running)
        with _escaping_stdout():
            return int(main() or 0)
    except EdgeSpecError as exc:
        print(f"{name}: error: {exc}", file=sys.stderr)
        return exc.exit_code
    except KeyboardInterrupt:
        print(f"{name}: interrupted", file=sys.stderr)
        return 130
    except _Terminated:
        print(f"{name}: terminated", file=sys.stderr)
        return 143
    except ModuleNotFoundError as exc:
        missing = _missing_extra(exc)
        if missing is None:
            raise
        package, extra = missing
        print(f"{name}: error: this needs {package}, which edgespec's '{extra}' extra installs: "
              f"pip install 'edgespec[{extra}]'", file=sys.stderr)
        return 2
    except BrokenPipeError:
        # the reader went away (`edgespec generate ... | head`): stop quietly, as Unix tools do
        try:
            sys.stdout = open(os.devnull, "w")
        except OSError:
            pass
        return 141
    except OSError as exc:
        if exc.errno not in _USER_FIXABLE_ERRNOS:
            raise
        # a file the user named cannot be read or written: say which, without a traceback
        path = exc.filename2 if exc.filename2 is not None else exc.filename
        where = f": {path!r}" if path is not None else ""
        print(f"{name}: error: {exc.strerror or exc}{where}; check the path, its permissions and the free space",
              file=sys.stderr)
        return 2
    finally:
        running.clear()
        if terminate:  # None: a handler set outside Python, which signal() cannot reinstall
            signal.signal(signal.SIGTERM, previous if previous is not None else signal.SIG_DFL)
            sys.unraisablehook = previous_hook


@contextlib.contextmanager
def _escaping_stdout():
    """A terminal or file in an encoding without some character a command writes (generated text, a
    path; ASCII, cp1252) took a traceback mid-output (a review's find): such characters are written
    as escapes while the command runs, and stdout's own error handler is put back after it (an
    application calling main() keeps its own). A closed stdout (fd 1 closed at start: Python leaves
    sys.stdout None) discards what is written, as print() does, instead of an AttributeError."""
    stream = sys.stdout
    if stream is None:
        sys.stdout = open(os.devnull, "w")
        try:
            yield
        finally:
            sys.stdout.close()
            sys.stdout = None
        return
    if not callable(getattr(stream, "reconfigure", None)):
        yield
        return
    before = stream.errors
    stream.reconfigure(errors="backslashreplace")
    try:
        yield
    finally:  # (on a closed pipe its flush raises BrokenPipeError: run_script's exit 141)
        stream.reconfigure(errors=before)


# optional packages -> the extra that installs them (pyproject.toml); the runtime needs none of them
_EXTRAS = {"jax": "xla", "jaxlib": "xla", "torch": "export", "transformers": "export", "optimum": "export",
           "onnx": "export", "tqdm": "export", "safetensors": "export", "matplotlib": "bench"}


def _missing_extra(exc: ModuleNotFoundError) -> tuple[str, str] | None:
    """(package, extra to install) for a missing optional package (None: another module, or one that
    is installed but broken inside: that traceback is a bug to report, not an install to make)."""
    root = (exc.name or "").split(".")[0]
    if root not in _EXTRAS:
        return None
    try:
        installed = importlib.util.find_spec(root) is not None
    except (ValueError, ImportError):  # (sys.modules[root] is None: blocked, as missing)
        installed = False
    return None if installed else (root, _EXTRAS[root])


class _Terminated(BaseException):
    """Raised by the SIGTERM handler; a BaseException so that no ``except Exception`` stops it."""


def _deliver_again(unraisable, previous_hook, running: threading.Event) -> None:
    """A Ctrl-C or SIGTERM whose exception was raised inside a __del__ or a garbage-collector
    callback (JAX has one) is printed and dropped by Python, and the program carried on. Send
    the signal again from another thread, so that its handler runs in the interrupted code once
    this hook has returned (a handler run inside the hook would be dropped the same way)."""
    exc = unraisable.exc_value
    if not isinstance(exc, (KeyboardInterrupt, _Terminated)):
        return previous_hook(unraisable)
    delay = 0.01
    while True:
        if isinstance(exc, KeyboardInterrupt):
            signum = signal.SIGINT
        else:
            signal.signal(signal.SIGTERM, _raise_terminated)  # its handler had reset itself for a second SIGTERM
            signum = signal.SIGTERM
        # 10 ms later, when this hook has usually returned; not once the command has ended (a
        # second Ctrl-C dropped during its clean-up)
        timer = threading.Timer(delay, lambda: running.is_set() and os.kill(os.getpid(), signum))
        timer.daemon = True
        try:
            timer.start()  # (waits for the thread to start: on a loaded machine, longer than 10 ms)
            return
        except (KeyboardInterrupt, _Terminated) as again:
            # The signal landed while this hook still ran. Python drops an exception raised in
            # the hook too (it does not call the hook for it), so send it once more, later.
            exc, delay = again, delay * 2


def _raise_terminated(signum, frame):
    signal.signal(signal.SIGTERM, signal.SIG_DFL)  # a second SIGTERM during the clean-up ends the process
    raise _Terminated()


_USER_FIXABLE_ERRNOS = {errno.EACCES, errno.EPERM, errno.EROFS, errno.ENOSPC, getattr(errno, "EDQUOT", errno.ENOSPC)}


if __name__ == "__main__":
    sys.exit(console_main())
