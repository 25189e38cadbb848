"""Restore hashes what it uploads; export starts writeback early.

What changed in behaviour, and what did not:
* the state sections are hashed as they land in the slots, in both verify modes: a file
  changed after the pre-allocation checks is caught (a verify-first restore used to
  upload the changed bytes unverified);
* verify=True (default) still verifies every digest before allocating: a corrupt file
  leaves the pools byte-identical, as every refusal must;
* verify="during" reads once: a digest mismatch found during the upload gives back
  every allocation; the old bytes of the slots it wrote come back with exact_rollback=True;
* padding and record problems are refused before anything is allocated in both modes;
* an export that will fsync asks the kernel to write back as it goes (sync_file_range)
  and writes the same bytes.
"""

from __future__ import annotations

import os
import shutil

import pytest

pytest.importorskip("torch")
from io_cases import export_from, identity, source, target  # noqa: E402

import hsnap_format as hf  # noqa: E402
from hsnap_testing import pools as sp  # noqa: E402
import hsnap_format.source  # noqa: E402
from hsnap_format import localfs  # noqa: E402
from hsnap_io import restore as restore_mod  # noqa: E402
from hsnap_io import restore_request  # noqa: E402

KIND = "hybrid_linear"


@pytest.fixture(scope="module")
def snap_path(tmp_path_factory):
    p = str(tmp_path_factory.mktemp("perf") / "req.hsnap")
    ps, req = source(KIND, 1)
    export_from(ps, req, p)
    return p


def _restore(path, ps, **kw):
    return restore_request(path, req_to_token_pool=ps.req_to_token_pool, token_to_kv_pool_allocator=ps.token_to_kv_pool_allocator,
                           identity=identity(), **kw)


def _flip(path, offset):
    fd = os.open(path, os.O_RDWR)
    try:
        b = os.pread(fd, 1, offset)
        os.pwrite(fd, bytes([b[0] ^ 0x40]), offset)
    finally:
        os.close(fd)


def _section(path, kind, i=0):
    with hf.open(path) as snap:
        return [s for s in snap.sections if s.kind == kind][i]


@pytest.fixture(params=["one thread", "two threads"])
def upload_threads(request, monkeypatch):
    """The upload on one thread, or on two (every payload, however small: what a large one gets)."""
    if request.param == "two threads":
        monkeypatch.setattr(restore_mod, "PARALLEL_STAGE_BYTES", 0)
    return request.param


@pytest.mark.parametrize("verify", ["two-pass", "during"])
@pytest.mark.parametrize("exact", [False, True])
def test_a_change_after_the_checks_is_caught_while_uploading(snap_path, tmp_path, monkeypatch, exact, verify, upload_threads):
    """Regression (verify-then-upload read the file twice): the file changes in place
    after open, checks and capacity, just before the upload; the bytes that land are
    hashed, so the restore is refused and rolled back. ("two-pass": verify=True on a
    payload over the one-read bound, which verifies, then reads and hashes again; under
    it verify=True uploads the bytes it hashed before allocating — tests/test_read_once.py.)"""
    if verify == "two-pass":
        monkeypatch.setattr(restore_mod, "ONE_READ_BYTES", 0)
        verify = True
    p = str(tmp_path / "req.hsnap")
    shutil.copy(snap_path, p)
    sec = _section(p, "temporal", 1)
    real = restore_mod.PoolCheckpoint

    def checkpoint_then_change(view):  # constructed right after check_unchanged, before allocating
        _flip(p, sec.offset + sec.length // 3)
        return real(view)

    monkeypatch.setattr(restore_mod, "PoolCheckpoint", checkpoint_then_change)
    ps = target(KIND, 1)
    before, copied = sp.pool_state_fingerprint(ps), sp.pool_state_copy(ps)
    with pytest.raises(hf.DigestMismatchError, match=sec.name):
        _restore(p, ps, exact_rollback=exact, verify=verify)
    changed = sp.diff_fingerprints(before, sp.pool_state_fingerprint(ps))
    if exact:
        assert changed == []
    else:  # allocations, mappings, rows: all given back; the written (now free) slots zeroed
        assert changed and all(c.startswith("buffers.") for c in changed), changed
        assert sp.refusal_changes(copied, ps) == []


def test_a_digest_mismatch_during_upload_gives_back_every_allocation(snap_path, tmp_path, upload_threads):
    p = str(tmp_path / "bad.hsnap")
    shutil.copy(snap_path, p)
    sec = _section(p, "temporal", 1)
    _flip(p, sec.offset + 5)
    ps = target(KIND, 1)
    before, copied = sp.pool_state_fingerprint(ps), sp.pool_state_copy(ps)
    with pytest.raises(hf.DigestMismatchError, match=sec.name):
        _restore(p, ps, verify="before")  # every byte verified before allocating
    assert sp.diff_fingerprints(before, sp.pool_state_fingerprint(ps)) == []  # the pools exactly as they were, byte for byte
    for verify in (True, "during"):  # the default reads once: found while uploading
        with pytest.raises(hf.DigestMismatchError, match=sec.name):
            _restore(p, ps, verify=verify)
        changed = sp.diff_fingerprints(before, sp.pool_state_fingerprint(ps))
        assert changed and all(c.startswith("buffers.") for c in changed), changed  # it did write: into fresh slots
        assert sp.refusal_changes(copied, ps) == []  # every allocation given back, what it wrote zeroed
    res = _restore(snap_path, ps)  # and the pools take the intact snapshot afterwards
    assert res.state_position == hf.open(snap_path).state_position


@pytest.mark.parametrize("verify", [True, "during"])
@pytest.mark.parametrize("what", ["padding", "record"])
def test_padding_and_record_are_refused_before_any_allocation(snap_path, tmp_path, what, verify):
    p = str(tmp_path / f"{what}.hsnap")
    shutil.copy(snap_path, p)
    with hf.open(p) as snap:
        at = snap.padding_ranges()[-1][0] if what == "padding" else snap.section("request.prompt_ids").offset
    _flip(p, at)
    ps = target(KIND, 1)
    before = sp.pool_state_fingerprint(ps)
    with pytest.raises(hf.DigestMismatchError, match="padding" if what == "padding" else "prompt_ids"):
        _restore(p, ps, verify=verify)
    assert sp.diff_fingerprints(before, sp.pool_state_fingerprint(ps)) == []  # byte-identical, no exact_rollback


def test_verified_restore_uploads_the_same_bytes(snap_path, upload_threads):
    a, b = target(KIND, 1), target(KIND, 1)
    c = target(KIND, 1)
    ra, rb, rc = _restore(snap_path, a, verify=True), _restore(snap_path, b, verify=False), _restore(snap_path, c, verify="during")
    assert ra.bytes_uploaded == rb.bytes_uploaded == rc.bytes_uploaded > 0
    assert sp.pool_state_fingerprint(a) == sp.pool_state_fingerprint(b) == sp.pool_state_fingerprint(c)
    with pytest.raises(ValueError, match="verify"):
        _restore(snap_path, target(KIND, 1), verify="sometimes")


def test_export_that_fsyncs_writes_back_early_and_writes_the_same_bytes(tmp_path, monkeypatch):
    if localfs.sync_file_range is None:
        pytest.skip("no sync_file_range on this platform")
    calls = []
    real = localfs.sync_file_range
    monkeypatch.setattr(localfs, "sync_file_range", lambda fd, off, n, flags: calls.append((off, n, flags)) or real(fd, off, n, flags))
    monkeypatch.setattr(hsnap_format.source, "WRITEBACK_BYTES", 4096)  # the small test request spans several ranges
    ps, req = source(KIND, 1)
    ident = identity(created_at="2026-01-01T00:00:00Z")
    from hsnap_io import export_request
    from io_cases import record

    def export(name, fsync):
        return export_request(str(tmp_path / name), req_to_token_pool=ps.req_to_token_pool, token_to_kv_pool_allocator=ps.token_to_kv_pool_allocator,
                              req_pool_idx=req.req_pool_idx, record=record(), identity=ident, fsync=fsync)

    export("a.hsnap", False)
    assert calls == []
    info = export("b.hsnap", True)
    assert calls and all(flags == 2 for _, _, flags in calls)
    ends = [off + n for off, n, _ in calls]
    assert [off for off, _, _ in calls] == [0] + ends[:-1]  # contiguous ranges in file order
    assert ends[-1] <= info.file_length
    assert (tmp_path / "a.hsnap").read_bytes() == (tmp_path / "b.hsnap").read_bytes()
