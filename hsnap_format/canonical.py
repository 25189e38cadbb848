"""Canonical JSON (RFC 8785, JCS) for headers and manifests.

The same content always gives the same bytes: keys sorted, no whitespace, strings
escaped minimally and stored as UTF-8, numbers in ECMAScript's shortest form.
Decoding is strict: duplicate keys, NaN/Infinity, non-canonical bytes, nesting
deeper than ``max_depth`` are refused. Keys must be ASCII, which makes JCS's
UTF-16 key order equal to plain code-point order.
"""

from __future__ import annotations

import json
import math
import re
from typing import Any

import orjson


MAX_SAFE_INTEGER = 2**53 - 1


class CanonicalError(ValueError):
    """Raised with a short reason; callers wrap it in a typed HsnapError."""


def _number(x: float) -> str:
    if not math.isfinite(x):
        raise CanonicalError(f"non-finite number {x!r}")
    if x == 0:
        return "0"
    sign = "-" if x < 0 else ""
    mant, _, exp = repr(abs(x)).partition("e")
    int_part, _, frac = mant.partition(".")
    digits = (int_part + frac).lstrip("0")
    # decimal exponent n such that value = 0.d1d2... * 10**n
    n = len(int_part.lstrip("0")) if int_part.strip("0") else -(len(frac) - len(frac.lstrip("0")))
    n += int(exp or 0)
    digits = digits.rstrip("0") or "0"
    k = len(digits)
    if k <= n <= 21:
        return sign + digits + "0" * (n - k)
    if 0 < n <= 21:
        return sign + digits[:n] + "." + digits[n:]
    if -6 < n <= 0:
        return sign + "0." + "0" * (-n) + digits
    e = n - 1
    body = digits[0] + ("." + digits[1:] if k > 1 else "")
    return f"{sign}{body}e{'+' if e >= 0 else '-'}{abs(e)}"


def _encode(obj: Any, out: list[str], depth: int) -> None:
    if depth > 64:
        raise CanonicalError("nesting too deep")
    if obj is None:
        out.append("null")
    elif obj is True:
        out.append("true")
    elif obj is False:
        out.append("false")
    elif isinstance(obj, int):
        if abs(obj) > MAX_SAFE_INTEGER:  # JCS numbers are IEEE doubles
            raise CanonicalError(f"integer {obj} exceeds 2**53")
        out.append(str(int(obj)))
    elif isinstance(obj, float):
        out.append(_number(obj))
    elif isinstance(obj, str):
        out.append(json.dumps(obj, ensure_ascii=False))
    elif isinstance(obj, (list, tuple)):
        out.append("[")
        for i, item in enumerate(obj):
            if i:
                out.append(",")
            _encode(item, out, depth + 1)
        out.append("]")
    elif isinstance(obj, dict):
        out.append("{")
        for i, key in enumerate(sorted(obj)):
            if not isinstance(key, str) or not key.isascii():
                raise CanonicalError(f"object key {key!r} is not an ASCII string")
            if i:
                out.append(",")
            out.append(json.dumps(key, ensure_ascii=False))  # as a value: DEL raw, not \u007f (spec 4)
            out.append(":")
            _encode(obj[key], out, depth + 1)
        out.append("}")
    else:
        raise CanonicalError(f"cannot encode {type(obj).__name__}")


def dumps(obj: Any) -> bytes:
    out: list[str] = []
    _encode(obj, out, 0)
    try:
        return "".join(out).encode("utf-8")
    except UnicodeEncodeError as e:  # lone surrogates
        raise CanonicalError(f"string is not valid Unicode: {e.reason}") from None


def _no_duplicates(pairs):
    obj = {}
    for key, value in pairs:
        if key in obj:
            raise CanonicalError(f"duplicate key {key!r}")
        obj[key] = value
    return obj


def _no_constant(name):
    raise CanonicalError(f"{name} is not JSON")


def _depth_ok(data: bytes, max_depth: int) -> bool:
    # Cheap pre-scan so a hostile '[[[[...' never reaches the recursive parser.
    depth = 0
    in_str = esc = False
    for b in data:
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
            if depth > max_depth:
                return False
        elif b in (0x5D, 0x7D):
            depth -= 1
    return True


# Spec 4: integer literals over 400 digits are refused. No canonical number is longer
# (a double's ECMAScript form is at most 25 characters), so the same bound applies to
# every number literal and keeps conversion cost bounded.
MAX_NUMBER_LITERAL = 400


def _parse_int(text: str):
    digits = len(text) - text.startswith("-")
    if digits > MAX_NUMBER_LITERAL:
        raise CanonicalError(f"integer literal of {digits} digits (at most {MAX_NUMBER_LITERAL})")
    value = int(text)
    if abs(value) <= MAX_SAFE_INTEGER:
        return value
    # Beyond 2**53 - 1 a literal denotes the IEEE double it rounds to (spec 4); from
    # 309 digits on that is beyond the largest double: refused like Infinity.
    try:
        return float(value)
    except OverflowError:
        raise CanonicalError(f"integer literal of {digits} digits is beyond the double range") from None


def _parse_float(text: str) -> float:
    if len(text) > MAX_NUMBER_LITERAL:
        raise CanonicalError(f"number literal of {len(text)} characters (at most {MAX_NUMBER_LITERAL})")
    value = float(text)  # a string never overflows: 1e400 gives inf, refused here
    if not math.isfinite(value):
        raise CanonicalError(f"number {text[:32]} is beyond the double range")
    return value


# Fast path: the C decoder and encoder do the work; the pure-Python
# ``_encode`` above stays the definition and decides every case the fast path does not
# prove. Accepting needs all of:
#   * ``json.loads`` without hooks but parse_float/parse_constant succeeds;
#   * no number literal of 16 or more digits (ints near or beyond 2**53, which JCS
#     reads as doubles, and over-long literals go to the full path);
#   * every float literal already in its ECMAScript form (``_number``) — checked per
#     literal, so JCS would print each float exactly as it stands;
#   * every key is ASCII, as JCS requires (implied when the bytes are; else checked);
#   * ``orjson.dumps(obj, OPT_SORT_KEYS)`` (compact, UTF-8, keys sorted) gives ``data``
#     back. With the float literals fixed above, JCS and orjson differ only in how some
#     floats are spelled (a mismatch: the full path) and in the key checks, so this is
#     ``dumps(obj) == data``. Duplicate keys shrink the dict (mismatch),
#     whitespace, escapes like ``\/`` or ``\u0041``, trailing data all mismatch or fail.
# Whatever fails or differs falls back to the full path below, which gives the same
# verdict and message as before; a mismatch found here is never a refusal by itself.
# A number literal of 16+ digits starts the text or follows ':' ',' '[' (then maybe '-'):
# digits read as '0' and those three as '!', it is '!0000000000000000' or '!-000...'.
# (A string that happens to spell one only sends the header to the full path.)
_NUMBER_VIEW = bytes.maketrans(b"123456789:,[", b"000000000!!!")
_LONG_NUMBER = (b"!" + b"0" * 16, b"!-" + b"0" * 16)


# a number token ends at ',' ']' '}' or the end ('.', 'e', 'E' continue a float): a digit run
# inside a string ("sha256:0123...ab") usually does not, and then stays on the fast path
_LONG_NUMBER_TOKEN = re.compile(rb"(?:^|[:,\[])-?[0-9]{16,}(?:[,\]}.eE]|\Z)")


def _number_view(data: bytes) -> bytes:
    return b"!" + data.translate(_NUMBER_VIEW)


def _has_long_number(data: bytes, view: bytes) -> bool:
    if _LONG_NUMBER[0] not in view and _LONG_NUMBER[1] not in view:
        return False
    return _LONG_NUMBER_TOKEN.search(data) is not None  # rare: the precise (slower) look


# In the same view a float literal is '!', maybe '-', digits, then '.' or an exponent: none found, the text has
# none (a string that spells one is found too: it only takes the slower decoder)
_FLOAT_IN_VIEW = re.compile(rb"!-?0+[.eE]")


_NOT_QUOTE_OR_BRACKET = bytes(b for b in range(256) if b not in b'"[]{}')
_BRACKETS_AS_SQUARE = bytes.maketrans(b"{}", b"[]")


class _NotFast(Exception):
    pass


def _float_fast(text: str) -> float:
    value = float(text) if len(text) <= MAX_NUMBER_LITERAL else math.nan
    if not math.isfinite(value) or _number(value) != text:
        raise _NotFast
    return value


def _canonical_depth(data: bytes, limit: int) -> int:
    """Nesting depth of ``data`` (at most ``limit + 1``), which must already be canonical
    JSON. Inside its strings a backslash starts an escape pair and every quote is escaped,
    so dropping ``\\\\`` then ``\\"`` leaves only the quotes that delimit strings; of the
    brackets outside them, each pass drops the innermost pairs: passes = depth."""
    if b"\\" in data:
        data = data.replace(b"\\\\", b"").replace(b'\\"', b"")
    # Quotes and brackets only. Left to right, a string without brackets is a '""' pair;
    # a string with one keeps its opening quote, so no quote left = no bracket in a string.
    skeleton = data.translate(_BRACKETS_AS_SQUARE, _NOT_QUOTE_OR_BRACKET).replace(b'""', b"")
    if b'"' in skeleton:
        skeleton = b"".join(data.split(b'"')[::2]).translate(_BRACKETS_AS_SQUARE, _NOT_QUOTE_OR_BRACKET)
    depth = 0
    while skeleton and depth <= limit:
        skeleton = skeleton.replace(b"[]", b"")
        depth += 1
    return depth


def _not_fast(_name):
    raise _NotFast


def _ascii_keys(pairs):
    if not all(k.isascii() for k, _ in pairs):
        raise _NotFast
    return dict(pairs)


def _loads_fast(data: bytes, max_depth: int):
    view = _number_view(data)
    if _has_long_number(data, view):
        raise _NotFast
    if data.isascii() and _FLOAT_IN_VIEW.search(view) is None:
        # every key ASCII, no float literal to check one by one (a string that spells one only takes the next
        # branch): orjson's decoder, 2x json's. It refuses NaN, Infinity and a lone surrogate (the full path decides)
        obj = orjson.loads(data)
    elif data.isascii():  # every key is ASCII
        text = data.decode("ascii")
        obj = json.loads(text, parse_float=_float_fast, parse_constant=_not_fast)
    else:  # keys are checked one object at a time (slower, still C parsing)
        text = data.decode("utf-8")
        obj = json.loads(text, parse_float=_float_fast, parse_constant=_not_fast, object_pairs_hook=_ascii_keys)
    # orjson's compact sorted UTF-8 is the definition's bytes for every string, key, int and
    # bool (tests/test_perf_open.py: every code point); a float it spells otherwise, an int
    # over 64 bits or a lone surrogate only sends the header the long way
    if orjson.dumps(obj, option=orjson.OPT_SORT_KEYS) != data:
        raise _NotFast
    if _canonical_depth(data, max_depth) > max_depth:
        raise CanonicalError(f"nesting deeper than {max_depth}")
    return obj


def loads(data: bytes, *, max_depth: int = 16) -> Any:
    """Decode canonical JSON bytes, refusing anything :func:`dumps` would not produce."""
    try:
        return _loads_fast(data, max_depth)
    except CanonicalError:
        raise
    except Exception:  # noqa: BLE001 - not proven canonical here: the full path decides
        pass
    if not _depth_ok(data, max_depth):
        raise CanonicalError(f"nesting deeper than {max_depth}")
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError as e:
        raise CanonicalError(f"not UTF-8 at byte {e.start}") from None
    try:
        obj = json.loads(
            text,
            object_pairs_hook=_no_duplicates,
            parse_constant=_no_constant,
            parse_int=_parse_int,
            parse_float=_parse_float,
        )
    except CanonicalError:
        raise
    except (ValueError, RecursionError, OverflowError) as e:  # every decoding failure is a CanonicalError
        raise CanonicalError(f"not JSON: {e}") from None
    if dumps(obj) != data:
        raise CanonicalError("not in canonical form (RFC 8785)")
    return obj
