"""What the plug-in refuses, and how a refusal travels: a typed :class:`hsnap_format.HsnapError` in the scheduler,
a plain dict over SGLang's IPC (:func:`error_dict`), an HTTP error status with that dict as the JSON body
(``{"error": {...}}``), a :class:`hsnap_sglang.client.ServerError` in the client.  Imports no SGLang."""

from __future__ import annotations

import math
import re
from typing import Any

from hsnap_format import errors as hf_errors
from hsnap_format.errors import HsnapError


class RequestError(HsnapError):
    """A refusal about a request of the server, named by its rid: without a file, its message starts at the field
    (``rid: ...``), not at a ``<memory>`` path."""

    def _message(self) -> str:
        text = super()._message()
        return text if self.path is not None else text.split(": ", 1)[1]


class UnknownRequestError(RequestError):
    """No request with this rid in the server (not running, queued nor being prefilled)."""


MAX_RIDS_NAMED = 8  # an unknown rid's refusal names at most this many of the server's requests


def unknown_request(rid: str, here: list[str], expected: str) -> UnknownRequestError:
    """The refusal of ``rid``, which no request of the server has: it names the requests the server has (a few, and
    the closest rid to the one asked for), so a typo is seen at once."""
    import difflib

    if not here:
        detail = "no request is running, queued or being prefilled here"
    else:
        shown = ", ".join(capped(r, 64) for r in here[:MAX_RIDS_NAMED])
        more = f" and {len(here) - MAX_RIDS_NAMED} more" if len(here) > MAX_RIDS_NAMED else ""
        close = difflib.get_close_matches(rid, here, n=1)
        detail = f"here: {shown}{more}" + (f" (did you mean {capped(close[0], 64)!r}?)" if close else "")
    return UnknownRequestError(None, "rid", hf_errors.Phrase(expected), rid, detail=detail)


class RequestFinishedError(RequestError):
    """The request finished (stop, length, abort) before it reached the export boundary: nothing to export."""


class RequestBusyError(RequestError):
    """Another hsnap operation already holds the request (an export in progress), or the rid is in use here."""


class PluginError(HsnapError):
    """The server could not do what was asked for a reason of its own (an unexpected exception, logged)."""


class BadRequestError(HsnapError):
    """A request body the routes refuse before anything runs: not a JSON object, too large, too deep, a field of
    another type, a text with a NUL byte or a lone surrogate, or over its length cap."""


class ServerBusyError(HsnapError):
    """A bounded resource of the server is in use to its limit (concurrent follows): retry later."""


class RelayError(HsnapError):
    """A relayed migration's target (another server) refused the follow, could not be reached, or its stream broke
    before the request finished there; ``remote`` is the target's own error when it sent one."""

    status_code = 502  # what SGLang's /generate stream puts in its error event's "code"

    def __init__(self, path, field, expected=None, found=None, detail=None, remote: dict | None = None) -> None:
        super().__init__(path, field, expected, found, detail)
        self.remote = remote

    def __reduce__(self):
        return (type(self), (self.path, self.field, self.expected, self.found, self.detail, self.remote))


class RemoteRankError(HsnapError):
    """Another TP rank refused; ``remote`` is its error (:func:`error_dict`), which the HTTP answer carries."""

    def __init__(self, rank: int, remote: dict) -> None:
        self.rank, self.remote = rank, dict(remote, tp_rank=rank)
        super().__init__(remote.get("path"), f"tp rank {rank}: {remote.get('field') or remote.get('type')}",
                         detail=f"{remote.get('type')}: {remote.get('message')}")

    def __reduce__(self):
        return (type(self), (self.rank, self.remote))


# the first class in the MRO of an error that has a row here gives the HTTP status
STATUS: dict[str, int] = {
    "UnknownRequestError": 404,
    "HsnapIOError": 404,  # an unknown path (or unreadable: the message says which)
    "RemoteNotFoundError": 404,
    "ConfinementError": 403,  # a path or URL outside the snapshot root / allowed prefixes (or none configured)
    "RequestFinishedError": 409,
    "RequestBusyError": 409,
    "SnapshotExistsError": 409,
    "SnapshotClaimedError": 409,  # resumed once already (hsnap_sglang.claims): again only on purpose
    "CapacityError": 409,  # a full target: retry later or elsewhere
    "UnsupportedRequestError": 422,  # a request hsnap cannot carry
    "IncompatibleSnapshotError": 422,  # intact, but not for this server (identity, layout, geometry, binding)
    "UnsupportedVersionError": 422,
    "UnsupportedFeatureError": 422,
    "ReservedNameError": 400,
    "MalformedError": 400,  # malformed header / manifest / record
    "DigestMismatchError": 400,
    "TruncatedError": 400,
    "BadMagicError": 400,
    "RemoteIOError": 502,
    "MigrationError": 504,  # the other side of a live migration did not do its part in time (or gave up)
    "RelayError": 502,  # the peer server a migration relays from refused or went away
    "PluginError": 500,
    "BadRequestError": 400,
    "ServerBusyError": 429,
    "HsnapError": 400,
}


def status_of(error_type_mro: list[str]) -> int:
    return next((STATUS[name] for name in error_type_mro if name in STATUS), 500)


ECHO_CHARS = 200  # an error answer repeats at most this much of any value it names (a 10 MB rid is not sent back)
MESSAGE_CHARS = 4000  # the one-line message and ``detail`` (they name every differing field)


# the object store's endpoint as hsnap_format.stores.s3 names it in its errors ("get at http://10.0.0.5:8333"): an
# operator's internal address, not for the server's HTTP clients
_ENDPOINT = re.compile(r"\bhttps?://[^\s/:]+(?::\d+)?(?:/[^\s:]*)?")
ENDPOINT_SHOWN = "<the object store>"


def capped(text: str, limit: int = ECHO_CHARS) -> str:
    """``text`` cut to ``limit`` characters, saying how long it was; no store endpoint in it; a lone surrogate (a
    client's ``"\ud800"``, which no UTF-8 answer can carry) written as its escape."""
    text = _ENDPOINT.sub(ENDPOINT_SHOWN, text) if "://" in text else text
    text = text if len(text) <= limit else f"{text[:limit]}…({len(text)} chars)"
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        text = text.encode("utf-8", "backslashreplace").decode("utf-8")
    return text


def _plain(v: Any, depth: int = 0) -> Any:
    """A value for JSON: scalars as they are (texts capped), containers recursively (a few levels, a few items),
    anything else as its (capped) text."""
    if v is None or isinstance(v, (bool, int)):
        return v if not isinstance(v, int) or v.bit_length() <= 64 else capped(str(v))
    if isinstance(v, str):
        return capped(v)
    if depth >= 4:
        return capped(str(v))
    if isinstance(v, float):
        return v if math.isfinite(v) else str(v)
    if isinstance(v, (list, tuple)):
        return [_plain(x, depth + 1) for x in v[:32]]
    if isinstance(v, dict):
        return {capped(str(k)): _plain(x, depth + 1) for k, x in list(v.items())[:32]}
    return capped(str(v))


def error_dict(e: BaseException, **extra) -> dict:
    """A refusal as plain values: ``type`` (the class name), ``status``, ``message`` (one line), ``path``,
    ``field``, ``expected``, ``found``, ``differences`` (IncompatibleSnapshotError), ``mro``."""
    mro = [c.__name__ for c in type(e).__mro__ if issubclass(c, BaseException)]
    text = str(e)
    message = text.splitlines()[0] if text else type(e).__name__
    d = {"type": type(e).__name__, "mro": mro, "status": status_of(mro), "message": capped(message, MESSAGE_CHARS)}
    if isinstance(e, HsnapError):
        d.update(path=_plain(e.path), field=_plain(e.field), expected=_plain(e.expected), found=_plain(e.found),
                 detail=None if e.detail is None else capped(str(e.detail), MESSAGE_CHARS))
        if isinstance(e, RelayError) and e.remote:
            d["remote"] = {k: _plain(e.remote.get(k)) for k in ("type", "status", "message", "field") if k in e.remote}
        if isinstance(e, hf_errors.IncompatibleSnapshotError):
            d["differences"] = [[_plain(f), _plain(x), _plain(y)] for f, x, y in e.differences[:32]]
    d.update(extra)
    return d


def error_of(e: BaseException) -> dict:
    """:func:`error_dict` of ``e``; another rank's refusal as that rank sent it."""
    return dict(e.remote) if isinstance(e, RemoteRankError) else error_dict(e)


__all__ = ["RequestError", "unknown_request", "MAX_RIDS_NAMED", "UnknownRequestError", "RequestFinishedError", "RequestBusyError", "PluginError", "BadRequestError", "ServerBusyError", "RelayError", "RemoteRankError", "capped", "STATUS", "status_of", "error_dict",
           "error_of"]
