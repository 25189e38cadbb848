"""hsnap-view on a 10,006-section snapshot directory: time to the first frame (the figure
with a 2 s target) and to the end of the digest scan.

    python -m bench.viewer [--repeats 5]     # prints a table; bench.run includes it

Each round is a fresh process (imports included, as a user pays them): the child reports
the wall and CPU seconds from its start to the first frame of the headless app
(160x48), and to the end of the scan. CPU seconds are the child's own, so other jobs on
a shared machine move the wall figure but hardly the CPU one.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
T_FIRST_FRAME_CPU = 2.0  # seconds


def _child(path: str) -> dict:
    t0, c0 = time.perf_counter(), time.process_time()
    import asyncio

    from hsnap_view.app import make_app
    from hsnap_view.screens.main import MainScreen
    from hsnap_view.widgets.digest_panel import DigestPanel

    out = {"import_s": time.perf_counter() - t0}

    async def run() -> None:
        app = make_app(path)
        async with app.run_test(size=(160, 48)) as pilot:
            out["first_frame_s"], out["first_frame_cpu_s"] = time.perf_counter() - t0, time.process_time() - c0
            assert isinstance(app.screen, MainScreen)
            panel = app.screen.query_one(DigestPanel)
            while panel.running or "pending" in set(panel.status.values()):
                await pilot.pause(0.02)
            out["scan_s"] = time.perf_counter() - t0 - out["first_frame_s"]
            out["sections"] = len(panel.status)
            t1 = time.perf_counter()
            await pilot.press("q")
        out["quit_s"] = time.perf_counter() - t1

    asyncio.run(run())
    return out


def build(root: str) -> str:
    sys.path.insert(0, os.path.join(REPO, "tests", "view"))
    from view_fixtures import build_big  # the snapshot the viewer's tests open

    return build_big(root)


def measure(repeats: int = 5, root: str | None = None) -> list[dict]:
    """``repeats`` fresh processes opening the 10,006-section directory."""
    with tempfile.TemporaryDirectory(prefix="hsnap-bench-view-", dir=root) as d:
        path = build(d)
        rounds = []
        for _ in range(repeats):
            p = subprocess.run([sys.executable, "-m", "bench.viewer", "--child", path], cwd=REPO, capture_output=True, text=True, check=True)
            rounds.append(json.loads(p.stdout.strip().splitlines()[-1]))
        return rounds


def rows(rounds: list[dict]) -> list[list[str]]:
    med = {k: statistics.median(r[k] for r in rounds) for k in ("import_s", "first_frame_s", "first_frame_cpu_s", "scan_s", "quit_s")}
    return [[f"{rounds[0]['sections']:,}", str(len(rounds)), f"{med['import_s']:.2f} s", f"{med['first_frame_s']:.2f} s",
             f"{med['first_frame_cpu_s']:.2f} s", f"{med['scan_s']:.2f} s", f"{med['quit_s']:.2f} s"]]


HEAD = ["sections", "rounds", "imports", "first frame (wall)", "first frame (CPU)", "digest scan (wall)", "q to exit (wall)"]


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m bench.viewer", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--child", default=None, help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.child:
        print(json.dumps(_child(args.child)))
        return 0
    rounds = measure(args.repeats)
    table = rows(rounds)
    print(" | ".join(HEAD))
    for r in table:
        print(" | ".join(r))
    cpu = statistics.median(r["first_frame_cpu_s"] for r in rounds)
    print(f"{'PASS' if cpu <= T_FIRST_FRAME_CPU else 'MISS'}  first frame <= {T_FIRST_FRAME_CPU} CPU s ({cpu:.2f})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
