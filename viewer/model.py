"""What the viewer shows, as plain data (no Textual): an opened snapshot, its
sections keyed by rank and name, and their grouping by layer."""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from itertools import groupby

import numpy as np

from hsnap_format import HsnapError, SectionInfo, Snapshot, SnapshotSet, open_snapshot
from hsnap_format.tools.diff import rank_map
from hsnap_format.tools.stats import section_stats
from hsnap_format.tools.viewmodel import PartialSnapshot, fmt_bytes, salvageable

# digest status of a section, as the Digests tab, the tree and the Section tab show it
OK, MISMATCH, MISSING, PENDING = "ok", "MISMATCH", "MISSING", "pending"
PROBLEMS = (MISMATCH, MISSING)

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


def alignment(offset: int, cap: int = 1 << 20) -> int:
    """The largest power of two dividing ``offset`` (capped)."""
    return cap if offset == 0 else min(offset & -offset, cap)


def aligned_to(offset: int) -> str:
    """What the offset happens to be a multiple of (a fact, not a requirement): '4 KiB', '1 MiB+'."""
    a = alignment(offset)
    return fmt_bytes(a).replace(".0 ", " ") + ("+" if a == 1 << 20 else "")


@dataclass(frozen=True)
class SectionRef:
    """One section of one rank; ``key`` identifies it in trees, tables and messages."""

    rank: int
    info: SectionInfo
    key: str = field(init=False, compare=False)  # computed once: tables ask for it per drawn row

    def __post_init__(self) -> None:
        object.__setattr__(self, "key", f"{self.rank}:{self.info.name}")

    @property
    def kind_label(self) -> str:
        return KIND_LABELS.get(self.info.kind, self.info.kind)


@dataclass(frozen=True)
class Group:
    label: str
    layer: int | None
    refs: tuple[SectionRef, ...]


class Document:
    """An opened rank file or snapshot directory. Raises :class:`HsnapError` if unreadable.

    A rank file that is truncated or an unfinished write, but whose header is intact,
    opens as a partial view (``partial`` says what is wrong; missing sections are marked)."""

    def __init__(self, path, *, source: Snapshot | SnapshotSet | None = None) -> None:
        self.path = os.fspath(path)
        self.label = display_name(path)
        self.source: Snapshot | SnapshotSet = open_snapshot(self.path) if source is None else source
        self.ranks: dict[int, Snapshot] = rank_map(self.source)
        self.manifest = self.source.manifest if isinstance(self.source, SnapshotSet) else None
        self.refs = tuple(SectionRef(r, s) for r, snap in sorted(self.ranks.items()) for s in snap.sections)
        self._by_key = {ref.key: ref for ref in self.refs}
        self.partial: str | None = self.source.describe() if isinstance(self.source, PartialSnapshot) else None
        # digest verdicts, filled by the scan: key -> OK / MISMATCH / MISSING / PENDING
        self.status: dict[str, str] = {ref.key: PENDING for ref in self.refs}
        self.status_detail: dict[str, str] = {}
        if isinstance(self.source, PartialSnapshot):
            for ref in self.refs:
                if not self.source.present(ref.info):
                    self.status[ref.key] = MISSING

    @classmethod
    def open(cls, path) -> "Document":
        """Open ``path``; a truncated or unfinished rank file with an intact header opens partially."""
        try:
            return cls(path)
        except HsnapError as e:
            if not (salvageable(e) and os.path.isfile(os.fspath(path))):
                raise
            try:
                source = PartialSnapshot(path)
            except HsnapError:
                raise e from None
            return cls(path, source=source)

    def present(self, ref: SectionRef) -> bool:
        src = self.ranks[ref.rank]
        return src.present(ref.info) if isinstance(src, PartialSnapshot) else True

    def problems(self) -> list[str]:
        """Keys of sections that failed their digest or are missing, in file order."""
        return [k for k, st in self.status.items() if st in PROBLEMS]

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
    def read_flat(self, ref: SectionRef, start: int, count: int) -> np.ndarray:
        """Elements [start, start+count) in C order (pread; unverified: a view, not a verdict)."""
        return self.ranks[ref.rank].read(ref.info, verify=False, start=start, count=count)

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
        return Document.open(path), None
    except HsnapError as e:
        return None, e
