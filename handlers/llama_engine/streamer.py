"""A batched text streamer: every row of a batch streams its own tokens and stops on its own.

It keeps the ``put(LongTensor[B, 1])`` / ``end()`` shape of HF streamers and of
transformers-neuronx's ``sample(streamer=...)``, which puts only generated tokens (never the
prompt). Unlike HF's ``TextIteratorStreamer`` it releases text as soon as it is complete,
not at the next space, so CJK text and code stream too.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable, List, Optional, Sequence, Tuple

import torch

from .detokenizer import IncrementalDetokenizer
from .stopping import FINISH_LENGTH, FINISH_STOP, StoppingCriteria, StopSequences


@dataclass
class TokenLogprobs:
    """One generated token as OpenAI's logprobs report it (only when ``params.logprobs`` asks).

    ``text`` is the token decoded after the tokens before it, so it keeps its leading space
    (unlike the streamed text, it is never held back); ``top`` holds the most likely tokens
    of the same distribution as ``(text, log-probability)``, most likely first.
    """

    text: str
    logprob: float
    top: List[Tuple[str, float]] = field(default_factory=list)


@dataclass
class GenerationResult:
    text: str
    token_ids: List[int]
    finish_reason: str
    prompt_tokens: int
    token_texts: List[str] = field(default_factory=list)
    logprobs: List[float] = field(default_factory=list)
    special: List[bool] = field(default_factory=list)
    seed: Optional[int] = None
    top_logprobs: List[TokenLogprobs] = field(default_factory=list)  # one per token when params.logprobs asks

    @property
    def generated_tokens(self) -> int:
        return len(self.token_ids)


@dataclass
class TokenEvent:
    row: int
    token_id: Optional[int]  # None for a closing event that carries no new token
    text: str
    special: bool
    logprob: float = 0.0
    result: Optional[GenerationResult] = None
    index: int = 0  # 1-based position of the token in the answer
    top_logprobs: Optional[TokenLogprobs] = None

    @property
    def finished(self) -> bool:
        return self.result is not None


@dataclass
class RowState:
    """What the streamer tracks for one live row."""

    detokenizer: IncrementalDetokenizer
    stopping: StoppingCriteria
    prompt_tokens: int
    special_ids: frozenset
    stop_sequences: Optional[StopSequences] = None
    seed: Optional[int] = None
    token_ids: List[int] = field(default_factory=list)
    pieces: List[str] = field(default_factory=list)
    logprobs: List[float] = field(default_factory=list)
    result: Optional[GenerationResult] = None
    selector: Optional[Any] = None  # the row's TokenSelector: its ``top`` alternatives, when params.logprobs asks
    top_logprobs: List[TokenLogprobs] = field(default_factory=list)

    def add(self, token_id: int, logprob: float = 0.0) -> TokenEvent:
        top = self._top_logprobs(token_id, logprob)  # before the detokenizer moves past this token
        self.token_ids.append(token_id)
        self.logprobs.append(logprob)
        text = self.detokenizer.add(token_id)
        stopped, reason = self.stopping(token_id, len(self.token_ids))
        if stopped:
            text += self.detokenizer.flush()
        if self.stop_sequences is not None:
            text, matched = self.stop_sequences(text)
            if matched:
                stopped, reason = True, FINISH_STOP
            elif stopped:
                text += self.stop_sequences.flush()
        self.pieces.append(text)
        if stopped:
            self._finish(reason)
        return TokenEvent(-1, token_id, text, token_id in self.special_ids, logprob, self.result,
                          len(self.token_ids), top)

    def _top_logprobs(self, token_id: int, logprob: float) -> Optional[TokenLogprobs]:
        if self.selector is None or self.selector.params.logprobs is None:
            return None
        text = self.detokenizer.token_text
        entry = TokenLogprobs(text(token_id), logprob, [(text(t), lp) for t, lp in self.selector.top])
        self.top_logprobs.append(entry)
        return entry

    def _finish(self, reason: str) -> None:
        self.result = GenerationResult(
            "".join(self.pieces), list(self.token_ids), reason, self.prompt_tokens, list(self.pieces),
            list(self.logprobs), [t in self.special_ids for t in self.token_ids], self.seed,
            list(self.top_logprobs))


Sink = Callable[[List[TokenEvent]], None]


class BatchTextStreamer:
    def __init__(self, rows: Sequence[Optional[RowState]], sink: Optional[Sink] = None):
        self.rows = list(rows)
        self.sink = sink

    def put(self, value: torch.Tensor) -> None:
        """Take ``LongTensor[B, 1]`` (or ``[B]``): one new token for every row."""
        if value.numel() != len(self.rows):
            raise ValueError(f"BatchTextStreamer has {len(self.rows)} rows, got shape {tuple(value.shape)}")
        self.put_rows(range(len(self.rows)), value.reshape(-1))

    def put_rows(self, rows: Sequence[int], tokens: torch.Tensor, logprobs: Optional[Sequence[float]] = None) -> None:
        """Take one new token for each of ``rows`` (the rows still in a shrunken batch)."""
        events = []
        token_list = tokens.reshape(-1).tolist()
        for i, (row, token_id) in enumerate(zip(rows, token_list)):
            state = self.rows[row]
            if state is None or state.result is not None:
                continue
            event = state.add(token_id, 0.0 if logprobs is None else logprobs[i])
            event.row = row
            events.append(event)
        if events and self.sink is not None:
            self.sink(events)

    def end(self) -> None:
        """Close rows that the generator stopped without a stopping decision of ours."""
        events = []
        for row, state in enumerate(self.rows):
            if state is not None and state.result is None:
                text = state.detokenizer.flush()
                if state.stop_sequences is not None:
                    text, _ = state.stop_sequences(text)
                    text += state.stop_sequences.flush()
                if state.pieces:  # the closing text belongs to the last token
                    state.pieces[-1] += text
                else:
                    state.pieces.append(text)
                state._finish(FINISH_LENGTH)
                events.append(TokenEvent(row, None, text, False, result=state.result))
        if events and self.sink is not None:
            self.sink(events)

    @property
    def finished(self) -> bool:
        return all(state is None or state.result is not None for state in self.rows)

    @property
    def active_rows(self) -> List[int]:
        return [i for i, s in enumerate(self.rows) if s is not None and s.result is None]

    def results(self) -> List[Optional[GenerationResult]]:
        return [None if state is None else state.result for state in self.rows]
