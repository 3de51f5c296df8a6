#!/usr/bin/env python3
"""Prepare a Hugging Face Llama checkpoint for packaging: safetensors weights + tokenizer.

    python scripts/prepare_checkpoint.py --checkpoint /path/to/Llama-2-13b-hf --out build/llama-2-13b/model

Weights are linked (or copied across file systems), never converted through pickle: a
checkpoint with only ``*.bin``/``*.pt`` weights is refused with the fix in the message.
transformers-neuronx loads safetensors checkpoints directly; ``--legacy-split`` writes the
old ``save_pretrained_split`` layout for Neuron SDKs before 2.18 instead.
"""
from __future__ import annotations

import argparse
import importlib.util
import json
import os
import shutil
import sys
from pathlib import Path

WEIGHT_GLOBS = ("*.safetensors", "model.safetensors.index.json")
META_FILES = ("config.json", "generation_config.json", "tokenizer.json", "tokenizer_config.json",
              "special_tokens_map.json", "tokenizer.model")
PICKLE_GLOBS = ("*.bin", "*.pt", "*.pth", "*.ckpt")


def check_checkpoint(src: Path) -> None:
    config = src / "config.json"
    if not config.exists():
        raise SystemExit(f"{src}: no config.json; point --checkpoint at a Hugging Face model directory")
    model_type = json.loads(config.read_text()).get("model_type")
    if model_type not in ("llama", "mistral"):
        raise SystemExit(f"{src}: model_type {model_type!r}; this toolkit serves Llama-family models")
    if not list(src.glob("*.safetensors")):
        pickles = [p.name for g in PICKLE_GLOBS for p in src.glob(g)]
        hint = f" (found {', '.join(pickles[:3])})" if pickles else ""
        raise SystemExit(f"{src}: no *.safetensors weights{hint}. Weights are loaded from safetensors only; "
                         "convert them once in a trusted environment, e.g. "
                         "AutoModelForCausalLM.from_pretrained(src).save_pretrained(dst, safe_serialization=True)")
    if not ((src / "tokenizer.json").exists() or (src / "tokenizer.model").exists()):
        raise SystemExit(f"{src}: no tokenizer.json or tokenizer.model next to the weights")


def link_or_copy(src: Path, dst: Path) -> None:
    try:
        os.link(src, dst)
    except OSError:
        shutil.copy2(src, dst)


def prepare(src: Path, out: Path) -> Path:
    check_checkpoint(src)
    staging = out.with_name(out.name + ".partial")
    shutil.rmtree(staging, ignore_errors=True)
    staging.mkdir(parents=True)
    names = {p.name for g in WEIGHT_GLOBS for p in src.glob(g)} | {n for n in META_FILES if (src / n).exists()}
    for name in sorted(names):
        link_or_copy(src / name, staging / name)
    shutil.rmtree(out, ignore_errors=True)
    staging.rename(out)
    return out


def legacy_split(src: Path, out: Path) -> Path:
    """The pre-2.18 Neuron layout; needs transformers-neuronx, so only on an inf2 host."""
    from transformers import AutoModelForCausalLM
    from transformers_neuronx.module import save_pretrained_split

    check_checkpoint(src)
    # accelerate (a transformers-neuronx dependency) lets a 70B checkpoint load without a second copy in RAM.
    low_memory = importlib.util.find_spec("accelerate") is not None
    model = AutoModelForCausalLM.from_pretrained(src, use_safetensors=True, low_cpu_mem_usage=low_memory)
    save_pretrained_split(model, str(out))
    for name in META_FILES:
        if (src / name).exists() and not (out / name).exists():
            shutil.copy2(src / name, out / name)
    return out


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--checkpoint", required=True, type=Path, help="HF checkpoint directory (safetensors weights)")
    parser.add_argument("--out", required=True, type=Path, help="directory to write the prepared checkpoint to")
    parser.add_argument("--legacy-split", action="store_true", help="save_pretrained_split layout (Neuron SDK < 2.18)")
    args = parser.parse_args(argv)
    out = (legacy_split if args.legacy_split else prepare)(args.checkpoint.resolve(), args.out)
    print(f"prepared {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
