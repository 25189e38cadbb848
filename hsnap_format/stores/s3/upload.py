"""Writing objects: :class:`MultipartUpload`, :class:`UploadSink` (the sink of a
:class:`~hsnap_format.writer.SnapshotWriter`: completion is the commit), the sequential
:class:`UrlSink` of ``hsnap cp`` and :class:`RemoteSetWriter` (a TP set under a prefix)."""

from __future__ import annotations

import concurrent.futures as cf
import os
import socket
import threading

from ... import localfs
from ...errors import (
    HsnapError,
    Phrase,
    ReservedNameError,
    SnapshotExistsError,
)
from ...manifest import Manifest, manifest_for
from ...spec import (
    HEADER_OFFSET,
    MANIFEST_NAME,
    PENDING_MARKER,
    PENDING_MARKER_TEXT,
    rank_file_name,
)
from ...writer import SnapshotWriter
from .client import ObjectChangedError, RemoteIOError, RemoteNotFoundError, call, check_final_key, client, delete, exists, fault_point, put_bytes
from .options import StorageOptions, parse_url


class MultipartUpload:
    """One multipart upload: parts in flight on a thread pool (at most ``parallel``
    waiting or running, so memory is bounded), completion as the commit."""

    def __init__(self, url: str, options: StorageOptions) -> None:
        self.url, self.options = url, options
        self.bucket, self.key = parse_url(url)
        self.client = client(options, url)
        fault_point("create", url)
        r = call(url, "create multipart upload", options, self.client.create_multipart_upload, Bucket=self.bucket, Key=self.key,
                  Metadata={"hsnap-writer": f"{socket.gethostname()[:64]}:{os.getpid()}"})
        self.upload_id = r["UploadId"]
        self._pool = cf.ThreadPoolExecutor(options.parallel, thread_name_prefix="hsnap-put")
        self._slots = threading.BoundedSemaphore(options.parallel)
        self._futures: dict[int, cf.Future] = {}

    def _put(self, number: int, data) -> str:
        try:
            fault_point("part", self.url, number, len(data))
            r = call(self.url, f"upload part {number}", self.options, self.client.upload_part, Bucket=self.bucket, Key=self.key,
                      UploadId=self.upload_id, PartNumber=number, Body=data if isinstance(data, bytes) else bytes(data))
            return r["ETag"]
        finally:
            self._slots.release()

    def submit(self, number: int, data) -> None:
        """Upload part ``number`` (1-based) in the background; blocks while ``parallel`` are in flight."""
        self._slots.acquire()
        for f in list(self._futures.values()):  # fail early: a failed part ends the upload
            if f.done() and (error := f.exception()) is not None:
                self._slots.release()
                raise error
        self._futures[number] = self._pool.submit(self._put, number, data)

    def complete(self) -> str:
        """Make the object visible (never over one that appeared meanwhile); its ETag."""
        parts = [{"PartNumber": n, "ETag": self._futures[n].result()} for n in sorted(self._futures)]
        fault_point("complete", self.url)
        try:
            r = call(self.url, "complete multipart upload", self.options, self.client.complete_multipart_upload, Bucket=self.bucket,
                      Key=self.key, UploadId=self.upload_id, MultipartUpload={"Parts": parts}, IfNoneMatch="*")
        except ObjectChangedError:  # If-None-Match: the key was taken while the parts went up
            raise SnapshotExistsError(self.url, "key", "no object", Phrase("one written while this upload ran")) from None
        self._pool.shutdown(wait=True)
        return r.get("ETag")

    def abort(self) -> None:
        """Best effort: a store that cannot be reached keeps the upload, which gc finds."""
        for f in self._futures.values():
            f.cancel()
        self._pool.shutdown(wait=True)
        try:
            self.client.abort_multipart_upload(Bucket=self.bucket, Key=self.key, UploadId=self.upload_id)
        except Exception:  # noqa: BLE001
            pass


class UploadSink:
    """A snapshot written to ``s3://bucket/key`` (a sink, see :mod:`hsnap_format.source`):
    a streamed multipart upload whose completion is the commit. Memory: the first part
    (held for the header), the part being filled and ``parallel`` parts in flight."""

    publishes_by_rename = False  # nothing of it can be read before the completion publishes it

    def __init__(self, url: str, options=None) -> None:
        self.path = url
        self.options = StorageOptions.of(options)
        self.etag: str | None = None  # of the committed object
        self._upload: MultipartUpload | None = None

    def open(self, file_length: int, data_offset: int) -> None:
        check_final_key(self.path, self.options)
        if exists(self.path, self.options):
            raise SnapshotExistsError(self.path, "key", "no object", Phrase("one exists"))
        self._upload = MultipartUpload(self.path, self.options)
        # part 1 covers the preamble and header (patched in at commit) and the first sections
        self._first_len = min(file_length, max(self.options.part_bytes, data_offset))
        self._buf = bytearray()  # bytes [_buf_at, _buf_at + len(_buf)) not yet handed to a part
        self._buf_at = 0
        self._part = 1
        self._stream = 0  # next byte of the object

    def _append(self, data) -> None:
        self._buf += data
        self._stream += len(data)
        if self._part == 1 and len(self._buf) >= self._first_len:
            self._first = self._buf[: self._first_len]  # uploaded at commit, header patched in
            del self._buf[: self._first_len]
            self._buf_at = self._first_len
            self._part = 2
        p, upload = self.options.part_bytes, self._upload
        assert upload is not None  # open() started it: the writer writes only between open and publish
        # a part goes up as soon as it is full (the parts of a plain put of the same bytes):
        # the last part, however small, holds the trailer (S3 sizes only the others)
        while self._part > 1 and len(self._buf) >= p:
            upload.submit(self._part, bytes(self._buf[:p]))
            del self._buf[:p]
            self._buf_at += p
            self._part += 1

    def write_at(self, view: memoryview, offset: int) -> None:
        if offset < self._stream:
            raise AssertionError(f"remote writes are sequential: {offset} < {self._stream}")
        if offset > self._stream:  # alignment padding
            self._append(bytes(offset - self._stream))
        self._append(view)

    def publish(self, pre: bytes, header: bytes, tra: bytes, end: int, fsync: bool, before_publish) -> None:
        """Complete the upload (fsync and ``before_publish`` are a file's: nothing of an
        upload exists before it completes)."""
        if end > self._stream:
            self._append(bytes(end - self._stream))
        self._append(tra)
        if self._part == 1:  # the whole object fits in one part
            self._first, self._buf = self._buf, bytearray()
        first = bytearray(self._first)
        first[: len(pre)] = pre
        first[HEADER_OFFSET : HEADER_OFFSET + len(header)] = header
        upload = self._upload
        assert upload is not None  # as in _append
        if self._buf:
            upload.submit(self._part, bytes(self._buf))
        upload.submit(1, bytes(first))
        self._first = self._buf = bytearray()  # the parts are the upload's now
        localfs.phase("before-complete")
        self.etag = upload.complete()

    def discard(self) -> None:
        up, self._upload = self._upload, None
        if up is not None:
            up.abort()


class UrlSink:
    """A snapshot object written sequentially (``hsnap cp``): a multipart upload fed in
    order, never over an existing key; completion is the commit."""

    def __init__(self, url: str, options: StorageOptions) -> None:
        self.url, self.options = url, options
        check_final_key(url, options)
        if exists(url, options):
            raise SnapshotExistsError(url, "key", "no object", Phrase("one exists"))
        self.upload = MultipartUpload(url, options)
        self.buf = bytearray()
        self.part = 1

    def write(self, offset: int, data) -> None:
        self.buf += data
        p = self.options.part_bytes
        while len(self.buf) >= 2 * p:  # keep >= one part back: every part but the last is >= 5 MiB
            self.upload.submit(self.part, bytes(self.buf[:p]))
            del self.buf[:p]
            self.part += 1

    def commit(self) -> str:
        """Complete the upload; the ETag of the object made visible."""
        if self.buf or self.part == 1:
            self.upload.submit(self.part, bytes(self.buf))
        self.buf = bytearray()
        return self.upload.complete()

    def abort(self) -> None:
        self.upload.abort()


class RemoteSetWriter:
    """A TP set under ``s3://bucket/prefix``: ``PREFIX/.hsnap-pending`` first, rank
    objects (each a writer to :meth:`rank_path` through an :class:`UploadSink`), then
    ``manifest.json`` (the commit of the set), then the marker goes. ``store``: the
    :class:`~hsnap_format.stores.s3.S3Store` that writes and reads the rank objects."""

    def __init__(self, url: str, store) -> None:
        self.path = url.rstrip("/")
        self.store, self.options = store, store.options
        localfs.check_final_name(parse_url(self.path)[1] or "x")
        check_final_key(f"{self.path}/{MANIFEST_NAME}", self.options)
        if exists(f"{self.path}/{MANIFEST_NAME}", self.options):
            raise SnapshotExistsError(self.path, MANIFEST_NAME, "no committed set", Phrase("one exists"))
        try:  # never over another writer's marker: two sets in one prefix would mix their ranks
            self._marker_etag = put_bytes(f"{self.path}/{PENDING_MARKER}", PENDING_MARKER_TEXT, self.options)
        except SnapshotExistsError:
            raise ReservedNameError(self.path, PENDING_MARKER, Phrase("no unfinished set in the prefix"), Phrase(
                "a marker of one (a set being written, or one killed: hsnap gc lists it)")) from None
        self.written: list[tuple[str, str | None]] = []  # (url, ETag) of each object this writer committed
        self._writers: list[SnapshotWriter] = []

    def rank_path(self, rank: int) -> str:
        return f"{self.path}/{rank_file_name(rank)}"

    def rank_writer(self, rank: int, **kw) -> SnapshotWriter:
        w = self.store.writer(self.rank_path(rank), **kw)
        self._writers.append(w)
        return w

    def commit(self, *, tp_size: int) -> Manifest:
        snaps = []
        try:
            for r in range(tp_size):
                snaps.append(self.store.open_file(self.rank_path(r)))
            manifest = manifest_for(snaps)
        finally:
            for s in snaps:
                s.close()
        localfs.phase("before-manifest")
        put_bytes(f"{self.path}/{MANIFEST_NAME}", manifest.encode(), self.options)
        localfs.phase("manifest-written")
        try:
            delete(f"{self.path}/{PENDING_MARKER}", self.options, etag=self._marker_etag)
        except HsnapError:
            pass  # the set is committed (the manifest wins over a marker left behind; gc removes it)
        return manifest

    def abort(self) -> None:
        """Remove what this writer itself committed — by ETag, never by name: a key that
        was someone else's (the rank writer refused it) stays — then the marker. A store
        that does not answer ends the clean-up at once (gc finds the rest later)."""
        # every rank writer's sink is an UploadSink (the store is the S3Store that made this writer)
        done = self.written + [(w.path, sink.etag) for w in self._writers if isinstance(sink := w.sink, UploadSink) and sink.etag]
        for url, etag in done + [(f"{self.path}/{PENDING_MARKER}", self._marker_etag)]:
            try:
                delete(url, self.options, etag=etag)
            except RemoteIOError as e:
                if not isinstance(e, RemoteNotFoundError):
                    return
            except HsnapError:
                pass


__all__ = ["MultipartUpload", "RemoteSetWriter", "UploadSink", "UrlSink"]
