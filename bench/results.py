"""Where a bench's report goes: printed, and written to ``bench/<NAME>.md`` unless the caller names another file
(``--results PATH``) or none (``--results ''``)."""

from __future__ import annotations

import os

BENCH_DIR = os.path.dirname(os.path.abspath(__file__))


def publish(text: str, results: str | None, default_name: str) -> None:
    """Print ``text``; write it to ``results`` (None: ``bench/<default_name>``; ``''``: nowhere) and say where."""
    print(text)
    path = os.path.join(BENCH_DIR, default_name) if results is None else results
    if path:
        with open(path, "w") as f:
            f.write(text + "\n")
        print(f"\nwrote {path}")
