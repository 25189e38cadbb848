"""The local file system as a store: writers commit by ``rename`` without replacing (spec 8)."""

from __future__ import annotations

import builtins
import os
import stat

from .. import localfs
from ..errors import DigestMismatchError, HsnapError, HsnapIOError, MalformedHeaderError, Phrase, SnapshotExistsError
from ..manifest import SetWriter, read_manifest, refuse_link
from ..source import Entry, FileSink, FileSource
from ..spec import HEADER_OFFSET
from . import gc
from .derived import SnapshotOps


class LocalStore(SnapshotOps):
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
        return data, localfs.version(st)

    def put_bytes(self, path: str, data: bytes) -> str:
        """Write ``data`` under ``path`` durably, never over an existing name: a temporary
        file marked unfinished until its first 64 bytes are written last (what ``hsnap gc``
        proves, spec 8.1), fsync, rename without replacing, fsync of the directory; its version."""
        localfs.check_final_path(path)
        if os.path.lexists(path):
            raise SnapshotExistsError(path, "path", "no file or directory", Phrase("one exists"))
        tmp = None
        try:
            tmp, fd = localfs.create_temp_file(path, 0o600, checked=True)
            try:
                view = memoryview(data).cast("B")
                localfs.pwrite_all(fd, view[HEADER_OFFSET:], HEADER_OFFSET)
                os.fsync(fd)
                localfs.pwrite_all(fd, view[:HEADER_OFFSET], 0)  # over the unfinished-write mark, last
                os.ftruncate(fd, len(view))
                os.fdatasync(fd)
                st = os.fstat(fd)
            finally:
                os.close(fd)
            localfs.rename_noreplace(tmp, path)
            localfs.fsync_dir(os.path.dirname(os.path.abspath(path)))
        except HsnapError:  # SnapshotExistsError (also an OSError): the name was taken meanwhile
            if tmp is not None:
                localfs.unlink_quietly(tmp)
            raise
        except OSError as e:
            if tmp is not None:
                localfs.unlink_quietly(tmp)
            raise HsnapIOError(path, "put", e) from None
        except BaseException:
            if tmp is not None:
                localfs.unlink_quietly(tmp)
            raise
        return localfs.version(st)

    def list(self, container: str) -> builtins.list[Entry]:
        """The regular files directly in ``container`` (links and directories are not entries)."""
        out = []
        try:
            it = os.scandir(container)
        except OSError as e:
            raise HsnapIOError(container, "list", e) from None
        with it:
            for entry in it:
                try:
                    if not entry.is_file(follow_symlinks=False):
                        continue
                    st = entry.stat(follow_symlinks=False)
                except FileNotFoundError:  # removed or renamed while listed: not in this listing
                    continue
                except OSError as err:
                    raise HsnapIOError(os.path.join(container, entry.name), "list", err) from None
                out.append(Entry(os.path.join(container, entry.name), st.st_size, localfs.version(st), st.st_mtime))
        return sorted(out, key=lambda x: x.path)

    def subdirs(self, container: str) -> builtins.list[str]:
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
        taken = localfs.temp_name(path)
        try:
            os.rename(path, taken)
        except OSError as e:
            raise HsnapIOError(path, "remove", e) from None
        try:
            st = os.lstat(taken)
        except OSError as e:
            raise HsnapIOError(taken, "remove", e) from None
        found = localfs.version(st) if stat.S_ISREG(st.st_mode) else stat.filemode(st.st_mode)
        if found != version:
            try:
                localfs.rename_noreplace(taken, path)
            finally:
                raise DigestMismatchError(path, "version (changed since read)", version, found)
        try:
            os.unlink(taken)
        except OSError as e:
            raise HsnapIOError(path, "remove", e) from None

    def source(self, path: str) -> FileSource:
        return FileSource(path)

    def snapshot_sink(self, path: str, *, mode: int, preallocate: bool, writeback: bool) -> FileSink:
        return FileSink(path, mode=mode, preallocate=preallocate, writeback=writeback)

    read_manifest = staticmethod(read_manifest)

    def open(self, path: str, *, ranks=None):
        p = os.fspath(path)
        refuse_link(p)  # Snapshot opens O_NOFOLLOW; this answers for a directory, the same way
        return self.open_set(p, ranks=ranks) if os.path.isdir(p) else self.open_file(p)

    def set_writer(self, path: str):
        return SetWriter(path)

    def sink(self, path: str) -> "LocalSink":
        return LocalSink(path)

    def collect(self, path: str, *, remove: bool = False, older_than: float | None = None, announce=None) -> builtins.list:
        return gc.collect(path, remove=remove, older_than=older_than, announce=announce)


class LocalSink:
    """A snapshot file written sequentially (``hsnap cp``): a temporary file marked
    unfinished (what ``hsnap gc`` proves) whose first 64 bytes are written last, then
    renamed without replacing."""

    def __init__(self, path: str) -> None:
        self.path = path
        localfs.check_final_name(path)
        if os.path.lexists(path):
            raise SnapshotExistsError(path, "path", "no file or directory", Phrase("one exists"))
        try:
            self.tmp, self.fd = localfs.create_temp_file(path, 0o600)
        except OSError as e:
            raise HsnapIOError(path, "create", e) from None
        self.first = b""

    def write(self, offset: int, data) -> None:
        data = bytes(data)
        if offset < HEADER_OFFSET:  # the real preamble replaces the pending mark at commit
            self.first = data[: HEADER_OFFSET - offset]
            data, offset = data[HEADER_OFFSET - offset :], HEADER_OFFSET
        try:
            localfs.pwrite_all(self.fd, data, offset)
        except OSError as e:
            raise HsnapIOError(self.path, "write", e) from None

    def commit(self) -> None:
        try:
            os.fsync(self.fd)
            localfs.pwrite_all(self.fd, self.first, 0)
            os.fdatasync(self.fd)
            os.close(self.fd)
            self.fd = -1
            localfs.check_final_path(self.path)  # again: a directory above may have become a staging directory (spec 8.1)
            localfs.rename_noreplace(self.tmp, self.path)
            localfs.fsync_dir(os.path.dirname(os.path.abspath(self.path)))
        except OSError as e:
            raise HsnapIOError(self.path, "commit", e) from None

    def abort(self) -> None:
        if self.fd >= 0:
            os.close(self.fd)
            self.fd = -1
        localfs.unlink_quietly(self.tmp)


LOCAL = LocalStore()


__all__ = ["LocalStore", "LocalSink", "LOCAL"]
