"""The README's serving commands, run through the real Makefile: `make demo`, `make stream`,
`make stop` with MODEL naming non-default models (one, and a comma list; the llamacpp backend's
among them, which the build converts to GGUF), `tsctl health`.

The server gets free loopback ports (``SERVE_ARGS=--free-ports``) and its own store and work
directory, so a developer's own `make serve` on 8080 is neither needed nor disturbed.
"""
from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import requests

from scripts.tsctl import read_key, read_log, read_properties

ROOT = Path(__file__).resolve().parents[2]

MODELS = ("tiny-llama-continuous", "tiny-llama", "tiny-llama-llamacpp")


def make(*args: str, timeout: float = 600) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if not k.startswith("MAKE")}
    return subprocess.run(["make", "--no-print-directory", "-C", str(ROOT), *args], capture_output=True,
                          text=True, timeout=timeout, env=env)


@pytest.fixture(scope="module")
def served(tmp_path_factory, tiny_model_dir):
    """`make demo MODEL=tiny-llama-continuous,tiny-llama,tiny-llama-llamacpp`, stopped by `make stop` afterwards."""
    work = tmp_path_factory.mktemp("make-serve")
    where = [f"STORE={work / 'store'}", f"SERVE_DIR={work / 'serve'}", "SERVE_ARGS=--free-ports",
             f"CHECKPOINT={tiny_model_dir}"]
    demo = make("demo", f"MODEL={','.join(MODELS)}", "PROMPT=Once upon a time", *where)
    try:
        yield demo, work / "serve", where
    finally:
        stopped = make("stop", *where)
        assert "torchserve stopped" in stopped.stdout, stopped.stdout + stopped.stderr


def test_make_demo_serves_and_streams_every_model_named(served):
    demo, workdir, _ = served
    assert demo.returncode == 0, demo.stdout[-3000:] + demo.stderr[-3000:]
    load_models = read_properties(workdir / "config.properties")["load_models"]
    assert load_models.split(",") == list(MODELS)
    for model in MODELS:
        assert f"--- {model}: streaming with curl -N" in demo.stdout
    # curl's NDJSON lines and stream.py's summary, once per model
    assert demo.stdout.count('"finish_reason": "length"') == len(MODELS), demo.stdout[-2000:]
    assert demo.stderr.count("[finish_reason=length") == len(MODELS), demo.stderr[-2000:]


def test_non_default_model_is_addressed_by_its_name(served):
    _, workdir, _ = served
    url = read_properties(workdir / "config.properties")["inference_address"]
    headers = {"Authorization": f"Bearer {read_key(workdir)}"}
    for model in MODELS:
        r = requests.post(f"{url}/predictions/{model}", headers=headers, timeout=60,
                          json={"inputs": "The function returns", "stream": False, "parameters": {"max_new_tokens": 4, "details": True}})
        assert r.status_code == 200, (model, r.text)
        assert r.json()[0]["details"]["generated_tokens"] == 4


def test_make_stream_addresses_the_model_given(served):
    _, _, where = served
    result = make("stream", "MODEL=tiny-llama-continuous", "PROMPT=The function returns", *where, timeout=120)
    assert result.returncode == 0, result.stdout + result.stderr
    assert "--- tiny-llama-continuous" in result.stdout
    assert "[finish_reason=" in result.stderr


def test_health_needs_the_inference_key_and_tsctl_health_carries_it(served):
    _, workdir, _ = served
    url = read_properties(workdir / "config.properties")["inference_address"]
    assert requests.get(f"{url}/ping", timeout=10).status_code == 400  # TorchServe 0.12 with token auth on
    probe = subprocess.run([sys.executable, str(ROOT / "scripts" / "tsctl.py"), "health", "--workdir", str(workdir)],
                           capture_output=True, text=True, timeout=60)
    assert probe.returncode == 0, probe.stderr
    assert probe.stdout.strip() == f"healthy: {','.join(MODELS)}"


def test_make_build_names_the_configs_when_the_model_is_unknown(tmp_path):
    result = make("build", "MODEL=tiny-llama,no-such-model", f"STORE={tmp_path / 'store'}")
    assert result.returncode != 0
    assert "no model-config/no-such-model.yaml; MODEL is one of:" in result.stderr
    assert "tiny-llama-continuous" in result.stderr
    assert not (tmp_path / "store").exists()


def probe_example() -> dict:
    """The Kubernetes probes of docs/operations.md, as a user would paste them."""
    import yaml

    text = (ROOT / "docs" / "operations.md").read_text()
    block = text.split("<!-- probe-example -->", 1)[1].split("```yaml", 1)[1].split("```", 1)[0]
    return yaml.safe_load(block)


def test_the_documented_kubernetes_probes_pass_against_a_served_model(served):
    _, workdir, _ = served
    probes = probe_example()
    for name in ("startupProbe", "readinessProbe"):
        command = [str(workdir) if part == "build/serve" else part for part in probes[name]["exec"]["command"]]
        assert command[-1] == str(workdir), command
        result = subprocess.run(command, cwd=ROOT, capture_output=True, text=True, timeout=60)
        assert result.returncode == 0, (name, result.stderr)
    live = probes["livenessProbe"]["httpGet"]
    metrics = read_properties(workdir / "config.properties")["metrics_address"]
    assert live["port"] == 8082  # config.properties' metrics port; this server's is a free one
    assert requests.get(f"{metrics}{live['path']}", timeout=10).status_code == 200


def test_the_documented_readiness_probe_fails_when_no_server_runs(tmp_path):
    command = probe_example()["readinessProbe"]["exec"]["command"]
    command = [str(tmp_path) if part == "build/serve" else part for part in command]
    result = subprocess.run(command, cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert result.returncode == 1 and "unhealthy" in result.stderr


@pytest.mark.parametrize("target", ["upload", "deploy"])
def test_upload_and_deploy_take_one_model(target):
    result = make(target, "MODEL=tiny-llama,tiny-llama-continuous", "S3_URI=s3://bucket/prefix/")
    assert result.returncode != 0
    assert "this target takes one MODEL, got: tiny-llama,tiny-llama-continuous" in result.stderr


def test_the_llamacpp_worker_learns_its_one_row_thread_count_while_serving(served):
    """``decode_threads: auto``: where the model's threads take every CPU, a stream's steps try both
    counts as served, and the worker log says which it kept; elsewhere every step takes them all."""
    from llama_engine.cpu_limits import usable_cpus

    _, workdir, _ = served
    url = read_properties(workdir / "config.properties")["inference_address"]
    headers = {"Authorization": f"Bearer {read_key(workdir)}"}
    decision = "decode_threads auto: one-row steps as served came every"
    for _ in range(4):  # 3 rounds of 6 one-row steps on each count; a request of n tokens gives n - 2
        r = requests.post(f"{url}/predictions/tiny-llama-llamacpp", headers=headers, timeout=120,
                          json={"inputs": "Once upon a time", "stream": False,
                                "parameters": {"max_new_tokens": 64, "details": True}})
        assert r.status_code == 200, r.text
        if decision in read_log(workdir, "model_log"):
            break
    text = read_log(workdir, "model_log")
    if usable_cpus().count <= 2:  # the config's torch_threads: 2
        assert "decode_threads auto: 2 threads to start; steps of one row as served choose between 2 and 1" in text
        kept = text[text.index(decision):].splitlines()[0]
        # 3 rounds of 6 steps on each count, or fewer where one count's steps came 1.5x as far apart
        assert " ms on 2 threads, " in kept and re.search(r" ms on 1 thread \(medians of (6|12|18)\); ", kept), kept
        assert kept.endswith(("; 1 for one token", "; 2 for one token")), kept
    else:
        assert "decode_threads auto" not in text
