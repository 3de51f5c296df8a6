#!/usr/bin/env python
"""Build the project's embedded default model: a tiny Llama plus its tokenizer.

Everything is built offline from English text that ships with CPython
(``pydoc_data.topics`` and a few stdlib docstrings), so no hub download is ever
needed. The build is deterministic: the same arguments on the same Python /
torch / tokenizers versions yield byte-identical ``model.safetensors`` and
``tokenizer.json``.

Usage::

    python scripts/build_tiny_llama.py --out build/tiny-llama [--steps N] [--seed 0] [--vocab-size 2048]
"""

from __future__ import annotations

import argparse
import importlib
import inspect
import math
import os
import shutil
import sys
import time
from pathlib import Path

import torch
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers
from transformers import GenerationConfig, LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

try:  # progress bar is a nicety, never a requirement
    from tqdm import tqdm
except ImportError:  # pragma: no cover - depends on the environment
    tqdm = None

PAD, BOS, EOS = "<pad>", "<s>", "</s>"
PAD_ID, BOS_ID, EOS_ID = 0, 1, 2
MAX_POSITIONS = 1024
SEQ_LEN = 128
BATCH_SIZE = 8  # on 2 cores, 8 x 128 tokens with more steps beat 16 x 128 at equal time
LR = 3e-3
NUM_THREADS = 2  # fixed: CPU float reductions depend on the thread count
DEFAULT_STEPS = 350  # ~80 s of training on a 2-core machine (measured)
ROUND_TRIP_SAMPLES = (
    "The function returns a new list of items.",
    "I like 🦙 and 🎉",
    "你好，世界。日本語",
)
MULTI_TOKEN_EMOJI = "🦙"
# Extra English text; fixed order so the corpus (and thus the build) is stable.
DOC_MODULES = (
    "argparse", "builtins", "collections", "dataclasses", "functools",
    "itertools", "json", "logging", "pathlib", "re", "string", "textwrap",
)


def log(msg: str) -> None:
    print(f"[build_tiny_llama] {msg}", flush=True)


# --------------------------------------------------------------------- corpus
def pydoc_topics() -> list[str]:
    """Return the pydoc topic texts sorted by key (dict order is not a contract)."""
    from pydoc_data.topics import topics

    return [topics[key] for key in sorted(topics)]


def module_docstrings(module_names=DOC_MODULES) -> list[str]:
    """Docstrings of a few stdlib modules and their public classes/functions."""
    docs = []
    for mod_name in module_names:
        mod = importlib.import_module(mod_name)
        docs.append(inspect.getdoc(mod) or "")
        for name in sorted(vars(mod)):
            obj = getattr(mod, name)
            if name.startswith("_") or not (inspect.isroutine(obj) or inspect.isclass(obj)):
                continue
            docs.append(inspect.getdoc(obj) or "")
    return docs


def load_corpus() -> list[str]:
    """Deterministic list of non-empty, de-duplicated documents."""
    seen, corpus = set(), []
    for doc in pydoc_topics() + module_docstrings():
        doc = doc.strip()
        if doc and doc not in seen:
            seen.add(doc)
            corpus.append(doc)
    return corpus


# ------------------------------------------------------------------ tokenizer
def train_bpe(corpus: list[str], vocab_size: int) -> Tokenizer:
    """Byte-level BPE: the full byte alphabet makes any UTF-8 text encodable."""
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=[PAD, BOS, EOS],  # order fixes ids 0, 1, 2
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(corpus, trainer=trainer)
    assert [tok.token_to_id(t) for t in (PAD, BOS, EOS)] == [PAD_ID, BOS_ID, EOS_ID]
    # Like Llama's tokenizer: prepend <s> on encode.
    tok.post_processor = processors.TemplateProcessing(
        single=f"{BOS} $A", pair=f"{BOS} $A {BOS} $B:1", special_tokens=[(BOS, BOS_ID)]
    )
    return tok


def wrap_tokenizer(tok: Tokenizer) -> PreTrainedTokenizerFast:
    return PreTrainedTokenizerFast(
        tokenizer_object=tok,
        bos_token=BOS,
        eos_token=EOS,
        pad_token=PAD,
        padding_side="left",
        model_max_length=MAX_POSITIONS,
        clean_up_tokenization_spaces=False,  # otherwise decode() is not lossless
        # Like Llama: no token_type_ids, which model.generate(**enc) would reject.
        model_input_names=["input_ids", "attention_mask"],
    )


def check_tokenizer(hf_tok: PreTrainedTokenizerFast) -> None:
    """Lossless round trips, and a split emoji so streaming must handle partial UTF-8."""
    for text in ROUND_TRIP_SAMPLES:
        ids = hf_tok(text).input_ids
        assert ids[0] == BOS_ID, f"encode did not prepend <s>: {ids}"
        decoded = hf_tok.decode(ids, skip_special_tokens=True)
        assert decoded == text, f"round trip failed: {text!r} -> {decoded!r}"
    emoji_ids = hf_tok(MULTI_TOKEN_EMOJI, add_special_tokens=False).input_ids
    assert len(emoji_ids) > 1, f"{MULTI_TOKEN_EMOJI} is a single token; pick another emoji"


# ---------------------------------------------------------------------- data
def token_stream(tok: Tokenizer, corpus: list[str]) -> torch.Tensor:
    """All documents concatenated, separated by </s>."""
    ids: list[int] = []
    for enc in tok.encode_batch(corpus, add_special_tokens=False):
        ids.extend(enc.ids)
        ids.append(EOS_ID)
    return torch.tensor(ids, dtype=torch.long)


def make_blocks(stream: torch.Tensor, seq_len: int = SEQ_LEN) -> torch.Tensor:
    """Non-overlapping blocks of ``seq_len`` tokens, each starting with <s>.

    A leading <s> matches what the model sees at inference time.
    """
    body = seq_len - 1
    n = len(stream) // body
    blocks = stream[: n * body].view(n, body)
    bos = torch.full((n, 1), BOS_ID, dtype=torch.long)
    return torch.cat([bos, blocks], dim=1)


def batch_indices(num_blocks: int, steps: int, batch_size: int, gen: torch.Generator):
    """Yield index batches from seeded per-epoch permutations."""
    perm, pos = torch.randperm(num_blocks, generator=gen), 0
    for _ in range(steps):
        if pos + batch_size > num_blocks:
            perm, pos = torch.randperm(num_blocks, generator=gen), 0
        yield perm[pos : pos + batch_size]
        pos += batch_size


# --------------------------------------------------------------------- model
def make_model(vocab_size: int) -> LlamaForCausalLM:
    config = LlamaConfig(
        vocab_size=vocab_size,
        hidden_size=256,
        intermediate_size=768,
        num_hidden_layers=4,
        num_attention_heads=8,
        num_key_value_heads=4,  # GQA on purpose, so serving code must handle it
        max_position_embeddings=MAX_POSITIONS,
        rope_theta=10000.0,
        tie_word_embeddings=False,
        bos_token_id=BOS_ID,
        eos_token_id=EOS_ID,
        pad_token_id=PAD_ID,
        torch_dtype="float32",
    )
    model = LlamaForCausalLM(config)
    model.generation_config = GenerationConfig(
        bos_token_id=BOS_ID, eos_token_id=EOS_ID, pad_token_id=PAD_ID
    )
    return model


def lr_lambda(steps: int):
    """Linear warm-up, then cosine decay to 10% of the peak learning rate."""
    warmup = max(1, steps // 10)

    def fn(step: int) -> float:
        if step < warmup:
            return (step + 1) / warmup
        frac = (step - warmup) / max(1, steps - warmup)
        return 0.1 + 0.9 * 0.5 * (1.0 + math.cos(math.pi * frac))

    return fn


def progress(iterable, total: int):
    if tqdm is None:
        return iterable
    # Redraw rarely when stderr is a log file rather than a terminal.
    interval = 0.1 if sys.stderr.isatty() else 10.0
    return tqdm(iterable, total=total, desc="train", unit="step", mininterval=interval)


def train(model, blocks: torch.Tensor, steps: int, seed: int) -> float:
    """Train in place; return the mean loss of the last (up to) 10 steps."""
    opt = torch.optim.AdamW(model.parameters(), lr=LR, betas=(0.9, 0.95), weight_decay=0.1)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lr_lambda(steps))
    gen = torch.Generator().manual_seed(seed)
    model.train()
    recent: list[float] = []
    bar = progress(batch_indices(len(blocks), steps, BATCH_SIZE, gen), steps)
    for step, idx in enumerate(bar):
        batch = blocks[idx]
        loss = model(input_ids=batch, labels=batch).loss
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        sched.step()
        loss_val = loss.item()
        recent = (recent + [loss_val])[-10:]
        if tqdm is not None:
            bar.set_postfix(loss=f"{loss_val:.3f}", refresh=False)
        elif step % 25 == 0 or step == steps - 1:
            log(f"step {step + 1}/{steps} loss {loss_val:.3f}")
    model.eval()
    return sum(recent) / len(recent)


# ---------------------------------------------------------------------- save
def save_all(model, hf_tok, out: Path) -> None:
    model.save_pretrained(out, safe_serialization=True)
    hf_tok.save_pretrained(out)
    assert (out / "model.safetensors").is_file(), "model.safetensors missing"
    assert not (out / "pytorch_model.bin").exists(), "pickle weights must not be written"
    assert (out / "generation_config.json").is_file()
    assert (out / "tokenizer.json").is_file()


def make_readable(directory: Path) -> None:
    """safetensors writes 0600 files; a server running as another user must read them."""
    for path in directory.iterdir():
        path.chmod(0o644)


def publish(tmp: Path, out: Path) -> None:
    """Move a finished build into place; the old build is only removed afterwards."""
    old = out.with_name(f".{out.name}.old-{os.getpid()}")
    if out.exists():
        os.replace(out, old)
    os.replace(tmp, out)
    shutil.rmtree(old, ignore_errors=True)


def set_determinism(seed: int) -> None:
    torch.manual_seed(seed)
    torch.use_deterministic_algorithms(True)
    torch.set_num_threads(NUM_THREADS)


# ---------------------------------------------------------------------- main
def build(out, steps: int = DEFAULT_STEPS, seed: int = 0, vocab_size: int = 2048) -> dict:
    """Build tokenizer + model into ``out`` atomically; return a summary dict."""
    start = time.perf_counter()
    out = Path(out).resolve()
    out.parent.mkdir(parents=True, exist_ok=True)
    set_determinism(seed)

    corpus = load_corpus()
    log(f"corpus: {len(corpus)} docs, {sum(map(len, corpus)):,} chars")
    tok = train_bpe(corpus, vocab_size)
    hf_tok = wrap_tokenizer(tok)
    check_tokenizer(hf_tok)
    blocks = make_blocks(token_stream(tok, corpus))
    log(f"tokenizer: vocab {len(hf_tok)}; data: {blocks.numel():,} tokens in {len(blocks)} blocks")

    model = make_model(len(hf_tok))
    n_params = sum(p.numel() for p in model.parameters())
    final_loss = train(model, blocks, steps, seed)

    tmp = out.with_name(f".{out.name}.tmp-{os.getpid()}")
    shutil.rmtree(tmp, ignore_errors=True)
    try:
        save_all(model, hf_tok, tmp)
        make_readable(tmp)
        publish(tmp, out)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)

    seconds = time.perf_counter() - start
    log(f"done: {out} params={n_params:,} steps={steps} final_loss={final_loss:.4f} seconds={seconds:.1f}")
    return {"out": str(out), "params": n_params, "final_loss": final_loss, "seconds": seconds}


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default="build/tiny-llama", help="output directory")
    parser.add_argument("--steps", type=int, default=DEFAULT_STEPS, help="training steps")
    parser.add_argument("--seed", type=int, default=0, help="seed of the weights and the training order (default 0)")
    parser.add_argument("--vocab-size", type=int, default=2048, help="BPE vocabulary to train (default 2048)")
    args = parser.parse_args(argv)
    if args.steps < 1:
        parser.error("--steps must be >= 1")
    return args


def main(argv=None) -> None:
    args = parse_args(argv)
    build(args.out, steps=args.steps, seed=args.seed, vocab_size=args.vocab_size)


if __name__ == "__main__":
    main()
