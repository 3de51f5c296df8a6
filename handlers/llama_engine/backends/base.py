"""The interface between the engine and a hardware stack.

A backend runs one static batch at a time: ``prefill`` encodes the left-padded prompts and
returns the logits of the last position; ``decode`` feeds one token per row and returns the
next logits. Backends compiled for fixed shapes (Neuron) publish ``batch_sizes`` and
``max_length``; the engine pads every batch to a compiled size and enforces the length.
"""
from __future__ import annotations

from abc import ABC, abstractmethod
from typing import Optional, Sequence, Tuple

import torch


class Backend(ABC):
    #: Batch sizes the backend can run; ``None`` means any size.
    batch_sizes: Optional[Tuple[int, ...]] = None
    #: The most positions (prompt + generated) one row may occupy.
    max_length: int
    #: The longest prompt that one prefill can encode at full speed.
    max_prompt_length: Optional[int] = None
    #: True when all rows of a batch share cache positions (left padding into one position
    #: counter), so the longest prompt plus the longest answer must fit ``max_length``.
    shared_positions: bool = False
    #: The compile cache this backend loaded through (None when nothing is compiled).
    compile_session = None

    @abstractmethod
    def prefill(self, input_ids: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
        """Encode ``input_ids [B, T]`` (left-padded); return logits ``[B, vocab]``."""

    @abstractmethod
    def decode(self, next_tokens: torch.Tensor) -> torch.Tensor:
        """Append ``next_tokens [B]``; return logits ``[B, vocab]``."""

    def retain(self, rows: Sequence[int]) -> bool:
        """Keep only ``rows`` of the running batch. Return False if the backend cannot shrink."""
        return False

    def release(self) -> None:
        """Drop the state of the running batch."""

    def padded_batch_size(self, n: int) -> int:
        """The batch size to run ``n`` rows at."""
        if self.batch_sizes is None:
            return n
        fitting = [b for b in self.batch_sizes if b >= n]
        if not fitting:
            raise ValueError(f"{n} rows exceed the largest compiled batch size {max(self.batch_sizes)}")
        return min(fitting)
