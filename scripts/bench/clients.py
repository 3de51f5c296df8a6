"""The bench's peers' protocols, as adapters of the shared streaming client (``scripts/streaming_client.py``).

Every request is timed the same way whatever the server (see that module, which also holds
:class:`~scripts.streaming_client.TorchServeAdapter` for this project's handler, NDJSON):

* :class:`LlamaServerAdapter`: llama.cpp's ``llama-server`` ``POST /completion`` with
  ``stream: true``: SSE ``data: {"content", "stop", ...}`` events, the last with
  ``stop: true`` and ``tokens_predicted``; ``n_predict`` and ``ignore_eos: true``. Tokens are
  counted by each event's running ``tokens_predicted``: a token whose text ends mid-UTF-8
  gets no event of its own and arrives with the next.
* :class:`OpenAICompletionsAdapter`: vLLM's OpenAI server, ``POST /v1/completions`` with
  ``stream: true``: SSE ``data: {"choices": [{"text"}]}`` chunks, a usage chunk
  (``stream_options.include_usage``) and ``data: [DONE]``; ``max_tokens`` and ``ignore_eos``;
  ``return_token_ids`` makes each chunk name its tokens (``token_ids``), which are counted.

Peers get the prompt as token ids (both servers accept a list of ints), so every system
sees exactly the same number of prompt tokens; TorchServe gets the text, which its tokenizer
turns into the same ids.
"""
from __future__ import annotations

import json

from scripts.streaming_client import Adapter, sse_data


class LlamaServerAdapter(Adapter):
    name = "llama.cpp"

    def __init__(self, base_url: str):
        self.url = f"{base_url}/completion"

    def request(self, prompt, max_new_tokens):
        body = {"prompt": prompt.ids, "n_predict": max_new_tokens, "stream": True, "ignore_eos": True,
                "cache_prompt": False, "top_k": 1, "temperature": 0.0}
        return self.url, {}, body

    # llama-server's stop_type -> the finish reasons the other systems report
    FINISH = {"limit": "length", "eos": "stop", "word": "stop"}

    def parse(self, line, record, now):
        payload = sse_data(line)
        if not payload:
            return False
        message = json.loads(payload)
        if not isinstance(message, dict):
            return False
        if "error" in message:
            record.error = json.dumps(message["error"])[:300]
            return True
        if "prompt_progress" not in message:
            # Every event says how many tokens the server has generated so far
            # ("tokens_predicted"). A token whose text ends inside a UTF-8 sequence gets no event
            # of its own: it arrives with the next one (whose "tokens" names only that next id),
            # and tokens still incomplete at the end arrive with the final event (which repeats
            # no text). Each token is timed when the event that brings it arrives.
            predicted = message.get("tokens_predicted")
            if isinstance(predicted, int):
                n = max(0, predicted - len(record.token_times))
            else:
                tokens = message.get("tokens")
                n = len(tokens) if isinstance(tokens, list) else int(bool(message.get("content")))
            record.token_times.extend([now] * n)
        if message.get("stop"):
            record.reported_tokens = message.get("tokens_predicted")
            stop_type = message.get("stop_type") or ("limit" if message.get("stopped_limit") else None)
            record.finish_reason = self.FINISH.get(stop_type, stop_type)
            return True
        return False


class OpenAICompletionsAdapter(Adapter):
    name = "vllm"

    def __init__(self, base_url: str, model: str):
        self.url = f"{base_url}/v1/completions"
        self.model = model

    def request(self, prompt, max_new_tokens):
        body = {"model": self.model, "prompt": prompt.ids, "max_tokens": max_new_tokens, "stream": True,
                "ignore_eos": True, "temperature": 0.0, "stream_options": {"include_usage": True},
                "return_token_ids": True}
        return self.url, {}, body

    def parse(self, line, record, now):
        payload = sse_data(line)
        if not payload:
            return False
        if payload == b"[DONE]":
            return True
        message = json.loads(payload)
        if "error" in message or message.get("object") == "error":
            record.error = json.dumps(message.get("error", message))[:300]
            return True
        for choice in message.get("choices") or []:
            ids = choice.get("token_ids")
            if isinstance(ids, list):  # vLLM with return_token_ids: the chunk's own tokens
                record.token_times.extend([now] * len(ids))
            elif "text" in choice:
                record.token_times.append(now)
            if choice.get("finish_reason"):
                record.finish_reason = choice["finish_reason"]
        usage = message.get("usage")
        if usage and usage.get("completion_tokens") is not None:
            record.reported_tokens = usage["completion_tokens"]
        return False
