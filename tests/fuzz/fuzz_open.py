#!/usr/bin/env python3
"""Coverage-guided fuzzing (atheris / libFuzzer) of everything that reads untrusted
bytes: ``Snapshot`` open + ``verify`` + ``record`` + section views + the CLI
summary, the manifest decoder ``decode_manifest`` and ``SnapshotSet`` over a
fuzzed manifest, and ``canonical.loads``. The only acceptable failure is an
:class:`HsnapError` (``CanonicalError`` from ``canonical.loads`` itself); anything
else — another exception, a hang (``-timeout``), a memory blow-up
(``-rss_limit_mb``) — is a bug, and libFuzzer saves the input as ``crash-*``.

The first byte of an input picks a mode, the rest is its payload:

  0  raw rank file                     -> open, verify, record, views, summary
  1  "repacked" rank file: payload = u32 header length | header JSON | body; the
     harness encodes the header canonically (when it parses as JSON) and rebuilds
     preamble, trailer, root digest and checks, so mutations reach the structural
     checks behind the integrity layer; bit 0x80 of the mode byte also recomputes
     every section digest from the body, so they reach verify() and record()
  2  raw manifest bytes                -> decode_manifest
  3  manifest body (JSON) + a correct digest line -> decode_manifest, then
     SnapshotSet over a directory with the two-rank vector's rank files
  4  raw bytes                         -> canonical.loads
  5  structure-aware header mutation: the payload drives 1-4 operations (replace
     with a value of any JSON type / boundary integer / known name, delete,
     insert, duplicate) at chosen paths of a seed's header object, then repacked
     as in mode 1 — type confusion and boundary values arrive in a few runs
  6  the same on the two-rank manifest object -> decode_manifest + SnapshotSet

Seeds: the golden vectors in spec/vectors/ (each in every mode that fits) plus a
few files written by hsnap_format.write_snapshot.

Run (CI runs 60 s through tests/fuzz/test_fuzz.py)::

    mkdir -p /tmp/hsnap-corpus
    .venv/bin/python tests/fuzz/fuzz_open.py /tmp/hsnap-corpus -max_total_time=3600 \\
        -timeout=10 -rss_limit_mb=2048 -artifact_prefix=/tmp/hsnap-crash- -print_final_stats=1
    # several workers: add -jobs=4 -workers=4; replay one input: pass the file instead of the directory

An empty corpus directory given on the command line is seeded first. A crash
found: copy it to tests/fuzz/regressions/ (test_fuzz.py replays every file there).
"""

from __future__ import annotations

import atexit
import json
import os
import shutil
import struct
import sys
import tempfile

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(os.path.dirname(HERE))
if ROOT not in sys.path:
    sys.path.insert(0, ROOT)
VECTORS = os.path.join(ROOT, "spec", "vectors")

try:
    import atheris
except ImportError:  # replaying regressions needs no atheris
    atheris = None

if atheris is not None and __name__ == "__main__":
    with atheris.instrument_imports(include=["hsnap_format"]):
        import hsnap_format  # noqa: F401
        from hsnap_format import canonical, manifest, reader
        from hsnap_format.tools import viewmodel
else:
    import hsnap_format  # noqa: F401
    from hsnap_format import canonical, manifest, reader
    from hsnap_format.tools import viewmodel

import xxhash  # noqa: E402

from hsnap_format.errors import HsnapError  # noqa: E402
from hsnap_format.spec import HEADER_OFFSET, MANIFEST_NAME, PREAMBLE, TRAILER, align_up  # noqa: E402

RAW, REPACK, MANIFEST_RAW, MANIFEST_BODY, CANONICAL, HEADER_OPS, MANIFEST_OPS = range(7)
MODES = 7
FIX_DIGESTS = 0x80

# Scratch files (one input file, a two-rank directory, written seeds). libFuzzer ends the
# process with exit(), skipping atexit: a caller that wants no residue passes HSNAP_FUZZ_WORK.
if os.environ.get("HSNAP_FUZZ_WORK"):
    _WORK = os.environ["HSNAP_FUZZ_WORK"]
    os.makedirs(_WORK, exist_ok=True)
else:
    _WORK = tempfile.mkdtemp(prefix="hsnap-fuzz-", dir="/dev/shm" if os.path.isdir("/dev/shm") else None)
    atexit.register(shutil.rmtree, _WORK, True)
_FILE = os.path.join(_WORK, "input.hsnap")
_SET = os.path.join(_WORK, "set")


def _setup_set_dir() -> None:
    os.makedirs(_SET, exist_ok=True)
    for r in (0, 1):
        src = os.path.join(VECTORS, "two-rank", f"rank-{r}.hsnap")
        if os.path.exists(src):
            shutil.copyfile(src, os.path.join(_SET, f"rank-{r}.hsnap"))


_setup_set_dir()


# ------------------------------------------------------------------ building inputs


def repack(header: bytes, body: bytes, fix_digests: bool = False) -> bytes:
    """A file with this header and body and every integrity field honest."""
    obj = None
    try:
        obj = json.loads(header)
        header = canonical.dumps(obj)  # mutations reach the checks behind "not canonical"
    except Exception:  # noqa: BLE001 - the harness's own parsing, not the code under test
        obj = None
    data_offset = align_up(HEADER_OFFSET + len(header))
    digests = []
    if isinstance(obj, dict) and isinstance(obj.get("sections"), list):
        changed = False
        for e in obj["sections"]:
            if not isinstance(e, dict):
                continue
            off, ln = e.get("offset"), e.get("length")
            if fix_digests and type(off) is int and type(ln) is int and data_offset <= off and off + ln <= data_offset + len(body) and ln < 1 << 26:
                d = xxhash.xxh3_128_hexdigest(body[off - data_offset : off - data_offset + ln])
                changed |= e.get("digest") != d
                e["digest"] = d
            dg = e.get("digest")
            if isinstance(dg, str) and len(dg) == 32:
                try:
                    digests.append(bytes.fromhex(dg))
                except ValueError:
                    pass
        if changed:
            try:
                header = canonical.dumps(obj)
            except Exception:  # noqa: BLE001
                pass
            if align_up(HEADER_OFFSET + len(header)) != data_offset:
                return b""
    hdig = xxhash.xxh3_128_digest(header)
    flen = data_offset + len(body) + TRAILER.size
    pre = PREAMBLE.pack(b"\x89HSN\r\n\x1a\n", 1, 0, 0x0A0B0C0D, len(header), data_offset, hdig, flen, 0)
    pre = pre[:56] + xxhash.xxh3_64_digest(pre[:56])[::-1]
    root = xxhash.xxh3_128()
    root.update(hdig)
    for d in digests:
        root.update(d)
    count = len(obj["sections"]) if isinstance(obj, dict) and isinstance(obj.get("sections"), list) else 0
    tra = TRAILER.pack(b"HSNAPEND", flen, count, root.digest(), bytes(16), 0)
    tra = tra[:56] + xxhash.xxh3_64_digest(tra[:56])[::-1]
    return pre + header + bytes(data_offset - HEADER_OFFSET - len(header)) + body + tra


def split_file(data: bytes) -> tuple[bytes, bytes]:
    """(header, body) of a well-formed file."""
    hlen, doff = PREAMBLE.unpack(data[:64])[4:6]
    return data[HEADER_OFFSET : HEADER_OFFSET + hlen], data[doff : len(data) - TRAILER.size]


def encode(mode: int, payload: bytes) -> bytes:
    return bytes([mode]) + payload


def repack_payload(header: bytes, body: bytes) -> bytes:
    return struct.pack("<I", len(header)) + header + body


def seeds() -> list[bytes]:
    out = []
    files = []
    for name in sorted(os.listdir(VECTORS)) if os.path.isdir(VECTORS) else []:
        if name.endswith(".hsnap"):
            files.append(os.path.join(VECTORS, name))
    two = os.path.join(VECTORS, "two-rank")
    if os.path.isdir(two):
        files += [os.path.join(two, n) for n in sorted(os.listdir(two)) if n.endswith(".hsnap")]
        with open(os.path.join(two, MANIFEST_NAME), "rb") as f:
            m = f.read()
        out += [encode(MANIFEST_RAW, m), encode(MANIFEST_BODY, m.split(b"\n")[0] + b"\n")]
    files += _written_seeds()
    for i in range(8):  # structure-aware modes: a few starting byte strings
        out += [encode(HEADER_OPS, bytes([i]) + bytes(range(i, i + 40))), encode(MANIFEST_OPS, bytes(range(i * 7, i * 7 + 24)))]
    for p in files:
        with open(p, "rb") as f:
            data = f.read()
        header, body = split_file(data)
        out += [encode(RAW, data), encode(REPACK, repack_payload(header, body)),
                encode(REPACK | FIX_DIGESTS, repack_payload(header, body)), encode(CANONICAL, header)]
    return out


def _written_seeds() -> list[str]:
    """Files from write_snapshot with a tiny geometry: MHA+mamba with rng/top-k, MLA, SWA."""
    import numpy as np

    import hsnap_format as hf
    from hsnap_format.layout import state_sections
    from hsnap_format.spec import DTYPES

    def _state(geom, pos, swa_start):
        rng = np.random.default_rng(0)
        return {s.name: rng.standard_normal(s.shape, dtype=np.float32).astype(DTYPES[s.dtype]) for s in state_sections(geom, pos, swa_start)}

    d = os.path.join(_WORK, "seeds")
    os.makedirs(d, exist_ok=True)
    geoms = {
        "hybrid": hf.Geometry(hf.AttentionGeometry("mha", (1,), 1, 4, 4, "bfloat16", "bfloat16"),
                              hf.MambaGeometry((0,), ((3, 2),), "bfloat16", (1, 2, 2), "float32"), num_layers=2),
        "mla": hf.Geometry(hf.AttentionGeometry("mla", (0,), 1, 6, 0, "float8_e4m3fn", "uint8", kv_lora_rank=4, qk_rope_head_dim=2), num_layers=1),
        "swa": hf.Geometry(hf.AttentionGeometry("swa", (0,), 1, 4, 4, "float16", "float16", swa_layers=(1,), swa_window=2), num_layers=2),
    }
    paths = []
    for i, (name, geom) in enumerate(geoms.items()):
        rec = hf.RequestRecord(rid=name, prompt_ids=np.arange(3, dtype=np.int32), output_ids=np.arange(2, dtype=np.int32),
                               state_position=4, output_logprobs=np.zeros(2, np.float32),
                               top_logprob_ids=np.zeros((2, 2), np.int32) if i == 0 else None,
                               top_logprob_values=np.zeros((2, 2), np.float32) if i == 0 else None,
                               rng_state=b"\x01\x02" if i == 0 else None, max_new_tokens=8, stop_strings=("é", "\n"))
        ident = hf.Identity(model_id="fuzz", weights_version="w", created_at="2026-01-01T00:00:00Z", snapshot_id=name)
        p = os.path.join(d, f"{name}.hsnap")
        if os.path.exists(p):
            os.unlink(p)
        hf.write_snapshot(p, identity=ident, geometry=geom, record=rec, state=_state(geom, 4, 1 if name == "swa" else 0),
                          swa_start=1 if name == "swa" else 0)
        paths.append(p)
    return paths


# ------------------------------------------------------------------ structure-aware mutation (modes 5, 6)


class Bytes:
    """A deterministic reader of the fuzzer's bytes (atheris.FuzzedDataProvider without atheris,
    so that saved inputs replay anywhere). Past the end it yields zeros."""

    def __init__(self, data: bytes) -> None:
        self.data, self.i = data, 0

    def u8(self) -> int:
        self.i += 1
        return self.data[self.i - 1] if self.i <= len(self.data) else 0

    def u32(self) -> int:
        return int.from_bytes(bytes(self.u8() for _ in range(4)), "little")

    def pick(self, seq):
        return seq[self.u8() % len(seq)]


_INTS = [0, 1, -1, 2, 3, 7, 8, 255, 4096, 65535, 65536, 2**31 - 1, 2**31, 2**32, 2**40 - 1, 2**40, 2**53 - 1, -(2**53 - 1)]
_FLOATS = [0.5, -0.0, 1e308, 5e-324, 1.0, -1.5]
_STRS = ["", "a", "attn_k", "conv", "temporal", "rng_state", "bfloat16", "uint8", "float8_e4m3fn", "mla", "swa", "mha",
         "xxh3-128", "sampler-rng-state", "top-logprobs", "hsnap", "hsnap-manifest", "rank-0.hsnap", "../rank-0.hsnap",
         "0" * 32, "f" * 32, "\u2028\u202e", "x" * 300]
_KEYS = ["name", "kind", "layer", "dtype", "shape", "offset", "length", "digest", "required", "optional", "layers", "heads",
         "k_head_dim", "v_head_dim", "swa_layers", "conv_shapes", "temporal_shape", "state_position", "prompt_tokens",
         "output_tokens", "top_logprobs_k", "has_rng_state", "has_logprobs", "swa_start", "tp_size", "tp_rank", "rank",
         "file", "ranks", "version", "format", "extra"]


def _value(b: Bytes, depth: int = 0):
    t = b.u8() % 9
    if t == 0:
        return None
    if t == 1:
        return bool(b.u8() & 1)
    if t == 2:
        return b.pick(_INTS)
    if t == 3:
        return b.u32() - (1 << 31)
    if t == 4:
        return b.pick(_FLOATS)
    if t == 5:
        return b.pick(_STRS)
    if t == 6 and depth < 4:
        return [_value(b, depth + 1) for _ in range(b.u8() % 4)]
    if t == 7 and depth < 4:
        return {b.pick(_KEYS): _value(b, depth + 1) for _ in range(b.u8() % 4)}
    return bytes(b.u8() % 95 + 32 for _ in range(b.u8() % 12)).decode()


def mutate(obj, b: Bytes):
    """Apply 1-4 operations (replace / delete / insert / duplicate) at fuzzer-chosen paths."""
    for _ in range(1 + b.u8() % 4):
        parent, key, node = None, None, obj
        for _depth in range(8):
            kids = sorted(node) if isinstance(node, dict) else list(range(len(node))) if isinstance(node, list) else []
            if not kids or b.u8() % 4 == 0:
                break
            parent, key = node, b.pick(kids)
            node = node[key]
        op = b.u8() % 5
        if parent is None:
            if isinstance(obj, dict) and op == 4:
                obj[b.pick(_KEYS)] = _value(b)
            continue
        if op <= 1:
            parent[key] = _value(b)
        elif op == 2:
            del parent[key]
        elif op == 3 and isinstance(node, list):
            node.append(_value(b) if b.u8() & 1 or not node else node[-1])
        elif op == 3 and isinstance(node, dict):
            node[b.pick(_KEYS)] = _value(b)
        else:
            parent[key] = type(node)(node) if isinstance(node, (list, dict)) else _value(b)
    return obj


_BASES: list[tuple[dict, bytes]] = []
_MANIFESTS: list[dict] = []


def _bases():
    if not _BASES:
        for s in seeds():
            if s[0] == RAW:
                header, body = split_file(s[1:])
                _BASES.append((json.loads(header), body))
            elif s[0] == MANIFEST_BODY:
                _MANIFESTS.append(json.loads(s[1:]))
    return _BASES, _MANIFESTS


def _header_ops(payload: bytes) -> bytes:
    import copy

    bases, _ = _bases()
    b = Bytes(payload)
    header, body = bases[b.u8() % len(bases)]
    obj = mutate(copy.deepcopy(header), b)
    try:
        hb = canonical.dumps(obj)
    except canonical.CanonicalError:
        return b""
    return repack(hb, body, fix_digests=bool(b.u8() & 1))


def _manifest_ops(payload: bytes) -> bytes:
    import copy

    _, manifests = _bases()
    if not manifests:
        return b""
    b = Bytes(payload)
    obj = mutate(copy.deepcopy(manifests[0]), b)
    try:
        return canonical.dumps(obj) + b"\n"
    except canonical.CanonicalError:
        return b""


# ------------------------------------------------------------------ the target


def _exercise(snap) -> None:
    viewmodel.snapshot_summary(snap)
    ranks = list(snap.ranks.values()) if isinstance(snap, manifest.SnapshotSet) else [snap]
    for s in ranks:
        for sec in s.sections:
            s.array(sec)
            sec.axes, sec.is_state  # noqa: B018
        s.padding_ranges()
        s.request  # noqa: B018
        s.verify()
        s.record(verify=False)


def _open_file(data: bytes) -> None:
    if not data:
        return
    with open(_FILE, "wb") as f:
        f.write(data)
    try:
        with reader.Snapshot(_FILE) as snap:
            _exercise(snap)
    except HsnapError:
        pass


def _open_manifest(body: bytes) -> None:
    """A manifest with this body and an honest digest line: decode, then open the set."""
    data = body + b"xxh3-128 " + xxhash.xxh3_128_hexdigest(body).encode() + b"\n"
    try:
        manifest.decode_manifest(data, "fuzz/manifest.json")
    except HsnapError:
        return
    with open(os.path.join(_SET, MANIFEST_NAME), "wb") as f:
        f.write(data)
    try:
        with manifest.SnapshotSet(_SET) as s:
            _exercise(s)
    except HsnapError:
        pass


def TestOneInput(data: bytes) -> None:  # noqa: N802 - atheris' name
    if not data:
        return
    mode, payload = data[0], data[1:]
    kind = mode & 0x7F
    if kind % MODES == RAW:
        _open_file(payload)
    elif kind % MODES == REPACK:
        if len(payload) < 4:
            return
        (hlen,) = struct.unpack("<I", payload[:4])
        hlen = min(hlen, len(payload) - 4)
        _open_file(repack(payload[4 : 4 + hlen], payload[4 + hlen :], bool(mode & FIX_DIGESTS)))
    elif kind % MODES == MANIFEST_RAW:
        try:
            manifest.decode_manifest(payload, "fuzz/manifest.json")
        except HsnapError:
            pass
    elif kind % MODES == MANIFEST_BODY:
        _open_manifest(payload if payload.endswith(b"\n") else payload + b"\n")
    elif kind % MODES == HEADER_OPS:
        _open_file(_header_ops(payload))
    elif kind % MODES == MANIFEST_OPS:
        body = _manifest_ops(payload)
        if body:
            _open_manifest(body)
    else:
        try:
            canonical.loads(payload)
        except (HsnapError, canonical.CanonicalError):
            pass


def _seed_corpora(args: list[str]) -> None:
    for a in args:
        if not a.startswith("-") and os.path.isdir(a) and not os.listdir(a):
            for i, s in enumerate(seeds()):
                with open(os.path.join(a, f"seed-{i:03d}"), "wb") as f:
                    f.write(s)


def main() -> None:
    if atheris is None:
        raise SystemExit("atheris is not installed (pip install atheris)")
    _seed_corpora(sys.argv[1:])
    atheris.Setup(sys.argv, TestOneInput)
    atheris.Fuzz()


if __name__ == "__main__":
    main()
