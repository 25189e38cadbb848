"""Small JSON control files and bodies whose writer is not trusted: a migration container's ``refused.json`` and
``abandoned.json`` (any writer of the shared container can put them), an HTTP request body.

One reader for all of them: the size is capped before anything is read, the text must be UTF-8, the nesting is
capped (Python's parser recurses: ``"[" * 8000`` is a RecursionError, not a refusal), NaN/Infinity are refused
(not JSON), and every failure is a :class:`~hsnap_format.errors.MalformedError` naming the file, the field, what
was expected and what was found."""

from __future__ import annotations

import json
from typing import Any

from .errors import HsnapError, MalformedError, Phrase

MAX_CONTROL_BYTES = 64 * 1024  # a marker says why in one line; 64 KiB is generous
MAX_CONTROL_DEPTH = 16


def _no_constant(name: str):
    raise ValueError(f"{name} is not JSON")


def _deeper_than(obj: Any, limit: int) -> bool:
    """Whether ``obj`` nests containers more than ``limit`` deep (iterative: no recursion of ours)."""
    stack = [(obj, 1)]
    while stack:
        o, d = stack.pop()
        if isinstance(o, (list, dict)):
            if d > limit:
                return True
            stack.extend((x, d + 1) for x in (o.values() if isinstance(o, dict) else o))
    return False


def loads_bounded(raw: bytes | str, path, field: str = "json", *, max_bytes: int = MAX_CONTROL_BYTES,
                  max_depth: int = MAX_CONTROL_DEPTH) -> Any:
    """``raw`` decoded as JSON, or a typed refusal (never RecursionError, UnicodeDecodeError or a giant value)."""
    size = len(raw)
    if size > max_bytes:
        raise MalformedError(path, field, Phrase(f"at most {max_bytes} bytes of JSON"), Phrase(f"{size} bytes"))
    if isinstance(raw, str):
        text = raw
    else:
        try:
            text = bytes(raw).decode("utf-8")
        except UnicodeDecodeError as e:
            raise MalformedError(path, field, Phrase("UTF-8 text"), Phrase(f"invalid byte at offset {e.start}")) from None
    deep = Phrase(f"JSON nested at most {max_depth} deep")
    try:
        obj = json.loads(text, parse_constant=_no_constant)
    except RecursionError:
        raise MalformedError(path, field, deep, Phrase("nesting too deep to parse")) from None
    except ValueError as e:
        raise MalformedError(path, field, Phrase("a JSON text"), Phrase(f"{type(e).__name__}: {str(e)[:160]}")) from None
    if sum(text.count(c) for c in "[{") > max_depth and _deeper_than(obj, max_depth):
        raise MalformedError(path, field, deep, Phrase(f"deeper than {max_depth}"))
    return obj


def read_control(store, path: str, field: str = "json", *, max_bytes: int = MAX_CONTROL_BYTES,
                 max_depth: int = MAX_CONTROL_DEPTH) -> Any:
    """The JSON control file at ``path`` in ``store`` (hsnap_format.stores), read with its size capped before
    reading (a regular file only, no link followed), then :func:`loads_bounded`."""
    try:
        raw = store.read_bytes(path, max_bytes)[0]
    except HsnapError:
        raise
    except (OSError, ValueError) as e:  # a name the OS refuses (NUL byte, unencodable text): typed, named
        raise MalformedError(path, "path", Phrase("a readable file name"), Phrase(f"{type(e).__name__}: {str(e)[:160]}")) from None
    return loads_bounded(raw, path, field, max_bytes=max_bytes, max_depth=max_depth)


__all__ = ["MAX_CONTROL_BYTES", "MAX_CONTROL_DEPTH", "loads_bounded", "read_control"]
