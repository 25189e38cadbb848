"""Reading an object by ranged GETs: :class:`RangeReader` (pinned to the ETag of open),
:class:`RangeSource` (the source of a :class:`~hsnap_format.reader.Snapshot`), read-ahead
and per-section hashing for a restore, and opening a rank object or a set."""

from __future__ import annotations

import collections
import concurrent.futures as cf
import contextlib
import itertools
import threading
from typing import Any, Iterator

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

    def _get(self, offset: int, out: memoryview) -> None:
        """Fill ``out`` with bytes [offset, offset+len(out)) of the pinned version."""
        n = len(out)
        fault_point("get", self.url, offset, n)
        self.requests += 1
        kw: dict[str, Any] = {"Bucket": self.bucket, "Key": self.key, "Range": f"bytes={offset}-{offset + n - 1}"}
        if self.version:
            kw["VersionId"] = self.version
        if self.etag:
            kw["IfMatch"] = self.etag
        try:
            body = self.client.get_object(**kw)["Body"]
            done = 0
            while done < n:  # read into the target piece by piece: no second whole-chunk copy
                piece = body.read(min(1 << 20, n - done))
                if not piece:
                    break
                out[done : done + len(piece)] = piece
                done += len(piece)
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
        futures = [self._executor().submit(self._get, offset + a, view[a:b]) for a, b in pieces]
        try:
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
        futures = [(a, b, self._executor().submit(self._get, offset + a, view[a:b])) for a, b in pieces]
        try:
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


class ReadAhead:
    """The byte ranges a restore will read, in the order it reads them, fetched ahead of it:
    ranged GETs of ``chunk`` bytes, at most ``depth`` submitted and not yet consumed, each
    into one of ``depth`` reused buffers — memory ``depth x chunk`` whatever the object
    size — so the next GETs run while the consumer hashes and scatters the current chunk.

    :meth:`serve` hands bytes out strictly in plan order; a read it does not hold next
    (off the plan) is left to the caller's own GET. Every GET is the reader's (pinned to
    the ETag of open). A failed GET raises from :meth:`serve` typed; :meth:`close`
    cancels what has not started and waits for what has (no GET outlives it)."""

    def __init__(self, reader: RangeReader, ranges, *, depth: int, chunk: int) -> None:
        self.reader, self.depth, self.chunk = reader, max(1, depth), max(1, chunk)
        runs: list[list[int]] = []
        for offset, length in ranges:
            if length <= 0:
                continue
            if runs and runs[-1][1] <= offset <= runs[-1][1] + READ_AHEAD_GAP:
                runs[-1][1] = max(runs[-1][1], offset + length)
            else:
                runs.append([offset, offset + length])
        self._todo = collections.deque((a, min(b, a + self.chunk)) for a0, b in runs for a in range(a0, b, self.chunk))
        self._held: collections.deque = collections.deque()  # (start, stop, buffer, future), plan order
        self._free: list[bytearray] = []
        self.submitted = 0
        self._fill()

    def _fill(self) -> None:
        while self._todo and len(self._held) < self.depth:
            a, b = self._todo.popleft()
            buf = self._free.pop() if self._free else bytearray(self.chunk)
            view = memoryview(buf)[: b - a]
            self._held.append((a, b, buf, self.reader._executor().submit(self.reader._get, a, view)))
            self.submitted += 1

    def serve(self, view: memoryview, offset: int) -> int:
        """Copy the planned bytes at ``offset`` into ``view``; how many (from its start)."""
        done, n = 0, len(view)
        while done < n and self._held:
            a, b, buf, fut = self._held[0]
            at = offset + done
            if at >= b:  # planned bytes the consumer skipped: drop them
                fut.cancel()
                cf.wait([fut])
                self._release()
                continue
            if not a <= at < b:
                break
            fut.result()  # the GET's typed error, raised here
            k = min(b - at, n - done)
            view[done : done + k] = memoryview(buf)[at - a : at - a + k]
            done += k
            if at + k == b:
                self._release()
        return done

    def _release(self) -> None:
        self._free.append(self._held.popleft()[2])  # (its GET is done) reused: fresh memory is expensive
        self._fill()

    def close(self) -> None:
        held, self._held, self._todo = list(self._held), collections.deque(), collections.deque()
        for *_, fut in held:
            fut.cancel()
        cf.wait([f for *_, f in held])  # nothing writes into a buffer after this returns
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
    def read_ahead(self, sections):
        """While the block runs, ``sections`` (in the order they will be read through
        :meth:`section_range`) are fetched ahead of the reads (:class:`ReadAhead`:
        ``parallel`` GETs of ``chunk_bytes`` submitted ahead, memory parallel x chunk);
        on leaving, every GET still running is waited for."""
        o = self.options
        if self._prefetch is not None:  # one read-ahead at a time (a nested block adds nothing)
            yield self._prefetch
            return
        pf = self._prefetch = ReadAhead(self.reader, [(i.offset, i.length) for i in sections], depth=o.parallel, chunk=o.chunk_bytes)
        try:
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


__all__ = ["READ_AHEAD_GAP", "RangeReader", "RangeSource", "ReadAhead", "SectionRange"]
