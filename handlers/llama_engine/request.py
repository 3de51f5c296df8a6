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
``[``) is taken as plain text, because the SageMaker examples send plain prompts that way;
a whole body that is one JSON string (``"..."``) is that string. A body that starts like JSON
but does not parse is a 400, and so is JSON nested deeper than :data:`MAX_JSON_DEPTH`: it is
refused before it is decoded, so no body can reach Python's recursion limit.

Bodies arrive as the client's bytes (the handler turns TorchServe's own decoding off), so
the size limit counts the bytes that were sent. Objects that a caller has already decoded
are accepted too, checked for depth without recursion before anything else touches them.
"""
from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any, List, Optional, Union

from .errors import RequestError
from .params import SamplingParams, check_text

NDJSON, SSE, JSON_BODY = "ndjson", "sse", "json"
JSON_KEYS = ("inputs", "messages", "parameters", "stream")
ROLES = ("system", "user", "assistant")
# The deepest valid body is 3 levels ({"messages": [{...}]}, {"parameters": {"stop": [...]}}).
MAX_JSON_DEPTH = 32
Body = Union[bytes, bytearray, str, dict, list, None]


@dataclass
class GenerationRequest:
    prompt: str = ""
    params: SamplingParams = field(default_factory=SamplingParams)
    output: str = NDJSON
    messages: Optional[List[dict]] = None
    # The OpenAI-compatible request this one was translated from (openai_api.py); it formats the responses.
    api: Optional[Any] = None

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
        return _parse_text(body, content_type)
    if isinstance(body, (dict, list)):  # decoded before it reached us: bound its depth before anything recurses
        if _nested_deeper_than(body, MAX_JSON_DEPTH):
            raise _too_deep()
        encoded = json.dumps(body, ensure_ascii=False, separators=(",", ":"))
        _check_size(len(encoded.encode("utf-8", "surrogatepass")), max_bytes)
    return _parse_value(body)


def _parse_value(body) -> GenerationRequest:
    if isinstance(body, dict):
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
        return _parse_value(_load_json(text))
    if _is_json_type(content_type) and stripped[:1] == '"':
        text = _json_string(text)
    if not text.strip():
        raise RequestError("empty prompt; send the prompt as the request body", "inputs")
    return GenerationRequest(prompt=check_text(text, "inputs"))


def _load_json(text: str):
    """Decode a JSON body; every way it can fail is a 400 (never a RecursionError or a 500)."""
    if _text_nested_deeper_than(text, MAX_JSON_DEPTH):
        raise _too_deep()
    try:
        return json.loads(text)
    except json.JSONDecodeError as exc:
        raise RequestError(f"invalid JSON body: {exc.msg} at line {exc.lineno} column {exc.colno}",
                           "inputs") from None
    except (ValueError, RecursionError) as exc:  # an integer over Python's 4300 digits, say
        raise RequestError(f"invalid JSON body: {exc}", "inputs") from None


def _json_string(text: str) -> str:
    """The prompt a whole-body JSON string stands for; text that is not one stays as it is."""
    try:
        value = json.loads(text)
    except ValueError:
        return text
    return value if isinstance(value, str) else text


def _too_deep() -> RequestError:
    return RequestError(f"the JSON body is nested deeper than {MAX_JSON_DEPTH} levels", "inputs")


def _text_nested_deeper_than(text: str, limit: int) -> bool:
    """Whether JSON text opens more than ``limit`` arrays/objects at once (strings skipped), in one pass."""
    if text.count("[") + text.count("{") <= limit:
        return False
    depth, in_string, escaped = 0, False, False
    for ch in text:
        if in_string:
            if escaped:
                escaped = False
            elif ch == "\\":
                escaped = True
            elif ch == '"':
                in_string = False
        elif ch == '"':
            in_string = True
        elif ch == "[" or ch == "{":
            depth += 1
            if depth > limit:
                return True
        elif ch == "]" or ch == "}":
            depth -= 1
    return False


def _nested_deeper_than(value, limit: int) -> bool:
    """The same for an already decoded value, without recursion."""
    stack = [(value, 1)]
    while stack:
        item, depth = stack.pop()
        if isinstance(item, (dict, list)):
            if depth > limit:
                return True
            stack.extend((child, depth + 1) for child in (item.values() if isinstance(item, dict) else item))
    return False


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
    check_text(prompt, "inputs")
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
        check_text(message["content"], "messages")
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
