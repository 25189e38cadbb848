"""hsnap may fail; the server may not.  Every hsnap entry point of the HTTP process (the ``/hsnap/*`` routes) and of
the scheduler (its message handlers, its hooks, the link writer thread) runs inside one of these wrappers: any
exception becomes a typed answer to its caller (:func:`~hsnap_sglang.errors.error_dict`) and one log line, and the
server and every other request go on.  The checks of what a client sends (body size and nesting, texts without NUL
bytes or lone surrogates, within a length cap) are here too, shared by every route.  Imports no SGLang."""

from __future__ import annotations

import asyncio
import contextvars
import functools
import logging
from collections import OrderedDict
from typing import Any, Callable

from hsnap_format import HsnapError
from hsnap_format.controljson import loads_bounded
from hsnap_format.errors import Phrase

from . import metrics
from .errors import BadRequestError, PluginError, ServerBusyError, error_dict

logger = logging.getLogger("hsnap_sglang")

MAX_BODY_BYTES = 1 << 20  # the /hsnap control routes take a few small fields
MAX_BODY_DEPTH = 8
MAX_PATH_CHARS = 4096  # PATH_MAX
MAX_RID_CHARS = 512
MAX_FOLLOWS = 4  # concurrent /hsnap/follow calls per server (each holds a scheduler watcher and, later, slots)
MAX_FOLLOW_TIMEOUT_S = 600.0  # a follow waits at most this long for each link
_LOGGED: OrderedDict[tuple[str, str, str], int] = OrderedDict()  # (where, error type, message) already logged: a fault repeated every iteration is said once
_LOGGED_MAX = 256


# ----------------------------------------------------------------------------- logging once


def log_failure(where: str, e: BaseException) -> None:
    """One log line (with the traceback) per distinct failure of ``where``; repeats are counted at debug level."""
    key = (where, type(e).__name__, str(e)[:200])
    if key in _LOGGED:
        _LOGGED[key] += 1
        logger.debug("hsnap %s failed again (%d): %s", where, _LOGGED[key], type(e).__name__)
        return
    _LOGGED[key] = 1
    while len(_LOGGED) > _LOGGED_MAX:
        _LOGGED.popitem(last=False)
    logger.error("hsnap %s failed: %s: %s", where, type(e).__name__, str(e)[:500], exc_info=(type(e), e, e.__traceback__))


def typed(e: BaseException, where: str, path=None) -> HsnapError:
    """``e`` as an HsnapError: itself when it is one, else a PluginError naming where it happened (logged)."""
    if isinstance(e, HsnapError):
        return e
    log_failure(where, e)
    return PluginError(path, where, detail=f"{type(e).__name__}: {str(e)[:500]}")


def typed_in_dir(e: BaseException, where: str, directory: str) -> HsnapError:
    """``e``, raised while a request's directory (a drain's, a migration's container) was looked at or made, as an
    HsnapError: itself when it is one (SnapshotExistsError is an OSError too: it stays itself, a 409), an OS error the
    directory's (a 400 naming ``dir``), anything else as :func:`typed`."""
    if isinstance(e, HsnapError):
        return e
    if isinstance(e, OSError):
        return HsnapError(directory, "dir", detail=str(e))
    return typed(e, where, directory)


# ----------------------------------------------------------------------------- the scheduler side


def contained_handler(answer: Callable[..., None], where: str, fn: Callable[[Any], Any]) -> Callable[[Any], None]:
    """A scheduler message handler that never raises: a failure answers the message with a typed error
    (``answer(msg, ok=False, error=...)``) and is logged once; the scheduler loop goes on."""

    @functools.wraps(fn)
    def handler(msg):
        try:
            fn(msg)
        except Exception as e:  # noqa: BLE001 - hsnap may fail, the scheduler may not
            err = typed(e, where, getattr(msg, "path", None) or getattr(msg, "dir", None))
            try:
                answer(msg, ok=False, error=error_dict(err))
            except Exception as e2:  # noqa: BLE001 - the caller then waits for its own timeout
                log_failure(f"{where} (answering)", e2)
        return None

    return handler


def guarded(where: str, fn: Callable[..., Any], *args, default: Any = None, **kwargs) -> Any:
    """``fn(*args, **kwargs)``, or ``default`` when it raises (logged once): for hook bodies and watchers, whose
    failure must not stop the scheduler."""
    try:
        return fn(*args, **kwargs)
    except Exception as e:  # noqa: BLE001 - hsnap may fail, the scheduler may not
        log_failure(where, e)
        return default


# ----------------------------------------------------------------------------- the HTTP side: what a client sends


def _bad(field: str, expected: str, found) -> BadRequestError:
    return BadRequestError("request body", field, Phrase(expected), found)


def check_text(field: str, value: Any, *, max_chars: int, what: str = "a string") -> str:
    """``value`` if it is a non-empty string of at most ``max_chars`` characters with no NUL byte and no lone
    surrogate (neither can name a file, and the scheduler's OS calls would raise on them), else a typed 400."""
    if type(value) is not str or not value:
        raise _bad(field, what, value)
    if len(value) > max_chars:
        raise _bad(field, f"{what} of at most {max_chars} characters", Phrase(f"{len(value)} characters"))
    if "\x00" in value:
        raise _bad(field, f"{what} without a NUL byte", Phrase(f"a NUL byte at {value.index(chr(0))}"))
    try:
        value.encode("utf-8")
    except UnicodeEncodeError as e:
        raise _bad(field, f"{what} of Unicode scalar values", Phrase(f"a lone surrogate at {e.start}")) from None
    return value


def check_path(field: str, value: Any, *, what: str = "a path or s3:// URL (string)") -> str:
    return check_text(field, value, max_chars=MAX_PATH_CHARS, what=what)


def check_rid(field: str, value: Any, *, what: str = "a request id (string)") -> str:
    return check_text(field, value, max_chars=MAX_RID_CHARS, what=what)


async def read_body(request, *, max_bytes: int = MAX_BODY_BYTES, max_depth: int = MAX_BODY_DEPTH) -> dict:
    """The request's JSON object body: its size capped before it is read whole (Content-Length, then as it
    streams), its nesting capped, NaN/Infinity refused; anything else is a typed 400."""
    declared = request.headers.get("content-length")
    if declared is not None and declared.isdigit() and int(declared) > max_bytes:
        raise _bad("body", f"a JSON object of at most {max_bytes} bytes", Phrase(f"{declared} bytes"))
    chunks, size = [], 0
    async for chunk in request.stream():
        size += len(chunk)
        if size > max_bytes:
            raise _bad("body", f"a JSON object of at most {max_bytes} bytes", Phrase(f"more than {max_bytes} bytes"))
        chunks.append(chunk)
    try:
        body = loads_bounded(b"".join(chunks), "request body", "body", max_bytes=max_bytes, max_depth=max_depth)
    except HsnapError as e:
        raise BadRequestError("request body", "body", e.expected, e.found) from None
    if not isinstance(body, dict):
        raise _bad("body", "a JSON object", Phrase(type(body).__name__))
    return body


# ----------------------------------------------------------------------------- the HTTP side: routes


ROUTE: contextvars.ContextVar[str] = contextvars.ContextVar("hsnap_route", default="route")  # the /hsnap route being answered

# what the one log line of a route's answer names, in this order (those it has)
QUIET_ROUTES = frozenset({"stats"})  # read-only, polled: not logged
ANSWER_LOG_FIELDS = ("rid", "path", "dir", "committed_positions", "output_tokens", "requests", "links", "every", "bytes")


def record_answer(status: int, content: dict, *, member: bool = False) -> None:
    """One log line per answer of an /hsnap route (the route from :data:`ROUTE`): what it did — rid, path,
    positions, bytes, duration — or the refusal's type and message; a drain adds one line per request.  The same
    answer is counted in SGLang's /metrics when it serves them (:mod:`.metrics`; a drain's members add their
    bytes and durations, the drain is one operation)."""
    where = ROUTE.get()
    if where in QUIET_ROUTES:
        return
    metrics.observe_answer(where, status, content, counted=not member)
    if status >= 400:
        logger.info("hsnap %s refused (HTTP %d): %s: %s", where, status, content.get("type"), str(content.get("message"))[:500])
        return
    said = " ".join(f"{k}={content[k]}" for k in ANSWER_LOG_FIELDS if content.get(k) is not None)
    timings = content.get("timings") or {}
    total = timings.get("total_s", timings.get("restore_s"))
    logger.info("hsnap %s: %s%s", where, said, f" in {total * 1e3:.1f} ms" if isinstance(total, (int, float)) else "")
    for item in content.get("items") or ():
        inner = item.get("result") if item.get("ok") else item.get("error")
        record_answer(200 if item.get("ok") else int((inner or {}).get("status", 500)), dict(inner or {}, rid=item.get("rid")), member=True)


def contained_route(where: str, respond: Callable[[dict], Any], answered: type | None = None):
    """Decorator of an ``/hsnap/*`` route: an HsnapError becomes its typed answer, ``answered`` (the scheduler's
    refusal, carrying ``.error``) its dict as it is, anything else a typed 500 (PluginError) and one log line —
    never a bare 500 or a traceback body.  ``respond(error_dict)`` builds the response."""

    def wrap(fn):
        @functools.wraps(fn)
        async def route(*args, **kwargs):
            ROUTE.set(where)  # this request's own context (one asyncio task per request)
            try:
                return await fn(*args, **kwargs)
            except asyncio.CancelledError:
                raise
            except HsnapError as e:
                return respond(error_dict(e))
            except Exception as e:  # noqa: BLE001 - hsnap may fail, the server may not
                if answered is not None and isinstance(e, answered):
                    return respond(e.error)
                return respond(error_dict(typed(e, where)))

        return route

    return wrap


class Slots:
    """At most ``limit`` holders at once (the HTTP process's event loop only: no lock needed); past it a typed 429."""

    def __init__(self, limit: int, what: str) -> None:
        self.limit, self.what, self.held = limit, what, 0

    def __enter__(self) -> "Slots":
        if self.held >= self.limit:
            raise ServerBusyError(None, self.what, Phrase(f"at most {self.limit} at once in this server"),
                                  Phrase(f"{self.held} running; retry later"))
        self.held += 1
        return self

    def __exit__(self, *exc) -> None:
        self.held -= 1


__all__ = ["MAX_BODY_BYTES", "MAX_BODY_DEPTH", "MAX_PATH_CHARS", "MAX_RID_CHARS", "MAX_FOLLOWS", "MAX_FOLLOW_TIMEOUT_S",
           "log_failure", "typed", "contained_handler", "guarded", "check_text", "check_path", "check_rid", "read_body",
           "contained_route", "Slots", "ROUTE", "record_answer"]
