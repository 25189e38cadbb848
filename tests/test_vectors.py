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
SINGLE = ("attention-only", "hybrid", "mla-fp8", "parallel")  # parallel: format 1.4 (feature parallel-layers)
SETS = ("two-rank", "hybrid-tp2", "mamba2-tp2", "kda-tp2")  # directories; all but two-rank are format-1.1 vectors
SHARDED = SETS[1:]
CHAINS = ("chain", "chain-tp2")  # format 1.2: a plain snapshot and two deltas (files; TP-2 sets)
HEADER_KEYS = ("format", "features", "digest", "identity", "geometry", "request", "base", "sections")  # base: a delta's
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
    for name in SETS:
        d = load(name)
        out += [(f"{name}/{r['file']}", VEC / d["directory"] / r["file"], r) for r in d["ranks"]]
    for name in CHAINS:
        for link in load(name)["links"]:
            if "file" in link:
                out.append((link["file"], VEC / link["file"], link))
            else:
                out += [(f"{link['directory']}/{r['file']}", VEC / link["directory"] / r["file"], r) for r in link["ranks"]]
    return out


RANKS = rank_vectors()


# ----------------------------------------------------------------------------- regeneration


def test_every_vector_regenerates_byte_for_byte():
    assert _generator().check() == []


def test_generate_check_command():
    r = subprocess.run([sys.executable, str(VEC / "generate.py"), "--check"], capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    assert r.stdout.startswith("OK 11 vectors")


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
        header = {k: desc[k] for k in HEADER_KEYS if k != "sections" and k in desc}
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


def test_vectors_cover_the_hybrid_mla_fp8_and_mha_cases():
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
    assert magic == b"\x89HSN\r\n\x1a\n" and bom == 0x0A0B0C0D and major == 1  # any minor (spec 9)
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


# ----------------------------------------------------------------------------- format 1.1 compatibility


def test_one_zero_vectors_are_one_zero_files_read_by_the_one_one_reader():
    """Spec 9: a 1.1 reader reads every 1.0 file; the 1.0 vectors stay minor 0, undescribed."""
    from hsnap_format.spec import MINOR

    assert MINOR == 4  # 1.2: snapshot chains (5.9); 1.3: pages stored once (5.10); 1.4: parallel layers (5.2)
    for label, path, desc in RANKS:
        if label.startswith(tuple(f"{n}/" for n in SHARDED) + ("chain-", "parallel")):  # 1.1, 1.2, 1.4 content (tests/test_chain_format.py, tests/test_parallel_layers.py)
            continue
        with Snapshot(path) as snap:
            assert snap.version == (1, 0) and desc["expected"]["version"] == [1, 0]
            assert snap.geometry.sharding is None
            assert "sharding" not in snap.header["geometry"]
            snap.verify()


def _one_zero_rules(data: bytes) -> dict:
    """A reader that knows only the 1.0 rules (spec 1.0, section 9): any minor, features
    {sampler-rng-state, top-logprobs}, unknown keys ignored, the 1.0 section plan."""
    out = independent_decode(data)
    h = out["header"]
    known = {"sampler-rng-state", "top-logprobs"}
    assert all(f in known for f in h["features"]["required"]), "1.0 refuses unknown required features"
    g = h["geometry"]
    plan = []  # spec 1.0 5.4, state sections only
    att, mam = g.get("attention"), g.get("mamba")
    owner = {L: "attn" for L in (att or {}).get("layers", [])} | {L: "mamba" for L in (mam or {}).get("layers", [])}
    pos = h["request"]["state_position"]
    for L in sorted(owner):
        if owner[L] == "attn":
            plan += [(f"attn.{L}.k", [pos, att["heads"], att["k_head_dim"]]), (f"attn.{L}.v", [pos, att["heads"], att["v_head_dim"]])]
        else:
            plan += [(f"mamba.{L}.conv.{i}", c) for i, c in enumerate(mam["conv_shapes"])] + [(f"mamba.{L}.temporal", mam["temporal_shape"])]
    got = [(s["name"], s["shape"]) for s in h["sections"] if s["layer"] is not None]
    assert got == plan
    return out


@pytest.mark.parametrize("name", ["hybrid-tp2", "mamba2-tp2"])  # this 1.0 plan knows mha attention only
def test_one_one_vector_through_one_zero_rules(name):
    """Spec 9: the 1.1 vectors use no new required feature, so a 1.0 reader reads them fully."""
    d = load(name)
    for r in d["ranks"]:
        data = (VEC / d["directory"] / r["file"]).read_bytes()
        assert struct.unpack_from("<HH", data, 8) == (1, 1)  # minor 1 in the preamble
        out = _one_zero_rules(data)
        assert out["header"]["features"] == {"optional": ["tp-sharding"], "required": []}
        for s in r["sections"]:
            assert _numbers(out["arrays"][s["name"]]) == s["values"]


def _reassembled(name: str) -> dict[str, np.ndarray]:
    """Every state section of a 1.1 set as its global tensor, rebuilt from the descriptions
    alone: each rank's parts written at their global offsets along their axis; a replicated
    element must be the same on every rank that holds it."""
    path = VEC / load(name)["directory"]
    glob: dict[str, np.ndarray] = {}
    with SnapshotSet(path) as ss:
        for r in range(ss.manifest.tp_size):
            snap = ss.rank(r)
            sh = snap.geometry.sharding
            for s in snap.sections:
                if not s.is_state:
                    continue
                ax = sh.attention if s.kind.startswith(("attn", "mla")) else sh.conv[0] if s.kind == "conv" else sh.temporal
                arr = snap.read(s)
                shape = list(arr.shape)
                shape[ax.axis] = ax.global_size
                g = glob.setdefault(s.name, np.full(shape, np.nan, dtype=np.float64))
                local = 0
                for off, n, _ in ax.parts:
                    idx = [slice(None)] * arr.ndim
                    src = list(idx)
                    idx[ax.axis], src[ax.axis] = slice(off, off + n), slice(local, local + n)
                    piece = arr[tuple(src)].astype(np.float64)
                    have = g[tuple(idx)]
                    assert np.all(np.isnan(have)) or np.array_equal(have, piece), (name, s.name, r, "replicas differ")
                    g[tuple(idx)] = piece
                    local += n
    assert not any(np.isnan(g).any() for g in glob.values()), "every global element held by some rank"
    return glob


def test_one_one_vector_reassembles_without_the_model():
    """The 1.1 description alone rebuilds the global tensors of the hybrid-tp2 vector."""
    glob = _reassembled("hybrid-tp2")
    # the vector's global state (see its description): conv channel c column j = c + j/2,
    # temporal head h = 0.25 + h, K token t head h dim d = 10t + h + d/4, V its negation
    assert glob["mamba.0.conv.0"].tolist() == [[c + j / 2 for j in range(2)] for c in range(6)]
    assert glob["mamba.0.temporal"].reshape(-1).tolist() == [0.25, 1.25]
    k = [[[10 * t + h + dd / 4 for dd in range(2)] for h in range(2)] for t in range(2)]
    assert glob["attn.1.k"].tolist() == k
    assert glob["attn.1.v"].tolist() == (-np.array(k)).tolist()


def test_mamba2_vector_replicates_the_one_group():
    """mamba2-tp2: n_groups 1 < tp, so B (channel 2) and C (channel 3) are on both ranks
    (replicas 2), x split; the one KV head replicated; the globals as its description says."""
    d = load("mamba2-tp2")
    convs = [r["geometry"]["sharding"]["conv"][0] for r in d["ranks"]]
    assert [c["parts"] for c in convs] == [[[0, 1, 1], [2, 1, 2], [3, 1, 2]], [[1, 1, 1], [2, 1, 2], [3, 1, 2]]]
    assert all(r["geometry"]["sharding"]["attention"]["parts"] == [[0, 1, 2]] for r in d["ranks"])
    glob = _reassembled("mamba2-tp2")
    assert glob["mamba.0.conv.0"].tolist() == [[c + j / 2 for j in range(2)] for c in range(4)]
    assert glob["mamba.0.temporal"].reshape(-1).tolist() == [0.25, 1.25]
    k = [[[10 * t + dd / 4 for dd in range(2)]] for t in range(2)]
    assert glob["attn.1.k"].tolist() == k and glob["attn.1.v"].tolist() == (-np.array(k)).tolist()


def test_kda_vector_shards_its_transposed_conv_along_axis_one():
    """kda-tp2: the conv slot is (K-1, channels); conv_slice_axis 1 and every conv AXIS on
    axis 1, in three parts (q, k, v halves); reassembled along axis 1 it is the global conv."""
    d = load("kda-tp2")
    for r in d["ranks"]:
        assert r["geometry"]["mamba"]["conv_slice_axis"] == 1 and r["geometry"]["mamba"]["conv_shapes"] == [[2, 6]]
        assert r["geometry"]["sharding"]["conv"][0]["axis"] == 1 and len(r["geometry"]["sharding"]["conv"][0]["parts"]) == 3
    glob = _reassembled("kda-tp2")
    assert glob["mamba.0.conv.0"].tolist() == [[c + j / 2 for c in range(12)] for j in range(2)]
    assert glob["mamba.0.temporal"].reshape(-1).tolist() == [4 * h + 2 * a + b + 0.5 for h in range(2) for a in range(2) for b in range(2)]
    assert glob["mla.1.kv"].tolist() == [[[10 * t + dd / 4 for dd in range(3)]] for t in range(2)]


# ----------------------------------------------------------------------------- 1.1: where readers could differ


def _ir():
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    import independent_reader

    return independent_reader


def _reseal(data: bytes, header: bytes) -> bytes:
    """``data`` with another header (fitting before data_offset), every digest and check
    recomputed: only the header's content can be refused."""
    _m, major, minor, bom, _hl, doff, _hd, flen, _pc = struct.unpack_from("<8sHHIQQ16sQQ", data)
    assert 64 + len(header) <= doff
    hd = xxhash.xxh3_128_digest(header)
    pre = struct.pack("<8sHHIQQ16sQ", data[:8], major, minor, bom, len(header), doff, hd, flen)
    pre += struct.pack("<Q", xxhash.xxh3_64_intdigest(pre))
    try:
        table = json.loads(header)["sections"]
        root = xxhash.xxh3_128_digest(hd + b"".join(bytes.fromhex(s["digest"]) for s in table))
        count = len(table)
    except Exception:
        root, count = data[-40:-24], struct.unpack("<Q", data[-48:-40])[0]
    tr = struct.pack("<8sQQ16s16s", b"HSNAPEND", flen, count, root, bytes(16))
    tr += struct.pack("<Q", xxhash.xxh3_64_intdigest(tr))
    return pre + header + bytes(doff - 64 - len(header)) + data[doff : flen - 64] + tr


def _edited(name: str, fn) -> bytes:
    from hsnap_format import canonical

    data = (VEC / f"{name}.hsnap").read_bytes()
    hl = struct.unpack_from("<Q", data, 16)[0]
    h = json.loads(data[64 : 64 + hl])
    out = fn(h)
    return _reseal(data, out if isinstance(out, bytes) else canonical.dumps(h))


def _raw_header(name: str, edit) -> bytes:
    data = (VEC / f"{name}.hsnap").read_bytes()
    hl = struct.unpack_from("<Q", data, 16)[0]
    return _reseal(data, edit(data[64 : 64 + hl]))


def _flip_at(name: str, *positions) -> bytes:
    data = bytearray((VEC / f"{name}.hsnap").read_bytes())
    for p in positions:
        data[p] ^= 0x5A
    return bytes(data)


def _flip_tail(data: bytes, back: int) -> bytes:
    """Flip a byte ``back`` bytes before the end (inside the trailer's check)."""
    b = bytearray(data)
    b[-back] ^= 0x5A
    return bytes(b)


def _both(data: bytes, tmp_path) -> tuple[str | None, str | None, tuple]:
    """(reference class, independent class, (reference field, independent field))."""
    from hsnap_format.errors import HsnapError

    p = tmp_path / "x.hsnap"
    p.write_bytes(data)
    ref = ind = rf = jf = None
    try:
        with Snapshot(p) as s:
            s.verify()
    except HsnapError as e:
        ref, rf = type(e).__name__, e.field
    try:
        _ir().read_snapshot(p)
    except _ir().HsnapSpecError as e:
        ind, jf = e.kind, e.field
    return ref, ind, (rf, jf)


POINTS = [
    # (spec 1.1 section 14 point, label, file bytes, expected class or None for "reads")
    (2, "order: trailer check and a table offset both bad -> step 15 first",
     lambda: _flip_tail(_edited("attention-only", lambda h: h["sections"][1].update(offset=8193)), 10),
     "MalformedHeaderError"),
    (3, "features: another key ignored", lambda: _edited("hybrid", lambda h: h["features"].update(x=[1])), None),
    (3, "features: duplicates allowed", lambda: _edited("hybrid", lambda h: h["features"]["optional"].append("top-logprobs")), None),
    (3, "features: non-string entry", lambda: _edited("hybrid", lambda h: h["features"]["optional"].append(1)), "MalformedHeaderError"),
    (3, "features: optional missing", lambda: _edited("hybrid", lambda h: h["features"].pop("optional")), "MalformedHeaderError"),
    (4, "digest: a number", lambda: _edited("hybrid", lambda h: h.update(digest=5)), "UnsupportedFeatureError"),
    (4, "digest: null", lambda: _edited("hybrid", lambda h: h.update(digest=None)), "UnsupportedFeatureError"),
    (5, "string length in code points: 1,500 x U+505C (4,500 bytes) is too long? no: fits 4,096",
     lambda: _edited("attention-only", lambda h: h["identity"].update(engine={"name": "\u505c" * 500, "version": "", "commit": ""})), None),
    (6, "null inside a flat-object array", lambda: _edited("hybrid", lambda h: h["request"]["sampling"].update(x=[1, None])), "MalformedHeaderError"),
    (6, "null as a flat-object value", lambda: _edited("hybrid", lambda h: h["request"]["sampling"].update(x=None)), None),
    (7, "conv_shapes dim 2^40", lambda: _edited("hybrid", lambda h: h["geometry"]["mamba"].update(conv_shapes=[[2**40, 3]])), "MalformedHeaderError"),
    (8, "conv_slice_axis beyond the conv rank (no sharding)", lambda: _edited("hybrid", lambda h: h["geometry"]["mamba"].update(conv_slice_axis=5)), None),
    (8, "layer ids outside start_layer/num_layers", lambda: _edited("hybrid", lambda h: h["geometry"].update(start_layer=7, num_layers=1)), None),
    (8, "mamba temporal_dtype missing", lambda: _edited("hybrid", lambda h: h["geometry"]["mamba"].pop("temporal_dtype")), "MalformedHeaderError"),
    (9, "mha with kv_lora_rank set", lambda: _edited("attention-only", lambda h: h["geometry"]["attention"].update(kv_lora_rank=4)), "MalformedHeaderError"),
    (9, "mha with swa_window set", lambda: _edited("attention-only", lambda h: h["geometry"]["attention"].update(swa_window=4)), "MalformedHeaderError"),
    (9, "mla with a null kv_lora_rank counting as 0", lambda: _edited("mla-fp8", lambda h: h["geometry"]["attention"].update(kv_lora_rank=None, qk_rope_head_dim=6)), None),
    (10, "top_logprobs_k > 0 without the top-logprobs name", lambda: _edited("hybrid", lambda h: h["features"].update(optional=["sampler-rng-state"])), None),
    (10, "tp-sharding named without a description", lambda: _edited("hybrid", lambda h: h["features"]["optional"].append("tp-sharding")), None),
    (11, "bool for an int", lambda: _edited("hybrid", lambda h: h["request"].update(top_logprobs_k=True)), "MalformedHeaderError"),
    (11, "integer literal of 401 digits", lambda: _raw_header("attention-only", lambda b: b.replace(b'"temperature":0', b'"temperature":' + b"1" * 401)), "MalformedHeaderError"),
    (12, "padding: two bad bytes -> the first; before a bad section", lambda: _flip_at("attention-only", 64 + 2154 + 7, 64 + 2154 + 9, 4096 + 3), "DigestMismatchError"),
    (14, "1e-6 written 1e-6 is not canonical", lambda: _raw_header("hybrid", lambda b: b.replace(b'"min_p":0.00001', b'"min_p":1e-5')), "MalformedHeaderError"),
]


@pytest.mark.parametrize("point,label,make,kind", POINTS, ids=[f"{p[0]}-{p[1][:40]}" for p in POINTS])
def test_both_readers_agree_on_the_points_of_spec_14(point, label, make, kind, tmp_path):
    ref, ind, fields = _both(make(), tmp_path)
    assert ref == ind == kind, (label, ref, ind, fields)
    if point == 12:
        assert fields == ("padding at byte 2225", "padding at byte 2225")


def test_digest_mismatch_message_is_stored_then_computed(tmp_path):
    """Spec 7.3 (point 13): expected = the stored digest, found = the computed one."""
    d = load("attention-only")
    stored = d["sections"][0]["digest"]
    p = tmp_path / "x.hsnap"
    p.write_bytes(_flip_at("attention-only", 4096))
    with Snapshot(p) as s, pytest.raises(Exception) as e:
        s.verify()
    assert f"expected {stored}" in str(e.value)
    with pytest.raises(_ir().HsnapSpecError) as e2:
        _ir().read_snapshot(p)
    assert f"expected {stored}" in str(e2.value)


def test_open_failures_step_1(tmp_path):
    """Spec 7.1 step 1 (point 1): no such file -> HsnapIOError; a directory -> MalformedHeaderError."""
    from hsnap_format.errors import HsnapIOError, MalformedHeaderError

    with pytest.raises(HsnapIOError):
        Snapshot(tmp_path / "missing.hsnap")
    with pytest.raises(MalformedHeaderError, match="path"):
        Snapshot(tmp_path)
    for target, kind in ((tmp_path / "missing.hsnap", "HsnapIOError"), (tmp_path, "MalformedHeaderError")):
        with pytest.raises(_ir().HsnapSpecError) as e:
            _ir().read_snapshot(target)
        assert e.value.kind == kind


@pytest.mark.parametrize("label,edit,kind", [
    ("unknown top-level key", lambda l1: l1.replace(b'{"format"', b'{"aaa":1,"format"'), None),
    ("tp_size over 65536", lambda l1: l1.replace(b'"tp_size":2', b'"tp_size":70000'), "MalformedManifestError"),
])
def test_manifest_points(label, edit, kind, tmp_path):
    """Spec 10.1/10.2 (point 15) with both readers."""
    import shutil

    from hsnap_format.errors import HsnapError

    d = tmp_path / "s"
    shutil.copytree(VEC / "two-rank", d)
    line1 = (d / "manifest.json").read_bytes().split(b"\n")[0]
    new = edit(line1)
    (d / "manifest.json").write_bytes(new + b"\nxxh3-128 " + xxhash.xxh3_128_hexdigest(new + b"\n").encode() + b"\n")
    ref = ind = None
    try:
        SnapshotSet(d).close()
    except HsnapError as e:
        ref = type(e).__name__
    try:
        _ir().read_directory(d)
    except _ir().HsnapSpecError as e:
        ind = e.kind
    assert ref == ind == kind


@pytest.mark.parametrize("text,kind", [
    (b"a\nb\nc", "TruncatedError"),  # no final newline, whatever the line count
    (b"a\nb\nc\n", "MalformedManifestError"),
])
def test_manifest_line_rules(text, kind, tmp_path):
    from hsnap_format.errors import HsnapError

    d = tmp_path / "s"
    import shutil

    shutil.copytree(VEC / "two-rank", d)
    (d / "manifest.json").write_bytes(text)
    with pytest.raises(HsnapError) as e:
        SnapshotSet(d)
    with pytest.raises(_ir().HsnapSpecError) as e2:
        _ir().read_directory(d)
    assert type(e.value).__name__ == e2.value.kind == kind


@pytest.mark.parametrize("label,edit,kind", [
    ("parts overlap", lambda sh: sh["conv"][0].update(parts=[[1, 1, 1], [1, 1, 1], [5, 1, 1]]), "MalformedHeaderError"),
    ("parts beyond global", lambda sh: sh["temporal"].update(parts=[[2, 1, 1]]), "MalformedHeaderError"),
    ("lengths != heads", lambda sh: sh["attention"].update(parts=[[0, 2, 1]]), "MalformedHeaderError"),
    ("conv axis != conv_slice_axis", lambda sh: sh["conv"][0].update(axis=1), "MalformedHeaderError"),
    ("replicas 0", lambda sh: sh["temporal"].update(parts=[[1, 1, 0]]), "MalformedHeaderError"),
    ("a bool as an offset", lambda sh: sh["temporal"].update(parts=[[True, 1, 1]]), "MalformedHeaderError"),
    ("undescribed conv", lambda sh: sh.update(conv=None), None),
])
def test_both_readers_agree_on_sharding(label, edit, kind, tmp_path):
    """Spec 5.7 with both readers, on rank 1 of the 1.1 vector."""
    from hsnap_format import canonical

    data = (VEC / "hybrid-tp2" / "rank-1.hsnap").read_bytes()
    hl = struct.unpack_from("<Q", data, 16)[0]
    h = json.loads(data[64 : 64 + hl])
    edit(h["geometry"]["sharding"])
    ref, ind, fields = _both(_reseal(data, canonical.dumps(h)), tmp_path)
    assert ref == ind == kind, (label, fields)
