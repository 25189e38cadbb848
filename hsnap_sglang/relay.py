"""A client's stream that survives a live migration: the source's HTTP process relays the target's stream into it.

``POST /hsnap/migrate`` with ``relay_to`` (a server the operator allowed, ``--hsnap-allow-peer``): before the source
starts, this process asks the target to follow the container (``/hsnap/follow``, streamed, expecting the rid) and
waits until the target lists that follow — a target that refuses, or cannot be reached, refuses the migrate with
nothing started.  The request's own stream here (``/generate``, the OpenAI routes, a resume's stream) then does not
end at the hand-off: the hand-off event goes out as an ordinary chunk (no finish reason) and the target's events
follow as they come — the same rid, the text and output ids so far in each (the target seeds them from the snapshot),
the finish reason of the run — until the target's stream ends.  The client's code does not change.

* The target's stream breaking before its finish ends the client's stream with a typed :class:`RelayError` naming
  the target (SGLang's own error event, code 502); the request is the target's by then.
* A migration given up (the request decodes on here) or a client gone before the hand-off closes the relay: the
  target's follow ends (abandoned.json) or its request is aborted as any stream's whose client went away.
* The source's SGLang holds a stream's locks (the model-update reader lock) for the stream's whole life: the relay
  takes over only after the source's stream has ended there, so a weight update here waits for no relayed stream.
* A SIGTERMed source serves its relayed streams to their end before it exits: SGLang's watchdog waits for the
  requests (a migration not yet handed off is one), then stops the schedulers and the HTTP server, whose graceful
  shutdown waits for the responses still open — a relayed stream needs no scheduler.  (A SIGKILL cuts them.)
* Not for a batch request (several prompts in one call; its rids are not relayable) or several tokenizer workers
  (the migrate call must reach the process that streams the request).
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
import time
from typing import Any, AsyncIterator

from hsnap_format.errors import Phrase

from . import metrics
from .client import HAND_OFF
from .errors import RelayError, RequestBusyError, UnknownRequestError, capped

logger = logging.getLogger("hsnap_sglang")

__all__ = ["PEER_API_KEY_ENV", "FOLLOW_WAIT_S", "Relay", "open_relay", "relayed", "around_generate_request"]

PEER_API_KEY_ENV = "HSNAP_PEER_API_KEY"  # the key this server sends to a peer's admin routes (else its own key)
FOLLOW_WAIT_S = 10.0  # the target must list the follow within this, or the migrate is refused (nothing started)
POLL_S = 0.02  # how often the target's /hsnap/stats is asked while waiting for the follow
QUEUE_EVENTS = 64  # target events read ahead of the client (then the target's socket waits)
MAX_EVENT_BYTES = 256 << 20  # one target event at most (events carry the whole text and logprobs so far)
MAX_ERROR_BYTES = 64 << 10  # a refusal's body read at most
CONNECT_S = 10.0


class Relay:
    """One relayed migration: the target's follow stream, read ahead into a bounded queue by a task."""

    def __init__(self, rid: str, target: str, container: str, obj: Any = None) -> None:
        self.rid, self.target, self.container = rid, target, container
        self.obj = obj  # the request's input object: the stream that may take this relay is the one made for it
        self.queue: asyncio.Queue = asyncio.Queue(QUEUE_EVENTS)
        self.failed: RelayError | None = None  # set once the follow failed (before or after its events began)
        self.task: asyncio.Task | None = None
        self.session: Any = None
        self.closed = False

    async def close(self) -> None:
        """End the relay: the follow's connection closed (the target sees its client gone)."""
        if self.closed:
            return
        self.closed = True
        if self.task is not None:
            self.task.cancel()
            try:
                await self.task
            except BaseException:  # noqa: BLE001 - cancelled or failed: closing either way
                pass
        if self.session is not None:
            await self.session.close()

    def _error(self, expected: str, found: str, remote: dict | None = None) -> RelayError:
        # the peer as host:port: a URL in an error is masked as the object store's endpoint (errors.capped)
        peer = self.target.split("://", 1)[-1]
        return RelayError(self.container, "relay_to", Phrase(expected), Phrase(capped(f"peer {peer}: {found}", 600)), remote=remote)

    async def events(self, hand_off: dict, *, stream: bool) -> AsyncIterator[dict]:
        """The client's stream from the hand-off on: the hand-off event as an ordinary chunk, then the target's
        events to its finish (a client that does not stream gets the target's last event alone)."""
        outcome = "broken"
        try:
            if stream:
                yield _as_chunk(hand_off)
            last = None
            while True:
                kind, value = await self.queue.get()
                if kind == "event":
                    if "error" in value:
                        err = value["error"] if isinstance(value["error"], dict) else {"message": str(value["error"])}
                        raise self._error("the target's stream to the request's finish", f"error: {err.get('message')}", remote=err)
                    last = value
                    if stream:
                        yield value
                    continue
                if kind == "error":
                    raise value
                finish = ((last or {}).get("meta_info") or {}).get("finish_reason")
                if finish is None:
                    raise self._error("the target's stream to the request's finish", "it ended before the request finished")
                break
            if not stream and last is not None:
                yield last
            outcome = "finished"
        except RelayError as e:
            logger.warning("hsnap relay of %s from %s: %s", self.rid, self.target, e)
            raise
        except BaseException:
            outcome = "client gone"
            raise
        finally:
            metrics.count("relays", outcome)
            await self.close()


def _as_chunk(out: dict) -> dict:
    """The hand-off event as an ordinary chunk of the stream (its text and ids so far; no finish reason)."""
    meta = dict(out.get("meta_info") or {})
    meta["finish_reason"] = None
    return dict(out, meta_info=meta)


def _hands_off_to(out: dict, container: str) -> bool:
    reason = (out.get("meta_info") or {}).get("finish_reason")
    return isinstance(reason, dict) and reason.get("type") == HAND_OFF and reason.get("migration") == container


def _peer_headers(tm) -> dict:
    args = getattr(tm, "server_args", None)
    key = os.environ.get(PEER_API_KEY_ENV) or getattr(args, "admin_api_key", None) or getattr(args, "api_key", None)
    return {"Content-Type": "application/json", **({"Authorization": f"Bearer {key}"} if key else {})}


async def _read_error(r) -> dict:
    """A peer's refusal body as its error dict (bounded; another body as its status)."""
    body = await r.content.read(MAX_ERROR_BYTES)
    try:
        err = json.loads(body).get("error")
    except (ValueError, AttributeError):
        err = None
    return err if isinstance(err, dict) else {"status": r.status, "message": f"HTTP {r.status}"}


async def _sse(content) -> AsyncIterator[dict]:
    """The JSON events of an SSE body (``data: {...}`` lines) until ``data: [DONE]``; each bounded."""
    buf = bytearray()
    async for chunk in content.iter_any():
        buf += chunk
        while True:
            end = buf.find(b"\n")
            if end < 0:
                if len(buf) > MAX_EVENT_BYTES:
                    raise ValueError(f"an event over {MAX_EVENT_BYTES} bytes")
                break
            line = bytes(buf[:end]).rstrip(b"\r")
            del buf[: end + 1]
            if not line.startswith(b"data:"):
                continue
            data = line[5:].strip()
            if data == b"[DONE]":
                return
            yield json.loads(data)


async def _pump(relay: Relay, body: dict, headers: dict) -> None:
    """The target's follow, read into the relay's queue: its events, then ("end", None) — or ("error", RelayError)."""
    try:
        async with relay.session.post(relay.target + "/hsnap/follow", json=body, headers=headers) as r:
            if r.status != 200:
                err = await _read_error(r)
                raise relay._error("a target that follows the migration", f"refused ({err.get('type') or r.status}): {err.get('message')}",
                                   remote=err)
            async for event in _sse(r.content):
                await relay.queue.put(("event", event))
        await relay.queue.put(("end", None))
    except asyncio.CancelledError:
        raise
    except Exception as e:  # noqa: BLE001 - the client's stream reports it (typed), the server goes on
        failed = e if isinstance(e, RelayError) else relay._error("the target's stream to the request's finish",
                                                                   f"the connection failed ({type(e).__name__}: {e})")
        relay.failed = failed
        await relay.queue.put(("error", failed))


async def _until_following(relay: Relay, headers: dict) -> None:
    """Wait until the target lists a follow expecting the rid (or the follow failed, or FOLLOW_WAIT_S passed)."""
    deadline = time.monotonic() + FOLLOW_WAIT_S
    while True:
        if relay.failed is not None:
            raise relay.failed
        try:
            async with relay.session.get(relay.target + "/hsnap/stats", headers=headers) as r:
                if r.status != 200:
                    err = await _read_error(r)
                    raise relay._error("a target whose /hsnap/stats answers", f"refused ({err.get('type') or r.status}): {err.get('message')}",
                                       remote=err)
                stats = json.loads(await r.content.read(MAX_EVENT_BYTES))
        except RelayError:
            raise
        except Exception as e:  # noqa: BLE001 - unreachable, or not an hsnap server
            raise relay._error("a target that answers", f"{type(e).__name__}: {e}") from None
        if any(isinstance(f, dict) and f.get("rid") == relay.rid for f in stats.get("follows") or ()):
            return
        if time.monotonic() > deadline:
            raise relay._error(f"a target following within {FOLLOW_WAIT_S:g} s", "no follow of the request listed")
        await asyncio.sleep(POLL_S)


async def open_relay(fe, rid: str, target: str, dir: str, container: str, *, timeout_s: float) -> Relay:  # noqa: A002
    """Have ``target`` follow ``dir`` (the client's name for the container; ``container``: this server's resolved
    path) for ``rid`` and relay its stream into the request's own stream here once the hand-off comes; returns once
    the target follows.  Refused (typed) when the request's stream is not this process's, when a relay of it is
    open, or when the target refuses or is silent."""
    import aiohttp

    tm = fe.tm
    state = tm.rid_to_state.get(rid)
    obj = getattr(state, "obj", None)
    if obj is None or id(obj) not in fe.relayable:
        raise UnknownRequestError(None, "rid", Phrase("a request streamed by one call of this HTTP process (not a batch)"), rid)
    if rid in fe.relays:
        raise RequestBusyError(None, "rid", Phrase("a request no other relayed migration holds"), rid)
    text_lp = bool(getattr(obj, "return_text_in_logprobs", False))
    relay = Relay(rid, target, container, obj)
    relay.session = aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=None, connect=CONNECT_S, sock_read=None))
    headers = _peer_headers(tm)
    body = {"dir": dir, "rid": rid, "stream": True, "timeout_s": timeout_s, "return_text_in_logprobs": text_lp}
    relay.task = asyncio.create_task(_pump(relay, body, headers))
    fe.relays[rid] = relay
    try:
        await _until_following(relay, headers)
    except BaseException:
        fe.relays.pop(rid, None)
        metrics.count("relays", "refused")
        await relay.close()
        raise
    return relay


async def drop(fe, relay: Relay) -> None:
    """The migration did not happen (refused or given up): the relay ends, the stream goes on here.  A relay the
    stream has taken already (the hand-off came) is the stream's to end."""
    if fe.relays.get(relay.rid) is relay:
        del fe.relays[relay.rid]
        metrics.count("relays", "dropped")
        await relay.close()


async def relayed(fe, obj, responses: AsyncIterator[dict]) -> AsyncIterator[dict]:
    """``responses`` (one request's stream here), continued by the target's once its request is handed off through
    a relayed migration.  Relayable: the request whose state holds ``obj`` itself (a batch's prompts have their own
    objects: none is)."""
    fe.relayable[id(obj)] = obj
    try:
        async for out in responses:
            rid = (out.get("meta_info") or {}).get("id")
            relay = fe.relays.get(rid) if isinstance(rid, str) else None
            if relay is not None and relay.obj is obj and _hands_off_to(out, relay.container):
                del fe.relays[rid]
                async for _ in responses:  # the source's stream ends here (and releases what SGLang held for it)
                    pass
                async for event in relay.events(out, stream=bool(getattr(obj, "stream", False))):
                    yield event
                return
            yield out
    finally:
        fe.relayable.pop(id(obj), None)
        for rid, left in [(r, x) for r, x in fe.relays.items() if x.obj is obj]:  # never taken: the stream ended otherwise
            del fe.relays[rid]
            metrics.count("relays", "dropped")
            asyncio.ensure_future(left.close())


def around_generate_request(original, tm, obj, *args, **kwargs):
    """AROUND ``TokenizerManager.generate_request`` (/generate and the OpenAI routes): the request's stream may be
    continued by a relayed migration's target (:func:`relayed`)."""
    responses = original(tm, obj, *args, **kwargs)
    fe = getattr(tm, "_hsnap", None)
    return responses if fe is None else relayed(fe, obj, responses)

