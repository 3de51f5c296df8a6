"""Per-request generation parameters, validated and normalised (after vLLM's sampling_params.py).

The names are those of TGI's and DJL LMI's ``parameters`` object, so their clients work as
they are.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field, fields
from typing import Any, List, Mapping, Optional

from .errors import RequestError

MAX_STOP_SEQUENCES = 8
MAX_STOP_LENGTH = 256
# A temperature this small samples the top token anyway, and dividing float32 logits by it
# overflows: it means greedy, as in vLLM (_SAMPLING_EPS).
GREEDY_TEMPERATURE = 1e-5
MAX_LOGPROBS = 20  # alternatives reported per token (OpenAI's top_logprobs limit, vLLM's default max_logprobs)
# Set by the OpenAI-compatible API only: not a TGI parameter, so a TGI body naming it gets a 400.
NOT_TGI = frozenset({"logprobs"})


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _is_number(value: Any) -> bool:
    return (isinstance(value, (int, float)) and not isinstance(value, bool)
            and math.isfinite(value))


def check_text(value: str, name: str) -> str:
    """A string that cannot be UTF-8 (a lone surrogate from a JSON ``\\ud800`` escape) is a 400."""
    try:
        value.encode("utf-8")
    except UnicodeEncodeError as exc:
        raise RequestError(f"{name} is not valid Unicode (a lone surrogate at character {exc.start})",
                           name) from None
    return value


@dataclass
class SamplingParams:
    """One request's parameters.

    Normalised forms: ``temperature == 0`` (or below ``GREEDY_TEMPERATURE``) and ``top_k == 1``
    mean greedy decoding, and ``do_sample`` is then False; a single ``stop`` string becomes a
    list; integers given for float parameters become floats.
    """

    max_new_tokens: Optional[int] = None
    do_sample: bool = False
    temperature: float = 1.0
    top_k: int = 0
    top_p: float = 1.0
    repetition_penalty: float = 1.0
    stop: List[str] = field(default_factory=list)
    seed: Optional[int] = None
    return_full_text: bool = False
    details: bool = False
    # As vLLM's: None reports no alternatives; k reports each token's own text and the k most likely tokens.
    logprobs: Optional[int] = None

    def __post_init__(self):
        self._check_max_new_tokens()
        for name in ("do_sample", "return_full_text", "details"):
            if not isinstance(getattr(self, name), bool):
                raise RequestError(f"{name} must be true or false, got {getattr(self, name)!r}", name)
        if not _is_number(self.temperature) or self.temperature < 0:
            raise RequestError(f"temperature must be a number >= 0, got {self.temperature!r}", "temperature")
        if not _is_int(self.top_k) or self.top_k < 0:
            raise RequestError(f"top_k must be an integer >= 0 (0 disables it), got {self.top_k!r}", "top_k")
        if not _is_number(self.top_p) or not 0 < self.top_p <= 1:
            raise RequestError(f"top_p must be a number in (0, 1], got {self.top_p!r}", "top_p")
        if not _is_number(self.repetition_penalty) or self.repetition_penalty <= 0:
            raise RequestError(f"repetition_penalty must be a number > 0 (1.0 disables it), "
                               f"got {self.repetition_penalty!r}", "repetition_penalty")
        if self.seed is not None and (not _is_int(self.seed) or not 0 <= self.seed < 2**63):
            raise RequestError(f"seed must be an integer in [0, 2**63), got {self.seed!r}", "seed")
        if self.logprobs is not None and (not _is_int(self.logprobs) or not 0 <= self.logprobs <= MAX_LOGPROBS):
            raise RequestError(f"logprobs must be an integer in [0, {MAX_LOGPROBS}], got {self.logprobs!r}", "logprobs")
        self.stop = _normalise_stop(self.stop)
        self.temperature = float(self.temperature)
        self.top_p = float(self.top_p)
        self.repetition_penalty = float(self.repetition_penalty)
        if self.temperature < GREEDY_TEMPERATURE or self.top_k == 1:
            self.do_sample = False

    def _check_max_new_tokens(self) -> None:
        if self.max_new_tokens is None:
            return
        if not _is_int(self.max_new_tokens):
            raise RequestError(f"max_new_tokens must be an integer, got {self.max_new_tokens!r}", "max_new_tokens")
        if self.max_new_tokens < 1:
            raise RequestError(f"max_new_tokens must be >= 1, got {self.max_new_tokens}", "max_new_tokens")

    @property
    def greedy(self) -> bool:
        return not self.do_sample

    @classmethod
    def from_dict(cls, data: Any) -> "SamplingParams":
        if data is None:
            return cls()
        if not isinstance(data, Mapping):
            raise RequestError(f"parameters must be a JSON object, got {type(data).__name__}", "parameters")
        known = {f.name for f in fields(cls)} - NOT_TGI
        for key in data:
            if key not in known:
                raise RequestError(f"unknown parameter {key!r}; accepted: {', '.join(sorted(known))}", key)
        return cls(**{k: v for k, v in data.items() if v is not None})  # null means "the default", as in TGI


def _normalise_stop(stop: Any) -> List[str]:
    if stop is None:
        return []
    if isinstance(stop, str):
        stop = [stop]
    if not isinstance(stop, list) or not all(isinstance(s, str) for s in stop):
        raise RequestError(f"stop must be a string or a list of strings, got {stop!r}", "stop")
    if any(not s for s in stop):
        raise RequestError("stop must not contain empty strings", "stop")
    for s in stop:
        check_text(s, "stop")
    if len(stop) > MAX_STOP_SEQUENCES:
        raise RequestError(f"stop has {len(stop)} sequences; at most {MAX_STOP_SEQUENCES} are accepted", "stop")
    if any(len(s) > MAX_STOP_LENGTH for s in stop):
        raise RequestError(f"stop sequences must be at most {MAX_STOP_LENGTH} characters", "stop")
    return list(dict.fromkeys(stop))
