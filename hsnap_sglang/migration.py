"""Live migration of one request between two running SGLang servers, in the scheduler processes.

The container (a directory or an ``s3://`` prefix both servers reach) and its names are hsnap_io.migrate's, so a
server and a library process (:class:`hsnap_io.migrate.MigrationTarget`) interoperate:

* **source** (``/hsnap/migrate``): at the request's next committed decode boundary its rows, recurrent state and
  record are captured (host copies: the decode waits only for that) and the link writer thread commits
  ``link-0000.hsnap`` (a plain snapshot) while the request keeps decoding; once the target has applied a round (its
  ``<link>.applied`` marker, watched off the scheduler thread) the next round is a delta of the rows decoded since;
  when at most ``tail`` rows are left (or after ``max_rounds`` rounds) the request is stopped at a boundary and
  ``final.hsnap`` (the tail rows, the whole recurrent state, the record) is written in the scheduler — the
  downtime — then its slots are released the way SGLang releases a finished request, and its stream ends with
  ``finish_reason {"type": "hsnap_export", "migration": dir, ...}``.  A request that finishes first, a link that
  cannot be written, a target that does not apply a round within ``timeout_s``: the source gives the migration up
  (``abandoned.json``, the request decodes on here, the caller gets the typed reason).
* **target** (``/hsnap/follow``): a :class:`~hsnap_io.migrate.MigrationTarget` over the scheduler's own pools
  applies each link as it is committed (every link checked and hashed before anything is allocated — off the
  scheduler thread, as a resume's snapshot, but for a small local file; the request itself — record, sampling,
  grammar, LoRA — checked with the first and the last link), evicting unreferenced
  radix-cache entries for room as admission does (only once a link passed every check).  After the final link the ``Req`` is bound to its slots and
  held; the HTTP process registers the client's state, then admits it (:class:`HsnapAdmitReqInput`): its next
  forward is a decode.  Until then its slots are reported to SGLang's own pool accounting as held (the strict idle
  memory check counts them), and a refused or abandoned migration gives every slot back.

At TP > 1, on either side (and across TP sizes: a target re-shards each link as it applies it, hsnap_io.migrate's
re-sharding path), every link is a TP set — each source rank writes its rank file, a delta of its own rank file of
the round before, manifest last — written in lockstep on the scheduler thread (the set's collectives run on the TP
group, which no writer thread may use), so each round's write is on the decode path there.  What a watcher thread or
the clock sees (a round applied, a refusal, a link committed, a timeout) differs from rank to rank; one small
collective per scheduler iteration while a migration or follow is under way makes every rank act on the same view:
the source's rank 0's, and for a target the links every rank has seen (each rank applies the same link in the same
iteration; a failure on one is a refusal on all).  The container is a local directory there (TP sets are re-sharded
from local rank files).
"""

from __future__ import annotations

import json
import logging
import time

from hsnap_format import HsnapError, SnapshotExistsError
from hsnap_format.errors import Phrase
from hsnap_format.migrations import ABANDONED_NAME, APPLIED_SUFFIX, FINAL_NAME, LINK_NAME, REFUSED_NAME, container_used, is_final_link
from hsnap_format.stores import store_for

from . import confine
from .containment import MAX_FOLLOWS, guarded, typed, typed_in_dir
from .errors import PluginError, RequestBusyError, RequestFinishedError, ServerBusyError, UnknownRequestError, error_dict, error_of
from .jobs import Export, Following, Job, Migrating, Watch, proves_here

logger = logging.getLogger("hsnap_sglang")


def held_kv_rows(hs) -> list:
    """ReqKvInfo of every request this plug-in holds in the pools outside SGLang's batches and tree: a migration
    being applied (its slots so far) and a migrated request waiting for its admission.  SGLang's pool accounting
    (``SchedulerPoolStatsObserver._session_kv_rows``) counts them as held, as it counts a streaming session's."""
    import torch
    from sglang.srt.managers.schedule_batch import ReqKvInfo

    rows = [req.kv for req, _ in hs.arrived.values()]
    for f in hs.follows.values():
        r = f.target.request
        if r is not None:
            kv = ReqKvInfo()
            kv.req_pool_idx = r.req_pool_idx
            kv.kv_committed_len = kv.kv_allocated_len = r.state_position
            if r.mamba_pool_idx is not None:
                kv.mamba_pool_idx = torch.tensor([r.mamba_pool_idx], dtype=torch.int64)
            rows.append(kv)
    return rows


# ----------------------------------------------------------------------------- source


def on_migrate(hs, msg) -> None:
    try:  # the HTTP edge checked it; again before anything there is looked at or written (nor abandoned.json outside)
        confine.resolve(msg.dir, "dir", confine.DIR)
    except HsnapError as e:
        hs.answer(msg, ok=False, error=error_dict(e))
        return

    where, req = hs.locate(msg.rid)
    store = store_for(msg.dir)
    used = None
    try:
        # a used container is refused (its names are never written over): here for a directory (stats); the HTTP process
        # looked under an s3:// prefix (HEADs) before sending the message, off this thread
        used = container_used(store, msg.dir) if store.local else None
        _check_tp_container(hs, store, msg.dir)
        if where is None:
            raise hs.absent(msg.rid)
        if hs.busy(msg.rid) or msg.rid in hs.migrations:
            raise RequestBusyError(None, "rid", Phrase("a request no other export or migration is waiting for"), msg.rid)
        if used is not None:
            raise SnapshotExistsError(used, "dir", Phrase("a container no migration has used"), Phrase("a link exists"))
        if store.local:
            confine.resolve(msg.dir, "dir", confine.DIR, create=True)  # made beneath the root, no symlink followed
    except Exception as e:  # noqa: BLE001 - an OS error is the dir's; anything else a typed PluginError (logged)
        err = typed_in_dir(e, "migrate", msg.dir)
        said, told = error_dict(err), None
        if used is None and hs.tp_rank == 0:  # a fresh container: a target already following it learns at once that nothing will come
            told = Job(lambda: _say_abandoned(store, msg.dir, said, 0), "hsnap-migration-abandon")  # a write: off this thread
        hs.answer_once_told(told, msg, error=said)
        return
    m = Migrating(msg, msg.dir, store, int(msg.tail), int(msg.max_rounds), float(msg.timeout_s), bool(msg.fsync), time.monotonic())
    if msg.rid in hs.checkpoints:  # its checkpoints end here (the request leaves); a link on its way is committed first
        hs.checkpoints.pop(msg.rid)  # (link-0000 waits for it at its boundary: the scheduler goes on meanwhile)
        m.stopped_checkpoints = True
    hs.drop_links(msg.rid)
    hs.migrations[msg.rid] = m
    m.queued = True
    hs.pending.append(Export(msg.rid, store.join(msg.dir, LINK_NAME.format(0)), True, time.monotonic(), req=req, found_in=where,
                              migration=m))


def _check_tp_container(hs, store, container: str) -> None:
    """A TP server migrates through a local directory: its links are TP sets, re-sharded from local rank files."""
    if hs.tp_size > 1 and not store.local:
        raise HsnapError(container, "dir", Phrase("a local directory (a TP server's links are TP sets of local rank files)"),
                         Phrase(f"an object-store prefix at TP {hs.tp_size}"))


SEEN_NOTHING, SEEN_APPLIED, SEEN_REFUSED = 0, 1, 2  # what a migration's watcher saw of its last round


def _round_seen(m: Migrating, now: float) -> list:
    """This rank's view of a migration: [SEEN_*, past its timeout]."""
    hit = m.watch.hit if m.watch is not None else None
    return [SEEN_NOTHING if hit is None else SEEN_REFUSED if hit.endswith(REFUSED_NAME) else SEEN_APPLIED, now - m.since > m.timeout_s]


def views(hs, local: list) -> list[list]:
    """Every rank's ``local`` (a short JSON list), in rank order: at TP > 1 one collective, which every rank calls at
    the same point of the same iteration (the jobs it lists are the same on every rank; what each saw differs)."""
    if hs.tp_size == 1:
        return [local]
    return [json.loads(p) if p else [] for p in hs.agree(None, payload=json.dumps(local, separators=(",", ":"))).payloads]


def advance_migrations(hs) -> None:
    """At a scheduler iteration: for every migration whose last round the target applied, the next round or the
    final link (queued as an export: it runs at the request's next committed boundary); a migration whose request
    finished, or whose target is silent past ``timeout_s``, is given up.  At TP > 1 every rank acts on rank 0's
    view.  Each migration is contained: one that fails (a hostile container file, a store error) is given up with
    the typed reason; the others go on."""
    now = time.monotonic()
    jobs = list(hs.migrations.items())
    seen = views(hs, [_round_seen(m, now) for _, m in jobs])[0]
    for (rid, m), (kind, late) in zip(jobs, seen):
        try:
            _advance_migration(hs, rid, m, kind, late)
        except Exception as e:  # noqa: BLE001 - hsnap may fail, the scheduler may not
            if hs.migrations.get(rid) is m:
                guarded("giving a migration up", abandon, hs, m, rid, typed(e, "migrate", m.container))


def _advance_migration(hs, rid: str, m: Migrating, seen: int, late: bool) -> None:
    from hsnap_io.migrate import MigrationError

    now = time.monotonic()
    where, req = hs.locate(rid)
    if req is None or req.finished():
        why = req.finished_reason.to_json() if req is not None and req.finished_reason is not None else None
        abandon(hs, m, rid, RequestFinishedError(m.container, "request", Phrase("a request still decoding when its migration ends"),
                                                 Phrase(f"finished: {json.dumps(why)}" if why else "gone")))
        return
    if m.queued:
        return
    if seen == SEEN_REFUSED:
        marker = m.store.join(m.container, REFUSED_NAME)
        said = m.watch.said if m.watch is not None and m.watch.said is not None else f"(see {REFUSED_NAME})"  # read by the watcher
        abandon(hs, m, rid, MigrationError(marker, "target", Phrase("a target applying the links"), Phrase(f"refused by the target: {said}")),
                say=False)
        return
    if seen == SEEN_NOTHING:
        if late:
            abandon(hs, m, rid, MigrationError(m.links[-1] + APPLIED_SUFFIX, "target", Phrase(f"the round applied within {m.timeout_s} s"),
                                               Phrase("not applied: no target follows, or it is stuck")))
        return
    if where not in ("running", "parked") or rid in hs.links.in_flight or hs.links.full():
        return  # the writer is busy with other links: the round goes at a later boundary
    if m.watch is not None:
        m.watch.cancel()  # (at TP > 1 this rank's own watcher may not have seen it yet)
    m.watch = None
    left = int(req.kv.kv_committed_len) - m.base_position
    final = left <= m.tail or len(m.links) >= m.max_rounds
    name = FINAL_NAME if final else LINK_NAME.format(len(m.links))
    m.left_at_stop = left
    m.queued = True
    hs.pending.append(Export(rid, m.store.join(m.container, name), not final, now, req=req, found_in=where, migration=m,
                              base=m.links[-1]))


def round_done(hs, ex, result, error) -> None:
    """A pre-copy round committed (or failed) by the link writer: watch for the target applying it (or refusing)."""
    m = ex.migration
    if hs.migrations.get(ex.rid) is not m:
        return  # given up meanwhile (answered then)
    m.queued = False
    if error is not None:
        abandon(hs, m, ex.rid, None, error=error)
        return
    m.links.append(ex.path)
    m.base_position = int(result["committed_positions"])
    m.since = time.monotonic()
    m.rounds.append({"link": ex.path, "committed_positions": m.base_position, "output_tokens": int(result["output_tokens"]),
                     "bytes": int(result["bytes"]), "capture_s": float(result["timings"]["write_s"]),
                     "writer_s": float(result["timings"].get("writer_s", 0.0)), "committed_at": m.since})
    m.watch = Watch(m.store, [ex.path + APPLIED_SUFFIX, m.store.join(m.container, REFUSED_NAME)])


def finish(hs, ex, req, where: str) -> None:
    """The final link, at a committed boundary, in the scheduler (the request decodes no further here): capture the
    rows since the last round, the recurrent state and the record; write and commit; release the request."""
    import uuid

    from hsnap_io.export import write_captured

    m = ex.migration
    t_stop = time.monotonic()
    sid = uuid.uuid4().hex
    try:
        if hs.tp_size > 1:  # a TP set, in lockstep on every rank (its collectives): the capture is the write
            written = hs.write_snapshot(ex.path, req, base=m.links[-1])
            t_captured = t_stop
            sid, final_bytes = written["snapshot_id"], int(written["bytes"])
        else:
            cap = hs.capture(req, ex.path, sid, m.base_position)
            t_captured = time.monotonic()
            try:
                final_bytes = int(write_captured(ex.path, cap, base=m.held, fsync=m.fsync).info.file_length)
            finally:
                cap.release()
    except Exception as e:  # noqa: BLE001 - the request decodes on here; the caller gets the reason
        if not isinstance(e, HsnapError):
            logger.exception("hsnap migration of %s: the final link failed", ex.rid)
            e = PluginError(ex.path, "migrate", detail=f"{type(e).__name__}: {e}")
        if where == "parked":
            hs.parked.pop(ex.rid, None)
            hs.admit([req])
        abandon(hs, m, ex.rid, e)
        return
    t_committed = time.monotonic()
    committed = int(req.kv.kv_committed_len)
    info = {"path": str(ex.path), "snapshot_id": sid, "committed_positions": committed, "migration": m.container}
    hs.release_exported(req, info)
    del hs.migrations[ex.rid]
    hs.exports += 1
    result = {
        "rid": ex.rid, "dir": m.container, "final": str(ex.path), "rounds": m.rounds, "committed_positions": committed,
        "output_tokens": len(req.output_ids), "prompt_tokens": len(req.origin_input_ids), "final_rows": committed - m.base_position,
        "rows_left_at_stop": m.left_at_stop,
        "final_bytes": final_bytes, "precopy_bytes": sum(r["bytes"] for r in m.rounds), "tp_size": hs.tp_size,
        "stopped_checkpoints": m.stopped_checkpoints,
        "timings": {"total_s": t_committed - m.started, "precopy_s": t_stop - m.started, "final_capture_s": t_captured - t_stop,
                    "final_write_s": t_committed - t_captured, "stopped_at": t_stop, "final_committed_at": t_committed,
                    "released_s": time.monotonic() - t_committed},
    }
    hs.answer(m.op, ok=True, result=result)


def abandon(hs, m: Migrating, rid: str, err: BaseException | None, *, error: dict | None = None, say: bool = True) -> None:
    """Give the migration up: ``abandoned.json`` for a following target (it gives back what it applied), the
    request stays here (its pending round dropped; a parked request back in the running batch), the caller told."""
    if hs.migrations.get(rid) is m:
        del hs.migrations[rid]
    if m.watch is not None:
        m.watch.cancel()
    for ex in [e for e in hs.pending if e.migration is m]:
        hs.pending.remove(ex)
        parked = hs.parked.pop(ex.rid, None)
        if parked is not None and not parked.finished():
            hs.admit([parked])
    error = error if error is not None else error_dict(err)
    told = None
    if say and hs.tp_rank == 0:  # (not to a target that refused: it knows; one rank says it; a write: off this thread)
        told = Job(lambda: _say_abandoned(m.store, m.container, error, len(m.links)), "hsnap-migration-abandon")
    hs.answer_once_told(told, m.op, error=error)  # the caller told "given up" finds abandoned.json


def _say_abandoned(store, container: str, error: dict, links: int) -> None:
    """``abandoned.json``: why, for a target following ``container`` (it gives back what it applied)."""
    try:
        if store.local:
            store.makedirs(container)
        store.put_bytes(store.join(container, ABANDONED_NAME), json.dumps({"reason": error.get("message", ""), "type": error.get("type"),
                                                                           "links": links}).encode())
    except Exception:  # noqa: BLE001 - the target then times out instead (its own deadline)
        logger.exception("hsnap migration: writing %s in %s", ABANDONED_NAME, container)


# ----------------------------------------------------------------------------- target


def on_follow(hs, msg) -> None:
    from hsnap_io.migrate import MigrationTarget

    s = hs.sched
    try:
        confine.resolve(msg.dir, "dir", confine.DIR)  # the HTTP edge checked it; again where it is read and written
        if len(hs.follows) >= MAX_FOLLOWS:  # each holds a watcher thread and, as links come, slots
            raise ServerBusyError(msg.dir, "follow", Phrase(f"at most {MAX_FOLLOWS} follows at once in this server"),
                                  Phrase(f"{len(hs.follows)} following; retry later"))
        if any(f.container == msg.dir for f in hs.follows.values()):
            raise RequestBusyError(msg.dir, "dir", Phrase("a container no other follow of this server applies"), msg.dir)
        if msg.rid is not None and (hs.locate(msg.rid)[0] is not None or msg.rid in hs.arrived):
            raise RequestBusyError(msg.dir, "request.rid", Phrase("a rid no request of this server has"), msg.rid)
        store = store_for(msg.dir)
        _check_tp_container(hs, store, msg.dir)
        # this rank's sharding: a link of another TP size (a TP set) is re-sharded as it is applied
        target = MigrationTarget(req_to_token_pool=s.req_to_token_pool, token_to_kv_pool_allocator=s.token_to_kv_pool_allocator,
                                 identity=hs.identity(), sharding=hs.sharding(), room=hs.room())
    except HsnapError as e:
        hs.answer(msg, ok=False, error=error_dict(e))
        return
    now = time.monotonic()
    f = Following(msg, msg.dir, store, target, float(msg.timeout_s), now + float(msg.timeout_s), started=now)
    f.watch = Watch(store, target.next_names(msg.dir))
    hs.follows[msg.op_id] = f


def advance_follows(hs) -> None:
    """At a scheduler iteration: prove the next link of every followed migration that has one committed, off this
    thread (:meth:`~hsnap_io.migrate.MigrationTarget.prove`: the link read and hashed — for an ``s3://`` container,
    GETs — while the other requests decode on; a small local file in place, as a resume's), and apply each link
    proved (the upload, here).  At TP > 1 a link is proved once every rank's watcher has seen it and applied once
    every rank has proved it (all in the same iteration), and a follow times out on rank 0's clock.  Each follow is
    contained: one that fails is refused with the typed reason (its slots given back); the others go on."""
    now = time.monotonic()
    jobs = list(hs.follows.items())
    # this rank's view of each: its next link seen by the watcher, that link's proof done, past its deadline
    seen = views(hs, [[f.watch is not None and f.watch.hit is not None, f.proof is not None and f.proof.done, now > f.deadline]
                      for _, f in jobs])
    proved = {op_id: f.proof is not None and all(rank[i][1] for rank in seen) for i, (op_id, f) in enumerate(jobs)}
    started = []
    for i, (op_id, f) in enumerate(jobs):
        if f.proof is not None:
            continue
        try:
            if all(rank[i][0] for rank in seen):
                f.proof = _prove_link(hs, f)
                started.append(op_id)
            elif seen[0][i][2]:
                _late(hs, op_id, f)
        except Exception as e:  # noqa: BLE001 - hsnap may fail, the scheduler may not
            if hs.follows.get(op_id) is f:
                guarded("refusing a follow", fail_follow, hs, op_id, typed(e, "follow", f.container))
    hs.let_run(next((f.proof for f in hs.follows.values() if f.proof is not None and not f.proof.done), None))
    if started:  # proved already (in place, or quickly)? every rank takes this view alike: they started the same
        done = views(hs, [hs.follows[op_id].proof.done for op_id in started])
        proved.update({op_id: all(rank[k] for rank in done) for k, op_id in enumerate(started)})
    for op_id, f in jobs:
        if not proved.get(op_id) or hs.follows.get(op_id) is not f:
            continue
        try:
            _apply_link(hs, op_id, f)
        except Exception as e:  # noqa: BLE001 - hsnap may fail, the scheduler may not
            if hs.follows.get(op_id) is f:
                guarded("refusing a follow", fail_follow, hs, op_id, typed(e, "follow", f.container))


def _late(hs, op_id: str, f: Following) -> None:
    from hsnap_io.migrate import MigrationError

    f.watch.cancel()
    fail_follow(hs, op_id, MigrationError(f.container, LINK_NAME.format(len(f.target.applied)),
                                          Phrase(f"committed within {f.timeout_s} s"), Phrase("missing")))


def _prove_link(hs, f: Following) -> Job:
    """The proof of the link ``f``'s watcher saw: which link it is (committed: a stat or HEAD per name), then
    :meth:`~hsnap_io.migrate.MigrationTarget.prove` with the request itself checked by :func:`_prepare` — in place
    for a local file up to the operator's ``HSNAP_PROOF_ON_SCHEDULER_BYTES``, else on a thread of its own."""
    target, container = f.target, f.container

    def prove():
        path = target.next_link(container)
        if path is None:  # seen, then gone: looked for again
            return None
        return target.prove(path, accept=lambda snap, record: _prepare(hs, f, snap, record))

    if proves_here(f.watch.hit, hs.proof_here_bytes):  # (never an s3:// link)
        return Job.run_here(prove)
    return Job(prove, f"hsnap-follow-{hs.tp_rank}")


def _apply_link(hs, op_id: str, f: Following) -> None:
    """Upload a proved link into the pools (this thread), every rank agreeing; then watch for the next one, or bind
    the request after the final one.  The marker the source waits for is put off this thread."""
    job, f.proof = f.proof, None
    proven, job.result = job.result, None
    t0 = time.monotonic()
    err: BaseException | None = None
    applied = None
    try:
        if job.error is not None:
            raise job.error
        if proven is not None:
            try:
                _check_here(hs, f, proven)
            except BaseException:
                proven.close()
                raise
            applied = f.target.apply_proven(proven)
    except HsnapError as e:
        err = e
    except Exception as e:  # noqa: BLE001 - the server keeps serving; the pools were rolled back by the apply
        logger.exception("hsnap follow of %s failed", f.container)
        err = PluginError(f.container, "follow", detail=f"{type(e).__name__}: {e}")
    # every rank applied the link, or the follow is refused on every rank (the first failing rank's reason)
    agreed = hs.agree(err, payload="applied" if applied is not None else "")
    if agreed.error is None and len(set(agreed.payloads)) > 1:
        agreed.error = PluginError(f.container, "follow", detail="the TP ranks did not all find the link committed")
    if agreed.error is not None:
        fail_follow(hs, op_id, agreed.error)
        return
    if applied is None:  # seen, then gone: look again
        f.watch = Watch(f.store, f.target.next_names(f.container))
        return
    t1 = time.monotonic()
    prove_s = job.ended - job.started
    f.applied.append({"link": applied.path, "committed_positions": applied.state_position, "rows": applied.rows,
                      "bytes_uploaded": applied.bytes_uploaded, "apply_s": prove_s + (t1 - t0), "prove_s": prove_s,
                      "upload_s": t1 - t0, "applied_at": t1})
    if applied.final:
        arrive(hs, op_id, f, t1)
    else:
        Job(lambda: f.target.mark_applied(applied), f"hsnap-follow-marker-{hs.tp_rank}")  # the source's cue
        f.deadline = t1 + f.timeout_s
        f.watch = Watch(f.store, f.target.next_names(f.container))


def _prepare(hs, f: Following, snap, record) -> None:
    """The request itself, checked with the first link (before the whole history is uploaded) and the final one
    (what is bound), as a resume's: a record the target could not run is refused before anything is allocated.  In
    the link's proof: it reads no pool."""
    from .req import prepare_req, target_worker_ipc

    if not (f.target.request is None or is_final_link(snap.path)):  # (a TP set's: ``snap`` is one of its rank files)
        return
    context = hs.resume_context()
    ipc = target_worker_ipc(snap.path, f.op.http_worker_ipc, context["req_kwargs"])
    f.prepared = prepare_req(record, snap.path, swa_start=snap.swa_start, http_worker_ipc=ipc, expect_rid=f.op.rid, **context)


def _check_here(hs, f: Following, proven) -> None:
    """What only this thread may look at, before a proved link is applied: its rid unused here (the first link), the
    Mamba track slots the bound request gets (the final)."""
    from .req.bind import check_tracking_capacity, mamba_tracking_slots

    s = hs.sched
    rid = proven.record.rid
    if proven.first and (hs.locate(rid)[0] is not None or rid in hs.arrived):
        raise RequestBusyError(proven.path, "request.rid", Phrase("a rid no request of this server has"), rid)
    if proven.final:
        check_tracking_capacity(s.req_to_token_pool, mamba_tracking_slots(s.req_to_token_pool), proven.snap.path)


def arrive(hs, op_id: str, f: Following, t_applied: float) -> None:
    """The final link is applied: bind the prepared Req to the slots (as resume_req does), hold it for the HTTP
    process's admission, and answer the follow with what the client's state needs."""
    from hsnap_io.slots import pool_lock

    from .frontend import resume_info_of
    from .req.bind import binder, mamba_tracking_slots

    s = hs.sched
    del hs.follows[op_id]
    restored, prepared = f.target.request, f.prepared
    req = prepared.req
    err: BaseException | None = None
    try:
        with pool_lock(s.req_to_token_pool):
            binder(req, prepared.carried["ReqKvInfo"], s.tree_cache, s.req_to_token_pool, mamba_tracking_slots(s.req_to_token_pool))(restored)
    except Exception as e:  # noqa: BLE001 - checked before the final link was applied; if it fails anyway: give it all back
        err = e if isinstance(e, HsnapError) else PluginError(f.container, "follow", detail=f"binding: {type(e).__name__}: {e}")
    agreed = hs.agree(err)  # at TP > 1 the request arrives on every rank or on none
    if agreed.error is not None:
        f.target.release()
        hs.answer(f.op, ok=False, error=error_of(agreed.error))
        return
    f.target.close()
    if prepared.grammar is not None:
        req.grammar_key, req.grammar = prepared.grammar_key, prepared.grammar
    req.hsnap_restored = restored
    f.arrived_at = time.monotonic()
    hs.arrived[req.rid] = (req, f)
    record = restored.record
    hs.answer(f.op, ok=True, result={
        "rid": req.rid, "dir": f.container, "final": f.applied[-1]["link"], "committed_positions": int(restored.state_position),
        "bytes_uploaded": int(restored.bytes_uploaded), "links": f.applied, "prompt_tokens": len(req.origin_input_ids),
        "output_tokens": len(req.output_ids), "info": resume_info_of(record, f.applied[-1]["link"]),
        "timings": {"follow_s": t_applied - f.started, "final_apply_s": f.applied[-1]["apply_s"], "final_applied_at": t_applied},
    })


def fail_follow(hs, op_id: str, err: BaseException) -> None:
    """The follow ends refused: every slot of the links applied so far given back; ``refused.json`` tells the source
    (it stops pre-copying at once) unless the source itself gave up; the caller gets the reason."""
    f = hs.follows.pop(op_id)
    if f.watch is not None:
        f.watch.cancel()
    if f.proof is not None:  # a link being proved: closed once read
        f.proof.discard()
        f.proof = None
    error = error_of(err)
    told = None
    try:
        f.target.release()
    finally:
        if hs.tp_rank == 0:  # one rank tells the source (looks and a write: off this thread)
            told = Job(lambda: _say_refused(f, error), "hsnap-follow-refuse")
        hs.answer_once_told(told, f.op, error=error)  # answered once refused.json is there


def _say_refused(f: Following, error: dict) -> None:
    """``refused.json``, unless the source gave up itself or was told already: it stops pre-copying at once."""
    try:
        if not f.store.exists(f.store.join(f.container, ABANDONED_NAME)) and not f.store.exists(f.store.join(f.container, REFUSED_NAME)):
            if f.store.local:
                f.store.makedirs(f.container)
            f.target.refuse(f.container, error)
    except Exception:  # noqa: BLE001 - the source then times out instead (its own deadline)
        logger.exception("hsnap follow of %s: writing %s", f.container, REFUSED_NAME)


def expire_arrivals(hs) -> None:
    """A migrated request whose admission never comes (the follow's HTTP caller went away before the answer reached
    it) is given back after ``timeout_s``: its slots are not held for ever (at TP > 1 on rank 0's clock)."""
    now = time.monotonic()
    jobs = list(hs.arrived.items())
    late = views(hs, [now - f.arrived_at > f.timeout_s for _, (_, f) in jobs])[0]
    for (rid, (req, f)), expired in zip(jobs, late):
        if expired:
            logger.warning("hsnap follow of %s: %s was never admitted within %.0f s; its slots are given back", f.container, rid, f.timeout_s)
            del hs.arrived[rid]
            guarded("releasing an unadmitted request", _release_unadmitted, hs, req)


def _release_unadmitted(hs, req) -> None:
    from sglang.srt.mem_cache.common import release_kv_cache

    req.skip_radix_cache_insert = True  # its history was never prefilled here: free exactly its own slots
    hs.sched.batch_result_processor._prepare_kv_cache_release(req)
    release_kv_cache(req, hs.sched.tree_cache)


def on_admit(hs, msg) -> None:
    """The HTTP process registered the client's state: run the arrived request (or give it back)."""
    got = hs.arrived.pop(msg.rid, None)
    if got is None:
        hs.answer(msg, ok=False, error=error_dict(UnknownRequestError(None, "rid", Phrase("a migrated request waiting for admission"), msg.rid)))
        return
    req, f = got
    if msg.admit:
        t0 = time.monotonic()
        hs.admit([req], resumed=True, detokenizer=msg.detokenizer)
        hs.resumes += 1
        hs.answer(msg, ok=True, result={"rid": msg.rid, "admitted_at": time.monotonic(), "admit_s": time.monotonic() - t0})
        return
    _release_unadmitted(hs, req)
    hs.answer(msg, ok=True, result={"rid": msg.rid, "released": True})
