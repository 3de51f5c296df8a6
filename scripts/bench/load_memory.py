#!/usr/bin/env python3
"""Memory a torch-backend load takes: at its peak and once loaded, against the weights and KV cache.

    python -m scripts.bench.load_memory --model build/beyond-cache/bench-model-bf16 --slots 8 --max-length 1024

Loads the model as a TorchServe worker does (``TorchSlotBackend.from_pretrained``), sampling this
process's resident memory every 10 ms, and prints one JSON line: the process's own memory
(``anon``) and mapped files' pages (``file``, which the kernel can drop and read again) at their
peaks and once loaded, the checkpoint's bytes and the KV cache's. Run it once per setting (the
peak is the process's): ``LLAMA_CPU_CLASS=avx2`` loads as an AVX2-only CPU would.
"""
from __future__ import annotations

import argparse
import json
import sys
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "handlers"))

from llama_engine.cpu import cpu_class, cpu_flags, process_memory  # noqa: E402

MIB = 2**20


class PeakSampler(threading.Thread):
    """The most ``anon`` and ``file`` memory seen at once, sampled every ``interval`` s until :meth:`stop`."""

    def __init__(self, interval: float = 0.01):
        super().__init__(daemon=True)
        self.interval, self.peak, self._done = interval, {"anon": 0, "file": 0}, threading.Event()

    def run(self) -> None:
        while not self._done.is_set():
            self._sample()
            self._done.wait(self.interval)

    def stop(self) -> dict:
        self._done.set()
        self.join()
        self._sample()
        return self.peak

    def _sample(self) -> None:
        now = process_memory()
        for key in self.peak:
            self.peak[key] = max(self.peak[key], now.get(key, 0))


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", required=True, help="an HF checkpoint directory with model.safetensors")
    p.add_argument("--slots", type=int, default=8)
    p.add_argument("--max-length", type=int, default=1024)
    p.add_argument("--dtype", default="auto")
    args = p.parse_args(argv)
    if not process_memory():
        print("no /proc/self/status here: nothing to measure", file=sys.stderr)
        return 2
    from llama_engine.backends.torch_backend import TorchSlotBackend

    sampler = PeakSampler()
    sampler.start()
    start = time.perf_counter()
    backend = TorchSlotBackend.from_pretrained(args.model, args.slots, args.max_length, args.dtype, "cpu")
    seconds = time.perf_counter() - start
    peak, loaded = sampler.stop(), process_memory()
    kv = 2 * backend.k_cache.numel() * backend.k_cache.element_size()
    checkpoint = sum(f.stat().st_size for f in Path(args.model).glob("*.safetensors"))
    print(json.dumps({
        "model": args.model, "cpu_class": cpu_class(cpu_flags()), "dtype": str(backend.dtype),
        "weights_dtype": str(backend.weight_dtype or backend.dtype), "load_s": round(seconds, 1),
        "checkpoint_mib": round(checkpoint / MIB), "kv_cache_mib": round(kv / MIB),
        "peak_anon_mib": round(peak["anon"] / MIB), "peak_file_mib": round(peak["file"] / MIB),
        "loaded_anon_mib": round(loaded["anon"] / MIB), "loaded_file_mib": round(loaded["file"] / MIB),
    }))
    return 0


if __name__ == "__main__":
    sys.exit(main())
