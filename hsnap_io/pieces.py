"""One piece of a section into the slots: where the engine reads it from — the restore's
staging buffer, a file range (hashed as it lands when verified), an object's ranged GETs
— (:func:`piece_source`) and the upload of it (:func:`upload_piece`). Shared by the
restore and live migration."""

from __future__ import annotations

import xxhash

from hsnap_format import DigestMismatchError, HsnapError, TruncatedError

from .transfer import FileRange, pread_into, read_spread, spread_preads

HASH_PIECE = 2 << 20  # hashed right after it lands, while still in cache


class VerifiedFileRange:
    """One section of an open snapshot file for an engine: ``readinto(view, at)`` preads the
    section's bytes from ``at`` — in order — 2 MiB at a time and hashes each piece right
    after it lands in ``view`` (the slots, or the engine's staging chunk on its way to
    them); ``readinto_spread`` (a CUDA engine's pinned chunk) preads the view on the copy
    threads, then hashes it in order; :meth:`finish` compares the digest. What is hashed
    is what the engine goes on with. The same call as :class:`hsnap_io.transfer.FileRange`
    and ``hsnap_format.stores.s3.ranges.SectionRange``."""

    __slots__ = ("fd", "offset", "length", "info", "path", "_h", "_next")

    def __init__(self, fd: int, info, path) -> None:
        self.fd, self.offset, self.length, self.info, self.path = fd, info.offset, info.length, info, path
        self._h = xxhash.xxh3_128()
        self._next = 0

    def _in_order(self, at: int) -> None:
        if at != self._next:  # the digest is over the section in order
            raise HsnapError(self.path, f"sections[{self.info.name!r}]", f"a read at byte {self._next}", at, detail="out of order")

    def readinto(self, view: memoryview, at: int) -> None:
        self._in_order(at)
        for a in range(0, len(view), HASH_PIECE):
            piece = view[a : a + HASH_PIECE]
            pread_into(self.fd, piece, self.offset + at + a)
            self._h.update(piece)
        self._next = at + len(view)

    def readinto_spread(self, view: memoryview, at: int) -> None:
        self._in_order(at)
        spread_preads(self.fd, view, self.offset + at)
        self._h.update(view)
        self._next = at + len(view)

    def finish(self) -> None:
        if self._next != self.length:
            raise TruncatedError(self.path, f"sections[{self.info.name!r}]", self.length, self._next)
        got = self._h.hexdigest()
        if got != self.info.digest:
            raise DigestMismatchError(self.path, f"sections[{self.info.name!r}].digest", self.info.digest, got)


class _Window:
    """A section source of which only ``take`` bytes after the first ``skip`` are handed on
    — a link's sliding-window rows that left the window before the head's position (spec
    7.5), or the inline rows on one side of a link's pages (spec 7.6) — while the whole
    section is read and hashed in order (its digest is over all of it): :meth:`finish`
    reads the rest before the source's own check."""

    __slots__ = ("src", "skip", "length", "_done", "_total")

    def __init__(self, src, skip: int, take: int | None = None) -> None:
        self.src, self.skip, self._total = src, skip, src.length
        self.length = src.length - skip if take is None else take
        self._done = 0

    def _pass(self, start: int, stop: int) -> None:
        scratch = memoryview(bytearray(min(max(stop - start, 1), HASH_PIECE)))
        for a in range(start, stop, len(scratch)):
            n = min(len(scratch), stop - a)
            self.src.readinto(scratch[:n], a)

    def readinto(self, view: memoryview, at: int) -> None:
        self._read(self.src.readinto, view, at)

    def readinto_spread(self, view: memoryview, at: int) -> None:
        self._read(lambda v, a: read_spread(self.src, v, a), view, at)

    def _read(self, read, view: memoryview, at: int) -> None:
        if self._done == 0 and self.skip:
            self._pass(0, self.skip)
        read(view, self.skip + at)
        self._done = max(self._done, at + len(view))

    def finish(self) -> None:
        if self.skip and self._done == 0:
            self._pass(0, self.skip)
        end = self.skip + self.length
        if end < self._total:
            self._pass(end, self._total)
        self.src.finish()


def piece_source(piece, check_digests: bool, staged=None):
    """What the engine reads one piece of a link's (or page object's) section from.
    ``staged``: the restore's staging buffer (:mod:`hsnap_io.restore`), whose bytes were
    hashed when read."""
    snap, info = piece.link, piece.info
    if staged is not None and snap is staged.snap:  # hashed in the staging buffer (verify=True, one read)
        return staged.section(info, piece.skip, piece.length)
    ranged = getattr(snap.source, "section_range", None)  # an object: ranged GETs, hashed on the way in
    if ranged:
        src = ranged(info)
    elif check_digests:
        src = VerifiedFileRange(snap.fileno(), info, snap.path)
    else:  # pread into the slots: nothing mapped, an I/O error is an OSError
        return FileRange(snap.fileno(), info.offset + piece.skip, piece.length)
    return _Window(src, piece.skip, piece.take) if piece.skip or piece.length != info.length else src


def upload_piece(engine, b, rows, piece, check_digests: bool, staged=None) -> int:
    src = piece_source(piece, check_digests, staged)
    engine.import_section(b.buffer, rows, src, b.host_rows)  # (a device engine moves the rows to its device)
    if check_digests:
        src.finish()  # DigestMismatchError: rolled back by the caller
    return piece.length
