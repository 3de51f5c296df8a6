"""int8 weights with a float32 scale per output row, in the layout the native kernels read (weight code 3).

A decode step of one row reads every weight once and is bound by memory: int8 weights are half the bytes of
bf16 ones. Each row of a weight ``[N, K]`` is quantized symmetrically on its own (scale = its largest
magnitude / 127, values rounded to nearest), as weight-only int8 schemes for Llama do; the products keep the
activations' dtype and accumulate in float32, then multiply each output by its row's scale. On the ``avx2``
build, whose products of several rows are bound by arithmetic, float32 rows are rounded to int16 first
(:func:`int16_rows`) and multiplied in integers, exactly (:meth:`.CpuKernels.int16_min_rows`).

One tensor carries both parts, so that a weight goes wherever a plain one goes (the native kernels take one
pointer per weight): :func:`quantize` returns the int8 values ``[N, K]`` as a view at the start of a byte
buffer whose N float32 scales follow them from the next multiple of :data:`SCALES_ALIGN` bytes. A copy of
the view (``clone``, ``copy_``) holds the values only: :func:`carries_scales` says whether a tensor still has
room for its scales behind it (a view of fewer rows still has room: only whole weights are handed around),
and every reader checks that. A place in a larger buffer (a block of weights in the order a decode step reads
them) takes :func:`nbytes` of it; :func:`copy_into` fills it.
"""
from __future__ import annotations

from typing import Optional, Sequence, Union

import torch

#: The scales start at the first multiple of this many bytes after the values (the kernels' row_scales).
SCALES_ALIGN = 64
#: The largest magnitude of a quantized value: symmetric, so -128 is never used.
LEVELS = 127
NOT_FINITE = "int8 weights: the weight holds inf or NaN, which no scale represents"
NO_SCALES = ("int8 weights: this tensor has no scales behind it (a copy of the values alone?); quantize the "
             "weight with int8_rows.quantize")


def scales_offset(rows: int, columns: int) -> int:
    """Bytes from the start of the values to the scales."""
    return -(-rows * columns // SCALES_ALIGN) * SCALES_ALIGN


def quantize(weight: torch.Tensor, out: Optional[torch.Tensor] = None, kernels=None) -> torch.Tensor:
    """``weight`` ``[N, K]`` (a floating dtype) as int8 values with a float32 scale per row, in one buffer:
    ``out`` where given (int8 ``[N, K]`` with room for the scales behind it, :func:`carries_scales`: a place
    from :func:`empty`), else a new one. Returns the values. ``kernels``: the loaded native kernels
    (:class:`.cpu_kernels.CpuKernels`), which quantize a contiguous float32 or bf16 weight in one read of it,
    to the same bits as the torch ops here (a 7B model's load: 25 s of them on a Zen 3)."""
    if weight.dim() != 2 or not weight.is_floating_point():
        raise ValueError(f"int8 weights: a 2-D floating weight is quantized, got {weight.dtype} {tuple(weight.shape)}")
    if out is None:
        out = empty(weight.shape, weight.device)
    else:
        _check_place(out, weight.shape)
    if kernels is not None and kernels.quantizes(weight):
        kernels.quantize_rows(weight, out)
        return out
    wide = weight.detach().to(torch.float32, copy=True)
    low, high = torch.aminmax(wide, dim=1)  # one pass, no |w| copy: a 7B model's load is ~6.7e9 of them
    largest = torch.maximum(high, -low)
    if not torch.isfinite(largest).all():  # an inf or a NaN anywhere in a row reaches its largest magnitude
        raise ValueError(NOT_FINITE)
    scale = largest / LEVELS
    divisor = torch.where(scale > 0, scale, 1.0)
    out.copy_(wide.div_(divisor[:, None]).round_().clamp_(-LEVELS, LEVELS))
    scales(out).copy_(scale)
    return out


def empty(shape: Sequence[int], device: Union[str, torch.device] = "cpu") -> torch.Tensor:
    """Uninitialised int8 values of ``shape`` ``[N, K]`` at the start of a buffer with room for their scales."""
    rows, columns = shape
    buffer = torch.empty(scales_offset(rows, columns) + 4 * rows, dtype=torch.uint8, device=device)
    return buffer[:rows * columns].view(torch.int8).view(rows, columns)


def nbytes(shape: Sequence[int]) -> int:
    """Bytes of the values of a weight of ``shape`` ``[N, K]`` and the scales behind them."""
    rows, columns = shape
    return scales_offset(rows, columns) + 4 * rows


def copy_into(place: torch.Tensor, quantized: torch.Tensor) -> torch.Tensor:
    """``quantized``'s values and scales copied to ``place`` (int8 of its shape with room for the scales behind
    it); returns ``place``."""
    _check_place(place, quantized.shape)
    place.copy_(quantized)
    scales(place).copy_(scales(quantized))
    return place


def _check_place(place: torch.Tensor, shape: Sequence[int]) -> None:
    if place.shape != shape or not carries_scales(place):
        raise ValueError(f"int8 weights: the place for a {tuple(shape)} weight is int8 of its shape with room for "
                         f"its scales behind it, got {place.dtype} {tuple(place.shape)}")


def carries_scales(quantized: torch.Tensor) -> bool:
    """Whether ``quantized`` is int8 values at the start of a buffer that holds their scales after them."""
    if quantized.dtype != torch.int8 or quantized.dim() != 2 or not quantized.is_contiguous():
        return False
    end = quantized.storage_offset() + nbytes(quantized.shape)
    return quantized.storage_offset() % 4 == 0 and quantized.untyped_storage().nbytes() >= end


def scales(quantized: torch.Tensor) -> torch.Tensor:
    """The float32 scale of each row of ``quantized`` (a view into its buffer)."""
    if not carries_scales(quantized):
        raise ValueError(NO_SCALES)
    rows, columns = quantized.shape
    offset = quantized.storage_offset() + scales_offset(rows, columns)
    buffer = torch.empty(0, dtype=torch.uint8, device=quantized.device).set_(quantized.untyped_storage())
    return buffer[offset:offset + 4 * rows].view(torch.float32)


def dequantize(quantized: torch.Tensor, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """The weight ``quantized`` stands for, ``[N, K]`` in ``dtype`` (values times their row's scale, in float32)."""
    return (quantized.to(torch.float32) * scales(quantized)[:, None]).to(dtype)


#: The largest magnitude of an activation rounded to int16 (:func:`int16_rows`).
INT16_LEVELS = 32767


def int16_rows(x: torch.Tensor) -> torch.Tensor:
    """The float32 rows ``x`` ``[M, K]`` as the ``avx2`` build's integer products take them, in float64: each
    rounded (to nearest even, in float32) to a multiple of its own step, its largest magnitude / 32767, so each
    value moves by at most half of its row's step (a row of zeros stays zeros)."""
    largest = x.abs().amax(dim=-1, keepdim=True)
    inverse = torch.where(largest > 0, torch.tensor(float(INT16_LEVELS)) / largest, torch.zeros_like(largest))
    return (x * inverse).round().double() * (largest / INT16_LEVELS).double()
