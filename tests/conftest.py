"""Shared fixtures. Tests are marked by folder: unit, e2e, neuron, gpu."""
from __future__ import annotations

import functools
import glob
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
DEFAULT_MODEL_DIR = ROOT / "build" / "tiny-llama"


@functools.cache
def _has_cuda() -> bool:
    import torch

    return torch.cuda.is_available()


def pytest_collection_modifyitems(config, items):
    has_neuron = bool(glob.glob("/dev/neuron*"))
    for item in items:
        folder = Path(str(item.fspath)).relative_to(ROOT / "tests").parts[0]
        if folder in ("unit", "e2e", "neuron", "gpu"):
            item.add_marker(getattr(pytest.mark, folder))
        if folder == "neuron" and not has_neuron:
            item.add_marker(pytest.mark.skip(reason="needs Neuron hardware (/dev/neuron*)"))
        if folder == "gpu" and not _has_cuda():
            item.add_marker(pytest.mark.skip(reason="needs a CUDA GPU (torch.cuda.is_available())"))


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory) -> Path:
    """The embedded default model, as `make build` makes it; built here if missing."""
    path = Path(os.environ.get("TINY_MODEL_DIR", DEFAULT_MODEL_DIR))
    if not (path / "model.safetensors").exists():
        path = tmp_path_factory.mktemp("tiny") / "tiny-llama"
        subprocess.run([sys.executable, str(ROOT / "scripts" / "build_tiny_llama.py"), "--out", str(path)],
                       check=True)
    return path


@pytest.fixture(scope="session")
def tokenizer(tiny_model_dir):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(tiny_model_dir)


@pytest.fixture(scope="module")
def hf_model(tiny_model_dir):
    """The tiny model as HF loads it (float32, nothing fused or packed): the reference forward, and
    a model that slot backends may share (the engine's own backend owns and fuses its copy)."""
    from llama_engine.backends.torch_backend import load_model

    return load_model(str(tiny_model_dir), "float32", "cpu", max_length=256)


@pytest.fixture(scope="module")
def engine(tiny_model_dir):
    """The tiny model's static engine on one torch thread (restored after the module).

    One thread: the tiny model gains nothing from more, and spinning OpenMP threads slow down
    many-fold while other test processes share the machine. Modules that need other limits
    define their own ``engine``.
    """
    import torch

    from llama_engine import Engine
    from llama_engine.config import HandlerConfig

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    # float32, as the tiny configs ship: the references it gives must not depend on the CPU's auto dtype
    cfg = HandlerConfig(model_path=tiny_model_dir.name, max_length=256, max_new_tokens=16, dtype="float32")
    yield Engine.from_config(cfg, str(tiny_model_dir.parent))
    torch.set_num_threads(threads)
