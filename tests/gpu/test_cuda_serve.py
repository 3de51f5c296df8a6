"""Through a real TorchServe on a CUDA GPU: the shipped tiny configs, built as ``make build`` builds them
(``device: auto``), stream each concurrent request its own greedy tokens, which are the CPU's.

Skipped without a CUDA device (``tests/conftest.py``).
"""
from __future__ import annotations

import json
import re
import threading
from pathlib import Path

import pytest
import requests

from llama_engine import Engine, GenerationRequest, SamplingParams
from llama_engine.config import HandlerConfig
from scripts import build_model
from scripts.tsctl import running

ROOT = Path(__file__).resolve().parents[2]
NEW_TOKENS = 12
PROMPTS = [
    "The function returns", "If the object is", "A list of", "The default value is",
    "When the file", "This module provides", "Return the number of", "An exception is raised",
]


@pytest.fixture(scope="module")
def cpu_results(tiny_model_dir):
    """Each prompt's greedy generation on the CPU in float32, as the tiny configs ship."""
    cfg = HandlerConfig(model_path=tiny_model_dir.name, max_length=256, max_new_tokens=NEW_TOKENS, dtype="float32",
                        device="cpu")
    engine = Engine.from_config(cfg, str(tiny_model_dir.parent), batch_size=len(PROMPTS))
    batch = [engine.prepare(GenerationRequest(p, SamplingParams(max_new_tokens=NEW_TOKENS))) for p in PROMPTS]
    return engine.generate(batch)


@pytest.fixture(scope="module", params=["tiny-llama", "tiny-llama-continuous"])
def gpu_server(request, tiny_model_dir, tmp_path_factory):
    model = request.param
    work = tmp_path_factory.mktemp(model)
    build_model.main(["--config", str(ROOT / "model-config" / f"{model}.yaml"), "--checkpoint", str(tiny_model_dir),
                      "--name", model, "--build-dir", str(work / "build"), "--export-path", str(work / "store")])
    with running(work / "ts", work / "store", models=model) as server:
        yield model, server


def stream(server, model: str, prompt: str) -> list:
    r = requests.post(f"{server.url()}/predictions/{model}", headers=server.auth_headers(), stream=True, timeout=300,
                      json={"inputs": prompt, "parameters": {"max_new_tokens": NEW_TOKENS}})
    assert r.status_code == 200, r.text
    return [json.loads(line) for line in r.iter_lines() if line]


def test_torchserve_on_the_gpu_streams_each_concurrent_request_the_cpus_greedy_tokens(gpu_server, cpu_results):
    model, server = gpu_server
    streams, errors = [None] * len(PROMPTS), []
    barrier = threading.Barrier(len(PROMPTS))

    def client(i):
        try:
            barrier.wait()
            streams[i] = stream(server, model, PROMPTS[i])
        except Exception as exc:  # noqa: BLE001 - collected for the main thread, which asserts none
            errors.append(exc)

    threads = [threading.Thread(target=client, args=(i,)) for i in range(len(PROMPTS))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=300)
    assert not errors, errors
    for prompt, lines, want in zip(PROMPTS, streams, cpu_results):
        assert [line["token"]["id"] for line in lines] == want.token_ids, prompt
        assert lines[-1]["generated_text"] == "".join(line["token"]["text"] for line in lines) == want.text, prompt
    assert re.search(r"KV cache in torch\.float32 on cuda", server.model_log()), server.log_tail()
