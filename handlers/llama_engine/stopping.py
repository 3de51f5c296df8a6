"""Stopping as a small pure callable returning ``(stopped, finish_reason)`` (after TGI's utils/tokens.py)."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional, Tuple

FINISH_LENGTH = "length"
FINISH_EOS = "eos_token"
FINISH_STOP = "stop_sequence"


@dataclass(frozen=True)
class StoppingCriteria:
    eos_token_ids: frozenset
    max_new_tokens: int

    def __call__(self, last_token_id: int, generated_count: int) -> Tuple[bool, Optional[str]]:
        if last_token_id in self.eos_token_ids:
            return True, FINISH_EOS
        if generated_count >= self.max_new_tokens:
            return True, FINISH_LENGTH
        return False, None
