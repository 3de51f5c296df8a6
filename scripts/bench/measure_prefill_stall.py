"""How long a long prompt's admission stalls the streams already running, per prefill budget.

Continuous batching admits a request between decode steps; its prefill runs in the step, so
every running stream waits for it (a longer gap between two of its tokens). The scheduler's
``max_prefill_tokens_per_step`` splits a long prompt into chunks over several steps. This
script runs ``--running`` streams, lets them settle, then admits one ``--prompt-tokens``
prompt and reports, for each budget: the longest step while the prompt was prefilled (the
worst inter-token gap a running stream saw), the median step before it, and the new
request's time to first token.

Usage: python -m scripts.bench.measure_prefill_stall [--model build/bench-model-fp32] [--threads 2]
"""
from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def measure(scheduler, prompt_ids, running: int, budget: int):
    from llama_engine import GenerationRequest, SamplingParams
    from llama_engine.engine import PreparedRequest

    scheduler.max_prefill_tokens_per_step = budget
    request = GenerationRequest("x", SamplingParams(max_new_tokens=400))
    streams = [scheduler.submit(PreparedRequest(request, prompt_ids[:16], 400)) for _ in range(running)]
    for _ in range(8):  # admit and settle
        scheduler.step()
    before = []
    for _ in range(10):
        started = time.perf_counter()
        scheduler.step()
        before.append(time.perf_counter() - started)
    newcomer = scheduler.submit(PreparedRequest(request, prompt_ids, 1))
    admitted = time.perf_counter()
    during = []
    while not newcomer.done:
        started = time.perf_counter()
        scheduler.step()
        during.append(time.perf_counter() - started)
    ttft = time.perf_counter() - admitted
    for handle in streams:
        scheduler.cancel(handle.request_id)
    scheduler.step()
    return statistics.median(before), max(during), len(during), ttft


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", type=Path, default=ROOT / "build" / "bench-model-fp32",
                        help="checkpoint directory (default build/bench-model-fp32)")
    parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"], help="the model's dtype (default float32)")
    parser.add_argument("--threads", type=int, default=2, help="torch threads (default 2)")
    parser.add_argument("--running", type=int, default=7, help="streams decoding when the long prompt arrives")
    parser.add_argument("--prompt-tokens", type=int, default=768, help="length of the prompt admitted (default 768)")
    parser.add_argument("--budgets", type=int, nargs="+", default=[64, 128, 256, 512, 768],
                        help="max_prefill_tokens_per_step values to compare (default 64 128 256 512 768)")
    args = parser.parse_args(argv)

    import torch
    from transformers import AutoTokenizer

    from llama_engine.backends.torch_backend import TorchSlotBackend
    from llama_engine.continuous import ContinuousScheduler

    torch.set_num_threads(args.threads)
    tokenizer = AutoTokenizer.from_pretrained(args.model)
    length = max(args.prompt_tokens + 1, 16 + 400)
    backend = TorchSlotBackend.from_pretrained(str(args.model), args.running + 1, max_length=length, dtype=args.dtype)
    scheduler = ContinuousScheduler(backend, tokenizer, max_queue=args.running + 1)
    filler = tokenizer(" the", add_special_tokens=False)["input_ids"][-1]
    prompt_ids = [filler] * args.prompt_tokens
    measure(scheduler, prompt_ids, args.running, args.budgets[0])  # warm-up
    print(f"{args.model.name} ({args.dtype}), {args.threads} threads, {args.running} streams running, "
          f"one {args.prompt_tokens}-token prompt admitted")
    print(f"{'budget':>8} {'step before':>12} {'worst step':>11} {'stall x':>8} {'steps':>6} {'new TTFT':>9}")
    for budget in args.budgets:
        before, worst, steps, ttft = measure(scheduler, prompt_ids, args.running, budget)
        print(f"{budget:>8} {before * 1000:>9.1f} ms {worst * 1000:>8.1f} ms {worst / before:>8.1f} {steps:>6} "
              f"{ttft * 1000:>6.0f} ms")
    return 0


if __name__ == "__main__":
    sys.exit(main())
