"""The stream client's line reassembly: NDJSON split across SageMaker PayloadParts at any byte."""
import json
import random

import pytest

from scripts.stream import LineIterator, iter_messages

LINES = [{"token": {"id": 1, "text": "Hello", "logprob": -0.1, "special": False}},
         {"token": {"id": 2, "text": " 🦙🎉", "logprob": -0.2, "special": False}},
         {"token": {"id": 3, "text": " 你好，世界", "logprob": -0.3, "special": False}},
         {"token": {"id": 4, "text": "\n", "logprob": -0.4, "special": False}, "generated_text": "Hello 🦙🎉 你好，世界\n",
          "details": {"finish_reason": "length", "generated_tokens": 4, "input_length": 2, "seed": None}}]
BODY = "".join(json.dumps(line, ensure_ascii=False) + "\n" for line in LINES).encode("utf-8")


def split_at(data: bytes, cuts):
    bounds = [0, *sorted(cuts), len(data)]
    return [data[a:b] for a, b in zip(bounds, bounds[1:])]


def as_events(parts):
    return [{"PayloadPart": {"Bytes": p}} for p in parts]


@pytest.mark.parametrize("seed", range(40))
def test_random_splits_reassemble_every_line(seed):
    rng = random.Random(seed)
    cuts = rng.sample(range(1, len(BODY)), rng.randint(1, 30))
    assert list(iter_messages(as_events(split_at(BODY, cuts)))) == LINES


def test_every_single_byte_cut_including_inside_multibyte_characters():
    emoji_start = BODY.index("🦙".encode())
    for cut in range(emoji_start - 2, emoji_start + 6):
        assert list(iter_messages(split_at(BODY, [cut]))) == LINES
    assert list(iter_messages([bytes([b]) for b in BODY])) == LINES


def test_several_lines_in_one_part_and_a_last_line_without_newline():
    assert list(LineIterator([b"a\nb\nc", b"d"])) == [b"a", b"b", b"cd"]


def test_sse_events_parse_too():
    events = b'data: {"index": 1}\n\ndata: {"index": 2}\n\n'
    assert list(iter_messages(split_at(events, [7, 20]))) == [{"index": 1}, {"index": 2}]


def test_stream_errors_raise():
    with pytest.raises(RuntimeError, match="ModelStreamError: boom"):
        list(LineIterator([{"ModelStreamError": {"Message": "boom", "ErrorCode": "x"}}]))
