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
"""

from __future__ import annotations

import collections
import concurrent.futures as cf
import contextlib
import errno
import itertools
import os
import re
import socket
import threading
import time
import urllib.parse
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
    ReservedNameError,
    SnapshotExistsError,
    TruncatedError,
    UnsupportedFeatureError,
)
from .gc import FILE as GC_FILE, Leftover, parse_name
from .manifest import Manifest, SnapshotSet, decode_manifest, manifest_for
from .reader import Snapshot, SectionInfo
from .spec import (
    HEADER_OFFSET,
    MAGIC,
    MANIFEST_NAME,
    MAX_MANIFEST_BYTES,
    PENDING_MAGIC,
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
    """No answer within the configured ``timeout`` / ``connect_timeout`` (storage options or
    ``HSNAP_S3_TIMEOUT`` / ``HSNAP_S3_CONNECT_TIMEOUT``), on every attempt."""


class NotS3EndpointError(RemoteIOError):
    """The endpoint answered, but not as an S3 server: no S3 error document, or not HTTP."""


class ObjectChangedError(DigestMismatchError):
    """The object was replaced (or truncated) since it was opened: its ETag changed."""


# ---------------------------------------------------------------- URLs and options

_URL_RE = re.compile(r"(?P<scheme>[A-Za-z][A-Za-z0-9+.-]*)://(?P<bucket>[^/]*)(?:/(?P<key>.*))?\Z", re.S)


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


# field -> (environment variable, default, least, most): how long a request may wait
# for a store that does not answer (README "Across hosts", the bound in request_bound_s)
_WAIT_KNOBS = {
    "timeout": ("HSNAP_S3_TIMEOUT", 15.0, 0.001, 3600.0),
    "connect_timeout": ("HSNAP_S3_CONNECT_TIMEOUT", 5.0, 0.001, 3600.0),
    "retries": ("HSNAP_S3_RETRIES", 2, 0, 10),
}
_MAX_BACKOFF = 20.0  # botocore's standard retry mode: retry i sleeps at most min(2**(i-1), 20) s


@dataclass(frozen=True)
class StorageOptions:
    """How to reach the store. ``None`` fields come from the standard places (the
    environment, ``~/.aws``). ``timeout`` is the read timeout of one attempt (no byte
    for that long), ``connect_timeout`` that of connecting, in seconds; ``retries`` the
    attempts after the first (botocore's standard mode). Unset, these three come from
    ``HSNAP_S3_TIMEOUT``, ``HSNAP_S3_CONNECT_TIMEOUT``, ``HSNAP_S3_RETRIES``, else 15,
    5 and 2; :attr:`request_bound_s` is then the longest one request waits."""

    endpoint_url: str | None = None
    key: str | None = None
    secret: str | None = None
    token: str | None = None
    region: str | None = None
    profile: str | None = None
    timeout: float | None = None
    connect_timeout: float | None = None
    retries: int | None = None
    chunk_bytes: int = 8 << 20  # one ranged GET
    parallel: int = 4  # ranged GETs / part uploads in flight
    part_bytes: int = 8 << 20  # multipart part size (>= 5 MiB)
    first_read: int = FIRST_READ  # the open's first GET (preamble + header)

    def __post_init__(self) -> None:
        for name, (env, default, least, most) in _WAIT_KNOBS.items():
            value, source = getattr(self, name), f"storage_options {name}"
            if value is None:
                value, source = os.environ.get(env) or None, env
                if value is None:
                    value, source = default, None
            try:
                number = int(value) if isinstance(default, int) else float(value)
                ok = (number == float(value) if isinstance(default, int) else True) and least <= number <= most
            except (TypeError, ValueError, OverflowError):
                ok = False
            if not ok:
                unit = "an integer" if isinstance(default, int) else "seconds"
                raise UnsupportedFeatureError(None, source or name, Phrase(f"{unit} from {least:g} to {most:g}"), value)
            object.__setattr__(self, name, number)

    @property
    def attempts(self) -> int:
        return self.retries + 1

    @property
    def request_bound_s(self) -> float:
        """The longest one request waits for a store that does not answer: every attempt
        connects (``connect_timeout``) and waits for bytes (``timeout``), with botocore's
        back-off before each retry. A store that accepts and never answers costs
        ``attempts x timeout`` plus the back-off."""
        backoff = sum(min(2.0**i, _MAX_BACKOFF) for i in range(self.retries))
        return self.attempts * (self.connect_timeout + self.timeout) + backoff

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


def _redact(endpoint: str) -> str:
    """An endpoint as messages show it: scheme, host, port and path, never user info or a query."""
    try:
        u = urllib.parse.urlsplit(endpoint)
        host = u.hostname or ""
        port = f":{u.port}" if u.port else ""
    except ValueError:
        return "<an endpoint that is not a URL>"
    host = f"[{host}]" if ":" in host else host
    return f"{u.scheme}://{host}{port}{u.path.rstrip('/')}" if u.scheme else "<an endpoint that is not a URL>"


def resolve_endpoint(options: StorageOptions) -> tuple[str | None, str]:
    """(endpoint URL or None for AWS's own, where it came from). An empty value counts as
    unset, as botocore and the AWS CLI treat ``AWS_ENDPOINT_URL=``; anything else must be
    an http(s) URL with a host (a typed refusal naming the variable otherwise)."""
    for source, value in (("storage_options endpoint_url", options.endpoint_url),
                          ("AWS_ENDPOINT_URL_S3", os.environ.get("AWS_ENDPOINT_URL_S3")),
                          ("AWS_ENDPOINT_URL", os.environ.get("AWS_ENDPOINT_URL"))):
        if not value:
            continue
        try:
            u = urllib.parse.urlsplit(value)
            ok = u.scheme in ("http", "https") and bool(u.hostname) and (u.port is None or u.port > 0)
        except ValueError:
            ok = False
        if not ok:
            raise UnsupportedFeatureError(None, source, Phrase("http://host:port or https://host[:port]"), _redact(value) if "://" in value else value)
        return value, source
    return None, "AWS"


def endpoint_shown(options: StorageOptions) -> str:
    """The endpoint requests go to, for messages (never credentials)."""
    try:
        endpoint, _ = resolve_endpoint(options)
    except HsnapError:
        return "<invalid endpoint>"
    if endpoint is None:
        c = _CLIENTS.get(astuple_key(options))
        return _redact(c.meta.endpoint_url) if c is not None else "AWS S3"
    return _redact(endpoint)


_CLIENTS: dict[tuple, Any] = {}
_CLIENTS_LOCK = threading.Lock()


def client(options: StorageOptions, url: str | None = None):
    """A botocore S3 client for ``options`` (cached: clients are thread-safe); ``url``
    only names what was asked for in a refusal (a bad endpoint, a missing profile)."""
    with _CLIENTS_LOCK:
        c = _CLIENTS.get(astuple_key(options))
        if c is not None:
            return c
        try:
            import botocore.config
            import botocore.session
        except ImportError as e:
            raise UnsupportedFeatureError(None, "hsnap[remote]", "botocore installed (pip install hsnap[remote])", Phrase(str(e))) from None
        try:
            endpoint, _ = resolve_endpoint(options)
        except HsnapError as e:
            raise type(e)(url, e.field, e.expected, e.found) from None
        region = options.region or os.environ.get("AWS_REGION") or os.environ.get("AWS_DEFAULT_REGION") or "us-east-1"
        try:
            session = botocore.session.Session(profile=options.profile)
            cfg = botocore.config.Config(
                connect_timeout=options.connect_timeout,
                read_timeout=options.timeout,
                # total_max_attempts counts the first attempt (botocore's max_attempts would not)
                retries={"total_max_attempts": options.attempts, "mode": "standard"},
                max_pool_connections=max(10, 2 * options.parallel + 2),
                s3={"addressing_style": "path"},
                signature_version="s3v4",
                # a checksum of every part costs a pass over the bytes; hsnap digests them already
                request_checksum_calculation="when_required",
                response_checksum_validation="when_required",
            )
            c = session.create_client("s3", endpoint_url=endpoint, region_name=region, aws_access_key_id=options.key,
                                      aws_secret_access_key=options.secret, aws_session_token=options.token, config=cfg)
        except Exception as e:  # noqa: BLE001 - a profile that is not there, a region botocore refuses
            raise translate(e, url, "create the S3 client", options) from None
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

# A failure that is not an answer of the store, by the class names found in the exception
# and its causes (botocore wraps urllib3, which wraps http.client and socket): each cause
# takes the row of its most specific class, and the first such row wins, so a cause that
# says more (an HTTP status line that is not one) beats the wrapper that says less.
# row: (class names, typed error, errno, what happened; {t} {ct} {n} = timeouts, attempts)
_TRANSPORT = (
    (("ConnectTimeoutError", "ConnectTimeout"), RemoteTimeoutError, errno.ETIMEDOUT,
     "no connection within the connect timeout ({ct:g} s per attempt, {n}; HSNAP_S3_CONNECT_TIMEOUT)"),
    (("ReadTimeoutError", "ReadTimeout", "TimeoutError", "timeout"), RemoteTimeoutError, errno.ETIMEDOUT,
     "no answer within the read timeout ({t:g} s per attempt, {n}; HSNAP_S3_TIMEOUT)"),
    (("NoCredentialsError", "PartialCredentialsError", "CredentialRetrievalError", "NoAuthTokenError", "TokenRetrievalError",
      "SSOTokenLoadError", "UnauthorizedSSOTokenError", "ProfileNotFound", "UnknownCredentialError"), RemoteAuthError, errno.EACCES,
     "{cls}: no usable credentials (AWS_ACCESS_KEY_ID / AWS_SECRET_ACCESS_KEY, AWS_PROFILE or storage_options; a local store needs any pair it accepts)"),
    (("RemoteDisconnected",), RemoteIOError, errno.ECONNRESET, "the store closed the connection without an answer"),
    (("BadStatusLine", "LineTooLong", "UnknownProtocol", "HTTPException"), NotS3EndpointError, errno.EPROTO,
     "the endpoint answered with something that is not HTTP: not an S3 endpoint"),
    (("SSLError", "SSLCertVerificationError"), RemoteIOError, errno.ECONNREFUSED, "{cls}: TLS with the endpoint failed"),
    (("EndpointConnectionError", "NewConnectionError", "NameResolutionError", "ConnectionRefusedError", "gaierror",
      "ProxyConnectionError"), RemoteIOError, errno.ECONNREFUSED, "{cls}: cannot connect to the endpoint"),
    (("ResponseStreamingError", "IncompleteReadError", "IncompleteRead", "ProtocolError", "ConnectionResetError",
      "ConnectionClosedError", "BrokenPipeError"), RemoteIOError, errno.ECONNRESET, "{cls}: the connection to the store broke"),
    (("ParamValidationError", "InvalidRegionError", "UnknownEndpointError", "InvalidEndpointConfigurationError",
      "ValidationError"), UnsupportedFeatureError, None, "{cls}"),
    (("BotoCoreError", "HTTPError", "OSError"), RemoteIOError, errno.EIO, "{cls}: the request to the store failed"),
)


def _causes(exc: BaseException) -> list[BaseException]:
    """The exception and what it wraps (botocore keeps urllib3's in ``kwargs['error']``)."""
    out: list[BaseException] = []
    todo = [exc]
    while todo and len(out) < 16:
        e = todo.pop(0)
        if e is None or any(e is x for x in out):
            continue
        out.append(e)
        kw = getattr(e, "kwargs", None)
        todo += [kw.get("error") if isinstance(kw, dict) else None, e.__cause__, e.__context__]
        todo += [a for a in getattr(e, "args", ()) if isinstance(a, BaseException)]
    return out


def error_code(exc: BaseException) -> str:
    """The S3 error code of a store's answer ('' when there is none: not an answer, or no S3 error document)."""
    response = getattr(exc, "response", None)
    err = response.get("Error") if isinstance(response, dict) else None
    return str(err.get("Code") or "") if isinstance(err, dict) else ""


def translate(exc: BaseException, url: str | None, op: str, options: StorageOptions | None = None) -> HsnapError:
    """A botocore/urllib3 failure as a typed error naming the URL, the operation and the
    endpoint. Built from the error code, the HTTP status and the exception classes only:
    the server's free text and the request (which may carry credentials) are never copied."""
    if isinstance(exc, HsnapError):
        return exc
    options = options or StorageOptions()
    where = f"{op} at {endpoint_shown(options)}"
    response = getattr(exc, "response", None)
    if isinstance(response, dict) and ("Error" in response or "ResponseMetadata" in response):  # the store answered
        code = error_code(exc)
        status = (response.get("ResponseMetadata") or {}).get("HTTPStatusCode")
        head = str(getattr(exc, "operation_name", "")).startswith("Head")  # S3 answers HEAD with no body: no code
        what = f"{code or 'error'} (HTTP {status})"
        if (not code or code.isdigit()) and not head:  # every S3 error but a HEAD's carries an XML document with a code
            if isinstance(status, int) and status >= 500:  # a proxy's or gateway's page: the store behind it failed
                return RemoteIOError(url, where, OSError(errno.EIO, f"HTTP {status} without an S3 error document (a proxy or gateway answered?)"))
            return NotS3EndpointError(url, where, OSError(errno.EPROTO, f"HTTP {status} without an S3 error document: not an S3 endpoint"))
        if code in _NOT_FOUND or (code.isdigit() and status == 404):
            return RemoteNotFoundError(url, where, FileNotFoundError(errno.ENOENT, f"{what}: no such {'bucket' if code == 'NoSuchBucket' else 'object'}"))
        if code in _DENIED or status == 403:
            return RemoteAuthError(url, where, PermissionError(errno.EACCES, f"{what}: credentials or access refused"))
        if code in _CHANGED or status == 412:
            return ObjectChangedError(url, f"{op}: ETag", "the object opened", Phrase("another version (replaced or truncated since open)"))
        return RemoteIOError(url, where, OSError(errno.EIO, what))
    rows = [_transport_row(e) for e in _causes(exc)]
    rows = [r for r in rows if r is not None]
    if not rows:
        return RemoteIOError(url, where, OSError(errno.EIO, type(exc).__name__))
    _, cls, num, text = _TRANSPORT[min(rows)]
    n = f"{options.attempts} attempt{'s' if options.attempts != 1 else ''}"
    msg = text.format(t=options.timeout, ct=options.connect_timeout, n=n, cls=type(exc).__name__)
    if cls is UnsupportedFeatureError:  # refused before any request: a bucket name S3 does not allow, a bad region
        return UnsupportedFeatureError(url, op, Phrase("parameters S3 accepts"), Phrase(f"{msg}: {_first_line(exc)}"))
    return cls(url, where, (TimeoutError if cls is RemoteTimeoutError else OSError)(num, msg))


def _transport_row(e: BaseException) -> int | None:
    """The row of _TRANSPORT for one exception: by its most specific class that a row names
    (urllib3's NewConnectionError is also a ConnectTimeoutError by inheritance: its own name decides)."""
    for c in type(e).__mro__:
        for i, row in enumerate(_TRANSPORT):
            if c.__name__ in row[0]:
                return i
    return None


def _first_line(exc: BaseException) -> str:
    """botocore's own text of a local refusal (no request was made: no secret in it), shortened."""
    lines = [x.strip() for x in str(exc).splitlines() if x.strip() and not x.strip().endswith("failed:")]
    return (lines[0] if lines else type(exc).__name__)[:160]


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


_POOL_NUMBERS = itertools.count()  # each reader's GET threads are named apart (close joins its own)


class RangeReader:
    """An object's bytes by ranged GET, pinned to the version seen by the first GET."""

    def __init__(self, url: str, options: StorageOptions | None = None) -> None:
        self.url = url
        self.options = StorageOptions.of(options)
        self.bucket, self.key = parse_url(url)
        self.client = client(self.options, url)
        self._pool: cf.ThreadPoolExecutor | None = None
        self.requests = 0  # GETs sent (open latency is counted in round trips)
        _hook("open", url)
        self.requests += 1
        try:
            r = self.client.get_object(Bucket=self.bucket, Key=self.key, Range=f"bytes=0-{max(self.options.first_read, 64) - 1}")
            body = r["Body"].read()
        except Exception as e:  # noqa: BLE001
            if error_code(e) == "InvalidRange":  # an empty object
                self.size, self.etag, self.version, self._first = 0, None, None, b""
                return
            raise translate(e, url, "open", self.options) from None
        self.etag = r.get("ETag")
        self.version = r.get("VersionId")
        total = r.get("ContentRange", "").rpartition("/")[2]
        self.size = int(total) if total.isdigit() else len(body)
        self._first = body

    def _executor(self) -> cf.ThreadPoolExecutor:
        if self._pool is None:
            self._pool_name = f"hsnap-get-{next(_POOL_NUMBERS)}"
            self._pool = cf.ThreadPoolExecutor(self.options.parallel, thread_name_prefix=self._pool_name)
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

    def iter_into(self, view: memoryview, offset: int, step: int) -> Iterator[tuple[int, memoryview]]:
        """Fill ``view`` from ``offset`` in ``step``-byte ranged GETs, ``parallel`` in flight,
        yielding ``(offset, piece)`` in order as each lands: the consumer hashes a piece
        while the next ones download. Leaving early (an error, the consumer stops) cancels
        what has not started and waits for what has: nothing writes into ``view`` after."""
        view = memoryview(view).cast("B")
        n = len(view)
        if offset + n > self.size:
            raise TruncatedError(self.url, f"read at byte {offset}", offset + n, Phrase(f"{self.size} bytes"))
        step = max(1, step)
        futures = [(a, min(n, a + step)) for a in range(0, n, step)]
        futures = [(a, b, self._executor().submit(self._get, offset + a, view[a:b])) for a, b in futures]
        try:
            for a, b, f in futures:
                f.result()  # the GET's typed error
                yield offset + a, view[a:b]
        finally:
            for *_, f in futures:
                f.cancel()
            cf.wait([f for *_, f in futures])

    def check_unchanged(self) -> None:
        _hook("head", self.url)
        r = _call(self.url, "head", self.options, self.client.head_object, Bucket=self.bucket, Key=self.key)
        if r.get("ETag") != self.etag or r.get("ContentLength") != self.size:
            raise ObjectChangedError(self.url, "ETag (changed since open)", self.etag, r.get("ETag"))

    def close(self) -> None:
        pool, self._pool = self._pool, None
        if pool is not None:
            pool.shutdown(wait=True)
            # a worker whose start a KeyboardInterrupt cut short is not in the pool's list,
            # so shutdown does not join it (it exits on the pool's stop signal): join it here
            prefix = self._pool_name + "_"
            for t in threading.enumerate():
                if t.name.startswith(prefix) and t is not threading.current_thread():
                    t.join()


_HASH_PIECE = 2 << 20  # hashed right after it is copied, while still in cache


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
        # with a read-ahead running, 2 MiB at a time: each piece is hashed right after it is
        # copied out of the read-ahead, while still in cache (the next GETs run meanwhile)
        step = _HASH_PIECE if self.snap._prefetch is not None else max(len(view), 1)
        for a in range(0, len(view), step):
            piece = view[a : a + step]
            self.snap._read_ahead(self.offset + at + a, piece)
            self._h.update(piece)
        self._next += len(view)

    def finish(self) -> None:
        if self._next != self.length:
            raise TruncatedError(self.snap.path, f"sections[{self.info.name!r}]", self.length, self._next)
        got = self._h.hexdigest()
        if got != self.info.digest:
            raise DigestMismatchError(self.snap.path, f"sections[{self.info.name!r}].digest", self.info.digest, got)


READ_AHEAD_GAP = 64 << 10  # planned ranges this close in the object are fetched as one run (the padding between is read too)


class ReadAhead:
    """The byte ranges a restore will read, in the order it reads them, fetched ahead of it:
    ranged GETs of ``chunk`` bytes, at most ``depth`` submitted and not yet consumed, each
    into one of ``depth`` reused buffers — memory ``depth x chunk`` whatever the object
    size — so the next GETs run while the consumer hashes and scatters the current chunk.

    :meth:`serve` hands bytes out strictly in plan order; a read it does not hold next
    (off the plan) is left to the caller's own GET. Every GET is the reader's (pinned to
    the ETag of open). A failed GET raises from :meth:`serve` typed; :meth:`close`
    cancels what has not started and waits for what has (no GET outlives it)."""

    def __init__(self, reader: RangeReader, ranges, *, depth: int, chunk: int) -> None:
        self.reader, self.depth, self.chunk = reader, max(1, depth), max(1, chunk)
        runs: list[list[int]] = []
        for offset, length in ranges:
            if length <= 0:
                continue
            if runs and runs[-1][1] <= offset <= runs[-1][1] + READ_AHEAD_GAP:
                runs[-1][1] = max(runs[-1][1], offset + length)
            else:
                runs.append([offset, offset + length])
        self._todo = collections.deque((a, min(b, a + self.chunk)) for a0, b in runs for a in range(a0, b, self.chunk))
        self._held: collections.deque = collections.deque()  # (start, stop, buffer, future), plan order
        self._free: list[bytearray] = []
        self.submitted = 0
        self._fill()

    def _fill(self) -> None:
        while self._todo and len(self._held) < self.depth:
            a, b = self._todo.popleft()
            buf = self._free.pop() if self._free else bytearray(self.chunk)
            view = memoryview(buf)[: b - a]
            self._held.append((a, b, buf, self.reader._executor().submit(self.reader._get, a, view)))
            self.submitted += 1

    def serve(self, view: memoryview, offset: int) -> int:
        """Copy the planned bytes at ``offset`` into ``view``; how many (from its start)."""
        done, n = 0, len(view)
        while done < n and self._held:
            a, b, buf, fut = self._held[0]
            at = offset + done
            if at >= b:  # planned bytes the consumer skipped: drop them
                fut.cancel()
                cf.wait([fut])
                self._release()
                continue
            if not a <= at < b:
                break
            fut.result()  # the GET's typed error, raised here
            k = min(b - at, n - done)
            view[done : done + k] = memoryview(buf)[at - a : at - a + k]
            done += k
            if at + k == b:
                self._release()
        return done

    def _release(self) -> None:
        self._free.append(self._held.popleft()[2])  # (its GET is done) reused: fresh memory is expensive
        self._fill()

    def close(self) -> None:
        held, self._held, self._todo = list(self._held), collections.deque(), collections.deque()
        for *_, fut in held:
            fut.cancel()
        cf.wait([f for *_, f in held])  # nothing writes into a buffer after this returns
        self._free = []


class RemoteSnapshot(Snapshot):
    """A committed rank object, read by ranged GETs (no map: ``snap[name]`` copies)."""

    # restore verifies each section as it lands in the slots (one pass over the network)
    verifies_while_reading = True

    def __init__(self, url: str, *, storage_options=None, reader: RangeReader | None = None) -> None:
        self.path = url
        self._mm = None
        self._fd = -1
        self._closed = True
        self._prefetch = None
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
        self._prefetch: ReadAhead | None = None

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

    @property
    def stage_window(self) -> int:
        """Bytes per ranged GET when a restore stages this object (each hashed as it lands)."""
        return self._src.options.chunk_bytes

    def iter_into(self, view: memoryview, offset: int, step: int) -> Iterator[tuple[int, memoryview]]:
        """:meth:`RangeReader.iter_into` of this object (the GETs pinned to its ETag)."""
        if self._closed:
            raise HsnapError(self.path, "snapshot", "open", Phrase("closed"))
        return self._src.iter_into(view, offset, step)

    @contextlib.contextmanager
    def serving(self, source):
        """While the block runs, reads are served first by ``source.serve(view, offset)``
        (bytes it holds, e.g. a restore's staging buffer, already read and hashed)."""
        if self._prefetch is not None:
            yield
            return
        self._prefetch = source
        try:
            yield
        finally:
            self._prefetch = None

    @contextlib.contextmanager
    def read_ahead(self, sections):
        """While the block runs, ``sections`` (in the order they will be read through
        :meth:`section_range`) are fetched ahead of the reads (:class:`ReadAhead`:
        ``parallel`` GETs of ``chunk_bytes`` submitted ahead, memory parallel x chunk);
        on leaving, every GET still running is waited for."""
        o = self._src.options
        if self._prefetch is not None:  # one read-ahead at a time (a nested block adds nothing)
            yield self._prefetch
            return
        pf = self._prefetch = ReadAhead(self._src, [(i.offset, i.length) for i in sections], depth=o.parallel, chunk=o.chunk_bytes)
        try:
            yield pf
        finally:
            self._prefetch = None
            pf.close()

    def _read_ahead(self, offset: int, view: memoryview) -> None:
        """Sequential reads (a restore, section after section): one window of
        chunk x parallel bytes fetched in parallel serves the small sections that follow
        (a GET per small section would cost a round trip each); reads at least a window
        long go straight into ``view``. Memory: one window buffer, reused."""
        if self._prefetch is not None:
            got = self._prefetch.serve(view, offset)
            if got == len(view):
                return
            view, offset = view[got:], offset + got
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

    def verify_failures(self, *, first: bool = False) -> list[HsnapError]:
        """Every section digest and the padding, in one streaming pass of ranged GETs (not
        one GET per gap); reported in spec 7.2's order (R-7.2-3): padding first."""
        failures = [err for _, err in self.iter_verify() if err is not None]
        try:
            self.check_padding()  # answered by the pass just made
        except HsnapError as e:
            failures.insert(0, e)
        return failures[:1] if first else failures

    def close(self) -> None:
        if not getattr(self, "_closed", True):
            self._closed = True
            if self._prefetch is not None:
                self._prefetch.close()
                self._prefetch = None
            self._src.close()

    def __repr__(self) -> str:
        return f"<hsnap.RemoteSnapshot {self.path!r} v{self.version[0]}.{self.version[1]} {len(self.sections)} sections, etag {self.etag}>"


def _windows(snap: Snapshot, window: int, start: int, stop: int, into: memoryview | None) -> Iterator[tuple[int, memoryview]]:
    """``(offset, bytes)`` of [start, stop) window by window: into one reused buffer, or
    into ``into`` (bytes [start, stop) kept whole) — by ranged GETs running ahead of the
    consumer where the snapshot has them (``iter_into``), else one read per window."""
    if into is not None and getattr(snap, "iter_into", None) is not None:
        yield from snap.iter_into(into[: stop - start], start, window)
        return
    buf = None if into is not None else bytearray(min(window, max(stop - start, 0)))
    for w in range(start, stop, window):
        n = min(window, stop - w)
        yield w, snap._read(w, n, into[w - start : w - start + n] if into is not None else memoryview(buf)[:n])


def stream(snap: Snapshot, window: int, start: int, stop: int, *, each=None, cancelled=None, result: dict | None = None,
           into: memoryview | None = None):
    """Read bytes [start, stop) of ``snap`` in windows (one buffer, reused — or ``into``,
    which then holds them all), hashing every section and checking the padding as each
    window lands; yields ``(section, error or None)`` as each section ends, calls
    ``each(offset, bytes)`` per window (a copy's sink), and puts the first padding error
    (or None) in ``result["padding"]`` when the pass completes."""
    regions = sorted([(s.offset, s.offset + s.length, s) for s in snap.sections] + [(a, b, None) for a, b in snap.padding_ranges()],
                     key=lambda r: r[0])
    regions = [r for r in regions if r[1] > start or r[0] >= start]
    with contextlib.closing(_windows(snap, window, start, stop, into)) as windows:
        yield from _hash_windows(snap, windows, regions, each, cancelled, result)


def _hash_windows(snap: Snapshot, windows, regions, each, cancelled, result):
    ri, h, padding_error = 0, xxhash.xxh3_128(), None
    for w, mv in windows:
        if cancelled is not None and cancelled():
            return
        n = len(mv)
        if each is not None:
            each(w, mv)
        while ri < len(regions) and regions[ri][0] < w + n:
            a, b, s = regions[ri]
            piece = mv[max(a, w) - w : min(b, w + n) - w]
            if s is not None:
                h.update(piece)
            elif padding_error is None and np.frombuffer(piece, dtype=np.uint8).any():  # (C speed: padding adds up)
                i = int(np.flatnonzero(np.frombuffer(piece, dtype=np.uint8))[0])
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
    c = client(options, url)
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
    c = client(options, url)
    try:
        c.head_bucket(Bucket=bucket)
        return
    except Exception as e:  # noqa: BLE001
        err = translate(e, url, "head bucket", options)
        if not isinstance(err, RemoteNotFoundError):
            raise err from None
    # a HEAD answer has no body, so S3's "no such bucket" and any web server's 404 look
    # alike: a GET tells them apart (NotS3EndpointError from a server that is not S3)
    _call(url, "list bucket", options, c.list_objects_v2, Bucket=bucket, MaxKeys=1)
    raise RemoteNotFoundError(url, f"head bucket at {endpoint_shown(options)}",
                              FileNotFoundError(errno.ENOENT, "NoSuchBucket (HTTP 404): no such bucket"))


def _exists(url: str, options: StorageOptions) -> bool:
    bucket, key = parse_url(url)
    try:
        client(options, url).head_object(Bucket=bucket, Key=key)
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
        self.client = client(options, url)
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

    def complete(self) -> str:
        """Make the object visible (never over one that appeared meanwhile); its ETag."""
        parts = [{"PartNumber": n, "ETag": self._futures[n].result()} for n in sorted(self._futures)]
        _hook("complete", self.url)
        try:
            r = _call(self.url, "complete multipart upload", self.options, self.client.complete_multipart_upload, Bucket=self.bucket,
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


class RemoteSnapshotWriter(SnapshotWriter):
    """:class:`SnapshotWriter` to ``s3://bucket/key``: a streamed multipart upload whose
    completion is the commit. Memory: the first part (held for the header), the part
    being filled and ``parallel`` parts in flight."""

    publishes_by_rename = False  # nothing of it can be read before the completion publishes it

    def __init__(self, url: str, *, storage_options=None, **kw) -> None:
        self.options = StorageOptions.of(storage_options)
        self.etag: str | None = None  # of the committed object
        super().__init__(url, **kw)

    def _create(self, mode: int, preallocate: bool) -> None:
        check_final_key(self.path, self.options)
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
        # a part goes up as soon as it is full (the parts of a plain put of the same bytes):
        # the last part, however small, holds the trailer (S3 sizes only the others)
        while self._part > 1 and len(self._buf) >= p:
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
            self.etag = self._upload.complete()
        except BaseException:
            self.state = WriterState.ABORTED
            self._discard()
            raise

    def _discard(self) -> None:
        up = getattr(self, "_upload", None)
        if up is not None:
            up.abort()
            self._upload = None


class UrlSink:
    """A snapshot object written sequentially (``hsnap cp``): a multipart upload fed in
    order, never over an existing key; completion is the commit."""

    def __init__(self, url: str, options: StorageOptions) -> None:
        self.url, self.options = url, options
        check_final_key(url, options)
        if _exists(url, options):
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


def read_object(url: str, options: StorageOptions, limit: int) -> tuple[bytes, str | None]:
    """A small object whole (at most ``limit`` + 1 bytes read: more is the caller's refusal) and its ETag."""
    bucket, key = parse_url(url)
    _hook("get", url, 0, limit)
    r = _call(url, "read", options, client(options, url).get_object, Bucket=bucket, Key=key, Range=f"bytes=0-{limit}")
    try:
        return r["Body"].read(), r.get("ETag")
    except Exception as e:  # noqa: BLE001
        raise translate(e, url, "read", options) from None


def list_objects(prefix_url: str, options: StorageOptions) -> list[tuple[str, int, str | None]]:
    """``(url, size, ETag)`` of every object directly under ``prefix_url`` taken as a
    directory (one level: ``s3://b/run`` lists ``s3://b/run/x``, never ``s3://b/run2``)."""
    bucket, prefix = parse_url(prefix_url)
    if prefix and not prefix.endswith("/"):
        prefix += "/"
    objs = _list(bucket, prefix, client(options, prefix_url), options, Delimiter="/")
    return [(_url(bucket, o["Key"]), int(o.get("Size") or 0), o.get("ETag")) for o in objs if not o["Key"].endswith("/")]


def list_entries(prefix_url: str, options: StorageOptions) -> tuple[list[tuple[str, int, str | None, float]], list[str]]:
    """One level of ``prefix_url`` taken as a directory: ``(url, size, ETag, LastModified as
    seconds since the epoch)`` of every object directly under it, and the URL of every
    sub-prefix (what a directory listing calls its subdirectories)."""
    bucket, prefix = parse_url(prefix_url)
    if prefix and not prefix.endswith("/"):
        prefix += "/"
    c = client(options, prefix_url)
    objs, subs, kw = [], [], {"Bucket": bucket, "Prefix": prefix, "Delimiter": "/"}
    while True:
        r = _call(_url(bucket, prefix), "list objects", options, c.list_objects_v2, **kw)
        objs += r.get("Contents", []) or []
        subs += [p["Prefix"] for p in r.get("CommonPrefixes", []) or []]
        if not r.get("IsTruncated"):
            break
        kw["ContinuationToken"] = r["NextContinuationToken"]
    files = [(_url(bucket, o["Key"]), int(o.get("Size") or 0), o.get("ETag"), o["LastModified"].timestamp() if o.get("LastModified") else 0.0)
             for o in objs if not o["Key"].endswith("/")]
    return files, [_url(bucket, p.rstrip("/")) for p in subs]


def put_bytes(url: str, data: bytes, options: StorageOptions, *, no_overwrite: bool = True) -> str:
    """One small object in one PUT (the manifest, the pending marker); never overwrites
    when the store honours ``If-None-Match``. Returns the ETag."""
    bucket, key = parse_url(url)
    _hook("put", url, 0, len(data))
    kw = {"IfNoneMatch": "*"} if no_overwrite else {}
    try:
        return _call(url, "put", options, client(options, url).put_object, Bucket=bucket, Key=key, Body=data, **kw)["ETag"]
    except ObjectChangedError:  # If-None-Match refused: the key is taken
        raise SnapshotExistsError(url, "key", "no object", Phrase("one exists")) from None


def delete(url: str, options: StorageOptions, *, etag: str | None = None) -> None:
    """Delete one object; with ``etag``, only that version of it (``If-Match``: SeaweedFS
    and AWS S3 refuse the delete of an object replaced since; a store that ignores the
    header deletes whatever is there)."""
    bucket, key = parse_url(url)
    kw = {"IfMatch": etag} if etag else {}
    _call(url, "delete", options, client(options, url).delete_object, Bucket=bucket, Key=key, **kw)


def check_final_key(url: str, options: StorageOptions) -> None:
    """Refuse a key a writer may not commit (spec 8.1, writers): a name of a temporary's
    form, a missing bucket, or a key inside an unfinished set's prefix (one holding
    ``.hsnap-pending``) other than that set's own ``rank-N.hsnap`` / ``manifest.json`` —
    such a prefix is gc's to look at, and nothing committed belongs in it."""
    bucket, key = parse_url(url)
    _fs.check_final_name(key or "x")
    _require_bucket(url, options)
    d, _, name = key.rpartition("/")
    if not _fs.is_set_member(name) and _exists(_url(bucket, f"{d}/{PENDING_MARKER}" if d else PENDING_MARKER), options):
        raise ReservedNameError(url, "prefix", Phrase(f"no {PENDING_MARKER!r} beside a final key (a prefix holding it is an unfinished "
                                                      "set's: a set being written, or one killed; hsnap gc lists it)"), _url(bucket, d))


class RemoteSetWriter:
    """A TP set under ``s3://bucket/prefix``: ``PREFIX/.hsnap-pending`` first, rank
    objects (each a :class:`RemoteSnapshotWriter` to :meth:`rank_path`), then
    ``manifest.json`` (the commit of the set), then the marker goes."""

    def __init__(self, url: str, *, storage_options=None) -> None:
        self.path = url.rstrip("/")
        self.options = StorageOptions.of(storage_options)
        _fs.check_final_name(parse_url(self.path)[1] or "x")
        check_final_key(f"{self.path}/{MANIFEST_NAME}", self.options)
        if _exists(f"{self.path}/{MANIFEST_NAME}", self.options):
            raise SnapshotExistsError(self.path, MANIFEST_NAME, "no committed set", Phrase("one exists"))
        try:  # never over another writer's marker: two sets in one prefix would mix their ranks
            self._marker_etag = put_bytes(f"{self.path}/{PENDING_MARKER}", PENDING_MARKER_TEXT, self.options)
        except SnapshotExistsError:
            raise ReservedNameError(self.path, PENDING_MARKER, Phrase("no unfinished set in the prefix"), Phrase(
                "a marker of one (a set being written, or one killed: hsnap gc lists it)")) from None
        self.written: list[tuple[str, str | None]] = []  # (url, ETag) of each object this writer committed
        self._writers: list[RemoteSnapshotWriter] = []

    def rank_path(self, rank: int) -> str:
        return f"{self.path}/{rank_file_name(rank)}"

    def rank_writer(self, rank: int, **kw) -> RemoteSnapshotWriter:
        w = RemoteSnapshotWriter(self.rank_path(rank), storage_options=self.options, **kw)
        self._writers.append(w)
        return w

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
            delete(f"{self.path}/{PENDING_MARKER}", self.options, etag=self._marker_etag)
        except HsnapError:
            pass  # the set is committed (the manifest wins over a marker left behind; gc removes it)
        return manifest

    def abort(self) -> None:
        """Remove what this writer itself committed — by ETag, never by name: a key that
        was someone else's (the rank writer refused it) stays — then the marker. A store
        that does not answer ends the clean-up at once (gc finds the rest later)."""
        done = self.written + [(w.path, w.etag) for w in self._writers if w.etag]
        for url, etag in done + [(f"{self.path}/{PENDING_MARKER}", self._marker_etag)]:
            try:
                delete(url, self.options, etag=etag)
            except RemoteIOError as e:
                if not isinstance(e, RemoteNotFoundError):
                    return
            except HsnapError:
                pass


# ---------------------------------------------------------------- gc

DEFAULT_URL_GC_AGE = 900.0  # a write younger than this may be running (on another host: no pid to check)
UPLOAD, FILE, MARKER, OBJECT = "upload", "file", "marker", "object"  # what a URL gc lists, by kind


def collect_url(url: str, *, remove: bool = False, older_than: float | None = None, storage_options=None,
                announce=None) -> list[Leftover]:
    """Leftovers of interrupted writes under ``url`` (a bucket, or a prefix taken as a
    directory), each proved one by one — a committed object is never removed, whatever
    its key (spec 8.1, on an object store):

    * ``upload``: an in-progress multipart upload — never visible, so provably no
      committed object; its size is the sum of its parts. Removable (aborted);
    * ``file``: an object whose key has a temporary's name, or a ``rank-N.hsnap`` of an
      unfinished set, proved unfinished by its bytes (empty, or ``PENDING_MAGIC`` at
      byte 0). Removable. A complete object (the hsnap magic) is listed and kept;
    * ``marker``: an unfinished set's ``.hsnap-pending`` (hsnap's text, no
      ``manifest.json`` beside it). Removable once nothing of the set is left beside it
      but what this run removes: while a complete rank object stays, so does the marker
      (that proof of the set would otherwise be lost); a marker beside a manifest (the
      set committed, its clean-up failed) is removable too;
    * ``object``: anything else beside a marker or beside rank objects without a
      manifest: listed with the reason it stays.

    Removable means also older than ``older_than`` seconds (default
    ``DEFAULT_URL_GC_AGE``): a running export on another host records no pid. With
    ``remove``, ``announce(path, bytes)`` is called right before each removal (as local
    gc's: the CLI prints each with its size); an object is deleted with ``If-Match`` its ETag at the
    proof, so one replaced since is refused by the store, not deleted; markers go last.
    """
    options = StorageOptions.of(storage_options)
    bucket, prefix = parse_url(url)
    if prefix and not prefix.endswith("/"):
        prefix += "/"  # a directory: s3://b/run never reaches s3://b/run2/
    c = client(options, url)
    age_limit = DEFAULT_URL_GC_AGE if older_than is None else older_than
    now = time.time()
    uploads = _upload_items(bucket, prefix, c, options, age_limit, now)
    objects = _object_items(bucket, prefix, c, options, age_limit, now, uploads)
    items = sorted(uploads + objects, key=lambda i: (i.path, i.kind))
    for m in items:  # a marker stays while anything of its set does (it is their proof)
        if m.kind == MARKER and m.removable and _keeps_marker(m, items, lambda i: not i.removable):
            m.removable = False
    removing = [i for i in items if i.removable]
    for item in sorted(removing, key=lambda i: i.kind == MARKER):  # markers last: the proof of what is left
        if not remove:
            item.action = "would remove"
            continue
        if item.kind == MARKER and not _marker_still_alone(item, items, bucket, c, options):
            continue
        if announce is not None:
            announce(item.path, item.bytes)
        _remove_item(item, bucket, c, options)
    return items


def _upload_items(bucket, prefix, c, options, age_limit, now) -> list[Leftover]:
    out: list[Leftover] = []
    kw: dict[str, Any] = {"Bucket": bucket, "Prefix": prefix}
    while True:
        r = _call(_url(bucket, prefix), "list multipart uploads", options, c.list_multipart_uploads, **kw)
        for u in r.get("Uploads", []) or []:
            size = _upload_size(bucket, u["Key"], u["UploadId"], c, options)
            if size is None:
                continue  # completed or aborted since the listing
            age = max(0.0, now - u["Initiated"].timestamp())
            item = Leftover(path=_url(bucket, u["Key"]) + f"?uploadId={u['UploadId']}", kind=UPLOAD, final=_url(bucket, u["Key"]),
                            age_s=age, bytes=size, removable=age >= age_limit,
                            reason="in-progress multipart upload (never visible: not a committed object)"
                            + ("" if age >= age_limit else f"; younger than {age_limit:g} s: may be running"))
            item._ref = (u["Key"], u["UploadId"])
            out.append(item)
        if not r.get("IsTruncated"):
            return out
        kw.update(KeyMarker=r.get("NextKeyMarker"), UploadIdMarker=r.get("NextUploadIdMarker"))


def _upload_size(bucket, key, upload_id, c, options) -> int | None:
    """The bytes an in-progress upload holds (the sum of its parts), None when it is gone."""
    total, kw = 0, {"Bucket": bucket, "Key": key, "UploadId": upload_id}
    while True:
        try:
            r = _call(_url(bucket, key), "list parts", options, c.list_parts, **kw)
        except RemoteNotFoundError:
            return None
        total += sum(int(p.get("Size") or 0) for p in r.get("Parts", []) or [])
        if not r.get("IsTruncated"):
            return total
        kw["PartNumberMarker"] = r.get("NextPartNumberMarker")


def _list(bucket: str, prefix: str, c, options, **extra) -> list[dict]:
    objs, kw = [], {"Bucket": bucket, "Prefix": prefix, **extra}
    while True:
        r = _call(_url(bucket, prefix), "list objects", options, c.list_objects_v2, **kw)
        objs += r.get("Contents", []) or []
        if not r.get("IsTruncated"):
            return objs
        kw["ContinuationToken"] = r["NextContinuationToken"]


def _head(bucket: str, key: str, c, options, n: int) -> tuple[bytes | None, str | None]:
    """The first ``n`` bytes of an object and the ETag of the version read; (None, None)
    when it went away or changed while examined."""
    url = _url(bucket, key)
    try:
        r = c.get_object(Bucket=bucket, Key=key, Range=f"bytes=0-{n - 1}")
        return r["Body"].read(n + 1), r.get("ETag")
    except Exception as e:  # noqa: BLE001
        err = translate(e, url, "read", options)
        if isinstance(err, RemoteNotFoundError) and "bucket" not in (err.os_error.strerror or ""):
            return None, None
        if error_code(e) != "InvalidRange":
            raise err from None
    try:  # no byte 0: empty, then its ETag from a HEAD (an object that grew since is not proved)
        r = c.head_object(Bucket=bucket, Key=key)
    except Exception as e:  # noqa: BLE001
        err = translate(e, url, "head", options)
        if isinstance(err, RemoteNotFoundError):
            return None, None
        raise err from None
    return (b"", r.get("ETag")) if r.get("ContentLength") == 0 else (None, None)


def _object_items(bucket, prefix, c, options, age_limit, now, uploads) -> list[Leftover]:
    by_dir: dict[str, dict[str, dict]] = {}
    for o in _list(bucket, prefix, c, options):
        d, _, name = o["Key"].rpartition("/")
        by_dir.setdefault(d, {})[name] = o
    uploads_in: dict[str, list[Leftover]] = {}
    for u in uploads:
        uploads_in.setdefault(u._ref[0].rpartition("/")[0], []).append(u)
    out: list[Leftover] = []
    for d, names in sorted(by_dir.items()):
        marker = names.get(PENDING_MARKER)
        committed = MANIFEST_NAME in names
        ranks = sorted(n for n in names if RANK_FILE_RE.match(n))
        unfinished = marker is not None and not committed  # a set's prefix before its manifest
        orphans = not committed and marker is None and bool(ranks)
        for name, o in sorted(names.items()):
            key = o["Key"]
            parsed = parse_name(name)
            temp = parsed is not None and parsed[0] == GC_FILE
            if not (temp or unfinished or orphans or name == PENDING_MARKER):
                continue  # an object where no write was interrupted: not a leftover
            item = Leftover(path=_url(bucket, key), kind=OBJECT, final=_url(bucket, key), bytes=int(o.get("Size") or 0),
                            age_s=max(0.0, now - o["LastModified"].timestamp()))
            if temp:
                item.final = _url(bucket, f"{d}/{parsed[1]}" if d else parsed[1])
            if name == PENDING_MARKER:
                item.kind = MARKER
                _prove_marker(item, bucket, key, c, options, age_limit, committed, ranks, names, uploads_in.get(d, []), now)
            elif temp or (unfinished and RANK_FILE_RE.match(name)):
                item.kind = FILE
                _prove_file(item, bucket, key, c, options, age_limit, "an unfinished set's rank object" if not temp else "a temporary's name")
            elif orphans and RANK_FILE_RE.match(name):
                item.reason = "rank object with neither manifest.json nor the pending marker beside it: not proved unfinished, kept"
            else:
                head, _ = _head(bucket, key, c, options, len(MAGIC))
                what = "a complete snapshot (hsnap magic at byte 0)" if head == MAGIC else "not an hsnap snapshot"
                where = "an unfinished set (pending marker, no manifest.json)" if unfinished else "rank objects without manifest.json"
                item.reason = f"{what} beside {where}, not one of its entries: never removed"
            out.append(item)
    return out


def _prove_file(item: Leftover, bucket, key, c, options, age_limit, why) -> None:
    head, etag = _head(bucket, key, c, options, len(PENDING_MAGIC))
    if head is None:
        item.reason = f"{why}, but it went away or changed while examined: not proved, kept"
    elif etag and head in (b"", PENDING_MAGIC):  # the ETag: what the delete is conditional on
        item.removable = item.age_s >= age_limit
        item.reason = f"{why}, {'empty' if not head else 'PENDING_MAGIC at byte 0'}: an unfinished write" + (
            "" if item.removable else f"; younger than {age_limit:g} s: may be running")
        item._ref = etag
    elif head == MAGIC:
        item.reason = f"{why}, but complete (hsnap magic at byte 0): not proved unfinished, kept; delete it by hand if it is abandoned"
    else:
        item.reason = f"{why}, but no unfinished-write mark at byte 0: not proved unfinished, kept"


def _prove_marker(item: Leftover, bucket, key, c, options, age_limit, committed, ranks, names, uploads, now) -> None:
    head, etag = _head(bucket, key, c, options, len(PENDING_MARKER_TEXT) + 1)
    if head != PENDING_MARKER_TEXT or not etag:
        item.reason = "named like the pending marker, but its content is not hsnap's (or it changed while examined): kept"
        return
    item._ref = etag
    if committed:
        item.removable = item.age_s >= age_limit
        item.reason = "pending marker beside manifest.json: its set committed, the marker's removal failed"
    else:
        newest = max([o["LastModified"].timestamp() for n, o in names.items() if n == PENDING_MARKER or n in ranks]
                     + [now - u.age_s for u in uploads])
        item.age_s = max(0.0, now - newest)  # the set's newest write, not the marker's alone
        item.removable = item.age_s >= age_limit
        item.reason = "pending marker of an unfinished set (no manifest.json)"
    if not item.removable:
        item.reason += f"; the set was written to less than {age_limit:g} s ago: may be running"
    item._set = (ranks, uploads)


def _keeps_marker(marker: Leftover, items: list[Leftover], stays) -> bool:
    """True (and the reason noted) when an entry of the marker's set — an upload in its
    prefix, a rank object beside it — ``stays``."""
    ranks, uploads = marker._set
    d = marker.path.rpartition("/")[0]
    staying = [i for i in items if stays(i) and (any(i is u for u in uploads)
                                                 or (i.kind == FILE and i.path.rpartition("/") in ((d, "/", r) for r in ranks)))]
    if staying:
        n = len(staying)
        marker.reason += f"; kept while {n} entr{'y' if n == 1 else 'ies'} of the set stay{'s' if n == 1 else ''} (the marker is their proof)"
    return bool(staying)


def _marker_still_alone(item: Leftover, items: list[Leftover], bucket, c, options) -> bool:
    """Right before removing a marker: nothing of its set stayed behind (a removal that
    failed), and a new listing shows no rank object the scan did not see (a writer at
    work). A manifest that appeared meanwhile only makes the marker stale."""
    if _keeps_marker(item, items, lambda i: i.action not in ("removed", "gone")):
        item.action = "kept"
        return False
    ranks, _ = item._set
    d = parse_url(item.path)[1].rpartition("/")[0]
    listed = (o["Key"].rpartition("/")[2] for o in _list(bucket, f"{d}/" if d else "", c, options, Delimiter="/"))
    appeared = sorted(n for n in listed if RANK_FILE_RE.match(n) and n not in ranks)
    if appeared:
        item.action, item.reason = "kept", item.reason + f"; {', '.join(appeared)} appeared since the scan (a writer at work): kept"
        return False
    return True


def _remove_item(item: Leftover, bucket, c, options) -> None:
    try:
        if item.kind == UPLOAD:
            key, upload_id = item._ref
            _call(item.path, "abort multipart upload", options, c.abort_multipart_upload, Bucket=bucket, Key=key, UploadId=upload_id)
        else:  # only the version proved: a store that honours If-Match refuses a replaced object
            delete(item.path, options, etag=item._ref)
        item.action = "removed"
    except RemoteNotFoundError:
        item.action, item.reason = "gone", item.reason + "; completed, aborted or removed meanwhile"
    except ObjectChangedError:
        item.action, item.reason = "failed", item.reason + "; replaced since it was proved (ETag): kept"
    except HsnapError as e:
        item.action, item.reason = "failed", item.reason + f"; {type(e).__name__}: {e}"


__all__ = [
    "RemoteIOError", "RemoteNotFoundError", "RemoteAuthError", "RemoteTimeoutError", "NotS3EndpointError", "ObjectChangedError",
    "StorageOptions", "RangeReader", "RemoteSnapshot", "RemoteSnapshotSet", "RemoteSnapshotWriter", "RemoteSetWriter",
    "MultipartUpload", "UrlSink", "open_url", "collect_url", "parse_url", "read_object", "list_objects", "list_entries",
]
