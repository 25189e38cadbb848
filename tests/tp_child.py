"""One rank of a 2-rank gloo export/restore (run by tests/test_io_tp.py)."""

from __future__ import annotations

import json
import os
import sys

import torch.distributed as dist

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import hsnap_format as hf  # noqa: E402
from hsnap_testing import pools as sp  # noqa: E402
from io_cases import identity, record, rows_as_bytes, source, target  # noqa: E402
from hsnap_io.tp import export_request_tp, restore_request_tp  # noqa: E402


def main() -> None:
    mode, rank, world, port, path, out = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), sys.argv[4], sys.argv[5], sys.argv[6]
    options = json.loads(sys.argv[7]) if len(sys.argv) > 7 else None  # an s3:// path's storage options
    if mode == "export-badkey" and rank == 1:
        options = dict(options, secret="not-the-secret")  # this rank cannot write to the store
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
    ident = identity(tp_size=world, tp_rank=rank, snapshot_id="tp-snap")
    result = {"rank": rank}
    if mode in ("export", "export-fail", "export-badkey"):
        ps, req = source("hybrid_linear", 1, seed=10 + rank)  # each rank its own shard
        if mode == "export-fail" and rank == 1:
            def boom(phase):
                if phase == "chunk":
                    raise OSError(28, "No space left on device")
            hf.localfs.phase_hook = boom  # type: ignore[attr-defined]
        try:
            export_request_tp(path, identity=ident, record=record(), req_to_token_pool=ps.req_to_token_pool,
                              token_to_kv_pool_allocator=ps.token_to_kv_pool_allocator, req_pool_idx=req.req_pool_idx,
                              storage_options=options)
            result["ok"] = True
        except hf.HsnapError as e:
            result.update(ok=False, error=type(e).__name__, message=str(e))
        result["rows"] = {k: v.tobytes().hex() for k, v in rows_as_bytes(sp.request_rows(ps, req)).items()}
    else:
        ps = target("hybrid_linear", 1)
        res = restore_request_tp(path, identity=ident, req_to_token_pool=ps.req_to_token_pool,
                                 token_to_kv_pool_allocator=ps.token_to_kv_pool_allocator, storage_options=options)
        rec = sp.RequestRecord(res.req_pool_idx, res.token_indices, res.mamba_pool_idx, res.state_position, 0)
        result["rows"] = {k: v.tobytes().hex() for k, v in rows_as_bytes(sp.request_rows(ps, rec)).items()}
        result["ok"] = True
    dist.barrier()
    dist.destroy_process_group()
    with open(out, "w") as f:
        json.dump(result, f)


if __name__ == "__main__":
    main()
