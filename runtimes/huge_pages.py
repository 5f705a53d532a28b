"""Back the weights ONNX Runtime loads with transparent huge pages (Linux).

A decoding step on a CPU streams every weight once (the bench target: 93 MB per token). With 4 KiB
pages that is ~23,000 TLB entries a step; with 2 MiB pages, ~50. Where transparent huge pages are
``madvise`` only (common: Debian, Ubuntu, this project's CI and benchmark hosts), ONNX Runtime's
allocations never get them. After a session is built, ``collapse_new`` asks the kernel
(``madvise(MADV_COLLAPSE)``, Linux 6.1+) to move the memory the session allocated, chunk by 2 MiB
chunk, onto huge pages. Measured on the bench pair (AMD EPYC, 1 thread, greedy): plain decoding 15%
faster, speculative decoding 7% faster (benchmarks/huge_pages_ab.py; benchmarks/README.md, "Session 15").

Only chunks whose pages the kernel reports all resident (``mincore``) are collapsed, so sparse memory
stays sparse (the KV caches, allocated with np.empty after the session is built, are not touched in
any case), and only address ranges that appeared while the session was built are considered. A page
that was only ever read maps the shared zero page, counts as resident and gets a real page. The
contents do not change: the kernel copies them. This is an optimisation, so anything it cannot do
(another OS, a kernel before 6.1, base pages other than 4 KiB, no /proc, a refused madvise) it skips.
"""
from __future__ import annotations

import bisect
import ctypes
import mmap
import sys

_PAGE = 4096             # the base page this works with (x86-64, most arm64 kernels)
_HUGE = 2 << 20          # a PMD-sized transparent huge page over 4 KiB base pages
_MADV_COLLAPSE = 25      # <linux/mman.h>, Linux 6.1


def anonymous_ranges() -> list[tuple[int, int]]:
    """Sorted (start, end) of this process's private writable anonymous mappings; [] where there is
    no /proc or the base page is not 4 KiB."""
    if not sys.platform.startswith("linux") or mmap.PAGESIZE != _PAGE:
        return []
    try:
        with open("/proc/self/maps", "rb") as f:  # bytes: mapped files' names need not be UTF-8
            lines = f.read().splitlines()
    except OSError:
        return []
    out = []
    for line in lines:
        # start-end perms offset dev inode [path]: anonymous = inode 0, no path (or the heap)
        parts = line.split(maxsplit=5)
        if len(parts) < 5 or parts[1] != b"rw-p" or parts[4] != b"0" or (len(parts) > 5 and parts[5].strip() != b"[heap]"):
            continue
        lo, _, hi = parts[0].partition(b"-")
        try:
            out.append((int(lo, 16), int(hi, 16)))
        except ValueError:
            continue
    return sorted(out)


def new_ranges(before: list[tuple[int, int]], after: list[tuple[int, int]]) -> list[tuple[int, int]]:
    """The parts of ``after``'s ranges that no range of ``before`` (sorted, disjoint, as
    ``anonymous_ranges`` gives) covered: a mapping that grew keeps its old part out, since that may
    hold sparse buffers made earlier."""
    starts = [lo for lo, _ in before]
    out = []
    for lo, hi in after:
        i = max(0, bisect.bisect_right(starts, lo) - 1)   # the first old range that can overlap
        at = lo
        while i < len(before) and before[i][0] < hi:
            blo, bhi = before[i]
            if bhi > at:
                if blo > at:
                    out.append((at, blo))
                at = max(at, bhi)
            i += 1
        if at < hi:
            out.append((at, hi))
    return out


def collapse_new(before: list[tuple[int, int]]) -> int:
    """Collapse the fully resident 2 MiB chunks of the anonymous memory mapped since ``before``
    (from ``anonymous_ranges()``) onto huge pages; returns the bytes collapsed (0 where unsupported)."""
    ranges = new_ranges(before, anonymous_ranges())
    if not ranges:
        return 0
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        madvise, mincore = libc.madvise, libc.mincore
    except (OSError, AttributeError):
        return 0
    madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
    mincore.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_char_p]
    vec = ctypes.create_string_buffer(_HUGE // _PAGE)
    done = 0
    for lo, hi in ranges:
        a = -(-lo // _HUGE) * _HUGE
        while a + _HUGE <= hi:
            # every base page resident (bit 0 of each byte): collapsing commits no sparse memory
            if mincore(a, _HUGE, vec) == 0 and all(b & 1 for b in vec.raw):
                if madvise(a, _HUGE, _MADV_COLLAPSE) == 0:  # fails (EINVAL) before Linux 6.1: skipped
                    done += _HUGE
            a += _HUGE
    return done
