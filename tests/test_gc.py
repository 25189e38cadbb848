"""``hsnap gc``: lists and removes leftovers of interrupted writes, and nothing else."""

from __future__ import annotations

import json
import os
import shutil
import time

import pytest

import crash_child as cc
import hsnap_format as hf
from hsnap_format.tools import cli
from hsnap_format.stores import gc as hgc


def _dead_pid() -> int:
    pid = os.fork()
    if pid == 0:
        os._exit(0)
    os.waitpid(pid, 0)
    assert not hgc.pid_alive(pid)
    return pid


def _touch(path, data=b"x", age=0.0):
    with open(path, "wb") as f:
        f.write(data)
    if age:
        t = time.time() - age
        os.utime(path, (t, t))
    return str(path)


def _tmp(d, final, pid, rand="0a1b2c3d"):
    return d / f".{final}.hsnap-tmp-{pid}-{rand}"


def _pending(path, data=b"", age=0.0):
    """A temporary file as a writer leaves it: the unfinished-write mark, then data."""
    from hsnap_format import localfs

    return _touch(path, localfs.pending_preamble("test") + data, age)


def _staging(path):
    """A staging directory as a writer makes it (with its marker)."""
    from hsnap_format import localfs

    localfs.make_staging_dir(str(path))
    return path


def _committed(d):
    """A committed rank file and a committed snapshot directory."""
    cc.write_single(str(d / "req.hsnap"))
    cc.write_set(str(d / "set"))
    return sorted(["req.hsnap", "set"])


def _actions(items):
    return {os.path.basename(i.path): i.action for i in items}


def test_names_are_parsed_as_the_writers_make_them(tmp_path):
    from hsnap_format import localfs

    t = os.path.basename(localfs.temp_name(str(tmp_path / "a.hsnap-tmp-1-deadbeef")))  # a final name that looks like one
    assert hgc.parse_name(t) == ("file", "a.hsnap-tmp-1-deadbeef", os.getpid())
    s = os.path.basename(localfs.staging_name(str(tmp_path / "snap")))
    assert hgc.parse_name(s) == ("staging", "snap", os.getpid())
    assert hgc.parse_name(".snap.hsnap-staging-00000000-0000-4000-8000-000000000002") == ("staging", "snap", None)
    assert hgc.parse_name(".snap.hsnap-staging-tp-snap") == ("staging", "snap", None)
    for name in ("req.hsnap", "snap", ".hidden", "x.hsnap-tmp-1-0a1b2c3d", ".x.hsnap-tmp-1-XYZ", ".x.hsnap-tmp-", ".x.hsnap-staging-"):
        assert hgc.parse_name(name) is None, name


def test_dead_writers_leftovers_are_removed_and_nothing_else(tmp_path):
    keep = _committed(tmp_path)
    _touch(tmp_path / "notes.txt")
    _touch(tmp_path / ".hidden")
    dead = _dead_pid()
    _pending(_tmp(tmp_path, "a.hsnap", dead), bytes(5000))
    _staging(tmp_path / f".b.hsnap-staging-{dead}-0a1b2c3d")
    _touch(tmp_path / f".b.hsnap-staging-{dead}-0a1b2c3d" / "rank-0.hsnap", b"")  # created, killed before its first byte
    _pending(tmp_path / f".b.hsnap-staging-{dead}-0a1b2c3d" / f".rank-1.hsnap.hsnap-tmp-{dead}-00000000")
    listed = hgc.collect(tmp_path)
    assert _actions(listed) == {f".a.hsnap.hsnap-tmp-{dead}-0a1b2c3d": "would remove", f".b.hsnap-staging-{dead}-0a1b2c3d": "would remove"}
    assert all(i.alive is False and i.pids == [dead] for i in listed)
    assert listed[0].final == str(tmp_path / "a.hsnap") and listed[0].bytes >= 5000
    assert len(os.listdir(tmp_path)) == 6  # listing removes nothing
    removed = hgc.collect(tmp_path, remove=True)
    assert {i.action for i in removed} == {"removed"}
    assert sorted(os.listdir(tmp_path)) == sorted(keep + ["notes.txt", ".hidden"])
    with hf.open(tmp_path / "set") as s:
        s.verify()
    with hf.open(tmp_path / "req.hsnap") as s:
        s.verify()


def test_a_running_writer_is_kept_unless_older_than_says_so(tmp_path):
    mine = _pending(_tmp(tmp_path, "a.hsnap", os.getpid()), age=100)
    items = hgc.collect(tmp_path, remove=True)
    assert [(i.action, i.alive) for i in items] == [("kept", True)] and "--older-than" in items[0].reason
    assert [i.action for i in hgc.collect(tmp_path, remove=True, older_than=1000)] == ["kept"]  # too young
    assert [i.action for i in hgc.collect(tmp_path, remove=True, older_than=50)] == ["removed"]
    assert not os.path.exists(mine)


def test_committed_snapshots_survive_older_than_zero(tmp_path):
    keep = _committed(tmp_path)
    old = time.time() - 10**6
    for n in keep:
        os.utime(tmp_path / n, (old, old))
    assert hgc.collect(tmp_path, remove=True, older_than=0) == []
    assert sorted(os.listdir(tmp_path)) == keep


def test_tp_staging_without_pid(tmp_path):
    st = _staging(tmp_path / ".snap.hsnap-staging-tp-snap")
    _pending(st / "rank-0.hsnap")
    [item] = hgc.collect(tmp_path, remove=True)
    assert (item.action, item.pids, item.alive) == ("kept", [], None) and "no pid" in item.reason
    # a rank still writing inside keeps it even with --older-than unless old enough
    _pending(_tmp(st, "rank-1.hsnap", os.getpid()))
    [item] = hgc.collect(tmp_path, remove=True, older_than=60)
    assert (item.action, item.pids, item.alive) == ("kept", [os.getpid()], True)
    [item] = hgc.collect(tmp_path, remove=True, older_than=0)
    assert item.action == "removed" and os.listdir(tmp_path) == []


def test_staging_with_a_dead_ranks_temporary_keeps_the_complete_rank(tmp_path):
    """A killed TP export: rank 0 complete, rank 1's temporary unfinished. The temporary
    and nothing else goes; the complete rank file, the marker and the directory stay."""
    st = _staging(tmp_path / ".snap.hsnap-staging-tp-snap")
    cc.write_single(str(tmp_path / "r0"))
    os.rename(tmp_path / "r0", st / "rank-0.hsnap")
    tmp = _pending(_tmp(st, "rank-1.hsnap", _dead_pid()))
    [item] = hgc.collect(tmp_path, remove=True)
    assert item.action == "kept" and "rank-0.hsnap" in item.reason and item.path == str(st), item
    assert {os.path.basename(f.path): f.action for f in item.files} == {
        ".hsnap-pending": "kept", "rank-0.hsnap": "kept", os.path.basename(tmp): "removed"}
    assert sorted(os.listdir(st)) == [".hsnap-pending", "rank-0.hsnap"]
    [item] = hgc.collect(tmp_path, remove=True, older_than=0)  # again: nothing more to do
    assert item.action == "kept" and not item.removable
    with hf.open(st / "rank-0.hsnap") as s:
        s.verify()


def test_odd_entries_are_left_alone(tmp_path):
    dead = _dead_pid()
    target = _touch(tmp_path / "precious")
    os.symlink(target, _tmp(tmp_path, "a.hsnap", dead))  # a symlink with a temporary's name
    (tmp_path / f".b.hsnap-tmp-{dead}-0a1b2c3d").mkdir()  # a directory with a file's name
    st = tmp_path / f".c.hsnap-staging-{dead}-0a1b2c3d"
    (st / "sub").mkdir(parents=True)  # a staging directory holding a directory
    _touch(tmp_path / f".d.hsnap-staging-{dead}-0a1b2c3d")  # a file with a staging name
    items = hgc.collect(tmp_path, remove=True, older_than=0)
    assert {i.action for i in items} == {"kept"} and len(items) == 4
    assert all("left alone" in i.reason for i in items)
    assert os.path.exists(target) and len(os.listdir(tmp_path)) == 5


def test_symlinks_inside_a_staging_directory_are_kept_not_followed(tmp_path):
    outside = tmp_path / "outside"
    outside.mkdir()
    victim = _touch(outside / "victim")
    d = tmp_path / "snaps"
    d.mkdir()
    st = _staging(d / f".s.hsnap-staging-{_dead_pid()}-0a1b2c3d")
    os.symlink(victim, st / "rank-0.hsnap")
    os.symlink(outside, st / "dirlink")
    _pending(st / "rank-1.hsnap")
    [item] = hgc.collect(d, remove=True)
    assert item.action == "kept" and sorted(os.listdir(st)) == [".hsnap-pending", "dirlink", "rank-0.hsnap"], item
    assert {os.path.basename(f.path): f.action for f in item.files} == {".hsnap-pending": "kept", "dirlink": "kept", "rank-0.hsnap": "kept", "rank-1.hsnap": "removed"}
    assert all("symbolic link" in f.reason for f in item.files if os.path.basename(f.path) in ("dirlink", "rank-0.hsnap"))
    assert os.listdir(outside) == ["victim"] and open(victim, "rb").read() == b"x"


def test_leftovers_inside_a_committed_snapshot_directory(tmp_path):
    cc.write_set(str(tmp_path / "set"))
    t = _pending(_tmp(tmp_path / "set", "rank-0.hsnap", _dead_pid()))
    [item] = hgc.collect(tmp_path, remove=True)
    assert item.path == t and item.action == "removed"
    with hf.open(tmp_path / "set") as s:
        s.verify()


def test_a_writer_whose_temporary_gc_removed_fails_typed(tmp_path):
    ident, geom, rec, state = cc.tiny()
    path = tmp_path / "req.hsnap"
    with hf.SnapshotWriter(path, identity=ident, geometry=geom, record=rec) as w:
        for spec in w.pending_state_sections():
            w.write_section(spec.name, state[spec.name])
        [item] = hgc.collect(tmp_path, remove=True, older_than=0)
        assert item.action == "removed"
        with pytest.raises(hf.HsnapIOError, match="rename"):
            w.commit()
    assert os.listdir(tmp_path) == []


def test_a_set_writer_whose_staging_gc_removed_fails_typed(tmp_path):
    w = hf.SetWriter(tmp_path / "set")
    [item] = hgc.collect(tmp_path, remove=True, older_than=0)
    assert item.action == "removed"
    ident, geom, rec, state = cc.tiny(tp_size=2, tp_rank=0, snapshot_id="s")
    with pytest.raises(hf.HsnapError):
        hf.write_snapshot(w.rank_path(0), identity=ident, geometry=geom, record=rec, state=state)
    with pytest.raises(hf.HsnapError):
        w.commit(tp_size=2)
    assert os.listdir(tmp_path) == []


def test_a_writer_committing_first_wins_over_gc(tmp_path):
    ident, geom, rec, state = cc.tiny()
    with hf.SnapshotWriter(tmp_path / "req.hsnap", identity=ident, geometry=geom, record=rec) as w:
        for spec in w.pending_state_sections():
            w.write_section(spec.name, state[spec.name])
        [item] = hgc.scan(tmp_path, older_than=0)
        w.commit()
    hgc._remove_file(item)
    assert item.action == "gone"
    w2 = hf.SetWriter(tmp_path / "set")
    for r in range(2):
        ident, geom, rec, state = cc.tiny(tp_size=2, tp_rank=r, snapshot_id="s")
        hf.write_snapshot(w2.rank_path(r), identity=ident, geometry=geom, record=rec, state=state)
    [item] = hgc.scan(tmp_path, older_than=0)
    w2.commit(tp_size=2)
    hgc._remove_staging(item)
    assert item.action == "gone"
    assert sorted(os.listdir(tmp_path)) == ["req.hsnap", "set"]
    with hf.open(tmp_path / "set") as s:
        s.verify()


def test_cli(tmp_path, capsys):
    _committed(tmp_path)
    dead = _dead_pid()
    _pending(_tmp(tmp_path, "a.hsnap", dead))
    _pending(_tmp(tmp_path, "b.hsnap", os.getpid()))
    assert cli.main(["gc", str(tmp_path)]) == 0
    out = capsys.readouterr().out
    assert "would remove" in out and f"writer {dead} not running" in out and "2 leftovers" in out
    assert cli.main(["gc", str(tmp_path), "--json"]) == 0
    doc = json.loads(capsys.readouterr().out)
    assert {os.path.basename(i["path"]): i["action"] for i in doc["leftovers"]} == {
        f".a.hsnap.hsnap-tmp-{dead}-0a1b2c3d": "would remove", f".b.hsnap.hsnap-tmp-{os.getpid()}-0a1b2c3d": "kept"}
    assert cli.main(["gc", str(tmp_path), "--remove", "--json"]) == 0
    doc = json.loads(capsys.readouterr().out)
    assert sorted(i["action"] for i in doc["leftovers"]) == ["kept", "removed"]
    assert cli.main(["gc", str(tmp_path), "--remove", "--older-than", "0"]) == 0
    assert "1 removed" in capsys.readouterr().out
    assert sorted(os.listdir(tmp_path)) == ["req.hsnap", "set"]
    assert cli.main(["gc", str(tmp_path / "missing")]) == 2
    assert "missing" in capsys.readouterr().err


def test_a_staging_directory_swapped_after_the_scan_is_not_followed(tmp_path):
    """gc run as root in a shared directory: the staging directory is replaced (by a
    symlink to, or by, another directory) between scan and removal — nothing outside is touched."""
    victim = tmp_path / "victim"
    victim.mkdir()
    _touch(victim / "precious")
    d = tmp_path / "shared"
    d.mkdir()
    for swap in ("symlink", "directory"):
        st = _staging(d / f".s.hsnap-staging-{_dead_pid()}-0a1b2c3d")
        _touch(st / "rank-0.hsnap")
        [item] = hgc.scan(d)
        os.rename(st, tmp_path / "moved")
        if swap == "symlink":
            os.symlink(victim, st)
        else:
            st.mkdir()
            _touch(st / "other")
        hgc._remove_staging(item)
        assert item.action == "failed" and "changed between scan and removal" in item.reason, item
        assert os.listdir(victim) == ["precious"]
        for n in os.listdir(d):
            p = d / n
            os.unlink(p) if os.path.islink(p) else shutil.rmtree(p)
        shutil.rmtree(tmp_path / "moved")
