"""Fuzzing (issue 9): the sampler, the acceptance test and the loop over random logits and
settings, and the bundle loader over mutated manifests and mutated ONNX bytes.

Invariants: never an id outside the vocabulary, output length bounds always hold, and the only
exceptions are EdgeSpecError subclasses (a row that is -inf everywhere, NaN or +inf logits:
NonFiniteLogitsError). ``tests/test_core.py::test_fuzz_ids_in_vocab_and_length_bounds`` covers
plain random tables; this file adds extreme values, dtypes, non-finite logits injected mid-run,
stop/EOS ids, adaptive gamma, the n-gram drafter, tight caches and lenience.
"""
from __future__ import annotations

import json
import random
import time

import numpy as np
import pytest
from hypothesis import HealthCheck, assume, given, settings, strategies as st

from edgespec.config import GenerationConfig, SamplingConfig
from edgespec.drafters import NgramDrafter
from edgespec.errors import EdgeSpecError, NonFiniteLogitsError
from edgespec.loop import generate
from edgespec.rejection import speculative_sample
from edgespec.sampling import process_logits, sample_index
from edgespec.toy import ToyBackend, ToyLM

# Values that break naive softmax code: masks, ties, huge, tiny and subnormal magnitudes.
SPECIAL = [-np.inf, 0.0, 1.0, -1.0, 1e-300, -1e-300, 5e-324, 1e300, -1e300, 3e38, -3e38, 65504.0, -65504.0, 88.0, -88.0]
TEMPERATURES = [0.0, 5e-324, 1e-310, 1e-300, 1e-8, 0.01, 0.5, 1.0, 2.0, 1e10, 1e300]
TOP_PS = [5e-324, 1e-9, 0.05, 0.5, 0.95, 0.999999, 1.0]

logit_value = st.one_of(st.sampled_from(SPECIAL), st.floats(-1e4, 1e4, allow_nan=False))
sampling_cfg = st.builds(SamplingConfig, temperature=st.sampled_from(TEMPERATURES), top_k=st.integers(0, 12),
                         top_p=st.sampled_from(TOP_PS))


def _expected_non_finite(logits: np.ndarray) -> bool:
    return bool(np.isnan(logits).any() or np.isposinf(logits).any() or np.isneginf(logits).all(axis=-1).any())


@settings(max_examples=400, deadline=None)
@given(k=st.integers(1, 4), V=st.integers(1, 16), data=st.data(), cfg=sampling_cfg,
       dtype=st.sampled_from([np.float64, np.float32, np.float16]),
       poison=st.sampled_from([None, None, None, "nan", "posinf", "allneginf"]))
def test_fuzz_process_logits_and_sample_index(k, V, data, cfg, dtype, poison):
    with np.errstate(over="ignore"):  # 3e38 -> float16 is +inf on purpose; covered by the checks
        logits = np.array(data.draw(st.lists(st.lists(logit_value, min_size=V, max_size=V), min_size=k, max_size=k)),
                          dtype=np.float64).astype(dtype)
    row = data.draw(st.integers(0, k - 1))
    if poison == "nan":
        logits[row, data.draw(st.integers(0, V - 1))] = np.nan
    elif poison == "posinf":
        logits[row, data.draw(st.integers(0, V - 1))] = np.inf
    elif poison == "allneginf":
        logits[row, :] = -np.inf
    if _expected_non_finite(logits):
        with pytest.raises(NonFiniteLogitsError):
            process_logits(logits, cfg, "fuzz model")
        return
    with np.errstate(over="ignore", under="ignore"):
        probs = process_logits(logits, cfg, "fuzz model")
    assert probs.shape == (k, V) and probs.dtype == np.float64
    assert np.isfinite(probs).all() and (probs >= 0).all()
    np.testing.assert_allclose(probs.sum(axis=-1), 1.0, rtol=1e-9)
    assert (probs[np.isneginf(logits)] == 0).all()  # a masked id never gets mass
    if cfg.greedy:
        assert (probs.argmax(axis=-1) == np.argmax(logits, axis=-1)).all()
    for r in range(k):
        for u in (0.0, data.draw(st.floats(0.0, 1.0, exclude_max=True)), np.nextafter(1.0, 0.0)):
            i = sample_index(probs[r], u)
            assert 0 <= i < V and probs[r, i] > 0


def _dist(draw, V):
    w = np.array(draw(st.lists(st.sampled_from([0.0, 0.0, 1e-300, 1e-12, 0.1, 0.5, 1.0, 7.0]), min_size=V, max_size=V)))
    assume(w.sum() > 0)
    return w / w.sum()


@settings(max_examples=300, deadline=None)
@given(V=st.integers(1, 10), g=st.integers(0, 6), data=st.data(), lenience=st.sampled_from([5e-324, 1e-6, 0.3, 1.0]),
       seed=st.integers(0, 2**32 - 1))
def test_fuzz_speculative_sample(V, g, data, lenience, seed):
    rng = np.random.default_rng(seed)
    q = np.array([_dist(data.draw, V) for _ in range(g)]).reshape(g, V)
    p = np.array([_dist(data.draw, V) for _ in range(g + 1)])
    x = np.array([sample_index(q[i], rng.random()) for i in range(g)], dtype=np.int64)
    v = speculative_sample(x, q, p, rng, lenience)
    assert 0 <= v.n_accepted <= g and 0 <= v.token < V
    assert all(p[i, x[i]] > 0 for i in range(v.n_accepted))  # p(x) = 0 is never kept
    assert v.kind == ("bonus" if v.n_accepted == g else "recovered")
    assert p[v.n_accepted, v.token] > 0  # recovered/bonus tokens come from (the support of) p


class _Poisoned(ToyBackend):
    """A ToyBackend whose ``at``-th model call returns a NaN / +inf / all -inf row."""

    def __init__(self, model, max_length, at, kind):
        super().__init__(model, max_length)
        self.at, self.kind, self.n_calls = at, kind, 0

    def extend(self, ids):
        out = super().extend(ids)
        self.n_calls += 1
        if self.kind is not None and self.n_calls == self.at:
            out = out.copy()
            if self.kind == "allneginf":
                out[-1, :] = -np.inf
            else:
                out[-1, 0] = np.nan if self.kind == "nan" else np.inf
        return out


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(V=st.integers(2, 12), seed=st.integers(0, 2**16), cfg=sampling_cfg,
       gamma=st.one_of(st.none(), st.integers(1, 9)), drafter=st.sampled_from(["none", "model", "ngram"]),
       max_new=st.integers(1, 40), slack=st.integers(0, 12), n_prompt=st.integers(1, 6),
       lenience=st.sampled_from([1.0, 0.5, 1e-9]), extreme=st.sampled_from([None, 1e30, 3e38, 1e-30]),
       dtype=st.sampled_from([np.float32, np.float16]), n_stop=st.integers(0, 2), eos=st.booleans(),
       poison=st.sampled_from([None, None, "nan", "posinf", "allneginf"]), poison_target=st.booleans(),
       poison_at=st.integers(1, 8))
def test_fuzz_loop_invariants(V, seed, cfg, gamma, drafter, max_new, slack, n_prompt, lenience, extreme, dtype,
                              n_stop, eos, poison, poison_target, poison_at):
    rng = np.random.default_rng(seed)
    table = rng.normal(0.0, 3.0, (V, V))
    table[rng.random(table.shape) < 0.3] = -np.inf                      # masks
    table[:, rng.integers(V)] = np.where(np.isfinite(table).any(axis=1), np.nanmax(np.where(np.isfinite(table), table, -1e9), axis=1), 0.0)  # ties, a live column
    if extreme is not None:
        table[rng.random(table.shape) < 0.2] = extreme * rng.choice([-1.0, 1.0])
    with np.errstate(over="ignore"):
        table = table.astype(dtype).astype(np.float32)
    assume(not _expected_non_finite(table))
    prompt = [int(t) for t in rng.integers(0, V, n_prompt)]
    # tight caches: the prompt and the output just fit (slack 0) or with a little room
    max_length = n_prompt + max_new - 1 + slack
    target = _Poisoned(ToyLM(V, 2, table=table), max_length, poison_at, poison if poison_target else None)
    draft_table = np.where(np.isfinite(table), table[::-1] * 0.5 + 0.1, -np.inf).astype(np.float32)
    assume(not _expected_non_finite(draft_table))
    draft = {"none": None, "ngram": NgramDrafter(3),
             "model": _Poisoned(ToyLM(V, 2, table=draft_table), max_length, poison_at, None if poison_target else poison)}[drafter]
    stops = tuple(int(t) for t in rng.integers(0, V, n_stop))
    c = GenerationConfig(max_new_tokens=max_new, sampling=cfg, gamma=gamma, max_gamma=9, lenience=lenience,
                         eos_token_ids=(int(rng.integers(V)),) if eos else (), stop_token_ids=stops)
    try:
        with np.errstate(over="ignore", under="ignore", invalid="ignore"):
            r = generate(target, prompt, c, np.random.default_rng(seed), draft)
    except NonFiniteLogitsError:
        assert poison is not None  # only a poisoned call may raise
        return
    except EdgeSpecError as exc:  # anything else must at least be ours; none is expected here
        pytest.fail(f"unexpected {type(exc).__name__}: {exc}")
    assert 1 <= len(r.tokens) <= max_new
    assert all(isinstance(t, int) and 0 <= t < V for t in r.tokens)
    assert len(r.sources) == len(r.tokens)
    assert target.length <= max_length
    ends = set(c.eos_token_ids) | set(c.stop_token_ids)
    assert not ends.intersection(r.tokens[:-1])  # generation stops at the first EOS / stop id
    if r.finish_reason == "length":
        assert len(r.tokens) == max_new
    else:
        assert r.tokens[-1] in ends


# ------------------------------------------------------------------ bundle loader fuzzing
# The campaigns run in a child process (this file is also its script): a crash inside ONNX Runtime
# on a malformed graph would otherwise take the test process down, and a hang is bounded by the
# child's timeout (plus a per-example faulthandler watchdog that prints where it hung).

_VALUES = [None, True, False, 0, -1, 1, 7, 2**31, 2**63, 10**30, 1e308, float("inf"), float("nan"), -0.0, 0.5, "", "x",
           "../..", "../secret", "/etc/passwd", "target", "draft", "decoder", "model.onnx", "seq2seq", "fp16",
           "\u00fc\U0001F642\u202e", "\udcff", "a\u0000b", [], {}, [1, 2], ["model.onnx"], {"decoder": "model.onnx"},
           {"a": 1}, "9" * 5000]


def _paths(node, prefix=()):
    yield prefix
    if isinstance(node, dict):
        for k, v in node.items():
            yield from _paths(v, prefix + (k,))
    elif isinstance(node, list):
        for i, v in enumerate(node):
            yield from _paths(v, prefix + (i,))


def _mutate_manifest(text: str, rnd: random.Random) -> tuple[str, str]:
    """One to three random JSON mutations (or a raw-text one) of a manifest; returns (text, what)."""
    if rnd.random() < 0.15:  # raw text: truncation, byte noise, deep nesting, huge number
        op = rnd.choice(["truncate", "noise", "nest", "bigint"])
        if op == "truncate":
            return text[: rnd.randrange(len(text))], "raw truncate"
        if op == "noise":
            i = rnd.randrange(len(text))
            return text[:i] + "".join(chr(rnd.randrange(0, 0x2FF)) for _ in range(rnd.randint(1, 8))) + text[i:], "raw noise"
        if op == "nest":
            d = rnd.choice([100, 5000, 200000])
            return text.replace('"opset": ', '"opset": ' + "[" * d + "]" * d + ", \"x\": ", 1), f"raw nest {d}"
        return text.replace('"vocab_size": ', '"vocab_size": ' + "9" * 5000 + ", \"y\": ", 1), "raw bigint"
    data = json.loads(text)
    what = []
    for _ in range(rnd.randint(1, 3)):
        paths = [p for p in _paths(data) if p]
        path = rnd.choice(paths)
        parent = data
        for key in path[:-1]:
            parent = parent[key]
        key = path[-1]
        op = rnd.choice(["replace", "replace", "replace", "delete", "rename", "extra", "wrap", "retype"])
        if op == "replace":
            parent[key] = rnd.choice(_VALUES)
        elif op == "delete":
            del parent[key]
        elif op == "rename" and isinstance(parent, dict):
            parent[rnd.choice(["", "x", "models", "target", "\u00fc"])] = parent.pop(key)
        elif op == "extra" and isinstance(parent, dict):
            parent[f"extra{rnd.randrange(9)}"] = rnd.choice(_VALUES)
        elif op == "wrap":
            parent[key] = [parent[key]]
        else:
            v = parent[key]
            parent[key] = str(v) if not isinstance(v, str) else (int(v) if v.isdigit() else len(v))
        what.append(f"{op} {'/'.join(map(str, path))}")
    return json.dumps(data, indent=1), "; ".join(what)


def _mutate_bytes(data: bytes, rnd: random.Random) -> tuple[bytes, str]:
    n = len(data)
    def offset():
        r = rnd.random()
        if r < 0.5:
            return rnd.randrange(n)
        return rnd.randrange(min(n, 16384)) if r < 0.75 else n - 1 - rnd.randrange(min(n, 16384))
    op = rnd.choice(["flip", "flip", "flip", "truncate", "insert", "overwrite", "delete", "duplicate"])
    i = offset()
    b = bytearray(data)
    if op == "flip":
        k = rnd.choice([1, 1, 2, 8, 32])
        for _ in range(k):
            j = offset()
            b[j] ^= 1 << rnd.randrange(8)
        return bytes(b), f"flip {k} bits near {i}"
    if op == "truncate":
        return data[:i], f"truncate at {i}"
    span = rnd.randint(1, 64)
    noise = bytes(rnd.randrange(256) for _ in range(span))
    if op == "insert":
        return data[:i] + noise + data[i:], f"insert {span} at {i}"
    if op == "overwrite":
        return data[:i] + noise + data[i + span:], f"overwrite {span} at {i}"
    if op == "delete":
        return data[:i] + data[i + span:], f"delete {span} at {i}"
    return data[:i] + data[i:i + span] + data[i:], f"duplicate {span} at {i}"


def _fuzz_worker(mode: str, bundle: str, n: int, seed: int, out: str) -> None:
    import faulthandler
    import shutil
    import sys
    import tempfile
    from pathlib import Path

    from edgespec import contract
    from edgespec.api import load
    from edgespec.bundle import load_bundle

    rnd = random.Random(seed)
    work = Path(tempfile.mkdtemp(prefix="edgespec-fuzz-")) / "b"
    shutil.copytree(bundle, work)
    mpath = work / contract.MANIFEST_NAME
    pristine = {p: p.read_bytes() for p in [mpath, *sorted(work.rglob("*.onnx"))]}
    onnx_files = [p for p in pristine if p.suffix == ".onnx"]
    stats: dict = {"examples": 0, "outcomes": {}, "failures": [], "max_seconds": 0.0}
    for i in range(n):
        for p, raw in pristine.items():
            p.write_bytes(raw)
        if mode == "manifest":
            text, what = _mutate_manifest(pristine[mpath].decode(), rnd)
            mpath.write_text(text, encoding="utf-8", errors="surrogatepass")
        else:
            victim = rnd.choice(onnx_files)
            raw, what = _mutate_bytes(pristine[victim], rnd)
            victim.write_bytes(raw)
            what = f"{victim.relative_to(work)}: {what}"
        faulthandler.dump_traceback_later(120, exit=True)  # a hang ends the child with a traceback
        t0 = time.perf_counter()
        stage = "load_bundle"
        try:
            load_bundle(work)
            stage = "load"
            eng = load(work, threads=1)
            stage = "generate"
            for kw in ({"temperature": 0}, {"temperature": 1.0, "use_draft": False}):
                eng.generate("the quick brown fox", max_new_tokens=3, seed=i, **kw)
            outcome = "loaded and generated"
        except EdgeSpecError as exc:
            outcome = f"{stage}: {type(exc).__name__}"
        except Exception as exc:  # the bug class this campaign hunts
            outcome = f"{stage}: UNHANDLED {type(exc).__name__}"
            stats["failures"].append({"example": i, "mutation": what, "stage": stage,
                                      "error": f"{type(exc).__name__}: {str(exc)[:300]}"})
        finally:
            faulthandler.cancel_dump_traceback_later()
        stats["max_seconds"] = max(stats["max_seconds"], time.perf_counter() - t0)
        stats["examples"] += 1
        stats["outcomes"][outcome] = stats["outcomes"].get(outcome, 0) + 1
    shutil.rmtree(work.parent, ignore_errors=True)
    Path(out).write_text(json.dumps(stats, indent=1))
    sys.exit(0)


def _run_campaign(mode, bundle, n, seed, tmp_path):
    import subprocess
    import sys

    out = tmp_path / f"{mode}-{seed}.json"
    proc = subprocess.run([sys.executable, __file__, mode, str(bundle), str(n), str(seed), str(out)],
                          capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0 and out.is_file(), f"fuzz child died (rc {proc.returncode}):\n{proc.stderr[-4000:]}"
    stats = json.loads(out.read_text())
    print(f"\n{mode} fuzz of {bundle.name}, seed {seed}: {json.dumps(stats, indent=1)}")
    assert stats["examples"] == n
    assert not stats["failures"], json.dumps(stats["failures"], indent=1)
    return stats


@pytest.mark.slow
@pytest.mark.parametrize("arch,n", [("gpt2", 200), ("t5", 60)])
def test_fuzz_manifest_mutations(tiny_bundle, tmp_path, arch, n):
    stats = _run_campaign("manifest", tiny_bundle(arch), n, 9, tmp_path)
    assert sum(v for k, v in stats["outcomes"].items() if k != "loaded and generated") > n // 2  # mutations bite


@pytest.mark.slow
@pytest.mark.parametrize("arch,n", [("gpt2", 200), ("t5", 60)])
def test_fuzz_onnx_bytes(tiny_bundle, tmp_path, arch, n):
    _run_campaign("onnx", tiny_bundle(arch), n, 9, tmp_path)


if __name__ == "__main__":
    import sys

    _fuzz_worker(sys.argv[1], sys.argv[2], int(sys.argv[3]), int(sys.argv[4]), sys.argv[5])
