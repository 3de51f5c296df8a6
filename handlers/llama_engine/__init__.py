"""LLM generation for TorchServe handlers: parameters, batching, streaming, stopping, sampling.

This package knows nothing of TorchServe; ``handlers/llama_handler.py`` is the thin entry.
The parts that need torch are imported on first use, so tools that only read a model-config
(deploy, upload) start without loading torch.
"""
from importlib import import_module

from .config import ConfigError, ModelConfig, load_model_config, load_model_config_file
from .errors import RequestError
from .params import SamplingParams
from .request import GenerationRequest, parse_request

_LAZY = {"Engine": ".engine", "PreparedRequest": ".lifecycle", "BatchTextStreamer": ".streamer",
         "GenerationResult": ".streamer", "TokenEvent": ".streamer"}


def __getattr__(name):
    if name in _LAZY:
        return getattr(import_module(_LAZY[name], __name__), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


__all__ = [
    "BatchTextStreamer", "ConfigError", "Engine", "GenerationRequest", "GenerationResult",
    "ModelConfig", "PreparedRequest", "RequestError", "SamplingParams", "TokenEvent",
    "load_model_config", "load_model_config_file", "parse_request",
]
