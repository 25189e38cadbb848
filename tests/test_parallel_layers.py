"""Format 1.4, feature ``parallel-layers`` (spec 5.2, 5.4, 9): a layer whose attention and Mamba mixer run side by
side (FalconH1) has its id in ``attention.layers`` and in ``mamba.layers``, and holds both groups' sections, attention
first.  The feature is required exactly when such a layer exists (R-5.2-2), so a 1.0 to 1.3 reader refuses the file by
name and reads every other file as before; the reference reader and the independent one (written from the spec)
agree on every verdict."""

from __future__ import annotations

import dataclasses
import struct
import sys
from pathlib import Path

import numpy as np
import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent))
import craft  # noqa: E402
import independent_reader as ir  # noqa: E402
from test_format_roundtrip import hybrid_geometry, identity, record, state_for  # noqa: E402

import hsnap_format as hf  # noqa: E402
from hsnap_format import reader  # noqa: E402
from hsnap_format.errors import MalformedHeaderError, UnsupportedFeatureError  # noqa: E402

VEC = Path(__file__).resolve().parents[1] / "spec" / "vectors"
PARALLEL = VEC / "parallel.hsnap"
FEATURE = "parallel-layers"


def _both_refuse(path: Path, exc: type[Exception], field: str) -> None:
    with pytest.raises(exc) as e:
        hf.Snapshot(path)
    assert e.value.field == field, e.value
    with pytest.raises(ir.HsnapSpecError) as e2:
        ir.read_snapshot(path)
    assert e2.value.kind == exc.__name__ and e2.value.field == field, e2.value


def test_a_parallel_layer_holds_attention_then_mamba_sections_in_both_readers():
    with hf.Snapshot(PARALLEL) as snap:
        snap.verify()
        assert snap.version == (1, 4) and snap.header["features"]["required"] == [FEATURE]
        assert snap.geometry.parallel_layers == (0, 1)
        assert [s.name for s in snap.sections if s.is_state] == [
            "attn.0.k", "attn.0.v", "mamba.0.conv.0", "mamba.0.temporal",
            "attn.1.k", "attn.1.v", "mamba.1.conv.0", "mamba.1.temporal"]
        ours = {s.name: snap.read(s).astype(np.float64) for s in snap.sections}
    theirs = ir.read_snapshot(PARALLEL)
    for name, arr in ours.items():
        assert np.array_equal(np.asarray(theirs.section(name)["values"], dtype=np.float64).reshape(arr.shape), arr), name


def test_readers_before_the_feature_refuse_it_by_name_and_read_every_other_vector(monkeypatch):
    monkeypatch.setattr(ir, "KNOWN_FEATURES", ir.KNOWN_FEATURES - {FEATURE})
    monkeypatch.setattr(reader, "KNOWN_FEATURES", reader.KNOWN_FEATURES - {FEATURE})
    with pytest.raises(UnsupportedFeatureError) as e:
        hf.Snapshot(PARALLEL)
    assert e.value.field == "header.features.required" and e.value.found == [FEATURE]
    with pytest.raises(ir.HsnapSpecError) as e2:
        ir.read_snapshot(PARALLEL)
    assert e2.value.kind == "UnsupportedFeatureError"
    others = [p for p in VEC.rglob("*.hsnap") if p != PARALLEL]
    assert len(others) >= 10
    for p in others:
        assert struct.unpack_from("<HH", p.read_bytes(), 8)[1] <= 3, p  # 1.4 stamps only files that use the feature
        with hf.Snapshot(p) as snap:
            assert FEATURE not in snap.header["features"]["required"]


def test_the_feature_without_a_parallel_layer_and_a_parallel_layer_without_it_are_refused(tmp_path):
    without = craft.mutate_header(PARALLEL.read_bytes(), lambda h: h["features"].update(required=[]))
    _both_refuse(Path(craft.write(tmp_path / "without.hsnap", without)), MalformedHeaderError, "geometry")
    needless = craft.mutate_header((VEC / "hybrid.hsnap").read_bytes(), lambda h: h["features"].update(required=[FEATURE]))
    _both_refuse(Path(craft.write(tmp_path / "needless.hsnap", needless)), MalformedHeaderError, "geometry")


def test_sliding_window_and_full_attention_layers_stay_apart(tmp_path):
    """1.4 lets a layer be attention *and* Mamba, never full *and* sliding-window attention."""
    def overlap(h):
        h["geometry"]["attention"].update(kind="swa", swa_layers=[3], swa_window=4)
    data = craft.mutate_header((VEC / "hybrid.hsnap").read_bytes(), overlap)
    with pytest.raises(MalformedHeaderError) as e:
        hf.Snapshot(craft.write(tmp_path / "swa.hsnap", data))
    assert e.value.field == "geometry.attention"


def test_the_writer_requires_the_feature_exactly_for_parallel_layers(tmp_path):
    plain = hybrid_geometry()
    parallel = dataclasses.replace(plain, mamba=dataclasses.replace(plain.mamba, layers=(1, 2)))  # layer 1 is both
    rec = record()
    for name, geom, required, minor in (("plain", plain, [], 0), ("parallel", parallel, [FEATURE], 4)):
        state = state_for(geom, rec.state_position)
        hf.write_snapshot(tmp_path / f"{name}.hsnap", identity=identity(), geometry=geom, record=rec, state=state)
        with hf.Snapshot(tmp_path / f"{name}.hsnap") as snap:
            snap.verify()
            assert snap.header["features"]["required"] == required and snap.version == (1, minor)
            for s, arr in state.items():
                assert np.array_equal(snap.read(s), arr), s
        ir.read_snapshot(tmp_path / f"{name}.hsnap")
    with hf.Snapshot(tmp_path / "parallel.hsnap") as snap:
        assert [s.name for s in snap.sections if s.layer == 1] == ["attn.1.k", "attn.1.v", "mamba.1.conv.0", "mamba.1.temporal"]
