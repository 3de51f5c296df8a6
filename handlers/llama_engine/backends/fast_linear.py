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
native bf16 support. float32 weights go to MKL's packed sgemm instead
(``mkl._mkl_reorder_linear_weight`` / ``mkl._mkl_linear``, inductor's choice for fp32):
as fast as ``nn.Linear`` for one row and about 1.8x faster for 8 rows. ``_mkl_linear``
falls back to its ``orig_weight`` argument when the row count differs from the
``batch_size`` it is given; :class:`MklPackedLinear` always passes the actual row count,
so the original weight is never read and is not kept (a zero-stride stand-in is passed).
Each fp32 layer is checked against ``nn.Linear`` once when it is packed and stays plain if
they disagree. The fp32 packing is opt-in (``LLAMA_PACKED_LINEAR=1``): a pass over the bench
model's linears ran 1.8x faster at 8 rows on 1 thread, but whole decode steps at 2 threads
measured the same as ``nn.Linear`` (0.97-1.02x), and MKL's packed format of small matrices
takes up to ~5x their size. ``LLAMA_PACKED_LINEAR=0`` turns all packing off.

oneDNN weights are packed for 8 rows (:data:`ONEDNN_BATCH_HINT`): streaming the bench
model's 85 bf16 weights once at 2 threads took 26.5 ms packed for 8 rows against 34.9 ms
packed for 1, with 1 row as with 8 (medians of 6 passes), and prefill (256 and 768 rows)
measured the same either way.
"""
from __future__ import annotations

import logging
import os
from typing import Optional

import torch
from torch import nn

logger = logging.getLogger(__name__)

#: Environment switch: "0" disables packing, "1" also packs float32 (MKL), default bf16/fp16 only.
ENV = "LLAMA_PACKED_LINEAR"
#: Row count oneDNN lays the packed weights out for (any row count still computes correctly).
ONEDNN_BATCH_HINT = 8


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


class MklPackedLinear(nn.Module):
    """float32 ``y = x @ W.T + b`` through MKL's packed sgemm (inference only)."""

    def __init__(self, linear: nn.Linear, batch_hint: int = 1):
        super().__init__()
        self.in_features, self.out_features = linear.in_features, linear.out_features
        weight = linear.weight.detach()
        self.register_buffer("packed_weight", torch.ops.mkl._mkl_reorder_linear_weight(weight, batch_hint),
                             persistent=False)
        bias = None if linear.bias is None else linear.bias.detach().clone()
        self.register_buffer("bias", bias, persistent=False)
        # Never read: forward always passes the actual row count as batch_size.
        self._stand_in = weight.new_zeros(1).expand(self.out_features, self.in_features)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        rows = x.numel() // self.in_features
        flat = x.reshape(rows, self.in_features)
        out = torch.ops.mkl._mkl_linear(flat, self.packed_weight, self._stand_in, self.bias, rows)
        return out.view(*x.shape[:-1], self.out_features)

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, bias={self.bias is not None}, " \
               f"dtype=torch.float32, packed=mkl"


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
    """Whether oneDNN packed linears are expected to beat ``nn.Linear`` for ``dtype`` on ``device``."""
    if torch.device(device).type != "cpu" or not torch.backends.mkldnn.is_available():
        return False
    if not torch.backends.mkldnn.enabled:
        return False
    if dtype == torch.bfloat16:
        return bool(torch.ops.mkldnn._is_mkldnn_bf16_supported())
    if dtype == torch.float16:
        return bool(torch.ops.mkldnn._is_mkldnn_fp16_supported())
    if dtype == torch.float32:
        return bool(torch._C.has_mkl) and hasattr(torch.ops.mkl, "_mkl_linear")
    return False


def pack_linears(model: nn.Module, batch_hint: Optional[int] = None) -> int:
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
    if weight.dtype == torch.float32 and setting not in ("1", "true", "on", "yes"):
        return 0  # measured no faster end to end at 2 threads (see the module docstring): opt-in only
    fp32 = weight.dtype == torch.float32
    swapped = 0
    for parent, name, child in targets:
        if child.weight.dtype != weight.dtype or child.weight.device.type != "cpu":
            continue
        if fp32:
            packed = MklPackedLinear(child, batch_hint or 1)
        else:
            packed = PackedLinear(child, batch_hint or ONEDNN_BATCH_HINT)
        if fp32 and not _agrees(child, packed):
            logger.warning("MKL packed linear disagrees with nn.Linear; keeping nn.Linear")
            return swapped
        setattr(parent, name, packed)
        swapped += 1
    logger.info("packed %d linear layers (%s, %s)", swapped, weight.dtype, "mkl" if fp32 else "onednn")
    return swapped


def concat_linears(linears) -> nn.Linear:
    """One ``nn.Linear`` computing the outputs of ``linears`` (same input) side by side.

    A decode step reads every weight once for a handful of rows; one larger product instead of
    three (q, k, v) or two (gate, up) saves per-call overhead: streaming the bench model's
    weights packed took 23.4 ms fused against 26.5 ms separate. The module is made on the meta
    device and given the concatenated tensors, so no random initialisation runs at load.
    """
    weight = torch.cat([lin.weight.detach() for lin in linears])
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

    def __init__(self, layer):
        super().__init__()
        attn, mlp = layer.self_attn, layer.mlp
        self.sizes = [attn.q_proj.out_features, attn.k_proj.out_features, attn.v_proj.out_features]
        self.intermediate = mlp.gate_proj.out_features
        self.qkv_proj = concat_linears([attn.q_proj, attn.k_proj, attn.v_proj])
        self.gate_up_proj = concat_linears([mlp.gate_proj, mlp.up_proj])
        pack_linears(self)

    @classmethod
    def of(cls, layer) -> Optional["FusedLlamaProjections"]:
        plain = all(type(getattr(getattr(layer, owner, None), name, None)) is nn.Linear
                    for owner, name in cls.PROJECTIONS)
        if not plain or not hasattr(layer.mlp, "act_fn") or not hasattr(layer.mlp, "down_proj"):
            return None
        return cls(layer)

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
