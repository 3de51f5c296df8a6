"""Render chat messages into a prompt: the tokenizer's own chat template, else Llama-2's.

The Llama-2 chat format (as in seed 002 and Meta's reference code)::

    <s>[INST] <<SYS>>
    {system}
    <</SYS>>

    {user 1} [/INST] {assistant 1} </s><s>[INST] {user 2} [/INST]

The rendered text carries its own ``<s>``, so it is tokenized without adding special tokens.
"""
from __future__ import annotations

from typing import List


def render_llama2(messages: List[dict]) -> str:
    system = messages[0]["content"] if messages[0]["role"] == "system" else None
    turns = messages[1:] if system is not None else messages
    parts = []
    for i in range(0, len(turns), 2):
        user = turns[i]["content"].strip()
        if i == 0 and system is not None:
            user = f"<<SYS>>\n{system.strip()}\n<</SYS>>\n\n{user}"
        part = f"<s>[INST] {user} [/INST]"
        if i + 1 < len(turns):
            part += f" {turns[i + 1]['content'].strip()} </s>"
        parts.append(part)
    return "".join(parts)


def render_chat(tokenizer, messages: List[dict]) -> str:
    if getattr(tokenizer, "chat_template", None):
        return tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    return render_llama2(messages)
