"""hsnap's edge package for SGLang: everything that names SGLang's runtime lives here.

* :mod:`hsnap_sglang.req` — SGLang's own ``Req`` in and out of a snapshot (``snapshot_req`` / ``resume_req``; below
  it the field table, the record, the binding to slots), :mod:`hsnap_sglang.retract` — retraction to disk;
* :mod:`hsnap_sglang.plugin` — an SGLang plug-in (opt-in: ``HSNAP_SGLANG_PLUGIN=1``) that pauses one live request of a
  running server over HTTP, exports it and resumes it in another server (:mod:`.scheduler` and the jobs it runs,
  :mod:`.jobs`, :mod:`.migration`; :mod:`.frontend`);
  :mod:`hsnap_sglang.client` — its Python calls and the ``hsnap pause | resume | drain`` commands;
* :mod:`hsnap_sglang.cpu` — a CPU platform (opt-in: ``HSNAP_SGLANG_CPU=1``) so that SGLang's real engine
  (``sglang.Engine``, ``python -m sglang.launch_server``) serves a GDN hybrid on a machine without a GPU;
* :mod:`hsnap_sglang.tiny` — a tiny random-weight Qwen3-Next / Qwen3.5 hybrid model directory built locally;
* :mod:`hsnap_sglang.serve` — ``python -m hsnap_sglang.serve``: ``sglang.launch_server`` on that platform;
* :mod:`hsnap_sglang.demo` — ``hsnap demo``: a live request paused in one real server, resumed exactly in a fresh one.

Importing this package imports nothing else (no torch, no SGLang).
"""
