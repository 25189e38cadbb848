"""What periodic checkpoints cost the request they protect: its inter-token time with and without
``POST /hsnap/checkpoint`` every M output tokens (goal: at most 2 % more, DéjàVu's figure).

    python -m bench.checkpoint                       # M = 16 and 64, 3 rounds, 192 output tokens
    python -m bench.checkpoint --every 16,64 --rounds 2 --tokens 128 --budget 300

One real server (``python -m hsnap_sglang.serve --enable-hsnap``, hsnap's CPU platform, the tiny random-weight
Qwen3-Next of ``hsnap_sglang.tiny``, bfloat16, radix cache on, overlap scheduler off).  Per round and mode (no
checkpoints, then each M, interleaved so that a drift of the machine's load touches every mode alike): one greedy
request of ``--tokens`` outputs streams alone; in the checkpointed modes its checkpoints are switched on after 2 tokens
(a plain link, then a delta every M tokens: hsnap_format.checkpoints).  Measured:

* the client's inter-token gaps of the request from its 4th token on (mean, median, p99, max);
* the scheduler's own time writing the links (``/hsnap/stats`` ``checkpoints.<rid>.write_s``, read just before the
  request ends), against the decode time of the same span: the overhead the request pays, free of the client's noise.

Writes bench/CHECKPOINT.md (``--results`` to change, ``--results ''`` for none).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import platform
import statistics
import sys
import tempfile
import time
from pathlib import Path

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if REPO not in sys.path:
    sys.path.insert(0, REPO)

from hsnap_sglang import client  # noqa: E402
from hsnap_sglang.demo import DemoServer, Stream, flush_cache, payload, prompt_ids, server_args, server_env  # noqa: E402

CAPACITY = {"--max-total-tokens": "8192", "--max-mamba-cache-size": "8", "--max-running-requests": "4"}
PROMPT = 64
SKIP = 3  # gaps before the checkpoints start (and the first link) are left out of every mode


def one_run(url: str, every: int | None, n: int, tag: str, d: Path) -> dict:
    rid = f"x-{tag}"
    flush_cache(url)
    x = Stream(url, payload(rid, n, ids=prompt_ids(7, PROMPT)))
    x.start()
    x.wait_tokens(2)
    first = None
    if every:
        first = client.checkpoint(url, rid, str(d / tag), every=every)
    x.wait_tokens(max(SKIP + 2, n - 4))
    state = client.stats(url)["checkpoints"].get(rid) if every else None
    x.finish()
    times = x.times
    # one event per output token (no stream interval here): the gaps from the SKIP-th token on
    gaps = [b - a for a, b in zip(times[SKIP:], times[SKIP + 1:])]
    span = times[-1] - times[SKIP]
    out = {"every": every, "tokens": len(times), "gaps": gaps, "span_s": span}
    if every:
        first_write = float(first["timings"]["write_s"])
        out.update(links=state["links"], write_s=state["write_s"], periodic_write_s=state["write_s"] - first_write,
                   writer_s=state.get("writer_s", 0.0), merged=state.get("merged", 0),
                   first_link_output=first["output_tokens"], link_bytes=sorted(p.stat().st_size for p in (d / tag).iterdir()))
    return out


def fmt_ms(s: float) -> str:
    return f"{s * 1e3:.2f} ms"


def summarize(runs: list[dict]) -> dict:
    gaps = sorted(g for r in runs for g in r["gaps"])
    return {"n": len(gaps), "mean": statistics.fmean(gaps), "median": statistics.median(gaps),
            "p99": gaps[min(len(gaps) - 1, int(0.99 * len(gaps)))], "max": gaps[-1]}


def report(results: dict, args, srv: DemoServer, wall: float, load0, load1) -> str:
    import torch

    out = ["# Periodic checkpoints: what they cost the running request (python -m bench.checkpoint)", ""]
    out.append(f"Machine: {platform.processor() or platform.machine()}, {len(os.sched_getaffinity(0))} cores usable, shared with other "
               f"jobs; torch {torch.__version__}; load average {load0[0]:.1f} / {load0[1]:.1f} / {load0[2]:.1f} at the start, "
               f"{load1[0]:.1f} / {load1[1]:.1f} / {load1[2]:.1f} at the end; {wall:.0f} s in all  ")
    out.append(f"Server: `python -m hsnap_sglang.serve --enable-hsnap`, tiny random-weight Qwen3-Next, bfloat16, radix cache on, "
               f"overlap scheduler off, {' '.join(f'{k} {v}' for k, v in CAPACITY.items())}; ready after {srv.ready_s:.1f} s  ")
    out.append(f"Per run: one greedy request alone, {PROMPT} prompt tokens, {args.tokens} output tokens; checkpoints switched on after "
               f"2 tokens; gaps from token {SKIP + 1} on; {args.rounds} rounds per mode, modes interleaved. Links: plain, then a "
               "delta of the link before every M tokens: captured (new rows, recurrent state, record: host copies) in the scheduler loop, "
               "written, fsynced and renamed by the scheduler's link writer thread.")
    out.append("")
    base = summarize(results["none"])
    head = ["mode", "gaps", "mean gap", "median", "p99", "max", "client: mean vs none", "links / run", "scheduler write per link",
            "link writes / span of the run", "write per link / (M x median gap without)", "writer thread per link", "merged / run"]
    rows = [["no checkpoints", str(base["n"]), fmt_ms(base["mean"]), fmt_ms(base["median"]), fmt_ms(base["p99"]), fmt_ms(base["max"]),
             "", "", "", "", "", "", ""]]
    for key, runs in results.items():
        if key == "none":
            continue
        s = summarize(runs)
        links = [r["links"] - 1 for r in runs]  # the periodic ones (the first link is written before the span)
        per_link = [r["periodic_write_s"] / max(1, r["links"] - 1) for r in runs]
        frac = [r["periodic_write_s"] / r["span_s"] for r in runs]
        rows.append([f"every {key} tokens", str(s["n"]), fmt_ms(s["mean"]), fmt_ms(s["median"]), fmt_ms(s["p99"]), fmt_ms(s["max"]),
                     f"{(s['mean'] / base['mean'] - 1) * 100:+.1f} %", f"{statistics.median(links):.0f}",
                     fmt_ms(statistics.median(per_link)), f"{statistics.median(frac) * 100:.2f} % (max {max(frac) * 100:.2f} %)",
                     f"{statistics.median(per_link) / (int(key) * base['median']) * 100:.1f} %",
                     fmt_ms(statistics.median(r["writer_s"] / max(1, r["links"]) for r in runs)),
                     f"{statistics.median(r['merged'] for r in runs):.0f}"])
    w = [max(len(r[i]) for r in [head] + rows) for i in range(len(head))]
    out.append("| " + " | ".join(h.ljust(w[i]) for i, h in enumerate(head)) + " |")
    out.append("|" + "|".join("-" * (x + 2) for x in w) + "|")
    out += ["| " + " | ".join(c.ljust(w[i]) for i, c in enumerate(r)) + " |" for r in rows]
    out.append("")
    out.append("*client: mean vs none* compares the request's mean inter-token gap with the no-checkpoint runs of the same "
               "session (client side: HTTP, the load of a shared machine included). *scheduler: link writes / decode time* is the "
               "scheduler's own time on the periodic links (the capture at the boundary; the writer thread's time is the "
               "*writer thread per link* column, off the decode path) (the decode of the request waits that long) over the client's "
               "span of the same tokens: the overhead free of the client's noise, but against decode steps slowed by the machine's "
               "load. The last column sets the median link write against M decode steps of the median gap without checkpoints "
               "(the least loaded steps): the overhead of a request decoding at that pace. Goal: at most 2 %.")
    out.append("")
    out.append("Raw runs (gaps in seconds): the JSON file beside this one (`CHECKPOINT.json` for the default output).")
    return "\n".join(out)


READING = "## Reading"


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m bench.checkpoint", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--every", type=lambda v: [int(x) for x in v.split(",")], default=[16, 64])
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--tokens", type=int, default=192)
    ap.add_argument("--budget", type=float, default=900.0, help="seconds in all, server start included; rounds stop when spent")
    ap.add_argument("--model-dir", default=None)
    ap.add_argument("--results", default=None, help="markdown output (default bench/CHECKPOINT.md; '' for none)")
    args = ap.parse_args(argv)
    if args.tokens < 32 or any(m < 1 for m in args.every):
        ap.error("--tokens >= 32, --every >= 1")
    t_start = time.monotonic()
    load0 = os.getloadavg()

    def log(msg: str) -> None:
        print(f"[{time.monotonic() - t_start:6.1f}s] {msg}", file=sys.stderr, flush=True)

    from hsnap_sglang.tiny import build_model_dir

    results: dict[str, list] = {"none": [], **{str(m): [] for m in args.every}}
    with tempfile.TemporaryDirectory(prefix="hsnap-bench-checkpoint-") as tmp:
        d = Path(tmp)
        model = build_model_dir(args.model_dir or d / "model", arch="qwen3_next")
        srv = DemoServer("bench", model, d / "server.log", server_args(CAPACITY), server_env(root=d))
        try:
            srv.start(420.0)
            log(f"server ready after {srv.ready_s:.1f} s")
            one_run(srv.url, args.every[0], 32, "warmup", d)  # the first export hashes the model directory
            for i in range(args.rounds):
                for key in results:
                    t = time.monotonic()
                    r = one_run(srv.url, None if key == "none" else int(key), args.tokens, f"{key}-{i}", d)
                    results[key].append(r)
                    log(f"round {i} {key}: mean gap {fmt_ms(statistics.fmean(r['gaps']))}"
                        + (f", {r['links']} links, {fmt_ms(r['periodic_write_s'])} writing" if key != "none" else "")
                        + f" ({time.monotonic() - t:.1f} s)")
                if time.monotonic() - t_start > args.budget:
                    log("budget spent")
                    break
        finally:
            srv.stop()
        text = report(results, args, srv, time.monotonic() - t_start, load0, os.getloadavg())
    print(text)
    results_path = os.path.join(REPO, "bench", "CHECKPOINT.md") if args.results is None else args.results
    if results_path:
        kept = ""  # a hand-written "## Reading" section after the generated part survives a rerun
        with contextlib.suppress(FileNotFoundError), open(results_path) as f:
            old = f.read()
            kept = old[old.index(READING):] if READING in old else ""
        with open(results_path, "w") as f:
            f.write(text + "\n" + ("\n" + kept if kept else ""))
        with open(os.path.splitext(results_path)[0] + ".json", "w") as f:
            json.dump(results, f, sort_keys=True)
        print(f"\nwrote {results_path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
