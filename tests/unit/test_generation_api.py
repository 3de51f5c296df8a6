"""Issue 4's generation API in-process: parameters, stop sequences, chat, per-row parameters, formats."""
from __future__ import annotations

import json

import pytest
import torch
from huggingface_hub.inference._generated.types import TextGenerationStreamOutput

from llama_engine import Engine, GenerationRequest, RequestError, SamplingParams, parse_request
from llama_engine.backends.base import take_greedy_picks
from llama_engine.chat import render_chat, render_llama2
from llama_engine.config import HandlerConfig
from llama_engine.formatting import full_response, ndjson_line, sse_event
from llama_engine.stopping import StopSequences


@pytest.fixture(scope="module")
def engine(tiny_model_dir):
    torch.set_num_threads(2)
    return Engine.from_config(HandlerConfig(model_path=tiny_model_dir.name, max_length=256, max_new_tokens=16),
                              str(tiny_model_dir.parent))


def generate(engine, requests, sink=None):
    return engine.generate([engine.prepare(r) for r in requests], sink)


# -- parameters ---------------------------------------------------------------------------

@pytest.mark.parametrize("parameters,parameter", [
    ({"repetition_penalty": 0}, "repetition_penalty"),
    ({"repetition_penalty": "high"}, "repetition_penalty"),
    ({"repetition_penalty": float("nan")}, "repetition_penalty"),
    ({"stop": 3}, "stop"),
    ({"stop": [""]}, "stop"),
    ({"stop": ["a", 1]}, "stop"),
    ({"stop": ["x"] * 9}, "stop"),
    ({"stop": ["x" * 300]}, "stop"),
    ({"return_full_text": "no"}, "return_full_text"),
    ({"details": 1}, "details"),
    ({"seed": 2**63}, "seed"),
    ({"seed": 1.5}, "seed"),
    ({"top_n_tokens": 5}, "top_n_tokens"),
    ({"watermark": True}, "watermark"),
    ({"temperature": float("inf")}, "temperature"),
    ({"top_k": 1.5}, "top_k"),
])
def test_bad_parameters_name_themselves(parameters, parameter):
    with pytest.raises(RequestError) as info:
        parse_request({"inputs": "x", "parameters": parameters})
    assert info.value.parameter == parameter and info.value.status == 400
    assert json.loads(info.value.to_json())["parameter"] == parameter


@pytest.mark.parametrize("messages", [
    [], "hi", [{"role": "user"}], [{"role": "robot", "content": "x"}], [{"role": "user", "content": 3}],
    [{"role": "user", "content": "a"}, {"role": "system", "content": "b"}],
    [{"role": "assistant", "content": "a"}], [{"role": "user", "content": "a"}, {"role": "user", "content": "b"}],
    [{"role": "user", "content": "a"}, {"role": "assistant", "content": "b"}],
])
def test_bad_messages_are_400s_naming_messages(messages):
    with pytest.raises(RequestError) as info:
        parse_request({"messages": messages})
    assert info.value.parameter == "messages" and info.value.status == 400


def test_normalisation():
    params = SamplingParams.from_dict({"stop": "###", "temperature": 0, "do_sample": True, "seed": None,
                                       "repetition_penalty": 1})
    assert params.stop == ["###"] and params.greedy and params.seed is None
    assert isinstance(params.repetition_penalty, float)


def test_output_form_follows_the_request():
    assert parse_request({"inputs": "x"}).output == "ndjson"
    assert parse_request({"inputs": "x", "stream": True}).output == "sse"
    assert parse_request({"inputs": "x", "stream": False}).output == "json"
    assert parse_request("x", "text/plain", accept="text/event-stream").output == "sse"
    assert parse_request({"inputs": "x", "stream": False}, accept="text/event-stream").output == "json"


# -- stop sequences -----------------------------------------------------------------------

def test_stop_sequence_spanning_pieces_is_held_back_then_cut():
    stops = StopSequences(["</answer>"])
    assert stops("The value is 4") == ("The value is 4", False)
    assert stops(" </ans") == (" ", False)  # "</ans" could start the stop sequence: held
    assert stops.held == "</ans"
    assert stops("wer> and more") == ("", True)


def test_false_alarm_is_released():
    stops = StopSequences(["STOP"])
    assert stops("ST") == ("", False)
    assert stops("ART") == ("START", False)
    assert stops("x S") == ("x ", False)
    assert stops.flush() == "S"


def test_earliest_of_several_stop_sequences_wins():
    stops = StopSequences(["world", "lo w"])
    assert stops("hello world") == ("hel", True)


def test_engine_stops_on_a_sequence_across_tokens(engine):
    free = generate(engine, [GenerationRequest("The function returns", SamplingParams(max_new_tokens=24))])[0]
    assert len(free.token_ids) == 24
    # pick a stop string that straddles a token boundary in the free-running output
    boundary = len(free.token_texts[0]) + len(free.token_texts[1])
    start = max(1, boundary - 2)
    stop = free.text[start:boundary + 2]
    assert stop and len(stop) >= 2
    events = []
    stopped = generate(engine, [GenerationRequest("The function returns",
                                                  SamplingParams(max_new_tokens=24, stop=[stop]))], events.extend)[0]
    assert stopped.finish_reason == "stop_sequence"
    assert stopped.text == free.text[:free.text.find(stop)]
    assert "".join(e.text for e in events) == stopped.text
    assert stop not in stopped.text


def test_three_finish_reasons(engine):
    eos_prompt = None
    for prompt in ("The", "A", "It", "If", "When", "Return"):
        result = generate(engine, [GenerationRequest(prompt, SamplingParams(max_new_tokens=200))])[0]
        if result.finish_reason == "eos_token":
            eos_prompt = prompt
            break
    length = generate(engine, [GenerationRequest("The", SamplingParams(max_new_tokens=2))])[0]
    assert length.finish_reason == "length"
    if eos_prompt is None:  # force EOS through the selector path: a logits bias on eos
        original = engine.backend.decode

        def biased(tokens):
            logits = original(tokens)
            take_greedy_picks(logits)  # the logits change: picks made from them no longer hold
            return logits.index_fill_(1, torch.tensor([engine.tokenizer.eos_token_id]), 1e9)

        engine.backend.decode = biased
        try:
            result = generate(engine, [GenerationRequest("The", SamplingParams(max_new_tokens=5))])[0]
        finally:
            engine.backend.decode = original
    assert result.finish_reason == "eos_token"


# -- per-row parameters in one batch ------------------------------------------------------

ROWS = [
    GenerationRequest("The function returns", SamplingParams(max_new_tokens=12)),
    GenerationRequest("If the object is", SamplingParams(max_new_tokens=12, do_sample=True, temperature=0.7, seed=3)),
    GenerationRequest("A list of", SamplingParams(max_new_tokens=12, repetition_penalty=1.3)),
    GenerationRequest("The default value is", SamplingParams(max_new_tokens=12, do_sample=True, top_k=20,
                                                             top_p=0.8, temperature=1.3, seed=99)),
    GenerationRequest("When the file", SamplingParams(max_new_tokens=12, stop=["\n"])),
]


def test_each_row_behaves_as_if_served_alone(engine):
    alone = [generate(engine, [r])[0] for r in ROWS]
    batched = generate(engine, ROWS)
    for a, b in zip(alone, batched):
        assert (b.token_ids, b.text, b.finish_reason) == (a.token_ids, a.text, a.finish_reason)
    assert batched[1].seed == 3 and batched[0].seed is None


def test_same_seed_same_output_different_seed_different_output(engine):
    def sampled(seed):
        return generate(engine, [GenerationRequest("The", SamplingParams(max_new_tokens=16, do_sample=True,
                                                                         temperature=1.5, seed=seed))])[0].text
    assert sampled(5) == sampled(5)
    assert len({sampled(s) for s in range(6)}) > 1


# -- chat ---------------------------------------------------------------------------------

def test_llama2_chat_template_string():
    messages = [{"role": "system", "content": "You are terse."}, {"role": "user", "content": "Hi there"},
                {"role": "assistant", "content": "Hello."}, {"role": "user", "content": "Tell me more "}]
    assert render_llama2(messages) == (
        "<s>[INST] <<SYS>>\nYou are terse.\n<</SYS>>\n\nHi there [/INST] Hello. </s>"
        "<s>[INST] Tell me more [/INST]")
    assert render_llama2([{"role": "user", "content": "Hi"}]) == "<s>[INST] Hi [/INST]"


def test_tokenizers_own_chat_template_wins(tokenizer):
    tokenizer.chat_template = "{% for m in messages %}<{{ m.role }}>{{ m.content }}{% endfor %}<assistant>"
    try:
        assert render_chat(tokenizer, [{"role": "user", "content": "Hi"}]) == "<user>Hi<assistant>"
    finally:
        tokenizer.chat_template = None


def test_chat_request_is_tokenized_with_a_single_bos(engine):
    request = parse_request({"messages": [{"role": "user", "content": "Hi"}]})
    prepared = engine.prepare(request)
    assert request.prompt == "<s>[INST] Hi [/INST]"
    assert prepared.prompt_ids.count(engine.tokenizer.bos_token_id) == 1 and prepared.prompt_ids[0] == 1


# -- response forms -----------------------------------------------------------------------

def test_sse_events_parse_as_tgi_stream_output(engine):
    request = GenerationRequest("The", SamplingParams(max_new_tokens=4, details=True, return_full_text=True))
    events = []
    result = generate(engine, [request], events.extend)[0]
    payloads = [sse_event(request, e) for e in events]
    assert all(p.startswith("data: ") and p.endswith("\n\n") for p in payloads)
    parsed = [TextGenerationStreamOutput.parse_obj_as_instance(json.loads(p[len("data: "):])) for p in payloads]
    assert [p.index for p in parsed] == [1, 2, 3, 4]
    assert parsed[-1].generated_text == "The" + result.text and parsed[-1].details.generated_tokens == 4
    assert all(p.generated_text is None and p.details is None for p in parsed[:-1])


def test_details_only_when_asked_in_sse_and_json(engine):
    request = GenerationRequest("The", SamplingParams(max_new_tokens=3))
    events = []
    result = generate(engine, [request], events.extend)[0]
    assert json.loads(sse_event(request, events[-1])[6:])["details"] is None
    assert "details" not in json.loads(full_response(request, result))[0]
    assert json.loads(ndjson_line(request, events[-1]))["details"]["finish_reason"] == "length"
    request.params.details = True
    body = json.loads(full_response(request, result))[0]
    assert [t["id"] for t in body["details"]["tokens"]] == result.token_ids
    assert "".join(t["text"] for t in body["details"]["tokens"]) == result.text
    assert all(t["logprob"] <= 0 for t in body["details"]["tokens"])


def test_tgi_clients_without_a_stream_key_get_one_json_document():
    agent = "unknown/None; hf_hub/0.36.2; python/3.11.7"
    assert parse_request({"inputs": "x"}, user_agent=agent).output == "json"
    assert parse_request({"inputs": "x", "stream": True}, user_agent=agent).output == "sse"
    assert parse_request({"inputs": "x"}, user_agent="curl/8.0").output == "ndjson"


def test_mid_stream_errors_end_each_form_in_its_own_way():
    from huggingface_hub.errors import TextGenerationError
    from huggingface_hub.inference._common import _format_text_generation_stream_output

    from llama_engine.formatting import stream_error

    error = RequestError("generation failed: device lost", status=500)
    sse = stream_error(parse_request({"inputs": "x", "stream": True}), error)
    with pytest.raises(TextGenerationError, match="device lost"):
        _format_text_generation_stream_output(sse.strip().encode(), details=True)
    line = stream_error(parse_request({"inputs": "x"}), error)
    assert line.endswith("\n") and json.loads(line)["code"] == 500
