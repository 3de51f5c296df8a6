"""Continuous batching on Neuron: NeuronSlotBackend and the scheduler, against the SDK test double.

The double (tests/neuron_double) runs the tiny HF Llama on CPU behind the real
transformers-neuronx continuous-batching calls: context graphs that always start at
position 0 and stop at the largest bucket, a token graph that always runs every slot and
writes a padding row (token 0 at position 0) into each slot missing from the call.
"""
from __future__ import annotations

import dataclasses

import pytest
import torch
import yaml

from llama_engine import GenerationRequest, RequestError, SamplingParams, load_model_config
from llama_engine.backends import create_slot_backend
from llama_engine.backends.base import PromptTooLong
from llama_engine.backends.torch_backend import TorchSlotBackend
from llama_engine.continuous import ContinuousScheduler
from llama_engine.lifecycle import FINISH_ERROR, RequestStatus, request_error

from conftest import ROOT
from neuron_env import neuron_double

CONFIG = ROOT / "model-config" / "tiny-llama-neuron.yaml"  # buckets [32, 64], n_positions [256], tp 2
SLOTS = 4
PROMPTS = [
    "The function returns",
    "If the object is a list of values, then",
    "A",
    "Errors should never pass silently. Unless explicitly silenced. In the face of ambiguity",
    "def main():",
    "Once upon a time there was",
]
LONG_PROMPT = " ".join(["Beautiful is better than ugly. Explicit is better than implicit."] * 6)


def neuron_cfg(model_dir):
    cfg = load_model_config(yaml.safe_load(CONFIG.read_text())).handler
    cfg.model_path = model_dir.name
    return cfg


@pytest.fixture(scope="module")
def backend(tiny_model_dir, tmp_path_factory):
    """NeuronSlotBackend over the double, built the way the handler builds it."""
    work = tmp_path_factory.mktemp("neuron-cb")
    with neuron_double(NEURON_COMPILE_CACHE_URL=str(work / "neuron-cache")):
        yield create_slot_backend(neuron_cfg(tiny_model_dir), str(tiny_model_dir.parent), SLOTS,
                                  build_cache_dir=str(work / "build-cache"))


@pytest.fixture()
def fresh(backend):
    """The module's backend with every slot free (a failed test must not leak into the next)."""
    for slot in range(backend.max_slots):
        backend.free_slot(slot)
    return backend


def prepare(engine, prompt, max_new_tokens=12):
    return engine.prepare(GenerationRequest(prompt, SamplingParams(max_new_tokens=max_new_tokens)))


_alone = {}


def alone(engine, prompt, max_new_tokens):
    """The static torch engine's greedy output for the request served by itself."""
    key = (prompt, max_new_tokens)
    if key not in _alone:
        _alone[key] = engine.generate([prepare(engine, prompt, max_new_tokens)])[0]
    return _alone[key]


def drain(scheduler, limit=2000):
    for _ in range(limit):
        if not scheduler.step():
            break
    assert scheduler.idle
    assert scheduler.free_slots == list(range(scheduler.max_slots)), "a slot leaked"


def run_interleaved(engine, backend, arrivals, lengths, **kw):
    """Submit ``arrivals`` (step -> request indexes) while stepping; return the handles."""
    sched = ContinuousScheduler(backend, engine.tokenizer, max_queue=16, **kw)
    handles = {}
    for step in range(500):
        for i in arrivals.get(step, []):
            handles[i] = sched.submit(prepare(engine, PROMPTS[i], lengths[i]))
        if not sched.step() and step > max(arrivals):
            break
    drain(sched)
    return handles


# ----- the build


def test_builds_the_sdk_continuous_batching_model(backend):
    model = backend.model
    assert type(backend).__name__ == "NeuronSlotBackend"
    assert model.ignored_kwargs == {}
    cb = model.neuron_config.continuous_batching
    assert cb.max_num_seqs == cb.batch_size_for_shared_caches == SLOTS
    assert model.neuron_config.padding_side == "right" and model.neuron_config.use_2d_cache_ids
    assert model.neuron_config.group_query_attention.value == "shard-over-heads"
    assert model.batch_sizes == [SLOTS] and model.context_batch_sizes == [1]
    graphs = [(e["graph"], e["bucket"], e["batch_size"]) for e in model.compile_log]
    assert graphs == [("context", 32, 1), ("context", 64, 1), ("token", 256, SLOTS)]
    assert backend.compile_session is not None
    assert (backend.max_slots, backend.max_length) == (SLOTS, 256)
    assert backend.max_prefill_chunk == backend.max_prompt_length == 64
    assert backend.incremental_prefill is False


def test_the_double_enforces_the_continuous_batching_build(tiny_model_dir, tmp_path):
    with neuron_double(NEURON_COMPILE_CACHE_URL=str(tmp_path / "cache")):
        from transformers_neuronx import NeuronAutoModelForCausalLM, NeuronConfig
        from transformers_neuronx.config import ContinuousBatchingConfig

        with pytest.raises(AssertionError, match="unexpected key word arguments"):
            ContinuousBatchingConfig(batch_size_for_shared_caches=SLOTS, max_slots=SLOTS)
        with pytest.raises(KeyError):
            ContinuousBatchingConfig(num_seqs=SLOTS)
        with pytest.raises(AssertionError, match="Unexpected NeuronConfig keyword"):
            NeuronConfig(continuous_batching=ContinuousBatchingConfig(max_num_seqs=SLOTS), padding="right")
        cb = NeuronConfig(continuous_batching=ContinuousBatchingConfig(max_num_seqs=SLOTS))
        assert cb.padding_side == "right"  # forced, as in the real NeuronConfig
        with pytest.raises(AssertionError, match="invalid batch_size_for_shared_caches"):
            NeuronAutoModelForCausalLM.from_pretrained(str(tiny_model_dir), batch_size=SLOTS - 1, n_positions=[256],
                                                       context_length_estimate=[32], neuron_config=cb)


# ----- the SDK's continuous-batching calls, as the double enforces them


def hf_next_logits(model, ids):
    with torch.inference_mode():
        return model(torch.tensor([ids])).logits[0, -1].float()


def test_decode_of_some_slots_leaves_the_others_intact(engine, fresh, hf_model):
    """The token graph runs every slot; the backend must keep the slots it does not advance."""
    tok = engine.tokenizer
    a, b = tok(PROMPTS[3])["input_ids"], tok(PROMPTS[0])["input_ids"]
    torch.testing.assert_close(fresh.prefill_slot(2, a), hf_next_logits(hf_model, a), atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(fresh.prefill_slot(0, b), hf_next_logits(hf_model, b), atol=1e-4, rtol=1e-4)
    for token in (5, 6, 7):  # slot 0 waits while slot 2 decodes
        torch.testing.assert_close(fresh.decode_slots([2], [token])[0], hf_next_logits(hf_model, a + [token]),
                                   atol=1e-4, rtol=1e-4)
        a = a + [token]
    fresh.prefill_slot(3, [b[0]])  # a one-token prompt while others hold sequences
    step = fresh.decode_slots([0, 2], [9, 8])  # slots out of compiled order come back in call order
    torch.testing.assert_close(step[0], hf_next_logits(hf_model, b + [9]), atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(step[1], hf_next_logits(hf_model, a + [8]), atol=1e-4, rtol=1e-4)
    assert [fresh.slot_length(s) for s in range(SLOTS)] == [len(b) + 1, 0, len(a) + 1, 1]


def test_the_double_overwrites_slots_missing_from_a_decode(engine, fresh, hf_model):
    """What the backend guards against: raw SDK calls that decode only slot 2 corrupt slot 0."""
    tok = engine.tokenizer
    model = fresh.model
    a, b = tok(PROMPTS[3])["input_ids"], tok(PROMPTS[0])["input_ids"]
    fresh.prefill_slot(0, b)
    fresh.prefill_slot(2, a)
    model.forward(torch.tensor([[5]]), cache_ids=torch.tensor([[len(a)]]), start_ids=torch.tensor([2]))
    got = model.forward(torch.tensor([[9]]), cache_ids=torch.tensor([[len(b)]]), start_ids=torch.tensor([0]))[0]
    assert not torch.allclose(got, hf_next_logits(hf_model, b + [9]), atol=1e-3)


def test_the_double_refuses_what_the_sdk_cannot_run(engine, fresh):
    model = fresh.model
    ids = engine.tokenizer(PROMPTS[3])["input_ids"]
    fresh.prefill_slot(1, ids[:4])
    rest = torch.tensor([ids[4:]])
    with pytest.raises(AssertionError, match="speculative forward"):  # a prefill continued at an offset
        model.forward(rest, cache_ids=torch.arange(4, len(ids))[None], start_ids=torch.tensor([1]))
    with pytest.raises(AssertionError, match="invalid input prompt length"):  # beyond the largest bucket
        model.forward(torch.ones(1, 65, dtype=torch.long), cache_ids=torch.arange(65)[None],
                      start_ids=torch.tensor([1]))
    with pytest.raises(RuntimeError):  # the SDK scatters cache_ids into a tensor of input_ids' dtype
        model.forward(torch.tensor([[5]]), cache_ids=torch.tensor([[4]], dtype=torch.int32),
                      start_ids=torch.tensor([1]))
    with pytest.raises(ValueError, match="repeat a slot"):
        model.forward(torch.tensor([[5], [6]]), cache_ids=torch.tensor([[4], [4]]), start_ids=torch.tensor([1, 1]))
    with pytest.raises(ValueError, match="never-written"):  # a decode past what the slot holds
        model.forward(torch.tensor([[5]]), cache_ids=torch.tensor([[6]]), start_ids=torch.tensor([1]))


def test_backend_prefill_checks(engine, fresh, hf_model):
    ids = engine.tokenizer(PROMPTS[3])["input_ids"]
    with pytest.raises(ValueError, match="prefill it first"):
        fresh.decode_slots([1], [5])
    fresh.prefill_slot(1, ids[:4])
    with pytest.raises(ValueError, match="cannot prefill from 2"):
        fresh.prefill_slot(1, ids[4:], start=2)
    # start > 0: the SDK cannot append at an offset, so the backend re-encodes from position 0
    torch.testing.assert_close(fresh.prefill_slot(1, ids[4:], start=4), hf_next_logits(hf_model, ids),
                               atol=1e-4, rtol=1e-4)
    long_ids = engine.tokenizer(LONG_PROMPT)["input_ids"]
    assert len(long_ids) > 64
    with pytest.raises(PromptTooLong, match="at most 64 tokens") as info:  # a plain error: no HTTP in a backend
        fresh.prefill_slot(0, long_ids)
    mapped = request_error(info.value)  # the engine answers it as the request's fault
    assert mapped.status == 400 and mapped.parameter == "inputs" and "at most 64 tokens" in mapped.message
    with pytest.raises(PromptTooLong, match="at most 64 tokens"):  # a continuation past the bucket as well
        fresh.prefill_slot(1, long_ids[:64 - len(ids) + 1], start=len(ids))
    assert fresh.slot_length(0) == 0 and fresh.slot_length(1) == len(ids)


# ----- through the scheduler


def test_interleaved_arrivals_equal_each_request_alone(engine, fresh, hf_model):
    """Arrivals at different steps; new prompts are prefilled while only the older slots decode.

    The scheduler prefills each Neuron prompt in one call (``incremental_prefill`` is False);
    the torch run chunks them 8 tokens a step."""
    lengths = [14, 6, 10, 12, 3, 9]
    arrivals = {0: [0, 1], 2: [2], 5: [3, 4], 9: [5]}
    handles = run_interleaved(engine, fresh, arrivals, lengths, max_slots=3, max_prefill_tokens_per_step=8)
    torch_backend = TorchSlotBackend(hf_model, max_slots=3, max_length=256)
    on_torch = run_interleaved(engine, torch_backend, arrivals, lengths, max_prefill_tokens_per_step=8)
    for i, prompt in enumerate(PROMPTS):
        ref = alone(engine, prompt, lengths[i])
        assert handles[i].error is None, handles[i].error
        assert handles[i].result.token_ids == ref.token_ids, f"request {i}"
        assert handles[i].result.text == ref.text and handles[i].result.finish_reason == ref.finish_reason
        assert on_torch[i].result.token_ids == handles[i].result.token_ids
    assert handles[3].first_token_step > 5  # it waited for a slot


def test_a_freed_slot_is_reused(engine, fresh):
    sched = ContinuousScheduler(fresh, engine.tokenizer, max_slots=2, max_prefill_tokens_per_step=64)
    first = sched.submit(prepare(engine, PROMPTS[3], 20))
    short = sched.submit(prepare(engine, PROMPTS[1], 2))
    while not short.done:
        sched.step()
    assert first.status is RequestStatus.RUNNING
    later = sched.submit(prepare(engine, PROMPTS[2], 10))  # takes the slot 'short' left, stale cache and all
    sched.step()
    assert later.slot == short.slot
    drain(sched)
    for handle, prompt, n in ((first, PROMPTS[3], 20), (short, PROMPTS[1], 2), (later, PROMPTS[2], 10)):
        assert handle.result.token_ids == alone(engine, prompt, n).token_ids


def test_a_prompt_longer_than_the_largest_bucket_fails_alone(engine, fresh):
    sched = ContinuousScheduler(fresh, engine.tokenizer, max_prefill_tokens_per_step=32)
    with pytest.raises(RequestError, match="limit is 64 tokens") as info:  # the scheduler reads max_prompt_length
        sched.prepare(GenerationRequest(LONG_PROMPT, SamplingParams(max_new_tokens=4)))
    assert info.value.status == 400
    # submit checks a request prepared elsewhere (here by the static engine) with the same rule
    with pytest.raises(RequestError, match="limit is 64 tokens") as info:
        sched.submit(prepare(engine, LONG_PROMPT, 4))
    assert info.value.status == 400 and sched.idle
    # one that got past the check anyway (limits that do not know the bucket) fails alone with the backend's error
    sched.lifecycle.limits = dataclasses.replace(sched.lifecycle.limits, max_prompt_length=None)
    ok = sched.submit(prepare(engine, PROMPTS[0], 8))
    too_long = sched.submit(prepare(engine, LONG_PROMPT, 4))
    drain(sched)
    assert too_long.result.finish_reason == FINISH_ERROR
    assert isinstance(too_long.error, RequestError) and "at most 64 tokens" in str(too_long.error)
    assert too_long.error.status == 400 and too_long.error.parameter == "inputs"
    assert ok.result.token_ids == alone(engine, PROMPTS[0], 8).token_ids
