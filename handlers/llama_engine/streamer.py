"""What generation streams: token events and results; and the static batch's streamer.

Every row of a batch streams its own tokens and stops on its own: :class:`BatchTextStreamer`
hands each row's token to that request's generation (lifecycle.py) and the events of a step
to one sink. Unlike HF's ``TextIteratorStreamer`` text is released as soon as it is
complete, not at the next space, so CJK text and code stream too.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Callable, List, Optional, Sequence, Tuple, Union

import torch

if TYPE_CHECKING:
    from .lifecycle import Generation


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
    error: Optional[Exception] = None  # on the closing event of a request that failed: what it is answered with

    @property
    def finished(self) -> bool:
        return self.result is not None


Sink = Callable[[List[TokenEvent]], None]


class BatchTextStreamer:
    """The rows of one static batch: each token goes to its row's generation, the events to the sink.

    ``rows[i]`` is the :class:`~llama_engine.lifecycle.Generation` of backend row ``i``, or
    None for a padding row; a finished row takes no more tokens.
    """

    def __init__(self, rows: Sequence[Optional[Generation]], sink: Optional[Sink] = None):
        self.rows = list(rows)
        self.sink = sink

    def put_rows(self, rows: Sequence[int], tokens: Union[torch.Tensor, Sequence[int]],
                 logprobs: Optional[Sequence[float]] = None) -> None:
        """Take one new token for each of ``rows`` (the rows still in a shrunken batch)."""
        events = []
        token_list = tokens.reshape(-1).tolist() if isinstance(tokens, torch.Tensor) else tokens
        for i, (row, token_id) in enumerate(zip(rows, token_list)):
            generation = self.rows[row]
            if generation is None or generation.result is not None:
                continue
            event = generation.add(token_id, 0.0 if logprobs is None else logprobs[i])
            event.row = row
            events.append(event)
        if events and self.sink is not None:
            self.sink(events)

    @property
    def finished(self) -> bool:
        return all(generation is None or generation.result is not None for generation in self.rows)

    @property
    def active_rows(self) -> List[int]:
        return [i for i, g in enumerate(self.rows) if g is not None and g.result is None]

    def results(self) -> List[Optional[GenerationResult]]:
        return [None if generation is None else generation.result for generation in self.rows]
