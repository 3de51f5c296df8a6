"""``handler.dtype: auto``: bf16 only where the CPU computes in it natively."""
import os
import subprocess
import sys

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


@pytest.mark.parametrize("cpuinfo, target, kept, dropped", [
    (SPR, "avx512-bf16", {"avx512_bf16", "avx512f", "avx2"}, {"amx_bf16", "amx_tile", "amx_int8"}),
    (SPR, "avx512", {"avx512f", "avx512_vnni", "avx512_fp16", "avx2"}, {"avx512_bf16", "amx_bf16"}),
    (SPR, "avx2", {"avx2", "fpu"}, {"avx512f", "avx512_vnni", "avx512_bf16", "avx512_fp16", "amx_tile"}),
    (COOPER, "other", {"fpu"}, {"avx2", "avx512f"}),
    (AVX2_EPYC, "avx2", {"avx2", "fma", "f16c", "bmi2"}, set()),
])
def test_a_cpu_restricted_to_a_lower_class_keeps_only_that_classs_flags(cpuinfo, target, kept, dropped):
    flags = cpu.restrict_flags(cpu.cpu_flags(cpuinfo), target)
    assert cpu.cpu_class(flags) == target
    assert kept <= flags and not dropped & flags


@pytest.mark.parametrize("target, message", [
    ("amx", "class avx512-bf16 and cannot run the instructions of class amx"),
    ("avx3", "'avx3' is not a CPU class; use one of other, avx2, avx512, avx512-bf16, amx"),
])
def test_a_class_the_cpu_cannot_emulate_is_refused_by_name(target, message):
    with pytest.raises(ValueError, match="LLAMA_CPU_CLASS") as err:
        cpu.restrict_flags(cpu.cpu_flags(COOPER), target)
    assert message in str(err.value)


def test_llama_cpu_class_narrows_this_machines_flags_and_so_the_auto_dtype(monkeypatch):
    monkeypatch.delenv(cpu.CLASS_ENV, raising=False)
    monkeypatch.setattr(cpu, "host_cpu_flags", lambda: cpu.cpu_flags(SPR))
    assert cpu.auto_dtype("cpu") == "bfloat16" and cpu.is_amx()
    monkeypatch.setenv(cpu.CLASS_ENV, "avx2")
    assert cpu.cpu_class(cpu.cpu_flags()) == "avx2"
    assert cpu.auto_dtype("cpu") == "float32" and not cpu.is_amx()
    assert cpu.cpu_flags(COOPER) == frozenset(COOPER.split(":")[1].split())  # given flags are taken as given
    monkeypatch.setenv(cpu.CLASS_ENV, "avx3")
    with pytest.raises(ValueError, match="LLAMA_CPU_CLASS='avx3'"):
        cpu.cpu_flags()


@pytest.mark.parametrize("target, expected", [
    ("avx2", {"LLAMA_CPU_CLASS": "avx2", "ATEN_CPU_CAPABILITY": "avx2", "ONEDNN_MAX_CPU_ISA": "AVX2",
              "MKL_ENABLE_INSTRUCTIONS": "AVX2"}),
    ("avx512", {"LLAMA_CPU_CLASS": "avx512", "ONEDNN_MAX_CPU_ISA": "AVX512_CORE_VNNI"}),
    ("avx512-bf16", {"LLAMA_CPU_CLASS": "avx512-bf16", "ONEDNN_MAX_CPU_ISA": "AVX512_CORE_BF16"}),
    ("amx", {"LLAMA_CPU_CLASS": "amx"}),
])
def test_emulation_narrows_torchs_own_kernels_to_the_class(monkeypatch, target, expected):
    monkeypatch.setattr(cpu, "host_cpu_flags", lambda: cpu.cpu_flags(SPR))
    assert cpu.emulation_env(target) == expected


def test_no_emulation_above_this_machines_class(monkeypatch):
    monkeypatch.setattr(cpu, "host_cpu_flags", lambda: cpu.cpu_flags(AVX2_EPYC))
    assert cpu.emulation_env("avx2")["LLAMA_CPU_CLASS"] == "avx2"
    with pytest.raises(ValueError, match="class avx2 and cannot run the instructions of class avx512"):
        cpu.emulation_env("avx512")


def test_torch_computes_with_the_emulated_classs_instructions():
    """The variables :func:`emulation_env` sets do narrow torch (read in a fresh process: each
    library reads its own once)."""
    if cpu.CLASSES.index(cpu.cpu_class(cpu.host_cpu_flags())) < cpu.CLASSES.index("avx2"):
        pytest.skip("this CPU has no AVX2 to emulate an avx2 CPU with")
    env = dict(os.environ, **cpu.emulation_env("avx2"))
    probe = subprocess.run([sys.executable, "-c", "import torch; print(torch.backends.cpu.get_cpu_capability())"],
                           env=env, capture_output=True, text=True, timeout=120)
    assert probe.returncode == 0, probe.stderr
    assert probe.stdout.strip() == "AVX2"
