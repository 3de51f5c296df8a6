import json

import pytest

from llama_engine import RequestError, SamplingParams, parse_request


def test_plain_text_is_the_prompt():
    req = parse_request("Today the weather is", "text/plain")
    assert req.prompt == "Today the weather is"
    assert req.stream is True
    assert req.params.greedy


def test_bytes_body_is_decoded():
    assert parse_request("héllo 🦙".encode(), "application/octet-stream").prompt == "héllo 🦙"


def test_json_object():
    req = parse_request({"inputs": "Hi", "parameters": {"max_new_tokens": 5, "do_sample": True,
                                                       "temperature": 0.7, "top_k": 20, "top_p": 0.9},
                         "stream": False})
    assert req.prompt == "Hi" and req.stream is False
    assert req.params.max_new_tokens == 5 and req.params.do_sample and req.params.top_k == 20


def test_json_sent_as_text_with_json_content_type_is_parsed():
    req = parse_request(json.dumps({"inputs": "Hi"}), "application/json; charset=utf-8")
    assert req.prompt == "Hi"


def test_plain_prompt_sent_as_json_content_type_is_accepted():
    # The SageMaker example sends a plain prompt with ContentType application/json.
    assert parse_request(b"Today the weather is", "application/json").prompt == "Today the weather is"


def test_temperature_zero_means_greedy():
    params = SamplingParams(do_sample=True, temperature=0)
    assert params.greedy and params.temperature == 0.0


def test_top_k_one_means_greedy():
    assert SamplingParams(do_sample=True, top_k=1).greedy


def test_integer_temperature_becomes_float():
    assert isinstance(SamplingParams(temperature=1).temperature, float)


@pytest.mark.parametrize("body,content_type,parameter,status", [
    (None, None, "inputs", 400),
    ("", "text/plain", "inputs", 400),
    ("   \n", "text/plain", "inputs", 400),
    (b"\xff\xfe bad", "text/plain", "inputs", 400),
    ('{"inputs": "x"', "application/json", "inputs", 400),
    ([{"inputs": "x"}], "application/json", "inputs", 400),
    ({"prompt": "x"}, "application/json", "prompt", 400),
    ({"inputs": 3}, "application/json", "inputs", 400),
    ({"inputs": ""}, "application/json", "inputs", 400),
    ({"inputs": "x", "stream": "yes"}, "application/json", "stream", 400),
    ({"inputs": "x", "parameters": []}, "application/json", "parameters", 400),
    ({"inputs": "x", "parameters": {"max_new_tokens": "5"}}, None, "max_new_tokens", 400),
    ({"inputs": "x", "parameters": {"max_new_tokens": 0}}, None, "max_new_tokens", 400),
    ({"inputs": "x", "parameters": {"max_new_tokens": 2.5}}, None, "max_new_tokens", 400),
    ({"inputs": "x", "parameters": {"temperature": -1}}, None, "temperature", 400),
    ({"inputs": "x", "parameters": {"temperature": "hot"}}, None, "temperature", 400),
    ({"inputs": "x", "parameters": {"top_p": 0}}, None, "top_p", 400),
    ({"inputs": "x", "parameters": {"top_p": 1.5}}, None, "top_p", 400),
    ({"inputs": "x", "parameters": {"top_k": -2}}, None, "top_k", 400),
    ({"inputs": "x", "parameters": {"do_sample": "true"}}, None, "do_sample", 400),
    ({"inputs": "x", "parameters": {"seed": -1}}, None, "seed", 400),
    ({"inputs": "x", "parameters": {"beams": 4}}, None, "beams", 400),
    ("x" * 70000, "text/plain", "inputs", 413),
])
def test_bad_requests_name_the_field(body, content_type, parameter, status):
    with pytest.raises(RequestError) as info:
        parse_request(body, content_type)
    assert info.value.parameter == parameter
    assert info.value.status == status
    body = json.loads(info.value.to_json())
    assert body["parameter"] == parameter and body["code"] == status and body["error"]
