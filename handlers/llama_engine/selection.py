"""Token selection, kept apart from the logits (after optimum-neuron's TokenSelector).

Each row of a batch has its own selector, so a batch may mix greedy and sampled rows with
different temperatures and penalties. A sampled row owns its generator, seeded from the
request (or at random, reported back), so its output does not depend on what else was in
the batch. The log-probability of each chosen token comes from the distribution it was
chosen from.
"""
from __future__ import annotations

import math
import random
from typing import List, Optional, Sequence, Tuple

import torch

from .params import SamplingParams

_MAX = torch.finfo(torch.float32).max


def _finite(scores: torch.Tensor) -> torch.Tensor:
    """Scores that a softmax can take: an extreme penalty or temperature overflows float32 to
    +-inf (or 0 * inf = nan), and one such score would make the whole row nan. Masked scores
    are set to -inf only after this."""
    return torch.nan_to_num(scores, nan=0.0, posinf=_MAX, neginf=-_MAX)


class TokenSelector:
    def __init__(self, params: SamplingParams, prompt_ids: Sequence[int] = ()):
        self.params = params
        self.seed: Optional[int] = None
        self.generator: Optional[torch.Generator] = None
        if params.do_sample:
            self.seed = params.seed if params.seed is not None else random.getrandbits(63)
            self.generator = torch.Generator().manual_seed(self.seed)
        self._seen: List[int] = list(prompt_ids) if params.repetition_penalty != 1.0 else []
        # The most likely tokens (id, log-probability) of the last choice, when params.logprobs asks for them.
        self.top: List[Tuple[int, float]] = []

    @property
    def plain_greedy(self) -> bool:
        return not self.params.do_sample and self.params.repetition_penalty == 1.0

    def penalise(self, logits: torch.Tensor) -> torch.Tensor:
        """CTRL-style repetition penalty over the prompt and the tokens generated so far."""
        penalty = self.params.repetition_penalty
        if penalty == 1.0 or not self._seen:
            return logits
        ids = torch.tensor(sorted(set(self._seen)), device=logits.device)
        scores = logits[ids]
        logits = logits.clone()
        logits[ids] = _finite(torch.where(scores > 0, scores / penalty, scores * penalty))
        return logits

    def warp(self, logits: torch.Tensor) -> torch.Tensor:
        """Apply temperature, top-k and top-p to one row of logits ``[vocab]``.

        The most likely token always survives top-k and top-p, so a row never loses every
        token (a ``top_p`` below float32's smallest number would otherwise drop them all).
        Top-k keeps exactly ``top_k`` tokens, ties at the k-th logit broken as ``torch.topk``
        breaks them: bf16 logits tie often (a tiny bf16 model's ``top_k=2`` kept three tokens
        when its 2nd and 3rd tied, and listed three alternatives).
        """
        p = self.params
        logits = _finite(logits / p.temperature)
        if 0 < p.top_k < logits.shape[-1]:
            kept = torch.topk(logits, p.top_k).indices
            logits = torch.full_like(logits, float("-inf")).scatter(0, kept, logits[kept])
        if p.top_p < 1.0:
            sorted_logits, order = torch.sort(logits, descending=True)
            sorted_probs = sorted_logits.softmax(-1)
            mass_before = sorted_probs.cumsum(-1) - sorted_probs
            drop_sorted = mass_before >= p.top_p
            drop_sorted[0] = False
            drop = torch.zeros_like(drop_sorted).scatter(0, order, drop_sorted)
            logits = logits.masked_fill(drop, float("-inf"))
        return logits

    def choose(self, logits: torch.Tensor) -> Tuple[int, float]:
        """Pick one token from one row of logits; return it with its log-probability.

        On the CPU wherever the logits are: the request's generator is a CPU one, so a seed draws
        the same tokens on a GPU as on a CPU (and a CUDA row cannot be sampled with it)."""
        scores = self.penalise(logits.float().cpu())
        if self.params.do_sample:
            scores = self.warp(scores)
            logprobs = scores.log_softmax(-1)
            token = int(torch.multinomial(logprobs.exp(), 1, generator=self.generator))
        else:
            logprobs = scores.log_softmax(-1)
            token = int(scores.argmax())
        self.keep_top(logprobs)
        return token, float(logprobs[token])

    def keep_top(self, logprobs: torch.Tensor) -> None:
        """Remember the ``params.logprobs`` most likely tokens of the distribution the token came from.

        Tokens that top-k or top-p ruled out (log-probability -inf) are left out. Tied tokens are listed and
        cut as ``argmax`` breaks ties, lowest id first: ``torch.topk`` orders and picks them in no set way,
        and bf16 logits tie often (a tiny bf16 model's greedy ``\\n`` came second to ``\\n  `` at the same
        log-probability).
        """
        k = self.params.logprobs
        if not k:
            return
        values, ids = torch.topk(logprobs, min(k, logprobs.shape[-1]))
        values = values.tolist()
        cut = values[-1]
        above = [(i, v) for i, v in zip(ids.tolist(), values) if v > cut]
        tied = (logprobs == cut).nonzero().flatten()[:len(values) - len(above)].tolist()
        top = sorted(above + [(i, cut) for i in tied], key=lambda pair: (-pair[1], pair[0]))
        self.top = [(i, v) for i, v in top if math.isfinite(v)]

    def observe(self, token: int) -> None:
        if self.params.repetition_penalty != 1.0:
            self._seen.append(token)


def select_tokens(logits: torch.Tensor, selectors: Sequence[Optional[TokenSelector]]
                  ) -> Tuple[torch.Tensor, List[float]]:
    """Pick the next token of every row of ``logits [B, vocab]``; a ``None`` selector is a padding row."""
    logits = logits.float()
    tokens = logits.argmax(dim=-1)
    table = logits.log_softmax(-1)
    logprobs = table.gather(1, tokens.unsqueeze(1)).squeeze(1).tolist()
    for row, selector in enumerate(selectors):
        if selector is None:
            continue
        if not selector.plain_greedy:
            token, logprob = selector.choose(logits[row])
            tokens[row] = token
            logprobs[row] = logprob
        else:
            selector.keep_top(table[row])
        selector.observe(int(tokens[row]))
    return tokens, logprobs


def select_token_lists(logits: torch.Tensor, selectors: Sequence[Optional[TokenSelector]],
                       picks: Optional[Tuple[List[int], List[float]]] = None) -> Tuple[List[int], List[float]]:
    """:func:`select_tokens` as lists; the backend's greedy ``picks`` (``StepLogits.picks``) where every row is
    plain greedy without top tokens to list, which is what :func:`select_tokens` would compute from ``logits``.

    The backend makes those picks while the logits are in the caches. Here, after a decode step of the bench
    model had streamed its ~230 MB of weights, :func:`select_tokens`' torch calls took ~0.3 ms on an AMX Xeon.
    """
    if (picks is not None and len(picks[0]) == len(selectors)
            and all(s is None or (s.plain_greedy and not s.params.logprobs) for s in selectors)):
        return list(picks[0]), list(picks[1])
    tokens, logprobs = select_tokens(logits, selectors)
    return tokens.tolist(), logprobs
