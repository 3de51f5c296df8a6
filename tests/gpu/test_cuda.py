"""The torch backend on a CUDA GPU: the same engine, scheduler and sampling as on the CPU.

Skipped without a CUDA device (``tests/conftest.py``). The references are the same requests on
the CPU in float32: a GPU in float32 must choose the same tokens, one in bf16 (``dtype: auto``)
must stay within bf16's rounding of the float32 logits.
"""
import pytest
import torch

from llama_engine import Engine, GenerationRequest, SamplingParams
from llama_engine.backends.base import PrefillChunk
from llama_engine.backends.torch_backend import TorchSlotBackend
from llama_engine.config import HandlerConfig
from llama_engine.continuous import ContinuousScheduler

MAX_LENGTH = 256
PROMPTS = [
    "The function returns",
    "If the object is a list of values, then",
    "A",
    "Errors should never pass silently. Unless explicitly silenced. In the face of ambiguity",
    "def main():",
]


def make_engine(model_dir, device, dtype="float32", **kw):
    cfg = HandlerConfig(model_path=model_dir.name, max_length=MAX_LENGTH, max_new_tokens=16, dtype=dtype,
                        device=device, **kw)
    return Engine.from_config(cfg, str(model_dir.parent), batch_size=len(PROMPTS))


@pytest.fixture(scope="module")
def cpu_engine(tiny_model_dir):
    return make_engine(tiny_model_dir, "cpu")


@pytest.fixture(scope="module")
def gpu_engine(tiny_model_dir):
    return make_engine(tiny_model_dir, "cuda")


def generate(engine, prompts, max_new_tokens=12, **params):
    batch = [engine.prepare(GenerationRequest(p, SamplingParams(max_new_tokens=max_new_tokens, **params)))
             for p in prompts]
    return engine.generate(batch)


def first_logits(slots, ids):
    """The logits after ``ids``, prefilled into slot 0 of a slot backend (freed after)."""
    logits = slots.prefill_slot(0, ids)
    slots.free_slot(0)
    return logits.float().cpu()


def test_the_model_and_its_cache_live_on_the_gpu(gpu_engine):
    backend = gpu_engine.backend
    assert backend.device.type == "cuda" and next(backend.model.parameters()).is_cuda
    assert backend.slots.k_cache.is_cuda and backend.slots.v_cache.is_cuda
    assert backend.slots._kernels is None  # the native CPU kernels serve CPU tensors only


def test_greedy_tokens_on_the_gpu_are_the_cpus(cpu_engine, gpu_engine):
    want = generate(cpu_engine, PROMPTS)
    got = generate(gpu_engine, PROMPTS)
    for w, g in zip(want, got):
        assert g.token_ids == w.token_ids and g.text == w.text and g.finish_reason == w.finish_reason
        assert g.logprobs == pytest.approx(w.logprobs, abs=1e-3)


def test_a_batch_on_the_gpu_equals_each_request_alone(gpu_engine):
    batch = generate(gpu_engine, PROMPTS)
    for prompt, together in zip(PROMPTS, batch):
        assert generate(gpu_engine, [prompt])[0].token_ids == together.token_ids


def test_seeded_sampling_on_the_gpu_draws_what_the_cpu_draws(cpu_engine, gpu_engine):
    """The token selector samples from a generator seeded per request: the same seed gives the
    same tokens on either device, and on the GPU the draw must not mix devices."""
    params = dict(do_sample=True, temperature=0.9, top_p=0.95, top_k=50, seed=1234, repetition_penalty=1.1)
    want = generate(cpu_engine, PROMPTS[:3], **params)
    got = generate(gpu_engine, PROMPTS[:3], **params)
    assert [g.token_ids for g in got] == [w.token_ids for w in want]
    assert [g.seed for g in got] == [1234] * 3


def test_auto_dtype_on_the_gpu_is_bf16_within_its_rounding_of_float32(tiny_model_dir, cpu_engine):
    engine = make_engine(tiny_model_dir, "auto", dtype="auto")
    backend = engine.backend
    want = torch.bfloat16 if torch.cuda.is_bf16_supported() else torch.float16
    assert backend.device.type == "cuda" and backend.model.dtype == want and backend.slots.k_cache.dtype == want
    ids = engine.tokenizer(PROMPTS[3])["input_ids"]
    reference, logits = first_logits(cpu_engine.backend.slots, ids), first_logits(backend.slots, ids)
    assert (logits - reference).abs().max() <= 0.05 * reference.abs().max()
    assert int(logits.argmax()) == int(reference.argmax())


def test_continuous_batching_on_the_gpu_equals_each_request_alone(tiny_model_dir, gpu_engine):
    backend = TorchSlotBackend.from_pretrained(str(tiny_model_dir), max_slots=3, max_length=MAX_LENGTH,
                                               dtype="float32", device="cuda")
    scheduler = ContinuousScheduler(backend, gpu_engine.tokenizer, max_slots=3, max_queue=8,
                                    max_prefill_tokens_per_step=8)
    lengths = [14, 6, 10, 12, 3]
    arrivals = {0: [0, 1], 2: [2], 5: [3, 4]}
    handles = {}
    for step in range(500):
        for i in arrivals.get(step, []):
            request = GenerationRequest(PROMPTS[i], SamplingParams(max_new_tokens=lengths[i]))
            handles[i] = scheduler.submit(gpu_engine.prepare(request))
        if not scheduler.step() and step > max(arrivals):
            break
    assert scheduler.idle and scheduler.free_slots == [0, 1, 2]
    for i, prompt in enumerate(PROMPTS):
        assert handles[i].result.token_ids == generate(gpu_engine, [prompt], lengths[i])[0].token_ids, i


def test_chunked_prefill_and_decode_rows_share_a_pass_on_the_gpu(tiny_model_dir, gpu_engine):
    slots = TorchSlotBackend.from_pretrained(str(tiny_model_dir), max_slots=2, max_length=MAX_LENGTH,
                                             dtype="float32", device="cuda")
    ids = gpu_engine.tokenizer(PROMPTS[3])["input_ids"]
    whole = first_logits(slots, ids)
    token = int(first_logits(slots, ids[:6]).argmax())
    after_token = first_logits(slots, ids[:6] + [token])
    slots.prefill_slot(0, ids[:5])
    assert int(slots.decode_slots([0], [ids[5]])[0].argmax()) == token
    assert not isinstance(slots.step_slots([], [], [PrefillChunk(1, ids[:7], 0)]).prefills[0], Exception)
    step = slots.step_slots([0], [token], [PrefillChunk(1, ids[7:], 7)])
    assert torch.allclose(step.decode[0].float().cpu(), after_token, atol=1e-3)
    assert torch.allclose(step.prefills[0].float().cpu(), whole, atol=1e-3)
    slots.free_slot(0)
    slots.free_slot(1)


def test_compiled_backend_on_the_gpu_chooses_the_eager_tokens(tiny_model_dir, gpu_engine):
    """``compile: true`` (HF's static cache under torch.compile, CUDA graphs on a GPU)."""
    compiled = make_engine(tiny_model_dir, "cuda", compile=True, allow_recompile=True)  # nothing shipped
    want = generate(gpu_engine, PROMPTS, 8)
    assert [r.token_ids for r in generate(compiled, PROMPTS, 8)] == [r.token_ids for r in want]


def test_the_handler_takes_the_gpu_torchserve_assigns(monkeypatch):
    import llama_handler

    config = llama_handler.load_model_config({"handler": {"device": "auto"}})
    last = torch.cuda.device_count() - 1
    assert llama_handler.use_assigned_gpu(config, str(last)) == last and torch.cuda.current_device() == last
    with pytest.raises(RuntimeError, match=f"gpu_id {last + 1}, but it sees {last + 1} CUDA"):
        llama_handler.use_assigned_gpu(config, last + 1)
