"""Turn a raw request body into a :class:`GenerationRequest`, or a :class:`RequestError`.

Accepted bodies:

* plain text: the whole body is the prompt;
* JSON ``{"inputs": str, "parameters": {...}, "stream": bool}``.

A body sent as ``application/json`` that is not JSON at all (it does not start with ``{`` or
``[``) is taken as plain text, because the SageMaker examples send plain prompts that way.
A body that starts like JSON but does not parse is a 400.
"""
from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Optional, Union

from .errors import RequestError
from .params import SamplingParams

JSON_KEYS = ("inputs", "parameters", "stream")
Body = Union[bytes, bytearray, str, dict, list, None]


@dataclass
class GenerationRequest:
    prompt: str
    params: SamplingParams = field(default_factory=SamplingParams)
    stream: bool = True


def parse_request(body: Body, content_type: Optional[str] = None,
                  max_bytes: int = 65536) -> GenerationRequest:
    if isinstance(body, (bytes, bytearray)):
        body = _decode_utf8(bytes(body), max_bytes)
    if isinstance(body, str):
        _check_size(len(body.encode("utf-8")), max_bytes)
        return _parse_text(body, content_type)
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


def _parse_text(text: str, content_type: Optional[str]) -> GenerationRequest:
    stripped = text.lstrip()
    if _is_json_type(content_type) and stripped[:1] in ("{", "["):
        try:
            data = json.loads(text)
        except json.JSONDecodeError as exc:
            raise RequestError(f"invalid JSON body: {exc.msg} at line {exc.lineno} column {exc.colno}",
                               "inputs") from None
        return parse_request(data, content_type)
    if not text.strip():
        raise RequestError("empty prompt; send the prompt as the request body", "inputs")
    return GenerationRequest(prompt=text)


def _parse_json_object(data: dict) -> GenerationRequest:
    for key in data:
        if key not in JSON_KEYS:
            raise RequestError(f"unknown field {key!r}; accepted: {', '.join(JSON_KEYS)}", key)
    prompt = data.get("inputs")
    if not isinstance(prompt, str):
        raise RequestError(f"inputs must be a string, got {type(prompt).__name__}", "inputs")
    if not prompt.strip():
        raise RequestError("inputs must not be empty", "inputs")
    stream = data.get("stream", True)
    if not isinstance(stream, bool):
        raise RequestError(f"stream must be true or false, got {stream!r}", "stream")
    params = SamplingParams.from_dict(data.get("parameters"))
    return GenerationRequest(prompt=prompt, params=params, stream=stream)


def describe_form_error() -> RequestError:
    """The error for a form-encoded body, which TorchServe has already split into fields."""
    return RequestError(
        "the body arrived form-encoded (curl -d without a Content-Type sends "
        "application/x-www-form-urlencoded) and the prompt cannot be recovered from it; "
        "send -H 'Content-Type: text/plain' for a plain prompt, or -H 'Content-Type: application/json' "
        "with {\"inputs\": ...}", "Content-Type")
