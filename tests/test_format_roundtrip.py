"""Writer/reader round trips, the reference geometry's byte count, open cost, and
the writer's state machine and commit protocol."""

from __future__ import annotations

import math
import os

import ml_dtypes
import numpy as np
import pytest

import hsnap_format as hf
from hsnap_format import canonical, localfs, reference
from hsnap_format.errors import (
    DigestMismatchError,
    HsnapError,
    MalformedHeaderError,
    MalformedManifestError,
    SnapshotExistsError,
    WriterStateError,
)
from hsnap_format.layout import state_sections
from hsnap_format.manifest import SetWriter, SnapshotSet
from hsnap_format.reader import Snapshot
from hsnap_format.records import AttentionGeometry, Engine, Geometry, Identity, MambaGeometry, RequestRecord
from hsnap_format.spec import ALIGNMENT, DTYPES, HEADER_OFFSET, PREAMBLE, TRAILER, TMP_FILE_MARK
from hsnap_format.writer import SnapshotWriter, WriterState, write_snapshot

# ----------------------------------------------------------------------------- small models


def identity(**kw) -> Identity:
    base = dict(model_id="test/tiny", weights_version="w1", engine=Engine("sglang", "0.0", "abc"),
                snapshot_id="snap-1", created_at="2026-01-01T00:00:00Z", hsnap_version="1.0.0")
    return Identity(**{**base, **kw})


def hybrid_geometry(conv_shapes=((6, 3),), attention_kind="mha") -> Geometry:
    att = AttentionGeometry(kind=attention_kind, layers=(1, 3), heads=2, k_head_dim=4, v_head_dim=4,
                            dtype="bfloat16", storage_dtype="bfloat16")
    mam = MambaGeometry(layers=(0, 2), conv_shapes=conv_shapes, conv_dtype="bfloat16",
                        temporal_shape=(2, 3, 3), temporal_dtype="float32")
    return Geometry(attention=att, mamba=mam, num_layers=4)


def record(prompt=5, output=3, *, state_position=None, **kw) -> RequestRecord:
    rng = np.random.default_rng(prompt * 31 + output)
    return RequestRecord(
        rid=kw.pop("rid", "r-1"),
        prompt_ids=rng.integers(0, 1000, prompt),
        output_ids=rng.integers(0, 1000, output),
        state_position=prompt + output - 1 if state_position is None else state_position,
        **kw,
    )


def state_for(geom: Geometry, state_position: int, swa_start: int = 0, seed: int = 0) -> dict:
    rng = np.random.default_rng(seed)
    return {
        s.name: (rng.integers(-8, 9, s.shape) * 0.25).astype(DTYPES[s.dtype])
        for s in state_sections(geom, state_position, swa_start)
    }


def write_small(path, geom=None, rec=None, swa_start=0, **kw):
    geom = geom or hybrid_geometry()
    rec = rec or record()
    state = state_for(geom, rec.state_position, swa_start)
    info = write_snapshot(path, identity=identity(), geometry=geom, record=rec, state=state, swa_start=swa_start, **kw)
    return info, state, rec


def same_array(a: np.ndarray, b: np.ndarray) -> bool:
    return a.dtype == b.dtype and a.shape == b.shape and a.tobytes() == b.tobytes()


# ----------------------------------------------------------------------------- reference geometry


def test_reference_geometry_53_tokens(tmp_path):
    """One TP rank of Qwen3.5-35B-A3B at 53 committed tokens: 32,737,280 payload bytes, 4 KiB offsets."""
    geom, rec = reference.geometry(), reference.record(53)
    path = tmp_path / "ref.hsnap"
    with SnapshotWriter(path, identity=reference.identity(), geometry=geom, record=rec) as w:
        assert w.payload_bytes == 32_737_280
        for name, arr in reference.state_arrays(geom, 53):
            w.write_section(name, arr)
        info = w.commit()
    assert info.payload_bytes == 32_737_280
    with Snapshot(path) as snap:
        assert snap.payload_bytes == 32_737_280
        assert sum(s.length for s in snap.sections if s.is_state) == 32_737_280
        assert snap.preamble.data_offset % ALIGNMENT == 0
        assert all(s.offset % ALIGNMENT == 0 for s in snap.sections)
        assert snap.file_length == os.path.getsize(path) == snap.sections[-1].offset + snap.sections[-1].length + TRAILER.size
        assert len([s for s in snap.sections if s.kind in ("attn_k", "attn_v")]) == 20
        assert len([s for s in snap.sections if s.kind in ("conv", "temporal")]) == 60
        for name, arr in reference.state_arrays(geom, 53):
            assert same_array(np.asarray(snap[name]), arr), name
        snap.verify()
        got = snap.record()
        assert np.array_equal(got.prompt_ids, rec.prompt_ids) and np.array_equal(got.output_ids, rec.output_ids)


@pytest.mark.parametrize("tokens", [1, 53, 4096])
def test_reference_payload_formula(tokens):
    geom = reference.geometry()
    specs = state_sections(geom, tokens)
    payload = sum(math.prod(s.shape) * DTYPES[s.dtype].itemsize for s in specs)
    assert payload == 10 * 2 * tokens * 256 * 2 + 30 * (4096 * 3 * 2 + 16 * 128 * 128 * 4)


# ----------------------------------------------------------------------------- open cost


def _count_preads(monkeypatch):
    calls = []
    real = os.pread

    def pread(fd, n, offset):
        data = real(fd, n, offset)
        calls.append((offset, len(data)))
        return data

    def forbidden(*a, **k):
        raise AssertionError("open must read with pread only")

    monkeypatch.setattr(os, "pread", pread)
    monkeypatch.setattr(os, "read", forbidden)
    monkeypatch.setattr(os, "readv", forbidden, raising=False)
    return calls


def test_open_reads_only_preamble_header_trailer(tmp_path, monkeypatch):
    """Opening costs the same for a 32 MB and a 40 KB file: 64 + header + 64 bytes read, nothing else."""
    big = tmp_path / "big.hsnap"
    geom = reference.geometry()
    write_snapshot(big, identity=reference.identity(), geometry=geom, record=reference.record(53),
                   state=dict(reference.state_arrays(geom, 53)))
    small = tmp_path / "small.hsnap"
    write_small(small)
    calls = _count_preads(monkeypatch)
    for path in (big, small):
        calls.clear()
        snap = Snapshot(path)
        hlen, flen = snap.preamble.header_length, snap.file_length
        assert calls == [(0, PREAMBLE.size), (HEADER_OFFSET, hlen), (flen - TRAILER.size, TRAILER.size)]
        assert sum(n for _, n in calls) == PREAMBLE.size + hlen + TRAILER.size
        snap.close()
    assert os.path.getsize(big) > 32_000_000 and os.path.getsize(small) < 100_000


# ----------------------------------------------------------------------------- round trips


def test_hybrid_roundtrip_and_section_order(tmp_path):
    path = tmp_path / "h.hsnap"
    info, state, rec = write_small(path)
    with Snapshot(path) as snap:
        names = [s.name for s in snap.sections]
        assert names == [
            "mamba.0.conv.0", "mamba.0.temporal", "attn.1.k", "attn.1.v",
            "mamba.2.conv.0", "mamba.2.temporal", "attn.3.k", "attn.3.v",
            "request.prompt_ids", "request.output_ids",
        ]
        for name, arr in state.items():
            got = snap[name]
            assert same_array(np.asarray(got), arr)
            assert not got.flags.writeable
        assert snap.root_digest == info.root_digest
        assert {s.name: s.digest for s in snap.sections} == info.digests
        assert snap.file_length == info.file_length
        assert snap.header_bytes == canonical.dumps(snap.header)
        assert snap.version == (hf.MAJOR, 0)  # no 1.1 content: a writer stamps minor 0 (spec 9)
        assert snap.identity == identity()
        assert snap.geometry == hybrid_geometry()
        snap.verify()


def test_request_record_roundtrip_every_field(tmp_path):
    n_out = 4
    rec = record(
        6, n_out,
        rid="req-\u00e9\u6f22",
        output_logprobs=-np.arange(n_out, dtype=np.float32) / 4,
        top_logprob_ids=np.arange(n_out * 3).reshape(n_out, 3),
        top_logprob_values=-np.arange(n_out * 3, dtype=np.float32).reshape(n_out, 3) / 8,
        sampling={"temperature": 0.7, "top_p": 0.95, "min_p": 1e-05, "top_k": 20, "seed": 7, "stop_regex": None},
        max_new_tokens=64, min_new_tokens=2, stop_strings=("</s>", "\u505c", "a\"b\n"), stop_token_ids=(2, 151645),
        ignore_eos=True, streamed_tokens=3, streamed_text_chars=11, reasoning_tokens=2, reasoning_finished=True,
        rng_state=bytes(range(40)), extra={"priority": 3, "tags": ["a", "b"], "ratio": 0.5},
    )
    path = tmp_path / "r.hsnap"
    write_small(path, rec=rec)
    with Snapshot(path) as snap:
        got = snap.record()
        assert snap.request["remaining_budget"] == 60
        assert snap.request["top_logprobs_k"] == 3
        assert set(snap.header["features"]["optional"]) == {"sampler-rng-state", "top-logprobs"}
        assert snap.header["features"]["required"] == []
        assert b'"min_p":0.00001' in snap.header_bytes  # ECMAScript number form
    for f in ("rid", "state_position", "sampling", "max_new_tokens", "min_new_tokens", "stop_strings", "stop_token_ids",
              "ignore_eos", "streamed_tokens", "streamed_text_chars", "reasoning_tokens", "reasoning_finished", "rng_state", "extra"):
        assert getattr(got, f) == getattr(rec, f), f
    for f in ("prompt_ids", "output_ids", "output_logprobs", "top_logprob_ids", "top_logprob_values"):
        assert same_array(getattr(got, f), getattr(rec, f)), f
    assert got.remaining_budget == rec.remaining_budget == 60


def test_swa_geometry_roundtrip(tmp_path):
    att = AttentionGeometry(kind="swa", layers=(0, 2), heads=1, k_head_dim=4, v_head_dim=2, dtype="float16",
                            storage_dtype="float16", page_size=16, swa_layers=(1, 3), swa_window=4)
    geom = Geometry(attention=att, num_layers=4)
    rec = record(5, 2)  # state_position 6
    path = tmp_path / "swa.hsnap"
    _, state, _ = write_small(path, geom=geom, rec=rec, swa_start=2)
    with Snapshot(path) as snap:
        assert [s.name for s in snap.sections][:8] == ["attn.0.k", "attn.0.v", "swa.1.k", "swa.1.v", "attn.2.k", "attn.2.v", "swa.3.k", "swa.3.v"]
        assert snap["attn.0.k"].shape == (6, 1, 4) and snap["attn.0.v"].shape == (6, 1, 2)
        assert snap["swa.1.k"].shape == (4, 1, 4)  # state_position - swa_start rows
        assert snap.swa_start == 2 and snap.request["swa_start"] == 2
        assert snap.geometry.attention.page_size == 16
        for name, arr in state.items():
            assert same_array(np.asarray(snap[name]), arr)
        snap.verify()


def test_mla_fp8_roundtrip(tmp_path):
    att = AttentionGeometry(kind="mla", layers=(0, 1), heads=1, k_head_dim=6, v_head_dim=0, dtype="float8_e4m3fn",
                            storage_dtype="uint8", kv_lora_rank=4, qk_rope_head_dim=2)
    geom = Geometry(attention=att, num_layers=2)
    path = tmp_path / "mla.hsnap"
    _, state, rec = write_small(path, geom=geom)
    with Snapshot(path) as snap:
        assert [s.name for s in snap.sections][:2] == ["mla.0.kv", "mla.1.kv"]
        kv = snap["mla.0.kv"]
        assert kv.dtype == np.dtype(ml_dtypes.float8_e4m3fn) and kv.shape == (rec.state_position, 1, 6)
        # fp8 travels as its bytes: the uint8 view SGLang's pool holds
        assert bytes(snap.raw("mla.0.kv")) == state["mla.0.kv"].view(np.uint8).tobytes()
        snap.verify()


def test_multi_component_conv(tmp_path):
    geom = hybrid_geometry(conv_shapes=((4, 3), (2, 3), (2, 3)))
    path = tmp_path / "c.hsnap"
    _, state, _ = write_small(path, geom=geom)
    with Snapshot(path) as snap:
        assert [s.name for s in snap.sections][:4] == ["mamba.0.conv.0", "mamba.0.conv.1", "mamba.0.conv.2", "mamba.0.temporal"]
        assert snap["mamba.2.conv.1"].shape == (2, 3)
        for name, arr in state.items():
            assert same_array(np.asarray(snap[name]), arr)


def test_attention_only_and_mamba_only(tmp_path):
    geom = Geometry(attention=hybrid_geometry().attention, num_layers=4)
    write_small(tmp_path / "a.hsnap", geom=geom)
    geom = Geometry(attention=None, mamba=hybrid_geometry().mamba, num_layers=4)
    write_small(tmp_path / "m.hsnap", geom=geom)
    with Snapshot(tmp_path / "a.hsnap") as a, Snapshot(tmp_path / "m.hsnap") as m:
        assert a.geometry.mamba is None and all(s.kind in ("attn_k", "attn_v") for s in a.sections if s.is_state)
        assert m.geometry.attention is None and all(s.kind in ("conv", "temporal") for s in m.sections if s.is_state)
        a.verify()
        m.verify()


def test_zero_length_sections(tmp_path):
    """state_position 0 and no output: empty sections, the last one empty too; the trailer follows directly."""
    rec = record(1, 0, state_position=0)
    path = tmp_path / "z.hsnap"
    write_small(path, rec=rec)
    with Snapshot(path) as snap:
        assert snap["attn.1.k"].shape == (0, 2, 4)
        last = snap.sections[-1]
        assert last.name == "request.output_ids" and last.length == 0
        assert snap.file_length == last.offset + TRAILER.size
        assert all(s.offset % ALIGNMENT == 0 for s in snap.sections)
        snap.verify()


def test_chunked_write_equals_whole(tmp_path):
    geom, rec = hybrid_geometry(), record()
    state = state_for(geom, rec.state_position)
    whole = tmp_path / "whole.hsnap"
    write_snapshot(whole, identity=identity(), geometry=geom, record=rec, state=state)
    chunked = tmp_path / "chunked.hsnap"
    with SnapshotWriter(chunked, identity=identity(), geometry=geom, record=rec, preallocate=False) as w:
        for spec in w.pending_state_sections():
            w.begin_section(spec.name)
            raw = state[spec.name].reshape(-1).view(np.uint8)
            for i in range(0, len(raw), 7):
                w.write_chunk(raw[i : i + 7])
            w.write_chunk(b"")
            w.end_section()
        w.commit(fsync=False)
    assert whole.read_bytes() == chunked.read_bytes()


def test_unknown_optional_feature_is_recorded_and_ignored(tmp_path):
    path = tmp_path / "f.hsnap"
    write_small(path, features_optional=["some-future-thing"])
    with Snapshot(path) as snap:
        assert "some-future-thing" in snap.header["features"]["optional"]


def test_array_verify_and_record_verify_detect_corruption(tmp_path):
    path = tmp_path / "c.hsnap"
    write_small(path)
    with Snapshot(path) as snap:
        attn, prompt = snap.section("attn.1.k"), snap.section("request.prompt_ids")
    with open(path, "r+b") as f:
        for s in (attn, prompt):
            f.seek(s.offset)
            b = f.read(1)
            f.seek(s.offset)
            f.write(bytes([b[0] ^ 0x10]))
    with Snapshot(path) as snap:
        snap["attn.1.k"]  # unverified access is allowed
        with pytest.raises(DigestMismatchError, match="attn.1.k"):
            snap.array("attn.1.k", verify=True)
        with pytest.raises(DigestMismatchError, match="request.prompt_ids"):
            snap.record()
        with pytest.raises(DigestMismatchError):
            snap.verify()
        errors = {s.name: e for s, e in snap.iter_verify()}
        assert {n for n, e in errors.items() if e is not None} == {"attn.1.k", "request.prompt_ids"}


def test_closed_snapshot_refuses_access(tmp_path):
    path = tmp_path / "c.hsnap"
    write_small(path)
    snap = Snapshot(path)
    snap.close()
    with pytest.raises(HsnapError):
        snap["attn.1.k"]
    with pytest.raises(KeyError):
        Snapshot(path).section("nope")


def test_open_missing_and_non_regular(tmp_path):
    with pytest.raises(hf.HsnapIOError):
        Snapshot(tmp_path / "missing.hsnap")
    with pytest.raises(MalformedHeaderError):
        Snapshot(tmp_path)  # a directory
    target = tmp_path / "t.hsnap"
    write_small(target)
    link = tmp_path / "link.hsnap"
    link.symlink_to(target)
    with pytest.raises(hf.HsnapIOError):  # O_NOFOLLOW
        Snapshot(link)


# ----------------------------------------------------------------------------- writer state machine


def make_writer(path, **kw):
    rec = kw.pop("rec", None) or record()
    return SnapshotWriter(path, identity=identity(), geometry=hybrid_geometry(), record=rec, **kw), state_for(hybrid_geometry(), rec.state_position)


def leftovers(d) -> list[str]:
    return sorted(os.listdir(d))


def test_writer_out_of_order_calls(tmp_path):
    w, state = make_writer(tmp_path / "s.hsnap")
    first = w.next_section.name
    with pytest.raises(WriterStateError):
        w.write_chunk(b"x")  # not in a section
    with pytest.raises(WriterStateError):
        w.end_section()
    with pytest.raises(WriterStateError, match="section order"):
        w.begin_section("attn.1.k")  # not the next one
    with pytest.raises(WriterStateError, match="section order"):
        w.begin_section("request.prompt_ids")
    with pytest.raises(WriterStateError):
        w.commit()  # state sections missing
    w.begin_section(first)
    with pytest.raises(WriterStateError):
        w.begin_section(first)  # already in it
    with pytest.raises(WriterStateError):
        w.commit()  # in a section
    w.write_chunk(state[first])
    w.end_section()
    for spec in w.pending_state_sections():
        w.write_section(spec.name, state[spec.name])
    assert w.next_section.name == "request.prompt_ids"
    w.commit(fsync=False)
    assert w.state is WriterState.COMMITTED
    for call in (lambda: w.begin_section("x"), lambda: w.write_chunk(b""), w.end_section, w.commit):
        with pytest.raises(WriterStateError):
            call()
    w.abort()  # no-op once committed
    assert leftovers(tmp_path) == ["s.hsnap"]


@pytest.mark.parametrize("how", ["too-long", "too-short", "wrong-shape", "too-long-chunked"])
def test_writer_wrong_lengths_raise_and_abort(tmp_path, how):
    w, state = make_writer(tmp_path / "s.hsnap")
    spec = w.next_section
    arr = state[spec.name]
    with pytest.raises(WriterStateError, match=spec.name):
        if how == "too-long":
            w.begin_section(spec.name)
            w.write_chunk(np.concatenate([arr.reshape(-1), arr.reshape(-1)[:1]]))
        elif how == "too-short":
            w.begin_section(spec.name)
            w.write_chunk(arr.reshape(-1)[:-1])
            w.end_section()
        elif how == "wrong-shape":
            w.write_section(spec.name, arr.reshape(-1))
        else:
            w.begin_section(spec.name)
            w.write_chunk(arr)
            w.write_chunk(b"\0")
    assert w.state is WriterState.ABORTED
    assert leftovers(tmp_path) == []
    with pytest.raises(WriterStateError):
        w.begin_section(spec.name)


def test_abort_leaves_no_file(tmp_path):
    w, state = make_writer(tmp_path / "s.hsnap")
    spec = w.next_section
    w.write_section(spec.name, state[spec.name])
    assert len(leftovers(tmp_path)) == 1 and TMP_FILE_MARK in leftovers(tmp_path)[0]
    w.abort()
    w.abort()
    assert leftovers(tmp_path) == []


def test_exception_inside_with_aborts(tmp_path):
    with pytest.raises(RuntimeError):
        with make_writer(tmp_path / "s.hsnap")[0]:
            raise RuntimeError("boom")
    assert leftovers(tmp_path) == []
    with make_writer(tmp_path / "s.hsnap")[0]:
        pass  # left without commit
    assert leftovers(tmp_path) == []


def test_existing_final_name_refused(tmp_path):
    final = tmp_path / "s.hsnap"
    final.write_bytes(b"precious")
    with pytest.raises(SnapshotExistsError):
        make_writer(final)
    assert leftovers(tmp_path) == ["s.hsnap"] and final.read_bytes() == b"precious"
    (tmp_path / "d").mkdir()
    with pytest.raises(SnapshotExistsError):
        make_writer(tmp_path / "d")


def test_final_name_taken_during_write_is_not_overwritten(tmp_path):
    final = tmp_path / "s.hsnap"
    w, state = make_writer(final)
    for spec in w.pending_state_sections():
        w.write_section(spec.name, state[spec.name])
    final.write_bytes(b"someone else")
    with pytest.raises(SnapshotExistsError):
        w.commit(fsync=False)
    assert final.read_bytes() == b"someone else"
    assert leftovers(tmp_path) == ["s.hsnap"]
    assert w.state is WriterState.ABORTED


def test_nothing_under_final_name_before_commit(tmp_path, monkeypatch):
    final = tmp_path / "s.hsnap"
    seen = []

    def hook(phase):
        seen.append((phase, final.exists()))

    monkeypatch.setattr(localfs, "phase_hook", hook)
    w, state = make_writer(final)
    for spec in w.pending_state_sections():
        w.write_section(spec.name, state[spec.name])
    assert not final.exists()
    w.commit()
    phases = [p for p, _ in seen]
    assert phases.index("before-fsync") < phases.index("after-fsync") < phases.index("before-rename") < phases.index("after-rename")
    for phase, exists in seen:
        assert exists == (phase in ("after-rename", "committed")), phase
    with Snapshot(final) as snap:
        snap.verify()


def test_writer_validates_record(tmp_path):
    with pytest.raises(MalformedHeaderError, match="state_position"):
        make_writer(tmp_path / "a.hsnap", rec=record(2, 2, state_position=5))
    with pytest.raises(MalformedHeaderError, match="output_logprobs"):
        make_writer(tmp_path / "b.hsnap", rec=record(2, 2, output_logprobs=np.zeros(3, np.float32)))
    with pytest.raises(MalformedHeaderError, match="max_new_tokens"):
        make_writer(tmp_path / "c.hsnap", rec=record(2, 4, max_new_tokens=3))
    assert leftovers(tmp_path) == []


# ----------------------------------------------------------------------------- multi-rank


def write_set(path, tp=2, state_positions=None):
    sw = SetWriter(path)
    for r in range(tp):
        rec = record(state_position=None if state_positions is None else state_positions[r])
        geom = hybrid_geometry()
        write_snapshot(sw.rank_path(r), identity=identity(tp_size=tp, tp_rank=r), geometry=geom, record=rec,
                       state=state_for(geom, rec.state_position, seed=r))
    return sw


def test_multi_rank_roundtrip(tmp_path):
    final = tmp_path / "set"
    sw = write_set(final)
    assert not final.exists()
    m = sw.commit(tp_size=2)
    assert final.is_dir() and sorted(os.listdir(final)) == ["manifest.json", "rank-0.hsnap", "rank-1.hsnap"]
    assert [e for e in os.listdir(tmp_path) if e != "set"] == []  # staging renamed away
    with hf.open(final) as ss:
        assert isinstance(ss, SnapshotSet)
        assert ss.manifest == m
        assert ss.rank(1).identity.tp_rank == 1
        assert ss.rank(0).root_digest != ss.rank(1).root_digest
        ss.verify()
    with SnapshotSet(final, ranks=[1]) as ss:
        assert list(ss.ranks) == [1]


def test_set_writer_refuses_existing_and_inconsistent(tmp_path):
    (tmp_path / "taken").mkdir()
    with pytest.raises(SnapshotExistsError):
        SetWriter(tmp_path / "taken")
    sw = write_set(tmp_path / "bad", state_positions=[7, 6])
    with pytest.raises(MalformedManifestError):
        sw.commit(tp_size=2, fsync=False)
    assert not (tmp_path / "bad").exists()
    sw.abort()
    assert sorted(os.listdir(tmp_path)) == ["taken"]


# ----------------------------------------------------------------------------- writer refuses what the reader refuses


@pytest.mark.parametrize(
    "kw,field",
    [
        (dict(sampling={"logit_bias": {"1": 2.0}}), "request.sampling"),
        (dict(extra={"a": {"b": 1}}), "request.extra"),
        (dict(stop_token_ids=(2**31,)), "request.stop.stop_token_ids"),
        (dict(rid="x" * 5000), "request.rid"),
        (dict(streamed_text_chars=-1), "request.streamed.text_chars"),
        (dict(min_new_tokens=-1), "request.stop.min_new_tokens"),
    ],
)
def test_writer_refuses_a_record_the_reader_would_refuse(tmp_path, kw, field):
    with pytest.raises(MalformedHeaderError) as ei:
        make_writer(tmp_path / "s.hsnap", rec=record(**kw))
    assert ei.value.field == field
    assert leftovers(tmp_path) == []


@pytest.mark.parametrize("case", ["tp_rank_past_size", "model_id_not_str"])
def test_writer_refuses_identity_geometry_the_reader_would_refuse(tmp_path, case):
    ident, geom = identity(), hybrid_geometry()
    if case == "tp_rank_past_size":
        ident = identity(tp_size=2, tp_rank=2)
    else:
        ident = identity(model_id=5)
    rec = record()
    try:
        write_snapshot(tmp_path / "s.hsnap", identity=ident, geometry=geom, record=rec, state=state_for(geom, rec.state_position))
    except MalformedHeaderError:
        return
    Snapshot(tmp_path / "s.hsnap")  # the reader refuses what the writer wrote


def test_set_writer_refuses_wrong_tp_rank(tmp_path):
    sw = SetWriter(tmp_path / "set")
    for r in range(2):
        rec, geom = record(), hybrid_geometry()
        write_snapshot(sw.rank_path(r), identity=identity(tp_size=2, tp_rank=0), geometry=geom, record=rec,
                       state=state_for(geom, rec.state_position))
    try:
        sw.commit(tp_size=2, fsync=False)
    except MalformedManifestError:
        return
    SnapshotSet(tmp_path / "set")
