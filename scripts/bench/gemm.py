"""The prefill and decode bounds: how fast this CPU can run the model's linear layers alone.

Prefill is compute-bound: each prompt token goes through every linear layer once, as rows of a
matrix product. :func:`prefill_bound` times the model's own products (fused q/k/v, o, fused
gate/up, down: the shapes the torch backend runs) on ``tokens`` rows of random activations, in
the bench's dtype and threads, and returns the prompt tokens per second they allow, attention,
norms and the LM head left out. A served prefill cannot beat it; how close it gets says whether
a longer prompt's time could shrink at all. Best of ``repeats`` after a warm-up, like
:mod:`scripts.bench.membw`.

Each product is timed with both kernels the torch backend can run, ``nn.Linear`` and the
oneDNN-packed weight of :mod:`llama_engine.backends.fast_linear`, and the faster counts: on an
AMD EPYC (Zen 5) in float32, ``nn.Linear`` alone made a bound the served prefill beat 1.6-1.9x,
because the backend packs float32 there.
"""
from __future__ import annotations

import contextlib
import json
import time
from pathlib import Path
from typing import Optional


def layer_shapes(config: dict) -> list:
    """(in, out) features of one decoder layer's linear products, fused as the torch backend runs them."""
    hidden, inter = config["hidden_size"], config["intermediate_size"]
    heads = config["num_attention_heads"]
    head_dim = config.get("head_dim") or hidden // heads
    kv_heads = config.get("num_key_value_heads") or heads
    return [(hidden, (heads + 2 * kv_heads) * head_dim), (heads * head_dim, hidden), (hidden, 2 * inter),
            (inter, hidden)]


def _random_products(shapes: list, rows: int, torch_dtype):
    """Seeded random weights ``[out, in]`` and inputs ``[rows, in]`` for (in, out) ``shapes``."""
    import torch

    gen = torch.Generator().manual_seed(0)
    weights = [torch.randn(out, inp, generator=gen).to(torch_dtype) for inp, out in shapes]
    inputs = [torch.randn(rows, inp, generator=gen).to(torch_dtype) for inp, _ in shapes]
    return weights, inputs


@contextlib.contextmanager
def torch_threads(threads: int):
    """Run the block on ``threads`` torch threads, then restore the caller's count."""
    import torch

    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        yield
    finally:
        torch.set_num_threads(before)


def _on_native(library, weights: list) -> list:
    """One product per weight on the native kernel library."""
    return [lambda x, w=w: library.linear(x, w) for w in weights]


def _paired(library, weights: list) -> Optional[list]:
    """One product per weight in the native kernels' pair panels (``CpuKernels.pack_pairs``), which the backend
    lays bf16 weights out in where they time faster at load (``fast_linear.weight_pairs``); None where the
    library does not take every weight so."""
    if not all(library.takes_pairs(w) for w in weights):
        return None
    packed = [library.pack_pairs(w) for w in weights]
    return [lambda x, p=p: library.linear(x, p, pairs=True) for p in packed]


def _gathered(weights: list) -> list:
    """Copies of ``weights`` one after another in one block on huge pages, as the backend gathers a decode
    step's weights (``fast_linear.gather_weights``; the last, the LM head, stays apart there too)."""
    from llama_engine.backends.fast_linear import gathered_block

    *layers, head = weights
    _, places, _ = gathered_block(layers)
    for place, weight in zip(places, layers):
        place.copy_(weight)
    return places + [head]


def _linear_over(weight):
    """An ``nn.Linear`` without bias over ``weight`` itself (made on the meta device: nothing initialised)."""
    import torch

    linear = torch.nn.Linear(weight.shape[1], weight.shape[0], bias=False, device="meta")
    linear.weight = torch.nn.Parameter(weight, requires_grad=False)
    return linear


def _over_float32_copies(weights: list) -> list:
    """One product per bf16 weight in float32 over a copy of the weight made for the call, the rows
    rounded back to their own dtype: what :class:`NativeLinear` runs for a prompt's rows of bf16 weights
    under float32 arithmetic, and of a bf16 model where that times faster at load
    (``fast_linear.bf16_prompt_products``)."""
    from llama_engine.backends.fast_linear import NativeLinear

    return [NativeLinear(_linear_over(w), None, 0, wide_in_float32=True) for w in weights]


def _kernels(weights: list, torch_dtype, native: bool = False, prompt: bool = False) -> dict:
    """The products each kernel the torch backend may run computes, by kernel name (``native``: with the
    native kernel that :class:`NativeLinear` runs for a decode step's rows, where it serves this dtype or
    the backend times it at load; ``prompt``: also float32 over per-call copies of bf16 weights, which it
    may run for a prompt's rows).
    Weights of another dtype than ``torch_dtype`` (bf16 under float32) run on the native kernel alone,
    as :class:`NativeLinear` runs them for a decode step's rows (a prompt's: over float32 copies)."""
    import torch

    from llama_engine.backends.cpu_kernels import tune_one_row_prefetch
    from llama_engine.backends.fast_linear import (
        PackedLinear,
        kept_weight_kernels,
        native_kernels_considered,
        packing_supported,
    )

    copies = prompt and torch.backends.mkldnn.is_available() and bool(weights) and weights[0].dtype == torch.bfloat16
    if weights and weights[0].dtype != torch_dtype:
        library = kept_weight_kernels(torch_dtype, weights[0].dtype, torch.device("cpu"))
        if library is None:
            raise ValueError(f"no native kernels run {torch_dtype} over {weights[0].dtype} weights on this CPU")
        tune_one_row_prefetch(library, weights, torch_dtype)
        kernels = {"native, bf16 weights": _on_native(library, weights),
                   "native, bf16 weights, gathered": _on_native(library, _gathered(weights))}
        paired = _paired(library, weights)
        if paired is not None:
            kernels["native, bf16 weights, pair panels"] = paired
        if copies:
            kernels["float32 over per-call copies"] = _over_float32_copies(weights)
        return kernels
    kernels = {"nn.Linear": [lambda x, w=w: torch.nn.functional.linear(x, w) for w in weights]}
    if copies:
        kernels["float32 over per-call copies"] = _over_float32_copies(weights)
    library = native_kernels_considered(torch_dtype, torch.device("cpu")) if native else None
    if library is not None:
        tune_one_row_prefetch(library, weights, torch_dtype)
        kernels["native"] = _on_native(library, weights)
        kernels["native, gathered"] = _on_native(library, _gathered(weights))
        paired = _paired(library, weights)
        if paired is not None:
            kernels["native, pair panels"] = paired
    if packing_supported(torch_dtype, torch.device("cpu")):
        kernels["oneDNN packed"] = [PackedLinear(_linear_over(w)) for w in weights]
    return kernels


def prefill_bound(model: Path, dtype: str = "float32", threads: int = 2, tokens: int = 256, repeats: int = 5) -> dict:
    """Prompt tokens/s of the model's linear layers alone, on ``tokens`` rows (best of ``repeats``, each
    product on the fastest kernel the backend may run it on: ``nn.Linear``, oneDNN packed, the
    native kernels where they serve the dtype, which have a GEMM for a prompt's rows (every build since aa8326c), and
    for bf16 float32 over per-call copies of the weights, which a bf16 model's prompts run on where that
    times faster at load: without them, a bench on an Emerald Rapids Xeon read a bound of 845 tok/s at 256
    rows that its in-process prompts, on them, beat at 988).

    A prompt needs only the keys and values of the last layer (:func:`products_per_prompt_token`)."""
    import torch

    config = json.loads((Path(model) / "config.json").read_text())
    torch_dtype = getattr(torch, dtype)
    shapes = layer_shapes(config)
    weights, inputs = _random_products(shapes, tokens, torch_dtype)
    with torch_threads(threads):
        kernels = _kernels(weights, torch_dtype, native=True, prompt=True)
        best = {name: [float("inf")] * len(shapes) for name in kernels}
        with torch.inference_mode():
            for _ in range(repeats + 1):
                for name, products in kernels.items():
                    for k, (product, x) in enumerate(zip(products, inputs)):
                        started = time.perf_counter()
                        product(x)
                        best[name][k] = min(best[name][k], time.perf_counter() - started)
    fastest = [min(best, key=lambda name: best[name][k]) for k in range(len(shapes))]
    counts = products_per_prompt_token(config)
    flops_per_token = round(2 * sum(c * inp * out for c, (inp, out) in zip(counts, shapes)))
    seconds = sum(c * best[name][k] for k, (c, name) in enumerate(zip(counts, fastest)))
    by_kernel = {name: round(tokens / sum(c * t for c, t in zip(counts, times)), 1) for name, times in best.items()}
    return {"tokens_per_s": round(tokens / seconds, 1), "gflops": round(flops_per_token * tokens / seconds / 1e9, 1),
            "flops_per_token": flops_per_token, "rows": tokens, "dtype": dtype, "threads": threads,
            "repeats": repeats, "kernels": fastest, "by_kernel_tokens_per_s": by_kernel}


def products_per_prompt_token(config: dict) -> list:
    """How many of each :func:`layer_shapes` product a prompt token needs: every layer's, but of the
    last layer only the keys and values, which later tokens read (the torch backend runs the rest of
    that layer for the rows with logits alone; the prompt's last token, one of hundreds, counts as the
    others). The K/V share of the fused q/k/v product counts as that share of its time."""
    heads = config["num_attention_heads"]
    kv_heads = config.get("num_key_value_heads") or heads
    full = config["num_hidden_layers"] - 1
    return [full + 2 * kv_heads / (heads + 2 * kv_heads), full, full, full]


def decode_products(model: Path, dtype: str = "float32", threads: int = 2, repeats: int = 5,
                    weight_dtype: Optional[str] = None) -> dict:
    """Batch-1 decode tokens/s of the model's linear products alone, and the GB/s they stream at.

    One row through every layer's products (the backend's fused shapes) and the LM head, each
    with its own random weights, so that a pass reads them all from memory as a decode step
    does; a whole pass per kernel (``nn.Linear``, oneDNN packed, the native kernel where the backend
    runs it), best of ``repeats`` after a
    warm-up, the faster kernel counts; the native kernel one row ahead as far as the backend has it read
    (:func:`cpu_kernels.tune_one_row_prefetch`). Against the memory bandwidth this is the batch-1 decode
    efficiency of an implementation that spent nothing besides its products on this CPU;
    against the decode, the share of a step that norms, attention and sampling take. ``weight_dtype``:
    the weights' dtype as served, where it differs from ``dtype`` (bf16 weights under float32).
    """
    import torch

    config = json.loads((Path(model) / "config.json").read_text())
    torch_dtype = getattr(torch, dtype)
    shapes = layer_shapes(config) * config["num_hidden_layers"] + [(config["hidden_size"], config["vocab_size"])]
    weights, inputs = _random_products(shapes, 1, torch_dtype)
    if weight_dtype and weight_dtype != dtype:
        weights = [w.to(getattr(torch, weight_dtype)) for w in weights]
    with torch_threads(threads):
        kernels = _kernels(weights, torch_dtype, native=True)
        best = dict.fromkeys(kernels, float("inf"))
        with torch.inference_mode():
            for _ in range(repeats + 1):
                for name, products in kernels.items():
                    started = time.perf_counter()
                    for product, x in zip(products, inputs):
                        product(x)
                    best[name] = min(best[name], time.perf_counter() - started)
    fastest = min(best, key=best.get)
    nbytes = sum(w.numel() * w.element_size() for w in weights)
    return {"tokens_per_s": round(1 / best[fastest], 2), "gb_per_s": round(nbytes / best[fastest] / 1e9, 2),
            "bytes": nbytes, "dtype": dtype, "weight_dtype": weight_dtype or dtype, "threads": threads, "repeats": repeats,
            "kernel": fastest,
            "by_kernel_tokens_per_s": {name: round(1 / t, 2) for name, t in best.items()}}
