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

The weights and the compile cache are staged as hard links (copies across file systems), and a
``no-archive`` export takes them the same way, after the archiver has packed the rest: the archiver
copies all it packs twice (into a temporary directory beside the system's, then to the export).
Through it a 13 GB checkpoint needed 39 GB of disk beyond the checkpoint and filled this machine's
(Llama-2-7B's shape, 2026-12-06); a 70B one would have needed 420 GB.
"""
from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path
from typing import List, Optional

from scripts.prepare_checkpoint import link_or_copy

ROOT = Path(__file__).resolve().parent.parent
HANDLER = ROOT / "handlers" / "llama_handler.py"
ENGINE = ROOT / "handlers" / "llama_engine"
METRICS_ADAPTER = ROOT / "handlers" / "llama_metrics.py"
MODEL_REQUIREMENTS = ROOT / "handlers" / "requirements-model.txt"
FORMATS = {"no-archive": "", "tgz": ".tar.gz", "default": ".mar"}
# Fixed, because it is part of the OpenAI-compatible API's address: /predictions/<model>/1.0/v1.
ARCHIVE_VERSION = "1.0"
#: What a ``no-archive`` export takes as links to the staged files rather than through the archiver.
LINKED_AFTER = ("model", "compile_cache")


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
    shutil.copytree(model_dir, stage_dir / "model", ignore=ignore, copy_function=link_or_copy)
    if list((stage_dir / "model").glob("*.bin")) or list((stage_dir / "model").glob("*.pt")):
        raise SystemExit(f"{model_dir}: pickle weights (*.bin/*.pt) found; ship safetensors only")
    if compile_cache is not None:
        shutil.copytree(compile_cache, stage_dir / "compile_cache", ignore=shutil.ignore_patterns("*.lock"),
                        copy_function=link_or_copy)
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
    linked = [stage_dir / d for d in LINKED_AFTER if (stage_dir / d).exists()] if fmt == "no-archive" else []
    packed = _without(stage_dir, linked) if linked else stage_dir
    cmd = [
        archiver(), "--model-name", name, "--version", version,
        "--handler", str(HANDLER), "--extra-files", str(packed),
        "--config-file", str(config), "--requirements-file", str(MODEL_REQUIREMENTS),
        "--archive-format", fmt, "--export-path", str(export), "--force",
    ]
    try:
        subprocess.run(cmd, check=True)
    finally:
        if packed != stage_dir:
            shutil.rmtree(packed)
    for directory in linked:
        shutil.copytree(directory, target / directory.name, copy_function=link_or_copy)
    return target


def _without(stage_dir: Path, left_out: List[Path]) -> Path:
    """A sibling of ``stage_dir`` with links to all it holds but ``left_out`` (what the archiver packs)."""
    packed = stage_dir.with_name(stage_dir.name + ".packed")
    shutil.rmtree(packed, ignore_errors=True)
    names = {path.name for path in left_out}
    shutil.copytree(stage_dir, packed, copy_function=link_or_copy,
                    ignore=lambda directory, entries: names & set(entries) if Path(directory) == stage_dir else ())
    return packed
