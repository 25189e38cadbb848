"""``hsnap demo --library --reshard 2:1``: the paused request exported as a TP 2 snapshot set (two rank
files split the way a TP 2 engine holds the state: SGLang's own sharding of KV heads and of
the GDN ``[q|k|v]`` conv channels and value heads) and resumed at TP 1 in a fresh process,
which must continue exactly (tokens equal, max |Δlogprob| 0, no history recomputed).

Three processes, as the main demo: ``reference`` (uninterrupted greedy run), ``reshard-export``
(generate k tokens at TP 1, place the state into two TP 2 rank pool sets, export the set),
``reshard-resume`` (fresh TP 1 pools with other requests; ``restore_request`` re-shards the
set; the model continues from the pools alone).
"""

from __future__ import annotations

import dataclasses
import math
import os
import shutil
import tempfile
import time
import uuid
from typing import Any

SET_NAME = "request.tp{tp}"


def tp_model(geom):
    from hsnap_io import reshard

    return reshard.TPModel(
        kv_heads=geom.num_kv_heads,
        mamba=reshard.GDNDims(geom.linear_num_key_heads, geom.linear_num_value_heads, geom.linear_key_head_dim, geom.linear_value_head_dim),
        conv_kernel=geom.conv_kernel,
    )


def rank_geometry(geom, tp: int, rank: int):
    """The demo model's per-rank pool geometry at ``tp``: head counts from SGLang's rules,
    checked against ``Mamba2StateShape.create(tp_world_size=tp)``."""
    from hsnap_io import reshard

    from .model import _sg

    heads, _ = reshard.kv_head_map(geom.num_kv_heads, tp, rank)
    chans, _ = reshard.conv_channel_map(tp_model(geom).mamba, tp, rank, geom.conv_kernel)
    hk, hv = geom.linear_num_key_heads // tp, geom.linear_num_value_heads // tp
    g = dataclasses.replace(
        geom, num_kv_heads=len(heads), kv_shape=(len(heads), geom.head_dim), linear_num_key_heads=hk,
        linear_num_value_heads=hv, conv_dim=len(chans), conv_shape=(len(chans), geom.conv_kernel - 1),
        conv_shard_groups=tuple(x // tp for x in geom.conv_shard_groups),
        temporal_shape=(hv, geom.linear_value_head_dim, geom.linear_key_head_dim),
    )
    shape = _sg().mamba_utils.Mamba2StateShape.create(
        tp_world_size=tp, intermediate_size=geom.linear_num_value_heads * geom.linear_value_head_dim,
        n_groups=geom.linear_num_key_heads, num_heads=geom.linear_num_value_heads, head_dim=geom.linear_value_head_dim,
        state_size=geom.linear_key_head_dim, conv_kernel=geom.conv_kernel,
    )
    if (tuple(shape.conv[0]), tuple(shape.temporal)) != (g.conv_shape, g.temporal_shape):
        raise AssertionError(f"rank shapes {g.conv_shape} {g.temporal_shape} differ from SGLang's {shape.conv} {shape.temporal}")
    return g


def shard_tensors(tensors, geom, tp: int, rank: int):
    """The TP 1 pool tensors of one request, cut to what rank ``rank`` of ``tp`` holds."""
    from hsnap_io import reshard

    heads, _ = reshard.kv_head_map(geom.num_kv_heads, tp, rank)
    chans, _ = reshard.conv_channel_map(tp_model(geom).mamba, tp, rank, geom.conv_kernel)
    hv = geom.linear_num_value_heads // tp
    return {
        "k": {L: t[:, heads].contiguous() for L, t in tensors["k"].items()},
        "v": {L: t[:, heads].contiguous() for L, t in tensors["v"].items()},
        "conv": {L: t[chans].contiguous() for L, t in tensors["conv"].items()},
        "temporal": {L: t[rank * hv : (rank + 1) * hv].contiguous() for L, t in tensors["temporal"].items()},
    }


def export_tp_set(demo, path: str, part, record, tp: int) -> dict[str, Any]:
    """The paused request as a TP ``tp`` snapshot directory: each rank's shard in that rank's
    own SGLang pools, exported with its 1.1 sharding description."""
    import hsnap_format as hf
    from hsnap_io import export_request, reshard

    from .model import alloc_request, build_pools, cache_to_pool_tensors, free_request, write_to_pools

    tensors = cache_to_pool_tensors(part.cache, demo.geom)
    sid = f"demo-tp{tp}-{uuid.uuid4().hex[:12]}"
    sw = hf.SetWriter(path)
    ranks = []
    try:
        for r in range(tp):
            g = rank_geometry(demo.geom, tp, r)
            pools = build_pools(g, size=256, mamba_size=4)
            slots = alloc_request(pools, part.seq_len)
            write_to_pools(pools.req_to_token_pool, pools.allocator, slots.token_indices, slots.mamba_idx,
                           shard_tensors(tensors, demo.geom, tp, r), req_pool_idx=slots.req_pool_idx)
            sharding = reshard.describe(tp_model(demo.geom), tp, r)
            info = export_request(sw.rank_path(r), req_to_token_pool=pools.req_to_token_pool, token_to_kv_pool_allocator=pools.allocator,
                                  req_pool_idx=slots.req_pool_idx, record=record,
                                  identity=demo.identity(tp_size=tp, tp_rank=r, snapshot_id=sid), sharding=sharding)
            free_request(pools, slots)
            ranks.append({"rank": r, "payload_bytes": info.payload_bytes, "kv_heads": list(sharding.attention.parts),
                          "conv_parts": [list(p) for p in sharding.conv[0].parts], "temporal_parts": [list(p) for p in sharding.temporal.parts]})
        sw.commit(tp_size=tp)
    except BaseException:
        sw.abort()
        raise
    return {"path": os.path.abspath(path), "snapshot_id": sid, "ranks": ranks}


# --------------------------------------------------------------------------------- children


def child_export(demo, args) -> dict[str, Any]:
    part = demo.pause(args.prompt, args.k, 0.0, None)
    record = demo.record("greedy", args.prompt, part, args.n, args.k, 0.0, None)
    res = export_tp_set(demo, args.set, part, record, args.reshard_src)
    res.update(token_ids=part.token_ids, logprobs=part.logprobs, state_position=part.seq_len)
    return res


def child_resume(demo, args) -> dict[str, Any]:
    import torch

    from hsnap_io import reshard, restore_request

    from .children import TARGET_OTHERS, TARGET_POOLS
    from .model import pool_tensors_to_cache, read_from_pools, request_slots

    pools, occupants = demo.pools(**TARGET_POOLS, others=TARGET_OTHERS, noise_seed=29)
    t = time.perf_counter()
    restored = restore_request(args.set, req_to_token_pool=pools.req_to_token_pool, token_to_kv_pool_allocator=pools.allocator,
                               identity=demo.identity(), sharding=reshard.describe(tp_model(demo.geom), 1, 0))
    seconds = time.perf_counter() - t
    rec, seq = restored.record, restored.state_position
    tok, mid = request_slots(pools.req_to_token_pool, restored.req_pool_idx, seq)
    if not torch.equal(tok, restored.token_indices) or mid != restored.mamba_pool_idx:
        raise AssertionError("restore_request's slots disagree with the pool's tables")
    cache = pool_tensors_to_cache(read_from_pools(pools.req_to_token_pool, pools.allocator, tok, mid, demo.geom), demo.geom, seq)
    fed0 = len(demo.dec.fed_ranges)
    g = demo.dec.generate(rec.prompt_ids.tolist(), int(rec.max_new_tokens), temperature=0.0, cache=cache,
                          start_outputs=rec.output_ids.tolist(), start_logprobs=rec.output_logprobs.tolist())
    fed = demo.dec.fed_ranges[fed0:]
    return {
        "token_ids": g.token_ids,
        "logprobs": g.logprobs,
        "state_position": seq,
        "positions_forwarded": g.positions,
        "history_positions_recomputed": sum(max(0, min(s + n, seq) - s) for s, n in fed),
        "source_ranks": list(restored.source_ranks),
        "source_bytes_read": restored.source_bytes_read,
        "bytes_uploaded": restored.bytes_uploaded,
        "restore_seconds": seconds,
    }


# --------------------------------------------------------------------------------- parent


def parse(spec: str) -> tuple[int, int]:
    from .run import DemoError

    try:
        src, dst = (int(x) for x in spec.split(":"))
    except ValueError:
        raise DemoError(f"--reshard takes SRC:DST (e.g. 2:1), got {spec!r}") from None
    if dst != 1 or src not in (2,):
        # the demo model computes at TP 1; its 2 KV heads / 2 GDN key heads split only in 2
        raise DemoError(f"--reshard supports 2:1 (the tiny model's 2 KV and 2 GDN key heads), got {spec}")
    return src, dst


def run(args) -> dict[str, Any]:
    from .run import PROMPT, DemoError, _default_out, _spawn, _wait, _SPAWNED, _validate

    _validate(args)
    src, dst = parse(args.reshard)
    if args.out is None:
        args.out = _default_out()
    out_dir = os.path.dirname(os.path.abspath(args.out))
    target = os.path.join(out_dir, SET_NAME.format(tp=src))
    if os.path.lexists(target):  # never replaced: the demo writes only new files
        raise DemoError(f"{target} exists: the demo never replaces a snapshot (choose another --out)")
    os.makedirs(out_dir, exist_ok=True)
    workdir = tempfile.mkdtemp(prefix="hsnap-reshard-")
    t0 = time.perf_counter()
    try:
        gen = ["--prompt", ",".join(map(str, PROMPT)), "--n", str(args.n), "--k", str(args.k)]
        ref = _spawn("reference", workdir, args, args.threads, gen + ["--variant", "greedy", "0.0", "-"])
        exp = _spawn("reshard-export", workdir, args, args.threads, gen + ["--set", target, "--reshard-src", str(src)])
        _wait([ref, exp], args.timeout)
        res = _spawn("reshard-resume", workdir, args, args.threads, ["--set", target])
        _wait([res], args.timeout)
        a, e, b = ref.data["variants"]["greedy"], exp.data, res.data
        diff = max((abs(x - y) for x, y in zip(a["logprobs"], b["logprobs"])), default=math.inf) if len(a["logprobs"]) == len(b["logprobs"]) else math.inf
        checks = {
            "tokens_equal": a["token_ids"] == b["token_ids"] and len(a["token_ids"]) == args.n,
            "logprobs_bit_identical": diff == 0.0,
            "no_history_recomputed": b["history_positions_recomputed"] == 0,
            "forwarded_is_n_minus_k": b["positions_forwarded"] == args.n - args.k,
            "paused_prefix_matches_reference": e["token_ids"] == a["token_ids"][: args.k],
            "both_source_ranks_used": b["source_ranks"] == list(range(src)),
            "only_slices_read": b["source_bytes_read"] == b["bytes_uploaded"],
        }
        return {
            "ok": all(checks.values()),
            "reshard": f"{src}:{dst}",
            "checks": checks,
            "n": args.n,
            "k": args.k,
            "max_abs_logprob_diff": diff if math.isfinite(diff) else None,
            "positions_recomputed": b["history_positions_recomputed"],
            "snapshot_set": e["path"],
            "source_ranks": e["ranks"],
            "restore": {k: b[k] for k in ("source_ranks", "source_bytes_read", "bytes_uploaded", "restore_seconds")},
            "reference_token_ids": a["token_ids"],
            "resumed_token_ids": b["token_ids"],
            "processes": [{"role": c.role, "pid": c.data.get("pid")} for c in (ref, exp, res)],
            "wall_seconds": round(time.perf_counter() - t0, 3),
        }
    finally:
        for c in _SPAWNED:
            if c.proc.poll() is None:
                c.proc.kill()
                c.proc.wait()
        _SPAWNED.clear()
        shutil.rmtree(workdir, ignore_errors=True)


def format_report(r: dict[str, Any]) -> str:
    yes = lambda b: "yes" if b else "NO"  # noqa: E731
    src, dst = r["reshard"].split(":")
    lines = [
        f"hsnap demo --library --reshard {r['reshard']}: a TP {src} snapshot set resumed at TP {dst} in a fresh process",
        f"  snapshot set:            {r['snapshot_set']}",
    ]
    for rk in r["source_ranks"]:
        lines.append(f"    rank-{rk['rank']}.hsnap: KV heads {rk['kv_heads']}, conv [q|k|v] parts {rk['conv_parts']}, value heads {rk['temporal_parts']}")
    lines += [
        f"  token ids equal:         {yes(r['checks']['tokens_equal'])} ({r['n']} tokens, paused after {r['k']})",
        f"  max |Δlogprob|:          {r['max_abs_logprob_diff']}",
        f"  positions recomputed:    {r['positions_recomputed']}",
        f"  read from source ranks:  {r['restore']['source_ranks']} ({r['restore']['source_bytes_read']} bytes of slices for {r['restore']['bytes_uploaded']} uploaded)",
        f"  result:                  {'OK' if r['ok'] else 'FAILED: ' + ', '.join(k for k, v in r['checks'].items() if not v)}",
        f"  inspect:                 hsnap info {r['snapshot_set']}",
    ]
    return "\n".join(lines)
