"""CPU time per streamed token of each process of a served stream: TorchServe's frontend (java), its
Python worker, and the client.

On a 2-core machine every millisecond the frontend or the client spends on a token is taken from the
model's two threads, so this is the serving overhead's budget at one stream. ``--compare-logging``
serves the model twice, with this repository's ``log4j2.xml`` (config.properties' ``vmargs``) and
with TorchServe's default logging, and alternates their rounds::

    python -m scripts.bench.frontend_cpu --compare-logging --rounds 4

The first round of each server is a warm-up (the JIT compiles the frontend's paths) and is not printed.
"""
from __future__ import annotations

import argparse
import re
import shutil
import sys
import tempfile
import time
from pathlib import Path
from typing import Dict, List

ROOT = Path(__file__).resolve().parents[2]
for _path in (ROOT, ROOT / "handlers"):
    if str(_path) not in sys.path:
        sys.path.insert(0, str(_path))


def cpu_seconds(pid: int) -> float:
    """User + system CPU seconds of a process so far."""
    import psutil

    times = psutil.Process(pid).cpu_times()
    return times.user + times.system


def children(pid: int) -> List[int]:
    import psutil

    return [child.pid for child in psutil.Process(pid).children()]


def server_processes(launcher_pid: int) -> Dict[str, int]:
    """``{"frontend": java's pid, "worker": its Python worker's}`` under the ``torchserve`` launcher."""
    import psutil

    launcher = psutil.Process(launcher_pid)
    java = next(p for p in [launcher, *launcher.children()] if p.name() == "java")
    workers = children(java.pid)
    if len(workers) != 1:
        raise RuntimeError(f"expected one worker under the frontend (pid {java.pid}), found {workers}")
    return {"frontend": java.pid, "worker": workers[0]}


def default_logging_config(work: Path) -> Path:
    """config.properties without the log4j2.xml of its ``vmargs`` (TorchServe's own logging), its other
    JVM arguments kept, beside a copy of metrics.yaml."""
    work.mkdir(parents=True, exist_ok=True)
    text = re.sub(r"-Dlog4j\.configurationFile=\S+ ?", "", (ROOT / "config.properties").read_text())
    shutil.copyfile(ROOT / "metrics.yaml", work / "metrics.yaml")
    path = work / "config.properties"
    path.write_text(text)
    return path


def measure(system, adapter, prompt, tokens: int, timeout: float) -> dict:
    """One stream of ``tokens`` tokens: tok/s and each process's CPU ms per token."""
    from scripts.streaming_client import run_wave

    pids = server_processes(system.pid)
    before = {name: cpu_seconds(pid) for name, pid in pids.items()}
    client_before, started = time.process_time(), time.perf_counter()
    records = run_wave(adapter, [prompt], tokens, timeout)
    wall = time.perf_counter() - started
    got = sum(len(r.token_times) for r in records)
    if got != tokens:
        raise RuntimeError(f"the stream ended after {got} of {tokens} tokens: {records[0].error}")
    out = {f"{name}_ms_per_token": round(1000 * (cpu_seconds(pid) - before[name]) / got, 3) for name, pid in pids.items()}
    out["client_ms_per_token"] = round(1000 * (time.process_time() - client_before) / got, 3)
    out["tokens_per_s"] = round(got / wall, 1)
    return out


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--config", default=str(ROOT / "model-config" / "bench-llama.yaml"), help="model-config served")
    parser.add_argument("--checkpoint", choices=("bfloat16", "float32"), default="bfloat16",
                        help="the bench checkpoint served (default bfloat16)")
    parser.add_argument("--tokens", type=int, default=512, help="tokens of each stream (default 512)")
    parser.add_argument("--input", type=int, default=256, help="prompt tokens (default 256)")
    parser.add_argument("--rounds", type=int, default=3, help="measured rounds per server (default 3)")
    parser.add_argument("--compare-logging", action="store_true",
                        help="also serve with TorchServe's default logging, rounds alternated")
    args = parser.parse_args(argv)

    from transformers import AutoTokenizer

    from scripts.bench.ab_served import make_system
    from scripts.bench.model import model_dir
    from scripts.bench.prompts import PromptFactory
    from scripts.streaming_client import run_wave

    work = Path(tempfile.mkdtemp(prefix="frontend-cpu-"))
    prompt = PromptFactory(AutoTokenizer.from_pretrained(model_dir(args.checkpoint)), 0).make(args.input)
    variants = {"log4j2.xml": None}
    if args.compare_logging:
        variants["TorchServe's default logging"] = default_logging_config(work / "default-logging")
    servers = {}
    try:
        for index, (name, base_config) in enumerate(variants.items()):
            system = make_system(args.config, index, work, "auto", 2, args.checkpoint)
            system.base_config = base_config
            adapter = system.start(timeout=600)
            servers[name] = (system, adapter)
            run_wave(adapter, [prompt], args.tokens, 600)  # warm-up: the frontend's JIT, the worker's caches
        for k in range(args.rounds):
            for name in (list(servers) if k % 2 == 0 else list(servers)[::-1]):
                system, adapter = servers[name]
                got = measure(system, adapter, prompt, args.tokens, 600)
                print(f"round {k + 1}, {name}: {got['tokens_per_s']} tok/s; CPU ms a token: frontend "
                      f"{got['frontend_ms_per_token']}, worker {got['worker_ms_per_token']}, "
                      f"client {got['client_ms_per_token']}", flush=True)
    finally:
        for system, _ in servers.values():
            system.stop()
    return 0


if __name__ == "__main__":
    sys.exit(main())
