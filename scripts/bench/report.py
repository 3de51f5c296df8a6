"""Ratios, the JSON file, the Markdown table, the plots and docs/benchmarks.md from one run's results."""
from __future__ import annotations

import json
import os
import re
import shutil
import statistics
from pathlib import Path
from typing import List, Optional

from scripts.bench.plan import MODES, choices_text

#: The page a full run rewrites (``--docs`` names another).
DOCS_PAGE = Path(__file__).resolve().parents[2] / "docs" / "benchmarks.md"

SERVED = "torchserve"
CONTINUOUS = "torchserve-continuous"
#: The handler with the llamacpp backend (continuous batching), served when llama-cpp-python is installed.
LLAMACPP = "torchserve-llamacpp"
#: The micro-batching handler over int8 weights (``handler.weight_dtype: int8``, opt-in and lossy): measured
#: against llama-server on the q8_0 GGUF, never against the bar in the dtype served.
INT8 = "torchserve-int8"
#: The peer each quantized variant is paired with, and held to.
QUANTIZED_PEER = "llama.cpp-q8_0"
#: The served variants' short names in the ``paired-peer/<label>`` rows.
VARIANT_LABELS = {SERVED: "micro", CONTINUOUS: "continuous", LLAMACPP: "llamacpp", INT8: "int8"}
INPROCESS = "inprocess"
#: The llamacpp backend's back-to-back pairs with llama-server (on one GGUF): both bracketed by bandwidth samples.
LLAMACPP_PAIRS = f"paired-peer/{VARIANT_LABELS[LLAMACPP]}"
#: The int8 variant's back-to-back pairs with the micro-batching handler over the weights as served.
INT8_PAIRS = "paired-int8"
PEER_NAMES = ("llama.cpp", "llama.cpp-q8_0", "vllm")
#: Peer ratio goals (served / peer output tok/s) by concurrency: llama.cpp in the dtype served.
LLAMA_CPP_GOALS = {8: 1.0, 1: 0.8}
PLOTS = ("ttft_vs_input.png", "throughput_vs_concurrency.png", "latency_percentiles.png", "poisson_latency.png")
#: The Poisson plot's bars of one system tell its loads apart by hatching.
LOAD_HATCH = {"mixed": "", "wide": "//", "steady": ".."}


# -- ratios ------------------------------------------------------------------------------------

def find(runs, system, scenario, **match) -> Optional[dict]:
    for run in runs:
        if run.get("system") == system and run.get("scenario") == scenario and run.get("ok") \
                and all(run.get(k) == v for k, v in match.items()):
            return run
    return None


def _ratio(value, goal_text, test, definition, **inputs) -> dict:
    """A ratio against its goal; ``test`` None (a figure only reported) leaves ``met`` None."""
    met = None if value is None or test is None else bool(test(value))
    return {"value": None if value is None else round(value, 4), "goal": goal_text, "met": met,
            "definition": definition, "inputs": inputs}


def _as_report(ratio: dict) -> dict:
    """The same figure kept beside a goal's: reported, not held to the goal."""
    return dict(ratio, goal="report", met=None)


def _ttft_growth(runs, system):
    ttft_runs = sorted((r for r in runs if r.get("system") == system and r.get("scenario") == "ttft" and r.get("ok")),
                       key=lambda r: r["input_tokens"])
    if len(ttft_runs) < 2:
        ttft_runs = sorted((r for r in runs if r.get("system") == system and r.get("scenario") == "length"
                            and r.get("ok")), key=lambda r: r["input_tokens"])
    if len(ttft_runs) < 2:
        return None, {}
    short, long_ = ttft_runs[0], ttft_runs[-1]
    t_short, t_long = short["ttft_ms"]["p50"], long_["ttft_ms"]["p50"]
    # TTFT = fixed + per_token x input: the two points give both (the cost of a first token, of a prompt token)
    per_token = (t_long - t_short) / (long_["input_tokens"] - short["input_tokens"])
    return (t_long / t_short,
            {"short_input": short["input_tokens"], "long_input": long_["input_tokens"],
             "ttft_short_ms": t_short, "ttft_long_ms": t_long, "scenario": short["scenario"],
             "per_prompt_token_ms": round(per_token, 3), "fixed_ms": round(t_short - per_token * short["input_tokens"], 1)})


def prefill_floor_ratios(runs, bound: dict) -> dict:
    """How near the in-process prefill runs to the linear layers' bound (``gemm.prefill_bound``), and the
    TTFT growth that bound itself implies: a prompt run at the bound's speed at both lengths, nothing else."""
    if not bound or len(bound) < 2:
        return {}
    lengths = sorted(bound, key=int)
    short_n, long_n = lengths[0], lengths[-1]
    floor = (int(long_n) / bound[long_n]["tokens_per_s"]) / (int(short_n) / bound[short_n]["tokens_per_s"])
    out = {"ttft_growth_at_prefill_bound": _ratio(
        floor, "report", None,
        f"TTFT({long_n}) / TTFT({short_n}) if a prompt cost only its linear layers at this CPU's best matrix-product "
        f"speed for its length (gemm.prefill_bound) and nothing besides: what any implementation faces here",
        bound_tokens_per_s={n: b["tokens_per_s"] for n, b in bound.items()})}
    for n in (short_n, long_n):
        # the rows TTFT growth is taken from: the probes, else the length sweep
        run = find(runs, INPROCESS, "ttft", input_tokens=int(n)) or find(runs, INPROCESS, "length", input_tokens=int(n))
        if run:
            rate = int(n) / (run["ttft_ms"]["p50"] / 1e3)
            out[f"prefill_vs_bound_{n}"] = _ratio(
                rate / bound[n]["tokens_per_s"], "report", None,
                f"{INPROCESS} prompt tokens/s at {n} input ({n} / TTFT p50) / the linear layers' bound on {n} rows",
                prefill_tokens_per_s=round(rate, 1), bound_tokens_per_s=bound[n]["tokens_per_s"])
    return out


def peer_ttft_ratios(runs, results: dict) -> dict:
    """Each peer's own TTFT growth on the same probes, and the served TTFT at the longest probe against
    the peer's: reported beside the goal, to tell a limit of the CPU from one of this code."""
    served_growth, served = _ttft_growth(runs, SERVED)
    out = {}
    for name in PEER_NAMES:
        if results["systems"].get(name, {}).get("status") != "ok":
            continue
        value, inputs = _ttft_growth(runs, name)
        if value is None:
            continue
        out[f"ttft_growth_{name}"] = _ratio(
            value, "report", None,
            f"{name} TTFT p50 at the longest input / at the shortest, the same probes as ttft_growth; as fixed + "
            f"per token: {inputs['fixed_ms']:.0f} ms + {inputs['per_prompt_token_ms']:.2f} ms/token", **inputs)
        if served_growth is not None and served["long_input"] == inputs["long_input"]:
            out[f"ttft_long_vs_{name}"] = _ratio(
                served["ttft_long_ms"] / inputs["ttft_long_ms"], "report", None,
                f"{SERVED} TTFT p50 / {name} TTFT p50 at {inputs['long_input']} input (below 1: the served "
                f"handler answers first)", served_ms=served["ttft_long_ms"], peer_ms=inputs["ttft_long_ms"])
    return out


def _batch1_run(runs, system) -> Optional[dict]:
    """The system's 1-stream sweep row, else its shortest length row (the length sweep runs one stream)."""
    return find(runs, system, "concurrency", concurrency=1) or next(
        iter(sorted((r for r in runs if r.get("system") == system and r.get("scenario") == "length" and r.get("ok")),
                    key=lambda r: r["input_tokens"])), None)


def int8_ratios(runs, results: dict, c: int) -> dict:
    """Where the int8 variant ran: its output tok/s against llama-server's on the q8_0 GGUF and against the
    handler's over the weights as served (each from back-to-back pairs where the run has them, else from the
    sweeps), and its batch-1 decode against the memory's speed at int8's bytes (values and scales)."""
    out = {}
    for suffix, conc in (("", c), ("_1_stream", 1)):
        for key, other, whose, note in (
                (f"int8_vs_{QUANTIZED_PEER}", QUANTIZED_PEER, f"{QUANTIZED_PEER}'s", ", both 8-bit weights"),
                ("int8_vs_served_weights", SERVED,
                 f"{SERVED}'s over the weights as served ({results['model'].get('weight_dtype')})", "")):
            ratio = _int8_against(runs, other, conc, f"{whose} at {conc} stream(s){note}")
            if ratio:
                out[key + suffix] = ratio
    run, nbytes = find(runs, INT8, "concurrency", concurrency=1), results["model"].get("int8_weight_bytes_per_token")
    rate = run and run.get("decode_tokens_per_s_per_stream")
    if rate and nbytes:
        bound = results["decode_bound"]
        out["batch1_decode_efficiency_int8"] = _ratio(
            rate * nbytes / (bound["bandwidth_gb_per_s"] * 1e9), "report", None,
            f"{INT8} batch-1 decode tok/s (its sweep) x int8 weight bytes per token (values and scales) / the best "
            f"memory bandwidth of the run ({bound['threads']} threads)",
            decode_tokens_per_s=rate, weight_bytes_per_token=nbytes, bandwidth_gb_per_s=bound["bandwidth_gb_per_s"])
    return out


def _int8_against(runs, other: str, conc: int, what: str) -> Optional[dict]:
    """The int8 variant's output tok/s over ``other``'s (``what``, for the definition) at ``conc`` streams: the
    median of their back-to-back pairs where the run has them, else the two sweeps'; None where either did not
    run."""
    scenario, key = {QUANTIZED_PEER: (f"paired-peer/{VARIANT_LABELS[INT8]}", "served_over_peer"),
                     SERVED: (INT8_PAIRS, "int8_over_weights")}[other]
    pair = find(runs, INT8, scenario, concurrency=conc)
    definition = f"{INT8} output tok/s / {what}"
    if pair and pair.get(f"{key}_median"):
        return _ratio(pair[f"{key}_median"], "report", None,
                      f"{definition}: median of {len(pair[key])} back-to-back A/B pairs of the same wave",
                      concurrency=conc, pairs=pair[key])
    mine, theirs = (find(runs, system, "concurrency", concurrency=conc) for system in (INT8, other))
    if mine and theirs:
        return _ratio(mine["output_tokens_per_s"] / theirs["output_tokens_per_s"], "report", None,
                      f"{definition} (the sweeps)", concurrency=conc)
    return None


def decode_floor_ratios(runs, results: dict) -> dict:
    """Batch-1 decode against the linear products alone (``gemm.decode_products``): the efficiency such
    a step would score on this CPU, and the share of it the in-process decode reaches."""
    products = results.get("decode_products")
    if not products:
        return {}
    bound = results["decode_bound"]
    out = {"batch1_decode_efficiency_at_products_bound": _ratio(
        products["tokens_per_s"] * bound["weight_bytes_per_token"] / (bound["bandwidth_gb_per_s"] * 1e9),
        "report", None,
        "batch-1 decode efficiency of a step that ran only the model's linear products, on this CPU's faster kernel "
        "(gemm.decode_products: one row through every layer's own weights), against the run's best bandwidth: "
        "what any implementation on these kernels faces here",
        products_tokens_per_s=products["tokens_per_s"], products_gb_per_s=products["gb_per_s"],
        kernel=products["kernel"])}
    run = _batch1_run(runs, INPROCESS)
    rate = run and run.get("decode_tokens_per_s_per_stream")
    if rate:
        out["batch1_decode_vs_products"] = _ratio(
            rate / products["tokens_per_s"], "report", None,
            f"{INPROCESS} batch-1 decode tok/s (its 1-stream sweep) / the linear products' alone: the rest of a step "
            "(norms, attention, rotary, sampling) is the difference",
            decode_tokens_per_s=rate, products_tokens_per_s=products["tokens_per_s"])
    return out


def llamacpp_engine_ratios(runs, results: dict) -> dict:
    """Where the llamacpp backend served one stream: llama-server's own batch-1 efficiency on the same
    GGUF, and the backend's speed over llama-server's in back-to-back pairs. Together they say
    whether a shortfall of ``batch1_decode_efficiency_llamacpp`` is ggml's kernels or the serving."""
    if not _batch1_run(runs, LLAMACPP):
        return {}
    out = {}
    peer = _batch1_run(runs, "llama.cpp")
    rate = peer and peer.get("decode_tokens_per_s_per_stream")
    if rate:
        bound = results["decode_bound"]
        against_best = _ratio(
            rate * bound["weight_bytes_per_token"] / (bound["bandwidth_gb_per_s"] * 1e9), "report", None,
            "llama.cpp batch-1 decode tok/s (its sweep) x weight bytes per token / the best memory bandwidth of the "
            "run: upstream's build of the engine the llamacpp backend runs (whose build adds scripts/patch_ggml.py's "
            "weight prefetch), on the same GGUF, with no TorchServe in front",
            decode_tokens_per_s=rate)
        bracketed = _bracketed_efficiency(find(runs, "llama.cpp", LLAMACPP_PAIRS, concurrency=1), "llama.cpp",
                                          "report", None, "rounds paired with the llamacpp backend's")
        out.update(_bracketed_or_best("batch1_decode_efficiency_llama.cpp", bracketed, against_best))
    pair = find(runs, LLAMACPP, LLAMACPP_PAIRS, concurrency=1)
    if pair and pair.get("served_over_peer_median"):
        out["llamacpp_vs_llama.cpp_1_stream"] = _ratio(
            pair["served_over_peer_median"], "report", None,
            f"{LLAMACPP} output tok/s / llama.cpp's at 1 stream, the same GGUF: median of "
            f"{len(pair['served_over_peer'])} back-to-back A/B pairs of the same wave (the backend's llama.cpp "
            "with scripts/patch_ggml.py's weight prefetch, behind the engine and TorchServe, against upstream's)",
            pairs=pair["served_over_peer"])
    return out


def _bracketed_efficiency(pair: Optional[dict], system: str, goal_text: str, test, rounds_text: str,
                          **inputs) -> Optional[dict]:
    """``system``'s batch-1 efficiency from a paired row whose 1-stream rounds sat between bandwidth
    samples (:func:`scripts.bench.scenarios.paired`'s ``efficiency``); None where the row has none."""
    if not pair or not pair.get("decode_efficiency_median"):
        return None
    return _ratio(
        pair["decode_efficiency_median"], goal_text, test,
        f"{system} batch-1 decode tok/s x weight bytes per token / the memory bandwidth measured right before and "
        f"after it (median of {len(pair['decode_efficiency_rounds'])} {rounds_text})",
        rounds=pair["decode_efficiency_rounds"], bandwidth_gb_per_s_samples=pair["bandwidth_gb_per_s_rounds"], **inputs)


def _bracketed_or_best(key: str, bracketed: Optional[dict], against_best: dict) -> dict:
    """``key`` held to the bandwidth read around its measurement, with the run's best beside it as
    ``<key>_vs_best_bandwidth``; against the best alone where there is no bracketed figure."""
    if bracketed is None:
        return {key: against_best}
    return {key: bracketed, f"{key}_vs_best_bandwidth": _as_report(against_best)}


def fp32_decode_efficiency(fp32: dict, best_bw: float) -> dict:
    """``batch1_decode_efficiency_fp32``: against the bandwidth sampled right before and after its wave
    (``bandwidth_gb_per_s_bracket``), as the main variant's paired rounds are, with the run's best
    bandwidth as a report; a run without the bracket (before it was taken) against the best alone.

    This host's 2-thread bandwidth read 48 and 76 GB/s at the two ends of one run, so a single
    wave held to the best sample of the run measured the minute it ran in more than its decode."""
    rate, nbytes = fp32["decode_tokens_per_s_per_stream"], fp32["weight_bytes_per_token"]
    goal, met = ">= 0.50", (lambda v: v >= 0.50)
    against_best = _ratio(rate * nbytes / best_bw if rate else None, goal, met,
                          "the float32 variant, in-process: batch-1 decode tok/s x its weight bytes per token / the "
                          "best memory bandwidth of the run", decode_tokens_per_s=rate, weight_bytes_per_token=nbytes)
    bracket = fp32.get("bandwidth_gb_per_s_bracket")
    bracketed = _ratio(
        rate * nbytes / (sum(bracket) / len(bracket) * 1e9), goal, met,
        "the float32 variant, in-process: batch-1 decode tok/s x its weight bytes per token / the memory bandwidth "
        "measured right before and after its wave", decode_tokens_per_s=rate, weight_bytes_per_token=nbytes,
        bandwidth_gb_per_s_samples=bracket) if bracket and rate else None
    return _bracketed_or_best("batch1_decode_efficiency_fp32", bracketed, against_best)


def _latency_split(served: dict, inprocess: Optional[dict]) -> dict:
    """The paired rows' TTFT and inter-token p50s, served then in-process: whether serving cost the
    first token (the batch delay, a slow prefill) or every token (the frontend's round trips)."""
    if not inprocess:
        return {}
    try:
        return {key: [served[row]["p50"], inprocess[row]["p50"]] for key, row in (("ttft_p50_ms", "ttft_ms"),
                                                                                 ("itl_p50_ms", "itl_ms"))}
    except (KeyError, TypeError):  # a row without latencies (a run from before they were kept)
        return {}


def ratios(results: dict) -> dict:
    runs = results["runs"]
    plan = results["plan"]
    c = 8 if 8 in plan["concurrency"] else max(plan["concurrency"])
    out = {}

    served = find(runs, SERVED, "concurrency", concurrency=c)
    inproc = find(runs, INPROCESS, "concurrency", concurrency=c)
    sweep_value = (served["output_tokens_per_s"] / inproc["output_tokens_per_s"]) if served and inproc else None
    for key, conc in (("serving_overhead", c), ("serving_overhead_batch1", 1)):
        pair = find(runs, SERVED, "paired", concurrency=conc)
        if pair and pair.get("served_over_inprocess_median"):
            split = _latency_split(pair, find(runs, INPROCESS, "paired", concurrency=conc))
            out[key] = _ratio(
                pair["served_over_inprocess_median"], ">= 0.90", lambda v: v >= 0.90,
                f"served output tok/s at {conc} stream(s) / in-process at batch {conc}: median of "
                f"{len(pair['served_over_inprocess'])} back-to-back A/B pairs of the same wave"
                + (f"; served / in-process TTFT p50 {split['ttft_p50_ms'][0]:.0f} / {split['ttft_p50_ms'][1]:.0f} ms, "
                   f"ITL p50 {split['itl_p50_ms'][0]:.1f} / {split['itl_p50_ms'][1]:.1f} ms" if split else ""),
                concurrency=conc, pairs=pair["served_over_inprocess"],
                from_the_sweeps=round(sweep_value, 4) if sweep_value and conc == c else None, **split)
        elif key == "serving_overhead":
            out[key] = _ratio(
                sweep_value, ">= 0.90", lambda v: v >= 0.90,
                f"served output tok/s at {c} streams / in-process output tok/s at batch {c} (the two sweeps)",
                concurrency=c, served_tokens_per_s=served and served["output_tokens_per_s"],
                inprocess_tokens_per_s=inproc and inproc["output_tokens_per_s"])

    bw = results["decode_bound"]["bandwidth_gb_per_s"] * 1e9
    nbytes = results["decode_bound"]["weight_bytes_per_token"]
    # each system's bracketed rounds: the torch rows' pairs with each other, the llamacpp backend's with llama-server
    for key, system, pairs in (("batch1_decode_efficiency", INPROCESS, "paired"),
                               ("batch1_decode_efficiency_served", SERVED, "paired"),
                               ("batch1_decode_efficiency_llamacpp", LLAMACPP, LLAMACPP_PAIRS)):
        run = _batch1_run(runs, system)
        rate = run and run.get("decode_tokens_per_s_per_stream")
        against_best = _ratio(
            rate * nbytes / bw if rate else None, ">= 0.50", lambda v: v >= 0.50,
            f"{system} batch-1 decode tok/s (its sweep) x weight bytes per token / the best memory bandwidth of the run "
            f"({results['decode_bound']['threads']} threads)",
            decode_tokens_per_s=rate, weight_bytes_per_token=nbytes,
            bandwidth_gb_per_s=results["decode_bound"]["bandwidth_gb_per_s"],
            input_tokens=run and run["input_tokens"], output_tokens=run and run["output_tokens"])
        if system == LLAMACPP and not run:
            continue
        bracketed = _bracketed_efficiency(find(runs, system, pairs, concurrency=1), system, ">= 0.50",
                                          lambda v: v >= 0.50,
                                          f"paired rounds, {results['decode_bound']['threads']} threads",
                                          weight_bytes_per_token=nbytes)
        out.update(_bracketed_or_best(key, bracketed, against_best))
    out.update(llamacpp_engine_ratios(runs, results))
    out.update(int8_ratios(runs, results, c))
    out.update(decode_floor_ratios(runs, results))
    fp32 = results.get("extra", {}).get("fp32_batch1")
    if fp32 and fp32.get("ok"):
        out.update(fp32_decode_efficiency(fp32, bw))

    for key, system in (("ttft_growth", SERVED), ("ttft_growth_inprocess", INPROCESS), ("ttft_growth_llamacpp", LLAMACPP)):
        value, inputs = _ttft_growth(runs, system)
        if system == LLAMACPP and value is None:
            continue
        out[key] = _ratio(value, "<= 2.5", lambda v: v <= 2.5,
                          f"{system} TTFT p50 at the longest input / at the shortest (768 / 256 in the full run)"
                          + (f"; as fixed + per token: {inputs['fixed_ms']:.0f} ms + {inputs['per_prompt_token_ms']:.2f} "
                             "ms/token" if inputs else ""),
                          **inputs)
    out.update(prefill_floor_ratios(runs, results.get("prefill_bound")))
    out.update(peer_ttft_ratios(runs, results))

    out.update(continuous_ratios(runs, results.get("extra")))
    best, best1 = _best_served(runs, c), _best_served(runs, 1)
    peers = {}
    for name in PEER_NAMES:
        if results["systems"].get(name, {}).get("status") != "ok":
            continue
        peer = find(runs, name, "concurrency", concurrency=c)
        if peer and best:
            if name != "llama.cpp-q8_0":  # a quantized model reads fewer bytes: labelled apart, not the bar
                peers[name] = peer["output_tokens_per_s"]
            goal = LLAMA_CPP_GOALS.get(c) if name == "llama.cpp" else None
            out[f"peer_ratio_{name}"] = _ratio(
                best["output_tokens_per_s"] / peer["output_tokens_per_s"], f">= {goal}" if goal else "report",
                (lambda v, g=goal: v >= g) if goal else None,
                f"served output tok/s ({best['system']}) / {name} output tok/s at {c} streams", concurrency=c)
        single = find(runs, name, "concurrency", concurrency=1)
        if single and best1:
            goal = LLAMA_CPP_GOALS[1] if name == "llama.cpp" else None
            out[f"peer_ratio_{name}_1_stream"] = _ratio(
                best1["output_tokens_per_s"] / single["output_tokens_per_s"], f">= {goal}" if goal else "report",
                (lambda v, g=goal: v >= g) if goal else None,
                f"served output tok/s ({best1['system']}) / {name} output tok/s at 1 stream", concurrency=1,
                by_variant={r["system"]: round(r["output_tokens_per_s"] / single["output_tokens_per_s"], 4)
                            for r in _served_rows(runs, 1)})
    out.update(_paired_peer_ratios(runs, out, c))
    if peers:
        strongest = max(peers, key=peers.get)
        out["peer_ratio_strongest"] = _ratio(
            best["output_tokens_per_s"] / peers[strongest], ">= 1.0", lambda v: v >= 1.0,
            f"served output tok/s ({best['system']}) / the strongest peer's ({strongest}) at {c} streams",
            peer=strongest, served_system=best["system"])
    else:
        states = {n: results["systems"].get(n, {}).get("status", "not checked") for n in PEER_NAMES}
        out["peer_ratio_strongest"] = _ratio(None, ">= 1.0", None,
                                             "served output tok/s / the strongest peer's; no peer ran", **states)
    return out


def _paired_peer_ratios(runs, sweep_ratios: dict, c: int) -> dict:
    """llama-server's goals from back-to-back A/B waves against each served variant, where the run has
    them (the best variant's median counts); the ratios of the sweeps, tens of minutes apart, stay as
    ``_sweeps`` rows."""
    out = {}
    for key, conc in (("peer_ratio_llama.cpp", c), ("peer_ratio_llama.cpp_1_stream", 1)):
        pairs = {}
        for variant, label in VARIANT_LABELS.items():
            if variant == INT8:  # held to the q8_0 peer (int8_ratios)
                continue
            row = find(runs, variant, f"paired-peer/{label}", concurrency=conc)
            if row and row.get("served_over_peer_median"):
                pairs[variant] = row
        if not pairs:
            continue
        best = max(pairs, key=lambda v: pairs[v]["served_over_peer_median"])
        goal = LLAMA_CPP_GOALS.get(conc)
        out[key] = _ratio(
            pairs[best]["served_over_peer_median"], f">= {goal}" if goal else "report",
            (lambda v, g=goal: v >= g) if goal else None,
            f"served output tok/s ({best}) / llama.cpp output tok/s at {conc} stream(s): median of "
            f"{len(pairs[best]['served_over_peer'])} back-to-back A/B pairs of the same wave",
            concurrency=conc, pairs=pairs[best]["served_over_peer"],
            by_variant={v: row["served_over_peer_median"] for v, row in pairs.items()})
        if key in sweep_ratios:
            out[f"{key}_sweeps"] = _as_report(sweep_ratios[key])
    return out


def _served_rows(runs, concurrency: int) -> List[dict]:
    """The served variants' concurrency-sweep rows at ``concurrency`` (those that ran)."""
    return [r for r in (find(runs, s, "concurrency", concurrency=concurrency) for s in (SERVED, CONTINUOUS, LLAMACPP))
            if r]


def _best_served(runs, concurrency: int) -> Optional[dict]:
    """The served variant with the higher output tok/s at ``concurrency``: the handler as a user would configure it."""
    return max(_served_rows(runs, concurrency), key=lambda r: r["output_tokens_per_s"], default=None)


def continuous_ratios(runs, extra: Optional[dict] = None) -> dict:
    """Continuous batching against micro-batching, both served: the same Poisson schedule, and the
    same static waves back to back (the ``paired-variants`` rows)."""
    out = {}
    waves = sorted((r for r in runs if r.get("system") == CONTINUOUS and r.get("scenario") == "paired-variants"
                    and r.get("ok") and r.get("continuous_over_micro_median")), key=lambda r: r["concurrency"])
    if waves:
        run = waves[-1]
        out["continuous_static_vs_micro"] = _ratio(
            run["continuous_over_micro_median"], "report", None,
            f"{run['concurrency']} streams arriving together: continuous-batching output tok/s / micro-batching "
            f"output tok/s, median of {len(run['continuous_over_micro'])} back-to-back A/B pairs of the same wave",
            concurrency=run["concurrency"], pairs=run["continuous_over_micro"])
    bounds = (extra or {}).get("continuous_bound", {})
    micro, cont = poisson_run(runs, SERVED, "mixed"), poisson_run(runs, CONTINUOUS, "mixed")
    if micro and cont:
        out["continuous_throughput_vs_micro"] = _ratio(
            cont["output_tokens_per_s"] / micro["output_tokens_per_s"], "report", None,
            "Poisson run (mixed load): continuous-batching output tok/s / micro-batching output tok/s (same "
            "schedule, same slots, mean of alternating rounds)",
            continuous=cont["output_tokens_per_s"], micro=micro["output_tokens_per_s"],
            round_ratios=cont.get("round_ratios"), bound=bounds.get("mixed", {}).get("bound"))
        out["continuous_p99_ttft_vs_micro"] = _p99_ttft_ratio(
            cont, micro, bounds.get("mixed", {}), "report", None,
            "Poisson run (mixed load): continuous-batching TTFT p99 / micro-batching TTFT p99 (the goal is on "
            "the steady load: this load offers more than both servers serve, so every queue grows until the "
            "arrivals stop and p99 TTFT is the backlog of the last arrivals)")
    micro_s, cont_s = poisson_run(runs, SERVED, "steady"), poisson_run(runs, CONTINUOUS, "steady")
    if micro_s and cont_s:
        pace = (extra or {}).get("steady_load", {})
        paced = ""
        if pace.get("utilization"):
            of = ("the requests/s micro-batching served on the mixed load" if pace.get("served_micro_capacity_per_s")
                  else "micro-batching's requests/s on this CPU")
            paced = f"{pace['utilization']:.0%} of {of}, "
        out["continuous_p99_ttft_vs_micro_steady"] = _p99_ttft_ratio(
            cont_s, micro_s, bounds.get("steady", {}), "<= 0.5", lambda v: v <= 0.5,
            f"Poisson run (steady load: {cont_s['requests'] // max(cont_s.get('rounds') or 1, 1)} requests of "
            f"the mixed load's lengths at {cont_s['rate_per_s']}/s, {paced}a pace both servers keep up with): "
            "continuous-batching TTFT p99 / micro-batching TTFT p99")
    if cont and bounds.get("mixed"):
        out.update(_vs_ideal(cont, bounds["mixed"], "mixed", ">= 0.95", lambda v: v >= 0.95))
    vllm = poisson_run(runs, "vllm", "mixed")
    if cont and vllm:
        out["continuous_vs_vllm"] = _ratio(
            cont["output_tokens_per_s"] / vllm["output_tokens_per_s"], ">= 1.0", lambda v: v >= 1.0,
            "Poisson run (mixed load): continuous-batching output tok/s / vLLM CPU's on the same schedule",
            continuous=cont["output_tokens_per_s"], vllm=vllm["output_tokens_per_s"])
    micro_w, cont_w = poisson_run(runs, SERVED, "wide"), poisson_run(runs, CONTINUOUS, "wide")
    if micro_w and cont_w:
        bound = bounds.get("wide", {})
        at_micro, at_cont = allowed_at_served_costs(micro_w), allowed_at_served_costs(cont_w)
        out["continuous_throughput_vs_micro_wide"] = _ratio(
            cont_w["output_tokens_per_s"] / micro_w["output_tokens_per_s"], ">= 2.0", lambda v: v >= 2.0,
            "Poisson run (wide load" + (f": outputs {choices_text(cont_w['output_choices'])}"
                                        if cont_w.get("output_choices") else "")
            + "): continuous-batching output tok/s / micro-batching output tok/s"
            + (f"; continuous_bound allows {bound['bound']:.2f}x at the step costs measured in-process" if bound else "")
            + (f", {at_micro:.2f}x at the forward passes micro-batching's server ran" if at_micro else "")
            + (f" ({at_cont:.2f}x at continuous batching's)" if at_cont else ""),
            continuous=cont_w["output_tokens_per_s"], micro=micro_w["output_tokens_per_s"],
            round_ratios=cont_w.get("round_ratios"), bound=bound.get("bound"),
            bound_at_micro_costs=at_micro, bound_at_continuous_costs=at_cont)
        if at_micro:
            out["continuous_bound_wide_at_served_costs"] = _ratio(
                at_micro, "report", None,
                "what the wide load allows continuous batching over micro-batching (continuous_bound: the ideal "
                "scheduler's tok/s over micro-batching's on the same arrivals, both priced at the forward passes "
                "micro-batching's server ran in each round, llama_forward_* metrics); mean over rounds"
                + (f". At continuous batching's own passes: {at_cont:.2f}x" if at_cont else ""),
                rounds=[round(b, 3) for b in _served_bounds(micro_w)])
        if bound:
            out.update(_vs_ideal(cont_w, bound, "wide", "report", None))
    return out


def allowed_at_served_costs(run: dict) -> Optional[float]:
    """The mean over a Poisson row's rounds of what the load allows continuous batching over
    micro-batching at the forward passes its server ran (``continuous_bound.at_served_costs``'s
    ``bound``); None for rows from before it was recorded."""
    bounds = _served_bounds(run)
    return round(statistics.mean(bounds), 3) if bounds else None


def _served_bounds(run: dict) -> List[float]:
    """Each priced round's ``bound`` of a Poisson row (rounds without forward passes to price are None)."""
    return [i["bound"] for i in run.get("ideal_at_served_costs") or [] if i and "bound" in i]


def _p99_ttft_ratio(cont: dict, micro: dict, bound: dict, goal: str, met, definition: str) -> dict:
    """Continuous / micro-batching TTFT p99 on one load, with the scheduler's ideal on it beside."""
    limit = bound.get("p99_ttft_bound")
    return _ratio(
        cont["ttft_ms"]["p99"] / micro["ttft_ms"]["p99"], goal, met,
        definition + (f"; on the same arrivals at the step costs measured in-process, with no serving cost, the "
                      f"scheduler's ideal gets {limit:.2f} (continuous_bound)" if limit else ""),
        continuous_ms=cont["ttft_ms"]["p99"], micro_ms=micro["ttft_ms"]["p99"], bound=limit)


def _vs_ideal(cont: dict, bound: dict, load: str, goal: str, met) -> dict:
    """Continuous batching against the schedule's ideal: priced at the served worker's own forward
    passes in each round (the goal's figure, where the rounds recorded them), and at the step
    costs measured in-process before the rounds (reported beside it; the goal's figure otherwise)."""
    key = "continuous_vs_ideal" + ("" if load == "mixed" else f"_{load}")
    ratios = cont.get("vs_ideal_at_served_costs") or []
    inprocess = _ratio(
        cont["output_tokens_per_s"] / bound["ideal_tps"], goal, met,
        f"Poisson run ({load} load): continuous-batching output tok/s / the schedule's ideal at step costs "
        "measured in-process before the served rounds (scripts.bench.continuous_bound; the host's speed may "
        "differ by then)",
        continuous=cont["output_tokens_per_s"], ideal=round(bound["ideal_tps"], 2),
        saturated=round(bound.get("saturated_ideal_tps", 0), 2))
    if not ratios:
        return {key: inprocess}
    served = _ratio(
        statistics.mean(ratios), goal, met,
        f"Poisson run ({load} load): continuous-batching output tok/s / the schedule's ideal (scripts.bench."
        "continuous_bound: the scheduler's policy on the same arrivals, no scheduling, serving or client cost), priced "
        "at the forward passes the server itself ran in each round (llama_forward_* metrics); mean over rounds",
        round_ratios=ratios, ideal_tps_rounds=[round(i["ideal_tps"], 2) for i in cont["ideal_at_served_costs"] if i],
        continuous_rounds=cont.get("output_tokens_per_s_rounds"))
    return {key: served, key.replace("_ideal", "_ideal_inprocess"): _as_report(inprocess)}


def poisson_run(runs, system: str, load: str) -> Optional[dict]:
    """A system's Poisson row on ``load`` (rows from before the wide load have no ``load``: mixed)."""
    return next((r for r in runs if r.get("system") == system and r.get("scenario") == "poisson" and r.get("ok")
                 and r.get("load", "mixed") == load), None)


def ratio_lines(rs: dict) -> List[str]:
    lines = ["ratios (reported, never asserted):"]
    for name, r in rs.items():
        value = "n/a" if r["value"] is None else f"{r['value']:.3f}"
        met = "" if r["met"] is None else ("  goal met" if r["met"] else "  goal NOT met")
        lines.append(f"  {name:34s} {value:>8s}  (goal {r['goal']}){met}  {r['definition']}")
    return lines


# -- Markdown ------------------------------------------------------------------------------------

def _f(x, digits=1):
    return "-" if x is None else f"{x:,.{digits}f}"


def _p(d, key, scale=1.0, digits=0):
    return "-" if not d else _f(d[key] * scale, digits)


def _share(run) -> str:
    share = run.get("foreign_cpu_share")
    if share is None:
        return "-"
    return f"**{100 * share:.0f}%**" if share >= 0.10 else f"{100 * share:.0f}%"


def results_table(results: dict) -> str:
    head = ("| system | scenario | input | output | conc. | ok/req | TTFT p50 / p90 / p99 (ms) | ITL p50 / p99 (ms) "
            "| E2E p50 / p99 (s) | output tok/s | decode tok/s per stream | seq tok/s (conv.) | other CPU |\n"
            "|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|\n")
    rows = []
    for r in results["runs"]:
        conc = r.get("concurrency")
        conc = f"{r['rate_per_s']}/s" if r.get("scenario") == "poisson" else conc
        if r.get("scenario") == "poisson":
            r = dict(r, scenario=f"poisson ({r.get('load', 'mixed')})")
        if not r.get("ok"):
            rows.append(f"| {r['system']} | {r['scenario']} | {r.get('input_tokens')} | {r.get('output_tokens')} | "
                        f"{conc} | 0/{r['requests']} | failed: {(r.get('error_samples') or ['?'])[0][:60]} | | | | | | |")
            continue
        t, i, e = r["ttft_ms"], r["itl_ms"], r["e2e_ms"]
        rows.append(
            f"| {r['system']} | {r['scenario']} | {r['input_tokens']} | {r['output_tokens']} | {conc} | "
            f"{r['ok']}/{r['requests']} | {_p(t, 'p50')} / {_p(t, 'p90')} / {_p(t, 'p99')} | "
            f"{_p(i, 'p50', digits=1)} / {_p(i, 'p99', digits=1)} | {_p(e, 'p50', 1e-3, 2)} / {_p(e, 'p99', 1e-3, 2)} | "
            f"{_f(r['output_tokens_per_s'])} | {_f(r.get('decode_tokens_per_s_per_stream'))} | "
            f"{_f(r.get('throughput_seq_tokens_per_s'))} | {_share(r)} |")
    return head + "\n".join(rows) + "\n"


def ratios_table(rs: dict) -> str:
    lines = ["| ratio | value | goal | met | definition |", "|---|---:|---|---|---|"]
    for name, r in rs.items():
        met = "-" if r["met"] is None else ("yes" if r["met"] else "**no**")
        lines.append(f"| {name} | {_f(r['value'], 3)} | {r['goal']} | {met} | {r['definition']} |")
    return "\n".join(lines) + "\n"


def systems_table(results: dict) -> str:
    lines = ["| system | status | detail |", "|---|---|---|"]
    for name, s in results["systems"].items():
        timings = ", ".join(f"{k} {v}" for k, v in (s.get("timings") or {}).items())
        detail = s.get("detail", "") + (f" ({timings})" if timings else "")
        lines.append(f"| {name} | {s['status']} | {detail.replace('|', '/')} |")
    return "\n".join(lines) + "\n"


def _rel(path) -> str:
    root = Path(__file__).resolve().parents[2]
    try:
        return str(Path(path).resolve().relative_to(root))
    except ValueError:
        return str(path)


def prefill_bound_line(results: dict) -> str:
    """The linear layers' prompt tokens/s per length (``gemm.prefill_bound``), when the run measured it."""
    bound = results.get("prefill_bound")
    if not bound:
        return ""
    parts = ", ".join(f"{b['tokens_per_s']:.0f} tok/s on {n} rows ({b['gflops']:.0f} GFLOP/s)"
                      for n, b in sorted(bound.items(), key=lambda kv: int(kv[0])))
    kernels = sorted({k for b in bound.values() for k in b.get("kernels", ())})
    on = (f", each product on the fastest of nn.Linear, oneDNN packed and the native kernels where they serve "
          f"the dtype: {' and '.join(kernels)}") if kernels else ""
    return (f"**Prefill bound** (the model's linear layers alone on random activations, {results['model']['dtype']}, "
            f"best of the samples{on}): {parts}.\n")


def dtype_label(described: dict) -> str:
    """``float32``, or ``float32, bfloat16 weights`` where the linears keep another dtype than the arithmetic."""
    dtype, weights = described["dtype"], described.get("weight_dtype")
    return dtype if not weights or weights == dtype else f"{dtype}, {weights} weights"


def decode_products_line(results: dict) -> str:
    """The linear products' batch-1 decode tokens/s alone (``gemm.decode_products``), when the run measured it."""
    products = results.get("decode_products")
    if not products:
        return ""
    kernels = ", ".join(f"{name} {rate:.1f}" for name, rate in products["by_kernel_tokens_per_s"].items())
    return (f"**Decode products** (one row through every layer's linear products and the LM head, each its own "
            f"random weights, {dtype_label(products)}, best of the samples): **{products['tokens_per_s']:.1f} tok/s**, "
            f"{products['bytes'] / 1e6:.1f} MB streamed at {products['gb_per_s']:.1f} GB/s (tok/s by kernel: {kernels}).\n")


def cache_caveat(results: dict) -> str:
    """A warning where the bench model's weights fit the CPU's last-level cache: batch-1 decode then
    reads them partly from the cache, and its efficiency against ``x.sum()``'s memory bandwidth can
    pass 1 (an Emerald Rapids Xeon's 260 MB L3 holds the bench model's 226 MB of bf16 weights)."""
    cache, weights = results["machine"].get("last_level_cache_bytes"), results["decode_bound"]["weight_bytes_per_token"]
    if not cache or weights > cache:
        return ""
    return (f"**The model's weights fit this CPU's last-level cache** ({weights / 1e6:.0f} MB of weights per token, "
            f"{cache / 1e6:.0f} MB of cache): batch-1 decode reads them partly from the cache, so its efficiency "
            f"against the memory bandwidth above can pass 1, and says little of a model larger than the cache.\n")


def queue_grew(run: dict) -> bool:
    """Whether a Poisson row's server fell behind its arrivals: it completed fewer requests per second
    than were offered, and its last request finished later after the last arrival than a typical
    request takes end to end (a server that keeps up ends one request's latency after it)."""
    behind = run["completed_rate_per_s"] < 0.9 * run["offered_rate_per_s"]
    return behind and run["drain_s"] > (run.get("e2e_ms") or {}).get("p50", 0.0) / 1e3


def markdown(results: dict, plots: List[Path]) -> str:
    m, v, model = results["machine"], results["versions"], results["model"]
    bw = results["memory_bandwidth"]
    bound = results["decode_bound"]
    bw_text = ", ".join(f"{x['gb_per_s']:.1f} GB/s with {x['threads']} thread{'s' if x['threads'] > 1 else ''}"
                        for x in bw.values())
    extra = results.get("extra", {}).get("fp32_batch1")
    fp32_line = ""
    if extra and extra.get("ok"):
        bracket = extra.get("bandwidth_gb_per_s_bracket")
        around = (f", the bandwidth read {' and '.join(f'{b:.1f}' for b in bracket)} GB/s right before and after its wave"
                  if bracket else "")
        fp32_line = (f"\nThe float32 variant in-process at batch 1 ({extra['input_tokens']} + {extra['output_tokens']} "
                     f"tokens): {_f(extra['decode_tokens_per_s_per_stream'])} decode tok/s, "
                     f"{extra['weight_bytes_per_token'] / 1e6:.0f} MB of weights per token, bound "
                     f"{bound['bandwidth_gb_per_s'] * 1e9 / extra['weight_bytes_per_token']:.1f} tok/s at the run's best "
                     f"bandwidth{around}.\n")
    served_text = server_metrics_text(results)
    c = 8 if 8 in results["plan"]["concurrency"] else max(results["plan"]["concurrency"])
    cpu_lines = []
    for system in ("inprocess", "torchserve"):
        run = find(results["runs"], system, "concurrency", concurrency=c)
        if run and run.get("own_cpu_by_process"):
            parts = ", ".join(f"{name} {100 * share:.0f}%" for name, share in run["own_cpu_by_process"].items())
            cpu_lines.append(f"* {system} at {c} streams: {parts} (of {results['machine']['logical_cpus']} CPUs)")
    poisson_text = "".join(
        f"Poisson run ({r.get('load', 'mixed')} load), {r['system']}: {r['requests']} requests offered at {r['offered_rate_per_s']}/s, completed at "
        f"{r['completed_rate_per_s']}/s; the last finished {r['drain_s']} s after the last arrival"
        f"{' (the queue grew: the server could not keep up)' if queue_grew(r) else ''}.\n\n"
        for r in results["runs"] if r.get("scenario") == "poisson" and r.get("offered_rate_per_s"))
    cpu_text = ("Where the CPU went (share of all the machine's CPU time, per process):\n\n" + "\n".join(cpu_lines) + "\n") \
        if cpu_lines else ""
    cpu_text += load_choices_text(results)
    merged = results.get("extra", {}).get("merged")
    merged_text = f"\n{merged}\n" if merged else ""
    return f"""Mode `{results['mode']}`, {results['timestamp']}, `{results['command']}`, {results['phases_s']['total_s']:.0f} s.
{merged_text}
**Machine**: {m['cpu']} (CPU class `{cpu_label(m)}`), {m['logical_cpus']} logical CPUs{usable_text(m)}, {m.get('memory_gb', '?')} GB, {m.get('virtualization', 'bare metal or unknown')}; {m['platform']}; CPU features {', '.join(m.get('cpu_flags', []))}{openmp_text(m)}.
**Versions**: Python {v['python']}, torch {v['torch']}, transformers {v['transformers']}, TorchServe {v['torchserve']}, {v.get('java')}, git {v.get('git')}.
**Model**: {model['name']}: {model['parameters']:,} parameters ({model['hidden_size']} hidden, {model['num_hidden_layers']} layers, {model['num_attention_heads']} heads, {model['num_key_value_heads']} KV heads, intermediate {model['intermediate_size']}, vocab {model['vocab_size']}), {dtype_label(model)}; EOS suppressed (its tokenizer declares no EOS token).
**Config**: `{_rel(results['config']['base'])}` with dtype {model['dtype']}: batchSize {results['config']['frontend']['batchSize']}, maxBatchDelay {results['config']['frontend']['maxBatchDelay']} ms, micro_batch_size {results['config']['micro_batching']['micro_batch_size']}, max_length {results['config']['handler']['max_length']}, torch_threads {results['config']['threads']}.

**Memory bandwidth** (`x.sum()` over {list(bw.values())[0]['bytes'] / 1e9:.2f} GB of float32, best of 5 passes and of the samples at the start and the end): {bw_text}.
Batch-1 decode bound = {bound['bandwidth_gb_per_s']:.1f} GB/s / {bound['weight_bytes_per_token'] / 1e6:.1f} MB of weights per token = **{bound['tokens_per_s']:.1f} tok/s** (the KV cache adds {model['kv_cache_bytes_per_position'] / 1e3:.1f} kB per position of context).
{cache_caveat(results)}{prefill_bound_line(results)}{decode_products_line(results)}{fp32_line}
### Ratios (CPU class `{cpu_label(m)}`, {dtype_label(model)})

{ratios_table(results['ratios'])}
### Systems (CPU class `{cpu_label(m)}`)

{systems_table(results)}
### Results (CPU class `{cpu_label(m)}`, {dtype_label(model)})

{results_table(results)}
"other CPU": the share of the machine's CPU time that processes outside this benchmark used while the
row was measured (bold from 10%: that row's figures are skewed by them). Memory bandwidth (the best of
{len(results.get('memory_bandwidth_samples', []))} samples, at the start and the end of the run) was measured with
{' and '.join(f"{100 * s['foreign_cpu_share']:.0f}%" for s in results.get('memory_bandwidth_samples', []))} of the CPUs taken by others.

{poisson_text}{cpu_text}
{served_text}

Plots: {', '.join(f'`{p}`' for p in plots)}.
"""


def load_choices_text(results: dict) -> str:
    """Each process's load-time choices (``extra.load_choices``, :mod:`scripts.bench.choices`), the bench
    process first, and under each served worker what it chose while serving (``extra.serving_choices``)."""
    choices = results.get("extra", {}).get("load_choices")
    if not choices:
        return ""
    serving = results["extra"].get("serving_choices", {})
    processes = sorted(choices, key=lambda process: process != "bench process")
    return ("\nWhat each process chose at load (the backend times its kernels against each other as it loads; each "
            "process decides for itself), and while serving:\n\n" + "\n".join(
                f"* {process}:" + ("".join(f"\n  * `{line}`" for line in choices[process]) or " nothing timed")
                + serving_choices_text(serving.get(process, []))
                for process in processes) + "\n")


def serving_choices_text(lines: List[str], shown: int = 3) -> str:
    """A worker's decisions while serving, the last ``shown`` of them, as the list under its load-time ones."""
    if not lines:
        return ""
    which = f"the last {shown} of {len(lines)}" if len(lines) > shown else f"{len(lines)}"
    return f"\n  * while serving ({which}):" + "".join(f"\n    * `{line}`" for line in lines[-shown:])


def openmp_text(machine: dict) -> str:
    """The bench process's OpenMP waits (``machine.openmp_env``), where the run recorded them."""
    env = {k: v for k, v in (machine.get("openmp_env") or {}).items() if v is not None}
    return "; OpenMP in the bench process: " + ", ".join(f"`{k}={v}`" for k, v in env.items()) if env else ""


def usable_text(machine: dict) -> str:
    """`` (1 usable: CPU affinity)`` where the run could use fewer CPUs than the host has."""
    usable = machine.get("usable_cpus")
    if usable is None or usable >= machine["logical_cpus"]:
        return ""
    return f" ({usable} usable: {machine.get('usable_cpus_source')})"


def cpu_label(machine: dict) -> str:
    """The CPU class a run was measured on (``amx``, ``avx512-bf16``, ``avx512``, ``avx2``), and the host's
    where it was emulated (``avx2 (emulated on avx512-bf16)``); runs from before the class was
    recorded are classed from their flags."""
    if machine.get("cpu_class"):
        emulated_on = machine.get("emulated_on")
        return f"{machine['cpu_class']} (emulated on {emulated_on})" if emulated_on else machine["cpu_class"]
    from llama_engine.cpu import cpu_class

    return cpu_class(frozenset(machine.get("cpu_flags", [])))


# -- ratios by CPU class: the latest full run's ratios on each class, kept beside the docs page ----

def cpu_short(cpu: str) -> str:
    """``Intel 6/207`` for ``Intel(R) Xeon(R) Processor (family 6, model 207)``: the vendor, and the
    family and model where the name has them."""
    vendor = next((v for v in ("Intel", "AMD") if v in cpu), cpu.split(" ")[0] if cpu else "unknown")
    numbers = re.search(r"\(family (\d+), model (\d+)\)", cpu)
    return f"{vendor} {numbers.group(1)}/{numbers.group(2)}" if numbers else vendor


_FAMILY_MODEL = re.compile(r" \(family \d+, model \d+\)$")


def _same_cpu(a: str, b: str) -> bool:
    """Runs from before the family and model were recorded name the CPU bare."""
    return a == b or (_FAMILY_MODEL.sub("", a) == _FAMILY_MODEL.sub("", b)
                      and not (_FAMILY_MODEL.search(a) and _FAMILY_MODEL.search(b)))


def cpu_column(machine: dict, table: dict) -> str:
    """The column a run takes among the ratios by CPU class (``table``): its class, or, where that
    class's column holds another CPU's run, the class on this CPU (``avx512-bf16 on Intel 6/207``).

    One class spans CPUs whose ratios differ (an AVX512_BF16 Zen 4 and an Emerald Rapids Xeon
    without AMX): each keeps its latest run, and a CPU's rerun replaces its own."""
    label = cpu_label(machine)
    held = table.get(label)
    if held is None or _same_cpu(held.get("cpu", ""), machine.get("cpu", "")):
        return label
    return f"{label} on {cpu_short(machine.get('cpu', ''))}"


def _read_by_cpu(path: Path) -> dict:
    return json.loads(path.read_text()) if path.exists() else {}


def update_by_cpu(results: dict, path: Path) -> dict:
    """Record this run's ratios as its CPU's latest in its class (``path``, JSON; :func:`cpu_column`);
    return every column's."""
    table = _read_by_cpu(path)
    m = results["machine"]
    column = cpu_column(m, table)
    entry = {
        "timestamp": results["timestamp"], "mode": results["mode"], "cpu": m["cpu"], "logical_cpus": m["logical_cpus"],
        "dtype": dtype_label(results["model"]), "git": results["versions"].get("git"),
        "ratios": {name: r["value"] for name, r in results["ratios"].items()},
        "goals": {name: r["goal"] for name, r in results["ratios"].items()},
    }
    carried = _carried(table.get(column), entry)
    if carried:
        entry["carried"] = carried
    table[column] = entry
    path.write_text(json.dumps(table, indent=1, sort_keys=True) + "\n")
    return table


#: Ratios a run has only when an optional system ran in it: a peer (llama.cpp, vLLM) or the llamacpp
#: backend, each built by its own make target.
_OPTIONAL_SYSTEM_RATIO = re.compile(r"vllm|llama\.?cpp")


def _carried(previous: Optional[dict], entry: dict) -> dict:
    """The ratios of an optional system that the same CPU's previous run of this mode measured and
    this run did not (vLLM not built on the host this time, say), each with its goal and the run it
    came from, so that a column keeps every figure it had until a run measures it again."""
    if not previous or previous.get("mode") != entry["mode"] or not _same_cpu(previous.get("cpu", ""), entry["cpu"]):
        return {}

    def lost(name: str) -> bool:
        return name not in entry["ratios"] and bool(_OPTIONAL_SYSTEM_RATIO.search(name))

    origin = {"timestamp": previous["timestamp"], "git": previous.get("git")}
    carried = {name: c for name, c in previous.get("carried", {}).items() if lost(name)}
    carried.update({name: {"value": value, "goal": previous.get("goals", {}).get(name), **origin}
                    for name, value in previous.get("ratios", {}).items() if value is not None and lost(name)})
    return dict(sorted(carried.items()))


def by_cpu_table(table: dict) -> str:
    classes = sorted(table)
    names = list(dict.fromkeys(name for c in classes for name in [*table[c]["ratios"], *table[c].get("carried", {})]))
    goals = {name: c["goal"] for column in classes for name, c in table[column].get("carried", {}).items()}
    goals.update({name: g for c in classes for name, g in table[c].get("goals", {}).items()})
    head = ["| ratio | goal | " + " | ".join(f"`{c}`" for c in classes) + " |",
            "|---|---|" + "---:|" * len(classes),
            "| (run) | | " + " | ".join(f"{table[c]['cpu']}, {table[c]['logical_cpus']} CPUs, {table[c]['dtype']}, "
                                        f"{table[c]['mode']} {table[c]['timestamp']}" for c in classes) + " |"]
    rows = [f"| {name} | {goals.get(name, '')} | " + " | ".join(_by_cpu_cell(table[c], name) for c in classes)
            + " |" for name in names]
    notes = [f"\n`{c}`: {table[c]['note']}" for c in classes if table[c].get("note")]
    notes += [f"\n`{c}`: {_carried_note(table[c]['carried'])}" for c in classes if table[c].get("carried")]
    return "\n".join(head + rows) + "\n" + "\n".join(notes) + ("\n" if notes else "")


def _by_cpu_cell(column: dict, name: str) -> str:
    carried = column.get("carried", {}).get(name)
    return f"{_f(carried['value'], 3)}†" if carried else _f(column["ratios"].get(name), 3)


def _carried_note(carried: dict) -> str:
    """Which run each † figure of a column came from."""
    by_run: dict = {}
    for name, c in carried.items():
        by_run.setdefault((c["timestamp"], c.get("git")), []).append(name)
    return "; ".join(f"† from its run at {timestamp}" + (f" ({git})" if git else "") + ", which measured what the latest "
                     f"did not: {', '.join(names)}" for (timestamp, git), names in sorted(by_run.items()))


def server_metrics_text(results: dict) -> str:
    """What each TorchServe variant's own metrics (its metrics API, scraped before and after its
    sweeps) say: model steps, their time and fill, and latencies from the handler's side."""
    lines = []
    for system in ("torchserve", "torchserve-continuous"):
        m = results.get("extra", {}).get(f"{system.replace('-', '_')}_metrics")
        if not m or not m.get("steps"):
            continue
        lines.append(
            f"* {system}: {m['requests']} requests, {m['generation_tokens']} tokens generated in {m['steps']} model steps, "
            f"{_f(m['ms_per_step'], 2)} ms per step, {_f(m['rows_per_step'], 2)} rows per step of {m['batch_capacity']} "
            f"(fill {_f(100 * m['batch_fill'], 0) if m['batch_fill'] is not None else '-'}%); from the handler taking a request: "
            f"queue {_f(m['queue_mean_ms'], 1)} ms, TTFT {_f(m['ttft_mean_ms'], 1)} ms, "
            f"time per output token {_f(m['time_per_output_token_mean_ms'], 2)} ms, end to end "
            f"{_f(m['e2e_mean_ms'], 1)} ms (means)")
    if not lines:
        return ""
    return ("TorchServe's own metrics (the handler's llama_* metrics on its metrics API, scraped before and after "
            "the sweeps; a step is a micro-batch's prefill or decode step, or a scheduler step):\n\n" + "\n".join(lines) + "\n")


# -- plots -------------------------------------------------------------------------------------

def _systems(results):
    return [s for s in results["systems"] if any(r.get("system") == s and r.get("ok") for r in results["runs"])]


def plot_all(results: dict, out: Path) -> List[Path]:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    runs, systems = results["runs"], _systems(results)
    colors = {s: f"C{i}" for i, s in enumerate(results["systems"])}
    title = f"{results['model']['name']}, {dtype_label(results['model'])}, {results['machine']['logical_cpus']} CPUs"
    paths = []

    fig, ax = plt.subplots(figsize=(7, 4.5))
    for s in systems:
        rs = [r for r in runs if r["system"] == s and r["scenario"] == "ttft" and r.get("ok")] or \
             [r for r in runs if r["system"] == s and r["scenario"] == "length" and r.get("ok")]
        rs.sort(key=lambda r: r["input_tokens"])
        if rs:
            x = [r["input_tokens"] for r in rs]
            ax.plot(x, [r["ttft_ms"]["p50"] for r in rs], "o-", color=colors[s], label=f"{s} p50")
            ax.plot(x, [r["ttft_ms"]["p90"] for r in rs], "x--", color=colors[s], alpha=0.6, label=f"{s} p90")
    ax.set(xlabel="input tokens", ylabel="TTFT (ms)", title=f"TTFT vs input length (concurrency 1)\n{title}")
    ax.set_ylim(bottom=0)
    ax.grid(alpha=0.3)
    ax.legend()
    paths.append(_save(fig, out / PLOTS[0], plt))

    fig, ax = plt.subplots(figsize=(7, 4.5))
    for s in systems:
        rs = sorted((r for r in runs if r["system"] == s and r["scenario"] == "concurrency" and r.get("ok")),
                    key=lambda r: r["concurrency"])
        if rs:
            ax.plot([r["concurrency"] for r in rs], [r["output_tokens_per_s"] for r in rs], "o-", color=colors[s], label=s)
    bound = results.get("decode_bound", {}).get("tokens_per_s")
    if bound:
        ax.axhline(bound, color="grey", linestyle=":", label=f"batch-1 decode bound {bound:.0f} tok/s")
    ax.set_xscale("log", base=2)
    ax.set(xlabel="concurrent streams (in-process: batch size)", ylabel="output tokens/s (aggregate)",
           title=f"Throughput vs concurrency\n{title}")
    ax.set_ylim(bottom=0)
    ax.grid(alpha=0.3)
    ax.legend()
    paths.append(_save(fig, out / PLOTS[1], plt))

    fig, axes = plt.subplots(1, 3, figsize=(15, 4.5))
    for ax, (key, label, scale) in zip(axes, (("ttft_ms", "TTFT (ms)", 1), ("itl_ms", "inter-token latency (ms)", 1),
                                              ("e2e_ms", "end-to-end latency (s)", 1e-3))):
        for s in systems:
            rs = sorted((r for r in runs if r["system"] == s and r["scenario"] == "concurrency" and r.get("ok")
                         and r.get(key)), key=lambda r: r["concurrency"])
            if not rs:
                continue
            x = [r["concurrency"] for r in rs]
            for pct, style in (("p50", "o-"), ("p90", "s:"), ("p99", "x--")):
                ax.plot(x, [r[key][pct] * scale for r in rs], style, color=colors[s], label=f"{s} {pct}",
                        alpha=1.0 if pct == "p50" else 0.6)
        ax.set_xscale("log", base=2)
        ax.set(xlabel="concurrent streams", ylabel=label)
        ax.set_ylim(bottom=0)
        ax.grid(alpha=0.3)
    axes[0].legend(fontsize=7)
    fig.suptitle(f"Latency percentiles vs concurrency: {title}")
    paths.append(_save(fig, out / PLOTS[2], plt))

    fig, axes = plt.subplots(1, 3, figsize=(15, 4.5))
    poisson = [r for r in runs if r["scenario"] == "poisson" and r.get("ok")]
    for ax, (key, label, scale) in zip(axes, (("ttft_ms", "TTFT (ms)", 1), ("itl_ms", "inter-token latency (ms)", 1),
                                              ("e2e_ms", "end-to-end latency (s)", 1e-3))):
        width = 0.8 / max(1, len(poisson))
        for i, r in enumerate(poisson):
            if r.get(key):
                ax.bar([j + i * width for j in range(3)], [r[key][p] * scale for p in ("p50", "p90", "p99")], width,
                       color=colors.get(r["system"]), hatch=LOAD_HATCH.get(r.get("load", "mixed"), ""),
                       label=f"{r['system']}, {r.get('load', 'mixed')} load")
        ax.set_xticks([j + width * (len(poisson) - 1) / 2 for j in range(3)], ["p50", "p90", "p99"])
        ax.set(ylabel=label)
        ax.grid(alpha=0.3, axis="y")
    if poisson:
        axes[0].legend()
        loads = ", ".join(dict.fromkeys(f"{r.get('load', 'mixed')} {r['rate_per_s']}/s" for r in poisson))
        fig.suptitle(f"Poisson arrivals ({loads}): {title}")
    else:
        fig.suptitle("Poisson arrivals: no run")
    paths.append(_save(fig, out / PLOTS[3], plt))
    return paths


def _save(fig, path: Path, plt) -> Path:
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return path


# -- docs and files ----------------------------------------------------------------------------

#: The back-to-back pairs a paired ratio's median is over, as the page's method says.
FULL_PAIRS, QUICK_PAIRS = MODES["default"]["paired_rounds"], MODES["quick"]["paired_rounds"]

DOCS_HEAD = f"""# Benchmarks

These pages are rewritten by the benchmark suite: a full or quick run rewrites its CPU class's page
(`benchmarks-<class>.md`) and the index (`benchmarks.md`); edit `scripts/bench/report.py`, not these
files. Speeds are reported, never asserted.

## How to run

```bash
.venv/bin/python -m scripts.bench --quick   # about 6 minutes on 2 cores (more with peers): shorter sweeps
.venv/bin/python -m scripts.bench           # about 75 minutes with both peers and the llamacpp variant: the full sweeps (this page's default)
.venv/bin/python -m scripts.bench --smoke --out /tmp/bench   # seconds, the tiny model (tests/unit/test_bench_smoke.py)
```

Needs `build/tiny-llama` (its tokenizer; `make build` or `python scripts/build_tiny_llama.py --out build/tiny-llama`)
and matplotlib. Outputs go to `build/bench/`: `results-<timestamp>.json` and `latest.json` (every
figure, the machine, versions, config and plan), `results.md` (this section's tables), and
`ttft_vs_input.png`, `throughput_vs_concurrency.png`, `latency_percentiles.png`, `poisson_latency.png`;
then `docs/benchmarks-<class>.md` (its plots in `docs/benchmarks-<class>-plots/`) and this index. A second CPU
of a class already measured gets a page and a column of its own (`benchmarks-avx512-bf16-intel-6-207.md`,
`avx512-bf16 on Intel 6/207`), so that a Xeon's run never replaces a Zen's.
Options: `--dtype float32`, `--checkpoint float32`, `--threads N`, `--no-peers`, `--llama-gguf PATH`, `--max-minutes M`, `--out DIR`,
`--docs PATH`/`--no-docs`, `--systems A,B`, `--scenarios A,B` (length, ttft, concurrency, paired, poisson, poisson-wide, poisson-steady),
`--poisson-rate R`, `--poisson-duration S`, `--poisson-rounds N`, `--cpu-class CLASS` (measure as a CPU of a
lower class would, on this one: its own page, `benchmarks-CLASS-emulated.md`, `benchmarks-CLASS-on-HOST-emulated.md`
on a host of another class than `avx512-bf16`). How far continuous batching can get
ahead of micro-batching on the Poisson load at all: `.venv/bin/python -m scripts.bench.continuous_bound`
(see docs/continuous-batching.md).

## What one run does

1. **The benchmark model** (`build/bench-model-bf16`, `build/bench-model-fp32`, built once, seed 0):
   a Llama with **random weights**, 116M parameters (hidden 768, 12 layers, 12 heads, intermediate 3072),
   the tokenizer of `build/tiny-llama` (2048 tokens), safetensors in bfloat16 and float32. Its config is
   `model-config/bench-llama.yaml` (torch backend, batchSize 8, micro_batch_size 8, max_length 1024,
   torch_threads 2), with `handler.dtype` set to the variant served. The bf16 checkpoint is served, as
   Llama checkpoints ship (`--checkpoint float32` serves the float32 copy): computed in float32 (classes
   `avx2` and `avx512`), its linears keep their bf16 weights (`handler.weight_dtype: auto`), and the
   decode bound counts the bytes they stream, two a weight; the heading's dtype says `float32, bfloat16 weights`.
2. **EOS is suppressed without touching the handler**: the bench model's tokenizer declares no EOS token
   (`eos_token: null`; `</s>` stays in the vocabulary as an ordinary token) and its `config.json` and
   `generation_config.json` have no `eos_token_id`. The engine stops a row only on the tokenizer's
   `eos_token_id`, so every request runs to its `max_new_tokens` (`finish_reason: length`); the client checks
   the count. Peers get `ignore_eos: true`.
3. **Prompts of exact token lengths**: `<s>` plus words that are single tokens, drawn with a seeded RNG,
   each prompt checked by encoding it again; every system gets the same prompts (peers as token ids).
4. **Memory bandwidth**: `x.sum()` over a large float32 tensor with 1 and 2 threads (GB/s, best of 5);
   the batch-1 decode bound is bandwidth / bytes of weights read per token (every weight except the input
   embedding, which is read one row per token).
5. **Systems, one at a time on the machine, same prompts, same client** (only the "paired" rows run
   the engine in-process and the served handler back to back, each idle while the other runs): (1) the engine in-process
   (`Engine.generate`, micro-batches of 8, no HTTP), (2) the handler served by TorchServe (archive built by
   `scripts/build_model.py` into `build/bench/work`, started with `scripts/tsctl.py` on free loopback ports,
   stopped by PID) with micro-batching (`torchserve`, `model-config/bench-llama.yaml`), (3) the same handler
   with continuous batching (`torchserve-continuous`, `model-config/bench-llama-continuous.yaml`: TorchServe's
   `continuousBatching`, 8 slots, the same prompts and the same Poisson schedule), (4) the same handler with
   continuous batching on the llamacpp backend (`torchserve-llamacpp`, `model-config/bench-llama-llamacpp.yaml`:
   the forward pass on llama.cpp through llama-cpp-python, over a GGUF the build converts in the linears' dtype
   as served, as llama-server's (for the bf16 checkpoint, under float32 too, the 16-bit type `gguf_type: auto`
   picks: bf16 on a CPU with native bf16, else f16, which holds its weights exactly and which llama.cpp decodes faster there); when `make llamacpp` has built
   it; its concurrency sweep and the llama-server pairs only), (5) the micro-batching handler over int8 weights
   (`torchserve-int8`: `handler.weight_dtype: int8`, opt-in and lossy, half of bf16's bytes; its waves at 1 and 8
   streams, then back to back with the micro-batching handler over the weights as served (`paired-int8` rows) and
   with llama-server on the q8_0 GGUF, the `int8_*` ratios: reported, never the bar),
   (6) peers when installed
   (`make bench-peers` builds them under `build/peers/`): llama.cpp's `llama-server` (`POST /completion`,
   `stream: true`, `n_predict`, `ignore_eos: true`; built from the llama.cpp tree in the llama-cpp-python
   0.3.36 sdist, the bench model converted to GGUF by that tree's `convert_hf_to_gguf.py`) and vLLM for CPU
   0.32.0's OpenAI server (`POST /v1/completions`, `stream: true`, `ignore_eos: true`; it serves
   the checkpoint served itself). llama-server's GGUF is in the linears' dtype as served (for the bf16
   checkpoint, computed in float32 or not, bf16 or f16 as above: the systems table names the file). They run with the same batch and thread budget:
   `llama-server -np 8 -t 2 -c 8192`, vLLM `--max-num-seqs 8 --max-model-len 1024` (vLLM's CPU defaults
   reserve one of the two cores for its scheduler). llama-server's flash attention (`-fa`) is timed both
   ways before its rows, its default `auto` against `off`, the two servers up at once and the paired waves
   alternated between them (2 rounds at 1 and 8 streams), and it runs with the faster (`scripts/bench/peer_flags.py`;
   the systems table says which and by how much): on the AMX Xeon its default served 1 / 8 streams 0.85 / 0.89x
   as fast as `-fa off`. Before that, for the bf16 checkpoint, its GGUF type is timed the same way: the 16-bit
   type `gguf_type: auto` gives the llamacpp backend here against the other (bf16 / f16), and it runs on the
   faster. Prompts go to peers as token ids. What each process (the
   bench's own, each served worker) chose at load, where the backend times its kernels against each other, is
   kept in `extra.load_choices` (`scripts/bench/choices.py`) and listed below the results: each process decides
   for itself, and one that took the slower side moves its ratios.
6. **Sweeps**: input length at concurrency 1 (full run: 256/512/768 input tokens with output to 1024 in all,
   plus 4 TTFT probes of 8 output tokens per length, the lengths taken in turn so that each sees the same
   minutes of the host's drift); concurrency 1, 2, 4, 8, 16 (full run: 256 input + 128
   output tokens, 2 rounds); a Poisson arrival run with mixed lengths (full run: 60 requests, inputs
   128–768, outputs 32–256, all drawn uniformly), paced at 1.25x the requests/s that the ideal continuous
   batcher serves of them in `continuous_bound`'s saturated replay at the step costs measured in-process
   before the served rounds, so that it offers more than any system here can serve and its throughput
   is each system's capacity on that mix rather than the offered rate (a fixed rate stops doing that as
   soon as a system gets faster; `extra.load_paces` holds each load's pace). The two TorchServe variants
   run it in alternating rounds (full run: 2 each, micro first
   in round 1, continuous first in round 2), both servers up and the idle one waiting; their Poisson row
   gathers every round's requests, its tok/s is the mean of the rounds' and `round_ratios` holds
   continuous / micro per round. Two more loads run the same way, on the two variants only: the wide
   load (128 short prompts, fifteen answers in sixteen of 8 tokens and one of 960, paced as the mixed load:
   where continuous batching's refilled rows count most) and the steady load (30 requests of the mixed
   load's lengths, paced at 60% of the requests/s that micro-batching serves in the same replay, or
   of what it served on the mixed load where that is less, as it is when serving costs more than the
   replay's in-process steps; `extra.steady_load` holds its pace): a load both servers keep up with, so that TTFT measures the
   wait each scheduler imposes rather than a backlog. The in-process engine has no scheduler, so it does not run the Poisson
   loads. Before the Poisson rounds, the two variants also run the same static wave (full run: 8 streams,
   256 in, 128 out) back to back, alternated over {FULL_PAIRS} pairs (the "paired-variants" rows;
   `continuous_over_micro` holds continuous / micro per pair), so that their static-load comparison
   carries no drift between sweeps minutes apart.

### Definitions

* TTFT: request sent → first token line. ITL: gaps between a stream's consecutive token lines, pooled.
  E2E: request sent → the request's last line. Percentiles p50/p90/p99 over requests (ITL: over gaps).
* Output tok/s: every output token of a round / the round's wall time (first send → last completion).
* Decode tok/s per stream: median over streams of (tokens − 1) / (last token − first token).
* Seq tok/s (conv.): the Neuron samples' convention (seed 003), batch_size × sequence_length / end-to-end
  latency, with sequence_length = prompt + generated tokens and the round's wall time as the latency.
* Other CPU: (busy CPU time of the whole machine − CPU time of the benchmark and its servers) /
  (wall time × logical CPUs) while a row was measured. Before each row the suite waits (up to 30 s per row and
  300 s per run in the full run; 10 s and 60 s in `--quick`) for a second in which other processes use
  under 10% of the CPUs.
* Serving overhead: served output tok/s at 8 streams / in-process at batch 8, the median over
  back-to-back A/B pairs of the same wave, {FULL_PAIRS} in the full run and {QUICK_PAIRS} in `--quick` (one pair's ratio ranged
  0.82-0.94 within a run on the 2-vCPU Zen 5 EPYC; the "paired" rows: the in-process engine stays loaded while
  the idle server is up, and the order alternates), because the machine's speed drifts by tens of
  percent between minutes; `serving_overhead_batch1` is the same at 1 stream. The bench process computes
  under the OpenMP waits the servers get (`OMP_WAIT_POLICY=PASSIVE`, `GOMP_SPINCOUNT=20000`, from
  `scripts/tsctl.py`, unless its environment sets them; `machine.openmp_env` records them): with
  libgomp's default ~3 ms of spinning after every torch op, its threads took the native kernels'
  cores and the in-process rows ran slower than the served ones (2-vCPU AVX2 EPYC: serving overhead
  1.09 at 8 streams, 0.99 under the servers' waits, `--systems inprocess,torchserve` runs minutes apart). Batch-1 decode efficiency:
  decode tok/s × weight bytes per token / bandwidth, where each paired 1-stream round (in-process and
  served; the llamacpp backend's with llama-server) sits between two bandwidth samples and is held to their mean, the median over the rounds
  (`_vs_best_bandwidth`: the 1-stream sweep against the run's best sample, reported). TTFT growth:
  TTFT(768) / TTFT(256) from the probes' p50, with its split into a fixed cost and a cost per prompt
  token (the line through the two points). Prefill bound (`scripts/bench/gemm.py`, sampled beside the
  bandwidth): the model's own linear products (fused q/k/v, o, fused gate/up, down) on 256 and on 768
  rows of random activations, best of 5, as prompt tokens/s, every layer's but of the last only its
  keys and values (a prompt needs no more of it); attention, norms and the LM head are left out, so no
  prefill beats it. `ttft_growth_at_prefill_bound` is the TTFT growth of a prompt that cost
  only that (what any implementation faces on the CPU); `prefill_vs_bound_<n>` is the in-process
  prompt tokens/s (n / TTFT p50) against it. Decode products (the same file, sampled alike): one row
  through every layer's products and the LM head, each with its own weights so that they stream from
  memory, on the faster kernel; `batch1_decode_efficiency_at_products_bound` is the efficiency of a
  step that did only that, `batch1_decode_vs_products` the in-process decode against it (the rest of a
  step: norms, attention, rotary, sampling). `batch1_decode_efficiency_llama.cpp` is llama-server's own
  1-stream rounds held alike, beside the llamacpp backend's (the engine it runs, which the backend's build
  patches with `scripts/patch_ggml.py`'s weight prefetch), and `llamacpp_vs_llama.cpp_1_stream` the
  backend's speed over llama-server's in the 1-stream pairs.
  Peer ratio: served / peer output tok/s at 8 streams.
* Continuous batching against the schedule's ideal: `scripts.bench.continuous_bound` replays the
  scheduler's policy on the same arrivals with no scheduling, streaming or serving cost. Its step
  costs are the served worker's own forward passes in each round (the `llama_forward_*` metrics:
  decode steps by rows; prefill passes scaled as a whole), the mean of the rounds' served / ideal;
  `continuous_vs_ideal_inprocess` prices it with the costs measured in-process before the rounds.

### Caveats

* Random weights: the figures measure compute and memory traffic, not the quality of any answer.
* The client, TorchServe's Java frontend and the worker share the machine's cores; on 2 cores that is
  part of what the served figures measure.
* The speed of a small VM drifts: on the reference machine the same in-process batch-1 decode measured
  30 ms per token in one run and 57 ms in another an hour later, with no other process running. Compare
  systems through the paired rows and the ratios, and re-run before reading a difference under ~20%.
* Where a batch-1 decode step goes on the native CPU kernels (Zen 5 EPYC, bench model, bf16, 2 threads,
  2026-11-26, each part replaced by a no-op in turn, 300 positions of context): of ~5.9 ms, ~5.2 ms
  are the linear products (the 230 MB of weights at ~44 GB/s, what `decode_products` takes alone),
  ~0.2-0.3 ms attention and ~0.45 ms the rest (embedding, the fused norms, rotary and SiLU, the
  Python between them). At 8 rows: ~6.7 ms products, ~2.4 ms attention (the rows' bf16 keys and
  values, 88 MB at ~37 GB/s), ~0.6 ms the rest. Before those kernels (torch's oneDNN products, SDPA
  over a float32 cache, ~30 torch ops a layer) the same steps took ~8.4 and ~17.6 ms; on the AMX Xeon
  (2026-11-25) 14-15 ms at 1 row, of which ~9.7 ms the oneDNN products.
* The llamacpp variant's `decode_threads: auto` learns while serving whether one stream's
  one-row steps run on every thread or one fewer: it alternates the two in blocks and keeps the
  one whose steps came faster, start to start (`llama_engine/backends/step_threads.py`). A
  load-time probe used to decide: on a 2-vCPU Zen 5 EPYC it read one thread 1.20-1.45x slower
  from load to load, around its 1.3 threshold, and the 1-stream figure moved with its choice
  (0.78x llama-server on one thread, 0.85x on two). Each worker's choices while serving are
  listed below the results.
* TorchServe batches statically: a frontend batch of up to 8 requests runs to its end before the next
  batch starts, so at 16 streams the second 8 wait for the first, and under Poisson arrivals a request
  that arrives during a batch waits for it.

"""


#: The host class of the first emulated runs: their pages are named without it (``benchmarks-avx2-emulated.md``),
#: a class emulated on another host's with it (``benchmarks-avx2-on-amx-emulated.md``).
FIRST_EMULATION_HOST = "avx512-bf16"


def default_docs(machine: dict) -> Path:
    """The page a full run rewrites: its CPU class's own (``docs/benchmarks-avx2.md``; for a run on an
    emulated class ``docs/benchmarks-avx2-emulated.md``, ``docs/benchmarks-avx2-on-amx-emulated.md`` on an AMX host:
    :data:`FIRST_EMULATION_HOST`), so that a run on one class never replaces
    another's; where another CPU of the class holds its column (:func:`cpu_column`), this CPU's
    (``docs/benchmarks-avx512-bf16-intel-6-207.md``). ``docs/benchmarks.md`` is their index
    (:func:`render_index`)."""
    qualified = cpu_column(machine, _read_by_cpu(by_cpu_path(DOCS_PAGE))) != cpu_label(machine)
    cpu = cpu_short(machine.get("cpu", ""))
    slug = "-" + re.sub(r"[^a-z0-9]+", "-", cpu.lower()).strip("-") if qualified else ""
    if machine.get("emulated_on"):
        host = machine["emulated_on"]
        on = "" if host == FIRST_EMULATION_HOST else f"-on-{host}"
        return DOCS_PAGE.with_name(f"{DOCS_PAGE.stem}-{machine['cpu_class']}{on}{slug}-emulated.md")
    return DOCS_PAGE.with_name(f"{DOCS_PAGE.stem}-{cpu_label(machine)}{slug}.md")


def is_class_page(docs: Path) -> bool:
    """Whether ``docs`` is one of the pages by CPU class beside the index (``docs/benchmarks-*.md``)."""
    return docs.parent == DOCS_PAGE.parent and docs.suffix == ".md" and docs.stem.startswith(DOCS_PAGE.stem + "-")


def by_cpu_path(docs: Path) -> Path:
    """The JSON of ratios by CPU class beside ``docs``: the index's for the index and every class page."""
    if docs == DOCS_PAGE or is_class_page(docs):
        docs = DOCS_PAGE
    return docs.parent / f"{docs.stem}-by-cpu.json"


BY_CPU_HEADING = "## Ratios by CPU class\n"


def by_cpu_section(by_cpu: dict, by_cpu_file: Path, docs: Path) -> str:
    return (f"{BY_CPU_HEADING}\nThe latest run's ratios on each class of CPU measured (from "
            f"`{os.path.relpath(by_cpu_file, docs.parent)}`, which each run updates for its own class). A ratio that holds on one "
            f"class can flip on another.\n\n{by_cpu_table(by_cpu)}\n")


def class_pages() -> List[Path]:
    """The pages by CPU class beside the index, measured classes before emulated ones."""
    pages = [p for p in DOCS_PAGE.parent.glob(f"{DOCS_PAGE.stem}-*.md") if is_class_page(p)]
    return sorted(pages, key=lambda p: (p.stem.endswith("-emulated"), p.stem))


def render_index(by_cpu_file: Path) -> str:
    """``docs/benchmarks.md``: how a run works, the ratios by CPU class, and a link to each class's page."""
    title, method = DOCS_HEAD.split("\n\n", 1)
    prefix = DOCS_PAGE.stem + "-"
    links = "\n".join(f"- [`{p.stem[len(prefix):].replace('-emulated', ' (emulated)')}`]({p.name})" for p in class_pages())
    by_cpu = json.loads(by_cpu_file.read_text()) if by_cpu_file.exists() else {}
    return (f"{title}\n\nEach CPU class's latest full run has a page of its own, which `python -m scripts.bench` rewrites "
            f"when it runs on (or, with `--cpu-class`, as) that class: its machine, every system's rows, the ratios and the "
            f"plots. This page is their index, rewritten with them. What every earlier run measured, and what changed "
            f"between runs: [measured.md](measured.md).\n\n## Pages by CPU class\n\n{links}\n\n"
            + by_cpu_section(by_cpu, by_cpu_file, DOCS_PAGE) + "\n" + method)


def render_docs(results: dict, plots: List[Path], docs: Path) -> str:
    """The docs page, with the plots copied beside it (``<page>-plots/``) so that the page shows them."""
    folder = docs.parent / f"{docs.stem}-plots"
    folder.mkdir(parents=True, exist_ok=True)
    for plot in plots:
        shutil.copyfile(plot, folder / plot.name)
    images = "\n".join(f"![{p.stem}]({folder.name}/{p.name})" for p in plots)
    by_cpu_file = by_cpu_path(docs)
    by_cpu = update_by_cpu(results, by_cpu_file)
    machine = results["machine"]
    emulated = (f"**An emulated CPU class.** This run computed as an `{machine['cpu_class']}` CPU would, on an "
                f"`{machine['emulated_on']}` one ({machine['cpu']}): its dtype, native kernels and torch's kernels were "
                f"those of the class ({', '.join(f'`{k}={v}`' for k, v in machine.get('emulation_env', {}).items())}), "
                f"llama-server was built for the class, and systems that cannot be narrowed were skipped. Memory, caches "
                f"and clocks were the host's: it measures the instruction set, not a chip of that class.\n\n"
                if machine.get("emulated_on") else "")
    if is_class_page(docs):  # how a run works and the ratios of every class are on the index
        title = f"# Benchmarks on the `{cpu_column(machine, by_cpu)}` CPU class"
        method = (f"The latest full run on this class of CPU, rewritten by `python -m scripts.bench` when it runs on "
                  f"(or, with `--cpu-class`, as) it. How a run works, what each figure means, and the ratios of every "
                  f"class measured: [{DOCS_PAGE.name}]({DOCS_PAGE.name}).\n\n")
        by_cpu_text = ""
    else:  # a page of its own elsewhere: whole
        title, method = DOCS_HEAD.split("\n\n", 1)
        by_cpu_text = by_cpu_section(by_cpu, by_cpu_file, docs)
    return (title + "\n\n" + emulated + method + by_cpu_text + "## Latest results\n\n" + markdown(results, [Path(folder.name) / p.name for p in plots])
            + "\n" + images + "\n")


def write_all(results: dict, out: Path, docs: Optional[Path]) -> List[Path]:
    out.mkdir(parents=True, exist_ok=True)
    plots = plot_all(results, out)
    md_path = out / "results.md"
    json_path = out / f"results-{results['timestamp']}.json"
    results["outputs"] = {"json": str(json_path), "latest": str(out / "latest.json"), "markdown": str(md_path),
                          "plots": [str(p) for p in plots], "docs": str(docs) if docs else None}
    md_path.write_text("# Benchmark results\n\n" + markdown(results, plots))
    json_path.write_text(json.dumps(results, indent=1, default=str))
    shutil.copyfile(json_path, out / "latest.json")
    written = [json_path, out / "latest.json", md_path, *plots]
    if docs is not None:
        if docs == DOCS_PAGE:
            raise ValueError(f"{DOCS_PAGE} is the index of the pages by CPU class; name another page, or none for "
                             f"this class's own ({DOCS_PAGE.stem}-<class>.md)")
        docs.parent.mkdir(parents=True, exist_ok=True)
        docs.write_text(render_docs(results, plots, docs))
        written.append(docs)
        if is_class_page(docs):
            DOCS_PAGE.write_text(render_index(by_cpu_path(DOCS_PAGE)))
            written.append(DOCS_PAGE)
    return written
