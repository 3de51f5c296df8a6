"""The Neuron path through a real TorchServe, with the Neuron SDK test double in the worker:
the artifact loads with 0 compiles from a read-only store, streams, and the shape contract
reaches the client as 4xx. The smoke script that `make neuron-smoke` runs passes too, and
the sequence it used to run (build in its own process, then TorchServe) fails, because a
NeuronCore belongs to one process until it exits."""
from __future__ import annotations

import json
import os
import re
import subprocess
import sys

import pytest
import requests

from scripts.tsctl import TorchServe, free_ports, running

from conftest import ROOT, build_model
from neuron_env import neuron_double, subprocess_env
from readonly import guarded_read_only_view

MODEL = "tiny-llama-neuron"
CONFIG = ROOT / "model-config" / f"{MODEL}.yaml"


@pytest.fixture(scope="module")
def neuron_store(tiny_model_dir, tmp_path_factory):
    work = tmp_path_factory.mktemp("neuron")
    with neuron_double(NEURON_COMPILE_CACHE_URL=str(work / "unused-cache")):
        build_model.main(["--config", str(CONFIG), "--checkpoint", str(tiny_model_dir), "--name", MODEL,
                          "--build-dir", str(work / "build"), "--export-path", str(work / "store")])
    return work / "store"


@pytest.fixture(scope="module")
def neuron_server(neuron_store, tmp_path_factory):
    with guarded_read_only_view(neuron_store, tmp_path_factory.mktemp("ro") / "store") as (store, _):
        # A compile at load would take 5 s per graph here, and fail the readiness deadline below.
        with running(tmp_path_factory.mktemp("ts-neuron"), store, models=MODEL, timeout=120,
                     env=subprocess_env(FAKE_NEURON_COMPILE_SECONDS=5)) as ts:
            yield ts


def post(server, body):
    return requests.post(f"{server.url()}/predictions/{MODEL}", json=body, timeout=120, stream=True,
                         headers={"Authorization": f"Bearer {server.key}"})


def test_loads_with_no_compiles(neuron_server):
    reports = re.findall(r"compile cache: (\{.*\})", neuron_server.model_log())
    assert json.loads(reports[-1])["new_entries"] == 0


def test_streams_ndjson(neuron_server):
    r = post(neuron_server, {"inputs": "The function returns", "parameters": {"max_new_tokens": 6}})
    assert r.status_code == 200 and r.headers["content-type"] == "application/x-ndjson"
    lines = [json.loads(line) for line in r.iter_lines() if line]
    assert len(lines) == 6 and lines[-1]["details"]["generated_tokens"] == 6


@pytest.mark.parametrize("body,parameter,limit", [
    ({"inputs": " ".join(["word"] * 80)}, "inputs", "largest compiled context bucket"),
    ({"inputs": "Hello", "parameters": {"max_new_tokens": 300}}, "max_new_tokens", "256"),
])
def test_shape_contract_is_a_400_that_names_the_limit(neuron_server, body, parameter, limit):
    r = post(neuron_server, body)
    assert r.status_code == 400
    error = r.json()
    assert error["parameter"] == parameter and limit in error["error"]


def test_neuron_smoke_script_passes_against_the_double(tiny_model_dir, tmp_path):
    """The build runs as a process of its own and has exited, with its NeuronCores, when
    TorchServe's worker asks for them on the same host (one core registry for all three)."""
    host = tmp_path / "host-cores"
    out = subprocess.run([sys.executable, str(ROOT / "scripts" / "neuron_smoke.py"), "--model", MODEL,
                          "--checkpoint", str(tiny_model_dir), "--workdir", str(tmp_path / "smoke"),
                          "--max-new-tokens", "8"],
                         env=subprocess_env(FAKE_NEURON_CORE_REGISTRY=host), capture_output=True, text=True,
                         timeout=600)
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    report = json.loads((tmp_path / "smoke" / "report.json").read_text())
    assert report["compile_cache"]["new_entries"] == 0
    assert report["stream"]["details"]["generated_tokens"] == 8
    assert {b["concurrency"] for b in report["benchmark"]} == {1, 4}
    assert sorted(p.name for p in host.glob("nc*")) == ["nc0", "nc1"], "the build and the worker took the cores here"


def test_building_in_the_process_that_then_starts_torchserve_fails_on_the_cores(tiny_model_dir, tmp_path):
    """What neuron_smoke did before: the build loads the model onto the cores in this process,
    which lives on, so TorchServe's worker on the same host cannot have them."""
    host = str(tmp_path / "host-cores")
    with neuron_double(NEURON_COMPILE_CACHE_URL=str(tmp_path / "unused-cache"), FAKE_NEURON_CORE_REGISTRY=host):
        build_model.main(["--config", str(CONFIG), "--checkpoint", str(tiny_model_dir), "--name", MODEL,
                          "--build-dir", str(tmp_path / "build"), "--export-path", str(tmp_path / "store")])
    message = load_failure(tmp_path, tmp_path / "store", FAKE_NEURON_CORE_REGISTRY=host)
    assert "Logical Neuron Core(s) not available" in message
    assert f"nc0 (pid {os.getpid()}), nc1 (pid {os.getpid()})" in message


def load_failure(tmp_path, store, **env) -> str:
    """Start TorchServe on ``store`` with ``env``; the model must fail to load, and this is why."""
    ts = TorchServe(tmp_path / "ts", store, models=MODEL, ports=free_ports(), env=subprocess_env(**env))
    try:
        with pytest.raises(RuntimeError) as info:
            ts.start_ready(timeout=120)
    finally:
        ts.stop()
    return str(info.value)


def test_a_changed_compiler_version_fails_the_load_fast_with_the_reason(neuron_store, tmp_path):
    message = load_failure(tmp_path, neuron_store, FAKE_NEURONXCC_VERSION="2.17.0.0")
    assert "neuronx-cc: compiled with 2.16.345.0, installed 2.17.0.0" in message
    assert "make build MODEL=" in message


CONTINUOUS = "tiny-llama-neuron-continuous"


@pytest.fixture(scope="module")
def continuous_server(tiny_model_dir, tmp_path_factory):
    """The continuous-batching Neuron artifact, built and then served read-only with the double."""
    work = tmp_path_factory.mktemp("neuron-cb")
    with neuron_double(NEURON_COMPILE_CACHE_URL=str(work / "unused-cache")):
        build_model.main(["--config", str(ROOT / "model-config" / f"{CONTINUOUS}.yaml"), "--checkpoint",
                          str(tiny_model_dir), "--name", CONTINUOUS, "--build-dir", str(work / "build"),
                          "--export-path", str(work / "store")])
    with guarded_read_only_view(work / "store", work / "ro" / "store") as (store, _):
        with running(work / "ts", store, models=CONTINUOUS, timeout=120,
                     env=subprocess_env(FAKE_NEURON_COMPILE_SECONDS=5)) as ts:
            yield ts


def test_continuous_batching_on_the_double_streams_each_request_its_solo_tokens(continuous_server):
    url = f"{continuous_server.url()}/predictions/{CONTINUOUS}"
    headers = {"Authorization": f"Bearer {continuous_server.key}"}
    prompts = [("The function returns", 12), ("If the object is", 4), ("A list of", 9), ("When the file", 6),
               ("This module provides", 7)]

    def ids(prompt, n):
        r = requests.post(url, json={"inputs": prompt, "parameters": {"max_new_tokens": n}}, headers=headers,
                          stream=True, timeout=120)
        assert r.status_code == 200
        return [json.loads(line)["token"]["id"] for line in r.iter_lines() if line]

    solo = [ids(p, n) for p, n in prompts]
    from concurrent.futures import ThreadPoolExecutor

    with ThreadPoolExecutor(len(prompts)) as pool:  # 5 requests over 4 slots: one waits, then takes a freed slot
        together = list(pool.map(lambda pn: ids(*pn), prompts))
    assert together == solo
    reports = re.findall(r"compile cache: (\{.*\})", continuous_server.model_log())
    assert json.loads(reports[-1])["new_entries"] == 0
