"""One request's life in the engine, the same in both batching modes.

::

    GenerationRequest --prepare--> PreparedRequest --start--> Generation --add(token)...--> GenerationResult

* :meth:`RequestLifecycle.prepare` renders chat messages, tokenizes, and checks the request
  against the model's :class:`Limits` (:meth:`Limits.check`, the one place length limits are
  checked: once per request, and again at the continuous scheduler's door only for a request
  prepared against other limits).
* :meth:`RequestLifecycle.start` gives the request its :class:`Generation`: its own
  ``TokenSelector`` (selection.py, after optimum-neuron), ``IncrementalDetokenizer``
  (detokenizer.py), ``StoppingCriteria`` and ``StopSequences`` (stopping.py, after TGI), all
  built from its ``SamplingParams`` (params.py, after vLLM).
* :meth:`Generation.add` takes each token chosen for the request and returns the
  ``TokenEvent`` to stream; on EOS, length or a stop sequence it finishes the generation
  itself. The engine finishes it from outside when its client leaves (:meth:`Generation.cancel`)
  or its step fails (:meth:`Generation.fail`). The result carries the finish reason and the
  token counts (usage).

The static engine (engine.py) runs a batch of generations from prefill to the last one; the
continuous scheduler (continuous.py) keeps each in a slot of its own. Each walks a request
through the same :class:`RequestStatus` values (as vLLM's and TGI's schedulers do)::

    WAITING --admit--> PREFILLING --start_decoding--> RUNNING --add / finish--> FINISHED

and any state but FINISHED may go straight to FINISHED (cancelled, failed).

Errors: backends know nothing of HTTP. They raise plain errors, ``PromptTooLong`` (a
``ValueError``) for a prompt they cannot encode, and :func:`request_error` maps whatever a
request failed with to the :class:`~llama_engine.errors.RequestError` (with its status) that
it is answered with.
"""
from __future__ import annotations

import enum
import os
from dataclasses import dataclass, field
from typing import List, Optional, Sequence

from .backends.base import PromptTooLong
from .chat import render_chat
from .detokenizer import IncrementalDetokenizer
from .errors import RequestError
from .metrics import RequestTimes
from .params import SamplingParams
from .request import GenerationRequest
from .selection import TokenSelector
from .stopping import FINISH_STOP, StoppingCriteria, StopSequences
from .streamer import GenerationResult, TokenEvent, TokenLogprobs

#: Finish reasons the engine decides, next to the stopping criteria's own ("length",
#: "eos_token", "stop_sequence", in stopping.py).
FINISH_CANCELLED = "cancelled"
FINISH_ERROR = "error"


class RequestStatus(enum.Enum):
    WAITING = "waiting"  # queued for a row or a slot
    PREFILLING = "prefilling"  # holds a row or a slot; its prompt is being encoded (maybe over several steps)
    RUNNING = "running"  # its prompt is in the cache; every step gives it a token
    FINISHED = "finished"  # it has its result (finished, cancelled or failed)


_NEXT = {
    RequestStatus.WAITING: (RequestStatus.PREFILLING, RequestStatus.FINISHED),
    RequestStatus.PREFILLING: (RequestStatus.RUNNING, RequestStatus.FINISHED),
    RequestStatus.RUNNING: (RequestStatus.FINISHED,),
    RequestStatus.FINISHED: (),
}


@dataclass
class PreparedRequest:
    """A request tokenized and checked against the limits: what a batching mode runs."""

    request: GenerationRequest
    prompt_ids: List[int]
    max_new_tokens: int
    times: RequestTimes = field(default_factory=RequestTimes)  # for the metrics sink
    #: The limits it was checked against (None: made by hand, unchecked).
    limits: Optional["Limits"] = None


def prompt_field(request: Optional[GenerationRequest]) -> str:
    """The body field a request's prompt came from, for errors about the prompt."""
    return "messages" if request is not None and request.messages is not None else "inputs"


@dataclass(frozen=True)
class Limits:
    """How long a request may be on one model (its backend's shapes and the config's default)."""

    #: Positions one row or slot holds: the prompt and the answer.
    max_length: int
    #: The longest prompt the backend encodes (Neuron: its largest context bucket); None: any that fits.
    max_prompt_length: Optional[int] = None
    #: ``max_new_tokens`` of a request that does not say (``handler.max_new_tokens``).
    default_max_new_tokens: int = 64

    @classmethod
    def of(cls, backend, default_max_new_tokens: int) -> "Limits":
        return cls(backend.max_length, backend.max_prompt_length, default_max_new_tokens)

    def check(self, prompt_tokens: int, max_new_tokens: Optional[int], field: str = "inputs") -> int:
        """The tokens to generate for a prompt of ``prompt_tokens`` that asks for ``max_new_tokens``
        (None: the default, cut to the room left); a RequestError (400) naming the field if it
        does not fit."""
        if prompt_tokens == 0:
            raise RequestError("the prompt has no tokens", field)
        bucket = self.max_prompt_length
        if bucket is not None and prompt_tokens > bucket:
            raise RequestError(
                f"the prompt is {prompt_tokens} tokens; the limit is {bucket} tokens "
                "(the largest compiled context bucket, handler.context_length_estimate)", field)
        if prompt_tokens >= self.max_length:
            raise RequestError(
                f"the prompt is {prompt_tokens} tokens; the limit is {self.max_length - 1} tokens "
                f"(handler.max_length {self.max_length} holds the prompt and the answer)", field)
        room = self.max_length - prompt_tokens
        if max_new_tokens is None:
            return min(self.default_max_new_tokens, room)
        if max_new_tokens > room:
            raise RequestError(
                f"max_new_tokens is {max_new_tokens}, but the prompt ({prompt_tokens} tokens) leaves room "
                f"for only {room} of handler.max_length {self.max_length}", "max_new_tokens")
        return max_new_tokens


def request_error(error: BaseException, request: Optional[GenerationRequest] = None) -> RequestError:
    """What a request that failed with ``error`` is answered with.

    A RequestError stays as it is; a backend's ``PromptTooLong`` is the request's fault (400,
    naming its prompt); anything else failed the generation (500).
    """
    if isinstance(error, RequestError):
        return error
    if isinstance(error, PromptTooLong):
        mapped = RequestError(str(error), prompt_field(request))
    else:
        mapped = RequestError(f"generation failed: {error}", status=500)
    mapped.__cause__ = error
    return mapped


def load_tokenizer(handler_cfg, model_dir: str):
    """The tokenizer of ``handler.model_path`` in the model directory."""
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(os.path.join(model_dir, handler_cfg.model_path))


class RequestLifecycle:
    """What the life of every request on one model shares: the tokenizer, its end-of-sequence,
    special and padding ids, and the limits. One per engine or scheduler."""

    def __init__(self, tokenizer, limits: Limits):
        self.tokenizer = tokenizer
        self.limits = limits
        eos = tokenizer.eos_token_id
        self.eos_token_ids = frozenset(() if eos is None else (eos,))
        self.special_ids = frozenset(tokenizer.all_special_ids)
        self.pad_token_id = next((i for i in (tokenizer.pad_token_id, eos) if i is not None), 0)

    def prepare(self, request: GenerationRequest) -> PreparedRequest:
        """Tokenize ``request`` (a chat is rendered first) and check it against the limits."""
        times = RequestTimes()  # received now, before tokenizing
        if request.messages is not None:
            request.prompt = render_chat(self.tokenizer, request.messages)
            prompt_ids = self.tokenizer(request.prompt, add_special_tokens=False)["input_ids"]
        else:
            prompt_ids = self.tokenizer(request.prompt)["input_ids"]
        max_new_tokens = self.limits.check(len(prompt_ids), request.params.max_new_tokens, prompt_field(request))
        return PreparedRequest(request, prompt_ids, max_new_tokens, times, self.limits)

    def check(self, prepared: PreparedRequest) -> None:
        """Refuse a request that was prepared against other limits (another engine's, or none:
        made by a script) and does not fit these. One prepared here was checked already."""
        if prepared.limits != self.limits:
            self.limits.check(len(prepared.prompt_ids), prepared.max_new_tokens, prompt_field(prepared.request))

    def start(self, prepared: PreparedRequest) -> "Generation":
        return Generation(prepared, self)

    def warmup_requests(self, max_new_tokens: int = 2, prompt_lengths: Sequence[int] = ()) -> List[PreparedRequest]:
        """A short request, then one per length in ``prompt_lengths`` with a prompt exactly that long
        (so that a compiling backend builds the graph of every context bucket)."""
        request = GenerationRequest("Warm-up", SamplingParams(max_new_tokens=max_new_tokens))
        filler = self.tokenizer(" the", add_special_tokens=False)["input_ids"][-1]
        start = self.tokenizer("")["input_ids"]
        return [self.prepare(request)] + [
            PreparedRequest(request, (start + [filler] * length)[:length],
                            min(max_new_tokens, self.limits.max_length - length))
            for length in prompt_lengths]


class Generation:
    """One request's generation: its selector, detokenizer and stopping, its tokens and its result.

    :meth:`add` is the per-token path of both batching modes: it does only what every token
    needs (detokenize, stop, the event), and builds the result once, when the request ends.
    """

    def __init__(self, prepared: PreparedRequest, lifecycle: RequestLifecycle):
        params = prepared.request.params
        self.prepared = prepared
        self.status = RequestStatus.WAITING
        self.selector = TokenSelector(params, prepared.prompt_ids)
        self.detokenizer = IncrementalDetokenizer(lifecycle.tokenizer, prepared.prompt_ids)
        self.stopping = StoppingCriteria(lifecycle.eos_token_ids, prepared.max_new_tokens)
        self.stop_sequences = StopSequences(params.stop) if params.stop else None
        self.special_ids = lifecycle.special_ids
        self.token_ids: List[int] = []
        self.pieces: List[str] = []  # the text each token released
        self.logprobs: List[float] = []
        self.top_logprobs: Optional[List[TokenLogprobs]] = [] if params.logprobs is not None else None
        self.result: Optional[GenerationResult] = None
        self.error: Optional[RequestError] = None  # set when it failed

    @property
    def done(self) -> bool:
        return self.status is RequestStatus.FINISHED

    # ----- status

    def admit(self) -> None:
        """It got its row or slot; its prompt is encoded next."""
        self._move(RequestStatus.PREFILLING)

    def start_decoding(self) -> None:
        """Its whole prompt is in the cache; the next token chosen is its first."""
        self._move(RequestStatus.RUNNING)

    def _move(self, status: RequestStatus) -> None:
        if status not in _NEXT[self.status]:
            raise RuntimeError(f"a {self.status.value} request cannot become {status.value}")
        self.status = status

    # ----- tokens

    def add(self, token_id: int, logprob: float = 0.0) -> TokenEvent:
        """Take the token chosen for this request; return its event (``result`` set on the last)."""
        top = self._top_logprobs(token_id, logprob) if self.top_logprobs is not None else None
        self.token_ids.append(token_id)
        self.logprobs.append(logprob)
        text = self.detokenizer.add(token_id)
        stopped, reason = self.stopping(token_id, len(self.token_ids))
        if stopped:
            text += self.detokenizer.flush()
        if self.stop_sequences is not None:
            text, matched = self.stop_sequences(text)
            if matched:
                stopped, reason = True, FINISH_STOP
            elif stopped:
                text += self.stop_sequences.flush()
        self.pieces.append(text)
        if stopped:
            self.finish(reason)
        return TokenEvent(-1, token_id, text, token_id in self.special_ids, logprob, self.result,
                          len(self.token_ids), top)

    def _top_logprobs(self, token_id: int, logprob: float) -> TokenLogprobs:
        text = self.detokenizer.token_text  # before the detokenizer moves past this token
        entry = TokenLogprobs(text(token_id), logprob, [(text(t), lp) for t, lp in self.selector.top])
        self.top_logprobs.append(entry)
        return entry

    # ----- the end

    def finish(self, reason: str) -> GenerationResult:
        """End the request with ``reason``; its result holds what it generated until now."""
        self._move(RequestStatus.FINISHED)
        self.result = GenerationResult(
            "".join(self.pieces), list(self.token_ids), reason, len(self.prepared.prompt_ids), list(self.pieces),
            list(self.logprobs), [t in self.special_ids for t in self.token_ids], self.selector.seed,
            list(self.top_logprobs or ()))
        return self.result

    def cancel(self) -> GenerationResult:
        """Its client went away."""
        return self.finish(FINISH_CANCELLED)

    def fail(self, error: BaseException) -> GenerationResult:
        """Its step failed with ``error``; :attr:`error` is what the request is answered with."""
        self.error = request_error(error, self.prepared.request)
        return self.finish(FINISH_ERROR)
