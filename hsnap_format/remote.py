"""Snapshots on an S3-compatible object store (``s3://bucket/key``): the same format,
checks and guarantees as a local file, over ranged GETs and multipart uploads.

* Reading: :class:`RangeReader` is the byte source behind :class:`RemoteSnapshot` (a
  :class:`~hsnap_format.reader.Snapshot` whose ``_read`` is a ranged GET): open costs
  two GETs (the first 64 KiB — preamble and header when it fits — and the trailer);
  larger reads are split in ``chunk_bytes`` ranges fetched ``parallel`` at a time
  straight into the caller's buffer, so memory is chunk x parallelism whatever the
  object size. Every read after the first carries ``If-Match: <ETag>`` of that
  first response: an object replaced or truncated since open is refused
  (:class:`ObjectChangedError`), never mixed.
* Writing: :class:`RemoteSnapshotWriter` is a :class:`~hsnap_format.writer.SnapshotWriter`
  whose target is a multipart upload. Parts stream as sections arrive (a few in
  flight); the first part, which holds the header whose digests are known only at
  the end, and the last, which holds the trailer, are uploaded at commit. Multipart
  completion is the commit: until then nothing is visible under the key, and an
  export that fails or is killed leaves only an in-progress upload, which
  ``hsnap gc URL`` lists and aborts.
* Sets (TP): ``PREFIX/rank-N.hsnap`` objects and ``PREFIX/manifest.json`` written
  last (the commit of the set), with ``PREFIX/.hsnap-pending`` present from the
  start until the manifest is in place — what proves an unfinished set to gc.

Client: botocore (the engine under s3fs), chosen by measurement — bench/RESULTS.md:
its ranged GETs in a thread pool match obstore's and beat s3fs's own API several
times, and it is the only one of the three with the multipart calls gc needs
(list and abort uploads). Optional: ``pip install hsnap[remote]``; imported only
when a URL is used.

Credentials and endpoint come from the standard places (``AWS_ENDPOINT_URL``,
``AWS_ACCESS_KEY_ID`` / ``AWS_SECRET_ACCESS_KEY``, ``AWS_PROFILE`` and the shared
config files) or from explicit ``storage_options``; they are never written into a
snapshot, a log line or an error message (errors name the URL, the operation and
the server's error code only).
"""

from __future__ import annotations

import concurrent.futures as cf
import errno
import os
import re
import socket
import threading
import time
from dataclasses import dataclass, fields
from typing import Any, Iterator

import numpy as np
import xxhash

from . import _fs
from .errors import (
    DigestMismatchError,
    HsnapError,
    HsnapIOError,
    MalformedManifestError,
    Phrase,
    SnapshotExistsError,
    TruncatedError,
    UnsupportedFeatureError,
)
from .gc import Leftover
from .manifest import Manifest, SnapshotSet, decode_manifest, manifest_for
from .reader import Snapshot, SectionInfo
from .spec import (
    HEADER_OFFSET,
    MANIFEST_NAME,
    MAX_MANIFEST_BYTES,
    PENDING_MARKER,
    PENDING_MARKER_TEXT,
    RANK_FILE_RE,
    TRAILER,
    rank_file_name,
)
from .writer import SnapshotWriter, WriterState

FIRST_READ = 64 << 10  # preamble + header in one GET when the header fits (most do)
MIN_PART = 5 << 20  # S3's minimum for every part but the last

# Tests set this to a callable ``(operation, url, offset, length)`` to inject faults
# (kill or stop the server at a chosen request), as ``_fs.phase_hook`` on disk.
fault_hook = None


# ---------------------------------------------------------------- errors


class RemoteIOError(HsnapIOError):
    """The object store failed a request (connection lost, server error)."""


class RemoteNotFoundError(RemoteIOError):
    """No such bucket or key (``os_error`` is a FileNotFoundError)."""


class RemoteAuthError(RemoteIOError):
    """The store refused the credentials or the access (the message never holds a secret)."""


class RemoteTimeoutError(RemoteIOError):
    """No answer within the configured ``timeout`` / ``connect_timeout`` (storage options)."""


class ObjectChangedError(DigestMismatchError):
    """The object was replaced (or truncated) since it was opened: its ETag changed."""


# ---------------------------------------------------------------- URLs and options

_URL_RE = re.compile(r"(?P<scheme>[A-Za-z][A-Za-z0-9+.-]*)://(?P<bucket>[^/]*)(?:/(?P<key>.*))?\Z", re.S)


def is_url(path) -> bool:
    return isinstance(path, str) and "://" in path


def parse_url(url: str) -> tuple[str, str]:
    """``s3://bucket/key`` -> (bucket, key). Credentials in a URL are refused (never echoed)."""
    m = _URL_RE.match(url)
    if not m:
        raise UnsupportedFeatureError(url, "url", "s3://bucket/key", Phrase("not a URL"))
    if m["scheme"].lower() != "s3":
        raise UnsupportedFeatureError(url, "url scheme", "s3", m["scheme"])
    if "@" in m["bucket"] or ":" in m["bucket"]:
        # s3://KEY:SECRET@bucket would put a secret in every message that names the URL
        raise UnsupportedFeatureError("s3://<redacted>", "url", "s3://bucket/key (credentials in storage_options or the environment)",
                                      Phrase("user info in the URL"))
    if not m["bucket"]:
        raise UnsupportedFeatureError(url, "url bucket", "a bucket name", Phrase("empty"))
    return m["bucket"], m["key"] or ""


@dataclass(frozen=True)
class StorageOptions:
    """How to reach the store. ``None`` fields come from the standard places (the
    environment, ``~/.aws``). ``timeout`` is the read timeout of one request, in
    seconds; ``retries`` the attempts after the first (botocore's standard mode)."""

    endpoint_url: str | None = None
    key: str | None = None
    secret: str | None = None
    token: str | None = None
    region: str | None = None
    profile: str | None = None
    timeout: float = 30.0
    connect_timeout: float = 5.0
    retries: int = 2
    chunk_bytes: int = 8 << 20  # one ranged GET
    parallel: int = 4  # ranged GETs / part uploads in flight
    part_bytes: int = 8 << 20  # multipart part size (>= 5 MiB)
    first_read: int = FIRST_READ  # the open's first GET (preamble + header)

    def __repr__(self) -> str:  # never the secret
        shown = {f.name: getattr(self, f.name) for f in fields(self) if f.name not in ("secret", "token", "key")}
        return f"StorageOptions({', '.join(f'{k}={v!r}' for k, v in shown.items())}, credentials={'given' if self.key else 'standard'})"

    @classmethod
    def of(cls, options) -> "StorageOptions":
        if options is None:
            return cls()
        if isinstance(options, StorageOptions):
            return options
        known = {f.name for f in fields(cls)}
        # s3fs spellings too, so one storage_options dict serves both
        alias = {"endpoint": "endpoint_url", "aws_access_key_id": "key", "aws_secret_access_key": "secret",
                 "aws_session_token": "token", "region_name": "region", "read_timeout": "timeout"}
        given = {alias.get(k, k): v for k, v in dict(options).items()}
        unknown = sorted(set(given) - known)
        if unknown:
            raise UnsupportedFeatureError(None, "storage_options", sorted(known), unknown)
        opts = cls(**given)
        if opts.part_bytes < MIN_PART or opts.chunk_bytes < 1 or opts.parallel < 1:
            raise UnsupportedFeatureError(None, "storage_options", f"part_bytes >= {MIN_PART}, chunk_bytes >= 1, parallel >= 1",
                                          Phrase(f"part_bytes {opts.part_bytes}, chunk_bytes {opts.chunk_bytes}, parallel {opts.parallel}"))
        return opts


_CLIENTS: dict[tuple, Any] = {}
_CLIENTS_LOCK = threading.Lock()


def client(options: StorageOptions):
    """A botocore S3 client for ``options`` (cached: clients are thread-safe)."""
    with _CLIENTS_LOCK:
        c = _CLIENTS.get(astuple_key(options))
        if c is not None:
            return c
        try:
            import botocore.config
            import botocore.session
        except ImportError as e:
            raise UnsupportedFeatureError(None, "hsnap[remote]", "botocore installed (pip install hsnap[remote])", Phrase(str(e))) from None
        session = botocore.session.Session(profile=options.profile)
        cfg = botocore.config.Config(
            connect_timeout=options.connect_timeout,
            read_timeout=options.timeout,
            retries={"max_attempts": options.retries + 1, "mode": "standard"},
            max_pool_connections=max(10, 2 * options.parallel + 2),
            s3={"addressing_style": "path"},
            signature_version="s3v4",
            # a checksum of every part costs a pass over the bytes; hsnap digests them already
            request_checksum_calculation="when_required",
            response_checksum_validation="when_required",
        )
        endpoint = options.endpoint_url or os.environ.get("AWS_ENDPOINT_URL_S3") or os.environ.get("AWS_ENDPOINT_URL")
        region = options.region or os.environ.get("AWS_REGION") or os.environ.get("AWS_DEFAULT_REGION") or "us-east-1"
        c = session.create_client("s3", endpoint_url=endpoint, region_name=region, aws_access_key_id=options.key,
                                  aws_secret_access_key=options.secret, aws_session_token=options.token, config=cfg)
        _CLIENTS[astuple_key(options)] = c
        return c


def astuple_key(options: StorageOptions) -> tuple:
    # what the environment supplies is part of the client too (tests switch it in one process)
    env = tuple(os.environ.get(k) for k in ("AWS_ENDPOINT_URL_S3", "AWS_ENDPOINT_URL", "AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY",
                                            "AWS_PROFILE", "AWS_REGION", "AWS_DEFAULT_REGION"))
    return tuple(getattr(options, f.name) for f in fields(options)) + env


_NOT_FOUND = {"NoSuchBucket", "NoSuchKey", "NotFound", "404", "NoSuchUpload"}
_DENIED = {"AccessDenied", "InvalidAccessKeyId", "SignatureDoesNotMatch", "403", "InvalidToken", "ExpiredToken", "AuthorizationHeaderMalformed"}
_CHANGED = {"PreconditionFailed", "412"}


def translate(exc: BaseException, url: str, op: str, options: StorageOptions | None = None) -> HsnapError:
    """A botocore/urllib3 failure as a typed error naming the URL and the operation.
    Built from the error code and HTTP status only: the server's free text and the
    request (which may carry credentials) are never copied into the message."""
    try:
        import botocore.exceptions as bx
        import urllib3.exceptions as ux
    except ImportError:  # pragma: no cover - botocore is there if a client exists
        return RemoteIOError(url, op, OSError(errno.EIO, type(exc).__name__))
    if isinstance(exc, HsnapError):
        return exc
    if isinstance(exc, bx.ClientError):
        err = exc.response.get("Error", {}) or {}
        code = str(err.get("Code") or "")
        status = (exc.response.get("ResponseMetadata") or {}).get("HTTPStatusCode")
        what = f"{code or 'error'} (HTTP {status})"
        if code in _NOT_FOUND or (not code and status == 404):
            return RemoteNotFoundError(url, op, FileNotFoundError(errno.ENOENT, f"{what}: no such {'bucket' if code == 'NoSuchBucket' else 'object'}"))
        if code in _DENIED or status == 403:
            return RemoteAuthError(url, op, PermissionError(errno.EACCES, f"{what}: credentials or access refused"))
        if code in _CHANGED or status == 412:
            return ObjectChangedError(url, f"{op}: ETag", "the object opened", Phrase("another version (replaced or truncated since open)"))
        return RemoteIOError(url, op, OSError(errno.EIO, what))
    timeout = options.timeout if options else None
    if isinstance(exc, (bx.ReadTimeoutError, ux.ReadTimeoutError)):
        return RemoteTimeoutError(url, op, TimeoutError(errno.ETIMEDOUT, f"no answer within the read timeout ({timeout} s)"))
    if isinstance(exc, (bx.ConnectTimeoutError, ux.ConnectTimeoutError)):
        ct = options.connect_timeout if options else None
        return RemoteTimeoutError(url, op, TimeoutError(errno.ETIMEDOUT, f"no connection within the connect timeout ({ct} s)"))
    if isinstance(exc, (bx.NoCredentialsError, bx.PartialCredentialsError)):
        return RemoteAuthError(url, op, PermissionError(errno.EACCES, f"{type(exc).__name__}: no credentials found"))
    if isinstance(exc, bx.BotoCoreError) or isinstance(exc, (ux.HTTPError, ConnectionError, OSError)):
        return RemoteIOError(url, op, ConnectionError(errno.ECONNRESET, f"{type(exc).__name__}: the connection to the store failed"))
    return RemoteIOError(url, op, OSError(errno.EIO, type(exc).__name__))


def _call(url: str, op: str, options: StorageOptions, fn, **kw):
    try:
        return fn(**kw)
    except Exception as e:  # noqa: BLE001 - every failure becomes a typed HsnapError
        raise translate(e, url, op, options) from None


def _hook(op: str, url: str, offset: int = 0, length: int = 0) -> None:
    if fault_hook is not None:
        fault_hook(op, url, offset, length)


def _url(bucket: str, key: str) -> str:
    return f"s3://{bucket}/{key}"


# ---------------------------------------------------------------- reading


class RangeReader:
    """An object's bytes by ranged GET, pinned to the version seen by the first GET."""

    def __init__(self, url: str, options: StorageOptions | None = None) -> None:
        self.url = url
        self.options = StorageOptions.of(options)
        self.bucket, self.key = parse_url(url)
        self.client = client(self.options)
        self._pool: cf.ThreadPoolExecutor | None = None
        self.requests = 0  # GETs sent (open latency is counted in round trips)
        _hook("open", url)
        self.requests += 1
        try:
            r = self.client.get_object(Bucket=self.bucket, Key=self.key, Range=f"bytes=0-{max(self.options.first_read, 64) - 1}")
            body = r["Body"].read()
        except Exception as e:  # noqa: BLE001
            err = translate(e, url, "open", self.options)
            if getattr(e, "response", {}).get("Error", {}).get("Code") == "InvalidRange":  # an empty object
                self.size, self.etag, self.version, self._first = 0, None, None, b""
                return
            raise err from None
        self.etag = r.get("ETag")
        self.version = r.get("VersionId")
        total = r.get("ContentRange", "").rpartition("/")[2]
        self.size = int(total) if total.isdigit() else len(body)
        self._first = body

    def _executor(self) -> cf.ThreadPoolExecutor:
        if self._pool is None:
            self._pool = cf.ThreadPoolExecutor(self.options.parallel, thread_name_prefix="hsnap-get")
        return self._pool

    def _get(self, offset: int, out: memoryview) -> None:
        """Fill ``out`` with bytes [offset, offset+len(out)) of the pinned version."""
        n = len(out)
        _hook("get", self.url, offset, n)
        self.requests += 1
        kw: dict[str, Any] = {"Bucket": self.bucket, "Key": self.key, "Range": f"bytes={offset}-{offset + n - 1}"}
        if self.version:
            kw["VersionId"] = self.version
        if self.etag:
            kw["IfMatch"] = self.etag
        try:
            body = self.client.get_object(**kw)["Body"]
            done = 0
            while done < n:  # read into the target piece by piece: no second whole-chunk copy
                piece = body.read(min(1 << 20, n - done))
                if not piece:
                    break
                out[done : done + len(piece)] = piece
                done += len(piece)
        except Exception as e:  # noqa: BLE001
            raise translate(e, self.url, f"read at byte {offset}", self.options) from None
        if done != n:
            raise TruncatedError(self.url, f"read at byte {offset} (object changed under the reader?)", n, done)

    def pread(self, n: int, offset: int) -> bytes:
        """Up to ``n`` bytes at ``offset`` (short at the end of the object), like os.pread."""
        n = max(0, min(n, self.size - offset))
        if offset + n <= len(self._first):
            return self._first[offset : offset + n]
        out = bytearray(n)
        self.readinto(memoryview(out), offset)
        return bytes(out)

    def readinto(self, view: memoryview, offset: int) -> None:
        """Fill ``view`` from ``offset``: chunked ranged GETs, ``parallel`` in flight."""
        view = memoryview(view).cast("B")
        n = len(view)
        if offset + n > self.size:
            raise TruncatedError(self.url, f"read at byte {offset}", offset + n, Phrase(f"{self.size} bytes"))
        if offset + n <= len(self._first):
            view[:] = self._first[offset : offset + n]
            return
        step = self.options.chunk_bytes
        pieces = [(a, min(n, a + step)) for a in range(0, n, step)]
        if len(pieces) == 1:
            return self._get(offset, view)
        futures = [self._executor().submit(self._get, offset + a, view[a:b]) for a, b in pieces]
        try:
            for f in futures:
                f.result()
        finally:
            for f in futures:
                f.cancel()
            cf.wait(futures)  # nothing may write into ``view`` after we return

    def check_unchanged(self) -> None:
        _hook("head", self.url)
        r = _call(self.url, "head", self.options, self.client.head_object, Bucket=self.bucket, Key=self.key)
        if r.get("ETag") != self.etag or r.get("ContentLength") != self.size:
            raise ObjectChangedError(self.url, "ETag (changed since open)", self.etag, r.get("ETag"))

    def close(self) -> None:
        if self._pool is not None:
            self._pool.shutdown(wait=True)
            self._pool = None


class SectionRange:
    """One section of a remote snapshot for a restore engine: ``readinto(view, at)``
    fills ``view`` with the section's bytes from ``at`` (ranged GETs) and hashes them
    in order; :meth:`finish` then checks the digest — what was hashed is what landed
    in the slots."""

    def __init__(self, snap: "RemoteSnapshot", info: SectionInfo) -> None:
        self.snap, self.info = snap, info
        self.offset, self.length = info.offset, info.length
        self._h = xxhash.xxh3_128()
        self._next = 0

    def readinto(self, view: memoryview, at: int) -> None:
        view = memoryview(view).cast("B")
        if at != self._next:  # the digest is over the section in order
            raise HsnapError(self.snap.path, f"sections[{self.info.name!r}]", f"a read at byte {self._next}", at, detail="out of order")
        self.snap._read_ahead(self.offset + at, view)
        self._h.update(view)
        self._next += len(view)

    def finish(self) -> None:
        if self._next != self.length:
            raise TruncatedError(self.snap.path, f"sections[{self.info.name!r}]", self.length, self._next)
        got = self._h.hexdigest()
        if got != self.info.digest:
            raise DigestMismatchError(self.snap.path, f"sections[{self.info.name!r}].digest", self.info.digest, got)


class RemoteSnapshot(Snapshot):
    """A committed rank object, read by ranged GETs (no map: ``snap[name]`` copies)."""

    # restore verifies each section as it lands in the slots (one pass over the network)
    verifies_while_reading = True

    def __init__(self, url: str, *, storage_options=None, reader: RangeReader | None = None) -> None:
        self.path = url
        self._mm = None
        self._fd = -1
        self._closed = True
        self._src = reader or RangeReader(url, storage_options)
        self._closed = False
        self.size = self._src.size
        try:
            self._load(self._src.pread)
        except BaseException:
            self.close()
            raise
        self._scratch = bytearray()
        self._padding_error: tuple[bool, HsnapError | None] | None = None

    @property
    def etag(self) -> str | None:
        return self._src.etag

    @property
    def open_requests(self) -> int:
        return self._src.requests

    def _read(self, offset: int, length: int, out: memoryview | None = None) -> memoryview:
        if self._closed:
            raise HsnapError(self.path, "snapshot", "open", Phrase("closed"))
        if out is None:
            if len(self._scratch) < length:
                self._scratch = bytearray(length)
            out = memoryview(self._scratch)[:length]
        self._read_ahead(offset, out)  # small reads (record sections, hex views) share a window
        return out

    def fileno(self) -> int:
        raise UnsupportedFeatureError(self.path, "fileno", "a local file", Phrase("an object-store URL"))

    def _map(self):
        raise UnsupportedFeatureError(self.path, "zero-copy view", "a local file", Phrase("an object-store URL (use read())"))

    def raw(self, name_or_info) -> memoryview:
        """The section's verified bytes (a copy: an object cannot be mapped)."""
        return memoryview(self.read(self._info(name_or_info), verify=True).reshape(-1).view(np.uint8))

    def array(self, name_or_info, *, verify: bool = True) -> np.ndarray:
        return self.read(self._info(name_or_info), verify=True)

    __getitem__ = array

    def check_unchanged(self) -> None:
        self._src.check_unchanged()

    def section_range(self, info: SectionInfo) -> SectionRange:
        return SectionRange(self, info)

    def _read_ahead(self, offset: int, view: memoryview) -> None:
        """Sequential reads (a restore, section after section): one window of
        chunk x parallel bytes fetched in parallel serves the small sections that follow
        (a GET per small section would cost a round trip each); reads at least a window
        long go straight into ``view``. Memory: one window buffer, reused."""
        n = len(view)
        window = self._src.options.chunk_bytes * self._src.options.parallel
        if n >= window:
            return self._src.readinto(view, offset)
        w_at, w_len = getattr(self, "_window", (0, 0))
        if not (w_at <= offset and offset + n <= w_at + w_len):
            w_len = min(window, self.file_length - offset)
            if len(getattr(self, "_window_buf", b"")) < w_len:
                self._window_buf = bytearray(window)
            self._src.readinto(memoryview(self._window_buf)[:w_len], offset)
            self._window = w_at, w_len = offset, w_len
        view[:] = memoryview(self._window_buf)[offset - w_at : offset - w_at + n]

    # -- verification in one streaming pass (sections and padding), not one GET per gap
    def iter_verify(self, cancelled=None) -> Iterator[tuple[SectionInfo, HsnapError | None]]:
        self._padding_error = None
        result: dict = {}
        window = self._src.options.chunk_bytes * self._src.options.parallel
        yield from stream(self, window, HEADER_OFFSET + self.preamble.header_length, self.file_length - TRAILER.size,
                          cancelled=cancelled, result=result)
        if "padding" in result:
            self._padding_error = (True, result["padding"])

    def check_padding(self) -> None:
        done, self._padding_error = self._padding_error, None  # a pass just made answers once
        if done is None:
            for _ in self.iter_verify():
                pass
            done, self._padding_error = self._padding_error, None
        if done[1] is not None:
            raise done[1]

    def verify(self) -> None:
        """Every section digest and the padding, in one streaming pass of ranged GETs."""
        for _, err in self.iter_verify():
            if err is not None:
                raise err
        self.check_padding()

    def close(self) -> None:
        if not getattr(self, "_closed", True):
            self._closed = True
            self._src.close()

    def __repr__(self) -> str:
        return f"<hsnap.RemoteSnapshot {self.path!r} v{self.version[0]}.{self.version[1]} {len(self.sections)} sections, etag {self.etag}>"


def stream(snap: Snapshot, window: int, start: int, stop: int, *, each=None, cancelled=None, result: dict | None = None):
    """Read bytes [start, stop) of ``snap`` in windows (one buffer, reused), hashing every
    section and checking the padding; yields ``(section, error or None)`` as each section
    ends, calls ``each(offset, bytes)`` per window (a copy's sink), and puts the first
    padding error (or None) in ``result["padding"]`` when the pass completes."""
    regions = sorted([(s.offset, s.offset + s.length, s) for s in snap.sections] + [(a, b, None) for a, b in snap.padding_ranges()],
                     key=lambda r: r[0])
    regions = [r for r in regions if r[1] > start or r[0] >= start]
    buf = bytearray(min(window, max(stop - start, 0)))
    ri, h, padding_error = 0, xxhash.xxh3_128(), None
    for w in range(start, stop, window):
        if cancelled is not None and cancelled():
            return
        n = min(window, stop - w)
        mv = snap._read(w, n, memoryview(buf)[:n])
        if each is not None:
            each(w, mv)
        while ri < len(regions) and regions[ri][0] < w + n:
            a, b, s = regions[ri]
            piece = mv[max(a, w) - w : min(b, w + n) - w]
            if s is not None:
                h.update(piece)
            elif padding_error is None and any(piece):
                i = next(i for i, x in enumerate(piece) if x)
                padding_error = DigestMismatchError(snap.path, f"padding at byte {max(a, w) + i}", "zero bytes", f"0x{piece[i]:02x}")
            if b > w + n:
                break
            if s is not None:
                got = h.hexdigest()
                yield s, None if got == s.digest else DigestMismatchError(snap.path, f"sections[{s.name!r}].digest", s.digest, got)
                h = xxhash.xxh3_128()
            ri += 1
    for a, b, s in regions[ri:]:  # zero-length sections at the very end
        if s is not None:
            got = xxhash.xxh3_128_hexdigest(b"")
            yield s, None if got == s.digest else DigestMismatchError(snap.path, f"sections[{s.name!r}].digest", s.digest, got)
    if result is not None:
        result["padding"] = padding_error


def _get_small(url: str, options: StorageOptions, limit: int) -> bytes:
    bucket, key = parse_url(url)
    c = client(options)
    _hook("get", url, 0, limit)
    r = _call(url, "read", options, c.get_object, Bucket=bucket, Key=key, Range=f"bytes=0-{limit}")
    try:
        return r["Body"].read()
    except Exception as e:  # noqa: BLE001
        raise translate(e, url, "read", options) from None


class RemoteSnapshotSet(SnapshotSet):
    """A committed set under a prefix: ``PREFIX/manifest.json`` binding ``PREFIX/rank-N.hsnap``."""

    def __init__(self, url: str, *, ranks=None, storage_options=None) -> None:
        self.path = url.rstrip("/")
        self.options = StorageOptions.of(storage_options)
        self.ranks = {}
        murl = f"{self.path}/{MANIFEST_NAME}"
        try:
            data = _get_small(murl, self.options, MAX_MANIFEST_BYTES)
        except RemoteNotFoundError as e:
            if "bucket" in (e.os_error.strerror or ""):
                raise
            raise MalformedManifestError(self.path, MANIFEST_NAME, "present (the commit point)", Phrase("missing: not a committed snapshot")) from None
        self.manifest = decode_manifest(data, murl)
        self._open_ranks(ranks)

    def _open_file(self, fpath: str) -> Snapshot:
        return RemoteSnapshot(fpath, storage_options=self.options)


def open_url(url: str, *, ranks=None, storage_options=None) -> RemoteSnapshot | RemoteSnapshotSet:
    """Open ``s3://bucket/key`` (one rank object) or ``s3://bucket/prefix`` (a set:
    its ``manifest.json``). ``ranks`` selects ranks of a set (ignored for one object)."""
    options = StorageOptions.of(storage_options)
    bucket, key = parse_url(url)
    if not key or key.endswith("/"):
        return RemoteSnapshotSet(url, ranks=ranks, storage_options=options)
    try:
        return RemoteSnapshot(url, storage_options=options)
    except RemoteNotFoundError as e:
        if "bucket" in (e.os_error.strerror or ""):
            raise
        try:  # a prefix holding a set?
            return RemoteSnapshotSet(url, ranks=ranks, storage_options=options)
        except MalformedManifestError as m:
            if m.field == MANIFEST_NAME:  # no set there either: the object is what is missing
                raise e from None
            raise


# ---------------------------------------------------------------- writing


def _require_bucket(url: str, options: StorageOptions) -> None:
    """Before a write: some stores (SeaweedFS) create a missing bucket on upload."""
    bucket, _ = parse_url(url)
    try:
        client(options).head_bucket(Bucket=bucket)
    except Exception as e:  # noqa: BLE001
        err = translate(e, url, "head bucket", options)
        if isinstance(err, RemoteNotFoundError):
            raise RemoteNotFoundError(url, "head bucket", FileNotFoundError(errno.ENOENT, "NoSuchBucket (HTTP 404): no such bucket")) from None
        raise err from None


def _exists(url: str, options: StorageOptions) -> bool:
    bucket, key = parse_url(url)
    try:
        client(options).head_object(Bucket=bucket, Key=key)
        return True
    except Exception as e:  # noqa: BLE001
        err = translate(e, url, "head", options)
        if isinstance(err, RemoteNotFoundError) and "bucket" not in (err.os_error.strerror or ""):
            return False
        raise err from None


class MultipartUpload:
    """One multipart upload: parts in flight on a thread pool (at most ``parallel``
    waiting or running, so memory is bounded), completion as the commit."""

    def __init__(self, url: str, options: StorageOptions) -> None:
        self.url, self.options = url, options
        self.bucket, self.key = parse_url(url)
        self.client = client(options)
        _hook("create", url)
        r = _call(url, "create multipart upload", options, self.client.create_multipart_upload, Bucket=self.bucket, Key=self.key,
                  Metadata={"hsnap-writer": f"{socket.gethostname()[:64]}:{os.getpid()}"})
        self.upload_id = r["UploadId"]
        self._pool = cf.ThreadPoolExecutor(options.parallel, thread_name_prefix="hsnap-put")
        self._slots = threading.BoundedSemaphore(options.parallel)
        self._futures: dict[int, cf.Future] = {}

    def _put(self, number: int, data) -> str:
        try:
            _hook("part", self.url, number, len(data))
            r = _call(self.url, f"upload part {number}", self.options, self.client.upload_part, Bucket=self.bucket, Key=self.key,
                      UploadId=self.upload_id, PartNumber=number, Body=data if isinstance(data, bytes) else bytes(data))
            return r["ETag"]
        finally:
            self._slots.release()

    def submit(self, number: int, data) -> None:
        """Upload part ``number`` (1-based) in the background; blocks while ``parallel`` are in flight."""
        self._slots.acquire()
        for n, f in list(self._futures.items()):  # fail early: a failed part ends the upload
            if f.done() and f.exception() is not None:
                self._slots.release()
                raise f.exception()
        self._futures[number] = self._pool.submit(self._put, number, data)

    def complete(self) -> None:
        parts = [{"PartNumber": n, "ETag": self._futures[n].result()} for n in sorted(self._futures)]
        _hook("complete", self.url)
        _call(self.url, "complete multipart upload", self.options, self.client.complete_multipart_upload, Bucket=self.bucket,
              Key=self.key, UploadId=self.upload_id, MultipartUpload={"Parts": parts}, IfNoneMatch="*")
        self._pool.shutdown(wait=True)

    def abort(self) -> None:
        """Best effort: a store that cannot be reached keeps the upload, which gc finds."""
        for f in self._futures.values():
            f.cancel()
        self._pool.shutdown(wait=True)
        try:
            self.client.abort_multipart_upload(Bucket=self.bucket, Key=self.key, UploadId=self.upload_id)
        except Exception:  # noqa: BLE001
            pass


class RemoteSnapshotWriter(SnapshotWriter):
    """:class:`SnapshotWriter` to ``s3://bucket/key``: a streamed multipart upload whose
    completion is the commit. Memory: the first part (held for the header), the part
    being filled and ``parallel`` parts in flight."""

    def __init__(self, url: str, *, storage_options=None, **kw) -> None:
        self.options = StorageOptions.of(storage_options)
        super().__init__(url, **kw)

    def _create(self, mode: int, preallocate: bool) -> None:
        _fs.check_final_name(parse_url(self.path)[1] or "x")
        _require_bucket(self.path, self.options)
        if _exists(self.path, self.options):
            raise SnapshotExistsError(self.path, "key", "no object", Phrase("one exists"))
        self._upload = MultipartUpload(self.path, self.options)
        self.state = WriterState.OPEN
        # part 1 covers the preamble and header (patched in at commit) and the first sections
        self._first_len = min(self.file_length, max(self.options.part_bytes, self._data_offset))
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
        p = self.options.part_bytes
        while self._part > 1 and len(self._buf) >= 2 * p:  # keep >= one part back: the last part holds the trailer
            self._upload.submit(self._part, bytes(self._buf[:p]))
            del self._buf[:p]
            self._buf_at += p
            self._part += 1

    def _write_at(self, view: memoryview, offset: int) -> None:
        try:
            if offset < self._stream:
                raise AssertionError(f"remote writes are sequential: {offset} < {self._stream}")
            if offset > self._stream:  # alignment padding
                self._append(bytes(offset - self._stream))
            self._append(view)
        except HsnapError:
            self.abort()
            raise

    def _publish(self, pre: bytes, header: bytes, tra: bytes, end: int, fsync: bool) -> None:
        try:
            if end > self._stream:
                self._append(bytes(end - self._stream))
            self._append(tra)
            if self._part == 1:  # the whole object fits in one part
                self._first, self._buf = self._buf, bytearray()
            first = bytearray(self._first)
            first[: len(pre)] = pre
            first[HEADER_OFFSET : HEADER_OFFSET + len(header)] = header
            if self._buf:
                self._upload.submit(self._part, bytes(self._buf))
            self._upload.submit(1, bytes(first))
            self._first = self._buf = None
            _fs.phase("before-complete")
            self._upload.complete()
        except BaseException:
            self.state = WriterState.ABORTED
            self._discard()
            raise

    def _discard(self) -> None:
        up = getattr(self, "_upload", None)
        if up is not None:
            up.abort()
            self._upload = None


def snapshot_writer(path, *, storage_options=None, **kw) -> SnapshotWriter:
    """The writer for ``path``: a multipart upload for an ``s3://`` URL, else a local file."""
    if is_url(os.fspath(path)):
        return RemoteSnapshotWriter(os.fspath(path), storage_options=storage_options, **kw)
    return SnapshotWriter(path, **kw)


def put_bytes(url: str, data: bytes, options: StorageOptions, *, no_overwrite: bool = True) -> str:
    """One small object in one PUT (the manifest, the pending marker); never overwrites
    when the store honours ``If-None-Match``. Returns the ETag."""
    bucket, key = parse_url(url)
    _hook("put", url, 0, len(data))
    kw = {"IfNoneMatch": "*"} if no_overwrite else {}
    return _call(url, "put", options, client(options).put_object, Bucket=bucket, Key=key, Body=data, **kw)["ETag"]


def delete(url: str, options: StorageOptions) -> None:
    bucket, key = parse_url(url)
    _call(url, "delete", options, client(options).delete_object, Bucket=bucket, Key=key)


class RemoteSetWriter:
    """A TP set under ``s3://bucket/prefix``: ``PREFIX/.hsnap-pending`` first, rank
    objects (each a :class:`RemoteSnapshotWriter` to :meth:`rank_path`), then
    ``manifest.json`` (the commit of the set), then the marker goes."""

    def __init__(self, url: str, *, storage_options=None) -> None:
        self.path = url.rstrip("/")
        self.options = StorageOptions.of(storage_options)
        _require_bucket(self.path, self.options)
        if _exists(f"{self.path}/{MANIFEST_NAME}", self.options):
            raise SnapshotExistsError(self.path, MANIFEST_NAME, "no committed set", Phrase("one exists"))
        put_bytes(f"{self.path}/{PENDING_MARKER}", PENDING_MARKER_TEXT, self.options, no_overwrite=False)
        self.written: list[str] = []

    def rank_path(self, rank: int) -> str:
        return f"{self.path}/{rank_file_name(rank)}"

    def rank_writer(self, rank: int, **kw) -> RemoteSnapshotWriter:
        self.written.append(self.rank_path(rank))
        return RemoteSnapshotWriter(self.rank_path(rank), storage_options=self.options, **kw)

    def commit(self, *, tp_size: int) -> Manifest:
        snaps = []
        try:
            for r in range(tp_size):
                snaps.append(RemoteSnapshot(self.rank_path(r), storage_options=self.options))
            manifest = manifest_for(snaps)
        finally:
            for s in snaps:
                s.close()
        _fs.phase("before-manifest")
        put_bytes(f"{self.path}/{MANIFEST_NAME}", manifest.encode(), self.options)
        _fs.phase("manifest-written")
        try:
            delete(f"{self.path}/{PENDING_MARKER}", self.options)
        except HsnapError:
            pass  # the set is committed (the manifest wins over a marker left behind)
        return manifest

    def abort(self) -> None:
        """Remove what this writer itself wrote (never by name pattern), marker last."""
        for url in self.written:
            try:
                delete(url, self.options)
            except HsnapError:
                pass
        try:
            delete(f"{self.path}/{PENDING_MARKER}", self.options)
        except HsnapError:
            pass


# ---------------------------------------------------------------- gc

DEFAULT_URL_GC_AGE = 900.0  # a multipart upload younger than this may be a running export


def collect_url(url: str, *, remove: bool = False, older_than: float | None = None, storage_options=None) -> list[Leftover]:
    """Leftovers of interrupted writes under ``url`` (a bucket or prefix):

    * in-progress multipart uploads — never visible, provably uncommitted; removable
      (aborted) when started at least ``older_than`` seconds ago (default
      ``DEFAULT_URL_GC_AGE``: a running export on another host records no pid we
      could check);
    * unfinished sets — a prefix holding ``.hsnap-pending`` and no ``manifest.json``
      (the marker goes only after the manifest is in place); removable when the
      marker is that old: the marker, then exactly the objects under that prefix.
      A prefix with rank objects and neither marker nor manifest is listed, kept.

    A completed object outside an unfinished set is never removed, whatever its name.
    """
    options = StorageOptions.of(storage_options)
    bucket, prefix = parse_url(url)
    c = client(options)
    age_limit = DEFAULT_URL_GC_AGE if older_than is None else older_than
    now = time.time()
    out: list[Leftover] = []
    kw: dict[str, Any] = {"Bucket": bucket, "Prefix": prefix}
    while True:
        r = _call(url, "list multipart uploads", options, c.list_multipart_uploads, **kw)
        for u in r.get("Uploads", []) or []:
            age = now - u["Initiated"].timestamp()
            item = Leftover(path=_url(bucket, u["Key"]) + f"?uploadId={u['UploadId']}", kind="upload", final=_url(bucket, u["Key"]),
                            age_s=age, removable=age >= age_limit,
                            reason="in-progress multipart upload (never visible)" + ("" if age >= age_limit else f"; younger than {age_limit:.0f} s: may be running"))
            if remove and item.removable:
                try:
                    c.abort_multipart_upload(Bucket=bucket, Key=u["Key"], UploadId=u["UploadId"])
                    item.action = "removed"
                except Exception as e:  # noqa: BLE001
                    err = translate(e, item.path, "abort", options)
                    item.action, item.reason = ("gone", item.reason) if isinstance(err, RemoteNotFoundError) else ("failed", str(err))
            elif item.removable:
                item.action = "would remove"
            out.append(item)
        if not r.get("IsTruncated"):
            break
        kw.update(KeyMarker=r.get("NextKeyMarker"), UploadIdMarker=r.get("NextUploadIdMarker"))
    out += _unfinished_sets(bucket, prefix, c, options, remove, age_limit, now)
    return out


def _list(bucket: str, prefix: str, c, options) -> list[dict]:
    objs, kw = [], {"Bucket": bucket, "Prefix": prefix}
    while True:
        r = _call(_url(bucket, prefix), "list objects", options, c.list_objects_v2, **kw)
        objs += r.get("Contents", []) or []
        if not r.get("IsTruncated"):
            return objs
        kw["ContinuationToken"] = r["NextContinuationToken"]


def _unfinished_sets(bucket, prefix, c, options, remove, age_limit, now) -> list[Leftover]:
    objs = _list(bucket, prefix, c, options)
    by_dir: dict[str, dict[str, dict]] = {}
    for o in objs:
        d, _, name = o["Key"].rpartition("/")
        by_dir.setdefault(d, {})[name] = o
    out = []
    for d, names in sorted(by_dir.items()):
        marker = names.get(PENDING_MARKER)
        ranks = [n for n in names if RANK_FILE_RE.match(n)]
        if MANIFEST_NAME in names or (marker is None and not ranks):
            continue
        where = _url(bucket, d)
        total = sum(o["Size"] for o in names.values())
        if marker is None:
            out.append(Leftover(path=where, kind="set", final=where, bytes=total, reason="rank objects without manifest.json or pending marker: not proved unfinished"))
            continue
        try:
            proof = _get_small(_url(bucket, marker["Key"]), options, len(PENDING_MARKER_TEXT)) == PENDING_MARKER_TEXT
        except HsnapError:
            proof = False
        age = now - max(o["LastModified"].timestamp() for o in names.values())
        item = Leftover(path=where, kind="set", final=where, bytes=total, age_s=age, removable=proof and age >= age_limit,
                        reason="unfinished set (pending marker, no manifest.json)" if proof else "marker content not hsnap's: kept")
        if item.removable and remove:
            item.action = _remove_set(bucket, d, names, c, options)
        elif item.removable:
            item.action = "would remove"
        out.append(item)
    return out


def _remove_set(bucket, d, names, c, options) -> str:
    # prove again right before: a manifest that appeared in between makes it a committed set
    if _exists(_url(bucket, f"{d}/{MANIFEST_NAME}"), options):
        return "kept"
    for name in sorted(names, key=lambda n: n == PENDING_MARKER):  # the marker last: a gc killed half way leaves proof
        try:
            c.delete_object(Bucket=bucket, Key=f"{d}/{name}")
        except Exception:  # noqa: BLE001
            return "failed"
    return "removed"


__all__ = [
    "RemoteIOError", "RemoteNotFoundError", "RemoteAuthError", "RemoteTimeoutError", "ObjectChangedError",
    "StorageOptions", "RangeReader", "RemoteSnapshot", "RemoteSnapshotSet", "RemoteSnapshotWriter", "RemoteSetWriter",
    "MultipartUpload", "open_url", "snapshot_writer", "collect_url", "is_url", "parse_url",
]
