"""``hsnap`` command line: info, verify, diff, gc (and, when its packages are
installed, demo). Subcommands that need torch or SGLang are imported only when run,
so ``hsnap info`` stays a numpy + xxhash program."""

from __future__ import annotations

import argparse
import json
import math
import os
import sys

import numpy as np

from .. import MAJOR, MINOR, __version__, open_snapshot
from ..chain import Chain, chain_below, compact_path
from ..errors import HsnapError
from ..manifest import SnapshotSet
from ..records import Geometry
from ..pages import collect_pages
from ..spec import DTYPES
from ..stores import store_for
from ..stores.entries import Listing, is_one_snapshot, list_directory
from .viewmodel import escape, fmt_bytes, fmt_value_pair, leftover_hint, plural, snapshot_summary


def _heads(n: int) -> str:
    return plural(n, "head")


def _print_rank(r: dict, first: bool) -> None:
    ident, req, g = r["identity"], r["request"], r["geometry"]
    if not first:
        print()
    print(f"== {escape(r['path'])}  (hsnap {r['version']}, rank {ident['tp_rank']}/{ident['tp_size']})")
    engine = ident["engine"]
    commit = f" ({escape(engine['commit'])})" if engine.get("commit") else ""
    weights = " ".join(escape(x) for x in (ident.get("weights_version"), ident.get("weights_hash")) if x)
    print(f"model {escape(ident['model_id'])}  weights {weights or '-'}  engine {escape(engine['name'])} {escape(engine['version'])}{commit}")
    print(f"snapshot {escape(ident['snapshot_id'])}  created {escape(ident['created_at'])}  device {escape(ident['device'])}")
    if g["attention"]:
        a = g["attention"]
        stored = "" if a["storage_dtype"] == a["dtype"] else f" (stored as {a['storage_dtype']})"
        swa = f" + {len(a['swa_layers'])} sliding-window" if a["swa_layers"] else ""
        print(f"attention {a['kind']}: {plural(len(a['layers']), 'layer')}{swa}, {_heads(a['heads'])} per rank, "
              f"K dim {a['k_head_dim']}, V dim {a['v_head_dim']}, {a['dtype']}{stored}, page size {a['page_size']}")
    if g["mamba"]:
        m = g["mamba"]
        conv = ", ".join("×".join(map(str, c)) for c in m["conv_shapes"])
        print(f"mamba/GDN: {plural(len(m['layers']), 'layer')}, conv [{conv}] {m['conv_dtype']}, "
              f"temporal {'×'.join(map(str, m['temporal_shape']))} {m['temporal_dtype']}, conv sliced on axis {m['conv_slice_axis']}")
    both = Geometry.from_header(g, parallel_layers=None).parallel_layers  # format 1.4 (FalconH1)
    if both:
        print(f"parallel layers (attention and mamba side by side): {', '.join(map(str, both))}")
    budget = req["remaining_budget"]
    print(f"request {escape(req['rid'])}: prompt {req['prompt_tokens']} + output {req['output_tokens']} tokens, state position {req['state_position']}, "
          f"streamed {req['streamed']['tokens']}, remaining budget {'unlimited' if budget is None else budget}")
    base = r.get("base")
    if base:  # a delta (spec 5.9): its attention sections hold the rows after its base's position
        print(f"delta of {escape(base['name'])} at position {base['state_position']} (snapshot {escape(base['snapshot_id'])}, "
              f"root digest {base['root_digest']}): attention rows {base['state_position']}..{req['state_position'] - 1}, "
              f"{plural(base['depth'], 'link')} below")
    secs = r["sections"]
    w = max([len("name")] + [len(escape(s["name"])) for s in secs])
    kw = max([len("kind")] + [len(s["kind"]) for s in secs])
    shw = max([len("shape")] + [len("×".join(map(str, s["shape"]))) for s in secs])
    print(f"{'name':<{w}}  {'kind':<{kw}} {'layer':>5}  {'dtype':<15} {'shape':<{shw}} {'offset':>12} {'bytes':>12} {'size':>10}  digest")
    for s in secs:
        layer = "" if s["layer"] is None else s["layer"]
        shape = "×".join(map(str, s["shape"]))
        print(f"{escape(s['name']):<{w}}  {s['kind']:<{kw}} {layer:>5}  {s['dtype']:<15} {shape:<{shw}} {s['offset']:>12} {s['length']:>12} "
              f"{fmt_bytes(s['length']):>10}  {s['digest']}")
    print(f"total {r['file_length']} bytes, payload {r['payload_bytes']} bytes ({fmt_bytes(r['file_length'])} file, "
          f"{fmt_bytes(r['payload_bytes'])} state payload), {len(secs)} sections, root digest {r['root_digest']}")


def _chains(snap, path: str):
    """(rank, Chain or the HsnapError that refused it) for every rank file that is a delta
    (spec 7.5): its links, opened and checked, through the store that holds ``path``."""
    store = store_for(path)
    out: list[tuple[int | None, Chain | HsnapError]] = []
    for r, s in (snap.ranks.items() if isinstance(snap, SnapshotSet) else [(None, snap)]):
        if s.base is None and s.pages is None:  # a delta, or a file whose pages are in a page store (7.6)
            continue
        try:
            out.append((r, chain_below(s, location=snap.path, rank=r, store=store)))
        except HsnapError as e:
            out.append((r, e))
    return out


def _chain_summary(rank, chain) -> dict:
    if isinstance(chain, HsnapError):
        return {"rank": rank, "error": _failure(chain)}
    return {"rank": rank, "state_position": chain.state_position, "links": [
        {"path": s.path, "state_position": s.state_position, "base_position": s.base_position, "file_length": s.file_length,
         "payload_bytes": s.payload_bytes, "root_digest": s.root_digest, "snapshot_id": s.identity.snapshot_id,
         "pages": None if s.pages is None else s.pages.count} for s in chain.links]}


def _print_chain(rank, chain) -> None:
    where = "" if rank is None else f" (rank {rank})"
    print()
    if isinstance(chain, HsnapError):
        print(f"chain{where}: {type(chain).__name__}: {escape(str(chain))}")
        return
    head = chain.head
    print(f"chain{where}: {plural(len(chain), 'link')} to position {chain.state_position}, "
          f"{fmt_bytes(sum(s.file_length for s in chain.links))} in all")
    for i, s in enumerate(chain.links):
        what = "plain snapshot" if s.base is None else f"delta of {escape(s.base.name)}"
        if s.pages is not None:  # spec 5.10: its full pages are page objects in its page store
            what += f", {plural(s.pages.count, 'page')} of {s.pages.page_size} positions in {escape(s.pages.store)}/"
        print(f"  {i:>3}  {escape(s.path)}  {what}, attention rows {s.base_position}..{s.state_position - 1}, "
              f"{fmt_bytes(s.file_length)}, root digest {s.root_digest}{'  (head)' if s is head else ''}")


def _entry_summary(path: str, listing: Listing) -> dict:
    """One entry of a directory of snapshots: its request, position and size (of a checkpoint chain, its newest
    committed link, how many links it has and which were passed over, and why)."""
    out: dict = {"path": path}
    chain = next((c for c in listing.chains.values() if (c.path or c.highest) == path), None)
    if chain is not None:
        out["checkpoints"] = {"name": chain.name, "links": listing.links.get(chain.name, 0), "newest_committed": chain.path,
                              "passed_over": [[p, why] for p, why in chain.passed_over]}
    try:
        with open_snapshot(path) as snap:
            ranks = list(snap.ranks.values()) if isinstance(snap, SnapshotSet) else [snap]
            out.update(kind="TP set" if isinstance(snap, SnapshotSet) else "snapshot", tp_size=len(ranks),
                       rid=ranks[0].header["request"]["rid"], state_position=ranks[0].state_position,
                       bytes=sum(r.file_length for r in ranks), delta=ranks[0].base is not None, paged=ranks[0].pages is not None)
    except HsnapError as e:
        out["error"] = _failure(e)
    return out


def _info_directory(args) -> int:
    """``hsnap info DIR`` of what a drain, a checkpointer or a migration writes: one line per request."""
    listing = list_directory(args.path)
    entries = [_entry_summary(p, listing) for p in listing.entries()]
    if args.json:
        print(json.dumps({"directory": args.path, "entries": entries, "pages": {"count": listing.pages, "bytes": listing.page_bytes},
                          "leftovers": listing.leftovers}, indent=2, sort_keys=True))
    else:
        chains = sum("checkpoints" in e for e in entries)
        parts = [plural(len(entries) - chains, "snapshot"), plural(chains, "checkpoint chain")]
        if listing.pages:
            parts.append(f"page store pages/: {plural(listing.pages, 'page')}, {fmt_bytes(listing.page_bytes)}")
        print(f"directory {escape(args.path)}: {', '.join(parts)}")
        for e in entries:
            name = os.path.basename(e["path"].rstrip("/"))
            if "error" in e:
                print(f"  {escape(name)}: {e['error']['error']}: {escape(e['error']['message'])}")
                continue
            what = f"TP set of {e['tp_size']} ranks" if e["kind"] == "TP set" else "snapshot"
            ck = e.get("checkpoints")
            if ck:
                what = f"newest committed link of {plural(ck['links'], 'checkpoint link')}"
                what += f" ({len(ck['passed_over'])} passed over)" if ck["passed_over"] else ""
            print(f"  {escape(name)}: rid {escape(e['rid'])}, {what}, {e['state_position']} committed positions, {fmt_bytes(e['bytes'])}")
        if listing.leftovers:
            print(f"leftovers (hidden; `hsnap gc {escape(args.path)}` lists what it can prove dead): "
                  f"{', '.join(escape(os.path.basename(x.rstrip('/'))) for x in listing.leftovers)}")
    return 1 if any("error" in e for e in entries) else 0


def cmd_info(args) -> int:
    if not is_one_snapshot(args.path):
        return _info_directory(args)
    with open_snapshot(args.path) as snap:
        summary = snapshot_summary(snap)
        chains = _chains(snap, args.path)
        try:
            if chains:
                summary["chains"] = [_chain_summary(r, c) for r, c in chains]
            if args.json:
                print(json.dumps(summary, indent=2, sort_keys=True))
            else:
                if isinstance(snap, SnapshotSet):
                    m = summary["manifest"]
                    total = sum(r["file_length"] for r in summary["ranks"])
                    print(f"snapshot directory {escape(args.path)}: id {escape(m['snapshot_id'])}, tp {m['tp_size']}, "
                          f"state position {m['state_position']}, {fmt_bytes(total)} in {plural(len(summary['ranks']), 'rank file')}")
                    print()
                for i, r in enumerate(summary["ranks"]):
                    _print_rank(r, first=i == 0)
                for r, c in chains:
                    _print_chain(r, c)
        finally:
            for _, c in chains:
                if not isinstance(c, HsnapError):
                    c.close()
    broken = [c for _, c in chains if isinstance(c, HsnapError)]
    for e in broken:  # a delta whose chain does not hold cannot be restored: say so, and exit 1
        print(f"hsnap info: {type(e).__name__}: {escape(str(e))}{_hint(e)}", file=sys.stderr)
    return 1 if broken else 0


def _failure(e: HsnapError) -> dict:
    return {"error": type(e).__name__, "path": e.path, "field": e.field, "message": str(e)}


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


def _verify_directory(args) -> int:
    """``hsnap verify DIR``: each entry of a directory of snapshots (a chain's newest committed link with its chain)."""
    listing = list_directory(args.path)
    results = []
    for path in listing.entries():
        n, links, failures = _verify_one(path, args.first)
        results.append({"path": path, "ok": not failures, "sections": n, "links": links, "errors": [_failure(e) for e in failures]})
        if not args.json:
            if failures:
                for failure in failures:
                    print(f"FAILED {type(failure).__name__}: {escape(str(failure))}{_hint(failure)}", file=sys.stderr)
            else:
                chain = f" (with {plural(len(links), 'link')} of its chain)" if links else ""
                print(f"OK {escape(path)}: {n} sections verified{chain}")
    for choice in listing.chains.values():
        for p, why in choice.passed_over:
            if not args.json:
                print(f"passed over {escape(p)}: {escape(why)}", file=sys.stderr)
    bad = [r for r in results if not r["ok"]]
    if args.json:
        print(json.dumps({"ok": not bad, "path": args.path, "entries": results}))
    elif bad:
        print(f"FAILED {escape(args.path)}: {len(bad)} of {plural(len(results), 'entry', 'entries')} do not verify", file=sys.stderr)
    else:
        print(f"OK {escape(args.path)}: {plural(len(results), 'entry', 'entries')} verified")
    return 1 if bad else 0


def cmd_verify(args) -> int:
    """Every rank, every section, the padding: report each failure (``--first``: stop at one)."""
    if not is_one_snapshot(args.path):
        return _verify_directory(args)
    n, links, failures = _verify_one(args.path, args.first)
    if args.json:
        out = {"ok": not failures, "path": args.path, "sections": n, "errors": [_failure(e) for e in failures]}
        if links:
            out["links"] = links
        if failures:
            out.update(_failure(failures[0]))  # the first failure at the top level, as before
        print(json.dumps(out))
    elif failures:
        for failure in failures:
            print(f"FAILED {type(failure).__name__}: {escape(str(failure))}{_hint(failure)}", file=sys.stderr)
        if len(failures) > 1:
            print(f"FAILED {escape(args.path)}: {len(failures)} problems", file=sys.stderr)
    else:
        chain = f" (with {plural(len(links), 'link')} of its chain)" if links else ""
        print(f"OK {escape(args.path)}: {n} sections verified{chain}")
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


def _print_diff(report, args) -> None:
    """h5diff-like text: header differences, then one line per section (the troubled ones
    first; equal ones only with -v), then a summary naming what differs."""
    for rank, h in report.headers.items():
        where = f"rank {rank} " if report.multi_rank else ""
        for part, rows in (("identity", h.identity), ("geometry", h.geometry), ("request", h.request), ("info", h.info)):
            for field, a, b in rows:
                print(f"{where}{part}: {escape(field)}: A {escape(repr(a))} != B {escape(repr(b))}")
    if report.ranks_a != report.ranks_b:
        print(f"ranks: A {list(report.ranks_a)} != B {list(report.ranks_b)}")
    shown = sorted((d for d in report.sections if args.verbose or not d.same), key=lambda d: _DIFF_ORDER.get(d.status, 5))
    w = max([len("section")] + [len(escape(report.label(d))) for d in shown])
    print(f"{'section':<{w}} {'status':<15} {'max_abs':>11} {'max_rel':>11} {'differing':>19}  first difference")
    for d in shown:
        count = f"{d.count_differ}/{d.elements}" if d.status in ("equal", "differ") else ""
        first = "" if d.first_diff is None else f"{list(d.first_diff)}: {fmt_value_pair(d.first_a, d.first_b, d.dtype_a, d.dtype_b)}"
        if d.status == "shape-mismatch":
            first = f"A {list(d.shape_a)} B {list(d.shape_b)}"
        elif d.status == "digest-mismatch":
            first = f"{d.corrupt} fails its own digest: its bytes are not what was written"
        elif d.dtype_mismatch:
            first = f"dtype A {d.dtype_a} B {d.dtype_b}; " + first
        print(f"{escape(report.label(d)):<{w}} {d.status:<15} {_fmt(d.max_abs_diff):>11} {_fmt(d.max_rel_diff):>11} {count:>19}  {first}")
    differing = sorted(report.differing, key=lambda d: _DIFF_ORDER.get(d.status, 5))
    n = len(differing)
    verdict = "same" if report.same else "DIFFER"
    names = f": {_names([report.label(d) for d in differing])}" if differing else ""
    print(f"{n} of {len(report.sections)} sections differ{names} (atol {report.atol:g}, rtol {report.rtol:g}); snapshots {verdict}")


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
            notes = [f"{label} ({escape(given)}): compared as the state its chain of {plural(links, 'link')} stands for"
                     for (label, (path, links)), given in zip(sides.items(), (args.a, args.b)) if path != given]
            with open_snapshot(sides["A"][0]) as a, open_snapshot(sides["B"][0]) as b:
                report = diff_snapshots(a, b, atol=args.atol, rtol=args.rtol, stop_at_first=args.names_only)
    except (HsnapError, ValueError) as e:
        print(f"hsnap diff: {type(e).__name__}: {escape(str(e))}{_hint(e)}", file=sys.stderr)
        return 2
    if not args.json:
        for note in notes:
            print(note, file=sys.stderr)
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
            print(f"exported {len(done)} sections to {escape(out)} ({fmt_bytes(sum(math.prod(e.shape) * DTYPES[e.dtype].itemsize for e in done))})")
            return 0
        if not args.section:
            print("hsnap export: name a SECTION (hsnap info lists them) or give --all", file=sys.stderr)
            return 2
        rank, s, info = ex.find_section(snap, args.section, args.rank)
        out = args.output or info.name + ".npy"
        e = ex.export_npy(s, info, out, raw=args.raw, force=args.force, source=snap)
        note = "" if e.stored_as == np.dtype(DTYPES[info.dtype]).name else f" as {e.stored_as}"
        print(f"exported {escape(info.name)} ({info.dtype} {'×'.join(map(str, info.shape))}{note}, digest verified) to {escape(out)}")
    return 0


def cmd_compact(args) -> int:
    """A chain (a delta and the links below it) into one plain snapshot (spec 7.5)."""
    links, nbytes = compact_path(args.path, args.output)
    if args.json:
        print(json.dumps({"ok": True, "path": args.path, "output": args.output, "links": links, "bytes": nbytes}))
    else:
        print(f"compacted {plural(links, 'link')} of {escape(args.path)} into {escape(args.output)} ({fmt_bytes(nbytes)}), every digest verified")
    return 0


def cmd_gc(args) -> int:
    """List (or with --remove, remove) leftovers of interrupted writes — a directory's
    temporaries and staging directories, or an object-store prefix's stale multipart
    uploads and unfinished sets — each proved one by one and announced with its size
    before it goes; exit 1 if a removal failed."""
    out = sys.stderr if args.json else sys.stdout  # --json: stdout is the document alone

    def announce(path: str, nbytes: int) -> None:  # each file, with its size, before its unlink
        print(f"removing {escape(path)}  {nbytes} bytes", file=out, flush=True)

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


def print_pages_report(args, report) -> int:
    """The report of ``hsnap gc --pages``: every page object and marker with its size and
    verdict; exit 1 if a removal failed or a page is damaged, 3 if the sweep was refused (nothing removed)."""
    failed = sum(i.action == "failed" for i in report.items) + len(report.damaged)
    if args.json:
        print(json.dumps(report.to_dict(), indent=2, sort_keys=True))
    else:
        for i in report.items:
            print(f"{i.action:<13} {escape(i.path)}  {i.bytes} bytes, {i.age_s:.0f} s old, {escape(i.reason)}")
        print(f"{plural(len(report.snapshots), 'committed snapshot')} read, {plural(report.referenced, 'page')} referenced, "
              f"{plural(report.protected, 'key')} protected by writers")
        for r in report.damaged:
            print(f"damaged: {escape(r)}")
        for r in report.skipped:  # a file without the magic is not a snapshot (spec 8.2 step 4): said, not a refusal
            print(f"skipped: {escape(r)}")
        for r in report.refused:
            print(f"sweep refused: {escape(r)}")
    return 1 if failed else 3 if report.refused else 0


def print_gc_report(args, items) -> int:
    """The report of ``hsnap gc`` (local or URL); exit 1 if a removal failed."""
    failed = sum(i.action == "failed" for i in items)
    if args.json:
        print(json.dumps({"dir": args.dir, "remove": args.remove, "older_than": args.older_than, "leftovers": [i.to_dict() for i in items]}, indent=2, sort_keys=True))
        return 1 if failed else 0
    for i in items:
        print(f"{i.action:<13} {i.kind:<8} {escape(i.path)}  {i.bytes} bytes, {i.age_s:.0f} s old, {escape(i.reason)}")
        for f in getattr(i, "files", ()):  # every file examined, with its size and verdict
            if f.path != i.path:
                print(f"  {f.action:<12} {escape(f.path)}  {f.bytes} bytes, {escape(f.reason)}")
    n_rm = sum(i.action in ("removed", "would remove") for i in items)
    verb = "removed" if args.remove else "removable (run with --remove)"
    gone = [f for i in items for f in getattr(i, "files", ()) if f.action in ("removed", "would remove")]
    files = f"; {len(gone)} files, {sum(f.bytes for f in gone)} bytes {verb.split()[0]}" if gone else ""
    print(f"{len(items)} leftovers in {escape(args.dir)}: {n_rm} {verb}, {len(items) - n_rm - failed} kept, {failed} failed{files}")
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
    sp = sub.add_parser("info", help="identity, geometry, sections, request summary")
    sp.add_argument("path", help="a rank file or a snapshot directory")
    sp.add_argument("--json", action="store_true", help="the whole summary as JSON (sizes in bytes)")
    sp.set_defaults(fn=cmd_info)
    sp = sub.add_parser("verify", help="check every byte; exit 0 when intact, else one line per failing section or field")
    sp.add_argument("path", help="a rank file or a snapshot directory")
    sp.add_argument("--json", action="store_true", help='{"ok": ..., "errors": [...]} on stdout')
    sp.add_argument("--first", action="store_true", help="stop at the first failure")
    sp.set_defaults(fn=cmd_verify)
    sp = sub.add_parser("diff", help="compare two snapshots section by section; exit 0 same, 1 differ, 2 error")
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
    sp = sub.add_parser("export", help="sections to .npy (one, or --all to a directory) or --all to one .safetensors file",
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
    sp = sub.add_parser("compact", help="write a snapshot chain (a delta and its links) as one plain snapshot",
                        description="Open the chain whose head is PATH (a delta rank file or a set of them), check every link, "
                                    "and write one plain snapshot at the head's position: byte for byte what a plain export at "
                                    "that position with the head's identity and record writes. Never overwrites.")
    sp.add_argument("path", help="the chain's head: a rank file or a snapshot directory (or an s3:// URL)")
    sp.add_argument("-o", "--output", required=True, metavar="OUT", help="the new snapshot (a file, a directory for a set, or an s3:// URL)")
    sp.add_argument("--json", action="store_true")
    sp.set_defaults(fn=cmd_compact)
    sp = sub.add_parser("gc", help="list or remove leftover temporary files of interrupted writes (never a committed snapshot)")
    sp.add_argument("dir", help="a directory that snapshots are written into, or s3://bucket/prefix")
    sp.add_argument("--remove", action="store_true", help="remove what is listed as removable (default: only list)")
    sp.add_argument("--older-than", type=float, metavar="SECONDS", default=None,
                    help="removable when unmodified this long, even if its writer pid is running or unknown (other hosts, TP staging)")
    sp.add_argument("--pages", action="store_true",
                    help="mark and sweep the page store beside DIR instead: remove pages no committed snapshot references (spec 8.2)")
    sp.add_argument("--store", default="pages", metavar="NAME", help="the page store's directory name beside DIR (default: pages)")
    sp.add_argument("--verify", action="store_true",
                    help="with --pages: also read and verify every page object, listing each damaged one (exit 1 if any)")
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
