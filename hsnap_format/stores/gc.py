"""Find and remove what interrupted writes leave behind (``hsnap gc``).

A writer never puts an incomplete snapshot under its final name: it writes a
temporary file ``.<final>.hsnap-tmp-<pid>-<8 hex>`` (rank files, manifests) or a
staging directory ``.<final>.hsnap-staging-<pid>-<8 hex>`` (:class:`SetWriter`) or
``.<final>.hsnap-staging-<snapshot_id>`` (the TP protocol of ``hsnap_io.tp``), and
renames it at the end. A process killed before that rename leaves the temporary
behind; this module lists those and removes them safely.

A name proves nothing (anyone can rename a committed snapshot, move one into a
directory called ``.runs.hsnap-staging-1-0a1b2c3d``, or commit one inside a dead
writer's staging directory), so gc removes only files it has *proved*, one by one and
by their content, to be unfinished writes (spec section 8.1):

* a regular file (never a link) that is empty (killed between creating and marking
  it: nothing to lose) or whose first bytes are ``PENDING_MAGIC`` (written at
  creation, overwritten by the real magic at commit) — a temporary file, or a file
  inside a marked staging directory;
* a staging directory's marker ``PENDING_MARKER`` (exact content), removed last and
  only once everything else in the directory is gone, then the empty directory.

A file that starts with the real magic is a complete snapshot: listed, never removed,
whatever its name and wherever it is — under a temporary name (killed between commit
and rename), or inside a staging directory (a set's complete rank files, or a snapshot
placed there by hand). A staging directory holding such a file, or anything else not
proved (a directory, a link, another file), or ``manifest.json`` (a complete set never
renamed), or no marker (not made by a writer) keeps its marker and stays, with the
reason; the proved files inside a marked one are still removed.

Then, who may be gone:

* by default a leftover is touched only when every writer process its name (or,
  for a staging directory, the names of the temporaries inside it) records is
  gone; a staging directory named after a snapshot id records no pid and is kept;
* ``older_than=S`` instead touches every leftover whose newest modification is at
  least S seconds old, whoever wrote it (writers on other hosts or in other PID
  namespaces, staging directories without a pid).

Removal takes the leftover first — an atomic rename to a temporary name of gc's own
pid (if its writer commits first the rename fails and nothing is touched; if gc
wins, the writer's commit fails with a typed error) — and then proves again,
through descriptors, what it now holds: the same inode as at the scan, and each
file the same inode and still proved, right before its unlink. Anything that changed
is handed back, never deleted. Every file is announced (path, bytes) before its
unlink. A gc killed at any step leaves a leftover the next run still proves and
finishes: a taken name records gc's (then dead) pid, and a staging directory keeps
its marker until it is otherwise empty.

Pure standard library: ``os`` plus the conventions of :mod:`hsnap_format.spec`.
"""

from __future__ import annotations

import errno
import os
import re
import stat
import time
from dataclasses import dataclass, field, fields
from typing import Any, Callable

from .. import localfs
from ..errors import HsnapError
from ..spec import MAGIC, MANIFEST_NAME, PENDING_MAGIC, PENDING_MARKER, PENDING_MARKER_TEXT, STAGING_DIR_MARK, TMP_FILE_MARK

_PID_TAG = re.compile(r"(\d{1,10})-([0-9a-f]{8})\Z")
_TMP_RE = re.compile(r"\.(?P<final>.+)" + re.escape(TMP_FILE_MARK) + r"(?P<tag>\d{1,10}-[0-9a-f]{8})\Z", re.S)
_STAGING_RE = re.compile(r"\.(?P<final>.+)" + re.escape(STAGING_DIR_MARK) + r"(?P<tag>[A-Za-z0-9][A-Za-z0-9._-]{0,127})\Z", re.S)

FILE = "file"
STAGING = "staging"

# Why a file is kept (the first two start the reasons tests/crash_child.py recognises)
COMPLETE_TEMPORARY = "a complete snapshot under a temporary name (its writer stopped between commit and rename): left alone; rename it to keep it"
COMPLETE_INSIDE = "a complete snapshot (starts with the magic): never removed"
HOLDS_MANIFEST = "holds manifest.json (a complete snapshot never renamed to its final name): left alone"

Announce = Callable[[str, int], None]  # (path, bytes): called right before each unlink


INTERNAL = {"internal": True}  # a field's metadata: the store's own bookkeeping, not part of the JSON report


def _public(obj) -> dict:
    return {f.name: getattr(obj, f.name) for f in fields(obj) if not f.name.startswith("_") and not f.metadata.get("internal")}


@dataclass
class FileVerdict:
    """One file gc examined, with its size: removed only when proved an unfinished write."""

    path: str
    bytes: int = 0  # st_size
    removable: bool = False  # proved, and its leftover's writers gone: gc --remove unlinks it
    reason: str = ""  # the proof, or why it stays
    action: str = "kept"  # kept | would remove | removed | gone | failed
    _proved: bool = field(default=False, repr=False)  # by content alone (whoever wrote it)
    _ident: tuple | None = field(default=None, repr=False)  # (st_dev, st_ino) when examined
    _mtime: float = field(default=0.0, repr=False)

    def to_dict(self) -> dict:
        return _public(self)


@dataclass
class Leftover:
    """One temporary file or staging directory of an interrupted (or running) write."""

    path: str
    kind: str  # "file" or "staging"
    final: str  # the path it would have been committed under
    pids: list[int] = field(default_factory=list)  # writer processes its name(s) record
    alive: bool | None = None  # some writer still running; None: no pid recorded
    age_s: float = 0.0  # seconds since the newest modification
    bytes: int = 0  # the sum of its files' sizes
    removable: bool = False  # gc --remove removes something here (see files)
    reason: str = ""
    action: str = "kept"  # kept | would remove | removed | gone | failed (the leftover as a whole)
    files: list[FileVerdict] = field(default_factory=list)  # every file examined, each with its verdict
    _ident: tuple | None = field(default=None, repr=False)  # (st_dev, st_ino) at the scan
    _whole: bool = field(default=False, repr=False)  # every file proved: the leftover goes entirely
    # an object store's: what its removal is conditional on (an ETag, or the key and id of a multipart upload), and
    # for a pending marker the set's rank names and uploads that the marker is the proof of
    pinned: Any = field(default=None, repr=False, metadata=INTERNAL)
    set_entries: tuple = field(default=(), repr=False, metadata=INTERNAL)

    def to_dict(self) -> dict:
        d = _public(self)
        d["files"] = [f.to_dict() for f in self.files]
        return d


def parse_name(name: str) -> tuple[str, str, int | None] | None:
    """``(kind, final name, pid or None)`` for a temporary's base name, else None."""
    m = _TMP_RE.match(name)
    if m:
        return FILE, m["final"], int(m["tag"].split("-")[0])
    m = _STAGING_RE.match(name)
    if m:
        pid = _PID_TAG.match(m["tag"])
        return STAGING, m["final"], int(pid[1]) if pid else None
    return None


def pid_alive(pid: int) -> bool:
    """True when a process with this pid exists here (a reused pid counts: kept, never wrongly removed)."""
    if pid <= 0:
        return True  # not a pid we can reason about: treat as alive
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    except OverflowError:
        return False
    return True


# ------------------------------------------------------------------ proofs, through descriptors

_OPEN = os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC


def _content_proof(fd: int, st: os.stat_result, *, marker: bool, complete: str) -> tuple[bool, str]:
    """(proved unfinished, why) for an open regular file."""
    if marker:
        ok = os.pread(fd, len(PENDING_MARKER_TEXT) + 1, 0) == PENDING_MARKER_TEXT
        return (True, "the staging marker (removed last)") if ok else (False, f"{PENDING_MARKER} is not hsnap's marker: left alone")
    if st.st_size == 0:
        return True, "empty (killed before its first byte): nothing to lose"
    head = os.pread(fd, len(PENDING_MAGIC), 0)
    if head == PENDING_MAGIC:
        return True, "starts with the unfinished-write mark"
    if head == MAGIC:
        return False, complete
    return False, "no unfinished-write mark at byte 0 (not an hsnap temporary): left alone"


def _examine(dir_fd: int | None, name: str, path: str, *, marker: bool = False, complete: str = COMPLETE_INSIDE) -> FileVerdict | None:
    """The verdict on one directory entry (``name`` relative to ``dir_fd``, or a path), never
    following a link and opening only regular files; None when it is gone."""
    v = FileVerdict(path=path)
    try:
        st = os.stat(name, dir_fd=dir_fd, follow_symlinks=False)
    except FileNotFoundError:
        return None
    except OSError as err:
        v.reason = f"cannot be examined ({err.strerror}): left alone"
        return v
    v._ident, v._mtime = (st.st_dev, st.st_ino), st.st_mtime
    if not stat.S_ISREG(st.st_mode):
        what = {stat.S_IFLNK: "a symbolic link", stat.S_IFDIR: "a directory"}.get(stat.S_IFMT(st.st_mode), f"not a regular file ({stat.filemode(st.st_mode)})")
        v.reason = f"{what} (no writer makes one): left alone"
        return v
    try:
        fd = os.open(name, _OPEN, dir_fd=dir_fd)
    except FileNotFoundError:
        return None
    except OSError as err:
        v.reason = f"cannot be opened without following links ({err.strerror}): left alone"
        return v
    try:
        fst = os.fstat(fd)
        v.bytes = fst.st_size
        if (fst.st_dev, fst.st_ino) != v._ident:
            v.reason = "replaced while examined: left alone"
        else:
            v._proved, v.reason = _content_proof(fd, fst, marker=marker, complete=complete)
    except OSError as err:
        v.reason = f"unreadable ({err.strerror}): left alone"
    finally:
        os.close(fd)
    return v


def _examine_staging(fd: int, path: str) -> tuple[str | None, list[FileVerdict], float]:
    """(why the open staging directory is left alone, or None when it is a writer's: empty
    or marked; the verdict on each entry; the newest modification time)."""
    files, newest = [], os.fstat(fd).st_mtime
    with os.scandir(fd) as it:
        names = sorted(e.name for e in it)
    for name in names:
        v = _examine(fd, name, os.path.join(path, name), marker=name == PENDING_MARKER)
        if v is not None:
            files.append(v)
            newest = max(newest, v._mtime)
    marker = next((v for v in files if os.path.basename(v.path) == PENDING_MARKER), None)
    if MANIFEST_NAME in names:
        why = HOLDS_MANIFEST
    elif not files:
        why = None  # killed between mkdir and the marker (or a gc between the marker and rmdir): holds nothing
    elif marker is None:
        why = f"no {PENDING_MARKER} marker (not made by an hsnap writer): left alone"
    else:
        why = None if marker._proved else marker.reason
    return why, files, newest


def _open_dir(path: str) -> int:
    return os.open(path, _OPEN | os.O_DIRECTORY)


def _who(item: Leftover, older_than: float | None) -> tuple[bool, str]:
    """(its writers are gone or it is old enough, the words for it)."""
    if item.pids:
        item.alive = any(pid_alive(p) for p in item.pids)
    who = (
        f"writer {', '.join(map(str, item.pids))} {'running' if item.alive else 'not running'}"
        if item.pids
        else "writer unknown (no pid in the name)"
    )
    if older_than is not None:
        old = item.age_s >= older_than
        return old, f"{who}; {'older' if old else 'younger'} than {older_than:g} s"
    return item.alive is False, who if item.alive is False else who + "; pass --older-than to remove"


def _decide(item: Leftover, older_than: float | None, why: str | None) -> None:
    """Set removable, the reasons, and which files gc would unlink."""
    if why is not None:  # not a writer's leftover at all: nothing in it is touched
        item.reason = why
        return
    gone, who = _who(item, older_than)
    kept = [f for f in item.files if not f._proved]
    item._whole = not kept
    if item.kind == STAGING and kept:  # the marker stays with what stays
        for f in item.files:
            if os.path.basename(f.path) == PENDING_MARKER:
                f._proved, f.reason = False, "the staging marker: kept while the directory holds what gc keeps"
        names = ", ".join(os.path.basename(f.path) for f in kept if os.path.basename(f.path) != PENDING_MARKER)
        who += f"; keeps what it cannot prove unfinished ({names}): the directory stays"
    item.removable = gone and (item._whole or any(f._proved for f in item.files))  # an empty directory is whole
    for f in item.files:
        f.removable = item.removable and f._proved
    item.reason = who


def scan(directory: str | os.PathLike[str], *, older_than: float | None = None, now: float | None = None) -> list[Leftover]:
    """List the leftovers in ``directory`` and in its plain subdirectories (one level, no
    symlinks), each with the verdict on every file in it."""
    directory = os.fspath(directory)
    now = time.time() if now is None else now
    found: list[Leftover] = []
    dirs = [directory]
    with os.scandir(directory) as it:
        for e in it:
            if e.is_dir(follow_symlinks=False) and parse_name(e.name) is None:
                dirs.append(e.path)  # e.g. a committed snapshot directory: temporaries inside it
    for d in dirs:
        try:
            it = os.scandir(d)
        except OSError:
            continue
        with it:
            entries = [(e.name, e.path) for e in it]
        for name, path in entries:
            parsed = parse_name(name)
            if parsed is None:
                continue
            kind, final, pid = parsed
            try:
                st = os.lstat(path)
            except FileNotFoundError:
                continue  # committed or removed meanwhile
            item = Leftover(path=path, kind=kind, final=os.path.join(d, final), pids=[] if pid is None else [pid], _ident=(st.st_dev, st.st_ino))
            why, newest = None, st.st_mtime
            if kind == FILE:
                v = _examine(None, path, path, complete=COMPLETE_TEMPORARY)
                if v is None:
                    continue
                item.files = [v]
                if not v._proved:
                    why = v.reason
            elif not stat.S_ISDIR(st.st_mode):
                why = f"not a directory ({stat.filemode(st.st_mode)}): left alone"
            else:
                try:
                    fd = _open_dir(path)
                except OSError as err:
                    why = f"cannot be opened without following links ({err.strerror}): left alone"
                else:
                    try:
                        why, item.files, newest = _examine_staging(fd, path)
                    except OSError as err:
                        why = f"unreadable ({err.strerror}): left alone"
                    finally:
                        os.close(fd)
                for f in item.files:  # a rank writer still at work inside
                    inner = parse_name(os.path.basename(f.path))
                    if inner is not None and inner[2] is not None and inner[2] not in item.pids:
                        item.pids.append(inner[2])
            item.bytes = sum(f.bytes for f in item.files)
            item.age_s = max(0.0, now - newest)
            _decide(item, older_than, why)
            found.append(item)
    found.sort(key=lambda x: x.path)
    return found


# ------------------------------------------------------------------ removal

def _take(item: Leftover) -> str | None:
    """Rename the leftover to a temporary name of this gc process (atomic: a writer that
    commits first keeps its snapshot; bounded to NAME_MAX). Returns the new path, or None
    when it is gone."""
    mark = STAGING_DIR_MARK if item.kind == STAGING else TMP_FILE_MARK
    mine = localfs.temp_name(os.path.join(os.path.dirname(item.path), os.path.basename(item.final)), mark)
    try:
        os.rename(item.path, mine)
    except FileNotFoundError:
        item.action, item.reason = "gone", item.reason + "; committed or removed meanwhile"
        return None
    localfs.phase("gc-taken")
    return mine


def _hand_back(item: Leftover, mine: str, why: str) -> None:
    """What gc took is not what it proved at scan time: put it back under its name."""
    try:
        localfs.rename_noreplace(mine, item.path)
        where = "put back"
    except (HsnapError, OSError):
        item.path, where = mine, f"kept as {os.path.basename(mine)}"
    item.action = "failed"
    item.reason += f"; changed between scan and removal ({why}); {where}"


def _take_and_open(item: Leftover) -> tuple[str, int] | None:
    """Take the leftover (see :func:`_take`) and open what gc now holds without following
    links (a leftover swapped for a symlink never leads gc elsewhere) and check it is the
    inode the scan examined; None when it is gone or handed back."""
    directory = item.kind == STAGING
    mine = _take(item)
    if mine is None:
        return None
    try:
        fd = _open_dir(mine) if directory else os.open(mine, _OPEN)
    except OSError as err:
        _hand_back(item, mine, f"cannot be opened as a plain {'directory' if directory else 'file'}: {err.strerror}")
        return None
    st = os.fstat(fd)
    if item._ident is not None and (st.st_dev, st.st_ino) != item._ident:
        os.close(fd)
        _hand_back(item, mine, "another inode under its name")
        return None
    return mine, fd


def _unlink(dir_fd: int | None, name: str, v: FileVerdict, announce: Announce | None) -> None:
    if announce is not None:
        announce(v.path, v.bytes)
    os.unlink(name, dir_fd=dir_fd)
    v.action = "removed"
    localfs.phase("gc-unlinked")


def _remove_file(item: Leftover, announce: Announce | None = None) -> None:
    taken = _take_and_open(item)
    if taken is None:
        return
    mine, fd = taken
    try:
        proved, why = _content_proof(fd, os.fstat(fd), marker=False, complete=COMPLETE_TEMPORARY)  # again, on what gc holds
    finally:
        os.close(fd)
    if not proved:
        _hand_back(item, mine, why)
        return
    [v] = item.files or [FileVerdict(path=item.path, bytes=item.bytes)]
    _unlink(None, mine, v, announce)
    item.action = "removed"


def _remove_staging(item: Leftover, announce: Announce | None = None) -> None:
    """Unlink, one by one, the files the scan proved that are still the same inode and
    still proved; then, only when nothing else is left, the marker and the directory.
    Otherwise the directory, marker included, goes back under its name."""
    taken = _take_and_open(item)
    if taken is None:
        return
    mine, fd = taken
    try:
        why, now, _ = _examine_staging(fd, mine)  # again, on what gc holds
        if why is not None:
            _hand_back(item, mine, why)
            return
        current = {os.path.basename(v.path): v for v in now}
        marker = None
        for v in item.files:
            name = os.path.basename(v.path)
            if name == PENDING_MARKER:
                marker = v
                continue
            if not v.removable:
                continue
            cur = current.get(name)
            if cur is None:
                v.action = "gone"
            elif cur._ident != v._ident or not cur._proved:
                v.action, v.reason = "failed", v.reason + f"; changed between scan and removal ({cur.reason}): kept"
            else:
                _unlink(fd, name, v, announce)
        with os.scandir(fd) as it:
            left = sorted(e.name for e in it)
        if left == [PENDING_MARKER] and marker is not None and marker.removable:
            cur = _examine(fd, PENDING_MARKER, marker.path, marker=True)
            if cur is not None and cur._ident == marker._ident and cur._proved:
                _unlink(fd, PENDING_MARKER, marker, announce)
                left = []
    finally:
        os.close(fd)
    if not left:
        try:
            os.rmdir(mine)
            item.action = "removed"
            localfs.phase("gc-removed")
            return
        except OSError as err:
            if err.errno not in (errno.ENOTEMPTY, errno.EEXIST):
                raise
            left = ["?"]  # a file appeared after the last check
    try:  # what stays goes back under its own name (or stays under gc's: the next run proves it again)
        localfs.rename_noreplace(mine, item.path)
    except (HsnapError, OSError):
        item.path = mine
    failed = any(v.action == "failed" for v in item.files)
    item.action = "failed" if failed else "kept"
    if left == ["?"]:  # only someone writing into gc's own name does this: theirs, left alone
        item.reason += "; a file appeared after the marker was removed: left alone"


def collect(
    directory: str | os.PathLike[str],
    *,
    remove: bool = False,
    older_than: float | None = None,
    announce: Announce | None = None,
) -> list[Leftover]:
    """Scan ``directory``; with ``remove=True`` unlink every file :func:`scan` proved in a
    removable leftover, calling ``announce(path, bytes)`` right before each unlink."""
    items = scan(directory, older_than=older_than)
    for item in items:
        if not item.removable:
            continue
        if not remove:
            item.action = "would remove" if item._whole else "kept"
            for f in item.files:
                if f.removable:
                    f.action = "would remove"
            continue
        try:
            (_remove_file if item.kind == FILE else _remove_staging)(item, announce)
        except OSError as err:
            item.action = "failed"
            item.reason += f"; {type(err).__name__}: {err.strerror or err}"
    return items


__all__ = ["Leftover", "FileVerdict", "scan", "collect", "parse_name", "pid_alive"]
