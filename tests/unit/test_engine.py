"""The engine on the embedded tiny model (torch backend, CPU)."""
import pytest
import torch

from llama_engine import Engine, GenerationRequest, RequestError, SamplingParams
from llama_engine.backends.base import take_greedy_picks, with_greedy_picks
from llama_engine.config import HandlerConfig

PROMPTS = [
    "The function returns",
    "If the object is a list of values, then",
    "A",
    "Errors should never pass silently. Unless explicitly silenced. In the face of ambiguity",
]


@pytest.fixture(scope="module")
def engine(tiny_model_dir):
    torch.set_num_threads(2)
    cfg = HandlerConfig(model_path=tiny_model_dir.name, max_length=256, max_new_tokens=16)
    return Engine.from_config(cfg, str(tiny_model_dir.parent))


def run(engine, prompts, max_new_tokens=12, sink=None, **params):
    prepared = [engine.prepare(GenerationRequest(p, SamplingParams(max_new_tokens=max_new_tokens, **params)))
                for p in prompts]
    return engine.generate(prepared, sink)


def test_batched_greedy_equals_each_prompt_alone(engine):
    alone = [run(engine, [p])[0] for p in PROMPTS]
    batched = run(engine, PROMPTS)
    for a, b in zip(alone, batched):
        assert b.token_ids == a.token_ids
        assert b.text == a.text
    assert len({r.text for r in batched}) > 1


def test_rows_stop_on_their_own_max_new_tokens(engine):
    prepared = [engine.prepare(GenerationRequest(p, SamplingParams(max_new_tokens=n)))
                for p, n in zip(PROMPTS, (3, 9, 1, 5))]
    results = engine.generate(prepared)
    assert [r.generated_tokens for r in results] == [3, 9, 1, 5]
    assert all(r.finish_reason == "length" for r in results)
    assert results[0].token_ids == run(engine, [PROMPTS[0]], max_new_tokens=9)[0].token_ids[:3]


def test_rows_stop_on_eos(engine):
    eos = engine.tokenizer.eos_token_id
    original = engine.backend.decode
    calls = []

    def decode_forcing_eos_in_row_0(tokens):
        logits = original(tokens)
        if not calls:  # the first decode step: the batch still holds both rows
            take_greedy_picks(logits)  # the logits change: picks made from them no longer hold
            logits[0, eos] = 1e9
        calls.append(len(tokens))
        return logits

    engine.backend.decode = decode_forcing_eos_in_row_0
    try:
        results = run(engine, PROMPTS[:2], max_new_tokens=6)
    finally:
        engine.backend.decode = original
    assert results[0].finish_reason == "eos_token" and results[0].generated_tokens == 2
    assert results[1].finish_reason == "length" and results[1].generated_tokens == 6
    assert calls[0] == 2 and set(calls[1:]) == {1}, "the finished row leaves the running batch"


def test_stream_events_rebuild_each_rows_text(engine):
    events = []
    results = run(engine, PROMPTS, max_new_tokens=10, sink=events.extend)
    for row, result in enumerate(results):
        row_events = [e for e in events if e.row == row]
        assert "".join(e.text for e in row_events) == result.text
        assert [e.token_id for e in row_events] == result.token_ids
        assert row_events[-1].finished and not any(e.finished for e in row_events[:-1])


def test_fixed_batch_size_backend_pads_and_ignores_padding_rows(engine, monkeypatch):
    expected = run(engine, PROMPTS[:3])
    monkeypatch.setattr(engine.backend, "batch_sizes", (4, 8), raising=False)
    monkeypatch.setattr(engine.backend, "retain", lambda rows: False)
    seen = []
    original = engine.backend.prefill
    monkeypatch.setattr(engine.backend, "prefill", lambda ids, mask: seen.append(ids.shape) or original(ids, mask))
    got = run(engine, PROMPTS[:3])
    assert seen[0][0] == 4
    assert [r.token_ids for r in got] == [r.token_ids for r in expected]


def test_plain_greedy_rows_take_the_backends_picks_and_others_select_from_the_logits(engine, monkeypatch):
    """Where the backend attached greedy picks to a decode step's logits, a batch of plain greedy rows takes them
    as they are (no selection over the logits); a batch where a row asks for top log-probabilities selects every
    row from the logits. The picks here are marked (token 7 at -0.25) so that the two ways differ."""
    original = engine.backend.decode

    def marked(next_tokens):
        logits = original(next_tokens)
        take_greedy_picks(logits)
        return with_greedy_picks(logits, [7] * logits.shape[0], [-0.25] * logits.shape[0])

    unmarked = run(engine, PROMPTS[:2], max_new_tokens=4)
    monkeypatch.setattr(engine.backend, "decode", marked)
    greedy = run(engine, PROMPTS[:2], max_new_tokens=4)
    assert [r.token_ids[1:] for r in greedy] == [[7] * 3] * 2 and [r.logprobs[1:] for r in greedy] == [[-0.25] * 3] * 2
    assert [r.token_ids[0] for r in greedy] == [r.token_ids[0] for r in unmarked]  # the prefill's: no picks
    prepared = [engine.prepare(GenerationRequest(PROMPTS[0], SamplingParams(max_new_tokens=4))),
                engine.prepare(GenerationRequest(PROMPTS[1], SamplingParams(max_new_tokens=4, logprobs=2)))]
    assert [r.token_ids for r in engine.generate(prepared)] == [r.token_ids for r in unmarked]


def test_seeded_sampling_same_alone_and_batched(engine):
    alone = run(engine, [PROMPTS[1]], do_sample=True, temperature=0.9, seed=1234)[0]
    prepared = [engine.prepare(GenerationRequest(PROMPTS[0], SamplingParams(max_new_tokens=12))),
                engine.prepare(GenerationRequest(PROMPTS[1], SamplingParams(max_new_tokens=12, do_sample=True,
                                                                          temperature=0.9, seed=1234)))]
    assert engine.generate(prepared)[1].token_ids == alone.token_ids


def test_prompt_over_max_length_is_a_request_error(engine):
    with pytest.raises(RequestError) as info:
        engine.prepare(GenerationRequest("word " * 400))
    assert info.value.parameter == "inputs" and "limit is 255 tokens" in info.value.message


def test_max_new_tokens_over_room_names_the_parameter(engine):
    with pytest.raises(RequestError) as info:
        engine.prepare(GenerationRequest("Hello", SamplingParams(max_new_tokens=300)))
    assert info.value.parameter == "max_new_tokens" and info.value.status == 400


def test_default_max_new_tokens_comes_from_config(engine):
    assert engine.prepare(GenerationRequest("Hello")).max_new_tokens == 16
