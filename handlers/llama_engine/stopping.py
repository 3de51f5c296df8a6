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


class StopSequences:
    """Cut the streamed text at the first stop sequence, holding back what may start one.

    Text is fed as it is released by the detokenizer, so a stop sequence may span tokens.
    Whatever could still become a stop sequence (a suffix that is a prefix of one) is held
    back rather than streamed and taken back later; the stop sequence itself is never
    returned.
    """

    def __init__(self, stops):
        self.stops = list(stops)
        self.held = ""

    def __call__(self, text: str) -> Tuple[str, bool]:
        """Feed new text; return (text safe to release, whether a stop sequence matched)."""
        buffer = self.held + text
        hits = [i for i in (buffer.find(stop) for stop in self.stops) if i >= 0]
        if hits:
            self.held = ""
            return buffer[:min(hits)], True
        keep = self._partial_suffix(buffer)
        self.held = buffer[len(buffer) - keep:]
        return buffer[:len(buffer) - keep], False

    def _partial_suffix(self, buffer: str) -> int:
        longest = 0
        for stop in self.stops:
            for n in range(min(len(stop) - 1, len(buffer)), longest, -1):
                if buffer.endswith(stop[:n]):
                    longest = n
                    break
        return longest

    def flush(self) -> str:
        """Release the held text when generation ends for another reason."""
        held, self.held = self.held, ""
        return held
