"""The TorchServe entry with TorchServe's real Context and wire protocol, but no frontend.

Intermediate responses are decoded from the bytes the handler writes to the frontend socket,
so these tests see exactly which request id each chunk is addressed to.
"""
from __future__ import annotations

import json
import os
import threading

import pytest
from ts.context import Context, RequestProcessor

import llama_handler
from llama_engine import GenerationRequest, SamplingParams

from ts_frontend import FakeMetrics, decode_message

CONFIG = {
    "batchSize": 8,
    "handler": {"model_path": "model", "max_length": 256, "max_new_tokens": 8, "torch_threads": 2},
    "micro_batching": {"micro_batch_size": 4, "parallelism": {"preprocess": 2, "postprocess": 2}},
}
PROMPTS = ["The function returns", "If the object is", "A list of", "The default value is",
           "When the file", "This module provides", "Return the number of", "The following"]


class FakeSocket:
    def __init__(self):
        self.messages = []
        self.lock = threading.Lock()

    def sendall(self, data):
        with self.lock:
            self.messages.append(bytes(data))


@pytest.fixture(scope="module")
def handler(tiny_model_dir, tmp_path_factory):
    model_dir = tmp_path_factory.mktemp("modeldir")
    os.symlink(tiny_model_dir, model_dir / "model")
    ctx = Context("tiny", str(model_dir), None, 8, None, "0.12.0", model_yaml_config=CONFIG)
    service = llama_handler.LlamaHandler()
    service.initialize(ctx)
    yield service
    service.micro_batching.shutdown()


def call(handler, bodies, timeout=120):
    """Run one frontend batch; return (final bodies, {req_id: [intermediate parts]}, context)."""
    ctx = Context("tiny", "", None, 8, None, "0.12.0")
    ctx.metrics = FakeMetrics()
    ctx.cl_socket = FakeSocket()
    ctx.request_ids = {i: f"req-{i}" for i in range(len(bodies))}
    ctx.request_processor = [RequestProcessor({"body": {"content-type": ct}}) for _, ct in bodies]
    data = [{"body": body} for body, _ in bodies]
    out = {}
    worker = threading.Thread(target=lambda: out.setdefault("finals", handler.handle(data, ctx)))
    worker.start()
    worker.join(timeout)
    assert not worker.is_alive(), "handle() hung"
    streams = {}
    for msg in ctx.cl_socket.messages:
        for part in decode_message(msg):
            streams.setdefault(part["req_id"], []).append(part)
    return out["finals"], streams, ctx


def reference(handler, prompt, max_new_tokens):
    prepared = handler.engine.prepare(GenerationRequest(prompt, SamplingParams(max_new_tokens=max_new_tokens)))
    return handler.engine.generate([prepared])[0]


def json_body(prompt, n):
    return {"inputs": prompt, "parameters": {"max_new_tokens": n}}


def test_each_request_of_two_micro_batches_gets_exactly_its_own_stream(handler):
    bodies = [(json_body(p, 3 + i), "application/json") for i, p in enumerate(PROMPTS)]
    finals, streams, _ = call(handler, bodies)
    assert finals == [""] * len(PROMPTS)
    for i, prompt in enumerate(PROMPTS):
        parts = streams[f"req-{i}"]
        assert all(p["headers"].get("ts_stream_next") == "true" for p in parts)
        assert all(p["content_type"] == "application/x-ndjson" and p["status"] == 200 for p in parts)
        lines = [json.loads(line) for p in parts for line in p["body"].splitlines()]
        ref = reference(handler, prompt, 3 + i)
        assert [line["token"]["id"] for line in lines] == ref.token_ids
        assert lines[-1]["generated_text"] == ref.text and lines[-1]["details"]["generated_tokens"] == 3 + i


def test_an_exception_in_a_stage_fails_only_its_request(handler, monkeypatch):
    original = handler.engine.prepare

    def prepare(request):
        if request.prompt == "boom":
            raise RuntimeError("tokenizer exploded")
        return original(request)

    monkeypatch.setattr(handler.engine, "prepare", prepare)
    bodies = [(json_body("A list of", 4), "application/json"), ("boom", "text/plain"),
              (json_body("The following", 4), "application/json")]
    finals, streams, ctx = call(handler, bodies)
    statuses = [ctx.get_response_status(i)[0] for i in range(3)]
    assert statuses == [200, 500, 200]
    assert "tokenizer exploded" in json.loads(finals[1])["error"]
    assert "details" in streams["req-2"][-1]["body"]
    finals, streams, ctx = call(handler, [(json_body("A list of", 2), "application/json")])
    assert json.loads(streams["req-0"][-1]["body"].splitlines()[-1])["details"]["generated_tokens"] == 2


def test_a_failure_mid_stream_ends_the_stream_with_an_error_line(handler, monkeypatch):
    original = handler.engine.backend.decode
    calls = []

    def decode(tokens):
        calls.append(1)
        if len(calls) == 3:
            raise RuntimeError("device lost")
        return original(tokens)

    monkeypatch.setattr(handler.engine.backend, "decode", decode)
    bodies = [(json_body("A list of", 8), "application/json"), (json_body("When the file", 8), "application/json")]
    finals, streams, _ = call(handler, bodies)
    for i in range(2):
        last = json.loads(streams[f"req-{i}"][-1]["body"])
        assert last["code"] == 500 and "device lost" in last["error"]
        assert finals[i] == ""
    monkeypatch.setattr(handler.engine.backend, "decode", original)
    finals, streams, _ = call(handler, [(json_body("A list of", 2), "application/json")])
    assert json.loads(streams["req-0"][-1]["body"].splitlines()[-1])["details"]["generated_tokens"] == 2


def test_bad_and_good_requests_in_one_micro_batch(handler):
    bodies = [(json_body("A list of", 3), "application/json"),
              ({"inputs": "x", "parameters": {"top_k": "many"}}, "application/json"),
              (b"\xff", "text/plain")]
    finals, streams, ctx = call(handler, bodies)
    assert ctx.get_response_status(0)[0] == 200 and finals[0] == ""
    assert ctx.get_response_status(1) == (400, "Bad Request")
    assert json.loads(finals[1])["parameter"] == "top_k"
    assert json.loads(finals[2])["parameter"] == "inputs"
    assert "req-1" not in streams and "req-2" not in streams


def test_stage_wrapper_routes_an_escaping_exception_to_its_requests(handler):
    @llama_handler._stage
    def broken(self, entries):
        raise ValueError("stage bug")

    ctx = Context("tiny", "", None, 8, None, "0.12.0")
    ctx.request_ids = {0: "a", 1: "b"}
    ctx.request_processor = [RequestProcessor({}), RequestProcessor({})]
    handler.responder = llama_handler.Responder(ctx)
    entries = [llama_handler.BatchEntry(0, None), llama_handler.BatchEntry(1, None)]
    assert broken(handler, entries) is entries
    assert all(e.error.status == 500 and "stage bug" in e.error.message for e in entries)


class FakeCuda:
    """torch.cuda on a host with ``count`` GPUs, recording set_device."""

    def __init__(self, count):
        self.count, self.current = count, None

    def is_available(self):
        return self.count > 0

    def device_count(self):
        return self.count

    def set_device(self, index):
        self.current = index


@pytest.mark.parametrize("handler_cfg, gpu_id, count, chosen", [
    ({"device": "auto"}, 1, 2, 1),
    ({"device": "cuda"}, "0", 2, 0),  # TorchServe may pass the id as a string
    ({"device": "cpu"}, 1, 2, None),
    ({"device": "auto"}, None, 2, None),
    ({"device": "auto"}, 0, 0, None),
    ({"backend": "llamacpp"}, 1, 2, None),
])
def test_a_worker_uses_the_gpu_torchserve_assigned_it(monkeypatch, handler_cfg, gpu_id, count, chosen):
    cuda = FakeCuda(count)
    monkeypatch.setattr(llama_handler.torch, "cuda", cuda)
    config = llama_handler.load_model_config({"handler": handler_cfg})
    assert llama_handler.use_assigned_gpu(config, gpu_id) == chosen and cuda.current == chosen


def test_a_gpu_id_the_worker_cannot_see_is_a_clear_error(monkeypatch):
    monkeypatch.setattr(llama_handler.torch, "cuda", FakeCuda(1))
    with pytest.raises(RuntimeError, match="gpu_id 2, but it sees 1 CUDA device.*CUDA_VISIBLE_DEVICES"):
        llama_handler.use_assigned_gpu(llama_handler.load_model_config({}), 2)
