"""The scheduler's jobs, apart from the scheduler that runs them: what is queued until a request reaches a committed
decode boundary (:class:`Export`: a plain export, a drain member, a checkpoint link or a migration round; a
:class:`Drain`; a request's periodic :class:`Checkpointing`), what migrates out of or into this server
(:class:`Migrating`, :class:`Following`), and the two kinds of thread that carry work off the scheduler thread: the
:class:`LinkWriter` (writes captured links), a :class:`Watch` (looks for a marker or link in a container) and a
:class:`Job` (a resume's proof, :class:`Resuming`, or a retracted request's; :func:`proves_here` says which are proved on
the scheduler thread)."""

from __future__ import annotations

import atexit
import dataclasses
import logging
import os
import queue
import re
import stat
import threading
import time
from typing import Any

from hsnap_format import HsnapError
from hsnap_format.checkpoints import parse_link
from hsnap_format.migrations import ABANDONED_NAME, REFUSED_NAME
from hsnap_format.stores import is_url

from .containment import typed
from .errors import error_dict, error_of

logger = logging.getLogger("hsnap_sglang")

_SAFE_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,127}")

WRITER_NICE = 5  # how much lower than the scheduler's a writer thread's CPU priority is (Linux: per thread)
LOCAL_POLL_S = 0.0005  # how often a watcher looks for a marker or link in a directory (a stat)
REMOTE_POLL_S = 0.01  # ... under an s3:// prefix (a HEAD request)


@dataclasses.dataclass
class Export:
    """A request to write at its next committed decode boundary: a plain export, a drain member, a checkpoint link or
    a migration round (or its final link)."""

    rid: str
    path: str
    keep_running: bool
    asked: float  # time.monotonic() when the request arrived
    op: Any = None  # the HsnapExportReqInput to answer (None: a drain member)
    drain: "Drain | None" = None
    req: Any = None  # the Req, once found
    parked: bool = False  # taken out of the running batch (overlap), to be exported or given back
    found_in: str = ""  # where the request was when the export was asked for
    checkpoint: "Checkpointing | None" = None  # a link of a request's checkpoints (keep_running)
    base: str | None = None  # the link it is a delta of (None: plain)
    migration: "Migrating | None" = None  # a pre-copy round (keep_running) or the final link


@dataclasses.dataclass
class Drain:
    """Every request present when the drain was asked for, each an :class:`Export` member; answered once all are."""

    op: Any  # the HsnapDrainReqInput to answer
    members: list
    items: dict = dataclasses.field(default_factory=dict)  # rid -> item
    pages: Any = None  # dedup: the page store session every member's full pages go to (closed when answered)


@dataclasses.dataclass
class Checkpointing:
    """A request checkpointed every ``links.every`` output tokens (hsnap_format.checkpoints): a link is queued as a
    keep_running export at the first committed boundary where one is due."""

    links: Any  # hsnap_format.checkpoints.Checkpoints
    written: int = 0
    write_s: float = 0.0  # scheduler time per link (capturing rows/state/record at the boundary: the decode waited that long)
    writer_s: float = 0.0  # the background writer's time (header, write, fsync, rename): off the decode path
    merged: int = 0  # links due while the previous one was still being written: folded into the next (never blocks decode)
    base_position: int = 0  # state position of the last committed link (the next delta holds the rows after it)
    waiting: bool = False  # a link came due while one is being written (counted once in ``merged``)
    held: Any = None  # hsnap_io.export.WrittenLink of the last committed link: the next delta's base, not re-opened


@dataclasses.dataclass
class LinkJob:
    """An export captured at a committed boundary (a checkpoint link, a migration round, a TP 1 plain export or
    drain member), written by the link writer thread."""

    ex: "Export"
    capture: Any  # hsnap_io.export.CapturedRequest (host copies)
    result: dict  # the export's answer so far (the info is added once written)
    capture_s: float
    base: Any = None  # the base as write_captured takes it (the held WrittenLink, else the path)
    info: Any = None  # hsnap_io.export.WrittenLink once written
    error: Any = None
    writer_s: float = 0.0
    done: Any = None  # threading.Event, set once written (or failed)
    fsync: bool = True  # False: a file only this process reads back (a retraction's), renamed into place unsynced


class LinkWriter:
    """One background thread per scheduler that writes captured checkpoint links, migration rounds and (TP 1) plain
    exports and drain members (header planning, write, fsync, rename), so none of that runs in the scheduler loop. At most ``depth`` links wait; the scheduler collects the
    finished ones at its next boundary (``collect``: bookkeeping and answers stay on the scheduler thread)."""

    def __init__(self, depth: int = 2) -> None:
        self.depth = depth
        self._q: queue.Queue = queue.Queue(maxsize=depth)
        self._lock = threading.Lock()
        self._finished: list[LinkJob] = []
        self.in_flight: dict[str, LinkJob] = {}  # rid -> its link being written (scheduler thread only)
        self._thread: threading.Thread | None = None
        # rids whose export (a pause, a drain member, a migration's link) waits for their link on the way to be committed
        # first: that export goes at a later boundary; the scheduler never waits for the writer
        self.exports_waiting: set[str] = set()

    def busy(self) -> bool:
        return bool(self.in_flight)

    def full(self) -> bool:
        return len(self.in_flight) >= self.depth

    def submit(self, job: LinkJob) -> None:
        if self._thread is None:
            self._thread = threading.Thread(target=self._run, name="hsnap-link-writer", daemon=True)
            self._thread.start()
            atexit.register(self.close)
        job.done = threading.Event()
        self.in_flight[job.ex.rid] = job
        self._q.put_nowait(job)  # never blocks: full() is checked before capturing

    # a test seam, never set in production: ``before_write(writer, job)`` runs in the writer thread before each link
    # is written (tests/engine/linkgate holds a link there, "being written")
    before_write = None

    def _run(self) -> None:
        yield_cpu_to_decode()
        while True:
            job = self._q.get()
            if job is None:
                return
            self._write_one(job)

    def _write_one(self, job: LinkJob) -> None:
        """Write one link; whatever happens the job is finished (an export waiting for it never waits for ever) and
        the thread lives on for the next link."""
        from hsnap_io.export import write_captured

        t0 = time.monotonic()
        try:
            if self.before_write is not None:
                self.before_write(job)
            job.info = write_captured(job.ex.path, job.capture, base=job.base, fsync=job.fsync)
        except HsnapError as e:
            job.error = error_of(e)
        except Exception as e:  # noqa: BLE001 - a link that cannot be written stops its checkpoints (logged)
            job.error = error_dict(typed(e, "checkpoint link", job.ex.path))
        finally:
            job.writer_s = time.monotonic() - t0
            if job.capture is not None:
                job.capture.release()  # the host copies' memory goes to the next capture
            job.capture = None
            with self._lock:
                self._finished.append(job)
            job.done.set()

    def collect(self) -> list[LinkJob]:
        """The links written (or failed) since the last call; they are no longer in flight."""
        with self._lock:
            done, self._finished = self._finished, []
        for job in done:
            if self.in_flight.get(job.ex.rid) is job:
                del self.in_flight[job.ex.rid]
        return done

    def close(self) -> None:
        """Server shutdown: the links queued are written, then the thread ends (joined)."""
        if self._thread is not None and self._thread.is_alive():
            self._q.put(None)
            self._thread.join()


class Watch:
    """A daemon thread that looks for the first of ``paths`` to exist (off the scheduler thread: an object store's
    HEAD never holds up a decode step); ``hit`` is that path once seen.  A marker that says why the other side gave
    up (``refused.json``, ``abandoned.json``) is read by the thread too, before ``hit`` is set: ``said``."""

    def __init__(self, store, paths) -> None:
        self.store, self.paths, self.hit = store, list(paths), None
        self.said: str | None = None
        self._stop = threading.Event()
        self._poll = LOCAL_POLL_S if store.local else REMOTE_POLL_S
        self._thread = threading.Thread(target=self._run, name="hsnap-migration-watch", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        warned = False
        while not self._stop.is_set():
            for p in self.paths:
                try:
                    if self.store.exists(p):
                        if os.path.basename(p) in (REFUSED_NAME, ABANDONED_NAME):
                            self.said = _marker_reason(self.store, p)
                        self.hit = p
                        return
                except Exception as e:  # noqa: BLE001 - a store that errs is asked again; said once
                    if not warned:
                        logger.warning("hsnap migration: looking for %s: %s", p, e)
                        warned = True
            self._stop.wait(self._poll)

    def cancel(self) -> None:
        self._stop.set()


def _marker_reason(store, path: str) -> str:
    from hsnap_io.migrate import marker_reason

    try:
        return marker_reason(store, path)  # bounded: size, nesting, UTF-8
    except Exception as e:  # noqa: BLE001 - a store that errs now: the marker is there, its text is not
        return f"(unreadable: {type(e).__name__})"


class Job:
    """A function run once on a daemon thread of its own, off the scheduler thread (a resume's proof: the snapshot
    opened, checked and every byte read and hashed — for an ``s3://`` one, GETs); the scheduler looks at ``done`` at
    its iterations and takes ``result`` or ``error`` (what it raised, as raised)."""

    def __init__(self, fn=None, name: str = "hsnap-job") -> None:
        self.result: Any = None
        self.error: BaseException | None = None
        self.started: float = time.monotonic()
        self.ended: float | None = None
        self.done = False
        self._thread: threading.Thread | None = None
        if fn is not None:
            self._thread = threading.Thread(target=self._run, args=(fn,), name=name, daemon=True)
            self._thread.start()

    @classmethod
    def run_here(cls, fn) -> "Job":
        """``fn`` run now, on the caller's thread: a done job."""
        job = cls()
        try:
            job.result = fn()
        except Exception as e:  # noqa: BLE001 - the scheduler answers it (typed there); an interrupt goes on up
            job.error = e
        finally:
            job.ended, job.done = time.monotonic(), True
        return job

    @classmethod
    def failed(cls, error: BaseException) -> "Job":
        """A job refused before it started (no thread): done, with ``error``."""
        job = cls()
        job.error, job.ended, job.done = error, job.started, True
        return job

    def _run(self, fn) -> None:
        try:
            self.result = fn()
        except BaseException as e:  # noqa: BLE001 - the scheduler answers it (typed there)
            self.error = e
        finally:
            self.ended = time.monotonic()
            self.done = True  # last: result and error are set when done is seen

    def wait(self, timeout: float | None = None) -> bool:
        if self._thread is not None:
            self._thread.join(timeout)
        return self.done

    def discard(self) -> None:
        """Nobody will take the result (its request went away): it is closed (a proof's open files and staging
        buffer) now if the job is done, else by a daemon thread once it ends."""

        def close() -> None:
            self.wait()
            result, self.result = self.result, None
            if result is not None:
                try:
                    result.close()
                except Exception:  # noqa: BLE001 - nothing waits for it; said
                    logger.exception("hsnap: closing a discarded proof")

        if self.done:
            close()
        else:
            threading.Thread(target=close, name="hsnap-discard", daemon=True).start()


@dataclasses.dataclass
class Resuming:
    """A resume whose snapshot is read and proved off the scheduler thread (:class:`Job` running
    ``hsnap_sglang.req.prove_resume``); the scheduler restores and admits it once the proof is done on every rank.
    ``job`` is None while it waits for a place among the proofs in flight (``start`` makes it)."""

    op: Any  # the HsnapResumeReqInput to answer
    received: float  # time.monotonic() when the scheduler took the message
    job: Job | None
    start: Any = None  # () -> Job, for a proof not started yet
    ahead: float | None = None  # when the proof started ahead of this message was asked for (ProvedAhead.received)

    @property
    def done(self) -> bool:
        return self.job is not None and self.job.done


@dataclasses.dataclass
class ProvedAhead:
    """A resume's proof started before the resume itself arrived (``HsnapProveAheadReqInput``): the HTTP process reads
    the record, claims the snapshot and registers the client meanwhile.  The resume naming it takes ``job``."""

    path: str  # as confine.resolve gives it
    job: Job
    received: float  # time.monotonic() when the scheduler took the message


# Proofs started ahead of their resume, held at once (more are not started: their resumes prove as they arrive), and
# how long one waits for its resume before it is given back (the HTTP process says so sooner when it refuses first).
MAX_PROVED_AHEAD = 2
PROVED_AHEAD_TTL_S = 30.0


# A local snapshot file up to this size is proved on the scheduler thread: ~5 ms on 2 CPU cores, under half a decode
# step, where a proof on a worker costs the resumed request about one step more (it joins the batch at the iteration
# after the proof; bench/SERVER.md); larger files, TP set directories and objects (network reads) are proved off it.
# The operator's HSNAP_PROOF_ON_SCHEDULER_BYTES sets it (0: every resume proved off the scheduler thread, e.g. for
# snapshots on a network file system).
PROOF_HERE_BYTES_ENV = "HSNAP_PROOF_ON_SCHEDULER_BYTES"
PROOF_HERE_BYTES = 4 << 20
# How long an idle scheduler waits on a proof running off its thread, at an iteration: spinning in Python it would hold
# the GIL, and the proof's thread would get it back only every switch interval (5 ms) after each read or hash (a
# 4k-token proof took 20 ms instead of 4); a message arriving meanwhile waits at most this long.
IDLE_PROOF_WAIT_S = 0.005


def proof_here_bytes(env=None) -> int:
    """The operator's :data:`PROOF_HERE_BYTES_ENV` (a byte count), else :data:`PROOF_HERE_BYTES`; a value that is not
    a non-negative integer is said once and the default kept."""
    given = (os.environ if env is None else env).get(PROOF_HERE_BYTES_ENV)
    if given is None:
        return PROOF_HERE_BYTES
    if given.strip().isascii() and given.strip().isdigit():  # (str.isdigit takes "²", which int() refuses)
        return int(given)
    logger.warning("hsnap: %s=%r is not a byte count; resumes of local files up to %d bytes are proved on the scheduler thread",
                   PROOF_HERE_BYTES_ENV, given[:40], PROOF_HERE_BYTES)
    return PROOF_HERE_BYTES


def proves_here(path: str, limit: int) -> bool:
    """Whether a resume of ``path`` (resolved) is proved on the scheduler thread: a local regular file of at most
    ``limit`` bytes that is not a checkpoint link (the chain below a link is read too, whatever the link's size)."""
    if is_url(path) or parse_link(os.path.basename(path)) is not None:
        return False
    try:
        st = os.stat(path)
    except OSError:
        return True  # refused by the proof at once
    return stat.S_ISREG(st.st_mode) and st.st_size <= limit


@dataclasses.dataclass
class Migrating:
    """A request migrating out of this server (source side)."""

    op: Any  # HsnapMigrateReqInput, answered once the final link is committed (or the migration given up)
    container: str
    store: Any
    tail: int
    max_rounds: int
    timeout_s: float
    fsync: bool
    started: float
    links: list = dataclasses.field(default_factory=list)  # committed rounds, in order
    rounds: list = dataclasses.field(default_factory=list)  # per round: what it carried and took
    base_position: int = 0  # state position of the last committed round (the next delta holds the rows after it)
    held: Any = None  # hsnap_io.export.WrittenLink of the last committed round: the next delta's base, not re-opened
    queued: bool = False  # a round or the final link is pending or being written
    watch: Watch | None = None  # the last round's .applied marker
    since: float = 0.0  # when the last round was committed
    writer_s: float = 0.0
    stopped_checkpoints: bool = False
    left_at_stop: int = 0  # rows after the last round when the stop was decided (the boundary it waits for adds its step)


@dataclasses.dataclass
class Following:
    """A migration this server follows (target side)."""

    op: Any  # HsnapFollowReqInput, answered once the final link is applied and the Req bound (or refused)
    container: str
    store: Any
    target: Any  # hsnap_io.migrate.MigrationTarget over the scheduler's pools
    timeout_s: float
    deadline: float
    watch: Watch | None = None
    proof: Job | None = None  # the next link seen, being read and proved off the scheduler thread (MigrationTarget.prove)
    prepared: Any = None  # hsnap_sglang.req.PreparedReq of the last link checked (the first, then the final)
    applied: list = dataclasses.field(default_factory=list)
    started: float = 0.0
    arrived_at: float = 0.0  # the final link applied and the Req bound: admitted by the HTTP process within timeout_s


def yield_cpu_to_decode() -> None:
    """Lower the calling thread's CPU priority by :data:`WRITER_NICE` (``setpriority`` on its thread id: Linux
    schedules threads apart): a background write takes what the decode loop leaves, so the other requests of a
    busy host do not wait for it (where the cores are shared).  Nowhere to lower it: nothing happens."""
    try:
        tid = threading.get_native_id()
        os.setpriority(os.PRIO_PROCESS, tid, min(19, os.getpriority(os.PRIO_PROCESS, tid) + WRITER_NICE))
    except (OSError, AttributeError):  # not Linux, or not permitted
        pass


def safe_file_name(rid: str) -> str:
    """``rid`` where it is a safe file name, else ``rid-<its hash>``: what a drain, checkpoints and retractions name files by."""
    import xxhash

    return rid if _SAFE_NAME.fullmatch(rid) else f"rid-{xxhash.xxh3_64_hexdigest(rid.encode())}"
