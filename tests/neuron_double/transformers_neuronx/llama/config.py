"""Test double of ``transformers_neuronx/llama/config.py`` (aws-neuron/transformers-neuronx).

Copies the HF config fields that shape the graphs and adds the Neuron settings
(``n_positions``, ``batch_size``, ``amp``, ``tp_degree``), like the real ``LlamaConfig``.
"""


class LlamaConfig:

    def __init__(self, config, n_positions, batch_size, amp, tp_degree, **kwargs):
        self.intermediate_size = config.intermediate_size
        self.hidden_size = config.hidden_size
        self.attention_head_size = config.hidden_size // config.num_attention_heads
        self.num_attention_heads = config.num_attention_heads
        self.num_key_value_heads = getattr(config, "num_key_value_heads", None) or config.num_attention_heads
        self.num_hidden_layers = config.num_hidden_layers
        self.vocab_size = config.vocab_size
        self.hidden_act = config.hidden_act
        self.bos_token_id = config.bos_token_id
        self.eos_token_id = config.eos_token_id
        self.max_position_embeddings = config.max_position_embeddings
        self.rms_norm_eps = config.rms_norm_eps
        self.rotary_percentage = getattr(config, "rotary_percentage", 1)
        self.rope_theta = getattr(config, "rope_theta", 10000)
        self.position_interpolation_factor = getattr(config, "position_interpolation_factor", None)
        self.rope_scaling = getattr(config, "rope_scaling", None)
        rope_type = None
        if self.rope_scaling is not None:
            rope_type = self.rope_scaling.get("rope_type", self.rope_scaling.get("type", None))
        if self.rope_scaling is not None and rope_type not in {'default', 'llama3'}:
            raise ValueError(f"Only default and llama3 ropes scaling types are currently supported. Received {rope_type}")
        self.is_eagle = getattr(config, "is_eagle", False)
        self.bias = getattr(config, "bias", True)
        for key, value in kwargs.items():  # utils.maybe_override_attributes
            if not hasattr(self, key):
                raise KeyError(f'Found invalid key "{key}".')
            if value is not None:
                setattr(self, key, value)
        self.n_positions = n_positions
        self.batch_size = batch_size
        self.amp = amp
        self.tp_degree = tp_degree
        self.model_type = 'llama'
