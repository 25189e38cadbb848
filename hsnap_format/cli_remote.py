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
import os
import sys

from . import _fs
from .errors import HsnapError, HsnapIOError, MalformedHeaderError, Phrase, SnapshotExistsError
from .manifest import SetWriter, SnapshotSet, open_snapshot
from .reader import Snapshot
from .spec import HEADER_OFFSET, TRAILER
from .viewmodel import escape

WINDOW = 32 << 20  # bytes read (and held) at a time


class LocalSink:
    """A snapshot file written sequentially: a temporary file marked unfinished (what
    ``hsnap gc`` proves) whose first 64 bytes are written last, then renamed."""

    def __init__(self, path: str) -> None:
        self.path = path
        _fs.check_final_name(path)
        if os.path.lexists(path):
            raise SnapshotExistsError(path, "path", "no file or directory", Phrase("one exists"))
        try:
            self.tmp, self.fd = _fs.create_temp_file(path, 0o600)
        except OSError as e:
            raise HsnapIOError(path, "create", e) from None
        self.first = b""

    def write(self, offset: int, data) -> None:
        data = bytes(data)
        if offset < HEADER_OFFSET:  # the real preamble replaces the pending mark at commit
            self.first = data[: HEADER_OFFSET - offset]
            data, offset = data[HEADER_OFFSET - offset :], HEADER_OFFSET
        try:
            _fs.pwrite_all(self.fd, data, offset)
        except OSError as e:
            raise HsnapIOError(self.path, "write", e) from None

    def commit(self) -> None:
        try:
            os.fsync(self.fd)
            _fs.pwrite_all(self.fd, self.first, 0)
            os.fdatasync(self.fd)
            os.close(self.fd)
            self.fd = -1
            _fs.check_final_path(self.path)  # again: a directory above may have become a staging directory (spec 8.1)
            _fs.rename_noreplace(self.tmp, self.path)
            _fs.fsync_dir(os.path.dirname(os.path.abspath(self.path)))
        except OSError as e:
            raise HsnapIOError(self.path, "commit", e) from None

    def abort(self) -> None:
        if self.fd >= 0:
            os.close(self.fd)
            self.fd = -1
        try:
            os.unlink(self.tmp)
        except OSError:
            pass


class UrlSink:
    """A multipart upload fed sequentially; completion is the commit."""

    def __init__(self, url: str, options) -> None:
        from . import remote

        self.url, self.options = url, options
        remote.check_final_key(url, options)
        if remote._exists(url, options):
            raise SnapshotExistsError(url, "key", "no object", Phrase("one exists"))
        self.upload = remote.MultipartUpload(url, options)
        self.buf = bytearray()
        self.part = 1

    def write(self, offset: int, data) -> None:
        self.buf += data
        p = self.options.part_bytes
        while len(self.buf) >= 2 * p:  # keep >= one part back: every part but the last is >= 5 MiB
            self.upload.submit(self.part, bytes(self.buf[:p]))
            del self.buf[:p]
            self.part += 1

    def commit(self) -> str:
        """Complete the upload; the ETag of the object made visible."""
        if self.buf or self.part == 1:
            self.upload.submit(self.part, bytes(self.buf))
        self.buf = bytearray()
        return self.upload.complete()

    def abort(self) -> None:
        self.upload.abort()


def _sink(dst: str, options):
    from . import remote

    return UrlSink(dst, options) if remote.is_url(dst) else LocalSink(dst)


def copy_snapshot(snap: Snapshot, dst: str, options=None, committed: list | None = None) -> int:
    """Copy one rank file/object to ``dst``, verifying while copying. Returns the bytes
    copied; ``committed`` gets ``(dst, ETag)`` once an object is visible (what a set's
    abort may delete: only what this copy made)."""
    from . import remote

    sink = _sink(dst, remote.StorageOptions.of(options))
    try:
        result: dict = {}
        head: dict = {}

        def each(offset: int, data) -> None:
            if offset == 0:  # the bytes copied must be the bytes checked at open
                head["header"] = bytes(data[HEADER_OFFSET : HEADER_OFFSET + snap.preamble.header_length])
            sink.write(offset, data)

        errors = [e for _, e in remote.stream(snap, WINDOW, 0, snap.file_length, each=each, result=result) if e is not None]
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
    from . import remote

    kw = {"storage_options": storage_options} if remote.is_url(src) else {}
    with open_snapshot(src, **kw) as snap:
        if not isinstance(snap, SnapshotSet):
            return copy_snapshot(snap, dst, storage_options)
        tp = snap.manifest.tp_size
        if remote.is_url(dst):
            w = remote.RemoteSetWriter(dst, storage_options=storage_options)
        else:
            w = SetWriter(dst)
        total = 0
        try:
            for r in range(tp):
                total += copy_snapshot(snap.ranks[r], w.rank_path(r), storage_options,
                                       committed=w.written if remote.is_url(dst) else None)
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
    args = p.parse_args(argv)
    try:
        n = copy(args.src, args.dst)
    except HsnapError as e:
        print(f"hsnap cp: {type(e).__name__}: {escape(str(e))}", file=sys.stderr)
        return 1
    if args.json:
        print(json.dumps({"ok": True, "src": args.src, "dst": args.dst, "bytes": n}))
    else:
        print(f"copied {escape(args.src)} -> {escape(args.dst)}: {n} bytes, every digest verified")
    return 0


def gc_url(args) -> int:
    """``hsnap gc s3://bucket/prefix``: stale multipart uploads, unfinished writes, each
    object proved one by one (remote.collect_url) and announced with its size before it
    goes, as local gc does."""
    from . import remote

    out = sys.stderr if args.json else sys.stdout  # --json: stdout is the document alone

    def announce(path: str, nbytes: int) -> None:
        print(f"removing {escape(path)}  {nbytes} bytes", file=out, flush=True)

    try:
        items = remote.collect_url(args.dir, remove=args.remove, older_than=args.older_than, announce=announce)
    except HsnapError as e:
        print(f"hsnap gc: {type(e).__name__}: {escape(str(e))}", file=sys.stderr)
        return 2
    from .cli import print_gc_report

    return print_gc_report(args, items)


__all__ = ["copy", "copy_snapshot", "cp_main", "gc_url", "LocalSink", "UrlSink"]
