"""Retraction to disk in a running server: a decoding request SGLang retracts is written to a file and later
restored from it, not recomputed.

SGLang retracts decoding requests when the KV pool runs short (``ScheduleBatch.retract_decode``; also every few
forwards under its test switch ``SGLANG_TEST_RETRACT``) and when a request of higher priority preempts them
(``PrefillAdder.preempt_to_schedule``): it frees their slots and queues them again, to be prefilled anew — prompt
and every output token recomputed, the recurrent (Mamba / GDN) state rebuilt from the start.  With
``HSNAP_RETRACT_DIR`` (``python -m hsnap_sglang.serve --hsnap-retract-dir DIR``) set by the operator:

* **at the retraction** (AROUND ``ScheduleBatch.release_req``, before SGLang frees anything) the request's rows,
  recurrent state and record are copied to host memory (``HsnapScheduler.capture``: the rows once, the Mamba
  state once, from wherever the pools declare it lives), then SGLang's own release runs unchanged;
* SGLang then queues it (AROUND ``Scheduler._add_request_to_queue``): it is held here instead, out of SGLang's
  waiting queue, while a writer thread writes ``DIR/<rid>.retracted.hsnap`` (temporary name, rename: never
  half-written under its name; not fsynced — the file is this process's own copy and is deleted once used);
* **re-admission**: once written, at a scheduler iteration where it fits the way SGLang's own admission counts
  room (free plus evictable token slots less the decode reservation of the running requests at SGLang's current
  ``new_token_ratio``, a Mamba slot, a request row, ``--max-running-requests``), the file is restored into fresh
  slots of the same ``Req`` and the request joins the running batch as a decoding request (its next forward is a
  decode: no position recomputed); the file is deleted.  The file is read and proved first — opened once, checked
  against the request, every byte hashed (:func:`hsnap_sglang.retract.prove_retracted`) — off the scheduler thread
  for a file over the operator's ``HSNAP_PROOF_ON_SCHEDULER_BYTES`` (as a resume's: :func:`hsnap_sglang.jobs.proves_here`),
  while the others decode on; the upload follows at the first iteration that finds it proved and the request still
  fitting (:func:`hsnap_sglang.retract.restore_retracted`).  Held requests go back oldest first, one proof at a time;
  one that does not fit stops the others behind it;
* anything that fails (the capture refused, the writer behind or failing, the restore refused) puts the request
  into SGLang's waiting queue as SGLang would have: it is recomputed there, exactly as without the plug-in; an
  abort of a held request is answered by SGLang's own abort (the request is put where SGLang looks first).

Off (said once at start; SGLang recomputes): TP > 1, PD disaggregation (its decode server keeps its own host backup),
the overlap scheduler (a request it retracts always has a forward in flight: its recurrent state has already moved
past its committed record and its next token is not processed yet).  Per request (counted ``recomputed``): a request
whose record the export refuses (input embeddings, ...), a writer that is behind, a file not written, a restore
refused.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import time
import uuid
from typing import Any

from .containment import guarded, typed
from .errors import error_of
from .jobs import Export, Job, LinkJob, LinkWriter, proves_here, safe_file_name
from .retract import prove_retracted, restore_retracted, retracted_extra

logger = logging.getLogger("hsnap_sglang")

RETRACT_DIR_ENV = "HSNAP_RETRACT_DIR"
SUFFIX = ".retracted.hsnap"
WRITER_DEPTH = 64  # retracted requests being written at once; more at one retraction are recomputed by SGLang
OUTCOMES = ("to_disk", "restored", "recomputed")  # hsnap_retractions_total{outcome}


@dataclasses.dataclass
class Held:
    """A retracted request held out of SGLang's waiting queue while its file is written and until it fits again."""

    req: Any
    path: str
    since: float
    job: LinkJob | None = None  # the write, until collected
    written: bool = False
    bytes: int = 0
    proof: Job | None = None  # its file read and proved (hsnap_sglang.retract.prove_retracted), once it fits


class RetractionToDisk:
    """The retracted requests of one scheduler (TP 1), their writer and their counters."""

    def __init__(self, hs, directory: str) -> None:
        self.hs, self.directory = hs, directory
        self.writer = LinkWriter(depth=WRITER_DEPTH)
        self.captured: dict[int, tuple[str, Any]] = {}  # id(req) -> (path, host copies): SGLang is releasing it
        self.released: dict[int, Held] = {}  # id(req) -> its file being written: SGLang queues it next (take)
        self.held: dict[str, Held] = {}  # rid -> held request, oldest first
        self.counts = dict.fromkeys(OUTCOMES, 0)
        self.restore_s = 0.0
        self.bytes_written = 0
        self.last: dict | None = None  # the last restore: what an operator (and a test) reads in /hsnap/stats

    # ------------------------------------------------------------------ at the retraction (inside retract_decode)

    def before_release(self, req) -> None:
        """Copy ``req`` to host memory before SGLang frees its slots (a committed boundary: the batch result that
        made its last token was processed); any refusal leaves it to SGLang's recompute."""
        hs = self.hs
        why = "its last forward is still in flight" if hs.in_flight(req) else "already held" if req.rid in self.held else None
        if why is not None:
            self._recomputed(req, why)
            return
        if self.writer.full():
            self._recomputed(req, f"{WRITER_DEPTH} retracted requests are being written")
            return
        path = os.path.join(self.directory, safe_file_name(req.rid) + SUFFIX)
        try:
            cap = hs.capture(req, path, uuid.uuid4().hex, extra=retracted_extra(req))
        except Exception as e:  # noqa: BLE001 - refused or failed: SGLang recomputes the request
            self._recomputed(req, error_of(typed(e, "retraction", path))["message"])
            return
        self.captured[id(req)] = (path, cap)

    def after_release(self, req, backup_saved: bool) -> None:
        """SGLang released ``req``; a capture of it is written now (it is queued next: :meth:`take`)."""
        entry = self.captured.pop(id(req), None)
        if entry is None or not backup_saved or not req.is_retracted:
            return
        path, cap = entry
        ex = Export(req.rid, path, keep_running=False, asked=time.monotonic(), req=req, found_in="retracted")
        job = LinkJob(ex, cap, {}, 0.0, fsync=False)
        self.writer.submit(job)
        self.released[id(req)] = Held(req, path, time.monotonic(), job=job)

    def take(self, req) -> bool:
        """SGLang queues a retracted request: hold it here when its file is on the way (True), else let SGLang queue
        it (False)."""
        held = self.released.pop(id(req), None)
        if held is None:
            return False
        self.held[req.rid] = held
        self.counts["to_disk"] += 1
        _count("to_disk")
        return True

    # ------------------------------------------------------------------ every scheduler iteration

    def busy(self) -> bool:
        return bool(self.held or self.captured or self.released or self.writer.busy())

    def service(self) -> None:
        """Collect the files written; put back, oldest first, every held request that fits now."""
        # captured or released in an iteration that did not queue the request: its file goes when written
        self.captured.clear()
        self.released.clear()
        for job in self.writer.collect():
            held = self.held.get(job.ex.rid)
            if held is None or held.job is not job:
                _remove(job.ex.path)  # the request left meanwhile (aborted): its file goes
                continue
            held.job = None
            if job.error is not None:
                self._give_back(held, f"its file could not be written: {job.error.get('message')}")
                continue
            held.written, held.bytes = True, int(job.info.info.file_length)
            self.bytes_written += held.bytes
        for rid, held in list(self.held.items()):
            if held.req.finished():  # finished while held (an abort SGLang answered): nothing to put back
                self._drop(rid)
                continue
            if not held.written:
                break  # still being written: the ones behind it wait (oldest first)
            if held.proof is None:
                if not self._fits(held.req):
                    break  # no room: the ones behind it wait
                held.proof = self._prove(held)
            self.hs.let_run(held.proof)
            if not held.proof.done:
                break  # being read: the ones behind it wait
            if held.proof.error is None and not self._fits(held.req):
                break  # proved, but the room went to others meanwhile: kept proved until it fits
            self._restore(held)

    def _prove(self, held: Held) -> Job:
        """The proof of ``held``'s file: in place for a small local file, else on a thread of its own (a resume's rule:
        :func:`hsnap_sglang.jobs.proves_here`, the operator's ``HSNAP_PROOF_ON_SCHEDULER_BYTES``)."""
        hs, s = self.hs, self.hs.sched
        here = proves_here(held.path, hs.proof_here_bytes)

        def prove():
            # off this thread, the room is the restore's to check: a request admitted meanwhile must not refuse the file
            return prove_retracted(held.path, held.req, req_to_token_pool=s.req_to_token_pool,
                                   token_to_kv_pool_allocator=s.token_to_kv_pool_allocator, identity=hs.identity(),
                                   room=hs.room() if here else None, capacity=here)

        return Job.run_here(prove) if here else Job(prove, "hsnap-retraction-proof")

    def _fits(self, req) -> bool:
        """Whether ``req`` fits as SGLang's admission counts room (PrefillAdder's budget: free plus evictable token
        slots, less the running requests' decode reservation at the current new_token_ratio; a request row, a Mamba
        slot, a running-request place)."""
        from sglang.srt.managers.schedule_policy import CLIP_MAX_NEW_TOKENS

        s = self.hs.sched
        running = s.running_batch.reqs
        if len(running) >= s.max_running_requests or s.req_to_token_pool.available_size() < 1:
            return False
        mamba = getattr(s.req_to_token_pool, "mamba_allocator", None)
        if mamba is not None:
            spare = int(s.tree_cache.mamba_evictable_size()) if hasattr(s.tree_cache, "mamba_evictable_size") else 0
            if mamba.available_size() + spare < 1:
                return False
        ratio = s.new_token_ratio_tracker.current

        def reserve(r) -> float:
            left = min(r.sampling_params.max_new_tokens - len(r.output_ids), CLIP_MAX_NEW_TOKENS)
            return left * (1.0 if r.sampling_params.ignore_eos else ratio)

        budget = s.token_to_kv_pool_allocator.create_prefill_budget(s.tree_cache)
        budget.total_offset += sum(reserve(r) for r in running)
        rows = len(req.origin_input_ids) + len(req.output_ids) - 1
        return budget.remaining_total >= rows + reserve(req)

    def _restore(self, held: Held) -> None:
        """Upload ``held``'s proved file into fresh slots and admit it; a refused proof or upload gives it back."""
        hs, s, req, job = self.hs, self.hs.sched, held.req, held.proof
        t0 = time.monotonic()
        proven, job.result, held.proof = job.result, None, None
        try:
            if job.error is not None:
                raise job.error
            restore_retracted(proven, tree_cache=s.tree_cache, room=hs.room())
        except Exception as e:  # noqa: BLE001 - refused (or failed, pools rolled back): SGLang recomputes it
            self._give_back(held, error_of(typed(e, "retraction", held.path))["message"])
            return
        upload_s = time.monotonic() - t0
        restored_s = job.ended - job.started + upload_s
        del self.held[req.rid]
        _remove(held.path)
        req.skip_radix_cache_insert = True  # as a resumed request: its slots are its own, not the tree's
        hs.admit([req])
        self.counts["restored"] += 1
        self.restore_s += restored_s
        _count("restored")
        self.last = {"rid": req.rid, "committed_positions": int(req.kv.kv_committed_len), "bytes": held.bytes,
                     "bytes_uploaded": int(req.hsnap_restored.bytes_uploaded),
                     "held_s": time.monotonic() - held.since, "restore_s": restored_s, "prove_s": job.ended - job.started,
                     "upload_s": upload_s}

    # ------------------------------------------------------------------ leaving

    def _give_back(self, held: Held, why: str) -> None:
        """Into SGLang's waiting queue, as SGLang would have queued it: recomputed there."""
        self._drop(held.req.rid)
        self._recomputed(held.req, why)
        self.hs.sched._add_request_to_queue(held.req, is_retracted=True)

    def _drop(self, rid: str) -> None:
        held = self.held.pop(rid, None)
        if held is None:
            return
        if held.proof is not None:  # its proof (running, or done and unused) is closed once it ends
            held.proof.discard()
            held.proof = None
        if held.job is None:
            _remove(held.path)  # one still being written is removed when collected

    def _recomputed(self, req, why: str) -> None:
        self.counts["recomputed"] += 1
        _count("recomputed")
        logger.warning("hsnap retraction of %s: recomputed by SGLang (%s)", req.rid, why)

    def release_for_abort(self, matches) -> None:
        """An abort names held requests: they go into SGLang's waiting queue first, where its abort finds them."""
        for rid, held in list(self.held.items()):
            if matches(rid):
                self._drop(rid)
                self.hs.sched.waiting_queue.append(held.req)

    def state(self) -> dict:
        return {"dir": self.directory, **self.counts, "held": {rid: _held_state(h) for rid, h in self.held.items()},
                "bytes_written": self.bytes_written, "restore_s": self.restore_s, "last": self.last}


def _held_state(held: Held) -> str:
    if not held.written:
        return "being written"
    return "on disk" if held.proof is None else "being proved" if not held.proof.done else "proved"


def _count(outcome: str) -> None:
    from . import metrics

    metrics.count("retractions", outcome)


def _remove(path: str) -> None:
    guarded("removing a retraction file", _unlink, path)


def _unlink(path: str) -> None:
    try:
        os.unlink(path)
    except (FileNotFoundError, NotADirectoryError):  # nothing there to remove
        pass


def from_env(hs) -> RetractionToDisk | None:
    """The operator's ``HSNAP_RETRACT_DIR`` (created, mode 0700), at TP 1 without PD disaggregation or the overlap
    scheduler; else None (said once when set but not usable)."""
    directory = os.environ.get(RETRACT_DIR_ENV)
    if not directory:
        return None
    mode = getattr(hs.sched, "disaggregation_mode", None)  # the scheduler's DisaggregationMode
    pd = str(getattr(mode, "value", mode) or "null")
    why = ("TP > 1" if hs.tp_size > 1 else
           "PD disaggregation" if pd != "null" else
           # a request retracted there always has a forward in flight: its state is already past its committed record
           "the overlap scheduler; --disable-overlap-schedule turns it off" if getattr(hs.sched, "enable_overlap", False) else None)
    if why is not None:
        logger.warning("hsnap: %s=%s ignored (%s): SGLang recomputes retracted requests", RETRACT_DIR_ENV, directory, why)
        return None
    os.makedirs(directory, mode=0o700, exist_ok=True)
    return RetractionToDisk(hs, os.path.abspath(directory))


__all__ = ["RETRACT_DIR_ENV", "SUFFIX", "OUTCOMES", "RetractionToDisk", "from_env"]
