"""What the CPU can do natively, and the dtype ``handler.dtype: auto`` picks from it.

bfloat16 halves the bytes a decode step reads, but only a CPU with native bf16 arithmetic
(AMX or AVX512_BF16) computes in it at speed: elsewhere every bf16 product is converted to
float32 and back. Measured with the bench model (116M, 2 threads): on an AMX Xeon bf16
prefill ran ~6x faster than float32; on an AVX2-only EPYC bf16 prefilled about 80 tokens/s
(a 3.1 s TTFT for 256 tokens) where float32 took 0.46 s, ~7x faster. So ``auto`` is bf16
only where it is native.
"""
from __future__ import annotations

import ctypes
import ctypes.util
import functools
import logging
import mmap
import os
import sys
from pathlib import Path
from typing import TYPE_CHECKING, Dict, FrozenSet, List, Optional, Tuple

if TYPE_CHECKING:
    import torch

logger = logging.getLogger(__name__)

#: /proc/cpuinfo flags that mean bf16 matrix products run natively.
NATIVE_BF16_FLAGS = ("amx_bf16", "avx512_bf16")
#: /proc/cpuinfo flags that mean f16 converts to float32 in hardware (x86 F16C, Arm's half-precision SIMD).
F16_CONVERT_FLAGS = ("f16c", "asimdhp")
#: The flags the bench and the logs report (what decides speed on x86).
REPORTED_FLAGS = ("avx2", "fma", "f16c", "avx512f", "avx512_vnni", "avx512_bf16", "avx512_fp16",
                  "amx_tile", "amx_bf16", "amx_int8", "amx_fp16")


#: The CPU classes (:func:`cpu_class`), lowest first.
CLASSES = ("other", "avx2", "avx512", "avx512-bf16", "amx")
#: The flags (by prefix) that lift a CPU into each class: a CPU of a lower class has none of them.
CLASS_FLAG_PREFIXES = {"avx2": ("avx2",), "avx512": ("avx512",), "avx512-bf16": ("avx512_bf16",), "amx": ("amx",)}
#: ``LLAMA_CPU_CLASS=avx2``: this machine reports only the flags a CPU of that (lower) class has,
#: so ``dtype: auto`` and the native kernels choose as they would there. torch's own kernels need
#: their own variables for that (:func:`emulation_env`); the bench's ``--cpu-class`` sets them all.
CLASS_ENV = "LLAMA_CPU_CLASS"
_announced: set = set()


def cpu_flags(cpuinfo: Optional[str] = None) -> FrozenSet[str]:
    """The first CPU's feature flags from ``/proc/cpuinfo`` (empty where there is none, e.g. macOS),
    or, for this machine, those of the class ``LLAMA_CPU_CLASS`` names (:func:`restrict_flags`)."""
    if cpuinfo is not None:
        return _parse_flags(cpuinfo)
    flags = host_cpu_flags()
    target = os.environ.get(CLASS_ENV, "").strip()
    if not target:
        return flags
    restricted = restrict_flags(flags, target)
    if target not in _announced:
        _announced.add(target)
        logger.info("%s=%s: choosing as a CPU of class %s would (this one is %s)", CLASS_ENV, target, target,
                    cpu_class(flags))
    return restricted


def _parse_flags(cpuinfo: str) -> FrozenSet[str]:
    for line in cpuinfo.splitlines():
        key, _, value = line.partition(":")
        if key.strip() in ("flags", "Features"):
            return frozenset(value.split())
    return frozenset()


def host_cpu_flags() -> FrozenSet[str]:
    """This machine's flags as ``/proc/cpuinfo`` has them, whatever ``LLAMA_CPU_CLASS`` says."""
    try:
        return _parse_flags(Path("/proc/cpuinfo").read_text())
    except OSError:
        return frozenset()


def restrict_flags(flags: FrozenSet[str], target: str) -> FrozenSet[str]:
    """``flags`` without those that lift a CPU above class ``target``: what a CPU of that class has.

    Only downwards: a CPU cannot run a higher class's instructions, so asking for one raises.
    """
    if target not in CLASSES:
        raise ValueError(f"{CLASS_ENV}={target!r} is not a CPU class; use one of {', '.join(CLASSES)}")
    actual = cpu_class(flags)
    if CLASSES.index(target) > CLASSES.index(actual):
        raise ValueError(f"{CLASS_ENV}={target}: this CPU is of class {actual} and cannot run the instructions of "
                         f"class {target}; use {actual} or a lower class, or unset {CLASS_ENV}")
    above = tuple(prefix for cls in CLASSES[CLASSES.index(target) + 1:] for prefix in CLASS_FLAG_PREFIXES[cls])
    return frozenset(flag for flag in flags if not flag.startswith(above))


#: What keeps torch's own kernels within a class, by variable: ATen's vectorized ops, oneDNN (bf16 and
#: packed linears), MKL (float32 matrix products). A class absent from a table needs no limit there.
_TORCH_LIMITS = {
    "ATEN_CPU_CAPABILITY": {"other": "default", "avx2": "avx2"},
    "ONEDNN_MAX_CPU_ISA": {"other": "SSE41", "avx2": "AVX2", "avx512": "AVX512_CORE_VNNI",
                           "avx512-bf16": "AVX512_CORE_BF16"},
    "MKL_ENABLE_INSTRUCTIONS": {"other": "SSE4_2", "avx2": "AVX2"},
}
#: Every variable :func:`emulation_env` may set.
EMULATION_VARS = (CLASS_ENV, *_TORCH_LIMITS)


def emulation_env(target: str) -> Dict[str, str]:
    """The environment under which this machine computes as a CPU of class ``target`` would: this
    package's choices (``LLAMA_CPU_CLASS``) and torch's kernels (``ATEN_CPU_CAPABILITY``,
    ``ONEDNN_MAX_CPU_ISA``, ``MKL_ENABLE_INSTRUCTIONS``). Each library reads its variable once, at
    its first use, so a process must have them before it computes anything. Memory, caches and
    clocks stay this machine's: an emulated class measures the instruction set, not the chip.
    """
    restrict_flags(host_cpu_flags(), target)  # raises for a class this machine cannot emulate
    return {CLASS_ENV: target, **{var: table[target] for var, table in _TORCH_LIMITS.items() if target in table}}


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


def is_amx(flags: Optional[FrozenSet[str]] = None) -> bool:
    """Whether the CPU with ``flags`` (default: this machine's) is of the ``amx`` class."""
    return cpu_class(cpu_flags() if flags is None else flags) == "amx"


def auto_dtype(device: str, flags: Optional[FrozenSet[str]] = None) -> str:
    """``handler.dtype: auto``: bfloat16 on a GPU that supports it and on a CPU with native bf16,
    float32 everywhere else."""
    if device == "cuda":
        import torch

        return "bfloat16" if torch.cuda.is_bf16_supported() else "float16"
    return "bfloat16" if has_native_bf16(cpu_flags() if flags is None else flags) else "float32"


def gguf_16_bit_type(flags: Optional[FrozenSet[str]] = None) -> str:
    """The 16-bit GGUF type llama.cpp decodes faster on the CPU with ``flags`` (default: this one's).

    bf16 where the CPU has native bf16. Without it ggml widens every bf16 weight in software, while a
    CPU with F16C converts f16 in one instruction: on the Emerald Rapids VM without AVX512_BF16
    (2026-12-03, bench model, 2 threads, a token after a 256-token prompt, alternated rounds) an f16
    GGUF decoded 15.8 against 17.0 ms a token in llama-server (16.6 against 19.2 under its AVX2
    build) and 14.4 against 16.9 in llama-cpp-python, prefill within 3%. bf16 on a CPU that has neither.
    """
    flags = cpu_flags() if flags is None else flags
    if has_native_bf16(flags) or not any(flag in flags for flag in F16_CONVERT_FLAGS):
        return "bf16"
    return "f16"


def reported_flags(flags: FrozenSet[str]) -> list:
    return sorted(flag for flag in flags if flag in REPORTED_FLAGS)


#: glibc's ``mallopt`` parameters (malloc.h).
M_TRIM_THRESHOLD, M_MMAP_THRESHOLD = -1, -3
#: Blocks up to this size come from the heap, not a fresh ``mmap`` each (glibc's own ceiling is 32 MiB).
MMAP_THRESHOLD = 256 << 20
#: Free memory at the heap's top that glibc keeps rather than hands back to the kernel.
TRIM_THRESHOLD = 1 << 30
_malloc_kept: Optional[bool] = None


def keep_freed_memory() -> bool:
    """Have glibc reuse the blocks torch frees instead of returning them to the kernel.

    A prefill's intermediates are megabytes each (768 tokens x 2 x 3072 float32 in the bench
    model's MLP: 19 MB), allocated and freed in every layer. With glibc's defaults such a block
    goes back to the kernel when freed (``mmap``'d, or trimmed from the heap's top), and the next
    one is faulted in and zeroed page by page. On the AVX2 EPYC a 768-token prefill of the bench
    model took 10,000-110,000 minor page faults with glibc's defaults (up to ~430 MB zeroed) and
    none with this; alone, ``silu(gate) * up`` on 768 rows took 9.3-11.7 ms against 2.0 ms. The
    prefill's own time moved by less than that host's drift between runs (1,330-1,780 ms either
    way). jemalloc or tcmalloc preloaded do the same; this needs nothing installed. Process-wide
    and applied once; False where the C library has no ``mallopt`` (not glibc).
    """
    global _malloc_kept
    if _malloc_kept is None:
        # an older glibc refuses a threshold above its own 32 MiB ceiling: take the ceiling there
        mmap = next((size for size in (MMAP_THRESHOLD, 32 << 20) if _mallopt(M_MMAP_THRESHOLD, size)), 0)
        _malloc_kept = bool(mmap) and _mallopt(M_TRIM_THRESHOLD, TRIM_THRESHOLD)
        logger.info("malloc: %s", f"freed blocks up to {mmap >> 20} MiB kept for reuse"
                    if _malloc_kept else "left as it is (no glibc mallopt)")
    return _malloc_kept


def _mallopt(param: int, value: int) -> bool:
    libc = _glibc()
    return libc is not None and bool(libc.mallopt(param, value))


def release_freed_memory() -> bool:
    """Hand the pages of glibc's free blocks back to the kernel (``malloc_trim(0)``); whether it could.

    :func:`keep_freed_memory` keeps freed blocks for reuse, which a prefill wants and a load does
    not: repacking a model's weights frees each loaded copy after making its replacement, and the
    freed copies stayed resident. Loading the 2.07 GB bf16 beyond-cache model (AMX Xeon) left 2 GB
    of them in the heap beside the weights in use: 5.4 GB of anonymous memory at its peak, with
    1.3 GB of KV cache. ``malloc_trim`` also releases free pages amid the heap, not only at its top.
    """
    libc = _glibc()
    if libc is None or not hasattr(libc, "malloc_trim"):
        return False
    libc.malloc_trim(0)
    return True


#: madvise(2)'s advice to start reading a file mapping's pages now (Linux), without waiting for them.
MADV_WILLNEED = 3


def read_pages_ahead(address: int, length: int) -> bool:
    """Have the kernel start reading the pages of ``length`` bytes of a file mapping from ``address``
    (``madvise(MADV_WILLNEED)`` over the whole pages); whether it took the advice (False off Linux)."""
    libc = _glibc()
    if libc is None or length <= 0:
        return False
    start = address - address % mmap.PAGESIZE
    return libc.madvise(ctypes.c_void_p(start), ctypes.c_size_t(address + length - start), MADV_WILLNEED) == 0


class _MallInfo2(ctypes.Structure):
    _fields_ = [(name, ctypes.c_size_t) for name in ("arena", "ordblks", "smblks", "hblks", "hblkhd", "usmblks",
                                                     "fsmblks", "uordblks", "fordblks", "keepcost")]


def heap_free_bytes() -> Optional[int]:
    """Bytes of glibc's free blocks in its heaps (``mallinfo2``'s ``fordblks``): what
    :func:`release_freed_memory` could hand back. None without glibc 2.33's ``mallinfo2``."""
    libc = _glibc()
    if libc is None or not hasattr(libc, "mallinfo2"):
        return None
    return int(libc.mallinfo2().fordblks)


@functools.cache
def _glibc() -> Optional[ctypes.CDLL]:
    """The C library where it is glibc (mallopt, malloc_trim, mallinfo2), else None; looked up once."""
    if not sys.platform.startswith("linux"):
        return None
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
    except OSError:
        return None
    if not hasattr(libc, "mallopt"):
        return None
    if hasattr(libc, "mallinfo2"):
        libc.mallinfo2.restype = _MallInfo2
    return libc


def file_mapped_ranges(maps: str = "/proc/self/maps") -> List[Tuple[int, int]]:
    """``[start, end)`` of each of this process's mappings of a file (a loaded checkpoint's among them).

    Empty where the process has no such list (not Linux)."""
    try:
        lines = Path(maps).read_text().splitlines()
    except OSError:
        return []
    ranges = []
    for line in lines:
        fields = line.split(maxsplit=5)
        if len(fields) == 6 and fields[5].startswith("/") and fields[4] != "0":
            start, end = fields[0].split("-")
            ranges.append((int(start, 16), int(end, 16)))
    return ranges


def process_memory(status: str = "/proc/self/status") -> Dict[str, int]:
    """This process's resident memory in bytes: ``anon`` (its own), ``file`` (mapped files' pages, which the
    kernel can drop and read again) and ``peak`` (the most resident at once, both kinds); empty off Linux."""
    try:
        text = Path(status).read_text()
    except OSError:
        return {}
    fields = dict(line.split(":", 1) for line in text.splitlines() if ":" in line)
    return {key: int(fields[name].split()[0]) << 10 for key, name in (("anon", "RssAnon"), ("file", "RssFile"),
                                                                        ("peak", "VmHWM")) if name in fields}


#: A transparent huge page on x86-64 Linux.
HUGE_PAGE = 2 << 20
THP_MODE_FILE = Path("/sys/kernel/mm/transparent_hugepage/enabled")


def transparent_huge_pages(mode_file: Path = THP_MODE_FILE) -> str:
    """The kernel's transparent huge page mode (``always``, ``madvise`` or ``never``); ``""`` without one."""
    try:
        text = mode_file.read_text()
    except OSError:
        return ""
    return next((word[1:-1] for word in text.split() if word.startswith("[")), "")


def huge_page_empty(numel: int, dtype: "torch.dtype") -> Tuple["torch.Tensor", bool]:
    """``numel`` uninitialised elements of ``dtype`` in an anonymous mapping of their own, from a 2 MiB
    boundary, advised for transparent huge pages before any page is touched; and whether the kernel
    took the advice (False off Linux or with THP ``never``: plain pages, still one block).

    A weight streamed from 4 KiB pages takes a TLB miss every 4 KiB. Advised before it is touched, the
    kernel maps 2 MiB pages as the block is written (malloc's blocks may be touched already: the
    advice then waits for khugepaged). The mapping is freed with the last tensor over it.
    """
    import torch

    if not hasattr(mmap, "MAP_ANONYMOUS"):  # Windows: no private anonymous mappings to advise
        return torch.empty(numel, dtype=dtype), False
    itemsize = torch.empty(0, dtype=dtype).element_size()
    size = numel * itemsize
    block = mmap.mmap(-1, size + HUGE_PAGE, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)  # shared: shmem, no THP
    address = ctypes.addressof(ctypes.c_char.from_buffer(block))
    start = -address % HUGE_PAGE
    advised = False
    if hasattr(mmap, "MADV_HUGEPAGE") and transparent_huge_pages() in ("always", "madvise"):
        try:
            block.madvise(mmap.MADV_HUGEPAGE)
            advised = True
        except OSError as exc:
            logger.info("transparent huge pages refused (%s): plain pages", exc)
    raw = torch.frombuffer(block, dtype=torch.uint8)
    return raw[start:start + size].view(dtype), advised


#: ``omp_pause_soft`` (OpenMP 5.0): free the calling thread's worker threads, keep the runtime.
OMP_PAUSE_SOFT = 1


def release_openmp_threads() -> int:
    """Free the OpenMP worker threads the calling thread has started, in every libgomp loaded.

    Call it from the thread that loaded and warmed the model when another thread runs the model
    from then on (TorchServe's ``MicroBatching`` stages). Every thread that has run a parallel
    region keeps its own team of workers, and once libgomp manages more threads than there are
    CPUs it spins only 100 times before sleeping, whatever GOMP_SPINCOUNT says. So the second
    thread's parallel regions each paid a wake-up: on a 2-vCPU Zen 5 EPYC a decode step of the
    bench model took 12.2 ms from that thread against 8.5 ms from the main thread, and served
    micro-batching ran its 1-row decode passes at 12.3-13.7 ms against 9.1-10.1 ms under
    continuous batching (which runs in the main thread). With the main thread's team freed the
    other thread's regions run as fast as the main thread's did. Returns how many libgomp
    libraries released their threads (0 on a platform without libgomp).
    """
    released = 0
    for path in _loaded_libgomps():
        try:
            released += ctypes.CDLL(path).omp_pause_resource_all(OMP_PAUSE_SOFT) == 0
        except (OSError, AttributeError):
            continue
    return released


def _loaded_libgomps() -> list:
    try:
        with open("/proc/self/maps", encoding="utf-8") as maps:
            return sorted({line.split()[-1] for line in maps if "/libgomp" in line})
    except OSError:
        return []
