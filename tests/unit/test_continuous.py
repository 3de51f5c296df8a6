"""Continuous batching in-process: the slot KV cache and the scheduler, on the tiny model (CPU)."""
import math

import pytest
import torch

from llama_engine import GenerationRequest, RequestError, SamplingParams
from llama_engine.backends.torch_backend import TorchSlotBackend
from llama_engine.continuous import ContinuousScheduler
from llama_engine.lifecycle import FINISH_CANCELLED, FINISH_ERROR, PreparedRequest, RequestStatus

MAX_LENGTH = 256
PROMPTS = [
    "The function returns",
    "If the object is a list of values, then",
    "A",
    "Errors should never pass silently. Unless explicitly silenced. In the face of ambiguity",
    "def main():",
    "Once upon a time there was",
]
LONG_PROMPT = " ".join(["Beautiful is better than ugly. Explicit is better than implicit."] * 3)


@pytest.fixture(scope="module")
def backend(hf_model):
    """Over the module's plain HF model (shared, so not fused); 4 slots."""
    return TorchSlotBackend(hf_model, max_slots=4, max_length=MAX_LENGTH)


def make_scheduler(engine, backend, **kw):
    kw.setdefault("max_slots", backend.max_slots)
    kw.setdefault("max_queue", 16)
    kw.setdefault("max_prefill_tokens_per_step", 64)
    return ContinuousScheduler(backend, engine.tokenizer, **kw)


def prepare(engine, prompt, max_new_tokens=12, **params):
    return engine.prepare(GenerationRequest(prompt, SamplingParams(max_new_tokens=max_new_tokens, **params)))


_alone_cache = {}


def alone(engine, prompt, max_new_tokens=12, **params):
    """The static engine's output for the request served by itself (the reference)."""
    key = (prompt, max_new_tokens, tuple(sorted((k, str(v)) for k, v in params.items())))
    if key not in _alone_cache:
        _alone_cache[key] = engine.generate([prepare(engine, prompt, max_new_tokens, **params)])[0]
    return _alone_cache[key]


class Events:
    """A callback that records one request's events and the scheduler step each arrived at."""

    def __init__(self, scheduler=None):
        self.scheduler = scheduler
        self.events, self.steps = [], []

    def __call__(self, event):
        self.events.append(event)
        self.steps.append(None if self.scheduler is None else self.scheduler.steps)

    @property
    def text(self):
        return "".join(e.text for e in self.events)

    @property
    def tokens(self):
        return [e.token_id for e in self.events if e.token_id is not None]


def drain(scheduler, limit=1000):
    for _ in range(limit):
        if not scheduler.step():
            break
    assert scheduler.idle
    assert scheduler.free_slots == list(range(scheduler.max_slots)), "a slot leaked"


# ----- the slot backend


def test_slot_backend_matches_hf_logits(engine, backend, hf_model):
    model = hf_model
    tok = engine.tokenizer
    a, b = tok(PROMPTS[3])["input_ids"], tok(PROMPTS[0])["input_ids"]
    with torch.inference_mode():
        ref_a = model(torch.tensor([a + [7, 8]])).logits[0]
        ref_b = model(torch.tensor([b + [9]])).logits[0]
    first = backend.prefill_slot(3, a[:5])  # chunked: 5 tokens, then the rest
    torch.testing.assert_close(first, ref_a[4], atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(backend.prefill_slot(3, a[5:], start=5), ref_a[len(a) - 1], atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(backend.prefill_slot(1, b), ref_b[len(b) - 1], atol=1e-4, rtol=1e-4)
    step = backend.decode_slots([3, 1], [7, 9])  # two rows at different positions, slots not contiguous
    torch.testing.assert_close(step[0], ref_a[len(a)], atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(step[1], ref_b[len(b)], atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(backend.decode_slots([3], [8])[0], ref_a[len(a) + 1], atol=1e-4, rtol=1e-4)
    assert backend.slot_length(3) == len(a) + 2
    for slot in (1, 3):
        backend.free_slot(slot)
    assert backend.slot_length(3) == 0
    with pytest.raises(ValueError, match="prefill it first"):
        backend.decode_slots([0], [5])


@pytest.mark.parametrize("waste", [0.0, 1.5, 1e9], ids=["row-by-row", "default", "batched-over-the-run"])
def test_decode_attention_plans_match_hf_logits(engine, waste, hf_model):
    """Rows out of slot order, a gap in the run, lengths far apart: each plan gives HF's logits.

    The gap slot holds a half-prefilled prompt that must be neither read nor written.
    """
    backend = TorchSlotBackend(hf_model, max_slots=4, max_length=MAX_LENGTH)
    backend.batched_attention_waste = waste
    model, tok = hf_model, engine.tokenizer
    prompts = {3: tok(LONG_PROMPT)["input_ids"], 0: tok(PROMPTS[2])["input_ids"], 1: tok(PROMPTS[1])["input_ids"]}
    gap = tok(PROMPTS[4])["input_ids"]
    followers = {3: [11, 12], 0: [13, 14], 1: [15, 16]}
    with torch.inference_mode():
        refs = {s: model(torch.tensor([ids + followers[s]])).logits[0] for s, ids in prompts.items()}
        gap_ref = model(torch.tensor([gap])).logits[0]
    for slot, ids in prompts.items():
        backend.prefill_slot(slot, ids)
    backend.prefill_slot(2, gap[:2])
    order = [3, 0, 1]
    for k in range(2):
        step = backend.decode_slots(order, [followers[s][k] for s in order])
        for row, slot in enumerate(order):
            torch.testing.assert_close(step[row], refs[slot][len(prompts[slot]) + k], atol=1e-4, rtol=1e-4)
    assert backend.slot_length(2) == 2
    torch.testing.assert_close(backend.prefill_slot(2, gap[2:], start=2), gap_ref[-1], atol=1e-4, rtol=1e-4)


def test_decode_attention_plan_follows_the_cost_rule(engine, hf_model):
    """Batched over the run while it reads <= 1.5x the K/V the rows need, else one call per row."""
    from llama_engine.backends.torch_backend import _RangeAttention, _RowAttention

    backend = TorchSlotBackend(hf_model, max_slots=8, max_length=MAX_LENGTH)
    def plan(slots, lengths):
        return backend._decode_attention(slots, lengths, torch.tensor(lengths).unsqueeze(1))

    assert isinstance(plan([0, 1, 2, 3], [40, 40, 40, 40]), _RangeAttention)
    assert plan([0, 1, 2, 3], [40, 40, 40, 40]).index is None
    assert isinstance(plan([0, 1, 3], [40, 40, 40]), _RangeAttention)  # 4 x 41 <= 1.5 x 123
    assert isinstance(plan([0, 7], [40, 40]), _RowAttention)  # 8 slots read for 2 rows
    assert isinstance(plan([0, 1, 2, 3], [200, 10, 10, 10]), _RowAttention)  # 4 x 201 > 1.5 x 234


@pytest.mark.parametrize("waste", [0.0, 1e9], ids=["row-by-row", "batched-over-the-run"])
def test_one_pass_with_chunks_and_decode_rows_matches_hf_logits(engine, waste, monkeypatch, hf_model):
    """``step_slots``: two prompt chunks (one new, one continued) and two decode rows, one forward pass."""
    from llama_engine.backends.base import PrefillChunk

    backend = TorchSlotBackend(hf_model, max_slots=4, max_length=MAX_LENGTH)
    backend.batched_attention_waste = waste
    model, tok = hf_model, engine.tokenizer
    running = {2: tok(PROMPTS[3])["input_ids"], 0: tok(PROMPTS[1])["input_ids"]}
    new, continued = tok(PROMPTS[5])["input_ids"], tok(LONG_PROMPT)["input_ids"]
    with torch.inference_mode():
        refs = {s: model(torch.tensor([ids + [21]])).logits[0, -1] for s, ids in running.items()}
        new_ref = model(torch.tensor([new])).logits[0, -1]
        continued_ref = model(torch.tensor([continued[:30]])).logits[0, -1]
    for slot, ids in running.items():
        backend.prefill_slot(slot, ids)
    backend.prefill_slot(3, continued[:10])
    passes = []
    forward = backend._forward
    monkeypatch.setattr(backend, "_forward", lambda *a: passes.append(len(a[0])) or forward(*a))
    out = backend.step_slots([2, 0], [21, 21], [PrefillChunk(1, new, 0), PrefillChunk(3, continued[10:30], 10)])
    assert passes == [2 + len(new) + 20], "the chunks and the rows were not one forward pass"
    for row, slot in enumerate([2, 0]):
        torch.testing.assert_close(out.decode[row], refs[slot], atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(out.prefills[0], new_ref, atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(out.prefills[1], continued_ref, atol=1e-4, rtol=1e-4)
    assert [backend.slot_length(s) for s in range(4)] == [len(running[0]) + 1, len(new), len(running[2]) + 1, 30]


@pytest.mark.parametrize("path", ["fused-ops", "torch-ops", "no-native-kernels"])
def test_the_last_layer_runs_only_the_rows_whose_logits_are_returned(engine, path, hf_model):
    """A pass of two chunks and two decode rows: the last layer's MLP sees the 4 rows with logits, the
    others every token; the logits are HF's, and the chunks' last-layer keys and values are all in
    the cache (the next decode step after them reads every one)."""
    from llama_engine.backends.base import PrefillChunk

    backend = TorchSlotBackend(hf_model, max_slots=4, max_length=MAX_LENGTH)
    if path != "fused-ops":
        backend._fused_ops = False
    if path == "no-native-kernels":
        backend._kernels = None
    tok, layers = engine.tokenizer, hf_model.model.layers
    running, new = tok(PROMPTS[1])["input_ids"], tok(PROMPTS[5])["input_ids"]
    continued = tok(LONG_PROMPT)["input_ids"][:30]
    with torch.inference_mode():
        ref_running = hf_model(torch.tensor([running + [21, 22]])).logits[0, -2:]
        ref_new = hf_model(torch.tensor([new + [23]])).logits[0, -2:]
        ref_continued = hf_model(torch.tensor([continued + [24]])).logits[0, -2:]
    backend.prefill_slot(0, running)
    backend.prefill_slot(3, continued[:10])
    rows = {0: [], len(layers) - 1: []}
    hooks = [layers[i].mlp.down_proj.register_forward_hook(lambda m, args, out, i=i: rows[i].append(args[0].shape[0]))
             for i in rows]
    try:
        out = backend.step_slots([0], [21], [PrefillChunk(1, new, 0), PrefillChunk(3, continued[10:], 10)])
    finally:
        for hook in hooks:
            hook.remove()
    assert rows == {0: [1 + len(new) + 20], len(layers) - 1: [3]}
    torch.testing.assert_close(out.decode[0], ref_running[0], atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(out.prefills[0], ref_new[0], atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(out.prefills[1], ref_continued[0], atol=1e-4, rtol=1e-4)
    step = backend.decode_slots([0, 1, 3], [22, 23, 24])
    for row, ref in enumerate((ref_running, ref_new, ref_continued)):
        torch.testing.assert_close(step[row], ref[1], atol=1e-4, rtol=1e-4)


def test_a_chunk_that_fails_its_checks_stays_out_of_the_pass(engine, hf_model):
    """A wrong start or a slot used twice gets its own ValueError; the rest of the step still runs."""
    from llama_engine.backends.base import PrefillChunk

    backend = TorchSlotBackend(hf_model, max_slots=4, max_length=MAX_LENGTH)
    model, tok = hf_model, engine.tokenizer
    a, b = tok(PROMPTS[0])["input_ids"], tok(PROMPTS[4])["input_ids"]
    with torch.inference_mode():
        ref_a, ref_b = model(torch.tensor([a + [5]])).logits[0, -1], model(torch.tensor([b])).logits[0, -1]
    backend.prefill_slot(0, a)
    out = backend.step_slots([0], [5], [PrefillChunk(1, b[:3], start=2), PrefillChunk(2, b, 0),
                                        PrefillChunk(0, b, len(a)), PrefillChunk(2, b, 0)])
    assert isinstance(out.prefills[0], ValueError) and "cannot prefill from 2" in str(out.prefills[0])
    for twice in out.prefills[2:]:  # a decoding slot, a slot already prefilled in this step
        assert isinstance(twice, ValueError) and "appears twice" in str(twice)
    assert backend.slot_length(1) == 0
    torch.testing.assert_close(out.prefills[1], ref_b, atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(out.decode[0], ref_a, atol=1e-4, rtol=1e-4)


def test_separate_calls_confine_a_failure_to_its_part(engine, monkeypatch, hf_model):
    """The base ``step_slots`` (for backends without a shared pass) runs each part on its own."""
    from llama_engine.backends.base import PrefillChunk, SlotBackend

    backend = TorchSlotBackend(hf_model, max_slots=4, max_length=MAX_LENGTH)
    tok = engine.tokenizer
    a, b = tok(PROMPTS[0])["input_ids"], tok(PROMPTS[4])["input_ids"]
    backend.prefill_slot(0, a)
    want = TorchSlotBackend(hf_model, max_slots=4, max_length=MAX_LENGTH).prefill_slot(2, b)
    prefill = backend.prefill_slot
    monkeypatch.setattr(backend, "prefill_slot",
                        lambda slot, ids, start=0: (_ for _ in ()).throw(RuntimeError("chunk lost")) if slot == 1
                        else prefill(slot, ids, start))
    out = SlotBackend.step_slots(backend, [0], [5], [PrefillChunk(1, b, 0), PrefillChunk(2, b, 0)])
    assert isinstance(out.prefills[0], RuntimeError)
    torch.testing.assert_close(out.prefills[1], want, atol=1e-5, rtol=1e-5)
    assert out.decode.shape == (1, want.shape[-1]) and backend.slot_length(0) == len(a) + 1


# ----- the scheduler


def test_interleaved_arrivals_equal_each_request_alone(engine, backend):
    """Requests arrive at different steps while others run; three slots, so some queue too."""
    sched = make_scheduler(engine, backend, max_slots=3, max_prefill_tokens_per_step=8)
    lengths = [14, 6, 10, 12, 3, 9]
    arrivals = {0: [0, 1], 2: [2], 5: [3, 4], 9: [5]}  # step -> requests submitted before it
    handles, events = {}, {}
    for step in range(200):
        for i in arrivals.get(step, []):
            events[i] = Events(sched)
            handles[i] = sched.submit(prepare(engine, PROMPTS[i], lengths[i]), events[i])
        if not sched.step() and step > max(arrivals):
            break
    drain(sched)
    for i, prompt in enumerate(PROMPTS):
        ref = alone(engine, prompt, lengths[i])
        result = handles[i].result
        assert result.token_ids == ref.token_ids, f"request {i}"
        assert result.text == ref.text and events[i].text == ref.text
        assert events[i].tokens == ref.token_ids
        assert result.finish_reason == ref.finish_reason
        assert [e.finished for e in events[i].events] == [False] * (len(events[i].events) - 1) + [True]
    assert handles[3].first_token_step > 5  # it waited for a slot


def test_an_admission_and_the_running_rows_share_one_forward_pass(engine, backend, monkeypatch):
    sched = make_scheduler(engine, backend)
    first = sched.submit(prepare(engine, PROMPTS[0], 6))
    sched.step()
    passes = []
    forward = backend._forward
    monkeypatch.setattr(backend, "_forward", lambda *a: passes.append(len(a[0])) or forward(*a))
    second = sched.submit(prepare(engine, PROMPTS[3], 6))
    sched.step()
    assert passes == [1 + len(second.prepared.prompt_ids)]
    assert len(first.token_ids) == 2 and len(second.token_ids) == 1
    monkeypatch.undo()
    drain(sched)
    assert first.result.token_ids == alone(engine, PROMPTS[0], 6).token_ids
    assert second.result.token_ids == alone(engine, PROMPTS[3], 6).token_ids


def test_short_request_finishes_before_a_long_one_that_started_earlier(engine, backend):
    sched = make_scheduler(engine, backend)
    long_events, short_events = Events(sched), Events(sched)
    long = sched.submit(prepare(engine, PROMPTS[0], 40), long_events)
    sched.step()
    sched.step()
    short = sched.submit(prepare(engine, PROMPTS[1], 3), short_events)
    while not short.done:
        sched.step()
    assert not long.done and long.status is RequestStatus.RUNNING
    assert short.slot not in sched.active  # freed at once
    assert short_events.events[-1].finished and short.result.generated_tokens == 3
    drain(sched)
    assert short_events.steps[-1] < long_events.steps[-1]
    assert long.result.token_ids == alone(engine, PROMPTS[0], 40).token_ids


def test_cancel_frees_the_slot_and_a_new_request_takes_it(engine, backend):
    sched = make_scheduler(engine, backend, max_slots=2)
    ev_a, ev_b = Events(sched), Events(sched)
    a = sched.submit(prepare(engine, PROMPTS[3], 40), ev_a)
    b = sched.submit(prepare(engine, PROMPTS[1], 40), ev_b)
    for _ in range(4):
        sched.step()
    assert sched.free_slots == []
    seen = len(ev_a.events)
    assert sched.cancel(a.request_id)
    assert not sched.cancel("no-such-request")
    c = sched.submit(prepare(engine, PROMPTS[2], 8))
    sched.step()
    assert a.done and a.result.finish_reason == FINISH_CANCELLED
    assert c.slot == a.slot and sched.active[c.slot] is c
    assert len(ev_a.events) == seen  # nothing more reaches a cancelled client
    assert not sched.cancel(a.request_id)
    drain(sched)
    # c reuses a's cache rows; a's stale keys beyond c's positions must not leak into c
    assert c.result.token_ids == alone(engine, PROMPTS[2], 8).token_ids
    assert b.result.token_ids == alone(engine, PROMPTS[1], 40).token_ids


def test_cancel_while_waiting_leaves_the_queue(engine, backend):
    sched = make_scheduler(engine, backend, max_slots=1)
    first = sched.submit(prepare(engine, PROMPTS[0], 4))
    queued = sched.submit(prepare(engine, PROMPTS[1], 4))
    assert sched.cancel(queued.request_id) and queued.done and sched.queue_length == 1
    drain(sched)
    assert first.result.generated_tokens == 4 and queued.result.finish_reason == FINISH_CANCELLED


def test_queue_limit_raises_503(engine, backend):
    sched = make_scheduler(engine, backend, max_slots=1, max_queue=2)
    sched.submit(prepare(engine, PROMPTS[0], 4))
    sched.submit(prepare(engine, PROMPTS[1], 4))
    with pytest.raises(RequestError, match="busy.*2 requests are already waiting.*queue limit 2") as info:
        sched.submit(prepare(engine, PROMPTS[2], 4))
    assert info.value.status == 503 and info.value.to_dict()["error_type"] == "overloaded"
    sched.step()  # one is admitted: the queue has room again
    sched.submit(prepare(engine, PROMPTS[2], 4))
    drain(sched)


def test_request_too_long_for_a_slot_is_a_400(engine, backend):
    sched = make_scheduler(engine, backend)
    ids = engine.tokenizer(PROMPTS[0])["input_ids"]
    prepared = PreparedRequest(GenerationRequest(PROMPTS[0]), ids, MAX_LENGTH)  # made by hand, as a script does
    with pytest.raises(RequestError, match=f"leaves room for only {MAX_LENGTH - len(ids)} of handler.max_length 256") \
            as info:
        sched.submit(prepared)
    assert info.value.status == 400 and info.value.parameter == "max_new_tokens" and sched.idle


def _visible_stop(engine):
    """A prompt and a stop string from its greedy answer's second half with a visible character (the
    kernels this CPU runs decide the tiny model's text, which may be runs of newlines)."""
    for prompt in (PROMPTS[4], *PROMPTS):
        text = alone(engine, prompt, 16).text
        tail = text[len(text) // 2:]
        for i in range(len(tail) - 2):
            if tail[i:i + 3].strip():
                return prompt, tail[i:i + 3]
    pytest.fail("no prompt's greedy answer has a visible character to stop on")


def test_per_request_parameters_hold(engine, backend):
    stop_prompt, stop = _visible_stop(engine)
    cases = [
        (PROMPTS[0], dict()),
        (PROMPTS[1], dict(do_sample=True, temperature=0.8, top_k=50, top_p=0.9, seed=1234)),
        (stop_prompt, dict(stop=[stop])),
        (PROMPTS[5], dict(repetition_penalty=1.3)),
        (PROMPTS[3], dict(do_sample=True, temperature=1.2, seed=7)),
    ]
    sched = make_scheduler(engine, backend, max_prefill_tokens_per_step=16)
    handles = [sched.submit(prepare(engine, p, 16, **kw), Events()) for p, kw in cases]
    drain(sched)
    for handle, (prompt, kw) in zip(handles, cases):
        ref = alone(engine, prompt, 16, **kw)
        assert handle.result.token_ids == ref.token_ids, kw
        assert handle.result.text == ref.text and handle.result.finish_reason == ref.finish_reason
        assert handle.on_event.text == ref.text
    assert handles[2].result.finish_reason == "stop_sequence" and stop not in handles[2].result.text
    assert handles[1].result.seed == 1234


def test_prefill_budget_delays_a_long_prompt_while_running_streams_keep_going(engine, backend):
    budget = 8
    sched = make_scheduler(engine, backend, max_prefill_tokens_per_step=budget)
    runner_events = Events(sched)
    runner = sched.submit(prepare(engine, PROMPTS[2], 60), runner_events)
    sched.step()
    assert len(runner_events.events) == 1
    long = sched.submit(prepare(engine, LONG_PROMPT, 5), Events(sched))
    prompt_tokens = len(long.prepared.prompt_ids)
    assert prompt_tokens > 3 * budget
    submitted_at = sched.steps
    while long.first_token_step is None:
        before = len(runner_events.events)
        sched.step()
        assert len(runner_events.events) == before + 1  # the running stream never skips a step
        assert backend.slot_length(long.slot) == min(prompt_tokens, (sched.steps - submitted_at) * budget)
    assert long.first_token_step - submitted_at + 1 == math.ceil(prompt_tokens / budget)
    assert not runner.done
    drain(sched)
    assert long.result.token_ids == alone(engine, LONG_PROMPT, 5).token_ids
    assert runner.result.token_ids == alone(engine, PROMPTS[2], 60).token_ids


def test_an_idle_server_prefills_a_burst_in_one_step_with_one_budget_per_slot(engine, backend):
    budget = 8
    sched = make_scheduler(engine, backend, max_prefill_tokens_per_step=budget)
    prompts = (PROMPTS[1], PROMPTS[5], PROMPTS[0])
    burst = [sched.submit(prepare(engine, p, 4), Events(sched)) for p in prompts]
    lengths = [len(h.prepared.prompt_ids) for h in burst]
    assert max(lengths) > budget and sum(lengths) <= budget * sched.max_slots
    sched.step()
    assert [h.first_token_step for h in burst] == [0, 0, 0]  # every prompt in the first step
    long = sched.submit(prepare(engine, LONG_PROMPT, 4), Events(sched))
    sched.step()
    assert backend.slot_length(long.slot) == budget  # streams are running: the per-step budget again
    drain(sched)
    for handle, prompt in zip(burst, prompts):
        assert handle.result.token_ids == alone(engine, prompt, 4).token_ids
    assert long.result.token_ids == alone(engine, LONG_PROMPT, 4).token_ids


def test_an_idle_server_chunks_a_prompt_longer_than_one_budget_per_slot(engine, backend):
    budget = 4
    sched = make_scheduler(engine, backend, max_prefill_tokens_per_step=budget)
    long = sched.submit(prepare(engine, LONG_PROMPT, 3), Events(sched))
    idle_budget = budget * sched.max_slots
    prompt_tokens = len(long.prepared.prompt_ids)
    assert prompt_tokens > 2 * idle_budget
    sched.step()
    assert backend.slot_length(long.slot) == idle_budget
    drain(sched)
    assert long.first_token_step + 1 == math.ceil(prompt_tokens / idle_budget)
    assert long.result.token_ids == alone(engine, LONG_PROMPT, 3).token_ids


def test_decode_error_fails_the_rows_of_that_step_and_frees_their_slots(engine, backend, monkeypatch):
    sched = make_scheduler(engine, backend)
    events = Events()
    handle = sched.submit(prepare(engine, PROMPTS[0], 10), events)
    sched.step()

    def broken(*args):
        raise RuntimeError("device lost")

    monkeypatch.setattr(backend, "_step", broken)
    sched.step()
    monkeypatch.undo()
    assert handle.done and handle.result.finish_reason == FINISH_ERROR and "device lost" in str(handle.error)
    assert events.events[-1].finished and events.events[-1].token_id is None
    drain(sched)


def test_a_callback_that_raises_cancels_only_its_request(engine, backend):
    sched = make_scheduler(engine, backend)

    def gone(event):
        raise BrokenPipeError("client went away")

    bad = sched.submit(prepare(engine, PROMPTS[0], 10), gone)
    good = sched.submit(prepare(engine, PROMPTS[1], 10))
    drain(sched)
    assert bad.result.finish_reason == FINISH_CANCELLED and bad.result.generated_tokens == 1
    assert good.result.token_ids == alone(engine, PROMPTS[1], 10).token_ids


def test_more_requests_than_slots_are_all_served_by_stepping(engine, backend):
    """The handler's way: submit, then step until idle; six requests share four slots."""
    sched = make_scheduler(engine, backend)
    handles = [sched.submit(prepare(engine, p, 8)) for p in PROMPTS]
    drain(sched)
    assert all(h.done and h.status is RequestStatus.FINISHED for h in handles)
    for prompt, handle in zip(PROMPTS, handles):
        assert handle.result.token_ids == alone(engine, prompt, 8).token_ids
    assert sched.free_slots == [0, 1, 2, 3] and sched.idle
