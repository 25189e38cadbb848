"""Find and remove what interrupted writes leave behind (``hsnap gc``).

A writer never puts an incomplete snapshot under its final name: it writes a
temporary file ``.<final>.hsnap-tmp-<pid>-<8 hex>`` (rank files, manifests) or a
staging directory ``.<final>.hsnap-staging-<pid>-<8 hex>`` (:class:`SetWriter`) or
``.<final>.hsnap-staging-<snapshot_id>`` (the TP protocol of ``hsnap_io.tp``), and
renames it at the end. A process killed before that rename leaves the temporary
behind; this module lists those and removes them safely:

* only names with those marks are ever considered, never a committed snapshot,
  never a symbolic link (a temporary is a regular file, a staging directory a
  plain directory holding regular files);
* by default a leftover is removed only when every writer process its name (or,
  for a staging directory, the names of the temporaries inside it) records is
  gone; a staging directory named after a snapshot id records no pid and is
  kept;
* ``older_than=S`` instead removes every leftover whose newest modification is at
  least S seconds old, whoever wrote it: for writers on other hosts or in other
  PID namespaces (a shared volume), whose pids mean nothing here, and for
  staging directories without a pid;
* a staging directory is first renamed to a fresh staging name of this process
  (atomic: if its writer commits first, the rename fails and nothing is touched;
  if gc wins, the writer's commit fails with a typed error), then emptied and
  removed; a gc killed half way leaves a staging directory of a dead pid, which
  the next run removes.

Pure standard library: ``os`` plus the name conventions of :mod:`hsnap_format.spec`.
"""

from __future__ import annotations

import errno
import os
import re
import secrets
import stat
import time
from dataclasses import asdict, dataclass, field

from .spec import STAGING_DIR_MARK, TMP_FILE_MARK

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
    _dev: int = field(default=0, repr=False, compare=False)
    _ino: int = field(default=0, repr=False, compare=False)

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


def _staging_contents(path: str) -> tuple[list[os.DirEntry], list[str]]:
    """Entries of a staging directory and the problems that forbid removing it."""
    entries, problems = [], []
    with os.scandir(path) as it:
        for e in it:
            entries.append(e)
            if not (e.is_file(follow_symlinks=False) or e.is_symlink()):
                problems.append(f"unexpected {'directory' if e.is_dir(follow_symlinks=False) else 'entry'} {e.name!r} inside")
    return entries, problems


def _describe(item: Leftover, older_than: float | None, problems: list[str]) -> None:
    if problems:
        item.reason = "; ".join(problems) + ": left alone"
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
                item = Leftover(path=e.path, kind=kind, final=os.path.join(d, final), pids=[] if pid is None else [pid],
                                _dev=st.st_dev, _ino=st.st_ino)
                problems: list[str] = []
                newest = st.st_mtime
                if kind == FILE:
                    item.bytes = st.st_blocks * 512 if stat.S_ISREG(st.st_mode) else 0
                    if not stat.S_ISREG(st.st_mode):
                        problems.append(f"not a regular file ({stat.filemode(st.st_mode)})")
                elif not stat.S_ISDIR(st.st_mode):
                    problems.append(f"not a directory ({stat.filemode(st.st_mode)})")
                else:
                    try:
                        entries, problems = _staging_contents(e.path)
                    except OSError as err:
                        entries, problems = [], [f"unreadable ({err.strerror})"]
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


def _remove_file(item: Leftover) -> None:
    try:
        os.unlink(item.path)
    except FileNotFoundError:
        item.action, item.reason = "gone", item.reason + "; committed or removed meanwhile"
        return
    item.action = "removed"


def _remove_staging(item: Leftover) -> None:
    head, tail = os.path.split(item.path)
    m = _STAGING_RE.match(tail)
    # Take the directory away from its writer first, atomically, under a name a
    # later gc recognises (this pid): a writer committing meanwhile keeps its snapshot.
    mine = os.path.join(head, f".{m['final']}{STAGING_DIR_MARK}{os.getpid()}-{secrets.token_hex(4)}")
    try:
        os.rename(item.path, mine)
    except FileNotFoundError:
        item.action, item.reason = "gone", item.reason + "; committed or removed meanwhile"
        return
    # Work through a descriptor opened without following links: a staging directory
    # swapped for a symlink (shared /tmp, gc run as root) never leads gc elsewhere.
    try:
        fd = os.open(mine, os.O_RDONLY | os.O_DIRECTORY | getattr(os, "O_NOFOLLOW", 0) | os.O_CLOEXEC)
    except OSError as err:
        item.action, item.path = "failed", mine
        item.reason += f"; not a plain directory any more ({err.strerror}): left alone"
        return
    try:
        st = os.fstat(fd)
        if (st.st_dev, st.st_ino) != (item._dev, item._ino):
            item.action, item.path = "failed", mine
            item.reason += "; replaced by another directory while gc ran: left alone"
            return
        problems, names = [], []
        with os.scandir(fd) as it:
            for e in it:
                if e.is_file(follow_symlinks=False) or e.is_symlink():
                    names.append(e.name)
                else:
                    problems.append(f"unexpected entry {e.name!r} inside")
        if problems:  # appeared between scan and rename: leave it (under our name) for a person to look at
            item.action, item.path = "failed", mine
            item.reason = "; ".join(problems) + ": left alone"
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
