"""llama.cpp on CPU, through llama-cpp-python's C API, over a GGUF of the checkpoint.

Why a second CPU backend: where torch's kernels stop short of the CPU, ggml's may not. On a
2-vCPU AMD EPYC (AVX2, no AVX-512) in float32, before torch's native kernels, a decode step of
1 / 2 / 4 / 8 rows of the bench model took 19.7 / 23.8 / 30.2 / 41.6 ms here against 26.9 / 29.2 /
34.1 / 43.8 ms in :class:`~.torch_backend.TorchSlotBackend`. With them (bf16 checkpoint, float32
arithmetic over bf16 weights against a bf16 GGUF, interleaved, 256 positions) torch took 12.4 /
12.9 / 14.6 / 25.7 ms against 18.4 / 21.9 / 34.7 / 54.2 here, and a 256-token prefill 546 against
658 ms. Which wins depends on the CPU and the load; ``make bench`` measures both served.

Only the forward pass is llama.cpp's: the engine's batching, sampling, stopping and streaming
are the same as with torch. Each slot is a llama.cpp sequence (``seq_id`` = slot) in a
context of ``max_slots`` sequences of ``max_length`` positions each (``kv_unified`` off, so
every sequence owns its part of the cache); a scheduler step's prompt chunks and decode rows
go to ``llama_decode`` as one batch, so the weights are read once per step.

The tokenizer stays the checkpoint's own (the engine tokenizes); llama.cpp sees token ids only.
"""
from __future__ import annotations

import ctypes
import logging
import os
import statistics
import time
from typing import List, Optional, Sequence, Tuple, Union

import torch

from ..cpu_limits import usable_cpus
from .base import OnePassSlotBackend, PrefillChunk, SlotBatchBackend
from .step_threads import OneRowThreadTuner

logger = logging.getLogger(__name__)

#: ``flash_attn`` as llama.cpp's ``flash_attn_type`` (llama.h); ``auto`` is llama.cpp's own choice.
FLASH_ATTN_TYPES = {"auto": -1, "off": 0, "on": 1}
#: ``flash_attn: auto`` times both settings on a request of this many prompt tokens (at most half of
#: ``max_length``) and half as many new ones: the bench's 256 in / 128 out.
FLASH_ATTN_PROMPT = 256

#: What ``llama_decode``'s return codes mean (llama.h).
DECODE_ERRORS = {
    1: "no room in the KV cache for the batch",
    2: "aborted",
    -1: "invalid input batch",
}


def import_llama_cpp():
    """``llama_cpp`` (llama-cpp-python), with its own logging turned down to errors."""
    try:
        import llama_cpp
        from llama_cpp import _logger
    except ImportError as exc:
        raise RuntimeError("handler.backend is 'llamacpp' but llama-cpp-python is not installed; run "
                           "`make llamacpp` (builds it from source for this CPU) or pick backend torch") from exc
    _logger.set_verbose(False)
    return llama_cpp


class LlamaCppSlotBackend(OnePassSlotBackend):
    """``max_slots`` llama.cpp sequences over one model, for continuous batching (and static batches)."""

    def __init__(self, gguf_path: str, max_slots: int, max_length: int, threads: Optional[int] = None,
                 max_batch_tokens: Optional[int] = None, decode_threads: Union[int, str, None] = None,
                 flash_attn: str = "auto"):
        if max_slots < 1:
            raise ValueError(f"max_slots must be >= 1, got {max_slots}")
        if flash_attn not in FLASH_ATTN_TYPES:
            raise ValueError(f"flash_attn must be one of {', '.join(FLASH_ATTN_TYPES)}, got {flash_attn!r}")
        if not os.path.isfile(gguf_path):
            raise FileNotFoundError(f"no GGUF at {gguf_path}: the build step writes it for backend llamacpp "
                                    "(make build MODEL=...)")
        self.lib = import_llama_cpp()
        self.max_slots, self.max_length = max_slots, max_length
        self.threads = threads or torch.get_num_threads()
        #: llama.cpp's ``n_threads``, for a batch of one token; ``threads`` is its ``n_threads_batch``.
        self.decode_threads = self.threads if decode_threads in (None, "auto") else min(int(decode_threads), self.threads)
        #: Tokens one ``llama_decode`` call takes; a longer step is split over several calls.
        self.max_batch_tokens = max_batch_tokens or max(max_length, max_slots)
        self.lib.llama_backend_init()
        self.model = self._load_model(gguf_path)
        self.n_vocab = self.lib.llama_vocab_n_tokens(self.lib.llama_model_get_vocab(self.model))
        trained = self.lib.llama_model_n_ctx_train(self.model)
        if max_length > trained:
            self.close()
            raise ValueError(f"handler.max_length ({max_length}) exceeds the model's trained context ({trained}); "
                             "lower handler.max_length")
        self.ctx = self.batch = None
        #: ``on``, ``off``, or ``auto`` (llama.cpp's choice) where a prompt too short to time leaves it
        self.flash_attn = flash_attn
        if flash_attn == "auto":
            self.batch = self.lib.llama_batch_init(self.max_batch_tokens, 0, 1)  # the probe's; replaced below
            self.flash_attn = self._pick_flash_attn()
        self._open_context(max_slots)
        #: ``decode_threads: auto`` where the model's threads take every CPU: learns it while serving
        self.step_threads = self._step_threads_tuner() if decode_threads == "auto" else None
        logger.info("llama.cpp backend: %s, %d slots x %d positions, %d threads (%d for one token), flash "
                    "attention %s (%s)", os.path.basename(gguf_path), max_slots, max_length, self.threads,
                    self.decode_threads, self.flash_attn, self.lib.llama_print_system_info().decode().strip())

    def _load_model(self, gguf_path: str):
        params = self.lib.llama_model_default_params()
        model = self.lib.llama_model_load_from_file(gguf_path.encode(), params)
        if not model:
            raise RuntimeError(f"llama.cpp could not load {gguf_path} (not a GGUF of a supported architecture?)")
        return model

    def _open_context(self, slots: int) -> None:
        """A fresh context (and batch buffer) of ``slots`` empty sequences, replacing any open one."""
        if self.ctx:
            self.lib.llama_free(self.ctx)
            self.ctx = None
        if self.batch is not None:
            self.lib.llama_batch_free(self.batch)
            self.batch = None
        self.max_slots = slots
        self.max_batch_tokens = max(self.max_batch_tokens, slots)
        self.batch = self.lib.llama_batch_init(self.max_batch_tokens, 0, 1)
        self.ctx = self._new_context(self.max_slots, self.max_length, self.flash_attn)
        self.memory = self.lib.llama_get_memory(self.ctx)
        self._lengths: List[int] = [0] * slots

    def _new_context(self, slots: int, positions: int, flash_attn: str):
        params = self.lib.llama_context_default_params()
        params.n_ctx = positions * slots
        params.n_seq_max = slots
        params.kv_unified = False
        params.n_batch = self.max_batch_tokens
        params.n_ubatch = min(512, self.max_batch_tokens)
        params.n_threads, params.n_threads_batch = self.decode_threads, self.threads
        params.flash_attn_type = FLASH_ATTN_TYPES[flash_attn]
        params.no_perf = True
        ctx = self.lib.llama_init_from_model(self.model, params)
        if not ctx:
            raise RuntimeError(f"llama.cpp could not create a context of {slots} x {positions} positions")
        return ctx

    def _pick_flash_attn(self) -> str:
        """``flash_attn: auto``: whichever of on and off serves requests faster here, timed at load.

        Which wins depends on the CPU's build and on how many sequences a step carries. On the AMX
        Xeon (bf16 GGUF, 2 threads) flash attention prefilled 768-token prompts ~10% faster, but
        its one-token steps grew with the context three times as fast (20.4 against 16.3 ms at 256
        positions, 27 against 18 at 768). On a Zen 5 EPYC a request alone told them apart by a few
        percent (and noise made the served worker pick off), while served, off ran 0.95x on at one
        stream and 0.88x at 8. So each setting gets a small context of ``max_slots`` sequences and
        times the bench's two waves there (:meth:`_request_costs`): one request alone, and one in
        every sequence at once. A ``max_length`` under 64 leaves llama.cpp's own choice.
        """
        tokens = min(FLASH_ATTN_PROMPT, self.max_length // 2)
        if tokens < 32:
            return "auto"
        positions = -(-(tokens + 16) // 256) * 256  # llama.cpp pads a sequence's cells to 256, and warns otherwise
        contexts = {setting: self._new_context(self.max_slots, positions, setting) for setting in ("on", "off")}
        try:
            costs = self._request_costs(contexts, tokens)
        finally:
            for ctx in contexts.values():
                self.lib.llama_free(ctx)
        choice = min(costs, key=costs.get)
        together = f" and {self.max_slots} at once" if self.max_slots > 1 else ""
        logger.info("flash_attn auto: a request of %d prompt tokens and %d new ones alone%s took %.0f ms with "
                    "flash attention on, %.0f ms off; %s", tokens, tokens // 2, together, 1e3 * costs["on"],
                    1e3 * costs["off"], choice)
        return choice

    def _request_costs(self, contexts: dict, tokens: int) -> dict:
        """Seconds, in each of ``contexts`` (``max_slots`` sequences each), for requests of ``tokens``
        prompt tokens and ``tokens // 2`` new ones: one alone, plus (with more than one slot) one in
        every sequence at once. Each context prefills sequence 0 once and copies it to the others;
        a wave costs a prefill per request plus its steps (of one row, of every row) at the median
        of six, alternated with the other context's."""
        prompt = [(1 + i % (self.n_vocab - 1), i, 0, i == tokens - 1) for i in range(tokens)]
        waves = [[0]] + ([list(range(self.max_slots))] if self.max_slots > 1 else [])
        prefill, lengths = {}, {}
        steps = {(name, len(wave)): [] for name in contexts for wave in waves}
        for name, ctx in contexts.items():
            started = time.perf_counter()
            self._decode_in_calls(prompt, ctx)
            prefill[name] = time.perf_counter() - started
            memory = self.lib.llama_get_memory(ctx)
            for seq in range(1, self.max_slots):
                self.lib.llama_memory_seq_cp(memory, 0, seq, -1, -1)
            lengths[name] = [tokens] * self.max_slots
        for _ in range(6):
            for wave in waves:
                for name, ctx in contexts.items():
                    started = time.perf_counter()
                    self._decode([(1, lengths[name][seq], seq, True) for seq in wave], ctx)
                    steps[name, len(wave)].append(time.perf_counter() - started)
                    for seq in wave:
                        lengths[name][seq] += 1
        return {name: sum(len(wave) * prefill[name] + tokens // 2 * statistics.median(steps[name, len(wave)])
                          for wave in waves)
                for name in contexts}

    def _step_threads_tuner(self) -> Optional[OneRowThreadTuner]:
        """``decode_threads: auto``: where the model's threads take every CPU, steps of one row try
        those threads and one fewer while serving and keep the faster (:mod:`.step_threads`); else
        every step takes them all."""
        if self.threads < 2 or self.threads < usable_cpus().count:
            return None
        logger.info("decode_threads auto: %d threads to start; steps of one row as served choose between %d and %d",
                    self.threads, self.threads, self.threads - 1)
        return OneRowThreadTuner((self.threads, self.threads - 1))

    def close(self) -> None:
        """Free the context, the batch and the model (also at garbage collection)."""
        lib = getattr(self, "lib", None)
        if lib is None:
            return
        if getattr(self, "batch", None) is not None:
            lib.llama_batch_free(self.batch)
            self.batch = None
        if getattr(self, "ctx", None):
            lib.llama_free(self.ctx)
            self.ctx = None
        if getattr(self, "model", None):
            lib.llama_model_free(self.model)
            self.model = None

    def __del__(self):
        try:
            self.close()
        except Exception:  # noqa: BLE001 - at interpreter exit the library may already be gone
            pass

    def reserve_slots(self, count: int) -> None:
        """Make room for ``count`` sequences, with a new context if it has fewer; only while every slot is free."""
        if count <= self.max_slots:
            return
        if any(self._lengths):
            raise RuntimeError(f"cannot grow the context to {count} sequences while some of its {self.max_slots} are in use")
        self._open_context(count)

    def slot_length(self, slot: int) -> int:
        return self._lengths[slot]

    def free_slot(self, slot: int) -> None:
        self.check_slot(slot)
        self.lib.llama_memory_seq_rm(self.memory, slot, -1, -1)
        self._lengths[slot] = 0

    def _step(self, slots: List[int], tokens: Sequence[int],
              chunks: Sequence[PrefillChunk]) -> Tuple[Optional[torch.Tensor], List[torch.Tensor]]:
        """Decode rows first, then each chunk (logits of its last token only); advance the slots.

        A step longer than ``max_batch_tokens`` goes over several ``llama_decode`` calls, in
        order, so each sequence's positions stay consecutive. On a failure the slots touched
        are rolled back to their lengths before the step.
        """
        if self.step_threads is not None:
            self._set_decode_threads(self.step_threads.threads_for_step(len(slots) == 1 and not chunks))
        entries = [(int(token), self._lengths[slot], slot, True) for slot, token in zip(slots, tokens)]
        for chunk in chunks:
            last = len(chunk.token_ids) - 1
            entries += [(int(token), chunk.start + i, chunk.slot, i == last) for i, token in enumerate(chunk.token_ids)]
        before = {slot: self._lengths[slot] for _, _, slot, _ in entries}
        try:
            logits = self._decode_in_calls(entries)
        except Exception:
            for slot, length in before.items():
                self.lib.llama_memory_seq_rm(self.memory, slot, length, -1)
            raise
        for slot in slots:
            self._lengths[slot] += 1
        for chunk in chunks:
            self._lengths[chunk.slot] = chunk.start + len(chunk.token_ids)
        decode = logits[:len(slots)] if slots else None
        return decode, list(logits[len(slots):])

    def _set_decode_threads(self, threads: int) -> None:
        if threads != self.decode_threads:
            self.lib.llama_set_n_threads(self.ctx, threads, self.threads)
            self.decode_threads = threads

    def _decode_in_calls(self, entries, ctx=None) -> torch.Tensor:
        """``entries`` over as many ``llama_decode`` calls of ``max_batch_tokens`` as they need, in order;
        the logits of those that asked for them."""
        return torch.cat([self._decode(entries[i:i + self.max_batch_tokens], ctx)
                          for i in range(0, len(entries), self.max_batch_tokens)])

    def _decode(self, entries, ctx=None) -> torch.Tensor:
        """One ``llama_decode`` call (on ``ctx``, default the backend's); the logits of the entries that
        asked for them, ``[n, vocab]`` float32."""
        ctx = ctx or self.ctx
        batch = self.batch
        batch.n_tokens = len(entries)
        for i, (token, pos, seq, wants_logits) in enumerate(entries):
            batch.token[i] = token
            batch.pos[i] = pos
            batch.n_seq_id[i] = 1
            batch.seq_id[i][0] = seq
            batch.logits[i] = wants_logits
        rc = self.lib.llama_decode(ctx, batch)
        if rc != 0:
            raise RuntimeError(f"llama_decode failed ({rc}: {DECODE_ERRORS.get(rc, 'fatal error')})")
        n_out = sum(1 for entry in entries if entry[3])
        if n_out == 0:
            return torch.empty((0, self.n_vocab))
        floats = ctypes.cast(self.lib.llama_get_logits(ctx), ctypes.POINTER(ctypes.c_float * (n_out * self.n_vocab)))
        return torch.frombuffer(floats.contents, dtype=torch.float32).view(n_out, self.n_vocab).clone()


class LlamaCppBackend(SlotBatchBackend):
    """Static batches (micro-batching) over :class:`LlamaCppSlotBackend`: row ``i`` is sequence ``i``."""

    def __init__(self, gguf_path: str, max_length: int, batch_size: int = 1, threads: Optional[int] = None,
                 decode_threads: Union[int, str, None] = None, flash_attn: str = "auto"):
        super().__init__(LlamaCppSlotBackend(gguf_path, max(1, batch_size), max_length, threads=threads,
                                             decode_threads=decode_threads, flash_attn=flash_attn))
        self.max_length = max_length
