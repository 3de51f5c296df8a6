"""The benchmark model: a random-weight Llama of 116M parameters, built offline and deterministically.

Weights are random (``LlamaForCausalLM``'s own initialisation under a fixed seed); the
figures measure compute and memory traffic, never quality. The tokenizer is the one of
``build/tiny-llama`` (byte-level BPE, 2048 tokens), so nothing is downloaded.

EOS is suppressed by the tokenizer, not by the handler: the bench model's tokenizer declares
no EOS token (``eos_token: null``; ``</s>`` stays in the vocabulary as an ordinary added
token) and ``config.json``/``generation_config.json`` carry no ``eos_token_id``. The engine
stops a row on ``tokenizer.eos_token_id`` only (``Engine._eos_ids`` returns nothing when it is
None), so every request runs to its ``max_new_tokens`` and reports ``finish_reason: length``,
whatever random token the model emits. Peers get ``ignore_eos: true`` in the request.
"""
from __future__ import annotations

import json
import math
import os
import shutil
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Dict, Optional

ROOT = Path(__file__).resolve().parents[2]
TINY = ROOT / "build" / "tiny-llama"
DTYPE_DIRS = {"bfloat16": "bf16", "float32": "fp32"}
SPEC_FILE = "bench-model.json"


@dataclass(frozen=True)
class ModelSpec:
    hidden_size: int = 768
    intermediate_size: int = 3072
    num_hidden_layers: int = 12
    num_attention_heads: int = 12
    num_key_value_heads: int = 12
    max_position_embeddings: int = 1024
    rope_theta: float = 10000.0
    seed: int = 0


def model_dir(dtype: str, root: Path = ROOT / "build") -> Path:
    return root / f"bench-model-{DTYPE_DIRS[dtype]}"


def _save_tokenizer_without_eos(src: Path, out: Path):
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(src)
    tok.eos_token = None
    tok.save_pretrained(out)
    return tok


def _check_no_eos(out: Path) -> None:
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(out)
    if tok.eos_token_id is not None:
        raise RuntimeError(f"{out}: the tokenizer still declares EOS id {tok.eos_token_id}")


def _publish(tmp: Path, out: Path) -> None:
    for path in tmp.iterdir():
        path.chmod(0o644)  # safetensors writes 0600; a server of another user must read it
    old = out.with_name(f".{out.name}.old-{os.getpid()}")
    if out.exists():
        os.replace(out, old)
    os.replace(tmp, out)
    shutil.rmtree(old, ignore_errors=True)


def llama_config(spec: ModelSpec, vocab: int, dtype: str):
    """The ``LlamaConfig`` of a random-weight model of ``spec``: untied embeddings, BOS 1, pad 0 and no EOS
    (so that generation runs its full length)."""
    from transformers import LlamaConfig

    return LlamaConfig(
        vocab_size=vocab, hidden_size=spec.hidden_size, intermediate_size=spec.intermediate_size,
        num_hidden_layers=spec.num_hidden_layers, num_attention_heads=spec.num_attention_heads,
        num_key_value_heads=spec.num_key_value_heads, max_position_embeddings=spec.max_position_embeddings,
        rope_theta=spec.rope_theta, tie_word_embeddings=False, bos_token_id=1, eos_token_id=None,
        pad_token_id=0, torch_dtype=dtype, architectures=["LlamaForCausalLM"])


def ensure_bench_models(dtypes=("bfloat16", "float32"), tokenizer_src: Path = TINY,
                        root: Path = ROOT / "build", spec: ModelSpec = ModelSpec(), log=print) -> Dict[str, Path]:
    """Build ``build/bench-model-{bf16,fp32}`` unless they exist with the same spec; return their paths."""
    wanted = {"spec": asdict(spec), "tokenizer_src": str(Path(tokenizer_src).resolve())}
    paths = {d: model_dir(d, root) for d in dtypes}
    missing = [d for d, p in paths.items()
               if not (p / "model.safetensors").exists() or not (p / SPEC_FILE).exists()
               or json.loads((p / SPEC_FILE).read_text()).get("spec") != wanted["spec"]]
    if not missing:
        return paths
    if not (Path(tokenizer_src) / "tokenizer.json").exists():
        raise SystemExit(f"no tokenizer at {tokenizer_src}; build the tiny model first: "
                         "python scripts/build_tiny_llama.py --out build/tiny-llama (or make build)")
    import torch
    from transformers import AutoTokenizer, GenerationConfig, LlamaForCausalLM

    vocab = len(AutoTokenizer.from_pretrained(tokenizer_src))
    torch.manual_seed(spec.seed)
    model = LlamaForCausalLM(llama_config(spec, vocab, "float32")).eval()  # deterministic under the seed on one torch version
    n_params = sum(p.numel() for p in model.parameters())
    log(f"bench model: {n_params / 1e6:.1f}M parameters, random weights (seed {spec.seed}), vocab {vocab}")
    for dtype in sorted(missing, key=lambda d: d != "float32"):  # float32 first: .to() converts in place
        out = paths[dtype]
        out.parent.mkdir(parents=True, exist_ok=True)
        tmp = out.with_name(f".{out.name}.tmp-{os.getpid()}")
        shutil.rmtree(tmp, ignore_errors=True)
        try:
            variant = model.to(getattr(torch, dtype))
            variant.config.torch_dtype = dtype
            variant.generation_config = GenerationConfig(bos_token_id=1, pad_token_id=0, eos_token_id=None)
            variant.save_pretrained(tmp, safe_serialization=True)
            _save_tokenizer_without_eos(tokenizer_src, tmp)
            _check_no_eos(tmp)
            (tmp / SPEC_FILE).write_text(json.dumps({**wanted, "dtype": dtype, "parameters": n_params,
                                                     "random_weights": True, "eos_token": None}, indent=1))
            _publish(tmp, out)
        finally:
            shutil.rmtree(tmp, ignore_errors=True)
        log(f"wrote {out}")
    return paths


def no_eos_copy(src: Path, out: Path) -> Path:
    """A copy of a checkpoint (the tiny model, for --smoke) whose tokenizer declares no EOS."""
    if (out / "model.safetensors").exists() and (out / SPEC_FILE).exists():
        return out
    tmp = out.with_name(f".{out.name}.tmp-{os.getpid()}")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    for name in ("model.safetensors", "config.json"):
        shutil.copy2(src / name, tmp / name)
    config = json.loads((tmp / "config.json").read_text())
    config["eos_token_id"] = None
    (tmp / "config.json").write_text(json.dumps(config, indent=2))
    gen = json.loads((src / "generation_config.json").read_text())
    gen.pop("eos_token_id", None)
    (tmp / "generation_config.json").write_text(json.dumps(gen, indent=2))
    _save_tokenizer_without_eos(src, tmp)
    _check_no_eos(tmp)
    (tmp / SPEC_FILE).write_text(json.dumps({"copy_of": str(src), "eos_token": None}))
    _publish(tmp, out)
    return out


def served_weight_dtype(handler, checkpoint: Path) -> str:
    """The dtype the torch backend keeps ``checkpoint``'s linear weights in under ``handler`` (a
    :class:`~llama_engine.config.HandlerConfig` whose ``dtype`` is resolved): bfloat16 for a bf16
    checkpoint computed in float32 where ``weight_dtype: auto`` keeps it, else the arithmetic's."""
    import torch

    from llama_engine.backends.torch_backend import DTYPES, checkpoint_dtype, weight_dtype_for

    chosen = weight_dtype_for(handler.weight_dtype, DTYPES[handler.dtype], torch.device("cpu"),
                              checkpoint_dtype(str(checkpoint)))
    return str(chosen).replace("torch.", "")


def describe(path: Path, dtype: str, weight_dtype: Optional[str] = None, random_weights: bool = True) -> dict:
    """Parameter counts and the bytes of weights a batch-1 decode step reads: ``weight_dtype``'s
    width (the linears' dtype as served; default ``dtype``, the arithmetic's)."""
    import torch
    from safetensors import safe_open

    from llama_engine.backends import cpu_kernels
    from llama_engine.backends.torch_backend import kv_cache_dtype_for

    config = json.loads((path / "config.json").read_text())
    total = embed = rows = 0
    with safe_open(str(path / "model.safetensors"), "pt") as f:
        for name in f.keys():
            shape = f.get_slice(name).get_shape()
            n = math.prod(shape)
            total += n
            if name.endswith("embed_tokens.weight"):
                embed += n
            elif len(shape) == 2:
                rows += shape[0]
    weight_dtype = weight_dtype or dtype
    width = {"float32": 4, "bfloat16": 2, "float16": 2}[weight_dtype]
    hidden = config["hidden_size"]
    kv_heads = config.get("num_key_value_heads") or config["num_attention_heads"]
    head_dim = hidden // config["num_attention_heads"]
    # A decode step reads every weight once, except the input embedding (one row per token).
    weight_bytes = (total - embed + hidden) * width
    # int8 weights (handler.weight_dtype: int8): a byte a weight and a float32 scale per row of each matrix
    int8_bytes = (total - embed + hidden) + 4 * rows
    kv_dtype = kv_cache_dtype_for("auto", getattr(torch, weight_dtype), torch.device("cpu"),
                                  native_attention=cpu_kernels.load() is not None)
    kv_width = torch.finfo(kv_dtype).bits // 8
    kv_bytes_per_position = 2 * config["num_hidden_layers"] * kv_heads * head_dim * kv_width
    return {
        "path": str(path), "dtype": dtype, "weight_dtype": weight_dtype,
        "checkpoint_dtype": config.get("torch_dtype"), "parameters": total, "embedding_parameters": embed,
        "hidden_size": hidden, "intermediate_size": config["intermediate_size"],
        "num_hidden_layers": config["num_hidden_layers"], "num_attention_heads": config["num_attention_heads"],
        "num_key_value_heads": kv_heads, "vocab_size": config["vocab_size"],
        "weight_bytes_per_token": weight_bytes, "int8_weight_bytes_per_token": int8_bytes,
        "kv_cache_bytes_per_position": kv_bytes_per_position,
        "random_weights": random_weights, "eos_token": None,
    }
