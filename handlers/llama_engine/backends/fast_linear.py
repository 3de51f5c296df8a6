"""Faster CPU linear layers for decoding: oneDNN weights packed once at load.

``nn.Linear`` in bfloat16 on CPU goes through ``aten::mm``, which for the few rows of a
decode step (one per sequence) reads the weight in its plain layout every call and runs at a
fraction of the memory bandwidth. oneDNN's inner product over a weight reordered once into
its blocked layout (``mkldnn._reorder_linear_weight``, the same pair of ops inductor's CPU
freezing emits for low-precision linears) uses the CPU's avx512_bf16 / AMX kernels instead.

:func:`pack_linears` swaps a model's ``nn.Linear`` modules for :class:`PackedLinear` in
place. The packed weight replaces the original (no second copy in memory); the layer
computes the same product (oneDNN accumulates in float32 and rounds the output once, as the
plain path does), so logits agree with the plain model to bfloat16 rounding.

It is applied only where it pays: bfloat16 (and float16) weights on a CPU with mkldnn and
native bf16 support, always; float32 weights where a measurement at load says so. Which float32
kernel wins depends on the CPU: on an AMX Xeon, ``nn.Linear`` (MKL's sgemm) and packed kernels
measured alike end to end; on an AVX2-only AMD EPYC, MKL's sgemm ran the bench model's weights
at 15 GFLOPS for 8 rows where oneDNN's packed kernel ran at 33 (118 vs 55 ms per pass over all
of them at 2 threads, minimum of 20) and 1 row ~12% slower. So :func:`pack_linears` times
products of the model's shapes each way at 1 and at 8 rows when it loads (about a second) and
packs float32 only if that is faster by 10%; off the ``avx2`` class, where the native kernels
load, it times them too (:func:`float32_linear_kernel`); it logs the timings. ``LLAMA_PACKED_LINEAR=0``
turns all packing off, ``=1`` packs float32 without measuring, ``=native`` puts float32 on the
native kernels without measuring.

oneDNN weights are packed for 8 rows (:data:`ONEDNN_BATCH_HINT`), in either dtype: streaming
the bench model's 85 bf16 weights once at 2 threads took 26.5 ms packed for 8 rows against 34.9
ms packed for 1, with 1 row as with 8 (medians of 6 passes), and prefill (256 and 768 rows)
measured the same either way; float32 on the AVX2 EPYC likewise (:data:`FP32_BATCH_HINT`).

bfloat16 weights go one step further where the native kernels load (:mod:`.cpu_kernels`):
:class:`NativeLinear` keeps the weight in its plain layout, streams it through the native
kernel for the few rows of a decode step, and hands more rows to oneDNN's inner product over
the same plain weight. One pass over the bench model's weights for one row (Zen 5 EPYC, 2
threads, best of 6, four runs): 3.7-5.0 ms native against 4.7-6.7 ms oneDNN packed; 8 rows
5.7-6.4 against 6.2-6.8. The plain weight costs oneDNN 3-5% on prompts of 256-768 rows (913-935
against 959-961 GFLOP/s) and 10-25% on 16-64 rows (:data:`NATIVE_MAX_ROWS`): that is what a
single copy of the weights costs there. float32 weights do the same on an ``avx2`` CPU, where
oneDNN has no wider instructions than the native kernel, for every row count: a prompt's rows
go to the ``avx2`` build's GEMM (:data:`GEMM_ISAS`). A float32
model may keep its linears' weights in bf16 (``pack_linears(weight_dtype=torch.bfloat16)``, what
``handler.weight_dtype: auto`` does for a bf16 checkpoint): the native kernel widens them as it
streams them (:data:`BF16_WEIGHT_MAX_ROWS`).
"""
from __future__ import annotations

import itertools
import logging
import math
import os
import statistics
import sys
import threading
from typing import Callable, Dict, FrozenSet, List, Mapping, Optional, Sequence, Tuple

import torch
from torch import nn

from ..cpu import cpu_class, cpu_flags, huge_page_empty, is_amx, release_freed_memory
from . import cpu_kernels, int8_rows

logger = logging.getLogger(__name__)

#: The spellings an on/off environment switch takes (:func:`switch_setting`).
OFF, ON = ("0", "off", "false", "no"), ("1", "on", "true", "yes")


def env_word(name: str, default: str, words: Sequence[str], aliases: Optional[Dict[str, str]] = None) -> str:
    """Environment variable ``name``, lowered and stripped (``default`` when unset), as one of ``words`` (a
    spelling in ``aliases`` stands for its word); anything else is a ValueError that names the variable and its
    words (a typo would otherwise leave the switch as it was)."""
    setting = os.environ.get(name, default).strip().lower()
    word = aliases.get(setting, setting) if aliases else setting
    if word not in words:
        raise ValueError(f"{name}={setting!r}: use {', '.join(words[:-1])} or {words[-1]}")
    return word


_ON_OFF = {**dict.fromkeys(OFF, "0"), **dict.fromkeys(ON, "1")}


def switch_setting(name: str, default: str, *others: str) -> str:
    """On/off environment switch ``name`` (:func:`env_word`): ``"off"`` for any of :data:`OFF`, ``"on"`` for
    any of :data:`ON`, or one of ``others``."""
    word = env_word(name, default, ("0", "1") + others, _ON_OFF)
    return {"0": "off", "1": "on"}.get(word, word)


#: Environment switch: "0" leaves a decode step's weights where they were loaded (:func:`gather_weights`).
GATHER_ENV = "LLAMA_GATHER_WEIGHTS"
#: Each weight :func:`gather_weights` places starts on a cache line.
GATHER_ALIGN = 64
#: Environment switch: "0" disables packing, "1" packs float32 without measuring, "native" runs float32 on
#: the native kernels without measuring (where they load), default: bf16/fp16 always, float32 on
#: whichever kernel measures fastest (:func:`float32_linear_kernel`).
ENV = "LLAMA_PACKED_LINEAR"
#: Environment switch for a bf16 model's products of more rows than :class:`NativeLinear` keeps (a prompt's):
#: "float32" multiplies them in float32 over a copy of the weight made for the call, "bfloat16" on oneDNN's
#: bf16 product, "native" on the AVX-512 builds' GEMM; default: whichever measures fastest at load
#: (:func:`bf16_prompt_products`).
WIDE_ENV = "LLAMA_BF16_PROMPT_PRODUCTS"
#: The rows :func:`bf16_prompt_products` times (a prompt's), and the bytes of weights it streams.
WIDE_ROWS, WIDE_SAMPLE_BYTES = 256, 64 << 20
#: Another side is taken over bf16 where the median ratio of its passes to bf16's is below this.
WIDE_TAKE = 0.95
#: A median ratio in this range is taken as unsure: :data:`WIDE_MORE_ROUNDS` more rounds are timed and all decide.
WIDE_UNSURE, WIDE_MORE_ROUNDS = (0.85, 1.05), 10
#: Where the bf16 weights go to pair panels (:func:`weight_pairs`), :func:`bf16_prompt_products` takes the native
#: GEMM while its median ratio is within this share of the side it would take otherwise: only with it does every
#: row count run natively, and so only with it do a decode step's products run on the pair panels. On an Emerald
#: Rapids Xeon (bench model, 2 threads, 6 alternated rounds in one process, medians), a load that had taken
#: float32 over a copy stepped 8 rows in 21.5 ms against 15.8 with the GEMM and its pair panels, and prefilled
#: 8 x 256 tokens in 2,029 against 1,912 ms; 4 of 29 loads there had taken float32, at native / float32 ratios
#: of 1.03-1.09, and served 8 streams at 0.82x the throughput of a load beside them that had taken the GEMM (the
#: median of 12 alternated rounds in three runs).
NATIVE_PROMPT_FAVOUR = 0.15
#: :func:`float32_linear_kernel` takes the native kernels while they score within this share of the fastest
#: other kernel: their products are the only part of a decode step that the measurement times. With them, the
#: step gathers its weights (:func:`gather_weights`) and runs its layers in one native call. The bench
#: model's float32 checkpoint on a Zen 4 EPYC (2 threads, 8 alternated rounds of 20 steps, medians): one-row
#: steps 10.4 ms native against 20.0 with oneDNN's packed products, where one pass over the products took
#: 13.9 (gathered) against 22.0; 8 rows 28.1 against 30.6, where the products took 22.4 against 22.5: at
#: equal products, the native step was 8% faster. The measurement's scores there, four loads: native
#: 20.1 / 21.7 / 24.4 / 24.5 ms against oneDNN's 23.2 / 24.9 / 25.3 / 26.6; with a 5% favour, one of
#: three ``decode_profile`` runs had loaded oneDNN's (a step of 22 ms where native's took 14-15).
NATIVE_FP32_FAVOUR = 0.10
#: The most rows :class:`NativeLinear` runs on the native kernel; oneDNN (over the same plain weight)
#: takes more. One pass over the bench model's bf16 weights (Zen 5 EPYC, 2 threads, best of 6), native
#: against oneDNN plain: 8 rows 6.4 against 9.9 ms, 16 rows 8.9 against 12.1, 32 rows 14.3 against
#: 16.0, 48 rows 19.2 against 19.6 (oneDNN packed, for comparison: 6.8, 8.1, 12.1, 15.8).
NATIVE_MAX_ROWS = 48
#: The same for bfloat16 weights under float32 arithmetic (:func:`kept_weight_kernels`); more rows go to
#: oneDNN over a float32 copy of the weight made for the call. One pass over the bench model's weights
#: (Zen 5 EPYC computing as an AVX2 CPU, 2 threads, best of 5): native over bf16 7.2 / 8.0 / 12.9 / 25.0 /
#: 34.3 / 65.2 / 87.2 / 355 ms at 1 / 4 / 8 / 16 / 24 / 48 / 64 / 256 rows, the float32 copy and oneDNN
#: 15.4 / 28.2 / 29.2 / 47.8 / 51.9 / 76.9 / 93.0 / 276; float32 weights, native 12.4 / 15.1 / 17.2 / 29.2 /
#: 38.8 / 70.4 / 92.3 / 370, oneDNN packed 14.0 / 17.5 / 17.9 / 26.6 / 32.0 / 54.0 / 70.2 / 250. So a decode
#: step's products run 1.3-1.7x faster than float32's best, steps of 17-64 rows up to 1.25x slower, and a
#: prompt's ~10% slower (the copy), against half the weights' memory.
BF16_WEIGHT_MAX_ROWS = 64
#: The kernel builds whose float32 products of many rows run a packed-panel GEMM (``gemm`` in
#: ``cpu_kernels.cpp``, from 48 rows): on them :class:`NativeLinear` keeps every row count. One layer's
#: four products of the bench model on a Zen 3 EPYC (AVX2, 2 threads, best of 5, GFLOP/s), GEMM
#: against the tiles against oneDNN over a float32 weight (the copy not counted): bf16 weights 143 /
#: 112 / 135 at 256 rows, 144 / 111 / 129 at 768; float32 weights 158 / 129 / 137 and 150 / 109 / 121.
#: Packing the activations as well took the GEMM 1.12-1.17x faster again (64 to 768 rows), and past
#: the tiles from 48 rows. Below 64 rows the tiles had been as fast or faster (64 rows: 101-123 each
#: way), and oneDNN slower (float32 weights, 24 to 64 rows: 66-83 against the tiles' 97-117). Before
#: the GEMM, float32 weights left the avx2 build past 24 rows; on a Zen 5 EPYC computing as an AVX2
#: CPU the tiles had run a pass over the bench model's float32 weights in 18.7 / 28.5 / 49.2 ms at 8 /
#: 16 / 32 rows, oneDNN over the plain weight in 26.2 / 35.0 / 47.0 at 8 / 16 / 32 and 244 at 256.
GEMM_ISAS = frozenset({"avx2"})
#: The kernel builds whose GEMM (``gemm512`` in ``cpu_kernels.cpp``, float32 arithmetic from 40 rows, a bf16
#: weight widened as its panels are packed) takes a prompt's rows over bf16 weights: always where a float32
#: model keeps its weights in bf16 (the alternative is oneDNN over a float32 copy made for each call), and
#: for a bf16 model where it times fastest at load (:func:`bf16_prompt_products`). 64 MiB of the bench
#: model's bf16 weights under float32 arithmetic on an Emerald Rapids Xeon (2 vCPUs, 9 alternated rounds):
#: 81.7 ms at 256 rows against 89.3 over a float32 copy, 50.8 against 58.1 at 128, 29.2 against 38.6 at 64
#: (the tiles: 128.6, 69.2, 34.8; 18.7 at 32 rows, as fast as the GEMM, 10.1 at 16 against its 16.3). Over
#: float32 weights oneDNN stays the faster at 256 rows (43.3 against 51.5 ms over 64 MiB), so they keep it.
#: float32 rows over 128 MiB of bf16 weights, the ``avx512`` build on that Xeon (7 alternated rounds): 42.3
#: against 46.6 ms at 128 rows, 76.4 against 78.0 at 256.
BF16_GEMM_ISAS = frozenset({"avx512", "avx512bf16"})
#: The columns of a GEMM's panel by build: outputs that are not a multiple of it leave the GEMM to the tiles,
#: so :class:`NativeLinear` gives a prompt's rows of those to oneDNN instead.
GEMM_PANEL_COLUMNS = {"avx2": 16, "avx512": 32, "avx512bf16": 32}
#: The most rows of int8 weights under bf16 that the ``avx512bf16`` build's dot-product tiles take where a bf16
#: model's prompts go to oneDNN; more multiply a bf16 copy of the weight widened for the call there. The bench
#: model's linears on a Zen 4 EPYC (2 threads, medians of 8 alternated passes), tiles against the copy (13 ms of
#: it, into a reused buffer) and oneDNN: 27.9 / 47.9 ms at 32 rows, 54.2 / 69.1 at 64, 103.7 / 121.7 at 128,
#: 202.6 / 196.5 at 256, 661 / 536 at 768.
INT8_TILES_MAX_ROWS = 256
#: Row count oneDNN lays the packed weights out for (any row count still computes correctly).
ONEDNN_BATCH_HINT = 8
#: The same for float32. Laid out for 8 rows, oneDNN matched its 1-row layout at 1 row and ran 2 to 8
#: rows 1.3-1.5x faster (a pass over the bench model's fused weights, AVX2 EPYC, 2 threads, best of 15:
#: 19.1 vs 21.9 ms at 1 row, 19.8 vs 30.8 at 2, 29.0 vs 37.9 at 8; 256 rows 385 vs 429).
FP32_BATCH_HINT = ONEDNN_BATCH_HINT


#: Each thread's buffer for :meth:`NativeLinear._dequantized`.
_DEQUANTIZED = threading.local()


class NativeLinear(nn.Module):
    """``y = x @ W.T + b`` over the plain weight: the native kernel (:mod:`.cpu_kernels`) for up to
    ``max_rows`` rows, oneDNN's inner product over the same weight for more (inference only).

    ``weight_dtype``: keep the weight in this dtype instead of the linear's (bfloat16 for a float32
    model: the native kernel widens it as it streams it, half the bytes; more rows than ``max_rows``
    multiply a float32 copy made for the call).

    ``pairs``: lay a bf16 weight out in the native kernels' pair panels (:meth:`.CpuKernels.pack_pairs`)
    where they take it and every row count runs natively (``max_rows`` unbounded: oneDNN never reads
    it); ``self.pairs`` says whether it was. ``weight`` then keeps its shape, not its layout.

    ``compute_dtype``: the arithmetic's dtype where the linear's weight is already in the kept one (default:
    the weight's dtype).

    ``place``: where to keep the weight (a tensor of its shape and kept dtype, e.g. its place in a
    :class:`GatheredBlock`; another is ignored). The weight is written there as it is laid out, or
    converted there and laid out in place; a linear whose weight is already there (:func:`concat_linears`
    into it) is laid out in place."""

    def __init__(self, linear: nn.Linear, kernels, max_rows: Optional[int] = None,
                 weight_dtype: Optional[torch.dtype] = None, wide_in_float32: bool = False, pairs: bool = False,
                 place: Optional[torch.Tensor] = None, compute_dtype: Optional[torch.dtype] = None):
        super().__init__()
        self.in_features, self.out_features = linear.in_features, linear.out_features
        self.kernels, self.max_rows = kernels, NATIVE_MAX_ROWS if max_rows is None else max_rows
        self.wide_in_float32 = wide_in_float32
        weight = linear.weight.detach()
        self.compute_dtype = compute_dtype or weight.dtype
        kept = weight_dtype or weight.dtype
        if place is not None and (place.shape != weight.shape or place.dtype != kept or not place.is_contiguous()
                                  or (kept == torch.int8 and not int8_rows.carries_scales(place))):
            place = None
        if kept == torch.int8:  # more rows than max_rows multiply a copy widened for the call (_dequantized)
            self.pairs = False
            stored = int8_rows.quantize(weight, out=place, kernels=kernels)
        else:
            if kernels is not None and self.out_features % GEMM_PANEL_COLUMNS.get(kernels.isa, 1):
                self.max_rows = min(self.max_rows, NATIVE_MAX_ROWS)  # the GEMMs take whole panels only: oneDNN's
            stored = self._kept(weight, kept, kernels, pairs, place)
        self.register_buffer("weight", stored, persistent=False)
        bias = None if linear.bias is None else linear.bias.detach().to(self.compute_dtype, copy=True)
        self.register_buffer("bias", bias, persistent=False)

    def _kept(self, weight: torch.Tensor, kept: torch.dtype, kernels, pairs: bool,
              place: Optional[torch.Tensor]) -> torch.Tensor:
        """``weight`` in ``kept``, in pair panels where ``pairs`` and they take it (``self.pairs``), at ``place``
        where given."""
        source = place.copy_(weight) if place is not None and weight.dtype != kept else weight.to(kept)
        self.pairs = bool(pairs and kernels is not None and self.max_rows == sys.maxsize
                          and kernels.takes_pairs(source))
        if self.pairs:
            return kernels.pack_pairs(source, out=place)
        if place is None:
            return source.contiguous()
        return place if place.data_ptr() == source.data_ptr() else place.copy_(source)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        rows = x.numel() // self.in_features
        if rows > self.max_rows:  # oneDNN, in float32 over copies made for the call where that was chosen
            dtype = torch.float32 if self.wide_in_float32 else x.dtype
            bias = None if self.bias is None else self.bias.to(dtype)
            weight = self._dequantized(dtype) if self.weight.dtype == torch.int8 else self.weight.to(dtype)
            return torch.ops.mkldnn._linear_pointwise(x.to(dtype), weight, bias, "none", [], "").to(x.dtype)
        flat = x.reshape(rows, self.in_features)
        if flat.stride(-1) != 1:
            flat = flat.contiguous()
        y = self.kernels.linear(flat, self.weight, pairs=self.pairs).view(*x.shape[:-1], self.out_features)
        return y if self.bias is None else y.add_(self.bias)

    def _dequantized(self, dtype: torch.dtype) -> torch.Tensor:
        """The int8 weight times its scales in ``dtype``, in this thread's scratch buffer (one for every linear:
        the largest weight's size, reused so that a prompt's products do not fault in fresh pages each call)."""
        numel = self.weight.numel()
        buffer = getattr(_DEQUANTIZED, "buffer", None)
        if buffer is None or buffer.dtype != dtype or buffer.numel() < numel:
            _DEQUANTIZED.buffer = buffer = None  # the old one freed before the new one is allocated
            _DEQUANTIZED.buffer = buffer = torch.empty(numel, dtype=dtype)
        return self.kernels.dequantize_rows(self.weight, dtype, out=buffer[:numel].view(self.weight.shape))

    def extra_repr(self) -> str:
        layout = ", pair panels" if self.pairs else ""
        return f"in_features={self.in_features}, out_features={self.out_features}, bias={self.bias is not None}, " \
               f"dtype={self.weight.dtype}{layout}, native up to {self.max_rows} rows ({self.kernels.isa})"


class PackedLinear(nn.Module):
    """``y = x @ W.T + b`` with ``W`` held in oneDNN's packed layout (inference only)."""

    def __init__(self, linear: nn.Linear, batch_hint: int = ONEDNN_BATCH_HINT):
        super().__init__()
        self.in_features, self.out_features = linear.in_features, linear.out_features
        weight = linear.weight.detach()
        self.dtype = weight.dtype
        # Packed for ``batch_hint`` rows; any row count is still computed correctly.
        self.register_buffer("packed_weight", torch.ops.mkldnn._reorder_linear_weight(weight, batch_hint),
                             persistent=False)
        bias = None if linear.bias is None else linear.bias.detach().clone()
        self.register_buffer("bias", bias, persistent=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.ops.mkldnn._linear_pointwise(x, self.packed_weight, self.bias, "none", [], "")

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, bias={self.bias is not None}, " \
               f"dtype={self.dtype}, packed=mkldnn"


def _agrees(linear: nn.Linear, packed: nn.Module) -> bool:
    """The packed layer computes the plain one's product (a few row counts, one random input each)."""
    gen = torch.Generator().manual_seed(0)
    with torch.inference_mode():
        for rows in (1, 3, 17):
            x = torch.randn(rows, linear.in_features, generator=gen).to(linear.weight.dtype)
            want = linear(x).float()
            scale = want.abs().max().item() + 1e-6
            if (packed(x).float() - want).abs().max().item() > 1e-3 * scale:
                return False
    return True


def packing_supported(dtype: torch.dtype, device: torch.device) -> bool:
    """Whether oneDNN can pack ``dtype`` linears on ``device`` (for float32, whether it pays is measured)."""
    if torch.device(device).type != "cpu" or not torch.backends.mkldnn.is_available():
        return False
    if not torch.backends.mkldnn.enabled:
        return False
    if dtype == torch.bfloat16:
        return bool(torch.ops.mkldnn._is_mkldnn_bf16_supported())
    if dtype == torch.float16:
        return bool(torch.ops.mkldnn._is_mkldnn_fp16_supported())
    return dtype == torch.float32


def native_kernels_for(dtype: torch.dtype, device: torch.device, flags: Optional[FrozenSet[str]] = None):
    """The native kernels where :class:`NativeLinear` serves ``dtype`` weights on ``device`` without a
    measurement, else None: bfloat16 on a CPU whose kernels multiply bf16 pairs natively (the
    ``avx512bf16`` build), where it has AMX only if the build multiplies on its tiles (:func:`amx_tiles`);
    float32 on an ``avx2``-class CPU, where oneDNN has no wider instructions than the ``avx2`` build.
    ``flags``: the CPU's (default: this machine's). float32 on the other x86 classes is measured at load
    (:func:`measured_native_kernels`).

    Elsewhere oneDNN's packed products were as fast or faster (bench model, one pass over the
    weights, 2 threads). Zen 5 EPYC: float32 against oneDNN's AVX-512, 1 row 11.0 ms native against
    11.8 packed, 8 rows 14.6 against 13.3, and prompts ~5% faster packed (on a Zen 4 EPYC, 1 row 9.7
    against 15.8, 8 rows 22.8 against 17.0: hence the measurement); bf16 through the ``avx2``
    build (which converts to float32), 1 row 6.3 against 6.1, 8 rows 13.2 against 7.4. AMX Xeon,
    bf16, where oneDNN multiplies on the AMX tiles: 1 row 8.4 against 8.9, 2 rows 9.8 against 8.7,
    8 rows 16.9 against 9.1; a decode step at 8 rows took 13.8 ms with oneDNN's linears and the
    native attention, 21.8 with the native linears too (in their plain layout, before the pair panels and
    the kernels' own AMX tiles: with them, an AMX Xeon's decode steps ran 2.26x faster at 1 row and 1.83x at
    8 than on oneDNN's products). float32 on an ``avx2`` CPU: see :data:`GEMM_ISAS`.
    """
    if not packing_supported(dtype, device):
        return None
    flags = cpu_flags() if flags is None else flags
    if dtype == torch.bfloat16:
        isa = "avx512bf16"
    elif dtype == torch.float32 and cpu_class(flags) == "avx2":
        isa = "avx2"
    else:
        return None
    kernels = cpu_kernels.for_device(device)
    if kernels is None or kernels.isa != isa:
        return None
    return None if dtype == torch.bfloat16 and is_amx(flags) and not amx_tiles(kernels) else kernels


def amx_tiles(kernels) -> bool:
    """Whether ``kernels`` multiply bf16 rows over pair panels on AMX's tiles (the ``avx512bf16`` build on a
    CPU with AMX whose tiles Linux grants), and the pair panels are not switched off (:data:`PAIRS_ENV`).
    Then one copy of a bf16 weight, in pair panels, serves every row count natively, on the tiles from
    :meth:`.CpuKernels.amx_min_rows` rows (1 unless set)."""
    rows = getattr(kernels, "amx_min_rows", None)
    return rows is not None and pairs_setting() != "off" and rows() > 0


def measured_native_kernels(dtype: torch.dtype, device: torch.device, flags: Optional[FrozenSet[str]] = None):
    """The native kernels that :func:`float32_linear_kernel` times against oneDNN's for ``dtype`` weights on
    ``device``, else None: float32 where the kernels load and :func:`native_kernels_for` does not already
    take them (an x86 CPU above the ``avx2`` class)."""
    if dtype != torch.float32 or not packing_supported(dtype, device) or native_kernels_for(dtype, device, flags):
        return None
    return cpu_kernels.for_device(device)


def native_kernels_considered(dtype: torch.dtype, device: torch.device):
    """The native kernels that :func:`pack_linears` may put ``dtype`` products on: those it takes
    (:func:`native_kernels_for`), else those it times at load (:func:`measured_native_kernels`), else None."""
    return native_kernels_for(dtype, device) or measured_native_kernels(dtype, device)


#: (arithmetic, weights) the native kernels run with the weights kept in another dtype than the arithmetic's:
#: bf16 widened to float32 as it streams, int8 with a scale per row (:mod:`.int8_rows`) at every row count.
KEPT_WEIGHTS = frozenset({(torch.float32, torch.bfloat16), (torch.float32, torch.int8), (torch.bfloat16, torch.int8)})
#: The dtypes a linear's weight is quantized to int8 from.
QUANTIZED_FROM = (torch.float32, torch.bfloat16, torch.float16)


def kept_weight_kernels(dtype: torch.dtype, weight_dtype: torch.dtype, device: torch.device):
    """The native kernels that run ``dtype`` arithmetic over ``weight_dtype`` weights on ``device``, else None:
    one of :data:`KEPT_WEIGHTS` on an x86 CPU whose kernels load (any build)."""
    if (dtype, weight_dtype) not in KEPT_WEIGHTS or torch.device(device).type != "cpu":
        return None
    return cpu_kernels.for_device(device)


def native_max_rows(kernels, limit: int = NATIVE_MAX_ROWS, weight_dtype: Optional[torch.dtype] = None) -> int:
    """The most rows :class:`NativeLinear` runs on ``kernels``: any number on a build with the GEMM
    (:data:`GEMM_ISAS`), or with the GEMM over bf16 weights kept under float32 arithmetic
    (``weight_dtype`` bfloat16, :data:`BF16_GEMM_ISAS`), else ``limit``."""
    if kernels.isa in GEMM_ISAS or (weight_dtype == torch.bfloat16 and kernels.isa in BF16_GEMM_ISAS):
        return sys.maxsize
    return limit


def pack_linears(model: nn.Module, batch_hint: Optional[int] = None, weight_dtype: Optional[torch.dtype] = None,
                 places: Optional[Mapping[nn.Module, torch.Tensor]] = None,
                 compute_dtype: Optional[torch.dtype] = None) -> int:
    """Swap every CPU ``nn.Linear`` of ``model`` for a :class:`NativeLinear` or a :class:`PackedLinear`
    where that pays; a :class:`NativeLinear` keeps its weight at ``places[linear]`` where given.
    ``compute_dtype``: the arithmetic's dtype, where the linears' weights are in ``weight_dtype`` already
    (default: their dtype).

    ``weight_dtype`` bfloat16 for a float32 model keeps the linears' weights in bf16 on the native
    kernels (:func:`kept_weight_kernels`): half the memory, and a decode step streams half the
    bytes. Returns how many layers were swapped (0 when the dtype, device or switch rules it out).
    A weight shared by another module (tied embeddings) is packed as a copy; the other module
    keeps the original.
    """
    setting = switch_setting(ENV, "auto", "auto", "native")
    if setting == "off":
        if weight_dtype == torch.int8:
            raise ValueError(f"{ENV}=0 keeps torch's linears, which do not multiply int8 weights: unset it, or set "
                             "handler.weight_dtype to auto")
        return 0
    targets = [(parent, name, child) for parent in model.modules() for name, child in parent.named_children()
               if type(child) is nn.Linear]
    if not targets:
        return 0
    dtype, device = compute_dtype or targets[0][2].weight.dtype, targets[0][2].weight.device
    if weight_dtype == torch.int8:
        kernels = kept_weight_kernels(dtype, weight_dtype, device)
        if kernels is None:
            raise ValueError(f"int8 linear weights under {dtype} arithmetic on {device} need the native CPU kernels "
                             "and float32 or bfloat16 arithmetic (an x86 CPU with AVX2 and FMA)")
        max_rows, wide = _int8_max_rows(targets, dtype, kernels)
        return _swap_native(targets, dtype, kernels, max_rows, weight_dtype, wide_in_float32=wide, pairs=False,
                            places=places)
    if weight_dtype not in (None, dtype):
        kernels = kept_weight_kernels(dtype, weight_dtype, device)
        if kernels is None:
            raise ValueError(f"{weight_dtype} linear weights under {dtype} arithmetic need the native CPU "
                             "kernels with float32 arithmetic over bfloat16 weights (an x86 CPU with AVX2 and FMA)")
        return _swap_native(targets, dtype, kernels, native_max_rows(kernels, BF16_WEIGHT_MAX_ROWS, weight_dtype),
                            weight_dtype, places=places)
    if not packing_supported(dtype, device):
        return 0
    kernels = native_kernels_for(dtype, device)
    if kernels is not None:
        if dtype == torch.bfloat16 and amx_tiles(kernels) and prompt_products_setting() in ("auto", "native"):
            _log_amx_tiles(kernels)
            return _swap_native(targets, dtype, kernels, sys.maxsize, pairs=True, places=places)
        prompts = _bf16_prompt_products(targets, kernels) if dtype == torch.bfloat16 else None
        max_rows = sys.maxsize if prompts == "native" else native_max_rows(kernels)
        return _swap_native(targets, dtype, kernels, max_rows, wide_in_float32=prompts == "float32", places=places)
    fp32 = dtype == torch.float32
    if fp32:
        kind, kernels = _float32_kind(setting, [t[2] for t in targets], device)
        if kind == "plain":
            return 0
        if kind == "native":
            return _swap_native(targets, dtype, kernels, native_max_rows(kernels), places=places)
    return _swap(targets, dtype,
                 lambda linear: PackedLinear(linear, batch_hint or (FP32_BATCH_HINT if fp32 else ONEDNN_BATCH_HINT)),
                 "onednn", check=fp32)


def _int8_max_rows(targets, dtype: torch.dtype, kernels) -> Tuple[int, bool]:
    """The most rows int8 linears run natively, and whether more multiply a float32 copy (else one in ``dtype``):
    :data:`INT8_TILES_MAX_ROWS` where the build keeps them on its tiles (:meth:`.CpuKernels.tiles_only`) and
    oneDNN's products of a bf16 model's prompt time faster than the native GEMM (:func:`bf16_prompt_products`),
    the weight widened for each call (:meth:`NativeLinear._dequantized`); else every row count."""
    if not kernels.tiles_only(dtype, torch.int8):
        return sys.maxsize, False
    prompts = bf16_prompt_products([t[2] for t in targets], kernels)
    return (sys.maxsize, False) if prompts == "native" else (INT8_TILES_MAX_ROWS, prompts == "float32")


#: Thread counts this process has said it runs bf16 on the AMX tiles at.
_AMX_LOGGED: set = set()


def _log_amx_tiles(kernels) -> None:
    """Say once per process and thread count that bf16 products run on the tiles: nothing is timed for it, and a
    bench page lists it with the choices that are (``scripts.bench.choices``)."""
    threads = torch.get_num_threads()
    if threads not in _AMX_LOGGED:
        _AMX_LOGGED.add(threads)
        logger.info("bf16 linears on AMX tiles, %d threads: every row count native in pair panels, on the tiles "
                    "from %d row(s), not timed (%s=off: oneDNN's packed products)", threads, kernels.amx_min_rows(),
                    PAIRS_ENV)


def _bf16_prompt_products(targets, kernels) -> str:
    """:func:`bf16_prompt_products` for a bf16 model's linears, favouring the native GEMM where the weights would
    go to pair panels with it (:data:`NATIVE_PROMPT_FAVOUR`); the pair panels are timed only where that decides."""
    linears = [t[2] for t in targets]
    return bf16_prompt_products(linears, kernels, native_favour=NATIVE_PROMPT_FAVOUR,
                                favour_applies=lambda: weight_pairs(linears, kernels, torch.bfloat16, torch.bfloat16))


def _swap_native(targets, dtype: torch.dtype, kernels, max_rows: int, weight_dtype: Optional[torch.dtype] = None,
                 wide_in_float32: bool = False, pairs: Optional[bool] = None,
                 places: Optional[Mapping[nn.Module, torch.Tensor]] = None) -> int:
    """:func:`_swap` for :class:`NativeLinear` (its weights kept in ``weight_dtype`` when given, at ``places``
    where given). bf16 weights whose every row count runs natively go to pair panels where ``pairs`` is
    true, or (None) where :func:`weight_pairs` says so, and they fit."""
    places = places or {}
    kept = weight_dtype or dtype
    if pairs is None:
        pairs = max_rows == sys.maxsize and kept == torch.bfloat16 and weight_pairs([t[2] for t in targets], kernels,
                                                                                     dtype, kept)
    stored = f"{weight_dtype} weights, " if weight_dtype is not None else ""
    wide = ", more rows in float32" if wide_in_float32 else ""
    layout = ", pair panels where they fit" if pairs else ""
    if pairs and amx_tiles(kernels):
        layout += f", AMX tiles from {kernels.amx_min_rows()} row(s)"
    return _swap(targets, dtype,
                 lambda linear: NativeLinear(linear, kernels, max_rows, weight_dtype, wide_in_float32, pairs,
                                             places.get(linear), dtype),
                 f"{stored}native up to {max_rows} rows{wide}{layout}, {kernels.isa}",
                 also=QUANTIZED_FROM if kept == torch.int8 else (kept,))


def gathered_block(tensors: Sequence[torch.Tensor]) -> Tuple[torch.Tensor, List[torch.Tensor], bool]:
    """One uninitialised block with room for ``tensors`` one after another (each from a cache line), from
    a 2 MiB boundary and advised for transparent huge pages (:func:`.cpu.huge_page_empty`); returns the
    block, each tensor's place in it (a view of its shape), and whether the kernel took the advice."""
    dtype, itemsize = tensors[0].dtype, tensors[0].element_size()
    step = max(GATHER_ALIGN // itemsize, 1)
    offsets, total = [], 0
    for tensor in tensors:
        offsets.append(total)
        room = int8_rows.nbytes(tensor.shape) if dtype == torch.int8 else tensor.numel()  # int8: its scales too
        total += -(-room // step) * step
    block, huge = huge_page_empty(total, dtype)
    places = [block[offset:offset + t.numel()].view(t.shape) for t, offset in zip(tensors, offsets)]
    return block, places, huge


class GatheredBlock:
    """A place for each weight of a decode step, one after another in one block (:func:`gathered_block`),
    planned from the weights' shapes before they are laid out: each is then written to its place once, as
    :class:`NativeLinear` packs it, instead of packed apart and copied in by :func:`gather_weights`.

    Loading a Llama-2-7B-shaped bf16 checkpoint on AMX, each weight was written three times: fused by
    ``torch.cat``, laid out in pair panels, and copied into the block, each time into memory first touched
    then (a page fault per 4 KiB, while the checkpoint's pages are evicted to make room). A place no weight
    is written to takes no memory."""

    def __init__(self, shapes: Sequence[Tuple[int, ...]], dtype: torch.dtype):
        self.block, self.places, self.huge = gathered_block(
            [torch.empty(shape, dtype=dtype, device="meta") for shape in shapes])

    @classmethod
    def plan(cls, shapes: Sequence[Tuple[int, ...]], dtype: torch.dtype) -> Optional["GatheredBlock"]:
        """The block for weights of ``shapes`` and ``dtype``; None where ``LLAMA_GATHER_WEIGHTS`` is 0."""
        return cls(shapes, dtype) if shapes and switch_setting(GATHER_ENV, "auto", "auto") != "off" else None

    def holds(self, weights: Sequence[torch.Tensor]) -> bool:
        """Whether the places are for ``weights``: as many, of their shapes and dtype."""
        return len(weights) == len(self.places) and all(
            w.shape == place.shape and w.dtype == place.dtype for w, place in zip(weights, self.places))


def gather_weights(linears: Sequence["NativeLinear"], planned: Optional[GatheredBlock] = None
                   ) -> Optional[torch.Tensor]:
    """Move the weights of ``linears`` into one block, one after another in this order (a decode step's), on
    transparent huge pages where the kernel gives them (:func:`gathered_block`); returns the block (None where
    ``LLAMA_GATHER_WEIGHTS`` is 0, or the weights are not all of one dtype). ``planned``: the block, where it
    :meth:`~GatheredBlock.holds` these weights; those already at their places stay there.

    A decode step streams every weight once. As loaded, each weight sat apart on 4 KiB pages: every
    product's stream started cold (its first lines not prefetched), and took a TLB miss every 4 KiB.
    Gathered, a product's prefetch runs on into the next one's weight, and the block's 2 MiB pages cut
    the misses 512-fold. One-row decode steps of the bench model (bf16, Zen 4 EPYC, 2 threads, 16
    alternated rounds of 40 steps, medians): 8.51 ms as loaded, 8.09 gathered on 4 KiB pages, 7.52
    on huge pages; 8 rows 13.87 against 13.21. Weight by weight, so memory holds one weight twice at most.
    """
    if not linears or switch_setting(GATHER_ENV, "auto", "auto") == "off":
        return None
    dtype = linears[0].weight.dtype
    if any(linear.weight.dtype != dtype or linear.weight.device.type != "cpu" for linear in linears):
        return None
    weights = [linear.weight for linear in linears]
    if planned is not None and planned.holds(weights):
        block, places, huge = planned.block, planned.places, planned.huge
    else:
        block, places, huge = gathered_block(weights)
    del weights
    moved = 0
    with torch.no_grad():
        for linear, place in zip(linears, places):
            if linear.weight.data_ptr() == place.data_ptr():
                continue
            if dtype == torch.int8:  # its scales too
                int8_rows.copy_into(place, linear.weight)
            else:
                place.copy_(linear.weight)
            linear.weight = place  # the loaded weight is freed here, not after the loop,
            release_freed_memory()  # and handed back: the block is a mapping of its own, which no free block serves
            moved += 1
    logger.info("gathered %d weights (%.0f MB, %s) into one block in decode order (%d laid out there, %d copied "
                "in), %s", len(linears), block.numel() * block.element_size() / 1e6, dtype, len(linears) - moved,
                moved, "on transparent huge pages" if huge else "on the kernel's pages")
    return block


def tune_native_prefetch(modules: Sequence[Optional[nn.Module]]) -> Optional[int]:
    """The one-row prefetch distance of the native kernels, measured over the weights of every
    :class:`NativeLinear` in ``modules`` (:func:`cpu_kernels.tune_one_row_prefetch`); None where there are
    none. Called once the model's linears are all swapped, so that the sample is the model's weights as a
    decode step streams them, not one layer's, which a cache could hold."""
    layers = [m for module in modules if module is not None for m in module.modules()
              if isinstance(m, NativeLinear) and not m.pairs]  # pair panels have no one-row distance to tune
    if not layers:
        return None
    return cpu_kernels.tune_one_row_prefetch(layers[0].kernels, [layer.weight for layer in layers],
                                             layers[0].compute_dtype)


def _swap(targets: list, dtype: torch.dtype, make, kind: str, check: bool = False,
          also: Sequence[torch.dtype] = ()) -> int:
    """Replace each ``(parent, name, linear)`` of ``dtype`` (or one of ``also``) on the CPU by ``make(linear)``; with
    ``check``, stop at the first replacement that does not compute the linear's product (:func:`_agrees`).

    Empties ``targets`` as it goes, so that each replaced linear (and its weight, where nothing else holds
    it) is freed before the next one is made: memory holds one weight twice at most, not the model."""
    swapped = 0
    targets.reverse()
    while targets:
        parent, name, child = targets.pop()
        if (child.weight.dtype != dtype and child.weight.dtype not in also) or child.weight.device.type != "cpu":
            continue
        replacement = make(child)
        if check and not _agrees(child, replacement):
            logger.warning("%s linear disagrees with nn.Linear; keeping nn.Linear", kind)
            return swapped
        setattr(parent, name, replacement)
        swapped += 1
    logger.info("packed %d linear layers (%s, %s)", swapped, dtype, kind)
    return swapped


#: float32 decisions of this process, by torch thread count and native build (None where there is none to
#: time): one measurement serves every model loaded.
_FP32_DECISIONS: Dict[tuple, str] = {}
#: Weights the measurement streams: enough to leave a server CPU's caches (:func:`_streamed_sample`).
SAMPLE_BYTES = cpu_kernels.PREFETCH_SAMPLE_BYTES
#: The most linears it streams: a small model's would take thousands to fill :data:`SAMPLE_BYTES`, each
#: pass mostly calls, and its decode steps read weights that its caches largely hold anyway.
SAMPLE_MAX_LINEARS = 512


def _float32_kind(setting: str, linears: Sequence[nn.Linear], device: torch.device):
    """``(kind, kernels)`` for a float32 model's linears: ``"onednn"``, ``"plain"`` or ``"native"`` (with the
    kernels), as ``LLAMA_PACKED_LINEAR`` says or else :func:`float32_linear_kernel` measures."""
    native = measured_native_kernels(torch.float32, device)
    if setting == "on":
        return "onednn", None
    if setting == "native":
        if native is not None:
            return "native", native
        logger.warning("%s=native: the native kernels did not load here; measuring oneDNN against nn.Linear",
                       ENV)
    kind = float32_linear_kernel(linears, native)
    return kind, native if kind == "native" else None


def _streamed_sample(linears: Sequence[nn.Linear], limit: int) -> List[nn.Linear]:
    """Linears of the shapes of ``linears``, taken in turn, over zeroed weights of their own, until those pass
    ``limit`` bytes (or :data:`SAMPLE_MAX_LINEARS` of them). The model's linears that :func:`pack_linears`
    sees first may be one layer's (26 MB of the bench model's float32 weights, which a 32 MB last-level
    cache held): timed over them, the native kernels' 8-row products beat oneDNN's by 1.36x on a Zen 4
    EPYC, and from memory, as a decode step streams them, lost by 1.34x."""
    sample, size = [], 0
    while size < limit and len(sample) < SAMPLE_MAX_LINEARS:
        for linear in linears:
            weight = torch.zeros(linear.out_features, linear.in_features, dtype=linear.weight.dtype)
            copy = nn.Linear(linear.in_features, linear.out_features, bias=False, device="meta")
            copy.weight = nn.Parameter(weight, requires_grad=False)
            sample.append(copy.eval())
            size += weight.numel() * weight.element_size()
            if size >= limit or len(sample) == SAMPLE_MAX_LINEARS:
                break
    return sample


def float32_linear_kernel(linears: Sequence[nn.Linear], native=None, repeats: int = 5) -> str:
    """The kernel that runs float32 products fastest on this CPU, measured: ``"onednn"`` (packed) where it beats
    ``nn.Linear`` by 10% over a decode step's rows and a prompt's, else ``"plain"``; ``"native"`` where ``native``
    (kernels of :func:`measured_native_kernels`) scores within :data:`NATIVE_FP32_FAVOUR` of the faster of those
    two at a decode step's rows (then nothing else is timed: no weight is packed for oneDNN).

    Linears of the shapes of ``linears`` (:data:`SAMPLE_BYTES` of weights, :func:`_streamed_sample`) run
    each way, in turns (:func:`cpu_kernels.alternate_passes`), at 1 row and at ``ONEDNN_BATCH_HINT`` rows
    (a decode step alone and in a full batch); each side's score is the sum of its fastest pass at each,
    so a busy machine slows every side and the minimum keeps what each kernel can do. oneDNN's packed weight
    replaces the plain one, so it takes a prompt's rows too: it is taken where the geometric mean of its time
    over ``nn.Linear``'s at 1 and 8 rows and at a prompt's (:data:`WIDE_ROWS`, over :data:`WIDE_SAMPLE_BYTES` of
    weights: many rows are bound by arithmetic, not the caches) is below 0.9. On a CPU without AVX2 (emulated
    on a Zen 3 EPYC: oneDNN held to SSE4.1, MKL to SSE4.2), five loads timed oneDNN at 0.61-1.06x
    ``nn.Linear``'s time at 1 row and 0.84-1.14x at 8, and chose either, where it took 2.15x at 256 rows; the
    bench model's whole steps, packed against plain: 256-token prefills 1.7x the time (1,108-1,284 against
    700-747 ms), decode steps 0.89x at 1 row and at 8.
    """
    key = (torch.get_num_threads(), None if native is None else native.isa)
    if key in _FP32_DECISIONS:
        return _FP32_DECISIONS[key]
    sample = _streamed_sample(linears, SAMPLE_BYTES)
    size = sum(linear.weight.numel() * linear.weight.element_size() for linear in sample)
    sides = {"plain": sample, "onednn": [PackedLinear(linear, FP32_BATCH_HINT) for linear in sample]}
    if native is not None:
        sides["native"] = [NativeLinear(linear, native, NATIVE_MAX_ROWS) for linear in sample]
    best: Dict[str, list] = {side: [] for side in sides}
    for rows in (1, ONEDNN_BATCH_HINT):
        for side, fastest in _fastest_passes(sides, rows, repeats).items():
            best[side].append(fastest)
    score = {side: sum(times) for side, times in best.items()}
    if native is not None and score["native"] <= (1 + NATIVE_FP32_FAVOUR) * min(score["onednn"], score["plain"]):
        kind, prompt = "native", ""  # the weights stay plain: a prompt's rows go where they went before
    else:
        kind, prompt = _packed_or_plain(sides, best, repeats)
    _FP32_DECISIONS[key] = kind
    names = {"plain": "nn.Linear", "onednn": "oneDNN packed", "native": f"native ({key[1]})"}
    logger.info("float32 linears, %d threads, %.0f MB of weights, 1 / %d rows: %s%s -> %s", key[0], size / 1e6,
                ONEDNN_BATCH_HINT, ", ".join(f"{names[side]} " + " / ".join(f"{1e3 * t:.2f}" for t in times) + " ms"
                                             for side, times in best.items()), prompt, names[kind])
    return kind


def _packed_or_plain(sides: Dict[str, list], best: Dict[str, list], repeats: int) -> Tuple[str, str]:
    """``"onednn"`` where the geometric mean of oneDNN's packed products' time over ``nn.Linear``'s, at the rows of
    ``best`` (each side's fastest passes at 1 and 8 rows) and at a prompt's (:data:`WIDE_ROWS`, through the first
    :data:`WIDE_SAMPLE_BYTES` of ``sides``' linears), is below 0.9, else ``"plain"``; and the prompt's timings
    for the log."""
    totals = itertools.accumulate(linear.weight.numel() * linear.weight.element_size() for linear in sides["plain"])
    count = next((i + 1 for i, total in enumerate(totals) if total >= WIDE_SAMPLE_BYTES), len(sides["plain"]))
    prompt = _fastest_passes({side: sides[side][:count] for side in ("plain", "onednn")}, WIDE_ROWS, repeats)
    ratios = [onednn / plain for onednn, plain in zip(best["onednn"] + [prompt["onednn"]],
                                                        best["plain"] + [prompt["plain"]])]
    mean = math.prod(ratios) ** (1 / len(ratios))
    detail = (f"; {WIDE_ROWS} rows: nn.Linear {1e3 * prompt['plain']:.1f} ms, oneDNN packed "
              f"{1e3 * prompt['onednn']:.1f} ms (oneDNN packed / nn.Linear {' / '.join(f'{r:.2f}' for r in ratios)}, "
              f"geometric mean {mean:.2f})")
    return ("onednn" if mean < 0.9 else "plain"), detail


def _fastest_passes(sides: Dict[str, list], rows: int, repeats: int) -> Dict[str, float]:
    """Each side's fastest pass through its linears with ``rows`` rows of input, the sides in turns
    (:func:`cpu_kernels.alternate_passes`)."""
    inputs = [torch.randn(rows, linear.in_features) for linear in next(iter(sides.values()))]
    passes = cpu_kernels.alternate_passes(
        {side: (lambda layers=layers: [layer(x) for layer, x in zip(layers, inputs)]) for side, layers in sides.items()},
        repeats)
    return {side: min(times) for side, times in passes.items()}


_WIDE_DECISIONS: Dict[Tuple[int, float], str] = {}
#: What :func:`bf16_prompt_products` may return, and :data:`WIDE_ENV` may force.
PROMPT_PRODUCTS = ("bfloat16", "float32", "native")


def bf16_prompt_products(linears: Sequence[nn.Linear], kernels=None, repeats: int = 5,
                         native_favour: float = 0.0, favour_applies: Callable[[], bool] = lambda: True) -> str:
    """How a bf16 model's products of a prompt's rows run fastest: ``"bfloat16"`` on oneDNN's bf16 product,
    ``"float32"`` on oneDNN's float32 one over a copy of the weight made for each call, or ``"native"`` on the
    AVX-512 builds' GEMM (``kernels``, where their isa is in :data:`BF16_GEMM_ISAS`: float32 arithmetic, the
    weight widened as it is packed). Measured once per process and thread count (:data:`WIDE_ENV` forces one).

    Native bf16 arithmetic is not always the faster: on an Emerald Rapids Xeon without AMX (2 threads, best of
    4 alternated), oneDNN's bf16 products over the bench model's layers took 323 / 1,004 ms at 256 / 768 rows,
    float32 over a per-call copy 244 / 693; with AMX, or on a Zen 4 (bf16 at 424-437 GFLOP/s), bf16 wins. On
    that Xeon the GEMM then ran 64 MiB of those layers' weights in 81.7 ms at 256 rows against 89.3 for float32
    over a copy and 123 for bf16 (9 alternated rounds), and 50.8 against 58.1 and 65 at 128 rows.
    Linears of the shapes of ``linears`` (:data:`WIDE_SAMPLE_BYTES`, :func:`_streamed_sample`) run each way in
    turns at :data:`WIDE_ROWS` rows, each round's passes compared with bf16's; the side with the lowest median
    ratio is taken where that is below :data:`WIDE_TAKE`, else bf16. (Compared by each side's fastest
    pass, as first built, that Xeon's loads had picked bf16 in 2 of 8 fresh processes: its passes slow down by
    up to 1.8x in bursts, and one lucky pass decided; round by round, 6 of 6 picked float32 at ratios of
    0.66-0.84.) A best median in :data:`WIDE_UNSURE` times :data:`WIDE_MORE_ROUNDS` more rounds, and the
    medians of all of them decide: a served worker measures while its frontend starts, and on that Xeon one
    bench run's continuous-batching worker read 0.95 (-> bf16) where the micro-batching one read 0.79 and fresh
    loads read 0.69-0.76; that server's prompts ran at 1.4-1.9 ms a token, micro-batching's at 0.93-1.15.
    ``native_favour`` (:data:`NATIVE_PROMPT_FAVOUR` where the GEMM brings the pair panels) takes the GEMM while
    its median ratio is within that share of the side taken otherwise (bf16's being 1) and ``favour_applies()``,
    which is asked only then."""
    native = kernels is not None and kernels.isa in BF16_GEMM_ISAS
    setting = prompt_products_setting()
    if setting in PROMPT_PRODUCTS:
        if setting == "native" and not native:
            raise ValueError(f"{WIDE_ENV}=native needs the native CPU kernels' avx512 or avx512bf16 build "
                             f"(here: {kernels.isa if kernels is not None else 'none'}); use auto, bfloat16 or float32")
        return setting
    key = (torch.get_num_threads(), native_favour)
    if key not in _WIDE_DECISIONS:
        sample = _streamed_sample(linears, WIDE_SAMPLE_BYTES)
        inputs = [torch.randn(WIDE_ROWS, linear.in_features).to(torch.bfloat16) for linear in sample]
        sides = {"bfloat16": [NativeLinear(linear, None, 0) for linear in sample],
                 "float32": [NativeLinear(linear, None, 0, wide_in_float32=True) for linear in sample]}
        if native:
            sides["native"] = [NativeLinear(linear, kernels, sys.maxsize) for linear in sample]
        runs = {side: (lambda layers=layers: [layer(x) for layer, x in zip(layers, inputs)])
                for side, layers in sides.items()}
        passes = cpu_kernels.alternate_passes(runs, repeats)
        if WIDE_UNSURE[0] <= min(_median_ratios(passes).values()) < WIDE_UNSURE[1]:
            more = cpu_kernels.alternate_passes(runs, WIDE_MORE_ROUNDS)
            passes = {side: passes[side] + more[side] for side in passes}
        ratios = _median_ratios(passes)
        fastest = min(ratios, key=ratios.get)
        taken = fastest if ratios[fastest] < WIDE_TAKE else "bfloat16"
        near = taken != "native" and ratios.get("native", math.inf) <= (1 + native_favour) * ratios.get(taken, 1.0)
        _WIDE_DECISIONS[key] = "native" if native_favour > 0 and near and favour_applies() else taken
        favoured = (f", native favoured by {native_favour:.0%} for its pair panels"
                    if _WIDE_DECISIONS[key] != taken else "")
        logger.info("bf16 prompt products, %d threads, %d rows: %s (medians of %d rounds%s) -> %s", key[0], WIDE_ROWS,
                    ", ".join(f"{PROMPT_PRODUCT_NAMES[side]} {1e3 * statistics.median(times):.1f} ms"
                              + (f" ({ratios[side]:.2f} of bf16's)" if side != "bfloat16" else "")
                              for side, times in passes.items()),
                    len(passes["bfloat16"]), favoured, _WIDE_DECISIONS[key])
    return _WIDE_DECISIONS[key]


#: Environment switch for :func:`weight_pairs`: "on" lays bf16 weights out in pair panels where the native
#: kernels take them, "off" keeps them plain; default ("auto"): whichever times faster at load.
PAIRS_ENV = "LLAMA_WEIGHT_PAIRS"
#: The rows :func:`weight_pairs` times (a decode step's at 8 streams), the bytes it streams, and the median
#: ratio (pairs over plain) below which it takes the pair panels.
PAIRS_ROWS, PAIRS_SAMPLE_BYTES, PAIRS_TAKE = 8, 64 << 20, 0.95
_PAIRS_DECISIONS: Dict[tuple, bool] = {}


def weight_pairs(linears: Sequence[nn.Linear], kernels, compute_dtype: torch.dtype,
                 weight_dtype: torch.dtype, repeats: int = 5) -> bool:
    """Whether bf16 weights run faster in the native kernels' pair panels (:meth:`.CpuKernels.pack_pairs`) than
    in their plain layout, on ``kernels`` for ``compute_dtype`` activations: measured once per process, thread
    count and dtypes (:data:`PAIRS_ENV` forces it), over linears of the shapes of ``linears``
    (:data:`PAIRS_SAMPLE_BYTES`, :func:`_streamed_sample`) at :data:`PAIRS_ROWS` rows, round by round.

    On an Emerald Rapids Xeon (2 vCPUs, 64 MiB of the bench model's bf16 weights, 11 alternated rounds,
    medians) the plain layout's tiles ran at ~140 GFLOP/s from 4 rows up and the pair panels at 200-240:
    1.53x at 8 rows, 1.52-1.61x at 12 to 39, even at 1 and 2; float32 rows over bf16 weights 1.39-1.46x at 8 to
    32. A build without them, or weights of another dtype, returns False."""
    setting = pairs_setting()
    if setting == "off":
        return False
    if weight_dtype != torch.bfloat16 or kernels is None or kernels.isa not in cpu_kernels.PAIRS_ISAS:
        if setting == "on":
            raise ValueError(f"{PAIRS_ENV}=on needs bfloat16 weights on the native CPU kernels' avx512 or "
                             f"avx512bf16 build (here: {weight_dtype} weights on "
                             f"{kernels.isa if kernels is not None else 'no native kernels'}); use auto or off")
        return False
    if setting == "on":
        return True
    key = (torch.get_num_threads(), compute_dtype, kernels.isa)
    if key not in _PAIRS_DECISIONS:
        converted = (linear.weight.to(weight_dtype).contiguous() for linear in _streamed_sample(linears, PAIRS_SAMPLE_BYTES))
        plain = [w for w in converted if kernels.takes_pairs(w)]
        if not plain:
            _PAIRS_DECISIONS[key] = False
            return False
        paired = [kernels.pack_pairs(w) for w in plain]
        inputs = [torch.randn(PAIRS_ROWS, w.shape[1]).to(compute_dtype) for w in plain]
        runs = {"plain": lambda: [kernels.linear(x, w) for x, w in zip(inputs, plain)],
                "pairs": lambda: [kernels.linear(x, w, pairs=True) for x, w in zip(inputs, paired)]}
        passes = cpu_kernels.alternate_passes(runs, repeats)
        ratio = statistics.median(p / q for p, q in zip(passes["pairs"], passes["plain"]))
        _PAIRS_DECISIONS[key] = ratio < PAIRS_TAKE
        logger.info("bf16 weights in pair panels, %d threads, %s rows, %d rows: plain %.2f ms, pairs %.2f ms "
                    "(%.2f of plain's, medians of %d rounds) -> %s", key[0], compute_dtype, PAIRS_ROWS,
                    1e3 * statistics.median(passes["plain"]), 1e3 * statistics.median(passes["pairs"]), ratio,
                    repeats, "pairs" if _PAIRS_DECISIONS[key] else "plain")
    return _PAIRS_DECISIONS[key]


def pairs_setting() -> str:
    """:data:`PAIRS_ENV`: ``auto`` (unset), ``on`` or ``off``; anything else is a ValueError naming it."""
    return env_word(PAIRS_ENV, "auto", ("auto", "on", "off"))


def prompt_products_setting() -> str:
    """:data:`WIDE_ENV`: ``auto`` (unset) or the side of :data:`PROMPT_PRODUCTS` it forces; anything else is a
    ValueError naming it (a misspelt side would otherwise run as ``auto``, and on AMX leave the tiles)."""
    return env_word(WIDE_ENV, "auto", ("auto",) + PROMPT_PRODUCTS)


#: How :func:`bf16_prompt_products` names each side in its log line.
PROMPT_PRODUCT_NAMES = {"bfloat16": "oneDNN bf16", "float32": "float32 over a copy", "native": "native GEMM"}


def _median_ratios(passes: Dict[str, list]) -> Dict[str, float]:
    """Each side's median over the rounds of its pass's time over bf16's in the same round (bf16 left out)."""
    return {side: statistics.median(t / b for t, b in zip(times, passes["bfloat16"]))
            for side, times in passes.items() if side != "bfloat16"}


def concat_linears(linears, out: Optional[torch.Tensor] = None) -> nn.Linear:
    """One ``nn.Linear`` computing the outputs of ``linears`` (same input) side by side; its weight is
    concatenated into ``out`` where that is a contiguous tensor of its shape and dtype.

    A decode step reads every weight once for a handful of rows; one larger product instead of
    three (q, k, v) or two (gate, up) saves per-call overhead: streaming the bench model's
    weights packed took 23.4 ms fused against 26.5 ms separate. The module is made on the meta
    device and given the concatenated tensors, so no random initialisation runs at load.
    """
    parts = [lin.weight.detach() for lin in linears]
    shape = (sum(part.shape[0] for part in parts), *parts[0].shape[1:])
    fits = out is not None and out.shape == shape and out.dtype == parts[0].dtype and out.is_contiguous()
    weight = torch.cat(parts, out=out) if fits else torch.cat(parts)
    has_bias = any(lin.bias is not None for lin in linears)
    fused = nn.Linear(linears[0].in_features, weight.shape[0], bias=has_bias, device="meta")
    fused.weight = nn.Parameter(weight, requires_grad=False)
    if has_bias:
        fused.bias = nn.Parameter(torch.cat([lin.bias.detach() if lin.bias is not None
                                             else weight.new_zeros(lin.out_features) for lin in linears]),
                                  requires_grad=False)
    return fused.eval()


class FusedLlamaProjections(nn.Module):
    """A Llama decoder layer's q/k/v and gate/up projections as two products, packed where that pays.

    Built from the layer's plain ``nn.Linear`` modules (:meth:`of` returns None when they
    are not, e.g. already packed). ``qkv(x)`` returns q, k, v; ``mlp(x, layer.mlp)`` the
    MLP's output through that module's own activation and ``down_proj``.
    """

    PROJECTIONS = (("self_attn", "q_proj"), ("self_attn", "k_proj"), ("self_attn", "v_proj"),
                   ("mlp", "gate_proj"), ("mlp", "up_proj"))

    def __init__(self, layer, weight_dtype: Optional[torch.dtype] = None,
                 places: Sequence[Optional[torch.Tensor]] = (None, None), compute_dtype: Optional[torch.dtype] = None):
        """``places``: where to keep the q/k/v and the gate/up weights; ``compute_dtype``: see :func:`pack_linears`."""
        super().__init__()
        attn, mlp = layer.self_attn, layer.mlp
        self.sizes = [attn.q_proj.out_features, attn.k_proj.out_features, attn.v_proj.out_features]
        self.intermediate = mlp.gate_proj.out_features
        self.qkv_proj = concat_linears([attn.q_proj, attn.k_proj, attn.v_proj], places[0])
        self.gate_up_proj = concat_linears([mlp.gate_proj, mlp.up_proj], places[1])
        pack_linears(self, weight_dtype=weight_dtype, places={self.qkv_proj: places[0], self.gate_up_proj: places[1]},
                     compute_dtype=compute_dtype)

    @classmethod
    def of(cls, layer, weight_dtype: Optional[torch.dtype] = None, places: Sequence[Optional[torch.Tensor]] = (None, None),
           compute_dtype: Optional[torch.dtype] = None) -> Optional["FusedLlamaProjections"]:
        plain = all(type(getattr(getattr(layer, owner, None), name, None)) is nn.Linear
                    for owner, name in cls.PROJECTIONS)
        if not plain or not hasattr(layer.mlp, "act_fn") or not hasattr(layer.mlp, "down_proj"):
            return None
        return cls(layer, weight_dtype, places, compute_dtype)

    def qkv(self, x: torch.Tensor):
        return self.qkv_proj(x).split(self.sizes, dim=-1)

    def mlp(self, x: torch.Tensor, mlp: nn.Module) -> torch.Tensor:
        gate, up = self.gate_up_proj(x).split([self.intermediate, self.intermediate], dim=-1)
        return mlp.down_proj(mlp.act_fn(gate) * up)

    @classmethod
    def drop_originals(cls, layer) -> None:
        """Free the layer's separate projections (the fused copies replace them)."""
        for owner, name in cls.PROJECTIONS:
            delattr(getattr(layer, owner), name)
