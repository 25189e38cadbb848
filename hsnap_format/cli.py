"""``hsnap`` command line: info, verify, diff, gc (and, when its packages are
installed, demo). Subcommands that need torch or SGLang are imported only when run,
so ``hsnap info`` stays a numpy + xxhash program."""

from __future__ import annotations

import argparse
import importlib
import json
import os
import sys

from . import open_snapshot
from .errors import HsnapError
from .manifest import SnapshotSet
from .reader import Snapshot
from .viewmodel import escape, snapshot_summary


def _ranks(snap) -> list[Snapshot]:
    return list(snap.ranks.values()) if isinstance(snap, SnapshotSet) else [snap]


def cmd_info(args) -> int:
    with open_snapshot(args.path) as snap:
        summary = snapshot_summary(snap)
        if args.json:
            print(json.dumps(summary, indent=2, sort_keys=True))
            return 0
        if isinstance(snap, SnapshotSet):
            m = summary["manifest"]
            print(f"snapshot directory {escape(args.path)}: id {escape(m['snapshot_id'])}, tp {m['tp_size']}, state position {m['state_position']}")
        for r in summary["ranks"]:
            ident, req = r["identity"], r["request"]
            print(f"\n== {escape(r['path'])}  (hsnap {r['version']}, rank {ident['tp_rank']}/{ident['tp_size']})")
            print(f"model {escape(ident['model_id'])} weights {escape(ident['weights_version'])} engine {escape(ident['engine']['name'])} {escape(ident['engine']['version'])} ({escape(ident['engine']['commit'])})")
            print(f"snapshot {escape(ident['snapshot_id'])} created {escape(ident['created_at'])} device {escape(ident['device'])}")
            g = r["geometry"]
            if g["attention"]:
                a = g["attention"]
                print(f"attention {a['kind']}: {len(a['layers'])} full + {len(a['swa_layers'])} swa layers, {a['heads']} heads, K {a['k_head_dim']} V {a['v_head_dim']}, {a['dtype']} (stored {a['storage_dtype']}), page {a['page_size']}")
            if g["mamba"]:
                m = g["mamba"]
                print(f"mamba: {len(m['layers'])} layers, conv {m['conv_shapes']} {m['conv_dtype']}, temporal {m['temporal_shape']} {m['temporal_dtype']}, slice axis {m['conv_slice_axis']}")
            print(f"request {escape(req['rid'])}: prompt {req['prompt_tokens']} + output {req['output_tokens']} tokens, state position {req['state_position']}, streamed {req['streamed']['tokens']}, remaining budget {req['remaining_budget']}")
            print(f"{'name':<26} {'kind':<16} {'layer':>5} {'dtype':<14} {'shape':<18} {'offset':>12} {'bytes':>12}  digest")
            for s in r["sections"]:
                layer = "" if s["layer"] is None else s["layer"]
                print(f"{escape(s['name']):<26} {s['kind']:<16} {layer:>5} {s['dtype']:<14} {str(s['shape']):<18} {s['offset']:>12} {s['length']:>12}  {s['digest']}")
            print(f"total {r['file_length']} bytes, payload {r['payload_bytes']} bytes, {len(r['sections'])} sections, root digest {r['root_digest']}")
    return 0


def cmd_verify(args) -> int:
    try:
        with open_snapshot(args.path) as snap:
            for s in _ranks(snap):
                s.verify()
            n = sum(len(s.sections) for s in _ranks(snap))
    except HsnapError as e:
        if args.json:
            print(json.dumps({"ok": False, "error": type(e).__name__, "path": e.path, "field": e.field, "message": str(e)}))
        else:
            print(f"FAILED {type(e).__name__}: {escape(str(e))}", file=sys.stderr)
        return 1
    if args.json:
        print(json.dumps({"ok": True, "path": args.path, "sections": n}))
    else:
        print(f"OK {escape(args.path)}: {n} sections verified")
    return 0


def _fmt(v) -> str:
    return "-" if v is None else f"{v:.6g}" if isinstance(v, float) else escape(v)


def _print_diff(report, args) -> None:
    """h5diff-like text: header differences, then one line per section (differing ones unless -v)."""
    for rank, h in report.headers.items():
        where = f"rank {rank} " if report.multi_rank else ""
        for part, rows in (("identity", h.identity), ("geometry", h.geometry), ("request", h.request), ("info", h.info)):
            for field, a, b in rows:
                print(f"{where}{part}: {escape(field)}: A {escape(repr(a))} != B {escape(repr(b))}")
    if report.ranks_a != report.ranks_b:
        print(f"ranks: A {list(report.ranks_a)} != B {list(report.ranks_b)}")
    print(f"{'section':<34} {'status':<15} {'max_abs':>11} {'max_rel':>11} {'differing':>19}  first difference")
    for d in report.sections:
        if d.same and not args.verbose:
            continue
        count = f"{d.count_differ}/{d.elements}" if d.status in ("equal", "differ") else ""
        first = "" if d.first_diff is None else f"{list(d.first_diff)}: A {_fmt(d.first_a)} B {_fmt(d.first_b)}"
        if d.status == "shape-mismatch":
            first = f"A {list(d.shape_a)} B {list(d.shape_b)}"
        elif d.dtype_mismatch:
            first = f"dtype A {d.dtype_a} B {d.dtype_b}; " + first
        print(f"{escape(report.label(d)):<34} {d.status:<15} {_fmt(d.max_abs_diff):>11} {_fmt(d.max_rel_diff):>11} {count:>19}  {first}")
    n = len(report.differing)
    verdict = "same" if report.same else "DIFFER"
    print(f"{n} of {len(report.sections)} sections differ (atol {report.atol:g}, rtol {report.rtol:g}); snapshots {verdict}")


def cmd_diff(args) -> int:
    """Exit 0 when A and B are the same, 1 when they differ, 2 on error (as h5diff)."""
    from .diff import diff_snapshots

    try:
        with open_snapshot(args.a) as a, open_snapshot(args.b) as b:
            report = diff_snapshots(a, b, atol=args.atol, rtol=args.rtol, stop_at_first=args.names_only)
    except (HsnapError, ValueError) as e:
        print(f"hsnap diff: {type(e).__name__}: {escape(str(e))}", file=sys.stderr)
        return 2
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


def cmd_gc(args) -> int:
    """List (or with --remove, remove) leftovers of interrupted writes; exit 1 if a removal failed."""
    from . import gc

    try:
        items = gc.collect(args.dir, remove=args.remove, older_than=args.older_than)
    except OSError as e:
        print(f"hsnap gc: {escape(args.dir)}: {e.strerror or e}", file=sys.stderr)
        return 2
    failed = sum(i.action == "failed" for i in items)
    if args.json:
        print(json.dumps({"dir": args.dir, "remove": args.remove, "older_than": args.older_than, "leftovers": [i.to_dict() for i in items]}, indent=2, sort_keys=True))
        return 1 if failed else 0
    for i in items:
        print(f"{i.action:<13} {i.kind:<8} {escape(i.path)}  {i.bytes} bytes, {i.age_s:.0f} s old, {escape(i.reason)}")
    n_rm = sum(i.action in ("removed", "would remove") for i in items)
    verb = "removed" if args.remove else "removable (run with --remove)"
    print(f"{len(items)} leftovers in {escape(args.dir)}: {n_rm} {verb}, {len(items) - n_rm - failed} kept, {failed} failed")
    return 1 if failed else 0


# name -> (module:function, help) for subcommands living in optional packages
_EXTERNAL = {
    "demo": ("hsnap_io.demo.run:main", "continue a tiny hybrid model in a fresh process (needs hsnap[sglang])"),
}


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
    if argv and argv[0] in _EXTERNAL:
        target, _ = _EXTERNAL[argv[0]]
        mod, func = target.split(":")
        try:
            module = importlib.import_module(mod)
        except ImportError as e:
            print(f"hsnap {argv[0]}: not available ({e}); install the matching extra", file=sys.stderr)
            return 2
        return getattr(module, func)(argv[1:])
    p = argparse.ArgumentParser(prog="hsnap", description="hsnap request snapshots")
    sub = p.add_subparsers(dest="cmd", required=True)
    for name, fn, help_ in (("info", cmd_info, "identity, geometry, sections, request summary"), ("verify", cmd_verify, "check every byte; exit 0 when intact")):
        sp = sub.add_parser(name, help=help_)
        sp.add_argument("path", help="a rank file or a snapshot directory")
        sp.add_argument("--json", action="store_true")
        sp.set_defaults(fn=fn)
    sp = sub.add_parser("diff", help="compare two snapshots section by section; exit 0 same, 1 differ, 2 error")
    sp.add_argument("a", help="snapshot A: a rank file or a snapshot directory")
    sp.add_argument("b", help="snapshot B")
    sp.add_argument("--json", action="store_true", help="the whole report as JSON")
    sp.add_argument("--atol", type=float, default=0.0, help="absolute tolerance (default 0: exact)")
    sp.add_argument("--rtol", type=float, default=0.0, help="relative tolerance, of max(|a|, |b|)")
    sp.add_argument("--names-only", action="store_true", help="print only the names of differing sections and fields")
    sp.add_argument("-v", "--verbose", action="store_true", help="list equal sections too")
    sp.set_defaults(fn=cmd_diff)
    sp = sub.add_parser("gc", help="list or remove leftover temporary files of interrupted writes (never a committed snapshot)")
    sp.add_argument("dir", help="a directory that snapshots are written into")
    sp.add_argument("--remove", action="store_true", help="remove what is listed as removable (default: only list)")
    sp.add_argument("--older-than", type=float, metavar="SECONDS", default=None,
                    help="removable when unmodified this long, even if its writer pid is running or unknown (other hosts, TP staging)")
    sp.add_argument("--json", action="store_true")
    sp.set_defaults(fn=cmd_gc)
    for name, (_, help_) in _EXTERNAL.items():
        sub.add_parser(name, help=help_, add_help=False)
    args = p.parse_args(argv)
    try:
        return args.fn(args)
    except HsnapError as e:
        print(f"hsnap {args.cmd}: {type(e).__name__}: {escape(str(e))}", file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())
