"""runtimes/huge_pages.py: which memory it moves onto huge pages, and that it changes nothing else."""
from __future__ import annotations

import ctypes
import mmap
import sys

import numpy as np
import pytest

from edgespec.runtimes import huge_pages
from edgespec.runtimes.huge_pages import new_ranges

linux = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="/proc/self/maps and madvise are Linux's")


def test_new_ranges_keeps_only_what_no_old_mapping_covered():
    before = [(100, 200), (300, 400)]
    after = [(50, 250), (300, 450), (500, 600)]  # grown on both sides, grown at the end, new
    assert new_ranges(before, after) == [(50, 100), (200, 250), (400, 450), (500, 600)]
    assert new_ranges(before, before) == []
    assert new_ranges([], after) == after


def _resident_pages(arr: np.ndarray) -> int:
    libc = ctypes.CDLL(None, use_errno=True)
    libc.mincore.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_char_p]
    lo = arr.ctypes.data // 4096 * 4096
    n = (arr.ctypes.data + arr.nbytes - lo + 4095) // 4096
    vec = ctypes.create_string_buffer(n)
    assert libc.mincore(lo, n * 4096, vec) == 0
    return sum(b & 1 for b in vec.raw)


def _collapse_supported() -> bool:
    """MADV_COLLAPSE exists (Linux 6.1) and transparent huge pages are not switched off."""
    import os
    import re

    m = re.match(r"(\d+)\.(\d+)", os.uname().release)
    try:
        with open("/sys/kernel/mm/transparent_hugepage/enabled") as f:
            off = "[never]" in f.read()
    except OSError:
        return False
    return bool(m) and (int(m[1]), int(m[2])) >= (6, 1) and not off


@linux
def test_collapse_keeps_contents_and_commits_no_sparse_memory():
    before = huge_pages.anonymous_ranges()
    assert before, "a Linux process has anonymous mappings"
    # anonymous memory that nothing advised onto huge pages (numpy advises its own large arrays,
    # whose pages then fault in 2 MiB at a time), as ONNX Runtime's weights are
    dense = mmap.mmap(-1, 32 << 20, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    data = np.frombuffer(dense, dtype=np.float64)
    data[:] = np.random.default_rng(0).standard_normal(data.size)      # 32 MiB, every page written
    copy = data.copy()
    # 64 MiB of it, sparse like a KV cache (np.empty)
    region = mmap.mmap(-1, 64 << 20, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    sparse = np.frombuffer(region, dtype=np.uint8)
    sparse[::2 << 20] = 1                                              # one page written per 2 MiB
    touched = _resident_pages(sparse)
    assert touched <= 40
    done = huge_pages.collapse_new(before)
    # the kernel may not support MADV_COLLAPSE (before Linux 6.1): then nothing happens at all
    assert done % (2 << 20) == 0 and done <= data.nbytes + copy.nbytes + (8 << 20)
    if _collapse_supported():
        assert done >= 2 << 20                                         # the dense region moved
    np.testing.assert_array_equal(data, copy)                          # the kernel copied, nothing changed
    assert _resident_pages(sparse) == touched                          # still sparse: never committed
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


def test_engine_and_clis_with_huge_pages_off(tiny_bundle, tmp_path, capsys):
    """Off (the API's huge_pages=False, the CLIs' --no-huge-pages) is plain ONNX Runtime: same output."""
    import json

    import edgespec
    from edgespec.cli import main

    b = tiny_bundle("llama")
    ids = [[t for t in edgespec.load(b, huge_pages=hp).generate("the cat", max_new_tokens=12, temperature=0, gamma=3).ids]
           for hp in (True, False)]
    assert ids[0] == ids[1]
    assert main(["generate", str(b), "--prompt", "the cat", "--max-new-tokens", "6", "--no-huge-pages", "--json"]) == 0
    assert main(["bench", str(b), "--gammas", "2", "--temperatures", "0", "--repeats", "1", "--max-new-tokens", "8",
                 "--no-huge-pages", "--quiet", "--out", str(tmp_path)]) == 0
    assert json.loads((tmp_path / "bench.json").read_text())["huge_pages"] is False
