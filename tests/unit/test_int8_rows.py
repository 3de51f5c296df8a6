"""int8 weights with a float32 scale per row (llama_engine/backends/int8_rows.py): the quantization, the one
buffer that carries values and scales, and the checks that catch a copy that lost its scales."""
import pytest
import torch

from llama_engine.backends import int8_rows


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("rows, columns", [(1, 1), (3, 7), (64, 100), (5, 4096)])
def test_each_row_is_rounded_to_127_levels_of_its_own_largest_magnitude(dtype, rows, columns):
    gen = torch.Generator().manual_seed(rows * columns)
    weight = (torch.randn(rows, columns, generator=gen) * torch.rand(rows, 1, generator=gen) * 3).to(dtype)
    quantized = int8_rows.quantize(weight)
    assert quantized.dtype == torch.int8 and quantized.shape == (rows, columns) and quantized.is_contiguous()
    scales = int8_rows.scales(quantized)
    wide = weight.float()
    assert torch.equal(scales, wide.abs().amax(1) / 127)
    assert torch.equal(quantized.abs().amax(1), torch.full((rows,), 127, dtype=torch.int8))
    error = (int8_rows.dequantize(quantized) - wide).abs()
    assert (error <= scales[:, None] / 2 * (1 + 1e-5)).all()  # a tie (x.5 levels) is off by half a level
    assert int8_rows.dequantize(quantized, torch.bfloat16).dtype == torch.bfloat16


def test_a_row_of_zeros_keeps_a_zero_scale_and_zero_values():
    weight = torch.randn(3, 16)
    weight[1] = 0
    quantized = int8_rows.quantize(weight)
    assert int8_rows.scales(quantized)[1] == 0 and not quantized[1].any()
    assert torch.equal(int8_rows.dequantize(quantized)[1], torch.zeros(16))


def test_the_weight_to_quantize_is_left_as_it_was():
    weight = torch.randn(4, 32)
    before = weight.clone()
    int8_rows.quantize(weight)
    assert torch.equal(weight, before)


@pytest.mark.parametrize("bad, message", [
    (torch.tensor([[1.0, float("inf")]]), "inf or NaN"),
    (torch.tensor([[float("nan"), 1.0]]), "inf or NaN"),
    (torch.randn(8), "a 2-D floating weight"),
    (torch.ones(2, 2, dtype=torch.int32), "a 2-D floating weight"),
])
def test_weights_no_scale_represents_are_refused_saying_why(bad, message):
    with pytest.raises(ValueError, match=message):
        int8_rows.quantize(bad)


@pytest.mark.parametrize("rows, columns", [(3, 5), (64, 64), (7, 100)])
def test_the_scales_sit_from_the_next_64_bytes_after_the_values_in_the_same_buffer(rows, columns):
    """What the native kernels read: the values at the pointer, the scales at it plus the values' bytes rounded
    up to 64."""
    quantized = int8_rows.quantize(torch.randn(rows, columns))
    offset = int8_rows.scales_offset(rows, columns)
    assert offset % 64 == 0 and rows * columns <= offset < rows * columns + 64
    assert int8_rows.scales(quantized).data_ptr() == quantized.data_ptr() + offset
    assert int8_rows.nbytes((rows, columns)) == offset + 4 * rows


def test_a_copy_of_the_values_alone_has_no_scales_and_says_so():
    quantized = int8_rows.quantize(torch.randn(8, 64))
    for copy in (quantized.clone(), torch.zeros(8, 64, dtype=torch.int8), quantized.float()):
        assert not int8_rows.carries_scales(copy)
        with pytest.raises(ValueError, match="no scales behind it"):
            int8_rows.scales(copy)
    assert int8_rows.carries_scales(quantized)


def test_a_weight_copied_into_its_place_in_a_block_keeps_values_and_scales():
    """A block of weights in decode order (fast_linear.gathered_block): each place starts on a multiple of 64
    bytes and holds its values and scales; a place without room for the scales, or of another shape, is
    refused."""
    weights = [int8_rows.quantize(torch.randn(rows, 40)) for rows in (3, 9)]
    block = torch.empty(1024, dtype=torch.int8)
    at, places = 0, []
    for weight in weights:
        place = block[at:at + weight.numel()].view(weight.shape)
        places.append(int8_rows.copy_into(place, weight))
        at += -(-int8_rows.nbytes(weight.shape) // 64) * 64
    for place, weight in zip(places, weights):
        assert int8_rows.carries_scales(place)
        assert torch.equal(place, weight) and torch.equal(int8_rows.scales(place), int8_rows.scales(weight))
    tight = torch.empty(3 * 40, dtype=torch.int8).view(3, 40)
    with pytest.raises(ValueError, match="room for its scales"):
        int8_rows.copy_into(tight, weights[0])
    with pytest.raises(ValueError, match=r"the place for a \(3, 40\) weight"):
        int8_rows.copy_into(int8_rows.empty((40, 3)), weights[0])
    filled = int8_rows.quantize(torch.randn(3, 40), out=int8_rows.empty((3, 40)))
    assert int8_rows.carries_scales(filled)
    with pytest.raises(ValueError, match="room for its scales"):
        int8_rows.quantize(torch.randn(3, 40), out=tight)
