"""Snapshots on an S3-compatible object store (``s3://bucket/key``): the same format,
checks and guarantees as a local file, over ranged GETs and multipart uploads.

* Reading: :class:`RangeReader` is behind :class:`RangeSource`, the source of a
  :class:`~hsnap_format.reader.Snapshot` whose reads are ranged GETs: open costs
  two GETs (the first 64 KiB — preamble and header when it fits — and the trailer);
  larger reads are split in ``chunk_bytes`` ranges fetched ``parallel`` at a time
  straight into the caller's buffer, so memory is chunk x parallelism whatever the
  object size. Every read after the first carries ``If-Match: <ETag>`` of that
  first response: an object replaced or truncated since open is refused
  (:class:`ObjectChangedError`), never mixed.
* Writing: :class:`UploadSink` is the sink of a :class:`~hsnap_format.writer.SnapshotWriter`:
  a multipart upload. Parts stream as sections arrive (a few in
  flight); the first part, which holds the header whose digests are known only at
  the end, and the last, which holds the trailer, are uploaded at commit. Multipart
  completion is the commit: until then nothing is visible under the key, and an
  export that fails or is killed leaves only an in-progress upload, which
  ``hsnap gc URL`` lists and aborts.
* Sets (TP): ``PREFIX/rank-N.hsnap`` objects and ``PREFIX/manifest.json`` written
  last (the commit of the set), with ``PREFIX/.hsnap-pending`` present from the
  start until the manifest is in place — what marks an unfinished set for gc, which
  still removes only what it proves unfinished object by object (:func:`collect_url`).

Client: botocore (the engine under s3fs), chosen by measurement — bench/RESULTS.md:
its ranged GETs in a thread pool match obstore's and beat s3fs's own API several
times, and it is the only one of the three with the multipart calls gc needs
(list and abort uploads). Optional: ``pip install hsnap[remote]``; imported only
when a URL is used.

Credentials and endpoint come from the standard places (``AWS_ENDPOINT_URL``,
``AWS_ACCESS_KEY_ID`` / ``AWS_SECRET_ACCESS_KEY``, ``AWS_PROFILE`` and the shared
config files) or from explicit ``storage_options``; they are never written into a
snapshot, a log line or an error message (errors name the URL, the operation, the
endpoint and the server's error code only). Every request waits a bounded time
(``StorageOptions.request_bound_s``): a store that does not answer gives a typed
:class:`RemoteTimeoutError`, never a hang.

The modules, imported only when a URL is used (botocore only when a client is made):
:mod:`.options` (URLs, :class:`StorageOptions`), :mod:`.client` (the client, typed
errors, small objects, listings), :mod:`.ranges` (reading by ranged GETs), :mod:`.upload`
(multipart uploads, the set writer) and :mod:`.gc` (``hsnap gc URL``); :class:`S3Store`
here is the store they make.
"""

from __future__ import annotations

import builtins
import errno
from ...errors import MalformedHeaderError, MalformedManifestError, Phrase
from ...manifest import Manifest, decode_manifest
from ...spec import MANIFEST_NAME, MAX_MANIFEST_BYTES
from ..derived import KeyPaths, SnapshotOps
from ...source import Entry


class S3Store(KeyPaths, SnapshotOps):
    """An S3-compatible object store: writers commit by
    completing a multipart upload or a PUT with ``If-None-Match: *``; removals carry
    ``If-Match`` with the version read."""

    local = False

    def __init__(self, storage_options=None) -> None:
        self._given = storage_options
        self._options = None

    @property
    def options(self):
        if self._options is None:  # parsed (and checked) on first use, not by store_for
            from .options import StorageOptions

            self._options = StorageOptions.of(self._given)
        return self._options

    def exists(self, path: str) -> bool:
        from .client import exists

        return exists(path, self.options)

    def read_bytes(self, path: str, limit: int) -> tuple[bytes, str]:
        from .client import read_object

        data, etag = read_object(path, self.options, limit)
        if len(data) > limit:
            raise MalformedHeaderError(path, "length", f"<= {limit} bytes", Phrase(f"more than {limit} bytes"))
        return data, etag or ""  # no ETag: a version no remove() accepts

    def put_bytes(self, path: str, data: bytes) -> str:
        from .client import check_final_key, put_bytes

        check_final_key(path, self.options)
        return put_bytes(path, data, self.options)

    def list(self, container: str) -> builtins.list[Entry]:
        from .client import list_entries

        return [Entry(url, size, etag or "", modified) for url, size, etag, modified in list_entries(container, self.options)[0]]

    def subdirs(self, container: str) -> builtins.list[str]:
        from .client import list_entries

        return list_entries(container, self.options)[1]

    def makedirs(self, container: str) -> None:
        """Nothing: a prefix exists as soon as an object under it does."""

    def remove(self, path: str, *, version: str) -> None:
        from .client import delete

        if not version:  # a delete without If-Match removes whatever is there now, proved or not
            from .client import RemoteIOError

            raise RemoteIOError(path, "delete", OSError(errno.EPROTO, "no version (ETag) to make the delete conditional on: refused"))
        delete(path, self.options, etag=version)

    def source(self, path: str):
        from .ranges import RangeSource

        return RangeSource(path, self.options)

    def snapshot_sink(self, path: str, **settings):
        from .upload import UploadSink

        return UploadSink(path, self.options)  # the settings are a file's: an upload has none of them

    def read_manifest(self, path: str) -> Manifest:
        """The manifest of the committed set under the prefix ``path`` (``PREFIX/manifest.json``)."""
        from .client import RemoteNotFoundError, get_small

        murl = f"{path}/{MANIFEST_NAME}"
        try:
            data = get_small(murl, self.options, MAX_MANIFEST_BYTES)
        except RemoteNotFoundError as e:
            if "bucket" in (e.os_error.strerror or ""):
                raise
            raise MalformedManifestError(path, MANIFEST_NAME, "present (the commit point)", Phrase("missing: not a committed snapshot")) from None
        return decode_manifest(data, murl)

    def open(self, path: str, *, ranks=None):
        """``s3://bucket/key`` (one rank object) or ``s3://bucket/prefix`` (a set: its
        ``manifest.json``). ``ranks`` selects ranks of a set (ignored for one object)."""
        from .client import RemoteNotFoundError
        from .options import parse_url

        prefix = path.rstrip("/")
        _, key = parse_url(path)
        if not key or key.endswith("/"):
            return self.open_set(prefix, ranks=ranks)
        try:
            return self.open_file(path)
        except RemoteNotFoundError as e:
            if "bucket" in (e.os_error.strerror or ""):
                raise
            try:  # a prefix holding a set?
                return self.open_set(prefix, ranks=ranks)
            except MalformedManifestError as m:
                if m.field == MANIFEST_NAME:  # no set there either: the object is what is missing
                    raise e from None
                raise

    def set_writer(self, path: str):
        from .upload import RemoteSetWriter

        return RemoteSetWriter(path, self)

    def sink(self, path: str):
        from .upload import UrlSink

        return UrlSink(path, self.options)

    def collect(self, path: str, *, remove: bool = False, older_than: float | None = None, announce=None) -> builtins.list:
        from .gc import collect_url

        return collect_url(path, remove=remove, older_than=older_than, storage_options=self._given, announce=announce)


__all__ = ["S3Store"]
