"""Snapshot operations written once, on a store's primitives; every store inherits them.

A store supplies ``source(path)`` (the bytes of one committed file), ``snapshot_sink(path,
**settings)`` (a file being written) and ``read_manifest(path)`` (a committed set's
manifest, decoded); :class:`SnapshotOps` makes readers, sets and writers of them."""

from __future__ import annotations

from ..manifest import Manifest, SnapshotSet
from ..reader import Snapshot
from ..source import Sink, Source
from ..writer import SnapshotWriter


class KeyPaths:
    """Names beside a name in a store of keys (``scheme://bucket/a/b``): ``/`` separates, a
    trailing one is not a level."""

    def split(self, path: str) -> tuple[str, str]:
        container, _, name = path.rstrip("/").rpartition("/")
        return container, name

    def join(self, container: str, name: str) -> str:
        return f"{container.rstrip('/')}/{name}"


class SnapshotOps:
    def source(self, path: str) -> Source:
        raise NotImplementedError

    def snapshot_sink(self, path: str, *, mode: int, preallocate: bool, writeback: bool) -> Sink:
        raise NotImplementedError

    def read_manifest(self, path: str) -> Manifest:
        raise NotImplementedError

    def open_file(self, path: str) -> Snapshot:
        return Snapshot(path, source=self.source(path))

    def open_set(self, path: str, *, ranks=None) -> SnapshotSet:
        return SnapshotSet(path, ranks=ranks, manifest=self.read_manifest(path), open_file=self.open_file)

    def writer(self, path: str, *, writeback: bool = False, mode: int = 0o600, preallocate: bool = True, **kw) -> SnapshotWriter:
        """A rank file whose commit never overwrites (``mode``, ``preallocate`` and
        ``writeback`` are a local file's settings; a store without them ignores them)."""
        return SnapshotWriter(path, sink=self.snapshot_sink(path, mode=mode, preallocate=preallocate, writeback=writeback), **kw)


__all__ = ["KeyPaths", "SnapshotOps"]
