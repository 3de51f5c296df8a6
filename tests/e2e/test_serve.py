"""Through a real TorchServe: chunked NDJSON streams, batching across micro-batches, errors."""
from __future__ import annotations

import json
import re
import subprocess
import threading

import pytest
import requests

from scripts.tsctl import read_log

PROMPTS = [
    "The function returns", "If the object is", "A list of", "The default value is",
    "When the file", "This module provides", "Return the number of", "The following",
    "In the case of", "An exception is raised", "The result is a", "Each item in the",
    "It is possible to", "For example, the", "The name of the", "All of the",
]


def read_stream(response):
    lines = [json.loads(line) for line in response.iter_lines() if line]
    return lines


def parse_chunked(raw: str) -> list:
    """Split a raw chunked HTTP body (as curl --raw prints it) into its chunks."""
    chunks = []
    while raw:
        size_line, _, rest = raw.partition("\r\n")
        size = int(size_line.split(";")[0], 16)
        if size == 0:
            break
        data = rest.encode()[:size].decode()
        chunks.append(data)
        raw = rest.encode()[size + 2:].decode()
    return chunks


def generate(client, prompt, max_new_tokens):
    r = client.post({"inputs": prompt, "parameters": {"max_new_tokens": max_new_tokens}})
    assert r.status_code == 200, r.text
    return read_stream(r)


@pytest.fixture(scope="module")
def references(client):
    """Each prompt's greedy output, served alone."""
    return {p: generate(client, p, 6 + i % 5) for i, p in enumerate(PROMPTS)}


def test_server_starts_and_requires_the_token(server, client):
    assert server.ready_seconds < 300
    for auth in ({}, {"Authorization": "Bearer wrong"}):
        r = requests.post(client.url, data="hi", headers={"Content-Type": "text/plain", **auth}, timeout=30)
        # TorchServe 0.12 answers a missing or wrong key with 400 InvalidKeyException.
        assert r.status_code == 400 and r.json()["type"] == "InvalidKeyException"


def test_registration_api_is_off(server):
    from scripts.tsctl import read_key

    headers = {"Authorization": f"Bearer {read_key(server.workdir, 'management')}"}
    assert requests.get(f"{server.url('management')}/models", headers=headers, timeout=30).status_code == 200
    r = requests.post(f"{server.url('management')}/models?url=x.mar", headers=headers, timeout=30)
    assert r.status_code == 405 and r.json()["type"] == "MethodNotAllowedException"


def test_curl_stream_is_chunked_ndjson(server, client):
    """curl --raw shows the HTTP chunk framing: several chunks, and lines that parse."""
    cmd = ["curl", "-sS", "-N", "--raw", "-D", "-", client.url,
           "-H", f"Authorization: Bearer {server.key}", "-H", "Content-Type: text/plain",
           "-d", "Today the weather is"]
    out = subprocess.run(cmd, capture_output=True, timeout=120, check=True).stdout.decode()
    head, _, raw = out.partition("\r\n\r\n")
    assert re.search(r"(?im)^transfer-encoding: chunked", head)
    assert re.search(r"(?im)^content-type: application/x-ndjson", head)
    chunks = parse_chunked(raw)
    assert len(chunks) > 1
    lines = [json.loads(line) for line in "".join(chunks).splitlines()]
    assert all("token" in line for line in lines)
    final = lines[-1]
    assert final["details"]["finish_reason"] in ("length", "eos_token")
    assert final["generated_text"] == "".join(line["token"]["text"] for line in lines)
    assert final["details"]["generated_tokens"] == len(lines) == 64


def test_streamed_tokens_leave_no_log_line_each_and_the_frontend_logs_each_line_once(server, client):
    """log4j2.xml (config.properties: vmargs): TorchServe's default logs "Sending response" for every
    streamed token, three lines for every call to the worker (a token each under continuous batching),
    and writes every frontend line to ts_log.log twice."""
    assert len(generate(client, "Once upon a time", 32)) == 32
    log = read_log(server.workdir, "ts_log")
    for per_token in ("Sending response", "Flushing req.cmd", "Looping backend response", "Backend response time"):
        assert per_token not in log, per_token
    assert "WorkerThread - Connecting to:" in log  # the worker thread's other lines are still there
    assert "State change WORKER_STARTED -> WORKER_MODEL_LOADED" in log  # and its debug lines
    loaded = [line for line in log.splitlines() if "Successfully loaded metrics configuration" in line]
    assert len(loaded) == 1, loaded


def test_concurrent_requests_each_get_their_own_stream(client, references, server):
    results, errors = {}, []
    barrier = threading.Barrier(len(PROMPTS))

    def worker(i, prompt):
        try:
            barrier.wait()
            results[prompt] = generate(client, prompt, 6 + i % 5)
        except Exception as exc:  # noqa: BLE001 - collected for the main thread, which asserts none
            errors.append(exc)

    threads = [threading.Thread(target=worker, args=(i, p)) for i, p in enumerate(PROMPTS)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=300)
    assert not errors
    assert len({ref[-1]["generated_text"] for ref in references.values()}) > len(PROMPTS) // 2, \
        "references must differ, or a mixed-up stream would go unnoticed"
    for prompt, lines in results.items():
        ref = references[prompt]
        assert [line["token"]["id"] for line in lines] == [line["token"]["id"] for line in ref], prompt
        assert lines[-1]["generated_text"] == ref[-1]["generated_text"]
        assert sum(1 for line in lines if "details" in line) == 1 and "details" in lines[-1]
    batches = [int(n) for n in re.findall(r"batch of (\d+) requests", server.model_log())]
    assert max(batches) > 4, f"requests were never batched beyond one micro-batch: {batches}"


BAD = [
    ({"inputs": "x", "parameters": {"top_p": 3}}, "application/json", "top_p"),
    ('{"inputs": "x",', "application/json", "inputs"),
    ({"inputs": "x", "parameters": {"max_new_tokens": 5000}}, "application/json", "max_new_tokens"),
    (b"\xff\xfe", "text/plain", "inputs"),
]


def test_bad_requests_in_a_batch_get_their_own_400(client, references):
    jobs = [(PROMPTS[i], None) for i in range(4)] + [(None, b) for b in BAD]
    jobs = [jobs[i] for i in (0, 4, 1, 5, 2, 6, 3, 7)]  # interleave good and bad
    out = [None] * len(jobs)
    barrier = threading.Barrier(len(jobs))

    def worker(k, prompt, bad):
        barrier.wait()
        if prompt is not None:
            out[k] = client.post({"inputs": prompt, "parameters": {"max_new_tokens": 6 + PROMPTS.index(prompt) % 5}})
        else:
            out[k] = client.post(bad[0], content_type=bad[1])
        out[k].lines = [line for line in out[k].iter_lines() if line]

    threads = [threading.Thread(target=worker, args=(k, p, b)) for k, (p, b) in enumerate(jobs)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=300)
    for (prompt, bad), r in zip(jobs, out):
        if prompt is not None:
            assert r.status_code == 200
            lines = [json.loads(line) for line in r.lines]
            assert lines[-1]["generated_text"] == references[prompt][-1]["generated_text"]
        else:
            assert r.status_code == 400, r.lines
            body = json.loads(b"".join(r.lines))
            assert body["parameter"] == bad[2] and body["error"]
    # the worker survived
    assert generate(client, PROMPTS[0], 3)[-1]["details"]["generated_tokens"] == 3


def test_form_encoded_curl_gets_a_400_that_says_what_to_send(server, client):
    cmd = ["curl", "-sS", "-w", "\n%{http_code}", client.url, "-H", f"Authorization: Bearer {server.key}",
           "-d", "Today the weather is"]
    body, status = subprocess.run(cmd, capture_output=True, text=True, timeout=60, check=True).stdout.rsplit("\n", 1)
    assert status == "400"
    assert "Content-Type: text/plain" in json.loads(body)["error"]


def test_non_streaming_json(client, references):
    prompt = PROMPTS[0]
    r = client.post({"inputs": prompt, "stream": False, "parameters": {"max_new_tokens": 6}}, stream=False)
    assert r.status_code == 200 and r.headers["content-type"].startswith("application/json")
    assert r.json()[0]["generated_text"] == references[prompt][-1]["generated_text"]


def test_the_worker_runs_the_native_kernels_the_artifact_ships(server, model_store):
    """The build compiled the torch backend's CPU kernels into the archive; the worker loads those,
    so a serving host needs no compiler (and compiles nothing)."""
    from llama_engine.backends import cpu_kernels
    from llama_engine.cpu import cpu_flags

    shipped = sorted(p.name for p in (model_store / "tiny-llama" / "llama_engine" / "backends").glob("*.so"))
    assert shipped == sorted(cpu_kernels.library_name(isa) for isa in cpu_kernels.ISAS)
    isa = cpu_kernels.isa_for(cpu_flags())
    if isa is None:
        pytest.skip("this CPU runs none of the native kernels' instruction sets")
    log = server.model_log()
    loaded = re.search(r"native CPU kernels: (\S+) \((\S+)\)", log)
    assert loaded, "the worker did not log which native kernels it loaded"
    assert loaded.group(1) == isa
    assert loaded.group(2).endswith(f"llama_engine/backends/{cpu_kernels.library_name(isa)}")
    assert str(cpu_kernels.cache_dir()) not in loaded.group(2)
