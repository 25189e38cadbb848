"""Drain with dedup: every request of an engine snapshotted, the
full pages of their shared prefix stored once.

    .venv/bin/python -m bench.pages [--requests 8] [--system 4096] [--own 512] [--page 64] [--rounds 3] [--out bench/PAGES.md]

Real SGLang pools with the reference geometry (bench.run: one TP-2 rank of Qwen3.5-35B-A3B,
10 full-attention layers, 30 GDN layers, 10,240 B of KV per token, 30.7 MiB of GDN state per
request). ``requests`` requests share a ``system``-token prompt — in the pools they share its
slots, as SGLang's radix cache hands them out — and each has ``own`` tokens more. A *plain
drain* exports each request to its own file; a *paged drain* exports them through one
:class:`~hsnap_format.pages.PageStore` session (page size ``page``, keys from SGLang's own
``get_hash_str``). Reported: bytes written by each (files, page objects), time of each drain
(fsync on, median of ``rounds``), one restore (verify=True) and one compaction of a paged
snapshot against the plain file. Bytes are exact; times are this machine's.
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import tempfile
import time

import numpy as np
import torch

import hsnap_format as hf
from bench import run as br


def _records(n: int, system: int, own: int) -> list[hf.RequestRecord]:
    rng = np.random.default_rng(0)
    prefix = rng.integers(0, 151_000, system, dtype=np.int32)
    out = []
    for i in range(n):
        ids = np.concatenate([prefix, np.random.default_rng(1 + i).integers(0, 151_000, own + 1, dtype=np.int32)])
        prompt = system + own // 2
        n_out = len(ids) - prompt
        out.append(hf.RequestRecord(rid=f"drain-{i}", prompt_ids=ids[:prompt], output_ids=ids[prompt:], state_position=system + own,
                                    output_logprobs=-np.linspace(0.01, 1.0, n_out, dtype=np.float32), sampling={"temperature": 0.0},
                                    max_new_tokens=4096, streamed_tokens=n_out))
    return out


def _pools(n: int, system: int, own: int):
    """``n`` requests whose first ``system`` positions share the first request's slots."""
    tokens = system + own
    pools = br.build_reference_pools(n * tokens, max_reqs=n + 1)
    rows = [br.alloc_request(pools, tokens) for _ in range(n)]
    rtp = pools.req_to_token_pool
    for r in rows[1:]:
        rtp.req_to_token[r, :system] = rtp.req_to_token[rows[0], :system]
    return pools, rows


def _dir_bytes(d: str) -> tuple[int, int]:
    files = [os.path.join(d, f) for f in os.listdir(d) if f.endswith(".hpage")] if os.path.isdir(d) else []
    return len(files), sum(os.path.getsize(f) for f in files)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--requests", type=int, default=8)
    ap.add_argument("--system", type=int, default=4096)
    ap.add_argument("--own", type=int, default=512)
    ap.add_argument("--page", type=int, default=64)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--out", default=os.path.join(os.path.dirname(__file__), "PAGES.md"))
    args = ap.parse_args(argv)
    from hsnap_io import export_request, restore_request
    from hsnap_io.pagestore import page_store

    n, system, own, S = args.requests, args.system, args.own, args.page
    pos = system + own
    pools, rows = _pools(n, system, own)
    records = _records(n, system, own)
    ident = br.identity()
    root = tempfile.mkdtemp(prefix="hsnap-pages-bench-")
    try:
        def plain_drain(d: str) -> tuple[float, int]:
            t = time.perf_counter()
            total = sum(export_request(os.path.join(d, f"r{i}.hsnap"), **pools.kwargs(), req_pool_idx=row, record=rec, identity=ident).file_length
                        for i, (row, rec) in enumerate(zip(rows, records)))
            return time.perf_counter() - t, total

        def paged_drain(d: str):
            t = time.perf_counter()
            with page_store(os.path.join(d, "pages"), page_size=S) as store:
                total = sum(export_request(os.path.join(d, f"r{i}.hsnap"), **pools.kwargs(), req_pool_idx=row, record=rec, identity=ident,
                                           pages=store).file_length for i, (row, rec) in enumerate(zip(rows, records)))
            return time.perf_counter() - t, total, store.stats

        plain_t, paged_t = [], []
        for k in range(args.rounds):
            for fn, times in ((plain_drain, plain_t), (paged_drain, paged_t)):
                d = os.path.join(root, f"{fn.__name__}-{k}")
                os.mkdir(d)
                res = fn(d)
                times.append(res[0])
                if fn is plain_drain:
                    plain_bytes = res[1]
                else:
                    paged_files, stats = res[1], res[2]
                    n_pages, page_bytes = _dir_bytes(os.path.join(d, "pages"))
                if k < args.rounds - 1:
                    shutil.rmtree(d)
        plain_dir, paged_dir = os.path.join(root, f"plain_drain-{args.rounds - 1}"), os.path.join(root, f"paged_drain-{args.rounds - 1}")

        def restore(path) -> float:
            target = br.build_reference_pools(pos)
            t = time.perf_counter()
            restore_request(path, **target.kwargs(), identity=ident)
            return time.perf_counter() - t

        t_restore_plain = statistics.median(restore(os.path.join(plain_dir, f"r{n - 1}.hsnap")) for _ in range(args.rounds))
        t_restore_paged = statistics.median(restore(os.path.join(paged_dir, f"r{n - 1}.hsnap")) for _ in range(args.rounds))

        def compacted() -> float:
            out = os.path.join(paged_dir, "c.hsnap")
            if os.path.lexists(out):
                os.unlink(out)
            t = time.perf_counter()
            with hf.open_chain(os.path.join(paged_dir, f"r{n - 1}.hsnap")) as c:
                hf.compact(c, out)
            return time.perf_counter() - t

        t_compact = statistics.median(compacted() for _ in range(args.rounds))
        same = open(os.path.join(paged_dir, "c.hsnap"), "rb").read() == open(os.path.join(plain_dir, f"r{n - 1}.hsnap"), "rb").read()
        gdn = sum(s.length for s in hf.open(os.path.join(plain_dir, "r0.hsnap")).sections if s.kind in ("conv", "temporal"))
    finally:
        shutil.rmtree(root, ignore_errors=True)
    written = paged_files + page_bytes
    kv_row = 10 * 2 * 256 * 2
    shared = system // S
    lines = [
        "# Drain with dedup (bench/pages.py)",
        "",
        f"Reference geometry (one TP-2 rank of Qwen3.5-35B-A3B: {kv_row:,} B of KV per token, 30 GDN layers: {gdn:,} B of "
        f"recurrent state per request), real SGLang pools on CPU. {n} requests share a {system:,}-token system prompt (its slots "
        f"shared, as SGLang's radix cache shares them) and have {own} tokens each of their own: {pos:,} committed positions each. "
        f"Plain drain: one file per request. Paged drain: one page-store session, page size {S} (keys: SGLang's `get_hash_str`). "
        f"fsync on, median of {args.rounds}; torch {torch.__version__}, {torch.get_num_threads()} threads.",
        "",
        "| | plain drain (sum of single snapshots) | paged drain | paged / plain |",
        "|---|---:|---:|---:|",
        f"| bytes written | {plain_bytes:,} | {written:,} | {written / plain_bytes:.3f} |",
        f"| of which snapshot files | {plain_bytes:,} | {paged_files:,} | |",
        f"| of which page objects | — | {page_bytes:,} ({n_pages} objects) | |",
        f"| drain time ({n} requests) | {statistics.median(plain_t) * 1e3:.0f} ms | {statistics.median(paged_t) * 1e3:.0f} ms | "
        f"{statistics.median(paged_t) / statistics.median(plain_t):.3f} |",
        "",
        f"Pages put: {stats.pages_put} ({stats.bytes_put:,} B); reused: {stats.pages_reused} ({stats.bytes_reused:,} B not written "
        f"again) — the {shared} pages of the system prompt put once and reused by the {n - 1} other requests; {stats.pages_verified} "
        f"existing pages verified (read and hashed) before reuse. Each paged snapshot still holds its whole recurrent state "
        f"({gdn:,} B: not prefix-addressable), its record and the {pos % S} rows after its last full page. Without the GDN state "
        f"the KV alone would be {n * pos * kv_row:,} B plain vs {(shared + n * (pos // S - shared)) * S * kv_row + n * (pos % S) * kv_row:,} "
        f"B paged.",
        "",
        f"Restore (verify=True) of one request: plain file {t_restore_plain * 1e3:.1f} ms; paged snapshot (file + {pos // S} page "
        f"objects, each checked and verified before allocating, hashed again as it lands) {t_restore_paged * 1e3:.1f} ms. "
        f"Compaction of a paged snapshot into a plain file: {t_compact * 1e3:.1f} ms (byte-identical to the plain export: {same}).",
        "",
    ]
    text = "\n".join(lines)
    print(text)
    with open(args.out, "w", encoding="utf-8") as f:
        f.write(text)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
