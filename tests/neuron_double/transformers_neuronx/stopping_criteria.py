"""Test double of ``transformers_neuronx/stopping_criteria.py`` (aws-neuron/transformers-neuronx).

``sample()`` calls ``stopping_criteria_list(input_ids, probs)`` once per new token,
with the *prompt* ids (not the tokens generated so far), as the real loop does.
"""
import abc
import time
from typing import Optional

import torch


class StoppingCriteria(abc.ABC):
    """Base class: a callable ``(input_ids, scores) -> bool``."""

    @abc.abstractmethod
    def __call__(self, input_ids: torch.LongTensor, scores: torch.FloatTensor, **kwargs) -> bool:
        """Return True to stop generation."""


class MaxTimeCriteria(StoppingCriteria):
    """Stop once ``max_time`` seconds have passed since ``initial_timestamp`` (default: now)."""

    def __init__(self, max_time: float, initial_timestamp: Optional[float] = None):
        self.max_time = max_time
        self.initial_timestamp = time.time() if initial_timestamp is None else initial_timestamp

    def __call__(self, input_ids, scores, **kwargs) -> bool:
        return time.time() - self.initial_timestamp > self.max_time


class StoppingCriteriaList(list):
    def __call__(self, input_ids, scores, **kwargs) -> bool:
        return any(criteria(input_ids, scores) for criteria in self)
