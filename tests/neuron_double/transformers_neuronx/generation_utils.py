"""Test double of ``transformers_neuronx/generation_utils.py`` (aws-neuron/transformers-neuronx).

``HuggingFaceGenerationModelAdapter(config, model)`` lets HF ``generate()`` drive a Neuron
model: the attention mask becomes ``start_ids`` (index of each row's first real token),
the first call encodes the whole prompt, later calls feed the last token at the next
cache position.  ``generate()`` resets that position counter first (stateless), and a
streamer passed to ``generate()`` sees the prompt first, as with any HF model.
"""
import warnings

import torch
from transformers import PreTrainedModel
from transformers.utils import ModelOutput


class HuggingFaceGenerationModelAdapter(PreTrainedModel):

    def __init__(self, config, model):
        if getattr(config, "_attn_implementation", None) == "sdpa":
            warnings.warn("Warning: sdpa is unsupported as part of attention implementation. "
                          "Falling back to eager attention implementation.")
            config._attn_implementation = "eager"
        super().__init__(config)
        self.model = model
        self.config = config
        self.cur_len = torch.zeros(1, dtype=torch.long)

    def reset_generation(self):
        self.cur_len = torch.zeros(1, dtype=torch.long)

    def forward(self, input_ids, cache_ids, start_ids=None, output_hidden_states=False, output_attentions=False,
                attention_mask=None, return_dict=False):
        if output_hidden_states or output_attentions or attention_mask is not None:
            warnings.warn("Warning: These arguments are not used by forward(): "
                          "(output_hidden_states, output_attentions, attention_mask)")
        out_logits = self.model(input_ids, cache_ids, start_ids)[:, None, :]
        if return_dict:
            return ModelOutput([("logits", out_logits), ("past_key_values", tuple())])
        return (out_logits,)

    def generate(self, *args, **kwargs):
        self.reset_generation()
        return super().generate(*args, **kwargs)

    def _reorder_cache(self, past, beam_idx):
        raise ValueError(f"{type(self.model).__name__}: beam search (reorder_cache) is not emulated by the double")

    def prepare_inputs_for_generation(self, input_ids, past_key_values=None, inputs_embeds=None, **kwargs):
        attention_mask = kwargs.get("attention_mask")
        start_ids = None
        if attention_mask is not None:
            start_ids = attention_mask.max(axis=1).indices.int()
        decoding = bool((self.cur_len > 0).any())
        if decoding:
            input_ids = input_ids[:, -1:]
        if self.model.neuron_config.use_2d_cache_ids:
            start_ids = torch.arange(input_ids.shape[0])
            if decoding:
                cache_ids = self.cur_len.unsqueeze(-1) + 1
                self.cur_len = cache_ids.squeeze(-1)
            else:
                cache_ids = torch.arange(attention_mask.shape[1]) * attention_mask
                self.cur_len = cache_ids.max(dim=1).values
        elif decoding:
            cache_ids = self.cur_len
            self.cur_len = cache_ids + 1
        else:
            cache_ids = torch.arange(input_ids.shape[1])
            self.cur_len = torch.tensor([input_ids.shape[1]], dtype=torch.long)
        return {"input_ids": input_ids, "cache_ids": cache_ids, "start_ids": start_ids}
