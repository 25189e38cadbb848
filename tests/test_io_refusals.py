"""Every refused restore names what is wrong with a typed error and leaves the
target pools exactly as they were (free lists and every buffer byte)."""

from __future__ import annotations

import os
import shutil
import struct

import pytest

pytest.importorskip("torch")
import torch  # noqa: E402
import xxhash  # noqa: E402
from io_cases import export_from, identity, record, source, target  # noqa: E402

import hsnap_format as hf  # noqa: E402
from hsnap_testing import pools as sp  # noqa: E402
from hsnap_io import NumericsWarning, UnsupportedPoolError, restore_request, view_pools  # noqa: E402
from hsnap_io import transfer  # noqa: E402

KIND = "hybrid_linear"


def _export(path, kind=KIND, page=1, ident=None):
    ps, req = source(kind, page)
    export_from(ps, req, path, ident)
    return ps, req


@pytest.fixture(scope="module")
def snap_path(tmp_path_factory):
    p = str(tmp_path_factory.mktemp("refuse") / "req.hsnap")
    _export(p)
    return p


def _restore_refused(path, ps, exc_type, ident=None, **kw):
    before = sp.pool_state_fingerprint(ps)
    with pytest.raises(exc_type) as info:
        restore_request(path, req_to_token_pool=ps.req_to_token_pool, token_to_kv_pool_allocator=ps.token_to_kv_pool_allocator, identity=ident or identity(), **kw)
    assert sp.diff_fingerprints(before, sp.pool_state_fingerprint(ps)) == []
    assert isinstance(info.value, hf.HsnapError)
    return info.value


def test_wrong_weights_version_names_the_field(snap_path):
    err = _restore_refused(snap_path, target(KIND, 1), hf.IncompatibleSnapshotError, identity(weights_version="w2"))
    assert err.differences == [("identity.weights_version", "w2", "w1")]
    assert snap_path in str(err) and "weights_version" in str(err)


def test_every_differing_binding_field_is_named(snap_path):
    ident = identity(model_id="other/model", engine=hf.Engine("sglang", "0.5.24", "abc"), tp_size=2)
    err = _restore_refused(snap_path, target(KIND, 1), hf.IncompatibleSnapshotError, ident)
    fields = {f for f, _, _ in err.differences}
    assert {"identity.model_id", "identity.engine.version", "identity.engine.commit", "identity.tp_size"} <= fields


def test_wrong_layout_is_refused(snap_path):
    err = _restore_refused(snap_path, target("mha", 1), hf.IncompatibleSnapshotError)
    fields = {f for f, _, _ in err.differences}
    assert "geometry.mamba" in fields and "geometry.attention.layers" in fields


def test_other_head_count_is_refused_whatever_the_page_size(tmp_path):
    # the page size is no geometry difference (spec 5.2; tests/test_hardening_io.py, any target page size)
    p = str(tmp_path / "mha16.hsnap")
    _export(p, "mha", 16)
    other = sp.build("mha", size=1024, page_size=64, seed=9, head_num=4)
    err = _restore_refused(p, other, hf.IncompatibleSnapshotError)
    assert err.differences == [("geometry.attention.heads", 4, 2)]


def test_newer_major_version_is_refused(snap_path, tmp_path):
    p = tmp_path / "v2.hsnap"
    data = bytearray(open(snap_path, "rb").read())
    struct.pack_into("<H", data, 8, 2)
    struct.pack_into("<Q", data, 56, xxhash.xxh3_64_intdigest(bytes(data[:56])))
    p.write_bytes(bytes(data))
    err = _restore_refused(str(p), target(KIND, 1), hf.UnsupportedVersionError)
    assert "2.0" in str(err)


def test_corrupted_section_is_refused_before_any_allocation(snap_path, tmp_path):
    p = tmp_path / "bad.hsnap"
    shutil.copy(snap_path, p)
    with hf.open(snap_path) as snap:
        sec = [s for s in snap.sections if s.kind == "temporal"][1]
    with open(p, "r+b") as f:
        f.seek(sec.offset + sec.length // 2)
        b = f.read(1)
        f.seek(sec.offset + sec.length // 2)
        f.write(bytes([b[0] ^ 0x10]))
    # verified as it lands in the slots: the allocations are given back; the
    # freed slots' old bytes too with exact_rollback (tests/test_perf_restore.py: without)
    err = _restore_refused(str(p), target(KIND, 1), hf.DigestMismatchError, exact_rollback=True)
    assert sec.name in str(err)


@pytest.mark.parametrize("what", ["tokens", "mamba", "rows"])
def test_target_without_room_is_refused(snap_path, what):
    ps = sp.build(KIND, size=64, page_size=1, seed=3)
    fill = {"tokens": dict(n=1, tokens=40), "mamba": dict(n=ps.mamba_allocator.available_size(), tokens=1), "rows": dict(n=ps.req_to_token_pool.available_size(), tokens=1)}[what]
    sp.occupy(ps, fill["n"], fill["tokens"], seed=4)
    err = _restore_refused(snap_path, ps, hf.CapacityError)
    assert "does not fit" in str(err)


def _flaky_upload(monkeypatch, fail_at=4):
    real = transfer.HostEngine.import_section
    calls = {"n": 0}

    def flaky(self, buffer, rows, src, host=None):
        calls["n"] += 1
        if calls["n"] == fail_at:
            raise OSError(5, "Input/output error")
        return real(self, buffer, rows, src, host)

    monkeypatch.setattr(transfer.HostEngine, "import_section", flaky)
    return calls


def test_failure_mid_upload_with_exact_rollback_restores_every_byte(snap_path, monkeypatch):
    calls = _flaky_upload(monkeypatch)
    err = _restore_refused(snap_path, target(KIND, 1), hf.HsnapIOError, exact_rollback=True)
    assert calls["n"] == 4 and "Input/output error" in str(err)


def test_failure_mid_upload_gives_back_every_allocation(snap_path, monkeypatch):
    """Default contract: allocations, mappings and the request row come back exactly;
    only the bytes of slots that are free again may differ (nothing reads them)."""
    ps = target(KIND, 1)
    before = sp.pool_state_fingerprint(ps)
    free_tokens = set(ps.token_to_kv_pool_allocator.free_pages.tolist())
    calls = _flaky_upload(monkeypatch)
    with pytest.raises(hf.HsnapIOError):
        restore_request(snap_path, req_to_token_pool=ps.req_to_token_pool, token_to_kv_pool_allocator=ps.token_to_kv_pool_allocator, identity=identity())
    after = sp.pool_state_fingerprint(ps)
    changed = sp.diff_fingerprints(before, after)
    assert calls["n"] == 4
    assert all(name.startswith("buffers.") and "req_to_token" not in name and "mapping" not in name for name in changed), changed
    assert set(ps.token_to_kv_pool_allocator.free_pages.tolist()) == free_tokens


def test_manifest_naming_a_missing_or_different_rank_file(tmp_path):
    staging = tmp_path / "staging"
    staging.mkdir()
    for r in (0, 1):
        _export(str(staging / f"rank-{r}.hsnap"), ident=identity(tp_size=2, tp_rank=r))
    w = hf.SetWriter(str(tmp_path / "snap"), staging=str(staging))
    w.commit(tp_size=2)
    snapdir = tmp_path / "snap"
    ok = restore_request(str(snapdir), req_to_token_pool=(t := target(KIND, 1)).req_to_token_pool, token_to_kv_pool_allocator=t.token_to_kv_pool_allocator, identity=identity(tp_size=2, tp_rank=1))
    assert ok.state_position == record().state_position
    # a different file under rank 1's name
    os.unlink(snapdir / "rank-1.hsnap")
    _export(str(snapdir / "rank-1.hsnap"), ident=identity(tp_size=2, tp_rank=1, snapshot_id="s2"))
    err = _restore_refused(str(snapdir), target(KIND, 1), hf.MalformedManifestError, identity(tp_size=2, tp_rank=1))
    assert "rank 1" in str(err)
    os.unlink(snapdir / "rank-1.hsnap")
    err = _restore_refused(str(snapdir), target(KIND, 1), hf.MalformedManifestError, identity(tp_size=2, tp_rank=1))
    assert "missing" in str(err)


def test_other_numerics_warn_but_restore(snap_path):
    ps = target(KIND, 1)
    other = identity(numerics={"torch": "9.9", "threads": 64, "device": "cpu"})
    with pytest.warns(NumericsWarning, match="bit-exactness"):
        res = restore_request(snap_path, req_to_token_pool=ps.req_to_token_pool, token_to_kv_pool_allocator=ps.token_to_kv_pool_allocator, identity=other)
    assert {f for f, _, _ in res.numerics_differences} == {"identity.numerics.torch", "identity.numerics.threads"}


def test_unknown_pool_kind_is_refused():
    class WeirdPool:
        pass

    class Alloc:
        def get_kvcache(self):
            return WeirdPool()

    with pytest.raises(UnsupportedPoolError, match="WeirdPool"):
        view_pools(object(), Alloc())


def test_swa_pool_beside_mamba_pool_still_exports_mamba_once():
    # SWAKVPool's cpu copy ignores mamba indices; the adapter must not.
    ps, _ = source("swa_mamba", 1)
    view = view_pools(ps.req_to_token_pool, ps.token_to_kv_pool_allocator)
    kv_carries = type(ps.kv_pool).cpu_copy_carries_mamba
    assert kv_carries is False
    temporal = [b for b in view.bindings if b.kind == "temporal"]
    assert len(temporal) == len(ps.mamba_pool.mamba_layer_ids)
    ps2, _ = source("hybrid_linear", 1)
    assert type(ps2.kv_pool).cpu_copy_carries_mamba is True
    view2 = view_pools(ps2.req_to_token_pool, ps2.token_to_kv_pool_allocator)
    names = [b.name for b in view2.bindings]
    assert len(names) == len(set(names))
    assert sum(b.kind == "temporal" for b in view2.bindings) == len(ps2.mamba_pool.mamba_layer_ids)
    assert all(b.buffer.device == torch.device("cpu") for b in view2.bindings)
