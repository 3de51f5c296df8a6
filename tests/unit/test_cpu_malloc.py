"""glibc keeps the blocks torch frees (``llama_engine.cpu.keep_freed_memory``): a prefill's
multi-megabyte intermediates are reused, not faulted in from the kernel page by page each time."""
import subprocess
import sys
from pathlib import Path

import pytest

HANDLERS = Path(__file__).resolve().parents[2] / "handlers"

# Minor page faults of three 48 MB tensors made, written and freed, before and after the call.
# 48 MB is above glibc's own dynamic ceiling (32 MiB), so with its defaults every such block is
# mmap'd and handed back. In a child process: the setting is process-wide and cannot be undone.
CHILD = f"""
import resource, sys
import torch
sys.path.insert(0, {str(HANDLERS)!r})
from llama_engine.cpu import keep_freed_memory

def faults():
    start = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    for _ in range(3):
        block = torch.ones(12 << 20)
        del block
    return resource.getrusage(resource.RUSAGE_SELF).ru_minflt - start

faults()
before = faults()
kept = keep_freed_memory()
for _ in range(3):  # the heap grows to hold the block over the first few (small objects land in between)
    faults()
print(kept, before, faults(), keep_freed_memory())
"""


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc's mallopt")
def test_freed_blocks_are_reused_instead_of_faulted_in_again():
    out = subprocess.run([sys.executable, "-c", CHILD], capture_output=True, text=True, timeout=120, check=True)
    kept, before, after, again = out.stdout.split()
    assert kept == again == "True"
    assert int(before) > 3 * 10_000, out.stdout  # 3 x 12,288 pages: each block faulted in anew
    assert int(after) < 1_000, out.stdout


def test_the_torch_backend_keeps_freed_memory_on_cpu(tiny_model_dir, monkeypatch):
    from llama_engine.backends import torch_backend

    calls = []
    monkeypatch.setattr(torch_backend, "keep_freed_memory", lambda: calls.append(True) or True)
    torch_backend.load_model(str(tiny_model_dir), "float32", "cpu", 64)
    assert calls == [True]


def test_releasing_openmp_threads_ends_the_calling_threads_workers():
    """A thread that then runs the model is not throttled by this thread's idle team (cpu.py)."""
    import os
    import time

    import torch

    from llama_engine.cpu import release_openmp_threads

    threads = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        torch.randn(4_000_000).sum()  # a parallel region: this thread's team gets a worker
        before = len(os.listdir("/proc/self/task"))
        assert release_openmp_threads() >= 1
        deadline = time.monotonic() + 5
        while len(os.listdir("/proc/self/task")) >= before and time.monotonic() < deadline:
            time.sleep(0.05)
        assert len(os.listdir("/proc/self/task")) < before
        assert torch.randn(1000).sum().isfinite()  # the runtime still works after the release
    finally:
        torch.set_num_threads(threads)


HEAP_CHILD = f"""
import sys, torch
sys.path.insert(0, {str(HANDLERS)!r})
from llama_engine.cpu import heap_free_bytes, keep_freed_memory
keep_freed_memory()
block = torch.ones(16 << 20)  # 64 MiB, from the heap under keep_freed_memory
before = heap_free_bytes()
del block
print(before, heap_free_bytes())
"""


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc's mallinfo2")
def test_heap_free_bytes_counts_a_freed_block_that_the_heap_keeps():
    """What the load's releases look at (torch_backend.RELEASE_AT): a 64 MiB block freed into the heap."""
    out = subprocess.run([sys.executable, "-c", HEAP_CHILD], capture_output=True, text=True, timeout=120, check=True)
    before, after = out.stdout.split()
    if before == "None":  # glibc before 2.33 has no mallinfo2: every layer's copies are handed back
        assert after == "None"
        return
    assert int(after) - int(before) >= 64 << 20, out.stdout
