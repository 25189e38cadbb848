"""``hsnap`` command line: info, verify (and, when their packages are installed,
diff, demo, gc). Subcommands that need torch or SGLang are imported only when run,
so ``hsnap info`` stays a numpy + xxhash program."""

from __future__ import annotations

import argparse
import importlib
import json
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


# name -> (module:function, help) for subcommands living in optional packages
_EXTERNAL = {
    "diff": ("hsnap_view.diff:main", "compare two snapshots section by section"),
    "demo": ("hsnap_io.demo.run:main", "continue a tiny hybrid model in a fresh process (needs hsnap[sglang])"),
    "gc": ("hsnap_io.gc:main", "list or remove leftover temporary files of interrupted writes"),
}


def main(argv: list[str] | None = None) -> int:
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
