"""The format target of the mutation run: every golden vector under spec/vectors/, mutated by byte
and header-JSON operators (raw and re-signed), through the readers, the stats, the viewer's model
and the CLI; each mutant classified (the package's docstring lists the classes)."""

from __future__ import annotations

import contextlib
import copy
import io
import json
import os
import random
import re
import shutil
import struct
import traceback

import craft  # tests/craft.py: split, lay_out, resign, manifest_for
import hsnap_format
from hsnap_format import canonical
from hsnap_format.errors import HsnapError
from hsnap_format.spec import HEADER_OFFSET, KNOWN_FEATURES, PREAMBLE, align_up
from hsnap_format.tools import stats as _stats
from hsnap_format.tools import viewmodel as _viewmodel
from mutation import ROOT

VECTORS = os.path.join(ROOT, "spec", "vectors")
# the library as imported (a tree of an older commit on PYTHONPATH is judged as the library
# too): every hsnap_* package beside hsnap_format
_LIB_ROOT = os.path.dirname(os.path.dirname(hsnap_format.__file__))
LIB_DIRS = tuple(os.path.join(_LIB_ROOT, d) + os.sep for d in sorted(os.listdir(_LIB_ROOT))
                 if d.startswith("hsnap_") and os.path.isfile(os.path.join(_LIB_ROOT, d, "__init__.py")))
OK_CLASSES = ("typed", "accepted-unchanged", "accepted-valid")
FAIL_CLASSES = ("accepted-but-changed", "untyped", "hang", "cli-disagrees", "spec-disagrees", "harness-error")
CLASSES = OK_CLASSES + FAIL_CLASSES


# =============================================================================== inputs


def load_inputs(vectors: str = VECTORS) -> tuple[dict[str, bytes], dict[str, list[str]]]:
    """(name -> bytes, directory -> its member names). Names are relative to ``vectors``."""
    inputs, groups = {}, {}
    for name in sorted(os.listdir(vectors)):
        p = os.path.join(vectors, name)
        if name.endswith(".hsnap") and os.path.isfile(p):
            inputs[name] = read_file(p)
        elif os.path.isfile(os.path.join(p, "manifest.json")):
            members = ["manifest.json"] + sorted(n for n in os.listdir(p) if n.endswith(".hsnap"))
            groups[name] = members
            for m in members:
                inputs[f"{name}/{m}"] = read_file(os.path.join(p, m))
        elif os.path.isdir(p) and any(n.endswith(".hpage") for n in os.listdir(p)):  # a page store (spec 5.10)
            members = sorted(n for n in os.listdir(p) if n.endswith(".hpage"))
            groups[name] = members
            for m in members:
                inputs[f"{name}/{m}"] = read_file(os.path.join(p, m))
    return inputs, groups


def is_page(target: str) -> bool:
    """A page object of a page store vector (spec 5.11): examined by :func:`_page_library`."""
    return target.endswith(".hpage")


def read_file(path: str) -> bytes:
    with open(path, "rb") as f:
        return f.read()


def is_manifest(target: str) -> bool:
    return target.endswith("manifest.json")


# ============================================================================ palettes

_INT_LITERALS = [
    "0", "1", "-1", "2", "3", "7", "8", "255", "256", "4095", "4096", "4097", "65535", "65536", "65537",
    "1048576", "1048577", "2147483647", "2147483648", "4294967295", "4294967296", "4294967297",
    "1099511627775", "1099511627776", "9007199254740991", "9007199254740992", "9007199254740993",
    "-9007199254740991", "-9007199254740992", "-9007199254740993", "18446744073709551615",
    "18446744073709551616", "100000000000000000000", "1000000000000000000000", "-0", "00", "01", "+1",
] + [d * n for d in ("1", "9") for n in (22, 307, 308, 309, 310, 350, 399, 400, 401, 600)] + [
    "-" + "9" * n for n in (308, 309, 350, 400, 401)
] + ["1" + "0" * n for n in (308, 309, 399, 400)]
_FLOAT_LITERALS = [
    "0.5", "-0.5", "1.5", "0.1", "1e-7", "0.000001", "1e+21", "1e21", "1E21", "1e400", "-1e400", "1e-400",
    "-0.0", "0.0", "1.0", "5e-324", "2.5e-324", "1e-323", "1.7976931348623157e+308", "1.7976931348623159e+308",
    "1e308", "-1e308", "1.5e300", ".5", "5.", "1e", "1e+", "NaN", "Infinity", "-Infinity", "1_0", "0x10", "1.0e+2",
    "4096.0", "4096e0", "0.7000000000000001", "1" + "0" * 400 + ".0", "0." + "0" * 400 + "1", "1e" + "9" * 30,
    "1e-" + "9" * 30,
]
NUMBER_LITERALS = _INT_LITERALS + _FLOAT_LITERALS

# string literals as raw JSON text (hex: not UTF-8 on purpose)
STRING_LITERALS = [
    {"text": '"\\u0041"'}, {"text": '"\\/"'}, {"text": '"\\ud800"'}, {"text": '"\\udc00\\ud800"'},
    {"text": '"\\ud83d\\ude00"'}, {"text": '"\\u00e9"'}, {"text": '"\\x41"'}, {"text": '"\\U00000041"'},
    {"text": '"\t"'}, {"text": '"\\t"'}, {"text": '"\\u0009"'}, {"text": '"\\u001f"'}, {"text": '"\\u001F"'},
    {"text": '"\\u007f"'}, {"text": '"\x7f"'}, {"text": '"abc'}, {"text": "'abc'"}, {"text": '"\\u0000"'},
    {"text": '"\u2028"'}, {"text": '"\\u2028"'}, {"text": '"\ufeff"'}, {"text": '"' + "a" * 4097 + '"'},
    {"hex": b'"\xc0\xaf"'.hex()}, {"hex": b'"\xed\xa0\x80"'.hex()}, {"hex": b'"\xff"'.hex()},
    {"hex": b'"\xef\xbb\xbf"'.hex()}, {"hex": b'"\xf4\x90\x80\x80"'.hex()}, {"hex": b'"\xe2\x80"'.hex()},
]

PALETTE = [
    None, True, False, 0, 1, -1, 2, 7, 0.5, -0.0, 1e-7, 1e21, 2**53 - 1, -(2**53 - 1), 2**31, 2**32, 2**40, 2**40 - 1,
    65535, 65536, 4096, "", "x", "0", "1", "hsnap", "hsnap-manifest", "xxh3-128", "bfloat16", "float32", "uint8", "bool",
    "float8_e4m3fn", "conv", "temporal", "rng_state", "attn_k", "mla_kv", "swa_k", "prompt_ids", "mha", "mla", "swa",
    "rank-0.hsnap", "rank-1.hsnap", "../rank-0.hsnap", "/etc/passwd", "a" * 4097, "\u00e9", "\u2028", "\x00",
    "\x1b[31m", "line\nbreak", "back\\slash", "sampler-rng-state", "top-logprobs", "zzz-unknown", "0" * 32, "f" * 32,
    [], {}, [None], [1, 2], ["a"], [[1]], [0] * 9, [2**40], [1.5], [True], ["sampler-rng-state"], {"a": 1}, {"": None},
    {"required": [], "optional": []}, {"name": "x"}, [[6, 3]], [1, 1, 1, 1, 1, 1, 1, 1],
]
NEW_KEYS = ["zzz", "x-extra", "A", "", " ", "layer", "digest", "offset", "kind", "swa_start", "attention", "format",
            "version", "sections", "required", "optional", "rank", "name", "numerics", "mamba"]
KEY_LITERALS = ['"\\u0041"', '"\u00e9"', '"\\ud800"', '"a\\u0000"', '"\\/"']
INTERESTING_BYTES = [0x00, 0x01, 0x7F, 0x80, 0xFF, 0x20, 0x22, 0x2C, 0x2D, 0x2E, 0x30, 0x31, 0x39, 0x3A, 0x5B, 0x5C,
                     0x5D, 0x65, 0x7B, 0x7D, 0x0A, 0x0D, 0x09, 0x41, 0x61, 0x66]
# (offset, size) of the integer fields of the preamble and (from the trailer's start) the trailer
PREAMBLE_INTS = [(8, 2), (10, 2), (12, 4), (16, 8), (24, 8), (48, 8)]
TRAILER_INTS = [(8, 8), (16, 8), (40, 8), (48, 8)]


# ====================================================================== JSON operators


def _walk(obj, path=()):
    yield path, obj
    if isinstance(obj, dict):
        for k, v in obj.items():
            yield from _walk(v, path + (k,))
    elif isinstance(obj, list):
        for i, v in enumerate(obj):
            yield from _walk(v, path + (i,))


def _nodes(obj, pred=lambda v: True, root=True):
    return [(list(p), v) for p, v in _walk(obj) if (root or p) and pred(v)]


def _is_num(v):
    return isinstance(v, (int, float)) and not isinstance(v, bool)


_SEMANTIC = ("identity", "geometry", "request", "features")


def _pick_node(rng, obj, pred=lambda v: True, root=False, prefer=None):
    """A random (path, value); half the time among ``prefer``-red paths (default: the
    identity/geometry/request/features objects, which the many table nodes would drown)."""
    nodes = _nodes(obj, pred, root)
    prefer = prefer or (lambda path: bool(path) and path[0] in _SEMANTIC)
    if rng.random() < 0.5:
        nodes = [n for n in nodes if prefer(n[0])] or nodes
    return rng.choice(nodes) if nodes else None


def _feature_list(path):
    return len(path) >= 1 and path[0] == "features"


def j_number(rng, obj):
    node = _pick_node(rng, obj, _is_num) if rng.random() < 0.85 else None
    node = node or _pick_node(rng, obj)
    if node is None:
        return []
    path, v = node
    if _is_num(v) and isinstance(v, int) and rng.random() < 0.4:  # nearby values reach the cross-field rules
        new = rng.choice([v + 1, v - 1, v + 2, v - 64, v + 64, v + 4096, v - 4096, v * 2, v // 2, -v, 0, 1])
        if abs(new) <= canonical.MAX_SAFE_INTEGER:
            return [{"op": "j.set", "path": path, "value": new}]
    return [{"op": "j.lit", "path": path, "text": rng.choice(NUMBER_LITERALS)}]


def j_type(rng, obj):
    node = _pick_node(rng, obj)
    return [] if node is None else [{"op": "j.set", "path": node[0], "value": rng.choice(PALETTE)}]


def j_list(rng, obj):
    node = _pick_node(rng, obj, lambda v: isinstance(v, list), prefer=_feature_list)
    if node is None:
        return []
    path, lst = node
    action = rng.choice(["replace", "append", "insert", "dup", "remove", "empty", "reverse"])
    value = rng.choice(PALETTE)
    if action in ("replace", "dup", "remove") and not lst:
        action = "append"
    i = rng.randrange(len(lst)) if lst else 0
    if action == "replace":
        return [{"op": "j.set", "path": path + [i], "value": value}]
    if action == "append":
        return [{"op": "j.ins", "path": path, "at": len(lst), "value": value}]
    if action == "insert":
        return [{"op": "j.ins", "path": path, "at": i, "value": value}]
    if action == "dup":
        return [{"op": "j.ins", "path": path, "at": i, "value": copy.deepcopy(lst[i])}]
    if action == "remove":
        return [{"op": "j.del", "path": path + [i]}]
    if action == "empty":
        return [{"op": "j.set", "path": path, "value": []}]
    return [{"op": "j.set", "path": path, "value": list(reversed(lst))}]


def j_add_key(rng, obj):
    node = _pick_node(rng, obj, lambda v: isinstance(v, dict), root=True)
    if node is None:
        return []
    if rng.random() < 0.2:
        return [{"op": "j.addlit", "path": node[0], "key": rng.choice(KEY_LITERALS), "value": rng.choice(PALETTE)}]
    return [{"op": "j.add", "path": node[0], "key": rng.choice(NEW_KEYS), "value": rng.choice(PALETTE)}]


def j_del_key(rng, obj):
    node = _pick_node(rng, obj, lambda v: isinstance(v, dict) and v, root=True)
    return [] if node is None else [{"op": "j.del", "path": node[0] + [rng.choice(sorted(node[1]))]}]


def j_dup_key(rng, obj):
    node = _pick_node(rng, obj, lambda v: isinstance(v, dict) and v, root=True)
    if node is None:
        return []
    key = rng.choice(sorted(node[1]))
    value = copy.deepcopy(node[1][key]) if rng.random() < 0.5 else rng.choice(PALETTE)
    return [{"op": "j.addlit", "path": node[0], "key": json.dumps(key), "value": value}]


def j_deep(rng, obj):
    node = _pick_node(rng, obj)
    if node is None:
        return []
    d = rng.choice([15, 16, 17, 20, 64, 65, 100, 1000, 10000, 100000])
    text = rng.choice(["[" * d + "]" * d, '{"a":' * d + "0" + "}" * d, "[" * d, "[" * d + "1" + "]" * d, "[{" * (d // 2) + "}]" * (d // 2)])
    return [{"op": "j.lit", "path": node[0], "text": text}]


def j_unicode(rng, obj):
    node = _pick_node(rng, obj, lambda v: isinstance(v, str)) or _pick_node(rng, obj)
    if node is None:
        return []
    if rng.random() < 0.35:  # valid, canonical, odd strings: the semantic checks must hold
        return [{"op": "j.set", "path": node[0], "value": rng.choice(["\u00e9", "\u2028", "\x00", "\x1b]0;x\x07", "a" * 4097,
                                                                   "\U0001f6d1", "\ud7ff", "\ufffd", "rank-0.hsnap/..", "é" * 5000])}]
    return [dict({"op": "j.lit", "path": node[0]}, **rng.choice(STRING_LITERALS))]


def j_swap(rng, obj):
    node = _pick_node(rng, obj, lambda v: isinstance(v, (list, dict)) and len(v) >= 2, root=True)
    if node is None:
        return []
    path, v = node
    keys = list(range(len(v))) if isinstance(v, list) else sorted(v)
    a, b = rng.sample(keys, 2)
    return [{"op": "j.swap", "path": path, "a": a, "b": b}]


def j_copy(rng, obj):
    dst, src = _pick_node(rng, obj), _pick_node(rng, obj)
    if dst is None or src is None or dst[0][: len(src[0])] == src[0]:
        return []
    return [{"op": "j.copy", "path": dst[0], "from": src[0]}]


def j_text(rng, obj):
    n = len(canonical.dumps(obj)) if _encodable(obj) else 2000
    at = rng.randrange(n + 1)
    edit = rng.choice([
        {"del": 0, "hex": b" ".hex()}, {"del": 0, "hex": b"\n".hex()}, {"del": 1, "hex": ""}, {"del": 1, "hex": b"0".hex()},
        {"del": 0, "hex": b",".hex()}, {"del": 0, "hex": b"\xef\xbb\xbf".hex()}, {"del": 1, "hex": b"A".hex()},
        {"del": 0, "hex": b"\x00".hex()}, {"del": 2, "hex": ""}, {"del": 1, "hex": b"}".hex()}, {"del": 1, "hex": b"\"".hex()},
    ])
    if rng.random() < 0.2:
        at = rng.choice([0, n])  # BOM before, newline after
    return [dict({"op": "j.text", "at": at}, **edit)]


def _encodable(obj) -> bool:
    try:
        canonical.dumps(obj)
        return True
    except canonical.CanonicalError:
        return False


# ====================================================================== byte operators


def _regions(data: bytes, target: str):
    """(start, end) ranges to aim at, with weights: structure first."""
    n = len(data)
    if is_manifest(target) or n < 128:
        nl = data.find(b"\n")
        return [((0, n), 3), ((max(0, nl - 2), min(n, nl + 44)), 1)] if nl >= 0 else [((0, n), 1)]
    hlen, doff = struct.unpack_from("<QQ", data, 16)
    hend = min(n, HEADER_OFFSET + hlen)
    return [((0, 64), 4), ((64, hend), 3), ((hend, max(hend, n - 64)), 2), ((n - 64, n), 3)]


def _pos(rng, data, target):
    if not data:
        return 0
    regions = _regions(data, target)
    (a, b), _ = rng.choices(regions, weights=[w for _, w in regions])[0]
    return rng.randrange(a, b) if b > a else rng.randrange(len(data))


def b_flip(rng, data, target):
    return [{"op": "b.flip", "bit": _pos(rng, data, target) * 8 + rng.randrange(8)}]


def b_byte(rng, data, target):
    return [{"op": "b.set", "at": _pos(rng, data, target), "value": rng.choice(INTERESTING_BYTES)}]


def b_int(rng, data, target):
    n = len(data)
    if is_manifest(target) or n < 128:
        at, size = _pos(rng, data, target), rng.choice([1, 2, 4, 8])
        old = 0
    else:
        if rng.random() < 0.6:
            at, size = rng.choice(PREAMBLE_INTS)
        else:
            off, size = rng.choice(TRAILER_INTS)
            at = n - 64 + off
        old = int.from_bytes(data[at : at + size], "little")
    bits = 8 * size
    value = rng.choice([0, 1, 2, old + 1, old - 1, old + 64, old - 64, old + 4096, old - 4096, old * 2, old // 2, n, n - 64,
                        n + 64, 1 << 20, (1 << 20) + 1, 1 << (bits - 1), (1 << bits) - 1, (1 << 16) - 1, 1 << 31, 1 << 32])
    return [{"op": "b.int", "at": at, "size": size, "value": value % (1 << bits)}]


def b_truncate(rng, data, target):
    n = len(data)
    hlen = struct.unpack_from("<Q", data, 16)[0] if n >= 64 and not is_manifest(target) else 0
    cand = [0, 1, 7, 8, 9, 63, 64, 65, 64 + hlen - 1, 64 + hlen, n - 65, n - 64, n - 63, n - 1, rng.randrange(n + 1)]
    return [{"op": "b.trunc", "len": max(0, min(n, rng.choice(cand)))}]


def b_extend(rng, data, target):
    n = rng.choice([1, 7, 63, 64, 65, 4096, rng.randrange(1, 200)])
    kind = rng.choice(["zero", "byte", "random", "tail"])
    if kind == "tail":
        return [{"op": "b.dupchunk", "at": max(0, len(data) - 64), "n": 64, "to": len(data)}]
    if kind == "random":
        return [{"op": "b.ins", "at": len(data), "hex": rng.randbytes(min(n, 256)).hex()}]
    return [{"op": "b.ins", "at": len(data), "fill": 0 if kind == "zero" else rng.choice(INTERESTING_BYTES), "n": n}]


def _chunk(rng, data, target):
    at = _pos(rng, data, target)
    n = rng.choice([1, 2, 3, 4, 8, 16, 64, 100, 4096, rng.randrange(1, max(2, len(data) // 4))])
    return at, max(1, min(n, len(data) - at))


def b_chunk_del(rng, data, target):
    at, n = _chunk(rng, data, target)
    return [{"op": "b.del", "at": at, "n": n}]


def b_chunk_dup(rng, data, target):
    at, n = _chunk(rng, data, target)
    return [{"op": "b.dupchunk", "at": at, "n": n, "to": at + n}]


def b_chunk_ins(rng, data, target):
    at = _pos(rng, data, target)
    if rng.random() < 0.5:
        return [{"op": "b.ins", "at": at, "hex": rng.randbytes(rng.choice([1, 2, 4, 8, 32])).hex()}]
    return [{"op": "b.ins", "at": at, "fill": rng.choice(INTERESTING_BYTES), "n": rng.choice([1, 4, 64, 4096])}]


def b_chunk_copy(rng, data, target):
    at, n = _chunk(rng, data, target)
    return [{"op": "b.copy", "at": at, "n": n, "to": _pos(rng, data, target)}]


# name -> (family, weight, generator). JSON operators edit the header object (of a rank
# file) or the manifest's first line; byte operators edit the bytes.
OPERATORS = {
    "j_number": ("json", 10, j_number),
    "j_type": ("json", 6, j_type),
    "j_list": ("json", 6, j_list),
    "j_add_key": ("json", 4, j_add_key),
    "j_del_key": ("json", 4, j_del_key),
    "j_dup_key": ("json", 3, j_dup_key),
    "j_deep": ("json", 2, j_deep),
    "j_unicode": ("json", 4, j_unicode),
    "j_swap": ("json", 3, j_swap),
    "j_copy": ("json", 3, j_copy),
    "j_text": ("json", 3, j_text),
    "b_flip": ("byte", 8, b_flip),
    "b_byte": ("byte", 5, b_byte),
    "b_int": ("byte", 8, b_int),
    "b_truncate": ("byte", 3, b_truncate),
    "b_extend": ("byte", 3, b_extend),
    "b_chunk_del": ("byte", 3, b_chunk_del),
    "b_chunk_dup": ("byte", 3, b_chunk_dup),
    "b_chunk_ins": ("byte", 3, b_chunk_ins),
    "b_chunk_copy": ("byte", 2, b_chunk_copy),
}
_OP_NAMES = list(OPERATORS)
_OP_WEIGHTS = [OPERATORS[n][1] for n in _OP_NAMES]


# ================================================================== applying the ops


_SENTINEL = "@@hsnap-mutant-{}@@"


class _JsonState:
    """A header (or manifest) object under JSON ops; literal text stands in for sentinels."""

    def __init__(self, obj):
        self.root = [copy.deepcopy(obj)]
        self.literals: dict[str, bytes] = {}
        self.text_edits: list[dict] = []

    def _lit(self, raw: bytes) -> str:
        s = _SENTINEL.format(len(self.literals))
        self.literals[s] = raw
        return s

    def _parent(self, path):
        node, full = self.root, [0] + list(path)
        for k in full[:-1]:
            if isinstance(node, dict) and isinstance(k, str) and k in node:
                node = node[k]
            elif isinstance(node, list) and isinstance(k, int) and 0 <= k < len(node):
                node = node[k]
            else:
                return None, None
        k = full[-1]
        ok = (isinstance(node, dict) and isinstance(k, str) and k in node) or (isinstance(node, list) and isinstance(k, int) and 0 <= k < len(node))
        return (node, k) if ok else (None, None)

    def get(self, path):
        parent, k = self._parent(path)
        return (True, parent[k]) if parent is not None else (False, None)

    def apply(self, op) -> None:
        """Apply one op; an op whose path no longer exists (a dropped earlier op) is skipped."""
        kind = op["op"]
        if kind == "j.text":
            self.text_edits.append(op)
            return
        parent, k = self._parent(op["path"])
        if parent is None:
            return
        if kind == "j.set":
            parent[k] = copy.deepcopy(op["value"])
        elif kind == "j.lit":
            parent[k] = self._lit(op["text"].encode("utf-8", "surrogatepass") if "text" in op else bytes.fromhex(op["hex"]))
        elif kind == "j.del":
            del parent[k]
        elif kind == "j.ins" and isinstance(parent[k], list):
            parent[k].insert(min(op["at"], len(parent[k])), copy.deepcopy(op["value"]))
        elif kind == "j.add" and isinstance(parent[k], dict):
            parent[k][op["key"]] = copy.deepcopy(op["value"])
        elif kind == "j.addlit" and isinstance(parent[k], dict):
            # an ASCII placeholder key whose text becomes op["key"] (duplicate, escaped, non-ASCII)
            placeholder = self._lit(op["key"].encode("utf-8", "surrogatepass"))
            parent[k][placeholder] = copy.deepcopy(op["value"])
        elif kind == "j.swap":
            v = parent[k]
            a, b = op["a"], op["b"]
            if isinstance(v, list) and isinstance(a, int) and isinstance(b, int) and max(a, b) < len(v):
                v[a], v[b] = v[b], v[a]
            elif isinstance(v, dict) and a in v and b in v:
                v[a], v[b] = v[b], v[a]
        elif kind == "j.copy":
            found, value = self.get(op["from"])
            if found:
                parent[k] = copy.deepcopy(value)

    def encode(self, shift: int = 0) -> bytes:
        """The text: canonical encoding (table offsets moved by ``shift``), literals in place, text edits."""
        obj = self.root[0]
        try:
            text = craft._encode(obj, shift) if isinstance(obj, dict) else canonical.dumps(obj)
        except canonical.CanonicalError:  # e.g. nesting beyond 64 from stacked ops: plain sorted JSON
            text = json.dumps(obj, sort_keys=True, separators=(",", ":"), ensure_ascii=False).encode("utf-8", "surrogatepass")
        for s, raw in self.literals.items():
            text = text.replace(json.dumps(s).encode(), raw)
        for e in self.text_edits:
            at = min(e["at"], len(text))
            text = text[:at] + bytes.fromhex(e["hex"]) + text[at + e["del"] :]
        return text


def _header_after_json_ops(data: bytes, ops, resign: bool) -> bytes:
    p = craft.split(data)
    st = _JsonState(json.loads(p.header))
    for op in ops:
        st.apply(op)
    if not resign:  # raw: the new header in place, every check and length stale
        hb = st.encode(0)
        return craft.lay_out(data, hb, max(p.data_offset, align_up(HEADER_OFFSET + len(hb))), honest_lengths=False)
    d1 = p.data_offset
    while True:  # the data moves to the next multiple of 4096 when the header outgrows it
        hb = st.encode(d1 - p.data_offset)
        need = align_up(HEADER_OFFSET + len(hb))
        if need <= d1:
            return craft.lay_out(data, hb, d1)
        d1 = need


def _manifest_after_json_ops(data: bytes, ops) -> bytes:
    line1, _, rest = data.partition(b"\n")
    st = _JsonState(json.loads(line1))
    for op in ops:
        st.apply(op)
    return st.encode(0) + b"\n" + rest


def apply_byte_op(data: bytes, op) -> bytes:
    n, kind = len(data), op["op"]
    if kind == "b.trunc":
        return data[: min(op["len"], n)]
    if kind == "b.ins":
        at = min(op["at"], n)
        chunk = bytes.fromhex(op["hex"]) if "hex" in op else bytes([op["fill"]]) * op["n"]
        return data[:at] + chunk + data[at:]
    if n == 0:
        return data
    if kind == "b.flip":
        bit = op["bit"] % (8 * n)
        b = bytearray(data)
        b[bit // 8] ^= 1 << (bit % 8)
        return bytes(b)
    if kind == "b.set":
        b = bytearray(data)
        b[op["at"] % n] = op["value"]
        return bytes(b)
    if kind == "b.int":
        at, size = op["at"] % n, op["size"]
        if at + size > n:
            return data
        return data[:at] + int(op["value"]).to_bytes(size, "little") + data[at + size :]
    at = op["at"] % n
    m = min(op["n"], n - at)
    if kind == "b.del":
        return data[:at] + data[at + m :]
    if kind == "b.dupchunk":
        to = min(op["to"], n)
        return data[:to] + data[at : at + m] + data[to:]
    if kind == "b.copy":
        to = op["to"] % n
        chunk = data[at : at + m][: n - to]
        return data[:to] + chunk + data[to + len(chunk) :]
    raise ValueError(f"unknown byte op {kind!r}")


def build(desc: dict, inputs: dict[str, bytes], groups: dict[str, list[str]]) -> dict[str, bytes]:
    """The mutant's files: {relative name: bytes} (one file, or a whole snapshot directory)."""
    target, resign = desc["target"], desc["resign"]
    data = inputs[target]
    jops = [o for o in desc["ops"] if o["op"].startswith("j.")]
    bops = [o for o in desc["ops"] if o["op"].startswith("b.")]
    if jops:
        data = _manifest_after_json_ops(data, jops) if is_manifest(target) else _header_after_json_ops(data, jops, resign)
    for op in bops:
        data = apply_byte_op(data, op)
    if resign:
        data = craft.resign_manifest(data) if is_manifest(target) else craft.resign(data)
    group, _, member = target.rpartition("/")
    if not group:
        return {target: data}
    files = {f"{group}/{m}": inputs[f"{group}/{m}"] for m in groups[group]}
    files[target] = data
    m = re.fullmatch(r"rank-(\d+)\.hsnap", member)
    if resign and m:  # the directory is re-signed too: the manifest binds the mutated rank
        files[f"{group}/manifest.json"] = craft.manifest_for(files[f"{group}/manifest.json"], int(m.group(1)), data)
    return files


# ======================================================================== generation


def draw(rng, target: str, inputs, groups):
    names = [rng.choices(_OP_NAMES, _OP_WEIGHTS)[0] for _ in range(rng.randint(2, 4) if rng.random() < 1 / 7 else 1)]
    names.sort(key=lambda n: OPERATORS[n][0] != "json")  # JSON ops apply first (build)
    ops: list[dict] = []
    data = inputs[target]
    obj = json.loads(data.partition(b"\n")[0] if is_manifest(target) else craft.split(data).header)
    st = _JsonState(obj)
    for k, name in enumerate(names):
        family, _, gen = OPERATORS[name]
        if family == "byte" and (k == 0 or OPERATORS[names[k - 1]][0] == "json") and ops:
            data = build({"target": target, "resign": False, "ops": ops}, inputs, groups)[target]  # byte ops aim at the bytes the JSON ops left
        new = []
        for _ in range(8):  # an operator with nothing to act on draws again
            new = gen(rng, st.root[0]) if family == "json" else gen(rng, data, target)
            if new:
                break
        for op in new:
            if family == "json":
                st.apply(op)
            else:
                data = apply_byte_op(data, op)
        ops += new
    return names, ops


def generate(seed: int, i: int, inputs: dict[str, bytes], groups) -> dict:
    """Mutant ``i`` of run ``seed``: a JSON description (target, operator, ops, variant)."""
    rng = random.Random(f"hsnap-mutate:{seed}:{i // 2}")
    target = rng.choice(sorted(inputs))
    for _attempt in range(8):  # a mutation that leaves the bytes as they were is drawn again
        names, ops = draw(rng, target, inputs, groups)
        if build({"target": target, "resign": False, "ops": ops}, inputs, groups)[target] != inputs[target]:
            break
    return {"i": i, "seed": seed, "target": target, "operator": names[0] if len(names) == 1 else "stacked",
            "operators": names, "resign": bool(i % 2), "ops": ops}


# ===================================================================== examination


class Hang(BaseException):
    """The in-process time limit (jobs=0) ran out."""


class Context:
    """Per-process state: inputs, scratch directory, the vectors written once for diff."""

    def __init__(self, scratch: str, *, cli_every: int = 10, independent: bool = True) -> None:
        self.inputs, self.groups = load_inputs()
        self.scratch = scratch
        self.cli_every = cli_every
        os.makedirs(scratch, exist_ok=True)
        self.orig = os.path.join(scratch, "orig")
        for name, data in self.inputs.items():
            p = os.path.join(self.orig, name)
            os.makedirs(os.path.dirname(p), exist_ok=True)
            if not os.path.exists(p):
                with open(p, "wb") as f:
                    f.write(data)
        self.ind = None
        if independent:
            try:
                import independent_reader

                self.ind = independent_reader
            except ImportError:
                pass

    def write(self, files: dict[str, bytes]) -> str:
        """Write the mutant under scratch/m/ and return the path to open; a link of a chain
        vector (spec 5.9) gets the other links of its chain beside it, as they are."""
        base = os.path.join(self.scratch, "m")
        if os.path.isdir(base):
            shutil.rmtree(base)
        top = {n.split("/")[0] for n in files}
        links = _chain_links(top) - top
        for name, data in [*files.items(), *((n, d) for n, d in self.inputs.items() if n.split("/")[0] in links)]:
            p = os.path.join(base, name)
            os.makedirs(os.path.dirname(p), exist_ok=True)
            with open(p, "wb") as f:
                f.write(data)
        return os.path.join(base, top.pop())


_CHAINS: list[set[str]] = []


def _chain_links(tops: set[str]) -> set[str]:
    """The files and directories of every chain vector (spec/vectors/*.json with ``links``) that has one of ``tops``;
    and of a paged vector (``snapshots``, spec 5.10), its page store."""
    if not _CHAINS:
        for name in sorted(os.listdir(VECTORS)):
            if name.endswith(".json"):
                with open(os.path.join(VECTORS, name), encoding="utf-8") as f:
                    desc = json.load(f)
                _CHAINS.append({d.get("file") or d.get("directory") for d in desc.get("links", [])})
                if "snapshots" in desc:
                    _CHAINS.append({d["file"] for d in desc["snapshots"]} | {desc["store"]})
    return set().union(*(links for links in _CHAINS if links & tops))


def _chain_verifies(snap, path: str) -> bool:
    """What ``hsnap verify`` adds for a delta (spec 7.5): its chain opens, every link below
    verifies and each base's output is a prefix of its delta's; for a file that references
    pages (spec 7.6), every reference holds and every page verifies."""
    from hsnap_format.chain import chain_below
    from hsnap_format.stores import store_for

    for r, s in (snap.ranks.items() if hasattr(snap, "ranks") else [(None, snap)]):
        if s.base is None and s.pages is None:
            continue
        try:
            with chain_below(s, location=snap.path, rank=r, store=store_for(path)) as chain:
                if chain.proof_failures(first=True):  # the one proof of a chain (restore, verify, compact)
                    return False
        except HsnapError:
            return False
    return True


def _where(tb) -> tuple[str, bool]:
    """'file:line func' of the deepest frame in the library (True), else of the deepest frame (False)."""
    frames = traceback.extract_tb(tb)
    lib = [f for f in frames if f.filename.startswith(LIB_DIRS)]
    f = (lib or frames or [None])[-1]
    if f is None:
        return "?", False
    return f"{os.path.relpath(f.filename, ROOT)}:{f.lineno} {f.name}", bool(lib)


def untyped(e: BaseException, stage: str) -> dict:
    """An exception that is not an HsnapError: the library's finding when any frame is the
    library's (it let the exception through), else the harness's own failure."""
    where, in_lib = _where(e.__traceback__)
    cls = "untyped" if in_lib or isinstance(e, (MemoryError, RecursionError)) else "harness-error"
    return {"cls": cls, "stage": stage, "error": type(e).__name__, "where": where, "message": str(e)[:300],
            "traceback": "".join(traceback.format_exception(type(e), e, e.__traceback__))[-4000:]}


def _ranks(snap):
    return list(snap.ranks.values()) if hasattr(snap, "ranks") else [snap]


def _typed(e: HsnapError, stage: str) -> dict:
    msg = str(e)
    r = {"cls": "typed", "stage": stage, "error": type(e).__name__, "field": field_label(e.field)}
    if "\n" in msg or "\r" in msg:  # spec 7.3: one line, "file: field: expected X, found Y"
        r["note"] = "multi-line message"
    elif not e.path or not msg.startswith(e.path):
        r["note"] = "message does not start with the file"
    return r


# which layer of checks a refusal came from: the first name of its field
_LAYERS = {"preamble": "framing", "trailer": "framing", "file_length": "framing", "magic": "framing", "path": "framing",
           "header_length": "framing", "header": "json", "body": "json", "lines": "manifest", "manifest": "manifest",
           "sections": "table", "identity": "identity", "geometry": "geometry", "request": "request"}


def layer_of(error: str, field: str) -> str:
    if error == "DigestMismatchError":
        return "integrity"
    if error == "MalformedManifestError":
        return "manifest"
    head = re.split(r"[.\[ (]", field, maxsplit=1)[0]
    if head == "header" and field.startswith("header."):  # header.features.required, header.format...
        return "features"
    return _LAYERS.get(head, "framing" if error in ("TruncatedError", "BadMagicError", "UnsupportedVersionError") else "other")


def field_label(field) -> str:
    """The field with indices and names folded, for counting which checks refuse."""
    text = re.sub(r"\[[^\]]*\]", "[]", str(field))
    return re.sub(r"\d+", "N", text)[:60]


def examine(desc: dict, ctx: Context, *, cli: bool | None = None) -> dict:
    """Build, write and read one mutant; classify what came out."""
    try:
        files = build(desc, ctx.inputs, ctx.groups)
        path = ctx.write(files)
    except Exception as e:  # noqa: BLE001 - the script's own failure
        r = untyped(e, "build")
        r["cls"] = "harness-error"
        return r
    if cli is None:
        cli = ctx.cli_every > 0 and desc["i"] % ctx.cli_every == 0
    if is_page(desc["target"]):  # a page object: its own reader (spec 5.11), and the snapshots that reference it
        page_path = os.path.join(os.path.dirname(path), desc["target"])
        result = _page_library(page_path, files, desc, ctx)
        if result["cls"] == "typed" and ctx.ind is not None:
            result = _page_spec_reader_agrees(page_path, result, ctx)
        verdicts = result.pop("references", {})
        if cli and result["cls"] in OK_CLASSES + ("typed",):
            for snap_path, ok in verdicts.items():  # hsnap verify of each referencing snapshot verifies its pages (R-7.6-3)
                c = _cli_verify(snap_path, ok)
                if c is not None:
                    result = dict(result, **c)
                    if c.get("cls"):
                        break
        result.pop("verify_ok", None)
        return result
    result = _library(path, files, desc, ctx)
    if result["cls"] == "typed":
        result = _spec_reader_agrees(path, result, ctx)
    if cli and result["cls"] in OK_CLASSES:
        c = _cli(path, desc, ctx, accepted_verify=result.get("verify_ok", False))
        if c is not None:
            result = dict(result, **c)
    result.pop("verify_ok", None)
    return result


def _spec_reader_agrees(path: str, result: dict, ctx: Context) -> dict:
    """A refusal the spec-only reader does not share is a reader stricter than its spec, or a
    spec silent where the reader decides: both are findings."""
    if ctx.ind is None:
        return result
    try:
        (ctx.ind.read_directory if os.path.isdir(path) else ctx.ind.read_snapshot)(path)
    except ctx.ind.HsnapSpecError as e:
        if result["stage"] != "open" or e.kind == result["error"]:
            return result
        why = f"refused at open as {result['error']} ({result['field']}), by the independent reader as {e.kind} ({e.field})"
    except Exception as e:  # noqa: BLE001 - the independent reader is test code: its crash is ours
        return dict(untyped(e, "independent reader"), cls="harness-error")
    else:
        why = f"refused as {result['error']} ({result['field']}) at {result['stage']}, accepted by the independent reader"
    return dict(result, cls="spec-disagrees", reason=why)


def _page_library(path: str, files: dict[str, bytes], desc: dict, ctx: Context) -> dict:
    """A page object: open (spec 5.11), verify, every section read (hashed and not); then every
    paged vector beside it checks its references and verifies its pages (spec 7.6) — a refusal
    there is expected of a changed page, an untyped error is a finding. Accepted and changed:
    re-signed only, and the page the reference encoder writes from its decoded content, which
    the independent reader accepts too."""
    from hsnap_format.pages import encode_page, open_page

    try:
        page = open_page(path)
    except HsnapError as e:
        try:
            return dict(_typed(e, "open"), references=_references(path))
        except BaseException as e2:  # noqa: BLE001
            if is_control(e2):
                raise
            return untyped(e2, "references")
    except BaseException as e:  # noqa: BLE001
        if is_control(e):
            raise
        return untyped(e, "open")
    typed, stage = None, "steps"
    try:
        with page:
            steps = [("verify", page.verify)]
            for sec in page.sections:
                steps += [("read", lambda sec=sec: page.read(sec)), ("read-noverify", lambda sec=sec: page.read(sec, verify=False)),
                          ("array", lambda sec=sec: page.array(sec))]
            for stage, fn in steps:
                try:
                    fn()
                except HsnapError as e:
                    typed = typed or _typed(e, stage)
            stage = "references"
            references = _references(path)
            if typed:
                return dict(typed, references=references)
            stage = "model"
            name = desc["target"]
            if files[name] == ctx.inputs[name]:
                return {"cls": "accepted-unchanged", "references": references}
            if not desc["resign"]:
                return {"cls": "accepted-but-changed", "reason": f"raw mutant accepted: {name} differs from the vector"}
            h = page.header
            data, _ = encode_page(h["namespace"], h["page"]["namespace_id"], h["page"]["index"], h["page"]["prior"], h["page"]["key"],
                                  h["page"]["tokens"], [(page_spec, page.read(sec).reshape(-1).view("u1").tobytes())
                                                        for page_spec, sec in zip(_page_specs(page), page.sections)])
            why = _page_model_diff(files[name], data)
            if why is not None:
                return {"cls": "accepted-but-changed", "reason": f"a re-signed page object the reference encoder writes otherwise: {why}"}
            if ctx.ind is not None:
                try:
                    ctx.ind.read_page(path)
                except ctx.ind.HsnapSpecError as e:
                    return {"cls": "accepted-but-changed", "reason": f"spec-invalid, the independent reader refuses it: {e.kind}: {str(e)[:300]}"}
            return {"cls": "accepted-valid", "references": references}
    except BaseException as e:  # noqa: BLE001
        if is_control(e):
            raise
        return untyped(e, stage)


def _references(page_path: str) -> dict[str, bool]:
    """Each paged snapshot beside the page store of ``page_path``: does it verify whole — the
    file, its references, every page (spec 7.6)? (A typed refusal is False; anything else
    propagates: the caller classifies it.)"""
    from hsnap_format.chain import open_chain

    where = os.path.dirname(os.path.dirname(page_path))
    out = {}
    for name in sorted(os.listdir(where)):
        if name.endswith(".hsnap"):
            try:
                with open_chain(os.path.join(where, name)) as chain:
                    chain.verify()
                out[os.path.join(where, name)] = True
            except HsnapError:
                out[os.path.join(where, name)] = False
    return out


def _cli_verify(path: str, library_ok: bool) -> dict | None:
    """``hsnap verify [--json]`` of a snapshot that references pages: its exit status is the
    library's verdict on the whole (the file, its references, every page)."""
    from hsnap_format.tools import cli

    for argv in (["verify", path], ["verify", "--json", path]):
        out, err = io.StringIO(), io.StringIO()
        try:
            with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
                rc = cli.main(argv)
        except BaseException as e:  # noqa: BLE001
            if is_control(e):
                raise
            return dict(untyped(e, "cli verify"), cli=argv[:-1])
        if (rc == 0) != library_ok:
            return {"cls": "cli-disagrees", "stage": "cli verify", "reason": f"hsnap {' '.join(argv[:-1])} {os.path.basename(path)} exit {rc}, "
                    f"library {'passed' if library_ok else 'refused'}", "message": (out.getvalue() + err.getvalue())[-300:]}
        if "Traceback" in err.getvalue():
            return {"cls": "untyped", "stage": "cli verify", "error": "traceback printed", "where": "cli", "message": err.getvalue()[-300:]}
    return {"cli": True}


_PAGE_KEYS = ("format", "digest", "namespace", "page")


def _page_model_diff(mbytes: bytes, wbytes: bytes) -> str | None:
    """None when the accepted page object and the reference encoding of its content differ
    only where the spec lets them (spec 5.6, 5.11): unknown top-level keys and keys inside
    ``features``, the optional features, and the offsets that the header's length moves."""
    def meaning(data: bytes) -> dict:
        pre = PREAMBLE.unpack(data[:64])
        h = json.loads(data[HEADER_OFFSET : HEADER_OFFSET + pre[4]])
        out = {k: h[k] for k in _PAGE_KEYS}
        out["features.required"] = h["features"]["required"]
        out["sections"] = [{k: v for k, v in e.items() if k != "offset"} for e in h["sections"]]
        out["preamble"] = (pre[0], pre[1], pre[3])  # magic, major, byte order (any minor is read)
        return out

    m, w = meaning(mbytes), meaning(wbytes)
    return next((f"{k}: {_show(m[k])} where the encoder writes {_show(w[k])}" for k in m if m[k] != w[k]), None)


def _page_specs(page):
    from hsnap_format.layout import SectionSpec

    return [SectionSpec(s.name, s.kind, s.layer, s.dtype, s.shape) for s in page.sections]


def _page_spec_reader_agrees(path: str, result: dict, ctx: Context) -> dict:
    try:
        ctx.ind.read_page(path)
    except ctx.ind.HsnapSpecError as e:
        if result["stage"] != "open" or e.kind == result["error"]:
            return result
        why = f"refused at open as {result['error']} ({result['field']}), by the independent reader as {e.kind} ({e.field})"
    except Exception as e:  # noqa: BLE001
        return dict(untyped(e, "independent reader"), cls="harness-error")
    else:
        why = f"refused as {result['error']} ({result['field']}) at {result['stage']}, accepted by the independent reader"
    return dict(result, cls="spec-disagrees", reason=why)


def is_control(e: BaseException) -> bool:
    return isinstance(e, (KeyboardInterrupt, Hang))


def _library(path: str, files: dict[str, bytes], desc: dict, ctx: Context) -> dict:
    """open, verify, record (both ways), every section through every read path; untyped beats typed."""
    try:
        snap = hsnap_format.open(path)
    except HsnapError as e:
        return _typed(e, "open")
    except BaseException as e:  # noqa: BLE001 - everything else is the finding
        if is_control(e):
            raise
        return untyped(e, "open")
    typed, verify_ok, stage = None, False, "steps"
    try:
        steps = [("verify", snap.verify)]
        for r in _ranks(snap):
            steps += [("record", r.record), ("record-noverify", lambda r=r: r.record(verify=False))]
            for s in r.sections:
                steps += [("array", lambda r=r, s=s: r.array(s)), ("array-verify", lambda r=r, s=s: r.array(s, verify=True))]
                for extra in ("section_bytes", "read"):  # pread-based read paths, where the reader has them
                    if callable(getattr(r, extra, None)):
                        steps.append((extra, lambda r=r, s=s, extra=extra: getattr(r, extra)(s)))
                steps += [("section_stats", lambda r=r, s=s: _stats.section_stats(r, s)),
                          ("section_stats-verify", lambda r=r, s=s: _stats.section_stats(r, s, verify=True))]
        steps.append(("summary", lambda: _viewmodel.snapshot_summary(snap)))
        for stage, fn in steps:
            try:
                fn()
                verify_ok = verify_ok or stage == "verify"
            except HsnapError as e:
                typed = typed or _typed(e, stage)
        stage = "chain"
        verify_ok = verify_ok and _chain_verifies(snap, path)
        stage = "model"
        result = typed or _accepted(snap, path, files, desc, ctx)
        stage = "close"
        snap.close()
    except BaseException as e:  # noqa: BLE001
        if is_control(e):
            raise
        return untyped(e, stage)
    result["verify_ok"] = verify_ok
    return result


def _accepted(snap, path: str, files: dict[str, bytes], desc: dict, ctx: Context) -> dict:
    """Opened, verified, recorded and read: is it the vector, a spec-valid file, or neither?"""
    changed = [n for n, b in files.items() if b != ctx.inputs[n]]
    if not changed:
        return {"cls": "accepted-unchanged"}
    if not desc["resign"]:
        return {"cls": "accepted-but-changed", "reason": f"raw mutant accepted: {', '.join(changed)} differ from the vector"}
    why = None
    if hasattr(snap, "ranks"):
        why = _manifest_model(snap, files[next(n for n in files if is_manifest(n))])
        for r, rs in snap.ranks.items():
            name = next(n for n in files if n.endswith(f"/rank-{r}.hsnap"))
            if why is None and name in changed:
                why = _rank_model(rs, files[name], ctx)
    else:
        why = _rank_model(snap, files[desc["target"]], ctx)
    if why is not None:
        return {"cls": "accepted-but-changed", "reason": why}
    # The writer validates with the reader's own code, so a rule both skip is invisible to the
    # rewrite; tests/independent_reader.py, written from the spec alone, is the second opinion.
    out = {"cls": "accepted-valid"}
    if ctx.ind is not None:
        try:
            (ctx.ind.read_directory if os.path.isdir(path) else ctx.ind.read_snapshot)(path)
        except ctx.ind.HsnapSpecError as e:
            msg = f"{e.kind}: {str(e)[:300]}"
            known = next((why for pattern, why in INDEPENDENT_DEVIATIONS if re.search(pattern, str(e))), None)
            if known is None:
                return {"cls": "accepted-but-changed", "reason": f"spec-invalid, the independent reader refuses it: {msg}"}
            out["independent"] = f"{e.kind}: {known}"
    return out


# Refusals of the independent reader that are its own deviations from the spec, not the
# reader's: (pattern of its message, why it is the independent reader that is wrong).
INDEPENDENT_DEVIATIONS: list[tuple[str, str]] = []  # none known (the last was fixed in the spec-only reader)


# ---------------------------------------------------------------------- the spec model

_MISSING = object()
# spec 5.1-5.3: (object, key) -> the default a reader applies when the key is absent
DEFAULTS = {
    ("identity", "weights_hash"): "", ("identity", "device"): "", ("identity", "snapshot_id"): "",
    ("identity", "created_at"): "", ("identity", "hsnap_version"): "", ("identity", "numerics"): {},
    ("geometry", "attention"): None, ("geometry", "mamba"): None, ("geometry", "start_layer"): 0,
    ("geometry", "num_layers"): 0, ("geometry.attention", "swa_layers"): [], ("geometry.attention", "swa_window"): None,
    ("geometry.attention", "kv_lora_rank"): None, ("geometry.attention", "qk_rope_head_dim"): None,
    ("geometry.mamba", "conv_slice_axis"): 0, ("request", "top_logprobs_k"): 0, ("request", "has_rng_state"): False,
    ("request", "sampling"): {}, ("request", "remaining_budget"): None, ("request", "swa_start"): 0,
    ("request", "extra"): {}, ("request.stop", "max_new_tokens"): None, ("request.stop", "min_new_tokens"): 0,
    ("request.stop", "stop_strings"): [], ("request.stop", "stop_token_ids"): [], ("request.stop", "ignore_eos"): False,
    ("request.streamed", "tokens"): 0, ("request.streamed", "text_chars"): 0,
    ("request.streamed", "reasoning_tokens"): 0, ("request.streamed", "reasoning_finished"): False,
}
FLAT_OBJECTS = {"identity.numerics", "request.sampling", "request.extra"}  # kept key for key by the writer
AUTO_FEATURES = KNOWN_FEATURES  # the writer lists a known feature when the file uses it


def _jkind(v) -> str:
    if v is None:
        return "null"
    if isinstance(v, bool):
        return "bool"
    if isinstance(v, (int, float)):
        return "number"
    return {str: "string", list: "array", dict: "object"}.get(type(v), type(v).__name__)


def _same(a, b) -> bool:
    if _jkind(a) != _jkind(b):
        return False
    if isinstance(a, dict):
        return a.keys() == b.keys() and all(_same(a[k], b[k]) for k in a)
    if isinstance(a, list):
        return len(a) == len(b) and all(_same(x, y) for x, y in zip(a, b))
    return a == b


def _show(v) -> str:
    return (repr(v) if not isinstance(v, str) else json.dumps(v))[:80]


def _meaning_diff(m, w, path: str, shift: int):
    """Why header ``m`` (the mutant's) does not mean what ``w`` (the writer's rewrite) says, or None."""
    if _jkind(m) != _jkind(w):
        return f"{path or 'header'}: {_jkind(m)} {_show(m)} where the writer writes {_show(w)}"
    if isinstance(m, dict):
        strict = path in FLAT_OBJECTS or path.startswith("sections[")  # spec 5.6: other keys in features are ignored
        for k in sorted(m.keys() - w.keys()):
            if strict:
                return f"{path}: unknown key {_show(k)} where the spec allows none (5.6)"
        for k in sorted(w.keys() - m.keys()):
            d = DEFAULTS.get((path, k), _MISSING)
            if d is _MISSING:
                return f"{path + '.' if path else ''}{k}: absent, and the spec gives it no default"
            if not _same(w[k], d):
                return f"{path + '.' if path else ''}{k}: absent, decoded as {_show(w[k])} instead of the default {_show(d)}"
        for k in sorted(m.keys() & w.keys()):
            sub = f"{path}.{k}" if path else k
            if sub == "features.optional" and isinstance(m[k], list) and isinstance(w[k], list):
                if not all(isinstance(x, str) for x in m[k]):
                    return f"features.optional: {_show(m[k])} holds non-strings"
                if not set(m[k]) <= set(w[k]) or not set(w[k]) - set(m[k]) <= AUTO_FEATURES:
                    return f"features.optional: {_show(m[k])} where the writer writes {_show(w[k])}"
                continue
            if sub == "features.required" and isinstance(m[k], list):
                if not all(isinstance(x, str) and x in KNOWN_FEATURES for x in m[k]):
                    return f"features.required: {_show(m[k])} holds unknown or non-string entries"
                continue
            if path.startswith("sections[") and k == "offset" and _is_num(m[k]) and _is_num(w[k]):
                if m[k] - w[k] != shift:
                    return f"{sub}: {m[k]} where the writer writes {w[k]} (+{shift})"
                continue
            why = _meaning_diff(m[k], w[k], sub, shift)
            if why:
                return why
        return None
    if isinstance(m, list):
        if len(m) != len(w):
            return f"{path}: {len(m)} entries where the writer writes {len(w)}"
        for i, (x, y) in enumerate(zip(m, w)):
            why = _meaning_diff(x, y, f"{path}[{i}]", shift)
            if why:
                return why
        return None
    return None if _same(m, w) else f"{path}: {_show(m)} where the writer writes {_show(w)}"


def _rank_model(snap, mbytes: bytes, ctx: Context):
    """None when ``mbytes`` (accepted) is what the reference writer writes for its decoded
    content, up to what the spec lets differ; otherwise the first difference."""
    hlen = PREAMBLE.unpack(mbytes[:64])[4]
    hm = json.loads(mbytes[HEADER_OFFSET : HEADER_OFFSET + hlen])
    feats = hm.get("features") if isinstance(hm, dict) else None
    opt = feats.get("optional") if isinstance(feats, dict) else None
    if not isinstance(opt, list) or not all(isinstance(x, str) for x in opt):
        return f"features.optional: {_show(opt)} is not a list of strings (spec 5)"
    out = os.path.join(ctx.scratch, "rewrite.hsnap")
    if os.path.lexists(out):
        os.unlink(out)
    try:
        w = hsnap_format.SnapshotWriter(out, identity=snap.identity, geometry=snap.geometry, record=snap.record(),
                                        swa_start=snap.swa_start, features_optional=opt, preallocate=False, base=snap.base,
                                        pages=snap.pages)
        with w:
            for spec in w.pending_state_sections():
                w.write_section(spec.name, snap.array(spec.name))
            w.commit(fsync=False)
    except HsnapError as e:
        return f"the writer refuses the decoded content: {type(e).__name__} {e.field}: {str(e)[-160:]}"
    wb = read_file(out)
    os.unlink(out)
    if wb == mbytes:
        return None
    pm, pw = PREAMBLE.unpack(mbytes[:64]), PREAMBLE.unpack(wb[:64])
    for i, name in ((0, "magic"), (1, "major"), (3, "byte_order")):
        if pm[i] != pw[i]:
            return f"preamble.{name}: {pm[i]!r} where the writer writes {pw[i]!r}"
    if pm[7] - pm[5] != pw[7] - pw[5]:
        return f"preamble: {pm[7] - pm[5]} bytes of data where the writer writes {pw[7] - pw[5]}"
    hw = json.loads(wb[HEADER_OFFSET : HEADER_OFFSET + pw[4]])
    why = _meaning_diff(hm, hw, "", pm[5] - pw[5])
    if why:
        return why
    for em, ew in zip(hm["sections"], hw["sections"]):
        if mbytes[em["offset"] : em["offset"] + em["length"]] != wb[ew["offset"] : ew["offset"] + ew["length"]]:
            return f"sections[{em['name']!r}]: bytes differ from the rewrite"
    return None


def _manifest_model(sset, mbytes: bytes):
    hm = json.loads(mbytes.split(b"\n")[0])
    ver = hm.get("version")
    if isinstance(ver, list) and not all(isinstance(v, int) and not isinstance(v, bool) and v >= 0 for v in ver):
        return f"manifest.version: {_show(ver)} is not [int, int] (ints are >= 0, spec 5)"  # the writer would echo it
    wb = sset.manifest.encode()
    if wb == mbytes:
        return None
    hw = json.loads(wb.split(b"\n")[0])
    for k in sorted(hw.keys() - hm.keys()):
        return f"manifest.{k}: absent (required)"
    # SPEC GAP: 10.1 does not say whether unknown top-level manifest keys are ignored; allowed here
    for k in sorted(hw.keys()):
        if k == "version" and isinstance(hm[k], list) and len(hm[k]) == 2 and _same(hm[k][0], hw[k][0]):
            continue  # any minor is accepted
        if not _same(hm[k], hw[k]):
            return f"manifest.{k}: {_show(hm[k])} where the writer writes {_show(hw[k])}"
    return None


# ------------------------------------------------------------------------------ CLI


def _cli(path: str, desc: dict, ctx: Context, *, accepted_verify: bool):
    from hsnap_format.tools import cli

    orig = os.path.join(ctx.orig, desc["target"].split("/")[0])
    try:  # the library's diff directly: ``hsnap diff`` turns every ValueError into exit 2
        from hsnap_format.tools.diff import diff_snapshots

        with hsnap_format.open(orig) as a, hsnap_format.open(path) as b:
            diff_snapshots(a, b)
    except HsnapError:
        pass
    except BaseException as e:  # noqa: BLE001
        if is_control(e):
            raise
        return dict(untyped(e, "diff_snapshots"), cli=True)
    runs = [["info", path], ["info", "--json", path], ["verify", path], ["verify", "--json", path], ["diff", orig, path]]
    for argv in runs:
        out, err = io.StringIO(), io.StringIO()
        try:
            with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
                rc = cli.main(argv)
        except BaseException as e:  # noqa: BLE001 (SystemExit included: main returns codes)
            if is_control(e):
                raise
            r = untyped(e, "cli " + argv[0])
            r["cli"] = argv[:-1]
            return r
        if argv[0] == "verify" and (rc == 0) != accepted_verify:
            return {"cls": "cli-disagrees", "stage": "cli verify", "reason": f"hsnap {' '.join(argv[:-1])} exit {rc}, library verify {'passed' if accepted_verify else 'refused'}",
                    "message": (out.getvalue() + err.getvalue())[-300:]}
        if "Traceback" in err.getvalue():
            return {"cls": "untyped", "stage": "cli " + argv[0], "error": "traceback printed", "where": "cli", "message": err.getvalue()[-300:]}
    return {"cli": True}
