"""Prompts of an exact token length under the model's tokenizer.

A prompt of ``n`` tokens is ``<s>`` (which the tokenizer prepends, as the handler's does) plus
``n - 1`` words drawn with a seeded RNG from the vocabulary's single-token words (``" the"``,
``" function"``, ...). The byte-level pre-tokenizer splits at every space, so each word stays
one token; every prompt is checked by encoding it again. Prompts differ per request, so no
server can answer from a prefix cache.
"""
from __future__ import annotations

import random
from dataclasses import dataclass
from typing import List


@dataclass
class Prompt:
    text: str
    ids: List[int]  # with <s>, as the server's tokenizer produces them; peers get these ids

    def __len__(self) -> int:
        return len(self.ids)


class PromptFactory:
    def __init__(self, tokenizer, seed: int = 0):
        self.tokenizer = tokenizer
        self.rng = random.Random(seed)
        self.words = self._single_token_words()
        if len(self.words) < 50:
            raise RuntimeError(f"only {len(self.words)} single-token words in the vocabulary")
        self.prefix = tokenizer("")["input_ids"]  # [<s>] for Llama-style tokenizers

    def _single_token_words(self) -> List[str]:
        words = []
        for token in sorted(self.tokenizer.get_vocab()):
            text = self.tokenizer.convert_tokens_to_string([token])
            if len(text) > 2 and text[0] == " " and text[1:].isascii() and text[1:].isalpha():
                if len(self.tokenizer(text, add_special_tokens=False)["input_ids"]) == 1:
                    words.append(text)
        return words

    def make(self, n_tokens: int) -> Prompt:
        body = n_tokens - len(self.prefix)
        if body < 1:
            raise ValueError(f"a prompt needs at least {len(self.prefix) + 1} tokens, asked for {n_tokens}")
        text = "".join(self.rng.choice(self.words) for _ in range(body))  # starts with a space
        ids = self.tokenizer(text)["input_ids"]
        if len(ids) != n_tokens:
            raise RuntimeError(f"built a prompt of {len(ids)} tokens instead of {n_tokens}")
        return Prompt(text, ids)
