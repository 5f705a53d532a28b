"""`edgespec demo` end to end on the tiny preset (train, export, stream, measure), and
`edgespec bench` on a tiny ONNX bundle: JSON, table and plots are written."""
from __future__ import annotations

import json

import pytest

from edgespec.cli import main

pytestmark = pytest.mark.slow


def test_demo_end_to_end_on_tiny_preset(tmp_path, monkeypatch, capsys):
    from tiny_models import copy_stdlib_files

    corpus = [str(p) for p in copy_stdlib_files(tmp_path, ("argparse.py", "textwrap.py", "string.py", "heapq.py",
                                                           "shlex.py", "copy.py"))]
    monkeypatch.setenv("EDGESPEC_CACHE", str(tmp_path / "cache"))
    args = ["demo", "--preset", "tiny", "--repeats", "1", "--max-new-tokens", "8", "--corpus", *corpus]
    assert main(args) == 0
    out = capsys.readouterr().out
    for needle in ("alpha (E[sum min(p, q)])", "c (draft step / target step)", "tokens/s plain",
                   "tokens/s speculative", "Theorem 3.8 predicts", "target bytes read per token", "hardware counters"):
        assert needle in out, needle
    # second run reuses the cached pair and bundle
    assert main(args) == 0
    err = capsys.readouterr().err
    assert "reusing the trained pair" in err and "reusing the exported bundle" in err


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
    for r in data["results"]:
        assert len(r["speedup_all"]) == 2 and r["plain_tokens_per_s"] > 0
        assert r["target_read_reduction"] > 0 and sum(r["accepted_hist"]) > 0
    assert (tmp_path / "out" / "speedup.png").stat().st_size > 1000
    assert (tmp_path / "out" / "accepted_hist.png").stat().st_size > 1000


def test_bench_bad_input(tiny_bundle, tmp_path, capsys):
    assert main(["bench", str(tiny_bundle("llama")), "--gammas", "x"]) == 2
    assert main(["bench", str(tmp_path / "nope")]) == 2
    err = capsys.readouterr().err
    assert "--gammas" in err and "Traceback" not in err
