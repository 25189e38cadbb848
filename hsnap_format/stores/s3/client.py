"""The S3 client and the small requests every other module builds on: typed errors
(:func:`translate`), one bounded call (:func:`call`, where tests inject faults through
``fault_hook``), small objects whole (read, put without overwriting, delete by ETag),
listings, and the checks before a write."""

from __future__ import annotations

import errno
import os
import threading
from typing import Any

from ... import localfs
from ...errors import (
    DigestMismatchError,
    HsnapError,
    HsnapIOError,
    Phrase,
    ReservedNameError,
    SnapshotExistsError,
    UnsupportedFeatureError,
)
from ...spec import (
    PENDING_MARKER,
)
from .options import StorageOptions, astuple_key, parse_url, redact, resolve_endpoint

# Tests set this to a callable ``(operation, url, offset, length)`` to inject faults
# (kill or stop the server at a chosen request), as ``localfs.phase_hook`` on disk.
fault_hook = None


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


def endpoint_shown(options: StorageOptions) -> str:
    """The endpoint requests go to, for messages (never credentials)."""
    try:
        endpoint, _ = resolve_endpoint(options)
    except HsnapError:
        return "<invalid endpoint>"
    if endpoint is None:
        c = _CLIENTS.get(astuple_key(options))
        return redact(c.meta.endpoint_url) if c is not None else "AWS S3"
    return redact(endpoint)


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
    todo: list[BaseException | None] = [exc]
    while todo and len(out) < 16:
        e = todo.pop(0)
        if e is None or any(e is x for x in out):
            continue
        out.append(e)
        kw = getattr(e, "kwargs", None)
        wrapped = kw.get("error") if isinstance(kw, dict) else None
        todo += [wrapped if isinstance(wrapped, BaseException) else None, e.__cause__, e.__context__]
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
    rows = [r for r in map(_transport_row, _causes(exc)) if r is not None]
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


def call(url: str, op: str, options: StorageOptions, fn, **kw):
    try:
        return fn(**kw)
    except Exception as e:  # noqa: BLE001 - every failure becomes a typed HsnapError
        raise translate(e, url, op, options) from None


def fault_point(op: str, url: str, offset: int = 0, length: int = 0) -> None:
    if fault_hook is not None:
        fault_hook(op, url, offset, length)


def object_url(bucket: str, key: str) -> str:
    return f"s3://{bucket}/{key}"


def get_small(url: str, options: StorageOptions, limit: int) -> bytes:
    bucket, key = parse_url(url)
    c = client(options, url)
    fault_point("get", url, 0, limit)
    r = call(url, "read", options, c.get_object, Bucket=bucket, Key=key, Range=f"bytes=0-{limit}")
    try:
        return r["Body"].read()
    except Exception as e:  # noqa: BLE001
        raise translate(e, url, "read", options) from None


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
    call(url, "list bucket", options, c.list_objects_v2, Bucket=bucket, MaxKeys=1)
    raise RemoteNotFoundError(url, f"head bucket at {endpoint_shown(options)}",
                              FileNotFoundError(errno.ENOENT, "NoSuchBucket (HTTP 404): no such bucket"))


def exists(url: str, options: StorageOptions) -> bool:
    bucket, key = parse_url(url)
    try:
        client(options, url).head_object(Bucket=bucket, Key=key)
        return True
    except Exception as e:  # noqa: BLE001
        err = translate(e, url, "head", options)
        if isinstance(err, RemoteNotFoundError) and "bucket" not in (err.os_error.strerror or ""):
            return False
        raise err from None


def read_object(url: str, options: StorageOptions, limit: int) -> tuple[bytes, str | None]:
    """A small object whole (at most ``limit`` + 1 bytes read: more is the caller's refusal) and its ETag."""
    bucket, key = parse_url(url)
    fault_point("get", url, 0, limit)
    r = call(url, "read", options, client(options, url).get_object, Bucket=bucket, Key=key, Range=f"bytes=0-{limit}")
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
    objs = list_all(bucket, prefix, client(options, prefix_url), options, Delimiter="/")
    return [(object_url(bucket, o["Key"]), int(o.get("Size") or 0), o.get("ETag")) for o in objs if not o["Key"].endswith("/")]


def list_entries(prefix_url: str, options: StorageOptions) -> tuple[list[tuple[str, int, str | None, float]], list[str]]:
    """One level of ``prefix_url`` taken as a directory: ``(url, size, ETag, LastModified as
    seconds since the epoch)`` of every object directly under it, and the URL of every
    sub-prefix (what a directory listing calls its subdirectories)."""
    bucket, prefix = parse_url(prefix_url)
    if prefix and not prefix.endswith("/"):
        prefix += "/"
    c = client(options, prefix_url)
    objs: list[dict] = []
    subs: list[str] = []
    kw = {"Bucket": bucket, "Prefix": prefix, "Delimiter": "/"}
    while True:
        r = call(object_url(bucket, prefix), "list objects", options, c.list_objects_v2, **kw)
        objs += r.get("Contents", []) or []
        subs += [p["Prefix"] for p in r.get("CommonPrefixes", []) or []]
        if not r.get("IsTruncated"):
            break
        kw["ContinuationToken"] = r["NextContinuationToken"]
    files = [(object_url(bucket, o["Key"]), int(o.get("Size") or 0), o.get("ETag"), o["LastModified"].timestamp() if o.get("LastModified") else 0.0)
             for o in objs if not o["Key"].endswith("/")]
    return files, [object_url(bucket, p.rstrip("/")) for p in subs]


def put_bytes(url: str, data: bytes, options: StorageOptions, *, no_overwrite: bool = True) -> str:
    """One small object in one PUT (the manifest, the pending marker); never overwrites
    when the store honours ``If-None-Match``. Returns the ETag."""
    bucket, key = parse_url(url)
    fault_point("put", url, 0, len(data))
    kw = {"IfNoneMatch": "*"} if no_overwrite else {}
    try:
        return call(url, "put", options, client(options, url).put_object, Bucket=bucket, Key=key, Body=data, **kw)["ETag"]
    except ObjectChangedError:  # If-None-Match refused: the key is taken
        raise SnapshotExistsError(url, "key", "no object", Phrase("one exists")) from None


def delete(url: str, options: StorageOptions, *, etag: str | None = None) -> None:
    """Delete one object; with ``etag``, only that version of it (``If-Match``: SeaweedFS
    and AWS S3 refuse the delete of an object replaced since; a store that ignores the
    header deletes whatever is there)."""
    bucket, key = parse_url(url)
    kw = {"IfMatch": etag} if etag else {}
    call(url, "delete", options, client(options, url).delete_object, Bucket=bucket, Key=key, **kw)


def check_final_key(url: str, options: StorageOptions) -> None:
    """Refuse a key a writer may not commit (spec 8.1, writers): a name of a temporary's
    form, a missing bucket, or a key inside an unfinished set's prefix (one holding
    ``.hsnap-pending``) other than that set's own ``rank-N.hsnap`` / ``manifest.json`` —
    such a prefix is gc's to look at, and nothing committed belongs in it."""
    bucket, key = parse_url(url)
    localfs.check_final_name(key or "x")
    _require_bucket(url, options)
    d, _, name = key.rpartition("/")
    if not localfs.is_set_member(name) and exists(object_url(bucket, f"{d}/{PENDING_MARKER}" if d else PENDING_MARKER), options):
        raise ReservedNameError(url, "prefix", Phrase(f"no {PENDING_MARKER!r} beside a final key (a prefix holding it is an unfinished "
                                                      "set's: a set being written, or one killed; hsnap gc lists it)"), object_url(bucket, d))


def list_all(bucket: str, prefix: str, c, options, **extra) -> list[dict]:
    objs: list[dict] = []
    kw = {"Bucket": bucket, "Prefix": prefix, **extra}
    while True:
        r = call(object_url(bucket, prefix), "list objects", options, c.list_objects_v2, **kw)
        objs += r.get("Contents", []) or []
        if not r.get("IsTruncated"):
            return objs
        kw["ContinuationToken"] = r["NextContinuationToken"]


__all__ = ["NotS3EndpointError", "ObjectChangedError", "RemoteAuthError", "RemoteIOError", "RemoteNotFoundError", "RemoteTimeoutError", "call", "check_final_key", "client", "delete", "endpoint_shown", "error_code", "exists", "fault_hook", "fault_point", "get_small", "list_all", "list_entries", "list_objects", "object_url", "put_bytes", "read_object", "translate"]
