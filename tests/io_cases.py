"""Shared cases for hsnap_io tests: pool kinds, a source request, identities.

Also runnable as a child process (``python tests/io_cases.py restore SPEC.json``):
restores snapshots into fresh pools of another capacity with other slots in use,
and writes the restored request rows as .npy files (allow_pickle=False) for the
parent test to compare byte for byte; ``resume SPEC.json`` does the same through
``hsnap_sglang.req.resume_req`` and writes the live ``Req``'s classified view too.
"""

from __future__ import annotations

import json
import os
import sys

import numpy as np
import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import hsnap_format as hf  # noqa: E402
from hsnap_testing import pools as sp  # noqa: E402

# (kind, page_size): every pool kind, at page 1 and paged
CASES = [
    ("mha", 1),
    ("mha", 16),
    ("mha", 64),
    ("mla", 1),
    ("swa", 1),
    ("hybrid_linear", 1),
    ("swa_mamba", 1),
    ("mha_fp8", 1),
]
N_TOKENS = 45


def case_id(kind: str, page: int) -> str:
    return f"{kind}-p{page}"


def identity(**over) -> hf.Identity:
    base = dict(
        model_id="tiny/hybrid",
        weights_version="w1",
        engine=hf.Engine("sglang", "0.5.23", "test"),
        tp_size=1,
        tp_rank=0,
        snapshot_id="s1",
        numerics={"torch": torch.__version__, "threads": torch.get_num_threads(), "device": "cpu"},
    )
    base.update(over)
    return hf.Identity(**base)


def record(n_tokens: int = N_TOKENS) -> hf.RequestRecord:
    out = 6
    return hf.RequestRecord(
        rid="req-1",
        prompt_ids=np.arange(n_tokens + 1 - out, dtype=np.int32),
        output_ids=np.arange(100, 100 + out, dtype=np.int32),
        output_logprobs=-np.linspace(0.1, 0.6, out, dtype=np.float32),
        state_position=n_tokens,
        sampling={"temperature": 0.0, "top_p": 1.0},
        max_new_tokens=32,
        streamed_tokens=out,
    )


def source(kind: str, page: int, seed: int = 1):
    """A source pool set with two other requests and the request to export."""
    ps = sp.build(kind, size=512, page_size=page)
    sp.occupy(ps, 2, 37, seed=5)
    swa_evict = 8 if kind in ("swa", "swa_mamba") else 0
    req = sp.alloc_request(ps, N_TOKENS, seed=seed, swa_evict=swa_evict)
    return ps, req


def export_from(ps, req, path, ident: hf.Identity | None = None):
    """Export ``req`` of pool set ``ps`` to ``path`` with the standard record."""
    from hsnap_io import export_request

    return export_request(
        path,
        req_to_token_pool=ps.req_to_token_pool,
        token_to_kv_pool_allocator=ps.token_to_kv_pool_allocator,
        req_pool_idx=req.req_pool_idx,
        record=record(),
        identity=ident or identity(),
        swa_start=req.swa_evicted,
    )


def target(kind: str, page: int):
    """Another capacity, other slots in use."""
    ps = sp.build(kind, size=1024, page_size=page, seed=9)
    sp.occupy(ps, 3, 50, seed=7)
    return ps


def rows_as_bytes(rows: dict) -> dict[str, np.ndarray]:
    out = {}
    for k, t in rows.items():
        t = t.contiguous()
        out[k] = t.numpy() if t.dtype == torch.bool else t.reshape(-1).view(torch.uint8).numpy()
    return out


def _into_target(restore, item: dict, **kw):
    """``restore`` (restore_request / resume_req) of ``item["path"]`` into a fresh :func:`target`."""
    ps = target(item["kind"], item["page"])
    return ps, restore(item["path"], req_to_token_pool=ps.req_to_token_pool,
                       token_to_kv_pool_allocator=ps.token_to_kv_pool_allocator, identity=identity(), **kw)


def _child_restore(spec_path: str) -> None:
    from hsnap_io import restore_request

    spec = json.load(open(spec_path))
    for item in spec["items"]:
        ps, res = _into_target(restore_request, item)
        rec = sp.RequestRecord(res.req_pool_idx, res.token_indices, res.mamba_pool_idx, res.state_position, 0)
        out_dir = item["out"]
        os.makedirs(out_dir, exist_ok=True)
        for k, arr in rows_as_bytes(sp.request_rows(ps, rec)).items():
            np.save(os.path.join(out_dir, f"{k}.npy"), arr, allow_pickle=False)
        json.dump(
            {"req_pool_idx": res.req_pool_idx, "mamba_pool_idx": res.mamba_pool_idx, "output_ids": res.record.output_ids.tolist(), "pid": os.getpid()},
            open(os.path.join(out_dir, "meta.json"), "w"),
        )


def _child_resume(spec_path: str) -> None:
    from hsnap_sglang.req import resume_req
    from hsnap_testing import reqs

    spec = json.load(open(spec_path))
    out = {}
    for item in spec["items"]:
        ps, req = _into_target(resume_req, item, tokenizer=reqs.tokenizer())
        rows = rows_as_bytes(reqs.req_rows(ps, req))
        out[item["path"]] = {
            "view": reqs.jsonable_view(req),
            "rows": {k: v.tobytes().hex() for k, v in rows.items()},
            "mamba_needs_clear": req.kv.mamba_needs_clear,
            "pid": os.getpid(),
        }
    json.dump(out, open(spec["out"], "w"))


if __name__ == "__main__":
    {"restore": _child_restore, "resume": _child_resume}[sys.argv[1]](sys.argv[2])
