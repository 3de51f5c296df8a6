"""TorchServe entry: translates between TorchServe and the ``llama_engine`` package.

Requests are split into micro-batches by TorchServe's ``MicroBatching``; each request is
tagged with its index in the frontend batch before the split, so every intermediate
response is addressed to the right request id even when the frontend batch holds several
micro-batches (the upstream example addressed them by their index inside the micro-batch).

Every stage catches its own errors and routes them to the requests they belong to: an
exception escaping a ``MicroBatching`` stage thread would kill the thread and leave
``handle()`` waiting forever.
"""
from __future__ import annotations

import functools
import logging
import os
import threading
import time
from dataclasses import dataclass
from http import HTTPStatus
from typing import Any, Dict, List, Optional

import torch
from ts.handler_utils.micro_batching import MicroBatching
from ts.handler_utils.utils import send_intermediate_predict_response

from llama_engine import Engine, RequestError, load_model_config, parse_request
from llama_engine.engine import PreparedRequest
from llama_engine.formatting import CONTENT_TYPES, JSON, full_response, stream_chunk, stream_error
from llama_engine.request import describe_form_error
from llama_engine.streamer import GenerationResult

logger = logging.getLogger(__name__)


@dataclass
class Slot:
    """One request of the frontend batch as it moves through the stages."""

    index: int
    raw: Any
    prepared: Optional[PreparedRequest] = None
    error: Optional[RequestError] = None
    result: Optional[GenerationResult] = None
    sent: bool = False

    @property
    def stream(self) -> bool:
        return self.prepared is not None and self.prepared.request.stream


class Responder:
    """Sends intermediate responses; the lock keeps messages from several stage threads whole."""

    def __init__(self, context):
        self.context = context
        self.lock = threading.Lock()

    def send(self, bodies: Dict[int, str]) -> None:
        if not bodies:
            return
        req_ids = {idx: self.context.request_ids[idx] for idx in bodies}
        with self.lock:
            send_intermediate_predict_response(bodies, req_ids, "Intermediate Prediction success",
                                               200, self.context)

    def set_status(self, idx: int, status: int, content_type: str) -> None:
        self.context.set_response_status(status, HTTPStatus(status).phrase, idx)
        self.context.set_response_content_type(idx, content_type)


def _stage(fn):
    """Turn any exception of a stage into a 500 for the slots it was working on."""

    @functools.wraps(fn)
    def wrapper(self, slots: List[Slot]):
        try:
            return fn(self, slots)
        except Exception as exc:  # noqa: BLE001 - must never escape a stage thread
            logger.exception("%s failed", fn.__name__)
            for slot in slots:
                if slot.error is None:
                    self._fail(slot, RequestError(f"internal error in {fn.__name__}: {exc}", status=500))
            return slots

    return wrapper


class LlamaHandler:
    def __init__(self):
        self.initialized = False
        self.context = None
        self.responder: Optional[Responder] = None

    def initialize(self, context) -> None:
        started = time.perf_counter()
        self.config = load_model_config(context.model_yaml_config)
        threads = self.config.handler.torch_threads or os.cpu_count() or 1
        torch.set_num_threads(threads)
        model_dir = context.system_properties.get("model_dir")
        micro = self.config.micro_batching
        self.engine = Engine.from_config(self.config.handler, model_dir, batch_size=micro.micro_batch_size)
        loaded = time.perf_counter()
        if self.config.handler.warmup:
            self.engine.warmup(batch_size=micro.micro_batch_size)
        logger.info("load %.1f s, warm-up %.1f s", loaded - started, time.perf_counter() - loaded)
        if self.engine.backend.compile_session is not None:
            self.engine.backend.compile_session.report()
        self.micro_batching = MicroBatching(self, micro_batch_size=micro.micro_batch_size,
                                            parallelism=micro.parallelism)
        self.initialized = True
        logger.info("model ready in %.1f s (torch threads %d, micro_batch_size %d)",
                    time.perf_counter() - started, threads, micro.micro_batch_size)

    def handle(self, data: List[Any], context) -> List[str]:
        started = time.perf_counter()
        self.context = context
        self.responder = Responder(context)
        slots = [Slot(index=i, raw=item) for i, item in enumerate(data)]
        logger.info("batch of %d requests, micro_batch_size %d", len(slots),
                    self.micro_batching.micro_batch_size)
        done = self.micro_batching.handle(slots)
        finals = {slot.index: self._final_body(slot) for slot in done}
        context.metrics.add_time("HandlerTime", round((time.perf_counter() - started) * 1000, 2), None, "ms")
        return [finals[i] for i in range(len(data))]

    # -- stages (each runs in MicroBatching's threads) -------------------------------------

    @_stage
    def preprocess(self, slots: List[Slot]) -> List[Slot]:
        for slot in slots:
            try:
                request = self._parse(slot)
                slot.prepared = self.engine.prepare(request)
            except RequestError as exc:
                self._fail(slot, exc)
            except Exception as exc:  # noqa: BLE001 - a bug on one input fails that request only
                logger.exception("preprocess failed for request %d", slot.index)
                self._fail(slot, RequestError(f"internal error in preprocess: {exc}", status=500))
        return slots

    @_stage
    def inference(self, slots: List[Slot]) -> List[Slot]:
        runnable = [s for s in slots if s.error is None and s.prepared is not None]
        for slot in runnable:
            if slot.stream:
                self.responder.set_status(slot.index, 200, CONTENT_TYPES[slot.prepared.request.output])
        started = time.perf_counter()
        try:
            results = self.engine.generate([s.prepared for s in runnable],
                                           sink=functools.partial(self._send_events, runnable))
        except Exception as exc:  # noqa: BLE001 - the error belongs to this micro-batch only
            logger.exception("generation failed")
            for slot in runnable:
                self._fail(slot, RequestError(f"generation failed: {exc}", status=500))
            return slots
        for slot, result in zip(runnable, results):
            slot.result = result
        if results:
            elapsed = time.perf_counter() - started
            steps = max(r.generated_tokens for r in results)
            logger.info("micro-batch of %d: %d tokens in %.0f ms (%.2f ms/step)", len(results),
                        sum(r.generated_tokens for r in results), elapsed * 1000, elapsed * 1000 / max(steps, 1))
        return slots

    @_stage
    def postprocess(self, slots: List[Slot]) -> List[Slot]:
        return slots

    # -- helpers -----------------------------------------------------------------------------

    def _parse(self, slot: Slot):
        raw = slot.raw
        if not isinstance(raw, dict):
            raise RequestError("unexpected request layout from the frontend", "inputs")
        body_key = "body" if "body" in raw else "data" if "data" in raw else None
        if body_key is None:
            raise describe_form_error()
        header = self.context.get_request_header(slot.index, body_key) or {}
        content_type = header.get("content-type") if isinstance(header, dict) else None
        return parse_request(raw[body_key], content_type, self.config.handler.max_input_bytes,
                             accept=self._header(slot.index, "accept"),
                             user_agent=self._header(slot.index, "user-agent"))

    def _header(self, idx: int, name: str) -> Optional[str]:
        for key, value in (self.context.get_all_request_header(idx) or {}).items():
            if isinstance(key, str) and key.lower() == name and isinstance(value, str):
                return value
        return None

    def _send_events(self, slots: List[Slot], events) -> None:
        bodies = {}
        for event in events:
            slot = slots[event.row]
            if slot.stream:
                bodies[slot.index] = stream_chunk(slot.prepared.request, event)
                slot.sent = True
        self.responder.send(bodies)

    def _fail(self, slot: Slot, error: RequestError) -> None:
        """Record the error; a stream already under way ends with an error line at once.

        An error before the first chunk goes out with the final response, as a plain 4xx/5xx:
        the frontend closes the connection after a non-2xx chunk, so it cannot be streamed.
        """
        slot.error = error
        if slot.sent:
            self.responder.send({slot.index: stream_error(slot.prepared.request, error)})

    def _final_body(self, slot: Slot) -> str:
        if slot.sent:
            return ""
        if slot.result is not None:
            self.responder.set_status(slot.index, 200, JSON)
            return full_response(slot.prepared.request, slot.result)
        error = slot.error or RequestError("request produced no result", status=500)
        self.responder.set_status(slot.index, error.status, JSON)
        return error.to_json()


_service = LlamaHandler()


def handle(data, context):
    """Module-level entry point, as TorchServe calls a handler module."""
    if not _service.initialized:
        _service.initialize(context)
    if data is None:
        return None
    return _service.handle(data, context)
