#!/usr/bin/env python3
"""Benchmark suite: the engine in-process, the served handler and installed peers, side by side.

    python -m scripts.bench --quick        # about 2 minutes on 2 cores
    python -m scripts.bench                # about 40 minutes: the full sweeps, peers included
    python -m scripts.bench --smoke --out /tmp/b   # seconds, the embedded tiny model (the test's mode)
    python -m scripts.bench --quick --systems llama.cpp,vllm   # only the peers (built by make bench-peers)
    python scripts/bench/run.py --quick    # the same, as a script

One run: build (or reuse) the benchmark model, measure the memory bandwidth, run the sweeps
(input length at concurrency 1, concurrency 1..16, a mixed-length Poisson arrival run) on the
engine in-process, then through TorchServe, then on each installed peer, each alone on the
machine, with the same prompts and the same client. Writes ``results-<timestamp>.json``,
``latest.json``, ``results.md`` and PNG plots to ``--out`` (default ``build/bench``), and
rewrites ``docs/benchmarks.md`` (not in ``--smoke``). Speeds are reported, never asserted.
"""
from __future__ import annotations

import argparse
import datetime as _dt
import os
import random
import re
import shlex
import statistics
import sys
import time
import traceback
from pathlib import Path
from typing import Dict, List, Optional

from llama_engine.cpu import auto_dtype
from scripts.bench import machine, model as bench_model, report
from scripts.bench.membw import read_bandwidth
from scripts.bench.prompts import PromptFactory
from scripts.bench.stats import summarize
from scripts.streaming_client import run_schedule, run_wave

ROOT = Path(__file__).resolve().parents[2]

#: The second Poisson load: most answers short, one in five long. A micro-batch runs until its
#: longest answer ends, so its rows sit idle most of their steps; continuous batching refills them.
WIDE = dict(rate=1.0, duration=40.0, inputs=[64, 128, 256], outputs=[8, 16, 32, 64, 512])
WIDE_QUICK = dict(rate=1.0, duration=15.0, inputs=[64, 128, 256], outputs=[8, 16, 32, 256])
LOADS = ("mixed", "wide")

# (input tokens, output tokens) pairs; every length pair runs at concurrency 1.
MODES = {
    "smoke": dict(
        model="tiny", dtype="float32", lengths=[(32, 8), (96, 8)], length_repeats=2, ttft_probes=0, probe_tokens=0,
        concurrency=[4], conc_input=32, conc_output=8, rounds=1,
        poisson=dict(rate=4.0, duration=2.0, inputs=[16, 32, 64], outputs=[4, 8]), poisson_rounds=1,
        poisson_wide=dict(rate=4.0, duration=1.5, inputs=[16, 32], outputs=[2, 4, 24]), bound=False,
        membw_gb=0.25, paired_rounds=2, paired_concurrency=[1, 4], quiet_wait=0, quiet_budget=0, peers=False, fp32_decode=False, max_minutes=4, request_timeout=120, docs=False),
    "quick": dict(
        model="bench", dtype="auto", lengths=[(256, 32), (768, 32)], length_repeats=3, ttft_probes=0,
        probe_tokens=0, concurrency=[1, 2, 4, 8, 16], conc_input=128, conc_output=32, rounds=1,
        poisson=dict(rate=1.0, duration=20.0, inputs=[64, 128, 256, 512], outputs=[16, 32, 64]), poisson_rounds=1,
        poisson_wide=WIDE_QUICK, bound=True,
        membw_gb=1.0, paired_rounds=3, paired_concurrency=[1, 8], quiet_wait=10, quiet_budget=60, peers=True, fp32_decode=False, max_minutes=10, request_timeout=300, docs=True),
    "default": dict(
        model="bench", dtype="auto", lengths=[(256, 768), (512, 512), (768, 256)], length_repeats=1,
        ttft_probes=4, probe_tokens=8, concurrency=[1, 2, 4, 8, 16], conc_input=256, conc_output=128, rounds=2,
        poisson=dict(rate=1.0, duration=60.0, inputs=[128, 256, 512, 768], outputs=[32, 64, 128, 256]),
        poisson_rounds=2, poisson_wide=WIDE, bound=True,
        membw_gb=2.0, paired_rounds=3, paired_concurrency=[1, 8], quiet_wait=30, quiet_budget=300, peers=True, fp32_decode=True, max_minutes=50, request_timeout=900, docs=True),
}


def log(msg: str) -> None:
    print(f"[bench {time.strftime('%H:%M:%S')}] {msg}", flush=True)


class Budget:
    def __init__(self, minutes: float):
        self.deadline = time.monotonic() + minutes * 60

    def left(self) -> float:
        return self.deadline - time.monotonic()

    def ok(self, what: str, need: float = 0.0) -> bool:
        if self.left() > need:
            return True
        log(f"skipping {what}: out of the time budget (--max-minutes)")
        return False


class Prompts:
    """Every system gets the very same prompts: drawn once, up front, from a seeded factory."""

    def __init__(self, factory: PromptFactory, plan: dict, max_length: int, seed: int):
        self.lengths = {(i, o): [factory.make(i) for _ in range(plan["length_repeats"])] for i, o in plan["lengths"]}
        self.probes = {i: [factory.make(i) for _ in range(plan["ttft_probes"])] for i, _ in plan["lengths"]}
        self.waves = {(c, r): [factory.make(plan["conc_input"]) for _ in range(c)]
                      for c in plan["concurrency"] for r in range(plan["rounds"])}
        self.warm = factory.make(16)
        self.schedules = {load: [(t, factory.make(inp), out) for t, inp, out in
                                 poisson_lengths(plan[POISSON_PLAN[load]], max_length, seed)] for load in LOADS}
        self.schedule = self.schedules["mixed"]


POISSON_PLAN = {"mixed": "poisson", "wide": "poisson_wide"}


def poisson_lengths(p: dict, max_length: int, seed: int) -> List[tuple]:
    """The Poisson schedule's (arrival s, input tokens, output tokens), drawn from ``seed``."""
    rng = random.Random(seed + 1)
    t, schedule = 0.0, []
    while True:
        t += rng.expovariate(p["rate"])
        if t > p["duration"]:
            return schedule
        inp = rng.choice(p["inputs"])
        schedule.append((t, inp, rng.choice([o for o in p["outputs"] if inp + o <= max_length] or [1])))


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
        snap = monitor.snapshot()
        scraped = server.snapshot() if server is not None else None
        records = fn()
        run = summarize(records, system=system, **labels)
        run.update(monitor.since(snap))
        if server is not None:
            run["server"] = server.since(scraped, requests=len(records))
        if quiet is not None:
            run["quiet_wait"] = quiet
        runs.append(run)
        log(f"{system} {what}: {_brief(run)}")
        return run, records

    scenarios = plan.get("scenarios", SCENARIOS)
    for (inp, out), items in (prompts.lengths.items() if "length" in scenarios else ()):
        if not budget.ok(f"{system} length {inp}"):
            return
        measure(f"length {inp}+{out}", lambda: [r for p in items for r in runner([p], out)],
                scenario="length", input_tokens=inp, output_tokens=out, concurrency=1)
    for inp, items in (prompts.probes.items() if "ttft" in scenarios else ()):
        if not items or not budget.ok(f"{system} ttft {inp}"):
            continue
        measure(f"ttft probe {inp}", lambda: [r for p in items for r in runner([p], plan["probe_tokens"])],
                scenario="ttft", input_tokens=inp, output_tokens=plan["probe_tokens"], concurrency=1)
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
            per_round = [summarize(part) for part in _split(records, c)]
            rates = [x["output_tokens_per_s"] for x in per_round if x.get("output_tokens_per_s")]
            seq = [x["throughput_seq_tokens_per_s"] for x in per_round if x.get("throughput_seq_tokens_per_s")]
            if rates:
                run["output_tokens_per_s"] = round(sum(rates) / len(rates), 3)
                run["output_tokens_per_s_rounds"] = rates
                run["throughput_seq_tokens_per_s"] = round(sum(seq) / len(seq), 3)
    if schedule_runner is not None and "poisson" in scenarios and prompts.schedule and budget.ok(f"{system} poisson", 30):
        p = plan["poisson"]
        run, _ = measure(f"poisson {p['rate']}/s for {p['duration']} s", lambda: schedule_runner(prompts.schedule),
                         **poisson_labels(p, prompts.schedule))
        if run.get("ok"):
            run.update(poisson_rates(run["ok"], run["wall_s"], prompts.schedule))


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
           ratio: str = "served_over_inprocess", concurrency=None) -> None:
    """The same waves on two systems, alternated A/B, B/A, ...: ``first`` and ``second`` are (name, runner).

    The machine's speed drifts between minutes (other processes, other VMs on the host); a ratio
    of two sweeps minutes apart carries that drift, a ratio of back-to-back waves much less.
    Both systems stay loaded (the idle one waits) and the order alternates. Each system gets a
    ``scenario`` row per concurrency; ``<ratio>`` holds second / first per round and
    ``<ratio>_median`` their median.
    """
    for c in (plan["paired_concurrency"] if concurrency is None else concurrency):
        if (c, 0) not in prompts.waves:
            continue
        items, n = prompts.waves[(c, 0)], plan["conc_output"]
        records = {first[0]: [], second[0]: []}
        ratios = []
        snap = monitor.snapshot()
        for k in range(plan["paired_rounds"]):
            rates = {}
            for name, runner in ((first, second) if k % 2 == 0 else (second, first)):
                wave = runner(items, n)
                records[name] += wave
                rates[name] = summarize(wave).get("output_tokens_per_s")
            if rates[first[0]] and rates[second[0]]:
                ratios.append(round(rates[second[0]] / rates[first[0]], 4))
        contention = monitor.since(snap)
        for name, recs in records.items():
            run = summarize(recs, system=name, scenario=scenario, input_tokens=plan["conc_input"], output_tokens=n,
                            concurrency=c, rounds=plan["paired_rounds"])
            per_round = [summarize(part).get("output_tokens_per_s") for part in _split(recs, c)]
            per_round = [x for x in per_round if x]
            if per_round:
                run["output_tokens_per_s"] = round(sum(per_round) / len(per_round), 3)
                run["output_tokens_per_s_rounds"] = per_round
                # every request of a paired wave has the same lengths: the convention follows per round
                run["throughput_seq_tokens_per_s"] = round(run["output_tokens_per_s"] * (plan["conc_input"] + n) / n, 3)
            run.update(contention, **{ratio: ratios, f"{ratio}_median": statistics.median(ratios) if ratios else None})
            runs.append(run)
        log(f"{scenario} A/B at {c} streams: {second[0]} / {first[0]} per round {ratios}")


def _split(records, size):
    return [records[i:i + size] for i in range(0, len(records), size)]


def _brief(run: dict) -> str:
    if not run.get("ok"):
        return f"FAILED {run.get('error_samples')}"
    ttft = run["ttft_ms"]["p50"]
    return (f"TTFT p50 {ttft:.0f} ms, ITL p50 {(run['itl_ms'] or {}).get('p50', 0):.1f} ms, "
            f"{run['output_tokens_per_s']:.1f} tok/s, {run['ok']}/{run['requests']} ok, "
            f"other processes {100 * run.get('foreign_cpu_share', 0):.0f}% of the CPUs")


SYSTEMS = ("inprocess", "torchserve", "torchserve-continuous", "llama.cpp", "llama.cpp-q8_0", "vllm")
SCENARIOS = ("length", "ttft", "concurrency", "paired", "poisson", "poisson-wide")


def parse_systems(value: str) -> List[str]:
    """``--systems``: a comma-separated subset of SYSTEMS, in SYSTEMS' order."""
    names = [n.strip() for n in value.split(",") if n.strip()]
    unknown = [n for n in names if n not in SYSTEMS]
    if unknown or not names:
        raise argparse.ArgumentTypeError(f"unknown system(s) {', '.join(unknown) or '(none)'}; choose from {', '.join(SYSTEMS)}")
    return [n for n in SYSTEMS if n in names]


def parse_scenarios(value: str) -> List[str]:
    """``--scenarios``: a comma-separated subset of SCENARIOS."""
    names = [n.strip() for n in value.split(",") if n.strip()]
    unknown = [n for n in names if n not in SCENARIOS]
    if unknown or not names:
        raise argparse.ArgumentTypeError(f"unknown scenario(s) {', '.join(unknown) or '(none)'}; "
                                         f"choose from {', '.join(SCENARIOS)}")
    return [n for n in SCENARIOS if n in names]


def derived_config(base: Path, out: Path, dtype: str, threads: Optional[int], overrides: dict) -> Path:
    import yaml

    from llama_engine import load_model_config_file

    data = yaml.safe_load(base.read_text())
    data["handler"]["dtype"] = dtype
    if threads:
        data["handler"]["torch_threads"] = threads
    data["handler"].update(overrides)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(f"# derived by scripts/bench from {base.relative_to(ROOT) if base.is_relative_to(ROOT) else base}\n"
                   + yaml.safe_dump(data, sort_keys=False))
    load_model_config_file(str(out))  # the project's validation
    return out


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    mode = parser.add_mutually_exclusive_group()
    mode.add_argument("--quick", action="store_true", help="fewer, shorter runs (about 2 minutes here)")
    mode.add_argument("--smoke", action="store_true", help="the tiny model, seconds of load (used by the tests)")
    parser.add_argument("--out", type=Path, default=ROOT / "build" / "bench", help="results directory")
    parser.add_argument("--config", type=Path, default=ROOT / "model-config" / "bench-llama.yaml")
    parser.add_argument("--continuous-config", type=Path, default=ROOT / "model-config" / "bench-llama-continuous.yaml",
                        help="the continuous-batching variant served as torchserve-continuous")
    parser.add_argument("--dtype", choices=["auto", "bfloat16", "float32"],
                        help="variant to serve (default: the mode's; auto is what handler.dtype: auto picks on this CPU)")
    parser.add_argument("--threads", type=int, help="torch threads (default: the config's handler.torch_threads)")
    parser.add_argument("--tiny", type=Path, default=ROOT / "build" / "tiny-llama",
                        help="the embedded tiny model: the tokenizer source, and the model of --smoke")
    parser.add_argument("--docs", type=Path, help="Markdown page to rewrite (default docs/benchmarks.md, not in --smoke)")
    parser.add_argument("--no-docs", action="store_true")
    parser.add_argument("--no-peers", action="store_true", help="do not start installed peers")
    parser.add_argument("--systems", type=parse_systems, default=list(SYSTEMS), metavar="A,B",
                        help=f"run only these ({', '.join(SYSTEMS)}; default all); a subset does not "
                             "rewrite the docs page unless --docs names it")
    parser.add_argument("--scenarios", type=parse_scenarios, default=list(SCENARIOS), metavar="A,B",
                        help=f"run only these ({', '.join(SCENARIOS)}; default all); a subset does not rewrite "
                             "the docs page unless --docs names it")
    parser.add_argument("--poisson-rate", type=float, help="Poisson arrivals per second (default: the mode's)")
    parser.add_argument("--poisson-duration", type=float, help="seconds of Poisson arrivals (default: the mode's)")
    parser.add_argument("--poisson-rounds", type=int, help="alternating rounds of the two TorchServe variants")
    parser.add_argument("--llama-gguf", type=Path, help="GGUF of the bench model for llama-server")
    parser.add_argument("--max-minutes", type=float, help="time budget; later phases are skipped past it")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--render", type=Path, metavar="JSON",
                        help="measure nothing: rewrite the Markdown, plots (and --docs) from a results JSON")
    args = parser.parse_args(argv)

    if args.render is not None:
        import json

        results = json.loads(args.render.read_text())
        results["ratios"] = report.ratios(results)
        docs = None if args.no_docs else (args.docs or (ROOT / "docs" / "benchmarks.md"
                                                        if results["mode"] != "smoke" else None))
        out = args.out.resolve()
        written = report.write_all(results, out, docs)
        log(f"re-rendered {args.render}: {', '.join(str(p) for p in written)}")
        return 0

    mode_name = "smoke" if args.smoke else "quick" if args.quick else "default"
    plan = dict(MODES[mode_name])
    plan["scenarios"] = args.scenarios
    plan["poisson"] = dict(plan["poisson"])
    if args.poisson_rate:
        plan["poisson"]["rate"] = args.poisson_rate
    if args.poisson_duration:
        plan["poisson"]["duration"] = args.poisson_duration
    if args.poisson_rounds:
        plan["poisson_rounds"] = args.poisson_rounds
    dtype = args.dtype or plan["dtype"]
    if dtype == "auto":
        dtype = auto_dtype("cpu")
    budget = Budget(args.max_minutes or plan["max_minutes"])
    out = args.out.resolve()
    work = out / "work"
    out.mkdir(parents=True, exist_ok=True)
    # torchserve, torch-model-archiver and the worker's python come from this interpreter's bin
    os.environ["PATH"] = f"{Path(sys.executable).parent}:{os.environ.get('PATH', '')}"
    started = time.perf_counter()
    stamp = _dt.datetime.now(_dt.timezone.utc).strftime("%Y%m%dT%H%M%SZ")
    phases: Dict[str, float] = {}
    results = {
        "schema": "llama-torchserve-bench/1", "timestamp": stamp, "mode": mode_name,
        "command": " ".join(["python -m scripts.bench"] + [shlex.quote(a) for a in (argv if argv is not None else sys.argv[1:])]),
        "machine": {**machine.machine_info(), "load_average_at_start": os.getloadavg()}, "versions": machine.versions(),
        "plan": {k: v for k, v in plan.items() if k not in ("docs",)}, "systems": {}, "runs": [], "extra": {},
    }
    log(f"mode {mode_name}, dtype {dtype}, out {out}")

    # -- the model and its config -------------------------------------------------------------
    t = time.perf_counter()
    if plan["model"] == "tiny":
        checkpoint = bench_model.no_eos_copy(args.tiny.resolve(), work / "models" / "tiny-llama-noeos")
        fp32_checkpoint = None
        results["model"] = bench_model.describe(checkpoint, dtype, random_weights=False)
        results["model"]["name"] = "tiny-llama (trained, 4.2M; EOS removed from its tokenizer)"
    else:
        paths = bench_model.ensure_bench_models(("bfloat16", "float32"), tokenizer_src=args.tiny.resolve(), log=log)
        checkpoint, fp32_checkpoint = paths[dtype], paths["float32"]
        results["model"] = bench_model.describe(checkpoint, dtype)
        results["model"]["name"] = f"bench-llama ({results['model']['parameters'] / 1e6:.0f}M, random weights)"
    phases["model_s"] = time.perf_counter() - t
    config = derived_config(args.config.resolve(), work / "bench-llama.yaml", dtype, args.threads, {})
    from llama_engine import load_model_config_file

    cfg = load_model_config_file(str(config))
    threads = cfg.handler.torch_threads or os.cpu_count() or 1
    results["config"] = {"path": str(config), "base": str(args.config), "threads": threads,
                         "frontend": vars(cfg.frontend), "handler": {k: v for k, v in vars(cfg.handler).items()},
                         "micro_batching": vars(cfg.micro_batching)}

    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(checkpoint)
    prompts = Prompts(PromptFactory(tokenizer, args.seed), plan, cfg.handler.max_length, args.seed)

    # -- memory bandwidth and the decode bound --------------------------------------------------
    monitor = machine.CpuMonitor()
    monitor.budget = plan["quiet_budget"]
    bw_threads = sorted({1, threads})

    def bandwidth_sample(when: str) -> None:
        t = time.perf_counter()
        quiet = monitor.wait_quiet(plan["quiet_wait"]) if plan["quiet_wait"] else None
        snap = monitor.snapshot()
        sample = {"when": when, "threads": read_bandwidth(plan["membw_gb"], threads=bw_threads),
                  **monitor.since(snap), "quiet_wait": quiet}
        results.setdefault("memory_bandwidth_samples", []).append(sample)
        # the best of the samples, per thread count: other processes only ever lower it
        results["memory_bandwidth"] = {
            str(n): max((s["threads"][str(n)] for s in results["memory_bandwidth_samples"]), key=lambda x: x["gb_per_s"])
            for n in bw_threads}
        best = results["memory_bandwidth"][str(threads)]["gb_per_s"]
        results["decode_bound"] = {
            "bandwidth_gb_per_s": best, "threads": threads,
            "weight_bytes_per_token": results["model"]["weight_bytes_per_token"],
            "tokens_per_s": round(best * 1e9 / results["model"]["weight_bytes_per_token"], 2)}
        phases[f"membw_{when}_s"] = time.perf_counter() - t
        log(f"memory bandwidth ({when}): " + ", ".join(f"{v['gb_per_s']:.1f} GB/s with {k} thread(s)"
                                                      for k, v in sample["threads"].items())
            + f", other processes {100 * sample['foreign_cpu_share']:.0f}% of the CPUs; batch-1 decode bound "
              f"{results['decode_bound']['tokens_per_s']:.1f} tok/s")

    bandwidth_sample("start")

    runs = results["runs"]
    micro = cfg.micro_batching.micro_batch_size
    timeout = plan["request_timeout"]

    # -- 1. the engine in-process ------------------------------------------------------------
    from scripts.bench.inprocess import InProcessEngine

    t = time.perf_counter()
    status = results["systems"]["inprocess"] = {"status": "ok", "detail": f"Engine in this process, {threads} torch threads"}
    engine = None
    try:
        if "inprocess" not in args.systems:
            raise _NotSelected()
        engine = InProcessEngine(cfg.handler, checkpoint, micro, threads, warmup=cfg.handler.warmup)
        status["timings"] = {"load_s": round(engine.load_s, 2), "warmup_s": round(engine.warmup_s, 2)}
        sweep("inprocess", engine.run_wave, prompts, plan, budget, runs, monitor)
        if plan["fp32_decode"] and fp32_checkpoint is not None and dtype != "float32" and budget.ok("fp32 decode", 60):
            import dataclasses

            fp32_cfg = dataclasses.replace(cfg.handler, dtype="float32")
            fp32_engine = InProcessEngine(fp32_cfg, fp32_checkpoint, micro, threads, warmup=True)
            quiet = monitor.wait_quiet(plan["quiet_wait"]) if plan["quiet_wait"] else None
            snap = monitor.snapshot()
            records = fp32_engine.run_wave(prompts.waves[(1, 0)], plan["conc_output"]) if (1, 0) in prompts.waves else []
            fp32_engine.close()
            fp32_run = summarize(records, system="inprocess-fp32", scenario="concurrency",
                                 input_tokens=plan["conc_input"], output_tokens=plan["conc_output"], concurrency=1)
            fp32_run.update(monitor.since(snap), quiet_wait=quiet)
            fp32_model = bench_model.describe(fp32_checkpoint, "float32")
            fp32_run["weight_bytes_per_token"] = fp32_model["weight_bytes_per_token"]
            results["extra"]["fp32_batch1"] = fp32_run
            log(f"inprocess fp32 batch 1: {_brief(fp32_run)}")
    except _NotSelected:
        status.update(status="skipped", detail="not selected (--systems)")
    except Exception as exc:  # noqa: BLE001 - reported, the other systems still run
        traceback.print_exc()
        status.update(status="failed", detail=f"{type(exc).__name__}: {exc}")
        engine = None
    phases["inprocess_s"] = time.perf_counter() - t

    # -- 1b. how far continuous batching can get on each Poisson load --------------------------
    cb_config = derived_config(args.continuous_config.resolve(), work / "bench-llama-continuous.yaml", dtype,
                               args.threads, {})
    if plan["bound"] and "torchserve-continuous" in args.systems and budget.ok("continuous bound", 120):
        t = time.perf_counter()
        results["extra"]["continuous_bound"] = continuous_bounds(load_model_config_file(str(cb_config)), checkpoint,
                                                                 dtype, prompts, plan, threads)
        phases["continuous_bound_s"] = time.perf_counter() - t

    # -- 2. the served handler ---------------------------------------------------------------
    from scripts.bench.systems import LlamaCppSystem, TorchServeSystem, VllmSystem

    # The two TorchServe variants run the Poisson load and the paired static waves in alternating
    # rounds (see variant_pairs), not in their sweeps: the machine's speed drifts more between
    # minutes than they differ.
    pair_names = ("torchserve", "torchserve-continuous")
    pairing = any(s in plan["scenarios"] for s in ("poisson", "poisson-wide", "paired")) and all(n in args.systems for n in pair_names)
    kept = {}

    def served(name, make_system, describe, after=None):
        """Build, start, warm up and sweep one served variant; ``after(adapter)`` runs while it is up.

        A variant of a pair stays up afterwards (in ``kept``) for :func:`variant_pairs`.
        """
        t = time.perf_counter()
        status = results["systems"][name] = {"status": "ok"}
        system = None
        keep = pairing and name in pair_names
        try:
            if name not in args.systems:
                raise _NotSelected()
            system = make_system()
            system.build()
            adapter = system.start(timeout=min(600, max(60, budget.left())))
            status["detail"] = f"TorchServe {results['versions'].get('torchserve')} {describe(system)} at {adapter.url}"
            log(f"{name} ready in {system.timings['start_to_ready_s']} s (pid {system.pid})")
            run_wave(adapter, [prompts.warm], 4, timeout)
            server = system.metrics()
            first = server.snapshot()
            sweep(name, lambda ps, n: run_wave(adapter, ps, n, timeout), prompts, plan, budget, runs, monitor,
                  schedule_runner=None if keep else lambda s: run_schedule(adapter, s, timeout), server=server)
            results["extra"][f"{name.replace('-', '_')}_metrics"] = server.since(first)
            if after is not None:
                after(system, adapter)
            if keep:
                kept[name] = (system, adapter)
        except _NotSelected:
            status.update(status="skipped", detail="not selected (--systems)")
        except Exception as exc:  # noqa: BLE001 - reported, the other systems still run
            traceback.print_exc()
            status.update(status="failed", detail=f"{type(exc).__name__}: {exc}"[:2000])
        finally:
            if system is not None and name not in kept:
                system.stop()
                status["timings"] = system.timings
        phases[f"{name.replace('-', '_')}_s"] = time.perf_counter() - t

    def variant_pairs():
        """Both TorchServe variants on the same static waves, then on the Poisson schedule, alternated.

        The static waves (``paired_concurrency`` above 1, ``paired_rounds`` rounds) go through
        :func:`paired` as ``paired-variants`` rows. Poisson round k runs micro then continuous
        (k even) or the reverse, over ``poisson_rounds`` rounds; the idle server waits without
        using the CPU. Each variant's Poisson run gathers all its rounds (percentiles over every
        request); its throughput is the mean of its rounds' (each over its own wall time), and
        ``round_ratios`` holds continuous / micro per round.
        """
        names = [name for name in pair_names if name in kept]  # both, unless one failed to start
        if len(names) == 2 and "paired" in plan["scenarios"] and budget.ok("paired variants", 60):
            t_waves = time.perf_counter()
            paired(*((name, lambda ps, n, a=kept[name][1]: run_wave(a, ps, n, timeout)) for name in names),
                   prompts, plan, runs, monitor, scenario="paired-variants", ratio="continuous_over_micro",
                   concurrency=[c for c in plan["paired_concurrency"] if c > 1])
            phases["paired_variants_s"] = time.perf_counter() - t_waves
        for load, scenario in (("mixed", "poisson"), ("wide", "poisson-wide")):
            if scenario in plan["scenarios"] and prompts.schedules[load]:
                poisson_rounds(names, load)

    def poisson_rounds(names, load):
        t_pairs = time.perf_counter()
        schedule, load_plan = prompts.schedules[load], plan[POISSON_PLAN[load]]
        per_round = {name: [] for name in names}
        records = {name: [] for name in names}
        snap = monitor.snapshot()
        for k in range(plan["poisson_rounds"]):
            if not budget.ok(f"{load} poisson round {k + 1}", 30):
                break
            for name in (names if k % 2 == 0 else names[::-1]):
                if plan["quiet_wait"]:
                    monitor.wait_quiet(plan["quiet_wait"])
                wave = run_schedule(kept[name][1], schedule, timeout)
                records[name] += wave
                per_round[name].append(summarize(wave))
                log(f"{name} {load} poisson round {k + 1}: {_brief(per_round[name][-1])}")
        contention = monitor.since(snap)
        ratios = [round(c["output_tokens_per_s"] / m["output_tokens_per_s"], 4)
                  for m, c in zip(*(per_round[x] for x in pair_names))
                  if m.get("output_tokens_per_s") and c.get("output_tokens_per_s")] if len(names) == 2 else []
        for name in names:
            rounds = [r for r in per_round[name] if r.get("output_tokens_per_s")]
            if not records[name]:
                continue
            run = summarize(records[name], system=name, rounds=len(per_round[name]), round_ratios=ratios,
                            **poisson_labels(load_plan, schedule, load))
            run.update(contention)
            if rounds:
                wall = statistics.mean(r["wall_s"] for r in rounds)
                rates = [r["output_tokens_per_s"] for r in rounds]
                run.update(output_tokens_per_s=round(statistics.mean(rates), 3), output_tokens_per_s_rounds=rates,
                           wall_s=round(wall, 3), **poisson_rates(run["ok"] / len(rounds), wall, schedule))
            runs.append(run)
        log(f"{load} poisson pairs: continuous / micro per round {ratios}")
        phases[f"poisson_{load}_pairs_s"] = time.perf_counter() - t_pairs

    def after_micro(system, adapter):
        if engine is not None and "paired" in plan["scenarios"] and plan["paired_rounds"] and budget.ok("paired A/B", 60):
            t_paired = time.perf_counter()
            paired(("inprocess", engine.run_wave), ("torchserve", lambda ps, n: run_wave(adapter, ps, n, timeout)),
                   prompts, plan, runs, monitor)
            phases["paired_s"] = time.perf_counter() - t_paired

    served("torchserve", lambda: TorchServeSystem(work, config, checkpoint), lambda ts: f"pid {ts.pid}",
           after=after_micro)
    if engine is not None:
        engine.close()
        engine = None

    # -- 2b. the served handler with continuous batching --------------------------------------
    def continuous_system():
        return TorchServeSystem(work / "continuous", cb_config, checkpoint, model_name="bench-llama-continuous")

    served("torchserve-continuous", continuous_system,
           lambda ts: f"continuousBatching, {load_model_config_file(str(cb_config)).slots} slots, pid {ts.pid}",
           after=lambda system, _: results["extra"].update(
               torchserve_continuous_round_trips=round_trips(system.server.model_log())))

    if kept:
        try:
            variant_pairs()
        except Exception:  # noqa: BLE001 - reported, the peers still run
            traceback.print_exc()
    for name, (system, _) in kept.items():
        system.stop()
        results["systems"][name]["timings"] = system.timings

    # -- 3. peers, when installed -------------------------------------------------------------
    peers = [LlamaCppSystem(work / "llama.cpp", dtype, threads, micro, cfg.handler.max_length, args.llama_gguf),
             LlamaCppSystem(work / "llama.cpp-q8_0", dtype, threads, micro, cfg.handler.max_length, quant="q8_0"),
             VllmSystem(work / "vllm", checkpoint, dtype, micro, cfg.handler.max_length)]
    for peer in peers:
        t = time.perf_counter()
        try:
            found, detail = peer.detect()
        except Exception as exc:  # noqa: BLE001
            found, detail = False, f"not installed ({type(exc).__name__}: {exc})"
        status = results["systems"][peer.name] = {"status": "ok" if found else "not installed", "detail": detail}
        if found and (not plan["peers"] or args.no_peers):
            status.update(status="skipped", detail=f"installed ({detail}) but skipped in this mode")
        elif found and peer.name not in args.systems:
            status.update(status="skipped", detail=f"installed ({detail}) but not selected (--systems)")
        if status["status"] != "ok":
            log(f"{peer.name}: {status['detail']}")
            continue
        if not budget.ok(peer.name, 120):
            status.update(status="skipped", detail="out of the time budget")
            continue
        try:
            adapter = peer.start(timeout=min(900, budget.left()))
            log(f"{peer.name} ready in {peer.timings['start_to_ready_s']} s (pid {peer.pid})")
            run_wave(adapter, [prompts.warm], 4, timeout)
            sweep(peer.name, lambda ps, n, a=adapter: run_wave(a, ps, n, timeout), prompts, plan, budget, runs, monitor,
                  schedule_runner=lambda s, a=adapter: run_schedule(a, s, timeout))
        except Exception as exc:  # noqa: BLE001
            traceback.print_exc()
            status.update(status="failed", detail=f"{type(exc).__name__}: {exc}"[:2000])
        finally:
            peer.stop()
            status["timings"] = peer.timings
        phases[f"{peer.name}_s"] = time.perf_counter() - t

    bandwidth_sample("end")  # a second sample: the machine may have been busier at the start

    # -- ratios and outputs ------------------------------------------------------------------------
    results["ratios"] = report.ratios(results)
    phases["total_s"] = time.perf_counter() - started
    results["phases_s"] = {k: round(v, 2) for k, v in phases.items()}
    everything = list(args.systems) == list(SYSTEMS) and list(args.scenarios) == list(SCENARIOS)
    docs = None if args.no_docs else (args.docs or (ROOT / "docs" / "benchmarks.md" if plan["docs"] and everything else None))
    written = report.write_all(results, out, docs)
    for line in report.ratio_lines(results["ratios"]):
        print(line)
    log(f"wrote {', '.join(str(p) for p in written)} in {phases['total_s']:.0f} s")
    failed = [name for name, s in results["systems"].items() if s["status"] == "failed"]
    if failed:
        log(f"systems that failed: {', '.join(failed)} (see the JSON for the reason)")
    return 1 if results["systems"].get("torchserve", {}).get("status") == "failed" else 0


def continuous_bounds(cb_cfg, checkpoint: Path, dtype: str, prompts: Prompts, plan: dict, threads: int) -> dict:
    """``scripts.bench.continuous_bound`` on each Poisson load, with the continuous config's slots and
    prefill budget: the ideal continuous batcher's tok/s (``ideal_tps``) that the served one is held to."""
    import torch

    from scripts.bench.continuous_bound import measure

    torch.set_num_threads(threads)
    out = {}
    for load in LOADS:
        schedule = [(t, len(ids), n) for t, ids, n in prompts.schedules[load]]
        if schedule:
            out[load] = measure(checkpoint, dtype, cb_cfg.slots, schedule,
                                cb_cfg.continuous_batching.max_prefill_tokens_per_step, cb_cfg.handler.max_length)
            log(f"continuous bound, {load} load: ideal {out[load]['ideal_tps']:.1f} tok/s, micro-batching replay "
                f"{out[load]['micro_tps']:.1f} tok/s, at most {out[load]['bound']:.2f}x")
    return out


ROUND_TRIP_LINE = re.compile(r"continuous batching: (\d+) calls, ([\d.]+) ms in the handler "
                             r"\(([\d.]+) ms of it in scheduler steps\) and ([\d.]+) ms in the frontend round trip per call")


def round_trips(model_log: str) -> List[dict]:
    """The continuous handler's periodic lines (``RoundTrips`` in the handler): calls, ms per call
    inside it (and of that in scheduler steps) and between calls."""
    return [{"calls": int(m[1]), "handler_ms": float(m[2]), "step_ms": float(m[3]), "round_trip_ms": float(m[4])}
            for m in ROUND_TRIP_LINE.finditer(model_log)]


class _NotSelected(Exception):
    """A system left out by --systems."""


if __name__ == "__main__":
    sys.exit(main())
