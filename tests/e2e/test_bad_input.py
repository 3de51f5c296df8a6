"""Malformed and hostile bodies through a real TorchServe (issue 14), with micro-batching
(tiny-llama, this module's server: one micro-batch of 8) and continuous batching
(tiny-llama-continuous, this module's server too: 8 slots).

Every bad body gets a 4xx JSON error that names the field; a long greedy stream running
alongside ends with exactly the tokens it streams alone; the worker keeps its PID; extreme
parameter values that are in range share a batch with a good stream without failing it.
"""
from __future__ import annotations

import json
import math
import threading
from dataclasses import dataclass

import pytest
import requests

from conftest import CONTINUOUS, CONTINUOUS_SLOTS, serve_variant, shared_continuous

PROMPT = "The function returns"
# New tokens of the long stream: 4 prompt tokens and these fit both servers' handler.max_length, set
# below to the tiny model's 1024 positions. The bad bodies sent while it streams must find it still
# running. On the shared continuous server (512 positions, 480 tokens) a fresh clone on a Zen 5 once
# found it over; here, on that CPU, 1000 tokens streamed for 0.54 s and the last sender started 0.07 s in.
LONG = {"micro": 1000, "continuous": 1000}
BATCH = CONTINUOUS_SLOTS  # the micro server's batch and micro-batch, the continuous server's slots


def micro(data):
    data.update(batchSize=BATCH, maxBatchDelay=200)
    data["handler"]["torch_threads"] = 1
    data["handler"]["max_length"] = 1024
    data["micro_batching"]["micro_batch_size"] = BATCH


def continuous(data):
    shared_continuous(data)
    data["handler"]["max_length"] = 1024


MODES = {"micro": "tiny-llama", "continuous": CONTINUOUS}


@dataclass
class Served:
    ts: object
    model: str
    mode: str
    pid: int = 0

    @property
    def url(self) -> str:
        return f"{self.ts.url()}/predictions/{self.model}"

    def post(self, body: bytes, content_type: str = "application/json", stream: bool = False):
        headers = {**self.ts.auth_headers(), "Content-Type": content_type}
        return requests.post(self.url, data=body, headers=headers, stream=stream, timeout=300)

    def workers(self) -> list:
        r = requests.get(f"{self.ts.url('management')}/models/{self.model}",
                         headers=self.ts.auth_headers("management"), timeout=30)
        r.raise_for_status()
        return r.json()[0]["workers"]

    def worker_pid(self) -> int:
        (worker,) = self.workers()
        return worker["pid"]


@pytest.fixture(scope="module")
def micro_server(tiny_model_dir, tmp_path_factory):
    with serve_variant(tmp_path_factory.mktemp("bad-input-micro"), MODES["micro"], tiny_model_dir, micro) as ts:
        yield ts


@pytest.fixture(scope="module")
def continuous_long_server(tiny_model_dir, tmp_path_factory):
    with serve_variant(tmp_path_factory.mktemp("bad-input-continuous"), CONTINUOUS, tiny_model_dir,
                       continuous) as ts:
        yield ts


@pytest.fixture(scope="module", params=list(MODES))
def served(request):
    ts = request.getfixturevalue({"micro": "micro_server", "continuous": "continuous_long_server"}[request.param])
    server = Served(ts, MODES[request.param], request.param)
    server.pid = server.worker_pid()
    return server


def body(obj) -> bytes:
    return json.dumps(obj).encode()


def nested(depth: int) -> str:
    return "[" * depth + "]" * depth


def params(**parameters) -> bytes:
    return body({"inputs": PROMPT, "parameters": parameters})


def raw_params(text: str) -> bytes:
    return ('{"inputs": "%s", "parameters": {%s}}' % (PROMPT, text)).encode()  # noqa: UP031 - JSON braces stay single


JSON, TEXT = "application/json", "text/plain"
USER = {"role": "user", "content": "Hi"}
# (id, body, content type, status, the field the error names)
BAD = [
    ("empty-json", b"", JSON, 400, "inputs"),
    ("empty-text", b"", TEXT, 400, "inputs"),
    ("blank-text", b" \n\t ", TEXT, 400, "inputs"),
    ("non-utf8-text", b"\xff\xfe\xfd prompt", TEXT, 400, "inputs"),
    ("non-utf8-json", b'{"inputs": "\xc3\x28"}', JSON, 400, "inputs"),
    ("non-utf8-octets", b"\x80\x81", "application/octet-stream", 400, "inputs"),
    ("1mb-json", body({"inputs": "x" * 1_000_000}), JSON, 413, "inputs"),
    ("1mb-text", b"y" * 1_000_000, TEXT, 413, "inputs"),
    ("json-truncated", b'{"inputs": "x", "parameters": {', JSON, 400, "inputs"),
    ("json-trailing-comma", b'{"inputs": "x",}', JSON, 400, "inputs"),
    ("json-single-quotes", b"{'inputs': 'x'}", JSON, 400, "inputs"),
    ("json-array", body([{"inputs": PROMPT}]), JSON, 400, "inputs"),
    ("deep-5000-array", nested(5000).encode(), JSON, 400, "inputs"),
    ("deep-5000-inputs", ('{"inputs": ' + nested(5000) + "}").encode(), JSON, 400, "inputs"),
    ("deep-5000-parameters", raw_params('"stop": ' + '{"a": ' * 5000 + "1" + "}" * 5000), JSON, 400, "inputs"),
    ("integer-5000-digits", raw_params('"max_new_tokens": ' + "9" * 5000), JSON, 400, "inputs"),
    ("nan-temperature", raw_params('"temperature": NaN, "do_sample": true'), JSON, 400, "temperature"),
    ("infinity-top-p", raw_params('"top_p": Infinity'), JSON, 400, "top_p"),
    ("minus-infinity-penalty", raw_params('"repetition_penalty": -Infinity'), JSON, 400, "repetition_penalty"),
    ("1e999-max-new-tokens", raw_params('"max_new_tokens": 1e999'), JSON, 400, "max_new_tokens"),
    ("nan-seed", raw_params('"seed": NaN'), JSON, 400, "seed"),
    ("nan-top-k", raw_params('"top_k": NaN'), JSON, 400, "top_k"),
    ("nan-inputs", b'{"inputs": NaN}', JSON, 400, "inputs"),
    ("inputs-number", body({"inputs": 3}), JSON, 400, "inputs"),
    ("inputs-list", body({"inputs": [PROMPT]}), JSON, 400, "inputs"),
    ("parameters-list", body({"inputs": PROMPT, "parameters": [1]}), JSON, 400, "parameters"),
    ("stream-string", body({"inputs": PROMPT, "stream": "yes"}), JSON, 400, "stream"),
    ("top-k-string", params(top_k="5"), JSON, 400, "top_k"),
    ("do-sample-string", params(do_sample="true"), JSON, 400, "do_sample"),
    ("max-new-tokens-float", params(max_new_tokens=2.5), JSON, 400, "max_new_tokens"),
    ("max-new-tokens-bool", params(max_new_tokens=True), JSON, 400, "max_new_tokens"),
    ("stop-number", params(stop=7), JSON, 400, "stop"),
    ("details-number", params(details=1), JSON, 400, "details"),
    ("top-p-1.5", params(top_p=1.5), JSON, 400, "top_p"),
    ("top-p-0", params(top_p=0), JSON, 400, "top_p"),
    ("temperature-negative", params(temperature=-0.5), JSON, 400, "temperature"),
    ("max-new-tokens-0", params(max_new_tokens=0), JSON, 400, "max_new_tokens"),
    ("max-new-tokens-past-max-length", params(max_new_tokens=100_000), JSON, 400, "max_new_tokens"),
    ("seed-negative", params(seed=-1), JSON, 400, "seed"),
    ("seed-2-pow-63", params(seed=2**63), JSON, 400, "seed"),
    ("top-k-negative", params(top_k=-1), JSON, 400, "top_k"),
    ("penalty-0", params(repetition_penalty=0), JSON, 400, "repetition_penalty"),
    ("stop-9-sequences", params(stop=[str(i) for i in range(9)]), JSON, 400, "stop"),
    ("stop-empty-string", params(stop=[""]), JSON, 400, "stop"),
    ("unknown-top-level-key", body({"inputs": PROMPT, "prompt": PROMPT}), JSON, 400, "prompt"),
    ("unknown-parameter", params(num_beams=4), JSON, 400, "num_beams"),
    ("chat-bad-role", body({"messages": [{"role": "robot", "content": "Hi"}]}), JSON, 400, "messages"),
    ("chat-role-list", body({"messages": [{"role": ["user"], "content": "Hi"}]}), JSON, 400, "messages"),
    ("chat-no-content", body({"messages": [{"role": "user"}]}), JSON, 400, "messages"),
    ("chat-extra-key", body({"messages": [{**USER, "name": "x"}]}), JSON, 400, "messages"),
    ("chat-content-number", body({"messages": [{"role": "user", "content": 5}]}), JSON, 400, "messages"),
    ("chat-not-a-list", body({"messages": "Hi"}), JSON, 400, "messages"),
    ("chat-empty", body({"messages": []}), JSON, 400, "messages"),
    ("chat-assistant-last", body({"messages": [USER, {"role": "assistant", "content": "x"}]}), JSON, 400,
     "messages"),
    ("chat-system-late", body({"messages": [USER, {"role": "system", "content": "x"}]}), JSON, 400, "messages"),
    ("chat-and-inputs", body({"inputs": PROMPT, "messages": [USER]}), JSON, 400, "messages"),
    ("lone-surrogate-inputs", b'{"inputs": "a\\ud800b"}', JSON, 400, "inputs"),
    ("lone-surrogate-chat", b'{"messages": [{"role": "user", "content": "\\udc00"}]}', JSON, 400, "messages"),
    ("lone-surrogate-stop", raw_params('"stop": "\\ud83d"'), JSON, 400, "stop"),
    ("prompt-over-max-length", body({"inputs": " the" * 1200}), JSON, 400, "inputs"),
    ("text-prompt-over-max-length", (" the" * 1200).encode(), TEXT, 400, "inputs"),
    ("chat-over-max-length", body({"messages": [{"role": "user", "content": " the" * 1200}]}), JSON, 400,
     "messages"),
    ("form-encoded", b"inputs=Hi", "application/x-www-form-urlencoded", 400, "Content-Type"),
]
# Over TorchServe's max_request_size (6.5 MB by default): refused by the frontend, not the handler.
OVER_FRONTEND_LIMIT = b"z" * 7_000_000


def check_error(response, status: int, field: str) -> dict:
    assert response.status_code == status, response.text[:500]
    assert response.headers.get("content-type", "").startswith("application/json"), response.headers
    error = response.json()
    assert isinstance(error["error"], str) and error["error"]
    assert error["code"] == status and error["parameter"] == field, error
    assert error["error_type"] == ("payload_too_large" if status == 413 else "validation")
    return error


def strict_lines(response):
    """NDJSON lines as they arrive, refusing NaN/Infinity (json.dumps writes them for a nan logprob)."""
    def refuse(constant):
        raise AssertionError(f"{constant} in a response line")

    for line in response.iter_lines():
        if line:
            yield json.loads(line, parse_constant=refuse)


class Stream:
    """A streamed request in its own thread: status, token ids, error lines, when it ended."""

    def __init__(self, served: Served, payload: bytes, barrier: threading.Barrier = None):
        self.served, self.payload, self.barrier = served, payload, barrier
        self.status, self.ids, self.errors, self.lines = None, [], [], []
        self.first_line, self.done = threading.Event(), threading.Event()
        self.thread = threading.Thread(target=self._run, daemon=True)

    def start(self) -> "Stream":
        self.thread.start()
        return self

    def _run(self):
        try:
            if self.barrier is not None:
                self.barrier.wait()
            response = self.served.post(self.payload, stream=True)
            self.status = response.status_code
            for line in strict_lines(response):
                self.lines.append(line)
                if "token" in line:
                    self.ids.append(line["token"]["id"])
                    assert math.isfinite(line["token"]["logprob"])
                if "error" in line:
                    self.errors.append(line)
                self.first_line.set()
        except BaseException as exc:  # noqa: BLE001 - reported by join()
            self.errors.append(repr(exc))
        finally:
            self.done.set()

    def join(self) -> "Stream":
        self.thread.join(300)
        assert not self.thread.is_alive(), "stream did not end"
        return self


def greedy(n: int) -> bytes:
    return params(max_new_tokens=n)


@pytest.mark.parametrize("case", BAD, ids=[c[0] for c in BAD])
def test_bad_body_gets_a_4xx_json_error_naming_the_field(served, case):
    _, payload, content_type, status, field = case
    check_error(served.post(payload, content_type), status, field)
    assert served.worker_pid() == served.pid


def test_a_body_over_torchserves_max_request_size_is_refused_by_the_frontend(served):
    # Netty's aggregator answers 413 with an empty body before any handler code runs.
    response = served.post(OVER_FRONTEND_LIMIT, TEXT)
    assert response.status_code == 413 and response.content == b""
    assert served.worker_pid() == served.pid


def test_bad_bodies_leave_a_long_greedy_stream_and_the_worker_alone(served):
    long = LONG[served.mode]
    alone = Stream(served, greedy(long)).start().join()
    assert alone.status == 200 and not alone.errors and len(alone.ids) == long
    log_start = len(served.ts.model_log())

    # The first bad bodies arrive with the stream (micro-batching: its frontend batch and
    # micro-batch; continuous: its admission), the rest while it streams. The senders of the rest
    # are started before and wait for its first line: started after it, ~25 thread starts, each
    # waiting for the GIL beside the stream's reader, can outlast the stream on a loaded host (a
    # fresh clone failed so once).
    first = BAD[:BATCH - 1]
    barrier = threading.Barrier(len(first) + 1)
    stream = Stream(served, greedy(long), barrier)
    results, while_running = {}, []

    def send(case, wait):
        wait()
        while_running.append((case[0], not stream.done.is_set()))
        results[case[0]] = served.post(case[1], case[2])

    senders = [threading.Thread(target=send, args=(case, barrier.wait)) for case in first]
    rest = [threading.Thread(target=send, args=(case, lambda: stream.first_line.wait(300)))
            for case in BAD[BATCH - 1:]]
    for t in senders + rest:
        t.start()
    stream.start()
    for t in senders + rest:
        t.join(300)
    over = served.post(OVER_FRONTEND_LIMIT, TEXT)
    stream.join()

    late = [name for name, running in while_running if not running]
    assert not late, f"the stream ended before these were sent (make LONG longer): {late}"
    for name, _payload, _content_type, status, field in BAD:
        check_error(results[name], status, field)
    assert over.status_code == 413
    assert stream.status == 200 and not stream.errors
    assert stream.ids == alone.ids
    assert served.worker_pid() == served.pid
    assert all(w["status"] == "READY" for w in served.workers())
    log = served.ts.model_log()[log_start:]
    assert "Traceback" not in log and "internal error" not in log


# Values in range that push the arithmetic to its edges: each once failed the whole micro-batch
# (a nan probability in torch.multinomial) or streamed "logprob": NaN, which is not JSON.
EXTREME = [
    params(max_new_tokens=12, do_sample=True, temperature=1e-300, seed=1),
    params(max_new_tokens=12, do_sample=True, temperature=1e300, seed=2),
    params(max_new_tokens=12, do_sample=True, top_p=5e-324, seed=3),
    params(max_new_tokens=12, repetition_penalty=1e-300),
    params(max_new_tokens=12, do_sample=True, repetition_penalty=1e-300, seed=4),
    params(max_new_tokens=12, do_sample=True, repetition_penalty=1e300, temperature=1e-5),
    params(max_new_tokens=12, do_sample=True, top_k=10**30, top_p=1e-300, seed=2**63 - 1),
]


def test_extreme_parameters_in_range_share_a_batch_with_a_good_stream(served):
    alone = Stream(served, greedy(64)).start().join()
    assert alone.status == 200 and len(alone.ids) == 64
    barrier = threading.Barrier(1 + len(EXTREME))
    good = Stream(served, greedy(64), barrier).start()
    extremes = [Stream(served, payload, barrier).start() for payload in EXTREME]
    for s in [good] + extremes:
        s.join()
    assert good.status == 200 and not good.errors and good.ids == alone.ids
    for s in extremes:
        assert s.status == 200 and not s.errors, (s.payload, s.errors)
        assert s.lines[-1]["details"]["generated_tokens"] == len(s.ids) > 0
    assert served.worker_pid() == served.pid


def test_the_size_limit_counts_the_bytes_the_client_sent(served):
    # 33 kB of UTF-8, 66 kB once re-encoded with \\u escapes (the worker's decoded JSON was
    # measured that way, and got a 413): the body is under the limit and reaches the tokenizer.
    payload = json.dumps({"inputs": "猫" * 11000}, ensure_ascii=False).encode()
    error = check_error(served.post(payload), 400, "inputs")
    assert "tokens" in error["error"]


def test_a_json_string_body_is_its_prompt(served):
    text_ids = [line["token"]["id"] for line in strict_lines(served.post(PROMPT.encode(), TEXT, stream=True))]
    json_ids = [line["token"]["id"] for line in strict_lines(served.post(body(PROMPT), JSON, stream=True))]
    assert json_ids == text_ids and len(text_ids) > 0
