"""One streaming HTTP client, with an adapter per server protocol.

Every request is timed the same way whatever the server: ``start`` before the request is
sent, one timestamp per token as its line arrives, ``end`` when the request's last line
(the one that says it is complete) arrives. Adapters only build the request and read lines:

* :class:`TorchServeAdapter`: this project's handler, NDJSON (one ``{"token": ...}`` line per
  token; the last line adds ``details`` with ``generated_tokens`` and ``finish_reason``).
* :class:`LlamaServerAdapter`: llama.cpp's ``llama-server`` ``POST /completion`` with
  ``stream: true``: SSE ``data: {"content", "stop", ...}`` events, the last with
  ``stop: true`` and ``tokens_predicted``; ``n_predict`` and ``ignore_eos: true``. Tokens are
  counted by each event's running ``tokens_predicted``: a token whose text ends mid-UTF-8
  gets no event of its own and arrives with the next.
* :class:`OpenAICompletionsAdapter`: vLLM's OpenAI server, ``POST /v1/completions`` with
  ``stream: true``: SSE ``data: {"choices": [{"text"}]}`` chunks, a usage chunk
  (``stream_options.include_usage``) and ``data: [DONE]``; ``max_tokens`` and ``ignore_eos``;
  ``return_token_ids`` makes each chunk name its tokens (``token_ids``), which are counted.

Peers get the prompt as token ids (both servers accept a list of ints), so every system
sees exactly the same number of prompt tokens; TorchServe gets the text, which its tokenizer
turns into the same ids.
"""
from __future__ import annotations

import json
import threading
import time
from abc import ABC, abstractmethod
from dataclasses import dataclass, field
from typing import Dict, List, Optional, Tuple

import requests

from .prompts import Prompt


@dataclass
class RequestRecord:
    system: str
    input_tokens: int
    requested_tokens: int
    start: float = 0.0  # perf_counter when sent
    token_times: List[float] = field(default_factory=list)  # perf_counter per token line
    end: Optional[float] = None  # perf_counter of the request's last line
    reported_tokens: Optional[int] = None  # the server's own count, when it says
    finish_reason: Optional[str] = None
    error: Optional[str] = None

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


class Adapter(ABC):
    name = "?"

    @abstractmethod
    def request(self, prompt: Prompt, max_new_tokens: int) -> Tuple[str, Dict[str, str], dict]:
        ...

    @abstractmethod
    def parse(self, line: bytes, record: RequestRecord, now: float) -> bool:
        """Read one line into ``record``; True when the request is complete."""


class TorchServeAdapter(Adapter):
    name = "torchserve"

    def __init__(self, base_url: str, model: str, headers: Optional[Dict[str, str]] = None):
        self.url = f"{base_url}/predictions/{model}"
        self.headers = dict(headers or {})

    def request(self, prompt, max_new_tokens):
        body = {"inputs": prompt.text, "parameters": {"max_new_tokens": max_new_tokens}}
        return self.url, self.headers, body

    def parse(self, line, record, now):
        message = json.loads(line)
        if "error" in message:
            record.error = f"{message.get('code', '?')}: {message['error']}"
            return True
        token = message.get("token")
        if token is not None and token.get("id") is not None:
            record.token_times.append(now)
        details = message.get("details")
        if details is not None:
            record.reported_tokens = details.get("generated_tokens")
            record.finish_reason = details.get("finish_reason")
            return True
        return False


def _sse_payload(line: bytes) -> Optional[bytes]:
    if not line.startswith(b"data:"):
        return None  # comments, event names, blank separators
    return line[5:].strip()


class LlamaServerAdapter(Adapter):
    name = "llama.cpp"

    def __init__(self, base_url: str):
        self.url = f"{base_url}/completion"

    def request(self, prompt, max_new_tokens):
        body = {"prompt": prompt.ids, "n_predict": max_new_tokens, "stream": True, "ignore_eos": True,
                "cache_prompt": False, "top_k": 1, "temperature": 0.0}
        return self.url, {}, body

    # llama-server's stop_type -> the finish reasons the other systems report
    FINISH = {"limit": "length", "eos": "stop", "word": "stop"}

    def parse(self, line, record, now):
        payload = _sse_payload(line)
        if not payload:
            return False
        message = json.loads(payload)
        if not isinstance(message, dict):
            return False
        if "error" in message:
            record.error = json.dumps(message["error"])[:300]
            return True
        if "prompt_progress" not in message:
            # Every event says how many tokens the server has generated so far
            # ("tokens_predicted"). A token whose text ends inside a UTF-8 sequence gets no event
            # of its own: it arrives with the next one (whose "tokens" names only that next id),
            # and tokens still incomplete at the end arrive with the final event (which repeats
            # no text). Each token is timed when the event that brings it arrives.
            predicted = message.get("tokens_predicted")
            if isinstance(predicted, int):
                n = max(0, predicted - len(record.token_times))
            else:
                tokens = message.get("tokens")
                n = len(tokens) if isinstance(tokens, list) else int(bool(message.get("content")))
            record.token_times.extend([now] * n)
        if message.get("stop"):
            record.reported_tokens = message.get("tokens_predicted")
            stop_type = message.get("stop_type") or ("limit" if message.get("stopped_limit") else None)
            record.finish_reason = self.FINISH.get(stop_type, stop_type)
            return True
        return False


class OpenAICompletionsAdapter(Adapter):
    name = "vllm"

    def __init__(self, base_url: str, model: str):
        self.url = f"{base_url}/v1/completions"
        self.model = model

    def request(self, prompt, max_new_tokens):
        body = {"model": self.model, "prompt": prompt.ids, "max_tokens": max_new_tokens, "stream": True,
                "ignore_eos": True, "temperature": 0.0, "stream_options": {"include_usage": True},
                "return_token_ids": True}
        return self.url, {}, body

    def parse(self, line, record, now):
        payload = _sse_payload(line)
        if not payload:
            return False
        if payload == b"[DONE]":
            return True
        message = json.loads(payload)
        if "error" in message or message.get("object") == "error":
            record.error = json.dumps(message.get("error", message))[:300]
            return True
        for choice in message.get("choices") or []:
            ids = choice.get("token_ids")
            if isinstance(ids, list):  # vLLM with return_token_ids: the chunk's own tokens
                record.token_times.extend([now] * len(ids))
            elif "text" in choice:
                record.token_times.append(now)
            if choice.get("finish_reason"):
                record.finish_reason = choice["finish_reason"]
        usage = message.get("usage")
        if usage and usage.get("completion_tokens") is not None:
            record.reported_tokens = usage["completion_tokens"]
        return False


def stream_one(adapter: Adapter, prompt: Prompt, max_new_tokens: int, timeout: float,
               record: Optional[RequestRecord] = None) -> RequestRecord:
    record = record or RequestRecord(adapter.name, len(prompt), max_new_tokens)
    url, headers, body = adapter.request(prompt, max_new_tokens)
    record.start = time.perf_counter()
    try:
        with requests.post(url, json=body, headers=headers, stream=True, timeout=(10, timeout)) as r:
            if r.status_code != 200:
                record.error = f"HTTP {r.status_code}: {r.text[:300]}"
                return record
            for line in r.iter_lines(chunk_size=None):
                now = time.perf_counter()
                if not line:
                    continue
                if adapter.parse(line, record, now):
                    record.end = now
                    break
            if record.end is None and record.error is None:
                if record.token_times:  # some servers just close the stream
                    record.end = record.token_times[-1]
                else:
                    record.error = "stream ended without a token"
    except (requests.RequestException, OSError, ValueError) as exc:
        record.error = f"{type(exc).__name__}: {exc}"[:300]
    return record


def run_wave(adapter: Adapter, prompts: List[Prompt], max_new_tokens: int, timeout: float) -> List[RequestRecord]:
    """All prompts at once, one thread (and connection) each; returns when all have finished."""
    records = [RequestRecord(adapter.name, len(p), max_new_tokens) for p in prompts]
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


def run_schedule(adapter: Adapter, schedule: List[Tuple[float, Prompt, int]], timeout: float) -> List[RequestRecord]:
    """Open loop: send each (offset_s, prompt, max_new_tokens) at its time, whatever is in flight."""
    records, threads = [], []
    t0 = time.perf_counter()
    for offset, prompt, max_new in schedule:
        delay = t0 + offset - time.perf_counter()
        if delay > 0:
            time.sleep(delay)
        record = RequestRecord(adapter.name, len(prompt), max_new)
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
