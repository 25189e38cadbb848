"""Multi-rank snapshots: a directory with one rank file per TP rank and a manifest.

The manifest is written last, atomically, and the whole staging directory is then
renamed to its final name: a directory under the final name always has a
manifest, and a manifest only ever names regular files inside its own directory.

Manifest file (``manifest.json``), two lines::

    <canonical JSON object>\\n
    xxh3-128 <32 hex digits of the digest of the first line, newline included>\\n
"""

from __future__ import annotations

import errno
import os
import stat
from dataclasses import dataclass
from typing import Callable, Sequence

import xxhash

from . import canonical, localfs
from .errors import (
    Phrase,
    DigestMismatchError,
    HsnapError,
    HsnapIOError,
    MalformedManifestError,
    SnapshotExistsError,
    TruncatedError,
    UnsupportedVersionError,
)
from .reader import Snapshot
from .spec import MAJOR, MANIFEST_FORMAT, MANIFEST_NAME, MAX_MANIFEST_BYTES, RANK_FILE_RE, rank_file_name
from .writer import SnapshotWriter


@dataclass(frozen=True)
class RankEntry:
    rank: int
    file: str
    length: int
    root_digest: str


@dataclass(frozen=True)
class Manifest:
    snapshot_id: str
    state_position: int
    tp_size: int
    ranks: tuple[RankEntry, ...]
    version: tuple[int, int] = (MAJOR, 0)  # the manifest is unchanged in 1.1 (spec 10.1)

    def encode(self) -> bytes:
        body = canonical.dumps(
            {
                "format": MANIFEST_FORMAT,
                "version": list(self.version),
                "snapshot_id": self.snapshot_id,
                "state_position": self.state_position,
                "tp_size": self.tp_size,
                "ranks": [{"rank": r.rank, "file": r.file, "length": r.length, "root_digest": r.root_digest} for r in self.ranks],
            }
        ) + b"\n"
        return body + b"xxh3-128 " + xxhash.xxh3_128_hexdigest(body).encode() + b"\n"


def decode_manifest(data: bytes, path) -> Manifest:
    if len(data) > MAX_MANIFEST_BYTES:
        raise MalformedManifestError(path, "length", f"<= {MAX_MANIFEST_BYTES}", len(data))
    body, sep, tail = data[:-1].rpartition(b"\n")
    body += sep
    if not sep or not data.endswith(b"\n"):
        raise TruncatedError(path, "manifest", "two lines, each ending in a newline", Phrase(f"{len(data)} bytes"))
    if data.count(b"\n") != 2:
        raise MalformedManifestError(path, "lines", 2, data.count(b"\n"))
    if not tail.startswith(b"xxh3-128 ") or len(tail) != 9 + 32 or not all(c in b"0123456789abcdef" for c in tail[9:]):
        raise MalformedManifestError(path, "digest line", "'xxh3-128 <32 hex>'", Phrase(f"{len(tail)} bytes of another form"))  # never the bytes
    got = xxhash.xxh3_128_hexdigest(body)
    if tail[9:].decode("ascii", "replace") != got:
        raise DigestMismatchError(path, "manifest digest", tail[9:].decode("ascii", "replace"), got)
    try:
        obj = canonical.loads(body[:-1])
    except canonical.CanonicalError as e:
        raise MalformedManifestError(path, "body", detail=str(e)) from None
    if not isinstance(obj, dict) or obj.get("format") != MANIFEST_FORMAT:
        raise MalformedManifestError(path, "format", MANIFEST_FORMAT, obj.get("format") if isinstance(obj, dict) else obj)
    ver = obj.get("version")
    if not (isinstance(ver, list) and len(ver) == 2 and all(isinstance(v, int) and not isinstance(v, bool) and v >= 0 for v in ver)):
        raise MalformedManifestError(path, "version", "[major, minor]", ver)
    if ver[0] != MAJOR:
        raise UnsupportedVersionError(path, "version", f"major {MAJOR}", f"{ver[0]}.{ver[1]}")

    def need(key, typ, lo=0):
        v = obj.get(key)
        if not isinstance(v, typ) or isinstance(v, bool) or (typ is int and v < lo):
            raise MalformedManifestError(path, key, typ.__name__, v)
        return v

    snapshot_id, pos, tp = need("snapshot_id", str), need("state_position", int), need("tp_size", int, 1)
    if tp > 1 << 16:  # spec 10.1: the bound of identity.tp_size; checked before the ranks list is walked
        raise MalformedManifestError(path, "tp_size", "1..65536", tp)
    ranks = obj.get("ranks")
    if not isinstance(ranks, list) or len(ranks) != tp:
        raise MalformedManifestError(path, "ranks", f"{tp} entries", ranks if not isinstance(ranks, list) else len(ranks))
    entries = []
    for i, r in enumerate(ranks):
        if not isinstance(r, dict) or set(r) != {"rank", "file", "length", "root_digest"}:
            raise MalformedManifestError(path, f"ranks[{i}]", "{rank, file, length, root_digest}", r)
        if r["rank"] != i or isinstance(r["rank"], bool):
            raise MalformedManifestError(path, f"ranks[{i}].rank", i, r["rank"])
        f = r["file"]
        # only plain names of rank files: nothing outside the directory, no '..', no '/'
        if not isinstance(f, str) or not RANK_FILE_RE.match(f) or f != rank_file_name(i):
            raise MalformedManifestError(path, f"ranks[{i}].file", rank_file_name(i), f)
        if not isinstance(r["length"], int) or isinstance(r["length"], bool) or r["length"] < 0:
            raise MalformedManifestError(path, f"ranks[{i}].length", "a byte count", r["length"])
        if not isinstance(r["root_digest"], str) or len(r["root_digest"]) != 32:
            raise MalformedManifestError(path, f"ranks[{i}].root_digest", "32 hex digits", r["root_digest"])
        entries.append(RankEntry(i, f, r["length"], r["root_digest"]))
    return Manifest(snapshot_id, pos, tp, tuple(entries), (ver[0], ver[1]))


def manifest_for(snaps: Sequence[Snapshot]) -> Manifest:
    """The manifest binding the opened rank files ``snaps`` (rank order), after checking
    that they agree on snapshot id and state position and name their own rank and size."""
    tp_size, first = len(snaps), snaps[0]
    manifest = Manifest(
        snapshot_id=first.identity.snapshot_id,
        state_position=first.state_position,
        tp_size=tp_size,
        ranks=tuple(RankEntry(r, rank_file_name(r), s.file_length, s.root_digest) for r, s in enumerate(snaps)),
    )
    for r, s in enumerate(snaps):
        want = (manifest.snapshot_id, manifest.state_position, r, tp_size)
        got = (s.identity.snapshot_id, s.state_position, s.identity.tp_rank, s.identity.tp_size)
        if want != got:
            raise MalformedManifestError(s.path, "snapshot_id/state_position/tp_rank/tp_size", want, got)
    return manifest


def read_manifest(path: str) -> Manifest:
    """The manifest of the committed snapshot directory ``path`` (spec 7.1, 10.1): a regular
    file, no symbolic link in the directory nor as the directory itself."""
    refuse_link(path)
    mpath = os.path.join(path, MANIFEST_NAME)
    try:
        st = os.lstat(mpath)
    except FileNotFoundError:
        raise MalformedManifestError(path, MANIFEST_NAME, "present (the commit point)", Phrase("missing: not a committed snapshot")) from None
    except OSError as e:
        raise HsnapIOError(mpath, "open", e) from None
    if not stat.S_ISREG(st.st_mode):
        raise MalformedManifestError(mpath, "type", "a regular file", Phrase(stat.filemode(st.st_mode)))
    if st.st_size > MAX_MANIFEST_BYTES:
        raise MalformedManifestError(mpath, "length", f"<= {MAX_MANIFEST_BYTES}", st.st_size)
    try:  # every OS failure (unreadable directory or manifest: files are 0600) is typed
        fd = os.open(mpath, os.O_RDONLY | os.O_CLOEXEC | os.O_NONBLOCK | getattr(os, "O_NOFOLLOW", 0))
        try:
            data = os.read(fd, MAX_MANIFEST_BYTES + 1)
        finally:
            os.close(fd)
        with os.scandir(path) as it:
            links = [e.name for e in it if e.is_symlink()]
    except OSError as e:
        raise HsnapIOError(mpath, "read", e) from None
    manifest = decode_manifest(data, mpath)
    if links:
        raise MalformedManifestError(path, links[0], "no symbolic links in a snapshot directory", Phrase("a symbolic link"))
    return manifest


class SnapshotSet:
    """A committed multi-rank snapshot directory: ``.manifest`` and ``.ranks`` (one Snapshot each)."""

    def __init__(self, path: str | os.PathLike[str], *, ranks: Sequence[int] | None = None, manifest: Manifest | None = None,
                 open_file: Callable[[str], Snapshot] = Snapshot) -> None:
        """``manifest`` and ``open_file``: a set held elsewhere (an object-store prefix), its
        manifest read and decoded, and how a rank file is opened by its path. By default the
        local directory at ``path``."""
        self.path = os.fspath(path)
        self._open_file = open_file
        self.ranks: dict[int, Snapshot] = {}
        self.manifest = read_manifest(self.path) if manifest is None else manifest
        self._open_ranks(ranks)

    def _open_ranks(self, ranks: Sequence[int] | None) -> None:
        """Open the selected ranks (all by default) into ``self.ranks``; on any failure
        close what was opened."""
        tp = self.manifest.tp_size
        wanted = range(tp) if ranks is None else list(ranks)
        for r in wanted:  # no negative indexing, no IndexError: a rank this set does not have is named
            if isinstance(r, bool) or not isinstance(r, int) or not 0 <= r < tp:
                raise MalformedManifestError(self.path, "ranks", f"rank numbers 0..{tp - 1} (tp_size {tp})", r)
        try:
            for r in wanted:
                self.ranks[r] = self._open_rank(self.manifest.ranks[r])
        except BaseException:
            self.close()
            raise

    def _open_rank(self, entry: RankEntry) -> Snapshot:
        fpath = os.path.join(self.path, entry.file)
        try:
            snap = self._open_file(fpath)
        except HsnapIOError as e:
            if isinstance(e.os_error, FileNotFoundError):
                raise MalformedManifestError(fpath, f"ranks[{entry.rank}].file", "present", Phrase("missing")) from None
            raise
        m = self.manifest
        checks = [
            ("length", entry.length, snap.file_length),
            ("root_digest", entry.root_digest, snap.root_digest),
            ("identity.tp_rank", entry.rank, snap.identity.tp_rank),
            ("identity.tp_size", m.tp_size, snap.identity.tp_size),
            ("identity.snapshot_id", m.snapshot_id, snap.identity.snapshot_id),
            ("request.state_position", m.state_position, snap.state_position),
        ]
        for field, exp, found in checks:
            if exp != found:
                snap.close()
                raise MalformedManifestError(fpath, f"rank {entry.rank} {field} (manifest vs rank file)", exp, found)
        return snap

    @classmethod
    def of_whole_file(cls, snap: Snapshot) -> "SnapshotSet":
        """A TP 1 snapshot file, already open, as the one-rank set it is (for re-sharding it to another TP size):
        the manifest it would have, written from the file's own header; the file is not opened again."""
        if snap.identity.tp_size != 1:
            raise MalformedManifestError(snap.path, "identity.tp_size", Phrase("1 (a whole state, not one rank's)"), snap.identity.tp_size)
        manifest = Manifest(snapshot_id=snap.identity.snapshot_id, state_position=snap.state_position, tp_size=1,
                            ranks=(RankEntry(0, os.path.basename(snap.path), snap.file_length, snap.root_digest),))
        return cls(os.path.dirname(snap.path) or ".", manifest=manifest, open_file=lambda _path: snap)

    def rank(self, r: int) -> Snapshot:
        return self.ranks[r]

    def verify(self) -> None:
        for snap in self.ranks.values():
            snap.verify()

    def close(self) -> None:
        for snap in self.ranks.values():
            snap.close()

    def __enter__(self) -> "SnapshotSet":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def __repr__(self) -> str:
        return f"<hsnap.SnapshotSet {self.path!r} tp={self.manifest.tp_size} id={self.manifest.snapshot_id!r}>"


class SetWriter:
    """Stage a multi-rank snapshot: ranks write ``rank_path(r)`` (each with SnapshotWriter),
    then ``commit()`` writes the manifest and renames the staging directory to its final name."""

    def __init__(self, path: str | os.PathLike[str], *, staging: str | None = None, mode: int = 0o700) -> None:
        self.path = os.path.abspath(os.fspath(path))
        localfs.check_final_path(self.path)  # the name, its length, no staging directory above it (spec 8.1)
        if os.path.lexists(self.path):
            raise SnapshotExistsError(self.path, "path", "no file or directory", Phrase("one exists"))
        self.mode = mode
        self.owns_staging = staging is None  # a given staging directory is its creator's to remove
        self.staging = staging or localfs.staging_name(self.path)
        if staging is None:
            try:
                localfs.make_staging_dir(self.staging, mode)
            except OSError as e:
                raise HsnapIOError(self.staging, "mkdir", e) from None

    def rank_path(self, rank: int) -> str:
        return os.path.join(self.staging, rank_file_name(rank))

    def rank_writer(self, rank: int, **kw) -> SnapshotWriter:
        """The writer of ``rank``'s file (as the object-store set writer's)."""
        return SnapshotWriter(self.rank_path(rank), **kw)

    def commit(self, *, tp_size: int, fsync: bool = True) -> Manifest:
        """Write the manifest and give the directory its final name. On any failure
        before the rename, a staging directory this writer made is removed."""
        try:
            return self._commit(tp_size, fsync)
        except BaseException:
            if self.owns_staging:  # after the final rename there is no staging left to remove
                self.abort()
            raise

    def _commit(self, tp_size: int, fsync: bool) -> Manifest:
        snaps = []
        try:
            for r in range(tp_size):
                snaps.append(Snapshot(self.rank_path(r)))
            manifest = manifest_for(snaps)
        finally:
            for s in snaps:
                s.close()
        data = manifest.encode()
        final = os.path.join(self.staging, MANIFEST_NAME)
        tmp = localfs.temp_name(final)
        try:
            fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, self.mode & 0o666)
            try:
                localfs.pwrite_all(fd, data, 0)
                if fsync:
                    os.fsync(fd)
            finally:
                os.close(fd)
            localfs.phase("manifest-written")
            localfs.rename_noreplace(tmp, final)
            localfs.drop_staging_marker(self.staging)  # complete now: gc must leave it alone
            if fsync:
                localfs.fsync_dir(self.staging)
            localfs.phase("before-dir-rename")
            localfs.check_final_path(self.path)  # again: a directory above may have become a staging directory
            localfs.rename_noreplace(self.staging, self.path)
        except HsnapError:  # SnapshotExistsError is an OSError too: keep its type
            raise
        except OSError as e:
            raise HsnapIOError(self.path, "commit manifest", e) from None
        if fsync:
            try:
                localfs.fsync_dir(os.path.dirname(self.path))
            except OSError as e:  # not durable: give the name back (see SnapshotWriter.commit), then
                try:  # remove what this writer made, one by one (never a half-removed set under the name)
                    localfs.rename_noreplace(self.path, self.staging)
                    localfs.remove_own_staging(self.staging)
                except HsnapError:
                    pass
                raise HsnapIOError(self.path, "fsync directory", e) from None
        localfs.phase("committed")
        return manifest

    def abort(self) -> None:
        """Remove this writer's staging directory: its own files one by one, the marker
        last (``localfs.remove_own_staging``); anything else keeps it, for gc to list."""
        localfs.remove_own_staging(self.staging)


def refuse_link(path: str) -> None:
    """Spec 7.1 step 1 (R-7.1-2): a symbolic link as the last component of the path of a
    snapshot directory is not followed, as a rank file's is not (``O_NOFOLLOW``) and gc
    follows none: whoever made a directory can otherwise point a reader anywhere it can read
    (another tenant's snapshot, restored as this request). A trailing ``/`` does not resolve it."""
    name = path.rstrip(os.sep) or os.sep
    try:
        is_link = stat.S_ISLNK(os.lstat(name).st_mode)
    except OSError:
        return  # a missing or unreadable path is refused by the open that follows, typed
    if is_link:
        raise HsnapIOError(path, "open", OSError(errno.ELOOP, "a symbolic link: not followed (spec 7.1 step 1); give the path it points to"))


__all__ = ["Manifest", "RankEntry", "manifest_for", "read_manifest", "SnapshotSet", "SetWriter", "decode_manifest", "refuse_link", "HsnapError"]
