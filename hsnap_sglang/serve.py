"""``python -m hsnap_sglang.serve [launch_server args]``: SGLang's own ``sglang.launch_server`` on hsnap's CPU platform.

It sets ``HSNAP_SGLANG_CPU=1`` (inherited by every process the server starts), activates the platform in this
process, adds the CPU flags below unless given (and ``--disable-overlap-schedule`` while the radix cache is on:
SGLang's CPU platform cannot run both), for ``--tp N`` sets ``SGLANG_CPU_OMP_THREADS_BIND`` (one core range
per rank) unless given, starts SGLang's child processes by ``fork`` (``HSNAP_SGLANG_START_METHOD=spawn``: SGLang's own
``spawn``; see :func:`use_start_method`) and runs ``sglang.launch_server`` as ``__main__`` (SGLang's code, unchanged).
``--enable-hsnap`` (hsnap's flag, not SGLang's) turns on the hsnap plug-in (``HSNAP_SGLANG_PLUGIN=1``);
``--hsnap-root DIR`` (``HSNAP_ROOT``) is the directory every client path resolves beneath, ``--hsnap-allow-url
s3://bucket/prefix`` (repeatable; ``HSNAP_ALLOWED_URLS``) an object-store prefix clients may name
(:mod:`hsnap_sglang.confine`), ``--hsnap-allow-peer http://host:port`` (repeatable; ``HSNAP_ALLOWED_PEERS``) a server
a relayed migration may call (:mod:`hsnap_sglang.relay`), ``--hsnap-retract-dir DIR`` (``HSNAP_RETRACT_DIR``) where
requests SGLang retracts are written and restored from (:mod:`hsnap_sglang.retraction`), ``--hsnap-allow-unauthenticated`` (``HSNAP_ALLOW_UNAUTHENTICATED=1``) lets the
plug-in start on a non-loopback host with no API key (:mod:`hsnap_sglang.auth`).  Equivalent by hand::

    HSNAP_SGLANG_CPU=1 python -m sglang.launch_server --model-path DIR --device cpu \\
        --attention-backend torch_native --disable-cuda-graph --sampling-backend pytorch \\
        --max-mamba-cache-size 16 --max-running-requests 8

:func:`engine_kwargs` gives the same defaults for ``sglang.Engine(**kwargs)``.
"""

from __future__ import annotations

import os
import runpy
import sys

__all__ = ["CPU_DEFAULTS", "HSNAP_FLAG_HELP", "START_METHOD_ENV", "START_METHODS", "early_exposure_refusal", "engine_kwargs", "hsnap_help", "launch_server_argv", "main",
           "omp_threads_bind", "take_hsnap_flags", "use_start_method"]

# flag -> value (None: a switch).  --max-mamba-cache-size matters: without it SGLang sizes the Mamba pool from free
# RAM (hundreds of thousands of slots, gigabytes).
CPU_DEFAULTS: dict[str, str | None] = {
    "--device": "cpu",
    "--attention-backend": "torch_native",
    "--disable-cuda-graph": None,
    "--sampling-backend": "pytorch",
    "--max-mamba-cache-size": "16",
    "--max-running-requests": "8",
}


def omp_threads_bind(tp_size: int) -> str | None:
    """``SGLANG_CPU_OMP_THREADS_BIND`` for ``tp_size`` CPU ranks: this process's cores split evenly, one range per
    rank ("0|1", "0-3|4-7").  SGLang requires it when there are more TP ranks than NUMA nodes; None when there
    are fewer cores than ranks (SGLang then says why it cannot start)."""
    cores = sorted(os.sched_getaffinity(0))
    if tp_size < 1 or len(cores) < tp_size:
        return None
    per = len(cores) // tp_size
    groups = [cores[r * per : (r + 1) * per] for r in range(tp_size)]
    return "|".join(str(g[0]) if len(g) == 1 else f"{g[0]}-{g[-1]}" for g in groups)


def _flag_value(argv: list[str], *flags: str) -> str | None:
    """The value ``argv`` gives any of ``flags`` (``--flag value`` or ``--flag=value``), the last one given as argparse
    takes it; None if none is given."""
    value = None
    for i, arg in enumerate(argv):
        for flag in flags:
            if arg == flag and i + 1 < len(argv):
                value = argv[i + 1]
            elif arg.startswith(flag + "="):
                value = arg.split("=", 1)[1]
    return value


def _tp_size(argv: list[str]) -> int:
    value = _flag_value(argv, "--tp", "--tp-size", "--tensor-parallel-size")
    return 1 if value is None else int(value)


# A flag that may give a key (argparse also takes an unambiguous prefix): where one is present the plug-in's own check,
# on SGLang's parsed arguments, decides
_KEY_FLAG_PREFIXES = ("--api", "--admin")
_SGLANG_DEFAULT_HOST = "127.0.0.1"  # SGLang's --host default (sglang.srt.arg_groups.fields.serving)


def early_exposure_refusal(argv: list[str], env) -> str | None:
    """The plug-in's refusal of an exposed server without a key (:func:`hsnap_sglang.auth.exposure_refusal`), decided
    from ``argv`` before SGLang is imported (seconds, not a server start); None where only SGLang's parsed arguments
    can decide (a key flag given), and the plug-in decides again there."""
    if env.get(HSNAP_SWITCHES[ENABLE_HSNAP]) != "1" or any(a.startswith(_KEY_FLAG_PREFIXES) for a in argv):
        return None
    from hsnap_sglang.auth import exposure_refusal

    return exposure_refusal(_flag_value(argv, "--host") or _SGLANG_DEFAULT_HOST, None, None, env=env)


# With the radix cache on (SGLang's default), SGLang's "auto" Mamba radix-cache strategy picks "extra_buffer" when the
# overlap scheduler is on too, and then refuses it on CPU ("extra_buffer requires platform support for Mamba cache
# state snapshots": CUDA/MUSA/NPU/HIP/XPU only).  The one strategy the CPU platform runs, "no_buffer", needs the
# overlap scheduler off: so it is turned off unless the radix cache is (or a strategy is chosen explicitly).
_RADIX_NEEDS_NO_OVERLAP = ("--disable-radix-cache", "--mamba-radix-cache-strategy", "--disable-overlap-schedule")


def launch_server_argv(argv: list[str]) -> list[str]:
    """``argv`` plus every :data:`CPU_DEFAULTS` flag it does not already give (``--flag value`` or ``--flag=value``),
    and ``--disable-overlap-schedule`` when the radix cache stays on (see above)."""
    given = {a.split("=", 1)[0] for a in argv if a.startswith("--")}
    out = list(argv)
    for flag, value in CPU_DEFAULTS.items():
        if flag not in given:
            out += [flag] if value is None else [flag, value]
    if not given & set(_RADIX_NEEDS_NO_OVERLAP):
        out.append("--disable-overlap-schedule")
    return out


def engine_kwargs(**overrides) -> dict:
    """``sglang.Engine`` keyword arguments with the CPU defaults (and the radix-cache rule above); ``overrides`` win."""
    kw = {flag[2:].replace("-", "_"): (True if value is None else value) for flag, value in CPU_DEFAULTS.items()}
    for key in ("max_mamba_cache_size", "max_running_requests"):
        kw[key] = int(kw[key])
    if not set(overrides) & {f[2:].replace("-", "_") for f in _RADIX_NEEDS_NO_OVERLAP}:
        kw["disable_overlap_schedule"] = True
    kw.update(overrides)
    return kw


ENABLE_HSNAP = "--enable-hsnap"  # hsnap's own flag: turns the plug-in on (HSNAP_SGLANG_PLUGIN=1), not passed to SGLang
# hsnap's own flags with a value -> the environment variable each sets (inherited by every process of the server);
# repeated flags join with "," (the allow-lists).  Not passed to SGLang.
HSNAP_VALUE_FLAGS = {"--hsnap-root": "HSNAP_ROOT", "--hsnap-allow-url": "HSNAP_ALLOWED_URLS", "--hsnap-drain-on-sigterm": "HSNAP_DRAIN_ON_SIGTERM",
                     "--hsnap-resume-on-start": "HSNAP_RESUME_ON_START", "--hsnap-allow-peer": "HSNAP_ALLOWED_PEERS",
                     "--hsnap-retract-dir": "HSNAP_RETRACT_DIR"}
_JOINED = ("HSNAP_ALLOWED_URLS", "HSNAP_ALLOWED_PEERS")  # repeatable flags: their values joined with ","
HSNAP_SWITCHES = {ENABLE_HSNAP: "HSNAP_SGLANG_PLUGIN", "--hsnap-allow-unauthenticated": "HSNAP_ALLOW_UNAUTHENTICATED"}


def take_hsnap_flags(argv: list[str], env: dict) -> list[str]:
    """``argv`` without hsnap's own flags (``--flag value`` or ``--flag=value``), each set in ``env`` instead.  A
    root that is not an existing directory is refused here, before anything starts."""
    out, values, i = [], {}, 0
    while i < len(argv):
        a = argv[i]
        name, eq, val = a.partition("=")
        if a in HSNAP_SWITCHES:
            env[HSNAP_SWITCHES[a]] = "1"
        elif name in HSNAP_VALUE_FLAGS:
            if not eq:
                if i + 1 >= len(argv):
                    raise SystemExit(f"hsnap_sglang.serve: {name} needs a value")
                i, val = i + 1, argv[i + 1]
            values.setdefault(HSNAP_VALUE_FLAGS[name], []).append(val)
        else:
            out.append(a)
        i += 1
    for var, vals in values.items():
        env[var] = ",".join(vals) if var in _JOINED else vals[-1]
    root = env.get("HSNAP_ROOT")
    if root:
        if not os.path.isdir(root):
            raise SystemExit(f"hsnap_sglang.serve: --hsnap-root {root!r}: not an existing directory")
        env["HSNAP_ROOT"] = os.path.abspath(root)
    return out


# hsnap's own flags -> what each does, for --help (SGLang's own ~2,800 lines of options follow)
HSNAP_FLAG_HELP = {
    ENABLE_HSNAP: "turn the hsnap plug-in on: the /hsnap/* admin routes (pause, resume, drain, checkpoint, migrate)",
    "--hsnap-root DIR": "the directory every path a client names resolves beneath (HSNAP_ROOT); none: no local path",
    "--hsnap-allow-url s3://BUCKET/PREFIX": "an object-store prefix clients may name (repeatable; HSNAP_ALLOWED_URLS)",
    "--hsnap-allow-unauthenticated": "let the plug-in start on a non-loopback host without an API key",
    "--hsnap-allow-peer http://HOST:PORT": "a server this one may call for a client: a relayed migration's target "
                                           "(repeatable; HSNAP_ALLOWED_PEERS; the key sent: HSNAP_PEER_API_KEY, else "
                                           "this server's own)",
    "--hsnap-drain-on-sigterm DIR": "on SIGTERM, drain every request into DIR (beneath the root, or an allowed s3:// prefix) "
                                    "before SGLang's graceful shutdown: a rolling restart loses no request's progress "
                                    "(HSNAP_DRAIN_ON_SIGTERM)",
    "--hsnap-resume-on-start DIR": "once ready, resume every snapshot in DIR and hold each request for its client "
                                   "(POST /hsnap/attach; client.generate attaches): a rolling restart's new server "
                                   "(HSNAP_RESUME_ON_START)",
    "--hsnap-retract-dir DIR": "a request SGLang retracts (KV pool short, priority preemption) is written to DIR and "
                               "restored from it once it fits again, not recomputed (TP 1, overlap scheduler off; "
                               "HSNAP_RETRACT_DIR)",
}


def hsnap_help() -> str:
    """What ``--help`` prints before SGLang's own options: hsnap's flags and the CPU defaults it adds."""
    width = max(map(len, HSNAP_FLAG_HELP))
    lines = ["usage: python -m hsnap_sglang.serve [hsnap options] [sglang.launch_server options]", "", "hsnap options:"]
    lines += [f"  {flag:<{width}}  {what}" for flag, what in HSNAP_FLAG_HELP.items()]
    defaults = " ".join(flag if value is None else f"{flag} {value}" for flag, value in CPU_DEFAULTS.items())
    lines += ["", f"added unless given (hsnap's CPU platform): {defaults}; --disable-overlap-schedule while the radix cache is on",
              f"SGLang's processes start by fork ({START_METHOD_ENV}=spawn: SGLang's own spawn)",
              "", "SGLang's own options (sglang.launch_server --help) follow.", ""]
    return "\n".join(lines)


START_METHOD_ENV = "HSNAP_SGLANG_START_METHOD"
START_METHODS = ("fork", "spawn")


def use_start_method(method: str) -> None:
    """How SGLang's scheduler and detokenizer processes start.  SGLang forces ``spawn`` (CUDA cannot be forked): each
    child imports torch, transformers and SGLang again, ~13 CPU-s apiece here, so a server start took ~50 CPU-s and 40 s
    on two cores.  On CPU there is no device context to lose: ``fork`` (the default here) starts them from this
    process's imports, made before any thread or torch op (~19 CPU-s, 20 s); ``spawn`` is SGLang's own way."""
    if method not in START_METHODS:
        raise SystemExit(f"hsnap_sglang.serve: {START_METHOD_ENV}={method!r}: expected one of {', '.join(START_METHODS)}")
    if method == "spawn":
        return
    import multiprocessing

    set_method = multiprocessing.set_start_method

    def set_chosen(_asked: str, force: bool = False) -> None:  # SGLang's mp.set_start_method("spawn", force=True)
        set_method(method, force=True)

    multiprocessing.set_start_method = set_chosen


def main(argv: list[str] | None = None) -> None:
    argv = sys.argv[1:] if argv is None else argv
    wants_help = "-h" in argv or "--help" in argv
    if wants_help:
        print(hsnap_help(), flush=True)
    argv = take_hsnap_flags(argv, os.environ)  # inherited by every process the server starts
    refusal = None if wants_help else early_exposure_refusal(argv, os.environ)
    if refusal:
        raise SystemExit(refusal)
    os.environ["HSNAP_SGLANG_CPU"] = "1"
    tp = _tp_size(argv)
    if tp > 1 and "SGLANG_CPU_OMP_THREADS_BIND" not in os.environ:
        bind = omp_threads_bind(tp)
        if bind is not None:
            os.environ["SGLANG_CPU_OMP_THREADS_BIND"] = bind
    from hsnap_sglang.cpu import activate

    activate()
    use_start_method(os.environ.get(START_METHOD_ENV) or "fork")
    sys.argv = ["sglang.launch_server", *launch_server_argv(argv)]
    runpy.run_module("sglang.launch_server", run_name="__main__", alter_sys=True)


if __name__ == "__main__":
    main()
