"""A real TorchServe for the end-to-end tests (after vLLM's RemoteOpenAIServer).

The archive is built into a temporary model store; the server gets free ports, its own
work directory and TMPDIR, is polled on /ping until the model is READY (failing fast if
the process died), and is always stopped by PID.
"""
from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest
import requests

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "scripts"))

import build_archive  # noqa: E402
from tsctl import TorchServe, free_port  # noqa: E402

MODEL = "tiny-llama"


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


@pytest.fixture(scope="session")
def model_store(tiny_model_dir, tmp_path_factory) -> Path:
    work = tmp_path_factory.mktemp("archive")
    build_archive.main(["--name", MODEL, "--config", str(ROOT / "model-config" / f"{MODEL}.yaml"),
                        "--model-dir", str(tiny_model_dir), "--export-path", str(work / "store"),
                        "--stage-dir", str(work / "stage")])
    return work / "store"


@pytest.fixture(scope="session")
def server(model_store, tmp_path_factory):
    ports = {"inference": free_port(), "management": free_port(), "metrics": free_port()}
    ts = TorchServe(tmp_path_factory.mktemp("torchserve"), model_store, models=MODEL, ports=ports)
    ts.start()
    try:
        ts.ready_seconds = ts.wait_ready(timeout=300)
        yield ts
    finally:
        ts.stop()


@pytest.fixture(scope="session")
def client(server) -> Client:
    return Client(server)
