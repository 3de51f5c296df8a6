"""The model-config YAML, loaded into validated dataclasses.

The file has three parts, as in TorchServe's own model-config:

* top-level frontend keys (``batchSize``, ``startupTimeout``, ...) that TorchServe's Java
  frontend reads; their names are TorchServe's;
* ``handler:`` for this project's handler (backend, model path, lengths, ...);
* ``micro_batching:`` for TorchServe's ``MicroBatching`` helper.

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

BACKENDS = ("torch", "neuron")
DTYPES = ("float32", "bfloat16", "float16")
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


@dataclass
class HandlerConfig:
    """The ``handler:`` section: what this project's handler needs to load and run a model."""

    backend: str = "torch"
    model_path: str = "model"
    dtype: str = "float32"
    device: str = "auto"
    max_length: int = 512
    max_new_tokens: int = 64
    max_input_bytes: int = 65536
    torch_threads: Optional[int] = None
    warmup: bool = True

    _TYPES = {
        "backend": (str, False), "model_path": (str, False), "dtype": (str, False),
        "device": (str, False), "max_length": (int, False), "max_new_tokens": (int, False),
        "max_input_bytes": (int, False), "torch_threads": (int, True), "warmup": (bool, False),
    }

    def __post_init__(self):
        _check_fields(self, "handler.", self._TYPES)
        _check_choice("handler.backend", self.backend, BACKENDS)
        _check_choice("handler.dtype", self.dtype, DTYPES)
        _check_choice("handler.device", self.device, DEVICES)
        for key in ("max_length", "max_new_tokens", "max_input_bytes", "torch_threads"):
            _check_positive("handler.", key, getattr(self, key))
        if os.path.isabs(self.model_path) or ".." in self.model_path.split("/"):
            raise ConfigError(
                f"handler.model_path: must be a path inside the model directory, got {self.model_path!r}"
            )
        if self.max_new_tokens >= self.max_length:
            raise ConfigError(
                f"handler.max_new_tokens ({self.max_new_tokens}) must be smaller than handler.max_length "
                f"({self.max_length}), which also has to hold the prompt; lower max_new_tokens"
            )


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
class ModelConfig:
    frontend: FrontendConfig
    handler: HandlerConfig
    micro_batching: MicroBatchingConfig

    def __post_init__(self):
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
    return cls(**data)


def load_model_config(data: Optional[Mapping]) -> ModelConfig:
    """Validate a parsed model-config mapping (as TorchServe hands it to the handler)."""
    data = dict(data or {})
    handler = _section(HandlerConfig, data.pop("handler", None), "handler")
    micro = _section(MicroBatchingConfig, data.pop("micro_batching", None), "micro_batching")
    frontend_keys = [f.name for f in dataclasses.fields(FrontendConfig)]
    passthrough = {k: data.pop(k) for k in list(data) if k in PASSTHROUGH_FRONTEND_KEYS}
    _reject_unknown("", data, frontend_keys + ["handler", "micro_batching"] + sorted(passthrough))
    if passthrough.get("continuousBatching"):
        raise ConfigError(
            "continuousBatching: this handler uses micro-batching; remove continuousBatching or set it to false"
        )
    return ModelConfig(frontend=FrontendConfig(**data), handler=handler, micro_batching=micro)


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
