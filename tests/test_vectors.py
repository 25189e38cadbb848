"""The golden vectors of spec/vectors: they regenerate byte for byte from their JSON
descriptions, decode to exactly what the JSON says, and decode the same way with a
from-scratch reader written only from spec/hsnap-v1.md (struct + json + xxhash)."""

from __future__ import annotations

import importlib.util
import json
import math
import re
import struct
import subprocess
import sys
from pathlib import Path

import ml_dtypes
import numpy as np
import pytest
import xxhash

from hsnap_format.manifest import SnapshotSet
from hsnap_format.reader import Snapshot
from hsnap_format.spec import DTYPES

ROOT = Path(__file__).resolve().parents[1]
VEC = ROOT / "spec" / "vectors"
SINGLE = ("attention-only", "hybrid", "mla-fp8")
HEADER_KEYS = ("format", "features", "digest", "identity", "geometry", "request", "sections")
TABLE_KEYS = ("name", "kind", "layer", "dtype", "shape", "offset", "length", "digest")


def _generator():
    spec = importlib.util.spec_from_file_location("hsnap_vectors_generate", VEC / "generate.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def load(name: str) -> dict:
    return json.loads((VEC / f"{name}.json").read_text(encoding="utf-8"))


def rank_vectors():
    """(id, path, description) for every rank file among the vectors."""
    out = [(n, VEC / load(n)["file"], load(n)) for n in SINGLE]
    two = load("two-rank")
    out += [(f"two-rank/{r['file']}", VEC / two["directory"] / r["file"], r) for r in two["ranks"]]
    return out


RANKS = rank_vectors()


# ----------------------------------------------------------------------------- regeneration


def test_every_vector_regenerates_byte_for_byte():
    assert _generator().check() == []


def test_generate_check_command():
    r = subprocess.run([sys.executable, str(VEC / "generate.py"), "--check"], capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    assert r.stdout.startswith("OK 4 vectors")


def test_vectors_are_tiny():
    payload = sum(d["expected"]["payload_bytes"] for _, _, d in RANKS)
    assert payload < 8192
    assert all(p.stat().st_size < 64 * 1024 for _, p, _ in RANKS)


# ----------------------------------------------------------------------------- decoding with hsnap_format


def _numbers(arr: np.ndarray) -> list:
    flat = np.asarray(arr).reshape(-1)
    return [int(x) for x in flat] if flat.dtype.kind in "iub" else [float(x) for x in flat.astype(np.float64)]


@pytest.mark.parametrize("label,path,desc", RANKS, ids=[r[0] for r in RANKS])
def test_decodes_to_its_description(label, path, desc):
    with Snapshot(path) as snap:
        header = {k: desc[k] for k in HEADER_KEYS if k != "sections"}
        header["sections"] = [{k: s[k] for k in TABLE_KEYS} for s in desc["sections"]]
        assert snap.header == header
        exp = desc["expected"]
        assert list(snap.version) == exp["version"]
        assert snap.preamble.header_length == exp["header_length"]
        assert snap.preamble.data_offset == exp["data_offset"]
        assert snap.file_length == exp["file_length"] == path.stat().st_size
        assert snap.payload_bytes == exp["payload_bytes"]
        assert len(snap.sections) == exp["section_count"]
        assert snap.preamble.header_digest.hex() == exp["header_digest"]
        assert snap.root_digest == exp["root_digest"]
        data = path.read_bytes()
        assert data[:64].hex() == exp["first_64_bytes_hex"]
        assert data[-64:].hex() == exp["last_64_bytes_hex"]
        for s in desc["sections"]:
            arr = snap[s["name"]]
            assert arr.dtype == DTYPES[s["dtype"]]
            assert list(arr.shape) == s["shape"]
            assert _numbers(arr) == s["values"], s["name"]
            assert bytes(snap.raw(s["name"])).hex() == s["hex"]
            assert xxhash.xxh3_128_hexdigest(bytes.fromhex(s["hex"])) == s["digest"]
        snap.verify()
        assert snap.identity.to_header() == desc["identity"]
        assert snap.geometry.to_header() == desc["geometry"]
        rec = snap.record()
        req = dict(rec.to_header(), swa_start=snap.swa_start)
        assert req == desc["request"]
        values = {s["name"]: s["values"] for s in desc["sections"]}
        assert rec.prompt_ids.tolist() == values["request.prompt_ids"]
        assert rec.output_ids.tolist() == values["request.output_ids"]
        if rec.rng_state is not None:
            assert list(rec.rng_state) == values["request.rng_state"]


def test_hybrid_vector_covers_what_the_issue_asks():
    d = load("hybrid")
    g, r = d["geometry"], d["request"]
    assert len(g["attention"]["layers"]) == 2 and len(g["mamba"]["layers"]) == 2
    assert g["mamba"]["temporal_dtype"] == "float32" and g["mamba"]["conv_dtype"] == "bfloat16"
    assert r["has_logprobs"] and r["top_logprobs_k"] == 2 and r["has_rng_state"]
    assert any(not s.isascii() for s in r["stop"]["stop_strings"])
    assert r["sampling"]["temperature"] == 0.7 and r["sampling"]["min_p"] == 1e-05
    header = (VEC / d["file"]).read_bytes()[64 : 64 + d["expected"]["header_length"]]
    assert b'"min_p":0.00001' in header and b'"temperature":0.7' in header  # ECMAScript forms
    assert "\u505c\u6b62".encode() in header  # non-ASCII stays raw UTF-8
    assert b'\\"stop\\"\\n' in header  # only '"', '\\' and controls are escaped
    m = load("mla-fp8")["geometry"]["attention"]
    assert (m["kind"], m["dtype"], m["storage_dtype"]) == ("mla", "float8_e4m3fn", "uint8")
    a = load("attention-only")["geometry"]["attention"]
    assert (a["kind"], a["dtype"], a["page_size"]) == ("mha", "bfloat16", 1)


def test_two_rank_directory():
    d = load("two-rank")
    path = VEC / d["directory"]
    text = (path / "manifest.json").read_bytes()
    assert text.decode() == d["manifest_text"]
    first, digest_line, rest = text.split(b"\n", 2)
    assert rest == b""
    assert digest_line == b"xxh3-128 " + xxhash.xxh3_128_hexdigest(first + b"\n").encode()
    assert json.loads(first) == d["manifest"]
    with SnapshotSet(path) as ss:
        m = ss.manifest
        assert (m.snapshot_id, m.state_position, m.tp_size, list(m.version)) == (
            d["manifest"]["snapshot_id"], d["manifest"]["state_position"], d["manifest"]["tp_size"], d["manifest"]["version"])
        for r, entry in enumerate(d["manifest"]["ranks"]):
            assert ss.rank(r).root_digest == entry["root_digest"] == d["ranks"][r]["expected"]["root_digest"]
            assert ss.rank(r).file_length == entry["length"]
        ss.verify()


# ----------------------------------------------------------------------------- an independent reader


ITEMSIZE = {  # spec: Element types
    "float64": 8, "float32": 4, "float16": 2, "bfloat16": 2, "float8_e4m3fn": 1, "float8_e5m2": 1,
    "float8_e4m3fnuz": 1, "float8_e5m2fnuz": 1, "int64": 8, "int32": 4, "int16": 2, "int8": 1,
    "uint64": 8, "uint32": 4, "uint16": 2, "uint8": 1, "bool": 1,
}
NUMPY = {"bfloat16": ml_dtypes.bfloat16, "float8_e4m3fn": ml_dtypes.float8_e4m3fn, "float32": "<f4", "int32": "<i4", "uint8": "u1"}


def independent_decode(data: bytes) -> dict:
    """Decode a rank file following spec/hsnap-v1.md alone."""
    magic, major, minor, bom, hlen, doff, hdig, flen, check = struct.unpack_from("<8sHHIQQ16sQQ", data, 0)
    assert magic == b"\x89HSN\r\n\x1a\n" and bom == 0x0A0B0C0D and (major, minor) == (1, 0)
    assert check == int.from_bytes(xxhash.xxh3_64_digest(data[:56]), "big")
    assert data[56:64] == xxhash.xxh3_64_digest(data[:56])[::-1]  # the u64, little-endian
    assert flen == len(data) and doff % 4096 == 0 and doff >= 64 + hlen
    header = data[64 : 64 + hlen]
    assert xxhash.xxh3_128_digest(header) == hdig
    assert not any(data[64 + hlen : doff])
    obj = json.loads(header)
    assert isinstance(obj, dict) and list(obj) == sorted(obj)
    t_magic, t_flen, count, root, reserved, t_check = struct.unpack_from("<8sQQ16s16sQ", data, flen - 64)
    assert t_magic == b"HSNAPEND" and t_flen == flen and reserved == bytes(16)
    assert t_check == xxhash.xxh3_64_intdigest(data[flen - 64 : flen - 8])
    assert count == len(obj["sections"])
    cursor, arrays, h = doff, {}, xxhash.xxh3_128(hdig)
    for i, s in enumerate(obj["sections"]):
        assert s["offset"] == cursor
        assert s["length"] == math.prod(s["shape"]) * ITEMSIZE[s["dtype"]]
        raw = data[s["offset"] : s["offset"] + s["length"]]
        assert xxhash.xxh3_128_hexdigest(raw) == s["digest"]
        h.update(bytes.fromhex(s["digest"]))
        arrays[s["name"]] = np.frombuffer(raw, dtype=NUMPY[s["dtype"]]).reshape(s["shape"])
        end = s["offset"] + s["length"]
        cursor = (end + 4095) // 4096 * 4096 if i < len(obj["sections"]) - 1 else end
        assert not any(data[end:cursor])
    assert cursor == flen - 64
    assert h.digest() == root
    return {"header": obj, "arrays": arrays, "root": root.hex()}


@pytest.mark.parametrize("label,path,desc", RANKS, ids=[r[0] for r in RANKS])
def test_independent_reader_agrees(label, path, desc):
    out = independent_decode(path.read_bytes())
    assert out["root"] == desc["expected"]["root_digest"]
    for s in desc["sections"]:
        assert _numbers(out["arrays"][s["name"]]) == s["values"]
    assert out["header"]["request"] == desc["request"]


def test_spec_worked_example_matches_the_vector():
    """The hex dump in spec/hsnap-v1.md is attention-only.hsnap's first 64 bytes."""
    text = (ROOT / "spec" / "hsnap-v1.md").read_text(encoding="utf-8")
    lines = re.findall(r"^000000([0-3])0: ((?:[0-9a-f]{4} ){7}[0-9a-f]{4})", text, re.M)
    assert [n for n, _ in lines] == ["0", "1", "2", "3"]
    dumped = bytes.fromhex("".join(h.replace(" ", "") for _, h in lines))
    assert dumped == (VEC / "attention-only.hsnap").read_bytes()[:64]
