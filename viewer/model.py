"""What the viewer shows, as plain data (no Textual): an opened snapshot, its
sections keyed by rank and name, and their grouping by layer."""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from itertools import groupby

import numpy as np

from hsnap_format import HsnapError, SectionInfo, Snapshot, SnapshotSet, open_snapshot
from hsnap_format.chain import Chain
from hsnap_format.tools.diff import rank_map
from hsnap_format.tools.stats import section_stats
from hsnap_format.tools.viewmodel import (ChainProof, PartialSnapshot, fmt_bytes, fmt_rows, fmt_runs, open_rank_chains, paged_positions,
                                          plural, row_runs, salvageable)

from .text import describe_error

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


@dataclass(frozen=True)
class ChainLink:
    """One link of a rank's chain as the tree and the Digests tab name it."""

    rank: int
    index: int  # 0: the plain snapshot at the bottom
    count: int
    name: str
    runs: tuple[tuple[int, int], ...]  # positions whose full-attention rows the file holds
    pages: int  # full pages it takes from its page store

    @property
    def title(self) -> str:
        return f"link {self.index + 1} of {self.count}"

    @property
    def label(self) -> str:
        pages = f" + {plural(self.pages, 'page')}" if self.pages else ""
        # "of N" is on the chain node above: the tree has a share of the width, the file name needs it
        return f"link {self.index + 1} · rows {fmt_runs(list(self.runs)) or 'none'}{pages} · {self.name}"


def full_attention_runs(snap: Snapshot) -> list[tuple[int, int]]:
    """The positions whose full-attention rows ``snap`` holds itself (not in pages)."""
    info = next((s for s in snap.sections if s.kind in ("attn_k", "mla_kv")), None)
    return row_runs(snap, info) if info is not None else []


class Document:
    """An opened rank file or snapshot directory. Raises :class:`HsnapError` if unreadable.

    A rank file that is truncated or an unfinished write, but whose header is intact,
    opens as a partial view (``partial`` says what is wrong; missing sections are marked).

    A delta, or a file that takes rows from a page store, opens its chain too (headers
    only: each link checked against the one above, spec 7.5); ``chains`` holds per rank the
    :class:`Chain` or the typed error that refused it, ``proofs`` the verdict of its proof
    once the digest scan made it (None: pending)."""

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
        self.rows = {ref.key: row_runs(self.ranks[ref.rank], ref.info) for ref in self.refs}
        self.chains: dict[int, Chain | HsnapError] = open_rank_chains(self.source, self.path)
        self.proofs: dict[int, ChainProof | HsnapError | None] = {r: None for r in self.chains}

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

    # -- chains and pages
    def links(self, rank: int) -> list[ChainLink]:
        """The links of ``rank``'s chain, bottom first (none when it is plain or did not open)."""
        chain = self.chains.get(rank)
        if not isinstance(chain, Chain):
            return []
        n = len(chain.links)
        # a rank of a set is named by its set directory (every rank file is rank-N.hsnap)
        names = [display_name(loc if chain.rank is not None and loc else s.path) for s, loc in zip(chain.links, chain.locations)]
        return [ChainLink(rank, i, n, name, tuple(full_attention_runs(s)), 0 if s.pages is None else s.pages.count)
                for i, (s, name) in enumerate(zip(chain.links, names))]

    def link_status(self, rank: int, index: int) -> str:
        proof = self.proofs.get(rank)
        if proof is None:
            return PENDING
        return MISMATCH if isinstance(proof, HsnapError) or proof.links[index] else OK

    def pages_status(self, rank: int) -> str:
        proof = self.proofs.get(rank)
        if proof is None:
            return PENDING
        return MISMATCH if isinstance(proof, HsnapError) or proof.pages else OK

    def chain_report(self, rank: int) -> list[tuple[str, str]]:
        """(status, line) of ``rank``'s chain: what opening it refused, or its proof's verdict
        per link and for its pages (``chain: 3 links ok``; ``chain: link 1 of 3 (base.hsnap)
        FAILED: ...``). A paged file alone is a chain of one link: its pages are what is new."""
        chain, proof = self.chains[rank], self.proofs.get(rank)
        prefix = f"rank {rank} " if self.multi_rank else ""
        if isinstance(chain, HsnapError):
            return [(MISMATCH, f"{prefix}chain does not open: {describe_error(chain)}")]
        links = self.links(rank)
        pages = sum(link.pages for link in links)
        alone = len(links) == 1
        where = f"{prefix}{'pages' if alone else 'chain'}"
        size = str(pages) if alone else plural(len(links), "link") + (f", {plural(pages, 'page')}" if pages else "")
        if proof is None:
            return [(PENDING, f"{where}: {size}, pending")]
        if isinstance(proof, HsnapError):
            return [(MISMATCH, f"{where}: the proof stopped: {describe_error(proof)}")]
        if proof.ok:
            return [(OK, f"{where}: {size} ok")]
        out = []
        for link, failures in zip(links, proof.links):
            if failures:
                more = f" (and {len(failures) - 1} more)" if len(failures) > 1 else ""
                what = link.name if alone else f"{link.title} ({link.name})"
                out.append((MISMATCH, f"{where}: {what} FAILED: {describe_error(failures[0])}{more}"))
        good = [str(link.index + 1) for link, failures in zip(links, proof.links) if not failures]
        if good and not alone:
            out.append((OK, f"{where}: link{'s' if len(good) > 1 else ''} {', '.join(good)} of {len(links)} ok"))
        if proof.pages:
            more = f" (and {len(proof.pages) - 1} more)" if len(proof.pages) > 1 else ""
            out.append((MISMATCH, f"{where}: {'' if alone else 'pages '}FAILED: {describe_error(proof.pages[0])}{more}"))
        elif pages:
            out.append((OK, f"{where}: {pages} ok" if alone else f"{where}: {plural(pages, 'page')} ok"))
        return out

    def chain_problems(self) -> list[str]:
        """Every failing line of every rank's chain report."""
        return [line for rank in sorted(self.chains) for status, line in self.chain_report(rank) if status == MISMATCH]

    def rows_text(self, ref: SectionRef) -> str:
        """``rows 280..296 of 297`` for a row section, else ''."""
        if ref.info.kind not in ATTENTION_KINDS:
            return ""
        return fmt_rows(self.rows[ref.key], self.ranks[ref.rank].state_position)

    def pages_text(self, rank: int, *, short: bool = False) -> str | None:
        """``2 pages of 2 positions (rows 0..3) in pages/`` (``short``: ``2 pages (rows 0..3) in
        pages/``) for a rank whose chain takes pages, else None."""
        chain = self.chains.get(rank)
        snaps = chain.links if isinstance(chain, Chain) else [self.ranks[rank]]
        paged = [s for s in snaps if s.pages is not None and s.pages.count]
        if not paged:
            return None
        count = sum(s.pages.count for s in paged)
        spans = [paged_positions(s) for s in paged]
        stores = ", ".join(dict.fromkeys(s.pages.store + "/" for s in paged))
        size = "" if short else f" of {paged[0].pages.page_size} positions"
        return f"{plural(count, 'page')}{size} (rows {fmt_runs([x for x in spans if x is not None])}) in {stores}"

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
        for chain in self.chains.values():
            if isinstance(chain, Chain):
                chain.close()
        self.source.close()


def try_open(path) -> tuple[Document | None, HsnapError | None]:
    try:
        return Document.open(path), None
    except HsnapError as e:
        return None, e
