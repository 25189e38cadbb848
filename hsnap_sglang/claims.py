"""At-most-once resume: the server that resumes a snapshot first claims it, by creating ``<snapshot>.claimed`` beside
it (a small JSON naming who claimed it and when) without ever replacing one — locally a temporary renamed without
replacing, on ``s3://`` a put with ``If-None-Match: *`` (SeaweedFS and AWS S3 refuse it when the key exists; a
store that ignores the header lets a second claim overwrite the first: there the claim is only as strong as the
store).  A second resume finds the marker and is refused (:class:`SnapshotClaimedError`, 409, naming the claimant);
resuming again is an explicit choice of the caller (``again``).  The HTTP process claims (one claimant for a TP
set) right before it asks the scheduler to admit the request, and takes the claim back if the scheduler refuses.
Blocking store calls: run them off the event loop."""

from __future__ import annotations

import json
import os
import socket
import time

from hsnap_format import HsnapError, SnapshotExistsError
from hsnap_format.errors import Phrase
from hsnap_format.stores import store_for

from hsnap_format.claims import CLAIM_SUFFIX, claim_path, read_claim


class SnapshotClaimedError(HsnapError):
    """The snapshot was already resumed (its claim marker exists): resuming it again duplicates the request."""


def claim(snapshot: str, who: dict) -> tuple[str, str]:
    """Create the claim marker of ``snapshot`` (refusing when one exists); returns (marker, its version) for
    :func:`release`."""
    marker = claim_path(snapshot)
    store = store_for(marker)
    body = json.dumps({"claimed_by": who, "claimed_at": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
                       "claimed_at_unix": round(time.time(), 3)}, sort_keys=True).encode()
    try:
        return marker, store.put_bytes(marker, body)
    except SnapshotExistsError:
        raise SnapshotClaimedError(snapshot, "claim", Phrase(f"a snapshot not resumed yet (no {CLAIM_SUFFIX} marker; "
                                                            "resume again on purpose: again=true / hsnap resume --again)"),
                                   Phrase(_claimant(store, snapshot))) from None


def release(marker: str, version: str) -> None:
    """Take a claim back (the resume was refused after claiming): only the version this server created."""
    store_for(marker).remove(marker, version=version)


def _claimant(store, snapshot: str) -> str:
    """Who holds the claim, as the marker says (its fields only, never its bytes as they are)."""
    got = read_claim(store, snapshot)
    if not got or got.get("unreadable"):
        return f"claimed (its {CLAIM_SUFFIX} marker is not readable as a claim)"
    return f"claimed by {got['server']} (host {got['host'][:100]}, pid {got['pid']!s:.12}) at {got['at']}"


def claimant_identity(server: str) -> dict:
    """What a marker says of the server that claims: its address as configured, host name, pid."""
    return {"server": server, "host": socket.gethostname(), "pid": os.getpid()}


__all__ = ["SnapshotClaimedError", "CLAIM_SUFFIX", "claim_path", "claim", "release", "claimant_identity"]
