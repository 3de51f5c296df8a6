"""HF transformers on CPU (or CUDA when present): eager forward passes with a KV cache."""
from __future__ import annotations

import json
import logging
import os
from itertools import chain
from typing import Dict, FrozenSet, List, Optional, Sequence, Union

import torch

from ..cpu import auto_dtype, file_mapped_ranges, heap_free_bytes, is_amx, keep_freed_memory, release_freed_memory
from . import cpu_kernels
from .base import Backend, OnePassSlotBackend, PrefillChunk, SlotBatchBackend
from .fast_linear import (
    FusedLlamaProjections,
    GatheredBlock,
    NativeLinear,
    gather_weights,
    kept_weight_kernels,
    pack_linears,
    switch_setting,
    tune_native_prefetch,
)
from .weight_memory import read_ahead, settle_loaded_weights

logger = logging.getLogger(__name__)

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
#: Free heap bytes at which a load hands the freed copies of the layers packed so far back to the kernel. Each
#: layer of a Llama-2-7B-shaped checkpoint left ~90 MB free that later layers did not reuse (2.7 GB by its 26th
#: layer, AMX Xeon), which raised the load's peak by 1.3 GiB; the 2 GB beyond-cache model's stayed at 70 MB,
#: which the next layer reuses. Pages handed back are faulted in again when reused, so not every layer's.
RELEASE_AT = 512 << 20
#: ``0`` keeps a decode step's layer loop in Python (:meth:`TorchSlotBackend._native_decode_layers`).
DECODE_LAYERS_ENV = "LLAMA_DECODE_LAYERS"


def resolve_device(device: str) -> torch.device:
    if device == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if device == "cuda" and not torch.cuda.is_available():
        raise RuntimeError("handler.device is 'cuda' but no CUDA device is available; use 'auto' or 'cpu'")
    return torch.device(device)


def resolve_dtype(dtype: str, device: str) -> str:
    """``handler.dtype`` with ``auto`` replaced by what the device computes fastest in (:mod:`..cpu`)."""
    return auto_dtype(resolve_device(device).type) if dtype == "auto" else dtype


def load_model(model_path: str, dtype: str, device: str, max_length: int):
    """The HF causal LM from safetensors, on ``device``, in eval mode (its linears as they are)."""
    from transformers import AutoModelForCausalLM

    dtype = resolve_dtype(dtype, device)
    model = AutoModelForCausalLM.from_pretrained(model_path, torch_dtype=DTYPES[dtype], use_safetensors=True)
    model = model.to(resolve_device(device)).eval()
    if model.device.type == "cpu":
        keep_freed_memory()
    check_max_length(model.config, max_length)
    return model


def _heap_holds_freed_copies() -> bool:
    """Whether glibc's heap holds :data:`RELEASE_AT` of freed blocks (or it cannot say: glibc before 2.33)."""
    free = heap_free_bytes()
    return free is None or free >= RELEASE_AT


def widen_all_but_layers(model, dtype: torch.dtype) -> None:
    """``model`` in ``dtype`` but for its decoder layers, which :class:`TorchSlotBackend` widens one by one.

    A bf16 checkpoint under float32 arithmetic keeps its linears' weights in bf16 (:func:`weight_dtype_for`).
    Loaded in float32 at once, the model was whole in float32 before its linears were packed back to bf16:
    twice the checkpoint's bytes at the peak of the load."""
    layers = model.model.layers
    model.model.layers = torch.nn.ModuleList()
    try:
        model.to(dtype)
    finally:
        model.model.layers = layers


def plain_linears(module) -> List[torch.nn.Linear]:
    """``module``'s own ``nn.Linear`` modules (not packed ones), itself included."""
    return [m for m in module.modules() if type(m) is torch.nn.Linear]


def widen_all_but_linears(module, dtype: torch.dtype) -> None:
    """``module``'s floating-point parameters and buffers in ``dtype``, but for its ``nn.Linear`` modules'."""
    for sub in module.modules():
        if type(sub) is torch.nn.Linear:
            continue
        for tensor in chain(sub.parameters(recurse=False), sub.buffers(recurse=False)):
            if tensor.is_floating_point():
                tensor.data = tensor.data.to(dtype)


def checkpoint_dtype(model_path: str) -> Optional[str]:
    """The dtype the checkpoint's ``config.json`` says its weights are stored in (``torch_dtype``), if any."""
    try:
        with open(os.path.join(model_path, "config.json")) as f:
            return json.load(f).get("torch_dtype")
    except (OSError, ValueError):
        return None


def weight_dtype_for(setting: str, dtype: torch.dtype, device: torch.device, stored: Optional[str]) -> torch.dtype:
    """The dtype of the linears' weights for ``handler.weight_dtype`` under ``dtype`` arithmetic.

    ``auto``: bfloat16 where the arithmetic is float32 on a CPU whose native kernels run float32 over
    bf16 weights (:func:`.fast_linear.kept_weight_kernels`: any x86 CPU with AVX2) and the checkpoint
    is stored in bf16 (``stored``), so that nothing of it is lost: half the memory, and a decode step,
    which streams every weight, 1.3-1.7x faster in its products (see :data:`.fast_linear.BF16_WEIGHT_MAX_ROWS`);
    elsewhere ``dtype``. ``float32`` keeps the weights in the arithmetic's dtype (never wider than
    it); ``bfloat16`` sets them, and under float32 arithmetic without those kernels it is an error
    that says so. ``int8``: int8 with a scale per row (:mod:`.int8_rows`, opt-in and lossy) under float32
    or bfloat16 arithmetic, where the native kernels load; elsewhere an error that says so.
    """
    if setting == "int8":
        if kept_weight_kernels(dtype, torch.int8, device) is None:
            raise ValueError(f"handler.weight_dtype int8 under {str(dtype).replace('torch.', '')} arithmetic on "
                             f"{device.type}: int8 weights need float32 or bfloat16 arithmetic on an x86 CPU whose "
                             "native kernels load (AVX2 and FMA); set weight_dtype: auto")
        return torch.int8
    if setting == "auto":
        if stored == "bfloat16" and kept_weight_kernels(dtype, torch.bfloat16, device) is not None:
            return torch.bfloat16
        return dtype
    wanted = DTYPES[setting]
    if wanted == torch.float32:
        return dtype
    if wanted != dtype and kept_weight_kernels(dtype, wanted, device) is None:
        raise ValueError(f"handler.weight_dtype {setting} under {str(dtype).replace('torch.', '')} arithmetic on "
                         f"{device.type}: only bfloat16 weights under float32 arithmetic, on an x86 CPU whose native "
                         "kernels load (AVX2 and FMA); set weight_dtype: auto or the dtype")
    return wanted


def kv_cache_dtype_for(setting: str, weights: torch.dtype, device: torch.device,
                       flags: Optional[FrozenSet[str]] = None, native_attention: bool = False) -> torch.dtype:
    """The slot cache's dtype for ``handler.kv_cache_dtype`` (``auto`` or a dtype name).

    ``weights``: the linears' weights' dtype, which under float32 arithmetic may be bf16 (a bf16
    checkpoint, :func:`weight_dtype_for`). ``auto`` on a CPU: with bf16 weights, bf16 where decode
    steps attend through the native kernel (``native_attention``, :mod:`.cpu_kernels`: it reads a
    bf16 cache at the memory's speed, half the bytes of float32) or the CPU has AMX, and float32 on
    any other; with fp16 weights, float32. Under bf16 arithmetic the keys and values are bf16 already,
    so a float32 cache would hold them exactly and only read slower. Under float32 arithmetic over
    bf16 weights a bf16 cache rounds them once, as a forward in the checkpoint's own dtype would
    store them: an 8-row decode step at 462 positions of the bench model 32.1 -> 23.2 ms, a 1-row
    one 12.2 -> 10.3 (2-vCPU AVX2 EPYC), its logits within 0.004 of the float32 cache's over a
    300-token prompt and 40 steps (max 2.1), every greedy token the same. Without AMX, torch's CPU
    attention over a half-precision cache runs several times slower than over float32 for the
    one-query rows of a decode step (the bench model's layer, 12 heads of 64, 2 threads, Zen 5 EPYC
    with AVX512_BF16: 134 against 20 us at 1 row and 260 positions, 1044 against 144 us at 8 rows),
    and no faster for a prompt. With AMX its bf16 kernels are the faster ones (AMX Xeon, same layer:
    33 against 35 us at 1 row, 215 against 350 us at 8 rows; decode steps at 8 rows 23.5 against
    28.9 ms). A float32 cache costs twice the memory: set a dtype to halve it where memory is tight,
    or ``float32`` to keep float32 keys and values exact. Elsewhere (a GPU, float32 weights) the
    weights' dtype. ``flags``: the CPU's (default: this machine's).
    """
    if setting != "auto":
        return getattr(torch, setting)
    if torch.device(device).type != "cpu" or weights == torch.float32:
        return weights
    return torch.bfloat16 if weights == torch.bfloat16 and (native_attention or is_amx(flags)) else torch.float32


def prompts_attend_by_blocks(dtype: torch.dtype, kv: torch.dtype, device: torch.device,
                             flags: Optional[FrozenSet[str]] = None) -> bool:
    """Whether prompt chunks attend by :class:`_PromptAttention` (in the arithmetic's ``dtype``) rather
    than through SDPA (in the cache's dtype ``kv``).

    For bf16 arithmetic on a CPU, except an AMX CPU with a bf16 cache: there SDPA's bf16 flash
    kernel is the faster (bench model, AMX Xeon, 2 threads, median of 4: whole prefill of 768
    tokens 173 against 193 ms, 256 tokens 55 against 59), and the native kernel on AMX's tiles faster
    still (:class:`_NativePrompt` with ``tiles``). For float32 arithmetic over a bf16
    cache on a CPU: SDPA would round the queries to bf16 and attend in it, and a 300-token prompt
    of the bench model then moved its logits by up to 1.6 (of 2.1) from the float32 cache's and
    changed 16 of the next 41 greedy tokens; in float32 (a first chunk through SDPA over its own
    keys and values, a later one by blocks over the cache), 0.004 and none. float16 keeps SDPA
    (see the class).
    """
    if torch.device(device).type != "cpu":
        return False
    if dtype == torch.float32:
        return kv != torch.float32
    if dtype != torch.bfloat16:
        return False
    return not (kv == torch.bfloat16 and is_amx(flags))


#: :func:`native_prompt_pays` decisions of this process, by (dtype, kv dtype, heads, kv heads, head_dim, threads).
_PROMPT_DECISIONS: Dict[tuple, bool] = {}
#: The prompt length :func:`native_prompt_pays` times one layer's attention at.
PROMPT_SAMPLE_TOKENS = 512


def native_prompt_pays(kernels, dtype: torch.dtype, kv: torch.dtype, heads: int, kv_heads: int, head_dim: int,
                       rounds: int = 4, tiles: bool = False) -> bool:
    """Whether the native prompt kernel (:class:`_NativePrompt`) attends a prompt at least as fast as torch's
    way here (:class:`_PromptAttention`: bf16 blocks, float32 blocks over a bf16 cache; with ``tiles``, the
    kernel in bf16 products against SDPA's causal bf16 flash kernel where an AMX CPU takes it, else against
    the bf16 blocks), measured once per process and shape on one layer's attention of
    :data:`PROMPT_SAMPLE_TOKENS` random tokens, the two taking turns; each side scores the sum of its two
    fastest runs. A tie goes to the kernel, whose
    float32 scores (and weights, off the tiles) are the more exact.

    The kernel's tile is AVX2's on every build: measured 1.7x faster than SDPA on a Zen 3 EPYC, as fast
    as bf16 blocks within a Zen 4's whole prefill; a CPU with two 512-bit multiply-add units (a Zen 5
    EPYC, AVX-512 Xeons) may run torch's AVX-512 products faster, hence the measurement (~50 ms)."""
    key = (dtype, kv, heads, kv_heads, head_dim, tiles, torch.get_num_threads())
    if key in _PROMPT_DECISIONS:
        return _PROMPT_DECISIONS[key]
    q, k, v = _prompt_sample(dtype, heads, kv_heads, head_dim)
    tokens, scale = PROMPT_SAMPLE_TOKENS, head_dim ** -0.5
    sdpa = tiles and not prompts_attend_by_blocks(dtype, kv, torch.device("cpu"))
    torch_way = _Chunk(_CausalPrompt(0, tokens)) if sdpa else _PromptAttention(0, 0, dtype)
    cache = [t.transpose(0, 1).unsqueeze(0) for t in (k, v)]  # one slot [1, kv_heads, tokens, head_dim]
    passes = cpu_kernels.alternate_passes({"native": lambda: kernels.prompt_attention(q, k, v, scale, tiles=tiles),
                                           "torch": lambda: torch_way(q, k, v, *cache, heads != kv_heads)}, rounds)
    decision = _PROMPT_DECISIONS[key] = cpu_kernels.choose_fastest(passes, "native", margin=0.0) == "native"
    scores = cpu_kernels.pass_scores(passes)
    logger.info("prompt attention, %s over a %s cache, %d tokens, %d threads: native%s %.2f ms, torch%s %.2f ms "
                "(each the mean of its two fastest passes) -> %s", dtype, kv, tokens, key[-1],
                " in bf16 products" if tiles else "", 1e3 * scores["native"], " SDPA" if sdpa else "", 1e3 * scores["torch"],
                "native" if decision else "torch")
    return decision


def _prompt_sample(dtype: torch.dtype, heads: int, kv_heads: int, head_dim: int):
    """q, k and v of :data:`PROMPT_SAMPLE_TOKENS` random tokens, the same in every process."""
    gen = torch.Generator().manual_seed(0)
    q = torch.randn(PROMPT_SAMPLE_TOKENS, heads, head_dim, generator=gen).to(dtype)
    k, v = (torch.randn(PROMPT_SAMPLE_TOKENS, kv_heads, head_dim, generator=gen).to(dtype) for _ in range(2))
    return q, k, v


#: :func:`bf16_products_pay` decisions of this process, by (heads, kv heads, head_dim, threads).
_BF16_PRODUCTS_DECISIONS: Dict[tuple, bool] = {}
#: How much faster AVX512_BF16's dot products must attend a prompt than the float32 products to be taken: their
#: softmax weights are rounded to bf16.
BF16_PRODUCTS_MARGIN = 0.1


def bf16_products_pay(kernels, heads: int, kv_heads: int, head_dim: int, rounds: int = 4) -> bool:
    """On a CPU with AVX512_BF16 and no AMX, whether the native prompt kernel's bf16 dot products
    (``tiles=True``) attend a bf16 prompt over a bf16 cache :data:`BF16_PRODUCTS_MARGIN` faster than its
    float32 products, measured once per process and shape on one layer's attention of
    :data:`PROMPT_SAMPLE_TOKENS` random tokens, the two taking turns (:func:`~.cpu_kernels.choose_fastest`).

    A dot product instruction does twice a float32 multiply-add's work; where a CPU issues it half as often
    (some AVX-512 Xeons) the two tie, and the float32 products, which keep the weights unrounded, stay. On
    a Zen 5 EPYC (2 threads, the bench model's layer): 0.21 against 0.39 ms at 256 tokens, 1.37 against 2.41
    at 768."""
    key = (heads, kv_heads, head_dim, torch.get_num_threads())
    if key in _BF16_PRODUCTS_DECISIONS:
        return _BF16_PRODUCTS_DECISIONS[key]
    q, k, v = _prompt_sample(torch.bfloat16, heads, kv_heads, head_dim)
    scale = head_dim ** -0.5
    passes = cpu_kernels.alternate_passes({"float32": lambda: kernels.prompt_attention(q, k, v, scale),
                                           "bf16": lambda: kernels.prompt_attention(q, k, v, scale, tiles=True)},
                                          rounds)
    decision = _BF16_PRODUCTS_DECISIONS[key] = cpu_kernels.choose_fastest(
        passes, "float32", margin=BF16_PRODUCTS_MARGIN) == "bf16"
    scores = cpu_kernels.pass_scores(passes)
    logger.info("prompt attention, bf16 over a bf16 cache, %d tokens, %d threads: float32 products %.2f ms, "
                "AVX512_BF16 dot products %.2f ms (each the mean of its two fastest passes) -> %s", PROMPT_SAMPLE_TOKENS,
                key[-1], 1e3 * scores["float32"], 1e3 * scores["bf16"], "bf16" if decision else "float32")
    return decision


def check_max_length(config, max_length: int) -> None:
    limit = getattr(config, "max_position_embeddings", max_length)
    if max_length > limit:
        raise ValueError(f"handler.max_length ({max_length}) exceeds the model's "
                         f"max_position_embeddings ({limit}); lower handler.max_length")


class TorchBackend(SlotBatchBackend):
    """Static batches (micro-batching) over :class:`TorchSlotBackend`'s forward: row ``i`` is slot ``i``.

    Each row sits in its own slot at its own positions, so the engine's left padding is
    dropped before the model sees it (no work on padding), all rows' prompts go through one
    forward pass, and ``retain`` only forgets the finished rows' slots (no cache copy). Decode
    steps cost what HF's own forward over a padded batch did (``scripts.bench.decode_profile``
    on the bench model, float32, AVX2 EPYC: the new step ran 0.92-1.10x as fast at 1, 4 and 8
    rows, within that machine's noise); what changes is the prefill of prompts of different
    lengths, and that both batching modes run the same forward. The cache holds
    ``max_length`` positions for as many rows as the largest batch seen (the micro-batch size
    at load), as the continuous backend's does.
    """

    def __init__(self, model_path: str, dtype: str = "float32", device: str = "auto",
                 max_length: int = 512, batch_size: int = 1, kv_cache_dtype: str = "auto", weight_dtype: str = "auto"):
        super().__init__(TorchSlotBackend.from_pretrained(model_path, max(1, batch_size), max_length, dtype, device,
                                                          kv_cache_dtype, weight_dtype))
        self.model, self.device = self.slots.model, self.slots.device
        logger.info("torch backend: %s on %s in %s", type(self.model).__name__, self.device, self.model.dtype)

    @torch.inference_mode()
    def prefill(self, input_ids: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
        return super().prefill(input_ids, attention_mask)


class CompiledTorchBackend(Backend):
    """``torch.compile``'d decode step over a static KV cache (``handler.compile: true``).

    The batch size and the cache length are fixed, so decoding is one compiled graph: the
    engine pads every batch to ``batch_size`` as it does for Neuron. Prefill runs eagerly
    (its length varies) through HF's forward and writes into the same static cache. Inductor
    packs the weights itself (and its compile cache depends on the plain graph), so nothing
    is packed or fused here.
    """

    def __init__(self, model_path: str, batch_size: int, dtype: str = "float32", device: str = "auto",
                 max_length: int = 512):
        from transformers import StaticCache

        self.device = resolve_device(device)
        self.model = load_model(model_path, dtype, device, max_length)
        self.max_length = max_length
        self.batch_sizes = (batch_size,)
        self._static = StaticCache(config=self.model.config, max_batch_size=batch_size, max_cache_len=max_length,
                                   device=self.device, dtype=self.model.dtype)
        self._full_mask = torch.zeros((batch_size, max_length), dtype=torch.long, device=self.device)
        self._position = 0
        self._next_position = None
        self._decode_step = torch.compile(self._step, dynamic=False, fullgraph=True)
        logger.info("compiled torch backend: %s on %s in %s, batch %d", type(self.model).__name__, self.device,
                    self.model.dtype, batch_size)

    def _step(self, input_ids, position_ids, cache_position, attention_mask):
        out = self.model(input_ids=input_ids, position_ids=position_ids, cache_position=cache_position,
                         attention_mask=attention_mask, past_key_values=self._static, use_cache=True)
        return out.logits[:, -1, :]

    @torch.inference_mode()
    def prefill(self, input_ids: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
        length = input_ids.shape[1]
        self._static.reset()
        self._full_mask.zero_()
        self._full_mask[:, :length] = attention_mask.to(self.device)
        positions = (attention_mask.cumsum(-1) - 1).clamp(min=0).to(self.device)
        out = self.model(input_ids=input_ids.to(self.device), attention_mask=self._full_mask,
                         position_ids=positions, cache_position=torch.arange(length, device=self.device),
                         past_key_values=self._static, use_cache=True, num_logits_to_keep=1)
        self._position = length
        self._next_position = positions[:, -1:] + 1
        return out.logits[:, -1, :].float()

    @torch.inference_mode()
    def decode(self, next_tokens: Union[torch.Tensor, Sequence[int]]) -> torch.Tensor:
        if self._position >= self.max_length:
            raise ValueError(f"the batch reached handler.max_length ({self.max_length}) positions")
        self._full_mask[:, self._position] = 1
        cache_position = torch.tensor([self._position], device=self.device)
        logits = self._decode_step(torch.as_tensor(next_tokens).to(self.device).view(-1, 1), self._next_position,
                                   cache_position, self._full_mask)
        self._position += 1
        self._next_position = self._next_position + 1
        return logits.float().clone()

    def retain(self, rows: Sequence[int]) -> bool:
        return False

    def release(self) -> None:
        self._position = 0


class TorchSlotBackend(OnePassSlotBackend):
    """A slot KV cache over an HF Llama's weights, for continuous batching.

    HF's caches keep every row of a batch at one shared position, so admitting a request
    would mean recomputing (or re-padding) all the others. This backend runs its own lean
    Llama forward over the HF modules (embeddings, RMSNorm, projections, MLP, lm_head; only
    the attention is its own) against one cache ``[layers, slots, kv_heads, max_length,
    head_dim]`` for keys and one for values. Each row of a forward pass writes its K/V at its
    own positions in its own slot and attends only to the positions at or before its own,
    so a slot's stale entries from an earlier request are never read and freeing a slot is
    only bookkeeping.
    """

    def __init__(self, model, max_slots: int, max_length: int, owns_model: bool = False, fuse: bool = True,
                 kv_cache_dtype: str = "auto", weight_dtype: Optional[torch.dtype] = None,
                 widen_layers: Optional[torch.dtype] = None):
        """``owns_model``: the model serves only this backend, so its separate projections are
        freed once fused and its remaining linears packed; otherwise they stay as they are
        (the fused copies are extra memory) for the model's other users. ``fuse=False`` keeps
        the separate projections (an A/B baseline). ``kv_cache_dtype``: see :func:`kv_cache_dtype_for`.
        ``weight_dtype``: the linears' weights in this dtype where it differs from the model's (see
        :func:`weight_dtype_for`; only with ``owns_model``). ``widen_layers``: the decoder layers are
        still in the checkpoint's dtype and the rest of the model in this one (:func:`widen_all_but_layers`):
        each layer is widened as its linears are packed, so that the model is never whole in it."""
        if widen_layers is not None and not (owns_model and fuse):
            for layer in model.model.layers:
                layer.to(widen_layers)
            widen_layers = None
        self.model = model.eval()
        cfg = model.config
        check_max_length(cfg, max_length)
        if max_slots < 1:
            raise ValueError(f"max_slots must be >= 1, got {max_slots}")
        self.max_slots, self.max_length = max_slots, max_length
        self.device = next(model.parameters()).device
        self.dtype = next(model.parameters()).dtype
        self.weight_dtype = weight_dtype if owns_model and weight_dtype not in (None, self.dtype) else None
        self.n_heads = cfg.num_attention_heads
        self.n_kv_heads = getattr(cfg, "num_key_value_heads", None) or self.n_heads
        self.head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // self.n_heads
        kernels = cpu_kernels.for_device(self.device)

        def native_attention(kv: torch.dtype) -> bool:
            return kernels is not None and kernels.supports_attention(self.dtype, kv, self.n_heads, self.n_kv_heads,
                                                                      self.head_dim)

        # int8 weights take the cache bf16 weights would: half a float32 cache's bytes, a rounding far finer than theirs
        weights = torch.bfloat16 if self.weight_dtype == torch.int8 else self.weight_dtype or self.dtype
        self.kv_dtype = kv_cache_dtype_for(kv_cache_dtype, weights, self.device,
                                           native_attention=native_attention(weights))
        #: Decode rows attend through the native kernel (:class:`_NativeDecodeRows`), else through SDPA.
        self._kernels = kernels if native_attention(self.kv_dtype) else None
        self._allocate_cache()
        self._cos, self._signed_sin = self._rope_tables()
        self._fused = self._fuse_projections(owns_model, widen_layers) if fuse else [None] * cfg.num_hidden_layers
        if owns_model and self.device.type == "cpu":
            settle_loaded_weights(self.model)  # before the native calls below take views of the norms
        #: Passes run :meth:`_fused_forward`: the native kernels' fused small ops, where they serve this model.
        self._fused_ops = self._kernels is not None and self._fuses_small_ops()
        #: Prompt chunks attend by :class:`_PromptAttention` (see :func:`prompts_attend_by_blocks`).
        self._prompt_by_blocks = prompts_attend_by_blocks(self.dtype, self.kv_dtype, self.device)
        #: bf16 prompt attention over a bf16 cache runs in bf16 products: on AMX's tiles where the CPU has them,
        #: else on AVX512_BF16's dot products where they measure faster than float32's (:func:`bf16_products_pay`).
        self._prompt_tiles = kernels is not None and kernels.supports_tile_attention(
            self.dtype, self.kv_dtype, self.head_dim) and (
            kernels.amx or bf16_products_pay(kernels, self.n_heads, self.n_kv_heads, self.head_dim))
        #: Prompt chunks attend through these kernels (:class:`_NativePrompt`), where they run them and measure
        #: as fast as torch's way (:func:`native_prompt_pays`): float32 arithmetic, bf16 where the blocks
        #: would run, and bf16 in bf16 products.
        self._prompt_kernels = kernels if (
            kernels is not None and (self.dtype == torch.float32 or self._prompt_by_blocks or self._prompt_tiles)
            and kernels.supports_prompt_attention(self.dtype, self.kv_dtype, self.n_heads, self.n_kv_heads,
                                                  self.head_dim)
            and native_prompt_pays(kernels, self.dtype, self.kv_dtype, self.n_heads, self.n_kv_heads,
                                   self.head_dim, tiles=self._prompt_tiles)) else None
        #: Passes of up to ``_decode_layers_rows`` rows run their layers in one native call: decode-only ones,
        #: and those with prompt chunks where the prompts attend natively (:meth:`_runs_natively`).
        self._decode_layers, self._decode_layers_rows = self._native_decode_layers()
        #: Whether that call ends with the logits (:meth:`_native_head`).
        self._logits_natively = self._decode_layers is not None and self._decode_layers.head is not None

    def _allocate_cache(self) -> None:
        """Zeroed K/V for ``max_slots`` slots (zeros: masked-out positions must not hold NaN)."""
        self.k_cache = self.v_cache = None  # the old cache goes before the new one is made
        shape = (self.model.config.num_hidden_layers, self.max_slots, self.n_kv_heads, self.max_length, self.head_dim)
        self.k_cache = torch.zeros(shape, dtype=self.kv_dtype, device=self.device)
        self.v_cache = torch.zeros(shape, dtype=self.kv_dtype, device=self.device)
        self._lengths: List[int] = [0] * self.max_slots
        logger.info("torch slot backend: %d slots x %d positions, %.1f MiB of KV cache in %s on %s", self.max_slots,
                    self.max_length, 2 * self.k_cache.numel() * self.k_cache.element_size() / 2**20, self.kv_dtype,
                    self.device)

    def reserve_slots(self, count: int) -> None:
        """Make room for ``count`` slots, growing the cache if it has fewer; only while every slot is free."""
        if count <= self.max_slots:
            return
        if any(self._lengths):
            raise RuntimeError(f"cannot grow the cache to {count} slots while some of its {self.max_slots} are in use")
        self.max_slots = count
        self._allocate_cache()

    @classmethod
    def from_pretrained(cls, model_path: str, max_slots: int, max_length: int = 512, dtype: str = "float32",
                        device: str = "auto", kv_cache_dtype: str = "auto",
                        weight_dtype: str = "auto") -> "TorchSlotBackend":
        arithmetic, stored = DTYPES[resolve_dtype(dtype, device)], checkpoint_dtype(model_path)
        weights = weight_dtype_for(weight_dtype, arithmetic, resolve_device(device), stored)
        narrower = DTYPES.get(stored) == torch.bfloat16 and arithmetic == torch.float32
        if weights == DTYPES.get(stored) != arithmetic or (weights == torch.int8 and narrower):
            # the layers stay as stored until each one's linears are kept (or quantized) and the rest widened
            model = load_model(model_path, stored, device, max_length)
            widen_all_but_layers(model, arithmetic)
            return cls(model, max_slots, max_length, owns_model=True, kv_cache_dtype=kv_cache_dtype,
                       weight_dtype=weights, widen_layers=arithmetic)
        model = load_model(model_path, dtype, device, max_length)
        return cls(model, max_slots, max_length, owns_model=True, kv_cache_dtype=kv_cache_dtype, weight_dtype=weights)

    def _fuses_small_ops(self) -> bool:
        """Whether :meth:`_fused_forward` computes this model's forward: fused projections in every layer,
        HF's Llama RMSNorm and SiLU, and dtypes and a head size the native kernels serve."""
        from transformers.models.llama.modeling_llama import LlamaRMSNorm

        inner = self.model.model
        norms = [inner.norm] + [n for layer in inner.layers for n in (layer.input_layernorm,
                                                                      layer.post_attention_layernorm)]
        return (self._kernels.supports_fused_ops(self.dtype, self.kv_dtype, self.head_dim)
                and all(f is not None for f in self._fused) and all(type(n) is LlamaRMSNorm for n in norms)
                and all(type(getattr(layer.mlp, "act_fn", None)) is torch.nn.SiLU for layer in inner.layers))

    def _native_decode_layers(self):
        """:class:`.cpu_kernels.DecodeLayers` over this model's layers and the most rows it runs, where
        :meth:`_fused_forward` would call only native kernels for a decode step: its products all
        :class:`.NativeLinear` without a bias, over weights of one dtype, every norm with one epsilon, and
        dtypes the call serves. Else ``(None, 0)``. ``LLAMA_DECODE_LAYERS=0`` keeps the Python loop (an A/B
        baseline)."""
        if not self._fused_ops or switch_setting(DECODE_LAYERS_ENV, "auto", "auto") == "off":
            return None, 0
        inner, layers, products = self.model.model, [], []
        for layer, fused in zip(inner.layers, self._fused):
            tensors = {"input_norm": layer.input_layernorm.weight, "post_norm": layer.post_attention_layernorm.weight}
            for name, linear in (("qkv", fused.qkv_proj), ("o", layer.self_attn.o_proj),
                                 ("gate_up", fused.gate_up_proj), ("down", layer.mlp.down_proj)):
                if not isinstance(linear, NativeLinear) or linear.bias is not None:
                    return None, 0
                tensors[name] = linear.weight
                products.append(linear)
            layers.append({name: t.detach() for name, t in tensors.items()})
        eps = {n.variance_epsilon for layer in inner.layers for n in (layer.input_layernorm,
                                                                         layer.post_attention_layernorm)}
        dtypes = (self.dtype, products[0].weight.dtype, self.kv_dtype)
        if (len(eps) != 1 or dtypes not in cpu_kernels.DECODE_LAYERS_DTYPES
                or any(p.weight.dtype != dtypes[1] or p.pairs != products[0].pairs for p in products)
                or any(t.dtype != self.dtype for layer in layers for t in (layer["input_norm"], layer["post_norm"]))):
            return None, 0
        rows, eps = min(p.max_rows for p in products), eps.pop()
        head = self._native_head(products[0], rows, eps)
        embedding = inner.embed_tokens.weight.detach()  # for decode_step, where its rows are the activations
        step = cpu_kernels.DecodeLayers(self._kernels, layers, self.n_heads, self.n_kv_heads, self.head_dim, eps,
                                        pairs=products[0].pairs, head=head,
                                        embedding=embedding if head is not None and embedding.dtype == self.dtype
                                        else None)
        return step, rows

    def _native_head(self, product: NativeLinear, rows: int, eps: float):
        """The final norm's and the LM head's weights, for :class:`.cpu_kernels.DecodeLayers` to end with the
        logits, where the backend would run them with the kernels and the layout of the layers' ``product``
        (else None: the backend runs them after the call)."""
        norm, head = self.model.model.norm, self.model.lm_head
        if (not isinstance(head, NativeLinear) or head.bias is not None or head.max_rows < rows
                or head.weight.dtype != product.weight.dtype or head.pairs != product.pairs
                or norm.variance_epsilon != eps or norm.weight.dtype != self.dtype):
            return None
        return norm.weight.detach(), head.weight

    def _fuse_projections(self, owns_model: bool, widen: Optional[torch.dtype] = None
                          ) -> List[Optional[FusedLlamaProjections]]:
        """Each layer's q/k/v and gate/up as two products (None for a layer that cannot be fused); with
        ``widen``, each layer first widened to it and its other linears packed before the next one widens
        (all of it but its linears, where their weights are kept as loaded: :meth:`_linears_kept_as_loaded`).
        With ``owns_model``, once the first layer's products come out native, every later layer's weights are
        written straight to their places in the decode step's block (:meth:`_plan_gathered`), and each layer's
        pages of the checkpoint are read while the one before it is repacked (:func:`.weight_memory.read_ahead`)."""
        fused, planned, later = [], None, {}
        layers = self.model.model.layers
        compute = widen if widen is not None and self._linears_kept_as_loaded() else None
        mapped = file_mapped_ranges() if owns_model and self.device.type == "cpu" else []
        for index, layer in enumerate(layers):
            if index + 1 < len(layers):
                read_ahead(layers[index + 1], mapped)
            places = planned.places[4 * index:4 * index + 4] if planned else [None] * 4
            rest = {layer.self_attn.o_proj: places[1], layer.mlp.down_proj: places[3]} if planned else {}
            fused.append(self._fuse_layer(layer, owns_model, (places[0], places[2]), widen, compute, rest))
            if widen is None:
                later.update(rest)
            if owns_model and index == 0:
                planned = self._plan_gathered(fused[0], layer)
            if owns_model and _heap_holds_freed_copies():
                release_freed_memory()
        if owns_model:
            pack_linears(self.model, weight_dtype=self.weight_dtype, places=later)
            gather_weights(self._step_products(fused) or [], planned)
        tune_native_prefetch([self.model, *fused])
        return fused

    def _fuse_layer(self, layer, owns_model: bool, fused_places, widen: Optional[torch.dtype],
                    compute: Optional[torch.dtype], rest) -> Optional[FusedLlamaProjections]:
        """One layer's step of :meth:`_fuse_projections`: its q/k/v and gate/up fused at ``fused_places``; with
        ``widen``, the layer widened first (but for its linears, with ``compute``) and its other linears packed
        at their places (``rest``) after."""
        if compute is not None:
            widen_all_but_linears(layer, compute)
        elif widen is not None:
            layer.to(widen)
        fused = FusedLlamaProjections.of(layer, self.weight_dtype, fused_places, compute)
        if owns_model and fused is not None:
            FusedLlamaProjections.drop_originals(layer)
        if widen is not None:
            pack_linears(layer, weight_dtype=self.weight_dtype, places=rest, compute_dtype=compute)
        if compute is not None:  # linears left unpacked (LLAMA_PACKED_LINEAR=off) compute in the widened dtype
            for module in filter(None, (layer, fused)):
                for linear in plain_linears(module):
                    linear.to(compute)
        return fused

    def _linears_kept_as_loaded(self) -> bool:
        """Whether the decoder layers' linears are loaded in the dtype their weights are kept in (a bf16
        checkpoint under float32 arithmetic), or are kept in int8 (quantized from the dtype they are loaded in):
        they are then fused and packed as loaded, under the arithmetic's dtype, rather than widened with their
        layer and narrowed back (twice their bytes touched, twice)."""
        linears = plain_linears(self.model.model.layers[0])
        return self.weight_dtype is not None and bool(linears) and (
            self.weight_dtype == torch.int8 or all(m.weight.dtype == self.weight_dtype for m in linears))

    def _plan_gathered(self, first: Optional[FusedLlamaProjections], layer) -> Optional[GatheredBlock]:
        """Places for every layer's q/k/v, o, gate/up and down weights in decode order, of the first layer's
        shapes and kept dtype, where its fused products came out as :class:`NativeLinear` (every layer's
        then do: one dtype, one choice); else None. A place whose weight goes elsewhere stays untouched."""
        if first is None or not isinstance(first.qkv_proj, NativeLinear) or self.device.type != "cpu":
            return None
        shapes = [first.qkv_proj.weight.shape, layer.self_attn.o_proj.weight.shape,
                  first.gate_up_proj.weight.shape, layer.mlp.down_proj.weight.shape]
        return GatheredBlock.plan(shapes * len(self.model.model.layers), first.qkv_proj.weight.dtype)

    def _step_products(self, fused: List[Optional[FusedLlamaProjections]]) -> Optional[List[NativeLinear]]:
        """Every layer's q/k/v, o, gate/up and down product in the order a decode step runs them, where
        all are :class:`NativeLinear` (the products a decode step streams); else None."""
        products = []
        for layer, projections in zip(self.model.model.layers, fused):
            if projections is None:
                return None
            products += [projections.qkv_proj, layer.self_attn.o_proj, projections.gate_up_proj, layer.mlp.down_proj]
        return products if all(isinstance(p, NativeLinear) for p in products) else None

    @torch.inference_mode()
    def _rope_tables(self):
        """cos and signed sin (see :func:`_rotate`) for every position, from the model's own rotary module."""
        rotary = self.model.model.rotary_emb
        if "dynamic" in getattr(rotary, "rope_type", "default"):
            raise ValueError("dynamic RoPE scaling depends on the sequence length; the slot cache needs a fixed table")
        positions = torch.arange(self.max_length, device=self.device).unsqueeze(0)
        probe = torch.zeros(1, dtype=self.dtype, device=self.device)
        cos, sin = rotary(probe, positions)
        return cos[0], _signed_sin(sin[0])

    def slot_length(self, slot: int) -> int:
        return self._lengths[slot]

    def free_slot(self, slot: int) -> None:
        self._lengths[slot] = 0

    def _prompt_part(self, chunk: PrefillChunk, end: int, positions: torch.Tensor):
        """How a prompt chunk's tokens attend: through the native kernel where it runs, else by blocks or
        through SDPA (:func:`prompts_attend_by_blocks`)."""
        if self._prompt_kernels is not None:
            return _NativePrompt(self._prompt_kernels, self.head_dim ** -0.5, chunk.slot, chunk.start,
                                 self._prompt_tiles)
        if self._prompt_by_blocks:
            return _PromptAttention(chunk.slot, chunk.start, self.dtype, self.device)
        return _Chunk(_CausalPrompt(chunk.slot, end) if chunk.start == 0
                      else _RangeAttention(chunk.slot, 1, positions, end, self.kv_dtype))

    def _step(self, slots: List[int], tokens: Sequence[int], chunks: Sequence[PrefillChunk]):
        """One forward pass: one token in each of ``slots``, then each chunk; advance the slots.

        Returns the decode rows' logits ``[rows, vocab]`` (None without rows) and each
        chunk's last logits. The tokens of every row and chunk go through the linear layers
        as one matrix; only attention is per part (:class:`_DecodeRows`, :class:`_Chunk`). A pass runs its
        layers in one native call where it can (:meth:`_pass_natively`).
        """
        lengths = [self._lengths[s] for s in slots]
        ids, token_slots, token_positions, spans = _lay_out(slots, tokens, lengths, chunks)
        if self._runs_natively(len(ids), chunks):
            logits = self._pass_natively(ids, token_slots, token_positions, spans, len(slots) + len(chunks))
        else:
            logits = self._forward(ids, token_slots, token_positions, *self._plan(slots, lengths, chunks, spans))
        self._advance(slots, chunks)
        if not chunks:  # a decode step: its logits as they are, no slice and no empty list from a tensor
            return (logits if slots else None), []
        return (logits[:len(slots)] if slots else None), list(logits[len(slots):])

    def _plan(self, slots: List[int], lengths: List[int], chunks: Sequence[PrefillChunk], spans: List[tuple]):
        """How the pass's parts attend in :meth:`_forward`: its ``parts``, ``sizes``, ``last`` and ``final``."""
        parts, sizes, last = [], [], list(range(len(slots)))
        if slots:
            parts.append(self._rows_attention(slots, lengths))
            sizes.append(len(slots))
        for chunk, (first, n, _, _) in zip(chunks, spans):
            end = chunk.start + n
            positions = torch.arange(chunk.start, end, device=self.device).unsqueeze(0)
            parts.append(self._prompt_part(chunk, end, positions))
            sizes.append(n)
            last.append(first + n - 1)
        final = None
        if chunks:  # the last layer runs only the rows with logits, each as a decode row of its slot
            final = self._rows_attention(slots + [c.slot for c in chunks],
                                         lengths + [c.start + len(c.token_ids) - 1 for c in chunks])
        return parts, sizes, last, final

    def _advance(self, slots: List[int], chunks: Sequence[PrefillChunk]) -> None:
        for s in slots:
            self._lengths[s] += 1
        for chunk in chunks:
            self._lengths[chunk.slot] = chunk.start + len(chunk.token_ids)

    def _runs_natively(self, rows: int, chunks: Sequence[PrefillChunk]) -> bool:
        """Whether a pass of ``rows`` tokens runs its layers in one native call: every product takes its rows
        natively, and any prompt chunks attend through the native kernel."""
        return (self._decode_layers is not None and 0 < rows <= self._decode_layers_rows
                and (not chunks or self._prompt_kernels is not None))

    def _pass_natively(self, ids: List[int], slots: List[int], positions: List[int], spans: List[tuple],
                       rows: int) -> torch.Tensor:
        """A pass through :attr:`_decode_layers` (one native call for all the layers; decode rows first, then
        the chunks ``spans``): the logits of :meth:`_fused_forward` for its first ``rows`` rows (those with
        logits), without its ~110 calls from Python, each of which found the caches the kernels had flushed
        (a 256-token prefill of the bench model: ~10 ms of ~60 outside the kernels on an AMX Xeon, against
        ~2 ms when the kernels do nothing)."""
        inner = self.model.model
        if not spans and self._decode_layers.embedding is not None:
            return self._decode_layers.decode_step(ids, positions, slots, self.k_cache, self.v_cache, self._cos,
                                                   self._signed_sin)
        positions = torch.tensor(positions, dtype=torch.int64)
        hidden = inner.embed_tokens(torch.tensor(ids, dtype=torch.long))
        out = self._decode_layers(hidden, self.k_cache, self.v_cache, self._cos, self._signed_sin, positions,
                                  torch.tensor(slots, dtype=torch.int64), positions + 1, chunks=spans,
                                  tiles=self._prompt_tiles)
        if self._logits_natively:  # the call ended with the final norm, the LM head and the greedy picks
            return out
        normed = self._kernels.add_rmsnorm(hidden[:rows], out[:rows], inner.norm.weight,
                                           inner.norm.variance_epsilon)
        return self.model.lm_head(normed).float()

    def _rows_attention(self, slots: List[int], lengths: List[int]):
        """How rows of one query each (row ``b`` at position ``lengths[b]`` of ``slots[b]``) attend: through
        the native kernel where it loads, else as :meth:`_decode_attention` plans."""
        if self._kernels is not None:
            return _NativeDecodeRows(self._kernels, slots, lengths, self.head_dim ** -0.5)
        positions = torch.tensor(lengths, device=self.device).unsqueeze(1)
        return _DecodeRows(self._decode_attention(slots, lengths, positions))

    #: Batch a decode step's attention over the run of slots from the lowest to the highest
    #: while that reads at most this many times the K/V the rows need; past it, one call per row.
    batched_attention_waste = 1.5

    def _decode_attention(self, slots: List[int], lengths: List[int], positions: torch.Tensor):
        """How a decode step attends: one batched call over a run of slots, or one call per row.

        A batched call reads every slot of the run (rows not decoding included) up to the
        longest row; a call per row reads exactly each row's own positions but costs about
        1.5x as much per position read (measured: 8 rows of 600 positions, 1.14 ms batched
        against 1.68 ms row by row per layer). Indexing the rows' K/V out of the cache instead
        (``cache[slot_tensor]``) copies all of it, per layer and step: steps with a gap in
        their slots ran 2x slower that way on the mixed-length benchmark load.
        """
        first, last = min(slots), max(slots)
        span = max(lengths) + 1
        if (last - first + 1) * span <= self.batched_attention_waste * sum(n + 1 for n in lengths):
            return _RangeAttention(first, last - first + 1, positions, span, self.kv_dtype, slots)
        return _RowAttention(list(zip(slots, (n + 1 for n in lengths))))

    def _forward(self, ids: List[int], slots: List[int], positions: List[int], parts, sizes: List[int],
                 last: List[int], final=None) -> torch.Tensor:
        """Run the tokens ``ids``, each at its own ``(slot, position)``; return float logits at ``last``.

        The tokens are one flat matrix ``[N, hidden]``; ``parts`` (with ``sizes`` tokens each,
        in order) say how each run of them attends. The write index and every part's plan
        (masks, indices) are built once here for all layers.

        With ``final`` (how the rows ``last`` attend, one query each), the last layer writes every
        token's keys and values but runs its attention, ``o_proj`` and MLP only for the rows ``last``:
        no later token reads the rest of its output. A prompt's other rows skip ~80% of one
        layer's products (the bench model's 12 layers: ~6% of a prefill).
        """
        if self._fused_ops:
            return self._fused_forward(ids, slots, positions, parts, sizes, last, final)
        inner = self.model.model
        ids = torch.tensor(ids, dtype=torch.long, device=self.device)
        positions = torch.tensor(positions, device=self.device)
        write = self._write_index(torch.tensor(slots, device=self.device), positions)
        cos, sin = self._cos[positions].unsqueeze(1), self._signed_sin[positions].unsqueeze(1)  # [N, 1, D]
        last = torch.tensor(last, device=self.device)
        hidden = inner.embed_tokens(ids)
        for index, layer in enumerate(inner.layers):
            attn_in = layer.input_layernorm(hidden)
            if final is not None and index == len(inner.layers) - 1:
                out = self._attention(index, layer.self_attn, attn_in, write, [final], [len(last)], cos, sin, last)
                hidden = hidden.index_select(0, last)
            else:
                out = self._attention(index, layer.self_attn, attn_in, write, parts, sizes, cos, sin)
            hidden = hidden + out
            mlp_in = layer.post_attention_layernorm(hidden)
            fused = self._fused[index]
            hidden = hidden + (layer.mlp(mlp_in) if fused is None else fused.mlp(mlp_in, layer.mlp))
        if final is None:
            hidden = hidden.index_select(0, last)
        return self.model.lm_head(inner.norm(hidden)).float()

    def _fused_forward(self, ids: List[int], slots: List[int], positions: List[int], parts, sizes: List[int],
                       last: List[int], final=None) -> torch.Tensor:
        """:meth:`_forward` with the native kernels' fused small ops (:data:`_fused_ops`): each residual add
        and the RMSNorm after it as one call, the rotary embedding and the K/V cache write as one, SiLU
        and the product with the up projection as one; each rounds as the torch ops it replaces.

        12 layers of ~30 torch ops became ~9 calls each: a bench-model decode step spent ~1.0 ms (1 row)
        and ~1.5 ms (8 rows) outside its linears and attention (Zen 5 EPYC, 2 threads).
        """
        kernels, inner = self._kernels, self.model.model
        positions = torch.tensor(positions, dtype=torch.int64)
        slots = torch.tensor(slots, dtype=torch.int64)
        last = torch.tensor(last)
        hidden = inner.embed_tokens(torch.tensor(ids, dtype=torch.long))
        delta = None  # the residual branch not yet added to ``hidden``
        for index, layer in enumerate(inner.layers):
            norm = layer.input_layernorm
            attn_in = kernels.add_rmsnorm(hidden, delta, norm.weight, norm.variance_epsilon)
            if final is not None and index == len(inner.layers) - 1:
                delta = self._fused_attention(index, layer.self_attn, attn_in, positions, slots, [final], [len(last)],
                                              last)
                hidden = hidden.index_select(0, last)
            else:
                delta = self._fused_attention(index, layer.self_attn, attn_in, positions, slots, parts, sizes)
            norm = layer.post_attention_layernorm
            mlp_in = kernels.add_rmsnorm(hidden, delta, norm.weight, norm.variance_epsilon)
            delta = layer.mlp.down_proj(kernels.silu_mul(self._fused[index].gate_up_proj(mlp_in)))
        if final is None:
            hidden, delta = hidden.index_select(0, last), delta.index_select(0, last)
        normed = kernels.add_rmsnorm(hidden, delta, inner.norm.weight, inner.norm.variance_epsilon)
        return self.model.lm_head(normed).float()

    def _fused_attention(self, index, attn, x, positions, slots, parts, sizes, rows=None) -> torch.Tensor:
        """:meth:`_attention` with the rotation and the cache write in one native call (in place in the
        fused q/k/v product)."""
        n, heads = x.shape[0], self.n_heads + self.n_kv_heads
        qkv = self._fused[index].qkv_proj(x)
        k_layer, v_layer = self.k_cache[index], self.v_cache[index]
        self._kernels.rope_store(qkv, self.n_heads, self.n_kv_heads, self._cos, self._signed_sin, positions, slots,
                                 k_layer, v_layer)
        if rows is not None:
            qkv, n = qkv.index_select(0, rows), rows.shape[0]
        qkv = qkv.view(n, heads + self.n_kv_heads, self.head_dim)
        return self._attend(attn, qkv[:, :self.n_heads], qkv[:, self.n_heads:heads], qkv[:, heads:], k_layer,
                            v_layer, parts, sizes)

    def _write_index(self, slots: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """Flat row numbers ``[N * kv_heads]`` of each new key in a layer's cache viewed as ``[-1, head_dim]``.

        One ``index_copy_`` per layer then writes every token at its own position in its own
        slot; an advanced-index assignment (``cache[rows, :, positions] = k``) does the same
        several times slower.
        """
        head = torch.arange(self.n_kv_heads, device=self.device).view(1, -1)
        return ((slots.view(-1, 1) * self.n_kv_heads + head) * self.max_length + positions.view(-1, 1)).reshape(-1)

    def _attention(self, index, attn, x, write, parts, sizes, cos, sin, rows=None) -> torch.Tensor:
        """One layer's attention for the pass's ``n`` tokens: project, rotate, write K/V to the cache, attend.

        Each part is called with its own tokens' queries, keys and values ``[tokens, heads,
        head_dim]`` in the weights' dtype and with the layer's cache, which already holds those keys
        and values; it returns ``[tokens, heads, head_dim]``. With ``rows``, every token's keys and
        values are written and only those rows attend (``parts`` are theirs).
        """
        n = x.shape[0]
        fused = self._fused[index]
        if fused is None:
            q = _rotate(attn.q_proj(x).view(n, self.n_heads, self.head_dim), cos, sin)
            k = _rotate(attn.k_proj(x).view(n, self.n_kv_heads, self.head_dim), cos, sin)
            v = attn.v_proj(x).view(n, self.n_kv_heads, self.head_dim)
        else:  # q and k are side by side in the fused product: one rotation for both
            heads = self.n_heads + self.n_kv_heads
            qkv = fused.qkv_proj(x).view(n, heads + self.n_kv_heads, self.head_dim)
            qk = _rotate(qkv[:, :heads], cos, sin)
            q, k, v = qk[:, :self.n_heads], qk[:, self.n_heads:], qkv[:, heads:]
        k_layer, v_layer = self.k_cache[index], self.v_cache[index]
        kv = self.kv_dtype
        k_layer.view(-1, self.head_dim).index_copy_(0, write, k.reshape(-1, self.head_dim).to(kv))
        v_layer.view(-1, self.head_dim).index_copy_(0, write, v.reshape(-1, self.head_dim).to(kv))
        if rows is not None:
            q, k, v = (t.index_select(0, rows) for t in (q, k, v))
        return self._attend(attn, q, k, v, k_layer, v_layer, parts, sizes)

    def _attend(self, attn, q, k, v, k_layer, v_layer, parts, sizes) -> torch.Tensor:
        """Each part's tokens attend as the part says (the cache already holds their keys and values);
        the heads' outputs through ``o_proj``."""
        n = q.shape[0]
        gqa = self.n_heads != self.n_kv_heads
        split = (lambda t: t.split(sizes)) if len(parts) > 1 else (lambda t: (t,))
        outs = [part(q_part, k_part, v_part, k_layer, v_layer, gqa)
                for part, q_part, k_part, v_part in zip(parts, split(q), split(k), split(v))]
        out = outs[0] if len(outs) == 1 else torch.cat([o.to(self.dtype) for o in outs])
        return attn.o_proj(out.reshape(n, self.n_heads * self.head_dim).to(self.dtype))


class _NativeDecodeRows:
    """Decode rows attending through the native kernel (:mod:`.cpu_kernels`), each over exactly its own
    positions in its own slot, the query heads of a GQA group reading each key and value once.

    SDPA over the slot cache took 8.5 ms of a 17.6 ms decode step at 8 rows of ~300 positions
    (bench model, bf16 weights, float32 cache, Zen 5 EPYC, 2 threads): ~21 GB/s.
    """

    def __init__(self, kernels, slots: List[int], lengths: List[int], scale: float):
        self.kernels, self.scale = kernels, scale
        self.slots = torch.tensor(slots, dtype=torch.int64)
        self.lengths = torch.tensor([n + 1 for n in lengths], dtype=torch.int64)

    def __call__(self, q, k, v, k_layer, v_layer, gqa: bool) -> torch.Tensor:
        if q.stride(2) != 1 or q.stride(1) != q.shape[2]:
            q = q.contiguous()
        return self.kernels.decode_attention(q, k_layer, v_layer, self.slots, self.lengths, self.scale)


class _DecodeRows:
    """Queries ``[rows, heads, head_dim]``, one per row, attending over the cache as ``plan`` says."""

    def __init__(self, plan):
        self.plan = plan

    def __call__(self, q, k, v, k_layer, v_layer, gqa: bool) -> torch.Tensor:
        return self.plan(q.to(k_layer.dtype).unsqueeze(2), k_layer, v_layer, gqa).squeeze(2)


class _Chunk:
    """A prompt chunk's queries ``[tokens, heads, head_dim]``, attending as ``plan`` (a one-slot range) says."""

    def __init__(self, plan):
        self.plan = plan

    def __call__(self, q, k, v, k_layer, v_layer, gqa: bool) -> torch.Tensor:
        q = q.to(k_layer.dtype).transpose(0, 1).unsqueeze(0)
        return self.plan(q, k_layer, v_layer, gqa)[0].transpose(0, 1)


class _NativePrompt:
    """A prompt chunk attending causally through the native kernel
    (:meth:`.cpu_kernels.CpuKernels.prompt_attention`): both products in float32 on the prompt GEMM's
    tile and an exact softmax between them, whether the arithmetic is float32 or bf16. A first chunk
    attends over its own keys and values (as computed), a later one over its slot of the cache,
    which holds the earlier chunks' and its own.

    On the bench model's shapes (12 heads of 64, 2 threads, 2-vCPU AVX2 EPYC, one layer, best of
    15): a first chunk 1.4 against SDPA's 2.7 ms at 256 tokens, 7.7 against 11.2 at 768, 14.6
    against 21.8 at 1024, as exact (float64 reference: 6e-5 at 768 either way); a chunk of 256
    after 512 over a bf16 cache 3.9 against 7.7 ms by blocks of torch products
    (:class:`_PromptAttention`), after 256 2.4 against 5.3. bf16 arithmetic on a Zen 4 EPYC
    (``avx512bf16`` build): whole prefills as fast as by bf16 blocks (1.00-1.02x), the scores and
    weights not rounded to bf16 (7.6e-3 from float64 at 768 tokens against 1.3e-2).

    With ``tiles`` (bf16 over a bf16 cache on an AMX CPU), both products run on AMX's tiles and the weights
    are rounded to bf16 between them, as SDPA's bf16 flash kernel (the way taken otherwise there) rounds
    them. AMX Xeon (family 6 model 167), one layer, medians of 15 alternated: 0.37 against SDPA's 0.47-0.58
    ms at 256 tokens, 1.8 against 2.7-2.9 at 768, a chunk of 256 after 512 1.1-1.2 against 1.5-1.7; whole
    in-process prefills 0.92x the time at 256 tokens and 0.95x at 768 (medians of 10 alternated).
    """

    def __init__(self, kernels, scale: float, slot: int, start: int, tiles: bool = False):
        self.kernels, self.scale, self.slot, self.start, self.tiles = kernels, scale, slot, start, tiles

    def __call__(self, q, k, v, k_layer, v_layer, gqa: bool) -> torch.Tensor:
        if self.start:
            end = self.start + q.shape[0]
            k, v = (c[self.slot].transpose(0, 1)[:end] for c in (k_layer, v_layer))  # [end, kv_heads, head_dim]
        return self.kernels.prompt_attention(q, k, v, self.scale, self.start, tiles=self.tiles)


class _PromptAttention:
    """A prompt chunk's queries attending by blocks, in the arithmetic's dtype: for bf16 arithmetic on
    a CPU without AMX, and float32 arithmetic over a bf16 cache (:func:`prompts_attend_by_blocks`), where
    the native kernels do not load (:class:`_NativePrompt` otherwise).

    bf16 arithmetic gets a float32 KV cache where the native kernels do not load, so SDPA would
    run its flash kernel in float32; its bfloat16 kernel is no faster (768 tokens of the bench
    model, causal: ~7.8 ms a layer either way on a Zen 5 EPYC, ~116 GFLOP/s). Here each block
    of ``block`` queries is two matrix products in the queries' dtype against the keys up to the
    block's last position, with a softmax between them (torch's CPU softmax of bf16 sums in float32), as HF's eager
    attention computes: ~3.5 ms a layer at 768 tokens; the whole 768-token prefill 304 -> 250 ms,
    256 tokens 84 -> 78 ms. The blocks keep the scores ``[heads, block, positions]`` small and
    skip the products above the diagonal but in each block's own square. A first chunk's keys
    and values are its own; a later chunk's come from the cache, converted. A float32 first chunk
    goes through SDPA's causal path instead (:meth:`_causal`). Not for float16:
    torch's CPU float16 products are slow without native support (the same 768 tokens: 5.3 s by
    blocks against 3.5 s through SDPA, and 0.25 s in bf16), so float16 keeps SDPA.
    """

    block = 128

    def __init__(self, slot: int, start: int, dtype: torch.dtype = torch.bfloat16, device="cpu"):
        self.slot, self.start = slot, start
        #: -inf above the diagonal of a block's own square, built once for every layer of the pass.
        self.above = torch.full((self.block, self.block), float("-inf"), dtype=dtype, device=device).triu_(1)

    def __call__(self, q, k, v, k_layer, v_layer, gqa: bool) -> torch.Tensor:
        if not self.start and q.dtype == torch.float32:
            return self._causal(q, k, v, gqa)
        tokens, heads, dim = q.shape
        end = self.start + tokens
        if self.start:
            k, v = (c[self.slot, :, :end].to(q.dtype) for c in (k_layer, v_layer))  # [kv_heads, end, dim]
        else:
            k, v = k.transpose(0, 1), v.transpose(0, 1)
        if gqa:
            k, v = (t.repeat_interleave(heads // t.shape[0], dim=0) for t in (k, v))
        q = torch.mul(q.transpose(0, 1), dim ** -0.5).contiguous()  # [heads, tokens, dim]
        k, v = k.contiguous(), v.contiguous()
        out = torch.empty_like(q)
        above = self.above.to(q.dtype)
        for first in range(0, tokens, self.block):
            last = min(tokens, first + self.block)
            span = self.start + last
            scores = torch.matmul(q[:, first:last], k[:, :span].transpose(1, 2))
            scores[:, :, self.start + first:span].add_(above[:last - first, :last - first])
            out[:, first:last] = torch.matmul(torch.softmax(scores, -1), v[:, :span])
        return out.transpose(0, 1)

    @staticmethod
    def _causal(q, k, v, gqa: bool) -> torch.Tensor:
        """A float32 first chunk over its own keys and values through SDPA's causal path: faster than
        the blocks there (the bench model's 12 layers, 2-vCPU AVX2 EPYC, 3 prefills each: 32-35 against
        41-64 ms at 256 tokens, 182-198 against 183-259 at 768), and as exact."""
        q, k, v = (t.transpose(0, 1).unsqueeze(0).contiguous() for t in (q, k, v))  # [1, heads, tokens, dim]
        out = torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=gqa)
        return out[0].transpose(0, 1)


class _RangeAttention:
    """One attention call over the cache slots ``[first, first + count)``, positions ``[0, span)``.

    The rows of the forward pass sit in ``slots`` (default: the whole run, in order); each
    attends to the positions at or before its own. Slots of the run that are not in the pass
    get a zero query that attends to position 0 only, and their output is dropped.
    """

    def __init__(self, first: int, count: int, positions: torch.Tensor, span: int, dtype: torch.dtype,
                 slots: Optional[List[int]] = None):
        self.first, self.count, self.span = first, count, span
        device = positions.device
        self.index = None
        if slots is not None and slots != list(range(first, first + count)):
            self.index = torch.tensor(slots, device=device) - first
            positions = positions.new_zeros((count, positions.shape[1])).index_copy_(0, self.index, positions)
        self.mask = _additive_mask(positions, span, dtype)

    def __call__(self, q, k_layer, v_layer, gqa: bool) -> torch.Tensor:
        run = slice(self.first, self.first + self.count)
        if self.index is not None:
            q = q.new_zeros((self.count,) + q.shape[1:]).index_copy_(0, self.index, q)
        out = torch.nn.functional.scaled_dot_product_attention(
            q, k_layer[run, :, :self.span], v_layer[run, :, :self.span], attn_mask=self.mask, enable_gqa=gqa)
        return out if self.index is None else out.index_select(0, self.index)


class _CausalPrompt:
    """A prompt's first chunk, attending to itself: SDPA's own causal path.

    An explicit mask makes SDPA's CPU kernel compute every block of the square; ``is_causal``
    skips those above the diagonal, half the attention of a long prompt (a 768-token prefill
    on the bench model, float32, 2 threads: 1406 against 1460 ms, best of 6).
    """

    def __init__(self, slot: int, span: int):
        self.slot, self.span = slot, span

    def __call__(self, q, k_layer, v_layer, gqa: bool) -> torch.Tensor:
        run = slice(self.slot, self.slot + 1)
        return torch.nn.functional.scaled_dot_product_attention(
            q, k_layer[run, :, :self.span], v_layer[run, :, :self.span], is_causal=True, enable_gqa=gqa)


class _RowAttention:
    """Decode attention, one call per row over exactly its own ``(slot, span)``."""

    def __init__(self, rows: List[tuple]):
        self.rows = rows

    def __call__(self, q, k_layer, v_layer, gqa: bool) -> torch.Tensor:
        sdpa = torch.nn.functional.scaled_dot_product_attention
        return torch.cat([sdpa(q[b:b + 1], k_layer[slot:slot + 1, :, :span], v_layer[slot:slot + 1, :, :span],
                               enable_gqa=gqa) for b, (slot, span) in enumerate(self.rows)])


def _lay_out(slots: List[int], tokens: Sequence[int], lengths: List[int], chunks: Sequence[PrefillChunk]):
    """A pass's tokens in order, the decode rows' (one each of ``slots``, at ``lengths``) then each chunk's:
    their ids, slots and positions, and each chunk's ``(first row, rows, slot, first position)``."""
    ids, token_slots, positions, spans = list(tokens), list(slots), list(lengths), []
    for chunk in chunks:
        n = len(chunk.token_ids)
        spans.append((len(ids), n, chunk.slot, chunk.start))
        ids += chunk.token_ids
        token_slots += [chunk.slot] * n
        positions += range(chunk.start, chunk.start + n)
    return ids, token_slots, positions, spans


def _rotate(x: torch.Tensor, cos: torch.Tensor, signed_sin: torch.Tensor) -> torch.Tensor:
    """Llama's rotary embedding, bit for bit HF's ``x * cos + rotate_half(x) * sin``.

    ``rotate_half(x) * sin`` is ``roll(x, D/2) * signed_sin`` with the first half of ``sin``
    negated (:func:`_signed_sin`): the same products (a sign moves from one factor to the
    other), in one op instead of two slices, a negation and a concatenation.
    """
    return x * cos + x.roll(x.shape[-1] // 2, -1) * signed_sin


def _signed_sin(sin: torch.Tensor) -> torch.Tensor:
    half = sin.shape[-1] // 2
    return torch.cat([-sin[..., :half], sin[..., half:]], dim=-1)


def _additive_mask(positions: torch.Tensor, span: int, dtype: torch.dtype) -> torch.Tensor:
    """``[B, 1, T, span]``: 0 where a query may attend (cache positions at or before its own), else -inf.

    Additive in the model's dtype: SDPA converts a boolean mask to this form on every call,
    once per layer.
    """
    allowed = torch.arange(span, device=positions.device) <= positions.unsqueeze(-1)
    mask = torch.zeros(allowed.shape, dtype=dtype, device=positions.device)
    return mask.masked_fill_(~allowed, float("-inf")).unsqueeze(1)
