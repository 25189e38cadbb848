"""Permissions and paths: private by default, no escape from a snapshot directory,
no symbolic links inside one, and a taken name is never overwritten — not even
when two writers race for it."""

from __future__ import annotations

import contextlib
import os
import stat
import subprocess
import sys
import threading

import pytest
import xxhash

import crash_child as cc
import hsnap_format as hf
from hsnap_format import localfs
from hsnap_format.manifest import decode_manifest


@contextlib.contextmanager
def umask(mask):
    old = os.umask(mask)
    try:
        yield
    finally:
        os.umask(old)


def _mode(path) -> int:
    return stat.S_IMODE(os.lstat(path).st_mode)


def _write(path, seed=0, **kw):
    ident, geom, rec, state = cc.tiny(seed)
    return hf.write_snapshot(path, identity=ident, geometry=geom, record=rec, state=state, **kw)


def _write_set(path, seed=0, **kw):
    w = hf.SetWriter(path, **kw)
    for r in range(2):
        ident, geom, rec, state = cc.tiny(seed, tp_size=2, tp_rank=r, snapshot_id=f"s{seed}")
        hf.write_snapshot(w.rank_path(r), identity=ident, geometry=geom, record=rec, state=state)
    return w


# ------------------------------------------------------------------ modes


@pytest.mark.parametrize("mask", [0o000, 0o022, 0o077])
def test_files_are_private_by_default_whatever_the_umask(tmp_path, mask, monkeypatch):
    seen = {}

    def hook(phase):
        if phase == "open":  # the temporary is private from its first byte
            [tmp] = [n for n in os.listdir(tmp_path) if ".hsnap-tmp-" in n]
            seen["tmp"] = _mode(tmp_path / tmp)

    monkeypatch.setattr(localfs, "phase_hook", hook)
    with umask(mask):
        _write(tmp_path / "req.hsnap")
    assert seen["tmp"] == 0o600
    assert _mode(tmp_path / "req.hsnap") == 0o600


@pytest.mark.parametrize("mask,expected", [(0o000, 0o640), (0o022, 0o640), (0o077, 0o600)])
def test_a_wider_mode_is_narrowed_by_the_umask(tmp_path, mask, expected):
    """mode= is the most a file gets; the umask may take bits away (as open(2) does), never add."""
    with umask(mask):
        _write(tmp_path / "req.hsnap", mode=0o640)
    assert _mode(tmp_path / "req.hsnap") == expected


@pytest.mark.parametrize("mask", [0o000, 0o022, 0o077])
def test_set_directories_are_private_by_default(tmp_path, mask):
    with umask(mask):
        w = _write_set(tmp_path / "set")
        assert _mode(w.staging) == 0o700
        w.commit(tp_size=2)
    d = tmp_path / "set"
    assert _mode(d) == 0o700
    assert {n: _mode(d / n) for n in os.listdir(d)} == {"manifest.json": 0o600, "rank-0.hsnap": 0o600, "rank-1.hsnap": 0o600}


def test_set_mode_is_configurable(tmp_path):
    with umask(0o022):
        _write_set(tmp_path / "set", mode=0o750).commit(tp_size=2)
    assert _mode(tmp_path / "set") == 0o750


def test_set_mode_reaches_the_manifest(tmp_path):
    with umask(0o022):
        _write_set(tmp_path / "set", mode=0o750).commit(tp_size=2)
    assert _mode(tmp_path / "set" / "manifest.json") & 0o040


def test_export_mode_reaches_the_file(tmp_path):
    pytest.importorskip("torch")
    from io_cases import identity, record, source

    from hsnap_io import export_request

    ps, req = source("mha", 1)
    with umask(0o022):
        export_request(tmp_path / "req.hsnap", req_to_token_pool=ps.req_to_token_pool, token_to_kv_pool_allocator=ps.token_to_kv_pool_allocator,
                       req_pool_idx=req.req_pool_idx, record=record(), identity=identity(), mode=0o640)
        export_request(tmp_path / "default.hsnap", req_to_token_pool=ps.req_to_token_pool, token_to_kv_pool_allocator=ps.token_to_kv_pool_allocator,
                       req_pool_idx=req.req_pool_idx, record=record(), identity=identity())
    assert _mode(tmp_path / "req.hsnap") == 0o640 and _mode(tmp_path / "default.hsnap") == 0o600


# ------------------------------------------------------------------ a manifest cannot leave its directory


def _manifest(files) -> bytes:
    import json

    body = json.dumps({"format": "hsnap-manifest", "version": [1, 0], "snapshot_id": "s0", "state_position": 5, "tp_size": len(files),
                       "ranks": [{"rank": i, "file": f, "length": 1, "root_digest": "0" * 32} for i, f in enumerate(files)]},
                      separators=(",", ":"), sort_keys=True).encode() + b"\n"
    return body + b"xxh3-128 " + xxhash.xxh3_128_hexdigest(body).encode() + b"\n"


@pytest.mark.parametrize("name", ["../rank-0.hsnap", "/etc/passwd", "sub/rank-0.hsnap", "rank-0.hsnap/..", "./rank-0.hsnap",
                                  "rank-1.hsnap", "rank-00.hsnap", "rank-0.hsnap\x00", "RANK-0.hsnap", "rank-0.hsnap "])
def test_a_manifest_names_only_its_own_rank_files(name):
    with pytest.raises(hf.MalformedManifestError, match=r"ranks\[0\]\.file"):
        decode_manifest(_manifest([name]), "m")


def test_a_manifest_pointing_outside_is_refused_on_open(tmp_path):
    _write_set(tmp_path / "set").commit(tp_size=2)
    d = tmp_path / "set"
    with hf.open(d) as s:
        good = s.manifest
    os.rename(d / "rank-1.hsnap", tmp_path / "rank-1.hsnap")
    os.chmod(d / "manifest.json", 0o600)
    (d / "manifest.json").write_bytes(_manifest(["rank-0.hsnap", "../rank-1.hsnap"]))
    with pytest.raises(hf.MalformedManifestError):
        hf.open(d)
    assert good.tp_size == 2


# ------------------------------------------------------------------ symbolic links


@pytest.fixture
def committed_set(tmp_path):
    _write_set(tmp_path / "set").commit(tp_size=2)
    return tmp_path / "set"


@pytest.mark.parametrize("what", ["rank file", "manifest", "extra entry"])
def test_symlinks_inside_a_snapshot_directory_are_refused(committed_set, tmp_path, what):
    d = committed_set
    if what == "rank file":  # the same, valid bytes — but through a link
        os.rename(d / "rank-1.hsnap", tmp_path / "elsewhere.hsnap")
        os.symlink(tmp_path / "elsewhere.hsnap", d / "rank-1.hsnap")
    elif what == "manifest":
        os.rename(d / "manifest.json", tmp_path / "manifest.json")
        os.symlink(tmp_path / "manifest.json", d / "manifest.json")
    else:
        os.symlink("/etc/passwd", d / "notes")
    with pytest.raises(hf.MalformedManifestError):
        with hf.open(d, ranks=[0]) as s:
            s.verify()


def test_a_symlink_given_as_the_path_is_not_followed(committed_set, tmp_path):
    """hf.open refuses a link given as the path itself (e.g. "latest"), as Snapshot() does
    (O_NOFOLLOW) and as links inside a snapshot directory are refused (spec 7.1 step 1,
    R-7.1-2); the target, by its own path, opens."""
    _write(tmp_path / "req.hsnap")
    os.symlink(tmp_path / "req.hsnap", tmp_path / "latest.hsnap")
    os.symlink(committed_set, tmp_path / "latest")
    for link in ("latest.hsnap", "latest"):
        with pytest.raises(hf.HsnapIOError, match="symbolic link"):
            hf.open(tmp_path / link)
        with hf.open(os.path.realpath(tmp_path / link)) as s:
            s.verify() if isinstance(s, hf.Snapshot) else [r.verify() for r in s.ranks.values()]
    with pytest.raises(hf.HsnapIOError):
        hf.Snapshot(tmp_path / "latest.hsnap")


_FIFO_CHILD = r"""
import os, sys
sys.path.insert(0, sys.argv[2])
import hsnap_format as hf
try:
    hf.open(sys.argv[1])
except hf.HsnapError as e:
    print("typed", type(e).__name__)
"""


def test_a_fifo_is_refused_not_waited_on(committed_set):
    os.unlink(committed_set / "rank-1.hsnap")
    os.mkfifo(committed_set / "rank-1.hsnap")
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    try:
        proc = subprocess.run([sys.executable, "-c", _FIFO_CHILD, str(committed_set), root], capture_output=True, text=True, timeout=8)
    except subprocess.TimeoutExpired:
        pytest.fail("the reader blocked on a FIFO")
    assert proc.stdout.startswith("typed"), proc.stderr[-500:]


# ------------------------------------------------------------------ never overwrite


@pytest.mark.parametrize("existing", ["file", "empty dir", "dir", "dangling symlink", "symlink"])
def test_an_existing_path_is_never_overwritten(tmp_path, existing):
    for final in ("req.hsnap", "set"):
        p = tmp_path / final
        if existing == "file":
            p.write_bytes(b"precious")
        elif existing in ("empty dir", "dir"):
            p.mkdir()
            if existing == "dir":
                (p / "precious").write_bytes(b"precious")
        else:
            os.symlink(tmp_path / ("precious" if existing == "symlink" else "nowhere"), p)
            (tmp_path / "precious").write_bytes(b"precious")
    before = {n: os.lstat(tmp_path / n) for n in os.listdir(tmp_path)}
    with pytest.raises(hf.SnapshotExistsError):
        _write(tmp_path / "req.hsnap")
    with pytest.raises(hf.SnapshotExistsError):
        hf.SetWriter(tmp_path / "set")
    after = {n: os.lstat(tmp_path / n) for n in os.listdir(tmp_path)}
    assert before == after


def test_a_name_taken_while_writing_is_not_overwritten(tmp_path):
    """Someone creates the final name after the writer checked it: commit refuses."""
    for kind in ("file", "dir"):
        ident, geom, rec, state = cc.tiny()
        final = tmp_path / f"req-{kind}.hsnap"
        with hf.SnapshotWriter(final, identity=ident, geometry=geom, record=rec) as w:
            for spec in w.pending_state_sections():
                w.write_section(spec.name, state[spec.name])
            final.write_bytes(b"precious") if kind == "file" else final.mkdir()
            with pytest.raises(hf.SnapshotExistsError):
                w.commit()
        assert (final.read_bytes() == b"precious") if kind == "file" else os.listdir(final) == []
    assert sorted(os.listdir(tmp_path)) == ["req-dir.hsnap", "req-file.hsnap"]


def test_a_directory_name_taken_while_staging_is_not_overwritten(tmp_path):
    w = _write_set(tmp_path / "set")
    (tmp_path / "set").mkdir()
    with pytest.raises(hf.HsnapError) as info:
        w.commit(tp_size=2)
    w.abort()
    assert os.listdir(tmp_path) == ["set"] and os.listdir(tmp_path / "set") == []
    assert isinstance(info.value, (hf.SnapshotExistsError, hf.HsnapIOError))


def test_a_directory_name_taken_while_staging_raises_snapshot_exists(tmp_path):
    w = _write_set(tmp_path / "set")
    (tmp_path / "set").mkdir()
    try:
        with pytest.raises(hf.SnapshotExistsError):
            w.commit(tp_size=2)
    finally:
        w.abort()


def _race_threads(tmp_path, phase, make, trials):
    """Two writers of one final name, released together at ``phase``: exactly one wins. The winners, by trial."""
    return [_race_once(tmp_path / f"race-{t}", phase, make) for t in range(trials)]


def _race_once(final, phase, make) -> int:
    barrier = threading.Barrier(2, timeout=20)

    def hook(p):
        if p == phase:
            barrier.wait()

    results = [None, None]

    def run(i):
        try:
            results[i] = ("won", make(final, seed=i))
        except hf.SnapshotExistsError as e:
            results[i] = ("lost", e)
        except BaseException as e:  # noqa: BLE001
            results[i] = ("error", e)

    localfs.phase_hook = hook
    try:
        threads = [threading.Thread(target=run, args=(i,)) for i in range(2)]
        for th in threads:
            th.start()
        for th in threads:
            th.join(30)
    finally:
        localfs.phase_hook = None
    kinds = sorted(r[0] for r in results)
    assert kinds == ["lost", "won"], results
    return [i for i, r in enumerate(results) if r[0] == "won"][0]


def test_two_threads_racing_for_one_file_name(tmp_path):
    def make(final, seed):
        return _write(final, seed=seed)

    winners = _race_threads(tmp_path, "before-rename", make, 30)
    for t, w in enumerate(winners):
        golden = tmp_path / f"golden-{w}"
        if not golden.exists():
            _write(golden, seed=w)
        assert cc.same_tree(str(tmp_path / f"race-{t}"), str(golden))  # the winner's bytes, whole
    assert sorted(n for n in os.listdir(tmp_path) if ".hsnap-" in n) == []  # the loser cleaned up
    print(f"\nfile-name races: {len(winners)}, winners by writer {[winners.count(0), winners.count(1)]}")


def test_two_threads_racing_for_one_directory_name(tmp_path):
    losers = []

    def make(final, seed):
        w = _write_set(final, seed=seed)
        try:
            return w.commit(tp_size=2)
        except hf.HsnapError as e:
            w.abort()
            losers.append(seed)
            if isinstance(e, hf.HsnapIOError) and isinstance(e.os_error, hf.SnapshotExistsError):
                raise e.os_error from None  # see test_a_directory_name_taken_while_staging_raises_snapshot_exists
            raise

    winners = _race_threads(tmp_path, "before-dir-rename", make, 20)
    for t, w in enumerate(winners):
        with hf.open(tmp_path / f"race-{t}") as s:
            s.verify()
            assert s.manifest.snapshot_id == f"s{w}"
    assert len(losers) == 20 and [n for n in os.listdir(tmp_path) if ".hsnap-" in n] == []


def test_two_processes_racing_for_one_name(tmp_path):
    """Forked writers, lined up at before-rename through pipes, released at once."""
    trials, winners = 20, []
    for t in range(trials):
        final = str(tmp_path / f"race-{t}.hsnap")
        go_r, go_w = os.pipe()
        ready_r, ready_w = os.pipe()
        pids = []
        for seed in range(2):
            pid = os.fork()
            if pid == 0:
                code = 1
                try:
                    def hook(p, ready_w=ready_w, go_r=go_r):  # this trial's pipes
                        if p == "before-rename":
                            os.write(ready_w, b"r")
                            os.read(go_r, 1)

                    localfs.phase_hook = hook
                    try:
                        _write(final, seed=seed)
                        code = 0
                    except hf.SnapshotExistsError:
                        code = 17
                finally:
                    os._exit(code)
            pids.append(pid)
        os.read(ready_r, 1), os.read(ready_r, 1)
        os.write(go_w, b"gg")
        codes = [os.waitstatus_to_exitcode(os.waitpid(pid, 0)[1]) for pid in pids]
        for fd in (go_r, go_w, ready_r, ready_w):
            os.close(fd)
        assert sorted(codes) == [0, 17], codes
        winners.append(codes.index(0))
        with hf.open(final) as s:
            s.verify()
            assert s.record().rid == f"r{winners[-1]}"
    assert [n for n in os.listdir(tmp_path) if ".hsnap-" in n] == []
