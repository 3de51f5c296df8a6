"""The OpenAI-compatible API through both handlers, with TorchServe's real Context and wire encoding.

TorchServe passes the path after ``/predictions/<model>/<version>/`` as the ``url_path``
request header; here it is set the same way, next to TGI requests in one frontend batch.
"""
from __future__ import annotations

import json
import os
import threading

import pytest
import torch
from ts.context import Context, RequestProcessor

import llama_handler

from ts_frontend import ContinuousFrontend, FakeMetrics, decode_message

CHAT, COMPLETIONS, MODELS = "v1/chat/completions", "v1/completions", "v1/models"
MESSAGES = [{"role": "user", "content": "What does a function return?"}]
HANDLER_CONFIG = {"model_path": "model", "max_length": 256, "max_new_tokens": 8, "torch_threads": 1}


class FakeSocket:
    def __init__(self):
        self.messages, self.lock = [], threading.Lock()

    def sendall(self, data):
        with self.lock:
            self.messages.append(bytes(data))


def load(handler, tiny_model_dir, tmp_path_factory, config):
    model_dir = tmp_path_factory.mktemp("modeldir")
    os.symlink(tiny_model_dir, model_dir / "model")
    handler.initialize(Context("tiny", str(model_dir), None, 8, None, "0.12.0", model_yaml_config=config))
    return handler


@pytest.fixture(scope="module")
def micro(tiny_model_dir, tmp_path_factory):
    threads = torch.get_num_threads()
    config = {"batchSize": 8, "handler": HANDLER_CONFIG, "micro_batching": {"micro_batch_size": 2}}
    service = load(llama_handler.LlamaHandler(), tiny_model_dir, tmp_path_factory, config)
    yield service
    service.micro_batching.shutdown()
    torch.set_num_threads(threads)


@pytest.fixture(scope="module")
def continuous(tiny_model_dir, tmp_path_factory):
    threads = torch.get_num_threads()
    config = {"continuousBatching": True, "batchSize": 4, "maxBatchDelay": 1, "handler": HANDLER_CONFIG,
              "continuous_batching": {"max_prefill_tokens_per_step": 64}}
    yield load(llama_handler.ContinuousHandler(), tiny_model_dir, tmp_path_factory, config)
    torch.set_num_threads(threads)


def call_micro(handler, requests):
    """One frontend batch of ``(url_path, body)``; return each request's (status, content type, whole body)."""
    ctx = Context("tiny", "", None, 8, None, "0.12.0")
    ctx.metrics, ctx.cl_socket = FakeMetrics(), FakeSocket()
    ctx.request_ids = {i: f"req-{i}" for i in range(len(requests))}
    ctx.request_processor = [RequestProcessor({"body": {"content-type": "application/json"}, "url_path": path})
                             for path, _ in requests]
    finals = handler.handle([{"body": json.dumps(body).encode()} for _, body in requests], ctx)
    chunks = {}
    for msg in ctx.cl_socket.messages:
        for part in decode_message(msg):
            chunks.setdefault(part["req_id"], []).append(part)
    out = []
    for i, final in enumerate(finals):
        parts = chunks.get(f"req-{i}", [])
        if parts:  # streamed: status and type went out with the first chunk
            out.append((parts[0]["status"], parts[0]["content_type"], "".join(p["body"] for p in parts) + final))
        else:
            out.append((ctx.get_response_status(i)[0], ctx.get_response_content_type(i), final))
    return out


def sse_chunks(body: str) -> list:
    events = [block[len("data: "):] for block in body.split("\n\n") if block]
    assert events[-1] == "[DONE]"
    return [json.loads(e) for e in events[:-1]]


def chat_body(**extra):
    return {"model": "tiny", "messages": MESSAGES, "temperature": 0, "max_tokens": 6, **extra}


def check_mixed_batch(outcomes):
    """A TGI stream, a streamed and a plain chat, a rejected chat, v1/models and a completion, each on its own."""
    tgi, streamed, plain, bad, models, text = outcomes
    assert tgi[:2] == (200, "application/x-ndjson") and json.loads(tgi[2].splitlines()[-1])["details"]
    assert streamed[:2] == (200, "text/event-stream") and plain[:2] == (200, "application/json")
    answer = json.loads(plain[2])["choices"][0]["message"]["content"]
    assert "".join(c["choices"][0]["delta"]["content"] for c in sse_chunks(streamed[2])) == answer
    assert bad[0] == 400 and json.loads(bad[2])["error"]["param"] == "n"
    assert models[0] == 200 and json.loads(models[2])["data"][0]["id"] == "tiny"
    assert text[0] == 200 and json.loads(text[2])["usage"]["completion_tokens"] == 3


MIXED = [("", {"inputs": "The function returns", "parameters": {"max_new_tokens": 4}}),
         (CHAT, chat_body(stream=True)), (CHAT, chat_body()), (CHAT, chat_body(n=2)), (MODELS, {}),
         (COMPLETIONS, {"prompt": "A list of", "max_tokens": 3, "temperature": 0})]


def test_micro_batching_answers_each_request_of_a_mixed_batch_in_its_own_api(micro):
    check_mixed_batch(call_micro(micro, MIXED))


def test_continuous_batching_answers_each_request_of_a_mixed_batch_in_its_own_api(continuous):
    frontend = ContinuousFrontend(continuous, 4)
    clients = [frontend.submit(json.dumps(body).encode(), {"url_path": path}) for path, body in MIXED]
    frontend.run()
    check_mixed_batch([(c.status, c.content_type, c.body) for c in clients])
    assert not continuous.live and continuous.scheduler.idle


@pytest.mark.parametrize("fixture", ["micro", "continuous"])
def test_engine_limits_are_openai_errors_naming_openai_params(fixture, request):
    handler = request.getfixturevalue(fixture)
    requests = [(CHAT, chat_body(max_tokens=400)), (COMPLETIONS, {"prompt": "word " * 300}),
                ("v1/embeddings", {"input": "x"})]
    if fixture == "micro":
        outcomes = call_micro(handler, requests)
    else:
        frontend = ContinuousFrontend(handler, 4)
        clients = [frontend.submit(json.dumps(body).encode(), {"url_path": path}) for path, body in requests]
        frontend.run()
        outcomes = [(c.status, c.content_type, c.body) for c in clients]
    errors = [(status, json.loads(body)["error"]["param"]) for status, _, body in outcomes]
    assert errors == [(400, "max_tokens"), (400, "prompt"), (404, None)]
    assert "max_tokens" in json.loads(outcomes[0][2])["error"]["message"]
