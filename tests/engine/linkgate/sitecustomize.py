"""Test seam of the off-thread jobs, loaded only by servers a test starts with this folder on PYTHONPATH
(``linkgate_env``): once ``hsnap_sglang.jobs`` is imported, its ``LinkWriter.before_write`` holds every link
whose ``<HSNAP_TEST_LINK_GATE>/<file name>.hold`` exists until the file is removed, saying so (``.held``; and
``.export-waiting`` once an export of the request waits for this link); once ``hsnap_sglang.req`` is, its
``prove_resume`` (a resume's proof, run off the scheduler thread) holds a resume of ``<file name>`` alike
(``.held``); once ``hsnap_sglang.retract`` is, its ``prove_retracted`` holds the proof of a retracted request's file
while ``<file name>.prove.hold`` exists (``.prove.held``: the link writer's gate holds the same file's write); once
``hsnap_io.migrate`` is, ``MigrationTarget.prove`` holds a followed migration's link of that name alike.  Production
code never reads the gate."""

import os
import sys
import time

from hsnap_testing.seams import AfterImport

GATE_ENV = "HSNAP_TEST_LINK_GATE"
TARGET = "hsnap_sglang.jobs"


def _gate() -> str:
    """The gate folder of this server, read when a job looks (not at import): a server forked from a test zygote
    (hsnap_testing.server_zygote) imported this module in the zygote, which an earlier server with another gate
    started."""
    return os.environ.get(GATE_ENV, "")


def _hold(writer, job) -> None:
    hold = os.path.join(_gate(), os.path.basename(job.ex.path) + ".hold")
    said: set[str] = set()
    while os.path.exists(hold):
        for tag, now in (("held", True), ("export-waiting", job.ex.rid in writer.exports_waiting)):
            if now and tag not in said:
                open(hold[: -len(".hold")] + "." + tag, "w").close()
                said.add(tag)
        time.sleep(0.01)


def _held_proof(proof, tag: str = ""):
    def prove(path, *args, **kwargs):
        hold = os.path.join(_gate(), os.path.basename(os.fspath(path)) + tag + ".hold")
        if os.path.exists(hold):
            open(hold[: -len(".hold")] + ".held", "w").close()
            while os.path.exists(hold):
                time.sleep(0.01)
        return proof(path, *args, **kwargs)

    return prove


def _install_jobs(module) -> None:
    module.LinkWriter.before_write = _hold


def _install_req(module) -> None:
    module.prove_resume = _held_proof(module.prove_resume)


def _install_retract(module) -> None:
    module.prove_retracted = _held_proof(module.prove_retracted, ".prove")


def _install_migrate(module) -> None:
    held = _held_proof(lambda path, target, *args, **kwargs: prove(target, path, *args, **kwargs), ".prove")
    prove = module.MigrationTarget.prove
    module.MigrationTarget.prove = lambda self, path, *args, **kwargs: held(path, self, *args, **kwargs)


SEAMS = {TARGET: _install_jobs, "hsnap_sglang.req": _install_req, "hsnap_sglang.retract": _install_retract,
         "hsnap_io.migrate": _install_migrate}


if _gate():
    sys.meta_path.insert(0, AfterImport(SEAMS))
