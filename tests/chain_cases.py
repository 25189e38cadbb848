"""Shared cases for snapshot chains on SGLang's real pool classes: one
request that keeps decoding — its attention rows grow, its recurrent state is rewritten
every step, its sliding window slides — exported as a plain snapshot and then as deltas.

Also used by ``tests/chain_tp_child.py`` (one rank of a TP-2 chain over gloo)."""

from __future__ import annotations

import numpy as np
import torch

import hsnap_format as hf
import io_cases as ic
from hsnap_testing import pools as sp

PROMPT = 20
N_TOKENS = 45  # the request's slots; a link at position P exports the first P
POSITIONS = (24, 33, 45)  # the plain snapshot, delta 1, delta 2
SWA_STARTS = (8, 16, 36)  # sliding-window kinds: swa_start of each link (36 > 33: delta 2 holds no row of delta 1's window)
SWA_KINDS = ("swa", "swa_mamba")
CREATED_AT = "2026-12-01T00:00:00Z"  # fixed: two exports of the same pools write the same bytes


def record(pos: int, rid: str = "req-1", prompt: int = PROMPT) -> hf.RequestRecord:
    """The request at position ``pos``: a fixed prompt, ``pos + 1 - prompt`` output tokens."""
    out = pos + 1 - prompt
    return hf.RequestRecord(
        rid=rid,
        prompt_ids=np.arange(prompt, dtype=np.int32),
        output_ids=np.arange(100, 100 + out, dtype=np.int32),
        output_logprobs=-np.linspace(0.1, 0.6, out, dtype=np.float32),
        state_position=pos,
        sampling={"temperature": 0.0, "top_p": 1.0},
        max_new_tokens=64,
        streamed_tokens=out,
    )


def source(kind: str, page: int = 1, seed: int = 1):
    """Pools with two other requests and the one that keeps decoding (its SWA window
    already slid past ``SWA_STARTS[0]`` positions for a sliding-window kind)."""
    ps = sp.build(kind, size=512, page_size=page)
    sp.occupy(ps, 2, 37, seed=5)
    req = sp.alloc_request(ps, N_TOKENS, seed=seed, swa_evict=SWA_STARTS[0] if kind in SWA_KINDS else 0)
    return ps, req


def swa_starts(kind: str) -> tuple[int, ...]:
    return SWA_STARTS if kind in SWA_KINDS else (0,) * len(POSITIONS)


def step(ps, req, i: int, swa_from: int, swa_to: int) -> None:
    """What decoding between two links does to the pools: the recurrent state is rewritten
    (new bytes in the request's Mamba slot) and the window slides (SWA slots of positions
    ``swa_from .. swa_to - 1`` freed, as SGLang's eviction does)."""
    if ps.has_mamba:
        gen = torch.Generator().manual_seed(1000 + i)
        for _, buf in sp.mamba_buffers(ps):
            buf[:, req.mamba_pool_idx] = sp.random_like((buf.shape[0], *buf.shape[2:]), buf.dtype, gen)
    if ps.has_swa and swa_to > swa_from:
        ps.token_to_kv_pool_allocator.free_swa_segment(req.token_indices[swa_from:swa_to], start_pos=swa_from)


def export(ps, req, path, pos: int, *, base=None, snapshot_id: str, swa_start: int = 0, ident: hf.Identity | None = None,
           rec: hf.RequestRecord | None = None, **kw):
    from hsnap_io import export_request

    return export_request(path, req_to_token_pool=ps.req_to_token_pool, token_to_kv_pool_allocator=ps.token_to_kv_pool_allocator,
                          req_pool_idx=req.req_pool_idx, record=rec or record(pos), identity=ident or ic.identity(snapshot_id=snapshot_id, created_at=CREATED_AT),
                          swa_start=swa_start, base=base, **kw)


def export_chain(ps, req, kind: str, directory, names=("link-0.hsnap", "link-1.hsnap", "link-2.hsnap"), **kw) -> list[str]:
    """The plain snapshot and two deltas, decoding (``step``) between them; their paths."""
    starts = swa_starts(kind)
    paths: list[str] = []
    for i, pos in enumerate(POSITIONS):
        if i:
            step(ps, req, i, starts[i - 1], starts[i])
        p = f"{str(directory).rstrip('/')}/{names[i]}"  # a directory or an s3:// prefix
        export(ps, req, p, pos, base=paths[-1] if paths else None, snapshot_id=f"link-{i}", swa_start=starts[i], **kw)
        paths.append(p)
    return paths


def restored_rows(ps, res) -> dict:
    """The restored request's rows, as CPU tensors (``sp.request_rows``)."""
    return sp.request_rows(ps, sp.RequestRecord(res.req_pool_idx, res.token_indices, res.mamba_pool_idx, res.state_position, 0))


def same_rows(a: dict, b: dict) -> bool:
    return a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def flip_every_section(path) -> None:
    """Change the first byte of every non-empty section of the snapshot file ``path`` in place
    (same size and inode): any later read of its bytes fails its digest."""
    with hf.open(path) as s:
        offsets = [sec.offset for sec in s.sections if sec.length]
    with open(path, "r+b") as f:
        for off in offsets:
            f.seek(off)
            b = f.read(1)
            f.seek(off)
            f.write(bytes([b[0] ^ 0xFF]))
