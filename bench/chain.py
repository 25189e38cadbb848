"""Delta vs full export: the cost of a checkpoint of a running request.

    .venv/bin/python -m bench.chain [--tokens 4096] [--new 64] [--rounds 5] [--out bench/CHAIN.md]

Real SGLang pools with the reference geometry (bench.run: one TP-2 rank of Qwen3.5-35B-A3B,
10 full-attention layers, 30 GDN layers, 10,240 B of KV per token, 30.7 MiB of GDN state).
A request at ``tokens`` committed positions is exported plain (the base); after ``new``
more tokens (its recurrent state rewritten) it is exported again, once plain and once as a
delta of the base — fsync on, median of ``rounds``. Also: restoring the two-link chain
against the plain file, and compacting the chain. Bytes are exact; times are this machine's.
"""

from __future__ import annotations

import argparse
import os
import statistics
import tempfile
import time

import numpy as np
import torch

import hsnap_format as hf
from bench import run as br


def _record(pos: int, prompt: int, seed: int = 0) -> hf.RequestRecord:
    rng = np.random.default_rng(seed)
    ids = rng.integers(0, 151_000, pos + 1, dtype=np.int32)  # one fixed sequence: prompt, then the outputs so far
    out = pos + 1 - prompt
    return hf.RequestRecord(rid="bench-chain", prompt_ids=ids[:prompt], output_ids=ids[prompt:], state_position=pos,
                            output_logprobs=-np.linspace(0.01, 1.0, out, dtype=np.float32), sampling={"temperature": 0.0},
                            max_new_tokens=4096, streamed_tokens=out)


def _median(fn, rounds: int) -> float:
    times = []
    for _ in range(rounds):
        times.append(fn())
    return statistics.median(times)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--tokens", type=int, default=4096)
    ap.add_argument("--new", type=int, default=64)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--out", default=os.path.join(os.path.dirname(__file__), "CHAIN.md"))
    args = ap.parse_args(argv)
    from hsnap_io import export_request, restore_request

    p0, p1 = args.tokens, args.tokens + args.new
    prompt = p0 - 63
    pools = br.build_reference_pools(p1)
    row = br.alloc_request(pools, p1)
    ident = br.identity()
    with tempfile.TemporaryDirectory(prefix="hsnap-chain-bench-") as d:
        base = os.path.join(d, "base.hsnap")
        export_request(base, **pools.kwargs(), req_pool_idx=row, record=_record(p0, prompt), identity=ident)
        mamba = int(pools.req_to_token_pool.req_index_to_mamba_index_mapping[row])
        for _, buf in ((b.name, b.buffer) for b in br.view(pools).bindings if b.space == "mamba"):
            buf[mamba].add_(1)  # decoding rewrote the recurrent state

        def timed(path, **kw):
            def once() -> float:
                if os.path.lexists(path):
                    os.unlink(path)
                t = time.perf_counter()
                info = export_request(path, **pools.kwargs(), req_pool_idx=row, record=_record(p1, prompt), identity=ident, **kw)
                once.info = info
                return time.perf_counter() - t
            return once

        full_fn, delta_fn = timed(os.path.join(d, "full.hsnap")), timed(os.path.join(d, "delta.hsnap"), base=base)
        t_full, t_delta = _median(full_fn, args.rounds), _median(delta_fn, args.rounds)
        full, delta = full_fn.info, delta_fn.info

        def restore(path) -> float:
            target = br.build_reference_pools(p1)  # fresh slots every round (not timed)
            t = time.perf_counter()
            restore_request(path, **target.kwargs(), identity=ident)
            return time.perf_counter() - t

        t_restore_full = _median(lambda: restore(os.path.join(d, "full.hsnap")), args.rounds)
        t_restore_chain = _median(lambda: restore(os.path.join(d, "delta.hsnap")), args.rounds)

        def compacted() -> float:
            out = os.path.join(d, "compact.hsnap")
            if os.path.lexists(out):
                os.unlink(out)
            t = time.perf_counter()
            with hf.open_chain(os.path.join(d, "delta.hsnap")) as c:
                hf.compact(c, out)
            return time.perf_counter() - t

        t_compact = _median(compacted, args.rounds)
        same = open(os.path.join(d, "compact.hsnap"), "rb").read() == open(os.path.join(d, "full.hsnap"), "rb").read()
        kv_row = 10 * 2 * 256 * 2  # 10 layers x (K, V) x 256 dims x bf16
        lines = [
            "# Delta vs full export (bench/chain.py)",
            "",
            f"Reference geometry (one TP-2 rank of Qwen3.5-35B-A3B: {kv_row:,} B of KV per token, 30 GDN layers), real SGLang pools on "
            f"CPU; base exported at {p0:,} tokens, then {args.new} new tokens: a full export at {p1:,} vs a delta over the base. "
            f"fsync on, median of {args.rounds}; torch {torch.__version__}, {torch.get_num_threads()} threads.",
            "",
            "| | full export | delta | delta / full |",
            "|---|---:|---:|---:|",
            f"| file bytes | {full.file_length:,} | {delta.file_length:,} | {delta.file_length / full.file_length:.3f} |",
            f"| state payload bytes | {full.payload_bytes:,} | {delta.payload_bytes:,} | {delta.payload_bytes / full.payload_bytes:.3f} |",
            f"| KV rows read from the pools | {p1:,} | {p1 - p0:,} | {(p1 - p0) / p1:.3f} |",
            f"| export time | {t_full * 1e3:.1f} ms | {t_delta * 1e3:.1f} ms | {t_delta / t_full:.3f} |",
            "",
            f"The delta's payload is {args.new} tokens of KV ({(p1 - p0) * kv_row:,} B) plus the whole GDN state "
            f"({delta.payload_bytes - (p1 - p0) * kv_row:,} B): the recurrent state, overwritten every token, is what a "
            f"checkpoint of a hybrid request cannot avoid writing.",
            "",
            f"Restore (verify=True) of the full file: {t_restore_full * 1e3:.1f} ms; of the two-link chain (base + delta): "
            f"{t_restore_chain * 1e3:.1f} ms. Compaction of the chain into one plain file: {t_compact * 1e3:.1f} ms "
            f"(byte-identical to the full export: {same}).",
            "",
        ]
    text = "\n".join(lines)
    print(text)
    with open(args.out, "w", encoding="utf-8") as f:
        f.write(text)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
