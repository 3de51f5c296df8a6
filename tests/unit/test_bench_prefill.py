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


def test_prefill_bound_counts_the_flops_a_prompt_needs_and_restores_the_threads(tmp_path):
    import torch

    (tmp_path / "config.json").write_text(json.dumps(LLAMA_GQA))
    before = torch.get_num_threads()
    bound = prefill_bound(tmp_path, "float32", threads=1, tokens=32, repeats=2)
    assert torch.get_num_threads() == before
    # two whole layers, and the last one's keys and values (2 x 2 heads of 8 of the q/k/v product's 96)
    assert bound["flops_per_token"] == 2 * (2 * (64 * 96 + 64 * 64 + 64 * 320 + 160 * 64) + 64 * 32)
    assert bound["tokens_per_s"] > 0 and bound["rows"] == 32
    assert bound["gflops"] == pytest.approx(bound["tokens_per_s"] * bound["flops_per_token"] / 1e9, rel=0.01)


def test_prefill_bound_takes_each_products_faster_kernel(tmp_path):
    """The backend packs float32 weights with oneDNN where that is faster, and runs them on the native
    kernels where those serve float32 (the avx2 build, its GEMM for a prompt's rows) or time faster at load
    (other x86 classes), so the bound times every such kernel and may not be slower than any one alone."""
    import torch

    from llama_engine.backends.fast_linear import native_kernels_considered

    (tmp_path / "config.json").write_text(json.dumps(LLAMA_GQA))
    bound = prefill_bound(tmp_path, "float32", threads=1, tokens=32, repeats=2)
    by_kernel = bound["by_kernel_tokens_per_s"]
    assert "nn.Linear" in by_kernel and len(bound["kernels"]) == 4
    assert ("native" in by_kernel) == (native_kernels_considered(torch.float32, torch.device("cpu")) is not None)
    assert set(bound["kernels"]) <= set(by_kernel)
    assert bound["tokens_per_s"] >= max(by_kernel.values()) * 0.999


def test_a_bf16_prefill_bound_also_times_float32_over_per_call_copies(tmp_path):
    """A bf16 model's prompt products run in float32 over per-call copies of the weights where that times
    faster at load (fast_linear.bf16_prompt_products), so the bound times that way too."""
    import torch

    (tmp_path / "config.json").write_text(json.dumps(LLAMA_GQA))
    bound = prefill_bound(tmp_path, "bfloat16", threads=1, tokens=32, repeats=2)
    by_kernel = bound["by_kernel_tokens_per_s"]
    assert ("float32 over per-call copies" in by_kernel) == torch.backends.mkldnn.is_available()
    assert bound["tokens_per_s"] >= max(by_kernel.values()) * 0.999
    assert "float32 over per-call copies" not in prefill_bound(tmp_path, "float32", threads=1, tokens=32,
                                                               repeats=1)["by_kernel_tokens_per_s"]


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


def test_decode_products_of_bf16_weights_under_float32_stream_two_bytes_a_weight_on_the_native_kernel(tmp_path):
    """A bf16 checkpoint computed in float32 keeps bf16 weights (handler.weight_dtype auto): the bound
    times what NativeLinear runs for a decode step's row, the native kernel widening each weight as it reads it."""
    from llama_engine.backends.cpu_kernels import PREFETCH_CANDIDATES, for_device

    if for_device("cpu") is None:
        pytest.skip("the native kernels do not load on this CPU (no AVX2/FMA)")
    (tmp_path / "config.json").write_text(json.dumps(dict(LLAMA_GQA, vocab_size=100)))
    got = decode_products(tmp_path, "float32", threads=1, repeats=2, weight_dtype="bfloat16")
    assert got["bytes"] == 2 * (3 * (64 * 96 + 64 * 64 + 64 * 320 + 160 * 64) + 64 * 100)
    assert list(got["by_kernel_tokens_per_s"]) == ["native, bf16 weights", "native, bf16 weights, gathered"]
    assert got["kernel"] in got["by_kernel_tokens_per_s"]
    assert (got["dtype"], got["weight_dtype"]) == ("float32", "bfloat16")
    # one row read as far ahead as the served backend reads it (measured once per process, as it is)
    import torch

    assert for_device("cpu").one_row_prefetch[(torch.float32, torch.bfloat16)] in PREFETCH_CANDIDATES


def test_the_products_bound_times_bf16_weights_in_pair_panels_where_the_kernels_take_them(tmp_path):
    """Where every weight fills whole pairs of panels (here the LM head's 128 outputs too) on an AVX-512 build,
    the bound times them laid out as the backend may lay them out at load (``fast_linear.weight_pairs``)."""
    from llama_engine.backends.cpu_kernels import PAIRS_ISAS, for_device

    library = for_device("cpu")
    (tmp_path / "config.json").write_text(json.dumps(dict(LLAMA_GQA, vocab_size=128)))
    got = decode_products(tmp_path, "float32", threads=1, repeats=1, weight_dtype="bfloat16") \
        if library is not None else {"by_kernel_tokens_per_s": {}}
    paired = library is not None and library.isa in PAIRS_ISAS
    assert ("native, bf16 weights, pair panels" in got["by_kernel_tokens_per_s"]) == paired
    import torch

    from llama_engine.backends.fast_linear import native_kernels_considered

    bf16_native = native_kernels_considered(torch.bfloat16, torch.device("cpu"))  # not on AMX: oneDNN's there
    if paired and bf16_native is not None and bf16_native.isa in PAIRS_ISAS:
        bound = prefill_bound(tmp_path, "bfloat16", threads=1, tokens=8, repeats=1)
        assert "native, pair panels" in bound["by_kernel_tokens_per_s"]


def test_the_products_bound_also_streams_the_layers_weights_gathered_as_the_backend_gathers_them():
    """The backend streams a decode step's weights from one block (``gather_weights``); the bound times
    copies laid out the same way beside the weights as loaded, with the LM head apart as served."""
    import torch

    from scripts.bench.gemm import _gathered

    weights = [torch.randn(n, k).to(torch.bfloat16) for n, k in ((96, 64), (64, 64), (320, 64), (64, 160), (100, 64))]
    gathered = _gathered(weights)
    assert all(torch.equal(a, b) for a, b in zip(gathered, weights))
    assert gathered[-1] is weights[-1]
    storage = {w.untyped_storage().data_ptr() for w in gathered[:-1]}
    assert len(storage) == 1 and [w.data_ptr() for w in gathered[:-1]] == sorted(w.data_ptr() for w in gathered[:-1])


def test_the_bench_describes_the_weights_as_served(tmp_path):
    """The decode bound's bytes per token are the linears' as served: a bf16 checkpoint under float32
    arithmetic streams two bytes a weight where the handler keeps them bf16, four where it widens them."""
    import dataclasses

    import torch
    from safetensors.torch import save_file

    from llama_engine.backends.cpu_kernels import for_device
    from llama_engine.config import HandlerConfig
    from scripts.bench.model import describe, served_weight_dtype
    from scripts.bench.report import dtype_label

    config = dict(LLAMA_GQA, vocab_size=100, torch_dtype="bfloat16")
    (tmp_path / "config.json").write_text(json.dumps(config))
    save_file({"model.embed_tokens.weight": torch.zeros(100, 64, dtype=torch.bfloat16),
               "model.layers.0.mlp.down_proj.weight": torch.zeros(64, 160, dtype=torch.bfloat16)},
              str(tmp_path / "model.safetensors"))
    handler = dataclasses.replace(HandlerConfig(), dtype="float32")
    widened = served_weight_dtype(dataclasses.replace(handler, weight_dtype="float32"), tmp_path)
    assert widened == "float32"
    assert describe(tmp_path, "float32", widened)["weight_bytes_per_token"] == 4 * (64 * 160 + 64)
    kept = served_weight_dtype(handler, tmp_path)
    assert kept == ("bfloat16" if for_device("cpu") is not None else "float32")
    got = describe(tmp_path, "float32", "bfloat16")
    assert got["weight_bytes_per_token"] == 2 * (64 * 160 + 64) and got["checkpoint_dtype"] == "bfloat16"
    assert got["int8_weight_bytes_per_token"] == 64 * 160 + 64 + 4 * 64  # a byte a weight, a float32 scale a row
    assert dtype_label(got) == "float32, bfloat16 weights"
    assert dtype_label(describe(tmp_path, "bfloat16")) == "bfloat16"
    assert dtype_label({"dtype": "float32"}) == "float32"  # a results file from before the weights' dtype


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


@pytest.mark.parametrize("stored", ["bfloat16", "float32"])
def test_the_bench_serves_the_checkpoint_asked_for_and_counts_its_weights_as_served(stored, tiny_model_dir, tmp_path,
                                                                                     monkeypatch):
    """``--checkpoint`` picks the bench model's stored dtype (bf16 by default, as Llama ships); computed in
    float32, the bf16 one keeps bf16 linears where the native kernels run, and the decode bound counts that."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from llama_engine.backends.cpu_kernels import for_device
    from scripts.bench import model as bench_model
    from scripts.bench.run import BenchRun, parse_args

    paths = {}
    for dtype in ("bfloat16", "float32"):
        paths[dtype] = tmp_path / dtype
        model = AutoModelForCausalLM.from_pretrained(tiny_model_dir, torch_dtype=getattr(torch, dtype))
        model.save_pretrained(paths[dtype], safe_serialization=True)
        AutoTokenizer.from_pretrained(tiny_model_dir).save_pretrained(paths[dtype])
    monkeypatch.setattr(bench_model, "ensure_bench_models", lambda *a, **k: paths)
    argv = ["--quick", "--dtype", "float32", "--out", str(tmp_path / "out"), "--tiny", str(tiny_model_dir)]
    args = parse_args(argv + ([] if stored == "bfloat16" else ["--checkpoint", stored]))
    assert args.checkpoint == stored
    run = BenchRun(args, argv)
    run.model_and_configs()
    described = run.results["model"]
    assert run.checkpoint == paths[stored] and described["checkpoint_dtype"] == stored
    kept = stored == "bfloat16" and for_device("cpu") is not None
    assert described["weight_dtype"] == run.weight_dtype == ("bfloat16" if kept else "float32")
    widened = bench_model.describe(paths["float32"], "float32")["weight_bytes_per_token"]
    assert described["weight_bytes_per_token"] == (widened // 2 if kept else widened)


def test_prefill_stall_burst_reports_each_budget_with_every_request_generating(tiny_model_dir, capsys, monkeypatch):
    import torch

    from scripts.bench import measure_prefill_stall as stall

    runs = []
    measure = stall.measure_burst

    def counting(scheduler, prompt_ids, burst, new_tokens, budget):
        result = measure(scheduler, prompt_ids, burst, new_tokens, budget)
        runs.append((budget, scheduler.steps))
        return result

    monkeypatch.setattr(stall, "measure_burst", counting)
    threads = torch.get_num_threads()
    try:
        assert stall.main(["--model", str(tiny_model_dir), "--threads", "1", "--burst", "3", "--prompt-tokens", "12",
                           "--new-tokens", "4", "--budgets", "4", "12", "--rounds", "2"]) == 0
    finally:
        torch.set_num_threads(threads)
    rows = [line.split() for line in capsys.readouterr().out.splitlines()[2:]]
    assert [row[0] for row in rows] == ["4", "12"]
    assert all(float(row[1]) > 0 and row[3] == "ms" and float(row[4]) >= float(row[2]) for row in rows)
    # warm-up, then the budgets alternated: 4 12, 12 4
    assert [budget for budget, _ in runs] == [4, 4, 12, 12, 4]
    # 3 slots, idle: a budget of 12 prefills the whole burst (3 x 12 tokens) in its first step, then
    # 3 decode steps; 4 prefills the first prompt alone (4 per slot), then 4 tokens a step beside
    # it: the others' first tokens come at steps 4 and 7, the last one's 4th token at step 10
    steps = [after - before for (_, before), (_, after) in zip(runs, runs[1:])]
    assert steps == [10, 1 + 3, 1 + 3, 10]
