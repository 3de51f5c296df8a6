"""How long a long prompt's admission stalls the streams already running, per prefill budget.

Continuous batching admits a request between decode steps; its prefill runs in the step, so
every running stream waits for it (a longer gap between two of its tokens). The scheduler's
``max_prefill_tokens_per_step`` splits a long prompt into chunks over several steps. This
script runs ``--running`` streams, lets them settle, then admits one ``--prompt-tokens``
prompt and reports, for each budget: the longest step while the prompt was prefilled (the
worst inter-token gap a running stream saw), the median step before it, and the new
request's time to first token.

With ``--burst N`` it measures the other side of the trade instead: N prompts arriving
together at an idle scheduler of N slots, each generating ``--new-tokens``; per budget, the
output tokens/s and the TTFT p50 and max (medians over ``--rounds``, the budgets alternated).
With no stream running a step takes the budget once per slot, so a budget of the prompt's
tokens prefills the whole burst in one step, as a static batch would; a budget of 1/N of it
prefills the first prompt alone, and the others at that budget a step beside it.

Usage: python -m scripts.bench.measure_prefill_stall [--model build/bench-model-fp32] [--threads 2]
       python -m scripts.bench.measure_prefill_stall --burst 8 --prompt-tokens 256 --budgets 32 256
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


def measure_burst(scheduler, prompt_ids, burst: int, new_tokens: int, budget: int):
    """``burst`` prompts submitted at once, stepped to the end: (output tok/s, TTFT p50, TTFT max)."""
    from llama_engine import GenerationRequest, SamplingParams
    from llama_engine.engine import PreparedRequest

    scheduler.max_prefill_tokens_per_step = budget
    request = GenerationRequest("x", SamplingParams(max_new_tokens=new_tokens))
    started, first = time.perf_counter(), {}

    def on_event(event, index):
        if event.token_id is not None:
            first.setdefault(index, time.perf_counter() - started)

    for index in range(burst):
        scheduler.submit(PreparedRequest(request, prompt_ids, new_tokens), lambda e, i=index: on_event(e, i))
    while scheduler.step():
        pass
    elapsed = time.perf_counter() - started
    return burst * new_tokens / elapsed, statistics.median(first.values()), max(first.values())


def report_burst(scheduler, prompt_ids, args) -> None:
    print(f"{args.model.name} ({args.dtype}), {args.threads} threads, {args.burst} prompts of "
          f"{args.prompt_tokens} tokens arriving together, {args.new_tokens} new tokens each, "
          f"medians of {args.rounds} rounds")
    measure_burst(scheduler, prompt_ids, args.burst, 4, args.budgets[0])  # warm-up
    runs = {budget: [] for budget in args.budgets}
    for round_index in range(args.rounds):
        order = args.budgets if round_index % 2 == 0 else args.budgets[::-1]
        for budget in order:
            runs[budget].append(measure_burst(scheduler, prompt_ids, args.burst, args.new_tokens, budget))
    print(f"{'budget':>8} {'tok/s':>8} {'TTFT p50':>9} {'TTFT max':>9}")
    for budget, samples in runs.items():
        tok_s, p50, worst = (statistics.median(column) for column in zip(*samples))
        print(f"{budget:>8} {tok_s:>8.1f} {p50 * 1000:>6.0f} ms {worst * 1000:>6.0f} ms")


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
    parser.add_argument("--burst", type=int, default=0,
                        help="measure N prompts arriving together instead of one admitted among running streams")
    parser.add_argument("--new-tokens", type=int, default=128, help="tokens each burst request generates (default 128)")
    parser.add_argument("--rounds", type=int, default=3, help="burst rounds per budget, alternated (default 3)")
    args = parser.parse_args(argv)
    if args.burst < 0 or args.new_tokens < 1 or args.rounds < 1:
        parser.error("--burst must be >= 0, --new-tokens and --rounds >= 1")

    import torch
    from transformers import AutoTokenizer

    from llama_engine.backends.torch_backend import TorchSlotBackend
    from llama_engine.continuous import ContinuousScheduler

    torch.set_num_threads(args.threads)
    tokenizer = AutoTokenizer.from_pretrained(args.model)
    # a burst's prompts and their new tokens; else the 16 + 400 running streams and the prompt's first token
    length = args.prompt_tokens + args.new_tokens if args.burst else max(args.prompt_tokens + 1, 16 + 400)
    slots = args.burst or args.running + 1
    backend = TorchSlotBackend.from_pretrained(str(args.model), slots, max_length=length, dtype=args.dtype)
    scheduler = ContinuousScheduler(backend, tokenizer, max_queue=slots)
    filler = tokenizer(" the", add_special_tokens=False)["input_ids"][-1]
    prompt_ids = [filler] * args.prompt_tokens
    if args.burst:
        report_burst(scheduler, prompt_ids, args)
        return 0
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
