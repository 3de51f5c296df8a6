"""An in-process stand-in for TorchServe's frontend in ``continuousBatching`` mode.

It drives a handler the way ``ContinuousBatching.java`` does: every call carries all the
requests in flight (at most ``batch_size``), new ones with their body and running ones by id
only; each reply is encoded with TorchServe's own ``create_predict_response`` and decoded
back from the wire bytes, and its ``ts_stream_next`` header decides, as in
``RestJob.responseInference``, whether a response is a plain one (no header), the next chunk
of a stream ("true") or its last ("false").
"""
from __future__ import annotations

import struct
from collections import deque
from dataclasses import dataclass, field
from typing import Deque, Dict, List, Optional

from ts.context import Context, RequestProcessor
from ts.protocol.otf_message_handler import create_predict_response


class FakeMetrics:
    def add_time(self, *args, **kwargs):
        pass


def decode_message(msg: bytes) -> List[dict]:
    """Parse one predict response of TorchServe's worker protocol into per-request parts."""
    pos = 0

    def take_int():
        nonlocal pos
        (value,) = struct.unpack_from("!i", msg, pos)
        pos += 4
        return value

    def take_bytes():
        nonlocal pos
        n = take_int()
        data = msg[pos:pos + n]
        pos += n
        return data

    take_int()  # batch code
    take_bytes()  # message
    parts = []
    while True:
        n = take_int()
        if n == -1:
            return parts
        req_id = msg[pos:pos + n].decode()
        pos += n
        content_type = take_bytes().decode()
        status = take_int()
        take_bytes()  # phrase
        headers = {take_bytes().decode(): take_bytes().decode() for _ in range(take_int())}
        parts.append({"req_id": req_id, "content_type": content_type, "status": status,
                      "headers": headers, "body": take_bytes().decode()})


@dataclass
class ClientView:
    """What the HTTP client of one request received."""

    request_id: str
    status: Optional[int] = None
    content_type: Optional[str] = None
    chunks: List[str] = field(default_factory=list)
    done: bool = False
    streamed: bool = False  # chunked transfer (ts_stream_next seen) rather than one response
    calls: int = 0  # handler calls this request took part in

    @property
    def body(self) -> str:
        return "".join(self.chunks)


class ContinuousFrontend:
    def __init__(self, handler, batch_size: int, content_type: str = "application/json"):
        self.handler = handler
        self.batch_size = batch_size
        self.content_type = content_type
        self.queue: Deque[tuple] = deque()
        self.jobs: Dict[str, Optional[dict]] = {}  # request id -> body until sent once, then None
        self.clients: Dict[str, ClientView] = {}
        self.calls = 0
        self._ids = 0

    def submit(self, body, headers: Optional[dict] = None) -> ClientView:
        self._ids += 1
        rid = f"req-{self._ids}"
        self.queue.append((rid, body, headers or {}))
        self.clients[rid] = ClientView(rid)
        return self.clients[rid]

    def disconnect(self, client: ClientView) -> None:
        """The client went away: the frontend drops the job, so later calls omit it."""
        self.jobs.pop(client.request_id, None)
        client.done = True

    @property
    def idle(self) -> bool:
        return not self.queue and not self.jobs

    def tick(self) -> None:
        """One handler call with every job in flight plus new ones up to ``batch_size``."""
        headers = {}
        while self.queue and len(self.jobs) < self.batch_size:
            rid, body, extra = self.queue.popleft()
            self.jobs[rid] = body
            headers[rid] = extra
        ids = list(self.jobs)
        data, processors = [], []
        for rid in ids:
            body = self.jobs[rid]
            if body is None:  # cached in the backend: the frontend sends no parameters
                data.append({})
                processors.append(RequestProcessor({}))
            else:
                data.append({"body": body})
                processors.append(RequestProcessor({"body": {"content-type": self.content_type},
                                                    **headers.get(rid, {})}))
                self.jobs[rid] = None
        context = Context("tiny", "", None, self.batch_size, None, "0.12.0")
        context.metrics = FakeMetrics()
        context.request_ids = dict(enumerate(ids))
        context.request_processor = processors
        replies = self.handler.handle(data, context)
        assert len(replies) == len(ids)
        self.calls += 1
        message = create_predict_response(replies, context.request_ids, "Prediction success", 200, context)
        for part in decode_message(bytes(message)):
            self._deliver(part)

    def _deliver(self, part: dict) -> None:
        client = self.clients[part["req_id"]]
        client.calls += 1
        flag = part["headers"].get("ts_stream_next")
        if client.status is None:
            client.status, client.content_type = part["status"], part["content_type"]
        client.streamed = client.streamed or flag is not None
        client.chunks.append(part["body"])
        if flag != "true":  # no header: a plain response; "false": a stream's last chunk
            client.done = True
            self.jobs.pop(part["req_id"], None)

    def run(self, max_calls: int = 10_000) -> None:
        while not self.idle:
            self.tick()
            assert self.calls < max_calls, "requests never finished"
