#!/usr/bin/env python3
"""Mutation run over every golden vector (issue 10): only typed refusals may come out.

    .venv/bin/python scripts/mutate.py --mutants 50000 --seed 1 [--jobs 2] [--json out.json]

Inputs: every vector under spec/vectors/ — each ``*.hsnap``, of each snapshot
directory its ``manifest.json`` and every rank file, and of each page store (spec 5.10)
every page object (examined by its own reader, spec 5.11, and through the references of
the paged vectors beside it, spec 7.6). Mutant ``i`` is a pure function of
(seed, i): pair ``i // 2`` draws a target and one operator (or, one time in seven, a
stack of 2-4), and ``i % 2`` picks the variant — 0 *raw* (bytes changed, every check
left stale), 1 *re-signed* (every integrity field recomputed as the mutated bytes lay
the file out: preamble check, header digest, each table digest, root digest, trailer
check, the manifest's digest line and, for a rank of a directory, its manifest entry),
so that the mutant passes the integrity layers and reaches the structural and semantic
checks behind them. Operators: bit flips, interesting bytes and integers (preamble and
trailer fields), truncation, extension, chunk deletion/duplication/insertion/copy, and
header-JSON-aware edits (numbers as huge/negative/float/300-400-digit/non-canonical
literals, type changes, list entries of other types (``features.optional``...), added,
removed and duplicated keys, deep nesting, escapes and invalid UTF-8, swaps, copies,
raw text edits).

Each mutant runs in a worker process (at most ``--jobs``; a per-mutant time limit; the
address space limited by RLIMIT_AS): ``hsnap_format.open``, ``verify()``, ``record()``
(and ``record(verify=False)``), every section through ``array()`` (plain and
verified), the pread paths (``section_bytes``/``read`` where the reader has them),
``section_stats`` (plain and verified) and ``snapshot_summary``; on every
``--cli-every``-th mutant also ``diff_snapshots`` against the vector and the CLI
(``info``, ``info --json``, ``verify``, ``verify --json``, ``diff``). Classes:

  typed               refused with an HsnapError subclass                    ok
  accepted-unchanged  accepted, and its bytes are the vector's               ok
  accepted-valid      re-signed, accepted, different, and a spec-valid file: ok
                      the reference writer, given the decoded content, writes
                      the same file (up to what the spec lets differ: unknown
                      keys where readers ignore them, absent keys that have a
                      default, the minor version, auto-listed optional features)
  accepted-but-changed  raw: accepted with bytes other than the vector's;    FAILURE
                      re-signed: accepted but not spec-valid — the writer
                      refuses it or writes something else ("non-canonical"),
                      or tests/independent_reader.py (written from the spec
                      alone) refuses it: the writer validates with the
                      reader's own code, so a rule both skip needs a second
                      opinion (its known deviations: INDEPENDENT_DEVIATIONS)
  untyped             any other exception (KeyError, TypeError, OverflowError, FAILURE
                      MemoryError, RecursionError...), or the worker died
  hang                over the time limit                                    FAILURE
  cli-disagrees       ``hsnap verify`` exit status differs from the library   FAILURE
  spec-disagrees      refused by hsnap_format, but tests/independent_reader.py FAILURE
                      (the spec alone) accepts it, or refuses it at open with
                      another error class (7.1's order is normative)
  harness-error       this script failed (not the library)                   FAILURE

The exit status is 1 when any FAILURE count is non-zero. The first few failures of
each class (distinct stack locations) are minimized (ops dropped and shrunk while the
failure stays the same) and saved, with the bytes, under ``--findings`` (default
/tmp/mutate-findings/seed<S>/); ``--replay DIR/case.json`` reruns one with its
traceback. No pickle: workers get indices or JSON and answer JSON lines.

``--target http`` (tests/mutate_http.py): one live server with the plug-in and a snapshot root, ``--mutants``
generated bodies over every ``/hsnap/*`` route and hostile migration container files, a bystander stream beside
them; counts server deaths, untyped 500s, hangs past the route's bound, files created outside the root, planted
non-snapshot bytes echoed, and bystander streams cut (each a FAILURE).

Other targets (issues 18, 20), ``--target reshard,resume,retract,gc,gc-url,migrate,chain,compact`` (or
``new``, or ``all`` with ``format``; tests/mutate_targets.py and, for migrate and chain,
tests/mutate_migrate.py, for compact tests/mutate_compact.py hold their seeds, operators and oracles):

    .venv/bin/python scripts/mutate.py --target new --mutants 5000 --url-mutants 1000 --jobs 2

  reshard   snapshot sets exported from SGLang's own pools at TP 1, 2, 4 (a Qwen3.5-like GDN
            hybrid, GQA, MLA, Mamba2, an SWA model with evicted window rows), one rank or the
            manifest mutated (per-rank bookkeeping, sharding parts, identity, record, section
            bytes, a rank rewritten with another swa_start or state_position), restored with
            ``restore_request(dir, sharding=describe(model, M, r))`` for every M != N
  resume    Req snapshots (greedy, sampled, logprobs top-k, xgrammar, SWA, Mamba, MLA, paged;
            written by snapshot_req) through ``resume_req``: sglang.* extras malformed, deeply
            nested, of other types, huge, unknown enum names; sampling values; ids outside
            the vocabulary
  retract   the same through ``load_retracted`` with the Req SGLang's retraction left
  gc        directories mixing committed snapshots (plain names, temporary-looking names,
            in marked staging directories, behind links) and leftovers in every state,
            renamed, moved, truncated, re-marked; ``gc.collect(remove=True, older_than=0)``
            (or by pid), ``hsnap gc --remove`` every ``--cli-every``-th
  gc-url    the same on a SeaweedFS this script starts, ``s3://`` prefixes and siblings,
            multipart uploads in progress (``--url-mutants`` of them)
  migrate   a live migration written by MigrationSource over SGLang's pools (and one across TP
            sizes: set links of a TP-1 source followed by each rank of a TP-2 target); a MigrationTarget
            applies k correct links, then meets a hostile link k through apply / step / follow
            (bytes of its header, record, sections, digests mutated; another request's, model's,
            geometry's or migration's link; the same link twice, one skipped, the plain one again;
            a final whose output ids do not extend; truncated, missing; abandoned.json; the
            caller's accept refusing): typed with pools and free lists byte-identical and the
            correct links still applying to the source's request, or accepted with exactly what
            the accepted link says
  chain     restore_request of a chain's head (a migration's links, a checkpoint directory's
            newest link by newest_links, a TP-2 chain of set directories) with a link anywhere
            below it mutated (re-signed: the links above re-based on it), removed, swapped or a
            stray newer checkpoint added
  compact   compact_path of the chain target's mutants and of paged chains (a page reference
            re-pointed at another page's object, its key or digest alone, pages fields, a page
            object mutated, removed, swapped, or re-signed under its new name and re-pointed at):
            refused typed with nothing left under the output's name, or an output that holds
            byte for byte what the restore of the same head puts in the pools (compact-laundered:
            compacted a chain the restore refuses; accepted-wrong-bytes; refused-left-output)

Target pools are filled with a sentinel byte in every free row and reused (put back from
the harness's own copy after each mutant). Classes (FAILURE unless typed or accepted):
typed (and the pools byte-identical), accepted (every check held; migrate and chain say
accepted-unchanged or accepted-valid), untyped, hang, leaked-slots, pool-changed,
req-changed, accepted-uncovered, accepted-ranks-disagree, uninitialised-uploaded,
accepted-unwritten, accepted-wrong-bytes, accepted-wrote-elsewhere, accepted-slot-accounting,
accepted-invalid-req, committed-removed, cli-failed, accepted-but-changed, not-resumable,
harness-error (tests/mutate_targets.py and tests/mutate_migrate.py say what each means).
Counts per target and overall; findings
minimized under ``--findings``/seed<S>/<target>/, replayed with ``--replay``.
"""

from __future__ import annotations

import argparse
import collections
import contextlib
import copy
import io
import json
import os
import random
import re
import resource
import select
import shutil
import signal
import struct
import subprocess
import sys
import tempfile
import time
import traceback

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
for _p in (ROOT, os.path.join(ROOT, "tests")):
    if _p not in sys.path:
        sys.path.insert(0, _p)

import xxhash  # noqa: E402

import craft  # noqa: E402  (tests/craft.py: split, lay_out, resign, manifest_for)
import mutate_targets as targets  # noqa: E402  (tests/mutate_targets.py: reshard, resume, retract, gc, gc-url)
import hsnap_format  # noqa: E402
from hsnap_format import canonical  # noqa: E402
from hsnap_format.tools import stats as _stats  # noqa: E402
from hsnap_format.tools import viewmodel as _viewmodel  # noqa: E402
from hsnap_format.errors import HsnapError  # noqa: E402
from hsnap_format.spec import HEADER_OFFSET, KNOWN_FEATURES, PREAMBLE, align_up  # noqa: E402

VECTORS = os.path.join(ROOT, "spec", "vectors")
LIB_DIR = os.path.join(ROOT, "hsnap_format") + os.sep
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
            inputs[name] = _read(p)
        elif os.path.isfile(os.path.join(p, "manifest.json")):
            members = ["manifest.json"] + sorted(n for n in os.listdir(p) if n.endswith(".hsnap"))
            groups[name] = members
            for m in members:
                inputs[f"{name}/{m}"] = _read(os.path.join(p, m))
        elif os.path.isdir(p) and any(n.endswith(".hpage") for n in os.listdir(p)):  # a page store (spec 5.10)
            members = sorted(n for n in os.listdir(p) if n.endswith(".hpage"))
            groups[name] = members
            for m in members:
                inputs[f"{name}/{m}"] = _read(os.path.join(p, m))
    return inputs, groups


def is_page(target: str) -> bool:
    """A page object of a page store vector (spec 5.11): examined by :func:`_page_library`."""
    return target.endswith(".hpage")


def _read(path: str) -> bytes:
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


def _draw(rng, target: str, inputs, groups):
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
        names, ops = _draw(rng, target, inputs, groups)
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
    from hsnap_format.storage import store_for

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
    """'file:line func' of the deepest frame in hsnap_format (True), else of the deepest frame (False)."""
    frames = traceback.extract_tb(tb)
    lib = [f for f in frames if f.filename.startswith(LIB_DIR)]
    f = (lib or frames or [None])[-1]
    if f is None:
        return "?", False
    return f"{os.path.relpath(f.filename, ROOT)}:{f.lineno} {f.name}", bool(lib)


def _untyped(e: BaseException, stage: str) -> dict:
    where, in_lib = _where(e.__traceback__)
    cls = "untyped" if in_lib or isinstance(e, (MemoryError, RecursionError)) else "harness-error"
    return {"cls": cls, "stage": stage, "error": type(e).__name__, "where": where, "message": str(e)[:300],
            "traceback": "".join(traceback.format_exception(type(e), e, e.__traceback__))[-4000:]}


def _ranks(snap):
    return list(snap.ranks.values()) if hasattr(snap, "ranks") else [snap]


def _typed(e: HsnapError, stage: str) -> dict:
    msg = str(e)
    r = {"cls": "typed", "stage": stage, "error": type(e).__name__, "field": _field_label(e.field)}
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


def _field_label(field) -> str:
    """The field with indices and names folded, for counting which checks refuse."""
    text = re.sub(r"\[[^\]]*\]", "[]", str(field))
    return re.sub(r"\d+", "N", text)[:60]


def examine(desc: dict, ctx: Context, *, cli: bool | None = None) -> dict:
    """Build, write and read one mutant; classify what came out."""
    try:
        files = build(desc, ctx.inputs, ctx.groups)
        path = ctx.write(files)
    except Exception as e:  # noqa: BLE001 - the script's own failure
        r = _untyped(e, "build")
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
    spec silent where the reader decides (issue 18 item 10): both are findings."""
    if ctx.ind is None:
        return result
    try:
        (ctx.ind.read_directory if os.path.isdir(path) else ctx.ind.read_snapshot)(path)
    except ctx.ind.HsnapSpecError as e:
        if result["stage"] != "open" or e.kind == result["error"]:
            return result
        why = f"refused at open as {result['error']} ({result['field']}), by the independent reader as {e.kind} ({e.field})"
    except Exception as e:  # noqa: BLE001 - the independent reader is test code: its crash is ours
        return dict(_untyped(e, "independent reader"), cls="harness-error")
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
            if _control(e2):
                raise
            return _untyped(e2, "references")
    except BaseException as e:  # noqa: BLE001
        if _control(e):
            raise
        return _untyped(e, "open")
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
        if _control(e):
            raise
        return _untyped(e, stage)


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
            if _control(e):
                raise
            return dict(_untyped(e, "cli verify"), cli=argv[:-1])
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
        return dict(_untyped(e, "independent reader"), cls="harness-error")
    else:
        why = f"refused as {result['error']} ({result['field']}) at {result['stage']}, accepted by the independent reader"
    return dict(result, cls="spec-disagrees", reason=why)


def _control(e: BaseException) -> bool:
    return isinstance(e, (KeyboardInterrupt, Hang))


def _library(path: str, files: dict[str, bytes], desc: dict, ctx: Context) -> dict:
    """open, verify, record (both ways), every section through every read path; untyped beats typed."""
    try:
        snap = hsnap_format.open(path)
    except HsnapError as e:
        return _typed(e, "open")
    except BaseException as e:  # noqa: BLE001 - everything else is the finding
        if _control(e):
            raise
        return _untyped(e, "open")
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
        if _control(e):
            raise
        return _untyped(e, stage)
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
INDEPENDENT_DEVIATIONS: list[tuple[str, str]] = []  # none known (issue 18 item 10 fixed the last)


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
    wb = _read(out)
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
        if _control(e):
            raise
        return dict(_untyped(e, "diff_snapshots"), cli=True)
    runs = [["info", path], ["info", "--json", path], ["verify", path], ["verify", "--json", path], ["diff", orig, path]]
    for argv in runs:
        out, err = io.StringIO(), io.StringIO()
        try:
            with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
                rc = cli.main(argv)
        except BaseException as e:  # noqa: BLE001 (SystemExit included: main returns codes)
            if _control(e):
                raise
            r = _untyped(e, "cli " + argv[0])
            r["cli"] = argv[:-1]
            return r
        if argv[0] == "verify" and (rc == 0) != accepted_verify:
            return {"cls": "cli-disagrees", "stage": "cli verify", "reason": f"hsnap {' '.join(argv[:-1])} exit {rc}, library verify {'passed' if accepted_verify else 'refused'}",
                    "message": (out.getvalue() + err.getvalue())[-300:]}
        if "Traceback" in err.getvalue():
            return {"cls": "untyped", "stage": "cli " + argv[0], "error": "traceback printed", "where": "cli", "message": err.getvalue()[-300:]}
    return {"cli": True}


# ====================================================================== worker pool


def _worker_main(args) -> int:
    """Answer one JSON line per request line: {"i": n} or {"case": desc}."""
    proto_in = os.fdopen(os.dup(0), "r", encoding="utf-8")
    proto_out = os.fdopen(os.dup(1), "w", encoding="utf-8", buffering=1)
    null = os.open(os.devnull, os.O_RDWR)
    os.dup2(null, 0)
    os.dup2(null, 1)  # a stray print from the library cannot corrupt the protocol
    if getattr(args, "target", "format") != "format":
        return _target_worker(args, proto_in, proto_out)
    ctx = Context(args.scratch, cli_every=args.cli_every)
    if args.mem_gib > 0:
        lim = int(args.mem_gib * (1 << 30))
        resource.setrlimit(resource.RLIMIT_AS, (lim, lim))
    inject = dict(x.split(":") for x in os.environ.get("HSNAP_MUTATE_INJECT", "").split(",") if ":" in x)
    proto_out.write(json.dumps({"ready": os.getpid()}) + "\n")
    for line in proto_in:
        req = json.loads(line)
        desc = req["case"] if "case" in req else generate(args.seed, req["i"], ctx.inputs, ctx.groups)
        what = inject.get(str(desc["i"]))  # tests of the pool itself: a hang, a crash
        if what == "hang":
            time.sleep(3600)
        elif what == "crash":
            os.kill(os.getpid(), signal.SIGSEGV)
        try:
            r = examine(desc, ctx, cli=req.get("cli"))
        except MemoryError as e:
            r = _untyped(e, "examine")
        r["i"] = desc["i"]
        proto_out.write(json.dumps(r) + "\n")
    return 0


class _Worker:
    def __init__(self, n: int, args, base: str) -> None:
        self.n = n
        self.scratch = os.path.join(base, f"w{n}-{time.monotonic_ns()}")
        self.log = open(os.path.join(base, f"w{n}.log"), "ab")
        env = dict(os.environ, OPENBLAS_NUM_THREADS="1", OMP_NUM_THREADS="1", MKL_NUM_THREADS="1", PYTHONHASHSEED="0")
        cmd = [sys.executable, os.path.abspath(__file__), "--worker", "--seed", str(args.seed), "--scratch", self.scratch,
               "--mem-gib", str(args.mem_gib), "--cli-every", str(args.cli_every)] + _target_argv(args)
        self.proc = subprocess.Popen(cmd, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=self.log, env=env, cwd=ROOT)
        self.buf = b""
        self.job = None
        self.deadline = 0.0
        line = self._line(time.monotonic() + (120 if getattr(args, "target", "format") == "format" else 600))
        if line is None or "ready" not in json.loads(line):
            raise RuntimeError(f"worker {n} did not start (see {self.log.name})")

    def _line(self, deadline: float):
        fd = self.proc.stdout.fileno()
        while b"\n" not in self.buf:
            left = deadline - time.monotonic()
            if left <= 0:
                return None
            r, _, _ = select.select([fd], [], [], left)
            if r:
                chunk = os.read(fd, 1 << 16)
                if not chunk:
                    return ""
                self.buf += chunk
        line, _, self.buf = self.buf.partition(b"\n")
        return line.decode("utf-8")

    def send(self, job, req: dict, timeout: float) -> None:
        self.job = job
        self.deadline = time.monotonic() + timeout
        self.proc.stdin.write((json.dumps(req) + "\n").encode())
        self.proc.stdin.flush()

    def kill(self) -> int:
        if self.proc.poll() is None:
            self.proc.kill()  # our own child, by its pid
        rc = self.proc.wait()
        self.log.close()
        shutil.rmtree(self.scratch, ignore_errors=True)
        return rc

    def close(self) -> None:
        try:
            self.proc.stdin.close()
            self.proc.wait(timeout=30)
        except (OSError, subprocess.TimeoutExpired):
            pass
        self.kill()


class Pool:
    """At most ``jobs`` worker processes; a per-request deadline; a dead or late worker is
    replaced and its request reported as a crash or a hang."""

    def __init__(self, args, base: str) -> None:
        self.args, self.base = args, base
        self.workers = [_Worker(n, args, base) for n in range(args.jobs)]

    def run(self, jobs, on_result) -> None:
        """``jobs``: iterable of (key, request); ``on_result(key, result)`` for each."""
        it = iter(jobs)
        pending = True
        busy: dict[int, _Worker] = {}
        while True:
            for w in self.workers:
                if w.job is None and pending:
                    try:
                        key, req = next(it)
                    except StopIteration:
                        pending = False
                        break
                    try:
                        w.send(key, req, self.args.timeout)
                    except OSError:  # it died between two mutants: the pipe is closed
                        self._replace(w, on_result, crashed=True)
                        continue
                    busy[w.proc.stdout.fileno()] = w
            if not busy:
                if pending:  # a worker was replaced before it got work
                    continue
                return
            wait = max(0.0, min(w.deadline for w in busy.values()) - time.monotonic())
            ready, _, _ = select.select(list(busy), [], [], wait)
            for fd in ready:
                w = busy[fd]
                chunk = os.read(fd, 1 << 16)
                if not chunk:
                    del busy[fd]
                    self._replace(w, on_result, crashed=True)
                    continue
                w.buf += chunk
                while b"\n" in w.buf and w.job is not None:
                    line, _, w.buf = w.buf.partition(b"\n")
                    key, w.job = w.job, None
                    del busy[fd]
                    on_result(key, json.loads(line))
            now = time.monotonic()
            for fd, w in list(busy.items()):
                if w.job is not None and now >= w.deadline:
                    del busy[fd]
                    self._replace(w, on_result, crashed=False)

    def _replace(self, w: _Worker, on_result, *, crashed: bool) -> None:
        key = w.job
        rc = w.kill()
        if crashed:
            tail = _tail(os.path.join(self.base, f"w{w.n}.log"))
            res = {"cls": "untyped", "stage": "worker", "error": f"worker died (exit {rc})", "where": "process",
                   "message": tail}
        else:
            res = {"cls": "hang", "stage": "?", "error": "timeout", "where": f"over {self.args.timeout} s", "message": ""}
        self.workers[self.workers.index(w)] = _Worker(w.n, self.args, self.base)
        on_result(key, res)

    def close(self) -> None:
        for w in self.workers:
            w.close()


def _tail(path: str, n: int = 600) -> str:
    try:
        with open(path, "rb") as f:
            f.seek(max(0, os.path.getsize(path) - n))
            return f.read().decode("utf-8", "replace")
    except OSError:
        return ""


# ================================================================== in-process runs


@contextlib.contextmanager
def _time_limit(seconds: float):
    def fire(signum, frame):
        raise Hang()

    old = signal.signal(signal.SIGALRM, fire)
    signal.setitimer(signal.ITIMER_REAL, seconds)
    try:
        yield
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, old)


def examine_in_process(desc: dict, ctx: Context, timeout: float, cli=None) -> dict:
    try:
        with _time_limit(timeout):
            r = examine(desc, ctx, cli=cli)
    except Hang:
        r = {"cls": "hang", "stage": "?", "error": "timeout", "where": f"over {timeout} s", "message": ""}
    r["i"] = desc["i"]
    return r


# ============================================================================ the run


class Tally:
    def __init__(self, seed: int) -> None:
        self.seed = seed
        self.total = collections.Counter()
        self.by_operator = collections.defaultdict(collections.Counter)
        self.by_target = collections.defaultdict(collections.Counter)
        self.by_variant = collections.defaultdict(collections.Counter)
        self.typed_errors = collections.Counter()
        self.typed_stages = collections.Counter()
        self.typed_fields = collections.Counter()
        self.typed_layers = collections.Counter()
        self.notes = collections.Counter()
        self.independent = collections.Counter()
        self.independent_examples: list[dict] = []
        self.cli_checked = 0
        self.failures: list[dict] = []

    def add(self, desc: dict, r: dict) -> None:
        cls = r["cls"]
        self.total[cls] += 1
        variant = "re-signed" if desc["resign"] else "raw"
        self.by_operator[desc["operator"]][cls] += 1
        self.by_target[desc["target"]][cls] += 1
        self.by_variant[variant][cls] += 1
        if cls == "typed":
            self.typed_errors[r["error"]] += 1
            self.typed_stages[f"{variant} {r['stage']}"] += 1
            if desc["resign"]:
                self.typed_fields[f"{r['error']} {r.get('field', '')}"] += 1
                self.typed_layers[layer_of(r["error"], r.get("field", ""))] += 1
        if r.get("note"):
            self.notes[r["note"]] += 1
        if r.get("independent"):
            self.independent[r["independent"].split(":")[0]] += 1
            if len(self.independent_examples) < 20:
                self.independent_examples.append({"i": desc["i"], "target": desc["target"], "ops": desc["ops"], "independent": r["independent"]})
        if r.get("cli"):
            self.cli_checked += 1
        if cls in FAIL_CLASSES:
            self.failures.append(dict(r, desc=desc))

    @property
    def n(self) -> int:
        return sum(self.total.values())

    @property
    def failed(self) -> int:
        return sum(self.total[c] for c in FAIL_CLASSES)

    def totals_line(self) -> str:
        t = self.total
        return (f"mutants: {self.n}  typed: {t['typed']}  accepted-unchanged: {t['accepted-unchanged']}  "
                f"accepted-but-changed: {t['accepted-but-changed']}  untyped: {t['untyped']}  hangs: {t['hang']}  seed: {self.seed}")

    def to_dict(self) -> dict:
        return {
            "seed": self.seed, "mutants": self.n, "totals": {c: self.total[c] for c in CLASSES},
            "by_operator": {k: dict(v) for k, v in sorted(self.by_operator.items())},
            "by_target": {k: dict(v) for k, v in sorted(self.by_target.items())},
            "by_variant": {k: dict(v) for k, v in sorted(self.by_variant.items())},
            "typed_errors": dict(self.typed_errors.most_common()), "typed_stages": dict(self.typed_stages.most_common()),
            "resigned_typed_fields": dict(self.typed_fields.most_common()),
            "resigned_typed_layers": dict(self.typed_layers.most_common()), "notes": dict(self.notes),
            "independent_reader_refuses_accepted_valid": dict(self.independent),
            "independent_examples": self.independent_examples, "cli_checked": self.cli_checked,
            "failures": [{k: v for k, v in f.items() if k != "traceback"} for f in sorted(self.failures, key=lambda f: f["i"])[:200]],
        }


def signature(r: dict) -> tuple:
    if r["cls"] in ("accepted-but-changed", "cli-disagrees", "spec-disagrees"):
        reason = re.sub(r"'[^']*'|\"[^\"]*\"", "_", r.get("reason", ""))  # values out, the check stays
        return (r["cls"], re.sub(r"[0-9]+", "N", reason)[:80])
    return (r["cls"], r.get("error"), r.get("where"))


def run(mutants: int, seed: int, *, jobs: int = 0, timeout: float = 10.0, mem_gib: float = 2.0, cli_every: int = 10,
        progress: bool = False, scratch: str | None = None) -> Tally:
    """The core: ``mutants`` mutants of ``seed`` (in-process when jobs == 0)."""
    base = scratch or tempfile.mkdtemp(prefix="hsnap-mutate-", dir="/dev/shm" if os.path.isdir("/dev/shm") else None)
    tally = Tally(seed)
    inputs, groups = load_inputs()
    t0 = last = time.monotonic()

    def report() -> None:
        nonlocal last
        if progress and time.monotonic() - last > 10:
            last = time.monotonic()
            rate = tally.n / (last - t0)
            print(f"  {tally.n}/{mutants} ({rate:.0f}/s) failures {tally.failed}", file=sys.stderr, flush=True)

    try:
        if jobs <= 0:
            ctx = Context(os.path.join(base, "inproc"), cli_every=cli_every)
            for i in range(mutants):
                desc = generate(seed, i, inputs, groups)
                tally.add(desc, examine_in_process(desc, ctx, timeout))
                report()
        else:
            args = argparse.Namespace(seed=seed, jobs=jobs, timeout=timeout, mem_gib=mem_gib, cli_every=cli_every)
            pool = Pool(args, base)
            try:
                def on_result(i, r):
                    r["i"] = i
                    tally.add(generate(seed, i, inputs, groups), r)
                    report()

                pool.run(((i, {"i": i}) for i in range(mutants)), on_result)
            finally:
                pool.close()
    finally:
        if scratch is None:
            shutil.rmtree(base, ignore_errors=True)
    return tally


# ====================================================================== minimization


def _shrinks(ops):
    """Smaller variants of an op list: one op dropped, then one size halved."""
    for k in range(len(ops)):
        if len(ops) > 1:
            yield ops[:k] + ops[k + 1 :]
    for k, op in enumerate(ops):
        for field in ("n", "del"):
            if isinstance(op.get(field), int) and op[field] > 1:
                yield ops[:k] + [dict(op, **{field: op[field] // 2})] + ops[k + 1 :]
        if op["op"] == "j.lit" and "text" in op and len(op["text"]) > 8:
            yield ops[:k] + [dict(op, text=op["text"][: len(op["text"]) // 2 + 1])] + ops[k + 1 :]
        if "hex" in op and len(op["hex"]) > 2 and op["op"] == "b.ins":
            yield ops[:k] + [dict(op, hex=op["hex"][: len(op["hex"]) // 4 * 2])] + ops[k + 1 :]


def minimize(desc: dict, sig: tuple, evaluate, budget: int = 60, signature_of=None) -> dict:
    """Greedy: keep any shrink whose failure has the same signature (``signature_of``, default
    ``signature``)."""
    signature_of = signature_of or signature
    best = desc
    improved = True
    while improved and budget > 0:
        improved = False
        for ops in _shrinks(best["ops"]):
            budget -= 1
            cand = dict(best, ops=ops)
            if signature_of(evaluate(cand)) == sig:
                best, improved = cand, True
                break
            if budget <= 0:
                break
    return best


def save_findings(tally: Tally, out_dir: str, evaluate, keep: int, inputs, groups) -> list[str]:
    """Minimize and save the first ``keep`` distinct failures of each class; returns the case files."""
    shutil.rmtree(out_dir, ignore_errors=True)
    saved, seen = [], collections.Counter()
    sigs = set()
    for f in sorted(tally.failures, key=lambda f: f["i"]):
        sig = signature(f)
        if sig in sigs or seen[f["cls"]] >= keep:
            continue
        sigs.add(sig)
        seen[f["cls"]] += 1
        desc = f["desc"]
        small = desc if f["cls"] == "hang" or f.get("stage") == "worker" else minimize(desc, sig, evaluate)
        again = f if small is desc else evaluate(small)
        slug = re.sub(r"[^A-Za-z0-9_.-]+", "-", f"{seen[f['cls']]:02d}-{f.get('error') or 'changed'}-{desc['target']}-{desc['operator']}")[:90]
        d = os.path.join(out_dir, f["cls"], slug)
        os.makedirs(d, exist_ok=True)
        files = build(small, inputs, groups)
        for name, data in files.items():
            p = os.path.join(d, "mutant", name)
            os.makedirs(os.path.dirname(p), exist_ok=True)
            with open(p, "wb") as fh:
                fh.write(data)
        case = {"seed": tally.seed, "i": desc["i"], "class": f["cls"], "signature": list(sig), "result": {k: v for k, v in again.items() if k != "desc"},
                "desc": small, "original_desc": desc,
                "reproduce": f".venv/bin/python scripts/mutate.py --replay {os.path.join(d, 'case.json')}",
                "open": os.path.join(d, "mutant", desc["target"].split("/")[0])}
        with open(os.path.join(d, "case.json"), "w") as fh:
            json.dump(case, fh, indent=1, default=str)
        saved.append(os.path.join(d, "case.json"))
    return saved


# ======================================================== the other targets (issue 18)
#
# --target reshard|resume|retract|gc|gc-url drives re-signed and raw mutants of seeds
# written from real SGLang pools (re-sharded restores across TP sizes, resume_req,
# load_retracted) and of directory / object-store layouts (hsnap gc) through the library,
# with the oracles of tests/mutate_targets.py. Same pool, same limits, same JSON lines.

TARGETS = ("format",) + targets.TARGETS
TARGET_GROUPS = {"all": TARGETS, "new": targets.TARGETS}


def _targets_of(spec: str) -> list[str]:
    out = []
    for name in spec.split(","):
        for t in TARGET_GROUPS.get(name.strip(), (name.strip(),)):
            if t not in TARGETS:
                raise SystemExit(f"mutate.py: unknown target {t!r} (one of {', '.join(TARGETS)}, all, new)")
            if t not in out:
                out.append(t)
    return out


def _target_argv(args) -> list[str]:
    t = getattr(args, "target", "format")
    if t == "format":
        return []
    argv = ["--target", t, "--seeds", args.seeds]
    if getattr(args, "store", None):
        argv += ["--store", args.store]
    if getattr(args, "gc_strict", False):
        argv.append("--gc-strict")
    return argv


def _target_worker(args, proto_in, proto_out) -> int:
    seeds = targets.load_seeds(args.target, args.seeds)
    gen = targets.generator(seeds)
    store = None
    if args.store:
        with open(args.store) as f:
            store = json.load(f)
    ex = targets.examiner(seeds, args.scratch, cli_every=args.cli_every, store=store, strict=args.gc_strict)
    ex.warm()  # pools, descriptions, SGLang imports: before "ready", outside any mutant's time limit
    if args.mem_gib > 0:
        lim = int(args.mem_gib * (1 << 30))
        resource.setrlimit(resource.RLIMIT_AS, (lim, lim))
    inject = dict(x.split(":") for x in os.environ.get("HSNAP_MUTATE_INJECT", "").split(",") if ":" in x)
    proto_out.write(json.dumps({"ready": os.getpid()}) + "\n")
    for line in proto_in:
        req = json.loads(line)
        desc = req["case"] if "case" in req else gen.generate(args.seed, req["i"])
        what = inject.get(str(desc["i"]))
        if what == "hang":
            time.sleep(3600)
        elif what == "crash":
            os.kill(os.getpid(), signal.SIGSEGV)
        try:
            r = ex.examine(desc)
        except MemoryError as e:
            r = targets.untyped(e, "examine")
        r["i"] = desc["i"]
        proto_out.write(json.dumps(r, default=str) + "\n")
    return 0


def examine_target_in_process(desc: dict, ex, timeout: float) -> dict:
    try:
        with _time_limit(timeout):
            r = ex.examine(desc)
    except Hang:
        r = {"cls": "hang", "stage": "?", "error": "timeout", "where": f"over {timeout} s", "message": ""}
    r["i"] = desc["i"]
    return r


class TargetTally(Tally):
    """Counts of one target of tests/mutate_targets.py (its classes, its failures)."""

    def __init__(self, seed: int, target: str) -> None:
        super().__init__(seed)
        self.target = target
        self.uncommitted_removed = 0
        self.removed = 0  # gc: entries it removed (evidence that it still cleans)
        self.refusal_fields = collections.Counter()

    def add(self, desc: dict, r: dict) -> None:
        cls = r["cls"]
        self.total[cls] += 1
        variant = "re-signed" if desc["resign"] else "raw"
        self.by_operator[desc["operator"]][cls] += 1
        self.by_target[desc["target"]][cls] += 1
        self.by_variant[variant][cls] += 1
        if cls == "typed":
            self.typed_errors[r["error"]] += 1
            self.typed_stages[f"{variant} {r['stage']}"] += 1
            self.refusal_fields[f"{variant} {r['error']} {r.get('field', '')}"] += 1
        if r.get("note"):
            self.notes[r["note"][:60]] += 1
        self.uncommitted_removed += int(r.get("uncommitted_removed", 0))
        self.removed += int(r.get("removed", 0))
        if cls in targets.FAIL_CLASSES:
            self.failures.append(dict(r, desc=desc))

    @property
    def failed(self) -> int:
        return sum(self.total[c] for c in targets.FAIL_CLASSES)

    def totals_line(self) -> str:
        t = self.total
        fails = ", ".join(f"{c} {t[c]}" for c in targets.FAIL_CLASSES if t[c])
        acc = "  ".join(f"{c} {t[c]}" for c in targets.OK_CLASSES[1:] if t[c]) or "accepted 0"
        return f"{self.target}: mutants {self.n}  typed {t['typed']}  {acc}  failures {self.failed}" + (f" ({fails})" if fails else "")

    def to_dict(self) -> dict:
        return {
            "target": self.target, "seed": self.seed, "mutants": self.n, "totals": {c: self.total[c] for c in targets.CLASSES},
            "failed": self.failed, "by_operator": {k: dict(v) for k, v in sorted(self.by_operator.items())},
            "by_target": {k: dict(v) for k, v in sorted(self.by_target.items())},
            "by_variant": {k: dict(v) for k, v in sorted(self.by_variant.items())},
            "typed_errors": dict(self.typed_errors.most_common()), "refusal_fields": dict(self.refusal_fields.most_common(60)),
            "notes": dict(self.notes), "uncommitted_rank_files_removed": self.uncommitted_removed, "gc_entries_removed": self.removed,
            "failures": [{k: v for k, v in f.items() if k != "traceback"} for f in sorted(self.failures, key=lambda f: f["i"])[:200]],
        }


def target_signature(r: dict) -> tuple:
    """Failures of one kind: an exception by its class and the library frame; an oracle
    finding by its class and its reason with names and numbers folded."""
    if r.get("where") in (None, "oracle", "after gc", "after refusal", "cli gc") or r["cls"] in ("committed-removed", "pool-changed"):
        reason = re.sub(r"'[^']*'|\"[^\"]*\"", "_", r.get("reason", ""))
        reason = re.sub(r"[0-9]+", "N", re.sub(r"\.[A-Za-z0-9_.-]*hsnap-(staging|tmp)-[A-Za-z0-9_.-]*", ".STAGING", reason))
        return (r["cls"], reason[:70])
    return (r["cls"], r.get("error"), r.get("where"))


def run_target(target: str, mutants: int, seed: int, *, seeds_dir: str, jobs: int = 0, timeout: float = 10.0, mem_gib: float = 0.0,
               cli_every: int = 10, store: dict | None = None, strict: bool = False, progress: bool = False,
               scratch: str | None = None) -> TargetTally:
    """``mutants`` mutants of ``target`` from the seeds in ``seeds_dir`` (in-process when jobs == 0)."""
    base = scratch or tempfile.mkdtemp(prefix=f"hsnap-mutate-{target}-", dir="/dev/shm" if os.path.isdir("/dev/shm") else None)
    os.makedirs(base, exist_ok=True)
    seeds = targets.load_seeds(target, seeds_dir)
    gen = targets.generator(seeds)
    tally = TargetTally(seed, target)
    t0 = last = time.monotonic()

    def report() -> None:
        nonlocal last
        if progress and time.monotonic() - last > 10:
            last = time.monotonic()
            print(f"  {target}: {tally.n}/{mutants} ({tally.n / (last - t0):.0f}/s) failures {tally.failed}", file=sys.stderr, flush=True)

    try:
        if jobs <= 0:
            ex = targets.examiner(seeds, os.path.join(base, "inproc"), cli_every=cli_every, store=store, strict=strict)
            ex.warm()
            for i in range(mutants):
                desc = gen.generate(seed, i)
                tally.add(desc, examine_target_in_process(desc, ex, timeout))
                report()
        else:
            store_file = None
            if store is not None:
                store_file = os.path.join(base, "store.json")
                with open(store_file, "w") as f:
                    json.dump(store, f)
            args = argparse.Namespace(seed=seed, jobs=jobs, timeout=timeout, mem_gib=max(mem_gib, targets.MEM_GIB[target]),
                                      cli_every=cli_every, target=target, seeds=seeds_dir, store=store_file, gc_strict=strict)
            pool = Pool(args, base)
            try:
                def on_result(i, r):
                    r["i"] = i
                    tally.add(gen.generate(seed, i), r)
                    report()

                pool.run(((i, {"i": i}) for i in range(mutants)), on_result)
            finally:
                pool.close()
    finally:
        if scratch is None:
            shutil.rmtree(base, ignore_errors=True)
    return tally


def save_target_findings(tally: TargetTally, out_dir: str, evaluate, keep: int, seeds) -> list[str]:
    """The first ``keep`` distinct failures of each class, minimized (ops dropped and
    shrunk while the signature stays) and saved with their files."""
    shutil.rmtree(out_dir, ignore_errors=True)
    saved, seen, sigs = [], collections.Counter(), set()
    for f in sorted(tally.failures, key=lambda f: f["i"]):
        sig = target_signature(f)
        if sig in sigs or seen[f["cls"]] >= keep:
            continue
        sigs.add(sig)
        seen[f["cls"]] += 1
        desc = f["desc"]
        unshrinkable = f["cls"] == "hang" or f.get("stage") == "worker"
        small = desc if unshrinkable else minimize(desc, sig, evaluate, budget=40, signature_of=target_signature)
        again = f if small is desc else evaluate(small)
        slug = re.sub(r"[^A-Za-z0-9_.-]+", "-", f"{seen[f['cls']]:02d}-{f['cls']}-{desc['target']}-{desc['operator']}")[:90]
        d = os.path.join(out_dir, f["cls"], slug)
        os.makedirs(d, exist_ok=True)
        for name, data in targets.mutant_files(seeds, small).items():
            p = os.path.join(d, "mutant", name)
            os.makedirs(os.path.dirname(p), exist_ok=True)
            with open(p, "wb") as fh:
                fh.write(data)
        case = {"seed": tally.seed, "i": desc["i"], "target": tally.target, "class": f["cls"], "signature": list(sig),
                "result": {k: v for k, v in again.items() if k != "desc"}, "desc": small, "original_desc": desc,
                "reproduce": f".venv/bin/python scripts/mutate.py --replay {os.path.join(d, 'case.json')}"}
        with open(os.path.join(d, "case.json"), "w") as fh:
            json.dump(case, fh, indent=1, default=str)
        saved.append(os.path.join(d, "case.json"))
    return saved


def _target_table(tally: TargetTally) -> str:
    shown = [c for c in targets.CLASSES if tally.total[c]] or ["typed", "accepted"]
    lines = [f"{'operator':<14} {'mutants':>8} " + " ".join(f"{c[:12]:>12}" for c in shown)]
    for groupname, table in (("operator", tally.by_operator), ("target", tally.by_target), ("variant", tally.by_variant)):
        if groupname != "operator":
            lines.append(f"-- by {groupname}")
        for name in sorted(table):
            c = table[name]
            lines.append(f"{name[:14]:<14} {sum(c.values()):>8} " + " ".join(f"{c[k]:>12}" for k in shown))
    return "\n".join(lines)


def seeds_cache(target: str) -> str:
    """Where ``--replay`` (and a run without ``--seeds``) keeps a target's seeds: they are
    rebuilt identically (fixed identities, seeded pools), so a case replays anywhere."""
    return os.path.join(tempfile.gettempdir(), f"hsnap-mutate-seeds-{os.getuid()}", target)


def _replay_target(case: dict, timeout: float) -> int:
    t = case["target"]
    seeds = targets.load_seeds(t, targets.build_seeds(t, seeds_cache(t)))
    server = store = None
    with tempfile.TemporaryDirectory(prefix="hsnap-replay-") as d:
        try:
            if t == "gc-url":
                server, store = targets.start_store(os.path.join(d, "weed"))
            ex = targets.examiner(seeds, os.path.join(d, "x"), cli_every=0, store=store)
            if hasattr(ex, "warm"):  # SGLang's imports and the pools: outside the mutant's time limit, as in a run
                ex.warm()
            r = examine_target_in_process(case["desc"], ex, timeout)
        finally:
            if server is not None:
                server.stop()
    print(json.dumps({k: v for k, v in r.items() if k != "traceback"}, indent=1, default=str))
    if r.get("traceback"):
        print(r["traceback"])
    return 0 if r["cls"] in targets.OK_CLASSES else 1


def main_targets(args) -> int:
    """``--target`` other than ``format``: each target in turn, counts per target and overall."""
    sel = _targets_of(args.target)
    t_all = time.monotonic()
    base = tempfile.mkdtemp(prefix="hsnap-mutate-", dir="/dev/shm" if os.path.isdir("/dev/shm") else None)
    results, rc = {}, 0
    try:
        for t in sel:
            t0 = time.monotonic()
            n = args.url_mutants if t == "gc-url" and args.url_mutants is not None else args.mutants
            if t == "format":
                out = os.path.join(base, "format.json")
                argv = ["--mutants", str(n), "--seed", str(args.seed), "--jobs", str(args.jobs), "--timeout", str(args.timeout),
                        "--mem-gib", str(args.mem_gib), "--cli-every", str(args.cli_every), "--json", out, "--findings", args.findings,
                        "--keep", str(args.keep)] + (["--quiet"] if args.quiet else [])
                rc |= main(argv)
                with open(out) as f:
                    d = json.load(f)
                failed = sum(d["totals"].get(c, 0) for c in FAIL_CLASSES)
                results[t] = {"mutants": d["mutants"], "failed": failed, "totals": d["totals"], "wall_s": round(time.monotonic() - t0, 1)}
                continue
            print(f"== target {t}: {n} mutants, seed {args.seed}, jobs {args.jobs}", flush=True)
            seeds_dir = args.seeds or os.path.join(base, "seeds", t)
            t_seeds = time.monotonic()
            targets.build_seeds(t, seeds_dir)
            seeds_s = time.monotonic() - t_seeds
            server = store = None
            try:
                if t == "gc-url":
                    server, store = targets.start_store(os.path.join(base, "weed"))
                tally = run_target(t, n, args.seed, seeds_dir=seeds_dir, jobs=args.jobs, timeout=args.timeout, mem_gib=args.mem_gib,
                                   cli_every=args.cli_every, store=store, strict=args.gc_strict, progress=not args.quiet,
                                   scratch=os.path.join(base, f"run-{t}"))
                saved = []
                if tally.failures:  # minimized in a worker (time and memory limits: a mutant may crash or hang)
                    seeds = targets.load_seeds(t, seeds_dir)
                    mbase = os.path.join(base, f"min-{t}")
                    os.makedirs(mbase, exist_ok=True)
                    store_file = None
                    if store is not None:
                        store_file = os.path.join(mbase, "store.json")
                        with open(store_file, "w") as f:
                            json.dump(store, f)
                    pool = Pool(argparse.Namespace(seed=args.seed, jobs=1, timeout=args.timeout, mem_gib=max(args.mem_gib, targets.MEM_GIB[t]),
                                                   cli_every=0, target=t, seeds=seeds_dir, store=store_file, gc_strict=args.gc_strict), mbase)

                    def evaluate(desc):
                        box = {}
                        pool.run([(0, {"case": desc})], lambda k, r: box.setdefault("r", r))
                        return box["r"]

                    try:
                        saved = save_target_findings(tally, os.path.join(args.findings, f"seed{args.seed}", t), evaluate, args.keep, seeds)
                    finally:
                        pool.close()
            finally:
                if server is not None:
                    server.stop()
            wall = time.monotonic() - t0
            print(_target_table(tally))
            if tally.refusal_fields:
                print("refusals, top checks: " + ", ".join(f"{k} {v}" for k, v in tally.refusal_fields.most_common(10)))
            if t in ("gc", "gc-url"):
                print(f"entries gc removed (leftovers it proved unfinished): {tally.removed}")
            if tally.uncommitted_removed:
                print(f"rank files of unfinished set exports removed (not counted as committed; --gc-strict counts them): {tally.uncommitted_removed}")
            for f in sorted(tally.failures, key=lambda f: f["i"])[:15]:
                print(f"FAIL {t} #{f['i']} {f['cls']} {f['desc']['target']} {f['desc']['operator']} {'re-signed' if f['desc']['resign'] else 'raw'}: "
                      f"{f.get('error', '')} {f.get('where', '')} {f.get('reason', '')[:160]} {f.get('message', '')[:100]}")
            for p in saved:
                print(f"saved {p}")
            print(f"{tally.totals_line()}  wall {wall:.1f} s (seeds {seeds_s:.1f} s)", flush=True)
            results[t] = dict(tally.to_dict(), wall_s=round(wall, 1), seeds_s=round(seeds_s, 1), findings=saved)
            rc |= 1 if tally.failed else 0
    finally:
        shutil.rmtree(base, ignore_errors=True)
    total = sum(r["mutants"] for r in results.values())
    failed = sum(r["failed"] for r in results.values())
    wall = time.monotonic() - t_all
    print("overall: " + "  ".join(f"{t} {r['mutants']} ({r['failed']} failed, {r['wall_s']} s)" for t, r in results.items())
          + f"  total {total} mutants, {failed} failures, wall {wall:.1f} s, jobs {args.jobs}", flush=True)
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"targets": results, "mutants": total, "failed": failed, "wall_s": round(wall, 1), "jobs": args.jobs,
                       "seed": args.seed, "timeout_s": args.timeout}, f, indent=1, default=str)
    return 1 if rc or failed else 0


# ============================================================================== CLI


def _table(tally: Tally) -> str:
    cols = ["typed", "accepted-unchanged", "accepted-valid", "accepted-but-changed", "untyped", "hang", "cli-disagrees", "spec-disagrees", "harness-error"]
    short = ["typed", "acc-same", "acc-valid", "acc-changed", "untyped", "hangs", "cli-disagr", "spec-disag", "harness"]
    lines = [f"{'operator':<14} {'mutants':>8} " + " ".join(f"{s:>10}" for s in short)]
    for groupname, table in (("operator", tally.by_operator), ("target", tally.by_target), ("variant", tally.by_variant)):
        if groupname != "operator":
            lines.append(f"-- by {groupname}")
        for name in sorted(table):
            c = table[name]
            lines.append(f"{name[:14]:<14} {sum(c.values()):>8} " + " ".join(f"{c[k]:>10}" for k in cols))
    return "\n".join(lines)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--mutants", type=int, default=50000)
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--jobs", type=int, default=2, help="worker processes (0: in this process, no memory limit)")
    ap.add_argument("--timeout", type=float, default=10.0, help="seconds per mutant before it counts as a hang")
    ap.add_argument("--mem-gib", type=float, default=2.0, help="RLIMIT_AS of each worker, GiB")
    ap.add_argument("--cli-every", type=int, default=10, help="run the CLI on every Nth mutant (0: never)")
    ap.add_argument("--json", metavar="OUT", help="write counts and failures as JSON")
    ap.add_argument("--findings", default="/tmp/mutate-findings", help="where minimized failing inputs go (a seed<S> folder)")
    ap.add_argument("--keep", type=int, default=5, help="failures saved per class (distinct stack locations)")
    ap.add_argument("--replay", metavar="CASE_JSON", help="rerun one saved case in this process, with its traceback")
    ap.add_argument("--show", type=int, metavar="I", help="print mutant I's description and exit")
    ap.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--scratch", help=argparse.SUPPRESS)
    ap.add_argument("--quiet", action="store_true")
    ap.add_argument("--target", default="format",
                    help="what to mutate, comma-separated: format (the golden vectors through the readers), reshard, resume, "
                         "retract, gc, gc-url, migrate, chain, compact (tests/mutate_targets.py); all; new (all but format); "
                         "http (one live server, bodies over every /hsnap route: tests/mutate_http.py)")
    ap.add_argument("--url-mutants", type=int, help="mutants of gc-url (each a few dozen requests to SeaweedFS; default --mutants)")
    ap.add_argument("--seeds", help="a folder of seeds to reuse (default: built for the run)")
    ap.add_argument("--gc-strict", action="store_true",
                    help="count rank files of an unfinished set export (rank-N.hsnap in a marked staging directory without manifest) as committed")
    ap.add_argument("--store", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.target == "http":  # a live server, not a pool of workers: tests/mutate_http.py
        import mutate_http

        return mutate_http.main(["--mutants", str(args.mutants), "--seed", str(args.seed)] + (["--json", args.json] if args.json else [])
                                + (["--quiet"] if args.quiet else []))
    if args.worker:
        return _worker_main(args)
    if args.replay:
        with open(args.replay) as f:
            case = json.load(f)
        if case.get("target") in targets.TARGETS:
            return _replay_target(case, args.timeout)
    if args.target != "format":
        if args.show is not None:
            t = _targets_of(args.target)[0]
            seeds = targets.load_seeds(t, targets.build_seeds(t, args.seeds or seeds_cache(t)))
            print(json.dumps(targets.generator(seeds).generate(args.seed, args.show), indent=1))
            return 0
        return main_targets(args)
    inputs, groups = load_inputs()
    if args.show is not None:
        print(json.dumps(generate(args.seed, args.show, inputs, groups), indent=1))
        return 0
    if args.replay:
        with open(args.replay) as f:
            case = json.load(f)
        with tempfile.TemporaryDirectory(prefix="hsnap-replay-") as d:
            r = examine_in_process(case["desc"], Context(d, cli_every=1), args.timeout, cli=True)
        print(json.dumps({k: v for k, v in r.items() if k != "traceback"}, indent=1))
        if r.get("traceback"):
            print(r["traceback"])
        return 0 if r["cls"] in OK_CLASSES else 1

    t0 = time.monotonic()
    print(f"hsnap mutation run: {args.mutants} mutants, seed {args.seed}, jobs {args.jobs}, timeout {args.timeout} s/mutant, "
          f"RLIMIT_AS {args.mem_gib} GiB, CLI every {args.cli_every}", flush=True)
    print("inputs: " + ", ".join(f"{n} ({len(b)} B)" for n, b in inputs.items()), flush=True)
    tally = run(args.mutants, args.seed, jobs=args.jobs, timeout=args.timeout, mem_gib=args.mem_gib, cli_every=args.cli_every,
                progress=not args.quiet)
    wall = time.monotonic() - t0
    saved = []
    if tally.failures:
        out_dir = os.path.join(args.findings, f"seed{args.seed}")
        base = tempfile.mkdtemp(prefix="hsnap-mutate-min-", dir="/dev/shm" if os.path.isdir("/dev/shm") else None)
        try:
            if args.jobs > 0:
                pool = Pool(argparse.Namespace(seed=args.seed, jobs=1, timeout=args.timeout, mem_gib=args.mem_gib, cli_every=args.cli_every), base)

                def evaluate(desc):
                    box = {}
                    pool.run([(0, {"case": desc, "cli": True})], lambda k, r: box.setdefault("r", r))
                    return box["r"]
            else:
                pool, ctx = None, Context(os.path.join(base, "c"))

                def evaluate(desc):
                    return examine_in_process(desc, ctx, args.timeout, cli=True)
            try:
                saved = save_findings(tally, out_dir, evaluate, args.keep, inputs, groups)
            finally:
                if pool is not None:
                    pool.close()
        finally:
            shutil.rmtree(base, ignore_errors=True)
    print(_table(tally))
    print("typed refusals by class: " + ", ".join(f"{k} {v}" for k, v in tally.typed_errors.most_common()))
    print("re-signed refusals by layer of checks: " + ", ".join(f"{k} {v}" for k, v in tally.typed_layers.most_common()))
    print("re-signed refusals, top checks: " + ", ".join(f"{k} {v}" for k, v in tally.typed_fields.most_common(12)))
    if tally.independent:
        print("accepted-valid mutants the independent reader refuses where it deviates from the spec: "
              + ", ".join(f"{k} {v}" for k, v in tally.independent.items()))
        for x in tally.independent_examples[:5]:
            print(f"  #{x['i']} {x['target']} {json.dumps(x['ops'])[:160]}: {x['independent'][:160]}")
    if tally.notes:
        print("typed refusals with notes: " + ", ".join(f"{k} {v}" for k, v in tally.notes.items()))
    for f in sorted(tally.failures, key=lambda f: f["i"])[:20]:
        print(f"FAIL #{f['i']} {f['cls']} {f['desc']['target']} {f['desc']['operator']} "
              f"{'re-signed' if f['desc']['resign'] else 'raw'}: {f.get('error', '')} {f.get('where', '')} {f.get('reason', '')} {f.get('message', '')[:120]}")
    for p in saved:
        print(f"saved {p}")
    print(f"accepted-valid: {tally.total['accepted-valid']}  cli-disagrees: {tally.total['cli-disagrees']}  "
          f"harness-errors: {tally.total['harness-error']}  CLI checked: {tally.cli_checked}  wall: {wall:.1f} s")
    print(tally.totals_line(), flush=True)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(dict(tally.to_dict(), wall_s=round(wall, 1), jobs=args.jobs, timeout_s=args.timeout, mem_gib=args.mem_gib,
                           inputs={n: {"bytes": len(b), "xxh3_128": xxhash.xxh3_128_hexdigest(b)} for n, b in inputs.items()},
                           findings=saved), f, indent=1)
    return 1 if tally.failed else 0


targets.use_core(argparse.Namespace(build=build, _draw=_draw, DEFAULTS=DEFAULTS))

if __name__ == "__main__":
    sys.exit(main())
