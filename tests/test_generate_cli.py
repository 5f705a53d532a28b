"""edgespec generate: output modes and bad inputs (non-zero exit, message, no traceback)."""
from __future__ import annotations

import json

import pytest

from edgespec import contract
from edgespec.cli import main

pytestmark = pytest.mark.slow

PROMPT = "the quick brown fox"


def test_stream_json_no_draft_show_drafts(tiny_bundle, capsys):
    b = str(tiny_bundle("gpt2"))
    assert main(["generate", b, "--prompt", PROMPT, "--temperature", "0", "--max-new-tokens", "10", "--threads", "1"]) == 0
    cap = capsys.readouterr()
    assert cap.out.strip() and "10 tokens" in cap.err

    assert main(["generate", b, "--prompt", PROMPT, "--temperature", "0", "--max-new-tokens", "10", "--json"]) == 0
    spec = json.loads(capsys.readouterr().out)
    assert len(spec["ids"]) == 10 and spec["speculative"] and spec["drafter"] == "model" and "acceptance_rate" in spec["stats"]

    assert main(["generate", b, "--prompt", PROMPT, "--temperature", "0", "--max-new-tokens", "10", "--json",
                 "--no-draft"]) == 0
    cap = capsys.readouterr()
    plain = json.loads(cap.out, parse_constant=lambda c: pytest.fail(f"not strict JSON: {c}"))
    assert plain["ids"] == spec["ids"] and set(plain["sources"]) == {"target"} and not plain["speculative"]
    assert plain["drafter"] is None
    assert plain["stats"]["acceptance_rate"] is None      # no drafts: no rate (null, not NaN)

    assert main(["generate", b, "--prompt", PROMPT, "--temperature", "0", "--max-new-tokens", "10", "--show-drafts",
                 "--gamma", "auto", "--draft-threads", "1", "--no-spin"]) == 0
    out = capsys.readouterr().out
    assert "\x1b[" not in out  # not a TTY: brackets, no ANSI codes


def test_stop_token_ids(tiny_bundle, capsys):
    """--stop-token-ids ends generation after the first of them, as the API's stop_token_ids; the
    speculative and the plain path stop at the same place."""
    b = str(tiny_bundle("gpt2"))
    argv = ["generate", b, "--prompt", PROMPT, "--temperature", "0", "--max-new-tokens", "12", "--json"]
    assert main(argv) == 0
    full = json.loads(capsys.readouterr().out)["ids"]
    stop = full[5]
    cut = full[: full.index(stop) + 1]
    for extra in ([], ["--no-draft"], ["--gamma", "3"]):
        assert main(argv + ["--stop-token-ids", f"{stop}, {stop + 1}"] + extra) == 0
        out = json.loads(capsys.readouterr().out)
        assert out["ids"] == cut and out["finish_reason"] == "stop", extra
    for bad in ("x", "-1", "²"):
        _fails(argv + ["--stop-token-ids", bad], capsys, "--stop-token-ids takes comma-separated non-negative integer")
    for bad, needle in (("3,,4", "has an empty item ('3,,4'); separate values with single commas: 3,4"),
                        ("", "is empty; give at least one value"), ("3,3", "lists a value twice")):
        _fails(argv + ["--stop-token-ids", bad], capsys, f"--stop-token-ids {needle}")
    _fails(argv + ["--stop-token-ids", "100000"], capsys, "(CLI --stop-token-ids) [100000] can never be generated")


def test_no_draft_needs_only_the_target(bundle_copy, capsys):
    """Plain decoding reads only the target's files: a broken or missing draft does not stop it
    (and the draft is still checked when it is used)."""
    import shutil

    b = bundle_copy()
    f = b / "draft" / contract.DECODER_FILE
    f.write_bytes(f.read_bytes()[:1000])
    argv = ["generate", str(b), "--prompt", PROMPT, "--temperature", "0", "--max-new-tokens", "4"]
    assert main(argv + ["--no-draft"]) == 0
    assert "acceptance_rate=n/a" in capsys.readouterr().err
    _fails(argv, capsys, "truncated")
    shutil.rmtree(b / "draft")
    assert main(argv + ["--no-draft"]) == 0
    _fails(argv, capsys, "missing the draft folder")


def test_contradictory_flags(tiny_bundle, capsys):
    b = str(tiny_bundle("gpt2"))
    _fails(["generate", b, "--prompt", "x", "--no-draft", "--draft", "ngram"], capsys, "drop --draft ngram")
    _fails(["generate", b, "--prompt", "x", "--no-draft", "--gamma", "4"], capsys, "--gamma has no effect")
    assert main(["generate", b, "--prompt", "x", "--no-draft", "--gamma", "adaptive", "--max-new-tokens", "2"]) == 0
    _fails(["generate", b, "--prompt", "x", "--platform", "tpu"], capsys, "--runtime xla")
    _fails(["generate", b, "--prompt", "x", "--no-draft", "--lenience", "0.5"], capsys, "--lenience has no effect")
    _fails(["generate", b, "--prompt", "x", "--json", "--show-drafts"], capsys, "drop --show-drafts or --json")
    _fails(["generate", b, "--prompt", "x", "--no-draft", "--show-drafts"], capsys, "--show-drafts has nothing to mark")
    _fails(["generate", b, "--prompt", "x", "--no-draft", "--draft-threads", "2"], capsys, "--draft-threads has no effect")
    _fails(["generate", b, "--prompt", "x", "--draft", "ngram", "--draft-provider", "cpu"], capsys,
           "--draft ngram uses no draft model: --draft-provider has no effect")
    _fails(["generate", b, "--prompt", "x", "--lenience", "0"], capsys, "lenience (CLI --lenience) must be in (0, 1]")


def test_lenience_below_one_says_it_is_not_exact(tiny_bundle, capsys):
    b = str(tiny_bundle("gpt2"))
    argv = ["generate", b, "--prompt", PROMPT, "--seed", "3", "--max-new-tokens", "6", "--json"]
    assert main(argv) == 0
    cap = capsys.readouterr()
    assert json.loads(cap.out)["exact"] is True and "not exact" not in cap.err
    assert main(argv + ["--lenience", "0.5"]) == 0
    cap = capsys.readouterr()
    assert json.loads(cap.out)["exact"] is False and "--lenience 0.5 < 1 is not exact" in cap.err
    assert main(argv + ["--lenience", "0.5", "--temperature", "0"]) == 0   # greedy keeps only the argmax: exact
    cap = capsys.readouterr()
    assert json.loads(cap.out)["exact"] is True and "not exact" not in cap.err


def test_seq2seq_generate(tiny_bundle, capsys):
    assert main(["generate", str(tiny_bundle("t5")), "--prompt", PROMPT, "--seed", "1", "--max-new-tokens", "8",
                 "--json"]) == 0
    assert len(json.loads(capsys.readouterr().out)["ids"]) <= 8


def _fails(argv, capsys, needle):
    rc = main(argv)
    err = capsys.readouterr().err
    assert rc != 0, err
    assert needle in err, err
    assert "Traceback" not in err


def test_cli_errors(tmp_path, tiny_bundle, bundle_copy, capsys):
    good = str(tiny_bundle("gpt2"))
    _fails(["generate", str(tmp_path / "nope"), "--prompt", "x"], capsys, "does not exist")
    _fails(["generate", good, "--prompt", "x", "--provider", "cuda"], capsys, "not available")
    _fails(["generate", good, "--prompt", "x", "--draft-provider", "qnn"], capsys, "not available")
    _fails(["generate", good, "--prompt", " ".join(["fox"] * 130)], capsys, "128")
    _fails(["generate", good, "--prompt", "x", "--gamma", "many"], capsys, "--gamma")
    _fails(["generate", good, "--prompt", "x", "--temperature", "-1"], capsys, "temperature")
    _fails(["generate", good, "--prompt", ""], capsys, "empty")
    _fails(["generate", good, "--prompt", "x", "--seed", "-1"], capsys, "--seed must be a non-negative integer (or left out")

    b = bundle_copy()
    data = json.loads((b / contract.MANIFEST_NAME).read_text())
    data["schema_version"] = 7
    (b / contract.MANIFEST_NAME).write_text(json.dumps(data))
    _fails(["generate", str(b), "--prompt", "x"], capsys, "re-export")

    b2 = bundle_copy("t5")
    f = b2 / "target" / contract.ENCODER_FILE
    f.write_bytes(f.read_bytes()[:500])
    _fails(["generate", str(b2), "--prompt", "x"], capsys, "truncated")

    f = b2 / "target" / contract.ENCODER_FILE
    f.write_text("version https://git-lfs.github.com/spec/v1\noid sha256:0\nsize 1\n")
    _fails(["generate", str(b2), "--prompt", "x"], capsys, "git lfs pull")


def test_version_module_entry_and_engine_context(tiny_bundle, capsys):
    import subprocess
    import sys

    import edgespec

    with pytest.raises(SystemExit) as info:
        main(["--version"])
    assert info.value.code == 0 and capsys.readouterr().out.strip() == f"edgespec {edgespec.__version__}"
    run = subprocess.run([sys.executable, "-m", "edgespec", "--version"], capture_output=True, text=True, timeout=120)
    assert run.returncode == 0 and run.stdout.strip() == f"edgespec {edgespec.__version__}"
    with edgespec.load(tiny_bundle("gpt2"), threads=1) as eng:
        assert len(eng.generate(PROMPT, max_new_tokens=3, temperature=0).ids) == 3
    assert len(eng.generate(PROMPT, max_new_tokens=3, temperature=0).ids) == 3  # close() forgets the context, the engine stays usable


def test_cli_sigterm_oserror_and_unknown_flags(monkeypatch, capsys):
    """SIGTERM unwinds like Ctrl-C (exit 143, one line); an unreadable or unwritable path named by
    the user is one line, exit 2; an unknown flag prints the command's usage, not the top level's."""
    import errno
    import os
    import signal
    import time

    import edgespec.theory as theory

    def killed(args):
        os.kill(os.getpid(), signal.SIGTERM)
        time.sleep(5)
        raise AssertionError("SIGTERM did not interrupt")

    monkeypatch.setattr(theory, "run", killed)
    before = signal.getsignal(signal.SIGTERM)
    assert main(["plan", "--alpha", "0.8", "--c", "0.05"]) == 143
    assert capsys.readouterr().err.strip() == "edgespec plan: terminated"
    assert signal.getsignal(signal.SIGTERM) is before              # handler restored

    def denied(args):
        raise PermissionError(errno.EACCES, "Permission denied", "/srv/models/out")

    monkeypatch.setattr(theory, "run", denied)
    assert main(["plan", "--alpha", "0.8", "--c", "0.05"]) == 2
    err = capsys.readouterr().err
    assert "Permission denied: '/srv/models/out'" in err and "Traceback" not in err

    def full(args):
        raise OSError(errno.ENOSPC, "No space left on device")          # a write with no file name

    monkeypatch.setattr(theory, "run", full)
    assert main(["plan", "--alpha", "0.8", "--c", "0.05"]) == 2
    err = capsys.readouterr().err
    assert "error: No space left on device; check" in err and "None" not in err

    with pytest.raises(SystemExit) as info:
        main(["plan", "--alpha", "0.8", "--c", "0.05", "--force"])
    err = capsys.readouterr().err
    assert info.value.code == 2 and "usage: edgespec plan" in err and "unrecognized arguments: --force" in err

    # a value that starts with '-' reads as a missing one: the message says how to write it
    with pytest.raises(SystemExit) as info:
        main(["generate", "bundle", "--prompt", "-x"])
    err = capsys.readouterr().err
    assert info.value.code == 2 and "argument --prompt: expected one argument" in err and "--prompt=VALUE" in err
    with pytest.raises(SystemExit) as info:   # a value left out: no such hint
        main(["generate", "bundle", "--prompt"])
    err = capsys.readouterr().err
    assert info.value.code == 2 and "argument --prompt: expected one argument" in err and "=VALUE" not in err


def test_show_drafts_marks_whitespace_tokens_visibly():
    from edgespec.generate_cli import render_marked

    class Pieces:
        def decode(self, ids):
            return "".join({1: "def", 2: "\n", 3: "    ", 4: " x"}[i] for i in ids)

    out = render_marked(Pieces(), [1, 2, 3, 4], ["target", "accepted", "bonus", "recovered"], color=False)
    assert out == "def[\\n]\n<    > {x}"     # a kept newline shows as [\n] and still breaks the line

    class Indent:
        def decode(self, ids):
            return "".join({1: "a", 2: "\n\n    ", 3: "b"}[i] for i in ids)

    out = render_marked(Indent(), [1, 2, 3], ["target", "accepted", "target"], color=False)
    assert out == "a[\\n\\n    ]\n\n    b"   # both line breaks and the indent survive the marking

    class Bytes:  # byte-level tokens (an int is one byte, a bytes object several): a character may span several
        def decode(self, ids):
            return b"".join(bytes([i]) if isinstance(i, int) else i for i in ids).decode("utf-8", errors="replace")

    word = list("a\u4e16b".encode()) + [0x19]   # a, the three bytes of a CJK character, b, a control character
    out = render_marked(Bytes(), word, ["target", "accepted", "accepted", "accepted", "bonus", "target"], color=False)
    assert out == "a[\u4e16]<b>\\x19"   # the character whole (it was a[\ufffd]), the control character escaped
    # tokens that straddle characters: each character goes with the token that completes it
    two = "\u4e16\u754c".encode()             # E4 B8 | 96 E7 | 95 8C
    out = render_marked(Bytes(), [two[:2], two[2:4], two[4:]], ["target", "target", "accepted"], color=False)
    assert out == "\u4e16[\u754c]"
    # format characters (a zero-width non-joiner in Persian) are text; a carriage return is escaped
    out = render_marked(Bytes(), list("a\u200cb\rc".encode()), ["target"] * 7, color=False)
    assert out == "a\u200cb\\rc"
    # the text's own brackets and backslashes are escaped: "[x]" in the text was read as an accepted x

    class Code:
        def decode(self, ids):
            return "".join({1: "a[i]", 2: "[j]", 3: "\\n", 4: "{k}"}[i] for i in ids)

    out = render_marked(Code(), [1, 2, 3, 4], ["target", "accepted", "target", "recovered"], color=False)
    assert out == "a\\[i\\][\\[j\\]]\\\\n{\\{k\\}}"
    colored = render_marked(Code(), [1, 2, 3, 4], ["target", "accepted", "target", "recovered"], color=True)
    assert colored.startswith("a[i]\x1b[32m[j]\x1b[0m\\n")   # colors need no escapes


def test_gamma_on_a_single_model_bundle_is_an_error(bundle_copy, capsys):
    """Without a draft model, --gamma would silently mean plain decoding; --draft ngram uses it."""
    import shutil

    b = bundle_copy()
    data = json.loads((b / contract.MANIFEST_NAME).read_text())
    del data["models"]["draft"]
    (b / contract.MANIFEST_NAME).write_text(json.dumps(data))
    shutil.rmtree(b / "draft")
    argv = ["generate", str(b), "--prompt", PROMPT, "--temperature", "0", "--max-new-tokens", "4"]
    _fails(argv + ["--gamma", "3"], capsys, "has no draft model, so --gamma has no effect")
    _fails(argv + ["--show-drafts"], capsys, "has no draft model, so --show-drafts has no effect")
    _fails(argv + ["--gamma", "3", "--show-drafts"], capsys, "so --gamma and --show-drafts have no effect")
    for flags in (["--draft-threads", "2"], ["--draft-provider", "cpu"], ["--lenience", "0.5"]):  # accepted, ignored
        _fails(argv + flags, capsys, f"has no draft model, so {flags[0]} has no effect")
    for drafter in ("model", "lookahead", "hybrid"):  # CLI words, not the API's drafter='...'
        _fails(argv + ["--draft", drafter], capsys, f"--draft {drafter} drafts with the bundle's draft model, and ")
    assert main(argv + ["--gamma", "3", "--draft", "ngram"]) == 0
    assert main(argv) == 0  # without --draft: plain decoding


def test_prompt_file_and_stdin(tiny_bundle, tmp_path, capsys, monkeypatch):
    """--prompt-file PATH (or '-': standard input) gives what --prompt gives with the same text; a
    missing, empty or non-UTF-8 file, or both flags, exit 2 before the bundle loads."""
    import io
    import sys

    b = str(tiny_bundle("gpt2"))
    text = PROMPT + "\n  over the lazy dog\n"
    argv = ["generate", b, "--temperature", "0", "--max-new-tokens", "6", "--json", "--threads", "1"]
    assert main(argv + ["--prompt", text]) == 0
    want = json.loads(capsys.readouterr().out)
    f = tmp_path / "prompt.txt"
    f.write_text(text, encoding="utf-8")
    assert main(argv + ["--prompt-file", str(f)]) == 0
    got = json.loads(capsys.readouterr().out)
    assert got["prompt_ids"] == want["prompt_ids"] and got["ids"] == want["ids"]
    monkeypatch.setattr(sys, "stdin", io.TextIOWrapper(io.BytesIO(text.encode("utf-8"))))
    assert main(argv + ["--prompt-file", "-"]) == 0
    assert json.loads(capsys.readouterr().out)["prompt_ids"] == want["prompt_ids"]
    f.write_bytes(b"\xef\xbb\xbf" + text.encode("utf-8"))  # a UTF-8 byte-order mark is not part of the prompt
    assert main(argv + ["--prompt-file", str(f)]) == 0
    assert json.loads(capsys.readouterr().out)["prompt_ids"] == want["prompt_ids"]
    (tmp_path / "utf16.txt").write_bytes(text.encode("utf-16"))
    (tmp_path / "latin.txt").write_bytes(b"caf\xe9")
    (tmp_path / "empty.txt").write_text("")
    for extra, needle in ((["--prompt-file", str(tmp_path / "nope.txt")], "cannot read --prompt-file"),
                          (["--prompt-file", str(tmp_path / "latin.txt")], "is not UTF-8 text (byte 3)"),
                          (["--prompt-file", str(tmp_path / "empty.txt")], "is empty"),
                          (["--prompt-file", str(tmp_path / "utf16.txt")], "is UTF-16 text; convert it to UTF-8")):
        _fails(argv + extra, capsys, needle)
    for extra, needle in ((["--prompt-file", str(f), "--prompt", "x"], "not allowed with argument"),
                          ([], "one of the arguments --prompt --prompt-file is required")):
        with pytest.raises(SystemExit) as exit_:  # argparse's own usage errors
            main(argv + extra)
        assert exit_.value.code == 2 and needle in capsys.readouterr().err


@pytest.mark.parametrize("stop", ["nan", "sigterm"])
def test_an_error_after_text_was_streamed_ends_its_line_and_says_so(tiny_bundle, capsys, monkeypatch, stop):
    """A draft that produced NaN logits a few tokens in: the streamed text stayed on stdout with no
    line break and nothing said it was cut short. SIGTERM's text too (a review's find)."""
    from edgespec.cli import _Terminated
    from edgespec.errors import NonFiniteLogitsError
    from edgespec.runtimes.onnx_backend import OnnxDecoderBackend

    bundle = str(tiny_bundle("gpt2"))   # (exported before the patch)
    real, calls = OnnxDecoderBackend.extend, []

    def failing(self, ids):
        calls.append(len(ids))
        if len(calls) > 6:
            if stop == "sigterm":
                raise _Terminated()   # what the CLI's SIGTERM handler raises
            raise NonFiniteLogitsError("the draft model produced NaN or +inf logits")
        return real(self, ids)

    monkeypatch.setattr(OnnxDecoderBackend, "extend", failing)
    assert main(["generate", bundle, "--prompt", PROMPT, "--temperature", "0", "--gamma", "1",
                 "--max-new-tokens", "20"]) == (2 if stop == "nan" else 143)
    out, err = capsys.readouterr()
    assert out.endswith("\n") and out.strip()
    lines = err.strip().splitlines()
    assert lines[-2].startswith("[stopped after ") and lines[-2].endswith(" tokens: the text above is incomplete]"), err
    assert lines[-1].startswith("edgespec generate: error: the draft model produced NaN" if stop == "nan" else
                                "edgespec generate: terminated")


def test_text_the_terminal_cannot_encode_is_escaped_not_a_traceback(tiny_bundle, monkeypatch, capsys):
    """stdout in ASCII (PYTHONIOENCODING=ascii, a cp1252 console) took a UnicodeEncodeError traceback
    mid-text when the model generated a character outside it (a review's find)."""
    import io
    import sys

    import edgespec.api

    real = edgespec.api._Detokenizer.push
    monkeypatch.setattr(edgespec.api._Detokenizer, "push", lambda self, ids: real(self, ids) + "\u00e9")
    raw = io.BytesIO()
    monkeypatch.setattr(sys, "stdout", io.TextIOWrapper(raw, encoding="ascii"))
    assert main(["generate", str(tiny_bundle("gpt2")), "--prompt", PROMPT, "--temperature", "0",
                 "--max-new-tokens", "4"]) == 0   # the streamed text
    sys.stdout.flush()
    assert b"\\xe9" in raw.getvalue()  # each block's character, escaped
    assert sys.stdout.errors == "strict"  # the escaping was for the command: an application keeps its own


def test_every_command_escapes_what_the_terminal_cannot_encode(tiny_bundle, tmp_path, monkeypatch):
    """The escaping was generate's own: bench wrote its files, then its last line ("wrote ...", a
    folder named résultats) took a traceback on an ASCII stdout; the demo's streamed text did too."""
    import io
    import sys

    raw = io.BytesIO()
    monkeypatch.setattr(sys, "stdout", io.TextIOWrapper(raw, encoding="ascii"))
    out = tmp_path / "r\u00e9sultats"
    assert main(["bench", str(tiny_bundle("llama")), "--gammas", "2", "--temperatures", "0", "--repeats", "1",
                 "--max-new-tokens", "4", "--prompts", str(_one_prompt(tmp_path)), "--quiet", "--out", str(out)]) == 0
    sys.stdout.flush()
    assert b"r\\xe9sultats" in raw.getvalue() and (out / "bench.json").is_file()
    assert sys.stdout.errors == "strict"


def _one_prompt(tmp_path):
    path = tmp_path / "prompts.txt"
    path.write_text("the cat sat")
    return path


def test_closed_standard_streams_are_not_a_traceback(tiny_bundle, monkeypatch, capsys):
    """With fd 0 or 1 closed at start (`<&-`, `>&-`, some daemons) Python leaves sys.stdin / sys.stdout
    None: an AttributeError traceback. Now a closed stdin is a typed error, and a closed stdout
    discards the text, as print() does."""
    import sys

    bundle = str(tiny_bundle("gpt2"))
    monkeypatch.setattr(sys, "stdin", None)
    assert main(["generate", bundle, "--prompt-file", "-"]) == 2
    assert "--prompt-file -: standard input is closed" in capsys.readouterr().err
    monkeypatch.setattr(sys, "stdout", None)
    assert main(["generate", bundle, "--prompt", PROMPT, "--max-new-tokens", "3", "--seed", "0"]) == 0
    assert sys.stdout is None  # put back as it was
