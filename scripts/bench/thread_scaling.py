"""How the torch backend's CPU path scales with threads on this machine, to choose ``handler.torch_threads``.

For each dtype and thread count: the memory's read bandwidth, a prompt's prefill, and decode steps of 1 and
8 rows, on a :class:`TorchSlotBackend` loaded at that count (the kernels' calibrations at load depend on it).
``decode1_weights_gb_s`` is the weights a one-row step streams per second: near ``read_gb_s`` a step is at
the memory's speed, above it the weights sit in the last-level cache. Reported, never asserted.

    python -m scripts.bench.thread_scaling [--threads 1,2,4] [--dtypes bfloat16,float32] [--model bench|DIR]
"""
from __future__ import annotations

import argparse
import functools
import json
import statistics
import time
from pathlib import Path
from typing import Callable, List, Optional

from llama_engine.cpu_limits import usable_cpus

from .gemm import torch_threads
from .membw import read_bandwidth
from .model import describe, ensure_bench_models, served_weight_dtype

#: The table's first columns, in this order; the prefill's column is named by its prompt length.
COLUMNS = ("dtype", "weight_dtype", "threads", "read_gb_s")


def default_threads(usable: int) -> List[int]:
    """1, 2, 4, ... below ``usable``, then ``usable`` itself."""
    counts, t = [], 1
    while t < usable:
        counts.append(t)
        t *= 2
    return counts + [usable]


def median_ms(call: Callable[[], object], repeats: int) -> float:
    times = []
    for _ in range(repeats):
        started = time.perf_counter()
        call()
        times.append(time.perf_counter() - started)
    return round(statistics.median(times) * 1e3, 3)


def measure(checkpoint: Path, dtype: str, threads: int, prompt: List[int], repeats: int) -> dict:
    """One row of the table: ``checkpoint`` in ``dtype`` on ``threads`` threads (restored after)."""
    from llama_engine.backends.torch_backend import TorchSlotBackend

    with torch_threads(threads):
        backend = TorchSlotBackend.from_pretrained(str(checkpoint), max_slots=8, max_length=len(prompt) + 64,
                                                   dtype=dtype, device="cpu")
        row = {"dtype": dtype, "threads": threads, "native_layers": backend._decode_layers is not None}

        def prefill():
            backend.prefill_slot(0, prompt)
            backend.free_slot(0)

        prefill()
        row[f"prefill{len(prompt)}_ms"] = median_ms(prefill, repeats)
        for rows in (1, 8):
            slots = list(range(rows))
            for slot in slots:
                backend.prefill_slot(slot, prompt[:32])
            step = functools.partial(backend.decode_slots, slots, [5] * rows)
            for _ in range(3):
                step()
            row[f"decode{rows}_ms"] = median_ms(step, 5 * repeats)
            for slot in slots:
                backend.free_slot(slot)
        return row


def scaling(checkpoints: dict, threads: List[int], prompt_tokens: int = 256, repeats: int = 5,
            bandwidth_gb: float = 1.0, log: Callable[[str], None] = print) -> List[dict]:
    """The table's rows for each ``dtype -> checkpoint`` at each thread count."""
    import torch

    from llama_engine.config import HandlerConfig

    bandwidth = read_bandwidth(bandwidth_gb, threads, repeats=3)
    prompt = torch.randint(3, 1000, (prompt_tokens,), generator=torch.Generator().manual_seed(0)).tolist()
    rows = []
    for dtype, checkpoint in checkpoints.items():
        weights = served_weight_dtype(HandlerConfig(model_path=".", dtype=dtype), checkpoint)
        step_bytes = describe(checkpoint, dtype, weights)["weight_bytes_per_token"]
        for t in threads:
            row = measure(checkpoint, dtype, t, prompt, repeats)
            row.update(weight_dtype=weights, read_gb_s=bandwidth[str(t)]["gb_per_s"],
                       decode1_weights_gb_s=round(step_bytes / row["decode1_ms"] / 1e6, 1))
            log(json.dumps(row))
            rows.append(row)
    return rows


def table(rows: List[dict]) -> str:
    keys = list(COLUMNS) + [k for k in rows[0] if k not in COLUMNS]
    lines = ["| " + " | ".join(keys) + " |", "|" + "---|" * len(keys)]
    lines += ["| " + " | ".join(str(r.get(k, "")) for k in keys) + " |" for r in rows]
    return "\n".join(lines)


def main(argv: Optional[List[str]] = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--threads", help="comma list of thread counts (default 1, 2, 4, ... and every usable CPU)")
    p.add_argument("--dtypes", default="bfloat16,float32", help="comma list of dtypes")
    p.add_argument("--model", default="bench",
                   help="bench: the benchmark's 116M model (built here if missing), or a checkpoint's directory")
    p.add_argument("--prompt-tokens", type=int, default=256, help="the prefill's prompt length (default 256)")
    p.add_argument("--repeats", type=int, default=5, help="prefills timed per row (decode steps: 5x as many)")
    p.add_argument("--json", type=Path, help="also write the rows here")
    args = p.parse_args(argv)
    dtypes = args.dtypes.split(",")
    threads = [int(t) for t in args.threads.split(",")] if args.threads else default_threads(usable_cpus().count)
    if args.model == "bench":
        checkpoints = ensure_bench_models(dtypes=tuple(dtypes))
    else:
        checkpoints = {d: Path(args.model) for d in dtypes}
    rows = scaling(checkpoints, threads, args.prompt_tokens, args.repeats)
    print(table(rows))
    if args.json:
        args.json.write_text(json.dumps(rows, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
