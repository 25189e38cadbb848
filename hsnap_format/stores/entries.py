"""What a directory (or ``s3://`` prefix) of snapshots holds: what a drain, a checkpointer or a migration writes.
One listing for every reader of such a directory — the server's resume, ``hsnap info`` and ``hsnap verify`` — written
once on a store's primitives.

* snapshots: every ``*.hsnap`` file and TP set (a subdirectory with ``manifest.json``) in it, one level, by name;
* checkpoint chains: of the links of one request (``<name>.ckNNNNNN.hsnap``: files, or TP sets at TP > 1) the newest committed one
  (:func:`hsnap_format.checkpoints.choose_links`: the highest verified position), the others the chain below it;
* a page store (``pages/``, spec 5.10): its page objects, counted;
* leftovers: hidden names (a writer's temporaries, staging directories), named for ``hsnap gc``.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field

from ..checkpoints import LinkChoice, choose_links, parse_link
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

    def entries(self) -> list[str]:
        """What a resume of the directory resumes: each snapshot, and each chain's newest committed link (or, when
        none holds, its highest-numbered one, so that its refusal names it)."""
        return sorted(self.snapshots + [c.path or c.highest for c in self.chains.values()])


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
    for f in (e.path for e in store.list(p)):
        if hidden(f):
            out.leftovers.append(f)
        elif (link := parse_link(store.split(f)[1])) is not None:
            out.links[link[0]] = out.links.get(link[0], 0) + 1
        elif f.endswith(".hsnap"):
            out.snapshots.append(f)
    for d in store.subdirs(p):
        if hidden(d):
            out.leftovers.append(d)
        elif (link := parse_link(store.split(d.rstrip("/"))[1])) is not None:  # a TP server's link: a set
            out.links[link[0]] = out.links.get(link[0], 0) + 1
        elif store.exists(store.join(d, "manifest.json")):
            out.snapshots.append(d)
        elif store.split(d.rstrip("/"))[1] == PAGE_STORE:
            pages = [e for e in store.list(d) if e.path.endswith(PAGE_SUFFIX)]
            out.pages, out.page_bytes = len(pages), sum(e.size or 0 for e in pages)
    out.snapshots.sort()
    out.leftovers.sort()
    out.chains = choose_links(p, storage_options=storage_options, verify=verify)
    return out


def snapshot_entries(path: str, storage_options=None) -> list[str]:
    """``[path]`` when it is one snapshot; else what a resume of the directory resumes (:meth:`Listing.entries`)."""
    if is_one_snapshot(path, storage_options):
        return [path]
    return list_directory(path, storage_options=storage_options).entries()


__all__ = ["Listing", "PAGE_STORE", "is_one_snapshot", "list_directory", "snapshot_entries"]
