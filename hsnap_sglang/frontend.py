"""hsnap in SGLang's HTTP process: the ``/hsnap/*`` routes and what the TokenizerManager needs for them.

Routes (JSON bodies; errors are an HTTP error status with ``{"error": {type, status, message, path, field,
expected, found, ...}}``, sent before any output):

* ``POST /hsnap/export {"rid", "path", "keep_running": false}`` — the export's result (path, bytes, committed
  positions, snapshot id, timings) once the snapshot is durable (and, without ``keep_running``, the request's slots
  are released and its client's stream has ended with ``finish_reason {"type": "hsnap_export", "path": ...}``).
* ``POST /hsnap/resume {"path", "stream": false, "return_text_in_logprobs": false}`` — the rest of the request, in
  /generate's shape (one JSON, or ``text/event-stream`` of ``data: {...}`` events and ``data: [DONE]``), continuing
  the original stream: each event carries the whole text, ``output_ids`` and ``meta_info`` logprobs so far, the part
  from before the snapshot included (the client's incremental-streaming setting gives deltas instead, as for
  /generate).  The resume result (snapshot id, committed positions, bytes, timings) is in the ``X-Hsnap-Resume``
  header.  A directory or ``s3://`` prefix (a drain's, or checkpoints': of those only each request's newest link)
  resumes every snapshot in it; the events of all of them
  are interleaved, each naming its request in ``meta_info.id``.  Each snapshot is resumed at most once: the server
  claims it first (``<snapshot>.claimed``, hsnap_sglang.claims); a second resume is refused with 409
  ``SnapshotClaimedError`` naming who claimed it and when, unless the body says ``"again": true``.
* ``POST /hsnap/drain {"dir", "dedup": false, "page_size": 64}`` — every request of the server exported into ``dir``:
  ``{"ok", "items": [...]}``; ``dedup``: full pages stored once in ``dir/pages`` (``"dedup": {bytes_written, single_bytes, ...}``).
* ``POST /hsnap/checkpoint {"rid", "dir", "every"}`` — checkpoint the request into ``dir`` now (answered once that
  link is durable) and every ``every`` output tokens after, while it keeps decoding (``every: 0`` stops).
* ``GET /hsnap/stats[?rid=]`` — completed forwards per request (decode / extend), requests, pool free counts and
  SGLang's own invariant checks.
* ``POST /hsnap/migrate {"rid", "dir", ...}`` / ``POST /hsnap/follow {"dir", "rid"?, "timeout_s"?}`` — live
  migration (:mod:`.migration`).  Follows are bounded: at most ``MAX_FOLLOWS`` (4) at once per server (past it a
  typed 429, ServerBusyError) and ``timeout_s`` at most ``MAX_FOLLOW_TIMEOUT_S`` (600 s) per link.

Every route is contained (:mod:`.containment`): a body over 1 MiB or nested over 8 deep, a text field with a NUL
byte or a lone surrogate (or a path over 4096, a rid over 512 characters) is a typed 400 before the scheduler is
asked; any failure is a typed JSON answer and one log line, never a bare 500; error answers echo at most 200
characters of any value.  Every route is an admin route (SGLang's ``ADMIN_OPTIONAL``: the admin key, else the API
key; :mod:`.auth`), and every client path or URL resolves beneath the snapshot root / allowed prefixes
(:mod:`.confine`; a typed 403 otherwise, before anything outside is opened).

Before the scheduler is asked to resume anything, the HTTP process reads the snapshot's record (hsnap_format:
header and record, hashed) to learn the rid and how the client is served, and registers the request's state with
SGLang's TokenizerManager, seeded with what the client already has (token ids, text, logprobs), so that no output
of the resumed request can arrive before its state exists.
"""

import asyncio
import json
import logging
import os
import time
import uuid
from typing import Any, Callable, NamedTuple

from hsnap_format import HsnapError, SnapshotExistsError, open_snapshot
from hsnap_format.errors import MalformedError, Phrase
from hsnap_format.migrations import container_used
from hsnap_format.spec import MAX_PAGE_SIZE
from hsnap_format.stores import is_url, store_for

from . import claims, metrics, restart
from . import auth, confine, relay
from .containment import (MAX_FOLLOW_TIMEOUT_S, MAX_FOLLOWS, Slots, check_path, check_rid, contained_route, log_failure, read_body,
                          record_answer)
from .detokenize import replay_info
from .errors import PluginError, RequestBusyError, error_dict
from .messages import (HsnapAdmitReqInput, HsnapCheckpointReqInput, HsnapDrainReqInput, HsnapExportReqInput, HsnapFollowReqInput,
                       HsnapMigrateReqInput, HsnapProveAheadReqInput, HsnapReqOutput, HsnapResumeReqInput, HsnapStatsReqInput)

logger = logging.getLogger("hsnap_sglang")



RESUME_HEADER = "X-Hsnap-Resume"
_HEADER_LIMIT = 6000


# ----------------------------------------------------------------------------- hooks (plugin.HOOKS)


def install(result, tm, *args, **kwargs):
    """AFTER ``TokenizerManager.init_request_dispatcher``: the scheduler's hsnap answers reach their callers."""
    from sglang.utils import TypeBasedDispatcher

    tm._hsnap = HsnapFrontend(tm)
    tm._result_dispatcher += TypeBasedDispatcher([(HsnapReqOutput, tm._hsnap.on_answer)])


_routes_added = False


def before_launch_server(*args, **kwargs):
    """BEFORE ``http_server.launch_server``: the /hsnap routes join SGLang's FastAPI app — unless no key guards them
    on a server others can reach (:func:`.auth.exposure_refusal`): then the server does not start, and says why."""
    global _routes_added
    sa = kwargs.get("server_args", args[0] if args else None)  # always given by launch_server (a probe may omit it)
    why = sa is not None and auth.exposure_refusal(getattr(sa, "host", None), getattr(sa, "api_key", None), getattr(sa, "admin_api_key", None),
                                                   tokenizer_workers=getattr(sa, "tokenizer_worker_num", 1))
    if why:
        logger.error(why)
        raise SystemExit(why)
    if not _routes_added:
        from sglang.srt.entrypoints import http_server

        add_routes(http_server.app)
        _routes_added = True
        root, urls = confine.configured_root(), confine.allowed_urls()
        logger.info("hsnap plug-in on: /hsnap routes added (admin operations: %s); snapshot root %s; URLs allowed: %s",
                    "the admin key, else the API key" if getattr(sa, "admin_api_key", None) or getattr(sa, "api_key", None) else "no key set",
                    root or "none (paths refused)", ", ".join("s3://" + "/".join((bucket, *parts)) for bucket, parts in urls) or "none")
    return None


def add_routes(app) -> None:
    """The /hsnap routes as routes of ``app`` itself: SGLang's key middleware finds a route's auth level on the
    app's own routes, and FastAPI's ``include_router`` now adds one opaque entry (its auth mark unseen: the routes
    then counted as user routes)."""
    for route in router().routes:
        app.add_api_route(route.path, route.endpoint, methods=sorted(route.methods), name=route.name)


# ----------------------------------------------------------------------------- the TokenizerManager side


class PreparedResume(NamedTuple):
    """A resume's work before the scheduler (:meth:`HsnapFrontend.prepare`): the record's request, the claim held
    (marker, version; None with ``again``), the replayed client text, and when the read and the claim ended."""

    info: dict
    held: tuple[str, str] | None
    handoff: Any
    read_at: float
    claimed_at: float


class HsnapFrontend:
    def __init__(self, tm) -> None:
        self.tm = tm
        self.waiting: dict[str, asyncio.Future] = {}
        self.text_skip: dict[str, int] = {}  # rid -> characters its first output repeats (detokenize.around_handle_batch_output)
        self.relays: dict[str, Any] = {}  # rid -> relay.Relay: its stream goes on with a migration target's
        self.relayable: dict[int, Any] = {}  # id -> a request's input object whose stream a relay can continue (relay.relayed)

    async def call(self, msg) -> HsnapReqOutput:
        """Send one hsnap request to the scheduler and wait for its answer (several may be in flight)."""
        self.tm.auto_create_handle_loop()
        fut = asyncio.get_running_loop().create_future()
        self.waiting[msg.op_id] = fut
        try:
            await self.tm._async_dispatch_to_scheduler(msg)
            return await fut
        finally:
            self.waiting.pop(msg.op_id, None)

    async def send(self, msg) -> None:
        """Send one hsnap message the scheduler does not answer."""
        self.tm.auto_create_handle_loop()
        await self.tm._async_dispatch_to_scheduler(msg)

    async def prove_ahead(self, path: str) -> str | None:
        """Have the scheduler start proving ``path`` now (:class:`HsnapProveAheadReqInput`), while this process reads
        the record, claims the snapshot and registers the client: the resume that names it (``ahead``) takes the
        proof.  Returns its op_id, None when it could not be sent (the resume then proves as it arrives)."""
        op_id = uuid.uuid4().hex
        try:
            await self.send(HsnapProveAheadReqInput(op_id=op_id, path=path))
        except Exception:  # noqa: BLE001 - only a head start lost
            logger.exception("hsnap: asking for a proof ahead of the resume of %s", path)
            return None
        return op_id

    async def drop_ahead(self, op_id: str | None) -> None:
        """The resume :meth:`prove_ahead` started a proof for will not be sent (or took another path): give it back
        now, not after the scheduler's time-out (a no-op once a resume took it)."""
        if op_id is not None:
            try:
                await self.send(HsnapProveAheadReqInput(op_id=op_id, path="", drop=True))
            except Exception:  # noqa: BLE001 - the scheduler gives it back after PROVED_AHEAD_TTL_S
                logger.exception("hsnap: giving back a proof ahead")

    def on_answer(self, out: HsnapReqOutput) -> None:
        fut = self.waiting.get(out.op_id)
        if fut is not None and not fut.done():
            fut.set_result(out)

    # ------------------------------------------------------------------ resume

    async def resume_one(self, path: str, *, stream: bool, text_in_logprobs: bool, request=None, again: bool = False,
                         prepared: "PreparedResume | BaseException | None" = None, asked_at: float | None = None,
                         ahead: str | None = None):
        """Claim the snapshot (hsnap_sglang.claims; not with ``again``), register the request's state (seeded), ask
        the scheduler; on refusal take the state and the claim back and raise.  File and store work runs off the
        event loop (its reads are bounded by the store's timeouts), in one job (:meth:`prepare`) unless the caller
        ran it already (``prepared``: its result or what it raised, with ``asked_at`` when the caller was asked).
        ``ahead``: the op_id of the proof :meth:`prove_ahead` started for ``path`` (given back if this fails first)."""
        t_asked = time.monotonic() if asked_at is None else asked_at
        try:
            if prepared is None:
                prepared = await asyncio.to_thread(self.prepare, path, again=again)
            elif isinstance(prepared, BaseException):
                raise prepared
        except BaseException:
            await self.drop_ahead(ahead)
            raise
        info, held = prepared.info, prepared.held
        try:
            obj, out, had = await self._registered(info, prepared.handoff,
                                                   HsnapResumeReqInput(op_id=uuid.uuid4().hex, rid=info["rid"], path=path, ahead=ahead),
                                                   stream=stream, text_in_logprobs=text_in_logprobs, request=request)
        except BaseException:
            await self.drop_ahead(ahead)  # (a no-op when the resume was sent: it took the proof)
            if held is not None:
                await asyncio.to_thread(_release_claim, *held)
            raise
        result = dict(out.result, client_had=had, claimed=held[0] if held is not None else None)
        result["timings"] = resume_phases(dict(result.get("timings") or {}), asked=t_asked, read=prepared.read_at, claimed=prepared.claimed_at,
                                          sent=obj.hsnap_sent_at, answered=time.monotonic())
        return obj, result

    def prepare(self, path: str, *, again: bool = False) -> "PreparedResume":
        """What a resume does before the scheduler sees it, in one job on a worker thread (each hop between the event
        loop and a worker costs a wake-up, milliseconds in a busy server): read the record, claim the snapshot, then
        replay its client's text (O(output tokens) decodes).  The claim comes before a rid is found busy: a snapshot
        this server (or another client) resumed already is refused as claimed, which a client following a rolling
        restart reads as "attach to it" — never as a busy rid, whatever came first.  A refusal after the claim takes
        it back."""
        info = read_resume_info(path)
        read_at = time.monotonic()
        held = None if again else claims.claim(path, self.claimant())
        claimed_at = time.monotonic()
        try:
            rid = info["rid"]
            if rid in self.tm.rid_to_state:  # a first look (the event loop looks again before registering)
                raise RequestBusyError(path, "request.rid", Phrase("a rid no request of this server has"), rid)
            handoff = replay_info(self.tm.tokenizer, info)
        except BaseException:
            if held is not None:
                _release_claim(*held)
            raise
        return PreparedResume(info, held, handoff, read_at, claimed_at)

    def claimant(self) -> dict:
        args = getattr(self.tm, "server_args", None)
        return claims.claimant_identity(f"{getattr(args, 'host', '?')}:{getattr(args, 'port', '?')}")

    async def _registered(self, info: dict, handoff, msg, *, stream: bool, text_in_logprobs: bool, request):
        """Register the client's state of ``info``'s request (seeded with what the client already has: ``handoff``,
        its replayed text), then send ``msg`` (the scheduler starts the request); a refusal takes the state back and
        raises.  Returns the request, the scheduler's answer and what the client had (the first event repeats it:
        /generate's events carry the text so far)."""
        tm, rid = self.tm, info["rid"]
        if rid in tm.rid_to_state:
            raise RequestBusyError(getattr(msg, "path", None), "request.rid", Phrase("a rid no request of this server has"), rid)
        obj = _generate_input(info, stream=stream, text_in_logprobs=text_in_logprobs)
        tm._init_req_state(obj, request)
        state = tm.rid_to_state[rid]
        state.hsnap_registered_at = time.monotonic()  # an earlier stream's delayed abort spares it (around_create_abort_task)
        _seed_state(state, info, handoff.text)
        had = {"text_chars": len(state.get_text()), "output_ids": len(state.output_ids),
               "incremental": bool(stream and tm.incremental_streaming_output)}
        msg.detokenizer = [handoff.surr, handoff.read]  # the scheduler's window: the one an uninterrupted stream has
        if handoff.pending:
            self.text_skip[rid] = handoff.pending
        obj.hsnap_sent_at = time.monotonic()
        try:
            out = await self.call(msg)
        except BaseException:
            tm.rid_to_state.pop(rid, None)
            self.text_skip.pop(rid, None)
            raise
        if not out.ok:
            if tm.rid_to_state.get(rid) is state:
                del tm.rid_to_state[rid]
            self.text_skip.pop(rid, None)
            raise _AnsweredError(out.error or {})
        # its reader, now (no await since the answer): a request that ends while the next snapshot of a directory is
        # resumed leaves rid_to_state, and a reader made later would not find its state (a 500 on a good resume)
        obj.hsnap_waiter = tm._wait_one_response(obj, request)
        return obj, out, had


    # ------------------------------------------------------------------ follow (the target of a live migration)

    async def follow(self, container: str, *, rid: str | None, timeout_s: float, stream: bool, text_in_logprobs: bool, request=None):
        """Ask the scheduler to follow ``container``; once the final link is applied (the request held in its slots),
        register the client's state from the record it answers with, then have it admitted."""
        tm = self.tm
        if rid is not None and rid in tm.rid_to_state:
            raise RequestBusyError(container, "request.rid", Phrase("a rid no request of this server has"), rid)
        out = await self.call(HsnapFollowReqInput(op_id=uuid.uuid4().hex, rid=rid, dir=container, timeout_s=timeout_s))
        if not out.ok:
            raise _AnsweredError(out.error or {})
        result = dict(out.result)
        info = result.pop("info")
        rid = info["rid"]
        give_back = HsnapAdmitReqInput(op_id=uuid.uuid4().hex, rid=rid, admit=False)
        # the hand-off happens once: the final link is claimed as a resume claims its snapshot (a resume of it
        # elsewhere is then refused by name); if one resumed it first, the migrated request is given back
        try:
            held = await asyncio.to_thread(claims.claim, result["final"], self.claimant())
        except BaseException:
            await self.call(give_back)
            raise
        try:
            if rid in tm.rid_to_state:  # a request of that rid arrived here meanwhile: give the migrated one back
                await self.call(give_back)
                raise RequestBusyError(container, "request.rid", Phrase("a rid no request of this server has"), rid)
            handoff = await asyncio.to_thread(replay_info, tm.tokenizer, info)  # O(output tokens) decodes: off the event loop
            obj, adm, result["client_had"] = await self._registered(info, handoff, HsnapAdmitReqInput(op_id=uuid.uuid4().hex, rid=rid, admit=True),
                                                                    stream=stream, text_in_logprobs=text_in_logprobs, request=request)
        except BaseException:
            await asyncio.to_thread(_release_claim, *held)
            raise
        result["claimed"] = held[0]
        result["timings"] = dict(result.get("timings", {}), admitted_at=adm.result.get("admitted_at"))
        return obj, result


def resume_phases(timings: dict, *, asked: float, read: float, claimed: float, sent: float, answered: float) -> dict:
    """A resume's time, phase by phase (seconds): the snapshot's record read in the HTTP process (for a route's
    first snapshot from the route's call: its body, the listing and the hop to a worker included), its claim, the
    request's registration (its client's text replayed, its state registered), the wait for the scheduler to take the message (``queue_s``), the restore, the admission
    into the running batch, and the answer's way back (``answer_s``); ``to_answer_s`` from asked to answered.  The
    scheduler's stamps share the host's monotonic clock."""
    received, admitted = timings.pop("received_at", None), timings.pop("admitted_at", None)
    phases = {"read_s": read - asked, "claim_s": claimed - read, "register_s": sent - claimed, "to_answer_s": answered - asked}
    if received is not None and admitted is not None:
        phases.update(queue_s=received - sent, answer_s=answered - admitted)
    return dict(timings, **phases)


def _release_claim(marker: str, version: str) -> None:
    try:
        claims.release(marker, version)
    except Exception:  # noqa: BLE001 - a claim left behind refuses a later resume by name (again=true resumes it)
        logger.exception("hsnap: taking back the claim %s", marker)


DRAIN_ON_SIGTERM_ENV = "HSNAP_DRAIN_ON_SIGTERM"  # a directory (beneath the root) or allowed s3:// prefix


def after_sigterm(result, handler, *args, **kwargs):
    """AFTER ``SignalHandler.sigterm_handler`` (SGLang then waits for every request to finish before it exits): with
    ``HSNAP_DRAIN_ON_SIGTERM`` set, every request is drained there first — each client's stream ends with
    ``finish_reason hsnap_export`` naming its snapshot — so SGLang's wait ends at once and a rolling restart loses
    no request's progress (``hsnap resume NEW_URL DIR`` continues them).  A drain that fails is logged; SGLang's
    own graceful wait then applies (the requests run to their end)."""
    target = os.environ.get(DRAIN_ON_SIGTERM_ENV)
    tm = getattr(handler, "tokenizer_manager", None)
    if not target or tm is None or getattr(tm, "_hsnap", None) is None:
        return None
    asyncio.get_event_loop().create_task(_drain_on_sigterm(tm._hsnap, target))
    return None


async def _drain_on_sigterm(fe: "HsnapFrontend", target: str) -> None:
    """The shutdown's drain; the scheduler logs how it ended (SGLang's shutdown may end this process first: once
    the drained streams have ended it sees no request left and stops everything)."""
    logger.info("hsnap: SIGTERM: draining every request into %s", target)
    try:
        out = await fe.call(HsnapDrainReqInput(op_id=uuid.uuid4().hex, dir=_local(target, "dir"), why="sigterm"))
    except Exception as e:  # noqa: BLE001 - the shutdown goes on (SGLang's graceful wait)
        log_failure("drain on SIGTERM", e)
        return
    if not out.ok and not out.items:  # refused as a whole (the directory): the requests run to their end
        logger.error("hsnap: SIGTERM: no drain into %s: %s", target, (out.error or {}).get("message"))


def around_create_abort_task(original, tm, obj, *args, **kwargs):
    """AROUND ``TokenizerManager.create_abort_task``: SGLang aborts a streamed request's rid 2 s after its stream
    ends (the client went away).  When that stream ended because its request was exported, the rid may by then
    belong to the same request resumed here: the delayed abort spares a request hsnap registered after the abort
    was arranged (the resumed one's own stream arranges its own, later, which still applies)."""
    return _delayed_abort(tm, lambda: [obj.rid] if obj.is_single else list(obj.rid))  # read once normalized, 2 s later


ABORT_DELAY_S = 2.0  # SGLang's delay before a stream's requests are aborted once the stream ended


def _delayed_abort(tm, rids: Callable[[], list]):
    """One background task: ``ABORT_DELAY_S`` after the stream ended, each of ``rids()`` still there is aborted —
    unless hsnap registered it after this was arranged (a resume of the same rid)."""
    from starlette.background import BackgroundTasks

    arranged = time.monotonic()

    async def abort_request():
        await asyncio.sleep(ABORT_DELAY_S)
        for rid in rids():
            state = tm.rid_to_state.get(rid)
            if state is not None and getattr(state, "hsnap_registered_at", float("-inf")) <= arranged:
                tm.abort_request(rid)
                if hasattr(state, "hsnap_registered_at"):  # a resumed one: its progress since the snapshot ends here
                    logger.info("hsnap: aborted resumed request %s: its stream's client went away (%d output tokens)", rid,
                                len(state.output_ids))

    tasks = BackgroundTasks()
    tasks.add_task(abort_request)
    return tasks


class _AnsweredError(Exception):
    """The scheduler refused: its error dict, as it is."""

    def __init__(self, error: dict) -> None:
        super().__init__(error.get("message"))
        self.error = error


def read_resume_info(path: str) -> dict:
    """What the HTTP process needs of a snapshot before the scheduler resumes it: the record (rank 0's in a set),
    read through hsnap_format (every byte read is hashed), and the carried client options."""
    with open_snapshot(path) as snap:
        first = snap.ranks[min(snap.ranks)] if hasattr(snap, "ranks") else snap
        record = first.record()
    record.validate(path)
    return resume_info_of(record, path)


def resume_info_of(record, path: str) -> dict:
    """:func:`read_resume_info` of a record already read and validated (plain values: it crosses SGLang's IPC)."""
    extra = record.extra
    req = lambda name, default=None: extra.get(f"sglang.Req.{name}", default)  # noqa: E731
    lp = lambda name, default=None: extra.get(f"sglang.ReqLogprob.{name}", default)  # noqa: E731

    def json_extra(key):
        v = extra.get(key)
        if not isinstance(v, str):
            return v
        try:  # carried JSON of a record that hashed fine but was written by anyone (logprobs may be -Infinity)
            return json.loads(v)
        except (RecursionError, ValueError) as e:
            raise MalformedError(path, f"record.extra[{key!r}]", Phrase("JSON text nested less than the parser's limit"),
                                 Phrase(type(e).__name__)) from None

    return {
        "path": path,
        "rid": record.rid,
        # numpy's tolist: Python ints and floats at C speed (a loop of int(x) took 4 ms for a 32k prompt)
        "prompt_ids": record.prompt_ids.tolist(),
        "output_ids": record.output_ids.tolist(),
        "output_logprobs": None if record.output_logprobs is None else record.output_logprobs.tolist(),
        "top_logprob_values": None if record.top_logprob_values is None else record.top_logprob_values.tolist(),
        "top_logprob_ids": None if record.top_logprob_ids is None else record.top_logprob_ids.tolist(),
        "return_logprob": bool(req("return_logprob", False)),
        "logprob_start_len": req("logprob_start_len", -1),
        "top_logprobs_num": int(lp("top_logprobs_num", 0) or 0),
        "token_ids_logprob": lp("token_ids_logprob"),
        "output_token_logprobs_idx": lp("output_token_logprobs_idx"),
        "output_token_ids_logprobs_val": json_extra("sglang.ReqLogprob.output_token_ids_logprobs_val"),
        "output_token_ids_logprobs_idx": json_extra("sglang.ReqLogprob.output_token_ids_logprobs_idx"),
        "input": {name: json_extra(f"sglang.ReqLogprob.{name}") for name in (
            "input_token_logprobs_val", "input_token_logprobs_idx", "input_top_logprobs_val", "input_top_logprobs_idx",
            "input_token_ids_logprobs_val", "input_token_ids_logprobs_idx")},
        "sampling": {k: v for k, v in record.sampling.items() if k != "__json__" and k not in record.sampling.get("__json__", [])},
    }


def _generate_input(info: dict, *, stream: bool, text_in_logprobs: bool):
    from sglang.srt.managers.io_struct import GenerateReqInput

    obj = GenerateReqInput(
        rid=info["rid"], input_ids=info["prompt_ids"], sampling_params=dict(info["sampling"]), stream=stream,
        return_logprob=info["return_logprob"], logprob_start_len=info["logprob_start_len"], top_logprobs_num=info["top_logprobs_num"],
        token_ids_logprob=info["token_ids_logprob"], return_text_in_logprobs=text_in_logprobs,
    )
    obj.normalize_batch_and_arguments()
    return obj


def _seed_state(state, info: dict, text: str) -> None:
    """What the client had before the snapshot, so every event continues the original stream."""
    outputs = info["output_ids"]
    state.output_ids = list(outputs)
    state.append_text(text)
    state.last_output_offset = len(outputs)
    if not info["return_logprob"]:
        return
    state.output_token_logprobs_val = list(info["output_logprobs"] or [])
    state.output_token_logprobs_idx = list(info["output_token_logprobs_idx"] or outputs)
    if info["top_logprobs_num"] > 0 and info["top_logprob_values"] is not None:
        state.output_top_logprobs_val = [list(r) for r in info["top_logprob_values"]]
        state.output_top_logprobs_idx = [list(r) for r in info["top_logprob_ids"]]
    if info["token_ids_logprob"] is not None:
        state.output_token_ids_logprobs_val = list(info["output_token_ids_logprobs_val"] or [])
        state.output_token_ids_logprobs_idx = list(info["output_token_ids_logprobs_idx"] or [])
    for name, value in info["input"].items():
        if value:
            setattr(state, name, list(value))


def snapshot_entries(path: str) -> list[str]:
    """``path`` itself when it is one snapshot (a rank file, a TP set directory, an ``s3://`` object or set); for a
    directory or ``s3://`` prefix of snapshots (what a drain writes; one level), every ``*.hsnap`` file and set in
    it, by name — of the checkpoint links of a request (``<name>.ckNNNNNN.hsnap``) only its newest committed one (the
    others are the chain below it): :func:`hsnap_format.stores.entries.snapshot_entries`, the listing ``hsnap info``
    and ``hsnap verify`` show."""
    from hsnap_format.stores.entries import snapshot_entries as entries

    return entries(path)


# ----------------------------------------------------------------------------- routes


def _tm():
    from sglang.srt.entrypoints.http_server import get_global_state

    return get_global_state().tokenizer_manager


def _frontend() -> HsnapFrontend:
    return _tm()._hsnap


def _error_response(error: dict, *, logged: bool = False):
    from fastapi.responses import JSONResponse

    status = int(error.get("status", 500))
    if not logged:
        record_answer(status, error)
    return JSONResponse(status_code=status, content={"error": error})


def _bad(field: str, expected, found):
    return _error_response(error_dict(HsnapError("request body", field, Phrase(expected), found)))


async def _body(request) -> dict:
    """The JSON object body, bounded (containment.read_body): anything else is a typed 400 (BadRequestError)."""
    return await read_body(request)


def _local(path: str, field: str = "path") -> str:
    """A client's path resolved beneath the snapshot root (a URL: beneath an allowed prefix), or ConfinementError
    (a typed 403): nothing outside the root is opened, no symlink beneath it followed (:mod:`.confine`)."""
    return confine.resolve(path, field, confine.READ)


def _answer_response(out: HsnapReqOutput):
    from fastapi.responses import JSONResponse

    if not out.ok and not out.items:
        return _error_response(out.error or {})
    content: dict[str, Any] = dict(out.result)
    if out.items:
        content.update(ok=out.ok, items=out.items)
    record_answer(200, content)
    return JSONResponse(status_code=200, content=content)


_FOLLOWS = Slots(MAX_FOLLOWS, "follow")


def _contained(where: str):
    """Route containment (containment.contained_route): any exception is a typed JSON answer, never a bare 500."""
    return contained_route(where, _error_response, answered=_AnsweredError)


def router():
    from fastapi import APIRouter, Request

    r = APIRouter(prefix="/hsnap")

    @r.post("/export")
    @_contained("export")
    async def export(request: Request):
        body = await _body(request)
        rid, path, keep = body.get("rid"), body.get("path"), body.get("keep_running", False)
        check_rid("rid", rid)
        path = check_path("path", path)
        if type(keep) is not bool:
            return _bad("keep_running", "true or false", keep)
        out = await _frontend().call(HsnapExportReqInput(op_id=uuid.uuid4().hex, rid=rid, path=_local(path), keep_running=keep))
        return _answer_response(out)

    @r.post("/drain")
    @_contained("drain")
    async def drain(request: Request):
        body = await _body(request)
        d = check_path("dir", body.get("dir"), what="a directory or s3:// prefix (string)")
        dedup, page = body.get("dedup", False), body.get("page_size", 0)
        if type(dedup) is not bool:
            return _bad("dedup", "true or false", dedup)
        if type(page) is not int or not 0 <= page <= MAX_PAGE_SIZE:  # spec 5.10: every page object fits its header
            return _bad("page_size", f"positions per page object, 1..{MAX_PAGE_SIZE} (0: the default)", page)
        out = await _frontend().call(HsnapDrainReqInput(op_id=uuid.uuid4().hex, dir=_local(d, "dir"), dedup=dedup, page_size=page))
        return _answer_response(out)

    @r.post("/checkpoint")
    @_contained("checkpoint")
    async def checkpoint(request: Request):
        body = await _body(request)
        rid, d, every = body.get("rid"), body.get("dir"), body.get("every")
        check_rid("rid", rid)
        if type(every) is not int or not 0 <= every <= 1 << 32:
            return _bad("every", "output tokens between checkpoints, >= 1 (0: stop)", every)
        if every == 0 and d is None:
            d = ""
        else:
            d = check_path("dir", d, what="a directory or s3:// prefix (string)")
        out = await _frontend().call(HsnapCheckpointReqInput(op_id=uuid.uuid4().hex, rid=rid, dir=_local(d, "dir") if d else d, every=every))
        return _answer_response(out)

    @r.get("/stats")
    @_contained("stats")
    async def stats(rid: str | None = None):
        if rid is not None:
            check_rid("rid", rid)
        out = await _frontend().call(HsnapStatsReqInput(op_id=uuid.uuid4().hex, rid=rid))
        return _answer_response(out)

    @r.post("/resume")
    @_contained("resume")
    async def resume(request: Request):
        asked_at = time.monotonic()
        body = await _body(request)
        path, stream, text_lp = body.get("path"), body.get("stream", False), body.get("return_text_in_logprobs", False)
        path = check_path("path", path, what="a snapshot path, a directory of snapshots or an s3:// URL (string)")
        if type(stream) is not bool or type(text_lp) is not bool:
            return _bad("stream", "true or false", stream)
        again = body.get("again", False)
        if type(again) is not bool:
            return _bad("again", "true or false (true: resume a snapshot already resumed once)", again)
        fe = _frontend()
        tm = fe.tm
        # the scheduler proves the snapshot while the listing, the record read, the claim and the registration run here
        ahead = await fe.prove_ahead(path)

        def listed() -> tuple[list, Any, bool]:
            """The listing and the first entry's preparation, one job off the event loop (what it raises: that
            entry's refusal); whether ``path`` is that one snapshot (what was proved ahead)."""
            local = _local(path)
            found = snapshot_entries(local)
            if not found:
                return found, None, False
            try:
                return found, fe.prepare(found[0], again=again), len(found) == 1
            except Exception as e:  # noqa: BLE001 - answered as that entry's refusal (resume_one raises it)
                return found, e, len(found) == 1

        try:
            entries, first, single = await asyncio.to_thread(listed)
        except HsnapError as e:  # a listing the store refused (typed, named)
            await fe.drop_ahead(ahead)
            return _error_response(error_dict(e))
        except OSError as e:
            await fe.drop_ahead(ahead)
            return _error_response(error_dict(HsnapError(path, "path", Phrase("a readable snapshot or directory"), Phrase(str(e)))))
        if not single:  # a directory of snapshots: each is proved as its resume arrives
            await fe.drop_ahead(ahead)
            ahead = None
        if not entries:
            return _error_response(error_dict(HsnapError(path, "path", Phrase("a snapshot, or a directory holding *.hsnap snapshots"),
                                                         Phrase("no snapshot"))))
        resumed: list = []
        results: list[dict[str, Any]] = []
        for i, entry in enumerate(entries):
            try:
                obj, result = await fe.resume_one(entry, stream=stream, text_in_logprobs=text_lp, request=request, again=again,
                                                  **({"prepared": first, "asked_at": asked_at, "ahead": ahead} if i == 0 else {}))
            except _AnsweredError as e:
                results.append({"path": entry, "ok": False, "error": e.error})
                continue
            except HsnapError as e:
                results.append({"path": entry, "ok": False, "error": error_dict(e)})
                continue
            except Exception as e:  # noqa: BLE001 - the call answers; the server keeps serving
                logger.exception("hsnap resume of %s failed", entry)
                results.append({"path": entry, "ok": False, "error": error_dict(PluginError(entry, "resume", detail=f"{type(e).__name__}: {e}"))})
                continue
            resumed.append(obj)
            results.append({"path": entry, "ok": True, "result": result})
        for item in results:
            inner = item["result"] if item["ok"] else item["error"]
            record_answer(200 if item["ok"] else int(inner.get("status", 500)), dict(inner, path=item["path"]))
        if not resumed:
            return _error_response(results[0]["error"], logged=True)
        header = json.dumps(results[0] if len(entries) == 1 and os.fspath(entries[0]) == _local(path) else results,
                            separators=(",", ":"), default=str)
        headers = {RESUME_HEADER: header if len(header) <= _HEADER_LIMIT else json.dumps({"truncated": True, "resumed": len(resumed)})}
        return await _respond(tm, resumed, request, stream=stream, headers=headers, single=len(entries) == 1, asked_at=asked_at)

    @r.post("/migrate")
    @_contained("migrate")
    async def migrate(request: Request):
        body = await _body(request)
        rid, d = body.get("rid"), body.get("dir")
        tail, rounds, timeout_s, fsync = body.get("tail", 16), body.get("max_rounds", 8), body.get("timeout_s", 60), body.get("fsync", False)
        rid = check_rid("rid", rid)
        d = check_path("dir", d, what="a directory or s3:// prefix the target follows (string)")
        if type(tail) is not int or not 0 <= tail <= 1 << 20:
            return _bad("tail", "rows left at most when the request stops, 0..1048576", tail)
        if type(rounds) is not int or not 1 <= rounds <= 1000:
            return _bad("max_rounds", "pre-copy rounds at most, 1..1000", rounds)
        if type(timeout_s) not in (int, float) or not 0 < timeout_s <= MAX_FOLLOW_TIMEOUT_S:  # as a follow's wait: bounded
            return _bad("timeout_s", f"seconds a round may wait for the target, (0, {MAX_FOLLOW_TIMEOUT_S:g}]", timeout_s)
        if type(fsync) is not bool:
            return _bad("fsync", "true or false", fsync)
        relay_to = body.get("relay_to")
        if relay_to is not None and type(relay_to) is not str:
            return _bad("relay_to", "the target server's URL, http(s)://host:port (string), or null", relay_to)
        fe, container = _frontend(), _local(d, "dir")
        if is_url(container):  # the scheduler looks in a directory itself (stats); HEADs under a prefix: here, off the loop
            store = store_for(container)
            used = await asyncio.to_thread(container_used, store, container)
            if used is not None:
                raise SnapshotExistsError(used, "dir", Phrase("a container no migration has used"), Phrase("a link exists"))
        opened = None
        if relay_to is not None:  # the target follows first (this process reads its stream for the request's client)
            opened = await relay.open_relay(fe, rid, confine.resolve_peer(relay_to, "relay_to"), d, container, timeout_s=float(timeout_s))
        try:
            out = await fe.call(HsnapMigrateReqInput(op_id=uuid.uuid4().hex, rid=rid, dir=container, tail=tail, max_rounds=rounds,
                                                     timeout_s=float(timeout_s), fsync=fsync))
        except BaseException:
            if opened is not None:
                await relay.drop(fe, opened)
            raise
        if opened is not None:
            if out.ok:
                out.result = dict(out.result, relay={"target": opened.target})
            else:
                await relay.drop(fe, opened)
        return _answer_response(out)

    @r.post("/follow")
    @_contained("follow")
    async def follow(request: Request):
        body = await _body(request)
        d, rid, stream = body.get("dir"), body.get("rid"), body.get("stream", False)
        text_lp, timeout_s = body.get("return_text_in_logprobs", False), body.get("timeout_s", 60)
        d = check_path("dir", d, what="the directory or s3:// prefix a source migrates through (string)")
        if rid is not None:
            check_rid("rid", rid, what="the request id expected (string) or null")
        if type(stream) is not bool or type(text_lp) is not bool:
            return _bad("stream", "true or false", stream)
        if type(timeout_s) not in (int, float) or not 0 < timeout_s <= MAX_FOLLOW_TIMEOUT_S:
            return _bad("timeout_s", f"seconds to wait for each link, (0, {MAX_FOLLOW_TIMEOUT_S:g}]", timeout_s)
        fe = _frontend()
        try:
            with _FOLLOWS:  # at most MAX_FOLLOWS at once (a typed 429 past it); the scheduler bounds them too
                obj, result = await fe.follow(_local(d, "dir"), rid=rid, timeout_s=float(timeout_s), stream=stream, text_in_logprobs=text_lp,
                                              request=request)
        except _AnsweredError as e:
            return _error_response(e.error)
        except HsnapError as e:
            return _error_response(error_dict(e))
        header = json.dumps(result, separators=(",", ":"), default=str)
        headers = {RESUME_HEADER: header if len(header) <= _HEADER_LIMIT else json.dumps({"truncated": True, "rid": result.get("rid")})}
        return await _respond(fe.tm, [obj], request, stream=stream, headers=headers, single=True)

    @r.post("/attach")
    @_contained("attach")
    async def attach(request: Request):
        body = await _body(request)
        rid, stream = check_rid("rid", body.get("rid")), body.get("stream", True)
        if type(stream) is not bool:
            return _bad("stream", "true or false", stream)
        deadline = time.monotonic() + restart.READY_WAIT_S
        while restart.resuming() and restart.held(rid) is None and time.monotonic() < deadline:
            await asyncio.sleep(ATTACH_POLL_S)  # the resume at start claimed its snapshots and has not yet reported
        held = restart.take(rid)  # typed 404 / 409: not held here, or another client has it
        info = {"path": held.path, "ok": True, "result": {"rid": rid, "attached": True,
                                                          "client_had": {"text_chars": 0, "output_ids": 0, "incremental": False}}}
        return await _attached(held, stream=stream, headers={RESUME_HEADER: json.dumps(info, separators=(",", ":"), default=str)})

    from sglang.srt.utils.auth import AuthLevel, auth_level

    for route in r.routes:  # admin operations: SGLang's middleware asks for the admin key (else the API key)
        auth_level(AuthLevel.ADMIN_OPTIONAL)(route.endpoint)
    return r


async def _respond(tm, resumed: list, request, *, stream: bool, headers: dict, single: bool, asked_at: float | None = None):
    """The resumed requests' outputs in /generate's shape: one JSON (a list for several), or an event stream
    (``asked_at``: when the resume was asked for, its first event observed as resume-to-first-token)."""
    from fastapi.responses import JSONResponse, StreamingResponse
    from sglang.srt.entrypoints.http_server import dumps_json

    fe = getattr(tm, "_hsnap", None)
    # made as each was registered (_Frontend._registered); a relayed migration out of here may continue each
    waiters = [obj.hsnap_waiter if fe is None else relay.relayed(fe, obj, obj.hsnap_waiter) for obj in resumed]
    if not stream:
        outs = [await w.__anext__() for w in waiters]
        return JSONResponse(content=outs[0] if len(outs) == 1 and single else outs, headers=headers)

    async def events():
        queue: asyncio.Queue = asyncio.Queue()

        async def pump(w):
            try:
                async for out in w:
                    await queue.put(out)
            except HsnapError as e:  # a relayed migration's target went away (typed)
                await queue.put({"error": error_dict(e)})
            except ValueError as e:  # a disconnect or an abort, as /generate reports it
                await queue.put({"error": {"message": str(e), "type": "invalid_request_error"}})
            finally:
                await queue.put(None)

        tasks = [asyncio.create_task(pump(w)) for w in waiters]
        left, timed = len(tasks), False
        try:
            while left:
                out = await queue.get()
                if out is None:
                    left -= 1
                    continue
                if not timed:
                    timed = True
                    if asked_at is not None:
                        metrics.observe("first_token", time.monotonic() - asked_at)
                yield b"data: " + dumps_json(out) + b"\n\n"
            yield b"data: [DONE]\n\n"
        finally:
            for t in tasks:
                t.cancel()

    return StreamingResponse(events(), media_type="text/event-stream", headers=headers, background=_abort_when_gone(tm, resumed))


ATTACH_POLL_S = 0.02  # how often an attached stream looks for the held request's next event


async def _attached(held, *, stream: bool, headers: dict):
    """A request held since the server resumed it at start (:mod:`.restart`): its latest event (the text and ids so
    far), then each newer one until it ends.  The request is the server's: a client that goes away leaves it
    running, and it may be attached to again (one client at a time)."""
    from fastapi.responses import JSONResponse, StreamingResponse
    from sglang.srt.entrypoints.http_server import dumps_json

    if not stream:
        while not held.done:
            await asyncio.sleep(ATTACH_POLL_S)
        return JSONResponse(content=held.event, headers=headers)

    async def events():
        last, ended = None, False
        try:
            while True:
                done = held.done  # first: a request marked done already holds its last event
                ev = held.event
                if ev is not None and ev is not last:
                    last = ev
                    yield b"data: " + dumps_json(ev) + b"\n\n"
                if done and ev is last:
                    break
                await asyncio.sleep(ATTACH_POLL_S)
            yield b"data: [DONE]\n\n"
            ended = True
        finally:
            if not ended:
                restart.release(held)  # the client went away mid-stream: another may attach

    return StreamingResponse(events(), media_type="text/event-stream", headers=headers)


def _abort_when_gone(tm, resumed: list):
    """One request or many, the same: once the stream ends, each resumed request still running is aborted (2 s
    later, SGLang's delay for /generate) — its client went away without pausing it (``hsnap resume`` pauses them on
    Ctrl-C before it closes the stream).  A request that finished or was exported is gone by then: nothing to do."""
    return _delayed_abort(tm, lambda: [obj.rid for obj in resumed])


__all__ = ["HsnapFrontend", "install", "before_launch_server", "after_sigterm", "DRAIN_ON_SIGTERM_ENV", "router", "read_resume_info", "snapshot_entries", "RESUME_HEADER"]
