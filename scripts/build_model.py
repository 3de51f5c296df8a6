#!/usr/bin/env python3
"""Build a servable model artifact from a checkpoint and a model-config, in four steps:

1. prepare the checkpoint (safetensors + tokenizer) into ``<build>/model``;
2. if the config compiles (backend neuron, or torch with ``compile: true``), load the model
   with the compiler's cache pointed at the build's cache: for torch, ``<build>/compile_cache``
   itself; for Neuron, the persistent cache ``<build>/neuron-compile-cache`` that stays on the
   build host (a rebuild reuses it);
3. warm up every graph: one generation per context bucket at the compiled batch size, which
   also compiles the token graph; for Neuron, ``model.save()`` the compiled graphs into
   ``<build>/compile_cache/neff``;
4. write the manifest next to the cache and package everything with torch-model-archiver.

    python scripts/build_model.py --config model-config/tiny-llama.yaml --checkpoint build/tiny-llama

For backend llamacpp, step 2 instead converts the checkpoint to a GGUF inside it with
llama.cpp's own ``convert_hf_to_gguf.py`` (the tree ``make llamacpp`` fetches, or
``LLAMA_CPP_TREE``), drops the safetensors weights it no longer needs (the tokenizer and
config stay), and runs one generation through llama.cpp to check the file.

TorchServe then loads the artifact without compiling: the handler verifies the manifest and
points the compiler at the shipped cache (Neuron: ``model.load()`` of the saved graphs).

On Neuron the build loads the model onto the NeuronCores, which stay with this process
until it exits: run it as its own process before TorchServe starts (``neuron_smoke.py`` does).
"""
from __future__ import annotations

import argparse
import functools
import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path
from typing import Optional, Tuple

from scripts import build_archive, prepare_checkpoint

ROOT = Path(__file__).resolve().parent.parent


def step(n: int, total: int, text: str) -> float:
    print(f"[{n}/{total}] {text}", flush=True)
    return time.perf_counter()


def compile_and_manifest(cfg, model_root: Path) -> Path:
    """Compile, warm every graph, collect what ships into a fresh cache next to the model, write the manifest."""
    from llama_engine.backends import cache_kind_and_settings
    from llama_engine.compile_cache import SAVED_NEFFS, write_manifest

    kind, settings = cache_kind_and_settings(cfg.handler, cfg.slots, cfg.continuous)
    cache = model_root / "compile_cache"
    partial = model_root / "compile_cache.partial"
    shutil.rmtree(partial, ignore_errors=True)
    neuron = cfg.handler.backend == "neuron"
    backend = warm_up(cfg, model_root, model_root / "neuron-compile-cache" if neuron else partial)
    print(f"    compile cache: {json.dumps(backend.compile_session.report(), sort_keys=True)}")
    if neuron:
        backend.model.save(str(partial / SAVED_NEFFS))
        print(f"    saved {len(list((partial / SAVED_NEFFS).iterdir()))} compiled graphs (model.save) to ship")
    manifest = write_manifest(partial, kind, settings)
    shutil.rmtree(cache, ignore_errors=True)
    partial.rename(cache)
    print(f"    {len(manifest['files'])} cache files, settings {settings}")
    return cache


#: ``convert_hf_to_gguf.py --outtype`` of a checkpoint stored in each 16-bit dtype.
GGUF_OF_16_BIT = {"bfloat16": "bf16", "float16": "f16"}
#: The largest finite float16: a bf16 weight beyond it would become infinite in an f16 GGUF.
F16_MAX = 65504.0


def gguf_outtype(gguf_type: str, checkpoint: Optional[Path] = None) -> str:
    """``handler.gguf_type`` as ``convert_hf_to_gguf.py --outtype``.

    ``auto``: a 16-bit type for a checkpoint stored in 16 bits (its ``config.json``'s ``torch_dtype``),
    as ``weight_dtype: auto`` keeps it for the torch backend: a decode step streams half of float32's
    bytes. On a Zen 3 EPYC (AVX2, where ``dtype: auto`` is float32) the llamacpp backend served the bf16
    bench checkpoint 1.36x faster at one stream and 1.12x at 8 from a bf16 GGUF than from an f32 one
    (4 alternated rounds each, prompts included). A bf16 checkpoint becomes f16 where llama.cpp decodes
    that faster (:func:`llama_engine.cpu.gguf_16_bit_type`: a CPU without native bf16) and its weights
    fit (:func:`fits_f16`), which loses none of them. A float32 checkpoint follows ``dtype: auto`` on
    this CPU: bf16 where it has native bf16, else f32.
    """
    if gguf_type != "auto":
        return gguf_type
    from llama_engine.backends.torch_backend import checkpoint_dtype
    from llama_engine.cpu import auto_dtype, gguf_16_bit_type

    stored = checkpoint_dtype(str(checkpoint)) if checkpoint is not None else None
    if stored == "bfloat16" and gguf_16_bit_type() == "f16":
        fits, detail = fits_f16(checkpoint)
        outtype = "f16" if fits else "bf16"
        print(f"    gguf_type auto: {outtype} ({detail})", flush=True)
        return outtype
    return GGUF_OF_16_BIT.get(stored) or GGUF_OF_16_BIT.get(auto_dtype("cpu"), "f32")


def fits_f16(checkpoint: Path) -> Tuple[bool, str]:
    """Whether every weight of the bf16 ``checkpoint`` converts to float16 without loss, and why.

    float16 holds every bf16 value from 2^-17 to 65504 in magnitude exactly (its 11 significant bits
    cover bf16's 8, its subnormals down to 2^-24), and smaller ones to within 2^-25. So the one loss to
    rule out is a weight beyond 65504, which would become infinite. This reads every weight once more
    than the conversion does, which is the price of not patching llama.cpp's converter.
    """
    from safetensors import safe_open
    from tqdm import tqdm

    files = sorted(checkpoint.glob("*.safetensors"))
    if not files:
        return False, f"no safetensors weights in {checkpoint} to check float16's range against"
    largest, where = 0.0, ""
    for path in tqdm(files, desc="checking weights against float16's range", unit="file", disable=len(files) < 2):
        with safe_open(str(path), "pt") as weights:
            for name in weights.keys():
                tensor = weights.get_tensor(name)
                if tensor.is_floating_point() and tensor.numel():
                    peak = float(tensor.abs().max())
                    if peak != peak:
                        return False, f"{name} holds NaN: kept in bf16"
                    if peak > largest:
                        largest, where = peak, name
    if largest > F16_MAX:
        return False, f"{where} holds {largest:g}, beyond float16's {F16_MAX:g}: kept in bf16"
    return True, f"the largest weight, {largest:g} in {where}, fits float16: llama.cpp decodes f16 faster on this CPU"


def convert_to_gguf(cfg, model_root: Path) -> Path:
    """The prepared checkpoint as ``handler.gguf`` inside it, then its safetensors weights removed."""
    checkpoint = model_root / cfg.handler.model_path
    target = checkpoint / cfg.handler.gguf
    outtype = gguf_outtype(cfg.handler.gguf_type, checkpoint)
    print(f"    {checkpoint} -> {target} (--outtype {outtype})", flush=True)
    run_converter(checkpoint, target, outtype)
    for weights in [*checkpoint.glob("*.safetensors"), *checkpoint.glob("*.safetensors.index.json")]:
        weights.unlink()
    print(f"    wrote {target.name} ({target.stat().st_size / 2**20:.1f} MiB); safetensors weights dropped", flush=True)
    return target


def run_converter(checkpoint: Path, target: Path, outtype: str) -> None:
    """llama.cpp's ``convert_hf_to_gguf.py`` (its tree: ``LLAMA_CPP_TREE``) on ``checkpoint`` into
    ``target``, which appears only once whole."""
    tree = Path(os.environ.get("LLAMA_CPP_TREE", ROOT / "build" / "peers" / "llama.cpp"))
    if not (tree / "convert_hf_to_gguf.py").is_file():
        raise SystemExit(f"backend llamacpp: no llama.cpp converter at {tree / 'convert_hf_to_gguf.py'}; run `make llamacpp` "
                         "(or set LLAMA_CPP_TREE to a llama.cpp source tree)")
    partial = target.with_name(target.name + ".partial")
    result = subprocess.run([sys.executable, str(ROOT / "scripts" / "convert_gguf.py"), "--tree", str(tree),
                             str(checkpoint), "--outfile", str(partial), "--outtype", outtype],
                            capture_output=True, text=True)
    if result.returncode != 0:
        raise SystemExit(f"convert_hf_to_gguf.py failed ({result.returncode}):\n{result.stderr[-3000:]}")
    partial.rename(target)


def warm_up(cfg, model_root: Path, build_cache_dir: Path):
    """Load the model compiling into ``build_cache_dir``, run one generation per graph; the backend."""
    from tqdm import tqdm

    from llama_engine import Engine
    from llama_engine.continuous import ContinuousScheduler

    buckets = list(cfg.handler.context_length_estimate or []) if cfg.handler.backend == "neuron" else []
    if cfg.continuous:
        runner = ContinuousScheduler.from_config(
            cfg.handler, str(model_root), cfg.slots, cfg.continuous_batching.max_prefill_tokens_per_step,
            build_cache_dir=str(build_cache_dir))
        warm = runner.warmup
    else:
        runner = Engine.from_config(cfg.handler, str(model_root), batch_size=cfg.slots,
                                    build_cache_dir=str(build_cache_dir))
        warm = functools.partial(runner.warmup, batch_size=cfg.slots)
    for length in tqdm([None] + buckets, desc="warm-up graphs", unit="graph"):
        warm(prompt_lengths=() if length is None else (length,))
    return runner.backend


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--config", required=True, type=Path, help="model-config YAML")
    parser.add_argument("--checkpoint", required=True, type=Path, help="HF checkpoint directory (safetensors)")
    parser.add_argument("--name", help="model name (default: the config's file name)")
    parser.add_argument("--build-dir", type=Path, help="default build/models/<name>")
    parser.add_argument("--export-path", type=Path, default=ROOT / "model_store",
                        help="where the archive goes (default model_store/)")
    parser.add_argument("--archive-format", default="no-archive", choices=sorted(build_archive.FORMATS),
                        help="torch-model-archiver's format: a directory (no-archive, the default), .tar.gz or .mar")
    parser.add_argument("--legacy-split", action="store_true", help="Neuron SDK < 2.18 checkpoint layout")
    args = parser.parse_args(argv)

    from llama_engine import load_model_config_file
    from llama_engine.backends import cache_kind_and_settings

    cfg = load_model_config_file(str(args.config))
    name = args.name or args.config.stem
    model_root = args.build_dir or ROOT / "build" / "models" / name
    compiles = cache_kind_and_settings(cfg.handler, cfg.slots, cfg.continuous) is not None
    gguf = cfg.handler.backend == "llamacpp"
    total = 4 if compiles else 3 if gguf else 2

    started = step(1, total, f"prepare checkpoint {args.checkpoint} -> {model_root / cfg.handler.model_path}")
    model_root.mkdir(parents=True, exist_ok=True)
    prepare = prepare_checkpoint.legacy_split if args.legacy_split else prepare_checkpoint.prepare
    prepare(args.checkpoint.resolve(), model_root / cfg.handler.model_path)
    cache = None
    if compiles:
        step(2, total, "compile into the build's compile cache (Neuron: minutes to an hour)")
        step(3, total, "warm up every context bucket and the token graph")
        cache = compile_and_manifest(cfg, model_root)
    if gguf:
        step(2, total, "convert the checkpoint to GGUF for llama.cpp, check it with one generation")
        convert_to_gguf(cfg, model_root)
        warm_up(cfg, model_root, model_root / "unused-compile-cache")
    step(total, total, f"package with torch-model-archiver ({args.archive_format})")
    stage_dir = build_archive.stage(model_root / cfg.handler.model_path, model_root.with_name(name + ".stage"),
                                    compile_cache=cache, native_kernels=cfg.handler.backend == "torch")
    target = build_archive.archive(name, args.config, stage_dir, args.export_path, args.archive_format,
                                   build_archive.ARCHIVE_VERSION)
    print(f"wrote {target} in {time.perf_counter() - started:.0f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
