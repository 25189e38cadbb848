"""mmap reader: opening reads only the preamble, header and trailer (the same cost
for a 30 MB and a 3 GB file); sections come back as zero-copy, read-only numpy
views; digests are checked per section on demand or all at once by ``verify()``.

Every check runs before anything sized by the file is allocated, so a hostile
file yields a typed :class:`HsnapError`, never a giant allocation or a hang.
"""

from __future__ import annotations

import math
import mmap
import os
import stat
from dataclasses import dataclass
from typing import Iterator

import numpy as np
import xxhash

from . import canonical
from .errors import (
    BadMagicError,
    DigestMismatchError,
    HsnapError,
    HsnapIOError,
    MalformedHeaderError,
    TruncatedError,
    UnsupportedFeatureError,
    UnsupportedVersionError,
)
from .layout import SectionSpec, record_sections, state_sections
from .records import Geometry, Identity, RequestRecord, request_header_fields
from .spec import (
    ALIGNMENT,
    BYTE_ORDER_MARK,
    DIGEST_ALGORITHMS,
    DTYPES,
    HEADER_OFFSET,
    KNOWN_FEATURES,
    MAGIC,
    MAJOR,
    MAX_HEADER_BYTES,
    MAX_JSON_DEPTH,
    MAX_SECTIONS,
    MINOR,
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


def parse_preamble(block: bytes, path, actual_size: int) -> Preamble:
    if len(block) < len(MAGIC) and MAGIC.startswith(block):
        raise TruncatedError(path, "preamble", f"{PREAMBLE.size} bytes", f"{len(block)} bytes")
    if block[: len(MAGIC)] != MAGIC:
        hint = " (newline translation or 7-bit transfer?)" if block[1:4] == MAGIC[1:4] else ""
        raise BadMagicError(path, "magic" + hint, MAGIC, block[: len(MAGIC)])
    if len(block) < PREAMBLE.size:
        raise TruncatedError(path, "preamble", f"{PREAMBLE.size} bytes", f"{len(block)} bytes")
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
        raise TruncatedError(path, "file_length", f"{flen} bytes", f"{actual_size} bytes")
    if actual_size > flen:
        raise MalformedHeaderError(path, "file_length", f"{flen} bytes", f"{actual_size} bytes (trailing data)")
    return Preamble(major, minor, hlen, doff, hdig, flen)


def parse_header(data: bytes, path) -> dict:
    try:
        obj = canonical.loads(data, max_depth=MAX_JSON_DEPTH)
    except canonical.CanonicalError as e:
        raise MalformedHeaderError(path, "header", detail=str(e)) from None
    if not isinstance(obj, dict):
        raise MalformedHeaderError(path, "header", "an object", type(obj).__name__)
    missing = _TOP_KEYS - obj.keys()
    if missing:
        raise MalformedHeaderError(path, "header", f"keys {sorted(_TOP_KEYS)}", f"missing {sorted(missing)}")
    if obj["format"] != "hsnap":
        raise MalformedHeaderError(path, "header.format", "hsnap", obj["format"])
    feats = obj["features"]
    if not isinstance(feats, dict) or not all(isinstance(feats.get(k), list) for k in ("required", "optional")):
        raise MalformedHeaderError(path, "header.features", "{required: [...], optional: [...]}", feats)
    unknown = [f for f in feats["required"] if not isinstance(f, str) or f not in KNOWN_FEATURES]
    if unknown:
        raise UnsupportedFeatureError(path, "header.features.required", sorted(KNOWN_FEATURES), unknown)
    if not isinstance(obj["digest"], str) or obj["digest"] not in DIGEST_ALGORITHMS:
        raise UnsupportedFeatureError(path, "header.digest", DIGEST_ALGORITHMS, obj["digest"])
    return obj


def parse_sections(table, path, data_offset: int, end: int) -> tuple[SectionInfo, ...]:
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

    def __init__(self, path: str | os.PathLike[str]) -> None:
        self.path = os.fspath(path)
        self._mm = None
        self._fd = -1
        try:
            # O_NONBLOCK: a FIFO under a snapshot's name is refused below, not waited on
            fd = os.open(self.path, os.O_RDONLY | os.O_CLOEXEC | os.O_NONBLOCK | getattr(os, "O_NOFOLLOW", 0))
        except OSError as e:
            raise HsnapIOError(self.path, "open", e) from None
        try:
            st = os.fstat(fd)
            if not stat.S_ISREG(st.st_mode):
                raise MalformedHeaderError(self.path, "path", "a regular file", stat.filemode(st.st_mode))
            self.size = st.st_size
            block = os.pread(fd, PREAMBLE.size, 0)
            self.preamble = pre = parse_preamble(block, self.path, self.size)
            header = os.pread(fd, pre.header_length, HEADER_OFFSET)
            if len(header) != pre.header_length:
                raise TruncatedError(self.path, "header", pre.header_length, len(header))
            if xxhash.xxh3_128_digest(header) != pre.header_digest:
                raise DigestMismatchError(self.path, "header_digest", pre.header_digest.hex(), xxhash.xxh3_128_hexdigest(header))
            self.header_bytes = header
            self.header = parse_header(header, self.path)
            trailer_at = pre.file_length - TRAILER.size
            tra = os.pread(fd, TRAILER.size, trailer_at)
            self.sections = parse_sections(self.header["sections"], self.path, pre.data_offset, trailer_at)
            self._check_trailer(tra)
            self.identity = Identity.from_header(self.header["identity"], self.path)
            self.geometry = Geometry.from_header(self.header["geometry"], self.path)
            req = request_header_fields(self.header["request"], self.path)
            self._request_fields, self._request_counts = req["fields"], req["counts"]
            self.swa_start = self._int_field("swa_start")
            att = self.geometry.attention
            if self.swa_start and (att is None or att.kind != "swa"):
                raise MalformedHeaderError(self.path, "request.swa_start", "0 unless geometry.attention.kind is 'swa'", self.swa_start)
            self._check_layout()
            self._by_name = {s.name: s for s in self.sections}
            try:
                self._mm = mmap.mmap(fd, 0, access=mmap.ACCESS_READ)
            except OSError as e:
                raise HsnapIOError(self.path, "mmap", e) from None
        except OSError as e:
            os.close(fd)
            raise HsnapIOError(self.path, "read", e) from None
        except BaseException:
            os.close(fd)
            raise
        # Kept open: verification reads with pread, so a file truncated or unreadable
        # under an open reader gives a typed error (through the map it would be SIGBUS).
        self._fd = fd
        self._scratch = bytearray()
        self._verified: set[str] = set()

    # -- open-time checks (cheap: no section bytes read)
    def _int_field(self, key: str) -> int:
        v = self.header["request"].get(key, 0)
        if isinstance(v, bool) or not isinstance(v, int) or not 0 <= v <= self._request_fields["state_position"]:
            raise MalformedHeaderError(self.path, f"request.{key}", f"0..{self._request_fields['state_position']}", v)
        return v

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
        for s in self.sections:
            h.update(bytes.fromhex(s.digest))
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
        expected = state_sections(self.geometry, self._request_fields["state_position"], self.swa_start) + record_sections(
            c["prompt_tokens"], c["output_tokens"], c["has_logprobs"], c["top_logprobs_k"], rng
        )
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
    def _buffer(self):
        if self._mm is None:
            raise HsnapError(self.path, "snapshot", "open", "closed")
        return self._mm

    def _read(self, offset: int, length: int) -> memoryview:
        """Bytes [offset, offset+length) by pread into a reused buffer (valid until the next call)."""
        if self._fd < 0:
            raise HsnapError(self.path, "snapshot", "open", "closed")
        if len(self._scratch) < length:
            self._scratch = bytearray(length)
        view = memoryview(self._scratch)[:length]
        try:
            got = os.preadv(self._fd, [view], offset)
        except OSError as e:
            raise HsnapIOError(self.path, f"read at byte {offset}", e) from None
        if got != length:
            raise TruncatedError(self.path, f"read at byte {offset} (file changed under the reader?)", length, got)
        return view

    def fileno(self) -> int:
        """The open, read-only descriptor of the checked file (for pread-based copies)."""
        if self._fd < 0:
            raise HsnapError(self.path, "snapshot", "open", "closed")
        return self._fd

    def check_unchanged(self) -> None:
        """Refuse if the file's size changed since open (mapped views would fault)."""
        try:
            size = os.fstat(self._fd).st_size
        except OSError as e:
            raise HsnapIOError(self.path, "fstat", e) from None
        if size != self.file_length:
            raise TruncatedError(self.path, "file_length (changed since open)", self.file_length, size)

    def raw(self, name_or_info: str | SectionInfo) -> memoryview:
        s = name_or_info if isinstance(name_or_info, SectionInfo) else self.section(name_or_info)
        return memoryview(self._buffer())[s.offset : s.offset + s.length]

    def array(self, name_or_info: str | SectionInfo, *, verify: bool = False) -> np.ndarray:
        """Zero-copy read-only view of a section. ``verify=True`` checks its digest first (once)."""
        s = name_or_info if isinstance(name_or_info, SectionInfo) else self.section(name_or_info)
        if verify:
            self.verify_section(s)
        arr = np.frombuffer(self._buffer(), dtype=DTYPES[s.dtype], count=math.prod(s.shape), offset=s.offset)
        return arr.reshape(s.shape)

    __getitem__ = array

    def verify_section(self, name_or_info: str | SectionInfo, *, force: bool = False, cancelled=None, progress=None) -> bool:
        """Check one section's digest (once per open unless ``force``). Hashes in chunks so a
        multi-GB section can report ``progress(nbytes)`` and stop when ``cancelled()``;
        returns False when cancelled, True when verified."""
        s = name_or_info if isinstance(name_or_info, SectionInfo) else self.section(name_or_info)
        if s.name in self._verified and not force:
            return True
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
        self._verified.add(s.name)
        return True

    def padding_ranges(self) -> list[tuple[int, int]]:
        ranges, cursor = [], HEADER_OFFSET + self.preamble.header_length
        for s in self.sections:
            ranges.append((cursor, s.offset))
            cursor = s.offset + s.length
        ranges.append((cursor, self.file_length - TRAILER.size))
        return [(a, b) for a, b in ranges if b > a]

    def check_padding(self) -> None:
        for a, b in self.padding_ranges():
            for start in range(a, b, len(_ZERO_CHUNK)):
                stop = min(b, start + len(_ZERO_CHUNK))
                chunk = self._read(start, stop - start)
                if chunk != _ZERO_CHUNK[: stop - start]:
                    i = next(i for i, x in enumerate(chunk) if x)
                    raise DigestMismatchError(self.path, f"padding at byte {start + i}", "zero bytes", f"0x{chunk[i]:02x}")

    def iter_verify(self, cancelled=None) -> Iterator[tuple[SectionInfo, HsnapError | None]]:
        """Verify section by section, yielding (section, error or None); stops when ``cancelled()``."""
        for s in self.sections:
            if cancelled is not None and cancelled():
                return
            try:
                self.verify_section(s)
                yield s, None
            except HsnapError as e:
                yield s, e

    def verify(self) -> None:
        """Check every byte: padding is zero and every section matches its digest."""
        self.check_padding()
        for s, err in self.iter_verify():
            if err is not None:
                raise err

    def record(self, *, verify: bool = True) -> RequestRecord:
        """The request record, with its arrays copied out of the file."""
        arrays = {}
        for s in self.sections:
            if not s.is_state:
                arrays[s.kind] = np.array(self.array(s, verify=verify))
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
        if getattr(self, "_fd", -1) >= 0:
            os.close(self._fd)
            self._fd = -1
        if self._mm is not None:
            try:
                self._mm.close()
            except BufferError:  # views still alive; the map goes when they do
                pass
            self._mm = None

    def __enter__(self) -> "Snapshot":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def __repr__(self) -> str:
        return f"<hsnap.Snapshot {self.path!r} v{self.version[0]}.{self.version[1]} {len(self.sections)} sections, {self.payload_bytes} payload bytes>"


def section_digest(data) -> str:
    return xxhash.xxh3_128_hexdigest(data)
