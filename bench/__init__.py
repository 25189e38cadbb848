"""Benchmarks for hsnap export/restore against the I/O limit and common peers.

``make bench`` (= ``python -m bench.run``) runs the CPU benchmark and writes
bench/RESULTS.md (with a row from ``python -m bench.viewer``: hsnap-view's first frame
on 10,006 sections); ``python -m bench.gpu_check`` is the single-GPU check.
"""
