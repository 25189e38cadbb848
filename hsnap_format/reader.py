"""mmap reader: opening reads only the preamble, header and trailer (the same cost
for a 30 MB and a 3 GB file); sections come back as zero-copy, read-only numpy
views; digests are checked per section on demand or all at once by ``verify()``.

Every check runs before anything sized by the file is allocated, so a hostile
file yields a typed :class:`HsnapError`, never a giant allocation or a hang.
"""

from __future__ import annotations

import contextlib
import math
import operator
import os
import re
from dataclasses import dataclass
from typing import Generator, Iterator

import numpy as np
import xxhash

from . import canonical
from .buffers import host_empty
from .errors import (
    Phrase,
    BadMagicError,
    DigestMismatchError,
    HsnapError,
    HsnapIOError,
    MalformedHeaderError,
    TruncatedError,
    UnsupportedFeatureError,
    UnsupportedVersionError,
)
from .layout import SectionSpec, namespace, namespace_id, page_range, record_sections, state_section_rows
from .records import BaseRef, Geometry, Identity, PagesRef, RequestRecord, request_header_fields
from .source import FileSource, Source
from .spec import (
    ALIGNMENT,
    BYTE_ORDER_MARK,
    DIGEST_ALGORITHMS,
    DELTA_FEATURE,
    DTYPES,
    HEADER_OFFSET,
    KNOWN_FEATURES,
    MAGIC,
    MAJOR,
    MAX_HEADER_BYTES,
    MAX_JSON_DEPTH,
    MAX_SECTIONS,
    MINOR,
    PAGES_FEATURE,
    PARALLEL_LAYERS_FEATURE,
    PENDING_MAGIC,
    PREAMBLE,
    SECTION_KINDS,
    TRAILER,
    TRAILER_MAGIC,
    align_up,
)

_ZERO_CHUNK = bytes(1 << 20)
_VERIFY_CHUNK = 2 << 20  # hashed while still in cache (bench: 233 -> 76 ms/GiB vs 64 MiB)
_MAX_RNG_BYTES = 1 << 20
_TOP_KEYS = {"format", "features", "digest", "identity", "geometry", "request", "sections"}


@dataclass(frozen=True)
class SectionInfo:
    """One row of the section table (absolute offsets)."""

    index: int
    name: str
    kind: str
    layer: int | None
    dtype: str
    shape: tuple[int, ...]
    offset: int
    length: int
    digest: str

    @property
    def is_state(self) -> bool:
        return SECTION_KINDS[self.kind].state

    @property
    def axes(self) -> tuple[str, ...] | None:
        return SECTION_KINDS[self.kind].axes


_new = object.__new__


def _section_info(index, name, kind, layer, dtype, shape, offset, length, digest) -> SectionInfo:
    """``SectionInfo(...)`` without the frozen dataclass's nine ``object.__setattr__``
    calls (a third of an open's section table cost); same type, fields, equality, hash."""
    s = _new(SectionInfo)
    s.__dict__.update(index=index, name=name, kind=kind, layer=layer, dtype=dtype, shape=shape, offset=offset, length=length, digest=digest)
    return s


def _check64(block: bytes) -> int:
    return xxhash.xxh3_64_intdigest(block[:56])


@dataclass(frozen=True)
class Preamble:
    major: int
    minor: int
    header_length: int
    data_offset: int
    header_digest: bytes
    file_length: int


# BadMagicError.found of a writer's temporary (what the viewer salvages): a description, as for any other file
PENDING_FOUND = Phrase(f"{len(PENDING_MAGIC)} bytes of the pending magic (a writer's temporary)")


def parse_preamble(block: bytes, path, actual_size: int) -> Preamble:
    if len(block) < len(MAGIC) and MAGIC.startswith(block):
        raise TruncatedError(path, "preamble", f"{PREAMBLE.size} bytes", Phrase(f"{len(block)} bytes"))
    # ``found`` says what the bytes are not, never the bytes: a caller may name any file (a server's /hsnap/resume)
    if block[: len(PENDING_MAGIC)] == PENDING_MAGIC:
        raise BadMagicError(path, "magic", MAGIC, PENDING_FOUND,
                            detail="an unfinished write (a writer's temporary file: its writer is running, or died; see `hsnap gc`)")
    if block[: len(MAGIC)] != MAGIC:
        hint = " (newline translation or 7-bit transfer?)" if block[1:4] == MAGIC[1:4] else ""
        raise BadMagicError(path, "magic" + hint, MAGIC, Phrase(f"{min(len(block), len(MAGIC))} bytes that are not the hsnap magic"))
    if len(block) < PREAMBLE.size:
        raise TruncatedError(path, "preamble", f"{PREAMBLE.size} bytes", Phrase(f"{len(block)} bytes"))
    magic, major, minor, bom, hlen, doff, hdig, flen, check = PREAMBLE.unpack(block)
    if check != _check64(block):
        raise DigestMismatchError(path, "preamble.check", f"{check:016x}", f"{_check64(block):016x}")
    if bom != BYTE_ORDER_MARK:
        raise MalformedHeaderError(path, "preamble.byte_order", f"0x{BYTE_ORDER_MARK:08x}", f"0x{bom:08x}")
    if major != MAJOR:
        raise UnsupportedVersionError(path, "preamble.version", f"major {MAJOR} (minor <= {MINOR} or newer)", f"{major}.{minor}")
    if hlen > MAX_HEADER_BYTES or hlen == 0:
        raise MalformedHeaderError(path, "preamble.header_length", f"1..{MAX_HEADER_BYTES}", hlen)
    if doff % ALIGNMENT or doff < align_up(HEADER_OFFSET + hlen):
        raise MalformedHeaderError(path, "preamble.data_offset", f"a multiple of {ALIGNMENT} >= {align_up(HEADER_OFFSET + hlen)}", doff)
    if flen < doff + TRAILER.size:
        raise MalformedHeaderError(path, "preamble.file_length", f">= {doff + TRAILER.size}", flen)
    if actual_size < flen:
        raise TruncatedError(path, "file_length", f"{flen} bytes", Phrase(f"{actual_size} bytes"))
    if actual_size > flen:
        raise MalformedHeaderError(path, "file_length", f"{flen} bytes", Phrase(f"{actual_size} bytes (trailing data)"))
    return Preamble(major, minor, hlen, doff, hdig, flen)


def parse_header(data: bytes, path) -> dict:
    try:
        obj = canonical.loads(data, max_depth=MAX_JSON_DEPTH)
    except canonical.CanonicalError as e:
        raise MalformedHeaderError(path, "header", detail=str(e)) from None
    if not isinstance(obj, dict):
        raise MalformedHeaderError(path, "header", "an object", type(obj).__name__)
    if obj.get("format", "hsnap") != "hsnap":  # first: another format (a page object, 5.11) says what it is
        raise MalformedHeaderError(path, "header.format", "hsnap", obj["format"])
    missing = _TOP_KEYS - obj.keys()
    if missing:
        raise MalformedHeaderError(path, "header", f"keys {sorted(_TOP_KEYS)}", f"missing {sorted(missing)}")
    feats = obj["features"]
    if not isinstance(feats, dict) or not all(isinstance(feats.get(k), list) for k in ("required", "optional")):
        raise MalformedHeaderError(path, "header.features", "{required: [...], optional: [...]}", feats)
    for k in ("required", "optional"):  # spec §4: lists of strings (a number here crashed tools downstream)
        bad = [f for f in feats[k] if not isinstance(f, str)]
        if bad:
            raise MalformedHeaderError(path, f"header.features.{k}", "strings only", bad[0])
    unknown = [f for f in feats["required"] if f not in KNOWN_FEATURES]
    if unknown:
        raise UnsupportedFeatureError(path, "header.features.required", sorted(KNOWN_FEATURES), unknown)
    if not isinstance(obj["digest"], str) or obj["digest"] not in DIGEST_ALGORITHMS:
        raise UnsupportedFeatureError(path, "header.digest", DIGEST_ALGORITHMS, obj["digest"])
    return obj


_SECTION_FIELDS = ("name", "kind", "layer", "dtype", "shape", "offset", "length", "digest")
_SECTION_GET = operator.itemgetter(*_SECTION_FIELDS)
_HEX = re.compile("[0-9a-f]*").fullmatch
_ITEMSIZE = {name: dt.itemsize for name, dt in DTYPES.items()}


def _sections_fast(table, data_offset: int, end: int) -> tuple[SectionInfo, ...] | None:
    """The section table when every entry passes every check of :func:`parse_sections`
    (the same checks, column by column, or stricter: exact types), else None — then
    parse_sections checks entry by entry for the error. Most of an open was spent here."""
    if type(table) is not list or len(table) > MAX_SECTIONS or not table:
        return None
    if set(map(type, table)) != {dict} or set(map(len, table)) != {len(_SECTION_FIELDS)}:
        return None
    try:  # 8 entries, all 8 keys present: exactly the keys
        rows = list(map(_SECTION_GET, table))
    except KeyError:
        return None
    names, kinds, layers, dtypes, shapes, offsets, lengths, digests = zip(*rows)
    if (set(map(type, names)) != {str} or len(set(names)) != len(names)
            or set(map(type, kinds)) != {str} or not set(kinds) <= SECTION_KINDS.keys()
            or set(map(type, dtypes)) != {str} or not set(dtypes) <= DTYPES.keys()
            or not set(map(type, layers)) <= {int, type(None)}
            or set(map(type, shapes)) != {list} or max(map(len, shapes)) > 8
            or not set(map(type, offsets)) == set(map(type, lengths)) == {int}
            or set(map(type, digests)) != {str} or set(map(len, digests)) != {32} or not _HEX(
                "".join(digests))):
        return None
    numbered = [x for x in layers if x is not None]
    if numbered and (min(numbered) < 0 or max(numbered) >= 1 << 16):
        return None
    dims = [d for shape in shapes for d in shape]
    if dims and (set(map(type, dims)) != {int} or min(dims) < 0 or max(dims) >= 1 << 40):
        return None
    cursor, mask = data_offset, ALIGNMENT - 1
    for shape, dtype, offset, length in zip(shapes, dtypes, offsets, lengths):
        if offset != cursor or length != math.prod(shape) * _ITEMSIZE[dtype]:
            return None
        cursor = (offset + length + mask) & ~mask
    if offset + length != end:  # the last section ends at the trailer, unpadded
        return None
    return tuple(map(_section_info, range(len(rows)), names, kinds, layers, dtypes, map(tuple, shapes), offsets, lengths, digests))


def parse_sections(table, path, data_offset: int, end: int) -> tuple[SectionInfo, ...]:
    fast = _sections_fast(table, data_offset, end)
    if fast is not None:
        return fast
    if not isinstance(table, list) or len(table) > MAX_SECTIONS:
        raise MalformedHeaderError(path, "header.sections", f"a list of at most {MAX_SECTIONS}", type(table).__name__)
    out, cursor, names = [], data_offset, set()
    keys = {"name", "kind", "layer", "dtype", "shape", "offset", "length", "digest"}
    for i, e in enumerate(table):
        where = f"sections[{i}]"
        if not isinstance(e, dict) or e.keys() != keys:
            raise MalformedHeaderError(path, where, f"an object with keys {sorted(keys)}", e if not isinstance(e, dict) else sorted(e))
        name, kind, layer, dtype, shape, offset, length, digest = (e[k] for k in ("name", "kind", "layer", "dtype", "shape", "offset", "length", "digest"))
        where = f"sections[{name!r}]" if isinstance(name, str) and len(name) <= 128 else where
        if not isinstance(name, str) or name in names:
            raise MalformedHeaderError(path, f"{where}.name", "a unique name", name)
        names.add(name)
        if not isinstance(kind, str) or kind not in SECTION_KINDS:  # isinstance first: a list is unhashable
            raise MalformedHeaderError(path, f"{where}.kind", sorted(SECTION_KINDS), kind)
        if not isinstance(dtype, str) or dtype not in DTYPES:
            raise MalformedHeaderError(path, f"{where}.dtype", sorted(DTYPES), dtype)
        if not (layer is None or (isinstance(layer, int) and not isinstance(layer, bool) and 0 <= layer < 1 << 16)):
            raise MalformedHeaderError(path, f"{where}.layer", "null or a layer id", layer)
        if not (isinstance(shape, list) and len(shape) <= 8 and all(isinstance(d, int) and not isinstance(d, bool) and 0 <= d < 1 << 40 for d in shape)):
            raise MalformedHeaderError(path, f"{where}.shape", "at most 8 non-negative integers", shape)
        nbytes = math.prod(shape) * DTYPES[dtype].itemsize
        for fld, v in (("offset", offset), ("length", length)):
            if isinstance(v, bool) or not isinstance(v, int) or v < 0:
                raise MalformedHeaderError(path, f"{where}.{fld}", "a non-negative integer", v)
        if length != nbytes:
            raise MalformedHeaderError(path, f"{where}.length", f"{nbytes} (shape x itemsize)", length)
        if offset != cursor:  # ascending, aligned, no overlap, no gap beyond padding
            raise MalformedHeaderError(path, f"{where}.offset", cursor, offset)
        if offset + length > end:
            raise MalformedHeaderError(path, f"{where}.offset+length", f"<= {end}", offset + length)
        if not (isinstance(digest, str) and len(digest) == 32 and all(c in "0123456789abcdef" for c in digest)):
            raise MalformedHeaderError(path, f"{where}.digest", "32 lowercase hex digits", digest)
        out.append(SectionInfo(i, name, kind, layer, dtype, tuple(shape), offset, length, digest))
        cursor = align_up(offset + length) if i < len(table) - 1 else offset + length
    if cursor != end:
        raise MalformedHeaderError(path, "sections", f"last section ending at the trailer ({end})", cursor)
    return tuple(out)


def _expected_section_count(geometry: Geometry, counts: dict, has_rng: bool) -> int:
    """len(state_sections(...) + record_sections(...)), without building them."""
    n = 2 + counts["has_logprobs"] + 2 * (counts["top_logprobs_k"] > 0) + has_rng
    att, mam = geometry.attention, geometry.mamba
    if att is not None:
        n += len(att.layers) * (1 if att.kind == "mla" else 2) + 2 * len(att.swa_layers)
    if mam is not None:
        n += len(mam.layers) * (len(mam.conv_shapes) + 1)
    return n


class Snapshot:
    """One committed rank file, mapped read-only.

    ``snap[name]`` is a zero-copy numpy view (bf16/fp8 via ml_dtypes);
    ``snap.record()`` the request record; ``snap.verify()`` checks every byte.
    """

    def __init__(self, path: str | os.PathLike[str], *, source: Source | None = None) -> None:
        """``source``: where the bytes come from (:mod:`hsnap_format.source`); by default
        the local file at ``path``, opened once (every read below goes through it)."""
        self.path = os.fspath(path)
        self.source: Source | None = None
        src: Source = FileSource(self.path) if source is None else source
        try:
            self.size = src.size
            self._load(src.pread)
        except HsnapError:
            src.close()
            raise
        except OSError as e:  # a file's pread
            src.close()
            raise HsnapIOError(self.path, "read", e) from None
        except BaseException:
            src.close()
            raise
        self.source = src
        self._scratch = bytearray()
        self._padding_error: tuple[bool, HsnapError | None] | None = None  # the streaming pass's, once (a source with a window)

    def _load(self, pread) -> None:
        """Parse and check preamble, header and trailer in the order of spec 7.1;
        ``pread(n, offset)`` reads the source. Needs ``self.size``."""
        self._load_header(pread, pread(PREAMBLE.size, 0), self.size)
        self._check_trailer(pread(TRAILER.size, self.preamble.file_length - TRAILER.size))
        self._load_request()

    _parse_header = staticmethod(parse_header)  # a page object (pages.py) parses its own header keys

    def _load_header(self, pread, block: bytes, size: int) -> None:
        """Preamble (``block``, checked against ``size``), header and section table."""
        self.preamble = pre = parse_preamble(block, self.path, size)
        header = pread(pre.header_length, HEADER_OFFSET)
        if len(header) != pre.header_length:
            raise TruncatedError(self.path, "header", pre.header_length, len(header))
        if xxhash.xxh3_128_digest(header) != pre.header_digest:
            raise DigestMismatchError(self.path, "header_digest", pre.header_digest.hex(), xxhash.xxh3_128_hexdigest(header))
        self.header_bytes = header
        self.header = self._parse_header(header, self.path)
        self.sections = parse_sections(self.header["sections"], self.path, pre.data_offset, pre.file_length - TRAILER.size)

    def _load_request(self) -> None:
        """Identity, geometry, request and the layout they imply (spec 7.1 step 19 on). Absent
        keys that have a default are set to it in ``self.header`` (R-5-3): what every consumer
        of the header (info, the viewer, hsnap_io) sees is what the file means."""
        self.identity = Identity.from_header(self.header["identity"], self.path, fill_defaults=True)
        self.geometry = Geometry.from_header(self.header["geometry"], self.path, fill_defaults=True,
                                             parallel_layers=PARALLEL_LAYERS_FEATURE in self.header["features"]["required"])
        req = request_header_fields(self.header["request"], self.path, fill_defaults=True)
        self._request_fields, self._request_counts = req["fields"], req["counts"]
        self.swa_start = self._int_field("swa_start")
        self.header["request"].setdefault("swa_start", 0)
        att = self.geometry.attention
        if self.swa_start and (att is None or att.kind != "swa"):
            raise MalformedHeaderError(self.path, "request.swa_start", "0 unless geometry.attention.kind is 'swa'", self.swa_start)
        self.base = self._load_base()
        self.pages = self._load_pages()
        self._check_layout()
        self._by_name = {s.name: s for s in self.sections}

    def __del__(self) -> None:  # an unclosed Snapshot must not leak its descriptor
        try:
            self.close()
        except Exception:
            pass

    # -- open-time checks (cheap: no section bytes read)
    def _int_field(self, key: str) -> int:
        v = self.header["request"].get(key, 0)
        if isinstance(v, bool) or not isinstance(v, int) or not 0 <= v <= self._request_fields["state_position"]:
            raise MalformedHeaderError(self.path, f"request.{key}", f"0..{self._request_fields['state_position']}", v)
        return v

    def _load_base(self) -> BaseRef | None:
        """A delta's ``base`` (spec 5.9): present (not null) exactly when ``delta`` is a
        required feature (R-5.9-1), then valid (R-5.9-2). None for a plain snapshot."""
        base = self.header.get("base")
        delta = DELTA_FEATURE in self.header["features"]["required"]
        if (base is not None) != delta:
            raise MalformedHeaderError(self.path, "base", Phrase(f"present exactly when {DELTA_FEATURE!r} is a required feature"),
                                       Phrase(f"{'an object' if base is not None else 'none'}, {DELTA_FEATURE!r} {'' if delta else 'not '}required"))
        return None if base is None else BaseRef.from_header(base, self.path, state_position=self.state_position)

    def _load_pages(self) -> PagesRef | None:
        """A paged file's ``pages`` (spec 5.10): present (not null) exactly when ``pages`` is a
        required feature (R-5.10-1), valid (R-5.10-2), one reference per full page of its rows
        and the namespace of its own identity, attention geometry and page size (R-5.10-3).
        None for a file that holds all its rows."""
        pages = self.header.get("pages")
        paged = PAGES_FEATURE in self.header["features"]["required"]
        if (pages is not None) != paged:
            raise MalformedHeaderError(self.path, "pages", Phrase(f"present exactly when {PAGES_FEATURE!r} is a required feature"),
                                       Phrase(f"{'an object' if pages is not None else 'none'}, {PAGES_FEATURE!r} {'' if paged else 'not '}required"))
        if pages is None:
            return None
        ref = PagesRef.from_header(pages, self.path)
        att = self.geometry.attention
        if att is None or not att.layers:
            raise MalformedHeaderError(self.path, "pages", Phrase("a geometry with full-attention layers (what pages hold)"),
                                       Phrase("no full-attention layer"))
        first, count = page_range(self.base_position, self.state_position, ref.page_size)
        if ref.count != count:
            raise MalformedHeaderError(self.path, "pages.refs", Phrase(f"{count} references (pages {first}..{first + count - 1} of "
                                                                      f"{ref.page_size} positions)"), Phrase(f"{ref.count}"))
        nid = namespace_id(namespace(self.identity, self.geometry, ref.page_size))
        if ref.namespace_id != nid:
            raise MalformedHeaderError(self.path, "pages.namespace_id", Phrase(f"{nid} (this file's identity, geometry and page size)"),
                                       ref.namespace_id)
        return ref

    @property
    def paged_rows(self) -> int:
        """Attention rows this file takes from its page store (spec 5.10), not in its sections."""
        return 0 if self.pages is None else self.pages.count * self.pages.page_size

    @property
    def base_position(self) -> int:
        """Where this file's attention rows start: its base's position (a delta), else 0."""
        return 0 if self.base is None else self.base.state_position

    def _check_trailer(self, tra: bytes) -> None:
        p = self.path
        if len(tra) != TRAILER.size:
            raise TruncatedError(p, "trailer", TRAILER.size, len(tra))
        magic, flen, count, root, reserved, check = TRAILER.unpack(tra)
        if check != _check64(tra):
            raise DigestMismatchError(p, "trailer.check", f"{check:016x}", f"{_check64(tra):016x}")
        if magic != TRAILER_MAGIC:
            raise MalformedHeaderError(p, "trailer.magic", TRAILER_MAGIC, magic)
        if flen != self.preamble.file_length:
            raise MalformedHeaderError(p, "trailer.file_length", self.preamble.file_length, flen)
        if count != len(self.sections):
            raise MalformedHeaderError(p, "trailer.section_count", len(self.sections), count)
        if reserved != bytes(16):
            raise MalformedHeaderError(p, "trailer.reserved", "zero", reserved.hex())
        h = xxhash.xxh3_128()
        h.update(self.preamble.header_digest)
        h.update(bytes.fromhex("".join(s.digest for s in self.sections)))  # = one update per digest
        if h.digest() != root:
            raise DigestMismatchError(p, "trailer.root_digest", root.hex(), h.hexdigest())
        self.root_digest = root.hex()

    def _check_layout(self) -> None:
        """The section table must be exactly what geometry + request imply."""
        c = self._request_counts
        rng = self.sections[-1].length if self.sections and self.sections[-1].kind == "rng_state" else None
        if c["has_rng_state"] != (rng is not None) or (rng is not None and rng > _MAX_RNG_BYTES):
            raise MalformedHeaderError(self.path, "request.has_rng_state", rng is not None, c["has_rng_state"])
        # Count first: a small header can name 65536 layers x 9 conv/temporal sections,
        # and building that plan would allocate far more than the file is worth.
        n = _expected_section_count(self.geometry, c, rng is not None)
        if n != len(self.sections):
            raise MalformedHeaderError(self.path, "sections", f"{n} sections (from geometry/request)", len(self.sections))
        records = record_sections(c["prompt_tokens"], c["output_tokens"], c["has_logprobs"], c["top_logprobs_k"], rng)
        rows = state_section_rows(self.geometry, self._request_fields["state_position"], self.swa_start, self.base_position, self.paged_rows)
        rows += [(r.name, r.kind, r.layer, r.dtype, r.shape) for r in records]
        if rows == [(s.name, s.kind, s.layer, s.dtype, s.shape) for s in self.sections]:
            return
        expected = [SectionSpec(*r) for r in rows]  # the slow comparison, for the message
        found = [SectionSpec(s.name, s.kind, s.layer, s.dtype, s.shape) for s in self.sections]
        if expected != found:
            for i, (e, f) in enumerate(zip(expected + [None] * len(found), found + [None] * len(expected))):
                if e != f:
                    raise MalformedHeaderError(self.path, f"sections[{i}]", e, f, detail="table disagrees with geometry/request")

    # -- properties
    @property
    def version(self) -> tuple[int, int]:
        return (self.preamble.major, self.preamble.minor)

    @property
    def file_length(self) -> int:
        return self.preamble.file_length

    @property
    def payload_bytes(self) -> int:
        return sum(s.length for s in self.sections if s.is_state)

    @property
    def state_position(self) -> int:
        return self._request_fields["state_position"]

    @property
    def request(self) -> dict:
        """The header's request object (counts, sampling, stop, streamed progress)."""
        return self.header["request"]

    def section(self, name: str) -> SectionInfo:
        try:
            return self._by_name[name]
        except KeyError:
            raise KeyError(f"{self.path}: no section {name!r}") from None

    def __contains__(self, name: str) -> bool:
        return name in self._by_name

    def __iter__(self) -> Iterator[SectionInfo]:
        return iter(self.sections)

    # -- data
    #
    # What each read path guarantees when the file changes underneath it (spec §7.4):
    #   read / iter_chunks / section_bytes / record / verify*: pread through the open
    #     descriptor; a truncation gives TruncatedError, an I/O error HsnapIOError;
    #     with verify=True the bytes returned are the bytes hashed, so a change in
    #     place gives DigestMismatchError, never changed data.
    #   array / raw / snap[name]: zero-copy views of a read-only map; a truncation
    #     while a view is used kills the process with SIGBUS, a change in place shows
    #     through. For trusted, unchanging files (the fast path of restores on GPU).
    def _source(self) -> Source:
        if self.source is None:
            raise HsnapError(self.path, "snapshot", "open", Phrase("closed"))
        return self.source

    def _map(self):
        return self._source().map()

    def _read(self, offset: int, length: int, out: memoryview | None = None) -> memoryview:
        """Bytes [offset, offset+length) read from the source, into ``out`` or a reused buffer (valid until the next call)."""
        src = self._source()
        if out is None:
            if len(self._scratch) < length:
                self._scratch = bytearray(length)
            out = memoryview(self._scratch)[:length]
        src.readinto(out, offset)
        return out

    def fileno(self) -> int:
        """The open, read-only descriptor of the checked file (for pread-based copies)."""
        return self._source().fileno()

    def check_unchanged(self) -> None:
        """Refuse if the bytes changed since open (a file: size, mtime_ns; an object: its version)."""
        self._source().check_unchanged()

    def _info(self, name_or_info: str | SectionInfo) -> SectionInfo:
        return name_or_info if isinstance(name_or_info, SectionInfo) else self.section(name_or_info)

    def raw(self, name_or_info: str | SectionInfo) -> memoryview:
        """Zero-copy bytes of a section, from the map: SIGBUS if the file is truncated while
        the view is used. Use :meth:`section_bytes` or :meth:`read` for files that may change."""
        s = self._info(name_or_info)
        if not self._source().mappable:  # an object: a copy, verified
            return self.read(s, verify=True).reshape(-1).view(np.uint8).data
        return memoryview(self._map())[s.offset : s.offset + s.length]

    def array(self, name_or_info: str | SectionInfo, *, verify: bool = False) -> np.ndarray:
        """A section as an array.

        ``verify=False``: a zero-copy read-only view of the map (SIGBUS if the file is
        truncated while it is used; a change in place shows through).
        ``verify=True``: :meth:`read` — a private copy whose bytes were hashed and matched.
        """
        s = self._info(name_or_info)
        if verify or not self._source().mappable:  # an object cannot be mapped: a copy, verified
            return self.read(s, verify=True)
        arr = np.frombuffer(self._map(), dtype=DTYPES[s.dtype], count=math.prod(s.shape), offset=s.offset)
        return arr.reshape(s.shape)

    __getitem__ = array

    def read(self, name_or_info: str | SectionInfo, *, verify: bool = True, start: int = 0, count: int | None = None) -> np.ndarray:
        """A private copy of a section, read with pread (typed errors, never SIGBUS).

        Whole section: shaped like it; with ``verify`` the copy is hashed and must match
        the stored digest. ``start``/``count`` (elements, C order) read a flat slice,
        which has no digest of its own: ``verify`` must then be False.
        """
        s = self._info(name_or_info)
        itemsize = DTYPES[s.dtype].itemsize
        total = math.prod(s.shape)
        partial = start != 0 or count is not None
        if partial and verify:
            raise ValueError("a slice of a section has no digest: read it with verify=False, or verify the section")
        count = total - start if count is None else count
        if not (0 <= start <= total and 0 <= count <= total - start):
            raise IndexError(f"{self.path}: {s.name}: elements [{start}, {start + count}) outside [0, {total})")
        out = host_empty(count, DTYPES[s.dtype])
        buf = out.view(np.uint8).data
        self._read(s.offset + start * itemsize, count * itemsize, buf)
        if verify:
            got = xxhash.xxh3_128_hexdigest(buf)
            if got != s.digest:
                raise DigestMismatchError(self.path, f"sections[{s.name!r}].digest", s.digest, got)
        return out if partial else out.reshape(s.shape)

    def iter_chunks(self, name_or_info: str | SectionInfo, chunk_elements: int = 1 << 20, *, verify: bool = True,
                    cancelled=None) -> Iterator[tuple[int, np.ndarray]]:
        """``(flat start, 1-D copy)`` over a section in C order, by pread: bounded memory for
        any section size. With ``verify`` the chunks are hashed as they are read and the
        last step raises :class:`DigestMismatchError` if the section does not match (a
        consumer reports nothing as final before the iteration ends). Stops early, without
        a verdict, when ``cancelled()`` returns true."""
        s = self._info(name_or_info)
        dt = DTYPES[s.dtype]
        total = math.prod(s.shape)
        h = xxhash.xxh3_128() if verify else None
        step = max(1, chunk_elements)
        for start in range(0, total, step):
            if cancelled is not None and cancelled():
                return
            n = min(step, total - start)
            chunk = np.empty(n, dtype=dt)  # (small and transient: numpy's own, as the tools always had)
            view = chunk.view(np.uint8).data
            self._read(s.offset + start * dt.itemsize, n * dt.itemsize, view)
            if h is not None:
                h.update(view)
            yield start, chunk
        if h is not None and h.hexdigest() != s.digest:
            raise DigestMismatchError(self.path, f"sections[{s.name!r}].digest", s.digest, h.hexdigest())

    def section_bytes(self, name_or_info: str | SectionInfo) -> "SectionBytes":
        """The bytes of a section as a lazy, pread-backed sequence (``len``, slices): for
        hex views of sections of any size, with typed errors instead of SIGBUS."""
        return SectionBytes(self, self._info(name_or_info))

    def verify_section(self, name_or_info: str | SectionInfo, *, force: bool = True, cancelled=None, progress=None) -> bool:
        """Read and hash one section, every call (nothing is cached: a file changed since
        an earlier verification fails now). Hashes in 2 MiB chunks, so a multi-GB section
        can report ``progress(nbytes)`` and stop when ``cancelled()``; returns False when
        cancelled, True when verified. (``force`` is accepted for compatibility.)"""
        s = self._info(name_or_info)
        h = xxhash.xxh3_128()
        for start in range(0, s.length, _VERIFY_CHUNK):
            if cancelled is not None and cancelled():
                return False
            h.update(self._read(s.offset + start, min(_VERIFY_CHUNK, s.length - start)))
            if progress is not None:
                progress(min(_VERIFY_CHUNK, s.length - start))
        got = h.hexdigest()
        if got != s.digest:
            raise DigestMismatchError(self.path, f"sections[{s.name!r}].digest", s.digest, got)
        return True

    def padding_ranges(self) -> list[tuple[int, int]]:
        ranges, cursor = [], HEADER_OFFSET + self.preamble.header_length
        for s in self.sections:
            ranges.append((cursor, s.offset))
            cursor = s.offset + s.length
        ranges.append((cursor, self.file_length - TRAILER.size))
        return [(a, b) for a, b in ranges if b > a]

    def check_padding(self) -> None:
        if self._source().window is not None:  # answered by the streaming pass (one just made answers once)
            done, self._padding_error = self._padding_error, None
            if done is None:
                for _ in self.iter_verify():
                    pass
                done, self._padding_error = self._padding_error, None
                assert done is not None  # a whole pass (none cancelled it) puts its padding verdict
            if done[1] is not None:
                raise done[1]
            return
        for a, b in self.padding_ranges():
            for start in range(a, b, len(_ZERO_CHUNK)):
                stop = min(b, start + len(_ZERO_CHUNK))
                chunk = self._read(start, stop - start)
                if chunk != _ZERO_CHUNK[: stop - start]:
                    i = next(i for i, x in enumerate(chunk) if x)
                    raise DigestMismatchError(self.path, f"padding at byte {start + i}", "zero bytes", f"0x{chunk[i]:02x}")

    def iter_verify(self, cancelled=None) -> Iterator[tuple[SectionInfo, HsnapError | None]]:
        """Verify section by section, yielding (section, error or None); stops when ``cancelled()``.
        A source with a ``window`` (an object) is read in one streaming pass, sections and
        padding together, not one read per gap."""
        window = self._source().window
        if window is not None:
            self._padding_error = None
            result: dict = {}
            yield from stream(self, window, HEADER_OFFSET + self.preamble.header_length, self.file_length - TRAILER.size,
                              cancelled=cancelled, result=result)
            if "padding" in result:
                self._padding_error = (True, result["padding"])
            return
        for s in self.sections:
            if cancelled is not None and cancelled():
                return
            try:
                self.verify_section(s)
                yield s, None
            except HsnapError as e:
                yield s, e

    def verify_failures(self, *, first: bool = False) -> list[HsnapError]:
        """Every failure of :meth:`verify`, in the order of spec 7.2 (R-7.2-3): the first
        non-zero padding byte in file order, then each section whose digest differs, in table
        order. ``first``: stop at the first of them (what ``verify()`` raises)."""
        failures: list[HsnapError] = []
        if self._source().window is not None:  # one streaming pass answers both; padding first
            failures = [err for _, err in self.iter_verify() if err is not None]
            try:
                self.check_padding()
            except HsnapError as e:
                failures.insert(0, e)
            return failures[:1] if first else failures
        try:
            self.check_padding()  # the padding ranges are small: cheap to check before hashing
        except HsnapError as e:
            failures.append(e)
        for _, err in self.iter_verify(cancelled=lambda: first and bool(failures)):
            if err is not None:
                failures.append(err)
        return failures[:1] if first else failures

    def verify(self) -> None:
        """Check every byte: padding is zero and every section matches its digest; raises
        the first failure in the order of spec 7.2."""
        failures = self.verify_failures(first=True)
        if failures:
            raise failures[0]

    def record(self, *, verify: bool = True) -> RequestRecord:
        """The request record, its arrays read with pread; with ``verify`` (the default)
        every record section is hashed on every call, and what is returned is what was hashed."""
        arrays = {}
        for s in self.sections:
            if not s.is_state:
                arrays[s.kind] = self.read(s, verify=verify)
        rng = arrays.pop("rng_state", None)
        return RequestRecord(
            prompt_ids=arrays["prompt_ids"],
            output_ids=arrays["output_ids"],
            output_logprobs=arrays.get("output_logprobs"),
            top_logprob_ids=arrays.get("top_logprob_ids"),
            top_logprob_values=arrays.get("top_logprob_values"),
            rng_state=None if rng is None else rng.tobytes(),
            **self._request_fields,
        )

    def close(self) -> None:
        src, self.source = getattr(self, "source", None), None
        if src is not None:
            src.close()

    def __enter__(self) -> "Snapshot":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def __repr__(self) -> str:
        return f"<hsnap.Snapshot {self.path!r} v{self.version[0]}.{self.version[1]} {len(self.sections)} sections, {self.payload_bytes} payload bytes>"


class SectionBytes:
    """A section's bytes, read on demand with pread (see :meth:`Snapshot.section_bytes`)."""

    __slots__ = ("snap", "info")

    def __init__(self, snap: Snapshot, info: SectionInfo) -> None:
        self.snap, self.info = snap, info

    def __len__(self) -> int:
        return self.info.length

    def __getitem__(self, key) -> bytes:
        if not isinstance(key, slice):
            raise TypeError("SectionBytes takes slices")
        a, b, step = key.indices(self.info.length)
        if step != 1:
            raise ValueError("SectionBytes takes contiguous slices")
        n = max(0, b - a)
        return bytes(self.snap._read(self.info.offset + a, n)) if n else b""


def _windows(snap: Snapshot, window: int, start: int, stop: int, into: memoryview | None) -> Generator[tuple[int, memoryview], None, None]:
    """``(offset, bytes)`` of [start, stop) window by window: into one reused buffer, or
    into ``into`` (bytes [start, stop) kept whole) — by ranged GETs running ahead of the
    consumer where the snapshot has them (``iter_into``), else one read per window."""
    ranged = getattr(snap._source(), "iter_into", None)
    if into is not None and ranged is not None:
        yield from ranged(into[: stop - start], start, window)
        return
    buf = into if into is not None else memoryview(bytearray(min(window, max(stop - start, 0))))
    for w in range(start, stop, window):
        n = min(window, stop - w)
        at = w - start if into is not None else 0  # ``into`` keeps every window; the one buffer is reused
        yield w, snap._read(w, n, buf[at : at + n])


def stream(snap: Snapshot, window: int, start: int, stop: int, *, each=None, cancelled=None, result: dict | None = None,
           into: memoryview | None = None):
    """Read bytes [start, stop) of ``snap`` in windows (one buffer, reused — or ``into``,
    which then holds them all), hashing every section and checking the padding as each
    window lands; yields ``(section, error or None)`` as each section ends, calls
    ``each(offset, bytes)`` per window (a copy's sink), and puts the first padding error
    (or None) in ``result["padding"]`` when the pass completes. [start, stop) may be part
    of the body cut at region boundaries (a section's or a padding's start): then only the
    regions in it are hashed and checked (several parts may be streamed at once)."""
    regions = sorted([(s.offset, s.offset + s.length, s) for s in snap.sections] + [(a, b, None) for a, b in snap.padding_ranges()],
                     key=lambda r: r[0])
    end = max((r[1] for r in regions), default=stop)
    regions = [r for r in regions if (r[1] > start or r[0] >= start) and (r[0] < stop or stop >= end)]
    with contextlib.closing(_windows(snap, window, start, stop, into)) as windows:
        yield from _hash_windows(snap, windows, regions, each, cancelled, result)


def _hash_windows(snap: Snapshot, windows, regions, each, cancelled, result):
    ri, h, padding_error = 0, xxhash.xxh3_128(), None
    for w, mv in windows:
        if cancelled is not None and cancelled():
            return
        n = len(mv)
        if each is not None:
            each(w, mv)
        while ri < len(regions) and regions[ri][0] < w + n:
            a, b, s = regions[ri]
            piece = mv[max(a, w) - w : min(b, w + n) - w]
            if s is not None:
                h.update(piece)
            elif padding_error is None and np.frombuffer(piece, dtype=np.uint8).any():  # (C speed: padding adds up)
                i = int(np.flatnonzero(np.frombuffer(piece, dtype=np.uint8))[0])
                padding_error = DigestMismatchError(snap.path, f"padding at byte {max(a, w) + i}", "zero bytes", f"0x{piece[i]:02x}")
            if b > w + n:
                break
            if s is not None:
                got = h.hexdigest()
                yield s, None if got == s.digest else DigestMismatchError(snap.path, f"sections[{s.name!r}].digest", s.digest, got)
                h = xxhash.xxh3_128()
            ri += 1
    for a, b, s in regions[ri:]:  # zero-length sections at the very end
        if s is not None:
            got = xxhash.xxh3_128_hexdigest(b"")
            yield s, None if got == s.digest else DigestMismatchError(snap.path, f"sections[{s.name!r}].digest", s.digest, got)
    if result is not None:
        result["padding"] = padding_error


def region_starts(snap: Snapshot) -> list[int]:
    """Where each region of the body (a section or the padding before one) starts, in order: the offsets
    :func:`stream` may cut the body at."""
    return sorted({s.offset for s in snap.sections} | {a for a, _ in snap.padding_ranges()})


def section_digest(data) -> str:
    return xxhash.xxh3_128_hexdigest(data)
