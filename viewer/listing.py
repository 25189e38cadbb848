"""What a directory of snapshots — a drain's, a checkpointer's, a migration's — holds, as the rows of the
viewer's listing (plain data, no Textual). The entries are hsnap_format's own: the listing a resume reads
(:func:`hsnap_format.tools.viewmodel.directory_entries`, which ``hsnap info DIR`` prints), so the viewer
names the same snapshots, TP sets and newest committed checkpoint links, the same links passed over and why,
the same page store and leftovers."""

from __future__ import annotations

import os
from dataclasses import dataclass

from hsnap_format.stores.entries import PAGE_STORE, Listing, list_directory
from hsnap_format.tools.fit import Column
from hsnap_format.tools.viewmodel import claim_said, entry_counts, entry_what, escape, fmt_bytes, plural

from .model import display_name

# the columns of `hsnap info DIR`'s table, elided the same way when the screen is narrow
LISTING_COLUMNS = (
    Column("entry", elide="middle", min_width=12),
    Column("rid", elide="middle", min_width=10),
    Column("what", elide="end", min_width=10),
    Column("positions", ">"),
    Column("size", ">"),
)

# how a row that is not a plain entry stands out
PASSED_OVER, BROKEN, ASIDE = "red", "bold red", "dim"


class NothingToViewError(Exception):
    """A directory that holds no snapshot, TP set or checkpoint chain: empty, or nothing of hsnap's."""


@dataclass(frozen=True)
class ListingRow:
    cells: tuple[str, str, str, str, str]  # entry, rid, what, positions, size: escaped, as LISTING_COLUMNS
    detail: str  # what the line under the table says while the row is highlighted
    opens: str | None  # the path Enter opens; None: nothing to open (the page store, a leftover)
    style: str = ""


def leaf(path: str) -> str:
    return os.path.basename(path.rstrip("/"))


def below(text: str, directory: str) -> str:
    """``text`` with the paths below ``directory`` named from it (no temp or home directories on screen)."""
    return text.replace(directory.rstrip("/") + "/", "")


def nothing_to_view(path: str) -> NothingToViewError | None:
    """Why ``path`` (a directory, not one snapshot) has nothing to list, or None. Cheap, before the first frame:
    the listing unverified (headers only); the screen lists it verified, off the event loop."""
    listing = list_directory(path, verify=False)
    if listing.entries():
        return None
    aside = []
    if listing.pages:
        aside.append(f"a page store {PAGE_STORE}/ of {plural(listing.pages, 'page')}")
    if listing.leftovers:
        aside.append(plural(len(listing.leftovers), "leftover"))
    return NothingToViewError(f"{escape(display_name(path))} holds no snapshot, TP set or checkpoint chain to view"
                              + (f" (only {' and '.join(aside)})" if aside else ""))


def _entry_row(e: dict, directory: str) -> ListingRow:
    name = escape(leaf(e["path"]))
    if e["error"]:
        why = below(escape(f"{e['error']['error']}: {e['error']['message']}"), directory)
        return ListingRow((name, "-", e["error"]["error"], "-", "-"), f"{name} does not open: {why}", e["path"], BROKEN)
    if e["kind"] == "TP set":
        name += "/"
    rid, size = escape(e["rid"]), fmt_bytes(e["bytes"])
    about = f"request {rid} at position {e['state_position']}, {size}"
    ck = e["checkpoints"]
    style = ""
    if ck and ck["newest_committed"] is None:  # none holds: the highest-numbered link, which a resume refuses
        why = next((why for p, why in ck["passed_over"] if p == e["path"]), "")
        detail = (f"{name}: no link of {escape(ck['name'])}'s {plural(ck['links'], 'checkpoint link')} holds; a resume is "
                  f"refused, naming this one: {below(escape(why), directory)}")
        style = BROKEN
    elif ck:
        passed = len([p for p, _ in ck["passed_over"] if p != e["path"]])
        detail = (f"{name}: the newest committed link of {escape(ck['name'])}'s {plural(ck['links'], 'checkpoint link')}, "
                  f"{about}" + (f"; {passed} newer passed over (below)" if passed else ""))
    elif e["migration"]:
        m = e["migration"]
        detail = (f"{name}: a live migration's {'final link' if m['final'] else 'newest round'} "
                  f"({plural(m['rounds'], 'pre-copy round')} {'below it' if m['final'] else 'in all'}), {m['outcome']}, {about}")
    else:
        detail = f"{name}: {'a TP set' if e['kind'] == 'TP set' else 'a snapshot'} of {about}"
    if e["delta"]:
        detail += "; a delta: it opens with the chain below it"
    if e["paged"]:
        detail += f"; its full pages are in the page store {PAGE_STORE}/"
    if e["claimed"]:
        detail += f"; {claim_said(e['claimed'])}"
    return ListingRow((name, rid, entry_what(e), str(e["state_position"]), size), detail, e["path"], style)


def _passed_over_rows(e: dict, directory: str) -> list[ListingRow]:
    """A chain's links passed over on the way to its newest committed one: the reason, and the link used instead."""
    ck = e["checkpoints"]
    if not ck:
        return []
    used = ck["newest_committed"]
    instead = (f"{escape(leaf(used))} is used instead" if used else
               f"no link of {escape(ck['name'])} holds: a resume is refused, naming {escape(leaf(e['path']))}")
    return [ListingRow((escape(leaf(p)), "-", "passed over", "-", "-"),
                       f"{escape(leaf(p))} passed over: {below(escape(why), directory)}; {instead}", p, PASSED_OVER)
            for p, why in ck["passed_over"] if p != e["path"]]


def listing_rows(directory: str, listing: Listing, entries: list[dict]) -> list[ListingRow]:
    """Each entry in the listing's order, each chain's passed-over links under it; then the page store and the
    leftovers (nothing to open there: said what they are)."""
    rows: list[ListingRow] = []
    for e in entries:
        rows.append(_entry_row(e, directory))
        rows += _passed_over_rows(e, directory)
    if listing.pages:
        where = escape(display_name(directory))
        rows.append(ListingRow((f"{PAGE_STORE}/", "-", "page store", plural(listing.pages, "page"), fmt_bytes(listing.page_bytes)),
                               f"{PAGE_STORE}/: the page store, {plural(listing.pages, 'page')} in {fmt_bytes(listing.page_bytes)}: "
                               f"the full pages the snapshots beside it name (`hsnap gc --pages {where}` counts which are kept)",
                               None, ASIDE))
    for p in listing.leftovers:
        rows.append(ListingRow((escape(leaf(p)), "-", "leftover", "-", "-"),
                               f"{escape(leaf(p))}: a leftover (hidden: a writer's temporary or staging directory); "
                               f"`hsnap gc {escape(display_name(directory))}` lists what it can prove dead", None, ASIDE))
    return rows


def listing_summary(listing: Listing, entries: list[dict]) -> list[str]:
    """The parts of the line above the table, as ``hsnap info DIR`` counts them."""
    parts = entry_counts(entries)
    passed = sum(len(e["checkpoints"]["passed_over"]) for e in entries if e["checkpoints"])
    if passed:
        parts.append(f"{passed} passed over")
    if listing.pages:
        parts.append(f"page store {PAGE_STORE}/: {plural(listing.pages, 'page')}, {fmt_bytes(listing.page_bytes)}")
    if listing.leftovers:
        parts.append(plural(len(listing.leftovers), "leftover"))
    return parts
