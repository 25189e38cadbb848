"""Re-sharded restore (TP N -> TP M) against the plain same-TP restore of the same target bytes.

    .venv/bin/python -m bench.reshard                  # writes bench/RESHARD.md (~3 min on 2 cores)
    .venv/bin/python -m bench.reshard --quick          # gqa, 4,096 tokens, 2 rounds; prints only

One global request state per model and size (seeded noise) is split the way SGLang holds
it at TP 1, 2 and 4 (``hsnap_io.reshard.kv_head_map`` / ``conv_channel_map``: SGLang's own
weight loaders) and each split is exported as a snapshot set from real SGLang pools. For
each pair N -> M, target rank 0 of TP M (real pools, every slot holding stale noise) is
restored two ways, interleaved, in the same run:

  re-sharded  restore_request(set at TP N, sharding=describe(model, M, 0))
  plain       restore_request(set at TP M, rank 0): the same target bytes, the rank file as is

both with the same ``verify`` mode; the ratio is t(plain) / t(re-sharded) (1.0 = as fast).
Once per pair (untimed) the two restores are compared byte for byte in the target slots.

Models: ``gqa`` (8 KV heads x 128 bf16, 4 layers, MHA pool: the case first measured) and
``reference`` (Qwen3.5-35B-A3B, hsnap_format.reference at TP 2: 2 KV heads x 256,
10 attention layers, 30 GDN layers; at TP 4 each KV head lives on 2 ranks).
"""

from __future__ import annotations

import argparse
import dataclasses
import gc
import os
import shutil
import statistics
import sys
import tempfile
import time

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if REPO not in sys.path:
    sys.path.insert(0, REPO)

import torch  # noqa: E402

import hsnap_format as hf  # noqa: E402
from bench.run import collect_garbage, round_order  # noqa: E402
from hsnap_format import reference as ref  # noqa: E402
from hsnap_io import reshard  # noqa: E402

MiB = 1 << 20
T_RESHARD = 0.5  # target: re-sharded >= 0.5x the plain same-TP restore
PAIRS = ((2, 1), (1, 2), (2, 4), (4, 2))


@dataclasses.dataclass(frozen=True)
class BenchModel:
    name: str
    tp: reshard.TPModel
    attn_layers: tuple[int, ...]
    head_dim: int
    mamba_layers: tuple[int, ...] = ()


MODELS = {
    "gqa": BenchModel("gqa", reshard.TPModel(kv_heads=8), (0, 1, 2, 3), 128),
    "reference": BenchModel("reference", reshard.TPModel(kv_heads=2, mamba=reshard.GDNDims(16, 32, 128, 128)),
                            ref.FULL_ATTENTION_LAYERS, 256, ref.GDN_LAYERS),
}


@dataclasses.dataclass
class Pools:
    rtp: object
    alloc: object
    kv: object

    def kwargs(self) -> dict:
        return dict(req_to_token_pool=self.rtp, token_to_kv_pool_allocator=self.alloc)

    def view(self):
        from hsnap_io.adapters import view_pools

        return view_pools(self.rtp, self.alloc)


def build_pools(m: BenchModel, tp: int, rank: int, size: int) -> Pools:
    """SGLang's own pool classes with rank ``rank`` of ``tp``'s shapes, room for ``size`` tokens."""
    from hsnap_io.sglang_env import import_sglang

    sg = import_sglang()
    mp = sg.memory_pool
    heads = len(reshard.kv_head_map(m.tp.kv_heads, tp, rank)[0])
    if m.mamba_layers:
        mu, d = sg.mamba_utils, m.tp.mamba
        shape = mu.Mamba2StateShape.create(tp_world_size=tp, conv_kernel=m.tp.conv_kernel, intermediate_size=d.v_heads * d.v_dim,
                                           n_groups=d.k_heads, num_heads=d.v_heads, head_dim=d.v_dim, state_size=d.k_dim,
                                           conv_shard_groups=[d.k_heads * d.k_dim] * 2 + [d.v_heads * d.v_dim])
        params = mu.Mamba2CacheParams(shape=shape, layers=list(m.mamba_layers),
                                      dtype=mu.Mamba2StateDType(conv=torch.bfloat16, temporal=torch.float32))
        rtp = mp.HybridReqToTokenPool(size=2, mamba_size=2, mamba_spec_state_size=2, max_context_len=size, device="cpu",
                                      enable_memory_saver=False, cache_params=params, mamba_layer_ids=list(m.mamba_layers),
                                      enable_mamba_extra_buffer=False)
        kv = mp.HybridLinearKVPool(size=size, dtype=torch.bfloat16, page_size=1, head_num=heads, head_dim=m.head_dim,
                                   full_attention_layer_ids=list(m.attn_layers), device="cpu", mamba_pool=rtp.mamba_pool,
                                   enable_memory_saver=False)
    else:
        rtp = mp.ReqToTokenPool(size=2, max_context_len=size, device="cpu", enable_memory_saver=False)
        kv = mp.MHATokenToKVPool(size=size, page_size=1, dtype=torch.bfloat16, head_num=heads, head_dim=m.head_dim,
                                 layer_num=len(m.attn_layers), device="cpu", enable_memory_saver=False, enable_alt_stream=False)
    alloc = sg.allocator.TokenToKVPoolAllocator(size, torch.bfloat16, "cpu", kv, False)
    return Pools(rtp, alloc, kv)


def noise(nbytes: int, salt: int) -> torch.Tensor:
    from bench.run import noise_block

    block = noise_block()
    start = (salt * 4099) % (4099 * 97)
    if nbytes <= 8 * MiB:  # its own storage: a view would keep 8 MiB alive per (small) section
        return block[start : start + nbytes].clone()
    reps = -(-nbytes // (8 * MiB))
    return block[start : start + 8 * MiB].repeat(reps)[:nbytes]


def fill_stale(p: Pools) -> None:
    """Every slot of every buffer holds noise (a serving engine's free slots hold stale data;
    and every page is faulted in before anything is timed)."""
    for i, b in enumerate(p.view().bindings):
        raw = b.buffer.view(-1).view(torch.uint8)
        raw.copy_(noise(raw.numel(), 1000 + i))


def global_state(m: BenchModel, tokens: int) -> dict[str, torch.Tensor]:
    """Section name -> the global (TP 1) tensor of one request of ``tokens`` tokens (noise)."""
    p = build_pools(m, 1, 0, 1)
    out = {}
    for i, b in enumerate(p.view().bindings):
        shape = (tokens, *b.buffer.shape[1:]) if b.space == "token" else tuple(b.buffer.shape[1:])
        n = torch.Size(shape).numel() * b.buffer.element_size()
        out[b.name] = noise(n, i).view(b.buffer.dtype).view(shape)
    return out


def shard_of(m: BenchModel, tp: int, rank: int, name: str, full: torch.Tensor) -> torch.Tensor:
    """What rank ``rank`` of ``tp`` holds of section ``name``'s global tensor (SGLang's split)."""
    if name.startswith("attn."):
        return full[:, reshard.kv_head_map(m.tp.kv_heads, tp, rank)[0]]
    if name.endswith(".temporal"):
        n = full.shape[0] // tp
        return full[rank * n : (rank + 1) * n]
    return full[reshard.conv_channel_map(m.tp.mamba, tp, rank, m.tp.conv_kernel)[0]]


def identity(m: BenchModel, tp: int, rank: int) -> hf.Identity:
    return hf.Identity(model_id=f"bench/{m.name}", weights_version="w", engine=hf.Engine("sglang", "0.5.23", "bench"),
                       tp_size=tp, tp_rank=rank, snapshot_id="bench-reshard", created_at="2026-12-01T00:00:00Z")


def place(p: Pools, tokens: int) -> tuple[int, torch.Tensor, int | None]:
    """One request through SGLang's allocators: (req row, token slots, mamba slot)."""
    row = p.rtp.alloc_rows(1)[0]
    tok = p.alloc.alloc(tokens).to(torch.int64)
    p.rtp.req_to_token[row, :tokens] = tok.to(p.rtp.req_to_token.dtype)
    mslot = None
    if hasattr(p.rtp, "mamba_allocator"):
        mslot = int(p.rtp.mamba_allocator.alloc(1).reshape(-1)[0])
        p.rtp.req_index_to_mamba_index_mapping[row] = mslot
    return row, tok, mslot


def write_set(m: BenchModel, tp: int, state: dict, tokens: int, path: str) -> str:
    """The TP ``tp`` snapshot set of ``state``: each rank's pools hold its SGLang split."""
    from hsnap_io import export_request

    sw = hf.SetWriter(path)
    try:
        for r in range(tp):
            p = build_pools(m, tp, r, tokens + 8)
            row, tok, mslot = place(p, tokens)
            for b in p.view().bindings:
                data = shard_of(m, tp, r, b.name, state[b.name])
                if b.space == "token":
                    b.buffer[tok] = data
                else:
                    b.buffer[mslot] = data
            export_request(sw.rank_path(r), **p.kwargs(), req_pool_idx=row, record=ref.record(state_position=tokens),
                           identity=identity(m, tp, r), sharding=reshard.describe(m.tp, tp, r), fsync=False)
            del p
        sw.commit(tp_size=tp, fsync=False)
    except BaseException:
        sw.abort()
        raise
    return path


MODES = ("True", "during", "False")  # restore_request's verify=
VERIFY = {"True": True, "during": "during", "False": False}


@dataclasses.dataclass
class Row:
    model: str
    tokens: int
    src: int
    dst: int
    target_bytes: int
    source_read: int
    plain: dict  # mode -> median seconds of the plain same-TP restore
    resharded: dict  # mode -> median seconds
    verify_pass: float = 0.0  # verify=True's read before allocating: every depended-on source section hashed
    staging: float = 0.0  # what staging the shard would add instead: a fresh buffer of the target bytes, filled and copied out

    def ratio(self, mode: str) -> float:
        return self.plain[mode] / self.resharded[mode]


def slot_bytes(p: Pools, res) -> list[bytes]:
    out = []
    for b in p.view().bindings:
        rows = res.token_indices if b.space == "token" else torch.tensor([res.mamba_pool_idx])
        out.append(b.buffer[rows].contiguous().view(-1).view(torch.uint8).numpy().tobytes())
    return out


def measure_pair(m: BenchModel, tokens: int, sets: dict, src: int, dst: int, modes, rounds: int, log=print) -> Row:
    from hsnap_io import restore_request
    from hsnap_io.statecheck import PoolCheckpoint

    target = build_pools(m, dst, 0, tokens + 64)
    fill_stale(target)
    v = target.view()
    desc = reshard.describe(m.tp, dst, 0)
    ident = identity(m, dst, 0)

    def restore(path, mode):
        cp = PoolCheckpoint(v)  # free lists etc.: put back after the run (untimed)
        t = time.perf_counter()
        res = restore_request(path, **target.kwargs(), identity=ident, sharding=desc, verify=VERIFY[mode])
        return time.perf_counter() - t, res, cp

    # untimed: the re-sharded restore lands exactly the plain restore's bytes, in every mode
    _, b, cp = restore(sets[dst], "True")
    want = slot_bytes(target, b)
    cp.rollback()
    for mode in modes:
        _, a, cp = restore(sets[src], mode)
        if slot_bytes(target, a) != want or not torch.equal(a.token_indices, b.token_indices):
            raise AssertionError(f"{m.name} {tokens} tok {src}->{dst} {mode}: re-sharded bytes differ from the plain restore's")
        cp.rollback()
    contenders = {f"plain {mode}": (sets[dst], mode) for mode in modes}
    contenders.update({mode: (sets[src], mode) for mode in modes})
    times: dict[str, list[float]] = {k: [] for k in contenders}
    names = list(contenders)
    collect_garbage()
    gc.disable()  # as bench.run: a collection of the bench's own heap is not a restore's cost
    try:
        for i in range(rounds + 1):  # round 0 warms up; the order is drawn afresh every round
            for name in round_order(names, i):
                dt, _, cp = restore(*contenders[name])
                cp.rollback()
                if i:
                    times[name].append(dt)
    finally:
        gc.enable()
    med = {k: statistics.median(t) for k, t in times.items()}
    row = Row(m.name, tokens, src, dst, a.bytes_uploaded, a.source_bytes_read,
              {mode: med[f"plain {mode}"] for mode in modes}, {mode: med[mode] for mode in modes})
    row.verify_pass, row.staging = _alternatives(sets[src], v, desc, a.bytes_uploaded, rounds)
    log(f"  {m.name} {tokens:>6} tok {src}->{dst}: " + "  ".join(
        f"[{mode}] plain {row.plain[mode] * 1e3:.1f} ms re-sharded {row.resharded[mode] * 1e3:.1f} ms ({row.ratio(mode):.2f})" for mode in modes)
        + f"  verify pass {row.verify_pass * 1e3:.1f} ms, staging {row.staging * 1e3:.1f} ms")
    return row


def _alternatives(path, view, desc, target_bytes: int, rounds: int) -> tuple[float, float]:
    """The two ways verify=True can keep its refusals before allocation, measured on their
    own: (a) what the restore does — hash every depended-on source section before
    allocating, then read it again while assembling; its extra cost is this verify pass;
    (b) stage the assembled shard in host memory before allocating and upload from it —
    one read, but a fresh buffer of the target bytes, written once and copied into the
    slots (a lower bound: here from and into memory already in place)."""
    import numpy as np

    with hf.open_snapshot(path) as s:
        plans = reshard.build_plans(s, view, desc, path)

        def verify_pass():
            for p in plans:
                for k in p.sources:
                    s.ranks[k].verify_section(p.name)

        src, dst = np.ones(target_bytes, dtype=np.uint8), np.ones(target_bytes, dtype=np.uint8)

        def staging():
            buf = np.empty(target_bytes, dtype=np.uint8)
            buf[:] = src
            dst[:] = buf
            del buf

        out = []
        for fn in (verify_pass, staging):
            ts = [_timed(fn) for _ in range(rounds + 1)][1:]
            out.append(statistics.median(ts))
    return out[0], out[1]


def _timed(fn) -> float:
    t = time.perf_counter()
    fn()
    return time.perf_counter() - t


def read_strategies(m: BenchModel, tokens: int, sets: dict, rounds: int) -> dict:
    """One attention section, TP 1 -> TP 2 target rank 0 (half of every source row):
    (a) one pread per contiguous run (here: per token), straight into the target bytes;
    (b) the whole section in 2 MiB preads, the runs sliced out of each piece (what the
    restore does; with verify it must read every byte anyway). No hashing in either."""
    import numpy as np

    with hf.open_snapshot(sets[1]) as s:
        snap = s.ranks[0]
        info = snap.section("attn.%d.k" % m.attn_layers[0])
        fd = snap.fileno()
        row = info.length // tokens
        half = row // 2
        out = np.empty(tokens * half, dtype=np.uint8)
        out.fill(0)
        piece = np.empty(2 << 20, dtype=np.uint8)

        def per_run():
            mv = memoryview(out)
            for t in range(tokens):
                os.preadv(fd, [mv[t * half : (t + 1) * half]], info.offset + t * row)

        def whole():
            per = (2 << 20) // row
            dst = out.reshape(tokens, half)
            for t0 in range(0, tokens, per):
                n = min(per, tokens - t0)
                os.preadv(fd, [memoryview(piece[: n * row])], info.offset + t0 * row)
                dst[t0 : t0 + n] = piece[: n * row].reshape(n, row)[:, :half]

        got = {}
        for name, fn in (("per-run preads", per_run), ("whole section, sliced", whole)):
            ts = []
            for _ in range(rounds + 1):
                t = time.perf_counter()
                fn()
                ts.append(time.perf_counter() - t)
            got[name] = statistics.median(ts[1:])
        return {"section": info.name, "bytes": info.length, "runs": tokens, "run bytes": half, **got}


def run(models, sizes, pairs, modes, rounds: int, d: str, log=print) -> tuple[list[Row], list[dict]]:
    rows, strategies = [], []
    for name in models:
        m = MODELS[name]
        for tokens in sizes:
            state = global_state(m, tokens)
            tps = sorted({t for pair in pairs for t in pair} | {1})
            sets = {tp: write_set(m, tp, state, tokens, os.path.join(d, f"{name}-{tokens}-tp{tp}")) for tp in tps}
            del state
            for src, dst in pairs:
                rows.append(measure_pair(m, tokens, sets, src, dst, modes, rounds, log))
            if name == "gqa":
                strategies.append({"model": name, "tokens": tokens, **read_strategies(m, tokens, sets, rounds)})
            for p in sets.values():
                shutil.rmtree(p)
    return rows, strategies


def _fmt_ms(s: float) -> str:
    return f"{s * 1e3:.2f} ms" if s < 1 else f"{s:.3f} s"


def tables(rows: list[Row], strategies: list[dict], modes) -> list[str]:
    head = ["model", "tokens", "TP", "target bytes", "source bytes read"]
    for mode in modes:
        head += [f"plain verify={mode}", f"re-sharded verify={mode}", "ratio"]
    out = ["| " + " | ".join(head) + " |", "|" + "---|" * 3 + "---:|" * (len(head) - 3)]
    for r in rows:
        cells = [r.model, f"{r.tokens:,}", f"{r.src}->{r.dst}", f"{r.target_bytes / MiB:.1f} MiB", f"{r.source_read / MiB:.1f} MiB"]
        for mode in modes:
            cells += [_fmt_ms(r.plain[mode]), _fmt_ms(r.resharded[mode]), f"{r.ratio(mode):.2f}"]
        out.append("| " + " | ".join(cells) + " |")
    out += ["", "## How verify=True keeps its refusals before allocating: read twice, or stage the shard", "",
            "verify=True hashes every depended-on source section before allocating and reads it again, hashed, while "
            "assembling it in the slots (`verify pass`: that first read, alone). The alternative — assemble the shard in host "
            "memory before allocating and upload from it, reading once — adds a fresh buffer of the target bytes, written "
            "once and copied into the slots (`staging`: that cost alone, a lower bound, from and into memory already in "
            "place). Fresh memory is what this VM makes expensive (virtio-balloon free page reporting: its cost swings from "
            "~40 µs to ~1 ms per MiB with what the host reclaimed), and a shard-sized buffer is a giant allocation on a "
            "serving host; the second read needs no memory beyond one 2 MiB piece.", "",
            "| model | tokens | TP | target bytes | source bytes read | verify pass | staging (lower bound) | cheaper |",
            "|---|---:|---|---:|---:|---:|---:|---|"]
    for r in rows:
        if r.verify_pass:
            out.append(f"| {r.model} | {r.tokens:,} | {r.src}->{r.dst} | {r.target_bytes / MiB:.1f} MiB | {r.source_read / MiB:.1f} MiB | "
                       f"{_fmt_ms(r.verify_pass)} | {_fmt_ms(r.staging)} | {'read twice' if r.verify_pass <= r.staging else 'staging'} |")
    if strategies:
        out += ["", "## Read strategy: one pread per contiguous run, or whole sections sliced in memory", "",
                "verify=False (no hashing), one attention section, TP 1 -> TP 2 rank 0 (half of every source row: the runs "
                "are per token). With verify, every byte is read anyway (the digest covers the section).", "",
                "| model | tokens | section | section bytes | runs (bytes each) | one pread per run | whole section in 2 MiB preads, sliced | per-run / whole |",
                "|---|---:|---|---:|---:|---:|---:|---:|"]
        for s in strategies:
            out.append(f"| {s['model']} | {s['tokens']:,} | {s['section']} | {s['bytes'] / MiB:.1f} MiB | {s['runs']:,} ({s['run bytes']:,} B) | "
                       f"{_fmt_ms(s['per-run preads'])} | {_fmt_ms(s['whole section, sliced'])} | "
                       f"{s['per-run preads'] / s['whole section, sliced']:.1f}x |")
    return out


def targets(rows: list[Row]) -> list[str]:
    out = ["| target | result | figure |", "|---|---|---:|"]
    for r in rows:
        if "True" in r.resharded:
            ok = r.ratio("True") >= T_RESHARD
            out.append(f"| {r.model} {r.tokens:,} tok {r.src}->{r.dst}: re-sharded verify=True >= {T_RESHARD}x plain | "
                       f"{'PASS' if ok else 'MISS'} | {r.ratio('True'):.2f} |")
    return out


def main(argv=None) -> int:
    from bench import run as br

    ap = argparse.ArgumentParser(prog="python -m bench.reshard", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="gqa, 4,096 tokens, 2->1 and 1->2, 2 rounds; prints, writes nothing")
    ap.add_argument("--models", default="gqa,reference")
    ap.add_argument("--tokens", default="4096,32768")
    ap.add_argument("--pairs", default=",".join(f"{a}-{b}" for a, b in PAIRS))
    ap.add_argument("--modes", default=",".join(MODES), help=f"verify modes, of: {', '.join(MODES)}")
    ap.add_argument("--rounds", type=int, default=7, help="measured rounds (median), after one warm-up round")
    ap.add_argument("--dir", default=None)
    ap.add_argument("--out", default=None, help="markdown output (default bench/RESHARD.md; none with --quick)")
    args = ap.parse_args(argv)
    torch.set_num_threads(1)
    if args.quick:
        args.models, args.tokens, args.pairs, args.rounds = "gqa", "4096", "2-1,1-2", 2
    models = args.models.split(",")
    sizes = [int(x) for x in args.tokens.split(",")]
    pairs = [tuple(int(x) for x in p.split("-")) for p in args.pairs.split(",")]
    modes = [x.strip() for x in args.modes.split(",")]
    for x in modes:
        if x not in MODES:
            ap.error(f"unknown mode {x!r}")
    load0 = os.getloadavg()
    t0 = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix="hsnap-reshard-bench-", dir=args.dir) as d:
        info = br.machine(d)
        rows, strategies = run(models, sizes, pairs, modes, args.rounds, d)
    elapsed, load1 = time.perf_counter() - t0, os.getloadavg()
    cmd = "python -m bench.reshard " + " ".join(argv if argv is not None else sys.argv[1:])
    lines = [
        "# Re-sharded restore vs the plain same-TP restore", "",
        *br.header_lines(cmd, info, elapsed, load0, load1),
        f"Statistic: median of {args.rounds} interleaved rounds after 1 warm-up round, the order rotating every round; "
        "page cache warm (the sets were just written); Python's cyclic GC off while timing.", "",
        "Target rank 0 of TP M, real SGLang pools, every slot holding stale noise. `plain` restores the TP M set's rank 0 "
        "file (the same target bytes, checked byte for byte against the re-sharded restore in every mode, untimed); "
        "`re-sharded` restores the TP N set with `sharding=describe(model, M, 0)`. `ratio` = t(plain) / t(re-sharded) "
        "at the same `verify` (1.0 = as fast). `source bytes read`: each depended-on source section once, whole (its "
        "digest covers every byte), sliced into the slots; verify=True reads them once more before allocating, as the "
        "plain verify=True reads its file twice.", "",
        *tables(rows, strategies, modes), "", "## Targets", "", *targets(rows), "",
    ]
    br.write_report(lines, args.quick, args.out, "RESHARD.md")
    return 0


if __name__ == "__main__":
    sys.exit(main())
