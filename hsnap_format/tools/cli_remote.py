"""``hsnap cp SRC DST`` (local file or directory <-> s3:// URL <-> URL) and ``hsnap gc URL``.

A copy reads the source once, in windows, hashing every section and checking the
padding while it writes; the destination becomes visible only after every digest
matched (a temporary file renamed, or a multipart upload completed — otherwise it
is aborted), and never replaces an existing snapshot. Exit codes as the rest of
``hsnap``: 0 done, 1 refused (a typed error, one line), 2 usage.
"""

from __future__ import annotations

import argparse
import json
import sys

from ..errors import HsnapError, MalformedHeaderError, Phrase
from ..manifest import SnapshotSet
from ..reader import Snapshot, stream
from ..spec import HEADER_OFFSET, TRAILER
from ..stores import open_snapshot, store_for
from .fit import Printer
from .viewmodel import escape

WINDOW = 32 << 20  # bytes read (and held) at a time


def copy_snapshot(snap: Snapshot, dst: str, options=None, committed: list | None = None) -> int:
    """Copy one rank file/object to ``dst``, verifying while copying. Returns the bytes
    copied; ``committed`` gets ``(dst, ETag)`` once an object is visible (what a set's
    abort may delete: only what this copy made)."""
    sink = store_for(dst, options).sink(dst)
    try:
        result: dict = {}
        head: dict = {}

        def each(offset: int, data) -> None:
            if offset == 0:  # the bytes copied must be the bytes checked at open
                head["header"] = bytes(data[HEADER_OFFSET : HEADER_OFFSET + snap.preamble.header_length])
            sink.write(offset, data)

        errors = [e for _, e in stream(snap, WINDOW, 0, snap.file_length, each=each, result=result) if e is not None]
        if result.get("padding") is not None:
            errors.append(result["padding"])
        if errors:
            raise errors[0]
        if head.get("header") != snap.header_bytes:
            raise MalformedHeaderError(snap.path, "header (changed since open)", Phrase("the header checked at open"), Phrase("other bytes"))
        tra = bytes(snap._read(snap.file_length - TRAILER.size, TRAILER.size))
        root = TRAILER.unpack(tra)[3]  # magic, file length, section count, root digest, ...
        if root != bytes.fromhex(snap.root_digest):
            raise MalformedHeaderError(snap.path, "trailer (changed since open)", snap.root_digest, root.hex())
        etag = sink.commit()
    except BaseException:
        sink.abort()
        raise
    if committed is not None:
        committed.append((dst, etag))
    return snap.file_length


def copy(src: str, dst: str, *, storage_options=None) -> int:
    """``hsnap cp``: a rank file or a set, local or ``s3://``, to a new local path or URL."""
    with open_snapshot(src, storage_options=storage_options) as snap:
        if not isinstance(snap, SnapshotSet):
            return copy_snapshot(snap, dst, storage_options)
        tp = snap.manifest.tp_size
        w = store_for(dst, storage_options).set_writer(dst)
        total = 0
        try:
            for r in range(tp):  # an object store's set writer lists what it committed (its abort deletes only those)
                total += copy_snapshot(snap.ranks[r], w.rank_path(r), storage_options, committed=getattr(w, "written", None))
            w.commit(tp_size=tp)
        except BaseException:
            w.abort()
            raise
        return total


def cp_main(argv) -> int:
    p = argparse.ArgumentParser(prog="hsnap cp", description="Copy a snapshot (rank file or set) between local paths and "
                                "s3:// URLs, verifying every digest while copying; the destination appears only when complete "
                                "and is never overwritten. Endpoint and credentials: AWS_ENDPOINT_URL, AWS_ACCESS_KEY_ID, "
                                "AWS_SECRET_ACCESS_KEY, AWS_PROFILE.")
    p.add_argument("src", help="a rank file, a snapshot directory, or s3://bucket/key (or prefix)")
    p.add_argument("dst", help="a new local path or s3:// URL")
    p.add_argument("--json", action="store_true")
    p.add_argument("--wide", action="store_true", help="print whole paths on one line (default: 80 columns)")
    args = p.parse_args(argv)
    try:
        n = copy(args.src, args.dst)
    except HsnapError as e:
        print(f"hsnap cp: {type(e).__name__}: {escape(str(e))}", file=sys.stderr)
        return 1
    if args.json:
        print(json.dumps({"ok": True, "src": args.src, "dst": args.dst, "bytes": n}))
    else:
        out = Printer(args.wide)
        out.line(f"copied {out.path(escape(args.src), 32)} -> {out.path(escape(args.dst), 32)}: {n} bytes, every digest verified")
    return 0


__all__ = ["copy", "copy_snapshot", "cp_main"]
