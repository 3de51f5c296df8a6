#!/usr/bin/env python3
"""Package a built model with torch-model-archiver into a TorchServe model store.

The archive holds the thin handler, the ``llama_engine`` package, the model-config YAML, the
weights and tokenizer (under ``model/``) and a per-model requirements file. torch-model-archiver
flattens one level of ``--extra-files`` directories, so the files are staged first in the
layout they must have inside the model directory::

    <stage>/llama_engine/...   ->  <model dir>/llama_engine/...
    <stage>/model/...          ->  <model dir>/model/...
"""
from __future__ import annotations

import argparse
import shutil
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
HANDLER = ROOT / "handlers" / "llama_handler.py"
ENGINE = ROOT / "handlers" / "llama_engine"
MODEL_REQUIREMENTS = ROOT / "handlers" / "requirements-model.txt"
FORMATS = {"no-archive": "", "tgz": ".tar.gz", "default": ".mar"}


def stage(model_dir: Path, stage_dir: Path) -> Path:
    if stage_dir.exists():
        shutil.rmtree(stage_dir)
    ignore = shutil.ignore_patterns("__pycache__", "*.pyc")
    shutil.copytree(ENGINE, stage_dir / "llama_engine", ignore=ignore)
    shutil.copytree(model_dir, stage_dir / "model", ignore=ignore)
    if list((stage_dir / "model").glob("*.bin")) or list((stage_dir / "model").glob("*.pt")):
        raise SystemExit(f"{model_dir}: pickle weights (*.bin/*.pt) found; ship safetensors only")
    return stage_dir


def archive(name: str, config: Path, stage_dir: Path, export: Path, fmt: str, version: str) -> Path:
    export.mkdir(parents=True, exist_ok=True)
    target = export / (name + FORMATS[fmt])
    if target.is_dir():
        shutil.rmtree(target)
    elif target.exists():
        target.unlink()
    cmd = [
        "torch-model-archiver", "--model-name", name, "--version", version,
        "--handler", str(HANDLER), "--extra-files", str(stage_dir),
        "--config-file", str(config), "--requirements-file", str(MODEL_REQUIREMENTS),
        "--archive-format", fmt, "--export-path", str(export), "--force",
    ]
    subprocess.run(cmd, check=True)
    return target


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--name", required=True, help="model name in TorchServe")
    parser.add_argument("--config", required=True, type=Path, help="model-config YAML")
    parser.add_argument("--model-dir", required=True, type=Path, help="HF checkpoint (safetensors) + tokenizer")
    parser.add_argument("--export-path", default=ROOT / "model_store", type=Path)
    parser.add_argument("--stage-dir", type=Path, help="scratch directory (default build/stage/<name>)")
    parser.add_argument("--archive-format", default="no-archive", choices=sorted(FORMATS))
    parser.add_argument("--version", default="1.0")
    args = parser.parse_args(argv)

    sys.path.insert(0, str(ROOT / "handlers"))
    from llama_engine import load_model_config_file

    load_model_config_file(str(args.config))  # fail here, not at torchserve start
    if not (args.model_dir / "config.json").exists():
        raise SystemExit(f"{args.model_dir}: no config.json; build or prepare the model first")
    stage_dir = stage(args.model_dir, args.stage_dir or ROOT / "build" / "stage" / args.name)
    target = archive(args.name, args.config, stage_dir, args.export_path, args.archive_format, args.version)
    print(f"wrote {target}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
