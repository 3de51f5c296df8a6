"""The benchmark suite (scripts/bench): a --smoke run end to end, and the peer client adapters.

The smoke run uses the embedded tiny model through a real TorchServe for a few seconds and
checks that every output is well-formed. Speeds are never asserted, only that figures exist
and are positive.
"""
from __future__ import annotations

import json
import os
import re
import signal
import struct
import subprocess
import sys
import time
from http.server import BaseHTTPRequestHandler
from pathlib import Path

import pytest

from scripts.bench.clients import LlamaServerAdapter, OpenAICompletionsAdapter
from scripts.bench.prompts import Prompt, PromptFactory
from scripts.streaming_client import TorchServeAdapter, run_schedule, run_wave
from scripts.tsctl import read_log

from loopback_http import loopback_server

ROOT = Path(__file__).resolve().parents[2]
PNG_MAGIC = b"\x89PNG\r\n\x1a\n"
PLOTS = ("ttft_vs_input.png", "throughput_vs_concurrency.png", "latency_percentiles.png", "poisson_latency.png")
RATIOS = ("serving_overhead", "batch1_decode_efficiency", "ttft_growth", "peer_ratio_strongest")
FIGURES = ("output_tokens_per_s", "decode_tokens_per_s_per_stream", "throughput_seq_tokens_per_s", "wall_s")


def host_env() -> dict:
    """This environment, with this venv's commands first, as this CPU (no emulated class from a
    caller's ``--cpu-class`` environment: llama_engine.cpu.emulation_env) and with no OpenMP waits
    (the bench sets what a server gets)."""
    from llama_engine.cpu import EMULATION_VARS

    env = dict(os.environ, PATH=f"{Path(sys.executable).parent}:{os.environ.get('PATH', '')}")
    for var in (*EMULATION_VARS, "OMP_WAIT_POLICY", "GOMP_SPINCOUNT"):
        env.pop(var, None)
    return env


@pytest.fixture(scope="module")
def smoke(tiny_model_dir, tmp_path_factory):
    out = tmp_path_factory.mktemp("bench")
    env = host_env()
    started = time.monotonic()
    # Its own session: on a hang the whole group goes (TorchServe included), not just the bench.
    proc = subprocess.Popen([sys.executable, "-m", "scripts.bench", "--smoke", "--out", str(out),
                             "--tiny", str(tiny_model_dir)], cwd=ROOT, env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, start_new_session=True)
    try:
        stdout, stderr = proc.communicate(timeout=480)  # a hang guard: the plan's budget is 4 minutes
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        stdout, stderr = proc.communicate()
        pytest.fail(f"the smoke bench hung past 480 s: {stdout[-2000:]}{stderr[-2000:]}")
    assert proc.returncode == 0, stdout[-4000:] + stderr[-4000:]
    return out, json.loads((out / "latest.json").read_text()), stdout, time.monotonic() - started


def test_smoke_json_has_every_section_and_positive_figures(smoke):
    out, results, _, _ = smoke
    for key in ("timestamp", "mode", "command", "machine", "versions", "model", "config", "plan",
                "memory_bandwidth", "decode_bound", "systems", "runs", "ratios", "phases_s", "outputs"):
        assert key in results, key
    assert results["mode"] == "smoke"
    assert results["versions"]["torch"] and results["versions"]["torchserve"]
    assert results["machine"]["logical_cpus"] >= 1
    assert 1 <= results["machine"]["usable_cpus"] <= results["machine"]["logical_cpus"]
    # its in-process rows ran under the OpenMP waits a server gets (the fixture's environment sets none)
    assert results["machine"]["openmp_env"] == {"OMP_WAIT_POLICY": "PASSIVE", "GOMP_SPINCOUNT": "20000"}
    assert results["model"]["weight_bytes_per_token"] > 0
    assert all(bw["gb_per_s"] > 0 for bw in results["memory_bandwidth"].values())
    assert results["decode_bound"]["tokens_per_s"] > 0
    # the linear layers' prompt tokens/s at the shortest and longest length, a sample at the start and the end
    assert sorted(results["prefill_bound"]) == ["32", "96"] and len(results["prefill_bound_samples"]) == 2
    assert all(b["tokens_per_s"] > 0 and b["gflops"] > 0 for b in results["prefill_bound"].values())
    assert results["ratios"]["ttft_growth_at_prefill_bound"]["value"] > 0
    products = results["decode_products"]  # the linear products alone at 1 row, a sample at the start and the end
    assert products["tokens_per_s"] > 0 and products["gb_per_s"] > 0 and len(results["decode_products_samples"]) == 2
    assert results["ratios"]["batch1_decode_efficiency_at_products_bound"]["value"] > 0
    assert results["ratios"]["batch1_decode_vs_products"]["value"] > 0
    assert results["systems"]["inprocess"]["status"] == "ok"
    assert results["systems"]["torchserve"]["status"] == "ok"
    assert results["systems"]["torchserve-continuous"]["status"] == "ok"
    assert results["systems"]["torchserve-llamacpp"]["status"] == "ok"  # make test builds llama-cpp-python
    assert "backend llamacpp (f32 GGUF)" in results["systems"]["torchserve-llamacpp"]["detail"]
    assert results["systems"]["torchserve-int8"]["status"] == "ok"
    assert "weight_dtype int8" in results["systems"]["torchserve-int8"]["detail"]
    for peer in ("llama.cpp", "vllm"):
        assert results["systems"][peer]["status"] in ("ok", "not installed", "skipped")
    assert (out / f"results-{results['timestamp']}.json").exists()


def test_smoke_runs_cover_each_scenario_with_full_length_streams(smoke):
    _, results, _, _ = smoke
    runs = results["runs"]
    seen = {(r["system"], r["scenario"]) for r in runs}
    for system in ("inprocess", "torchserve"):
        assert {(system, "length"), (system, "concurrency")} <= seen
        probes = sorted(r["input_tokens"] for r in runs if r["system"] == system and r["scenario"] == "ttft")
        assert probes == [32, 96], probes  # one probe a length, taken in turn, a row each
    assert results["ratios"]["ttft_growth"]["inputs"]["scenario"] == "ttft"
    assert results["ratios"]["prefill_vs_bound_96"]["value"] > 0
    assert ("torchserve", "poisson") in seen
    assert ("torchserve-llamacpp", "concurrency") in seen  # the llamacpp backend's sweep (no Poisson rounds)
    assert not any(s == "torchserve-llamacpp" and sc == "poisson" for s, sc in seen)
    # the int8 variant: its waves at the paired concurrencies the sweep has, then back to back with the
    # micro-batching handler at each paired concurrency, nothing else
    assert {(r["scenario"], r["concurrency"]) for r in runs if r["system"] == "torchserve-int8"} == {
        ("concurrency", 4), ("paired-int8", 1), ("paired-int8", 4)}
    assert {r["concurrency"] for r in runs if r["system"] == "torchserve" and r["scenario"] == "paired-int8"} == {1, 4}
    for suffix in ("", "_1_stream"):
        weights = results["ratios"][f"int8_vs_served_weights{suffix}"]
        assert weights["value"] > 0 and len(weights["inputs"]["pairs"]) == 2
        assert "back-to-back" in weights["definition"]
    assert results["model"]["int8_weight_bytes_per_token"] < results["model"]["weight_bytes_per_token"] / 3
    # the two TorchServe variants run each load's schedule in alternating rounds (one in --smoke)
    paired = [r for r in runs if r["scenario"] == "poisson" and r["system"].startswith("torchserve")]
    assert sorted((r["load"], r["system"]) for r in paired) == [
        ("mixed", "torchserve"), ("mixed", "torchserve-continuous"),
        ("steady", "torchserve"), ("steady", "torchserve-continuous"),
        ("wide", "torchserve"), ("wide", "torchserve-continuous")]
    prompt_tokens = {}
    for run in paired:
        assert run["rounds"] == 1 and len(run["round_ratios"]) == 1 and run["round_ratios"][0] > 0, run
        forward = run["server_forward_rounds"][0]  # the server's own forward passes in the round (its metrics)
        assert forward["decode"] and all(shape["seconds"] > 0 for shape in forward["decode"].values())
        prompt_tokens.setdefault(run["load"], set()).add(
            sum(shape["prefill_tokens"] for shape in forward["prefill"].values()))
    assert all(len(totals) == 1 and totals.pop() > 0 for totals in prompt_tokens.values())  # both prefilled the same prompts
    wide = next(r for r in paired if r["load"] == "wide")
    assert wide["output_choices"] == results["plan"]["poisson_wide"]["outputs"]
    assert results["ratios"]["continuous_throughput_vs_micro_wide"]["goal"] == ">= 2.0"
    # --smoke measures no continuous bound to pace the steady load by: the plan's fixed rate paces it
    steady = next(r for r in paired if r["load"] == "steady")
    assert results["extra"]["steady_load"]["rate"] == steady["rate_per_s"] == results["plan"]["poisson_steady"]["rate"]
    assert steady["requests"] == results["plan"]["poisson_steady"]["requests"] and 0 < steady["duration_s"]
    assert results["ratios"]["continuous_p99_ttft_vs_micro_steady"]["goal"] == "<= 0.5"
    # ... and the same static wave back to back, one ratio per pair (2 pairs of 4 streams in --smoke)
    waves = [r for r in runs if r["scenario"] == "paired-variants"]
    assert sorted((r["system"], r["concurrency"]) for r in waves) == [("torchserve", 4), ("torchserve-continuous", 4)]
    for run in waves:
        assert run["requests"] == 2 * 4 and len(run["continuous_over_micro"]) == 2, run
        assert all(x > 0 for x in run["continuous_over_micro"]), run
    assert results["ratios"]["continuous_static_vs_micro"]["inputs"]["pairs"] == waves[0]["continuous_over_micro"]
    # at 1 stream, each A/B round sits between two memory-bandwidth samples; efficiency per round per system
    one = {r["system"]: r for r in runs if r["scenario"] == "paired" and r["concurrency"] == 1}
    assert sorted(one) == ["inprocess", "torchserve"]
    for run in one.values():
        assert len(run["decode_efficiency_rounds"]) == 2 and len(run["bandwidth_gb_per_s_rounds"]) == 3, run
        assert all(0 < e for e in run["decode_efficiency_rounds"]) and min(run["bandwidth_gb_per_s_rounds"]) > 0
    assert results["ratios"]["batch1_decode_efficiency"]["inputs"]["rounds"] == one["inprocess"]["decode_efficiency_rounds"]
    assert results["ratios"]["batch1_decode_efficiency_served_vs_best_bandwidth"]["met"] is None
    for run in runs:
        assert run["ok"] == run["requests"] > 0, run
        assert run["short_streams"] == 0, run  # EOS is suppressed: every stream has its max_new_tokens
        assert set(run["finish_reasons"]) == {"length"}, run
        for figure in FIGURES:
            assert isinstance(run[figure], (int, float)) and run[figure] > 0, (figure, run)
        for metric in ("ttft_ms", "itl_ms", "e2e_ms"):
            pct = run[metric]
            assert 0 < pct["p50"] <= pct["p90"] <= pct["p99"], (metric, run)
        assert run["ttft_ms"]["p50"] <= run["e2e_ms"]["p50"]


def test_smoke_ratios_markdown_and_plots(smoke):
    out, results, stdout, seconds = smoke
    for name in RATIOS:
        ratio = results["ratios"][name]
        assert {"value", "goal", "met", "definition"} <= set(ratio), name
        if name != "peer_ratio_strongest":
            assert ratio["value"] > 0, name
    assert "ratios (reported, never asserted)" in stdout
    table = (out / "results.md").read_text()
    assert "| system | scenario |" in table and "| torchserve | concurrency |" in table
    assert "| serving_overhead |" in table
    for name in PLOTS:
        data = (out / name).read_bytes()
        assert data[:8] == PNG_MAGIC and data[12:16] == b"IHDR", name
        width, height = struct.unpack(">II", data[16:24])
        assert width > 100 and height > 100, name
    assert results["outputs"]["docs"] is None  # --smoke never rewrites docs/benchmarks.md
    # Bounded by the plan's time budget (phases past it are skipped), not by a wall-clock assertion.
    assert results["plan"]["max_minutes"] <= 4 and seconds > 0


def test_served_rows_carry_the_servers_own_figures_from_its_metrics_api(smoke):
    """The handler's metrics, scraped before and after each served row, count what the client saw."""
    _, results, _, _ = smoke
    served = [r for r in results["runs"] if "server" in r]
    assert {r["system"] for r in served} == {"torchserve", "torchserve-continuous", "torchserve-llamacpp",
                                             "torchserve-int8"}
    for run in served:
        server = run["server"]
        assert server["requests"] == run["requests"] and server["errors_by_status"] == {}, run
        assert server["generation_tokens"] == run["total_output_tokens"], run
        assert server["finish_reasons"] == run["finish_reasons"], run
        assert 0 < server["ttft_mean_ms"] <= server["e2e_mean_ms"] <= run["e2e_ms"]["max"], run
        assert 0 < server["batch_fill"] <= 1 and server["ms_per_step"] > 0, run
    for system in ("torchserve", "torchserve_continuous"):
        whole = results["extra"][f"{system}_metrics"]
        rows = [r for r in served if r["system"].replace("-", "_") == system]
        assert whole["requests"] >= sum(r["requests"] for r in rows) > 0


def test_each_process_records_what_it_chose_at_load(smoke):
    """The bench process's and each served worker's load-time decisions, as their loggers wrote them."""
    from scripts.bench.choices import is_decision

    out, results, stdout, _ = smoke
    choices = results["extra"]["load_choices"]
    assert {"bench process", "torchserve", "torchserve-continuous"} <= set(choices)
    for process, lines in choices.items():
        assert all(is_decision(line) for line in lines), process
        assert all(f"{process} chose at load: {line}" in stdout for line in lines), process
    assert "What each process chose at load" in (out / "results.md").read_text()


def test_prompts_have_exact_token_lengths(tokenizer):
    factory = PromptFactory(tokenizer, seed=3)
    for n in (2, 17, 256, 768):
        prompt = factory.make(n)
        assert len(prompt) == n == len(tokenizer(prompt.text)["input_ids"])
        assert prompt.ids == tokenizer(prompt.text)["input_ids"]
    assert factory.make(64).text != factory.make(64).text


# -- the client adapters against a fake server speaking each protocol ---------------------------

class FakeServer(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"
    bodies = []

    def log_message(self, *args):
        pass

    def do_POST(self):
        body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        FakeServer.bodies.append((self.path, body))
        self.send_response(200)
        self.send_header("Transfer-Encoding", "chunked")
        self.end_headers()
        if self.path.startswith("/predictions/"):
            n = body["parameters"]["max_new_tokens"]
            events = [{"token": {"id": 5, "text": "a", "logprob": 0.0, "special": False}} for _ in range(n)]
            events[-1].update(generated_text="a" * n, details={"finish_reason": "length", "generated_tokens": n})
            lines = [json.dumps(e) + "\n" for e in events]
        elif self.path == "/completion":
            n = body["n_predict"]
            assert body["stream"] is True and body["ignore_eos"] is True and isinstance(body["prompt"], list)
            lines = [f"data: {json.dumps({'content': 'a', 'stop': False})}\n\n" for _ in range(n)]
            lines.append(f"data: {json.dumps({'content': '', 'stop': True, 'tokens_predicted': n, 'stop_type': 'limit'})}\n\n")
        else:
            n = body["max_tokens"]
            assert body["stream"] is True and body["ignore_eos"] is True and isinstance(body["prompt"], list)
            lines = [f"data: {json.dumps({'choices': [{'index': 0, 'text': 'a', 'finish_reason': None}]})}\n\n"
                     for _ in range(n - 1)]
            lines.append(f"data: {json.dumps({'choices': [{'index': 0, 'text': 'a', 'finish_reason': 'length'}]})}\n\n")
            lines.append(f"data: {json.dumps({'choices': [], 'usage': {'completion_tokens': n}})}\n\n")
            lines.append("data: [DONE]\n\n")
        for line in lines:
            data = line.encode()
            self.wfile.write(b"%x\r\n%s\r\n" % (len(data), data))
            self.wfile.flush()
            time.sleep(0.005)
        self.wfile.write(b"0\r\n\r\n")


@pytest.fixture(scope="module")
def fake_server():
    with loopback_server(FakeServer) as url:
        yield url


@pytest.mark.parametrize("make", [lambda url: TorchServeAdapter(url, "m", {"Authorization": "Bearer k"}),
                                  LlamaServerAdapter, lambda url: OpenAICompletionsAdapter(url, "m")],
                         ids=["torchserve", "llama-server", "vllm"])
def test_adapters_time_every_token_of_a_stream(fake_server, make):
    adapter = make(fake_server)
    prompts = [Prompt(" a b c", [1, 5, 6, 7]) for _ in range(3)]
    records = run_wave(adapter, prompts, 6, timeout=30)
    for r in records:
        assert r.ok, r.error
        assert r.output_tokens == 6 and len(r.token_times) == 6
        assert r.finish_reason in ("length", "limit")
        assert 0 < r.ttft < r.e2e and len(r.itls()) == 5 and all(g >= 0 for g in r.itls())
        assert r.e2e - r.ttft >= 0.015  # tokens were timed as they arrived, not all at the end
    records = run_schedule(adapter, [(0.0, prompts[0], 2), (0.05, prompts[1], 3)], timeout=30)
    assert [r.output_tokens for r in records] == [2, 3] and all(r.ok for r in records)


FAKE_LLAMA_SERVER = '''#!{python}
"""A stand-in for llama.cpp's llama-server: /health and a streaming /completion."""
import json, sys, time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

class H(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"
    def log_message(self, *a):
        pass
    def do_GET(self):
        self.send_response(200 if self.path == "/health" else 404)
        self.send_header("Content-Length", "0")
        self.end_headers()
    def do_POST(self):
        body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        self.send_response(200)
        self.send_header("Transfer-Encoding", "chunked")
        self.end_headers()
        n = body["n_predict"]
        events = [{{"content": "x", "stop": False}}] * n + [{{"content": "", "stop": True, "tokens_predicted": n}}]
        for e in events:
            data = ("data: " + json.dumps(e) + "\\n\\n").encode()
            self.wfile.write(b"%x\\r\\n%s\\r\\n" % (len(data), data))
            self.wfile.flush()
            time.sleep(0.002)
        self.wfile.write(b"0\\r\\n\\r\\n")

port = int(sys.argv[sys.argv.index("--port") + 1])
assert "-m" in sys.argv and "-np" in sys.argv
ThreadingHTTPServer(("127.0.0.1", port), H).serve_forever()
'''


def test_peer_is_detected_started_driven_and_stopped_by_pid(tmp_path, monkeypatch):
    from scripts.bench.systems import LlamaCppSystem, VllmSystem

    gguf = fake_llama_server(tmp_path, monkeypatch)
    missing = LlamaCppSystem(tmp_path / "w0", "bfloat16", 2, 8, 1024, gguf=tmp_path / "absent.gguf")
    found, detail = missing.detect()
    assert not found and detail.startswith("not installed") and str(tmp_path / "absent.gguf") in detail

    peer = LlamaCppSystem(tmp_path / "w1", "bfloat16", 2, 8, 1024, gguf=gguf)
    assert peer.detect()[0]
    adapter = peer.start(timeout=30)
    try:
        records = run_wave(adapter, [Prompt(" a", [1, 5])] * 2, 5, timeout=30)
        assert all(r.ok and r.output_tokens == 5 and len(r.token_times) == 5 for r in records)
    finally:
        pid = peer.pid
        peer.stop()
    with pytest.raises(ProcessLookupError):
        os.killpg(pid, 0)

    vllm = VllmSystem(tmp_path / "w2", tmp_path, "bfloat16", 8, 1024, venv=tmp_path / "no-venv")
    found, detail = vllm.detect()
    assert not found and detail.startswith("not installed")


def fake_llama_server(tmp_path, monkeypatch) -> Path:
    """A stand-in llama-server first on PATH; returns its GGUF's path (created)."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    server = bin_dir / "llama-server"
    server.write_text(FAKE_LLAMA_SERVER.format(python=sys.executable))
    server.chmod(0o755)
    monkeypatch.setenv("PATH", f"{bin_dir}:{os.environ['PATH']}")
    gguf = tmp_path / "bench.gguf"
    gguf.write_bytes(b"GGUF")
    return gguf


def test_a_peer_whose_port_was_taken_starts_again_on_another(tmp_path, monkeypatch):
    import socket

    from scripts import tsctl
    from scripts.bench.systems import LlamaCppSystem, PortTaken

    gguf = fake_llama_server(tmp_path, monkeypatch)
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        real_free_port = tsctl.free_port
        monkeypatch.setattr(tsctl, "free_port", lambda: port)
        always_taken = LlamaCppSystem(tmp_path / "w0", "bfloat16", 2, 8, 1024, gguf=gguf)
        always_taken.detect()
        with pytest.raises(PortTaken, match="exited with 1"):
            always_taken.start(timeout=30, attempts=2)

        chosen = iter([port])
        monkeypatch.setattr(tsctl, "free_port", lambda: next(chosen, None) or real_free_port())
        peer = LlamaCppSystem(tmp_path / "w1", "bfloat16", 2, 8, 1024, gguf=gguf)
        peer.detect()
        try:
            adapter = peer.start(timeout=30)
            assert peer.port != port
            records = run_wave(adapter, [Prompt(" a", [1, 5])], 3, timeout=30)
            assert records[0].ok and records[0].output_tokens == 3
        finally:
            peer.stop()


def emulated_smoke(cpu_class: str, tiny_model_dir, tmp_path):
    """A smoke bench of the in-process engine and TorchServe as a CPU of ``cpu_class``, its page at
    ``tmp_path / "page.md"``: its output directory and results."""
    out = tmp_path / "bench"
    proc = subprocess.run([sys.executable, "-m", "scripts.bench", "--smoke", "--cpu-class", cpu_class, "--out", str(out),
                           "--tiny", str(tiny_model_dir), "--systems", "inprocess,torchserve",
                           "--scenarios", "concurrency", "--docs", str(tmp_path / "page.md")],
                          cwd=ROOT, env=host_env(), capture_output=True, text=True, timeout=480,
                          start_new_session=True)
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-4000:]
    return out, json.loads((out / "latest.json").read_text())


def test_smoke_as_an_avx2_cpu_serves_with_that_classs_dtype_and_kernels(smoke, tiny_model_dir, tmp_path):
    """--cpu-class avx2 on a newer CPU: the bench, and the TorchServe worker it starts, choose and
    compute as an AVX2-only CPU would, and the run says it was emulated. On an AVX2-only CPU the
    module's own smoke run is such a run, unemulated: its figures are checked the same way."""
    from llama_engine import cpu

    host = cpu.cpu_class(cpu.host_cpu_flags())
    if cpu.CLASSES.index(host) < cpu.CLASSES.index("avx2"):
        pytest.skip(f"this CPU ({host}) has no AVX2 to run an avx2 CPU's instructions")
    if host == "avx2":
        out, results = smoke[0], smoke[1]
    else:
        out, results = emulated_smoke("avx2", tiny_model_dir, tmp_path)
    machine = results["machine"]
    assert (machine["cpu_class"], machine["auto_dtype"], machine["torch_cpu_capability"]) == ("avx2", "float32", "AVX2")
    assert not {"avx512f", "avx512_bf16", "amx_bf16"} & set(machine["cpu_flags"])
    assert results["systems"]["torchserve"]["status"] == "ok"
    assert any(r["system"] == "torchserve" and r["ok"] for r in results["runs"])
    log = read_log(out / "work" / "torchserve", "model_log")
    assert re.search(r"native CPU kernels: avx2 \(", log), "the worker did not load the avx2 build"
    if host != "avx2":
        assert machine["emulated_on"] == host
        assert machine["emulation_env"]["ONEDNN_MAX_CPU_ISA"] == "AVX2"
        assert "LLAMA_CPU_CLASS=avx2: choosing as a CPU of class avx2 would" in log
        assert f"(CPU class `avx2 (emulated on {host})`)" in (out / "results.md").read_text()
        page = (tmp_path / "page.md").read_text()
        assert page.startswith("# Benchmarks\n\n**An emulated CPU class.** This run computed as an `avx2` CPU would")
        assert "`ONEDNN_MAX_CPU_ISA=AVX2`" in page
        assert list(json.loads((tmp_path / "page-by-cpu.json").read_text())) == [f"avx2 (emulated on {host})"]
    else:
        assert "emulated_on" not in machine


def test_smoke_as_a_cpu_without_avx2_serves_on_torchs_kernels_alone(tiny_model_dir, tmp_path):
    """--cpu-class other on any AVX2 CPU: a CPU without AVX2 gets float32, no native kernels (they need AVX2 and
    FMA) and torch's baseline kernels, in the bench and in the TorchServe worker it starts, and its page says so."""
    from llama_engine import cpu

    host = cpu.cpu_class(cpu.host_cpu_flags())
    if host == "other":
        pytest.skip("this CPU has no AVX2: every run here is a run of the class, unemulated")
    out, results = emulated_smoke("other", tiny_model_dir, tmp_path)
    machine = results["machine"]
    assert (machine["cpu_class"], machine["auto_dtype"], machine["torch_cpu_capability"]) == \
        ("other", "float32", "DEFAULT")
    assert not {"avx2", "avx512f", "amx_bf16"} & set(machine["cpu_flags"])
    assert machine["emulated_on"] == host
    assert (machine["emulation_env"]["MKL_ENABLE_INSTRUCTIONS"], machine["emulation_env"]["ONEDNN_MAX_CPU_ISA"]) == \
        ("SSE4_2", "SSE41")
    assert results["systems"]["torchserve"]["status"] == "ok"
    assert any(r["system"] == "torchserve" and r["ok"] for r in results["runs"])
    log = read_log(out / "work" / "torchserve", "model_log")
    assert "native CPU kernels: none for this CPU (needs AVX2 and FMA); torch's kernels" in log
    assert "LLAMA_CPU_CLASS=other: choosing as a CPU of class other would" in log
    page = (tmp_path / "page.md").read_text()
    assert page.startswith("# Benchmarks\n\n**An emulated CPU class.** This run computed as an `other` CPU would")
