"""The served handler's own figures for a run: two scrapes of TorchServe's metrics API.

The handler records its llama_* metrics with TorchServe's metrics API (docs/operations.md,
"Metrics"); a scrape before and one after a run give what the server saw of it: requests by
outcome, prompt and generated tokens, model steps and their rows, and its latencies from the
moment it took each request (the client's figures also hold the frontend and the network).
Histogram quantiles are coarse (TorchServe's fixed buckets), so latencies are means.
"""
from __future__ import annotations

import time
from typing import Optional, Tuple

from scripts.scrape_metrics import Samples, delta, scrape, summary, value


class ServerMetrics:
    def __init__(self, metrics_url: str, model: str):
        self.metrics_url = metrics_url
        self.model = model

    def scrape(self) -> Samples:
        return scrape(self.metrics_url)

    def snapshot(self, settle: float = 0.15, timeout: float = 5.0) -> Samples:
        """A scrape of the server at rest, to count a run from: the frontend parses a flush's metric
        lines one by one, a moment after the responses went out, so a scrape taken right after the
        previous run can hold half of its last flush (its prompt tokens, not yet the passes that
        prefilled them), and the next run would be counted the rest. At rest, two scrapes ``settle`` s
        apart agree and every counted prompt token was prefilled (up to ``timeout`` s): :meth:`settled`
        over the whole count."""
        return self.settled({}, 0, timeout, settle=settle)[1]

    def since(self, before: Samples, requests: Optional[int] = None, timeout: float = 10.0) -> dict:
        """Figures between ``before`` and now; with ``requests``, once :meth:`settled`."""
        if requests is None:
            after = self.scrape()
            got = summary(delta(after, before), self.model)
        else:
            got, after = self.settled(before, requests, timeout)
        return figures(got, value(after, "llama_batch_capacity", self.model))

    def settled(self, before: Samples, requests: int, timeout: float = 10.0, idle: bool = False,
                settle: float = 0.1) -> Tuple[dict, Samples]:
        """The :func:`summary` of what happened since ``before``, and the last scrape, once the server
        has counted ``requests`` more and an outcome for each (``idle``: and none runs or waits), and two
        scrapes ``settle`` s apart agree (up to ``timeout`` s).

        The frontend parses the worker's metric lines a moment after the responses went out; a request
        is counted when it ends, its tokens when the handler next flushes. A single scrape is no
        snapshot either: the frontend collects one metric after another while it parses new lines, so a
        scrape can read a request's outcome before that line was parsed and its count after. A server
        that counts its forward passes has also counted the prefill of every prompt token it counted."""
        deadline, last = time.monotonic() + timeout, None
        while True:
            after = self.scrape()
            got = summary(delta(after, before), self.model)
            counts_passes = value(after, "llama_forward_passes_total", self.model) > 0
            ready = _settled(got, requests, counts_passes) and (not idle or _idle(after, self.model))
            if (ready and last is not None and _llama(after) == _llama(last)) or time.monotonic() > deadline:
                return got, after
            last = after if ready else None
            time.sleep(settle)


def _idle(samples: Samples, model: str) -> bool:
    return value(samples, "llama_requests_running", model) == value(samples, "llama_requests_waiting", model) == 0


def _llama(samples: Samples) -> Samples:
    return {key: v for key, v in samples.items() if key[0].startswith("llama_")}


def _prefilled_every_prompt(got: dict, counts_passes: bool) -> bool:
    """Whether the forward passes of a :func:`summary` prefilled every prompt token it counted (true of a
    server that does not count its passes)."""
    prefilled = sum(shape.get("prefill_tokens", 0.0) for shapes in got["forward"].values() for shape in shapes.values())
    return not counts_passes or prefilled >= got["prompt_tokens"]


def _settled(got: dict, requests: int, counts_passes: bool = False) -> bool:
    outcomes = (sum(got["success_by_finish_reason"].values()) + sum(got["errors_by_status"].values())
                + got["cancelled"])
    return (got["requests"] >= requests and outcomes >= requests
            and _prefilled_every_prompt(got, counts_passes))


def figures(got: dict, capacity: float) -> dict:
    """The JSON-friendly subset of a :func:`scrape_metrics.summary` of a delta (``capacity``: the
    gauge's value, which a delta cannot hold): counts, and ms rounded."""
    def ms(key):
        mean = got[key]["mean_s"]
        return None if mean is None else round(1000 * mean, 3)

    return {
        "requests": int(got["requests"]),
        "finish_reasons": {k: int(v) for k, v in got["success_by_finish_reason"].items()},
        "errors_by_status": {k: int(v) for k, v in got["errors_by_status"].items()},
        "prompt_tokens": int(got["prompt_tokens"]),
        "generation_tokens": int(got["generation_tokens"]),
        "steps": int(got["steps"]),
        "batch_capacity": int(capacity),
        "rows_per_step": None if got["rows_per_step"] is None else round(got["rows_per_step"], 3),
        "batch_fill": None if got["rows_per_step"] is None or not capacity else round(got["rows_per_step"] / capacity, 3),
        "ms_per_step": None if got["ms_per_step"] is None else round(got["ms_per_step"], 3),
        "ttft_mean_ms": ms("time_to_first_token"),
        "time_per_output_token_mean_ms": ms("request_time_per_output_token"),
        "e2e_mean_ms": ms("e2e_request_latency"),
        "queue_mean_ms": ms("request_queue_time"),
        "forward": {kind: {str(rows): {k: round(v, 6) for k, v in shape.items()} for rows, shape in shapes.items()}
                    for kind, shapes in got["forward"].items()},
    }
