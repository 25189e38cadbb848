"""The local file system's primitives: temporary and staging names, rename without
replacing, pwrite, fsync — the durable, no-overwrite steps every local writer and gc take."""

from __future__ import annotations

import ctypes
import ctypes.util
import errno
import os
import secrets
import stat
from typing import Any

from .errors import HsnapIOError, MalformedHeaderError, Phrase, ReservedNameError, SnapshotExistsError
from .spec import MANIFEST_NAME, PENDING_MAGIC, PENDING_MARKER, PENDING_MARKER_TEXT, RANK_FILE_RE, STAGING_DIR_MARK, TMP_FILE_MARK

_RENAME_NOREPLACE = 1
_AT_FDCWD = -100
_renameat2: Any
try:
    _libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True)
    _renameat2 = _libc.renameat2
    _renameat2.argtypes = [ctypes.c_int, ctypes.c_char_p, ctypes.c_int, ctypes.c_char_p, ctypes.c_uint]
except (OSError, AttributeError):  # not Linux/glibc: fall back below
    _renameat2 = None


def _load_sync_file_range():
    """libc's sync_file_range (Linux), or None: then a writer only fsyncs at commit."""
    try:
        f = _libc.sync_file_range
    except (NameError, AttributeError):
        return None
    f.argtypes = [ctypes.c_int, ctypes.c_longlong, ctypes.c_longlong, ctypes.c_uint]
    f.restype = ctypes.c_int
    return f


sync_file_range = _load_sync_file_range()
SYNC_FILE_RANGE_WRITE = 2  # linux/fs.h: start writeback of the range's dirty pages, do not wait

# Tests (crash/fault injection) set this to a callable taking a phase name.
phase_hook = None


def phase(name: str) -> None:
    if phase_hook is not None:
        phase_hook(name)


# The most a temporary's name adds to the final name it stands for: "." before it and
# ".hsnap-staging-<pid>-<8 hex>" after it, a pid having at most 10 digits (spec 8.1).
PID_TAG_BYTES = 10 + 1 + 8
FALLBACK_NAME_MAX = 255


def name_max(directory: str) -> int:
    """The filesystem's longest file name in bytes (NAME_MAX), 255 when it cannot say."""
    try:
        return os.pathconf(directory or ".", "PC_NAME_MAX")
    except (OSError, ValueError):
        return FALLBACK_NAME_MAX


def temp_name(final: str, mark: str = TMP_FILE_MARK) -> str:
    """``.<final name><mark><pid>-<8 hex>`` next to ``final``. The writers refuse final
    names too long for this (check_final_path); for gc's own names (taking a leftover
    whose writer had a shorter pid or tag) the final part is cut to fit NAME_MAX."""
    head, tail = os.path.split(os.path.abspath(final))
    suffix = f"{mark}{os.getpid()}-{secrets.token_hex(4)}"
    room = name_max(head) - 1 - len(os.fsencode(suffix))
    while len(os.fsencode(tail)) > room and len(tail) > 1:
        tail = tail[:-1]
    return os.path.join(head, f".{tail}{suffix}")


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


def is_staging_dir(path: str) -> bool:
    """A directory with a temporary's name or holding the staging marker: an unfinished
    write's, which ``hsnap gc`` may reclaim (spec 8.1)."""
    return is_reserved_name(os.path.basename(path)) or os.path.lexists(os.path.join(path, PENDING_MARKER))


def is_set_member(name: str) -> bool:
    """The names a set writer gives the files of its own staging directory."""
    return name == MANIFEST_NAME or RANK_FILE_RE.match(name) is not None


def check_final_path(path: str, *, tag_bytes: int = PID_TAG_BYTES) -> None:
    """Refuse a local final path (spec 8.1, writers):

    * a base name of a temporary's form (check_final_name);
    * a base name too long for its temporary's name: at most NAME_MAX - 16 -
      max(tag_bytes, 19) bytes (``tag_bytes``: a TP group's staging tag, its snapshot id);
    * a path inside a staging directory: any ancestor directory (links resolved, up to
      the root) whose name has a temporary's form, or a parent directory that holds the
      marker — gc's to reclaim. A set's own files (``rank-N.hsnap``, ``manifest.json``)
      directly inside its staging directory are the one exception (that directory's own
      ancestors are checked).

    Writers check at creation and again just before the commit rename; a directory
    made a staging directory after that holds a file starting with the magic, which gc
    never removes."""
    check_final_name(path)
    head, tail = os.path.split(os.path.abspath(path))
    limit = name_max(head) - 1 - len(STAGING_DIR_MARK) - max(tag_bytes, PID_TAG_BYTES)
    if len(os.fsencode(tail)) > limit:
        raise ReservedNameError(path, "final name length", Phrase(
            f"at most {limit} bytes (NAME_MAX {name_max(head)} less {name_max(head) - limit} for the temporary's '.' and "
            f"'{STAGING_DIR_MARK}<tag>')"), Phrase(f"{len(os.fsencode(tail))} bytes"))
    d = os.path.realpath(head)
    staging = is_staging_dir(d)  # the parent, by name or marker; above it, by name (gc looks at no other)
    member = is_set_member(tail)  # allowed directly inside one staging directory
    while True:
        if staging and not member:
            raise ReservedNameError(path, "directory", Phrase(
                f"no staging directory above it (named *{STAGING_DIR_MARK}*, *{TMP_FILE_MARK}* or holding {PENDING_MARKER})"), d)
        member = False
        up = os.path.dirname(d)
        if up == d:
            return
        d = up
        staging = is_reserved_name(os.path.basename(d))


def pending_preamble(tag: str) -> bytes:
    """The first 64 bytes of a temporary file until commit (see spec.PENDING_MAGIC)."""
    return (PENDING_MAGIC + b"writer " + tag.encode("ascii", "replace")[:40]).ljust(64, b"\0")


def create_temp_file(final: str, mode: int, *, checked: bool = False) -> tuple[str, int]:
    """Create the temporary of ``final`` (O_EXCL) and mark it as an unfinished write;
    a final path :func:`check_final_path` refuses is refused here (every local writer),
    unless the caller just ``checked`` it."""
    if not checked:
        check_final_path(final)
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
        remove_own_staging(path)
        raise


def remove_own_staging(path: str) -> bool:
    """A writer takes back the staging directory it made (abort): one by one, without
    following links, the set's own files (``rank-N.hsnap``, ``manifest.json``) and
    temporaries, then the marker, then the directory. Anything else (a directory, a
    file of another name) stays, and so do the marker and the directory: gc lists it.
    Returns True when the directory is gone. Never raises (an abort path)."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC)
    except OSError:
        return False
    kept = False
    try:
        with os.scandir(fd) as it:
            names = [e.name for e in it]
        for name in names:
            if name == PENDING_MARKER:
                continue
            try:
                st = os.stat(name, dir_fd=fd, follow_symlinks=False)
            except OSError:
                continue
            own = is_set_member(name) or TMP_FILE_MARK in name
            if own and (stat.S_ISREG(st.st_mode) or stat.S_ISLNK(st.st_mode)):
                try:
                    os.unlink(name, dir_fd=fd)
                    continue
                except FileNotFoundError:
                    continue
                except OSError:
                    pass
            kept = True
        if not kept:
            try:
                os.unlink(PENDING_MARKER, dir_fd=fd)  # last: until the directory is empty it stays provable
            except FileNotFoundError:
                pass
    except OSError:
        return False
    finally:
        os.close(fd)
    try:
        os.rmdir(path)
    except OSError:
        return False
    return True


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


def version(st: os.stat_result) -> str:
    """A local file's change-detection token (what an object's ETag is to a store)."""
    return f"{st.st_dev}:{st.st_ino}:{st.st_mtime_ns}:{st.st_size}"


def open_regular(path: str) -> tuple[int, os.stat_result]:
    """Open a file read-only, never following a final symlink and never waiting on a
    FIFO (O_NONBLOCK); refuse anything but a regular file. Returns (descriptor, stat)."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC | os.O_NONBLOCK | getattr(os, "O_NOFOLLOW", 0))
    except OSError as e:
        raise HsnapIOError(path, "open", e) from None
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            raise MalformedHeaderError(path, "path", "a regular file", Phrase(stat.filemode(st.st_mode)))
    except BaseException:
        os.close(fd)
        raise
    return fd, st


def unlink_quietly(path: str) -> None:
    try:
        os.unlink(path)
    except OSError:
        pass
