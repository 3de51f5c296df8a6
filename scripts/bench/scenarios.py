"""The measurements a bench run makes, each on the systems it is handed (runners: a function
of (prompts, max_new_tokens) -> request records, or of a Poisson schedule -> records):

* :func:`sweep`: one system's length sweep, TTFT probes, concurrency sweep and (for servers)
  the mixed Poisson run, a row per group of requests;
* :func:`ttft_probes`: the TTFT probes of every length taken in turn, a row per length;
* :func:`paired`: two systems on the same waves, alternated round by round, with their ratio;
* :func:`poisson_labels` and :func:`poisson_rates`: the labels and offered/served rates of a
  Poisson row;
* :func:`continuous_bounds`: ``scripts.bench.continuous_bound`` on each Poisson load, the
  ideal continuous batcher the served one is held to;
* :func:`round_trips`: the continuous handler's periodic timing lines from its log;
* :func:`brief`: a row as its log line says it.

Every row is a :func:`~scripts.bench.stats.summarize` of its records plus the CPU that other
processes took meanwhile (the machine's :class:`~scripts.bench.machine.CpuMonitor`).
"""
from __future__ import annotations

import re
import statistics
from pathlib import Path
from typing import List

from scripts.bench.plan import LOADS, POISSON_PLAN, SCENARIOS, Budget, Prompts, log
from scripts.bench.stats import summarize


def sweep(system: str, runner, prompts: Prompts, plan: dict, budget: Budget, runs: List[dict],
          monitor, schedule_runner=None, server=None) -> None:
    """Length sweep, TTFT probes, concurrency sweep and (for servers) the Poisson run.

    Before each group of requests: wait (up to ``plan["quiet_wait"]`` s) until the rest of the
    machine is quiet; after it, record how much CPU other processes took meanwhile. With
    ``server`` (a :class:`~scripts.bench.server_metrics.ServerMetrics`), each row also gets the
    server's own figures for it (``server``), from its metrics API before and after.
    """
    def measure(what, fn, **labels):
        quiet = monitor.wait_quiet(plan["quiet_wait"]) if plan["quiet_wait"] else None
        scraped = server.snapshot() if server is not None else None  # waits for the server to rest
        snap = monitor.snapshot()
        records = fn()
        run = summarize(records, system=system, **labels)
        run.update(monitor.since(snap))
        if server is not None:
            run["server"] = server.since(scraped, requests=len(records))
        if quiet is not None:
            run["quiet_wait"] = quiet
        runs.append(run)
        log(f"{system} {what}: {brief(run)}")
        return run, records

    scenarios = plan.get("scenarios", SCENARIOS)
    for (inp, out), items in (prompts.lengths.items() if "length" in scenarios else ()):
        if not budget.ok(f"{system} length {inp}"):
            return
        measure(f"length {inp}+{out}", lambda: [r for p in items for r in runner([p], out)],
                scenario="length", input_tokens=inp, output_tokens=out, concurrency=1)
    if "ttft" in scenarios and any(prompts.probes.values()) and budget.ok(f"{system} ttft probes"):
        ttft_probes(system, runner, prompts.probes, plan, runs, measure)
    for c in (plan["concurrency"] if "concurrency" in scenarios else ()):
        if not budget.ok(f"{system} concurrency {c}"):
            return
        run, records = measure(
            f"concurrency {c}", lambda: [x for r in range(plan["rounds"]) for x in runner(prompts.waves[(c, r)],
                                                                                           plan["conc_output"])],
            scenario="concurrency", input_tokens=plan["conc_input"], output_tokens=plan["conc_output"],
            concurrency=c, rounds=plan["rounds"])
        if run.get("ok") and plan["rounds"] > 1:
            # rounds run one after the other: rates are per round (its own wall time), averaged
            per_round = [summarize(part) for part in split(records, c)]
            rates = [x["output_tokens_per_s"] for x in per_round if x.get("output_tokens_per_s")]
            seq = [x["throughput_seq_tokens_per_s"] for x in per_round if x.get("throughput_seq_tokens_per_s")]
            if rates:
                run["output_tokens_per_s"] = round(sum(rates) / len(rates), 3)
                run["output_tokens_per_s_rounds"] = rates
                run["throughput_seq_tokens_per_s"] = round(sum(seq) / len(seq), 3)
    if schedule_runner is not None and "poisson" in scenarios and prompts.schedule and budget.ok(f"{system} poisson", 30):
        p = prompts.load_plan(plan, "mixed")
        run, _ = measure(f"poisson {p['rate']}/s for {p['duration']} s", lambda: schedule_runner(prompts.schedule),
                         **poisson_labels(p, prompts.schedule))
        if run.get("ok"):
            run.update(poisson_rates(run["ok"], run["wall_s"], prompts.schedule))


def ttft_probes(system: str, runner, probes: dict, plan: dict, runs: List[dict], measure) -> None:
    """The TTFT probes of every length taken in turn (256, 512, 768, 256, ...), then a row per length.

    On a host whose speed drifts between minutes, probes of one length after another would put the
    drift into TTFT(768) / TTFT(256); taken in turn, each length sees the same minutes.
    """
    by_length: dict = {inp: [] for inp in probes}

    def take_turns():
        for k in range(max(len(items) for items in probes.values())):
            for inp, items in probes.items():
                if k < len(items):
                    by_length[inp] += runner([items[k]], plan["probe_tokens"])
        return [r for records in by_length.values() for r in records]

    whole, records = measure("ttft probes, lengths in turn", take_turns, scenario="ttft-all", concurrency=1)
    runs.remove(whole)
    # the machine's figures over all the probes (other processes' CPU, the quiet wait) go to every row
    machine = {k: v for k, v in whole.items() if k not in summarize(records, system=system, scenario="ttft-all", concurrency=1)
               and k != "server"}
    for inp, records in by_length.items():
        run = summarize(records, system=system, scenario="ttft", input_tokens=inp,
                        output_tokens=plan["probe_tokens"], concurrency=1)
        run.update(machine)
        runs.append(run)
        log(f"{system} ttft probe {inp}: {brief(run)}")


def poisson_labels(p: dict, schedule, load: str = "mixed") -> dict:
    """The labels of a Poisson run: its load, and the schedule's mean input and output tokens."""
    n = len(schedule)
    return dict(scenario="poisson", load=load, concurrency=None, rate_per_s=p["rate"], duration_s=p["duration"],
                input_choices=p["inputs"], output_choices=p["outputs"],
                input_tokens=round(sum(len(x[1]) for x in schedule) / n, 1),
                output_tokens=round(sum(x[2] for x in schedule) / n, 1))


def poisson_rates(ok: int, wall_s: float, schedule) -> dict:
    """Offered vs served: a server that cannot keep up finishes long after the last arrival."""
    last = schedule[-1][0]
    return dict(offered_rate_per_s=round(len(schedule) / last, 3), completed_rate_per_s=round(ok / wall_s, 3),
                drain_s=round(wall_s - last, 2))


def paired(first, second, prompts: Prompts, plan: dict, runs: List[dict], monitor, *, scenario: str = "paired",
           ratio: str = "served_over_inprocess", concurrency=None, efficiency=None) -> None:
    """The same waves on two systems, alternated A/B, B/A, ...: ``first`` and ``second`` are (name, runner).

    The machine's speed drifts between minutes (other processes, other VMs on the host); a ratio
    of two sweeps minutes apart carries that drift, a ratio of back-to-back waves much less.
    Both systems stay loaded (the idle one waits) and the order alternates. Each system gets a
    ``scenario`` row per concurrency; ``<ratio>`` holds second / first per round and
    ``<ratio>_median`` their median.

    ``efficiency``, ``(bandwidth sampler in GB/s, weight bytes per token)``, brackets each round at
    1 stream with memory-bandwidth samples: each system's batch-1 decode efficiency per round is
    its decode tok/s x bytes per token / the mean of the samples before and after that round
    (``decode_efficiency_rounds``, ``decode_efficiency_median``), so that the bandwidth it is held
    to is the machine's in that minute, not its best of the run.
    """
    for c in (plan["paired_concurrency"] if concurrency is None else concurrency):
        if (c, 0) not in prompts.waves:
            continue
        items, n = prompts.waves[(c, 0)], plan["conc_output"]
        records = {first[0]: [], second[0]: []}
        ratios = []
        sample_bandwidth, bytes_per_token = efficiency if efficiency and c == 1 else (None, None)
        bandwidth = [sample_bandwidth()] if sample_bandwidth else []
        efficiencies = {first[0]: [], second[0]: []}
        snap = monitor.snapshot()
        for k in range(plan["paired_rounds"]):
            rates, decode = {}, {}
            for name, runner in ((first, second) if k % 2 == 0 else (second, first)):
                wave = runner(items, n)
                records[name] += wave
                rates[name] = summarize(wave).get("output_tokens_per_s")
                decode[name] = wave[0].decode_tokens_per_s() if wave and wave[0].ok else None
            if rates[first[0]] and rates[second[0]]:
                ratios.append(round(rates[second[0]] / rates[first[0]], 4))
            if sample_bandwidth:
                bandwidth.append(sample_bandwidth())
                gb_per_s = (bandwidth[-2] + bandwidth[-1]) / 2
                for name, rate in decode.items():
                    if rate:
                        efficiencies[name].append(round(rate * bytes_per_token / (gb_per_s * 1e9), 4))
        contention = monitor.since(snap)
        for name, recs in records.items():
            run = summarize(recs, system=name, scenario=scenario, input_tokens=plan["conc_input"], output_tokens=n,
                            concurrency=c, rounds=plan["paired_rounds"])
            per_round = [summarize(part).get("output_tokens_per_s") for part in split(recs, c)]
            per_round = [x for x in per_round if x]
            if per_round:
                run["output_tokens_per_s"] = round(sum(per_round) / len(per_round), 3)
                run["output_tokens_per_s_rounds"] = per_round
                # every request of a paired wave has the same lengths: the convention follows per round
                run["throughput_seq_tokens_per_s"] = round(run["output_tokens_per_s"] * (plan["conc_input"] + n) / n, 3)
            run.update(contention, **{ratio: ratios, f"{ratio}_median": statistics.median(ratios) if ratios else None})
            if efficiencies[name]:
                run.update(decode_efficiency_rounds=efficiencies[name], bandwidth_gb_per_s_rounds=bandwidth,
                           decode_efficiency_median=statistics.median(efficiencies[name]))
            runs.append(run)
        log(f"{scenario} A/B at {c} streams: {second[0]} / {first[0]} per round {ratios}")


def split(records, size):
    """Records in runs of ``size``: the rounds of a wave, one after the other."""
    return [records[i:i + size] for i in range(0, len(records), size)]


def brief(run: dict) -> str:
    """A row's figures for its log line."""
    if not run.get("ok"):
        return f"FAILED {run.get('error_samples')}"
    ttft = run["ttft_ms"]["p50"]
    return (f"TTFT p50 {ttft:.0f} ms, ITL p50 {(run['itl_ms'] or {}).get('p50', 0):.1f} ms, "
            f"{run['output_tokens_per_s']:.1f} tok/s, {run['ok']}/{run['requests']} ok, "
            f"other processes {100 * run.get('foreign_cpu_share', 0):.0f}% of the CPUs")


def continuous_bounds(cb_cfg, checkpoint: Path, dtype: str, prompts: Prompts, plan: dict, threads: int) -> dict:
    """``scripts.bench.continuous_bound`` on each Poisson load, with the continuous config's slots and
    prefill budget: the ideal continuous batcher's tok/s (``ideal_tps``) that the served one is held to."""
    import torch

    from scripts.bench.continuous_bound import load_backend, measure, on_arrivals, pace_for

    torch.set_num_threads(threads)
    backend = load_backend(checkpoint, dtype, cb_cfg.slots, cb_cfg.handler.max_length)
    out = {}
    for load in LOADS:
        schedule = lengths_of(prompts.schedules[load])
        if not schedule:
            continue
        out[load] = measure(backend, schedule, cb_cfg.continuous_batching.max_prefill_tokens_per_step)
        pace = None if load in prompts.rates else pace_for(out[load], plan[POISSON_PLAN[load]])
        if pace:
            prompts.pace(load, pace["rate"])
            out[load].update(on_arrivals(out[load], lengths_of(prompts.schedules[load])), pace=pace)
            log(f"{load} load paced at {pace['rate']:.3f} requests/s: " + (
                f"{pace['utilization']:.0%} of micro-batching's {pace['micro_capacity_per_s']:.3f}/s"
                if "utilization" in pace else
                f"{pace['overload']:.2f}x the ideal continuous batcher's {pace['ideal_capacity_per_s']:.3f}/s")
                + " at the step costs measured here")
        log(f"continuous bound, {load} load: ideal {out[load]['ideal_tps']:.1f} tok/s, micro-batching replay "
            f"{out[load]['micro_tps']:.1f} tok/s, at most {out[load]['bound']:.2f}x; p99 TTFT ideal / micro "
            f"{out[load]['p99_ttft_bound']:.2f}")
    return out


def lengths_of(schedule) -> List[tuple]:
    """A schedule of prompts as (arrival s, input tokens, output tokens)."""
    return [(t, len(ids), n) for t, ids, n in schedule]


ROUND_TRIP_LINE = re.compile(r"continuous batching: (\d+) calls, ([\d.]+) ms in the handler "
                             r"\(([\d.]+) ms of it (?:in scheduler steps|waiting for a step)\) "
                             r"and ([\d.]+) ms in the frontend round trip per call")


def round_trips(model_log: str) -> List[dict]:
    """The continuous handler's periodic lines (``RoundTrips`` in the handler): calls, ms per call
    inside it (and of that in scheduler steps) and between calls."""
    return [{"calls": int(m[1]), "handler_ms": float(m[2]), "step_ms": float(m[3]), "round_trip_ms": float(m[4])}
            for m in ROUND_TRIP_LINE.finditer(model_log)]
