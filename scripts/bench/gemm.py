"""The prefill bound: how fast this CPU can run a prompt through the model's linear layers.

Prefill is compute-bound: each prompt token goes through every linear layer once, as rows of a
matrix product. :func:`prefill_bound` times the model's own products (fused q/k/v, o, fused
gate/up, down: the shapes the torch backend runs) on ``tokens`` rows of random activations, in
the bench's dtype and threads, and returns the prompt tokens per second they allow, attention,
norms and the LM head left out. A served prefill cannot beat it; how close it gets says whether
a longer prompt's time could shrink at all. Best of ``repeats`` after a warm-up, like
:mod:`scripts.bench.membw`.
"""
from __future__ import annotations

import json
import time
from pathlib import Path


def layer_shapes(config: dict) -> list:
    """(in, out) features of one decoder layer's linear products, fused as the torch backend runs them."""
    hidden, inter = config["hidden_size"], config["intermediate_size"]
    heads = config["num_attention_heads"]
    head_dim = config.get("head_dim") or hidden // heads
    kv_heads = config.get("num_key_value_heads") or heads
    return [(hidden, (heads + 2 * kv_heads) * head_dim), (heads * head_dim, hidden), (hidden, 2 * inter),
            (inter, hidden)]


def prefill_bound(model: Path, dtype: str = "float32", threads: int = 2, tokens: int = 256, repeats: int = 5) -> dict:
    """Prompt tokens/s of the model's linear layers alone, on ``tokens`` rows (best of ``repeats``)."""
    import torch

    config = json.loads((Path(model) / "config.json").read_text())
    torch_dtype = getattr(torch, dtype)
    shapes = layer_shapes(config)
    gen = torch.Generator().manual_seed(0)
    weights = [torch.randn(out, inp, generator=gen).to(torch_dtype) for inp, out in shapes]
    inputs = {inp: torch.randn(tokens, inp, generator=gen).to(torch_dtype) for inp, _ in shapes}
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        def one_layer() -> float:
            started = time.perf_counter()
            for (inp, _), w in zip(shapes, weights):
                torch.nn.functional.linear(inputs[inp], w)
            return time.perf_counter() - started

        one_layer()
        best = min(one_layer() for _ in range(repeats))
    finally:
        torch.set_num_threads(before)
    layers = config["num_hidden_layers"]
    flops_per_token = 2 * layers * sum(inp * out for inp, out in shapes)
    seconds = best * layers
    return {"tokens_per_s": round(tokens / seconds, 1), "gflops": round(flops_per_token * tokens / seconds / 1e9, 1),
            "flops_per_token": flops_per_token, "rows": tokens, "dtype": dtype, "threads": threads,
            "repeats": repeats}
