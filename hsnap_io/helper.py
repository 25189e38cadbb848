"""The restore's second thread: one kept thread per process, and the two ways a restore uses it.

* :func:`on_two_threads` runs two fixed halves at once (a staged body's two parts);
* :func:`share_jobs` runs a list of jobs on this thread and the helper, each taking the next job when it is free (the
  helper the largest left, the caller the smallest) — an upload's sections. On this VM a vCPU woken from idle runs the
  helper up to ~2 ms after the call, which a fixed split made the caller wait for; shared, the caller starts at once,
  the helper takes what is left when it comes, and a helper that comes after every job was taken is not waited for.

preadv, numpy's copies and xxhash (an update of 64 KiB or more) release the GIL: the two threads copy and hash on
two cores.
"""

from __future__ import annotations

import collections
import os
import queue
import threading
from collections.abc import Callable, Sequence
from typing import Any


class _Job:
    """``fn`` offered to a thread; ``withdraw()`` cancels it if it has not started, else waits for it to end;
    ``join()`` waits for it to run and end."""

    __slots__ = ("fn", "lock", "state", "done")

    def __init__(self, fn: Callable[[], None]) -> None:
        self.fn, self.lock, self.state, self.done = fn, threading.Lock(), "offered", threading.Event()

    def run(self) -> None:
        with self.lock:
            if self.state != "offered":  # withdrawn: the caller did it all
                return
            self.state = "running"
        try:
            self.fn()
        finally:
            self.done.set()

    def withdraw(self) -> None:
        with self.lock:
            if self.state == "offered":
                self.state = "withdrawn"
                return
        self.done.wait()

    def join(self) -> None:
        self.done.wait()


class Helper:
    """One long-lived thread per process that runs the other half of a two-thread call: a thread started per call
    waited 0.8 ms on average for the OS to run it (a resume in a busy 2-core server starts two). Busy (another
    restore's half, or a call from the helper itself), or in a process forked while it ran: a thread of its own."""

    def __init__(self) -> None:
        self._free = threading.Lock()  # held while a job of one caller is offered to it or runs on it
        self._pid: int | None = None
        self._jobs: queue.SimpleQueue | None = None
        self._thread: threading.Thread | None = None

    def offer(self, fn: Callable[[], None], name: str, *, cancel: bool = True) -> Callable[[], None]:
        """Offer ``fn()`` (which must not raise) to run beside the caller; returns the call that ends the offer: it
        cancels ``fn`` if no thread has started it yet (``cancel=False``: waits for it to run), else waits for it
        to end."""
        job = _Job(fn)
        end = job.withdraw if cancel else job.join
        if threading.current_thread() is self._thread or not self._free.acquire(blocking=False):
            threading.Thread(target=job.run, name=name, daemon=True).start()
            return end
        try:
            if self._pid != os.getpid():  # the first call, or a forked child (the parent's thread is not here)
                self._jobs = queue.SimpleQueue()
                self._thread = threading.Thread(target=self._serve, args=(self._jobs,), name="hsnap-helper", daemon=True)
                self._thread.start()
                self._pid = os.getpid()
            self._jobs.put((job, name))
        except BaseException:
            self._free.release()
            raise

        def end_offer() -> None:
            # a withdrawn job stays queued until the thread skips it: the next caller's job runs after it
            end()
            self._free.release()

        return end_offer

    @staticmethod
    def _serve(jobs: queue.SimpleQueue) -> None:
        me = threading.current_thread()
        while True:
            job, name = jobs.get()
            me.name = name  # named for the job while it runs (a traceback, a log line)
            try:
                job.run()
            finally:
                me.name = "hsnap-helper"


HELPER = Helper()


def _outcome(fn: Callable[[], Any]) -> tuple[bool, Any]:
    try:
        return True, fn()
    except BaseException as e:  # noqa: BLE001 - raised in the calling thread
        return False, e


def on_two_threads(here: Callable[[], Any], there: Callable[[], Any], name: str) -> tuple:
    """``here()`` on this thread and ``there()`` on the helper thread, at once; both results, or the first failure
    (this thread's before the other's), raised here once both ended."""
    other: list = []
    join = HELPER.offer(lambda: other.append(_outcome(there)), name, cancel=False)
    mine = _outcome(here)
    join()
    for ok, value in (mine, other[0]):
        if not ok:
            raise value
    return mine[1], other[0][1]


class JobFailure(Exception):
    """The failure of job ``index`` of :func:`share_jobs` (``error``)."""

    def __init__(self, index: int, error: BaseException) -> None:
        super().__init__(index)
        self.index, self.error = index, error


def share_jobs(jobs: Sequence[Any], order: Sequence[int], run: Callable[[Any, Any], int], helper_context: Callable[[], Any],
               context: Any, name: str) -> int:
    """Run ``run(jobs[i], ctx)`` for every ``i`` in ``order`` on this thread (``ctx`` = ``context``) and on the helper
    (``ctx`` = ``helper_context()``, made when it takes its first job), each taking the next index when it is free:
    the helper from the front of ``order``, this thread from the back. Returns the sum of the results. A failure stops
    both from taking more; once neither runs a job, the failure of the lowest index is raised as :class:`JobFailure`.

    Given ``order`` largest first, the helper reads and hashes the large jobs, which release the GIL for most of their
    time, while this thread runs the small ones, mostly Python under the GIL: taken from one end by both, the two
    threads ran small jobs at the same time at the end and handed the GIL to each other at every step (a wake-up of
    the other vCPU each on this VM: a 53-token restore's upload 3.54 -> 3.06 ms, 4,096 tokens 6.52 -> 6.11 ms)."""
    left = collections.deque(order)  # popleft() and pop() are atomic under the GIL: no lock to hand over
    failures: list[tuple[int, BaseException]] = []

    def work(ctx: Any, make: Callable[[], Any] | None, take: Callable[[], int]) -> int:
        total = 0
        while not failures:
            try:
                i = take()
            except IndexError:  # every job taken
                break
            try:
                if make is not None:
                    ctx, make = make(), None
                total += run(jobs[i], ctx)
            except BaseException as e:  # noqa: BLE001 - raised in the calling thread
                failures.append((i, e))
                break
        return total

    theirs: list[int] = []
    finish = HELPER.offer(lambda: theirs.append(work(None, helper_context, left.popleft)), name)
    try:
        mine = work(context, None, left.pop)
    finally:
        finish()  # the helper writes nothing once this returns: a rollback may follow
    if failures:
        raise JobFailure(*min(failures, key=lambda f: f[0]))
    return mine + sum(theirs)
