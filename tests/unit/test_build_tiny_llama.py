"""Tests for scripts/build_tiny_llama.py (offline, deterministic tiny Llama build)."""

import importlib.util
import subprocess
import sys
from pathlib import Path

import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

SCRIPT = Path(__file__).resolve().parents[2] / "scripts" / "build_tiny_llama.py"
STEPS = 3


def load_script():
    spec = importlib.util.spec_from_file_location("build_tiny_llama", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="module")
def builds(tmp_path_factory):
    """One build via the CLI in a fresh process, one in-process via build()."""
    root = tmp_path_factory.mktemp("tiny-llama")
    cli_out, lib_out = root / "cli", root / "lib"
    subprocess.run(
        [sys.executable, str(SCRIPT), "--out", str(cli_out), "--steps", str(STEPS)],
        check=True,
        capture_output=True,
        text=True,
    )
    threads, deterministic = torch.get_num_threads(), torch.are_deterministic_algorithms_enabled()
    try:
        load_script().build(lib_out, steps=STEPS)
    finally:  # build() changes process-wide torch settings; restore them
        torch.set_num_threads(threads)
        torch.use_deterministic_algorithms(deterministic)
    return cli_out, lib_out


@pytest.fixture(scope="module")
def tokenizer(builds):
    return transformers.AutoTokenizer.from_pretrained(builds[0])


def test_builds_are_byte_identical(builds):
    a, b = builds
    for name in ("model.safetensors", "tokenizer.json"):
        assert (a / name).read_bytes() == (b / name).read_bytes(), name


def test_output_layout(builds):
    out = builds[0]
    for name in ("config.json", "generation_config.json", "model.safetensors", "tokenizer.json"):
        assert (out / name).is_file(), name
    assert not (out / "pytorch_model.bin").exists()
    assert (out / "model.safetensors").stat().st_mode & 0o044 == 0o044, "not group/world readable"
    leftovers = [p.name for p in out.parent.iterdir() if p.name.startswith(".")]
    assert leftovers == [], "temporary build directories were left behind"


def test_tokenizer_special_tokens(tokenizer):
    assert tokenizer.is_fast
    assert (tokenizer.pad_token_id, tokenizer.bos_token_id, tokenizer.eos_token_id) == (0, 1, 2)
    assert tokenizer.padding_side == "left"
    assert tokenizer.model_max_length == 1024
    ids = tokenizer("The function returns").input_ids
    assert ids[0] == tokenizer.bos_token_id
    assert ids.count(tokenizer.bos_token_id) == 1


@pytest.mark.parametrize(
    "text",
    ["The function returns a value.", "I like 🦙 and 🎉", "你好，世界。日本語", "  tabs\tand\nnewlines  "],
)
def test_tokenizer_round_trip(tokenizer, text):
    ids = tokenizer(text).input_ids
    assert tokenizer.decode(ids, skip_special_tokens=True) == text


def test_emoji_spans_several_tokens(tokenizer):
    assert len(tokenizer("🦙", add_special_tokens=False).input_ids) > 1


def test_model_loads_and_produces_logits(builds, tokenizer):
    model = transformers.LlamaForCausalLM.from_pretrained(builds[0], use_safetensors=True)
    cfg = model.config
    assert (cfg.bos_token_id, cfg.eos_token_id, cfg.pad_token_id) == (1, 2, 0)
    assert cfg.num_key_value_heads < cfg.num_attention_heads  # GQA
    assert cfg.tie_word_embeddings is False
    assert model.generation_config.eos_token_id == 2
    assert model.generation_config.pad_token_id == 0
    enc = tokenizer("The function returns", return_tensors="pt")
    assert "token_type_ids" not in enc  # would break model.generate(**enc)
    with torch.no_grad():
        logits = model(**enc).logits
    assert logits.shape == (1, enc.input_ids.shape[1], len(tokenizer))
    assert cfg.vocab_size == len(tokenizer)
    assert torch.isfinite(logits).all()
