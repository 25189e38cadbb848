"""Craft hsnap files for hostile-input tests: split a file into its parts and pack it
again with every check recomputed (header digest, preamble check, root digest,
trailer check), so a test reaches the structural checks behind the integrity layer.

Independent of the writer on purpose: only ``hsnap_format.spec`` constants and
``canonical.dumps`` are used, mirroring what ``spec/hsnap-v1.md`` describes.
"""

from __future__ import annotations

import copy
import json
import os
import re
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


# ---------------------------------------------------------------------------------------
# Re-signing arbitrary bytes (python -m mutation): a mutant keeps whatever structure its
# bytes have, and only the integrity fields are made honest again, so it reaches the
# structural and semantic checks behind them.

_TABLE_DIGEST = re.compile(rb'"digest":"([0-9a-f]{32})"')


def lay_out(data: bytes, header: bytes, data_offset: int, *, honest_lengths: bool = True) -> bytes:
    """``data``'s sections and trailer behind a new ``header`` whose data starts at ``data_offset``
    (the caller shifted the table's offsets). ``honest_lengths`` sets header_length, data_offset
    and file_length (preamble and trailer) to the new layout; the integrity fields keep their old
    values either way (:func:`resign` recomputes them)."""
    p = split(data)
    pad = max(0, data_offset - HEADER_OFFSET - len(header))
    flen = HEADER_OFFSET + len(header) + pad + len(p.body) + TRAILER.size
    if honest_lengths:
        p = replace(p, header_length=len(header), data_offset=data_offset, file_length=flen, trailer_file_length=flen)
    return pack_preamble(p, p.preamble_check) + header + bytes(pad) + p.body + pack_trailer(p, p.trailer_check)


def _fresh_table_digests(header: bytes, data: bytes) -> tuple[bytes, list[bytes]]:
    """``header`` with each table digest recomputed from the bytes its entry names (when the
    header parses and its ranges lie in ``data``), and the digests the root digest covers."""
    found = list(_TABLE_DIGEST.finditer(header))
    try:
        obj = json.loads(header.decode("utf-8"))
        table = obj["sections"] if isinstance(obj, dict) and isinstance(obj.get("sections"), list) else None
    except (ValueError, RecursionError, KeyError):
        table = None
    if table is None or len(found) != len(table):  # cannot pair digests with entries: keep them
        return header, [bytes.fromhex(m.group(1).decode()) for m in found]
    out, digests, at = [], [], 0
    for m, e in zip(found, table):
        d = m.group(1)
        off, ln = (e.get("offset"), e.get("length")) if isinstance(e, dict) else (None, None)
        if type(off) is int and type(ln) is int and 0 <= off and 0 <= ln <= 1 << 26 and off + ln <= len(data):
            d = xxhash.xxh3_128_hexdigest(data[off : off + ln]).encode()
        out += [header[at : m.start(1)], d]
        at = m.end(1)
        digests.append(bytes.fromhex(d.decode()))
    out.append(header[at:])
    return b"".join(out), digests


def resign(data: bytes) -> bytes:
    """Recompute every integrity field of ``data`` as its bytes lay it out, whatever else is
    wrong with it: each table digest (from the bytes the entry names), the header digest, the
    preamble check, the root digest and the trailer check (of the trailer the preamble's
    file_length points to, else the last 64 bytes). Lengths, offsets and counts stay as they are."""
    if len(data) < PREAMBLE.size:
        return data
    b = bytearray(data)
    hlen, flen = PREAMBLE.unpack(data[: PREAMBLE.size])[4], PREAMBLE.unpack(data[: PREAMBLE.size])[7]
    hend = min(len(b), HEADER_OFFSET + hlen)
    header, digests = _fresh_table_digests(bytes(b[HEADER_OFFSET:hend]), data)
    b[HEADER_OFFSET:hend] = header
    hdig = xxhash.xxh3_128_digest(header)
    t = flen - TRAILER.size if TRAILER.size <= flen <= len(b) else len(b) - TRAILER.size
    if t >= PREAMBLE.size:
        b[t + 24 : t + 40] = root_digest(hdig, [d.hex() for d in digests])
        b[t + 56 : t + 64] = check64(bytes(b[t : t + 56])).to_bytes(8, "little")
    b[32:48] = hdig
    b[56:64] = check64(bytes(b[:56])).to_bytes(8, "little")
    return bytes(b)


def resign_manifest(data: bytes) -> bytes:
    """A manifest with its digest line (line 2) recomputed from line 1; everything else kept."""
    nl = data.find(b"\n")
    if nl < 0:
        return data
    body, rest = data[: nl + 1], data[nl + 1 :]
    nl2 = rest.find(b"\n")
    return body + b"xxh3-128 " + xxhash.xxh3_128_hexdigest(body).encode() + (rest[nl2:] if nl2 >= 0 else b"")


def manifest_for(manifest: bytes, rank: int, rank_file: bytes) -> bytes:
    """``manifest`` (a valid one) with entry ``rank`` bound to ``rank_file`` as its bytes say
    (root digest from the trailer the preamble points to, length from the preamble), re-signed."""
    obj = canonical.loads(manifest.split(b"\n", 1)[0])
    if len(rank_file) >= PREAMBLE.size:
        flen = PREAMBLE.unpack(rank_file[: PREAMBLE.size])[7]
        t = flen - TRAILER.size if TRAILER.size <= flen <= len(rank_file) else len(rank_file) - TRAILER.size
        entry = obj["ranks"][rank]
        entry["length"] = flen if flen <= MAX_SAFE_LENGTH else entry["length"]
        if t >= 0:
            entry["root_digest"] = rank_file[t + 24 : t + 40].hex()
    return resign_manifest(canonical.dumps(obj) + b"\n" + manifest.split(b"\n", 1)[1])


MAX_SAFE_LENGTH = canonical.MAX_SAFE_INTEGER

__all__ += ["lay_out", "resign", "resign_manifest", "manifest_for"]
