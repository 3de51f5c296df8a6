"""Generation for one static batch: tokenize, left-pad, prefill, decode, stop, stream.

The engine knows nothing of TorchServe. A caller hands it prepared requests and a sink; the
sink receives one list of :class:`TokenEvent` per decode step, only for rows that produced
a token in that step.
"""
from __future__ import annotations

import logging
import os
import time
from dataclasses import dataclass, field
from typing import List, Optional, Sequence

import torch

from .backends import Backend, create_backend
from .chat import render_chat
from .detokenizer import IncrementalDetokenizer
from .errors import RequestError
from .metrics import NULL_SINK, MetricsSink, RequestTimes
from .request import GenerationRequest
from .selection import TokenSelector, select_tokens
from .stopping import StoppingCriteria, StopSequences
from .streamer import BatchTextStreamer, GenerationResult, RowState, Sink

logger = logging.getLogger(__name__)


@dataclass
class PreparedRequest:
    request: GenerationRequest
    prompt_ids: List[int]
    max_new_tokens: int
    times: RequestTimes = field(default_factory=RequestTimes)  # for the metrics sink


class Engine:
    def __init__(self, backend: Backend, tokenizer, default_max_new_tokens: int = 64):
        self.backend = backend
        self.tokenizer = tokenizer
        self.default_max_new_tokens = default_max_new_tokens
        self.pad_token_id = _pad_id(tokenizer)
        self.eos_token_ids = frozenset(_eos_ids(tokenizer))
        self.special_ids = frozenset(tokenizer.all_special_ids)

    @classmethod
    def from_config(cls, handler_cfg, model_dir: str, batch_size: int = 1,
                    build_cache_dir: Optional[str] = None) -> "Engine":
        from transformers import AutoTokenizer

        tokenizer = AutoTokenizer.from_pretrained(os.path.join(model_dir, handler_cfg.model_path))
        backend = create_backend(handler_cfg, model_dir, batch_size, build_cache_dir)
        return cls(backend, tokenizer, handler_cfg.max_new_tokens)

    @property
    def max_length(self) -> int:
        return self.backend.max_length

    def prepare(self, request: GenerationRequest) -> PreparedRequest:
        """Tokenize and check the request against the model's limits (RequestError if over)."""
        return prepare_request(self.tokenizer, request, self.max_length, self.backend.max_prompt_length,
                               self.default_max_new_tokens)

    def _row_state(self, prepared: PreparedRequest, seed: Optional[int] = None, selector=None) -> RowState:
        stops = prepared.request.params.stop
        return RowState(
            detokenizer=IncrementalDetokenizer(self.tokenizer, prepared.prompt_ids),
            stopping=StoppingCriteria(self.eos_token_ids, prepared.max_new_tokens),
            prompt_tokens=len(prepared.prompt_ids),
            special_ids=self.special_ids,
            stop_sequences=StopSequences(stops) if stops else None,
            seed=seed,
            selector=selector,
        )

    def _pad_batch(self, prompts: Sequence[List[int]], batch_size: int):
        longest = max(len(p) for p in prompts)
        input_ids = torch.full((batch_size, longest), self.pad_token_id, dtype=torch.long)
        attention_mask = torch.zeros((batch_size, longest), dtype=torch.long)
        for row in range(batch_size):
            # Padding rows (for fixed-batch backends) repeat the first prompt; their output is ignored.
            ids = prompts[row] if row < len(prompts) else prompts[0]
            input_ids[row, longest - len(ids):] = torch.tensor(ids, dtype=torch.long)
            attention_mask[row, longest - len(ids):] = 1
        return input_ids, attention_mask

    def generate(self, batch: Sequence[PreparedRequest], sink: Optional[Sink] = None,
                 metrics: MetricsSink = NULL_SINK) -> List[GenerationResult]:
        """Generate for every request; rows report through ``sink`` under their index in ``batch``,
        and each request's admission, tokens, end and the steps go to ``metrics``."""
        results: List[GenerationResult] = []
        for start, group in self._plan(batch):
            group_sink = sink if start == 0 or sink is None else _offset_sink(sink, start)
            results.extend(self._generate_group(group, _metered_sink(group_sink, group, metrics), metrics))
        return results

    def _plan(self, batch: Sequence[PreparedRequest]):
        """Split ``batch`` where rows sharing cache positions would overrun ``max_length``."""
        if not self.backend.shared_positions:
            return [(0, list(batch))] if batch else []
        groups, start, longest_prompt, longest_answer = [], 0, 0, 0
        for i, p in enumerate(batch):
            prompt = max(longest_prompt, len(p.prompt_ids))
            answer = max(longest_answer, p.max_new_tokens)
            if i > start and prompt + answer > self.max_length:
                groups.append((start, list(batch[start:i])))
                start, prompt, answer = i, len(p.prompt_ids), p.max_new_tokens
            longest_prompt, longest_answer = prompt, answer
        if len(batch) > start:
            groups.append((start, list(batch[start:])))
        return groups

    @torch.inference_mode()
    def _generate_group(self, batch: Sequence[PreparedRequest], sink: Optional[Sink] = None,
                        metrics: MetricsSink = NULL_SINK) -> List[GenerationResult]:
        batch_size = self.backend.padded_batch_size(len(batch))
        selectors = [TokenSelector(p.request.params, p.prompt_ids) for p in batch]
        rows = [self._row_state(p, sel.seed, sel) for p, sel in zip(batch, selectors)]
        rows += [None] * (batch_size - len(batch))
        selectors += [None] * (batch_size - len(batch))
        streamer = BatchTextStreamer(rows, sink)
        input_ids, attention_mask = self._pad_batch([p.prompt_ids for p in batch], batch_size)
        live = list(range(batch_size))  # streamer row of each backend row
        for prepared in batch:
            metrics.admitted(prepared)
        started, steps, rows_worked = time.perf_counter(), 0, 0
        try:
            logits = self.backend.prefill(input_ids, attention_mask)
            while True:
                steps, rows_worked = steps + 1, rows_worked + len(streamer.active_rows)
                tokens, logprobs = select_tokens(logits, [selectors[r] for r in live])
                streamer.put_rows(live, tokens, logprobs)
                if streamer.finished:
                    break
                live, tokens = self._shrink(streamer, live, tokens)
                logits = self.backend.decode(tokens)
        finally:
            self.backend.release()
            metrics.steps(steps, rows_worked, time.perf_counter() - started)
        return streamer.results()[: len(batch)]

    def _shrink(self, streamer: BatchTextStreamer, live: List[int], tokens: torch.Tensor):
        """Drop finished rows from the running batch, where the backend can."""
        active = set(streamer.active_rows)
        keep = [i for i, row in enumerate(live) if row in active]
        if len(keep) == len(live) or not self.backend.retain(keep):
            return live, tokens
        return [live[i] for i in keep], tokens[keep]

    def warmup(self, batch_size: int = 1, max_new_tokens: int = 2, prompt_lengths: Sequence[int] = ()) -> None:
        """Run short generations so the first real request does not pay for lazy set-up.

        ``prompt_lengths`` adds one generation per length, so that a compiling backend builds
        the graph of every context bucket (and the token graph) now rather than on a request.
        """
        from .params import SamplingParams

        request = GenerationRequest("Warm-up", SamplingParams(max_new_tokens=max_new_tokens))
        prepared = [self.prepare(request)] + warmup_prompts(self.tokenizer, request, prompt_lengths, self.max_length)
        for item in prepared:
            self.generate([item] * batch_size)


def prepare_request(tokenizer, request: GenerationRequest, max_length: int, max_prompt_length: Optional[int],
                    default_max_new_tokens: int) -> PreparedRequest:
    """Tokenize ``request`` and check it against the model's limits (RequestError if over).

    ``max_length`` holds the prompt and the answer; ``max_prompt_length`` is the longest prompt
    the backend encodes at full speed (None: no such limit).
    """
    times = RequestTimes()  # received now, before tokenizing
    if request.messages is not None:
        request.prompt = render_chat(tokenizer, request.messages)
        prompt_ids = tokenizer(request.prompt, add_special_tokens=False)["input_ids"]
    else:
        prompt_ids = tokenizer(request.prompt)["input_ids"]
    field = "inputs" if request.messages is None else "messages"
    bucket = max_prompt_length
    if bucket is not None and len(prompt_ids) > bucket:
        raise RequestError(
            f"the prompt is {len(prompt_ids)} tokens; the limit is {bucket} tokens "
            "(the largest compiled context bucket, handler.context_length_estimate)", field)
    if len(prompt_ids) >= max_length:
        raise RequestError(
            f"the prompt is {len(prompt_ids)} tokens; the limit is {max_length - 1} tokens "
            f"(handler.max_length {max_length} holds the prompt and the answer)", field)
    room = max_length - len(prompt_ids)
    requested = request.params.max_new_tokens
    if requested is None:
        max_new = min(default_max_new_tokens, room)
    elif requested > room:
        raise RequestError(
            f"max_new_tokens is {requested}, but the prompt ({len(prompt_ids)} tokens) leaves room "
            f"for only {room} of handler.max_length {max_length}", "max_new_tokens")
    else:
        max_new = requested
    return PreparedRequest(request, prompt_ids, max_new, times)


def warmup_prompts(tokenizer, request: GenerationRequest, lengths: Sequence[int],
                   max_length: int) -> List[PreparedRequest]:
    """One prepared ``request`` per prompt length, each prompt exactly that many tokens long."""
    filler = tokenizer(" the", add_special_tokens=False)["input_ids"][-1]
    new = request.params.max_new_tokens
    return [PreparedRequest(request, (tokenizer("")["input_ids"] + [filler] * length)[:length],
                            min(new, max_length - length)) for length in lengths]


def _metered_sink(sink: Optional[Sink], batch: Sequence[PreparedRequest], metrics: MetricsSink) -> Optional[Sink]:
    """``sink`` that also reports each row's tokens and end to ``metrics`` (after ``sink`` has them)."""
    if metrics is NULL_SINK:
        return sink

    def metered(events):
        seen = [(batch[event.row], event.index, event.result) for event in events]  # before ``sink`` shifts rows
        if sink is not None:
            sink(events)
        for prepared, index, result in seen:
            if index:  # 0: a closing event without a token
                metrics.token(prepared, index)
            if result is not None:
                metrics.finished(prepared, result.finish_reason, result.generated_tokens)

    return metered


def _offset_sink(sink: Sink, offset: int) -> Sink:
    def shifted(events):
        for event in events:
            event.row += offset
        sink(events)

    return shifted


def _pad_id(tokenizer) -> int:
    for candidate in (tokenizer.pad_token_id, tokenizer.eos_token_id, 0):
        if candidate is not None:
            return candidate
    return 0


def _eos_ids(tokenizer) -> List[int]:
    eos = tokenizer.eos_token_id
    return [] if eos is None else [eos]
