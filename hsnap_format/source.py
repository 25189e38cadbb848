"""Where a snapshot's bytes come from and go to, as the format sees it.

A **source** is one committed file's bytes: ``size``, a ``version`` (a change-detection
token), ``pread``/``readinto`` (ranged reads, the second into the caller's buffer),
``check_unchanged`` and ``close``; with the capability ``mappable`` it also gives a
zero-copy ``map()`` and a ``fileno()``. ``window``, when not None, is the byte count a
verification streams at a time (one pass of ranged reads rather than one per section).

A **sink** is one file being written: ``open(file_length, data_offset)`` before the first
byte, ``write_at`` (offsets ascending), ``publish`` (the commit point: the finished bytes
appear under the final name, never over another) and ``discard``; ``publishes_by_rename``
says whether the finished file exists under a temporary name before it is published.

:class:`~hsnap_format.reader.Snapshot` and :class:`~hsnap_format.writer.SnapshotWriter`
take one of each (a local file by default, the classes here); a store
(:mod:`hsnap_format.stores`) hands out its own for its paths. A **store** (:class:`Store`)
is what holds them: primitives on names beside names, and the source and sink of a path.
Nothing here knows a store: the stores register how a path names one
(:func:`set_store_resolver`), and the format modules that take a path and options rather
than a store (chain, pages, checkpoints) ask :func:`store_at`.
"""

from __future__ import annotations

import builtins
import mmap
import os
from dataclasses import dataclass, field
from typing import Callable, Protocol, runtime_checkable

from . import localfs
from .errors import DigestMismatchError, HsnapIOError, Phrase, SnapshotExistsError, TruncatedError
from .spec import MAGIC

WRITEBACK_BYTES = 2 << 20


class Source(Protocol):
    path: str
    size: int
    version: str | None
    mappable: bool
    window: int | None

    def pread(self, n: int, offset: int) -> bytes: ...
    def readinto(self, view: memoryview, offset: int) -> None: ...
    def check_unchanged(self) -> None: ...
    def map(self): ...
    def fileno(self) -> int: ...
    def close(self) -> None: ...


class Sink(Protocol):
    path: str
    publishes_by_rename: bool

    def open(self, file_length: int, data_offset: int) -> None: ...
    def write_at(self, view: memoryview, offset: int) -> None: ...
    def publish(self, pre: bytes, header: bytes, tra: bytes, end: int, fsync: bool, before_publish) -> None: ...
    def discard(self) -> None: ...


@dataclass(frozen=True)
class Entry:
    """One object of a listing: its full path (or URL), size, version and modification
    time (seconds since the epoch, the store's clock; not compared)."""

    path: str
    size: int
    version: str
    modified: float = field(default=0.0, compare=False)


@runtime_checkable
class Store(Protocol):
    """What every call site needs of where snapshots live (see :mod:`hsnap_format.stores`)."""

    local: bool

    def split(self, path: str) -> tuple[str, str]: ...
    def join(self, container: str, name: str) -> str: ...
    def exists(self, path: str) -> bool: ...
    def read_bytes(self, path: str, limit: int) -> tuple[bytes, str]: ...
    def put_bytes(self, path: str, data: bytes) -> str: ...
    def list(self, container: str) -> builtins.list[Entry]: ...
    def subdirs(self, container: str) -> builtins.list[str]: ...
    def makedirs(self, container: str) -> None: ...
    def remove(self, path: str, *, version: str) -> None: ...
    def source(self, path: str): ...
    def open(self, path: str, *, ranks=None): ...
    def writer(self, path: str, *, writeback: bool = False, **kw): ...
    def set_writer(self, path: str): ...
    def sink(self, path: str): ...
    def collect(self, path: str, *, remove: bool = False, older_than: float | None = None, announce=None) -> builtins.list: ...


_resolve: Callable[..., Store] | None = None


def set_store_resolver(resolve: Callable[..., Store]) -> None:
    """How a path (and storage options) names the store that holds it: set once, by
    :mod:`hsnap_format.stores` (imported with the package)."""
    global _resolve
    _resolve = resolve


def store_at(path, storage_options=None) -> Store:
    """The store that holds ``path``, as the stores resolve it."""
    if _resolve is None:
        raise RuntimeError("no store resolver: import hsnap_format (it registers hsnap_format.stores)")
    return _resolve(path, storage_options)


class FileSource:
    """A local regular file, read by pread through one descriptor kept open: a file
    truncated or unreadable under an open reader gives a typed error (through a map it
    would be SIGBUS). The map is made only when asked for, and then costs a second
    descriptor."""

    mappable = True
    window: int | None = None
    version: str | None

    def __init__(self, path: str) -> None:
        self.path = path
        self._mm: mmap.mmap | None = None
        self._fd, st = localfs.open_regular(path)
        self.size, self._mtime_ns, self.version = st.st_size, st.st_mtime_ns, localfs.version(st)

    def pread(self, n: int, offset: int) -> bytes:
        return os.pread(self._fd, n, offset)

    def readinto(self, view: memoryview, offset: int) -> None:
        done, length = 0, len(view)
        while done < length:
            try:
                got = os.preadv(self._fd, [view[done:]], offset + done)
            except OSError as e:
                raise HsnapIOError(self.path, f"read at byte {offset + done}", e) from None
            if got <= 0:
                raise TruncatedError(self.path, f"read at byte {offset + done} (file changed under the reader?)", length, done)
            done += got

    @property
    def mapped(self) -> bool:
        return self._mm is not None

    def map(self):
        if self._mm is None:
            try:
                mm = mmap.mmap(self._fd, 0, access=mmap.ACCESS_READ)
            except (OSError, ValueError) as e:  # ValueError: the file is now empty
                raise TruncatedError(self.path, "file_length (changed since open)", self.size, Phrase(f"unmappable: {e}")) from None
            if len(mm) < self.size:
                mm.close()
                raise TruncatedError(self.path, "file_length (changed since open)", self.size, len(mm))
            self._mm = mm
        return self._mm

    def fileno(self) -> int:
        return self._fd

    def check_unchanged(self) -> None:
        """Refuse if the file was resized or written since open (size, mtime_ns)."""
        try:
            st = os.fstat(self._fd)
        except OSError as e:
            raise HsnapIOError(self.path, "fstat", e) from None
        if st.st_size != self.size:
            raise TruncatedError(self.path, "file_length (changed since open)", self.size, st.st_size)
        if st.st_mtime_ns != self._mtime_ns:
            raise DigestMismatchError(self.path, "mtime_ns (written since open)", self._mtime_ns, st.st_mtime_ns)

    def close(self) -> None:
        if self._fd >= 0:
            os.close(self._fd)
            self._fd = -1
        if self._mm is not None:
            try:
                self._mm.close()
            except BufferError:  # views still alive; the map goes when they do
                pass
            self._mm = None


class FileSink:
    """A local file: a temporary marked as an unfinished write from its first byte (what
    ``hsnap gc`` proves, spec 8.1), renamed to the final name without replacing at publish.

    ``writeback``: for a caller that will commit with fsync, start the kernel's writeback
    of every WRITEBACK_BYTES written (sync_file_range, asynchronous), so the data goes to
    the device while later sections are produced and commit's fsync waits for less (bench:
    31 MiB written + fsynced in 14.8 instead of 20.7 ms). The commit protocol is unchanged."""

    publishes_by_rename = True

    def __init__(self, path: str, *, mode: int = 0o600, preallocate: bool = True, writeback: bool = False) -> None:
        self.path, self.mode, self.preallocate = path, mode, preallocate
        self._writeback_from = 0 if writeback and localfs.sync_file_range is not None else None
        self._fd = -1
        self.tmp = ""  # the temporary's name, once open

    def open(self, file_length: int, data_offset: int) -> None:
        localfs.check_final_path(self.path)  # the name, its length, no staging directory above it (spec 8.1)
        if os.path.lexists(self.path):
            raise SnapshotExistsError(self.path, "path", "no file or directory", Phrase("one exists"))
        try:  # marked as an unfinished write from its first byte (what hsnap gc checks)
            self.tmp, self._fd = localfs.create_temp_file(self.path, self.mode, checked=True)
        except OSError as e:
            raise HsnapIOError(self.path, "create", e) from None
        try:
            if self.preallocate:  # a full disk fails here, before any work
                try:
                    os.posix_fallocate(self._fd, 0, file_length)
                except OSError as e:
                    if e.errno not in (95, 22):  # EOPNOTSUPP, EINVAL: filesystem without fallocate
                        raise
            os.ftruncate(self._fd, file_length)
            localfs.phase("open")
        except OSError as e:
            self.discard()
            raise HsnapIOError(self.path, "preallocate", e) from None
        except BaseException:
            self.discard()
            raise

    def write_at(self, view: memoryview, offset: int) -> None:
        localfs.pwrite_all(self._fd, view, offset)
        start = self._writeback_from
        if start is not None and offset + view.nbytes - start >= WRITEBACK_BYTES:  # sections arrive in file order
            end = offset + view.nbytes
            localfs.sync_file_range(self._fd, start, end - start, localfs.SYNC_FILE_RANGE_WRITE)  # a hint: errors are fsync's
            self._writeback_from = end

    def publish(self, pre: bytes, header: bytes, tra: bytes, end: int, fsync: bool, before_publish) -> None:
        """Make the finished file visible under its final name (the commit point). On a
        failure the caller discards the sink."""
        try:
            # Everything but the magic first: until the magic replaces PENDING_MAGIC the
            # file is provably unfinished (what hsnap gc checks, spec 8.1), so a crash
            # during the long fsync leaves a leftover gc may remove. The magic costs one
            # more small data sync (~0.2 ms here); only between it and the rename is a
            # complete file under a temporary name, which gc lists and keeps.
            localfs.pwrite_all(self._fd, pre[len(MAGIC):] + header, len(MAGIC))
            localfs.pwrite_all(self._fd, tra, end)
            localfs.phase("before-fsync")
            if fsync:
                os.fsync(self._fd)
            localfs.phase("after-fsync")
            localfs.pwrite_all(self._fd, MAGIC, 0)
            if fsync:
                os.fdatasync(self._fd)
            localfs.phase("magic-written")
            os.close(self._fd)
            self._fd = -1
        except OSError as e:
            raise HsnapIOError(self.path, "commit", e) from None
        if before_publish is not None:
            before_publish(self.tmp)
        localfs.phase("before-rename")
        localfs.check_final_path(self.path)  # again: a directory above may have become a staging directory
        localfs.rename_noreplace(self.tmp, self.path)
        localfs.phase("after-rename")
        if fsync:
            try:
                localfs.fsync_dir(os.path.dirname(os.path.abspath(self.path)))
            except OSError as e:
                # The name may not survive a crash: take it back rather than report
                # a commit that is not durable (and leave the name free for a retry).
                localfs.unlink_quietly(self.path)
                raise HsnapIOError(self.path, "fsync directory", e) from None

    def discard(self) -> None:
        if self._fd >= 0:
            try:
                os.close(self._fd)
            except OSError:
                pass
            self._fd = -1
        if self.tmp:
            localfs.unlink_quietly(self.tmp)


__all__ = ["Source", "Sink", "Store", "Entry", "FileSource", "FileSink", "WRITEBACK_BYTES", "set_store_resolver", "store_at"]
