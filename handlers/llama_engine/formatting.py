"""Response bodies in the three forms a request can ask for.

* NDJSON (the default stream): one JSON object per line. Every token has its own line,
  ``{"token": {"id", "text", "logprob", "special"}}``; the last line adds ``generated_text``
  and ``details`` (finish_reason, generated_tokens, input_length, seed), so a client can
  split the body on ``\\n`` however the HTTP chunks fall.
* Server-Sent Events in TGI's ``generate_stream`` schema, for ``"stream": true`` or
  ``Accept: text/event-stream``: ``data: {"index", "token", "generated_text", "details",
  "top_tokens"}\\n\\n``, with ``generated_text`` on the last event and ``details`` there
  only when the request asked for them. ``huggingface_hub.InferenceClient`` parses it.
* One JSON document for ``"stream": false``: ``[{"generated_text": ..., "details": ...}]``.

A request that came in through the OpenAI-compatible API carries its own formatter
(``request.api``, see ``openai_format.py``), which these functions hand over to.
"""
from __future__ import annotations

import json

from .errors import RequestError
from .request import JSON_BODY, NDJSON, SSE, GenerationRequest
from .streamer import GenerationResult, TokenEvent

CONTENT_TYPES = {NDJSON: "application/x-ndjson", SSE: "text/event-stream", JSON_BODY: "application/json"}
JSON = CONTENT_TYPES[JSON_BODY]


def _dumps(obj) -> str:
    return json.dumps(obj, ensure_ascii=False)


def token_dict(event: TokenEvent) -> dict:
    return {"id": event.token_id, "text": event.text, "logprob": event.logprob, "special": event.special}


def generated_text(request: GenerationRequest, result: GenerationResult) -> str:
    return request.prompt + result.text if request.params.return_full_text else result.text


def stream_details(result: GenerationResult) -> dict:
    return {"finish_reason": result.finish_reason, "generated_tokens": result.generated_tokens,
            "input_length": result.prompt_tokens, "seed": result.seed}


def ndjson_line(request: GenerationRequest, event: TokenEvent) -> str:
    line = {"token": token_dict(event)}
    if event.result is not None:
        line["generated_text"] = generated_text(request, event.result)
        line["details"] = stream_details(event.result)
    return _dumps(line) + "\n"


def sse_event(request: GenerationRequest, event: TokenEvent) -> str:
    done = event.result is not None
    payload = {
        "index": event.index,
        "token": token_dict(event),
        "generated_text": generated_text(request, event.result) if done else None,
        "details": stream_details(event.result) if done and request.params.details else None,
        "top_tokens": None,
    }
    return f"data: {_dumps(payload)}\n\n"


def stream_chunk(request: GenerationRequest, event: TokenEvent) -> str:
    if request.api is not None:
        return request.api.stream_chunk(event)
    return sse_event(request, event) if request.output == SSE else ndjson_line(request, event)


def full_response(request: GenerationRequest, result: GenerationResult) -> str:
    if request.api is not None:
        return request.api.full_response(result)
    answer = {"generated_text": generated_text(request, result)}
    if request.params.details:
        answer["details"] = {
            "finish_reason": result.finish_reason,
            "generated_tokens": result.generated_tokens,
            "seed": result.seed,
            "prefill": [],
            "tokens": [{"id": i, "text": t, "logprob": lp, "special": sp} for i, t, lp, sp in
                       zip(result.token_ids, result.token_texts, result.logprobs, result.special)],
        }
    return _dumps([answer])


def stream_error(request: GenerationRequest, error: RequestError) -> str:
    """A failure after the stream started: the last NDJSON line, or a TGI error event."""
    if request.api is not None:
        return request.api.stream_error(error)
    if request.output == SSE:
        return f"data: {_dumps({'error': error.message, 'error_type': error.to_dict()['error_type']})}\n\n"
    return error.to_json() + "\n"
