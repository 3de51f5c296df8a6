"""The CPU decode speedups of the torch backends keep the model's numbers.

* :func:`pack_linears` (the native kernel's linears in bfloat16 where :mod:`cpu_kernels` load,
  oneDNN packed linears in bfloat16 otherwise, and in float32 where measured faster): logits of
  prefill and decode match the plain HF model (within bfloat16 rounding; to float32 summation
  order), for TorchBackend and TorchSlotBackend, with the native kernels and without them.
* :class:`TorchBackend` (static batches on the slot cache, row ``i`` in slot ``i``): left padding
  dropped, ``retain`` keeps the rows' logits, the cache grows for a larger batch, and a failed
  prefill leaves every slot free.
"""
import copy
import logging
import re
import sys
import time

import pytest
import torch
from transformers import AutoModelForCausalLM, DynamicCache

from llama_engine import cpu as cpu_info
from llama_engine.backends import cpu_kernels, fast_linear, int8_rows, torch_backend
from llama_engine.backends.base import PrefillChunk, SlotBatchBackend, take_greedy_picks
from llama_engine.backends.fast_linear import (
    FusedLlamaProjections,
    NativeLinear,
    PackedLinear,
    pack_linears,
    packing_supported,
)
from llama_engine.backends.torch_backend import (
    TorchBackend,
    TorchSlotBackend,
    _PromptAttention,
    kv_cache_dtype_for,
    prompts_attend_by_blocks,
)

BF16 = pytest.mark.skipif(not packing_supported(torch.bfloat16, torch.device("cpu")),
                          reason="no oneDNN bfloat16 support on this CPU")
FP32 = pytest.mark.skipif(not packing_supported(torch.float32, torch.device("cpu")), reason="torch built without oneDNN")
DTYPES = [pytest.param("bfloat16", marks=BF16), pytest.param("float32", marks=FP32)]
#: This CPU's native kernels (None where it cannot run them or they cannot be built).
NATIVE = cpu_kernels.load()
needs_native = pytest.mark.skipif(NATIVE is None, reason="the native CPU kernels do not run on this CPU")
PAIRED = pytest.mark.skipif(NATIVE is None or NATIVE.isa not in cpu_kernels.PAIRS_ISAS,
                            reason="the native kernels' AVX-512 builds lay weights out in pair panels")
#: bf16 arithmetic on the native kernels: only the avx512bf16 build runs it (fast_linear.native_kernels_for); on an
#: ``avx512`` CPU a bf16 model keeps oneDNN's products.
needs_bf16_native = pytest.mark.skipif(NATIVE is None or NATIVE.isa != "avx512bf16",
                                       reason="bf16 arithmetic runs natively on the avx512bf16 build only")
needs_amx_tiles = pytest.mark.skipif(NATIVE is None or not NATIVE.amx, reason="this CPU has no AMX tiles")
#: bf16 prompt products on AVX512_BF16's dot products: the avx512bf16 build on a CPU without AMX.
needs_dot_products = pytest.mark.skipif(NATIVE is None or NATIVE.isa != "avx512bf16" or NATIVE.amx,
                                        reason="the avx512bf16 build on a CPU without AMX")
#: The backend with the native kernels and with torch's own (``LLAMA_CPU_KERNELS=0``).
KERNELS = [pytest.param("native", marks=needs_native), "torch"]


@pytest.fixture(params=KERNELS)
def kernels(request, monkeypatch):
    """Run the test with the native CPU kernels and with torch's (the switch the backend reads)."""
    monkeypatch.setenv(cpu_kernels.ENV, "auto" if request.param == "native" else "0")
    return request.param


@pytest.fixture(autouse=True)
def fp32_packing_on(monkeypatch):
    """float32 packing without the measurement; these tests check it keeps the logits."""
    monkeypatch.setenv(fast_linear.ENV, "1")


@pytest.fixture(autouse=True)
def one_thread():
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


#: CPU flag sets of the two classes with native bf16 (the backend reads this machine's otherwise).
AMX = frozenset({"avx2", "avx512f", "avx512_bf16", "amx_tile", "amx_bf16"})
AVX512_BF16 = frozenset({"avx2", "avx512f", "avx512_bf16"})
AVX512 = frozenset({"avx2", "fma", "avx512f"})
AVX2 = frozenset({"avx2", "fma", "f16c"})


def load(tiny_model_dir, dtype):
    return AutoModelForCausalLM.from_pretrained(tiny_model_dir, torch_dtype=dtype, use_safetensors=True).eval()


def prompts(batch=2, length=9, seed=0):
    gen = torch.Generator().manual_seed(seed)
    ids = torch.randint(3, 2000, (batch, length), generator=gen)
    mask = torch.ones_like(ids)
    mask[0, :3] = 0  # left padding on the first row
    return ids, mask


@torch.inference_mode()
def reference_logits(model, ids, mask, steps, cache=None):
    """The plain HF model: prefill then greedy decode with a DynamicCache; logits of every step."""
    positions = (mask.cumsum(-1) - 1).clamp(min=0)
    out = model(input_ids=ids, attention_mask=mask, position_ids=positions,
                past_key_values=cache if cache is not None else DynamicCache(), use_cache=True)
    logits = [out.logits[:, -1, :].float()]
    cache, position = out.past_key_values, positions[:, -1:] + 1
    for _ in range(steps):
        token = logits[-1].argmax(-1, keepdim=True)
        mask = torch.cat([mask, torch.ones_like(token)], dim=1)
        out = model(input_ids=token, attention_mask=mask, position_ids=position, past_key_values=cache, use_cache=True)
        logits.append(out.logits[:, -1, :].float())
        position = position + 1
    return logits


def backend_logits(backend, ids, mask, steps):
    logits = [backend.prefill(ids, mask)]
    for _ in range(steps):
        logits.append(backend.decode(logits[-1].argmax(-1)))
    return logits


def assert_close(got, want, dtype="bfloat16"):
    """bf16: rounding of the activations may differ between kernels; fp32: only the summation order."""
    scale = want.abs().max().item()
    tol = 0.01 * scale + 0.01 if dtype == "bfloat16" else 1e-4 * scale + 1e-5
    assert (got - want).abs().max().item() <= tol, (got - want).abs().max()


@BF16
def test_packed_linear_matches_nn_linear():
    torch.manual_seed(0)
    for bias in (False, True):
        linear = torch.nn.Linear(96, 80, bias=bias).to(torch.bfloat16)
        packed = PackedLinear(linear)
        for shape in ((1, 96), (3, 1, 96), (2, 7, 96), (300, 96)):
            x = torch.randn(shape, dtype=torch.bfloat16)
            with torch.inference_mode():
                want = torch.nn.functional.linear(x.float(), linear.weight.float(),
                                                  None if linear.bias is None else linear.bias.float())
                got = packed(x)
            assert got.shape == want.shape and got.dtype == torch.bfloat16
            torch.testing.assert_close(got.float(), want, atol=0.05, rtol=0.02)


@needs_native
@BF16
def test_native_linear_matches_nn_linear_on_either_side_of_its_row_limit(monkeypatch):
    """The native kernel up to ``max_rows`` rows, oneDNN over the same plain weight beyond; bias, 3-D and
    strided inputs alike."""
    torch.manual_seed(0)
    calls = []
    monkeypatch.setattr(NATIVE, "linear", lambda x, w, _f=NATIVE.linear, **kw: calls.append(x.shape[0]) or _f(x, w, **kw))
    for bias in (False, True):
        linear = torch.nn.Linear(96, 80, bias=bias).to(torch.bfloat16)
        native = NativeLinear(linear, NATIVE, max_rows=6)
        for shape in ((1, 96), (3, 2, 96), (6, 96), (7, 96), (2, 7, 96), (300, 96)):
            x = torch.randn(shape, dtype=torch.bfloat16)
            calls.clear()
            with torch.inference_mode():
                want = torch.nn.functional.linear(x.float(), linear.weight.float(),
                                                  None if linear.bias is None else linear.bias.float())
                got = native(x)
            rows = x.numel() // 96
            assert calls == ([rows] if rows <= 6 else [])
            assert got.shape == want.shape and got.dtype == torch.bfloat16
            torch.testing.assert_close(got.float(), want, atol=0.05, rtol=0.02)
    strided = torch.randn(4, 200, dtype=torch.bfloat16)[:, 10:106]
    torch.testing.assert_close(native(strided).float(), torch.nn.functional.linear(
        strided.float(), linear.weight.float(), linear.bias.float()), atol=0.05, rtol=0.02)


def test_native_linears_serve_bf16_on_the_bf16_build_without_amx_and_float32_on_an_avx2_cpu(monkeypatch):
    """bf16 through the avx2 build, bf16 on an AMX CPU (whose tiles oneDNN multiplies on) and float32
    where oneDNN has AVX-512 stay on oneDNN's packed products (faster there); float32 on an AVX2 CPU
    runs natively, up to its own row count."""
    cpu = torch.device("cpu")
    assert fast_linear.native_kernels_for(torch.float32, cpu, AVX512_BF16) is None
    assert fast_linear.native_kernels_for(torch.bfloat16, torch.device("meta"), AVX512_BF16) is None
    avx2_build = type("K", (), {"isa": "avx2"})()
    monkeypatch.setattr(cpu_kernels, "load", lambda: avx2_build)
    assert fast_linear.native_kernels_for(torch.bfloat16, cpu, AVX512_BF16) is None
    assert fast_linear.native_kernels_for(torch.bfloat16, cpu, AVX2) is None
    assert fast_linear.native_kernels_for(torch.float32, cpu, AVX2) is (
        avx2_build if packing_supported(torch.float32, cpu) else None)
    assert fast_linear.native_kernels_for(torch.float32, cpu, AVX512) is None
    bf16_build = type("K", (), {"isa": "avx512bf16"})()
    monkeypatch.setattr(cpu_kernels, "load", lambda: bf16_build)
    expected = bf16_build if packing_supported(torch.bfloat16, cpu) else None
    assert fast_linear.native_kernels_for(torch.bfloat16, cpu, AVX512_BF16) is expected
    assert fast_linear.native_kernels_for(torch.bfloat16, cpu, AMX) is None
    assert fast_linear.native_max_rows(bf16_build) == fast_linear.NATIVE_MAX_ROWS
    assert fast_linear.native_max_rows(bf16_build, fast_linear.BF16_WEIGHT_MAX_ROWS) == fast_linear.BF16_WEIGHT_MAX_ROWS
    # bf16 weights kept under float32 arithmetic: the AVX-512 builds' GEMM takes a prompt's rows of them
    for isa in ("avx512", "avx512bf16"):
        build = type("K", (), {"isa": isa})()
        assert fast_linear.native_max_rows(build, 64, torch.bfloat16) == sys.maxsize
        assert fast_linear.native_max_rows(build, 64, torch.float32) == 64
    # the avx2 build multiplies a prompt's many rows with its GEMM: no row count leaves it
    assert fast_linear.native_max_rows(avx2_build) == fast_linear.native_max_rows(avx2_build, 64) == sys.maxsize


@FP32
def test_float32_packed_linear_matches_nn_linear():
    torch.manual_seed(0)
    for bias in (False, True):
        linear = torch.nn.Linear(96, 80, bias=bias)
        packed = PackedLinear(linear)
        for shape in ((1, 96), (3, 1, 96), (8, 96), (2, 7, 96), (300, 96)):
            x = torch.randn(shape)
            with torch.inference_mode():
                torch.testing.assert_close(packed(x), linear(x), atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("dtype", DTYPES)
def test_pack_linears_swaps_every_linear_and_keeps_logits(tiny_model_dir, dtype, kernels):
    plain, packed = load(tiny_model_dir, getattr(torch, dtype)), load(tiny_model_dir, getattr(torch, dtype))
    linears = sum(type(m) is torch.nn.Linear for m in plain.modules())
    assert pack_linears(packed) == linears
    assert not any(type(m) is torch.nn.Linear for m in packed.modules())
    native = fast_linear.native_kernels_for(getattr(torch, dtype), torch.device("cpu")) is not None
    assert all(isinstance(m, NativeLinear if native else PackedLinear) for m in packed.modules()
               if isinstance(m, (NativeLinear, PackedLinear))) and any(isinstance(m, NativeLinear) is native
                                                                       for m in packed.modules())
    ids, mask = prompts()
    for got, want in zip(reference_logits(packed, ids, mask, 6), reference_logits(plain, ids, mask, 6)):
        assert_close(got, want, dtype)


def _slowed(cls, monkeypatch):
    """``cls.forward`` 0.2 ms slower per call; returns a function that puts the real one back."""
    real = cls.forward

    def slowed(self, x):
        time.sleep(2e-4)
        return real(self, x)

    monkeypatch.setattr(cls, "forward", slowed)
    return lambda: monkeypatch.setattr(cls, "forward", real)


FP32_SIDES = {"plain": torch.nn.Linear, "onednn": PackedLinear, "native": NativeLinear}


@FP32
@pytest.mark.parametrize("fastest, native", [("plain", False), ("onednn", False),
                                             pytest.param("plain", True, marks=needs_native),
                                             pytest.param("onednn", True, marks=needs_native),
                                             pytest.param("native", True, marks=needs_native)])
def test_float32_linears_go_to_the_kernel_a_measurement_finds_fastest(tiny_model_dir, monkeypatch, fastest, native):
    """Off the ``avx2`` class (``native_kernels_for`` None for float32), a float32 model's linears stay
    ``nn.Linear``, are packed by oneDNN, or run on the native kernels, whichever times fastest at load (the
    others slowed during the measurement); without native kernels only the first two are timed."""
    monkeypatch.delenv(fast_linear.ENV)
    monkeypatch.setattr(fast_linear, "_FP32_DECISIONS", {})
    monkeypatch.setattr(fast_linear, "SAMPLE_MAX_LINEARS", 16)  # the slowed calls are what tells them apart
    monkeypatch.setattr(fast_linear, "native_kernels_for", lambda *args: None)  # as on a CPU above avx2
    if not native:
        monkeypatch.setattr(cpu_kernels, "for_device", lambda device: None)
    restore = [_slowed(cls, monkeypatch) for side, cls in FP32_SIDES.items() if side != fastest]
    model = load(tiny_model_dir, torch.float32)
    linears = sum(type(m) is torch.nn.Linear for m in model.modules())
    swapped = pack_linears(model)
    for undo in restore:
        undo()
    assert swapped == (0 if fastest == "plain" else linears)
    kinds = {type(m) for m in model.modules() if type(m) in FP32_SIDES.values()}
    assert kinds == {FP32_SIDES[fastest]}
    assert fast_linear._FP32_DECISIONS == {(torch.get_num_threads(), NATIVE.isa if native else None): fastest}
    # one measurement per process, thread count and build: the next model follows it without measuring
    again = load(tiny_model_dir, torch.float32)
    monkeypatch.setattr(fast_linear.cpu_kernels, "alternate_passes", None)
    assert pack_linears(again) == swapped


@FP32
def test_onednn_fast_at_a_decode_steps_rows_but_slow_at_a_prompts_leaves_the_linears_plain(monkeypatch):
    """Packing replaces the weight, so a prompt's rows go through oneDNN too: its time there counts. Faster at a
    decode step's rows by more than the 10% a decode-only score asked, but 2.15x nn.Linear's time at a prompt's
    (as a CPU without AVX2 measured, oneDNN under SSE4.1), it is not taken; as fast at a prompt's, it is."""
    calls, decode = [], [{"plain": 17.7, "onednn": 12.7}, {"plain": 39.2, "onednn": 33.0}]  # 1 and 8 rows
    linears = [torch.nn.Linear(64, 64) for _ in range(3)]
    for prompt, kind in (({"plain": 255.0, "onednn": 548.0}, "plain"), ({"plain": 255.0, "onednn": 250.0}, "onednn")):
        calls.clear()
        times = decode + [prompt]

        def passes(runs, rounds, times=times):
            calls.append(sorted(runs))
            return {side: [times[len(calls) - 1][side]] for side in runs}

        monkeypatch.setattr(cpu_kernels, "alternate_passes", passes)
        monkeypatch.setattr(fast_linear, "_FP32_DECISIONS", {})
        assert fast_linear.float32_linear_kernel(linears) == kind
        assert calls == [["onednn", "plain"]] * 3  # 1 row, 8 rows, a prompt's


@FP32
@needs_native
def test_a_tie_goes_to_the_native_kernels_and_the_switch_overrides_the_measurement(tiny_model_dir, monkeypatch):
    """Native products within ``NATIVE_FP32_FAVOUR`` of oneDNN's take the model (its decode step then
    runs in one native call); ``LLAMA_PACKED_LINEAR=native`` and ``=1`` decide without measuring."""
    monkeypatch.setattr(fast_linear, "native_kernels_for", lambda *args: None)
    times, timed = {"plain": 1.0, "onednn": 0.50, "native": 0.52}, []
    monkeypatch.setattr(cpu_kernels, "alternate_passes",
                        lambda runs, rounds: timed.append(sorted(runs)) or {side: [times[side]] for side in runs})
    monkeypatch.setattr(fast_linear, "_FP32_DECISIONS", {})
    linears = [torch.nn.Linear(64, 64) for _ in range(3)]
    assert fast_linear.float32_linear_kernel(linears, NATIVE) == "native"
    assert timed == [["native", "onednn", "plain"]] * 2  # 1 and 8 rows; no weight packed, no prompt's rows timed
    times["native"], timed[:] = 0.56, []
    monkeypatch.setattr(fast_linear, "_FP32_DECISIONS", {})
    assert fast_linear.float32_linear_kernel(linears, NATIVE) == "onednn"
    assert timed == [["native", "onednn", "plain"]] * 2 + [["onednn", "plain"]]
    monkeypatch.setattr(cpu_kernels, "alternate_passes", None)  # no measurement below
    for setting, kind in (("native", NativeLinear), ("1", PackedLinear)):
        monkeypatch.setenv(fast_linear.ENV, setting)
        model = load(tiny_model_dir, torch.float32)
        pack_linears(model)
        assert {type(m) for m in model.modules() if type(m) in FP32_SIDES.values()} == {kind}


@FP32
def test_float32_linears_on_an_avx2_cpu_run_natively_and_keep_the_logits(tiny_model_dir, monkeypatch):
    """The avx2 build's float32 products, a few rows (the tiles) and a prompt's many (its GEMM from
    48 rows), compute the model's."""
    if cpu_kernels.isa_for(cpu_info.cpu_flags()) is None:
        pytest.skip("this CPU runs none of the native kernels' instruction sets")
    monkeypatch.setenv(cpu_kernels.ENV, "avx2")
    monkeypatch.setattr(fast_linear, "cpu_flags", lambda: AVX2)
    plain, native = load(tiny_model_dir, torch.float32), load(tiny_model_dir, torch.float32)
    assert pack_linears(native) == sum(type(m) is torch.nn.Linear for m in plain.modules())
    layers = [m for m in native.modules() if isinstance(m, (NativeLinear, PackedLinear))]
    assert all(isinstance(m, NativeLinear) and m.kernels.isa == "avx2" and m.max_rows == sys.maxsize for m in layers)
    for ids, mask in (prompts(), prompts(batch=2, length=40)):  # 18 and 80 rows in the prefill
        for got, want in zip(reference_logits(native, ids, mask, 6), reference_logits(plain, ids, mask, 6)):
            assert_close(got, want, "float32")


def test_pack_linears_honours_the_switch(tiny_model_dir, monkeypatch):
    monkeypatch.setenv(fast_linear.ENV, "0")
    for dtype in (torch.bfloat16, torch.float32):
        model = load(tiny_model_dir, dtype)
        assert pack_linears(model) == 0
        assert any(type(m) is torch.nn.Linear for m in model.modules())


@pytest.mark.parametrize("dtype", DTYPES)
def test_torch_backend_packed_matches_plain_model(tiny_model_dir, dtype, kernels):
    backend = TorchBackend(str(tiny_model_dir), dtype=dtype, device="cpu", max_length=64)
    assert not any(type(m) is torch.nn.Linear for m in backend.model.modules())
    ids, mask = prompts()
    plain = load(tiny_model_dir, getattr(torch, dtype))
    for got, want in zip(backend_logits(backend, ids, mask, 6), reference_logits(plain, ids, mask, 6)):
        assert_close(got, want, dtype)


@pytest.mark.parametrize("dtype", DTYPES)
def test_slot_backend_packed_matches_plain_model(tiny_model_dir, dtype, kernels):
    backend = TorchSlotBackend.from_pretrained(str(tiny_model_dir), max_slots=2, max_length=64, dtype=dtype,
                                               device="cpu")
    assert not any(type(m) is torch.nn.Linear for m in backend.model.modules())
    plain = load(tiny_model_dir, getattr(torch, dtype))
    ids = prompts(batch=1)[0]
    want = reference_logits(plain, ids, torch.ones_like(ids), 5)
    got = [backend.prefill_slot(0, ids[0].tolist())]
    for _ in range(5):
        got.append(backend.decode_slots([0], [int(got[-1].argmax())])[0])
    for g, w in zip(got, want):
        assert_close(g, w[0], dtype)


@BF16
@pytest.mark.parametrize("kv_cache_dtype", ["auto", "bfloat16", "float32"])
def test_bf16_weights_keep_a_float32_cache_on_a_cpu_without_amx_or_native_attention_unless_told_and_match_the_plain_model(
        tiny_model_dir, monkeypatch, kv_cache_dtype, kernels):
    monkeypatch.setattr(cpu_info, "cpu_flags", lambda: AVX512_BF16)
    backend = TorchBackend(str(tiny_model_dir), dtype="bfloat16", device="cpu", max_length=64,
                           kv_cache_dtype=kv_cache_dtype)
    auto = torch.bfloat16 if kernels == "native" else torch.float32
    cache_dtype = auto if kv_cache_dtype == "auto" else getattr(torch, kv_cache_dtype)
    assert backend.slots.k_cache.dtype == backend.slots.v_cache.dtype == cache_dtype
    assert (backend.slots._kernels is not None) == (kernels == "native")
    ids, mask = prompts()
    plain = load(tiny_model_dir, torch.bfloat16)
    for got, want in zip(backend_logits(backend, ids, mask, 6), reference_logits(plain, ids, mask, 6)):
        assert got.dtype == torch.float32
        assert_close(got, want, "bfloat16")


@pytest.mark.parametrize("tokens", [5, 128, 300])
@pytest.mark.parametrize("start", [0, 200])
@pytest.mark.parametrize("kv_heads", [4, 2])
@pytest.mark.parametrize("dtype, cache", [(torch.float32, torch.bfloat16), (torch.bfloat16, torch.float32)],
                         ids=["float32-over-bf16", "bf16-over-float32"])
def test_prompt_attention_by_blocks_is_causal_attention_over_the_chunk_and_what_precedes_it(tokens, start, kv_heads,
                                                                                          dtype, cache):
    """A first float32 chunk attends through SDPA over its own keys and values, any other chunk by blocks."""
    gen = torch.Generator().manual_seed(tokens + start)
    end = start + tokens
    q = torch.randn(end, 4, 16, generator=gen)
    k, v = (torch.randn(end, kv_heads, 16, generator=gen).to(cache).float() for _ in range(2))  # as the cache holds them
    k_layer, v_layer = (torch.zeros(2, kv_heads, 512, 16, dtype=cache) for _ in range(2))  # [slots, kv_heads, positions, dim]
    k_layer[1, :, :end], v_layer[1, :, :end] = k.transpose(0, 1), v.transpose(0, 1)
    gqa = kv_heads != 4
    attention = _PromptAttention(slot=1, start=start, dtype=dtype)
    got = attention(*(t[start:].to(dtype) for t in (q, k, v)), k_layer, v_layer, gqa)
    want = torch.nn.functional.scaled_dot_product_attention(
        q.transpose(0, 1), k.transpose(0, 1), v.transpose(0, 1), is_causal=True, enable_gqa=gqa).transpose(0, 1)
    assert got.shape == (tokens, 4, 16) and got.dtype == dtype
    tolerance = 1e-5 if dtype == torch.float32 else 2e-2
    torch.testing.assert_close(got.float(), want[start:], rtol=tolerance, atol=tolerance)


@BF16
@pytest.mark.parametrize("fuse", [True, False])
@pytest.mark.parametrize("flags, kv, by_blocks", [(AVX512_BF16, torch.float32, True), (AMX, torch.bfloat16, False)],
                         ids=["avx512-bf16", "amx"])
def test_bf16_prompts_whole_or_in_chunks_match_the_plain_model_on_each_cpu_class(tiny_model_dir, monkeypatch, fuse,
                                                                                 flags, kv, by_blocks, kernels):
    """Without AMX: prompts by blocks, over a float32 cache (a bf16 one where decode rows attend through the
    native kernel); with AMX: a bf16 cache and SDPA. Same logits."""
    monkeypatch.setattr(cpu_info, "cpu_flags", lambda: flags)
    backend = TorchSlotBackend(load(tiny_model_dir, torch.bfloat16), max_slots=2, max_length=320, fuse=fuse)
    kv = torch.bfloat16 if kernels == "native" else kv
    assert backend.kv_dtype == kv and backend.k_cache.dtype == kv
    assert backend._prompt_by_blocks is by_blocks
    ids = prompts(batch=1, length=300)[0][0].tolist()
    want = reference_logits(load(tiny_model_dir, torch.bfloat16), torch.tensor([ids]), torch.ones(1, 300), 3)
    got = [backend.prefill_slot(0, ids)]
    for _ in range(3):
        got.append(backend.decode_slots([0], [int(got[-1].argmax())])[0])
    for g, w in zip(got, want):
        assert_close(g, w[0], "bfloat16")
    backend.step_slots([], [], [PrefillChunk(1, ids[:140], 0)])
    (last,) = backend.step_slots([], [], [PrefillChunk(1, ids[140:], 140)]).prefills
    assert_close(last, want[0][0], "bfloat16")


def test_kv_cache_dtype_auto_depends_on_the_weights_the_device_amx_and_native_attention():
    cpu, gpu = torch.device("cpu"), torch.device("cuda")
    assert kv_cache_dtype_for("auto", torch.bfloat16, cpu, AVX512_BF16) == torch.float32
    assert kv_cache_dtype_for("auto", torch.bfloat16, cpu, AVX512_BF16, native_attention=True) == torch.bfloat16
    assert kv_cache_dtype_for("auto", torch.float16, cpu, AVX512_BF16, native_attention=True) == torch.float32
    assert kv_cache_dtype_for("auto", torch.float32, cpu, AVX512_BF16, native_attention=True) == torch.float32
    assert kv_cache_dtype_for("float32", torch.bfloat16, cpu, AVX512_BF16, native_attention=True) == torch.float32
    assert kv_cache_dtype_for("auto", torch.bfloat16, cpu, AMX) == torch.bfloat16
    assert kv_cache_dtype_for("auto", torch.float16, cpu, AVX512_BF16) == torch.float32
    assert kv_cache_dtype_for("auto", torch.float16, cpu, AMX) == torch.float32
    assert kv_cache_dtype_for("auto", torch.float32, cpu, AMX) == torch.float32
    assert kv_cache_dtype_for("auto", torch.bfloat16, gpu, AVX512_BF16) == torch.bfloat16
    assert kv_cache_dtype_for("bfloat16", torch.bfloat16, cpu, AVX512_BF16) == torch.bfloat16
    assert kv_cache_dtype_for("float32", torch.bfloat16, gpu, AMX) == torch.float32
    assert kv_cache_dtype_for("float32", torch.bfloat16, cpu, AMX) == torch.float32


def test_torch_backend_retain_matches_a_fresh_batch(tiny_model_dir):
    """Rows kept by retain() decode as they would have in the full batch (the cache rows follow)."""
    backend = TorchBackend(str(tiny_model_dir), dtype="float32", device="cpu", max_length=64)
    ids, mask = prompts(batch=3)
    full = backend_logits(backend, ids, mask, 8)
    backend.release()
    logits = backend_logits(backend, ids, mask, 3)
    assert backend.retain([0, 2])
    for step in range(4, 9):
        logits.append(backend.decode(full[step - 1][[0, 2]].argmax(-1)))
        torch.testing.assert_close(logits[-1], full[step][[0, 2]], atol=1e-5, rtol=1e-5)


def test_torch_backend_grows_its_cache_for_a_larger_batch_and_frees_slots_on_release(tiny_model_dir):
    backend = TorchBackend(str(tiny_model_dir), dtype="float32", device="cpu", max_length=64, batch_size=2)
    ids, mask = prompts(batch=4)
    logits = backend_logits(backend, ids, mask, 2)
    assert backend.slots.max_slots == 4 and logits[-1].shape[0] == 4
    assert [backend.slots.slot_length(s) for s in range(4)] == [ids.shape[1] - 3 + 2] + [ids.shape[1] + 2] * 3
    with pytest.raises(RuntimeError, match="in use"):
        backend.slots.reserve_slots(5)
    backend.release()
    assert [backend.slots.slot_length(s) for s in range(4)] == [0] * 4


def test_torch_backend_prefill_that_fails_leaves_every_slot_free(tiny_model_dir):
    backend = TorchBackend(str(tiny_model_dir), dtype="float32", device="cpu", max_length=16, batch_size=2)
    ids = torch.randint(3, 2000, (2, 20))
    mask = torch.ones_like(ids)
    mask[0, :10] = 0  # row 0 fits (10 tokens), row 1 does not (20)
    with pytest.raises(ValueError, match="positions"):
        backend.prefill(ids, mask)
    assert [backend.slots.slot_length(s) for s in range(2)] == [0, 0]
    ok_ids, ok_mask = prompts(batch=2)
    assert backend.prefill(ok_ids, ok_mask).shape[0] == 2


@needs_native
def test_the_slot_backend_measures_the_prefetch_over_every_native_linear_of_the_model(tiny_model_dir, monkeypatch):
    """Once, after every linear is swapped: one layer's weights could sit in a cache and mislead it. (Weights
    in pair panels have no one-row distance: the plain layout here, whatever the load-time choice would be.)"""
    monkeypatch.setenv(cpu_kernels.ENV, "auto")
    monkeypatch.setenv(fast_linear.PAIRS_ENV, "off")
    calls = []
    monkeypatch.setattr(cpu_kernels, "tune_one_row_prefetch",
                        lambda kernels, weights, x_dtype: calls.append((kernels, weights, x_dtype)) or 1024)
    backend = TorchSlotBackend.from_pretrained(str(tiny_model_dir), max_slots=2, max_length=64, dtype="float32",
                                               weight_dtype="bfloat16")
    native = [m for module in (backend.model, *backend._fused) for m in module.modules() if isinstance(m, NativeLinear)]
    assert len(calls) == 1 and len(native) > 2
    kernels, weights, x_dtype = calls[0]
    assert kernels is NATIVE and x_dtype == torch.float32
    assert {w.data_ptr() for w in weights} == {m.weight.data_ptr() for m in native}
    assert all(w.dtype == torch.bfloat16 for w in weights)


def test_slot_backend_fuses_projections_and_frees_the_originals_of_its_own_model(tiny_model_dir):
    backend = TorchSlotBackend.from_pretrained(str(tiny_model_dir), max_slots=2, max_length=64, dtype="float32",
                                               device="cpu")
    assert all(f is not None for f in backend._fused)
    layer = backend.model.model.layers[0]
    assert not hasattr(layer.self_attn, "q_proj") and not hasattr(layer.mlp, "gate_proj")
    cfg = backend.model.config
    assert backend._fused[0].qkv_proj.out_features == cfg.hidden_size + 2 * cfg.num_key_value_heads * backend.head_dim


@torch.inference_mode()
def test_slot_backend_on_a_shared_model_leaves_it_usable_and_fused_equals_separate(tiny_model_dir):
    model = load(tiny_model_dir, torch.float32)
    ids = prompts(batch=1)[0]
    before = model(ids).logits
    logits = []
    for fuse in (True, False):
        backend = TorchSlotBackend(model, max_slots=1, max_length=64, fuse=fuse)
        assert all((f is not None) == fuse for f in backend._fused)
        got = [backend.prefill_slot(0, ids[0].tolist())]
        got += [backend.decode_slots([0], [int(got[-1].argmax())])[0] for _ in range(3)]
        logits.append(torch.stack(got))
    torch.testing.assert_close(model(ids).logits, before, atol=0, rtol=0)
    torch.testing.assert_close(logits[0], logits[1], atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_slot_rotary_is_hf_rotary_bit_for_bit(dtype):
    """``_rotate`` with the signed-sin table: HF's ``apply_rotary_pos_emb``, not merely close to it."""
    from transformers.models.llama.modeling_llama import apply_rotary_pos_emb

    from llama_engine.backends.torch_backend import _rotate, _signed_sin

    gen = torch.Generator().manual_seed(0)
    q = torch.randn(5, 4, 3, 64, generator=gen).to(dtype)  # [batch, heads, positions, head_dim]
    k = torch.randn(5, 2, 3, 64, generator=gen).to(dtype)
    angles = torch.randn(5, 3, 32, generator=gen) * 50
    cos, sin = torch.cat([angles.cos()] * 2, -1).to(dtype), torch.cat([angles.sin()] * 2, -1).to(dtype)
    want_q, want_k = apply_rotary_pos_emb(q, k, cos, sin)
    signed = _signed_sin(sin).unsqueeze(1)
    assert torch.equal(_rotate(q, cos.unsqueeze(1), signed), want_q)
    assert torch.equal(_rotate(k, cos.unsqueeze(1), signed), want_k)


def test_cpu_prompts_attend_by_blocks_in_bf16_unless_amx_reads_a_bf16_cache_and_in_float32_over_a_bf16_cache(
        tiny_model_dir, monkeypatch, kernels):
    """float16 products are slow on a CPU without native fp16 (slower by blocks than through SDPA)."""
    monkeypatch.setattr(cpu_info, "cpu_flags", lambda: AVX512_BF16)
    for dtype, by_blocks in ((torch.bfloat16, True), (torch.float16, False), (torch.float32, False)):
        assert TorchSlotBackend(load(tiny_model_dir, dtype), max_slots=1, max_length=32)._prompt_by_blocks is by_blocks
    over_bf16 = TorchSlotBackend(load(tiny_model_dir, torch.float32), 1, 32, kv_cache_dtype="bfloat16")
    assert over_bf16._prompt_by_blocks
    cpu, bf16, fp32 = torch.device("cpu"), torch.bfloat16, torch.float32
    assert not prompts_attend_by_blocks(bf16, bf16, cpu, AMX)
    assert prompts_attend_by_blocks(bf16, fp32, cpu, AMX)  # kv_cache_dtype: float32 set on an AMX CPU
    assert prompts_attend_by_blocks(bf16, bf16, cpu, AVX512_BF16)
    assert not prompts_attend_by_blocks(bf16, bf16, torch.device("cuda"), AVX512_BF16)
    assert prompts_attend_by_blocks(fp32, bf16, cpu, AMX) and prompts_attend_by_blocks(fp32, bf16, cpu, AVX2)
    assert not prompts_attend_by_blocks(fp32, fp32, cpu, AVX2)
    assert not prompts_attend_by_blocks(fp32, bf16, torch.device("cuda"), AVX2)


@needs_native
@pytest.mark.parametrize("dtype", DTYPES)
def test_fused_small_ops_compute_what_the_torch_ops_do(tiny_model_dir, dtype, monkeypatch):
    """The native path's fused residual-add + RMSNorm, rotary + cache write and SiLU-times-up against the torch
    ops they replace, on the same weights: chunked prompts, decode rows of different lengths, a mixed pass."""
    monkeypatch.setenv(cpu_kernels.ENV, "auto")
    model = load(tiny_model_dir, getattr(torch, dtype))
    fused, plain = (TorchSlotBackend(model, max_slots=3, max_length=128) for _ in range(2))
    assert fused._fused_ops and plain._fused_ops
    plain._fused_ops, plain._decode_layers_rows = False, 0
    prompts_ = [prompts(batch=1, length=n, seed=n)[0][0].tolist() for n in (40, 7, 61)]
    logits = []
    for backend in (fused, plain):
        got = [backend.prefill_slot(0, prompts_[0]), backend.prefill_slot(1, prompts_[1])]
        tokens = [int(g.argmax()) for g in got]
        step = backend.step_slots([0, 1], tokens, [PrefillChunk(2, prompts_[2][:30], 0)])  # mixed pass
        got += list(step.decode) + step.prefills
        tokens = [int(g.argmax()) for g in step.decode]
        step = backend.step_slots([0, 1], tokens, [PrefillChunk(2, prompts_[2][30:], 30)])
        got += list(step.decode) + step.prefills
        got += list(backend.decode_slots([0, 1, 2], [5, 6, 7]))
        logits.append(torch.stack(got))
    assert_close(logits[0], logits[1], dtype)
    tolerance = {"atol": 0.05, "rtol": 0.02} if dtype == "bfloat16" else {"atol": 1e-5, "rtol": 1e-4}
    for cache in ("k_cache", "v_cache"):  # the same keys and values at the same slots and positions
        torch.testing.assert_close(getattr(fused, cache).float(), getattr(plain, cache).float(), **tolerance)


def test_fused_small_ops_only_for_models_they_compute(tiny_model_dir, monkeypatch):
    """Another norm or activation, or unfused projections, keep the torch ops."""
    if NATIVE is None:
        backend = TorchSlotBackend(load(tiny_model_dir, torch.float32), max_slots=1, max_length=32)
        assert not backend._fused_ops
        return
    model = load(tiny_model_dir, torch.float32)
    assert TorchSlotBackend(model, max_slots=1, max_length=32)._fused_ops
    assert not TorchSlotBackend(model, max_slots=1, max_length=32, fuse=False)._fused_ops
    model.model.layers[1].mlp.act_fn = torch.nn.GELU()
    assert not TorchSlotBackend(model, max_slots=1, max_length=32)._fused_ops
    monkeypatch.setenv(cpu_kernels.ENV, "0")
    assert not TorchSlotBackend(load(tiny_model_dir, torch.float32), max_slots=1, max_length=32)._fused_ops


class CountedCalls:
    """Wraps the backend's native decode layers and counts the calls: ``calls`` of decode rows only (a call
    without ``chunks``, or ``decode_step``), ``prompts`` of passes with prompt chunks (``chunks`` given)."""

    def __init__(self, inner):
        self.inner, self.calls, self.prompts = inner, 0, 0
        self.head, self.embedding = inner.head, inner.embedding

    def __call__(self, *args, **kwargs):
        if not kwargs.get("chunks"):
            self.calls += 1
        else:
            self.prompts += 1
        return self.inner(*args, **kwargs)

    def decode_step(self, *args):
        self.calls += 1
        return self.inner.decode_step(*args)


@needs_native
@pytest.mark.parametrize("dtype, weight_dtype, kv", [("float32", None, "auto"), ("float32", torch.bfloat16, "auto"),
                                                     ("float32", torch.bfloat16, "bfloat16"),
                                                     pytest.param("bfloat16", None, "auto", marks=BF16),
                                                     ("float32", torch.int8, "auto"), ("bfloat16", torch.int8, "auto")])
def test_decode_steps_run_their_layers_in_one_native_call_with_the_python_loops_numbers(tiny_model_dir, dtype,
                                                                                        weight_dtype, kv,
                                                                                        monkeypatch):
    """Decode-only passes (one row, rows of different lengths in slots out of order) through
    ``DecodeLayers``: the logits and K/V cache of the Python layer loop, bit for bit; a pass of more rows than
    the call runs keeps the Python loop. The prompts (each alone in its pass) and a mixed pass go through it
    too where they attend through the native prompt kernel. A bf16 cache under float32 arithmetic too.
    float32 weights off the ``avx2`` class run natively where the load-time measurement picks the native
    kernels (here forced by ``LLAMA_PACKED_LINEAR=native``); their weights are gathered as well."""
    cpu, torch_dtype = torch.device("cpu"), getattr(torch, dtype)
    measured = weight_dtype is None and fast_linear.native_kernels_for(torch_dtype, cpu) is None
    if measured and fast_linear.measured_native_kernels(torch_dtype, cpu) is not None:
        monkeypatch.setenv(fast_linear.ENV, "native")
        measured = False
    backends = [TorchSlotBackend(load(tiny_model_dir, torch_dtype), max_slots=4, max_length=96,
                                 owns_model=True, weight_dtype=weight_dtype, kv_cache_dtype=kv) for _ in range(2)]
    native, python = backends
    bf16_cache = kv == "bfloat16" or dtype == "bfloat16" or weight_dtype in (torch.bfloat16, torch.int8)  # auto: the
    # weights' (int8 weights: bf16 ones')
    assert native.kv_dtype == (torch.bfloat16 if bf16_cache else torch.float32)
    if measured:
        assert native._decode_layers is None  # such products are oneDNN's on this CPU (bf16 on AMX)
        return
    assert native._decode_layers is not None and native._logits_natively  # the final norm and LM head too
    products = native._step_products(native._fused)
    assert len({p.weight.untyped_storage().data_ptr() for p in products}) == 1  # gathered into one block
    python._decode_layers_rows = 0
    native._decode_layers = counted = CountedCalls(native._decode_layers)
    prompts_ = [prompts(batch=1, length=n, seed=n)[0][0].tolist() for n in (30, 5, 17, 12)]
    logits = []
    with torch.inference_mode():
        for backend in backends:
            got = [backend.prefill_slot(slot, prompts_[slot]) for slot in (3, 1, 0)]
            got += list(backend.decode_slots([1], [int(got[1].argmax())]))
            for _ in range(3):
                got += list(backend.decode_slots([3, 0, 1], [int(g.argmax()) for g in got[-3:]]))
            step = backend.step_slots([0, 3], [4, 5], [PrefillChunk(2, prompts_[2], 0)])  # mixed
            got += list(step.decode) + step.prefills
            backend._decode_layers_rows = min(backend._decode_layers_rows, 2)
            got += list(backend.decode_slots([0, 1, 2], [6, 7, 8]))  # more rows than it runs: the Python loop
            logits.append(torch.stack(got))
    assert counted.calls == 4 and counted.prompts == (4 if native._prompt_kernels is not None else 0)
    assert torch.equal(logits[0], logits[1])
    assert torch.equal(native.k_cache, python.k_cache) and torch.equal(native.v_cache, python.v_cache)


@needs_native
@pytest.mark.parametrize("dtype, weight_dtype, kv", [("float32", torch.bfloat16, "auto"),
                                                     ("float32", torch.bfloat16, "float32"), ("float32", torch.int8, "auto"),
                                                     pytest.param("bfloat16", None, "auto", marks=[BF16, needs_bf16_native])])
def test_a_prompt_alone_runs_its_layers_in_one_native_call_with_the_python_loops_numbers(tiny_model_dir, dtype,
                                                                                        weight_dtype, kv,
                                                                                        monkeypatch):
    """Passes with prompt chunks through ``DecodeLayers`` where they attend through the native prompt kernel (on
    AMX's tiles where the backend takes them): a whole prompt, a first chunk and a later one over the cache, a
    one-token prompt, two prompts together (micro-batching's prefill), and decode rows beside a first chunk and
    a later one (continuous batching's mixed pass): the logits and the K/V cache of the Python layer loop, bit
    for bit."""
    monkeypatch.setattr(torch_backend, "native_prompt_pays", lambda *args, **kwargs: True)  # whatever this CPU measures
    if dtype == "bfloat16":  # and bf16 prompts' products native, which a Zen 5 EPYC's load-time timing leaves to oneDNN
        monkeypatch.setenv(fast_linear.WIDE_ENV, "native")
    backends = [TorchSlotBackend(load(tiny_model_dir, getattr(torch, dtype)), max_slots=6, max_length=320,
                                 owns_model=True, weight_dtype=weight_dtype, kv_cache_dtype=kv) for _ in range(2)]
    native, python = backends
    assert native._decode_layers is not None and native._prompt_kernels is not None and native._logits_natively
    python._decode_layers_rows = 0
    native._decode_layers = counted = CountedCalls(native._decode_layers)
    tiles = []
    inner = counted.inner
    counted.inner = lambda *args, **kwargs: tiles.append(kwargs.get("tiles")) or inner(*args, **kwargs)
    ids = prompts(batch=1, length=300)[0][0].tolist()
    logits = []
    with torch.inference_mode():
        for backend in backends:
            got = [backend.prefill_slot(0, ids), backend.prefill_slot(2, ids[:1])]
            backend.step_slots([], [], [PrefillChunk(1, ids[:140], 0)])
            got += backend.step_slots([], [], [PrefillChunk(1, ids[140:], 140)]).prefills
            got += backend.step_slots([], [], [PrefillChunk(3, ids[:37], 0), PrefillChunk(4, ids[50:60], 0)]).prefills
            step = backend.step_slots([2, 0], [7, 8], [PrefillChunk(3, ids[37:90], 37), PrefillChunk(5, ids[:5], 0)])
            got += list(step.decode) + step.prefills
            logits.append(torch.stack(got))
    assert counted.prompts == 6 and counted.calls == 0
    assert tiles == [native._prompt_tiles] * 6
    assert torch.equal(logits[0], logits[1])
    assert torch.equal(native.k_cache, python.k_cache) and torch.equal(native.v_cache, python.v_cache)
    assert [native.slot_length(s) for s in range(6)] == [301, 300, 2, 90, 10, 5]


@needs_native
def test_a_native_decode_step_hands_its_greedy_picks_over_with_its_logits_and_only_there(tiny_model_dir):
    """A decode step whose call ends with the logits gives each row's greedy pick in ``StepLogits.picks``: the
    argmax of its logits and that token's log_softmax. Nothing else carries picks: not the logits it returns,
    not ``decode_slots``' (whose caller may change them in place), not a pass with a prompt chunk; but the
    static batch's ``decode``, whose logits go straight to the engine's selection."""
    backend = TorchSlotBackend(load(tiny_model_dir, torch.float32), max_slots=4, max_length=64, owns_model=True,
                               weight_dtype=torch.bfloat16)
    assert backend._logits_natively
    ids = prompts(batch=1, length=12)[0][0].tolist()
    with torch.inference_mode():
        firsts = [backend.prefill_slot(slot, ids[slot:]) for slot in range(3)]
        step = backend.step_slots([2, 0], [int(firsts[2].argmax()), int(firsts[0].argmax())], [])
        tokens, logprobs = step.picks
        assert tokens == step.decode.argmax(-1).tolist()
        want = step.decode.log_softmax(-1).gather(1, step.decode.argmax(-1, keepdim=True)).squeeze(1).tolist()
        assert logprobs == pytest.approx(want, rel=1e-5, abs=1e-6)
        assert take_greedy_picks(step.decode) is None
        assert take_greedy_picks(backend.decode_slots([1], [int(firsts[1].argmax())])) is None
        mixed = backend.step_slots([1], [3], [PrefillChunk(3, ids[:4], 0)])
        assert mixed.picks is None and mixed.decode.shape[0] == 1
        for slot in range(4):
            backend.free_slot(slot)
        static = SlotBatchBackend(backend)  # micro-batching's backend: its decode hands them to the engine
        first = static.prefill(torch.tensor([ids[:5], ids[2:7]]), torch.ones(2, 5, dtype=torch.long))
        logits = static.decode(first.argmax(-1))
        assert take_greedy_picks(logits)[0] == logits.argmax(-1).tolist()


@needs_native
def test_an_lm_head_with_a_bias_runs_after_the_native_call_with_the_python_loops_numbers(tiny_model_dir):
    """The native call ends with the logits only where the backend would run the LM head with the layers' own
    kernels: a head with a bias runs from Python after it, and the logits stay the Python loop's."""
    def with_biased_head():
        model = load(tiny_model_dir, torch.float32)
        head = torch.nn.Linear(model.lm_head.in_features, model.lm_head.out_features, bias=True)
        with torch.no_grad():
            head.weight.copy_(model.lm_head.weight)
            head.bias.copy_(torch.linspace(-1, 1, head.out_features))
        model.lm_head = head
        return TorchSlotBackend(model, max_slots=2, max_length=64, owns_model=True, weight_dtype=torch.bfloat16)

    native, python = with_biased_head(), with_biased_head()
    assert native._decode_layers is not None and not native._logits_natively
    python._decode_layers_rows = 0
    ids = prompts(batch=1, length=20)[0][0].tolist()
    logits = []
    with torch.inference_mode():
        for backend in (native, python):
            first = backend.prefill_slot(0, ids)
            logits.append(torch.cat([first[None], backend.decode_slots([0], [int(first.argmax())])]))
    assert torch.equal(logits[0], logits[1])


@needs_native
def test_decode_layers_only_where_every_product_is_native_without_a_bias_or_unless_switched_off(tiny_model_dir,
                                                                                                monkeypatch):
    """float32 arithmetic over the products the native kernels run on this CPU: float32 weights on an
    ``avx2`` CPU, bf16 weights on either build (float32 weights off ``avx2`` are oneDNN's: no such call)."""
    cpu = torch.device("cpu")
    if fast_linear.native_kernels_for(torch.float32, cpu) is not None:
        options, max_rows = {}, fast_linear.native_max_rows
    else:
        assert TorchSlotBackend(load(tiny_model_dir, torch.float32), max_slots=1, max_length=32,
                                owns_model=True)._decode_layers is None
        options = {"weight_dtype": torch.bfloat16}
        max_rows = lambda kernels: fast_linear.native_max_rows(kernels, fast_linear.BF16_WEIGHT_MAX_ROWS,  # noqa: E731
                                                               torch.bfloat16)
    backend = TorchSlotBackend(load(tiny_model_dir, torch.float32), max_slots=1, max_length=32, owns_model=True,
                               **options)
    assert backend._decode_layers is not None and backend._decode_layers_rows == max_rows(backend._kernels)
    shared = TorchSlotBackend(load(tiny_model_dir, torch.float32), max_slots=1, max_length=32,
                              **options)  # o/down not swapped
    assert shared._fused_ops and shared._decode_layers is None and shared._decode_layers_rows == 0
    model = load(tiny_model_dir, torch.float32)
    model.model.layers[1].self_attn.o_proj.bias = torch.nn.Parameter(torch.zeros(model.config.hidden_size))
    assert TorchSlotBackend(model, max_slots=1, max_length=32, owns_model=True, **options)._decode_layers is None
    monkeypatch.setenv("LLAMA_DECODE_LAYERS", "0")
    assert TorchSlotBackend(load(tiny_model_dir, torch.float32), max_slots=1, max_length=32, owns_model=True,
                            **options)._decode_layers is None


def test_on_off_switches_take_their_spellings_and_name_a_typo(monkeypatch, tiny_model_dir):
    """``LLAMA_PACKED_LINEAR``, ``LLAMA_GATHER_WEIGHTS`` and ``LLAMA_DECODE_LAYERS``: 0/off/false/no, 1/on/true/yes
    in any case, or the switch's own words; a typo is a ValueError naming the switch, not a silent "on"."""
    switches = ((fast_linear.ENV, ("auto", "native")), (fast_linear.GATHER_ENV, ("auto",)),
                (torch_backend.DECODE_LAYERS_ENV, ("auto",)))
    for name, words in switches:
        for spelled, meant in [(v, "off") for v in ("0", "OFF", " false ", "no")] + \
                              [(v, "on") for v in ("1", "On", "true", "YES")] + [(w, w) for w in words]:
            monkeypatch.setenv(name, spelled)
            assert fast_linear.switch_setting(name, "auto", *words) == meant
        monkeypatch.setenv(name, "of")
        with pytest.raises(ValueError, match=re.escape(f"{name}='of': use 0, 1")):
            fast_linear.switch_setting(name, "auto", *words)
        monkeypatch.delenv(name)
        assert fast_linear.switch_setting(name, "auto", "auto") == "auto"
    monkeypatch.setenv(fast_linear.ENV, "nativ")
    with pytest.raises(ValueError, match="LLAMA_PACKED_LINEAR='nativ'"):
        pack_linears(load(tiny_model_dir, torch.float32))
    monkeypatch.delenv(fast_linear.ENV)
    monkeypatch.setenv(fast_linear.GATHER_ENV, "of")
    with pytest.raises(ValueError, match="LLAMA_GATHER_WEIGHTS='of'"):
        fast_linear.gather_weights([torch.nn.Linear(8, 8)])


@pytest.mark.parametrize("dtype, weight_dtype", [pytest.param(torch.float32, torch.bfloat16, marks=needs_native),
                                                  pytest.param(torch.bfloat16, None, marks=needs_bf16_native),
                                                  pytest.param(torch.float32, torch.int8, marks=needs_native)])
def test_a_slot_backend_of_its_own_model_gathers_the_weights_a_decode_step_streams_in_its_order(
        tiny_model_dir, monkeypatch, caplog, dtype, weight_dtype):
    """q/k/v, o, gate/up and down of every layer, one after another in one block (``gather_weights``), with
    the logits and cache of the weights where they were loaded, bit for bit; ``LLAMA_GATHER_WEIGHTS=0``
    leaves them there. Over bf16 weights, which every native build runs (float32 ones only ``avx2``), under
    float32 arithmetic and in a bf16 model (fused into their places, and in pair panels where they go).
    Every layer's weights but the first's are written to their places as they are laid out."""
    def backend():
        return TorchSlotBackend(load(tiny_model_dir, dtype), max_slots=2, max_length=64, owns_model=True,
                                weight_dtype=weight_dtype)

    def run(b):
        with torch.inference_mode():
            got = [b.prefill_slot(0, prompts(batch=1, length=11)[0][0].tolist())]
            got += [b.decode_slots([0], [int(got[-1].argmax())])[0] for _ in range(3)]
        return torch.stack(got)

    with caplog.at_level(logging.INFO, logger=fast_linear.__name__):
        gathered = backend()
    products = gathered._step_products(gathered._fused)
    layers = gathered.model.config.num_hidden_layers
    assert len(products) == 4 * layers and gathered._decode_layers is not None
    assert f"({4 * layers - 4} laid out there, 4 copied in)" in caplog.text
    storages = {p.weight.untyped_storage().data_ptr() for p in products}
    pointers = [p.weight.data_ptr() for p in products]
    assert len(storages) == 1 and pointers == sorted(pointers)
    for earlier, later in zip(products, products[1:]):
        int8 = earlier.weight.dtype == torch.int8  # its scales behind it
        end = earlier.weight.data_ptr() + (int8_rows.nbytes(earlier.weight.shape) if int8 else
                                           earlier.weight.numel() * earlier.weight.element_size())
        assert not int8 or int8_rows.carries_scales(earlier.weight)
        assert 0 <= later.weight.data_ptr() - end < fast_linear.GATHER_ALIGN
    monkeypatch.setenv(fast_linear.GATHER_ENV, "0")
    loaded = backend()
    assert len({p.weight.untyped_storage().data_ptr() for p in loaded._step_products(loaded._fused)}) == len(products)
    assert torch.equal(run(gathered), run(loaded))
    assert torch.equal(gathered.k_cache, loaded.k_cache) and torch.equal(gathered.v_cache, loaded.v_cache)


@needs_native
def test_native_linear_keeps_bf16_weights_for_float32_rows_on_either_side_of_its_row_limit(monkeypatch):
    """``weight_dtype`` bfloat16 under float32 arithmetic: half the bytes kept, the product of the widened
    weight in float32 (natively up to ``max_rows`` rows, over a float32 copy beyond)."""
    torch.manual_seed(0)
    calls = []
    monkeypatch.setattr(NATIVE, "linear", lambda x, w, _f=NATIVE.linear, **kw: calls.append((x.dtype, w.dtype)) or _f(x, w, **kw))
    linear = torch.nn.Linear(96, 80, bias=True)
    native = NativeLinear(linear, NATIVE, max_rows=6, weight_dtype=torch.bfloat16)
    assert native.weight.dtype == torch.bfloat16 and native.bias.dtype == torch.float32
    widened = linear.weight.detach().to(torch.bfloat16).float()
    for shape in ((1, 96), (3, 2, 96), (6, 96), (7, 96), (300, 96)):
        x = torch.randn(shape)
        calls.clear()
        with torch.inference_mode():
            got = native(x)
        rows = x.numel() // 96
        assert calls == ([(torch.float32, torch.bfloat16)] if rows <= 6 else [])
        assert got.dtype == torch.float32
        torch.testing.assert_close(got, torch.nn.functional.linear(x, widened, linear.bias.detach()),
                                   atol=1e-5, rtol=1e-5)


def test_weight_dtype_auto_keeps_a_bf16_checkpoint_in_bf16_only_under_float32_on_the_native_kernels(monkeypatch):
    from llama_engine.backends import torch_backend

    cpu, gpu = torch.device("cpu"), torch.device("cuda")
    kernels = object()
    monkeypatch.setattr(fast_linear.cpu_kernels, "for_device", lambda device: kernels)
    weight_dtype_for = torch_backend.weight_dtype_for
    assert weight_dtype_for("auto", torch.float32, cpu, "bfloat16") == torch.bfloat16
    assert weight_dtype_for("auto", torch.float32, cpu, "float32") == torch.float32
    assert weight_dtype_for("auto", torch.float32, cpu, "float16") == torch.float32, "bf16 would round fp16 weights"
    assert weight_dtype_for("auto", torch.float32, cpu, None) == torch.float32
    assert weight_dtype_for("auto", torch.bfloat16, cpu, "bfloat16") == torch.bfloat16
    assert weight_dtype_for("auto", torch.float32, gpu, "bfloat16") == torch.float32
    assert weight_dtype_for("float32", torch.float32, cpu, "bfloat16") == torch.float32
    assert weight_dtype_for("float32", torch.bfloat16, cpu, "bfloat16") == torch.bfloat16, "never wider than the arithmetic"
    assert weight_dtype_for("bfloat16", torch.float32, cpu, "float32") == torch.bfloat16
    assert weight_dtype_for("bfloat16", torch.bfloat16, gpu, None) == torch.bfloat16
    with pytest.raises(ValueError, match=r"handler\.weight_dtype bfloat16 under float32 arithmetic on cuda"):
        weight_dtype_for("bfloat16", torch.float32, gpu, "bfloat16")
    monkeypatch.setattr(fast_linear.cpu_kernels, "for_device", lambda device: None)
    assert weight_dtype_for("auto", torch.float32, cpu, "bfloat16") == torch.float32
    with pytest.raises(ValueError, match="AVX2 and FMA"):
        weight_dtype_for("bfloat16", torch.float32, cpu, "bfloat16")


@pytest.fixture(scope="module")
def bf16_checkpoint(tiny_model_dir, tmp_path_factory):
    """The tiny model stored in bfloat16, as Llama 3's checkpoints are."""
    path = tmp_path_factory.mktemp("bf16") / "tiny-llama-bf16"
    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir, torch_dtype=torch.bfloat16, use_safetensors=True)
    model.save_pretrained(path, safe_serialization=True)
    return path


@needs_native
def test_a_bf16_checkpoint_under_float32_keeps_bf16_weights_and_the_float32_models_logits(bf16_checkpoint):
    """``dtype: float32`` over a bf16 checkpoint: the linears keep its bf16 weights (``weight_dtype: auto``),
    and prefill and decode give the logits of the same checkpoint widened to float32 at load."""
    kept = TorchSlotBackend.from_pretrained(str(bf16_checkpoint), 2, 64, "float32", "cpu", kv_cache_dtype="float32")
    widened = TorchSlotBackend.from_pretrained(str(bf16_checkpoint), 2, 64, "float32", "cpu", weight_dtype="float32")
    linears = [m for m in kept.model.modules() if isinstance(m, (NativeLinear, PackedLinear))]
    linears += [m for fused in kept._fused if fused is not None for m in fused.modules() if isinstance(m, NativeLinear)]
    assert linears and all(isinstance(m, NativeLinear) and m.weight.dtype == torch.bfloat16 for m in linears)
    assert kept.weight_dtype == torch.bfloat16 and widened.weight_dtype is None and kept.dtype == torch.float32
    with torch.inference_mode():
        prompt = [1] + list(range(10, 40))
        got, want = kept.prefill_slot(0, prompt), widened.prefill_slot(0, prompt)
        torch.testing.assert_close(got, want, atol=1e-4, rtol=1e-4)
        for _ in range(4):
            token = [int(want.argmax())]
            got, want = kept.decode_slots([0], token)[0], widened.decode_slots([0], token)[0]
            torch.testing.assert_close(got, want, atol=1e-4, rtol=1e-4)


@needs_native
def test_a_bf16_checkpoint_under_float32_widens_one_layer_at_a_time_to_the_same_logits(bf16_checkpoint, monkeypatch):
    """Loaded as stored and widened layer by layer but for its linears, which are fused and packed as loaded
    (never the whole model in float32, twice the checkpoint's bytes, nor a layer's linears), the backend
    computes what the model loaded in float32 does."""
    models, plain_float32 = [], []
    widen, of = torch_backend.widen_all_but_layers, FusedLlamaProjections.of
    monkeypatch.setattr(torch_backend, "widen_all_but_layers", lambda model, dtype: models.append(model) or
                        widen(model, dtype))

    def spy(layer, *args):
        plain_float32.append(sum(any(type(m) is torch.nn.Linear and m.weight.dtype == torch.float32
                                     for m in each.modules()) for each in models[0].model.layers))
        return of(layer, *args)

    monkeypatch.setattr(FusedLlamaProjections, "of", staticmethod(spy))
    new = TorchSlotBackend.from_pretrained(str(bf16_checkpoint), 2, 64, "float32", "cpu", kv_cache_dtype="float32")
    monkeypatch.undo()
    layers = new.model.config.num_hidden_layers
    assert plain_float32 == [0] * layers
    assert new.dtype == torch.float32 and new.weight_dtype == torch.bfloat16
    assert not any(type(m) is torch.nn.Linear for m in new.model.modules())
    assert all(p.dtype == torch.float32 for p in new.model.parameters())
    old = TorchSlotBackend(torch_backend.load_model(str(bf16_checkpoint), "float32", "cpu", 64), 2, 64,
                           owns_model=True, kv_cache_dtype="float32", weight_dtype=torch.bfloat16)
    with torch.inference_mode():
        prompt = [1] + list(range(10, 40))
        got, want = new.prefill_slot(0, prompt), old.prefill_slot(0, prompt)
        assert torch.equal(got, want)
        token = [int(want.argmax())]
        assert torch.equal(new.decode_slots([0], token)[0], old.decode_slots([0], token)[0])


@needs_native
def test_a_bf16_checkpoint_under_float32_with_packing_off_widens_its_linears_to_the_same_logits(bf16_checkpoint,
                                                                                               monkeypatch):
    """``LLAMA_PACKED_LINEAR=off`` leaves the linears as ``nn.Linear``: those of a layer kept as loaded in bf16
    are widened with it, and compute what the model loaded in float32 does."""
    monkeypatch.setenv(fast_linear.ENV, "off")
    new = TorchSlotBackend.from_pretrained(str(bf16_checkpoint), 2, 64, "float32", "cpu", kv_cache_dtype="float32")
    linears = [m for module in (new.model, *new._fused) if module is not None for m in module.modules()
               if type(m) is torch.nn.Linear]
    assert linears and all(m.weight.dtype == torch.float32 for m in linears)
    old = TorchSlotBackend(torch_backend.load_model(str(bf16_checkpoint), "float32", "cpu", 64), 2, 64,
                           owns_model=True, kv_cache_dtype="float32", weight_dtype=torch.bfloat16)
    with torch.inference_mode():
        prompt = [1] + list(range(10, 40))
        assert torch.equal(new.prefill_slot(0, prompt), old.prefill_slot(0, prompt))


@needs_native
def test_a_bf16_checkpoint_under_float32_gets_a_bf16_cache_and_its_logits_round_only_the_keys_and_values(
        bf16_checkpoint):
    """``kv_cache_dtype: auto`` over bf16 weights under float32 arithmetic: a bf16 cache (half the bytes
    a decode step reads), prompts attending by blocks in float32, and the logits of a float32 cache but
    for the keys' and values' rounding to bf16, prompt chunks and decode steps alike."""
    auto = TorchSlotBackend.from_pretrained(str(bf16_checkpoint), 2, 320, "float32", "cpu")
    exact = TorchSlotBackend.from_pretrained(str(bf16_checkpoint), 2, 320, "float32", "cpu", kv_cache_dtype="float32")
    assert auto.weight_dtype == torch.bfloat16 and auto.kv_dtype == auto.k_cache.dtype == torch.bfloat16
    assert auto._prompt_by_blocks and auto._decode_layers is not None and exact.kv_dtype == torch.float32
    prompt = [1] + [(i * 37) % 500 + 3 for i in range(299)]
    with torch.inference_mode():
        for backend in (auto, exact):  # a prompt in two chunks, the second attending to the cache
            backend.step_slots([], [], [PrefillChunk(0, prompt[:180], 0)])
        got, want = (b.step_slots([], [], [PrefillChunk(0, prompt[180:], 180)]).prefills[0] for b in (auto, exact))
        for _ in range(6):
            torch.testing.assert_close(got, want, atol=2e-2, rtol=0)
            assert int(got.argmax()) == int(want.argmax())
            token = [int(want.argmax())]
            got, want = auto.decode_slots([0], token)[0], exact.decode_slots([0], token)[0]
    assert not torch.equal(got, want), "a bf16 cache rounds the keys and values"


#: The native kernels' instruction sets this CPU runs.
RUNNABLE_ISAS = [isa for isa in cpu_kernels.ISAS if cpu_kernels.ISA_NEEDS[isa] <= cpu_info.cpu_flags()]


@pytest.mark.parametrize("isa", RUNNABLE_ISAS)
@pytest.mark.parametrize("kv_cache_dtype", ["float32", "bfloat16"])
def test_float32_prompt_chunks_attend_through_the_native_prompt_kernel_and_keep_the_logits(tiny_model_dir, monkeypatch,
                                                                                       kv_cache_dtype, isa):
    """A whole prompt, a first chunk and a later one (over the cache) go through ``prompt_attention``, once a
    layer but the last (where only the row with logits attends, as a decode row), on every build; the
    logits are the plain model's (a float32 cache) or within the bf16 cache's rounding. The layers run from
    Python: on an AVX2-only CPU the one native call for all layers takes a prompt's rows too, and attends
    inside it."""
    monkeypatch.setenv(cpu_kernels.ENV, isa)
    monkeypatch.setenv(torch_backend.DECODE_LAYERS_ENV, "0")
    monkeypatch.setattr(torch_backend, "native_prompt_pays", lambda *args, **kwargs: True)  # whatever this CPU measures
    backend = TorchSlotBackend.from_pretrained(str(tiny_model_dir), 2, 320, "float32", "cpu",
                                               kv_cache_dtype=kv_cache_dtype)
    kernels = backend._prompt_kernels
    assert kernels is not None and kernels.isa == isa and backend.kv_dtype == getattr(torch, kv_cache_dtype)
    calls = []
    real = kernels.prompt_attention
    monkeypatch.setattr(kernels, "prompt_attention",
                        lambda q, k, v, scale, start=0, tiles=False: calls.append((q.shape[0], start, tiles))
                        or real(q, k, v, scale, start, tiles))
    layers = backend.model.config.num_hidden_layers - 1
    ids = prompts(batch=1, length=300)[0][0].tolist()
    want = reference_logits(load(tiny_model_dir, torch.float32), torch.tensor([ids]), torch.ones(1, 300), 3)
    tolerance = "float32" if kv_cache_dtype == "float32" else "bfloat16"
    with torch.inference_mode():
        got = [backend.prefill_slot(0, ids)]
        assert calls == [(300, 0, False)] * layers
        for _ in range(3):
            got.append(backend.decode_slots([0], [int(got[-1].argmax())])[0])
        for g, w in zip(got, want):
            assert_close(g, w[0], tolerance)
        calls.clear()
        backend.step_slots([], [], [PrefillChunk(1, ids[:140], 0)])
        (last,) = backend.step_slots([], [], [PrefillChunk(1, ids[140:], 140)]).prefills
    assert calls == [(140, 0, False)] * layers + [(160, 140, False)] * layers
    assert_close(last, want[0][0], tolerance)


@pytest.mark.parametrize("isa", RUNNABLE_ISAS)
def test_bf16_prompt_chunks_attend_through_the_native_prompt_kernel_where_torch_would_by_blocks(bf16_checkpoint,
                                                                                              monkeypatch, isa):
    """bf16 arithmetic on a CPU without AMX (where torch's way is :class:`_PromptAttention`'s blocks): a whole
    prompt, a first chunk and a later one go through ``prompt_attention`` once a layer but the last, on every
    build, and the logits stay within bf16 rounding of the blocks'. An AMX CPU takes SDPA's bf16 kernel where
    the build has no tiles, and the tiles where it has (the next test)."""
    monkeypatch.setenv(cpu_kernels.ENV, isa)
    monkeypatch.setattr(torch_backend, "native_prompt_pays", lambda *args, **kwargs: True)  # whatever this CPU measures
    monkeypatch.setattr(torch_backend, "bf16_products_pay", lambda *args, **kwargs: False)  # the float32 products
    backend = TorchSlotBackend.from_pretrained(str(bf16_checkpoint), 2, 320, "bfloat16", "cpu")
    assert backend.dtype == backend.kv_dtype == torch.bfloat16
    if cpu_info.is_amx(cpu_info.cpu_flags()):
        assert not backend._prompt_by_blocks and backend._prompt_tiles == (isa == "avx512bf16")
        assert (backend._prompt_kernels is None) == (isa != "avx512bf16")
        return
    kernels = backend._prompt_kernels
    assert kernels is not None and kernels.isa == isa and backend._prompt_by_blocks and not backend._prompt_tiles
    native, blocks = native_and_torch_prompts(backend, kernels, monkeypatch, tiles=False)
    for got, want in zip(native, blocks):
        assert_close(got, want)
    assert not torch.equal(native[0], blocks[0]), "the blocks round their scores and weights to bf16; the kernel does not"


def native_and_torch_prompts(backend, kernels, monkeypatch, tiles: bool):
    """A whole 300-token prompt (slot 0), then the same as chunks of 140 and 160 (slot 1), first through the
    native prompt kernel, which must be called once a layer but the last with ``tiles``, then torch's way:
    each way's last logits of the two (float32). The Python layer loop's calls (a prompt alone in its pass
    runs its layers in one native call otherwise, tested on its own)."""
    monkeypatch.setattr(backend, "_decode_layers", None)
    calls = []
    real = kernels.prompt_attention
    monkeypatch.setattr(kernels, "prompt_attention",
                        lambda q, k, v, scale, start=0, tiles=False: calls.append((q.dtype, q.shape[0], start, tiles))
                        or real(q, k, v, scale, start, tiles))
    layers = backend.model.config.num_hidden_layers - 1
    ids = prompts(batch=1, length=300)[0][0].tolist()

    def run(attend_natively: bool):
        backend._prompt_kernels = kernels if attend_natively else None
        backend.free_slot(0), backend.free_slot(1)
        whole = backend.prefill_slot(0, ids)
        backend.step_slots([], [], [PrefillChunk(1, ids[:140], 0)])
        (last,) = backend.step_slots([], [], [PrefillChunk(1, ids[140:], 140)]).prefills
        return whole.float(), last.float()

    with torch.inference_mode():
        native = run(True)
        assert calls == [(torch.bfloat16, 300, 0, tiles)] * layers + [(torch.bfloat16, 140, 0, tiles)] * layers + [
            (torch.bfloat16, 160, 140, tiles)] * layers
        calls.clear()
        torch_way = run(False)
    assert not calls
    return native, torch_way


@pytest.mark.skipif(NATIVE is None or NATIVE.isa != "avx512bf16", reason="this CPU does not run the avx512bf16 build")
def test_bf16_prompt_chunks_attend_in_bf16_products_where_the_cpu_runs_them(bf16_checkpoint, monkeypatch):
    """bf16 arithmetic over a bf16 cache on the avx512bf16 build: a whole prompt, a first chunk and a later one
    attend in bf16 products (``tiles=True``: AMX's tiles, or without AMX AVX512_BF16's dot products where they
    measure faster than the float32 products) once a layer but the last, and the logits stay within bf16
    rounding of torch's way there: SDPA's bf16 flash kernel on an AMX CPU, else the bf16 blocks."""
    monkeypatch.setenv(cpu_kernels.ENV, "avx512bf16")
    monkeypatch.setattr(torch_backend, "native_prompt_pays", lambda *args, **kwargs: kwargs["tiles"])
    monkeypatch.setattr(torch_backend, "bf16_products_pay", lambda *args, **kwargs: True)
    backend = TorchSlotBackend.from_pretrained(str(bf16_checkpoint), 2, 320, "bfloat16", "cpu")
    assert backend._prompt_tiles and backend._prompt_by_blocks == (not NATIVE.amx)
    kernels = backend._prompt_kernels
    assert kernels is not None and kernels.isa == "avx512bf16"
    products, torch_way = native_and_torch_prompts(backend, kernels, monkeypatch, tiles=True)
    for got, want in zip(products, torch_way):
        assert_close(got, want)


@needs_dot_products
def test_bf16_dot_products_are_timed_against_the_float32_products_once_per_shape(bf16_checkpoint, monkeypatch,
                                                                                caplog):
    """:func:`bf16_products_pay` times the native prompt kernel's two kinds of products once per process and
    shape (logging both); the bf16 ones must win by :data:`BF16_PRODUCTS_MARGIN`, and where they do not, the
    backend keeps the float32 ones."""
    monkeypatch.setattr(torch_backend, "_BF16_PRODUCTS_DECISIONS", {})
    calls = []
    real = NATIVE.prompt_attention
    monkeypatch.setattr(NATIVE, "prompt_attention",
                        lambda *args, **kwargs: calls.append(kwargs.get("tiles", False)) or real(*args, **kwargs))
    with caplog.at_level(logging.INFO, logger=torch_backend.__name__):
        decision = torch_backend.bf16_products_pay(NATIVE, 4, 2, 64)
        assert torch_backend.bf16_products_pay(NATIVE, 4, 2, 64) is decision
    assert sorted(calls) == [False] * 5 + [True] * 5  # a warm-up round and 4 timed ones each, then the cached decision
    assert re.search(r"prompt attention, bf16 over a bf16 cache, 512 tokens, \d+ threads: float32 products [\d.]+ ms, "
                     r"AVX512_BF16 dot products [\d.]+ ms \(each the mean of its two fastest passes\) -> (bf16|float32)",
                     caplog.text)
    passes = {"float32": [1.0, 1.0], "bf16": [0.95, 0.95]}  # 5% faster: within the margin
    assert cpu_kernels.choose_fastest(passes, "float32", torch_backend.BF16_PRODUCTS_MARGIN) == "float32"
    monkeypatch.setattr(torch_backend, "bf16_products_pay", lambda *args, **kwargs: False)
    monkeypatch.setattr(torch_backend, "native_prompt_pays", lambda *args, **kwargs: True)
    backend = TorchSlotBackend.from_pretrained(str(bf16_checkpoint), 1, 64, "bfloat16", "cpu")
    assert not backend._prompt_tiles and backend._prompt_kernels is not None


@needs_native
def test_prompts_attend_natively_only_where_the_kernel_measures_as_fast_once_per_shape(tiny_model_dir, monkeypatch,
                                                                                     caplog):
    """:func:`native_prompt_pays` times the kernel against torch's way once per process and shape (logging
    both), and the backend keeps torch's way where the kernel loses."""
    monkeypatch.setattr(torch_backend, "_PROMPT_DECISIONS", {})
    kernels = cpu_kernels.load()
    calls = []
    real = kernels.prompt_attention
    monkeypatch.setattr(kernels, "prompt_attention", lambda *args, **kwargs: calls.append(args[0].shape) or real(*args, **kwargs))
    with caplog.at_level(logging.INFO, logger=torch_backend.__name__):
        decision = torch_backend.native_prompt_pays(kernels, torch.float32, torch.bfloat16, 4, 2, 32)
        measured = len(calls)
        assert torch_backend.native_prompt_pays(kernels, torch.float32, torch.bfloat16, 4, 2, 32) is decision
    assert measured == 5 and len(calls) == measured  # a warm-up round and 4 timed ones, then the cached decision
    assert calls[0] == (torch_backend.PROMPT_SAMPLE_TOKENS, 4, 32)
    logged = re.search(r"prompt attention, torch.float32 over a torch.bfloat16 cache, 512 tokens, \d+ threads: native "
                       r"([\d.]+) ms, torch ([\d.]+) ms \(each the mean of its two fastest passes\) -> (native|torch)",
                       caplog.text)
    assert logged and logged[3] == ("native" if decision else "torch")
    # the figures logged are the ones the decision was made on (a tie goes to the kernel)
    assert (float(logged[1]) <= float(logged[2])) == decision or logged[1] == logged[2]
    monkeypatch.setattr(torch_backend, "native_prompt_pays", lambda *args, **kwargs: False)
    backend = TorchSlotBackend.from_pretrained(str(tiny_model_dir), 1, 64, "float32", "cpu", kv_cache_dtype="bfloat16")
    assert backend._prompt_kernels is None and backend._prompt_by_blocks


@needs_amx_tiles
def test_prompt_attention_on_amx_tiles_is_timed_against_sdpa(monkeypatch, caplog):
    """With ``tiles``, :func:`native_prompt_pays` times the kernel on the tiles against SDPA's causal kernel (the
    way an AMX CPU takes otherwise), and keeps that decision apart from the one without tiles."""
    monkeypatch.setattr(torch_backend, "_PROMPT_DECISIONS", {})
    kernels = cpu_kernels.load()
    calls, sdpa = [], []
    real, real_sdpa = kernels.prompt_attention, torch.nn.functional.scaled_dot_product_attention
    monkeypatch.setattr(kernels, "prompt_attention",
                        lambda *args, **kwargs: calls.append(kwargs.get("tiles")) or real(*args, **kwargs))
    monkeypatch.setattr(torch.nn.functional, "scaled_dot_product_attention",
                        lambda *args, **kwargs: sdpa.append(kwargs.get("is_causal")) or real_sdpa(*args, **kwargs))
    with caplog.at_level(logging.INFO, logger=torch_backend.__name__):
        torch_backend.native_prompt_pays(kernels, torch.bfloat16, torch.bfloat16, 4, 2, 64, tiles=True)
    assert calls == [True] * 5 and sdpa == [True] * 5
    assert re.search(r"prompt attention, torch.bfloat16 over a torch.bfloat16 cache, 512 tokens, \d+ threads: native "
                     r"in bf16 products [\d.]+ ms, torch SDPA [\d.]+ ms \(each the mean of its two fastest passes\) -> (native|torch)",
                     caplog.text)
    calls.clear(), sdpa.clear()
    torch_backend.native_prompt_pays(kernels, torch.bfloat16, torch.bfloat16, 4, 2, 64, tiles=False)
    assert calls == [False] * 5 and not sdpa  # its own decision, against the blocks


def test_the_float32_measurement_streams_fresh_weights_of_the_models_shapes_past_the_caches(monkeypatch):
    """Products of the given linears' shapes, taken in turn, over zeroed weights of their own (not the
    model's: its first layer may sit in the last-level cache), until they pass the sample's bytes or count."""
    linears = [torch.nn.Linear(64, 96, bias=True), torch.nn.Linear(160, 64, bias=False)]
    monkeypatch.setattr(fast_linear, "SAMPLE_BYTES", 2 * (96 * 64 + 64 * 160) * 4 + 1)  # two of each, and one
    sample = fast_linear._streamed_sample(linears, fast_linear.SAMPLE_BYTES)
    shapes = [tuple(linear.weight.shape) for linear in sample]
    assert shapes == [(96, 64), (64, 160)] * 2 + [(96, 64)]
    assert all(linear.bias is None and not linear.weight.any() for linear in sample)
    storages = {linear.weight.untyped_storage().data_ptr() for linear in sample + linears}
    assert len(storages) == len(sample) + len(linears)
    monkeypatch.setattr(fast_linear, "SAMPLE_MAX_LINEARS", 3)
    assert len(fast_linear._streamed_sample(linears, fast_linear.SAMPLE_BYTES)) == 3


def test_bf16_prompt_products_run_in_float32_where_that_measures_faster(monkeypatch):
    """Without AMX, oneDNN's bf16 products can be slower than float32 ones over a copy of the weight (an
    Emerald Rapids Xeon: 1.32x at 256 rows): float32 is taken where it is 5% faster, round by round, once per
    thread count; the switch decides without measuring."""
    monkeypatch.delenv(fast_linear.WIDE_ENV, raising=False)
    times = {"bfloat16": [1.0] * 5, "float32": [0.9] * 5}
    monkeypatch.setattr(cpu_kernels, "alternate_passes", lambda runs, rounds: {side: times[side] for side in runs})
    linears = [torch.nn.Linear(64, 32).to(torch.bfloat16) for _ in range(2)]
    monkeypatch.setattr(fast_linear, "_WIDE_DECISIONS", {})
    assert fast_linear.bf16_prompt_products(linears) == "float32"
    times["float32"] = [0.97] * 5  # within 5%: bf16 stays
    assert fast_linear.bf16_prompt_products(linears) == "float32"  # decided for this thread count already
    monkeypatch.setattr(fast_linear, "_WIDE_DECISIONS", {})
    assert fast_linear.bf16_prompt_products(linears) == "bfloat16"
    monkeypatch.setattr(cpu_kernels, "alternate_passes", None)  # no measurement below
    for setting in ("float32", "bfloat16"):
        monkeypatch.setenv(fast_linear.WIDE_ENV, setting)
        assert fast_linear.bf16_prompt_products(linears) == setting
    monkeypatch.setenv(fast_linear.WIDE_ENV, "native")
    with pytest.raises(ValueError, match="avx512 or avx512bf16 build"):
        fast_linear.bf16_prompt_products(linears, type("K", (), {"isa": "avx2"})())
    monkeypatch.setenv(fast_linear.WIDE_ENV, "bf16")
    with pytest.raises(ValueError, match=r"LLAMA_BF16_PROMPT_PRODUCTS='bf16': use auto, bfloat16, float32 or native"):
        fast_linear.bf16_prompt_products(linears)


def test_outputs_off_the_gemm_panels_leave_a_prompts_rows_to_onednn():
    """The GEMMs take whole panels of outputs only (16 columns on avx2, 32 on the AVX-512 builds); a linear
    with other outputs would run a prompt's rows on the tiles, so :class:`NativeLinear` sends them to oneDNN."""
    for isa, panel in (("avx2", 16), ("avx512", 32), ("avx512bf16", 32)):
        build = type("K", (), {"isa": isa})()
        assert NativeLinear(torch.nn.Linear(64, 4 * panel), build, sys.maxsize).max_rows == sys.maxsize
        assert NativeLinear(torch.nn.Linear(64, 4 * panel + 8), build, sys.maxsize).max_rows == \
            fast_linear.NATIVE_MAX_ROWS
        assert NativeLinear(torch.nn.Linear(64, 4 * panel + 8), build, 24).max_rows == 24


def test_bf16_prompt_products_take_the_native_gemm_where_it_times_fastest(monkeypatch):
    """On the AVX-512 builds their GEMM is a third side (on an Emerald Rapids Xeon: 81.7 ms at 256 rows against
    89.3 for float32 over a copy and 123 for bf16); the fastest side by its median ratio to bf16 is taken."""
    monkeypatch.delenv(fast_linear.WIDE_ENV, raising=False)
    times = {"bfloat16": [1.0] * 5, "float32": [0.72] * 5, "native": [0.66] * 5}
    timed = []

    def alternate(runs, rounds):
        timed.append(sorted(runs))
        return {side: times[side] for side in runs}
    monkeypatch.setattr(cpu_kernels, "alternate_passes", alternate)
    linears = [torch.nn.Linear(64, 32).to(torch.bfloat16)]
    for isa, expected in (("avx512bf16", "native"), ("avx512", "native"), ("avx2", "float32")):
        monkeypatch.setattr(fast_linear, "_WIDE_DECISIONS", {})
        assert fast_linear.bf16_prompt_products(linears, type("K", (), {"isa": isa})()) == expected, isa
    assert timed == [["bfloat16", "float32", "native"]] * 2 + [["bfloat16", "float32"]]
    times["native"] = [1.2] * 5  # slower than bf16, as oneDNN's bf16 product on a Zen 4 might be
    monkeypatch.setattr(fast_linear, "_WIDE_DECISIONS", {})
    assert fast_linear.bf16_prompt_products(linears, type("K", (), {"isa": "avx512bf16"})()) == "float32"
    monkeypatch.setenv(fast_linear.WIDE_ENV, "native")
    assert fast_linear.bf16_prompt_products(linears, type("K", (), {"isa": "avx512bf16"})()) == "native"


def test_a_native_favour_keeps_the_gemm_within_its_share_of_the_fastest_side(monkeypatch, caplog):
    """Only with the GEMM do a decode step's products run on pair panels (an Emerald Rapids Xeon: 8 rows in 15.8
    against 21.5 ms), so where they would, the GEMM is taken while it times within ``native_favour`` of the side
    taken otherwise (bf16 at 1); loads there had read native / float32 ratios of 1.03-1.09 and taken float32."""
    monkeypatch.delenv(fast_linear.WIDE_ENV, raising=False)
    times = {"bfloat16": [1.0] * 5, "float32": [0.70] * 5, "native": [0.77] * 5}
    monkeypatch.setattr(cpu_kernels, "alternate_passes", lambda runs, rounds: {side: times[side] for side in runs})
    linears = [torch.nn.Linear(64, 32).to(torch.bfloat16)]
    build = type("K", (), {"isa": "avx512bf16"})()

    def decide(favour):
        monkeypatch.setattr(fast_linear, "_WIDE_DECISIONS", {})
        return fast_linear.bf16_prompt_products(linears, build, native_favour=favour)

    assert decide(0.0) == "float32"
    with caplog.at_level(logging.INFO, logger=fast_linear.__name__):
        assert decide(0.15) == "native"
    assert "native favoured by 15% for its pair panels) -> native" in caplog.text
    times["native"] = [0.81] * 5  # past 1.15 x 0.70
    assert decide(0.15) == "float32"
    times.update(float32=[0.97] * 5, native=[1.1] * 5)  # float32 not taken: within 15% of bf16's
    assert decide(0.0) == "bfloat16" and decide(0.15) == "native"
    times["native"] = [0.96] * 5  # no favour: not 5% faster than bf16
    assert decide(0.0) == "bfloat16"
    times["native"] = [1.2] * 5  # an AMX CPU's bf16 products would leave the GEMM further behind
    assert decide(0.15) == "bfloat16"


@PAIRED
@needs_bf16_native
def test_a_bf16_model_keeps_the_gemm_for_its_pair_panels_where_float32_times_a_little_faster(tiny_model_dir,
                                                                                            monkeypatch):
    """``pack_linears`` favours the GEMM by ``NATIVE_PROMPT_FAVOUR`` where the weights go to pair panels; with
    the pair panels off, the faster float32 side is taken."""
    monkeypatch.delenv(fast_linear.WIDE_ENV, raising=False)
    times = {"bfloat16": [1.0] * 5, "float32": [0.70] * 5, "native": [0.75] * 5}
    monkeypatch.setattr(cpu_kernels, "alternate_passes", lambda runs, rounds: {side: times[side] for side in runs})
    for setting, prompt_rows_native in (("on", True), ("off", False)):
        monkeypatch.setenv(fast_linear.PAIRS_ENV, setting)
        monkeypatch.setattr(fast_linear, "_WIDE_DECISIONS", {})
        model = load(tiny_model_dir, torch.bfloat16)
        assert pack_linears(model) > 0
        native = [m for m in model.modules() if isinstance(m, NativeLinear)]
        assert all((m.max_rows == sys.maxsize) == prompt_rows_native for m in native), setting
        assert all(m.wide_in_float32 != prompt_rows_native for m in native), setting
        assert any(m.pairs for m in native) == prompt_rows_native, setting


def test_bf16_prompt_products_are_compared_round_by_round(monkeypatch):
    """A burst that slows both sides of some rounds, or one lucky bf16 pass, does not decide: each round's two
    passes are compared, and the median of those ratios is what counts."""
    monkeypatch.delenv(fast_linear.WIDE_ENV, raising=False)
    passes = {"bfloat16": [1.0, 0.80, 1.8, 1.8, 1.0], "float32": [0.85, 0.85, 1.5, 1.5, 0.85]}
    monkeypatch.setattr(cpu_kernels, "alternate_passes", lambda runs, rounds: {side: passes[side] for side in runs})
    monkeypatch.setattr(fast_linear, "_WIDE_DECISIONS", {})
    linears = [torch.nn.Linear(64, 32).to(torch.bfloat16)]
    assert min(passes["float32"]) > min(passes["bfloat16"])  # fastest pass against fastest pass: bf16
    assert fast_linear.bf16_prompt_products(linears) == "float32"


def test_an_unsure_prompt_products_measurement_times_more_rounds(monkeypatch):
    """A median ratio near the threshold (a worker measuring while its frontend starts read 0.95 where fresh
    loads read 0.69-0.76) times more rounds, and the median of all decides; a clear one times no more."""
    monkeypatch.delenv(fast_linear.WIDE_ENV, raising=False)
    linears = [torch.nn.Linear(64, 32).to(torch.bfloat16)]
    calls = []

    def decide(*batches):
        def alternate(runs, rounds):
            calls.append(rounds)
            ratio = batches[min(len(calls), len(batches)) - 1]
            return {"bfloat16": [1.0] * rounds, "float32": [ratio] * rounds}
        calls.clear()
        monkeypatch.setattr(cpu_kernels, "alternate_passes", alternate)
        monkeypatch.setattr(fast_linear, "_WIDE_DECISIONS", {})
        return fast_linear.bf16_prompt_products(linears)

    assert decide(0.95, 0.7) == "float32" and calls == [5, fast_linear.WIDE_MORE_ROUNDS]
    assert decide(0.9, 1.0) == "bfloat16" and len(calls) == 2  # 5 at 0.9, 10 at 1.0: the median is 1.0
    assert decide(0.7) == "float32" and calls == [5]
    assert decide(1.2) == "bfloat16" and calls == [5]


@needs_bf16_native
@BF16
def test_a_bf16_models_prompt_rows_in_float32_round_once_to_bf16(tiny_model_dir, monkeypatch):
    """With the float32 choice a prompt's products (more rows than the native kernel keeps) are the float32
    product of the bf16 inputs and weights, rounded to bf16 once; a decode step's rows stay native."""
    monkeypatch.setenv(fast_linear.WIDE_ENV, "float32")
    model = load(tiny_model_dir, torch.bfloat16)
    assert pack_linears(model) > 0
    linear = next(m for m in model.modules() if isinstance(m, NativeLinear))
    assert linear.wide_in_float32 and linear.bias is None
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(linear.max_rows + 16, linear.in_features, generator=gen).to(torch.bfloat16)
    with torch.inference_mode():
        y = linear(x)
        # oneDNN's float32 product, rounded once: bit for bit, whatever summation order this CPU's kernel takes
        # (torch's own matmul agreed to the bit on the AMX Xeon, not on a Zen 5 EPYC)
        product = torch.ops.mkldnn._linear_pointwise(x.float(), linear.weight.float(), None, "none", [], "")
        expected = product.to(torch.bfloat16)
        bf16 = torch.ops.mkldnn._linear_pointwise(x, linear.weight, None, "none", [], "")
        few = linear(x[:4])
    assert y.dtype == torch.bfloat16
    assert torch.equal(y, expected)
    torch.testing.assert_close(product, x.float() @ linear.weight.float().T, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(y.float(), bf16.float(), rtol=2e-2, atol=2e-2)
    torch.testing.assert_close(few.float(), expected[:4].float(), rtol=2e-2, atol=2e-2)
    monkeypatch.setenv(fast_linear.WIDE_ENV, "bfloat16")
    again = load(tiny_model_dir, torch.bfloat16)
    pack_linears(again)
    assert not any(m.wide_in_float32 for m in again.modules() if isinstance(m, NativeLinear))


@PAIRED
def test_bf16_weights_go_to_pair_panels_where_they_time_faster_once_per_process(monkeypatch):
    """The load-time choice (an Emerald Rapids Xeon: 1.53x at 8 rows): pairs where their median ratio to the plain
    layout is below ``PAIRS_TAKE``, measured once per thread count and dtypes; the switch forces either way."""
    monkeypatch.delenv(fast_linear.PAIRS_ENV, raising=False)
    ratio = [0.65]
    timed = []

    def alternate(runs, rounds):
        timed.append(sorted(runs))
        return {"plain": [1.0] * rounds, "pairs": [ratio[0]] * rounds}
    monkeypatch.setattr(cpu_kernels, "alternate_passes", alternate)
    monkeypatch.setattr(fast_linear, "_PAIRS_DECISIONS", {})
    linears = [torch.nn.Linear(64, 96).to(torch.bfloat16)]
    assert fast_linear.weight_pairs(linears, NATIVE, torch.bfloat16, torch.bfloat16)
    assert fast_linear.weight_pairs(linears, NATIVE, torch.bfloat16, torch.bfloat16) and timed == [["pairs", "plain"]]
    ratio[0] = 0.97  # not clearly faster: the plain layout stays
    assert not fast_linear.weight_pairs(linears, NATIVE, torch.float32, torch.bfloat16) and len(timed) == 2
    assert not fast_linear.weight_pairs([torch.nn.Linear(64, 96)], NATIVE, torch.float32, torch.float32)
    monkeypatch.setattr(fast_linear, "_PAIRS_DECISIONS", {})
    assert not fast_linear.weight_pairs([torch.nn.Linear(64, 48).to(torch.bfloat16)], NATIVE, torch.bfloat16,
                                        torch.bfloat16) and len(timed) == 2  # no whole pair of panels to time
    monkeypatch.setattr(fast_linear, "_PAIRS_DECISIONS", {})
    for setting, expected in (("on", True), ("off", False)):
        monkeypatch.setenv(fast_linear.PAIRS_ENV, setting)
        assert fast_linear.weight_pairs(linears, NATIVE, torch.bfloat16, torch.bfloat16) is expected
    assert len(timed) == 2
    monkeypatch.setenv(fast_linear.PAIRS_ENV, "on")
    with pytest.raises(ValueError, match="LLAMA_WEIGHT_PAIRS=on needs .*avx2"):
        fast_linear.weight_pairs(linears, type("K", (), {"isa": "avx2"})(), torch.bfloat16, torch.bfloat16)
    monkeypatch.setenv(fast_linear.PAIRS_ENV, "sometimes")
    with pytest.raises(ValueError, match="LLAMA_WEIGHT_PAIRS='sometimes': use auto, on or off"):
        fast_linear.weight_pairs(linears, NATIVE, torch.bfloat16, torch.bfloat16)


@PAIRED
def test_weights_in_pair_panels_leave_the_one_row_prefetch_untuned(tiny_model_dir, monkeypatch):
    """Every product in pair panels: nothing for the plain layout's one-row distance to be measured over."""
    monkeypatch.setenv(cpu_kernels.ENV, "auto")
    monkeypatch.setenv(fast_linear.PAIRS_ENV, "on")
    calls = []
    monkeypatch.setattr(cpu_kernels, "tune_one_row_prefetch", lambda *args: calls.append(args) or 1024)
    backend = TorchSlotBackend.from_pretrained(str(tiny_model_dir), max_slots=2, max_length=64, dtype="float32",
                                               weight_dtype="bfloat16")
    native = [m for module in (backend.model, *backend._fused) for m in module.modules() if isinstance(m, NativeLinear)]
    assert native and all(m.pairs for m in native) and calls == []


@PAIRED
def test_a_native_linear_in_pair_panels_computes_the_plain_ones_product(monkeypatch):
    """Any row count (a decode step's tiles, a prompt's GEMM), bias and 3-D inputs; only where every row count
    stays native and the outputs fill whole pairs of panels."""
    torch.manual_seed(0)
    for bias in (False, True):
        linear = torch.nn.Linear(96, 64, bias=bias).to(torch.bfloat16)
        paired = NativeLinear(linear, NATIVE, sys.maxsize, pairs=True)
        plain = NativeLinear(linear, NATIVE, sys.maxsize)
        assert paired.pairs and not plain.pairs and "pair panels" in paired.extra_repr()
        assert not torch.equal(paired.weight, plain.weight) and paired.weight.shape == plain.weight.shape
        for shape in ((1, 96), (3, 5, 96), (8, 96), (300, 96)):
            x = torch.randn(shape, dtype=torch.bfloat16)
            with torch.inference_mode():
                got, want = paired(x), plain(x)
            assert got.shape == want.shape and got.dtype == torch.bfloat16
            torch.testing.assert_close(got.float(), want.float(), rtol=2e-2, atol=2e-2)
    assert not NativeLinear(torch.nn.Linear(96, 64).to(torch.bfloat16), NATIVE, 48, pairs=True).pairs
    assert not NativeLinear(torch.nn.Linear(96, 48).to(torch.bfloat16), NATIVE, sys.maxsize, pairs=True).pairs


@PAIRED
def test_a_native_linear_lays_its_weight_out_in_pair_panels_at_its_place_even_where_it_already_is():
    """``place``: the pair panels written there, from the weight where it was loaded, or where the weight
    already lies there (``concat_linears`` into it), in place; the same product either way."""
    torch.manual_seed(0)
    parts = [torch.nn.Linear(96, 32, bias=False).to(torch.bfloat16) for _ in range(2)]
    plain = NativeLinear(fast_linear.concat_linears(parts), NATIVE, sys.maxsize)
    apart = torch.empty(64, 96, dtype=torch.bfloat16)
    paired = NativeLinear(fast_linear.concat_linears(parts), NATIVE, sys.maxsize, pairs=True, place=apart)
    place = torch.empty(64, 96, dtype=torch.bfloat16)
    fused = fast_linear.concat_linears(parts, out=place)
    assert fused.weight.data_ptr() == place.data_ptr() and torch.equal(fused.weight, plain.weight)
    in_place = NativeLinear(fused, NATIVE, sys.maxsize, pairs=True, place=place)
    assert paired.weight.data_ptr() == apart.data_ptr() and in_place.weight.data_ptr() == place.data_ptr()
    assert in_place.pairs and torch.equal(in_place.weight, paired.weight)
    assert torch.equal(in_place.weight, NATIVE.pack_pairs(plain.weight))
    wide = fast_linear.concat_linears([part.float() for part in parts])  # converted at its place, then laid out
    narrowed = NativeLinear(wide, NATIVE, sys.maxsize, torch.bfloat16, pairs=True, place=torch.empty_like(place))
    assert narrowed.pairs and narrowed.compute_dtype == torch.float32 and torch.equal(narrowed.weight, paired.weight)
    x = torch.randn(5, 96, dtype=torch.bfloat16)
    with torch.inference_mode():
        torch.testing.assert_close(in_place(x).float(), plain(x).float(), rtol=2e-2, atol=2e-2)


def greedy_in_three_slots(backend, prompt, length, steps=6):
    """Prefill ``prompt``'s first ``length``, ``length`` + 1 and ``length`` + 2 tokens into slots 0-2, then decode
    the three greedily together for ``steps`` steps: each slot's tokens, and the last step's logits (float32)."""
    with torch.inference_mode():
        got = [backend.prefill_slot(slot, prompt[:length + slot]) for slot in range(3)]
        seen = [[int(g.argmax())] for g in got]
        for _ in range(steps):
            got = list(backend.decode_slots([0, 1, 2], [s[-1] for s in seen]))
            for s, g in zip(seen, got):
                s.append(int(g.argmax()))
    return seen, torch.stack(got).float()


@PAIRED
@needs_bf16_native
def test_a_bf16_model_decodes_the_same_tokens_with_its_weights_in_pair_panels(tiny_model_dir, monkeypatch):
    """The tiny model with ``LLAMA_WEIGHT_PAIRS=on`` and ``off``: every decode-step product in pair panels (one
    native call per step, ``pairs``) or none; the same greedy tokens, logits within bf16's rounding. (As on a CPU
    without AMX, where ``off`` keeps the native kernels: on one with AMX it means oneDNN's packed products.)"""
    monkeypatch.setenv(fast_linear.WIDE_ENV, "native")
    monkeypatch.setattr(fast_linear, "is_amx", lambda flags=None: False)
    logits, backends = [], []
    for setting in ("on", "off"):
        monkeypatch.setenv(fast_linear.PAIRS_ENV, setting)
        backend = TorchSlotBackend(load(tiny_model_dir, torch.bfloat16), max_slots=4, max_length=96, owns_model=True)
        products = backend._step_products(backend._fused)
        assert products and all(p.pairs == (setting == "on") for p in products)
        assert backend._decode_layers is not None and backend._decode_layers.pairs == (setting == "on")
        backends.append(backend)
    prompt = prompts(batch=1, length=20, seed=3)[0][0].tolist()
    tokens = []
    for backend in backends:
        seen, last = greedy_in_three_slots(backend, prompt, 12)
        logits.append(last)
        tokens.append(seen)
    assert tokens[0] == tokens[1]
    torch.testing.assert_close(logits[0], logits[1], rtol=0.05, atol=0.05 * logits[1].abs().max().item())


TILED = type("K", (), {"isa": "avx512bf16", "amx_min_rows": lambda self, set_to=None: 2})()
UNTILED = type("K", (), {"isa": "avx512bf16", "amx_min_rows": lambda self, set_to=None: 0})()


def test_bf16_on_an_amx_cpu_runs_natively_only_where_the_build_has_the_tiles(monkeypatch):
    """On an AMX CPU bf16 goes to the native kernels where they multiply on the tiles (``amx_min_rows`` > 0) and
    the pair panels are not switched off; else it stays on oneDNN's packed products. Without AMX, the tiles do not
    matter."""
    cpu = torch.device("cpu")
    monkeypatch.setattr(fast_linear, "packing_supported", lambda dtype, device: True)
    monkeypatch.delenv(fast_linear.PAIRS_ENV, raising=False)
    for build, on_amx in ((TILED, TILED), (UNTILED, None)):
        monkeypatch.setattr(cpu_kernels, "load", lambda build=build: build)
        assert fast_linear.native_kernels_for(torch.bfloat16, cpu, AMX) is on_amx
        assert fast_linear.native_kernels_for(torch.bfloat16, cpu, AVX512_BF16) is build
        assert fast_linear.native_kernels_for(torch.float32, cpu, AMX) is None
    monkeypatch.setattr(cpu_kernels, "load", lambda: TILED)
    assert fast_linear.amx_tiles(TILED) and not fast_linear.amx_tiles(UNTILED)
    assert not fast_linear.amx_tiles(type("K", (), {"isa": "avx512bf16"})())
    monkeypatch.setenv(fast_linear.PAIRS_ENV, "off")
    assert not fast_linear.amx_tiles(TILED) and fast_linear.native_kernels_for(torch.bfloat16, cpu, AMX) is None


@pytest.mark.skipif(NATIVE is None or NATIVE.isa != "avx512bf16" or not packing_supported(torch.bfloat16, "cpu"),
                    reason="needs the native kernels' avx512bf16 build and oneDNN bf16")
def test_a_bf16_model_on_amx_tiles_keeps_every_product_native_in_pair_panels_without_measuring(tiny_model_dir,
                                                                                              monkeypatch, caplog):
    """Where the tiles run (here made to look so), a bf16 model's products all stay native at every row count,
    in pair panels, a decode step in one native call; nothing is timed at load, and one line says so, which
    a bench page lists with the choices timed. A forced prompt side (``LLAMA_BF16_PROMPT_PRODUCTS=bfloat16``)
    is still honoured."""
    from scripts.bench.choices import is_decision

    caplog.set_level(logging.INFO, logger="llama_engine")
    monkeypatch.setattr(fast_linear, "_AMX_LOGGED", set())
    monkeypatch.delenv(fast_linear.PAIRS_ENV, raising=False)
    monkeypatch.delenv(fast_linear.WIDE_ENV, raising=False)
    monkeypatch.setattr(fast_linear, "amx_tiles", lambda kernels: True)
    monkeypatch.setattr(NATIVE, "amx_min_rows", lambda set_to=None: 2)

    def timed(*args, **kwargs):
        raise AssertionError("nothing is timed at load on the tiles")

    measured = fast_linear.bf16_prompt_products
    monkeypatch.setattr(fast_linear, "bf16_prompt_products", timed)
    monkeypatch.setattr(fast_linear, "weight_pairs", timed)
    backend = TorchSlotBackend(load(tiny_model_dir, torch.bfloat16), max_slots=2, max_length=64, owns_model=True)
    native = [m for module in (backend.model, *backend._fused) for m in module.modules() if isinstance(m, NativeLinear)]
    assert native and all(m.pairs and m.max_rows == sys.maxsize for m in native)
    assert backend._decode_layers is not None and backend._decode_layers.pairs
    said = [r.getMessage() for r in caplog.records if "AMX tiles," in r.getMessage()]
    assert len(said) == 1 and is_decision(said[0]) and "from 2 row(s)" in said[0], said
    monkeypatch.setenv(fast_linear.WIDE_ENV, "bfloat16")
    monkeypatch.setattr(fast_linear, "bf16_prompt_products", measured)  # which answers the forced side unmeasured
    model = load(tiny_model_dir, torch.bfloat16)
    assert pack_linears(model) > 0
    assert all(m.max_rows == fast_linear.NATIVE_MAX_ROWS and not m.pairs
               for m in model.modules() if isinstance(m, NativeLinear))
    monkeypatch.setenv(fast_linear.WIDE_ENV, "bf16")
    with pytest.raises(ValueError, match="LLAMA_BF16_PROMPT_PRODUCTS='bf16'"):
        pack_linears(load(tiny_model_dir, torch.bfloat16))


@pytest.mark.skipif(NATIVE is None or NATIVE.isa != "avx512bf16" or NATIVE.amx_min_rows() == 0,
                    reason="this CPU has no AMX tiles")
def test_a_bf16_model_on_amx_tiles_decodes_the_tokens_of_onednns_products(tiny_model_dir, monkeypatch):
    """On an AMX CPU, the tiny model on the tiles (prompts of 14-16 rows, decode steps of 3) and on oneDNN's packed
    products (``LLAMA_WEIGHT_PAIRS=off``): the same greedy tokens, logits within bf16's rounding."""
    monkeypatch.delenv(fast_linear.WIDE_ENV, raising=False)
    runs = []
    for setting in ("auto", "off"):
        monkeypatch.setenv(fast_linear.PAIRS_ENV, setting)
        backend = TorchSlotBackend(load(tiny_model_dir, torch.bfloat16), max_slots=4, max_length=96, owns_model=True)
        assert (backend._decode_layers is not None) == (setting == "auto")
        runs.append(greedy_in_three_slots(backend, prompts(batch=1, length=20, seed=5)[0][0].tolist(), 14))
    (tiled, tiled_logits), (onednn, onednn_logits) = runs
    assert tiled == onednn
    torch.testing.assert_close(tiled_logits, onednn_logits, rtol=0.05, atol=0.05 * onednn_logits.abs().max().item())


@needs_native
def test_native_linear_keeps_int8_rows_and_computes_the_dequantized_weights_product_at_every_row_count():
    """``weight_dtype`` int8: the weight kept as int8 with a scale per row (a quarter of float32's bytes and
    its scales), up to ``max_rows`` rows on the native kernels and more on oneDNN over a copy dequantized for the
    call (in one scratch buffer, reused), output columns that no GEMM panel divides included, the bias in the
    arithmetic's dtype; a place of the wrong shape or without room for the scales is not taken."""
    torch.manual_seed(0)
    linear = torch.nn.Linear(96, 80, bias=True)
    native = NativeLinear(linear, NATIVE, max_rows=6, weight_dtype=torch.int8)
    assert native.weight.dtype == torch.int8 and int8_rows.carries_scales(native.weight)
    assert native.max_rows == 6 and not native.pairs and native.bias.dtype == torch.float32
    assert NativeLinear(linear, NATIVE, max_rows=sys.maxsize, weight_dtype=torch.int8).max_rows == sys.maxsize
    dequantized = int8_rows.dequantize(native.weight)
    assert (dequantized - linear.weight.detach()).abs().max() <= int8_rows.scales(native.weight).max() / 2 + 1e-7
    int16_from = NATIVE.int16_min_rows(torch.float32, torch.int8)  # the avx2 build rounds rows to int16
    for shape in ((1, 96), (3, 2, 96), (7, 96), (300, 96)):
        x = torch.randn(shape)
        with torch.inference_mode():
            got = native(x)
        rows = x.reshape(-1, 96)
        taken = int8_rows.int16_rows(rows).float() if 0 < int16_from <= len(rows) <= native.max_rows else rows
        torch.testing.assert_close(got, torch.nn.functional.linear(taken, dequantized, linear.bias.detach()).view(got.shape),
                                   atol=1e-5, rtol=1e-5)
    assert native._dequantized(torch.float32).data_ptr() == native._dequantized(torch.float32).data_ptr()
    # past max_rows oneDNN multiplies a bf16 copy where it has bf16 products (the CPUs whose builds cap int8's rows
    # under bf16), else a float32 one (an AVX2 CPU: its oneDNN refuses bf16)
    wide = not packing_supported(torch.bfloat16, torch.device("cpu"))
    half = NativeLinear(copy.deepcopy(linear).to(torch.bfloat16), NATIVE, max_rows=6, weight_dtype=torch.int8,
                        wide_in_float32=wide)
    for rows in (6, 7):  # the tiles, then oneDNN over the copy
        x = torch.randn(rows, 96).to(torch.bfloat16)
        with torch.inference_mode():
            got = half(x)
        want = torch.nn.functional.linear(x.float(), int8_rows.dequantize(half.weight), half.bias.float())
        torch.testing.assert_close(got.float(), want, atol=0.05, rtol=0.02)
    place = int8_rows.empty((80, 96))
    assert NativeLinear(linear, NATIVE, weight_dtype=torch.int8, place=place).weight.data_ptr() == place.data_ptr()
    for wrong in (torch.empty(80, 96, dtype=torch.int8), int8_rows.empty((96, 80))):
        assert NativeLinear(linear, NATIVE, weight_dtype=torch.int8, place=wrong).weight.data_ptr() != wrong.data_ptr()


class TilesOnly:
    """Kernels that keep int8 weights under bf16 on their tiles at every row count, or (``only`` false) not."""
    isa = "avx512bf16"

    def __init__(self, only: bool):
        self.only = only

    def tiles_only(self, x_dtype, weight_dtype):
        return self.only and (x_dtype, weight_dtype) == (torch.bfloat16, torch.int8)


@pytest.mark.parametrize("only, prompts, want", [
    (False, "bfloat16", (sys.maxsize, False)), (True, "native", (sys.maxsize, False)),
    (True, "bfloat16", (fast_linear.INT8_TILES_MAX_ROWS, False)), (True, "float32", (fast_linear.INT8_TILES_MAX_ROWS, True))])
def test_int8_prompts_past_the_tiles_go_where_a_bf16_models_prompts_time_fastest(monkeypatch, only, prompts, want):
    """int8 linears run every row count natively where the build has a GEMM for them, or where the native GEMM
    multiplies a bf16 model's prompts fastest; else up to INT8_TILES_MAX_ROWS rows on the tiles, and oneDNN (in
    bf16, or float32 where that timed faster) takes more rows over a copy widened for the call."""
    monkeypatch.setenv(fast_linear.WIDE_ENV, prompts)
    linear = torch.nn.Linear(64, 64, dtype=torch.bfloat16)
    assert fast_linear._int8_max_rows([(None, "l", linear)], torch.bfloat16, TilesOnly(only)) == want


def test_weight_dtype_int8_needs_the_native_kernels_and_float32_or_bfloat16_arithmetic(monkeypatch):
    cpu, gpu = torch.device("cpu"), torch.device("cuda")
    weight_dtype_for = torch_backend.weight_dtype_for
    monkeypatch.setattr(fast_linear.cpu_kernels, "for_device", lambda device: object())
    assert weight_dtype_for("int8", torch.float32, cpu, "bfloat16") == torch.int8
    assert weight_dtype_for("int8", torch.bfloat16, cpu, None) == torch.int8
    for dtype, device in ((torch.float16, cpu), (torch.float32, gpu)):
        with pytest.raises(ValueError, match=r"handler\.weight_dtype int8 under .* set weight_dtype: auto"):
            weight_dtype_for("int8", dtype, device, "float32")
    monkeypatch.setattr(fast_linear.cpu_kernels, "for_device", lambda device: None)
    with pytest.raises(ValueError, match="AVX2 and FMA"):
        weight_dtype_for("int8", torch.float32, cpu, "float32")


@needs_native
def test_int8_weights_with_packing_switched_off_are_refused_naming_the_switch(tiny_model_dir, monkeypatch):
    monkeypatch.setenv(fast_linear.ENV, "0")
    with pytest.raises(ValueError, match=f"{fast_linear.ENV}=0 keeps torch's linears"):
        TorchSlotBackend(load(tiny_model_dir, torch.float32), max_slots=1, max_length=32, owns_model=True,
                         weight_dtype=torch.int8)


@needs_native
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_int8_weights_keep_the_models_logits_to_their_quantization(tiny_model_dir, dtype):
    """Every linear (the LM head too) in int8 with a scale per row: prefill and decode logits within a small
    share of the logits' range of the model with its own weights (the tiny model's random weights: per-row
    rounding errors of ~0.2% of each row's largest weight), and greedy picks that mostly agree."""
    int8 = TorchSlotBackend(load(tiny_model_dir, dtype), max_slots=1, max_length=96, owns_model=True,
                            weight_dtype=torch.int8, kv_cache_dtype="float32")
    plain = TorchSlotBackend(load(tiny_model_dir, dtype), max_slots=1, max_length=96, owns_model=True,
                             kv_cache_dtype="float32")
    linears = [m for m in int8.model.modules() if isinstance(m, NativeLinear)]
    linears += [m for fused in int8._fused for m in fused.modules() if isinstance(m, NativeLinear)]
    assert linears and all(m.weight.dtype == torch.int8 for m in linears) and int8._logits_natively
    assert not any(type(m) is torch.nn.Linear for m in int8.model.modules())
    prompt = prompts(batch=1, length=40)[0][0].tolist()
    got, want, same = [], [], 0
    with torch.inference_mode():
        got.append(int8.prefill_slot(0, prompt).float())
        want.append(plain.prefill_slot(0, prompt).float())
        for _ in range(20):
            token = int(want[-1].argmax())
            same += token == int(got[-1].argmax())
            got.append(int8.decode_slots([0], [token])[0].float())
            want.append(plain.decode_slots([0], [token])[0].float())
    got, want = torch.stack(got), torch.stack(want)
    spread = want.amax(-1) - want.amin(-1)
    assert ((got - want).abs().amax(-1) / spread).max() < 0.05
    assert torch.nn.functional.cosine_similarity(got, want, dim=-1).min() > 0.999
    assert same >= 16
