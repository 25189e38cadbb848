"""Disk full and I/O errors: a failed export raises a typed HsnapIOError, leaves
nothing under the final name and no temporary behind, and never touches the
source pools; a failed restore raises a typed error and leaves the target pools
exactly as before.

Faults come from a real full filesystem (a 1 MiB tmpfs; skipped where mounting
is not permitted) and from injected failures of os.pwrite / os.write / os.fsync /
renameat2 / the directory fsync / the section digest at the N-th call.
"""

from __future__ import annotations

import ctypes
import errno
import os
import stat
import subprocess
import sys
import tempfile

import pytest

import crash_child as cc
import hsnap_format as hf
from hsnap_format import localfs

pytest.importorskip("torch")
from hsnap_testing import pools as sp  # noqa: E402
from io_cases import identity, record, source, target  # noqa: E402

from hsnap_io import export_request, restore_request  # noqa: E402

ENOSPC = OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
EIO = OSError(errno.EIO, os.strerror(errno.EIO))
KIND = "hybrid_linear"


@pytest.fixture(scope="module")
def src():
    return source(KIND, 1)


def _export(ps, req, path, **kw):
    return export_request(path, req_to_token_pool=ps.req_to_token_pool, token_to_kv_pool_allocator=ps.token_to_kv_pool_allocator,
                          req_pool_idx=req.req_pool_idx, record=record(), identity=identity(), **kw)


def _nth(real, n, err, match=lambda *a: True):
    """``real`` that raises ``err`` at its n-th matching call (1-based) and passes every other call through."""
    seen = [0]

    def fake(*args):
        if match(*args):
            seen[0] += 1
            if seen[0] == n:
                raise err
        return real(*args)

    fake.seen = seen
    return fake


def _is_dir_fd(fd) -> bool:
    return stat.S_ISDIR(os.fstat(fd).st_mode)


def _export_fails(src, tmp_path, field):
    ps, req = src
    before = sp.pool_state_fingerprint(ps)
    path = tmp_path / "req.hsnap"
    with pytest.raises(hf.HsnapIOError) as info:
        _export(ps, req, path)
    assert field in info.value.field, info.value
    assert sp.diff_fingerprints(before, sp.pool_state_fingerprint(ps)) == []
    return info.value, sorted(os.listdir(tmp_path))


# ------------------------------------------------------------------ export: injected failures


@pytest.mark.parametrize("n", [1, 3, 7])
def test_export_write_enospc_mid_sections(src, tmp_path, monkeypatch, n):
    # section bytes start at data_offset (>= 4096); byte 0 holds the pending mark, written at create
    monkeypatch.setattr(os, "pwrite", _nth(os.pwrite, n, ENOSPC, match=lambda fd, data, off: off >= 4096))
    err, left = _export_fails(src, tmp_path, "write")
    assert left == [] and "No space left" in str(err)


@pytest.mark.parametrize("what,n,offset", [("pending mark", 1, 0), ("preamble+header", 1, 8), ("magic", 2, 0)])
def test_export_header_write_eio(src, tmp_path, monkeypatch, what, n, offset):
    monkeypatch.setattr(os, "pwrite", _nth(os.pwrite, n, EIO, match=lambda fd, data, off: off == offset))
    err, left = _export_fails(src, tmp_path, "create" if what == "pending mark" else "commit")
    assert left == []


def test_export_file_fsync_eio(src, tmp_path, monkeypatch):
    monkeypatch.setattr(os, "fsync", _nth(os.fsync, 1, EIO, match=lambda fd: not _is_dir_fd(fd)))
    err, left = _export_fails(src, tmp_path, "commit")
    assert left == [] and "Input/output error" in str(err)


def _failing_renameat2(code):
    def fake(olddir, old, newdir, new, flags):
        ctypes.set_errno(code)
        return -1

    return fake


@pytest.mark.parametrize("code", [errno.EIO, errno.ENOSPC, errno.EROFS])
def test_export_rename_fails(src, tmp_path, monkeypatch, code):
    if localfs._renameat2 is None:
        pytest.skip("no renameat2 here")
    monkeypatch.setattr(localfs, "_renameat2", _failing_renameat2(code))
    err, left = _export_fails(src, tmp_path, "rename")
    assert left == []


def test_export_rename_fallback_link_fails(src, tmp_path, monkeypatch):
    """Without renameat2 (other OS / filesystem) the file is published by link+unlink."""
    monkeypatch.setattr(localfs, "_renameat2", None)
    monkeypatch.setattr(os, "link", _nth(os.link, 1, EIO))
    err, left = _export_fails(src, tmp_path, "rename")
    assert left == []


def test_export_dir_fsync_eio_after_rename(src, tmp_path, monkeypatch):
    """The directory fsync fails after the rename: the name may not survive a crash, so
    the writer gives it back — a typed error, nothing under the final name, no temporary."""
    monkeypatch.setattr(os, "fsync", _nth(os.fsync, 1, EIO, match=_is_dir_fd))
    err, left = _export_fails(src, tmp_path, "fsync directory")
    assert left == []


@pytest.mark.parametrize("phase", ["open", "chunk", "before-fsync", "after-fsync"])
def test_export_phase_hook_raising_oserror_is_typed(src, tmp_path, monkeypatch, phase):
    def hook(p):
        if p == phase:
            raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(localfs, "phase_hook", hook)
    _, left = _export_fails(src, tmp_path, "")
    assert left == []


def test_export_short_header_write_is_never_committed(src, tmp_path, monkeypatch):
    real = os.pwrite

    def short(fd, data, off):
        if off == 0 and len(data) > 64:
            return real(fd, bytes(data)[: len(data) // 2], off)
        return real(fd, data, off)

    monkeypatch.setattr(os, "pwrite", short)
    ps, req = src
    _export(ps, req, tmp_path / "req.hsnap")  # a short write is continued, not an error
    with hf.open(tmp_path / "req.hsnap") as s:
        s.verify()


# ------------------------------------------------------------------ multi-rank writer: injected failures


def _set_with_ranks(path):
    w = hf.SetWriter(path)
    for r in range(2):
        ident, geom, rec, state = cc.tiny(tp_size=2, tp_rank=r, snapshot_id="s")
        hf.write_snapshot(w.rank_path(r), identity=ident, geometry=geom, record=rec, state=state)
    return w


@pytest.mark.parametrize("fault", ["manifest write", "manifest fsync", "staging fsync", "dir rename", "parent fsync"])
def test_set_commit_faults(tmp_path, monkeypatch, fault):
    path = tmp_path / "set"
    w = _set_with_ranks(path)
    if fault == "manifest write":
        monkeypatch.setattr(os, "pwrite", _nth(os.pwrite, 1, ENOSPC))
    elif fault == "manifest fsync":
        monkeypatch.setattr(os, "fsync", _nth(os.fsync, 1, EIO))
    elif fault == "staging fsync":
        monkeypatch.setattr(os, "fsync", _nth(os.fsync, 1, EIO, match=_is_dir_fd))
    elif fault == "dir rename":
        if localfs._renameat2 is None:
            pytest.skip("no renameat2 here")
        real, calls = localfs._renameat2, [0]

        def second_fails(*a):
            calls[0] += 1
            return _failing_renameat2(errno.EIO)(*a) if calls[0] == 2 else real(*a)

        monkeypatch.setattr(localfs, "_renameat2", second_fails)
    else:  # after the directory rename: the name is given back
        monkeypatch.setattr(os, "fsync", _nth(os.fsync, 2, EIO, match=_is_dir_fd))
    with pytest.raises(hf.HsnapError):
        w.commit(tp_size=2)
    monkeypatch.undo()
    assert not os.path.lexists(path)
    w.abort()
    assert os.listdir(tmp_path) == []


def test_set_short_manifest_write_is_continued(tmp_path, monkeypatch):
    path = tmp_path / "set"
    w = _set_with_ranks(path)
    real = os.pwrite
    monkeypatch.setattr(os, "pwrite", lambda fd, data, off: real(fd, bytes(data)[: max(1, len(data) // 2)], off))
    w.commit(tp_size=2)
    monkeypatch.undo()
    with hf.open(path) as s:
        s.verify()


# ------------------------------------------------------------------ a real full filesystem


@pytest.fixture
def tiny_fs():
    if os.geteuid() != 0:
        pytest.skip("mounting a tmpfs needs root")
    d = tempfile.mkdtemp(prefix="hsnap-fullfs-")
    proc = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=1m,mode=0700", "tmpfs", d], capture_output=True, text=True)
    if proc.returncode != 0:
        os.rmdir(d)
        pytest.skip(f"mount -t tmpfs not permitted here: {proc.stderr.strip()}")
    try:
        yield d
    finally:
        subprocess.run(["umount", d], check=False)
        os.rmdir(d)


def _fill(d, leave: int) -> str:
    """Take all but ``leave`` bytes of the filesystem with one file."""
    st = os.statvfs(d)
    free = st.f_bavail * st.f_frsize
    filler = os.path.join(d, "filler")
    with open(filler, "wb") as f:
        f.write(b"\xff" * max(0, free - leave))
    return filler


def test_export_onto_a_full_tmpfs(src, tiny_fs):
    ps, req = src
    _fill(tiny_fs, 16 << 10)
    before = sp.pool_state_fingerprint(ps)
    with pytest.raises(hf.HsnapIOError, match="No space left") as info:
        _export(ps, req, os.path.join(tiny_fs, "req.hsnap"))
    assert info.value.field == "preallocate"  # refused before any section is written
    assert sorted(os.listdir(tiny_fs)) == ["filler"]
    assert sp.diff_fingerprints(before, sp.pool_state_fingerprint(ps)) == []


def test_write_without_preallocation_onto_a_full_tmpfs(tiny_fs):
    """Without fallocate the disk fills during a section write: same outcome."""
    _fill(tiny_fs, 16 << 10)
    ident, geom, rec, state = cc.tiny(big=True)  # ~2 MB
    with pytest.raises(hf.HsnapIOError, match="No space left") as info:
        hf.write_snapshot(os.path.join(tiny_fs, "req.hsnap"), identity=ident, geometry=geom, record=rec, state=state, preallocate=False)
    assert info.value.field.startswith("write ")
    assert sorted(os.listdir(tiny_fs)) == ["filler"]


def test_set_onto_a_full_tmpfs(tiny_fs):
    path = os.path.join(tiny_fs, "set")
    w = hf.SetWriter(path)
    ident, geom, rec, state = cc.tiny(tp_size=2, tp_rank=0, snapshot_id="s")
    hf.write_snapshot(w.rank_path(0), identity=ident, geometry=geom, record=rec, state=state)
    _fill(tiny_fs, 0)
    ident, geom, rec, state = cc.tiny(tp_size=2, tp_rank=1, snapshot_id="s")
    with pytest.raises(hf.HsnapIOError, match="No space left"):
        hf.write_snapshot(w.rank_path(1), identity=ident, geometry=geom, record=rec, state=state)
    with pytest.raises(hf.HsnapError):
        w.commit(tp_size=2)
    w.abort()
    assert sorted(os.listdir(tiny_fs)) == ["filler"]


def test_manifest_onto_a_full_tmpfs(tiny_fs):
    path = os.path.join(tiny_fs, "set")
    w = _set_with_ranks(path)
    _fill(tiny_fs, 0)
    with pytest.raises(hf.HsnapIOError, match="No space left"):
        w.commit(tp_size=2)
    assert not os.path.lexists(path)
    w.abort()
    assert sorted(os.listdir(tiny_fs)) == ["filler"]


# ------------------------------------------------------------------ restore: read errors


@pytest.fixture(scope="module")
def snap_path(src, tmp_path_factory):
    ps, req = src
    p = str(tmp_path_factory.mktemp("faults") / "req.hsnap")
    _export(ps, req, p)
    return p


def _restore_fails(path, exc=hf.HsnapIOError, **kw):
    ps = target(KIND, 1)
    before = sp.pool_state_fingerprint(ps)
    with pytest.raises(exc) as info:
        restore_request(path, req_to_token_pool=ps.req_to_token_pool, token_to_kv_pool_allocator=ps.token_to_kv_pool_allocator, identity=identity(), **kw)
    assert sp.diff_fingerprints(before, sp.pool_state_fingerprint(ps)) == []
    return info.value


@pytest.mark.parametrize("which", ["first", "middle", "last"])
def test_restore_read_error_during_verify(snap_path, monkeypatch, which):
    """An I/O error while restore reads the payload (its verify pass and what it uploads:
    first, middle, last read): typed, target untouched. Every read is a pread, so a real
    one is an OSError too. (Counted on a restore that succeeds: the default
    verify reads a small payload once, into a staging buffer, before allocating.)"""
    real = os.preadv
    calls = [0]

    def counting(fd, buffers, offset):
        calls[0] += 1
        return real(fd, buffers, offset)

    monkeypatch.setattr(os, "preadv", counting)
    ps = target(KIND, 1)
    restore_request(snap_path, req_to_token_pool=ps.req_to_token_pool, token_to_kv_pool_allocator=ps.token_to_kv_pool_allocator,
                    identity=identity(), exact_rollback=True)
    total = calls[0]
    n = {"first": 1, "middle": total // 2, "last": total}[which]
    seen = [0]

    def failing(fd, buffers, offset):
        seen[0] += 1
        if seen[0] == n:
            raise EIO
        return real(fd, buffers, offset)

    monkeypatch.setattr(os, "preadv", failing)
    # the state sections are verified as they land: a read failing there is an
    # upload failure, rolled back byte for byte with exact_rollback
    err = _restore_fails(snap_path, exact_rollback=True)
    assert seen[0] == n and "Input/output error" in str(err)


def test_restore_open_error(snap_path, monkeypatch):
    monkeypatch.setattr(os, "pread", _nth(os.pread, 2, EIO))  # the header read
    err = _restore_fails(snap_path)
    assert "Input/output error" in str(err)


def test_restore_of_a_file_vanishing_is_typed(snap_path, tmp_path):
    err = _restore_fails(str(tmp_path / "gone.hsnap"))
    assert isinstance(err.os_error, FileNotFoundError)


_TRUNCATE_CHILD = r"""
import os, sys
sys.path.insert(0, sys.argv[2])
import crash_child as cc, hsnap_format as hf
p = sys.argv[1]
cc.write_single(p, 0, True)
s = hf.open(p)
os.truncate(p, 8192)  # another process rewrites the file in place (cp, rsync --inplace) or the disk fails
try:
    s.verify()
except hf.HsnapError as e:
    print("typed", type(e).__name__)
"""


def test_file_truncated_under_an_open_reader_is_typed(tmp_path):
    proc = subprocess.run([sys.executable, "-c", _TRUNCATE_CHILD, str(tmp_path / "t.hsnap"), os.path.dirname(__file__)],
                          capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0 and proc.stdout.startswith("typed"), (proc.returncode, proc.stderr[-500:])
