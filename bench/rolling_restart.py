"""A rolling restart with hsnap, measured: ``kill -TERM old; start new`` with R requests decoding.

    python -m bench.rolling_restart                 # 4 requests of 400 tokens
    python -m bench.rolling_restart --requests 4 --tokens 400 --results ''

Two real servers (``python -m hsnap_sglang.serve --enable-hsnap``, hsnap's CPU platform, the tiny Qwen3-Next of
``hsnap_sglang.tiny``): the old one with ``HSNAP_DRAIN_ON_SIGTERM=restart``, the new one with
``HSNAP_RESUME_ON_START=restart``.  R clients stream through ``hsnap_sglang.client.generate(old, next_url=new)``;
once every request has decoded a tenth of its tokens the old server gets SIGTERM, and the new one is started when
the old one has exited.  Measured (client side, one clock): requests lost (a run that does not end by its length
with every token, or whose tokens differ from an uninterrupted run of the same batch in the new server); SIGTERM ->
the last request durable (its stream's hand-off event); SIGTERM -> the old server's exit; the new server's start ->
ready; the new server's start -> every request decoding again (its first token after the hand-off).  The start of a
server is mostly SGLang's own (imports, model load): beside it hsnap's share is the resume of the directory.
Writes bench/ROLLING.md (``--results`` to change, ``''`` for none).
"""

from __future__ import annotations

import argparse
import os
import signal
import sys
import tempfile
import threading
import time
from pathlib import Path

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if REPO not in sys.path:
    sys.path.insert(0, REPO)

from bench.results import publish  # noqa: E402
from hsnap_sglang import client  # noqa: E402
from hsnap_sglang.demo import DemoServer, Stream, payload, prompt_ids, server_args, server_env  # noqa: E402

CAPACITY = {"--max-total-tokens": "8192", "--max-mamba-cache-size": "16", "--max-running-requests": "5"}  # 3 Mamba slots a request


class Client(threading.Thread):
    """One request streamed through client.generate; when each thing happened."""

    def __init__(self, old: str, new: str, rid: str, ids: list[int], n: int) -> None:
        super().__init__(daemon=True)
        self.old, self.new, self.rid, self.ids, self.n = old, new, rid, ids, n
        self.tokens, self.handed_off_at, self.back_at, self.result, self.error = 0, None, None, None, None

    def chunk(self, rid: str, text: str, ids: list, event: dict) -> None:
        now = time.monotonic()
        self.tokens += len(ids)
        if ((event.get("meta_info") or {}).get("finish_reason") or {}).get("type") == client.HAND_OFF:
            self.handed_off_at = now
        elif ids and self.handed_off_at is not None and self.back_at is None:
            self.back_at = now

    def run(self) -> None:
        try:
            self.result = client.generate(self.old, payload(self.rid, self.n, ids=self.ids), next_url=self.new, on_chunk=self.chunk, wait_s=600)
        except Exception as e:  # noqa: BLE001 - reported
            self.error = e


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m bench.rolling_restart", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--requests", type=int, default=4)
    ap.add_argument("--tokens", type=int, default=400)
    ap.add_argument("--results", default=None, help="markdown output (default bench/ROLLING.md; '' for none)")
    args = ap.parse_args(argv)
    if not 1 <= args.requests <= 5:
        ap.error("--requests: 1..5 (the servers run 5 at once)")
    from hsnap_sglang.tiny import build_model_dir

    with tempfile.TemporaryDirectory(prefix="hsnap-bench-rolling-") as tmp:
        d = Path(tmp)
        model = build_model_dir(d / "model")
        old = DemoServer("old", model, d / "old.log", server_args(CAPACITY), {**server_env(root=d), "HSNAP_DRAIN_ON_SIGTERM": "restart"})
        new = DemoServer("new", model, d / "new.log", server_args(CAPACITY), {**server_env(root=d), "HSNAP_RESUME_ON_START": "restart"})
        prompts = {f"roll-{i}": prompt_ids(200 + i, 20) for i in range(args.requests)}
        try:
            old.start(420.0)
            clients = [Client(old.url, new.url, rid, ids, args.tokens) for rid, ids in prompts.items()]
            for c in clients:
                c.start()
            deadline = time.monotonic() + 300
            while min(c.tokens for c in clients) < args.tokens // 10:
                if time.monotonic() > deadline:
                    raise SystemExit("the requests did not start decoding in 300 s")
                time.sleep(0.01)
            t_term = time.monotonic()
            old.proc.send_signal(signal.SIGTERM)
            old.proc.wait(timeout=300)
            t_exit = time.monotonic()
            t_spawn = time.monotonic()
            new.start(420.0)
            t_ready = time.monotonic()
            for c in clients:
                c.join(900)
            refs = {rid: Stream(new.url, payload(f"{rid}-ref", args.tokens, ids=ids)) for rid, ids in prompts.items()}
            for st in refs.values():  # one batch, uninterrupted: the reference of every request
                st.start()
            ref_ids = {rid: (st.finish().final or {}).get("output_ids") for rid, st in refs.items()}
        finally:
            old.stop()
            new.stop()
    lost = [c.rid for c in clients if c.result is None or (c.result.finish_reason or {}).get("type") != "length"
            or c.result.output_ids != ref_ids[c.rid]]
    durable = max((c.handed_off_at or float("nan")) for c in clients) - t_term
    back = max((c.back_at or float("nan")) for c in clients) - t_spawn
    rows = [("requests decoding at SIGTERM", f"{args.requests} x {args.tokens} tokens"),
            ("requests lost (not ended by length, or tokens differ from an uninterrupted run)", f"{len(lost)} {lost if lost else ''}".strip()),
            ("SIGTERM -> the last request durable (its hand-off event)", f"{durable * 1e3:.0f} ms"),
            ("SIGTERM -> the old server exited", f"{(t_exit - t_term):.1f} s"),
            ("the new server's start -> ready (/health)", f"{(t_ready - t_spawn):.1f} s"),
            ("the new server's start -> every request decoding again", f"{back:.1f} s"),
            ("hand-offs per request", ", ".join(f"{c.rid}: {len(c.result.hand_offs) if c.result else c.error!r}" for c in clients))]
    text = "\n".join(["# Rolling restart (bench/rolling_restart.py)", "",
                      f"Machine: {os.cpu_count()} cores, load {os.getloadavg()[0]:.1f}; the tiny Qwen3-Next, hsnap's CPU platform.", "",
                      "| what | figure |", "|---|---|", *[f"| {a} | {b} |" for a, b in rows], ""])
    publish(text, args.results, "ROLLING.md")
    return 0 if not lost else 1


if __name__ == "__main__":
    sys.exit(main())
