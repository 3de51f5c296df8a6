#!/usr/bin/env python3
"""Memory a torch-backend load takes: at its peak and once loaded, against the weights and KV cache.

    python -m scripts.bench.load_memory --model build/beyond-cache/bench-model-bf16 --slots 8 --max-length 1024

Loads the model as a TorchServe worker does (``TorchSlotBackend.from_pretrained``), sampling this
process's resident memory every 10 ms, and prints one JSON line: the process's own memory
(``anon``) and mapped files' pages (``file``, which the kernel can drop and read again) at their
peaks and once loaded, the checkpoint's bytes and the KV cache's. Run it once per setting (the
peak is the process's): ``LLAMA_CPU_CLASS=avx2`` loads as an AVX2-only CPU would.

    python -m scripts.bench.load_memory --model build/llama-7b-shape --random-checkpoint

first writes a random-weight bf16 checkpoint of Llama-2-7B's shape there (32 layers of hidden 4096,
MLP 11008, 32 heads; 13.0 GB in 4 shards, as real checkpoints come; the bench model's tokenizer), one
tensor at a time, so that it builds in less memory than it holds.
"""
from __future__ import annotations

import argparse
import json
import sys
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "handlers"))

from llama_engine.cpu import cpu_class, cpu_flags, process_memory  # noqa: E402
from scripts.bench.model import ModelSpec, llama_config  # noqa: E402

MIB = 2**20
#: ``--random-checkpoint``'s shape: Llama-2-7B's but for the vocabulary (the bench model's tokenizer).
SHAPE = ModelSpec(hidden_size=4096, intermediate_size=11008, num_hidden_layers=32, num_attention_heads=32,
                  num_key_value_heads=32, max_position_embeddings=4096)
SHARDS = 4


def write_random_checkpoint(out: Path, tokenizer: Path, shape: ModelSpec = SHAPE, shards: int = SHARDS) -> None:
    """A bf16 Llama checkpoint of ``shape`` with random weights (seeded), in ``shards`` safetensors files and
    their index, written one shard at a time; nothing if ``out`` has its index already."""
    import torch
    from safetensors.torch import save_file
    from transformers import AutoTokenizer

    index_file = out / "model.safetensors.index.json"
    if index_file.exists():
        return
    out.mkdir(parents=True, exist_ok=True)
    tokenizer_files = AutoTokenizer.from_pretrained(tokenizer)
    config = llama_config(shape, len(tokenizer_files), "bfloat16")
    hidden, inter, layers = shape.hidden_size, shape.intermediate_size, shape.num_hidden_layers
    per_layer = {"self_attn.q_proj.weight": (hidden, hidden), "self_attn.k_proj.weight": (hidden, hidden),
                 "self_attn.v_proj.weight": (hidden, hidden), "self_attn.o_proj.weight": (hidden, hidden),
                 "mlp.gate_proj.weight": (inter, hidden), "mlp.up_proj.weight": (inter, hidden),
                 "mlp.down_proj.weight": (hidden, inter), "input_layernorm.weight": (hidden,),
                 "post_attention_layernorm.weight": (hidden,)}
    groups = [[f"model.layers.{i}.{name}" for i in range(layers)[k::shards] for name in per_layer]
              for k in range(shards)]
    groups[0] = ["model.embed_tokens.weight", *groups[0]]
    groups[-1] += ["model.norm.weight", "lm_head.weight"]
    shapes = {"model.embed_tokens.weight": (config.vocab_size, hidden), "model.norm.weight": (hidden,),
              "lm_head.weight": (config.vocab_size, hidden)}
    generator, weight_map = torch.Generator().manual_seed(shape.seed), {}
    for k, names in enumerate(groups):
        shard = f"model-{k + 1:05d}-of-{shards:05d}.safetensors"
        tensors = {}
        for name in names:
            size = shapes.get(name) or per_layer[name.split(".", 3)[3]]
            tensors[name] = (torch.ones(size) if len(size) == 1 else
                             torch.randn(size, generator=generator) * 0.02).to(torch.bfloat16)
            weight_map[name] = shard
        save_file(tensors, str(out / shard), metadata={"format": "pt"})
        (out / shard).chmod(0o644)  # as a downloaded checkpoint's (safetensors writes through a private file)
        del tensors
    config.save_pretrained(out)
    tokenizer_files.save_pretrained(out)
    total = sum((out / f).stat().st_size for f in set(weight_map.values()))
    index_file.write_text(json.dumps({"metadata": {"total_size": total}, "weight_map": weight_map}, indent=1))


class PeakSampler(threading.Thread):
    """The most ``anon`` and ``file`` memory seen at once, sampled every ``interval`` s until :meth:`stop`."""

    def __init__(self, interval: float = 0.01):
        super().__init__(daemon=True)
        self.interval, self.peak, self._done = interval, {"anon": 0, "file": 0}, threading.Event()

    def run(self) -> None:
        while not self._done.is_set():
            self._sample()
            self._done.wait(self.interval)

    def stop(self) -> dict:
        self._done.set()
        self.join()
        self._sample()
        return self.peak

    def _sample(self) -> None:
        now = process_memory()
        for key in self.peak:
            self.peak[key] = max(self.peak[key], now.get(key, 0))


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", required=True, help="an HF checkpoint directory with model.safetensors")
    p.add_argument("--slots", type=int, default=8, help="KV cache slots, as a config's batchSize (default 8)")
    p.add_argument("--max-length", type=int, default=1024, help="positions a slot holds (default 1024)")
    p.add_argument("--dtype", default="auto", help="handler.dtype: auto (default), float32, bfloat16 or float16")
    p.add_argument("--weight-dtype", default="auto",
                   help="handler.weight_dtype: auto (default), float32, bfloat16 or int8")
    p.add_argument("--random-checkpoint", action="store_true",
                   help="first write a random bf16 checkpoint of Llama-2-7B's shape at --model (unless there)")
    p.add_argument("--tokenizer", type=Path, default=ROOT / "build" / "tiny-llama",
                   help="the tokenizer --random-checkpoint copies (default build/tiny-llama)")
    args = p.parse_args(argv)
    if args.random_checkpoint:
        write_random_checkpoint(Path(args.model), args.tokenizer)
    if not process_memory():
        print("no /proc/self/status here: nothing to measure", file=sys.stderr)
        return 2
    from llama_engine.backends.torch_backend import TorchSlotBackend

    sampler = PeakSampler()
    sampler.start()
    start = time.perf_counter()
    backend = TorchSlotBackend.from_pretrained(args.model, args.slots, args.max_length, args.dtype, "cpu",
                                               weight_dtype=args.weight_dtype)
    seconds = time.perf_counter() - start
    peak, loaded = sampler.stop(), process_memory()
    kv = 2 * backend.k_cache.numel() * backend.k_cache.element_size()
    checkpoint = sum(f.stat().st_size for f in Path(args.model).glob("*.safetensors"))
    print(json.dumps({
        "model": args.model, "cpu_class": cpu_class(cpu_flags()), "dtype": str(backend.dtype),
        "weights_dtype": str(backend.weight_dtype or backend.dtype), "load_s": round(seconds, 1),
        "checkpoint_mib": round(checkpoint / MIB), "kv_cache_mib": round(kv / MIB),
        "peak_anon_mib": round(peak["anon"] / MIB), "peak_file_mib": round(peak["file"] / MIB),
        "loaded_anon_mib": round(loaded["anon"] / MIB), "loaded_file_mib": round(loaded["file"] / MIB),
    }))
    return 0


if __name__ == "__main__":
    sys.exit(main())
