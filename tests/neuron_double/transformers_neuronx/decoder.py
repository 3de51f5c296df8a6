"""Test double of ``transformers_neuronx/decoder.py`` (aws-neuron/transformers-neuronx): the part
that owns the KV caches and runs the compiled decoder graphs.

Here the numerics are delegated to a Hugging Face ``LlamaForCausalLM`` (float32) and a
``transformers.DynamicCache``.  The real KV cache is a fixed array of ``max(n_positions)``
slots addressed by ``cache_ids``; the double keeps the filled prefix of it:

* a write at position 0 starts a fresh cache (context encoding, or a 1-token prompt): on the
  device it overwrites the positions the new batch reads, and the attention mask hides the
  previous batch's entries beyond them, so no ``reset()`` is needed between batches;
* a write at ``p < filled`` discards positions ``>= p`` first (the real graph masks them out);
* a write at ``p > filled`` would read never-written slots, so it is a ``ValueError``;
* any position ``>= max(n_positions)`` is a ``ValueError`` (the real cache has no such slot).

Left padding (static batching): ``start_ids[b]`` is row b's first real token.  The
attention mask hides positions ``< start_ids[b]`` and ``position_ids = cache_ids - start_ids``
(clamped at 0), which is what HF ``generate`` does for a left-padded batch.
Continuous batching keeps one cache per sequence slot, written position by position (see
``encode_slot`` / ``decode_slot``).
"""
import torch
from transformers import DynamicCache


class HFDecoder:
    """KV-cache state plus the HF model that computes the logits."""

    def __init__(self, hf_model, n_positions: int):
        self.hf = hf_model
        self.n_positions = n_positions
        self.reset()

    def reset(self):
        """Forget every cached position (static batch and continuous-batching slots), as the
        device's zeroed caches hold nothing a later read may use."""
        self._cache, self._filled, self._rows = None, 0, None
        self._slots = {}

    def _check(self, positions, filled):
        """Validate a contiguous run of cache positions against the cache state."""
        first, last = int(positions[0]), int(positions[-1])
        if last >= self.n_positions:
            raise ValueError(
                f"cache position {last} exceeds the KV cache: the model was compiled with "
                f"max(n_positions)={self.n_positions} positions (prompt + new tokens must fit)")
        if not torch.equal(positions, torch.arange(first, last + 1, dtype=positions.dtype)):
            raise ValueError(f"cache_ids must be consecutive positions, got {positions.tolist()}")
        if first > filled:
            raise ValueError(
                f"cache_ids start at position {first} but only positions < {filled} hold keys/values; "
                "the model would attend to never-written KV-cache slots")
        return first

    @staticmethod
    def _aligned(cache, first):
        if first == 0 or cache is None:
            return DynamicCache()
        if cache.get_seq_length() > first:
            cache.crop(first)
        return cache

    @torch.no_grad()
    def _step(self, cache, input_ids, embeds, positions, start_ids):
        total = int(positions[-1]) + 1
        mask = (torch.arange(total)[None, :] >= start_ids[:, None]).long()
        position_ids = (positions[None, :] - start_ids[:, None]).clamp(min=0)
        out = self.hf(input_ids=None if embeds is not None else input_ids, inputs_embeds=embeds,
                      attention_mask=mask, position_ids=position_ids, past_key_values=cache,
                      use_cache=True, num_logits_to_keep=1)
        return out.logits[:, -1, :].float()

    def run_static(self, input_ids, embeds, positions, start_ids):
        """One call on the shared static-batch cache; returns logits ``[B, vocab]``."""
        rows = input_ids.shape[0]
        first = self._check(positions, self._filled if self._cache is not None else 0)
        if first > 0 and rows != self._rows:
            raise ValueError(f"the KV cache holds a batch of {self._rows} rows, got {rows}")
        cache = self._aligned(self._cache, first)
        logits = self._step(cache, input_ids, embeds, positions, start_ids)
        self._cache, self._filled, self._rows = cache, int(positions[-1]) + 1, rows
        return logits

    # ---- continuous batching: one fixed KV-cache row per slot -------------------------
    #
    # Each slot holds genuine keys/values for positions [0, valid) (a DynamicCache); a write
    # at position p overwrites p only, as in the real fixed array, and a read of a position
    # >= valid (never written, context-bucket padding, or a freed request's stale entries)
    # is a ValueError.

    def encode_slot(self, seq, input_ids, bucket):
        """The context graph: positions ``0..n-1`` of slot ``seq`` (``n <= bucket``); logits ``[1, vocab]``."""
        n = input_ids.shape[1]
        self._check(torch.arange(n), 0)
        cache = DynamicCache()
        logits = self._step(cache, input_ids, None, torch.arange(n), torch.zeros(1, dtype=torch.long))
        self._slots[seq] = (cache, n)
        return logits

    def decode_slot(self, seq, token, position):
        """The token graph for one row: ``token`` at ``position`` of slot ``seq``; logits ``[1, vocab]``."""
        cache, valid = self._slots.get(seq, (None, 0))
        self._check(torch.tensor([position]), valid)
        ids = torch.as_tensor(token).long().view(1, 1)
        zero = torch.zeros(1, dtype=torch.long)
        if cache is None or position == 0 and valid <= 1:
            cache = DynamicCache()
        if position == valid or position == 0 and valid <= 1:
            logits = self._step(cache, ids, None, torch.tensor([position]), zero)
            self._slots[seq] = (cache, max(valid, position + 1))
            return logits
        # Overwrite one position and keep the later ones, as the real scatter does.
        tails = [(k[:, :, position + 1:valid].clone(), v[:, :, position + 1:valid].clone())
                 for k, v in zip(cache.key_cache, cache.value_cache)]
        cache.crop(position)
        logits = self._step(cache, ids, None, torch.tensor([position]), zero)
        for layer, (k, v) in enumerate(tails):
            cache.key_cache[layer] = torch.cat([cache.key_cache[layer], k], dim=-2)
            cache.value_cache[layer] = torch.cat([cache.value_cache[layer], v], dim=-2)
        cache._seen_tokens = valid
        return logits
