"""Hostile and malformed bodies (issue 14): each is a 4xx naming the field, never an exception
that escapes the parser (a RecursionError, an integer-conversion ValueError, a tokenizer
error), and no accepted parameter makes token selection produce nan.

The same bodies go through a real TorchServe in tests/e2e/test_bad_input.py.
"""
from __future__ import annotations

import io
import json
import math
import struct

import pytest
import torch

import llama_handler
from llama_engine import RequestError, SamplingParams, parse_request
from llama_engine.request import MAX_JSON_DEPTH
from llama_engine.selection import TokenSelector, select_tokens

JSON = "application/json"


def error_of(body, content_type=JSON, max_bytes=65536) -> RequestError:
    with pytest.raises(RequestError) as info:
        parse_request(body, content_type, max_bytes)
    return info.value


def nested(depth: int, inner: str = "") -> str:
    return "[" * depth + inner + "]" * depth


# -- nesting depth ----------------------------------------------------------------------------


@pytest.mark.parametrize("text", [
    nested(5000),
    '{"inputs": ' + nested(5000) + "}",
    '{"inputs": "x", "parameters": ' + '{"a": ' * 5000 + "1" + "}" * 5000 + "}",
    '{"messages": [' + nested(5000) + "]}",
    nested(100_000),  # past any recursion limit; the scan is one pass over the text
])
def test_deep_json_is_a_400_and_never_a_recursion_error(text):
    for body in (text, text.encode()):
        error = error_of(body, max_bytes=1 << 20)
        assert error.status == 400 and error.parameter == "inputs"
        assert f"deeper than {MAX_JSON_DEPTH}" in error.message


def test_the_depth_limit_is_exact():
    # depth = the number of arrays/objects open at once, the outer object included
    at_limit = '{"inputs": "x", "parameters": {"x": ' + nested(MAX_JSON_DEPTH - 2) + "}}"
    assert error_of(at_limit).parameter == "x"  # parsed: the unknown parameter is what is wrong
    over = '{"inputs": "x", "parameters": {"x": ' + nested(MAX_JSON_DEPTH - 1) + "}}"
    assert error_of(over).parameter == "inputs" and "deeper" in error_of(over).message


@pytest.mark.parametrize("prompt", ["[" * 5000, '"] [[[' + "{" * 5000, "\\" + "[" * 5000])
def test_brackets_inside_strings_do_not_count(prompt):
    assert parse_request(json.dumps({"inputs": prompt}), JSON).prompt == prompt


def test_an_already_decoded_deep_value_is_a_400_without_recursion():
    # TorchServe's worker decodes application/json itself unless told not to; whatever it
    # hands over is measured without recursion before json.dumps or anything else sees it.
    deep = []
    for _ in range(100_000):
        deep = [deep]
    error = error_of({"inputs": "x", "parameters": {"stop": deep}}, None)
    assert error.status == 400 and error.parameter == "inputs" and "deeper" in error.message
    assert error_of([deep], None).parameter == "inputs"


# -- numbers ------------------------------------------------------------------------------------


@pytest.mark.parametrize("name", ["max_new_tokens", "temperature", "top_k", "top_p", "repetition_penalty", "seed"])
@pytest.mark.parametrize("literal", ["NaN", "Infinity", "-Infinity", "1e999", "-1e999"])
def test_non_finite_numbers_name_their_parameter(name, literal):
    error = error_of('{"inputs": "x", "parameters": {"%s": %s}}' % (name, literal))  # noqa: UP031 - JSON braces stay single
    assert error.status == 400 and error.parameter == name


@pytest.mark.parametrize("text", ['{"inputs": NaN}', '{"inputs": "x", "stream": Infinity}'])
def test_non_finite_numbers_elsewhere(text):
    assert error_of(text).parameter in ("inputs", "stream")


def test_an_integer_over_pythons_digit_limit_is_a_400():
    error = error_of('{"inputs": "x", "parameters": {"max_new_tokens": %s}}' % ("9" * 5000))
    assert error.status == 400 and error.parameter == "inputs" and "invalid JSON" in error.message


def test_a_huge_but_parseable_integer_is_out_of_range():
    error = error_of('{"inputs": "x", "parameters": {"seed": %s}}' % ("9" * 4000))
    assert error.parameter == "seed"


# -- text that cannot be UTF-8 ----------------------------------------------------------------


@pytest.mark.parametrize("text,parameter", [
    ('{"inputs": "a\\ud800b"}', "inputs"),
    ('{"inputs": "x", "parameters": {"stop": ["\\udfff"]}}', "stop"),
    ('{"messages": [{"role": "user", "content": "\\ud83d"}]}', "messages"),
    ('"\\ud800"', "inputs"),
])
def test_lone_surrogates_are_a_400_naming_the_field(text, parameter):
    error = error_of(text)
    assert error.status == 400 and error.parameter == parameter and "Unicode" in error.message


def test_a_paired_surrogate_escape_is_fine():
    assert parse_request('{"inputs": "llama \\ud83e\\udd99"}', JSON).prompt == "llama 🦙"


# -- the body as sent ---------------------------------------------------------------------------


def test_the_size_limit_counts_the_bytes_sent():
    body = json.dumps({"inputs": "猫" * 15000}, ensure_ascii=False).encode()  # 45 kB, 90 kB as \\u escapes
    assert len(body) < 65536 < len(json.dumps({"inputs": "猫" * 15000}))
    assert parse_request(body, JSON).prompt == "猫" * 15000
    assert parse_request({"inputs": "猫" * 15000}, None).prompt == "猫" * 15000
    assert error_of(json.dumps({"inputs": "猫" * 22000}, ensure_ascii=False).encode()).status == 413


def test_a_whole_body_json_string_is_the_prompt():
    assert parse_request(b'"Today the weather is"', JSON).prompt == "Today the weather is"
    assert parse_request(b'"Hello," she said', JSON).prompt == '"Hello," she said'
    assert parse_request(b'"Hello," she said', "text/plain").prompt == '"Hello," she said'
    assert parse_request(b"42", JSON).prompt == "42"
    assert error_of(b'"   "').parameter == "inputs"


@pytest.mark.parametrize("body,parameter", [
    (b"", "inputs"),
    (b"\xff\xfe{", "inputs"),
    (b'{"inputs": ', "inputs"),
    (b'{"inputs": "x",}', "inputs"),
    (b"[]", "inputs"),
    (b'{"inputs": "x", "extra": 1}', "extra"),
    (b'{"inputs": "x", "parameters": {"beams": 2}}', "beams"),
    (b'{"inputs": "x", "parameters": "fast"}', "parameters"),
    (b'{"inputs": ["x"]}', "inputs"),
    (b'{"messages": [{"role": "robot", "content": "x"}]}', "messages"),
    (b'{"messages": [{"role": "user"}]}', "messages"),
    (b'{"messages": [{"role": ["user"], "content": "x"}]}', "messages"),
    (b'{"messages": "hi"}', "messages"),
])
def test_raw_bodies_name_the_field(body, parameter):
    error = error_of(body)
    assert 400 <= error.status < 500 and error.parameter == parameter
    assert json.loads(error.to_json())["parameter"] == parameter


# -- TorchServe's worker hands over the bytes ------------------------------------------------


class WireConnection:
    """The frontend's side of one input parameter, as ``_retrieve_input_data`` reads it."""

    def __init__(self, name: bytes, content_type: bytes, value: bytes):
        frame = b"".join(struct.pack("!i", len(part)) + part for part in (name, content_type, value))
        self.stream = io.BytesIO(frame)

    def recv(self, n: int) -> bytes:
        return self.stream.read(n)


def test_take_raw_bodies_turns_off_the_workers_json_decoding(monkeypatch):
    from ts.protocol.otf_message_handler import _retrieve_input_data

    body = b'{"inputs": "x", "parameters": {"temperature": NaN}}'
    monkeypatch.delenv("TS_DECODE_INPUT_REQUEST", raising=False)
    assert _retrieve_input_data(WireConnection(b"body", b"application/json", body))["value"] != body
    llama_handler.take_raw_bodies()
    assert _retrieve_input_data(WireConnection(b"body", b"application/json", body))["value"] == body
    assert _retrieve_input_data(WireConnection(b"body", b"text/plain", b"Hi"))["value"] == b"Hi"


# -- extreme values that are in range ----------------------------------------------------------


def test_a_temperature_too_small_to_sample_with_means_greedy():
    assert SamplingParams(do_sample=True, temperature=1e-300).greedy
    assert not SamplingParams(do_sample=True, temperature=1e-4).greedy


@pytest.mark.parametrize("params", [
    dict(do_sample=True, temperature=1e-5),
    dict(do_sample=True, temperature=1e300),
    dict(do_sample=True, top_p=5e-324),
    dict(do_sample=True, top_p=1e-300, temperature=1e300),
    dict(repetition_penalty=1e-300),
    dict(repetition_penalty=1e300),
    dict(do_sample=True, repetition_penalty=1e-300, top_k=3, top_p=5e-324),
    dict(do_sample=True, repetition_penalty=1e300, temperature=1e-5),
])
def test_extreme_parameters_never_make_selection_nan(params):
    logits = torch.randn(2, 64, generator=torch.Generator().manual_seed(0)) * 8
    logits[:, 5] = 0.0  # a zero score times an infinite penalty is nan without care
    selectors = [TokenSelector(SamplingParams(seed=1, **params), prompt_ids=[1, 5, 9]),
                 TokenSelector(SamplingParams(), prompt_ids=[2])]
    for _ in range(3):
        tokens, logprobs = select_tokens(logits, selectors)
        assert all(math.isfinite(lp) for lp in logprobs)
        assert tokens[1].item() == int(logits[1].argmax())  # the greedy neighbour is untouched
