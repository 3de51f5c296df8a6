"""Package a built model with torch-model-archiver into a TorchServe model store.

The archive holds the thin handler, the ``llama_engine`` package, the handler's metrics
adapter (``llama_metrics.py``, next to the handler), the model-config YAML, the
weights and tokenizer (under ``model/``) and a per-model requirements file. torch-model-archiver
flattens one level of ``--extra-files`` directories, so the files are staged first in the
layout they must have inside the model directory::

    <stage>/llama_engine/...   ->  <model dir>/llama_engine/...
    <stage>/llama_metrics.py   ->  <model dir>/llama_metrics.py
    <stage>/model/...          ->  <model dir>/model/...
    <stage>/compile_cache/...  ->  <model dir>/compile_cache/...   (compiled configs only)

For the torch backend the staged engine also holds its native CPU kernels, compiled here for
every instruction set (``llama_engine/backends/libllama_cpu_kernels-<isa>-<digest>.so``).
"""
from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path
from typing import Optional

ROOT = Path(__file__).resolve().parent.parent
HANDLER = ROOT / "handlers" / "llama_handler.py"
ENGINE = ROOT / "handlers" / "llama_engine"
METRICS_ADAPTER = ROOT / "handlers" / "llama_metrics.py"
MODEL_REQUIREMENTS = ROOT / "handlers" / "requirements-model.txt"
FORMATS = {"no-archive": "", "tgz": ".tar.gz", "default": ".mar"}
# Fixed, because it is part of the OpenAI-compatible API's address: /predictions/<model>/1.0/v1.
ARCHIVE_VERSION = "1.0"


def stage(model_dir: Path, stage_dir: Path, compile_cache: Optional[Path] = None, native_kernels: bool = False) -> Path:
    """Lay out what the archive holds; ``native_kernels``: compile the torch backend's CPU kernels for
    every instruction set into the staged engine, so that the serving host needs no compiler."""
    if stage_dir.exists():
        shutil.rmtree(stage_dir)
    ignore = shutil.ignore_patterns("__pycache__", "*.pyc", "*.so")
    shutil.copytree(ENGINE, stage_dir / "llama_engine", ignore=ignore)
    if native_kernels:
        ship_native_kernels(stage_dir / "llama_engine" / "backends")
    shutil.copy2(METRICS_ADAPTER, stage_dir / METRICS_ADAPTER.name)
    shutil.copytree(model_dir, stage_dir / "model", ignore=ignore)
    if list((stage_dir / "model").glob("*.bin")) or list((stage_dir / "model").glob("*.pt")):
        raise SystemExit(f"{model_dir}: pickle weights (*.bin/*.pt) found; ship safetensors only")
    if compile_cache is not None:
        shutil.copytree(compile_cache, stage_dir / "compile_cache", ignore=shutil.ignore_patterns("*.lock"))
    return stage_dir


def ship_native_kernels(directory: Path) -> list:
    """Every instruction set's build of the native CPU kernels in ``directory`` (none, with the reason
    printed, where this host cannot compile them: the serving host then builds them or keeps torch's)."""
    from llama_engine.backends import cpu_kernels

    try:
        built = cpu_kernels.build_all(directory)
    except cpu_kernels.KernelBuildError as exc:
        print(f"    native CPU kernels not shipped: {exc}", flush=True)
        return []
    print(f"    native CPU kernels shipped: {', '.join(path.name for path in built)}", flush=True)
    return built


def archiver() -> str:
    """``torch-model-archiver``: on PATH, else beside this interpreter (``.venv/bin/python scripts/...``
    run without the venv on PATH)."""
    found = shutil.which("torch-model-archiver")
    beside = Path(sys.executable).parent / "torch-model-archiver"
    if found:
        return found
    if beside.is_file():
        return str(beside)
    raise FileNotFoundError("torch-model-archiver is neither on PATH nor beside this Python "
                            f"({sys.executable}); install requirements.txt into this environment (make venv)")


def archive(name: str, config: Path, stage_dir: Path, export: Path, fmt: str, version: str) -> Path:
    export.mkdir(parents=True, exist_ok=True)
    target = export / (name + FORMATS[fmt])
    if target.is_dir():
        shutil.rmtree(target)
    elif target.exists():
        target.unlink()
    cmd = [
        archiver(), "--model-name", name, "--version", version,
        "--handler", str(HANDLER), "--extra-files", str(stage_dir),
        "--config-file", str(config), "--requirements-file", str(MODEL_REQUIREMENTS),
        "--archive-format", fmt, "--export-path", str(export), "--force",
    ]
    subprocess.run(cmd, check=True)
    return target
