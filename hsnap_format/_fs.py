"""Durable, no-overwrite filesystem steps shared by the writers."""

from __future__ import annotations

import ctypes
import ctypes.util
import errno
import os
import secrets
import shutil

from .errors import HsnapIOError, Phrase, ReservedNameError, SnapshotExistsError
from .spec import PENDING_MAGIC, PENDING_MARKER, PENDING_MARKER_TEXT, STAGING_DIR_MARK, TMP_FILE_MARK

_RENAME_NOREPLACE = 1
_AT_FDCWD = -100
try:
    _libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True)
    _renameat2 = _libc.renameat2
    _renameat2.argtypes = [ctypes.c_int, ctypes.c_char_p, ctypes.c_int, ctypes.c_char_p, ctypes.c_uint]
except (OSError, AttributeError):  # not Linux/glibc: fall back below
    _renameat2 = None

# Tests (crash/fault injection) set this to a callable taking a phase name.
phase_hook = None


def phase(name: str) -> None:
    if phase_hook is not None:
        phase_hook(name)


def temp_name(final: str, mark: str = TMP_FILE_MARK) -> str:
    head, tail = os.path.split(os.path.abspath(final))
    return os.path.join(head, f".{tail}{mark}{os.getpid()}-{secrets.token_hex(4)}")


def staging_name(final: str) -> str:
    return temp_name(final, STAGING_DIR_MARK)


def is_reserved_name(name: str) -> bool:
    """True for names of the forms ``hsnap gc`` treats as leftovers (and ``manifest.json``'s temporaries)."""
    return TMP_FILE_MARK in name or STAGING_DIR_MARK in name or name == PENDING_MARKER


def check_final_name(path: str) -> None:
    """Refuse a final name that has the form of a temporary or staging name: such a name
    is gc's to reclaim, and a committed snapshot must never look like a leftover."""
    base = os.path.basename(os.path.abspath(path))
    if is_reserved_name(base):
        raise ReservedNameError(path, "final name", f"a name without {TMP_FILE_MARK!r} or {STAGING_DIR_MARK!r} (reserved for unfinished writes)", base)


def pending_preamble(tag: str) -> bytes:
    """The first 64 bytes of a temporary file until commit (see spec.PENDING_MAGIC)."""
    return (PENDING_MAGIC + b"writer " + tag.encode("ascii", "replace")[:40]).ljust(64, b"\0")


def create_temp_file(final: str, mode: int) -> tuple[str, int]:
    """Create the temporary of ``final`` (O_EXCL) and mark it as an unfinished write."""
    tmp = temp_name(final)
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, mode)
    try:
        pwrite_all(fd, pending_preamble(tmp.rsplit(TMP_FILE_MARK, 1)[1]), 0)
    except BaseException:
        os.close(fd)
        try:
            os.unlink(tmp)
        except OSError:
            pass
        raise
    return tmp, fd


def make_staging_dir(path: str, mode: int = 0o700) -> None:
    """Create a staging directory holding the marker that lets gc prove it is one."""
    os.mkdir(path, mode)
    try:
        fd = os.open(os.path.join(path, PENDING_MARKER), os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, mode & 0o666)
        try:
            pwrite_all(fd, PENDING_MARKER_TEXT, 0)
        finally:
            os.close(fd)
    except BaseException:
        shutil.rmtree(path, ignore_errors=True)
        raise


def drop_staging_marker(path: str) -> None:
    """Called once manifest.json is in the staging directory (the directory is then complete)."""
    try:
        os.unlink(os.path.join(path, PENDING_MARKER))
    except FileNotFoundError:
        pass


def rename_noreplace(src: str, dst: str) -> None:
    """Atomically give ``src`` the name ``dst``; refuse if ``dst`` exists (never overwrite)."""
    if _renameat2 is not None:
        if _renameat2(_AT_FDCWD, os.fsencode(src), _AT_FDCWD, os.fsencode(dst), _RENAME_NOREPLACE) == 0:
            return
        err = ctypes.get_errno()
        if err == errno.EEXIST:
            raise SnapshotExistsError(dst, "path", "no file or directory", Phrase("one exists"))
        if err not in (errno.EINVAL, errno.ENOSYS):  # unsupported by the filesystem: fall back
            raise HsnapIOError(dst, "rename", OSError(err, os.strerror(err)))
    try:
        if os.path.isdir(src):
            _rename_dir_noreplace(src, dst)
        else:
            os.link(src, dst)  # fails if dst exists: atomic no-replace for files
            os.unlink(src)
    except FileExistsError:
        raise SnapshotExistsError(dst, "path", "no file or directory", Phrase("one exists")) from None
    except OSError as e:
        raise HsnapIOError(dst, "rename", e) from None


def _rename_dir_noreplace(src: str, dst: str) -> None:
    """Without RENAME_NOREPLACE, rename(2) silently replaces an empty directory at dst.
    Claim dst first with mkdir (atomic, fails if anything is there), then rename over
    our own claim — after checking it is still ours (same inode), so a directory that
    someone else created in between is never replaced."""
    os.mkdir(dst, 0o700)  # FileExistsError if taken
    claim = os.lstat(dst)
    try:
        now = os.lstat(dst)
        if (now.st_dev, now.st_ino) != (claim.st_dev, claim.st_ino):
            raise FileExistsError(errno.EEXIST, "replaced while committing", dst)
        os.rename(src, dst)
    except BaseException:
        try:
            os.rmdir(dst)  # only succeeds on an empty directory: ours
        except OSError:
            pass
        raise


def pwrite_all(fd: int, data, offset: int) -> None:
    """os.pwrite until every byte is written (a short write is not an error by itself)."""
    view = memoryview(data).cast("B")
    done = 0
    while done < view.nbytes:
        n = os.pwrite(fd, view[done:], offset + done)
        if n <= 0:
            raise OSError(5, "short write made no progress")
        done += n


def fsync_dir(path: str) -> None:
    fd = os.open(path or ".", os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
