"""Hardware backends, one module per stack, imported only when chosen: ``torch_backend``
(HF transformers on CPU or CUDA), ``llamacpp_backend`` (llama.cpp on CPU, over a GGUF the
build writes), ``neuron_backend`` (transformers-neuronx on Inferentia2).

A backend whose stack compiles (Neuron always, torch with ``compile: true``) loads through
the compile cache shipped in the model directory (``compile_cache.activate``); the build
step instead passes ``build_cache_dir`` to compile into a cache of its own. A Neuron backend
loads the shipped ``model.save()`` graphs of a verified cache (``CacheSession.saved_neffs``).
"""
from __future__ import annotations

import os
from pathlib import Path
from typing import Optional, Tuple

from .. import compile_cache
from .base import Backend, SlotBackend


def cache_kind_and_settings(cfg, batch_size: int,
                            continuous: bool = False) -> Optional[Tuple[compile_cache.CacheKind, dict]]:
    """What the compiled artifacts depend on, for the manifest; None if nothing is compiled.

    ``continuous`` marks a continuous-batching build (``batch_size`` is then the slot count),
    whose Neuron graphs differ from a static build's of the same batch size.
    """
    if cfg.backend == "neuron":
        settings = {
            "tp_degree": cfg.tp_degree, "amp": cfg.amp, "batch_size": batch_size,
            "n_positions": list(cfg.n_positions), "context_length_estimate": list(cfg.context_length_estimate),
            "neuron_cc_flags": cfg.neuron_cc_flags, "gqa": cfg.gqa,
        }
        if continuous:
            settings["continuous_batching"] = True
        return compile_cache.NEURON, settings
    if cfg.backend == "torch" and cfg.compile:
        from .torch_backend import resolve_dtype  # graphs depend on the dtype ``auto`` resolves to here

        return compile_cache.INDUCTOR, {
            "dtype": resolve_dtype(cfg.dtype, cfg.device), "batch_size": batch_size, "max_length": cfg.max_length, "device": cfg.device,
        }
    return None


def prepare_cache(cfg, model_dir: str, batch_size: int, build_cache_dir: Optional[str] = None,
                  continuous: bool = False) -> Optional[compile_cache.CacheSession]:
    compiled = cache_kind_and_settings(cfg, batch_size, continuous)
    if compiled is None:
        return None
    kind, settings = compiled
    if build_cache_dir is not None:
        Path(build_cache_dir).mkdir(parents=True, exist_ok=True)
        return compile_cache.CacheSession.start(kind, Path(build_cache_dir).resolve())
    return compile_cache.activate(model_dir, cfg.compile_cache, kind, settings, cfg.allow_recompile)


def create_backend(cfg, model_dir: str, batch_size: int = 1, build_cache_dir: Optional[str] = None) -> Backend:
    session = prepare_cache(cfg, model_dir, batch_size, build_cache_dir)
    backend = _load(cfg, model_dir, batch_size, session)
    backend.compile_session = session
    return backend


def _load(cfg, model_dir: str, batch_size: int, session: Optional[compile_cache.CacheSession]) -> Backend:
    model_path = os.path.join(model_dir, cfg.model_path)
    if cfg.backend == "neuron":
        from .neuron_backend import NeuronBackend

        return NeuronBackend(model_path, cfg, batch_size, saved_neffs=session.saved_neffs())
    if cfg.backend == "llamacpp":
        from .llamacpp_backend import LlamaCppBackend

        return LlamaCppBackend(os.path.join(model_path, cfg.gguf), cfg.max_length, batch_size,
                               decode_threads=cfg.decode_threads, flash_attn=cfg.flash_attn)
    if cfg.compile:
        from .torch_backend import CompiledTorchBackend

        return CompiledTorchBackend(model_path, batch_size, dtype=cfg.dtype, device=cfg.device,
                                    max_length=cfg.max_length)
    from .torch_backend import TorchBackend

    return TorchBackend(model_path, dtype=cfg.dtype, device=cfg.device, max_length=cfg.max_length,
                        batch_size=batch_size, kv_cache_dtype=cfg.kv_cache_dtype, weight_dtype=cfg.weight_dtype)


def create_slot_backend(cfg, model_dir: str, max_slots: int, build_cache_dir: Optional[str] = None) -> SlotBackend:
    """A backend with ``max_slots`` independent sequences, for continuous batching."""
    model_path = os.path.join(model_dir, cfg.model_path)
    if cfg.backend == "torch" and cfg.compile:
        raise ValueError("handler.compile is not supported with continuous batching yet; set compile: false "
                         "or use micro-batching")
    session = prepare_cache(cfg, model_dir, max_slots, build_cache_dir, continuous=True)
    if cfg.backend == "neuron":
        from .neuron_backend import NeuronSlotBackend

        backend = NeuronSlotBackend(model_path, cfg, max_slots, saved_neffs=session.saved_neffs())
    elif cfg.backend == "llamacpp":
        from .llamacpp_backend import LlamaCppSlotBackend

        backend = LlamaCppSlotBackend(os.path.join(model_path, cfg.gguf), max_slots, cfg.max_length,
                                      decode_threads=cfg.decode_threads, flash_attn=cfg.flash_attn)
    else:
        from .torch_backend import TorchSlotBackend

        backend = TorchSlotBackend.from_pretrained(model_path, max_slots, max_length=cfg.max_length,
                                                   dtype=cfg.dtype, device=cfg.device,
                                                   kv_cache_dtype=cfg.kv_cache_dtype, weight_dtype=cfg.weight_dtype)
    backend.compile_session = session
    return backend


__all__ = ["Backend", "SlotBackend", "cache_kind_and_settings", "create_backend", "create_slot_backend",
           "prepare_cache"]
