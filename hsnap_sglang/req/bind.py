"""A resumed ``Req`` bound to the slots a restore allocated: the Mamba radix-tracking slots SGLang gives every new
request (:func:`mamba_tracking_slots`, :func:`check_tracking_capacity`), ``req.kv`` pointed at the restored slots
(:func:`bind_restored`), and the ``bind`` step of ``hsnap_io.restore.restore_opened`` that does both inside the
restore's rollback (:func:`binder`)."""

from __future__ import annotations

import copy
import dataclasses
from dataclasses import dataclass
from typing import Any, Callable, Mapping

import torch

from hsnap_format import CapacityError
from hsnap_format.errors import IncompatibleSnapshotError

from .values import component_type


def mamba_tracking_slots(req_to_token_pool) -> int:
    """Ping-pong radix-tracking slots SGLang gives every new request on this target (0 without the extra buffer)."""
    return int(req_to_token_pool.mamba_initial_tracking_slots) if getattr(req_to_token_pool, "enable_mamba_extra_buffer", False) else 0


def check_tracking_capacity(req_to_token_pool, tracking: int, path, spare: int = 0) -> None:
    """Before the restore allocates (hold pool_lock): room for the working Mamba slot and the track slots, counting
    ``spare`` Mamba slots a caller could free (:meth:`hsnap_io.slots.Room.spare`)."""
    free = req_to_token_pool.mamba_allocator.available_size() if tracking else 0
    if tracking and free + spare < 1 + tracking:
        raise CapacityError(path, "target pools", detail=f"does not fit: mamba slots (working + {tracking} ping-pong track): need {1 + tracking}, "
                                                         f"free {free}" + (f" + {spare} evictable" if spare else ""))


@dataclass
class ProvenRestore:
    """A snapshot opened once and every digest proved (:func:`hsnap_io.restore.prove_opened`) touching no pool, kept
    for its restore into ``view``: what a resume's and a retracted request's proofs share.  :meth:`restore` fills
    the slots; :meth:`close` gives everything back (a proof never restored)."""

    source: Any  # hsnap_io.restore.OpenSource, proved
    view: Any  # the target's PoolView
    identity: Any  # the target's Identity, or None
    tracking: int  # Mamba ping-pong track slots the Req gets
    restore_kwargs: dict

    def close(self) -> None:
        self.source.close()

    def restore(self, *, room, bind):
        """:func:`restore_proved` of this proof; closes it whatever happens."""
        with self.source as source:
            return restore_proved(source, self.view, identity=self.identity, room=room, tracking=self.tracking, bind=bind,
                                  restore_kwargs=self.restore_kwargs)


def restore_proved(source, view, *, identity, room, tracking: int, bind, restore_kwargs: Mapping[str, Any]):
    """The restore of a ``source`` :func:`hsnap_io.restore.prove_opened` proved: under the pool lock, the track slots
    checked counting what ``room`` (:class:`hsnap_io.slots.Room`, or None) could free, the room made (only now: a
    snapshot refused for anything never costs the cache), the track slots checked again, and the restore with
    ``bind``."""
    from hsnap_io.restore import restore_opened
    from hsnap_io.slots import pool_lock, slots_needed

    pools = dict(req_to_token_pool=view.req_to_token_pool, token_to_kv_pool_allocator=view.allocator)
    path = source.snap.path
    with pool_lock(view.req_to_token_pool):  # capacity check, restore and track slots: one step for other allocators
        if room is not None:
            check_tracking_capacity(view.req_to_token_pool, tracking, path, spare=room.spare().get("mamba slots", 0))
            room.make(*slots_needed(source.snap, view))  # every check passed: free only what is missing
        check_tracking_capacity(view.req_to_token_pool, tracking, path)
        return restore_opened(source, **pools, identity=identity, bind=bind, **restore_kwargs)


_TRACK_FIELDS = ("mamba_ping_pong_track_buffer", "mamba_ping_pong_empty", "mamba_prev_track_seqlen", "mamba_next_track_idx", "mamba_last_track_idx")


def binder(req, kvx: Mapping[str, Any], tree_cache, req_to_token_pool, tracking: int, commit: Callable[[], None] | None = None):
    """restore_opened's ``bind``: fresh track slots first (what can fail: inside the
    restore's rollback, before ``req`` is touched), then ``req.kv`` onto the slots (and the
    root of ``tree_cache``, the requests' radix tree, if any), then ``commit()`` (the caller's
    last word, e.g. every TP rank agreeing): whatever raises gives every allocation back and
    leaves ``req`` as it was."""

    def bind(restored) -> None:
        root = tree_cache.root_node_handle(req.extra_key) if tree_cache is not None else None
        # the state restored is the request's: at a decode boundary its KV rows hold the prompt and every output
        # but the last (the next step's input); a record of another step (a stale link's) would decode on silently wrong
        expected = len(req.origin_input_ids) + len(req.output_ids) - 1
        if int(restored.state_position) != expected:
            raise IncompatibleSnapshotError(None, [("state_position", f"prompt + output - 1 = {expected} (the request's record)",
                                                    int(restored.state_position))])
        track = None
        if tracking:
            # fresh radix-tracking slots, as HybridReqToTokenPool.alloc gives a new request: no
            # tracked state yet (mamba_last_track_seqlen None), so nothing stale reaches a tree
            scratch = _Scratch(type(req.kv)())
            req_to_token_pool._alloc_ping_pong_buffer(scratch)
            track = {name: getattr(scratch.kv, name) for name in _TRACK_FIELDS}
            req_to_token_pool.req_index_to_mamba_ping_pong_track_buffer_mapping[restored.req_pool_idx] = track["mamba_ping_pong_track_buffer"]
        kv_before = {f.name: getattr(req.kv, f.name) for f in dataclasses.fields(req.kv)}
        req_before = {name: copy.copy(getattr(req, name)) for name in _BOUND_REQ_ATTRS if hasattr(req, name)}
        try:
            bind_restored(req, restored, kvx, root=root)
            for name, value in (track or {}).items():
                setattr(req.kv, name, value)
            if commit is not None:
                commit()
        except BaseException:  # the pools are rolled back by the caller: leave req as it was too
            for name, value in {**kv_before}.items():
                setattr(req.kv, name, value)
            for name, value in req_before.items():
                setattr(req, name, value)
            raise

    return bind


_BOUND_REQ_ATTRS = ("full_untruncated_fill_ids", "extend_end", "prefix_len", "lock", "last_node", "last_host_node", "best_match_node")


@dataclass
class _Scratch:  # what _alloc_ping_pong_buffer writes to (req.kv), before the real req is bound
    kv: Any


def bind_restored(req, restored, kvx: Mapping[str, Any], *, root=None) -> None:
    """Point ``req.kv`` at the slots of ``restored`` (a :class:`RestoredRequest`) and
    leave nothing pending that would overwrite the restored state. ``kvx``: the carried
    ReqKvInfo values (:func:`decode_carried`); ``root``: the tree root handle, if any.
    Sets attributes only: everything that can fail was checked before allocation."""
    ct = component_type()
    kv = req.kv
    kv.req_pool_idx = restored.req_pool_idx
    kv.kv_committed_len = kv.kv_allocated_len = restored.state_position
    kv.cache_protected_len = kv.cache_inserted_len = 0
    seqlens = dict(kvx.get("component_evicted_seqlens") or {})
    freed = restored.swa_evict_floor  # SWA slots the restore freed: swa_start in whole target pages
    if ct.SWA in seqlens or freed:
        seqlens[ct.SWA] = freed
    kv.component_evicted_seqlens = seqlens
    # SGLang frees [swa_dead_lo, SWA cursor) full-side only and everything below swa_dead_lo
    # on both sides: a shield above 0 over positions whose SWA slots the restore already freed
    # would free them twice. The restored request holds no SWA rows below swa_start anyway.
    kv.swa_evict_floor = 0 if freed else int(kvx.get("swa_evict_floor", 0))
    kv.retraction_backup = None
    if restored.mamba_pool_idx is not None:
        kv.mamba_pool_idx = torch.tensor(restored.mamba_pool_idx, dtype=torch.int64)  # 0-d, as SGLang's alloc
    kv.mamba_needs_clear = False  # sglang#32995: a set flag zeroes the restored state
    kv.mamba_cow_src_index = None  # a pending COW would overwrite it with a tree copy
    req.refresh_fill_ids()
    req.extend_end = restored.state_position
    req.prefix_len = 0
    req.lock = None
    if root is not None:
        req.last_node = req.last_host_node = req.best_match_node = root
