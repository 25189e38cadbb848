"""The processes of ``hsnap demo --library``: each is ``python -m hsnap_io.demo.run --child ROLE ...``.

Arguments and paths come on the command line; each child writes its result as one JSON file (``--result``); no
pickle anywhere.  Every child pins the torch thread count first (bit-exactness depends on it).

* ``reference``: uninterrupted greedy / sampled generation of N tokens.
* ``export``: generate k tokens, write the model's attention KV and GDN conv / recurrent state into real SGLang pools
  (``HybridReqToTokenPool`` + ``HybridLinearKVPool``) at the request's slots.  A greedy request is SGLang's own
  ``Req`` (constructor, ``HybridReqToTokenPool.alloc``, outputs / logprobs / reasoning / stream offsets advanced as
  the scheduler advances them), snapshotted with :func:`hsnap_sglang.req.snapshot_req` and released with SGLang's
  ``release_kv_cache``; a sampled one keeps the demo's own sampler state, which no SGLang ``Req`` holds, and goes
  through :func:`hsnap_io.export_request` with a hand-built record.  Then exit.  With ``--negative-dir`` also the
  sources of the negative client: one snapshot file and a committed 2-rank snapshot directory.
* ``resume``: a fresh process.  Builds pools of another capacity with other slots in use (every buffer filled with
  noise), gets a live ``Req`` from :func:`hsnap_sglang.req.resume_req` (a sampled snapshot: :func:`hsnap_io.restore_request`),
  rebuilds the model's cache from the slots in ``req.kv`` and continues to N tokens, streaming from the offsets.
  It is given only the snapshot path: prompt, outputs so far, sampling parameters, budget, stream offsets,
  reasoning state (and a sampled snapshot's sampler state) all come from the snapshot.
* ``negative``: restores bad snapshots (wrong weights, wrong layout, missing rank file, corrupted section) and
  checks that each is refused with its typed error and that the target pools are untouched.
"""

from __future__ import annotations

import argparse
import dataclasses
import hashlib
import json
import os
import shutil
import time
import uuid
import warnings
from datetime import datetime, timezone
from typing import Any

# pools of child 2 (export) and child 3 (resume): other capacities, other occupants, same page size (page size is
# part of the layout a snapshot binds to)
SOURCE_POOLS = dict(size=256, mamba_size=4)
SOURCE_OTHERS = (13,)
TARGET_POOLS = dict(size=512, mamba_size=8)
TARGET_OTHERS = (7, 23)

NEGATIVE_FILE = "request.hsnap"
NEGATIVE_TP2 = "tp2.hsnap"
NEGATIVE_CORRUPT = "corrupted.hsnap"


def _pin_threads(threads: int) -> None:
    import torch

    torch.set_num_threads(threads)
    try:
        torch.set_num_interop_threads(1)
    except RuntimeError:  # already set (only possible before any parallel work)
        pass


def _write_json(path: str, obj: Any) -> None:
    tmp = path + ".tmp"
    with open(tmp, "w") as f:
        json.dump(obj, f, indent=1, sort_keys=True)
    os.replace(tmp, path)


def _sha256(b: bytes | None) -> str | None:
    return None if b is None else hashlib.sha256(b).hexdigest()


def _slots_summary(token_indices, req_pool_idx: int, mamba_idx: int | None, pools) -> dict[str, Any]:
    tok = [int(x) for x in token_indices.tolist()]
    return {
        "req_pool_idx": int(req_pool_idx),
        "mamba_idx": None if mamba_idx is None else int(mamba_idx),
        "token_slots": len(tok),
        "first_token_slot": tok[0] if tok else None,
        "last_token_slot": tok[-1] if tok else None,
        "pool_token_capacity": pools.size,
        "pool_mamba_capacity": pools.mamba_size,
    }


class Demo:
    """The model (and its decoder, identity and pools) as every child builds it."""

    def __init__(self, arch: str, model_seed: int, threads: int) -> None:
        from .model import Decoder, build_model, weights_digest

        self.arch, self.model_seed, self.threads = arch, model_seed, threads
        self.model, self.geom = build_model(seed=model_seed, arch=arch)
        self.dec = Decoder(self.model, self.geom)
        self.weights = weights_digest(self.model)

    def numerics(self) -> dict[str, Any]:
        from .model import numerics_environment

        env = numerics_environment()
        env["attn_implementation"] = self.model.config._attn_implementation
        env["dtype"] = str(self.geom.kv_dtype).removeprefix("torch.")
        return env

    def identity(self, **over):
        import importlib.metadata

        import hsnap_format as hf

        try:
            version = importlib.metadata.version("sglang")
        except importlib.metadata.PackageNotFoundError:
            version = "unknown"
        base = dict(
            model_id=f"hsnap-demo/tiny-{self.arch}",
            weights_version=f"sha256:{self.weights[:16]}",
            weights_hash=f"sha256:{self.weights}",
            engine=hf.Engine("sglang", version, ""),
            tp_size=1,
            tp_rank=0,
            device="cpu",
            snapshot_id=f"demo-{uuid.uuid4().hex[:16]}",
            created_at=datetime.now(timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ"),
            hsnap_version=hf.__version__,
            numerics=self.numerics(),
        )
        base.update(over)
        return hf.Identity(**base)

    def pools(self, *, size: int, mamba_size: int, others=(), noise_seed: int = 0, geom=None):
        """Real SGLang pools, every buffer filled with noise, ``others`` requests occupying slots first."""
        import torch

        from .model import alloc_request, build_pools

        pools = build_pools(geom or self.geom, size=size, mamba_size=mamba_size)
        gen = torch.Generator().manual_seed(noise_seed)
        kv = pools.kv_pool.full_kv_pool
        state = pools.req_to_token_pool.mamba_pool.mamba_cache
        for buf in [*kv.k_buffer, *kv.v_buffer, *state.conv, state.temporal]:
            buf.copy_(torch.randn(buf.shape, generator=gen, dtype=torch.float32).to(buf.dtype))
        occupants = [alloc_request(pools, n) for n in others]
        return pools, occupants

    def pause(self, prompt, k: int, temperature: float, seed: int | None):
        """Generate k tokens: the request as a scheduler holds it (cache = prompt + outputs[:-1])."""
        part = self.dec.generate(prompt, k, temperature=temperature, seed=seed if temperature > 0 else None)
        if part.seq_len != len(prompt) + k - 1:
            raise AssertionError(f"cache holds {part.seq_len} positions, expected {len(prompt) + k - 1}")
        return part

    def record(self, name: str, prompt, part, n: int, k: int, temperature: float, seed: int | None):
        import hsnap_format as hf

        return hf.RequestRecord(
            rid=f"demo-{name}",
            prompt_ids=list(prompt),
            output_ids=part.token_ids,
            output_logprobs=part.logprobs,
            state_position=part.seq_len,
            sampling={
                "temperature": float(temperature),
                "top_p": 1.0,
                "top_k": -1,
                "min_p": 0.0,
                "sampling_seed": seed if temperature > 0 else None,
            },
            max_new_tokens=n,
            streamed_tokens=k,
            rng_state=part.generator_state,  # the sampler's torch.Generator state (None for greedy)
            extra={"demo": "hsnap demo", "variant": name},
        )

    def export(self, path: str, pools, part, record, identity) -> dict[str, Any]:
        """Cache -> pools (at freshly allocated slots) -> snapshot file; the slots are freed afterwards."""
        from hsnap_io import export_request

        from .model import alloc_request, cache_to_pool_tensors, free_request, write_to_pools

        tensors = cache_to_pool_tensors(part.cache, self.geom)
        slots = alloc_request(pools, part.seq_len)
        write_to_pools(
            pools.req_to_token_pool, pools.allocator, slots.token_indices, slots.mamba_idx, tensors,
            req_pool_idx=slots.req_pool_idx,
        )
        t = time.perf_counter()
        info = export_request(
            path,
            req_to_token_pool=pools.req_to_token_pool,
            token_to_kv_pool_allocator=pools.allocator,
            req_pool_idx=slots.req_pool_idx,
            record=record,
            identity=identity,
        )
        seconds = time.perf_counter() - t
        where = _slots_summary(slots.token_indices, slots.req_pool_idx, slots.mamba_idx, pools)
        free_request(pools, slots)  # the file is durable under its final name: the slots may go
        return {
            "path": info.path,
            "file_length": info.file_length,
            "payload_bytes": info.payload_bytes,
            "root_digest": info.root_digest,
            "snapshot_id": identity.snapshot_id,
            "export_seconds": seconds,
            "slots": where,
        }


    def export_req(self, path: str, pools, part, name: str, prompt, n: int, identity) -> dict[str, Any]:
        """The paused request as SGLang's own Req in the pools -> snapshot_req -> SGLang's release."""
        from hsnap_sglang.req import snapshot_req

        from . import reqs
        from .model import cache_to_pool_tensors, write_to_pools

        req = reqs.new_req(name, prompt, n, self.geom.vocab_size)
        tok = reqs.admit(pools, req, part.seq_len)  # SGLang's HybridReqToTokenPool.alloc: row + mamba slot
        write_to_pools(pools.req_to_token_pool, pools.allocator, tok, int(req.kv.mamba_pool_idx), cache_to_pool_tensors(part.cache, self.geom))
        req.kv.mamba_needs_clear = False  # the prefill forward wrote the slot (SGLang clears the flag there)
        chunks = [c for t, lp in zip(part.token_ids, part.logprobs) if (c := reqs.advance(req, t, lp)) is not None]
        t = time.perf_counter()
        info = snapshot_req(path, req, req_to_token_pool=pools.req_to_token_pool, token_to_kv_pool_allocator=pools.allocator, identity=identity)
        seconds = time.perf_counter() - t
        where = _slots_summary(tok, req.kv.req_pool_idx, int(req.kv.mamba_pool_idx), pools)
        free_before = (pools.allocator.available_size(), pools.req_to_token_pool.mamba_allocator.available_size())
        reqs.release(pools, req)  # the file is durable under its final name: SGLang's release_kv_cache
        free_after = (pools.allocator.available_size(), pools.req_to_token_pool.mamba_allocator.available_size())
        return {
            "api": "sglang.Req",
            "rid": req.rid,
            "path": info.path,
            "file_length": info.file_length,
            "payload_bytes": info.payload_bytes,
            "root_digest": info.root_digest,
            "snapshot_id": identity.snapshot_id,
            "export_seconds": seconds,
            "slots": where,
            "stream_chunks": chunks,
            "reasoning": reqs.reasoning(req),
            "released": {"token_slots_freed": free_after[0] - free_before[0], "mamba_slots_freed": free_after[1] - free_before[1],
                         "req_pool_idx_after": req.kv.req_pool_idx},
        }


def _common(p: argparse.ArgumentParser) -> None:
    p.add_argument("--child", required=True, choices=["reference", "export", "resume", "negative", "reshard-export", "reshard-resume"])
    p.add_argument("--result", required=True, help="JSON file to write")
    p.add_argument("--arch", default="qwen3_5")
    p.add_argument("--model-seed", type=int, default=0)
    p.add_argument("--threads", type=int, default=1)


def _ints(s: str) -> list[int]:
    return [int(x) for x in s.split(",") if x]


def child_main(argv: list[str]) -> int:
    p = argparse.ArgumentParser(prog="python -m hsnap_io.demo.run --child")
    _common(p)
    p.add_argument("--prompt", type=_ints, help="comma-separated token ids")
    p.add_argument("--n", type=int)
    p.add_argument("--k", type=int)
    p.add_argument("--variant", nargs=3, action="append", default=[], metavar=("NAME", "TEMPERATURE", "SEED"))
    p.add_argument("--snapshot", nargs=2, action="append", default=[], metavar=("NAME", "PATH"))
    p.add_argument("--negative-dir")
    p.add_argument("--set", help="snapshot directory (--reshard)")
    p.add_argument("--reshard-src", type=int, help="TP size of the set to write (--reshard)")
    args = p.parse_args(argv)
    _pin_threads(args.threads)  # before any torch work
    t_import = time.perf_counter()
    from hsnap_io._sglang_env import import_sglang

    import_sglang()
    demo = Demo(args.arch, args.model_seed, args.threads)
    setup = time.perf_counter() - t_import
    from . import reshard_demo

    fn = {"reference": _reference, "export": _export, "resume": _resume, "negative": _negative,
          "reshard-export": reshard_demo.child_export, "reshard-resume": reshard_demo.child_resume}[args.child]
    t = time.perf_counter()
    result = fn(demo, args)
    result.update(
        role=args.child,
        pid=os.getpid(),
        threads=args.threads,
        numerics=demo.numerics(),
        weights_version=f"sha256:{demo.weights[:16]}",
        seconds={"setup": setup, "work": time.perf_counter() - t},  # setup: SGLang import + model
        positions_forwarded_in_process=demo.dec.positions_forwarded,
        forward_calls_in_process=demo.dec.forward_calls,
    )
    _write_json(args.result, result)
    return 0


def _variants(args) -> list[tuple[str, float, int | None]]:
    return [(name, float(t), None if s == "-" else int(s)) for name, t, s in args.variant]


# ------------------------------------------------------------------------------------------------ child 1


def _reference(demo: Demo, args) -> dict[str, Any]:
    out = {}
    from . import reqs

    for name, temperature, seed in _variants(args):
        g = demo.dec.generate(args.prompt, args.n, temperature=temperature, seed=seed if temperature > 0 else None)
        out[name] = {
            "reasoning_at_k": reqs.reasoning_of(g.token_ids[: args.k], demo.geom.vocab_size),
            "reasoning_final": reqs.reasoning_of(g.token_ids, demo.geom.vocab_size),
            "token_ids": g.token_ids,
            "logprobs": g.logprobs,
            "positions_forwarded": g.positions,
            "forward_calls": g.forward_calls,
            "rng_state_sha256": _sha256(g.generator_state),
        }
    return {"variants": out}


# ------------------------------------------------------------------------------------------------ child 2


def _export(demo: Demo, args) -> dict[str, Any]:
    pools, _ = demo.pools(**SOURCE_POOLS, others=SOURCE_OTHERS, noise_seed=11)
    out = {}
    paths = dict(args.snapshot)
    for name, temperature, seed in _variants(args):
        path = paths[name]
        part = demo.pause(args.prompt, args.k, temperature, seed)
        if temperature == 0:
            res = demo.export_req(path, pools, part, name, args.prompt, args.n, demo.identity())
        else:  # the demo's own sampler state: no SGLang Req holds one (docs/sglang.md, "Sampler RNG")
            record = demo.record(name, args.prompt, part, args.n, args.k, temperature, seed)
            res = demo.export(path, pools, part, record, demo.identity())
            res["api"] = "record"
        res.update(
            token_ids=part.token_ids,
            logprobs=part.logprobs,
            state_position=part.seq_len,
            positions_forwarded=part.positions,
            rng_state_sha256=_sha256(part.generator_state),
        )
        out[name] = res
    result: dict[str, Any] = {"variants": out}
    if args.negative_dir:
        result["negative_sources"] = _negative_sources(demo, args, pools)
    return result


def _negative_sources(demo: Demo, args, pools) -> dict[str, Any]:
    """A greedy snapshot file and a committed 2-rank snapshot directory (the same shard under both ranks)."""
    import hsnap_format as hf
    from hsnap_format.spec import rank_file_name
    from hsnap_io.tp import staging_dir

    d = args.negative_dir
    part = demo.pause(args.prompt, args.k, 0.0, None)
    record = demo.record("negative-source", args.prompt, part, args.n, args.k, 0.0, None)
    single = demo.export(os.path.join(d, NEGATIVE_FILE), pools, part, record, demo.identity())
    final = os.path.join(d, NEGATIVE_TP2)
    sid = f"demo-tp2-{uuid.uuid4().hex[:12]}"
    staging = staging_dir(final, sid)
    os.mkdir(staging, 0o700)
    ranks = []
    for r in range(2):
        ident = demo.identity(tp_size=2, tp_rank=r, snapshot_id=sid)
        ranks.append(demo.export(os.path.join(staging, rank_file_name(r)), pools, part, record, ident))
    manifest = hf.SetWriter(final, staging=staging).commit(tp_size=2)
    return {
        "file": single,
        "tp2": {"path": final, "snapshot_id": manifest.snapshot_id, "ranks": [r.file for r in manifest.ranks]},
    }


# ------------------------------------------------------------------------------------------------ child 3


def _resume(demo: Demo, args) -> dict[str, Any]:
    import torch

    from hsnap_io import NumericsWarning, restore_request

    from .model import pool_tensors_to_cache, read_from_pools, request_slots

    pools, occupants = demo.pools(**TARGET_POOLS, others=TARGET_OTHERS, noise_seed=23)
    identity = demo.identity()  # this process's own: same model and weights, maybe other numerics
    out = {}
    for name, path in args.snapshot:
        if _is_req_snapshot(path):
            out[name] = _resume_req(demo, pools, occupants, identity, path)
            continue
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always", NumericsWarning)
            t = time.perf_counter()
            restored = restore_request(
                path, req_to_token_pool=pools.req_to_token_pool, token_to_kv_pool_allocator=pools.allocator,
                identity=identity,
            )
            restore_seconds = time.perf_counter() - t
        numerics_warnings = [str(w.message) for w in caught if issubclass(w.category, NumericsWarning)]
        rec = restored.record
        seq = restored.state_position
        # the request's state, found through the pool's own tables (req_to_token row, req -> mamba slot)
        tok, mid = request_slots(pools.req_to_token_pool, restored.req_pool_idx, seq)
        if not torch.equal(tok, restored.token_indices) or mid != restored.mamba_pool_idx:
            raise AssertionError("restore_request's slots disagree with the pool's tables")
        cache = pool_tensors_to_cache(read_from_pools(pools.req_to_token_pool, pools.allocator, tok, mid, demo.geom), demo.geom, seq)

        temperature = float(rec.sampling.get("temperature", 0.0))
        fed0 = len(demo.dec.fed_ranges)
        g = demo.dec.generate(
            rec.prompt_ids.tolist(),  # only its length is used: to check the cache; nothing of it is fed
            int(rec.max_new_tokens),
            temperature=temperature,
            generator_state=rec.rng_state if temperature > 0 else None,
            cache=cache,
            start_outputs=rec.output_ids.tolist(),
            start_logprobs=rec.output_logprobs.tolist() if rec.output_logprobs is not None else None,
        )
        fed = demo.dec.fed_ranges[fed0:]
        recomputed = sum(max(0, min(s + n, seq) - s) for s, n in fed)
        out[name] = {
            "token_ids": g.token_ids,
            "logprobs": g.logprobs,
            "restored_outputs": len(rec.output_ids),
            "max_new_tokens": int(rec.max_new_tokens),
            "state_position": seq,
            "positions_forwarded": g.positions,
            "forward_calls": g.forward_calls,
            "first_position_fed": fed[0][0] if fed else None,
            "history_positions_recomputed": recomputed,
            "rng_state_sha256": _sha256(g.generator_state),
            "rng_state_restored": rec.rng_state is not None,
            "numerics_warnings": numerics_warnings,
            "numerics_differences": [list(d) for d in restored.numerics_differences],
            "snapshot_id": restored.snapshot_id,
            "bytes_uploaded": restored.bytes_uploaded,
            "restore_seconds": restore_seconds,
            "slots": _slots_summary(tok, restored.req_pool_idx, mid, pools),
            "other_requests": [_slots_summary(o.token_indices, o.req_pool_idx, o.mamba_idx, pools) for o in occupants],
            "api": "record",
        }
    return {"variants": out}


def _is_req_snapshot(path: str) -> bool:
    import hsnap_format as hf
    from hsnap_sglang.req import FORMAT, FORMAT_KEY

    with hf.open(path) as snap:
        return snap.request.get("extra", {}).get(FORMAT_KEY) == FORMAT


def _resume_req(demo: Demo, pools, occupants, identity, path: str) -> dict[str, Any]:
    """A live SGLang Req from the snapshot alone; the model continues from the slots in req.kv."""
    import torch

    from hsnap_io import NumericsWarning
    from hsnap_sglang.req import resume_req

    from . import reqs
    from .model import pool_tensors_to_cache, read_from_pools, request_slots

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always", NumericsWarning)
        t = time.perf_counter()
        req = resume_req(path, req_to_token_pool=pools.req_to_token_pool, token_to_kv_pool_allocator=pools.allocator, identity=identity)
        restore_seconds = time.perf_counter() - t
    numerics_warnings = [str(w.message) for w in caught if issubclass(w.category, NumericsWarning)]
    restored = req.hsnap_restored
    seq = req.kv.kv_committed_len
    tok, mid = request_slots(pools.req_to_token_pool, req.kv.req_pool_idx, seq)
    if not torch.equal(tok, restored.token_indices) or mid != int(req.kv.mamba_pool_idx):
        raise AssertionError("req.kv disagrees with the pool's tables")
    if req.sampling_params.top_k != 1:
        raise AssertionError("the demo's Req path is greedy (SGLang's normal form: top_k 1)")
    flags = {"mamba_needs_clear": req.kv.mamba_needs_clear, "mamba_cow_src_index": req.kv.mamba_cow_src_index,
             "kv_committed_len": seq, "kv_allocated_len": req.kv.kv_allocated_len, "seqlen": req.seqlen}
    at_resume = reqs.reasoning(req)
    streamed_at_resume = req.send_token_offset
    cache = pool_tensors_to_cache(read_from_pools(pools.req_to_token_pool, pools.allocator, tok, mid, demo.geom), demo.geom, seq)
    fed0 = len(demo.dec.fed_ranges)
    g = demo.dec.generate(
        list(req.origin_input_ids),  # only its length is used: to check the cache; nothing of it is fed
        int(req.sampling_params.max_new_tokens),
        temperature=0.0,
        cache=cache,
        start_outputs=list(req.output_ids),
        start_logprobs=list(req.logprob.output_token_logprobs_val),
    )
    fed = demo.dec.fed_ranges[fed0:]
    restored_outputs = len(req.output_ids)
    chunks = [c for t, lp in zip(g.new_token_ids, g.new_logprobs) if (c := reqs.advance(req, t, lp)) is not None]
    return {
        "api": "sglang.Req",
        "rid": req.rid,
        "token_ids": [int(t) for t in req.output_ids],
        "logprobs": [float(x) for x in req.logprob.output_token_logprobs_val],
        "restored_outputs": restored_outputs,
        "max_new_tokens": int(req.sampling_params.max_new_tokens),
        "state_position": seq,
        "positions_forwarded": g.positions,
        "forward_calls": g.forward_calls,
        "first_position_fed": fed[0][0] if fed else None,
        "history_positions_recomputed": sum(max(0, min(s + n, seq) - s) for s, n in fed),
        "rng_state_sha256": None,
        "rng_state_restored": False,
        "numerics_warnings": numerics_warnings,
        "numerics_differences": [list(d) for d in restored.numerics_differences],
        "snapshot_id": restored.snapshot_id,
        "bytes_uploaded": restored.bytes_uploaded,
        "restore_seconds": restore_seconds,
        "slots": _slots_summary(tok, req.kv.req_pool_idx, mid, pools),
        "other_requests": [_slots_summary(o.token_indices, o.req_pool_idx, o.mamba_idx, pools) for o in occupants],
        "flags": flags,
        "streamed_at_resume": streamed_at_resume,
        "stream_chunks": chunks,
        "reasoning_at_resume": at_resume,
        "reasoning_final": reqs.reasoning(req),
    }


# ------------------------------------------------------------------------------------------------ negative


def _attempt(case: str, description: str, expected: str, pools, path: str, identity, rank=None) -> dict[str, Any]:
    import hsnap_format as hf
    from hsnap_io import restore_request

    from .fingerprint import fingerprint_differences, fingerprint_digest, pool_fingerprint

    before = pool_fingerprint(pools.req_to_token_pool, pools.allocator)
    error: BaseException | None = None
    try:
        # exact_rollback: a corrupted state section is found as it lands in the slots (issue 15);
        # the allocations come back either way, the written slots' old bytes with this
        restore_request(path, req_to_token_pool=pools.req_to_token_pool, token_to_kv_pool_allocator=pools.allocator, identity=identity,
                        rank=rank, exact_rollback=True)
    except hf.HsnapError as e:
        error = e
    after = pool_fingerprint(pools.req_to_token_pool, pools.allocator)
    changed = fingerprint_differences(before, after)
    got = None if error is None else type(error).__name__
    return {
        "case": case,
        "description": description,
        "path": path,
        "expected_error": expected,
        "error": got,
        "message": "restored (not refused)" if error is None else str(error),
        "differences": [list(map(str, d)) for d in getattr(error, "differences", [])],
        "pools_untouched": not changed,
        "changed": changed[:20],
        "fingerprint": {"entries": len(before), "before": fingerprint_digest(before), "after": fingerprint_digest(after)},
        "free": {
            "req_rows": pools.req_to_token_pool.available_size(),
            "token_slots": pools.allocator.available_size(),
            "mamba_slots": pools.req_to_token_pool.mamba_allocator.available_size(),
        },
        "ok": got == expected and not changed,
    }


def _negative(demo: Demo, args) -> dict[str, Any]:
    import hsnap_format as hf
    from hsnap_format.spec import rank_file_name
    from hsnap_io import NumericsWarning, restore_request

    from .model import build_model, weights_digest

    d = args.negative_dir
    good = os.path.join(d, NEGATIVE_FILE)
    identity = demo.identity()
    pools, _ = demo.pools(**TARGET_POOLS, others=TARGET_OTHERS, noise_seed=31)
    cases = []

    # (a) weights: the target runs other weights (same architecture, another seed)
    other, _ = build_model(seed=demo.model_seed + 1, arch=demo.arch)
    w = weights_digest(other)
    del other
    wrong = dataclasses.replace(identity, weights_version=f"sha256:{w[:16]}", weights_hash=f"sha256:{w}")
    cases.append(_attempt("wrong weights version", f"target runs other weights (model seed {demo.model_seed + 1})", "IncompatibleSnapshotError", pools, good, wrong))

    # (b) layout: pools of another geometry (4 KV heads instead of the snapshot's)
    heads = demo.geom.num_kv_heads * 2
    g4 = dataclasses.replace(demo.geom, num_kv_heads=heads, kv_shape=(heads, demo.geom.head_dim))
    pools4, _ = demo.pools(**TARGET_POOLS, others=TARGET_OTHERS, noise_seed=37, geom=g4)
    cases.append(_attempt("wrong layout", f"target pools have {heads} KV heads, the snapshot {demo.geom.num_kv_heads}", "IncompatibleSnapshotError", pools4, good, identity))

    # (c) a committed 2-rank snapshot whose rank-1 file was deleted; rank 1 restores
    tp2 = os.path.join(d, NEGATIVE_TP2)
    with hf.open(tp2) as s:  # intact before the deletion
        s.verify()
    missing = os.path.join(tp2, rank_file_name(1))
    os.remove(missing)
    ident_r1 = dataclasses.replace(identity, tp_size=2, tp_rank=1)
    cases.append(_attempt("missing rank file", f"deleted {rank_file_name(1)} of a committed 2-rank snapshot; rank 1 restores", "MalformedManifestError", pools, tp2, ident_r1, rank=1))

    # (d) one byte flipped in a state section of a copy
    bad = os.path.join(d, NEGATIVE_CORRUPT)
    shutil.copyfile(good, bad)
    with hf.open(bad) as s:
        sec = next(x for x in s.sections if x.kind == "temporal")
    at = sec.offset + sec.length // 2
    with open(bad, "r+b") as f:
        f.seek(at)
        b = f.read(1)[0]
        f.seek(at)
        f.write(bytes([b ^ 0xFF]))
    cases.append(_attempt("corrupted section", f"byte {at} (inside section {sec.name}) flipped 0x{b:02x} -> 0x{b ^ 0xFF:02x}", "DigestMismatchError", pools, bad, identity))

    # advisory, not a refusal: a target in another numerics environment restores, with a NumericsWarning
    env = dict(identity.numerics)
    env["num_threads"] = int(env.get("num_threads", 1)) + 1
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always", NumericsWarning)
        restored = restore_request(good, req_to_token_pool=pools.req_to_token_pool, token_to_kv_pool_allocator=pools.allocator, identity=dataclasses.replace(identity, numerics=env))
    msgs = [str(x.message) for x in caught if issubclass(x.category, NumericsWarning)]
    advisory = {
        "case": "other numerics",
        "description": f"target declares num_threads {env['num_threads']}, the snapshot {identity.numerics.get('num_threads')}",
        "restored": True,
        "warning": "NumericsWarning" if msgs else None,
        "message": msgs[0] if msgs else "no warning",
        "differences": [list(map(str, x)) for x in restored.numerics_differences],
        "ok": bool(msgs) and any(x[0] == "identity.numerics.num_threads" for x in restored.numerics_differences),
    }
    return {"cases": cases, "advisory": advisory, "ok": all(c["ok"] for c in cases) and advisory["ok"]}
