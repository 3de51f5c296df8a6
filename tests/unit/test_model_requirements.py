"""The archive's per-model requirements cover every third-party import of the handler code.

On SageMaker (TS_INSTALL_PY_DEP_PER_MODEL=true) these are all the container installs for the
model; a missing one only shows as an ImportError on the endpoint, half an hour in.
"""
import ast
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
# What the PyTorch (Neuronx) inference container already has.
CONTAINER = {"torch", "ts", "transformers_neuronx", "torch_neuronx", "neuronxcc", "llama_engine",
             "llama_metrics"}  # (the last two ship in the archive)
# Built for the host's CPU, so never installed per model: the llamacpp backend needs it in the image
# (make llamacpp here; `make deploy` warns that the SageMaker images lack it).
HOST_BUILT = {"llama_cpp"}
IMPORT_TO_DIST = {"yaml": "pyyaml", "transformers": "transformers", "tokenizers": "tokenizers",
                  "safetensors": "safetensors"}


def third_party_imports():
    names = set()
    for path in (ROOT / "handlers").rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Import):
                names.update(alias.name.split(".")[0] for alias in node.names)
            elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
                names.add(node.module.split(".")[0])
    return {n for n in names if n not in sys.stdlib_module_names and n not in CONTAINER | HOST_BUILT}


def test_requirements_model_covers_the_handler():
    listed = {line.split("==")[0].strip().lower() for line in
              (ROOT / "handlers" / "requirements-model.txt").read_text().splitlines()
              if line.strip() and not line.startswith("#")}
    imports = third_party_imports()
    assert imports, "the scan found no imports at all"
    missing = {name for name in imports if IMPORT_TO_DIST.get(name, name) not in listed}
    assert not missing, f"imported by handlers/ but not in requirements-model.txt: {missing}"
    assert "transformers" in listed and "safetensors" in listed
