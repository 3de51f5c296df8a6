"""The model-config YAML, loaded into validated dataclasses.

The file has three parts, as in TorchServe's own model-config:

* top-level frontend keys (``batchSize``, ``startupTimeout``, ...) that TorchServe's Java
  frontend reads; their names are TorchServe's;
* ``handler:`` for this project's handler (backend, model path, lengths, ...);
* ``micro_batching:`` for TorchServe's ``MicroBatching`` helper, or, with TorchServe's
  ``continuousBatching: true``, ``continuous_batching:`` for the continuous scheduler (its
  slot count is ``batchSize``, so no second key can disagree with it).

Unknown keys, wrong types and contradictions raise :class:`ConfigError` with a message that
names the key and says how to fix it.
"""
from __future__ import annotations

import dataclasses
import difflib
import os
from dataclasses import dataclass, field
from typing import Any, Mapping, Optional

from .errors import ConfigError

BACKENDS = ("torch", "neuron", "llamacpp")
DTYPES = ("auto", "float32", "bfloat16", "float16")
DEVICES = ("auto", "cpu", "cuda")
STAGES = ("preprocess", "inference", "postprocess")


def _type_name(expected) -> str:
    if isinstance(expected, tuple):
        return " or ".join(t.__name__ for t in expected)
    return expected.__name__


def _check_type(section: str, key: str, value: Any, expected, optional: bool = False) -> None:
    if value is None and optional:
        return
    ok_types = expected if isinstance(expected, tuple) else (expected,)
    # bool is a subclass of int; "batchSize: true" must not pass as 1.
    if isinstance(value, bool) and bool not in ok_types:
        ok = False
    else:
        ok = isinstance(value, ok_types)
    if not ok:
        raise ConfigError(
            f"{section}{key}: expected {_type_name(expected)}{' or null' if optional else ''}, "
            f"got {type(value).__name__} {value!r}"
        )


def _check_positive(section: str, key: str, value: Optional[int], allow_zero: bool = False) -> None:
    if value is None:
        return
    if value < 0 or (value == 0 and not allow_zero):
        bound = ">= 0" if allow_zero else ">= 1"
        raise ConfigError(f"{section}{key}: must be {bound}, got {value}")


def _reject_unknown(section: str, data: Mapping, known) -> None:
    for key in data:
        if key not in known:
            hint = difflib.get_close_matches(str(key), list(known), n=1)
            fix = f"did you mean '{hint[0]}'?" if hint else f"known keys: {', '.join(sorted(known))}"
            raise ConfigError(f"{section}{key}: unknown key; {fix}")


def _check_fields(obj, section: str, types: Mapping[str, tuple]) -> None:
    for name, (expected, optional) in types.items():
        _check_type(section, name, getattr(obj, name), expected, optional)


@dataclass
class FrontendConfig:
    """Keys read by TorchServe's frontend. Validated here so a typo fails at load, not silently."""

    minWorkers: int = 1
    maxWorkers: int = 1
    batchSize: int = 1
    maxBatchDelay: int = 100
    responseTimeout: int = 120
    startupTimeout: int = 120

    _TYPES = {k: (int, False) for k in
              ("minWorkers", "maxWorkers", "batchSize", "maxBatchDelay", "responseTimeout", "startupTimeout")}

    def __post_init__(self):
        _check_fields(self, "", self._TYPES)
        for key in ("maxWorkers", "batchSize", "responseTimeout", "startupTimeout"):
            _check_positive("", key, getattr(self, key))
        for key in ("minWorkers", "maxBatchDelay"):
            _check_positive("", key, getattr(self, key), allow_zero=True)
        if self.minWorkers > self.maxWorkers:
            raise ConfigError(
                f"minWorkers ({self.minWorkers}) is larger than maxWorkers ({self.maxWorkers}); "
                "raise maxWorkers or lower minWorkers"
            )


# TorchServe frontend keys this project does not use but must not reject.
PASSTHROUGH_FRONTEND_KEYS = frozenset({
    "deviceType", "parallelType", "parallelLevel", "deviceIds", "torchrun", "maxRetryTimeoutInSec",
    "clientTimeoutInMills", "jobQueueSize", "useJobTicket", "sequenceMaxIdleMSec",
    "sequenceTimeoutMSec", "maxSequenceJobQueueSize", "maxNumSequence", "continuousBatching",
    "sequenceBatching", "asyncCommunication", "useVenv",
})


AMPS = ("f32", "f16", "bf16")
GQA_MODES = ("shard-over-heads", "shard-over-batch", "replicated-heads", "all-gather-heads")
NEURON_KEYS = frozenset({"tp_degree", "amp", "n_positions", "context_length_estimate", "neuron_cc_flags",
                         "gqa", "visible_cores", "compilation_worker_count"})
TORCH_KEYS = frozenset({"dtype", "device", "compile", "kv_cache_dtype", "weight_dtype"})
#: ``handler.weight_dtype``: the linear layers' weights; another dtype than the arithmetic's only as
#: bfloat16 weights under float32 arithmetic (the native CPU kernels widen them as they stream them), or as
#: int8 with a scale per row under float32 or bfloat16 (opt-in and lossy: half a bf16 weight's bytes).
WEIGHT_DTYPES = ("auto", "float32", "bfloat16", "int8")
LLAMACPP_KEYS = frozenset({"gguf", "gguf_type", "decode_threads", "flash_attn"})
#: ``handler.flash_attn`` (llamacpp): llama.cpp's flash attention on, off, or timed both ways at load.
FLASH_ATTN = ("auto", "on", "off")
#: GGUF tensor types the build converts to (llama.cpp's ``convert_hf_to_gguf.py --outtype``);
#: ``auto``: what ``dtype: auto`` picks on the build machine (bf16 with native bf16, else f32).
GGUF_TYPES = ("auto", "f32", "bf16", "f16", "q8_0")
KEYS_OF = {"torch": TORCH_KEYS, "neuron": NEURON_KEYS, "llamacpp": LLAMACPP_KEYS}


@dataclass
class HandlerConfig:
    """The ``handler:`` section: what this project's handler needs to load and run a model."""

    backend: str = "torch"
    model_path: str = "model"
    max_length: int = 512
    max_new_tokens: int = 64
    max_input_bytes: int = 65536
    torch_threads: Optional[int] = None
    warmup: bool = True
    # The compile cache shipped in the model directory, and whether a mismatch may recompile.
    compile_cache: str = "compile_cache"
    allow_recompile: bool = False
    # torch backend
    #: ``auto``: bfloat16 on a CPU with native bf16 (AMX, AVX512_BF16) or a GPU, float32 elsewhere.
    dtype: str = "auto"
    device: str = "auto"
    compile: bool = False
    #: ``auto``: float32 on a CPU when the weights are bf16/fp16 (attention over a half-precision cache
    #: runs several times slower there), the weights' dtype elsewhere; a dtype sets it.
    kv_cache_dtype: str = "auto"
    #: ``auto``: bfloat16 when the arithmetic is float32 on an x86 CPU and the checkpoint is stored in
    #: bf16 (nothing of it lost, half the memory, faster decode steps); else the arithmetic's dtype.
    weight_dtype: str = "auto"
    # llamacpp backend: the GGUF (in model_path) the build converts the checkpoint to, and its type
    gguf: str = "model.gguf"
    gguf_type: str = "auto"
    #: Threads for a step of one token (one stream decoding; llama.cpp's ``n_threads``, while
    #: ``torch_threads`` is its ``n_threads_batch``). ``auto``: 1 where the model's threads take
    #: every CPU and one thread's step is at most 3 ms slower than theirs (timed at load), so
    #: TorchServe's frontend keeps a core; else ``torch_threads``.
    decode_threads: Any = "auto"
    #: llama.cpp's flash attention (``flash_attn_type``). ``auto``: whichever of on and off serves
    #: requests of 256 prompt tokens and 128 new ones faster, alone and in every slot at once, timed at
    #: load; ``on`` or ``off`` sets it.
    flash_attn: str = "auto"
    # neuron backend (transformers-neuronx); the compiled batch size is micro_batch_size
    tp_degree: Optional[int] = None
    amp: str = "bf16"
    n_positions: Any = None
    context_length_estimate: Any = None
    neuron_cc_flags: str = "--model-type=transformer"
    gqa: str = "shard-over-heads"
    visible_cores: Optional[str] = None
    #: Graphs neuronx-cc compiles at once (transformers-neuronx ``NeuronConfig(compilation_worker_count)``).
    #: Each compile of a 7B graph can take several GiB of host RAM; null compiles every graph at
    #: once (the SDK's default), 1 one at a time (the safe default on a 16 GiB inf2.xlarge).
    compilation_worker_count: Optional[int] = 1

    _TYPES = {
        "backend": (str, False), "model_path": (str, False), "dtype": (str, False),
        "device": (str, False), "max_length": (int, False), "max_new_tokens": (int, False),
        "max_input_bytes": (int, False), "torch_threads": (int, True), "warmup": (bool, False),
        "compile_cache": (str, False), "allow_recompile": (bool, False), "compile": (bool, False),
        "tp_degree": (int, True), "amp": (str, False), "n_positions": ((int, list), True),
        "context_length_estimate": ((int, list), True), "neuron_cc_flags": (str, False),
        "gqa": (str, False), "visible_cores": (str, True), "compilation_worker_count": (int, True),
        "gguf": (str, False), "gguf_type": (str, False), "kv_cache_dtype": (str, False),
        "weight_dtype": (str, False), "decode_threads": ((int, str), False),
        "flash_attn": ((str, bool), False),
    }

    def __post_init__(self):
        _check_fields(self, "handler.", self._TYPES)
        _check_choice("handler.backend", self.backend, BACKENDS)
        _check_choice("handler.dtype", self.dtype, DTYPES)
        _check_choice("handler.device", self.device, DEVICES)
        _check_choice("handler.gguf_type", self.gguf_type, GGUF_TYPES)
        if isinstance(self.flash_attn, bool):  # YAML 1.1 reads a bare on / off as a boolean
            self.flash_attn = "on" if self.flash_attn else "off"
        _check_choice("handler.flash_attn", self.flash_attn, FLASH_ATTN)
        _check_choice("handler.kv_cache_dtype", self.kv_cache_dtype, DTYPES)
        _check_choice("handler.weight_dtype", self.weight_dtype, WEIGHT_DTYPES)
        if self.weight_dtype == "int8" and self.dtype == "float16":
            raise ConfigError("handler.weight_dtype int8 under dtype float16: the native CPU kernels multiply int8 "
                              "weights under float32 or bfloat16 arithmetic; set dtype: auto, float32 or bfloat16")
        if self.weight_dtype == "bfloat16" and self.dtype == "float16":
            raise ConfigError(f"handler.weight_dtype {self.weight_dtype} under dtype {self.dtype}: weights may differ "
                              "from the arithmetic only as bfloat16 under float32; set weight_dtype: auto or "
                              f"{self.dtype}")
        if self.compile and self.weight_dtype != "auto":
            raise ConfigError("handler.weight_dtype: the compiled backend (compile: true) keeps the checkpoint's "
                              "linears in dtype; remove weight_dtype or set compile: false")
        if self.compile and self.kv_cache_dtype != "auto":
            raise ConfigError("handler.kv_cache_dtype: the compiled backend (compile: true) keeps HF's static cache "
                              "in the weights' dtype; remove kv_cache_dtype or set compile: false")
        if isinstance(self.decode_threads, str) and self.decode_threads != "auto":
            raise ConfigError(f"handler.decode_threads: expected 'auto' or a number of threads, got {self.decode_threads!r}")
        if isinstance(self.decode_threads, int):
            _check_positive("handler.", "decode_threads", self.decode_threads)
        if isinstance(self.decode_threads, int) and self.torch_threads and self.decode_threads > self.torch_threads:
            raise ConfigError(f"handler.decode_threads ({self.decode_threads}) exceeds handler.torch_threads "
                              f"({self.torch_threads}), the threads of longer steps; lower decode_threads")
        for key in ("max_length", "max_new_tokens", "max_input_bytes", "torch_threads", "tp_degree",
                    "compilation_worker_count"):
            _check_positive("handler.", key, getattr(self, key))
        for key in ("model_path", "compile_cache", "gguf"):
            _check_relative(key, getattr(self, key))
        if self.max_new_tokens >= self.max_length:
            raise ConfigError(
                f"handler.max_new_tokens ({self.max_new_tokens}) must be smaller than handler.max_length "
                f"({self.max_length}), which also has to hold the prompt; lower max_new_tokens"
            )
        if self.backend == "neuron":
            self._check_neuron()

    def _check_neuron(self) -> None:
        if self.tp_degree is None:
            raise ConfigError("handler.tp_degree: required for backend neuron (NeuronCores per model, e.g. 2 on inf2.xlarge)")
        _check_choice("handler.amp", self.amp, AMPS)
        _check_choice("handler.gqa", self.gqa, GQA_MODES)
        if self.n_positions is None:
            self.n_positions = [self.max_length]
        self.n_positions = _buckets("n_positions", self.n_positions)
        if self.context_length_estimate is None:
            raise ConfigError("handler.context_length_estimate: required for backend neuron; list the prompt-length "
                              "buckets to compile, e.g. [128, 256, 512]")
        self.context_length_estimate = _buckets("context_length_estimate", self.context_length_estimate)
        largest = self.n_positions[-1]
        if self.max_length > largest:
            raise ConfigError(f"handler.max_length ({self.max_length}) exceeds the largest n_positions bucket "
                              f"({largest}); raise n_positions or lower max_length")
        if self.context_length_estimate[-1] >= largest:
            raise ConfigError(f"handler.context_length_estimate: the largest bucket ({self.context_length_estimate[-1]}) "
                              f"must be smaller than the largest n_positions ({largest}) to leave room for tokens")
        if self.visible_cores is not None and not _core_range(self.visible_cores):
            raise ConfigError(f"handler.visible_cores: expected a core or a range like '0-11', got {self.visible_cores!r}")
        if "--cache_dir" in self.neuron_cc_flags:
            raise ConfigError("handler.neuron_cc_flags: --cache_dir would send the compiler to another cache than the "
                              "one the handler sets up (NEURON_COMPILE_CACHE_URL); remove it")


def _check_relative(key: str, value: str) -> None:
    if os.path.isabs(value) or ".." in value.split("/"):
        raise ConfigError(f"handler.{key}: must be a path inside the model directory, got {value!r}")


def _buckets(key: str, value) -> list:
    values = value if isinstance(value, list) else [value]
    if not values or not all(isinstance(v, int) and not isinstance(v, bool) and v > 0 for v in values):
        raise ConfigError(f"handler.{key}: expected a positive integer or a list of them, got {value!r}")
    return sorted(set(values))


def _core_range(text: str) -> Optional[range]:
    parts = text.split("-")
    if not all(p.isdigit() for p in parts) or len(parts) > 2:
        return None
    first, last = int(parts[0]), int(parts[-1])
    return range(first, last + 1) if last >= first else None


def _check_choice(key: str, value: str, choices) -> None:
    if value not in choices:
        raise ConfigError(f"{key}: must be one of {', '.join(choices)}, got {value!r}")


@dataclass
class MicroBatchingConfig:
    micro_batch_size: int = 1
    parallelism: dict = field(default_factory=lambda: {s: 1 for s in STAGES})

    def __post_init__(self):
        _check_type("micro_batching.", "micro_batch_size", self.micro_batch_size, int)
        _check_positive("micro_batching.", "micro_batch_size", self.micro_batch_size)
        _check_type("micro_batching.", "parallelism", self.parallelism, dict)
        _reject_unknown("micro_batching.parallelism.", self.parallelism, STAGES)
        merged = {s: 1 for s in STAGES}
        for stage, threads in self.parallelism.items():
            _check_type("micro_batching.parallelism.", stage, threads, int)
            _check_positive("micro_batching.parallelism.", stage, threads)
            merged[stage] = threads
        if merged["inference"] != 1:
            raise ConfigError(
                "micro_batching.parallelism.inference: must be 1, because one model instance "
                f"runs one micro-batch at a time (got {merged['inference']}); use more workers instead"
            )
        self.parallelism = merged


@dataclass
class ContinuousBatchingConfig:
    """The ``continuous_batching:`` section. The slot count is the frontend's ``batchSize``."""

    #: Prompt tokens prefilled per scheduler step, over all admissions: a longer prompt is
    #: prefilled in chunks, so that it stalls the running streams by one chunk per step.
    max_prefill_tokens_per_step: int = 256
    #: Run the scheduler's steps in a thread of their own, so that the model keeps stepping
    #: while the step before makes its round trip through TorchServe's frontend; each handler
    #: call returns what the steps since the last call produced. False: each call runs
    #: ``steps_per_call`` steps itself and the model waits for the frontend between calls.
    overlap_round_trips: bool = True
    #: With ``overlap_round_trips: false``, scheduler steps per call. The frontend hands new
    #: requests to the handler only between calls, so more steps per call trade admission
    #: latency for fewer round trips. A call also ends as soon as a request finishes.
    steps_per_call: int = 1

    _TYPES = {"max_prefill_tokens_per_step": (int, False), "overlap_round_trips": (bool, False),
              "steps_per_call": (int, False)}

    def __post_init__(self):
        _check_fields(self, "continuous_batching.", self._TYPES)
        for key in ("max_prefill_tokens_per_step", "steps_per_call"):
            _check_positive("continuous_batching.", key, getattr(self, key))
        if self.overlap_round_trips and self.steps_per_call != 1:
            raise ConfigError(
                f"continuous_batching.steps_per_call: {self.steps_per_call} applies only with "
                "overlap_round_trips: false (with it on, the step thread runs as many steps as the "
                "frontend's round trip allows); set overlap_round_trips: false or remove steps_per_call")


@dataclass
class SageMakerConfig:
    """The ``sagemaker:`` section: what `make deploy` needs to size an endpoint for this model."""

    instance_type: str = "ml.m5.xlarge"
    volume_size_gb: int = 30
    model_data_download_timeout: int = 600
    container_startup_health_check_timeout: int = 600

    _TYPES = {"instance_type": (str, False), "volume_size_gb": (int, False),
              "model_data_download_timeout": (int, False), "container_startup_health_check_timeout": (int, False)}

    def __post_init__(self):
        _check_fields(self, "sagemaker.", self._TYPES)
        if not self.instance_type.startswith("ml."):
            raise ConfigError(f"sagemaker.instance_type: SageMaker instance types start with 'ml.', "
                              f"got {self.instance_type!r} (e.g. ml.inf2.xlarge)")
        for key in ("volume_size_gb", "model_data_download_timeout", "container_startup_health_check_timeout"):
            _check_positive("sagemaker.", key, getattr(self, key))
        if not 60 <= self.container_startup_health_check_timeout <= 3600:
            raise ConfigError("sagemaker.container_startup_health_check_timeout: SageMaker accepts 60 to 3600 s, "
                              f"got {self.container_startup_health_check_timeout}")
        if not 60 <= self.model_data_download_timeout <= 3600:
            raise ConfigError("sagemaker.model_data_download_timeout: SageMaker accepts 60 to 3600 s, "
                              f"got {self.model_data_download_timeout}")


@dataclass
class ModelConfig:
    frontend: FrontendConfig
    handler: HandlerConfig
    micro_batching: MicroBatchingConfig
    sagemaker: SageMakerConfig = field(default_factory=SageMakerConfig)
    #: Set when TorchServe's ``continuousBatching: true`` selects continuous batching.
    continuous_batching: Optional[ContinuousBatchingConfig] = None

    @property
    def continuous(self) -> bool:
        return self.continuous_batching is not None

    @property
    def slots(self) -> int:
        """Sequences generated at once: the continuous slots, else one micro-batch."""
        return self.frontend.batchSize if self.continuous else self.micro_batching.micro_batch_size

    def __post_init__(self):
        if self.continuous and self.handler.backend == "torch" and self.handler.compile:
            raise ConfigError("handler.compile: not supported with continuousBatching yet; set compile: false, "
                              "or continuousBatching: false to use micro-batching")
        if self.continuous and self.handler.backend == "neuron" and self.frontend.batchSize < 2:
            raise ConfigError(
                f"batchSize ({self.frontend.batchSize}): continuous batching on Neuron needs at least 2 slots; "
                "transformers-neuronx cannot compile the graph that writes a prompt into a KV cache of one sequence "
                "(fused_kv_update_cache raises NotImplementedError in to_neuron). Set batchSize: 2 or more, or "
                "continuousBatching: false to serve one sequence at a time")
        if self.handler.backend == "neuron" and self.frontend.maxWorkers > 1:
            raise ConfigError(
                f"maxWorkers ({self.frontend.maxWorkers}): each Neuron worker holds its tp_degree NeuronCores "
                "exclusively; use maxWorkers: 1 and one model (config with its own handler.visible_cores) per core group")
        if self.micro_batching.micro_batch_size > self.frontend.batchSize:
            raise ConfigError(
                f"micro_batching.micro_batch_size ({self.micro_batching.micro_batch_size}) is larger "
                f"than batchSize ({self.frontend.batchSize}): a micro-batch can never fill; "
                "set batchSize to a multiple of micro_batch_size"
            )


def _section(cls, data: Any, name: str):
    if data is None:
        data = {}
    if not isinstance(data, Mapping):
        raise ConfigError(f"{name}: expected a mapping, got {type(data).__name__}")
    known = [f.name for f in dataclasses.fields(cls)]
    _reject_unknown(f"{name}.", data, known)
    if cls is HandlerConfig:
        _reject_other_backend_keys(data)
    return cls(**data)


def _reject_other_backend_keys(data: Mapping) -> None:
    backend = data.get("backend", "torch")
    if backend not in KEYS_OF:
        return  # HandlerConfig names the valid backends
    for key in data:
        owner = next((name for name, keys in KEYS_OF.items() if key in keys), backend)
        if owner != backend:
            raise ConfigError(f"handler.{key}: applies only to backend {owner}, but backend is {backend}; "
                              f"remove it or set handler.backend: {owner}")


def load_model_config(data: Optional[Mapping]) -> ModelConfig:
    """Validate a parsed model-config mapping (as TorchServe hands it to the handler)."""
    data = dict(data or {})
    has_micro, has_continuous = "micro_batching" in data, "continuous_batching" in data
    handler = _section(HandlerConfig, data.pop("handler", None), "handler")
    micro = _section(MicroBatchingConfig, data.pop("micro_batching", None), "micro_batching")
    continuous = _section(ContinuousBatchingConfig, data.pop("continuous_batching", None), "continuous_batching")
    sagemaker = _section(SageMakerConfig, data.pop("sagemaker", None), "sagemaker")
    frontend_keys = [f.name for f in dataclasses.fields(FrontendConfig)]
    passthrough = {k: data.pop(k) for k in list(data) if k in PASSTHROUGH_FRONTEND_KEYS}
    _reject_unknown("", data, frontend_keys + ["handler", "micro_batching", "continuous_batching", "sagemaker"]
                    + sorted(passthrough))
    mode = _batching_mode(passthrough, has_micro, has_continuous)
    return ModelConfig(frontend=FrontendConfig(**data), handler=handler, micro_batching=micro, sagemaker=sagemaker,
                       continuous_batching=continuous if mode == "continuous" else None)


def _batching_mode(passthrough: Mapping, has_micro: bool, has_continuous: bool) -> str:
    """``continuous`` when TorchServe's ``continuousBatching`` is on, else ``micro``; sections must agree."""
    flag = passthrough.get("continuousBatching", False)
    _check_type("", "continuousBatching", flag, bool)
    for key in ("asyncCommunication", "sequenceBatching"):
        if passthrough.get(key):
            raise ConfigError(f"{key}: this handler does not support it; use continuousBatching: true for "
                              "continuous batching, or remove the key for micro-batching")
    if flag and has_micro:
        raise ConfigError("micro_batching: applies to micro-batching, but continuousBatching is true; remove the "
                          "micro_batching section (the slot count is batchSize) or set continuousBatching: false")
    if not flag and has_continuous:
        raise ConfigError("continuous_batching: applies only with continuousBatching: true at the top level; "
                          "add it, or remove the continuous_batching section")
    return "continuous" if flag else "micro"


def load_model_config_file(path: str) -> ModelConfig:
    import yaml

    with open(path, encoding="utf-8") as f:
        try:
            data = yaml.safe_load(f)
        except yaml.YAMLError as exc:
            raise ConfigError(f"{path}: not valid YAML: {exc}") from exc
    try:
        return load_model_config(data)
    except ConfigError as exc:
        raise ConfigError(f"{path}: {exc}") from exc
