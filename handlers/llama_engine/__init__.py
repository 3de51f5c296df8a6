"""LLM generation for TorchServe handlers: parameters, batching, streaming, stopping, sampling.

This package knows nothing of TorchServe; ``handlers/llama_handler.py`` is the thin entry.
"""
from .config import ConfigError, ModelConfig, load_model_config, load_model_config_file
from .engine import Engine, PreparedRequest
from .errors import RequestError
from .params import SamplingParams
from .request import GenerationRequest, parse_request
from .streamer import BatchTextStreamer, GenerationResult, TokenEvent

__all__ = [
    "BatchTextStreamer", "ConfigError", "Engine", "GenerationRequest", "GenerationResult",
    "ModelConfig", "PreparedRequest", "RequestError", "SamplingParams", "TokenEvent",
    "load_model_config", "load_model_config_file", "parse_request",
]
