"""Issue 9, faults: exports killed at random moments or out of disk, engines shared by threads,
generation interrupted mid-stream."""
from __future__ import annotations

import errno
import json
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from edgespec import contract
from edgespec.api import load
from edgespec.bundle import PARTIAL_MARKER, load_bundle
from edgespec.cli import main
from edgespec.errors import BundleError, DiskFullError, EngineBusyError, InvalidArgumentError

pytestmark = pytest.mark.slow

PROMPT = "the quick brown fox jumps over"


# ------------------------------------------------------------------------- killed exports
def _export_cmd(target, draft, out):
    return [sys.executable, "-m", "edgespec.cli", "export", "--target", str(target), "--draft", str(draft),
            "--out", str(out)]


def _loads(folder: Path) -> bool:
    try:
        load_bundle(folder)
        return True
    except BundleError:
        return False


def _assert_no_partial_bundle(out: Path, reference: dict) -> None:
    for p in out.parent.glob(f".{out.name}.partial-*"):
        assert not _loads(p), f"{p} loads as a bundle"
    if out.exists() and _loads(out):
        # only possible when the kill came after the commit (rename + marker removal): then it is whole
        data = json.loads((out / contract.MANIFEST_NAME).read_text())
        assert {r: m["files"] for r, m in data["models"].items()} == reference
        eng = load(out, threads=1)
        assert len(eng.generate(PROMPT, max_new_tokens=4, temperature=0).ids) == 4


KILL_POINTS = [0.5, 1.5, 3.0, "target: exporting ONNX graphs", "target: validating", "draft: loading", "writing "]


@pytest.mark.parametrize("when", KILL_POINTS, ids=[str(k) for k in KILL_POINTS])
def test_sigkilled_export_leaves_no_bundle_and_rerun_succeeds(tiny_checkpoints, tiny_bundle, tmp_path, capsys, when):
    target, draft = tiny_checkpoints("gpt2")
    reference = {r: m.files for r, m in load_bundle(tiny_bundle("gpt2")).models.items()}
    out = tmp_path / "bundle"
    proc = subprocess.Popen(_export_cmd(target, draft, out), stderr=subprocess.PIPE, stdout=subprocess.DEVNULL, text=True)
    try:
        if isinstance(when, float):
            time.sleep(when)
        else:
            for line in proc.stderr:  # progress lines: "[edgespec export] <role>: <step>"
                if when in line:
                    break
        proc.send_signal(signal.SIGKILL)
    finally:
        proc.wait(timeout=60)
        proc.stderr.close()
    _assert_no_partial_bundle(out, reference)
    # rerun the same command (with --overwrite only if the first run had already committed)
    extra = ["--overwrite"] if out.exists() and _loads(out) else []
    assert main(["export", "--target", str(target), "--draft", str(draft), "--out", str(out), "--quiet", *extra]) == 0
    capsys.readouterr()
    assert _loads(out) and not (out / PARTIAL_MARKER).exists()
    assert not list(tmp_path.glob(".bundle.partial-*")), "stale temporary folders were not cleaned"


def test_kill_between_rename_and_commit_is_recovered(tiny_checkpoints, tiny_bundle, tmp_path, capsys):
    """The only window where --out exists before the export is complete: it holds the marker of a
    dead process, never loads, and the next export replaces it without --overwrite."""
    import shutil

    target, draft = tiny_checkpoints("gpt2")
    out = tmp_path / "bundle"
    shutil.copytree(tiny_bundle("gpt2"), out)
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    (out / PARTIAL_MARKER).write_text(json.dumps({"pid": dead.pid, "host": os.uname().nodename}))
    with pytest.raises(BundleError, match="unfinished export.*delete it and run `edgespec export` again"):
        load_bundle(out)
    rc = main(["generate", str(out), "--prompt", "x"])
    assert rc != 0 and "unfinished export" in capsys.readouterr().err
    # a live exporter's folder is left alone
    live = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        other = tmp_path / ".bundle.partial-live"
        other.mkdir()
        (other / PARTIAL_MARKER).write_text(json.dumps({"pid": live.pid, "host": os.uname().nodename}))
        assert main(["export", "--target", str(target), "--draft", str(draft), "--out", str(out), "--quiet"]) == 0
        assert other.is_dir() and _loads(out) and not (out / PARTIAL_MARKER).exists()
    finally:
        live.kill()
        live.wait()
    capsys.readouterr()


# ------------------------------------------------------------------------------ disk full
def test_file_size_limit_in_a_child_export(tiny_checkpoints, tmp_path):
    target, draft = tiny_checkpoints("gpt2")
    out = tmp_path / "bundle"
    limit = "import resource; resource.setrlimit(resource.RLIMIT_FSIZE, (100_000, 100_000)); "
    code = limit + f"import sys; from edgespec.cli import main; sys.exit(main({[*_export_cmd(target, draft, out)[3:]]!r}))"
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert proc.returncode != 0
    assert "file-size limit" in proc.stderr and "Nothing was written" in proc.stderr, proc.stderr[-3000:]
    assert "Traceback" not in proc.stderr
    assert not out.exists() and not list(tmp_path.glob(".bundle.*"))


@pytest.mark.parametrize("where", ["tokenizer copy", "manifest"])
def test_disk_full_while_writing(tiny_checkpoints, tmp_path, monkeypatch, capsys, where):
    from edgespec.export import pipeline

    def enospc(*a, **k):
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    if where == "tokenizer copy":
        monkeypatch.setattr(pipeline.shutil, "copy2", enospc)
    else:
        monkeypatch.setattr(pipeline, "write_manifest", enospc)
    target, draft = tiny_checkpoints("gpt2")
    out = tmp_path / "bundle"
    with pytest.raises(DiskFullError, match="disk is full.*needs about .* MiB.*Nothing was written"):
        pipeline.export_bundle(target, out, draft=draft, progress=None)
    assert main(["export", "--target", str(target), "--draft", str(draft), "--out", str(out), "--quiet"]) != 0
    err = capsys.readouterr().err
    assert "disk is full" in err and "Traceback" not in err
    assert not out.exists() and not list(tmp_path.glob(".bundle.*"))


def test_not_enough_free_space_is_refused_before_any_work(tiny_checkpoints, tmp_path, monkeypatch, capsys):
    from edgespec.export import pipeline

    monkeypatch.setattr(pipeline.shutil, "disk_usage", lambda p: type("Usage", (), {"free": 1000})())
    target, _ = tiny_checkpoints("gpt2")
    out = tmp_path / "bundle"
    assert main(["export", "--model", str(target), "--out", str(out)]) != 0
    err = capsys.readouterr().err
    assert "not enough disk space" in err and "needed" in err and "1000" not in err and "Traceback" not in err
    assert not out.exists() and not list(tmp_path.glob(".bundle.*"))


def test_free_space_estimate_covers_the_peak(tmp_path, monkeypatch):
    """The estimate checked before an export is what the export really puts on disk at its peak,
    within 10% and never below: a tied embedding written twice by the static-KV graph (table and LM
    head), its rotary tables, and an int8 rewrite beside the fp32 graph until it replaces it. It
    counted the checkpoint's weights once (here a third of the peak)."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    import tiny_models
    from edgespec.export import pipeline, quantize
    from edgespec.export.checkpoint import inspect_checkpoint

    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=4096, hidden_size=256, intermediate_size=512, num_hidden_layers=4, num_attention_heads=8,
                      num_key_value_heads=4, max_position_embeddings=16384, bos_token_id=3, eos_token_id=1, pad_token_id=0,
                      tie_word_embeddings=True)
    ckpt = tiny_models._save(LlamaForCausalLM(cfg).eval(), tmp_path / "ckpt")
    peak = [0]
    real_replace = quantize._replace

    def measure(tmp, graph):  # the moment both graphs are on disk
        peak[0] = max(peak[0], sum(p.stat().st_size for p in tmp_path.rglob("*") if p.is_file() and ".partial-" in str(p)))
        return real_replace(tmp, graph)

    monkeypatch.setattr(quantize, "_replace", measure)
    pipeline.export_bundle(ckpt, tmp_path / "out", options=pipeline.ExportOptions(quantize_target="int8"), progress=None)
    roles = {"target": inspect_checkpoint(ckpt, "target")}
    need = pipeline._estimate_bytes(roles, False, {"target": contract.KV_STATIC}, frozenset({"target"}))
    slack = 1 << 20  # the estimate's margin per model (files, headers, alignment), smaller than each term here
    weights = sum(p.stat().st_size for p in ckpt.glob("*.safetensors"))
    assert peak[0] <= need <= 1.1 * peak[0] + slack, (peak[0], need)
    assert weights < peak[0] / 2



# ---------------------------------------------------------------------- threads and streams
@pytest.fixture(scope="module")
def engine(tiny_bundle):
    return load(tiny_bundle("gpt2"), threads=1)


def _reference(bundle, seeds, **kw):
    eng = load(bundle, threads=1)
    return {s: eng.generate(PROMPT, seed=s, **kw).ids for s in seeds}


KW = dict(max_new_tokens=24, temperature=1.0, gamma=3)


def test_threads_share_one_engine(engine, tiny_bundle):
    seeds = list(range(8))
    ref = _reference(tiny_bundle("gpt2"), seeds, **KW)
    results, errors = {}, []
    barrier = threading.Barrier(len(seeds))

    def work(seed, stream):
        try:
            barrier.wait()
            for _ in range(3):
                if stream:
                    s = engine.generate(PROMPT, seed=seed, stream=True, **KW)
                    ids = []
                    for chunk in s:
                        ids += chunk.ids
                        time.sleep(0.001)  # let other threads try to get in mid-stream
                    assert ids == s.result.ids
                else:
                    ids = engine.generate(PROMPT, seed=seed, **KW).ids
                results.setdefault(seed, []).append(ids)
        except BaseException as exc:  # pragma: no cover - reported below
            errors.append(exc)

    threads = [threading.Thread(target=work, args=(s, s % 2 == 0)) for s in seeds]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=120)
    assert not errors, errors
    assert all(results[s] == [ref[s]] * 3 for s in seeds)


def test_second_stream_in_the_same_thread_supersedes_the_first(engine, tiny_bundle):
    ref = _reference(tiny_bundle("gpt2"), [1, 2], **KW)
    first = iter(engine.generate(PROMPT, seed=1, stream=True, **KW))
    next(first)
    assert engine.generate(PROMPT, seed=2, **KW).ids == ref[2]  # not corrupted by the open stream
    with pytest.raises(EngineBusyError, match="superseded.*finish or close"):
        next(first)
    assert engine.generate(PROMPT, seed=1, **KW).ids == ref[1]
    second = engine.generate(PROMPT, seed=2, stream=True, **KW)
    it = iter(second)
    head = next(it)
    assert [head, *second] == list(engine.generate(PROMPT, seed=2, stream=True, **KW))  # goes on where it stopped
    assert list(second) == [] and second.result.ids == ref[2]
    unstarted = engine.generate(PROMPT, seed=2, stream=True, **KW)
    iter(unstarted)                    # an iterator made and dropped before any step: nothing ran, nothing closed
    assert "".join(unstarted) == engine.generate(PROMPT, seed=2, **KW).text
    # engine.close() in the same thread supersedes an open stream too, and a stream closed early
    # says it has no result (not "iterate to the end", which it can no longer do)
    third = iter(engine.generate(PROMPT, seed=1, stream=True, **KW))
    next(third)
    engine.close()
    with pytest.raises(EngineBusyError, match="generate call or engine.close()"):
        next(third)
    fourth = engine.generate(PROMPT, seed=1, stream=True, **KW)
    for _ in fourth:
        break
    with pytest.raises(InvalidArgumentError, match="closed before it finished"):
        fourth.result
    with pytest.raises(InvalidArgumentError, match="closed before it finished, so it cannot be iterated again"):
        iter(fourth)
    # next(stream) holds its iterator: the stream stays open between calls and a loop goes on from there;
    # next(iter(stream)) drops the iterator it made, which ends the stream, and the error says so
    fifth = engine.generate(PROMPT, seed=2, stream=True, **KW)
    head = [next(fifth), next(fifth)]
    assert [*head, *fifth] == list(engine.generate(PROMPT, seed=2, stream=True, **KW))
    assert fifth.result.ids == ref[2]
    with pytest.raises(StopIteration):
        next(fifth)
    # a stream that next() holds is freed, and gives the engine back, as soon as it is dropped (no
    # reference cycle left for the garbage collector); close() ends it and next() then says so
    import gc

    gc.disable()
    try:
        held = engine.generate(PROMPT, seed=2, stream=True, **KW)
        next(held)
        assert engine._guard._holder is not None
        del held
        assert engine._guard._holder is None
    finally:
        gc.enable()
    held = engine.generate(PROMPT, seed=2, stream=True, **KW)
    next(held)
    held.close()
    assert engine._guard._holder is None
    for again in (lambda: next(held), lambda: list(held)):
        with pytest.raises(InvalidArgumentError, match="closed before it finished"):
            again()
    unread = engine.generate(PROMPT, seed=2, stream=True, **KW)
    unread.close()                     # closed before its first step: next() says so too (not a bare StopIteration)
    for again in (lambda: next(unread), lambda: list(unread)):
        with pytest.raises(InvalidArgumentError, match="closed before it finished"):
            again()
    sixth = engine.generate(PROMPT, seed=2, stream=True, **KW)
    next(iter(sixth))
    with pytest.raises(InvalidArgumentError, match=r"dropping its iterator, as next\(iter\(stream\)\) does.*next\(stream\)"):
        list(sixth)


@pytest.mark.parametrize("call", ["generate", "close"])
def test_a_stream_handed_to_another_thread_is_waited_for_mid_step(engine, tiny_bundle, monkeypatch, call):
    """A stream started in this thread and stepped in a worker: this thread's next call found the
    holder to be "its own" idle stream and took the caches while the worker's step ran (other
    output, segmentation faults). It now waits for that step to end, then supersedes the stream."""
    ref = _reference(tiny_bundle("gpt2"), [2], **KW)
    s = engine.generate(PROMPT, seed=1, stream=True, **KW)
    next(s)                                           # started (and leased) in this thread
    entered, release, outcome = threading.Event(), threading.Event(), []
    real_extend = engine.target.extend

    def held_extend(*args, **kwargs):                 # the worker's step stops inside the target's call
        if threading.current_thread() is worker:
            entered.set()
            release.wait(30)
        return real_extend(*args, **kwargs)

    def consume():
        try:
            list(s)
            outcome.append("finished")
        except EngineBusyError as exc:
            outcome.append(str(exc))

    monkeypatch.setattr(engine.target, "extend", held_extend)
    worker = threading.Thread(target=consume)
    worker.start()
    assert entered.wait(30)
    threading.Timer(0.3, release.set).start()
    if call == "generate":
        ids = engine.generate(PROMPT, seed=2, **KW).ids
    else:
        engine.close()
    assert release.is_set()                           # it waited for the worker's step
    worker.join(30)
    assert len(outcome) == 1 and "superseded" in outcome[0]   # and the stream ended at its next step
    if call == "generate":
        assert ids == ref[2]


@pytest.mark.parametrize("consume", ["for", "next"])
def test_a_stream_closed_from_another_thread_mid_step_keeps_the_engine_until_the_step_ends(engine, tiny_bundle,
                                                                                         monkeypatch, consume):
    """close() from another thread (a cancel button) while the consumer's step ran gave the engine
    back at once: the next call prefilled caches the old step then wrote to (other output), and with
    next(stream) close() raised "generator already executing" (a review's finds)."""
    ref = _reference(tiny_bundle("gpt2"), [2], **KW)
    s = engine.generate(PROMPT, seed=1, stream=True, **KW)
    entered, release, errors = threading.Event(), threading.Event(), []
    real_extend = engine.target.extend

    def held_extend(*args, **kwargs):                 # the consumer's step stops inside the target's call
        if threading.current_thread() is worker and not release.is_set():
            entered.set()
            release.wait(30)
        return real_extend(*args, **kwargs)

    def run():
        try:
            if consume == "for":
                list(s)
            else:
                while True:
                    next(s)
        except (StopIteration, InvalidArgumentError):  # (next() after close: "the stream was closed")
            pass
        except Exception as exc:
            errors.append(exc)

    monkeypatch.setattr(engine.target, "extend", held_extend)
    worker = threading.Thread(target=run)
    worker.start()
    assert entered.wait(30)
    s.close()                                         # from this thread, while the worker's step runs
    threading.Timer(0.3, release.set).start()
    ids = engine.generate(PROMPT, seed=2, **KW).ids
    assert release.is_set()                           # the call waited for that step
    worker.join(30)
    assert not errors and ids == ref[2]


def test_busy_timeout_counts_from_the_call_while_the_holder_makes_progress(engine, tiny_bundle, monkeypatch):
    """Each step of the holder woke the waiters, and each wake-up restarted the timeout: a call with
    busy_timeout=0.5 waited out a 5 s generation (a review's find)."""
    real_extend = engine.target.extend
    monkeypatch.setattr(engine.target, "extend", lambda *a, **k: (time.sleep(0.03), real_extend(*a, **k))[1])
    started = threading.Event()

    def long_call():
        started.set()
        engine.generate(PROMPT, max_new_tokens=60, temperature=0, use_draft=False)   # about 2 s

    t = threading.Thread(target=long_call)
    t.start()
    started.wait(30)
    time.sleep(0.2)
    engine.busy_timeout = 0.3
    t0 = time.perf_counter()
    try:
        with pytest.raises(EngineBusyError, match="busy with another thread"):
            engine.generate(PROMPT, max_new_tokens=2, temperature=0, use_draft=False)
        assert time.perf_counter() - t0 < 1.0
    finally:
        engine.busy_timeout = None
        t.join(60)


def test_busy_timeout_refuses_clearly(engine, tiny_bundle):
    ref = _reference(tiny_bundle("gpt2"), [3], **KW)
    started, release = threading.Event(), threading.Event()

    def hold():
        s = engine.generate(PROMPT, seed=3, stream=True, **KW)
        it = iter(s)
        next(it)
        started.set()
        release.wait(30)
        s.close()

    t = threading.Thread(target=hold)
    t.start()
    started.wait(30)
    engine.busy_timeout = 0.2
    try:
        with pytest.raises(EngineBusyError, match="busy with another thread"):
            engine.generate(PROMPT, seed=3, **KW)
    finally:
        engine.busy_timeout = None
        release.set()
        t.join(30)
    assert engine.generate(PROMPT, seed=3, **KW).ids == ref[3]


@pytest.mark.parametrize("drafter", ["model", "lookahead"])
@pytest.mark.parametrize("arch", ["gpt2", "t5"])
@pytest.mark.parametrize("how", ["break", "close", "keyboard-interrupt-in-consumer", "keyboard-interrupt-in-model",
                                 "abandoned-iterator", "closed-and-collected-during-the-next"])
def test_interrupted_stream_leaves_the_engine_usable(tiny_bundle, arch, how, drafter):
    """Also with the lookahead drafter, whose worker thread may be drafting when the interrupt comes."""
    bundle = tiny_bundle(arch)
    kw = dict(max_new_tokens=20, temperature=0.9, gamma=3, drafter=drafter)
    fresh = load(bundle, threads=1).generate(PROMPT, seed=5, **kw).ids
    eng = load(bundle, threads=1)
    s = eng.generate(PROMPT, seed=11, stream=True, **kw)
    keep = None
    if how == "break":
        for i, _ in enumerate(s):
            if i == 2:
                break
    elif how == "close":
        it = iter(s)
        next(it), next(it)
        s.close()
        assert list(it) == []
    elif how == "keyboard-interrupt-in-consumer":
        with pytest.raises(KeyboardInterrupt):
            for i, _ in enumerate(s):
                if i == 2:
                    raise KeyboardInterrupt
    elif how == "keyboard-interrupt-in-model":
        real, calls = eng.target.extend, []

        def interrupted(ids):
            calls.append(1)
            if len(calls) == 3:
                raise KeyboardInterrupt
            return real(ids)

        eng.target.extend = interrupted
        with pytest.raises(KeyboardInterrupt):
            list(s)
        del eng.target.extend
    elif how == "closed-and-collected-during-the-next":
        # the closed stream's generator is finalised while a later call runs: its cleanup must
        # not stop the lookahead worker of that call (the seeded text changed)
        import gc

        it = iter(s)
        next(it), next(it)
        s.close()
        got = []
        for i, c in enumerate(eng.generate(PROMPT, seed=5, stream=True, **kw)):
            got += c.ids
            if i == 2:
                del it, s
                gc.collect()
        assert got == fresh
    else:  # the consumer keeps its iterator but never resumes it
        keep = iter(s)
        next(keep)
    assert eng.generate(PROMPT, seed=5, **kw).ids == fresh
    assert [t for c in eng.generate(PROMPT, seed=5, stream=True, **kw) for t in c.ids] == fresh
    del keep


def test_keyboard_interrupt_in_cli_generate(tiny_bundle, monkeypatch, capsys):
    from edgespec import api

    def interrupt(self, *a, **k):
        raise KeyboardInterrupt

    monkeypatch.setattr(api.Engine, "generate", interrupt)
    assert main(["generate", str(tiny_bundle("gpt2")), "--prompt", "x"]) == 130
    err = capsys.readouterr().err
    assert "interrupted" in err and "Traceback" not in err


# A child started from a shell's background job inherits SIGINT ignored, and Python then installs no
# handler for it (a re-sent Ctrl-C would do nothing): these tests give the child the usual one.
_DEFAULT_SIGINT = "import signal; signal.signal(signal.SIGINT, signal.default_int_handler)\n"


def _dropped_signals_exit_codes(setup: str = "") -> None:
    """In a child Python (after ``setup``): a KeyboardInterrupt, then a _Terminated, raised in a
    __del__ while run_script runs a 2-second command; both commands must end with 130 / 143."""
    code = (
        _DEFAULT_SIGINT + setup +
        "import time\n"
        "from edgespec.cli import run_script, _Terminated\n"
        "class Boom:\n"
        "    def __init__(self, exc): self.exc = exc\n"
        "    def __del__(self): raise self.exc()\n"
        "def main(exc):\n"
        "    b = Boom(exc); del b\n"
        "    for _ in range(200): time.sleep(0.01)\n"
        "    return 0\n"
        "print(run_script(lambda: main(KeyboardInterrupt), 'x'), run_script(lambda: main(_Terminated), 'x'))\n")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert proc.stdout.split() == ["130", "143"], proc.stdout + proc.stderr
    assert "x: interrupted" in proc.stderr and "x: terminated" in proc.stderr and "Traceback" not in proc.stderr


def test_a_signal_dropped_inside_a_gc_callback_still_stops_the_command():
    """Python prints and drops an exception raised in a __del__ or gc callback (JAX's, during an
    XLA export): a Ctrl-C or SIGTERM landing there used to be lost and the export ran to the end.
    run_script sends the signal again, so the command still ends with 130 / 143."""
    _dropped_signals_exit_codes()


def test_a_resent_signal_landing_inside_the_hook_is_sent_again():
    """On a loaded machine the hook can still be running when the re-sent signal arrives (starting
    the timer's thread waits for it); Python drops an exception raised in the hook as well, and the
    command ran to its end. Simulated by a timer whose start() keeps the hook busy for 50 ms: the
    signal is sent again, later, until it lands outside the hook."""
    _dropped_signals_exit_codes(
        "import threading, time\n"
        "import edgespec.cli as cli\n"
        "class SlowStart(threading.Timer):\n"
        "    def start(self):\n"
        "        super().start()\n"
        "        time.sleep(0.05)\n"
        "cli.threading = type('T', (), {'Timer': SlowStart, 'Event': threading.Event,\n"
        "                              'current_thread': threading.current_thread, 'main_thread': threading.main_thread})\n")


def test_swap_into_place_rechecks_the_output_at_the_rename(tmp_path, monkeypatch):
    """The output may change while a command works: without --overwrite a folder that appeared is
    never replaced (a user's files, another run's bundle); with it, only an earlier output is; an
    interruption between the two renames puts the previous output back."""
    from edgespec.errors import OutputExistsError
    from edgespec.outputs import check_swap, swap_into_place

    def finished(name):
        new = tmp_path / name
        new.mkdir()
        (new / "edgespec.json").write_text(name)
        return new

    dest = tmp_path / "out"
    swap_into_place(finished("a"), dest, False, "edgespec.json", "a bundle")         # nothing there: renamed
    assert (dest / "edgespec.json").read_text() == "a"
    with pytest.raises(OutputExistsError, match="appeared while this command ran"):  # no --overwrite
        swap_into_place(finished("b"), dest, False, "edgespec.json", "a bundle")
    with pytest.raises(OutputExistsError, match="appeared while this command ran"):  # asked before tidying up
        check_swap(dest, False, "edgespec.json", "a bundle")
    check_swap(dest, True, "edgespec.json", "a bundle")
    assert (dest / "edgespec.json").read_text() == "a" and (tmp_path / "b").exists()
    swap_into_place(tmp_path / "b", dest, True, "edgespec.json", "a bundle")          # --overwrite, a bundle
    assert (dest / "edgespec.json").read_text() == "b"
    notes = tmp_path / "notes"
    notes.mkdir()
    (notes / "mine.txt").write_text("precious")
    with pytest.raises(OutputExistsError, match="not a bundle"):                       # --overwrite, user's files
        swap_into_place(finished("c"), notes, True, "edgespec.json", "a bundle")
    assert (notes / "mine.txt").read_text() == "precious"
    real_replace, calls = os.replace, []

    def interrupted(src, dst):
        calls.append(dst)
        if len(calls) == 2:
            raise KeyboardInterrupt
        return real_replace(src, dst)

    monkeypatch.setattr(os, "replace", interrupted)
    with pytest.raises(KeyboardInterrupt):
        swap_into_place(tmp_path / "c", dest, True, "edgespec.json", "a bundle")
    monkeypatch.undo()
    assert (dest / "edgespec.json").read_text() == "b"                                # put back
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".out.old-")]


def test_a_parent_folder_removed_by_another_failed_export_is_made_again(tmp_path, tiny_checkpoints, monkeypatch):
    """Two exports into new sibling folders share a new parent; one that fails removes the parent it
    made, and the other's work folder then had nowhere to go (a FileNotFoundError traceback)."""
    import tempfile

    from edgespec.export import pipeline

    target, _ = tiny_checkpoints("gpt2")
    out = tmp_path / "new-parent" / "bundle"
    real, calls = tempfile.mkdtemp, []

    def racing(*a, **k):
        if str(k.get("prefix", "")).startswith(".bundle.partial-"):
            calls.append(k["dir"])
            if len(calls) == 1:
                Path(k["dir"]).rmdir()  # the other export's failure, between this one's mkdir and its mkdtemp
        return real(*a, **k)

    monkeypatch.setattr(pipeline.tempfile, "mkdtemp", racing)
    pipeline.export_bundle(target, out, progress=None)
    assert len(calls) == 2 and _loads(out)


def test_an_export_in_another_thread_of_this_process_is_alive(tmp_path):
    """A partial folder with this process's pid belongs to a live export if its token is one of this
    process's exports in progress (a second export to the same output in another thread deleted it)."""
    from edgespec.export import pipeline

    folder = tmp_path / ".b.partial-x"
    folder.mkdir()
    (folder / PARTIAL_MARKER).write_text(json.dumps({"pid": os.getpid(), "host": __import__("socket").gethostname(),
                                                     "token": "t-live"}))
    assert not pipeline._marker_owner_alive(folder)       # no such export here: a leftover
    pipeline._LIVE_EXPORTS.add("t-live")
    try:
        assert pipeline._marker_owner_alive(folder) and not pipeline._is_stale_partial(folder)
    finally:
        pipeline._LIVE_EXPORTS.discard("t-live")


def test_a_stale_unfinished_export_is_removed_only_if_it_holds_nothing_else(tmp_path, tiny_checkpoints):
    """A killed export's own folder at --out is cleared before a new export; one that also holds other
    things is refused, and they stay."""
    from edgespec.errors import OutputExistsError
    from edgespec.export import pipeline

    target, _ = tiny_checkpoints("gpt2")
    out = tmp_path / "b"
    out.mkdir()
    (out / PARTIAL_MARKER).write_text(json.dumps({"pid": 2**22 + 12345, "host": __import__("socket").gethostname(),
                                                  "token": "t-dead"}))  # a pid above Linux's maximum: not running
    (out / "target").mkdir()
    (out / "mine.txt").write_text("keep")
    assert pipeline._is_stale_partial(out)
    with pytest.raises(OutputExistsError, match=r"unfinished export that also holds what an export does not write \(mine.txt\)"):
        pipeline.check_output(out, [target], overwrite=False)
    assert (out / "mine.txt").read_text() == "keep"
    (out / "mine.txt").unlink()
    assert pipeline.check_output(out, [target], overwrite=False) == out.resolve()
    # a live export's folder is named as such (its marker was called a file the user put there)
    (out / PARTIAL_MARKER).write_text(json.dumps({"pid": os.getpid(), "host": __import__("socket").gethostname(),
                                                  "token": "t-live"}))
    pipeline._LIVE_EXPORTS.add("t-live")
    try:
        with pytest.raises(OutputExistsError, match=rf"is being written by another export \(pid {os.getpid()} on \S+: running.*wait for it to finish"):
            pipeline.check_output(out, [target], overwrite=True)
    finally:
        pipeline._LIVE_EXPORTS.discard("t-live")


def test_a_missing_optional_package_names_the_extra_that_installs_it(capsys, monkeypatch):
    """`generate --runtime xla` without the xla extra (and export, distill, train-pair without the
    export one) ended in a ModuleNotFoundError traceback; a missing package of an extra is a
    one-line error naming the pip command. A broken module inside an installed package stays a
    traceback: that is a bug to report, not an install to make."""
    from edgespec.cli import run_script

    def needs(module):
        return lambda: __import__(module)

    for module, extra in (("jax", "xla"), ("torch", "export"), ("transformers.models", "export")):
        monkeypatch.setitem(sys.modules, module.split(".")[0], None)   # as if not installed
        assert run_script(needs(module), "edgespec x") == 2
        err = capsys.readouterr().err
        assert err == (f"edgespec x: error: this needs {module.split('.')[0]}, which edgespec's '{extra}' extra installs: "
                       f"pip install 'edgespec[{extra}]'\n"), err
    for module in ("numpy.no_such_module", "no_such_package"):
        with pytest.raises(ModuleNotFoundError):
            run_script(needs(module), "edgespec x")
