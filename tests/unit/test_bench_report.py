"""The bench's ratios from synthetic rows: the peer goals, the continuous-batching bound and the
table of ratios by CPU class (the figures themselves come from ``make bench``, never asserted)."""
import json

from scripts.bench import report
from scripts.bench.continuous_bound import replay


def _run(system, scenario, tps, **labels):
    return {"system": system, "scenario": scenario, "ok": 8, "requests": 8, "output_tokens_per_s": tps,
            "input_tokens": 256, "output_tokens": 128, "decode_tokens_per_s_per_stream": tps,
            "ttft_ms": {"p50": 100.0, "p90": 150.0, "p99": 200.0}, **labels}


def _results(runs, cpu_class="avx2", extra=None):
    return {"runs": runs, "plan": {"concurrency": [1, 8]}, "extra": extra or {},
            "decode_bound": {"bandwidth_gb_per_s": 10.0, "weight_bytes_per_token": 4e8, "threads": 2},
            "systems": {name: {"status": "ok"} for name in ("llama.cpp", "llama.cpp-q8_0", "vllm")},
            "machine": {"cpu": "AMD EPYC", "logical_cpus": 2, "cpu_class": cpu_class},
            "model": {"dtype": "float32"}, "timestamp": "20261123T000000Z", "mode": "default",
            "versions": {"git": "abc"}}


def test_llama_cpp_goals_at_8_and_1_stream_and_q8_is_labelled_apart():
    runs = [_run("torchserve", "concurrency", 100.0, concurrency=8), _run("torchserve", "concurrency", 20.0, concurrency=1),
            _run("llama.cpp", "concurrency", 90.0, concurrency=8), _run("llama.cpp", "concurrency", 30.0, concurrency=1),
            _run("llama.cpp-q8_0", "concurrency", 200.0, concurrency=8)]
    rs = report.ratios(_results(runs))
    assert rs["peer_ratio_llama.cpp"]["value"] == round(100 / 90, 4) and rs["peer_ratio_llama.cpp"]["met"] is True
    one = rs["peer_ratio_llama.cpp_1_stream"]
    assert one["value"] == round(20 / 30, 4) and one["goal"] == ">= 0.8" and one["met"] is False
    q8 = rs["peer_ratio_llama.cpp-q8_0"]
    assert q8["value"] == 0.5 and q8["met"] is None  # reported, not the bar
    assert rs["peer_ratio_strongest"]["inputs"]["peer"] == "llama.cpp"  # the quantized row is not "strongest"


def test_continuous_is_held_to_the_ideal_to_vllm_and_to_2x_micro_on_the_wide_load():
    runs = [_run("torchserve", "poisson", 60.0), _run("torchserve-continuous", "poisson", 95.0, load="mixed"),
            _run("vllm", "poisson", 100.0),
            _run("torchserve", "poisson", 40.0, load="wide"), _run("torchserve-continuous", "poisson", 90.0, load="wide")]
    bound = {"mixed": {"ideal_tps": 100.0, "bound": 1.6}, "wide": {"ideal_tps": 100.0, "bound": 3.1}}
    rs = report.ratios(_results(runs, extra={"continuous_bound": bound}))
    assert rs["continuous_vs_ideal"]["value"] == 0.95 and rs["continuous_vs_ideal"]["met"] is True
    assert rs["continuous_vs_vllm"]["value"] == 0.95 and rs["continuous_vs_vllm"]["met"] is False
    assert rs["continuous_throughput_vs_micro"]["value"] == round(95 / 60, 4)
    wide = rs["continuous_throughput_vs_micro_wide"]
    assert wide["value"] == 2.25 and wide["met"] is True and wide["inputs"]["bound"] == 3.1
    assert rs["continuous_vs_ideal_wide"]["value"] == 0.9


def test_each_cpu_class_keeps_its_latest_ratios(tmp_path):
    path = tmp_path / "by-cpu.json"
    runs = [_run("torchserve", "concurrency", 100.0, concurrency=8), _run("llama.cpp", "concurrency", 50.0, concurrency=8)]
    for cpu_class, tps in (("amx", 100.0), ("avx2", 25.0), ("avx2", 40.0)):
        results = _results([runs[0], _run("llama.cpp", "concurrency", tps, concurrency=8)], cpu_class)
        results["ratios"] = report.ratios(results)
        table = report.update_by_cpu(results, path)
    assert sorted(table) == ["amx", "avx2"]
    assert table["avx2"]["ratios"]["peer_ratio_llama.cpp"] == 2.5 and table["amx"]["ratios"]["peer_ratio_llama.cpp"] == 1.0
    assert json.loads(path.read_text()) == table
    text = report.by_cpu_table(table)
    assert "| ratio | goal | `amx` | `avx2` |" in text
    assert "| peer_ratio_llama.cpp | >= 1.0 | 1.000 | 2.500 |" in text


def test_old_runs_without_a_class_are_classed_from_their_flags():
    assert report.cpu_label({"cpu_flags": ["amx_bf16", "avx2", "avx512_bf16"]}) == "amx"
    assert report.cpu_label({"cpu_flags": ["avx2"]}) == "avx2"


def test_a_schedule_with_widely_spread_outputs_leaves_micro_batches_mostly_idle():
    steps = {rows: 10.0 + rows for rows in range(1, 9)}  # ms per decode step by rows
    even = [(0.0, 128, 64)] * 16
    wide = [(0.0, 128, 512 if i % 5 == 0 else 16) for i in range(16)]
    assert replay(even, 8, steps, 1000.0, 256, 5.0)["micro_rows_per_step"] == 8
    spread = replay(wide, 8, steps, 1000.0, 256, 5.0)
    assert spread["micro_rows_per_step"] < 2.5 and spread["bound"] > 2


def test_the_schedules_ideal_pays_for_arrivals_and_the_drain():
    from scripts.bench.continuous_bound import simulate

    steps = {rows: 10.0 + rows for rows in range(0, 9)}
    one = simulate([(2.0, 100, 5)], 8, steps, 1000.0, 256, 0.0)
    # 100 prompt tokens at 1000/s give the first token, then 4 one-row steps of 11 ms
    assert abs(one["ideal_s"] - (0.1 + 4 * 0.011)) < 1e-9 and one["sim_tokens"] == 5
    together = [(0.0, 100, 50)] * 8
    apart = [(i * 1.0, 100, 50) for i in range(8)]  # one at a time: 1-row steps, gaps between
    fast, slow = simulate(together, 8, steps, 1000.0, 256, 0.0), simulate(apart, 8, steps, 1000.0, 256, 0.0)
    assert fast["sim_tokens"] == slow["sim_tokens"] == 400
    assert slow["ideal_tps"] < fast["ideal_tps"] / 2
    # with the whole wave's prompts in one pass: 0.8 s of prefill, every first token, then 49 8-row steps
    whole = simulate(together, 8, steps, 1000.0, 800, 0.0)
    assert abs(whole["ideal_s"] - (0.8 + 49 * steps[8] / 1e3)) < 1e-9
    # in 256-token chunks the first prompts start decoding in the passes that prefill the others
    assert fast["ideal_s"] < whole["ideal_s"]


def test_load_choices_read_as_weights_when_repeated():
    from scripts.bench.plan import choices_text

    assert choices_text([8, 16, 32]) == "8/16/32"
    assert choices_text([8] * 7 + [512]) == "8 (7 in 8), 512 (1 in 8)"
