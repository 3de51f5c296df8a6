"""The bench's ratios from synthetic rows: the peer goals, the continuous-batching bound and the
table of ratios by CPU class (the figures themselves come from ``make bench``, never asserted)."""
import json

import pytest

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


def test_llama_cpp_goals_come_from_back_to_back_pairs_where_the_run_has_them():
    runs = [_run("torchserve-continuous", "concurrency", 80.0, concurrency=8),
            _run("torchserve-continuous", "concurrency", 20.0, concurrency=1),
            _run("llama.cpp", "concurrency", 90.0, concurrency=8), _run("llama.cpp", "concurrency", 30.0, concurrency=1)]
    for label, system, at8, at1 in (("micro", "torchserve", 1.02, 0.7), ("continuous", "torchserve-continuous", 1.1, 0.85)):
        runs += [_run(system, f"paired-peer/{label}", 1.0, concurrency=8, served_over_peer=[at8, at8],
                      served_over_peer_median=at8),
                 _run(system, f"paired-peer/{label}", 1.0, concurrency=1, served_over_peer=[at1], served_over_peer_median=at1)]
    rs = report.ratios(_results(runs))
    eight, one = rs["peer_ratio_llama.cpp"], rs["peer_ratio_llama.cpp_1_stream"]
    assert eight["value"] == 1.1 and eight["met"] is True and eight["inputs"]["by_variant"]["torchserve"] == 1.02
    assert one["value"] == 0.85 and one["met"] is True and one["inputs"]["pairs"] == [0.85]
    sweeps = rs["peer_ratio_llama.cpp_sweeps"]  # 80 / 90 minutes apart: reported beside, not the bar
    assert sweeps["value"] == round(80 / 90, 4) and sweeps["met"] is None
    assert rs["peer_ratio_llama.cpp_1_stream_sweeps"]["value"] == round(20 / 30, 4)


def test_the_llamacpp_backend_counts_as_a_served_variant_against_llama_server():
    runs = [_run("torchserve", "concurrency", 60.0, concurrency=8), _run("torchserve-llamacpp", "concurrency", 95.0, concurrency=8),
            _run("llama.cpp", "concurrency", 90.0, concurrency=8)]
    for label, system, at8 in (("micro", "torchserve", 0.8), ("llamacpp", "torchserve-llamacpp", 1.04)):
        runs.append(_run(system, f"paired-peer/{label}", 1.0, concurrency=8, served_over_peer=[at8], served_over_peer_median=at8))
    rs = report.ratios(_results(runs))
    assert rs["peer_ratio_llama.cpp"]["value"] == 1.04 and "torchserve-llamacpp" in rs["peer_ratio_llama.cpp"]["definition"]
    assert "batch1_decode_efficiency_llamacpp" not in rs and "ttft_growth_llamacpp" not in rs  # it ran no 1-stream row
    runs.append(_run("torchserve-llamacpp", "concurrency", 40.0, concurrency=1))
    eff = report.ratios(_results(runs))["batch1_decode_efficiency_llamacpp"]
    assert eff["value"] == round(40 * 4e8 / 10e9, 4) and eff["goal"] == ">= 0.50" and eff["met"] is True
    assert rs["peer_ratio_llama.cpp_sweeps"]["value"] == round(95 / 90, 4)


def test_the_int8_variant_is_measured_against_the_q8_0_peer_never_against_the_bar():
    """int8 weights stream half of bf16's bytes: its rows are reported against llama-server on the q8_0 GGUF
    (the pairs where the run has them) and against the handler over the weights as served, and they neither
    count as the best served variant nor meet llama.cpp's goals."""
    runs = [_run("torchserve", "concurrency", 60.0, concurrency=8), _run("torchserve", "concurrency", 20.0, concurrency=1),
            _run("torchserve-int8", "concurrency", 90.0, concurrency=8),
            _run("torchserve-int8", "concurrency", 30.0, concurrency=1),
            _run("llama.cpp", "concurrency", 80.0, concurrency=8), _run("llama.cpp", "concurrency", 25.0, concurrency=1),
            _run("llama.cpp-q8_0", "concurrency", 75.0, concurrency=8),
            _run("llama.cpp-q8_0", "concurrency", 24.0, concurrency=1),
            _run("torchserve-int8", "paired-peer/int8", 1.0, concurrency=8, served_over_peer=[1.3, 1.1, 1.2],
                 served_over_peer_median=1.2)]
    results = _results(runs)
    results["model"]["int8_weight_bytes_per_token"] = 1e8
    rs = report.ratios(results)
    eight, one = rs["int8_vs_llama.cpp-q8_0"], rs["int8_vs_llama.cpp-q8_0_1_stream"]
    assert eight["value"] == 1.2 and eight["inputs"]["pairs"] == [1.3, 1.1, 1.2] and eight["met"] is None
    assert one["value"] == round(30 / 24, 4) and "(the sweeps)" in one["definition"] and one["met"] is None
    assert rs["int8_vs_served_weights"]["value"] == 1.5 and rs["int8_vs_served_weights_1_stream"]["value"] == 1.5
    assert rs["batch1_decode_efficiency_int8"]["value"] == round(30 * 1e8 / 10e9, 4)
    assert rs["peer_ratio_llama.cpp"]["value"] == round(60 / 80, 4) and rs["peer_ratio_llama.cpp"]["met"] is False
    assert rs["peer_ratio_llama.cpp_1_stream"]["inputs"]["by_variant"] == {"torchserve": 0.8}
    assert rs["peer_ratio_strongest"]["inputs"]["served_system"] == "torchserve"
    assert not any(key.startswith("int8") for key in report.ratios(_results(runs[:2] + runs[4:8])))


def test_the_int8_variant_is_held_to_the_served_weights_by_its_back_to_back_pairs_where_it_has_them():
    """Sweeps minutes apart carry the host's drift (two runs of the same code read 1.38 and 0.90 from them on
    the Zen 3): the ``paired-int8`` rows' median takes over, at each concurrency they ran at."""
    runs = [_run("torchserve", "concurrency", 60.0, concurrency=8), _run("torchserve", "concurrency", 20.0, concurrency=1),
            _run("torchserve-int8", "concurrency", 90.0, concurrency=8),
            _run("torchserve-int8", "concurrency", 30.0, concurrency=1),
            _run("torchserve-int8", "paired-int8", 1.0, concurrency=8, int8_over_weights=[1.1, 1.3, 1.2],
                 int8_over_weights_median=1.2),
            _run("torchserve", "paired-int8", 1.0, concurrency=8, int8_over_weights=[1.1, 1.3, 1.2],
                 int8_over_weights_median=1.2)]
    rs = report.ratios(_results(runs))
    eight, one = rs["int8_vs_served_weights"], rs["int8_vs_served_weights_1_stream"]
    assert eight["value"] == 1.2 and eight["inputs"]["pairs"] == [1.1, 1.3, 1.2]
    assert "median of 3 back-to-back A/B pairs" in eight["definition"] and eight["met"] is None
    assert one["value"] == 1.5 and "(the sweeps)" in one["definition"]  # no pairs at 1 stream: the sweeps


def test_the_llamacpp_backends_batch1_is_reported_beside_its_engines_own():
    runs = [_run("llama.cpp", "concurrency", 50.0, concurrency=1)]
    rs = report.ratios(_results(runs))
    assert "batch1_decode_efficiency_llama.cpp" not in rs  # the backend did not run: nothing to explain
    runs += [_run("torchserve-llamacpp", "concurrency", 40.0, concurrency=1),
             _run("torchserve-llamacpp", "paired-peer/llamacpp", 1.0, concurrency=1, served_over_peer=[0.9, 0.96, 0.93],
                  served_over_peer_median=0.93)]
    rs = report.ratios(_results(runs))
    engine, kept = rs["batch1_decode_efficiency_llama.cpp"], rs["llamacpp_vs_llama.cpp_1_stream"]
    assert engine["value"] == round(50 * 4e8 / 10e9, 4) and engine["met"] is None  # reported, not a goal
    assert kept["value"] == 0.93 and kept["met"] is None and kept["inputs"]["pairs"] == [0.9, 0.96, 0.93]


def test_the_llamacpp_backend_and_llama_server_are_held_to_the_bandwidth_around_their_pairs():
    """As the torch rows are: the llamacpp backend's 1-stream pairs with llama-server, each round between
    two bandwidth samples, give both engines a bracketed figure; the sweep against the best stays beside."""
    bracket = dict(bandwidth_gb_per_s_rounds=[6.0, 7.0, 8.0])
    runs = [_run("llama.cpp", "concurrency", 10.0, concurrency=1), _run("torchserve-llamacpp", "concurrency", 10.0, concurrency=1),
            _run("llama.cpp", "paired-peer/llamacpp", 1.0, concurrency=1, served_over_peer=[0.9, 0.95],
                 served_over_peer_median=0.925, decode_efficiency_rounds=[0.6, 0.62], decode_efficiency_median=0.61, **bracket),
            _run("torchserve-llamacpp", "paired-peer/llamacpp", 1.0, concurrency=1, served_over_peer=[0.9, 0.95],
                 served_over_peer_median=0.925, decode_efficiency_rounds=[0.52, 0.56], decode_efficiency_median=0.54,
                 **bracket)]
    rs = report.ratios(_results(runs))
    backend, engine = rs["batch1_decode_efficiency_llamacpp"], rs["batch1_decode_efficiency_llama.cpp"]
    assert backend["value"] == 0.54 and backend["met"] is True and backend["inputs"]["rounds"] == [0.52, 0.56]
    assert rs["batch1_decode_efficiency_llamacpp_vs_best_bandwidth"]["value"] == round(10 * 4e8 / 10e9, 4) == 0.4
    assert rs["batch1_decode_efficiency_llamacpp_vs_best_bandwidth"]["met"] is None
    assert engine["value"] == 0.61 and engine["met"] is None and engine["inputs"]["bandwidth_gb_per_s_samples"] == [6.0, 7.0, 8.0]
    assert rs["batch1_decode_efficiency_llama.cpp_vs_best_bandwidth"]["value"] == 0.4


@pytest.mark.parametrize("native_bf16, sixteen_bit", [(True, "bf16"), (False, "f16")])
def test_derived_configs_set_the_gguf_type_for_llamacpp_and_the_dtype_otherwise(tmp_path, monkeypatch, native_bf16,
                                                                                sixteen_bit):
    import yaml

    from llama_engine import cpu
    from scripts.bench.plan import ROOT, derived_config

    flags = {"avx2", "f16c", "avx512f"} | ({"avx512_bf16"} if native_bf16 else set())
    monkeypatch.setattr(cpu, "host_cpu_flags", lambda: frozenset(flags))
    monkeypatch.delenv(cpu.CLASS_ENV, raising=False)
    for base, dtype, key, want in (("bench-llama-llamacpp", "float32", "gguf_type", "f32"),
                                   ("bench-llama-llamacpp", "bfloat16", "gguf_type", sixteen_bit),
                                   ("bench-llama", "bfloat16", "dtype", "bfloat16")):
        out = derived_config(ROOT / "model-config" / f"{base}.yaml", tmp_path / f"{base}-{dtype}.yaml", dtype, 2, {})
        handler = yaml.safe_load(out.read_text())["handler"]
        assert handler[key] == want and handler["torch_threads"] == 2
        assert ("dtype" in handler) == (base == "bench-llama")


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
    assert "continuous_bound_wide_at_served_costs" not in rs  # rows from before the served prices were recorded


def test_what_the_wide_load_allows_is_also_priced_at_each_servers_own_forward_passes():
    def priced(*bounds):
        return {"ideal_at_served_costs": [None] + [{"ideal_tps": 200.0, "bound": b} for b in bounds]}

    runs = [_run("torchserve", "poisson", 95.0, load="wide", **priced(2.0, 2.1)),
            _run("torchserve-continuous", "poisson", 180.0, load="wide", **priced(2.2, 2.3))]
    bound = {"wide": {"ideal_tps": 160.0, "bound": 2.8}}
    rs = report.ratios(_results(runs, extra={"continuous_bound": bound}))
    wide = rs["continuous_throughput_vs_micro_wide"]
    assert wide["inputs"]["bound"] == 2.8 and wide["inputs"]["bound_at_micro_costs"] == 2.05
    assert wide["inputs"]["bound_at_continuous_costs"] == 2.25
    assert "allows 2.80x at the step costs measured in-process, 2.05x at the forward passes micro-batching's" \
           in wide["definition"] and "(2.25x at continuous batching's)" in wide["definition"]
    allowed = rs["continuous_bound_wide_at_served_costs"]
    assert allowed["value"] == 2.05 and allowed["met"] is None and allowed["inputs"]["rounds"] == [2.0, 2.1]


def test_batch1_efficiency_is_held_to_the_bandwidth_measured_around_it():
    sweep = _run("inprocess", "concurrency", 30.0, concurrency=1)  # 30 tok/s x 4e8 B / 10 GB/s = 1.2 against the best
    pair = _run("inprocess", "paired", 30.0, concurrency=1, decode_efficiency_rounds=[0.4, 0.55, 0.6],
                bandwidth_gb_per_s_rounds=[20.0, 22.0, 21.0, 24.0], decode_efficiency_median=0.55)
    rs = report.ratios(_results([sweep, pair]))
    assert rs["batch1_decode_efficiency"]["value"] == 0.55 and rs["batch1_decode_efficiency"]["met"] is True
    assert rs["batch1_decode_efficiency_vs_best_bandwidth"]["value"] == 1.2
    assert rs["batch1_decode_efficiency_vs_best_bandwidth"]["met"] is None
    alone = report.ratios(_results([sweep]))  # no bracketed pairs: the sweep against the best bandwidth is the figure
    assert alone["batch1_decode_efficiency"]["value"] == 1.2 and alone["batch1_decode_efficiency"]["met"] is True


def test_the_float32_variants_decode_is_held_to_the_bandwidth_around_its_wave():
    """Best bandwidth 10 GB/s; 40 MB a token at 60 tok/s streams 2.4 GB/s: against the 4 and 8 GB/s
    read around the wave that is 0.4, against the run's best 0.24 (a report beside it)."""
    fp32 = {"ok": 1, "decode_tokens_per_s_per_stream": 60.0, "weight_bytes_per_token": 4e7,
            "bandwidth_gb_per_s_bracket": [4.0, 8.0]}
    runs = [_run("torchserve", "concurrency", 100.0, concurrency=8)]
    rs = report.ratios(_results(runs, extra={"fp32_batch1": fp32}))
    assert rs["batch1_decode_efficiency_fp32"]["value"] == 0.4 and rs["batch1_decode_efficiency_fp32"]["met"] is False
    best = rs["batch1_decode_efficiency_fp32_vs_best_bandwidth"]
    assert best["value"] == 0.24 and best["met"] is None
    del fp32["bandwidth_gb_per_s_bracket"]  # a run from before the bracket: the best bandwidth is all there is
    rs = report.ratios(_results(runs, extra={"fp32_batch1": fp32}))
    assert rs["batch1_decode_efficiency_fp32"]["value"] == 0.24
    assert "batch1_decode_efficiency_fp32_vs_best_bandwidth" not in rs


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


def test_a_rerun_without_a_peer_keeps_that_peers_figures_marked_with_their_run(tmp_path):
    """vLLM not built on the host this time: the column keeps its last vLLM ratio, marked, and says
    which run it came from, until a run measures it again; other ratios come from the latest run only."""
    path = tmp_path / "by-cpu.json"

    def run(timestamp, git, peers, cpu="AMD EPYC (family 25, model 17)"):
        runs = [_run("torchserve", "concurrency", 100.0, concurrency=8)] + [
            _run(name, "concurrency", tps, concurrency=8) for name, tps in peers.items()]
        results = _results(runs, "avx512-bf16")
        results["machine"]["cpu"] = cpu
        results.update(timestamp=timestamp, versions={"git": git})
        results["ratios"] = report.ratios(results)
        return results

    report.update_by_cpu(run("T1", "aaa", {"llama.cpp": 50.0, "vllm": 40.0}), path)
    table = report.update_by_cpu(run("T2", "bbb", {"llama.cpp": 25.0}), path)
    column = table["avx512-bf16"]
    assert column["ratios"]["peer_ratio_llama.cpp"] == 4.0 and "peer_ratio_vllm" not in column["ratios"]
    assert column["carried"]["peer_ratio_vllm"] == {"value": 2.5, "goal": "report", "timestamp": "T1", "git": "aaa"}
    assert set(column["carried"]) == {"peer_ratio_vllm"}
    text = report.by_cpu_table(table)
    assert "| peer_ratio_vllm | report | 2.500† |" in text and "| peer_ratio_llama.cpp | >= 1.0 | 4.000 |" in text
    assert "`avx512-bf16`: † from its run at T1 (aaa), which measured what the latest did not: peer_ratio_vllm" in text
    carried_on = report.update_by_cpu(run("T3", "ccc", {"llama.cpp": 50.0}), path)["avx512-bf16"]["carried"]
    assert carried_on["peer_ratio_vllm"]["timestamp"] == "T1"
    measured_again = report.update_by_cpu(run("T4", "ddd", {"llama.cpp": 50.0, "vllm": 20.0}), path)["avx512-bf16"]
    assert measured_again["ratios"]["peer_ratio_vllm"] == 5.0 and "carried" not in measured_again
    other_cpu = report.update_by_cpu(run("T5", "eee", {"llama.cpp": 50.0}, cpu="AMD EPYC (family 25, model 1)"), path)
    assert "carried" not in other_cpu["avx512-bf16 on AMD 25/1"]


def test_two_cpus_of_one_class_each_keep_their_latest_run_and_page(tmp_path, monkeypatch):
    """An Intel Xeon without AMX and a Zen 4 are both avx512-bf16: the second CPU measured gets a
    column and a page of its own, and each CPU's rerun replaces only its own."""
    monkeypatch.setattr(report, "DOCS_PAGE", tmp_path / "docs" / "benchmarks.md")
    (tmp_path / "docs").mkdir()
    by_cpu = report.by_cpu_path(report.DOCS_PAGE)
    zen4, xeon = "AMD EPYC (family 25, model 17)", "Intel(R) Xeon(R) Processor (family 6, model 207)"
    assert report.cpu_short(xeon) == "Intel 6/207" and report.cpu_short("AMD EPYC") == "AMD"

    def run(cpu, tps, emulated_on=None):
        runs = [_run("torchserve", "concurrency", 100.0, concurrency=8), _run("llama.cpp", "concurrency", tps, concurrency=8)]
        results = _results(runs, "avx512-bf16" if not emulated_on else "avx2")
        results["machine"].update(cpu=cpu, **({"emulated_on": emulated_on} if emulated_on else {}))
        results["ratios"] = report.ratios(results)
        return results

    first = run(zen4, 50.0)
    assert report.default_docs(first["machine"]) == tmp_path / "docs" / "benchmarks-avx512-bf16.md"
    report.update_by_cpu(first, by_cpu)
    assert report.default_docs(first["machine"]) == tmp_path / "docs" / "benchmarks-avx512-bf16.md"
    second = run(xeon, 80.0)
    assert report.default_docs(second["machine"]) == tmp_path / "docs" / "benchmarks-avx512-bf16-intel-6-207.md"
    report.update_by_cpu(second, by_cpu)
    report.update_by_cpu(run(xeon, 40.0), by_cpu)
    report.update_by_cpu(run(zen4, 25.0), by_cpu)
    table = json.loads(by_cpu.read_text())
    assert {k: v["ratios"]["peer_ratio_llama.cpp"] for k, v in table.items()} == \
        {"avx512-bf16": 4.0, "avx512-bf16 on Intel 6/207": 2.5}
    emulated = run(xeon, 50.0, emulated_on="avx512-bf16")
    assert report.default_docs(emulated["machine"]) == tmp_path / "docs" / "benchmarks-avx2-emulated.md"
    report.update_by_cpu(emulated, by_cpu)
    assert report.default_docs(run(zen4, 50.0, emulated_on="avx512-bf16")["machine"]) == \
        tmp_path / "docs" / "benchmarks-avx2-amd-25-17-emulated.md"
    on_amx = run("Intel(R) Xeon(R) Processor (family 6, model 167)", 50.0, emulated_on="amx")
    assert report.cpu_column(on_amx["machine"], json.loads(by_cpu.read_text())) == "avx2 (emulated on amx)"
    assert report.default_docs(on_amx["machine"]) == tmp_path / "docs" / "benchmarks-avx2-on-amx-emulated.md"


def test_a_cpu_named_before_its_family_was_recorded_is_the_same_cpu():
    bare, numbered = "Intel(R) Xeon(R) Processor", "Intel(R) Xeon(R) Processor (family 6, model 143)"
    table = {"amx": {"cpu": bare}}
    assert report.cpu_column({"cpu_class": "amx", "cpu": numbered}, table) == "amx"
    assert report.cpu_column({"cpu_class": "amx", "cpu": "AMD EPYC (family 26, model 2)"}, table) == "amx on AMD 26/2"
    table = {"amx": {"cpu": numbered}}
    assert report.cpu_column({"cpu_class": "amx", "cpu": "Intel(R) Xeon(R) Processor (family 6, model 207)"}, table) \
        == "amx on Intel 6/207"


def test_each_class_has_its_own_page_and_one_table_of_ratios_by_class(tmp_path, monkeypatch):
    """A run on an avx2 CPU and one with --cpu-class avx2 on an avx512-bf16 host are two columns and two
    pages, and every class page shares the table of ratios by class beside docs/benchmarks.md."""
    monkeypatch.setattr(report, "DOCS_PAGE", tmp_path / "docs" / "benchmarks.md")
    (tmp_path / "docs").mkdir()
    runs = [_run("torchserve", "concurrency", 100.0, concurrency=8), _run("llama.cpp", "concurrency", 80.0, concurrency=8)]
    measured, emulated = _results(runs, "avx2"), _results(runs, "avx2")
    emulated["machine"]["emulated_on"] = "avx512-bf16"
    assert report.cpu_label(emulated["machine"]) == "avx2 (emulated on avx512-bf16)"
    assert report.default_docs(measured["machine"]) == tmp_path / "docs" / "benchmarks-avx2.md"
    assert report.default_docs({"cpu_flags": ["avx2", "avx512f"]}) == tmp_path / "docs" / "benchmarks-avx512.md"
    page = report.default_docs(emulated["machine"])
    assert page == tmp_path / "docs" / "benchmarks-avx2-emulated.md"
    by_cpu = tmp_path / "docs" / "benchmarks-by-cpu.json"
    assert report.by_cpu_path(page) == by_cpu == report.by_cpu_path(report.DOCS_PAGE)
    assert report.by_cpu_path(report.default_docs(measured["machine"])) == by_cpu
    assert report.by_cpu_path(tmp_path / "mine.md") == tmp_path / "mine-by-cpu.json"
    for results in (measured, emulated):
        results["ratios"] = report.ratios(results)
        report.update_by_cpu(results, by_cpu)
    assert sorted(json.loads(by_cpu.read_text())) == ["avx2", "avx2 (emulated on avx512-bf16)"]


def test_a_run_writes_its_class_page_and_the_index_leaving_other_classes_pages_alone(tmp_path, monkeypatch):
    """docs/benchmarks.md lists every class page and the ratios by class; a run on one class rewrites its
    own page and the index, and another class's page stays byte for byte."""
    monkeypatch.setattr(report, "DOCS_PAGE", tmp_path / "docs" / "benchmarks.md")
    monkeypatch.setattr(report, "plot_all", lambda results, out: [])
    monkeypatch.setattr(report, "markdown", lambda results, plots: f"{results['machine']['cpu_class']} results\n")
    (tmp_path / "docs").mkdir()
    runs = [_run("torchserve", "concurrency", 100.0, concurrency=8), _run("llama.cpp", "concurrency", 80.0, concurrency=8)]
    measured = _results(runs, "avx512-bf16")
    measured["ratios"] = report.ratios(measured)
    written = report.write_all(measured, tmp_path / "out-measured", report.default_docs(measured["machine"]))
    bf16_page = tmp_path / "docs" / "benchmarks-avx512-bf16.md"
    assert bf16_page in written and report.DOCS_PAGE in written
    before = bf16_page.read_text()
    assert "avx512-bf16 results" in before
    emulated = _results([runs[0], _run("llama.cpp", "concurrency", 40.0, concurrency=8)], "avx2")
    emulated["machine"]["emulated_on"] = "avx512-bf16"
    emulated["ratios"] = report.ratios(emulated)
    real_avx2 = _results([runs[0], _run("llama.cpp", "concurrency", 50.0, concurrency=8)], "avx2")
    real_avx2["ratios"] = report.ratios(real_avx2)
    report.write_all(emulated, tmp_path / "out-emulated", report.default_docs(emulated["machine"]))
    report.write_all(real_avx2, tmp_path / "out-avx2", report.default_docs(real_avx2["machine"]))
    assert bf16_page.read_text() == before
    avx2_page = (tmp_path / "docs" / "benchmarks-avx2.md").read_text()
    assert avx2_page.startswith("# Benchmarks on the `avx2` CPU class\n") and avx2_page.count("avx2 results") == 1
    assert "[benchmarks.md](benchmarks.md)" in avx2_page and report.BY_CPU_HEADING not in avx2_page
    assert "**An emulated CPU class.**" in (tmp_path / "docs" / "benchmarks-avx2-emulated.md").read_text()
    index = report.DOCS_PAGE.read_text()
    assert "## Latest results" not in index and "results\n" not in index
    links = [line for line in index.splitlines() if line.startswith("- [`")]
    assert links == ["- [`avx2`](benchmarks-avx2.md)", "- [`avx512-bf16`](benchmarks-avx512-bf16.md)",
                     "- [`avx2 (emulated)`](benchmarks-avx2-emulated.md)"]
    assert "| ratio | goal | `avx2` | `avx2 (emulated on avx512-bf16)` | `avx512-bf16` |" in index
    assert "| peer_ratio_llama.cpp | >= 1.0 | 2.000 | 2.500 | 1.250 |" in index
    assert "## How to run" in index
    with pytest.raises(ValueError, match="index of the pages by CPU class"):
        report.write_all(real_avx2, tmp_path / "out-again", report.DOCS_PAGE)


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


def test_steps_pay_for_the_positions_their_rows_read_and_passes_for_themselves():
    """A micro-batch's long answer decodes alone over ever more positions; every prefill pass costs
    ``pass_ms`` besides its tokens."""
    from scripts.bench.continuous_bound import simulate, simulate_micro

    steps = {1: 10.0, 2: 12.0}
    costs = dict(kv_ms=0.01, context=100, pass_ms=5.0)
    # one request: 100 prompt tokens in a 5 ms pass plus 0.1 s, then tokens 2..4 over 101..103 positions
    decode = sum(10.0 + 0.01 * (ctx - 100) for ctx in (101, 102, 103)) / 1e3
    one = simulate([(0.0, 100, 4)], 2, steps, 1000.0, 256, 0.0, **costs)
    assert one["ideal_s"] == pytest.approx(0.105 + decode)
    assert simulate_micro([(0.0, 100, 4)], 2, steps, 1000.0, **costs)["tps"] == pytest.approx(4 / (0.105 + decode))
    # the saturated replay: micro's batch pays its rows' positions step by step, the ideal every token's
    schedule = [(0.0, 50, 3), (0.0, 150, 1)]
    r = replay(schedule, 2, steps, 1000.0, 256, 7.0, **costs)
    micro_steps = [12.0 + 0.01 * (50 + 150 - 200), 10.0 + 0.01 * (51 - 100), 10.0 + 0.01 * (52 - 100)]
    assert r["micro_decode_s"] == pytest.approx(sum(micro_steps) / 1e3)
    assert r["micro_prefill_s"] == pytest.approx(0.2 + 0.005)
    positions = (50 + 51 + 52) + 150
    assert r["ideal_decode_s"] == pytest.approx(((4 - 2) / 2 * 12.0 + 2 * 7.0 + 0.01 * (positions - 4 * 100)) / 1e3)
    assert r["ideal_prefill_s"] == pytest.approx(0.2 + 2 * 0.005)
    flat = replay(schedule, 2, steps, 1000.0, 256, 7.0)
    assert r["micro_decode_s"] < flat["micro_decode_s"]  # below the mean context, steps cost less


class _Clock:
    """A backend whose passes advance a fake clock by a known cost: the measurements must recover it."""

    def __init__(self, slots=4, max_length=1024):
        self.now, self.max_slots, self.max_length, self._lengths = 0.0, slots, max_length, [0] * slots

    def perf_counter(self):
        return self.now

    def decode_slots(self, slots, tokens):
        self.now += (8.0 + 2.0 * len(slots) + 0.004 * sum(self._lengths[s] for s in slots)) / 1e3
        for s in slots:
            self._lengths[s] += 1

    def prefill_slot(self, slot, ids, start=0):
        self.now += (6.0 + 2.5 * len(ids)) / 1e3
        self._lengths[slot] = start + len(ids)

    def free_slot(self, slot):
        self._lengths[slot] = 0


def test_the_bound_measures_step_position_and_pass_costs(monkeypatch):
    from scripts.bench import continuous_bound as cb

    clock = _Clock()
    monkeypatch.setattr(cb.time, "perf_counter", clock.perf_counter)
    assert cb.step_times(clock, 4, 100, repeats=3) == pytest.approx({r: 8.0 + 2.0 * r + 0.4 * r for r in range(1, 5)})
    assert cb.kv_ms_per_position(clock, 4, 20, 500, repeats=3) == pytest.approx(0.004)
    assert cb.kv_ms_per_position(clock, 4, 500, 500, repeats=3) == 0.0
    assert cb.prefill_rate(clock, 16, 256, repeats=3) == pytest.approx(400.0)  # 2.5 ms a token, 6 ms a pass
    assert clock._lengths == [0] * 4  # every slot free again for the next load
    r = cb.measure(clock, [(0.0, 16, 8)] * 15 + [(0.0, 32, 960)], chunk=256, repeats=3)
    tokens = 15 * 8 + 960
    assert r["context"] == round((15 * (8 * 16 + 28) + 960 * 32 + 960 * 959 / 2) / tokens)
    # a pass's own cost: a 1-row step's (8 + 2 ms + its K/V reads) less its row at the prefill rate
    assert r["kv_ms"] == pytest.approx(0.004) and r["pass_ms"] == pytest.approx(10.0 - 2.5)
    assert r["merged_rows_ms"] == pytest.approx(3 * (2.5 + 0.004 * r["context"]))
    assert r["bound"] > 1.5  # micro-batching's 1-row steps over the long answer's positions


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
    # at an idle server a pass prefills a chunk per slot: here the whole wave in one pass of
    # 0.8 s, every first token, then 49 8-row steps
    whole = 0.8 + 49 * steps[8] / 1e3
    assert abs(fast["ideal_s"] - whole) < 1e-9
    assert abs(simulate(together, 8, steps, 1000.0, 100, 0.0)["ideal_s"] - whole) < 1e-9
    # chunks of 50: the first pass holds 4 prompts (400 tokens); with those decoding, the other 4
    # come 50 tokens a pass beside them (8 passes to 0.8 s: the 4 make 9 tokens, the others 7, 5, 3, 1),
    # then 41 8-row steps end the first 4 and the rest drain 2 steps each of 4, 3, 2, 1 rows
    halves = simulate(together, 8, steps, 1000.0, 50, 0.0)
    drain = 2 * sum(steps[rows] for rows in (4, 3, 2, 1))
    assert abs(halves["ideal_s"] - (0.8 + (41 * steps[8] + drain) / 1e3)) < 1e-9


BOUND = {"slots": 8, "chunk": 256, "step_ms": {str(r): 10.0 + r for r in range(1, 9)},  # as the JSON holds it
         "prefill_tokens_per_s": 1000.0, "merged_rows_ms": 7.0}
WAVE = [(i * 0.5, 200, 40) for i in range(16)]


def _forward(decode_ms: dict, decode_passes: int, prefill_tokens: int, merged_rows: int, prefill_s: float) -> dict:
    """A round's forward passes as ``scrape_metrics.forward_passes`` gives them (one prefill shape)."""
    return {"decode": {r: {"passes": decode_passes, "seconds": decode_passes * ms / 1e3} for r, ms in decode_ms.items()},
            "prefill": {merged_rows: {"passes": 10, "seconds": prefill_s, "prefill_tokens": prefill_tokens}}}


def test_the_ideal_priced_at_the_servers_own_forward_passes():
    from scripts.bench.continuous_bound import at_served_costs, simulate

    inproc = {r: 10.0 + r for r in range(1, 9)}
    expected = simulate(WAVE, 8, inproc, 1000.0, 256, 7.0)["ideal_tps"]
    # passes that cost what the in-process measure said: the same ideal
    same = _forward(inproc, 20, 2000, 0, 2.0)
    assert at_served_costs(BOUND, same, WAVE)["ideal_tps"] == pytest.approx(expected)
    # a host twice as slow in the round: every cost doubles, rows it never ran too
    slow = at_served_costs(BOUND, _forward({r: 2 * inproc[r] for r in (1, 4, 8)}, 20, 2000, 0, 4.0), WAVE)
    assert slow["decode_scale"] == pytest.approx(2.0) and slow["prefill_scale"] == pytest.approx(2.0)
    assert slow["step_ms"][6] == pytest.approx(32.0) and slow["served_rows"] == [1, 4, 8]
    assert slow["prefill_tokens_per_s"] == pytest.approx(500.0) and slow["merged_rows_ms"] == pytest.approx(14.0)
    assert expected / 2 < slow["ideal_tps"] < expected  # the gaps between arrivals do not slow down
    burst = [(0.0, 200, 40)] * 16
    assert at_served_costs(BOUND, _forward({r: 2 * inproc[r] for r in (1, 4, 8)}, 20, 2000, 0, 4.0), burst)[
        "ideal_tps"] == pytest.approx(at_served_costs(BOUND, same, burst)["ideal_tps"] / 2)
    # merged decode rows are priced before the prefill scale: 7 rows in 10 passes at 7 ms per 7 rows
    merged = at_served_costs(BOUND, _forward(inproc, 20, 2000, 7, 2.07), WAVE)
    assert merged["prefill_scale"] == pytest.approx(1.0)
    # each of the 10 prefill passes costs 10 ms besides its tokens
    with_pass = at_served_costs(dict(BOUND, pass_ms=10.0), _forward(inproc, 20, 2000, 0, 2.1), WAVE)
    assert with_pass["prefill_scale"] == pytest.approx(1.0)
    # too few passes of a row count to price it; nothing to price at all
    sparse = at_served_costs(BOUND, _forward({2: 24.0, 3: 13.0}, 4, 2000, 0, 2.0) | {"decode": {
        2: {"passes": 4, "seconds": 0.096}, 3: {"passes": 6, "seconds": 0.078}}}, WAVE)
    assert sparse["served_rows"] == [3] and sparse["step_ms"][2] == pytest.approx(12.0)
    assert at_served_costs(BOUND, {}, WAVE) is None


def test_micro_batching_is_replayed_at_the_same_served_prices_as_the_ideal():
    from scripts.bench.continuous_bound import at_served_costs, simulate_micro

    inproc = {r: 10.0 + r for r in range(1, 9)}
    same = at_served_costs(BOUND, _forward(inproc, 20, 2000, 0, 2.0), WAVE)
    micro = simulate_micro(WAVE, 8, inproc, 1000.0)["tps"]
    assert same["micro_tps"] == pytest.approx(micro) and same["bound"] == pytest.approx(same["ideal_tps"] / micro)
    # one-row steps that cost the server twice as much: micro-batching's long one-row tails pay for it,
    # the ideal's full steps do not, so the load allows more; half as much, less
    spread = [(i * 0.5, 200, 400 if i % 8 == 0 else 8) for i in range(16)]
    base = at_served_costs(BOUND, _forward(inproc, 20, 2000, 0, 2.0), spread)
    dear_one_row = at_served_costs(BOUND, _forward(inproc | {1: 22.0}, 20, 2000, 0, 2.0), spread)
    assert dear_one_row["micro_tps"] < base["micro_tps"] and dear_one_row["bound"] > base["bound"]
    cheap_one_row = at_served_costs(BOUND, _forward(inproc | {1: 5.5}, 20, 2000, 0, 2.0), spread)
    assert cheap_one_row["bound"] < base["bound"]


def test_continuous_against_the_ideal_at_served_costs_with_the_in_process_one_beside():
    rounds = {"output_tokens_per_s_rounds": [45.0, 55.0], "vs_ideal_at_served_costs": [0.9, 1.0],
              "ideal_at_served_costs": [{"ideal_tps": 50.0}, {"ideal_tps": 55.0}]}
    runs = [_run("torchserve", "poisson", 40.0), _run("torchserve-continuous", "poisson", 50.0, **rounds)]
    rs = report.ratios(_results(runs, extra={"continuous_bound": {"mixed": {"ideal_tps": 80.0, "bound": 1.5}}}))
    served = rs["continuous_vs_ideal"]
    assert served["value"] == 0.95 and served["met"] is True and served["inputs"]["ideal_tps_rounds"] == [50.0, 55.0]
    inprocess = rs["continuous_vs_ideal_inprocess"]
    assert inprocess["value"] == 0.625 and inprocess["met"] is None


def test_forward_passes_read_from_a_scrape():
    from scripts.scrape_metrics import forward_passes, parse

    text = "\n".join(f'{name}{{ModelName="{m}",kind="{k}",rows="{r}",Hostname="h",}} {v}' for name, m, k, r, v in (
        ("llama_forward_passes_total", "m", "decode", "8", 30.0), ("llama_forward_seconds_total", "m", "decode", "8", 1.5),
        ("llama_forward_passes_total", "m", "prefill", "7", 2.0), ("llama_forward_seconds_total", "m", "prefill", "7", 0.9),
        ("llama_forward_prefill_tokens_total", "m", "prefill", "7", 512.0),
        ("llama_forward_passes_total", "other", "decode", "1", 9.0))) + "\n"
    assert forward_passes(parse(text), "m") == {
        "decode": {8: {"passes": 30.0, "seconds": 1.5}},
        "prefill": {7: {"passes": 2.0, "seconds": 0.9, "prefill_tokens": 512.0}}}


def test_micro_batching_on_the_arrivals_waits_for_the_batch_before_it():
    from scripts.bench.continuous_bound import simulate, simulate_micro

    steps = {rows: 10.0 + rows for rows in range(0, 9)}
    one = simulate_micro([(2.0, 100, 5)], 8, steps, 1000.0)
    # 100 prompt tokens at 1000/s give the first token, then 4 one-row steps of 11 ms
    assert one["p99_ttft_s"] == pytest.approx(0.1) and one["tps"] == pytest.approx(5 / (0.1 + 4 * 0.011))
    # two requests 10 ms apart: the second waits for the first's whole batch (prefill + 49 steps)
    two = [(0.0, 100, 50), (0.01, 100, 50)]
    second = 0.1 + 49 * 0.011 - 0.01 + 0.1
    assert simulate_micro(two, 8, steps, 1000.0)["p99_ttft_s"] == pytest.approx(0.1 + 0.99 * (second - 0.1))
    # the continuous batcher admits it into a free slot at once: its prompt goes in the next pass
    assert simulate(two, 8, steps, 1000.0, 256, 0.0)["p99_ttft_s"] < 0.25


def _steady(system, p99_ms, rate=0.3):
    run = _run(system, "poisson", 40.0, load="steady", rate_per_s=rate, rounds=2, requests=60)
    run["ttft_ms"] = dict(run["ttft_ms"], p99=p99_ms)
    return run


def test_the_p99_ttft_goal_is_on_the_steady_load_and_the_mixed_one_is_reported_with_what_it_allows():
    runs = [_run("torchserve", "poisson", 40.0), _run("torchserve-continuous", "poisson", 50.0),
            _steady("torchserve", 12_000.0), _steady("torchserve-continuous", 3_000.0)]
    runs[0]["ttft_ms"]["p99"], runs[1]["ttft_ms"]["p99"] = 100_000.0, 68_000.0
    bound = {"mixed": {"ideal_tps": 60.0, "bound": 1.2, "p99_ttft_bound": 0.65},
             "steady": {"ideal_tps": 30.0, "bound": 1.1, "p99_ttft_bound": 0.15}}
    steady_load = {"rate": 0.3, "utilization": 0.6, "micro_capacity_per_s": 0.5}
    rs = report.ratios(_results(runs, extra={"continuous_bound": bound, "steady_load": steady_load}))
    mixed = rs["continuous_p99_ttft_vs_micro"]
    assert mixed["value"] == 0.68 and mixed["goal"] == "report" and mixed["met"] is None
    assert mixed["inputs"]["bound"] == 0.65 and "ideal gets 0.65" in mixed["definition"]
    steady = rs["continuous_p99_ttft_vs_micro_steady"]
    assert steady["value"] == 0.25 and steady["goal"] == "<= 0.5" and steady["met"] is True
    assert steady["inputs"]["bound"] == 0.15
    assert "30 requests" in steady["definition"] and "0.3/s, 60% of micro-batching's" in steady["definition"]
    runs[3]["ttft_ms"]["p99"] = 7_000.0
    assert report.ratios(_results(runs, extra={"continuous_bound": bound}))["continuous_p99_ttft_vs_micro_steady"]["met"] is False


def test_the_steady_load_is_the_same_requests_paced_to_what_micro_batching_serves():
    from scripts.bench.continuous_bound import on_arrivals, steady_rate
    from scripts.bench.plan import STEADY, Prompts, poisson_lengths

    unit = poisson_lengths(STEADY, 1024, seed=0)
    assert len(unit) == STEADY["requests"] and unit == poisson_lengths(STEADY, 1024, seed=0)
    # drawn as the mixed load is (at 1/s, its lengths), cut at the count
    mixed = poisson_lengths(dict(STEADY, rate=1.0, duration=200.0), 1024, seed=0)
    assert unit == mixed[:STEADY["requests"]] and {i for _, i, _ in unit} <= set(STEADY["inputs"])
    # 100 tok/s in micro-batching's saturated replay of 10 requests of 1000 tokens in all: 1 request/s
    pace = steady_rate({"micro_tps": 100.0, "requests": 10, "tokens": 1000}, 0.6)
    assert pace["rate"] == 0.6 and pace["micro_capacity_per_s"] == 1.0

    class Factory:
        def make(self, n):
            return list(range(n))

    plan = {"lengths": [], "ttft_probes": 0, "paired_concurrency": [], "concurrency": [], "rounds": 0,
            "poisson": dict(rate=1.0, duration=5.0, inputs=[8], outputs=[4]), "poisson_wide": dict(rate=1.0, duration=0.0,
            inputs=[8], outputs=[4]), "poisson_steady": dict(requests=5, utilization=0.5, rate=None, inputs=[8, 16], outputs=[4])}
    prompts = Prompts(Factory(), plan, 1024, seed=0)
    before = prompts.schedules["steady"]
    prompts.pace("steady", 0.25)
    after = prompts.schedules["steady"]
    assert [t * 4 for t, _, _ in before] == pytest.approx([t for t, _, _ in after]) and prompts.rates == {"steady": 0.25}
    assert [(ids, out) for _, ids, out in before] == [(ids, out) for _, ids, out in after]
    with pytest.raises(ValueError, match="paced already"):
        prompts.pace("steady", 0.5)
    # slower arrivals of the same requests: micro-batching's TTFT p99 falls, and so does the ideal's
    bound = dict(BOUND, step_ms={r: 10.0 + r for r in range(1, 9)})
    fast = on_arrivals(bound, [(i * 0.05, 200, 40) for i in range(16)])
    slow = on_arrivals(bound, [(i * 2.0, 200, 40) for i in range(16)])
    assert slow["micro_p99_ttft_s"] < fast["micro_p99_ttft_s"] and slow["ideal_p99_ttft_s"] <= fast["ideal_p99_ttft_s"]
    assert slow["p99_ttft_bound"] == pytest.approx(slow["ideal_p99_ttft_s"] / slow["micro_p99_ttft_s"])


def _steady_run_state(micro_tps):
    """A BenchRun's state after the mixed load: the steady load paced from the in-process replay (1 request/s
    of 100 output tokens each), micro-batching's mixed-load row at ``micro_tps``, and the steady bound."""
    from types import SimpleNamespace

    from scripts.bench.continuous_bound import on_arrivals

    class Factory:
        def make(self, n):
            return list(range(n))

    plan = {"lengths": [], "ttft_probes": 0, "paired_concurrency": [], "concurrency": [], "rounds": 0,
            "poisson": dict(rate=1.0, duration=5.0, inputs=[8], outputs=[4]), "poisson_wide": dict(rate=1.0, duration=0.0,
            inputs=[8], outputs=[4]), "poisson_steady": dict(requests=6, utilization=0.6, rate=None, inputs=[8], outputs=[100])}
    from scripts.bench.plan import Prompts

    prompts = Prompts(Factory(), plan, 1024, seed=0)
    prompts.pace("steady", 0.6)
    bound = dict(BOUND, step_ms={r: 10.0 + r for r in range(1, 9)})
    bound.update(on_arrivals(bound, [(t, len(ids), out) for t, ids, out in prompts.schedules["steady"]]))
    mixed = {"system": "torchserve", "scenario": "poisson", "load": "mixed", "ok": 6, "output_tokens_per_s": micro_tps}
    paces = []
    state = SimpleNamespace(prompts=prompts, runs=[mixed], results={"extra": {
        "steady_load": {"rate": 0.6, "utilization": 0.6, "micro_capacity_per_s": 1.0, "micro_tps": 100.0},
        "continuous_bound": {"steady": bound}}})
    state._record_pace = lambda load, pace: (paces.append((load, pace)),
                                             state.results["extra"].__setitem__("steady_load", pace))
    return state, paces


def test_the_steady_load_is_repaced_to_what_micro_batching_served_where_that_is_less():
    """Served, micro-batching can fall well short of its in-process replay (an Emerald Rapids Xeon: 132 against
    186 tok/s), and 60% of the replay's capacity was no steady load there: both queues grew."""
    from scripts.bench.continuous_bound import served_capacity
    from scripts.bench.run import BenchRun

    assert served_capacity(50.0, [(0.0, [1], 100), (1.0, [1], 300)]) == 0.25
    state, paces = _steady_run_state(micro_tps=50.0)  # served: 0.5 requests/s of 100 tokens, half the replay's
    before = list(state.prompts.schedules["steady"])
    p99_before = state.results["extra"]["continuous_bound"]["steady"]["micro_p99_ttft_s"]
    BenchRun._steady_at_served_capacity(state)
    assert state.prompts.rates["steady"] == 0.3
    after = state.prompts.schedules["steady"]
    assert [t * 2 for t, _, _ in before] == pytest.approx([t for t, _, _ in after])
    assert [(ids, out) for _, ids, out in before] == [(ids, out) for _, ids, out in after]
    (load, pace), = paces
    assert load == "steady" and pace["rate"] == 0.3 and pace["served_micro_capacity_per_s"] == 0.5
    assert pace["micro_capacity_per_s"] == 1.0 and "served on the mixed load" in pace["basis"]
    steady_bound = state.results["extra"]["continuous_bound"]["steady"]
    assert steady_bound["micro_p99_ttft_s"] <= p99_before and steady_bound["pace"] == pace  # the new arrivals
    steady_runs = [_steady("torchserve", 12_000.0, rate=0.3), _steady("torchserve-continuous", 3_000.0, rate=0.3)]
    rs = report.ratios(_results(steady_runs, extra=state.results["extra"]))
    assert "60% of the requests/s micro-batching served on the mixed load" in \
        rs["continuous_p99_ttft_vs_micro_steady"]["definition"]
    with pytest.raises(ValueError, match="not paced yet"):
        state.prompts.repace("wide", 1.0)


def test_the_steady_load_keeps_its_pace_where_micro_batching_served_as_much_as_its_replay():
    from scripts.bench.run import BenchRun

    state, paces = _steady_run_state(micro_tps=120.0)  # 1.2 requests/s served: more than the replay's 1.0
    BenchRun._steady_at_served_capacity(state)
    assert state.prompts.rates["steady"] == 0.6 and not paces
    state, paces = _steady_run_state(micro_tps=50.0)
    state.runs = []  # micro-batching did not run the mixed load
    BenchRun._steady_at_served_capacity(state)
    assert state.prompts.rates["steady"] == 0.6 and not paces


def test_the_mixed_and_wide_loads_are_paced_past_what_the_ideal_continuous_batcher_serves():
    """A fixed rate stops saturating the servers as soon as they get faster (the wide load's 3/s on the Zen 5
    EPYC measured the offer, 1.30x, where the bound allowed 3.24x): those loads are paced from the bound."""
    from scripts.bench.continuous_bound import on_arrivals, overload_rate, pace_for, replay
    from scripts.bench.plan import MIXED, MODES, WIDE, Prompts, make_plan

    # 1000 tok/s saturated, 10 requests of 1000 tokens in all: the ideal serves 10 requests/s
    pace = overload_rate({"saturated_ideal_tps": 1000.0, "requests": 10, "tokens": 1000}, 1.25)
    assert pace["rate"] == 12.5 and pace["ideal_capacity_per_s"] == 10.0
    assert pace_for({"saturated_ideal_tps": 1000.0, "requests": 10, "tokens": 1000}, MIXED)["rate"] == 12.5
    assert pace_for({"micro_tps": 100.0, "requests": 10, "tokens": 1000}, dict(requests=5, utilization=0.6))["rate"] == 0.6
    assert pace_for({}, dict(rate=3.0, duration=4.0)) is None  # a fixed-rate load keeps its rate
    for mode in ("quick", "default"):
        assert {"requests", "overload", "rate"} <= set(MODES[mode]["poisson"]) and MODES[mode]["poisson_wide"]["overload"]
    # --poisson-rate / --poisson-duration: a fixed-rate mixed load again
    fixed = make_plan("default", ["poisson"], poisson_rate=2.0)["poisson"]
    assert fixed["rate"] == 2.0 and fixed["duration"] == MIXED["requests"] / 2.0 and "overload" not in fixed
    assert make_plan("default", ["poisson"])["poisson"] == MIXED

    class Factory:
        def make(self, n):
            return list(range(n))

    plan = {"lengths": [], "ttft_probes": 0, "paired_concurrency": [], "concurrency": [], "rounds": 0,
            "poisson": dict(MIXED, requests=6), "poisson_wide": dict(WIDE, requests=16),
            "poisson_steady": dict(requests=2, utilization=0.5, rate=None, inputs=[8], outputs=[4])}
    prompts = Prompts(Factory(), plan, 1024, seed=0)
    unpaced = prompts.schedule
    assert prompts.load_plan(plan, "mixed") is plan["poisson"]
    prompts.pace("mixed", 4.0)
    assert prompts.schedule is prompts.schedules["mixed"] and prompts.schedule != unpaced  # the peers run the paced one
    paced = prompts.load_plan(plan, "mixed")
    assert paced["rate"] == 4.0 and paced["duration"] == round(prompts.schedule[-1][0], 1) and paced["requests"] == 6
    # paced past the ideal's capacity, the ideal on the arrivals serves about its saturated throughput
    schedule = [(t, len(ids), out) for t, ids, out in prompts.schedules["wide"]]
    bound = dict(BOUND, step_ms={r: 10.0 + r for r in range(1, 9)})
    bound.update(replay(schedule, 8, bound["step_ms"], bound["prefill_tokens_per_s"], bound["chunk"],
                        bound["merged_rows_ms"]))
    bound["saturated_ideal_tps"] = bound["ideal_tps"]
    rate = overload_rate(bound, 1.25)["rate"]
    arrivals = on_arrivals(bound, [(t / rate, inp, out) for t, inp, out in schedule])
    offered = on_arrivals(bound, [(t / 0.2, inp, out) for t, inp, out in schedule])  # a slow fixed rate: the offer
    assert arrivals["ideal_tps"] > 3 * offered["ideal_tps"]


def test_load_choices_read_as_weights_when_repeated():
    from scripts.bench.plan import choices_text

    assert choices_text([8, 16, 32]) == "8/16/32"
    assert choices_text([8] * 7 + [512]) == "8 (7 in 8), 512 (1 in 8)"


def _ttft(system, inp, p50):
    return dict(_run(system, "ttft", 1.0, concurrency=1, input_tokens=inp), ttft_ms={"p50": p50, "p90": p50, "p99": p50})


def test_ttft_growth_splits_into_a_fixed_cost_and_a_cost_per_prompt_token():
    rs = report.ratios(_results([_ttft("torchserve", 256, 500.0), _ttft("torchserve", 768, 1400.0)]))
    growth = rs["ttft_growth"]
    assert growth["value"] == round(1400 / 500, 4) and growth["met"] is False
    # 900 ms more for 512 more tokens: 1.758 ms a token, and 500 - 256 x 1.758 = 50 ms besides
    assert growth["inputs"]["per_prompt_token_ms"] == pytest.approx(900 / 512, abs=1e-3)
    assert growth["inputs"]["fixed_ms"] == pytest.approx(500 - 256 * 900 / 512, abs=0.1)
    assert "50 ms + 1.76 ms/token" in growth["definition"]


def test_each_peers_ttft_growth_and_its_long_prompt_ttft_are_reported_beside_the_goal():
    runs = [_ttft("torchserve", 256, 500.0), _ttft("torchserve", 768, 1400.0),
            _ttft("llama.cpp", 256, 600.0), _ttft("llama.cpp", 768, 1800.0), _ttft("vllm", 256, 1000.0)]
    rs = report.ratios(_results(runs))
    peer = rs["ttft_growth_llama.cpp"]
    assert peer["value"] == 3.0 and peer["met"] is None and "0 ms + 2.34 ms/token" in peer["definition"]
    assert rs["ttft_long_vs_llama.cpp"]["value"] == round(1400 / 1800, 4)
    assert rs["ttft_long_vs_llama.cpp"]["inputs"] == {"served_ms": 1400.0, "peer_ms": 1800.0}
    assert "ttft_growth_vllm" not in rs and "ttft_growth_llama.cpp-q8_0" not in rs  # one probe, and none
    down = _results(runs)
    down["systems"]["llama.cpp"]["status"] = "failed"
    assert "ttft_growth_llama.cpp" not in report.ratios(down)


def test_the_prefill_bound_gives_the_growth_any_implementation_faces_and_how_near_inprocess_runs():
    bound = {"256": {"tokens_per_s": 600.0, "gflops": 136.0}, "768": {"tokens_per_s": 720.0, "gflops": 163.0}}
    runs = [_ttft("inprocess", 256, 512.0), _ttft("inprocess", 768, 1536.0)]
    rs = report.ratios(dict(_results(runs), prefill_bound=bound))
    floor = rs["ttft_growth_at_prefill_bound"]
    assert floor["value"] == round((768 / 720) / (256 / 600), 4) == 2.5 and floor["met"] is None
    assert rs["prefill_vs_bound_256"]["value"] == round(500 / 600, 4)  # 256 tokens in 0.512 s
    assert rs["prefill_vs_bound_768"]["value"] == round(500 / 720, 4)
    assert "ttft_growth_at_prefill_bound" not in report.ratios(_results(runs))  # a run without the samples
    line = report.prefill_bound_line(dict(_results(runs), prefill_bound=bound))
    assert "600 tok/s on 256 rows (136 GFLOP/s), 720 tok/s on 768 rows (163 GFLOP/s)" in line
    bound["768"]["kernels"] = ["oneDNN packed", "nn.Linear"]
    line = report.prefill_bound_line(dict(_results(runs), prefill_bound=bound))
    assert "fastest of nn.Linear, oneDNN packed and the native kernels where they serve the dtype: " \
           "nn.Linear and oneDNN packed)" in line


def test_a_server_falls_behind_when_its_last_request_ends_later_than_a_typical_one_takes():
    def row(completed, drain, e2e_p50_ms):
        return {"offered_rate_per_s": 1.0, "completed_rate_per_s": completed, "drain_s": drain,
                "e2e_ms": {"p50": e2e_p50_ms}}

    assert report.queue_grew(row(0.42, 83.6, 55_800.0))  # the mixed load on the AVX2 EPYC
    # a short steady run: the last request's own answer drags the rate under 0.9, yet no backlog
    assert not report.queue_grew(row(0.86, 14.8, 18_400.0))
    assert not report.queue_grew(row(0.95, 60.0, 1_000.0))


def test_the_cpu_model_carries_its_family_and_model_numbers(tmp_path):
    from scripts.bench.machine import _cpu_model

    cpuinfo = tmp_path / "cpuinfo"
    block = "processor\t: {n}\nvendor_id\t: AuthenticAMD\ncpu family\t: {f}\nmodel\t\t: 17\nmodel name\t: AMD EPYC\n\n"
    cpuinfo.write_text(block.format(n=0, f=25) + block.format(n=1, f=99))
    assert _cpu_model(cpuinfo) == "AMD EPYC (family 25, model 17)"
    cpuinfo.write_text("processor\t: 0\nmodel name\t: ARMv8 Processor rev 1 (v8l)\n\n")
    assert _cpu_model(cpuinfo) == "ARMv8 Processor rev 1 (v8l)"


def test_the_bench_refuses_to_write_its_results_over_the_index():
    from scripts.bench.run import parse_args

    with pytest.raises(SystemExit):
        parse_args(["--docs", str(report.DOCS_PAGE)])
    assert parse_args(["--docs", str(report.DOCS_PAGE.with_name("benchmarks-mine.md"))]).docs.name == "benchmarks-mine.md"


def test_the_machine_line_says_which_openmp_waits_the_bench_process_ran_under():
    machine = {"openmp_env": {"OMP_WAIT_POLICY": "PASSIVE", "GOMP_SPINCOUNT": "20000"}}
    assert report.openmp_text(machine) == ("; OpenMP in the bench process: `OMP_WAIT_POLICY=PASSIVE`, "
                                          "`GOMP_SPINCOUNT=20000`")
    assert report.openmp_text({"openmp_env": {"OMP_WAIT_POLICY": None, "GOMP_SPINCOUNT": None}}) == ""
    assert report.openmp_text({}) == ""  # a run from before the bench recorded them


def test_the_machine_line_says_when_the_run_could_use_fewer_cpus_than_the_host_has():
    assert report.usable_text({"logical_cpus": 64, "usable_cpus": 4, "usable_cpus_source": "cgroup CPU quota 4"}) == (
        " (4 usable: cgroup CPU quota 4)")
    assert report.usable_text({"logical_cpus": 2, "usable_cpus": 2, "usable_cpus_source": "CPU affinity"}) == ""
    assert report.usable_text({"logical_cpus": 2}) == ""  # a run from before the bench recorded them


def test_the_serving_overhead_says_whether_serving_cost_the_first_token_or_every_token():
    latencies = {"inprocess": ({"p50": 456.0}, {"p50": 10.9}), "torchserve": ({"p50": 668.0}, {"p50": 10.6})}
    runs = [_run(system, "paired", tps, concurrency=1, served_over_inprocess=[0.9, 0.88, 0.92],
                 served_over_inprocess_median=0.9, ttft_ms=latencies[system][0], itl_ms=latencies[system][1])
            for system, tps in (("inprocess", 67.5), ("torchserve", 60.7))]
    row = report.ratios(_results(runs))["serving_overhead_batch1"]
    assert row["value"] == 0.9 and row["met"] is True
    assert row["inputs"]["ttft_p50_ms"] == [668.0, 456.0] and row["inputs"]["itl_p50_ms"] == [10.6, 10.9]
    assert "TTFT p50 668 / 456 ms, ITL p50 10.6 / 10.9 ms" in row["definition"]
    del runs[0]["itl_ms"]  # a run from before the paired rows kept latencies: the ratio alone
    row = report.ratios(_results(runs))["serving_overhead_batch1"]
    assert row["value"] == 0.9 and "TTFT" not in row["definition"] and "ttft_p50_ms" not in row["inputs"]


def test_a_model_whose_weights_fit_the_last_level_cache_is_flagged():
    """On a CPU whose L3 holds the bench model, batch-1 decode can beat the DRAM bandwidth: say so."""
    results = _results([])  # 4e8 bytes of weights per token
    assert report.cache_caveat(results) == ""
    results["machine"]["last_level_cache_bytes"] = 32 << 20
    assert report.cache_caveat(results) == ""
    results["machine"]["last_level_cache_bytes"] = 260 << 20
    results["decode_bound"]["weight_bytes_per_token"] = 226e6
    assert "fit this CPU's last-level cache** (226 MB of weights per token, 273 MB of cache)" in report.cache_caveat(results)
