"""``handler.weight_dtype: int8`` against the default weights on one checkpoint, in one process: how far the logits
move, how many greedy tokens stay the same, and decode and prefill times, alternated side by side.

A script, not a test: it prints figures and asserts nothing about speed.

    .venv/bin/python -m scripts.bench.int8_weights                              # the bench model (bf16)
    .venv/bin/python -m scripts.bench.int8_weights --model build/tiny-llama --rounds 4

Both sides are :class:`TorchSlotBackend` over the same checkpoint with ``dtype: auto``: the default keeps what
``weight_dtype: auto`` keeps (a bf16 checkpoint's bf16 weights on the native kernels of a CPU without native
bf16); int8 quantizes every linear, the LM head too, with a scale per row. Decode steps run in blocks, A B A B,
so that a busy machine's drift falls on both; the figures are medians. The bench model's weights are random:
its logits are nearly flat, so its greedy tokens part at the first near tie. The tiny model is trained (on
CPython's pydoc topics and a few modules' docstrings): its perplexity on docstrings it was not trained on
(:data:`HELD_OUT`) says what the quantization costs a model that has learnt something.
"""
from __future__ import annotations

import argparse
import math
import statistics
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[2]
SIDES = ("auto", "int8")
#: Tokens each decode row is prefilled with before its timed steps (fewer where the longest prompt is shorter).
DECODE_PROMPT = 128
#: Standard-library modules whose docstrings the tiny model did not see (scripts/build_tiny_llama.py's DOC_MODULES).
HELD_OUT = ("csv", "heapq", "shutil", "bisect", "zipfile")


def load(model: Path, side: str, slots: int, max_length: int):
    from llama_engine.backends.torch_backend import TorchSlotBackend

    return TorchSlotBackend.from_pretrained(str(model), max_slots=slots, max_length=max_length, dtype="auto",
                                            weight_dtype=side)


def greedy(backend, prompt, steps: int):
    """The prefill's and each greedy step's logits (float32 rows) and the tokens picked."""
    backend.free_slot(0)
    rows, tokens = [backend.prefill_slot(0, prompt).float().reshape(-1)], []
    for _ in range(steps):
        tokens.append(int(rows[-1].argmax()))
        rows.append(backend.decode_slots([0], [tokens[-1]])[0].float().reshape(-1))
    backend.free_slot(0)
    return torch.stack(rows), tokens


def held_out_ids(model: Path, limit: int):
    """The :data:`HELD_OUT` modules' docstrings as the checkpoint's tokens, at most ``limit``."""
    import importlib
    import inspect

    from transformers import AutoTokenizer

    text = "\n\n".join(inspect.getdoc(importlib.import_module(name)) or "" for name in HELD_OUT)
    return AutoTokenizer.from_pretrained(str(model))(text, truncation=True, max_length=limit)["input_ids"]


def perplexity(backend, ids) -> float:
    """exp of the mean negative log-likelihood of ``ids[1:]``, each token fed in turn (teacher forcing)."""
    backend.free_slot(0)
    logits, nll = backend.prefill_slot(0, ids[:1]).float().reshape(-1), 0.0
    for token in ids[1:]:
        nll -= float(torch.log_softmax(logits, -1)[token])
        logits = backend.decode_slots([0], [token])[0].float().reshape(-1)
    backend.free_slot(0)
    return math.exp(nll / (len(ids) - 1))


def decode_block(backend, rows: int, prompt, steps: int) -> float:
    """Seconds per decode step of ``rows`` slots, each prefilled with ``prompt`` first."""
    slots = list(range(rows))
    for slot in slots:
        backend.free_slot(slot)
        backend.prefill_slot(slot, prompt)
    start = time.perf_counter()
    for _ in range(steps):
        backend.decode_slots(slots, [5] * rows)
    elapsed = (time.perf_counter() - start) / steps
    for slot in slots:
        backend.free_slot(slot)
    return elapsed


def prefill_once(backend, prompt) -> float:
    backend.free_slot(0)
    start = time.perf_counter()
    backend.prefill_slot(0, prompt)
    elapsed = time.perf_counter() - start
    backend.free_slot(0)
    return elapsed


def alternated(backends, rounds: int, measure) -> dict:
    times = {side: [] for side in backends}
    for _ in range(rounds):
        for side, backend in backends.items():
            times[side].append(measure(backend))
    return {side: statistics.median(values) for side, values in times.items()}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", type=Path, default=ROOT / "build" / "bench-model-bf16",
                   help="checkpoint directory (default: the bench model, bf16)")
    p.add_argument("--batches", default="1,8", help="comma list of decode rows to time")
    p.add_argument("--prefills", default="256,768", help="comma list of prompt lengths to time")
    p.add_argument("--rounds", type=int, default=8, help="alternated blocks per side")
    p.add_argument("--steps", type=int, default=20, help="decode steps per block")
    p.add_argument("--greedy", type=int, default=40,
                   help="greedy steps compared after a prompt of 256 tokens (or the longest --prefills, if shorter)")
    p.add_argument("--perplexity-tokens", type=int, default=512,
                   help="held-out tokens whose perplexity each side scores (0: none)")
    p.add_argument("--threads", type=int, default=2, help="torch threads (default 2)")
    args = p.parse_args(argv)
    torch.set_num_threads(args.threads)
    batches = [int(b) for b in args.batches.split(",")]
    prefills = [int(n) for n in args.prefills.split(",")]
    decode_prompt = min(DECODE_PROMPT, max(prefills))
    positions = max(max(prefills) + args.greedy, args.perplexity_tokens, decode_prompt + args.steps) + 8
    backends = {side: load(args.model, side, max(batches), positions) for side in SIDES}
    vocab = backends["auto"].model.config.vocab_size
    ids = torch.randint(3, vocab, (max(prefills),), generator=torch.Generator().manual_seed(0)).tolist()
    with torch.inference_mode():
        prompt = ids[:256]
        (want, picked), (got, int8_picked) = (greedy(backends[side], prompt, args.greedy) for side in SIDES)
        same = next((i for i, (a, b) in enumerate(zip(picked, int8_picked)) if a != b), len(picked))
        spread = want[0].max() - want[0].min()
        print(f"{args.model.name}, {args.threads} threads: int8 against the default weights")
        print(f"- first logits after {len(prompt)} tokens: max |diff| {(got[0] - want[0]).abs().max():.4f} of a range of "
              f"{spread:.3f}, cosine {torch.nn.functional.cosine_similarity(got[0], want[0], 0):.5f}")
        print(f"- greedy tokens: the first {same} of {args.greedy} the same")
        if args.perplexity_tokens:
            text = held_out_ids(args.model, args.perplexity_tokens)
            scores = {side: perplexity(backend, text) for side, backend in backends.items()}
            print(f"- perplexity over {len(text)} tokens of held-out docstrings ({', '.join(HELD_OUT)}): default "
                  f"{scores['auto']:.3f}, int8 {scores['int8']:.3f} ({scores['int8'] / scores['auto'] - 1:+.2%})")
        for rows in batches:
            m = alternated(backends, args.rounds, lambda b, rows=rows: decode_block(b, rows, ids[:decode_prompt], args.steps))
            print(f"- decode, {rows} row(s): default {1e3 * m['auto']:.2f} ms a step ({rows / m['auto']:.1f} tok/s), "
                  f"int8 {1e3 * m['int8']:.2f} ({rows / m['int8']:.1f} tok/s): {m['auto'] / m['int8']:.2f}x")
        for n in prefills:
            m = alternated(backends, max(2, args.rounds // 2), lambda b, n=n: prefill_once(b, ids[:n]))
            print(f"- prefill of {n} tokens: default {1e3 * m['auto']:.0f} ms, int8 {1e3 * m['int8']:.0f} ms: "
                  f"{m['auto'] / m['int8']:.2f}x")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
