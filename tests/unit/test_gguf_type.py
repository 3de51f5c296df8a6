"""``handler.gguf_type: auto``: which GGUF type the build converts a checkpoint to, on which CPU."""
from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import save_file

from llama_engine import cpu
from scripts import build_model

AVX512_NO_BF16 = frozenset({"avx2", "fma", "f16c", "avx512f", "avx512_vnni"})


@pytest.mark.parametrize("flags, expected", [
    (AVX512_NO_BF16, "f16"),
    (frozenset({"avx2", "fma", "f16c"}), "f16"),
    (frozenset({"asimd", "asimdhp"}), "f16"),
    (AVX512_NO_BF16 | {"avx512_bf16"}, "bf16"),
    (AVX512_NO_BF16 | {"avx512_bf16", "amx_tile", "amx_bf16"}, "bf16"),
    (frozenset({"sse4_2"}), "bf16"),
])
def test_the_16_bit_type_is_f16_only_without_native_bf16_and_with_hardware_f16(flags, expected):
    assert cpu.gguf_16_bit_type(flags) == expected


def test_an_emulated_avx2_class_gets_f16(monkeypatch):
    monkeypatch.setattr(cpu, "host_cpu_flags", lambda: AVX512_NO_BF16 | {"avx512_bf16", "amx_bf16", "amx_tile"})
    assert cpu.gguf_16_bit_type() == "bf16"
    monkeypatch.setenv(cpu.CLASS_ENV, "avx2")
    assert cpu.gguf_16_bit_type() == "f16"


def checkpoint(folder, stored, tensors=None):
    folder.mkdir()
    (folder / "config.json").write_text(json.dumps({"torch_dtype": stored} if stored else {}))
    if tensors is not None:
        save_file(tensors, str(folder / "model.safetensors"))
    return folder


def bf16_weights(**special):
    tensors = {"layers.0.mlp.up_proj.weight": (torch.randn(64, 32) * 0.02).bfloat16(),
               "norm.weight": torch.ones(32, dtype=torch.bfloat16)}
    for name, value in special.items():
        tensors[name] = torch.full((4, 4), value, dtype=torch.bfloat16)
    return tensors


@pytest.fixture()
def on_cpu(monkeypatch):
    """Makes the build machine one whose ``dtype: auto`` and 16-bit GGUF type are given."""
    def choose(auto_dtype, sixteen_bit):
        monkeypatch.setattr(cpu, "auto_dtype", lambda device: auto_dtype)
        monkeypatch.setattr(cpu, "gguf_16_bit_type", lambda: sixteen_bit)
    return choose


def test_a_bf16_checkpoint_becomes_f16_where_llamacpp_decodes_it_faster_and_it_fits(on_cpu, tmp_path, capsys):
    folder = checkpoint(tmp_path / "bf16", "bfloat16", bf16_weights(big=65280.0))  # the largest bf16 under 65504
    on_cpu("float32", "f16")
    assert build_model.gguf_outtype("auto", folder) == "f16"
    assert "65280 in big, fits float16" in capsys.readouterr().out
    on_cpu("bfloat16", "bf16")
    assert build_model.gguf_outtype("auto", folder) == "bf16"


@pytest.mark.parametrize("value, why", [(65536.0, "beyond float16's 65504"), (float("inf"), "beyond float16's"),
                                        (float("nan"), "holds NaN")])
def test_a_bf16_checkpoint_stays_bf16_where_a_weight_would_not_survive_f16(on_cpu, tmp_path, capsys, value, why):
    folder = checkpoint(tmp_path / "bf16", "bfloat16", bf16_weights(outlier=value))
    on_cpu("float32", "f16")
    assert build_model.gguf_outtype("auto", folder) == "bf16"
    out = capsys.readouterr().out
    assert "outlier" in out and why in out and "kept in bf16" in out


def test_a_bf16_checkpoint_without_safetensors_stays_bf16(on_cpu, tmp_path):
    on_cpu("float32", "f16")
    assert build_model.gguf_outtype("auto", checkpoint(tmp_path / "bf16", "bfloat16")) == "bf16"


def test_every_weight_file_of_a_sharded_checkpoint_is_checked(tmp_path):
    folder = checkpoint(tmp_path / "bf16", "bfloat16", bf16_weights())
    save_file(bf16_weights(lm_head=1e5), str(folder / "model-00002-of-00002.safetensors"))
    fits, detail = build_model.fits_f16(folder)
    assert not fits and "lm_head holds 99840" in detail


@pytest.mark.parametrize("auto, sixteen_bit, fallback", [("bfloat16", "bf16", "bf16"), ("float32", "f16", "f32"),
                                                         ("float32", "bf16", "f32")])
def test_other_checkpoints_keep_their_16_bit_type_or_follow_dtype_auto(on_cpu, tmp_path, auto, sixteen_bit, fallback):
    on_cpu(auto, sixteen_bit)
    assert build_model.gguf_outtype("auto", checkpoint(tmp_path / "f16", "float16")) == "f16"
    assert build_model.gguf_outtype("auto", checkpoint(tmp_path / "f32", "float32")) == fallback
    assert build_model.gguf_outtype("auto", checkpoint(tmp_path / "none", None)) == fallback
    assert build_model.gguf_outtype("auto") == fallback


def test_an_explicit_type_is_used_as_given(on_cpu, tmp_path):
    folder = checkpoint(tmp_path / "bf16", "bfloat16", bf16_weights(outlier=70000.0))
    on_cpu("float32", "f16")
    for explicit in ("q8_0", "f32", "f16", "bf16"):
        assert build_model.gguf_outtype(explicit, folder) == explicit
