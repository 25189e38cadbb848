"""hsnap's operations in SGLang's own ``/metrics`` (Prometheus), when the server runs with ``--enable-metrics``.

SGLang then serves ``/metrics`` from a ``MultiProcessCollector`` over ``$PROMETHEUS_MULTIPROC_DIR``, which it sets
before it starts its processes: a metric any of them creates after that is written there and served with SGLang's
own.  hsnap's are created on first use in the process that observes them (the HTTP process for what the routes
answer, the scheduler for checkpoint links); without that directory nothing is created and every call is a no-op.
prometheus_client is imported only then (SGLang's requirement: after the directory is set).

Names and what they count (every ``op`` is a route: export, drain, checkpoint, resume, migrate, follow):

=========================================  ====================================================================
``hsnap_operations_total{op,outcome}``     answers; ``outcome`` ``ok`` or the refusal's error type
``hsnap_bytes_written_total{op}``          snapshot bytes written (exports, drain members, first checkpoint links)
``hsnap_bytes_read_total{op}``             snapshot bytes read into the pools (resumes, follows)
``hsnap_pause_to_durable_seconds{op}``     an export asked for → its snapshot durable (the request's pause)
``hsnap_restore_seconds``                  a resume's restore into the pools
``hsnap_resume_to_first_token_seconds``    a resume asked for → the first event of its stream
``hsnap_migration_stop_seconds``           a migration's source: request stopped → final link durable
``hsnap_checkpoint_link_lag_seconds``      a checkpoint link: due → committed (written off the decode path)
``hsnap_relays_total{outcome}``            relayed migrations (:mod:`.relay`) by how they ended: ``finished`` (the
                                           target's stream relayed to the request's finish), ``broken`` (the
                                           target's stream broke first), ``client gone``, ``refused`` (the target
                                           did not follow), ``dropped`` (the migration did not happen)
``hsnap_retractions_total{outcome}``       requests SGLang retracted, with ``HSNAP_RETRACT_DIR`` (:mod:`.retraction`):
                                           ``to_disk`` (held, its file written), ``restored`` (back decoding from
                                           its file), ``recomputed`` (left to SGLang's new prefill)
=========================================  ====================================================================
"""

from __future__ import annotations

import os
import threading
from typing import Any, Callable

MULTIPROC_ENV = "PROMETHEUS_MULTIPROC_DIR"
_SECONDS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 300.0)

_lock = threading.Lock()
_made: dict[str, Any] | None = None


def _metrics() -> dict[str, Any] | None:
    """The metrics of this process, created on first use; None when SGLang runs without metrics."""
    global _made
    if _made is not None:
        return _made or None
    with _lock:
        if _made is None:
            _made = _create() if os.environ.get(MULTIPROC_ENV) else {}
    return _made or None


def _create() -> dict[str, Any]:
    from prometheus_client import Counter, Histogram

    def seconds(name: str, doc: str, labels: tuple[str, ...] = ()) -> Any:
        return Histogram(name, doc, labels, buckets=_SECONDS)

    return {
        "operations": Counter("hsnap_operations_total", "hsnap route answers, by route and outcome (ok or the error type)", ("op", "outcome")),
        "bytes_written": Counter("hsnap_bytes_written_total", "snapshot bytes written", ("op",)),
        "bytes_read": Counter("hsnap_bytes_read_total", "snapshot bytes read into the pools", ("op",)),
        "pause_to_durable": seconds("hsnap_pause_to_durable_seconds", "an export asked for to its snapshot durable", ("op",)),
        "restore": seconds("hsnap_restore_seconds", "a resume's restore into the pools"),
        "first_token": seconds("hsnap_resume_to_first_token_seconds", "a resume asked for to the first event of its stream"),
        "migration_stop": seconds("hsnap_migration_stop_seconds", "a migration's source: request stopped to final link durable"),
        "link_lag": seconds("hsnap_checkpoint_link_lag_seconds", "a checkpoint link: due to committed"),
        "relays": Counter("hsnap_relays_total", "relayed migrations, by how they ended", ("outcome",)),
        "retractions": Counter("hsnap_retractions_total", "retracted requests, by what hsnap did with them", ("outcome",)),
    }


def _at(*path: str) -> Callable[[dict], float | None]:
    """The number at ``path`` in an answer, or None."""
    def get(content: dict) -> float | None:
        value: Any = content
        for key in path:
            value = value.get(key) if isinstance(value, dict) else None
        return float(value) if isinstance(value, (int, float)) and not isinstance(value, bool) else None

    return get


def _sum(*parts: Callable[[dict], float | None]) -> Callable[[dict], float | None]:
    def get(content: dict) -> float | None:
        values = [v for v in (p(content) for p in parts) if v is not None]
        return sum(values) if values else None

    return get


_EXPORT = (("bytes_written", _at("bytes"), True), ("pause_to_durable", _at("timings", "pause_to_durable_s"), True))
# what one successful answer of each route adds: (metric, its number in the answer, labelled by op)
_OBSERVED: dict[str, tuple[tuple[str, Callable[[dict], float | None], bool], ...]] = {
    "export": _EXPORT,
    "drain": _EXPORT,  # per member
    "checkpoint": (("bytes_written", _at("bytes"), True),),
    "resume": (("bytes_read", _at("bytes_uploaded"), True), ("restore", _at("timings", "restore_s"), False)),
    "follow": (("bytes_read", _at("bytes_uploaded"), True),),
    # the request is stopped from its final capture to the final link's commit
    "migrate": (("migration_stop", _sum(_at("timings", "final_capture_s"), _at("timings", "final_write_s")), False),),
}


def observe_answer(op: str, status: int, content: dict, *, counted: bool = True) -> None:
    """Count one answer of route ``op`` (``content``: its result, or the refusal's error dict); ``counted``
    False: only its bytes and durations (a drain's member)."""
    m = _metrics()
    if m is None:
        return
    if counted:
        m["operations"].labels(op, "ok" if status < 400 else str(content.get("type") or f"HTTP {status}")).inc()
    if status >= 400:
        return
    for name, number_of, by_op in _OBSERVED.get(op, ()):
        number = number_of(content)
        if number is None:
            continue
        metric = m[name].labels(op) if by_op else m[name]
        (metric.inc if name.startswith("bytes") else metric.observe)(number)


def observe(name: str, seconds: float) -> None:
    """One observation of an unlabelled histogram (``first_token``, ``link_lag``)."""
    m = _metrics()
    if m is not None:
        m[name].observe(seconds)


def count(name: str, label: str) -> None:
    """One more of a counter with one label (``relays`` by outcome)."""
    m = _metrics()
    if m is not None:
        m[name].labels(label).inc()


__all__ = ["MULTIPROC_ENV", "observe_answer", "observe", "count"]
