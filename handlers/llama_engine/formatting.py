"""Response bodies: NDJSON lines for streams, one JSON document otherwise.

A stream is one JSON object per line. Every generated token has its own line; the last line
also carries ``generated_text`` and ``details``, so a client can split the body on ``\\n``
however the HTTP chunks fall.
"""
from __future__ import annotations

import json

from .errors import RequestError
from .streamer import GenerationResult, TokenEvent

NDJSON = "application/x-ndjson"
JSON = "application/json"


def details(result: GenerationResult) -> dict:
    return {
        "finish_reason": result.finish_reason,
        "generated_tokens": result.generated_tokens,
        "prompt_tokens": result.prompt_tokens,
    }


def stream_line(event: TokenEvent) -> str:
    line = {}
    if event.token_id is not None:
        line["token"] = {"id": event.token_id, "text": event.text, "special": event.special}
    elif event.text:
        line["token"] = {"id": None, "text": event.text, "special": False}
    if event.result is not None:
        line["generated_text"] = event.result.text
        line["details"] = details(event.result)
    return json.dumps(line, ensure_ascii=False) + "\n"


def error_line(error: RequestError) -> str:
    return error.to_json() + "\n"


def full_response(result: GenerationResult) -> str:
    return json.dumps([{"generated_text": result.text, "details": details(result)}], ensure_ascii=False)
