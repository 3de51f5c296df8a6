"""Peer plumbing of the benchmark suite: the GGUF converter's pre-tokenizer check and the
llama-server stream as the real server sends it."""
from __future__ import annotations

import json
import subprocess
from pathlib import Path

import pytest

from scripts.bench.clients import LlamaServerAdapter
from scripts.convert_gguf import gpt2_pretokenizer
from scripts.streaming_client import RequestRecord

ROOT = Path(__file__).resolve().parents[2]

BYTE_LEVEL = {"type": "ByteLevel", "add_prefix_space": False, "trim_offsets": True, "use_regex": True}


def tokenizer_json(**overrides):
    data = {"model": {"type": "BPE"}, "normalizer": None, "pre_tokenizer": dict(BYTE_LEVEL)}
    data.update(overrides)
    return data


def test_gpt2_pretokenizer_accepts_the_projects_byte_level_bpe():
    assert gpt2_pretokenizer(tokenizer_json())[0]
    assert gpt2_pretokenizer(tokenizer_json(pre_tokenizer={"type": "Sequence", "pretokenizers": [BYTE_LEVEL]}))[0]
    tiny = ROOT / "build" / "tiny-llama" / "tokenizer.json"
    if tiny.exists():  # the tokenizer the bench model carries
        assert gpt2_pretokenizer(json.loads(tiny.read_text())) == (
            True, "ByteLevel with GPT-2's regex, no prefix space, no normalizer")


def test_gpt2_pretokenizer_rejects_anything_else():
    rejected = [
        tokenizer_json(model={"type": "Unigram"}),
        tokenizer_json(normalizer={"type": "NFC"}),
        tokenizer_json(pre_tokenizer={**BYTE_LEVEL, "add_prefix_space": True}),
        tokenizer_json(pre_tokenizer={**BYTE_LEVEL, "use_regex": False}),
        tokenizer_json(pre_tokenizer={"type": "Metaspace"}),
        tokenizer_json(pre_tokenizer={"type": "Sequence", "pretokenizers": [{"type": "Split"}, BYTE_LEVEL]}),
    ]
    for data in rejected:
        ok, why = gpt2_pretokenizer(data)
        assert not ok and why


def sse(message) -> bytes:
    return b"data: " + json.dumps(message).encode()


def test_llama_server_stream_counts_tokens_not_text_events():
    """llama-server streams one event per token whose text is complete, each with its running
    tokens_predicted; a token ending inside a UTF-8 sequence gets no event and arrives with the
    next (whose "tokens" names only that next id); the final event repeats no text, says
    stop_type "limit" when n_predict was reached, and brings tokens never completed as text."""
    adapter = LlamaServerAdapter("http://x")
    record = RequestRecord("llama.cpp", 4, 6)
    lines = [
        b": keep-alive comment",
        sse(None),  # the begin marker, should it ever reach the wire
        sse({"content": "a", "tokens": [7], "stop": False, "tokens_predicted": 1}),
        # token 2 (half of a UTF-8 character) was held back: token 3 completes it
        sse({"content": "\u00e9", "tokens": [201], "stop": False, "tokens_predicted": 3}),
        sse({"content": "b", "tokens": [8], "stop": False, "tokens_predicted": 4}),
        # tokens 5 and 6 end inside a 4-byte character: no event until the final one
        sse({"content": "", "tokens": [], "stop": True, "tokens_predicted": 6, "stop_type": "limit"}),
    ]
    done = [adapter.parse(line, record, float(i)) for i, line in enumerate(lines)]
    assert done == [False] * 5 + [True]
    assert record.token_times == [2.0, 3.0, 3.0, 4.0, 5.0, 5.0]
    assert record.reported_tokens == 6 and record.output_tokens == 6
    assert record.finish_reason == "length"


def test_llama_server_error_and_older_events_without_token_ids():
    adapter = LlamaServerAdapter("http://x")
    record = RequestRecord("llama.cpp", 4, 2)
    assert not adapter.parse(sse({"content": "a", "stop": False}), record, 1.0)
    assert adapter.parse(sse({"content": "", "stop": True, "tokens_predicted": 1, "stop_type": "eos"}), record, 2.0)
    assert record.token_times == [1.0] and record.finish_reason == "stop"
    failed = RequestRecord("llama.cpp", 4, 2)
    assert adapter.parse(sse({"error": {"code": 400, "message": "bad"}}), failed, 1.0)
    assert "bad" in failed.error


def test_systems_filter_keeps_the_suites_order_and_rejects_unknown_names():
    import argparse

    import pytest

    from scripts.bench.plan import SYSTEMS, parse_systems

    assert parse_systems("vllm, llama.cpp") == ["llama.cpp", "vllm"]
    assert parse_systems(",".join(SYSTEMS)) == list(SYSTEMS)
    for bad in ("", "llama", "torchserve,tgi"):
        with pytest.raises(argparse.ArgumentTypeError):
            parse_systems(bad)


def test_vllm_stream_counts_the_token_ids_of_each_chunk():
    from scripts.bench.clients import OpenAICompletionsAdapter

    adapter = OpenAICompletionsAdapter("http://x", "m")
    assert adapter.request(type("P", (), {"ids": [1, 5]})(), 3)[2]["return_token_ids"] is True
    record = RequestRecord("vllm", 2, 3)
    lines = [
        sse({"choices": [{"index": 0, "text": " a", "finish_reason": None, "prompt_token_ids": [1, 5], "token_ids": [9]}]}),
        sse({"choices": [{"index": 0, "text": "", "finish_reason": None, "token_ids": [200, 201]}]}),
        sse({"choices": [], "usage": {"completion_tokens": 3}}),
        b"data: [DONE]",
    ]
    assert [adapter.parse(line, record, float(i)) for i, line in enumerate(lines)] == [False, False, False, True]
    assert record.token_times == [0.0, 1.0, 1.0] and record.reported_tokens == 3


def test_summary_counts_streams_whose_server_count_differs_from_what_streamed():
    from scripts.bench.stats import summarize

    good = RequestRecord("x", 4, 3, start=0.0, token_times=[1.0, 2.0, 3.0], end=3.0, reported_tokens=3)
    off = RequestRecord("x", 4, 3, start=0.0, token_times=[1.0, 2.0], end=3.0, reported_tokens=3)
    silent = RequestRecord("x", 4, 3, start=0.0, token_times=[1.0, 2.0, 3.0], end=3.0)
    run = summarize([good, off, silent])
    assert run["streamed_vs_reported"] == 1 and run["short_streams"] == 0


def test_round_trip_lines_of_the_continuous_handler_parse(caplog):
    """The bench reads the handler's own periodic line; a reworded line would silently read as none."""
    import logging

    import llama_handler
    from scripts.bench.scenarios import round_trips

    trips = llama_handler.RoundTrips(every=1.0)
    with caplog.at_level(logging.INFO, logger=llama_handler.logger.name):
        trips.record(0.0, 0.040, busy=True)
        trips.stepping += 0.030
        trips.record(0.043, 1.2, busy=True)
    parsed = round_trips(caplog.text)
    assert len(parsed) == 1
    assert parsed[0]["calls"] == 2
    assert parsed[0]["handler_ms"] == pytest.approx(598.5, abs=0.01)
    assert parsed[0]["step_ms"] == pytest.approx(15.0, abs=0.01)
    assert parsed[0]["round_trip_ms"] == pytest.approx(1.5, abs=0.01)


def test_continuous_bound_replay_counts_rows_and_merged_chunks():
    """Two slots, outputs 4 and 2: micro decodes 4 steps (1.5 rows each) after an unpadded prefill;
    the ideal batcher prefills each prompt in one merged pass and decodes the rest 2 rows a step."""
    from scripts.bench.continuous_bound import replay

    schedule = [(0.0, 10, 4), (0.1, 6, 2)]  # (arrival s, prompt tokens, output tokens)
    r = replay(schedule, slots=2, step_ms={1: 10.0, 2: 10.0}, prefill_tps=1000.0, chunk=10, merged_ms=0.0)
    assert r["micro_rows_per_step"] == pytest.approx(1.5)
    assert r["micro_decode_s"] == pytest.approx(0.04)
    assert r["micro_prefill_s"] == pytest.approx(0.016)  # 10 + 6 tokens: each row in its own slot, unpadded
    assert r["ideal_decode_s"] == pytest.approx(0.02)  # (6 tokens - 2 merged rows) / 2 rows a step
    assert r["ideal_prefill_s"] == pytest.approx(0.016)
    assert r["bound"] == pytest.approx(0.056 / 0.036)


def test_continuous_bound_measures_two_loads_on_one_backend(tiny_model_dir):
    """The bench measures the mixed and the wide load on one loaded backend: the second starts from free slots."""
    import torch

    from scripts.bench.continuous_bound import load_backend, measure

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        backend = load_backend(tiny_model_dir, "float32", slots=2, max_length=64)
        for schedule in ([(0.0, 8, 4), (0.5, 12, 2)], [(0.0, 6, 8), (0.2, 4, 2), (0.3, 10, 3)]):
            r = measure(backend, schedule, chunk=8, repeats=1)
            assert r["tokens"] == sum(out for _, _, out in schedule) and set(r["step_ms"]) == {1, 2}
    finally:
        torch.set_num_threads(threads)


def test_an_emulated_cpu_class_takes_only_a_llama_server_built_for_it(tmp_path, monkeypatch):
    """Under --cpu-class avx2 the native llama-server (AVX-512 here) would not be the peer an AVX2
    CPU runs: only build/peers/llama.cpp/build-avx2's will do."""
    from scripts.bench import systems

    monkeypatch.setattr(systems, "PEERS", tmp_path)
    gguf = tmp_path / "bench-model-fp32.gguf"
    gguf.write_bytes(b"GGUF")

    def binary(folder):
        path = tmp_path / "llama.cpp" / folder / "bin" / "llama-server"
        path.parent.mkdir(parents=True)
        path.write_text("#!/bin/sh\n")
        path.chmod(0o755)
        return path

    native = binary("build")
    assert systems.LlamaCppSystem(tmp_path / "w", "float32", 2, 8, 1024).detect() == (True, f"{native} with {gguf}")
    found, detail = systems.LlamaCppSystem(tmp_path / "w", "float32", 2, 8, 1024, cpu_class="avx2").detect()
    assert not found and "make bench-peers BENCH_PEERS=llama-avx2" in detail
    for_avx2 = binary("build-avx2")
    assert systems.LlamaCppSystem(tmp_path / "w", "float32", 2, 8, 1024, cpu_class="avx2").detect() == \
        (True, f"{for_avx2} with {gguf}")


def test_build_peers_knows_ggmls_flags_for_each_class_it_builds_for():
    script = ROOT / "scripts" / "build_peers.sh"
    flags = {}
    for cls in ("other", "avx2", "avx512", "amx"):
        probe = subprocess.run(["bash", "-c", f'source <(sed "/^main \\"\\$@\\"/d" {script}); ggml_isa_flags {cls}'],
                               capture_output=True, text=True, timeout=30)
        flags[cls] = (probe.returncode, probe.stdout.split(), probe.stderr)
    assert flags["avx2"][0] == 0 and "-DGGML_AVX2=ON" in flags["avx2"][1] and "-DGGML_AVX512=OFF" in flags["avx2"][1]
    assert flags["avx512"][0] == 0 and "-DGGML_AVX512=ON" in flags["avx512"][1]
    assert flags["other"][0] == 0 and {"-DGGML_SSE42=ON", "-DGGML_AVX=OFF", "-DGGML_AVX2=OFF", "-DGGML_FMA=OFF",
                                       "-DGGML_F16C=OFF"} <= set(flags["other"][1])
    assert flags["amx"][0] != 0 and "no llama-server build for CPU class 'amx'" in flags["amx"][2]


def test_llama_servers_pairs_with_the_llamacpp_backend_alone_are_held_to_the_bandwidth_around_them(monkeypatch):
    """One engine on one GGUF in both: their 1-stream rounds get bandwidth samples around them, as the torch
    rows' do; a torch variant's pairs, or the q8_0 peer's (another GGUF), are speed ratios only. The int8 variant
    meets the q8_0 peer alone, and the q8_0 peer meets nothing else."""
    from types import SimpleNamespace

    from scripts.bench import report, run

    calls = []
    monkeypatch.setattr(run, "paired", lambda first, second, *args, scenario, ratio, efficiency=None:
                        calls.append((first[0], second[0], scenario, efficiency)))
    bench = SimpleNamespace(plan={"scenarios": ["paired"], "paired_rounds": 2}, runs=[], monitor=None, timeout=1,
                            kept={report.SERVED: (None, "micro"), report.LLAMACPP: (None, "llamacpp"),
                                  report.INT8: (None, "int8")}, prompts=None,
                            budget=SimpleNamespace(ok=lambda *args: True), phases={}, _bandwidth_now=lambda: 10.0,
                            results={"decode_bound": {"weight_bytes_per_token": 4e8}})
    bench._kept_runner = lambda name: run.BenchRun._kept_runner(bench, name)
    for peer in ("llama.cpp", "llama.cpp-q8_0"):
        run.BenchRun._paired_with_peer(bench, peer, "adapter")
    bracketed = {(first, scenario): efficiency for first, _, scenario, efficiency in calls}
    assert sorted(bracketed) == [("llama.cpp", "paired-peer/llamacpp"), ("llama.cpp", "paired-peer/micro"),
                                 ("llama.cpp-q8_0", "paired-peer/int8")]
    sample, nbytes = bracketed["llama.cpp", "paired-peer/llamacpp"]
    assert sample() == 10.0 and nbytes == 4e8
    assert [key for key, efficiency in bracketed.items() if efficiency] == [("llama.cpp", "paired-peer/llamacpp")]


def test_the_int8_variant_is_skipped_saying_why_where_the_worker_would_refuse_it():
    """float16 arithmetic takes no int8 weights: the bench says so at once instead of waiting out a worker
    that fails to load."""
    from types import SimpleNamespace

    from scripts.bench import report, run

    served = []
    bench = SimpleNamespace(dtype="float16", results={"systems": {}}, served=lambda *args, **kwargs: served.append(args))
    run.BenchRun.served_int8(bench)
    status = bench.results["systems"][report.INT8]
    assert status["status"] == "skipped" and "handler.weight_dtype int8 under float16" in status["detail"]
    assert not served
