"""llama-server's flash attention, chosen on this CPU before its rows are measured.

llama-server's default (``-fa auto``) turns flash attention on. On the AMX Xeon (family 6 model 167,
bench model, bf16 GGUF, 2 threads) its one-token steps then grew three times as fast with the context
as without it, and ``-fa off`` served one stream 1.18x as fast and 8 streams 1.13x (``ab_served``,
2026-11-30): the peer had been measured below its best. Which setting wins depends on the CPU, so
each run measures both: the two servers up at once, the same waves alternated between them
(:func:`~scripts.bench.scenarios.paired`, at the paired concurrencies), and the peer then runs its
rows with the setting whose throughput was higher over both (the geometric mean of the per-stream-count
medians of off / auto).
"""
from __future__ import annotations

import math
from typing import Callable, List

from .scenarios import paired

#: ``-fa`` settings tried: llama-server's default first (kept on a tie), then off.
SETTINGS = ("auto", "off")
#: Rounds of each wave per setting: the choice needs a clear winner, not the rows' precision.
ROUNDS = 2
RATIO = "off_over_auto"


def choose_flash_attn(peer, prompts, plan: dict, monitor, run_wave: Callable, log: Callable[[str], None]) -> dict:
    """Start ``peer`` (a :class:`~scripts.bench.systems.LlamaCppSystem`, not started) with each of
    :data:`SETTINGS`, time them against each other and set ``peer.flash_attn`` to the faster.

    ``run_wave(adapter, prompts, max_new_tokens)`` sends one wave. Returns what the run records: the
    choice, each stream count's median ratio and rounds, and each setting's output tok/s.
    """
    twins = {s: peer.with_flash_attn(s, peer.work.parent / f"{peer.work.name}-fa-{s}") for s in SETTINGS}
    rows: List[dict] = []
    try:
        adapters = {}
        for setting, twin in twins.items():
            adapters[setting] = twin.start(timeout=300)
            run_wave(adapters[setting], [prompts.warm], 4)
        runners = [(s, lambda ps, n, a=adapters[s]: run_wave(a, ps, n)) for s in SETTINGS]
        paired(runners[0], runners[1], prompts, {**plan, "paired_rounds": min(ROUNDS, plan["paired_rounds"])},
               rows, monitor, scenario=f"flash-attn/{peer.name}", ratio=RATIO)
    finally:
        for twin in twins.values():
            twin.stop()
    return decide(peer, rows, log)


def decide(peer, rows: List[dict], log: Callable[[str], None]) -> dict:
    """The choice from :func:`paired`'s rows (one per setting and stream count), set on ``peer``."""
    medians = {str(r["concurrency"]): round(r[f"{RATIO}_median"], 4) for r in rows
               if r["system"] == SETTINGS[1] and r.get(f"{RATIO}_median")}
    if not medians:
        raise RuntimeError(f"{peer.name}: no wave completed on both -fa settings")
    overall = math.exp(sum(math.log(m) for m in medians.values()) / len(medians))
    peer.flash_attn = SETTINGS[1] if overall > 1 else SETTINGS[0]
    out = {"choice": peer.flash_attn, "off_over_auto": round(overall, 4), "medians": medians,
           "rounds": {str(r["concurrency"]): r[RATIO] for r in rows if r["system"] == SETTINGS[1]},
           "output_tokens_per_s": {f"{r['system']}@{r['concurrency']}": r.get("output_tokens_per_s") for r in rows}}
    log(f"{peer.name}: -fa off / -fa auto {overall:.3f} ({', '.join(f'{c} streams {m:.3f}' for c, m in medians.items())}); "
        f"runs with -fa {peer.flash_attn}")
    return out
