"""Test double of ``transformers_neuronx/module.py`` (aws-neuron/transformers-neuronx).

* ``save_pretrained_split(model, save_directory)``: the legacy split checkpoint, as the
  real function writes it through ``model.save_pretrained(..., save_function=save_split)``:
  ``<dir>/config.json`` and a *directory* ``<dir>/pytorch_model.bin/`` holding
  ``key_to_filename.json`` plus one ``torch.save``-d tensor per weight (``p<i>.<key>``).
* ``PretrainedModel.from_pretrained(pretrained_model_path, *model_args, **kwargs)``:
  the real sanity checks, ``AutoConfig`` + ``cls(config, *model_args, **kwargs)``, and a
  lazy checkpoint: only the location is recorded; weights are read in ``to_neuron()``.
  Checkpoint priority as in the real ``load_state_dict_dir``: ``model.safetensors``,
  ``model.safetensors.index.json``, split ``pytorch_model.bin/`` directory.  A pickled
  ``pytorch_model.bin`` *file* is refused by the double (safetensors only).
"""
import json
import os
import re

import torch
from safetensors.torch import load_file
from transformers import AutoConfig

from transformers_neuronx import constants

_SAFETENSORS_MODEL_INDEX_FILENAME_JSON = 'model.safetensors.index.json'
_SAFETENSORS_MODEL_FILENAME = 'model.safetensors'
_PYTORCH_MODEL_BIN_INDEX_FILENAME_JSON = 'pytorch_model.bin.index.json'
_PYTORCH_MODEL_BIN_FILENAME = 'pytorch_model.bin'
_KEY_TO_FILENAME_JSON = 'key_to_filename.json'


def save_pretrained_split(model, save_directory):
    model.save_pretrained(save_directory, save_function=save_split, max_shard_size='10000GB', safe_serialization=False)


def save_split(state_dict, save_dir):
    os.makedirs(save_dir, exist_ok=True)
    key_to_filename = {key: f'p{idx}.{sanitize_file_name(key)}' for idx, key in enumerate(state_dict)}
    with open(os.path.join(save_dir, _KEY_TO_FILENAME_JSON), 'w') as f:
        json.dump(key_to_filename, f, indent=2)
    for key, tensor in state_dict.items():
        torch.save(tensor.contiguous(), os.path.join(save_dir, key_to_filename[key]))


def sanitize_file_name(name):
    sanitized = re.sub(r'(?u)[^-\w.]', '', name.strip().replace(' ', '_'))
    if sanitized in {'', '.', '..'}:
        raise ValueError(f'Could not sanitize "{name}" to file name.')
    return sanitized


def find_checkpoint(path):
    """``(kind, path)`` of the weights in a model directory, in the real priority order."""
    def join(name):
        return os.path.join(path, name)
    if os.path.isfile(join(_SAFETENSORS_MODEL_FILENAME)):
        return 'safetensors', join(_SAFETENSORS_MODEL_FILENAME)
    if os.path.exists(join(_SAFETENSORS_MODEL_INDEX_FILENAME_JSON)):
        return 'safetensors_sharded', join(_SAFETENSORS_MODEL_INDEX_FILENAME_JSON)
    if os.path.isdir(join(_PYTORCH_MODEL_BIN_FILENAME)):
        return 'split', join(_PYTORCH_MODEL_BIN_FILENAME)
    if os.path.isfile(join(_PYTORCH_MODEL_BIN_FILENAME)) or os.path.isfile(join(_PYTORCH_MODEL_BIN_INDEX_FILENAME_JSON)):
        raise ValueError(f"{path} holds only pickled pytorch_model.bin weights; the Neuron test double "
                         "loads safetensors or a save_pretrained_split checkpoint")
    raise FileNotFoundError(f"Can not find model.safetensors or pytorch_model.bin in {path}")


def read_state_dict(kind, location):
    """Read every tensor of a checkpoint found by ``find_checkpoint``."""
    if kind == 'safetensors':
        return load_file(location)
    if kind == 'safetensors_sharded':
        with open(location) as f:
            shards = sorted(set(json.load(f)["weight_map"].values()))
        state = {}
        for shard in shards:
            state.update(load_file(os.path.join(os.path.dirname(location), shard)))
        return state
    with open(os.path.join(location, _KEY_TO_FILENAME_JSON)) as f:
        key_to_filename = json.load(f)
    return {key: torch.load(os.path.join(location, name), weights_only=True)
            for key, name in key_to_filename.items()}


def _sanity_check(**kwargs):
    """The real ``from_pretrained`` pre-checks (assertions, real messages)."""
    context_length_estimate = kwargs.get("context_length_estimate", None)
    n_positions = kwargs.get("n_positions", 2048)
    max_n_pos = max(n_positions) if isinstance(n_positions, list) else n_positions
    max_cle = max(context_length_estimate) if isinstance(context_length_estimate, list) else context_length_estimate
    if isinstance(max_n_pos, int) and isinstance(max_cle, int):
        assert max_n_pos >= max_cle, \
            f"Max context_length_estimate {max_cle} cannot be more than max n_positions {max_n_pos}."
    neuron_config = kwargs.get("neuron_config", None)
    bsh_cache_layout = neuron_config is not None and neuron_config.cache_layout == constants.LAYOUT_BSH
    if neuron_config and neuron_config.continuous_batching:
        shared = neuron_config.continuous_batching.batch_size_for_shared_caches
        expected = kwargs.get("batch_size")
        assert shared == expected, f"invalid batch_size_for_shared_caches ({shared}), {expected} is expected"
        if bsh_cache_layout and not neuron_config.continuous_batching.optimized_paged_attention:
            assert isinstance(n_positions, list) and len(n_positions) == 1
            assert isinstance(context_length_estimate, list) and len(context_length_estimate) == 1, \
                "BSH cache layout does not support multi-bucketing"
    else:
        assert not bsh_cache_layout, "BSH cache layout can only be configured with continuous batching."


class PretrainedModel(torch.nn.Module):
    """Base of the Neuron models: lazy checkpoint loading."""

    @classmethod
    def from_pretrained(cls, pretrained_model_path, *model_args, **kwargs):
        _sanity_check(**kwargs)
        config = AutoConfig.from_pretrained(pretrained_model_path)
        model = cls(config, *model_args, **kwargs)
        model.load_state_dict_dir(pretrained_model_path)
        return model

    def load_state_dict_dir(self, pretrained_model_path):
        """Record where the weights are; they are read by ``to_neuron()``."""
        self._checkpoint = find_checkpoint(pretrained_model_path)
