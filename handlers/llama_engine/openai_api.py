"""The OpenAI-compatible API: ``v1/chat/completions``, ``v1/completions`` and ``v1/models``.

TorchServe 0.12 hands the path segments after ``/predictions/<model>/<version>/`` to the
handler as the ``url_path`` request header (``InferenceRequestHandler.handlePredictions``),
so OpenAI clients work with ``base_url=".../predictions/<model>/<version>/v1"``. The version
segment is required: without it the frontend takes ``v1`` for the version and answers 404.

Each request kind is a dataclass validated and normalised in ``__post_init__`` (after vLLM's
``entrypoints/openai/protocol.py``) and mapped onto the engine's own
:class:`GenerationRequest` and :class:`SamplingParams`, so it runs through the same
batching, chat template, stopping and selection as the TGI API. A field this server does not
implement gets a 400 in OpenAI's error schema that names it, never silent neglect: ``n``,
``best_of``, ``echo``, ``frequency_penalty`` and ``presence_penalty`` are accepted at their
no-op values only (1, 1, false, 0, 0), the known unsupported fields (tools,
response_format, logit_bias, ...) only as ``null``, and unknown fields not at all.

``model`` must name the served model (or be left out): another name is a 404
``model_not_found``, as from OpenAI and vLLM, since the URL has already chosen the model.
Unlike the TGI API, the default temperature is OpenAI's 1.0 (sampling); 0 means greedy.
"""
from __future__ import annotations

import json
import math
import time
from abc import ABC, abstractmethod
from dataclasses import dataclass, field, fields
from typing import Any, Dict, List, Optional, Union

from . import request as body_parsing
from .errors import RequestError
from .openai_format import ChatFormat, CompletionFormat, error_body, model_card, models_body
from .params import MAX_LOGPROBS, SamplingParams, check_text
from .request import JSON_BODY, SSE, GenerationRequest

CHAT, COMPLETIONS, MODELS = "v1/chat/completions", "v1/completions", "v1/models"
# When the worker loaded: the ``created`` time of the model card.
LOADED = int(time.time())
# Accepted at these values only (null too): each names the one behaviour this server has.
NO_OP_VALUES = {"n": 1, "best_of": 1, "echo": False, "frequency_penalty": 0, "presence_penalty": 0}
UNSUPPORTED = frozenset({
    "tools", "tool_choice", "parallel_tool_calls", "functions", "function_call", "response_format", "logit_bias",
    "suffix", "audio", "modalities", "prediction", "reasoning_effort", "web_search_options", "service_tier",
    "store", "metadata",
})
# Engine parameter names in errors raised after translation, by route.
RENAMED = {CHAT: {"max_new_tokens": "max_tokens", "inputs": "messages"},
           COMPLETIONS: {"max_new_tokens": "max_tokens", "inputs": "prompt"}}
CHAT_ROLES = {"system": "system", "developer": "system", "user": "user", "assistant": "assistant"}


class OpenAIError(RequestError):
    """A client error that goes out in OpenAI's schema: ``{"error": {message, type, param, code}}``."""

    def __init__(self, message: str, parameter: Optional[str] = None, status: int = 400,
                 code: Optional[str] = None):
        super().__init__(message, parameter, status)
        self.code = code

    def to_dict(self) -> dict:
        return error_body(self.message, self.status, self.parameter, self.code)


def as_openai_error(error: RequestError, path: str) -> OpenAIError:
    """``error`` (from the engine, say) as the OpenAI route ``path`` names things."""
    if isinstance(error, OpenAIError):
        return error
    renamed = RENAMED.get(path.strip("/"), {})
    param = renamed.get(error.parameter, error.parameter)
    message = error.message if param == error.parameter else error.message.replace(error.parameter, param)
    return OpenAIError(message, param, error.status)


@dataclass
class Reply:
    """An answer that needs no generation (``v1/models``)."""

    body: str
    status: int = 200
    content_type: str = "application/json"


def parse_openai(path: str, body: Any, max_bytes: int, served_model: str) -> Union[GenerationRequest, Reply]:
    """The request that ``body``, sent to ``path`` (the ``url_path`` header), stands for.

    ``body`` None means a form-encoded body, which TorchServe has already split into fields.
    """
    route = path.strip("/")
    if route == MODELS or route.startswith(MODELS + "/"):
        return _models(route, served_model)
    kind = REQUEST_KINDS.get(route)
    if kind is None:
        raise OpenAIError(f"unknown path {path!r}; this server has {CHAT}, {COMPLETIONS} and {MODELS}",
                          status=404, code="not_found")
    openai_request = kind.from_body(_json_object(body, max_bytes))
    _check_model(openai_request.model, served_model)
    return openai_request.to_generation(served_model)


def _models(route: str, served_model: str) -> Reply:
    if route == MODELS:
        return Reply(json.dumps(models_body(served_model, LOADED)))
    name = route[len(MODELS) + 1:]
    if name != served_model:
        raise _model_not_found(name, served_model)
    return Reply(json.dumps(model_card(served_model, LOADED)))


def _check_model(model: Optional[str], served_model: str) -> None:
    if model is not None and model != served_model:
        raise _model_not_found(model, served_model)


def _model_not_found(name: str, served_model: str) -> OpenAIError:
    return OpenAIError(f"the model {name!r} does not exist; this URL serves {served_model!r}", "model", 404,
                       "model_not_found")


def _json_object(body: Any, max_bytes: int) -> dict:
    """Decode the body with the TGI API's checks (size, UTF-8, depth); its errors name no field."""
    if body is None:
        raise OpenAIError("the body arrived form-encoded; send it as JSON with -H 'Content-Type: application/json'")
    try:
        if isinstance(body, (bytes, bytearray)):
            body = body_parsing._decode_utf8(bytes(body), max_bytes)
        if isinstance(body, str):
            body_parsing._check_size(len(body.encode("utf-8")), max_bytes)
            if not body.strip():
                raise OpenAIError("empty body; send a JSON object")
            body = body_parsing._load_json(body)
        elif isinstance(body, dict) and body_parsing._nested_deeper_than(body, body_parsing.MAX_JSON_DEPTH):
            raise body_parsing._too_deep()
    except OpenAIError:
        raise
    except RequestError as exc:
        raise OpenAIError(exc.message, None, exc.status) from None
    if not isinstance(body, dict):
        raise OpenAIError(f"the body must be a JSON object, got {type(body).__name__}")
    return body


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _is_number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)


def _is_no_op(value: Any, default: Any) -> bool:
    if value is None:
        return True
    if isinstance(default, bool):
        return value is default
    return _is_number(value) and value == default


def _no_op_error(name: str, value: Any) -> OpenAIError:
    return OpenAIError(f"{name} must be {json_value(NO_OP_VALUES[name])} (or left out): this server does not "
                       f"support other values, got {value!r}", name, code="unsupported_value")


def json_value(value: Any) -> str:
    return "true" if value is True else "false" if value is False else str(value)


@dataclass
class _CommonRequest(ABC):
    """The fields ``v1/chat/completions`` and ``v1/completions`` share; ``params`` is the result."""

    model: Optional[str] = None
    max_tokens: Optional[int] = None
    temperature: Optional[float] = None
    top_p: Optional[float] = None
    stop: Optional[Union[str, List[str]]] = None
    seed: Optional[int] = None
    stream: Optional[bool] = None
    stream_options: Optional[dict] = None
    user: Optional[str] = None  # accepted for tracking, as OpenAI does; unused
    top_k: Optional[int] = None  # vLLM's extra sampling parameters
    repetition_penalty: Optional[float] = None
    params: SamplingParams = field(init=False, repr=False)
    include_usage: bool = field(init=False, default=False)

    @classmethod
    def from_body(cls, data: Dict[str, Any]) -> "_CommonRequest":
        known = {f.name for f in fields(cls) if f.init}
        for key, value in data.items():
            if key in NO_OP_VALUES:
                if not _is_no_op(value, NO_OP_VALUES[key]):
                    raise _no_op_error(key, value)
            elif key in UNSUPPORTED:
                if value is not None:
                    raise OpenAIError(f"{key} is not supported by this server", key, code="unsupported_parameter")
            elif key not in known:
                raise OpenAIError(f"unknown field {key!r}", key, code="unsupported_parameter")
        return cls(**{k: v for k, v in data.items() if k in known})

    def __post_init__(self):
        self._check_common()
        self.include_usage = self._include_usage()
        try:
            self.params = SamplingParams(
                max_new_tokens=self.max_tokens, do_sample=True,
                temperature=1.0 if self.temperature is None else self.temperature,
                top_p=1.0 if self.top_p is None else self.top_p, top_k=self.top_k or 0,
                repetition_penalty=1.0 if self.repetition_penalty is None else self.repetition_penalty,
                stop=self.stop, seed=self.seed, logprobs=self._top_logprobs())
        except OpenAIError:
            raise
        except RequestError as exc:
            raise OpenAIError(exc.message, exc.parameter, exc.status) from None

    def _check_common(self) -> None:
        if self.model is not None and not isinstance(self.model, str):
            raise OpenAIError(f"model must be a string, got {self.model!r}", "model")
        if self.max_tokens is not None and (not _is_int(self.max_tokens) or self.max_tokens < 1):
            raise OpenAIError(f"max_tokens must be an integer >= 1, got {self.max_tokens!r}", "max_tokens")
        if self.temperature is not None and (not _is_number(self.temperature) or not 0 <= self.temperature <= 2):
            raise OpenAIError(f"temperature must be a number in [0, 2], got {self.temperature!r}", "temperature")
        if self.stream is not None and not isinstance(self.stream, bool):
            raise OpenAIError(f"stream must be true or false, got {self.stream!r}", "stream")
        if self.user is not None and not isinstance(self.user, str):
            raise OpenAIError(f"user must be a string, got {self.user!r}", "user")

    def _include_usage(self) -> bool:
        options = self.stream_options
        if options is None:
            return False
        if not self.stream:
            raise OpenAIError("stream_options is only allowed when stream is true", "stream_options")
        if not isinstance(options, dict) or set(options) - {"include_usage"}:
            raise OpenAIError(f"stream_options accepts only include_usage, got {options!r}", "stream_options")
        include = options.get("include_usage")
        if include is not None and not isinstance(include, bool):
            raise OpenAIError(f"stream_options.include_usage must be true or false, got {include!r}",
                              "stream_options")
        return bool(include)

    @abstractmethod
    def _top_logprobs(self) -> Optional[int]:
        """Alternatives to report per token (None: no logprobs), from this API's own fields."""

    @property
    def output(self) -> str:
        return SSE if self.stream else JSON_BODY


def _check_logprobs_count(value: Any, name: str) -> None:
    if not _is_int(value) or not 0 <= value <= MAX_LOGPROBS:
        raise OpenAIError(f"{name} must be an integer in [0, {MAX_LOGPROBS}], got {value!r}", name)


@dataclass
class ChatCompletionRequest(_CommonRequest):
    """``v1/chat/completions``: messages rendered with the tokenizer's chat template (or Llama-2's)."""

    messages: Any = None
    max_completion_tokens: Optional[int] = None
    logprobs: Optional[bool] = None
    top_logprobs: Optional[int] = None

    def __post_init__(self):
        self.max_tokens = self._max_tokens()
        self.messages = _chat_messages(self.messages)
        super().__post_init__()

    def _max_tokens(self) -> Optional[int]:
        """``max_completion_tokens`` is OpenAI's newer name for ``max_tokens``; both must agree."""
        newer, older = self.max_completion_tokens, self.max_tokens
        if newer is None:
            return older
        if not _is_int(newer) or newer < 1:
            raise OpenAIError(f"max_completion_tokens must be an integer >= 1, got {newer!r}",
                              "max_completion_tokens")
        if older is not None and older != newer:
            raise OpenAIError("max_tokens and max_completion_tokens disagree; send one of them",
                              "max_completion_tokens")
        return newer

    def _top_logprobs(self) -> Optional[int]:
        if self.logprobs is not None and not isinstance(self.logprobs, bool):
            raise OpenAIError(f"logprobs must be true or false, got {self.logprobs!r}", "logprobs")
        if self.top_logprobs is not None:
            _check_logprobs_count(self.top_logprobs, "top_logprobs")
            if not self.logprobs:
                raise OpenAIError("top_logprobs needs logprobs: true", "top_logprobs")
        return (self.top_logprobs or 0) if self.logprobs else None

    def to_generation(self, served_model: str) -> GenerationRequest:
        api = ChatFormat(served_model, self.include_usage, logprobs=bool(self.logprobs))
        return GenerationRequest(params=self.params, output=self.output, messages=self.messages, api=api)


def _chat_messages(messages: Any) -> List[dict]:
    """OpenAI messages as the engine's ``{"role", "content"}`` list, checked as the TGI chat body is."""
    if not isinstance(messages, list) or not messages:
        raise OpenAIError("messages must be a non-empty list of {\"role\", \"content\"} objects", "messages")
    try:
        return body_parsing._check_messages([_chat_message(i, m) for i, m in enumerate(messages)])
    except OpenAIError:
        raise
    except RequestError as exc:
        raise OpenAIError(exc.message, "messages") from None


def _chat_message(i: int, message: Any) -> dict:
    if not isinstance(message, dict):
        raise OpenAIError(f"messages[{i}] must be an object", "messages")
    extra = set(message) - {"role", "content"}
    if extra:
        raise OpenAIError(f"messages[{i}]: {', '.join(sorted(extra))} not supported (only role and content)",
                          "messages", code="unsupported_parameter")
    role = CHAT_ROLES.get(message.get("role")) if isinstance(message.get("role"), str) else None
    if role is None:
        raise OpenAIError(f"messages[{i}].role must be one of {', '.join(CHAT_ROLES)}, got {message.get('role')!r}",
                          "messages")
    return {"role": role, "content": _content(i, message.get("content"))}


def _content(i: int, content: Any) -> str:
    """A string, or a list of text parts (joined); image, audio and file parts are refused."""
    if isinstance(content, str):
        return check_text(content, "messages")
    if isinstance(content, list) and content:
        texts = []
        for part in content:
            if not isinstance(part, dict) or part.get("type") != "text" or not isinstance(part.get("text"), str):
                raise OpenAIError(f"messages[{i}].content: only text parts are supported, got {part!r}"[:300],
                                  "messages")
            texts.append(check_text(part["text"], "messages"))
        return "".join(texts)
    raise OpenAIError(f"messages[{i}].content must be a string or a list of text parts", "messages")


@dataclass
class CompletionRequest(_CommonRequest):
    """``v1/completions``: a plain prompt, continued."""

    prompt: Any = None
    logprobs: Optional[int] = None

    def __post_init__(self):
        self.prompt = _prompt(self.prompt)
        super().__post_init__()

    def _top_logprobs(self) -> Optional[int]:
        if self.logprobs is not None:
            _check_logprobs_count(self.logprobs, "logprobs")
        return self.logprobs

    def to_generation(self, served_model: str) -> GenerationRequest:
        api = CompletionFormat(served_model, self.include_usage, logprobs=self.logprobs is not None)
        return GenerationRequest(prompt=self.prompt, params=self.params, output=self.output, api=api)


def _prompt(prompt: Any) -> str:
    """One prompt: a string, or a list holding one string (lists of several and token ids are refused)."""
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], str):
        prompt = prompt[0]
    if not isinstance(prompt, str):
        raise OpenAIError("prompt must be a string (one prompt per request; token ids are not accepted)", "prompt")
    if not prompt.strip():
        raise OpenAIError("prompt must not be empty", "prompt")
    try:
        return check_text(prompt, "prompt")
    except RequestError as exc:
        raise OpenAIError(exc.message, "prompt") from None


REQUEST_KINDS = {CHAT: ChatCompletionRequest, COMPLETIONS: CompletionRequest}
