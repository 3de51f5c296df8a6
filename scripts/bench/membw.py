"""The machine's memory read bandwidth, measured the way a decode step reads weights.

``x.sum()`` over a float32 tensor far larger than the last-level cache streams it from DRAM
once; GB/s = bytes / seconds (1 GB = 1e9 bytes), best of ``repeats`` after a warm-up pass,
with 1 thread and with 2 (or the requested) torch threads.
"""
from __future__ import annotations

import statistics
import time
from typing import Dict, Sequence


def read_bandwidth(size_gb: float = 2.0, threads: Sequence[int] = (1, 2), repeats: int = 5) -> Dict[str, dict]:
    import torch

    before = torch.get_num_threads()
    n = int(size_gb * 1e9) // 4
    x = torch.ones(n, dtype=torch.float32)
    results = {}
    try:
        for t in threads:
            torch.set_num_threads(t)
            x.sum()  # warm-up: page faults, thread pool
            times = []
            for _ in range(repeats):
                started = time.perf_counter()
                x.sum()
                times.append(time.perf_counter() - started)
            nbytes = x.numel() * x.element_size()
            results[str(t)] = {"threads": t, "gb_per_s": round(nbytes / min(times) / 1e9, 3),
                               "median_gb_per_s": round(nbytes / statistics.median(times) / 1e9, 3),
                               "bytes": nbytes, "repeats": repeats}
    finally:
        torch.set_num_threads(before)
        del x
    return results
