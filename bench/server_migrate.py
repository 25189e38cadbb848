"""Live migration between two running SGLang servers: the client's downtime — the last
token the source streamed to the first token the target streams — against stop-and-copy and recompute, side by side.

    python -m bench.server_migrate                        # 1k / 8k committed tokens (32k as far as --budget allows)
    python -m bench.server_migrate --sizes 1024 --rounds 1
    python -m bench.server_migrate --tp 2,1               # a TP 2 source, a TP 1 target (bench/SERVER_MIGRATE_TP2-1.md)

Two real servers (``python -m hsnap_sglang.serve --enable-hsnap``: SGLang's ``launch_server`` with the plug-in on
hsnap's CPU platform; the tiny random-weight Qwen3-Next of ``hsnap_sglang.tiny``, bfloat16, radix cache on, chunked
prefill in 1,024-token chunks); the migration container is a local directory (both servers on this machine).  For
each size n (committed positions of the request x when it moves: a prompt of n - K + 1 tokens, K outputs) and round,
the three methods in turn, each on a fresh x:

* **live** (``client.move``: ``/hsnap/follow`` on the target, ``/hsnap/migrate`` on the source): pre-copy rounds
  while x decodes, then the tail rows + recurrent state + record;
* **stop-and-copy**: ``/hsnap/export`` on the source (the whole snapshot, x released), then ``/hsnap/resume`` on
  the target;
* **recompute**: x aborted on the source, its history (prompt + outputs) sent to the target as a new ``/generate``
  (re-prefill; the target's radix cache flushed first).

Downtime is measured by the client, one clock: the arrival of the source stream's last token event to the arrival
of the target stream's first event with a new token.  The server-side parts of a live migration come from both
servers' reports (CLOCK_MONOTONIC, one clock on one machine).  Writes bench/SERVER_MIGRATE.md.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import tempfile
import time
import zlib
from pathlib import Path

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if REPO not in sys.path:
    sys.path.insert(0, REPO)

from bench.results import publish  # noqa: E402
from hsnap_sglang import client  # noqa: E402
from hsnap_sglang.demo import DemoServer, Stream, abort, flush_cache, payload, prompt_ids, server_args, server_env  # noqa: E402

SIZES = (1024, 8192, 32768)
K = 16  # outputs before the move
AFTER = 24  # outputs after it (on the target)
CAPACITY = {"--max-total-tokens": "81920", "--max-mamba-cache-size": "16", "--max-running-requests": "4"}
METHODS = ("live", "stop-and-copy", "recompute")


def _decode_step(s: Stream) -> float:
    gaps = [b - a for a, b in zip(s.times[1:], s.times[2:])]
    return statistics.median(gaps) if gaps else float("nan")


def one(src: str, dst: str, method: str, n: int, tag: str, d: Path) -> dict:
    rid = f"x-{method}-{tag}"
    ids = prompt_ids(zlib.crc32(tag.encode()), max(1, n - K + 1))
    flush_cache(src)
    flush_cache(dst)
    x = Stream(src, payload(rid, K + AFTER, ids=ids))
    x.start()
    x.wait_tokens(K)
    first: list[float] = []

    def on_chunk(r, text, new_ids, event):
        if new_ids and not first:
            first.append(time.monotonic())

    out: dict = {"method": method, "n": n}
    if method == "live":
        mig = client.move(src, dst, rid, str(d / f"mig-{tag}"), tail=4, timeout_s=300, last_source_event_at=x.last_token_at)
        x.finish()
        s, t = mig.source, mig.run.info
        out.update(downtime_s=mig.downtime_s, committed=s["committed_positions"], rounds=len(s["rounds"]), precopy_bytes=s["precopy_bytes"],
                   first_round_bytes=s["rounds"][0]["bytes"], final_rows=s["final_rows"], final_bytes=s["final_bytes"],
                   source_final_s=s["timings"]["final_capture_s"] + s["timings"]["final_write_s"],
                   target_final_apply_s=t["timings"]["final_apply_s"],
                   stop_to_applied_s=t["timings"]["final_applied_at"] - s["timings"]["stopped_at"],
                   applied_to_admitted_s=t["timings"]["admitted_at"] - t["timings"]["final_applied_at"],
                   admitted_to_first_token_s=mig.first_target_event_at - t["timings"]["admitted_at"],
                   uploaded_final=t["links"][-1]["bytes_uploaded"], tokens=mig.run.output_ids)
    elif method == "stop-and-copy":
        path = d / f"stop-{tag}.hsnap"
        rep = client.pause(src, rid, str(path))
        x.finish()
        last = x.last_token_at()
        run = client.resume(dst, str(path), on_chunk=on_chunk)
        out.update(downtime_s=first[0] - last, committed=rep["committed_positions"], bytes=rep["bytes"],
                   uploaded=run.info["result"]["bytes_uploaded"], tokens=run.output_ids)
    else:
        abort(src, rid)  # the request stops; the target recomputes what the client has
        x.finish()
        last = x.last_token_at()
        history = ids + list(x.final.get("output_ids") or [])
        y = Stream(dst, payload(rid + "-re", AFTER, ids=history))
        y.start()
        y.wait_tokens(1)
        y.finish()
        out.update(downtime_s=y.times[0] - last, committed=len(history), tokens=None)
    out["decode_step_s"] = _decode_step(x)
    return out


def fmt(s) -> str:
    if s is None or s != s:
        return "–"
    return f"{s * 1e3:,.1f} ms" if s < 10 else f"{s:,.2f} s"


# what the last column means when the TP sizes differ (the correctness of a cross-TP continuation is proved in float32
# against transformers: tests/engine/test_hsnap_mamba2_tp2.py)
CROSS_TP_TOKENS = ("Across TP sizes the last column compares two runs that switch from the source's numerics to the target's at "
                   "different positions (the live one a step or two later: committed tokens differ by that): in bfloat16 a TP 2 "
                   "and a TP 1 forward round differently (the all-reduce sums in another order), so on this random-weight model, "
                   "whose next-token choices are near ties, the two may part after the switch (\"no\") without either being wrong. "
                   "Each continuation's own correctness: tests/engine/test_hsnap_mamba2_tp2.py (float32, every token and logprob "
                   "against transformers, 2 -> 1 and 1 -> 2).")


def report(results: list[dict], skipped: dict, args, wall: float, ready: list[float], load0, load1) -> str:
    tps, tpd = args.tp
    title = "" if (tps, tpd) == (1, 1) else f", TP {tps} → TP {tpd}"
    lines = [f"# Live migration between two SGLang servers{title} (python -m bench.server_migrate{' --tp %d,%d' % (tps, tpd) if title else ''})", "",
             f"Machine: {platform.machine()}, {os.cpu_count()} cores; load average {load0[0]:.1f} at the start, {load1[0]:.1f} at the end; "
             f"{wall:.0f} s in all; servers ready after {ready[0]:.1f} s and {ready[1]:.1f} s  ",
             "Servers: `python -m hsnap_sglang.serve --enable-hsnap` (SGLang's launch_server, hsnap's CPU platform), tiny random-weight "
             "qwen3_next (2 attention + 2 GDN layers), bfloat16, radix cache on, chunked prefill 1,024; the migration container a local "
             "directory, links not fsynced (`fsync: false`, the default: the target reads them at once)"
             + (f"; the source at TP {tps}, the target at TP {tpd} (each rank on its own core range: on this machine two "
                "servers' ranks share 2 cores; at TP > 1 each link is a TP set written in lockstep on the source's scheduler "
                "thread, a target of another TP size re-shards it)" if title else "") + ".  ",
             f"Per round and method a fresh request x: {K} outputs on the source, then moved, {AFTER} more on the target; nothing else runs. "
             "Downtime: the client's gap from the source's last token event to the target's first (one clock). Median over the rounds, "
             "every round in brackets.", "",
             "| committed tokens | decode step (source) | live migration | stop-and-copy | recompute (re-prefill) | live: same tokens as stop-and-copy |",
             "|---:|---:|---:|---:|---:|---|"]
    sizes = sorted({r["n"] for r in results})
    for n in sizes:
        rs = [r for r in results if r["n"] == n]
        by = {m: [r for r in rs if r["method"] == m] for m in METHODS}
        cell = {m: (f"**{fmt(statistics.median(r['downtime_s'] for r in by[m]))}** ({', '.join(fmt(r['downtime_s']) for r in by[m])})"
                    if by[m] else "–") for m in METHODS}
        same = all(a["tokens"] == b["tokens"] for a, b in zip(by["live"], by["stop-and-copy"])) if by["live"] and by["stop-and-copy"] else None
        step = statistics.median(r["decode_step_s"] for r in rs)
        committed = by["live"][0]["committed"] if by["live"] else n
        lines.append(f"| {committed:,} | {fmt(step)} | {cell['live']} | {cell['stop-and-copy']} | {cell['recompute']} | "
                     f"{'yes' if same else 'no' if same is not None else '–'} |")
    for n, why in skipped.items():
        lines.append(f"| {n:,} | {why} | | | | |")
    if tps != tpd:
        lines += ["", CROSS_TP_TOKENS]
    lines += ["", "Where the live migration's downtime goes (median round): the source stops x at a committed boundary and writes the "
              "final link (tail rows + GDN state + record); the target notices it, checks, hashes and uploads it, binds the Req; the HTTP "
              "process registers the client's state and admits it; the first decode step streams:", "",
              "| committed tokens | pre-copy rounds | pre-copy bytes (first round) | final link: rows, bytes | source: stop → final committed | "
              "stop → applied on target | target: apply final | applied → admitted | admitted → first token |",
              "|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for n in sizes:
        live = sorted((r for r in results if r["n"] == n and r["method"] == "live"), key=lambda r: r["downtime_s"])
        if not live:
            continue
        r = live[len(live) // 2]
        lines.append(f"| {r['committed']:,} | {r['rounds']} | {r['precopy_bytes']:,} ({r['first_round_bytes']:,}) | {r['final_rows']}, "
                     f"{r['final_bytes']:,} | {fmt(r['source_final_s'])} | {fmt(r['stop_to_applied_s'])} | {fmt(r['target_final_apply_s'])} | "
                     f"{fmt(r['applied_to_admitted_s'])} | {fmt(r['admitted_to_first_token_s'])} |")
    lines += ["", "Raw rounds (JSON):", "", "```json", json.dumps([{k: v for k, v in r.items() if k != "tokens"} for r in results], sort_keys=True), "```"]
    return "\n".join(lines)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m bench.server_migrate", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--sizes", type=lambda v: [int(x) for x in v.split(",")], default=list(SIZES))
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--budget", type=float, default=600.0, help="seconds in all, server starts included (default 600)")
    ap.add_argument("--tp", type=lambda v: tuple(int(x) for x in v.split(",")), default=(1, 1), metavar="SRC,DST",
                    help="the source's and the target's TP sizes (default 1,1)")
    ap.add_argument("--results", default=None, help="markdown output (default bench/SERVER_MIGRATE.md, at other TP sizes "
                    "bench/SERVER_MIGRATE_TP<src>-<dst>.md; '' for none)")
    args = ap.parse_args(argv)
    if len(args.tp) != 2 or min(args.tp) < 1:
        ap.error("--tp takes two sizes: SRC,DST")
    t_start = time.monotonic()
    load0 = os.getloadavg()

    def log(msg: str) -> None:
        print(f"[{time.monotonic() - t_start:6.1f}s] {msg}", file=sys.stderr, flush=True)

    from hsnap_sglang.tiny import build_model_dir

    results: list[dict] = []
    skipped: dict = {}
    with tempfile.TemporaryDirectory(prefix="hsnap-bench-migrate-") as tmp:
        d = Path(tmp)
        model = build_model_dir(d / "model")
        sargs = [a if a != "128" else "1024" for a in server_args(CAPACITY)]  # 1,024-token prefill chunks
        def env_at(tp: int) -> dict:
            env = server_env(root=d)
            if tp > 1:  # the TP 1 core binding of the demo's environment: serve binds one core range per rank
                env.pop("SGLANG_CPU_OMP_THREADS_BIND", None)
            return env

        tp_args = [[] if n == 1 else ["--tp", str(n)] for n in args.tp]
        src = DemoServer("source", model, d / "source.log", sargs + tp_args[0], env_at(args.tp[0]))
        dst = DemoServer("target", model, d / "target.log", sargs + tp_args[1], env_at(args.tp[1]))
        try:
            import threading

            failed: list[BaseException] = []

            def start(server) -> None:
                try:
                    server.start(420.0)
                except BaseException as e:  # noqa: BLE001 - raised below, once both have ended
                    failed.append(e)

            ts = [threading.Thread(target=start, args=(s,)) for s in (src, dst)]
            for t in ts:
                t.start()
            for t in ts:
                t.join()
            if failed:
                raise failed[0]
            log(f"servers ready after {src.ready_s:.1f} s / {dst.ready_s:.1f} s")
            for m in METHODS:  # warm-up (the first export of a process hashes the model directory)
                one(src.url, dst.url, m, 64, f"warm-{m}", d)
            rate = None
            for n in sorted(args.sizes):
                left = args.budget - (time.monotonic() - t_start)
                projected = None if rate is None else rate * n * 1.3
                if projected is not None and projected + 5 > left:
                    skipped[n] = f"skipped: a round projected at ~{fmt(projected)}, {fmt(max(left, 0))} of budget left"
                    log(f"{n}: {skipped[n]}")
                    continue
                for i in range(args.rounds):
                    t = time.monotonic()
                    for m in METHODS:
                        r = one(src.url, dst.url, m, n, f"{n}-{i}", d)
                        results.append(r)
                        log(f"{n} {m}: downtime {fmt(r['downtime_s'])} (decode step {fmt(r['decode_step_s'])})")
                    rate = (time.monotonic() - t) / n
        finally:
            src.stop()
            dst.stop()
        text = report(results, skipped, args, time.monotonic() - t_start, [src.ready_s or 0, dst.ready_s or 0], load0, os.getloadavg())
    publish(text, args.results, "SERVER_MIGRATE.md" if args.tp == (1, 1) else f"SERVER_MIGRATE_TP{args.tp[0]}-{args.tp[1]}.md")
    return 0


if __name__ == "__main__":
    sys.exit(main())
