"""`edgespec demo` end to end on the tiny preset (train, export, stream, measure), and
`edgespec bench` on a tiny ONNX bundle: JSON, table and plots are written."""
from __future__ import annotations

import json
import os
import re
from pathlib import Path

import pytest

from edgespec.cli import main
from edgespec.config import SamplingConfig
from edgespec.errors import BundleError, InvalidArgumentError

pytestmark = pytest.mark.slow


def _script(name: str):
    """A benchmarks/ script as a module (they are scripts, not a package; siblings importable)."""
    import importlib.util
    import sys
    from pathlib import Path

    folder = Path(__file__).parents[1] / "benchmarks"
    sys.path.insert(0, str(folder))
    try:
        spec = importlib.util.spec_from_file_location(name, folder / f"{name}.py")
        mod = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(mod)
    finally:
        sys.path.remove(str(folder))
    return mod


def test_demo_end_to_end_on_tiny_preset(tmp_path, monkeypatch, capsys):
    from tiny_models import copy_stdlib_files

    corpus = [str(p) for p in copy_stdlib_files(tmp_path, ("argparse.py", "textwrap.py", "string.py", "heapq.py",
                                                           "shlex.py", "copy.py"))]
    monkeypatch.setenv("EDGESPEC_CACHE", str(tmp_path / "cache"))
    args = ["demo", "--preset", "tiny", "--repeats", "1", "--max-new-tokens", "8", "--corpus", *corpus]
    assert main(args) == 0
    out = capsys.readouterr().out
    for needle in ("alpha (E[sum min(p, q)])", "c (draft step / verify call)", "tokens/s plain",
                   "tokens/s speculative", "Theorem 3.8 predicts", "decode speedup (after 1st tok)",
                   "target bytes read per token", "hardware counters"):
        assert needle in out, needle
    # the default measures gamma 4 and adaptive gamma side by side, at T=0 and T=1
    assert [line.strip() for line in out.splitlines() if line.strip().startswith("temperature ")][::2] == [
        "temperature 0, gamma 4:", "temperature 1, gamma 4:"]
    # (a policy that found plain steps faster on the tiny pair, as under load, prints "auto (nothing drafted)")
    assert out.count(", gamma auto (mean ") + out.count(", gamma auto (nothing drafted)") == 2
    assert "--prompts FILE --max-new-tokens N` for the full grid" in out  # the tiny pair's 32 positions
    # second run reuses the cached pair and bundle; --max-new-tokens' default fits the tiny pair (96 did not)
    assert main([a for a in args if a not in ("--max-new-tokens", "8")]) == 0
    err = capsys.readouterr().err
    assert "reusing the trained pair" in err and "reusing the exported bundle" in err
    # the pair's folder (its bundle included) holds only what train-pair and demo write: --overwrite
    # would not refuse their own output
    from edgespec.outputs import PAIR_FILES, foreign_names

    (pair_dir,) = (tmp_path / "cache" / "pairs").iterdir()
    assert (pair_dir / "bundle" / "target").is_dir() and foreign_names(pair_dir, PAIR_FILES) == []


def test_demo_exports_a_damaged_bundle_again_but_never_deletes_a_users_file(tiny_checkpoints, tmp_path):
    """demo removed a pair's bundle/ with everything in it once it lacked edgespec.json (a user's
    files went with it), gave a traceback when bundle was a file or a link, and a truncated graph's
    data file blocked the re-export for good."""
    import shutil

    from edgespec.demo import ensure_bundle
    from edgespec.errors import OutputExistsError

    pair = tmp_path / "pair"
    for role, src in zip(("target", "draft"), tiny_checkpoints("llama")):
        shutil.copytree(src, pair / role)
    logged = []
    bundle = ensure_bundle(pair, logged.append)
    assert ensure_bundle(pair, logged.append) == bundle and "reusing the exported bundle" in logged[-1]
    with open(bundle / "draft" / "model.onnx", "r+b") as fh:
        fh.truncate(100)
    del logged[:]
    ensure_bundle(pair, logged.append)                              # damaged: exported again
    assert logged[0].startswith("re-exporting: ") and "truncated" in logged[0]
    assert ensure_bundle(pair, logged.append) and "reusing" in logged[-1]
    (bundle / "draft" / "model.onnx").unlink()
    (bundle / "target" / "results.csv").write_text("mine")
    with pytest.raises(OutputExistsError, match=r"also holds what the export did not write \(target/results.csv\); move"):
        ensure_bundle(pair, logged.append)
    (bundle / "edgespec.json").unlink()
    with pytest.raises(OutputExistsError, match="holds files but no edgespec.json.*move it away .or delete it."):
        ensure_bundle(pair, logged.append)
    assert (bundle / "target" / "results.csv").read_text() == "mine" and (bundle / "target" / "model.onnx").is_file()
    shutil.rmtree(bundle)
    bundle.write_text("a file")
    with pytest.raises(OutputExistsError, match="is a file, not the pair's exported bundle: move it away"):
        ensure_bundle(pair, logged.append)
    bundle.unlink()
    bundle.symlink_to(tmp_path)
    with pytest.raises(OutputExistsError, match="is a symbolic link"):
        ensure_bundle(pair, logged.append)
    assert bundle.is_symlink() and tmp_path.is_dir()


def test_bench_writes_table_json_and_plots(tiny_bundle, tmp_path, capsys):
    prompts = tmp_path / "prompts.txt"
    prompts.write_text("the cat\n---\na dog ran")
    assert main(["bench", str(tiny_bundle("llama")), "--gammas", "1,3,auto", "--temperatures", "0,1",
                 "--repeats", "2", "--max-new-tokens", "12", "--prompts", str(prompts), "--quiet",
                 "--out", str(tmp_path / "out")]) == 0
    out = capsys.readouterr().out
    assert "Thm3.8" in out and "model gamma=auto T=1" in out
    data = json.loads((tmp_path / "out" / "bench.json").read_text())
    assert len(data["results"]) == 6 and data["machine"]["cpu_count"] >= 1
    busy = data["other_cpu_load_cores"]  # None where it cannot be told (e.g. a run too short)
    assert busy is None or busy >= 0.0
    for r in data["results"]:
        assert len(r["speedup_all"]) == 2 and r["plain_tokens_per_s"] > 0
        assert r["target_read_reduction"] > 0 and sum(r["accepted_hist"]) > 0
        assert r["verify_cost_steps"] > 0
    for r in (r for r in data["results"] if r["gamma"] == 1):  # every round drafts 1: the formulas in closed form
        e, c, v = r["expected_tokens_per_round"], r["c"], r["verify_cost_steps"]
        assert r["mean_gamma"] == 1 and r["predicted_speedup"] == pytest.approx(e / (c * v + 1))
        assert r["predicted_speedup_verify_cost"] == pytest.approx(e / ((c + 1) * v))
    assert (tmp_path / "out" / "speedup.png").stat().st_size > 1000
    assert (tmp_path / "out" / "accepted_hist.png").stat().st_size > 1000
    assert [v["temperature"] for v in data["adaptive_vs_static"]] == [0.0, 1.0]
    # what reruns it: the command as parsed (it was rebuilt from sys.argv, which a caller of main() does not set), the seed
    assert data["command"].startswith("edgespec bench ") and "--max-new-tokens 12" in data["command"]
    assert data["seed"] == 0 and len(data["prompts_sha256"]) == 64 and data["edgespec"]["version"]
    assert "adaptive gamma / best static gamma" in out


def test_bench_writes_its_report_before_printing(tiny_bundle, tmp_path, monkeypatch):
    """`edgespec bench ... --out DIR | head -1`: the table was printed first, so a reader that went
    away (exit 141) took the whole run with it; bench.json was never written."""
    import sys

    class Closed:
        def write(self, text):
            raise BrokenPipeError(32, "Broken pipe")

        def flush(self):
            pass

    monkeypatch.setattr(sys, "stdout", Closed())
    assert main(["bench", str(tiny_bundle("llama")), "--gammas", "2", "--temperatures", "0", "--repeats", "1",
                 "--max-new-tokens", "4", "--quiet", "--out", str(tmp_path / "r")]) == 141
    assert len(json.loads((tmp_path / "r" / "bench.json").read_text())["results"]) == 1


def test_bench_on_a_full_disk_prints_its_table_and_names_the_file(tiny_bundle, tmp_path, monkeypatch, capsys):
    """A full disk under --out lost the whole measurement (nothing printed), left a partial
    .tmp-*.json and said only "No space left on device" (a review's find)."""
    import errno

    import edgespec.report

    def full(obj, fh, **kw):
        fh.write("{")
        fh.flush()
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(edgespec.report.json, "dump", full)
    out = tmp_path / "r"
    assert main(["bench", str(tiny_bundle("llama")), "--gammas", "2", "--temperatures", "0", "--repeats", "1",
                 "--max-new-tokens", "4", "--quiet", "--out", str(out)]) == 2
    cap = capsys.readouterr()
    assert "gamma=2 T=0" in cap.out                     # the table
    assert f"No space left on device: {str(out / 'bench.json')!r}" in cap.err
    assert os.listdir(out) == []                        # no partial temporary file


def test_bench_lookahead_drafter_side_by_side(tiny_bundle, tmp_path, capsys, monkeypatch):
    """--draft model,lookahead: both drafters measured in one run; draft reads counted for both;
    a bad drafter name is a clean error."""
    (tmp_path / "o").mkdir()
    (tmp_path / "o" / "speedup.png").write_text("an earlier run's plot")  # (kept beside this run's bench.json
    (tmp_path / "o" / "notes.txt").write_text("mine")                      # when plotting was interrupted)
    import edgespec.bench

    monkeypatch.setattr(edgespec.bench, "plot", lambda rows, out: None)  # no matplotlib: no plots
    assert main(["bench", str(tiny_bundle("llama")), "--gammas", "3", "--temperatures", "0", "--draft", "model,lookahead",
                 "--repeats", "1", "--max-new-tokens", "10", "--quiet", "--out", str(tmp_path / "o")]) == 0
    assert sorted(os.listdir(tmp_path / "o")) == ["bench.json", "notes.txt"]
    data = json.loads((tmp_path / "o" / "bench.json").read_text())
    assert [r["draft"] for r in data["results"]] == ["model", "lookahead"]
    assert all(r["draft_bytes_per_token_spec"] > 0 for r in data["results"])
    assert "lookahead gamma=3 T=0" in capsys.readouterr().out
    assert main(["bench", str(tiny_bundle("llama")), "--draft", "model,ahead"]) == 2
    assert "--draft takes" in capsys.readouterr().err


def test_bench_says_when_no_round_was_drafted(tiny_bundle, tmp_path, capsys, monkeypatch):
    """Where the adaptive policy took plain steps throughout, bench said "85% of the tokens came from
    plain target steps (...; the theory columns describe the drafted rounds)": there were none (the
    other 15% were each prompt's first token)."""
    from edgespec.adaptive import AdaptiveGamma

    monkeypatch.setattr(AdaptiveGamma, "draft_next", lambda self: False)
    assert main(["bench", str(tiny_bundle("llama")), "--gammas", "2,auto", "--temperatures", "0", "--repeats", "1",
                 "--max-new-tokens", "6", "--quiet", "--out", str(tmp_path / "o")]) == 0
    out = capsys.readouterr().out
    assert "gamma=auto T=0: no round was drafted" in out and not re.search(r"auto T=0: \d+% of the tokens", out), out


def test_bench_lenience_at_greedy_and_plain_steps_of_static_lookup(tiny_bundle, tmp_path, capsys):
    """Lenience is ignored at T=0, so T=0 l=0.5 was a copy of T=0 measured again, with its own
    adaptive-vs-static line (noise shown as a result); a static prompt-lookup row took plain steps
    without the note adaptive rows get."""
    base = ["bench", str(tiny_bundle("llama")), "--repeats", "1", "--max-new-tokens", "8", "--quiet"]
    assert main([*base, "--gammas", "2", "--temperatures", "0,1", "--lenience", "1,0.5", "--out", str(tmp_path / "l")]) == 0
    cap = capsys.readouterr()
    assert "lenience has no effect at temperature 0" in cap.err
    rows = json.loads((tmp_path / "l" / "bench.json").read_text())["results"]
    assert [(r["temperature"], r["lenience"]) for r in rows] == [(0.0, 1.0), (1.0, 1.0), (1.0, 0.5)]
    assert main([*base, "--lenience", "1.5"]) == 2 and "--lenience takes values in (0, 1]" in capsys.readouterr().err
    assert main([*base, "--gammas", "3", "--temperatures", "0", "--draft", "ngram", "--out", str(tmp_path / "n")]) == 0
    out = capsys.readouterr().out
    row = json.loads((tmp_path / "n" / "bench.json").read_text())["results"][0]
    share, causes = row["plain_step_share"], row["plain_step_causes"]
    assert share > 0.05 and causes["nothing_drafted"] > 0 and causes["adaptive_policy"] == 0, row
    assert sum(causes.values()) == pytest.approx(share)  # each plain step has one cause
    assert re.search(r"came from plain target steps \((\d+% [a-z :',]+, )?\d+% lookups that found nothing", out), out


def test_read_counter_counts_the_cross_attention_reads_of_an_encoder_decoder():
    """A T5 decoder call reads the prompt's cross-attention KV too (they were not counted); XLA's
    artifacts read their whole buffers: max_length self positions, max_prompt_length cross ones."""
    from edgespec.measure import ReadCounter

    class Fake:
        vocab_size, max_length, max_prompt_length, length = 10, 64, 40, 0

        def __init__(self, seq2seq):
            self.is_encoder_decoder = seq2seq

        def prefill(self, ids):
            self.length = 1  # (T5: the start token)

        def extend(self, ids):
            self.length += len(ids)

    for seq2seq, static, want in ((True, None, (0 + 7) + (1 + 7)), (False, None, 0 + 1), (True, 64, (64 + 40) * 2)):
        rc = ReadCounter(Fake(seq2seq), 100, 1, static)
        rc.prefill([5] * 7)
        rc.extend([1, 2])
        assert (rc.calls, rc.weight_read, rc.kv_read) == (2, 200, want), (seq2seq, static)


def test_settings_run_side_by_side_with_a_shared_plain_run(monkeypatch):
    """run_settings: per prompt, one plain run and every setting of the same sampling back to
    back, the order rotating; one plain tokens/s per repeat shared by the group; ratios same-run."""
    import numpy as np

    from edgespec import measure
    from edgespec.config import SamplingConfig
    from edgespec.measure import ReadCounter, Setting, adaptive_vs_static, run_settings
    from edgespec.toy import toy_pair

    target, draft = toy_pair(vocab_size=40, order=3, noise=1.0, seed=2, max_length=256)
    calls = []
    real = measure.generate

    def spy(tb, prompt, cfg, rng, drafter=None, policy=None):
        calls.append((cfg.sampling.temperature, "plain" if drafter is None else cfg.gamma, tuple(prompt)))
        return real(tb, prompt, cfg, rng, drafter, policy=policy)

    monkeypatch.setattr(measure, "generate", spy)
    settings = [Setting(g, SamplingConfig(t)) for t in (0.0, 1.0) for g in (2, 4, None)]
    prompts = [[1, 2, 3], [4, 5], [6]]
    res = run_settings(ReadCounter(target, 100, 1), ReadCounter(draft, 10, 1), prompts, settings,
                       max_new_tokens=10, repeats=2, warmup=1)
    assert len(calls) == 2 * 3 * 3 * 4          # temperatures x repeats (warm-up too) x prompts x (plain + 3)
    for k in range(0, len(calls), 4):           # each prompt: plain and the three settings, back to back
        block = calls[k:k + 4]
        assert {c[1] for c in block} == {"plain", 2, 4, None} and len({c[2] for c in block}) == 1
    assert len({calls[k][1] for k in range(0, len(calls), 4)}) == 4  # who goes first rotates
    for group in (res[:3], res[3:]):
        assert all(r.plain_tps == group[0].plain_tps and len(r.plain_tps) == 2 for r in group)
        for r in group:
            assert r.ratios == [s / p for s, p in zip(r.spec_tps, r.plain_tps)]
            # (adaptive gamma prices rounds with timed calls: on a loaded machine it may take plain steps only)
            reduction = r.summary()["target_read_reduction"]
            assert reduction > 1 if r.setting.gamma else reduction >= 1
    versus = adaptive_vs_static(res)
    assert [v["temperature"] for v in versus] == [0.0, 1.0]
    for v, group in zip(versus, (res[:3], res[3:])):
        best = max(group[:2], key=lambda r: np.median(r.spec_tps))
        assert v["best_static_gamma"] == best.setting.gamma
        assert v["all"] == [a / b for a, b in zip(group[2].spec_tps, best.spec_tps)]


def test_decode_rate_excludes_the_first_token(monkeypatch):
    """The decode rate of a repeat is (tokens - first tokens) / (seconds - time to first token),
    summed over the prompts, for plain and speculative runs alike; decode_speedup is their ratio."""
    import types

    from edgespec import measure
    from edgespec.config import SamplingConfig
    from edgespec.measure import ReadCounter, Setting, run_settings
    from edgespec.toy import toy_pair

    target, draft = toy_pair(vocab_size=40, order=3, noise=1.0, seed=2, max_length=256)
    clock = [0.0]
    monkeypatch.setattr(measure, "time", types.SimpleNamespace(perf_counter=lambda: clock[0]))
    real = measure.generate

    def timed(tb, prompt, cfg, rng, drafter=None, policy=None):
        r = real(tb, prompt, cfg, rng, drafter, policy=policy)
        # a made-up clock: plain runs take 0.1 s per token, speculative 0.04 s; the first token 0.5 s
        r.stats.ttft_s = 0.5
        clock[0] += 0.5 + (0.1 if drafter is None else 0.04) * (len(r.tokens) - 1)
        return r

    monkeypatch.setattr(measure, "generate", timed)
    res = run_settings(ReadCounter(target, 100, 1), ReadCounter(draft, 10, 1), [[1, 2, 3], [4, 5]],
                       [Setting(3, SamplingConfig(0.0))], max_new_tokens=10, repeats=2, warmup=1)
    s = res[0].summary()
    assert s["plain_decode_tokens_per_s"] == pytest.approx(10.0)
    assert s["spec_decode_tokens_per_s"] == pytest.approx(25.0)
    assert s["decode_speedup"] == pytest.approx(2.5)
    # end to end, the same 0.5 s first token weighs on both: 20 tokens in 1.0 + 1.8 s against 1.0 + 0.72 s
    assert s["speedup"] == pytest.approx(2.8 / 1.72)


def test_verify_cost_is_verify_call_over_plain_step():
    from edgespec.config import SamplingConfig
    from edgespec.loop import GenerationStats
    from edgespec.measure import Setting, SettingResult
    from edgespec.theory import speedup

    st = GenerationStats(target_calls=11, target_s=0.15, draft_calls=40, draft_s=0.012, beta_sum=32.0, beta_count=40)
    res = SettingResult(Setting(gamma=4, sampling=SamplingConfig(0.0)), stats=[st], plain_step=[0.2, 20])
    r = res.summary()
    assert r["verify_cost_steps"] == pytest.approx(0.015 / 0.010)   # 15 ms per verify call, 10 ms per plain step
    assert r["c"] == pytest.approx(0.0003 / 0.015)
    # Theorem 3.8 takes the paper's c, a draft step over a plain target step (0.3 ms / 10 ms = c V), as
    # `edgespec plan` does; it took c (over a verify call) and so predicted more than plan for the same run
    assert r["predicted_speedup"] == pytest.approx(speedup(0.8, 4, 0.03))
    assert r["predicted_speedup_verify_cost"] == pytest.approx(speedup(0.8, 4, 0.02) / 1.5)


def test_theory_columns_use_the_gamma_the_rounds_drafted():
    """A static gamma the loop could not draft (too few tokens left) is not what the theory sees,
    and rounds of different gammas (adaptive gamma, prompt lookup) each count with their own: the
    mean gamma put into the formulas is not the mean of the formulas (a trial saw 'theory' 5.00
    tokens per round at alpha 1 from round(5.5))."""
    from edgespec.config import SamplingConfig
    from edgespec.loop import GenerationStats
    from edgespec.measure import Setting, SettingResult
    from edgespec.theory import expected_tokens

    def stats(hist):
        rounds, drafted = sum(hist), sum(g * n for g, n in enumerate(hist))
        return GenerationStats(target_calls=rounds + 1, target_s=0.15, draft_calls=drafted, draft_s=0.012,
                               beta_sum=0.8 * drafted, beta_count=drafted, rounds=rounds, drafted=drafted,
                               round_tokens=drafted, gamma_hist=hist)

    seven = stats([0] * 7 + [10])
    for gamma in (100, 7, None):
        r = SettingResult(Setting(gamma=gamma, sampling=SamplingConfig(0.0)), stats=[seven], plain_step=[0.2, 20]).summary()
        assert r["expected_tokens_per_round"] == pytest.approx(expected_tokens(0.8, 7)), gamma
    mixed = stats([0, 0, 0, 5, 0, 0, 5])  # five rounds of 3 drafts, five of 6 (mean 4.5)
    r = SettingResult(Setting(gamma=None, sampling=SamplingConfig(0.0)), stats=[mixed], plain_step=[0.2, 20]).summary()
    e3, e6 = expected_tokens(0.8, 3), expected_tokens(0.8, 6)
    assert r["expected_tokens_per_round"] == pytest.approx((e3 + e6) / 2)
    c = r["c"] * r["verify_cost_steps"]  # the paper's c
    assert r["predicted_speedup"] == pytest.approx((e3 + e6) / ((3 * c + 1) + (6 * c + 1)))


def test_bench_bad_input(tiny_bundle, tmp_path, capsys):
    assert main(["bench", str(tiny_bundle("llama")), "--gammas", "x"]) == 2
    assert main(["bench", str(tmp_path / "nope")]) == 2
    err = capsys.readouterr().err
    assert "--gammas" in err and "Traceback" not in err
    latin = tmp_path / "latin.txt"
    latin.write_bytes(b"the fox \xff\xfe\n---\none two\n")
    for extra, needle in ((["--prompts", str(latin)], "is not UTF-8 text"), (["--gammas", ""], "--gammas is empty"),
                          (["--temperatures", " , "], "--temperatures is empty"),
                          (["--gammas", "1,2,1"], "lists a value twice"), (["--gammas", "2,,3"], "has an empty item ('2,,3'); separate values with single commas: 2,3"),
                          (["--temperatures", "0,"], "--temperatures has an empty item"),
                          # the sampling config's own message named generate's --temperature
                          (["--temperatures", "0,-1"], "--temperatures takes finite numbers >= 0 (0 = greedy); got '0,-1'"),
                          (["--temperatures", "nan"], "--temperatures takes finite numbers")):
        assert main(["bench", str(tiny_bundle("llama")), "--repeats", "1", *extra]) == 2, extra
        err = capsys.readouterr().err
        assert needle in err and "Traceback" not in err, (extra, err)
    # a length error names the knob that fixes it: the prompts, the new tokens, or either
    long = tmp_path / "long.txt"
    long.write_text("the cat sat on the mat " * 60)
    base = ["--repeats", "1", "--gammas", "2", "--temperatures", "0"]
    for bundle, extra, fix in (("llama", ["--prompts", str(long)], f"a prompt of {long}: pass --prompts FILE with shorter prompts)"),
                               ("t5", ["--max-new-tokens", "600"], "positions; lower max_new_tokens to at most 512 (lower --max-new-tokens)"),
                               ("llama", ["--max-new-tokens", "120"], "shorter prompts, or lower --max-new-tokens)")):
        assert main(["bench", str(tiny_bundle(bundle)), *base, *extra]) == 2, extra
        assert capsys.readouterr().err.strip().endswith(fix), extra


def test_bench_refuses_flags_that_do_nothing_and_a_draft_too_short(tiny_bundle, tmp_path, capsys):
    """As generate does: flags with no effect are refused, and a prompt longer than the draft
    model's positions is named as such (it surfaced as the draft backend's error, whose fix,
    fewer new tokens, could not help)."""
    from edgespec.export.pipeline import export_bundle
    from tiny_models import make_llama

    base = ["--gammas", "2", "--temperatures", "0", "--repeats", "1", "--max-new-tokens", "4", "--quiet"]
    for extra, needle in ((["--draft", "ngram", "--draft-threads", "2"], "--draft ngram uses no draft model: --draft-threads"),
                          (["--runtime", "xla", "--spin", "on"], "--spin configures ONNX Runtime")):
        assert main(["bench", str(tiny_bundle("llama")), *base, *extra]) == 2, extra
        assert needle in capsys.readouterr().err, extra
    t = make_llama(tmp_path / "t", seed=1, max_positions=128)
    d = make_llama(tmp_path / "d", seed=2, layers=1, vocab_size=80, max_positions=16)
    from edgespec.errors import EdgeSpecWarning

    with pytest.warns(EdgeSpecWarning, match="the draft takes 16 positions and the target 128"):  # export says so
        export_bundle(t, tmp_path / "b", draft=d, progress=None)
    prompts = tmp_path / "p.txt"
    prompts.write_text("the cat sat on the mat and the dog sat on the log " * 2)
    assert main(["bench", str(tmp_path / "b"), "--prompts", str(prompts), *base]) == 2
    assert "but the draft model takes at most 15 (the last of its 16 positions is for the token it reads to draft)" \
        in capsys.readouterr().err
    assert main(["bench", str(tmp_path / "b"), "--prompts", str(prompts), *base, "--draft", "ngram"]) == 0


def test_bench_prompt_file_separators(tmp_path):
    from edgespec.bench import read_prompts

    f = tmp_path / "p.txt"
    for text, prompts in (("---\nfoo\n---\nbar", ["foo", "bar"]), ("foo\n  ---  \nbar\n---", ["foo", "bar"]),
                          ("a\n\nb\n---\n\nc\n", ["a\n\nb", "c"]), ("only one", ["only one"])):
        f.write_text(text)
        assert read_prompts(f) == prompts, text
    for text in ("---\n---\n", "", "\n\n"):
        f.write_text(text)
        with pytest.raises(InvalidArgumentError, match="holds no prompt"):
            read_prompts(f)
    import warnings

    from edgespec.errors import EdgeSpecWarning

    with warnings.catch_warnings():
        warnings.simplefilter("error")   # a --- before the first prompt or after the last: no warning (above too)
        assert read_prompts(f.write_text("---\nfoo\n---\n\n") and f) == ["foo"]
    f.write_text("foo\n---\n   \n---\nbar\n---\n\n---\nbaz\n---\n")  # blank prompts between others were dropped silently
    with pytest.warns(EdgeSpecWarning, match=r"2 blank prompts between '---' lines skipped; measuring the other 3$"):
        assert read_prompts(f) == ["foo", "bar", "baz"]


def _exit_code(argv) -> int:
    """The CLI's exit status: main's return value, or argparse's for a usage error (SystemExit)."""
    try:
        return main(argv)
    except SystemExit as exc:
        return exc.code


def test_demo_says_when_speculation_loses_and_what_adaptive_gamma_did(capsys):
    """A fixed gamma slower than plain decoding: the demo says so, with the verify cost, and points
    to adaptive gamma; an adaptive row reports the share of tokens from plain steps."""
    from edgespec.demo import _print_row

    nan = float("nan")
    base = dict(temperature=1.0, alpha=0.6, c=0.1, tokens_per_round=2.0, expected_tokens_per_round=2.1,
                plain_tokens_per_s=2000.0, spec_tokens_per_s=1600.0, predicted_speedup=1.6, decode_speedup=0.8,
                plain_ttft_s=0.003, spec_ttft_s=0.003, verify_cost_steps=2.04, mean_gamma=nan, plain_step_share=0.004)
    _print_row({**base, "gamma": 4, "speedup": 0.8, "speedup_all": [0.79, 0.8, 1.1]})
    out = capsys.readouterr().out
    assert "(per repeat: 0.79, 0.80, 1.10)" in out  # a median of per-repeat ratios, not of the tok/s above
    assert "slower than plain decoding here: a verify call cost 2.04 plain steps" in out and "--gamma auto" in out
    _print_row({**base, "gamma": 4, "speedup": 0.8}, auto_shown=True)
    assert "takes plain steps where drafting loses: the gamma auto row at this temperature" in capsys.readouterr().out
    _print_row({**base, "gamma": 4, "speedup": 1.3})
    assert "slower" not in capsys.readouterr().out
    causes = {"adaptive_policy": 0.8, "nothing_drafted": 0.0, "no_room": 0.08}
    _print_row({**base, "gamma": None, "speedup": 0.93, "mean_gamma": 1.2, "plain_step_share": 0.88,
                "plain_step_causes": causes})
    out = capsys.readouterr().out
    assert "gamma auto (mean 1.2)" in out and "slower" not in out
    # what the plain steps were for, not "faster than drafted rounds here" whatever the cause
    assert ("plain target steps             88% of the tokens (80% the adaptive policy finding them faster than "
            "drafted rounds, 8% no room to draft") in out, out
    _print_row({**base, "gamma": None, "speedup": 0.9, "plain_step_share": 0.875,
                "plain_step_causes": {"adaptive_policy": 0.875, "nothing_drafted": 0.0, "no_room": 0.0}})
    out = capsys.readouterr().out
    assert "gamma auto (nothing drafted)" in out and "mean nan" not in out, out
    _print_row({**base, "gamma": 4, "speedup": 0.96, "predicted_speedup": nan, "decode_speedup": nan,
                "verify_cost_steps": nan})  # no round drafted (--max-new-tokens 1)
    out = capsys.readouterr().out  # a ratio not measured is n/a, not "n/ax"
    assert "n/ax" not in out and "predicts n/a" in out and "decode speedup (after 1st tok) n/a " in out, out
    assert "verify call cost n/a" not in out and "slower" not in out, out  # (both ran plain steps only)


def test_demo_checks_its_options_before_training(monkeypatch, capsys):
    import edgespec.pair

    monkeypatch.setattr(edgespec.pair, "train_pair", lambda *a, **k: pytest.fail("trained before checking the options"))
    for extra, needle in ((["--gamma", "foo"], "--gamma"), (["--gamma", "0"], "--gamma"),
                          (["--gamma", "4,4"], "--gamma lists a value twice"), (["--gamma", "3,x"], "--gamma"), (["--repeats", "0"], "--repeats"),
                          (["--max-new-tokens", "0"], "--max-new-tokens"), (["--threads", "-1"], "--threads"),
                          (["--repeats", "2.5"], "--repeats: expected an integer"),
                          (["--preset", "bogus"], "argument --preset: invalid choice: 'bogus'"),
                          (["--preset", "tiny", "--max-new-tokens", "32"], "in the tiny pair's 32 positions")):
        assert _exit_code(["demo", *extra]) == 2, extra
        err = capsys.readouterr().err
        assert needle in err and "Traceback" not in err and "step 1/4" not in err, (extra, err)


def test_toy_refuses_tables_too_large_for_memory(capsys):
    for extra, needle in ((["--vocab", "100000", "--order", "3"], "keep vocab ** order"),
                          (["--max-new-tokens", "100000000000"], "--max-new-tokens must be in")):
        assert main(["toy", *extra]) == 2
        err = capsys.readouterr().err
        assert needle in err and "Traceback" not in err


def test_adaptive_bound_replays_a_greedy_trace(tiny_checkpoints, tmp_path):
    """benchmarks/adaptive_bound.py runs on a bundle; its replay agrees with the real loop on how
    many target calls a static gamma needs (the trace replay is exact at temperature 0)."""
    import numpy as np

    import edgespec

    ab = _script("adaptive_bound")
    # a draft that agrees with the target often but not always: the target with noisy weights
    import shutil

    import torch
    from safetensors.torch import load_file, save_file

    from edgespec.export.pipeline import export_bundle
    target, _ = tiny_checkpoints("llama")
    noisy = tmp_path / "noisy-draft"
    shutil.copytree(target, noisy)
    weights = load_file(noisy / "model.safetensors")
    gen = torch.Generator().manual_seed(0)
    save_file({k: v + 0.4 * v.std() * torch.randn(v.shape, generator=gen) if v.ndim == 2 else v
               for k, v in weights.items()}, noisy / "model.safetensors")
    bundle = tmp_path / "bundle"
    export_bundle(target, bundle, draft=noisy, progress=None)
    eng = edgespec.load(bundle, threads=1)
    ids = [5, 9, 13, 22, 31, 7]
    tr = ab.trace(eng, [ids], 30, eng.vocab_size)
    assert 0.2 < np.mean(tr[0]["match"]) < 0.95  # some drafts kept, some not
    # replay with unit costs counts target calls per emitted token: compare with the loop's own count
    for gamma in (1, 3):
        real = eng.generate(ids, max_new_tokens=30, temperature=0, gamma=gamma).stats
        rate = ab.replay(tr, gamma, 0.0, lambda k: 1.0)           # tokens per target call
        n = len(tr[0]["match"])
        assert real.emitted == n and real.target_calls - 1 == round(n / rate), gamma  # prefill call excluded
    # the richer predictors run on real traces (one fitted, the other replayed)
    vocab = eng.vocab_size
    cal = ab.trace(eng, [[3, 8, 1, 4], [11, 12, 2], [40, 41]], 30, vocab)
    rows = ab.predictor_rows(cal, tr, vocab, 0.05, lambda k: 1.0 + 0.1 * (k - 1))
    assert len(rows) == 3 and all(np.isfinite(held) and held > 0 for _, held, _ in rows)
    out = tmp_path / "ab"
    assert ab.main([str(bundle), "--out", str(out), "--new-tokens", "16"]) == 0
    data = json.loads((out / "adaptive_bound.json").read_text())
    assert data["best_static_gamma"] in range(1, 11)
    assert all(np.isfinite(v) and v > 0 for v in data["policies"].values())


def test_adaptive_bound_predictors_learn_a_signal_that_decides_the_outcome():
    """Synthetic traces where the draft's confidence tells exactly which drafts are kept (0.9: kept,
    0.05: rejected): every predictor, fitted on one trace and replayed on another, must stop where
    the oracle stops (plus the one rejected draft it has to see) and beat every static gamma."""
    import numpy as np

    ab = _script("adaptive_bound")

    def trace(seed: int) -> list[dict]:
        rng = np.random.default_rng(seed)
        out = []
        for _ in range(6):
            match = rng.random(300) < 0.85
            conf = np.where(match, 0.9, 0.05)
            out.append({"match": match.tolist(), "conf": conf.tolist(), "second": (conf / 10).tolist(),
                        "entropy": (1 - conf).tolist(), "token": rng.integers(0, 50, 300).tolist(),
                        "prev": rng.integers(0, 50, 300).tolist()})
        return out

    cal, test = trace(0), trace(1)
    t_draft, t_target = 0.02, (lambda k: 1.0 + 0.1 * (k - 1))
    best_static = max(ab.replay(test, g, t_draft, t_target) for g in range(1, 17))
    # the oracle drafts exactly the kept run; a policy must also draft (and pay for) the rejected token
    near_oracle = ab.oracle(test, 16, t_draft, t_target) * 0.9
    for name, held, _ in ab.predictor_rows(cal, test, 50, t_draft, t_target):
        assert held > best_static and held > near_oracle, (name, held, best_static, near_oracle)
        assert "AUC 1.000" in name, name


def test_adaptive_bound_regime_policy_follows_the_recent_keep_rate():
    """A synthetic trace whose drafts all have the same confidence, kept in long easy stretches and
    rarely in hard ones: the confidence says nothing, the recent keep rate says everything. The
    regime-split policy must beat the shipped one there; with its split out of reach (always one
    regime) it must be the shipped policy (a mutant check of the regime switch)."""
    import numpy as np

    from edgespec.adaptive import AdaptiveGamma

    ab = _script("adaptive_bound")
    rng = np.random.default_rng(0)
    easy = np.repeat(np.arange(40) % 2 == 0, 150)                       # [6000] stretches of 150 positions
    match = np.where(easy, rng.random(easy.size) < 0.97, rng.random(easy.size) < 0.3)
    tr = [{"match": match.tolist(), "conf": [0.5] * easy.size}]
    t_draft, t_target = 0.02, (lambda k: 1.0 + 0.1 * (k - 1))
    shipped = ab.replay(tr, 8, t_draft, t_target, policy=lambda: AdaptiveGamma(8), shared=True)
    regime = ab.replay(tr, 8, t_draft, t_target, policy=lambda: ab.RegimeAdaptive(8), shared=True)
    assert regime > 1.05 * shipped, (regime, shipped)
    one_regime = ab.replay(tr, 8, t_draft, t_target, policy=lambda: ab.RegimeAdaptive(8, split=-1.0), shared=True)
    assert one_regime == shipped


def test_adaptive_bound_logistic_and_auc():
    """The predictor helpers of benchmarks/adaptive_bound.py: AUC of a perfect, a reversed and a
    useless score; the logistic fit recovers a known keep probability."""
    import numpy as np

    ab = _script("adaptive_bound")
    y = np.array([False, False, True, True])
    assert ab.auc(np.array([0.1, 0.2, 0.3, 0.4]), y) == 1.0
    assert ab.auc(np.array([0.4, 0.3, 0.2, 0.1]), y) == 0.0
    assert ab.auc(np.ones(4), y) == 0.5
    rng = np.random.default_rng(0)
    x = rng.normal(size=20000)
    truth = 1 / (1 + np.exp(-(2 * x - 1)))
    fit = ab.fit_logistic(np.stack([x, np.ones_like(x)], 1), (rng.random(x.shape) < truth).astype(float))
    grid = np.linspace(-2, 2, 9)
    assert np.abs(fit(np.stack([grid, np.ones_like(grid)], 1)) - 1 / (1 + np.exp(-(2 * grid - 1)))).max() < 0.03


def test_acceptance_signals_binned_r2_and_collect(tiny_bundle, capsys):
    """benchmarks/acceptance_signals.py: the binned R^2 is ~1 for a signal that determines the keep
    probability and ~0 for one independent of it; on a real bundle every a(x) is a probability."""
    from pathlib import Path

    import numpy as np

    import edgespec

    mod = _script("acceptance_signals")
    rng = np.random.default_rng(0)
    s = rng.random(20000)
    assert mod.binned_r2(np.floor(s * 10) / 10, s)[0] > 0.99
    assert abs(mod.binned_r2(rng.random(20000), s)[0]) < 0.01
    eng = edgespec.load(tiny_bundle("llama"), threads=1)
    data = mod.collect(eng, [[5, 9, 13], [7, 2]], 12, 1.0, 3, 0)
    assert 0 < data["a"].size <= 2 * 12 * 3 and data["a"].size % 3 == 0 and ((data["a"] >= 0) & (data["a"] <= 1)).all()
    assert ((data["q_x"] > 0) & (data["q_x"] <= data["max_q"] + 1e-12)).all()
    from edgespec.cli import run_script  # as the script's __main__ runs it: a clean error, no traceback

    assert run_script(lambda: mod.main([str(Path("/nonexistent/bundle")), "--out", "unused"]), "acceptance_signals.py") == 2
    assert "acceptance_signals.py: error: bundle folder" in capsys.readouterr().err


def test_plot_says_when_matplotlib_is_missing(monkeypatch, tmp_path):
    import sys

    from edgespec.report import plot

    monkeypatch.setitem(sys.modules, "matplotlib", None)   # import matplotlib now raises ImportError
    assert plot([], tmp_path) is None


def test_bench_checks_out_first_and_iqr_stays_in_the_data(tiny_bundle, tmp_path, capsys):
    from edgespec.measure import _iqr

    lo, hi = _iqr([1.222, 1.309])
    assert 1.222 <= lo <= hi <= 1.309                         # "exclusive" quantiles extrapolated: 1.200-1.331
    afile = tmp_path / "afile"
    afile.write_text("x")
    assert main(["bench", str(tiny_bundle("llama")), "--gammas", "2", "--temperatures", "0", "--repeats", "1",
                 "--max-new-tokens", "4", "--out", str(afile)]) == 2
    err = capsys.readouterr().err
    assert "is a file" in err and "[bench]" not in err and "Traceback" not in err   # refused before measuring
    for extra in (["--repeats", "0"], ["--max-new-tokens", "0"]):
        assert _exit_code(["bench", str(tiny_bundle("llama")), "--gammas", "2", *extra]) == 2
        err = capsys.readouterr().err
        assert f"{extra[0]}: must be >= 1, got 0" in err and "[bench]" not in err and "Traceback" not in err


@pytest.mark.parametrize("name,args", [
    ("acceptance_signals", ["B"]), ("adaptive_bound", ["B"]), ("call_width", ["B"]), ("lookup_agreement", ["B"]),
    ("verify_width", []), ("int8_rows", []), ("graphs", ["--static", "B", "--concat", "B"]),
    ("paper_tables", ["--pair", "B"]), ("huge_pages_ab", ["B"]), ("runtimes", ["--bundle", "B"]),
    ("peers", ["--pair", "B"])])
def test_benchmark_scripts_refuse_a_file_as_out_before_measuring(name, args, tmp_path, monkeypatch):
    """A file given as --out was found only when the results were written, after the measurement
    (a traceback, the run lost; a trial's find): each script refuses it first, with a typed error."""
    import sys

    from edgespec.errors import OutputPathError

    afile = tmp_path / "afile"
    afile.write_text("x")
    argv = [str(tmp_path / "missing") if a == "B" else a for a in args] + ["--out", str(afile)]
    monkeypatch.setattr(sys, "argv", [f"{name}.py", *argv])   # (some scripts parse sys.argv)
    main_ = _script(name).main
    with pytest.raises(OutputPathError, match="is a file; give a folder"):
        main_(argv) if "argv" in main_.__code__.co_varnames[:main_.__code__.co_argcount] else main_()


def test_pair_scripts_refuse_a_bundle_as_the_pair(tmp_path, monkeypatch):
    """paper_tables.py and peers.py take a trained pair; a bundle (whose target/ has a config.json
    too) went on to an export that failed on missing safetensors (a trial's find)."""
    import sys

    pair = tmp_path / "pair"
    (pair / "bundle" / "target").mkdir(parents=True)
    (pair / "pair.json").write_text("{}")
    (pair / "bundle" / "edgespec.json").write_text("{}")
    (pair / "bundle" / "target" / "config.json").write_text("{}")
    argv = ["--pair", str(pair / "bundle"), "--out", str(tmp_path / "out")]
    monkeypatch.setattr(sys, "argv", ["peers.py", *argv])
    for run in (lambda: _script("paper_tables").main(argv), lambda: _script("peers").main()):
        with pytest.raises(InvalidArgumentError, match=f"is an exported bundle, not a trained pair.*pair is '{pair}'"):
            run()


def test_int8_rows_script_shows_which_scheme_is_causal(tmp_path, monkeypatch):
    """benchmarks/int8_rows.py on small weights: the target schemes' row 0 ignores a change in a
    later row (rowwise: and equals a 1-row call's), the dynamic (draft) scheme's does not."""
    mod = _script("int8_rows")
    monkeypatch.setattr(mod, "K", 128)
    monkeypatch.setattr(mod, "N", 256)
    assert mod.main(["--calls", "2", "--out", str(tmp_path)]) == 0
    res = json.loads((tmp_path / "int8_rows.json").read_text())["results"]
    assert res["int8 rowwise (targets)"]["row0_when_last_row_changes"] == 0.0
    assert res["int8 rowwise (targets)"]["row0_1_vs_k"] == 0.0
    assert res["int8 blockwise (targets before 2026-11-30)"]["row0_when_last_row_changes"] == 0.0
    assert res["fp32"]["row0_when_last_row_changes"] == 0.0
    assert res["int8 dynamic (drafts)"]["row0_when_last_row_changes"] > 1e-3


@pytest.mark.parametrize("arch", ["llama", "t5"])
def test_call_width_script(tiny_bundle, tmp_path, monkeypatch, arch):
    """benchmarks/call_width.py on a tiny fp32 bundle: 1-token and 3-token calls agree to kernel
    rounding (in one call and along the sequence), an earlier row ignores a change in a later one,
    and greedy speculative output equals plain decoding (the tiny models have no near-ties)."""
    import edgespec.prompts

    mod = _script("call_width")

    monkeypatch.setattr(edgespec.prompts, "CODE_PROMPTS", ("def f(x):", "ab cd"))
    assert mod.main([str(tiny_bundle(arch)), "--width", "3", "--max-new-tokens", "10", "--out", str(tmp_path)]) == 0
    res = json.loads((tmp_path / "call_width.json").read_text())["results"]
    assert len(res) == 2 and all(len(r["greedy"]) == 3 for r in res)
    for r in res:
        assert r["positions"] >= 2 and r["earlier_rows_when_last_changes"] == 0.0
        for kind in ("one_call", "sequence"):
            assert 0 <= r[f"{kind}_median_abs" if kind == "sequence" else "one_call_max_abs"] <= r[f"{kind}_max_abs"] < 1e-3
            assert r[f"{kind}_max_tv"] < 1e-3
        assert all(g["identical"] for g in r["greedy"])
    assert "greedy speculative (gamma 3, 6, adaptive) identical to plain in 6 of 6 runs" in (tmp_path / "call_width.md").read_text()


def test_call_width_reports_a_flip_and_short_continuations():
    """call_width's greedy check names the first differing token and plain decoding's logit gap
    there (from the target's own 1-token steps), and its width check takes a 0- or 1-token
    continuation (output that stopped at once) without failing."""
    from types import SimpleNamespace

    import numpy as np

    mod = _script("call_width")

    class Target:                                       # logits favour token (last id + 1) % 5, token 4 by 0.25
        vocab_size = 5

        def __init__(self):
            self.ids = []

        length = property(lambda self: len(self.ids))

        def _row(self):
            row = np.zeros(5, np.float32)
            row[(self.ids[-1] + 1) % 5] = 1.0
            row[4] = 0.75
            return row

        def prefill(self, ids):
            self.ids = list(ids)
            return self._row()

        def extend(self, ids):
            rows = []
            for x in ids:
                self.ids.append(int(x))
                rows.append(self._row())
            return np.stack(rows)

        def rewind_to(self, n):
            self.ids = self.ids[:n]

    class Engine:
        target = Target()

        def generate(self, prompt, max_new_tokens, temperature, use_draft=True, gamma=None):
            ids = [2, 3, 4] if not use_draft else ([2, 3, 0] if gamma == 6 else [2, 3, 4])
            return SimpleNamespace(ids=ids, prompt_ids=[1])

    rows = mod.greedy_identity(Engine(), "p", 3, (3, 6))
    assert rows[0] == {"gamma": 3, "identical": True}
    assert rows[1]["first_difference"] == 2 and rows[1]["plain_logit_gap"] == pytest.approx(0.75 - 0.0)
    for cont in ([], [3], [3, 0]):                      # the last token is output, never fed
        res = mod.width_noise(Engine(), [1, 2], cont, 4)
        assert res["positions"] == max(0, len(cont) - 1) and "earlier_rows_when_last_changes" not in res
    engine = Engine()
    res = mod.width_noise(engine, [1, 2], [3, 0, 1], 2)
    assert res["positions"] == 2 and res["one_call_max_abs"] == 0.0 and res["earlier_rows_when_last_changes"] == 0.0
    assert engine.target.length == 0                                # rewound at the end

    class WidthNoise(Target):                           # a wide call's rows are 0.01 off a 1-token call's
        def extend(self, ids):
            return super().extend(ids) + np.float32(0.01 if len(ids) > 1 else 0.0)

    engine.target = WidthNoise()
    res = mod.width_noise(engine, [1, 2], [3, 0, 1, 2, 3, 4], 4)   # 5 positions: 4 of them in a wide call's row 0
    assert res["one_call_max_abs"] == pytest.approx(0.01) and res["one_call_positions_over_1e-3"] == 4
    assert res["sequence_max_abs"] == pytest.approx(0.01) and res["earlier_rows_when_last_changes"] == 0.0


def test_verify_width_script(tmp_path, monkeypatch):
    """benchmarks/verify_width.py on small weights: a row per width, V(1) = 1, rates consistent."""
    mod = _script("verify_width")
    monkeypatch.setattr(mod.int8_rows, "K", 128)
    monkeypatch.setattr(mod.int8_rows, "N", 256)
    assert mod.main(["--calls", "2", "--widths", "1,4,2", "--peak-width", "16", "--out", str(tmp_path)]) == 0
    res = json.loads((tmp_path / "verify_width.json").read_text())
    assert [r["rows"] for r in res["rows"]] == [1, 2, 4]
    assert res["rows"][0]["V"] == 1.0 and res["rows"][0]["extra_ms_per_row"] is None
    flops = 2 * 128 * 256 * 12
    for r in res["rows"]:
        assert r["gflops"] == pytest.approx(flops * r["rows"] / r["ms"] / 1e6)
        assert r["ideal_V"] >= 1.0
    assert res["kernel_best_gflops"] > 0 and res["numpy_1row_gb_per_s"] > 0
    with pytest.raises(InvalidArgumentError, match="must include 1"):
        mod.main(["--widths", "2,4"])


def test_paper_tables_never_deletes_a_folder_it_did_not_write(tmp_path, tiny_checkpoints):
    """--draft NAME=DIR exports into PAIR/bundles/NAME: a folder of the user's files there is
    refused (it was deleted), and NAME cannot leave PAIR/bundles."""
    import shutil

    pair = tmp_path / "pair"
    t, d = tiny_checkpoints("llama")
    shutil.copytree(t, pair / "target")
    shutil.copytree(d, pair / "draft")
    notes = pair / "bundles" / "notes"
    notes.mkdir(parents=True)
    (notes / "README.txt").write_text("mine")
    mod = _script("paper_tables")
    base = ["--pair", str(pair), "--out", str(tmp_path / "out")]
    # missing folders are refused before any export (it used to export the pair's draft first)
    with pytest.raises(InvalidArgumentError, match="holds no target model"):
        mod.main(["--pair", str(tmp_path / "nopair"), "--out", str(tmp_path / "out")])
    with pytest.raises(InvalidArgumentError, match="is not a model folder"):
        mod.main(base + ["--draft", f"x={tmp_path / 'none'}"])
    assert not (pair / "bundles" / "pair-draft").exists()
    with pytest.raises(InvalidArgumentError, match="exists and is not a bundle"):
        mod.main(base + ["--draft", f"notes={d}"])
    assert (notes / "README.txt").read_text() == "mine"
    for bad in (f"../../victim={d}", f"a/b={d}", str(d), f"pair-draft={d}"):
        with pytest.raises(InvalidArgumentError, match="NAME=DIR"):
            mod.main(base + ["--draft", bad])
    for extra in (["--gammas", "2,auto"], ["--repeats", "0"]):
        with pytest.raises(InvalidArgumentError):
            mod.main(base + extra)
    assert not (tmp_path / "victim").exists() and not (tmp_path / "out").exists()


def test_peers_checks_the_pytorch_peers_folders_first(tmp_path, tiny_checkpoints, monkeypatch):
    """A missing --draft-dir (or pair folder) is refused before any system is measured; it used to
    show up as a transformers child that "did not start", after the other peers had run."""
    import shutil
    import sys

    pair = tmp_path / "pair"
    t, d = tiny_checkpoints("llama")
    shutil.copytree(t, pair / "target")
    shutil.copytree(d, pair / "draft")
    mod = _script("peers")
    for extra, match in ((["--draft-dir", str(tmp_path / "none")], "--draft-dir .* is not a model folder"),
                         ([], "--pair's target .* is not a model folder")):
        argv = ["peers.py", "--pair", str(pair if extra else tmp_path / "nopair"), "--out", str(tmp_path / "o")]
        monkeypatch.setattr(sys, "argv", argv + extra)
        with pytest.raises(InvalidArgumentError, match=match):
            mod.main()
    assert not (tmp_path / "o").exists()


def test_graphs_script_labels_rows_by_the_bundles_layout(tmp_path, tiny_checkpoints):
    from edgespec.export.pipeline import ExportOptions, export_bundle

    t, d = tiny_checkpoints("llama")
    export_bundle(t, tmp_path / "s", draft=d, progress=None)
    export_bundle(t, tmp_path / "c", draft=d, options=ExportOptions(graph="optimum"), progress=None)
    mod = _script("graphs")
    with pytest.raises(InvalidArgumentError, match="with static KV graphs .it has concat"):   # the flags swapped
        mod.main(["--static", str(tmp_path / "c"), "--concat", str(tmp_path / "s"), "--out", str(tmp_path / "o")])
    assert mod.main(["--static", str(tmp_path / "s"), "--concat", str(tmp_path / "c"), "--out", str(tmp_path / "o"),
                     "--calls", "2"]) == 0
    text = (tmp_path / "o" / "graphs.md").read_text()
    assert "| target | static (static) |" in text and "| draft | concat (concat) |" in text


def test_measurement_review_fixes(monkeypatch):
    """Lenience < 1: the theory columns use the test's keep probability; NaN repeats (no decode
    rate) are left out of medians and IQRs; c and V use the verify calls only; perf that fails
    is not 'available'."""
    import subprocess

    from edgespec import measure
    from edgespec.config import SamplingConfig
    from edgespec.loop import GenerationStats
    from edgespec.measure import Setting, SettingResult
    from edgespec.theory import expected_tokens

    st = GenerationStats(target_calls=11, target_s=0.15, draft_calls=40, draft_s=0.012, beta_sum=28.0, keep_sum=36.0,
                         beta_count=40, rounds=10, drafted=40, round_tokens=40)
    lenient = SettingResult(Setting(gamma=4, sampling=SamplingConfig(1.0), lenience=0.5), stats=[st],
                            plain_step=[0.2, 20]).summary()
    exact = SettingResult(Setting(gamma=4, sampling=SamplingConfig(1.0)), stats=[st], plain_step=[0.2, 20]).summary()
    assert lenient["alpha"] == exact["alpha"] == pytest.approx(0.7) and lenient["keep_probability"] == pytest.approx(0.9)
    assert lenient["expected_tokens_per_round"] == pytest.approx(expected_tokens(0.9, 4))
    assert exact["expected_tokens_per_round"] == pytest.approx(expected_tokens(0.7, 4))
    nan = float("nan")
    assert measure._med([nan, 1, 2, 3, 4]) == measure._med([1, 2, nan, 3, 4]) == 2.5
    assert measure._iqr([1, nan, 2, 3]) == measure._iqr([nan, 1, 2, 3])
    # two plain steps (20 ms each) inside the run: not verify calls
    mixed = GenerationStats(target_calls=13, target_s=0.19, plain_steps=2, plain_step_s=0.04, draft_calls=40,
                            draft_s=0.012, beta_sum=28.0, keep_sum=28.0, beta_count=40, rounds=10, drafted=40)
    r = SettingResult(Setting(gamma=4, sampling=SamplingConfig(0.0)), stats=[mixed], plain_step=[0.2, 20]).summary()
    assert r["verify_cost_steps"] == pytest.approx(0.015 / 0.010) and mixed.c == pytest.approx(0.0003 / 0.015)
    monkeypatch.setattr("shutil.which", lambda name: "/usr/bin/perf")
    monkeypatch.setattr(subprocess, "run", lambda *a, **k: subprocess.CompletedProcess(
        a, 2, "", "WARNING: perf not found for kernel 6.1\n"))
    assert "perf does not work here" in measure.hardware_counters_note()


def test_the_draft_is_prefilled_after_the_first_token():
    """The first token costs what it costs without a draft (time to first token, decode rate)."""
    import numpy as np

    from edgespec.config import GenerationConfig
    from edgespec.loop import iter_generate
    from edgespec.toy import toy_pair

    target, draft = toy_pair(16, 2, 0.3)
    it = iter_generate(target, [1, 2, 3], GenerationConfig(max_new_tokens=10, gamma=3), np.random.default_rng(0),
                       draft=draft)
    next(it)
    assert target.calls == 1 and draft.calls == 0
    next(it)
    assert draft.calls >= 1


def test_machine_description_counts_the_cores_this_process_may_use(monkeypatch):
    """A benchmark's machine line says how many cores the run could use (a container's or taskset's
    limit), not the host's count; the host's is kept beside it."""
    import os

    from edgespec import report

    if not hasattr(os, "sched_getaffinity"):
        pytest.skip("no CPU affinity on this OS")
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: {0})
    monkeypatch.setattr(os, "cpu_count", lambda: 64)
    info = report.machine_description()
    assert info["cpu_count"] == 1 and info["host_cpu_count"] == 64


def test_lookup_agreement_script(tiny_bundle, tmp_path, monkeypatch):
    """benchmarks/lookup_agreement.py on a tiny bundle whose prompts repeat themselves: it counts
    every generated position, finds lookups, and its three agreements are consistent (the best
    choice per cell is at least the model's; the replay of the online rule a valid fraction)."""
    import edgespec.prompts

    mod = _script("lookup_agreement")
    monkeypatch.setattr(edgespec.prompts, "CODE_PROMPTS", ("the cat the cat the cat", "a b c a b c a b"))
    assert mod.main([str(tiny_bundle("llama")), "--max-new-tokens", "16", "--out", str(tmp_path)]) == 0
    res = json.loads((tmp_path / "lookup_agreement.json").read_text())
    assert res["positions"] == 32 and res["lookup_found"] > 0.5
    assert 0 <= res["model_agreement"] <= res["best_per_cell_agreement"] <= 1
    assert 0 <= res["online_rule_agreement"] <= 1
    assert sum(c["positions"] for c in res["cells"]) == round(res["differ"] * res["positions"])
    with pytest.raises(InvalidArgumentError, match="no draft model"):
        _no_draft(mod, tiny_bundle, tmp_path)


def _no_draft(mod, tiny_bundle, tmp_path):
    import shutil

    from edgespec import contract

    b = tmp_path / "single"
    shutil.copytree(tiny_bundle("llama"), b)
    data = json.loads((b / contract.MANIFEST_NAME).read_text())
    del data["models"]["draft"]
    (b / contract.MANIFEST_NAME).write_text(json.dumps(data))
    shutil.rmtree(b / "draft")
    mod.main([str(b), "--max-new-tokens", "4"])


def test_policy_ab_runs_this_policy_against_a_revision(tiny_bundle, capsys, monkeypatch):
    """benchmarks/policy_ab.py runs the checkout's adaptive policy and another revision's side by
    side with plain decoding; a revision before Verdict.keep still runs in this loop, and a revision
    git cannot read is a clear error."""
    import numpy as np

    from edgespec.adaptive import AdaptiveGamma

    pab = _script("policy_ab")
    import subprocess
    if subprocess.run(["git", "rev-parse", "HEAD"], cwd=pab.ROOT, capture_output=True).returncode != 0:
        pytest.skip("not a git checkout: policy_ab.py reads the other policy with git show")

    class Old(AdaptiveGamma):  # as before Verdict.keep: update() took no keep probabilities
        def update(self, confidences, n_accepted, draft_s, target_s):
            self.seen = n_accepted
            return super().update(confidences, n_accepted, draft_s, target_s)

    pol = pab.adapt(Old)(8)
    pol.update(np.full(2, 0.5), 1, 0.001, 0.002, np.array([1.0, 0.5]))
    assert pol.seen == 1 and pab.adapt(AdaptiveGamma) is AdaptiveGamma

    class Older(Old):  # as before confidence_s: start_round() returned nothing
        def start_round(self):
            super().start_round()

    assert pab.adapt(Older)(8).start_round() is not None  # the loop is given its keep_going
    bundle = str(tiny_bundle("llama"))
    rows = pab.run(bundle, "HEAD", 1.0, 1, 8)
    assert len(rows) == 1 and all(rows[0][side]["tokens_per_s"] > 0 for side in ("plain", "this", "other"))
    assert rows[0]["plain"]["plain_step_share"] == pytest.approx(7 / 8)  # every token but the prefill's
    assert pab.main([bundle, "--repeats", "1", "--max-new-tokens", "8", "--temperature", "0"]) == 0
    assert "this / HEAD: median" in capsys.readouterr().out
    assert pab.main([bundle, "--repeats", "1", "--max-new-tokens", "8", "--stalls", "1e6"]) == 0  # a stall after every call
    assert "4 ms stalls injected at 1e+06 per second" in capsys.readouterr().out
    # --work: both policies' choices overridden, so both sides decode the same tokens (checked by the script)
    rows = pab.run(bundle, "HEAD", 1.0, 1, 8, work=3)
    assert rows[0]["this"]["plain_step_share"] == rows[0]["other"]["plain_step_share"] < 0.1  # (a call's last token)
    assert pab.main([bundle, "--repeats", "1", "--max-new-tokens", "8", "--work", "3"]) == 0
    assert "3 drafts every round" in capsys.readouterr().out
    made = []
    real_init = AdaptiveGamma.__init__
    monkeypatch.setattr(AdaptiveGamma, "__init__", lambda self, *a, **k: (made.append(self), real_init(self, *a, **k))[1])
    assert pab.main([bundle, "--repeats", "1", "--max-new-tokens", "8", "--fresh"]) == 0
    assert "a new policy for every call" in capsys.readouterr().out
    assert len(made) == 1 + 2 * len(pab.CODE_PROMPTS)   # this side's: one kept, then one per call (2 repeats)
    # --static: the other side drafts G every round, with no policy (and no revision read)
    made.clear()
    rows = pab.run(bundle, "no-such-revision", 0.0, 1, 8, static=2, fresh=True)
    assert rows[0]["other"]["tokens_per_s"] > 0 and len(made) == 1 + 2 * len(pab.CODE_PROMPTS)  # this side's only
    assert pab.main([bundle, "--repeats", "1", "--max-new-tokens", "8", "--static", "2"]) == 0
    assert "this / gamma 2: median" in capsys.readouterr().out
    # --draft lookahead: a lookahead drafter per side
    from edgespec.drafters import LookaheadDrafter
    looks = []
    real_look = LookaheadDrafter.__init__
    monkeypatch.setattr(LookaheadDrafter, "__init__", lambda self, *a: (looks.append(self), real_look(self, *a))[1])
    assert pab.main([bundle, "--repeats", "1", "--max-new-tokens", "8", "--temperature", "0", "--draft", "lookahead"]) == 0
    assert "the lookahead drafter on both sides" in capsys.readouterr().out
    assert len(looks) == 2 and all(d.starts > 0 for d in looks)  # (started by the calls that drafted)
    for bad in (["--work", "9"], ["--static", "9"], ["--static", "2", "--work", "2"], ["--draft", "ngram"]):
        with pytest.raises(SystemExit):
            pab.main([bundle, *bad])
    with pytest.raises(InvalidArgumentError, match="cannot read edgespec/adaptive.py"):
        pab.policy_class("no-such-revision")
    if subprocess.run(["git", "cat-file", "-e", "c3986e0"], cwd=pab.ROOT, capture_output=True).returncode == 0:
        with pytest.raises(InvalidArgumentError, match="predates plain steps"):   # (a shallow clone lacks it)
            pab.policy_class("c3986e0")  # before draft_next / record_plain


def test_other_load_counts_other_processes_not_this_one(tmp_path, monkeypatch):
    """OtherLoad: the busy CPU time from /proc/stat (user, nice, system, irq, softirq, steal; not
    idle or iowait) of the cores this process may use, minus this process's own, over the wall time;
    None under a cgroup CPU quota, without /proc/stat or for a run under half a second; the note
    appears only above a quarter of a core. (A fake /proc/stat and clock: under pytest -n 2 the real
    ones also count the other worker.)"""
    import os
    import time

    from edgespec import report
    from edgespec.report import OtherLoad, other_load_note

    hz = os.sysconf("SC_CLK_TCK")
    clock, own = [100.0], [5.0]
    monkeypatch.setattr(time, "perf_counter", lambda: clock[0])
    monkeypatch.setattr(time, "process_time", lambda: own[0])
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: {1}, raising=False)  # this process runs on cpu1 only
    stat, cgroup = tmp_path / "stat", tmp_path / "cgroup"
    cgroup.mkdir()

    def write(cpu1_user, cpu1_steal, cpu0_user):
        stat.write_text(f"cpu  {cpu1_user + cpu0_user} 0 0 900 0 0 0 {cpu1_steal} 0 0\n"
                        f"cpu0 {cpu0_user} 0 0 400 0 0 0 0 0 0\ncpu1 {cpu1_user} 10 20 500 50 5 5 {cpu1_steal} 0 0\n"
                        "intr 1 2 3\n")

    write(1000, 20, 7000)
    load = OtherLoad(str(stat), str(cgroup))
    # 2 s later: cpu1 did 1.5 s of user time (0.5 s of it this process's) and 0.5 s of steal; cpu0's
    # 2 s of work and cpu1's idle and iowait do not count
    clock[0], own[0] = 102.0, 5.5
    write(1000 + 3 * hz // 2, 20 + hz // 2, 7000 + 2 * hz)
    assert load.cores() == pytest.approx((1.5 + 0.5 - 0.5) / 2.0)
    clock[0] = 100.0
    write(1000, 20, 7000)
    short = OtherLoad(str(stat), str(cgroup))
    clock[0] = 100.4
    assert short.cores() is None                                   # under half a second: ticks say too little
    (cgroup / "cpu.max").write_text("max 100000\n")
    assert OtherLoad(str(stat), str(cgroup))._start is not None   # no quota
    (cgroup / "cpu.max").write_text("200000 100000\n")
    assert OtherLoad(str(stat), str(cgroup)).cores() is None      # a quota: host-wide cores, not told
    assert OtherLoad(str(tmp_path / "none"), str(tmp_path / "none")).cores() is None  # no /proc/stat
    (tmp_path / "short").write_text("cpu 1 2 3\n")
    assert OtherLoad(str(tmp_path / "short"), str(cgroup / "x"))._start is None  # a line of another shape
    monkeypatch.setattr(report, "usable_cores", lambda: 2)
    assert other_load_note(0.1) is None and other_load_note(None) is None
    assert "other processes took 0.90 of the 2 cores this ran on" in other_load_note(0.9)


def test_table_leaves_unmeasured_ratios_blank():
    """A ratio that was not measured (no drafted round: no prediction; no read counter) printed "-x"."""
    from edgespec.report import format_table

    nan = float("nan")
    row = {"setting": "ngram gamma=4 T=0", "alpha": nan, "c": nan, "tokens_per_round": nan,
           "expected_tokens_per_round": nan, "plain_tokens_per_s": 200.0, "spec_tokens_per_s": 190.0, "speedup": 0.95,
           "speedup_iqr": [nan] * 2, "decode_speedup": nan, "predicted_speedup": nan}
    cells = format_table([row]).splitlines()[2].split()[3:]
    assert cells == ["-", "-", "-", "-", "200.0", "190.0", "0.95x", "[---]", "-", "-", "-", "-", "-"], cells


def test_bench_table_cells_sit_under_their_headers():
    """Every value ends where its header ends, with one repeat ([---]) and with several."""
    from edgespec.report import format_table

    row = {"setting": "model gamma=4 T=0", "alpha": 0.8, "c": 0.03, "tokens_per_round": 3.2,
           "expected_tokens_per_round": 3.3, "plain_tokens_per_s": 200.0, "spec_tokens_per_s": 450.0, "speedup": 2.25,
           "speedup_iqr": [float("nan")] * 2, "decode_speedup": 2.4, "predicted_speedup": 3.1, "verify_cost_steps": 1.3,
           "predicted_speedup_verify_cost": 2.4, "target_read_reduction": 3.5}
    head, _, one, many, long = format_table([row, {**row, "speedup_iqr": [2.2, 2.3]},
                                             {**row, "setting": "lookahead gamma=auto T=1 top_k=50 top_p=0.95 l=0.5"}]
                                            ).splitlines()[:5]

    import re

    names = ["alpha", "c", "tok/round", "(theory)", "plain tok/s", "spec tok/s", "speedup", "[IQR]", "decode", "Thm3.8",
             "V", "Thm3.8(V)", "fewer reads"]
    first = len("lookahead gamma=auto T=1 top_k=50 top_p=0.95 l=0.5") + 1   # the widest label sets the first column
    header_ends, pos = [], first
    for name in names:
        pos = head.index(name, pos) + len(name)
        header_ends.append(pos)
    for line in (one, many, long):  # a row's cells hold no spaces
        assert [first + m.end() for m in re.finditer(r"\S+", line[first:])] == header_ends, (head, line)


def test_benchmark_scripts_bound_their_sizes(tmp_path, monkeypatch, capsys):
    """Sizes a script cannot honour are usage errors before anything runs (trials' finds):
    int8_rows.py --rows 100000 ran out of memory; call_width.py --width 300 reported 300-token calls
    along a 96-token continuation, which feeds at most 95 per call."""
    import subprocess
    import sys

    with pytest.raises(SystemExit) as e:
        _script("int8_rows").main(["--rows", "100000"])
    assert e.value.code == 2 and "--rows: must be >= 2 and <= 256, got 100000" in capsys.readouterr().err
    with pytest.raises(SystemExit) as e:
        _script("call_width").main([str(tmp_path / "missing"), "--width", "300"])
    assert e.value.code == 2 and "raise --max-new-tokens above 300 or lower --width" in capsys.readouterr().err
    # count_drafts.py is a module of paper_tables.py: its --help is help, not an error
    script = Path(__file__).resolve().parents[1] / "benchmarks" / "count_drafts.py"
    done = subprocess.run([sys.executable, str(script), "--help"], capture_output=True, text=True)
    assert done.returncode == 0 and "run that script instead" in done.stderr
    assert subprocess.run([sys.executable, str(script)], capture_output=True).returncode == 2


def test_revision_ab_runs_this_checkout_against_a_revision(tiny_bundle, tmp_path, capsys):
    """benchmarks/revision_ab.py runs this checkout and a revision (in a temporary git worktree, each
    side in its own process importing its own tree, edgespec.runtimes and edgespec.export included,
    which an editable install maps to its own checkout) side by side, removes the worktree, and
    refuses a revision git cannot resolve and a missing bundle before making one."""
    import subprocess

    rab = _script("revision_ab")
    if subprocess.run(["git", "rev-parse", "HEAD"], cwd=rab.ROOT, capture_output=True).returncode != 0:
        pytest.skip("not a git checkout: revision_ab.py checks the other side out with git worktree")
    worktrees = subprocess.run(["git", "worktree", "list"], cwd=rab.ROOT, capture_output=True, text=True).stdout
    bundle = str(tiny_bundle("llama"))
    rates = rab.run(bundle, "HEAD", 1.0, "2", 2, 4)
    assert len(rates["this"]) == len(rates["other"]) == 2 and min(rates["this"] + rates["other"]) > 0
    assert rab.main([bundle, "--repeats", "1", "--max-new-tokens", "4", "--temperature", "0", "--gamma", "auto"]) == 0
    assert "this / HEAD: median" in capsys.readouterr().out
    assert subprocess.run(["git", "worktree", "list"], cwd=rab.ROOT, capture_output=True, text=True).stdout == worktrees
    with pytest.raises(InvalidArgumentError, match="cannot resolve 'no-such-revision'"):
        rab.run(bundle, "no-such-revision", 1.0, "2", 1, 4)
    with pytest.raises(BundleError):
        rab.run(str(tmp_path / "missing"), "HEAD", 1.0, "2", 1, 4)
    with pytest.raises(SystemExit):
        rab.main([bundle, "--gamma", "0"])


def test_policy_ab_reports_a_missing_bundle_first(tmp_path, capsys):
    """policy_ab.py printed its note about the revision before the missing bundle's error."""
    from edgespec.errors import BundleError

    with pytest.raises(BundleError, match="does not exist"):
        _script("policy_ab").run(str(tmp_path / "missing"), "HEAD", 1.0, 1, 4)
    assert "[policy_ab] note" not in capsys.readouterr().err


def test_an_unwritable_report_folder_is_named_as_given():
    """The message named a probe file (--out '/proc/x/results.json') that no script writes."""
    from edgespec.errors import OutputPathError
    from edgespec.outputs import check_report_folder

    with pytest.raises(OutputPathError, match=r"^cannot write --out '/proc/edgespec-x': '/proc' is not a writable") as e:
        check_report_folder(Path("/proc/edgespec-x"))
    assert "results.json" not in str(e.value)


# (the tests below pin what a mutation audit's surviving mutants changed: each fails on its mutant)
def _stats(**kw):
    from edgespec.loop import GenerationStats
    base = dict(target_calls=11, target_s=0.15, draft_calls=40, draft_s=0.012, beta_sum=20.0, beta_count=25,
                rounds=10, drafted=40, round_tokens=40)
    base.update(kw)
    return GenerationStats(**base)


def test_mean_gamma_is_drafts_per_round():
    from edgespec.measure import Setting, SettingResult
    r = SettingResult(Setting(gamma=4, sampling=SamplingConfig(1.0)), stats=[_stats()], plain_step=[0.2, 20]).summary()
    assert r["mean_gamma"] == pytest.approx(4.0)


def test_accepted_hist_sums_over_runs():
    from edgespec.measure import Setting, SettingResult
    stats = [_stats(accepted_hist=[1, 2]), _stats(accepted_hist=[3]), _stats(accepted_hist=[0, 0, 5])]
    r = SettingResult(Setting(gamma=4, sampling=SamplingConfig(1.0)), stats=stats, plain_step=[0.2, 20]).summary()
    assert r["accepted_hist"] == [4, 2, 5]


def _toy_run(seed=0, sampling=SamplingConfig(1.0)):
    from edgespec.measure import ReadCounter, Setting, run_settings
    from edgespec.toy import toy_pair
    target, draft = toy_pair(vocab_size=40, order=3, noise=1.0, seed=2, max_length=256)
    return run_settings(ReadCounter(target, 100, 1), ReadCounter(draft, 10, 1), [[1, 2, 3], [4, 5], [6]],
                        [Setting(3, sampling)], max_new_tokens=10, repeats=2, warmup=1, seed=seed)


def test_plain_step_count_excludes_the_prefill():
    res = _toy_run()
    # 2 kept repeats x 3 prompts x (10 tokens: 1 from the prefill + 9 steps)
    assert res[0].plain_step[1] == 2 * 3 * 9


def test_bench_seed_reaches_the_runs(monkeypatch):
    from edgespec import measure
    seen = []
    real = measure.generate

    def spy(tb, prompt, cfg, rng, drafter=None, policy=None):
        r = real(tb, prompt, cfg, rng, drafter, policy=policy)
        seen.append(tuple(r.tokens))
        return r

    monkeypatch.setattr(measure, "generate", spy)
    runs = []
    for seed in (0, 0, 12345):
        seen.clear()
        _toy_run(seed)
        runs.append(list(seen))
    assert runs[0] == runs[1] and runs[0] != runs[2]


def test_policy_overhead_takes_the_policy_apart_against_static_gamma(tiny_bundle, capsys):
    """benchmarks/policy_overhead.py runs static gamma, the confidence alone, the policy's work and
    the policy side by side, each row against static gamma; bad options are refused."""
    po = _script("policy_overhead")
    bundle = str(tiny_bundle("llama"))
    assert po.main([bundle, "--temperature", "0", "--gamma", "3", "--repeats", "1", "--max-new-tokens", "8"]) == 0
    out = capsys.readouterr().out
    rows = {line.split(":")[0].strip(): line for line in out.splitlines()[1:]}
    assert list(rows) == ["static", "confidence", "policy work", "adaptive"], out
    assert "/ static 1.000" in rows["static"] and "mean gamma" in rows["adaptive"]
    with pytest.raises(SystemExit):
        po.main([bundle, "--gamma", "9"])
