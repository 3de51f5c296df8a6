"""Test double of ``transformers_neuronx/modeling_auto.py`` (aws-neuron/transformers-neuronx).

``NeuronAutoModelForCausalLM.from_pretrained`` dispatches on the checkpoint's config
like the real class.  The double emulates Llama only (``llama``, ``code_llama``); a
type the real library supports but the double does not is a ``ValueError``, an
unknown type the real ``AssertionError``.
"""
import transformers
from transformers import AutoConfig

from transformers_neuronx.llama.model import LlamaForSampling

NEURON_MODEL_FOR_CAUSAL_LM_MAPPING = {
    "code_llama": LlamaForSampling,
    "llama": LlamaForSampling,
}

#: Model types the real 0.13 library serves but this double does not emulate.
_REAL_ONLY = ("bloom", "gpt2", "gpt_neox", "gptj", "mistral", "mixtral", "opt")

CONFIG_MAPPING = {transformers.LlamaConfig: "llama"}


class NeuronAutoModelForCausalLM:

    @classmethod
    def from_pretrained(cls, pretrained_model_name_or_path, *model_args, **kwargs):
        config = AutoConfig.from_pretrained(pretrained_model_name_or_path)
        if type(config) in CONFIG_MAPPING:
            model_type = CONFIG_MAPPING[type(config)]
        elif hasattr(config, "model_type"):
            model_type = config.model_type
        else:
            raise AssertionError(f"Models based on '{type(config)}' are not supported by Neuron")
        if model_type in _REAL_ONLY:
            raise ValueError(f"model type '{model_type}' is supported by transformers-neuronx but not by "
                             f"the Neuron test double, which emulates only {sorted(NEURON_MODEL_FOR_CAUSAL_LM_MAPPING)}")
        if model_type not in NEURON_MODEL_FOR_CAUSAL_LM_MAPPING:
            raise AssertionError(f"The configuration model type '{model_type}' is not supported by Neuron")
        model_class = NEURON_MODEL_FOR_CAUSAL_LM_MAPPING[model_type]
        return model_class.from_pretrained(pretrained_model_name_or_path, *model_args, **kwargs)
