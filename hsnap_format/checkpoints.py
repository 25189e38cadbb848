"""Periodic checkpoints of a running request: a chain of links in one directory.

A request checkpointed every ``every`` output tokens leaves ``<name>.ck000001.hsnap``,
``<name>.ck000002.hsnap``, ... beside each other (files; at TP > 1 each link a TP set directory of that name): the first link (and every
``rebase_every``-th after it) a plain snapshot, each other one a delta (spec 5.9) whose base
is the link before it. Every link is committed atomically under its final name (the
writer's temporary, fsync, rename: a crash mid-write leaves only a hidden temporary). A
resume after a crash takes the link at the highest position whose chain opens and verifies
(:func:`newest_links`): not merely the highest number, which a stray copy or a damaged file
can hold. The numbers of one name only grow: a checkpointer started where links of its name
exist continues after the highest (:func:`highest_seq`).

Pure bookkeeping: the caller writes each link (``export(path, base)``: a plain snapshot
when ``base`` is None, else a delta of ``base``) through ``hsnap_io.export_request`` or
``hsnap_sglang.req.snapshot_req``.

    cp = Checkpoints.start("/ck", "req-42", every=64)
    if cp.due(len(req.output_ids)):               # at a committed decode boundary
        cp.write(lambda path, base: snapshot_req(path, req, ..., base=base), len(req.output_ids))
"""

from __future__ import annotations

import logging
import re
from dataclasses import dataclass, field
from typing import Callable

from .errors import HsnapError, Phrase
from .manifest import SnapshotSet
from .source import store_at

LINK_RE = re.compile(r"(?P<name>[^/]+?)\.ck(?P<seq>[0-9]{6,})\.hsnap")
_log = logging.getLogger("hsnap.checkpoints")
REBASE_EVERY = 64  # links per chain: a fresh plain link then (bounds the chain a resume opens and checks)


def link_name(name: str, seq: int) -> str:
    """The file name of link ``seq`` (from 1) of ``name``'s checkpoints."""
    return f"{name}.ck{seq:06d}.hsnap"


def parse_link(leaf: str) -> tuple[str, int] | None:
    """``(name, seq)`` of a link's file name; None for any other name (temporaries start with a dot)."""
    m = LINK_RE.fullmatch(leaf)
    return None if m is None or leaf.startswith(".") else (m["name"], int(m["seq"]))


@dataclass
class LinkChoice:
    """The link a resume of checkpoints ``name`` takes (:func:`choose_links`): ``path``, the
    link at the highest position whose chain opens and verifies (None when none does), and
    every link passed over on the way, with the reason (``passed_over``: ``(path, why)``)."""

    name: str
    path: str | None
    highest: str  # the link of the highest number (what a resume names when none holds)
    position: int = -1
    passed_over: list[tuple[str, str]] = field(default_factory=list)


def _link_files(store, container: str) -> dict[str, list[tuple[int, str]]]:
    """name -> ``(seq, path)`` of its links: files, and TP sets (a TP server's links: a directory per link)."""
    out: dict[str, list[tuple[int, str]]] = {}
    for path in [e.path for e in store.list(container)] + [d.rstrip("/") for d in store.subdirs(container)]:
        parsed = parse_link(store.split(path)[1])
        if parsed is not None:
            out.setdefault(parsed[0], []).append((parsed[1], path))
    return out


def _position(opened) -> int:
    """The request position a link (an open rank file or TP set) holds."""
    return opened.manifest.state_position if isinstance(opened, SnapshotSet) else opened.state_position


def _check_chains(path: str, opened, store, verify: bool) -> None:
    """The chain below the open link ``path`` opens (and ``verify``: verifies whole) — below every rank of a TP
    set, from the link already open (as compaction opens a set's chains)."""
    from .chain import chain_below

    heads = sorted(opened.ranks.items()) if isinstance(opened, SnapshotSet) else [(None, opened)]
    for rank, head in heads:
        with chain_below(head, location=path, rank=rank, store=store) as chain:
            if verify:
                chain.verify()


def choose_links(container: str, *, storage_options=None, verify: bool = True) -> dict[str, LinkChoice]:
    """name -> :class:`LinkChoice` for every checkpoint chain in ``container`` (a directory
    or an ``s3://`` prefix). A link's number says only where it was written: a stray copy
    of an early link under a higher number, or a damaged file there, must not win. So each
    link is opened for its ``request.state_position``, and the links are tried from the
    highest position down (the higher number first at equal positions) until one whose
    chain opens and (``verify``) verifies whole — spec 7.5, 7.6, every byte read; for a TP set's link, the chain
    below each of its ranks."""
    store = store_at(container, storage_options)
    out: dict[str, LinkChoice] = {}
    for name, links in sorted(_link_files(store, container).items()):
        choice = out[name] = LinkChoice(name, None, highest=max(links)[1])
        ranked = []
        for seq, path in links:
            try:
                with store.open(path) as snap:
                    ranked.append((_position(snap), seq, path))
            except HsnapError as e:
                choice.passed_over.append((path, f"does not open ({type(e).__name__}: {e})"))
        for position, _, path in sorted(ranked, reverse=True):
            try:
                with store.open(path) as opened:
                    _check_chains(path, opened, store, verify)
            except HsnapError as e:
                choice.passed_over.append((path, f"its chain does not hold ({type(e).__name__}: {e})"))
                continue
            choice.path, choice.position = path, position
            break
        for path, why in choice.passed_over:
            _log.warning("hsnap checkpoints %s: passed over %s: %s", name, path, why)
    return out


def newest_links(container: str, *, storage_options=None, verify: bool = True) -> dict[str, str]:
    """name -> path of the link a resume takes, for every checkpoint chain in ``container``
    (:func:`choose_links`: the highest verified position, not the highest number; each link
    passed over is logged with its reason). A name none of whose links holds gives its
    highest-numbered link, so that its resume is refused typed, naming it — never skipped."""
    return {n: c.path or c.highest for n, c in choose_links(container, storage_options=storage_options, verify=verify).items()}


def highest_seq(container: str, name: str, *, storage_options=None) -> int:
    """The highest link number of ``name`` in ``container``, whatever its file holds (0: none):
    a new link is numbered after it, so that no link is ever overwritten."""
    store = store_at(container, storage_options)
    return max((seq for seq, _ in _link_files(store, container).get(name, [])), default=0)


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
        store = store_at(directory, storage_options)
        store.makedirs(directory)
        seq = highest_seq(directory, name, storage_options=storage_options)
        return cls(directory, name, every, rebase_every, seq=seq, storage_options=storage_options)

    def due(self, output_tokens: int) -> bool:
        """Whether a link is due at a boundary with ``output_tokens`` output tokens."""
        return self.last is None or output_tokens - self.last_output >= self.every

    def next_link(self) -> tuple[str, str | None]:
        """``(path, base)`` of the next link: a delta of the last one, or plain (the first, and every
        ``rebase_every``-th)."""
        store = store_at(self.directory, self.storage_options)
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


__all__ = ["Checkpoints", "LINK_RE", "REBASE_EVERY", "LinkChoice", "link_name", "parse_link", "newest_links", "choose_links", "highest_seq"]
