"""The engine's metrics, recorded with TorchServe's own metrics API (``context.metrics``).

Each value becomes one ``[METRICS]`` line on the worker's stdout, which the frontend parses
and, with ``metrics_mode=prometheus``, adds to the metric of that name on the metrics API
(``:8082/metrics``). The frontend only keeps metrics declared in the server's
``metrics_config`` YAML (this repository's ``metrics.yaml``) unless
``model_metrics_auto_detect=true``: TorchServe 0.12 reads that file once, at start, for every
model, and takes no metrics declaration from a model archive. The worker reads the same file;
a metric missing there is added to the worker's cache here, so its lines are still written.

Labels: ``ModelName`` (the model's name) and the metric's own (``finish_reason``, ``status``,
``kind``); the frontend adds ``Hostname``.
"""
from __future__ import annotations

import logging
from typing import Dict

from llama_engine.metrics import METRICS, MODEL_LABEL, SPECS, TimedSink

logger = logging.getLogger(__name__)


class TorchServeMetrics(TimedSink):
    """A :class:`~llama_engine.metrics.TimedSink` that records into TorchServe's metrics cache.

    ``cache`` is ``context.metrics`` when the model loads; without one (a handler driven
    outside TorchServe) nothing is recorded.
    """

    def __init__(self, cache, model_name: str, capacity: int, continuous: bool = False, **kwargs):
        super().__init__(capacity, continuous, **kwargs)
        self.model_name = model_name
        self._metrics: Dict[str, object] = declare(cache) if hasattr(cache, "add_metric_to_cache") else {}

    def record(self, name: str, value: float, labels: tuple = ()) -> None:
        metric = self._metrics.get(name)
        if metric is not None:
            metric.add_or_update(_number(value), [self.model_name, *labels])


def declare(cache) -> Dict[str, object]:
    """The cache's metric object for each of :data:`METRICS`, added where the YAML lacks it."""
    from ts.metrics.metric_cache_errors import MetricsCacheKeyError
    from ts.metrics.metric_type_enum import MetricTypes

    metrics = {}
    for spec in METRICS:
        kind = MetricTypes(spec.kind)
        try:
            metrics[spec.name] = cache.get_metric(spec.name, kind)
        except MetricsCacheKeyError:
            metrics[spec.name] = cache.add_metric_to_cache(spec.name, spec.unit, dimensions(spec.name), kind)
    missing = [spec.name for spec in METRICS if metrics[spec.name].dimension_names != dimensions(spec.name)]
    if missing:
        logger.warning("metrics_config declares %s with other dimensions than %s; their values will be refused",
                       ", ".join(missing), [dimensions(n) for n in missing])
    return metrics


def dimensions(name: str) -> list:
    return [MODEL_LABEL, *SPECS[name].labels]


def _number(value: float):
    """Counts as integers (``3``, not ``3.0``), seconds as they are."""
    return int(value) if float(value).is_integer() else value


def model_metrics_yaml() -> dict:
    """The ``model_metrics`` section of a TorchServe metrics YAML that declares :data:`METRICS`
    (without TorchServe's own HandlerTime and PredictionTime)."""
    section: Dict[str, list] = {}
    for spec in METRICS:
        section.setdefault(spec.kind, []).append({"name": spec.name, "unit": spec.unit,
                                                  "dimensions": dimensions(spec.name)})
    return section
