"""Golden vectors of spec/vectors/ decoded by tests/independent_reader.py.

The reader under test is written from spec/hsnap-v1.md alone; nothing from
hsnap_format/, hsnap_io/ or viewer/ is imported here either.
"""

from __future__ import annotations

import json
import math
import os
import re
import shutil
import struct
import sys
from pathlib import Path

import numpy as np
import pytest
import xxhash

sys.path.insert(0, str(Path(__file__).resolve().parent))
import independent_reader as ir  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent
VECTORS = ROOT / "spec" / "vectors"
SPEC = ROOT / "spec" / "hsnap-v1.md"
SINGLE = ["attention-only", "hybrid", "mla-fp8", "parallel"]  # parallel: format 1.4 (parallel-layers)
NON_HEADER_KEYS = {"description", "file", "expected"}
SECTION_VALUE_KEYS = {"values", "hex"}


def _desc(name: str) -> dict:
    return json.loads((VECTORS / f"{name}.json").read_text(encoding="utf-8"))


def _rank_descs() -> list[dict]:
    return _desc("two-rank")["ranks"]


def _same_number_tree(a, b) -> bool:
    """Equality of JSON trees where 1 == 1.0 (spec 4: int/float not distinguished)
    but booleans are not numbers."""
    if isinstance(a, bool) or isinstance(b, bool):
        return type(a) is type(b) and a == b
    if isinstance(a, (int, float)) and isinstance(b, (int, float)):
        return a == b
    if isinstance(a, dict) and isinstance(b, dict):
        return a.keys() == b.keys() and all(_same_number_tree(a[k], b[k]) for k in a)
    if isinstance(a, list) and isinstance(b, list):
        return len(a) == len(b) and all(_same_number_tree(x, y) for x, y in zip(a, b))
    return type(a) is type(b) and a == b


def _check_against_description(snap: ir.Snapshot, desc: dict, data: bytes) -> None:
    # -- header: "exactly the decoded header, section table included" (spec 12)
    want_header = {k: v for k, v in desc.items() if k not in NON_HEADER_KEYS}
    want_header["sections"] = [
        {k: v for k, v in s.items() if k not in SECTION_VALUE_KEYS} for s in desc["sections"]
    ]
    for key in ("format", "features", "digest", "identity", "geometry", "request"):
        assert _same_number_tree(snap.header[key], want_header[key]), key
    assert _same_number_tree(snap.header, want_header)
    # The description, re-encoded canonically, is byte-identical to the header.
    assert ir.canonical_json(want_header).encode() == snap.header_bytes

    # -- sections, one by one
    assert [s["name"] for s in snap.sections] == [s["name"] for s in desc["sections"]]
    for got, want in zip(snap.sections, desc["sections"]):
        for k in ("name", "kind", "layer", "dtype", "shape", "offset", "length", "digest"):
            assert got[k] == want[k], (want["name"], k)
        assert got["raw"].hex() == want["hex"], want["name"]
        assert data[got["offset"]:got["offset"] + got["length"]].hex() == want["hex"]
        vals = got["values"]
        assert list(vals.shape) == want["shape"]
        flat = vals.reshape(-1).tolist()
        assert len(flat) == len(want["values"]), want["name"]
        for i, (g, w) in enumerate(zip(flat, want["values"])):
            if isinstance(w, float) and math.isnan(w):
                assert math.isnan(g), (want["name"], i)
            else:
                assert float(g) == float(w), (want["name"], i)
        if got["dtype"].startswith(("int", "uint")):
            assert all(isinstance(x, int) for x in flat)

    # -- expected block
    exp = desc["expected"]
    assert [snap.major, snap.minor] == exp["version"]
    assert snap.header_length == exp["header_length"]
    assert snap.data_offset == exp["data_offset"]
    assert snap.file_length == exp["file_length"] == len(data)
    assert snap.payload_bytes == exp["payload_bytes"]
    assert len(snap.sections) == exp["section_count"]
    assert snap.header_digest.hex() == exp["header_digest"]
    assert snap.root_digest.hex() == exp["root_digest"]
    # `expected` gives the checks as the u64 value in hex (not the stored LE bytes)
    assert f"{snap.preamble_check:016x}" == exp["preamble_check"]
    assert f"{snap.trailer_check:016x}" == exp["trailer_check"]
    assert data[:64].hex() == exp["first_64_bytes_hex"]
    assert data[-64:].hex() == exp["last_64_bytes_hex"]
    # stored byte order of the checks: u64 little-endian (spec 1)
    assert data[56:64] == struct.pack("<Q", int(exp["preamble_check"], 16))
    assert data[-8:] == struct.pack("<Q", int(exp["trailer_check"], 16))
    # features listed when used (spec 9)
    req = snap.header["request"]
    opt = set(snap.header["features"]["optional"])
    assert ("sampler-rng-state" in opt) == req.get("has_rng_state", False)
    assert ("top-logprobs" in opt) == (req.get("top_logprobs_k", 0) > 0)


# ---------------------------------------------------------------------------
# Golden vectors decode to their descriptions
# ---------------------------------------------------------------------------


@pytest.mark.parametrize("name", SINGLE)
def test_single_rank_vector(name):
    desc = _desc(name)
    assert desc["file"] == f"{name}.hsnap"
    path = VECTORS / desc["file"]
    snap = ir.read_snapshot(path)
    assert snap.verified
    _check_against_description(snap, desc, path.read_bytes())


def test_two_rank_directory():
    desc = _desc("two-rank")
    d = VECTORS / desc["directory"]
    res = ir.read_directory(d)
    text = (d / "manifest.json").read_bytes()
    assert res.manifest_text == text == desc["manifest_text"].encode("utf-8")
    assert _same_number_tree(res.manifest, desc["manifest"])
    line1 = text.split(b"\n")[0] + b"\n"
    assert res.manifest_digest == xxhash.xxh3_128(line1).hexdigest()
    assert text.endswith(f"xxh3-128 {res.manifest_digest}\n".encode())
    assert len(res.ranks) == desc["manifest"]["tp_size"] == len(desc["ranks"])
    for i, (snap, rdesc, entry) in enumerate(zip(res.ranks, desc["ranks"],
                                                  desc["manifest"]["ranks"])):
        assert rdesc["file"] == entry["file"] == f"rank-{i}.hsnap"
        assert entry["rank"] == i == snap.header["identity"]["tp_rank"]
        assert entry["length"] == snap.file_length
        assert entry["root_digest"] == snap.root_digest.hex()
        _check_against_description(snap, rdesc, (d / rdesc["file"]).read_bytes())
    # the request record is repeated in every rank file (spec 10)
    assert res.ranks[0].header["request"] == res.ranks[1].header["request"]
    for k in ("prompt_ids", "output_ids"):
        a, b = (r.section(f"request.{k}")["values"] for r in res.ranks)
        assert np.array_equal(a, b)


CHAIN_LINKS = ["chain-base", "chain-delta-1", "chain-delta-2"]  # files of chain.json (format 1.2)
CHAIN_SETS = ["chain-tp2-base", "chain-tp2-delta-1", "chain-tp2-delta-2"]  # directories of chain-tp2.json
SHARDED_SETS = ["hybrid-tp2", "mamba2-tp2", "kda-tp2"]  # format 1.1: TP-2 sets with geometry.sharding


def test_every_vector_has_a_description():
    hsnaps = sorted(p.stem for p in VECTORS.glob("*.hsnap"))
    assert hsnaps == sorted(SINGLE + CHAIN_LINKS + ["paged-a", "paged-b"])  # paged-*: pages.json (1.3, tests/test_pagestore.py)
    assert sorted(p.stem for p in VECTORS.glob("*.json")) == sorted(SINGLE + ["two-rank", "chain", "chain-tp2", "pages"] + SHARDED_SETS)
    assert [link.get("file") for link in _desc("chain")["links"]] == [f"{n}.hsnap" for n in CHAIN_LINKS]
    assert [link["directory"] for link in _desc("chain-tp2")["links"]] == CHAIN_SETS
    for d in ["two-rank"] + SHARDED_SETS + CHAIN_SETS:
        assert sorted(p.name for p in (VECTORS / d).iterdir()) == [
            "manifest.json", "rank-0.hsnap", "rank-1.hsnap"]


# ---------------------------------------------------------------------------
# The spec's own worked examples agree with the vectors
# ---------------------------------------------------------------------------


def _spec_text() -> str:
    return SPEC.read_text(encoding="utf-8")


def _xxd_blocks(text: str) -> list[tuple[int, bytes]]:
    out = []
    for m in re.finditer(r"^([0-9a-f]{8}): ((?:[0-9a-f]{4} ?){8})", text, re.M):
        out.append((int(m.group(1), 16), bytes.fromhex(m.group(2).replace(" ", ""))))
    return out


def test_spec_section_11_worked_example():
    text = _spec_text()
    sec11 = text[text.index("## 11. Worked example"):text.index("## 12.")]
    data = (VECTORS / "attention-only.hsnap").read_bytes()
    blocks = _xxd_blocks(sec11)
    assert len(blocks) == 8
    for off, chunk in blocks:
        assert data[off:off + 16] == chunk, hex(off)
    snap = ir.read_snapshot(VECTORS / "attention-only.hsnap")
    assert snap.header_length == 2154 and snap.file_length == 24648
    assert snap.payload_bytes == 320 and len(snap.sections) == 6
    assert snap.header_bytes.startswith(
        b'{"digest":"xxh3-128","features":{"optional":[],"required":[]},"format":"hsnap",'
        b'"geometry":{')
    rows = re.findall(r"^\| `([a-z0-9._]+)` \| (\w+) \| (\w+) \| (\w+) \| \[([0-9, ]+)\] \| "
                      r"(\d+) \| (\d+) \|$", sec11, re.M)
    assert [r[0] for r in rows] == [s["name"] for s in snap.sections]
    for (name, kind, layer, dtype, shape, off, length), s in zip(rows, snap.sections):
        assert (kind, dtype) == (s["kind"], s["dtype"])
        assert (None if layer == "null" else int(layer)) == s["layer"]
        assert [int(x) for x in shape.split(",")] == s["shape"]
        assert (int(off), int(length)) == (s["offset"], s["length"])
    assert f"{snap.preamble_check:#018x}" in sec11
    assert f"{snap.trailer_check:#018x}" in sec11
    assert snap.root_digest.hex() in sec11 and snap.header_digest.hex() in sec11


def test_spec_section_5_4_hybrid_example_order():
    text = _spec_text()
    start = text.index("Example — hybrid")
    block = text[start:text.index("### 5.5")]
    names = re.findall(r"(?:mamba|attn|request)\.[a-z0-9._]+[a-z0-9]", block)
    names = [n for n in names if n != "spec/vectors/hybrid.hsnap"]
    snap = ir.read_snapshot(VECTORS / "hybrid.hsnap")
    assert names == [s["name"] for s in snap.sections]


# ---------------------------------------------------------------------------
# Element decoding and canonical JSON, from the spec's definitions
# ---------------------------------------------------------------------------


def test_fp8_and_bf16_bit_decoding():
    e4 = lambda b: ir.decode_elements("float8_e4m3fn", bytes([b]), [1])[0]  # noqa: E731
    e5 = lambda b: ir.decode_elements("float8_e5m2", bytes([b]), [1])[0]  # noqa: E731
    assert e4(0x7E) == 448.0 and e4(0xFE) == -448.0
    assert math.isnan(e4(0x7F)) and math.isnan(e4(0xFF))
    assert e4(0x78) == 256.0  # exponent all ones is finite in E4M3FN
    assert e4(0x01) == 2.0**-9 and e4(0x08) == 2.0**-6 and e4(0x38) == 1.0
    assert e4(0x80) == 0.0 and math.copysign(1, e4(0x80)) == -1
    assert e5(0x7C) == math.inf and e5(0xFC) == -math.inf and math.isnan(e5(0x7D))
    assert e5(0x7B) == 57344.0 and e5(0x01) == 2.0**-16 and e5(0x3C) == 1.0
    assert math.isnan(ir.decode_elements("float8_e4m3fnuz", b"\x80", [1])[0])
    assert math.isnan(ir.decode_elements("float8_e5m2fnuz", b"\x80", [1])[0])
    bf = ir.decode_elements("bfloat16", bytes.fromhex("803f10c0807f"), [3])
    assert bf.tolist()[:2] == [1.0, -2.25] and bf[2] == np.inf
    assert ir.decode_elements("bool", b"\x00\x01", [2]).tolist() == [False, True]
    with pytest.raises(ir.HsnapSpecError):
        ir.decode_elements("bool", b"\x02", [1])


@pytest.mark.parametrize("value,text", [
    (0.7, "0.7"), (1e-05, "0.00001"), (1e-07, "1e-7"), (1.0, "1"), (1e21, "1e+21"),
    (-0.0, "0"), (1e20, "100000000000000000000"), (1.05, "1.05"), (-1.5e-300, "-1.5e-300"),
])
def test_canonical_numbers(value, text):
    assert ir.es_number(value) == text
    assert ir.parse_canonical_json(text.encode()) == value


@pytest.mark.parametrize("bad", [
    b'{"a":1.0}', b'{"a":1e-05}', b'{"a":-0}', b'{"b":1,"a":2}', b'{"a":1,"a":1}',
    b'{ "a":1}', b'{"a":"\\u00E9"}', b'{"a":"\\/"}', b'{"a":"\\u001F"}', b'{"a":NaN}',
    b'{"a":"\\ud800"}', b'\xef\xbb\xbf{}', b'{}\n',
    b'[' * 17 + b']' * 17,
    b'{"a":' + b"1" * 401 + b"}",
])
def test_non_canonical_json_refused(bad):
    with pytest.raises(ir._JsonRefused):
        ir.parse_canonical_json(bad)


def test_canonical_json_accepts():
    assert ir.parse_canonical_json(b'{"a":"\\u001f\\n\xc3\xa9/\x7f"}') == {"a": "\x1f\né/\x7f"}
    assert ir.parse_canonical_json(b'[' * 16 + b']' * 16) is not None
    big = ir.parse_canonical_json(b"[100000000000000000000]")[0]
    assert isinstance(big, float) and big == 1e20


# ---------------------------------------------------------------------------
# Negative checks
# ---------------------------------------------------------------------------


def _flip(data: bytes, pos: int, bit: int = 0) -> bytes:
    b = bytearray(data)
    b[pos] ^= 1 << bit
    return bytes(b)


@pytest.mark.parametrize("name", SINGLE + ["two-rank/rank-1"])
def test_flipped_bit_in_each_section_is_a_digest_mismatch(name):
    data = (VECTORS / f"{name}.hsnap").read_bytes()
    snap = ir.parse_snapshot(data, name)
    for i, s in enumerate(snap.sections):
        if s["length"] == 0:
            continue
        pos = s["offset"] + (i * 7) % s["length"]
        bad = _flip(data, pos, i % 8)
        # open succeeds (sections are not read at open) ...
        ir.parse_snapshot(bad, name, verify=False)
        # ... verify names the section
        with pytest.raises(ir.HsnapSpecError) as e:
            ir.parse_snapshot(bad, name)
        assert e.value.kind == "DigestMismatchError"
        assert e.value.field == f"sections[{s['name']!r}].digest"


@pytest.mark.parametrize("cut", [0, 3, 7, 8, 40, 63, 64, 2000, 4096, -65, -64, -1])
def test_truncated_file(cut):
    data = (VECTORS / "hybrid.hsnap").read_bytes()
    short = data[:cut] if cut >= 0 else data[:len(data) + cut]
    with pytest.raises(ir.HsnapSpecError) as e:
        ir.parse_snapshot(short, "hybrid.hsnap")
    assert e.value.kind == "TruncatedError"
    assert isinstance(e.value, ValueError)


def test_other_single_bit_flips_fail_at_open():
    data = (VECTORS / "attention-only.hsnap").read_bytes()
    snap = ir.parse_snapshot(data)
    cases = {
        0: ("BadMagicError", "magic"),
        9: ("DigestMismatchError", "preamble.check"),
        60: ("DigestMismatchError", "preamble.check"),
        64 + 100: ("DigestMismatchError", "header_digest"),
        len(data) - 40: ("DigestMismatchError", "trailer.check"),
        len(data) - 2: ("DigestMismatchError", "trailer.check"),
    }
    for pos, (kind, fld) in cases.items():
        with pytest.raises(ir.HsnapSpecError) as e:
            ir.parse_snapshot(_flip(data, pos), "x", verify=False)
        assert (e.value.kind, e.value.field) == (kind, fld), pos
    # padding: after the header, and between two sections
    for pos in (64 + snap.header_length + 5, snap.sections[0]["offset"] + 100):
        bad = _flip(data, pos)
        ir.parse_snapshot(bad, "x", verify=False)
        with pytest.raises(ir.HsnapSpecError) as e:
            ir.parse_snapshot(bad, "x")
        assert (e.value.kind, e.value.field) == ("DigestMismatchError", f"padding at byte {pos}")
    # appended byte
    with pytest.raises(ir.HsnapSpecError) as e:
        ir.parse_snapshot(data + b"\0", "x")
    assert e.value.kind == "MalformedHeaderError"


def _reseal(data: bytes, header_bytes: bytes) -> bytes:
    """Replace the header (it must still fit before data_offset) and recompute
    header digest, preamble check, root digest and trailer check, so that only
    the header's content can be refused."""
    (_m, major, minor, bom, _hl, data_offset, _hd, file_length, _pc) = ir.PREAMBLE.unpack(data[:64])
    assert 64 + len(header_bytes) <= data_offset
    hd = xxhash.xxh3_128(header_bytes).digest()
    pre = ir.PREAMBLE.pack(ir.MAGIC, major, minor, bom, len(header_bytes), data_offset, hd,
                           file_length, 0)[:56]
    pre += struct.pack("<Q", xxhash.xxh3_64(pre).intdigest())
    try:
        table = json.loads(header_bytes)["sections"]
        root = xxhash.xxh3_128(hd + b"".join(bytes.fromhex(s["digest"]) for s in table)).digest()
        count = len(table)
    except Exception:
        root, count = data[-40:-24], struct.unpack("<Q", data[-48:-40])[0]
    tr = ir.TRAILER.pack(b"HSNAPEND", file_length, count, root, bytes(16), 0)[:56]
    tr += struct.pack("<Q", xxhash.xxh3_64(tr).intdigest())
    body = pre + header_bytes + bytes(data_offset - 64 - len(header_bytes))
    return body + data[data_offset:file_length - 64] + tr


def test_resealed_original_is_identical():
    data = (VECTORS / "hybrid.hsnap").read_bytes()
    hl = struct.unpack("<Q", data[16:24])[0]
    assert _reseal(data, data[64:64 + hl]) == data


def _header(name="hybrid"):
    data = (VECTORS / f"{name}.hsnap").read_bytes()
    hl = struct.unpack("<Q", data[16:24])[0]
    return data, json.loads(data[64:64 + hl])


def _enc(h) -> bytes:
    return ir.canonical_json(h).encode()


def _edit(fn, name="hybrid"):
    data, h = _header(name)
    fn(h)
    return _reseal(data, _enc(h))


@pytest.mark.parametrize("label,make,kind", [
    ("whitespace", lambda: _reseal(_header()[0], _enc(_header()[1]).replace(b'{"d', b'{ "d', 1)),
     "MalformedHeaderError"),
    ("float-spelling", lambda: _reseal(_header()[0], _enc(_header()[1]).replace(
        b'"min_p":0.00001', b'"min_p":1e-05')), "MalformedHeaderError"),
    ("key-order", lambda: _reseal(_header()[0], _enc(_header()[1]).replace(
        b'{"digest":"xxh3-128","features"', b'{"features"').replace(
        b'"format":"hsnap"', b'"digest":"xxh3-128","format":"hsnap"')), "MalformedHeaderError"),
    ("unknown-top-key-ok", lambda: _edit(lambda h: h.update(zz_new=1)), None),
    ("unknown-required-feature",
     lambda: _edit(lambda h: h["features"]["required"].append("x-new")), "UnsupportedFeatureError"),
    ("unknown-optional-feature-ok",
     lambda: _edit(lambda h: h["features"]["optional"].append("x-new")), None),
    ("digest-algo", lambda: _edit(lambda h: h.update(digest="sha256")), "UnsupportedFeatureError"),
    ("format", lambda: _edit(lambda h: h.update(format="hsnaq")), "MalformedHeaderError"),
    ("offset", lambda: _edit(lambda h: h["sections"][1].update(offset=8193)),
     "MalformedHeaderError"),
    ("length", lambda: _edit(lambda h: h["sections"][0].update(shape=[6, 4])),
     "MalformedHeaderError"),
    ("extra-entry-key", lambda: _edit(lambda h: h["sections"][0].update(note="x")),
     "MalformedHeaderError"),
    ("plan-state-position", lambda: _edit(lambda h: h["request"].update(state_position=4)),
     "MalformedHeaderError"),
    ("plan-order", lambda: _edit(lambda h: h["geometry"]["mamba"].update(layers=[2, 0])), None),
    ("tp-rank", lambda: _edit(lambda h: h["identity"].update(tp_rank=1)), "MalformedHeaderError"),
    ("remaining-budget", lambda: _edit(lambda h: h["request"].update(remaining_budget=30)),
     "MalformedHeaderError"),
    ("has-rng", lambda: _edit(lambda h: h["request"].update(has_rng_state=False)),
     "MalformedHeaderError"),
    ("layer-two-groups", lambda: _edit(lambda h: h["geometry"]["mamba"].update(layers=[0, 1])),
     "MalformedHeaderError"),
    ("float-int-field", lambda: _edit(lambda h: h["request"].update(prompt_tokens=3.5)),
     "MalformedHeaderError"),
])
def test_resealed_header_edits(label, make, kind):
    data = make()
    if kind is None:
        ir.parse_snapshot(data, label)
    else:
        with pytest.raises(ir.HsnapSpecError) as e:
            ir.parse_snapshot(data, label)
        assert e.value.kind == kind, str(e.value)


@pytest.fixture
def two_rank(tmp_path):
    d = tmp_path / "snap"
    shutil.copytree(VECTORS / "two-rank", d)
    return d


def _dir_error(d) -> ir.HsnapSpecError:
    with pytest.raises(ir.HsnapSpecError) as e:
        ir.read_directory(d)
    return e.value


def test_manifest_negatives(two_rank):
    m = two_rank / "manifest.json"
    good = m.read_bytes()
    ir.read_directory(two_rank)

    m.write_bytes(good.replace(b'"state_position":4', b'"state_position":5'))
    assert _dir_error(two_rank).kind == "DigestMismatchError"

    m.write_bytes(good[:-1])
    assert _dir_error(two_rank).kind == "TruncatedError"

    m.write_bytes(good.replace(b"xxh3-128 ", b"xxh3_128 "))
    assert _dir_error(two_rank).kind == "MalformedManifestError"

    def resign(line1: bytes) -> bytes:
        return line1 + b"\nxxh3-128 " + xxhash.xxh3_128(line1 + b"\n").hexdigest().encode() + b"\n"

    line1 = good.split(b"\n")[0]
    m.write_bytes(resign(line1.replace(b"[1,0]", b"[2,0]")))
    assert _dir_error(two_rank).kind == "UnsupportedVersionError"
    m.write_bytes(resign(line1.replace(b"[1,0]", b"[1,7]")))
    ir.read_directory(two_rank)  # any minor
    m.write_bytes(resign(line1.replace(b'"state_position":4', b'"state_position":3')))
    assert _dir_error(two_rank).kind == "MalformedManifestError"
    m.write_bytes(resign(line1.replace(b'"rank-1.hsnap"', b'"../rank-1.hsnap"')))
    assert _dir_error(two_rank).kind == "MalformedManifestError"
    m.write_bytes(resign(line1.replace(b'"tp_size":2', b'"tp_size": 2')))
    assert _dir_error(two_rank).kind == "MalformedManifestError"

    m.write_bytes(good)
    r1 = two_rank / "rank-1.hsnap"
    data1 = r1.read_bytes()
    r1.write_bytes((VECTORS / "two-rank" / "rank-0.hsnap").read_bytes())
    assert _dir_error(two_rank).kind == "MalformedManifestError"  # root digest / tp_rank
    r1.unlink()
    assert _dir_error(two_rank).kind == "MalformedManifestError"  # missing
    r1.write_bytes(_flip(data1, 20480 + 3))
    err = _dir_error(two_rank)
    assert (err.kind, err.field) == ("DigestMismatchError",
                                     "sections['request.prompt_ids'].digest")
    r1.write_bytes(data1)
    os.symlink(r1, two_rank / "extra-link")
    assert _dir_error(two_rank).kind == "MalformedManifestError"
    (two_rank / "extra-link").unlink()
    m.unlink()
    assert _dir_error(two_rank).kind == "MalformedManifestError"


# ---------------------------------------------------------------------------
# Format 1.1: geometry.sharding (spec 5.7), the hybrid-tp2 vector
# ---------------------------------------------------------------------------


def test_hybrid_tp2_vector_is_1_1_and_reassembles():
    desc = _desc("hybrid-tp2")
    d = VECTORS / desc["directory"]
    res = ir.read_directory(d)
    for snap, rdesc in zip(res.ranks, desc["ranks"]):
        assert (snap.major, snap.minor) == (1, 1)
        assert snap.header["features"]["optional"] == ["tp-sharding"]
        _check_against_description(snap, rdesc, (d / rdesc["file"]).read_bytes())
    # the description alone rebuilds the global tensors (values of the vector's description)
    conv = ir.reassemble_global(res, "mamba.0.conv.0")
    assert conv.tolist() == [[c + j / 2 for j in range(2)] for c in range(6)]
    assert ir.reassemble_global(res, "mamba.0.temporal").reshape(-1).tolist() == [0.25, 1.25]
    k = ir.reassemble_global(res, "attn.1.k")
    assert k.tolist() == [[[10 * t + h + dd / 4 for dd in range(2)] for h in range(2)] for t in range(2)]


@pytest.mark.parametrize("name", ["mamba2-tp2", "kda-tp2"])
def test_other_family_vectors_decode_and_reassemble(name):
    """mamba2-tp2 (B and C of the one group replicated on both ranks) and kda-tp2 (the conv
    slot transposed, sharded along axis 1, beside a replicated MLA latent) decode to their
    descriptions, and their parts alone rebuild the global tensors (replicas agreeing)."""
    desc = _desc(name)
    d = VECTORS / desc["directory"]
    res = ir.read_directory(d)
    assert res.manifest_text == desc["manifest_text"].encode("utf-8")
    for snap, rdesc in zip(res.ranks, desc["ranks"]):
        assert (snap.major, snap.minor) == (1, 1)
        _check_against_description(snap, rdesc, (d / rdesc["file"]).read_bytes())
    conv = ir.reassemble_global(res, "mamba.0.conv.0")
    temporal = ir.reassemble_global(res, "mamba.0.temporal").reshape(-1).tolist()
    if name == "mamba2-tp2":  # x | B | C: 2 + 1 + 1 channels, K-1 = 2 columns
        assert conv.tolist() == [[c + j / 2 for j in range(2)] for c in range(4)]
        assert temporal == [0.25, 1.25]
        assert ir.reassemble_global(res, "attn.1.k").tolist() == [[[10 * t + dd / 4 for dd in range(2)]] for t in range(2)]
    else:  # (K-1, q | k | v): 2 rows of 12 channels
        assert conv.tolist() == [[c + j / 2 for c in range(12)] for j in range(2)]
        assert temporal == [4 * h + 2 * a + b + 0.5 for h in range(2) for a in range(2) for b in range(2)]
        assert ir.reassemble_global(res, "mla.1.kv").tolist() == [[[10 * t + dd / 4 for dd in range(3)]] for t in range(2)]


def _rank1(edit) -> bytes:
    data = (VECTORS / "hybrid-tp2" / "rank-1.hsnap").read_bytes()
    hl = struct.unpack("<Q", data[16:24])[0]
    h = json.loads(data[64:64 + hl])
    edit(h["geometry"]["sharding"])
    return _reseal(data, _enc(h))


@pytest.mark.parametrize("label,edit,field", [
    ("parts overlap", lambda sh: sh["conv"][0].update(parts=[[1, 1, 1], [1, 1, 1], [5, 1, 1]]), "geometry.sharding.conv[0].parts[1][0]"),
    ("parts beyond global", lambda sh: sh["temporal"].update(parts=[[2, 1, 1]]), "geometry.sharding.temporal.parts[0]"),
    ("lengths != heads", lambda sh: sh["attention"].update(parts=[[0, 2, 1]]), "geometry.sharding.attention.parts"),
    ("attention axis 0", lambda sh: sh["attention"].update(axis=0), "geometry.sharding.attention.axis"),
    ("conv axis != conv_slice_axis", lambda sh: sh["conv"][0].update(axis=1), "geometry.sharding.conv[0].axis"),
    ("replicas 0", lambda sh: sh["temporal"].update(parts=[[1, 1, 0]]), "geometry.sharding.temporal.parts[0][2]"),
    ("conv entries != conv_shapes", lambda sh: sh.update(conv=[]), "geometry.sharding.conv"),
])
def test_sharding_description_refused(label, edit, field):
    with pytest.raises(ir.HsnapSpecError) as e:
        ir.parse_snapshot(_rank1(edit), label)
    assert (e.value.kind, e.value.field) == ("MalformedHeaderError", field)


def test_undescribed_kinds_are_allowed():
    """Spec 5.7: a null kind is "not described", not an error; an absent one is (5.6, R-5.6-4:
    the three keys are required)."""
    ir.parse_snapshot(_rank1(lambda sh: sh.update(conv=None, temporal=None)), "x")
    with pytest.raises(ir.HsnapSpecError) as e:
        ir.parse_snapshot(_rank1(lambda sh: sh.clear()), "x")
    assert (e.value.kind, e.value.field) == (ir.MALFORMED_HEADER, "geometry.sharding.attention")
