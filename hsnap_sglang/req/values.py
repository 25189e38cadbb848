"""How a carried value outside the typed record is checked (``Field.value`` of the field table): from what the
file stores to the typed value resume sets — a type, a range (in terms of the record's own counts, :class:`Bounds`),
a bounded JSON text.  Each check raises :class:`InvalidValue`; ``record.decode_carried`` names the file and the
record field."""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from typing import Callable

from hsnap_format.errors import Phrase

MAX_PLAIN = 2**53 - 1  # a JSON number in the header (canonical JSON)
TOKEN_ID_LIMIT = 2**31  # token ids are stored as int32
_MAX_JSON_DEPTH = 32  # nesting of a JSON text carried in a string (kv_hints payloads, input logprobs)
_MAX_LIST = 1 << 20


class InvalidValue(Exception):
    """A value its check refuses: what was expected, what was found (decode_carried names the file and field)."""

    def __init__(self, expected, found) -> None:
        super().__init__(expected)
        self.expected, self.found = expected, found


@dataclass(frozen=True)
class Bounds:
    """What a carried value is checked against: the record's counts and the carried vocab."""

    prompt: int
    output: int
    position: int
    swa_start: int
    vocab: int | None

    @property
    def token_hi(self) -> int:  # ids are < this
        return self.vocab if self.vocab is not None and 0 < self.vocab <= TOKEN_ID_LIMIT else TOKEN_ID_LIMIT


def _limit(x, b: Bounds) -> int:
    return x(b) if callable(x) else x


def boolean(v, b):
    if type(v) is bool:
        return v
    raise InvalidValue(Phrase("true or false"), v)


def integer(lo=0, hi=MAX_PLAIN, none=False):
    def check(v, b):
        if v is None and none:
            return None
        lo_, hi_ = _limit(lo, b), _limit(hi, b)
        if type(v) is not int or not lo_ <= v <= hi_:
            raise InvalidValue(Phrase(f"an integer in {lo_}..{hi_}" + (" or null" if none else "")), v)
        return v

    return check


def string(none=True):
    def check(v, b):
        if v is None and none or type(v) is str:
            return v
        raise InvalidValue(Phrase("a string" + (" or null" if none else "")), v)

    return check


def one_of(values: Callable[[], tuple]):
    def check(v, b):
        allowed = values()
        if type(v) is str and v in allowed:
            return v
        raise InvalidValue(Phrase(f"one of {list(allowed)}"), v)

    return check


def token_ids(hi=lambda b: b.token_hi, max_len=_MAX_LIST, none=True):
    """A list of token ids in 0..hi-1 (at most ``max_len``)."""

    def check(v, b):
        if v is None and none:
            return None
        hi_, n = _limit(hi, b), _limit(max_len, b)
        if type(v) is not list or len(v) > n:
            raise InvalidValue(Phrase(f"a list of at most {n} token ids"), v if type(v) is not list else Phrase(f"{len(v)} entries"))
        for i, t in enumerate(v):
            if type(t) is not int or not 0 <= t < hi_:
                raise InvalidValue(Phrase(f"token ids in 0..{hi_ - 1} (entry {i})"), t)
        return list(v)

    return check


def histogram(v, b):
    """A histogram: non-negative integers."""
    if type(v) is not list or len(v) > _MAX_LIST or not all(type(x) is int and 0 <= x <= MAX_PLAIN for x in v):
        raise InvalidValue(Phrase("a list of non-negative integers"), v)
    return list(v)


def nested_lists(depth: int, leaf: str):
    """Null, or a list whose entries are null, a ``leaf`` (``number``: int or float; ``int``)
    or, ``depth`` > 1, such a list one level down (SGLang's logprob lists)."""
    kinds = (int, float) if leaf == "number" else (int,)

    def ok(x, d) -> bool:
        if x is None or (type(x) in kinds):
            return True
        return d > 1 and type(x) is list and all(ok(y, d - 1) for y in x)

    def check(v, b):
        if v is None or type(v) is list and all(ok(x, depth) for x in v):
            return v
        raise InvalidValue(Phrase(f"null or lists (nested at most {depth} deep) of {leaf}s or nulls"), v)

    return check


def component_type():
    from sglang.srt.mem_cache.unified_cache.component_type import ComponentType

    return ComponentType


def evicted_lengths(v, b):
    """``{ComponentType name: cursor}``: names SGLang's ComponentType knows, cursors within
    the committed positions, the SWA cursor the snapshot's own swa_start (what was written)."""
    ct = component_type()
    if type(v) is not dict:
        raise InvalidValue(Phrase("an object {component name: evicted length}"), v)
    out = {}
    for name, n in v.items():
        if name not in ct.__members__:
            raise InvalidValue(Phrase(f"component names in {list(ct.__members__)}"), name)
        if type(n) is not int or not 0 <= n <= b.position:
            raise InvalidValue(Phrase(f"{name}: an evicted length in 0..{b.position}"), n)
        out[ct[name]] = n
    swa = out.get(ct.SWA, 0)
    if swa != b.swa_start:
        raise InvalidValue(Phrase(f"SWA = request.swa_start ({b.swa_start})"), swa)
    others = {c.name: n for c, n in out.items() if c != ct.SWA and n}
    if others:
        raise InvalidValue(Phrase("no evicted positions outside SWA (hsnap restores SWA eviction only)"), others)
    return out


def kv_hints_envelope(v, b):
    """SGLang's own decoder of the envelope (decode_kv_hints_envelope)."""
    if v is None:
        return None
    from sglang.srt.managers.kv_hints import decode_kv_hints_envelope

    try:
        return decode_kv_hints_envelope(v)
    except (ValueError, TypeError) as e:
        raise InvalidValue(Phrase("a KvHintsEnvelope (protocol_version, message_id, actions)"), Phrase(short_repr(str(e), 160))) from None


def sampling_logprobs_modes() -> tuple:
    import typing

    from sglang.srt.managers.schedule_batch import SamplingLogprobsMode

    return typing.get_args(SamplingLogprobsMode)


_JSON_STRING = re.compile(r'"(?:[^"\\]|\\.)*"', re.S)
_JSON_BRACKET = re.compile(r"[\[\]{}]")


def json_text(text, max_depth: int = _MAX_JSON_DEPTH):
    """A JSON text carried in a string, parsed with its nesting bounded first (the parser
    recurses: 400,000 nested brackets would be a RecursionError, not a refusal)."""
    if type(text) is not str:
        raise InvalidValue(Phrase("a JSON text (string)"), text)
    depth = 0
    for m in _JSON_BRACKET.finditer(_JSON_STRING.sub("", text)):
        depth += 1 if m.group() in "[{" else -1
        if depth > max_depth:
            raise InvalidValue(Phrase(f"JSON nested at most {max_depth} deep"), Phrase(f"deeper than {max_depth}"))
    try:
        return json.loads(text)
    except (ValueError, RecursionError) as e:
        raise InvalidValue(Phrase("a JSON text"), Phrase(short_repr(f"{type(e).__name__}: {e}", 160))) from None


def unpack(codec: str, stored):
    """The stored form of a carried extra -> the value its check takes."""
    if codec == "json":
        return json_text(stored)
    if codec in ("ints", "intset") and stored is not None and type(stored) is not list:
        raise InvalidValue(Phrase("a list of integers or null"), stored)
    return stored


def short_repr(v, n: int = 80) -> str:
    """``repr(v)``, cut to ``n`` characters (what a refusal echoes of a value)."""
    s = repr(v)
    return s if len(s) <= n else s[: n - 3] + "..."

