"""``hsnap gc URL``: leftovers of interrupted writes under a bucket or prefix (in-progress
uploads, unfinished objects, an unfinished set's marker), each proved before it is removed
(spec 8.1 on an object store)."""

from __future__ import annotations

import time
from typing import Any

from ...errors import HsnapError
from ..gc import FILE as GC_FILE, Leftover, parse_name
from ...spec import (
    MAGIC,
    MANIFEST_NAME,
    PENDING_MAGIC,
    PENDING_MARKER,
    PENDING_MARKER_TEXT,
    RANK_FILE_RE,
)
from .client import ObjectChangedError, RemoteNotFoundError, call, client, delete, error_code, list_all, object_url, translate
from .options import StorageOptions, parse_url

DEFAULT_URL_GC_AGE = 900.0  # a write younger than this may be running (on another host: no pid to check)


UPLOAD, FILE, MARKER, OBJECT = "upload", "file", "marker", "object"  # what a URL gc lists, by kind


def collect_url(url: str, *, remove: bool = False, older_than: float | None = None, storage_options=None,
                announce=None) -> list[Leftover]:
    """Leftovers of interrupted writes under ``url`` (a bucket, or a prefix taken as a
    directory), each proved one by one — a committed object is never removed, whatever
    its key (spec 8.1, on an object store):

    * ``upload``: an in-progress multipart upload — never visible, so provably no
      committed object; its size is the sum of its parts. Removable (aborted);
    * ``file``: an object whose key has a temporary's name, or a ``rank-N.hsnap`` of an
      unfinished set, proved unfinished by its bytes (empty, or ``PENDING_MAGIC`` at
      byte 0). Removable. A complete object (the hsnap magic) is listed and kept;
    * ``marker``: an unfinished set's ``.hsnap-pending`` (hsnap's text, no
      ``manifest.json`` beside it). Removable once nothing of the set is left beside it
      but what this run removes: while a complete rank object stays, so does the marker
      (that proof of the set would otherwise be lost); a marker beside a manifest (the
      set committed, its clean-up failed) is removable too;
    * ``object``: anything else beside a marker or beside rank objects without a
      manifest: listed with the reason it stays.

    Removable means also older than ``older_than`` seconds (default
    ``DEFAULT_URL_GC_AGE``): a running export on another host records no pid. With
    ``remove``, ``announce(path, bytes)`` is called right before each removal (as local
    gc's: the CLI prints each with its size); an object is deleted with ``If-Match`` its ETag at the
    proof, so one replaced since is refused by the store, not deleted; markers go last.
    """
    options = StorageOptions.of(storage_options)
    bucket, prefix = parse_url(url)
    if prefix and not prefix.endswith("/"):
        prefix += "/"  # a directory: s3://b/run never reaches s3://b/run2/
    c = client(options, url)
    age_limit = DEFAULT_URL_GC_AGE if older_than is None else older_than
    now = time.time()
    uploads = _upload_items(bucket, prefix, c, options, age_limit, now)
    objects = _object_items(bucket, prefix, c, options, age_limit, now, uploads)
    items = sorted(uploads + objects, key=lambda i: (i.path, i.kind))
    for m in items:  # a marker stays while anything of its set does (it is their proof)
        if m.kind == MARKER and m.removable and _keeps_marker(m, items, lambda i: not i.removable):
            m.removable = False
    removing = [i for i in items if i.removable]
    for item in sorted(removing, key=lambda i: i.kind == MARKER):  # markers last: the proof of what is left
        if not remove:
            item.action = "would remove"
            continue
        if item.kind == MARKER and not _marker_still_alone(item, items, bucket, c, options):
            continue
        if announce is not None:
            announce(item.path, item.bytes)
        _remove_item(item, bucket, c, options)
    return items


def _upload_items(bucket, prefix, c, options, age_limit, now) -> list[Leftover]:
    out: list[Leftover] = []
    kw: dict[str, Any] = {"Bucket": bucket, "Prefix": prefix}
    while True:
        r = call(object_url(bucket, prefix), "list multipart uploads", options, c.list_multipart_uploads, **kw)
        for u in r.get("Uploads", []) or []:
            size = _upload_size(bucket, u["Key"], u["UploadId"], c, options)
            if size is None:
                continue  # completed or aborted since the listing
            age = max(0.0, now - u["Initiated"].timestamp())
            item = Leftover(path=object_url(bucket, u["Key"]) + f"?uploadId={u['UploadId']}", kind=UPLOAD, final=object_url(bucket, u["Key"]),
                            age_s=age, bytes=size, removable=age >= age_limit,
                            reason="in-progress multipart upload (never visible: not a committed object)"
                            + ("" if age >= age_limit else f"; younger than {age_limit:g} s: may be running"))
            item.pinned = (u["Key"], u["UploadId"])
            out.append(item)
        if not r.get("IsTruncated"):
            return out
        kw.update(KeyMarker=r.get("NextKeyMarker"), UploadIdMarker=r.get("NextUploadIdMarker"))


def _upload_size(bucket, key, upload_id, c, options) -> int | None:
    """The bytes an in-progress upload holds (the sum of its parts), None when it is gone."""
    total, kw = 0, {"Bucket": bucket, "Key": key, "UploadId": upload_id}
    while True:
        try:
            r = call(object_url(bucket, key), "list parts", options, c.list_parts, **kw)
        except RemoteNotFoundError:
            return None
        total += sum(int(p.get("Size") or 0) for p in r.get("Parts", []) or [])
        if not r.get("IsTruncated"):
            return total
        kw["PartNumberMarker"] = r.get("NextPartNumberMarker")


def _head(bucket: str, key: str, c, options, n: int) -> tuple[bytes | None, str | None]:
    """The first ``n`` bytes of an object and the ETag of the version read; (None, None)
    when it went away or changed while examined."""
    url = object_url(bucket, key)
    try:
        r = c.get_object(Bucket=bucket, Key=key, Range=f"bytes=0-{n - 1}")
        return r["Body"].read(n + 1), r.get("ETag")
    except Exception as e:  # noqa: BLE001
        err = translate(e, url, "read", options)
        if isinstance(err, RemoteNotFoundError) and "bucket" not in (err.os_error.strerror or ""):
            return None, None
        if error_code(e) != "InvalidRange":
            raise err from None
    try:  # no byte 0: empty, then its ETag from a HEAD (an object that grew since is not proved)
        r = c.head_object(Bucket=bucket, Key=key)
    except Exception as e:  # noqa: BLE001
        err = translate(e, url, "head", options)
        if isinstance(err, RemoteNotFoundError):
            return None, None
        raise err from None
    return (b"", r.get("ETag")) if r.get("ContentLength") == 0 else (None, None)


def _object_items(bucket, prefix, c, options, age_limit, now, uploads) -> list[Leftover]:
    by_dir: dict[str, dict[str, dict]] = {}
    for o in list_all(bucket, prefix, c, options):
        d, _, name = o["Key"].rpartition("/")
        by_dir.setdefault(d, {})[name] = o
    uploads_in: dict[str, list[Leftover]] = {}
    for u in uploads:
        uploads_in.setdefault(u.pinned[0].rpartition("/")[0], []).append(u)
    out: list[Leftover] = []
    for d, names in sorted(by_dir.items()):
        marker = names.get(PENDING_MARKER)
        committed = MANIFEST_NAME in names
        ranks = sorted(n for n in names if RANK_FILE_RE.match(n))
        unfinished = marker is not None and not committed  # a set's prefix before its manifest
        orphans = not committed and marker is None and bool(ranks)
        for name, o in sorted(names.items()):
            key = o["Key"]
            parsed = parse_name(name)
            temp = parsed is not None and parsed[0] == GC_FILE
            if not (temp or unfinished or orphans or name == PENDING_MARKER):
                continue  # an object where no write was interrupted: not a leftover
            item = Leftover(path=object_url(bucket, key), kind=OBJECT, final=object_url(bucket, key), bytes=int(o.get("Size") or 0),
                            age_s=max(0.0, now - o["LastModified"].timestamp()))
            if parsed is not None and temp:
                item.final = object_url(bucket, f"{d}/{parsed[1]}" if d else parsed[1])
            if name == PENDING_MARKER:
                item.kind = MARKER
                _prove_marker(item, bucket, key, c, options, age_limit, committed, ranks, names, uploads_in.get(d, []), now)
            elif temp or (unfinished and RANK_FILE_RE.match(name)):
                item.kind = FILE
                _prove_file(item, bucket, key, c, options, age_limit, "an unfinished set's rank object" if not temp else "a temporary's name")
            elif orphans and RANK_FILE_RE.match(name):
                item.reason = "rank object with neither manifest.json nor the pending marker beside it: not proved unfinished, kept"
            else:
                head, _ = _head(bucket, key, c, options, len(MAGIC))
                what = "a complete snapshot (hsnap magic at byte 0)" if head == MAGIC else "not an hsnap snapshot"
                where = "an unfinished set (pending marker, no manifest.json)" if unfinished else "rank objects without manifest.json"
                item.reason = f"{what} beside {where}, not one of its entries: never removed"
            out.append(item)
    return out


def _prove_file(item: Leftover, bucket, key, c, options, age_limit, why) -> None:
    head, etag = _head(bucket, key, c, options, len(PENDING_MAGIC))
    if head is None:
        item.reason = f"{why}, but it went away or changed while examined: not proved, kept"
    elif etag and head in (b"", PENDING_MAGIC):  # the ETag: what the delete is conditional on
        item.removable = item.age_s >= age_limit
        item.reason = f"{why}, {'empty' if not head else 'PENDING_MAGIC at byte 0'}: an unfinished write" + (
            "" if item.removable else f"; younger than {age_limit:g} s: may be running")
        item.pinned = etag
    elif head == MAGIC:
        item.reason = f"{why}, but complete (hsnap magic at byte 0): not proved unfinished, kept; delete it by hand if it is abandoned"
    else:
        item.reason = f"{why}, but no unfinished-write mark at byte 0: not proved unfinished, kept"


def _prove_marker(item: Leftover, bucket, key, c, options, age_limit, committed, ranks, names, uploads, now) -> None:
    head, etag = _head(bucket, key, c, options, len(PENDING_MARKER_TEXT) + 1)
    if head != PENDING_MARKER_TEXT or not etag:
        item.reason = "named like the pending marker, but its content is not hsnap's (or it changed while examined): kept"
        return
    item.pinned = etag
    if committed:
        item.removable = item.age_s >= age_limit
        item.reason = "pending marker beside manifest.json: its set committed, the marker's removal failed"
    else:
        newest = max([o["LastModified"].timestamp() for n, o in names.items() if n == PENDING_MARKER or n in ranks]
                     + [now - u.age_s for u in uploads])
        item.age_s = max(0.0, now - newest)  # the set's newest write, not the marker's alone
        item.removable = item.age_s >= age_limit
        item.reason = "pending marker of an unfinished set (no manifest.json)"
    if not item.removable:
        item.reason += f"; the set was written to less than {age_limit:g} s ago: may be running"
    item.set_entries = (ranks, uploads)


def _keeps_marker(marker: Leftover, items: list[Leftover], stays) -> bool:
    """True (and the reason noted) when an entry of the marker's set — an upload in its
    prefix, a rank object beside it — ``stays``."""
    ranks, uploads = marker.set_entries
    d = marker.path.rpartition("/")[0]
    staying = [i for i in items if stays(i) and (any(i is u for u in uploads)
                                                 or (i.kind == FILE and i.path.rpartition("/") in ((d, "/", r) for r in ranks)))]
    if staying:
        n = len(staying)
        marker.reason += f"; kept while {n} entr{'y' if n == 1 else 'ies'} of the set stay{'s' if n == 1 else ''} (the marker is their proof)"
    return bool(staying)


def _marker_still_alone(item: Leftover, items: list[Leftover], bucket, c, options) -> bool:
    """Right before removing a marker: nothing of its set stayed behind (a removal that
    failed), and a new listing shows no rank object the scan did not see (a writer at
    work). A manifest that appeared meanwhile only makes the marker stale."""
    if _keeps_marker(item, items, lambda i: i.action not in ("removed", "gone")):
        item.action = "kept"
        return False
    ranks, _ = item.set_entries
    d = parse_url(item.path)[1].rpartition("/")[0]
    listed = (o["Key"].rpartition("/")[2] for o in list_all(bucket, f"{d}/" if d else "", c, options, Delimiter="/"))
    appeared = sorted(n for n in listed if RANK_FILE_RE.match(n) and n not in ranks)
    if appeared:
        item.action, item.reason = "kept", item.reason + f"; {', '.join(appeared)} appeared since the scan (a writer at work): kept"
        return False
    return True


def _remove_item(item: Leftover, bucket, c, options) -> None:
    try:
        if item.kind == UPLOAD:
            key, upload_id = item.pinned
            call(item.path, "abort multipart upload", options, c.abort_multipart_upload, Bucket=bucket, Key=key, UploadId=upload_id)
        else:  # only the version proved: a store that honours If-Match refuses a replaced object
            delete(item.path, options, etag=item.pinned)
        item.action = "removed"
    except RemoteNotFoundError:
        item.action, item.reason = "gone", item.reason + "; completed, aborted or removed meanwhile"
    except ObjectChangedError:
        item.action, item.reason = "failed", item.reason + "; replaced since it was proved (ETag): kept"
    except HsnapError as e:
        item.action, item.reason = "failed", item.reason + f"; {type(e).__name__}: {e}"


__all__ = ["DEFAULT_URL_GC_AGE", "collect_url"]
