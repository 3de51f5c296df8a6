"""Continuous batching through a real TorchServe (``continuousBatching: true``, 2 slots)."""
from __future__ import annotations

import json
import threading
import time

import pytest
import requests

from scripts.tsctl import read_log

from conftest import CONTINUOUS, burst_statuses, serve_variant

MODEL = CONTINUOUS
SLOTS = 2
QUEUE = 2
#: Tokens of a stream that another request must overtake: the tiny model's 400 took 0.15-0.2 s on a
#: Zen 5 EPYC beside a second one, and the overtaking request 0.02-0.03 s. The server takes the model's
#: 1024 positions so that the margin is wider on a loaded host.
LONG = 1000


def small(data):
    data.update(batchSize=SLOTS, jobQueueSize=QUEUE)
    data["handler"]["torch_threads"] = 1
    data["continuous_batching"]["max_prefill_tokens_per_step"] = 16
    data["handler"]["max_length"] = 1024


@pytest.fixture(scope="module")
def server(tiny_model_dir, tmp_path_factory):
    with serve_variant(tmp_path_factory.mktemp("continuous"), MODEL, tiny_model_dir, small) as ts:
        yield ts


class Stream:
    """One streaming request in its own thread: token ids and when it ended."""

    def __init__(self, server, prompt: str, n: int, start_after: float = 0.0):
        self.url = f"{server.url()}/predictions/{MODEL}"
        self.headers = {"Authorization": f"Bearer {server.key}"}
        self.body = {"inputs": prompt, "parameters": {"max_new_tokens": n}}
        self.start_after = start_after
        self.ids, self.status, self.ended, self.first_line = [], None, None, threading.Event()
        self.response = None
        self.thread = threading.Thread(target=self._run, daemon=True)

    def start(self) -> "Stream":
        self.thread.start()
        return self

    def _run(self):
        time.sleep(self.start_after)
        self.response = requests.post(self.url, json=self.body, headers=self.headers, stream=True, timeout=300)
        self.status = self.response.status_code
        try:
            for line in self.response.iter_lines():
                if line:
                    self.ids.append(json.loads(line)["token"]["id"])
                    self.first_line.set()
        except (requests.RequestException, AttributeError):  # closed by disconnect()
            pass
        self.ended = time.perf_counter()

    def join(self, timeout: float = 300):
        self.thread.join(timeout)
        assert not self.thread.is_alive(), "stream did not end"
        return self

    def disconnect(self):
        self.response.close()


PROMPTS = ["The function returns", "If the object is", "A list of", "The default value is"]


def test_interleaved_requests_stream_exactly_their_solo_tokens(server):
    lengths = [24, 6, 15, 9]
    solo = [Stream(server, p, n).start().join().ids for p, n in zip(PROMPTS, lengths)]
    together = [Stream(server, p, n, start_after=0.05 * i).start() for i, (p, n) in enumerate(zip(PROMPTS, lengths))]
    for stream, expected in zip(together, solo):
        stream.join()
        assert stream.status == 200 and stream.ids == expected


def test_a_streamed_token_leaves_no_frontend_log_line(server):
    """Here every call to the worker is one step, one token: log4j2.xml drops the frontend's lines per call
    (TorchServe's default writes three, twice each), so ts_log.log grows by the same whatever the length."""
    lengths = {}
    for n in (4, 64):
        before = len(read_log(server.workdir, "ts_log"))
        assert len(Stream(server, PROMPTS[0], n).start().join().ids) == n
        lengths[n] = len(read_log(server.workdir, "ts_log")) - before
    text = read_log(server.workdir, "ts_log")
    for per_call in ("Flushing req.cmd", "Looping backend response", "Backend response time", "Sending response"):
        assert per_call not in text, per_call
    assert lengths[64] - lengths[4] < 8000, lengths  # not lines a token: 3 x ~130 bytes, 60 tokens more


def test_a_short_request_finishes_before_a_long_one_that_started_earlier(server):
    long = Stream(server, PROMPTS[0], LONG).start()
    assert long.first_line.wait(60)
    short = Stream(server, PROMPTS[1], 4).start().join()
    assert len(short.ids) == 4
    assert long.ended is None, "the short answer waited for the long one"
    long.join()
    assert len(long.ids) == LONG and short.ended < long.ended


def test_a_disconnect_frees_its_slot(server):
    gone = Stream(server, PROMPTS[0], LONG).start()
    busy = Stream(server, PROMPTS[1], LONG).start()
    assert gone.first_line.wait(60) and busy.first_line.wait(60)
    gone.disconnect()
    # Both slots were taken; the next request can only run before `busy` ends if the
    # departed request's slot was freed (it would otherwise generate its LONG tokens first).
    newcomer = Stream(server, PROMPTS[2], 4).start().join()
    assert newcomer.status == 200 and len(newcomer.ids) == 4
    assert busy.ended is None, "the newcomer waited for a slot the departed client still held"
    busy.join()
    assert len(busy.ids) == LONG
    assert "left (client gone); freeing its slot" in server.model_log()


def test_requests_beyond_the_queue_get_503(server):
    statuses = burst_statuses(server, MODEL, PROMPTS[3])
    assert statuses.count(503) >= 1 and statuses.count(200) >= SLOTS, statuses
    assert set(statuses) <= {200, 503}, statuses
