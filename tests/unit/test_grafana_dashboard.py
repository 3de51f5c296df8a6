"""docs/grafana-dashboard.json queries only metrics the handler declares, in the form Prometheus
exposes them (a histogram's _bucket/_sum/_count, a counter under its own name), through a
Prometheus datasource variable, and covers the figures the metrics exist for."""
from __future__ import annotations

import json
import re
from pathlib import Path

from llama_engine.metrics import COUNTER, GAUGE, HISTOGRAM, METRICS, SPECS

ROOT = Path(__file__).resolve().parents[2]
DASHBOARD = json.loads((ROOT / "docs" / "grafana-dashboard.json").read_text())


def panels():
    return DASHBOARD["panels"]


def exprs():
    return [target["expr"] for panel in panels() for target in panel["targets"]]


def series(expr: str) -> set:
    """The metric names an expression selects (identifiers followed by ``{`` or ``[``)."""
    return set(re.findall(r"([a-zA-Z_:][a-zA-Z0-9_:]*)\s*\{", expr))


def declared_series(name: str) -> bool:
    for suffix in ("_bucket", "_sum", "_count"):
        if name.endswith(suffix) and SPECS.get(name[: -len(suffix)], None) is not None:
            return SPECS[name[: -len(suffix)]].kind == HISTOGRAM
    spec = SPECS.get(name)
    return spec is not None and spec.kind in (COUNTER, GAUGE)


def test_every_queried_metric_is_one_the_handler_declares():
    queried = set().union(*(series(e) for e in exprs()))
    assert queried, "no metric found in the dashboard's queries"
    unknown = {name for name in queried if not declared_series(name)}
    assert not unknown, f"the dashboard queries metrics the handler does not declare: {unknown}"
    variable_query = {v["name"]: v for v in DASHBOARD["templating"]["list"]}["model"]["definition"]
    assert all(declared_series(n) for n in re.findall(r"label_values\((\w+)", variable_query))


def test_rates_are_taken_of_counters_and_histogram_series_only():
    for expr in exprs():
        for name in re.findall(r"rate\(\s*(\w+)\{", expr):
            assert name.endswith(("_total", "_bucket", "_sum", "_count")), (name, expr)
        for name in re.findall(r"histogram_quantile\([^,]+,[^(]*\(\s*rate\(\s*(\w+)\{", expr):
            assert name.endswith("_bucket"), expr


def test_every_panel_uses_the_datasource_variable_and_filters_by_model():
    variables = {v["name"]: v for v in DASHBOARD["templating"]["list"]}
    assert variables["datasource"]["type"] == "datasource" and variables["datasource"]["query"] == "prometheus"
    for panel in panels():
        assert panel["datasource"]["uid"] == "${datasource}", panel["title"]
        for target in panel["targets"]:
            assert target["datasource"]["uid"] == "${datasource}"
            assert 'ModelName=~"$model"' in target["expr"], target["expr"]
    ids = [p["id"] for p in panels()]
    assert len(ids) == len(set(ids))


def test_the_dashboard_covers_latency_percentiles_throughput_outcomes_and_load():
    text = "\n".join(exprs())
    for histogram in ("llama_time_to_first_token_seconds", "llama_request_time_per_output_token_seconds",
                      "llama_e2e_request_latency_seconds"):
        for q in ("0.5", "0.9", "0.99"):
            assert f"histogram_quantile({q}, sum by (le, ModelName) (rate({histogram}_bucket" in text
    for needle in ("rate(llama_generation_tokens_total", "by (ModelName, finish_reason) (rate(llama_request_success_total",
                   "by (ModelName, status) (rate(llama_request_errors_total", "llama_requests_running",
                   "llama_requests_waiting", "llama_slots_in_use", "rate(llama_step_rows_total"):
        assert needle in text, needle
    unused = {spec.name for spec in METRICS} - {n.rsplit("_bucket", 1)[0].rsplit("_sum", 1)[0].rsplit("_count", 1)[0]
                                                 for e in exprs() for n in series(e)}
    assert not unused, f"declared but on no panel: {unused}"
