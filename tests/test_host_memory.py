"""Large host buffers hsnap allocates (a restore's staging buffer and undo log, a section read whole) never ask the
kernel for huge pages: where it compacts memory for such a request at fault time, the first touch stalls."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from hsnap_format.buffers import HUGE_PAGE_REQUEST_BYTES, host_empty

THP = Path("/sys/kernel/mm/transparent_hugepage/enabled")


def _thp_eligible(a: np.ndarray) -> bool:
    """Whether the mapping holding ``a`` may get transparent huge pages (/proc/self/smaps)."""
    at, eligible, inside = a.ctypes.data + a.nbytes // 2, None, False  # (numpy advises its aligned middle)
    for line in Path("/proc/self/smaps").read_text().splitlines():
        head = line.split()[0]
        if "-" in head and not head.endswith(":"):
            lo, hi = (int(x, 16) for x in head.split("-"))
            inside = lo <= at < hi
        elif inside and head == "THPeligible:":
            eligible = line.split()[1] == "1"
    assert eligible is not None, "no mapping holds the array"
    return eligible


def test_host_empty_is_a_writable_array_of_the_asked_size_and_type():
    for count, dtype in ((10, np.uint8), (HUGE_PAGE_REQUEST_BYTES // 4, np.float32), (3 << 20, np.uint16)):
        a = host_empty(count, dtype)
        assert a.shape == (count,) and a.dtype == np.dtype(dtype) and a.flags.writeable and a.flags.c_contiguous
        a[:] = 7
        assert int(a[-1]) == 7


@pytest.mark.skipif(not THP.exists() or "[madvise]" not in THP.read_text(), reason="huge pages here are not only on request")
def test_a_large_buffer_asks_for_no_huge_pages_where_numpy_would():
    n = 8 << 20
    numpy_own, ours = np.empty(n, np.uint8), host_empty(n)
    assert _thp_eligible(numpy_own)  # numpy asks for them on an array this large
    assert not _thp_eligible(ours)


def test_kept_buffers_hand_back_the_smallest_that_fits_and_stay_within_their_bound():
    from hsnap_format.buffers import KeptBuffers

    kept = KeptBuffers(100)
    a, b = kept.take(60), kept.take(30)
    assert a.nbytes == 60 and b.nbytes == 30 and a is not b
    kept.give(a)
    kept.give(b)
    assert [x.nbytes for x in kept.buffers] == [60, 30]
    assert kept.take(20) is b and kept.take(20) is a  # the smallest that holds it, each handed out once
    assert kept.take(20) is not a and kept.buffers == ()
    kept.give(kept.take(101))  # over the bound: never kept
    assert kept.buffers == ()
    kept.give(a)
    kept.give(b)
    c = kept.take(70)  # nothing kept holds 70 bytes: a new one
    assert c is not a and c is not b and c.nbytes == 70
    kept.give(c)  # 70 + 60 + 30 over 100: the smallest go first, until the rest fits
    assert [x.nbytes for x in kept.buffers] == [70]
