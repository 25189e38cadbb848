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
    detokenizer: Optional[List[int]] = None  # [surr, read]: the detokenization window (hsnap_sglang.detokenize)
    ahead: Optional[str] = None  # the op_id of a HsnapProveAheadReqInput of the same path: its proof, if held, is this resume's


class HsnapProveAheadReqInput(BaseReq, kw_only=True):
    """Start proving the snapshot at ``path`` now (opened, checked, every byte read and hashed: no pool touched), for
    the resume the HTTP process is about to send once it has read the record, claimed the snapshot and registered the
    client (``HsnapResumeReqInput.ahead`` = this ``op_id``): the proof runs meanwhile.  Not answered.  ``drop``: the
    resume will not come (refused before it was sent); a proof no resume takes is given back after
    ``hsnap_sglang.jobs.PROVED_AHEAD_TTL_S``."""

    op_id: str
    path: str
    drop: bool = False


class HsnapDrainReqInput(BaseReq, kw_only=True):
    """Export every request of the server into ``dir`` (one snapshot per request); ``dedup``: their full pages of
    ``page_size`` positions stored once, in the page store ``dir/pages`` (format 1.3)."""

    op_id: str
    dir: str
    dedup: bool = False
    page_size: int = 0
    why: str = ""  # "sigterm": the shutdown's own drain, logged by the scheduler when done (the HTTP process may be gone)


class HsnapCheckpointReqInput(BaseReq, kw_only=True):
    """Checkpoint ``rid`` into ``dir`` now and then every ``every`` output tokens (0: stop checkpointing it)."""

    op_id: str
    dir: str
    every: int


class HsnapMigrateReqInput(BaseReq, kw_only=True):
    """Migrate ``rid`` out through ``dir`` (a directory or ``s3://`` prefix a target follows): pre-copy rounds while
    it decodes; once the target applied a round and at most ``tail`` rows are left (or after ``max_rounds`` rounds),
    stop it and write the final link; a round not applied within ``timeout_s`` gives the migration up; ``fsync``:
    make each link durable (a migration on one host does not need it: the target reads the link at once)."""

    op_id: str
    dir: str
    tail: int = 16
    max_rounds: int = 8
    timeout_s: float = 60.0
    fsync: bool = False


class HsnapFollowReqInput(BaseReq, kw_only=True):
    """Follow the migration in ``dir``: apply each link as it is committed (``rid``, when given, is the request the
    caller expects); answered once the final link is applied and the request held for admission."""

    op_id: str
    dir: str
    timeout_s: float = 60.0


class HsnapAdmitReqInput(BaseReq, kw_only=True):
    """Run the request a follow brought in (the HTTP process registered its client's state), or give it back."""

    op_id: str
    admit: bool = True
    detokenizer: Optional[List[int]] = None  # [surr, read]: the detokenization window (hsnap_sglang.detokenize)


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


TYPES = (HsnapExportReqInput, HsnapResumeReqInput, HsnapProveAheadReqInput, HsnapDrainReqInput, HsnapCheckpointReqInput, HsnapMigrateReqInput, HsnapFollowReqInput,
         HsnapAdmitReqInput, HsnapStatsReqInput, HsnapReqOutput)

_registered = False


def register() -> None:
    """Teach SGLang's msgpack IPC decoder these types (once per process)."""
    global _registered
    if not _registered:
        hook_custom_types(*TYPES)
        _registered = True
