"""HF transformers on CPU (or CUDA when present): eager forward passes with a KV cache."""
from __future__ import annotations

import logging
from typing import Sequence

import torch

from .base import Backend

logger = logging.getLogger(__name__)

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def resolve_device(device: str) -> torch.device:
    if device == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if device == "cuda" and not torch.cuda.is_available():
        raise RuntimeError("handler.device is 'cuda' but no CUDA device is available; use 'auto' or 'cpu'")
    return torch.device(device)


class TorchBackend(Backend):
    def __init__(self, model_path: str, dtype: str = "float32", device: str = "auto",
                 max_length: int = 512):
        from transformers import AutoModelForCausalLM

        self.device = resolve_device(device)
        self.model = AutoModelForCausalLM.from_pretrained(
            model_path, torch_dtype=DTYPES[dtype], use_safetensors=True)
        self.model.to(self.device).eval()
        limit = getattr(self.model.config, "max_position_embeddings", max_length)
        if max_length > limit:
            raise ValueError(f"handler.max_length ({max_length}) exceeds the model's "
                             f"max_position_embeddings ({limit}); lower handler.max_length")
        self.max_length = max_length
        self._cache = None
        self._mask = None
        self._next_position = None
        logger.info("torch backend: %s on %s in %s", type(self.model).__name__, self.device, dtype)

    @torch.inference_mode()
    def prefill(self, input_ids: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
        from transformers import DynamicCache

        input_ids = input_ids.to(self.device)
        attention_mask = attention_mask.to(self.device)
        positions = (attention_mask.cumsum(-1) - 1).clamp(min=0)
        out = self.model(input_ids=input_ids, attention_mask=attention_mask, position_ids=positions,
                         past_key_values=DynamicCache(), use_cache=True, num_logits_to_keep=1)
        self._cache = out.past_key_values
        self._mask = attention_mask
        self._next_position = positions[:, -1:] + 1
        return out.logits[:, -1, :].float()

    @torch.inference_mode()
    def decode(self, next_tokens: torch.Tensor) -> torch.Tensor:
        ones = self._mask.new_ones((self._mask.shape[0], 1))
        self._mask = torch.cat([self._mask, ones], dim=1)
        out = self.model(input_ids=next_tokens.to(self.device).view(-1, 1), attention_mask=self._mask,
                         position_ids=self._next_position, past_key_values=self._cache,
                         use_cache=True)
        self._cache = out.past_key_values
        self._next_position = self._next_position + 1
        return out.logits[:, -1, :].float()

    def retain(self, rows: Sequence[int]) -> bool:
        index = torch.tensor(list(rows), device=self.device)
        self._cache.batch_select_indices(index)
        self._mask = self._mask.index_select(0, index)
        self._next_position = self._next_position.index_select(0, index)
        return True

    def release(self) -> None:
        self._cache = self._mask = self._next_position = None


class CompiledTorchBackend(TorchBackend):
    """``torch.compile``'d decode step over a static KV cache (``handler.compile: true``).

    The batch size and the cache length are fixed, so decoding is one compiled graph: the
    engine pads every batch to ``batch_size`` as it does for Neuron. Prefill runs eagerly
    (its length varies) and writes into the same static cache.
    """

    def __init__(self, model_path: str, batch_size: int, dtype: str = "float32", device: str = "auto",
                 max_length: int = 512):
        from transformers import StaticCache

        super().__init__(model_path, dtype=dtype, device=device, max_length=max_length)
        self.batch_sizes = (batch_size,)
        self._static = StaticCache(config=self.model.config, max_batch_size=batch_size, max_cache_len=max_length,
                                   device=self.device, dtype=DTYPES[dtype])
        self._full_mask = torch.zeros((batch_size, max_length), dtype=torch.long, device=self.device)
        self._position = 0
        self._decode_step = torch.compile(self._step, dynamic=False, fullgraph=True)

    def _step(self, input_ids, position_ids, cache_position, attention_mask):
        out = self.model(input_ids=input_ids, position_ids=position_ids, cache_position=cache_position,
                         attention_mask=attention_mask, past_key_values=self._static, use_cache=True)
        return out.logits[:, -1, :]

    @torch.inference_mode()
    def prefill(self, input_ids: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
        length = input_ids.shape[1]
        self._static.reset()
        self._full_mask.zero_()
        self._full_mask[:, :length] = attention_mask.to(self.device)
        positions = (attention_mask.cumsum(-1) - 1).clamp(min=0).to(self.device)
        out = self.model(input_ids=input_ids.to(self.device), attention_mask=self._full_mask,
                         position_ids=positions, cache_position=torch.arange(length, device=self.device),
                         past_key_values=self._static, use_cache=True, num_logits_to_keep=1)
        self._position = length
        self._next_position = positions[:, -1:] + 1
        return out.logits[:, -1, :].float()

    @torch.inference_mode()
    def decode(self, next_tokens: torch.Tensor) -> torch.Tensor:
        if self._position >= self.max_length:
            raise ValueError(f"the batch reached handler.max_length ({self.max_length}) positions")
        self._full_mask[:, self._position] = 1
        cache_position = torch.tensor([self._position], device=self.device)
        logits = self._decode_step(next_tokens.to(self.device).view(-1, 1), self._next_position,
                                   cache_position, self._full_mask)
        self._position += 1
        self._next_position = self._next_position + 1
        return logits.float().clone()

    def retain(self, rows: Sequence[int]) -> bool:
        return False

    def release(self) -> None:
        self._position = 0
