"""What a loaded model leaves in memory once its weights are repacked.

``from_pretrained`` reads a safetensors checkpoint through a mapping of the file, and the
model's tensors are views of it. The torch backend then repacks the linears' weights into
memory of its own (fused, in pair panels, gathered in decode order), so the mapping serves
only what was left as loaded: the norms and the embedding, a few MB. Those few pinned the
whole file: every page a load had read stayed resident as the file's (2.06 GB of the 2.07 GB
beyond-cache model, AMX Xeon), beside the repacked copies. :func:`settle_loaded_weights`
copies such leftovers out, so that the mapping goes, and hands the heap's freed blocks back.

While the backend repacks one layer, :func:`read_ahead` has the kernel read the next one's pages.
"""
from __future__ import annotations

import logging
from itertools import chain
from typing import Dict, List, Sequence, Tuple

import torch
from torch import nn

from ..cpu import file_mapped_ranges, process_memory, read_pages_ahead, release_freed_memory

logger = logging.getLogger(__name__)

#: A mapping is let go only where the tensors still reading it hold at most this share of its bytes, so
#: that the copies cost less than the pages let go. Where they hold more (linears left as loaded), copying
#: would trade pages that the kernel can drop and read again, and that workers loading the same file share,
#: for as much memory of the process's own.
MAPPED_SHARE = 0.5


def settle_loaded_weights(model: nn.Module) -> Dict[str, int]:
    """Copy out the tensors that alone keep a checkpoint's mapping resident (see the module's doc), give
    glibc's free blocks back to the kernel, and log what the process then holds. Returns
    :func:`.cpu.process_memory` (empty off Linux) with ``copied``: the bytes copied out."""
    copied = copy_out_of_mappings(model)
    release_freed_memory()
    memory = process_memory()
    if memory:
        logger.info("memory once loaded: %.0f MiB of the process's own, %.0f MiB of mapped files; at most %.0f "
                    "MiB resident at once so far, mapped files' pages included (%.1f MiB copied out of the "
                    "checkpoint's mapping)",
                    memory["anon"] / 2**20, memory["file"] / 2**20, memory["peak"] / 2**20, copied / 2**20)
    return {**memory, "copied": copied}


def copy_out_of_mappings(model: nn.Module, share: float = MAPPED_SHARE) -> int:
    """Give ``model``'s CPU tensors that view a file mapping memory of their own, mapping by mapping, where
    they hold at most ``share`` of its bytes; returns the bytes copied. A tensor held by several modules
    (tied weights) is copied once and stays shared."""
    copied = 0
    for (start, end), tensors in _views_by_mapping(model, file_mapped_ranges()).items():
        if sum(t.numel() * t.element_size() for t in tensors) > share * (end - start):
            continue
        with torch.no_grad():
            for tensor in tensors:
                tensor.data = tensor.data.clone()
                copied += tensor.numel() * tensor.element_size()
    return copied


def _views_by_mapping(model: nn.Module, ranges: List[Tuple[int, int]]) -> Dict[Tuple[int, int], List[torch.Tensor]]:
    if not ranges:
        return {}
    views: Dict[Tuple[int, int], List[torch.Tensor]] = {}
    for tensor in chain(model.parameters(), model.buffers()):  # each shared tensor once
        if tensor.device.type != "cpu" or tensor.layout != torch.strided:
            continue
        address = tensor.untyped_storage().data_ptr()
        mapping = next(((start, end) for start, end in ranges if start <= address < end), None)
        if mapping is not None:
            views.setdefault(mapping, []).append(tensor)
    return views


def read_ahead(module: nn.Module, ranges: Sequence[Tuple[int, int]]) -> int:
    """Have the kernel start reading the file pages of ``module``'s tensors that view one of ``ranges`` (file
    mappings, :func:`.cpu.file_mapped_ranges`), and return at once; returns the bytes it was asked for.

    Read as the repacking touched them, a checkpoint whose pages were not all cached came in a fault at a
    time. Loading the Llama-2-7B-shaped checkpoint (AMX Xeon, 23.5 GiB: its 13 GB and the repacked weights
    are more than the machine holds), 6 alternated loads each: 22.5-61.0 s (median 35) without, 22.9-32.9 s
    (median 31) with each layer's pages asked for while the one before it was repacked. It cuts the slow
    loads; a typical one is within the noise."""
    asked = 0
    for tensor in chain.from_iterable(_views_by_mapping(module, list(ranges)).values()):
        size = tensor.numel() * tensor.element_size()
        asked += size if read_pages_ahead(tensor.data_ptr(), size) else 0
    return asked
