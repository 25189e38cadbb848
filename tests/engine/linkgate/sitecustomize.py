"""Test seam of the checkpoint link writer, loaded only by servers a test starts with this folder on PYTHONPATH
(``linkgate_env``): once ``hsnap_sglang.jobs`` is imported, its ``LinkWriter.before_write`` holds every link
whose ``<HSNAP_TEST_LINK_GATE>/<file name>.hold`` exists until the file is removed, saying so (``.held``; and
``.export-waiting`` once an export of the request waits for this link).  Production code never reads the gate."""

import importlib.abc
import importlib.machinery
import os
import sys
import time

GATE = os.environ.get("HSNAP_TEST_LINK_GATE")
TARGET = "hsnap_sglang.jobs"


def _hold(writer, job) -> None:
    hold = os.path.join(GATE, os.path.basename(job.ex.path) + ".hold")
    said: set[str] = set()
    while os.path.exists(hold):
        for tag, now in (("held", True), ("export-waiting", writer.export_waiting == job.ex.rid)):
            if now and tag not in said:
                open(hold[: -len(".hold")] + "." + tag, "w").close()
                said.add(tag)
        time.sleep(0.01)


class _Finder(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path, target=None):
        if name != TARGET:
            return None
        spec = importlib.machinery.PathFinder.find_spec(name, path)
        if spec is None or spec.loader is None:
            return None
        run = spec.loader.exec_module

        def exec_module(module):
            run(module)
            module.LinkWriter.before_write = _hold

        spec.loader.exec_module = exec_module
        return spec


if GATE:
    sys.meta_path.insert(0, _Finder())
