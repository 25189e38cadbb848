"""Everything a reader must refuse, and how: every truncation and every bit flip of the
golden vectors' integrity-covered structures, corruption found by verify(), hostile
headers that pass the integrity layer (tests/craft.py recomputes every check), and
hostile snapshot directories. Only typed HsnapErrors may come out, and a hostile
header must not make the reader allocate memory sized by what it claims."""

from __future__ import annotations

import json
import os
import re
import shutil
import tracemalloc
from pathlib import Path

import pytest
import xxhash

import craft
from hsnap_format import canonical
from hsnap_format.errors import (
    BadMagicError,
    DigestMismatchError,
    HsnapError,
    HsnapIOError,
    MalformedHeaderError,
    MalformedManifestError,
    TruncatedError,
    UnsupportedFeatureError,
    UnsupportedVersionError,
)
from hsnap_format.manifest import SnapshotSet
from hsnap_format.stores import open_snapshot
from hsnap_format.reader import Snapshot
from hsnap_format.spec import MAGIC, MAX_MANIFEST_BYTES, PREAMBLE

VEC = Path(__file__).resolve().parents[1] / "spec" / "vectors"
RANK_FILES = [
    ("attention-only", VEC / "attention-only.hsnap"),
    ("hybrid", VEC / "hybrid.hsnap"),
    ("mla-fp8", VEC / "mla-fp8.hsnap"),
    ("two-rank/rank-0", VEC / "two-rank" / "rank-0.hsnap"),
    ("two-rank/rank-1", VEC / "two-rank" / "rank-1.hsnap"),
]
IDS = [n for n, _ in RANK_FILES]
HYBRID = (VEC / "hybrid.hsnap").read_bytes()


def open_error(path) -> HsnapError | None:
    """Open ``path``; return the HsnapError it raised (anything else propagates and fails the test)."""
    try:
        Snapshot(path).close()
    except HsnapError as e:
        return e
    return None


class InPlace:
    """A scratch copy rewritten in place (pwrite/ftruncate): cheap enough for every bit of a header."""

    def __init__(self, path: Path, data: bytes) -> None:
        self.path, self.data = path, data
        path.write_bytes(data)
        self.fd = os.open(path, os.O_RDWR)

    def flip(self, bit: int):
        i = bit // 8
        os.pwrite(self.fd, bytes([self.data[i] ^ (1 << (bit % 8))]), i)
        return i

    def restore(self, i: int) -> None:
        os.pwrite(self.fd, self.data[i : i + 1], i)

    def close(self) -> None:
        os.close(self.fd)


def layout(data: bytes):
    pre = PREAMBLE.unpack(data[: PREAMBLE.size])
    return pre[4], pre[5], pre[7]  # header_length, data_offset, file_length


# ----------------------------------------------------------------------------- truncation


@pytest.mark.parametrize("label,path", RANK_FILES, ids=IDS)
def test_every_truncation_is_truncated_error(label, path, tmp_path):
    data = path.read_bytes()
    f = InPlace(tmp_path / "t.hsnap", data)
    wrong = []
    try:
        for n in range(len(data) - 1, -1, -1):
            os.ftruncate(f.fd, n)
            e = open_error(f.path)
            if type(e) is not TruncatedError:
                wrong.append((n, e))
    finally:
        f.close()
    assert wrong == []


def _sample_lengths(n: int, hlen: int, doff: int) -> list[int]:
    edges = set(range(0, 80)) | {63 + hlen, 64 + hlen, 65 + hlen, doff - 1, doff, doff + 1, n - 65, n - 64, n - 63, n - 1}
    return sorted(edges | set(range(0, n, 211)))


@pytest.mark.parametrize("rank", [0, 1])
def test_truncated_rank_file_inside_directory(rank, tmp_path):
    d = tmp_path / "set"
    shutil.copytree(VEC / "two-rank", d)
    target = d / f"rank-{rank}.hsnap"
    data = target.read_bytes()
    hlen, doff, flen = layout(data)
    f = InPlace(target, data)
    try:
        for n in reversed(_sample_lengths(flen, hlen, doff)):  # shrinking only: the prefix stays the original
            os.ftruncate(f.fd, n)
            with pytest.raises(TruncatedError):
                SnapshotSet(d)
    finally:
        f.close()


def test_every_truncation_of_the_manifest(tmp_path):
    d = tmp_path / "set"
    shutil.copytree(VEC / "two-rank", d)
    m = d / "manifest.json"
    data = m.read_bytes()
    for n in range(len(data)):
        m.write_bytes(data[:n])
        with pytest.raises(TruncatedError):
            SnapshotSet(d)


# ----------------------------------------------------------------------------- bit flips


@pytest.mark.parametrize("label,path", RANK_FILES, ids=IDS)
def test_every_bit_flip_in_preamble_header_trailer(label, path, tmp_path):
    data = path.read_bytes()
    hlen, doff, flen = layout(data)
    f = InPlace(tmp_path / "f.hsnap", data)
    regions = [
        (0, 8, BadMagicError, None),
        (8, 64, DigestMismatchError, "preamble.check"),
        (64, 64 + hlen, DigestMismatchError, "header_digest"),
        (flen - 64, flen, DigestMismatchError, "trailer.check"),
    ]
    wrong, count = [], 0
    try:
        for start, stop, cls, fld in regions:
            for bit in range(start * 8, stop * 8):
                i = f.flip(bit)
                e = open_error(f.path)
                f.restore(i)
                count += 1
                if type(e) is not cls or (fld is not None and e.field != fld):
                    wrong.append((bit, e))
    finally:
        f.close()
    assert count == (128 + hlen) * 8
    assert wrong == []


@pytest.mark.parametrize("label,path", RANK_FILES, ids=IDS)
def test_flip_in_each_section_and_padding_found_by_verify(label, path, tmp_path):
    data = path.read_bytes()
    with Snapshot(path) as snap:
        sections = [(s.name, s.offset, s.length) for s in snap.sections]
        padding = snap.padding_ranges()
    assert padding, "every vector has header and section padding"
    f = InPlace(tmp_path / "f.hsnap", data)
    try:
        for name, off, length in sections:
            for pos in sorted({off, off + length // 2, off + length - 1}) if length else []:
                i = f.flip(pos * 8 + 3)
                with Snapshot(f.path) as snap:  # open reads no section byte: it succeeds
                    with pytest.raises(DigestMismatchError) as ei:
                        snap.verify()
                    assert ei.value.field == f"sections[{name!r}].digest", name
                    bad = [s.name for s, e in snap.iter_verify() if e is not None]
                    assert bad == [name]
                f.restore(i)
        for a, b in padding:
            for pos in sorted({a, (a + b) // 2, b - 1}):
                i = f.flip(pos * 8)
                with Snapshot(f.path) as snap:
                    with pytest.raises(DigestMismatchError) as ei:
                        snap.verify()
                    assert ei.value.field == f"padding at byte {pos}"
                    assert all(e is None for _, e in snap.iter_verify())  # sections themselves are intact
                f.restore(i)
    finally:
        f.close()


def test_every_bit_flip_in_the_manifest(tmp_path):
    d = tmp_path / "set"
    shutil.copytree(VEC / "two-rank", d)
    m = d / "manifest.json"
    data = m.read_bytes()
    f = InPlace(m, data)
    wrong = []
    try:
        for bit in range(len(data) * 8):
            i = f.flip(bit)
            try:
                SnapshotSet(d).close()
                wrong.append((bit, None))
            except (DigestMismatchError, MalformedManifestError, TruncatedError):
                pass
            f.restore(i)
    finally:
        f.close()
    assert wrong == []


@pytest.mark.parametrize("how", ["crlf-to-lf", "lf-to-crlf", "7-bit", "utf8-reencoded"])
def test_text_mode_mangling_is_bad_magic(how, tmp_path):
    data = HYBRID
    mangled = {
        "crlf-to-lf": lambda: data.replace(b"\r\n", b"\n"),
        "lf-to-crlf": lambda: data.replace(b"\n", b"\r\n"),
        "7-bit": lambda: bytes(b & 0x7F for b in data),
        "utf8-reencoded": lambda: data.decode("latin-1").encode("utf-8"),
    }[how]()
    e = open_error(craft.write(tmp_path / "m.hsnap", mangled))
    assert type(e) is BadMagicError


@pytest.mark.parametrize("data", [b"", b"\x89", b"\x89HSN\r\n\x1a", b"GGUF", b"PK\x03\x04" + bytes(100), b"{}"])
def test_not_an_hsnap_file(data, tmp_path):
    e = open_error(craft.write(tmp_path / "x.hsnap", data))
    assert type(e) is (TruncatedError if MAGIC.startswith(data) else BadMagicError)


# ----------------------------------------------------------------------------- hostile headers


def H(fn):
    """A case that edits the hybrid vector's header (a dict) and re-packs with valid checks."""
    return lambda: craft.mutate_header(HYBRID, fn)


def R(old: bytes, new: bytes, count: int = 1):
    """A case that replaces raw header bytes (non-canonical JSON) and re-packs with valid checks."""

    def build():
        header = craft.split(HYBRID).header
        assert header.count(old) >= 1, old
        return craft.rebuild(HYBRID, header.replace(old, new, count))

    return build


def P(**fields):
    """A case that sets preamble/trailer fields, checks recomputed."""
    return lambda: craft.rebuild(HYBRID, **fields)


def _set(path: str, value):
    def fn(h):
        *parents, last = path.split(".")
        obj = h
        for p in parents:
            obj = obj[int(p)] if isinstance(obj, list) else obj[p]
        if isinstance(obj, list):
            obj[int(last)] = value
        else:
            obj[last] = value

    return fn


def _del(path: str):
    def fn(h):
        *parents, last = path.split(".")
        obj = h
        for p in parents:
            obj = obj[int(p)] if isinstance(obj, list) else obj[p]
        del obj[last]

    return fn


def _each_section(fn):
    def apply(h):
        for s in h["sections"]:
            fn(s)

    return apply


def _shift_from(i: int, delta: int):
    def fn(h):
        for s in h["sections"][i:]:
            s["offset"] += delta

    return fn


def _nest(depth: int):
    def fn(h):
        v = 0
        for _ in range(depth):
            v = [v]
        h["request"]["extra"]["deep"] = v

    return fn


def _big_mamba(h):
    h["geometry"]["mamba"]["layers"] = [i for i in range(65536) if i not in (1, 3)]
    h["geometry"]["mamba"]["conv_shapes"] = [[6, 3]] * 8


def _swap_names(h):
    a, b = h["sections"][2], h["sections"][3]
    a["name"], b["name"] = b["name"], a["name"]


RX = re.compile
HLEN = craft.split(HYBRID).header_length
DOFF = craft.split(HYBRID).data_offset
FLEN = len(HYBRID)
FIRST_SECTION_OFFSET = DOFF

CASES = {
    # preamble: lengths and offsets (checks valid)
    "header_length_gigabytes": (P(header_length=3 << 30), MalformedHeaderError, "preamble.header_length"),
    "header_length_max_u64": (P(header_length=2**64 - 1), MalformedHeaderError, "preamble.header_length"),
    "header_length_zero": (P(header_length=0), MalformedHeaderError, "preamble.header_length"),
    "header_length_past_data": (P(header_length=DOFF), MalformedHeaderError, "preamble.data_offset"),
    "header_length_short": (lambda: craft.rebuild(HYBRID, header_length=HLEN - 1, header_digest=xxhash.xxh3_128_digest(craft.split(HYBRID).header[:-1])), MalformedHeaderError, "header"),
    "data_offset_unaligned": (P(data_offset=DOFF + 1), MalformedHeaderError, "preamble.data_offset"),
    "data_offset_zero": (P(data_offset=0), MalformedHeaderError, "preamble.data_offset"),
    "data_offset_huge": (P(data_offset=1 << 62), MalformedHeaderError, "preamble.file_length"),
    "data_offset_later": (P(data_offset=DOFF + 4096), MalformedHeaderError, None),
    "file_length_huge": (P(file_length=1 << 62, trailer_file_length=1 << 62), TruncatedError, "file_length"),
    "file_length_short": (P(file_length=FLEN - 4096, trailer_file_length=FLEN - 4096), MalformedHeaderError, "file_length"),
    "file_length_tiny": (P(file_length=100), MalformedHeaderError, "preamble.file_length"),
    "big_endian_bom": (P(bom=0x0D0C0B0A), MalformedHeaderError, "preamble.byte_order"),
    "newer_major": (P(major=2), UnsupportedVersionError, None),
    "major_zero": (P(major=0), UnsupportedVersionError, None),
    "header_digest_wrong": (P(header_digest=bytes(16)), DigestMismatchError, "header_digest"),
    # trailer (checks valid)
    "trailer_magic": (P(trailer_magic=b"HSNAPEN\0"), MalformedHeaderError, "trailer.magic"),
    "trailer_file_length": (P(trailer_file_length=FLEN + 1), MalformedHeaderError, "trailer.file_length"),
    "trailer_section_count": (P(section_count=15), MalformedHeaderError, "trailer.section_count"),
    "trailer_reserved": (P(reserved=b"\1" + bytes(15)), MalformedHeaderError, "trailer.reserved"),
    "trailer_root_digest": (P(root_digest=bytes(16)), DigestMismatchError, "trailer.root_digest"),
    # non-canonical or non-JSON header text
    "whitespace": (R(b'{"digest"', b'{ "digest"'), MalformedHeaderError, "header"),
    "trailing_newline": (lambda: craft.rebuild(HYBRID, craft.split(HYBRID).header + b"\n"), MalformedHeaderError, "header"),
    "key_order": (lambda: craft.rebuild(HYBRID, json.dumps(dict(reversed(list(craft.split(HYBRID).header_obj.items()))), separators=(",", ":"), ensure_ascii=False).encode()), MalformedHeaderError, "header"),
    "float_as_int_form": (R(b'"top_k":20', b'"top_k":20.0'), MalformedHeaderError, "header"),
    "exponent_form": (R(b'"temperature":0.7', b'"temperature":7e-1'), MalformedHeaderError, "header"),
    "python_float_form": (R(b'"min_p":0.00001', b'"min_p":1e-05'), MalformedHeaderError, "header"),
    "negative_zero": (R(b'"frequency_penalty":0', b'"frequency_penalty":-0'), MalformedHeaderError, "header"),
    "escaped_solidus": (R(b'"</s>"', b'"<\\/s>"'), MalformedHeaderError, "header"),
    "escaped_non_ascii": (R("\u505c".encode(), b"\\u505c"), MalformedHeaderError, "header"),
    "uppercase_escape": (R(b'\\n"', b'\\u000A"'), MalformedHeaderError, "header"),
    "duplicate_key": (R(b'{"digest":"xxh3-128",', b'{"digest":"xxh3-128","digest":"xxh3-128",'), MalformedHeaderError, "header"),
    "nan": (R(b'"temperature":0.7', b'"temperature":NaN'), MalformedHeaderError, "header"),
    "infinity": (R(b'"temperature":0.7', b'"temperature":-Infinity'), MalformedHeaderError, "header"),
    "overflow_to_inf": (R(b'"temperature":0.7', b'"temperature":1e999'), MalformedHeaderError, "header"),
    "int_beyond_2_53": (R(b'"state_position":5', b'"state_position":9007199254740993'), MalformedHeaderError, "header"),
    "int_2_60_not_shortest": (R(b'"state_position":5', b'"state_position":1152921504606846976'), MalformedHeaderError, "header"),
    "int_1e20_canonical": (R(b'"state_position":5', b'"state_position":100000000000000000000'), MalformedHeaderError, "request.state_position"),
    "huge_int_literal": (R(b'"state_position":5', b'"state_position":' + b"9" * 5000), MalformedHeaderError, "header"),
    "lone_surrogate": (R(b'"rid":"vector-hybrid"', b'"rid":"\\ud800"'), MalformedHeaderError, "header"),
    "not_utf8": (R(b'"rid":"vector-hybrid"', b'"rid":"vector-\xff\xfe"'), MalformedHeaderError, "header"),
    "control_char_raw": (R(b'"rid":"vector-hybrid"', b'"rid":"vector\x01"'), MalformedHeaderError, "header"),
    "deep_nesting_17": (H(_nest(17)), MalformedHeaderError, "header"),
    "deep_nesting_100000": (lambda: craft.rebuild(HYBRID, b"[" * 100000 + b"]" * 100000), MalformedHeaderError, "header"),
    "deep_nesting_unclosed": (lambda: craft.rebuild(HYBRID, b'{"a":' + b"[" * 50000), MalformedHeaderError, "header"),
    "header_array": (lambda: craft.rebuild(HYBRID, b"[]"), MalformedHeaderError, "header"),
    "header_string": (lambda: craft.rebuild(HYBRID, b'"hsnap"'), MalformedHeaderError, "header"),
    "header_garbage": (lambda: craft.rebuild(HYBRID, bytes(range(256))), MalformedHeaderError, "header"),
    # top level
    "missing_sections": (H(_del("sections")), MalformedHeaderError, "header"),
    "missing_identity": (H(_del("identity")), MalformedHeaderError, "header"),
    "format_other": (H(_set("format", "gguf")), MalformedHeaderError, "header.format"),
    "features_not_object": (H(_set("features", [])), MalformedHeaderError, "header.features"),
    "features_required_not_list": (H(_set("features", {"required": "x", "optional": []})), MalformedHeaderError, "header.features"),
    "unknown_required_feature": (H(_set("features.required", ["zstd-sections"])), UnsupportedFeatureError, "header.features.required"),
    "required_feature_unhashable": (H(_set("features.required", [["zstd"]])), MalformedHeaderError, "header.features.required"),
    "required_feature_number": (H(_set("features.required", [1])), MalformedHeaderError, "header.features.required"),
    # a number among the optional features was accepted once (and crashed the viewer)
    "optional_feature_number": (H(_set("features.optional", [7])), MalformedHeaderError, "header.features.optional"),
    "optional_feature_list": (H(_set("features.optional", [["x"]])), MalformedHeaderError, "header.features.optional"),
    "digest_sha256": (H(_set("digest", "sha256")), UnsupportedFeatureError, "header.digest"),
    "digest_unhashable": (H(_set("digest", ["xxh3-128"])), UnsupportedFeatureError, "header.digest"),
    # section table
    "sections_not_list": (H(_set("sections", {})), MalformedHeaderError, "header.sections"),
    "too_many_sections": (H(_set("sections", [0] * 70000)), MalformedHeaderError, "header.sections"),
    "section_not_object": (H(_set("sections.0", 0)), MalformedHeaderError, "sections[0]"),
    "section_extra_key": (H(_set("sections.0.compression", "none")), MalformedHeaderError, "sections[0]"),
    "section_missing_key": (H(_del("sections.0.layer")), MalformedHeaderError, "sections[0]"),
    "overlapping_sections": (H(_set("sections.1.offset", FIRST_SECTION_OFFSET)), MalformedHeaderError, RX(r"sections\['mamba.0.temporal'\].offset")),
    "unaligned_section": (H(_set("sections.1.offset", FIRST_SECTION_OFFSET + 4097)), MalformedHeaderError, RX(r".*\.offset")),
    "gap_between_sections": (H(_shift_from(5, 4096)), MalformedHeaderError, None),
    "section_past_trailer": (H(_set("sections.13.offset", FLEN)), MalformedHeaderError, None),
    "section_offset_huge": (H(_set("sections.0.offset", 2**53 - 1)), MalformedHeaderError, RX(r".*\.offset")),
    "section_offset_negative": (H(_set("sections.0.offset", -4096)), MalformedHeaderError, RX(r".*\.offset")),
    "section_offset_string": (H(_set("sections.0.offset", "4096")), MalformedHeaderError, RX(r".*\.offset")),
    "section_length_bool": (H(_set("sections.0.length", True)), MalformedHeaderError, RX(r".*\.length")),
    "section_length_wrong": (H(_set("sections.0.length", 37)), MalformedHeaderError, RX(r".*\.length")),
    "section_length_huge": (H(_set("sections.13.length", 2**52)), MalformedHeaderError, RX(r".*\.length")),
    "absurd_shape": (H(_set("sections.0.shape", [2**39] * 8)), MalformedHeaderError, RX(r".*\.length")),
    "absurd_shape_with_length": (H(lambda h: h["sections"][13].update(shape=[2**39] * 8, length=2**53 - 1)), MalformedHeaderError, None),
    "shape_too_many_dims": (H(_set("sections.0.shape", [1] * 9)), MalformedHeaderError, RX(r".*\.shape")),
    "shape_negative": (H(_set("sections.0.shape", [-6, -3])), MalformedHeaderError, RX(r".*\.shape")),
    "shape_float": (H(_set("sections.0.shape", [6, 3.5])), MalformedHeaderError, RX(r".*\.shape")),
    "shape_bool": (H(_set("sections.0.shape", [True, 3])), MalformedHeaderError, RX(r".*\.shape")),
    "shape_not_list": (H(_set("sections.0.shape", "6x3")), MalformedHeaderError, RX(r".*\.shape")),
    "duplicate_section_name": (H(_set("sections.1.name", "mamba.0.conv.0")), MalformedHeaderError, RX(r".*\.name")),
    "section_name_number": (H(_set("sections.1.name", 7)), MalformedHeaderError, RX(r".*\.name")),
    "unknown_kind": (H(_set("sections.0.kind", "ssm")), MalformedHeaderError, RX(r".*\.kind")),
    "kind_unhashable": (H(_set("sections.0.kind", ["conv"])), MalformedHeaderError, RX(r".*\.kind")),
    "unknown_dtype": (H(_set("sections.0.dtype", "float128")), MalformedHeaderError, RX(r".*\.dtype")),
    "dtype_unhashable": (H(_set("sections.0.dtype", {"name": "bfloat16"})), MalformedHeaderError, RX(r".*\.dtype")),
    "layer_negative": (H(_set("sections.0.layer", -1)), MalformedHeaderError, RX(r".*\.layer")),
    "layer_string": (H(_set("sections.0.layer", "0")), MalformedHeaderError, RX(r".*\.layer")),
    "layer_bool": (H(_set("sections.0.layer", False)), MalformedHeaderError, RX(r".*\.layer")),
    "digest_uppercase": (H(lambda h: h["sections"][0].update(digest=h["sections"][0]["digest"].upper())), MalformedHeaderError, RX(r".*\.digest")),
    "digest_short": (H(_set("sections.0.digest", "00")), MalformedHeaderError, RX(r".*\.digest")),
    "digest_number": (H(_set("sections.0.digest", 0)), MalformedHeaderError, RX(r".*\.digest")),
    "table_disagrees_names": (H(_swap_names), MalformedHeaderError, RX(r"sections\[2\]")),
    "table_disagrees_dtype": (H(lambda h: h["sections"][1].update(dtype="int32")), MalformedHeaderError, RX(r"sections\[1\]")),
    "rng_flag_without_section": (H(_set("request.has_rng_state", False)), MalformedHeaderError, "request.has_rng_state"),
    # request record
    "request_not_object": (H(_set("request", [])), MalformedHeaderError, "request"),
    "state_position_past_tokens": (H(_set("request.state_position", 7)), MalformedHeaderError, "request.state_position"),
    "state_position_negative": (H(_set("request.state_position", -1)), MalformedHeaderError, "request.state_position"),
    "prompt_tokens_absurd": (H(_set("request.prompt_tokens", 2**40)), MalformedHeaderError, "request.prompt_tokens"),
    "prompt_tokens_large": (H(_set("request.prompt_tokens", 2**32)), MalformedHeaderError, None),
    "output_tokens_mismatch": (H(lambda h: h["request"].update(output_tokens=4, remaining_budget=28)), MalformedHeaderError, None),
    "remaining_budget_wrong": (H(_set("request.remaining_budget", 30)), MalformedHeaderError, "request.remaining_budget"),
    "remaining_budget_bool": (H(lambda h: [h["request"]["stop"].update(max_new_tokens=4), h["request"].update(remaining_budget=True)] and None), MalformedHeaderError, "request.remaining_budget"),
    "max_new_below_output": (H(lambda h: [h["request"]["stop"].update(max_new_tokens=2), h["request"].update(remaining_budget=-1)] and None), MalformedHeaderError, "request.stop.max_new_tokens"),
    "has_logprobs_string": (H(_set("request.has_logprobs", "yes")), MalformedHeaderError, "request.has_logprobs"),
    "top_k_absurd": (H(_set("request.top_logprobs_k", 10**6)), MalformedHeaderError, "request.top_logprobs_k"),
    "top_k_mismatch": (H(_set("request.top_logprobs_k", 3)), MalformedHeaderError, None),
    "swa_start_past_position": (H(_set("request.swa_start", 6)), MalformedHeaderError, "request.swa_start"),
    "swa_start_negative": (H(_set("request.swa_start", -1)), MalformedHeaderError, "request.swa_start"),
    "swa_start_float": (H(_set("request.swa_start", 0.5)), MalformedHeaderError, "request.swa_start"),
    "rid_number": (H(_set("request.rid", 5)), MalformedHeaderError, "request.rid"),
    "rid_huge": (H(_set("request.rid", "x" * 5000)), MalformedHeaderError, "request.rid"),
    "streamed_past_output": (H(_set("request.streamed.tokens", 4)), MalformedHeaderError, "request.streamed.tokens"),
    "reasoning_past_output": (H(_set("request.streamed.reasoning_tokens", 4)), MalformedHeaderError, "request.streamed.reasoning_tokens"),
    "streamed_missing": (H(_del("request.streamed")), MalformedHeaderError, "request.streamed"),
    "sampling_nested": (H(_set("request.sampling.logit_bias", {"1": 2})), MalformedHeaderError, "request.sampling"),
    "stop_ids_out_of_range": (H(_set("request.stop.stop_token_ids", [2**31])), MalformedHeaderError, "request.stop.stop_token_ids"),
    "stop_strings_not_strings": (H(_set("request.stop.stop_strings", [1])), MalformedHeaderError, "request.stop.stop_strings[0]"),
    "ignore_eos_int": (H(_set("request.stop.ignore_eos", 0)), MalformedHeaderError, "request.stop.ignore_eos"),
    "extra_nested": (H(_set("request.extra.obj", {"a": 1})), MalformedHeaderError, "request.extra"),
    # geometry
    "geometry_null": (H(_set("geometry", None)), MalformedHeaderError, "geometry"),
    "attention_kind_unknown": (H(_set("geometry.attention.kind", "gqa")), MalformedHeaderError, "geometry.attention.kind"),
    "attention_kind_unhashable": (H(_set("geometry.attention.kind", ["mha"])), MalformedHeaderError, "geometry.attention.kind"),
    "heads_zero": (H(_set("geometry.attention.heads", 0)), MalformedHeaderError, "geometry.attention.heads"),
    "heads_mismatch": (H(_set("geometry.attention.heads", 2)), MalformedHeaderError, None),
    "head_dim_absurd": (H(_set("geometry.attention.k_head_dim", 2**30)), MalformedHeaderError, "geometry.attention.k_head_dim"),
    "dtype_unknown": (H(_set("geometry.attention.dtype", "float128")), MalformedHeaderError, "geometry.attention.dtype"),
    "dtype_list": (H(_set("geometry.attention.dtype", ["bfloat16"])), MalformedHeaderError, "geometry.attention.dtype"),
    "conv_dtype_list": (H(_set("geometry.mamba.conv_dtype", ["bfloat16"])), MalformedHeaderError, "geometry.mamba.conv_dtype"),
    "page_size_zero": (H(_set("geometry.attention.page_size", 0)), MalformedHeaderError, "geometry.attention.page_size"),
    "layer_in_two_groups": (H(_set("geometry.mamba.layers", [0, 1])), MalformedHeaderError, "geometry"),
    "layer_ids_absurd": (H(_set("geometry.attention.layers", [1, 2**20])), MalformedHeaderError, "geometry.attention.layers"),
    "layer_id_65536": (H(_set("geometry.attention.layers", [1, 65536])), MalformedHeaderError, "geometry.attention.layers"),
    "absurd_layer_count": (H(_big_mamba), MalformedHeaderError, "sections"),
    "conv_shapes_empty": (H(_set("geometry.mamba.conv_shapes", [])), MalformedHeaderError, "geometry.mamba.conv_shapes"),
    "conv_shapes_nine": (H(_set("geometry.mamba.conv_shapes", [[6, 3]] * 9)), MalformedHeaderError, "geometry.mamba.conv_shapes"),
    "conv_shape_absurd": (H(_set("geometry.mamba.conv_shapes", [[6, 3], [2**41, 3]])), MalformedHeaderError, "geometry.mamba.conv_shapes[1]"),
    "temporal_shape_absurd": (H(_set("geometry.mamba.temporal_shape", [2**40] * 8)), MalformedHeaderError, None),
    "conv_slice_axis_nine": (H(_set("geometry.mamba.conv_slice_axis", 9)), MalformedHeaderError, "geometry.mamba.conv_slice_axis"),
    # identity
    "identity_not_object": (H(_set("identity", "me")), MalformedHeaderError, "identity"),
    "tp_rank_past_size": (H(_set("identity.tp_rank", 1)), MalformedHeaderError, "identity.tp_rank"),
    "tp_size_zero": (H(_set("identity.tp_size", 0)), MalformedHeaderError, "identity.tp_size"),
    "model_id_number": (H(_set("identity.model_id", 5)), MalformedHeaderError, "identity.model_id"),
    "engine_missing": (H(_del("identity.engine")), MalformedHeaderError, "identity.engine"),
    "numerics_nested": (H(_set("identity.numerics.x", {"y": 1})), MalformedHeaderError, "identity.numerics"),
}


@pytest.mark.parametrize("case", sorted(CASES))
def test_hostile_header(case, tmp_path):
    build, cls, fld = CASES[case]
    path = craft.write(tmp_path / f"{case}.hsnap", build())
    tracemalloc.start()
    try:
        e = open_error(path)
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert type(e) is cls, (case, e)
    if isinstance(fld, re.Pattern):
        assert fld.fullmatch(e.field), (case, e.field)
    elif fld is not None:
        assert e.field == fld, (case, e.field)
    assert peak < 32 << 20, f"{case}: the reader allocated {peak} bytes"
    assert "\n" not in str(e)


def _mutated(fn) -> dict:
    h = craft.split(HYBRID).header_obj
    fn(h)
    return h


def test_newer_minor_and_additive_fields_are_accepted(tmp_path):
    def additive(h):
        h["future_top_level"] = {"anything": [1, 2]}
        h["features"]["optional"].append("some-future-feature")
        h["request"]["future_field"] = 1
        h["identity"]["future_field"] = "x"

    data = craft.rebuild(HYBRID, _mutated(additive), minor=7)
    with Snapshot(craft.write(tmp_path / "m.hsnap", data)) as snap:
        assert snap.version == (1, 7)
        snap.verify()
        assert snap.record().rid == "vector-hybrid"


def test_craft_relocates_data_when_the_header_grows(tmp_path):
    """craft.rebuild relocates the data when a header grows: the result is still a valid file."""
    data = craft.mutate_header(HYBRID, _set("request.extra.pad", "x" * 3000))
    assert craft.split(data).data_offset == 8192
    with Snapshot(craft.write(tmp_path / "big.hsnap", data)) as snap:
        snap.verify()


# ----------------------------------------------------------------------------- snapshot directories


def manifest_bytes(obj) -> bytes:
    body = canonical.dumps(obj) + b"\n"
    return body + b"xxh3-128 " + xxhash.xxh3_128_hexdigest(body).encode() + b"\n"


@pytest.fixture
def setdir(tmp_path):
    d = tmp_path / "set"
    shutil.copytree(VEC / "two-rank", d)
    return d


def _manifest_obj(d: Path) -> dict:
    return canonical.loads((d / "manifest.json").read_bytes().split(b"\n")[0])


def _rewrite_manifest(d: Path, fn) -> None:
    obj = _manifest_obj(d)
    fn(obj)
    (d / "manifest.json").write_bytes(manifest_bytes(obj))


def test_intact_directory_opens(setdir):
    with open_snapshot(setdir) as ss:
        ss.verify()
    _rewrite_manifest(setdir, lambda m: None)  # our manifest encoder is the writer's
    assert (setdir / "manifest.json").read_bytes() == (VEC / "two-rank" / "manifest.json").read_bytes()


def test_missing_rank_file(setdir):
    (setdir / "rank-1.hsnap").unlink()
    with pytest.raises(MalformedManifestError, match="rank-1.hsnap"):
        SnapshotSet(setdir)


def test_rank_file_from_another_snapshot(setdir):
    """A valid rank file whose root digest differs from the manifest's (same length)."""
    data = (setdir / "rank-1.hsnap").read_bytes()
    other = craft.mutate_header(data, _set("identity.device", "cpx"))
    assert len(other) == len(data)
    (setdir / "rank-1.hsnap").write_bytes(other)
    assert open_error(setdir / "rank-1.hsnap") is None
    with pytest.raises(MalformedManifestError) as ei:
        SnapshotSet(setdir)
    assert "root_digest" in ei.value.field


def test_rank_files_swapped(setdir):
    a, b = (setdir / "rank-0.hsnap").read_bytes(), (setdir / "rank-1.hsnap").read_bytes()
    (setdir / "rank-0.hsnap").write_bytes(b)
    (setdir / "rank-1.hsnap").write_bytes(a)
    with pytest.raises(MalformedManifestError):
        SnapshotSet(setdir)


@pytest.mark.parametrize("name", ["../rank-1.hsnap", "/etc/passwd", "ABSOLUTE", "rank-1.hsnap/..", "./rank-1.hsnap",
                                  "rank-01.hsnap", "rank-0.hsnap", "sub/rank-1.hsnap", "rank-1.hsnap\u0000", 1])
def test_manifest_names_a_file_outside(setdir, name):
    if name == "ABSOLUTE":
        name = str((setdir / "rank-1.hsnap").resolve())
    _rewrite_manifest(setdir, lambda m: m["ranks"][1].update(file=name))
    with pytest.raises(MalformedManifestError, match=r"ranks\[1\]\.file"):
        SnapshotSet(setdir)


def test_symlink_inside_directory(setdir, tmp_path):
    (setdir / "notes").symlink_to("/etc/hostname")
    with pytest.raises(MalformedManifestError, match="symbolic link"):
        SnapshotSet(setdir)


def test_rank_file_is_a_symlink(setdir, tmp_path):
    outside = tmp_path / "outside.hsnap"
    shutil.move(setdir / "rank-1.hsnap", outside)
    (setdir / "rank-1.hsnap").symlink_to(outside)
    with pytest.raises(MalformedManifestError, match="symbolic link"):
        SnapshotSet(setdir)


def test_manifest_is_a_symlink_or_missing(setdir, tmp_path):
    shutil.move(setdir / "manifest.json", tmp_path / "m.json")
    with pytest.raises(MalformedManifestError, match="manifest.json"):
        SnapshotSet(setdir)
    (setdir / "manifest.json").symlink_to(tmp_path / "m.json")
    with pytest.raises(MalformedManifestError):
        SnapshotSet(setdir)
    (setdir / "manifest.json").unlink()
    (setdir / "manifest.json").mkdir()
    with pytest.raises(MalformedManifestError):
        SnapshotSet(setdir)


def test_links_given_as_the_path(setdir, tmp_path):
    """A link given as the path is not followed either (spec 7.1 step 1, R-7.1-2):
    open_snapshot refuses it like Snapshot() (O_NOFOLLOW) and like a link inside a
    snapshot directory (above); the caller resolves it."""
    link = tmp_path / "latest"
    link.symlink_to(setdir)
    with pytest.raises(HsnapIOError, match="symbolic link"):
        open_snapshot(link)
    with open_snapshot(os.path.realpath(link)) as ss:
        assert isinstance(ss, SnapshotSet)
        ss.verify()
    flink = tmp_path / "rank.hsnap"
    flink.symlink_to(setdir / "rank-0.hsnap")
    for opener in (Snapshot, open_snapshot):
        with pytest.raises(HsnapIOError):
            opener(flink)


@pytest.mark.parametrize(
    "edit,cls",
    [
        (lambda m: m.update(version=[2, 0]), UnsupportedVersionError),
        (lambda m: m.update(format="hsnap"), MalformedManifestError),
        (lambda m: m.update(version="1.0"), MalformedManifestError),
        (lambda m: m.update(tp_size=3), MalformedManifestError),
        (lambda m: m.update(tp_size=0), MalformedManifestError),
        (lambda m: m.update(state_position=5), MalformedManifestError),
        (lambda m: m.update(snapshot_id="other"), MalformedManifestError),
        (lambda m: m.update(snapshot_id=None), MalformedManifestError),
        (lambda m: m["ranks"][1].update(rank=0), MalformedManifestError),
        (lambda m: m["ranks"][1].update(length=10), MalformedManifestError),
        (lambda m: m["ranks"][1].update(length=-1), MalformedManifestError),
        (lambda m: m["ranks"][1].update(root_digest="00"), MalformedManifestError),
        (lambda m: m["ranks"][1].update(root_digest="0" * 32), MalformedManifestError),
        (lambda m: m["ranks"][1].update(extra=1), MalformedManifestError),
        (lambda m: m.update(ranks={}), MalformedManifestError),
        (lambda m: m["ranks"].__setitem__(1, []), MalformedManifestError),
    ],
)
def test_hostile_manifest(setdir, edit, cls):
    _rewrite_manifest(setdir, edit)
    with pytest.raises(cls):
        SnapshotSet(setdir)


def test_manifest_newer_minor_accepted(setdir):
    _rewrite_manifest(setdir, lambda m: m.update(version=[1, 3]))
    with SnapshotSet(setdir) as ss:
        assert ss.manifest.version == (1, 3)


@pytest.mark.parametrize(
    "data,cls",
    [
        (b"", TruncatedError),
        (b'{"format":"hsnap-manifest"}\n', TruncatedError),
        (b"{}\nxxh3-128 " + b"0" * 32 + b"\n", DigestMismatchError),
        (b"{}\nsha256 " + b"0" * 64 + b"\n", MalformedManifestError),
        (b"{ }\nxxh3-128 " + xxhash.xxh3_128_hexdigest(b"{ }\n").encode() + b"\n", MalformedManifestError),
        (b"[]\nxxh3-128 " + xxhash.xxh3_128_hexdigest(b"[]\n").encode() + b"\n", MalformedManifestError),
        (b"\xff\nxxh3-128 " + xxhash.xxh3_128_hexdigest(b"\xff\n").encode() + b"\n", MalformedManifestError),
        (b"[" * 100000 + b"\nxxh3-128 " + xxhash.xxh3_128_hexdigest(b"[" * 100000 + b"\n").encode() + b"\n", MalformedManifestError),
    ],
)
def test_malformed_manifest_bytes(setdir, data, cls):
    (setdir / "manifest.json").write_bytes(data)
    with pytest.raises(cls):
        SnapshotSet(setdir)


def test_manifest_too_large(setdir):
    (setdir / "manifest.json").write_bytes(b" " * (MAX_MANIFEST_BYTES + 1))
    with pytest.raises(MalformedManifestError, match="length"):
        SnapshotSet(setdir)


@pytest.mark.parametrize("extra", [b"\n", b"\n\n", b"x\n"])
def test_manifest_of_more_than_two_lines_refused(setdir, extra):
    data = (setdir / "manifest.json").read_bytes()
    (setdir / "manifest.json").write_bytes(data + extra)
    with pytest.raises((TruncatedError, MalformedManifestError)):
        SnapshotSet(setdir)
