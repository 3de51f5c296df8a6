"""Benchmark suite: the engine in-process, the handler served by TorchServe, and installed peers.

Run ``python -m scripts.bench`` (``--quick``, ``--smoke``); see ``docs/benchmarks.md``. A run's
steps are ``BenchRun``'s methods in ``run.py``, in order; what it will run is fixed up front in
``plan.py`` (modes, prompts, schedules, budget), each measurement is in ``scenarios.py``, the
servers under test in ``systems.py`` and their protocols in ``clients.py`` (the client itself
is ``scripts/streaming_client.py``, shared with the other scripts).
"""
