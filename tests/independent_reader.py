"""An independent hsnap v1 reader (format 1.1), written from ``spec/hsnap-v1.md`` alone.

It deliberately imports nothing from this repository (no ``hsnap_format``,
``hsnap_io``, ``viewer``) and no ``ml_dtypes``: it exists to show that the
specification by itself is enough to write a conforming reader.  Dependencies:
the Python standard library, numpy and xxhash.

Entry points:

* ``read_snapshot(path)`` / ``parse_snapshot(data, name)``: open checks of
  spec 7.1 (steps 2-20 in the spec's order), then, unless ``verify=False``,
  the verify pass of 7.2 (padding zero, every section digest), then decode
  every section into a numpy array of its logical numbers.
* ``read_directory(path)``: a multi-rank snapshot directory (spec 10.2).
* ``decode_elements(dtype, raw, shape)``: section 6 element decoding, with
  bfloat16 and the four fp8 formats decoded from their bit patterns.
* ``canonical_json(value)`` / ``parse_canonical_json(data)``: section 4.

Every violation raises ``HsnapSpecError`` (a plain ``ValueError``) whose
``kind`` is the spec's error class name (``"DigestMismatchError"``,
``"TruncatedError"``, ...) and whose message is one line,
``file: field: expected X, found Y`` (spec 7.3).

Where the 1.0 text left a choice open, the comment ``SPEC GAP`` marked the
choice made; 1.1 closed them (spec section 14), and each such place now cites
the section that decides it (``spec 1.1 <section>``). Format 1.1 adds the
optional feature ``tp-sharding`` (``geometry.sharding``, spec 5.7), validated
here, and ``reassemble_global`` rebuilds a global tensor from a directory's
rank files with it. Format 1.2 adds chains (``read_chain``, spec 5.9, 7.5); 1.3 pages
stored once: ``pages`` validated at open (5.10), page objects read by ``read_page``
(5.11), and ``read_chain`` resolves each link's page references (7.6) and assembles the
rows of its pages into the head's sections.
"""

from __future__ import annotations

import json
import math
import os
import re
import stat
import struct
from dataclasses import dataclass, field
from decimal import Decimal
from typing import Any

import numpy as np
import xxhash

# ---------------------------------------------------------------------------
# Errors (spec 7.3)
# ---------------------------------------------------------------------------


class HsnapSpecError(ValueError):
    """Any violation of the spec.  ``kind`` names the spec's error class."""

    def __init__(self, kind: str, file: str, fld: str, expected: Any, found: Any):
        self.kind = kind
        self.file = file
        self.field = fld
        msg = f"{file}: {fld}: expected {expected}, found {found}"
        super().__init__(f"[{kind}] " + msg.replace("\n", "\\n"))


TRUNCATED = "TruncatedError"
BAD_MAGIC = "BadMagicError"
UNSUPPORTED_VERSION = "UnsupportedVersionError"
UNSUPPORTED_FEATURE = "UnsupportedFeatureError"
MALFORMED_HEADER = "MalformedHeaderError"
MALFORMED_MANIFEST = "MalformedManifestError"
DIGEST_MISMATCH = "DigestMismatchError"
IO_ERROR = "HsnapIOError"

# ---------------------------------------------------------------------------
# Constants (spec 1, 3, 5, 6, 9, 10)
# ---------------------------------------------------------------------------

MAGIC = b"\x89HSN\r\n\x1a\n"
TRAILER_MAGIC = b"HSNAPEND"
MAJOR = 1
BYTE_ORDER_MARK = 0x0A0B0C0D
PREAMBLE = struct.Struct("<8sHHIQQ16sQQ")
TRAILER = struct.Struct("<8sQQ16s16sQ")
assert PREAMBLE.size == 64 and TRAILER.size == 64
ALIGNMENT = 4096
MAX_HEADER = 1024 * 1024  # spec 3.1 / 7.1 step 8: 1 MiB
MAX_SECTIONS = 65536
MAX_RNG = 1024 * 1024
MAX_MANIFEST = 1024 * 1024
MAX_DEPTH = 16
MAX_SAFE_INT = 2**53 - 1
MAX_INT_DIGITS = 400
MAX_STR = 4096
MAX_STOP_STRINGS = 1024  # spec 5.3 (R-5-1): count and length of request.stop.stop_strings
MAX_STOP_STRING = 4096
MAX_STOP_TOKEN_IDS = 65536

KNOWN_FEATURES = {"sampler-rng-state", "top-logprobs", "tp-sharding", "delta", "pages", "parallel-layers"}  # spec 9 (delta: 1.2, pages: 1.3, parallel-layers: 1.4, required)
PAGE_TOP_KEYS = {"format", "features", "digest", "namespace", "page", "sections"}  # spec 5.11
PAGE_FEATURES: set[str] = set()  # spec 5.11: the required features a page object may list (1.3: none)
NAMESPACE_KEYS = {"attention", "engine", "model_id", "page_size", "sharding", "tp_rank", "tp_size", "weights_hash", "weights_version"}
NAMESPACE_ATTENTION_KEYS = {"dtype", "heads", "k_head_dim", "kind", "kv_lora_rank", "layers", "qk_rope_head_dim", "storage_dtype", "v_head_dim"}
HEX64_RE = re.compile(r"[0-9a-f]{64}")
PAGE_ERROR = "PageError"
PAGED_KINDS = ("attn_k", "attn_v", "mla_kv")  # spec 5.10: only these rows are paged
MAX_CHAIN_DEPTH = 1024  # spec 5.9: base.depth 1..1024
KNOWN_DIGESTS = {"xxh3-128"}
SECTION_KEYS = {"name", "kind", "layer", "dtype", "shape", "offset", "length", "digest"}
TOP_KEYS = {"format", "features", "digest", "identity", "geometry", "request", "sections"}
KINDS = {
    "attn_k", "attn_v", "mla_kv", "swa_k", "swa_v", "conv", "temporal",
    "prompt_ids", "output_ids", "output_logprobs", "top_logprob_ids",
    "top_logprob_values", "rng_state",
}
SECTION_NAME_RE = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,127}")
HEX32_RE = re.compile(r"[0-9a-f]{32}")

# dtype name -> itemsize (spec 6)
ITEMSIZE = {
    "float64": 8, "float32": 4, "float16": 2, "bfloat16": 2,
    "float8_e4m3fn": 1, "float8_e5m2": 1, "float8_e4m3fnuz": 1, "float8_e5m2fnuz": 1,
    "int64": 8, "int32": 4, "int16": 2, "int8": 1,
    "uint64": 8, "uint32": 4, "uint16": 2, "uint8": 1,
    "bool": 1,
}


def align(n: int) -> int:
    return (n + ALIGNMENT - 1) // ALIGNMENT * ALIGNMENT


def digest128(data: bytes) -> bytes:
    """XXH3-128, seed 0, canonical (big-endian) 16 bytes (spec 1)."""
    return xxhash.xxh3_128(data).digest()


def check64(block: bytes) -> int:
    """XXH3-64 of bytes 0..55 of a 64-byte block, as an integer (spec 1)."""
    return xxhash.xxh3_64(block[:56]).intdigest()


# ---------------------------------------------------------------------------
# Element decoding (spec 6)
# ---------------------------------------------------------------------------


def _fp8_table(exp_bits: int, man_bits: int, bias: int, style: str) -> np.ndarray:
    """float64 value of every byte 0..255 of a 1-sign-bit fp8 format.

    style "ieee": all-ones exponent is inf (mantissa 0) or NaN (E5M2).
    style "fn":   no infinities; only S.1111.111 is NaN (OCP E4M3).
    style "fnuz": no infinities, no -0; 0x80 is the only NaN (AMD).
    """
    out = np.empty(256, dtype=np.float64)
    emax = (1 << exp_bits) - 1
    mmax = (1 << man_bits) - 1
    for b in range(256):
        s = -1.0 if b & 0x80 else 1.0
        e = (b >> man_bits) & emax
        m = b & mmax
        if style == "fnuz" and b == 0x80:
            out[b] = math.nan
            continue
        if style == "ieee" and e == emax:
            out[b] = s * math.inf if m == 0 else math.nan
            continue
        if style == "fn" and e == emax and m == mmax:
            out[b] = math.nan
            continue
        if e == 0:
            v = (m / (1 << man_bits)) * 2.0 ** (1 - bias)
        else:
            v = (1 + m / (1 << man_bits)) * 2.0 ** (e - bias)
        out[b] = s * v
    return out


# spec 1.1 6: the fnuz formats have exponent biases 8 (E4M3) and 16 (E5M2), no -0,
# NaN 0x80 only.  No golden vector uses float8_e5m2 or the fnuz types.
_FP8 = {
    "float8_e4m3fn": _fp8_table(4, 3, 7, "fn"),
    "float8_e5m2": _fp8_table(5, 2, 15, "ieee"),
    "float8_e4m3fnuz": _fp8_table(4, 3, 8, "fnuz"),
    "float8_e5m2fnuz": _fp8_table(5, 2, 16, "fnuz"),
}

_NUMPY_LE = {
    "float64": "<f8", "float32": "<f4", "float16": "<f2",
    "int64": "<i8", "int32": "<i4", "int16": "<i2", "int8": "i1",
    "uint64": "<u8", "uint32": "<u4", "uint16": "<u2", "uint8": "u1",
}


def decode_elements(dtype: str, raw: bytes, shape: list[int], *, file: str = "?",
                    name: str = "?") -> np.ndarray:
    """Section bytes -> array of logical numbers, C order, given shape."""
    count = math.prod(shape)
    if len(raw) != count * ITEMSIZE[dtype]:
        raise HsnapSpecError(MALFORMED_HEADER, file, f"sections[{name!r}].length",
                             count * ITEMSIZE[dtype], len(raw))
    if dtype in _NUMPY_LE:
        arr = np.frombuffer(raw, dtype=_NUMPY_LE[dtype]).copy()
    elif dtype == "bfloat16":
        bits = np.frombuffer(raw, dtype="<u2").astype(np.uint32) << np.uint32(16)
        arr = bits.astype("<u4").view("<f4").copy()
    elif dtype in _FP8:
        arr = _FP8[dtype][np.frombuffer(raw, dtype="u1")]
    elif dtype == "bool":
        b = np.frombuffer(raw, dtype="u1")
        # SPEC GAP: section 6 defines only 0x00/0x01; what a reader does with
        # other byte values is not said.  Refused here.
        if b.size and int(b.max()) > 1:
            raise HsnapSpecError(MALFORMED_HEADER, file, f"sections[{name!r}] bool byte",
                                 "0x00 or 0x01", hex(int(b.max())))
        arr = b.astype(bool)
    else:  # pragma: no cover - dtype names are validated earlier
        raise HsnapSpecError(MALFORMED_HEADER, file, "dtype", "a name of section 6", dtype)
    return arr.reshape(shape)


# ---------------------------------------------------------------------------
# Canonical JSON (spec 4)
# ---------------------------------------------------------------------------


class _JsonRefused(Exception):
    pass


def es_number(x: float) -> str:
    """ECMAScript Number::toString for a finite double (RFC 8785 3.2.2.3)."""
    if not math.isfinite(x):
        raise _JsonRefused(f"non-finite number {x!r}")
    if x == 0:
        return "0"
    sign = "-" if x < 0 else ""
    tup = Decimal(repr(abs(x))).as_tuple()  # repr: shortest round-trip digits
    digits = "".join(map(str, tup.digits)).lstrip("0")
    exp = tup.exponent
    while digits.endswith("0"):
        digits = digits[:-1]
        exp += 1
    k = len(digits)
    n = exp + k  # value = 0.digits * 10^n
    if k <= n <= 21:
        body = digits + "0" * (n - k)
    elif 0 < n <= 21:
        body = digits[:n] + "." + digits[n:]
    elif -6 < n <= 0:
        body = "0." + "0" * (-n) + digits
    else:
        e = n - 1
        es = ("+" if e >= 0 else "-") + str(abs(e))
        body = digits[0] + ("." + digits[1:] if k > 1 else "") + "e" + es
    return sign + body


_SHORT_ESC = {'"': '\\"', "\\": "\\\\", "\b": "\\b", "\t": "\\t", "\n": "\\n",
              "\f": "\\f", "\r": "\\r"}


def _es_string(s: str) -> str:
    out = ['"']
    for ch in s:
        c = ord(ch)
        if 0xD800 <= c <= 0xDFFF:
            raise _JsonRefused("lone surrogate in string")
        if ch in _SHORT_ESC:
            out.append(_SHORT_ESC[ch])
        elif c < 0x20:
            out.append(f"\\u{c:04x}")
        else:
            out.append(ch)
    out.append('"')
    return "".join(out)


def canonical_json(value: Any) -> str:
    """The canonical text of a decoded value (spec 4)."""
    if value is None:
        return "null"
    if value is True:
        return "true"
    if value is False:
        return "false"
    if isinstance(value, int):
        if abs(value) > MAX_SAFE_INT:
            return es_number(float(value))
        return str(value)
    if isinstance(value, float):
        return es_number(value)
    if isinstance(value, str):
        return _es_string(value)
    if isinstance(value, list):
        return "[" + ",".join(canonical_json(v) for v in value) + "]"
    if isinstance(value, dict):
        for k in value:
            if not k.isascii():
                raise _JsonRefused(f"non-ASCII key {k!r}")
        items = sorted(value.items())
        return "{" + ",".join(_es_string(k) + ":" + canonical_json(v) for k, v in items) + "}"
    raise _JsonRefused(f"not a JSON value: {type(value).__name__}")


def _json_depth(text: bytes) -> int:
    """Maximum nesting of arrays/objects, skipping string contents."""
    depth = best = 0
    in_str = esc = False
    for b in text:
        if in_str:
            if esc:
                esc = False
            elif b == 0x5C:
                esc = True
            elif b == 0x22:
                in_str = False
        elif b == 0x22:
            in_str = True
        elif b in (0x5B, 0x7B):
            depth += 1
            best = max(best, depth)
        elif b in (0x5D, 0x7D):
            depth -= 1
    return best


def _parse_int(lit: str):
    if len(lit.lstrip("-")) > MAX_INT_DIGITS:
        raise _JsonRefused("integer literal over 400 digits")
    v = int(lit)
    if abs(v) > MAX_SAFE_INT:
        f = float(lit)  # read as the IEEE double it denotes
        if not math.isfinite(f):
            raise _JsonRefused("integer literal beyond double range")
        return f
    return v


def _parse_float(lit: str) -> float:
    f = float(lit)
    if not math.isfinite(f):
        raise _JsonRefused(f"number {lit} is not a finite double")
    return f


def _parse_constant(lit: str):
    raise _JsonRefused(f"{lit} is not JSON")


def _no_duplicates(pairs):
    d = {}
    for k, v in pairs:
        if k in d:
            raise _JsonRefused(f"duplicate key {k!r}")
        d[k] = v
    return d


def parse_canonical_json(data: bytes) -> Any:
    """Decode ``data``; refuse anything that is not exactly canonical."""
    if _json_depth(data) > MAX_DEPTH:
        raise _JsonRefused(f"nesting deeper than {MAX_DEPTH}")
    try:
        text = data.decode("utf-8", errors="strict")
    except UnicodeDecodeError as e:
        raise _JsonRefused(f"not UTF-8: {e}") from None
    try:
        value = json.loads(text, parse_int=_parse_int, parse_float=_parse_float,
                           parse_constant=_parse_constant,
                           object_pairs_hook=_no_duplicates)
    except json.JSONDecodeError as e:
        raise _JsonRefused(f"not JSON: {e}") from None
    except RecursionError:  # pragma: no cover - depth is checked above
        raise _JsonRefused("too deep") from None
    canon = canonical_json(value)
    if canon.encode("utf-8") != data:
        # find the first differing byte for a useful message
        c = canon.encode("utf-8")
        i = next((j for j in range(min(len(c), len(data))) if c[j] != data[j]),
                 min(len(c), len(data)))
        raise _JsonRefused(f"not canonical at byte {i}: expected {c[i:i + 24]!r}, "
                           f"found {data[i:i + 24]!r}")
    return value


# ---------------------------------------------------------------------------
# Field validators (spec 5)
# ---------------------------------------------------------------------------


class _V:
    """Type/range checks that raise a MalformedHeaderError naming the field."""

    def __init__(self, file: str, kind: str = MALFORMED_HEADER):
        self.file = file
        self.kind = kind

    def fail(self, fld: str, expected: Any, found: Any):
        raise HsnapSpecError(self.kind, self.file, fld, expected, found)

    def obj(self, v, fld):
        if not isinstance(v, dict):
            self.fail(fld, "an object", _show(v))
        return v

    def get(self, o: dict, key: str, fld: str, default=...):
        if key in o:
            return o[key]
        if default is ...:
            self.fail(f"{fld}.{key}", "present", "missing")
        return default

    def is_int(self, v) -> bool:
        return isinstance(v, int) and not isinstance(v, bool)

    def int(self, v, fld, lo=0, hi=MAX_SAFE_INT, nullable=False):
        if v is None and nullable:
            return v
        if not self.is_int(v) or not lo <= v <= hi:
            self.fail(fld, f"an integer in [{lo}, {hi}]" + (" or null" if nullable else ""),
                      _show(v))
        return v

    def str(self, v, fld, maxlen=MAX_STR):
        # spec 1.1 4/5: length in code points (Python's len of a str)
        if not isinstance(v, str) or (maxlen is not None and len(v) > maxlen):
            self.fail(fld, f"a string of at most {maxlen} code points", _show(v))
        return v

    def bool(self, v, fld):
        if not isinstance(v, bool):
            self.fail(fld, "a boolean", _show(v))
        return v

    def flat(self, v, fld):
        self.obj(v, fld)
        for k, x in v.items():
            if isinstance(x, list):
                for y in x:
                    if not isinstance(y, (str, int, float, bool)):
                        self.fail(f"{fld}.{k}", "an array of strings, numbers, booleans",
                                  _show(x))
            elif x is not None and not isinstance(x, (str, int, float, bool)):
                self.fail(f"{fld}.{k}", "a string, number, boolean, null or flat array",
                          _show(x))
        return v

    def dtype(self, v, fld):
        if not isinstance(v, str) or v not in ITEMSIZE:  # a list or object is no name (and unhashable)
            self.fail(fld, "a dtype name of section 6", _show(v))
        return v

    def shape(self, v, fld, dim_hi, max_dims=8):
        if not isinstance(v, list) or len(v) > max_dims:
            self.fail(fld, f"a list of at most {max_dims} integers", _show(v))
        for i, d in enumerate(v):
            self.int(d, f"{fld}[{i}]", 0, dim_hi)
        return v

    def layers(self, v, fld):
        if not isinstance(v, list) or len(v) > 65536:
            self.fail(fld, "a list of at most 65536 layer ids", _show(v))
        for i, x in enumerate(v):
            self.int(x, f"{fld}[{i}]", 0, 65535)
        if len(set(v)) != len(v):
            # spec 5.6: layer lists hold distinct ids
            self.fail(fld, "distinct layer ids", _show(v))
        return v


def _show(v) -> str:
    s = json.dumps(v, ensure_ascii=False) if not isinstance(v, bytes) else v.hex()
    return s if len(s) <= 80 else s[:77] + "..."


def _validate_identity(v: _V, ident):
    f = "identity"
    v.obj(ident, f)
    v.str(v.get(ident, "model_id", f), f"{f}.model_id")
    v.str(v.get(ident, "weights_version", f), f"{f}.weights_version")
    v.str(v.get(ident, "weights_hash", f, ""), f"{f}.weights_hash")
    eng = v.obj(v.get(ident, "engine", f), f"{f}.engine")
    for k in ("name", "version", "commit"):
        v.str(v.get(eng, k, f"{f}.engine"), f"{f}.engine.{k}")
    tp_size = v.int(v.get(ident, "tp_size", f), f"{f}.tp_size", 1, 65536)
    tp_rank = v.int(v.get(ident, "tp_rank", f), f"{f}.tp_rank", 0, 65536)
    if tp_rank >= tp_size:
        v.fail(f"{f}.tp_rank", f"< tp_size ({tp_size})", tp_rank)
    for k in ("device", "snapshot_id", "created_at", "hsnap_version"):
        # SPEC GAP: created_at is "RFC 3339 UTC time" but no reader check is
        # stated (and the default "" is not RFC 3339); only the type is checked.
        v.str(v.get(ident, k, f, ""), f"{f}.{k}")
    v.flat(v.get(ident, "numerics", f, {}), f"{f}.numerics")


def _validate_geometry(v: _V, geo, parallel: bool = False):
    """``parallel``: the file requires ``parallel-layers`` (spec 1.4 5.2, R-5.2-2): then, and only then, a layer id
    is in an attention group and in mamba.layers."""
    f = "geometry"
    v.obj(geo, f)
    att = v.get(geo, "attention", f, None)
    mam = v.get(geo, "mamba", f, None)
    v.int(v.get(geo, "start_layer", f, 0), f"{f}.start_layer", 0, 65536)
    v.int(v.get(geo, "num_layers", f, 0), f"{f}.num_layers", 0, 65536)
    owners: dict[int, str] = {}
    if att is not None:
        a = f"{f}.attention"
        v.obj(att, a)
        kind = v.get(att, "kind", a)
        if kind not in ("mha", "mla", "swa"):
            v.fail(f"{a}.kind", '"mha", "mla" or "swa"', _show(kind))
        layers = v.layers(v.get(att, "layers", a), f"{a}.layers")
        heads = v.int(v.get(att, "heads", a), f"{a}.heads", 1, 65536)
        kdim = v.int(v.get(att, "k_head_dim", a), f"{a}.k_head_dim", 1, 2**20)
        vdim = v.int(v.get(att, "v_head_dim", a), f"{a}.v_head_dim", 0, 2**20)
        dt = v.dtype(v.get(att, "dtype", a), f"{a}.dtype")
        sdt = v.dtype(v.get(att, "storage_dtype", a), f"{a}.storage_dtype")
        if ITEMSIZE[sdt] != ITEMSIZE[dt]:  # spec 5.6: storage_dtype has the itemsize of dtype
            v.fail(f"{a}.storage_dtype", f"a type of itemsize {ITEMSIZE[dt]} (as dtype)", _show(sdt))
        v.int(v.get(att, "page_size", a), f"{a}.page_size", 1, 2**20)
        swa_layers = v.layers(v.get(att, "swa_layers", a, []), f"{a}.swa_layers")
        # spec 5.6: absent swa_window, kv_lora_rank, qk_rope_head_dim mean null
        swa_window = v.int(v.get(att, "swa_window", a, None), f"{a}.swa_window", nullable=True)
        lora = v.int(v.get(att, "kv_lora_rank", a, None), f"{a}.kv_lora_rank", nullable=True)
        rope = v.int(v.get(att, "qk_rope_head_dim", a, None), f"{a}.qk_rope_head_dim",
                     nullable=True)
        # spec 1.1 5.6: kind rules; "set" = non-null (swa_layers: non-empty);
        # swa does not require swa_window; a null MLA dimension counts as 0
        if kind != "swa" and swa_layers:
            v.fail(f"{a}.swa_layers", "[] unless kind is swa", _show(swa_layers))
        if kind != "swa" and swa_window is not None:
            v.fail(f"{a}.swa_window", "null unless kind is swa", swa_window)
        if kind != "mla":
            for k_, x in (("kv_lora_rank", lora), ("qk_rope_head_dim", rope)):
                if x is not None:
                    v.fail(f"{a}.{k_}", "null unless kind is mla", x)
        if kind == "mla":
            if heads != 1:
                v.fail(f"{a}.heads", "1 for mla", heads)
            if vdim != 0:
                v.fail(f"{a}.v_head_dim", "0 for mla", vdim)
            if kdim != (lora or 0) + (rope or 0):
                v.fail(f"{a}.k_head_dim", "kv_lora_rank + qk_rope_head_dim for mla",
                       f"{kdim} (kv_lora_rank {lora}, qk_rope_head_dim {rope})")
        for L in layers:
            owners[L] = "attention.layers"
        for L in swa_layers:
            if L in owners:
                v.fail(f"{a}.swa_layers", f"layer {L} in one group only", owners[L])
            owners[L] = "attention.swa_layers"
    if mam is not None:
        m = f"{f}.mamba"
        v.obj(mam, m)
        layers = v.layers(v.get(mam, "layers", m), f"{m}.layers")
        cs = v.get(mam, "conv_shapes", m)
        if not isinstance(cs, list) or not 1 <= len(cs) <= 8:
            v.fail(f"{m}.conv_shapes", "1..8 shapes", _show(cs))
        for i, s in enumerate(cs):
            v.shape(s, f"{m}.conv_shapes[{i}]", 2**40 - 1)  # spec 1.1 5.2: 0 ..< 2^40
        v.dtype(v.get(mam, "conv_dtype", m), f"{m}.conv_dtype")
        v.shape(v.get(mam, "temporal_shape", m), f"{m}.temporal_shape", 2**40 - 1)
        v.dtype(v.get(mam, "temporal_dtype", m), f"{m}.temporal_dtype")
        # spec 1.1 5.2: not tied to the conv rank (unless sharding.conv is present)
        v.int(v.get(mam, "conv_slice_axis", m, 0), f"{m}.conv_slice_axis", 0, 7)
        both = [L for L in layers if L in owners]
        if bool(both) != parallel:
            v.fail(f, "a layer in an attention group and in mamba.layers exactly when features.required lists parallel-layers",
                   f"layers {both} in both, parallel-layers {'' if parallel else 'not '}required")
    sh = v.get(geo, "sharding", f, None)
    if sh is not None:
        _validate_sharding(v, sh, att, mam)


def _validate_axis(v: _V, ax, fld: str, axis_rule, shape) -> None:
    """spec 1.1 5.7: {"axis", "global", "parts": [[offset, length, replicas]...]}."""
    v.obj(ax, fld)
    axis = v.int(v.get(ax, "axis", fld), f"{fld}.axis", 0, 7)
    glob = v.int(v.get(ax, "global", fld), f"{fld}.global", 1, 2**40)
    parts = v.get(ax, "parts", fld)
    if not isinstance(parts, list) or not 1 <= len(parts) <= 64:
        v.fail(f"{fld}.parts", "1..64 parts", _show(parts))
    end = total = 0
    for i, p in enumerate(parts):
        pf = f"{fld}.parts[{i}]"
        if not isinstance(p, list) or len(p) != 3:
            v.fail(pf, "[offset, length, replicas]", _show(p))
        off = v.int(p[0], f"{pf}[0]", end, 2**40)
        n = v.int(p[1], f"{pf}[1]", 1, 2**40)
        v.int(p[2], f"{pf}[2]", 1, 65536)
        if off + n > glob:
            v.fail(pf, f"offset + length <= global ({glob})", off + n)
        end, total = off + n, total + n
    if axis_rule is not None and axis != axis_rule:
        v.fail(f"{fld}.axis", axis_rule, axis)
    if axis >= len(shape):
        v.fail(f"{fld}.axis", f"< rank {len(shape)}", axis)
    if total != shape[axis]:
        v.fail(f"{fld}.parts", f"lengths summing to {shape[axis]}", total)


def _validate_sharding(v: _V, sh, att, mam) -> None:
    f = "geometry.sharding"
    v.obj(sh, f)
    # spec 5.6/5.7 (R-5.6-4): the three keys are required (each an AXIS or null)
    a, c, t = (v.get(sh, k, f) for k in ("attention", "conv", "temporal"))
    if a is not None:
        if att is None:
            v.fail(f"{f}.attention", "null (geometry.attention is null)", "present")
        _validate_axis(v, a, f"{f}.attention", 1, [None, att["heads"], None])
    if (c is not None or t is not None) and mam is None:
        v.fail(f"{f}.conv/temporal", "null (geometry.mamba is null)", "present")
    if c is not None:
        shapes = mam["conv_shapes"]
        if not isinstance(c, list) or len(c) != len(shapes):
            v.fail(f"{f}.conv", f"{len(shapes)} entries", _show(c))
        for i, ax in enumerate(c):
            _validate_axis(v, ax, f"{f}.conv[{i}]", mam.get("conv_slice_axis", 0), shapes[i])
    if t is not None:
        _validate_axis(v, t, f"{f}.temporal", None, mam["temporal_shape"])


def reassemble_global(directory: "Directory", name: str) -> np.ndarray:
    """The global tensor of state section ``name`` from every rank (spec 5.7): each rank's
    parts written at their global offsets (replicas must agree)."""
    out = None
    key = {"attn": "attention", "swa": "attention", "mla": "attention"}
    for snap in directory.ranks:
        s = snap.section(name)
        kind = s["kind"]
        sh = snap.header["geometry"]["sharding"]
        ax = sh["conv"][int(name.rsplit(".", 1)[1])] if kind == "conv" else sh[key.get(name.split(".")[0], "temporal")]
        vals = s["values"]
        shape = list(vals.shape)
        shape[ax["axis"]] = ax["global"]
        if out is None:
            out = np.full(shape, np.nan)
        local = 0
        for off, n, _ in ax["parts"]:
            dst = [slice(None)] * vals.ndim
            src = list(dst)
            dst[ax["axis"]], src[ax["axis"]] = slice(off, off + n), slice(local, local + n)
            piece = np.asarray(vals[tuple(src)], dtype=np.float64)
            have = out[tuple(dst)]
            if not np.all(np.isnan(have)) and not np.array_equal(have, piece):
                raise HsnapSpecError(MALFORMED_HEADER, snap.file, f"{name} replicas", "equal", "different")
            out[tuple(dst)] = piece
            local += n
    return out


def _validate_request(v: _V, req):
    f = "request"
    v.obj(req, f)
    v.str(v.get(req, "rid", f), f"{f}.rid")
    sp = v.int(v.get(req, "state_position", f), f"{f}.state_position")
    pt = v.int(v.get(req, "prompt_tokens", f), f"{f}.prompt_tokens", 0, 2**32)
    ot = v.int(v.get(req, "output_tokens", f), f"{f}.output_tokens", 0, 2**32)
    if sp > pt + ot:
        v.fail(f"{f}.state_position", f"<= prompt_tokens + output_tokens ({pt + ot})", sp)
    v.bool(v.get(req, "has_logprobs", f), f"{f}.has_logprobs")
    v.int(v.get(req, "top_logprobs_k", f, 0), f"{f}.top_logprobs_k", 0, 4096)
    v.bool(v.get(req, "has_rng_state", f, False), f"{f}.has_rng_state")
    v.flat(v.get(req, "sampling", f, {}), f"{f}.sampling")
    stop = v.obj(v.get(req, "stop", f), f"{f}.stop")
    s = f"{f}.stop"
    # spec 5.6: absent max_new_tokens means null (no budget)
    mnt = v.int(v.get(stop, "max_new_tokens", s, None), f"{s}.max_new_tokens", nullable=True)
    if mnt is not None and mnt < ot:
        v.fail(f"{s}.max_new_tokens", f">= output_tokens ({ot})", mnt)
    v.int(v.get(stop, "min_new_tokens", s, 0), f"{s}.min_new_tokens")
    ss = v.get(stop, "stop_strings", s, [])
    if not isinstance(ss, list) or len(ss) > MAX_STOP_STRINGS:
        v.fail(f"{s}.stop_strings", f"at most {MAX_STOP_STRINGS} strings", _show(ss))
    for i, x in enumerate(ss):
        v.str(x, f"{s}.stop_strings[{i}]", maxlen=MAX_STOP_STRING)  # spec 5.3: each <= 4,096 code points
    sti = v.get(stop, "stop_token_ids", s, [])
    if not isinstance(sti, list) or len(sti) > MAX_STOP_TOKEN_IDS:
        v.fail(f"{s}.stop_token_ids", f"at most {MAX_STOP_TOKEN_IDS} ints", _show(sti))
    for i, x in enumerate(sti):
        v.int(x, f"{s}.stop_token_ids[{i}]", 0, 2**31 - 1)
    v.bool(v.get(stop, "ignore_eos", s, False), f"{s}.ignore_eos")
    # SPEC GAP: remaining_budget defaults to null yet must be "exactly
    # max_new_tokens - output_tokens"; an absent value with a non-null
    # max_new_tokens is refused here.
    rb = v.int(v.get(req, "remaining_budget", f, None), f"{f}.remaining_budget",
               nullable=True)
    want = None if mnt is None else mnt - ot
    if rb != want:
        v.fail(f"{f}.remaining_budget", _show(want), _show(rb))
    st = v.obj(v.get(req, "streamed", f), f"{f}.streamed")
    t = f"{f}.streamed"
    v.int(v.get(st, "tokens", t, 0), f"{t}.tokens", 0, ot)
    v.int(v.get(st, "text_chars", t, 0), f"{t}.text_chars")
    v.int(v.get(st, "reasoning_tokens", t, 0), f"{t}.reasoning_tokens", 0, ot)
    v.bool(v.get(st, "reasoning_finished", t, False), f"{t}.reasoning_finished")
    v.int(v.get(req, "swa_start", f, 0), f"{f}.swa_start", 0, sp)
    v.flat(v.get(req, "extra", f, {}), f"{f}.extra")


def _validate_swa_start(v: _V, header) -> None:
    """spec 5.6: swa_start is 0 unless geometry.attention.kind is swa."""
    att = header["geometry"].get("attention")
    swa_start = header["request"].get("swa_start", 0)
    if swa_start and (att is None or att.get("kind") != "swa"):
        v.fail("request.swa_start", "0 unless geometry.attention.kind is swa", swa_start)


def _validate_base(v: _V, header) -> None:
    """spec 5.9 (1.2): base present (not null) exactly when delta is required (R-5.9-1);
    then its keys, each present and in range (R-5.9-2); unknown keys inside ignored."""
    base = header.get("base")
    delta = "delta" in header["features"]["required"]
    if (base is not None) != delta:
        v.fail("base", "present exactly when features.required lists delta",
               f"base {'present' if base is not None else 'absent'}, delta {'' if delta else 'not '}required")
    if base is None:
        return
    v.obj(base, "base")
    name = v.str(v.get(base, "name", "base"), "base.name")
    raw = name.encode("utf-8", "surrogatepass")
    if not 1 <= len(raw) <= 255 or "/" in name or "\0" in name or name in (".", ".."):
        v.fail("base.name", "1..255 bytes, no '/' or NUL, not '.' or '..'", _show(name))
    rd = v.get(base, "root_digest", "base")
    if not isinstance(rd, str) or not HEX32_RE.fullmatch(rd):
        v.fail("base.root_digest", "32 lowercase hex digits", _show(rd))
    v.str(v.get(base, "snapshot_id", "base"), "base.snapshot_id")
    v.int(v.get(base, "state_position", "base"), "base.state_position", 0, header["request"]["state_position"])
    v.int(v.get(base, "depth", "base"), "base.depth", 1, MAX_CHAIN_DEPTH)


def _validate_pages(v: _V, header) -> None:
    """spec 5.10 (1.3): pages present (not null) exactly when pages is required (R-5.10-1);
    its keys present and in range (R-5.10-2); full-attention layers, one reference per full
    page of the file's rows, and the namespace id of the file's own namespace (R-5.10-3)."""
    pages = header.get("pages")
    required = "pages" in header["features"]["required"]
    if (pages is not None) != required:
        v.fail("pages", "present exactly when features.required lists pages",
               f"pages {'present' if pages is not None else 'absent'}, pages {'' if required else 'not '}required")
    if pages is None:
        return
    v.obj(pages, "pages")
    store = v.str(v.get(pages, "store", "pages"), "pages.store")
    raw = store.encode("utf-8", "surrogatepass")
    if not 1 <= len(raw) <= 255 or "/" in store or "\0" in store or store in (".", ".."):
        v.fail("pages.store", "1..255 bytes, no '/' or NUL, not '.' or '..'", _show(store))
    S = v.int(v.get(pages, "page_size", "pages"), "pages.page_size", 1, 2**16)
    nid = v.get(pages, "namespace_id", "pages")
    if not isinstance(nid, str) or not HEX64_RE.fullmatch(nid):
        v.fail("pages.namespace_id", "64 lowercase hex digits", _show(nid))
    refs = v.get(pages, "refs", "pages")
    if not isinstance(refs, list):
        v.fail("pages.refs", "an array", _show(refs))
    for i, r in enumerate(refs):
        if not (isinstance(r, list) and len(r) == 2 and isinstance(r[0], str) and HEX64_RE.fullmatch(r[0])
                and isinstance(r[1], str) and HEX32_RE.fullmatch(r[1])):
            v.fail(f"pages.refs[{i}]", "[64 hex, 32 hex]", _show(r))
    att = header["geometry"].get("attention")
    if att is None or not att["layers"]:
        v.fail("pages", "full-attention layers", "none")
    first, count = page_range(header, S)
    if len(refs) != count:
        v.fail("pages.refs", f"{count} references", len(refs))
    want = namespace_id(namespace_of(header, S))
    if nid != want:
        v.fail("pages.namespace_id", want, nid)


def page_range(header: dict, S: int) -> tuple[int, int]:
    """spec 5.10: pages first .. first + count - 1, the full pages of positions B .. P - 1."""
    B, P = base_position(header), header["request"]["state_position"]
    first = -(-B // S)
    return first, max(0, P // S - first)


def namespace_of(header: dict, S: int) -> dict:
    """spec 5.10: the namespace object of a file's pages."""
    ident, att = header["identity"], header["geometry"]["attention"]
    sh = header["geometry"].get("sharding")
    return {
        "attention": {k: (sorted(att[k]) if k == "layers" else att.get(k)) for k in NAMESPACE_ATTENTION_KEYS},
        "engine": {k: ident["engine"][k] for k in ("commit", "name", "version")},
        "model_id": ident["model_id"], "page_size": S,
        # spec 5.10: the AXIS's own three keys; unknown keys beside them (5.6) stay out of the namespace
        "sharding": None if sh is None or sh.get("attention") is None else {k: sh["attention"][k] for k in ("axis", "global", "parts")},
        "tp_rank": ident["tp_rank"], "tp_size": ident["tp_size"],
        "weights_hash": ident.get("weights_hash", ""), "weights_version": ident["weights_version"],
    }


def namespace_id(ns: dict) -> str:
    """spec 5.10: SHA-256 of "hsnap-page-namespace-v1\n" and the namespace's canonical JSON."""
    import hashlib

    return hashlib.sha256(b"hsnap-page-namespace-v1\n" + canonical_json(ns).encode("utf-8")).hexdigest()


def page_key(prior: str | None, tokens) -> str:
    """spec 5.10: SHA-256 of the prior key's 32 bytes and the page's ids as u32 little-endian."""
    import hashlib

    h = hashlib.sha256(bytes.fromhex(prior) if prior else b"")
    h.update(b"".join(struct.pack("<I", int(t)) for t in tokens))
    return h.hexdigest()


def paged_rows(header: dict) -> int:
    """G of spec 5.4: the rows a file takes from its pages."""
    pages = header.get("pages")
    return 0 if pages is None else pages["page_size"] * len(pages["refs"])


def base_position(header: dict) -> int:
    """B of spec 5.4: a delta's base.state_position, else 0."""
    base = header.get("base")
    return 0 if base is None else base["state_position"]


def section_plan(header: dict, rng_len: int | None) -> list[dict]:
    """The section table 5.4 implies (name, kind, layer, dtype, shape); B of a delta (5.9)."""
    geo, req = header["geometry"], header["request"]
    att = geo.get("attention")
    mam = geo.get("mamba")
    B = base_position(header)
    sp = req["state_position"] - B - paged_rows(header)  # rows of full-attention sections (5.4: B, G)
    swa_start = max(req.get("swa_start", 0), B)
    sp_swa = req["state_position"]
    plan: list[dict] = []

    def add(name, kind, layer, dtype, shape):
        plan.append({"name": name, "kind": kind, "layer": layer, "dtype": dtype,
                     "shape": list(shape)})

    groups: dict[int, list[str]] = {}  # a parallel layer (1.4): its attention group's sections, then its mamba ones
    if att is not None:
        for L in att["layers"]:
            groups.setdefault(L, []).append("attn")
        for L in att.get("swa_layers", []):
            groups.setdefault(L, []).append("swa")
    if mam is not None:
        for L in mam["layers"]:
            groups.setdefault(L, []).append("mamba")
    for L, g in [(layer, kind) for layer in sorted(groups) for kind in groups[layer]]:
        if g == "attn" and att["kind"] == "mla":
            add(f"mla.{L}.kv", "mla_kv", L, att["dtype"], [sp, 1, att["k_head_dim"]])
        elif g == "attn":
            add(f"attn.{L}.k", "attn_k", L, att["dtype"], [sp, att["heads"], att["k_head_dim"]])
            add(f"attn.{L}.v", "attn_v", L, att["dtype"], [sp, att["heads"], att["v_head_dim"]])
        elif g == "swa":
            n = sp_swa - swa_start
            add(f"swa.{L}.k", "swa_k", L, att["dtype"], [n, att["heads"], att["k_head_dim"]])
            add(f"swa.{L}.v", "swa_v", L, att["dtype"], [n, att["heads"], att["v_head_dim"]])
        else:
            for i, shape in enumerate(mam["conv_shapes"]):
                add(f"mamba.{L}.conv.{i}", "conv", L, mam["conv_dtype"], shape)
            add(f"mamba.{L}.temporal", "temporal", L, mam["temporal_dtype"],
                mam["temporal_shape"])
    pt, ot = req["prompt_tokens"], req["output_tokens"]
    k = req.get("top_logprobs_k", 0)
    add("request.prompt_ids", "prompt_ids", None, "int32", [pt])
    add("request.output_ids", "output_ids", None, "int32", [ot])
    if req["has_logprobs"]:
        add("request.output_logprobs", "output_logprobs", None, "float32", [ot])
    if k > 0:
        add("request.top_logprob_ids", "top_logprob_ids", None, "int32", [ot, k])
        add("request.top_logprob_values", "top_logprob_values", None, "float32", [ot, k])
    if req.get("has_rng_state", False):
        add("request.rng_state", "rng_state", None, "uint8", [rng_len])
    return plan


# ---------------------------------------------------------------------------
# Reading one rank file (spec 3, 7)
# ---------------------------------------------------------------------------


@dataclass
class Snapshot:
    file: str
    major: int
    minor: int
    header_length: int
    data_offset: int
    file_length: int
    header_digest: bytes
    preamble_check: int
    trailer_check: int
    root_digest: bytes
    header_bytes: bytes
    header: dict
    sections: list[dict]  # header entries, each plus "raw" and "values" once decoded
    verified: bool = False
    payload_bytes: int = 0
    raw_file: bytes = field(repr=False, default=b"")

    def section(self, name: str) -> dict:
        for s in self.sections:
            if s["name"] == name:
                return s
        raise KeyError(name)


def read_snapshot(path, *, verify: bool = True) -> Snapshot:
    """Open (7.1 step 1: no final symlink, regular file) and parse a rank file."""
    path = os.fspath(path)
    name = os.path.basename(path)
    try:
        fd = os.open(path, os.O_RDONLY | getattr(os, "O_NOFOLLOW", 0))
    except OSError as e:
        raise HsnapSpecError(IO_ERROR, name, "path", "an openable regular file, no symlink",
                             e.strerror) from None
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            raise HsnapSpecError(MALFORMED_HEADER, name, "path", "a regular file",
                                 stat.filemode(st.st_mode))
        chunks = []
        while True:
            b = os.read(fd, 1 << 20)
            if not b:
                break
            chunks.append(b)
    finally:
        os.close(fd)
    return parse_snapshot(b"".join(chunks), name, verify=verify)


def parse_snapshot(data: bytes, name: str = "<bytes>", *, verify: bool = True, _page: bool = False) -> Snapshot:
    """Checks 2..20 of 7.1 in order, then 7.2 and decoding when ``verify``. ``_page``: a page
    object (spec 5.11): its own step 13 and, after step 18, its namespace and page checks."""
    E = lambda kind, fld, exp, found: HsnapSpecError(kind, name, fld, exp, found)  # noqa: E731
    size = len(data)
    # 2, 3: magic
    if size < 8 and MAGIC.startswith(data):
        raise E(TRUNCATED, "magic", "8 bytes", f"{size} bytes")
    if data[:8] != MAGIC:
        raise E(BAD_MAGIC, "magic", MAGIC.hex(), data[:8].hex())
    # 4: preamble present
    if size < 64:
        raise E(TRUNCATED, "preamble", "64 bytes", f"{size} bytes")
    pre = data[:64]
    (_magic, major, minor, bom, header_length, data_offset, header_digest, file_length,
     preamble_check) = PREAMBLE.unpack(pre)
    # 5: preamble check
    if check64(pre) != preamble_check:
        # spec 1.1 7.3: expected = stored, found = computed
        raise E(DIGEST_MISMATCH, "preamble.check", f"{preamble_check:016x}",
                f"{check64(pre):016x}")
    # 6: byte-order mark
    if bom != BYTE_ORDER_MARK:
        raise E(MALFORMED_HEADER, "byte_order", "0x0a0b0c0d", hex(bom))
    # 7: version
    if major != MAJOR:
        raise E(UNSUPPORTED_VERSION, "major", MAJOR, major)
    # 8: header length
    if not 1 <= header_length <= MAX_HEADER:
        raise E(MALFORMED_HEADER, "header_length", f"1..{MAX_HEADER}", header_length)
    # 9: data offset
    if data_offset % ALIGNMENT or data_offset < align(64 + header_length):
        raise E(MALFORMED_HEADER, "data_offset",
                f"a multiple of 4096 >= {align(64 + header_length)}", data_offset)
    # 10: room for the trailer
    if file_length < data_offset + 64:
        raise E(MALFORMED_HEADER, "file_length", f">= data_offset + 64 ({data_offset + 64})",
                file_length)
    # 11: actual size
    if size < file_length:
        raise E(TRUNCATED, "file_length", f"{file_length} bytes", f"{size} bytes")
    if size > file_length:
        raise E(MALFORMED_HEADER, "file_length", f"{file_length} bytes", f"{size} bytes")
    # 12: header digest
    hbytes = data[64:64 + header_length]
    if digest128(hbytes) != header_digest:
        raise E(DIGEST_MISMATCH, "header_digest", header_digest.hex(), digest128(hbytes).hex())
    # 13: canonical JSON, seven keys, format, features
    try:
        header = parse_canonical_json(hbytes)
    except _JsonRefused as e:
        raise E(MALFORMED_HEADER, "header", "canonical JSON (section 4)", str(e)) from None
    if not isinstance(header, dict):
        raise E(MALFORMED_HEADER, "header", "an object", type(header).__name__)
    top, fmt = (PAGE_TOP_KEYS, "hsnap-page") if _page else (TOP_KEYS, "hsnap")
    missing = top - header.keys()
    if missing:
        raise E(MALFORMED_HEADER, "header", f"keys {sorted(top)}",
                f"missing {sorted(missing)}")
    if header["format"] != fmt:
        raise E(MALFORMED_HEADER, "format", _show(fmt), _show(header["format"]))
    feats = header["features"]
    # spec 1.1 5.6: both keys, arrays of strings only; other keys ignored;
    # duplicates allowed; an optional list that disagrees with the content is no error
    if (not isinstance(feats, dict) or not {"required", "optional"} <= set(feats)
            or not all(isinstance(feats[k], list) and all(isinstance(x, str) for x in feats[k])
                       for k in ("required", "optional"))):
        raise E(MALFORMED_HEADER, "features",
                '{"required": [string...], "optional": [string...]}', _show(feats))
    # 14: features, digest algorithm
    # spec 5.11: no feature applies to a page object in 1.3, so a page requires none
    known = PAGE_FEATURES if _page else KNOWN_FEATURES
    for feat in feats["required"]:
        if feat not in known:
            raise E(UNSUPPORTED_FEATURE, "features.required", sorted(known),
                    _show(feat))
    # spec 1.1 5.6: a digest that is not a known name, of any JSON type: UnsupportedFeature
    if not isinstance(header["digest"], str) or header["digest"] not in KNOWN_DIGESTS:
        raise E(UNSUPPORTED_FEATURE, "digest", '"xxh3-128"', _show(header["digest"]))
    # 15: section table
    table = header["sections"]
    if not isinstance(table, list) or len(table) > MAX_SECTIONS:
        raise E(MALFORMED_HEADER, "sections", f"an array of at most {MAX_SECTIONS} entries",
                _show(table) if not isinstance(table, list) else f"{len(table)} entries")
    v = _V(name)
    cursor = data_offset
    seen = set()
    for i, s in enumerate(table):
        fld = f"sections[{i}]"
        v.obj(s, fld)
        if set(s) != SECTION_KEYS:
            v.fail(fld, f"exactly the keys {sorted(SECTION_KEYS)}", sorted(s))
        nm = s["name"]
        if not isinstance(nm, str) or not SECTION_NAME_RE.fullmatch(nm):
            v.fail(f"{fld}.name", "[A-Za-z0-9][A-Za-z0-9._-]{0,127}", _show(nm))
        if nm in seen:
            v.fail(f"{fld}.name", "a unique name", _show(nm))
        seen.add(nm)
        fld = f"sections[{nm!r}]"
        if not isinstance(s["kind"], str) or s["kind"] not in KINDS:
            v.fail(f"{fld}.kind", "a kind of 5.4", _show(s["kind"]))
        v.int(s["layer"], f"{fld}.layer", 0, 65535, nullable=True)
        v.dtype(s["dtype"], f"{fld}.dtype")
        v.shape(s["shape"], f"{fld}.shape", 2**40 - 1)
        v.int(s["offset"], f"{fld}.offset")
        v.int(s["length"], f"{fld}.length")
        if not isinstance(s["digest"], str) or not HEX32_RE.fullmatch(s["digest"]):
            v.fail(f"{fld}.digest", "32 lowercase hex digits", _show(s["digest"]))
        want_len = math.prod(s["shape"]) * ITEMSIZE[s["dtype"]]
        if s["length"] != want_len:
            v.fail(f"{fld}.length", f"product(shape) x itemsize = {want_len}", s["length"])
        want_off = data_offset if i == 0 else align(cursor)
        if s["offset"] != want_off:
            v.fail(f"{fld}.offset", want_off, s["offset"])
        cursor = s["offset"] + s["length"]
        if cursor > file_length - 64:
            v.fail(f"{fld}.length", f"to end by the trailer at {file_length - 64}",
                   f"end at {cursor}")
    # spec 5.5: with no sections the trailer starts at data_offset
    if cursor != file_length - 64:
        v.fail("sections", f"the last section to end at file_length - 64 = "
                           f"{file_length - 64}", f"end at {cursor}")
    # 16: trailer check
    tr = data[file_length - 64:file_length]
    t_magic, t_len, t_count, root_digest, reserved, trailer_check = TRAILER.unpack(tr)
    if check64(tr) != trailer_check:
        raise E(DIGEST_MISMATCH, "trailer.check", f"{trailer_check:016x}", f"{check64(tr):016x}")
    # 17: trailer fields
    if t_magic != TRAILER_MAGIC:
        raise E(MALFORMED_HEADER, "trailer.magic", TRAILER_MAGIC, t_magic)
    if t_len != file_length:
        raise E(MALFORMED_HEADER, "trailer.file_length", file_length, t_len)
    if t_count != len(table):
        raise E(MALFORMED_HEADER, "trailer.section_count", len(table), t_count)
    if reserved != bytes(16):
        raise E(MALFORMED_HEADER, "trailer.reserved", "zero", reserved.hex())
    # 18: root digest
    root = digest128(header_digest + b"".join(bytes.fromhex(s["digest"]) for s in table))
    if root != root_digest:
        raise E(DIGEST_MISMATCH, "trailer.root_digest", root_digest.hex(), root.hex())
    if _page:  # spec 5.11, after step 18
        _validate_page(v, header, table)
        snap = Snapshot(file=name, major=major, minor=minor, header_length=header_length, data_offset=data_offset,
                        file_length=file_length, header_digest=header_digest, preamble_check=preamble_check,
                        trailer_check=trailer_check, root_digest=root_digest, header_bytes=hbytes, header=header,
                        sections=[dict(s) for s in table], raw_file=data)
        if verify:
            verify_snapshot(snap)
        return snap
    # 19: identity / geometry / request
    _validate_identity(v, header["identity"])
    _validate_geometry(v, header["geometry"], "parallel-layers" in header["features"]["required"])
    _validate_request(v, header["request"])
    _validate_swa_start(v, header)
    _validate_base(v, header)
    _validate_pages(v, header)
    # 20: rng_state <=> last section, then the plan
    req = header["request"]
    has_rng = req.get("has_rng_state", False)
    last_is_rng = bool(table) and table[-1]["kind"] == "rng_state"
    if has_rng != last_is_rng:
        v.fail("request.has_rng_state", f"{has_rng} <=> last section is rng_state",
               f"last section kind {table[-1]['kind'] if table else None!r}")
    rng_len = None
    if has_rng:
        shp = table[-1]["shape"]
        if len(shp) != 1 or shp[0] > MAX_RNG:
            v.fail("sections['request.rng_state'].shape", f"[n], n <= {MAX_RNG}", _show(shp))
        rng_len = shp[0]
    plan = section_plan(header, rng_len)
    if len(plan) != len(table):
        v.fail("sections", f"{len(plan)} entries (the plan of 5.4)", f"{len(table)}")
    for p, s in zip(plan, table):
        for k in ("name", "kind", "layer", "dtype", "shape"):
            if p[k] != s[k]:
                v.fail(f"sections[{s['name']!r}].{k}", _show(p[k]), _show(s[k]))

    snap = Snapshot(
        file=name, major=major, minor=minor, header_length=header_length,
        data_offset=data_offset, file_length=file_length, header_digest=header_digest,
        preamble_check=preamble_check, trailer_check=trailer_check,
        root_digest=root_digest, header_bytes=hbytes, header=header,
        sections=[dict(s) for s in table], raw_file=data,
        payload_bytes=sum(s["length"] for s in table if s["layer"] is not None),
    )
    if verify:
        verify_snapshot(snap)
    return snap


def _validate_page(v: _V, header: dict, table: list) -> None:
    """spec 5.11: namespace (exactly its keys, each as the field it copies), page (exactly its
    keys), then the two digests, then the plan."""
    ns, page = header["namespace"], header["page"]
    v.obj(ns, "namespace")
    if set(ns) != NAMESPACE_KEYS:
        v.fail("namespace", f"exactly the keys {sorted(NAMESPACE_KEYS)}", sorted(ns))
    v.obj(ns["attention"], "namespace.attention")
    if set(ns["attention"]) != NAMESPACE_ATTENTION_KEYS:
        v.fail("namespace.attention", f"exactly the keys {sorted(NAMESPACE_ATTENTION_KEYS)}", sorted(ns["attention"]))
    v.obj(ns["engine"], "namespace.engine")
    if set(ns["engine"]) != {"commit", "name", "version"}:
        v.fail("namespace.engine", "exactly the keys commit, name, version", sorted(ns["engine"]))
    S = v.int(ns["page_size"], "namespace.page_size", 1, 2**16)
    ident = {k: ns[k] for k in ("model_id", "weights_version", "weights_hash", "tp_size", "tp_rank")}
    ident["engine"] = ns["engine"]
    _validate_identity(v, ident)
    att = dict(ns["attention"], page_size=S)
    _validate_geometry(v, {"attention": att})
    if not att["layers"]:
        v.fail("namespace.attention.layers", "at least one layer", "[]")
    if ns["sharding"] is not None:  # geometry.sharding.attention (5.7) of this rank
        if isinstance(ns["sharding"], dict) and set(ns["sharding"]) != {"axis", "global", "parts"}:  # exactly its keys, nested too
            v.fail("namespace.sharding", "exactly the keys axis, global, parts", sorted(ns["sharding"]))
        _validate_axis(v, ns["sharding"], "namespace.sharding", 1, [None, att["heads"], None])
    v.obj(page, "page")
    if set(page) != {"namespace_id", "index", "prior", "key", "tokens"}:
        v.fail("page", "exactly the keys index, key, namespace_id, prior, tokens", sorted(page))
    index = v.int(page["index"], "page.index", 0, 2**40)
    for k in ("key", "namespace_id"):
        if not isinstance(page[k], str) or not HEX64_RE.fullmatch(page[k]):
            v.fail(f"page.{k}", "64 lowercase hex digits", _show(page[k]))
    prior = page["prior"]
    if (prior is None) != (index == 0) or (prior is not None and not (isinstance(prior, str) and HEX64_RE.fullmatch(prior))):
        v.fail("page.prior", "null exactly at index 0, else 64 hex", _show(prior))
    toks = page["tokens"]
    if not isinstance(toks, list) or len(toks) != S or not all(v.is_int(t) and 0 <= t <= 2**31 - 1 for t in toks):
        v.fail("page.tokens", f"{S} token ids", _show(toks))
    nid = namespace_id(ns)
    if page["namespace_id"] != nid:
        raise HsnapSpecError(DIGEST_MISMATCH, v.file, "page.namespace_id", page["namespace_id"], nid)
    key = page_key(prior, toks)
    if page["key"] != key:
        raise HsnapSpecError(DIGEST_MISMATCH, v.file, "page.key", page["key"], key)
    plan = []
    for L in sorted(att["layers"]):
        if att["kind"] == "mla":
            plan.append((f"mla.{L}.kv", "mla_kv", L, att["dtype"], [S, 1, att["k_head_dim"]]))
        else:
            plan.append((f"attn.{L}.k", "attn_k", L, att["dtype"], [S, att["heads"], att["k_head_dim"]]))
            plan.append((f"attn.{L}.v", "attn_v", L, att["dtype"], [S, att["heads"], att["v_head_dim"]]))
    if [tuple(x) for x in plan] != [(e["name"], e["kind"], e["layer"], e["dtype"], e["shape"]) for e in table]:
        v.fail("sections", "the page plan of 5.11", "another table")


def read_page(path, *, verify: bool = True) -> Snapshot:
    """A page object (spec 5.11)."""
    path = os.fspath(path)
    try:  # 7.1 step 1 as for any file a reader opens: a symbolic link is not followed (spec 7.6)
        fd = os.open(path, os.O_RDONLY | getattr(os, "O_NOFOLLOW", 0))
    except OSError as e:
        raise HsnapSpecError(IO_ERROR, os.path.basename(path), "open", "an openable regular file, no symlink", e.strerror) from None
    with os.fdopen(fd, "rb") as f:
        if not stat.S_ISREG(os.fstat(f.fileno()).st_mode):
            raise HsnapSpecError(MALFORMED_HEADER, os.path.basename(path), "path", "a regular file", stat.filemode(os.fstat(f.fileno()).st_mode))
        data = f.read()
    return parse_snapshot(data, os.path.basename(path), verify=verify, _page=True)


def verify_snapshot(snap: Snapshot) -> None:
    """7.2: every padding byte zero, then every section digest; then decode."""
    data, name = snap.raw_file, snap.file
    ranges = [(64 + snap.header_length, snap.data_offset)]
    for a, b in zip(snap.sections, snap.sections[1:]):
        ranges.append((a["offset"] + a["length"], b["offset"]))
    for lo, hi in ranges:
        pad = data[lo:hi]
        if pad.count(0) != len(pad):
            first = lo + next(i for i, x in enumerate(pad) if x)
            raise HsnapSpecError(DIGEST_MISMATCH, name, f"padding at byte {first}", "0x00",
                                 hex(data[first]))
    for s in snap.sections:
        raw = data[s["offset"]:s["offset"] + s["length"]]
        got = digest128(raw).hex()
        if got != s["digest"]:
            raise HsnapSpecError(DIGEST_MISMATCH, name, f"sections[{s['name']!r}].digest",
                                 s["digest"], got)
        s["raw"] = raw
        s["values"] = decode_elements(s["dtype"], raw, s["shape"], file=name, name=s["name"])
    snap.verified = True


# ---------------------------------------------------------------------------
# Snapshot directory (spec 10)
# ---------------------------------------------------------------------------


@dataclass
class Directory:
    path: str
    manifest_text: bytes
    manifest: dict
    manifest_digest: str
    ranks: list[Snapshot]


def read_directory(path, *, verify: bool = True) -> Directory:
    path = os.fspath(path)
    dname = os.path.basename(os.path.normpath(path))
    # spec 7.1 step 1 (R-7.1-2): a directory given as a symbolic link is not followed either
    if os.path.islink(path.rstrip(os.sep) or os.sep):
        raise HsnapSpecError(IO_ERROR, dname, "path", "a directory, not a symbolic link", "a symbolic link")
    M = lambda fld, exp, found: HsnapSpecError(MALFORMED_MANIFEST, dname, fld, exp, found)  # noqa: E731
    mpath = os.path.join(path, "manifest.json")
    try:
        st = os.lstat(mpath)
    except FileNotFoundError:
        raise M("manifest.json", "present", "missing") from None
    if not stat.S_ISREG(st.st_mode):
        raise M("manifest.json", "a regular file", stat.filemode(st.st_mode))
    if st.st_size > MAX_MANIFEST:
        raise M("manifest.json", f"at most {MAX_MANIFEST} bytes", st.st_size)
    fd = os.open(mpath, os.O_RDONLY | getattr(os, "O_NOFOLLOW", 0))
    try:
        text = b""
        while len(text) <= MAX_MANIFEST:
            b = os.read(fd, 1 << 16)
            if not b:
                break
            text += b
    finally:
        os.close(fd)
    if len(text) > MAX_MANIFEST:
        raise M("manifest.json", f"at most {MAX_MANIFEST} bytes", len(text))
    manifest, mdigest = parse_manifest(text, dname)
    # any entry a symlink
    for ent in os.scandir(path):
        if ent.is_symlink():
            raise M(ent.name, "not a symbolic link", "a symbolic link")
    ranks = []
    for i, r in enumerate(manifest["ranks"]):
        rpath = os.path.join(path, r["file"])
        if not os.path.lexists(rpath):
            raise M(r["file"], "present", "missing")
        snap = read_snapshot(rpath, verify=verify)
        ident, req = snap.header["identity"], snap.header["request"]
        pairs = [
            ("length", r["length"], snap.file_length),
            ("root_digest", r["root_digest"], snap.root_digest.hex()),
            ("tp_rank", i, ident["tp_rank"]),
            ("tp_size", manifest["tp_size"], ident["tp_size"]),
            ("snapshot_id", manifest["snapshot_id"], ident.get("snapshot_id", "")),
            ("state_position", manifest["state_position"], req["state_position"]),
        ]
        for fld, want, got in pairs:
            if want != got:
                raise M(f"{r['file']}: {fld}", _show(want), _show(got))
        ranks.append(snap)
    return Directory(path=path, manifest_text=text, manifest=manifest,
                     manifest_digest=mdigest, ranks=ranks)


def parse_manifest(text: bytes, dname: str = "<manifest>") -> tuple[dict, str]:
    """10.1/10.2 checks on manifest.json's bytes; returns (object, digest hex)."""
    M = lambda fld, exp, found: HsnapSpecError(MALFORMED_MANIFEST, dname, fld, exp, found)  # noqa: E731
    # spec 1.1 10.2: not ending in \n (any number of lines) or < 2 lines: truncated;
    # then more than two lines: malformed
    nls = text.count(b"\n")
    if not text.endswith(b"\n") or nls < 2:
        ends = "ends" if text.endswith(b"\n") else "does not end"
        raise HsnapSpecError(TRUNCATED, dname, "manifest.json", "two \\n-terminated lines",
                             f"{nls} newlines, {ends} in \\n")
    if nls != 2:
        raise M("manifest.json lines", 2, nls)
    nl = text.index(b"\n") + 1
    line1, line2 = text[:nl], text[nl:]
    prefix = b"xxh3-128 "
    if not (line2.startswith(prefix) and len(line2) == len(prefix) + 32 + 1):
        raise M("manifest.json digest line", "'xxh3-128 ' + 32 characters", _show(
            line2.decode("utf-8", "replace")))
    stored = line2[len(prefix):-1].decode("ascii", "replace")
    # SPEC GAP: 10.1 says "32 lowercase hex", 10.2 only checks "32 characters";
    # non-lowercase-hex characters are refused as malformed here.
    if not HEX32_RE.fullmatch(stored):
        raise M("manifest.json digest", "32 lowercase hex digits", stored)
    got = digest128(line1).hex()
    if got != stored:
        raise HsnapSpecError(DIGEST_MISMATCH, dname, "manifest.json digest", stored, got)
    try:
        m = parse_canonical_json(line1[:-1])
    except _JsonRefused as e:
        raise M("manifest.json", "canonical JSON (section 4)", str(e)) from None
    if not isinstance(m, dict):
        raise M("manifest.json", "an object", type(m).__name__)
    # spec 1.1 10.1: unknown top-level keys are ignored; rank entries are exact. spec 10.2:
    # line 1 is checked key by key in its order (format, version, ...), a missing key at its
    # own place — a manifest without tp_size but with another major is UnsupportedVersion
    for k in ("format", "version"):
        if k not in m:
            raise M(k, "present", "missing")
    if m["format"] != "hsnap-manifest":
        raise M("format", '"hsnap-manifest"', _show(m["format"]))
    ver = m["version"]
    v = _V(dname, MALFORMED_MANIFEST)
    if not (isinstance(ver, list) and len(ver) == 2 and all(v.is_int(x) and x >= 0 for x in ver)):
        raise M("version", "[int, int]", _show(ver))
    if ver[0] != 1:
        raise HsnapSpecError(UNSUPPORTED_VERSION, dname, "version", "[1, *]", _show(ver))
    for k in ("snapshot_id", "state_position", "tp_size", "ranks"):
        if k not in m:
            raise M(k, "present", "missing")
    v.str(m["snapshot_id"], "snapshot_id")
    v.int(m["state_position"], "state_position")
    tp = v.int(m["tp_size"], "tp_size", 1, 65536)  # spec 1.1 10.1
    ranks = m["ranks"]
    if not isinstance(ranks, list) or len(ranks) != tp:
        raise M("ranks", f"an array of {tp} objects", _show(ranks))
    for i, r in enumerate(ranks):
        f = f"ranks[{i}]"
        if not isinstance(r, dict) or set(r) != {"file", "length", "rank", "root_digest"}:
            raise M(f, 'exactly {"file", "length", "rank", "root_digest"}', _show(r))
        if r["rank"] != i or not v.is_int(r["rank"]):
            raise M(f"{f}.rank", i, _show(r["rank"]))
        if r["file"] != f"rank-{i}.hsnap":
            raise M(f"{f}.file", f"rank-{i}.hsnap", _show(r["file"]))
        v.int(r["length"], f"{f}.length")
        if not isinstance(r["root_digest"], str) or not HEX32_RE.fullmatch(r["root_digest"]):
            raise M(f"{f}.root_digest", "32 lowercase hex digits", _show(r["root_digest"]))
    return m, stored


# ---------------------------------------------------------------------------
# Chains (spec 5.9, 7.5; format 1.2)
# ---------------------------------------------------------------------------

CHAIN_ERROR = "ChainError"
BINDING = ("model_id", "weights_version", "weights_hash", "tp_size", "tp_rank")  # 5.1, with engine.*


@dataclass
class Chain:
    links: list[Snapshot]  # the plain snapshot first, the head last
    sections: dict  # name -> values of the head's sections at its position (7.5, "The head's sections")


def _identity_binding(ident: dict) -> dict:
    out = {k: ident.get(k, "" if k == "weights_hash" else None) for k in BINDING}
    out.update({f"engine.{k}": ident["engine"][k] for k in ("name", "version", "commit")})
    return out


def _geometry_meaning(geo: dict) -> dict:
    """geometry with the defaults of 5.2/5.6 applied (7.5 step 7 compares every field)."""
    g = {"attention": geo.get("attention"), "mamba": geo.get("mamba"), "start_layer": geo.get("start_layer", 0),
         "num_layers": geo.get("num_layers", 0), "sharding": geo.get("sharding")}
    if g["attention"] is not None:
        a = dict(g["attention"])
        for k, d in (("swa_layers", []), ("swa_window", None), ("kv_lora_rank", None), ("qk_rope_head_dim", None)):
            a.setdefault(k, d)
        a["layers"], a["swa_layers"] = sorted(a["layers"]), sorted(a["swa_layers"])
        g["attention"] = a
    if g["mamba"] is not None:
        m = dict(g["mamba"])
        m.setdefault("conv_slice_axis", 0)
        m["layers"] = sorted(m["layers"])
        g["mamba"] = m
    return g


def _check_link(base: Snapshot, delta: Snapshot, depth_named: int) -> None:
    """7.5 steps 5-7: the base found is the one the delta names, and the same request."""
    name = delta.file
    C = lambda fld, exp, found: HsnapSpecError(CHAIN_ERROR, name, fld, exp, found)  # noqa: E731
    ref = delta.header["base"]
    if base.root_digest.hex() != ref["root_digest"]:
        raise HsnapSpecError(DIGEST_MISMATCH, name, "base.root_digest", ref["root_digest"], base.root_digest.hex())
    bh, dh = base.header, delta.header
    bdepth = bh["base"]["depth"] if bh.get("base") is not None else 0
    for fld, want, got in (("base.snapshot_id", ref["snapshot_id"], bh["identity"].get("snapshot_id", "")),
                           ("base.state_position", ref["state_position"], bh["request"]["state_position"]),
                           ("base.depth", depth_named - 1, bdepth)):
        if want != got:
            raise C(fld, _show(want), _show(got))
    bi, di = _identity_binding(bh["identity"]), _identity_binding(dh["identity"])
    for k in bi:
        if bi[k] != di[k]:
            raise C(f"identity.{k}", _show(bi[k]), _show(di[k]))
    if _geometry_meaning(bh["geometry"]) != _geometry_meaning(dh["geometry"]):
        raise C("geometry", "the base's geometry", "another geometry")
    br, dr = bh["request"], dh["request"]
    if br["rid"] != dr["rid"]:
        raise C("request.rid", _show(br["rid"]), _show(dr["rid"]))
    if br["prompt_tokens"] != dr["prompt_tokens"]:
        raise C("request.prompt_tokens", br["prompt_tokens"], dr["prompt_tokens"])
    if base.section("request.prompt_ids")["digest"] != delta.section("request.prompt_ids")["digest"]:
        raise C("request.prompt_ids", "the base's prompt digest", "another")
    for k in ("output_tokens", "state_position", "swa_start"):
        if br.get(k, 0) > dr.get(k, 0):
            raise C(f"request.{k}", f">= {br.get(k, 0)}", dr.get(k, 0))


def _open_link(where: str, rank: int | None, verify: bool) -> Snapshot:
    if os.path.islink(where):  # spec 7.5 step 4 / 7.1 step 1: a base is never reached through a symbolic link
        raise HsnapSpecError(IO_ERROR, os.path.basename(where), "open", "not a symbolic link", "a symbolic link")
    if rank is None:
        if os.path.isdir(where):
            raise HsnapSpecError(CHAIN_ERROR, os.path.basename(where), "base.name", "a rank file", "a snapshot directory")
        return read_snapshot(where, verify=verify)
    if not os.path.isdir(where):
        raise HsnapSpecError(CHAIN_ERROR, os.path.basename(where), "base.name", "a snapshot directory", "a rank file")
    d = read_directory(where, verify=verify)
    return d.ranks[rank]


def read_chain(path, *, rank: int | None = None, verify: bool = True, max_depth: int = MAX_CHAIN_DEPTH) -> Chain:
    """Spec 7.5: the chain whose head is ``path`` (a rank file, or rank ``rank`` of a
    snapshot directory), opened link by link with steps 1-8, then (``verify``) every link
    verified head first and each base's output ids a prefix of its delta's (R-7.5-2), and
    the head's sections assembled from the links."""
    path = os.fspath(path).rstrip(os.sep)
    head = _open_link(path, rank, False)  # spec 7.5: every link check (3 reads a link) before any byte check
    links, where = [head], path
    if head.header.get("base") is not None and head.header["base"]["depth"] > max_depth:
        raise HsnapSpecError(CHAIN_ERROR, head.file, "base.depth", f"<= {max_depth}", head.header["base"]["depth"])
    seen = {os.path.basename(path)}
    snap = head
    while snap.header.get("base") is not None:
        ref = snap.header["base"]
        if ref["name"] in seen:  # step 2
            raise HsnapSpecError(CHAIN_ERROR, snap.file, "base.name", "a link not yet followed", f"{ref['name']!r}: a cycle")
        seen.add(ref["name"])
        where = os.path.join(os.path.dirname(where), ref["name"])  # beside the delta (its set directory)
        if not os.path.lexists(where):  # step 3
            raise HsnapSpecError(CHAIN_ERROR, snap.file, "base.name", f"{ref['name']!r} present", "missing")
        base = _open_link(where, rank, False)  # step 4
        _check_link(base, snap, ref["depth"])  # steps 5-7
        links.append(base)
        snap = base
    if verify:  # then every link verified (7.2), head first
        for link in links:
            verify_snapshot(link)
    links.reverse()
    if verify:
        for base, delta in zip(links, links[1:]):
            b = base.section("request.output_ids")["values"].tolist()
            d = delta.section("request.output_ids")["values"].tolist()
            if d[: len(b)] != b:
                raise HsnapSpecError(CHAIN_ERROR, delta.file, "request.output_ids", "the base's output ids first", "others")
    locations = []  # where each link was found (its file, or its set directory)
    where = path
    for link in reversed(links):
        locations.append(where)
        if link.header.get("base") is not None:
            where = os.path.join(os.path.dirname(where), link.header["base"]["name"])
    locations.reverse()
    for link, loc in zip(links, locations):
        if link.header.get("pages") is not None:
            _resolve_pages(link, loc, verify)
    sections = _head_sections(links) if verify else {}
    return Chain(links=links, sections=sections)


def _resolve_pages(link: Snapshot, location: str, verify: bool) -> None:
    """spec 7.6 for one link: its keys against its own token ids (R-7.6-1), then each page
    object found beside it against its reference (R-7.6-2), verified (R-7.6-3)."""
    pages = link.header["pages"]
    S = pages["page_size"]
    first, count = page_range(link.header, S)
    tokens = [int(t) for t in read_section_ints(link, "request.prompt_ids")] + [int(t) for t in read_section_ints(link, "request.output_ids")]
    negative = [q for q, t in enumerate(tokens[:(first + count) * S]) if t < 0]
    if negative:  # spec 5.10: keys are over u32 ids; a negative id has no key (R-7.6-1 refuses the first reference on it)
        q = negative[0]
        i = max(q // S - first, 0)
        raise HsnapSpecError(DIGEST_MISMATCH, link.file, f"pages.refs[{i}] (key of page {first + i})", pages["refs"][i][0], f"no key: token id {tokens[q]}")
    key = None
    keys = []
    for j in range(first + count):
        key = page_key(key, tokens[j * S:(j + 1) * S])
        keys.append(key)
    for i, (k, root) in enumerate(pages["refs"]):
        if keys[first + i] != k:
            raise HsnapSpecError(DIGEST_MISMATCH, link.file, f"pages.refs[{i}] (key of page {first + i})", k, keys[first + i])
    store = os.path.join(os.path.dirname(location), pages["store"])
    link.pages = []
    for i, (k, root) in enumerate(pages["refs"]):
        j = first + i
        p = os.path.join(store, f"{pages['namespace_id']}-{k}-{root}.hpage")
        if not os.path.lexists(p):
            raise HsnapSpecError(PAGE_ERROR, link.file, f"pages.refs[{i}]", "the page object", "missing")
        page = read_page(p, verify=False)
        if page.root_digest.hex() != root:
            raise HsnapSpecError(DIGEST_MISMATCH, link.file, f"pages.refs[{i}].root_digest", root, page.root_digest.hex())
        ph = page.header["page"]
        for fld, want, got in (("namespace_id", pages["namespace_id"], ph["namespace_id"]), ("index", j, ph["index"]),
                               ("key", k, ph["key"]), ("tokens", tokens[j * S:(j + 1) * S], ph["tokens"])):
            if want != got:
                raise HsnapSpecError(PAGE_ERROR, link.file, f"pages.refs[{i}].{fld}", _show(want), _show(got))
        if verify:  # after its reference's checks (spec 7.6)
            verify_snapshot(page)
        link.pages.append(page)


def read_section_ints(snap: Snapshot, name: str) -> list:
    s = snap.section(name)
    if "values" in s:
        return s["values"].tolist()
    raw = snap.raw_file[s["offset"]:s["offset"] + s["length"]]
    return list(struct.unpack(f"<{len(raw) // 4}i", raw))


def _link_rows(link: Snapshot, name: str) -> np.ndarray:
    """A link's rows of positions B .. P - 1 of a full-attention section: with pages (5.10),
    its own rows before its first page, the pages, its own rows after its last page."""
    vals = link.section(name)["values"]
    pages = getattr(link, "pages", None)
    if not pages:
        return vals
    S = link.header["pages"]["page_size"]
    first, count = page_range(link.header, S)
    B = base_position(link.header)
    head = first * S - B
    parts = [vals[:head]] + [p.section(name)["values"] for p in pages] + [vals[head:]]
    return np.concatenate(parts, axis=0)


def _head_sections(links: list[Snapshot]) -> dict:
    """7.5 "The head's sections": every section of 5.4 at the head's position."""
    head = links[-1]
    hreq = head.header["request"]
    S = hreq.get("swa_start", 0)
    out = {}
    for s in head.sections:
        kind = s["kind"]
        if kind not in ("attn_k", "attn_v", "mla_kv", "swa_k", "swa_v"):
            out[s["name"]] = s["values"]
            continue
        parts = []
        for link in links:
            B = base_position(link.header)
            first = max(B, link.header["request"].get("swa_start", 0)) if kind.startswith("swa") else B
            start = max(first, S) if kind.startswith("swa") else first
            vals = _link_rows(link, s["name"]) if kind in PAGED_KINDS else link.section(s["name"])["values"]
            parts.append(vals[start - first :])
        out[s["name"]] = np.concatenate(parts, axis=0)
    return out

