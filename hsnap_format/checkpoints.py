"""Periodic checkpoints of a running request: a chain of links in one directory.

A request checkpointed every ``every`` output tokens leaves ``<name>.ck000001.hsnap``,
``<name>.ck000002.hsnap``, ... beside each other: the first link (and every
``rebase_every``-th after it) a plain snapshot, each other one a delta (spec 5.9) whose base
is the link before it. Every link is committed atomically under its final name (the
writer's temporary, fsync, rename: a crash mid-write leaves only a hidden temporary), so the
newest committed link of a chain is the one with the highest number — what a resume after
a crash takes (:func:`newest_links`). The numbers of one name only grow: a checkpointer
started where links of its name exist continues after the highest.

Pure bookkeeping: the caller writes each link (``export(path, base)``: a plain snapshot
when ``base`` is None, else a delta of ``base``) through ``hsnap_io.export_request`` or
``hsnap_sglang.req.snapshot_req``.

    cp = Checkpoints.start("/ck", "req-42", every=64)
    if cp.due(len(req.output_ids)):               # at a committed decode boundary
        cp.write(lambda path, base: snapshot_req(path, req, ..., base=base), len(req.output_ids))
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Callable

from .errors import HsnapError, Phrase
from .storage import store_for

LINK_RE = re.compile(r"(?P<name>[^/]+?)\.ck(?P<seq>[0-9]{6,})\.hsnap")
REBASE_EVERY = 64  # links per chain: a fresh plain link then (bounds the chain a resume opens and checks)


def link_name(name: str, seq: int) -> str:
    """The file name of link ``seq`` (from 1) of ``name``'s checkpoints."""
    return f"{name}.ck{seq:06d}.hsnap"


def parse_link(leaf: str) -> tuple[str, int] | None:
    """``(name, seq)`` of a link's file name; None for any other name (temporaries start with a dot)."""
    m = LINK_RE.fullmatch(leaf)
    return None if m is None or leaf.startswith(".") else (m["name"], int(m["seq"]))


def newest_links(container: str, *, storage_options=None) -> dict[str, str]:
    """name -> path of the newest committed link of every checkpoint chain in ``container``
    (a directory or an ``s3://`` prefix): the highest number of each name."""
    store = store_for(container, storage_options)
    best: dict[str, tuple[int, str]] = {}
    for entry in store.list(container):
        parsed = parse_link(store.split(entry.path)[1])
        if parsed is not None and parsed[1] > best.get(parsed[0], (0, ""))[0]:
            best[parsed[0]] = (parsed[1], entry.path)
    return {name: path for name, (_, path) in sorted(best.items())}


@dataclass
class Checkpoints:
    """The checkpoints of one request: where its next link goes and what its base is."""

    directory: str
    name: str
    every: int
    rebase_every: int = REBASE_EVERY
    seq: int = 0  # number of the last link committed (or found) under this name
    last: str | None = None  # path of the last link this checkpointer committed (the next delta's base)
    last_output: int = 0  # output tokens at that link
    depth: int = 0  # links of the current chain
    storage_options: object = None

    @classmethod
    def start(cls, directory: str, name: str, every: int, *, rebase_every: int = REBASE_EVERY, storage_options=None) -> "Checkpoints":
        """A checkpointer for ``name`` in ``directory``; its first link is plain and numbered after any link of
        ``name`` already there (links are never overwritten)."""
        if type(every) is not int or every < 1:
            raise HsnapError(directory, "every", Phrase("a number of output tokens >= 1"), every)
        if type(rebase_every) is not int or rebase_every < 1:
            raise HsnapError(directory, "rebase_every", Phrase("a number of links >= 1"), rebase_every)
        if parse_link(link_name(name, 1)) != (name, 1):
            raise HsnapError(directory, "name", Phrase("a file name without '/'"), name)
        store = store_for(directory, storage_options)
        store.makedirs(directory)
        found = newest_links(directory, storage_options=storage_options).get(name)
        seq = 0 if found is None else parse_link(store.split(found)[1])[1]
        return cls(directory, name, every, rebase_every, seq=seq, storage_options=storage_options)

    def due(self, output_tokens: int) -> bool:
        """Whether a link is due at a boundary with ``output_tokens`` output tokens."""
        return self.last is None or output_tokens - self.last_output >= self.every

    def next_link(self) -> tuple[str, str | None]:
        """``(path, base)`` of the next link: a delta of the last one, or plain (the first, and every
        ``rebase_every``-th)."""
        store = store_for(self.directory, self.storage_options)
        base = None if self.last is None or self.depth >= self.rebase_every else self.last
        return store.join(self.directory, link_name(self.name, self.seq + 1)), base

    def committed(self, path: str, output_tokens: int, base: str | None) -> None:
        """Link ``path`` is durable under its final name."""
        self.seq += 1
        self.last, self.last_output = path, output_tokens
        self.depth = 1 if base is None else self.depth + 1

    def write(self, export: Callable[[str, str | None], object], output_tokens: int):
        """Write the next link with ``export(path, base)`` and record it; returns what ``export`` returned."""
        path, base = self.next_link()
        out = export(path, base)
        self.committed(path, output_tokens, base)
        return out


__all__ = ["Checkpoints", "LINK_RE", "REBASE_EVERY", "link_name", "parse_link", "newest_links"]
