"""The testing kit shared by tests, bench and scripts: real SGLang 0.5.23 pools on CPU and what drives them.

* :mod:`hsnap_testing.pools`: pool sets of every kind SGLang has (MHA, MLA, SWA, hybrid linear, SWA + Mamba, fp8),
  requests allocated through SGLang's own allocators, and the pool-state fingerprint (free lists + every byte).
* :mod:`hsnap_testing.tp_pools`: the pools of each TP rank of a few model shapes, holding one request's shard.
* :mod:`hsnap_testing.reqs`: live SGLang ``Req`` objects in a decode state.
* :mod:`hsnap_testing.model`: the tiny random-weight hybrid model, its decode loop, cache <-> pool layouts.
* :mod:`hsnap_testing.migration`: a request migrating between two processes while the tiny model decodes.
* :mod:`hsnap_testing.zygote`: fresh child processes forked from one that already imported torch and SGLang.
* :mod:`hsnap_testing.server_zygote`: test servers (``python -m hsnap_sglang.serve``) forked from one that already
  imported SGLang's server on the CPU platform.
* :mod:`hsnap_testing.terminal`: a child that Ctrl-C reaches as it does at a terminal.
* :mod:`hsnap_testing.seams`: a change made to a module right after it runs (the test and GPU-machine seams' finder).

The top layer: it imports hsnap_format, hsnap_io and hsnap_sglang; none of them imports it.
"""
