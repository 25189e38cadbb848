"""Plain-data summaries of snapshots for the CLI, ``--json`` and the viewer."""

from __future__ import annotations

from .manifest import SnapshotSet
from .reader import Snapshot

from .errors import escape_text as escape  # one rule for the CLI, the viewer and error messages


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
