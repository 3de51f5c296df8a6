"""``handler.dtype: auto``: bf16 only where the CPU computes in it natively."""
import pytest

from llama_engine import cpu
from llama_engine.config import HandlerConfig

AVX2_EPYC = "processor\t: 0\nvendor_id\t: AuthenticAMD\nflags\t\t: fpu sse2 avx fma f16c avx2 bmi2\n"
SPR = "flags\t\t: fpu avx2 avx512f avx512_vnni avx512_bf16 amx_bf16 amx_tile amx_int8 avx512_fp16\n"
COOPER = "flags\t\t: fpu avx2 avx512f avx512_vnni avx512_bf16\n"
SKYLAKE = "flags\t\t: fpu avx2 avx512f avx512_vnni\n"
GRAVITON = "Features\t: fp asimd evtstrm aes pmull sha1 sha2 crc32 atomics fphp asimdhp bf16\n"


@pytest.mark.parametrize("cpuinfo, dtype, klass", [
    (AVX2_EPYC, "float32", "avx2"),
    (SKYLAKE, "float32", "avx512"),
    (COOPER, "bfloat16", "avx512-bf16"),
    (SPR, "bfloat16", "amx"),
    (GRAVITON, "float32", "other"),
    ("", "float32", "other"),
])
def test_auto_is_bf16_only_with_native_bf16(cpuinfo, dtype, klass):
    flags = cpu.cpu_flags(cpuinfo)
    assert cpu.auto_dtype("cpu", flags) == dtype
    assert cpu.cpu_class(flags) == klass


def test_flags_come_from_the_first_processor_and_are_reported_selectively():
    flags = cpu.cpu_flags(SPR + "flags\t\t: fpu\n")
    assert "amx_bf16" in flags
    assert cpu.reported_flags(flags) == ["amx_bf16", "amx_int8", "amx_tile", "avx2", "avx512_bf16",
                                         "avx512_fp16", "avx512_vnni", "avx512f"]


def test_this_machine_reads_its_own_flags():
    flags = cpu.cpu_flags()
    assert cpu.auto_dtype("cpu") == ("bfloat16" if cpu.has_native_bf16(flags) else "float32")


def test_auto_is_the_default_and_a_valid_choice():
    assert HandlerConfig().dtype == "auto"
    assert HandlerConfig(dtype="auto").dtype == "auto"


def test_the_torch_backend_loads_auto_in_the_dtype_this_cpu_gets(tiny_model_dir):
    import torch

    from llama_engine.backends.torch_backend import TorchBackend, resolve_dtype

    backend = TorchBackend(str(tiny_model_dir), dtype="auto", device="cpu", max_length=64)
    expected = resolve_dtype("auto", "cpu")
    assert expected == cpu.auto_dtype("cpu")
    assert backend.model.dtype == getattr(torch, expected)
