"""The engine's metrics events and what they become: the sink, both batching modes in-process,
TorchServe's metric lines, metrics.yaml and config.properties.

The same figures through a real TorchServe's /metrics: tests/e2e/test_metrics.py.
"""
from __future__ import annotations

import logging
import re
import threading
import time
from pathlib import Path
from types import SimpleNamespace

import pytest
import yaml

import llama_handler
from llama_engine import GenerationRequest, SamplingParams
from llama_engine.backends.torch_backend import TorchSlotBackend
from llama_engine.continuous import ContinuousScheduler
from llama_engine.metrics import (
    COUNTER,
    GAUGE,
    HISTOGRAM,
    METRICS,
    SPECS,
    RequestTimes,
    TimedSink,
    compile_cache_counts,
)
from llama_metrics import TorchServeMetrics, dimensions, model_metrics_yaml
from scripts.scrape_metrics import parse, quantile, summary

ROOT = Path(__file__).resolve().parents[2]


class Recorder(TimedSink):
    """Keeps every recorded value; a clock the test moves."""

    def __init__(self, capacity=4, continuous=False, flush_every=1.0, real_clock=False):
        self.now = 100.0
        super().__init__(capacity, continuous, flush_every, clock=time.perf_counter if real_clock else lambda: self.now)
        self.values = []

    def record(self, name, value, labels=()):
        assert name in SPECS and len(labels) == len(SPECS[name].labels), (name, labels)
        self.values.append((name, labels, value))

    def of(self, name, labels=()):
        return [v for n, ls, v in self.values if n == name and ls == labels]


def request(prompt_tokens=3, received=100.0):
    return SimpleNamespace(prompt_ids=[1] * prompt_tokens, times=RequestTimes(received=received))


# -- the sink, with a clock the test moves -------------------------------------------------------

def test_one_request_becomes_its_latencies_and_counts():
    sink, r = Recorder(), request(prompt_tokens=5)
    sink.received()
    sink.now = 100.5
    sink.admitted(r)
    for i, t in enumerate((101.0, 101.25, 101.75, 102.0), start=1):
        sink.now = t
        sink.token(r, i)
    sink.finished(r, "length", 4)
    sink.flush()
    assert sink.of("llama_request_queue_time_seconds") == [0.5]
    assert sink.of("llama_time_to_first_token_seconds") == [1.0]
    assert sink.of("llama_request_time_per_output_token_seconds") == [pytest.approx(1.0 / 3)]
    assert sink.of("llama_e2e_request_latency_seconds") == [2.0]
    assert sink.of("llama_request_success_total", ("length",)) == [1]
    assert sink.of("llama_requests_total") == [1]
    assert sink.of("llama_prompt_tokens_total") == [5] and sink.of("llama_generation_tokens_total") == [4]
    assert sink.of("llama_requests_running") == [0] and sink.of("llama_requests_waiting") == [0]
    assert sink.of("llama_batch_capacity") == [4] and sink.of("llama_slots_in_use") == []  # micro-batching


def test_gauges_follow_requests_and_are_recorded_when_they_change():
    sink = Recorder(capacity=2, continuous=True)
    a, b, c = request(), request(), request()
    for _ in range(3):
        sink.received()
    sink.admitted(a)
    sink.admitted(b)
    sink.flush()
    assert (sink.of("llama_requests_running"), sink.of("llama_requests_waiting"), sink.of("llama_slots_in_use")) \
        == ([2], [1], [2])
    sink.values.clear()
    sink.flush()
    assert sink.values == []  # nothing changed, nothing recorded
    sink.error(500, a)  # a running request fails
    sink.finished(c, "cancelled", 0)  # a waiting one is cancelled
    sink.flush()
    assert sink.of("llama_requests_running") == [1] and sink.of("llama_requests_waiting") == [0]
    assert sink.of("llama_request_errors_total", ("500",)) == [1]
    assert sink.of("llama_request_cancelled_total") == [1] and sink.of("llama_requests_total") == [2]
    assert sink.of("llama_e2e_request_latency_seconds") == []  # neither finished generating


def test_a_request_keeps_its_first_outcome_and_answered_ones_count_nowhere():
    sink, r = Recorder(), request()
    sink.received()
    sink.received()
    sink.admitted(r)
    sink.token(r, 1)
    sink.finished(r, "eos_token", 1)
    sink.error(500, r)  # its micro-batch failed afterwards: still one request, a success
    sink.answered()  # the second: a model listing
    sink.flush()
    assert sink.of("llama_request_success_total", ("eos_token",)) == [1]
    assert sink.of("llama_request_errors_total", ("500",)) == [] and sink.of("llama_requests_total") == [1]
    assert sink.of("llama_request_time_per_output_token_seconds") == []  # one token: no gap
    assert sink.of("llama_requests_waiting") == [0] and sink.of("llama_requests_running") == [0]


def test_counters_wait_for_a_flush_unless_a_second_has_passed():
    sink, r = Recorder(flush_every=1.0), request()
    sink.received()
    sink.admitted(r)
    sink.token(r, 1)
    sink.flush(force=False)
    assert [n for n, _, _ in sink.values] == ["llama_request_queue_time_seconds", "llama_time_to_first_token_seconds"]
    sink.now += 1.0
    sink.steps(1, 1, 0.01)  # any event flushes once flush_every has passed
    assert sink.of("llama_generation_tokens_total") == [1] and sink.of("llama_steps_total") == [1]


def test_a_flush_records_requests_outcomes_after_their_tokens_forward_passes_and_gauges_and_the_count_last():
    """The frontend reads metric lines one by one: a scrape that sees an outcome must see the rest, and
    one that sees a request counted must see how it ended."""
    sink, first, second = Recorder(), request(), request(prompt_tokens=5)
    sink.received()
    sink.received()
    sink.admitted(first)
    sink.token(first, 1)
    sink.finished(first, "length", 1)  # counted before the second's prefill, in the same flush
    sink.admitted(second)
    sink.forward(0, 5, 0.01)
    sink.token(second, 1)
    sink.flush()
    names = [n for n, _, _ in sink.values]
    assert names[-2:] == ["llama_request_success_total", "llama_requests_total"], names
    assert {"llama_forward_prefill_tokens_total", "llama_prompt_tokens_total", "llama_requests_running"} <= set(names)


def test_two_threads_flushing_at_once_keep_a_requests_outcome_after_its_tokens():
    """The continuous handler's thread and its step thread both flush; their lines must not interleave."""

    class Slow(Recorder):
        def record(self, name, value, labels=()):
            if name == "llama_generation_tokens_total":
                in_record.set()
                time.sleep(0.05)  # the second flush runs meanwhile, if nothing holds it back
            super().record(name, value, labels)

    in_record = threading.Event()
    sink, req = Slow(), request()
    sink.received()
    sink.admitted(req)
    sink.token(req, 1)
    first = threading.Thread(target=sink.flush)
    first.start()
    assert in_record.wait(5)
    sink.finished(req, "length", 1)
    sink.flush()
    first.join(5)
    names = [n for n, _, _ in sink.values]
    assert names.index("llama_generation_tokens_total") < names.index("llama_request_success_total"), names


def test_a_flush_while_a_request_ends_never_publishes_it_counted_without_its_outcome():
    """Another thread's flush may land while ``finished`` records the latencies: the count and the
    outcome must go out in the same flush (a CI run once scraped two requests ended, one success)."""

    class FlushesMidway(Recorder):
        def record(self, name, value, labels=()):
            super().record(name, value, labels)
            if name == "llama_e2e_request_latency_seconds":
                self.flush()  # what the step thread's flush does at this moment

    sink, req = FlushesMidway(), request()
    sink.received()
    sink.admitted(req)
    sink.token(req, 1)
    sink.token(req, 2)
    sink.finished(req, "length", 2)
    sink.flush()
    counted = succeeded = 0
    for name, _, value in sink.values:
        succeeded += value if name == "llama_request_success_total" else 0
        counted += value if name == "llama_requests_total" else 0
        assert counted <= succeeded, sink.values
    assert counted == succeeded == 1


def test_compile_cache_hits_and_misses_from_the_cache_report():
    assert compile_cache_counts({"kind": "inductor", "shipped_entries": 9, "new_entries": 2,
                                 "fxgraph_cache_hit": 7, "fxgraph_cache_miss": 1}) == (7, 1)
    assert compile_cache_counts({"kind": "neuron", "shipped_entries": 4, "new_entries": 0}) == (4, 0)
    sink = Recorder()
    backend = SimpleNamespace(compile_session=SimpleNamespace(
        report=lambda: {"kind": "neuron", "shipped_entries": 3, "new_entries": 0}))
    llama_handler.warm_up_and_report(False, None, backend, 0.0, sink)
    assert sink.of("llama_compile_cache_hits_total", ("neuron",)) == [3]
    assert sink.of("llama_compile_cache_misses_total", ("neuron",)) == [0]  # recorded: the series exists


# -- both batching modes report, in-process on the tiny model ------------------------------------

def prepared(engine, prompt, n, **params):
    return engine.prepare(GenerationRequest(prompt, SamplingParams(max_new_tokens=n, **params)))


def totals(sink):
    sink.flush()
    out = {}
    for name, labels, value in sink.values:
        if SPECS[name].kind == COUNTER:
            out[(name, labels)] = out.get((name, labels), 0) + value
    return out


def forward_totals(counts) -> dict:
    """``{kind: {decode rows: {"passes", "prefill_tokens"}}}`` of :func:`totals`' forward-pass counters."""
    out = {}
    for (name, labels), value in counts.items():
        key = {"llama_forward_passes_total": "passes", "llama_forward_prefill_tokens_total": "prefill_tokens"}.get(name)
        if key and value:
            out.setdefault(labels[0], {}).setdefault(int(labels[1]), {})[key] = value
    return out


def test_the_static_engine_reports_every_row_of_every_group(engine):
    sink = Recorder(capacity=3, real_clock=True)
    batch = [prepared(engine, "The function returns", 3), prepared(engine, "A list of", 7),
             prepared(engine, "If the object is", 5)]
    for _ in batch:
        sink.received()
    results = engine.generate(batch, sink=lambda events: None, metrics=sink)
    counts = totals(sink)
    generated = sum(r.generated_tokens for r in results)
    assert counts[("llama_generation_tokens_total", ())] == generated
    assert counts[("llama_prompt_tokens_total", ())] == sum(len(p.prompt_ids) for p in batch)
    assert counts[("llama_step_rows_total", ())] == generated  # each live row made one token per step
    assert counts[("llama_steps_total", ())] == max(r.generated_tokens for r in results)
    assert len(sink.of("llama_time_to_first_token_seconds")) == len(sink.of("llama_e2e_request_latency_seconds")) == 3
    reasons = {}
    for r in results:
        reasons[r.finish_reason] = reasons.get(r.finish_reason, 0) + 1
    assert {ls[0]: v for (n, ls), v in counts.items() if n == "llama_request_success_total"} == reasons
    passes = forward_totals(counts)
    assert passes["prefill"] == {0: {"passes": 1, "prefill_tokens": sum(len(p.prompt_ids) for p in batch)}}
    assert sum(shape["passes"] for shape in passes["decode"].values()) == counts[("llama_steps_total", ())] - 1
    assert set(passes["decode"]) <= {1, 2, 3} and counts[("llama_forward_seconds_total", ("prefill", "0"))] > 0
    engine.generate([prepared(engine, "When the file", 2)], metrics=sink)  # no stream sink: still reported
    assert len(sink.of("llama_e2e_request_latency_seconds")) == 4
    queue, ttft, e2e = (sink.of(f"llama_{n}_seconds") for n in ("request_queue_time", "time_to_first_token",
                                                                  "e2e_request_latency"))
    assert min(queue) > 0 and sum(queue) <= sum(ttft) <= sum(e2e)  # (finish order differs from row order)


def test_the_scheduler_reports_admissions_tokens_cancellations_and_steps(engine, hf_model):
    backend = TorchSlotBackend(hf_model, max_slots=2, max_length=256)
    scheduler = ContinuousScheduler(backend, engine.tokenizer, max_slots=2, max_queue=4)
    sink = scheduler.metrics = Recorder(capacity=2, continuous=True, real_clock=True)
    done = [scheduler.submit(prepared(engine, p, n)) for p, n in (("The function returns", 4), ("A list of", 6))]
    waiting = scheduler.submit(prepared(engine, "If the object is", 5))
    left = scheduler.submit(prepared(engine, "When the file", 5))
    for _ in range(4):
        sink.received()
    scheduler.cancel(left.request_id)  # never admitted
    while not all(h.done for h in done + [waiting]):
        scheduler.step()
    counts = totals(sink)
    generated = sum(h.result.generated_tokens for h in done + [waiting])
    assert counts[("llama_generation_tokens_total", ())] == generated == counts[("llama_step_rows_total", ())]
    assert counts[("llama_request_success_total", ("length",))] == 3
    assert counts[("llama_request_cancelled_total", ())] == 1 and counts[("llama_requests_total", ())] == 4
    assert counts[("llama_steps_total", ())] == scheduler.steps
    assert len(sink.of("llama_request_queue_time_seconds")) == 3  # the cancelled one never got a slot
    passes = forward_totals(counts)
    assert sum(shape["passes"] for kind in passes.values() for shape in kind.values()) == scheduler.steps
    assert sum(shape.get("prefill_tokens", 0) for shape in passes["prefill"].values()) == \
        sum(len(h.prepared.prompt_ids) for h in done + [waiting])
    assert set(passes["decode"]) <= {1, 2} and set(passes["prefill"]) <= {0, 1}  # a prefill pass decodes the other slot
    assert "prefill_tokens" not in passes["decode"].get(2, {})
    assert sink.of("llama_slots_in_use")[-1] == 0 and sink.of("llama_requests_waiting")[-1] == 0


# -- TorchServe's metric lines, metrics.yaml, config.properties ----------------------------------

# The frontend's parser of a worker's metric line (0.12.0, frontend/.../metrics/Metric.java PATTERN).
FRONTEND_LINE = re.compile(r"\s*([\w\s]+)\.([\w\s]+):([0-9\-,.e]+)\|#([^|]*)(\|#type:([^|,]+))?\|#hostname:([^,]+),([^,]+)(,(.*))?")


def test_torchserve_lines_parse_as_the_frontend_parses_them(caplog):
    from ts.metrics.metric_cache_yaml_impl import MetricsCacheYamlImpl

    cache = MetricsCacheYamlImpl(str(ROOT / "metrics.yaml"))
    cache.initialize_cache()
    sink = TorchServeMetrics(cache, "tiny-llama", 8, continuous=True)
    r = request()
    with caplog.at_level(logging.INFO):
        sink.received()
        sink.admitted(r)
        sink.token(r, 1)
        sink.finished(r, "stop_sequence", 1)
        sink.error(413)
        sink.flush()
    lines = [m.split("[METRICS]", 1)[1] for m in caplog.messages if m.startswith("[METRICS]")]
    parsed = {}
    for line in lines:
        match = FRONTEND_LINE.fullmatch(line)
        assert match, line
        dims = dict(d.split(":") for d in match[4].split(","))
        parsed[(match[1], dims.get("finish_reason") or dims.get("status"))] = (match[2], match[6], float(match[3]))
        assert dims["ModelName"] == "tiny-llama" and list(dims) == dimensions(match[1])
    assert parsed[("llama_request_success_total", "stop_sequence")] == ("Count", "COUNTER", 1)
    assert parsed[("llama_request_errors_total", "413")] == ("Count", "COUNTER", 1)
    assert parsed[("llama_requests_total", None)] == ("Count", "COUNTER", 2)
    assert parsed[("llama_time_to_first_token_seconds", None)][:2] == ("Seconds", "HISTOGRAM")
    assert parsed[("llama_slots_in_use", None)] == ("Count", "GAUGE", 0)


def test_without_torchserve_metrics_nothing_is_recorded():
    sink = TorchServeMetrics(None, "m", 2)  # a Context without metrics (handler tests)
    sink.received()
    sink.error(400)
    sink.flush()


def test_metrics_yaml_declares_exactly_the_handler_metrics_and_keeps_torchserves():
    ours = yaml.safe_load((ROOT / "metrics.yaml").read_text())
    import ts

    theirs = yaml.safe_load((Path(ts.__file__).parent / "configs" / "metrics.yaml").read_text())
    assert ours["ts_metrics"] == theirs["ts_metrics"]
    declared = {}
    for kind, entries in ours["model_metrics"].items():
        for entry in entries:
            declared[entry["name"]] = (kind, entry["unit"], entry["dimensions"])
    for kind, entries in theirs["model_metrics"].items():
        for entry in entries:
            assert declared.pop(entry["name"]) == (kind, entry["unit"], entry["dimensions"])
    assert declared == {spec.name: (spec.kind, spec.unit, dimensions(spec.name)) for spec in METRICS}
    generated = model_metrics_yaml()
    assert {k: [e["name"] for e in v] for k, v in generated.items()} == \
        {k: [s.name for s in METRICS if s.kind == k] for k in (COUNTER, GAUGE, HISTOGRAM)}


def test_metric_names_follow_prometheus_conventions():
    for spec in METRICS:
        assert spec.name.startswith("llama_") and re.fullmatch(r"[a-z0-9_]+", spec.name)
        assert spec.name.endswith("_total") == (spec.kind == COUNTER), spec.name
        assert spec.name.endswith("_seconds") == (spec.kind == HISTOGRAM), spec.name
        assert (spec.unit == "s") == ("seconds" in spec.name), spec.name


def test_config_properties_serves_prometheus_metrics_on_loopback(tmp_path):
    from scripts.tsctl import TorchServe, read_properties

    props = read_properties(ROOT / "config.properties")
    assert props["metrics_mode"] == "prometheus" and props["metrics_address"].startswith("http://127.0.0.1:")
    assert (ROOT / props["metrics_config"]).is_file()
    server = TorchServe(tmp_path, tmp_path)  # started from its own work directory: the path must not be relative
    assert server.props["metrics_config"] == str(ROOT / "metrics.yaml")


# -- reading a scrape ----------------------------------------------------------------------------

SCRAPE = """# HELP llama_time_to_first_token_seconds Torchserve prometheus histogram metric with unit: s
# TYPE llama_time_to_first_token_seconds histogram
llama_time_to_first_token_seconds_bucket{ModelName="m",Hostname="h",le="0.1",} 2.0
llama_time_to_first_token_seconds_bucket{ModelName="m",Hostname="h",le="1.0",} 6.0
llama_time_to_first_token_seconds_bucket{ModelName="m",Hostname="h",le="10.0",} 8.0
llama_time_to_first_token_seconds_bucket{ModelName="m",Hostname="h",le="+Inf",} 10.0
llama_time_to_first_token_seconds_count{ModelName="m",Hostname="h",} 10.0
llama_time_to_first_token_seconds_sum{ModelName="m",Hostname="h",} 55.5
llama_request_errors_total{ModelName="m",status="400",Hostname="h",} 3.0
llama_request_errors_total{ModelName="other",status="400",Hostname="h",} 1.0
llama_request_queue_time_seconds_sum{ModelName="m",Hostname="h",} 4.9E-4
"""


def test_a_scrape_reads_as_prometheus_would():
    samples = parse(SCRAPE)
    got = summary(samples, "m")
    assert got["errors_by_status"] == {"400": 3}
    assert got["time_to_first_token"]["mean_s"] == pytest.approx(5.55)
    assert got["request_queue_time"]["sum_s"] == pytest.approx(4.9e-4)
    assert quantile(samples, "llama_time_to_first_token_seconds", 0.5, "m") == pytest.approx(0.1 + 0.9 * 3 / 4)
    # past the last finite bucket a quantile can only say 10 s: the bucket caveat of docs/operations.md
    assert quantile(samples, "llama_time_to_first_token_seconds", 0.95, "m") == 10.0


def test_the_bench_waits_for_every_counted_request_to_have_an_outcome(monkeypatch):
    """Requests are counted on arrival, outcomes and tokens at the handler's next flush."""
    from scripts.bench.server_metrics import ServerMetrics

    def scrape(requests, finished, tokens):
        return parse(f"""llama_requests_total{{ModelName="m"}} {requests}
llama_request_success_total{{ModelName="m",finish_reason="length"}} {finished}
llama_generation_tokens_total{{ModelName="m"}} {tokens}
""")

    scrapes = iter([scrape(2, 1, 10), scrape(2, 1, 10), scrape(2, 2, 20), scrape(2, 2, 20)])
    server = ServerMetrics("http://127.0.0.1:1/metrics", "m")
    monkeypatch.setattr(server, "scrape", lambda: next(scrapes))
    monkeypatch.setattr("scripts.bench.server_metrics.time.sleep", lambda s: None)
    got = server.since(parse(""), requests=2)
    assert got["generation_tokens"] == 20 and got["finish_reasons"] == {"length": 2}


def test_the_bench_takes_figures_only_from_two_scrapes_that_agree(monkeypatch):
    """A scrape is no snapshot: the frontend collects one metric after another while it parses the
    worker's lines, so one scrape can hold a flush's outcomes and count but not its tokens (collected
    before the lines were parsed), or a count of two with one success (a CI run read that)."""
    from scripts.bench.server_metrics import ServerMetrics

    def scrape(requests, finished, tokens, running=0):
        return parse(f"""llama_requests_total{{ModelName="m"}} {requests}
llama_request_success_total{{ModelName="m",finish_reason="length"}} {finished}
llama_generation_tokens_total{{ModelName="m"}} {tokens}
llama_requests_running{{ModelName="m"}} {running}
""")

    server = ServerMetrics("http://127.0.0.1:1/metrics", "m")
    monkeypatch.setattr("scripts.bench.server_metrics.time.sleep", lambda s: None)
    scrapes = iter([scrape(2, 2, 10), scrape(2, 2, 20), scrape(2, 2, 20)])
    monkeypatch.setattr(server, "scrape", lambda: next(scrapes))
    assert server.since(parse(""), requests=2)["generation_tokens"] == 20
    scrapes = iter([scrape(2, 1, 20), scrape(2, 2, 20, running=1), scrape(2, 2, 20), scrape(2, 2, 20)])
    got, after = server.settled(parse(""), 2, idle=True)
    assert got["success_by_finish_reason"] == {"length": 2} and summary(after, "m")["running"] == 0
    assert next(scrapes, None) is None


def test_the_bench_waits_for_the_forward_passes_of_every_counted_prompt_token(monkeypatch):
    """The outcomes may be flushed before the passes that prefilled their prompts: the round's pass figures
    (``server_forward_rounds``) would then miss a prompt."""
    from scripts.bench.server_metrics import ServerMetrics

    def scrape(prefilled):
        return parse(f"""llama_requests_total{{ModelName="m"}} 1
llama_request_success_total{{ModelName="m",finish_reason="length"}} 1
llama_prompt_tokens_total{{ModelName="m"}} 96
llama_forward_passes_total{{ModelName="m",kind="prefill",rows="1"}} {1 if prefilled else 0}
llama_forward_prefill_tokens_total{{ModelName="m",kind="prefill",rows="1"}} {prefilled}
llama_forward_passes_total{{ModelName="m",kind="decode",rows="1"}} 5
""")

    scrapes = iter([scrape(0), scrape(0), scrape(96), scrape(96)])
    server = ServerMetrics("http://127.0.0.1:1/metrics", "m")
    monkeypatch.setattr(server, "scrape", lambda: next(scrapes))
    monkeypatch.setattr("scripts.bench.server_metrics.time.sleep", lambda s: None)
    got = server.since(parse(""), requests=1)
    assert got["forward"]["prefill"]["1"]["prefill_tokens"] == 96


def test_the_bench_counts_a_run_from_a_server_at_rest(monkeypatch):
    """A scrape right after a run can hold half of its last flush: the prompt tokens, not yet the passes
    that prefilled them. Counted from there, the next run would be counted the rest."""
    from scripts.bench.server_metrics import ServerMetrics

    def scrape(prompt, prefilled, finished):
        return parse(f"""llama_requests_total{{ModelName="m"}} {finished}
llama_request_success_total{{ModelName="m",finish_reason="length"}} {finished}
llama_prompt_tokens_total{{ModelName="m"}} {prompt}
llama_forward_passes_total{{ModelName="m",kind="prefill",rows="0"}} 1
llama_forward_prefill_tokens_total{{ModelName="m",kind="prefill",rows="0"}} {prefilled}
""")

    mid_flush, outcomes_missing, at_rest = scrape(256, 128, 4), scrape(256, 256, 4), scrape(256, 256, 8)
    scrapes = iter([mid_flush, mid_flush, outcomes_missing, at_rest, at_rest, scrape(300, 300, 9)])
    server = ServerMetrics("http://127.0.0.1:1/metrics", "m")
    monkeypatch.setattr(server, "scrape", lambda: next(scrapes))
    monkeypatch.setattr("scripts.bench.server_metrics.time.sleep", lambda s: None)
    assert server.snapshot() == at_rest
