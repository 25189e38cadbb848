"""A request decoding at TP N, each rank in its own SGLang pools (``hsnap_testing.tp_pools``), for the
live migrations across TP sizes (tests/test_migrate_tp.py).

The global state of the request grows as it decodes: its attention rows up to position
``POSITIONS[i]`` are the first rows of one global tensor per section, and its recurrent
state is rewritten every round (``rounds(m)[i]``). Each rank holds its shard of both
(``hsnap_testing.tp_pools.shard_of``), in slots SGLang's own allocators gave it (with other slots
taken in between: a request's slots are never one run).

Also runnable as one rank of a TP source group over gloo (forked by the test, or
``python tests/tp_migrate_cases.py RANK WORLD PORT DIR``): the rank migrates its shard
with ``MigrationSource(group=)`` — two pre-copy rounds and the final link, each a TP set —
and writes a plain TP set at the final position beside (``direct``)."""

from __future__ import annotations

import os
import sys
from types import SimpleNamespace

import numpy as np
import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import hsnap_format as hf  # noqa: E402
from hsnap_testing import tp_pools as rp  # noqa: E402
from hsnap_io import export_request, reshard  # noqa: E402
from hsnap_io.adapters import view_pools  # noqa: E402

MODEL = rp.MODELS["qwen35"]  # Qwen3.5-35B-A3B per rank: 2 KV heads, GDN 16 key / 32 value heads
POSITIONS = (6, 11, 15)  # link-0000 (plain), link-0001 (delta), final (delta)
SIZE = 64


def rounds(m=MODEL, seed: int = 5) -> tuple[dict, list[dict]]:
    """(section -> global attention rows up to the last position, [section -> global
    recurrent state of round i]): the request's global state at every link."""
    ps = rp.build(m, 1, 0, seed=seed)
    gen = torch.Generator().manual_seed(seed)
    rows, states = {}, [{} for _ in POSITIONS]
    for b in view_pools(ps.rtp, ps.alloc).bindings:
        if b.space == "token":
            bits = torch.randint(-(2**15), 2**15, (POSITIONS[-1], *b.buffer.shape[1:]), generator=gen, dtype=torch.int32)
            rows[b.name] = bits.to(torch.int16).view(b.buffer.dtype)
        else:
            for st in states:
                shape = tuple(b.buffer.shape[1:])
                st[b.name] = (torch.randn(shape, generator=gen, dtype=torch.float32) if b.buffer.dtype == torch.float32 else
                              torch.randint(-(2**15), 2**15, shape, generator=gen, dtype=torch.int32).to(torch.int16).view(b.buffer.dtype))
    return rows, states


def record(pos: int, rid: str = "r-mig") -> hf.RequestRecord:
    """The request at position ``pos``: 3 prompt tokens, ``pos - 2`` output tokens."""
    return hf.RequestRecord(rid=rid, prompt_ids=np.arange(3, dtype=np.int32), output_ids=np.arange(100, 98 + pos, dtype=np.int32),
                            state_position=pos, max_new_tokens=64)


class Rank:
    """Rank ``rank`` of a TP ``tp`` source: its pools and the request in them."""

    def __init__(self, tp: int, rank: int, rows: dict, m=MODEL, seed: int = 30) -> None:
        from hsnap_io.sglang_env import import_sglang

        self.m, self.tp, self.rank, self.rows = m, tp, rank, rows
        self.ps = rp.build(m, tp, rank, size=SIZE, seed=seed + rank)
        req = SimpleNamespace(kv=import_sglang().schedule_batch.ReqKvInfo())
        self.row = int(self.ps.rtp.alloc([req])[0])
        self.mslot = int(req.kv.mamba_pool_idx)
        self.pos = 0
        self.view = view_pools(self.ps.rtp, self.ps.alloc)

    def decode_to(self, pos: int, state: dict) -> None:
        """The request's rows up to ``pos`` (new slots after another request's one) and
        the recurrent state ``state``, this rank's shard of each."""
        self.ps.alloc.alloc(1)  # another request's slot first
        tok = self.ps.alloc.alloc(pos - self.pos).to(torch.int64)
        self.ps.rtp.write((self.row, slice(self.pos, pos)), tok.to(torch.int32))
        for b in self.view.bindings:
            if b.space == "token":
                b.buffer[tok] = rp.shard_of(self.m, self.tp, self.rank, b.name, self.rows[b.name][self.pos : pos])
            else:
                b.buffer[self.mslot] = rp.shard_of(self.m, self.tp, self.rank, b.name, state[b.name])
        self.pos = pos

    def identity(self, sid: str = "") -> hf.Identity:
        return rp.identity(self.tp, self.rank, sid)

    def sharding(self):
        return reshard.describe(self.m.tp, self.tp, self.rank)

    def export(self, path, pos: int, *, base=None, identity=None, record_=None) -> None:
        export_request(path, req_to_token_pool=self.ps.rtp, token_to_kv_pool_allocator=self.ps.alloc, req_pool_idx=self.row,
                       record=record_ or record(pos), identity=identity or self.identity(os.path.basename(str(path).rstrip("/"))),
                       sharding=self.sharding(), base=base, fsync=False)


def write_set(ranks: list[Rank], path, pos: int, *, base=None, overrides: dict | None = None) -> str:
    """One link written by a TP group of ``ranks`` in this process (SetWriter, each rank
    file a delta of the same rank of the set ``base``): what ``MigrationSource(group=)``
    writes over gloo. ``overrides`` (rank -> export keywords) make one rank disagree."""
    sw = hf.SetWriter(path)
    try:
        for r in ranks:
            kw = dict(base=base, identity=r.identity(os.path.basename(str(path))))
            kw.update((overrides or {}).get(r.rank, {}))
            r.export(sw.rank_path(r.rank), pos, **kw)
        sw.commit(tp_size=len(ranks), fsync=False)
    except BaseException:
        sw.abort()
        raise
    return str(path)


def target(tp: int, rank: int, m=MODEL, seed: int = 70):
    """Fresh pools of target rank ``rank`` of ``tp``, two other requests' slots taken."""
    ps = rp.build(m, tp, rank, size=SIZE, seed=seed + rank)
    ps.alloc.alloc(3)
    return ps


def request_bytes(ps, req) -> dict[str, bytes]:
    """Section name -> the request's bytes in the target's pools: its token slots in
    position order, its Mamba slot."""
    out = {}
    for b in view_pools(ps.rtp, ps.alloc).bindings:
        rows = b.buffer[req.token_indices] if b.space == "token" else b.buffer[req.mamba_pool_idx]
        out[b.name] = rp.as_bytes(rows)
    slots = ps.rtp.req_to_token[req.req_pool_idx, : req.state_position].to(torch.int64)
    assert torch.equal(slots, req.token_indices), "req_to_token holds the request's slots in position order"
    return out


def expected_bytes(m, tp: int, rank: int, rows: dict, state: dict, pos: int) -> dict[str, bytes]:
    """What target rank ``rank`` of ``tp`` must hold: its shard of the global state at ``pos``."""
    ps = rp.build(m, tp, rank)
    out = {}
    for b in view_pools(ps.rtp, ps.alloc).bindings:
        full = rows[b.name][:pos] if b.space == "token" else state[b.name]
        out[b.name] = rp.as_bytes(rp.shard_of(m, tp, rank, b.name, full))
    return out


def source_rank(rank: int, world: int, port: str, directory: str) -> None:
    """One rank of a TP ``world`` source over gloo: the migration links and a direct set."""
    import torch.distributed as dist

    from hsnap_io.migrate import MigrationSource

    torch.set_num_threads(1)  # a forked rank runs no intra-op thread pool inherited from its parent
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
    try:
        rows, states = rounds()
        r = Rank(world, rank, rows)
        src = MigrationSource(os.path.join(directory, "mig"), req_to_token_pool=r.ps.rtp, token_to_kv_pool_allocator=r.ps.alloc,
                              identity=r.identity(), sharding=r.sharding(), group=None, fsync=False)
        for i, pos in enumerate(POSITIONS):
            r.decode_to(pos, states[i])
            (src.stop if i == len(POSITIONS) - 1 else src.precopy)(r.row, record(pos))
        from hsnap_io.tp import export_request_tp

        export_request_tp(os.path.join(directory, "direct"), identity=r.identity("direct"), record=record(POSITIONS[-1]),
                          req_to_token_pool=r.ps.rtp, token_to_kv_pool_allocator=r.ps.alloc, req_pool_idx=r.row,
                          sharding=r.sharding(), fsync=False)
        dist.barrier()
    finally:
        dist.destroy_process_group()


if __name__ == "__main__":
    source_rank(int(sys.argv[1]), int(sys.argv[2]), sys.argv[3], sys.argv[4])
