"""Tokens/s: ContinuousScheduler with 8 concurrent requests vs Engine.generate on a static batch of 8 (tiny model, CPU).

    python -m scripts.bench.measure_continuous [torch_threads]
"""
import argparse
import time
from pathlib import Path

import torch

from llama_engine import Engine, GenerationRequest, SamplingParams
from llama_engine.backends.torch_backend import TorchSlotBackend
from llama_engine.config import HandlerConfig
from llama_engine.continuous import ContinuousScheduler

ROOT = Path(__file__).resolve().parents[2]

_parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
_parser.add_argument("torch_threads", nargs="?", type=int, default=2, help="torch threads (default 2)")
torch.set_num_threads(_parser.parse_args().torch_threads)
N, NEW, REPS = 8, 64, 3
cfg = HandlerConfig(model_path="tiny-llama", max_length=256, max_new_tokens=NEW)
engine = Engine.from_config(cfg, str(ROOT / "build"))
prompts = ["The function returns", "If the object is a list of values, then", "A", "def main():",
           "Once upon a time there was", "Errors should never pass silently.", "Beautiful is better than", "Import"]


def prep():
    return [engine.prepare(GenerationRequest(p, SamplingParams(max_new_tokens=NEW))) for p in prompts[:N]]


backend = TorchSlotBackend(engine.backend.model, max_slots=N, max_length=256)

def static():
    return sum(r.generated_tokens for r in engine.generate(prep()))

def continuous():
    s = ContinuousScheduler(backend, engine.tokenizer, max_slots=N, max_queue=64, max_prefill_tokens_per_step=512)
    hs = [s.submit(p) for p in prep()]
    while s.step():
        pass
    return sum(h.result.generated_tokens for h in hs), s.steps

def continuous_staggered():
    """Arrivals every 4 steps, with mixed lengths: what continuous batching is for."""
    s = ContinuousScheduler(backend, engine.tokenizer, max_slots=N, max_queue=64, max_prefill_tokens_per_step=64)
    items, hs = prep(), []
    for i, p in enumerate(items):
        p.max_new_tokens = 16 if i % 2 else NEW
    step = 0
    while items or not s.idle:
        if step % 4 == 0 and items:
            hs.append(s.submit(items.pop(0)))
        s.step()
        step += 1
    return sum(h.result.generated_tokens for h in hs), s.steps

for name, fn in [("static Engine.generate batch 8", static), ("continuous, 8 submitted at once", continuous),
                 ("continuous, staggered arrivals", continuous_staggered)]:
    times, out = [], None
    fn()
    for _ in range(REPS):
        t = time.perf_counter()
        out = fn()
        times.append(time.perf_counter() - t)
    tokens = out if isinstance(out, int) else out[0]
    dt = min(times)
    extra = "" if isinstance(out, int) else f", {out[1]} steps"
    print(f"{name:36s} {tokens:4d} tokens in {dt*1000:7.1f} ms = {tokens/dt:7.0f} tokens/s (best of {REPS}{extra})")
