"""runtimes/huge_pages.py: which memory it moves onto huge pages, and that it changes nothing else."""
from __future__ import annotations

import ctypes
import mmap
import sys

import numpy as np
import pytest

from edgespec.runtimes import huge_pages
from edgespec.runtimes.huge_pages import new_ranges

linux = pytest.mark.skipif(not sys.platform.startswith("linux") or mmap.PAGESIZE != 4096,
                           reason="/proc/self/maps, mincore and MADV_COLLAPSE over 4 KiB pages are Linux's")
_PRIVATE = mmap.MAP_PRIVATE | getattr(mmap, "MAP_ANONYMOUS", 0x20)
_HUGE = huge_pages._HUGE


def test_new_ranges_keeps_only_what_no_old_mapping_covered():
    before = [(100, 200), (300, 400)]
    after = [(50, 250), (300, 450), (500, 600)]  # grown on both sides, grown at the end, new
    assert new_ranges(before, after) == [(50, 100), (200, 250), (400, 450), (500, 600)]
    assert new_ranges(before, before) == []
    assert new_ranges([], after) == after
    assert new_ranges([(0, 1000)], after) == []
    assert new_ranges([(120, 130), (140, 150)], [(100, 160)]) == [(100, 120), (130, 140), (150, 160)]


def _libc():
    libc = ctypes.CDLL(None, use_errno=True)
    libc.mincore.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_char_p]
    libc.madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
    return libc


def _resident_pages(arr: np.ndarray) -> int:
    lo = arr.ctypes.data // mmap.PAGESIZE * mmap.PAGESIZE
    n = (arr.ctypes.data + arr.nbytes - lo + mmap.PAGESIZE - 1) // mmap.PAGESIZE
    vec = ctypes.create_string_buffer(n)
    assert _libc().mincore(lo, n * mmap.PAGESIZE, vec) == 0
    return sum(b & 1 for b in vec.raw)


def _collapse_works() -> bool:
    """Whether this kernel collapses a written private region here (Linux 6.1+, huge pages not off,
    memory to spare): a probe, so that a host that cannot is not mistaken for a no-op mutant."""
    region = mmap.mmap(-1, 2 * _HUGE, flags=_PRIVATE)
    try:
        arr = np.frombuffer(region, dtype=np.uint8)
        arr[:] = 1
        a = -(-arr.ctypes.data // _HUGE) * _HUGE
        ok = _libc().madvise(a, _HUGE, huge_pages._MADV_COLLAPSE) == 0
        del arr
        return ok
    finally:
        region.close()


def _thp_always() -> bool:
    try:
        with open("/sys/kernel/mm/transparent_hugepage/enabled") as f:
            return "[always]" in f.read()
    except OSError:
        return False


@linux
def test_collapse_keeps_contents_and_commits_no_sparse_memory():
    before = huge_pages.anonymous_ranges()
    assert before, "a Linux process has anonymous mappings"
    # anonymous memory that nothing advised onto huge pages (numpy advises its own large arrays,
    # whose pages then fault in 2 MiB at a time), as ONNX Runtime's weights are
    dense = mmap.mmap(-1, 32 << 20, flags=_PRIVATE)
    data = np.frombuffer(dense, dtype=np.float64)
    data[:] = np.random.default_rng(0).standard_normal(data.size)      # 32 MiB, every page written
    copy = data.copy()
    # 64 MiB of it, sparse like a KV cache (np.empty); with huge pages 'always' a write faults in a
    # whole huge page, so there the region is not sparse to begin with
    region = mmap.mmap(-1, 64 << 20, flags=_PRIVATE)
    sparse = np.frombuffer(region, dtype=np.uint8)
    sparse[::_HUGE] = 1                                                 # one page written per 2 MiB
    touched = _resident_pages(sparse)
    done = huge_pages.collapse_new(before)
    assert done % _HUGE == 0 and done <= data.nbytes + copy.nbytes + (8 << 20)
    if _collapse_works():
        assert done >= _HUGE                                           # the dense region moved
    np.testing.assert_array_equal(data, copy)                          # the kernel copied, nothing changed
    if not _thp_always():
        assert touched <= 40
        assert _resident_pages(sparse) == touched                      # still sparse: never committed
    del sparse, data
    region.close()
    dense.close()


@linux
def test_collapse_touches_nothing_mapped_before():
    data = np.ones(16 << 20, dtype=np.uint8)                           # written before the snapshot
    assert huge_pages.collapse_new(huge_pages.anonymous_ranges()) == 0  # nothing new since
    assert data.sum() == data.size


def test_collapse_is_a_no_op_without_proc(monkeypatch):
    monkeypatch.setattr(huge_pages, "anonymous_ranges", lambda: [])
    assert huge_pages.collapse_new([]) == 0


def test_engine_and_clis_switch_it(tiny_bundle, tmp_path, monkeypatch, capsys):
    """huge_pages=True (the default) collapses after each CPU session is built; the API's
    huge_pages=False and the CLIs' --no-huge-pages never do; the output is the same either way."""
    import json

    import edgespec
    from edgespec.cli import main

    calls = []
    real = huge_pages.collapse_new
    monkeypatch.setattr(huge_pages, "collapse_new", lambda before: (calls.append(1), real(before))[1])
    b = tiny_bundle("llama")
    on = edgespec.load(b).generate("the cat", max_new_tokens=12, temperature=0, gamma=3).ids
    assert len(calls) == 2                                             # target and draft
    off = edgespec.load(b, huge_pages=False).generate("the cat", max_new_tokens=12, temperature=0, gamma=3).ids
    assert on == off and len(calls) == 2
    assert main(["generate", str(b), "--prompt", "the cat", "--max-new-tokens", "6", "--no-huge-pages", "--json"]) == 0
    assert main(["bench", str(b), "--gammas", "2", "--temperatures", "0", "--repeats", "1", "--max-new-tokens", "8",
                 "--no-huge-pages", "--quiet", "--out", str(tmp_path)]) == 0
    assert len(calls) == 2
    assert json.loads((tmp_path / "bench.json").read_text())["huge_pages"] is False
    from edgespec.errors import InvalidArgumentError

    with pytest.raises(InvalidArgumentError, match="huge_pages must be True or False"):
        edgespec.load(b, huge_pages="no")
    assert main(["generate", str(b), "--prompt", "the cat", "--max-new-tokens", "6", "--json"]) == 0
    assert len(calls) == 4


@linux
def test_maps_with_a_file_name_that_is_not_utf8(tmp_path):
    """/proc/self/maps names mapped files as bytes; one that is not UTF-8 must not break loading."""
    import os

    path = os.fsencode(tmp_path) + b"/caf\xe9.bin"
    fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o600)
    try:
        os.write(fd, b"x" * 4096)
        with mmap.mmap(fd, 4096):
            assert huge_pages.anonymous_ranges()
            huge_pages.collapse_new(huge_pages.anonymous_ranges())
    finally:
        os.close(fd)
