"""One block for a decode step's weights (``llama_engine.cpu.huge_page_empty``,
``fast_linear.gather_weights``): where it starts, what the kernel maps it with, and the weights that
move into it keep their values and shapes in the order given."""
import re
import sys

import pytest
import torch
from torch import nn

from llama_engine import cpu as cpu_info
from llama_engine.backends import fast_linear
from llama_engine.backends.fast_linear import NativeLinear, gather_weights

LINUX = sys.platform.startswith("linux")


def huge_pages_of(address: int) -> int:
    """The kB of the mapping holding ``address`` that the kernel maps with huge pages (/proc/self/smaps)."""
    mapping = None
    with open("/proc/self/smaps", encoding="utf-8") as smaps:
        for line in smaps:
            bounds = re.match(r"([0-9a-f]+)-([0-9a-f]+) ", line)
            if bounds:
                mapping = (int(bounds.group(1), 16), int(bounds.group(2), 16))
            elif line.startswith("AnonHugePages:") and mapping[0] <= address < mapping[1]:
                return int(line.split()[1])
    raise AssertionError(f"no mapping holds {address:#x}")


@pytest.mark.parametrize("text, mode", [("always [madvise] never\n", "madvise"), ("[always] madvise never", "always"),
                                        ("always madvise [never]", "never")])
def test_the_kernels_huge_page_mode_is_the_bracketed_word(tmp_path, text, mode):
    (tmp_path / "enabled").write_text(text)
    assert cpu_info.transparent_huge_pages(tmp_path / "enabled") == mode
    assert cpu_info.transparent_huge_pages(tmp_path / "missing") == ""


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_a_huge_page_block_starts_on_2_mib_and_is_mapped_with_huge_pages_where_the_kernel_allows(dtype):
    numel = (6 << 20) // torch.empty(0, dtype=dtype).element_size() + 5
    block, advised = cpu_info.huge_page_empty(numel, dtype)
    assert block.shape == (numel,) and block.dtype == dtype and block.data_ptr() % cpu_info.HUGE_PAGE == 0
    block.copy_(torch.arange(numel, dtype=torch.float32).to(dtype))  # every page written
    assert float(block[-1]) == float(torch.tensor(numel - 1, dtype=torch.float32).to(dtype))
    mode = cpu_info.transparent_huge_pages()
    assert advised == (LINUX and mode in ("always", "madvise"))
    if advised:  # 6 MiB from a 2 MiB boundary: three huge pages, unless memory is too fragmented for any
        assert huge_pages_of(block.data_ptr()) >= 2048, "the kernel mapped no huge page over the advised block"


def test_without_anonymous_mappings_the_block_is_a_plain_tensor(monkeypatch):
    import mmap

    monkeypatch.delattr(mmap, "MAP_ANONYMOUS")
    block, advised = cpu_info.huge_page_empty(1000, torch.float32)
    assert block.shape == (1000,) and block.dtype == torch.float32 and not advised


def native_linears(shapes, dtype=torch.bfloat16):
    torch.manual_seed(0)
    return [NativeLinear(nn.Linear(k, n, bias=False).to(dtype), kernels=None) for n, k in shapes]


def test_gathered_weights_lie_one_after_another_in_the_order_given_with_their_values():
    linears = native_linears([(96, 64), (64, 96), (200, 64), (64, 100)])  # 64 x 100 bf16: not a whole line
    before = [linear.weight.clone() for linear in linears]
    block = gather_weights(linears)
    assert block is not None and block.data_ptr() % cpu_info.HUGE_PAGE == 0
    start = block.data_ptr()
    for linear, weight in zip(linears, before):
        assert torch.equal(linear.weight, weight) and linear.weight.is_contiguous()
        assert linear.weight.data_ptr() == start and start % fast_linear.GATHER_ALIGN == 0
        assert linear.weight.untyped_storage().data_ptr() == block.untyped_storage().data_ptr()
        end = start + weight.numel() * weight.element_size()
        start = -(-end // fast_linear.GATHER_ALIGN) * fast_linear.GATHER_ALIGN
    linears[0].weight.add_(1)  # a view of the block, not a copy
    assert torch.equal(block[:96 * 64].view(96, 64), before[0] + 1)


def test_weights_of_two_dtypes_or_the_switch_off_stay_where_they_were(monkeypatch):
    mixed = native_linears([(64, 64)]) + native_linears([(64, 64)], torch.float32)
    pointers = [linear.weight.data_ptr() for linear in mixed]
    assert gather_weights(mixed) is None and [linear.weight.data_ptr() for linear in mixed] == pointers
    monkeypatch.setenv(fast_linear.GATHER_ENV, "0")
    same = native_linears([(64, 64), (64, 64)])
    pointers = [linear.weight.data_ptr() for linear in same]
    assert gather_weights(same) is None and [linear.weight.data_ptr() for linear in same] == pointers
    assert gather_weights([]) is None


def test_a_planned_block_keeps_the_weights_laid_out_at_their_places_and_copies_in_the_rest(caplog):
    """``GatheredBlock``: a weight made at its place (``NativeLinear``'s ``place``, converted to the kept dtype
    as it is written there) stays there; the others are copied to theirs."""
    linears = native_linears([(96, 64), (64, 96), (200, 64)])
    planned = fast_linear.GatheredBlock.plan([linear.weight.shape for linear in linears], torch.bfloat16)
    assert planned.holds([linear.weight for linear in linears])
    wide = nn.Linear(96, 64, bias=False)
    linears[1] = NativeLinear(wide, kernels=None, weight_dtype=torch.bfloat16, place=planned.places[1])
    assert linears[1].weight.data_ptr() == planned.places[1].data_ptr()
    before = [linear.weight.clone() for linear in linears]
    assert torch.equal(before[1], wide.weight.detach().to(torch.bfloat16))
    with caplog.at_level("INFO", logger=fast_linear.__name__):
        block = gather_weights(linears, planned)
    assert block.data_ptr() == planned.block.data_ptr() and "(1 laid out there, 2 copied in)" in caplog.text
    assert [linear.weight.data_ptr() for linear in linears] == [place.data_ptr() for place in planned.places]
    assert all(torch.equal(linear.weight, weight) for linear, weight in zip(linears, before))


def test_a_place_of_another_shape_or_dtype_is_not_taken():
    """A weight goes where it would have gone without the place; a plan for other weights is not used."""
    linear = nn.Linear(96, 64, bias=False).to(torch.bfloat16)
    for place in (torch.empty(64, 96), torch.empty(96, 64, dtype=torch.bfloat16),
                  torch.empty(96, 64, dtype=torch.bfloat16).t()):
        native = NativeLinear(linear, kernels=None, place=place)
        assert native.weight.data_ptr() != place.data_ptr() and torch.equal(native.weight, linear.weight)
    linears = native_linears([(96, 64), (64, 96)])
    planned = fast_linear.GatheredBlock.plan([(64, 96), (64, 96)], torch.bfloat16)
    assert not planned.holds([linear.weight for linear in linears])
    block = gather_weights(linears, planned)
    assert block.data_ptr() != planned.block.data_ptr()
    assert linears[0].weight.untyped_storage().data_ptr() == block.untyped_storage().data_ptr()


def test_no_block_is_planned_with_the_gathering_switched_off(monkeypatch):
    monkeypatch.setenv(fast_linear.GATHER_ENV, "0")
    assert fast_linear.GatheredBlock.plan([(64, 64)], torch.bfloat16) is None
    monkeypatch.delenv(fast_linear.GATHER_ENV)
    assert fast_linear.GatheredBlock.plan([], torch.bfloat16) is None
    assert fast_linear.GatheredBlock.plan([(64, 64)], torch.bfloat16).places[0].shape == (64, 64)
