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
rewrites this CPU class's page, ``docs/benchmarks-<class>.md``, and their index ``docs/benchmarks.md``
(not in ``--smoke``). Speeds are reported, never asserted.
"""
from __future__ import annotations

import argparse
import dataclasses
import datetime as _dt
import importlib.util
import json
import os
import shlex
import statistics
import sys
import time
import traceback
from pathlib import Path
from typing import Dict, List, Optional

from llama_engine.cpu import CLASSES, auto_dtype
from llama_engine.cpu_limits import model_threads
from scripts.bench import machine, model as bench_model, report
from scripts.bench.choices import ChoiceRecorder, choices_in_log
from scripts.bench.membw import read_bandwidth
from scripts.bench.plan import (
    POISSON_PLAN,
    ROOT,
    SCENARIOS,
    SYSTEMS,
    Budget,
    Prompts,
    derived_config,
    log,
    make_plan,
    pairs_planned,
    parse_scenarios,
    parse_systems,
)
from scripts.bench.prompts import PromptFactory
from scripts.bench.scenarios import (
    brief,
    continuous_bounds,
    lengths_of,
    paired,
    poisson_labels,
    poisson_rates,
    round_trips,
    sweep,
)
from scripts.bench.stats import summarize
from scripts.streaming_client import run_schedule, run_wave

#: The two TorchServe variants. They run the Poisson loads and the paired static waves in
#: alternating rounds (:meth:`BenchRun.variant_pairs`), not in their sweeps: the machine's speed
#: drifts more between minutes than they differ.
VARIANTS = ("torchserve", "torchserve-continuous")


def parse_args(argv: Optional[List[str]]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    mode = parser.add_mutually_exclusive_group()
    mode.add_argument("--quick", action="store_true", help="fewer, shorter runs (about 2 minutes here)")
    mode.add_argument("--smoke", action="store_true", help="the tiny model, seconds of load (used by the tests)")
    parser.add_argument("--out", type=Path, default=ROOT / "build" / "bench", help="results directory")
    parser.add_argument("--config", type=Path, default=ROOT / "model-config" / "bench-llama.yaml",
                        help="the micro-batching model-config served as torchserve (and run in-process)")
    parser.add_argument("--continuous-config", type=Path, default=ROOT / "model-config" / "bench-llama-continuous.yaml",
                        help="the continuous-batching variant served as torchserve-continuous")
    parser.add_argument("--llamacpp-config", type=Path, default=ROOT / "model-config" / "bench-llama-llamacpp.yaml",
                        help="the llamacpp-backend variant served as torchserve-llamacpp (when llama-cpp-python is installed)")
    parser.add_argument("--dtype", choices=["auto", "bfloat16", "float32"],
                        help="variant to serve (default: the mode's; auto is what handler.dtype: auto picks on this CPU)")
    parser.add_argument("--checkpoint", choices=["bfloat16", "float32"], default="bfloat16",
                        help="the bench model's stored dtype (default bfloat16, as Llama checkpoints ship: computed in "
                             "float32, its linears keep bf16 weights where handler.weight_dtype auto does); float32: "
                             "the float32 copy, as the avx2 and avx512 rows before this option")
    parser.add_argument("--threads", type=int, help="torch threads (default: the config's handler.torch_threads)")
    parser.add_argument("--tiny", type=Path, default=ROOT / "build" / "tiny-llama",
                        help="the embedded tiny model: the tokenizer source, and the model of --smoke")
    parser.add_argument("--docs", type=Path, help="Markdown page to rewrite (default this CPU class's, "
                             "docs/benchmarks-<class>.md, not in --smoke)")
    parser.add_argument("--no-docs", action="store_true", help="do not rewrite any docs page")
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
    parser.add_argument("--seed", type=int, default=0, help="seed of the prompts and Poisson schedules (default 0)")
    parser.add_argument("--cpu-class", choices=CLASSES, metavar="CLASS",
                        help="measure as a CPU of this lower class would (other: no AVX2, avx2, avx512, avx512-bf16): "
                             "its dtype, native kernels and torch's kernels (llama_engine.cpu.emulation_env); llama.cpp's peer "
                             "from build/peers/llama.cpp/build-CLASS (make bench-peers BENCH_PEERS=llama-CLASS); "
                             "the docs page docs/benchmarks-CLASS-emulated.md")
    parser.add_argument("--render", type=Path, metavar="JSON",
                        help="measure nothing: rewrite the Markdown, plots (and --docs) from a results JSON")
    args = parser.parse_args(argv)
    if args.docs is not None and args.docs.resolve() == report.DOCS_PAGE:
        parser.error(f"--docs {args.docs}: that page is the index of the pages by CPU class, rewritten with them; "
                     "leave --docs out for this class's own page, or name another")
    return args


def main(argv=None) -> int:
    args = parse_args(argv)
    if args.render is not None:
        return render(args)
    log("OpenMP as served: " + " ".join(f"{k}={v}" for k, v in machine.openmp_as_served().items()))
    if args.cpu_class:
        log(f"--cpu-class {args.cpu_class}: " + " ".join(f"{k}={v}" for k, v in machine.emulate(args.cpu_class).items()))

    bench = BenchRun(args, argv)
    with ChoiceRecorder() as choices:  # what this process's engines chose at load (the workers': served())
        bench.model_and_configs()
        bench.bandwidth_sample("start")
        bench.inprocess()
        bench.continuous_bound()
        bench.served_micro()  # paired with the in-process engine while both are up
        bench.close_inprocess()
        bench.served_continuous()
        bench.served_llamacpp()  # kept up (idle) for the llama-server pairs
        bench.served_int8()  # kept up (idle) for the pairs with llama-server on the q8_0 GGUF
        bench.variant_pairs()  # both variants: the paired static waves, then each Poisson load's rounds
        bench.peers()  # the variants stay up (idle): llama-server runs paired waves against each
        bench.stop_variants()
        bench.bandwidth_sample("end")  # a second sample: the machine may have been busier at the start
    bench.load_choices("bench process", choices.lines)
    return bench.outputs()


def render(args) -> int:
    """--render: measure nothing, rewrite the Markdown, plots (and docs) from a results JSON."""
    results = json.loads(args.render.read_text())
    results["ratios"] = report.ratios(results)
    docs = None if args.no_docs else (args.docs or (report.default_docs(results["machine"])
                                                    if results["mode"] != "smoke" else None))
    out = args.out.resolve()
    written = report.write_all(results, out, docs)
    log(f"re-rendered {args.render}: {', '.join(str(p) for p in written)}")
    return 0


def wave_runner(name: str, adapter, timeout: float):
    """``(name, runner)`` of a server behind ``adapter``, a wave at a time, for :func:`~scripts.bench.scenarios.paired`."""
    return name, lambda prompts, n: run_wave(adapter, prompts, n, timeout)


class BenchRun:
    """One bench run. Its steps are the methods below, in the order :func:`main` calls them;
    each adds what it measured to ``results`` (the JSON) and its duration to ``phases``.

    A system that fails is reported (``results["systems"][name]``) and the others still run.
    """

    def __init__(self, args, argv):
        self.args = args
        self.mode = "smoke" if args.smoke else "quick" if args.quick else "default"
        self.plan = plan = make_plan(self.mode, args.scenarios, args.poisson_rate, args.poisson_duration,
                                     args.poisson_rounds)
        dtype = args.dtype or plan["dtype"]
        self.dtype = auto_dtype("cpu") if dtype == "auto" else dtype
        self.budget = Budget(args.max_minutes or plan["max_minutes"])
        self.out = args.out.resolve()
        self.work = self.out / "work"
        self.out.mkdir(parents=True, exist_ok=True)
        # torchserve, torch-model-archiver and the worker's python come from this interpreter's bin
        os.environ["PATH"] = f"{Path(sys.executable).parent}:{os.environ.get('PATH', '')}"
        self.started = time.perf_counter()
        stamp = _dt.datetime.now(_dt.timezone.utc).strftime("%Y%m%dT%H%M%SZ")
        self.phases: Dict[str, float] = {}
        self.results = {
            "schema": "llama-torchserve-bench/1", "timestamp": stamp, "mode": self.mode,
            "command": " ".join(["python -m scripts.bench"] + [shlex.quote(a) for a in (argv if argv is not None else sys.argv[1:])]),
            "machine": {**machine.machine_info(), "load_average_at_start": os.getloadavg()}, "versions": machine.versions(),
            "plan": {k: v for k, v in plan.items() if k not in ("docs",)}, "systems": {}, "runs": [], "extra": {},
        }
        self.runs = self.results["runs"]
        host = self.results["machine"]
        #: the CPU class emulated (--cpu-class, below this host's), or None
        self.emulated = host["cpu_class"] if host.get("emulated_on") else None
        self.timeout = plan["request_timeout"]
        self.monitor = machine.CpuMonitor()
        self.monitor.budget = plan["quiet_budget"]
        self.engine = None  # the in-process engine, kept until the micro-batching variant is paired with it
        self.kept = {}  # name -> (system, adapter): the variants kept up for variant_pairs
        self.pairing = (any(s in plan["scenarios"] for s in ("poisson", "poisson-wide", "poisson-steady", "paired"))
                        and all(n in args.systems for n in VARIANTS))
        log(f"mode {self.mode}, dtype {self.dtype}, out {self.out}")

    # -- the model and its configs -------------------------------------------------------------

    def model_and_configs(self) -> None:
        """The benchmark model (built once, then reused), the two served configs derived for this
        run's dtype and threads, and the prompts every system gets."""
        args, results = self.args, self.results
        t = time.perf_counter()
        if self.plan["model"] == "tiny":
            self.checkpoint = bench_model.no_eos_copy(args.tiny.resolve(), self.work / "models" / "tiny-llama-noeos")
            self.fp32_checkpoint = None
        else:
            paths = bench_model.ensure_bench_models(("bfloat16", "float32"), tokenizer_src=args.tiny.resolve(), log=log)
            self.checkpoint, self.fp32_checkpoint = paths[args.checkpoint], paths["float32"]
        self.phases["model_s"] = time.perf_counter() - t
        self.config = derived_config(args.config.resolve(), self.work / "bench-llama.yaml", self.dtype, args.threads, {})
        self.cb_config = derived_config(args.continuous_config.resolve(), self.work / "bench-llama-continuous.yaml",
                                        self.dtype, args.threads, {})
        from llama_engine import load_model_config_file

        self.cfg = cfg = load_model_config_file(str(self.config))
        self.weight_dtype = bench_model.served_weight_dtype(cfg.handler, self.checkpoint)
        tiny = self.plan["model"] == "tiny"
        model = results["model"] = bench_model.describe(self.checkpoint, self.dtype, self.weight_dtype, random_weights=not tiny)
        model["name"] = ("tiny-llama (trained, 4.2M; EOS removed from its tokenizer)" if tiny
                         else f"bench-llama ({model['parameters'] / 1e6:.0f}M, random weights)")
        self.threads = model_threads(cfg.handler.torch_threads)  # what the worker picks
        self.micro = cfg.micro_batching.micro_batch_size
        results["config"] = {"path": str(self.config), "base": str(args.config), "threads": self.threads,
                             "frontend": vars(cfg.frontend), "handler": {k: v for k, v in vars(cfg.handler).items()},
                             "micro_batching": vars(cfg.micro_batching)}

        from transformers import AutoTokenizer

        tokenizer = AutoTokenizer.from_pretrained(self.checkpoint)
        self.prompts = Prompts(PromptFactory(tokenizer, args.seed), self.plan, cfg.handler.max_length, args.seed)

    # -- memory bandwidth and the decode bound --------------------------------------------------

    def bandwidth_sample(self, when: str) -> None:
        """The memory bandwidth now, and the batch-1 decode bound of the best sample so far."""
        plan, results, monitor = self.plan, self.results, self.monitor
        bw_threads = sorted({1, self.threads})
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
        best = results["memory_bandwidth"][str(self.threads)]["gb_per_s"]
        results["decode_bound"] = {
            "bandwidth_gb_per_s": best, "threads": self.threads,
            "weight_bytes_per_token": results["model"]["weight_bytes_per_token"],
            "tokens_per_s": round(best * 1e9 / results["model"]["weight_bytes_per_token"], 2)}
        self._prefill_bound_sample(when)
        self._decode_products_sample(when)
        self.phases[f"membw_{when}_s"] = time.perf_counter() - t
        log(f"memory bandwidth ({when}): " + ", ".join(f"{v['gb_per_s']:.1f} GB/s with {k} thread(s)"
                                                      for k, v in sample["threads"].items())
            + f", other processes {100 * sample['foreign_cpu_share']:.0f}% of the CPUs; batch-1 decode bound "
              f"{results['decode_bound']['tokens_per_s']:.1f} tok/s")

    def _prefill_bound_sample(self, when: str) -> None:
        """The linear layers' prompt tokens/s at the shortest and the longest length (best of the samples)."""
        from scripts.bench.gemm import prefill_bound

        rows = sorted({min(i for i, _ in self.plan["lengths"]), max(i for i, _ in self.plan["lengths"])})
        sample = {str(n): prefill_bound(self.checkpoint, self.dtype, self.threads, tokens=n) for n in rows}
        self.results.setdefault("prefill_bound_samples", []).append({"when": when, "rows": sample})
        self.results["prefill_bound"] = {
            n: max((s["rows"][n] for s in self.results["prefill_bound_samples"]), key=lambda x: x["tokens_per_s"])
            for n in sample}
        log(f"prefill bound ({when}, the linear layers alone): " + ", ".join(
            f"{v['tokens_per_s']:.0f} tok/s ({v['gflops']:.0f} GFLOP/s) on {n} rows" for n, v in sample.items()))

    def _decode_products_sample(self, when: str) -> None:
        """The linear products' batch-1 decode tokens/s alone (``gemm.decode_products``; best of the samples)."""
        from scripts.bench.gemm import decode_products

        sample = decode_products(self.checkpoint, self.dtype, self.threads, weight_dtype=self.weight_dtype)
        self.results.setdefault("decode_products_samples", []).append({"when": when, **sample})
        self.results["decode_products"] = max(self.results["decode_products_samples"],
                                              key=lambda x: x["tokens_per_s"])
        log(f"decode products ({when}, the linear layers alone at 1 row): {sample['tokens_per_s']:.1f} tok/s, "
            f"the weights at {sample['gb_per_s']:.1f} GB/s ({sample['kernel']})")

    # -- 1. the engine in-process ------------------------------------------------------------

    def _bandwidth_now(self) -> float:
        """GB/s with the bench's threads, a short sample (best of 3) to bracket a measurement."""
        return read_bandwidth(self.plan["membw_gb"], threads=(self.threads,), repeats=3)[str(self.threads)]["gb_per_s"]

    def inprocess(self) -> None:
        """The engine in this process: its sweep, and (default mode) float32 at batch 1 beside it."""
        from scripts.bench.inprocess import InProcessEngine

        plan, cfg = self.plan, self.cfg
        t = time.perf_counter()
        status = self.results["systems"]["inprocess"] = {
            "status": "ok", "detail": f"Engine in this process, {self.threads} torch threads"}
        try:
            if "inprocess" not in self.args.systems:
                raise _NotSelected()
            self.engine = InProcessEngine(cfg.handler, self.checkpoint, self.micro, self.threads,
                                          warmup=cfg.handler.warmup)
            status["timings"] = {"load_s": round(self.engine.load_s, 2), "warmup_s": round(self.engine.warmup_s, 2)}
            sweep("inprocess", self.engine.run_wave, self.prompts, plan, self.budget, self.runs, self.monitor)
            if (plan["fp32_decode"] and self.fp32_checkpoint is not None and self.weight_dtype != "float32"
                    and self.budget.ok("fp32 decode", 60)):
                self.results["extra"]["fp32_batch1"] = self._fp32_batch1(InProcessEngine)
        except _NotSelected:
            status.update(status="skipped", detail="not selected (--systems)")
        except Exception as exc:  # noqa: BLE001 - reported, the other systems still run
            traceback.print_exc()
            status.update(status="failed", detail=f"{type(exc).__name__}: {exc}")
            self.engine = None
        self.phases["inprocess_s"] = time.perf_counter() - t

    def _fp32_batch1(self, InProcessEngine) -> dict:
        plan, monitor = self.plan, self.monitor
        fp32_cfg = dataclasses.replace(self.cfg.handler, dtype="float32")
        fp32_engine = InProcessEngine(fp32_cfg, self.fp32_checkpoint, self.micro, self.threads, warmup=True)
        quiet = monitor.wait_quiet(plan["quiet_wait"]) if plan["quiet_wait"] else None
        snap = monitor.snapshot()
        waves = self.prompts.waves
        bracket = [self._bandwidth_now()]
        records = fp32_engine.run_wave(waves[(1, 0)], plan["conc_output"]) if (1, 0) in waves else []
        bracket.append(self._bandwidth_now())
        fp32_engine.close()
        fp32_run = summarize(records, system="inprocess-fp32", scenario="concurrency",
                             input_tokens=plan["conc_input"], output_tokens=plan["conc_output"], concurrency=1)
        fp32_run.update(monitor.since(snap), quiet_wait=quiet)
        fp32_model = bench_model.describe(self.fp32_checkpoint, "float32")
        fp32_run["weight_bytes_per_token"] = fp32_model["weight_bytes_per_token"]
        fp32_run["bandwidth_gb_per_s_bracket"] = bracket
        log(f"inprocess fp32 batch 1: {brief(fp32_run)}")
        return fp32_run

    def close_inprocess(self) -> None:
        if self.engine is not None:
            self.engine.close()
            self.engine = None

    # -- 1b. how far continuous batching can get on each Poisson load --------------------------

    def continuous_bound(self) -> None:
        if self.plan["bound"] and "torchserve-continuous" in self.args.systems and self.budget.ok("continuous bound", 120):
            from llama_engine import load_model_config_file

            t = time.perf_counter()
            bounds = self.results["extra"]["continuous_bound"] = continuous_bounds(
                load_model_config_file(str(self.cb_config)), self.checkpoint, self.dtype, self.prompts, self.plan,
                self.threads)
            for load, bound in bounds.items():
                if "pace" in bound:
                    self._record_pace(load, dict(bound["pace"], basis=(
                        "utilization x micro-batching's" if "utilization" in bound["pace"] else
                        "overload x the ideal continuous batcher's") + " requests/s in the continuous bound's "
                        "saturated replay (step costs measured in-process)"))
            self.phases["continuous_bound_s"] = time.perf_counter() - t

    # -- 2. the served handler, each variant ----------------------------------------------------

    def served_micro(self) -> None:
        """TorchServe with micro-batching; while it is up, paired A/B waves against the in-process engine."""
        from scripts.bench.systems import TorchServeSystem

        self.served("torchserve", lambda: TorchServeSystem(self.work, self.config, self.checkpoint),
                    lambda ts: f"pid {ts.pid}", after=self._paired_with_inprocess)

    def _paired_with_inprocess(self, system, adapter) -> None:
        plan = self.plan
        if self.engine is not None and pairs_planned(plan) and self.budget.ok("paired A/B", 60):
            t = time.perf_counter()
            paired(("inprocess", self.engine.run_wave),
                   wave_runner("torchserve", adapter, self.timeout),
                   self.prompts, plan, self.runs, self.monitor,
                   efficiency=(self._bandwidth_now, self.results["decode_bound"]["weight_bytes_per_token"]))
            self.phases["paired_s"] = time.perf_counter() - t

    def served_continuous(self) -> None:
        """TorchServe with continuous batching; its handler's round trips from the model log."""
        from llama_engine import load_model_config_file
        from scripts.bench.systems import TorchServeSystem

        def round_trips_of(system, _adapter):
            self.results["extra"].update(torchserve_continuous_round_trips=round_trips(system.server.model_log()))

        self.served("torchserve-continuous",
                    lambda: TorchServeSystem(self.work / "continuous", self.cb_config, self.checkpoint,
                                             model_name="bench-llama-continuous"),
                    lambda ts: f"continuousBatching, {load_model_config_file(str(self.cb_config)).slots} slots, pid {ts.pid}",
                    after=round_trips_of)

    def served_llamacpp(self) -> None:
        """The handler on the llamacpp backend (continuous batching), when llama-cpp-python imports."""
        from llama_engine import load_model_config_file
        from scripts.bench.systems import TorchServeSystem

        if self.emulated:
            self.results["systems"][report.LLAMACPP] = {"status": "skipped", "detail": self._unemulated("llama-cpp-python")}
            log(f"{report.LLAMACPP}: {self.results['systems'][report.LLAMACPP]['detail']}")
            return
        if importlib.util.find_spec("llama_cpp") is None:
            self.results["systems"][report.LLAMACPP] = {
                "status": "not installed", "detail": "llama-cpp-python does not import (make llamacpp builds it)"}
            log(f"{report.LLAMACPP}: llama-cpp-python not installed (make llamacpp)")
            return
        # its GGUF in the linears' dtype as served, as llama-server's (plan.gguf_type_of: bf16 or f16 for the bf16 checkpoint)
        config = derived_config(self.args.llamacpp_config.resolve(), self.work / "bench-llama-llamacpp.yaml",
                                self.weight_dtype, self.args.threads, {})
        self.served(report.LLAMACPP,
                    lambda: TorchServeSystem(self.work / "llamacpp", config, self.checkpoint, model_name="bench-llama-llamacpp"),
                    lambda ts: f"backend llamacpp ({load_model_config_file(str(config)).handler.gguf_type} GGUF), "
                               f"continuousBatching, pid {ts.pid}")

    def served_int8(self) -> None:
        """The micro-batching handler over int8 weights (``handler.weight_dtype: int8``): its waves at the paired
        concurrencies, then (:meth:`peers`) back to back against llama-server on the q8_0 GGUF."""
        import torch

        from llama_engine.backends.torch_backend import weight_dtype_for
        from scripts.bench.systems import TorchServeSystem

        try:  # where the worker would refuse them, say so now rather than wait out its start
            weight_dtype_for("int8", getattr(torch, self.dtype), torch.device("cpu"), None)
        except ValueError as exc:
            self.results["systems"][report.INT8] = {"status": "skipped", "detail": str(exc)}
            log(f"{report.INT8}: {exc}")
            return

        def make_system():
            config = derived_config(self.args.config.resolve(), self.work / "bench-llama-int8.yaml", self.dtype,
                                    self.args.threads, {"weight_dtype": "int8"})
            return TorchServeSystem(self.work / "int8", config, self.checkpoint, model_name="bench-llama-int8")

        waves = [c for c in self.plan["concurrency"] if c in self.plan["paired_concurrency"]]
        self.served(report.INT8, make_system, lambda ts: f"weight_dtype int8, pid {ts.pid}",
                    plan=dict(self.plan, scenarios=["concurrency"], concurrency=waves or self.plan["concurrency"]))

    def _unemulated(self, what: str) -> str:
        return (f"{what} is built for this host's instruction set ({self.results['machine']['emulated_on']}), "
                f"which no variable narrows to the emulated class {self.emulated}'s")

    def load_choices(self, process: str, lines: List[str]) -> None:
        """Record what ``process`` chose at load (:mod:`scripts.bench.choices`) and log it."""
        self.results["extra"].setdefault("load_choices", {})[process] = lines
        for line in lines:
            log(f"{process} chose at load: {line}")

    def serving_choices(self, name: str, system) -> None:
        """Record what ``name``'s worker chose while serving (the llamacpp backend's decode threads)."""
        lines = choices_in_log(system.server.model_log(), serving=True)
        if lines:
            self.results["extra"].setdefault("serving_choices", {})[name] = lines
            log(f"{name} chose while serving ({len(lines)}): {lines[-1]}")

    def served(self, name: str, make_system, describe, after=None, plan: Optional[dict] = None) -> None:
        """Build, start, warm up and sweep one served variant; ``after(system, adapter)`` runs while it is up.
        ``plan``: the sweep's (default the run's).

        A variant of the pair stays up afterwards (in ``kept``) for :meth:`variant_pairs`, which
        runs its Poisson loads instead of its sweep.
        """
        results, budget = self.results, self.budget
        t = time.perf_counter()
        status = results["systems"][name] = {"status": "ok"}
        system = None
        keep = self.pairing and (name in VARIANTS or name in (report.LLAMACPP, report.INT8))
        try:
            if name not in self.args.systems:
                raise _NotSelected()
            system = make_system()
            system.build()
            adapter = system.start(timeout=min(600, max(60, budget.left())))
            status["detail"] = f"TorchServe {results['versions'].get('torchserve')} {describe(system)} at {adapter.url}"
            log(f"{name} ready in {system.timings['start_to_ready_s']} s (pid {system.pid})")
            self.load_choices(name, choices_in_log(system.server.model_log()))
            run_wave(adapter, [self.prompts.warm], 4, self.timeout)
            server = system.metrics()
            first = server.snapshot()
            sweep(name, lambda ps, n: run_wave(adapter, ps, n, self.timeout), self.prompts, plan or self.plan, budget,
                  self.runs, self.monitor,
                  schedule_runner=None if keep else lambda s: run_schedule(adapter, s, self.timeout), server=server)
            results["extra"][f"{name.replace('-', '_')}_metrics"] = server.since(first)
            if after is not None:
                after(system, adapter)
            if keep:
                self.kept[name] = (system, adapter)
        except _NotSelected:
            status.update(status="skipped", detail="not selected (--systems)")
        except Exception as exc:  # noqa: BLE001 - reported, the other systems still run
            traceback.print_exc()
            status.update(status="failed", detail=f"{type(exc).__name__}: {exc}"[:2000])
        finally:
            if system is not None and name not in self.kept:
                self.serving_choices(name, system)
                system.stop()
                status["timings"] = system.timings
        self.phases[f"{name.replace('-', '_')}_s"] = time.perf_counter() - t

    # -- 2c. both variants, alternated ----------------------------------------------------------

    def variant_pairs(self) -> None:
        """Both TorchServe variants on the same static waves, then on each Poisson schedule, alternated.

        The static waves (``paired_concurrency`` above 1, ``paired_rounds`` rounds) go through
        :func:`~scripts.bench.scenarios.paired` as ``paired-variants`` rows; then
        :meth:`poisson_rounds` for each load.
        """
        if not self.kept:
            return
        plan, prompts = self.plan, self.prompts
        names = [name for name in VARIANTS if name in self.kept]  # both, unless one failed to start
        try:
            if len(names) == 2 and pairs_planned(plan) and self.budget.ok("paired variants", 60):
                t = time.perf_counter()
                paired(*(self._kept_runner(name) for name in names), prompts, plan, self.runs, self.monitor,
                       scenario="paired-variants", ratio="continuous_over_micro",
                       concurrency=[c for c in plan["paired_concurrency"] if c > 1])
                self.phases["paired_variants_s"] = time.perf_counter() - t
            self._int8_against_served_weights()
            for load, scenario in (("mixed", "poisson"), ("wide", "poisson-wide"), ("steady", "poisson-steady")):
                if load == "steady":
                    self._steady_at_served_capacity()
                if scenario in plan["scenarios"] and prompts.schedules[load] and self._paced(load):
                    self.poisson_rounds(names, load)
        except Exception:  # noqa: BLE001 - reported, the peers still run
            traceback.print_exc()

    def _kept_runner(self, name: str):
        """``(name, runner)`` of a variant kept up, a wave at a time, for :func:`~scripts.bench.scenarios.paired`."""
        return wave_runner(name, self.kept[name][1], self.timeout)

    def _int8_against_served_weights(self) -> None:
        """The int8 variant against the micro-batching handler over the weights as served, in back-to-back A/B
        waves at the paired concurrencies (``paired-int8`` rows): their sweeps ran minutes apart, and on the
        Zen 3 two runs of the same code read 1.38 and 0.90 from them at 8 streams."""
        plan = self.plan
        if not {report.SERVED, report.INT8} <= set(self.kept) or not pairs_planned(plan) or not self.budget.ok("paired int8", 60):
            return
        t = time.perf_counter()
        paired(self._kept_runner(report.SERVED), self._kept_runner(report.INT8), self.prompts, plan, self.runs,
               self.monitor, scenario=report.INT8_PAIRS, ratio="int8_over_weights")
        self.phases["paired_int8_s"] = time.perf_counter() - t

    def _paced(self, load: str) -> bool:
        """Whether ``load`` has its arrival rate: its plan's own, one the continuous bound set (a load given
        by ``requests``), or the plan's fallback ``rate`` when no bound was measured to derive it from."""
        load_plan = self.plan[POISSON_PLAN[load]]
        if "requests" not in load_plan or load in self.prompts.rates:
            return True
        if load_plan.get("rate"):
            self.prompts.pace(load, load_plan["rate"])
            self._record_pace(load, {"rate": load_plan["rate"], "basis": "the plan's fixed rate (no continuous bound)"})
            return True
        log(f"skipping the {load} load: its rate comes from the continuous bound, which this run did not measure")
        return False

    def _steady_at_served_capacity(self) -> None:
        """Pace the steady load at its utilization of what micro-batching served on the mixed load (the same
        lengths, offered past capacity: its throughput there is its capacity), where that is below the
        in-process replay's capacity it was paced to. Served, micro-batching falls short of its in-process
        step costs: a full bench on an Emerald Rapids Xeon replayed 186 tok/s and served 132, so its
        "steady" load, at 60% of the replay, was 85% of what it served, and both servers' queues grew
        (micro-batching's TTFT p50 4.8-5.5 s). The ideal's and the replay's p99 TTFT follow the new pace."""
        from scripts.bench.continuous_bound import on_arrivals, served_capacity

        pace = self.results["extra"].get("steady_load")
        mixed = report.poisson_run(self.runs, report.SERVED, "mixed")
        if not pace or "utilization" not in pace or not (mixed or {}).get("output_tokens_per_s") \
                or "steady" not in self.prompts.rates:
            return
        served = served_capacity(mixed["output_tokens_per_s"], self.prompts.schedules["steady"])
        if served >= pace["micro_capacity_per_s"]:
            return
        rate = round(pace["utilization"] * served, 4)
        self.prompts.repace("steady", rate)
        new_pace = dict(pace, rate=rate, served_micro_capacity_per_s=round(served, 4),
                        served_micro_tps=mixed["output_tokens_per_s"], basis=(
                            "utilization x micro-batching's requests/s as served on the mixed load "
                            "(below its in-process replay's micro_capacity_per_s)"))
        bound = self.results["extra"].get("continuous_bound", {}).get("steady")
        if bound:
            bound.update(on_arrivals(bound, lengths_of(self.prompts.schedules["steady"])), pace=new_pace)
        self._record_pace("steady", new_pace)
        log(f"steady load re-paced at {rate:.3f} requests/s: {pace['utilization']:.0%} of the {served:.3f}/s "
            f"micro-batching served on the mixed load ({mixed['output_tokens_per_s']:.1f} tok/s), below the "
            f"{pace['micro_capacity_per_s']:.3f}/s of its in-process replay")

    def _record_pace(self, load: str, pace: dict) -> None:
        """``extra.load_paces[load]``: the rate a load's arrivals were paced to, and why (the steady load's
        also as ``extra.steady_load``, which the report reads)."""
        self.results["extra"].setdefault("load_paces", {})[load] = pace
        if load == "steady":
            self.results["extra"]["steady_load"] = pace

    def poisson_rounds(self, names: List[str], load: str) -> None:
        """The variants on one Poisson load: round k runs micro then continuous (k even) or the
        reverse, over ``poisson_rounds`` rounds; the idle server waits without using the CPU.

        Each variant's row gathers all its rounds (percentiles over every request); its
        throughput is the mean of its rounds' (each over its own wall time), and
        ``round_ratios`` holds continuous / micro per round.
        """
        plan, monitor = self.plan, self.monitor
        t = time.perf_counter()
        schedule, load_plan = self.prompts.schedules[load], self.prompts.load_plan(self.plan, load)
        per_round = {name: [] for name in names}
        records = {name: [] for name in names}
        snap = monitor.snapshot()
        for k in range(plan["poisson_rounds"]):
            if not self.budget.ok(f"{load} poisson round {k + 1}", 30):
                break
            for name in (names if k % 2 == 0 else names[::-1]):
                if plan["quiet_wait"]:
                    monitor.wait_quiet(plan["quiet_wait"])
                server = self.kept[name][0].metrics()
                before = server.snapshot()
                wave = run_schedule(self.kept[name][1], schedule, self.timeout)
                records[name] += wave
                per_round[name].append(summarize(wave))
                per_round[name][-1]["server"] = server.since(before, requests=len(schedule))
                log(f"{name} {load} poisson round {k + 1}: {brief(per_round[name][-1])}")
        contention = monitor.since(snap)
        ratios = [round(c["output_tokens_per_s"] / m["output_tokens_per_s"], 4)
                  for m, c in zip(*(per_round[x] for x in VARIANTS))
                  if m.get("output_tokens_per_s") and c.get("output_tokens_per_s")] if len(names) == 2 else []
        for name in names:
            rounds = [r for r in per_round[name] if r.get("output_tokens_per_s")]
            if not records[name]:
                continue
            run = summarize(records[name], system=name, rounds=len(per_round[name]), round_ratios=ratios,
                            **poisson_labels(load_plan, schedule, load))
            run.update(contention)
            run["server_forward_rounds"] = [r["server"].get("forward") for r in per_round[name]]
            run.update(self._ideal_at_served_costs(load, schedule, rounds))
            if rounds:
                wall = statistics.mean(r["wall_s"] for r in rounds)
                rates = [r["output_tokens_per_s"] for r in rounds]
                run.update(output_tokens_per_s=round(statistics.mean(rates), 3), output_tokens_per_s_rounds=rates,
                           wall_s=round(wall, 3), **poisson_rates(run["ok"] / len(rounds), wall, schedule))
            self.runs.append(run)
        log(f"{load} poisson pairs: continuous / micro per round {ratios}")
        self.phases[f"poisson_{load}_pairs_s"] = time.perf_counter() - t

    def _ideal_at_served_costs(self, load: str, schedule, rounds: List[dict]) -> dict:
        """Each round's ideal (and micro-batching's replay) priced at the server's own forward passes in
        it, and served / that ideal. Micro-batching's rounds price what the load allows at the passes a
        server without continuous batching's overlap ran (``report``'s wide-load ratio)."""
        from scripts.bench.continuous_bound import at_served_costs

        bound = self.results["extra"].get("continuous_bound", {}).get(load)
        if not bound:
            return {}
        ideals = [at_served_costs(bound, r["server"].get("forward", {}), lengths_of(schedule)) for r in rounds]
        ratios = [round(r["output_tokens_per_s"] / ideal["ideal_tps"], 4) for r, ideal in zip(rounds, ideals) if ideal]
        return dict(ideal_at_served_costs=[ideal and dict(ideal, step_ms={str(k): v for k, v in ideal["step_ms"].items()})
                                           for ideal in ideals],
                    vs_ideal_at_served_costs=ratios)

    def stop_variants(self) -> None:
        for name, (system, _) in self.kept.items():
            self.serving_choices(name, system)
            system.stop()
            self.results["systems"][name]["timings"] = system.timings

    # -- 3. peers, when installed -------------------------------------------------------------

    def peers(self) -> None:
        """Each installed peer, alone on the machine, through the same sweep as the served variants."""
        from scripts.bench.systems import LlamaCppSystem, VllmSystem

        args, plan, budget, results = self.args, self.plan, self.budget, self.results
        max_length = self.cfg.handler.max_length
        peers = [LlamaCppSystem(self.work / "llama.cpp", self.weight_dtype, self.threads, self.micro, max_length, args.llama_gguf,
                                cpu_class=self.emulated),
                 LlamaCppSystem(self.work / "llama.cpp-q8_0", self.dtype, self.threads, self.micro, max_length, quant="q8_0",
                                cpu_class=self.emulated),
                 VllmSystem(self.work / "vllm", self.checkpoint, self.dtype, self.micro, max_length)]
        for peer in peers:
            t = time.perf_counter()
            try:
                found, detail = peer.detect()
            except Exception as exc:  # noqa: BLE001
                found, detail = False, f"not installed ({type(exc).__name__}: {exc})"
            status = results["systems"][peer.name] = {"status": "ok" if found else "not installed", "detail": detail}
            if found and self.emulated and isinstance(peer, VllmSystem):
                status.update(status="skipped", detail=self._unemulated(f"vLLM's CPU build ({detail})"))
            elif found and (not plan["peers"] or args.no_peers):
                status.update(status="skipped", detail=f"installed ({detail}) but skipped in this mode")
            elif found and peer.name not in args.systems:
                status.update(status="skipped", detail=f"installed ({detail}) but not selected (--systems)")
            if status["status"] != "ok":
                log(f"{peer.name}: {status['detail']}")
                continue
            if not budget.ok(peer.name, 120):
                status.update(status="skipped", detail="out of the time budget")
                continue
            if isinstance(peer, LlamaCppSystem):
                self._peer_gguf(peer, status)
                self._peer_flash_attn(peer, status)
            try:
                adapter = peer.start(timeout=min(900, budget.left()))
                log(f"{peer.name} ready in {peer.timings['start_to_ready_s']} s (pid {peer.pid})")
                run_wave(adapter, [self.prompts.warm], 4, self.timeout)
                self._paced("mixed")  # the served variants' rounds paced it already, unless they did not run
                sweep(peer.name, lambda ps, n, a=adapter: run_wave(a, ps, n, self.timeout), self.prompts, plan, budget,
                      self.runs, self.monitor, schedule_runner=lambda s, a=adapter: run_schedule(a, s, self.timeout))
                if peer.name in ("llama.cpp", report.QUANTIZED_PEER):
                    self._paired_with_peer(peer.name, adapter)
            except Exception as exc:  # noqa: BLE001
                traceback.print_exc()
                status.update(status="failed", detail=f"{type(exc).__name__}: {exc}"[:2000])
            finally:
                peer.stop()
                status["timings"] = peer.timings
            self.phases[f"{peer.name}_s"] = time.perf_counter() - t

    def _peer_gguf(self, peer, status: dict) -> None:
        """llama-server's 16-bit GGUF of the bf16 checkpoint for this run, the faster here
        (:func:`scripts.bench.peer_flags.choose_gguf`); a ``--llama-gguf`` or a quantized peer is kept."""
        from scripts.bench.peer_flags import choose_gguf, other_16_bit_gguf, other_16_bit_type, timed_detail
        from scripts.bench.plan import gguf_type_of

        if self.weight_dtype != "bfloat16" or self.args.llama_gguf or peer.name != "llama.cpp" \
                or not pairs_planned(self.plan):
            return
        default = gguf_type_of(self.weight_dtype)
        other = other_16_bit_gguf(peer.gguf, default)
        if not other.exists():
            status["gguf"] = {"choice": default, "file": peer.gguf.name,
                              "error": f"not timed: no {other} (make bench-peers BENCH_PEERS=gguf)"}
        elif self.budget.ok(f"{peer.name} GGUF type", 180):
            t = time.perf_counter()
            try:
                status["gguf"] = choose_gguf(peer, default, self.prompts, self.plan, self.monitor,
                                             lambda a, ps, n: run_wave(a, ps, n, self.timeout), log)
            except Exception as exc:  # noqa: BLE001 - the peer still runs, on the default GGUF
                traceback.print_exc()
                status["gguf"] = {"choice": default, "file": peer.gguf.name, "error": f"{type(exc).__name__}: {exc}"[:500]}
            self.phases[f"{peer.name}_gguf_s"] = time.perf_counter() - t
        chosen = status.get("gguf", {})
        timed = timed_detail("the other 16-bit GGUF", f"{other_16_bit_type(default)}_over_{default}", chosen)
        status["detail"] = f"{peer.binary} with {peer.gguf}" + (timed or (f" ({chosen['error']})" if "error" in chosen else ""))

    def _peer_flash_attn(self, peer, status: dict) -> None:
        """llama-server's ``-fa`` for this run, the faster here (:mod:`scripts.bench.peer_flags`)."""
        from scripts.bench.peer_flags import choose_flash_attn, timed_detail

        if pairs_planned(self.plan) and self.budget.ok(f"{peer.name} -fa", 180):
            t = time.perf_counter()
            try:
                status["flash_attn"] = choose_flash_attn(peer, self.prompts, self.plan, self.monitor,
                                                         lambda a, ps, n: run_wave(a, ps, n, self.timeout), log)
            except Exception as exc:  # noqa: BLE001 - the peer still runs, with its default
                traceback.print_exc()
                status["flash_attn"] = {"choice": peer.flash_attn, "error": f"{type(exc).__name__}: {exc}"[:500]}
            self.phases[f"{peer.name}_flash_attn_s"] = time.perf_counter() - t
        status["detail"] += f", -fa {peer.flash_attn}" + timed_detail("-fa auto", "off_over_auto", status.get("flash_attn", {}))

    def _paired_with_peer(self, name: str, adapter) -> None:
        """The peer against each served variant still up, in back-to-back A/B waves (``paired-peer/<variant>``
        rows): the sweeps ran tens of minutes apart, and this host's speed drifts by tens of percent. The int8
        variant meets llama-server on the q8_0 GGUF, the others llama-server in the dtype served."""
        plan = self.plan
        if not self.kept or not pairs_planned(plan) or not self.budget.ok(f"paired {name}", 60):
            return
        t = time.perf_counter()
        for variant in self.kept:
            if (variant == report.INT8) != (name == report.QUANTIZED_PEER):
                continue
            # llama.cpp in both, on one GGUF: both held to the bandwidth around their waves, as the torch rows are
            same_engine = variant == report.LLAMACPP and name == "llama.cpp"
            bracket = (self._bandwidth_now, self.results["decode_bound"]["weight_bytes_per_token"]) if same_engine else None
            paired(wave_runner(name, adapter, self.timeout), self._kept_runner(variant),
                   self.prompts, plan, self.runs, self.monitor, scenario=f"paired-peer/{report.VARIANT_LABELS[variant]}",
                   ratio="served_over_peer", efficiency=bracket)
        self.phases[f"paired_{name}_s"] = time.perf_counter() - t

    # -- ratios and outputs ------------------------------------------------------------------------

    def outputs(self) -> int:
        """The ratios, the JSON, Markdown, plots (and docs page); 1 when the served handler failed."""
        args, results, phases = self.args, self.results, self.phases
        results["ratios"] = report.ratios(results)
        phases["total_s"] = time.perf_counter() - self.started
        results["phases_s"] = {k: round(v, 2) for k, v in phases.items()}
        everything = list(args.systems) == list(SYSTEMS) and list(args.scenarios) == list(SCENARIOS)
        docs = None if args.no_docs else (args.docs or (report.default_docs(results["machine"])
                                                        if self.plan["docs"] and everything else None))
        written = report.write_all(results, self.out, docs)
        for line in report.ratio_lines(results["ratios"]):
            print(line)
        log(f"wrote {', '.join(str(p) for p in written)} in {phases['total_s']:.0f} s")
        failed = [name for name, s in results["systems"].items() if s["status"] == "failed"]
        if failed:
            log(f"systems that failed: {', '.join(failed)} (see the JSON for the reason)")
        return 1 if results["systems"].get("torchserve", {}).get("status") == "failed" else 0


class _NotSelected(Exception):
    """A system left out by --systems."""


if __name__ == "__main__":
    sys.exit(main())
