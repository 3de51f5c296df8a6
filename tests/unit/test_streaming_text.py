"""Incremental detokenization and the batched streamer, on the embedded model's byte-level BPE."""
import random

import pytest
import torch

from llama_engine import GenerationRequest, SamplingParams
from llama_engine.detokenizer import IncrementalDetokenizer, decoder_of
from llama_engine.lifecycle import Limits, PreparedRequest, RequestLifecycle
from llama_engine.stopping import FINISH_EOS, FINISH_LENGTH, StoppingCriteria
from llama_engine.streamer import BatchTextStreamer

TEXTS = [
    "Hello world, this is plain English.",
    "I like 🦙 and 🎉 very much",
    "你好，世界。日本語のテキスト",
    "def f(x):\n    return x**2  # code",
    "emoji at the end 👍🏽",
]


def stream_pieces(tokenizer, prompt, text):
    prompt_ids = tokenizer(prompt)["input_ids"]
    ids = tokenizer(text, add_special_tokens=False)["input_ids"]
    detok = IncrementalDetokenizer(tokenizer, prompt_ids)
    pieces = [detok.add(i) for i in ids]
    pieces.append(detok.flush())
    return ids, pieces


@pytest.mark.parametrize("text", TEXTS)
def test_pieces_join_to_the_text_and_never_hold_replacement_chars(tokenizer, text):
    ids, pieces = stream_pieces(tokenizer, "Prompt:", text)
    assert "".join(pieces) == text
    assert all("\ufffd" not in p for p in pieces)


def test_split_emoji_is_held_back_until_complete(tokenizer):
    ids, pieces = stream_pieces(tokenizer, "x", "🦙")
    assert len(ids) > 1, "the test needs an emoji that spans several tokens"
    assert pieces[:-2] == [""] * (len(ids) - 1) or "".join(pieces) == "🦙"
    released = [p for p in pieces if p]
    assert released == ["🦙"]


def test_cjk_streams_without_waiting_for_a_space(tokenizer):
    _, pieces = stream_pieces(tokenizer, "x", "你好世界你好世界")
    # Text is released before the end although there is no whitespace at all.
    assert sum(1 for p in pieces[:-1] if p) >= 2


def test_no_prompt_echo(tokenizer):
    _, pieces = stream_pieces(tokenizer, "The prompt text", " and the answer")
    assert "".join(pieces) == " and the answer"


def test_the_fast_tokenizers_own_decoder_gives_transformers_text(tokenizer):
    rng = random.Random(0)
    decode = decoder_of(tokenizer)
    samples = [[rng.randrange(len(tokenizer)) for _ in range(rng.randrange(1, 9))] for _ in range(2000)]
    samples += [[tokenizer.bos_token_id, *ids, tokenizer.eos_token_id] for ids in samples[:50]]
    for ids in samples:
        assert decode(ids) == tokenizer.decode(ids, skip_special_tokens=True, clean_up_tokenization_spaces=False)


class SlowTokenizer:
    """A tokenizer without a Rust backend (a sentencepiece ``LlamaTokenizer``): only ``decode``."""

    def __init__(self, fast):
        self.fast = fast
        self.calls = []

    def decode(self, ids, **kwargs):
        self.calls.append(kwargs)
        return self.fast.decode(ids, **kwargs)


@pytest.mark.parametrize("text", TEXTS[1:3])
def test_a_tokenizer_without_a_backend_decodes_through_its_own_decode(tokenizer, text):
    slow = SlowTokenizer(tokenizer)
    ids = tokenizer(text, add_special_tokens=False)["input_ids"]
    detok = IncrementalDetokenizer(slow, tokenizer("x")["input_ids"])
    assert "".join([detok.add(i) for i in ids] + [detok.flush()]) == text
    assert slow.calls and all(c == {"skip_special_tokens": True, "clean_up_tokenization_spaces": False}
                              for c in slow.calls)


def make_row(tokenizer, max_new_tokens, prompt="Hi"):
    """A request's generation, as either batching mode starts it."""
    prompt_ids = tokenizer(prompt)["input_ids"]
    request = GenerationRequest(prompt, SamplingParams(max_new_tokens=max_new_tokens))
    return RequestLifecycle(tokenizer, Limits(256)).start(PreparedRequest(request, prompt_ids, max_new_tokens))


def test_batch_streamer_routes_tokens_and_stops_rows_independently(tokenizer):
    events = []
    a = tokenizer(" one two three", add_special_tokens=False)["input_ids"]
    b = tokenizer(" 你好", add_special_tokens=False)["input_ids"]
    streamer = BatchTextStreamer([make_row(tokenizer, 2), make_row(tokenizer, 10), None], events.extend)
    eos = tokenizer.eos_token_id
    steps = max(len(a), len(b)) + 1
    for step in range(steps):
        col = [a[step] if step < len(a) else eos, b[step] if step < len(b) else eos, 0]
        streamer.put_rows(range(3), torch.tensor(col))
        if streamer.finished:
            break
    results = streamer.results()
    assert results[2] is None
    assert results[0].finish_reason == FINISH_LENGTH and results[0].generated_tokens == 2
    assert results[0].text == tokenizer.decode(a[:2])
    assert results[1].finish_reason == FINISH_EOS and results[1].text == " 你好"
    assert {e.row for e in events} == {0, 1}
    assert "".join(e.text for e in events if e.row == 1) == " 你好"
    assert sum(1 for e in events if e.finished) == 2


def test_a_shrunken_batch_routes_each_token_to_its_row(tokenizer):
    """After finished rows leave the running batch, ``put_rows`` names the rows still in it."""
    events = []
    a = tokenizer(" one two three four", add_special_tokens=False)["input_ids"]
    b = tokenizer(" alpha beta gamma delta", add_special_tokens=False)["input_ids"]
    streamer = BatchTextStreamer([make_row(tokenizer, 1), make_row(tokenizer, 3), make_row(tokenizer, 3)],
                                 events.extend)
    streamer.put_rows([0, 1, 2], torch.tensor([a[0], a[0], b[0]]))
    assert streamer.active_rows == [1, 2]
    streamer.put_rows([1, 2], torch.tensor([a[1], b[1]]), [-0.5, -1.5])
    streamer.put_rows([1, 2], torch.tensor([a[2], b[2]]))
    assert streamer.finished
    results = streamer.results()
    assert results[1].token_ids == a[:3] and results[2].token_ids == b[:3]
    assert results[1].logprobs[1] == -0.5 and results[2].logprobs[1] == -1.5
    assert [e.row for e in events] == [0, 1, 2, 1, 2, 1, 2]


def test_stopping_criteria():
    stop = StoppingCriteria(frozenset({2}), 3)
    assert stop(5, 1) == (False, None)
    assert stop(2, 1) == (True, FINISH_EOS)
    assert stop(5, 3) == (True, FINISH_LENGTH)
