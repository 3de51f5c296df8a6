"""llama-server's GGUF type and flash attention, chosen on this CPU before its rows are measured.

llama-server's default (``-fa auto``) turns flash attention on. On the AMX Xeon (family 6 model 167,
bench model, bf16 GGUF, 2 threads) its one-token steps then grew three times as fast with the context
as without it, and ``-fa off`` served one stream 1.18x as fast and 8 streams 1.13x (``ab_served``,
2026-11-30): the peer had been measured below its best. Which setting wins depends on the CPU, so
each run measures both: the two servers up at once, the same waves alternated between them
(:func:`~scripts.bench.scenarios.paired`, at the paired concurrencies), and the peer then runs its
rows with the setting whose throughput was higher over both (the geometric mean of the per-stream-count
medians of the other setting over the default).

The bf16 checkpoint's GGUF type is timed the same way, first: the 16-bit type ``gguf_type: auto``
gives the llamacpp backend on this CPU (:func:`.plan.gguf_type_of`) against the other one. On the
Emerald Rapids VM without AVX512_BF16 (2026-12-03) llama-server served f16 1.06x as fast as bf16 at
one stream and 0.98x at 8 (``ab_served llama-server:bf16 llama-server:f16``).
"""
from __future__ import annotations

import math
from pathlib import Path
from typing import Callable, Dict, List

from .scenarios import paired

#: ``-fa`` settings tried: llama-server's default first (kept on a tie), then off.
SETTINGS = ("auto", "off")
#: The 16-bit GGUF types a bf16 checkpoint may be served from.
SIXTEEN_BIT = ("bf16", "f16")
#: Rounds of each wave per setting: the choice needs a clear winner, not the rows' precision.
ROUNDS = 2
RATIO = "off_over_auto"


def choose_flash_attn(peer, prompts, plan: dict, monitor, run_wave: Callable, log: Callable[[str], None]) -> dict:
    """Start ``peer`` (a :class:`~scripts.bench.systems.LlamaCppSystem`, not started) with each of
    :data:`SETTINGS`, time them against each other and set ``peer.flash_attn`` to the faster.

    ``run_wave(adapter, prompts, max_new_tokens)`` sends one wave. Returns what the run records: the
    choice, each stream count's median ratio and rounds, and each setting's output tok/s.
    """
    twins = {s: peer.twin(peer.work.parent / f"{peer.work.name}-fa-{s}", flash_attn=s) for s in SETTINGS}
    return decide(peer, _time_twins(twins, prompts, plan, monitor, run_wave, f"flash-attn/{peer.name}", RATIO), log)


def choose_gguf(peer, default: str, prompts, plan: dict, monitor, run_wave: Callable,
                log: Callable[[str], None]) -> dict:
    """Time ``peer`` on its GGUF (of 16-bit type ``default``) against the same checkpoint's other 16-bit
    GGUF beside it, and keep the faster in ``peer.gguf`` (``default`` on a tie)."""
    other = other_16_bit_type(default)
    files = {default: Path(peer.gguf), other: other_16_bit_gguf(peer.gguf, default)}
    twins = {t: peer.twin(peer.work.parent / f"{peer.work.name}-{t}", gguf=files[t]) for t in (default, other)}
    ratio = f"{other}_over_{default}"
    rows = _time_twins(twins, prompts, plan, monitor, run_wave, f"gguf/{peer.name}", ratio)
    overall, medians = _overall(rows, other, ratio, f"{peer.name}: no wave completed on both GGUF types")
    choice = other if overall > 1 else default
    peer.gguf = files[choice]
    log(f"{peer.name}: {other} GGUF / {default} GGUF {overall:.3f} "
        f"({', '.join(f'{c} streams {m:.3f}' for c, m in medians.items())}); runs on {peer.gguf.name}")
    return {"choice": choice, "file": peer.gguf.name, ratio: round(overall, 4), "medians": medians,
            **_record(rows, other, ratio)}


def other_16_bit_type(default: str) -> str:
    return next(t for t in SIXTEEN_BIT if t != default)


def other_16_bit_gguf(gguf, default: str) -> Path:
    """The GGUF beside ``gguf`` (``bench-model-<default>.gguf``) in the other type of :data:`SIXTEEN_BIT`."""
    return Path(gguf).with_name(Path(gguf).name.replace(default, other_16_bit_type(default)))


def timed_detail(against: str, ratio_name: str, chosen: dict) -> str:
    """`` (timed against AGAINST here: RATIO_NAME r, at 1 streams m1, 8 streams m8)`` for a systems table,
    from a choice's record; empty where it holds no ratio."""
    if ratio_name not in chosen:
        return ""
    return (f" (timed against {against} here: {ratio_name.replace('_over_', ' / ')} {chosen[ratio_name]:.2f}, at "
            + ", ".join(f"{c} streams {m:.2f}" for c, m in chosen["medians"].items()) + ")")


def _time_twins(twins: Dict[str, object], prompts, plan: dict, monitor, run_wave: Callable, scenario: str,
                ratio: str) -> List[dict]:
    """Both ``twins`` (label: a server not started) up at once, warmed, then the paired waves alternated
    between them; both stopped whatever happens. :func:`paired`'s rows, second over first in ``ratio``."""
    rows: List[dict] = []
    try:
        adapters = {}
        for label, twin in twins.items():
            adapters[label] = twin.start(timeout=300)
            run_wave(adapters[label], [prompts.warm], 4)
        runners = [(label, lambda ps, n, a=adapters[label]: run_wave(a, ps, n)) for label in twins]
        paired(runners[0], runners[1], prompts, {**plan, "paired_rounds": min(ROUNDS, plan["paired_rounds"])},
               rows, monitor, scenario=scenario, ratio=ratio)
    finally:
        for twin in twins.values():
            twin.stop()
    return rows


def _overall(rows: List[dict], second: str, ratio: str, none_message: str):
    """The geometric mean over stream counts of ``second``'s median ratio, and those medians."""
    medians = {str(r["concurrency"]): round(r[f"{ratio}_median"], 4) for r in rows
               if r["system"] == second and r.get(f"{ratio}_median")}
    if not medians:
        raise RuntimeError(none_message)
    return math.exp(sum(math.log(m) for m in medians.values()) / len(medians)), medians


def _record(rows: List[dict], second: str, ratio: str) -> dict:
    return {"rounds": {str(r["concurrency"]): r[ratio] for r in rows if r["system"] == second},
            "output_tokens_per_s": {f"{r['system']}@{r['concurrency']}": r.get("output_tokens_per_s") for r in rows}}


def decide(peer, rows: List[dict], log: Callable[[str], None]) -> dict:
    """The ``-fa`` choice from :func:`paired`'s rows (one per setting and stream count), set on ``peer``."""
    overall, medians = _overall(rows, SETTINGS[1], RATIO, f"{peer.name}: no wave completed on both -fa settings")
    peer.flash_attn = SETTINGS[1] if overall > 1 else SETTINGS[0]
    out = {"choice": peer.flash_attn, RATIO: round(overall, 4), "medians": medians, **_record(rows, SETTINGS[1], RATIO)}
    log(f"{peer.name}: -fa off / -fa auto {overall:.3f} ({', '.join(f'{c} streams {m:.3f}' for c, m in medians.items())}); "
        f"runs with -fa {peer.flash_attn}")
    return out
