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
from typing import Any


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
            out.append(json.dumps(key))
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


def _parse_int(text: str):
    if len(text) > 400:
        raise CanonicalError("integer literal too long")
    value = int(text)
    return value if abs(value) <= MAX_SAFE_INTEGER else float(value)


def loads(data: bytes, *, max_depth: int = 16) -> Any:
    """Decode canonical JSON bytes, refusing anything :func:`dumps` would not produce."""
    if not _depth_ok(data, max_depth):
        raise CanonicalError(f"nesting deeper than {max_depth}")
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError as e:
        raise CanonicalError(f"not UTF-8 at byte {e.start}") from None
    try:
        obj = json.loads(
            text, object_pairs_hook=_no_duplicates, parse_constant=_no_constant, parse_int=_parse_int
        )
    except CanonicalError:
        raise
    except (ValueError, RecursionError) as e:
        raise CanonicalError(f"not JSON: {e}") from None
    if dumps(obj) != data:
        raise CanonicalError("not in canonical form (RFC 8785)")
    return obj
