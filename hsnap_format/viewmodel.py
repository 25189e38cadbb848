"""Plain-data summaries of snapshots for the CLI, ``--json`` and the viewer."""

from __future__ import annotations

import re

from .manifest import SnapshotSet
from .reader import Snapshot

_CONTROL = re.compile(r"[\x00-\x1f\x7f-\x9f\u2028\u2029\u202a-\u202e\u2066-\u2069]")


def escape(text) -> str:
    """Make a string from a file safe for a terminal (no escape sequences, no bidi tricks)."""
    return _CONTROL.sub(lambda m: f"\\x{ord(m.group()):02x}" if ord(m.group()) < 0x100 else f"\\u{ord(m.group()):04x}", str(text))


def rank_summary(snap: Snapshot) -> dict:
    return {
        "path": snap.path,
        "version": f"{snap.version[0]}.{snap.version[1]}",
        "identity": snap.header["identity"],
        "geometry": snap.header["geometry"],
        "request": snap.header["request"],
        "features": snap.header["features"],
        "digest_algorithm": snap.header["digest"],
        "sections": [
            {"name": s.name, "kind": s.kind, "layer": s.layer, "dtype": s.dtype, "shape": list(s.shape),
             "offset": s.offset, "length": s.length, "digest": s.digest}
            for s in snap.sections
        ],
        "file_length": snap.file_length,
        "payload_bytes": snap.payload_bytes,
        "root_digest": snap.root_digest,
    }


def snapshot_summary(snap) -> dict:
    if isinstance(snap, SnapshotSet):
        m = snap.manifest
        return {
            "manifest": {"snapshot_id": m.snapshot_id, "state_position": m.state_position, "tp_size": m.tp_size,
                         "ranks": [{"rank": r.rank, "file": r.file, "length": r.length, "root_digest": r.root_digest} for r in m.ranks]},
            "ranks": [rank_summary(s) for s in snap.ranks.values()],
        }
    return {"manifest": None, "ranks": [rank_summary(snap)]}
