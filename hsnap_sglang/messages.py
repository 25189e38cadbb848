"""The messages between the HTTP process (TokenizerManager) and the scheduler: SGLang IPC structs (msgspec, plain
values only: no tensor, no callable), registered with SGLang's decoder by :func:`register`.

Every request carries an ``op_id`` that its answer (:class:`HsnapReqOutput`) repeats, so several hsnap calls can be
in flight at once (an export waiting for a request's first decode boundary does not hold up a stats call).
"""

from __future__ import annotations

from typing import Any, Dict, List, Optional

import msgspec
from sglang.srt.managers.io_struct import BaseReq, hook_custom_types


class HsnapExportReqInput(BaseReq, kw_only=True):
    """Export ``rid`` (BaseReq.rid) to ``path`` at its next committed decode boundary."""

    op_id: str
    path: str
    keep_running: bool = False


class HsnapResumeReqInput(BaseReq, kw_only=True):
    """Resume the snapshot at ``path`` as a decoding request; ``rid`` is the rid the HTTP process read from it (the
    scheduler refuses a file that holds another)."""

    op_id: str
    path: str


class HsnapDrainReqInput(BaseReq, kw_only=True):
    """Export every request of the server into ``dir`` (one snapshot per request); ``dedup``: their full pages of
    ``page_size`` positions stored once, in the page store ``dir/pages`` (format 1.3)."""

    op_id: str
    dir: str
    dedup: bool = False
    page_size: int = 0


class HsnapCheckpointReqInput(BaseReq, kw_only=True):
    """Checkpoint ``rid`` into ``dir`` now and then every ``every`` output tokens (0: stop checkpointing it)."""

    op_id: str
    dir: str
    every: int


class HsnapStatsReqInput(BaseReq, kw_only=True):
    """Forward counts of ``rid`` (all known rids when None) and the plug-in's state."""

    op_id: str


class HsnapReqOutput(BaseReq, kw_only=True):
    """The answer to one of the requests above: ``result`` when ``ok``, else ``error`` (:func:`error_dict`)."""

    op_id: str
    ok: bool
    result: Dict[str, Any] = msgspec.field(default_factory=dict)
    error: Optional[Dict[str, Any]] = None
    # drain: one entry per request (export result or error)
    items: List[Dict[str, Any]] = msgspec.field(default_factory=list)


TYPES = (HsnapExportReqInput, HsnapResumeReqInput, HsnapDrainReqInput, HsnapCheckpointReqInput, HsnapStatsReqInput, HsnapReqOutput)

_registered = False


def register() -> None:
    """Teach SGLang's msgpack IPC decoder these types (once per process)."""
    global _registered
    if not _registered:
        hook_custom_types(*TYPES)
        _registered = True
