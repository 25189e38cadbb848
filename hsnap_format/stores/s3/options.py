"""An object store's URLs and options: ``s3://bucket/key`` parsed, :class:`StorageOptions`
(endpoint, credentials, time bounds, part and chunk sizes) checked once, endpoints resolved."""

from __future__ import annotations

import os
import re
import urllib.parse
from collections.abc import Mapping
from dataclasses import dataclass, fields
from typing import Any

from ...errors import (
    Phrase,
    UnsupportedFeatureError,
)

FIRST_READ = 64 << 10  # preamble + header in one GET when the header fits (most do)


MIN_PART = 5 << 20  # S3's minimum for every part but the last


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
            source: str | None
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
        assert self.retries is not None  # __post_init__ sets every wait knob
        return self.retries + 1

    @property
    def request_bound_s(self) -> float:
        """The longest one request waits for a store that does not answer: every attempt
        connects (``connect_timeout``) and waits for bytes (``timeout``), with botocore's
        back-off before each retry. A store that accepts and never answers costs
        ``attempts x timeout`` plus the back-off."""
        assert self.retries is not None and self.connect_timeout is not None and self.timeout is not None  # as in attempts
        backoff = sum(min(2.0**i, _MAX_BACKOFF) for i in range(self.retries))
        return self.attempts * (self.connect_timeout + self.timeout) + backoff

    def __repr__(self) -> str:  # never the secret
        shown = {f.name: getattr(self, f.name) for f in fields(self) if f.name not in ("secret", "token", "key")}
        return f"StorageOptions({', '.join(f'{k}={v!r}' for k, v in shown.items())}, credentials={'given' if self.key else 'standard'})"

    @classmethod
    def of(cls, options: Mapping[str, Any] | StorageOptions | None) -> "StorageOptions":
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


def redact(endpoint: str) -> str:
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
            raise UnsupportedFeatureError(None, source, Phrase("http://host:port or https://host[:port]"), redact(value) if "://" in value else value)
        return value, source
    return None, "AWS"


def astuple_key(options: StorageOptions) -> tuple:
    # what the environment supplies is part of the client too (tests switch it in one process)
    env = tuple(os.environ.get(k) for k in ("AWS_ENDPOINT_URL_S3", "AWS_ENDPOINT_URL", "AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY",
                                            "AWS_PROFILE", "AWS_REGION", "AWS_DEFAULT_REGION"))
    return tuple(getattr(options, f.name) for f in fields(options)) + env


__all__ = ["FIRST_READ", "MIN_PART", "StorageOptions", "astuple_key", "parse_url", "redact", "resolve_endpoint"]
