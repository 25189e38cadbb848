"""One storage seam: where snapshot bytes live — a local file system or an
S3-compatible object store (``s3://bucket/key``) — behind one small interface.

No caller tells a URL from a path by itself: :func:`store_for` answers with the store
that holds a path, and the call site asks the store for what it needs. A store has

* primitives, what a snapshot chain, a content-addressed page store and gc build on:
  ``split``/``join`` (names beside a name), ``exists``, ``read_bytes`` (a small object
  whole, with its version), ``put_bytes`` (commit without overwriting: a taken name is
  :class:`SnapshotExistsError`), ``list`` (one level of a directory or prefix: name,
  size, version, modification time), ``subdirs`` (its directories or sub-prefixes),
  ``makedirs`` (a directory before its first file; nothing on an object store) and
  ``remove`` (only the version named: anything changed since it was read is kept and
  refused);
* snapshot operations: ``open`` (a rank file or a set), ``writer`` (a rank file whose
  commit never overwrites), ``set_writer``, ``sink`` (a sequential copy target for
  ``hsnap cp``) and ``collect`` (``hsnap gc``);
* one capability, ``local``: paths are operating-system paths (inodes, fsync and
  writeback, descriptors a re-sharding restore reads).

A *version* is an opaque change-detection token: an object's ETag, a local file's
``device:inode:mtime_ns:size``. Shard and plan arithmetic stays pure in
``hsnap_format`` (layout, records, chain); nothing here knows the format beyond what a
committed snapshot and an unfinished write look like (spec 8, 8.1).

The object-store side (:mod:`hsnap_format.stores.s3`, botocore) is imported only when a
URL is used.

The format classes never import a store: a store hands them a byte source or sink for a
path (:mod:`hsnap_format.source`, which also says what a store is); :mod:`.derived` writes
the snapshot operations once on its primitives; :mod:`.local`, :mod:`.s3` and
:mod:`.memory` (``memory://``, for unit tests) are the stores; :func:`store_for` picks one
by URL scheme and is the resolver the format modules reach through ``source.store_at``.
"""

from __future__ import annotations

import os
from typing import Callable

from ..source import Store, set_store_resolver
from .local import LOCAL
from .memory import MemoryStore
from .s3 import S3Store

URL_MARK = "://"


def is_url(path) -> bool:
    """A path that names an object (``s3://bucket/key``) rather than a file."""
    return isinstance(path, str) and URL_MARK in path


# scheme -> the store for its URLs (options reach it); a path without a scheme is local
SCHEMES: dict[str, Callable[..., Store]] = {"s3": S3Store, "memory": MemoryStore}


def store_for(path, storage_options=None) -> Store:
    """The store that holds ``path``: an object store for a URL, else the local file system.
    Cheap (no client, no request); ``storage_options`` only reach an object store."""
    p = os.fspath(path) if isinstance(path, os.PathLike) else path
    if is_url(p):
        return SCHEMES.get(p.partition(URL_MARK)[0], S3Store)(storage_options)
    return LOCAL


set_store_resolver(store_for)


def open_snapshot(path, *, storage_options=None, **kw):
    """Open a rank file or a snapshot directory, or their object-store URL: through the store that holds it."""
    return store_for(path, storage_options).open(os.fspath(path), **kw)


__all__ = ["SCHEMES", "LOCAL", "store_for", "open_snapshot", "is_url"]
