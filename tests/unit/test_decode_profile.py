"""scripts/bench/decode_profile.py's baseline: a revision's own torch backend, fast linears and native
kernels, importable beside the current ones (a script that prints figures; only its loading is tested)."""
import sys

import torch

from llama_engine.backends import cpu_kernels, torch_backend
from scripts.bench import decode_profile


def test_the_baseline_brings_its_own_modules_and_its_own_kernel_source():
    baseline = decode_profile.load_baseline("HEAD")
    assert baseline.TorchSlotBackend is not torch_backend.TorchSlotBackend
    kernels = sys.modules["llama_engine.backends._baseline_cpu_kernels"]
    assert kernels is not cpu_kernels
    assert kernels.SOURCE != cpu_kernels.SOURCE and kernels.SOURCE.name == "cpu_kernels.cpp"
    assert kernels.SOURCE.read_bytes() == decode_profile.git_show(
        "HEAD", f"{decode_profile.BACKENDS}/cpu_kernels.cpp").encode()


def test_the_baseline_backend_runs_a_decode_step(tiny_model_dir):
    baseline = decode_profile.load_baseline("HEAD")
    backend = baseline.TorchSlotBackend.from_pretrained(str(tiny_model_dir), 1, 64, "float32", "cpu")
    logits = backend.prefill_slot(0, [1, 5, 9])
    assert backend.decode_slots([0], [int(logits.argmax())]).shape == (1, logits.shape[-1])
    assert torch.isfinite(logits).all()
