"""scripts/neuron_smoke.py: what it measures (the e2e test runs it whole against the Neuron SDK double)."""
from __future__ import annotations

import pytest

from llama_engine import load_model_config_file
from scripts import neuron_smoke

from conftest import ROOT


@pytest.mark.parametrize("name", ["tiny-llama-neuron", "tiny-llama-neuron-continuous", "llama-2-7b-inf2-xlarge-b4",
                                  "llama-2-7b-inf2-xlarge-continuous"])
def test_benchmark_runs_at_one_and_at_the_compiled_batch_size(name):
    """Continuous configs have no micro-batch: their compiled batch is the slot count (batchSize)."""
    cfg = load_model_config_file(str(ROOT / "model-config" / f"{name}.yaml"))
    assert neuron_smoke.benchmark_concurrency(cfg) == [1, 4]
