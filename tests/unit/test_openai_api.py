"""The OpenAI-compatible API in-process: request translation, rejections, and response bodies."""
from __future__ import annotations

import json

import pytest
import torch

from llama_engine import Engine, RequestError, SamplingParams, parse_request
from llama_engine.config import HandlerConfig
from llama_engine.formatting import full_response, stream_chunk, stream_error
from llama_engine.openai_api import OpenAIError, Reply, as_openai_error, parse_openai
from llama_engine.request import JSON_BODY, SSE

MODEL = "tiny"
USER = [{"role": "user", "content": "What does a function return?"}]


def chat(**body):
    return parse_openai("v1/chat/completions", json.dumps({"model": MODEL, "messages": USER, **body}), 65536, MODEL)


def completion(**body):
    return parse_openai("v1/completions", json.dumps({"model": MODEL, "prompt": "The function returns", **body}),
                        65536, MODEL)


def rejected(call, **body) -> dict:
    """The OpenAI error body ``call(**body)`` raises."""
    with pytest.raises(OpenAIError) as info:
        call(**body)
    return {"status": info.value.status, **json.loads(info.value.to_json())["error"]}


@pytest.fixture(scope="module")
def engine(tiny_model_dir):
    torch.set_num_threads(2)
    return Engine.from_config(HandlerConfig(model_path=tiny_model_dir.name, max_length=256, max_new_tokens=16),
                              str(tiny_model_dir.parent))


def run(engine, request):
    """Generate ``request``; return (its stream's SSE text, its result)."""
    chunks = []
    result = engine.generate([engine.prepare(request)], lambda events: chunks.extend(
        stream_chunk(request, e) for e in events))[0]
    return "".join(chunks), result


def sse_data(text: str) -> list:
    events = [block[len("data: "):] for block in text.split("\n\n") if block]
    assert events[-1] == "[DONE]" and "[DONE]" not in events[:-1]
    return [json.loads(e) for e in events[:-1]]


# -- translation -----------------------------------------------------------------------------

def test_chat_fields_map_onto_sampling_params():
    request = chat(max_completion_tokens=7, temperature=0.5, top_p=0.9, seed=3, stop="\n", logprobs=True,
                   top_logprobs=2, stream=True, stream_options={"include_usage": True}, user="u1")
    p = request.params
    assert (p.max_new_tokens, p.do_sample, p.temperature, p.top_p, p.seed, p.stop, p.logprobs) == \
        (7, True, 0.5, 0.9, 3, ["\n"], 2)
    assert request.messages == USER and request.output == SSE and request.api.include_usage


def test_openai_defaults_sample_at_temperature_1_and_0_means_greedy():
    assert chat().params.do_sample and chat().params.temperature == 1.0
    assert not chat(temperature=0).params.do_sample
    assert chat().output == JSON_BODY and chat().params.logprobs is None


def test_completion_prompt_max_tokens_and_logprobs():
    request = completion(max_tokens=5, logprobs=0, stop=["a", "b"])
    assert request.prompt == "The function returns" and request.messages is None
    assert (request.params.max_new_tokens, request.params.logprobs, request.params.stop) == (5, 0, ["a", "b"])
    assert completion(prompt=["one prompt"]).prompt == "one prompt"


def test_no_op_values_and_null_unsupported_fields_are_accepted():
    request = chat(n=1, frequency_penalty=0, presence_penalty=0.0, tools=None, response_format=None)
    assert request.params.max_new_tokens is None
    assert completion(echo=False, best_of=1, logit_bias=None, model=None).prompt


def test_developer_role_and_text_parts_become_a_plain_chat():
    request = chat(messages=[{"role": "developer", "content": "Be brief."},
                             {"role": "user", "content": [{"type": "text", "text": "Hi "}, {"type": "text",
                                                                                            "text": "there"}]}])
    assert request.messages == [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi there"}]


@pytest.mark.parametrize("call,body,param", [
    (chat, {"n": 2}, "n"),
    (chat, {"tools": [{"type": "function", "function": {"name": "f"}}]}, "tools"),
    (chat, {"tool_choice": "auto"}, "tool_choice"),
    (chat, {"response_format": {"type": "json_object"}}, "response_format"),
    (chat, {"logit_bias": {"5": 10}}, "logit_bias"),
    (chat, {"functions": [{"name": "f"}]}, "functions"),
    (chat, {"frequency_penalty": 0.5}, "frequency_penalty"),
    (chat, {"some_new_field": None}, "some_new_field"),
    (completion, {"best_of": 3}, "best_of"),
    (completion, {"echo": True}, "echo"),
    (completion, {"suffix": "x"}, "suffix"),
])
def test_unsupported_fields_are_rejected_by_name(call, body, param):
    error = rejected(call, **body)
    assert error["status"] == 400 and error["param"] == param and error["type"] == "invalid_request_error"
    assert param in error["message"]


@pytest.mark.parametrize("call,body,param", [
    (chat, {"temperature": 2.5}, "temperature"),
    (chat, {"temperature": "hot"}, "temperature"),
    (chat, {"top_p": 0}, "top_p"),
    (chat, {"max_tokens": 0}, "max_tokens"),
    (chat, {"max_completion_tokens": 1.5}, "max_completion_tokens"),
    (chat, {"max_tokens": 4, "max_completion_tokens": 5}, "max_completion_tokens"),
    (chat, {"seed": -1}, "seed"),
    (chat, {"stop": ["x"] * 9}, "stop"),
    (chat, {"stream": "yes"}, "stream"),
    (chat, {"stream_options": {"include_usage": True}}, "stream_options"),
    (chat, {"stream": True, "stream_options": {"continuous_usage_stats": True}}, "stream_options"),
    (chat, {"logprobs": 1}, "logprobs"),
    (chat, {"top_logprobs": 2}, "top_logprobs"),
    (chat, {"logprobs": True, "top_logprobs": 21}, "top_logprobs"),
    (chat, {"messages": []}, "messages"),
    (chat, {"messages": [{"role": "tool", "content": "x"}]}, "messages"),
    (chat, {"messages": [{"role": "user", "content": "x", "name": "bob"}]}, "messages"),
    (chat, {"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}]},
     "messages"),
    (chat, {"messages": [{"role": "user", "content": "\ud800"}]}, "messages"),
    (chat, {"model": 3}, "model"),
    (completion, {"prompt": ["a", "b"]}, "prompt"),
    (completion, {"prompt": [1, 2, 3]}, "prompt"),
    (completion, {"prompt": " "}, "prompt"),
    (completion, {"logprobs": True}, "logprobs"),
    (completion, {"logprobs": 21}, "logprobs"),
])
def test_bad_values_are_a_400_naming_the_param(call, body, param):
    error = rejected(call, **body)
    assert (error["status"], error["param"], error["type"]) == (400, param, "invalid_request_error")


def test_another_model_name_is_a_404_naming_model():
    error = rejected(chat, model="gpt-4o")
    assert (error["status"], error["param"], error["code"]) == (404, "model", "model_not_found")


@pytest.mark.parametrize("body,status", [
    (b"", 400), (b"{", 400), (b"[1]", 400), (b"\xff", 400), (b"{" * 40 + b"}" * 40, 400), (b" " * 70000, 413),
    (None, 400),
])
def test_malformed_bodies_get_openai_errors(body, status):
    with pytest.raises(OpenAIError) as info:
        parse_openai("v1/chat/completions", body, 65536, MODEL)
    assert info.value.status == status and "error" in json.loads(info.value.to_json())


def test_models_routes_and_unknown_paths():
    listing = parse_openai("v1/models", b"", 65536, MODEL)
    assert isinstance(listing, Reply) and listing.status == 200
    assert [m["id"] for m in json.loads(listing.body)["data"]] == [MODEL]
    assert json.loads(parse_openai("v1/models/tiny/", b"", 65536, MODEL).body)["object"] == "model"
    assert rejected(lambda: parse_openai("v1/models/other", b"", 65536, MODEL))["status"] == 404
    assert rejected(lambda: parse_openai("v1/embeddings", b"{}", 65536, MODEL))["code"] == "not_found"


def test_engine_errors_are_renamed_for_the_route():
    error = RequestError("max_new_tokens is 600, but the prompt leaves room for only 200", "max_new_tokens")
    renamed = json.loads(as_openai_error(error, "v1/chat/completions").to_json())["error"]
    assert renamed["param"] == "max_tokens" and renamed["message"].startswith("max_tokens is 600")
    assert as_openai_error(RequestError("too long", "inputs"), "v1/completions").parameter == "prompt"
    assert as_openai_error(RequestError("too long", "messages"), "v1/chat/completions").parameter == "messages"
    busy = json.loads(as_openai_error(RequestError("busy", status=503), "v1/completions").to_json())["error"]
    assert busy["type"] == "server_error"


def test_the_tgi_api_does_not_take_the_openai_only_logprobs_parameter():
    with pytest.raises(RequestError) as info:
        parse_request({"inputs": "x", "parameters": {"logprobs": 2}})
    assert info.value.parameter == "logprobs"
    with pytest.raises(RequestError):
        SamplingParams(logprobs=21)


# -- responses -------------------------------------------------------------------------------

def test_streamed_chat_equals_the_non_streamed_answer_with_usage(engine):
    streamed, result = run(engine, chat(temperature=0, max_tokens=12, stream=True,
                                        stream_options={"include_usage": True}))
    chunks = sse_data(streamed)
    *token_chunks, usage_chunk = chunks
    assert token_chunks[0]["choices"][0]["delta"]["role"] == "assistant"
    assert all(c["object"] == "chat.completion.chunk" and c["usage"] is None for c in token_chunks)
    assert len({(c["id"], c["created"]) for c in chunks}) == 1 and chunks[0]["id"].startswith("chatcmpl-")
    assert usage_chunk["choices"] == [] and usage_chunk["usage"] == {
        "prompt_tokens": result.prompt_tokens, "completion_tokens": 12, "total_tokens": result.prompt_tokens + 12}
    assert [c["choices"][0]["finish_reason"] for c in token_chunks] == [None] * 11 + ["length"]
    whole = json.loads(full_response(chat(temperature=0, max_tokens=12), run(engine, chat(temperature=0,
                                                                                          max_tokens=12))[1]))
    assert "".join(c["choices"][0]["delta"]["content"] for c in token_chunks) == \
        whole["choices"][0]["message"]["content"] == result.text
    assert whole["object"] == "chat.completion" and whole["model"] == MODEL and whole["usage"] == usage_chunk["usage"]


def test_chat_logprobs_report_every_token_and_the_most_likely_alternatives(engine):
    request = chat(temperature=0, max_tokens=6, logprobs=True, top_logprobs=3)
    streamed, result = run(engine, request)
    content = json.loads(full_response(request, result))["choices"][0]["logprobs"]["content"]
    assert len(content) == 6 and "".join(t["token"] for t in content) == result.text
    for entry in content:
        assert len(entry["top_logprobs"]) == 3 and entry["bytes"] == list(entry["token"].encode())
        best = entry["top_logprobs"][0]
        assert best["token"] == entry["token"] and best["logprob"] == pytest.approx(entry["logprob"])
        assert entry["logprob"] <= 0
        assert [t["logprob"] for t in entry["top_logprobs"]] == sorted((t["logprob"] for t in entry["top_logprobs"]),
                                                                       reverse=True)
    streamed_entries = [c["choices"][0]["logprobs"]["content"] for c in sse_data(streamed)]
    assert [e for entries in streamed_entries for e in entries] == content


def test_sampled_top_logprobs_leave_out_tokens_top_k_ruled_out(engine):
    request = chat(temperature=0.8, top_k=2, seed=5, max_tokens=4, logprobs=True, top_logprobs=5)
    content = json.loads(full_response(request, run(engine, request)[1]))["choices"][0]["logprobs"]["content"]
    assert all(len(entry["top_logprobs"]) <= 2 for entry in content)
    assert all(entry["token"] in [t["token"] for t in entry["top_logprobs"]] for entry in content)


def test_completion_bodies_and_legacy_logprobs(engine):
    request = completion(temperature=0, max_tokens=5, logprobs=2, stream=True)
    streamed, result = run(engine, request)
    chunks = sse_data(streamed)
    assert all(c["object"] == "text_completion" and "usage" not in c for c in chunks)
    assert "".join(c["choices"][0]["text"] for c in chunks) == result.text
    offsets = [c["choices"][0]["logprobs"]["text_offset"][0] for c in chunks]
    tokens = [c["choices"][0]["logprobs"]["tokens"][0] for c in chunks]
    assert offsets == [sum(len(t) for t in tokens[:i]) for i in range(len(tokens))]
    for c, token in zip(chunks, tokens):
        top = c["choices"][0]["logprobs"]["top_logprobs"][0]
        assert token in top and 2 <= len(top) <= 3
    whole = json.loads(full_response(completion(temperature=0, max_tokens=5, logprobs=2), result))
    assert whole["choices"][0]["text"] == result.text and whole["id"].startswith("cmpl-")
    assert whole["choices"][0]["logprobs"]["tokens"] == tokens and whole["usage"]["completion_tokens"] == 5


def test_a_stop_sequence_ends_the_answer_with_finish_reason_stop(engine):
    free = run(engine, completion(temperature=0, max_tokens=16))[1].text
    stop = free[3:6]
    request = completion(temperature=0, max_tokens=16, stop=[stop])
    body = json.loads(full_response(request, run(engine, request)[1]))
    assert body["choices"][0]["text"] == free[:free.index(stop)]
    assert body["choices"][0]["finish_reason"] == "stop" and body["choices"][0]["logprobs"] is None


def test_a_failure_mid_stream_is_an_openai_error_event():
    request = chat(stream=True)
    event = stream_error(request, RequestError("generation failed: device lost", status=500))
    assert event.startswith("data: ") and event.endswith("\n\n")
    assert json.loads(event[len("data: "):])["error"]["type"] == "server_error"
