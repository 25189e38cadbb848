"""A store in this process's memory (``memory://name/key``), for unit tests: the primitives
on one dict, sources and sinks over bytes. It shows what the format classes need of
where bytes live — nothing of a file. An object appears whole when its writer publishes
it, never over another, so a write leaves nothing behind to collect."""

from __future__ import annotations

import builtins
import errno
import itertools
import threading

from ..errors import DigestMismatchError, HsnapIOError, MalformedHeaderError, MalformedManifestError, Phrase, SnapshotExistsError, TruncatedError, UnsupportedFeatureError
from ..manifest import Manifest, decode_manifest, manifest_for
from ..spec import HEADER_OFFSET, MANIFEST_NAME, rank_file_name
from .derived import KeyPaths, SnapshotOps
from ..source import Entry

_OBJECTS: dict[str, tuple[bytes, str]] = {}  # path -> (bytes, version): every MemoryStore sees the same objects
_LOCK = threading.Lock()
_VERSIONS = itertools.count(1)


class MemorySource:
    """One object's bytes as they were at open (a later put is another version)."""

    mappable = True
    window: int | None = None
    version: str | None

    def __init__(self, path: str) -> None:
        self.path = path
        try:
            self.data, self.version = _OBJECTS[path]
        except KeyError:
            raise HsnapIOError(path, "open", FileNotFoundError(errno.ENOENT, "no such object")) from None
        self.size = len(self.data)

    def pread(self, n: int, offset: int) -> bytes:
        return self.data[offset : offset + n]

    def readinto(self, view: memoryview, offset: int) -> None:
        if offset + len(view) > self.size:
            raise TruncatedError(self.path, f"read at byte {offset}", offset + len(view), Phrase(f"{self.size} bytes"))
        view[:] = self.data[offset : offset + len(view)]

    def map(self):
        return self.data

    def fileno(self) -> int:
        raise UnsupportedFeatureError(self.path, "fileno", "a local file", Phrase("an object in memory"))

    def check_unchanged(self) -> None:
        found = _OBJECTS.get(self.path, (b"", None))[1]
        if found != self.version:
            raise DigestMismatchError(self.path, "version (changed since open)", self.version, found)

    def close(self) -> None:
        pass


class MemorySink:
    """A snapshot written into a buffer, put whole (never over an existing object) at publish."""

    publishes_by_rename = False

    def __init__(self, store: "MemoryStore", path: str) -> None:
        self.store, self.path, self.buf = store, path, bytearray()
        self.etag: str | None = None

    def open(self, file_length: int, data_offset: int) -> None:
        if self.store.exists(self.path):
            raise SnapshotExistsError(self.path, "key", "no object", Phrase("one exists"))
        self.buf = bytearray(file_length)

    def write_at(self, view: memoryview, offset: int) -> None:
        self.buf[offset : offset + len(view)] = view

    def publish(self, pre: bytes, header: bytes, tra: bytes, end: int, fsync: bool, before_publish) -> None:
        self.buf[: len(pre)] = pre
        self.buf[HEADER_OFFSET : HEADER_OFFSET + len(header)] = header
        self.buf[end : end + len(tra)] = tra
        self.etag = self.store.put_bytes(self.path, bytes(self.buf))

    def discard(self) -> None:
        self.buf = bytearray()


class MemorySetWriter:
    """A TP set under a prefix: rank objects, then ``manifest.json`` (the commit)."""

    def __init__(self, store: "MemoryStore", path: str) -> None:
        self.store, self.path = store, path.rstrip("/")
        if store.exists(f"{self.path}/{MANIFEST_NAME}"):
            raise SnapshotExistsError(self.path, MANIFEST_NAME, "no committed set", Phrase("one exists"))

    def rank_path(self, rank: int) -> str:
        return f"{self.path}/{rank_file_name(rank)}"

    def rank_writer(self, rank: int, **kw):
        return self.store.writer(self.rank_path(rank), **kw)

    def commit(self, *, tp_size: int, fsync: bool = True) -> Manifest:
        snaps = [self.store.open_file(self.rank_path(r)) for r in range(tp_size)]
        manifest = manifest_for(snaps)
        self.store.put_bytes(f"{self.path}/{MANIFEST_NAME}", manifest.encode())
        return manifest

    def abort(self) -> None:
        pass  # rank objects stay, as any committed object does


class MemoryStore(KeyPaths, SnapshotOps):
    local = False

    def __init__(self, storage_options=None) -> None:
        pass  # one process-wide dict: nothing to configure

    def exists(self, path: str) -> bool:
        return path in _OBJECTS

    def read_bytes(self, path: str, limit: int) -> tuple[bytes, str]:
        data, version = MemorySource(path).data, _OBJECTS[path][1]
        if len(data) > limit:
            raise MalformedHeaderError(path, "length", f"<= {limit} bytes", len(data))
        return data, version

    def put_bytes(self, path: str, data: bytes) -> str:
        with _LOCK:
            if path in _OBJECTS:
                raise SnapshotExistsError(path, "key", "no object", Phrase("one exists"))
            version = str(next(_VERSIONS))
            _OBJECTS[path] = (bytes(data), version)
        return version

    def list(self, container: str) -> builtins.list[Entry]:
        prefix = container.rstrip("/") + "/"
        return sorted((Entry(p, len(d), v) for p, (d, v) in list(_OBJECTS.items()) if p.startswith(prefix) and "/" not in p[len(prefix):]),
                      key=lambda e: e.path)

    def subdirs(self, container: str) -> builtins.list[str]:
        prefix = container.rstrip("/") + "/"
        return sorted({prefix + p[len(prefix):].split("/")[0] for p in list(_OBJECTS) if p.startswith(prefix) and "/" in p[len(prefix):]})

    def makedirs(self, container: str) -> None:
        """Nothing: a prefix exists as soon as an object under it does."""

    def remove(self, path: str, *, version: str) -> None:
        with _LOCK:
            found = _OBJECTS.get(path, (b"", None))[1]
            if found != version:
                raise DigestMismatchError(path, "version (changed since read)", version, found)
            del _OBJECTS[path]

    def source(self, path: str) -> MemorySource:
        return MemorySource(path)

    def snapshot_sink(self, path: str, **settings) -> MemorySink:
        return MemorySink(self, path)

    def read_manifest(self, path: str) -> Manifest:
        murl = f"{path}/{MANIFEST_NAME}"
        if murl not in _OBJECTS:
            raise MalformedManifestError(path, MANIFEST_NAME, "present (the commit point)", Phrase("missing: not a committed snapshot"))
        return decode_manifest(_OBJECTS[murl][0], murl)

    def open(self, path: str, *, ranks=None):
        prefix = path.rstrip("/")
        return self.open_set(prefix, ranks=ranks) if self.exists(f"{prefix}/{MANIFEST_NAME}") else self.open_file(path)

    def set_writer(self, path: str) -> MemorySetWriter:
        return MemorySetWriter(self, path)

    def sink(self, path: str):
        raise UnsupportedFeatureError(path, "hsnap cp", "a file or an s3:// URL", Phrase("memory://"))

    def collect(self, path: str, *, remove: bool = False, older_than: float | None = None, announce=None) -> builtins.list:
        return []  # an object appears whole at publish: no write leaves anything behind


def clear() -> None:
    """Forget every object (between tests)."""
    with _LOCK:
        _OBJECTS.clear()


__all__ = ["MemoryStore", "MemorySource", "MemorySink", "MemorySetWriter", "clear"]
