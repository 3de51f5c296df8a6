"""What clients see when TorchServe's worker is SIGKILLed, measured through a real server.

A script, not a test: it measures and prints. Each trial kills the READY worker, waits
``--delay-ms`` (one value per round-robin trial), then sends one short request with a
``--client-timeout`` read timeout, and records its outcome and the time from the kill:

* ``served``: queued by the frontend and answered once the new worker is up;
* ``error``: an error status or a cut connection;
* ``lost``: no answer within the client's timeout. TorchServe 0.12's frontend drops a job it
  had already taken into a batch that was still filling (``maxBatchDelay``) when it learned
  that the worker died (``WorkerThread.run`` calls ``aggregator.cleanJobs()`` without
  answering); only the client's own timeout ends that wait.

    .venv/bin/python -m scripts.bench.worker_kill --model tiny-llama --trials 12
    .venv/bin/python -m scripts.bench.worker_kill --model tiny-llama-continuous --delay-ms 0,20,200
"""
from __future__ import annotations

import argparse
import collections
import os
import signal
import sys
import tempfile
import time
from pathlib import Path

import requests

from scripts import build_model
from scripts.tsctl import running

ROOT = Path(__file__).resolve().parents[2]


def ready_worker_pid(server, model: str, timeout: float = 120) -> int:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        r = requests.get(f"{server.url('management')}/models/{model}", headers=server.auth_headers("management"),
                         timeout=10)
        workers = r.json()[0]["workers"]
        if workers and workers[0]["status"] == "READY":
            return int(workers[0]["pid"])
        time.sleep(0.2)
    raise TimeoutError(f"no READY worker for {model} after {timeout:.0f} s")


def kill_ready_worker(server, model: str, timeout: float = 120) -> None:
    """SIGKILL the READY worker; the management API can list a worker that just died as READY."""
    deadline = time.monotonic() + timeout
    while True:
        try:
            os.kill(ready_worker_pid(server, model), signal.SIGKILL)
            return
        except ProcessLookupError:
            if time.monotonic() > deadline:
                raise
            time.sleep(0.2)


def trial(server, model: str, delay: float, client_timeout: float) -> tuple:
    """Kill the worker, wait ``delay`` s, send one request: (outcome, seconds from the kill)."""
    kill_ready_worker(server, model)
    killed = time.monotonic()
    time.sleep(delay)
    body = {"inputs": "The function returns", "stream": False, "parameters": {"max_new_tokens": 4}}
    try:
        r = requests.post(f"{server.url()}/predictions/{model}", json=body, headers=server.auth_headers(),
                          timeout=(5, client_timeout))
        outcome = "served" if r.status_code == 200 else f"error {r.status_code}"
    except requests.exceptions.ReadTimeout:
        outcome = "lost"
    except requests.RequestException as exc:
        outcome = f"error {type(exc).__name__}"
    return outcome, time.monotonic() - killed


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="tiny-llama", help="a model-config name (built from --checkpoint)")
    parser.add_argument("--config", type=Path, help="a model-config file (default model-config/<model>.yaml)")
    parser.add_argument("--checkpoint", type=Path, default=ROOT / "build" / "tiny-llama", help="the HF checkpoint")
    parser.add_argument("--trials", type=int, default=12, help="kills in all")
    parser.add_argument("--delay-ms", default="0,10,50,200",
                        help="comma list of waits between the kill and the request, used in turn")
    parser.add_argument("--client-timeout", type=float, default=30, help="the client's read timeout, s")
    args = parser.parse_args(argv)

    delays = [float(d) / 1000 for d in args.delay_ms.split(",")]
    with tempfile.TemporaryDirectory(prefix="worker-kill-") as tmp:
        work = Path(tmp)
        config = args.config or ROOT / "model-config" / f"{args.model}.yaml"
        build_model.main(["--config", str(config), "--checkpoint",
                          str(args.checkpoint), "--name", args.model, "--build-dir", str(work / "build"),
                          "--export-path", str(work / "store")])
        results = collections.defaultdict(list)
        with running(work / "ts", work / "store", models=args.model) as server:
            for i in range(args.trials):
                delay = delays[i % len(delays)]
                outcome, seconds = trial(server, args.model, delay, args.client_timeout)
                results[(delay, outcome)].append(seconds)
                print(f"trial {i + 1}: request {delay * 1000:.0f} ms after the kill -> {outcome} "
                      f"after {seconds:.1f} s", flush=True)
    print(f"\n{args.model}, {args.trials} kills, client timeout {args.client_timeout:.0f} s:")
    for (delay, outcome), times in sorted(results.items()):
        print(f"  +{delay * 1000:.0f} ms: {outcome:<12} x{len(times)}  median {sorted(times)[len(times) // 2]:.1f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
