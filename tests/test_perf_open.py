"""The fast paths of an open decide exactly as the checks they shortcut.

``canonical.loads`` first tries a proof with the C decoder/encoder and falls back to
the pure-Python definition (``_encode``) for anything it does not prove; the reader
checks the section table column by column and falls back to the entry-by-entry checks
for the error; the writer encodes its own section table with a format string. Each
must accept, refuse and return exactly what the long way does — behaviour, never time.
"""

from __future__ import annotations

import dataclasses
import json
import os
import random
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import craft
from hsnap_format import canonical, reader, writer
from hsnap_format.layout import record_sections, state_sections
from hsnap_format import reference as ref

VEC = Path(__file__).resolve().parents[1] / "spec" / "vectors"
HEADERS = [craft.split(p.read_bytes()).header for p in (VEC / "hybrid.hsnap", VEC / "mla-fp8.hsnap", VEC / "hybrid-tp2" / "rank-1.hsnap")]
FUZZ = settings(max_examples=int(os.environ.get("HSNAP_FUZZ_EXAMPLES", 300)), deadline=None,
                suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])


def _outcome(fn, *a, **k):
    """repr of the value (1 and 1.0 and True differ) or the error's type and message."""
    try:
        return ("ok", repr(fn(*a, **k)))
    except canonical.CanonicalError as e:
        return ("refused", str(e))


def _full(data: bytes, max_depth: int = 16):
    """canonical.loads with its fast path off: the definition."""
    saved = canonical._loads_fast

    def off(*_a, **_k):
        raise canonical._NotFast

    canonical._loads_fast = off
    try:
        return _outcome(canonical.loads, data, max_depth=max_depth)
    finally:
        canonical._loads_fast = saved


def _same(data: bytes, max_depth: int = 16) -> None:
    assert _outcome(canonical.loads, data, max_depth=max_depth) == _full(data, max_depth), data[:200]


TRICKY = [
    b'{"a":1e-7}', b'{"a":1e-07}', b'{"a":1.5e+21}', b'{"a":1.5e21}', b"[100000000000000000000]", b"[1e+21]",
    b"9007199254740991", b"9007199254740992", b"9007199254740993", b"-9007199254740992", b"123456789012345", b'{"a":"sha256:12345678901234567890ab"}', b'{"a":"x:1234567890123456,"}', b"[12345678901234567]",
    b"1234567890123456", b'["1234567890123456"]', b"[0.1234567890123456]", b"[1.0]", b"[-0]", b"[-0.0]", b"[0]",
    b'"\\u0041"', b'"\\/"', b'"\\u00e9"', '"é"'.encode(), b'"\\ud800"', b'{"\\u00e9":1}', '{"é":1}'.encode(),
    b'{"a":1,"a":1}', b'{"b":1,"a":2}', b"[1, 2]", b" [1]", b"[1]\n", b"NaN", b"[Infinity]", b"[1e400]", b"[tru]",
    b"[" * 16 + b"]" * 16, b"[" * 17 + b"]" * 17, b"{" + b'"a":[' * 16 + b"1" + b"]" * 16 + b"}",
    b'["[[[[[[[[[[[[[[[[[[[["]', b'["\\\\","[[[[[[[[[[[[[[[[[[[[[[","\\""]', b'[["]]]]]]]]]]]]]]"],[[[[[[[[[[[[[[[[[[1]]]]]]]]]]]]]]]]]]]',
    b'{"a\\"[":"x"}', b'["\\\\"]', b"[" * 2000 + b"]" * 2000, b"", b"{}", b"[]", b'"\x7f"', b'"\\u007f"', b'"\\n"', b'"\x01"',
]


@pytest.mark.parametrize("data", TRICKY)
def test_canonical_fast_path_decides_as_the_definition(data):
    _same(data)
    _same(data, max_depth=64)


def _reference_header(tokens: int = 53, wild: bool = False) -> bytes:
    geom, rec = ref.geometry(), ref.record(tokens)
    specs = state_sections(geom, tokens) + record_sections(len(rec.prompt_ids), len(rec.output_ids), True, 0, None)
    body = {"format": "hsnap", "digest": "xxh3-128", "identity": ref.identity().to_header(), "geometry": geom.to_header(),
            "request": rec.to_header(), "features": {"required": [], "optional": []}}
    if wild:  # non-ASCII strings, and a hash whose hex starts with 16+ decimal digits after ':'
        body["request"]["stop"]["stop_strings"] = ["停止", "🛑", "§"]
        body["identity"]["weights_hash"] = "xxh3-128:00112233445566778899aabbccddeeff"
    return writer.build_header(body, specs, ["0123456789abcdef" * 2] * len(specs), 1 << 14)[0]


def test_the_fast_path_is_taken_for_real_headers():
    # a refusal here would be a silent fall back to the ~4x slower path: the bench's seed
    # header, one with non-ASCII stop strings and a hash of 16+ digits after ':', a vector
    for h in (_reference_header(), _reference_header(4096), _reference_header(wild=True), HEADERS[2]):
        assert canonical._loads_fast(h, 16) == json.loads(h)
    assert canonical._loads_fast(HEADERS[0], 16) == json.loads(HEADERS[0])  # its float 0.00001: orjson's spelling too
    # a float that orjson spells otherwise than ECMAScript (1e-6 vs 0.000001) takes the long way, same result
    for data in (b'{"a":0.000001}', b'[0.0000015,2]'):
        with pytest.raises(canonical._NotFast):
            canonical._loads_fast(data, 16)
        _same(data)


def test_the_fast_paths_encoder_spells_every_string_as_the_definition():
    # the fast path accepts when orjson re-encodes the bytes: each code point must come out
    # exactly as the definition writes it (escapes, raw UTF-8), as a value and as a key
    import orjson

    chars = [chr(c) for c in range(0x110000) if not 0xD800 <= c <= 0xDFFF]
    for i in range(0, len(chars), 4096):
        block = chars[i : i + 4096]
        assert orjson.dumps(block) == canonical.dumps(block)
        keys = {c: 0 for c in block if c.isascii()}
        assert orjson.dumps(keys, option=orjson.OPT_SORT_KEYS) == canonical.dumps(keys)


values = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats(allow_nan=False, allow_infinity=False)
    | st.text(max_size=8) | st.sampled_from([2**53, 2**53 + 1, 10**15, 10**16, 1e-7, 1e21, 5e-324, -0.0, "[", "]\"{", "\\"]),
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=5), inner, max_size=4),
    max_leaves=25,
)


@FUZZ
@given(values)
def test_fast_path_equals_definition_on_every_spelling(value):
    spellings = [json.dumps(value, sort_keys=True, separators=(",", ":"), ensure_ascii=False).encode("utf-8", "surrogatepass"),
                 json.dumps(value, sort_keys=True, separators=(",", ":")).encode(), json.dumps(value).encode()]
    try:
        spellings.append(canonical.dumps(value))
    except canonical.CanonicalError:
        pass
    for data in spellings:
        _same(data)
        _same(data, max_depth=64)


@FUZZ
@given(st.integers(0, len(HEADERS) - 1), st.lists(st.tuples(st.integers(0, 1 << 20), st.integers(0, 255)), min_size=1, max_size=3))
def test_fast_path_equals_definition_on_mutated_headers(which, edits):
    h = bytearray(HEADERS[which])
    for at, b in edits:
        h[at % len(h)] = b
    _same(bytes(h))


# ---------------------------------------------------------------- section table


def _table_and_bounds(h: bytes):
    obj = json.loads(h)
    secs = obj["sections"]
    return secs, secs[0]["offset"], secs[-1]["offset"] + secs[-1]["length"]


def _slow_sections(table, start, end):
    saved = reader._sections_fast
    reader._sections_fast = lambda *a, **k: None
    try:
        return reader.parse_sections(table, "<t>", start, end)
    finally:
        reader._sections_fast = saved


def test_section_fast_path_is_taken_and_equal():
    for h in HEADERS:
        table, start, end = _table_and_bounds(h)
        fast = reader._sections_fast(table, start, end)
        assert fast is not None and fast == _slow_sections(table, start, end)
        assert all(type(s) is reader.SectionInfo and s.__dict__ == vars(s) for s in fast)
        with pytest.raises(dataclasses.FrozenInstanceError):
            fast[0].name = "x"


MUTATIONS = [
    ("layer", True), ("layer", -1), ("layer", 1 << 16), ("layer", 2.0), ("layer", "1"), ("shape", [1, True]), ("shape", [-1]),
    ("shape", [1 << 40]), ("shape", [1.0]), ("shape", [1] * 9), ("shape", "x"), ("offset", True), ("offset", 1.5), ("length", -1),
    ("length", 0), ("digest", "A" * 32), ("digest", "0" * 31), ("digest", "0" * 33), ("digest", 5), ("dtype", "bf16"), ("dtype", ["x"]),
    ("kind", "attn"), ("kind", None), ("name", 3), ("name", "attn.3.k"), ("name", "mamba.0.conv.0"), ("offset", 0),
]


@pytest.mark.parametrize("field,value", MUTATIONS)
def test_section_fast_path_accepts_only_what_the_checks_accept(field, value):
    rnd = random.Random(7)
    for h in HEADERS:
        table, start, end = _table_and_bounds(h)
        for i in {0, len(table) - 1, rnd.randrange(len(table))}:
            t = [dict(e) for e in table]
            t[i][field] = value
            fast = reader._sections_fast(t, start, end)
            try:
                slow = _slow_sections(t, start, end)
            except reader.HsnapError:
                assert fast is None  # refused the long way: the fast path never accepts it
                continue
            assert fast is None or fast == slow
    for extra in ({"extra": 1}, {}):
        t = [dict(e) for e in table]
        t[0].update(extra) if extra else t[0].pop("digest")
        assert reader._sections_fast(t, start, end) is None


# ---------------------------------------------------------------- writer table


def test_writer_table_encoding_equals_canonical():
    geom, rec = ref.geometry(), ref.record(53)
    specs = state_sections(geom, 53) + record_sections(44, 10, True, 0, None)
    body = {"format": "hsnap", "digest": "xxh3-128", "identity": ref.identity().to_header(), "geometry": geom.to_header(),
            "request": rec.to_header(), "features": {"required": [], "optional": []}}
    for digests in (["0" * 32] * len(specs), [f"{i:032x}" for i in range(len(specs))]):
        header, table, _ = writer.build_header(body, specs, digests, 1 << 14)
        assert writer._table_json(table) is not None  # the shortcut is taken...
        assert header == canonical.dumps({**body, "sections": table})  # ...and is the canonical encoding
    # outside what the shortcut covers: the long way, same bytes or the same refusal
    for change in ({"name": 'a"b'}, {"name": "é"}, {"name": "a\nb"}, {"offset": 2**53}, {"layer": True}, {"shape": [1.0]}, {"digest": 5}):
        t = [dict(table[0], **change)] + table[1:]
        assert writer._table_json(t) is None
    body2 = {**body, "zzz": 1}  # a key sorting after "sections": the shortcut must not append
    header, table, _ = writer.build_header(body2, specs, ["0" * 32] * len(specs), 1 << 14)
    assert header == canonical.dumps({**body2, "sections": table})


def test_a_key_with_del_is_judged_like_the_definition():
    """Found by the hypothesis test above: the one-call fast check wrote a key's DEL raw
    while ``dumps`` escaped keys (\\u007f). Spec 4 (JCS) writes DEL raw in keys as in values
    (an implementer from the spec alone disagreed), so both paths do."""
    from hsnap_format import canonical

    raw = b'{"d\x7fgest":1}'
    escaped = b'{"d\\u007fgest":1}'
    assert canonical.loads(raw) == {"d\x7fgest": 1}
    with pytest.raises(canonical.CanonicalError):
        canonical.loads(escaped)
    assert canonical.dumps({"d\x7fgest": 1}) == raw
    assert canonical.loads(b'{"a":"x\x7fy"}') == {"a": "x\x7fy"}  # in values DEL stays raw
    _same(raw)
    _same(escaped)
