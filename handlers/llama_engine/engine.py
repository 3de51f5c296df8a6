"""Generation for one static batch: tokenize, left-pad, prefill, decode, stop, stream.

The engine knows nothing of TorchServe. A caller hands it prepared requests and a sink; the
sink receives one list of :class:`TokenEvent` per decode step, only for rows that produced
a token in that step. Each request's own life (parameters, selection, detokenization,
stopping, limits, result) is its :class:`~llama_engine.lifecycle.Generation`.
"""
from __future__ import annotations

import logging
import time
from typing import List, Optional, Sequence

import torch

from .backends import Backend, create_backend
from .backends.base import take_greedy_picks
from .lifecycle import Limits, PreparedRequest, RequestLifecycle, load_tokenizer
from .metrics import NULL_SINK, MetricsSink
from .request import GenerationRequest
from .selection import select_token_lists
from .streamer import BatchTextStreamer, GenerationResult, Sink

logger = logging.getLogger(__name__)


class Engine:
    def __init__(self, backend: Backend, tokenizer, default_max_new_tokens: int = 64):
        self.backend = backend
        self.lifecycle = RequestLifecycle(tokenizer, Limits.of(backend, default_max_new_tokens))

    @classmethod
    def from_config(cls, handler_cfg, model_dir: str, batch_size: int = 1,
                    build_cache_dir: Optional[str] = None) -> "Engine":
        backend = create_backend(handler_cfg, model_dir, batch_size, build_cache_dir)
        return cls(backend, load_tokenizer(handler_cfg, model_dir), handler_cfg.max_new_tokens)

    @property
    def tokenizer(self):
        return self.lifecycle.tokenizer

    @property
    def max_length(self) -> int:
        return self.backend.max_length

    def prepare(self, request: GenerationRequest) -> PreparedRequest:
        """Tokenize and check the request against the model's limits (RequestError if over)."""
        return self.lifecycle.prepare(request)

    def _pad_batch(self, prompts: Sequence[List[int]], batch_size: int):
        longest = max(len(p) for p in prompts)
        input_ids = torch.full((batch_size, longest), self.lifecycle.pad_token_id, dtype=torch.long)
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
        generations = [self.lifecycle.start(p) for p in batch]
        padding = [None] * (batch_size - len(batch))
        selectors = [g.selector for g in generations] + padding
        streamer = BatchTextStreamer(generations + padding, sink)
        input_ids, attention_mask = self._pad_batch([p.prompt_ids for p in batch], batch_size)
        live = list(range(batch_size))  # streamer row of each backend row
        for generation in generations:
            generation.admit()
            metrics.admitted(generation.prepared)
        started, steps, rows_worked = time.perf_counter(), 0, 0
        try:
            logits = self._forward(metrics, 0, sum(len(p.prompt_ids) for p in batch),
                                   self.backend.prefill, input_ids, attention_mask)
            for generation in generations:
                generation.start_decoding()
            while True:
                steps, rows_worked = steps + 1, rows_worked + len(streamer.active_rows)
                tokens, logprobs = select_token_lists(logits, [selectors[r] for r in live], take_greedy_picks(logits))
                streamer.put_rows(live, tokens, logprobs)
                if streamer.finished:
                    break
                live, tokens = self._shrink(streamer, live, tokens)
                logits = self._forward(metrics, len(live), 0, self.backend.decode, tokens)
        finally:
            self.backend.release()
            metrics.steps(steps, rows_worked, time.perf_counter() - started)
        return streamer.results()[: len(batch)]

    @staticmethod
    def _forward(metrics: MetricsSink, rows: int, prefill_tokens: int, call, *args):
        started = time.perf_counter()
        logits = call(*args)
        metrics.forward(rows, prefill_tokens, time.perf_counter() - started)
        return logits

    def _shrink(self, streamer: BatchTextStreamer, live: List[int], tokens: List[int]):
        """Drop finished rows from the running batch, where the backend can."""
        active = set(streamer.active_rows)
        keep = [i for i, row in enumerate(live) if row in active]
        if len(keep) == len(live) or not self.backend.retain(keep):
            return live, tokens
        return [live[i] for i in keep], [tokens[i] for i in keep]

    def warmup(self, batch_size: int = 1, max_new_tokens: int = 2, prompt_lengths: Sequence[int] = ()) -> None:
        """Run short generations so the first real request does not pay for lazy set-up.

        ``prompt_lengths`` adds one generation per length, so that a compiling backend builds
        the graph of every context bucket (and the token graph) now rather than on a request.
        """
        for prepared in self.lifecycle.warmup_requests(max_new_tokens, prompt_lengths):
            self.generate([prepared] * batch_size)


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
