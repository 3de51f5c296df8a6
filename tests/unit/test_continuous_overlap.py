"""The continuous handler with its steps in a thread of their own (``overlap_round_trips``, the default).

Driven call by call through ``ts_frontend.ContinuousFrontend`` (TorchServe's wire format), as
in test_continuous_handler.py, which covers the same handler stepping in the caller's thread.
Here the model steps between calls, so these tests assert what holds whatever the timing: each
stream's tokens, its last response, errors per request, the slot freed by a disconnect.
"""
from __future__ import annotations

import json
import threading
import time

import pytest
import torch
from test_continuous_handler import (
    CONFIG as STEPPED_CONFIG,
    PROMPTS,
    SLOTS,
    body,
    load_continuous_handler,
    solo_tokens,
    tokens_of,
)

import llama_handler
from llama_engine import GenerationRequest, RequestError, SamplingParams
from llama_engine.continuous import ContinuousScheduler, SteppingThread

from ts_frontend import ContinuousFrontend

CONFIG = {**STEPPED_CONFIG, "continuous_batching": {"max_prefill_tokens_per_step": 64}}  # overlap: the default


@pytest.fixture(scope="module")
def handler(tiny_model_dir, tmp_path_factory):
    threads = torch.get_num_threads()
    service = load_continuous_handler(tiny_model_dir, tmp_path_factory, CONFIG)
    assert service.stepper is not None and service.stepper.alive
    yield service
    service.stepper.stop()
    assert not service.stepper.alive
    torch.set_num_threads(threads)


@pytest.fixture
def frontend(handler):
    yield ContinuousFrontend(handler, SLOTS)
    assert not handler.live, "the handler kept requests the frontend no longer has"
    wait_until(lambda: handler.scheduler.idle and len(handler.scheduler.free_slots) == SLOTS)


def wait_until(condition, timeout=10.0):
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.005)


@pytest.fixture(scope="module")
def solo(handler):
    return solo_tokens(handler.scheduler)


def test_the_model_steps_while_the_frontend_is_away(frontend, handler):
    client = frontend.submit(body(PROMPTS[0], 40))
    frontend.tick()
    before = handler.scheduler.steps
    wait_until(lambda: handler.scheduler.steps >= before + 5)  # no handler call meanwhile
    frontend.tick()
    assert len(tokens_of(client)[0]) >= 5, "the steps between the calls lost their tokens"
    frontend.run()
    assert len(tokens_of(client)[0]) == 40 and client.status == 200


def test_interleaved_arrivals_stream_exactly_their_solo_tokens(frontend, solo):
    lengths = [5, 12, 3, 9, 7, 4, 10, 6]
    clients = []
    for i, (prompt, n) in enumerate(zip(PROMPTS, lengths)):
        clients.append(frontend.submit(body(prompt, n)))
        for _ in range(i % 3):
            frontend.tick()
    frontend.run()
    for client, prompt, n in zip(clients, PROMPTS, lengths):
        ids, lines = tokens_of(client)
        assert client.status == 200 and client.content_type == "application/x-ndjson"
        assert ids == solo(prompt, n), prompt
        assert lines[-1]["details"]["finish_reason"] == "length" and "generated_text" in lines[-1]


def test_a_disconnect_frees_the_slot_for_the_next_request(frontend, handler):
    clients = [frontend.submit(body(p, 200)) for p in PROMPTS[:SLOTS]]
    wait_until(lambda: (frontend.tick(), handler.scheduler.free_slots == [])[1])
    gone = clients[1]
    frontend.disconnect(gone)
    waiting = frontend.submit(body(PROMPTS[5], 2))
    frontend.tick()  # the call without the departed request cancels it and admits the new one
    assert gone.request_id not in handler.live
    while not waiting.done:
        frontend.tick()
    assert len(tokens_of(waiting)[0]) == 2, "the new request never got the departed one's slot"
    for client in clients:
        if client is not gone:
            frontend.disconnect(client)
    frontend.tick()


def test_a_bad_request_gets_its_own_400_and_the_others_go_on(frontend, solo):
    good = frontend.submit(body(PROMPTS[2], 6))
    frontend.tick()
    bad = frontend.submit(body(PROMPTS[3], 4, parameters={"max_new_tokens": 4, "top_p": 7}))
    frontend.run()
    assert bad.status == 400 and not bad.streamed and bad.calls == 1
    assert json.loads(bad.body)["parameter"] == "top_p"
    assert tokens_of(good)[0] == solo(PROMPTS[2], 6)


def test_non_streaming_and_sse_requests_get_their_formats(frontend, solo):
    plain = frontend.submit(body(PROMPTS[4], 5, stream=False))
    sse = frontend.submit(body(PROMPTS[4], 5, stream=True))
    frontend.run()
    assert plain.status == 200 and plain.content_type == "application/json"
    assert plain.body.count("generated_text") == 1
    events = [json.loads(chunk[len("data:"):]) for chunk in sse.body.split("\n\n") if chunk.startswith("data:")]
    assert [e["token"]["id"] for e in events] == solo(PROMPTS[4], 5)
    assert events[-1]["generated_text"] == json.loads(plain.body)[0]["generated_text"]


def test_a_failed_forward_pass_ends_each_stream_with_an_error_line(frontend, handler, monkeypatch):
    streams = [frontend.submit(body(p, 200)) for p in PROMPTS[:2]]
    wait_until(lambda: (frontend.tick(), all(tokens_of(c)[0] for c in streams))[1])

    def broken(*args):
        raise RuntimeError("device lost")

    monkeypatch.setattr(handler.scheduler.backend, "_step", broken)
    frontend.run()
    monkeypatch.undo()
    for client in streams:
        last = json.loads(client.body.splitlines()[-1])
        assert client.status == 200 and last["code"] == 500 and "device lost" in last["error"]
    after = frontend.submit(body(PROMPTS[6], 3))
    frontend.run()
    assert len(tokens_of(after)[0]) == 3, "the worker did not recover"


def test_a_step_that_raises_fails_the_requests_in_flight_and_the_thread_goes_on(frontend, handler, monkeypatch):
    streams = [frontend.submit(body(p, 200)) for p in PROMPTS[:2]]
    wait_until(lambda: (frontend.tick(), all(tokens_of(c)[0] for c in streams))[1])

    def bug(*args):
        raise KeyError("a bug in the scheduler")

    monkeypatch.setattr(handler.scheduler, "_decoded", bug)
    frontend.run()
    monkeypatch.undo()
    assert handler.stepper.alive
    for client in streams:
        last = json.loads(client.body.splitlines()[-1])
        assert last["code"] == 500 and "a bug in the scheduler" in last["error"]
    after = frontend.submit(body(PROMPTS[7], 3))
    frontend.run()
    assert len(tokens_of(after)[0]) == 3


def test_the_round_trip_line_says_the_handler_waits_for_steps(handler, caplog):
    import logging

    from scripts.bench.scenarios import round_trips

    trips = llama_handler.RoundTrips(every=1.0, overlapped=True)
    with caplog.at_level(logging.INFO, logger=llama_handler.logger.name):
        trips.record(0.0, 0.040, busy=True)
        trips.stepping += 0.030
        trips.record(0.043, 1.2, busy=True)
    assert "waiting for a step" in caplog.text and handler.round_trips.overlapped
    assert round_trips(caplog.text)[0]["step_ms"] == pytest.approx(15.0, abs=0.01)


def test_submissions_from_another_thread_while_the_thread_steps(handler):
    """The scheduler's own lock: many threads submit and cancel while the step thread runs."""
    scheduler: ContinuousScheduler = handler.scheduler
    results, cancelled = {}, set()

    def client(i):
        prepared = scheduler.prepare(GenerationRequest(PROMPTS[i % len(PROMPTS)], SamplingParams(max_new_tokens=6)))
        handle = None
        while handle is None:
            try:
                handle = scheduler.submit(prepared, request_id=f"t{i}")
            except RequestError:  # 503: the queue is full; retry as the frontend would hold it
                time.sleep(0.002)
        handler.stepper.wake()
        if i % 5 == 0:
            scheduler.cancel(f"t{i}")
            cancelled.add(i)
        wait_until(lambda: handle.done)
        results[i] = handle.result

    threads = [threading.Thread(target=client, args=(i,)) for i in range(20)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)
    assert len(results) == 20
    for i, result in results.items():  # a cancel that came after the last token changes nothing
        assert result.finish_reason in (("cancelled", "length") if i in cancelled else ("length",))
        assert result.finish_reason == "cancelled" or len(result.token_ids) == 6
    wait_until(lambda: scheduler.idle and len(scheduler.free_slots) == SLOTS)


def test_a_stopped_thread_wakes_its_waiters():
    class Idle:
        idle = True

        def step(self):
            return False

    stepper = SteppingThread(Idle(), idle_wait=0.01).start()
    started = time.monotonic()
    waiter = threading.Thread(target=stepper.wait_for_step, args=(0, 30.0))
    waiter.start()
    stepper.stop()
    waiter.join(5)
    assert not waiter.is_alive() and not stepper.alive and time.monotonic() - started < 5


def test_the_worker_writes_no_line_per_call_for_the_frontend_to_parse(handler, frontend, caplog):
    """TorchServe's worker logs "Backend received inference at" and records PredictionTime per call:
    under continuous batching, per token. The handler drops both and keeps its own lines and metrics."""
    import logging

    with caplog.at_level(logging.INFO):
        logging.info("Backend received inference at: %d", 1)
        logging.info("another root line")
    assert "Backend received inference" not in caplog.text and "another root line" in caplog.text

    recorded = []

    class Metrics:
        request_ids = None

        def add_time(self, name, value, *args, **kwargs):
            recorded.append(name)

    context = type("Context", (), {})()
    context.metrics = Metrics()
    llama_handler.quiet_per_call_lines(context)
    context.metrics.request_ids = {0: "a"}  # what TorchServe's predict sets reaches the real cache
    context.metrics.add_time("PredictionTime", 3.0)
    context.metrics.add_time("HandlerTime", 2.0, None, "ms")
    assert recorded == ["HandlerTime"] and context.metrics.request_ids == {0: "a"}
