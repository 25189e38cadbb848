"""One rank of a TP-2 snapshot chain over gloo (run by tests/test_chain.py): export a
plain set and two delta sets of one decoding request (each rank its own shard), a direct
set at the head's position; then restore the head's chain and the direct set into fresh
pools and compare the rows."""

from __future__ import annotations

import json
import os
import sys

import torch.distributed as dist

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import chain_cases as cc  # noqa: E402
import hsnap_format as hf  # noqa: E402
import io_cases as ic  # noqa: E402
from hsnap_io.tp import export_request_tp, restore_request_tp  # noqa: E402


def main() -> None:
    rank, world, port, run, out = int(sys.argv[1]), int(sys.argv[2]), sys.argv[3], sys.argv[4], sys.argv[5]
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
    kind = "hybrid_linear"
    ps, req = cc.source(kind, seed=10 + rank)  # each rank its own shard
    os.makedirs(run, exist_ok=True)
    paths = []
    for i, pos in enumerate(cc.POSITIONS):
        if i:
            cc.step(ps, req, i + 10 * rank, 0, 0)
        path = os.path.join(run, f"link-{i}")
        export_request_tp(path, identity=ic.identity(tp_size=world, tp_rank=rank, snapshot_id=f"link-{i}"), record=cc.record(pos),
                          req_to_token_pool=ps.req_to_token_pool, token_to_kv_pool_allocator=ps.token_to_kv_pool_allocator,
                          req_pool_idx=req.req_pool_idx, base=paths[-1] if paths else None)
        paths.append(path)
    with hf.open(os.path.join(paths[-1], f"rank-{rank}.hsnap")) as head:
        ident = head.identity
    export_request_tp(os.path.join(run, "direct"), identity=ident, record=cc.record(cc.POSITIONS[-1]),
                      req_to_token_pool=ps.req_to_token_pool, token_to_kv_pool_allocator=ps.token_to_kv_pool_allocator,
                      req_pool_idx=req.req_pool_idx)
    target = ic.identity(tp_size=world, tp_rank=rank)
    rows = []
    links = 0
    for path in (paths[-1], os.path.join(run, "direct")):
        t = ic.target(kind, 1)
        res = restore_request_tp(path, identity=target, req_to_token_pool=t.req_to_token_pool, token_to_kv_pool_allocator=t.token_to_kv_pool_allocator)
        rows.append(cc.restored_rows(t, res))
    with hf.open_chain(paths[-1], rank=rank) as chain:
        links = len(chain)
        assert all(s.identity.tp_rank == rank for s in chain.links)
    dist.barrier()
    dist.destroy_process_group()
    with open(out, "w") as f:
        json.dump({"rank": rank, "same_rows": cc.same_rows(*rows), "links": links}, f)


if __name__ == "__main__":
    main()
