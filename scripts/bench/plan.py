"""What a bench run will do, fixed before it measures anything.

* :data:`MODES`: the plan of each mode (``--smoke``, ``--quick``, the default): the model, the
  lengths, concurrencies, Poisson loads (:data:`LOADS`, each a plan key of :data:`POISSON_PLAN`),
  rounds, waits and the time budget; :func:`make_plan` applies the command line to one.
* :data:`SYSTEMS` and :data:`SCENARIOS`, and their ``--systems`` / ``--scenarios`` parsers.
* :class:`Prompts`: the very same prompts and Poisson schedules for every system
  (:func:`poisson_lengths` draws a schedule's arrivals and lengths from the seed).
* :class:`Budget`: the time left (``--max-minutes``); later phases are skipped past it.
* :func:`derived_config`: a served model-config with the run's dtype and threads.
"""
from __future__ import annotations

import argparse
import random
import time
from collections import Counter
from pathlib import Path
from typing import List, Optional

from scripts.bench.prompts import PromptFactory

ROOT = Path(__file__).resolve().parents[2]

#: The first Poisson load: mixed lengths, ``requests`` of them, arriving at ``overload`` times the
#: requests/s that the ideal continuous batcher serves of them in ``continuous_bound``'s saturated
#: replay (every slot busy every step, at the step costs measured in-process before the served
#: rounds). That is more than any system here serves, so that each one's throughput is its capacity
#: on the mix rather than the offered rate: a fixed 1 request/s once offered 2-3x what the 2-vCPU
#: AVX2 EPYC served, and with the native CPU kernels every system on the Zen 5 EPYC kept up with it
#: (139 tok/s each), which measured the offer. ``rate`` is the pace when the run measures no bound
#: to derive it from (a subset of the systems, ``--smoke``).
MIXED = dict(requests=60, overload=1.25, rate=1.0, inputs=[128, 256, 512, 768], outputs=[32, 64, 128, 256])
#: The second Poisson load: short prompts, fifteen answers in sixteen of 8 tokens and one of 960. A
#: micro-batch runs until its longest answer ends, so its rows sit idle most of their steps;
#: continuous batching refills them. How wide the outputs must spread for that to be worth 2x
#: depends on the CPU: what an 8-row decode step costs against a 1-row one, and how much of the
#: run both spend prefilling alike. ``continuous_bound`` (micro unpadded, as it now runs) put the
#: first wide load (inputs 64-256, outputs 8/16/32/64/512 alike, 2/s x 20 s) at 1.51x on the 2-vCPU
#: AVX2 EPYC, and the second (inputs 32/64, 8 for 7 in 8 and 512 for 1 in 8) at 2.20x there and
#: 3.08x on the Zen 5 EPYC, but at 1.86-1.94x on the Zen 5 computing as an AVX2 CPU over bf16
#: weights (an 8-row step 2.1x a 1-row one, prefill 410-700 tok/s): a goal of 2x the load did not
#: allow. This one, at those step costs: 2.37-2.61x there, 4.28x on the Zen 5 EPYC, in about the
#: same time. Paced as the mixed load is, past what the ideal continuous batcher serves: a fixed 3
#: requests/s had stopped saturating the continuous server on the Zen 5 EPYC (it served 2.95 of
#: them a second), and the ratio measured the offer (1.30x) where the bound allowed 3.24x.
#: The bound then priced every decode step at the load's mean request context and every prompt at
#: the rate of its longest one alone: at 1.98x it fell below the 2.14x served on the Zen 3 AVX2 EPYC.
#: Priced at the positions each step's rows read and at a cost per prefill pass plus per token, it
#: put this load at 2.20-2.40x there (four runs of the script, bf16 weights under float32). The prompt
#: GEMM (14d1b38) then sped up micro-batching's 8-prompt prefills more than continuous batching's
#: short merged passes: 1.96x served and 1.96x bound in the full run at d902b27, 2.06x in fbe8759's
#: model; no wider variant of this load (shorter answers or prompts, a long answer in 8 or 32) took
#: that bound past 2.12x. A bf16 K/V cache for the bf16 weights (ffd824a) then made the 8-row steps
#: cheaper against the 1-row ones: 2.64x bound (2.38x with the float32 cache, same minutes), 2.02x
#: served in the full runs at 8f52846 and d174e90, 2.08x at 8d44a6d, 2.20x at f20c12f, 2.36x at bf82d64,
#: 2.29x at 6157340.
WIDE = dict(requests=128, overload=1.25, rate=3.0, inputs=[16, 32], outputs=[8] * 15 + [960])
WIDE_QUICK = dict(WIDE, requests=40, outputs=[8] * 15 + [480])
#: The third Poisson load: the mixed load's lengths, ``requests`` of them, arriving at
#: ``utilization`` of what micro-batching serves on this CPU. Offered past capacity, as the mixed
#: load is, every queue grows until the arrivals stop, and a p99 TTFT is the backlog of the last
#: arrivals, set by throughput and the run's length rather than by how the scheduler admits
#: requests. Paced to the CPU at hand, both servers keep up (on
#: the in-process step costs, or on what micro-batching served on the mixed load where that is less:
#: ``BenchRun._steady_at_served_capacity``), and TTFT measures the wait each scheduler imposes. ``rate`` is the
#: pace when the run measures no continuous bound to derive it from (``--smoke``).
STEADY = dict(requests=30, utilization=0.6, rate=None, inputs=[128, 256, 512, 768], outputs=[32, 64, 128, 256])
LOADS = ("mixed", "wide", "steady")
#: Each load's plan key.
POISSON_PLAN = {"mixed": "poisson", "wide": "poisson_wide", "steady": "poisson_steady"}

# (input tokens, output tokens) pairs; every length pair runs at concurrency 1.
MODES = {
    "smoke": dict(
        model="tiny", dtype="float32", lengths=[(32, 8), (96, 8)], length_repeats=2, ttft_probes=1, probe_tokens=4,
        concurrency=[4], conc_input=32, conc_output=8, rounds=1,
        poisson=dict(rate=4.0, duration=2.0, inputs=[16, 32, 64], outputs=[4, 8]), poisson_rounds=1,
        poisson_wide=dict(rate=4.0, duration=1.5, inputs=[16, 32], outputs=[2, 4, 24]),
        poisson_steady=dict(requests=4, utilization=None, rate=2.0, inputs=[16, 32], outputs=[4, 8]), bound=False,
        membw_gb=0.25, paired_rounds=2, paired_concurrency=[1, 4], quiet_wait=0, quiet_budget=0, peers=False, fp32_decode=False, max_minutes=4, request_timeout=120, docs=False),
    "quick": dict(
        model="bench", dtype="auto", lengths=[(256, 32), (768, 32)], length_repeats=3, ttft_probes=0,
        probe_tokens=0, concurrency=[1, 2, 4, 8, 16], conc_input=128, conc_output=32, rounds=1,
        poisson=dict(MIXED, requests=20, inputs=[64, 128, 256, 512], outputs=[16, 32, 64]), poisson_rounds=1,
        poisson_wide=WIDE_QUICK, poisson_steady=dict(STEADY, requests=12, inputs=[64, 128, 256, 512], outputs=[16, 32, 64]),
        bound=True,
        membw_gb=1.0, paired_rounds=3, paired_concurrency=[1, 8], quiet_wait=10, quiet_budget=60, peers=True, fp32_decode=False, max_minutes=10, request_timeout=300, docs=True),
    "default": dict(
        model="bench", dtype="auto", lengths=[(256, 768), (512, 512), (768, 256)], length_repeats=1,
        ttft_probes=4, probe_tokens=8, concurrency=[1, 2, 4, 8, 16], conc_input=256, conc_output=128, rounds=2,
        poisson=MIXED, poisson_rounds=2, poisson_wide=WIDE, poisson_steady=STEADY, bound=True,
        membw_gb=2.0, paired_rounds=5, paired_concurrency=[1, 8], quiet_wait=30, quiet_budget=300, peers=True, fp32_decode=True, max_minutes=95, request_timeout=900, docs=True),
}

SYSTEMS = ("inprocess", "torchserve", "torchserve-continuous", "torchserve-llamacpp", "torchserve-int8", "llama.cpp",
           "llama.cpp-q8_0", "vllm")
SCENARIOS = ("length", "ttft", "concurrency", "paired", "poisson", "poisson-wide", "poisson-steady")


def log(msg: str) -> None:
    """The bench's progress line."""
    print(f"[bench {time.strftime('%H:%M:%S')}] {msg}", flush=True)


#: The keys of a load that pace it to the CPU at hand (see :meth:`Prompts.pace`).
PACING_KEYS = ("requests", "overload", "utilization")


def at_fixed_rate(load: dict, rate: Optional[float] = None, duration: Optional[float] = None) -> dict:
    """``load`` offered at a fixed ``rate`` (default: its fallback ``rate``) for ``duration`` seconds
    (default: its own, or as long as its ``requests`` take at that rate), no longer paced to the CPU."""
    fixed = {k: v for k, v in load.items() if k not in PACING_KEYS}
    fixed["rate"] = rate or fixed["rate"]
    fixed["duration"] = duration or fixed.get("duration") or load["requests"] / fixed["rate"]
    return fixed


def make_plan(mode: str, scenarios: List[str], poisson_rate: Optional[float] = None,
              poisson_duration: Optional[float] = None, poisson_rounds: Optional[int] = None) -> dict:
    """The plan of ``mode`` with the command line's scenarios and Poisson overrides."""
    plan = dict(MODES[mode])
    plan["scenarios"] = scenarios
    plan["poisson"] = dict(plan["poisson"])
    if poisson_rate or poisson_duration:
        plan["poisson"] = at_fixed_rate(plan["poisson"], poisson_rate, poisson_duration)
    if poisson_rounds:
        plan["poisson_rounds"] = poisson_rounds
    return plan


def pairs_planned(plan: dict) -> bool:
    """Whether ``plan`` runs back-to-back A/B waves: the ``paired`` scenario with at least one round."""
    return "paired" in plan["scenarios"] and bool(plan["paired_rounds"])


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
        paired_only = [c for c in plan["paired_concurrency"] if c not in plan["concurrency"]]  # drawn last: the
        self.waves = {(c, r): [factory.make(plan["conc_input"]) for _ in range(c)]  # sweep's prompts stay the same
                      for c in plan["concurrency"] + paired_only for r in range(plan["rounds"])}
        self.warm = factory.make(16)
        self.schedules = {load: [(t, factory.make(inp), out) for t, inp, out in
                                 poisson_lengths(plan[POISSON_PLAN[load]], max_length, seed)] for load in LOADS}
        self.rates: dict = {}  # load -> the rate :meth:`pace` set

    @property
    def schedule(self) -> list:
        """The mixed load's schedule, as paced (the peers run this one)."""
        return self.schedules["mixed"]

    def load_plan(self, plan: dict, load: str) -> dict:
        """``load``'s plan, with the rate and duration its schedule was paced to (a load given by ``requests``)."""
        load_plan = plan[POISSON_PLAN[load]]
        if load not in self.rates:
            return load_plan
        return dict(load_plan, rate=self.rates[load], duration=round(self.schedules[load][-1][0], 1))

    def pace(self, load: str, rate: float) -> None:
        """Arrivals of ``load`` (drawn at 1 request/s) at ``rate`` per second: the same requests, spread in time."""
        if load in self.rates:
            raise ValueError(f"the {load} load is paced already (at {self.rates[load]}/s)")
        self._spread(load, 1.0, rate)

    def repace(self, load: str, rate: float) -> None:
        """Arrivals of a paced ``load`` at ``rate`` per second instead (the same requests, spread again)."""
        if load not in self.rates:
            raise ValueError(f"the {load} load is not paced yet: pace it")
        self._spread(load, self.rates[load], rate)

    def _spread(self, load: str, was: float, rate: float) -> None:
        self.schedules[load] = [(t * was / rate, ids, out) for t, ids, out in self.schedules[load]]
        self.rates[load] = rate


def choices_text(values: List[int]) -> str:
    """A load's length choices for a table: ``8/16/32``, or ``8 (7 in 8), 512 (1 in 8)`` when weighted."""
    counts = Counter(values)
    if len(set(counts.values())) == 1:
        return "/".join(str(v) for v in sorted(counts))
    return ", ".join(f"{v} ({c} in {len(values)})" for v, c in sorted(counts.items()))


def poisson_lengths(p: dict, max_length: int, seed: int) -> List[tuple]:
    """The Poisson schedule's (arrival s, input tokens, output tokens), drawn from ``seed``.

    A load given by ``requests`` rather than rate and duration (every load of the full and quick runs)
    is drawn at 1 request/s and cut at that many; :meth:`Prompts.pace` sets its rate once the CPU is
    measured.
    """
    if "requests" in p:
        unit = {k: v for k, v in p.items() if k != "requests"}
        return poisson_lengths(dict(unit, rate=1.0, duration=4.0 * p["requests"] + 20), max_length, seed)[:p["requests"]]
    rng = random.Random(seed + 1)
    t, schedule = 0.0, []
    while True:
        t += rng.expovariate(p["rate"])
        if t > p["duration"]:
            return schedule
        inp = rng.choice(p["inputs"])
        schedule.append((t, inp, rng.choice([o for o in p["outputs"] if inp + o <= max_length] or [1])))


#: ``handler.gguf_type`` for a variant's dtype (backend llamacpp); bfloat16: :func:`gguf_type_of`.
GGUF_TYPE_OF = {"auto": "auto", "float32": "f32", "float16": "f16"}


def gguf_type_of(dtype: str) -> str:
    """The GGUF type that stands for ``dtype`` on this CPU (or the emulated class): bf16 weights in the
    16-bit type llama.cpp decodes faster here (:func:`llama_engine.cpu.gguf_16_bit_type`; f16 holds
    the bench checkpoint's bf16 weights exactly), what ``gguf_type: auto`` converts them to."""
    if dtype == "bfloat16":
        from llama_engine.cpu import gguf_16_bit_type

        return gguf_16_bit_type()
    return GGUF_TYPE_OF[dtype]


def derived_config(base: Path, out: Path, dtype: str, threads: Optional[int], overrides: dict) -> Path:
    """``base`` with ``handler.dtype`` (and ``torch_threads``, ``overrides``) set, written to ``out``
    and validated as the project loads it."""
    import yaml

    from llama_engine import load_model_config_file

    data = yaml.safe_load(base.read_text())
    if data["handler"].get("backend") == "llamacpp":  # the GGUF's type stands for the dtype
        data["handler"]["gguf_type"] = gguf_type_of(dtype)
    else:
        data["handler"]["dtype"] = dtype
    if threads:
        data["handler"]["torch_threads"] = threads
    data["handler"].update(overrides)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(f"# derived by scripts/bench from {base.relative_to(ROOT) if base.is_relative_to(ROOT) else base}\n"
                   + yaml.safe_dump(data, sort_keys=False))
    load_model_config_file(str(out))  # the project's validation
    return out
