"""The names in a live migration's container (spec 8.4; a directory or ``s3://`` prefix): what ``hsnap_io.migrate`` writes and
a listing of the container recognises (:mod:`hsnap_format.stores.entries`).

* ``link-NNNN.hsnap``: the pre-copy rounds in order, ``link-0000`` a plain snapshot, each later one a delta of the
  one before (a file, or a TP set's directory at TP > 1);
* ``final.hsnap``: the last delta, written once the source stopped the request — the hand-off (a target that
  admits the request claims it, ``final.hsnap.claimed``, as a resume claims its snapshot);
* ``<link>.applied``: put by a following target beside each round it applied;
* ``abandoned.json`` / ``refused.json``: the source gave the migration up / the target refused a link (why).
"""

from __future__ import annotations

import os
import re

LINK_NAME = "link-{:04d}.hsnap"  # the pre-copy rounds, in order: link-0000 plain, the others deltas
FINAL_NAME = "final.hsnap"  # the last delta, written after the source stopped the request
APPLIED_SUFFIX = ".applied"  # put by a following target beside each round it applied: the source stops once it sees it
ABANDONED_NAME = "abandoned.json"  # put by a source that gives the migration up (the request finished, was refused...)
REFUSED_NAME = "refused.json"  # put by a target that refused a link (MigrationTarget.refuse): the source gives up at once

_ROUND = re.compile(r"link-(\d{4,})\.hsnap")


def parse_round(name: str) -> int | None:
    """The round number of a pre-copy link's name (``link-0003.hsnap`` -> 3), else None."""
    m = _ROUND.fullmatch(name)
    return int(m.group(1)) if m else None


def is_final_link(path: str) -> bool:
    """``path`` is a container's final link, or a rank file of it (a TP set's ``final.hsnap/rank-N.hsnap``)."""
    p = os.fspath(path).rstrip("/")
    return os.path.basename(p) == FINAL_NAME or os.path.basename(os.path.dirname(p)) == FINAL_NAME


USED_NAMES = (LINK_NAME.format(0), FINAL_NAME, ABANDONED_NAME, REFUSED_NAME)  # any of them: a container a migration used


def container_used(store, container: str) -> str | None:
    """The first name in ``container`` that says a migration used it (:data:`USED_NAMES`), else None: a stat per name
    on a local store, a HEAD on an object store (run it off any thread that must not wait)."""
    return next((p for p in (store.join(container, n) for n in USED_NAMES) if store.exists(p)), None)


__all__ = ["LINK_NAME", "FINAL_NAME", "APPLIED_SUFFIX", "ABANDONED_NAME", "REFUSED_NAME", "USED_NAMES", "parse_round", "is_final_link",
           "container_used"]
