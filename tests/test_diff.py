"""hsnap_format.tools.diff and `hsnap diff`: per-section comparison, header differences, exit codes."""

from __future__ import annotations

import json
import math
import tracemalloc

import ml_dtypes
import numpy as np
import pytest

from hsnap_format import AttentionGeometry, Geometry, MambaGeometry, open_snapshot, write_snapshot
from hsnap_format import reference as ref
from hsnap_format.tools.cli import main as hsnap
from hsnap_format.tools.diff import (
    DIFFER, EQUAL, ONLY_A, ONLY_B, SHAPE_MISMATCH, compare_arrays, diff_snapshots, header_differences, section_pairs,
)


# ---------------------------------------------------------------------------- arrays


def test_identical_arrays():
    a = np.arange(12, dtype=np.float32).reshape(3, 4)
    r = compare_arrays(a, a.copy())
    assert (r.count_differ, r.max_abs_diff, r.max_rel_diff, r.first_index) == (0, 0.0, 0.0, None)


def test_first_difference_across_chunks():
    a = np.zeros(20, dtype=np.float32)
    b = a.copy()
    b[13], b[17] = 0.5, -2.0
    r = compare_arrays(a, b, chunk_elements=3)
    assert (r.count_differ, r.first_index, r.first_a, r.first_b) == (2, 13, 0.0, 0.5)
    assert r.max_abs_diff == 2.0 and r.max_rel_diff == 1.0


def test_nan_inf_semantics():
    a = np.array([np.nan, np.inf, np.inf, 1.0, np.nan, -0.0], dtype=np.float32)
    b = np.array([np.nan, np.inf, 1.0, np.nan, 2.0, 0.0], dtype=np.float32)
    r = compare_arrays(a, b)
    # NaN==NaN and inf==inf and -0==+0 are equal; inf vs 1 and NaN vs number differ
    assert r.count_differ == 3 and r.first_index == 2
    assert r.max_abs_diff == math.inf and r.max_rel_diff == math.inf


def test_tolerances_are_symmetric():
    a = np.array([1.0, 100.0, 0.0], dtype=np.float64)
    b = np.array([1.05, 101.0, 1e-9], dtype=np.float64)
    assert compare_arrays(a, b).count_differ == 3
    assert compare_arrays(a, b, atol=0.1).count_differ == 1  # 100 vs 101
    assert compare_arrays(a, b, rtol=0.05).count_differ == 1  # 0 vs 1e-9
    assert compare_arrays(a, b, atol=1e-8, rtol=0.05).count_differ == 0
    assert compare_arrays(b, a, atol=1e-8, rtol=0.05).count_differ == 0


def test_inf_is_never_close_with_tolerance():
    a = np.array([np.inf], dtype=np.float32)
    assert compare_arrays(a, np.array([1.0], dtype=np.float32), rtol=0.5).count_differ == 1


def test_int64_compares_exactly():
    a = np.array([2**60, 3], dtype=np.int64)
    b = np.array([2**60 + 1, 3], dtype=np.int64)  # equal once rounded to float64
    r = compare_arrays(a, b)
    assert r.count_differ == 1 and r.first_a == 2**60 and r.first_b == 2**60 + 1


def test_bf16_against_float32_in_float64():
    a = np.array([1.0, 1.5, 3.0], dtype=ml_dtypes.bfloat16)
    b = np.array([1.0, 1.5, 3.0078125], dtype=np.float32)
    r = compare_arrays(a, b)
    assert r.count_differ == 1 and r.max_abs_diff == 0.0078125


def test_stop_at_first():
    a, b = np.zeros(10), np.ones(10)
    assert compare_arrays(a, b, chunk_elements=2, stop_at_first=True).count_differ == 2


def test_memory_stays_bounded():
    a = np.zeros(4 << 20, dtype=ml_dtypes.bfloat16)
    b = a.copy()
    b[-1] = 1
    tracemalloc.start()
    try:
        r = compare_arrays(a, b, chunk_elements=1 << 16)
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert r.first_index == (4 << 20) - 1
    assert peak < 8 << 20, peak  # float64 copies of both would be 64 MiB


# ---------------------------------------------------------------------------- snapshots


def _geometry(heads=2, mamba=True) -> Geometry:
    return Geometry(
        attention=AttentionGeometry("mha", (0, 2), heads, 8, 8, "bfloat16", "bfloat16"),
        mamba=MambaGeometry((1, 3), ((16, 3),), "bfloat16", (2, 4, 4), "float32") if mamba else None,
        num_layers=4,
    )


def _write(path, geom=None, *, edit=None, streamed=4, model="tiny/hybrid") -> str:
    geom = geom or _geometry()
    ident = ref.identity(snapshot_id="t")
    ident = type(ident)(**{**ident.__dict__, "model_id": model, "tp_size": 1})
    rec = ref.record(state_position=12, outputs=4, seed=1)
    rec.streamed_tokens = streamed
    state = dict(ref.state_arrays(geom, 12))
    if edit:
        edit(state)
    write_snapshot(path, identity=ident, geometry=geom, record=rec, state=state)
    return str(path)


def _bump(name, index, delta=1.0):
    def edit(state):
        arr = np.array(state[name])
        arr[index] = arr[index] + delta
        state[name] = arr
    return edit


@pytest.fixture(scope="module")
def snaps(tmp_path_factory):
    d = tmp_path_factory.mktemp("diff")
    return {
        "a": _write(d / "a.hsnap"),
        "a2": _write(d / "a2.hsnap"),
        "b": _write(d / "b.hsnap", edit=_bump("mamba.3.temporal", (1, 2, 3), 0.25)),
        "heads": _write(d / "heads.hsnap", _geometry(heads=1)),
        "attn": _write(d / "attn.hsnap", _geometry(mamba=False)),
        "req": _write(d / "req.hsnap", streamed=3, model="other/model"),
    }


def _diff(x, y, **kw):
    with open_snapshot(x) as a, open_snapshot(y) as b:
        return diff_snapshots(a, b, **kw)


def test_same_content_is_same(snaps):
    r = _diff(snaps["a"], snaps["a2"])
    assert r.same and all(s.status == EQUAL for s in r.sections) and len(r.sections) == 11


def test_one_changed_element(snaps):
    r = _diff(snaps["a"], snaps["b"])
    assert not r.same
    [d] = r.differing
    assert (d.name, d.status, d.first_diff, d.count_differ, d.elements) == ("mamba.3.temporal", DIFFER, (1, 2, 3), 1, 32)
    assert math.isclose(d.max_abs_diff, 0.25, rel_tol=1e-6)
    assert math.isclose(d.first_b - d.first_a, 0.25, rel_tol=1e-5)
    assert _diff(snaps["a"], snaps["b"], atol=0.3).same


def test_shape_mismatch_and_missing_sections(snaps):
    r = _diff(snaps["a"], snaps["heads"])
    by = {s.name: s.status for s in r.sections}
    assert by["attn.0.k"] == SHAPE_MISMATCH and by["request.prompt_ids"] == EQUAL
    assert ("geometry.attention.heads", 2, 1) in r.headers[0].geometry
    r = _diff(snaps["a"], snaps["attn"])
    by = {s.name: s.status for s in r.sections}
    assert by["mamba.1.conv.0"] == ONLY_A and by["attn.0.k"] in (EQUAL, DIFFER)
    r = _diff(snaps["attn"], snaps["a"])
    assert {s.name: s.status for s in r.sections}["mamba.3.temporal"] == ONLY_B
    with open_snapshot(snaps["attn"]) as a, open_snapshot(snaps["a"]) as b:
        assert [p.name for p in section_pairs(a, b)][-1] == "mamba.3.temporal"  # A's order, then B's extras


def test_header_differences(snaps):
    with open_snapshot(snaps["a"]) as a, open_snapshot(snaps["req"]) as b:
        h = header_differences(a, b)
        r = diff_snapshots(a, b)
    assert ("identity.model_id", "tiny/hybrid", "other/model") in h.identity
    assert ("request.streamed.tokens", 4, 3) in h.request
    assert not h.geometry and not r.same and not r.differing  # same data, different headers


def test_report_json_is_strict_json(snaps):
    doc = _diff(snaps["a"], snaps["b"]).to_dict()
    json.dumps(doc, allow_nan=False)
    assert doc["summary"]["differ"] == 1 and doc["same"] is False
    assert doc["sections"][7]["first_diff"] == [1, 2, 3]


def test_negative_tolerance_is_refused(snaps):
    with pytest.raises(ValueError):
        _diff(snaps["a"], snaps["a"], atol=-1)


# ---------------------------------------------------------------------------- CLI


def test_cli_exit_codes(snaps, capsys):
    assert hsnap(["diff", snaps["a"], snaps["a2"]]) == 0
    assert "snapshots same" in capsys.readouterr().out
    assert hsnap(["diff", snaps["a"], snaps["b"]]) == 1
    out = capsys.readouterr().out
    assert "mamba.3.temporal" in out and "[1, 2, 3]" in out and "attn.0.k" not in out
    assert hsnap(["diff", snaps["a"], snaps["b"], "--atol", "0.5"]) == 0


def test_cli_error_is_one_line_and_exit_2(snaps, capsys, tmp_path):
    bad = tmp_path / "bad.hsnap"
    bad.write_bytes(b"not a snapshot at all")
    assert hsnap(["diff", snaps["a"], str(bad)]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith("hsnap diff: BadMagicError")
    assert hsnap(["diff", snaps["a"], str(tmp_path / "missing")]) == 2
    assert hsnap(["diff", snaps["a"], snaps["a"], "--rtol", "-1"]) == 2
    with pytest.raises(SystemExit) as e:
        hsnap(["diff", snaps["a"]])
    assert e.value.code == 2


def test_cli_json_and_names_only(snaps, capsys):
    assert hsnap(["diff", snaps["a"], snaps["req"], "--json"]) == 1
    doc = json.loads(capsys.readouterr().out)
    assert doc["same"] is False and doc["headers"]["0"]["identity"][0]["field"] == "identity.model_id"
    assert hsnap(["diff", snaps["a"], snaps["b"], "--names-only"]) == 1
    assert capsys.readouterr().out.splitlines() == ["mamba.3.temporal"]
    assert hsnap(["diff", snaps["a"], snaps["req"], "--names-only"]) == 1
    assert capsys.readouterr().out.splitlines() == ["identity.model_id", "request.streamed.tokens"]


def test_cli_diff_is_a_normal_subcommand():
    from hsnap_format.tools import cli

    assert "diff" not in cli.registered_commands()
