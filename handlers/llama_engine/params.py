"""Per-request generation parameters, validated and normalised (after vLLM's sampling_params.py)."""
from __future__ import annotations

import math
from dataclasses import dataclass, fields
from typing import Any, Mapping, Optional

from .errors import RequestError


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _is_number(value: Any) -> bool:
    return (isinstance(value, (int, float)) and not isinstance(value, bool)
            and math.isfinite(value))


@dataclass
class SamplingParams:
    """One request's parameters.

    ``temperature == 0`` and ``top_k == 1`` both mean greedy decoding; ``do_sample`` is then
    normalised to False so that the token selector sees one canonical form.
    """

    max_new_tokens: Optional[int] = None
    do_sample: bool = False
    temperature: float = 1.0
    top_k: int = 0
    top_p: float = 1.0
    seed: Optional[int] = None

    def __post_init__(self):
        if self.max_new_tokens is not None:
            if not _is_int(self.max_new_tokens):
                raise RequestError(f"max_new_tokens must be an integer, got {self.max_new_tokens!r}",
                                   "max_new_tokens")
            if self.max_new_tokens < 1:
                raise RequestError(f"max_new_tokens must be >= 1, got {self.max_new_tokens}",
                                   "max_new_tokens")
        if not isinstance(self.do_sample, bool):
            raise RequestError(f"do_sample must be true or false, got {self.do_sample!r}", "do_sample")
        if not _is_number(self.temperature) or self.temperature < 0:
            raise RequestError(f"temperature must be a number >= 0, got {self.temperature!r}", "temperature")
        if not _is_int(self.top_k) or self.top_k < 0:
            raise RequestError(f"top_k must be an integer >= 0 (0 disables it), got {self.top_k!r}", "top_k")
        if not _is_number(self.top_p) or not 0 < self.top_p <= 1:
            raise RequestError(f"top_p must be a number in (0, 1], got {self.top_p!r}", "top_p")
        if self.seed is not None and (not _is_int(self.seed) or not 0 <= self.seed < 2**63):
            raise RequestError(f"seed must be an integer in [0, 2**63), got {self.seed!r}", "seed")
        self.temperature = float(self.temperature)
        self.top_p = float(self.top_p)
        if self.temperature == 0 or self.top_k == 1:
            self.do_sample = False

    @property
    def greedy(self) -> bool:
        return not self.do_sample

    @classmethod
    def from_dict(cls, data: Any) -> "SamplingParams":
        if data is None:
            return cls()
        if not isinstance(data, Mapping):
            raise RequestError(f"parameters must be a JSON object, got {type(data).__name__}", "parameters")
        known = {f.name for f in fields(cls)}
        for key in data:
            if key not in known:
                raise RequestError(
                    f"unknown parameter {key!r}; accepted: {', '.join(sorted(known))}", key)
        return cls(**data)
