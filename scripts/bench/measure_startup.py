#!/usr/bin/env python3
"""Cold against warm start, side by side: ``torchserve --start`` to the first streamed token.

    python -m scripts.bench.measure_startup --config model-config/tiny-llama-compiled.yaml --checkpoint build/tiny-llama

Builds the artifact once (with its compile cache), then serves two copies of it from fresh
TorchServe work directories:

* warm: the artifact as built, loading through the shipped cache;
* cold: the same artifact without ``compile_cache/`` and with ``allow_recompile: true``,
  so the model compiles at load as it would without this toolkit's build step.

Prints one JSON line per variant and the ratio.
"""
from __future__ import annotations

import argparse
import json
import shutil
import sys
import tempfile
import time
from pathlib import Path

import yaml

from scripts import build_model
from scripts.streaming_client import TorchServeAdapter, stream_one
from scripts.tsctl import TorchServe, free_ports

ROOT = Path(__file__).resolve().parents[2]


def make_cold_copy(store: Path, name: str, cold_name: str) -> None:
    src, dst = store / name, store / cold_name
    shutil.rmtree(dst, ignore_errors=True)
    shutil.copytree(src, dst, symlinks=True)
    shutil.rmtree(dst / "compile_cache")
    config = dst / f"{name}.yaml"
    data = yaml.safe_load(config.read_text())
    data["handler"]["allow_recompile"] = True
    config.write_text(yaml.safe_dump(data))
    manifest = json.loads((dst / "MAR-INF" / "MANIFEST.json").read_text())
    manifest["model"]["modelName"] = cold_name
    (dst / "MAR-INF" / "MANIFEST.json").write_text(json.dumps(manifest))


def time_to_first_token(store: Path, model: str, workdir: Path, timeout: float) -> dict:
    server = TorchServe(workdir, store, models=model, ports=free_ports())
    try:
        server.start_ready(timeout)
        started = server.started_at
        ready = time.perf_counter() - started
        adapter = TorchServeAdapter(server.url(), model, {"Authorization": f"Bearer {server.key}"})
        record = stream_one(adapter, "The function returns", 8, timeout)
        if not record.ok:
            raise RuntimeError(f"{model}: {record.error}")
        first = record.token_times[0] - started
    finally:
        server.stop()
    return {"variant": model, "start_to_ready_s": round(ready, 1), "start_to_first_token_s": round(first, 1)}


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--config", required=True, type=Path, help="model-config YAML to build (compile: true)")
    parser.add_argument("--checkpoint", required=True, type=Path, help="HF checkpoint directory (safetensors)")
    parser.add_argument("--timeout", type=float, default=900,
                        help="seconds to wait for each server to be ready and to stream (default 900)")
    args = parser.parse_args(argv)

    name = args.config.stem
    with tempfile.TemporaryDirectory(prefix="measure-startup-") as tmp:
        work = Path(tmp)
        build_model.main(["--config", str(args.config), "--checkpoint", str(args.checkpoint), "--name", name,
                          "--build-dir", str(work / "build"), "--export-path", str(work / "store")])
        make_cold_copy(work / "store", name, f"{name}-cold")
        results = [time_to_first_token(work / "store", model, work / model, args.timeout)
                   for model in (f"{name}-cold", name)]
    for result in results:
        print(json.dumps(result))
    cold, warm = results
    print(json.dumps({"cold_over_warm_first_token": round(cold["start_to_first_token_s"] /
                                                          warm["start_to_first_token_s"], 1)}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
