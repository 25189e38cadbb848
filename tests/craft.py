"""Craft hsnap files for hostile-input tests: split a file into its parts and pack it
again with every check recomputed (header digest, preamble check, root digest,
trailer check), so a test reaches the structural checks behind the integrity layer.

Independent of the writer on purpose: only ``hsnap_format.spec`` constants and
``canonical.dumps`` are used, mirroring what ``spec/hsnap-v1.md`` describes.
"""

from __future__ import annotations

import copy
import os
from dataclasses import dataclass, replace

import xxhash

from hsnap_format import canonical
from hsnap_format.spec import ALIGNMENT, HEADER_OFFSET, PREAMBLE, TRAILER, align_up

_PRE_FIELDS = ("magic", "major", "minor", "bom", "header_length", "data_offset", "header_digest", "file_length", "preamble_check")
_TRA_FIELDS = ("trailer_magic", "trailer_file_length", "section_count", "root_digest", "reserved", "trailer_check")


@dataclass(frozen=True)
class Parts:
    magic: bytes
    major: int
    minor: int
    bom: int
    header_length: int
    data_offset: int
    header_digest: bytes
    file_length: int
    preamble_check: int
    header: bytes
    body: bytes  # bytes from data_offset up to the trailer
    trailer_magic: bytes
    trailer_file_length: int
    section_count: int
    root_digest: bytes
    reserved: bytes
    trailer_check: int

    @property
    def header_obj(self) -> dict:
        return canonical.loads(self.header)


def split(data: bytes) -> Parts:
    pre = PREAMBLE.unpack(data[: PREAMBLE.size])
    hlen, doff = pre[4], pre[5]
    tra = TRAILER.unpack(data[-TRAILER.size :])
    return Parts(*pre, header=data[HEADER_OFFSET : HEADER_OFFSET + hlen], body=data[doff : len(data) - TRAILER.size], **dict(zip(_TRA_FIELDS, tra)))


def check64(block: bytes) -> int:
    """The preamble/trailer check: xxh3-64 of the first 56 bytes, as the u64 stored little-endian."""
    return xxhash.xxh3_64_intdigest(block[:56])


def root_digest(header_digest: bytes, section_digests) -> bytes:
    h = xxhash.xxh3_128()
    h.update(header_digest)
    for d in section_digests:
        h.update(bytes.fromhex(d))
    return h.digest()


def pack_preamble(p: Parts, check: int | None = None) -> bytes:
    block = PREAMBLE.pack(p.magic, p.major, p.minor, p.bom, p.header_length, p.data_offset, p.header_digest, p.file_length, 0)
    return block[:56] + (check64(block) if check is None else check).to_bytes(8, "little")


def pack_trailer(p: Parts, check: int | None = None) -> bytes:
    block = TRAILER.pack(p.trailer_magic, p.trailer_file_length, p.section_count, p.root_digest, p.reserved, 0)
    return block[:56] + (check64(block) if check is None else check).to_bytes(8, "little")


def _table_digests(obj):
    try:
        return [e["digest"] for e in obj["sections"] if bytes.fromhex(e["digest"]) and len(e["digest"]) == 32]
    except Exception:
        return None


def _encode(obj, shift: int) -> bytes:
    if shift:
        obj = copy.deepcopy(obj)
        for e in obj.get("sections", []) if isinstance(obj.get("sections"), list) else []:
            if isinstance(e, dict) and isinstance(e.get("offset"), int) and not isinstance(e["offset"], bool):
                e["offset"] += shift
    return canonical.dumps(obj)


def rebuild(data: bytes, header: dict | bytes | None = None, **overrides) -> bytes:
    """``data`` with its header replaced and every check recomputed.

    ``header``: a dict (encoded canonically; when it no longer fits before the data,
    the data moves to the next multiple of 4096 and the table's offsets move with it),
    raw bytes (used as they are), or None (keep). ``overrides`` set preamble or
    trailer fields (names of :class:`Parts`) after the honest values are computed;
    overriding ``header_digest``, ``root_digest`` or a check keeps the lie.
    """
    p = split(data)
    d0 = p.data_offset
    if header is None:
        header = p.header
    if isinstance(header, dict):
        d1 = d0
        while True:
            hb = _encode(header, d1 - d0)
            need = align_up(HEADER_OFFSET + len(hb))
            if need <= d1:
                break
            d1 = need
        obj = canonical.loads(hb, max_depth=64)
    else:
        hb = header
        d1 = max(d0, align_up(HEADER_OFFSET + len(hb)))
        try:
            obj = canonical.loads(hb, max_depth=64)
        except Exception:
            obj = None
    hdig = xxhash.xxh3_128_digest(hb)
    digests = _table_digests(obj) if isinstance(obj, dict) else None
    flen = d1 + len(p.body) + TRAILER.size
    p = replace(
        p,
        header=hb,
        header_length=len(hb),
        data_offset=d1,
        header_digest=hdig,
        file_length=flen,
        trailer_file_length=flen,
        section_count=len(digests) if digests is not None else p.section_count,
        root_digest=root_digest(hdig, digests) if digests is not None else p.root_digest,
    )
    pre_check = overrides.pop("preamble_check", None)
    tra_check = overrides.pop("trailer_check", None)
    unknown = set(overrides) - set(_PRE_FIELDS) - set(_TRA_FIELDS)
    if unknown:
        raise TypeError(f"unknown fields {sorted(unknown)}")
    p = replace(p, **overrides)
    out = pack_preamble(p, pre_check) + hb + bytes(d1 - HEADER_OFFSET - len(hb)) + p.body + pack_trailer(p, tra_check)
    return out


def mutate_header(data: bytes, fn) -> bytes:
    """Rebuild ``data`` with ``fn(header_dict)`` applied to a copy of its header (fn may return a new object)."""
    obj = split(data).header_obj
    new = fn(obj)
    return rebuild(data, obj if new is None else new)


def flip(data: bytes, bit: int) -> bytes:
    b = bytearray(data)
    b[bit // 8] ^= 1 << (bit % 8)
    return bytes(b)


def write(path, data: bytes) -> str:
    with open(path, "wb") as f:
        f.write(data)
    return os.fspath(path)


__all__ = ["Parts", "split", "check64", "root_digest", "pack_preamble", "pack_trailer", "rebuild", "mutate_header", "flip", "write", "ALIGNMENT"]
