"""Find and remove what interrupted writes leave behind (``hsnap gc``).

A writer never puts an incomplete snapshot under its final name: it writes a
temporary file ``.<final>.hsnap-tmp-<pid>-<8 hex>`` (rank files, manifests) or a
staging directory ``.<final>.hsnap-staging-<pid>-<8 hex>`` (:class:`SetWriter`) or
``.<final>.hsnap-staging-<snapshot_id>`` (the TP protocol of ``hsnap_io.tp``), and
renames it at the end. A process killed before that rename leaves the temporary
behind; this module lists those and removes them safely.

A name proves nothing (anyone can rename a committed snapshot, or call a directory
``.runs.hsnap-staging-1-0a1b2c3d``), so gc removes only what it has *proved* to be
an unfinished write by its content (spec section 8.1):

* a temporary file whose first bytes are ``PENDING_MAGIC`` (written at creation,
  overwritten by the real preamble at commit) — or an empty one (killed between
  creating and marking it; nothing to lose);
* a staging directory that holds the ``PENDING_MARKER`` file and no
  ``manifest.json`` (the marker is removed only once the manifest is in place) — or
  an empty one — and nothing but regular files and symlinks.

A file that starts with the real magic under a temporary name, or a staging directory
with a manifest, is a complete snapshot that was never renamed: listed, never removed.

Then, who may be gone:

* by default a leftover is removed only when every writer process its name (or,
  for a staging directory, the names of the temporaries inside it) records is
  gone; a staging directory named after a snapshot id records no pid and is kept;
* ``older_than=S`` instead removes every proved leftover whose newest modification
  is at least S seconds old, whoever wrote it (writers on other hosts or in other
  PID namespaces, staging directories without a pid).

Removal takes the thing first — an atomic rename to a temporary name of gc's own
pid (if its writer commits first the rename fails and nothing is touched; if gc
wins, the writer's commit fails with a typed error) — and then proves it again
through a descriptor of what it now holds, so something swapped in between scan and
removal (a committed set renamed into a dead writer's name, a reused inode number)
is handed back, never deleted. A gc killed half way leaves a marked leftover of a
dead pid, which the next run removes.

Pure standard library: ``os`` plus the conventions of :mod:`hsnap_format.spec`.
"""

from __future__ import annotations

import errno
import os
import re
import secrets
import stat
import time
from dataclasses import asdict, dataclass, field

from . import _fs
from .errors import HsnapError
from .spec import MAGIC, MANIFEST_NAME, PENDING_MAGIC, PENDING_MARKER, PENDING_MARKER_TEXT, STAGING_DIR_MARK, TMP_FILE_MARK

_PID_TAG = re.compile(r"(\d{1,10})-([0-9a-f]{8})\Z")
_TMP_RE = re.compile(r"\.(?P<final>.+)" + re.escape(TMP_FILE_MARK) + r"(?P<tag>\d{1,10}-[0-9a-f]{8})\Z", re.S)
_STAGING_RE = re.compile(r"\.(?P<final>.+)" + re.escape(STAGING_DIR_MARK) + r"(?P<tag>[A-Za-z0-9][A-Za-z0-9._-]{0,127})\Z", re.S)

FILE = "file"
STAGING = "staging"


@dataclass
class Leftover:
    """One temporary file or staging directory of an interrupted (or running) write."""

    path: str
    kind: str  # "file" or "staging"
    final: str  # the path it would have been committed under
    pids: list[int] = field(default_factory=list)  # writer processes its name(s) record
    alive: bool | None = None  # some writer still running; None: no pid recorded
    age_s: float = 0.0  # seconds since the newest modification
    bytes: int = 0
    removable: bool = False
    reason: str = ""
    action: str = "kept"  # kept | would remove | removed | gone | failed

    def to_dict(self) -> dict:
        return {k: v for k, v in asdict(self).items() if not k.startswith("_")}


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


def _file_proof(fd: int, st: os.stat_result) -> str | None:
    """None when the open file is proved an unfinished write; else why it must stay."""
    if not stat.S_ISREG(st.st_mode):
        return f"not a regular file ({stat.filemode(st.st_mode)}): left alone"
    if st.st_size == 0:
        return None  # killed between creating and marking it: holds nothing
    head = os.pread(fd, len(PENDING_MAGIC), 0)
    if head == PENDING_MAGIC:
        return None
    if head == MAGIC:
        return "a complete snapshot under a temporary name (its writer stopped between commit and rename): left alone; rename it to keep it"
    return "no unfinished-write mark at byte 0 (not an hsnap temporary): left alone"


def _staging_proof(fd: int) -> tuple[str | None, list[str]]:
    """(None, names) when the open directory is proved an unfinished staging directory;
    else (why it must stay, names)."""
    names, problems = [], []
    with os.scandir(fd) as it:
        for e in it:
            if e.is_file(follow_symlinks=False) or e.is_symlink():
                names.append(e.name)
            else:
                problems.append(f"unexpected {'directory' if e.is_dir(follow_symlinks=False) else 'entry'} {e.name!r} inside")
    if problems:
        return "; ".join(problems) + ": left alone", names
    if MANIFEST_NAME in names:
        return "holds manifest.json (a complete snapshot never renamed to its final name): left alone", names
    if not names:
        return None, names  # killed between mkdir and the marker: holds nothing
    if PENDING_MARKER not in names:
        return f"no {PENDING_MARKER} marker (not made by an hsnap writer): left alone", names
    try:
        mfd = os.open(PENDING_MARKER, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC, dir_fd=fd)
        try:
            ok = stat.S_ISREG(os.fstat(mfd).st_mode) and os.pread(mfd, len(PENDING_MARKER_TEXT) + 1, 0) == PENDING_MARKER_TEXT
        finally:
            os.close(mfd)
    except OSError as err:
        return f"{PENDING_MARKER} unreadable ({err.strerror}): left alone", names
    return (None if ok else f"{PENDING_MARKER} is not hsnap's marker: left alone"), names


def _open_nofollow(path: str, directory: bool) -> int:
    flags = os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC | (os.O_DIRECTORY if directory else 0)
    return os.open(path, flags)


def _proof_of(path: str, kind: str) -> list[str]:
    """[] when ``path`` is proved an unfinished write of its kind, else [why not]."""
    try:
        fd = _open_nofollow(path, kind == STAGING)
    except OSError as err:
        return [f"cannot be opened without following links ({err.strerror}): left alone"]
    try:
        why = _file_proof(fd, os.fstat(fd)) if kind == FILE else _staging_proof(fd)[0]
    except OSError as err:
        why = f"unreadable ({err.strerror}): left alone"
    finally:
        os.close(fd)
    return [] if why is None else [why]


def _describe(item: Leftover, older_than: float | None, problems: list[str]) -> None:
    if problems:
        item.reason = "; ".join(problems)
        return
    if item.pids:
        item.alive = any(pid_alive(p) for p in item.pids)
    who = (
        f"writer {', '.join(map(str, item.pids))} {'running' if item.alive else 'not running'}"
        if item.pids
        else "writer unknown (no pid in the name)"
    )
    if older_than is not None:
        item.removable = item.age_s >= older_than
        item.reason = f"{who}; {'older' if item.removable else 'younger'} than {older_than:g} s"
    else:
        item.removable = item.alive is False
        item.reason = who if item.alive is False else who + "; pass --older-than to remove"


def scan(directory: str | os.PathLike[str], *, older_than: float | None = None, now: float | None = None) -> list[Leftover]:
    """List the leftovers in ``directory`` and in its plain subdirectories (one level, no symlinks)."""
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
            for e in it:
                parsed = parse_name(e.name)
                if parsed is None:
                    continue
                kind, final, pid = parsed
                try:
                    st = os.lstat(e.path)
                except FileNotFoundError:
                    continue  # committed or removed meanwhile
                item = Leftover(path=e.path, kind=kind, final=os.path.join(d, final), pids=[] if pid is None else [pid])
                problems: list[str] = []
                newest = st.st_mtime
                if kind == FILE:
                    item.bytes = st.st_blocks * 512 if stat.S_ISREG(st.st_mode) else 0
                    problems += _proof_of(e.path, FILE)
                elif not stat.S_ISDIR(st.st_mode):
                    problems.append(f"not a directory ({stat.filemode(st.st_mode)}): left alone")
                else:
                    problems += _proof_of(e.path, STAGING)
                    try:
                        entries = list(os.scandir(e.path))
                    except OSError:
                        entries = []
                    for c in entries:
                        try:
                            cst = c.stat(follow_symlinks=False)
                        except OSError:
                            continue
                        newest = max(newest, cst.st_mtime)
                        item.bytes += cst.st_blocks * 512
                        inner = parse_name(c.name)
                        if inner is not None and inner[2] is not None and inner[2] not in item.pids:
                            item.pids.append(inner[2])  # a rank writer still at work inside
                item.age_s = max(0.0, now - newest)
                _describe(item, older_than, problems)
                found.append(item)
    found.sort(key=lambda x: x.path)
    return found


def _take(item: Leftover, mark: str) -> str | None:
    """Rename the leftover to a temporary name of this gc process (atomic: a writer that
    commits first keeps its snapshot). Returns the new path, or None when it is gone."""
    head = os.path.dirname(item.path)
    mine = os.path.join(head, f".{os.path.basename(item.final)}{mark}{os.getpid()}-{secrets.token_hex(4)}")
    try:
        os.rename(item.path, mine)
    except FileNotFoundError:
        item.action, item.reason = "gone", item.reason + "; committed or removed meanwhile"
        return None
    return mine


def _hand_back(item: Leftover, mine: str, why: str) -> None:
    """What gc took is not what it proved at scan time: put it back under its name."""
    try:
        _fs.rename_noreplace(mine, item.path)
        where = "put back"
    except (HsnapError, OSError):
        item.path, where = mine, f"kept as {os.path.basename(mine)}"
    item.action = "failed"
    item.reason += f"; changed between scan and removal ({why}); {where}"


def _take_and_open(item: Leftover) -> tuple[str, int] | None:
    """Take the leftover (see :func:`_take`) and open what gc now holds without following
    links (a leftover swapped for a symlink never leads gc elsewhere); None when it is
    gone or handed back."""
    directory = item.kind == STAGING
    mine = _take(item, STAGING_DIR_MARK if directory else TMP_FILE_MARK)
    if mine is None:
        return None
    try:
        return mine, _open_nofollow(mine, directory)
    except OSError as err:
        _hand_back(item, mine, f"cannot be opened as a plain {'directory' if directory else 'file'}: {err.strerror}")
        return None


def _remove_file(item: Leftover) -> None:
    taken = _take_and_open(item)
    if taken is None:
        return
    mine, fd = taken
    try:
        why = _file_proof(fd, os.fstat(fd))  # proved again, on what gc now holds
    finally:
        os.close(fd)
    if why is not None:
        _hand_back(item, mine, why)
        return
    os.unlink(mine)
    item.action = "removed"


def _remove_staging(item: Leftover) -> None:
    taken = _take_and_open(item)
    if taken is None:
        return
    mine, fd = taken
    try:
        why, names = _staging_proof(fd)  # proved again, on what gc now holds
        if why is not None:
            _hand_back(item, mine, why)
            return
        for name in names:
            try:
                os.unlink(name, dir_fd=fd)
            except FileNotFoundError:
                pass
    finally:
        os.close(fd)
    try:
        os.rmdir(mine)
    except OSError as err:
        if err.errno in (errno.ENOTEMPTY, errno.EEXIST):  # a straggling writer added a file: next run
            item.action, item.path = "failed", mine
            item.reason += "; a file appeared while removing: run gc again"
            return
        raise
    item.action = "removed"


def collect(directory: str | os.PathLike[str], *, remove: bool = False, older_than: float | None = None) -> list[Leftover]:
    """Scan ``directory``; with ``remove=True`` remove what :func:`scan` marks removable."""
    items = scan(directory, older_than=older_than)
    for item in items:
        if not item.removable:
            continue
        if not remove:
            item.action = "would remove"
            continue
        try:
            (_remove_file if item.kind == FILE else _remove_staging)(item)
        except OSError as err:
            item.action = "failed"
            item.reason += f"; {type(err).__name__}: {err.strerror or err}"
    return items


__all__ = ["Leftover", "scan", "collect", "parse_name", "pid_alive"]
