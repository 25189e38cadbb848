"""Streaming writer: sections go to disk as they arrive, the header is completed
at the end, and only a fully written, fsynced file ever gets the final name.

The writer is a state machine (as gguf-py's)::

    OPEN --begin_section--> IN_SECTION --end_section--> OPEN ... --commit--> COMMITTED
      \\______________________ abort / exception ______________________--> ABORTED

Memory is bounded by what the caller hands in: nothing is buffered.
"""

from __future__ import annotations

import enum
import math
import os
import re
from typing import Any, Iterable, Sequence

import numpy as np
import xxhash

from . import canonical, localfs
from .errors import HsnapError, HsnapIOError, MalformedHeaderError, Phrase, WriterStateError, require_type
from .layout import SectionSpec, check_pages_ref, record_sections, state_sections
from .source import FileSink, Sink
from .records import BaseRef, Geometry, Identity, PagesRef, RequestRecord, Sharding
from .spec import (
    ALIGNMENT,
    BYTE_ORDER_MARK,
    DEFAULT_DIGEST,
    DELTA_FEATURE,
    DTYPES,
    HEADER_OFFSET,
    MAGIC,
    MAJOR,
    MAX_HEADER_BYTES,
    FEATURE_MINOR,
    NAME_RE,
    PAGES_FEATURE,
    PARALLEL_LAYERS_FEATURE,
    PREAMBLE,
    SECTION_KINDS,
    TRAILER,
    TRAILER_MAGIC,
    align_up,
)

_ZERO_DIGEST = "0" * 32


def check_spec(spec: SectionSpec) -> None:
    if not NAME_RE.match(spec.name):
        raise MalformedHeaderError(None, f"sections[{spec.name!r}].name", "[A-Za-z0-9._-], at most 128", spec.name)
    if spec.kind not in SECTION_KINDS:
        raise MalformedHeaderError(None, f"sections[{spec.name}].kind", sorted(SECTION_KINDS), spec.kind)
    if spec.dtype not in DTYPES:
        raise MalformedHeaderError(None, f"sections[{spec.name}].dtype", sorted(DTYPES), spec.dtype)


def section_nbytes(spec: SectionSpec) -> int:
    return math.prod(spec.shape) * DTYPES[spec.dtype].itemsize


def build_header(body: dict, specs: Sequence[SectionSpec], digests: Sequence[str], data_offset: int,
                 body_json: bytes | None = None) -> tuple[bytes, list[dict], int]:
    """Encode the header for a given data_offset; returns (bytes, table, end of last section).
    ``body_json``: ``canonical.dumps(body)``, when the caller already has it."""
    table, cursor = [], data_offset
    for spec, digest in zip(specs, digests):
        length = section_nbytes(spec)
        table.append(
            {
                "name": spec.name,
                "kind": spec.kind,
                "layer": spec.layer,
                "dtype": spec.dtype,
                "shape": list(spec.shape),
                "offset": cursor,
                "length": length,
                "digest": digest,
            }
        )
        cursor = align_up(cursor + length) if spec is not specs[-1] else cursor + length
    rows = _table_json(table)
    if rows is None or "sections" in body or any(k > "sections" for k in body):
        return canonical.dumps({**body, "sections": table}), table, cursor
    body_json = canonical.dumps(body) if body_json is None else body_json
    # "sections" sorts after every other key: the canonical header is the body's, with it appended
    return body_json[:-1] + (b',"sections":' if body else b'"sections":') + rows + b"}", table, cursor


_PLAIN_LINES = re.compile(r"[A-Za-z0-9._\n-]*\Z").match  # strings canonical JSON writes as they are, one per line
_MAX_SAFE = canonical.MAX_SAFE_INTEGER
_STR_FIELDS = ("name", "kind", "dtype", "digest")


def _table_json(table: list[dict]) -> bytes | None:
    """``canonical.dumps(table)`` for the writer's own table (the bulk of a header: one
    pure-Python encode of it was most of an export's fixed cost), or None when an entry has
    a value this shortcut does not cover (then the caller encodes it all the long way).
    Keys in canonical order; names, kinds, dtypes and digests need no escaping (checked);
    every integer is a plain int within 2**53 (checked)."""
    try:
        strs = "\n".join(e[k] for e in table for k in _STR_FIELDS)
    except TypeError:  # not a str
        return None
    ints = [v for e in table for v in (e["offset"], e["length"], *e["shape"])]
    ints += [e["layer"] for e in table if e["layer"] is not None]
    if strs.count("\n") != len(_STR_FIELDS) * len(table) - 1 or not _PLAIN_LINES(strs) or (ints and (set(map(type, ints)) != {int} or max(map(abs, ints)) > _MAX_SAFE)):
        return None
    return ("[" + ",".join(
        f'{{"digest":"{e["digest"]}","dtype":"{e["dtype"]}","kind":"{e["kind"]}","layer":{"null" if e["layer"] is None else e["layer"]},'
        f'"length":{e["length"]},"name":"{e["name"]}","offset":{e["offset"]},"shape":[{",".join(map(str, e["shape"]))}]}}'
        for e in table) + "]").encode()


def layout_header(body: dict, specs: Sequence[SectionSpec], digests: Sequence[str]) -> tuple[bytes, list[dict], int, int]:
    """Find the fixed point data_offset = align(64 + len(header)) (offsets' digits move the length)."""
    data_offset = ALIGNMENT
    body_json = canonical.dumps(body)  # the same on every pass
    while True:
        header, table, end = build_header(body, specs, digests, data_offset, body_json)
        need = align_up(HEADER_OFFSET + len(header))
        if need <= data_offset:
            return header, table, data_offset, end
        data_offset = need


_ZERO_DIGEST_FIELD = b'"digest":"' + _ZERO_DIGEST.encode() + b'"'


def _fill_digests(planned: bytes, digests: Sequence[str]) -> bytes | None:
    """The header ``build_header`` would encode with ``digests``, from the planned one.

    Canonical JSON sorts keys and never escapes hex digits, so a digest only changes the
    32 characters of its own value: substituting them in the planned header (zero
    digests, same offsets) gives the same bytes as encoding again. ``None`` when the
    zero-digest field does not occur exactly once per section (e.g. a request field
    that happens to spell it): then the caller encodes.
    """
    parts = planned.split(_ZERO_DIGEST_FIELD)
    if len(parts) != len(digests) + 1 or not all(len(d) == 32 and d.isascii() and d.isalnum() and d == d.lower() for d in digests):
        return None
    out = [parts[0]]
    for d, rest in zip(digests, parts[1:]):
        out += [b'"digest":"', d.encode(), b'"', rest]
    return b"".join(out)


def _byte_view(data, spec: SectionSpec, path) -> memoryview:
    """The bytes to write for a section (or a chunk of one).

    An array must be of the section's element type, or raw bytes (uint8): another type
    of the same width would be written as if it were the section's (float16 read back
    as bfloat16), so it is refused. Other objects must export a C-contiguous buffer.
    """
    if isinstance(data, np.ndarray):  # bf16/fp8 (ml_dtypes) arrays export no buffer: view as bytes
        if data.dtype != DTYPES[spec.dtype] and data.dtype != np.uint8:
            raise WriterStateError(path, f"sections[{spec.name}].dtype", f"{spec.dtype} (or raw bytes as uint8)", str(data.dtype))
        return np.ascontiguousarray(data).reshape(-1).view(np.uint8).data
    try:
        return memoryview(data).cast("B")
    except TypeError as e:  # a list, a str, a non-contiguous view...
        raise WriterStateError(path, f"sections[{spec.name}].data", "a numpy array or a C-contiguous buffer", Phrase(f"{type(data).__name__} ({e})")) from None


class WriterState(enum.Enum):
    OPEN = "open"
    IN_SECTION = "in section"
    COMMITTED = "committed"
    ABORTED = "aborted"


class SnapshotWriter:
    """Write one rank file. Use as a context manager; leaving it by an exception aborts.

    >>> with SnapshotWriter(path, identity=ident, geometry=geom, record=rec) as w:
    ...     for spec in w.pending_state_sections():
    ...         w.write_section(spec.name, arrays[spec.name])
    ...     w.commit()

    ``before_publish(temp_path)``, when set, is called with the finished, synced file under
    its temporary name right before the rename that publishes it; if it raises, nothing is
    published (a compaction re-reads and proves its output there). A writer whose commit
    is not a rename (an object store's multipart upload) says so: ``publishes_by_rename``.

    ``sink``: where the bytes go (:mod:`hsnap_format.source`); by default a local file at
    ``path`` (``mode``, ``preallocate`` and ``writeback`` are its settings).
    """

    before_publish = None

    def __init__(
        self,
        path: str | os.PathLike[str],
        *,
        identity: Identity,
        geometry: Geometry,
        record: RequestRecord,
        swa_start: int = 0,
        mode: int = 0o600,
        features_optional: Iterable[str] = (),
        preallocate: bool = True,
        writeback: bool = False,
        base: BaseRef | None = None,
        pages: PagesRef | None = None,
        sink: Sink | None = None,
    ) -> None:
        """``base``: write a delta (spec 5.9, format 1.2): attention sections hold only the
        rows after ``base.state_position``; recurrent state and record are whole.
        ``pages``: the file's full pages are page objects already in its page store (spec
        5.10, format 1.3): its ``attn_*``/``mla_kv`` sections hold only the other rows —
        before its first page and after its last (:func:`hsnap_format.layout.inline_runs`)."""
        self.path = os.fspath(path)
        self.sink = FileSink(self.path, mode=mode, preallocate=preallocate, writeback=writeback) if sink is None else sink
        self.state = WriterState.ABORTED  # until the file exists
        # a dict where a record class goes: a typed refusal, not an AttributeError further on
        for field, value, cls in (("identity", identity, Identity), ("geometry", geometry, Geometry), ("record", record, RequestRecord)):
            require_type(self.path, field, value, cls)
        require_type(self.path, "geometry.sharding", geometry.sharding, Sharding, optional=True)
        require_type(self.path, "base", base, BaseRef, optional=True)
        require_type(self.path, "pages", pages, PagesRef, optional=True)
        record.validate(self.path)
        if base is not None:  # the reader's own rules (R-5.9-2), before any byte
            base = BaseRef.from_header(base.to_header(), self.path, state_position=record.state_position)
        self.record = record
        self.base = base
        base_position = 0 if base is None else base.state_position
        if pages is not None:  # the reader's own rules (R-5.10-2, R-5.10-3), before any byte
            pages = check_pages_ref(pages, identity, geometry, base_position, record.state_position, self.path)
        self.pages = pages
        paged_rows = 0 if pages is None else pages.count * pages.page_size
        specs = state_sections(geometry, record.state_position, swa_start, base_position, paged_rows) + record_sections(
            len(record.prompt_ids),
            len(record.output_ids),
            record.output_logprobs is not None,
            record.top_logprobs_k,
            None if record.rng_state is None else len(record.rng_state),
        )
        for spec in specs:
            check_spec(spec)
        # The writer refuses exactly what the reader would refuse, instead of writing it.
        Identity.from_header(identity.to_header(), self.path)
        Geometry.from_header(geometry.to_header(), self.path, parallel_layers=bool(geometry.parallel_layers))
        optional = set(features_optional)
        if record.rng_state is not None:
            optional.add("sampler-rng-state")
        if record.top_logprobs_k:
            optional.add("top-logprobs")
        if geometry.sharding is not None:
            optional.add("tp-sharding")
        required = [] if base is None else [DELTA_FEATURE]  # older readers must refuse a delta (spec 9)
        if pages is not None:
            required.append(PAGES_FEATURE)  # ... and a file whose full pages are elsewhere
        if geometry.parallel_layers:
            required.append(PARALLEL_LAYERS_FEATURE)  # ... and one whose layers hold both groups' sections
        # the least minor that covers the content (spec 9): a file without 1.1 content is a 1.0 file
        self.minor = max((FEATURE_MINOR.get(f, 0) for f in (*optional, *required)), default=0)
        request = record.to_header()
        request["swa_start"] = swa_start
        self._body: dict[str, Any] = {
            "format": "hsnap",
            "features": {"required": required, "optional": sorted(optional)},
            "digest": DEFAULT_DIGEST,
            "identity": identity.to_header(),
            "geometry": geometry.to_header(),
            "request": request,
        }
        if base is not None:  # a plain snapshot has no "base" key: byte-identical to a 1.1 writer's
            self._body["base"] = base.to_header()
        if pages is not None:  # nor a "pages" key: byte-identical to a 1.2 writer's
            self._body["pages"] = pages.to_header()
        self.specs = specs
        self._digests = [_ZERO_DIGEST] * len(specs)
        try:
            header, self._table, self._data_offset, end = layout_header(self._body, specs, self._digests)
        except canonical.CanonicalError as e:
            raise MalformedHeaderError(self.path, "header", detail=f"cannot encode: {e}") from None
        if len(header) > MAX_HEADER_BYTES:
            raise MalformedHeaderError(self.path, "header_length", f"<= {MAX_HEADER_BYTES}", len(header))
        self._header_length = len(header)
        self._planned_header = header  # zero digests; commit fills them in
        self.file_length = end + TRAILER.size
        self.payload_bytes = sum(section_nbytes(s) for s in specs if SECTION_KINDS[s.kind].state)
        self._next = 0
        self._hasher = xxhash.xxh3_128()  # begin_section starts each section's afresh
        self._cursor = 0
        self._written = 0
        self.sink.open(self.file_length, self._data_offset)
        self.state = WriterState.OPEN

    @property
    def publishes_by_rename(self) -> bool:
        return self.sink.publishes_by_rename

    def set_pages(self, pages: PagesRef) -> None:
        """The file's ``pages`` with the root digests of the page objects now put, in place of
        the zero digests it was planned with (``PagePlan.placeholder``): the same store, page
        size, namespace and keys; every value fixed-width, so the planned layout holds."""
        self._require(WriterState.OPEN, WriterState.IN_SECTION, call="set_pages")
        planned = self.pages
        if planned is None or (pages.store, pages.page_size, pages.namespace_id, [k for k, _ in pages.refs]) != (
                planned.store, planned.page_size, planned.namespace_id, [k for k, _ in planned.refs]):
            self.abort()
            raise WriterStateError(self.path, "pages", Phrase("the pages it was planned with"), Phrase("other pages"))
        self.pages = pages
        self._body["pages"] = pages.to_header()
        header, _, _ = build_header(self._body, self.specs, [_ZERO_DIGEST] * len(self.specs), self._data_offset)
        if len(header) != self._header_length:
            raise AssertionError("header length moved with the page digests")  # every value is fixed-width
        self._planned_header = header

    # -- state machine helpers
    def _require(self, *states: WriterState, call: str) -> None:
        if self.state not in states:
            raise WriterStateError(self.path, call, " or ".join(s.value for s in states), self.state.value)

    def pending_state_sections(self) -> list[SectionSpec]:
        return [s for s in self.specs[self._next :] if SECTION_KINDS[s.kind].state]

    @property
    def next_section(self) -> SectionSpec | None:
        return self.specs[self._next] if self._next < len(self.specs) else None

    # -- sections
    def begin_section(self, name: str) -> SectionSpec:
        self._require(WriterState.OPEN, call="begin_section")
        spec = self.next_section
        if spec is None or spec.name != name:
            raise WriterStateError(self.path, "section order", None if spec is None else spec.name, name)
        self.state = WriterState.IN_SECTION
        self._hasher = xxhash.xxh3_128()
        self._cursor = self._table[self._next]["offset"]
        self._written = 0
        return spec

    def write_chunk(self, data) -> None:
        self._require(WriterState.IN_SECTION, call="write_chunk")
        try:
            view = _byte_view(data, self.specs[self._next], self.path)
        except WriterStateError:
            self.abort()
            raise
        expected = self._table[self._next]["length"]
        if self._written + view.nbytes > expected:
            self.abort()
            raise WriterStateError(self.path, f"sections[{self.specs[self._next].name}].length", expected, self._written + view.nbytes)
        self._hasher.update(view)
        try:
            self.sink.write_at(view, self._cursor)
            localfs.phase("chunk")
        except HsnapError:
            self.abort()
            raise
        except OSError as e:
            self.abort()
            raise HsnapIOError(self.path, f"write {self.specs[self._next].name}", e) from None
        self._cursor += view.nbytes
        self._written += view.nbytes

    def end_section(self) -> str:
        self._require(WriterState.IN_SECTION, call="end_section")
        spec, expected = self.specs[self._next], self._table[self._next]["length"]
        if self._written != expected:
            self.abort()
            raise WriterStateError(self.path, f"sections[{spec.name}].length", expected, self._written)
        digest = self._hasher.hexdigest()
        self._digests[self._next] = digest
        self._next += 1
        self.state = WriterState.OPEN
        localfs.phase("section")
        return digest

    def write_section(self, name: str, data) -> str:
        """Write a whole section (any C-contiguous buffer of exactly its length). Returns its digest."""
        spec = self.begin_section(name)
        if isinstance(data, np.ndarray) and tuple(data.shape) != spec.shape:
            self.abort()
            raise WriterStateError(self.path, f"sections[{name}].shape", list(spec.shape), list(data.shape))
        self.write_chunk(data)
        return self.end_section()

    def write_record_sections(self) -> None:
        arrays = self.record.bulk_arrays()
        while self.next_section is not None and not SECTION_KINDS[self.next_section.kind].state:
            spec = self.next_section
            self.write_section(spec.name, np.ascontiguousarray(arrays[spec.kind], dtype=DTYPES[spec.dtype]))

    # -- commit
    def commit(self, *, fsync: bool = True) -> "CommitInfo":
        """Complete the header, fsync, and give the file its final name (never overwriting)."""
        self._require(WriterState.OPEN, call="commit")
        self.write_record_sections()
        if self.next_section is not None:
            raise WriterStateError(self.path, "commit", "all sections written", Phrase(f"next is {self.next_section.name}"))
        data_offset, end = self._data_offset, self.file_length - TRAILER.size
        header = _fill_digests(self._planned_header, self._digests)
        if header is None:  # digests are fixed-width: the planned offsets still hold, encode once
            header, _, end = build_header(self._body, self.specs, self._digests, data_offset)
        if len(header) != self._header_length or align_up(HEADER_OFFSET + len(header)) > data_offset:
            raise AssertionError("header length moved after planning")  # digests are fixed-width
        header_digest = xxhash.xxh3_128_digest(header)
        root = xxhash.xxh3_128()
        root.update(header_digest)
        for d in self._digests:
            root.update(bytes.fromhex(d))
        root_digest = root.digest()
        pre = PREAMBLE.pack(MAGIC, MAJOR, self.minor, BYTE_ORDER_MARK, len(header), data_offset, header_digest, self.file_length, 0)
        pre = pre[:56] + xxhash.xxh3_64_digest(pre[:56])[::-1]  # digest() is big-endian; store LE
        tra = TRAILER.pack(TRAILER_MAGIC, self.file_length, len(self.specs), root_digest, bytes(16), 0)
        tra = tra[:56] + xxhash.xxh3_64_digest(tra[:56])[::-1]
        try:
            self.sink.publish(pre, header, tra, end, fsync, self.before_publish)
        except BaseException:
            self.abort()
            raise
        self.state = WriterState.COMMITTED
        localfs.phase("committed")
        return CommitInfo(self.path, self.file_length, self.payload_bytes, root_digest.hex(), dict(zip((s.name for s in self.specs), self._digests)))

    def abort(self) -> None:
        """Drop the temporary file. Safe to call in any state; a no-op once committed."""
        if self.state in (WriterState.COMMITTED, WriterState.ABORTED):
            return
        self.state = WriterState.ABORTED
        self.sink.discard()

    def __enter__(self) -> "SnapshotWriter":
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        if exc_type is not None or self.state is not WriterState.COMMITTED:
            self.abort()

    def __del__(self) -> None:
        try:
            self.abort()
        except Exception:
            pass


class CommitInfo:
    __slots__ = ("path", "file_length", "payload_bytes", "root_digest", "digests")

    def __init__(self, path, file_length, payload_bytes, root_digest, digests):
        self.path, self.file_length, self.payload_bytes = path, file_length, payload_bytes
        self.root_digest, self.digests = root_digest, digests

    def __repr__(self) -> str:
        return f"CommitInfo({self.path!r}, file_length={self.file_length}, payload_bytes={self.payload_bytes})"


def write_snapshot(path, *, identity: Identity, geometry: Geometry, record: RequestRecord, state: dict[str, Any], swa_start: int = 0, **kw) -> CommitInfo:
    """Write a whole snapshot from in-memory arrays (section name -> array). Convenience for small files."""
    with SnapshotWriter(path, identity=identity, geometry=geometry, record=record, swa_start=swa_start, **kw) as w:
        for spec in w.pending_state_sections():
            w.write_section(spec.name, state[spec.name])
        return w.commit()
