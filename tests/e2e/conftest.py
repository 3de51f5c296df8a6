"""A real TorchServe for the end-to-end tests (after vLLM's RemoteOpenAIServer).

The archive is built into a temporary model store; the server gets free ports, its own
work directory and TMPDIR, is polled on /ping until the model is READY (failing fast if
the process died), and is always stopped by PID.
"""
from __future__ import annotations

from pathlib import Path

import pytest
import requests
import yaml

from scripts import build_model
from scripts.tsctl import TorchServe, running

ROOT = Path(__file__).resolve().parents[2]

MODEL = "tiny-llama"
CONTINUOUS = "tiny-llama-continuous"


class Client:
    def __init__(self, server: TorchServe, model: str = MODEL):
        self.server = server
        self.url = f"{server.url()}/predictions/{model}"

    @property
    def auth(self) -> dict:
        return {"Authorization": f"Bearer {self.server.key}"}

    def post(self, body, content_type="application/json", stream=True, **kwargs):
        headers = {**self.auth, "Content-Type": content_type}
        data = body if isinstance(body, (bytes, str)) else __import__("json").dumps(body)
        return requests.post(self.url, data=data, headers=headers, stream=stream, timeout=300, **kwargs)


# The batching scenario: a frontend batch of 8 split into two micro-batches of 4.
TEST_CONFIG = {"batchSize": 8, "maxBatchDelay": 200, "micro_batching": {"micro_batch_size": 4}}


def serve_variant(work: Path, model: str, checkpoint: Path, edit):
    """Build ``model-config/<model>.yaml`` changed by ``edit(data)`` into ``work`` and serve it.

    A context manager yielding the ready TorchServe (free ports, stopped by PID on exit).
    """
    data = yaml.safe_load((ROOT / "model-config" / f"{model}.yaml").read_text())
    edit(data)
    config = work / f"{model}.yaml"
    config.write_text(yaml.safe_dump(data))
    build_model.main(["--config", str(config), "--checkpoint", str(checkpoint), "--name", model,
                      "--build-dir", str(work / "build"), "--export-path", str(work / "store")])
    return running(work / "ts", work / "store", models=model)


def burst_statuses(server: TorchServe, model: str, prompt: str, n: int = 10) -> list:
    """Send ``n`` long non-streaming requests at the same instant; return their HTTP statuses."""
    import threading

    url = f"{server.url()}/predictions/{model}"
    headers = {"Authorization": f"Bearer {server.key}"}
    statuses = [None] * n
    barrier = threading.Barrier(n)

    def worker(i):
        barrier.wait()
        r = requests.post(url, json={"inputs": prompt, "stream": False, "parameters": {"max_new_tokens": 200}},
                          headers=headers, timeout=300)
        statuses[i] = r.status_code

    threads = [threading.Thread(target=worker, args=(i,)) for i in range(n)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=300)
    return statuses


def write_test_config(path: Path) -> Path:
    data = yaml.safe_load((ROOT / "model-config" / f"{MODEL}.yaml").read_text())
    data.update({k: v for k, v in TEST_CONFIG.items() if k != "micro_batching"})
    data["micro_batching"].update(TEST_CONFIG["micro_batching"])
    path.write_text(yaml.safe_dump(data))
    return path


@pytest.fixture(scope="session")
def model_store(tiny_model_dir, tmp_path_factory) -> Path:
    work = tmp_path_factory.mktemp("archive")
    config = write_test_config(work / f"{MODEL}.yaml")
    build_model.main(["--config", str(config), "--checkpoint", str(tiny_model_dir), "--name", MODEL,
                      "--build-dir", str(work / "build"), "--export-path", str(work / "store")])
    return work / "store"


@pytest.fixture(scope="session")
def server(model_store, tmp_path_factory):
    with running(tmp_path_factory.mktemp("torchserve"), model_store, models=MODEL) as ts:
        yield ts


@pytest.fixture(scope="session")
def client(server) -> Client:
    return Client(server)


#: Slots of the session's continuous server (:func:`continuous_server`); tests that fill them read it here.
CONTINUOUS_SLOTS = 8


def shared_continuous(data):
    data.update(batchSize=CONTINUOUS_SLOTS)
    data["handler"]["torch_threads"] = 1


@pytest.fixture(scope="session")
def continuous_server(tiny_model_dir, tmp_path_factory):
    """``tiny-llama-continuous`` with :data:`CONTINUOUS_SLOTS` slots on one torch thread, shared by the modules
    that only send it requests (a module that kills its worker or counts its metrics serves its own)."""
    with serve_variant(tmp_path_factory.mktemp("continuous"), CONTINUOUS, tiny_model_dir, shared_continuous) as ts:
        yield ts
