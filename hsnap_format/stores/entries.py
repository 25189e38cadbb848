"""What a directory (or ``s3://`` prefix) of snapshots holds: what a drain, a checkpointer or a migration writes.
One listing for every reader of such a directory — the server's resume, ``hsnap info`` and ``hsnap verify`` — written
once on a store's primitives.

* snapshots: every ``*.hsnap`` file and TP set (a subdirectory with ``manifest.json``) in it, one level, by name;
* checkpoint chains: of the links of one request (``<name>.ckNNNNNN.hsnap``: files, or TP sets at TP > 1) the newest committed one
  (:func:`hsnap_format.checkpoints.choose_links`: the highest verified position), the others the chain below it;
* a live migration's container (:mod:`hsnap_format.migrations`; one with ``link-0000.hsnap``): its rounds are the
  chain below its ``final.hsnap`` — one entry, the final link (or, while none is committed, the highest round), and
  its outcome (``abandoned.json``, ``refused.json``);
* a page store (``pages/``, spec 5.10): its page objects, counted;
* leftovers: hidden names (a writer's temporaries, staging directories), named for ``hsnap gc``.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field

from ..checkpoints import LinkChoice, choose_links, parse_link
from ..migrations import ABANDONED_NAME, FINAL_NAME, LINK_NAME, REFUSED_NAME, parse_round
from ..spec import PAGE_SUFFIX
from . import store_for

PAGE_STORE = "pages"  # a drain's --dedup page store, beside its snapshots


@dataclass
class Listing:
    """The entries of a directory of snapshots (see the module)."""

    path: str
    snapshots: list[str] = field(default_factory=list)  # files and TP sets, by name
    chains: dict[str, LinkChoice] = field(default_factory=dict)  # request name -> its links' choice
    links: dict[str, int] = field(default_factory=dict)  # request name -> how many links it has here
    pages: int = 0  # page objects in its page store
    page_bytes: int = 0
    leftovers: list[str] = field(default_factory=list)
    migration: "MigrationListing | None" = None  # a live migration's container

    def entries(self) -> list[str]:
        """What a resume of the directory resumes: each snapshot, each chain's newest committed link (or, when
        none holds, its highest-numbered one, so that its refusal names it), and a migration's final link (or its
        highest round)."""
        return sorted(self.snapshots + [c.path or c.highest for c in self.chains.values()]
                      + ([self.migration.entry] if self.migration is not None else []))


@dataclass
class MigrationListing:
    """What a live migration's container holds: its rounds in order, its final link, how it ended."""

    rounds: list[str]
    final: str | None
    abandoned: bool
    refused: bool

    @property
    def entry(self) -> str:
        return self.final or self.rounds[-1]

    @property
    def outcome(self) -> str:
        """``handed off`` (the final link committed), ``abandoned`` (the source gave up: the request ran on there),
        ``refused`` (the target refused a link), or ``in progress``."""
        return "handed off" if self.final else "refused" if self.refused else "abandoned" if self.abandoned else "in progress"


def is_one_snapshot(path: str, storage_options=None) -> bool:
    """``path`` names one snapshot (a rank file, a TP set, an object or set), or nothing: not a directory of them."""
    store = store_for(path, storage_options)
    p = path if store.local else path.rstrip("/")
    if store.local:
        return not os.path.isdir(p) or os.path.exists(os.path.join(p, "manifest.json"))
    return store.exists(p) or store.exists(store.join(p, "manifest.json")) or not (store.list(p) or store.subdirs(p))


def list_directory(path: str, *, storage_options=None, verify: bool = True) -> Listing:
    """The :class:`Listing` of a directory of snapshots (one level; ``verify``: each chain's newest link is the
    newest whose chain verifies whole)."""
    store = store_for(path, storage_options)
    p = path if store.local else path.rstrip("/")
    out = Listing(path)
    hidden = lambda f: store.split(f)[1].startswith(".")  # noqa: E731 - temporaries, staging directories
    files, dirs = [e.path for e in store.list(p)], store.subdirs(p)
    name = lambda x: store.split(x.rstrip("/"))[1]  # noqa: E731
    names = {name(x) for x in files + dirs}
    migration = LINK_NAME.format(0) in names  # a migration's container: its first round is there
    of_migration = lambda x: migration and (parse_round(name(x)) is not None or name(x) == FINAL_NAME)  # noqa: E731 - files or TP sets
    linked: list[str] = []  # the migration's rounds and final link
    for f in files:
        if hidden(f):
            out.leftovers.append(f)
        elif of_migration(f):
            linked.append(f)
        elif (link := parse_link(name(f))) is not None:
            out.links[link[0]] = out.links.get(link[0], 0) + 1
        elif f.endswith(".hsnap"):
            out.snapshots.append(f)
    for d in dirs:
        if hidden(d):
            out.leftovers.append(d)
        elif of_migration(d):
            linked.append(d)
        elif (link := parse_link(name(d))) is not None:  # a TP server's link: a set
            out.links[link[0]] = out.links.get(link[0], 0) + 1
        elif store.exists(store.join(d, "manifest.json")):
            out.snapshots.append(d)
        elif store.split(d.rstrip("/"))[1] == PAGE_STORE:
            pages = [e for e in store.list(d) if e.path.endswith(PAGE_SUFFIX)]
            out.pages, out.page_bytes = len(pages), sum(e.size or 0 for e in pages)
    if migration:
        rounds = sorted((x for x in linked if name(x) != FINAL_NAME), key=lambda x: parse_round(name(x)) or 0)
        final = next((x for x in linked if name(x) == FINAL_NAME), None)
        out.migration = MigrationListing(rounds, final, ABANDONED_NAME in names, REFUSED_NAME in names)
    out.snapshots.sort()
    out.leftovers.sort()
    out.chains = choose_links(p, storage_options=storage_options, verify=verify)
    return out


def snapshot_entries(path: str, storage_options=None) -> list[str]:
    """``[path]`` when it is one snapshot; else what a resume of the directory resumes (:meth:`Listing.entries`)."""
    if is_one_snapshot(path, storage_options):
        return [path]
    return list_directory(path, storage_options=storage_options).entries()


__all__ = ["Listing", "MigrationListing", "PAGE_STORE", "is_one_snapshot", "list_directory", "snapshot_entries"]
