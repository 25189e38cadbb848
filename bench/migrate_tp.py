"""Live migration across TP sizes: the downtime path of a re-sharded migration (the target's
apply of the final link), at the library level.

    .venv/bin/python -m bench.migrate_tp              # writes bench/MIGRATE_TP.md (~2 min on 2 cores)
    .venv/bin/python -m bench.migrate_tp --quick      # 1,024 tokens, 2 -> 1 only, 2 rounds; prints only

Model: Qwen3.5-35B-A3B (``bench.reshard``'s ``reference``: 2 KV heads x 256 bf16 on 10
attention layers, 30 GDN layers of 16 key / 32 value heads x 128, fp32 temporal state),
real SGLang pools of each rank. A request of ``L`` committed tokens migrates from a source
at TP N to target rank 0 of TP M: ``link-0000`` (a plain set at ``L - 68``), ``link-0001``
(a set of deltas, 64 rows) and ``final`` (a set of deltas: the tail of 4 rows, the whole
recurrent state, the record), each set written by the N source ranks' pools in this
process (the TP set ``MigrationSource(group=)`` commits; the source side is not timed here).
For each round the target (a fresh ``MigrationTarget(sharding=describe(model, M, 0))`` over
pools whose every slot holds stale noise) applies the two pre-copy links untimed, then the
final link timed — every check, the hashing of what it reads, the allocation of 4 slots, the
upload — and releases the request. Beside it, in the same rounds:

  stop-and-copy  ``restore_request`` of a plain TP N set at ``L`` re-sharded into the same
                 target (what the downtime path carries without live migration: the whole
                 history; compacting the chain first would add its own time)

Once per case (untimed) the migrated request is compared byte for byte with that direct
re-sharded restore. ``2 -> 2`` is the same-TP path (each rank file as is) for comparison.
"""

from __future__ import annotations

import dataclasses
import gc
import os
import statistics
import sys
import time

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if REPO not in sys.path:
    sys.path.insert(0, REPO)

import torch  # noqa: E402

import hsnap_format as hf  # noqa: E402
from bench.run import collect_garbage  # noqa: E402
from bench import reshard as brs  # noqa: E402
from hsnap_io import export_request, reshard  # noqa: E402

PAIRS = ((2, 1), (1, 2), (2, 2))
DELTA, TAIL = 64, 4  # rows of link-0001 and of the final link
WARMUP = 2  # untimed rounds first: the process's allocator settles (fresh 2 MiB blocks fault their pages in at first)

ABOUT = (
    "Qwen3.5-35B-A3B geometry (2 KV heads x 256 bf16, 10 attention layers; 30 GDN layers, 16 key / 32 value heads x 128: "
    "61.5 MiB of recurrent state at TP 1, 30.8 MiB per rank at TP 2), real SGLang pools. The source at TP N pre-copied "
    f"`link-0000` (a plain set) and `link-0001` ({DELTA} rows), applied by target rank 0 of TP M before the clock starts; "
    f"the timed apply is the final link's (the tail of {TAIL} rows, the whole recurrent state, the record): open the set, "
    "every check of the chain and of the set, hash the sections this rank reads, allocate the tail's slots, keep the "
    "Mamba slot's bytes for a rollback, assemble this rank's heads and channels from the source ranks holding them into "
    "the slots (hashed again as read). `stop-and-copy re-sharded`: `restore_request` of a plain TP N set at the same "
    "position into the same target rank (the whole history on the downtime path; compacting a chain first would add its "
    "own time). Each migration was checked byte for byte against that direct re-sharded restore (untimed). `2 -> 2`: the "
    "same-TP path (each rank file as is), for comparison."
)
READING = (
    "Reading: the downtime path of a live migration carries the tail rows and this rank's share of the recurrent state "
    "whatever the length — the bytes uploaded are the same at 1k and 8k tokens; at TP 2 -> 1 the target rank gathers the "
    "state of both source ranks (the whole 61.5 MiB), at 1 -> 2 it reads the TP 1 state whole (each source section's "
    "digest covers every byte) and keeps half. With this model the recurrent state dominates the final link: at 1k tokens "
    "the whole history is only 20 MiB of KV more, so stop-and-copy costs about the same; stop-and-copy grows with the "
    "history, the final link does not."
)


class Source:
    """Rank ``rank`` of a TP ``tp`` source holding the request as it decodes."""

    def __init__(self, m, tp: int, rank: int, tokens: int, rows: dict) -> None:
        self.m, self.tp, self.rank, self.rows = m, tp, rank, rows
        self.p = brs.build_pools(m, tp, rank, tokens + 16)
        self.row = self.p.rtp.alloc_rows(1)[0]
        self.mslot = int(self.p.rtp.mamba_allocator.alloc(1).reshape(-1)[0])
        self.p.rtp.req_index_to_mamba_index_mapping[self.row] = self.mslot
        self.pos = 0

    def decode_to(self, pos: int, state: dict) -> None:
        self.p.alloc.alloc(1)  # another request's slot in between
        tok = self.p.alloc.alloc(pos - self.pos).to(torch.int64)
        self.p.rtp.req_to_token[self.row, self.pos : pos] = tok.to(self.p.rtp.req_to_token.dtype)
        for b in self.p.view().bindings:
            full = self.rows[b.name][self.pos : pos] if b.space == "token" else state[b.name]
            data = brs.shard_of(self.m, self.tp, self.rank, b.name, full)
            if b.space == "token":
                b.buffer[tok] = data
            else:
                b.buffer[self.mslot] = data
        self.pos = pos


def record(pos: int, prompt: int) -> hf.RequestRecord:
    """The request at ``pos``: the same ``prompt`` tokens at every link, its outputs growing."""
    import numpy as np

    out = pos + 1 - prompt
    return hf.RequestRecord(rid="bench-migrate-tp", prompt_ids=np.arange(prompt, dtype=np.int32),
                            output_ids=np.arange(100, 100 + out, dtype=np.int32), state_position=pos, max_new_tokens=128)


def write_link(ranks: list[Source], path: str, base: str | None, sid: str, prompt: int) -> str:
    sw = hf.SetWriter(path)
    try:
        for s in ranks:
            ident = dataclasses.replace(brs.identity(s.m, s.tp, s.rank), snapshot_id=sid)
            export_request(sw.rank_path(s.rank), **s.p.kwargs(), req_pool_idx=s.row, record=record(s.pos, prompt),
                           identity=ident, sharding=reshard.describe(s.m.tp, s.tp, s.rank), base=base, fsync=False)
        sw.commit(tp_size=len(ranks), fsync=False)
    except BaseException:
        sw.abort()
        raise
    return path


def states(m, n: int) -> list[dict]:
    """``n`` recurrent states of the request (global tensors of noise, another salt each)."""
    p = brs.build_pools(m, 1, 0, 1)
    out = []
    for i in range(n):
        st = {}
        for j, b in enumerate(p.view().bindings):
            if b.space != "token":
                shape = tuple(b.buffer.shape[1:])
                st[b.name] = brs.noise(torch.Size(shape).numel() * b.buffer.element_size(), 7000 + 100 * i + j).view(b.buffer.dtype).view(shape)
        out.append(st)
    return out


def measure(m, tokens: int, src: int, dst: int, rounds: int, d: str, log=print) -> dict:
    from hsnap_io import restore_request
    from hsnap_io.migrate import FINAL_NAME, LINK_NAME, MigrationTarget
    from hsnap_io.statecheck import PoolCheckpoint

    rows = brs.global_state(m, tokens)
    sts = states(m, 3)
    positions = (tokens - TAIL - DELTA, tokens - TAIL, tokens)
    prompt = positions[0] - 9  # 10 outputs at link-0000
    ranks = [Source(m, src, r, tokens, rows) for r in range(src)]
    c = os.path.join(d, f"{m.name}-{tokens}-{src}-{dst}")
    os.makedirs(c)
    links = []
    for i, pos in enumerate(positions):
        for s in ranks:
            s.decode_to(pos, sts[i])
        name = FINAL_NAME if i == 2 else LINK_NAME.format(i)
        links.append(write_link(ranks, os.path.join(c, name), links[-1] if links else None, f"mig-{i}", prompt))
    direct = write_link(ranks, os.path.join(c, "direct"), None, "direct", prompt)
    del ranks
    collect_garbage()
    final_bytes = sum(os.path.getsize(os.path.join(links[2], f)) for f in os.listdir(links[2]) if f.endswith(".hsnap"))

    target = brs.build_pools(m, dst, 0, tokens + 64)
    brs.fill_stale(target)
    v = target.view()
    desc, ident = reshard.describe(m.tp, dst, 0), brs.identity(m, dst, 0)

    def migrate():
        tgt = MigrationTarget(**target.kwargs(), identity=ident, sharding=desc)
        for link in links[:2]:
            tgt.apply(link)
        t = time.perf_counter()
        applied = tgt.apply(links[2])
        return time.perf_counter() - t, tgt, applied

    def stop_and_copy():
        cp = PoolCheckpoint(v)
        t = time.perf_counter()
        res = restore_request(direct, **target.kwargs(), identity=ident, sharding=desc)
        dt = time.perf_counter() - t
        return dt, res, cp

    # untimed: the migrated request holds exactly the direct re-sharded restore's bytes
    _, tgt, applied = migrate()
    got = brs.slot_bytes(target, tgt.request)
    tgt.release()
    _, res, cp = stop_and_copy()
    if brs.slot_bytes(target, res) != got:
        raise AssertionError(f"{tokens} tok {src}->{dst}: the migrated request differs from the direct re-sharded restore")
    whole = res.bytes_uploaded
    cp.rollback()
    times = {"final": [], "stop": []}
    collect_garbage()
    gc.disable()
    try:
        for i in range(rounds + WARMUP):  # the first WARMUP rounds warm up (allocator, page cache)
            for name in (("final", "stop") if i % 2 else ("stop", "final")):
                if name == "final":
                    dt, tgt, _ = migrate()
                    tgt.release()
                else:
                    dt, _, cp = stop_and_copy()
                    cp.rollback()
                if i >= WARMUP:
                    times[name].append(dt)
    finally:
        gc.enable()
    row = dict(tokens=tokens, src=src, dst=dst, rows=applied.rows, uploaded=applied.bytes_uploaded, final_file_bytes=final_bytes,
               final_ms=statistics.median(times["final"]) * 1e3, final_all=[t * 1e3 for t in times["final"]],
               stop_uploaded=whole, stop_ms=statistics.median(times["stop"]) * 1e3, stop_all=[t * 1e3 for t in times["stop"]])
    log(f"  {tokens:>6} tok {src}->{dst}: final link {row['final_ms']:.1f} ms, {row['uploaded']:,} B uploaded "
        f"({row['final_file_bytes']:,} B in the link); stop-and-copy {row['stop_ms']:.1f} ms, {whole:,} B")
    import shutil

    shutil.rmtree(c)
    return row


def table(rows: list[dict]) -> list[str]:
    out = ["| committed tokens | TP | final link: rows | bytes uploaded (this rank) | final link on disk (all source ranks) "
           "| apply of the final link (median; all rounds) | stop-and-copy re-sharded: bytes | time (median; all rounds) |",
           "|---:|---|---:|---:|---:|---:|---:|---:|"]
    for r in rows:
        out.append(f"| {r['tokens']:,} | {r['src']} -> {r['dst']} | {r['rows']} | {r['uploaded']:,} | {r['final_file_bytes']:,} | "
                   f"**{r['final_ms']:.1f} ms** ({', '.join(f'{t:.0f}' for t in r['final_all'])}) | {r['stop_uploaded']:,} | "
                   f"{r['stop_ms']:.1f} ms ({', '.join(f'{t:.0f}' for t in r['stop_all'])}) |")
    return out


def main(argv=None) -> int:
    from bench import run as br

    ap = br.bench_parser("python -m bench.migrate_tp", __doc__, quick="1,024 tokens, 2 -> 1, 2 rounds", out="MIGRATE_TP.md", rounds=7)
    ap.add_argument("--tokens", default="1024,8192", help="committed tokens of the request, comma-separated")
    ap.add_argument("--pairs", default=",".join(f"{a}-{b}" for a, b in PAIRS), help="source TP - target TP, comma-separated")
    args = ap.parse_args(argv)
    torch.set_num_threads(1)
    if args.quick:
        args.tokens, args.pairs, args.rounds = "1024", "2-1", 2
    cases = [(int(n), tuple(int(x) for x in p.split("-"))) for n in args.tokens.split(",") for p in args.pairs.split(",")]
    m = brs.MODELS["reference"]
    info, rows, elapsed, load0, load1 = br.timed_in_tempdir(
        "hsnap-migrate-tp-bench-", args.dir, lambda d: [measure(m, n, src, dst, args.rounds, d) for n, (src, dst) in cases])
    lines = [
        "# Live migration across TP sizes: the downtime path (bench/migrate_tp.py)", "",
        *br.header_lines("python -m bench.migrate_tp " + " ".join(argv if argv is not None else sys.argv[1:]), info, elapsed, load0, load1),
        f"Statistic: median of {args.rounds} rounds after {WARMUP} warm-up rounds, the two contenders alternating; page cache warm "
        "(the links were just written, fsync off); Python's cyclic GC off while timing.", "",
        ABOUT, "", *table(rows), "", READING, "",
    ]
    br.write_report(lines, args.quick, args.out, "MIGRATE_TP.md")
    return 0


if __name__ == "__main__":
    sys.exit(main())
