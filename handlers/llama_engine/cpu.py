"""What the CPU can do natively, and the dtype ``handler.dtype: auto`` picks from it.

bfloat16 halves the bytes a decode step reads, but only a CPU with native bf16 arithmetic
(AMX or AVX512_BF16) computes in it at speed: elsewhere every bf16 product is converted to
float32 and back. Measured with the bench model (116M, 2 threads): on an AMX Xeon bf16
prefill ran ~6x faster than float32; on an AVX2-only EPYC bf16 prefilled about 80 tokens/s
(a 3.1 s TTFT for 256 tokens) where float32 took 0.46 s, ~7x faster. So ``auto`` is bf16
only where it is native.
"""
from __future__ import annotations

from pathlib import Path
from typing import FrozenSet, Optional

#: /proc/cpuinfo flags that mean bf16 matrix products run natively.
NATIVE_BF16_FLAGS = ("amx_bf16", "avx512_bf16")
#: The flags the bench and the logs report (what decides speed on x86).
REPORTED_FLAGS = ("avx2", "fma", "f16c", "avx512f", "avx512_vnni", "avx512_bf16", "avx512_fp16",
                  "amx_tile", "amx_bf16", "amx_int8", "amx_fp16")


def cpu_flags(cpuinfo: Optional[str] = None) -> FrozenSet[str]:
    """The first CPU's feature flags from ``/proc/cpuinfo`` (empty where there is none, e.g. macOS)."""
    if cpuinfo is None:
        try:
            cpuinfo = Path("/proc/cpuinfo").read_text()
        except OSError:
            return frozenset()
    for line in cpuinfo.splitlines():
        key, _, value = line.partition(":")
        if key.strip() in ("flags", "Features"):
            return frozenset(value.split())
    return frozenset()


def has_native_bf16(flags: FrozenSet[str]) -> bool:
    return any(flag in flags for flag in NATIVE_BF16_FLAGS)


def cpu_class(flags: FrozenSet[str]) -> str:
    """A short name for the class of x86 CPU that decides which kernels run (``amx``, ``avx512-bf16``,
    ``avx512``, ``avx2`` or ``other``)."""
    if "amx_bf16" in flags:
        return "amx"
    if "avx512_bf16" in flags:
        return "avx512-bf16"
    if "avx512f" in flags:
        return "avx512"
    if "avx2" in flags:
        return "avx2"
    return "other"


def auto_dtype(device: str, flags: Optional[FrozenSet[str]] = None) -> str:
    """``handler.dtype: auto``: bfloat16 on a GPU that supports it and on a CPU with native bf16,
    float32 everywhere else."""
    if device == "cuda":
        import torch

        return "bfloat16" if torch.cuda.is_bf16_supported() else "float16"
    return "bfloat16" if has_native_bf16(cpu_flags() if flags is None else flags) else "float32"


def reported_flags(flags: FrozenSet[str]) -> list:
    return sorted(flag for flag in flags if flag in REPORTED_FLAGS)
