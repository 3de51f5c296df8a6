"""Shared fixtures. Tests are marked by folder: unit, e2e, neuron."""
from __future__ import annotations

import glob
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
DEFAULT_MODEL_DIR = ROOT / "build" / "tiny-llama"


def pytest_collection_modifyitems(config, items):
    has_neuron = bool(glob.glob("/dev/neuron*"))
    for item in items:
        folder = Path(str(item.fspath)).relative_to(ROOT / "tests").parts[0]
        if folder in ("unit", "e2e", "neuron"):
            item.add_marker(getattr(pytest.mark, folder))
        if folder == "neuron" and not has_neuron:
            item.add_marker(pytest.mark.skip(reason="needs Neuron hardware (/dev/neuron*)"))


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
