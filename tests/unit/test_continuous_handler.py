"""The continuous-batching handler, driven call by call as TorchServe's frontend drives it.

These tests step in the handler's own thread (``overlap_round_trips: false``), so that what a
call returns is exact; test_continuous_overlap.py covers the default, steps in their own thread.

``ts_frontend.ContinuousFrontend`` encodes every reply with TorchServe's own wire format and
reads ``ts_stream_next`` the way the Java frontend does, so these tests check what each
client would receive, not just what the handler returned.
"""
from __future__ import annotations

import json
import os

import pytest
import torch
from ts.context import Context

import llama_handler
from llama_engine import GenerationRequest, SamplingParams

from ts_frontend import ContinuousFrontend

SLOTS = 4
CONFIG = {
    "continuousBatching": True,
    "batchSize": SLOTS,
    "maxBatchDelay": 1,
    "handler": {"model_path": "model", "max_length": 256, "max_new_tokens": 8, "torch_threads": 1},
    "continuous_batching": {"max_prefill_tokens_per_step": 64, "overlap_round_trips": False},
}
PROMPTS = ["The function returns", "If the object is", "A list of", "The default value is",
           "When the file", "This module provides", "Return the number of", "The following"]


def load_continuous_handler(tiny_model_dir, tmp_path_factory, config):
    """A ContinuousHandler initialized as TorchServe would, over the tiny model."""
    model_dir = tmp_path_factory.mktemp("modeldir")
    os.symlink(tiny_model_dir, model_dir / "model")
    service = llama_handler.ContinuousHandler()
    service.initialize(Context("tiny", str(model_dir), None, SLOTS, None, "0.12.0", model_yaml_config=config))
    return service


@pytest.fixture(scope="module")
def handler(tiny_model_dir, tmp_path_factory):
    threads = torch.get_num_threads()
    yield load_continuous_handler(tiny_model_dir, tmp_path_factory, CONFIG)
    torch.set_num_threads(threads)


@pytest.fixture
def frontend(handler):
    yield ContinuousFrontend(handler, SLOTS)
    assert not handler.live, "the handler kept requests the frontend no longer has"
    assert handler.scheduler.idle and len(handler.scheduler.free_slots) == SLOTS


def body(prompt, n, **extra):
    return {"inputs": prompt, "parameters": {"max_new_tokens": n}, **extra}


def tokens_of(client):
    """The streamed token ids (an error line has none) and every line."""
    lines = [json.loads(line) for line in client.body.splitlines() if line]
    return [line["token"]["id"] for line in lines if "token" in line], lines


def solo_tokens(scheduler):
    """Each prompt's greedy tokens with nothing else in flight, stepped by the caller (steps are
    serialized, so a handler's step thread may run beside it)."""
    cache = {}

    def run(prompt, n):
        if (prompt, n) not in cache:
            handle = scheduler.submit(scheduler.prepare(GenerationRequest(prompt, SamplingParams(max_new_tokens=n))))
            while not handle.done:
                scheduler.step()
            cache[prompt, n] = handle.result.token_ids
        return cache[prompt, n]

    return run


@pytest.fixture(scope="module")
def solo(handler):
    return solo_tokens(handler.scheduler)


def test_interleaved_arrivals_stream_exactly_their_solo_tokens(frontend, solo):
    lengths = [5, 12, 3, 9, 7, 4, 10, 6]
    clients = []
    for i, (prompt, n) in enumerate(zip(PROMPTS, lengths)):
        clients.append(frontend.submit(body(prompt, n)))
        for _ in range(i % 3):  # arrivals land while others are mid-generation
            frontend.tick()
    frontend.run()
    for client, prompt, n in zip(clients, PROMPTS, lengths):
        ids, lines = tokens_of(client)
        assert client.status == 200 and client.content_type == "application/x-ndjson" and client.streamed
        assert ids == solo(prompt, n), prompt
        assert lines[-1]["details"]["finish_reason"] == "length"
    assert frontend.calls < sum(lengths), "requests did not share decode steps"


def test_a_short_request_finishes_before_a_long_one_that_started_earlier(frontend):
    long = frontend.submit(body(PROMPTS[0], 40))
    frontend.tick()
    frontend.tick()
    short = frontend.submit(body(PROMPTS[1], 3))
    while not short.done:
        frontend.tick()
    assert not long.done, "the short answer waited for the long one"
    assert len(tokens_of(short)[0]) == 3
    frontend.run()
    assert len(tokens_of(long)[0]) == 40


def test_a_disconnect_frees_the_slot_for_the_next_request(frontend, handler):
    clients = [frontend.submit(body(p, 30)) for p in PROMPTS[:SLOTS]]
    frontend.tick()
    assert handler.scheduler.free_slots == []
    gone = clients[1]
    slot = handler.scheduler._by_id[gone.request_id].slot
    frontend.disconnect(gone)
    waiting = frontend.submit(body(PROMPTS[5], 2))
    frontend.tick()  # the call without the departed request frees its slot and admits the new one
    assert gone.request_id not in handler.live
    assert handler.scheduler._by_id[waiting.request_id].slot == slot
    frontend.run()
    assert len(tokens_of(waiting)[0]) == 2


def test_a_bad_request_gets_its_own_400_and_the_others_go_on(frontend, solo):
    good = frontend.submit(body(PROMPTS[2], 6))
    frontend.tick()
    bad = frontend.submit(body(PROMPTS[3], 4, parameters={"max_new_tokens": 4, "top_p": 7}))
    frontend.run()
    assert bad.status == 400 and not bad.streamed and bad.calls == 1
    error = json.loads(bad.body)
    assert error["parameter"] == "top_p" and error["code"] == 400
    assert tokens_of(good)[0] == solo(PROMPTS[2], 6)


def test_non_streaming_and_sse_requests_get_their_formats(frontend, solo):
    plain = frontend.submit(body(PROMPTS[4], 5, stream=False))
    sse = frontend.submit(body(PROMPTS[4], 5, stream=True))
    frontend.run()
    assert plain.status == 200 and plain.content_type == "application/json"
    expected = solo(PROMPTS[4], 5)
    reference = json.loads(plain.body)[0]["generated_text"]
    assert reference and plain.body.count("generated_text") == 1
    events = [json.loads(chunk[len("data:"):]) for chunk in sse.body.split("\n\n") if chunk.startswith("data:")]
    assert sse.content_type == "text/event-stream"
    assert [e["token"]["id"] for e in events] == expected
    assert events[-1]["generated_text"] == reference


def test_a_request_done_in_its_first_call_is_one_plain_response(frontend):
    client = frontend.submit(body(PROMPTS[5], 1))
    frontend.run()
    assert client.status == 200 and client.calls == 1 and not client.streamed
    assert len(tokens_of(client)[0]) == 1


def test_a_failed_step_ends_each_stream_with_an_error_line(frontend, handler, monkeypatch):
    streams = [frontend.submit(body(p, 20)) for p in PROMPTS[:2]]
    frontend.tick()
    frontend.tick()

    def broken(*args):
        raise RuntimeError("device lost")

    monkeypatch.setattr(handler.scheduler.backend, "_step", broken)
    frontend.tick()
    monkeypatch.undo()
    assert all(c.done and c.status == 200 for c in streams)
    for client in streams:
        last = json.loads(client.body.splitlines()[-1])
        assert last["code"] == 500 and "device lost" in last["error"]
    after = frontend.submit(body(PROMPTS[6], 3))
    frontend.run()
    assert len(tokens_of(after)[0]) == 3, "the worker did not recover"


@pytest.fixture(scope="module")
def micro_handler(tiny_model_dir, tmp_path_factory):
    from test_handler import CONFIG as MICRO_CONFIG

    model_dir = tmp_path_factory.mktemp("micro-modeldir")
    os.symlink(tiny_model_dir, model_dir / "model")
    config = {**MICRO_CONFIG, "handler": {**MICRO_CONFIG["handler"], "torch_threads": 1}}
    service = llama_handler.LlamaHandler()
    service.initialize(Context("tiny", str(model_dir), None, 8, None, "0.12.0", model_yaml_config=config))
    yield service
    service.micro_batching.shutdown()


@pytest.mark.parametrize("parameters", [
    {"max_new_tokens": 12, "do_sample": True, "temperature": 0.8, "top_k": 20, "seed": 7},
    {"max_new_tokens": 12, "repetition_penalty": 1.3, "details": True},
    {"max_new_tokens": 30, "stop": [" the", "\n"], "return_full_text": True},
])
def test_the_same_request_gets_the_same_answer_as_with_micro_batching(frontend, micro_handler, parameters):
    from test_handler import call

    request = {"inputs": PROMPTS[7], "parameters": parameters, "stream": False}
    finals, _, _ = call(micro_handler, [(request, "application/json")])
    others = [frontend.submit(body(p, 9)) for p in PROMPTS[:3]]  # other requests in flight
    client = frontend.submit(request)
    frontend.run()
    assert client.status == 200 and all(o.status == 200 for o in others)
    got, expected = json.loads(client.body), json.loads(finals[0])
    # The slot backend's own attention rounds differently from HF's: logprobs agree to ~1e-5.
    for token in expected[0].get("details", {}).get("tokens", []):
        token["logprob"] = pytest.approx(token["logprob"], abs=1e-3)
    assert got == expected
