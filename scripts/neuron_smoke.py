#!/usr/bin/env python3
"""End-to-end smoke run on an Inferentia2 host (``make neuron-smoke MODEL=... CHECKPOINT=...``).

1. builds the artifact (compile, warm every graph, save the compiled graphs, manifest,
   archive) in a process of its own: the build loads the model onto the NeuronCores, and the
   Neuron runtime gives a core to one process until that process exits, so the build must
   be gone before TorchServe's worker asks for the same cores;
2. starts TorchServe from it and checks that loading compiled nothing (every graph hit the cache);
3. streams a prompt;
4. runs a short benchmark (TTFT and tokens/s at concurrency 1 and the compiled batch size:
   the micro-batch, or the slot count with continuous batching);
5. prints a report and writes it to ``build/neuron-smoke/<model>/report.json``.

Each step prints what it does; the run stops at the first failure with the reason.
"""
from __future__ import annotations

import argparse
import json
import re
import subprocess
import sys
import time
from pathlib import Path

from scripts import loadtest
from scripts.streaming_client import StreamError, TorchServeAdapter, stream_one
from scripts.tsctl import TorchServe, free_ports

ROOT = Path(__file__).resolve().parent.parent


def compile_report(log: str) -> dict:
    found = re.findall(r"compile cache: (\{.*\})", log)
    return json.loads(found[-1]) if found else {}


def build_in_subprocess(config: Path, checkpoint: Path, model: str, work: Path, store: Path) -> int:
    """scripts/build_model.py as a child process; it exits, freeing the NeuronCores, before TorchServe starts."""
    cmd = [sys.executable, str(ROOT / "scripts" / "build_model.py"), "--config", str(config), "--checkpoint",
           str(checkpoint), "--name", model, "--build-dir", str(work / "build"), "--export-path", str(store)]
    return subprocess.run(cmd).returncode


def benchmark_concurrency(cfg) -> list:
    """Concurrency 1 and the compiled batch size: the slot count with continuous batching, else the micro-batch."""
    return sorted({1, cfg.slots})


def echo(text: str) -> None:
    print(text, end="", flush=True)


def stream_prompt(adapter: TorchServeAdapter, prompt: str, max_new_tokens: int) -> dict:
    """Stream ``prompt`` (an adapter with ``on_text=echo`` prints its tokens as they arrive);
    a failed stream raises StreamError."""
    record = stream_one(adapter, prompt, max_new_tokens, timeout=600)
    print()
    if not record.ok:
        raise StreamError(record.error or "the stream ended without a token")
    return {"ttft_s": round(record.ttft, 3), "total_s": round(record.e2e, 3),
            "text": "".join(record.text), "details": record.details}


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", required=True, help="a model-config name, e.g. llama-2-7b-inf2-xlarge-b1")
    parser.add_argument("--checkpoint", required=True, type=Path, help="HF checkpoint directory (safetensors)")
    parser.add_argument("--config", type=Path, help="default model-config/<model>.yaml")
    parser.add_argument("--workdir", type=Path, help="default build/neuron-smoke/<model>")
    parser.add_argument("--prompt", default="Today the weather is really nice and I am planning on",
                        help="the prompt streamed in step 3")
    parser.add_argument("--max-new-tokens", type=int, default=64, help="tokens per stream (default 64)")
    parser.add_argument("--skip-build", action="store_true", help="reuse model_store/<model>")
    args = parser.parse_args(argv)

    from llama_engine import load_model_config_file

    config = args.config or ROOT / "model-config" / f"{args.model}.yaml"
    cfg = load_model_config_file(str(config))
    work = (args.workdir or ROOT / "build" / "neuron-smoke" / args.model).resolve()
    store = work / "model_store"
    report = {"model": args.model, "config": str(config)}

    print(f"== 1. build {args.model} (compile + warm-up + manifest + archive)", flush=True)
    started = time.perf_counter()
    if not args.skip_build:
        code = build_in_subprocess(config, args.checkpoint, args.model, work, store)
        if code != 0:
            print(f"FAIL: the build exited with {code}; see its output above")
            return 1
    report["build_s"] = round(time.perf_counter() - started, 1)

    print("== 2. start TorchServe from the artifact; loading must compile nothing", flush=True)
    server = TorchServe(work / "torchserve", store, models=args.model, ports=free_ports())
    try:
        server.start_ready(timeout=cfg.frontend.startupTimeout + 60)
        report["start_to_ready_s"] = round(time.perf_counter() - server.started_at, 1)
        cache = compile_report(server.model_log())
        report["compile_cache"] = cache
        if cache.get("new_entries") != 0:
            print(f"FAIL: loading compiled {cache.get('new_entries')} graphs; see {server.workdir}/logs")
            return 1

        print("== 3. stream a prompt", flush=True)
        headers = {"Authorization": f"Bearer {server.key}"}
        try:
            report["stream"] = stream_prompt(TorchServeAdapter(server.url(), args.model, headers, on_text=echo),
                                             args.prompt, args.max_new_tokens)
            print("== 4. short benchmark", flush=True)
            adapter = TorchServeAdapter(server.url(), args.model, headers)
            report["benchmark"] = [loadtest.run_round(adapter, c, args.max_new_tokens)
                                   for c in benchmark_concurrency(cfg)]
        except StreamError as exc:
            print(f"FAIL: {exc}")
            return 1
    finally:
        server.stop()

    print("== 5. report", flush=True)
    (work / "report.json").write_text(json.dumps(report, indent=2))
    print(json.dumps(report, indent=2))
    print(f"PASS: report in {work / 'report.json'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
