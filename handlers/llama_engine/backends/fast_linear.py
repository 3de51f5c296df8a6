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
native bf16 support. float32 keeps ``nn.Linear`` (MKL's sgemv already streams at the
memory bandwidth for one row). ``LLAMA_PACKED_LINEAR=0`` turns it off.
"""
from __future__ import annotations

import logging
import os

import torch
from torch import nn

logger = logging.getLogger(__name__)

#: Environment switch: "0" disables packing, "1" forces it for any supported dtype.
ENV = "LLAMA_PACKED_LINEAR"


class PackedLinear(nn.Module):
    """``y = x @ W.T + b`` with ``W`` held in oneDNN's packed layout (inference only)."""

    def __init__(self, linear: nn.Linear, batch_hint: int = 1):
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


def packing_supported(dtype: torch.dtype, device: torch.device) -> bool:
    """Whether oneDNN packed linears are expected to beat ``nn.Linear`` for ``dtype`` on ``device``."""
    if torch.device(device).type != "cpu" or not torch.backends.mkldnn.is_available():
        return False
    if not torch.backends.mkldnn.enabled:
        return False
    if dtype == torch.bfloat16:
        return bool(torch.ops.mkldnn._is_mkldnn_bf16_supported())
    if dtype == torch.float16:
        return bool(torch.ops.mkldnn._is_mkldnn_fp16_supported())
    return False


def pack_linears(model: nn.Module, batch_hint: int = 1) -> int:
    """Swap every CPU ``nn.Linear`` of ``model`` for a :class:`PackedLinear` where that pays.

    Returns how many layers were swapped (0 when the dtype, device or switch rules it out).
    A weight shared by another module (tied embeddings) is packed as a copy; the other module
    keeps the original.
    """
    setting = os.environ.get(ENV, "auto").strip().lower()
    if setting in ("0", "false", "off", "no"):
        return 0
    targets = [(parent, name, child) for parent in model.modules() for name, child in parent.named_children()
               if type(child) is nn.Linear]
    if not targets:
        return 0
    weight = targets[0][2].weight
    if not packing_supported(weight.dtype, weight.device):
        return 0
    swapped = 0
    for parent, name, child in targets:
        if child.weight.dtype != weight.dtype or child.weight.device.type != "cpu":
            continue
        setattr(parent, name, PackedLinear(child, batch_hint))
        swapped += 1
    logger.info("packed %d linear layers for oneDNN (%s)", swapped, weight.dtype)
    return swapped
