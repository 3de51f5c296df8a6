"""How much faster can continuous batching be than micro-batching on the benchmark's Poisson load?

A script, not a test: it measures and prints, asserting nothing about speed.

    OMP_WAIT_POLICY=PASSIVE .venv/bin/python -m scripts.bench.continuous_bound
    OMP_WAIT_POLICY=PASSIVE .venv/bin/python -m scripts.bench.continuous_bound --rate 0.5 --duration 75

Both schedulers run the same decode steps on this machine; what differs is how many rows a
step carries and how many prompt tokens they prefill. The script measures, on the slot
backend in this process, what the steps cost: a decode step of 1..8 rows at the load's mean
context (the positions its output tokens decode over, on average), what each position more
adds (the rows' K/V reads: a micro-batch's long answer decodes alone over ever more of them),
and a prefill pass as a cost per token (the slope through one-pass prefills of a few lengths)
plus one per pass (what a 1-row decode step costs besides its row). It then replays the
benchmark's schedule (the same seeded draws as ``python -m scripts.bench``) on a saturated
server:

* micro-batching: requests in arrival order, 8 to a batch, the batch's prompts prefilled
  unpadded (each row in its own slot) and decoding until its longest output ends, finished
  rows dropped (as the handler does);
* an ideal continuous batcher: every decode step carries all 8 slots, prompts prefilled
  without padding in chunks of ``--chunk`` tokens, each chunk in the same forward pass as a
  decode step of the other slots (as the scheduler runs them), no scheduling or serving cost
  at all. The pass costs the chunk's prefill plus its decode rows, each priced as a prompt
  token plus its K/V reads.

The ratio of the two bounds what continuous scheduling itself can gain on this load and
machine when both sides run the same decode steps. A third figure, the schedule's ideal
(:func:`simulate`), serves the requests as they arrive with the scheduler's own policy and no
cost besides the model: the served continuous server's throughput is held to it (the saturated
replay ignores the gaps between arrivals and the drain after the last, which no server avoids).
A second replay makes every step cost
what a 1-row step does: the limit of the schedule itself, however cheap extra rows become.
Both handlers run the slot backend's forward (micro-batching puts row ``i`` of a batch in slot
``i``), so these steps are what both serve with.
"""
from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path
from typing import Optional

import torch

from llama_engine.continuous import step_prefill_budget
from llama_engine.cpu import auto_dtype
from scripts.bench.plan import MODES, at_fixed_rate, poisson_lengths

ROOT = Path(__file__).resolve().parents[2]


def step_times(backend, rows_max: int, context: int, repeats: int) -> dict:
    """Median ms of a decode step with 1..rows_max rows, each row at ``context`` positions."""
    times = step_times_at(backend, [(rows, context) for rows in range(1, rows_max + 1)], repeats)
    return {rows: ms for (rows, _), ms in times.items()}


def kv_ms_per_position(backend, rows_max: int, near: int, far: int, repeats: int) -> float:
    """Ms a decode step adds for each cached position one of its rows reads (its K/V), from steps of
    1 and ``rows_max`` rows at ``near`` and at ``far`` positions, alternated."""
    if far <= near:
        return 0.0
    times = step_times_at(backend, [(rows, at) for rows in (1, rows_max) for at in (near, far)], repeats)
    added = sum(times[(rows, far)] - times[(rows, near)] for rows in (1, rows_max))
    return max(added / ((1 + rows_max) * (far - near)), 0.0)


def step_times_at(backend, cases, repeats: int) -> dict:
    """Median ms of a decode step for each ``(rows, context)`` of ``cases``: that many rows, each at
    ``context`` positions.

    The rows' lengths are set, not prefilled: a step's cost depends on how many cached positions
    it reads, not on what they hold. Each round runs every case, so a host whose speed drifts
    shifts them all alike."""
    samples = {case: [] for case in cases}
    for i in range(repeats + 1):
        for rows, context in samples:
            backend._lengths[:rows] = [context] * rows
            start = time.perf_counter()
            backend.decode_slots(list(range(rows)), [5] * rows)
            if i:
                samples[(rows, context)].append(time.perf_counter() - start)
    for slot in range(max(rows for rows, _ in samples)):
        backend.free_slot(slot)
    return {case: statistics.median(times) * 1e3 for case, times in samples.items()}


def prefill_rate(backend, small: int, large: int, repeats: int) -> float:
    """Prompt tokens/s that a prefill pass adds per token: the slope of a least-squares line through
    the median cost of one-pass prefills of ``small``, 2 ``small``, 4 ``small`` ... and ``large``
    tokens (alternated). What a pass costs besides its tokens is :func:`measure`'s ``pass_ms``."""
    sizes = sorted({min(small << i, large) for i in range(12) if small << i < 2 * large})
    ids = torch.randint(3, 2000, (large,), generator=torch.Generator().manual_seed(1)).tolist()
    samples = {n: [] for n in sizes}
    for i in range(repeats + 1):
        for n in sizes:
            backend.free_slot(0)
            start = time.perf_counter()
            backend.prefill_slot(0, ids[:n])
            if i:
                samples[n].append(time.perf_counter() - start)
    backend.free_slot(0)
    costs = [statistics.median(samples[n]) for n in sizes]
    per_token = statistics.linear_regression(sizes, costs).slope if len(sizes) > 1 else 0.0
    return 1 / per_token if per_token > 0 else sum(sizes) / sum(costs)


def decode_ms(step_ms: dict, contexts, kv_ms: float = 0.0, context: int = 0) -> float:
    """Ms of a decode step whose rows hold ``contexts`` cached positions: the step of that many rows
    measured at ``context`` positions each, plus ``kv_ms`` for each position more (or less) read."""
    return step_ms[len(contexts)] + kv_ms * (sum(contexts) - len(contexts) * context)


def replay(schedule, slots: int, step_ms: dict, prefill_tps: float, chunk: int, merged_ms: float,
           kv_ms: float = 0.0, context: int = 0, pass_ms: float = 0.0) -> dict:
    """Both schedulers on ``schedule``, saturated (arrivals ignored): see the module's account.

    A decode step costs :func:`decode_ms` of its rows' contexts (a request of ``inp`` prompt tokens
    decodes its ``s``-th token over ``inp + s`` positions); a prefill pass ``pass_ms`` plus its
    tokens at ``prefill_tps``."""
    tokens = sum(out for _, _, out in schedule)
    micro_decode = micro_prefill = micro_steps = 0.0
    for first in range(0, len(schedule), slots):
        batch = schedule[first:first + slots]
        longest = max(out for _, _, out in batch)
        micro_steps += longest
        micro_decode += sum(decode_ms(step_ms, [inp + s for _, inp, out in batch if out > s], kv_ms, context)
                            for s in range(longest)) / 1e3
        micro_prefill += sum(inp for _, inp, _ in batch) / prefill_tps + pass_ms / 1e3
    # A pass that prefills a chunk also decodes the other slots - 1 rows at ``merged_ms``.
    merged_steps = sum(-(-inp // chunk) for _, inp, _ in schedule)
    pure_steps = max(tokens - merged_steps * (slots - 1), 0) / slots
    positions = sum(out * inp + out * (out - 1) / 2 for _, inp, out in schedule)  # every token's context
    ideal_decode = (pure_steps * step_ms[slots] + merged_steps * merged_ms + kv_ms * (positions - tokens * context)) / 1e3
    ideal_prefill = sum(inp for _, inp, _ in schedule) / prefill_tps + merged_steps * pass_ms / 1e3
    micro_s, ideal_s = micro_decode + micro_prefill, ideal_decode + ideal_prefill
    return dict(requests=len(schedule), tokens=tokens, micro_rows_per_step=tokens / micro_steps,
                micro_decode_s=micro_decode, micro_prefill_s=micro_prefill, micro_tps=tokens / micro_s,
                ideal_decode_s=ideal_decode, ideal_prefill_s=ideal_prefill, ideal_tps=tokens / ideal_s,
                bound=micro_s / ideal_s)


def simulate(schedule, slots: int, step_ms: dict, prefill_tps: float, chunk: int, merged_ms: float,
             kv_ms: float = 0.0, context: int = 0, pass_ms: float = 0.0) -> dict:
    """An ideal continuous batcher serving ``schedule`` as it arrives: the schedule's ideal.

    The scheduler's policy (admit in arrival order into a free slot, prefill at most ``chunk``
    prompt tokens per step in admission order, ``chunk`` per slot while no stream decodes, each
    chunk in the same pass as one decode token for every slot whose prompt is done, a request's
    first token when its prompt completes) at the measured step costs (:func:`replay`'s), with
    no scheduling, serving or client cost at all. Unlike :func:`replay`, it pays for what the
    schedule imposes: steps with fewer rows while requests have yet to arrive, and the drain after
    the last arrival. Returns ``ideal_tps``: output tokens / (last completion - first arrival),
    the served throughput's definition.
    """
    pending = sorted(schedule)
    start = t = pending[0][0]
    active, tokens, finished, ttfts = [], 0, 0.0, []
    i = 0
    while i < len(pending) or active:
        while i < len(pending) and pending[i][0] <= t and len(active) < slots:
            arrival, prompt, out = pending[i]
            active.append({"arrival": arrival, "prompt": prompt, "length": prompt, "out": out, "made": 0})
            i += 1
        if not active:
            t = pending[i][0]
            continue
        decoding = [r for r in active if r["prompt"] == 0]
        budget, prefilled, completing = step_prefill_budget(chunk, slots, bool(decoding)), 0, []
        for r in active:
            if r["prompt"] and budget:
                take = min(r["prompt"], budget)
                r["prompt"] -= take
                budget -= take
                prefilled += take
                if r["prompt"] == 0:
                    completing.append(r)
        contexts = [r["length"] + r["made"] for r in decoding]
        if prefilled:
            cost = (pass_ms + merged_ms * len(decoding) / max(slots - 1, 1)
                    + kv_ms * (sum(contexts) - len(contexts) * context)) / 1e3 + prefilled / prefill_tps
        else:
            cost = decode_ms(step_ms, contexts, kv_ms, context) / 1e3
        t += cost
        ttfts += [t - r["arrival"] for r in completing]
        for r in decoding + completing:
            r["made"] += 1
            tokens += 1
        done = [r for r in active if r["made"] >= r["out"]]
        if done:
            finished = t
            active = [r for r in active if r["made"] < r["out"]]
    return dict(ideal_tps=tokens / (finished - start), ideal_s=finished - start, sim_tokens=tokens,
                p99_ttft_s=p99(ttfts))


def simulate_micro(schedule, slots: int, step_ms: dict, prefill_tps: float,
                   kv_ms: float = 0.0, context: int = 0, pass_ms: float = 0.0) -> dict:
    """Micro-batching serving ``schedule`` as it arrives, at the same step costs and with no other cost.

    When a batch ends, the next takes up to ``slots`` of the requests that have arrived by then
    (or waits for the next arrival), prefills their prompts unpadded in one pass (each request's
    first token comes at its end) and decodes until its longest output ends, finished rows
    dropped: the handler's micro-batching without ``maxBatchDelay`` or any serving cost.
    """
    pending = sorted(schedule)
    start = t = pending[0][0]
    tokens, ttfts, i = 0, [], 0
    while i < len(pending):
        t = max(t, pending[i][0])
        batch = []
        while i < len(pending) and pending[i][0] <= t and len(batch) < slots:
            batch.append(pending[i])
            i += 1
        t += sum(inp for _, inp, _ in batch) / prefill_tps + pass_ms / 1e3
        ttfts += [t - arrival for arrival, _, _ in batch]
        for made in range(1, max(out for _, _, out in batch)):
            t += decode_ms(step_ms, [inp + made for _, inp, out in batch if out > made], kv_ms, context) / 1e3
        tokens += sum(out for _, _, out in batch)
    return dict(tps=tokens / (t - start), p99_ttft_s=p99(ttfts))


def p99(values) -> float:
    """The 99th percentile as the bench's rows compute it (numpy's linear interpolation)."""
    import numpy as np

    return float(np.percentile(np.asarray(values, dtype=float), 99))


#: Decode passes of one row count the served round must have run for their mean to price that count.
MIN_PASSES = 5


def at_served_costs(bound: dict, forward: dict, schedule) -> Optional[dict]:
    """The schedule's ideal (:func:`simulate`) priced at the forward passes the served worker ran.

    ``bound`` is :func:`measure`'s (in this process, minutes away from the served round);
    ``forward`` the server's own ``llama_forward_*`` metrics over one round
    (``scrape_metrics.forward_passes``). On a host whose speed drifts between minutes, the
    in-process prices misstate the ideal by tens of percent; these are what the round's model
    work really cost, so served / this ideal is the scheduling, streaming and serving overhead
    alone. A decode step of ``r`` rows costs the server's mean decode pass of ``r`` rows (rows it
    ran fewer than :data:`MIN_PASSES` times: the in-process figure times the median served /
    in-process ratio of the others); prefill passes keep the in-process shape (prompt tokens /
    rate + merged decode rows), scaled so that the round's prefill passes cost what they did.
    ``micro_tps`` is micro-batching on the same arrivals at the same prices (:func:`simulate_micro`)
    and ``bound`` the ideal's tok/s over it: what the load allows at the costs this server ran, where
    the in-process ``bound`` holds step costs measured minutes away (a burst of a busy host had
    priced a 1-row step at 1.3-1.7x what the two servers then ran it at, and allowed 2.8x where these
    prices allow 2.0-2.3x). None without both decode and prefill passes to price.
    """
    slots, inproc = bound["slots"], {int(r): ms for r, ms in bound["step_ms"].items()}
    served = {int(r): 1000 * shape["seconds"] / shape["passes"] for r, shape in forward.get("decode", {}).items()
              if shape.get("passes", 0) >= MIN_PASSES and int(r) in inproc}
    prefill = forward.get("prefill", {}).values()
    tokens = sum(shape.get("prefill_tokens", 0) for shape in prefill)
    passes = sum(shape["passes"] for shape in prefill)
    merged_rows = sum(int(r) * shape["passes"] for r, shape in forward.get("prefill", {}).items())
    pass_ms = bound.get("pass_ms", 0.0)
    predicted_s = (tokens / bound["prefill_tokens_per_s"] + pass_ms / 1e3 * passes
                   + bound["merged_rows_ms"] / 1e3 * merged_rows / max(slots - 1, 1))
    if not served or predicted_s <= 0:
        return None
    decode_scale = statistics.median(served[r] / inproc[r] for r in served)
    prefill_scale = sum(shape["seconds"] for shape in prefill) / predicted_s
    step_ms = {r: served.get(r, ms * decode_scale) for r, ms in inproc.items()}
    tps, merged = bound["prefill_tokens_per_s"] / prefill_scale, bound["merged_rows_ms"] * prefill_scale
    # The served means already hold the round's contexts: no per-position term on top.
    pass_ms *= prefill_scale
    sim = simulate(schedule, slots, step_ms, tps, bound["chunk"], merged, pass_ms=pass_ms)
    micro = simulate_micro(schedule, slots, step_ms, tps, pass_ms=pass_ms)
    return dict(ideal_tps=sim["ideal_tps"], ideal_s=sim["ideal_s"], micro_tps=micro["tps"],
                bound=sim["ideal_tps"] / micro["tps"], step_ms=step_ms, prefill_tokens_per_s=tps,
                merged_rows_ms=merged, decode_scale=decode_scale, prefill_scale=prefill_scale,
                served_rows=sorted(served))


def load_backend(model: Path, dtype: str, slots: int, max_length: int):
    """The slot backend the steps are measured on (load it once for several schedules)."""
    from llama_engine.backends.torch_backend import TorchSlotBackend

    return TorchSlotBackend.from_pretrained(str(model), slots, max_length, dtype, "cpu")


def measure(backend, schedule, chunk: int, repeats: int = 7) -> dict:
    """Step costs measured on ``backend`` (:func:`load_backend`), and both schedulers' replays of ``schedule``.

    Returns :func:`replay`'s figures plus the measured ``step_ms`` (by rows, each row at ``context``
    positions: the mean over the load's output tokens of the positions each decodes over),
    ``kv_ms`` (what a step adds per position more), ``prefill_tokens_per_s`` and ``pass_ms`` (a
    prefill pass's cost besides its tokens), ``merged_rows_ms``, and ``flat_bound`` (the bound if a
    step cost the same with any number of rows: what the schedule alone allows).
    """
    slots = backend.max_slots
    for slot in range(slots):  # a backend measured before (the other load) still holds its rows
        backend.free_slot(slot)
    tokens = sum(out for _, _, out in schedule)
    context = round(sum(out * inp + out * (out - 1) / 2 for _, inp, out in schedule) / tokens)
    steps = step_times(backend, slots, context, repeats)
    shortest = min(inp for _, inp, _ in schedule)
    far = min(max(inp + out for _, inp, out in schedule), backend.max_length - 2)
    kv = kv_ms_per_position(backend, slots, shortest, far, repeats)
    tps = prefill_rate(backend, max(1, min(shortest, chunk // 4)), chunk, max(3, repeats // 2))
    # A pass costs something besides its rows (the weights streamed once, the layers' calls): what a
    # 1-row decode step costs besides its row and that row's K/V reads. The intercept of the line
    # through prefill costs had read 0-34 ms on the same CPU, the line's bend at small passes in it.
    pass_ms = max(steps[1] - 1e3 / tps - kv * context, 0.0)
    # Decode rows in a prefill pass cost what prompt rows do, plus their K/V reads: measured as the
    # difference of two passes of ~chunk rows, they were lost in the noise of either.
    merged = (slots - 1) * (1e3 / tps + kv * context)
    costs = dict(kv_ms=kv, context=context, pass_ms=pass_ms)
    r = replay(schedule, slots, steps, tps, chunk, merged, **costs)
    flat = replay(schedule, slots, {rows: steps[1] for rows in steps}, tps, chunk, 0.0, pass_ms=pass_ms)
    r = dict(r, saturated_ideal_tps=r["ideal_tps"], step_ms=steps, prefill_tokens_per_s=tps, merged_rows_ms=merged,
             chunk=chunk, slots=slots, flat_bound=flat["bound"], **costs)
    return dict(r, **on_arrivals(r, schedule))


def on_arrivals(bound: dict, schedule) -> dict:
    """The figures of :func:`measure`'s ``bound`` that depend on when the requests arrive, for ``schedule``.

    Both schedulers serve it as it arrives at the measured step costs: the ideal continuous batcher
    (:func:`simulate`: ``ideal_tps``, ``ideal_s``, ``ideal_p99_ttft_s``) and micro-batching
    (:func:`simulate_micro`: ``micro_arrivals_tps``, ``micro_p99_ttft_s``); ``p99_ttft_bound`` is their
    p99 TTFT ratio. The saturated replays ignore arrivals, so a re-paced schedule needs only these.
    """
    steps, tps, slots = bound["step_ms"], bound["prefill_tokens_per_s"], bound["slots"]
    costs = {key: bound.get(key, 0) for key in ("kv_ms", "context", "pass_ms")}
    sim = simulate(schedule, slots, steps, tps, bound["chunk"], bound["merged_rows_ms"], **costs)
    micro = simulate_micro(schedule, slots, steps, tps, **costs)
    return dict(ideal_tps=sim["ideal_tps"], ideal_s=sim["ideal_s"], ideal_p99_ttft_s=sim["p99_ttft_s"],
                micro_arrivals_tps=micro["tps"], micro_p99_ttft_s=micro["p99_ttft_s"],
                p99_ttft_bound=sim["p99_ttft_s"] / micro["p99_ttft_s"])


def steady_rate(bound: dict, utilization: float) -> dict:
    """The arrival rate at ``utilization`` of what micro-batching serves of ``bound``'s requests.

    ``bound`` is :func:`measure`'s on the requests themselves (their arrivals do not matter to it):
    its saturated micro-batching replay (``micro_tps``, every batch full and back to back) gives the
    requests/s micro-batching keeps up with at the step costs measured in this process.
    """
    capacity = bound["micro_tps"] * bound["requests"] / bound["tokens"]
    return dict(rate=round(utilization * capacity, 4), utilization=utilization,
                micro_capacity_per_s=round(capacity, 4), micro_tps=round(bound["micro_tps"], 2))


def served_capacity(output_tokens_per_s: float, schedule) -> float:
    """The requests/s of ``schedule`` (arrival s, prompt, output tokens) that a server streaming
    ``output_tokens_per_s`` keeps up with: its rate over the mean output tokens of a request."""
    return output_tokens_per_s * len(schedule) / sum(out for _, _, out in schedule)


def overload_rate(bound: dict, overload: float) -> dict:
    """The arrival rate at ``overload`` times what the ideal continuous batcher serves of ``bound``'s requests.

    Like :func:`steady_rate`, from the saturated replay (every slot busy every step, arrivals
    ignored): ``saturated_ideal_tps`` gives the requests/s the ideal serves at the step costs
    measured here; past it, every server's queue grows, and its throughput is its capacity.
    """
    capacity = bound["saturated_ideal_tps"] * bound["requests"] / bound["tokens"]
    return dict(rate=round(overload * capacity, 4), overload=overload, ideal_capacity_per_s=round(capacity, 4),
                saturated_ideal_tps=round(bound["saturated_ideal_tps"], 2))


def pace_for(bound: dict, load: dict) -> Optional[dict]:
    """The pace of a load given by ``requests`` (its ``utilization`` of micro-batching's capacity, or
    ``overload`` times the ideal continuous batcher's), or None for a load with a fixed rate."""
    if "requests" not in load:
        return None
    if load.get("utilization"):
        return steady_rate(bound, load["utilization"])
    if load.get("overload"):
        return overload_rate(bound, load["overload"])
    return None


def main(argv=None) -> int:
    plan = MODES["default"]
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--load", choices=["mixed", "wide", "steady"], default="mixed",
                   help="the bench's Poisson load: mixed (default) or wide (outputs spread widely), each paced "
                        "past the ideal continuous batcher's requests/s here, or steady (the mixed load's "
                        "lengths, paced to 60%% of micro-batching's)")
    p.add_argument("--dtype", choices=["float32", "bfloat16"], default=auto_dtype("cpu"),
                   help="default: what handler.dtype: auto picks on this CPU")
    p.add_argument("--model", type=Path, help="checkpoint (default: build/bench-model-<dtype>)")
    p.add_argument("--threads", type=int, default=2, help="torch threads (default 2)")
    p.add_argument("--slots", type=int, default=8, help="continuous-batching slots, the micro-batch too (default 8)")
    p.add_argument("--rate", type=float, help="arrivals per second (default: the load's in the full bench)")
    p.add_argument("--duration", type=float, help="seconds of arrivals (default: the load's in the full bench)")
    p.add_argument("--chunk", type=int, default=256, help="prefill tokens per step (max_prefill_tokens_per_step)")
    p.add_argument("--max-length", type=int, default=1024,
                   help="prompt + output tokens per request, as handler.max_length (default 1024)")
    p.add_argument("--repeats", type=int, default=7, help="timings per measured step cost; the median counts (default 7)")
    p.add_argument("--seed", type=int, default=0, help="the benchmark's --seed")
    args = p.parse_args(argv)
    args.model = args.model or ROOT / "build" / ("bench-model-bf16" if args.dtype == "bfloat16" else "bench-model-fp32")
    if not (args.model / "model.safetensors").exists():
        sys.exit(f"{args.model} is missing: python -m scripts.bench --quick builds it")

    torch.set_num_threads(args.threads)
    load = dict(plan[{"mixed": "poisson", "wide": "poisson_wide", "steady": "poisson_steady"}[args.load]])
    if args.duration:  # a fixed rate and duration instead of the load's requests
        load = at_fixed_rate(load, args.rate, args.duration)
    schedule = poisson_lengths(load, args.max_length, args.seed)
    r = measure(load_backend(args.model, args.dtype, args.slots, args.max_length), schedule, args.chunk, args.repeats)
    if "requests" in load:  # drawn at 1 request/s: paced as the bench paces it, unless --rate says
        pace = args.rate or pace_for(r, load)["rate"]
        schedule = [(t / pace, inp, out) for t, inp, out in schedule]
        r.update(on_arrivals(r, schedule))
        load.update(rate=round(pace, 3), duration=round(schedule[-1][0], 1))
    steps, tps, merged, context = r["step_ms"], r["prefill_tokens_per_s"], r["merged_rows_ms"], r["context"]
    print(f"{args.model.name}, {args.dtype}, {args.threads} threads, {args.slots} slots; load: {load['rate']} req/s "
          f"for {load['duration']} s, inputs {load['inputs']}, outputs {load['outputs']} (seed {args.seed}): "
          f"{r['requests']} requests, {r['tokens']} output tokens")
    print(f"decode step at {context} positions, ms by rows: "
          + ", ".join(f"{rows}: {ms:.1f}" for rows, ms in steps.items()))
    print(f"each position more a row reads adds {1e3 * r['kv_ms']:.2f} us to a step")
    print(f"a prefill pass: {r['pass_ms']:.1f} ms + its tokens at {tps:.0f} prompt tokens/s; {args.slots - 1} decode "
          f"rows in a pass of {args.chunk} prompt tokens add {merged:.1f} ms (a decode step alone: "
          f"{steps[args.slots - 1]:.1f} ms)")
    print(f"micro-batching: {r['micro_rows_per_step']:.2f} rows per decode step; decode {r['micro_decode_s']:.1f} s "
          f"+ prefill {r['micro_prefill_s']:.1f} s -> {r['micro_tps']:.1f} tok/s")
    print(f"saturated continuous ({args.slots} rows every step, no cost besides the model): decode "
          f"{r['ideal_decode_s']:.1f} s + prefill {r['ideal_prefill_s']:.1f} s -> {r['saturated_ideal_tps']:.1f} tok/s")
    print(f"the schedule's ideal (that batcher on the arrivals as they come, drain included): {r['ideal_s']:.1f} s "
          f"-> {r['ideal_tps']:.1f} tok/s (the served continuous server's yardstick)")
    print(f"continuous / micro throughput when both run these steps: at most {r['bound']:.2f}x")
    print(f"TTFT p99 on the arrivals, both without serving cost: the ideal {r['ideal_p99_ttft_s']:.1f} s, micro-batching "
          f"{r['micro_p99_ttft_s']:.1f} s ({r['micro_arrivals_tps']:.1f} tok/s): ratio {r['p99_ttft_bound']:.2f}")
    print(f"even if a step cost the same with 1 or {args.slots} rows (their K/V reads free, decode rows free in a "
          f"prefill pass): at most {r['flat_bound']:.2f}x; the rest is the schedule's (rows per step)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
