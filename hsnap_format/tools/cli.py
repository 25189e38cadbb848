"""``hsnap`` command line: info, verify, diff, gc (and, when its packages are
installed, demo). Subcommands that need torch or SGLang are imported only when run,
so ``hsnap info`` stays a numpy + xxhash program."""

from __future__ import annotations

import argparse
import json
import math
import os
import posixpath
import sys

import numpy as np

from .. import MAJOR, MINOR, __version__, open_snapshot
from ..chain import compact_path
from ..errors import HsnapError
from ..manifest import SnapshotSet
from ..records import Geometry
from ..pages import collect_pages
from ..spec import DTYPES, PAGE_SUFFIX, RANK_FILE_RE
from ..stores import store_for
from ..stores.entries import is_one_snapshot, list_directory
from .fit import WIDTH, Column, Printer, relative_to
from .viewmodel import ENTRY_KEYS as ENTRY_KEYS  # `hsnap info --json`'s keys of a directory's entry, named here too
from .viewmodel import (claim_said, directory_entries, entry_counts, entry_what, error_summary, escape, fmt_bytes, fmt_value_pair, leftover_hint,
                        open_rank_chains, plural, snapshot_summary)


def _heads(n: int) -> str:
    return plural(n, "head")


# A rank's sections: with --wide every column; by default kind and layer (the name says both), the offset and the
# exact byte count (the total line has them) give way, and the digest shows its first characters.
SECTION_COLUMNS = (
    Column("name", elide="middle", min_width=12),
    Column("kind", wide_only=True),
    Column("layer", ">", wide_only=True),
    Column("dtype"),
    Column("shape", elide="end", min_width=8),
    Column("offset", ">", wide_only=True),
    Column("bytes", ">", wide_only=True),
    Column("size", ">"),
    Column("digest"),
)


def _print_rank(r: dict, first: bool, out: Printer, in_set: str | None) -> None:
    """One rank file: its identity, geometry, request and (a delta) link, its sections, its totals. ``in_set``: the
    set's directory, which the set's own line names (its rank files are then named below it)."""
    ident, req, g = r["identity"], r["request"], r["geometry"]
    if not first:
        out.line()
    rank = f"  (hsnap {r['version']}, rank {ident['tp_rank']}/{ident['tp_size']})"
    path = escape(r["path"] if in_set is None or out.wide else relative_to(r["path"], in_set))
    out.line(f"== {out.path(path, WIDTH - 3 - len(rank))}{rank}")
    engine = ident["engine"]
    commit = f" ({escape(engine['commit'])})" if engine.get("commit") else ""
    weights_hash = ident.get("weights_hash")
    weights = " ".join(x for x in (escape(ident.get("weights_version") or ""), out.digest(escape(weights_hash)) if weights_hash else "") if x)
    out.line(f"model {escape(ident['model_id'])}  weights {weights or '-'}  engine {escape(engine['name'])} {escape(engine['version'])}{commit}")
    out.line(f"snapshot {escape(ident['snapshot_id'])}  created {escape(ident['created_at'])}  device {escape(ident['device'])}")
    if g["attention"]:
        a = g["attention"]
        stored = "" if a["storage_dtype"] == a["dtype"] else f" (stored as {a['storage_dtype']})"
        swa = f" + {len(a['swa_layers'])} sliding-window" if a["swa_layers"] else ""
        out.line(f"attention {a['kind']}: {plural(len(a['layers']), 'layer')}{swa}, {_heads(a['heads'])} per rank, "
                 f"K dim {a['k_head_dim']}, V dim {a['v_head_dim']}, {a['dtype']}{stored}, page size {a['page_size']}")
    if g["mamba"]:
        m = g["mamba"]
        conv = ", ".join("×".join(map(str, c)) for c in m["conv_shapes"])
        out.line(f"mamba/GDN: {plural(len(m['layers']), 'layer')}, conv [{conv}] {m['conv_dtype']}, "
                 f"temporal {'×'.join(map(str, m['temporal_shape']))} {m['temporal_dtype']}, conv sliced on axis {m['conv_slice_axis']}")
    both = Geometry.from_header(g, parallel_layers=None).parallel_layers  # format 1.4 (FalconH1)
    if both:
        out.line(f"parallel layers (attention and mamba side by side): {', '.join(map(str, both))}")
    budget = req["remaining_budget"]
    out.line(f"request {escape(req['rid'])}: prompt {req['prompt_tokens']} + output {req['output_tokens']} tokens, state position "
             f"{req['state_position']}, streamed {req['streamed']['tokens']}, remaining budget {'unlimited' if budget is None else budget}")
    base = r.get("base")
    if base:  # a delta (spec 5.9): its attention sections hold the rows after its base's position
        out.line(f"delta of {escape(base['name'])} at position {base['state_position']} (snapshot {escape(base['snapshot_id'])}, "
                 f"root digest {out.digest(base['root_digest'])}): attention rows {base['state_position']}..{req['state_position'] - 1}, "
                 f"{plural(base['depth'], 'link')} below")
    secs = r["sections"]
    out.table(SECTION_COLUMNS, [
        (escape(s["name"]), s["kind"], s["layer"], s["dtype"], "×".join(map(str, s["shape"])), s["offset"], s["length"],
         fmt_bytes(s["length"]), out.digest(s["digest"])) for s in secs])
    out.line(f"total {r['file_length']} bytes, payload {r['payload_bytes']} bytes ({fmt_bytes(r['file_length'])} file, "
             f"{fmt_bytes(r['payload_bytes'])} state payload), {len(secs)} sections, root digest {out.digest(r['root_digest'])}")


def _chains(snap, path: str):
    """(rank — None for a single file —, Chain or the HsnapError that refused it) for every rank file that is a
    delta or takes pages from a page store (spec 7.5, 7.6): :func:`.viewmodel.open_rank_chains`, as the viewer opens them."""
    return [(r if isinstance(snap, SnapshotSet) else None, c) for r, c in open_rank_chains(snap, path).items()]


def _chain_summary(rank, chain) -> dict:
    """The same keys for a chain that opened and one that was refused (``error``; no links)."""
    if isinstance(chain, HsnapError):
        return {"rank": rank, "state_position": None, "links": [], "error": error_summary(chain)}
    return {"rank": rank, "state_position": chain.state_position, "error": None, "links": [
        {"path": s.path, "state_position": s.state_position, "base_position": s.base_position, "file_length": s.file_length,
         "payload_bytes": s.payload_bytes, "root_digest": s.root_digest, "snapshot_id": s.identity.snapshot_id,
         "pages": None if s.pages is None else s.pages.count} for s in chain.links]}


# A chain's links, base first (a delta's base is the row above it): the file (named below the snapshot's directory
# unless --wide), plain or delta, its attention rows, its pages in the page store
CHAIN_COLUMNS = (
    Column("#", ">"),
    Column("file", elide="middle", min_width=16),
    Column("link"),
    Column("base", wide_only=True),
    Column("rows", ">"),
    Column("pages", ">"),
    Column("page store", wide_only=True),
    Column("size", ">"),
    Column("root digest"),
    Column("", wide_only=True),  # the head: by default, the last row
)


def _print_chain(rank, chain, out: Printer, beside: str) -> None:
    """A delta's (or a paged file's) chain; ``beside``: the directory the snapshot lies in, which its links are named
    relative to by default."""
    where = "" if rank is None else f" (rank {rank})"
    out.line()
    if isinstance(chain, HsnapError):
        out.line(f"chain{where}: {type(chain).__name__}: {escape(str(chain))}")
        return
    head = chain.head
    out.line(f"chain{where}: {plural(len(chain), 'link')} to position {chain.state_position}, "
             f"{fmt_bytes(sum(s.file_length for s in chain.links))} in all")
    rows = []
    for i, s in enumerate(chain.links):
        pages = s.pages  # spec 5.10: its full pages are page objects in its page store
        rows.append((i, escape(s.path if out.wide else relative_to(s.path, beside)),
                     "plain" if s.base is None else "delta", "-" if s.base is None else escape(s.base.name),
                     f"{s.base_position}..{s.state_position - 1}", "-" if pages is None else pages.count,
                     "-" if pages is None else f"{escape(pages.store)}/, {plural(pages.page_size, 'position')} a page",
                     fmt_bytes(s.file_length), out.digest(s.root_digest), "head" if s is head else ""))
    out.table(CHAIN_COLUMNS, rows, indent="  ")


# `hsnap info --json`: the same keys for a rank file, a TP set and a directory of snapshots (README: Command line);
# each of a directory's entries has viewmodel.ENTRY_KEYS (the viewer lists the same entries)
INFO_KEYS = ("path", "kind", "manifest", "ranks", "chains", "directory", "entries", "pages", "leftovers")

# A directory's entries: each snapshot, TP set and checkpoint chain's newest committed link
ENTRY_COLUMNS = (
    Column("entry", elide="middle", min_width=12),
    Column("rid", elide="middle", min_width=10),
    Column("what"),
    Column("positions", ">"),
    Column("size", ">"),
)


def _entry_row(e: dict, out: Printer) -> tuple:
    name = escape(e["path"] if out.wide else os.path.basename(e["path"].rstrip("/")))
    if e["error"]:
        return (name, "-", e["error"]["error"], "-", "-")
    return (name, escape(e["rid"]), entry_what(e), e["state_position"], fmt_bytes(e["bytes"]))


def _entry_detail(e: dict, out: Printer) -> str | None:
    """What a row of the directory's table leaves out: why its entry did not open, its chain's newer links that were
    passed over (``hsnap verify DIR`` says why), who resumed it already (its claim)."""
    if e["error"]:
        return f"{e['error']['error']}: {escape(e['error']['message'])}"
    said = []
    passed = e["checkpoints"]["passed_over"] if e["checkpoints"] else []
    if passed:
        names = ", ".join(escape(p if out.wide else os.path.basename(p)) for p, _ in passed)
        said.append(f"{len(passed)} passed over: {names}")
    if e["claimed"]:
        said.append(claim_said(e["claimed"]))
    return "; ".join(said) or None


def _info_directory(args, out: Printer) -> int:
    """``hsnap info DIR`` of what a drain, a checkpointer or a migration writes: one line per request."""
    listing, entries = directory_entries(args.path)
    if args.json:
        doc = dict.fromkeys(INFO_KEYS)
        doc.update(path=args.path, kind="directory", ranks=[], chains=[], directory=args.path, entries=entries,
                   pages={"count": listing.pages, "bytes": listing.page_bytes}, leftovers=listing.leftovers)
        print(json.dumps(doc, indent=2, sort_keys=True))
    else:
        parts = entry_counts(entries)
        if listing.pages:
            parts.append(f"page store pages/: {plural(listing.pages, 'page')}, {fmt_bytes(listing.page_bytes)}")
        out.line(f"directory {out.path(escape(args.path))}: {', '.join(parts)}")
        if entries:
            out.table(ENTRY_COLUMNS, [_entry_row(e, out) for e in entries], [_entry_detail(e, out) for e in entries], indent="  ")
        if listing.leftovers:
            out.line(f"leftovers (hidden; `hsnap gc {out.path(escape(args.path), 32)}` lists what it can prove dead): "
                     f"{', '.join(escape(os.path.basename(x.rstrip('/'))) for x in listing.leftovers)}")
    return 1 if any(e["error"] for e in entries) else 0


def cmd_info(args) -> int:
    out = Printer(args.wide)
    if not is_one_snapshot(args.path):
        return _info_directory(args, out)
    with open_snapshot(args.path) as snap:
        summary = snapshot_summary(snap)
        chains = _chains(snap, args.path)
        try:
            if args.json:
                doc = dict.fromkeys(INFO_KEYS)
                doc.update(path=args.path, kind="TP set" if isinstance(snap, SnapshotSet) else "snapshot", entries=[], leftovers=[],
                           chains=[_chain_summary(r, c) for r, c in chains], **summary)
                print(json.dumps(doc, indent=2, sort_keys=True))
            else:
                in_set = None
                if isinstance(snap, SnapshotSet):
                    m = summary["manifest"]
                    total = sum(r["file_length"] for r in summary["ranks"])
                    out.line(f"snapshot directory {out.path(escape(args.path))}: id {escape(m['snapshot_id'])}, tp {m['tp_size']}, "
                             f"state position {m['state_position']}, {fmt_bytes(total)} in {plural(len(summary['ranks']), 'rank file')}")
                    out.line()
                    in_set = args.path
                for i, r in enumerate(summary["ranks"]):
                    _print_rank(r, first=i == 0, out=out, in_set=in_set)
                beside = os.path.dirname(args.path.rstrip("/"))
                for r, c in chains:
                    _print_chain(r, c, out, beside)
        finally:
            for _, c in chains:
                if not isinstance(c, HsnapError):
                    c.close()
    broken = [c for _, c in chains if isinstance(c, HsnapError)]
    for e in broken:  # a delta whose chain does not hold cannot be restored: say so, and exit 1
        print(f"hsnap info: {type(e).__name__}: {escape(str(e))}{_hint(e)}", file=sys.stderr)
    return 1 if broken else 0


def _verify_one(path: str, first: bool) -> tuple[int, list[str], list[HsnapError]]:
    """(sections checked, links of its chain checked with it, failures) of one snapshot: every rank, every section,
    the padding, and the chain below a delta (the proof restore and compaction make)."""
    failures: list[HsnapError] = []
    n = 0
    links: list[str] = []
    try:
        with open_snapshot(path) as snap:
            chains = _chains(snap, path)
            try:
                by_rank = dict(chains)
                for r, s in (snap.ranks.items() if isinstance(snap, SnapshotSet) else [(None, snap)]):
                    n += len(s.sections)
                    chain = by_rank.get(r)
                    if chain is None or isinstance(chain, HsnapError):  # each rank in the order of spec 7.2: padding, then sections
                        failures += s.verify_failures(first=first)
                        if chain is not None and not (first and failures):
                            failures.append(chain)  # a chain that does not open (spec 7.5)
                    else:  # a delta or a file with pages: the one proof restore and compaction make (spec 7.5, 7.6)
                        links += [link.path for link in reversed(chain.links[:-1])]
                        n += sum(len(link.sections) for link in chain.links[:-1])
                        failures += chain.proof_failures(first=first)
                    if first and failures:
                        break
            finally:
                for _, c in chains:
                    if not isinstance(c, HsnapError):
                        c.close()
    except HsnapError as e:  # refused at open: nothing else can be checked
        failures, n = [e], 0
    return n, links, failures[:1] if first else failures


# `hsnap verify --json`: the same keys for a rank file, a TP set and a directory; a failure puts the first one's
# error, path, field and message at the top level (README: Command line)
VERIFY_KEYS = ("ok", "path", "sections", "links", "errors", "error", "field", "message", "entries")


def _verify_document(path: str, sections: int, links: list[str], errors: list[dict], entries: list[dict]) -> dict:
    doc = dict.fromkeys(VERIFY_KEYS)
    doc.update(ok=not errors, path=path, sections=sections, links=links, errors=errors, entries=entries)
    if errors:
        doc.update(errors[0])  # the first failure at the top level, as before
    return doc


def _print_ok(out: Printer, path: str, n: int, links: list[str]) -> None:
    # below a set's head every rank has its chain: count the links (sets), not their rank files
    sets = {posixpath.dirname(p) for p in links}
    if links and all(RANK_FILE_RE.match(posixpath.basename(p)) for p in links) and len(sets) < len(links):
        chain = f" (with {plural(len(sets), 'link')} of its chain, each of {len(links) // len(sets)} ranks)"
    else:
        chain = f" (with {plural(len(links), 'link')} of its chain)" if links else ""
    verified = f": {n} sections verified"
    out.line(f"OK {out.path(escape(path), WIDTH - 3 - len(verified))}{verified}{chain}")


def _verify_directory(args) -> int:
    """``hsnap verify DIR``: each entry of a directory of snapshots (a chain's newest committed link with its chain)."""
    out = Printer(args.wide)
    listing = list_directory(args.path)
    results: list[dict] = []
    for path in listing.entries():
        n, links, failures = _verify_one(path, args.first)
        results.append({"path": path, "ok": not failures, "sections": n, "links": links, "errors": [error_summary(e) for e in failures]})
        if not args.json:
            if failures:
                for failure in failures:
                    print(f"FAILED {type(failure).__name__}: {escape(str(failure))}{_hint(failure)}", file=sys.stderr)
            else:
                _print_ok(out, path if out.wide else relative_to(path, args.path), n, links)
    for choice in listing.chains.values():
        for p, why in choice.passed_over:
            if not args.json:
                print(f"passed over {escape(p)}: {escape(why)}", file=sys.stderr)
    bad = [r for r in results if not r["ok"]]
    if args.json:
        print(json.dumps(_verify_document(args.path, sum(r["sections"] for r in results), [],
                                          [e for r in results for e in r["errors"]], results)))
    elif bad:
        print(f"FAILED {escape(args.path)}: {len(bad)} of {plural(len(results), 'entry', 'entries')} do not verify", file=sys.stderr)
    else:
        verified = f": {plural(len(results), 'entry', 'entries')} verified"
        out.line(f"OK {out.path(escape(args.path), WIDTH - 3 - len(verified))}{verified}")
    return 1 if bad else 0


def cmd_verify(args) -> int:
    """Every rank, every section, the padding: report each failure (``--first``: stop at one)."""
    if not is_one_snapshot(args.path):
        return _verify_directory(args)
    n, links, failures = _verify_one(args.path, args.first)
    if args.json:
        print(json.dumps(_verify_document(args.path, n, links, [error_summary(e) for e in failures], [])))
    elif failures:
        for failure in failures:
            print(f"FAILED {type(failure).__name__}: {escape(str(failure))}{_hint(failure)}", file=sys.stderr)
        if len(failures) > 1:
            print(f"FAILED {escape(args.path)}: {len(failures)} problems", file=sys.stderr)
    else:
        _print_ok(Printer(args.wide), args.path, n, links)
    return 1 if failures else 0


def _hint(e: BaseException) -> str:
    hint = leftover_hint(e)
    return f" ({hint})" if hint else ""


# status -> order in the printed diff: what needs attention first
_DIFF_ORDER = {"digest-mismatch": 0, "shape-mismatch": 1, "only-in-A": 2, "only-in-B": 2, "differ": 3, "equal": 4}
_NAMES_IN_SUMMARY = 5


def _fmt(v) -> str:
    return "-" if v is None else f"{v:.6g}" if isinstance(v, float) else escape(v)


def _names(labels: list[str]) -> str:
    more = f", … {len(labels) - _NAMES_IN_SUMMARY} more" if len(labels) > _NAMES_IN_SUMMARY else ""
    return ", ".join(escape(x) for x in labels[:_NAMES_IN_SUMMARY]) + more


# A diff's sections: the first difference is a column with --wide, else a line under its section's row
DIFF_COLUMNS = (
    Column("section", elide="middle", min_width=12),
    Column("status"),
    Column("max_abs", ">"),
    Column("max_rel", ">"),
    Column("differing", ">"),
    Column("first difference", wide_only=True),
)


def _first_difference(d) -> str:
    first = "" if d.first_diff is None else f"{list(d.first_diff)}: {fmt_value_pair(d.first_a, d.first_b, d.dtype_a, d.dtype_b)}"
    if d.status == "shape-mismatch":
        return f"A {list(d.shape_a)} B {list(d.shape_b)}"
    if d.status == "digest-mismatch":
        return f"{d.corrupt} fails its own digest: its bytes are not what was written"
    if d.dtype_mismatch:
        return f"dtype A {d.dtype_a} B {d.dtype_b}; " + first
    return first


def _print_diff(report, args) -> None:
    """h5diff-like text: header differences, then one line per section (the troubled ones
    first; equal ones only with -v), then a summary naming what differs."""
    out = Printer(args.wide)
    for rank, h in report.headers.items():
        where = f"rank {rank} " if report.multi_rank else ""
        for part, rows in (("identity", h.identity), ("geometry", h.geometry), ("request", h.request), ("info", h.info)):
            for field, a, b in rows:
                out.line(f"{where}{part}: {escape(field)}: A {escape(repr(a))} != B {escape(repr(b))}")
    if report.ranks_a != report.ranks_b:
        out.line(f"ranks: A {list(report.ranks_a)} != B {list(report.ranks_b)}")
    shown = sorted((d for d in report.sections if args.verbose or not d.same), key=lambda d: _DIFF_ORDER.get(d.status, 5))
    firsts = [_first_difference(d) for d in shown]
    out.table(DIFF_COLUMNS, [
        (escape(report.label(d)), d.status, _fmt(d.max_abs_diff), _fmt(d.max_rel_diff),
         f"{d.count_differ}/{d.elements}" if d.status in ("equal", "differ") else "", first) for d, first in zip(shown, firsts)],
        None if out.wide else firsts)
    differing = sorted(report.differing, key=lambda d: _DIFF_ORDER.get(d.status, 5))
    n = len(differing)
    verdict = "same" if report.same else "DIFFER"
    names = f": {_names([report.label(d) for d in differing])}" if differing else ""
    out.line(f"{n} of {len(report.sections)} sections differ{names} (atol {report.atol:g}, rtol {report.rtol:g}); snapshots {verdict}")


def _resolved(path: str, tmp: str, label: str) -> tuple[str, int]:
    """``path`` itself when its sections hold its whole state; else (a delta, a file that references pages) the plain
    snapshot its chain stands for, compacted into ``tmp`` — proved as a restore proves it — and its link count."""
    with open_snapshot(path) as snap:
        whole = _partial_rows(snap) is None
    if whole:
        return path, 1
    out = os.path.join(tmp, label + ("" if os.path.isdir(path) else ".hsnap"))
    links, _ = compact_path(path, out, fsync=False)
    return out, links


def cmd_diff(args) -> int:
    """Exit 0 when A and B are the same, 1 when they differ, 2 on error (as h5diff).  A and B are compared as the
    states they stand for (a delta with its chain, a paged file with its pages), unless --bytes."""
    import tempfile

    from .diff import diff_snapshots

    try:
        with tempfile.TemporaryDirectory(prefix="hsnap-diff-") as tmp:
            sides = {"A": (args.a, 1), "B": (args.b, 1)} if args.bytes else {
                "A": _resolved(args.a, tmp, "a"), "B": _resolved(args.b, tmp, "b")}
            shown = Printer(args.wide).path
            notes = [f"{label} ({shown(escape(given))}): compared as the state its chain of {plural(links, 'link')} stands for"
                     for (label, (path, links)), given in zip(sides.items(), (args.a, args.b)) if path != given]
            with open_snapshot(sides["A"][0]) as a, open_snapshot(sides["B"][0]) as b:
                report = diff_snapshots(a, b, atol=args.atol, rtol=args.rtol, stop_at_first=args.names_only)
    except (HsnapError, ValueError) as e:
        print(f"hsnap diff: {type(e).__name__}: {escape(str(e))}{_hint(e)}", file=sys.stderr)
        return 2
    if not args.json:
        for note in notes:
            Printer(args.wide, file=sys.stderr).line(note)
    corrupt = report.corrupt
    if args.json:
        print(json.dumps(report.to_dict(), indent=2, sort_keys=True))
    elif args.names_only:
        for rank, h in report.headers.items():
            prefix = f"rank{rank}/" if report.multi_rank else ""
            for field, _, _ in h.identity + h.geometry + h.request:
                print(prefix + escape(field))
        for d in report.differing:
            print(escape(report.label(d)))
    else:
        _print_diff(report, args)
    if corrupt:  # a comparison with bytes that fail their own digests is no answer
        names = ", ".join(f"{escape(report.label(d))} ({d.corrupt})" for d in corrupt)
        print(f"hsnap diff: DigestMismatchError: {len(corrupt)} section(s) fail their own digests: {names}", file=sys.stderr)
        return 2
    return 0 if report.same else 1


def _partial_rows(snap) -> str | None:
    """Why ``snap``'s attention sections do not hold all its rows (a delta: those after its base, spec 5.9; a paged
    file: those outside its pages, spec 5.10), or None when they do."""
    for s in (snap.ranks.values() if isinstance(snap, SnapshotSet) else [snap]):
        if s.base is not None:
            return (f"a delta of {s.base.name}: its attention sections hold rows {s.base_position}..{s.state_position - 1} of "
                    f"{s.state_position}")
        if s.pages is not None:
            return f"its attention sections leave out the {s.pages.count * s.pages.page_size} rows of its pages in {s.pages.store}/"
    return None


def cmd_export(args) -> int:
    """One section to .npy, or every section (--all) to a directory of .npy or one .safetensors file."""
    from . import export_npy as ex

    with open_snapshot(args.path) as snap:
        partial = None if args.link_only else _partial_rows(snap)
        attention = args.section and args.section.rsplit("/", 1)[-1].startswith(("attn.", "mla."))
        if partial and (args.all or attention):  # never a part of the KV exported as if it were all of it
            print(f"hsnap export: {escape(args.path)} is {partial}: `hsnap compact {escape(args.path)} -o FULL.hsnap` writes the "
                  "whole state to export, or --link-only exports this file's own rows", file=sys.stderr)
            return 2
        if args.all:
            if args.section:
                print("hsnap export: give either SECTION or --all", file=sys.stderr)
                return 2
            # the default is a directory by its trailing separator, whatever dots the snapshot's name has
            out = args.output or (os.path.basename(os.path.normpath(args.path)).rsplit(".", 1)[0] + "-npy" + os.sep)
            if out.endswith(".safetensors"):
                done = ex.export_safetensors(snap, out, force=args.force)
            else:
                done = ex.export_all_npy(snap, out, raw=args.raw, force=args.force)
            shown = Printer(args.wide)
            shown.line(f"exported {len(done)} sections to {shown.path(escape(out))} "
                       f"({fmt_bytes(sum(math.prod(e.shape) * DTYPES[e.dtype].itemsize for e in done))})")
            return 0
        if not args.section:
            print("hsnap export: name a SECTION (hsnap info lists them) or give --all", file=sys.stderr)
            return 2
        rank, s, info = ex.find_section(snap, args.section, args.rank)
        out = args.output or info.name + ".npy"
        e = ex.export_npy(s, info, out, raw=args.raw, force=args.force, source=snap)
        note = "" if e.stored_as == np.dtype(DTYPES[info.dtype]).name else f" as {e.stored_as}"
        shown = Printer(args.wide)
        shown.line(f"exported {escape(info.name)} ({info.dtype} {'×'.join(map(str, info.shape))}{note}, digest verified) to "
                   f"{shown.path(escape(out))}")
    return 0


def cmd_compact(args) -> int:
    """A chain (a delta and the links below it) into one plain snapshot (spec 7.5)."""
    links, nbytes = compact_path(args.path, args.output)
    if args.json:
        print(json.dumps({"ok": True, "path": args.path, "output": args.output, "links": links, "bytes": nbytes}))
    else:
        out = Printer(args.wide)
        out.line(f"compacted {plural(links, 'link')} of {out.path(escape(args.path), 32)} into {out.path(escape(args.output), 32)} "
                 f"({fmt_bytes(nbytes)}), every digest verified")
    return 0


def cmd_gc(args) -> int:
    """List (or with --remove, remove) leftovers of interrupted writes — a directory's
    temporaries and staging directories, or an object-store prefix's stale multipart
    uploads and unfinished sets — each proved one by one and announced with its size
    before it goes; exit 1 if a removal failed."""
    # --json: stdout is the document alone, and the announcements on stderr name whole paths, as it does
    out = Printer(args.wide or args.json, file=sys.stderr if args.json else sys.stdout)
    below = os.path.join(args.dir, args.store) if args.pages else args.dir  # what the listing names paths below

    def announce(path: str, nbytes: int) -> None:  # each file, with its size, before its unlink
        size = f"  {nbytes} bytes"
        out.line(f"removing {out.path(escape(path if out.wide else relative_to(path, below)), WIDTH - 9 - len(size))}{size}")

    try:
        if args.pages:  # mark and sweep of the page store beside DIR (spec 8.2)
            return print_pages_report(args, collect_pages(args.dir, store_name=args.store, remove=args.remove,
                                                          older_than=args.older_than, announce=announce, verify=args.verify))
        items = store_for(args.dir).collect(args.dir, remove=args.remove, older_than=args.older_than, announce=announce)
    except OSError as e:  # a directory that cannot be scanned
        print(f"hsnap gc: {escape(args.dir)}: {e.strerror or e}", file=sys.stderr)
        return 2
    except HsnapError as e:  # a store that refused or did not answer
        print(f"hsnap gc: {type(e).__name__}: {escape(str(e))}", file=sys.stderr)
        return 2
    return print_gc_report(args, items)


# What `hsnap gc --pages` counts, page objects only (markers are listed, never removed): each name -> which pages.
# "removable": proved unreferenced by this run (with --remove, then removed, failed or gone; kept if the sweep ran
# out of time); without --remove nothing is removed.
PAGE_TOTALS = {
    "kept": lambda v: v.action == "kept",
    "removable": lambda v: v.removable,
    "removed": lambda v: v.action == "removed",
    "failed": lambda v: v.action == "failed",
    "gone": lambda v: v.action == "gone",
}
PAGES_LISTED = 10  # removable, removed, failed or gone pages named by default (--verbose, --wide: every object)

PAGE_COLUMNS = (
    Column("action"),
    Column("object", elide="middle", min_width=24),
    Column("bytes", ">"),
    Column("age", ">"),
    Column("reason", wide_only=True),
)
TOTAL_COLUMNS = (Column("pages"), Column("count", ">"), Column("bytes", ">"), Column("size", ">"))


def page_totals(report) -> dict:
    """{kept|removable|removed|failed|gone: {"count", "bytes"}} of the page objects of a ``gc --pages`` report."""
    pages = [v for v in report.items if v.path.endswith(PAGE_SUFFIX)]
    return {name: {"count": sum(1 for v in pages if chosen(v)), "bytes": sum(v.bytes for v in pages if chosen(v))}
            for name, chosen in PAGE_TOTALS.items()}


def _bounded(lines: list[str], limit: int, everything: bool) -> list[str]:
    if everything or len(lines) <= limit:
        return lines
    return lines[:limit] + [f"… and {len(lines) - limit} more (--verbose lists all)"]


def print_pages_report(args, report) -> int:
    """The report of ``hsnap gc --pages``: the pages it removed (or would remove, or failed to), then what it counted
    — kept, removable and removed pages and their bytes — and what it read; with --verbose or --wide every object
    with its verdict. Exit 1 if a removal failed or a page is damaged, 3 if the sweep was refused (nothing removed)."""
    failed = sum(i.action == "failed" for i in report.items) + len(report.damaged)
    totals = page_totals(report)
    if args.json:
        print(json.dumps({**report.to_dict(), "totals": totals}, indent=2, sort_keys=True))
        return 1 if failed else 3 if report.refused else 0
    out = Printer(args.wide)
    everything = args.verbose or args.wide
    store_dir = os.path.join(report.directory, report.store)
    listed = [v for v in report.items if everything or v.removable or v.action != "kept"]
    shown = listed if everything else listed[:PAGES_LISTED]
    if shown:
        out.table(PAGE_COLUMNS, [(v.action, escape(v.path if out.wide else relative_to(v.path, store_dir)), v.bytes,
                                  f"{v.age_s:.0f} s", escape(v.reason)) for v in shown],
                  None if out.wide else [escape(v.reason) if everything or v.action in ("failed", "gone") else None for v in shown])
        if len(listed) > len(shown):
            out.line(f"… and {len(listed) - len(shown)} more (--verbose lists all)")
    others = len(report.items) - sum(v.path.endswith(PAGE_SUFFIX) for v in report.items)
    markers = f", {plural(others, 'other object')} (markers)" if others else ""
    out.line(f"page store {out.path(escape(store_dir))}/: {plural(sum(v.path.endswith(PAGE_SUFFIX) for v in report.items), 'page')} listed"
             f"{markers}")
    out.table(TOTAL_COLUMNS, [(name, t["count"], t["bytes"], fmt_bytes(t["bytes"])) for name, t in totals.items()
                              if name in ("kept", "removable", "removed") or t["count"]], indent="  ")
    if totals["removable"]["count"] and not args.remove:
        out.line(f"dry run: nothing removed; --remove removes the {plural(totals['removable']['count'], 'removable page')}")
    out.line(f"{plural(len(report.snapshots), 'committed snapshot')} read, {plural(report.referenced, 'page')} referenced, "
             f"{plural(report.protected, 'key')} protected by writers")
    def said(r: str) -> str:  # "PATH: why", PATH below DIR unless --wide
        return escape(r if out.wide else relative_to(r, report.directory))

    for r in report.damaged:
        out.line(f"damaged: {said(r)}")
    # a file without the magic is not a snapshot (spec 8.2 step 4): said, not a refusal
    for line in _bounded([f"skipped: {said(r)}" for r in report.skipped], PAGES_LISTED, everything):
        out.line(line)
    for r in report.refused:
        out.line(f"sweep refused: {said(r)}")
    return 1 if failed else 3 if report.refused else 0


# A leftover of an interrupted write, then each file in it: the reason is a column with --wide, else a line under it
LEFTOVER_COLUMNS = (
    Column("action"),
    Column("kind"),
    Column("path", elide="middle", min_width=20),
    Column("bytes", ">"),
    Column("age", ">"),
    Column("reason", wide_only=True),
)


def print_gc_report(args, items) -> int:
    """The report of ``hsnap gc`` (local or URL); exit 1 if a removal failed."""
    failed = sum(i.action == "failed" for i in items)
    if args.json:
        print(json.dumps({"dir": args.dir, "remove": args.remove, "older_than": args.older_than, "leftovers": [i.to_dict() for i in items]}, indent=2, sort_keys=True))
        return 1 if failed else 0
    out = Printer(args.wide)
    rows, reasons = [], []
    for i in items:  # named below DIR, and each file below its leftover, unless --wide
        rows.append((i.action, i.kind, escape(i.path if out.wide else relative_to(i.path, args.dir)), i.bytes, f"{i.age_s:.0f} s",
                     escape(i.reason)))
        reasons.append(escape(i.reason))
        for f in getattr(i, "files", ()):  # every file examined, with its size and verdict
            if f.path != i.path:
                rows.append((f.action, "", "  " + escape(f.path if out.wide else relative_to(f.path, i.path)), f.bytes, "",
                             escape(f.reason)))
                reasons.append(escape(f.reason))
    if rows:
        out.table(LEFTOVER_COLUMNS, rows, None if out.wide else reasons)
    n_rm = sum(i.action in ("removed", "would remove") for i in items)
    verb = "removed" if args.remove else "removable (run with --remove)"
    gone = [f for i in items for f in getattr(i, "files", ()) if f.action in ("removed", "would remove")]
    files = f"; {len(gone)} files, {sum(f.bytes for f in gone)} bytes {verb.split()[0]}" if gone else ""
    out.line(f"{len(items)} leftovers in {out.path(escape(args.dir))}: {n_rm} {verb}, {len(items) - n_rm - failed} kept, "
             f"{failed} failed{files}")
    return 1 if failed else 0


# Subcommands of other packages register in the `hsnap.commands` entry-point group (pyproject.toml), as the plug-in
# registers with SGLang's `sglang.srt.plugins`: this package never names them. Each entry is `name = "module:function"`;
# the function takes argv and returns the exit status, and its docstring's first line is its help.
COMMANDS_GROUP = "hsnap.commands"


def registered_commands() -> dict:
    """name -> entry point of every installed subcommand of another package."""
    from importlib.metadata import entry_points
    return {ep.name: ep for ep in entry_points(group=COMMANDS_GROUP)}


def _command_help(ep) -> str:
    try:
        fn = ep.load()
    except ImportError as e:
        return f"(not available: {e}; install the matching extra)"
    return ((fn.__doc__ or "").strip().splitlines() or [""])[0]


def main(argv: list[str] | None = None) -> int:
    try:
        return _main(argv)
    except KeyboardInterrupt:  # Ctrl-C: one line, the shell's convention for SIGINT
        print("hsnap: interrupted", file=sys.stderr)
        return 130
    except BrokenPipeError:  # `hsnap info X | head`: the reader left, that is not an error
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 0


def _main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv and argv[0] == "cp":
        from .cli_remote import cp_main
        return cp_main(argv[1:])
    external = registered_commands()
    if argv and argv[0] in external:
        try:
            fn = external[argv[0]].load()
        except ImportError as e:
            print(f"hsnap {argv[0]}: not available ({e}); install the matching extra", file=sys.stderr)
            return 2
        return fn(argv[1:])
    p = argparse.ArgumentParser(prog="hsnap", description="hsnap request snapshots: inspect, verify, compare, export, clean up")
    p.add_argument("--version", action="version", version=f"hsnap {__version__} (format {MAJOR}.{MINOR})")
    sub = p.add_subparsers(dest="cmd", required=True, metavar="COMMAND")
    wide = argparse.ArgumentParser(add_help=False)  # every command's text fits 80 columns unless --wide
    wide.add_argument("--wide", action="store_true",
                      help="print in full: every column, whole paths and digests, lines as long as they are (default: 80 columns)")
    sp = sub.add_parser("info", parents=[wide], help="identity, geometry, sections, request summary")
    sp.add_argument("path", help="a rank file or a snapshot directory")
    sp.add_argument("--json", action="store_true", help="the whole summary as JSON (sizes in bytes)")
    sp.set_defaults(fn=cmd_info)
    sp = sub.add_parser("verify", parents=[wide], help="check every byte; exit 0 when intact, else one line per failing section or field")
    sp.add_argument("path", help="a rank file or a snapshot directory")
    sp.add_argument("--json", action="store_true", help='{"ok": ..., "errors": [...]} on stdout')
    sp.add_argument("--first", action="store_true", help="stop at the first failure")
    sp.set_defaults(fn=cmd_verify)
    sp = sub.add_parser("diff", parents=[wide], help="compare two snapshots section by section; exit 0 same, 1 differ, 2 error")
    sp.add_argument("a", help="snapshot A: a rank file or a snapshot directory")
    sp.add_argument("b", help="snapshot B")
    sp.add_argument("--json", action="store_true", help="the whole report as JSON")
    sp.add_argument("--atol", type=float, default=0.0, help="absolute tolerance (default 0: exact)")
    sp.add_argument("--rtol", type=float, default=0.0, help="relative tolerance, of max(|a|, |b|)")
    sp.add_argument("--names-only", action="store_true", help="print only the names of differing sections and fields")
    sp.add_argument("--bytes", action="store_true", help="compare the files as they are: a delta's or a paged file's own "
                                                         "sections (default: the states they stand for, chains and pages resolved)")
    sp.add_argument("-v", "--verbose", action="store_true", help="list equal sections too")
    sp.set_defaults(fn=cmd_diff)
    sp = sub.add_parser("export", parents=[wide], help="sections to .npy (one, or --all to a directory) or --all to one .safetensors file",
                        description="Export verified section data. bf16/fp8 sections become float32 in .npy (exact; --raw keeps "
                                    "their bits as uint16/uint8); safetensors keeps bf16 and fp8 as they are. Never overwrites "
                                    "without --force.")
    sp.add_argument("path", help="a rank file or a snapshot directory")
    sp.add_argument("section", nargs="?", help="a section name (attn.3.k; rank1/attn.3.k in a directory)")
    sp.add_argument("-o", "--output", metavar="OUT", help="SECTION: a .npy path (default NAME.npy); --all: a directory (no extension, "
                                                          "or ending in /; default NAME-npy/) or a .safetensors file")
    sp.add_argument("--all", action="store_true", help="every section of every rank")
    sp.add_argument("--rank", type=int, default=None, help="the rank of SECTION in a snapshot directory (default: the lowest)")
    sp.add_argument("--raw", action="store_true", help=".npy: bf16/fp8 as their bit patterns instead of float32")
    sp.add_argument("--force", action="store_true", help="replace existing output files (never the input snapshot or anything inside it)")
    sp.add_argument("--link-only", action="store_true", help="a delta or a paged file: its own attention rows only (else refused: "
                                                             "compact it first)")
    sp.set_defaults(fn=cmd_export)
    sp = sub.add_parser("compact", parents=[wide], help="write a snapshot chain (a delta and its links) as one plain snapshot",
                        description="Open the chain whose head is PATH (a delta rank file or a set of them), check every link, "
                                    "and write one plain snapshot at the head's position: byte for byte what a plain export at "
                                    "that position with the head's identity and record writes. Never overwrites.")
    sp.add_argument("path", help="the chain's head: a rank file or a snapshot directory (or an s3:// URL)")
    sp.add_argument("-o", "--output", required=True, metavar="OUT", help="the new snapshot (a file, a directory for a set, or an s3:// URL)")
    sp.add_argument("--json", action="store_true")
    sp.set_defaults(fn=cmd_compact)
    sp = sub.add_parser("gc", parents=[wide], help="list or remove leftover temporary files of interrupted writes (never a committed snapshot)")
    sp.add_argument("dir", help="a directory that snapshots are written into, or s3://bucket/prefix")
    sp.add_argument("--remove", action="store_true", help="remove what is listed as removable (default: only list)")
    sp.add_argument("--older-than", type=float, metavar="SECONDS", default=None,
                    help="removable when unmodified this long, even if its writer pid is running or unknown (other hosts, TP staging)")
    sp.add_argument("--pages", action="store_true",
                    help="mark and sweep the page store beside DIR instead: remove pages no committed snapshot references (spec 8.2)")
    sp.add_argument("--store", default="pages", metavar="NAME", help="the page store's directory name beside DIR (default: pages)")
    sp.add_argument("--verify", action="store_true",
                    help="with --pages: also read and verify every page object, listing each damaged one (exit 1 if any)")
    sp.add_argument("-v", "--verbose", action="store_true",
                    help="with --pages: list every object with its verdict (default: the removed and removable ones, at most 10)")
    sp.add_argument("--json", action="store_true", help="the list as JSON")
    sp.set_defaults(fn=cmd_gc)
    sub.add_parser("cp", help="copy a snapshot between paths and s3:// URLs, verifying (needs hsnap[remote] for URLs)", add_help=False)
    for name, ep in sorted(external.items()):
        sub.add_parser(name, help=_command_help(ep), add_help=False)
    args = p.parse_args(argv)
    try:
        return args.fn(args)
    except HsnapError as e:
        print(f"hsnap {args.cmd}: {type(e).__name__}: {escape(str(e))}{_hint(e)}", file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())
