"""What a loaded model leaves in memory once its weights are repacked.

``from_pretrained`` reads a safetensors checkpoint through a mapping of the file, and the
model's tensors are views of it. The torch backend then repacks the linears' weights into
memory of its own (fused, in pair panels, gathered in decode order), so the mapping serves
only what was left as loaded: the norms and the embedding, a few MB. Those few pinned the
whole file: every page a load had read stayed resident as the file's (2.06 GB of the 2.07 GB
beyond-cache model, AMX Xeon), beside the repacked copies. :func:`settle_loaded_weights`
copies such leftovers out, so that the mapping goes, and hands the heap's freed blocks back.

While the backend repacks one layer, :func:`read_ahead` has the kernel read the next one's pages,
and where memory cannot hold the checkpoint's pages beside the repacked weights
(:func:`checkpoint_pages_crowd`), :func:`drop_pages` reclaims each layer's once it is repacked.
"""
from __future__ import annotations

import logging
from itertools import chain
from typing import Dict, Iterable, List, Sequence, Set, Tuple

import torch
from torch import nn

from ..cpu import (
    available_memory,
    drop_file_pages,
    file_mapped_ranges,
    process_memory,
    read_pages_ahead,
    release_freed_memory,
)

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
    return sum(size for address, size in mapped_spans(module, ranges) if read_pages_ahead(address, size))


def mapped_spans(module: nn.Module, ranges: Sequence[Tuple[int, int]]) -> Set[Tuple[int, int]]:
    """``(address, bytes)`` of each of ``module``'s CPU tensors that views one of ``ranges`` (file mappings)."""
    spans = set()
    for tensor in chain(module.parameters(), module.buffers()) if ranges else ():
        if tensor.device.type != "cpu" or tensor.layout != torch.strided:  # oneDNN's packed weights: no pointer
            continue
        address = tensor.data_ptr()
        if any(start <= address < end for start, end in ranges):
            spans.add((address, tensor.numel() * tensor.element_size()))
    return spans


def checkpoint_pages_crowd(checkpoint_bytes: int) -> bool:
    """Whether the memory the kernel could give (:func:`.cpu.available_memory`) is less than a checkpoint of
    ``checkpoint_bytes`` read into the page cache and its weights repacked beside it: the kernel will then
    evict the checkpoint's pages to make room for the repacked copies, under their page faults.

    Under that pressure a page fault reclaimed and compacted memory for the huge pages of the weights' block.
    Loading the Llama-2-7B-shaped checkpoint (AMX Xeon, 23.5 GiB; 3 alternated loads each) took 815-1,132
    compaction stalls and 26.5-35.8 s under float32 arithmetic over its bf16 weights, 28.1-30.2 s in bf16;
    with each layer's pages reclaimed once it was repacked (:func:`drop_pages`), none, and 14.8-17.4 s and
    16.6-17.7 s. Where memory holds both, the pages stay cached for the next load."""
    available = available_memory()
    return available is not None and available < 2 * checkpoint_bytes


def drop_pages(spans: Iterable[Tuple[int, int]]) -> int:
    """Reclaim the pages under ``spans`` (``(address, bytes)`` of file mappings, :func:`mapped_spans`) now;
    returns the bytes the kernel took the advice for. Read again from the file where touched again."""
    return sum(size for address, size in spans if drop_file_pages(address, size))
