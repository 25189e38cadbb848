"""Restores that read the payload once, with every guarantee kept.

The default (``verify=True``) reads once, straight into fresh slots, each piece hashed as
it lands: a refusal gives back every allocation exactly and zeroes what it wrote
(tests/test_perf_restore.py; here: the object store's read-ahead, a late refusal, a
Ctrl-C, a dead server). ``verify="before"`` — the proof a caller gets from
``prove_opened`` before it touches the pools — refuses before allocating, the pools
byte-identical:

A local file: a payload up to ``restore.ONE_READ_BYTES`` is read once, into a reused
staging buffer, each section hashed and the padding checked as it lands, before anything
is allocated; the upload copies from that buffer. So the file is read once, and what
reaches the pools is what was hashed even if the file changes afterwards. Larger payloads
take the two-pass path (verify, then read and hash again while uploading).

An object store (a real SeaweedFS): the ranged GETs run ahead of the hashing and the
scatter — into the staging buffer (a payload under the bound) or straight into the slots
with an undo log (over it) — with the ETag pinned, a refusal or a dead server leaving the
pools byte-identical, no GET thread outliving the restore, at most ``parallel`` GETs in flight.

No timing here (speed is bench/RESULTS.md and bench/REMOTE.md); the overlap is shown
by order of events: a GET that will not finish until the first piece is hashed.
"""

from __future__ import annotations

import os
import shutil
import threading
import time
import types

import numpy as np
import pytest

torch = pytest.importorskip("torch")
from io_cases import export_from, identity, rows_as_bytes, source, target  # noqa: E402

import hsnap_format as hf  # noqa: E402
from hsnap_testing import pools as sp  # noqa: E402
from hsnap_io import restore as restore_mod  # noqa: E402
from hsnap_io import helper as helper_mod  # noqa: E402
from hsnap_io import restore_request  # noqa: E402

KIND = "hybrid_linear"


@pytest.fixture(scope="module")
def snap_path(tmp_path_factory):
    p = str(tmp_path_factory.mktemp("once") / "req.hsnap")
    ps, req = source(KIND, 1)
    export_from(ps, req, p)
    return p


@pytest.fixture(scope="module")
def expected():
    ps, req = source(KIND, 1)
    return rows_as_bytes(sp.request_rows(ps, req))


def _restore(path, ps, **kw):
    return restore_request(path, req_to_token_pool=ps.req_to_token_pool, token_to_kv_pool_allocator=ps.token_to_kv_pool_allocator,
                           identity=identity(), **kw)


def _rows(ps, got):
    class R:  # what sp.request_rows reads
        req_pool_idx, n_tokens, mamba_pool_idx = got.req_pool_idx, got.state_position, got.mamba_pool_idx

    return rows_as_bytes(sp.request_rows(ps, R))


def _same_rows(a, b) -> bool:
    return sorted(a) == sorted(b) and all(np.array_equal(a[k], b[k]) for k in a)


def _count_reads(monkeypatch, path):
    """Bytes read by pread from ``path``'s descriptors (every read of a snapshot file is one)."""
    real, fds, total = os.preadv, set(), [0]
    real_open = os.open

    def opening(p, *a, **k):
        fd = real_open(p, *a, **k)
        if os.fspath(p) == path:
            fds.add(fd)
        return fd

    def counting(fd, buffers, offset):
        got = real(fd, buffers, offset)
        if fd in fds:
            total[0] += got
        return got

    monkeypatch.setattr(os, "open", opening)
    monkeypatch.setattr(os, "preadv", counting)
    return total


def _flip(path, offset):
    fd = os.open(path, os.O_RDWR)
    try:
        b = os.pread(fd, 1, offset)
        os.pwrite(fd, bytes([b[0] ^ 0x40]), offset)
    finally:
        os.close(fd)


# ------------------------------------------------------------------ local: verify=True (one pass) and "before" (proof first)


@pytest.fixture(params=["one part", "two parts"])
def parts(request, monkeypatch):
    """The staged body (or the one pass's upload) read and hashed as one part, or (any body: the bound set to 0) as two
    parts at once."""
    if request.param == "two parts":
        monkeypatch.setattr(restore_mod, "PARALLEL_STAGE_BYTES", 0)
    return request.param


@pytest.mark.parametrize("verify", [True, "before"])
def test_verify_reads_the_payload_once(snap_path, expected, monkeypatch, parts, verify):
    size = os.path.getsize(snap_path)
    with hf.open(snap_path) as s:
        records = sum(x.length for x in s.sections if not x.is_state)
    total = _count_reads(monkeypatch, snap_path)
    ps = target(KIND, 1)
    got = _restore(snap_path, ps, verify=verify)
    assert _same_rows(_rows(ps, got), expected)
    # the body once, the (small) record sections hashed again as the record is built
    assert size // 2 < total[0] <= size + records, (total[0], size)


def test_over_the_bound_two_passes_still_right(snap_path, expected, monkeypatch):
    monkeypatch.setattr(restore_mod, "ONE_READ_BYTES", 0)  # the bound stated in restore.py, here below the payload
    size = os.path.getsize(snap_path)
    total = _count_reads(monkeypatch, snap_path)
    ps = target(KIND, 1)
    got = _restore(snap_path, ps, verify="before")
    assert _same_rows(_rows(ps, got), expected)
    assert total[0] > size  # verified, then read and hashed again while uploading


def test_file_changed_after_the_verify_pass_never_reaches_the_pools(snap_path, expected, tmp_path, monkeypatch):
    """The file changes in place after the one read (between the verify pass and the
    allocation): the upload copies the bytes that were hashed, so the pools hold the
    snapshot's bytes, never the changed ones."""
    p = str(tmp_path / "req.hsnap")
    shutil.copy(snap_path, p)
    with hf.open(p) as s:
        sec = [x for x in s.sections if x.kind == "temporal"][1]
    real = restore_mod.PoolCheckpoint

    def checkpoint_then_change(view):  # constructed after the verify pass, right before allocating
        _flip(p, sec.offset + sec.length // 3)
        return real(view)

    monkeypatch.setattr(restore_mod, "PoolCheckpoint", checkpoint_then_change)
    ps = target(KIND, 1)
    got = _restore(p, ps, verify="before")
    assert _same_rows(_rows(ps, got), expected)
    with pytest.raises(hf.DigestMismatchError, match=sec.name):  # the file really changed
        hf.open(p).verify()


def test_corrupt_file_refused_before_allocation_pools_identical(snap_path, tmp_path, parts):
    p = str(tmp_path / "bad.hsnap")
    shutil.copy(snap_path, p)
    with hf.open(p) as s:
        sec = [x for x in s.sections if x.kind == "temporal"][1]
        pad = s.padding_ranges()
    _flip(p, sec.offset + 7)
    ps = target(KIND, 1)
    before, copied = sp.pool_state_fingerprint(ps), sp.pool_state_copy(ps)
    with pytest.raises(hf.DigestMismatchError, match=sec.name):
        _restore(p, ps, verify="before")
    assert sp.diff_fingerprints(before, sp.pool_state_fingerprint(ps)) == []
    with pytest.raises(hf.DigestMismatchError, match=sec.name):  # the one pass: found as it lands, zeroed
        _restore(p, ps)
    assert sp.refusal_changes(copied, ps) == []
    if pad:  # padding first (spec 7.2's order), found in the same one read; the one pass checks it before allocating
        _flip(p, pad[0][0])
        for verify in ("before", True):
            with pytest.raises(hf.DigestMismatchError, match="padding"):
                _restore(p, ps, verify=verify)
        assert sp.refusal_changes(copied, ps) == []


def test_two_parts_report_the_first_corrupt_section_in_table_order(snap_path, tmp_path, monkeypatch):
    """Read as two parts at once, a body corrupt in both parts (or only in the second) is refused naming the section
    a one-part read names: the first one in the table, whichever thread hashed it; the pools untouched."""
    monkeypatch.setattr(restore_mod, "PARALLEL_STAGE_BYTES", 0)
    with hf.open(snap_path) as s:
        secs = sorted((x for x in s.sections if x.length), key=lambda x: x.offset)
    first, last = secs[0], secs[-1]
    ps = target(KIND, 1)
    before = sp.pool_state_fingerprint(ps)
    for flips, named in (([last], last), ([first, last], first)):
        p = str(tmp_path / f"bad-{len(flips)}.hsnap")
        shutil.copy(snap_path, p)
        for x in flips:
            _flip(p, x.offset + x.length - 1)
        with pytest.raises(hf.DigestMismatchError) as e:
            _restore(p, ps, verify="before")
        assert e.value.field == f"sections[{named.name!r}].digest"
        assert sp.diff_fingerprints(before, sp.pool_state_fingerprint(ps)) == []


@pytest.mark.parametrize("failing", ["hsnap-upload", "MainThread"])
def test_a_failure_in_either_upload_thread_rolls_back_exactly(snap_path, expected, monkeypatch, failing):
    """Staged pieces are copied into the slots on two threads (the bound set to 0): one that fails in either thread is
    a typed error naming its section, every allocation given back, with exact_rollback every byte; then the same
    restore succeeds, its rows equal to the source's."""
    from hsnap_io import slots, transfer

    monkeypatch.setattr(restore_mod, "PARALLEL_STAGE_BYTES", 0)
    real, threads = transfer.HostEngine.import_section, set()
    helper_came = threading.Event()

    def flaky(self, buffer, rows, src, host=None):
        me = threading.current_thread().name
        threads.add(me)
        if me == "hsnap-upload":
            helper_came.set()
        elif failing == "hsnap-upload":  # the helper takes pieces only when free: hold the first until it came
            helper_came.wait(10)
        if me == failing:
            raise NotImplementedError("no kernel for this dtype")
        return real(self, buffer, rows, src, host)

    monkeypatch.setattr(transfer.HostEngine, "import_section", flaky)
    ps = target(KIND, 1)
    before = sp.pool_state_fingerprint(ps)
    with pytest.raises(slots.UploadError) as e:
        _restore(snap_path, ps, exact_rollback=True)
    assert e.value.field.startswith("sections[") and "no kernel" in str(e.value)
    assert sp.diff_fingerprints(before, sp.pool_state_fingerprint(ps)) == []
    assert failing in threads
    monkeypatch.setattr(transfer.HostEngine, "import_section", real)
    got = _restore(snap_path, ps)
    assert _same_rows(_rows(ps, got), expected)



@pytest.mark.parametrize("verify", [True, False, "before"])
def test_a_restore_says_where_its_time_went(snap_path, verify):
    """RestoredRequest.timings: every phase of restore_request, none negative, together within the call's own time."""
    ps = target(KIND, 1)
    t = time.perf_counter()
    got = _restore(snap_path, ps, verify=verify)
    wall = time.perf_counter() - t
    assert set(got.timings) == {"open_s", "prove_s", "allocate_s", "plan_s", "upload_s"}
    assert all(v >= 0 for v in got.timings.values()) and sum(got.timings.values()) <= wall
    assert got.timings["upload_s"] > 0 and got.timings["open_s"] > 0

def test_staging_buffer_is_reused(snap_path, expected):
    ps = target(KIND, 1)
    got = _restore(snap_path, ps, verify="before")
    kept = restore_mod._Staged.kept.buffers[0]  # the largest kept
    assert kept.size >= os.path.getsize(snap_path) - 200
    ps = target(KIND, 1)
    got = _restore(snap_path, ps, verify="before")
    assert any(b is kept for b in restore_mod._Staged.kept.buffers)  # the same memory, not faulted in again
    assert _same_rows(_rows(ps, got), expected)


# ------------------------------------------------------------------ object store

from hsnap_format import reader  # noqa: E402
from hsnap_format.stores.s3 import client as s3client, options as s3options, ranges as s3ranges  # noqa: E402  (botocore only when a client is made: s3server skips without it)


@pytest.fixture(autouse=True)
def _no_hook():
    yield
    s3client.fault_hook = None


@pytest.fixture(params=["staged", "read-ahead", "one pass"])
def path_kind(request, monkeypatch):
    """The three pipelines: the default under the bound, staged and proved before allocating (as verify="before");
    over it, verify="before" straight into the slots with an undo log, and the default's one pass (straight into the
    slots, zeroed on a refusal)."""
    if request.param != "staged":
        monkeypatch.setattr(restore_mod, "ONE_READ_BYTES", 0)
    return request.param


def _verify(path_kind: str):
    return "before" if path_kind == "read-ahead" else True


def _upload(s3server, bucket, snap_path) -> str:
    url = f"s3://{bucket}/o.hsnap"
    s3client.put_bytes(url, open(snap_path, "rb").read(), s3options.StorageOptions.of(s3server.options()))
    return url


def _gets_threads() -> list[str]:
    return [t.name for t in threading.enumerate() if t.name.startswith("hsnap-get")]


CHUNK = 2048  # many GETs (the test snapshot is ~44 KiB)


def test_url_restore_downloads_ahead_while_hashing(s3server, bucket, snap_path, expected, path_kind, monkeypatch):
    """The second GET after the restore's check is held until the first piece has been
    hashed: a pipeline that hashes only after its downloads would never release it (it
    gives up after 20 s and the overlap is reported missing)."""
    url = _upload(s3server, bucket, snap_path)
    hashed, seen, overlap = threading.Event(), [], []
    real = s3ranges.xxhash.xxh3_128

    class Hasher:
        def __init__(self, *a):
            self.h = real(*a)

        def update(self, b):
            if seen:  # after the restore's check (an open's trailer is hashed too)
                hashed.set()
            self.h.update(b)

        def digest(self):
            return self.h.digest()

        def hexdigest(self):
            return self.h.hexdigest()

    def hook(op, u, offset, length):
        if op == "head" and u == url:
            seen.append("head")
        elif op == "get" and u == url and seen:
            seen.append(offset)
            if len(seen) == 3:  # the second GET after the check
                overlap.append(hashed.wait(20))

    counted = types.SimpleNamespace(**{**{k: getattr(s3ranges.xxhash, k) for k in dir(s3ranges.xxhash) if k.startswith("xxh")}, "xxh3_128": Hasher})
    for hashing in (s3ranges, reader):  # a section's ranged GETs hash in s3ranges, a staged window stream in reader
        monkeypatch.setattr(hashing, "xxhash", counted)
    s3client.fault_hook = hook
    ps = target(KIND, 1)
    got = _restore(url, ps, storage_options=dict(s3server.options(), chunk_bytes=CHUNK, parallel=2), verify=_verify(path_kind))
    s3client.fault_hook = None
    assert overlap == [True]
    assert _same_rows(_rows(ps, got), expected)
    assert _gets_threads() == []


def test_in_flight_gets_bounded(s3server, bucket, snap_path, expected, path_kind, monkeypatch):
    url = _upload(s3server, bucket, snap_path)
    lock, now, peak, count = threading.Lock(), [0], [0], [0]
    real = s3ranges.RangeReader._get

    def counted(self, offset, out):
        with lock:
            now[0] += 1
            count[0] += 1
            peak[0] = max(peak[0], now[0])
        try:
            return real(self, offset, out)
        finally:
            with lock:
                now[0] -= 1

    monkeypatch.setattr(s3ranges.RangeReader, "_get", counted)
    held = []
    real_fill = s3ranges.ReadAhead._fill

    def fill(self):
        real_fill(self)
        held.append(self.ring_buffers)

    monkeypatch.setattr(s3ranges.ReadAhead, "_fill", fill)
    ps = target(KIND, 1)
    got = _restore(url, ps, storage_options=dict(s3server.options(), chunk_bytes=CHUNK, parallel=3), verify=_verify(path_kind))
    assert _same_rows(_rows(ps, got), expected)
    assert count[0] > 6 and 1 <= peak[0] <= 3
    assert max(held, default=0) <= 3  # ring buffers made: parallel x chunk_bytes at most
    assert (path_kind != "staged") == bool(held)
    assert _gets_threads() == []


@pytest.mark.parametrize("verify", ["before", True])
@pytest.mark.parametrize("slots", ["used", "never used"])
def test_url_read_ahead_lands_in_the_slots_and_a_late_refusal_puts_back_every_byte(s3server, bucket, snap_path, expected,
                                                                                   tmp_path, monkeypatch, slots, verify):
    """Over the staging bound an object's sections are fetched straight into their slots; with verify="before" each
    GET saves the bytes it overwrites first (held as zeros where the slots held only zeros). The last section
    corrupt: every earlier one has landed when the digest fails, and the pools come back byte for byte — free slots
    that held an earlier request's bytes, or nothing — then the good object restores exactly. The default
    (verify=True, any size) saves nothing: its refusal gives back every allocation and zeroes the slots it wrote."""
    from hsnap_io import statecheck

    monkeypatch.setattr(restore_mod, "ONE_READ_BYTES", 0)
    bad = str(tmp_path / "late.hsnap")
    shutil.copy(snap_path, bad)
    with hf.open(bad) as s:
        last = max((x for x in s.sections if not x.name.startswith("request.")), key=lambda x: x.offset)
    _flip(bad, last.offset + last.length - 3)
    good_url, bad_url = _upload(s3server, bucket, snap_path), f"s3://{bucket}/late.hsnap"
    s3client.put_bytes(bad_url, open(bad, "rb").read(), s3options.StorageOptions.of(s3server.options()))
    saved, real_save = [], statecheck.RunUndo.save

    def save(self, a, b):
        saved.append((self.what, b - a, bool(self.dest[a:b].any())))
        return real_save(self, a, b)

    monkeypatch.setattr(statecheck.RunUndo, "save", save)
    ps = target(KIND, 1)
    gen = np.random.default_rng(7)
    for t in sp.all_buffers(ps).values():  # the state buffers: an earlier request's bytes, or a fresh server's zeros
        if t.dtype.is_floating_point and t.numel():
            t.view(-1).view(torch.uint8)[:] = torch.from_numpy(gen.integers(1, 255, t.numel() * t.element_size(), dtype=np.uint8)
                                                               if slots == "used" else np.zeros(t.numel() * t.element_size(), np.uint8))
    before, copied = sp.pool_state_fingerprint(ps), sp.pool_state_copy(ps)
    opts = dict(s3server.options(), chunk_bytes=CHUNK, parallel=3)
    with pytest.raises(hf.DigestMismatchError, match=last.name):
        _restore(bad_url, ps, storage_options=opts, verify=verify)
    if verify == "before":
        assert saved and {any_bytes for *_, any_bytes in saved} == {slots == "used"}  # landed, saved (or held as zeros)
        assert sp.diff_fingerprints(before, sp.pool_state_fingerprint(ps)) == []
    else:
        assert saved == []  # no undo log: nothing copied before the bytes land
        assert sp.refusal_changes(copied, ps) == []
        assert (sp.diff_fingerprints(before, sp.pool_state_fingerprint(ps)) != []) == (slots == "used")  # it wrote, then zeroed
    assert _gets_threads() == []
    got = _restore(good_url, ps, storage_options=opts)
    assert _same_rows(_rows(ps, got), expected)


def _interrupted(s3server, bucket, snap_path, act, err, path_kind, **opts):
    url = _upload(s3server, bucket, snap_path)
    seen = []

    def hook(op, u, offset, length):
        if op == "head" and u == url:
            seen.append("head")
        elif op == "get" and u == url and seen:
            seen.append(offset)
            if len(seen) == 4:  # mid-download, GETs running ahead
                act()

    ps = target(KIND, 1)
    before, copied = sp.pool_state_fingerprint(ps), sp.pool_state_copy(ps)
    s3client.fault_hook = hook
    try:
        with pytest.raises(err) as e:
            _restore(url, ps, storage_options=dict(s3server.options(), chunk_bytes=CHUNK, parallel=3, **opts), verify=_verify(path_kind))
    finally:
        s3client.fault_hook = None
    assert len(seen) >= 4
    if path_kind == "one pass":
        assert sp.refusal_changes(copied, ps) == []  # every allocation given back, the slots it wrote zeroed
    else:
        assert sp.diff_fingerprints(before, sp.pool_state_fingerprint(ps)) == []  # byte-identical
    assert _gets_threads() == []  # every GET waited for, the pool shut down
    return e.value


def test_ctrl_c_mid_download_pools_identical_no_thread_left(s3server, bucket, snap_path, path_kind):
    import _thread

    def interrupt():
        _thread.interrupt_main()  # what Ctrl-C does to the main thread, while GETs run ahead

    _interrupted(s3server, bucket, snap_path, interrupt, KeyboardInterrupt, path_kind)


# last: kills the shared server and starts it again on the same directory and ports


def test_pipelined_restore_server_killed_mid_download_pools_identical(s3server, bucket, snap_path, path_kind):
    try:
        e = _interrupted(s3server, bucket, snap_path, s3server.kill, s3client.RemoteIOError, path_kind, retries=0)
        assert isinstance(e, hf.HsnapIOError)
    finally:
        s3server.start()


# ----------------------------------------------------------------------------- the second thread of a restore


def test_the_other_half_runs_on_one_kept_helper_thread_and_failures_come_back_in_order():
    seen = []
    here, there = helper_mod.on_two_threads(lambda: 1, lambda: seen.append(threading.current_thread()) or 2, "t-1")
    assert (here, there) == (1, 2)
    helper_mod.on_two_threads(lambda: None, lambda: seen.append((threading.current_thread(), threading.current_thread().name)), "t-2")
    assert seen[1] == (seen[0], "t-2") and seen[0].name == "hsnap-helper"  # one kept thread, named for each job
    def fails(kind):
        def raise_it():
            raise kind("failed")
        return raise_it

    with pytest.raises(KeyError):  # this thread's failure first
        helper_mod.on_two_threads(fails(KeyError), fails(IndexError), "t")
    with pytest.raises(IndexError):
        helper_mod.on_two_threads(lambda: None, fails(IndexError), "t")
    assert helper_mod.on_two_threads(lambda: 3, lambda: 4, "t") == (3, 4)  # a failure leaves the helper usable


def test_a_caller_that_finds_the_helper_busy_or_is_the_helper_gets_a_thread_of_its_own():
    gate, inside = threading.Event(), threading.Event()

    def hold():
        inside.set()
        gate.wait(10)

    holder = threading.Thread(target=lambda: helper_mod.on_two_threads(lambda: inside.wait(10), hold, "t"))
    holder.start()
    assert inside.wait(10)
    name = helper_mod.on_two_threads(lambda: None, lambda: threading.current_thread().name, "busy")[1]
    gate.set()
    holder.join(10)
    assert name == "busy"  # not queued behind the other restore's half
    nested = helper_mod.on_two_threads(lambda: None, lambda: helper_mod.on_two_threads(lambda: 0, lambda: threading.current_thread().name, "nested")[1], "t")[1]
    assert nested == "nested"  # the helper never waits on itself


@pytest.mark.skipif(not hasattr(os, "fork"), reason="fork only")
def test_a_process_forked_after_the_helper_ran_gets_its_own():
    helper_mod.on_two_threads(lambda: None, lambda: None, "t")  # the parent's helper exists
    pid = os.fork()
    if pid == 0:  # the child: the parent's thread is not here; a call must not wait for it
        import signal

        signal.alarm(10)
        helper = helper_mod.on_two_threads(lambda: 5, threading.current_thread, "t")[1]
        ok = helper is not threading.main_thread() and helper.name == "hsnap-helper"
        os._exit(0 if ok else 1)
    _, status = os.waitpid(pid, 0)
    assert os.waitstatus_to_exitcode(status) == 0



def test_a_helper_that_comes_after_every_job_was_taken_runs_none_and_is_not_waited_for(monkeypatch):
    helper_mod.on_two_threads(lambda: None, lambda: None, "warm")  # the kept thread exists and is free
    real_run, late = helper_mod._Job.run, threading.Event()

    def late_run(job):
        late.wait(10)  # the helper's vCPU not run yet
        real_run(job)

    monkeypatch.setattr(helper_mod._Job, "run", late_run)
    ran = []

    def run(job, ctx):
        ran.append((job, ctx, threading.current_thread().name))
        return job

    total = helper_mod.share_jobs([1, 2, 3], [2, 0, 1], run, lambda: "fork", "mine", "shared")
    # this thread takes from the back of the order: every job, smallest first, while the helper does not come
    assert total == 6 and ran == [(2, "mine", "MainThread"), (1, "mine", "MainThread"), (3, "mine", "MainThread")]
    assert not late.is_set()  # returned while the helper had not come
    late.set()
    monkeypatch.undo()
    # the withdrawn job is skipped when the helper comes; the helper takes the next caller's job
    assert helper_mod.on_two_threads(lambda: 3, lambda: threading.current_thread().name, "t") == (3, "t")
    assert len(ran) == 3


def test_a_helper_that_comes_while_jobs_are_left_takes_them_on_its_own_context():
    ran, came = [], threading.Event()

    def run(job, ctx):
        if ctx == "fork":
            came.set()
        elif not came.is_set():
            came.wait(10)  # this thread's first job held until the helper took one
        ran.append((job, ctx, threading.current_thread().name))
        return job

    assert helper_mod.share_jobs(list(range(8)), list(range(8)), run, lambda: "fork", "mine", "shared") == 28
    assert sorted(j for j, _, _ in ran) == list(range(8))
    assert {c for _, c, _ in ran} == {"mine", "fork"}
    assert {t for _, c, t in ran if c == "fork"} == {"shared"} and {t for _, c, t in ran if c == "mine"} == {"MainThread"}
    # the two ends of the order: the helper from the front (the largest jobs), this thread from the back
    helpers, mine = [j for j, c, _ in ran if c == "fork"], [j for j, c, _ in ran if c == "mine"]
    assert helpers == sorted(helpers) and helpers[0] == 0 and mine == sorted(mine, reverse=True) and mine[0] == 7
    assert max(helpers) < min(mine)


def test_shared_jobs_raise_the_first_failure_in_order_once_neither_thread_runs():
    started, running = threading.Event(), []

    def run(job, ctx):
        running.append(job)
        if job == "slow":  # the helper's: ends last
            started.set()
            time.sleep(0.2)
            running.remove(job)
            raise KeyError(job)
        started.wait(10)  # this thread's: fails first, once the helper runs the other
        running.remove(job)
        raise IndexError(job)

    with pytest.raises(helper_mod.JobFailure) as e:
        helper_mod.share_jobs(["slow", "fast"], [1, 0], run, lambda: None, None, "t")
    assert e.value.index == 0 and isinstance(e.value.error, KeyError) and running == []
