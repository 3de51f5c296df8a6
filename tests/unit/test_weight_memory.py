"""A loaded model holds its weights once: repacked copies replace what was loaded, and nothing keeps
the checkpoint's file mapping or the freed loaded copies resident (backends/weight_memory.py,
fast_linear's ``_swap`` and ``gather_weights``)."""
import ctypes
import gc
import json
import mmap
import os
import subprocess
import sys
import time
import weakref
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file
from torch import nn

from llama_engine.backends import cpu_kernels, fast_linear, weight_memory
from llama_engine.backends.weight_memory import copy_out_of_mappings, read_ahead
from llama_engine.cpu import auto_dtype, file_mapped_ranges

HANDLERS = Path(__file__).resolve().parents[2] / "handlers"
linux_only = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="/proc/self/maps and glibc's malloc")


def mappings_of(path: Path) -> int:
    return sum(str(path) in line for line in Path("/proc/self/maps").read_text().splitlines())


def module_from(path: Path, names) -> nn.Module:
    tensors = load_file(str(path))
    module = nn.Module()
    for name in names:
        module.register_parameter(name, nn.Parameter(tensors[name], requires_grad=False))
    return module


@pytest.fixture
def checkpoint(tmp_path) -> Path:
    path = tmp_path / "weights.safetensors"
    save_file({"big": torch.arange(1 << 20, dtype=torch.float32), "small": torch.arange(64, dtype=torch.float32)},
              str(path))
    return path


def cached_share(tensor: torch.Tensor) -> float:
    """The share of the pages under ``tensor`` that the kernel holds (``mincore``): for a file mapping, the
    file's pages in the page cache, read or not through this mapping."""
    page = mmap.PAGESIZE
    start = tensor.data_ptr() - tensor.data_ptr() % page
    pages = -(-(tensor.data_ptr() + tensor.numel() * tensor.element_size() - start) // page)
    vector = (ctypes.c_ubyte * pages)()
    assert ctypes.CDLL(None).mincore(ctypes.c_void_p(start), ctypes.c_size_t(pages * page), vector) == 0
    return sum(byte & 1 for byte in vector) / pages


@linux_only
def test_read_ahead_has_the_kernel_read_a_modules_pages_of_a_file_mapping_and_nothing_else(checkpoint):
    module = module_from(checkpoint, ["big"])
    module.register_buffer("own", torch.ones(1 << 16))
    fd = os.open(checkpoint, os.O_RDONLY)  # the pages the load's reads brought in, dropped: none is mapped yet
    try:
        os.fsync(fd)
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
    finally:
        os.close(fd)
    assert cached_share(module.big) < 0.5  # evicted: what follows is the advice's doing
    assert read_ahead(module, file_mapped_ranges()) == (1 << 20) * 4  # the buffer of its own is not asked for
    deadline = time.monotonic() + 10
    while cached_share(module.big) < 1 and time.monotonic() < deadline:
        time.sleep(0.01)
    assert cached_share(module.big) == 1
    assert read_ahead(module, []) == 0


@linux_only
def test_a_mapping_that_only_small_tensors_still_read_is_let_go(checkpoint):
    module = module_from(checkpoint, ["small"])
    gc.collect()
    assert mappings_of(checkpoint) == 1
    assert copy_out_of_mappings(module) == 64 * 4
    gc.collect()
    assert mappings_of(checkpoint) == 0
    assert torch.equal(module.small, torch.arange(64, dtype=torch.float32))
    assert copy_out_of_mappings(module) == 0  # nothing maps a file any more


@linux_only
def test_a_mapping_whose_tensors_are_most_of_it_is_kept(checkpoint):
    module = module_from(checkpoint, ["big", "small"])
    address = module.big.untyped_storage().data_ptr()
    assert copy_out_of_mappings(module) == 0
    assert module.big.untyped_storage().data_ptr() == address
    assert mappings_of(checkpoint) == 1


@linux_only
def test_a_tied_tensor_is_copied_once_and_stays_tied(checkpoint):
    module = module_from(checkpoint, ["small"])
    module.other = nn.Module()
    module.other.tied = module.small
    assert copy_out_of_mappings(module) == 64 * 4
    assert module.other.tied is module.small


def test_swap_frees_each_replaced_linear_before_making_the_next():
    linears = nn.Sequential(*(nn.Linear(16, 16, bias=False) for _ in range(4)))
    targets = [(linears, name, child) for name, child in linears.named_children()]
    alive = [weakref.ref(child.weight) for _, _, child in targets]
    seen = []

    def make(linear):
        seen.append([ref() is not None for ref in alive])
        return nn.Identity()

    targets_left = list(targets)
    del targets
    assert fast_linear._swap(targets_left, torch.float32, make, "test") == 4
    assert targets_left == []
    # when the k-th replacement is made, the linears replaced before it are gone
    assert seen == [[True, True, True, True], [False, True, True, True], [False, False, True, True],
                    [False, False, False, True]]


GATHER_CHILD = f"""
import sys, torch
sys.path.insert(0, {str(HANDLERS)!r})
from llama_engine.cpu import keep_freed_memory, process_memory
from llama_engine.backends.fast_linear import gather_weights
from torch import nn

class Product(nn.Module):
    def __init__(self):
        super().__init__()
        self.register_buffer("weight", torch.ones(1024, 2048, dtype=torch.bfloat16))  # 4 MiB, from the heap

keep_freed_memory()
products = [Product() for _ in range(64)]
before = process_memory()["anon"]
block = gather_weights(products)
after = process_memory()["anon"]
assert all(p.weight.untyped_storage().data_ptr() == block.untyped_storage().data_ptr() for p in products)
print(before, after, block.numel() * block.element_size())
"""


@linux_only
def test_gathering_weights_leaves_them_resident_once():
    """The loaded copies, freed into the heap as the block fills, go back to the kernel: without that the
    process held the weights twice (kept by :func:`.cpu.keep_freed_memory`, not reused by the block)."""
    out = subprocess.run([sys.executable, "-c", GATHER_CHILD], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    before, after, block = map(int, out.stdout.split())
    assert block == 64 << 22
    assert after - before < block // 4, out.stdout


LOAD_CHILD = """
import json, sys, torch
sys.path.insert(0, {handlers!r})
from llama_engine.backends.torch_backend import TorchSlotBackend
from llama_engine.cpu import file_mapped_ranges
backend = TorchSlotBackend.from_pretrained({model_dir!r}, 2, 64, {dtype!r}, "cpu")
plain = [name for name, m in backend.model.named_modules() if type(m) is torch.nn.Linear]
mapped = sum({model_dir!r} + "/model.safetensors" in line for line in open("/proc/self/maps"))
print(json.dumps({{"plain": plain, "mapped": mapped}}))
"""


@linux_only
@pytest.mark.parametrize("dtype", ["float32", "auto"])
def test_a_loaded_backend_lets_the_checkpoint_mapping_go_once_its_linears_are_repacked(tiny_model_dir, dtype):
    code = LOAD_CHILD.format(handlers=str(HANDLERS), model_dir=str(Path(tiny_model_dir).resolve()), dtype=dtype)
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    result = json.loads(out.stdout.splitlines()[-1])
    if result["plain"]:  # linears left as loaded still read the file: its pages stay the model's
        assert result["mapped"] >= 1, result
    else:
        assert result["mapped"] == 0, result


@linux_only
def test_a_backend_has_each_layers_pages_read_while_the_layer_before_it_is_repacked(tiny_model_dir, monkeypatch):
    from llama_engine.backends import torch_backend

    asked = []

    def record(layer, ranges):
        asked.append((layer, [t.data_ptr() for t in layer.parameters()], list(ranges)))
        return weight_memory.read_ahead(layer, ranges)

    monkeypatch.setattr(torch_backend, "read_ahead", record)
    backend = torch_backend.TorchSlotBackend.from_pretrained(str(tiny_model_dir), 2, 64, "float32", "cpu")
    layers = list(backend.model.model.layers)
    assert [layer for layer, _, _ in asked] == layers[1:]
    for _, pointers, ranges in asked:  # asked for while still as loaded: views of the checkpoint's mapping
        assert pointers and all(any(start <= p < end for start, end in ranges) for p in pointers)


def test_file_mapped_ranges_reads_only_file_mappings(tmp_path):
    maps = tmp_path / "maps"
    maps.write_text("\n".join([
        "7f0000000000-7f0000001000 rw-p 00000000 fe:00 1234  /models/model.safetensors",
        "7f0000002000-7f0000003000 rw-p 00000000 00:00 0 ",
        "7f0000004000-7f0000005000 rw-p 00000000 00:00 0  [heap]",
        "7f0000006000-7f0000008000 r-xp 00000000 fe:00 99  /usr/lib/libc.so.6",
    ]))
    assert file_mapped_ranges(str(maps)) == [(0x7F0000000000, 0x7F0000001000), (0x7F0000006000, 0x7F0000008000)]
    assert file_mapped_ranges(str(tmp_path / "absent")) == []


@linux_only
@pytest.mark.parametrize("weight_dtype", ["auto", pytest.param("int8", marks=pytest.mark.skipif(
    cpu_kernels.load() is None, reason="int8 weights need the native CPU kernels"))])
def test_the_load_memory_bench_prints_the_loads_memory_beside_the_weights_and_cache(tiny_model_dir, weight_dtype):
    root = Path(__file__).resolve().parents[2]
    out = subprocess.run([sys.executable, "-m", "scripts.bench.load_memory", "--model", str(tiny_model_dir),
                          "--slots", "2", "--max-length", "64", "--weight-dtype", weight_dtype], cwd=root,
                         capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    result = json.loads(out.stdout.splitlines()[-1])
    # the tiny checkpoint is float32: auto keeps the arithmetic's dtype, bf16 on a CPU with native bf16
    assert result["weights_dtype"] == ("torch.int8" if weight_dtype == "int8" else f"torch.{auto_dtype('cpu')}")
    assert result["checkpoint_mib"] == round((Path(tiny_model_dir) / "model.safetensors").stat().st_size / 2**20)
    assert result["kv_cache_mib"] >= 0 and result["load_s"] > 0
    assert result["peak_anon_mib"] >= result["loaded_anon_mib"] > result["kv_cache_mib"]


SHARDED_CHILD = """
import json, sys
sys.path.insert(0, {handlers!r})
sys.path.insert(0, {root!r})
from pathlib import Path
from scripts.bench.load_memory import write_random_checkpoint
from scripts.bench.model import ModelSpec
from llama_engine.backends.torch_backend import TorchSlotBackend
out = Path({out!r})
write_random_checkpoint(out, Path({tokenizer!r}), shape=ModelSpec(**{shape!r}), shards=2)
backend = TorchSlotBackend.from_pretrained(str(out), 1, 32, "float32", "cpu")
logits = backend.prefill_slot(0, [1, 5, 9])
mapped = sum(str(out) in line for line in open("/proc/self/maps"))
print(json.dumps({{"mapped": mapped, "vocab": logits.shape[-1], "finite": bool(logits.isfinite().all())}}))
"""


@linux_only
def test_a_sharded_random_checkpoint_loads_and_lets_every_shards_mapping_go(tiny_model_dir, tmp_path):
    """``load_memory --random-checkpoint`` (at a small shape): shards and an index that transformers loads; the
    backend repacks its bf16 weights under float32 arithmetic, and no shard stays mapped."""
    shape = {"hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 3, "num_attention_heads": 4,
             "num_key_value_heads": 4}
    out = tmp_path / "sharded"
    root = Path(__file__).resolve().parents[2]
    code = SHARDED_CHILD.format(handlers=str(HANDLERS), root=str(root), out=str(out), tokenizer=str(tiny_model_dir),
                                shape=shape)
    run = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stderr[-3000:]
    result = json.loads(run.stdout.splitlines()[-1])
    index = json.loads((out / "model.safetensors.index.json").read_text())
    assert sorted(set(index["weight_map"].values())) == ["model-00001-of-00002.safetensors",
                                                        "model-00002-of-00002.safetensors"]
    assert len(index["weight_map"]) == 3 * 9 + 3
    assert json.loads((out / "config.json").read_text())["architectures"] == ["LlamaForCausalLM"]  # as converters need
    assert result["finite"] and result["vocab"] > 0
    assert result["mapped"] == 0, result
