"""AWS Inferentia2 through transformers-neuronx (``LlamaForSampling`` and relatives).

Everything that touches the Neuron SDK lives in this module and is imported only when the
backend is chosen. The runtime environment (``NEURON_RT_NUM_CORES`` or
``NEURON_RT_VISIBLE_CORES``, ``NEURON_CC_FLAGS``) is set before ``transformers_neuronx`` is
imported, because the runtime reads it once when it initialises.

Decoding follows transformers-neuronx's own ``sample_loop_llama``: one ``forward`` over the
left-padded prompts with ``start_ids`` (each row's first real token), then one ``forward``
per token with a 1-D ``cache_ids`` holding the shared position. All rows of a batch share
cache positions, so the longest prompt plus the longest answer must fit ``n_positions``
(``shared_positions``; the engine plans batches accordingly).
"""
from __future__ import annotations

import glob
import json
import logging
import os
import shutil
import subprocess
from typing import Optional

import torch

from .base import Backend

logger = logging.getLogger(__name__)

CORES_PER_DEVICE = 2  # NeuronCores per Inferentia2 device


def available_neuron_cores() -> Optional[int]:
    """NeuronCores on this host: from ``neuron-ls --json-output``, else /dev/neuron* x 2."""
    if shutil.which("neuron-ls"):
        try:
            out = subprocess.run(["neuron-ls", "--json-output"], capture_output=True, text=True,
                                 timeout=30, check=True).stdout
            return sum(int(device.get("nc_count", CORES_PER_DEVICE)) for device in json.loads(out))
        except (subprocess.SubprocessError, ValueError, TypeError, AttributeError):
            logger.warning("neuron-ls --json-output failed; counting /dev/neuron* instead")
    devices = glob.glob("/dev/neuron[0-9]*")
    return len(devices) * CORES_PER_DEVICE if devices else None


def configure_runtime(tp_degree: int, visible_cores: Optional[str], cc_flags: str) -> None:
    """Set the runtime's core selection and the compiler flags; fail if the cores are not there."""
    available = available_neuron_cores()
    if available is None:
        raise RuntimeError("handler.backend is neuron but no Neuron devices were found (no neuron-ls, no "
                           "/dev/neuron*); run on an inf2 host or use backend: torch")
    if visible_cores is not None:
        first, _, last = visible_cores.partition("-")
        wanted = int(last or first) - int(first) + 1
        if wanted != tp_degree:
            raise RuntimeError(f"handler.visible_cores {visible_cores} names {wanted} cores but tp_degree is {tp_degree}")
        if int(last or first) >= available:
            raise RuntimeError(f"handler.visible_cores {visible_cores} is beyond the {available} NeuronCores of this host")
        os.environ["NEURON_RT_VISIBLE_CORES"] = visible_cores
        os.environ.pop("NEURON_RT_NUM_CORES", None)
    else:
        if tp_degree > available:
            raise RuntimeError(f"tp_degree {tp_degree} needs {tp_degree} NeuronCores, this host has {available}; "
                               "use a larger instance or a config with a smaller tp_degree")
        os.environ.setdefault("NEURON_RT_NUM_CORES", str(tp_degree))
    if os.environ.get("NEURON_CC_FLAGS", cc_flags) != cc_flags:
        logger.warning("NEURON_CC_FLAGS=%r from the environment replaces handler.neuron_cc_flags %r",
                       os.environ["NEURON_CC_FLAGS"], cc_flags)
    os.environ.setdefault("NEURON_CC_FLAGS", cc_flags)


class NeuronBackend(Backend):
    shared_positions = True

    def __init__(self, model_path: str, cfg, batch_size: int):
        configure_runtime(cfg.tp_degree, cfg.visible_cores, cfg.neuron_cc_flags)
        from transformers_neuronx import NeuronAutoModelForCausalLM, NeuronConfig
        from transformers_neuronx.constants import GQA

        neuron_config = NeuronConfig(group_query_attention=GQA(cfg.gqa), padding_side="left")
        self.model = NeuronAutoModelForCausalLM.from_pretrained(
            model_path, batch_size=batch_size, tp_degree=cfg.tp_degree, amp=cfg.amp,
            n_positions=list(cfg.n_positions), context_length_estimate=list(cfg.context_length_estimate),
            neuron_config=neuron_config)
        self.model.to_neuron()
        self.batch_sizes = (batch_size,)
        self.max_length = max(cfg.n_positions)
        self.max_prompt_length = max(cfg.context_length_estimate)
        self._start_ids = None
        self._position = 0

    def prefill(self, input_ids: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
        self.model.reset()
        self._start_ids = attention_mask.argmax(dim=1).to(torch.int32)
        self._position = input_ids.shape[1]
        return self.model.forward(input_ids, cache_ids=None, start_ids=self._start_ids).float()

    def decode(self, next_tokens: torch.Tensor) -> torch.Tensor:
        if self._position >= self.max_length:
            raise ValueError(f"the batch reached the largest n_positions ({self.max_length})")
        cache_ids = torch.tensor([self._position], dtype=torch.int32)
        logits = self.model.forward(next_tokens.view(-1, 1), cache_ids=cache_ids, start_ids=self._start_ids)
        self._position += 1
        return logits.float()

    def release(self) -> None:
        self._start_ids = None
        self._position = 0
