"""Turn a raw request body into a :class:`GenerationRequest`, or a :class:`RequestError`.

Accepted bodies:

* plain text: the whole body is the prompt;
* TGI/LMI JSON ``{"inputs": str, "parameters": {...}, "stream": bool}``;
* chat JSON ``{"messages": [{"role": ..., "content": ...}, ...], "parameters": {...}, "stream": bool}``,
  rendered with the tokenizer's chat template (or the Llama-2 template) by the engine.

The response format follows the request: NDJSON by default, Server-Sent Events in TGI's
schema for ``"stream": true`` or ``Accept: text/event-stream``, one JSON document for
``"stream": false``. huggingface_hub's client sends no ``"stream"`` key when it wants one
JSON document (TGI's default), so a request with its User-Agent and no key gets that.

A body sent as ``application/json`` that is not JSON at all (it does not start with ``{`` or
``[``) is taken as plain text, because the SageMaker examples send plain prompts that way.
A body that starts like JSON but does not parse is a 400.
"""
from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import List, Optional, Union

from .errors import RequestError
from .params import SamplingParams

NDJSON, SSE, JSON_BODY = "ndjson", "sse", "json"
JSON_KEYS = ("inputs", "messages", "parameters", "stream")
ROLES = ("system", "user", "assistant")
Body = Union[bytes, bytearray, str, dict, list, None]


@dataclass
class GenerationRequest:
    prompt: str = ""
    params: SamplingParams = field(default_factory=SamplingParams)
    output: str = NDJSON
    messages: Optional[List[dict]] = None

    @property
    def stream(self) -> bool:
        return self.output != JSON_BODY


# TGI's clients expect TGI's default, a single JSON document, when they send no "stream" key.
TGI_CLIENT_AGENTS = ("hf_hub/",)


def parse_request(body: Body, content_type: Optional[str] = None, max_bytes: int = 65536,
                  accept: Optional[str] = None, user_agent: Optional[str] = None) -> GenerationRequest:
    request = _parse_body(body, content_type, max_bytes)
    if request.output is None:
        tgi_client = bool(user_agent) and any(agent in user_agent for agent in TGI_CLIENT_AGENTS)
        request.output = JSON_BODY if tgi_client else NDJSON
    if request.output == NDJSON and accept and "text/event-stream" in accept.lower():
        request.output = SSE
    return request


def _parse_body(body: Body, content_type: Optional[str], max_bytes: int) -> GenerationRequest:
    if isinstance(body, (bytes, bytearray)):
        body = _decode_utf8(bytes(body), max_bytes)
    if isinstance(body, str):
        _check_size(len(body.encode("utf-8")), max_bytes)
        return _parse_text(body, content_type, max_bytes)
    if isinstance(body, dict):
        _check_size(len(json.dumps(body).encode("utf-8")), max_bytes)
        return _parse_json_object(body)
    if isinstance(body, list):
        raise RequestError("a JSON array is not accepted; send one JSON object per request", "inputs")
    if body is None:
        raise RequestError("empty request body; send the prompt as text or as JSON {\"inputs\": ...}", "inputs")
    raise RequestError(f"unsupported request body of type {type(body).__name__}", "inputs")


def _check_size(n_bytes: int, max_bytes: int) -> None:
    if n_bytes > max_bytes:
        raise RequestError(f"request body is {n_bytes} bytes, over the limit of {max_bytes}",
                           "inputs", status=413)


def _decode_utf8(raw: bytes, max_bytes: int) -> str:
    _check_size(len(raw), max_bytes)
    try:
        return raw.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise RequestError(f"request body is not valid UTF-8 (byte {exc.start})", "inputs") from None


def _is_json_type(content_type: Optional[str]) -> bool:
    return bool(content_type) and "json" in content_type.split(";")[0].lower()


def _parse_text(text: str, content_type: Optional[str], max_bytes: int) -> GenerationRequest:
    stripped = text.lstrip()
    if _is_json_type(content_type) and stripped[:1] in ("{", "["):
        try:
            data = json.loads(text)
        except json.JSONDecodeError as exc:
            raise RequestError(f"invalid JSON body: {exc.msg} at line {exc.lineno} column {exc.colno}",
                               "inputs") from None
        return _parse_body(data, content_type, max_bytes)
    if not text.strip():
        raise RequestError("empty prompt; send the prompt as the request body", "inputs")
    return GenerationRequest(prompt=text)


def _parse_json_object(data: dict) -> GenerationRequest:
    for key in data:
        if key not in JSON_KEYS:
            raise RequestError(f"unknown field {key!r}; accepted: {', '.join(JSON_KEYS)}", key)
    stream = data.get("stream")
    if stream is not None and not isinstance(stream, bool):
        raise RequestError(f"stream must be true or false, got {stream!r}", "stream")
    output = None if stream is None else SSE if stream else JSON_BODY
    params = SamplingParams.from_dict(data.get("parameters"))
    if "messages" in data:
        if "inputs" in data:
            raise RequestError("send either inputs or messages, not both", "messages")
        return GenerationRequest(params=params, output=output, messages=_check_messages(data["messages"]))
    prompt = data.get("inputs")
    if not isinstance(prompt, str):
        raise RequestError(f"inputs must be a string, got {type(prompt).__name__}", "inputs")
    if not prompt.strip():
        raise RequestError("inputs must not be empty", "inputs")
    return GenerationRequest(prompt=prompt, params=params, output=output)


def _check_messages(messages) -> List[dict]:
    if not isinstance(messages, list) or not messages:
        raise RequestError("messages must be a non-empty list of {\"role\", \"content\"} objects", "messages")
    for i, message in enumerate(messages):
        if not isinstance(message, dict) or set(message) != {"role", "content"}:
            raise RequestError(f"messages[{i}] must be an object with exactly role and content", "messages")
        if message["role"] not in ROLES:
            raise RequestError(f"messages[{i}].role must be one of {', '.join(ROLES)}, got {message['role']!r}",
                               "messages")
        if not isinstance(message["content"], str):
            raise RequestError(f"messages[{i}].content must be a string", "messages")
        if message["role"] == "system" and i != 0:
            raise RequestError(f"messages[{i}]: a system message may only come first", "messages")
    turns = [m["role"] for m in messages if m["role"] != "system"]
    if not turns or turns[-1] != "user":
        raise RequestError("the last message must come from the user", "messages")
    if any(role != ("user" if i % 2 == 0 else "assistant") for i, role in enumerate(turns)):
        raise RequestError("after an optional system message, roles must alternate user/assistant", "messages")
    return messages


def describe_form_error() -> RequestError:
    """The error for a form-encoded body, which TorchServe has already split into fields."""
    return RequestError(
        "the body arrived form-encoded (curl -d without a Content-Type sends "
        "application/x-www-form-urlencoded) and the prompt cannot be recovered from it; "
        "send -H 'Content-Type: text/plain' for a plain prompt, or -H 'Content-Type: application/json' "
        "with {\"inputs\": ...}", "Content-Type")
