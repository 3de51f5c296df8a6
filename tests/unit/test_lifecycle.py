"""One request's life (lifecycle.py): limits, error mapping, status, result; the same in both batching modes."""
from __future__ import annotations

from pathlib import Path

import pytest

from llama_engine import GenerationRequest, RequestError, SamplingParams
from llama_engine.backends.base import PromptTooLong
from llama_engine.backends.torch_backend import TorchSlotBackend
from llama_engine.continuous import ContinuousScheduler
from llama_engine.lifecycle import (
    FINISH_CANCELLED,
    FINISH_ERROR,
    Generation,
    Limits,
    PreparedRequest,
    RequestLifecycle,
    RequestStatus,
    request_error,
)
from llama_engine.stopping import FINISH_EOS, FINISH_LENGTH, FINISH_STOP

BACKENDS = Path(__file__).resolve().parents[2] / "handlers" / "llama_engine" / "backends"


def lifecycle(tokenizer, **limits) -> RequestLifecycle:
    limits.setdefault("max_length", 64)
    return RequestLifecycle(tokenizer, Limits(**limits))


def start(tokenizer, prompt="Hi", max_new_tokens=4, **params) -> Generation:
    life = lifecycle(tokenizer)
    return life.start(life.prepare(GenerationRequest(prompt, SamplingParams(max_new_tokens=max_new_tokens, **params))))


def words(tokenizer, text):
    return tokenizer(text, add_special_tokens=False)["input_ids"]


# ----- limits: one function, every rule


def test_limits_default_is_cut_to_the_room_left():
    limits = Limits(max_length=64, default_max_new_tokens=20)
    assert limits.check(10, None) == 20
    assert limits.check(50, None) == 14
    assert limits.check(63, None) == 1


def test_limits_take_an_answer_that_fits_exactly():
    assert Limits(max_length=64).check(10, 54) == 54


@pytest.mark.parametrize("prompt,new,field,parameter,message", [
    (0, 4, "inputs", "inputs", "the prompt has no tokens"),
    (64, None, "inputs", "inputs", "the prompt is 64 tokens; the limit is 63 tokens (handler.max_length 64"),
    (64, None, "messages", "messages", "the limit is 63 tokens"),
    (10, 55, "inputs", "max_new_tokens", "max_new_tokens is 55, but the prompt (10 tokens) leaves room for only 54 "
                                         "of handler.max_length 64"),
])
def test_limits_refuse_with_a_400_that_names_the_field(prompt, new, field, parameter, message):
    with pytest.raises(RequestError) as info:
        Limits(max_length=64).check(prompt, new, field)
    assert info.value.status == 400 and info.value.parameter == parameter and message in info.value.message


def test_limits_refuse_a_prompt_over_the_largest_compiled_bucket():
    limits = Limits(max_length=256, max_prompt_length=32)
    assert limits.check(32, 8) == 8
    with pytest.raises(RequestError, match=r"the prompt is 33 tokens; the limit is 32 tokens \(the largest compiled "
                                           r"context bucket") as info:
        limits.check(33, 8)
    assert info.value.parameter == "inputs"


def test_limits_of_a_backend_read_its_shapes():
    class Shaped:
        max_length, max_prompt_length = 256, 64

    assert Limits.of(Shaped(), 16) == Limits(256, 64, 16)


def test_prepare_checks_once_and_names_the_prompt_field_of_a_chat(tokenizer):
    life = lifecycle(tokenizer, max_length=16)
    with pytest.raises(RequestError) as info:
        life.prepare(GenerationRequest(messages=[{"role": "user", "content": "word " * 40}]))
    assert info.value.parameter == "messages"
    prepared = life.prepare(GenerationRequest("Hi", SamplingParams(max_new_tokens=3)))
    assert prepared.max_new_tokens == 3 and prepared.limits == life.limits


def test_each_request_is_checked_once_in_both_batching_modes(engine, tokenizer, monkeypatch, hf_model):
    """The static engine checks in ``prepare``; the scheduler's ``submit`` checks again only a request
    prepared against other limits (another engine's, or one made by hand)."""
    calls = []
    check = Limits.check
    monkeypatch.setattr(Limits, "check", lambda self, *a: calls.append(self) or check(self, *a))
    request = GenerationRequest("The function returns", SamplingParams(max_new_tokens=4))
    engine.prepare(request)
    assert len(calls) == 1
    scheduler = ContinuousScheduler(TorchSlotBackend(hf_model, max_slots=2, max_length=128), tokenizer)
    calls.clear()
    scheduler.submit(scheduler.prepare(request))
    assert len(calls) == 1
    calls.clear()
    scheduler.submit(engine.prepare(request))  # the engine's limits (max_length 256) are not the slots'
    assert calls == [engine.lifecycle.limits, scheduler.lifecycle.limits]
    calls.clear()
    scheduler.submit(PreparedRequest(request, [1, 2, 3], 4))
    assert calls == [scheduler.lifecycle.limits]


def test_both_batching_modes_refuse_with_the_same_words(engine, tokenizer, hf_model):
    backend = TorchSlotBackend(hf_model, max_slots=2, max_length=engine.backend.max_length)
    scheduler = ContinuousScheduler(backend, tokenizer, default_max_new_tokens=16)
    request = GenerationRequest("word " * 400)
    with pytest.raises(RequestError) as static:
        engine.prepare(request)
    with pytest.raises(RequestError) as continuous:
        scheduler.prepare(request)
    assert static.value.to_dict() == continuous.value.to_dict()


def test_warmup_requests_have_prompts_of_exactly_each_length(tokenizer):
    life = lifecycle(tokenizer, max_length=64)
    short, *per_length = life.warmup_requests(max_new_tokens=8, prompt_lengths=(1, 32, 60))
    assert short.request.prompt == "Warm-up" and short.max_new_tokens == 8
    assert [len(p.prompt_ids) for p in per_length] == [1, 32, 60]
    assert [p.max_new_tokens for p in per_length] == [8, 8, 4]  # cut to the room left


# ----- errors: backends raise plain ones, the engine maps them


def test_a_request_error_is_answered_as_it_is():
    error = RequestError("bad top_k", "top_k")
    assert request_error(error) is error


def test_a_prompt_too_long_for_the_backend_is_the_requests_fault():
    cause = PromptTooLong("the prompt has 80 tokens; at most 64")
    assert isinstance(cause, ValueError) and not isinstance(cause, RequestError)
    mapped = request_error(cause, GenerationRequest("x"))
    assert (mapped.status, mapped.parameter, mapped.message) == (400, "inputs", str(cause))
    assert mapped.__cause__ is cause
    chat = request_error(cause, GenerationRequest(messages=[{"role": "user", "content": "x"}]))
    assert chat.parameter == "messages"


def test_any_other_error_failed_the_generation():
    cause = RuntimeError("device lost")
    mapped = request_error(cause)
    assert mapped.status == 500 and mapped.message == "generation failed: device lost"
    assert mapped.to_dict()["error_type"] == "generation" and mapped.__cause__ is cause


def test_no_backend_knows_of_http_errors():
    for module in BACKENDS.glob("*.py"):
        assert "RequestError" not in module.read_text(), f"{module.name} raises an HTTP-aware error"


# ----- status


def test_a_request_walks_waiting_prefilling_running_finished(tokenizer):
    generation = start(tokenizer, max_new_tokens=2)
    assert generation.status is RequestStatus.WAITING and not generation.done
    generation.admit()
    assert generation.status is RequestStatus.PREFILLING
    generation.start_decoding()
    assert generation.status is RequestStatus.RUNNING
    ids = words(tokenizer, " one two")
    assert not generation.add(ids[0]).finished
    last = generation.add(ids[1])
    assert last.finished and generation.done and generation.status is RequestStatus.FINISHED
    assert last.result is generation.result and generation.result.finish_reason == FINISH_LENGTH


@pytest.mark.parametrize("steps,illegal", [
    ((), "start_decoding"),  # waiting -> running skips the prefill
    (("admit",), "admit"),
    (("admit", "start_decoding"), "admit"),
    (("admit", "start_decoding"), "start_decoding"),
    (("cancel",), "cancel"),  # over is over
    (("cancel",), "admit"),
])
def test_illegal_moves_are_refused(tokenizer, steps, illegal):
    generation = start(tokenizer)
    for step in steps:
        getattr(generation, step)()
    before = generation.status
    with pytest.raises(RuntimeError, match="request cannot become"):
        getattr(generation, illegal)()
    assert generation.status is before


@pytest.mark.parametrize("steps", [(), ("admit",), ("admit", "start_decoding")],
                         ids=["waiting", "prefilling", "running"])
def test_any_live_request_can_be_cancelled_or_fail(tokenizer, steps):
    for end in ("cancel", "fail"):
        generation = start(tokenizer)
        for step in steps:
            getattr(generation, step)()
        result = generation.cancel() if end == "cancel" else generation.fail(RuntimeError("device lost"))
        assert generation.done and result is generation.result
        if end == "cancel":
            assert result.finish_reason == FINISH_CANCELLED and generation.error is None
        else:
            assert result.finish_reason == FINISH_ERROR and generation.error.status == 500


def test_status_is_an_enum_not_a_string():
    assert [s.name for s in RequestStatus] == ["WAITING", "PREFILLING", "RUNNING", "FINISHED"]
    assert RequestStatus.RUNNING != "running"


def test_the_scheduler_moves_its_requests_through_the_same_states(engine, tokenizer, hf_model):
    backend = TorchSlotBackend(hf_model, max_slots=1, max_length=128)
    scheduler = ContinuousScheduler(backend, tokenizer, max_queue=4, max_prefill_tokens_per_step=2)
    first = scheduler.submit(scheduler.prepare(GenerationRequest("The function returns a value",
                                                                 SamplingParams(max_new_tokens=3))))
    second = scheduler.submit(scheduler.prepare(GenerationRequest("A", SamplingParams(max_new_tokens=2))))
    assert first.status is second.status is RequestStatus.WAITING
    scheduler.step()  # two prompt tokens of the first: its prompt is longer
    assert first.status is RequestStatus.PREFILLING and second.status is RequestStatus.WAITING
    seen = set()
    while scheduler.step():
        seen.add(first.status)
    assert RequestStatus.RUNNING in seen
    assert first.status is second.status is RequestStatus.FINISHED
    assert [first.result.generated_tokens, second.result.generated_tokens] == [3, 2]


def test_the_static_engine_finishes_every_generation_it_starts(engine, monkeypatch):
    started = []
    original = engine.lifecycle.start
    monkeypatch.setattr(engine.lifecycle, "start", lambda p: started.append(original(p)) or started[-1])
    prompts = ["The function returns", "A"]
    engine.generate([engine.prepare(GenerationRequest(p, SamplingParams(max_new_tokens=3))) for p in prompts])
    assert len(started) == 2 and all(g.status is RequestStatus.FINISHED for g in started)


# ----- tokens and the result


def test_the_result_counts_the_prompt_and_the_answer(tokenizer):
    generation = start(tokenizer, "The function returns", max_new_tokens=3)
    prompt_tokens = len(generation.prepared.prompt_ids)
    events = [generation.add(t) for t in words(tokenizer, " a list of")[:3]]
    result = generation.result
    assert (result.prompt_tokens, result.generated_tokens) == (prompt_tokens, 3)
    assert result.text == "".join(e.text for e in events) == "".join(result.token_texts)
    assert [e.index for e in events] == [1, 2, 3]


def test_eos_ends_the_request_and_is_a_special_token(tokenizer):
    generation = start(tokenizer, max_new_tokens=10)
    generation.add(words(tokenizer, " one")[0])
    event = generation.add(tokenizer.eos_token_id)
    assert event.finished and event.special and generation.result.finish_reason == FINISH_EOS
    assert generation.result.special == [False, True]


def test_a_stop_sequence_ends_the_request_and_is_not_returned(tokenizer):
    generation = start(tokenizer, max_new_tokens=20, stop=[" two"])
    for token in words(tokenizer, " one two three"):
        event = generation.add(token)
        if event.finished:
            break
    assert generation.result.finish_reason == FINISH_STOP and generation.result.text == " one"


def test_a_cancelled_request_keeps_what_it_streamed(tokenizer):
    generation = start(tokenizer, max_new_tokens=10)
    texts = [generation.add(t).text for t in words(tokenizer, " one two")]
    result = generation.cancel()
    assert result.text == "".join(texts) and result.generated_tokens == 2


def test_a_sampled_request_reports_its_seed(tokenizer):
    assert start(tokenizer, do_sample=True, seed=7).cancel().seed == 7
    assert start(tokenizer).cancel().seed is None


def test_top_logprobs_only_when_asked(tokenizer):
    plain = start(tokenizer)
    assert plain.add(words(tokenizer, " one")[0]).top_logprobs is None
    asked = start(tokenizer, logprobs=2)
    asked.selector.top = [(5, -0.1), (6, -2.0)]
    event = asked.add(5, -0.1)
    assert event.top_logprobs.logprob == -0.1 and len(event.top_logprobs.top) == 2
    assert asked.cancel().top_logprobs == [event.top_logprobs]
