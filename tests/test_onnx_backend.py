"""ONNX Runtime backend: prefill / extend / rewind consistency, providers, protocol."""
from __future__ import annotations

import numpy as np
import pytest

from edgespec.backend import Backend
from edgespec.bundle import load_bundle
from edgespec.errors import InvalidArgumentError, PromptTooLongError, ProviderError
from edgespec.runtimes.onnx_backend import SessionConfig, available_providers, open_backend, resolve_providers

pytestmark = pytest.mark.slow


def _backends(bundle):
    m = load_bundle(bundle)
    return {role: (open_backend(bundle / mm.path, mm, SessionConfig(intra_op_threads=1)),
                   open_backend(bundle / mm.path, mm, SessionConfig(intra_op_threads=1)), mm)
            for role, mm in m.models.items()}


@pytest.mark.parametrize("arch", ["gpt2", "llama", "t5"])
def test_rewind_then_extend_matches_fresh(tiny_bundle, arch):
    rng = np.random.default_rng(0)
    for role, (be, fresh, mm) in _backends(tiny_bundle(arch)).items():
        assert isinstance(be, Backend)
        ids = rng.integers(4, 50, size=24)
        base = 1 if mm.kind == "seq2seq" else 6  # decoder tokens after prefill(ids[:6])
        be.prefill(ids[:6])
        assert be.length == base
        be.extend(ids[6:7])
        be.extend(ids[7:12])                      # k-token verify
        assert be.length == base + 6
        # Compare against a fresh prefill of the same tokens, built explicitly:
        be.prefill(ids[:6]); be.extend(ids[6:12])
        be.rewind_to(be.length - 3); l_rw = be.extend(ids[20:24])        # after a rejection of 3
        be.rewind_to(be.length - 1); l_rw2 = be.extend(ids[10:11])       # rewind by one, then 1 token
        fresh.prefill(ids[:6])
        l_ref = fresh.extend(np.concatenate([ids[6:9], ids[20:24]]))[-4:]
        fresh.rewind_to(fresh.length - 1)
        l_ref2 = fresh.extend(ids[10:11])
        assert np.abs(l_rw - l_ref).max() < 1e-4, (arch, role)
        assert np.abs(l_rw2 - l_ref2).max() < 1e-4, (arch, role)
        if mm.kind == "decoder":
            # last-position logits of a fresh prefill of the whole sequence
            whole = np.concatenate([ids[:9], ids[20:23], ids[10:11]])
            assert np.abs(fresh.prefill(whole) - l_rw2[-1]).max() < 1e-4, (arch, role)
        assert l_rw.shape == (4, mm.vocab_size)


def test_logits_survive_later_calls(tiny_bundle):
    (be, _, mm) = _backends(tiny_bundle("gpt2"))["draft"]
    a = be.prefill(np.array([4, 5, 6]))
    keep = a.copy()
    b = be.extend(np.array([7]))
    be.extend(np.array([8]))
    assert np.array_equal(a, keep) and b.shape == (1, mm.vocab_size)


@pytest.mark.parametrize("arch", ["gpt2", "t5"])
def test_limits_and_bad_ids(tiny_bundle, arch):
    (be, _, mm) = _backends(tiny_bundle(arch))["target"]
    with pytest.raises(InvalidArgumentError, match="token ids"):
        be.prefill(np.array([4, mm.vocab_size]))
    be.prefill(np.array([4, 5]))
    n = be.length
    for bad in ([6, mm.vocab_size], [-1]):  # extend checks the ids too, and leaves the cache as it was
        with pytest.raises(InvalidArgumentError, match=r"token ids must be in \[0, "):
            be.extend(np.array(bad))
        assert be.length == n
    if arch == "t5":
        return
    with pytest.raises(PromptTooLongError, match="positions"):
        be.prefill(np.arange(mm.max_positions + 1) % 50)
    be.prefill(np.array([4, 5]))
    with pytest.raises(InvalidArgumentError, match="rewind_to"):
        be.rewind_to(3)


def test_providers():
    assert resolve_providers(["cpu"]) == ("CPUExecutionProvider",)
    assert resolve_providers("CPUExecutionProvider") == ("CPUExecutionProvider",)
    with pytest.raises(ProviderError, match=r"not available.*available: .*cpu"):
        resolve_providers(["cuda", "cpu"])
    with pytest.raises(ProviderError, match="unknown execution provider 'no-such-ep': use a short name") as e:
        resolve_providers(["no-such-ep"])
    assert "onnxruntime-gpu" not in str(e.value)       # an unknown name is a typo, not a missing package
    # Azure's provider (installed with the CPU wheel) runs no model operator: refused, never listed
    for name in ("azure", "AzureExecutionProvider"):
        with pytest.raises(ProviderError, match="every node would fall back to the CPU; choose a compute provider: .*cpu"):
            resolve_providers([name, "cpu"])
    assert "azure" not in available_providers() and "cpu" in available_providers()
    with pytest.raises(ProviderError, match="unknown execution provider") as e:
        resolve_providers(["no-such-ep"])
    assert "azure" not in str(e.value)  # not offered as a short name to use
    with pytest.raises(ProviderError, match="has an empty item; separate names with single commas: cpu"):
        resolve_providers("cpu,,")
    with pytest.raises(InvalidArgumentError, match="threads"):
        SessionConfig(intra_op_threads=-1)


@pytest.mark.parametrize("arch", ["gpt2", "llama", "t5"])
def test_close_gives_the_kv_memory_back_and_the_engine_stays_usable(tiny_bundle, arch):
    import gc
    import weakref

    from edgespec.api import load

    eng = load(tiny_bundle(arch), threads=1)
    prompt = [5, 9, 4, 17, 5, 8]
    first = eng.generate(prompt, max_new_tokens=12, temperature=0.0, gamma=3).ids
    def flat(x):  # in-place layout: a list of buffers; ping-pong layout: two lists of them
        return [b for item in x for b in (flat(item) if isinstance(item, list) else [item])]

    bufs = [b for be in (eng.target, eng.draft) for b in flat(be._kv.buffers)]
    assert bufs and all(isinstance(b, np.ndarray) for b in bufs)
    refs = [weakref.ref(b) for b in bufs]
    del bufs
    eng.close()
    gc.collect()
    assert all(r() is None for r in refs)  # nothing holds the written buffers any more
    assert eng.generate(prompt, max_new_tokens=12, temperature=0.0, gamma=3).ids == first


@pytest.mark.parametrize("arch", ["llama", "t5"])  # the in-place layout and the ping-pong one
def test_a_failed_reallocation_leaves_nothing_bound_to_freed_memory(tiny_bundle, arch, monkeypatch):
    """free() dropped the KV buffers, then failed to allocate new ones (out of memory): the binding
    kept the freed buffers' pointers, and a caller that caught the error and went on had ONNX Runtime
    write the cache into freed memory (a review's find: other arrays were overwritten). Now the next
    call allocates again, and runs as a fresh backend does."""
    import edgespec.runtimes.onnx_backend as ob
    from edgespec.errors import InsufficientMemoryError

    be, fresh, _ = _backends(tiny_bundle(arch))["target"]
    prompt = np.array([5, 9, 4, 17, 5, 8])
    be.prefill(prompt)
    be.extend(np.array([3, 4]))
    real, calls = ob._alloc, []

    def second_fails(*a):
        calls.append(1)
        if len(calls) == 2:
            raise InsufficientMemoryError("injected: out of memory")
        return real(*a)

    monkeypatch.setattr(ob, "_alloc", second_fails)
    with pytest.raises(InsufficientMemoryError):
        be.free()
    monkeypatch.setattr(ob, "_alloc", real)
    got = be.prefill(prompt), be.extend(np.array([3, 4]))
    want = fresh.prefill(prompt), fresh.extend(np.array([3, 4]))
    for g, w in zip(got, want):
        np.testing.assert_allclose(g, w, rtol=1e-5, atol=1e-5)
    kv = be._kv  # what is bound is what is held
    held = [b for side in kv.buffers for b in side] if arch == "t5" else kv.buffers
    bound = [p for side in kv.ptrs for p in side] if arch == "t5" else kv.ptrs
    assert bound == [b.ctypes.data for b in held]


def test_rewind_to_takes_integer_positions_only(tiny_bundle):
    """A float position was taken (length 9.5) and the next call failed in ONNX Runtime's binding
    with a raw TypeError; the XLA backend refused it."""
    be, _, _ = _backends(tiny_bundle("llama"))["target"]
    be.prefill(np.array([5, 9, 4, 17, 5, 8]))
    for bad in (2.5, np.float64(3.0), True):
        with pytest.raises(InvalidArgumentError, match="needs an integer 0 <= n <= length=6"):
            be.rewind_to(bad)
    be.rewind_to(np.int64(4))
    assert be.length == 4 and type(be.length) is int
    assert be.extend(np.array([3])).shape[0] == 1
