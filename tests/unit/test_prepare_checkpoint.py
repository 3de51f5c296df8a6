import pytest

from scripts import prepare_checkpoint

from neuron_env import neuron_double


def test_prepare_links_safetensors_and_tokenizer(tiny_model_dir, tmp_path):
    out = prepare_checkpoint.prepare(tiny_model_dir, tmp_path / "model")
    names = {p.name for p in out.iterdir()}
    assert {"model.safetensors", "config.json", "tokenizer.json"} <= names
    assert not (tmp_path / "model.partial").exists()


def test_pickle_only_checkpoint_is_refused_with_the_fix(tiny_model_dir, tmp_path):
    src = tmp_path / "src"
    src.mkdir()
    (src / "config.json").write_text((tiny_model_dir / "config.json").read_text())
    (src / "pytorch_model.bin").write_bytes(b"pickle")
    with pytest.raises(SystemExit, match=r"no \*\.safetensors weights \(found pytorch_model\.bin\).*safe_serialization=True"):
        prepare_checkpoint.prepare(src, tmp_path / "model")


def test_non_llama_checkpoint_is_refused(tmp_path):
    (tmp_path / "config.json").write_text('{"model_type": "bert"}')
    with pytest.raises(SystemExit, match="model_type 'bert'"):
        prepare_checkpoint.prepare(tmp_path, tmp_path / "out")


def test_legacy_split_writes_the_old_neuron_layout(tiny_model_dir, tmp_path):
    with neuron_double():
        out = prepare_checkpoint.legacy_split(tiny_model_dir, tmp_path / "split")
        from transformers_neuronx import LlamaForSampling

        model = LlamaForSampling.from_pretrained(str(out), batch_size=1, tp_degree=2, n_positions=128,
                                                 context_length_estimate=[32])
        assert model is not None
    assert (out / "pytorch_model.bin" / "key_to_filename.json").exists()
    assert (out / "tokenizer.json").exists()
