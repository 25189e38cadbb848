"""One storage seam (issue 20): where snapshot bytes live — a local file system or an
S3-compatible object store (``s3://bucket/key``) — behind one small interface.

No caller tells a URL from a path by itself: :func:`store_for` answers with the store
that holds a path, and the call site asks the store for what it needs. A store has

* primitives, what a snapshot chain, a content-addressed page store and gc build on:
  ``split``/``join`` (names beside a name), ``exists``, ``read_bytes`` (a small object
  whole, with its version), ``put_bytes`` (commit without overwriting: a taken name is
  :class:`SnapshotExistsError`), ``list`` (one level of a directory or prefix: name,
  size, version, modification time), ``subdirs`` (its directories or sub-prefixes),
  ``makedirs`` (a directory before its first file; nothing on an object store) and
  ``remove`` (only the version named: anything changed since it was read is kept and
  refused);
* snapshot operations: ``open`` (a rank file or a set), ``writer`` (a rank file whose
  commit never overwrites), ``set_writer``, ``sink`` (a sequential copy target for
  ``hsnap cp``) and ``collect`` (``hsnap gc``);
* one capability, ``local``: paths are operating-system paths (inodes, fsync and
  writeback, descriptors a re-sharding restore reads).

A *version* is an opaque change-detection token: an object's ETag, a local file's
``device:inode:mtime_ns:size``. Shard and plan arithmetic stays pure in
``hsnap_format`` (layout, records, chain); nothing here knows the format beyond what a
committed snapshot and an unfinished write look like (spec 8, 8.1).

The object-store side (:mod:`hsnap_format.remote`, botocore) is imported only when a
URL is used.
"""

from __future__ import annotations

import os
import stat
from dataclasses import dataclass, field
from typing import Protocol, runtime_checkable

from . import _fs
from .errors import DigestMismatchError, HsnapError, HsnapIOError, MalformedHeaderError, Phrase, SnapshotExistsError
from .reader import Snapshot
from .spec import HEADER_OFFSET

URL_MARK = "://"


def is_url(path) -> bool:
    """A path that names an object (``s3://bucket/key``) rather than a file."""
    return isinstance(path, str) and URL_MARK in path


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
    """What every call site needs of where snapshots live (see the module docstring)."""

    local: bool

    def split(self, path: str) -> tuple[str, str]: ...
    def join(self, container: str, name: str) -> str: ...
    def exists(self, path: str) -> bool: ...
    def read_bytes(self, path: str, limit: int) -> tuple[bytes, str]: ...
    def put_bytes(self, path: str, data: bytes) -> str: ...
    def list(self, container: str) -> list[Entry]: ...
    def subdirs(self, container: str) -> list[str]: ...
    def makedirs(self, container: str) -> None: ...
    def remove(self, path: str, *, version: str) -> None: ...
    def open(self, path: str, *, ranks=None): ...
    def writer(self, path: str, *, writeback: bool = False, **kw): ...
    def set_writer(self, path: str): ...
    def sink(self, path: str): ...
    def collect(self, path: str, *, remove: bool = False, older_than: float | None = None, announce=None) -> list: ...


def store_for(path, storage_options=None) -> Store:
    """The store that holds ``path``: an object store for a URL, else the local file system.
    Cheap (no client, no request); ``storage_options`` only reach an object store."""
    if is_url(os.fspath(path) if isinstance(path, os.PathLike) else path):
        return S3Store(storage_options)
    return LOCAL


def open_snapshot(path, *, storage_options=None, **kw):
    """Open a rank file or a snapshot directory, or their object-store URL: through the store that holds it."""
    return store_for(path, storage_options).open(os.fspath(path), **kw)


# ------------------------------------------------------------------------- local


def _local_version(st: os.stat_result) -> str:
    return f"{st.st_dev}:{st.st_ino}:{st.st_mtime_ns}:{st.st_size}"


class LocalStore:
    """The local file system: writers commit by ``rename`` without replacing (spec 8)."""

    local = True

    def split(self, path: str) -> tuple[str, str]:
        p = os.fspath(path)
        return os.path.split(p.rstrip(os.sep) or os.sep)

    def join(self, container: str, name: str) -> str:
        return os.path.join(container, name)

    def exists(self, path: str) -> bool:
        return os.path.lexists(path)

    def read_bytes(self, path: str, limit: int) -> tuple[bytes, str]:
        """A regular file's bytes (at most ``limit``, else refused) and its version; links are not followed."""
        try:
            fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC | os.O_NONBLOCK | os.O_NOFOLLOW)
            try:
                st = os.fstat(fd)
                if not stat.S_ISREG(st.st_mode):
                    raise MalformedHeaderError(path, "path", "a regular file", Phrase(stat.filemode(st.st_mode)))
                if st.st_size > limit:
                    raise MalformedHeaderError(path, "length", f"<= {limit} bytes", st.st_size)
                data = os.pread(fd, st.st_size + 1, 0)
            finally:
                os.close(fd)
        except OSError as e:
            raise HsnapIOError(path, "read", e) from None
        if len(data) != st.st_size:
            raise DigestMismatchError(path, "length (changed while read)", st.st_size, len(data))
        return data, _local_version(st)

    def put_bytes(self, path: str, data: bytes) -> str:
        """Write ``data`` under ``path`` durably, never over an existing name: a temporary
        file marked unfinished until its first 64 bytes are written last (what ``hsnap gc``
        proves, spec 8.1), fsync, rename without replacing, fsync of the directory; its version."""
        _fs.check_final_path(path)
        if os.path.lexists(path):
            raise SnapshotExistsError(path, "path", "no file or directory", Phrase("one exists"))
        tmp = None
        try:
            tmp, fd = _fs.create_temp_file(path, 0o600, checked=True)
            try:
                view = memoryview(data).cast("B")
                _fs.pwrite_all(fd, view[HEADER_OFFSET:], HEADER_OFFSET)
                os.fsync(fd)
                _fs.pwrite_all(fd, view[:HEADER_OFFSET], 0)  # over the unfinished-write mark, last
                os.ftruncate(fd, len(view))
                os.fdatasync(fd)
                st = os.fstat(fd)
            finally:
                os.close(fd)
            _fs.rename_noreplace(tmp, path)
            _fs.fsync_dir(os.path.dirname(os.path.abspath(path)))
        except HsnapError:  # SnapshotExistsError (also an OSError): the name was taken meanwhile
            if tmp is not None:
                _unlink_quietly(tmp)
            raise
        except OSError as e:
            if tmp is not None:
                _unlink_quietly(tmp)
            raise HsnapIOError(path, "put", e) from None
        except BaseException:
            if tmp is not None:
                _unlink_quietly(tmp)
            raise
        return _local_version(st)

    def list(self, container: str) -> list[Entry]:
        """The regular files directly in ``container`` (links and directories are not entries)."""
        out = []
        try:
            it = os.scandir(container)
        except OSError as e:
            raise HsnapIOError(container, "list", e) from None
        with it:
            for e in it:
                try:
                    if not e.is_file(follow_symlinks=False):
                        continue
                    st = e.stat(follow_symlinks=False)
                except FileNotFoundError:  # removed or renamed while listed: not in this listing
                    continue
                except OSError as err:
                    raise HsnapIOError(os.path.join(container, e.name), "list", err) from None
                out.append(Entry(os.path.join(container, e.name), st.st_size, _local_version(st), st.st_mtime))
        return sorted(out, key=lambda x: x.path)

    def subdirs(self, container: str) -> list[str]:
        """The directories directly in ``container`` (links are not followed, nor listed)."""
        try:
            it = os.scandir(container)
        except OSError as e:
            raise HsnapIOError(container, "list", e) from None
        with it:  # is_dir without following links answers from the entry itself (no stat to race)
            return sorted(os.path.join(container, e.name) for e in it if e.is_dir(follow_symlinks=False))

    def makedirs(self, container: str) -> None:
        try:
            os.makedirs(container, mode=0o755, exist_ok=True)
        except OSError as e:
            raise HsnapIOError(container, "mkdir", e) from None
        except ValueError as e:  # a NUL byte, a lone surrogate: no name the OS can take (typed, not a crash)
            raise HsnapError(container, "mkdir", Phrase("a path the OS can name"), Phrase(f"{type(e).__name__}: {e}")) from None

    def remove(self, path: str, *, version: str) -> None:
        """Unlink ``path`` only if it is still ``version``: taken first by an atomic rename
        (a writer's commit cannot slip in between), examined, then unlinked — or put back
        and refused (:class:`DigestMismatchError`, field ``version``) when it changed."""
        taken = _fs.temp_name(path)
        try:
            os.rename(path, taken)
        except OSError as e:
            raise HsnapIOError(path, "remove", e) from None
        try:
            st = os.lstat(taken)
        except OSError as e:
            raise HsnapIOError(taken, "remove", e) from None
        found = _local_version(st) if stat.S_ISREG(st.st_mode) else stat.filemode(st.st_mode)
        if found != version:
            try:
                _fs.rename_noreplace(taken, path)
            finally:
                raise DigestMismatchError(path, "version (changed since read)", version, found)
        try:
            os.unlink(taken)
        except OSError as e:
            raise HsnapIOError(path, "remove", e) from None

    def open(self, path: str, *, ranks=None):
        from .manifest import SnapshotSet, refuse_link

        p = os.fspath(path)
        refuse_link(p)  # Snapshot opens O_NOFOLLOW; this answers for a directory, the same way
        if os.path.isdir(p):
            return SnapshotSet(p, ranks=ranks)
        return Snapshot(p)

    def writer(self, path: str, *, writeback: bool = False, **kw):
        from .writer import SnapshotWriter

        return SnapshotWriter(path, writeback=writeback, **kw)

    def set_writer(self, path: str):
        from .manifest import SetWriter

        return SetWriter(path)

    def sink(self, path: str) -> "LocalSink":
        return LocalSink(path)

    def collect(self, path: str, *, remove: bool = False, older_than: float | None = None, announce=None) -> list:
        from . import gc

        return gc.collect(path, remove=remove, older_than=older_than, announce=announce)


def _unlink_quietly(path: str) -> None:
    try:
        os.unlink(path)
    except OSError:
        pass


class LocalSink:
    """A snapshot file written sequentially (``hsnap cp``): a temporary file marked
    unfinished (what ``hsnap gc`` proves) whose first 64 bytes are written last, then
    renamed without replacing."""

    def __init__(self, path: str) -> None:
        self.path = path
        _fs.check_final_name(path)
        if os.path.lexists(path):
            raise SnapshotExistsError(path, "path", "no file or directory", Phrase("one exists"))
        try:
            self.tmp, self.fd = _fs.create_temp_file(path, 0o600)
        except OSError as e:
            raise HsnapIOError(path, "create", e) from None
        self.first = b""

    def write(self, offset: int, data) -> None:
        data = bytes(data)
        if offset < HEADER_OFFSET:  # the real preamble replaces the pending mark at commit
            self.first = data[: HEADER_OFFSET - offset]
            data, offset = data[HEADER_OFFSET - offset :], HEADER_OFFSET
        try:
            _fs.pwrite_all(self.fd, data, offset)
        except OSError as e:
            raise HsnapIOError(self.path, "write", e) from None

    def commit(self) -> None:
        try:
            os.fsync(self.fd)
            _fs.pwrite_all(self.fd, self.first, 0)
            os.fdatasync(self.fd)
            os.close(self.fd)
            self.fd = -1
            _fs.check_final_path(self.path)  # again: a directory above may have become a staging directory (spec 8.1)
            _fs.rename_noreplace(self.tmp, self.path)
            _fs.fsync_dir(os.path.dirname(os.path.abspath(self.path)))
        except OSError as e:
            raise HsnapIOError(self.path, "commit", e) from None

    def abort(self) -> None:
        if self.fd >= 0:
            os.close(self.fd)
            self.fd = -1
        _unlink_quietly(self.tmp)


LOCAL = LocalStore()


# ------------------------------------------------------------------------- object store


class S3Store:
    """An S3-compatible object store (:mod:`hsnap_format.remote`): writers commit by
    completing a multipart upload or a PUT with ``If-None-Match: *``; removals carry
    ``If-Match`` with the version read."""

    local = False

    def __init__(self, storage_options=None) -> None:
        self._given = storage_options
        self._options = None

    @property
    def options(self):
        if self._options is None:  # parsed (and checked) on first use, not by store_for
            from .remote import StorageOptions

            self._options = StorageOptions.of(self._given)
        return self._options

    def split(self, path: str) -> tuple[str, str]:
        container, _, name = path.rstrip("/").rpartition("/")
        return container, name

    def join(self, container: str, name: str) -> str:
        return f"{container.rstrip('/')}/{name}"

    def exists(self, path: str) -> bool:
        from .remote import _exists

        return _exists(path, self.options)

    def read_bytes(self, path: str, limit: int) -> tuple[bytes, str]:
        from .remote import read_object

        data, etag = read_object(path, self.options, limit)
        if len(data) > limit:
            raise MalformedHeaderError(path, "length", f"<= {limit} bytes", Phrase(f"more than {limit} bytes"))
        return data, etag

    def put_bytes(self, path: str, data: bytes) -> str:
        from .remote import check_final_key, put_bytes

        check_final_key(path, self.options)
        return put_bytes(path, data, self.options)

    def list(self, container: str) -> list[Entry]:
        from .remote import list_entries

        return [Entry(url, size, etag, modified) for url, size, etag, modified in list_entries(container, self.options)[0]]

    def subdirs(self, container: str) -> list[str]:
        from .remote import list_entries

        return list_entries(container, self.options)[1]

    def makedirs(self, container: str) -> None:
        """Nothing: a prefix exists as soon as an object under it does."""

    def remove(self, path: str, *, version: str) -> None:
        from .remote import delete

        delete(path, self.options, etag=version)

    def open(self, path: str, *, ranks=None):
        from .remote import open_url

        return open_url(path, ranks=ranks, storage_options=self.options)

    def writer(self, path: str, *, writeback: bool = False, **kw):
        from .remote import RemoteSnapshotWriter

        # writeback is a file's (the kernel's dirty pages): an upload has nothing to write back
        return RemoteSnapshotWriter(path, storage_options=self.options, **kw)

    def set_writer(self, path: str):
        from .remote import RemoteSetWriter

        return RemoteSetWriter(path, storage_options=self.options)

    def sink(self, path: str):
        from .remote import UrlSink

        return UrlSink(path, self.options)

    def collect(self, path: str, *, remove: bool = False, older_than: float | None = None, announce=None) -> list:
        from .remote import collect_url

        return collect_url(path, remove=remove, older_than=older_than, storage_options=self._given, announce=announce)


__all__ = ["Store", "Entry", "LocalStore", "S3Store", "LocalSink", "LOCAL", "store_for", "open_snapshot", "is_url"]
