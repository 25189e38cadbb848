"""Hex view of one section with absolute file offsets, drawn line by line
(Textual's Line API): only the visible rows are ever read from the file."""

from __future__ import annotations

from rich.segment import Segment
from rich.style import Style
from textual.geometry import Size
from textual.scroll_view import ScrollView
from textual.strip import Strip

from hsnap_format import HsnapError

BYTES_PER_LINE = 16
_OFFSET = Style(color="cyan")
_ASCII = Style(dim=True)
_ERROR = Style(color="red")


def hex_parts(data: bytes, offset: int) -> tuple[str, str, str]:
    """Offset, hex bytes and printable ASCII of up to 16 bytes at absolute ``offset``."""
    hexes = " ".join(f"{b:02x}" for b in data)
    text = "".join(chr(b) if 0x20 <= b < 0x7F else "." for b in data)
    return f"{offset:012x}", f"  {hexes:<{BYTES_PER_LINE * 3 - 1}}  ", f"|{text}|"


def hex_line(data: bytes, offset: int) -> str:
    """``000000001000  0a 0b ...  |..|``"""
    return "".join(hex_parts(data, offset))


class HexView(ScrollView, can_focus=True):
    DEFAULT_CSS = "HexView { height: 1fr; }"

    def __init__(self, **kw) -> None:
        super().__init__(**kw)
        self._data = None  # a section's bytes: len() and slices (pread-backed in the app)
        self._base = 0

    def show(self, data, base_offset: int = 0) -> None:
        """Show ``data`` (a section's bytes) labelled from ``base_offset``; None clears."""
        self._data, self._base = data, base_offset
        lines = 0 if data is None else (len(data) + BYTES_PER_LINE - 1) // BYTES_PER_LINE
        self.virtual_size = Size(12 + 2 + BYTES_PER_LINE * 3 + 1 + BYTES_PER_LINE + 2, lines)
        self.scroll_to(0, 0, animate=False)
        self.refresh()

    def render_line(self, y: int) -> Strip:
        scroll_x, scroll_y = self.scroll_offset
        row = y + scroll_y
        data = self._data
        if data is None or row * BYTES_PER_LINE >= len(data):
            return Strip.blank(self.size.width)
        start = row * BYTES_PER_LINE
        try:
            chunk = bytes(data[start : start + BYTES_PER_LINE])
        except HsnapError as e:  # pread-backed: a truncated file is a line of text, not a crash
            return Strip([Segment(f"{self._base + start:012x}  unreadable: {e.field}", _ERROR)]).crop(scroll_x, scroll_x + self.size.width)
        off, hexes, text = hex_parts(chunk, self._base + start)
        strip = Strip([Segment(off, _OFFSET), Segment(hexes), Segment(text, _ASCII)])
        return strip.crop(scroll_x, scroll_x + self.size.width)
