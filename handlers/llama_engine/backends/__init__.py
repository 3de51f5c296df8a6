"""Hardware backends, one module per stack, imported only when chosen."""
from __future__ import annotations

import os

from .base import Backend


def create_backend(handler_cfg, model_dir: str) -> Backend:
    model_path = os.path.join(model_dir, handler_cfg.model_path)
    if handler_cfg.backend == "torch":
        from .torch_backend import TorchBackend

        return TorchBackend(model_path, dtype=handler_cfg.dtype, device=handler_cfg.device,
                            max_length=handler_cfg.max_length)
    raise ValueError(f"handler.backend {handler_cfg.backend!r} is not available in this build")


__all__ = ["Backend", "create_backend"]
