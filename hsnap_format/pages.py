"""Pages stored once (spec 5.10, 5.11, 7.6, 8.2; format 1.3, feature ``pages``).

Attention KV of a prefix is the same for every request that shares it (a system prompt):
a *page store* holds each full page of it once, as a small *page object* — an hsnap-layout
file (preamble, canonical header, aligned sections, trailer: every guarantee of spec 3 and
7.4) whose sections are one TP rank's rows of one page for every full-attention layer. A
snapshot that *references* pages holds only the rows around them (before its first page
and after its last), its sliding-window rows, its recurrent state and its record; its
header names, per page, the page's key and root digest.

Keys are SGLang's own page hash chain (``get_hash_str`` of ``sglang.srt.mem_cache.utils``,
what HiCache stores pages under): ``key_i = SHA-256(key_{i-1} ‖ the page's token ids as
u32 LE)``, ``key_{-1}`` empty. A page object is named ``<namespace id>-<key>-<root
digest>.hpage``: the *namespace* (model, weights, engine, TP size and rank, attention
layout and dtype, sharding, page size) keeps a page of other weights or another shard from
ever matching, and the root digest makes the name content-addressed — two requests whose
rows of a page are the same bytes share one object; other bytes (KV computed in another
batch can differ in its last bits) are another object, so a restore is always exact.

The page store is a directory (or ``s3://`` prefix) beside the snapshots: ``pages.store``
names it. Writers follow spec 8.2 — a pending-reference marker before any page is put or
reused, no sweep in progress after it, every page verified or put, then the snapshot — and
:func:`collect_pages` (``hsnap gc --pages``) sweeps only pages no committed snapshot beside
the store references and no live marker protects, proving each by its content.

Pure: numpy, xxhash and hashlib; no torch, no SGLang (``hsnap_io`` supplies SGLang's own
``get_hash_str`` through ``keys=``, and :func:`chain_keys` is the same algorithm).
"""

from __future__ import annotations

import functools
import hashlib
import os
import socket
import time
import uuid
from dataclasses import dataclass, field
from typing import Callable, Iterable, Sequence

import numpy as np
import xxhash

from . import canonical
from .errors import (
    BadMagicError,
    DigestMismatchError,
    HsnapError,
    HsnapIOError,
    MalformedHeaderError,
    PageError,
    Phrase,
    SnapshotExistsError,
    TruncatedError,
    UnsupportedFeatureError,
)
from .layout import SectionSpec, namespace, namespace_id, page_range, page_sections
from .reader import Snapshot
from .records import ATTENTION_KINDS, AttentionGeometry, Geometry, Identity, PagesRef, RequestRecord, ShardAxis, HeaderFields
from .spec import (
    BYTE_ORDER_MARK,
    DEFAULT_DIGEST,
    DIGEST_ALGORITHMS,
    FEATURE_MINOR,
    HEADER_OFFSET,
    MAGIC,
    MAJOR,
    MAX_JSON_DEPTH,
    MAX_HEADER_BYTES,
    MAX_MARKER_BYTES,
    MAX_PAGE_REFS,
    MAX_PAGE_SIZE,
    PAGE_FORMAT,
    PAGE_MARKERS_DIR,
    PAGE_NAME_RE,
    PAGE_SUFFIX,
    PAGES_FEATURE,
    PENDING_REFS_SUFFIX,
    PREAMBLE,
    STAGING_DIR_MARK,
    SWEEP_SUFFIX,
    TMP_FILE_MARK,
    TRAILER,
    TRAILER_MAGIC,
)
from .source import Store, store_at

_TOKEN_MAX = (1 << 31) - 1  # hsnap token ids are int32 (5.4): SGLang's u32 page form always applies

# spec 8.2 defaults: a writer's pending-reference marker protects its pages for at most
# WRITER_LEASE_S (a writer refreshes it long before); a gc's sweep marker holds writers
# back for at most SWEEP_LEASE_S, and a gc stops removing at half of that.
WRITER_LEASE_S = 3600.0
SWEEP_LEASE_S = 300.0


# ------------------------------------------------------------------------- keys


def _u32(tokens, path=None, where: str = "tokens") -> bytes:
    arr = np.asarray(tokens)
    if arr.size and (arr.dtype.kind not in "iu" or int(arr.min()) < 0 or int(arr.max()) > _TOKEN_MAX):
        found = str(arr.dtype) if arr.dtype.kind not in "iu" else (int(arr.min()) if int(arr.min()) < 0 else int(arr.max()))
        raise MalformedHeaderError(path, where, f"token ids in 0..{_TOKEN_MAX}", found)
    return np.ascontiguousarray(arr, dtype="<u4").tobytes()


def page_key(prior: str | None, tokens) -> str:
    """One link of SGLang's page hash chain: SHA-256 of the prior key's 32 bytes (none for
    the first page) and the page's token ids as little-endian u32, hex."""
    h = hashlib.sha256()
    if prior is not None:
        h.update(bytes.fromhex(prior))
    h.update(_u32(tokens))
    return h.hexdigest()


def chain_keys(tokens, page_size: int) -> list[str]:
    """The keys of every full page of ``tokens`` (SGLang ``get_hash_str(tokens, None,
    page_size)`` on whole pages): the pure form of what :mod:`hsnap_io.pagestore` asks SGLang."""
    data = np.asarray(tokens)
    keys: list[str] = []
    for i in range(len(data) // page_size):
        keys.append(page_key(keys[-1] if keys else None, data[i * page_size : (i + 1) * page_size]))
    return keys


def request_tokens(record: RequestRecord) -> np.ndarray:
    """Token id of every position: prompt, then output (position p holds token p's KV)."""
    return np.concatenate([np.asarray(record.prompt_ids, dtype=np.int32), np.asarray(record.output_ids, dtype=np.int32)])


def page_name(nid: str, key: str, root: str) -> str:
    return f"{nid}-{key}-{root}{PAGE_SUFFIX}"


# ------------------------------------------------------------------------- page objects (spec 5.11)

_PAGE_TOP_KEYS = frozenset({"format", "features", "digest", "namespace", "page", "sections"})
PAGE_FEATURES: frozenset[str] = frozenset()  # spec 5.11: the required features a page object may list (1.3: none)
_NS_KEYS = frozenset({"attention", "engine", "model_id", "page_size", "sharding", "tp_rank", "tp_size", "weights_hash", "weights_version"})
_NS_ATT_KEYS = frozenset({"dtype", "heads", "k_head_dim", "kind", "kv_lora_rank", "layers", "qk_rope_head_dim", "storage_dtype", "v_head_dim"})
_NS_AXIS_KEYS = frozenset({"axis", "global", "parts"})  # an AXIS of 5.7: unknown keys of the file's own stay out of the namespace
_HEX = frozenset("0123456789abcdef")


def _is_hex(v, n: int) -> bool:
    return isinstance(v, str) and len(v) == n and set(v) <= _HEX


def parse_page_header(data: bytes, path) -> dict:
    """A page object's header: canonical JSON (4), its six keys, ``format`` "hsnap-page",
    ``features`` as in 5.6, known required features and digest (spec 5.11, 7.1 steps 13-14)."""
    try:
        obj = canonical.loads(data, max_depth=MAX_JSON_DEPTH)
    except canonical.CanonicalError as e:
        raise MalformedHeaderError(path, "header", detail=str(e)) from None
    if not isinstance(obj, dict):
        raise MalformedHeaderError(path, "header", "an object", type(obj).__name__)
    if obj.get("format", PAGE_FORMAT) != PAGE_FORMAT:
        raise MalformedHeaderError(path, "header.format", PAGE_FORMAT, obj["format"])
    missing = _PAGE_TOP_KEYS - obj.keys()
    if missing:
        raise MalformedHeaderError(path, "header", f"keys {sorted(_PAGE_TOP_KEYS)}", f"missing {sorted(missing)}")
    feats = obj["features"]
    if not isinstance(feats, dict) or not all(isinstance(feats.get(k), list) for k in ("required", "optional")):
        raise MalformedHeaderError(path, "header.features", "{required: [...], optional: [...]}", feats)
    for k in ("required", "optional"):
        bad = [f for f in feats[k] if not isinstance(f, str)]
        if bad:
            raise MalformedHeaderError(path, f"header.features.{k}", "strings only", bad[0])
    unknown = [f for f in feats["required"] if f not in PAGE_FEATURES]
    if unknown:  # a snapshot's features (delta, sampler-rng-state ...) mean nothing in a page
        raise UnsupportedFeatureError(path, "header.features.required", sorted(PAGE_FEATURES), unknown)
    if not isinstance(obj["digest"], str) or obj["digest"] not in DIGEST_ALGORITHMS:
        raise UnsupportedFeatureError(path, "header.digest", DIGEST_ALGORITHMS, obj["digest"])
    return obj


def _exact_keys(obj, keys: frozenset, where: str, path) -> None:
    if not isinstance(obj, dict) or obj.keys() != keys:
        found = sorted(obj) if isinstance(obj, dict) else type(obj).__name__
        raise MalformedHeaderError(path, where, Phrase(f"an object with exactly the keys {sorted(keys)}"), found)


def parse_namespace(obj, path=None) -> tuple[Identity, Geometry, int]:
    """A page's ``namespace`` (spec 5.10): exactly its keys (its bytes make the id), each in
    its type and range; the identity, attention-only geometry and page size it describes."""
    _exact_keys(obj, _NS_KEYS, "namespace", path)
    _exact_keys(obj["attention"], _NS_ATT_KEYS, "namespace.attention", path)
    f = HeaderFields(obj, "namespace", path)
    e = f.sub("engine")
    _exact_keys(obj["engine"], frozenset({"commit", "name", "version"}), "namespace.engine", path)
    from .records import Engine

    identity = Identity(model_id=f.str("model_id"), weights_version=f.str("weights_version"), weights_hash=f.str("weights_hash"),
                        engine=Engine(e.str("name"), e.str("version"), e.str("commit")), tp_size=f.int("tp_size", lo=1, hi=1 << 16),
                        tp_rank=f.int("tp_rank", hi=1 << 16))
    if identity.tp_rank >= identity.tp_size:
        raise MalformedHeaderError(path, "namespace.tp_rank", f"< tp_size {identity.tp_size}", identity.tp_rank)
    page_size = f.int("page_size", lo=1, hi=MAX_PAGE_SIZE)
    a = dict(obj["attention"])
    if a.get("kind") not in ATTENTION_KINDS:
        raise MalformedHeaderError(path, "namespace.attention.kind", f"one of {ATTENTION_KINDS}", a.get("kind"))
    try:  # the geometry rules of 5.2/5.6 (field names as the namespace spells them)
        att = AttentionGeometry.from_header({**a, "page_size": page_size}, path)
    except MalformedHeaderError as err:
        raise MalformedHeaderError(path, err.field.replace("geometry.attention", "namespace.attention"), err.expected, err.found) from None
    if not att.layers:
        raise MalformedHeaderError(path, "namespace.attention.layers", "at least one full-attention layer", [])
    sh = obj["sharding"]
    sharding = None
    if sh is not None:
        from .records import Sharding

        _exact_keys(sh, _NS_AXIS_KEYS, "namespace.sharding", path)  # exactly, at every level: its bytes make the id
        axis = ShardAxis.from_header(sh, "namespace.sharding", path)
        if axis.axis != 1 or axis.local_size != att.heads:
            raise MalformedHeaderError(path, "namespace.sharding", Phrase(f"axis 1 with parts summing to heads {att.heads}"), sh)
        sharding = Sharding(attention=axis)
    return identity, Geometry(attention=att, sharding=sharding), page_size


_NAMESPACES: dict[str, tuple] = {}  # every page of a store shares a few namespaces: parsed and hashed once


def _parsed_namespace(obj, path=None) -> tuple[Identity, Geometry, int, str]:
    """:func:`parse_namespace` and the namespace id, cached by the object's JSON text (equal
    texts are equal objects, so equal canonical bytes; a refusal is never cached)."""
    import json

    key = json.dumps(obj, sort_keys=True)
    hit = _NAMESPACES.get(key)
    if hit is None:
        hit = (*parse_namespace(obj, path), namespace_id(obj))
        if len(_NAMESPACES) >= 64:
            _NAMESPACES.clear()
        _NAMESPACES[key] = hit
    return hit


@dataclass(frozen=True)
class PageHeader:
    """A page object's ``page`` (spec 5.11)."""

    namespace_id: str
    index: int
    prior: str | None
    key: str
    tokens: tuple[int, ...]


def parse_page_fields(obj, page_size: int, path=None) -> PageHeader:
    _exact_keys(obj, frozenset({"index", "key", "namespace_id", "prior", "tokens"}), "page", path)
    f = HeaderFields(obj, "page", path)
    index = f.int("index", hi=(1 << 40))
    for k in ("key", "namespace_id"):
        if not _is_hex(obj[k], 64):
            raise MalformedHeaderError(path, f"page.{k}", "64 lowercase hex digits", obj[k])
    prior = obj["prior"]
    if (prior is None) != (index == 0) or (prior is not None and not _is_hex(prior, 64)):
        raise MalformedHeaderError(path, "page.prior", "null for page 0, else the previous page's key (64 hex)" , prior)
    tokens = obj["tokens"]
    if not (isinstance(tokens, list) and len(tokens) == page_size
            and all(isinstance(t, int) and not isinstance(t, bool) and 0 <= t <= _TOKEN_MAX for t in tokens)):
        raise MalformedHeaderError(path, "page.tokens", f"{page_size} token ids in 0..{_TOKEN_MAX}",
                                   tokens if not isinstance(tokens, list) else Phrase(f"a list of {len(tokens)}"))
    return PageHeader(obj["namespace_id"], index, prior, obj["key"], tuple(tokens))


@functools.lru_cache(maxsize=64)
def _page_plan(geometry: Geometry, page_size: int) -> tuple[SectionSpec, ...]:
    return tuple(page_sections(geometry, page_size))


class PageObject(Snapshot):
    """A page object, opened with a snapshot reader's machinery (spec 5.11): 7.1 steps 1-18
    with the page's own header keys, then its namespace and page fields, their digests, and
    its section plan. Verification, reads and the guarantees of 7.4 are the reader's own,
    from whatever source it is given (a local file by default, as a rank file)."""

    _parse_header = staticmethod(parse_page_header)

    def _load_request(self) -> None:  # a page has no request: its namespace and page instead
        ident, geometry, page_size, nid = _parsed_namespace(self.header["namespace"], self.path)
        self.identity, self.geometry, self.page_size = ident, geometry, page_size
        self.page = page = parse_page_fields(self.header["page"], page_size, self.path)
        if page.namespace_id != nid:
            raise DigestMismatchError(self.path, "page.namespace_id", page.namespace_id, nid)
        key = page_key(page.prior, page.tokens)
        if page.key != key:
            raise DigestMismatchError(self.path, "page.key", page.key, key)
        plan = _page_plan(geometry, page_size)
        if len(plan) != len(self.sections):
            raise MalformedHeaderError(self.path, "sections", f"{len(plan)} sections (from the namespace)", len(self.sections))
        for i, (e, s) in enumerate(zip(plan, self.sections)):
            if (e.name, e.kind, e.layer, e.dtype, e.shape) != (s.name, s.kind, s.layer, s.dtype, s.shape):
                raise MalformedHeaderError(self.path, f"sections[{i}]", e, SectionSpec(s.name, s.kind, s.layer, s.dtype, s.shape),
                                           detail="table disagrees with the namespace")
        self.base = self.pages = None
        self.swa_start = 0
        self._by_name = {s.name: s for s in self.sections}

    @property
    def name(self) -> str:
        """The name this page object has in a page store (spec 5.11)."""
        return page_name(self.page.namespace_id, self.page.key, self.root_digest)

    def __repr__(self) -> str:
        return f"<hsnap.PageObject {self.path!r} page {self.page.index} of {self.page.namespace_id[:12]}…>"


def open_page(path: str, store: Store | None = None):
    """Open a page object through the store that holds it (spec 5.11 checks)."""
    store = store or store_at(path)
    return PageObject(path, source=store.source(path))


def encode_page(ns: dict, nid: str, index: int, prior: str | None, key: str, tokens, sections: Sequence[tuple[SectionSpec, bytes]]) -> tuple[bytes, str]:
    """The bytes of a page object (spec 5.11) and its root digest (hex): what the reference
    writer of 8 writes, built in memory (a page is small)."""
    from .writer import layout_header, section_nbytes

    specs = [s for s, _ in sections]
    datas = [memoryview(d).cast("B") for _, d in sections]
    for spec, d in zip(specs, datas):
        if d.nbytes != section_nbytes(spec):
            raise HsnapError(None, f"sections[{spec.name}].length", section_nbytes(spec), d.nbytes, detail="page rows")
    digests = [xxhash.xxh3_128_hexdigest(d) for d in datas]
    body = {
        "digest": DEFAULT_DIGEST,
        "features": {"optional": [], "required": []},
        "format": PAGE_FORMAT,
        "namespace": ns,
        "page": {"index": index, "key": key, "namespace_id": nid, "prior": prior, "tokens": [int(t) for t in tokens]},
    }
    header, table, data_offset, end = layout_header(body, specs, digests)
    if len(header) > MAX_HEADER_BYTES:  # R-8-1: a page no reader opens (7.1 step 8) is never written
        raise MalformedHeaderError(None, "header_length", f"<= {MAX_HEADER_BYTES}", len(header), detail=f"a page object of {len(tokens)} positions")
    file_length = end + TRAILER.size
    out = bytearray(file_length)
    header_digest = xxhash.xxh3_128_digest(header)
    root = xxhash.xxh3_128()
    root.update(header_digest)
    for digest in digests:
        root.update(bytes.fromhex(digest))
    root_digest = root.digest()
    pre = PREAMBLE.pack(MAGIC, MAJOR, FEATURE_MINOR[PAGES_FEATURE], BYTE_ORDER_MARK, len(header), data_offset, header_digest, file_length, 0)
    out[:64] = pre[:56] + xxhash.xxh3_64_digest(pre[:56])[::-1]
    out[HEADER_OFFSET : HEADER_OFFSET + len(header)] = header
    for entry, d in zip(table, datas):
        out[entry["offset"] : entry["offset"] + d.nbytes] = d
    tra = TRAILER.pack(TRAILER_MAGIC, file_length, len(specs), root_digest, bytes(16), 0)
    out[end:] = tra[:56] + xxhash.xxh3_64_digest(tra[:56])[::-1]
    return bytes(out), root_digest.hex()


@functools.lru_cache(maxsize=16)
def _worst_page_header(ns_json: str, geometry: Geometry, page_size: int) -> int:
    """The header length of a page of ``page_size`` positions whose every token id has the
    most digits (a page's header is longest then): what every page of the namespace fits in."""
    from .writer import layout_header

    import json

    specs = list(_page_plan(geometry, page_size))
    body = {"digest": DEFAULT_DIGEST, "features": {"optional": [], "required": []}, "format": PAGE_FORMAT, "namespace": json.loads(ns_json),
            "page": {"index": 1 << 40, "key": "0" * 64, "namespace_id": "0" * 64, "prior": "0" * 64, "tokens": [_TOKEN_MAX] * page_size}}
    return len(layout_header(body, specs, ["0" * 32] * len(specs))[0])


def check_page_fits(ns: dict, geometry: Geometry, page_size: int, path=None) -> None:
    """Refuse a namespace whose page objects could exceed the 1 MiB header (spec 5.10, 7.1
    step 8) before any page is put: every page of it must open (R-8-1)."""
    import json

    n = _worst_page_header(json.dumps(ns, sort_keys=True), geometry, page_size)
    if n > MAX_HEADER_BYTES:
        raise MalformedHeaderError(path, "pages.page_size", Phrase(f"a page size whose page objects fit a {MAX_HEADER_BYTES}-byte header"),
                                   Phrase(f"{page_size}: headers up to {n} bytes"))


# ------------------------------------------------------------------------- resolving references (spec 7.6)


@dataclass(frozen=True)
class PageRef:
    """One page a snapshot references: page ``page`` (positions ``page * size`` on) of the
    link ``link``, its ``index`` in the link's ``pages.refs``, its key, root digest and
    where the page object is."""

    link: Snapshot
    index: int
    page: int
    key: str
    root: str
    path: str

    @property
    def size(self) -> int:
        return link_pages(self.link).page_size


def link_pages(link: Snapshot) -> PagesRef:
    """The ``pages`` of a link that references pages (what every reference is made from)."""
    assert link.pages is not None  # callers pass only links whose pages they checked
    return link.pages


def pages_dir(store: Store, location: str, name: str) -> str:
    """Where a link's page store is (spec 5.10): the directory ``name`` beside ``location`` —
    the rank file, or the set directory of a rank of a set."""
    return store.join(store.split(location)[0], name)


def page_refs(link: Snapshot, pages_dir: str, store: Store) -> list[PageRef]:
    """The page references of one link, with the path of each page object."""
    p = link_pages(link)
    first, _ = page_range(link.base_position, link.state_position, p.page_size)
    return [PageRef(link, i, first + i, key, root, store.join(pages_dir, page_name(p.namespace_id, key, root)))
            for i, (key, root) in enumerate(p.refs)]


def check_keys(link: Snapshot, tokens: np.ndarray, keys_fn: Callable | None = None) -> None:
    """The keys a link names are SGLang's page hash chain over its own token ids (R-7.6-1):
    ``DigestMismatchError`` naming the first reference whose key is not the computed one."""
    p = link_pages(link)
    first, count = page_range(link.base_position, link.state_position, p.page_size)
    span = np.asarray(tokens[: (first + count) * p.page_size])
    if count and len(negative := np.flatnonzero(span < 0)):  # spec 5.10: a key is over ids as u32; an int32 below 0 has none (every later key depends on it)
        q = int(negative[0])
        i = max(q // p.page_size - first, 0)
        raise DigestMismatchError(link.path, f"pages.refs[{i}] (key of page {first + i})", p.refs[i][0],
                                  Phrase(f"no key: token id {int(span[q])} at position {q}"))
    keys = (keys_fn or chain_keys)(span, p.page_size)
    for i, (key, _) in enumerate(p.refs):
        if keys[first + i] != key:
            raise DigestMismatchError(link.path, f"pages.refs[{i}] (key of page {first + i})", key, keys[first + i])


def check_page(page, ref: PageRef, tokens: np.ndarray | None = None) -> None:
    """The page object found is the one referenced (R-7.6-2): its root digest, namespace,
    index, key and (given the request's ``tokens``) tokens."""
    link, pages = ref.link, link_pages(ref.link)
    where = f"pages.refs[{ref.index}]"
    if page.root_digest != ref.root:
        raise DigestMismatchError(link.path, f"{where}.root_digest ({page.path})", ref.root, page.root_digest)
    problems = [
        ("namespace_id", pages.namespace_id, page.page.namespace_id),
        ("index", ref.page, page.page.index),
        ("key", ref.key, page.page.key),
    ]
    if tokens is not None:
        S = pages.page_size
        problems.append(("tokens", [int(t) for t in tokens[ref.page * S : (ref.page + 1) * S]], list(page.page.tokens)))
    for fld, expected, found in problems:
        if expected != found:
            raise PageError(link.path, f"{where}.{fld} ({page.path})", expected, found, detail="not the page referenced")


def open_checked(ref: PageRef, store: Store, tokens: np.ndarray | None = None):
    """Open the page object ``ref`` names and check it (R-7.6-2); a missing one is a
    :class:`PageError`. The caller closes it."""
    try:
        page = open_page(ref.path, store)
    except HsnapIOError as e:
        if isinstance(getattr(e, "os_error", None), FileNotFoundError):
            raise PageError(ref.link.path, f"pages.refs[{ref.index}]", Phrase(f"the page object {ref.path}"), Phrase("missing")) from None
        raise
    try:
        check_page(page, ref, tokens)
    except BaseException:
        page.close()
        raise
    return page


# ------------------------------------------------------------------------- writing (spec 8.2)


def _marker_text(fmt: str, **fields) -> bytes:
    return canonical.dumps({"format": fmt, "host": socket.gethostname(), "pid": os.getpid(), **fields}) + b"\n"


def parse_marker(data: bytes, path=None) -> dict:
    """A marker of spec 8.2: one canonical JSON object and a newline."""
    if not data.endswith(b"\n"):
        raise MalformedHeaderError(path, "marker", "one JSON object and a newline", Phrase(f"{len(data)} bytes, no final newline"))
    try:
        obj = canonical.loads(data[:-1], max_depth=4)
    except canonical.CanonicalError as e:
        raise MalformedHeaderError(path, "marker", detail=str(e)) from None
    if not isinstance(obj, dict) or obj.get("format") not in ("hsnap-pending-refs", "hsnap-page-sweep"):
        raise MalformedHeaderError(path, "marker.format", "hsnap-pending-refs or hsnap-page-sweep", obj.get("format") if isinstance(obj, dict) else obj)
    if obj["format"] == "hsnap-pending-refs":
        keys = obj.get("keys")
        if not isinstance(keys, list) or not all(isinstance(k, str) and len(k) == 129 and k[64] == "-" and _is_hex(k[:64], 64) and _is_hex(k[65:], 64) for k in keys):
            raise MalformedHeaderError(path, "marker.keys", "a list of <namespace id>-<key>", Phrase("something else"))
    return obj


@dataclass(frozen=True)
class PagePlan:
    """The pages a file will reference (:meth:`PageStore.plan_pages`): pages ``first ..
    first + count - 1`` of ``page_size`` positions, the keys of pages ``0 .. first + count
    - 1`` and the request's token ids."""

    store: str
    page_size: int
    namespace: dict
    namespace_id: str
    first: int
    count: int
    keys: tuple[str, ...]
    tokens: np.ndarray
    geometry: Geometry

    def placeholder(self) -> PagesRef:
        """The file's ``pages`` with zero root digests: what a writer plans its header with
        before the pages are put (every value fixed-width, so the header keeps its length)."""
        return PagesRef(self.store, self.page_size, self.namespace_id, tuple((k, "0" * 32) for k in self.keys[self.first :]))


@dataclass
class PageStats:
    """What a page store session did: pages and bytes put, and reused (stored once)."""

    pages_put: int = 0
    bytes_put: int = 0
    pages_reused: int = 0
    bytes_reused: int = 0
    pages_verified: int = 0  # existing pages read and hashed before reuse
    pages_replaced: int = 0  # existing pages that failed verification, replaced by this writer's bytes
    markers: int = 0
    sweep_waits: int = 0


class PageStore:
    """A page store being written: a directory (or ``s3://`` prefix) beside the snapshots
    whose full pages it holds (spec 5.10, 8.2). One object per writer session — an export,
    or a whole drain of many requests — so that a page shared by many snapshots is put once,
    verified once, and protected from a concurrent gc while the session lasts. Close it
    (a context manager) to drop its markers.

    ``keys(tokens, page_size)``: the page hash chain (default :func:`chain_keys`;
    :mod:`hsnap_io.pagestore` passes SGLang's own ``get_hash_str``). ``page_size``: the
    page the keys and objects use (default: the pool's)."""

    def __init__(self, directory, *, page_size: int | None = None, storage_options=None, keys: Callable | None = None,
                 verify_existing: bool = True, writer_lease: float = WRITER_LEASE_S, sweep_lease: float = SWEEP_LEASE_S,
                 poll_s: float | None = None) -> None:
        self.directory = os.fspath(directory).rstrip("/") or "/"
        self.store = store_at(self.directory, storage_options)
        self.parent, self.name = self.store.split(self.directory)
        if not self.name or self.name in (".", "..") or TMP_FILE_MARK in self.name or STAGING_DIR_MARK in self.name:
            raise PageError(self.directory, "page store", Phrase("a directory name (not a temporary's)"), self.name)
        self.markers_dir = self.store.join(self.directory, PAGE_MARKERS_DIR)
        if page_size is not None and (type(page_size) is not int or not 1 <= page_size <= MAX_PAGE_SIZE):
            raise PageError(self.directory, "page_size", f"1..{MAX_PAGE_SIZE} positions (spec 5.10)", page_size)
        self.page_size = page_size
        self.keys = keys or chain_keys
        self.verify_existing = verify_existing
        self.writer_lease, self.sweep_lease = writer_lease, sweep_lease
        self.poll_s = poll_s if poll_s is not None else (0.02 if self.store.local else 0.25)
        self.stats = PageStats()
        self._markers: list[tuple[str, str, float]] = []  # (path, version, monotonic time put)
        self._protected: set[str] = set()  # "<nid>-<key>" named by a marker of this session
        self._present: set[str] = set()  # page names proved present after their marker's wait
        self._made = False

    # -- markers (spec 8.2, writers W1-W2)
    def _makedirs(self) -> None:
        if not self._made:
            self.store.makedirs(self.directory)
            self.store.makedirs(self.markers_dir)
            self._made = True

    def _put_marker(self, keys: Iterable[str]) -> None:
        self._makedirs()
        path = self.store.join(self.markers_dir, f"{uuid.uuid4().hex}{PENDING_REFS_SUFFIX}")
        version = self.store.put_bytes(path, _marker_text("hsnap-pending-refs", keys=sorted(keys)))
        self._markers.append((path, version, time.monotonic()))
        self.stats.markers += 1

    def wait_for_sweeps(self) -> None:
        """Return once a listing of the markers shows no gc sweep in progress (spec 8.2, W2),
        or every sweep seen has been waited for ``sweep_lease`` (a gc that died)."""
        seen: dict[str, float] = {}
        while True:
            sweeps = [e.path for e in _list_quiet(self.store, self.markers_dir) if e.path.endswith(SWEEP_SUFFIX)]
            now = time.monotonic()
            for s in sweeps:
                seen.setdefault(s, now)
            if not sweeps or all(now - seen[s] >= self.sweep_lease for s in sweeps):
                return
            self.stats.sweep_waits += 1
            time.sleep(self.poll_s)

    def protect(self, keys: Sequence[str]) -> None:
        """Make sure a marker of this session names every ``<nid>-<key>`` of ``keys`` and no
        sweep started before it is still running (spec 8.2, W1-W2): from then on no gc
        removes a page of those keys while this session is open."""
        self._refresh()
        new = [k for k in dict.fromkeys(keys) if k not in self._protected]
        if not new:
            return
        self._put_marker(new)
        self.wait_for_sweeps()
        self._protected.update(new)

    def _refresh(self) -> None:
        """A session older than a quarter of the writer lease re-puts one marker naming
        everything it protects (a gc ignores markers older than the lease), then drops the old."""
        if not self._markers or time.monotonic() - self._markers[0][2] < self.writer_lease / 4:
            return
        old, self._markers = self._markers, []
        self._put_marker(self._protected)
        self.wait_for_sweeps()
        for path, version, _ in old:
            _remove_quiet(self.store, path, version)

    # -- pages (W3)
    def beside(self, snapshot_path: str, in_set: bool = False) -> None:
        """Refuse a snapshot that does not lie beside this store (spec 5.10: ``pages.store``
        is a name beside the file, or beside the set directory holding it)."""
        container = self.store.split(os.fspath(snapshot_path))[0]
        if in_set:
            container = self.store.split(container)[0]
        mine = self.parent
        if self.store.local:
            container, mine = os.path.realpath(container or "."), os.path.realpath(mine or ".")
        else:
            container, mine = container.rstrip("/"), mine.rstrip("/")
        if container != mine:
            raise PageError(snapshot_path, "pages.store", Phrase(f"a page store beside the snapshot (in {container})"), self.directory)

    def plan_pages(self, *, path, identity: Identity, geometry: Geometry, record: RequestRecord, base_position: int,
                   in_set: bool = False) -> "PagePlan | None":
        """Which full pages a file at ``path`` holding rows ``base_position ..
        state_position - 1`` references, and their keys (SGLang's page hash chain over the
        record's token ids); None when no full page fits (the file is then plain). Checks
        that the file lies beside this store; puts nothing."""
        att = geometry.attention
        if att is None or not att.layers:
            return None
        S = self.page_size or att.page_size
        if type(S) is not int or not 1 <= S <= MAX_PAGE_SIZE:  # spec 5.10: a larger page might not open
            raise MalformedHeaderError(path, "pages.page_size", f"1..{MAX_PAGE_SIZE}", S)
        first, count = page_range(base_position, record.state_position, S)
        if not count:
            return None
        if count > MAX_PAGE_REFS:  # no 1 MiB header holds them: refused before any key is computed
            raise MalformedHeaderError(path, "pages.refs", Phrase(f"at most {MAX_PAGE_REFS} references (a 1 MiB header)"), count)
        self.beside(path, in_set)
        ns = namespace(identity, geometry, S)
        check_page_fits(ns, geometry, S, path)
        tokens = request_tokens(record)
        keys = self.keys(tokens[: (first + count) * S], S)
        if len(keys) != first + count:
            raise HsnapError(path, "pages (keys)", first + count, len(keys), detail="the page hash chain gave another number of keys")
        return PagePlan(self.name, S, ns, namespace_id(ns), first, count, tuple(keys), tokens, geometry)

    def put_pages(self, plan: "PagePlan", rows: Callable[[str, int, int], bytes]) -> PagesRef:
        """Put (or find, verified) every page of ``plan`` once a marker protects it and no gc
        sweep that started before is still running (spec 8.2, W1-W3); returns the
        :class:`PagesRef` the file records. ``rows(name, start, stop)``: the bytes of section
        ``name``'s rows of positions ``start .. stop - 1``. Every page is durable when this
        returns; the snapshot is committed after it (W4)."""
        S, nid, keys, tokens = plan.page_size, plan.namespace_id, plan.keys, plan.tokens
        self.protect([f"{nid}-{k}" for k in keys[plan.first :]])
        specs = page_sections(plan.geometry, S)
        refs = []
        for j in range(plan.first, plan.first + plan.count):
            data, root = encode_page(plan.namespace, nid, j, keys[j - 1] if j else None, keys[j], tokens[j * S : (j + 1) * S],
                                     [(spec, rows(spec.name, j * S, (j + 1) * S)) for spec in specs])
            self._ensure(page_name(nid, keys[j], root), data, plan.geometry, S)
            refs.append((keys[j], root))
        return PagesRef(store=plan.store, page_size=S, namespace_id=nid, refs=tuple(refs))

    def store_pages(self, *, path, identity: Identity, geometry: Geometry, record: RequestRecord, base_position: int,
                    rows: Callable[[str, int, int], bytes], in_set: bool = False) -> PagesRef | None:
        """:meth:`plan_pages` then :meth:`put_pages`."""
        plan = self.plan_pages(path=path, identity=identity, geometry=geometry, record=record, base_position=base_position, in_set=in_set)
        return None if plan is None else self.put_pages(plan, rows)

    def _ensure(self, name: str, data: bytes, geometry: Geometry, S: int) -> None:
        """A page in the store, once: proved present already (this session), found and
        verified (another writer put it: stored once), or put now (never overwriting)."""
        if name in self._present:
            self.stats.pages_reused += 1
            self.stats.bytes_reused += len(data)
            return
        path = self.store.join(self.directory, name)
        try:
            found = self.store.exists(path)
            if not found:
                self.store.put_bytes(path, data)
                self.stats.pages_put += 1
                self.stats.bytes_put += len(data)
        except SnapshotExistsError:  # another writer put it meanwhile
            found = True
        if found:
            if self.verify_existing and not self._verify_or_replace(path, name, data):
                self._present.add(name)
                return
            self.stats.pages_reused += 1
            self.stats.bytes_reused += len(data)
        self._present.add(name)

    def _verify_or_replace(self, path: str, name: str, data: bytes) -> bool:
        """Whether the page found under ``name`` is reused as it is (it opens as the page its
        name says and verifies); a damaged one — its name is content-addressed, so any bytes
        but ``data`` are damage — is replaced (spec 8.2, W3): that version only removed, then
        ``data`` put (never overwriting), so the name holds the damaged bytes, nothing or the
        page, never a torn file. False when it was replaced."""
        try:
            self._verify_existing(path, name)
            return True
        except HsnapError as err:
            if isinstance(err, HsnapIOError) and not isinstance(getattr(err, "os_error", None), FileNotFoundError):
                raise  # the store failed: nothing is known of the page
            damage = err
        found: bytes | None
        version: str | None
        try:
            found, version = self.store.read_bytes(path, len(data))
        except HsnapError as err:
            if not isinstance(getattr(err, "os_error", None), FileNotFoundError):
                raise PageError(path, "page object", Phrase("the page its name says"), Phrase(f"damaged ({type(damage).__name__}: {damage})"),
                                detail=f"and not replaceable ({type(err).__name__}); hsnap gc --pages --verify lists it") from None
            found = version = None
        if found == data:  # replaced by another writer meanwhile
            return True
        if version is not None:
            try:
                self.store.remove(path, version=version)
            except HsnapError as err:
                if not isinstance(getattr(err, "os_error", None), FileNotFoundError):
                    raise
        try:
            self.store.put_bytes(path, data)
        except SnapshotExistsError:  # another writer replaced it first: what is there now must verify
            self._verify_existing(path, name)
            return True
        self.stats.pages_replaced += 1
        self.stats.pages_put += 1
        self.stats.bytes_put += len(data)
        return False

    def _verify_existing(self, path: str, name: str) -> None:
        """A page found in the store is used only once it opens as the page its name says
        and every byte verifies (else :meth:`_verify_or_replace` replaces it)."""
        page = open_page(path, self.store)
        try:
            if page.name != name:
                raise PageError(path, "name", name, page.name, detail="a page object under another page's name")
            page.verify()
        finally:
            page.close()
        self.stats.pages_verified += 1

    def close(self) -> None:
        """Drop this session's markers (after its snapshots are committed)."""
        markers, self._markers = self._markers, []
        for path, version, _ in markers:
            _remove_quiet(self.store, path, version)
        self._protected.clear()
        self._present.clear()

    def __enter__(self) -> "PageStore":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def __repr__(self) -> str:
        return f"<hsnap.PageStore {self.directory!r}: {self.stats.pages_put} pages put, {self.stats.pages_reused} reused>"


def _list_quiet(store: Store, container: str):
    """A listing of ``container``; a directory that does not exist lists nothing (only the
    directory itself: an entry that went away meanwhile is simply not listed by the store)."""
    try:
        return store.list(container)
    except HsnapIOError as e:
        if isinstance(getattr(e, "os_error", None), FileNotFoundError) and e.path is not None and e.path.rstrip("/") == container.rstrip("/"):
            return []
        raise


def _remove_quiet(store: Store, path: str, version: str) -> None:
    try:
        store.remove(path, version=version)
    except (HsnapError, OSError):  # gone, or a store that failed: a stale marker only delays gc
        pass


def write_paged_snapshot(path, *, identity: Identity, geometry: Geometry, record: RequestRecord, state: dict, pages: PageStore,
                         swa_start: int = 0, base=None, storage_options=None, **kw):
    """Write a snapshot whose full pages go to ``pages`` (the pure counterpart of
    ``hsnap_io.export_request(..., pages=)``). ``state``: section name -> the *whole* section
    at ``record.state_position`` (what a plain snapshot holds: full-attention rows from
    position 0, sliding-window rows from ``swa_start``); ``base``: a delta's
    :class:`~hsnap_format.records.BaseRef`. Returns the writer's commit info."""
    from .layout import ROW_KINDS, first_position, inline_runs

    B = 0 if base is None else base.state_position
    plan = pages.plan_pages(path=os.fspath(path), identity=identity, geometry=geometry, record=record, base_position=B)

    def rows(name: str, a: int, b: int) -> bytes:
        arr = np.ascontiguousarray(state[name])
        return arr[a:b].reshape(-1).view(np.uint8).tobytes()

    with store_at(path, storage_options).writer(os.fspath(path), identity=identity, geometry=geometry, record=record, swa_start=swa_start,
                                                 base=base, pages=None if plan is None else plan.placeholder(), **kw) as w:
        if plan is not None:
            w.set_pages(pages.put_pages(plan, rows))
        for spec in w.pending_state_sections():
            arr = np.ascontiguousarray(state[spec.name])
            if spec.kind in ROW_KINDS:
                origin = first_position(spec.kind, swa_start)
                runs = [(max(B, origin) if spec.kind not in ("attn_k", "attn_v", "mla_kv") else B, record.state_position)]
                if plan is not None and spec.kind in ("attn_k", "attn_v", "mla_kv"):
                    runs = inline_runs(B, record.state_position, plan.page_size)
                arr = np.concatenate([arr[a - origin : b - origin] for a, b in runs]) if runs else arr[:0]
            w.write_section(spec.name, arr)
        return w.commit()


# ------------------------------------------------------------------------- gc: mark and sweep (spec 8.2)


@dataclass
class PageVerdict:
    """One object of a page store's directory, with its size and gc's verdict."""

    path: str
    bytes: int = 0
    age_s: float = 0.0
    removable: bool = False
    reason: str = ""
    action: str = "kept"  # kept | would remove | removed | gone | failed
    _version: str = field(default="", repr=False)

    def to_dict(self) -> dict:
        return {k: v for k, v in self.__dict__.items() if not k.startswith("_")}


@dataclass
class PageReport:
    """What ``hsnap gc --pages`` found: every page object (and marker) with its verdict, the
    committed snapshots it read, and why a sweep was refused, if it was."""

    directory: str
    store: str
    snapshots: list[str] = field(default_factory=list)
    referenced: int = 0
    protected: int = 0
    refused: list[str] = field(default_factory=list)
    skipped: list[str] = field(default_factory=list)  # files beside the store that are not snapshots, and why
    damaged: list[str] = field(default_factory=list)  # with verify: page objects that fail to open as their name or to verify
    items: list[PageVerdict] = field(default_factory=list)

    def to_dict(self) -> dict:
        d = {k: v for k, v in self.__dict__.items() if k != "items"}
        d["items"] = [i.to_dict() for i in self.items]
        return d


def _basename(store: Store, path: str) -> str:
    return store.split(path)[1]


def _snapshot_refs(snap, store_name: str) -> set[str]:
    p = snap.pages
    if p is None or p.store != store_name:
        return set()
    return {page_name(p.namespace_id, k, r) for k, r in p.refs}


def _not_a_snapshot(e: HsnapError) -> bool:
    """An object that is not a committed snapshot by its own bytes: another file format, a
    writer's unfinished temporary (spec 8.1), or a page object."""
    return isinstance(e, BadMagicError) or (isinstance(e, MalformedHeaderError) and e.field == "header.format" and e.found == PAGE_FORMAT)


_MARK_ROUNDS = 64


def _mark_files(store: Store, container: str, store_name: str, report: PageReport, marked: set[str]) -> None:
    """Mark what every committed snapshot directly in ``container`` references."""
    for e in _list_quiet(store, container):
        try:
            snap = store.open(e.path)
        except HsnapError as err:
            if isinstance(getattr(err, "os_error", None), FileNotFoundError):
                continue
            if _not_a_snapshot(err) or (isinstance(err, TruncatedError) and e.size < len(MAGIC)):  # no magic: not a snapshot (8.2 step 4)
                report.skipped.append(f"{e.path}: not a snapshot ({e.size} bytes, {type(err).__name__})")
                continue
            report.refused.append(f"{e.path}: cannot be read ({type(err).__name__}: {err}): the pages it references are unknown")
            continue
        with snap:
            report.snapshots.append(e.path)
            marked |= _snapshot_refs(snap, store_name)


def mark(directory: str, store_name: str, store: Store, report: PageReport) -> set[str]:
    """Every page name a committed snapshot beside the page store references (spec 8.2, G3):
    each file directly in ``directory`` and in each of its directories (one level: sets,
    and the staging directories of sets not yet renamed — their rank files are committed),
    the store itself excepted; directories are listed again until no new one appears (a set
    renamed from its staging name meanwhile). A file that starts like a snapshot but cannot
    be read — it might reference pages — or one that requires a feature this reader lacks
    refuses the sweep (``report.refused``)."""
    marked: set[str] = set()
    pages_dir = store.join(directory, store_name).rstrip("/")
    _mark_files(store, directory, store_name, report, marked)
    seen: set[str] = set()
    for _ in range(_MARK_ROUNDS):
        new = [d for d in store.subdirs(directory) if d.rstrip("/") != pages_dir and d not in seen]
        if not new:
            return marked
        for d in new:
            seen.add(d)
            _mark_files(store, d, store_name, report, marked)
    report.refused.append(f"{directory}: directories kept appearing while marked ({_MARK_ROUNDS} rounds): run gc again")
    return marked


def _protected_keys(store: Store, markers_dir: str, report: PageReport, lease: float, now: float) -> set[str]:
    """Keys named by live pending-reference markers (spec 8.2, G3). A marker that cannot be
    read refuses the sweep; one older than ``lease`` (its writer died) protects nothing."""
    keys: set[str] = set()
    for e in _list_quiet(store, markers_dir):
        if not e.path.endswith(PENDING_REFS_SUFFIX):
            continue
        age = max(0.0, now - e.modified)
        v = PageVerdict(e.path, e.size, age, _version=e.version)
        report.items.append(v)
        try:
            data, _ = store.read_bytes(e.path, MAX_MARKER_BYTES)
            obj = parse_marker(data, e.path)
        except HsnapError as err:
            if isinstance(getattr(err, "os_error", None), FileNotFoundError):
                v.action, v.reason = "gone", "removed by its writer meanwhile"
                continue
            v.reason = f"unreadable marker ({type(err).__name__}): the sweep is refused"
            report.refused.append(f"{e.path}: {err}")
            continue
        if age >= lease:
            v.reason = f"a pending-reference marker older than {lease:g} s (its writer stopped): protects nothing"
            continue
        v.reason = f"a writer's pending references ({len(obj['keys'])} keys): protects their pages"
        keys.update(obj["keys"])
    return keys


def collect_pages(directory, *, store_name: str = "pages", remove: bool = False, older_than: float | None = None,
                  announce=None, storage_options=None, writer_lease: float = WRITER_LEASE_S, sweep_lease: float = SWEEP_LEASE_S,
                  verify: bool = False) -> PageReport:
    """Mark and sweep the page store ``directory/store_name`` (spec 8.2): list its pages,
    then the live pending-reference markers, then every committed snapshot beside it; a
    page that none references or protects (and, with ``older_than``, at least that old) is
    removable. With ``remove``, gc first puts its sweep marker, then removes each such page
    after proving, one by one, that it is the page object its name says — naming it and its
    size right before (``announce(path, bytes)``) — only in the version it listed, and stops
    removing after half the sweep lease. With ``verify``, every page object is also read
    and verified, and each damaged one listed (``report.damaged``; the next writer of that
    page replaces it). Local directory or ``s3://`` prefix."""
    directory = os.fspath(directory).rstrip("/") or "/"
    store = store_at(directory, storage_options)
    pages_dir = store.join(directory, store_name)
    markers_dir = store.join(pages_dir, PAGE_MARKERS_DIR)
    report = PageReport(directory, store_name)
    sweep = None
    if remove:
        store.makedirs(markers_dir)
        sweep_path = store.join(markers_dir, f"{uuid.uuid4().hex}{SWEEP_SUFFIX}")
        sweep = (sweep_path, store.put_bytes(sweep_path, _marker_text("hsnap-page-sweep")), time.monotonic())
    finished = attempted = False
    try:
        now = time.time()
        listed = _list_quiet(store, pages_dir)  # G1: pages first
        protected = _protected_keys(store, markers_dir, report, writer_lease, time.time())  # G2: then live markers
        marked = mark(directory, store_name, store, report)  # G3: then what committed snapshots reference
        report.referenced, report.protected = len(marked), len(protected)
        candidates = []
        for e in listed:
            name = _basename(store, e.path)
            v = PageVerdict(e.path, e.size, max(0.0, now - e.modified), _version=e.version)
            report.items.append(v)
            m = PAGE_NAME_RE.match(name)
            damage = _page_damage(store, e.path, name) if verify and m is not None else None
            if damage is not None:
                report.damaged.append(f"{e.path}: {damage}")
            if m is None:
                v.reason = "not named as a page object: left alone"
            elif name in marked:
                v.reason = "referenced by a committed snapshot"
            elif f"{m[1]}-{m[2]}" in protected:
                v.reason = "protected by a writer's pending references"
            elif older_than is not None and v.age_s < older_than:
                v.reason = f"unreferenced, younger than {older_than:g} s"
            elif report.refused:
                v.reason = "unreferenced, but the sweep is refused (see refused)"
            else:
                v.removable, v.reason = True, "unreferenced by every committed snapshot beside the store, protected by no writer"
                v.action = "would remove"
                candidates.append(v)
            if damage is not None:
                v.reason = f"damaged ({damage}); {v.reason}"
        if sweep is not None:  # remove: the sweep marker is up
            for v in candidates:
                if time.monotonic() - sweep[2] >= sweep_lease / 2:  # writers wait at most the lease for this sweep
                    v.action, v.reason = "kept", v.reason + "; the sweep ran out of time: run gc again"
                    continue
                attempted = True
                _sweep_one(store, v, announce)
        finished = True
    finally:
        # every removal returned (or none was sent): writers may go on. An error in the middle
        # of removals leaves the marker: one may still be in flight, writers wait out the lease.
        if sweep is not None and (finished or not attempted):
            _remove_quiet(store, sweep[0], sweep[1])
    return report


def _page_damage(store: Store, path: str, name: str) -> str | None:
    """Why the page object at ``path`` is not the page its name says, every byte verified; None when it is."""
    try:
        with open_page(path, store) as page:
            if page.name != name:
                return f"its header names another page ({page.name})"
            page.verify()
    except HsnapError as err:
        if isinstance(getattr(err, "os_error", None), FileNotFoundError):
            return None  # removed meanwhile: nothing to report
        return f"{type(err).__name__}: {err}"
    return None


def _sweep_one(store: Store, v: PageVerdict, announce) -> None:
    """Prove by content that ``v`` is the page object its name says, then remove exactly the
    version listed (local: taken by rename and compared; object store: ``If-Match``)."""
    name = _basename(store, v.path)
    try:
        page = open_page(v.path, store)
    except HsnapError as err:
        if isinstance(getattr(err, "os_error", None), FileNotFoundError):
            v.action, v.reason = "gone", v.reason + "; removed meanwhile"
            return
        v.action, v.removable, v.reason = "kept", False, f"not a page object its name says ({type(err).__name__}): left alone"
        return
    try:
        proved = page.name == name
    finally:
        page.close()
    if not proved:
        v.action, v.removable, v.reason = "kept", False, f"its header names another page ({page.name}): left alone"
        return
    if announce is not None:
        announce(v.path, v.bytes)
    try:
        store.remove(v.path, version=v._version)
        v.action = "removed"
    except DigestMismatchError as err:
        v.action, v.reason = "failed", v.reason + f"; changed since listed ({err.found}): kept"
    except HsnapError as err:
        if isinstance(getattr(err, "os_error", None), FileNotFoundError):
            v.action, v.reason = "gone", v.reason + "; removed meanwhile"
        else:
            v.action, v.reason = "failed", v.reason + f"; {type(err).__name__}: {err}"


__all__ = [
    "page_key", "chain_keys", "request_tokens", "page_name", "PageObject", "open_page",
    "encode_page", "PagePlan", "PageRef", "page_refs", "pages_dir", "check_keys", "check_page", "open_checked", "PageStore", "PageStats",
    "write_paged_snapshot", "collect_pages", "mark", "PageReport", "PageVerdict", "parse_marker", "WRITER_LEASE_S", "SWEEP_LEASE_S",
]
