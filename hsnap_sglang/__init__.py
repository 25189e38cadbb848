"""hsnap's edge package for SGLang: everything that names SGLang's runtime lives here.

* :mod:`hsnap_sglang.cpu` — a CPU platform (opt-in: ``HSNAP_SGLANG_CPU=1``) so that SGLang's real engine
  (``sglang.Engine``, ``python -m sglang.launch_server``) serves a GDN hybrid on a machine without a GPU;
* :mod:`hsnap_sglang.tiny` — a tiny random-weight Qwen3-Next / Qwen3.5 hybrid model directory built locally;
* :mod:`hsnap_sglang.serve` — ``python -m hsnap_sglang.serve``: ``sglang.launch_server`` on that platform.

Importing this package imports nothing else (no torch, no SGLang).
"""
