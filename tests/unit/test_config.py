from pathlib import Path

import pytest
import yaml

from llama_engine import ConfigError, load_model_config, load_model_config_file
from llama_engine.config import TORCH_KEYS

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
    ("handler", "backend", "tpu", r"handler\.backend: must be one of torch, neuron, llamacpp"),
    ("handler", "dtype", "fp8", r"handler\.dtype: must be one of"),
    ("handler", "max_new_tokens", 600, r"max_new_tokens \(600\) must be smaller than handler\.max_length"),
    ("handler", "model_path", "/etc", r"handler\.model_path: must be a path inside"),
    ("handler", "model_path", "../x", r"handler\.model_path: must be a path inside"),
    ("handler", "torch_threads", 0, r"handler\.torch_threads: must be >= 1"),
    ("micro_batching", "micro_batch_size", 16, r"micro_batch_size \(16\) is larger than batchSize \(8\).*multiple"),
    ("micro_batching", "parallelism", {"inference": 2}, r"parallelism\.inference: must be 1"),
    ("micro_batching", "parallelism", {"decode": 1}, r"parallelism\.decode: unknown key"),
    ("", "minWorkers", 3, r"minWorkers \(3\) is larger than maxWorkers \(1\)"),
    ("", "continuousBatching", True, r"micro_batching: applies to micro-batching, but continuousBatching is true"),
    ("", "continuousBatching", "yes", r"continuousBatching: expected bool"),
    ("", "asyncCommunication", True, r"asyncCommunication: this handler does not support it"),
    ("", "continuous_batching", {}, r"continuous_batching: applies only with continuousBatching: true"),
    ("", "startupTimeout", 0, r"startupTimeout: must be >= 1"),
])
def test_bad_config_names_the_key(section, key, value, expected):
    with pytest.raises(ConfigError, match=expected):
        load_model_config(mutate(section, key, value))


def continuous_base(**section):
    data = base()
    del data["micro_batching"]
    data["continuousBatching"] = True
    if section:
        data["continuous_batching"] = section
    return data


def test_continuous_mode_takes_its_slot_count_from_batch_size():
    cfg = load_model_config(continuous_base(max_prefill_tokens_per_step=64))
    assert cfg.continuous and cfg.slots == 8
    assert cfg.continuous_batching.max_prefill_tokens_per_step == 64
    assert cfg.continuous_batching.steps_per_call == 1
    assert cfg.continuous_batching.overlap_round_trips is True
    micro = load_model_config(base())
    assert not micro.continuous and micro.slots == micro.micro_batching.micro_batch_size


@pytest.mark.parametrize("section,expected", [
    ({"max_slots": 4}, r"continuous_batching\.max_slots: unknown key"),
    ({"max_prefill_tokens_per_step": 0}, r"continuous_batching\.max_prefill_tokens_per_step: must be >= 1"),
    ({"steps_per_call": "2"}, r"continuous_batching\.steps_per_call: expected int"),
    ({"overlap_round_trips": "yes"}, r"continuous_batching\.overlap_round_trips: expected bool"),
    ({"steps_per_call": 4}, r"continuous_batching\.steps_per_call: 4 applies only with overlap_round_trips: false.*"
                            r"set overlap_round_trips: false or remove steps_per_call"),
])
def test_bad_continuous_section_names_the_key(section, expected):
    with pytest.raises(ConfigError, match=expected):
        load_model_config(continuous_base(**section))


def test_steps_per_call_holds_with_the_steps_in_the_handlers_thread():
    cfg = load_model_config(continuous_base(overlap_round_trips=False, steps_per_call=4))
    assert not cfg.continuous_batching.overlap_round_trips and cfg.continuous_batching.steps_per_call == 4


@pytest.mark.parametrize("handler,expected", [
    ({"backend": "llamacpp", "decode_threads": "many"}, r"handler\.decode_threads: expected 'auto' or a number"),
    ({"backend": "llamacpp", "decode_threads": 0}, r"handler\.decode_threads: must be >= 1"),
    ({"backend": "llamacpp", "torch_threads": 2, "decode_threads": 3},
     r"handler\.decode_threads \(3\) exceeds handler\.torch_threads \(2\).*lower decode_threads"),
    ({"decode_threads": 1}, r"handler\.decode_threads: applies only to backend llamacpp"),
])
def test_bad_decode_threads_names_the_key(handler, expected):
    data = base()
    data["handler"] = {k: v for k, v in data["handler"].items() if k not in TORCH_KEYS} | handler
    with pytest.raises(ConfigError, match=expected):
        load_model_config(data)


def test_decode_threads_defaults_to_auto():
    data = base()
    data["handler"] = {k: v for k, v in data["handler"].items() if k not in TORCH_KEYS} | {"backend": "llamacpp"}
    assert load_model_config(data).handler.decode_threads == "auto"
    data["handler"]["decode_threads"] = 1
    assert load_model_config(data).handler.decode_threads == 1


@pytest.mark.parametrize("value,expected", [("auto", "auto"), ("on", "on"), ("off", "off"), (True, "on"), (False, "off")])
def test_flash_attn_takes_llama_cpps_settings_and_yamls_bare_on_and_off(value, expected):
    data = base()
    data["handler"] = {k: v for k, v in data["handler"].items() if k not in TORCH_KEYS} | {"backend": "llamacpp"}
    assert load_model_config(data).handler.flash_attn == "auto"
    data["handler"]["flash_attn"] = value
    assert load_model_config(data).handler.flash_attn == expected


def test_flash_attn_from_a_yaml_file_with_bare_off(tmp_path):
    data = base()
    data["handler"] = {k: v for k, v in data["handler"].items() if k not in TORCH_KEYS} | {"backend": "llamacpp"}
    path = tmp_path / "c.yaml"
    path.write_text(yaml.safe_dump(data).replace("handler:\n", "handler:\n  flash_attn: off\n", 1))
    assert load_model_config_file(str(path)).handler.flash_attn == "off"


@pytest.mark.parametrize("handler,expected", [
    ({"backend": "llamacpp", "flash_attn": "fast"}, r"handler\.flash_attn: must be one of auto, on, off, got 'fast'"),
    ({"flash_attn": "off"}, r"handler\.flash_attn: applies only to backend llamacpp"),
])
def test_bad_flash_attn_names_the_key(handler, expected):
    data = base()
    data["handler"] = {k: v for k, v in data["handler"].items() if k not in TORCH_KEYS} | handler
    with pytest.raises(ConfigError, match=expected):
        load_model_config(data)


def test_continuous_mode_rejects_compile():
    data = continuous_base()
    data["handler"]["compile"] = True
    with pytest.raises(ConfigError, match=r"handler\.compile: not supported with continuousBatching"):
        load_model_config(data)


def test_passthrough_frontend_keys_are_accepted():
    cfg = load_model_config(mutate("", "jobQueueSize", 100))
    assert cfg.frontend.batchSize == 8


def test_file_errors_name_the_file(tmp_path):
    bad = tmp_path / "bad.yaml"
    bad.write_text("handler:\n  backend: nope\n")
    with pytest.raises(ConfigError, match=r"bad\.yaml: handler\.backend"):
        load_model_config_file(str(bad))


def neuron_base():
    return yaml.safe_load((ROOT / "model-config" / "llama-2-7b-inf2-xlarge-b4.yaml").read_text())


def test_neuron_config_normalises_buckets():
    data = neuron_base()
    data["handler"]["n_positions"] = 2048
    data["handler"]["context_length_estimate"] = [1024, 256, 512, 256]
    cfg = load_model_config(data)
    assert cfg.handler.n_positions == [2048]
    assert cfg.handler.context_length_estimate == [256, 512, 1024]  # the last caps prompts (NeuronBackend)


@pytest.mark.parametrize("key,value,expected", [
    ("tp_degree", None, r"handler\.tp_degree: required for backend neuron"),
    ("amp", "fp32", r"handler\.amp: must be one of f32, f16, bf16"),
    ("gqa", "sharded", r"handler\.gqa: must be one of"),
    ("n_positions", [0], r"handler\.n_positions: expected a positive integer"),
    ("context_length_estimate", None, r"context_length_estimate: required for backend neuron"),
    ("context_length_estimate", [4096], r"largest bucket \(4096\) must be smaller than the largest n_positions \(2048\)"),
    ("max_length", 4096, r"max_length \(4096\) exceeds the largest n_positions bucket \(2048\)"),
    ("visible_cores", "a-b", r"handler\.visible_cores: expected a core or a range"),
    ("dtype", "bfloat16", r"handler\.dtype: applies only to backend torch, but backend is neuron"),
    ("compile", True, r"handler\.compile: applies only to backend torch"),
    ("compilation_worker_count", 0, r"handler\.compilation_worker_count: must be >= 1"),
    ("compilation_worker_count", "2", r"handler\.compilation_worker_count: expected int or null"),
    ("neuron_cc_flags", "--model-type=transformer --cache_dir=/tmp/c", r"handler\.neuron_cc_flags: --cache_dir"),
])
def test_bad_neuron_config(key, value, expected):
    data = neuron_base()
    data["handler"][key] = value
    with pytest.raises(ConfigError, match=expected):
        load_model_config(data)


def test_neuron_keys_on_the_torch_backend_are_rejected():
    data = base()
    data["handler"]["tp_degree"] = 2
    with pytest.raises(ConfigError, match=r"handler\.tp_degree: applies only to backend neuron, but backend is torch"):
        load_model_config(data)
    data = base()
    data["handler"]["compilation_worker_count"] = 2
    with pytest.raises(ConfigError, match=r"handler\.compilation_worker_count: applies only to backend neuron"):
        load_model_config(data)


def test_compilation_worker_count_defaults_to_one_compile_at_a_time():
    data = neuron_base()
    del data["handler"]["compilation_worker_count"]
    assert load_model_config(data).handler.compilation_worker_count == 1
    data["handler"]["compilation_worker_count"] = None  # every graph at once, the SDK's default
    assert load_model_config(data).handler.compilation_worker_count is None


@pytest.mark.parametrize("path", sorted((ROOT / "model-config").glob("*inf2-xlarge*.yaml")), ids=lambda p: p.name)
def test_7b_configs_for_inf2_xlarge_compile_one_graph_at_a_time(path):
    """A 16 GiB inf2.xlarge cannot run several 7B compiles next to the checkpoint."""
    assert load_model_config_file(str(path)).handler.compilation_worker_count == 1


def test_continuous_batching_on_neuron_needs_two_slots():
    data = yaml.safe_load((ROOT / "model-config" / "llama-2-7b-inf2-xlarge-continuous.yaml").read_text())
    data["batchSize"] = 1
    with pytest.raises(ConfigError, match=r"batchSize \(1\): continuous batching on Neuron needs at least 2 slots.*"
                                          r"fused_kv_update_cache.*Set batchSize: 2 or more"):
        load_model_config(data)
    data["batchSize"] = 2
    assert load_model_config(data).slots == 2


def test_neuron_with_several_workers_is_rejected():
    data = neuron_base()
    data["maxWorkers"] = 2
    with pytest.raises(ConfigError, match=r"maxWorkers \(2\): each Neuron worker holds"):
        load_model_config(data)


@pytest.mark.parametrize("path", sorted((ROOT / "model-config").glob("*.yaml")), ids=lambda p: p.name)
def test_every_shipped_config_leaves_time_to_load(path):
    cfg = load_model_config_file(str(path))
    floor = 600 if cfg.handler.backend == "neuron" or cfg.handler.compile else 120
    assert cfg.frontend.startupTimeout >= floor


def llamacpp_base():
    return yaml.safe_load((ROOT / "model-config" / "tiny-llama-llamacpp.yaml").read_text())


def test_llamacpp_config_defaults():
    data = llamacpp_base()
    del data["handler"]["gguf"], data["handler"]["gguf_type"]
    cfg = load_model_config(data)
    assert (cfg.handler.backend, cfg.handler.gguf, cfg.handler.gguf_type) == ("llamacpp", "model.gguf", "auto")


@pytest.mark.parametrize("key,value,expected", [
    ("gguf_type", "q4_k", r"handler\.gguf_type: must be one of auto, f32, bf16, f16, q8_0"),
    ("gguf", "../elsewhere.gguf", r"gguf"),
    ("dtype", "float32", r"handler\.dtype: applies only to backend torch, but backend is llamacpp"),
    ("tp_degree", 2, r"handler\.tp_degree: applies only to backend neuron, but backend is llamacpp"),
    ("kv_cache_dtype", "float32", r"handler\.kv_cache_dtype: applies only to backend torch, but backend is llamacpp"),
])
def test_bad_llamacpp_config(key, value, expected):
    data = llamacpp_base()
    data["handler"][key] = value
    with pytest.raises(ConfigError, match=expected):
        load_model_config(data)


@pytest.mark.parametrize("backend", ["torch", "neuron"])
def test_gguf_keys_on_other_backends_are_rejected(backend):
    data = neuron_base() if backend == "neuron" else base()
    data["handler"]["gguf_type"] = "f32"
    with pytest.raises(ConfigError, match=rf"handler\.gguf_type: applies only to backend llamacpp, but backend is {backend}"):
        load_model_config(data)


def test_kv_cache_dtype_is_auto_by_default_and_takes_a_dtype():
    assert load_model_config(base()).handler.kv_cache_dtype == "auto"
    data = base()
    data["handler"]["kv_cache_dtype"] = "bfloat16"
    assert load_model_config(data).handler.kv_cache_dtype == "bfloat16"


@pytest.mark.parametrize("extra,expected", [
    ({"kv_cache_dtype": "int8"}, r"handler\.kv_cache_dtype: must be one of auto, float32, bfloat16, float16, got 'int8'"),
    ({"kv_cache_dtype": "float32", "compile": True}, r"handler\.kv_cache_dtype: the compiled backend .* set compile: false"),
])
def test_bad_kv_cache_dtype(extra, expected):
    data = base()
    data["handler"].update(extra)
    with pytest.raises(ConfigError, match=expected):
        load_model_config(data)


def test_weight_dtype_is_auto_by_default_and_takes_float32_bfloat16_or_int8():
    assert load_model_config(base()).handler.weight_dtype == "auto"
    for value in ("float32", "bfloat16", "int8"):
        data = base()
        data["handler"].update(dtype="float32", weight_dtype=value)
        assert load_model_config(data).handler.weight_dtype == value


@pytest.mark.parametrize("changes,expected", [
    ({"weight_dtype": "int4"}, r"handler\.weight_dtype: must be one of auto, float32, bfloat16, int8, got 'int4'"),
    ({"weight_dtype": "float16"}, r"handler\.weight_dtype: must be one of"),
    ({"dtype": "float16", "weight_dtype": "bfloat16"}, r"handler\.weight_dtype bfloat16 under dtype float16: .* set "
                                                       r"weight_dtype: auto or float16"),
    ({"compile": True, "weight_dtype": "bfloat16"}, r"handler\.weight_dtype: the compiled backend .* set compile: false"),
    ({"dtype": "float16", "weight_dtype": "int8"}, r"handler\.weight_dtype int8 under dtype float16: .* set dtype: "
                                                   r"auto, float32 or bfloat16"),
    ({"compile": True, "weight_dtype": "int8"}, r"handler\.weight_dtype: the compiled backend .* set compile: false"),
])
def test_bad_weight_dtype_names_the_key_and_the_fix(changes, expected):
    data = base()
    data["handler"].update(changes)
    with pytest.raises(ConfigError, match=expected):
        load_model_config(data)


def test_weight_dtype_is_a_torch_key():
    data = llamacpp_base()
    data["handler"]["weight_dtype"] = "bfloat16"
    with pytest.raises(ConfigError, match=r"handler\.weight_dtype: applies only to backend torch, but backend is llamacpp"):
        load_model_config(data)
