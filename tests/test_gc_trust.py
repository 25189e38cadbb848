"""Local directories: ``hsnap gc`` never removes a committed
snapshot, wherever it sits; writers refuse to commit inside a staging directory; gc
killed at any step finishes on the next run; names near NAME_MAX work or are refused
typed up front."""

from __future__ import annotations

import json
import os
import random
import re
import shutil
import signal
import socket
import tempfile

import pytest

import crash_child as cc
import hsnap_format as hf
from hsnap_format import localfs
from hsnap_format.tools import cli
from hsnap_format.stores import gc as hgc
from hsnap_format.spec import MAGIC, PENDING_MARKER


def _dead_pid() -> int:
    pid = os.fork()
    if pid == 0:
        os._exit(0)
    os.waitpid(pid, 0)
    assert not hgc.pid_alive(pid)
    return pid


def _pending(path, data=b""):
    path = str(path)
    with open(path, "wb") as f:
        f.write(localfs.pending_preamble("test") + data)
    return path


def _committed(path, seed=0) -> bytes:
    """A committed rank file written in a plain directory and moved to ``path`` (what a
    user's ``mv`` does: writers refuse such a path themselves)."""
    src = os.path.join(tempfile.mkdtemp(dir=os.path.dirname(os.path.dirname(os.path.dirname(str(path))))), "made.hsnap")
    cc.write_single(src, seed)
    os.rename(src, path)
    os.rmdir(os.path.dirname(src))
    return open(path, "rb").read()


def _dead_staging(d, name="x"):
    st = d / f".{name}.hsnap-staging-{_dead_pid()}-0a1b2c3d"
    localfs.make_staging_dir(str(st))
    return st


def _tree(root) -> dict[str, bytes | None]:
    """Every path under ``root`` (links not followed) with the bytes of each regular file."""
    out = {}
    for dirpath, dirnames, filenames in os.walk(root):
        for n in dirnames + filenames:
            p = os.path.join(dirpath, n)
            out[os.path.relpath(p, root)] = open(p, "rb").read() if os.path.isfile(p) and not os.path.islink(p) else None
    return out


# ------------------------------------------------------------------ the writers


def test_writer_refuses_to_commit_inside_a_dead_writers_staging_directory(tmp_path):
    """The scenario first reported: ``D/.x.hsnap-staging-<deadpid>-<hex>/keep.hsnap``.
    Before: committed (then ``hsnap gc D --remove`` deleted it). Now: refused, typed,
    naming the staging directory, and nothing is created inside it."""
    st = _dead_staging(tmp_path)
    before = sorted(os.listdir(st))
    ident, geom, rec, state = cc.tiny()
    for target in (st / "keep.hsnap", st / "sub" / "keep.hsnap"):
        with pytest.raises(hf.ReservedNameError, match="staging directory") as e:
            hf.write_snapshot(target, identity=ident, geometry=geom, record=rec, state=state)
        assert e.value.found == os.path.realpath(st) and e.value.field == "directory"
    with pytest.raises(hf.ReservedNameError, match="staging directory"):
        hf.SetWriter(st / "keepset")
    # reached through a symbolic link: the resolved path is checked
    os.symlink(st, tmp_path / "innocent")
    with pytest.raises(hf.ReservedNameError, match="staging directory"):
        hf.write_snapshot(tmp_path / "innocent" / "keep.hsnap", identity=ident, geometry=geom, record=rec, state=state)
    # a directory with a staging name but no marker, and one with the marker under a plain name
    bare = tmp_path / f".y.hsnap-staging-{_dead_pid()}-0a1b2c3d"
    bare.mkdir()
    marked = tmp_path / "plain"
    localfs.make_staging_dir(str(marked))
    for d in (bare, marked):
        with pytest.raises(hf.ReservedNameError, match="staging directory"):
            hf.write_snapshot(d / "keep.hsnap", identity=ident, geometry=geom, record=rec, state=state)
    assert sorted(os.listdir(st)) == before and os.listdir(bare) == [] and os.listdir(marked) == [PENDING_MARKER]
    # a set's own rank files directly in its own staging directory are what a set writer writes
    w = hf.SetWriter(tmp_path / "set")
    for r in range(2):
        ident, geom, rec, state = cc.tiny(tp_size=2, tp_rank=r, snapshot_id="s")
        hf.write_snapshot(w.rank_path(r), identity=ident, geometry=geom, record=rec, state=state)
    w.commit(tp_size=2)
    with hf.open(tmp_path / "set") as s:
        s.verify()


def test_hsnap_cp_refuses_a_destination_inside_a_staging_directory(tmp_path, capsys):
    cc.write_single(str(tmp_path / "a.hsnap"))
    st = _dead_staging(tmp_path)
    assert cli.main(["cp", str(tmp_path / "a.hsnap"), str(st / "keep.hsnap")]) != 0
    assert "ReservedNameError" in capsys.readouterr().err
    assert os.listdir(st) == [PENDING_MARKER]


def test_tp_export_refuses_a_path_inside_a_staging_directory(tmp_path):
    """Rank 0 refuses before the staging directory is made (a one-rank gloo group: the
    refusal comes before any pool is touched)."""
    torch = pytest.importorskip("torch")
    import torch.distributed as dist

    from hsnap_io.tp import export_request_tp

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=0, world_size=1)
    try:
        st = _dead_staging(tmp_path)
        ident, _, rec, _ = cc.tiny()
        with pytest.raises(hf.ReservedNameError, match="staging directory"):
            export_request_tp(st / "keep", identity=ident, record=rec)
        with pytest.raises(hf.ReservedNameError, match="final name length"):  # the staging name must fit too
            export_request_tp(tmp_path / ("n" * 120), identity=ident.__class__(**{**ident.__dict__, "snapshot_id": "i" * 120}), record=rec)
    finally:
        dist.destroy_process_group()
    assert sorted(os.listdir(tmp_path)) == [st.name] and os.listdir(st) == [PENDING_MARKER]
    del torch


def test_a_directory_made_a_staging_directory_after_the_check(tmp_path):
    """The race: the check passes at creation, then a directory above becomes a staging
    directory. The writer checks again before its rename and refuses (its temporary is
    removed); a file committed before that is kept by gc (it starts with the magic)."""
    d = tmp_path / "d"
    d.mkdir()
    ident, geom, rec, state = cc.tiny()
    with hf.SnapshotWriter(d / "keep.hsnap", identity=ident, geometry=geom, record=rec) as w:
        for spec in w.pending_state_sections():
            w.write_section(spec.name, state[spec.name])
        (d / PENDING_MARKER).write_bytes(hf.spec.PENDING_MARKER_TEXT)  # marked after the check
        with pytest.raises(hf.ReservedNameError, match="staging directory"):
            w.commit()
    assert os.listdir(d) == [PENDING_MARKER]
    # committed first, renamed into a staging name (with its marker) afterwards: gc keeps it
    os.unlink(d / PENDING_MARKER)
    cc.write_single(str(d / "keep.hsnap"))
    data = open(d / "keep.hsnap", "rb").read()
    (d / PENDING_MARKER).write_bytes(hf.spec.PENDING_MARKER_TEXT)
    st = tmp_path / f".d.hsnap-staging-{_dead_pid()}-0a1b2c3d"
    os.rename(d, st)
    for older in (None, 0):
        [item] = hgc.collect(tmp_path, remove=True, older_than=older)
        assert item.action == "kept" and "keep.hsnap" in item.reason, item
    assert open(st / "keep.hsnap", "rb").read() == data


def test_a_writers_abort_removes_only_its_own_files(tmp_path):
    """A set writer's abort (and the TP rank 0's cleanup, the same function) removes its
    own files one by one; a snapshot someone placed in its staging directory stays, with
    the marker and the directory (before: ``shutil.rmtree`` took it)."""
    w = hf.SetWriter(tmp_path / "set")
    ident, geom, rec, state = cc.tiny(tp_size=2, tp_rank=0, snapshot_id="s")
    hf.write_snapshot(w.rank_path(0), identity=ident, geometry=geom, record=rec, state=state)
    data = _committed(os.path.join(w.staging, "keep.hsnap"))
    w.abort()
    assert sorted(os.listdir(w.staging)) == [PENDING_MARKER, "keep.hsnap"]
    assert open(os.path.join(w.staging, "keep.hsnap"), "rb").read() == data
    w2 = hf.SetWriter(tmp_path / "set2")  # without a stranger: nothing is left
    hf.write_snapshot(w2.rank_path(0), identity=ident, geometry=geom, record=rec, state=state)
    w2.abort()
    assert not os.path.lexists(w2.staging)


def test_a_set_whose_parent_fsync_fails_is_given_back_whole(tmp_path, monkeypatch):
    w = hf.SetWriter(tmp_path / "set")
    for r in range(2):
        ident, geom, rec, state = cc.tiny(tp_size=2, tp_rank=r, snapshot_id="s")
        hf.write_snapshot(w.rank_path(r), identity=ident, geometry=geom, record=rec, state=state)
    real = localfs.fsync_dir

    def fsync_dir(path):
        if os.path.abspath(path) == str(tmp_path):
            raise OSError(5, "Input/output error")
        real(path)

    monkeypatch.setattr(localfs, "fsync_dir", fsync_dir)
    with pytest.raises(hf.HsnapIOError, match="fsync directory"):
        w.commit(tp_size=2)
    assert os.listdir(tmp_path) == []


# ------------------------------------------------------------------ gc


def test_gc_keeps_a_committed_snapshot_inside_a_dead_writers_staging_directory(tmp_path):
    """Before: ``hsnap gc D --remove`` removed the whole marked staging directory, a
    committed snapshot inside included. Now every file is proved on its own: the
    unfinished ones go, the snapshot (any name, a rank file too) and the marker and
    the directory stay, and the reason names what is kept."""
    st = _dead_staging(tmp_path)
    keep = _committed(st / "keep.hsnap")
    rank = _committed(st / "rank-0.hsnap", 1)
    tmp = _pending(st / f".rank-1.hsnap.hsnap-tmp-{_dead_pid()}-0a1b2c3d", bytes(3000))
    empty = st / "rank-2.hsnap"
    empty.write_bytes(b"")
    for older in (None, 0, None):
        [item] = hgc.collect(tmp_path, remove=True, older_than=older)
        assert item.action == "kept" and "keep.hsnap" in item.reason and "rank-0.hsnap" in item.reason, item
    assert sorted(os.listdir(st)) == [PENDING_MARKER, "keep.hsnap", "rank-0.hsnap"]
    assert open(st / "keep.hsnap", "rb").read() == keep and open(st / "rank-0.hsnap", "rb").read() == rank
    assert not os.path.exists(tmp) and not os.path.exists(empty)
    for name in ("keep.hsnap", "rank-0.hsnap"):
        with hf.open(st / name) as s:
            s.verify()


def test_gc_keeps_a_committed_set_inside_a_staging_directory(tmp_path):
    st = _dead_staging(tmp_path)
    cc.write_set(str(tmp_path / "set"))
    os.rename(tmp_path / "set", st / "set")
    before = _tree(st / "set")
    [item] = hgc.collect(tmp_path, remove=True, older_than=0)
    assert item.action == "kept" and "set" in item.reason
    assert _tree(st / "set") == before and PENDING_MARKER in os.listdir(st)


def test_gc_lists_each_file_with_its_size_before_removing(tmp_path, capsys):
    st = _dead_staging(tmp_path)
    a = _pending(st / "rank-0.hsnap", bytes(1000))
    b = _pending(st / f".rank-1.hsnap.hsnap-tmp-{_dead_pid()}-0a1b2c3d", bytes(20))
    sizes = {a: os.path.getsize(a), b: os.path.getsize(b), str(st / PENDING_MARKER): os.path.getsize(st / PENDING_MARKER)}
    # the dry run names every file it would remove, with its size (below its leftover; whole with --wide)
    assert cli.main(["gc", str(tmp_path)]) == 0
    out = capsys.readouterr().out
    for p, n in sizes.items():
        assert re.search(rf"^would remove +{re.escape(os.path.basename(p))} +{n}$", out, re.M), out
    assert cli.main(["gc", "--wide", str(tmp_path)]) == 0
    out = capsys.readouterr().out
    for p, n in sizes.items():
        assert re.search(rf"^would remove +{re.escape(p)} +{n} ", out, re.M), out
    assert cli.main(["gc", str(tmp_path), "--json"]) == 0
    doc = json.loads(capsys.readouterr().out)
    [leftover] = doc["leftovers"]
    assert {f["path"]: (f["bytes"], f["action"]) for f in leftover["files"]} == {p: (n, "would remove") for p, n in sizes.items()}
    # the removal announces each file, with its size, before unlinking it: the marker last
    seen = []
    real = os.unlink

    def unlink(path, *, dir_fd=None):
        seen.append(("unlink", os.path.basename(path)))
        real(path, dir_fd=dir_fd)

    os.unlink = unlink
    try:
        items = hgc.collect(tmp_path, remove=True, announce=lambda p, n: seen.append(("announce", os.path.basename(p), n)))
    finally:
        os.unlink = real
    assert [i.action for i in items] == ["removed"] and os.listdir(tmp_path) == []
    pairs = [(seen[i], seen[i + 1]) for i in range(0, len(seen), 2)]
    assert all(x[0] == "announce" and y == ("unlink", x[1]) for x, y in pairs), seen
    assert {x[1]: x[2] for x, _ in pairs} == {os.path.basename(p): n for p, n in sizes.items()}
    assert pairs[-1][0][1] == PENDING_MARKER
    # and the command line prints them, text and --json (on stderr there: stdout is the document)
    st = _dead_staging(tmp_path)
    c = _pending(st / "rank-0.hsnap", bytes(10))
    n = os.path.getsize(c)
    assert cli.main(["gc", str(tmp_path), "--remove", "--json"]) == 0
    cap = capsys.readouterr()
    assert f"removing {c}  {n} bytes" in cap.err
    doc = json.loads(cap.out)
    assert {f["path"]: f["action"] for f in doc["leftovers"][0]["files"]} == {c: "removed", str(st / PENDING_MARKER): "removed"}
    st = _dead_staging(tmp_path)
    c = _pending(st / "rank-0.hsnap", bytes(10))
    assert cli.main(["gc", str(tmp_path), "--remove", "--wide"]) == 0
    out = capsys.readouterr().out
    assert out.index(f"removing {c}  {n} bytes") < re.search(rf"^removed +{re.escape(c)} +{n} ", out, re.M).start(), out


def test_mixed_directories_never_lose_a_committed_snapshot(tmp_path):
    """Random mixes of what writers leave, what users place and what attackers forge,
    under every name form gc looks at: after ``gc --remove --older-than 0`` (twice), every
    file that starts with the magic and every committed set is there, byte for byte, and
    every file gc proved in a removable leftover is gone."""
    rng = random.Random(18)
    golden_file = tmp_path / "golden.hsnap"
    cc.write_single(str(golden_file))
    golden = golden_file.read_bytes()
    cc.write_set(str(tmp_path / "golden-set"))
    dead = [_dead_pid() for _ in range(4)]
    tally = {"kept complete": 0, "removed": 0}
    for t in range(60):
        d = tmp_path / f"t{t}"
        d.mkdir()
        for k in range(rng.randint(1, 5)):
            form = rng.choice(["tmpfile", "staging", "bare-staging", "plain"])
            pid = rng.choice(dead + [os.getpid(), 1])
            if form == "tmpfile":
                p = d / f".f{k}.hsnap.hsnap-tmp-{pid}-0a1b2c3d"
                rng.choice([lambda p: p.write_bytes(golden), lambda p: _pending(p, bytes(rng.randint(0, 99))), lambda p: p.write_bytes(b""),
                            lambda p: p.write_bytes(b"user data")])(p)
                continue
            if form == "plain":
                p = d / f"plain{k}"
            else:
                p = d / f".s{k}.hsnap-staging-{pid}-0a1b2c3d"
            p.mkdir()
            if form in ("staging", "plain") and rng.random() < 0.8:
                (p / PENDING_MARKER).write_bytes(hf.spec.PENDING_MARKER_TEXT)
            for j in range(rng.randint(0, 4)):
                kind = rng.choice(["magic", "pending", "empty", "other", "set", "link", "tmp-magic", "tmp-pending"])
                name = rng.choice([f"rank-{j}.hsnap", f"keep{j}.hsnap", f".rank-{j}.hsnap.hsnap-tmp-{rng.choice(dead)}-0a1b2c3d"])
                q = p / name
                if os.path.lexists(q):
                    continue
                if kind in ("magic", "tmp-magic"):
                    q.write_bytes(golden)
                elif kind in ("pending", "tmp-pending"):
                    _pending(q, bytes(rng.randint(0, 50)))
                elif kind == "empty":
                    q.write_bytes(b"")
                elif kind == "other":
                    q.write_bytes(b"notes")
                elif kind == "set":
                    shutil.copytree(tmp_path / "golden-set", q)
                else:
                    os.symlink(golden_file, q)
        before = _tree(d)
        must_stay = {p: b for p, b in before.items() if b is not None and b[:8] == MAGIC}
        must_stay_sets = [p for p in before if os.path.basename(p) == "manifest.json"]
        items = hgc.collect(d, remove=True, older_than=0)
        proved_gone = [f.path for i in items for f in getattr(i, "files", ()) if f.action == "removed"]
        hgc.collect(d, remove=True, older_than=0)
        after = _tree(d)
        for p, b in must_stay.items():
            assert after.get(p) == b, (t, p, items)
        for p in must_stay_sets:
            with hf.open(os.path.join(d, os.path.dirname(p))) as s:
                s.verify()
        for p in proved_gone:
            assert not os.path.lexists(p)
        assert golden_file.read_bytes() == golden
        tally["kept complete"] += len(must_stay)
        tally["removed"] += len(proved_gone)
    assert tally["kept complete"] > 50 and tally["removed"] > 50, tally


# ------------------------------------------------------------------ gc killed half way


def _gc_killed_after(directory: str, n: int) -> bool:
    """Run ``gc --remove`` in a forked child that SIGKILLs itself right after its n-th
    unlink, rmdir or rename (the steps that change the directory). True if it was killed."""
    pid = os.fork()
    if pid == 0:
        count = [0]

        def after(fn):
            def step(*a, **kw):
                out = fn(*a, **kw)
                count[0] += 1
                if count[0] == n:
                    os.kill(os.getpid(), signal.SIGKILL)
                return out

            return step

        os.unlink, os.rmdir, os.rename = after(os.unlink), after(os.rmdir), after(os.rename)
        try:
            hgc.collect(directory, remove=True)
        finally:
            os._exit(0)
    _, status = os.waitpid(pid, 0)
    return os.WIFSIGNALED(status)


def _half_removed_scene(d, complete_rank: bool):
    """A dead writer's staging directory (marker, unfinished files, an empty one), a dead
    writer's temporary file and, with ``complete_rank``, a staging directory that also
    holds a complete rank file (what gc keeps). Returns that rank file's bytes."""
    st = _dead_staging(d, "a")
    for i in range(6):
        _pending(st / f".rank-{i}.hsnap.hsnap-tmp-{_dead_pid()}-0a1b2c3d", bytes(100 * i))
    (st / "rank-9.hsnap").write_bytes(b"")
    _pending(d / f".c.hsnap.hsnap-tmp-{_dead_pid()}-0a1b2c3d", bytes(10))
    if not complete_rank:
        return None
    part = _dead_staging(d, "b")
    data = _committed(part / "rank-0.hsnap")
    _pending(part / f".rank-1.hsnap.hsnap-tmp-{_dead_pid()}-0a1b2c3d")
    return data


@pytest.mark.parametrize("complete_rank", [False, True])
def test_gc_killed_at_every_step_finishes_on_the_next_run(tmp_path, complete_rank):
    """Before: the marker was unlinked in directory order, and a gc killed before the
    other files were gone left a directory without a marker that no later run would ever
    remove. Now the marker goes last and a taken name records gc's own pid: at every kill
    point (after each unlink, rename, rmdir), the next run (default mode: every pid dead)
    proves and finishes the job, and keeps what it kept."""
    n = 0
    while True:
        n += 1
        d = tmp_path / f"k{n}"
        d.mkdir()
        data = _half_removed_scene(d, complete_rank)
        killed = _gc_killed_after(str(d), n)
        again = hgc.collect(d, remove=True)
        assert not any(i.action == "failed" for i in again), (n, again)
        left = os.listdir(d)
        if not complete_rank:
            assert left == [], (n, left, again)
        else:  # only the staging directory with the complete rank file, and its marker
            [name] = left
            assert name.startswith(".b.hsnap-staging-") and sorted(os.listdir(d / name)) == [PENDING_MARKER, "rank-0.hsnap"], (n, again)
            assert open(d / name / "rank-0.hsnap", "rb").read() == data
            [item] = hgc.collect(d, remove=True)  # and nothing more to do
            assert item.action == "kept" and not item.removable
        if not killed:
            break
    assert n > 10  # every unlink, the renames and the rmdir were kill points


# ------------------------------------------------------------------ names near NAME_MAX


def _name(nbytes: int, suffix: str = ".hsnap") -> str:
    """A name of exactly ``nbytes`` bytes, with two-byte characters in it."""
    body = nbytes - len(suffix.encode())
    return ("é" * (body // 4)) + "n" * (body - 2 * (body // 4)) + suffix


@pytest.mark.parametrize("nbytes", [200, 219, 220, 221, 224, 230, 250, 255])
def test_writers_and_gc_with_names_near_name_max(tmp_path, nbytes):
    """A final name leaves room for the longest temporary's suffix (35 bytes under a
    255-byte NAME_MAX): up to 220 bytes it commits, and gc removes its leftovers; above it
    is refused up front, typed, with the limit named (before: ENAMETOOLONG from the
    temporary's create for a file, the staging directory's mkdir for a set)."""
    name = _name(nbytes)
    assert len(name.encode()) == nbytes
    limit = os.pathconf(tmp_path, "PC_NAME_MAX") - 35
    ident, geom, rec, state = cc.tiny()
    if nbytes <= limit:
        hf.write_snapshot(tmp_path / name, identity=ident, geometry=geom, record=rec, state=state)
        with hf.open(tmp_path / name) as s:
            s.verify()
        w = hf.SetWriter(tmp_path / ("s" + name[1:]))
        w.abort()
    else:
        with pytest.raises(hf.ReservedNameError, match=f"at most {limit} bytes"):
            hf.write_snapshot(tmp_path / name, identity=ident, geometry=geom, record=rec, state=state)
        with pytest.raises(hf.ReservedNameError, match=f"at most {limit} bytes"):
            hf.SetWriter(tmp_path / name)
    # leftovers whose names use the whole NAME_MAX (a one-digit pid, a short TP tag): gc's
    # own taken name must fit too
    d = tmp_path / "gc"
    d.mkdir()
    full = limit + 35
    tmp_name = "." + _name(full - 1 - len(".hsnap-tmp-1-0a1b2c3d"), "") + ".hsnap-tmp-1-0a1b2c3d"
    stg_name = "." + _name(full - 1 - len(".hsnap-staging-t"), "") + ".hsnap-staging-t"
    _pending(d / tmp_name, bytes(7))
    localfs.make_staging_dir(str(d / stg_name))
    _pending(d / stg_name / "rank-0.hsnap")
    items = hgc.collect(d, remove=True, older_than=0)
    assert [i.action for i in items] == ["removed", "removed"], items
    assert os.listdir(d) == []
