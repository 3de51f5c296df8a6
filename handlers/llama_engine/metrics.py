"""What the engine reports about its requests and steps, and the metrics that makes.

The engine knows nothing of TorchServe or Prometheus. The static engine and the continuous
scheduler call a :class:`MetricsSink` at each event of a request (admitted into a batch or
slot, a token, finished with a reason, failed with a status) and after each batch of model
steps; the handler adds the events only it sees (a request received, an error it answers).
:class:`TimedSink` turns the events into the observations named in :data:`METRICS` (seconds
and counts) and leaves recording them to a subclass: the handler's, in
``handlers/llama_metrics.py``, records them with TorchServe's ``context.metrics``.

TorchServe records each value as one line that the worker writes to its stdout and the
frontend parses (and logs in ts_log.log): about 30 us of the worker's time and 300 bytes of
log each, on top of the frontend's work. So nothing here is recorded per token. Histograms
get at most four observations per request (queue time, TTFT, time per output token, end to
end latency); the inter-token latency is each request's mean (vLLM's
``request_time_per_output_token_seconds``): one observation per token cost this tiny model a
fifth of its throughput at 8 streams. Counters and gauges are summed in memory and recorded by
:meth:`TimedSink.flush`, at most every ``flush_every`` seconds while requests run and at once
when the handler says it is idle.
"""
from __future__ import annotations

import threading
import time
from abc import ABC, abstractmethod
from collections import defaultdict
from dataclasses import dataclass, field
from typing import Dict, Optional, Tuple

COUNTER, GAUGE, HISTOGRAM = "counter", "gauge", "histogram"

#: Every metric carries this label (the model's name); ``MetricSpec.labels`` are the others.
MODEL_LABEL = "ModelName"


@dataclass(frozen=True)
class MetricSpec:
    name: str
    kind: str
    unit: str  # TorchServe's unit name: "s" or "count"
    help: str
    labels: Tuple[str, ...] = ()


METRICS = (
    MetricSpec("llama_time_to_first_token_seconds", HISTOGRAM, "s",
               "from the handler taking the request (tokenizing it) to its first generated token"),
    MetricSpec("llama_request_time_per_output_token_seconds", HISTOGRAM, "s",
               "inter-token latency as each request's mean: (last token - first token) / (tokens - 1), "
               "for requests that finished generating with at least two tokens"),
    MetricSpec("llama_e2e_request_latency_seconds", HISTOGRAM, "s",
               "from the handler taking the request to its last token, for requests that finished generating"),
    MetricSpec("llama_request_queue_time_seconds", HISTOGRAM, "s",
               "from the handler taking the request to its admission into a micro-batch or a slot"),
    MetricSpec("llama_requests_total", COUNTER, "count",
               "requests that ended: finished generating, failed or cancelled (the sum of the next three)"),
    MetricSpec("llama_prompt_tokens_total", COUNTER, "count", "prompt tokens of the requests admitted"),
    MetricSpec("llama_generation_tokens_total", COUNTER, "count", "tokens generated"),
    MetricSpec("llama_request_success_total", COUNTER, "count",
               "requests that finished generating, by finish reason (length, eos_token, stop_sequence)",
               ("finish_reason",)),
    MetricSpec("llama_request_errors_total", COUNTER, "count",
               "requests answered with an error (or whose stream ended with one), by status", ("status",)),
    MetricSpec("llama_request_cancelled_total", COUNTER, "count",
               "requests whose client went away before the end (continuous batching only sees this)"),
    MetricSpec("llama_steps_total", COUNTER, "count",
               "model steps (forward passes): a micro-batch's prefill and decode steps, or a scheduler step"),
    MetricSpec("llama_step_rows_total", COUNTER, "count",
               "requests worked on, summed over the steps (rows still generating, or slots in use)"),
    MetricSpec("llama_step_seconds_total", COUNTER, "s", "time spent in the model steps"),
    MetricSpec("llama_forward_passes_total", COUNTER, "count",
               "forward passes by kind (decode: one token for each row; prefill: prompt tokens, with the decode "
               "rows that continuous batching runs in the same pass) and by those decode rows", ("kind", "rows")),
    MetricSpec("llama_forward_seconds_total", COUNTER, "s",
               "time in the backend's forward passes (no sampling, streaming or scheduling), by kind and rows",
               ("kind", "rows")),
    MetricSpec("llama_forward_prefill_tokens_total", COUNTER, "count",
               "prompt tokens the prefill passes computed, by the decode rows in the same pass", ("kind", "rows")),
    MetricSpec("llama_requests_running", GAUGE, "count", "requests admitted and not yet finished"),
    MetricSpec("llama_requests_waiting", GAUGE, "count",
               "requests the handler holds that are not yet admitted into a micro-batch or a slot"),
    MetricSpec("llama_slots_in_use", GAUGE, "count",
               "continuous batching: slots holding a request (the same as running, by construction)"),
    MetricSpec("llama_batch_capacity", GAUGE, "count",
               "rows one step can hold: micro_batch_size, or the continuous slots"),
    MetricSpec("llama_compile_cache_hits_total", COUNTER, "count",
               "compiled graphs found in the shipped compile cache at load", ("kind",)),
    MetricSpec("llama_compile_cache_misses_total", COUNTER, "count",
               "graphs compiled at load because the shipped cache did not hold them", ("kind",)),
)
SPECS = {spec.name: spec for spec in METRICS}


@dataclass
class RequestTimes:
    """When things happened to one request (``time.perf_counter`` seconds); kept by the sink."""

    received: float = field(default_factory=time.perf_counter)
    admitted: Optional[float] = None
    first_token: Optional[float] = None
    last_token: Optional[float] = None
    ended: bool = False


class MetricsSink:
    """The engine's events; here every one does nothing.

    ``request`` is a :class:`~llama_engine.lifecycle.PreparedRequest` (its ``times`` and
    ``prompt_ids`` are read). ``error`` takes None for a request that failed before it was
    prepared.
    """

    def received(self) -> None:
        """The handler took a new request."""

    def answered(self) -> None:
        """A request received was answered without generating (a model listing); it counts nowhere."""

    def admitted(self, request) -> None:
        """The request got its row of a micro-batch, or a slot; its prefill starts."""

    def token(self, request, index: int) -> None:
        """The request's ``index``-th generated token (1-based)."""

    def finished(self, request, reason: str, generated_tokens: int) -> None:
        """The request ended: a finish reason, or ``"cancelled"`` when its client went away."""

    def error(self, status: int, request=None) -> None:
        """The request failed with ``status`` (HTTP semantics: 400, 413, 500, 503...)."""

    def steps(self, count: int, rows: int, seconds: float) -> None:
        """``count`` model steps ran in ``seconds``, working on ``rows`` requests summed over them."""

    def forward(self, rows: int, prefill_tokens: int, seconds: float) -> None:
        """One backend forward pass: ``rows`` decode rows and ``prefill_tokens`` prompt tokens in ``seconds``.

        What a step costs the model alone, by its shape: the benchmark's ideal schedule is
        priced with these (``scripts/bench/continuous_bound.py``), and an operator sees what a
        decode step of ``rows`` rows costs on this machine.
        """

    def compile_cache(self, stats: dict) -> None:
        """The load's compile cache report (``CacheSession.report()``)."""

    def flush(self, force: bool = True) -> None:
        """Record what was summed in memory (``force=False``: only if ``flush_every`` has passed)."""


NULL_SINK = MetricsSink()


def compile_cache_counts(stats: dict) -> Tuple[int, int]:
    """(hits, misses) from ``CacheSession.report()``: TorchInductor's FX graph cache counters,
    else (Neuron) the shipped graphs against the graphs compiled at load."""
    if "fxgraph_cache_hit" in stats:
        return int(stats["fxgraph_cache_hit"]), int(stats["fxgraph_cache_miss"])
    return int(stats.get("shipped_entries", 0)), int(stats.get("new_entries", 0))


#: Counters of requests ending, recorded last in a flush, after the gauges, and ``llama_requests_total``
#: last of them: TorchServe's frontend reads the worker's metric lines one by one, so a scrape that sees
#: a request's outcome then also sees its tokens, forward passes and the gauges after it, and one that
#: sees it counted in ``llama_requests_total`` also sees how it ended (the bench and the tests wait for
#: that count, then read the rest; with the count first, a scrape between two lines once read two
#: requests ended and one success).
OUTCOME_COUNTERS = frozenset({"llama_requests_total", "llama_request_success_total", "llama_request_errors_total",
                              "llama_request_cancelled_total"})
#: A flush's lines by rank (see :data:`OUTCOME_COUNTERS`): other counters 0, gauges 1, outcomes 2, the count 3.
_FLUSH_RANK = {**dict.fromkeys(OUTCOME_COUNTERS, 2), "llama_requests_total": 3}


class TimedSink(MetricsSink, ABC):
    """Events -> observations; a subclass records them in :meth:`record`.

    ``capacity`` is the rows one step holds (micro_batch_size or the slots); ``continuous``
    adds the slots-in-use gauge. Thread-safe: micro-batching's stages and the continuous
    handler's step thread call it beside the handler's own thread.
    """

    def __init__(self, capacity: int, continuous: bool = False, flush_every: float = 1.0, clock=time.perf_counter):
        self.capacity = capacity
        self.continuous = continuous
        self.flush_every = flush_every
        self.clock = clock
        self._lock = threading.Lock()
        self._flush_lock = threading.Lock()
        self._counts: Dict[Tuple[str, tuple], float] = defaultdict(float)
        self._gauges: Dict[str, float] = {}
        self._received = self._admitted = self._ended_waiting = self._ended_running = 0
        self._last_flush = clock()

    @abstractmethod
    def record(self, name: str, value: float, labels: tuple = ()) -> None:
        """Record one value of metric ``name`` (a histogram's observation, a counter's increment,
        a gauge's value) with the values of ``SPECS[name].labels``."""

    # -- events ---------------------------------------------------------------------------------

    def received(self) -> None:
        with self._lock:
            self._received += 1

    def answered(self) -> None:
        with self._lock:
            self._ended_waiting += 1

    def admitted(self, request) -> None:
        now, times = self.clock(), request.times
        times.admitted = now
        with self._lock:
            self._admitted += 1
            self._counts[("llama_prompt_tokens_total", ())] += len(request.prompt_ids)
        self.record("llama_request_queue_time_seconds", now - times.received)

    def token(self, request, index: int) -> None:
        now, times = self.clock(), request.times
        if index == 1:
            times.first_token = now
            self.record("llama_time_to_first_token_seconds", now - times.received)
        times.last_token = now
        with self._lock:
            self._counts[("llama_generation_tokens_total", ())] += 1

    def finished(self, request, reason: str, generated_tokens: int) -> None:
        if not self._end(request):
            return
        times = request.times
        if reason == "cancelled":
            key = ("llama_request_cancelled_total", ())
        else:
            if generated_tokens >= 2 and times.first_token is not None:
                self.record("llama_request_time_per_output_token_seconds",
                            (times.last_token - times.first_token) / (generated_tokens - 1))
            self.record("llama_e2e_request_latency_seconds", self.clock() - times.received)
            key = ("llama_request_success_total", (reason,))
        self._count_outcome(key)

    def error(self, status: int, request=None) -> None:
        if not self._end(request):
            return
        self._count_outcome(("llama_request_errors_total", (str(status),)))

    def steps(self, count: int, rows: int, seconds: float) -> None:
        with self._lock:
            self._counts[("llama_steps_total", ())] += count
            self._counts[("llama_step_rows_total", ())] += rows
            self._counts[("llama_step_seconds_total", ())] += seconds
        self._maybe_flush()

    def forward(self, rows: int, prefill_tokens: int, seconds: float) -> None:
        labels = ("prefill" if prefill_tokens else "decode", str(rows))
        with self._lock:
            self._counts[("llama_forward_passes_total", labels)] += 1
            self._counts[("llama_forward_seconds_total", labels)] += seconds
            self._counts[("llama_forward_prefill_tokens_total", labels)] += prefill_tokens

    def compile_cache(self, stats: dict) -> None:
        hits, misses = compile_cache_counts(stats)
        kind = str(stats.get("kind", "unknown"))
        self.record("llama_compile_cache_hits_total", hits, (kind,))  # zeros too: "no miss" is the news
        self.record("llama_compile_cache_misses_total", misses, (kind,))

    def flush(self, force: bool = True) -> None:
        if not force:
            self._maybe_flush()
            return
        with self._flush_lock:  # two threads' flushes must not interleave their lines (OUTCOME_COUNTERS)
            with self._lock:
                counts, self._counts = self._counts, defaultdict(float)
                gauges = self._changed_gauges()
                self._last_flush = self.clock()
            lines = [(_FLUSH_RANK.get(name, 0), name, labels, value) for (name, labels), value in counts.items() if value]
            lines += [(1, name, (), value) for name, value in gauges.items()]
            for _, name, labels, value in sorted(lines, key=lambda line: line[0]):
                self.record(name, value, labels)

    # -- bookkeeping ----------------------------------------------------------------------------

    def _end(self, request) -> bool:
        """Count the request out of running or waiting; False if it had already ended (a request
        that finished generating and then failed in the same micro-batch keeps its first outcome)."""
        times = getattr(request, "times", None)
        with self._lock:
            if times is not None:
                if times.ended:
                    return False
                times.ended = True
            if times is None or times.admitted is None:
                self._ended_waiting += 1
            else:
                self._ended_running += 1
        return True

    def _count_outcome(self, key: Tuple[str, tuple]) -> None:
        """The outcome and ``llama_requests_total`` under one lock: a flush between them once
        published two requests ended with one success (another thread's step flushed in between)."""
        with self._lock:
            self._counts[key] += 1
            self._counts[("llama_requests_total", ())] += 1
        self._maybe_flush()

    def _changed_gauges(self) -> Dict[str, float]:
        running = self._admitted - self._ended_running
        now = {"llama_requests_running": running,
               "llama_requests_waiting": self._received - self._admitted - self._ended_waiting,
               "llama_batch_capacity": self.capacity}
        if self.continuous:
            now["llama_slots_in_use"] = running
        changed = {k: v for k, v in now.items() if self._gauges.get(k) != v}
        self._gauges.update(changed)
        return changed

    def _maybe_flush(self) -> None:
        if self.clock() - self._last_flush >= self.flush_every:
            self.flush()
