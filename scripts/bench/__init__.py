"""Benchmark suite: the engine in-process, the handler served by TorchServe, and installed peers.

Run ``python -m scripts.bench`` (``--quick``, ``--smoke``); see ``scripts/bench/run.py`` and
``docs/benchmarks.md``.
"""
