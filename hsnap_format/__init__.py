"""hsnap: snapshots of one active request of a hybrid LLM (attention KV + Mamba/GDN
state + request record). Pure Python on numpy and xxhash: no torch, no SGLang.

    import hsnap_format as hf
    with hf.open("req.hsnap") as snap:      # reads only preamble, header, trailer
        k = snap["attn.3.k"]                # zero-copy view, [tokens, heads, dim]
        snap.verify()                       # every byte, or DigestMismatchError

Normative spec: spec/hsnap-v1.md.
"""

from . import errors
from .errors import *  # noqa: F401,F403  (the error tree is public)
from .chain import Chain, compact, open_chain
from .layout import SectionSpec
from .manifest import Manifest, RankEntry, SetWriter, SnapshotSet
from .reader import SectionInfo, Snapshot
from .records import (
    AttentionGeometry,
    BaseRef,
    Engine,
    Geometry,
    Identity,
    MambaGeometry,
    RequestRecord,
    geometry_differences,
    identity_differences,
    numerics_differences,
)
from .spec import MAJOR, MINOR
from .stores import open_snapshot
from .writer import CommitInfo, SnapshotWriter, write_snapshot

__version__ = "1.0.0"
open = open_snapshot  # noqa: A001  (hsnap_format.open(path), like zarr.open)

__all__ = [
    "open",
    "open_snapshot",
    "open_chain",
    "compact",
    "Chain",
    "BaseRef",
    "Snapshot",
    "SnapshotSet",
    "SectionInfo",
    "SectionSpec",
    "SnapshotWriter",
    "SetWriter",
    "CommitInfo",
    "write_snapshot",
    "Manifest",
    "RankEntry",
    "Identity",
    "Engine",
    "Geometry",
    "AttentionGeometry",
    "MambaGeometry",
    "RequestRecord",
    "identity_differences",
    "geometry_differences",
    "numerics_differences",
    "MAJOR",
    "MINOR",
]
__all__ += errors.__all__
