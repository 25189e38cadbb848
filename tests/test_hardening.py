"""Regressions for trust defects on the format side (gc, verify, read paths,
descriptors, diff, writer inputs, error text). Each test failed on the code before
the fix."""

from __future__ import annotations

import gc as pygc
import json
import os
import shutil
import threading
import time

import numpy as np
import pytest

import crash_child as cc
import hsnap_format as hf
from hsnap_format import localfs
from hsnap_format.tools import cli
from hsnap_format.stores import gc as hgc
from hsnap_format.tools.diff import CORRUPT, diff_snapshots
from hsnap_format.tools.stats import section_stats

VECTORS = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "spec", "vectors")


def _dead_pid() -> int:
    pid = os.fork()
    if pid == 0:
        os._exit(0)
    os.waitpid(pid, 0)
    return pid


def _single(path, seed=0):
    cc.write_single(str(path), seed)
    return str(path)


def _in_child(fn) -> tuple[int | None, int | None]:
    """Run ``fn`` in a forked child: (exit status, signal). A SIGBUS kills only the child."""
    pid = os.fork()
    if pid == 0:
        code = 99
        try:
            code = fn()
        except BaseException:  # noqa: BLE001 - reported through the exit status
            code = 98
        os._exit(code if isinstance(code, int) else 0)
    _, status = os.waitpid(pid, 0)
    return (os.WEXITSTATUS(status) if os.WIFEXITED(status) else None, os.WTERMSIG(status) if os.WIFSIGNALED(status) else None)


def _first_state_section(snap):
    return next(s for s in snap.sections if s.is_state and s.length)


def _flip_in_place(path, offset):
    """Change one byte without changing size or inode (what an in-place corruption does)."""
    with open(path, "r+b") as f:
        f.seek(offset)
        b = f.read(1)
        f.seek(offset)
        f.write(bytes([b[0] ^ 0xFF]))


# ------------------------------------------------------------------ gc never deletes a committed snapshot


@pytest.mark.parametrize("name", [".a.hsnap.hsnap-tmp-{pid}-0a1b2c3d", ".a.hsnap-staging-{pid}-0a1b2c3d", "x.hsnap-tmp-1", ".hsnap-pending"])
def test_writers_refuse_leftover_names_as_final_names(tmp_path, name):
    final = tmp_path / name.format(pid=_dead_pid())
    ident, geom, rec, state = cc.tiny()
    with pytest.raises(hf.ReservedNameError, match="final name"):
        hf.write_snapshot(final, identity=ident, geometry=geom, record=rec, state=state)
    with pytest.raises(hf.ReservedNameError):
        hf.SetWriter(final)
    assert os.listdir(tmp_path) == []


def test_a_committed_file_renamed_into_a_dead_writers_temporary_name_survives(tmp_path):
    golden = _single(tmp_path / "g.hsnap")
    data = open(golden, "rb").read()
    victim = tmp_path / f".a.hsnap.hsnap-tmp-{_dead_pid()}-0a1b2c3d"
    os.rename(golden, victim)
    for older in (None, 0):
        [item] = hgc.collect(tmp_path, remove=True, older_than=older)
        assert item.action == "kept" and not item.removable and "complete snapshot" in item.reason, item
    assert open(victim, "rb").read() == data


def test_a_committed_set_renamed_into_a_dead_writers_staging_name_survives(tmp_path):
    cc.write_set(str(tmp_path / "set"))
    victim = tmp_path / f".set.hsnap-staging-{_dead_pid()}-0a1b2c3d"
    os.rename(tmp_path / "set", victim)
    for older in (None, 0):
        [item] = hgc.collect(tmp_path, remove=True, older_than=older)
        assert item.action == "kept" and "manifest.json" in item.reason, item
    with hf.open(victim) as s:
        s.verify()


def test_a_user_directory_with_a_staging_like_name_is_not_emptied(tmp_path):
    runs = tmp_path / f".runs.hsnap-staging-{_dead_pid()}-0a1b2c3d"
    runs.mkdir()
    for name, seed in (("a.hsnap", 0), ("b.hsnap", 1)):  # moved in: writers refuse such a directory
        os.rename(_single(tmp_path / name, seed), runs / name)
    [item] = hgc.collect(tmp_path, remove=True, older_than=0)
    assert item.action == "kept" and "marker" in item.reason, item
    assert sorted(os.listdir(runs)) == ["a.hsnap", "b.hsnap"]


def test_a_snapshot_swapped_in_between_scan_and_removal_is_handed_back(tmp_path):
    """Scan proves a real leftover; before removal a committed set takes its name (an
    ext4 inode number may even be reused): gc re-proves what it holds and gives it back."""
    cc.write_set(str(tmp_path / "set"))
    stg = tmp_path / f".s.hsnap-staging-{_dead_pid()}-0a1b2c3d"
    localfs.make_staging_dir(str(stg))
    [item] = hgc.scan(tmp_path)
    assert item.removable
    shutil.rmtree(stg)
    os.rename(tmp_path / "set", stg)
    hgc._remove_staging(item)
    assert item.action == "failed" and "changed between scan and removal" in item.reason and "put back" in item.reason
    with hf.open(stg) as s:
        s.verify()
    # the same for a single file
    g = _single(tmp_path / "g.hsnap")
    tmp = tmp_path / f".a.hsnap.hsnap-tmp-{_dead_pid()}-0a1b2c3d"
    tmp.write_bytes(localfs.pending_preamble("x") + b"data")
    [item] = [i for i in hgc.scan(tmp_path) if i.kind == hgc.FILE]
    os.unlink(tmp)
    os.rename(g, tmp)
    hgc._remove_file(item)
    assert item.action == "failed" and "put back" in item.reason
    with hf.open(tmp) as s:
        s.verify()


def test_real_leftovers_of_dead_writers_are_still_removed(tmp_path):
    """The positive side: what a killed writer really leaves is proved and removed —
    also when it was killed in the commit's long fsync (the magic is written after it)."""
    _, seq, _, _ = cc.fork_trial(cc.write_single, str(tmp_path / "probe.hsnap"))
    os.unlink(tmp_path / "probe.hsnap")
    for phase in ("open", "chunk", "after-fsync"):
        how, seen, _, _ = cc.fork_trial(cc.write_single, str(tmp_path / f"{phase}.hsnap"), kill_at=seq.index(phase) + 1)
        assert how == "killed" and seen[-1] == phase
    stg = tmp_path / f".e.hsnap-staging-{_dead_pid()}-0a1b2c3d"
    stg.mkdir()  # killed between mkdir and its marker: empty, nothing to lose
    empty = tmp_path / f".f.hsnap.hsnap-tmp-{_dead_pid()}-0a1b2c3d"
    empty.write_bytes(b"")
    items = hgc.collect(tmp_path, remove=True)
    assert len(items) == 5 and {i.action for i in items} == {"removed"}, items
    assert os.listdir(tmp_path) == []


def test_set_commit_keeps_a_marker_or_a_manifest_at_every_instant(tmp_path, monkeypatch):
    seen = []

    def hook(phase):
        st = [n for n in os.listdir(tmp_path) if ".hsnap-staging-" in n]
        if st:
            names = set(os.listdir(tmp_path / st[0]))
            seen.append((phase, hf.spec.PENDING_MARKER in names, "manifest.json" in names))

    monkeypatch.setattr(localfs, "phase_hook", hook)
    cc.write_set(str(tmp_path / "set"))
    assert seen and all(marker or manifest for _, marker, manifest in seen), seen
    assert sorted(os.listdir(tmp_path / "set")) == ["manifest.json", "rank-0.hsnap", "rank-1.hsnap"]


# ------------------------------------------------------------------ verify reads and hashes every time


def test_verify_again_after_an_in_place_change_fails(tmp_path):
    p = _single(tmp_path / "a.hsnap")
    with hf.open(p) as snap:
        snap.verify()
        rec = next(s for s in snap.sections if s.kind == "output_ids")
        st = _first_state_section(snap)
        _flip_in_place(p, st.offset)
        with pytest.raises(hf.DigestMismatchError, match=st.name):
            snap.verify()
        with pytest.raises(hf.DigestMismatchError):
            snap.verify_section(st)
        with pytest.raises(hf.DigestMismatchError):
            snap.array(st, verify=True)
        _flip_in_place(p, rec.offset)
        with pytest.raises(hf.DigestMismatchError, match="output"):
            snap.record()
        assert [e is not None for _, e in snap.iter_verify()].count(True) == 2


# ------------------------------------------------------------------ unreadable directory or manifest


def _as_nobody(fn) -> dict:
    """Run ``fn`` as an unprivileged user (root bypasses file modes) and return its JSON report."""
    r, w = os.pipe()
    pid = os.fork()
    if pid == 0:
        os.close(r)
        try:
            if os.getuid() == 0:
                os.setgid(65534)
                os.setuid(65534)
            out = fn()
        except BaseException as e:  # noqa: BLE001
            out = {"crash": f"{type(e).__name__}: {e}"}
        os.write(w, json.dumps(out).encode())
        os._exit(0)
    os.close(w)
    data = b""
    while chunk := os.read(r, 65536):
        data += chunk
    os.close(r)
    os.waitpid(pid, 0)
    return json.loads(data)


def test_unreadable_directory_or_manifest_is_a_typed_error(capsys):
    import tempfile
    from pathlib import Path

    base = Path(tempfile.mkdtemp(prefix="hsnap-perm-", dir="/tmp"))  # traversable by others, unlike tmp_path
    os.chmod(base, 0o755)
    request_cleanup = shutil.rmtree
    cc.write_set(str(base / "set"))  # 0700 directory, 0600 files
    open_dir = base / "open"
    cc.write_set(str(open_dir))
    os.chmod(open_dir, 0o755)  # directory readable, manifest 0600
    from viewer.model import try_open

    def probe():
        out = {}
        for label, p in (("dir", base / "set"), ("manifest", open_dir)):
            try:
                hf.open(p).close()
                out[label] = "opened"
            except hf.HsnapError as e:
                out[label] = type(e).__name__
            except Exception as e:  # noqa: BLE001
                out[label] = "UNTYPED " + type(e).__name__
            for cmd in ("info", "verify"):
                try:
                    out[f"{label}-{cmd}"] = cli.main([cmd, str(p)])
                except BaseException as e:  # noqa: BLE001
                    out[f"{label}-{cmd}"] = "UNTYPED " + type(e).__name__
            doc, err = try_open(p)
            out[f"{label}-viewer"] = type(err).__name__ if err is not None else "opened"
        return out

    try:
        res = _as_nobody(probe)
    finally:
        request_cleanup(base, ignore_errors=True)
    assert res == {"dir": "HsnapIOError", "dir-info": 1, "dir-verify": 1, "dir-viewer": "HsnapIOError",
                   "manifest": "HsnapIOError", "manifest-info": 1, "manifest-verify": 1, "manifest-viewer": "HsnapIOError"}, res


# ------------------------------------------------------------------ no SIGBUS through the public read paths


def _truncate_under(path, fn, verified_first=False):
    """Open ``path`` (and verify it), truncate the file, then call fn(snap) in a child: (exit, signal)."""
    def child():
        snap = hf.open(path)
        if verified_first:  # a section verified before must not be served from a cache or the map
            snap.verify()
        first = _first_state_section(snap)
        os.truncate(path, first.offset + 1)
        try:
            fn(snap, first)
        except hf.HsnapError:
            return 7  # typed: what we want
        return 0

    return _in_child(child)


@pytest.mark.parametrize("path_name", ["read", "read_nov", "record", "record_nov", "array_verify", "stats", "section_bytes", "iter_chunks", "verify"])
def test_reads_of_a_truncated_file_are_typed_not_sigbus(tmp_path, path_name):
    calls = {
        "read": lambda s, f: s.read(f),
        "read_nov": lambda s, f: s.read(f, verify=False),
        "record": lambda s, f: s.record(),
        "record_nov": lambda s, f: s.record(verify=False),
        "array_verify": lambda s, f: s.array(f, verify=True),
        "stats": lambda s, f: section_stats(s, f),
        "section_bytes": lambda s, f: s.section_bytes(f)[0:64],
        "iter_chunks": lambda s, f: list(s.iter_chunks(f, 4)),
        "verify": lambda s, f: s.verify(),
    }
    for verified_first in (False, True):
        p = _single(tmp_path / f"a{verified_first}.hsnap")
        code, sig = _truncate_under(p, calls[path_name], verified_first)
        assert (code, sig) == (7, None), (path_name, verified_first, code, sig)


def test_diff_and_cli_of_a_truncated_file_are_typed(tmp_path):
    a = _single(tmp_path / "a.hsnap")
    b = _single(tmp_path / "b.hsnap")

    def child():
        with hf.open(a) as sa, hf.open(b) as sb:
            os.truncate(b, _first_state_section(sb).offset + 1)
            try:
                diff_snapshots(sa, sb)
            except hf.HsnapError:
                return 7
        return 0

    assert _in_child(child) == (7, None)
    assert cli.main(["diff", a, b]) == 2  # b is truncated now: refused at open


def test_mapped_views_say_so():
    for fn in (hf.Snapshot.array, hf.Snapshot.raw):
        assert "SIGBUS" in fn.__doc__


# ------------------------------------------------------------------ a file shrinking while open runs


def test_a_file_shrinking_during_open_gives_typed_errors(tmp_path):
    p = _single(tmp_path / "a.hsnap")
    data = open(p, "rb").read()
    stop = threading.Event()

    def churn():
        cuts = [0, 10, 64, 200, len(data) // 2, len(data) - 64, len(data) - 1]
        i = 0
        while not stop.is_set():
            with open(p, "r+b") as f:
                f.truncate(cuts[i % len(cuts)])
                f.seek(0)
                f.write(data)
            i += 1

    t = threading.Thread(target=churn)
    t.start()
    outcomes = {"ok": 0, "typed": 0}
    untyped = []
    try:
        deadline = time.monotonic() + 3
        while time.monotonic() < deadline:
            try:
                with hf.open(p) as s:
                    s.record()
                outcomes["ok"] += 1
            except hf.HsnapError:
                outcomes["typed"] += 1
            except Exception as e:  # noqa: BLE001
                untyped.append(repr(e))
    finally:
        stop.set()
        t.join()
    assert not untyped, untyped[:5]
    assert outcomes["typed"] > 0, outcomes


# ------------------------------------------------------------------ descriptors


def _fds() -> int:
    return len(os.listdir("/proc/self/fd"))


def test_unclosed_snapshots_do_not_leak_descriptors(tmp_path):
    p = _single(tmp_path / "a.hsnap")
    pygc.collect()
    before = _fds()
    for _ in range(300):
        hf.open(p).verify()
    pygc.collect()
    assert _fds() - before <= 2


def test_one_descriptor_per_open_rank(tmp_path):
    cc.write_set(str(tmp_path / "set"))
    before = _fds()
    with hf.open(tmp_path / "set") as s:
        s.verify()
        s.ranks[0].record()
        assert _fds() - before == 2  # two ranks, one descriptor each
    assert _fds() == before


# ------------------------------------------------------------------ diff verifies both sides


def test_diff_reports_a_side_that_fails_its_digests(tmp_path, capsys):
    a = _single(tmp_path / "a.hsnap")
    b = _single(tmp_path / "b.hsnap")
    with hf.open(b) as s:
        st = _first_state_section(s)
    _flip_in_place(b, st.offset)
    with hf.open(a) as sa, hf.open(b) as sb:
        rep = diff_snapshots(sa, sb)
        [bad] = rep.corrupt
        assert (bad.name, bad.status, bad.corrupt) == (st.name, CORRUPT, "B") and not rep.same
        rep = diff_snapshots(sa, sb, stop_at_first=True)
        assert [d.name for d in rep.corrupt] == [st.name]
    for extra in ([], ["--names-only"], ["--json"]):
        assert cli.main(["diff", a, b, *extra]) == 2, extra
        err = capsys.readouterr().err
        assert "fail their own digests" in err and st.name in err


# ------------------------------------------------------------------ low: the writer refuses to reinterpret data


def test_low_writer_refuses_another_dtype_of_the_same_width(tmp_path):
    ident, geom, rec, state = cc.tiny()
    name = next(n for n, a in state.items() if a.dtype.name == "bfloat16")
    bad = dict(state, **{name: state[name].astype(np.float16)})
    with pytest.raises(hf.WriterStateError, match=f"{name}.*dtype.*bfloat16.*float16"):
        hf.write_snapshot(tmp_path / "a.hsnap", identity=ident, geometry=geom, record=rec, state=bad)
    for odd in (state[name].tolist(), memoryview(np.ascontiguousarray(state[name]).view(np.uint8).reshape(-1))[::2]):
        with pytest.raises(hf.WriterStateError, match="data"):
            hf.write_snapshot(tmp_path / "b.hsnap", identity=ident, geometry=geom, record=rec, state=dict(state, **{name: odd}))
    assert os.listdir(tmp_path) == []


@pytest.mark.parametrize("field,value", [
    ("prompt_ids", np.array([1, 4294967303], dtype=np.int64)),
    ("output_ids", np.array([-1], dtype=np.int64)),
    ("prompt_ids", np.array([1.5, 2.0])),
    ("stop_strings", "abc"),
    ("stop_token_ids", [1.7]),
])
def test_low_record_refuses_values_int32_or_tuples_would_change(field, value):
    with pytest.raises(hf.MalformedHeaderError, match=field.split("_")[0]):
        hf.RequestRecord(**{"rid": "r", "prompt_ids": [1, 2], "output_ids": [3], "state_position": 2, field: value})


# ------------------------------------------------------------------ low: SetWriter


def test_low_set_writer_never_replaces_an_empty_directory_without_noreplace(tmp_path, monkeypatch):
    monkeypatch.setattr(localfs, "_renameat2", None)  # a filesystem without RENAME_NOREPLACE
    w = hf.SetWriter(tmp_path / "set")
    for r in range(2):
        ident, geom, rec, state = cc.tiny(tp_size=2, tp_rank=r, snapshot_id="s")
        hf.write_snapshot(w.rank_path(r), identity=ident, geometry=geom, record=rec, state=state)
    (tmp_path / "set").mkdir()  # someone else's, created in the race window
    (tmp_path / "set" / "theirs").write_text("x")
    os.unlink(tmp_path / "set" / "theirs")  # empty again: rename(2) alone would replace it
    with pytest.raises(hf.SnapshotExistsError):
        w.commit(tp_size=2)
    assert os.listdir(tmp_path) == ["set"] and os.listdir(tmp_path / "set") == []  # theirs, untouched; no staging left


def test_low_set_writer_removes_its_staging_after_a_failed_commit(tmp_path, monkeypatch):
    w = hf.SetWriter(tmp_path / "set")
    for r in range(2):
        ident, geom, rec, state = cc.tiny(tp_size=2, tp_rank=r, snapshot_id="s")
        hf.write_snapshot(w.rank_path(r), identity=ident, geometry=geom, record=rec, state=state)

    def full(phase):
        if phase == "manifest-written":
            raise OSError(28, "No space left on device")

    monkeypatch.setattr(localfs, "phase_hook", full)
    with pytest.raises(hf.HsnapIOError):
        w.commit(tp_size=2)
    assert os.listdir(tmp_path) == []


# ------------------------------------------------------------------ low: ranks= and error text


def test_low_open_with_a_rank_the_set_does_not_have(tmp_path):
    d = os.path.join(VECTORS, "two-rank")
    for bad in ([5], [-1], [True], ["0"]):
        with pytest.raises(hf.MalformedManifestError, match="ranks"):
            hf.open(d, ranks=bad)
    with hf.open(d, ranks=[1]) as s:
        assert list(s.ranks) == [1]


def test_low_error_text_quotes_strings_and_stays_on_one_line():
    e = hf.MalformedHeaderError("/x/a\nb.hsnap", "request.rid", "a string", "4")
    assert str(e) == "/x/a\\x0ab.hsnap: request.rid: expected a string, found '4'"
    assert "found 4" in str(hf.MalformedHeaderError(None, "f", "x", 4))
    assert "\n" not in str(hf.MalformedHeaderError(None, "f", "x", "a\nb\x1b"))
    from hsnap_format.tools.viewmodel import escape

    assert escape("\\x1b") == "\\\\x1b" and escape("\x1b") == "\\x1b" and escape("é") == "é"


def test_a_temporary_file_is_named_an_unfinished_write_by_the_reader(tmp_path):
    t = tmp_path / f".a.hsnap.hsnap-tmp-{os.getpid()}-0a1b2c3d"
    t.write_bytes(localfs.pending_preamble("x") + bytes(4096))
    with pytest.raises(hf.BadMagicError, match="unfinished write.*hsnap gc"):
        hf.open(t)
