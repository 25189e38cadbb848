"""Durable, no-overwrite filesystem steps shared by the writers."""

from __future__ import annotations

import ctypes
import ctypes.util
import errno
import os
import secrets

from .errors import HsnapIOError, SnapshotExistsError
from .spec import STAGING_DIR_MARK, TMP_FILE_MARK

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


def rename_noreplace(src: str, dst: str) -> None:
    """Atomically give ``src`` the name ``dst``; refuse if ``dst`` exists (never overwrite)."""
    if _renameat2 is not None:
        if _renameat2(_AT_FDCWD, os.fsencode(src), _AT_FDCWD, os.fsencode(dst), _RENAME_NOREPLACE) == 0:
            return
        err = ctypes.get_errno()
        if err == errno.EEXIST:
            raise SnapshotExistsError(dst, "path", "no file or directory", "one exists")
        if err not in (errno.EINVAL, errno.ENOSYS):  # unsupported by the filesystem: fall back
            raise HsnapIOError(dst, "rename", OSError(err, os.strerror(err)))
    if os.path.lexists(dst):
        raise SnapshotExistsError(dst, "path", "no file or directory", "one exists")
    try:
        if os.path.isdir(src):
            os.rename(src, dst)
        else:
            os.link(src, dst)
            os.unlink(src)
    except FileExistsError:
        raise SnapshotExistsError(dst, "path", "no file or directory", "one exists") from None
    except OSError as e:
        raise HsnapIOError(dst, "rename", e) from None


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
