"""TorchServe entry: translates between TorchServe and the ``llama_engine`` package.

Two modes, chosen by the model-config:

* **Micro-batching** (default, :class:`LlamaHandler`). Requests are split into micro-batches
  by TorchServe's ``MicroBatching``; each request is tagged with its index in the frontend
  batch before the split, so every intermediate response is addressed to the right request
  id even when the frontend batch holds several micro-batches (the upstream example
  addressed them by their index inside the micro-batch). Every stage catches its own errors
  and routes them to the requests they belong to: an exception escaping a ``MicroBatching``
  stage thread would kill the thread and leave ``handle()`` waiting forever.
* **Continuous batching** (``continuousBatching: true``, :class:`ContinuousHandler`).
  TorchServe's frontend calls the handler again and again with every request in flight (at
  most ``batchSize``, the slot count), new ones with their body and running ones by id only.
  Each call admits the new requests into the engine's
  :class:`~llama_engine.continuous.ContinuousScheduler` and returns each request's output
  since the last call; ``context.stopping_criteria`` tells the frontend which responses are a
  stream's last. The scheduler steps in a thread of its own (``overlap_round_trips``), so the
  model keeps working while a call's output makes its round trip through the frontend; the
  worker's main thread still does every socket write. With ``overlap_round_trips: false``
  each call runs ``steps_per_call`` steps itself. A request missing from a call is one whose
  client went away (the frontend drops it), so its slot is freed at once.

Both load the same way (:class:`ModelService`): model-config, torch threads, the model and its
runner, metrics, warm-up.
"""
from __future__ import annotations

import functools
import logging
import os
import threading
import time
from abc import ABC, abstractmethod
from dataclasses import dataclass, field
from http import HTTPStatus
from typing import Any, Dict, List, Optional, Union

import torch
from ts.handler_utils.micro_batching import MicroBatching
from ts.handler_utils.utils import send_intermediate_predict_response

from llama_engine import Engine, RequestError, load_model_config, parse_request
from llama_engine.continuous import ContinuousScheduler, RequestHandle, SteppingThread
from llama_engine.cpu import release_openmp_threads
from llama_engine.cpu_limits import model_threads
from llama_engine.formatting import CONTENT_TYPES, JSON, full_response, stream_chunk, stream_error
from llama_engine.lifecycle import PreparedRequest, request_error
from llama_engine.openai_api import Reply, as_openai_error, parse_openai
from llama_engine.request import describe_form_error
from llama_engine.streamer import GenerationResult
from llama_metrics import TorchServeMetrics

logger = logging.getLogger(__name__)


def read_request(context, idx: int, raw: Any, max_input_bytes: int):
    """Parse request ``idx`` of the frontend batch (body, content type, Accept, User-Agent).

    A request to ``/predictions/<model>/<version>/v1/...`` is one of the OpenAI-compatible
    API: the frontend passes the path after the version as the ``url_path`` header.
    """
    if not isinstance(raw, dict):
        raise RequestError("unexpected request layout from the frontend", "inputs")
    body_key = "body" if "body" in raw else "data" if "data" in raw else None
    path = _url_path(context, idx)
    if path:
        return parse_openai(path, raw[body_key] if body_key else None, max_input_bytes, context.model_name)
    if body_key is None:
        raise describe_form_error()
    header = context.get_request_header(idx, body_key) or {}
    content_type = header.get("content-type") if isinstance(header, dict) else None
    return parse_request(raw[body_key], content_type, max_input_bytes,
                         accept=_header(context, idx, "accept"), user_agent=_header(context, idx, "user-agent"))


def _url_path(context, idx: int) -> str:
    return context.get_request_header(idx, "url_path") or ""


def api_error(context, idx: int, error: RequestError) -> RequestError:
    """``error`` in the schema of the API that request ``idx`` was sent to (OpenAI's for ``v1/...``)."""
    path = _url_path(context, idx)
    return as_openai_error(error, path) if path else error


def _header(context, idx: int, name: str) -> Optional[str]:
    for key, value in (context.get_all_request_header(idx) or {}).items():
        if isinstance(key, str) and key.lower() == name and isinstance(value, str):
            return value
    return None


def set_head(context, idx: int, status: int, content_type: str) -> None:
    """Status and content type of request ``idx``'s response (the first one of a stream counts)."""
    context.set_response_status(status, HTTPStatus(status).phrase, idx)
    context.set_response_content_type(idx, content_type)


def warm_up_and_report(warmup: bool, warm, backend, started: float, metrics=None) -> None:
    """Called when the model has loaded: run ``warm()`` if asked, log both times and the compile cache's
    report (its hits and misses also go to ``metrics``)."""
    loaded = time.perf_counter()
    if warmup:
        warm()
    logger.info("load %.1f s, warm-up %.1f s", loaded - started, time.perf_counter() - loaded)
    if backend.compile_session is not None:
        stats = backend.compile_session.report()
        if metrics is not None:
            metrics.compile_cache(stats)


def set_torch_threads(config) -> int:
    """``handler.torch_threads``, at most the CPUs this worker may use (:func:`model_threads`)."""
    threads = model_threads(config.handler.torch_threads)
    torch.set_num_threads(threads)
    warning = openmp_wait_warning(threads, os.environ)
    if warning:
        logger.warning(warning)
    return threads


def openmp_wait_warning(threads: int, env) -> Optional[str]:
    """What is wrong with libgomp's waits for ``threads`` model threads under ``env``, or None.

    Both variables matter (``make serve`` sets both, ``scripts/tsctl.py`` says why): without PASSIVE the
    threads spin for ms between torch ops and take the cores the frontend needs; with PASSIVE alone they
    sleep at every barrier, and llama.cpp has hundreds a step (the llamacpp backend's one-token step on
    the bench model took 30.4 against 17.0 ms on an AMX Xeon, 2 threads)."""
    if threads <= 1:
        return None
    fix = ("start torchserve with OMP_WAIT_POLICY=PASSIVE and GOMP_SPINCOUNT=20000 in its environment (as make "
           "serve does), or set handler.torch_threads: 1")
    if env.get("OMP_WAIT_POLICY", "").upper() != "PASSIVE":
        return (f"OMP_WAIT_POLICY is not PASSIVE: {threads} OpenMP threads will spin between torch ops and take "
                f"the CPU TorchServe's frontend needs (decode many times slower on small machines); {fix}")
    if not env.get("GOMP_SPINCOUNT"):
        return (f"OMP_WAIT_POLICY is PASSIVE without GOMP_SPINCOUNT: {threads} OpenMP threads will sleep at "
                f"every barrier inside a step (llama.cpp's steps ~1.8x slower); {fix}")
    return None


def use_assigned_gpu(config, gpu_id) -> Optional[int]:
    """Make the GPU TorchServe assigned this worker the current CUDA device; its index, or None.

    On a GPU host TorchServe spreads a model's workers over the GPUs by each worker's ``gpu_id``;
    ``cuda`` (and ``auto`` there) then means that GPU, not GPU 0 for every worker. Nothing to do
    for a CPU model, another backend, or a host without CUDA.
    """
    handler = config.handler
    if gpu_id is None or handler.backend != "torch" or handler.device == "cpu" or not torch.cuda.is_available():
        return None
    index, count = int(gpu_id), torch.cuda.device_count()
    if not 0 <= index < count:
        raise RuntimeError(f"TorchServe assigned this worker gpu_id {index}, but it sees {count} CUDA device(s); "
                           "check CUDA_VISIBLE_DEVICES against torchserve's number_of_gpu")
    torch.cuda.set_device(index)
    return index


@dataclass
class BatchEntry:
    """One request of TorchServe's frontend batch as it moves through the MicroBatching stages.

    (Not a slot: that is a KV-cache row of continuous batching.)
    """

    index: int
    raw: Any
    prepared: Optional[PreparedRequest] = None
    error: Optional[RequestError] = None
    result: Optional[GenerationResult] = None
    sent: bool = False
    reply: Optional[Reply] = None  # an answer without generation (v1/models)

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
        set_head(self.context, idx, status, content_type)


def _stage(fn):
    """Turn any exception of a stage into a 500 for the requests it was working on."""

    @functools.wraps(fn)
    def wrapper(self, entries: List[BatchEntry]):
        try:
            return fn(self, entries)
        except Exception as exc:  # must never escape a stage thread
            logger.exception("%s failed", fn.__name__)
            for entry in entries:
                if entry.error is None:
                    self._fail(entry, RequestError(f"internal error in {fn.__name__}: {exc}", status=500))
            return entries

    return wrapper


class ModelService(ABC):
    """What both modes do at load: read the model-config, set torch's threads, load the model
    with its runner (the static engine or the continuous scheduler), set up the metrics, warm
    up and report. Each mode says how it loads and warms up its runner, and handles requests."""

    #: The engine or the scheduler, once loaded; it has the ``backend``.
    runner: Any = None

    def __init__(self):
        self.initialized = False

    def initialize(self, context) -> None:
        started = time.perf_counter()
        self.config = load_model_config(context.model_yaml_config)
        threads = set_torch_threads(self.config)
        use_assigned_gpu(self.config, context.system_properties.get("gpu_id"))
        self.runner = self._load(context.system_properties.get("model_dir"))
        self.metrics = TorchServeMetrics(context.metrics, context.model_name, self.config.slots,
                                         continuous=self.config.continuous)
        warm_up_and_report(self.config.handler.warmup, self._warm_up, self.runner.backend, started, self.metrics)
        self._ready(context)
        self.initialized = True
        logger.info("model ready in %.1f s (torch threads %d, %s)", time.perf_counter() - started, threads,
                    self._describe())

    @abstractmethod
    def _load(self, model_dir: str):
        """The runner for ``self.config``, with its model loaded from ``model_dir``."""

    @abstractmethod
    def _warm_up(self) -> None:
        """Run the runner's warm-up (when ``handler.warmup`` asks for one)."""

    @abstractmethod
    def _ready(self, context) -> None:
        """After the warm-up, before the first request (``context``: TorchServe's, of the load)."""

    @abstractmethod
    def _describe(self) -> str:
        """The mode and its settings, for the log line that says the model is ready."""

    @abstractmethod
    def handle(self, data: List[Any], context) -> List[str]:
        """One call of TorchServe's frontend: a response body for each request of ``data``."""


class LlamaHandler(ModelService):
    def __init__(self):
        super().__init__()
        self.context = None
        self.responder: Optional[Responder] = None

    def _load(self, model_dir: str) -> Engine:
        micro = self.config.micro_batching
        self.engine = Engine.from_config(self.config.handler, model_dir, batch_size=micro.micro_batch_size)
        return self.engine

    def _warm_up(self) -> None:
        self.engine.warmup(batch_size=self.config.micro_batching.micro_batch_size)

    def _ready(self, context) -> None:
        """The stages run in MicroBatching's threads: the main thread's OpenMP workers go first."""
        release_openmp_threads()
        micro = self.config.micro_batching
        self.micro_batching = MicroBatching(self, micro_batch_size=micro.micro_batch_size,
                                            parallelism=micro.parallelism)

    def _describe(self) -> str:
        return f"micro_batch_size {self.config.micro_batching.micro_batch_size}"

    def handle(self, data: List[Any], context) -> List[str]:
        started = time.perf_counter()
        self.context = context
        self.responder = Responder(context)
        entries = [BatchEntry(index=i, raw=item) for i, item in enumerate(data)]
        for _ in entries:
            self.metrics.received()
        logger.info("batch of %d requests, micro_batch_size %d", len(entries),
                    self.micro_batching.micro_batch_size)
        done = self.micro_batching.handle(entries)
        finals = {entry.index: self._final_body(entry) for entry in done}
        self._report_outcomes(done)
        context.metrics.add_time("HandlerTime", round((time.perf_counter() - started) * 1000, 2), None, "ms")
        return [finals[i] for i in range(len(data))]

    # -- stages (each runs in MicroBatching's threads) -------------------------------------

    @_stage
    def preprocess(self, entries: List[BatchEntry]) -> List[BatchEntry]:
        for entry in entries:
            try:
                request = self._parse(entry)
                if isinstance(request, Reply):
                    entry.reply = request
                    continue
                entry.prepared = self.engine.prepare(request)
            except RequestError as exc:
                self._fail(entry, exc)
            except Exception as exc:  # a bug on one input fails that request only
                logger.exception("preprocess failed for request %d", entry.index)
                self._fail(entry, RequestError(f"internal error in preprocess: {exc}", status=500))
        return entries

    @_stage
    def inference(self, entries: List[BatchEntry]) -> List[BatchEntry]:
        runnable = [e for e in entries if e.error is None and e.prepared is not None]
        for entry in runnable:
            if entry.stream:
                self.responder.set_status(entry.index, 200, CONTENT_TYPES[entry.prepared.request.output])
        started = time.perf_counter()
        try:
            results = self.engine.generate([e.prepared for e in runnable],
                                           sink=functools.partial(self._send_events, runnable), metrics=self.metrics)
        except Exception as exc:  # the error belongs to this micro-batch only
            logger.exception("generation failed")
            for entry in runnable:
                self._fail(entry, request_error(exc, entry.prepared.request))
            return entries
        for entry, result in zip(runnable, results):
            entry.result = result
        if results:
            elapsed = time.perf_counter() - started
            steps = max(r.generated_tokens for r in results)
            logger.info("micro-batch of %d: %d tokens in %.0f ms (%.2f ms/step)", len(results),
                        sum(r.generated_tokens for r in results), elapsed * 1000, elapsed * 1000 / max(steps, 1))
        return entries

    @_stage
    def postprocess(self, entries: List[BatchEntry]) -> List[BatchEntry]:
        return entries

    # -- helpers -----------------------------------------------------------------------------

    def _parse(self, entry: BatchEntry):
        return read_request(self.context, entry.index, entry.raw, self.config.handler.max_input_bytes)

    def _send_events(self, entries: List[BatchEntry], events) -> None:
        bodies = {}
        for event in events:
            entry = entries[event.row]
            if entry.stream:
                bodies[entry.index] = stream_chunk(entry.prepared.request, event)
                entry.sent = True
        self.responder.send(bodies)

    def _fail(self, entry: BatchEntry, error: RequestError) -> None:
        """Record the error; a stream already under way ends with an error line at once.

        An error before the first chunk goes out with the final response, as a plain 4xx/5xx:
        the frontend closes the connection after a non-2xx chunk, so it cannot be streamed.
        """
        entry.error = error = api_error(self.context, entry.index, error)
        if entry.sent:
            self.responder.send({entry.index: stream_error(entry.prepared.request, error)})

    def _report_outcomes(self, entries: List[BatchEntry]) -> None:
        """Count each request without a result (the engine counted the others) and record the counts."""
        for entry in entries:
            if entry.reply is not None:
                self.metrics.answered()
            elif entry.result is None:
                self.metrics.error(entry.error.status if entry.error else 500, entry.prepared)
        self.metrics.flush()

    def _final_body(self, entry: BatchEntry) -> str:
        if entry.sent:
            return ""
        if entry.reply is not None:
            self.responder.set_status(entry.index, entry.reply.status, entry.reply.content_type)
            return entry.reply.body
        if entry.result is not None:
            self.responder.set_status(entry.index, 200, JSON)
            return full_response(entry.prepared.request, entry.result)
        error = entry.error or RequestError("request produced no result", status=500)
        self.responder.set_status(entry.index, error.status, JSON)
        return error.to_json()


@dataclass
class LiveRequest:
    """A request the frontend keeps handing back until its last response."""

    prepared: PreparedRequest
    handle: Optional[RequestHandle] = None
    chunks: List[str] = field(default_factory=list)
    finished: bool = False  # its last event is in ``chunks`` (set with them, under the handler's lock)
    responded: bool = False

    @property
    def stream(self) -> bool:
        return self.prepared.request.stream


#: The longest a call waits for a step: a call that comes back empty-handed costs one round trip.
STEP_WAIT_S = 1.0


class ContinuousHandler(ModelService):
    """Continuous batching through TorchServe's ``continuousBatching`` frontend mode."""

    def __init__(self):
        super().__init__()
        self.live: Dict[str, LiveRequest] = {}
        self.round_trips = RoundTrips()
        self.stepper: Optional[SteppingThread] = None
        #: Guards every live request's ``chunks`` and ``finished``: the step thread adds, a call takes.
        #: Never held while calling the scheduler (whose lock the step thread holds when it takes this).
        self._output = threading.Lock()
        self._steps_seen = 0

    def _load(self, model_dir: str) -> ContinuousScheduler:
        settings = self.config.continuous_batching
        self.steps_per_call = settings.steps_per_call
        self.scheduler = ContinuousScheduler.from_config(self.config.handler, model_dir, self.config.slots,
                                                         settings.max_prefill_tokens_per_step)
        return self.scheduler

    def _warm_up(self) -> None:
        self.scheduler.warmup()

    def _ready(self, context) -> None:
        self.scheduler.metrics = self.metrics  # after the warm-up, whose requests are not counted
        quiet_per_call_lines(context)  # a call is a step here: one token
        if self.config.continuous_batching.overlap_round_trips:
            release_openmp_threads()  # the step thread runs the model from now on (see cpu.py)
            self.stepper = SteppingThread(self.scheduler).start()
            self.round_trips.overlapped = True

    def _describe(self) -> str:
        steps = ("steps in their own thread, overlapping the frontend's round trips" if self.stepper
                 else f"{self.steps_per_call} steps per call")
        return (f"continuous batching: {self.config.slots} slots, "
                f"{self.config.continuous_batching.max_prefill_tokens_per_step} prompt tokens per step, {steps}")

    def handle(self, data: List[Any], context) -> List[str]:
        started = time.perf_counter()
        bodies = self._handle(data, context)
        self.metrics.flush(force=not self.live)  # while requests run, at most every second
        self.round_trips.record(started, time.perf_counter(), busy=bool(self.live))
        return bodies

    def _handle(self, data: List[Any], context) -> List[str]:
        ids = [context.request_ids[i] for i in range(len(data))]
        self._drop_departed(set(ids))
        rejected = {i: self._admit(context, i, rid, raw) for i, (rid, raw) in enumerate(zip(ids, data))
                    if rid not in self.live}
        self._count_new(rejected)
        if self.stepper is not None:
            self._await_step()
        else:
            self._run()
        bodies, last = [], []
        with self._output:
            for idx, rid in enumerate(ids):
                error = rejected.get(idx)
                body, final = (self._error_response(context, idx, error) if error is not None
                               else self._response(context, idx, rid))
                bodies.append(body)
                last.append(final)
        context.stopping_criteria = [functools.partial(_is_last, flag) for flag in last]
        return bodies

    def _count_new(self, outcomes: Dict[int, Any]) -> None:
        """Count the new requests, those refused at admission and those answered without generating."""
        for outcome in outcomes.values():
            self.metrics.received()
            if isinstance(outcome, RequestError):
                self.metrics.error(outcome.status)
            elif isinstance(outcome, Reply):
                self.metrics.answered()

    def _drop_departed(self, present) -> None:
        for rid in [r for r in self.live if r not in present]:
            logger.info("request %s left (client gone); freeing its slot", rid)
            self.scheduler.cancel(rid)
            del self.live[rid]

    def _admit(self, context, idx: int, rid: str, raw: Any) -> Optional[Union[RequestError, Reply]]:
        """Parse and submit a new request; return its error (or its Reply, for v1/models) instead of raising."""
        try:
            request = read_request(context, idx, raw, self.config.handler.max_input_bytes)
            if isinstance(request, Reply):
                return request
            live = LiveRequest(self.scheduler.prepare(request))
            live.handle = self.scheduler.submit(live.prepared, functools.partial(self._on_event, live),
                                                request_id=rid)
        except RequestError as exc:
            return exc
        except Exception as exc:  # a bug on one input fails that request only
            logger.exception("admitting request %s failed", rid)
            return RequestError(f"internal error: {exc}", status=500)
        self.live[rid] = live
        return None

    def _on_event(self, live: LiveRequest, event) -> None:
        """The scheduler's callback (in the step thread when overlapping): queue the request's chunk."""
        with self._output:
            try:
                if live.stream:
                    live.chunks.append(stream_error(live.prepared.request, event.error) if event.error is not None
                                       else stream_chunk(live.prepared.request, event))
            except Exception:
                live.chunks.append(stream_error(live.prepared.request, RequestError("internal error", status=500)))
                live.finished = True
                raise  # the scheduler cancels the request: no more events come
            live.finished = live.finished or event.finished

    def _await_step(self) -> None:
        """Overlapped: unless some output is ready, wait for a step newer than the last call saw."""
        self.stepper.wake()
        started = time.perf_counter()
        with self._output:
            ready = any(live.chunks or live.finished for live in self.live.values())
        if self.live and not ready:
            self.stepper.wait_for_step(self._steps_seen, STEP_WAIT_S)
        self._steps_seen = self.stepper.steps_done
        self.round_trips.stepping += time.perf_counter() - started

    def _run(self) -> None:
        """Up to ``steps_per_call`` steps; return early when a request ends, so its slot refills."""
        started = time.perf_counter()
        try:
            for _ in range(self.steps_per_call):
                if not self.scheduler.step() or any(live.handle.done for live in self.live.values()):
                    return
        finally:
            self.round_trips.stepping += time.perf_counter() - started

    def _response(self, context, idx: int, rid: str):
        """The request's output since the last call and whether it is its last (under ``_output``)."""
        live = self.live[rid]
        done = live.finished
        first = not live.responded
        body = "".join(live.chunks)
        live.chunks.clear()
        status = 200
        if done and not live.stream:
            error = live.handle.error
            if error is None:
                body = full_response(live.prepared.request, live.handle.result)
            else:
                error = api_error(context, idx, error)
                body, status = error.to_json(), error.status
        if first:  # a non-200 status only ever comes with a non-streaming request's JSON
            set_head(context, idx, status, CONTENT_TYPES[live.prepared.request.output] if live.stream else JSON)
        live.responded = True
        if done:
            del self.live[rid]
        # A request whose first response is also its last goes out as one plain response.
        return body, (None if first and done else done)

    @staticmethod
    def _error_response(context, idx: int, error: Union[RequestError, Reply]):
        if isinstance(error, Reply):
            set_head(context, idx, error.status, error.content_type)
            return error.body, None
        error = api_error(context, idx, error)
        set_head(context, idx, error.status, JSON)
        return error.to_json(), None


class _MetricsWithoutPredictionTime:
    """``context.metrics`` without the ``PredictionTime`` TorchServe's worker records per handler call."""

    def __init__(self, metrics):
        object.__setattr__(self, "_metrics", metrics)

    def add_time(self, name, *args, **kwargs):
        if name != PREDICTION_TIME:
            return self._metrics.add_time(name, *args, **kwargs)
        return None

    def __getattr__(self, name):
        return getattr(self._metrics, name)

    def __setattr__(self, name, value):
        setattr(self._metrics, name, value)


PREDICTION_TIME = "PredictionTime"
PER_CALL_LOG_LINE = "Backend received inference at"


def _not_per_call_line(record: logging.LogRecord) -> bool:
    return not str(record.msg).startswith(PER_CALL_LOG_LINE)


def quiet_per_call_lines(context) -> None:
    """Drop the two lines TorchServe's worker writes to stdout per handler call.

    Under continuous batching a call is a step, so each generated token cost the frontend two
    lines to read, parse and log: the worker's "Backend received inference at: <time>" (an
    INFO line of the root logger) and the ``PredictionTime`` gauge (a ``[METRICS]`` line), a step's
    latency that the llama_* metrics report properly. The handler's own lines and metrics stay.
    """
    logging.getLogger().addFilter(_not_per_call_line)
    context.metrics = _MetricsWithoutPredictionTime(context.metrics)


class RoundTrips:
    """Time inside the handler against time between calls (the frontend's round trip).

    Logged every ``every`` seconds, so the cost of one frontend round trip per
    step is visible in the model log instead of guessed. ``overlapped``: the steps run in their
    own thread, so the time inside a call is waiting for one, and the model is not idle
    during the round trip.
    """

    def __init__(self, every: float = 10.0, overlapped: bool = False):
        self.every = every
        self.overlapped = overlapped
        self._reset(None)

    def _reset(self, now: Optional[float]) -> None:
        self.calls, self.inside, self.between, self.since = 0, 0.0, 0.0, now
        self.stepping = 0.0  # of ``inside``: the scheduler's steps (the rest is the handler's own work)
        self.last_end: Optional[float] = None

    def record(self, start: float, end: float, busy: bool) -> None:
        if self.since is None:
            self.since = start
        self.calls += 1
        self.inside += end - start
        if self.last_end is not None:
            self.between += start - self.last_end
        self.last_end = end if busy else None  # an idle gap is waiting for traffic, not a round trip
        if end - self.since >= self.every:
            logger.info("continuous batching: %d calls, %.2f ms in the handler (%.2f ms of it %s) "
                        "and %.2f ms in the frontend round trip per call (%.0f%% of the time)", self.calls,
                        1000 * self.inside / self.calls, 1000 * self.stepping / self.calls,
                        "waiting for a step" if self.overlapped else "in scheduler steps",
                        1000 * self.between / self.calls, 100 * self.between / max(self.inside + self.between, 1e-9))
            self._reset(end)


def _is_last(flag: Optional[bool], _body) -> Optional[bool]:
    """TorchServe's per-request stopping criterion: True last, False more to come, None not a stream."""
    return flag


_service = None


def take_raw_bodies() -> None:
    """Have TorchServe's worker hand every body over as the client's bytes.

    By default the worker ``json.loads`` each ``application/json`` body in its message loop
    (``otf_message_handler._retrieve_input_data``) before the handler runs: the handler then
    cannot bound the nesting depth before decoding, counts the size limit on a re-encoding
    instead of the bytes sent (a 45 kB CJK prompt counted as 90 kB and got a 413), and every
    JSON body is decoded twice when that decode fails. The worker reads this variable (which
    ``decode_input_request=false`` in config.properties also sets) for every request, so
    setting it here, when the model loads, covers any config.properties the archive is served
    with; ``llama_engine.request`` parses the bytes itself.
    """
    os.environ["TS_DECODE_INPUT_REQUEST"] = "false"


def handle(data, context):
    """Module-level entry point, as TorchServe calls a handler module."""
    global _service
    if _service is None:
        take_raw_bodies()
        continuous = load_model_config(context.model_yaml_config).continuous
        _service = ContinuousHandler() if continuous else LlamaHandler()
    if not _service.initialized:
        _service.initialize(context)
    if data is None:
        return None
    return _service.handle(data, context)
