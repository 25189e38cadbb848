"""hsnap inside a running SGLang server: pause one live request over HTTP, export it, resume it elsewhere.

An SGLang general plug-in (entry point group ``sglang.srt.plugins``, name ``hsnap``), **off unless the operator
turns it on** with ``HSNAP_SGLANG_PLUGIN=1`` in the server's environment (``python -m hsnap_sglang.serve
--enable-hsnap`` sets it).  Off, :func:`sglang_plugin` returns before importing anything: no hook is registered,
no message type is added, no route exists.  On, it registers, through SGLang's own ``HookRegistry``:

=================================================================  =====  ==============================================
target                                                             type   what
=================================================================  =====  ==============================================
``Scheduler.init_request_dispatcher``                              AFTER  adds the hsnap request types to the scheduler's
                                                                          ``TypeBasedDispatcher`` (``+=``)
``Scheduler.ingest_requests``                                      AFTER  runs the exports waiting for a committed
                                                                          decode boundary (:mod:`.scheduler`)
``Scheduler.process_batch_result``                                 AROUND counts, per request, the forwards that
                                                                          completed (decode / extend)
``TokenizerManager.init_request_dispatcher``                       AFTER  routes the scheduler's hsnap answers to their
                                                                          waiting HTTP calls (:mod:`.frontend`)
``TokenizerManager.create_abort_task``                             AROUND a stream's delayed abort (2 s after it ends) spares
                                                                          a request resumed here since (same rid)
``TokenizerManager.generate_request``                              AROUND a request's stream may go on with a relayed
                                                                          migration's target's (:mod:`.relay`)
``TokenizerManager._handle_batch_output``                          AROUND drops, from a resumed request's first output, the
                                                                          characters its client already had (:mod:`.detokenize`)
``DetokenizerManager._decode_batch_token_id_output``               AROUND an exported request's last message is decoded as a
                                                                          streaming step: no U+FFFD flush (:mod:`.detokenize`)
``http_server.launch_server``                                      BEFORE adds the ``/hsnap/*`` routes to SGLang's
                                                                          FastAPI app
``http_server._wait_and_warmup``                                   AFTER  with ``HSNAP_RESUME_ON_START``: resumes every snapshot
                                                                          there once the server is ready (:mod:`.restart`)
``Scheduler.maybe_sleep_on_idle``                                  AROUND an idle scheduler following a migration polls
                                                                          its sockets for 1 ms, not 1 s (links come by store)
``SchedulerPoolStatsObserver._session_kv_rows``                    AROUND adds the slots of a request migrating in (held
                                                                          outside any batch) to SGLang's pool accounting
``SignalHandler.sigterm_handler``                                   AFTER  with ``HSNAP_DRAIN_ON_SIGTERM``: drains every request
                                                                          there before SGLang's graceful shutdown
``ScheduleBatch.release_req``                                      AROUND with ``HSNAP_RETRACT_DIR``: a retracted (or preempted)
                                                                          request is copied to host memory before SGLang
                                                                          frees its slots (:mod:`.retraction`)
``Scheduler._add_request_to_queue``                                AROUND ... and held by hsnap while its file is written
                                                                          and until it fits again, not queued for a prefill
``Scheduler.abort_request``                                        AROUND ... an abort of a held request reaches SGLang's own
=================================================================  =====  ==============================================

and registers its message types (:mod:`.messages`, msgspec structs of plain values) with SGLang's IPC decoder
(``io_struct.hook_custom_types``).  The hooks are thin: each imports its module only when SGLang calls it.
"""

from __future__ import annotations

import importlib
import os

__all__ = ["ENV_VAR", "HOOKS", "enabled", "sglang_plugin"]

ENV_VAR = "HSNAP_SGLANG_PLUGIN"

_SCHED = "sglang.srt.managers.scheduler.Scheduler"
_TM = "sglang.srt.managers.tokenizer_manager.TokenizerManager"

# target -> (hook: "module:function" in hsnap_sglang, HookType name)
HOOKS: dict[str, tuple[str, str]] = {
    f"{_SCHED}.init_request_dispatcher": ("scheduler:install", "AFTER"),
    f"{_SCHED}.ingest_requests": ("scheduler:after_ingest", "AFTER"),
    f"{_SCHED}.process_batch_result": ("scheduler:around_process_batch_result", "AROUND"),
    f"{_TM}.init_request_dispatcher": ("frontend:install", "AFTER"),
    f"{_TM}.create_abort_task": ("frontend:around_create_abort_task", "AROUND"),
    f"{_TM}.generate_request": ("relay:around_generate_request", "AROUND"),
    f"{_TM}._handle_batch_output": ("detokenize:around_handle_batch_output", "AROUND"),
    "sglang.srt.managers.detokenizer_manager.DetokenizerManager._decode_batch_token_id_output":
        ("detokenize:around_decode_batch_token_id_output", "AROUND"),
    "sglang.srt.entrypoints.http_server.launch_server": ("frontend:before_launch_server", "BEFORE"),
    "sglang.srt.managers.tokenizer_manager.SignalHandler.sigterm_handler": ("frontend:after_sigterm", "AFTER"),
    "sglang.srt.entrypoints.http_server._wait_and_warmup": ("restart:after_wait_and_warmup", "AFTER"),
    f"{_SCHED}.maybe_sleep_on_idle": ("scheduler:around_maybe_sleep_on_idle", "AROUND"),
    "sglang.srt.managers.schedule_batch.ScheduleBatch.release_req": ("scheduler:around_release_req", "AROUND"),
    f"{_SCHED}._add_request_to_queue": ("scheduler:around_add_request_to_queue", "AROUND"),
    f"{_SCHED}.abort_request": ("scheduler:around_abort_request", "AROUND"),
    "sglang.srt.managers.scheduler_components.pool_stats_observer.SchedulerPoolStatsObserver._session_kv_rows":
        ("scheduler:around_session_kv_rows", "AROUND"),
}


def enabled() -> bool:
    """Whether the operator turned the plug-in on (``HSNAP_SGLANG_PLUGIN=1``)."""
    return os.environ.get(ENV_VAR) == "1"


def _lazy(spec: str):
    """The hook SGLang calls: imports ``hsnap_sglang.<module>`` on first call (the scheduler module is never
    imported by the HTTP process, nor the frontend by a scheduler)."""
    module, func = spec.split(":")

    def hook(*args, **kwargs):
        return getattr(importlib.import_module(f"hsnap_sglang.{module}"), func)(*args, **kwargs)

    hook.__qualname__ = hook.__name__ = f"hsnap_sglang.{module}.{func}"
    return hook


def sglang_plugin() -> None:
    """``sglang.srt.plugins`` entry point, run by SGLang's ``load_plugins()`` in every server process."""
    if not enabled():
        return
    from sglang.srt.plugins.hook_registry import HookRegistry, HookType

    from . import messages

    messages.register()
    for target, (spec, kind) in HOOKS.items():
        HookRegistry.register(target, _lazy(spec), HookType[kind])
