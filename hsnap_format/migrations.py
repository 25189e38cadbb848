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


__all__ = ["LINK_NAME", "FINAL_NAME", "APPLIED_SUFFIX", "ABANDONED_NAME", "REFUSED_NAME", "parse_round", "is_final_link"]
