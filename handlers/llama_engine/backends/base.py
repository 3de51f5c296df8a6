"""The interface between the engine and a hardware stack.

A backend runs one static batch at a time: ``prefill`` encodes the left-padded prompts and
returns the logits of the last position; ``decode`` feeds one token per row and returns the
next logits. Backends compiled for fixed shapes (Neuron) publish ``batch_sizes`` and
``max_length``; the engine pads every batch to a compiled size and enforces the length.
"""
from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass, field
from typing import List, Optional, Sequence, Tuple, Union

import torch


class PromptTooLong(ValueError):
    """A prompt longer than the backend can encode.

    The engine checks every request against the backend's limits before it runs
    (``lifecycle.Limits``); this is the backend's own guard, for a request that got past them.
    It is the request's fault, not the backend's: the engine answers it as a client error.
    """


#: The attribute under which the torch backend's logits carry the greedy picks its native head made with them,
#: from that head to :meth:`SlotBackend.step_slots`, which takes them off (:func:`take_greedy_picks`).
GREEDY_PICKS = "greedy_picks"


def with_greedy_picks(logits: torch.Tensor, tokens: List[int], logprobs: List[float]) -> torch.Tensor:
    """``logits`` carrying each row's first argmax and its log-probability (log_softmax's there), as a backend
    computed them beside the logits: the CPU kernels' head does, while the rows are still in the caches."""
    setattr(logits, GREEDY_PICKS, (tokens, logprobs))
    return logits


def take_greedy_picks(logits) -> Optional[Tuple[List[int], List[float]]]:
    """The ``(tokens, logprobs)`` attached to ``logits`` (:func:`with_greedy_picks`), or None; taken off them,
    so that code handed these logits, which may change them in place, never finds picks they no longer match."""
    return logits.__dict__.pop(GREEDY_PICKS, None) if isinstance(logits, torch.Tensor) else None


class Backend(ABC):
    #: Batch sizes the backend can run; ``None`` means any size.
    batch_sizes: Optional[Tuple[int, ...]] = None
    #: The most positions (prompt + generated) one row may occupy.
    max_length: int
    #: The longest prompt that one prefill can encode at full speed.
    max_prompt_length: Optional[int] = None
    #: True when all rows of a batch share cache positions (left padding into one position
    #: counter), so the longest prompt plus the longest answer must fit ``max_length``.
    shared_positions: bool = False
    #: The compile cache this backend loaded through (None when nothing is compiled).
    compile_session = None

    @abstractmethod
    def prefill(self, input_ids: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
        """Encode ``input_ids [B, T]`` (left-padded); return logits ``[B, vocab]``."""

    @abstractmethod
    def decode(self, next_tokens: Union[torch.Tensor, Sequence[int]]) -> torch.Tensor:
        """Append ``next_tokens [B]`` (a tensor or a list of ids); return logits ``[B, vocab]``, with each row's greedy pick attached
        (:func:`with_greedy_picks`) where the backend computed them beside the logits: code that changes the
        logits (a wrapper biasing them, say) takes the picks off first (:func:`take_greedy_picks`)."""

    def retain(self, rows: Sequence[int]) -> bool:
        """Keep only ``rows`` of the running batch. Return False if the backend cannot shrink."""
        return False

    def release(self) -> None:
        """Drop the state of the running batch."""

    def padded_batch_size(self, n: int) -> int:
        """The batch size to run ``n`` rows at."""
        if self.batch_sizes is None:
            return n
        fitting = [b for b in self.batch_sizes if b >= n]
        if not fitting:
            raise ValueError(f"{n} rows exceed the largest compiled batch size {max(self.batch_sizes)}")
        return min(fitting)


@dataclass(frozen=True)
class PrefillChunk:
    """Prompt tokens ``token_ids`` to encode at positions ``start..`` of ``slot``."""
    slot: int
    token_ids: Sequence[int]
    start: int = 0


#: A part's logits, or the exception that failed it.
Outcome = Union[torch.Tensor, BaseException]


@dataclass
class StepLogits:
    """What one :meth:`SlotBackend.step_slots` call produced.

    ``decode``: the decode rows' logits ``[rows, vocab]`` (None when there were no rows);
    ``prefills``: one entry per chunk, in order, its last position's logits ``[vocab]``.
    Each entry is an exception instead where that part failed; the others still count.
    ``picks``: each decode row's greedy token and its log-probability, where the backend computed them with
    the logits (``(tokens, logprobs)``; else None): what greedy selection would take from ``decode``.
    """
    decode: Optional[Outcome] = None
    prefills: List[Outcome] = field(default_factory=list)
    picks: Optional[Tuple[List[int], List[float]]] = None


class SlotBackend(ABC):
    """A KV cache of ``max_slots`` independent rows, for continuous batching.

    Unlike :class:`Backend`, which runs one static batch, a slot backend keeps one sequence
    per slot, each at its own position: a request is prefilled into a free slot while the
    other slots keep their cache, and a decode step advances any subset of the slots by one
    token each.
    """

    #: How many sequences the cache holds at once.
    max_slots: int
    #: The most positions (prompt + generated) one slot may occupy.
    max_length: int
    #: The longest prompt chunk one ``prefill_slot`` call may encode (None: any length).
    #: Neuron compiles prefill for fixed ``context_length_estimate`` buckets.
    max_prefill_chunk: Optional[int] = None
    #: The longest prompt one slot accepts (None: whatever fits ``max_length``). Neuron
    #: encodes a whole prompt with one context graph, so its largest bucket caps prompts;
    #: ``prefill_slot`` raises ``PromptTooLong`` beyond it.
    max_prompt_length: Optional[int] = None
    #: False when ``prefill_slot(start > 0)`` cannot append to the slot and re-encodes the
    #: first ``start`` tokens too (Neuron): splitting a prompt over steps then costs work
    #: instead of saving it, so a scheduler should prefill such a prompt in one call.
    incremental_prefill: bool = True
    #: The compile cache this backend loaded through (None when nothing is compiled).
    compile_session = None

    @abstractmethod
    def prefill_slot(self, slot: int, prompt_ids: Sequence[int], start: int = 0) -> torch.Tensor:
        """Encode ``prompt_ids`` at positions ``start..`` of ``slot``; return the last logits ``[vocab]``.

        ``start > 0`` continues a prompt whose first ``start`` tokens are already in the slot
        (chunked prefill).
        """

    @abstractmethod
    def decode_slots(self, slots: Sequence[int], tokens: Sequence[int]) -> torch.Tensor:
        """Append one token to each of ``slots``, each at its own position; return logits ``[len(slots), vocab]``."""

    def step_slots(self, slots: Sequence[int], tokens: Sequence[int], prefills: Sequence[PrefillChunk]) -> StepLogits:
        """One scheduler step's model work: prompt chunks for some slots, one token for others.

        This default runs each chunk with ``prefill_slot`` and then the rows with
        ``decode_slots``, as separate calls, so a failure stays within its own part. A
        backend that can run them in one forward pass (reading the weights once) overrides it.
        """
        out = StepLogits()
        for chunk in prefills:
            out.prefills.append(_outcome(self.prefill_slot, chunk.slot, chunk.token_ids, start=chunk.start))
        if slots:
            out.decode = _outcome(self.decode_slots, slots, tokens)
        return out

    @abstractmethod
    def free_slot(self, slot: int) -> None:
        """Forget the sequence in ``slot`` so that another request can use it."""

    def slot_length(self, slot: int) -> int:
        """Positions of ``slot`` already written (0 when free)."""
        return 0

    def check_prefill(self, slot: int, n: int, start: int) -> None:
        """Refuse a ``prefill_slot`` call that the slot's state or size cannot take (ValueError)."""
        self.check_slot(slot)
        if n == 0:
            raise ValueError("prefill_slot needs at least one token")
        if start != self.slot_length(slot):
            raise ValueError(f"slot {slot} holds {self.slot_length(slot)} positions; cannot prefill from {start}")
        if start + n > self.max_length:
            raise ValueError(f"the prompt needs {start + n} positions; the slot holds {self.max_length}")

    def check_decode(self, slots: Sequence[int], tokens: Sequence[int]) -> None:
        """Refuse a ``decode_slots`` call on unknown, repeated, empty or full slots (ValueError)."""
        if len(slots) != len(tokens):
            raise ValueError(f"{len(slots)} slots but {len(tokens)} tokens")
        if not slots:
            raise ValueError("decode_slots needs at least one slot")
        if len(set(slots)) != len(slots):
            raise ValueError(f"a slot appears twice in {list(slots)}")
        for slot in slots:
            self.check_slot(slot)
            if self.slot_length(slot) < 1:
                raise ValueError(f"decode on an empty slot ({slot}); prefill it first")
            if self.slot_length(slot) >= self.max_length:
                raise ValueError(f"slot {slot} reached max_length ({self.max_length}) positions")

    def check_slot(self, slot: int) -> None:
        if not 0 <= slot < self.max_slots:
            raise ValueError(f"slot {slot} is out of range: the backend has {self.max_slots} slots")


class OnePassSlotBackend(SlotBackend):
    """A slot backend whose ``_step`` runs decode rows and prompt chunks in one forward pass.

    ``prefill_slot``, ``decode_slots`` and ``step_slots`` all go through ``_step``, so a
    scheduler step reads the weights once. A chunk or a decode set that fails its checks gets
    its ValueError and stays out of the pass; a failure of the pass itself is every part's.
    """

    @abstractmethod
    def _step(self, slots: List[int], tokens: Sequence[int],
              chunks: Sequence[PrefillChunk]) -> Tuple[Optional[torch.Tensor], List[torch.Tensor]]:
        """One pass: a token for each of ``slots``, then each chunk; advance the slots.

        Returns the decode rows' logits (None without rows) and each chunk's last logits."""

    @torch.inference_mode()
    def prefill_slot(self, slot: int, prompt_ids: Sequence[int], start: int = 0) -> torch.Tensor:
        self.check_prefill(slot, len(prompt_ids), start)
        return self._step([], [], [PrefillChunk(slot, prompt_ids, start)])[1][0]

    @torch.inference_mode()
    def decode_slots(self, slots: Sequence[int], tokens: Sequence[int]) -> torch.Tensor:
        self.check_decode(slots, tokens)
        logits = self._step(list(slots), tokens, [])[0]
        take_greedy_picks(logits)
        return logits

    @torch.inference_mode()
    def step_slots(self, slots: Sequence[int], tokens: Sequence[int], prefills: Sequence[PrefillChunk]) -> StepLogits:
        out = StepLogits(prefills=[None] * len(prefills))
        valid, taken = [], set(slots)
        for i, chunk in enumerate(prefills):
            try:
                if chunk.slot in taken:
                    raise ValueError(f"slot {chunk.slot} appears twice in one step")
                self.check_prefill(chunk.slot, len(chunk.token_ids), chunk.start)
                valid.append(i)
                taken.add(chunk.slot)
            except ValueError as exc:
                out.prefills[i] = exc
        slots = list(slots)
        if slots:
            try:
                self.check_decode(slots, tokens)
            except ValueError as exc:
                out.decode, slots, tokens = exc, [], []
        if not slots and not valid:
            return out
        try:
            decode, chunk_logits = self._step(slots, tokens, [prefills[i] for i in valid])
        except Exception as exc:  # noqa: BLE001 - the pass was shared: every part in it failed
            decode, chunk_logits = exc, [exc] * len(valid)
        if slots:
            out.decode, out.picks = decode, take_greedy_picks(decode)
        for i, logits in zip(valid, chunk_logits):
            out.prefills[i] = logits
        return out


class SlotBatchBackend(Backend):
    """Static batches (micro-batching) over a :class:`SlotBackend`: row ``i`` of a batch is slot ``i``.

    Each row sits in its own slot at its own positions, so the engine's left padding is
    dropped before the model sees it, all rows' prompts go through one ``step_slots`` call,
    and ``retain`` only forgets the finished rows' slots.
    """

    def __init__(self, slots: SlotBackend):
        self.slots = slots
        self.max_length = slots.max_length
        self._rows: List[int] = []  # the slot of each row of the running batch

    def prefill(self, input_ids: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
        self.release()
        self.slots.reserve_slots(input_ids.shape[0])
        chunks = [PrefillChunk(row, ids[mask.bool()].tolist())
                  for row, (ids, mask) in enumerate(zip(input_ids.cpu(), attention_mask.cpu()))]
        out = self.slots.step_slots([], [], chunks)
        failed = next((o for o in out.prefills if isinstance(o, BaseException)), None)
        if failed is not None:
            for chunk in chunks:
                self.slots.free_slot(chunk.slot)
            raise failed
        self._rows = [chunk.slot for chunk in chunks]
        return torch.stack(out.prefills)

    def decode(self, next_tokens: Union[torch.Tensor, Sequence[int]]) -> torch.Tensor:
        ids = next_tokens.view(-1).tolist() if isinstance(next_tokens, torch.Tensor) else list(next_tokens)
        step = self.slots.step_slots(self._rows, ids, [])
        if isinstance(step.decode, BaseException):
            raise step.decode
        return step.decode if step.picks is None else with_greedy_picks(step.decode, *step.picks)

    def retain(self, rows: Sequence[int]) -> bool:
        keep = [self._rows[i] for i in rows]
        for slot in set(self._rows).difference(keep):
            self.slots.free_slot(slot)
        self._rows = keep
        return True

    def release(self) -> None:
        for slot in self._rows:
            self.slots.free_slot(slot)
        self._rows = []


def _outcome(fn, *args, **kwargs) -> Outcome:
    try:
        return fn(*args, **kwargs)
    except Exception as exc:  # noqa: BLE001 - handed back as this part's outcome
        return exc
