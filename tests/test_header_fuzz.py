"""Property tests of the header decoder: whatever the bytes, only HsnapError (or, from
canonical.loads itself, CanonicalError) comes out, and canonical JSON round-trips.

Four generators: random bytes; JSON values through dumps/loads; byte-level
mutations of the vectors' headers; value-level mutations of the vectors' headers,
packed into a whole file with every digest and check recomputed (tests/craft.py)
so that Snapshot() gets past the integrity layer to the structural checks.
"""

from __future__ import annotations

import json
import math
import os
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import craft
from hsnap_format import canonical
from hsnap_format.errors import HsnapError
from hsnap_format.reader import Snapshot, parse_header

VEC = Path(__file__).resolve().parents[1] / "spec" / "vectors"
FILES = [VEC / "attention-only.hsnap", VEC / "hybrid.hsnap", VEC / "mla-fp8.hsnap", VEC / "two-rank" / "rank-1.hsnap"]
DATA = [p.read_bytes() for p in FILES]
HEADERS = [craft.split(d).header for d in DATA]

# HSNAP_FUZZ_EXAMPLES=20000 for a longer soak; the default keeps the file under 10 s on 2 cores
FUZZ = settings(max_examples=int(os.environ.get("HSNAP_FUZZ_EXAMPLES", 250)), deadline=None, suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])

ascii_keys = st.text(st.characters(min_codepoint=0x20, max_codepoint=0x7E), max_size=12)
scalars = (
    st.none()
    | st.booleans()
    | st.integers(-(2**53) + 1, 2**53 - 1)
    | st.floats(allow_nan=False, allow_infinity=False)
    | st.text(max_size=20)
)
json_values = st.recursive(scalars, lambda inner: st.lists(inner, max_size=4) | st.dictionaries(ascii_keys, inner, max_size=4), max_leaves=20)
# hostile values: also big ints, non-ASCII keys, deep lists
wild_scalars = scalars | st.integers() | st.sampled_from([2**53, -(2**53), 2**64, 10**400, 1e308, 5e-324, -0.0, "", "\x00", "\u2028"])
wild_values = st.recursive(wild_scalars, lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=6), inner, max_size=4), max_leaves=12)


def decodes_or_refuses(data: bytes) -> None:
    try:
        canonical.loads(data)
    except canonical.CanonicalError:
        pass
    try:
        parse_header(data, "<fuzz>")
    except HsnapError:
        pass


@FUZZ
@given(st.binary(max_size=600))
def test_random_bytes(data):
    decodes_or_refuses(data)


@FUZZ
@given(json_values)
def test_canonical_round_trip(value):
    data = canonical.dumps(value)
    data.decode("utf-8")  # always valid UTF-8
    back = canonical.loads(data, max_depth=64)
    assert canonical.dumps(back) == data
    # the same value: numbers compare by value (1.0 comes back as 1, an integer-valued
    # double beyond 2**53 as a float: JCS numbers are IEEE doubles)
    assert back == value


@FUZZ
@given(json_values)
def test_non_canonical_spellings_refused_or_identical(value):
    for text in (json.dumps(value), json.dumps(value, sort_keys=True, separators=(",", ":")), json.dumps(value, ensure_ascii=False, indent=1)):
        data = text.encode()
        try:
            got = canonical.loads(data, max_depth=64)
        except canonical.CanonicalError:
            continue
        assert data == canonical.dumps(got)  # accepted only when byte-identical to the canonical form


@st.composite
def mutated_bytes(draw):
    data = bytearray(draw(st.sampled_from(HEADERS)))
    for _ in range(draw(st.integers(1, 4))):
        op = draw(st.sampled_from(["set", "insert", "delete", "duplicate"]))
        i = draw(st.integers(0, len(data) - 1)) if data else 0
        if op == "set" and data:
            data[i] = draw(st.sampled_from(b'{}[]",:0123456789-.eE\\tfn \x00\x7f\xff') | st.integers(0, 255))
        elif op == "insert":
            data[i:i] = draw(st.binary(min_size=1, max_size=8) | st.sampled_from([b"[", b"]", b",", b'"', b"{", b"}", b"1", b"-0", b"1e999", b"NaN", b'"a":1,']))
        elif op == "delete":
            del data[i : i + draw(st.integers(1, 16))]
        else:
            j = draw(st.integers(i, min(len(data), i + 64)))
            data[i:i] = data[i:j]
    return bytes(data)


@FUZZ
@given(mutated_bytes())
def test_mutated_header_bytes(data):
    decodes_or_refuses(data)


@pytest.fixture(scope="module")
def scratch(tmp_path_factory):
    return tmp_path_factory.mktemp("fuzz") / "f.hsnap"


def open_all_the_way(path) -> None:
    """Open, and when that succeeds, read everything: only HsnapError may escape."""
    try:
        snap = Snapshot(path)
    except HsnapError:
        return
    try:
        snap.verify()
        snap.record()
        for s in snap.sections:
            snap[s.name]
    except HsnapError:
        pass
    finally:
        snap.close()


@FUZZ
@given(st.integers(0, len(DATA) - 1), mutated_bytes())
def test_mutated_header_bytes_in_a_file(scratch, which, header):
    craft.write(scratch, craft.rebuild(DATA[which], header))
    open_all_the_way(scratch)


def _paths(obj, prefix=()):
    yield prefix
    if isinstance(obj, dict):
        for k, v in obj.items():
            yield from _paths(v, prefix + (k,))
    elif isinstance(obj, list):
        for i, v in enumerate(obj):
            yield from _paths(v, prefix + (i,))


TREES = [craft.split(d).header_obj for d in DATA]
PATHS = [list(_paths(t)) for t in TREES]


@st.composite
def mutated_trees(draw):
    which = draw(st.integers(0, len(TREES) - 1))
    tree = json.loads(json.dumps(TREES[which]))
    for _ in range(draw(st.integers(1, 3))):
        path = draw(st.sampled_from(PATHS[which]))
        parent, key = tree, None
        try:
            for k in path[:-1]:
                parent = parent[k]
            key = path[-1] if path else None
            _ = parent[key] if key is not None else None
        except (KeyError, IndexError, TypeError):
            continue  # an earlier mutation removed it
        op = draw(st.sampled_from(["replace", "delete", "add", "tweak"]))
        if key is None:
            continue
        if op == "replace":
            parent[key] = draw(json_values)
        elif op == "delete":
            del parent[key]
        elif op == "add" and isinstance(parent, dict):
            parent[draw(ascii_keys)] = draw(json_values)
        elif op == "tweak":
            v = parent[key]
            if isinstance(v, bool):
                parent[key] = not v
            elif isinstance(v, int):
                parent[key] = draw(st.sampled_from([v + 1, v - 1, -v, 0, 2**53 - 1, 2 * v, v + 4096]))
            elif isinstance(v, str):
                parent[key] = draw(st.sampled_from([v + "x", v[:-1], v.upper(), "", "float8_e5m2", "conv", "mla", "swa"]))
            elif isinstance(v, list) and v:
                parent[key] = draw(st.sampled_from([v[:-1], v + v[-1:], v[::-1], []]))
    return which, tree


@FUZZ
@given(mutated_trees())
def test_mutated_header_values_in_a_file(scratch, case):
    which, tree = case
    try:
        data = craft.rebuild(DATA[which], tree)
    except canonical.CanonicalError:
        return
    craft.write(scratch, data)
    open_all_the_way(scratch)


@FUZZ
@given(wild_values)
def test_wild_values_into_header_fields(scratch, value):
    """Any JSON value (or one the encoder refuses) in the request/geometry/identity/sections slots."""
    tree = json.loads(json.dumps(TREES[1]))
    for slot in ("request", "geometry", "identity", "sections", "features"):
        t = json.loads(json.dumps(tree))
        t[slot] = value
        try:
            data = craft.rebuild(DATA[1], t)
        except canonical.CanonicalError:
            return
        craft.write(scratch, data)
        open_all_the_way(scratch)


def test_number_forms_match_ecmascript():
    """Spot checks of the Number-to-String rule the spec cites (RFC 8785 section 3.2.2.3)."""
    cases = [(0.0, "0"), (-0.0, "0"), (1.0, "1"), (0.7, "0.7"), (1e-05, "0.00001"), (1e-06, "0.000001"), (1e-07, "1e-7"),
             (1e21, "1e+21"), (1e20, "100000000000000000000"), (123456789012345680000.0, "123456789012345680000"),
             (5e-324, "5e-324"), (1.7976931348623157e308, "1.7976931348623157e+308"), (-1.5, "-1.5"),
             (0.1 + 0.2, "0.30000000000000004"), (2.0**53, "9007199254740992")]  # pairs: -0.0 == 0.0 as a dict key
    for x, text in cases:
        assert canonical.dumps(x) == text.encode(), x
        if not (x == 0 and math.copysign(1, x) < 0):
            assert canonical.loads(text.encode()) == x
