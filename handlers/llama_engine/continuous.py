"""Continuous batching: requests join and leave the running batch between decode steps.

The static engine (``engine.py``) runs a batch from prefill to its last row, so a request
that arrives meanwhile waits for the whole batch, and a short answer holds its row until the
longest one ends. Here a :class:`ContinuousScheduler` owns the slots of a
:class:`~llama_engine.backends.base.SlotBackend` and runs one loop; each iteration (``step``)

1. drops cancelled requests and frees their slots;
2. plans the prefill: continues prompts already admitted, then admits waiting requests
   into free slots, all within ``max_prefill_tokens_per_step`` prompt tokens. A longer
   prompt is prefilled in chunks over several steps (chunked prefill), so it cannot stall
   the streams already running. With no stream running there is none to stall: the step
   may then prefill one budget per slot, so a burst arriving at an idle server is prefilled
   in one pass, as micro-batching would;
3. runs those chunks and one decode token for every request that was running when the
   step began, in one backend call (one forward pass on the torch backend); a request
   whose prompt is now complete gets its first token.

Each request is a :class:`RequestHandle`, its :class:`~llama_engine.lifecycle.Generation`
(the same selection, detokenization, stopping and result as the static engine's rows) plus
its place here: its slot and how much of its prompt is in it. Its ``TokenEvent`` go to its
own callback. A request that finishes (EOS, length, stop sequence, error) frees its slot
before its callback sees the final event.

Threading: ``prepare``, ``submit`` and ``cancel`` may come from any thread, also while
another thread is inside ``step`` (:class:`SteppingThread` steps in a thread of its own); one
lock guards the queue and the slots, and the forward pass runs outside it. Steps themselves
run one at a time. Callbacks run inside ``step`` with that lock held, so they should hand
events off rather than block, and must not call back into the scheduler from another thread
they wait on; a cancellation made meanwhile takes effect at the next step.
"""
from __future__ import annotations

import heapq
import itertools
import logging
import threading
import time
from collections import deque
from typing import Callable, Deque, Dict, List, Optional, Sequence

from .backends.base import PrefillChunk, SlotBackend
from .errors import RequestError
from .lifecycle import (
    FINISH_ERROR,
    Generation,
    Limits,
    PreparedRequest,
    RequestLifecycle,
    RequestStatus,
    load_tokenizer,
)
from .metrics import NULL_SINK, MetricsSink
from .selection import select_token_lists, select_tokens
from .streamer import TokenEvent

logger = logging.getLogger(__name__)

EventCallback = Callable[[TokenEvent], None]


def step_prefill_budget(per_step: int, slots: int, streams_running: bool) -> int:
    """A step's prompt tokens: ``per_step`` while streams decode (it bounds their gaps), else one per slot.

    Shared with ``scripts.bench.continuous_bound``, whose ideal schedule follows this policy.
    """
    return per_step if streams_running else per_step * slots


class RequestHandle(Generation):
    """One submitted request: its generation (status, tokens, result, error) and its place in the scheduler."""

    def __init__(self, request_id: str, prepared: PreparedRequest, lifecycle: RequestLifecycle,
                 on_event: Optional[EventCallback]):
        super().__init__(prepared, lifecycle)
        self.request_id = request_id
        self.on_event = on_event
        self.slot: Optional[int] = None
        self.prefilled = 0  # prompt tokens already in the slot
        self.next_token: Optional[int] = None  # the token the next decode step feeds
        self.first_token_step: Optional[int] = None  # the scheduler step that produced the first token


class ContinuousScheduler:
    def __init__(self, backend: SlotBackend, tokenizer, max_slots: Optional[int] = None, max_queue: int = 64,
                 max_prefill_tokens_per_step: int = 256, default_max_new_tokens: int = 64):
        max_slots = backend.max_slots if max_slots is None else max_slots
        if not 1 <= max_slots <= backend.max_slots:
            raise ValueError(f"max_slots must be in [1, {backend.max_slots}] (the backend's slots), got {max_slots}")
        if max_queue < 0:
            raise ValueError(f"max_queue must be >= 0, got {max_queue}")
        if max_prefill_tokens_per_step < 1:
            raise ValueError(f"max_prefill_tokens_per_step must be >= 1, got {max_prefill_tokens_per_step}")
        self.backend = backend
        self.lifecycle = RequestLifecycle(tokenizer, Limits.of(backend, default_max_new_tokens))
        self.max_slots = max_slots
        self.max_queue = max_queue
        self.max_prefill_tokens_per_step = max_prefill_tokens_per_step
        self.steps = 0
        self._free: List[int] = list(range(max_slots))  # a heap: admission takes the lowest free slot
        self._active: Dict[int, RequestHandle] = {}  # slot -> request (prefilling or running)
        self._waiting: Deque[RequestHandle] = deque()
        self._by_id: Dict[str, RequestHandle] = {}
        self._cancelled: List[str] = []
        self._ids = itertools.count(1)
        self._lock = threading.RLock()  # the queue, the slots and the requests' events
        self._step_lock = threading.Lock()  # one step at a time, whichever thread calls it
        #: Where requests' events and steps are reported; set it after ``warmup`` (which would count).
        self.metrics: MetricsSink = NULL_SINK

    @classmethod
    def from_config(cls, handler_cfg, model_dir: str, max_slots: int, max_prefill_tokens_per_step: int,
                    max_queue: Optional[int] = None, build_cache_dir: Optional[str] = None) -> "ContinuousScheduler":
        """The tokenizer and a slot backend of ``max_slots`` slots, as ``handler:`` describes them."""
        from .backends import create_slot_backend

        backend = create_slot_backend(handler_cfg, model_dir, max_slots, build_cache_dir)
        return cls(backend, load_tokenizer(handler_cfg, model_dir), max_slots=max_slots,
                   max_queue=max_slots if max_queue is None else max_queue,
                   max_prefill_tokens_per_step=max_prefill_tokens_per_step,
                   default_max_new_tokens=handler_cfg.max_new_tokens)

    @property
    def tokenizer(self):
        return self.lifecycle.tokenizer

    def prepare(self, request) -> PreparedRequest:
        """Tokenize ``request`` and check it against the slots' limits (RequestError if over).

        Under the lock: a fast tokenizer that is encoding while another thread decodes with it
        can fail with "Already borrowed" (its padding and truncation settings are changed per call).
        """
        with self._lock:
            return self.lifecycle.prepare(request)

    def warmup(self, max_new_tokens: int = 2, prompt_lengths: Sequence[int] = ()) -> None:
        """Fill every slot with a short request and run them to the end, stepping here.

        The first full decode step and the prefill of each slot pay their one-off costs now
        (allocation, kernel selection, compiled graphs) instead of on a user's request.
        ``prompt_lengths`` adds one request per length, so that a compiling backend builds
        the graph of every context bucket now.
        """
        short, *per_length = self.lifecycle.warmup_requests(max_new_tokens, prompt_lengths)
        wave = max(self.max_queue, 1)
        prepared = [short] * min(self.max_slots, wave) + per_length
        for start in range(0, len(prepared), wave):
            handles = [self.submit(p) for p in prepared[start:start + wave]]
            while not all(h.done for h in handles):
                self.step()

    # ----- submission, cancellation, inspection

    def submit(self, prepared: PreparedRequest, on_event: Optional[EventCallback] = None,
               request_id: Optional[str] = None) -> RequestHandle:
        """Queue a request; RequestError 400 when it does not fit a slot (a request prepared
        elsewhere), 503 when ``max_queue`` requests already wait for a slot."""
        with self._lock:
            return self._submit(prepared, on_event, request_id)

    def _submit(self, prepared: PreparedRequest, on_event: Optional[EventCallback],
                request_id: Optional[str]) -> RequestHandle:
        self.lifecycle.check(prepared)
        rid = request_id if request_id is not None else f"req-{next(self._ids)}"
        if rid in self._by_id:
            raise RequestError(f"request id {rid!r} is already in use", "request_id")
        if len(self._waiting) >= self.max_queue:
            raise RequestError(
                f"the server is busy: {len(self._waiting)} requests are already waiting for one of "
                f"{self.max_slots} generation slots (queue limit {self.max_queue}); retry later",
                status=503)
        handle = RequestHandle(rid, prepared, self.lifecycle, on_event)
        self._waiting.append(handle)
        self._by_id[rid] = handle
        return handle

    def cancel(self, request_id: str) -> bool:
        """Drop a request (its client went away); its callback sees nothing more.

        A waiting request leaves the queue now; one in a slot frees it at the start of the
        next step. Return False if the request is unknown or already over.
        """
        with self._lock:
            handle = self._by_id.get(request_id)
            if handle is None or handle.done:
                return False
            if handle.status is RequestStatus.WAITING:
                self._waiting.remove(handle)
                handle.cancel()
                self._ended(handle)
            else:
                self._cancelled.append(request_id)
            return True

    def abort(self, error: BaseException) -> int:
        """Fail every request in a slot or waiting for one with ``error``; return how many.

        For a step that raised where no request's own failure explains it (a bug): the requests
        get their error instead of waiting for steps that would raise again.
        """
        with self._lock:
            handles = list(self._active.values()) + list(self._waiting)
            self._waiting.clear()
            for handle in handles:
                if not handle.done:
                    self._fail(handle, error)
            return len(handles)

    @property
    def free_slots(self) -> List[int]:
        return sorted(self._free)

    @property
    def queue_length(self) -> int:
        return len(self._waiting)

    @property
    def active(self) -> Dict[int, RequestHandle]:
        """Requests holding a slot, by slot."""
        return dict(self._active)

    @property
    def idle(self) -> bool:
        return not self._waiting and not self._active and not self._cancelled

    # ----- the loop

    def step(self) -> bool:
        """One iteration: cancellations, prefill within the token budget, one decode step.

        The step's prompt chunks and decode rows go to the backend together
        (``step_slots``), which runs them in one forward pass where it can. Return False when
        there was nothing to do.
        """
        with self._step_lock:
            with self._lock:
                if self.idle:
                    return False
                self._apply_cancellations()
                started = time.perf_counter()
                running = sorted((h for h in self._active.values() if h.status is RequestStatus.RUNNING),
                                 key=lambda h: h.slot)
                chunks = self._plan_prefill(step_prefill_budget(self.max_prefill_tokens_per_step, self.max_slots,
                                                                 bool(running)))
            forward_started = time.perf_counter()
            out = self.backend.step_slots([h.slot for h in running], [h.next_token for h in running],
                                          [PrefillChunk(h.slot, ids, h.prefilled) for h, ids in chunks])
            self.metrics.forward(len(running), sum(len(ids) for _, ids in chunks),
                                 time.perf_counter() - forward_started)
            with self._lock:
                for (handle, ids), logits in zip(chunks, out.prefills):
                    self._prefilled(handle, len(ids), logits)
                self._decoded([h for h in running if h.status is RequestStatus.RUNNING], out.decode, out.picks)
            self.metrics.steps(1, len(running) + len(chunks), time.perf_counter() - started)
            self.steps += 1
            return True

    # ----- internals

    def _apply_cancellations(self) -> None:
        ids, self._cancelled = self._cancelled, []
        for rid in ids:
            handle = self._by_id.get(rid)
            if handle is not None and not handle.done:
                self._release(handle)
                handle.cancel()
                self._ended(handle)

    def _plan_prefill(self, budget: int) -> List[tuple]:
        """Spend ``budget`` prompt tokens: first on prompts under way, then on new admissions.

        Returns ``(handle, chunk token ids)`` pairs, admitting waiting requests into free slots.
        """
        chunks = []
        candidates = self._prefill_candidates()
        while budget > 0:
            handle = next(candidates, None)
            if handle is None:
                break
            chunks.append((handle, self._chunk(handle, budget)))
            budget -= len(chunks[-1][1])
        return chunks

    def _prefill_candidates(self):
        """Prompts under way (by slot), then waiting requests admitted one at a time as they are drawn."""
        yield from sorted((h for h in self._active.values() if h.status is RequestStatus.PREFILLING),
                          key=lambda h: h.slot)
        while self._free:
            handle = self._admit()
            if handle is None:
                return
            yield handle

    def _admit(self) -> Optional[RequestHandle]:
        if not self._waiting:
            return None
        handle = self._waiting.popleft()
        handle.slot = heapq.heappop(self._free)
        handle.admit()
        self._active[handle.slot] = handle
        self.metrics.admitted(handle.prepared)
        return handle

    def _chunk(self, handle: RequestHandle, budget: int) -> List[int]:
        """The next prompt tokens of ``handle`` to prefill within ``budget``."""
        prompt, start = handle.prepared.prompt_ids, handle.prefilled
        return list(prompt[start:start + self._chunk_size(len(prompt) - start, budget)])

    def _prefilled(self, handle: RequestHandle, n: int, logits) -> None:
        """``n`` more prompt tokens of ``handle`` are in its slot; a complete prompt gets its first token."""
        if isinstance(logits, BaseException):
            self._fail(handle, logits)
            return
        handle.prefilled += n
        if handle.prefilled < len(handle.prepared.prompt_ids):
            return
        try:
            tokens, logprobs = select_tokens(logits.unsqueeze(0), [handle.selector])
        except Exception as exc:  # noqa: BLE001 - this request's selection failed: it fails alone
            self._fail(handle, exc)
            return
        handle.start_decoding()
        self._deliver(handle, int(tokens[0]), logprobs[0])

    def _chunk_size(self, remaining: int, budget: int) -> int:
        """Prompt tokens to prefill now: within the budget, unless the backend cannot append.

        A backend without incremental prefill re-encodes the whole prompt on every call, so
        its prompts go in one call (up to ``max_prefill_chunk``), budget or not.
        """
        limit = self.backend.max_prefill_chunk
        size = remaining if not self.backend.incremental_prefill else min(remaining, budget)
        return size if limit is None else min(size, limit)

    def _decoded(self, handles: List[RequestHandle], logits, picks) -> None:
        if not handles:
            return
        try:
            if isinstance(logits, BaseException):
                raise logits
            tokens, logprobs = select_token_lists(logits, [h.selector for h in handles], picks)
        except Exception as exc:  # noqa: BLE001 - the step is shared: every row in it fails, the others go on
            for handle in handles:
                self._fail(handle, exc)
            return
        for handle, token, logprob in zip(handles, tokens, logprobs):
            self._deliver(handle, token, logprob)

    def _deliver(self, handle: RequestHandle, token: int, logprob: float) -> None:
        event = handle.add(token, logprob)
        event.row = handle.slot
        handle.next_token = token
        if handle.first_token_step is None:
            handle.first_token_step = self.steps
        self.metrics.token(handle.prepared, event.index)
        if event.finished:
            self._release(handle)
            self._ended(handle)
        self._emit(handle, event)

    def _fail(self, handle: RequestHandle, exc: BaseException) -> None:
        logger.error("request %s failed: %s", handle.request_id, exc)
        slot = handle.slot
        self._release(handle)
        handle.fail(exc)
        self._ended(handle)
        self._emit(handle, TokenEvent(-1 if slot is None else slot, None, "", False, result=handle.result,
                                      error=handle.error))

    def _emit(self, handle: RequestHandle, event: TokenEvent) -> None:
        """Hand the event to the request's callback; a callback that raises cancels its request."""
        if handle.on_event is None:
            return
        try:
            handle.on_event(event)
        except Exception:
            logger.exception("callback of request %s raised; cancelling it", handle.request_id)
            if not handle.done:
                self._release(handle)
                handle.cancel()
                self._ended(handle)

    def _release(self, handle: RequestHandle) -> None:
        """Give the request's slot back at once, so the next admission can take it."""
        if handle.slot is None or self._active.get(handle.slot) is not handle:
            return
        del self._active[handle.slot]
        self.backend.free_slot(handle.slot)
        heapq.heappush(self._free, handle.slot)

    def _ended(self, handle: RequestHandle) -> None:
        """Forget a request that has its result, and report how it ended."""
        self._by_id.pop(handle.request_id, None)
        result = handle.result
        if result.finish_reason == FINISH_ERROR:
            self.metrics.error(handle.error.status, handle.prepared)
        else:
            self.metrics.finished(handle.prepared, result.finish_reason, result.generated_tokens)


class SteppingThread:
    """Steps a :class:`ContinuousScheduler` in a thread of its own while it has work.

    Driven call by call, the model waits whenever its caller is away: under TorchServe's
    continuous batching each step's tokens make a round trip through the frontend before the
    next handler call steps again, 2.3-3.7 ms a call on a 2-vCPU EPYC against steps of 8-50 ms.
    Here the next step runs during that round trip. Submit and cancel on the scheduler (both
    thread-safe) and call :meth:`wake` after a submission; :meth:`wait_for_step` blocks until a
    step later than the one a caller saw has ended. A step that raises (a bug: a backend's
    failure fails its own requests inside the step) fails every request in flight and the
    thread goes on.
    """

    def __init__(self, scheduler: ContinuousScheduler, idle_wait: float = 0.5, name: str = "llama-steps"):
        self.scheduler = scheduler
        self.idle_wait = idle_wait
        self.steps_done = 0
        self._progress = threading.Condition()
        self._wake = threading.Event()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, name=name, daemon=True)

    def start(self) -> "SteppingThread":
        self._thread.start()
        return self

    @property
    def alive(self) -> bool:
        return self._thread.is_alive()

    def wake(self) -> None:
        """Have an idle thread look for work now (after a submission)."""
        self._wake.set()

    def stop(self, timeout: float = 10.0) -> None:
        """End the thread after its current step; callers waiting for a step return."""
        self._stop.set()
        self._wake.set()
        with self._progress:
            self._progress.notify_all()
        self._thread.join(timeout)

    def wait_for_step(self, seen: int, timeout: float) -> int:
        """Block until more than ``seen`` steps have ended (or ``timeout`` s); return the count."""
        with self._progress:
            self._progress.wait_for(lambda: self.steps_done != seen or self._stop.is_set(), timeout)
            return self.steps_done

    def _loop(self) -> None:
        while not self._stop.is_set():
            try:
                stepped = self.scheduler.step()
            except Exception as exc:
                logger.exception("a scheduler step raised; failing the requests in flight")
                self.scheduler.abort(exc)
                stepped = True
            if stepped:
                with self._progress:
                    self.steps_done += 1
                    self._progress.notify_all()
            else:
                self._wake.wait(self.idle_wait)
                self._wake.clear()
