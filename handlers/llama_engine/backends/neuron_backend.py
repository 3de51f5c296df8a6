"""AWS Inferentia2 through transformers-neuronx (``LlamaForSampling`` and relatives).

Everything that touches the Neuron SDK lives in this module and is imported only when the
backend is chosen. The runtime environment (``NEURON_RT_NUM_CORES`` or
``NEURON_RT_VISIBLE_CORES``, ``NEURON_CC_FLAGS``) is set before ``transformers_neuronx`` is
imported, because the runtime reads it once when it initialises.

Loading: the build saved the compiled graphs with ``model.save()`` into the shipped cache; the
handler calls ``model.load(dir)`` before ``to_neuron()``, so a graph that does not match
(other settings, flags, checkpoint or SDK) is a ``FileNotFoundError`` at once, never an hour
of compiling. Only ``handler.allow_recompile: true`` then compiles, through the persistent
cache. The compiler flags come from ``handler.neuron_cc_flags`` alone: a different
``NEURON_CC_FLAGS`` in the environment is refused, since ``load()`` does not look at flags.

Decoding follows transformers-neuronx's own ``sample_loop_llama``: one ``forward`` over the
left-padded prompts with ``start_ids`` (each row's first real token), then one ``forward``
per token with a 1-D ``cache_ids`` holding the shared position. All rows of a batch share
cache positions, so the longest prompt plus the longest answer must fit ``n_positions``
(``shared_positions``; the engine plans batches accordingly). Like upstream's loops it never
calls ``model.reset()`` (a host write of every layer's KV cache, gigabytes for 7B): the next
context encoding overwrites what the new batch reads, and the mask hides the rest.

:class:`NeuronSlotBackend` serves continuous batching the way vLLM's Neuron worker drives
transformers-neuronx: ``NeuronConfig(continuous_batching=...)`` (right padding, 2-D
``cache_ids``, ``start_ids`` = the sequence's KV-cache slot), one context graph per prompt
and one token graph for the whole slot batch.
"""
from __future__ import annotations

import gc
import glob
import json
import logging
import os
import shutil
import subprocess
from pathlib import Path
from typing import List, Optional, Sequence, Union

import torch

from ..compile_cache import CompileCacheError
from .base import Backend, PromptTooLong, SlotBackend

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
    set_compiler_flags(cc_flags)


def set_compiler_flags(cc_flags: str) -> None:
    """``NEURON_CC_FLAGS`` = ``handler.neuron_cc_flags``; refuse an environment that says otherwise.

    The flags are part of the persistent cache's key but not of ``model.load()``'s file
    names, so an environment override would either compile at load or run graphs built
    with other flags than the environment asks for.
    """
    env_flags = os.environ.get("NEURON_CC_FLAGS")
    if env_flags is not None and env_flags.split() != cc_flags.split():
        raise RuntimeError(
            f"NEURON_CC_FLAGS={env_flags!r} in the environment differs from handler.neuron_cc_flags {cc_flags!r}, "
            "which the model is built with; unset NEURON_CC_FLAGS (the handler sets it), or put the flags in "
            "handler.neuron_cc_flags and rebuild the model")
    os.environ["NEURON_CC_FLAGS"] = cc_flags


def _new_model(model_path: str, cfg, batch_size: int, continuous_batching: bool, padding_side: str):
    """``from_pretrained`` with ``cfg``'s buckets and NeuronConfig; nothing loaded onto the cores yet."""
    from transformers_neuronx import NeuronAutoModelForCausalLM, NeuronConfig
    from transformers_neuronx.config import ContinuousBatchingConfig
    from transformers_neuronx.constants import GQA

    extra = {}
    if continuous_batching:
        extra["continuous_batching"] = ContinuousBatchingConfig(batch_size_for_shared_caches=batch_size)
    neuron_config = NeuronConfig(group_query_attention=GQA(cfg.gqa), padding_side=padding_side,
                                 compilation_worker_count=cfg.compilation_worker_count, **extra)
    return NeuronAutoModelForCausalLM.from_pretrained(
        model_path, batch_size=batch_size, tp_degree=cfg.tp_degree, amp=cfg.amp,
        n_positions=list(cfg.n_positions), context_length_estimate=list(cfg.context_length_estimate),
        neuron_config=neuron_config)


def load_neuron_model(model_path: str, cfg, batch_size: int, continuous_batching: bool = False,
                      padding_side: str = "left", saved_neffs: Optional[Path] = None):
    """Configure the runtime, then build and ``to_neuron()`` the model for ``cfg``'s buckets.

    ``continuous_batching`` builds a KV cache of ``batch_size`` independent sequences
    (``ContinuousBatchingConfig``); the SDK then forces right padding. ``saved_neffs`` is a
    ``model.save()`` directory to load the graphs from instead of compiling; a miss fails
    with ``CompileCacheError`` unless ``cfg.allow_recompile``, which then compiles.
    """
    configure_runtime(cfg.tp_degree, cfg.visible_cores, cfg.neuron_cc_flags)
    args = (model_path, cfg, batch_size, continuous_batching, padding_side)
    if saved_neffs is not None:
        model = _load_saved(args, saved_neffs)
        if model is not None:
            return model
        gc.collect()  # the failed model's weights are on the cores: free them before loading them again
    model = _new_model(*args)
    model.to_neuron()
    return model


def _load_saved(args: tuple, saved_neffs: Path):
    """``model.load(saved_neffs)`` + ``to_neuron()``; None on a miss that ``allow_recompile`` lets compile."""
    cfg = args[1]
    model = _new_model(*args)
    model.load(str(saved_neffs))
    try:
        model.to_neuron()
        return model
    except FileNotFoundError as exc:
        if not cfg.allow_recompile:
            raise CompileCacheError(
                f"the compiled graphs shipped in {saved_neffs} do not match this model: {exc}\nNothing was "
                "compiled. Rebuild the model with these settings (`make build MODEL=<config>`), or set "
                "handler.allow_recompile: true to compile at load (slow: minutes to an hour on Neuron)") from exc
        logger.warning("compile cache: %s; compiling at load because handler.allow_recompile is true", exc)
    return None


class NeuronBackend(Backend):
    shared_positions = True

    def __init__(self, model_path: str, cfg, batch_size: int, saved_neffs: Optional[Path] = None):
        self.model = load_neuron_model(model_path, cfg, batch_size, padding_side="left", saved_neffs=saved_neffs)
        self.batch_sizes = (batch_size,)
        self.max_length = max(cfg.n_positions)
        self.max_prompt_length = max(cfg.context_length_estimate)
        self._start_ids = None
        self._position = 0

    def prefill(self, input_ids: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
        self._start_ids = attention_mask.argmax(dim=1).to(torch.int32)
        self._position = input_ids.shape[1]
        return self.model.forward(input_ids, cache_ids=None, start_ids=self._start_ids).float()

    def decode(self, next_tokens: Union[torch.Tensor, Sequence[int]]) -> torch.Tensor:
        if self._position >= self.max_length:
            raise ValueError(f"the batch reached the largest n_positions ({self.max_length})")
        cache_ids = torch.tensor([self._position], dtype=torch.int32)
        logits = self.model.forward(torch.as_tensor(next_tokens).view(-1, 1), cache_ids=cache_ids,
                                    start_ids=self._start_ids)
        self._position += 1
        return logits.float()

    def release(self) -> None:
        self._start_ids = None
        self._position = 0


class NeuronSlotBackend(SlotBackend):
    """Continuous batching on transformers-neuronx: ``max_slots`` sequences, one KV-cache slot each.

    The model is compiled with ``ContinuousBatchingConfig(batch_size_for_shared_caches=max_slots)``
    and ``batch_size=max_slots``: one context graph per ``context_length_estimate`` bucket at
    batch 1, and token graphs at batch ``max_slots``. Calls follow vLLM's Neuron worker:

    * prefill: ``forward(ids [1, bucket], cache_ids [1, bucket], start_ids=[slot])``, the prompt
      right-padded with 0 to its context bucket and ``cache_ids`` = positions ``0..n-1`` then 0
      (the SDK's own padding). The SDK reads the last logits at ``max(cache_ids)``. Padding to
      the bucket here also keeps a one-token prompt on the context graph: unpadded, it would
      run the token graph, which writes a padding row into every other slot (below).
    * decode: ``forward(ids [k, 1], cache_ids [k, 1], start_ids [k])``, each row at its slot's
      own position; the SDK scatters the rows into a full ``max_slots`` batch and returns the
      logits in the order of ``start_ids``.

    Two limits of the SDK (``base.py`` ``_prepare_for_continuous_batching``) shape this class:

    * The token graph always runs all ``max_slots`` rows; a slot missing from the call gets a
      padding row, token 0 at position 0, which overwrites position 0 of that slot's cache.
      So every occupied slot that is not decoded is sent along with its own first token at
      position 0 (rewriting the same keys/values), and its logits are dropped.
    * A context graph always encodes from position 0 (a multi-token call at a position > 0
      is taken for speculative decoding, for which no graph is compiled), and no prompt may
      exceed the largest context bucket. ``prefill_slot(start > 0)`` therefore re-encodes the
      slot's tokens from position 0 (``incremental_prefill = False``), and a prompt longer than
      the largest bucket is refused (``max_prompt_length``).

    It needs at least 2 slots: the context graph inserts a prompt into the shared cache only
    when it holds more sequences than the one being encoded (``layers/attention.py``
    ``fused_kv_update_cache``), so with one slot ``to_neuron()`` raises ``NotImplementedError``.
    """

    incremental_prefill = False

    def __init__(self, model_path: str, cfg, max_slots: int, saved_neffs: Optional[Path] = None):
        if max_slots < 2:
            raise ValueError(f"continuous batching on Neuron needs max_slots >= 2, got {max_slots}: transformers-neuronx "
                             "cannot compile the context-insert graph for a KV cache of one sequence")
        self.context_buckets = sorted(cfg.context_length_estimate)
        if not self.context_buckets or self.context_buckets[0] < 2:
            raise ValueError("continuous batching on Neuron needs context_length_estimate buckets of at least 2 "
                             f"tokens, got {list(cfg.context_length_estimate)}")
        self.model = load_neuron_model(model_path, cfg, max_slots, continuous_batching=True, padding_side="right",
                                       saved_neffs=saved_neffs)
        self.max_slots = max_slots
        self.max_length = max(cfg.n_positions)
        self.max_prefill_chunk = self.max_prompt_length = max(self.context_buckets)
        self._tokens: List[List[int]] = [[] for _ in range(max_slots)]  # what each slot's cache holds

    def slot_length(self, slot: int) -> int:
        return len(self._tokens[slot])

    def free_slot(self, slot: int) -> None:
        self._tokens[slot] = []

    def _bucket(self, length: int) -> int:
        return next(b for b in self.context_buckets if b >= length)

    def prefill_slot(self, slot: int, prompt_ids: Sequence[int], start: int = 0) -> torch.Tensor:
        total = start + len(prompt_ids)
        if total > self.max_prompt_length:
            raise PromptTooLong(
                f"the prompt has {total} tokens; this Neuron model encodes prompts of at most "
                f"{self.max_prompt_length} tokens with continuous batching (the largest context_length_estimate "
                "bucket); shorten the prompt or compile a larger bucket")
        self.check_prefill(slot, len(prompt_ids), start)
        tokens = self._tokens[slot][:start] + [int(t) for t in prompt_ids]
        bucket = self._bucket(total)
        input_ids = torch.zeros(1, bucket, dtype=torch.long)
        input_ids[0, :total] = torch.tensor(tokens, dtype=torch.long)
        cache_ids = torch.zeros(1, bucket, dtype=torch.long)
        cache_ids[0, :total] = torch.arange(total, dtype=torch.long)
        logits = self.model.forward(input_ids, cache_ids=cache_ids, start_ids=torch.tensor([slot], dtype=torch.long))
        self._tokens[slot] = tokens
        return logits[0].float()

    def decode_slots(self, slots: Sequence[int], tokens: Sequence[int]) -> torch.Tensor:
        slots, tokens = [int(s) for s in slots], [int(t) for t in tokens]
        self.check_decode(slots, tokens)
        # Occupied slots outside this step: their first token again at position 0 (see the class doc).
        keep = [s for s in range(self.max_slots) if self._tokens[s] and s not in slots]
        rows = slots + keep
        input_ids = torch.tensor([[t] for t in tokens] + [[self._tokens[s][0]] for s in keep], dtype=torch.long)
        cache_ids = torch.tensor([[len(self._tokens[s])] for s in slots] + [[0] for _ in keep], dtype=torch.long)
        logits = self.model.forward(input_ids, cache_ids=cache_ids, start_ids=torch.tensor(rows, dtype=torch.long))
        for slot, token in zip(slots, tokens):
            self._tokens[slot].append(token)
        return logits[:len(slots)].float()
