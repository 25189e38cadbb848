"""What the viewer shows, as plain data (no Textual): an opened snapshot, its
sections keyed by rank and name, and their grouping by layer."""

from __future__ import annotations

import math
import os
from dataclasses import dataclass
from itertools import groupby

import numpy as np

from hsnap_format import HsnapError, SectionInfo, Snapshot, SnapshotSet, open_snapshot
from hsnap_format.diff import rank_map
from hsnap_format.stats import section_stats

# section kind -> how it is named on screen
KIND_LABELS = {
    "attn_k": "attention K",
    "attn_v": "attention V",
    "swa_k": "SWA K",
    "swa_v": "SWA V",
    "mla_kv": "MLA latent KV",
    "conv": "conv state",
    "temporal": "temporal state",
    "prompt_ids": "prompt token ids",
    "output_ids": "output token ids",
    "output_logprobs": "output logprobs",
    "top_logprob_ids": "top-k logprob ids",
    "top_logprob_values": "top-k logprobs",
    "rng_state": "sampler RNG state",
}

# section kind -> the family a layer node is labelled with
KIND_FAMILY = {
    "attn_k": "attention",
    "attn_v": "attention",
    "swa_k": "SWA",
    "swa_v": "SWA",
    "mla_kv": "MLA",
    "conv": "Mamba/GDN",
    "temporal": "Mamba/GDN",
}

ATTENTION_KINDS = frozenset(("attn_k", "attn_v", "swa_k", "swa_v", "mla_kv"))


def display_name(path) -> str:
    """The basename only: no temp or home directories on screen (or in snapshot SVGs)."""
    p = os.path.normpath(os.fspath(path))
    name = os.path.basename(p) or p
    return name + "/" if os.path.isdir(p) else name


def fmt_bytes(n: int) -> str:
    for unit, size in (("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if n >= size:
            return f"{n / size:.1f} {unit}"
    return f"{n} B"


def alignment(offset: int, cap: int = 1 << 20) -> int:
    """The largest power of two dividing ``offset`` (capped)."""
    return cap if offset == 0 else min(offset & -offset, cap)


@dataclass(frozen=True)
class SectionRef:
    """One section of one rank; ``key`` identifies it in trees, tables and messages."""

    rank: int
    info: SectionInfo

    @property
    def key(self) -> str:
        return f"{self.rank}:{self.info.name}"

    @property
    def kind_label(self) -> str:
        return KIND_LABELS.get(self.info.kind, self.info.kind)


@dataclass(frozen=True)
class Group:
    label: str
    layer: int | None
    refs: tuple[SectionRef, ...]


class Document:
    """An opened rank file or snapshot directory. Raises :class:`HsnapError` if unreadable."""

    def __init__(self, path) -> None:
        self.path = os.fspath(path)
        self.label = display_name(path)
        self.source: Snapshot | SnapshotSet = open_snapshot(self.path)
        self.ranks: dict[int, Snapshot] = rank_map(self.source)
        self.manifest = self.source.manifest if isinstance(self.source, SnapshotSet) else None
        self.refs = tuple(SectionRef(r, s) for r, snap in sorted(self.ranks.items()) for s in snap.sections)
        self._by_key = {ref.key: ref for ref in self.refs}

    @property
    def multi_rank(self) -> bool:
        return self.manifest is not None

    @property
    def first(self) -> Snapshot:
        return self.ranks[min(self.ranks)]

    def ref(self, key: str) -> SectionRef:
        return self._by_key[key]

    def __contains__(self, key: str) -> bool:
        return key in self._by_key

    def snapshot(self, ref: SectionRef) -> Snapshot:
        return self.ranks[ref.rank]

    # Every read below uses pread (typed errors): a file truncated while the viewer has
    # it open must give a message, never SIGBUS through a mapped view.
    def head(self, ref: SectionRef, rows: int) -> np.ndarray:
        """The first ``rows`` rows along the last axis, shaped ``[rows', last]`` (a small copy)."""
        shape = ref.info.shape
        last = shape[-1] if shape else 1
        total = math.prod(shape)
        arr = self.ranks[ref.rank].read(ref.info, verify=False, count=min(total, rows * last))
        return arr.reshape(-1, last) if last else arr.reshape(0, 0)

    def raw(self, ref: SectionRef):
        """The section's bytes, read on demand (``len`` and slices)."""
        return self.ranks[ref.rank].section_bytes(ref.info)

    def stats(self, ref: SectionRef, cancelled=None):
        return section_stats(self.ranks[ref.rank], ref.info, cancelled=cancelled)

    def section_label(self, ref: SectionRef) -> str:
        where = f"rank {ref.rank} · " if self.multi_rank else ""
        layer = "request" if ref.info.layer is None else f"layer {ref.info.layer}"
        return f"{where}{layer} · {ref.info.name} ({ref.kind_label})"

    def storage_dtype(self, ref: SectionRef) -> str:
        """``dtype`` or ``dtype / storage dtype`` where the pool stores another type (fp8 as uint8)."""
        att = self.ranks[ref.rank].geometry.attention
        if ref.info.kind in ATTENTION_KINDS and att is not None and att.storage_dtype != ref.info.dtype:
            return f"{ref.info.dtype} / {att.storage_dtype}"
        return ref.info.dtype

    def groups(self, rank: int) -> list[Group]:
        """Sections of one rank by layer (state, in file order), then the request record."""
        refs = [r for r in self.refs if r.rank == rank]
        out = []
        for layer, items in groupby((r for r in refs if r.info.is_state), key=lambda r: r.info.layer):
            items = tuple(items)
            families = " + ".join(dict.fromkeys(KIND_FAMILY.get(r.info.kind, r.info.kind) for r in items))
            out.append(Group(f"layer {layer} · {families}", layer, items))
        record = tuple(r for r in refs if not r.info.is_state)
        if record:
            out.append(Group("request record", None, record))
        return out

    def record_array(self, kind: str, rank: int | None = None) -> np.ndarray | None:
        """A request-record section by kind (a copy, read with pread), or None when the file has none."""
        snap = self.ranks[min(self.ranks) if rank is None else rank]
        for s in snap.sections:
            if s.kind == kind:
                return snap.read(s, verify=False)
        return None

    def close(self) -> None:
        self.source.close()


def try_open(path) -> tuple[Document | None, HsnapError | None]:
    try:
        return Document(path), None
    except HsnapError as e:
        return None, e
