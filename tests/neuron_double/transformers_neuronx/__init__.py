"""Test double of ``transformers_neuronx/__init__.py`` (aws-neuron/transformers-neuronx, 0.13.x).

A CPU stand-in for the Neuron SDK's transformers-neuronx, for tests on machines without
Inferentia: the same public names, signatures and failure modes for what the project
uses, Llama numerics delegated to Hugging Face transformers, and a simulated Neuron
persistent compile cache.  See ``tests/neuron_double/README.md``.

Extra (double-only) names: ``compiler_stats`` (process-wide cache hit/miss counters)
and ``reset_compiler_stats()``.
"""
from transformers_neuronx.version import __version__

from transformers_neuronx.constants import GQA, Layout
from transformers_neuronx.config import NeuronConfig, ContinuousBatchingConfig, GenerationConfig
from transformers_neuronx.compiler import compiler_stats, reset_compiler_stats
from transformers_neuronx.generation_utils import HuggingFaceGenerationModelAdapter
from transformers_neuronx.llama.model import LlamaForSampling
from transformers_neuronx.modeling_auto import NeuronAutoModelForCausalLM

__all__ = [
    "__version__", "GQA", "Layout", "NeuronConfig", "ContinuousBatchingConfig", "GenerationConfig",
    "HuggingFaceGenerationModelAdapter", "LlamaForSampling", "NeuronAutoModelForCausalLM",
    "compiler_stats", "reset_compiler_stats",
]
