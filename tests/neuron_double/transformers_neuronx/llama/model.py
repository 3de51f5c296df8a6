"""Test double of ``transformers_neuronx/llama/model.py`` (aws-neuron/transformers-neuronx, 0.13.x):
``LlamaForSampling``.

Same constructor, ``forward`` and ``sample`` signatures and defaults as the real class.
Like the real one it silently accepts unknown constructor keywords; the double records
them in ``model.ignored_kwargs`` so that a test can assert that none were passed.
Numerics come from an HF ``LlamaForCausalLM`` (see ``decoder.py``); compilation is
simulated (see ``base.py`` and ``compiler.py``).
"""
import warnings

import transformers

from transformers_neuronx import base, bucket, sampling
from transformers_neuronx.config import NeuronConfig
from transformers_neuronx.constants import KV_SHARD_PAD
from transformers_neuronx.llama.config import LlamaConfig

_AMP = ('f32', 'f16', 'bf16')


def _check_sizes(name, value, allow_none=False):
    """``value`` must be an int or a non-empty list of ints (or None when allowed)."""
    if value is None and allow_none:
        return
    items = value if isinstance(value, list) else [value]
    if not items or not all(isinstance(v, int) and not isinstance(v, bool) for v in items):
        raise TypeError(f"{name} must be an int or a list of ints, got {value!r}")


class LlamaForSampling(base.NeuronModelBase):

    _hf_model_class = transformers.LlamaForCausalLM

    def __init__(self, config, *, n_positions=2048, batch_size=1, amp='f32', tp_degree=2,
                 context_length_estimate=None, context_unroll=None, unroll=None,
                 neuron_config=None, prefixed_length=0, **kwargs):
        super().__init__()
        if amp not in _AMP:
            raise ValueError(f"amp={amp!r} is not supported; use one of {list(_AMP)}")
        _check_sizes("batch_size", batch_size)
        _check_sizes("n_positions", n_positions)
        _check_sizes("context_length_estimate", context_length_estimate, allow_none=True)
        self.ignored_kwargs = dict(kwargs)
        self._hf_config = config
        config = LlamaConfig(config, n_positions, batch_size, amp, tp_degree)
        self.context_pre_hook = None
        self.context_hook = None
        self.config = config
        self.neuron_config = neuron_config if neuron_config else NeuronConfig()
        if self.neuron_config.shard_over_sequence:
            warnings.warn(f"shard over sequence enabled, increasing n_positions {n_positions} by 128")
            if isinstance(n_positions, list):
                n_positions = sorted(n_positions)
                n_positions[-1] += KV_SHARD_PAD
            else:
                n_positions = n_positions + KV_SHARD_PAD
            config.n_positions = n_positions
        if self.neuron_config.on_device_generation:
            self.neuron_config.on_device_generation.vocab_size = config.vocab_size
        self.layers_after_partition = self.neuron_config.auto_layer_partition(config.num_hidden_layers)
        self.prefixed_length = prefixed_length
        self.context_unroll = len(self.layers_after_partition) if context_unroll is None else context_unroll
        self.unroll = len(self.layers_after_partition) if unroll is None else unroll
        self.token_buckets = bucket.token_sizes(n_positions)
        self.context_buckets = bucket.context_sizes(context_length_estimate, self.token_buckets)
        self._check_sequence_parallel(neuron_config)
        if prefixed_length and prefixed_length not in self.context_buckets:
            self.context_buckets = sorted(self.context_buckets + [prefixed_length])
        self.batch_sizes = bucket.batch_sizes(batch_size)
        self.context_batch_sizes = [1] if self.neuron_config.continuous_batching else self.batch_sizes
        self._init_runtime_state()

    def _check_sequence_parallel(self, neuron_config):
        if neuron_config and neuron_config.sequence_parallel_norm:
            for size in self.context_buckets:
                if size > neuron_config.sequence_parallel_norm_threshold and size % self.config.tp_degree != 0:
                    raise ValueError(
                        f"Sequence parallel normalization requires the bucket size ({size}) to be divisible "
                        f"by the tensor parallel degree ({self.config.tp_degree})")

    def set_prefixed(self, input_ids):
        self.prefixed_input_ids = input_ids[:, :self.prefixed_length]
        prefixed_length = self.prefixed_length
        self.prefixed_length = 0
        self.forward(self.prefixed_input_ids)
        self.prefixed_length = prefixed_length

    def forward(self, input_ids, cache_ids=None, start_ids=None, last_token_id=None, input_embeddings=None, **kwargs):
        """Logits ``[B, vocab]`` of the last position (tokens ``[B, 1]`` with on-device generation)."""
        return self._forward_impl(input_ids, cache_ids, start_ids, last_token_id, input_embeddings)

    def sample(self, input_ids, sequence_length, cache_ids=None, start_ids=None,
               top_k=50, top_p=1.0, eos_token_override=None, temperature=1.0, streamer=None,
               stopping_criteria_list=None, no_repeat_ngram_size=None, **kwargs):
        """Prompt plus new tokens, ``[B, <= sequence_length]`` (``sequence_length`` counts the prompt).

        Unknown keywords are ignored like the real method does; the double keeps the last
        call's in ``self.ignored_sample_kwargs``.
        """
        self.ignored_sample_kwargs = dict(kwargs)
        if self.neuron_config.on_device_generation:
            return sampling.sample_tokens(self, input_ids, start_ids, sequence_length=sequence_length,
                                          config=self.neuron_config.on_device_generation, streamer=streamer,
                                          cache_ids=cache_ids)
        if self.context_pre_hook is not None:
            self.context_pre_hook()
        batch_size, context_length = input_ids.shape
        if batch_size not in self.batch_sizes:
            raise ValueError(f"Model not compiled for batch_size : {batch_size}. "
                             f"Acceptable batch_size is one of the following {self.batch_sizes}")
        prefixed_length = self.prefixed_length
        if context_length < prefixed_length:
            self.prefixed_length = 0
        else:
            input_ids = input_ids[:, prefixed_length:]
            sequence_length -= prefixed_length
        return sampling.sample_llama(
            self, input_ids, start_ids, sequence_length,
            eos_token_id=self.config.eos_token_id if eos_token_override is None else eos_token_override,
            top_k=top_k, top_p=top_p, temperature=temperature, streamer=streamer,
            stopping_criteria_list=stopping_criteria_list, no_repeat_ngram_size=no_repeat_ngram_size,
            cache_ids=cache_ids)
