"""The bench's prefill bound (scripts/bench/gemm.py) and its TTFT probes taken in turn (scenarios.ttft_probes).
Speeds are never asserted: only the shapes, the FLOP count and the order of the probes."""
import json

import pytest

from scripts.bench.gemm import layer_shapes, prefill_bound
from scripts.bench.scenarios import ttft_probes
from scripts.streaming_client import RequestRecord

LLAMA_GQA = {"hidden_size": 64, "intermediate_size": 160, "num_attention_heads": 8, "num_key_value_heads": 2,
             "num_hidden_layers": 3}


def test_layer_shapes_are_the_fused_products_the_torch_backend_runs():
    # q/k/v fused (8 query heads and 2 + 2 key/value heads of 8), o, gate/up fused, down
    assert layer_shapes(LLAMA_GQA) == [(64, 96), (64, 64), (64, 320), (160, 64)]
    assert layer_shapes(dict(LLAMA_GQA, head_dim=16))[0] == (64, (8 + 4) * 16)


def test_prefill_bound_counts_every_layers_flops_and_restores_the_threads(tmp_path):
    import torch

    (tmp_path / "config.json").write_text(json.dumps(LLAMA_GQA))
    before = torch.get_num_threads()
    bound = prefill_bound(tmp_path, "float32", threads=1, tokens=32, repeats=2)
    assert torch.get_num_threads() == before
    assert bound["flops_per_token"] == 2 * 3 * (64 * 96 + 64 * 64 + 64 * 320 + 160 * 64)
    assert bound["tokens_per_s"] > 0 and bound["rows"] == 32
    assert bound["gflops"] == pytest.approx(bound["tokens_per_s"] * bound["flops_per_token"] / 1e9, rel=0.01)


def test_prefill_bound_takes_each_products_faster_kernel(tmp_path):
    """The backend packs float32 weights with oneDNN where that is faster, so the bound times both kernels
    and may not be slower than either one alone."""
    (tmp_path / "config.json").write_text(json.dumps(LLAMA_GQA))
    bound = prefill_bound(tmp_path, "float32", threads=1, tokens=32, repeats=2)
    by_kernel = bound["by_kernel_tokens_per_s"]
    assert "nn.Linear" in by_kernel and len(bound["kernels"]) == 4
    assert set(bound["kernels"]) <= set(by_kernel)
    assert bound["tokens_per_s"] >= max(by_kernel.values()) * 0.999


def test_ttft_probes_take_the_lengths_in_turn_and_make_a_row_per_length():
    calls, runs, clock = [], [], iter(range(1000))

    def runner(prompts, max_new_tokens):
        (prompt,) = prompts
        calls.append(prompt)
        record = RequestRecord("s", prompt, max_new_tokens)
        record.start = next(clock)
        record.token_times = [record.start + prompt / 1000 + k for k in range(max_new_tokens)]
        record.end = record.token_times[-1]
        return [record]

    def measure(what, fn, **labels):
        records = fn()
        run = dict(labels, system="s", records=len(records), foreign_cpu_share=0.03, quiet_wait=1.5)
        runs.append(run)
        return run, records

    ttft_probes("s", runner, {256: [256, 256], 768: [768, 768]}, {"probe_tokens": 2}, runs, measure)
    assert calls == [256, 768, 256, 768]
    assert [(r["scenario"], r["input_tokens"], r["requests"]) for r in runs] == [("ttft", 256, 2), ("ttft", 768, 2)]
    assert all(r["foreign_cpu_share"] == 0.03 and r["quiet_wait"] == 1.5 for r in runs)  # the machine's figures
    assert runs[1]["ttft_ms"]["p50"] == pytest.approx(768, abs=1)  # ms from the start to the first token
