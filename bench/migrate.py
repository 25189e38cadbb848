"""Downtime of moving a decoding request to another process: live migration
vs stop-and-copy vs recompute, side by side, at several committed lengths.

    .venv/bin/python -m bench.migrate [--lengths 1024,8192,32768] [--out bench/MIGRATE.md]

Two processes per length (``hsnap_testing.migration``): a source that prefills a prompt of the
length and decodes the tiny hybrid model through real SGLang pools, and a target with its own
pools (another capacity, other requests) that takes the request over three times, one method
after the other, through a local directory (fsync on):

* **live**: pre-copy rounds (a plain snapshot, then a delta of the new rows each time the target
  has applied the last round) while the source decodes on; once the target has applied every
  round and at most 4 rows are new, the source stops and writes the last delta (the tail rows, the whole GDN
  state, the record); the target has applied every round already and applies only that.
* **live-nofsync**: the same with the links written without fsync (visible to the target once
  renamed, not durable: a migration on one host needs no durability, the source keeps the request
  until its last link is written).
* **stop**: the source stops and writes one plain snapshot; the target restores all of it.
* **recompute**: the source stops and hands over the token ids; the target prefills the whole
  history again (as a token-replay migration does).

Downtime = the source's time of its last token to the target's time of its first (one clock,
CLOCK_MONOTONIC, for both processes). The first token of each method is compared with the
token the source itself decoded at that output.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
METHODS = ("live", "live-nofsync", "stop", "recompute")


def _spec(length: int, directory: str, repeats: int) -> dict:
    return {"dir": directory, "prompt_len": length, "n": length + 64, "methods": list(METHODS) * repeats, "rounds": 3, "every": 4, "tail": 2,
            "source_size": length + 4096, "target_size": length + 4096, "max_rounds": 200, "threads": 1, "timeout_s": 900, "continue": False,
            "attn_implementation": "sdpa", "prefill_chunk": 1024}


def _run(length: int, repeats: int) -> dict:
    with tempfile.TemporaryDirectory(prefix="hsnap-migrate-bench-") as d:
        spec = _spec(length, os.path.join(d, "mig"), repeats)
        path = os.path.join(d, "spec.json")
        with open(path, "w") as f:
            json.dump(spec, f)
        cmd = [sys.executable, "-m", "hsnap_testing.migration"]
        target = subprocess.Popen([*cmd, "target", "--spec", path, "--result", os.path.join(d, "t.json")], cwd=ROOT,
                                  stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
        try:
            src = subprocess.run([*cmd, "source", "--spec", path, "--result", os.path.join(d, "s.json")], cwd=ROOT,
                                 capture_output=True, text=True, timeout=1800)
            if src.returncode:
                raise SystemExit(f"source failed at {length}:\n{src.stderr[-3000:]}")
            _, err = target.communicate(timeout=1800)
            if target.returncode:
                raise SystemExit(f"target failed at {length}:\n{err[-3000:]}")
        finally:
            if target.poll() is None:
                target.kill()
                target.wait()
        with open(os.path.join(d, "s.json")) as f:
            s = json.load(f)
        with open(os.path.join(d, "t.json")) as f:
            t = json.load(f)
    runs: dict[str, list] = {m: [] for m in METHODS}
    for sm, tm in zip(s["methods"], t["methods"]):
        k = sm["outputs"]  # the target's first token is output k (0-based); the source decoded it too
        final = tm["applied"][-1] if tm["applied"] else {}
        runs[sm["method"]].append({
            "downtime_s": tm["t_first"] - sm["t_last"],
            "export_s": sm["export_s"],
            "cache_s": final.get("cache_s", 0.0),
            "first_step_s": tm["first_step_s"],
            "bytes": final.get("bytes_uploaded", 0),
            "rows": final.get("rows", 0),
            "position": sm["position"],
            "same_token": tm["token_ids"][k] == s["token_ids"][k],
            "logprob_delta": abs(tm["logprobs"][k] - s["logprobs"][k]),
            "rounds": sm["rounds"],
        })
    rows = {}
    for m, xs in runs.items():  # the migration of median downtime stands for the method
        xs.sort(key=lambda x: x["downtime_s"])
        rows[m] = dict(xs[len(xs) // 2], all_s=[x["downtime_s"] for x in xs], all_same=all(x["same_token"] for x in xs),
                       max_logprob_delta=max(x["logprob_delta"] for x in xs))
    steps = sorted(s["decode_step_s"])
    return {"length": length, "repeats": repeats, "decode_step_s": steps[len(steps) // 2], "prefill_s": s["prefill_s"], "methods": rows}


def _ms(x: float) -> str:
    return f"{x * 1e3:,.1f} ms"


def report(results: list[dict], load0, load1, wall: float) -> str:
    import torch

    lines = [
        "# Live migration downtime (bench/migrate.py)",
        "",
        f"Tiny hybrid model (Qwen3.5-style: 2 full-attention + 2 GDN layers, fp32, 1,024 B of KV per token, 21 KiB of GDN "
        f"state), decoding through real SGLang pools on CPU; source and target are two processes, 1 torch thread each, "
        f"sdpa attention; links through a local directory (fsync on but in *live, links not fsynced*). Machine: {os.cpu_count()} cores shared with other jobs; "
        f"load average {load0[0]:.1f} / {load0[1]:.1f} / {load0[2]:.1f} at the start, {load1[0]:.1f} / {load1[1]:.1f} / "
        f"{load1[2]:.1f} at the end; torch {torch.__version__}, Python {platform.python_version()}; {wall:.0f} s in all. "
        f"Each method {results[0]['repeats']} times per length, interleaved (live, live-nofsync, stop, recompute, live, ...): the median, "
        "every run's downtime in ms in brackets; the breakdown is the median run's.",
        "",
        "Downtime: the source's last token to the target's first token (CLOCK_MONOTONIC, one clock for both processes).",
        "",
        "| committed tokens | decode step (source, median) | live migration | live, links not fsynced | stop-and-copy | recompute (re-prefill) |",
        "|---:|---:|---:|---:|---:|---:|",
    ]
    for r in results:
        m = r["methods"]
        cells = [f"{_ms(m[x]['downtime_s'])} ({', '.join(f'{y * 1e3:.0f}' for y in m[x]['all_s'])})" for x in METHODS]
        lines.append(f"| {m['live']['position']:,} | {_ms(r['decode_step_s'])} | **{cells[0]}** | {cells[1]} | {cells[2]} | {cells[3]} |")
    lines += [
        "",
        "Where the downtime goes (source: writing the last link, fsync included; target: the first decode step; "
        "*cache* is this demo's own cost of turning pool rows into the transformers cache it decodes with — an engine "
        "decodes from the pools themselves; *rest* is noticing the link, opening, checking, hashing and uploading it. A link "
        "is visible once renamed, before the source's fsync of the directory returns, so the parts can overlap: *rest* "
        "may be negative):",
        "",
        "| committed tokens | method | bytes uploaded on the downtime path | rows | source: last link | target: cache | "
        "target: first step | rest | first token = source's |",
        "|---:|---|---:|---:|---:|---:|---:|---:|---|",
    ]
    for r in results:
        for name in METHODS:
            x = r["methods"][name]
            rest = x["downtime_s"] - x["export_s"] - x["cache_s"] - x["first_step_s"]
            same = ("yes" if x["all_same"] else "no") + f" (max logprob Δ {x['max_logprob_delta']:.1e})"
            lines.append(f"| {x['position']:,} | {name} | {x['bytes']:,} | {x['rows']:,} | {_ms(x['export_s'])} | {_ms(x['cache_s'])} | "
                         f"{_ms(x['first_step_s'])} | {_ms(rest)} | {same} |")
    lines += ["", "Pre-copy rounds of the median live migration (the request decodes between them; a round goes when the "
              "target has applied the last one, with the rows decoded meanwhile):", "",
              "| committed tokens | rounds | first round (plain snapshot): bytes, export | later rounds (deltas): bytes, median export |",
              "|---:|---:|---|---|"]
    for r in results:
        rounds = r["methods"]["live"]["rounds"]
        later = sorted(x["export_s"] for x in rounds[1:])
        tail = f"{rounds[1]['payload_bytes']:,} B, {_ms(later[len(later) // 2])}" if later else "-"
        lines.append(f"| {r['methods']['live']['position']:,} | {len(rounds)} | {rounds[0]['payload_bytes']:,} B, {_ms(rounds[0]['export_s'])} | {tail} |")
    lines += [
        "",
        "Reading: the live migration's downtime path carries the rows decoded since the last round (4 here), the whole "
        "GDN state and the record, whatever the length; the target has applied every earlier round into its pools "
        "before the source stops. What grows with the length is stop-and-copy (the whole KV written, read, hashed and "
        "uploaded; and this demo's cache rebuild) and recompute (the prefill: attention quadratic). The tiny model's "
        "GDN state is 21 KiB; a real hybrid's is larger (30.7 MiB per TP-2 rank of Qwen3.5-35B-A3B) and is on the "
        "downtime path whatever is pre-copied — bench/CHAIN.md times that delta's export (64 rows + the state).",
        "",
        "Across TP sizes (a TP N source's links as TP sets, each target rank re-sharding every link as it applies it): "
        "`python -m bench.migrate_tp`, bench/MIGRATE_TP.md — the final link's apply and bytes at 1k / 8k tokens with the "
        "Qwen3.5-35B-A3B geometry, against a stop-and-copy re-sharded restore.",
    ]
    return "\n".join(lines) + "\n"


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--lengths", default="1024,8192,32768")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--out", default=os.path.join(os.path.dirname(__file__), "MIGRATE.md"))
    args = ap.parse_args(argv)
    load0, t0 = os.getloadavg(), time.monotonic()
    results = []
    for length in (int(x) for x in args.lengths.split(",")):
        results.append(_run(length, args.repeats))
        print(json.dumps({k: v for k, v in results[-1].items()}, default=str)[:600], flush=True)
    load1, wall = os.getloadavg(), time.monotonic() - t0
    with open(os.path.splitext(args.out)[0] + ".json", "w") as f:  # the raw figures, to read the report against
        json.dump({"load": [load0, load1], "wall_s": wall, "results": results}, f, indent=1)
    text = report(results, load0, load1, wall)
    with open(args.out, "w") as f:
        f.write(text)
    print(text)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
