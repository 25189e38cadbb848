"""hsnap_format.tools.stats: chunked statistics, exact for bf16/fp8, bounded memory."""

from __future__ import annotations

import glob
import json
import math
import os
import tracemalloc

import ml_dtypes
import numpy as np
import pytest

from hsnap_format.tools.stats import Cancelled, array_stats, is_float, sample, section_stats


def _reference(arr: np.ndarray) -> dict:
    x = arr.astype(np.float64).reshape(-1)
    f = x[np.isfinite(x)]
    return {
        "nan": int(np.isnan(x).sum()),
        "posinf": int((x == np.inf).sum()),
        "neginf": int((x == -np.inf).sum()),
        "zero": int((x == 0).sum()),
        "finite": f.size,
        "min": float(f.min()),
        "max": float(f.max()),
        "mean": float(f.mean()),
        "std": float(f.std()),
    }


def _check(arr, chunk_elements):
    s, ref = array_stats(arr, chunk_elements=chunk_elements), _reference(arr)
    assert s.count == arr.size
    for k in ("nan", "posinf", "neginf", "zero", "finite"):
        assert getattr(s, k) == ref[k], k
    assert s.min == ref["min"] and s.max == ref["max"]
    assert math.isclose(s.mean, ref["mean"], rel_tol=1e-12, abs_tol=1e-12)
    assert math.isclose(s.std, ref["std"], rel_tol=1e-10)


@pytest.mark.parametrize("dtype", [np.float32, np.float16, ml_dtypes.bfloat16, ml_dtypes.float8_e5m2])
@pytest.mark.parametrize("chunk_elements", [7, 1 << 20])
def test_float_stats_match_float64_reference(dtype, chunk_elements):
    rng = np.random.default_rng(0)
    arr = (rng.standard_normal((5, 3, 41)) * 3 + 1).astype(dtype)
    flat = arr.reshape(-1)
    flat[[3, 50]] = np.nan
    flat[10] = np.inf
    flat[11] = -np.inf
    flat[[20, 21, 22]] = 0
    _check(arr, chunk_elements)


def test_fp8_e4m3fn_has_nan_but_no_inf():
    arr = np.array([1.5, -448, 448, 0, 0.125], dtype=np.float32).astype(ml_dtypes.float8_e4m3fn)
    arr = np.concatenate([arr, np.array([np.nan], dtype=ml_dtypes.float8_e4m3fn)])
    s = array_stats(arr, chunk_elements=2)
    assert (s.nan, s.posinf, s.neginf, s.zero, s.finite) == (1, 0, 0, 1, 5)
    assert (s.min, s.max) == (-448.0, 448.0)
    assert math.isclose(s.mean, (1.5 - 448 + 448 + 0 + 0.125) / 5)


def test_integer_stats_are_exact():
    arr = np.array([2**62, -(2**62) - 1, 0, 5], dtype=np.int64)
    s = array_stats(arr, chunk_elements=3)
    assert s.min == -(2**62) - 1 and s.max == 2**62 and isinstance(s.min, int)
    assert (s.nan, s.zero, s.finite) == (0, 1, 4)


def test_bool_and_empty():
    s = array_stats(np.array([True, False, True]))
    assert (s.min, s.max, s.zero) == (0, 1, 1)
    assert math.isclose(s.mean, 2 / 3)
    e = array_stats(np.zeros((0, 4), dtype=ml_dtypes.bfloat16))
    assert (e.count, e.finite, e.min, e.mean, e.std) == (0, 0, None, None, None)


def test_all_nan_gives_no_moments():
    s = array_stats(np.full(10, np.nan, dtype=np.float32))
    assert (s.nan, s.finite, s.min, s.mean) == (10, 0, None, None)


def test_cancelled_stops_the_scan():
    calls = []

    def cancelled():
        calls.append(1)
        return len(calls) > 2

    with pytest.raises(Cancelled):
        array_stats(np.zeros(100, dtype=np.float32), chunk_elements=10, cancelled=cancelled)
    assert len(calls) == 3


def test_memory_stays_bounded_for_a_big_bf16_section():
    """A float64 copy of 4M elements would be 32 MiB; chunked it stays at a few chunks."""
    arr = np.ones(4 << 20, dtype=ml_dtypes.bfloat16)
    tracemalloc.start()
    try:
        s = array_stats(arr, chunk_elements=1 << 16)
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert s.mean == 1.0 and s.std == 0.0
    assert peak < 4 << 20, peak


def test_sample_and_is_float():
    assert is_float(ml_dtypes.bfloat16) and is_float(np.float16) and not is_float(np.int32) and not is_float(np.bool_)
    assert sample(np.arange(10, dtype=np.int32), 3) == [0, 1, 2]
    got = sample(np.array([[1.5, 2.5]], dtype=ml_dtypes.bfloat16))
    assert got == [1.5, 2.5] and all(isinstance(v, float) for v in got)


def test_section_stats_on_a_snapshot(tmp_path):
    from hsnap_format import open_snapshot, write_snapshot
    from hsnap_format import reference as ref
    from hsnap_format.records import AttentionGeometry, Geometry

    geom = Geometry(AttentionGeometry("mha", (0,), 1, 4, 4, "bfloat16", "bfloat16"), num_layers=1)
    rec = ref.record(state_position=6, outputs=2)
    state = dict(ref.state_arrays(geom, 6))
    write_snapshot(tmp_path / "s.hsnap", identity=ref.identity(), geometry=geom, record=rec, state=state)
    with open_snapshot(tmp_path / "s.hsnap") as snap:
        s = section_stats(snap, "attn.0.k")
        assert s == array_stats(state["attn.0.k"])
        assert s.count == 6 * 4


VECTORS = sorted(glob.glob(os.path.join(os.path.dirname(__file__), "..", "spec", "vectors", "*.json")))


@pytest.mark.parametrize("description", VECTORS or [pytest.param(None, marks=pytest.mark.skip(reason="no spec/vectors yet"))])
def test_golden_vector_stats_match_their_logical_values(description):
    """Each vector's JSON lists every section's values as plain numbers (bf16/fp8 decoded):
    stats read from the file must equal stats of those numbers."""
    from hsnap_format import open_snapshot

    with open(description) as f:
        doc = json.load(f)
    if "sections" not in doc:
        pytest.skip("a directory description")
    with open_snapshot(os.path.join(os.path.dirname(description), doc["file"])) as snap:
        for sec in doc["sections"]:
            if "values" not in sec or not sec["values"]:
                continue
            got = section_stats(snap, sec["name"])
            ref = _reference(np.array(sec["values"], dtype=np.float64))
            assert (got.count, got.nan, got.zero, got.finite) == (len(sec["values"]), ref["nan"], ref["zero"], ref["finite"]), sec["name"]
            assert (got.min, got.max) == (ref["min"], ref["max"]), sec["name"]
            assert math.isclose(got.mean, ref["mean"], rel_tol=1e-12, abs_tol=1e-15), sec["name"]
