"""The shared streaming client (scripts/streaming_client.py): line reassembly of NDJSON split
across SageMaker PayloadParts at any byte, TorchServe's messages into a timed record, and the
failures each script reports (an error message, a cut stream, an error status); and stream.py,
loadtest.py and neuron_smoke.py, which read their streams through it."""
import json
import random
import time
from http.server import BaseHTTPRequestHandler

import pytest

from scripts import loadtest, neuron_smoke, stream
from scripts.streaming_client import (
    LineIterator,
    RequestRecord,
    StreamError,
    TorchServeAdapter,
    iter_messages,
    post_chunks,
    read_message,
    read_stream,
    stream_one,
)

from loopback_http import loopback_server

LINES = [{"token": {"id": 1, "text": "Hello", "logprob": -0.1, "special": False}},
         {"token": {"id": 2, "text": " 🦙🎉", "logprob": -0.2, "special": False}},
         {"token": {"id": 3, "text": " 你好，世界", "logprob": -0.3, "special": False}},
         {"token": {"id": 4, "text": "\n", "logprob": -0.4, "special": False}, "generated_text": "Hello 🦙🎉 你好，世界\n",
          "details": {"finish_reason": "length", "generated_tokens": 4, "input_length": 2, "seed": None}}]
BODY = "".join(json.dumps(line, ensure_ascii=False) + "\n" for line in LINES).encode("utf-8")


def split_at(data: bytes, cuts):
    bounds = [0, *sorted(cuts), len(data)]
    return [data[a:b] for a, b in zip(bounds, bounds[1:])]


def as_events(parts):
    return [{"PayloadPart": {"Bytes": p}} for p in parts]


@pytest.mark.parametrize("seed", range(40))
def test_random_splits_reassemble_every_line(seed):
    rng = random.Random(seed)
    cuts = rng.sample(range(1, len(BODY)), rng.randint(1, 30))
    assert list(iter_messages(as_events(split_at(BODY, cuts)))) == LINES


def test_every_single_byte_cut_including_inside_multibyte_characters():
    emoji_start = BODY.index("🦙".encode())
    for cut in range(emoji_start - 2, emoji_start + 6):
        assert list(iter_messages(split_at(BODY, [cut]))) == LINES
    assert list(iter_messages([bytes([b]) for b in BODY])) == LINES


def test_several_lines_in_one_part_and_a_last_line_without_newline():
    assert list(LineIterator([b"a\nb\nc", b"d"])) == [b"a", b"b", b"cd"]


def test_sse_events_parse_too():
    events = b'data: {"index": 1}\n\ndata: {"index": 2}\n\n'
    assert list(iter_messages(split_at(events, [7, 20]))) == [{"index": 1}, {"index": 2}]


def test_stream_errors_raise():
    with pytest.raises(RuntimeError, match="ModelStreamError: boom"):
        list(LineIterator([{"ModelStreamError": {"Message": "boom", "ErrorCode": "x"}}]))


# -- the shared client (scripts/streaming_client.py) and the scripts that use it, against a fake TorchServe --


class FakeTorchServe(BaseHTTPRequestHandler):
    """/predictions/<model>: ``ok`` streams max_new_tokens tokens, ``error`` an error message after
    one token, ``cut`` one token and then closes the connection mid-stream, ``bad`` answers 400."""

    protocol_version = "HTTP/1.1"

    def log_message(self, *args):
        pass

    def do_POST(self):
        body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        model = self.path.rsplit("/", 1)[-1]
        if model == "bad":
            payload = b'{"code": 400, "error": "max_new_tokens: must be positive"}'
            self.send_response(400)
            self.send_header("Content-Length", str(len(payload)))
            self.end_headers()
            self.wfile.write(payload)
            return
        n = body["parameters"].get("max_new_tokens") or 3
        self.send_response(200)
        self.send_header("Transfer-Encoding", "chunked")
        self.end_headers()
        lines = [LINES[i % 3] for i in range(n)]
        lines[-1] = {**LINES[3], "details": {**LINES[3]["details"], "generated_tokens": n}}
        if model == "error":
            lines = lines[:1] + [{"code": 503, "error": "boom"}]
        elif model == "cut":
            lines = lines[:1]
        for line in lines:
            data = (json.dumps(line, ensure_ascii=False) + "\n").encode()
            self.wfile.write(b"%x\r\n%s\r\n" % (len(data), data))
            self.wfile.flush()
            time.sleep(0.005)
        if model == "cut":
            self.wfile.write(b"40\r\npartial")  # a chunk that never ends: the worker died
            self.wfile.flush()
            self.close_connection = True
            return
        self.wfile.write(b"0\r\n\r\n")


@pytest.fixture(scope="module")
def fake_torchserve():
    with loopback_server(FakeTorchServe) as url:
        yield url


@pytest.fixture
def workdir(tmp_path):
    (tmp_path / "key_file.json").write_text(json.dumps({"inference": {"key": "k"}, "management": {"key": "m"}}))
    return tmp_path


def test_read_message_times_tokens_and_ends_at_the_last_message():
    record = RequestRecord("torchserve", None, 4)
    assert [read_message(m, record, float(i)) for i, m in enumerate(LINES)] == [False, False, False, True]
    assert record.token_times == [0.0, 1.0, 2.0, 3.0] and "".join(record.text) == LINES[3]["generated_text"]
    assert record.details == LINES[3]["details"] and record.output_tokens == 4 and record.finish_reason == "length"


def test_read_message_ends_an_sse_stream_at_its_generated_text_and_raises_an_error_message():
    record = RequestRecord("torchserve", None, 2)
    assert not read_message({"index": 1, "token": {"id": 1, "text": "a"}, "generated_text": None, "details": None},
                            record, 1.0)
    assert read_message({"index": 2, "token": {"id": 2, "text": "b"}, "generated_text": "ab", "details": None},
                        record, 2.0)
    with pytest.raises(StreamError, match="boom") as info:
        read_message({"code": 503, "error": "boom"}, record, 3.0)
    assert info.value.describe() == "503: boom"


def test_stream_one_records_tokens_and_each_kind_of_failure(fake_torchserve):
    ok = stream_one(TorchServeAdapter(fake_torchserve, "ok"), "Hi", 5, timeout=30)
    assert ok.ok and ok.output_tokens == 5 and len(ok.token_times) == 5 and ok.input_tokens is None
    errors = {model: stream_one(TorchServeAdapter(fake_torchserve, model), "Hi", 5, timeout=30).error
              for model in ("error", "cut", "bad")}
    assert errors["error"] == "503: boom"
    assert "was cut before its last message" in errors["cut"]
    assert errors["bad"].startswith("HTTP 400: ")


def test_a_cut_stream_raises_a_stream_error_that_says_so(fake_torchserve):
    record = RequestRecord("torchserve", None, 5)
    chunks = post_chunks(f"{fake_torchserve}/predictions/cut", {"inputs": "Hi", "parameters": {}}, read_timeout=30)
    with pytest.raises(StreamError, match="was cut before its last message"):
        read_stream(iter_messages(chunks), record)
    assert len(record.token_times) == 1 and record.end is None


def test_loadtest_round_reports_its_figures_and_fails_on_a_failed_stream(fake_torchserve):
    figures = loadtest.run_round(TorchServeAdapter(fake_torchserve, "ok"), 3, 4)
    assert set(figures) == {"concurrency", "ttft_ms_p50", "ttft_ms_max", "tokens", "wall_s",
                            "aggregate_tokens_per_s", "per_stream_tokens_per_s"}
    assert figures["concurrency"] == 3 and figures["tokens"] == 12 and figures["aggregate_tokens_per_s"] > 0
    with pytest.raises(StreamError, match="3 of 3 streams failed: 503: boom"):
        loadtest.run_round(TorchServeAdapter(fake_torchserve, "error"), 3, 4)


def test_loadtest_prints_one_json_line_per_concurrency(fake_torchserve, workdir, capsys):
    assert loadtest.main(["--url", fake_torchserve, "--model", "ok", "--workdir", str(workdir),
                          "--concurrency", "1", "2", "--rounds", "1", "--max-new-tokens", "3"]) == 0
    lines = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
    assert [line["concurrency"] for line in lines] == [1, 2] and [line["tokens"] for line in lines] == [3, 6]
    assert loadtest.main(["--url", fake_torchserve, "--model", "bad", "--workdir", str(workdir)]) == 1
    assert "error: 1 of 1 streams failed: HTTP 400" in capsys.readouterr().err


@pytest.mark.parametrize("model,code,err", [
    ("ok", 0, "[finish_reason=length input_length=2 generated_tokens=4 ttft="),
    ("error", 1, "\nerror: boom\n"),
    ("cut", 1, "was cut before its last message (did the worker die?"),
    ("bad", 1, "error: HTTP 400: {\"code\": 400, \"error\": \"max_new_tokens: must be positive\"}"),
])
def test_stream_py_prints_the_tokens_and_says_why_a_stream_failed(fake_torchserve, workdir, capsys, model, code, err):
    argv = ["Hi", "--url", fake_torchserve, "--model", model, "--workdir", str(workdir), "--max-new-tokens", "4",
            "--details"]
    assert stream.main(argv) == code
    out, stderr = capsys.readouterr()
    assert err in stderr, stderr
    if model == "ok":
        assert out == LINES[3]["generated_text"] + "\n"
    elif model != "bad":
        assert out == "Hello"  # the token that came before the failure


def test_neuron_smoke_streams_its_prompt_through_the_shared_client(fake_torchserve, capsys):
    report = neuron_smoke.stream_prompt(TorchServeAdapter(fake_torchserve, "ok", on_text=neuron_smoke.echo), "Hi", 4)
    assert capsys.readouterr().out == LINES[3]["generated_text"] + "\n"
    assert report["text"] == LINES[3]["generated_text"] and report["details"]["generated_tokens"] == 4
    assert 0 < report["ttft_s"] <= report["total_s"]
    with pytest.raises(StreamError, match="cut before its last message"):
        neuron_smoke.stream_prompt(TorchServeAdapter(fake_torchserve, "cut"), "Hi", 4)
