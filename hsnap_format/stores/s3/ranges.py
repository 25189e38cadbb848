"""Reading an object by ranged GETs: :class:`RangeReader` (pinned to the ETag of open),
:class:`RangeSource` (the source of a :class:`~hsnap_format.reader.Snapshot`), read-ahead
and per-section hashing for a restore, and opening a rank object or a set."""

from __future__ import annotations

import collections
import concurrent.futures as cf
import contextlib
import itertools
import threading
from dataclasses import dataclass
from typing import Any, Callable, Iterator

import numpy as np

import xxhash

from ...errors import (
    DigestMismatchError,
    HsnapError,
    Phrase,
    TruncatedError,
    UnsupportedFeatureError,
)
from ...reader import SectionInfo
from .client import ObjectChangedError, call, client, error_code, fault_point, translate
from .options import StorageOptions, parse_url

_POOL_NUMBERS = itertools.count()  # each reader's GET threads are named apart (close joins its own)


class RangeReader:
    """An object's bytes by ranged GET, pinned to the version seen by the first GET."""

    def __init__(self, url: str, options: StorageOptions | None = None) -> None:
        self.url = url
        self.options = StorageOptions.of(options)
        self.bucket, self.key = parse_url(url)
        self.client = client(self.options, url)
        self._pool: cf.ThreadPoolExecutor | None = None
        self.requests = 0  # GETs sent (open latency is counted in round trips)
        fault_point("open", url)
        self.requests += 1
        try:
            r = self.client.get_object(Bucket=self.bucket, Key=self.key, Range=f"bytes=0-{max(self.options.first_read, 64) - 1}")
            body = r["Body"].read()
        except Exception as e:  # noqa: BLE001
            if error_code(e) == "InvalidRange":  # an empty object
                self.size, self.etag, self.version, self._first = 0, None, None, b""
                return
            raise translate(e, url, "open", self.options) from None
        self.etag = r.get("ETag")
        self.version = r.get("VersionId")
        total = r.get("ContentRange", "").rpartition("/")[2]
        self.size = int(total) if total.isdigit() else len(body)
        self._first = body

    def _executor(self) -> cf.ThreadPoolExecutor:
        if self._pool is None:
            self._pool_name = f"hsnap-get-{next(_POOL_NUMBERS)}"
            self._pool = cf.ThreadPoolExecutor(self.options.parallel, thread_name_prefix=self._pool_name)
        return self._pool

    def _get(self, offset: int, out) -> None:
        """Fill ``out`` with bytes [offset, offset+len(out)) of the pinned version (``out``: a
        view, or a list of views filled one after another by one GET)."""
        outs = [o for o in ([out] if isinstance(out, memoryview) else out) if len(o)]
        n = sum(len(o) for o in outs)
        fault_point("get", self.url, offset, n)
        self.requests += 1
        kw: dict[str, Any] = {"Bucket": self.bucket, "Key": self.key, "Range": f"bytes={offset}-{offset + n - 1}"}
        if self.version:
            kw["VersionId"] = self.version
        if self.etag:
            kw["IfMatch"] = self.etag
        try:
            body = self.client.get_object(**kw)["Body"]
            done, k, into = 0, 0, 0  # bytes read; outs[k], filled up to ``into``
            while done < n:  # read into the targets piece by piece: no second whole-chunk copy
                piece = memoryview(body.read(min(1 << 20, n - done)))
                if not piece:
                    break
                while piece:
                    m = min(len(piece), len(outs[k]) - into)
                    outs[k][into : into + m] = piece[:m]
                    piece, into, done = piece[m:], into + m, done + m
                    if into == len(outs[k]):
                        k, into = k + 1, 0
        except Exception as e:  # noqa: BLE001
            raise translate(e, self.url, f"read at byte {offset}", self.options) from None
        if done != n:
            raise TruncatedError(self.url, f"read at byte {offset} (object changed under the reader?)", n, done)

    def pread(self, n: int, offset: int) -> bytes:
        """Up to ``n`` bytes at ``offset`` (short at the end of the object), like os.pread."""
        n = max(0, min(n, self.size - offset))
        if offset + n <= len(self._first):
            return self._first[offset : offset + n]
        out = bytearray(n)
        self.readinto(memoryview(out), offset)
        return bytes(out)

    def readinto(self, view: memoryview, offset: int) -> None:
        """Fill ``view`` from ``offset``: chunked ranged GETs, ``parallel`` in flight."""
        view = memoryview(view).cast("B")
        n = len(view)
        if offset + n > self.size:
            raise TruncatedError(self.url, f"read at byte {offset}", offset + n, Phrase(f"{self.size} bytes"))
        if offset + n <= len(self._first):
            view[:] = self._first[offset : offset + n]
            return
        step = self.options.chunk_bytes
        pieces = [(a, min(n, a + step)) for a in range(0, n, step)]
        if len(pieces) == 1:
            return self._get(offset, view)
        futures: list[cf.Future] = []
        try:  # (submitted inside the try: an interrupt while submitting still waits for what was submitted)
            for a, b in pieces:
                futures.append(self._executor().submit(self._get, offset + a, view[a:b]))
            for f in futures:
                f.result()
        finally:
            for f in futures:
                f.cancel()
            cf.wait(futures)  # nothing may write into ``view`` after we return

    def iter_into(self, view: memoryview, offset: int, step: int) -> Iterator[tuple[int, memoryview]]:
        """Fill ``view`` from ``offset`` in ``step``-byte ranged GETs, ``parallel`` in flight,
        yielding ``(offset, piece)`` in order as each lands: the consumer hashes a piece
        while the next ones download. Leaving early (an error, the consumer stops) cancels
        what has not started and waits for what has: nothing writes into ``view`` after."""
        view = memoryview(view).cast("B")
        n = len(view)
        if offset + n > self.size:
            raise TruncatedError(self.url, f"read at byte {offset}", offset + n, Phrase(f"{self.size} bytes"))
        step = max(1, step)
        pieces = [(a, min(n, a + step)) for a in range(0, n, step)]
        futures: list = []
        try:  # (submitted inside the try: leaving early still waits for what was submitted)
            for a, b in pieces:
                futures.append((a, b, self._executor().submit(self._get, offset + a, view[a:b])))
            for a, b, f in futures:
                f.result()  # the GET's typed error
                yield offset + a, view[a:b]
        finally:
            for *_, f in futures:
                f.cancel()
            cf.wait([f for *_, f in futures])

    def check_unchanged(self) -> None:
        fault_point("head", self.url)
        r = call(self.url, "head", self.options, self.client.head_object, Bucket=self.bucket, Key=self.key)
        if r.get("ETag") != self.etag or r.get("ContentLength") != self.size:
            raise ObjectChangedError(self.url, "ETag (changed since open)", self.etag, r.get("ETag"))

    def close(self) -> None:
        pool, self._pool = self._pool, None
        if pool is not None:
            pool.shutdown(wait=True)
            # a worker whose start a KeyboardInterrupt cut short is not in the pool's list,
            # so shutdown does not join it (it exits on the pool's stop signal): join it here
            prefix = self._pool_name + "_"
            for t in threading.enumerate():
                if t.name.startswith(prefix) and t is not threading.current_thread():
                    t.join()


_HASH_PIECE = 2 << 20  # hashed right after it is copied, while still in cache


class SectionRange:
    """One section of a remote snapshot for a restore engine: ``readinto(view, at)``
    fills ``view`` with the section's bytes from ``at`` (ranged GETs) and hashes them
    in order; :meth:`finish` then checks the digest — what was hashed is what landed
    in the slots."""

    def __init__(self, source: RangeSource, info: SectionInfo) -> None:
        self.source, self.info = source, info
        self.offset, self.length = info.offset, info.length
        self._h = xxhash.xxh3_128()
        self._next = 0

    def readinto(self, view: memoryview, at: int) -> None:
        view = memoryview(view).cast("B")
        if at != self._next:  # the digest is over the section in order
            raise HsnapError(self.source.path, f"sections[{self.info.name!r}]", f"a read at byte {self._next}", at, detail="out of order")
        # with a read-ahead running, 2 MiB at a time: each piece is hashed right after it is
        # copied out of the read-ahead, while still in cache (the next GETs run meanwhile)
        step = _HASH_PIECE if self.source._prefetch is not None else max(len(view), 1)
        for a in range(0, len(view), step):
            piece = view[a : a + step]
            self.source.readinto(piece, self.offset + at + a)
            self._h.update(piece)
        self._next += len(view)

    def finish(self) -> None:
        if self._next != self.length:
            raise TruncatedError(self.source.path, f"sections[{self.info.name!r}]", self.length, self._next)
        got = self._h.hexdigest()
        if got != self.info.digest:
            raise DigestMismatchError(self.source.path, f"sections[{self.info.name!r}].digest", self.info.digest, got)


READ_AHEAD_GAP = 64 << 10  # planned ranges this close in the object are fetched as one run (the padding between is read too)


@dataclass(frozen=True)
class Landing:
    """Where a planned range's bytes go as they arrive: its GETs write straight into ``view``
    (the range's length; no ring buffer, no copy — :meth:`ReadAhead.serve` finds them already
    there). ``before(a, b)``, when given, runs in the GET's thread just before bytes [a, b)
    of ``view`` are written (an undo log saving what the view held)."""

    view: memoryview
    before: Callable[[int, int], None] | None = None


def _address(view: memoryview) -> int:
    return np.frombuffer(view, dtype=np.uint8).ctypes.data


class _Get:
    """One planned ranged GET of ``[a, b)``: ``parts`` ``(start, stop, view, landing, at)``
    cover it in order, each a slice of a landing (``at``: where in it) or, its view None until
    the GET is submitted, of ``buf``: the ring buffer that takes every byte without a landing
    (``ringed``; none when every byte has one)."""

    __slots__ = ("a", "b", "parts", "ringed", "buf", "future")

    def __init__(self, a: int, b: int, parts: list) -> None:
        self.a, self.b, self.parts = a, b, parts
        self.ringed = any(view is None for _, _, view, _, _ in parts)
        self.buf: bytearray | None = None
        self.future: cf.Future | None = None


class ReadAhead:
    """The byte ranges a restore will read, in the order it reads them, fetched ahead of it
    by ranged GETs of ``chunk`` bytes over the object (ranges close together are fetched as
    one run, a GET crossing from one range into the next). A range planned with a
    :class:`Landing` is fetched straight into it; every other byte goes to one of at most
    ``depth`` reused ring buffers — memory ``depth x chunk`` whatever the object size — so
    the next GETs run while the consumer hashes and scatters the current chunk. A GET that
    needs no ring buffer costs no memory: all of those are queued at once (the reader's
    ``parallel`` threads bound what is in flight).

    :meth:`serve` hands bytes out strictly in plan order; a read it does not hold next
    (off the plan) is left to the caller's own GET. Every GET is the reader's (pinned to
    the ETag of open). A failed GET raises from :meth:`serve` typed; :meth:`close`
    cancels what has not started and waits for what has (no GET outlives it: nothing
    writes into a landing after it returns)."""

    def __init__(self, reader: RangeReader, ranges, *, depth: int, chunk: int) -> None:
        """``ranges``: ``(offset, length)`` or ``(offset, length, landing)`` (a :class:`Landing` or None)."""
        self.reader, self.depth, self.chunk = reader, max(1, depth), max(1, chunk)
        runs: list[list] = []  # [start, stop, [(start, stop, landing)]]: ranges close together, one run
        for offset, length, *rest in ranges:
            if length <= 0:
                continue
            seg = (offset, offset + length, rest[0] if rest else None)
            if runs and runs[-1][1] <= offset <= runs[-1][1] + READ_AHEAD_GAP:
                runs[-1][1] = offset + length
                runs[-1][2].append(seg)
            else:
                runs.append([offset, offset + length, [seg]])
        self._todo = collections.deque(g for a0, b0, segs in runs for g in self._plan(a0, b0, segs))
        self._held: collections.deque = collections.deque()  # submitted _Gets, plan order
        self._free: list[bytearray] = []
        self.submitted = 0
        self.ring_buffers = 0  # ring buffers made (the memory the ring took)
        self._ring_held = 0
        # close() waits for every GET that started and stops every later one, whatever bookkeeping a
        # KeyboardInterrupt in the consumer's thread cut short (a future submitted, not yet held)
        self._state = threading.Condition()
        self._closed, self._active = False, 0

    def start(self) -> None:
        """Submit the first GETs (not in ``__init__``: whoever holds the read-ahead can close it
        however its start ends)."""
        self._fill()

    def _plan(self, a0: int, b0: int, segs: list) -> list[_Get]:
        """The GETs of one run: ``chunk`` bytes each, every byte in a part (a landing's or the ring's)."""
        gets = []
        for a in range(a0, b0, self.chunk):
            b = min(b0, a + self.chunk)
            parts, at = [], a
            for s0, s1, landing in segs:
                if s1 <= at or s0 >= b:
                    continue
                if s0 > at:  # the gap before this range (padding): read, not handed out
                    parts.append((at, s0, None, None, 0))
                lo, hi = max(s0, at), min(s1, b)
                parts.append((lo, hi, None if landing is None else landing.view[lo - s0 : hi - s0], landing, lo - s0))
                at = hi
            if at < b:
                parts.append((at, b, None, None, 0))
            gets.append(_Get(a, b, parts))
        return gets

    def _fill(self) -> None:
        while self._todo and (not self._todo[0].ringed or self._ring_held < self.depth):
            g = self._todo.popleft()
            if g.ringed:
                if not self._free:
                    self.ring_buffers += 1
                g.buf = self._free.pop() if self._free else bytearray(self.chunk)
                self._ring_held += 1
                ring = memoryview(g.buf)
                g.parts = [(x, y, ring[x - g.a : y - g.a] if v is None else v, landing, at) for x, y, v, landing, at in g.parts]
            g.future = self.reader._executor().submit(self._land, g)
            self._held.append(g)
            self.submitted += 1

    def _land(self, g: _Get) -> None:
        with self._state:
            if self._closed:  # (never handed out: serve is not called after close)
                return
            self._active += 1
        try:
            for _, _, view, landing, at in g.parts:
                if landing is not None and landing.before is not None:
                    landing.before(at, at + len(view))
            self.reader._get(g.a, [view for _, _, view, _, _ in g.parts])
        finally:
            with self._state:
                self._active -= 1
                self._state.notify_all()

    def serve(self, view: memoryview, offset: int) -> int:
        """Copy the planned bytes at ``offset`` into ``view`` (nothing to copy where they
        landed there already); how many (from its start)."""
        done, n = 0, len(view)
        while done < n and self._held:
            g = self._held[0]
            at = offset + done
            if at >= g.b:  # planned bytes the consumer skipped: drop them
                g.future.cancel()
                cf.wait([g.future])
                self._release()
                continue
            if not g.a <= at < g.b:
                break
            g.future.result()  # the GET's typed error, raised here
            x, y, src = next((x, y, v) for x, y, v, _, _ in g.parts if x <= at < y)
            k = min(y - at, n - done)
            src, dst = src[at - x : at - x + k], view[done : done + k]
            if _address(src) != _address(dst):
                dst[:] = src
            done += k
            if at + k == g.b:
                self._release()
        return done

    def _release(self) -> None:
        g = self._held.popleft()
        if g.ringed:
            self._free.append(g.buf)  # (its GET is done) reused: fresh memory is expensive
            self._ring_held -= 1
        self._fill()

    def close(self) -> None:
        with self._state:
            self._closed = True
        held, self._held, self._todo = list(self._held), collections.deque(), collections.deque()
        for g in held:
            g.future.cancel()
        with self._state:  # nothing writes into a buffer or a landing after this returns
            while self._active:
                self._state.wait()
        self._free = []


class RangeSource:
    """An object's bytes for a :class:`~hsnap_format.reader.Snapshot` (a source, see
    :mod:`hsnap_format.source`): ranged GETs pinned to the ETag of open, no map (a section
    read is a copy), verification in one streaming pass of ``window`` bytes at a time."""

    mappable = False
    # restore verifies each section as it lands in the slots (one pass over the network)
    verifies_while_reading = True

    def __init__(self, url: str, options=None, *, reader: RangeReader | None = None) -> None:
        self.path = url
        self._closed = True
        self._prefetch: ReadAhead | None = None
        self.reader = reader or RangeReader(url, options)
        self._closed = False
        self.options = self.reader.options
        self.size, self.version = self.reader.size, self.reader.etag
        self.window = self.options.chunk_bytes * self.options.parallel

    @property
    def etag(self) -> str | None:
        return self.reader.etag

    @property
    def requests(self) -> int:
        """GETs sent so far (open latency is counted in round trips)."""
        return self.reader.requests

    def pread(self, n: int, offset: int) -> bytes:
        return self.reader.pread(n, offset)

    def fileno(self) -> int:
        raise UnsupportedFeatureError(self.path, "fileno", "a local file", Phrase("an object-store URL"))

    def map(self):
        raise UnsupportedFeatureError(self.path, "zero-copy view", "a local file", Phrase("an object-store URL (use read())"))

    def check_unchanged(self) -> None:
        self.reader.check_unchanged()

    def section_range(self, info: SectionInfo) -> SectionRange:
        return SectionRange(self, info)

    @property
    def stage_window(self) -> int:
        """Bytes per ranged GET when a restore stages this object (each hashed as it lands)."""
        return self.options.chunk_bytes

    def iter_into(self, view: memoryview, offset: int, step: int) -> Iterator[tuple[int, memoryview]]:
        """:meth:`RangeReader.iter_into` of this object (the GETs pinned to its ETag)."""
        if self._closed:
            raise HsnapError(self.path, "snapshot", "open", Phrase("closed"))
        return self.reader.iter_into(view, offset, step)

    @contextlib.contextmanager
    def serving(self, source):
        """While the block runs, reads are served first by ``source.serve(view, offset)``
        (bytes it holds, e.g. a restore's staging buffer, already read and hashed)."""
        if self._prefetch is not None:
            yield
            return
        self._prefetch = source
        try:
            yield
        finally:
            self._prefetch = None

    @contextlib.contextmanager
    def read_ahead(self, sections, landings=None):
        """While the block runs, ``sections`` (in the order they will be read through
        :meth:`section_range`) are fetched ahead of the reads (:class:`ReadAhead`:
        ``parallel`` GETs of ``chunk_bytes`` submitted ahead, memory parallel x chunk);
        ``landings`` (one per section, a :class:`Landing` or None): where a section's bytes
        go straight away (the slots it is read into). On leaving, every GET still running
        is waited for."""
        o = self.options
        if self._prefetch is not None:  # one read-ahead at a time (a nested block adds nothing)
            yield self._prefetch
            return
        plan = [(i.offset, i.length, None if landings is None else landings[k]) for k, i in enumerate(sections)]
        pf = self._prefetch = ReadAhead(self.reader, plan, depth=o.parallel, chunk=o.chunk_bytes)
        try:
            pf.start()
            yield pf
        finally:
            self._prefetch = None
            pf.close()

    def readinto(self, view: memoryview, offset: int) -> None:
        """Sequential reads (a restore, section after section): one window of
        chunk x parallel bytes fetched in parallel serves the small sections that follow
        (a GET per small section would cost a round trip each); reads at least a window
        long go straight into ``view``. Memory: one window buffer, reused."""
        if self._prefetch is not None:
            got = self._prefetch.serve(view, offset)
            if got == len(view):
                return
            view, offset = view[got:], offset + got
        n = len(view)
        if n >= self.window:
            return self.reader.readinto(view, offset)
        w_at, w_len = getattr(self, "_window", (0, 0))
        if not (w_at <= offset and offset + n <= w_at + w_len):
            w_len = min(self.window, self.size - offset)
            if len(getattr(self, "_window_buf", b"")) < w_len:
                self._window_buf = bytearray(self.window)
            self.reader.readinto(memoryview(self._window_buf)[:w_len], offset)
            self._window = w_at, w_len = offset, w_len
        view[:] = memoryview(self._window_buf)[offset - w_at : offset - w_at + n]

    def close(self) -> None:
        if not self._closed:
            self._closed = True
            if self._prefetch is not None:
                self._prefetch.close()
                self._prefetch = None
            self.reader.close()


__all__ = ["READ_AHEAD_GAP", "Landing", "RangeReader", "RangeSource", "ReadAhead", "SectionRange"]
