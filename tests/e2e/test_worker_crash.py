"""A worker SIGKILLed mid-stream, mid-request and while idle, in both batching modes.

What a client of a crashed worker gets comes from TorchServe's frontend (the worker is gone):
a non-stream request in the batch gets a 5xx JSON ``Worker died.`` at once; a stream already
under way is cut (the frontend closes the connection before the last chunk), which every
HTTP client reports as an error at once. TorchServe restarts the worker, and requests after
that are served with the same tokens as before. Each test prints what it measured (time to
the client's error, time to serving again); `docs/operations.md` quotes them.

No assertion is about speed: the client's read timeout (``HANG``) only tells a prompt error
from a hang, which is what the issue reported.
"""
from __future__ import annotations

import json
import os
import signal
import threading
import time

import pytest
import requests

from scripts.bench.frontend_cpu import cpu_seconds

from conftest import CONTINUOUS, serve_variant

MODES = {"micro": "tiny-llama", "continuous": CONTINUOUS}
HANG = 60.0  # s of silence that would mean a client was left hanging
PROMPT = "Once upon a time"
LONG = {"inputs": PROMPT, "parameters": {"max_new_tokens": 400}}
#: CPU seconds that tell a worker generating from one waiting on its socket.
BUSY_CPU_S = 0.2


@pytest.fixture(scope="module", params=sorted(MODES))
def crash_server(request, tmp_path_factory, tiny_model_dir):
    model = MODES[request.param]
    with serve_variant(tmp_path_factory.mktemp(f"crash-{request.param}"), model, tiny_model_dir,
                       lambda data: None) as server:
        server.model = model
        server.baseline = stream_tokens(server, LONG)
        assert server.baseline["final"]["details"]["finish_reason"] == "length"  # long enough to kill mid-way
        yield server


def url(server) -> str:
    return f"{server.url()}/predictions/{server.model}"


def worker(server) -> dict:
    r = requests.get(f"{server.url('management')}/models/{server.model}",
                     headers=server.auth_headers("management"), timeout=10)
    workers = r.json()[0]["workers"]
    return workers[0] if workers else {}


def kill_worker(server) -> tuple:
    """SIGKILL the model's READY worker (waiting for one if a restart is under way)."""
    deadline = time.monotonic() + 120
    while worker(server).get("status") != "READY":
        assert time.monotonic() < deadline, f"no READY worker to kill\n{server.log_tail()}"
        time.sleep(0.2)
    pid = int(worker(server)["pid"])
    os.kill(pid, signal.SIGKILL)
    return pid, time.monotonic()


def worker_pid(server) -> int:
    """The pid of the model's worker (waiting until the frontend reports one)."""
    deadline = time.monotonic() + 120
    while worker(server).get("pid") is None:
        assert time.monotonic() < deadline, f"no worker\n{server.log_tail()}"
        time.sleep(0.2)
    return int(worker(server)["pid"])


def wait_until_the_worker_computes(pid: int, before: float, timeout: float = 30.0) -> None:
    """Until worker ``pid`` has used :data:`BUSY_CPU_S` more CPU than ``before``: it is generating. (The
    frontend's line for each batch it writes to a worker, "Flushing req.cmd", was the sign before; it is one a
    token under continuous batching, and log4j2.xml leaves it out. An idle worker waits on its socket.)"""
    deadline = time.monotonic() + timeout
    while cpu_seconds(pid) - before < BUSY_CPU_S:
        assert time.monotonic() < deadline, "the worker never started computing the request"
        time.sleep(0.02)


def wait_for_new_worker(server, old_pid: int, killed_at: float) -> float:
    """Seconds from the kill until a new worker answers a request."""
    deadline = killed_at + 120
    while time.monotonic() < deadline:
        if worker(server).get("pid") not in (None, old_pid) and worker(server).get("status") == "READY":
            r = requests.post(url(server), json={"inputs": "hi", "stream": False, "parameters": {"max_new_tokens": 2}},
                              headers=server.auth_headers(), timeout=HANG)
            if r.status_code == 200:
                return time.monotonic() - killed_at
        time.sleep(0.2)
    raise AssertionError(f"no new worker serving 120 s after the kill\n{server.log_tail()}")


def stream_tokens(server, body: dict, started: threading.Event = None) -> dict:
    """Read one NDJSON stream; the outcome says whether it ended with its final message or an error."""
    texts, final, error = [], None, None
    begun = time.monotonic()
    try:
        with requests.post(url(server), json=body, headers=server.auth_headers(), stream=True,
                           timeout=(10, HANG)) as r:
            assert r.status_code == 200, r.text
            for line in r.iter_lines():
                if not line:
                    continue
                message = json.loads(line)
                texts.append(message.get("token", {}).get("text", ""))
                final = message if "details" in message else final
                if started is not None and len(texts) >= 3:
                    started.set()
    except requests.RequestException as exc:
        error = exc
    return {"text": "".join(texts), "final": final, "error": error, "ended_at": time.monotonic(),
            "seconds": time.monotonic() - begun}


def test_streams_under_way_are_cut_at_once_and_served_after_the_restart(crash_server):
    results, threads, events = [None, None], [], [threading.Event(), threading.Event()]
    for i in range(2):
        threads.append(threading.Thread(target=lambda i=i: results.__setitem__(i, stream_tokens(crash_server, LONG,
                                                                                                events[i]))))
        threads[-1].start()
    for event in events:
        assert event.wait(60), "the streams never started"
    pid, killed_at = kill_worker(crash_server)
    for thread in threads:
        thread.join(HANG + 30)
    for result in results:
        assert result["final"] is None, "a stream of the killed worker finished normally"
        assert isinstance(result["error"], requests.exceptions.ChunkedEncodingError), result["error"]
        assert result["text"] and crash_server.baseline["text"].startswith(result["text"])
    to_error = max(r["ended_at"] for r in results) - killed_at
    back = wait_for_new_worker(crash_server, pid, killed_at)
    print(f"\n[{crash_server.model}] mid-stream kill: clients' error after {to_error:.2f} s; serving again after {back:.1f} s")
    assert stream_tokens(crash_server, LONG)["text"] == crash_server.baseline["text"]


def test_a_non_stream_request_in_the_killed_batch_gets_an_error_at_once(crash_server):
    """Micro-batching: a 5xx JSON ``Worker died.``. Continuous batching answers every request,
    non-stream too, as a chunked response from its first step on (TorchServe's continuous
    batching has no other way to keep a request in the running batch), so there the
    connection is cut, as for a stream."""
    pid = worker_pid(crash_server)
    before = cpu_seconds(pid)
    outcome = {}
    body = {**LONG, "stream": False}

    def send():
        try:
            outcome["response"] = requests.post(url(crash_server), json=body, headers=crash_server.auth_headers(),
                                                timeout=HANG)
        except requests.RequestException as exc:
            outcome["error"] = exc

    thread = threading.Thread(target=send)
    thread.start()
    wait_until_the_worker_computes(pid, before)
    pid, killed_at = kill_worker(crash_server)
    thread.join(HANG + 10)
    to_error = time.monotonic() - killed_at
    if crash_server.model == MODES["micro"]:
        assert "error" not in outcome, outcome
        response = outcome["response"]
        assert 500 <= response.status_code < 600, response.text
        assert response.json()["message"] == "Worker died."
        seen = f"HTTP {response.status_code} {response.json()['message']}"
    else:
        assert isinstance(outcome.get("error"), requests.exceptions.ChunkedEncodingError), outcome
        seen = "connection cut"
    back = wait_for_new_worker(crash_server, pid, killed_at)
    print(f"\n[{crash_server.model}] in-flight non-stream kill: {seen} after {to_error:.2f} s; "
          f"serving again after {back:.1f} s")


def test_a_kill_while_idle_costs_the_next_client_only_the_restart(crash_server):
    pid, killed_at = kill_worker(crash_server)
    deadline = killed_at + 30
    while worker(crash_server).get("status") == "READY" and worker(crash_server).get("pid") == pid:
        assert time.monotonic() < deadline, "the frontend did not notice the dead worker"
        time.sleep(0.05)
    result = stream_tokens(crash_server, LONG)  # queued until the new worker is up
    assert result["error"] is None, result["error"]
    assert result["text"] == crash_server.baseline["text"]
    print(f"\n[{crash_server.model}] idle kill: the next stream finished {result['ended_at'] - killed_at:.1f} s after "
          f"the kill ({result['seconds']:.1f} s after it was sent)")


def test_stream_py_says_the_stream_was_cut(crash_server):
    import subprocess
    import sys
    from pathlib import Path

    root = Path(__file__).resolve().parents[2]
    cli = subprocess.Popen([sys.executable, str(root / "scripts" / "stream.py"), PROMPT, "--model", crash_server.model,
                            "--workdir", str(crash_server.workdir), "--max-new-tokens", "400"],
                           stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        assert cli.stdout.read(20), "stream.py printed no tokens"
        pid, killed_at = kill_worker(crash_server)
        _, err = cli.communicate(timeout=HANG)
    finally:
        cli.kill()
    assert cli.returncode == 1
    assert "was cut before its last message" in err, err
    wait_for_new_worker(crash_server, pid, killed_at)
