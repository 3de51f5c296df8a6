#!/usr/bin/env python3
"""Read TorchServe's metrics API (Prometheus text format) and summarize the handler's metrics.

    python scripts/scrape_metrics.py                      # the server of `make serve` (build/serve)
    python scripts/scrape_metrics.py --workdir DIR --model tiny-llama-continuous
    python scripts/scrape_metrics.py --raw                # every llama_* sample as scraped

The metrics API needs no key; it listens where config.properties' ``metrics_address`` says
(loopback). The benchmark suite and the tests read the same figures with :func:`scrape` and
:func:`summary`, as the difference of two scrapes.
"""
from __future__ import annotations

import argparse
import math
import sys
from pathlib import Path
from typing import Dict, FrozenSet, Optional, Tuple

import requests
from prometheus_client.parser import text_string_to_metric_families

Labels = FrozenSet[Tuple[str, str]]
Samples = Dict[Tuple[str, Labels], float]

HISTOGRAMS = ("llama_time_to_first_token_seconds", "llama_request_time_per_output_token_seconds",
              "llama_e2e_request_latency_seconds", "llama_request_queue_time_seconds")


def parse(text: str) -> Samples:
    """Samples of the Prometheus text format: ``{(name, labels): value}`` (prometheus_client's parser)."""
    return {(sample.name, frozenset(sample.labels.items())): float(sample.value)
            for family in text_string_to_metric_families(text) for sample in family.samples}


def scrape(metrics_url: str, timeout: float = 10.0) -> Samples:
    """GET ``<metrics_url>/metrics`` and parse it."""
    response = requests.get(metrics_url.rstrip("/") + "/metrics", timeout=timeout)
    response.raise_for_status()
    return parse(response.text)


def value(samples: Samples, name: str, model: Optional[str] = None, **labels: str) -> float:
    """The sum of ``name``'s samples whose labels include ``labels`` (and ``ModelName=model``)."""
    want = dict(labels, **({"ModelName": model} if model is not None else {}))
    return sum(v for (n, ls), v in samples.items() if n == name and want.items() <= dict(ls).items())


def by_label(samples: Samples, name: str, label: str, model: Optional[str] = None) -> Dict[str, float]:
    """``name``'s samples summed per value of ``label``."""
    out: Dict[str, float] = {}
    for (n, ls), v in samples.items():
        labels = dict(ls)
        if n == name and label in labels and (model is None or labels.get("ModelName") == model):
            out[labels[label]] = out.get(labels[label], 0.0) + v
    return out


def delta(after: Samples, before: Samples) -> Samples:
    """``after - before`` for every sample of ``after`` (counters and histograms: what happened between)."""
    return {key: v - before.get(key, 0.0) for key, v in after.items()}


def buckets(samples: Samples, histogram: str, model: Optional[str] = None) -> Dict[float, float]:
    """A histogram's cumulative bucket counts by upper bound (``+Inf`` as ``math.inf``)."""
    raw = by_label(samples, f"{histogram}_bucket", "le", model)
    return {math.inf if le == "+Inf" else float(le): count for le, count in raw.items()}


def quantile(samples: Samples, histogram: str, q: float, model: Optional[str] = None) -> Optional[float]:
    """``histogram_quantile`` as Prometheus computes it: linear within the bucket; None when empty.
    Past the last finite bucket it can only say that bucket's bound."""
    cumulative = sorted(buckets(samples, histogram, model).items())
    total = cumulative[-1][1] if cumulative else 0.0
    if total <= 0:
        return None
    rank, lower, below = q * total, 0.0, 0.0
    for bound, count in cumulative:
        if count >= rank:
            if math.isinf(bound):
                return lower
            return lower + (bound - lower) * (rank - below) / max(count - below, 1e-12)
        lower, below = bound, count
    return lower


def summary(samples: Samples, model: str) -> dict:
    """The handler's figures for ``model`` from a scrape (or the delta of two): counts, token totals,
    mean and median latencies (seconds), mean rows per step and ms per step."""
    def v(name: str) -> float:
        return value(samples, name, model)

    out = {
        "requests": v("llama_requests_total"),
        "success_by_finish_reason": _nonzero(by_label(samples, "llama_request_success_total", "finish_reason", model)),
        "errors_by_status": _nonzero(by_label(samples, "llama_request_errors_total", "status", model)),
        "cancelled": v("llama_request_cancelled_total"),
        "prompt_tokens": v("llama_prompt_tokens_total"),
        "generation_tokens": v("llama_generation_tokens_total"),
        "steps": v("llama_steps_total"),
        "step_rows": v("llama_step_rows_total"),
        "step_seconds": v("llama_step_seconds_total"),
        "running": v("llama_requests_running"),
        "waiting": v("llama_requests_waiting"),
        "batch_capacity": v("llama_batch_capacity"),
    }
    out["forward"] = forward_passes(samples, model)
    out["rows_per_step"] = out["step_rows"] / out["steps"] if out["steps"] else None
    out["ms_per_step"] = 1000 * out["step_seconds"] / out["steps"] if out["steps"] else None
    for histogram in HISTOGRAMS:
        short = histogram[len("llama_"):-len("_seconds")]
        count, total = v(f"{histogram}_count"), v(f"{histogram}_sum")
        out[short] = {"count": count, "sum_s": total, "mean_s": total / count if count else None,
                      "p50_s": quantile(samples, histogram, 0.5, model)}
    return out


def forward_passes(samples: Samples, model: Optional[str] = None) -> Dict[str, Dict[int, dict]]:
    """The backend's forward passes by kind and decode rows: ``{"decode"|"prefill": {rows: {"passes",
    "seconds", "prefill_tokens"}}}``, without the shapes that did not run."""
    keys = {"llama_forward_passes_total": "passes", "llama_forward_seconds_total": "seconds",
            "llama_forward_prefill_tokens_total": "prefill_tokens"}
    out: Dict[str, Dict[int, dict]] = {}
    for (name, ls), v in samples.items():
        labels = dict(ls)
        if name not in keys or (model is not None and labels.get("ModelName") != model) or "kind" not in labels:
            continue
        shape = out.setdefault(labels["kind"], {}).setdefault(int(labels["rows"]), {})
        shape[keys[name]] = shape.get(keys[name], 0.0) + v
    return {kind: {rows: shape for rows, shape in sorted(shapes.items()) if shape.get("passes")}
            for kind, shapes in out.items()}


def _nonzero(counts: Dict[str, float]) -> Dict[str, float]:
    return {k: v for k, v in counts.items() if v}


def main(argv=None) -> int:
    from scripts.tsctl import ADDRESS_KEYS, ROOT, read_properties

    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--workdir", type=Path, default=ROOT / "build" / "serve", help="the server's (tsctl start --workdir)")
    parser.add_argument("--url", help="the metrics address (default: the workdir's metrics_address)")
    parser.add_argument("--model", help="one model's figures (default: every model seen)")
    parser.add_argument("--raw", action="store_true", help="print the llama_* samples instead")
    args = parser.parse_args(argv)
    url = args.url or read_properties(args.workdir / "config.properties")[ADDRESS_KEYS["metrics"]]
    samples = scrape(url)
    if args.raw:
        for (name, labels), v in sorted(samples.items(), key=lambda item: (item[0][0], sorted(item[0][1]))):
            if name.startswith("llama_"):
                print(name + "{" + ",".join(f'{k}="{x}"' for k, x in sorted(labels)) + "} " + repr(v))
        return 0
    models = [args.model] if args.model else sorted({dict(ls)["ModelName"] for (n, ls) in samples
                                                    if n.startswith("llama_") and "ModelName" in dict(ls)})
    if not models:
        print(f"no llama_* samples at {url}/metrics (no request served yet, or metrics_mode is not prometheus)")
    for model in models:
        print(f"--- {model}")
        for key, figure in summary(samples, model).items():
            print(f"{key}: {figure}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
