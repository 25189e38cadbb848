"""What the plug-in refuses, and how a refusal travels: a typed :class:`hsnap_format.HsnapError` in the scheduler,
a plain dict over SGLang's IPC (:func:`error_dict`), an HTTP error status with that dict as the JSON body
(``{"error": {...}}``), a :class:`hsnap_sglang.client.ServerError` in the client.  Imports no SGLang."""

from __future__ import annotations

import math
from typing import Any

from hsnap_format import errors as hf_errors
from hsnap_format.errors import HsnapError


class UnknownRequestError(HsnapError):
    """No request with this rid in the server (not running, queued nor being prefilled)."""


class RequestFinishedError(HsnapError):
    """The request finished (stop, length, abort) before it reached the export boundary: nothing to export."""


class RequestBusyError(HsnapError):
    """Another hsnap operation already holds the request (an export in progress), or the rid is in use here."""


class PluginError(HsnapError):
    """The server could not do what was asked for a reason of its own (an unexpected exception, logged)."""


# the first class in the MRO of an error that has a row here gives the HTTP status
STATUS: dict[str, int] = {
    "UnknownRequestError": 404,
    "HsnapIOError": 404,  # an unknown path (or unreadable: the message says which)
    "RemoteNotFoundError": 404,
    "RequestFinishedError": 409,
    "RequestBusyError": 409,
    "SnapshotExistsError": 409,
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
    "PluginError": 500,
    "HsnapError": 400,
}


def status_of(error_type_mro: list[str]) -> int:
    return next((STATUS[name] for name in error_type_mro if name in STATUS), 500)


def _plain(v: Any) -> Any:
    """A value for JSON: scalars as they are, containers recursively, anything else as its text."""
    if v is None or isinstance(v, (bool, int, str)):
        return v
    if isinstance(v, float):
        return v if math.isfinite(v) else str(v)
    if isinstance(v, (list, tuple)):
        return [_plain(x) for x in v]
    if isinstance(v, dict):
        return {str(k): _plain(x) for k, x in v.items()}
    return str(v)


def error_dict(e: BaseException, **extra) -> dict:
    """A refusal as plain values: ``type`` (the class name), ``status``, ``message`` (one line), ``path``,
    ``field``, ``expected``, ``found``, ``differences`` (IncompatibleSnapshotError), ``mro``."""
    mro = [c.__name__ for c in type(e).__mro__ if issubclass(c, BaseException)]
    d = {"type": type(e).__name__, "mro": mro, "status": status_of(mro), "message": str(e).splitlines()[0] if str(e) else type(e).__name__}
    if isinstance(e, HsnapError):
        d.update(path=e.path, field=e.field, expected=_plain(e.expected), found=_plain(e.found), detail=e.detail)
        if isinstance(e, hf_errors.IncompatibleSnapshotError):
            d["differences"] = [[f, _plain(x), _plain(y)] for f, x, y in e.differences]
    d.update(extra)
    return d


__all__ = ["UnknownRequestError", "RequestFinishedError", "RequestBusyError", "PluginError", "STATUS", "status_of", "error_dict"]
