"""The bench's prefill bound and decode products (scripts/bench/gemm.py), the ratios made of them, and its
TTFT probes taken in turn (scenarios.ttft_probes). Speeds are never asserted: only the shapes, the FLOP
and byte counts, the arithmetic of the ratios and the order of the probes."""
import json

import pytest

from scripts.bench.gemm import decode_products, layer_shapes, prefill_bound
from scripts.bench.report import decode_floor_ratios
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


def test_decode_products_stream_every_layers_weights_and_the_lm_head_once(tmp_path):
    import torch

    (tmp_path / "config.json").write_text(json.dumps(dict(LLAMA_GQA, vocab_size=100)))
    before = torch.get_num_threads()
    got = decode_products(tmp_path, "bfloat16", threads=1, repeats=2)
    assert torch.get_num_threads() == before
    assert got["bytes"] == 2 * (3 * (64 * 96 + 64 * 64 + 64 * 320 + 160 * 64) + 64 * 100)
    assert got["kernel"] in got["by_kernel_tokens_per_s"] and "nn.Linear" in got["by_kernel_tokens_per_s"]
    assert got["tokens_per_s"] == max(got["by_kernel_tokens_per_s"].values())  # the faster kernel counts
    assert got["gb_per_s"] == pytest.approx(got["bytes"] * got["tokens_per_s"] / 1e9, rel=0.01)


def test_decode_floor_ratios_hold_the_products_to_the_bandwidth_and_the_decode_to_the_products():
    results = {"decode_products": {"tokens_per_s": 80.0, "gb_per_s": 20.0, "kernel": "oneDNN packed"},
               "decode_bound": {"bandwidth_gb_per_s": 25.0, "weight_bytes_per_token": 250e6}}
    runs = [{"system": "inprocess", "scenario": "concurrency", "concurrency": 1, "ok": True,
             "decode_tokens_per_s_per_stream": 60.0}]
    got = decode_floor_ratios(runs, results)
    assert got["batch1_decode_efficiency_at_products_bound"]["value"] == pytest.approx(80 * 250e6 / 25e9)
    assert got["batch1_decode_vs_products"]["value"] == pytest.approx(0.75)
    assert all(r["goal"] == "report" and r["met"] is None for r in got.values())
    assert decode_floor_ratios(runs, {}) == {}  # a run without the sample (an older results file) has neither
    assert list(decode_floor_ratios([], results)) == ["batch1_decode_efficiency_at_products_bound"]


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
