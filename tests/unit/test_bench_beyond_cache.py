"""scripts/bench/beyond_cache.py: the model it sizes against the cache, and one real run of both backends on a
model small enough for a test (it prints figures; only what it computes from them is checked)."""
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from scripts.bench import beyond_cache

ROOT = Path(__file__).resolve().parents[2]


def test_a_layer_of_the_default_shape_and_the_layers_for_four_times_the_cache():
    assert beyond_cache.layer_bytes(2048, 5632) == (4 * 2048 * 2048 + 3 * 2048 * 5632) * 2 == 102_760_448
    assert beyond_cache.layers_for(260 << 20, 4.0, 2048, 5632) == 11  # 1.13 GB against 1.09 GB
    assert beyond_cache.layers_for(32 << 20, 4.0, 2048, 5632) == 2
    assert beyond_cache.layers_for(1, 4.0, 2048, 5632) == 1


def test_unknown_backends_and_too_long_waves_are_refused(capsys):
    with pytest.raises(SystemExit):
        beyond_cache.parse_args(["--backends", "torch,onnx"])
    assert "--backends: unknown onnx (torch, llamacpp, torchserve, torchserve-llamacpp, llama-server)" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        beyond_cache.parse_args(["--prompt", "1000", "--tokens", "48"])
    assert "max_length (1024)" in capsys.readouterr().err


def test_a_run_measures_each_backend_on_the_model_it_built(tiny_model_dir, tmp_path):
    """Both backends in this process, the handler served by a real TorchServe, and llama-server where
    `make bench-peers` built it (else a skip line)."""
    out = tmp_path / "figures.json"
    hidden, intermediate, layers = 64, 128, 2
    run = subprocess.run([sys.executable, "-m", "scripts.bench.beyond_cache", "--hidden", str(hidden),
                          "--intermediate", str(intermediate), "--heads", "2", "--layers", str(layers),
                          "--streams", "1,3", "--rounds", "2", "--tokens", "6", "--prompt", "24", "--membw-gb", "0.05",
                          "--tokenizer", str(tiny_model_dir), "--root", str(tmp_path / "model"), "--out", str(out)],
                         cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert run.returncode == 0, run.stderr[-3000:]
    figures = json.loads(out.read_text())
    assert figures["spec"]["num_hidden_layers"] == layers and figures["spec"]["hidden_size"] == hidden
    assert figures["streams"] == [1, 3]
    config = json.loads((tmp_path / "model" / "bench-model-bf16" / "config.json").read_text())
    # every weight but the input embedding, read once a step: the layers, the final norm, the LM head
    streamed = layers * (4 * hidden * hidden + 3 * hidden * intermediate + 2 * hidden) + hidden + config["vocab_size"] * hidden
    served = "llama-server" in figures["backends"]
    assert served or "llama-server: skipped, not installed" in run.stdout
    assert set(figures["backends"]) == {"torch", "llamacpp", "torchserve", "torchserve-llamacpp"} | (
        {"llama-server"} if served else set())
    for name, got in figures["backends"].items():
        assert got["weight_bytes_per_token"] == 2 * (streamed + hidden), name  # bf16 weights, f16 GGUF: 2 bytes
        assert set(got["streams"]) == {"1", "3"}
        for n, at in got["streams"].items():
            assert len(at["rounds"]) == 2
            for round_ in at["rounds"]:
                mean_bandwidth = sum(round_["bandwidth_gb_per_s"]) / 2
                assert round_["decode_tokens_per_s"] > 0 and round_["output_tokens_per_s"] > 0
                steps_per_s = round_["decode_tokens_per_s"] / int(n)  # a step of n rows reads the weights once
                assert round_["efficiency"] == pytest.approx(
                    steps_per_s * got["weight_bytes_per_token"] / (mean_bandwidth * 1e9), abs=1e-4)  # 4 decimals
            assert at["efficiency_median"] == pytest.approx(sum(r["efficiency"] for r in at["rounds"]) / 2)
            assert f"{name} ({got['runs']}), {n} stream(s): decode" in run.stdout
    assert figures["backends"]["llamacpp"]["runs"].startswith("llama.cpp in-process over a ")
    assert list((tmp_path / "model").glob("gguf-*/model.gguf"))
    assert figures["backends"]["torchserve"]["runs"].startswith("TorchServe, the torch backend, micro-batching")
    gguf = figures["backends"]["llamacpp"]["runs"].split()[-2]  # "llama.cpp in-process over a f16 GGUF"
    # the served llamacpp worker's thread choice is in the figures and printed (it decides a one-stream step)
    choice = [c for c in figures["backends"]["torchserve-llamacpp"]["load_choices"] if c.startswith("decode_threads")]
    assert len(choice) == 1 and f"torchserve-llamacpp chose at load: {choice[0]}" in run.stdout
    assert isinstance(figures["backends"]["torchserve"]["load_choices"], list)
    assert "load_choices" not in figures["backends"]["torch"]
    assert figures["backends"]["torchserve-llamacpp"]["runs"] == \
        f"TorchServe, the llamacpp backend, continuous batching, over a {gguf} GGUF"
    if served:
        assert "torchserve / llama-server, 3 stream(s): decode" in run.stdout


def test_a_run_as_an_avx2_cpu_computes_as_one_and_files_its_figures_apart(tiny_model_dir, tmp_path):
    """The README's ``--cpu-class avx2``: the torch rows (in-process and served) get that class's dtype,
    llama-cpp-python (built for this host) is skipped with why, llama-server runs its AVX2 build where
    `make bench-peers BENCH_PEERS=llama-avx2` built it, and the figures say which CPU was under it and
    land beside, not over, a native run's."""
    from llama_engine import cpu

    host = cpu.cpu_class(cpu.host_cpu_flags())
    if cpu.CLASSES.index(host) < cpu.CLASSES.index("avx2"):
        pytest.skip(f"this CPU ({host}) has no AVX2 to run an avx2 CPU's instructions")
    env = {k: v for k, v in os.environ.items() if k not in cpu.EMULATION_VARS}
    run = subprocess.run([sys.executable, "-m", "scripts.bench.beyond_cache", "--cpu-class", "avx2", "--hidden", "64",
                          "--intermediate", "128", "--heads", "2", "--layers", "1", "--streams", "2", "--rounds", "1",
                          "--tokens", "4", "--prompt", "16", "--membw-gb", "0.05", "--tokenizer", str(tiny_model_dir),
                          "--root", str(tmp_path / "model"), "--out", str(tmp_path / "figures.json")],
                         cwd=tmp_path, env=env, capture_output=True, text=True, timeout=600)
    assert run.returncode == 0, run.stderr[-3000:]
    emulated = host != "avx2"
    figures = json.loads((tmp_path / "figures.json").read_text())
    assert beyond_cache.figures_name(figures["machine"]) == (f"avx2-on-{host}" if emulated else "avx2")
    assert figures["cpu_class"] == figures["machine"]["cpu_class"] == "avx2"
    assert figures["machine"]["auto_dtype"] == "float32"
    assert figures["machine"].get("emulated_on") == (host if emulated else None)
    assert f"CPU class avx2{f' (emulated on {host})' if emulated else ''}" in run.stdout
    if emulated:
        assert figures["machine"]["emulation_env"]["ATEN_CPU_CAPABILITY"].lower() == "avx2"
        for system in ("llamacpp", "torchserve-llamacpp"):
            assert f"{system}: skipped, llama-cpp-python is built for this host's instruction set" in run.stdout
    for system in ("torch", "torchserve"):
        assert "float32 arithmetic over bfloat16 weights" in figures["backends"][system]["runs"], system
    peer = figures["backends"].get("llama-server")
    assert peer or "llama-server: skipped, not installed" in run.stdout
    if peer and emulated:
        assert "avx2" in peer["runs"], peer["runs"]  # the AVX2 build's binary, not the host's


def test_llama_server_not_built_is_skipped_with_the_fix(monkeypatch, tmp_path, capsys):
    from scripts.bench import systems

    monkeypatch.setattr(systems.LlamaCppSystem, "detect", lambda self: (False, "not installed (no llama-server)"))
    monkeypatch.setattr(beyond_cache, "gguf_copy", lambda checkpoint, out: (tmp_path, "f16"))
    args = beyond_cache.parse_args(["--backends", "llama-server", "--root", str(tmp_path)])
    assert beyond_cache.load_backends(args, tmp_path, tmp_path, {}) == {}
    assert "llama-server: skipped, not installed (no llama-server) (make bench-peers)" in capsys.readouterr().out


def test_the_report_gives_each_backend_over_llama_server_at_each_stream_count(capsys):
    def at(decode, output):
        return {"decode_tokens_per_s_median": decode, "output_tokens_per_s_median": output,
                "efficiency_median": 0.5, "efficiency_vs_best_bandwidth": 0.4}

    results = {"torch": {"runs": "torch", "streams": {"1": at(30.0, 20.0), "8": at(120.0, 60.0)}},
               "llama-server": {"runs": "llama-server", "streams": {"1": at(20.0, 10.0), "8": at(100.0, 80.0)}}}
    beyond_cache.report(results, rounds=5)
    printed = capsys.readouterr().out
    assert "torch / llama-server, 1 stream(s): decode 1.50x, output 2.00x" in printed
    assert "torch / llama-server, 8 stream(s): decode 1.20x, output 0.75x" in printed
    assert "llama-server / llama-server" not in printed
    beyond_cache.report({"torch": results["torch"]}, rounds=5)
    assert "/ llama-server" not in capsys.readouterr().out


def test_the_gguf_is_converted_again_for_another_checkpoint(tmp_path, monkeypatch):
    """A model rebuilt with another spec must not decode through the GGUF of the one before."""
    from scripts.bench.model import SPEC_FILE

    conversions = []

    def convert(command, **_):
        conversions.append(command)
        Path(command[command.index("--outfile") + 1]).write_bytes(b"GGUF")
        return subprocess.CompletedProcess(command, 0, "", "")

    from scripts import build_model

    tree = tmp_path / "llama.cpp"
    tree.mkdir()
    (tree / "convert_hf_to_gguf.py").write_text("")
    monkeypatch.setenv("LLAMA_CPP_TREE", str(tree))
    monkeypatch.setattr(build_model.subprocess, "run", convert)
    checkpoint = tmp_path / "checkpoint"
    checkpoint.mkdir()
    (checkpoint / "config.json").write_text("{}")
    (checkpoint / "model.safetensors").write_bytes(b"weights")
    (checkpoint / SPEC_FILE).write_text('{"spec": 1}')
    monkeypatch.setattr("scripts.build_model.gguf_outtype", lambda gguf_type, path: "f16")
    out, outtype = beyond_cache.gguf_copy(checkpoint, tmp_path / "gguf")
    assert (out.name, outtype) == ("gguf-f16", "f16") and (out / "model.gguf").read_bytes() == b"GGUF"
    assert not (out / "model.safetensors").exists() and (out / "config.json").exists()
    beyond_cache.gguf_copy(checkpoint, tmp_path / "gguf")
    assert len(conversions) == 1
    (checkpoint / SPEC_FILE).write_text('{"spec": 2}')
    beyond_cache.gguf_copy(checkpoint, tmp_path / "gguf")
    assert len(conversions) == 2 and (out / SPEC_FILE).read_text() == '{"spec": 2}'
