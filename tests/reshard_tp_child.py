"""One rank of a TP M gloo group restoring a TP N snapshot set (run by tests/test_reshard_tp.py)."""

from __future__ import annotations

import json
import os
import sys

import torch.distributed as dist

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from hsnap_testing import tp_pools as rp  # noqa: E402
from hsnap_io import reshard  # noqa: E402
from hsnap_io.tp import restore_request_tp  # noqa: E402


def main() -> None:
    name, rank, world, port, path, out = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), sys.argv[4], sys.argv[5], sys.argv[6]
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
    m = rp.MODELS[name]
    ps = rp.build(m, world, rank, seed=40 + rank)
    res = restore_request_tp(path, identity=rp.identity(world, rank), req_to_token_pool=ps.rtp, token_to_kv_pool_allocator=ps.alloc,
                             sharding=reshard.describe(m.tp, world, rank))
    rows = {k: rp.as_bytes(v).hex() for k, v in rp.restored_rows(ps, res).items()}
    dist.barrier()
    dist.destroy_process_group()
    with open(out, "w") as f:
        json.dump({"rank": rank, "rows": rows, "source_ranks": list(res.source_ranks)}, f)


if __name__ == "__main__":
    main()
