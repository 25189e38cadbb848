"""Snapshot chains (spec 5.9, 7.5; format 1.2, feature ``delta``).

Attention KV is append-only; conv and temporal state are overwritten every token; the
record grows. A *delta* is a rank file that names its base by the base's root digest
(``base`` in its header) and holds only the attention rows after the base's position,
the whole recurrent state and the whole record. A base may itself be a delta: a
*chain* is a plain snapshot and the deltas above it, the last one its *head*.

A chain's links live side by side: ``base.name`` is a file name beside the delta (a
rank file), or a directory name beside the delta's set directory (rank ``r`` of a TP
set has its base in rank ``r`` of the named set). Links are found through the storage
seam (:mod:`hsnap_format.stores`), so a chain lies in a local directory or under one
object-store prefix alike.

:func:`open_chain` opens a head and every link below it and checks each link against
the one above before anything else happens (spec 7.5): the digest it is named by, its
position, snapshot id and depth, and that it is the same request of the same model on
the same rank — typed refusals, never a loop (a visited set and a stated depth limit).
:meth:`Chain.prove` then makes the one proof of the chain that a restore, ``hsnap verify``
and :func:`compact` all make: every link's bytes, each base's output a prefix of its
delta's, every page key and every page reference on its own. :meth:`Chain.pieces` says
which rows of which link make up each section of the head's position — what a restore
uploads and what :func:`compact` writes: one plain snapshot byte-identical to a direct
export at the head's position, proved again before it is published.

Pure: numpy and xxhash through the reader and writer; no torch, no SGLang.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import TYPE_CHECKING, Iterator

import numpy as np
import xxhash

from .errors import ChainError, DigestMismatchError, HsnapError, HsnapIOError, MalformedManifestError, Phrase
from .layout import PAGED_KINDS, ROW_KINDS, first_position, inline_runs
from .manifest import SnapshotSet
from .reader import SectionInfo, Snapshot
from .records import BaseRef, Geometry, Identity, RequestRecord, identity_differences
from .spec import DTYPES, MAX_CHAIN_DEPTH
from .source import Store, store_at

if TYPE_CHECKING:
    from .pages import PageRef

_COPY_CHUNK = 2 << 20  # hashed while in cache, as the reader's verify
_OPEN_PAGES = 256  # page objects a compaction keeps open at once (one descriptor each)


# ------------------------------------------------------------------------- link rules


@dataclass(frozen=True)
class LinkFacts:
    """What the chain rules compare between a base and its delta (from a file's header,
    or from what an export is about to write)."""

    path: str | None
    identity: Identity
    geometry: Geometry
    rid: str
    state_position: int
    swa_start: int
    prompt_tokens: int
    output_tokens: int
    prompt_digest: str  # XXH3-128 of the prompt's int32 bytes: the section's digest

    @classmethod
    def of_snapshot(cls, snap: Snapshot) -> "LinkFacts":
        r = snap.request
        return cls(snap.path, snap.identity, snap.geometry, r["rid"], snap.state_position, snap.swa_start, r["prompt_tokens"],
                   r["output_tokens"], snap.section("request.prompt_ids").digest)

    @classmethod
    def of_export(cls, path, identity: Identity, geometry: Geometry, record: RequestRecord, swa_start: int) -> "LinkFacts":
        prompt = np.ascontiguousarray(record.prompt_ids, dtype=DTYPES["int32"])
        return cls(None if path is None else os.fspath(path), identity, geometry, record.rid, record.state_position, swa_start,
                   len(record.prompt_ids), len(record.output_ids), xxhash.xxh3_128_hexdigest(prompt.view(np.uint8).data))


def _identity(b: LinkFacts, d: LinkFacts):
    return identity_differences(b.identity, d.identity)


def _meaning(geometry: Geometry) -> dict:
    """Every field of a geometry as compared (layer lists as sets: their order means nothing, spec 5.6)."""
    flat = geometry.flat()
    flat.update({k: sorted(v) for k, v in flat.items() if k.endswith("layers") and isinstance(v, (list, tuple))})
    flat["geometry.sharding"] = None if geometry.sharding is None else geometry.sharding.to_header()
    return flat


def _geometry(b: LinkFacts, d: LinkFacts):
    mb, md = _meaning(b.geometry), _meaning(d.geometry)
    return [(k, mb.get(k), md.get(k)) for k in dict.fromkeys([*mb, *md]) if mb.get(k) != md.get(k)]


def _equal(field: str, attr: str):
    return lambda b, d: [] if getattr(b, attr) == getattr(d, attr) else [(field, getattr(b, attr), getattr(d, attr))]


def _at_least(field: str, attr: str, what: str):
    return lambda b, d: [] if getattr(b, attr) <= getattr(d, attr) else [(field, Phrase(f">= the base's {what} {getattr(b, attr)}"), getattr(d, attr))]


# The same request of the same model on the same rank, grown, never shrunk (R-7.5-1):
# each rule gives (field, expected — the base's, found — the delta's) for what differs.
LINK_RULES = (
    _identity,  # model, weights, engine, TP size and rank
    _geometry,  # the pools: every field, sharding included
    _equal("request.rid", "rid"),
    _equal("request.prompt_tokens", "prompt_tokens"),
    _equal("request.prompt_ids (digest)", "prompt_digest"),
    _at_least("request.state_position", "state_position", "position"),
    _at_least("request.output_tokens", "output_tokens", "output tokens"),
    _at_least("request.swa_start", "swa_start", "swa_start"),
)


def link_problems(base: LinkFacts, delta: LinkFacts) -> list[tuple[str, object, object]]:
    """Every breach of :data:`LINK_RULES` by ``delta`` over ``base``."""
    return [p for rule in LINK_RULES for p in rule(base, delta)]


def check_link(base: LinkFacts, delta: LinkFacts, where) -> None:
    """:class:`ChainError` naming ``where`` (the delta) and the first rule ``delta`` breaks."""
    problems = link_problems(base, delta)
    if problems:
        field, expected, found = problems[0]
        raise ChainError(where, f"{field} (base {base.path})" if base.path else field, expected, found,
                         detail=f"not a delta of its base ({len(problems)} difference{'s' if len(problems) > 1 else ''})")


def check_ref(ref: BaseRef, base: Snapshot, where) -> None:
    """The base found is the one named (R-7.5-1): its root digest (``DigestMismatchError``:
    expected the digest named, found the base's), then snapshot id, position and depth."""
    if base.root_digest != ref.root_digest:
        raise DigestMismatchError(where, "base.root_digest", ref.root_digest, base.root_digest)
    depth = 0 if base.base is None else base.base.depth
    for field, named, found in (("base.snapshot_id", ref.snapshot_id, base.identity.snapshot_id),
                                ("base.state_position", ref.state_position, base.state_position),
                                ("base.depth", ref.depth - 1, depth)):
        if named != found:
            shown = Phrase(f"{named} links below the base") if field == "base.depth" else named
            raise ChainError(where, field, shown, found, detail=f"the base {base.path}")


def check_output_prefix(base: Snapshot, delta: Snapshot, *, verify: bool = True) -> None:
    """The base's output ids are the first of its delta's (both read; hashed with ``verify``)."""
    b, d = base.read("request.output_ids", verify=verify), delta.read("request.output_ids", verify=verify)
    n = len(b)
    if len(d) < n or not np.array_equal(d[:n], b):
        at = next((i for i in range(min(n, len(d))) if b[i] != d[i]), min(n, len(d)))
        raise ChainError(delta.path, "request.output_ids", Phrase(f"the base's {n} output tokens first ({base.path})"),
                         Phrase(f"another token at output {at}" if at < len(d) else f"{len(d)} output tokens"))


def base_ref(base: Snapshot, name: str) -> BaseRef:
    """The ``base`` a delta of ``base`` writes, ``name`` being where its links find it."""
    depth = 0 if base.base is None else base.base.depth
    return BaseRef(name=name, root_digest=base.root_digest, snapshot_id=base.identity.snapshot_id,
                   state_position=base.state_position, depth=depth + 1)


# ------------------------------------------------------------------------- the chain


@dataclass(frozen=True)
class Piece:
    """Rows of one link's section that fill rows ``start..stop`` of the head's whole
    section (the section a plain export at the head's position would hold): ``take`` bytes
    after the first ``skip`` bytes of the link's section (None: to its end). ``start``/
    ``stop`` are None for a recurrent or record section, taken whole from the head.

    A *page piece* (``page`` set, format 1.3, spec 7.6) comes from a page object instead:
    the whole section of the same name of the page ``page`` names; ``link``/``info`` are
    then None (the page object is opened by whoever reads the piece)."""

    link: Snapshot | None
    info: SectionInfo | None
    skip: int
    start: int | None
    stop: int | None
    take: int | None = None
    page: "PageRef | None" = None

    @property
    def length(self) -> int:
        if self.take is not None:
            return self.take
        assert self.info is not None  # only a page piece has no info, and every page piece has its take
        return self.info.length - self.skip


def _whole_piece(link: Snapshot, info: SectionInfo) -> Piece:
    """``Piece(link, info, 0, ...)``: the whole section of ``link`` (rows 0.. of a row section), without the frozen
    dataclass's seven ``object.__setattr__`` calls (most of a restore's planning); same type, fields, equality."""
    rows = info.shape[0] if info.kind in ROW_KINDS else None
    p = object.__new__(Piece)
    p.__dict__.update(link=link, info=info, skip=0, start=None if rows is None else 0, stop=rows, take=None, page=None)
    return p


def _row_bytes(info: SectionInfo) -> int:
    n = DTYPES[info.dtype].itemsize
    for d in info.shape[1:]:
        n *= d
    return n


class Chain:
    """A head and every link below it, opened and checked (spec 7.5); ``links[0]`` is the
    plain snapshot at the bottom, ``links[-1]`` the head. A plain snapshot is a chain of
    one link. Owns what it opened below the head (closed by :meth:`close`).

    ``locations[i]``: where link i was found (its file, or the set directory holding it as
    rank ``rank``), through ``store``: a link that references pages (spec 5.10) finds its
    page store beside it."""

    def __init__(self, links: list[Snapshot], owned: list, location: str | None = None, *, locations: list[str] | None = None,
                 store: Store | None = None, rank: int | None = None) -> None:
        self.links = tuple(links)
        self._owned = owned
        self.location = location
        self.locations = tuple(locations) if locations is not None else ((location,) * len(self.links) if len(self.links) == 1 else (None,) * len(self.links))
        self.store = store if store is not None else (store_at(location) if location is not None else None)
        self.rank = rank

    @classmethod
    def single(cls, snap: Snapshot) -> "Chain":
        return cls([snap], [])

    @property
    def head(self) -> Snapshot:
        return self.links[-1]

    @property
    def is_delta(self) -> bool:
        return len(self.links) > 1

    @property
    def paged(self) -> bool:
        """Some link takes full pages from a page store (spec 5.10)."""
        return any(link.pages is not None for link in self.links)

    @property
    def plain(self) -> bool:
        """A plain snapshot holding all its rows: a chain of one link without pages."""
        return len(self.links) == 1 and self.links[0].pages is None

    @property
    def state_position(self) -> int:
        return self.head.state_position

    def __len__(self) -> int:
        return len(self.links)

    # -- pages (format 1.3, spec 7.6)
    def page_refs(self, link_index: int | None = None) -> list["PageRef"]:
        """The pages every link (or link ``link_index``) references, in position order."""
        from .pages import page_refs, pages_dir

        out = []
        for i, link in enumerate(self.links):
            if link.pages is None or (link_index is not None and i != link_index):
                continue
            location = self.locations[i]
            if location is None or self.store is None:
                raise ChainError(link.path, "pages.store", Phrase("a snapshot opened from its location (open_chain)"),
                                 Phrase("a file opened alone: its page store is unknown"))
            out += page_refs(link, pages_dir(self.store, location, link.pages.store), self.store)
        return out

    def request_tokens(self, link: Snapshot, *, verify: bool = True) -> np.ndarray:
        """Token id of every position of ``link``'s request (its record, read and hashed)."""
        return np.concatenate([link.read("request.prompt_ids", verify=verify), link.read("request.output_ids", verify=verify)])

    def check_pages(self, *, verify: bool = True, keys_fn=None, hashed: bool = True) -> None:
        """The pages part of :meth:`prove` (R-7.6-1 to 3), raising the first failure."""
        for e in self._page_proof(sections=verify, hashed=hashed, keys_fn=keys_fn):
            raise e

    def _segments(self, link: Snapshot, info: SectionInfo, refs_by_link: dict) -> list[tuple]:
        """The runs of positions ``link`` contributes to section ``info``'s rows, in order:
        ``("rows", a, b, row)`` — rows of its own section from row ``row`` — and
        ``("page", a, b, ref)`` — a page object (spec 7.6)."""
        row0 = first_position(info.kind, link.swa_start, link.base_position)
        if link.pages is None or info.kind not in PAGED_KINDS:
            return [("rows", row0, link.state_position, 0)]
        S = link.pages.page_size
        runs = inline_runs(link.base_position, link.state_position, S)
        out, row = [], 0
        pages = {ref.page: ref for ref in refs_by_link[id(link)]}
        cursor = link.base_position
        for a, b in runs:
            while cursor < a:  # the pages before this run
                out.append(("page", cursor, cursor + S, pages[cursor // S]))
                cursor += S
            out.append(("rows", a, b, row))
            row += b - a
            cursor = b
        while cursor + S <= link.state_position and cursor // S in pages:
            out.append(("page", cursor, cursor + S, pages[cursor // S]))
            cursor += S
        return out

    def pieces_of(self, names) -> dict[str, list[Piece]]:
        """:meth:`pieces` of each of ``names``: a plain snapshot's at once (each section whole, from the head)."""
        if not self.plain:
            return {name: self.pieces(name) for name in names}
        head = self.head
        return {name: [_whole_piece(head, head.section(name))] for name in names}

    def pieces(self, name: str) -> list[Piece]:
        """The rows of each link (or page object) that make up the head's section ``name``
        at the head's position, in order (spec 7.5, 7.6): a full-attention section from every
        link — its pages from their page objects —, a sliding-window one from positions
        ``swa_start`` on, state and record from the head."""
        head = self.head
        h = head.section(name)
        paged = h.kind in PAGED_KINDS and self.paged
        if h.kind not in ROW_KINDS or not (self.is_delta or paged):
            return [_whole_piece(head, h)]
        origin = first_position(h.kind, head.swa_start)  # position of row 0 of the whole section
        rb = _row_bytes(h)
        refs_by_link: dict = {}
        if paged:
            for i, link in enumerate(self.links):
                refs_by_link[id(link)] = self.page_refs(i) if link.pages is not None else []
        out, cursor = [], origin
        for link in self.links:
            info = link.section(name)
            for kind, a, b, extra in self._segments(link, info, refs_by_link):
                start = max(a, origin)
                if start >= b:
                    continue
                if start != cursor:  # the link rules make this impossible; never upload a gap or an overlap
                    raise ChainError(link.path, f"sections[{name!r}]", Phrase(f"rows from position {cursor}"), Phrase(f"rows from position {start}"))
                if kind == "rows":
                    out.append(Piece(link, info, (extra + start - a) * rb, start - origin, b - origin, (b - start) * rb))
                else:
                    out.append(Piece(None, None, 0, start - origin, b - origin, (b - start) * rb, extra))
                cursor = b
        if cursor != head.state_position:
            raise ChainError(head.path, f"sections[{name!r}]", Phrase(f"rows up to position {head.state_position}"), Phrase(f"rows up to {cursor}"))
        return out

    # -- the proof (spec 7.5, 7.6): what restore, verify and compact all make of a chain
    def proof_failures(self, *, sections: bool = True, page_sections: bool | None = None, hashed: bool = True, padding: bool = True,
                       first: bool = False, keys_fn=None) -> list[HsnapError]:
        """The one proof of an opened chain — restore, ``hsnap verify`` and compaction all make
        it, after the link checks of opening it (:func:`chain_below`, R-7.5-1) — as a list of
        failures, in this order:

        1. the links, head first then down: with ``sections`` each verified (7.2: padding,
           then every section's digest); else, with ``padding``, each link's padding;
        2. the records: each base's output ids the first of its delta's (R-7.5-2), read and,
           with ``hashed``, hashed;
        3. the pages of each link that has some: its keys the page hash chain over its own
           token ids (R-7.6-1), then *every reference* checked against the page object it
           names — root digest, namespace, index, key and tokens (R-7.6-2) — and, with
           ``page_sections`` (default: ``sections``), that page verified (R-7.6-3).

        ``sections=False`` is for a caller that hashes every byte it reads afterwards (a
        restore that verifies while uploading). ``first``: stop at the first failure."""
        failures: list[HsnapError] = []
        for link in reversed(self.links):
            if sections:
                failures += link.verify_failures(first=first)
            elif padding:
                try:
                    link.check_padding()
                except HsnapError as e:
                    failures.append(e)
            if first and failures:
                return failures[:1]
        try:
            self.check_records(hashed=hashed)
        except HsnapError as e:
            failures.append(e)
            if first:
                return failures
        for failure in self._page_proof(sections=sections if page_sections is None else page_sections, hashed=hashed, keys_fn=keys_fn, first=first):
            failures.append(failure)
            if first:
                break
        return failures

    def prove(self, **kw) -> None:
        """:meth:`proof_failures`, raising the first (what a restore or a compaction refuses
        with, before it allocates or writes anything)."""
        failures = self.proof_failures(first=True, **kw)
        if failures:
            raise failures[0]

    def check_records(self, *, hashed: bool = True) -> None:
        """Each base's output ids are a prefix of its delta's (R-7.5-2)."""
        for base, delta in zip(self.links, self.links[1:]):
            check_output_prefix(base, delta, verify=hashed)

    def _page_proof(self, *, sections: bool, hashed: bool, keys_fn=None, first: bool = False) -> Iterator[HsnapError]:
        """The failures of R-7.6-1 to 3, in position order (a link whose keys fail has its
        references skipped: they name pages of other tokens)."""
        if not self.paged:
            return
        from .pages import check_keys, open_checked

        for i, link in enumerate(self.links):
            if link.pages is None:
                continue
            try:
                tokens = self.request_tokens(link, verify=hashed)
                check_keys(link, tokens, keys_fn)
                refs = self.page_refs(i)
            except HsnapError as e:
                yield e
                continue
            assert self.store is not None  # page_refs refused a chain without one
            for ref in refs:  # each reference on its own: two may name one object
                try:
                    page = open_checked(ref, self.store, tokens)
                except HsnapError as e:
                    yield e
                    continue
                with page:
                    failures = page.verify_failures(first=first) if sections else []
                yield from failures

    def verify_failures(self, *, first: bool = False) -> list[HsnapError]:
        """Every failure of the whole proof (:meth:`proof_failures`, every byte read)."""
        return self.proof_failures(first=first)

    def page_failures(self, *, first: bool = False) -> list[HsnapError]:
        """The pages part of the whole proof (R-7.6-1 to 3)."""
        out = []
        for e in self._page_proof(sections=True, hashed=True, first=first):
            out.append(e)
            if first:
                break
        return out

    def verify(self) -> None:
        self.prove()

    def check_padding(self) -> None:
        for link in reversed(self.links):
            link.check_padding()

    def check_unchanged(self) -> None:
        for link in self.links:
            link.check_unchanged()

    def close(self) -> None:
        for o in self._owned:
            o.close()
        self._owned = []

    def __enter__(self) -> "Chain":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def __repr__(self) -> str:
        return f"<hsnap.Chain {self.head.path!r}: {len(self.links)} links, position {self.state_position}>"


def _missing(e: HsnapError) -> bool:
    return isinstance(e, HsnapIOError) and isinstance(e.os_error, FileNotFoundError)


def chain_below(head: Snapshot, *, location: str, rank: int | None = None, store: Store | None = None,
                max_depth: int = MAX_CHAIN_DEPTH) -> Chain:
    """The chain of ``head``, opened from ``location`` — the head's file, or the set
    directory (prefix) holding it as rank ``rank``. Opens each link once, in order down
    from the head, checking it against the link above before opening the next (spec 7.5);
    the head itself stays the caller's. Refusals: :class:`ChainError` (missing link, cycle,
    too deep, another request/identity/geometry/position), ``DigestMismatchError`` (a base
    that is not the one named), or what opening the base refuses."""
    store = store or store_at(location)
    if head.base is None:
        return Chain([head], [], location, locations=[location], store=store, rank=rank)
    if head.base.depth > max_depth:  # bounded before anything is opened (R-7.5-1)
        raise ChainError(head.path, "base.depth", f"<= {max_depth} links", head.base.depth)
    links, owned, locations = [head], [], [location]
    visited = {store.split(location)[1]}
    snap, loc = head, location
    try:
        while snap.base is not None:
            ref = snap.base
            if ref.name in visited:
                raise ChainError(snap.path, "base.name", Phrase("a link not yet in the chain"), Phrase(f"{ref.name!r} again: a cycle"))
            visited.add(ref.name)
            base_loc = store.join(store.split(loc)[0], ref.name)
            try:
                opened = store.open(base_loc, ranks=None if rank is None else [rank])
            except HsnapError as e:
                if _missing(e):
                    raise ChainError(snap.path, "base.name", Phrase(f"the base {base_loc}"), Phrase("missing")) from None
                if rank is None and isinstance(e, MalformedManifestError):  # 7.5 step 4: a directory where a rank file goes
                    raise ChainError(snap.path, "base.name", Phrase("a rank file"), Phrase(f"{base_loc}: a directory")) from None
                raise
            owned.append(opened)
            in_set = isinstance(opened, SnapshotSet)
            if in_set != (rank is not None):
                raise ChainError(snap.path, "base.name", Phrase("a snapshot directory" if rank is not None else "a rank file"),
                                 Phrase(f"{base_loc}: {'a snapshot directory' if in_set else 'a rank file'}"))
            base = opened.ranks[rank] if in_set else opened
            check_ref(ref, base, snap.path)
            check_link(LinkFacts.of_snapshot(base), LinkFacts.of_snapshot(snap), snap.path)
            links.append(base)
            locations.append(base_loc)
            snap, loc = base, base_loc
    except BaseException:
        for o in owned:
            o.close()
        raise
    return Chain(links[::-1], owned, location, locations=locations[::-1], store=store, rank=rank)


def open_chain(path, *, rank: int | None = None, storage_options=None, max_depth: int = MAX_CHAIN_DEPTH) -> Chain:
    """Open the chain whose head is ``path`` — a rank file, or rank ``rank`` (default 0)
    of a set (a directory or an object-store prefix) — through the store that holds it.
    The chain owns every file it opened; close it (a context manager)."""
    p = os.fspath(path)
    store = store_at(p, storage_options)
    opened = store.open(p, ranks=None if rank is None else [rank])
    try:
        if isinstance(opened, SnapshotSet):
            r = next(iter(opened.ranks))
            chain = chain_below(opened.ranks[r], location=opened.path, rank=r, store=store, max_depth=max_depth)
        else:
            chain = chain_below(opened, location=p, store=store, max_depth=max_depth)
    except BaseException:
        opened.close()
        raise
    chain._owned.append(opened)
    return chain


# ------------------------------------------------------------------------- compaction


def iter_piece(piece: Piece, chunk: int = _COPY_CHUNK) -> Iterator[memoryview]:
    """The bytes of ``piece``, in order, read by pread (ranged GETs) — and the whole of its
    link's section hashed on the way (the bytes before and after the piece too), so the last
    step raises ``DigestMismatchError`` if the section does not match its digest (nothing is
    final before the iteration ends)."""
    info, snap = piece.info, piece.link
    assert info is not None and snap is not None  # a page piece is read as a piece of its page object
    stop = piece.skip + piece.length
    h = xxhash.xxh3_128()
    for at in range(0, info.length, chunk):
        n = min(chunk, info.length - at)
        data = snap._read(info.offset + at, n)
        h.update(data)
        lo, hi = max(piece.skip, at), min(stop, at + n)
        if hi > lo:
            yield data[lo - at : hi - at]
    got = h.hexdigest()
    if got != info.digest:
        raise DigestMismatchError(snap.path, f"sections[{info.name!r}].digest", info.digest, got)


def write_compacted(chain: Chain, writer) -> None:
    """Stream the head's whole sections into ``writer`` (a SnapshotWriter planned with the
    head's identity, geometry, record and swa_start). A page piece's page object is checked
    against *its* reference at every use (spec 7.6, R-7.6-2, tokens included: an object kept
    open for an earlier reference is checked again for a later one) and its section hashed
    like a link's."""
    from .pages import check_page, open_checked

    opened: dict = {}  # page objects stay open across sections (every section reads every page), within a bound
    tokens: dict = {}  # id(link) -> its token ids (what each of its references is checked against)
    try:
        for spec in writer.pending_state_sections():
            writer.begin_section(spec.name)
            for piece in chain.pieces(spec.name):
                if piece.page is None:
                    for data in iter_piece(piece):
                        writer.write_chunk(data)
                    continue
                ref = piece.page
                assert chain.store is not None  # pieces made its page pieces through page_refs, which needs it
                tok = tokens.get(id(ref.link))
                if tok is None:
                    tok = tokens[id(ref.link)] = chain.request_tokens(ref.link)
                page = opened.get(ref.path)
                if page is None:
                    page = open_checked(ref, chain.store, tok)
                    if len(opened) < _OPEN_PAGES:
                        opened[ref.path] = page
                else:
                    check_page(page, ref, tok)  # per reference, never by the object's name
                try:
                    for data in iter_piece(Piece(page, page.section(spec.name), 0, piece.start, piece.stop)):
                        writer.write_chunk(data)
                finally:
                    if opened.get(ref.path) is not page:
                        page.close()
            writer.end_section()
    finally:
        for page in opened.values():
            page.close()


def prove_output(path, head: Snapshot, *, storage_options=None) -> None:
    """A compaction's output, re-opened from ``path`` (its temporary, or the object just
    completed) and proved as any chain is (:meth:`Chain.prove`: a plain snapshot, every byte):
    plain, at the head's position, of the head's request."""
    p = os.fspath(path)
    store = store_at(p, storage_options)
    snap = Snapshot(p) if store.local else store.open(p)
    try:
        for field, want, got in (("base", None, snap.base), ("pages", None, snap.pages), ("request.state_position", head.state_position, snap.state_position),
                                 ("identity.snapshot_id", head.identity.snapshot_id, snap.identity.snapshot_id),
                                 ("request.rid", head.request["rid"], snap.request["rid"])):
            if want != got:
                raise ChainError(p, field, want, got, detail="a compaction's output is not the head's plain snapshot")
        Chain.single(snap).prove()
    finally:
        snap.close()


def compact(chain: Chain, path, *, storage_options=None, fsync: bool = True, mode: int = 0o600, writer=None, proved: bool = False):
    """Write the chain as one plain snapshot at ``path`` (a file or an ``s3://`` URL): the
    head's identity, geometry, record, ``swa_start`` and optional features, every state
    section at the head's position — byte for byte what a plain export of the same pools
    at that position, with the head's identity and record, writes (spec 7.5).

    First the chain's whole proof (:meth:`Chain.prove`, what a restore and ``hsnap verify``
    make: every link, record and page reference, every byte): what either refuses is refused
    here with the same error, before anything is written. Every byte copied is hashed again
    on the way; then the output is re-opened and proved (:func:`prove_output`) before its
    name is published — a file is renamed only after that; an object store's upload, which
    publishes at completion, is removed again (by its ETag) when its proof fails. Nothing
    unproved stays under ``path``. ``proved``: the caller has just made the chain's proof.
    Returns the writer's :class:`~hsnap_format.writer.CommitInfo`."""
    if not proved:
        chain.prove()
    head = chain.head
    kw = dict(identity=head.identity, geometry=head.geometry, record=head.record(), swa_start=head.swa_start,
              features_optional=head.header["features"]["optional"], mode=mode)
    w = writer(**kw) if writer is not None else store_at(path, storage_options).writer(os.fspath(path), writeback=fsync, **kw)
    with w:
        write_compacted(chain, w)
        if w.publishes_by_rename:
            w.before_publish = lambda tmp: prove_output(tmp, head)
            return w.commit(fsync=fsync)
        info = w.commit(fsync=fsync)
    options = getattr(w.sink, "options", storage_options)
    try:
        prove_output(w.path, head, storage_options=options)
    except BaseException:
        try:  # published before its proof failed: removed by its ETag (only that version)
            store_at(w.path, options).remove(w.path, version=w.sink.etag)
        except HsnapError:
            pass
        raise
    return info


def compact_path(head, out, *, storage_options=None, fsync: bool = True, max_depth: int = MAX_CHAIN_DEPTH):
    """``hsnap compact HEAD -o OUT``: a rank file's chain into one plain rank file, or a
    set's (every rank's chain) into one plain set; local paths or ``s3://`` URLs. Every
    rank's chain is opened and proved (:meth:`Chain.prove`) before anything is written,
    every byte copied hashed again, every output proved before it is published (:func:`compact`).
    Returns ``(links, bytes)`` (the links of rank 0's chain, and the bytes written)."""
    src = os.fspath(head)
    store = store_at(src, storage_options)
    opened = store.open(src)
    try:
        if not isinstance(opened, SnapshotSet):
            with chain_below(opened, location=src, store=store, max_depth=max_depth) as chain:
                info = compact(chain, out, storage_options=storage_options, fsync=fsync)
                return len(chain), info.file_length
        chains = []
        try:
            for r, snap in opened.ranks.items():
                chains.append(chain_below(snap, location=opened.path, rank=r, store=store, max_depth=max_depth))
            for chain in chains:  # every rank's refusal before the set's first byte
                chain.prove()
            w = store_at(out, storage_options).set_writer(os.fspath(out))
            total = 0
            try:
                for r, chain in enumerate(chains):
                    total += compact(chain, None, fsync=fsync, writer=lambda r=r, **kw: w.rank_writer(r, **kw), proved=True).file_length
                w.commit(tp_size=len(chains))
            except BaseException:
                w.abort()
                raise
            return len(chains[0]), total
        finally:
            for c in chains:
                c.close()
    finally:
        opened.close()


__all__ = ["LinkFacts", "LINK_RULES", "link_problems", "check_link", "check_ref", "check_output_prefix", "base_ref", "Piece", "Chain",
           "chain_below", "open_chain", "compact", "compact_path", "iter_piece", "write_compacted", "prove_output"]
