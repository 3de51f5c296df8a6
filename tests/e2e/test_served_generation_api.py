"""The generation API through a real TorchServe, read by the clients users already have:
huggingface_hub's InferenceClient (TGI's SSE schema and non-streamed JSON), requests and curl."""
from __future__ import annotations

import json
import subprocess
import threading

import pytest
import requests
from huggingface_hub import InferenceClient
from huggingface_hub.errors import TextGenerationError

PROMPT = "The function returns"


@pytest.fixture(scope="module")
def hf(server, client):
    return InferenceClient(model=client.url, headers=client.auth, timeout=120)


def ndjson(client, body, **kwargs):
    r = client.post(body, **kwargs)
    assert r.status_code == 200, r.text
    return [json.loads(line) for line in r.iter_lines() if line]


def test_inference_client_streams_with_details(hf, client):
    reference = ndjson(client, {"inputs": PROMPT, "parameters": {"max_new_tokens": 8}})
    events = list(hf.text_generation(PROMPT, max_new_tokens=8, stream=True, details=True))
    assert [e.token.id for e in events] == [line["token"]["id"] for line in reference]
    assert events[-1].generated_text == reference[-1]["generated_text"]
    assert events[-1].details.finish_reason == "length" and events[-1].details.generated_tokens == 8
    assert all(e.details is None for e in events[:-1])
    assert all(e.token.logprob <= 0 for e in events)


def test_inference_client_streams_text_without_details(hf, client):
    reference = ndjson(client, {"inputs": PROMPT, "parameters": {"max_new_tokens": 8}})
    pieces = list(hf.text_generation(PROMPT, max_new_tokens=8, stream=True))
    assert "".join(pieces) == reference[-1]["generated_text"]


def test_inference_client_without_streaming(hf, client):
    reference = ndjson(client, {"inputs": PROMPT, "parameters": {"max_new_tokens": 8}})
    assert hf.text_generation(PROMPT, max_new_tokens=8) == reference[-1]["generated_text"]
    out = hf.text_generation(PROMPT, max_new_tokens=8, details=True, return_full_text=True)
    assert out.generated_text == PROMPT + reference[-1]["generated_text"]
    assert out.details.generated_tokens == 8 and len(out.details.tokens) == 8


def test_inference_client_sampling_parameters_and_seed(hf):
    a = hf.text_generation(PROMPT, max_new_tokens=12, do_sample=True, temperature=0.9, top_p=0.9, top_k=40,
                           repetition_penalty=1.1, seed=42, details=True)
    b = hf.text_generation(PROMPT, max_new_tokens=12, do_sample=True, temperature=0.9, top_p=0.9, top_k=40,
                           repetition_penalty=1.1, seed=42, details=True)
    assert a.generated_text == b.generated_text and a.details.seed == 42


def test_inference_client_sees_a_400_as_an_error(hf):
    with pytest.raises((TextGenerationError, requests.HTTPError)) as info:
        list(hf.text_generation(PROMPT, max_new_tokens=8, top_p=2.0, stream=True))
    assert "top_p" in str(info.value)


def test_streamed_and_non_streamed_text_are_equal(client):
    body = {"inputs": PROMPT, "parameters": {"max_new_tokens": 16, "stop": ["\n\n"]}}
    streamed = ndjson(client, body)
    whole = client.post({**body, "stream": False}, stream=False).json()[0]
    assert "".join(line["token"]["text"] for line in streamed) == streamed[-1]["generated_text"] == whole["generated_text"]


def test_stop_sequence_through_the_server(client):
    free = ndjson(client, {"inputs": PROMPT, "parameters": {"max_new_tokens": 16}})[-1]["generated_text"]
    stop = free[4:8]
    lines = ndjson(client, {"inputs": PROMPT, "parameters": {"max_new_tokens": 16, "stop": stop}})
    assert lines[-1]["details"]["finish_reason"] == "stop_sequence"
    assert lines[-1]["generated_text"] == free[:free.find(stop)]


def test_sse_by_accept_header_with_curl(server, client):
    out = subprocess.run(["curl", "-sS", "-N", client.url, "-H", f"Authorization: Bearer {server.key}",
                          "-H", "Content-Type: text/plain", "-H", "Accept: text/event-stream",
                          "-d", PROMPT, "-D", "-"], capture_output=True, timeout=120, check=True).stdout.decode()
    head, _, body = out.partition("\r\n\r\n")
    assert "content-type: text/event-stream" in head.lower()
    events = [json.loads(e[len("data: "):]) for e in body.split("\n\n") if e.startswith("data: ")]
    assert events and events[-1]["generated_text"] is not None and events[0]["index"] == 1


def test_chat_request(client):
    lines = ndjson(client, {"messages": [{"role": "system", "content": "Be brief."},
                                         {"role": "user", "content": "What does a function return?"}],
                            "parameters": {"max_new_tokens": 6, "details": True}})
    assert lines[-1]["details"]["generated_tokens"] == 6
    assert lines[-1]["details"]["input_length"] > 10


def test_mixed_good_and_bad_requests_in_one_batch(client):
    jobs = [
        ({"inputs": PROMPT, "parameters": {"max_new_tokens": 6}}, 200),
        ({"inputs": PROMPT, "parameters": {"repetition_penalty": -1}}, 400),
        ({"messages": [{"role": "user", "content": "Hi"}], "parameters": {"max_new_tokens": 4}}, 200),
        ({"messages": [{"role": "assistant", "content": "Hi"}]}, 400),
        ({"inputs": PROMPT, "stream": True, "parameters": {"max_new_tokens": 5}}, 200),
        ({"inputs": "x" * 70000}, 413),
        ({"inputs": PROMPT, "stream": False, "parameters": {"max_new_tokens": 3, "stop": 7}}, 400),
        ({"inputs": PROMPT, "stream": False, "parameters": {"max_new_tokens": 3}}, 200),
    ]
    out = [None] * len(jobs)
    barrier = threading.Barrier(len(jobs))

    def worker(i, body):
        barrier.wait()
        r = client.post(body, stream=False)
        out[i] = (r.status_code, r.text)

    threads = [threading.Thread(target=worker, args=(i, body)) for i, (body, _) in enumerate(jobs)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=300)
    for (body, want), (status, text) in zip(jobs, out):
        assert status == want, (body, text[:300])
        if want >= 400:
            error = json.loads(text)
            assert error["code"] == want and error["parameter"]
