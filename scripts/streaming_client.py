"""The one streaming client of every script: send a request, read the streamed answer, time
each token, and say why a stream failed.

Reading, from any source of byte chunks (an HTTP response, SageMaker's event stream):

* :class:`LineIterator` reassembles whole lines (and so whole UTF-8 characters) from chunks
  split at arbitrary byte offsets, and raises SageMaker's stream errors.
* :func:`parse_line` reads one line: an NDJSON object, or the JSON of an SSE ``data:`` event;
  :func:`iter_messages` turns chunks into those messages.
* :func:`read_message` reads one of TorchServe's messages (this project's handler, NDJSON or
  TGI-style SSE) into a :class:`RequestRecord`: a timestamp and the text of every token, and
  the final message's ``details``; the last message is the one with ``details`` or
  ``generated_text``. An error message raises :class:`StreamError`. :func:`read_stream` reads
  messages until the last.

Sending, every request timed the same way whatever the server: ``start`` before the request
is sent, one timestamp per token as its line arrives, ``end`` when the request's last line
arrives.

* :func:`post_chunks` POSTs a JSON body and yields the answer's chunks as they arrive; an HTTP
  error status, a stream cut before its last message (its worker died) and silence past the
  read timeout raise :class:`StreamError` with a sentence that says so.
* :func:`stream_one` sends one request through an :class:`Adapter` (the server's protocol:
  :class:`TorchServeAdapter` here, the bench's peers in ``scripts/bench/clients.py``) and
  records its failure instead of raising it; :func:`run_wave` sends several at once,
  :func:`run_schedule` at given times (open loop).

A prompt is a string, or a :class:`scripts.bench.prompts.Prompt` (text and token ids).
"""
from __future__ import annotations

import json
import threading
import time
from abc import ABC, abstractmethod
from dataclasses import dataclass, field
from typing import Callable, Dict, Iterable, Iterator, List, Optional, Tuple

import requests

#: Called with each token's text as it arrives.
OnText = Optional[Callable[[str], None]]


class StreamError(RuntimeError):
    """A stream that failed: an error status, an error message in the stream, a cut, silence.

    ``code`` is the status an error message in the stream carried (TorchServe's handler sends
    ``{"error": ..., "code": ...}``); the text is the error itself.
    """

    def __init__(self, message: str, code=None):
        super().__init__(message)
        self.code = code

    def describe(self) -> str:
        """The error as a request's record keeps it: ``<code>: <error>`` for an error message."""
        return f"{self.code}: {self}" if self.code is not None else str(self)


class StreamTimeout(StreamError):
    """No data for the read timeout."""


# -- reading --------------------------------------------------------------------------------------


class LineIterator:
    """Yield complete lines (bytes, without the newline) from an iterable of byte chunks.

    Accepts raw ``bytes`` chunks or SageMaker event-stream events
    (``{"PayloadPart": {"Bytes": b"..."}}``); a line may span any number of chunks, and a chunk
    may hold several lines. Lines are only decoded by the caller, once whole, so a multi-byte
    character split across chunks is never decoded in halves.
    """

    def __init__(self, chunks: Iterable):
        self.chunks = iter(chunks)
        self.buffer = bytearray()

    def __iter__(self) -> Iterator[bytes]:
        for chunk in self.chunks:
            self.buffer += _payload(chunk)
            while True:
                newline = self.buffer.find(b"\n")
                if newline < 0:
                    break
                line = bytes(self.buffer[:newline])
                del self.buffer[:newline + 1]
                yield line
        if self.buffer:
            yield bytes(self.buffer)
            self.buffer.clear()


def _payload(chunk) -> bytes:
    if isinstance(chunk, (bytes, bytearray)):
        return bytes(chunk)
    if "PayloadPart" in chunk:
        return chunk["PayloadPart"]["Bytes"]
    for error in ("ModelStreamError", "InternalStreamFailure"):
        if error in chunk:
            raise StreamError(f"{error}: {chunk[error].get('Message', chunk[error])}")
    return b""


def sse_data(line: bytes) -> Optional[bytes]:
    """The payload of an SSE ``data:`` line; None for comments, event names and blank separators."""
    if not line.startswith(b"data:"):
        return None
    return line[5:].strip()


def parse_line(line: bytes) -> Optional[dict]:
    """One line of a stream: an NDJSON object or an SSE ``data:`` event's JSON; None when blank."""
    line = line.strip()
    if not line:
        return None
    if line.startswith(b"data:"):
        line = line[len(b"data:"):].strip()
    return json.loads(line.decode("utf-8"))


def iter_messages(chunks: Iterable) -> Iterator[dict]:
    """Parse a stream into messages: NDJSON lines, or TGI-style SSE ``data:`` events."""
    for line in LineIterator(chunks):
        message = parse_line(line)
        if message is not None:
            yield message


@dataclass
class RequestRecord:
    system: str
    input_tokens: Optional[int]  # None when the prompt was only text
    requested_tokens: Optional[int]
    start: float = 0.0  # perf_counter when sent
    token_times: List[float] = field(default_factory=list)  # perf_counter per token line
    end: Optional[float] = None  # perf_counter of the request's last line
    reported_tokens: Optional[int] = None  # the server's own count, when it says
    finish_reason: Optional[str] = None
    error: Optional[str] = None
    text: List[str] = field(default_factory=list, repr=False)  # each token's text, where the server sends it
    details: Optional[dict] = None  # TorchServe's final details

    @property
    def ok(self) -> bool:
        return self.error is None and self.end is not None and bool(self.token_times)

    @property
    def output_tokens(self) -> int:
        return self.reported_tokens if self.reported_tokens is not None else len(self.token_times)

    @property
    def ttft(self) -> float:
        return self.token_times[0] - self.start

    @property
    def e2e(self) -> float:
        return self.end - self.start

    def itls(self) -> List[float]:
        t = self.token_times
        return [b - a for a, b in zip(t, t[1:])]

    def decode_tokens_per_s(self) -> Optional[float]:
        """Tokens after the first over the time after the first: the stream's decode rate."""
        span = self.token_times[-1] - self.token_times[0]
        return (len(self.token_times) - 1) / span if len(self.token_times) > 1 and span > 0 else None


def read_message(message: dict, record: RequestRecord, now: float, on_text: OnText = None) -> bool:
    """One of TorchServe's messages into ``record``; True when it is the last.

    A token with an id is timed at ``now``; its text is kept (and handed to ``on_text``). An
    error message raises :class:`StreamError`.
    """
    if "error" in message:
        raise StreamError(str(message["error"]), code=message.get("code", "?"))
    token = message.get("token")
    if token is not None:
        if token.get("id") is not None:
            record.token_times.append(now)
        piece = token.get("text") or ""
        record.text.append(piece)
        if on_text is not None:
            on_text(piece)
    details = message.get("details")
    if details is not None:
        record.details = details
        record.reported_tokens = details.get("generated_tokens")
        record.finish_reason = details.get("finish_reason")
    return details is not None or message.get("generated_text") is not None


def read_stream(messages: Iterable[dict], record: RequestRecord, on_text: OnText = None) -> RequestRecord:
    """TorchServe's messages into ``record`` until the last (``record.end`` says it came)."""
    for message in messages:
        now = time.perf_counter()
        if read_message(message, record, now, on_text):
            record.end = now
            break
    return record


# -- sending --------------------------------------------------------------------------------------


def post_chunks(url: str, body: dict, headers: Optional[Dict[str, str]] = None, read_timeout: float = 300.0,
                connect_timeout: float = 10.0) -> Iterator[bytes]:
    """POST ``body`` as JSON and yield the answer's chunks as they arrive.

    An HTTP status other than 200, a stream cut before its last message and no data for
    ``read_timeout`` s raise :class:`StreamError` (:class:`StreamTimeout` for the last).
    """
    try:
        with requests.post(url, json=body, headers=headers, stream=True,
                           timeout=(connect_timeout, read_timeout)) as response:
            if response.status_code != 200:
                raise StreamError(f"HTTP {response.status_code}: {response.text}")
            yield from response.iter_content(chunk_size=None)
    except requests.exceptions.ChunkedEncodingError as exc:
        raise StreamError(f"the stream from {url} was cut before its last message (did the worker die? "
                          f"see the server's logs): {exc}") from None
    except requests.exceptions.Timeout:
        raise StreamTimeout(f"no data from {url} for {read_timeout:.0f} s") from None


class Adapter(ABC):
    """A server's protocol: the request for a prompt, and how its answer's lines read."""

    name = "?"

    @abstractmethod
    def request(self, prompt, max_new_tokens: int) -> Tuple[str, Dict[str, str], dict]:
        """(url, headers, JSON body) of one streamed request."""

    @abstractmethod
    def parse(self, line: bytes, record: RequestRecord, now: float) -> bool:
        """Read one line into ``record``; True when the request is complete."""


class TorchServeAdapter(Adapter):
    """This project's handler: NDJSON, one ``{"token": ...}`` line per token; the last line adds
    ``details`` with ``generated_tokens`` and ``finish_reason``. ``on_text`` gets each token's
    text as it arrives."""

    name = "torchserve"

    def __init__(self, base_url: str, model: str, headers: Optional[Dict[str, str]] = None, on_text: OnText = None):
        self.url = f"{base_url}/predictions/{model}"
        self.headers = dict(headers or {})
        self.on_text = on_text

    def request(self, prompt, max_new_tokens):
        body = {"inputs": prompt_text(prompt), "parameters": {"max_new_tokens": max_new_tokens}}
        return self.url, self.headers, body

    def parse(self, line, record, now):
        message = parse_line(line)
        return message is not None and read_message(message, record, now, self.on_text)


def prompt_text(prompt) -> str:
    return prompt if isinstance(prompt, str) else prompt.text


def prompt_tokens(prompt) -> Optional[int]:
    return None if isinstance(prompt, str) else len(prompt)


def read_lines(adapter: Adapter, lines: Iterable[bytes], record: RequestRecord) -> RequestRecord:
    """Lines into ``record`` through ``adapter`` until the request is complete or the stream ends."""
    for line in lines:
        now = time.perf_counter()
        if not line:
            continue
        if adapter.parse(line, record, now):
            record.end = now
            return record
    if record.end is None and record.error is None:
        if record.token_times:  # some servers just close the stream
            record.end = record.token_times[-1]
        else:
            record.error = "stream ended without a token"
    return record


def stream_one(adapter: Adapter, prompt, max_new_tokens: int, timeout: float,
               record: Optional[RequestRecord] = None) -> RequestRecord:
    """One streamed request, timed; a failure is recorded in ``record.error``, not raised."""
    record = record or RequestRecord(adapter.name, prompt_tokens(prompt), max_new_tokens)
    url, headers, body = adapter.request(prompt, max_new_tokens)
    record.start = time.perf_counter()
    chunks = post_chunks(url, body, headers, timeout)
    try:
        read_lines(adapter, LineIterator(chunks), record)
    except StreamError as exc:
        record.error = exc.describe()[:300]
    except (requests.RequestException, OSError, ValueError) as exc:
        record.error = f"{type(exc).__name__}: {exc}"[:300]
    finally:
        chunks.close()  # a request complete before its stream closed lets its connection go now
    return record


def run_wave(adapter: Adapter, prompts: List, max_new_tokens: int, timeout: float) -> List[RequestRecord]:
    """All prompts at once, one thread (and connection) each; returns when all have finished."""
    records = [RequestRecord(adapter.name, prompt_tokens(p), max_new_tokens) for p in prompts]
    barrier = threading.Barrier(len(prompts))

    def go(prompt, record):
        barrier.wait()
        stream_one(adapter, prompt, max_new_tokens, timeout, record)

    threads = [threading.Thread(target=go, args=(p, r), daemon=True) for p, r in zip(prompts, records)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout + 30)
    for r in records:
        if r.end is None and r.error is None:
            r.error = "client timeout"
    return records


def run_schedule(adapter: Adapter, schedule: List[Tuple[float, object, int]], timeout: float) -> List[RequestRecord]:
    """Open loop: send each (offset_s, prompt, max_new_tokens) at its time, whatever is in flight."""
    records, threads = [], []
    t0 = time.perf_counter()
    for offset, prompt, max_new in schedule:
        delay = t0 + offset - time.perf_counter()
        if delay > 0:
            time.sleep(delay)
        record = RequestRecord(adapter.name, prompt_tokens(prompt), max_new)
        thread = threading.Thread(target=stream_one, args=(adapter, prompt, max_new, timeout, record), daemon=True)
        thread.start()
        records.append(record)
        threads.append(thread)
    deadline = time.perf_counter() + timeout + 30
    for t in threads:
        t.join(max(0.0, deadline - time.perf_counter()))
    for r in records:
        if r.end is None and r.error is None:
            r.error = "client timeout"
    return records
