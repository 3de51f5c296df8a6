"""Native decode kernels for the torch backend on x86 CPUs: build, load, call.

A decode step streams every weight once for a handful of rows and every cached key and value
of every row once. torch's kernels for those shapes stop well short of the memory bandwidth
(bench model, bf16, 2 threads, Zen 5 EPYC, one pass over all its linear weights for one row:
oneDNN's packed GEMV 5.3-6.7 ms at 35-43 GB/s while ``x.sum()`` read 40-64 GB/s; on a Zen 4
EPYC and an AMX Xeon it streamed at 21 GB/s). SDPA over the slot cache took 8.5 ms of a 17.6
ms step at 8 rows of ~300 positions (float32 cache, ~21 GB/s). ``cpu_kernels.cpp`` holds two
streaming kernels that read their data in its plain layout, one sequential stream per thread with a
software prefetch ahead of it:

* ``linear``: ``y = x @ W.T`` for a few rows of ``x``, bf16 or float32, accumulated in float32
  (bf16 pairs through AVX512_BF16's dot product where the CPU has it), or float32 rows over bf16
  weights (widened as they are loaded); a prompt's many rows go to a packed-panel GEMM in float32
  arithmetic (the ``avx2`` build's from 48 rows, the AVX-512 builds' from 40, bf16 weights widened
  as their panels are packed);
* ``decode_attention``: one query per row and head over the row's cached positions, the heads
  of a GQA group sharing each key and value read, softmax in float32;
* ``prompt_attention``: a prompt chunk's queries (float32 or bf16) over their own keys and values
  and those before them in the cache, both products in float32 on the prompt GEMM's tile (faster
  than SDPA's causal flash kernel, 1.4-1.9x on a Zen 3 EPYC, and than a later chunk's torch
  products; on a Zen 4 EPYC as fast as bf16 products by blocks in a whole prefill, and without
  their bf16 rounding of the scores); on the ``avx512bf16`` build, bf16 queries over bf16 keys and
  values in bf16 products instead (``tiles=True``: the softmax's weights rounded to bf16 as SDPA's
  kernel rounds them): on AMX's tiles, 1.3-1.5x SDPA's speed a layer, and on a CPU without AMX with
  AVX512_BF16's dot products, 1.8x the float32 products' on a Zen 5 EPYC;

and the small ops of a step fused, rounding as the torch ops they replace: ``add_rmsnorm``,
``silu_mul`` and ``rope_store`` (the rotary embedding and the cache write).
A decode-only step runs all of them for every layer in one call (:class:`DecodeLayers`), so that
Python's ~110 calls a step (~4 ms of a 15 ms one-row step on a Zen 3 EPYC) drop out.

The source is compiled once per instruction set (``avx512bf16``: AVX-512 with BF16, which AMX
CPUs have as well; ``avx512``: AVX-512 without it, Skylake-SP to Ice Lake, where bf16 is widened
and rounded in software; ``avx2``: AVX2 + FMA) into a shared library with no dependency on torch's
headers (a C ABI called through ctypes, which releases the GIL). Its threads are its own, not
OpenMP's: the caller and ``torch.get_num_threads() - 1`` helpers claim chunks of a job, and the
caller waits only for chunks a helper has started. An OpenMP region ends at a barrier that
waits for every thread, so served, where TorchServe's frontend and the worker's main thread
take a core now and then, the model's other thread stood idle there: a bench-model decode pass
took 9.7-11.5 ms served against 6.9-7.6 in-process (Zen 5 EPYC, 2 threads).

Where the library comes from, in order: next to this module (the build step compiles every
instruction set into the model artifact, so a serving host needs no compiler), the cache
directory (``LLAMA_CPU_KERNELS_CACHE``, default ``~/.cache/llama-torchserve``), else it is
compiled there with ``$CXX`` or ``g++`` (11 s on a 2-vCPU Xeon; the build step compiles every instruction set
into the cache and ships copies, :func:`build_all`). Its file name carries a digest of the source
and flags, so a stale build is never loaded. Without a compiler or a supported CPU, the
backend keeps torch's kernels and says so in its log. ``LLAMA_CPU_KERNELS=0`` turns the
kernels off (an A/B baseline); ``=avx2``, ``=avx512`` or ``=avx512bf16`` picks an instruction set the CPU
supports instead of the best one.

How far ahead a one-row product prefetches its weights depends on the chip, not the instruction
set: 4 KB streamed fastest on a Zen 5 EPYC, 1 KB 15-25% faster than that on a Zen 3 EPYC (the
comment at ``PREFETCH_ONE_ROW`` in the source). :func:`tune_one_row_prefetch` measures it on the
model's own weights when the backend loads them; ``LLAMA_CPU_PREFETCH=<bytes>`` sets it instead.
"""
from __future__ import annotations

import ctypes
import hashlib
import logging
import os
import shutil
import subprocess
import tempfile
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Callable, Dict, FrozenSet, Hashable, Optional, Sequence, Tuple

import torch

from ..cpu import cpu_flags
from . import int8_rows
from .base import with_greedy_picks

logger = logging.getLogger(__name__)

SOURCE = Path(__file__).with_name("cpu_kernels.cpp")
ENV = "LLAMA_CPU_KERNELS"
CACHE_ENV = "LLAMA_CPU_KERNELS_CACHE"
#: Compiler flags per instruction set, and the /proc/cpuinfo flags each needs.
ISA_FLAGS = {
    "avx512bf16": ["-DLLK_AVX512BF16", "-mavx512f", "-mavx512bw", "-mavx512vl", "-mavx512dq", "-mavx512bf16",
                   "-mavx2", "-mfma", "-mf16c"],
    "avx512": ["-DLLK_AVX512", "-mavx512f", "-mavx512bw", "-mavx512vl", "-mavx512dq", "-mavx2", "-mfma", "-mf16c"],
    "avx2": ["-DLLK_AVX2", "-mavx2", "-mfma", "-mf16c"],
}
ISA_NEEDS = {
    "avx512bf16": frozenset({"avx512f", "avx512bw", "avx512vl", "avx512dq", "avx512_bf16", "avx2", "fma", "f16c"}),
    "avx512": frozenset({"avx512f", "avx512bw", "avx512vl", "avx512dq", "avx2", "fma", "f16c"}),
    "avx2": frozenset({"avx2", "fma", "f16c"}),
}
#: Best first.
ISAS = ("avx512bf16", "avx512", "avx2")
#: ``-ffp-contract=off``: a product and a sum written apart stay apart (rounded as torch rounds them), where
#: GCC's default would fuse them into one FMA.
COMMON_FLAGS = ["-O3", "-std=c++20", "-fPIC", "-shared", "-pthread", "-fvisibility=hidden", "-fno-math-errno",
                "-ffp-contract=off", "-Wall", "-Wno-uninitialized", "-Wno-maybe-uninitialized"]
DTYPE_CODES = {torch.float32: 0, torch.bfloat16: 1}
#: The weight code of a bf16 weight in pair panels (:meth:`CpuKernels.pack_pairs`), the builds that have
#: them, and the outputs a panel pair takes.
PAIRS_CODE = 2
#: The weight code of an int8 weight with a float32 scale per row (:mod:`.int8_rows`).
INT8_CODE = 3
PAIRS_ISAS = frozenset({"avx512", "avx512bf16"})
PAIRS_COLUMNS = 32
#: Head sizes the attention kernel is compiled for.
HEAD_DIMS = (32, 64, 128, 256)
#: ``LLAMA_CPU_PREFETCH``: ``auto`` (measure at load, the default) or a one-row prefetch distance in bytes.
PREFETCH_ENV = "LLAMA_CPU_PREFETCH"
#: The one-row prefetch distances (bytes) :func:`tune_one_row_prefetch` tries; the source's default first.
PREFETCH_CANDIDATES = (4096, 2048, 1024, 512)
#: Weights the measurement streams (the model's first linears): enough to leave a server CPU's caches.
PREFETCH_SAMPLE_BYTES = 256 * 2**20
#: Another distance replaces the default only when it is this much faster.
PREFETCH_MARGIN = 0.05


class KernelBuildError(RuntimeError):
    """The kernels could not be compiled; the message says what was missing or what the compiler said."""


def isa_for(flags: FrozenSet[str]) -> Optional[str]:
    """The best instruction set of :data:`ISAS` that a CPU with ``flags`` runs, or None."""
    return next((isa for isa in ISAS if ISA_NEEDS[isa] <= flags), None)


def library_name(isa: str) -> str:
    """The library's file name: the instruction set and a digest of the source and the flags."""
    digest = hashlib.sha256(SOURCE.read_bytes())
    digest.update(" ".join(COMMON_FLAGS + ISA_FLAGS[isa]).encode())
    return f"libllama_cpu_kernels-{isa}-{digest.hexdigest()[:16]}.so"


def shipped_dir() -> Path:
    """Where the build step puts the libraries inside the model artifact: next to this module."""
    return Path(__file__).parent


def cache_dir() -> Path:
    configured = os.environ.get(CACHE_ENV)
    if configured:
        return Path(configured)
    base = os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache"
    return Path(base) / "llama-torchserve"


def compiler() -> Optional[str]:
    return os.environ.get("CXX") or shutil.which("g++") or shutil.which("c++")


def build(isa: str, directory: Path) -> Path:
    """Compile the kernels for ``isa`` into ``directory`` (atomically: a concurrent build of the
    same library by another worker leaves one complete file); returns the library's path."""
    if isa not in ISA_FLAGS:
        raise KernelBuildError(f"unknown instruction set {isa!r}; one of {', '.join(ISAS)}")
    cxx = compiler()
    if not cxx:
        raise KernelBuildError("no C++ compiler: install g++ (or set CXX), or build the model artifact, "
                               "which ships the kernels, on a machine that has one")
    directory.mkdir(parents=True, exist_ok=True)
    target = directory / library_name(isa)
    fd, partial = tempfile.mkstemp(prefix=target.name + ".", suffix=".tmp", dir=directory)
    os.close(fd)
    command = [cxx, *COMMON_FLAGS, *ISA_FLAGS[isa], str(SOURCE), "-o", partial]
    try:
        done = subprocess.run(command, capture_output=True, text=True, timeout=300)
        if done.returncode != 0:
            raise KernelBuildError(f"{' '.join(command)} failed ({done.returncode}):\n{done.stderr[-4000:]}")
        os.replace(partial, target)
    except (OSError, subprocess.TimeoutExpired) as exc:
        raise KernelBuildError(f"{' '.join(command)}: {exc}") from exc
    finally:
        if os.path.exists(partial):
            os.unlink(partial)
    return target


def build_all(directory: Path) -> list:
    """Every instruction set's library in ``directory`` (what the build step ships).

    Each comes from the cache directory, compiled there first where it is missing (those side by side, one
    compiler per core): a library's name is a digest of the source and flags, so a same-named one is this
    build. Compiling all three took 34 s of a 35 s archive build of the tiny model (2-vCPU Xeon), once per
    model built, in every test server's fixture too. Where the cache cannot be written, they are compiled
    into ``directory``."""
    cache = cache_dir()
    try:
        missing = [isa for isa in ISAS if not (cache / library_name(isa)).is_file()]
        with ThreadPoolExecutor(max_workers=max(1, min(len(missing), os.cpu_count() or 1))) as pool:
            list(pool.map(lambda isa: build(isa, cache), missing))  # raises the first build's error
        directory.mkdir(parents=True, exist_ok=True)
        return [Path(shutil.copy2(cache / library_name(isa), directory / library_name(isa))) for isa in ISAS]
    except OSError as exc:
        logger.info("native CPU kernels: the cache %s is not usable (%s); compiling into %s", cache, exc, directory)
        return [build(isa, directory) for isa in ISAS]


_P, _I64, _I32, _F32 = ctypes.c_void_p, ctypes.c_long, ctypes.c_int, ctypes.c_float
#: The library's C functions: attribute -> (symbol, argument types, result type).
_FUNCTIONS = {
    "_linear": ("llk_linear", [_P, _I64, _I32, _P, _I32, _P, _I64, _I64, _I64, _I64, _I32, _I64], _I32),
    "_attention": ("llk_decode_attention",
                   [_P, _I64, _I32, _P, _P, _I32, _P, _P, _I64, _I64, _I64, _I64, _I64, _F32, _P, _I32], _I32),
    "_prompt_attention": ("llk_prompt_attention",
                          [_P, _I64, _I32, _P, _P, _I32, _P, _I64, _I64, _I64, _I64, _I64, _F32, _P, _I32, _I32],
                          _I32),
    "_add_rmsnorm": ("llk_add_rmsnorm", [_P, _P, _P, _P, _I64, _I64, _F32, _I32, _I32], _I32),
    "_silu_mul": ("llk_silu_mul", [_P, _P, _I64, _I64, _I32, _I32], _I32),
    "_gate_up_silu": ("llk_gate_up_silu", [_P, _I64, _P, _P, _I64, _I64, _I64, _I32], _I32),
    "_rope_store": ("llk_rope_store",
                    [_P, _I64, _I64, _I64, _I64, _I64, _P, _P, _P, _P, _P, _P, _I64, _I32, _I32, _I32], _I32),
    "_decode_layers": ("llk_decode_layers", [_P] * 11 + [_F32, _F32, _I32, _I32, _I32, _I32, _I64, _I64, _P, _I32,
                                                      _P, _P, _I64, _P, _P, _P, _P], _I32),
    "_pack_pairs": ("llk_pack_pairs", [_P, _P, _I64, _I64], _I32),
    "_quantize_rows": ("llk_quantize_rows", [_P, _I32, _P, _I64, _I64, _I32], _I32),
    "_dequantize_rows": ("llk_dequantize_rows", [_P, _P, _I32, _I64, _I64, _I32], _I32),
    "_amx_min_rows": ("llk_amx_min_rows", [_I64], _I64),
    "_tiles_only": ("llk_tiles_only", [_I32, _I32], _I32),
    "_int16_min_rows": ("llk_int16_min_rows", [_I32, _I32], _I64),
    "_amx_usable": ("llk_amx_usable", [], _I32),
    "_bf16_prompt_products": ("llk_bf16_prompt_products", [], _I32),
    "_pool_check": ("llk_pool_check", [_I64, _I64, _I32], _I64),
    "_isa": ("llk_isa", [], ctypes.c_char_p),
}


def weight_code(weight: torch.Tensor) -> int:
    """The kernels' code for a weight in its plain layout: its dtype's, or :data:`INT8_CODE` for int8 values
    with their scales behind them (a ValueError for int8 values without); -1 for a dtype they do not read."""
    if weight.dtype == torch.int8:
        if not int8_rows.carries_scales(weight):
            raise ValueError(int8_rows.NO_SCALES)
        return INT8_CODE
    return DTYPE_CODES.get(weight.dtype, -1)


class CpuKernels:
    """The loaded library for one instruction set, called with torch tensors."""

    def __init__(self, path: Path, isa: str):
        self.path, self.isa = path, isa
        self.lib = ctypes.CDLL(str(path))
        for attribute, (symbol, argtypes, restype) in _FUNCTIONS.items():
            function = getattr(self.lib, symbol)
            function.argtypes, function.restype = argtypes, restype
            setattr(self, attribute, function)
        built_for = self._isa().decode()
        if built_for != isa:
            raise KernelBuildError(f"{path} was built for {built_for}, not {isa}")
        #: One-row prefetch distance (bytes) by (activation dtype, weight dtype); absent: the source's default.
        self.one_row_prefetch: Dict[tuple, int] = {}

    def linear(self, x: torch.Tensor, weight: torch.Tensor, out: Optional[torch.Tensor] = None,
               pairs: bool = False) -> torch.Tensor:
        """``x @ weight.T`` for ``x`` ``[M, K]`` (rows may be strided, elements contiguous) and a contiguous
        ``weight`` ``[N, K]``: both float32, both bfloat16, float32 ``x`` over a bfloat16 ``weight``
        (widened as it is read), or either ``x`` over an int8 weight from :func:`.int8_rows.quantize`;
        returns ``[M, N]`` in ``x``'s dtype. ``pairs``: ``weight`` is a bf16 weight's pair panels
        (:meth:`pack_pairs`)."""
        rows, k = x.shape
        n = weight.shape[0]
        if out is None:
            out = torch.empty((rows, n), dtype=x.dtype)
        w_code = PAIRS_CODE if pairs and weight.dtype == torch.bfloat16 else weight_code(weight)
        code = self._linear(x.data_ptr(), x.stride(0), DTYPE_CODES.get(x.dtype, -1), weight.data_ptr(), w_code,
                            out.data_ptr(), out.stride(0), rows, k, n, torch.get_num_threads(),
                            self.one_row_prefetch.get((x.dtype, weight.dtype), 0))
        if code:
            layout = " in pair panels" if pairs else ""
            raise ValueError(f"native linear: unsupported dtypes ({x.dtype} activations, {weight.dtype} "
                             f"weight{layout}) or shape on {self.isa}")
        return out

    def pack_pairs(self, weight: torch.Tensor, out: Optional[torch.Tensor] = None) -> torch.Tensor:
        """A bf16 ``weight`` ``[N, K]`` laid out in pair panels (``pack_pairs`` in the source): a tensor of the
        same shape and dtype whose memory holds 16 outputs at a time, K-major, each k beside k + 1. Only where
        :meth:`takes_pairs` (the AVX-512 builds). ``out``: where to lay them out (returned), a contiguous tensor
        of the weight's shape and dtype, apart from ``weight`` or ``weight`` itself (then rewritten in place)."""
        if not self.takes_pairs(weight):
            raise ValueError(f"pair panels: need a bfloat16 [N, K] weight with K even and N a multiple of "
                             f"{PAIRS_COLUMNS} on an AVX-512 build (got {weight.dtype} {tuple(weight.shape)} on "
                             f"{self.isa})")
        weight = weight.contiguous()
        packed = torch.empty_like(weight) if out is None else out
        if packed.shape != weight.shape or packed.dtype != weight.dtype or not packed.is_contiguous():
            raise ValueError(f"pair panels: out must be a contiguous {weight.dtype} {tuple(weight.shape)} tensor "
                             f"(got {packed.dtype} {tuple(packed.shape)})")
        if packed.data_ptr() != weight.data_ptr() and _overlap(packed, weight):
            raise ValueError("pair panels: out overlaps the weight without being it")
        if self._pack_pairs(weight.data_ptr(), packed.data_ptr(), weight.shape[1], weight.shape[0]):
            raise ValueError(f"pair panels: the {self.isa} build refused a {tuple(weight.shape)} weight")
        return packed

    @staticmethod
    def quantizes(weight: torch.Tensor) -> bool:
        """Whether :meth:`quantize_rows` takes ``weight``: a contiguous float32 or bf16 ``[N, K]`` in memory."""
        return (weight.dim() == 2 and weight.dtype in DTYPE_CODES and weight.is_contiguous()
                and weight.device.type == "cpu")

    def quantize_rows(self, weight: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
        """:func:`.int8_rows.quantize` of ``weight`` (:meth:`quantizes`) into ``out`` (a place from
        :func:`.int8_rows.empty` of its shape), the same bits in one read of the weight; returns ``out``."""
        if not self.quantizes(weight) or out.shape != weight.shape or not int8_rows.carries_scales(out):
            raise ValueError(f"native int8 quantization: a contiguous float32 or bf16 [N, K] weight into an int8 "
                             f"place of its shape with its scales behind it, got {weight.dtype} "
                             f"{tuple(weight.shape)} into {out.dtype} {tuple(out.shape)}")
        rows, columns = weight.shape
        if self._quantize_rows(weight.data_ptr(), DTYPE_CODES[weight.dtype], out.data_ptr(), rows, columns,
                               torch.get_num_threads()):
            raise ValueError(int8_rows.NOT_FINITE)
        return out

    def dequantize_rows(self, quantized: torch.Tensor, dtype: torch.dtype,
                        out: Optional[torch.Tensor] = None) -> torch.Tensor:
        """:func:`.int8_rows.dequantize` of ``quantized`` (int8 values with their scales behind them) into ``dtype``
        (float32 or bf16), each value rounded once: into ``out`` where given (contiguous, of its shape and dtype)."""
        if dtype not in DTYPE_CODES or not int8_rows.carries_scales(quantized):
            raise ValueError(f"native int8 dequantization: int8 values with their scales behind them into float32 "
                             f"or bf16, got {quantized.dtype} {tuple(quantized.shape)} into {dtype}")
        out = torch.empty(quantized.shape, dtype=dtype) if out is None else out
        if out.shape != quantized.shape or out.dtype != dtype or not out.is_contiguous():
            raise ValueError(f"native int8 dequantization: out must be a contiguous {dtype} "
                             f"{tuple(quantized.shape)} tensor (got {out.dtype} {tuple(out.shape)})")
        rows, columns = quantized.shape
        self._dequantize_rows(quantized.data_ptr(), out.data_ptr(), DTYPE_CODES[dtype], rows, columns,
                              torch.get_num_threads())
        return out

    def tiles_only(self, x_dtype: torch.dtype, weight_dtype: torch.dtype) -> bool:
        """Whether this build multiplies ``x_dtype`` rows over a plain ``weight_dtype`` weight on its few-row tiles
        whatever the rows, never on its GEMM: int8 weights under bf16 on the ``avx512bf16`` build."""
        codes = {**DTYPE_CODES, torch.int8: INT8_CODE}
        answer = self._tiles_only(codes.get(x_dtype, -1), codes.get(weight_dtype, -1))
        if answer < 0:
            raise ValueError(f"native linear: no product of {x_dtype} rows over {weight_dtype} weights")
        return bool(answer)

    def int16_min_rows(self, x_dtype: torch.dtype, weight_dtype: torch.dtype) -> int:
        """The fewest ``x_dtype`` rows over ``weight_dtype`` weights this build multiplies in integers, each row
        rounded to int16 at its own step (its largest magnitude / 32767, so each value moves by at most half a
        step): float32 rows over int8 weights on the ``avx2`` build. 0 where it never does."""
        codes = {**DTYPE_CODES, torch.int8: INT8_CODE}
        return int(self._int16_min_rows(codes.get(x_dtype, -1), codes.get(weight_dtype, -1)))

    def amx_min_rows(self, set_to: Optional[int] = None) -> int:
        """The fewest rows of a bf16 product over pair panels that run on AMX's tiles (0: this build or CPU has
        none); ``set_to`` sets it first (0 keeps every row count on the vector tiles)."""
        return int(self._amx_min_rows(-1 if set_to is None else set_to))

    def takes_pairs(self, weight: torch.Tensor) -> bool:
        """Whether this build multiplies ``weight`` in pair panels: bf16 ``[N, K]``, K even, N a multiple of
        :data:`PAIRS_COLUMNS`, on an AVX-512 build."""
        if self.isa not in PAIRS_ISAS or weight.dtype != torch.bfloat16 or weight.dim() != 2:
            return False
        out, inp = weight.shape
        return inp % 2 == 0 and out % PAIRS_COLUMNS == 0 and out > 0 and inp > 0

    def decode_attention(self, q: torch.Tensor, k_layer: torch.Tensor, v_layer: torch.Tensor, slots: torch.Tensor,
                         lengths: torch.Tensor, scale: float) -> torch.Tensor:
        """Attention of one query per row: ``q`` ``[rows, heads, head_dim]`` (each row's heads contiguous),
        one layer's cache ``[slots, kv_heads, max_length, head_dim]``, row ``b`` over positions
        ``[0, lengths[b])`` of slot ``slots[b]`` (int64 tensors). Returns ``[rows, heads, head_dim]``."""
        rows, heads, dim = q.shape
        _, kv_heads, max_length, _ = k_layer.shape
        out = torch.empty((rows, heads, dim), dtype=q.dtype)
        code = self._attention(q.data_ptr(), q.stride(0), DTYPE_CODES[q.dtype], k_layer.data_ptr(), v_layer.data_ptr(),
                               DTYPE_CODES[k_layer.dtype], slots.data_ptr(), lengths.data_ptr(), rows, heads, kv_heads,
                               max_length, dim, scale, out.data_ptr(), torch.get_num_threads())
        if code:
            raise ValueError(f"native decode attention: unsupported shape or dtype (q {q.dtype}, cache "
                             f"{k_layer.dtype}, {heads} heads over {kv_heads}, head_dim {dim})")
        return out

    def prompt_attention(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float,
                         start: int = 0, tiles: bool = False, dot_products: bool = False) -> torch.Tensor:
        """A prompt chunk's causal attention: queries ``q`` ``[tokens, heads, head_dim]``, float32 or bfloat16
        (each token's heads side by side, rows may be strided), at positions ``start .. start + tokens - 1``,
        each over the keys and values at or before its own. ``k`` and ``v``: ``[start + tokens,
        kv_heads, head_dim]`` of one dtype, float32 or bfloat16, ``head_dim`` contiguous (a first
        chunk's own rows of the fused q/k/v product, or a slot of the cache viewed as
        ``k_layer[slot].transpose(0, 1)``). The arithmetic is float32 whatever the dtypes; with ``tiles``
        (only where :meth:`supports_tile_attention`), both products are bf16 products with float32 sums, on
        AMX's tiles where the CPU has them, else (or with ``dot_products``) with AVX512_BF16's dot products,
        and the softmax's weights are rounded to bf16 between them, as SDPA's bf16 flash kernel rounds them.
        Returns ``[tokens, heads, head_dim]`` in ``q``'s dtype. Only where :meth:`supports_prompt_attention`."""
        tokens, heads, dim = q.shape
        if q.dtype not in DTYPE_CODES or q.stride(2) != 1 or q.stride(1) != dim:
            raise ValueError(f"native prompt attention: q must be float32 or bfloat16 [tokens, heads, {dim}] with "
                             f"each token's heads contiguous (got {q.dtype}, strides {q.stride()})")
        for name, t in (("k", k), ("v", v)):
            if (t.dtype != k.dtype or t.dtype not in DTYPE_CODES or t.stride(2) != 1
                    or t.shape != (start + tokens, k.shape[1], dim)):
                raise ValueError(f"native prompt attention: {name} must be float32 or bfloat16 [{start + tokens}, "
                                 f"kv_heads, {dim}] in k's dtype, {dim} contiguous (got {t.dtype}, shape "
                                 f"{tuple(t.shape)}, strides {t.stride()})")
        out = torch.empty((tokens, heads, dim), dtype=q.dtype)
        strides = (ctypes.c_long * 4)(k.stride(0), k.stride(1), v.stride(0), v.stride(1))
        code = self._prompt_attention(q.data_ptr(), q.stride(0), DTYPE_CODES[q.dtype], k.data_ptr(), v.data_ptr(),
                                      DTYPE_CODES[k.dtype], strides, tokens, start, heads, k.shape[1], dim, scale,
                                      out.data_ptr(), torch.get_num_threads(), (2 if dot_products else 1) * tiles)
        if code == -3:
            raise ValueError(f"native prompt attention in bf16 products: needs the avx512bf16 build (here: "
                             f"{self.isa}), bfloat16 q, k and v, a head_dim that is a multiple of 32 (got "
                             f"{q.dtype} over {k.dtype}, head_dim {dim})")
        if code:
            raise ValueError(f"native prompt attention: unsupported on {self.isa} ({heads} heads over "
                             f"{k.shape[1]}, head_dim {dim})")
        return out

    def add_rmsnorm(self, hidden: torch.Tensor, delta: Optional[torch.Tensor], weight: torch.Tensor,
                    eps: float) -> torch.Tensor:
        """``hidden += delta`` in place (when given), then HF's LlamaRMSNorm of ``hidden`` with ``weight``:
        contiguous ``[rows, hidden_size]`` tensors of one dtype; returns the normed rows."""
        out = torch.empty_like(hidden)
        code = self._add_rmsnorm(hidden.data_ptr(), 0 if delta is None else delta.data_ptr(), weight.data_ptr(),
                                 out.data_ptr(), hidden.shape[0], hidden.shape[1], eps, DTYPE_CODES[hidden.dtype],
                                 torch.get_num_threads())
        if code:
            raise ValueError(f"native add_rmsnorm: unsupported dtype {hidden.dtype}")
        return out

    def silu_mul(self, gate_up: torch.Tensor) -> torch.Tensor:
        """``silu(gate) * up`` for a contiguous ``[rows, 2 * I]`` of ``[gate | up]`` rows; returns ``[rows, I]``."""
        rows, width = gate_up.shape
        out = torch.empty((rows, width // 2), dtype=gate_up.dtype)
        code = self._silu_mul(gate_up.data_ptr(), out.data_ptr(), rows, width // 2, DTYPE_CODES[gate_up.dtype],
                              torch.get_num_threads())
        if code:
            raise ValueError(f"native silu_mul: unsupported dtype {gate_up.dtype}")
        return out

    def gate_up_silu(self, x: torch.Tensor, gate_up: torch.Tensor) -> Tuple[torch.Tensor, bool]:
        """``silu(gate) * up`` of bf16 ``x`` ``[rows, K]`` (rows may be strided) times a gate/up weight ``[gate |
        up]`` ``[2 I, K]`` in pair panels (:meth:`pack_pairs`), as the one-call decoder layers compute it; returns
        ``[rows, I]`` and whether AMX's tiles ran it in one pass (a prompt's rows, more than 16), rather than
        :meth:`linear` then :meth:`silu_mul`, whose numbers it gives."""
        rows, k = x.shape
        inner = gate_up.shape[0] // 2
        if x.dtype != torch.bfloat16 or x.stride(1) != 1 or not self.takes_pairs(gate_up) or gate_up.shape[1] != k:
            raise ValueError(f"native gate_up_silu: needs bfloat16 x [rows, K] and a bf16 [2 I, K] weight in pair "
                             f"panels with 2 I a multiple of {PAIRS_COLUMNS} on an AVX-512 build (got {x.dtype} "
                             f"{tuple(x.shape)}, {gate_up.dtype} {tuple(gate_up.shape)} on {self.isa})")
        out = torch.empty((rows, inner), dtype=torch.bfloat16)
        code = self._gate_up_silu(x.data_ptr(), x.stride(0), gate_up.data_ptr(), out.data_ptr(), rows, k, inner,
                                  torch.get_num_threads())
        if code < 0:
            raise ValueError(f"native gate_up_silu: the {self.isa} build refused {rows} rows over {tuple(gate_up.shape)}")
        return out, code == 1

    def rope_store(self, qkv: torch.Tensor, heads: int, kv_heads: int, cos: torch.Tensor, signed_sin: torch.Tensor,
                   positions: torch.Tensor, slots: torch.Tensor, k_layer: torch.Tensor, v_layer: torch.Tensor) -> None:
        """Rotate the q and k heads of each row of ``qkv`` (``[tokens, (heads + 2 kv_heads) * head_dim]``, rows
        may be strided) in place by the rotary tables' row at its position (``[positions, head_dim]``, first
        half of ``signed_sin`` negated), and write its k and v into one layer's cache ``[slots, kv_heads,
        max_length, head_dim]`` at ``(slots[t], positions[t])`` (int64 tensors)."""
        dim = cos.shape[1]
        code = self._rope_store(qkv.data_ptr(), qkv.stride(0), qkv.shape[0], heads, kv_heads, dim, cos.data_ptr(),
                                signed_sin.data_ptr(), positions.data_ptr(), slots.data_ptr(), k_layer.data_ptr(),
                                v_layer.data_ptr(), k_layer.shape[2], DTYPE_CODES[qkv.dtype],
                                DTYPE_CODES[k_layer.dtype], torch.get_num_threads())
        if code:
            raise ValueError(f"native rope_store: unsupported (weights {qkv.dtype}, cache {k_layer.dtype}, "
                             f"head_dim {dim})")

    def pool_check(self, jobs: int, max_chunks: int, threads: int) -> int:
        """The library's thread pool run ``jobs`` times back to back: how many jobs ran a chunk other than
        exactly once (0 when it is right; tests/unit/test_cpu_kernels.py)."""
        return self._pool_check(jobs, max_chunks, threads)

    def supports_fused_ops(self, dtype: torch.dtype, kv_dtype: torch.dtype, head_dim: int) -> bool:
        """Whether :meth:`add_rmsnorm`, :meth:`silu_mul` and :meth:`rope_store` serve these dtypes and head size."""
        return (dtype in DTYPE_CODES and kv_dtype in DTYPE_CODES
                and head_dim % 32 == 0 and head_dim <= 512)

    def supports_prompt_attention(self, dtype: torch.dtype, kv_dtype: torch.dtype, heads: int, kv_heads: int,
                                  head_dim: int) -> bool:
        """Whether :meth:`prompt_attention` runs here: float32 or bf16 queries over float32 or bf16 keys and
        values, a head size that is a multiple of 16, every build (AVX2's tile; the AVX-512 builds' where the
        head size is a multiple of 32)."""
        return (dtype in DTYPE_CODES and kv_dtype in DTYPE_CODES and head_dim % 16 == 0 and kv_heads >= 1
                and heads % kv_heads == 0)

    def supports_tile_attention(self, dtype: torch.dtype, kv_dtype: torch.dtype, head_dim: int) -> bool:
        """Whether :meth:`prompt_attention` runs in bf16 products (``tiles=True``) here: the ``avx512bf16`` build
        from a compiler with AMX's intrinsics (on AMX's tiles where the CPU has them, else AVX512_BF16's dot
        products), bfloat16 queries, keys and values, a head size that is a multiple of 32 (one tile row of a
        query)."""
        return (dtype == kv_dtype == torch.bfloat16 and head_dim % 32 == 0 and head_dim > 0
                and self._bf16_prompt_products() == 1)

    @property
    def amx(self) -> bool:
        """Whether this build and CPU run AMX's tiles."""
        return self._amx_usable() == 1

    def supports_attention(self, q_dtype: torch.dtype, kv_dtype: torch.dtype, heads: int, kv_heads: int,
                           head_dim: int) -> bool:
        return (q_dtype in DTYPE_CODES and kv_dtype in DTYPE_CODES and head_dim in HEAD_DIMS
                and kv_heads >= 1 and heads % kv_heads == 0 and heads // kv_heads <= 64)


#: (activations, weights, cache) dtypes :class:`DecodeLayers` runs: those its kernels serve together.
DECODE_LAYERS_DTYPES = frozenset({(torch.float32, torch.float32, torch.float32),
                                  (torch.float32, torch.bfloat16, torch.float32),
                                  (torch.float32, torch.float32, torch.bfloat16),
                                  (torch.float32, torch.bfloat16, torch.bfloat16),
                                  (torch.bfloat16, torch.bfloat16, torch.bfloat16),
                                  (torch.bfloat16, torch.bfloat16, torch.float32),
                                  *((x, torch.int8, kv) for x in (torch.float32, torch.bfloat16)
                                    for kv in (torch.float32, torch.bfloat16))})
#: A layer's tensors :class:`DecodeLayers` reads, in the order the native call takes them.
LAYER_TENSORS = ("input_norm", "qkv", "o", "post_norm", "gate_up", "down")


class DecodeLayers:
    """A decode step's decoder layers in one native call (``llk_decode_layers``): each row one token at its
    own position in its own slot, every layer the ops the torch backend's fused forward calls from Python
    one by one, with the same kernels in the same order (so the same numbers), and no Python between them.

    ``layers``: per layer, a dict of :data:`LAYER_TENSORS` (contiguous; norms in the activations' dtype,
    products' weights ``[out, in]`` in one dtype). The pointers are taken once here, so the tensors must
    stay where they are: this object keeps them alive. ``pairs``: every product's weight is in pair panels
    (:meth:`CpuKernels.pack_pairs`).

    ``head``: the final norm's weight and the LM head's ``[vocab, hidden]`` (in the layers' dtype and layout),
    for the call to end with the logits, as the backend's next two calls did. Those were the first Python after
    ~230 MB of weights had streamed through the caches: 0.64-0.68 ms from the call's return to the logits of an
    8-row step (~21 ms) of the bench model on an AMX Xeon, against ~0.13 ms for both on warm caches.

    ``embedding``: the token embeddings ``[vocab, hidden]`` (contiguous, in the activations' dtype), for
    :meth:`decode_step` to start from token ids; it needs the ``head`` too.
    """

    def __init__(self, kernels: CpuKernels, layers: Sequence[Dict[str, torch.Tensor]], heads: int, kv_heads: int,
                 head_dim: int, eps: float, pairs: bool = False,
                 head: Optional[Tuple[torch.Tensor, torch.Tensor]] = None, embedding: Optional[torch.Tensor] = None):
        first = layers[0]
        self.kernels, self.weight_dtype, self.pairs = kernels, first["qkv"].dtype, pairs
        self.intermediate = first["gate_up"].shape[0] // 2
        self.heads, self.kv_heads, self.head_dim, self.eps = heads, kv_heads, head_dim, eps
        self.scale = head_dim ** -0.5
        tensors = [layer[name] for layer in layers for name in LAYER_TENSORS]
        if any(not t.is_contiguous() or t.device.type != "cpu" for t in tensors):
            raise ValueError("native decode layers: every weight must be a contiguous CPU tensor")
        if head is not None and any(not t.is_contiguous() or t.device.type != "cpu" for t in head):
            raise ValueError("native decode layers: the head's weights must be contiguous CPU tensors")
        self.head = head
        if embedding is not None and (not embedding.is_contiguous() or embedding.device.type != "cpu"):
            raise ValueError("native decode layers: the embedding must be a contiguous CPU tensor")
        self.embedding = embedding
        products = [layer[name] for layer in layers for name in ("qkv", "o", "gate_up", "down")] + list(head or ())[1:]
        codes = [weight_code(w) for w in products]  # int8 values without their scales behind them: refused
        self.weight_code = codes[0]
        self._tensors = tensors  # what the pointers below point into
        self._weights = (ctypes.c_void_p * len(tensors))(*[t.data_ptr() for t in tensors])
        self._layers = len(layers)
        self.hidden_width = first["input_norm"].shape[0]
        self._caches, self._cache_key = None, None
        self._step_buffers: Dict[tuple, tuple] = {}  # decode_step's, per (rows, dtype)

    def _cache_pointers(self, k_cache: torch.Tensor, v_cache: torch.Tensor):
        """Each layer's k and v of the ``[layers, slots, kv_heads, max_length, head_dim]`` caches (kept until
        the cache is reallocated)."""
        key = (k_cache.data_ptr(), v_cache.data_ptr(), k_cache.shape)
        if key != self._cache_key:
            pointers = [t[layer].data_ptr() for layer in range(self._layers) for t in (k_cache, v_cache)]
            self._caches, self._cache_key = (ctypes.c_void_p * len(pointers))(*pointers), key
        return self._caches

    def __call__(self, hidden: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, cos: torch.Tensor,
                 signed_sin: torch.Tensor, positions: torch.Tensor, slots: torch.Tensor,
                 lengths: torch.Tensor, chunks: Sequence[Tuple[int, int, int, int]] = (),
                 tiles: bool = False) -> torch.Tensor:
        """Run every layer over ``hidden`` ``[rows, hidden]`` (the tokens' embeddings; updated in place with
        each layer's residual but the last's, which is returned for the final norm to add; with a ``head``,
        the rows with logits' logits ``[rows with logits, vocab]``, computed in ``hidden``'s dtype and returned
        in float32, each row's greedy pick attached: :func:`~llama_engine.backends.base.with_greedy_picks`).
        Row ``r``'s token sits at ``positions[r]`` of slot ``slots[r]`` and attends to its first ``lengths[r]``
        positions (int64 tensors).

        ``chunks``: prompt chunks after the decode rows, each ``(first row, rows, slot, first position)``,
        attending as :meth:`CpuKernels.prompt_attention` (``tiles`` as there) would, in each layer but the
        last. That one runs only the rows with logits, each as a decode row (the fused forward's way): the
        decode rows, then each chunk's last row, whose hidden states and residuals come back in the first
        ``decode rows + len(chunks)`` rows. Python's ~110 calls a pass go as a decode step's did: each
        refilled the caches the kernels had just flushed (~100 us a call on an AMX Xeon, ~10 ms of a
        256-token prefill)."""
        self._check_dtypes(hidden.dtype, k_cache.dtype)
        rows = hidden.shape[0]
        delta = torch.empty_like(hidden)
        scratch = torch.empty(self._scratch_elements(rows), dtype=hidden.dtype)
        head_rows = (chunks[0][0] if chunks else rows) + len(chunks)
        staged = None
        if self.head is not None and hidden.dtype != torch.float32:
            staged = torch.empty((head_rows, self.head[1].shape[0]), dtype=hidden.dtype)
        chunk_info = (ctypes.c_long * (4 * len(chunks) or 1))(*[n for chunk in chunks for n in chunk])
        return self._run(hidden, delta, scratch, staged, head_rows, k_cache, v_cache, cos, signed_sin,
                         positions.data_ptr(), slots.data_ptr(), lengths.data_ptr(), len(chunks), chunk_info, tiles)

    def decode_step(self, ids: Sequence[int], positions: Sequence[int], slots: Sequence[int], k_cache: torch.Tensor,
                    v_cache: torch.Tensor, cos: torch.Tensor, signed_sin: torch.Tensor) -> torch.Tensor:
        """A decode step's rows (one token each, no prompt chunk) from their token ids: the logits, greedy picks
        attached, that this object's call over ``embedding[ids]`` with ``lengths = positions + 1`` returns. Needs
        the ``head`` and the ``embedding``.

        Without a torch call but the one that allocates the logits: the rows' embeddings are copied into a
        buffer kept per row count (as are the call's scratch buffers) and the integers go as ctypes arrays. The
        seven torch calls this replaces were the first Python after the weights had streamed through the
        caches: ~0.35 ms of a 9 ms one-row step of the bench model on two Zen 4 cores."""
        embedding = self.embedding
        if self.head is None or embedding is None:
            raise ValueError("native decode layers: decode_step needs the head (the call ends with the logits) "
                             "and the embedding")
        self._check_dtypes(embedding.dtype, k_cache.dtype)
        rows, (vocab, width) = len(ids), embedding.shape
        if any(not 0 <= token < vocab for token in ids):
            raise ValueError(f"native decode layers: a token id out of range [0, {vocab}) in {list(ids)}")
        key = (rows, embedding.dtype)
        buffers = self._step_buffers.get(key)
        if buffers is None:
            hidden = torch.empty((rows, width), dtype=embedding.dtype)
            staged = None if embedding.dtype == torch.float32 else torch.empty((rows, self.head[1].shape[0]),
                                                                                dtype=embedding.dtype)
            buffers = self._step_buffers[key] = (hidden, torch.empty_like(hidden),
                                                 torch.empty(self._scratch_elements(rows), dtype=hidden.dtype),
                                                 staged)
        hidden = buffers[0]
        row_bytes = width * embedding.element_size()
        for row, token in enumerate(ids):
            ctypes.memmove(hidden.data_ptr() + row * row_bytes, embedding.data_ptr() + token * row_bytes, row_bytes)
        longs = ctypes.c_int64 * rows
        at, of, lengths = longs(*positions), longs(*slots), longs(*[p + 1 for p in positions])  # alive for the call
        return self._run(*buffers, rows, k_cache, v_cache, cos, signed_sin, ctypes.addressof(at),
                         ctypes.addressof(of), ctypes.addressof(lengths), 0, (ctypes.c_long * 1)(), False)

    def _check_dtypes(self, dtype: torch.dtype, kv_dtype: torch.dtype) -> None:
        if (dtype, self.weight_dtype, kv_dtype) not in DECODE_LAYERS_DTYPES:
            raise ValueError(f"native decode layers: unsupported dtypes ({dtype} activations, "
                             f"{self.weight_dtype} weights, {kv_dtype} cache)")

    def _scratch_elements(self, rows: int) -> int:
        qkv = (self.heads + 2 * self.kv_heads) * self.head_dim
        return rows * (self.hidden_width + qkv + self.heads * self.head_dim + 3 * self.intermediate)

    def _run(self, hidden, delta, scratch, staged, head_rows: int, k_cache, v_cache, cos, signed_sin,
             positions: int, slots: int, lengths: int, chunks: int, chunk_info, tiles: bool) -> torch.Tensor:
        """The native call over ``hidden`` (positions, slots and lengths: addresses of int64 arrays); with a
        head, the logits of its ``head_rows`` rows with logits (``staged``: their buffer in ``hidden``'s dtype
        where that is not float32), else ``delta``."""
        rows = hidden.shape[0]
        logits, head = None, (None, None, 0, None, None, None, None)
        if self.head is not None:
            norm, weight = self.head
            shape = (head_rows, weight.shape[0])
            logits = torch.empty(shape, dtype=torch.float32)
            staged = logits if staged is None else staged
            best, logprobs = (ctypes.c_int64 * shape[0])(), (ctypes.c_float * shape[0])()
            head = (norm.data_ptr(), weight.data_ptr(), shape[1], staged.data_ptr(), logits.data_ptr(),
                    ctypes.addressof(best), ctypes.addressof(logprobs))
        dims = (ctypes.c_long * 8)(rows, self.hidden_width, self.heads, self.kv_heads, self.head_dim,
                                   self.intermediate, k_cache.shape[3], self._layers)
        code = self.kernels._decode_layers(
            hidden.data_ptr(), delta.data_ptr(), scratch.data_ptr(), dims, self._weights,
            self._cache_pointers(k_cache, v_cache), cos.data_ptr(), signed_sin.data_ptr(), positions, slots, lengths,
            self.eps, self.scale, DTYPE_CODES[hidden.dtype],
            PAIRS_CODE if self.pairs else self.weight_code, DTYPE_CODES[k_cache.dtype],
            torch.get_num_threads(), self.kernels.one_row_prefetch.get((hidden.dtype, self.weight_dtype), 0),
            chunks, chunk_info, int(tiles), *head)
        if code == -3:
            raise ValueError("native decode layers: a prompt's attention in bf16 products does not run here (see "
                             "CpuKernels.supports_tile_attention)")
        if code:
            layout = " or shapes for pair panels" if self.pairs else ""
            raise ValueError(f"native decode layers: unsupported head size {self.head_dim} or heads "
                             f"({self.heads} over {self.kv_heads}){layout}")
        return delta if logits is None else with_greedy_picks(logits, list(best), list(logprobs))


def _overlap(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Whether the memory of two contiguous tensors overlaps."""
    a_end = a.data_ptr() + a.numel() * a.element_size()
    return a.data_ptr() < b.data_ptr() + b.numel() * b.element_size() and b.data_ptr() < a_end


def leading_bytes(weights: Sequence[torch.Tensor], limit: int) -> tuple:
    """How many of the first ``weights`` a load-time measurement streams, and their bytes: enough to
    pass ``limit``, so that they come from memory as a decode step's do, not from a cache."""
    size = 0
    for count, weight in enumerate(weights, 1):
        size += weight.numel() * weight.element_size()
        if size >= limit:
            return count, size
    return len(weights), size


def alternate_passes(runs: Dict[Hashable, Callable[[], object]], rounds: int) -> Dict[Hashable, list]:
    """Each of ``runs`` timed once a round, ``rounds`` rounds after a warm-up one, in an order that turns
    round by round (a drifting machine slows each side alike); returns the seconds of each one's passes."""
    order = list(runs)
    passes: Dict[Hashable, list] = {name: [] for name in order}
    with torch.inference_mode():
        for round_ in range(rounds + 1):
            for name in (order if round_ % 2 else order[::-1]):
                start = time.perf_counter()
                runs[name]()
                if round_:  # the first round warms up
                    passes[name].append(time.perf_counter() - start)
    return passes


def pass_scores(passes: Dict[Hashable, Sequence[float]]) -> Dict[Hashable, float]:
    """Each side's score, in seconds: the mean of its two fastest passes (a busy machine slows every
    side; the fastest keep what each can do, and two of them damp one lucky pass)."""
    return {side: sum(sorted(times)[:2]) / min(2, len(times)) for side, times in passes.items()}


def choose_fastest(passes: Dict[Hashable, Sequence[float]], default: Hashable, margin: float) -> Hashable:
    """The side with the lowest :func:`pass_scores` score, where it beats ``default``'s by ``margin``."""
    score = pass_scores(passes)
    fastest = min(score, key=score.get)
    return fastest if score[fastest] < (1 - margin) * score.get(default, float("inf")) else default


def choose_prefetch(passes: Dict[int, Sequence[float]], default: int = PREFETCH_CANDIDATES[0],
                    margin: float = PREFETCH_MARGIN) -> int:
    """:func:`choose_fastest` among prefetch distances: another replaces the default only by the margin."""
    return choose_fastest(passes, default, margin)


def tune_one_row_prefetch(kernels: CpuKernels, weights: Sequence[torch.Tensor], x_dtype: torch.dtype,
                          rounds: int = 5) -> int:
    """Set and return the one-row prefetch distance ``kernels`` use for ``x_dtype`` rows over weights of
    ``weights``' dtype: ``LLAMA_CPU_PREFETCH`` where it names one, else measured once per process and
    dtype pair, the candidates taking turns over the first weights (up to :data:`PREFETCH_SAMPLE_BYTES`).
    """
    key = (x_dtype, weights[0].dtype)
    setting = os.environ.get(PREFETCH_ENV, "auto").strip().lower()
    if setting != "auto":
        try:
            distance = int(setting)
        except ValueError:
            distance = -1
        if distance < 0:
            raise ValueError(f"{PREFETCH_ENV}={setting!r}: give a distance in bytes (0: the kernels' default) or auto")
        kernels.one_row_prefetch[key] = distance
        return distance
    if key in kernels.one_row_prefetch:
        return kernels.one_row_prefetch[key]
    count, size = leading_bytes(weights, PREFETCH_SAMPLE_BYTES)
    sample = list(weights[:count])
    inputs = [torch.randn(1, w.shape[1]).to(x_dtype) for w in sample]

    def one_pass(distance: int) -> None:
        kernels.one_row_prefetch[key] = distance
        for x, w in zip(inputs, sample):
            kernels.linear(x, w)

    passes = alternate_passes({d: (lambda d=d: one_pass(d)) for d in PREFETCH_CANDIDATES}, rounds)
    chosen = kernels.one_row_prefetch[key] = choose_prefetch(passes)
    scores = pass_scores(passes)
    logger.info("native linear, one row of %s over %s weights, %d threads, %.0f MB: a pass %s ms at %s bytes "
                "ahead (each the mean of its two fastest) -> %d", x_dtype, weights[0].dtype, torch.get_num_threads(),
                size / 1e6, " / ".join(f"{1e3 * scores[d]:.2f}" for d in PREFETCH_CANDIDATES),
                " / ".join(map(str, PREFETCH_CANDIDATES)), chosen)
    return chosen


def for_device(device) -> Optional[CpuKernels]:
    """:func:`load` for tensors on ``device``: None off the CPU (the kernels serve CPU memory only)."""
    return load() if torch.device(device).type == "cpu" else None


_loaded: Dict[str, Optional[CpuKernels]] = {}
_lock = threading.Lock()


def load(flags: Optional[FrozenSet[str]] = None) -> Optional[CpuKernels]:
    """The kernels for this CPU (built if needed), or None where they are off, unsupported or
    cannot be built (logged once per process, with the reason)."""
    setting = os.environ.get(ENV, "auto").strip().lower()
    with _lock:
        if setting not in _loaded:
            _loaded[setting] = _load(setting, cpu_flags() if flags is None else flags)
        return _loaded[setting]


def _load(setting: str, flags: FrozenSet[str]) -> Optional[CpuKernels]:
    if setting in ("0", "off", "false", "no"):
        logger.info("native CPU kernels: off (%s=%s)", ENV, setting)
        return None
    isa = isa_for(flags) if setting in ("auto", "1", "on", "true", "yes") else setting
    if isa is None:
        logger.info("native CPU kernels: none for this CPU (needs AVX2 and FMA); torch's kernels")
        return None
    if isa not in ISA_FLAGS or not ISA_NEEDS[isa] <= flags:
        raise ValueError(f"{ENV}={setting}: this CPU cannot run {setting!r}; use auto, 0, or one of "
                         f"{', '.join(i for i in ISAS if ISA_NEEDS[i] <= flags) or '(none here)'}")
    name = library_name(isa)
    for path in (shipped_dir() / name, cache_dir() / name):
        if path.is_file():
            try:
                return _loaded_from(path, isa)
            except OSError as exc:  # built for another host (a newer glibc, say): build one here
                logger.warning("native CPU kernels: %s does not load here (%s); building one", path, exc)
    try:
        return _loaded_from(build(isa, cache_dir()), isa)
    except (KernelBuildError, OSError) as exc:
        logger.warning("native CPU kernels unavailable, torch's kernels instead: %s", exc)
        return None


def _loaded_from(path: Path, isa: str) -> CpuKernels:
    kernels = CpuKernels(path, isa)
    logger.info("native CPU kernels: %s (%s)", isa, path)
    return kernels
