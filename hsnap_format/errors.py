"""One error tree for everything hsnap refuses.

Every error carries the file, the field, and what was expected versus found, and
its message says all of it on one line. The classes subclass builtins (as zarr's
do) so callers that already catch ``ValueError`` or ``EOFError`` keep working.
"""

from __future__ import annotations

import os
import re
from typing import Any


# Control characters (C0, DEL, C1), line/paragraph separators and bidi overrides: what
# can break a message onto two lines or make a terminal show something else.
_CONTROL = re.compile(r"[\\\x00-\x1f\x7f-\x9f\u2028\u2029\u202a-\u202e\u2066-\u2069]")


def escape_text(text) -> str:
    """Make a string from a file safe for one terminal line (no escape sequences, no bidi
    tricks). Backslashes are doubled, so a literal ``\\x1b`` never reads as an escaped ESC."""
    return _CONTROL.sub(
        lambda m: "\\\\" if m.group() == "\\" else f"\\x{ord(m.group()):02x}" if ord(m.group()) < 0x100 else f"\\u{ord(m.group()):04x}",
        str(text),
    )


class Phrase(str):
    """A description rather than a value: printed as is (values are quoted)."""


_NAME_CHARS = 4096  # a path or field named in a message (PATH_MAX): a longer one is cut, not copied whole


def _bounded_repr(value: Any, limit: int) -> str:
    """``repr(value)`` as far as its first ``limit`` characters, without building the rest: a 10 MB value (or a list
    of them) named in an error costs its first characters, never a copy of itself."""
    if isinstance(value, (str, bytes, bytearray)):
        return repr(value[: limit + 1])  # the same characters as repr(value) up to the cut below
    if isinstance(value, (list, tuple, dict)):
        items = value.items() if isinstance(value, dict) else value
        parts, size = [], 2
        for item in items:
            part = (f"{_bounded_repr(item[0], limit)}: {_bounded_repr(item[1], limit)}" if isinstance(value, dict)
                    else _bounded_repr(item, limit))
            parts.append(part)
            size += len(part) + 2
            if size > limit:  # cut below: only its beginning is shown
                return ("{" if isinstance(value, dict) else "[" if isinstance(value, list) else "(") + ", ".join(parts)
    return repr(value)  # small (every part above was): exact


def _short(value: Any, limit: int = 120, *, quote: bool = True) -> str:
    # A string value is quoted, so "found '4'" (the string) reads differently from
    # "found 4" (the number); descriptions (Phrase, and ``expected`` texts) are not.
    if isinstance(value, str) and (isinstance(value, Phrase) or not quote):
        text = escape_text(value[: limit + 1])
    else:
        text = _bounded_repr(value, limit)
    return text if len(text) <= limit else text[: limit - 3] + "..."


class HsnapError(ValueError):
    """Base of every hsnap refusal. ``str(err)`` is ``file: field: expected X, found Y``."""

    def __init__(
        self,
        path: str | os.PathLike[str] | None,
        field: str,
        expected: Any = None,
        found: Any = None,
        detail: str | None = None,
    ) -> None:
        self.path = None if path is None else os.fspath(path)
        self.field = field
        self.expected = expected
        self.found = found
        self.detail = detail
        super().__init__(self._message())

    def _message(self) -> str:
        parts = [_short(self.path or "<memory>", _NAME_CHARS, quote=False), _short(self.field, _NAME_CHARS, quote=False)]
        if self.detail:
            parts.append(escape_text(self.detail))
        if self.expected is not None or self.found is not None:
            parts.append(f"expected {_short(self.expected, quote=False)}, found {_short(self.found)}")
        return ": ".join(parts)

    def __reduce__(self):  # keep errors picklable by multiprocessing without pickle of ours
        return (type(self), (self.path, self.field, self.expected, self.found, self.detail))


class TruncatedError(HsnapError, EOFError):
    """The input ends before a structure it promises (file shorter than its recorded length)."""


class BadMagicError(HsnapError):
    """Not an hsnap file, or one mangled by a text-mode transfer (CRLF/LF/8-bit stripping)."""


class UnsupportedVersionError(HsnapError):
    """A newer major version than this reader understands."""


class UnsupportedFeatureError(HsnapError):
    """The file requires a feature this reader does not implement."""


class MalformedError(HsnapError):
    """A structure is present but violates the spec (bad field, overlap, out of range, padding)."""


class MalformedHeaderError(MalformedError):
    """The header (or section table) violates the spec."""


class MalformedManifestError(MalformedError):
    """A multi-rank manifest violates the spec or disagrees with its rank files."""


class ChainError(MalformedError):
    """The links of a snapshot chain do not hold together (spec 7.5): a link missing, a
    cycle, a chain deeper than the limit, or a base of another request, identity or
    geometry, or at another position than its delta names."""


class PageError(MalformedError):
    """A page reference does not hold (spec 7.6): the page object is missing, or belongs to
    another namespace, another page of the chain, or other tokens than the snapshot's."""


class DigestMismatchError(HsnapError):
    """Stored and computed digests differ: the bytes were changed after the writer committed."""


class IncompatibleSnapshotError(HsnapError):
    """The snapshot is intact but does not belong to this target (identity or geometry differ).

    ``differences`` lists every differing field as ``(field, expected, found)``.
    """

    def __init__(self, path, differences: list[tuple[str, Any, Any]], detail: str | None = None) -> None:
        self.differences = list(differences)
        fields = "; ".join(f"{f}: expected {_short(e)}, found {_short(x)}" for f, e, x in self.differences)  # both are values
        super().__init__(path, "identity/geometry", detail=detail or fields)

    def _message(self) -> str:
        return f"{escape_text(self.path or '<memory>')}: {self.field} differ: {escape_text(self.detail)}"

    def __reduce__(self):
        return (type(self), (self.path, self.differences, None))


class CapacityError(HsnapError):
    """The target pools cannot hold the request (not enough free rows, token slots or mamba slots)."""


class WriterStateError(HsnapError, RuntimeError):
    """A writer call came out of order (the writer is a state machine)."""


class SnapshotExistsError(HsnapError, FileExistsError):
    """The final name is taken: hsnap never overwrites a snapshot silently."""


class ReservedNameError(HsnapError):
    """A final name of the form reserved for unfinished writes (``.X.hsnap-tmp-…``, ``.X.hsnap-staging-…``)."""


class HsnapIOError(HsnapError):
    """The operating system failed a read, write, fsync or rename (disk full, I/O error)."""

    def __init__(self, path, field: str, error: OSError) -> None:
        self.os_error = error
        super().__init__(path, field, detail=f"{type(error).__name__}: {error.strerror or error}")

    def __reduce__(self):
        return (HsnapError, (self.path, self.field, None, None, self.detail))


class WrongTypeError(HsnapError, TypeError):
    """A public function got another type than it documents (a dict where a record class goes)."""


def require_type(path, field: str, value: Any, cls: type, *, optional: bool = False) -> Any:
    """``value`` if it is a ``cls`` (or None when ``optional``), else a typed refusal naming
    the parameter and the class, before anything reads an attribute of it."""
    if isinstance(value, cls) or optional and value is None:
        return value
    expected = f"{cls.__module__}.{cls.__qualname__}" + (" or None" if optional else "")
    raise WrongTypeError(path, field, Phrase(expected), Phrase(type(value).__qualname__))


__all__ = [
    "HsnapError",
    "Phrase",
    "TruncatedError",
    "BadMagicError",
    "UnsupportedVersionError",
    "UnsupportedFeatureError",
    "MalformedError",
    "MalformedHeaderError",
    "MalformedManifestError",
    "ChainError",
    "PageError",
    "DigestMismatchError",
    "IncompatibleSnapshotError",
    "CapacityError",
    "WriterStateError",
    "SnapshotExistsError",
    "ReservedNameError",
    "HsnapIOError",
    "WrongTypeError",
]
