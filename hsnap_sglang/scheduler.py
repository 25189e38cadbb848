"""hsnap in SGLang's scheduler process (every TP rank): export a request at a committed decode boundary, resume a
snapshot as a decoding request, drain, and count the forwards each request got.

Where the work happens (``event_loop_normal`` / ``event_loop_overlap`` of SGLang 0.5.23):

* the hsnap messages are dispatched in ``process_input_requests`` (inside ``ingest_requests``), right after the
  previous batch's ``process_batch_result``: a committed boundary (every output token of the request is appended,
  ``kv_committed_len == kv_allocated_len == seqlen - 1``).  An export is queued there and run by
  :func:`after_ingest` in the same iteration, before the next batch is scheduled: at TP 1 only its capture (host
  copies of the rows, the state and the record) runs there; the link writer thread writes and commits the file, the
  request held out of every batch (``writing``) until the snapshot is durable (then released) or failed (then it
  decodes on).  A TP set and a dedup drain are still written on the scheduler thread.
* with the overlap scheduler the batch launched in the previous iteration is still in flight at that point (its
  result is processed later in the iteration).  The request is then *parked*: taken out of the running batch
  (``ScheduleBatch.filter_batch``), so no further batch includes it; the export runs at the next ``ingest`` once no
  queued result holds it — a boundary no batch in flight has passed.  ``keep_running`` puts it back afterwards.
* a request that is queued or still being prefilled (chunked prefill) is **waited for**: it is exported at its
  first committed decode boundary (one output token), unless it finishes first (``RequestFinishedError``).
* resume admits the restored ``Req`` as SGLang's PD-decode admission does (``prepare_for_prebuilt``: metadata of a
  request whose KV is in place), stashes its last output token in the scheduler's ``FutureMap`` (the decode input
  relay) and merges it into the running batch: its next forward is a decode; it never extends.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import os
import time
from collections import OrderedDict
from typing import Any

import torch

from hsnap_format import HsnapError, IncompatibleSnapshotError, SnapshotExistsError
from hsnap_format.errors import Phrase

from hsnap_format.stores import is_url, store_for

from .errors import (PluginError, RemoteRankError, RequestBusyError, RequestFinishedError, UnknownRequestError, error_dict, error_of,
                     unknown_request)
from . import confine, metrics, migration, retraction
from .containment import contained_handler, guarded, log_failure, typed, typed_in_dir
from .jobs import (IDLE_PROOF_WAIT_S, MAX_PROVED_AHEAD, PROVED_AHEAD_TTL_S, Checkpointing, Drain, Export, Job, LinkJob, LinkWriter, ProvedAhead,
                   Resuming, proof_here_bytes, proves_here, safe_file_name)
from .client import HAND_OFF
from .detokenize import anchor_detokenizer
from .messages import (HsnapAdmitReqInput, HsnapCheckpointReqInput, HsnapDrainReqInput, HsnapExportReqInput, HsnapFollowReqInput,
                       HsnapMigrateReqInput, HsnapProveAheadReqInput, HsnapReqOutput, HsnapResumeReqInput, HsnapStatsReqInput)

logger = logging.getLogger("hsnap_sglang")



MAX_COUNTED_RIDS = 4096  # per-rid forward counts kept (oldest forgotten first)
MAX_FINISHED_RIDS = 4096  # rids of requests that finished here lately: an export of one answers "finished", not "unknown"
DEDUP_PAGE_SIZE = 64  # positions per page object of a dedup drain (the pool's own page is 1 on CPU: a file per token)
_ERROR_BYTES = 4096  # one rank's error, as JSON, in the TP agreement


# ----------------------------------------------------------------------------- hooks (plugin.HOOKS)


def install(result, sched, *args, **kwargs):
    """AFTER ``Scheduler.init_request_dispatcher``: the hsnap request types join SGLang's dispatcher."""
    from sglang.utils import TypeBasedDispatcher

    global _ACTIVE
    sched._hsnap = _ACTIVE = HsnapScheduler(sched)
    sched._request_dispatcher += TypeBasedDispatcher(sched._hsnap.handlers())


def after_ingest(result, sched, *args, **kwargs):
    """AFTER ``Scheduler.ingest_requests``: a committed boundary; run the exports that can run now."""
    hs = getattr(sched, "_hsnap", None)
    if hs is not None and (hs.pending or hs.checkpoints or hs.links.busy() or hs.after_links or hs.migrations or hs.follows or hs.arrived
                           or hs.resuming or hs.proved_ahead or hs.telling or (hs.retraction is not None and hs.retraction.busy())):
        guarded("service", hs.service)  # each part is contained on its own; this is the last line of defence


def around_process_batch_result(original, sched, batch, result, *args, **kwargs):
    """AROUND ``Scheduler.process_batch_result``: count, per request, the completed forwards whose output it took
    (a request already finished or retracted when the result comes — the overlap scheduler's one extra step — is
    not counted)."""
    hs = getattr(sched, "_hsnap", None)
    live = guarded("counting forwards", lambda: [r.rid for r in batch.reqs if not r.finished() and not r.is_retracted],
                   default=None) if hs is not None else None
    mode = batch.forward_mode
    out = original(sched, batch, result, *args, **kwargs)  # exactly once, outside any guard: its errors are SGLang's
    if live is not None:
        guarded("counting forwards", hs.count, mode, live)
        guarded("counting forwards", hs.note_finished, batch.reqs)
    return out


def around_session_kv_rows(original, observer, *args, **kwargs):
    """AROUND ``SchedulerPoolStatsObserver._session_kv_rows``: SGLang's pool accounting (its strict idle memory check, the
    pool stats) counts the slots this plug-in holds outside any batch (a migration being applied, a migrated request
    waiting for admission) as held, as it counts a streaming session's."""
    rows = original(observer, *args, **kwargs)
    hs = _ACTIVE
    if hs is not None and (hs.follows or hs.arrived):
        rows = list(rows) + guarded("held rows", migration.held_kv_rows, hs, default=[])
    if hs is not None and hs.writing:  # requests held while their export is written (slots released once durable)
        rows = list(rows) + [req.kv for req in hs.writing.values()]
    return rows


_ACTIVE = None  # the HsnapScheduler of this process (one scheduler per process)


def around_release_req(original, batch, idx, remaing_req_count, *args, **kwargs):
    """AROUND ``ScheduleBatch.release_req`` (a retraction or a priority preemption; SGLang passes ``offload_kv=False``
    only where the request is aborted): with retraction to disk on, the request is copied to host memory before
    SGLang frees its slots (:mod:`.retraction`)."""
    rt = _ACTIVE.retraction if _ACTIVE is not None else None
    retracting = rt is not None and kwargs.get("offload_kv", args[0] if args else True)
    req = batch.reqs[idx] if retracting else None
    if req is not None:
        guarded("retraction to disk", rt.before_release, req)
    out = original(batch, idx, remaing_req_count, *args, **kwargs)  # exactly once, outside any guard
    if req is not None:
        guarded("retraction to disk", rt.after_release, req, out)
    return out


def around_add_request_to_queue(original, sched, req, *args, **kwargs):
    """AROUND ``Scheduler._add_request_to_queue``: a request retracted to disk is held by hsnap, not queued for a
    new prefill."""
    hs = getattr(sched, "_hsnap", None)
    if hs is not None and hs.retraction is not None and guarded("retraction to disk", hs.retraction.take, req, default=False):
        return None
    return original(sched, req, *args, **kwargs)


def around_abort_request(original, sched, recv_req, *args, **kwargs):
    """AROUND ``Scheduler.abort_request``: requests retracted to disk that the abort names go back into SGLang's
    waiting queue first, where SGLang's own abort finds and answers them."""
    hs = getattr(sched, "_hsnap", None)
    if hs is not None and hs.retraction is not None and hs.retraction.held:
        guarded("abort of a retracted request", hs.retraction.release_for_abort,
                lambda rid: bool(recv_req.abort_all) or rid.startswith(recv_req.rid))
    return original(sched, recv_req, *args, **kwargs)


def around_maybe_sleep_on_idle(original, sched, *args, **kwargs):
    """AROUND ``Scheduler.maybe_sleep_on_idle`` (``--sleep-on-idle``): an idle scheduler that follows a migration,
    proves a resume (or writes a retracted request) waits at most 1 ms for a message, not a second: what it waits for
    arrives through the store or a thread, not a socket."""
    hs = getattr(sched, "_hsnap", None)
    if hs is not None and (hs.follows or hs.migrations or hs.arrived or hs.resuming or hs.telling or hs.links.busy()
                           or (hs.retraction is not None and hs.retraction.busy())):
        sleeper = getattr(sched, "idle_sleeper", None)
        try:
            if sleeper is not None and hasattr(sleeper, "poller"):
                sleeper.poller.poll(1)
            return None
        except Exception as e:  # noqa: BLE001 - a poll that fails: SGLang's own sleep instead (the original, once)
            log_failure("idle poll", e)
    return original(sched, *args, **kwargs)


def _finish_reason_class():
    from sglang.srt.managers.schedule_batch import BaseFinishReason

    class FINISH_HSNAP_EXPORT(BaseFinishReason):
        """The request left this server as a snapshot: the client's stream ends saying where it is."""

        def __init__(self, path: str, snapshot_id: str, committed: int, migration: str | None = None):
            super().__init__()
            self.path, self.snapshot_id, self.committed, self.migration = path, snapshot_id, committed, migration

        def to_json(self):
            out = {"type": HAND_OFF, "path": self.path, "snapshot_id": self.snapshot_id, "committed_positions": self.committed}
            if self.migration is not None:
                out["migration"] = self.migration  # the container a target follows: the request goes on there
            return out

    return FINISH_HSNAP_EXPORT


class HsnapScheduler:
    """hsnap in one scheduler process (every TP rank): the handlers of the hsnap messages and the jobs they queue
    (exports waiting for a committed boundary, requests parked or held while written, checkpoints, migrations);
    :mod:`.migration` drives its migrations through the public methods here."""

    def __init__(self, sched) -> None:
        from sglang.srt.runtime_context import get_parallel

        self.sched = sched
        parallel = get_parallel()
        self.tp_size, self.tp_rank = int(parallel.tp_size), int(parallel.tp_rank)
        self.group = sched.tp_cpu_group if self.tp_size > 1 else None
        self.pending: list[Export] = []
        self.parked: dict[str, Any] = {}  # rid -> Req out of the running batch (overlap), until exported/given back
        self.writing: dict[str, Any] = {}  # rid -> Req held out of every batch while the link writer writes its export
        self.forwards: OrderedDict[str, dict[str, int]] = OrderedDict()
        self.checkpoints: dict[str, Checkpointing] = {}  # rid -> its periodic checkpoints
        self.links = LinkWriter()  # writes the checkpoint links off the decode path
        self.after_links: list = []  # checkpoint messages taken up once their request's link on the way is collected
        self.migrations: dict[str, Any] = {}  # rid -> migration.Migrating (source side)
        self.follows: dict[str, Any] = {}  # op_id -> migration.Following (target side)
        self.arrived: dict[str, Any] = {}  # rid -> (Req, Following): migrated in, waiting for the HTTP process's admission
        self.resuming: dict[str, Resuming] = {}  # op_id -> a resume whose snapshot is proved off this thread, in arrival order
        self.proved_ahead: dict[str, ProvedAhead] = {}  # op_id -> a proof started before its resume arrived, oldest first
        self.telling: list[tuple[Job, Any, dict]] = []  # refusals answered once the marker that tells the other side is written
        self.proof_here_bytes = proof_here_bytes()
        self.finish_reason = _finish_reason_class()
        self._identity = None
        self._sharding: tuple | None = None  # (Sharding or None,) once computed
        self.exports = self.resumes = 0
        self.finished: OrderedDict[str, str] = OrderedDict()  # rid -> how it finished (its finish reason's type), newest last
        self.retraction = retraction.from_env(self)  # retracted requests to disk (the operator's HSNAP_RETRACT_DIR), or None

    def handlers(self):
        """Every handler contained: whatever it raises, its message is answered with a typed error (logged once)
        and SGLang's scheduler loop goes on."""
        table = [(HsnapExportReqInput, "export", self.on_export), (HsnapResumeReqInput, "resume", self.on_resume),
                 (HsnapProveAheadReqInput, "proof ahead of a resume", self.on_prove_ahead),
                 (HsnapDrainReqInput, "drain", self.on_drain), (HsnapCheckpointReqInput, "checkpoint", self.on_checkpoint),
                 (HsnapStatsReqInput, "stats", self.on_stats), (HsnapMigrateReqInput, "migrate", self._on(migration.on_migrate)),
                 (HsnapFollowReqInput, "follow", self._on(migration.on_follow)), (HsnapAdmitReqInput, "admit", self._on(migration.on_admit))]
        return [(kind, contained_handler(self.answer, where, fn)) for kind, where, fn in table]

    def _on(self, fn):
        def handler(msg):
            fn(self, msg)
            return None

        return handler

    # ------------------------------------------------------------------ helpers

    def identity(self):
        if self._identity is None:
            from .identity import server_identity

            self._identity = server_identity(self.sched.server_args, tp_size=self.tp_size, tp_rank=self.tp_rank)
        return self._identity

    def sharding(self):
        """This rank's ``geometry.sharding`` (:func:`hsnap_io.reshard.describe` of the model at this TP size), for a
        set of another TP size to be re-sharded as it is resumed; None for a family :mod:`.sharding` has no row for
        (such a set is refused)."""
        if self._sharding is None:
            from hsnap_io.reshard import describe

            from .sharding import tp_model

            model = tp_model(self.sched.model_config.hf_text_config)
            self._sharding = (describe(model, self.tp_size, self.tp_rank) if model is not None else None,)
        return self._sharding[0]

    def resume_context(self) -> dict[str, Any]:
        """What a request resumed or migrated into this scheduler is checked against and built with (keywords of
        ``resume_req`` / ``prepare_req``): the tokenizer, the grammar backend, the LoRA adapters loaded, the model's
        vocabulary size and the ``Req`` constructor's extras (the metrics collector, where metrics are on)."""
        s = self.sched
        registry = getattr(getattr(getattr(s, "tp_worker", None), "model_runner", None), "lora_manager", None)
        req_kwargs = {"metrics_collector": s.metrics_collector} if getattr(s.metrics_reporter, "enable_metrics", False) else {}
        return dict(tokenizer=s.tokenizer, grammar_backend=getattr(s.grammar_manager, "grammar_backend", None),
                    loaded_lora_ids=set(getattr(registry, "loras", None) or {}), vocab_size=s.model_config.vocab_size, req_kwargs=req_kwargs)

    def answer(self, op, *, ok: bool, result=None, error=None, items=None) -> None:
        out = HsnapReqOutput(op_id=op.op_id, rid=op.rid, ok=ok, result=result or {}, error=error, items=items or [])
        self.sched.send_control_output(out, op)  # rank 0 only (SGLang's sender is a no-op on the others)

    def answer_once_told(self, told: Job | None, op, *, error: dict) -> None:
        """Answer ``op``'s refusal once ``told`` — the marker that tells the other side of a migration why
        (``abandoned.json``, ``refused.json``), written off this thread — has ended (None: now), so a caller told the
        migration is over finds the marker there."""
        if told is None or told.done:
            self.answer(op, ok=False, error=error)
        else:
            self.telling.append((told, op, error))

    def answer_told(self) -> None:
        """At an iteration: the refusals whose marker is written now."""
        waiting, self.telling = self.telling, []
        for told, op, error in waiting:
            if told.done:
                guarded("answering a refusal", self.answer, op, ok=False, error=error)
            else:
                self.telling.append((told, op, error))

    def locate(self, rid: str):
        """Where ``rid`` is: ("running" | "parked" | "prefilled" | "prefilling" | "waiting", Req) or (None, None)."""
        s = self.sched
        for req in s.running_batch.reqs:
            if req.rid == rid:
                return "running", req
        if rid in self.parked:
            return "parked", self.parked[rid]
        if rid in self.writing:
            return "writing", self.writing[rid]
        if rid in self.arrived:
            return "arrived", self.arrived[rid][0]
        chunked = s.chunked_req
        if chunked is not None and chunked.rid == rid:
            return "prefilling", chunked
        last = s.last_batch
        if last is not None and last.forward_mode.is_extend():
            for req in last.reqs:  # prefilled in the last step, merged into the running batch at the next
                if req.rid == rid:
                    return "prefilled", req
        for batch, _ in getattr(s, "result_queue", ()):
            for req in batch.reqs:
                if req.rid == rid and not req.finished():
                    return "prefilled", req
        for req in s.waiting_queue:
            if req.rid == rid:
                return "waiting", req
        held = self.retraction.held.get(rid) if self.retraction is not None else None
        if held is not None:
            return "retracted", held.req
        grammar = getattr(s.grammar_manager, "grammar_queue", None) or ()
        for req in grammar:
            if getattr(req, "rid", None) == rid:
                return "waiting", req
        return None, None

    def note_finished(self, reqs) -> None:
        """Remember the rids of ``reqs`` that finished (a bounded LRU)."""
        for req in reqs:
            if req.finished():
                why = req.finished_reason.to_json() if req.finished_reason is not None else None
                self.finished[req.rid] = str(why.get("type", "finished") if isinstance(why, dict) else "finished")
                self.finished.move_to_end(req.rid)
        while len(self.finished) > MAX_FINISHED_RIDS:
            self.finished.popitem(last=False)

    def absent(self, rid: str) -> HsnapError:
        """The refusal for a rid no request of this server has: finished lately (409, saying how) or unknown (404)."""
        how = self.finished.get(rid)
        if how is not None:
            return RequestFinishedError(None, "rid", Phrase("a request still running, queued or being prefilled in this server"),
                                        Phrase(f"finished ({how})"))
        return unknown_request(rid, self.rids_here(), "a request running, queued or being prefilled in this server")

    def rids_here(self) -> list[str]:
        """The rids of this server's requests: running, held by hsnap, being prefilled, queued, retracted to disk."""
        s = self.sched
        chunked = [s.chunked_req] if s.chunked_req is not None else []
        reqs = [*s.running_batch.reqs, *self.parked.values(), *self.writing.values(), *chunked, *s.waiting_queue, *self.retracted()]
        return list(dict.fromkeys(r.rid for r in reqs if not r.finished()))

    def retracted(self) -> list:
        """The requests retracted to disk, held out of SGLang's queues until they fit again."""
        return [h.req for h in self.retraction.held.values()] if self.retraction is not None else []

    def room(self) -> "_Room | None":
        """Room for a restore made the way SGLang's admission makes it, where a radix cache can free slots; else None
        (the header's capacity check)."""
        s = self.sched
        return _Room(s) if s.tree_cache.supports_prefix_sharing() else None

    def in_flight(self, req) -> bool:
        """A batch whose result is not processed yet holds ``req`` (the overlap scheduler)."""
        return any(req in batch.reqs for batch, _ in getattr(self.sched, "result_queue", ()))

    # ------------------------------------------------------------------ export

    def on_export(self, msg: HsnapExportReqInput):
        where, req = self.locate(msg.rid)
        try:
            if where is None:
                raise self.absent(msg.rid)
            if self.busy(msg.rid):
                raise RequestBusyError(None, "rid", Phrase("a request no other export is waiting for"), msg.rid)
            self._check_target(msg.path)
        except HsnapError as e:
            self.answer(msg, ok=False, error=error_dict(e))
            return None
        self.drop_links(msg.rid)
        self.pending.append(Export(msg.rid, msg.path, bool(msg.keep_running), time.monotonic(), op=msg, req=req, found_in=where))
        return None  # answered by service(), at the boundary

    def busy(self, rid: str) -> bool:
        """An export asked for by a caller (not a checkpoint link) waits for ``rid``, or is being written."""
        job = self.links.in_flight.get(rid)
        return (rid in self.migrations or any(e.rid == rid and e.checkpoint is None for e in self.pending)
                or (job is not None and job.ex.checkpoint is None and job.ex.migration is None))

    def drop_links(self, rid: str) -> None:
        """A pending checkpoint link of ``rid`` gives way to the export queued next (which takes over a parked
        request: it finds it parked)."""
        self.pending = [e for e in self.pending if not (e.rid == rid and e.checkpoint is not None)]

    def _check_target(self, path: str) -> None:
        confine.resolve(path, "path", confine.FILE)  # the HTTP edge checked it; again where it is written
        _check_target_free(path)

    def service(self) -> None:
        """Run every export whose request is at a committed decode boundary now; park (overlap) those whose last
        batch is still in flight; keep waiting for the ones being queued or prefilled."""
        if self.resuming:
            guarded("finishing resumes", self.finish_resumes)
        if self.proved_ahead:
            guarded("expiring proofs ahead of their resume", self._expire_proved_ahead)
        if self.telling:
            guarded("answering refusals told", self.answer_told)
        if self.links.busy():
            guarded("collecting checkpoint links", self.collect_links)
        if self.checkpoints:
            guarded("queueing checkpoint links", self._queue_due_links)
        if self.migrations:
            guarded("advancing migrations", migration.advance_migrations, self)
        if self.follows:
            guarded("advancing follows", migration.advance_follows, self)
        if self.arrived:
            guarded("expiring arrivals", migration.expire_arrivals, self)
        if self.retraction is not None and self.retraction.busy():
            guarded("restoring retracted requests", self.retraction.service)
        for ex in list(self.pending):
            try:
                self._service_one(ex)
            except Exception as e:  # noqa: BLE001 - a fault of the plug-in never takes the scheduler down
                logger.exception("hsnap export of %s failed", ex.rid)
                if ex in self.pending:
                    self.pending.remove(ex)
                parked = self.parked.pop(ex.rid, None)
                if parked is not None and not parked.finished():
                    self.admit([parked])
                self._done(ex, error=error_dict(PluginError(ex.path, "export", detail=f"{type(e).__name__}: {e}")))

    def _service_one(self, ex: Export) -> None:
        where, req = self.locate(ex.rid)
        if req is not None:
            ex.req = req
        if where is None or (ex.req is not None and ex.req.finished()):
            self.pending.remove(ex)
            self.parked.pop(ex.rid, None)
            self.links.exports_waiting.discard(ex.rid)
            why = ex.req.finished_reason.to_json() if ex.req is not None and ex.req.finished_reason is not None else None
            self._done(ex, error=error_dict(RequestFinishedError(ex.path, "request", Phrase("a request still decoding at the export boundary"),
                                                                 Phrase(f"finished: {json.dumps(why)}" if why else "gone"))))
        elif where in ("running", "parked") and not self.in_flight(req):  # snapshot_req refuses anything uncommitted
            if ex.checkpoint is None and ex.rid in self.links.in_flight:
                # a pause/drain/export/migration of a checkpointed request: its link on the way is committed first (and
                # answered), so no link is written after this export and the final snapshot follows the last link — at
                # a boundary after it is collected; the scheduler goes on meanwhile (no link is queued behind the export)
                self.links.exports_waiting.add(ex.rid)
                self._decode_on(ex, req, where)
                return
            self.links.exports_waiting.discard(ex.rid)
            background = self._writes_in_background(ex)
            if background and self.links.full():  # the writer is behind: a later boundary (the request decodes on)
                self._decode_on(ex, req, where)
                return
            self.pending.remove(ex)
            if self.tp_size > 1 and (ex.checkpoint is not None or (ex.migration is not None and ex.keep_running)):
                self._write_link_set(ex, req, where)  # a checkpoint link or a pre-copy round of a TP set
            elif ex.checkpoint is not None or (ex.migration is not None and ex.keep_running):
                self._capture_link(ex, req, where)
            elif ex.migration is not None:
                migration.finish(self, ex, req, where)
            elif background:
                self._capture_export(ex, req, where)
            else:
                self._export(ex, req, where)
        elif where == "running":  # overlap: its last batch is in flight; take it out of the next ones
            self.sched.running_batch.filter_batch(reqs_to_exclude=[req])
            self.parked[ex.rid] = req
            ex.parked = True

    def _decode_on(self, ex: Export, req, where: str) -> None:
        """An export that goes at a later boundary: a request it parked (overlap) decodes on meanwhile."""
        if where == "parked":
            self.parked.pop(ex.rid, None)
            ex.parked = False
            self.admit([req])

    def _writes_in_background(self, ex: Export) -> bool:
        """A plain export or drain member is written by the link writer (TP 1; a dedup drain's page store session
        and a TP set's collectives stay on this thread)."""
        return (self.tp_size == 1 and ex.checkpoint is None and ex.migration is None and ex.base is None
                and (ex.drain is None or ex.drain.pages is None))

    def _capture_export(self, ex: Export, req, where: str) -> None:
        """A plain export at the committed boundary: the rows, the recurrent state and the record copied to host
        memory (the only part the decode waits for); the link writer writes, fsyncs and commits it.  Without
        ``keep_running`` the request is held out of every batch until the snapshot is durable: its slots are
        released then (:meth:`_export_written`), or it decodes on if the write fails (it missed no token)."""
        import uuid

        t0 = time.monotonic()
        sid = uuid.uuid4().hex
        try:
            cap = self.capture(req, ex.path, sid)
        except Exception as e:  # noqa: BLE001 - never take the scheduler down; the request keeps running
            err = error_of(typed(e, "export", ex.path))  # an unexpected one: logged once, a typed PluginError
        else:
            err = None
        if (err is not None or ex.keep_running) and where == "parked":
            self.parked.pop(ex.rid, None)
            self.admit([req])  # back into the running batch: it missed no token
        if err is not None:
            self._done(ex, error=err)
            return
        if not ex.keep_running:  # held out of every batch until durable (SGLang's accounting counts it as held)
            if where == "running":
                self.sched.running_batch.filter_batch(reqs_to_exclude=[req])
            self.parked.pop(ex.rid, None)
            ex.parked = False
            self.writing[ex.rid] = req
        capture_s = time.monotonic() - t0
        result = dict(path=str(ex.path), committed_positions=int(req.kv.kv_committed_len), snapshot_id=sid, tp_size=1, rid=ex.rid,
                      keep_running=ex.keep_running, found_in=ex.found_in, prompt_tokens=len(req.origin_input_ids),
                      output_tokens=len(req.output_ids), captured_bytes=cap.nbytes, timings={"wait_s": t0 - ex.asked, "capture_s": capture_s})
        self.links.submit(LinkJob(ex, cap, result, capture_s))

    def capture(self, req, path: str, snapshot_id: str, base_position: int = 0, extra: dict | None = None):
        """``req``'s record (what snapshot_req refuses, refused here), then its rows after ``base_position``, its
        recurrent state and the record copied to host memory (``hsnap_io.export.CapturedRequest``): what the link
        writer writes while the request decodes on (or is released). ``extra``: record entries written over the
        request's own (a retraction's counters)."""
        from hsnap_io.export import capture_request

        from .req.record import req_record

        record, swa_start = req_record(req, path=path)
        record.extra.update(extra or {})
        s = self.sched
        return capture_request(req_to_token_pool=s.req_to_token_pool, token_to_kv_pool_allocator=s.token_to_kv_pool_allocator,
                               req_pool_idx=int(req.kv.req_pool_idx), record=record, swa_start=swa_start,
                               identity=dataclasses.replace(self.identity(), snapshot_id=snapshot_id), base_position=base_position,
                               sharding=self.sharding())

    def _export_written(self, job: "LinkJob") -> None:
        """A plain export the writer finished (scheduler thread): release the held request, or give it back."""
        ex, req = job.ex, job.ex.req
        if job.error is not None:
            held = self.writing.pop(ex.rid, None)
            if held is not None and not held.finished():
                self.admit([held])  # it decodes on: it missed no token
            self._done(ex, error=job.error)
            return
        info = job.info.info
        result = dict(job.result, bytes=int(info.file_length), payload_bytes=int(info.payload_bytes))
        t_written = time.monotonic()
        if not ex.keep_running:
            self.release_exported(req, result)
            self.checkpoints.pop(ex.rid, None)  # its checkpoints end with it (its last link was committed before)
        self.exports += 1
        t_done = time.monotonic()
        result["timings"] = dict(result["timings"], write_s=job.capture_s + job.writer_s, writer_s=job.writer_s,
                                 release_s=t_done - t_written, pause_to_durable_s=t_written - ex.asked, total_s=t_done - ex.asked)
        self._done(ex, result=result)

    def _export(self, ex: Export, req, where: str) -> None:
        t0 = time.monotonic()
        try:
            info = self.write_snapshot(ex.path, req, base=ex.base, pages=ex.drain.pages if ex.drain is not None else None)
        except Exception as e:  # noqa: BLE001 - never take the scheduler down; the request keeps running
            err = error_of(typed(e, "export", ex.path))  # an unexpected one: logged once, a typed PluginError
        else:
            err = None
        t_written = time.monotonic()
        if err is not None or ex.keep_running:
            if where == "parked":
                self.parked.pop(ex.rid, None)
                self.admit([req])  # back into the running batch: it missed no token
            if err is not None:
                self._done(ex, error=err)
                return
        else:
            self.release_exported(req, info)
            self.checkpoints.pop(ex.rid, None)  # its checkpoints end with it (its last link was committed before)
        self.exports += 1
        t_done = time.monotonic()
        result = dict(info, rid=ex.rid, keep_running=ex.keep_running, found_in=ex.found_in, prompt_tokens=len(req.origin_input_ids),
                      output_tokens=len(req.output_ids),
                      timings={"wait_s": t0 - ex.asked, "write_s": t_written - t0, "release_s": t_done - t_written,
                               "pause_to_durable_s": t_written - ex.asked, "total_s": t_done - ex.asked})
        self._done(ex, result=result)

    def write_snapshot(self, path: str, req, *, base: str | None = None, pages=None) -> dict:
        """Write ``req`` to ``path``: one file at TP 1; at TP > 1 a set (every rank its rank file, manifest last,
        hsnap_io.tp's protocol over the TP CPU group; a local directory or an ``s3://`` prefix). The same collectives run on every rank, whatever fails.
        ``base``: a delta of that link (a checkpoint link; at TP > 1 a set, each rank's file a delta of its rank of
        it); ``pages``: full pages into that page store (a dedup drain; at TP > 1 each rank's session puts its own
        rank's pages into the one page store beside the sets)."""
        import uuid

        from hsnap_io.tp import export_request_tp

        from .req import snapshot_req
        from .req.record import req_record

        s = self.sched
        # the sharding described (format 1.1): a server of another TP size can re-shard what this one writes
        pools = dict(req_to_token_pool=s.req_to_token_pool, token_to_kv_pool_allocator=s.token_to_kv_pool_allocator,
                     sharding=self.sharding())
        identity = self.identity()
        if self.tp_size == 1:
            sid = uuid.uuid4().hex
            info = snapshot_req(path, req, identity=dataclasses.replace(identity, snapshot_id=sid), base=base, pages=pages, **pools)
            return {"path": str(path), "bytes": int(info.file_length), "payload_bytes": int(info.payload_bytes),
                    "committed_positions": int(req.kv.kv_committed_len), "snapshot_id": sid, "tp_size": 1}

        # one snapshot id for the set: rank 0's, sent to the others with the first agreement
        err, record, swa_start = None, None, 0
        try:
            record, swa_start = req_record(req, path=path)
        except HsnapError as e:
            err = e
        agreed = self.agree(err, payload=uuid.uuid4().hex if self.tp_rank == 0 else "")
        if agreed.error is not None:
            raise agreed.error
        sid = agreed.payloads[0]
        manifest = None
        try:
            manifest = export_request_tp(path, identity=dataclasses.replace(identity, snapshot_id=sid), record=record, group=self.group,
                                         swa_start=swa_start, req_pool_idx=int(req.kv.req_pool_idx), base=base, pages=pages, **pools)
        except HsnapError as e:
            err = e
        agreed = self.agree(err, payload=str(sum(r.length for r in manifest.ranks)) if manifest is not None else "")
        if agreed.error is not None:
            raise agreed.error
        return {"path": str(path), "bytes": int(agreed.payloads[0] or 0), "committed_positions": int(req.kv.kv_committed_len),
                "snapshot_id": sid, "tp_size": self.tp_size}

    def release_exported(self, req, info: dict) -> None:
        """The snapshot is durable: end the request the way SGLang ends a finished one (the tree cache's own
        release path: the radix tree keeps what it can key and frees only what the request owns), and close the
        client's stream with a finish reason that says where the snapshot is."""
        from sglang.srt.mem_cache.common import release_kv_cache

        s = self.sched
        req.finished_reason = self.finish_reason(info["path"], info["snapshot_id"], info["committed_positions"], info.get("migration"))
        self.note_finished([req])
        if any(r is req for r in s.running_batch.reqs):
            s.running_batch.filter_batch(reqs_to_exclude=[req])
        self.parked.pop(req.rid, None)
        self.writing.pop(req.rid, None)
        s.batch_result_processor._prepare_kv_cache_release(req)
        release_kv_cache(req, s.tree_cache, checkpoint=True)
        req.time_stats.set_completion_time()
        s.output_streamer.stream_output([req], req.return_logprob)

    def _done(self, ex: Export, *, result=None, error=None) -> None:
        if ex.migration is not None:
            migration.round_done(self, ex, result, error)
            return
        if ex.checkpoint is not None:
            self._link_done(ex, result, error)
            return
        if ex.drain is None:
            self.answer(ex.op, ok=error is None, result=result, error=error)
            return
        d = ex.drain
        d.items[ex.rid] = {"rid": ex.rid, "path": ex.path, "ok": error is None, "result": result, "error": error}
        if len(d.items) == len(d.members):
            items = [d.items[m.rid] for m in d.members]
            result = {"dir": d.op.dir, "requests": len(items)}
            if d.pages is not None:
                result["dedup"] = _dedup_report(d.pages.page_size, self._page_totals(d.pages), items)
                try:
                    d.pages.close()  # its markers: every member is committed (or refused) by now
                except Exception:  # noqa: BLE001 - a marker left behind expires (its lease); the drain is done
                    logger.exception("hsnap drain %s: closing the page store session", d.op.dir)
            if d.op.why == "sigterm":  # said here: SGLang's shutdown may stop the HTTP process before it reads the answer
                exported = sum(1 for i in items if i["ok"])
                (logger.info if exported == len(items) else logger.error)(
                    "hsnap: SIGTERM: drained %d of %d requests into %s", exported, len(items), d.op.dir)
            self.answer(d.op, ok=all(i["ok"] for i in items), items=items, result=result)

    # ------------------------------------------------------------------ drain

    def on_drain(self, msg: HsnapDrainReqInput):
        """Every request present now (running, parked, prefilled, prefilling, queued, retracted to disk) is exported into
        ``dir`` at its next committed decode boundary (queued ones once prefilled, retracted ones once restored);
        answered when all are done."""
        s = self.sched
        rids: list[str] = []
        for req in [*s.running_batch.reqs, *self.parked.values(), *([s.chunked_req] if s.chunked_req is not None else []),
                    *(s.last_batch.reqs if s.last_batch is not None and s.last_batch.forward_mode.is_extend() else []),
                    *[r for b, _ in getattr(s, "result_queue", ()) for r in b.reqs], *s.waiting_queue, *self.retracted()]:
            if not req.finished() and req.rid not in rids and not self.busy(req.rid):
                rids.append(req.rid)
        drain = Drain(msg, [])
        try:
            # made beneath the root (no symlink followed) only when something goes in it: an idle drain writes nothing
            confine.resolve(msg.dir, "dir", confine.DIR, create=bool(rids) and not is_url(msg.dir))
            if msg.dedup and rids:
                if not is_url(msg.dir):
                    confine.resolve(os.path.join(msg.dir, "pages"), "dir", confine.DIR, create=True)
                from hsnap_io.pagestore import page_store

                drain.pages = page_store(store_for(msg.dir).join(msg.dir, "pages"), page_size=msg.page_size or DEDUP_PAGE_SIZE)
            for rid in rids:
                drain.members.append(Export(rid, drain_path(msg.dir, rid, self.tp_size), False, time.monotonic(), drain=drain))
            for m in drain.members:
                self._check_target(m.path)
        except Exception as e:  # noqa: BLE001 - an OS error is the dir's; anything else a typed PluginError (logged)
            if drain.pages is not None:
                guarded("closing a drain's page store", drain.pages.close)
            err = typed_in_dir(e, "drain", msg.dir)
            self.answer(msg, ok=False, error=error_of(err))
            return None
        if not drain.members:
            if msg.why == "sigterm":
                logger.info("hsnap: SIGTERM: no request to drain into %s", msg.dir)
            self.answer(msg, ok=True, items=[], result={"dir": msg.dir, "requests": 0})
            return None
        for m in drain.members:
            self.drop_links(m.rid)
        self.pending.extend(drain.members)
        return None

    # ------------------------------------------------------------------ periodic checkpoints

    def on_checkpoint(self, msg: HsnapCheckpointReqInput):
        """Checkpoint ``rid`` into ``dir``: a plain link at its next committed decode boundary (answered once
        durable), then a delta of the link before every ``every`` output tokens, while it decodes here; ``every``
        0 stops (answered at once).  Links: hsnap_format.checkpoints (``<name>.ckNNNNNN.hsnap``)."""
        from hsnap_format.checkpoints import Checkpoints

        try:
            if msg.every == 0:
                ck = self.checkpoints.pop(msg.rid, None)  # a link on its way is still written (it may hold the request parked)
                if ck is None:
                    raise UnknownRequestError(None, "rid", Phrase("a request checkpointed in this server"), msg.rid)
                self.answer(msg, ok=True, result=dict(_checkpoint_state(ck), rid=msg.rid, stopped=True))
                return None
            where, req = self.locate(msg.rid)
            if where is None:
                raise self.absent(msg.rid)
            if self.busy(msg.rid):
                raise RequestBusyError(None, "rid", Phrase("a request no other export is waiting for"), msg.rid)
            if msg.rid in self.links.in_flight:  # a link of earlier checkpoints on its way: committed first (numbering),
                self.after_links.append(msg)  # then this message taken up again (collect_links); the scheduler goes on
                return None
            confine.resolve(msg.dir, "dir", confine.DIR, create=not is_url(msg.dir))
            ck = Checkpointing(Checkpoints.start(msg.dir, safe_file_name(msg.rid), msg.every))
            path, base = ck.links.next_link()
            self._check_target(path)
        except HsnapError as e:
            self.answer(msg, ok=False, error=error_of(e))
            return None
        self.drop_links(msg.rid)
        self.checkpoints[msg.rid] = ck
        self.pending.append(Export(msg.rid, path, True, time.monotonic(), op=msg, req=req, found_in=where, checkpoint=ck, base=base))
        return None

    def _queue_due_links(self) -> None:
        """A link for every checkpointed request that is due one (and has no export on its way); a request that
        finished or left this server is no longer checkpointed."""
        for rid, ck in list(self.checkpoints.items()):
            if any(e.rid == rid for e in self.pending):
                continue
            where, req = self.locate(rid)
            if req is None or req.finished():
                del self.checkpoints[rid]
            elif where in ("running", "parked") and ck.links.due(len(req.output_ids)):
                job = self.links.in_flight.get(rid)
                if job is not None or self.links.full():  # the writer is behind: never block the decode; a link due
                    # now folds into the next one (a delta of the last committed link, taken once the writer is free)
                    since = len(req.output_ids) - (job.result["output_tokens"] if job is not None else ck.links.last_output)
                    if since >= ck.links.every and not ck.waiting:
                        ck.merged += 1
                        ck.waiting = True
                    continue
                ck.waiting = False
                path, base = ck.links.next_link()
                self.pending.append(Export(rid, path, True, time.monotonic(), req=req, found_in=where, checkpoint=ck, base=base))

    def _capture_link(self, ex: Export, req, where: str) -> None:
        """At the committed boundary: the link's rows after the base, the recurrent state and the record, copied to
        host memory (the only part the decode waits for); the link writer thread writes and commits it."""
        import uuid

        t0 = time.monotonic()
        ck = ex.checkpoint or ex.migration  # whose links: both keep the last committed one (held) and its position
        try:
            cap = self.capture(req, ex.path, uuid.uuid4().hex, ck.base_position if ex.base is not None else 0)
        except Exception as e:  # noqa: BLE001 - never take the scheduler down; the request keeps running
            self._link_taken(ex, req, where, error_of(typed(e, "export", ex.path)))
            return
        self._link_taken(ex, req, where, None)
        capture_s = time.monotonic() - t0
        result = dict(rid=ex.rid, keep_running=True, found_in=ex.found_in, prompt_tokens=len(req.origin_input_ids),
                      output_tokens=len(req.output_ids), committed_positions=int(cap.record.state_position),
                      snapshot_id=cap.identity.snapshot_id, tp_size=1, path=str(ex.path), captured_bytes=cap.nbytes,
                      timings={"wait_s": t0 - ex.asked, "write_s": capture_s})
        held = ck.held if ex.base is not None and ck.held is not None and ck.held.path == ex.base else ex.base
        self.links.submit(LinkJob(ex, cap, result, capture_s, base=held))

    def _link_taken(self, ex: Export, req, where: str, error: dict | None) -> None:
        """After a link's capture or write: a parked request goes back into the running batch (it missed no token);
        a failure is answered (the request decodes on)."""
        if where == "parked":
            self.parked.pop(ex.rid, None)
            self.admit([req])
        if error is not None:
            self._done(ex, error=error)

    def _write_link_set(self, ex: Export, req, where: str) -> None:
        """A TP server's link: a set (every rank its rank file — a delta of its own rank file of the last link —
        manifest last) written here, in lockstep on every rank, as a TP export is (:meth:`write_snapshot`): its collectives
        run on the scheduler's TP group, which no writer thread may use beside the scheduler.  The decode waits for
        the write (the capture's cost at TP 1, plus the write's)."""
        t0 = time.monotonic()
        try:
            info = self.write_snapshot(ex.path, req, base=ex.base)
        except Exception as e:  # noqa: BLE001 - never take the scheduler down; the request keeps running
            self._link_taken(ex, req, where, error_of(typed(e, "export", ex.path)))
            return
        self._link_taken(ex, req, where, None)
        self.exports += 1
        t_done = time.monotonic()
        result = dict(info, rid=ex.rid, keep_running=True, found_in=ex.found_in, prompt_tokens=len(req.origin_input_ids),
                      output_tokens=len(req.output_ids),
                      timings={"wait_s": t0 - ex.asked, "write_s": t_done - t0, "pause_to_durable_s": t_done - ex.asked,
                               "total_s": t_done - ex.asked})
        self._done(ex, result=result)

    def collect_links(self) -> None:
        """The links the writer finished: bookkept and answered here, on the scheduler thread; then the messages that
        waited for a request's link (:attr:`after_links`) are taken up again."""
        for job in self.links.collect():
            ex = job.ex
            if ex.checkpoint is None and ex.migration is None:
                self._export_written(job)
                continue
            owner = ex.checkpoint or ex.migration
            owner.writer_s += job.writer_s
            if job.error is not None:
                self._done(ex, error=job.error)
                continue
            self.exports += 1
            owner.held = job.info
            info = job.info.info
            result = dict(job.result, bytes=int(info.file_length), payload_bytes=int(info.payload_bytes))
            result["timings"] = dict(result["timings"], writer_s=job.writer_s, total_s=time.monotonic() - ex.asked,
                                     pause_to_durable_s=time.monotonic() - ex.asked)
            self._done(ex, result=result)
        ready = [msg for msg in self.after_links if msg.rid not in self.links.in_flight]
        for msg in ready:
            self.after_links.remove(msg)
            contained_handler(self.answer, "checkpoint", self.on_checkpoint)(msg)

    def _link_done(self, ex: Export, result, error) -> None:
        ck = ex.checkpoint
        if error is None:
            ck.links.committed(ex.path, int(result["output_tokens"]), ex.base)
            ck.base_position = int(result["committed_positions"])
            ck.written += 1
            ck.write_s += float(result["timings"]["write_s"])
            if "total_s" in result["timings"]:  # due -> committed: how far the newest durable link lags the request
                metrics.observe("link_lag", float(result["timings"]["total_s"]))
            result = dict(result, link=ck.links.seq, base=ex.base, dir=ck.links.directory, every=ck.links.every)
        elif self.checkpoints.get(ex.rid) is ck:  # a link that cannot be written stops the checkpoints (logged)
            logger.error("hsnap checkpoint of %s stopped: %s", ex.rid, error.get("message"))
            del self.checkpoints[ex.rid]
        if ex.op is not None:
            self.answer(ex.op, ok=error is None, result=result, error=error)

    # ------------------------------------------------------------------ resume

    def on_resume(self, msg: HsnapResumeReqInput):
        """Start the resume's proof off this thread (:func:`hsnap_sglang.req.prove_resume`: the snapshot opened, checked
        and every byte read and hashed — for an ``s3://`` one, GETs — while the other requests decode on), or take the
        one started ahead of it (``msg.ahead``: :meth:`on_prove_ahead`); the restore, admission and answer follow at
        the iteration that finds it proved on every rank (:meth:`finish_resumes`).  Every rank keeps the same jobs in
        the same order: the messages reach them so (a rank without the proof ahead proves now)."""
        t0 = time.monotonic()
        ahead = self.proved_ahead.pop(msg.ahead, None) if msg.ahead is not None else None
        try:
            resolved = confine.resolve(msg.path, "path", confine.READ)  # the HTTP edge checked it; again where it is opened
            if self.busy_resuming(msg.rid):
                raise RequestBusyError(msg.path, "request.rid", Phrase("a rid no request of this server has"), msg.rid)
        except HsnapError as e:
            if ahead is not None:
                ahead.job.discard()
            self.resuming[msg.op_id] = Resuming(msg, t0, Job.failed(e))
            return None
        if ahead is not None and ahead.path != resolved:  # (not what the HTTP process sends)
            ahead.job.discard()
            ahead = None
        if ahead is not None:  # its rid is checked against the message's once proved (_restore_resumed)
            self.resuming[msg.op_id] = Resuming(msg, t0, ahead.job, ahead=ahead.received)
            return None
        prove = self._resume_proof(msg.path, msg.http_worker_ipc, msg.rid)
        if proves_here(resolved, self.proof_here_bytes):
            self.resuming[msg.op_id] = Resuming(msg, t0, Job.run_here(prove))
        else:  # started now if a place is free, else by finish_resumes (each holds a staging buffer of up to 128 MiB)
            self.resuming[msg.op_id] = Resuming(msg, t0, None, start=lambda: Job(prove, f"hsnap-resume-{self.tp_rank}"))
            self._start_proofs()
        return None

    def _resume_proof(self, path: str, http_worker_ipc, rid: str | None):
        """The proof of a resume of ``path`` (of request ``rid``; None: checked when it is taken), to run once."""
        from .req import prove_resume

        s = self.sched
        pools = dict(req_to_token_pool=s.req_to_token_pool, token_to_kv_pool_allocator=s.token_to_kv_pool_allocator)
        kwargs = dict(identity=self.identity(), rank=self.tp_rank if self.tp_size > 1 else None, http_worker_ipc=http_worker_ipc,
                      expect_rid=rid, room=self.room(), sharding=self.sharding(), **self.resume_context())
        return lambda: prove_resume(path, **pools, **kwargs)

    def on_prove_ahead(self, msg: HsnapProveAheadReqInput):
        """Prove ``msg.path`` now, for the resume the HTTP process sends once it has read the record, claimed the
        snapshot and registered its client (``HsnapResumeReqInput.ahead``): the two overlap.  A local file up to the
        operator's bound is proved here, as its resume would be, the rest on a thread.  Not answered: a path this
        refuses, or more than :data:`MAX_PROVED_AHEAD` proofs held, leave the resume to prove when it arrives (and
        answer its refusal); ``drop`` gives the proof back."""
        held = self.proved_ahead.pop(msg.op_id, None)
        if held is not None:  # dropped (or an op_id sent twice: nothing is proved for it again)
            held.job.discard()
        if msg.drop or held is not None:
            return None
        self._expire_proved_ahead()
        if len(self.proved_ahead) >= MAX_PROVED_AHEAD:
            return None
        try:
            resolved = confine.resolve(msg.path, "path", confine.READ)
        except HsnapError:
            return None
        prove = self._resume_proof(resolved, msg.http_worker_ipc, None)
        job = Job.run_here(prove) if proves_here(resolved, self.proof_here_bytes) else Job(prove, f"hsnap-ahead-{self.tp_rank}")
        self.proved_ahead[msg.op_id] = ProvedAhead(resolved, job, time.monotonic())
        return None

    def _expire_proved_ahead(self) -> None:
        """Give back the proofs whose resume has not come within :data:`PROVED_AHEAD_TTL_S` (an HTTP process gone)."""
        now = time.monotonic()
        for op_id, held in list(self.proved_ahead.items()):
            if now - held.received <= PROVED_AHEAD_TTL_S:
                break  # (oldest first)
            del self.proved_ahead[op_id]
            held.job.discard()

    def _start_proofs(self) -> None:
        """Start waiting proofs, oldest first, while fewer than :data:`MAX_PROOFS_IN_FLIGHT` run."""
        running = sum(1 for r in self.resuming.values() if r.job is not None and not r.job.done)
        for r in self.resuming.values():
            if running >= MAX_PROOFS_IN_FLIGHT:
                return
            if r.job is None:
                r.job, r.start = r.start(), None
                running += 1

    def let_run(self, job: Job | None) -> None:
        """An idle scheduler waits a moment (:data:`IDLE_PROOF_WAIT_S`) on ``job``, a proof off this thread not done yet:
        spinning in Python it would hold the GIL the proof's thread needs after each read or hash."""
        if job is not None and not job.done and self.idle():
            job.wait(IDLE_PROOF_WAIT_S)

    def idle(self) -> bool:
        """No batch to run or in flight, nothing queued or being prefilled."""
        s = self.sched
        return (s.running_batch.is_empty() and not s.waiting_queue and s.chunked_req is None
                and not getattr(s, "result_queue", None))

    def busy_resuming(self, rid: str) -> bool:
        """A request of ``rid`` is here, queued for an export, or being resumed: another resume of it is refused."""
        return (self.locate(rid)[0] is not None or any(e.rid == rid for e in self.pending)
                or any(r.op.rid == rid for r in self.resuming.values()))

    def finish_resumes(self) -> None:
        """At a scheduler iteration: restore and admit every resume proved on every rank (at TP > 1 one collective
        says which), in arrival order; each is contained (a failure is its refusal, the others go on)."""
        self._start_proofs()
        self.let_run(next((r.job for r in self.resuming.values() if r.job is not None and not r.job.done), None))
        jobs = list(self.resuming.items())
        seen = migration.views(self, [r.done for _, r in jobs])
        for i, (op_id, r) in enumerate(jobs):
            if not all(rank[i] for rank in seen):
                continue
            del self.resuming[op_id]
            try:
                self._restore_resumed(r)
            except Exception as e:  # noqa: BLE001 - hsnap may fail, the scheduler may not: answered, the rest go on
                logger.exception("hsnap resume of %s failed", r.op.path)
                guarded("refusing a resume", self.answer, r.op, ok=False,
                        error=error_of(PluginError(r.op.path, "resume", detail=f"{type(e).__name__}: {e}")))
        self._start_proofs()

    def _restore_resumed(self, r: Resuming) -> None:
        """The resume's second half, on this thread: a rid that arrived meanwhile refused, the room made, the slots
        allocated and filled from the proof (its capacity checked again under the pool lock), every rank agreeing
        (TP > 1: all hold the request or none), then admission and the answer."""
        from .req import restore_proven

        msg, s = r.op, self.sched
        t_picked = time.monotonic()
        agreement = _Agreement(self)
        req, err = None, None
        proven, r.job.result = r.job.result, None
        try:
            if r.job.error is not None:
                raise r.job.error
            if self.busy_resuming(msg.rid):  # arrived meanwhile (this resume left self.resuming already)
                proven.close()
                raise RequestBusyError(msg.path, "request.rid", Phrase("a rid no request of this server has"), msg.rid)
            if proven.prepared.req.rid != msg.rid:  # proved ahead, before the HTTP process read the rid: the file it read
                proven.close()
                raise IncompatibleSnapshotError(msg.path, [("request.rid", msg.rid, proven.prepared.req.rid)])
            req = restore_proven(proven, tree_cache=s.tree_cache, room=self.room(), commit=agreement.commit if self.tp_size > 1 else None)
        except HsnapError as e:
            err = e
        except Exception as e:  # noqa: BLE001 - the server keeps serving; the pools were rolled back by the restore
            logger.exception("hsnap resume of %s failed", msg.path)
            err = PluginError(msg.path, "resume", detail=f"{type(e).__name__}: {e}")
        if self.tp_size > 1 and not agreement.done:
            outcome = self.agree(err)  # this rank failed before the restore's commit: tell the others
            err = err or outcome.error
        elif self.tp_size > 1 and err is None and agreement.error is not None:
            err = agreement.error
        if err is not None:
            self.answer(msg, ok=False, error=error_of(err))
            return None
        t_restored = time.monotonic()
        self.admit([req], resumed=True, detokenizer=msg.detokenizer)
        self.resumes += 1
        restored = req.hsnap_restored
        job = r.job
        self.answer(msg, ok=True, result={
            "rid": req.rid, "path": msg.path, "snapshot_id": restored.snapshot_id, "committed_positions": int(restored.state_position),
            "bytes_uploaded": int(restored.bytes_uploaded), "prompt_tokens": len(req.origin_input_ids), "output_tokens": len(req.output_ids),
            "remaining_budget": _remaining(req), "numerics_differences": [[f, repr(a), repr(b)] for f, a, b in restored.numerics_differences],
            # monotonic stamps (one clock for every process of the host): the HTTP process puts its own beside them;
            # restore_s = prove_s (from the message: a worker thread, or a wait for a place among the proofs in flight;
            # what is left of a proof started ahead) + pickup_s (to this thread's next iteration) + upload_s (this
            # thread); proof_s: the proof's own time, ahead_s of it before the message (started ahead)
            "timings": {"restore_s": t_restored - r.received, "prove_s": max(0.0, job.ended - r.received),
                        "pickup_s": t_picked - max(job.ended, r.received), "upload_s": t_restored - t_picked,
                        "proof_s": job.ended - job.started,
                        "ahead_s": 0.0 if r.ahead is None else max(0.0, min(job.ended, r.received) - job.started),
                        "admit_s": time.monotonic() - t_restored, "received_at": r.received,
                        "admitted_at": time.monotonic()}, "tp_size": self.tp_size,
            # hsnap's own phases of the restore (hsnap_io RestoredRequest.timings): open, proof, allocate, plan, upload
            "restore_phases": {k: float(v) for k, v in restored.timings.items()},
        })
        return None

    def admit(self, reqs: list, *, resumed: bool = False, detokenizer: list[int] | None = None) -> None:
        """Put requests whose KV and Mamba state are in their slots into the running batch as decoding requests.

        SGLang's own PD-decode admission: ``ScheduleBatch.init_new`` + ``prepare_for_prebuilt`` (decode metadata of
        a request with its KV in place; ``seq_lens`` = committed positions), the last output token stashed in the
        ``FutureMap`` (the relay every decode step reads its input from), then ``merge_batch``.  The penalizers
        (frequency/presence/repetition penalties, min_new_tokens) are fed the earlier output tokens as decoding would
        have fed them.  A resumed request's detokenization window is ``detokenizer`` (the HTTP process replayed the
        source's, :mod:`.detokenize`) and it stays out of the radix tree (its history was not prefilled here;
        releasing it frees exactly its own slots)."""
        from sglang.srt.managers.overlap_utils import RelayPayload
        from sglang.srt.managers.schedule_batch import ScheduleBatch

        s = self.sched
        for req in reqs:
            if resumed:
                s.init_req_max_new_tokens(req)
                req.skip_radix_cache_insert = True
                anchor_detokenizer(req, detokenizer)
        for req in reqs:  # one batch per request: the penalizers are fed its own history
            batch = ScheduleBatch.init_new([req], s.req_to_token_pool, s.token_to_kv_pool_allocator, s.tree_cache, s.model_config,
                                           s.enable_overlap, s.spec_algorithm)
            batch.prepare_for_prebuilt()
            orchestrator = batch.sampling_info.penalizer_orchestrator
            if orchestrator.is_required:
                for token in list(req.output_ids)[:-1]:  # the next prepare_for_decode feeds the last one
                    orchestrator.cumulate_output_tokens(torch.tensor([token], dtype=torch.int64, device=batch.device))
            last = torch.tensor([req.output_ids[-1]], dtype=torch.int64, device=batch.device)
            s.future_map.stash(batch.req_pool_indices, RelayPayload(bonus_tokens=last))
            batch.input_ids = None
            if s.running_batch.is_empty():
                s.running_batch = batch
            else:
                s.running_batch.merge_batch(batch)

    # ------------------------------------------------------------------ the TP agreement

    def _page_totals(self, pages) -> dict[str, int]:
        """A drain's page store session's counts, summed over the ranks (a collective at TP > 1: each rank put its own
        rank's pages)."""
        st = pages.stats
        mine = {"pages_put": st.pages_put, "pages_reused": st.pages_reused, "bytes_put": st.bytes_put, "bytes_reused": st.bytes_reused}
        if self.tp_size == 1:
            return mine
        ranks = [json.loads(p) for p in self.agree(None, payload=json.dumps(mine)).payloads]
        return {k: sum(int(r[k]) for r in ranks) for k in mine}

    def agree(self, error: BaseException | None, payload: str = "") -> "_Outcome":
        """Collective over the TP CPU group (every rank calls it at the same point): each rank's error (class name
        and message, as JSON in a fixed-size byte tensor: no pickle) and a short payload; the first failing rank's
        error comes back as a typed HsnapError on every rank."""
        if self.tp_size == 1:
            return _Outcome(error, [payload])
        import torch.distributed as dist

        mine = {"payload": payload, "error": None if error is None else error_of(error)}
        data = json.dumps(mine, default=str).encode()
        if len(data) > _ERROR_BYTES - 4:
            mine["error"] = {k: mine["error"][k] for k in ("type", "status", "message", "field")} if mine["error"] else None
            if mine["error"]:
                mine["error"]["message"] = mine["error"]["message"][:1000]
            data = json.dumps(mine, default=str).encode()[: _ERROR_BYTES - 4]
        buf = torch.zeros(_ERROR_BYTES, dtype=torch.uint8)
        buf[:4] = torch.tensor(list(len(data).to_bytes(4, "little")), dtype=torch.uint8)
        buf[4 : 4 + len(data)] = torch.frombuffer(bytearray(data), dtype=torch.uint8)
        out = [torch.zeros_like(buf) for _ in range(self.tp_size)]
        dist.all_gather(out, buf, group=self.group)
        payloads, errors = [], []
        for rank, t in enumerate(out):
            raw = bytes(t.tolist())
            n = int.from_bytes(raw[:4], "little")
            try:
                got = json.loads(raw[4 : 4 + n].decode())
            except ValueError:
                got = {"payload": "", "error": {"type": "PluginError", "status": 500, "message": f"tp rank {rank}: unreadable agreement"}}
            payloads.append(got.get("payload", ""))
            if got.get("error"):
                errors.append((rank, got["error"]))
        if not errors:
            return _Outcome(error, payloads)
        # the cause, not its echo: a rank that only saw another one fail says RankFailedError / RemoteRankError
        rank, e = next(((r, e) for r, e in errors if e.get("type") not in _ECHOES), errors[0])
        if rank == self.tp_rank and error is not None:
            return _Outcome(error, payloads)
        return _Outcome(RemoteRankError(rank, e), payloads)

    # ------------------------------------------------------------------ stats

    def count(self, mode, rids) -> None:
        kind = "decode" if mode.is_decode() else "extend" if mode.is_extend() else str(getattr(mode, "name", mode)).lower()
        for rid in rids:
            c = self.forwards.get(rid)
            if c is None:
                c = self.forwards[rid] = {"decode": 0, "extend": 0}
                while len(self.forwards) > MAX_COUNTED_RIDS:
                    self.forwards.popitem(last=False)
            c[kind] = c.get(kind, 0) + 1

    def on_stats(self, msg: HsnapStatsReqInput):
        s = self.sched
        rtp, alloc = s.req_to_token_pool, s.token_to_kv_pool_allocator
        pools = {"req_rows_free": int(rtp.available_size()), "token_slots_free": int(alloc.available_size())}
        if getattr(rtp, "mamba_allocator", None) is not None:
            pools["mamba_slots_free"] = int(rtp.mamba_allocator.available_size())
        if s.tree_cache.supports_prefix_sharing():  # what the radix cache holds that no request uses (it could free)
            pools["token_slots_evictable"] = int(s.tree_cache.full_evictable_size())
        result = {
            "plugin": {"enabled": True, "tp_size": self.tp_size, "overlap": bool(s.enable_overlap),
                       "radix_cache": bool(s.tree_cache.supports_prefix_sharing()), "exports": self.exports, "resumes": self.resumes,
                       "proofs_ahead": len(self.proved_ahead)},
            "requests": {"running": [r.rid for r in s.running_batch.reqs], "waiting": [r.rid for r in s.waiting_queue],
                         "prefilling": [s.chunked_req.rid] if s.chunked_req is not None else [], "parked": list(self.parked),
                         "writing": list(self.writing), "retracted": [r.rid for r in self.retracted()],
                         "pending_exports": [e.rid for e in self.pending], "resuming": [r.op.rid for r in self.resuming.values()]},
            "pools": pools,
            "checks": self.checks(),
            "checkpoints": {rid: _checkpoint_state(ck) for rid, ck in self.checkpoints.items()},
            "migrations": {rid: {"dir": m.container, "rounds": len(m.links), "queued": m.queued} for rid, m in self.migrations.items()},
            "follows": [{"dir": f.container, "rid": f.op.rid, "applied": len(f.applied), "proving": f.proof is not None and not f.proof.done}
                        for f in self.follows.values()],
            "arrived": list(self.arrived),
            "retraction": self.retraction.state() if self.retraction is not None else None,
            "table": self.request_rows(),
        }
        if msg.rid is not None:
            result["rid"] = msg.rid
            result["forwards"] = self.forwards.get(msg.rid)
            result["where"] = self.locate(msg.rid)[0]
        else:
            result["forwards_by_rid"] = dict(self.forwards)
        self.answer(msg, ok=True, result=result)
        return None

    def request_rows(self) -> list[dict]:
        """One row per request present (what ``hsnap ls`` shows): rid, where it is, its tokens, the positions its
        KV rows hold at a decode boundary (prompt + output - 1; none before its first decode), and whether it is
        being checkpointed or migrated."""
        s = self.sched
        where = (("running", s.running_batch.reqs), ("parked", self.parked.values()), ("writing", self.writing.values()),
                 ("prefilling", [s.chunked_req] if s.chunked_req is not None else []), ("waiting", s.waiting_queue),
                 ("retracted", self.retracted()))
        rows, seen = [], set()
        for state, reqs in where:
            for req in reqs:
                if req.rid in seen:
                    continue
                seen.add(req.rid)
                ck, mig = self.checkpoints.get(req.rid), self.migrations.get(req.rid)
                prompt, output = len(req.origin_input_ids), len(req.output_ids)
                rows.append({"rid": req.rid, "state": state, "prompt_tokens": prompt, "output_tokens": output,
                             "committed_positions": prompt + output - 1 if output and state in ("running", "parked", "writing") else None,
                             "checkpoint": {"dir": ck.links.directory, "every": ck.links.every, "links": ck.written} if ck else None,
                             "migration": {"dir": mig.container, "rounds": len(mig.links)} if mig else None})
        return rows

    def checks(self) -> dict:
        """SGLang's own invariant checks, run now: the pool accounting (every token, Mamba and request slot is free,
        cached in the tree or owned by a request) and, when the server is idle, the tree's sanity check."""
        s = self.sched
        ic = s.invariant_checker
        out: dict[str, Any] = {"idle": bool(s.is_fully_idle()) and not self.resuming}  # a resume being proved is work
        try:
            ps = s.pool_stats_observer.get_pool_stats()
            if out["idle"] and not self.parked:
                leak, messages = ic._check_all_pools(ps)
                rows_ok = len(s.req_to_token_pool.free_slots) + s.pool_stats_observer.session_held_req_count() == (
                    s.req_to_token_pool.size + s.req_to_token_pool.pre_alloc_size)
                out.update(pool_leak=bool(leak), req_rows_ok=bool(rows_ok), messages=list(messages))
                if s.tree_cache.supports_prefix_sharing() and hasattr(s.tree_cache, "sanity_check"):
                    try:
                        s.tree_cache.sanity_check()
                        out["tree_sanity"] = "ok"
                    except Exception as e:  # noqa: BLE001 - reported, not raised
                        out["tree_sanity"] = f"{type(e).__name__}: {e}"
            else:
                full_uncached, _ = ic._get_total_uncached_sizes()
                uncached = full_uncached + sum(_private_tokens(r, ic.page_size) for r in self.parked.values())
                leak, message = ic._check_full_pool(ps, uncached=uncached)
                out.update(pool_leak=bool(leak), messages=[message])
        except Exception as e:  # noqa: BLE001 - a check that cannot run says so
            out["error"] = f"{type(e).__name__}: {e}"
        return out


class _Room:
    """The radix cache's unreferenced entries as :class:`hsnap_io.slots.Room`: counted as free by a resume's (or a
    migration link's) capacity check, touching nothing, and evicted the way SGLang's admission evicts them
    (``evict_to_free_tokens``, ``ensure_mamba_capacity``) only once every check passed, and only as many as are
    missing — a resume refused for any reason leaves the cache as it was."""

    def __init__(self, sched) -> None:
        self.sched = sched

    def spare(self) -> dict[str, int]:
        tree = self.sched.tree_cache
        spare = {"token slots": int(tree.full_evictable_size())}
        if hasattr(tree, "mamba_evictable_size"):
            spare["mamba slots"] = int(tree.mamba_evictable_size())
        return spare

    def make(self, token_slots: int, mamba_slots: int) -> None:
        from types import SimpleNamespace

        from sglang.srt.managers.schedule_batch import ReqKvInfo
        from sglang.srt.mem_cache.allocation import ensure_mamba_capacity

        s = self.sched
        if token_slots:
            s.token_to_kv_pool_allocator.evict_to_free_tokens(s.tree_cache, token_slots)
        if mamba_slots:
            ensure_mamba_capacity(s.req_to_token_pool, [SimpleNamespace(kv=ReqKvInfo())] * mamba_slots, s.tree_cache)


MAX_PROOFS_IN_FLIGHT = 2  # resumes proved off the scheduler thread at once (the rest wait, in order)


_ECHOES = ("RankFailedError", "RemoteRankError")


@dataclasses.dataclass
class _Outcome:
    error: BaseException | None
    payloads: list


class _Agreement:
    """resume_req's ``commit`` at TP > 1: inside the restore's rollback, every rank says it succeeded; a rank that
    failed earlier calls :meth:`HsnapScheduler.agree` after its failure instead (same collective, same order)."""

    def __init__(self, hs: HsnapScheduler) -> None:
        self.hs, self.done, self.error = hs, False, None

    def commit(self) -> None:
        self.done = True
        outcome = self.hs.agree(None)
        if outcome.error is not None:
            self.error = outcome.error
            raise outcome.error  # the restore gives back every allocation of this rank


# ----------------------------------------------------------------------------- small pieces


def drain_path(dir_: str, rid: str, tp_size: int) -> str:
    """Where a drain puts ``rid``: ``DIR/<rid>.hsnap`` (a TP set: a directory ``DIR/<rid>``); a rid that is not a safe
    file name is named by its hash (the record inside says which request it is)."""
    name = safe_file_name(rid)
    leaf = name if tp_size > 1 else f"{name}.hsnap"
    return store_for(dir_).join(dir_, leaf)


def _checkpoint_state(ck: Checkpointing) -> dict:
    links = ck.links
    return {"dir": links.directory, "every": links.every, "last": links.last, "last_output_tokens": links.last_output,
            "links": ck.written, "write_s": ck.write_s, "writer_s": ck.writer_s, "merged": ck.merged}


def _dedup_report(page_size: int, totals: dict[str, int], items: list) -> dict:
    """What a dedup drain wrote against what single snapshots would have: each file (every rank's) plus every page
    object it references (put now or reused), summed over the requests (and ranks: ``totals``)."""
    files = sum(int(i["result"]["bytes"]) for i in items if i["ok"])
    put, reused = totals["bytes_put"], totals["bytes_reused"]
    return {"page_size": page_size, "pages_put": totals["pages_put"], "pages_reused": totals["pages_reused"],
            "page_bytes_put": put, "page_bytes_reused": reused, "file_bytes": files,
            "bytes_written": files + put, "single_bytes": files + put + reused}


def _check_target_free(path: str) -> None:
    """Refuse at once (not only at commit time) a local path that exists: snapshots are never overwritten."""
    if not is_url(path) and os.path.lexists(path):
        raise SnapshotExistsError(path, "path", "no file or directory", Phrase("one exists"))


def _remaining(req) -> int | None:
    m = req.sampling_params.max_new_tokens
    return None if m is None else max(0, int(m) - len(req.output_ids))


def _private_tokens(req, page_size: int) -> int:
    from sglang.srt.mem_cache.common import kv_private_tokens

    return int(kv_private_tokens(req.kv, page_size))


__all__ = ["HsnapScheduler", "install", "after_ingest", "around_process_batch_result", "drain_path"]
