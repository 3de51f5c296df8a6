"""Token selection, kept apart from the logits (after optimum-neuron's TokenSelector).

Each row of a batch has its own selector, so a batch may mix greedy and sampled rows with
different temperatures. A seeded row owns its generator, so its output does not depend on
what else was in the batch.
"""
from __future__ import annotations

from typing import Optional, Sequence

import torch

from .params import SamplingParams


class TokenSelector:
    def __init__(self, params: SamplingParams):
        self.params = params
        self.generator: Optional[torch.Generator] = None
        if params.do_sample:
            self.generator = torch.Generator()
            self.generator.manual_seed(params.seed if params.seed is not None else torch.seed())

    def warp(self, logits: torch.Tensor) -> torch.Tensor:
        """Apply temperature, top-k and top-p to one row of logits ``[vocab]``."""
        p = self.params
        logits = logits / p.temperature
        if 0 < p.top_k < logits.shape[-1]:
            kth = torch.topk(logits, p.top_k).values[-1]
            logits = logits.masked_fill(logits < kth, float("-inf"))
        if p.top_p < 1.0:
            sorted_logits, order = torch.sort(logits, descending=True)
            sorted_probs = sorted_logits.softmax(-1)
            mass_before = sorted_probs.cumsum(-1) - sorted_probs
            drop_sorted = mass_before >= p.top_p
            drop = torch.zeros_like(drop_sorted).scatter(0, order, drop_sorted)
            logits = logits.masked_fill(drop, float("-inf"))
        return logits

    def sample(self, logits: torch.Tensor) -> int:
        probs = self.warp(logits.float()).softmax(-1)
        return int(torch.multinomial(probs, 1, generator=self.generator))


def select_tokens(logits: torch.Tensor, selectors: Sequence[Optional[TokenSelector]]) -> torch.Tensor:
    """Pick the next token of every row of ``logits [B, vocab]``; a ``None`` selector is a padding row."""
    tokens = logits.argmax(dim=-1)
    for row, selector in enumerate(selectors):
        if selector is not None and selector.params.do_sample:
            tokens[row] = selector.sample(logits[row])
    return tokens
