"""Response bodies of the OpenAI-compatible API, in OpenAI's own schemas.

One formatter per request (:class:`ChatFormat` for ``v1/chat/completions``,
:class:`CompletionFormat` for ``v1/completions``) holds what every body of that request
repeats: its ``id``, ``created`` time and the served ``model`` name. The engine's
``formatting`` functions hand OpenAI requests over to it (``request.api``).

Streams are Server-Sent Events: one ``data: {...}`` chunk per generated token (its text may
be ``""`` while a possible stop sequence or an incomplete UTF-8 character is held back), the
last with ``finish_reason``; with ``stream_options.include_usage`` every chunk has
``"usage": null`` and a last chunk with no choices carries the usage; then ``data: [DONE]``.
"""
from __future__ import annotations

import json
import time
import uuid
from abc import ABC, abstractmethod
from typing import List, Optional

from .errors import RequestError
from .stopping import FINISH_LENGTH
from .streamer import GenerationResult, TokenEvent, TokenLogprobs

DONE = "data: [DONE]\n\n"


def finish_reason(result: GenerationResult) -> str:
    """OpenAI's two reasons: "length" when max_tokens ran out, "stop" for EOS and stop sequences."""
    return "length" if result.finish_reason == FINISH_LENGTH else "stop"


def usage(result: GenerationResult) -> dict:
    return {"prompt_tokens": result.prompt_tokens, "completion_tokens": result.generated_tokens,
            "total_tokens": result.prompt_tokens + result.generated_tokens}


def error_body(message: str, status: int, param: Optional[str] = None, code: Optional[str] = None) -> dict:
    """OpenAI's error schema; the openai client raises BadRequestError (400) etc. with ``param`` and ``code``."""
    kind = "invalid_request_error" if status < 500 else "server_error"
    return {"error": {"message": message, "type": kind, "param": param, "code": code}}


def _dumps(obj) -> str:
    return json.dumps(obj, ensure_ascii=False)


def _sse(obj) -> str:
    return f"data: {_dumps(obj)}\n\n"


def _bytes(text: str) -> Optional[List[int]]:
    """UTF-8 bytes of a token's text; None where the token ends inside a character (its text has U+FFFD)."""
    return None if "\ufffd" in text else list(text.encode("utf-8"))


class _Format(ABC):
    """What chat and text completions share: ids, chunk framing, usage, errors."""

    prefix = ""
    object_name = ""
    chunk_object = ""

    def __init__(self, model: str, include_usage: bool = False, logprobs: bool = False):
        self.id = f"{self.prefix}-{uuid.uuid4().hex}"
        self.created = int(time.time())
        self.model = model
        self.include_usage = include_usage
        self.logprobs = logprobs
        self.started = False

    def _head(self, object_name: str) -> dict:
        return {"id": self.id, "object": object_name, "created": self.created, "model": self.model}

    def stream_chunk(self, event: TokenEvent) -> str:
        """The SSE chunk of one token; after the last one the usage chunk (if asked) and ``[DONE]``."""
        done = event.result is not None
        choice = {"index": 0, **self._delta(event.text),
                  "logprobs": self._logprobs([event.top_logprobs] if event.top_logprobs else []),
                  "finish_reason": finish_reason(event.result) if done else None}
        self.started = True
        chunks = [self._chunk([choice])]
        if done:
            if self.include_usage:
                chunks.append(self._chunk([], usage(event.result)))
            chunks.append(DONE)
        return "".join(chunks)

    def _chunk(self, choices: list, counts: Optional[dict] = None) -> str:
        body = {**self._head(self.chunk_object), "choices": choices}
        if self.include_usage:
            body["usage"] = counts
        return _sse(body)

    def full_response(self, result: GenerationResult) -> str:
        choice = {"index": 0, **self._answer(result.text),
                  "logprobs": self._logprobs(result.top_logprobs),
                  "finish_reason": finish_reason(result)}
        return _dumps({**self._head(self.object_name), "choices": [choice], "usage": usage(result)})

    def stream_error(self, error: RequestError) -> str:
        """A failure after the stream started: an error event, which the openai client raises as APIError."""
        return _sse(error_body(error.message, error.status, error.parameter))

    @abstractmethod
    def _delta(self, text: str) -> dict:
        """A streamed chunk's choice content for ``text``."""

    @abstractmethod
    def _answer(self, text: str) -> dict:
        """The whole answer's choice content for ``text``."""

    @abstractmethod
    def _logprobs(self, tokens: List[TokenLogprobs]) -> Optional[dict]:
        """The choice's ``logprobs`` for ``tokens``, in this API's shape (None when not asked for)."""


class ChatFormat(_Format):
    """``chat.completion`` and ``chat.completion.chunk`` bodies."""

    prefix = "chatcmpl"
    object_name = "chat.completion"
    chunk_object = "chat.completion.chunk"

    def _delta(self, text: str) -> dict:
        delta = {"content": text}
        if not self.started:
            delta = {"role": "assistant", **delta}
        return {"delta": delta}

    def _answer(self, text: str) -> dict:
        return {"message": {"role": "assistant", "content": text}}

    def _logprobs(self, tokens: List[TokenLogprobs]) -> Optional[dict]:
        if not self.logprobs:
            return None
        return {"content": [{"token": t.text, "logprob": t.logprob, "bytes": _bytes(t.text),
                             "top_logprobs": [{"token": s, "logprob": lp, "bytes": _bytes(s)} for s, lp in t.top]}
                            for t in tokens]}


class CompletionFormat(_Format):
    """``text_completion`` bodies, streamed or not, with the legacy logprobs layout.

    ``text_offset`` counts characters of the completion (the prompt is not echoed), carried
    from chunk to chunk; ``top_logprobs`` maps the most likely tokens' texts to their
    log-probabilities, with the chosen token among them, as OpenAI's legacy API does.
    """

    prefix = "cmpl"
    object_name = chunk_object = "text_completion"

    def __init__(self, model: str, include_usage: bool = False, logprobs: bool = False):
        super().__init__(model, include_usage, logprobs)
        self.offset = 0

    def _delta(self, text: str) -> dict:
        return {"text": text}

    _answer = _delta

    def _logprobs(self, tokens: List[TokenLogprobs]) -> Optional[dict]:
        if not self.logprobs:
            return None
        offsets = []
        for t in tokens:
            offsets.append(self.offset)
            self.offset += len(t.text)
        return {"tokens": [t.text for t in tokens], "token_logprobs": [t.logprob for t in tokens],
                "top_logprobs": [{**dict(t.top), t.text: t.logprob} for t in tokens], "text_offset": offsets}


def models_body(model: str, created: int) -> dict:
    """``v1/models``: the one model this URL serves."""
    return {"object": "list", "data": [model_card(model, created)]}


def model_card(model: str, created: int) -> dict:
    return {"id": model, "object": "model", "created": created, "owned_by": "torchserve"}
