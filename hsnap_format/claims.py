"""A snapshot's claim (spec 8.3): ``<snapshot>.claimed`` beside it, put by the one server that resumed it (or, of a
live migration's container, by the target that admitted its final link).  Here: its name and a reader — what
``hsnap info DIR`` shows of each entry (resumed already, by whom, when).  Making and taking back a claim is the
server plug-in's (``hsnap_sglang.claims``)."""

from __future__ import annotations

import os

from .controljson import loads_bounded
from .errors import HsnapError

CLAIM_SUFFIX = ".claimed"
CLAIM_MAX_BYTES = 4096  # a claim is a few hundred bytes; a bigger marker is not one and is not read whole
_SHOWN = 200  # characters of a claim's field shown at most


def claim_path(snapshot: str) -> str:
    """``<snapshot>.claimed``: beside the file, or beside a TP set's directory (never inside it)."""
    return os.fspath(snapshot).rstrip("/") + CLAIM_SUFFIX


def read_claim(store, snapshot: str) -> dict | None:
    """The claim of ``snapshot`` in ``store``, or None when it has none: ``{"server", "host", "pid", "at"}`` as its
    fields say (texts, capped; never the marker's bytes as they are), or ``{"unreadable": True}`` for a marker that
    is not a claim."""
    marker = claim_path(snapshot)
    try:
        if not store.exists(marker):
            return None
        got = loads_bounded(store.read_bytes(marker, CLAIM_MAX_BYTES)[0], marker, "claim", max_bytes=CLAIM_MAX_BYTES, max_depth=4)
        who = got.get("claimed_by") or {}
        return {"server": str(who.get("server", ""))[:_SHOWN], "host": str(who.get("host", ""))[:_SHOWN],
                "pid": who.get("pid") if isinstance(who.get("pid"), int) else None, "at": str(got.get("claimed_at", ""))[:40]}
    except (HsnapError, ValueError, AttributeError, OSError):
        return {"unreadable": True}


__all__ = ["CLAIM_SUFFIX", "CLAIM_MAX_BYTES", "claim_path", "read_claim"]
