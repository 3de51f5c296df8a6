"""The OpenAI-compatible API through a real TorchServe, read by the official ``openai`` client.

Both batching modes: the session's micro-batching server (``tiny-llama``, batches of 8 in
micro-batches of 4) and its continuous-batching server (``tiny-llama-continuous``). The base
URL is ``/predictions/<model>/1.0/v1``: TorchServe hands what follows the version to the
handler as ``url_path``.
"""
from __future__ import annotations

import json
import re
import subprocess
import sys
import threading
from pathlib import Path

import openai
import pytest

from llama_engine.chat import render_chat

from conftest import CONTINUOUS, MODEL

ROOT = Path(__file__).resolve().parents[2]
MESSAGES = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "What does a function return?"}]
PROMPT = "The function returns"


@pytest.fixture(scope="module", params=[MODEL, CONTINUOUS])
def served(request):
    """(server, model name) for each batching mode."""
    server = request.getfixturevalue("server" if request.param == MODEL else "continuous_server")
    return server, request.param


@pytest.fixture(scope="module")
def client(served):
    server, model = served
    return openai.OpenAI(base_url=f"{server.url()}/predictions/{model}/1.0/v1", api_key=server.key,
                         max_retries=0, timeout=120)


@pytest.fixture(scope="module")
def model(served):
    return served[1]


def chat(client, model, **kwargs):
    return client.chat.completions.create(model=model, messages=MESSAGES, **kwargs)


def test_streamed_chat_equals_the_non_streamed_chat_when_greedy(client, model, tokenizer):
    whole = chat(client, model, temperature=0, max_tokens=12)
    chunks = list(chat(client, model, temperature=0, max_tokens=12, stream=True,
                       stream_options={"include_usage": True}))
    *token_chunks, last = chunks
    assert "".join(c.choices[0].delta.content for c in token_chunks) == whole.choices[0].message.content
    assert token_chunks[0].choices[0].delta.role == "assistant"
    assert token_chunks[-1].choices[0].finish_reason == whole.choices[0].finish_reason == "length"
    assert last.choices == [] and last.usage == whole.usage
    prompt_ids = tokenizer(render_chat(tokenizer, MESSAGES), add_special_tokens=False)["input_ids"]
    assert whole.usage.prompt_tokens == len(prompt_ids)
    assert whole.usage.completion_tokens == 12 and whole.usage.total_tokens == len(prompt_ids) + 12
    assert whole.model == model and whole.object == "chat.completion" and whole.id.startswith("chatcmpl-")
    assert len({c.id for c in chunks}) == 1 and all(c.object == "chat.completion.chunk" for c in chunks)


def test_completion_usage_and_logprobs_match_the_tokenizer(client, model, tokenizer):
    out = client.completions.create(model=model, prompt=PROMPT, temperature=0, max_tokens=8, logprobs=2)
    choice = out.choices[0]
    assert out.usage.prompt_tokens == len(tokenizer(PROMPT)["input_ids"])
    assert out.usage.completion_tokens == len(choice.logprobs.tokens) == 8
    assert "".join(choice.logprobs.tokens) == choice.text
    assert all(token in top for token, top in zip(choice.logprobs.tokens, choice.logprobs.top_logprobs))
    streamed = "".join(c.choices[0].text for c in client.completions.create(
        model=model, prompt=PROMPT, temperature=0, max_tokens=8, stream=True))
    assert streamed == choice.text


def test_chat_logprobs_and_top_logprobs(client, model):
    out = chat(client, model, temperature=0, max_tokens=5, logprobs=True, top_logprobs=3)
    content = out.choices[0].logprobs.content
    assert len(content) == 5 and "".join(t.token for t in content) == out.choices[0].message.content
    for entry in content:  # greedy: the chosen token is the most likely one
        assert len(entry.top_logprobs) == 3 and entry.top_logprobs[0].token == entry.token
        assert entry.logprob == pytest.approx(entry.top_logprobs[0].logprob) and entry.logprob <= 0


def test_stop_ends_the_answer_before_the_stop_string(client, model):
    free = chat(client, model, temperature=0, max_tokens=16).choices[0].message.content
    stop = free[3:6]
    for kind in (stop, [stop, "never in it \u2603"]):
        out = chat(client, model, temperature=0, max_tokens=16, stop=kind)
        assert out.choices[0].message.content == free[:free.index(stop)]
        assert out.choices[0].finish_reason == "stop"


def test_seed_makes_sampling_reproducible(client, model):
    kwargs = dict(temperature=1.0, top_p=0.9, seed=11, max_completion_tokens=10)
    assert chat(client, model, **kwargs).choices[0].message.content == \
        chat(client, model, **kwargs).choices[0].message.content


@pytest.mark.parametrize("kwargs,param", [
    ({"n": 2}, "n"),
    ({"tools": [{"type": "function", "function": {"name": "now", "parameters": {"type": "object"}}}]}, "tools"),
    ({"response_format": {"type": "json_object"}}, "response_format"),
    ({"temperature": 3}, "temperature"),
    ({"extra_body": {"best_of_n": 2}}, "best_of_n"),
])
def test_unsupported_fields_and_bad_values_are_rejected_by_name(client, model, kwargs, param):
    with pytest.raises(openai.BadRequestError) as info:
        chat(client, model, max_tokens=4, **kwargs)
    assert info.value.status_code == 400 and info.value.param == param
    assert info.value.type == "invalid_request_error" and param in info.value.message


def test_a_max_tokens_beyond_the_context_names_max_tokens(client, model):
    with pytest.raises(openai.BadRequestError) as info:
        chat(client, model, max_tokens=600)
    assert info.value.param == "max_tokens"


def test_models_lists_the_served_model_and_another_name_is_not_found(client, model):
    assert [m.id for m in client.models.list()] == [model]
    assert client.models.retrieve(model).id == model
    with pytest.raises(openai.NotFoundError) as info:
        chat(client, "gpt-4o", max_tokens=2)
    assert info.value.code == "model_not_found" and info.value.param == "model"


def test_the_version_segment_is_required(served):
    server, model = served
    versionless = openai.OpenAI(base_url=f"{server.url()}/predictions/{model}/v1", api_key=server.key, max_retries=0)
    with pytest.raises(openai.NotFoundError):
        versionless.models.list()


def test_concurrent_streams_share_a_batch_and_each_gets_its_solo_answer(client, model):
    lengths = [4, 9, 6, 12]
    solo = [chat(client, model, temperature=0, max_tokens=n).choices[0].message.content for n in lengths]
    together = [None] * len(lengths)
    barrier = threading.Barrier(len(lengths))

    def stream(i):
        barrier.wait()
        chunks = chat(client, model, temperature=0, max_tokens=lengths[i], stream=True)
        together[i] = "".join(c.choices[0].delta.content for c in chunks)

    threads = [threading.Thread(target=stream, args=(i,)) for i in range(len(lengths))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=120)
    assert together == solo


def readme_block(language: str, marker: str) -> str:
    """The README's fenced ``language`` block that contains ``marker``."""
    blocks = re.findall(rf"```{language}\n(.*?)```", (ROOT / "README.md").read_text(), re.S)
    found = [b for b in blocks if marker in b]
    assert len(found) == 1, f"expected one {language} block with {marker!r} in README.md"
    return found[0]


def pointed_at(block: str, server) -> str:
    """A README block aimed at the test server: its address, and its key read from its work directory."""
    return (block.replace("http://127.0.0.1:8080", server.url())
            .replace("scripts/tsctl.py key", f"scripts/tsctl.py key --workdir {server.workdir}"))


def test_the_readme_curl_example(server):
    script = pointed_at(readme_block("bash", "$BASE/chat/completions"), server)
    out = subprocess.run(["bash", "-c", script], cwd=ROOT, capture_output=True, text=True, timeout=120, check=True)
    events = [block[len("data: "):] for block in out.stdout.split("\n\n") if block.startswith("data: ")]
    assert events[-1] == "[DONE]"
    chunks = [json.loads(e) for e in events[:-1]]
    assert all(c["object"] == "chat.completion.chunk" and c["model"] == MODEL for c in chunks)
    assert chunks[-1]["choices"][0]["finish_reason"] in ("stop", "length")
    streamed = "".join(c["choices"][0]["delta"].get("content") or "" for c in chunks)
    assert streamed == greedy_answer(server) and len(chunks) > 2  # greedy, as the Python example below


def greedy_answer(server) -> str:
    """The README examples' chat, answered greedily through the official client, not streamed."""
    reference = openai.OpenAI(base_url=f"{server.url()}/predictions/{MODEL}/1.0/v1", api_key=server.key,
                              max_retries=0)
    answer = reference.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "What does a function return?"}], max_tokens=40,
        temperature=0).choices[0].message.content
    assert answer.strip(), "the greedy answer is empty: the examples would show nothing"
    return answer


def test_the_readme_openai_client_example(server):
    script = pointed_at(readme_block("python", "from openai import OpenAI"), server)
    out = subprocess.run([sys.executable, "-c", script], cwd=ROOT, capture_output=True, text=True, timeout=120,
                         check=True)
    assert out.stdout.strip() == greedy_answer(server).strip()
