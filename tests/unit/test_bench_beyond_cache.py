"""scripts/bench/beyond_cache.py: the model it sizes against the cache, and one real run of both backends on a
model small enough for a test (it prints figures; only what it computes from them is checked)."""
import json
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
    assert "--backends: unknown onnx" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        beyond_cache.parse_args(["--prompt", "1000", "--tokens", "48"])
    assert "max_length (1024)" in capsys.readouterr().err


def test_a_run_measures_each_backend_on_the_model_it_built(tiny_model_dir, tmp_path):
    """Both backends in this process; llama-server too where `make bench-peers` built it (else a skip line)."""
    out = tmp_path / "figures.json"
    hidden, intermediate, layers = 64, 128, 2
    run = subprocess.run([sys.executable, "-m", "scripts.bench.beyond_cache", "--hidden", str(hidden),
                          "--intermediate", str(intermediate), "--heads", "2", "--layers", str(layers),
                          "--rounds", "2", "--tokens", "6", "--prompt", "24", "--membw-gb", "0.05",
                          "--tokenizer", str(tiny_model_dir), "--root", str(tmp_path / "model"), "--out", str(out)],
                         cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert run.returncode == 0, run.stderr[-3000:]
    figures = json.loads(out.read_text())
    assert figures["spec"]["num_hidden_layers"] == layers and figures["spec"]["hidden_size"] == hidden
    config = json.loads((tmp_path / "model" / "bench-model-bf16" / "config.json").read_text())
    vocab = config["vocab_size"]
    # every weight but the input embedding, read once a token: the layers, the final norm, the LM head
    streamed = layers * (4 * hidden * hidden + 3 * hidden * intermediate + 2 * hidden) + hidden + vocab * hidden
    served = "llama-server" in figures["backends"]
    assert served or "llama-server: skipped, not installed" in run.stdout
    assert set(figures["backends"]) == {"torch", "llamacpp"} | ({"llama-server"} if served else set())
    for name, got in figures["backends"].items():
        assert got["weight_bytes_per_token"] == 2 * (streamed + hidden), name  # bf16 weights, f16 GGUF: 2 bytes
        assert len(got["rounds"]) == 2
        for round_ in got["rounds"]:
            mean_bandwidth = sum(round_["bandwidth_gb_per_s"]) / 2
            assert round_["decode_tokens_per_s"] > 0
            assert round_["efficiency"] == pytest.approx(
                round_["decode_tokens_per_s"] * got["weight_bytes_per_token"] / (mean_bandwidth * 1e9), abs=1e-4)  # 4 decimals
        assert got["efficiency_median"] == pytest.approx(sum(r["efficiency"] for r in got["rounds"]) / 2)
        assert f"{name} (" in run.stdout and "batch-1 decode" in run.stdout
    assert figures["backends"]["llamacpp"]["runs"].startswith("llama.cpp in-process over a ")
    assert list((tmp_path / "model").glob("gguf-*/model.gguf"))


def test_llama_server_not_built_is_skipped_with_the_fix(monkeypatch, tmp_path, capsys):
    from scripts.bench import systems

    monkeypatch.setattr(systems.LlamaCppSystem, "detect", lambda self: (False, "not installed (no llama-server)"))
    monkeypatch.setattr(beyond_cache, "gguf_copy", lambda checkpoint, out: (tmp_path, "f16"))
    args = beyond_cache.parse_args(["--backends", "llama-server", "--root", str(tmp_path)])
    assert beyond_cache.load_backends(args, tmp_path, tmp_path, {}) == {}
    assert "llama-server: skipped, not installed (no llama-server) (make bench-peers)" in capsys.readouterr().out
