from pathlib import Path

import pytest
import yaml

from llama_engine import ConfigError, load_model_config, load_model_config_file

ROOT = Path(__file__).resolve().parents[2]


def base():
    return yaml.safe_load((ROOT / "model-config" / "tiny-llama.yaml").read_text())


@pytest.mark.parametrize("path", sorted((ROOT / "model-config").glob("*.yaml")), ids=lambda p: p.name)
def test_every_shipped_config_loads(path):
    cfg = load_model_config_file(str(path))
    assert cfg.micro_batching.micro_batch_size <= cfg.frontend.batchSize


def test_tiny_config_values():
    cfg = load_model_config(base())
    assert cfg.handler.backend == "torch"
    assert cfg.micro_batching.parallelism == {"preprocess": 2, "inference": 1, "postprocess": 2}
    assert cfg.frontend.startupTimeout >= 120


def mutate(section, key, value):
    data = base()
    (data[section] if section else data)[key] = value
    return data


@pytest.mark.parametrize("section,key,value,expected", [
    ("handler", "max_lenght", 10, r"handler\.max_lenght: unknown key; did you mean 'max_length'"),
    ("", "batchsize", 4, r"batchsize: unknown key; did you mean 'batchSize'"),
    ("micro_batching", "size", 4, r"micro_batching\.size: unknown key"),
    ("handler", "max_length", "512", r"handler\.max_length: expected int, got str"),
    ("", "batchSize", True, r"batchSize: expected int, got bool"),
    ("handler", "warmup", "yes", r"handler\.warmup: expected bool"),
    ("handler", "backend", "tpu", r"handler\.backend: must be one of torch, neuron"),
    ("handler", "dtype", "fp8", r"handler\.dtype: must be one of"),
    ("handler", "max_new_tokens", 600, r"max_new_tokens \(600\) must be smaller than handler\.max_length"),
    ("handler", "model_path", "/etc", r"handler\.model_path: must be a path inside"),
    ("handler", "model_path", "../x", r"handler\.model_path: must be a path inside"),
    ("handler", "torch_threads", 0, r"handler\.torch_threads: must be >= 1"),
    ("micro_batching", "micro_batch_size", 16, r"micro_batch_size \(16\) is larger than batchSize \(8\).*multiple"),
    ("micro_batching", "parallelism", {"inference": 2}, r"parallelism\.inference: must be 1"),
    ("micro_batching", "parallelism", {"decode": 1}, r"parallelism\.decode: unknown key"),
    ("", "minWorkers", 3, r"minWorkers \(3\) is larger than maxWorkers \(1\)"),
    ("", "continuousBatching", True, r"continuousBatching: this handler uses micro-batching"),
    ("", "startupTimeout", 0, r"startupTimeout: must be >= 1"),
])
def test_bad_config_names_the_key(section, key, value, expected):
    with pytest.raises(ConfigError, match=expected):
        load_model_config(mutate(section, key, value))


def test_passthrough_frontend_keys_are_accepted():
    cfg = load_model_config(mutate("", "jobQueueSize", 100))
    assert cfg.frontend.batchSize == 8


def test_file_errors_name_the_file(tmp_path):
    bad = tmp_path / "bad.yaml"
    bad.write_text("handler:\n  backend: nope\n")
    with pytest.raises(ConfigError, match=r"bad\.yaml: handler\.backend"):
        load_model_config_file(str(bad))
