"""The native CPU decode kernels (llama_engine/backends/cpu_kernels.{cpp,py}).

* Each instruction set this CPU runs computes what float64 arithmetic does, to the rounding of
  its dtype: ``linear`` for row, column and inner-dimension tails and strided rows;
  ``decode_attention`` for every dtype pair, head size and GQA group, rows of different lengths
  in slots out of order, a one-position row, and strided queries; ``prompt_attention`` (every
  build, float32 or bf16 queries) for the tails of its panels and work items, GQA groups, head
  sizes, a later chunk over a float32 or bf16 cache, and large scores.
* The fused small ops (``add_rmsnorm``, ``silu_mul``, ``rope_store``) round as the torch ops they
  replace; a decode step's layers in one call (``DecodeLayers``) compute what those kernels called one by
  one compute, bit for bit, for every dtype combination it runs; the thread pool runs every chunk of every job once, whoever calls.
* Building and loading: the file name follows the source, a build is atomic, a shipped library
  is preferred to the cache and rebuilt where it does not load, the kernels' own code needs no
  newer glibc than torch, no compiler means torch's kernels (with the reason logged), the
  switch turns the kernels off or picks an instruction set, and the kernels bring no OpenMP
  runtime of their own.
"""
import logging
import math
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from llama_engine.backends import cpu_kernels, int8_rows
from llama_engine.backends.base import take_greedy_picks
from llama_engine.cpu import _loaded_libgomps, cpu_flags

FLAGS = cpu_flags()
ISAS = [pytest.param(isa, marks=pytest.mark.skipif(not cpu_kernels.ISA_NEEDS[isa] <= FLAGS,
                                                   reason=f"this CPU cannot run {isa}"))
        for isa in cpu_kernels.ISAS]
#: Relative error of one rounding to each dtype.
ROUNDING = {torch.bfloat16: 2 ** -8, torch.float32: 2 ** -24}
#: float32 accumulation: a few units in the last place of the sum of the products' magnitudes.
ACCUMULATION = 4 * 2 ** -24


@pytest.fixture(scope="module")
def kernel_cache(tmp_path_factory):
    return tmp_path_factory.mktemp("kernels")


@pytest.fixture
def isolated(monkeypatch, kernel_cache):
    """Loads that neither reuse this process's kernels nor write outside the test's cache."""
    monkeypatch.setattr(cpu_kernels, "_loaded", {})
    monkeypatch.setenv(cpu_kernels.CACHE_ENV, str(kernel_cache))
    return kernel_cache


@pytest.fixture
def kernels(request, isolated, monkeypatch):
    monkeypatch.setenv(cpu_kernels.ENV, request.param)
    loaded = cpu_kernels.load()
    assert loaded is not None and loaded.isa == request.param
    return loaded


def assert_product(got: torch.Tensor, x: torch.Tensor, w: torch.Tensor) -> None:
    """``got`` is ``x @ w.T`` to one rounding to its dtype and float32 accumulation over the inner dimension."""
    want = x.double() @ w.double().T
    bound = ROUNDING[got.dtype] * want.abs() + ACCUMULATION * (x.double().abs() @ w.double().abs().T)
    excess = (got.double() - want).abs() - bound
    assert excess.max().item() <= 1e-12, f"{(excess > 1e-12).sum().item()} products off by up to {excess.max():.3g}"


@pytest.mark.parametrize("kernels", ISAS, indirect=True)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("rows, inner, outer", [(1, 768, 2304), (3, 768, 770), (5, 100, 9), (8, 3072, 96),
                                                (16, 33, 64), (1, 17, 3), (7, 256, 257), (12, 64, 1), (2, 768, 300),
                                                (6, 40, 77), (14, 96, 10), (1, 104, 5)])
def test_linear_is_the_float64_product_to_the_dtype_rounding(kernels, dtype, rows, inner, outer):
    gen = torch.Generator().manual_seed(rows * inner + outer)
    x = torch.randn(rows, inner, generator=gen).to(dtype)
    w = torch.randn(outer, inner, generator=gen).to(dtype)
    got = kernels.linear(x, w)
    assert got.shape == (rows, outer) and got.dtype == dtype
    assert_product(got, x, w)


@pytest.mark.parametrize("kernels", ISAS, indirect=True)
@pytest.mark.parametrize("rows, inner, outer", [(1, 768, 2304), (3, 768, 770), (5, 100, 9), (8, 3072, 96),
                                                (16, 33, 64), (1, 17, 3), (7, 256, 257), (2, 768, 300), (6, 40, 77),
                                                (14, 96, 10), (1, 104, 5)])
def test_linear_of_float32_rows_over_bf16_weights_is_their_float64_product(kernels, rows, inner, outer):
    """A float32 model whose weights are kept in bf16: the weight is widened exactly, the product is float32's."""
    gen = torch.Generator().manual_seed(rows * inner + outer)
    x = torch.randn(rows, inner, generator=gen)
    w = torch.randn(outer, inner, generator=gen).to(torch.bfloat16)
    got = kernels.linear(x, w)
    assert got.shape == (rows, outer) and got.dtype == torch.float32
    assert_product(got, x, w)


@pytest.mark.parametrize("kernels", ISAS, indirect=True)
@pytest.mark.parametrize("x_dtype, w_dtype", [(torch.bfloat16, torch.bfloat16), (torch.float32, torch.float32),
                                              (torch.float32, torch.bfloat16)])
def test_linear_computes_the_same_bits_at_every_prefetch_distance(kernels, x_dtype, w_dtype):
    """The one-row prefetch distance only moves reads ahead: every distance, the default (0) among them,
    gives the same bits, for one row (where it applies) and for several (where it does not)."""
    gen = torch.Generator().manual_seed(5)
    w = torch.randn(300, 768, generator=gen).to(w_dtype)
    for rows in (1, 3):
        x = torch.randn(rows, 768, generator=gen).to(x_dtype)
        results = []
        for distance in (0, *cpu_kernels.PREFETCH_CANDIDATES, 64, 1 << 16):
            kernels.one_row_prefetch[(x_dtype, w_dtype)] = distance
            results.append(kernels.linear(x, w))
        assert all(torch.equal(results[0], got) for got in results[1:])
        assert_product(results[0], x, w)


@pytest.mark.parametrize("kernels", ISAS, indirect=True)
@pytest.mark.parametrize("x_dtype, w_dtype", [(torch.float32, torch.bfloat16), (torch.float32, torch.int8),
                                              (torch.bfloat16, torch.int8), (torch.float32, torch.float32)])
def test_linear_computes_the_same_bits_on_one_thread_and_on_several(kernels, x_dtype, w_dtype):
    """The threads split w's rows into chunks whose size depends on the thread count (as many as a multiple of
    the threads), each a whole number of tiles: the tiles, and so every output's bits, are the same however
    many threads share them. 769 rows of 768 int8 weights: 3 chunks on one thread, 4 on two, 3 of another size
    on three."""
    gen = torch.Generator().manual_seed(11)
    w = torch.randn(769, 768, generator=gen)  # one row past whole tiles of every shape
    w = int8_rows.quantize(w) if w_dtype == torch.int8 else w.to(w_dtype)
    previous = torch.get_num_threads()
    try:
        for rows in (1, 3, 8):
            x = torch.randn(rows, 768, generator=gen).to(x_dtype)
            results = []
            for threads in (1, 2, 3):
                torch.set_num_threads(threads)
                results.append(kernels.linear(x, w))
            assert all(torch.equal(results[0], got) for got in results[1:]), rows
    finally:
        torch.set_num_threads(previous)


def test_the_prefetch_distance_chosen_is_the_fastest_only_where_it_clearly_beats_the_default():
    default = cpu_kernels.PREFETCH_CANDIDATES[0]
    assert cpu_kernels.choose_prefetch({default: [10.0, 10.2, 11.0], 1024: [8.0, 8.1, 9.5]}) == 1024
    # within the margin (a 2% gain) the default stays
    assert cpu_kernels.choose_prefetch({default: [10.0, 10.0], 1024: [9.8, 9.8]}) == default
    # one lucky pass does not decide: each side's two fastest passes count
    assert cpu_kernels.choose_prefetch({default: [10.0, 10.0, 10.1], 512: [8.0, 12.5, 13.0]}) == default
    assert cpu_kernels.choose_prefetch({default: [10.0, 10.0], 2048: [9.0, 9.0], 1024: [8.0, 8.0]}) == 1024


def test_a_sides_score_is_the_mean_of_its_two_fastest_passes_and_decides():
    """The figures the load-time choices log are these scores: a side with the single fastest pass can lose."""
    passes = {"native": [1.21e-3, 1.40e-3, 1.50e-3], "torch": [1.25e-3, 1.26e-3, 1.60e-3]}
    scores = cpu_kernels.pass_scores(passes)
    assert scores["native"] == pytest.approx(1.305e-3) and scores["torch"] == pytest.approx(1.255e-3)
    assert cpu_kernels.choose_fastest(passes, "native", margin=0.0) == "torch"
    assert cpu_kernels.pass_scores({"one": [2.0]}) == {"one": 2.0}


@pytest.mark.parametrize("kernels", ISAS, indirect=True)
def test_the_one_row_prefetch_is_measured_once_per_dtype_pair_unless_the_environment_sets_it(kernels, monkeypatch):
    weights = [torch.randn(64, 256).to(torch.bfloat16) for _ in range(3)]
    measured = []
    real_choose = cpu_kernels.choose_prefetch

    def spy(passes, *args, **kwargs):
        measured.append(passes)
        return real_choose(passes, *args, **kwargs)

    monkeypatch.setattr(cpu_kernels, "choose_prefetch", spy)
    monkeypatch.delenv(cpu_kernels.PREFETCH_ENV, raising=False)
    chosen = cpu_kernels.tune_one_row_prefetch(kernels, weights, torch.float32, rounds=2)
    assert chosen in cpu_kernels.PREFETCH_CANDIDATES
    assert kernels.one_row_prefetch[(torch.float32, torch.bfloat16)] == chosen
    assert len(measured) == 1 and set(measured[0]) == set(cpu_kernels.PREFETCH_CANDIDATES)
    assert all(len(times) == 2 for times in measured[0].values())  # the warm-up round is not scored
    assert cpu_kernels.tune_one_row_prefetch(kernels, weights, torch.float32) == chosen and len(measured) == 1

    monkeypatch.setenv(cpu_kernels.PREFETCH_ENV, "1536")
    assert cpu_kernels.tune_one_row_prefetch(kernels, weights, torch.float32) == 1536
    assert kernels.one_row_prefetch[(torch.float32, torch.bfloat16)] == 1536 and len(measured) == 1
    assert kernels.linear(torch.randn(1, 256), weights[0]).shape == (1, 64)
    for bad in ("-1", "far", "4k"):
        monkeypatch.setenv(cpu_kernels.PREFETCH_ENV, bad)
        with pytest.raises(ValueError, match=f"{cpu_kernels.PREFETCH_ENV}=.*distance in bytes"):
            cpu_kernels.tune_one_row_prefetch(kernels, weights, torch.float32)


@pytest.mark.parametrize("kernels", ISAS, indirect=True)
@pytest.mark.parametrize("x_dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("rows, inner, outer", [(1, 768, 2304), (3, 768, 770), (5, 100, 9), (8, 3072, 96),
                                                (16, 33, 64), (1, 17, 3), (7, 256, 257), (14, 96, 10),
                                                (64, 768, 2304), (131, 300, 80), (97, 520, 48), (48, 128, 32),
                                                (47, 136, 32), (40, 520, 96), (39, 64, 64), (600, 520, 96),
                                                (256, 520, 96), (257, 520, 96)])
def test_linear_over_int8_rows_is_the_float64_product_of_the_weight_they_stand_for(kernels, x_dtype, rows, inner,
                                                                                    outer):
    """int8 weights with a scale per row, as a decode step's few rows and a prompt's many take them (the tiles;
    the GEMMs from 48 or 40 rows over whole panels, but for bf16 rows on the avx512bf16 build, whose dot-product
    tiles take every row count; in blocks of 264 rows), with row, column and inner tails and
    strided rows in and out: each output is the product with the dequantized weight, to float32 accumulation
    and one rounding to the activations' dtype, and the columns beside the output are untouched."""
    gen = torch.Generator().manual_seed(rows * inner + outer)
    x = torch.randn(rows, inner + 24, generator=gen)[:, 8:8 + inner].to(x_dtype)
    quantized = int8_rows.quantize(torch.randn(outer, inner, generator=gen))
    padded = torch.full((rows, outer + 16), 7.0, dtype=x_dtype)
    out = padded[:, :outer]
    assert kernels.linear(x, quantized, out=out).data_ptr() == out.data_ptr()
    int16_from = kernels.int16_min_rows(x_dtype, torch.int8)
    assert_product(out, int8_rows.int16_rows(x) if 0 < int16_from <= rows else x, int8_rows.dequantize(quantized))
    assert torch.equal(padded[:, outer:], torch.full((rows, 16), 7.0, dtype=x_dtype))


@pytest.mark.parametrize("kernels", ISAS, indirect=True)
@pytest.mark.parametrize("rows", [2, 8, 47, 48, 300])
def test_int16_rows_move_each_activation_by_at_most_half_its_rows_step_and_no_further(kernels, rows):
    """Where float32 rows over int8 weights are multiplied in integers (the ``avx2`` build, from 2 rows; tiles and
    GEMM), each output is within half a step per activation of the product with the exact rows, and wider than
    float32's own accumulation for rows with a wide range: the path is taken, and its error has its bound. Rows of
    very unequal ranges each keep their own step, and a K past 4096 (the int32 sums' block) stays exact."""
    if kernels.int16_min_rows(torch.float32, torch.int8) == 0:
        assert kernels.isa != "avx2"
        return
    assert kernels.int16_min_rows(torch.float32, torch.int8) == 2
    assert kernels.int16_min_rows(torch.bfloat16, torch.int8) == 0
    assert kernels.int16_min_rows(torch.float32, torch.bfloat16) == 0
    gen = torch.Generator().manual_seed(rows)
    inner, outer = 4096 + 57, 48  # one int32 block and a 57-element tail; K blocks of the GEMM end on an odd one
    x = torch.randn(rows, inner, generator=gen) * torch.logspace(-3, 3, rows)[:, None]
    x[0, 7] = 1e4  # row 0's step grows past all its other values, which round to 0; no other row's step moves
    quantized = int8_rows.quantize(torch.randn(outer, inner, generator=gen))
    w = int8_rows.dequantize(quantized).double()
    got = kernels.linear(x, quantized)
    assert_product(got, int8_rows.int16_rows(x), w)
    got = got.double()
    exact = x.double() @ w.T
    float32_bound = ACCUMULATION * (x.double().abs() @ w.abs().T)
    half_steps = x.abs().amax(dim=1, keepdim=True).double() / 32767 / 2
    assert ((got - exact).abs() <= half_steps * w.abs().sum(dim=1) + 2 * float32_bound).all()
    assert ((got - exact)[0].abs() > 10 * float32_bound[0]).any()


@pytest.mark.parametrize("kernels", ISAS, indirect=True)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("rows, columns", [(1, 1), (3, 7), (5, 4096), (37, 1001), (300, 200), (64, 8)])
def test_native_quantization_is_torchs_bit_for_bit(kernels, dtype, rows, columns):
    """The load's quantization in one read of the weight: the same values and scales as int8_rows' torch ops,
    ties (x.5 levels, rounded to even) and a row of zeros included, into a place with the scales behind it."""
    gen = torch.Generator().manual_seed(rows * columns)
    weight = (torch.randn(rows, columns, generator=gen) * torch.rand(rows, 1, generator=gen) * 3).to(dtype)
    weight[rows // 2] = 0
    weight[-1, :4] = torch.tensor([127.0, 0.5, -1.5, 2.5], dtype=dtype)[:columns]  # scale 1: three ties
    want = int8_rows.quantize(weight)
    place = int8_rows.empty(weight.shape)
    got = int8_rows.quantize(weight, out=place, kernels=kernels)
    assert got.data_ptr() == place.data_ptr()
    assert torch.equal(got, want) and torch.equal(int8_rows.scales(got), int8_rows.scales(want))


@pytest.mark.parametrize("kernels", ISAS, indirect=True)
@pytest.mark.parametrize("bad", [float("nan"), float("inf"), -float("inf")])
@pytest.mark.parametrize("at", [(0, 0), (6, 40), (3, 17)])
def test_native_quantization_refuses_inf_and_nan_in_a_row_or_its_tail(kernels, bad, at):
    weight = torch.randn(7, 41)
    weight[at] = bad
    with pytest.raises(ValueError, match="inf or NaN"):
        kernels.quantize_rows(weight, int8_rows.empty(weight.shape))


@pytest.mark.parametrize("kernels", ISAS, indirect=True)
def test_native_quantization_leaves_what_it_does_not_take_to_torch(kernels):
    strided = torch.randn(16, 8).T
    assert not kernels.quantizes(strided) and not kernels.quantizes(torch.randn(8, 16).half())
    assert torch.equal(int8_rows.quantize(strided, kernels=kernels), int8_rows.quantize(strided.contiguous()))
    with pytest.raises(ValueError, match="an int8 place of its shape with its scales behind it"):
        kernels.quantize_rows(torch.randn(4, 8), torch.zeros(4, 8, dtype=torch.int8))


@pytest.mark.parametrize("kernels", ISAS, indirect=True)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("rows, columns", [(1, 1), (3, 7), (5, 4096), (37, 1001), (64, 8)])
def test_native_dequantization_is_int8_rows_bit_for_bit(kernels, dtype, rows, columns):
    """What a prompt's products over int8 weights multiply on oneDNN: each value times its row's scale in float32,
    rounded once to the dtype, as int8_rows.dequantize computes it, vector body and tail alike, into ``out``."""
    gen = torch.Generator().manual_seed(rows * columns)
    quantized = int8_rows.quantize(torch.randn(rows, columns, generator=gen) * 3)
    out = torch.full((rows, columns), 7.0, dtype=dtype)
    got = kernels.dequantize_rows(quantized, dtype, out=out)
    assert got.data_ptr() == out.data_ptr() and torch.equal(got, int8_rows.dequantize(quantized, dtype))


@pytest.mark.parametrize("kernels", ISAS, indirect=True)
def test_native_dequantization_refuses_values_without_scales_and_a_wrong_out(kernels):
    quantized = int8_rows.quantize(torch.randn(8, 64))
    with pytest.raises(ValueError, match="int8 values with their scales behind them"):
        kernels.dequantize_rows(quantized.clone(), torch.bfloat16)
    with pytest.raises(ValueError, match="into float32 or bf16"):
        kernels.dequantize_rows(quantized, torch.float16)
    with pytest.raises(ValueError, match=r"out must be a contiguous torch.bfloat16 \(8, 64\) tensor"):
        kernels.dequantize_rows(quantized, torch.bfloat16, out=torch.empty(64, 8, dtype=torch.bfloat16))


@pytest.mark.parametrize("kernels", ISAS, indirect=True)
def test_only_int8_under_bf16_on_the_dot_product_build_stays_on_the_tiles_at_every_row_count(kernels):
    """tiles_only: bf16 rows over int8 weights on the avx512bf16 build, where its dot-product tiles ran the bench
    model's products faster than the GEMM at every row count measured; no other pair or build; a pair no product
    takes is refused, naming it."""
    assert kernels.tiles_only(torch.bfloat16, torch.int8) == (kernels.isa == "avx512bf16")
    for x_dtype, w_dtype in ((torch.float32, torch.int8), (torch.float32, torch.float32),
                             (torch.float32, torch.bfloat16), (torch.bfloat16, torch.bfloat16)):
        assert not kernels.tiles_only(x_dtype, w_dtype)
    with pytest.raises(ValueError, match="no product of torch.float16 rows over torch.int8 weights"):
        kernels.tiles_only(torch.float16, torch.int8)


@pytest.mark.parametrize("kernels", ISAS, indirect=True)
def test_linear_refuses_int8_values_without_their_scales(kernels):
    quantized = int8_rows.quantize(torch.randn(8, 64))
    with pytest.raises(ValueError, match="no scales behind it"):
        kernels.linear(torch.randn(2, 64), quantized.clone())
    with pytest.raises(ValueError, match="no scales behind it"):
        kernels.linear(torch.randn(2, 64), torch.zeros(8, 64, dtype=torch.int8))
    with pytest.raises(ValueError, match=r"unsupported dtypes \(torch.float16 activations, torch.int8 weight\)"):
        kernels.linear(torch.randn(2, 64).to(torch.float16), quantized)
    width, dim = 64, 32
    layer = {"input_norm": torch.ones(width), "qkv": int8_rows.quantize(torch.randn(6 * dim, width)),
             "o": int8_rows.quantize(torch.randn(width, 2 * dim)), "post_norm": torch.ones(width),
             "gate_up": int8_rows.quantize(torch.randn(64, width)), "down": int8_rows.quantize(torch.randn(width, 32))}
    cpu_kernels.DecodeLayers(kernels, [layer], 2, 2, dim, 1e-5)
    with pytest.raises(ValueError, match="no scales behind it"):
        cpu_kernels.DecodeLayers(kernels, [dict(layer, down=layer["down"].clone())], 2, 2, dim, 1e-5)
    with pytest.raises(ValueError, match="no scales behind it"):
        cpu_kernels.DecodeLayers(kernels, [layer], 2, 2, dim, 1e-5, head=(torch.ones(width), quantized.clone()))


@pytest.mark.parametrize("kernels", ISAS, indirect=True)
def test_linear_names_a_pair_of_dtypes_it_does_not_run(kernels):
    with pytest.raises(ValueError, match=r"unsupported dtypes \(torch.bfloat16 activations, torch.float32 weight\)"):
        kernels.linear(torch.randn(2, 8).to(torch.bfloat16), torch.randn(4, 8))
    with pytest.raises(ValueError, match="torch.float16 weight"):
        kernels.linear(torch.randn(2, 8), torch.randn(4, 8).to(torch.float16))


@pytest.mark.parametrize("kernels", ISAS, indirect=True)
@pytest.mark.parametrize("x_dtype, w_dtype", [(torch.float32, torch.float32), (torch.float32, torch.bfloat16),
                                              (torch.bfloat16, torch.bfloat16)])
@pytest.mark.parametrize("rows, inner, outer", [(64, 768, 2304), (131, 300, 80), (97, 520, 48), (200, 36, 64),
                                                (70, 64, 100), (48, 128, 32), (47, 136, 32), (300, 3072, 16),
                                                (40, 520, 96), (39, 64, 64), (61, 1040, 160)])
def test_linear_of_a_prompts_rows_is_the_float64_product(kernels, x_dtype, w_dtype, rows, inner, outer):
    """Rows by the many, as a prompt has them (on the avx2 build, a packed-panel GEMM from 48 rows, 47 on
    the tiles; on the AVX-512 builds one from 40 rows, 39 on the tiles): outputs in panels of 16 or 32 (and
    100, 80 or 48, not multiples of 32: the tiles there), the inner dimension in blocks of 256 with tails
    that are not multiples of 8 or 16, rows in blocks of 96 and micro-panels of 6 or 12 with tails; strided
    rows in and out, the columns beside the output untouched."""
    gen = torch.Generator().manual_seed(rows + inner + outer)
    x = torch.randn(rows, inner + 24, generator=gen)[:, 8:8 + inner].to(x_dtype)
    w = torch.randn(outer, inner, generator=gen).to(w_dtype)
    padded = torch.full((rows, outer + 16), 7.0, dtype=x_dtype)
    out = padded[:, :outer]
    assert kernels.linear(x, w, out=out).data_ptr() == out.data_ptr()
    assert_product(out, x, w)
    assert torch.equal(padded[:, outer:], torch.full((rows, 16), 7.0, dtype=x_dtype))


@pytest.mark.parametrize("kernels, w_dtype, pairs", [
    pytest.param(isa.values[0], w_dtype, pairs, marks=isa.marks, id=f"{isa.values[0]}-{name}")
    for isa in ISAS for name, w_dtype, pairs in [("float32", torch.float32, False), ("bf16", torch.bfloat16, False),
                                                 ("bf16-pair-panels", torch.bfloat16, True)]
    if not pairs or isa.values[0] in cpu_kernels.PAIRS_ISAS], indirect=["kernels"])
@pytest.mark.parametrize("rows", [530, 600])
def test_a_prompts_rows_go_in_blocks_each_as_its_own_product(kernels, w_dtype, pairs, rows):
    """The GEMMs take a long prompt's rows 264 at a time (530 = 2 x 264 + 2, a tail under the GEMM's fewest
    rows; 600 = 2 x 264 + 72), over float32 and bf16 weights and pair panels: every row is the float64
    product, and a block's rows are the same bits as those rows alone, 264 of them."""
    gen = torch.Generator().manual_seed(rows)
    x = torch.randn(rows, 520, generator=gen)
    w = torch.randn(96, 520, generator=gen).to(w_dtype)
    weight = kernels.pack_pairs(w) if pairs else w
    out = kernels.linear(x, weight, pairs=pairs)
    assert_product(out, x, w)
    assert torch.equal(out[264:528], kernels.linear(x[264:528].clone(), weight, pairs=pairs))


@pytest.mark.parametrize("kernels", ISAS, indirect=True)
@pytest.mark.parametrize("x_dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("rows, inner, outer", [(1, 768, 2304), (3, 770, 64), (8, 2, 32), (12, 3072, 96),
                                                (13, 100, 32), (39, 64, 64), (40, 96, 128), (53, 130, 32)])
def test_linear_over_pair_panels_is_the_float64_product(kernels, x_dtype, rows, inner, outer):
    """bf16 weights laid out in pair panels (the AVX-512 builds): every tile height (1 to 12 rows, 13 and 39
    split into even tiles), the GEMM from 40 rows, K not a multiple of 16 and as short as 2."""
    gen = torch.Generator().manual_seed(rows * inner + outer)
    x = torch.randn(rows, inner, generator=gen).to(x_dtype)
    w = torch.randn(outer, inner, generator=gen).to(torch.bfloat16)
    if kernels.isa not in cpu_kernels.PAIRS_ISAS:
        assert not kernels.takes_pairs(w)
        with pytest.raises(ValueError, match="avx2"):
            kernels.pack_pairs(w)
        return
    packed = kernels.pack_pairs(w)
    assert packed.shape == w.shape and packed.dtype == torch.bfloat16
    assert torch.equal(packed, w) == (inner == 2)  # K = 2: each panel row is a plain row already
    got = kernels.linear(x, packed, pairs=True)
    assert got.shape == (rows, outer) and got.dtype == x_dtype
    assert_product(got, x, w)
    assert kernels.linear(x[:0], packed, pairs=True).shape == (0, outer)  # no rows: nothing to do


@pytest.mark.parametrize("kernels", ISAS, indirect=True)
@pytest.mark.parametrize("outer, inner", [(32, 2), (32, 30), (64, 32), (64, 64), (96, 98), (32, 4096), (160, 1000)])
def test_pair_panels_hold_each_panels_16_rows_pair_by_pair(kernels, outer, inner):
    """The layout itself, against torch's: whole 16-word blocks (transposed in registers) and the words after."""
    w = torch.arange(outer * inner, dtype=torch.float32).remainder(251).to(torch.bfloat16).view(outer, inner)
    if kernels.isa not in cpu_kernels.PAIRS_ISAS:  # the avx2 build has no pair panels
        with pytest.raises(ValueError, match="pair panels"):
            kernels.pack_pairs(w)
        return
    want = w.view(outer // 16, 16, inner // 2, 2).permute(0, 2, 1, 3).reshape(outer, inner)
    assert torch.equal(kernels.pack_pairs(w), want)


PAIRS_BUILDS = [param for param in ISAS if param.values[0] in cpu_kernels.PAIRS_ISAS]


@pytest.mark.parametrize("kernels", PAIRS_BUILDS, indirect=True)
@pytest.mark.parametrize("outer, inner", [(32, 30), (96, 98), (64, 4096)])
def test_pair_panels_are_laid_out_into_the_tensor_given_even_the_weight_itself(kernels, outer, inner):
    """``out``: a place apart, or the weight's own memory (each panel's rows copied out first: a panel
    rewritten straight from its rows would read words it had already overwritten)."""
    w = torch.arange(outer * inner, dtype=torch.float32).remainder(251).to(torch.bfloat16).view(outer, inner)
    want = w.view(outer // 16, 16, inner // 2, 2).permute(0, 2, 1, 3).reshape(outer, inner)
    out = torch.empty_like(w)
    assert kernels.pack_pairs(w, out=out) is out and torch.equal(out, want)
    itself = w.clone()
    assert kernels.pack_pairs(itself, out=itself).data_ptr() == itself.data_ptr() and torch.equal(itself, want)
    for wrong in (torch.empty(outer, inner + 2, dtype=torch.bfloat16), torch.empty_like(w, dtype=torch.float32),
                  torch.empty(inner, outer, dtype=torch.bfloat16).t()):
        with pytest.raises(ValueError, match="out must be a contiguous"):
            kernels.pack_pairs(w, out=wrong)
    room = torch.cat([w.flatten(), torch.zeros(16 * inner, dtype=torch.bfloat16)])
    with pytest.raises(ValueError, match="overlaps the weight"):
        kernels.pack_pairs(room[:outer * inner].view(outer, inner), out=room[16 * inner:].view(outer, inner))


AMX_FLAGS = frozenset({"amx_tile", "amx_bf16"})
AMX_TILES = pytest.mark.skipif(not AMX_FLAGS | cpu_kernels.ISA_NEEDS["avx512bf16"] <= FLAGS,
                               reason="this CPU has no AMX tiles")
#: bf16 products (``tiles=True``): AMX's tiles where the CPU has them, else AVX512_BF16's dot products.
BF16_PRODUCTS = pytest.mark.skipif(not cpu_kernels.ISA_NEEDS["avx512bf16"] <= FLAGS,
                                   reason="this CPU does not run the avx512bf16 build")
#: ``dot_products``: the dot products even on an AMX CPU (elsewhere they are what ``tiles`` runs anyway).
ON_DOT_PRODUCTS = pytest.mark.parametrize("dot_products", [False, True], ids=["tiles-where-amx", "dot-products"])


@pytest.fixture
def tiles_from(kernels):
    """Sets the fewest rows the AMX tiles take (``amx_min_rows``) for a test, and restores it after."""
    before = kernels.amx_min_rows()
    yield kernels.amx_min_rows
    kernels.amx_min_rows(before)


@AMX_TILES
@pytest.mark.parametrize("kernels", ["avx512bf16"], indirect=True)
@pytest.mark.parametrize("rows, inner, outer", [(1, 32, 32), (2, 768, 96), (15, 288, 64), (16, 64, 32),
                                                (17, 544, 32), (32, 96, 128), (33, 3072, 64), (100, 256, 96)])
def test_amx_tiles_compute_the_float64_product_over_pair_panels(kernels, tiles_from, rows, inner, outer):
    """bf16 rows over pair panels on the tile unit: 16- and 32-row blocks and their tails (1, 15, 17, 33, 100
    rows), K in one block of 256, several, or a block and a tail (288, 544); strided rows, into a given
    tensor."""
    assert tiles_from(1) == 1
    gen = torch.Generator().manual_seed(rows * inner + outer)
    wide = torch.randn(rows, inner + 32, generator=gen).to(torch.bfloat16)
    x = wide[:, 16:16 + inner]
    w = torch.randn(outer, inner, generator=gen).to(torch.bfloat16)
    out = torch.full((rows, outer), float("nan"), dtype=torch.bfloat16)
    assert kernels.linear(x, kernels.pack_pairs(w), out=out, pairs=True) is out
    assert_product(out, x, w)


@AMX_TILES
@pytest.mark.parametrize("kernels", ["avx512bf16"], indirect=True)
@pytest.mark.parametrize("rows, inner", [(800, 1056), (1600, 544)])
def test_amx_tiles_sum_blocks_of_rows_and_of_k_as_one_row_alone(kernels, tiles_from, rows, inner):
    """A prompt's rows go through the tiles in blocks of 768 rows and 512 of K (here 800 = 768 + a tail of 32, and
    1600 = 2 x 768 + 64; K 1056 = 2 x 512 + 32, 544 = 512 + 32), over items of several column pairs (640 outputs:
    20 pairs, 2 a work item on 2 threads, so the rows go in two halves of 416 + 384 and 800 + 800, 5 pairs an
    item): each row is the float64 product to the rounding, and the same bits as that row alone, whose sums add
    over the whole of K in one pass."""
    tiles_from(1)
    gen = torch.Generator().manual_seed(rows + inner)
    x = torch.randn(rows, inner, generator=gen).to(torch.bfloat16)
    w = torch.randn(640, inner, generator=gen).to(torch.bfloat16)
    packed = kernels.pack_pairs(w)
    out = kernels.linear(x, packed, pairs=True)
    assert_product(out, x, w)
    half = (rows // 2 + 31) // 32 * 32
    for row in (0, 31, 32, half - 1, half, 767, 768, rows - 1):
        assert torch.equal(out[row:row + 1], kernels.linear(x[row:row + 1], packed, pairs=True)), f"row {row}"


@AMX_TILES
@pytest.mark.parametrize("kernels", ["avx512bf16"], indirect=True)
def test_amx_tiles_take_the_rows_they_are_set_to_take(kernels, tiles_from):
    """From ``amx_min_rows`` rows a product runs on the tiles, which sum in another order than the vector tiles
    (some roundings differ), below on the vector tiles; 0 keeps every row count on the vector tiles."""
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(64, 3072, generator=gen).to(torch.bfloat16)
    w = torch.randn(768, 3072, generator=gen).to(torch.bfloat16)
    packed = kernels.pack_pairs(w)
    assert tiles_from(0) == 0
    vector = kernels.linear(x, packed, pairs=True)
    assert tiles_from(65) == 65 and torch.equal(kernels.linear(x, packed, pairs=True), vector)
    assert tiles_from(64) == 64
    tiled = kernels.linear(x, packed, pairs=True)
    assert not torch.equal(tiled, vector)
    assert_product(tiled, x, w)
    assert_product(vector, x, w)


@pytest.mark.parametrize("kernels", ISAS[:2], indirect=True)
@pytest.mark.parametrize("rows, inner, gate_width", [(3, 64, 48), (16, 96, 64), (17, 96, 48), (40, 544, 1040),
                                                     (800, 1056, 80)])
def test_gate_up_silu_in_one_pass_is_the_product_then_silu_mul_bit_for_bit(kernels, rows, inner, gate_width):
    """A prompt's rows (more than 16) on AMX's tiles take a gate/up weight's gate and up panels side by side and
    make silu(gate) * up of their sums in one pass: the numbers of the product into [gate | up] then silu_mul,
    bit for bit. Gate widths of an odd number of 16-column panels (48, 80: the gate's last panel and the up's
    first share a column pair of the product's); K in blocks and a tail (544, 1056), 800 rows in a block of 768
    and a tail; strided rows. Decode rows (16 or fewer), and builds or CPUs without the tiles, take the two
    calls."""
    gen = torch.Generator().manual_seed(rows + inner + gate_width)
    x = (torch.randn(rows, inner + 32, generator=gen) * 2).to(torch.bfloat16)[:, 16:16 + inner]
    packed = kernels.pack_pairs((torch.randn(2 * gate_width, inner, generator=gen) / inner ** 0.5).to(torch.bfloat16))
    got, one_pass = kernels.gate_up_silu(x, packed)
    want = kernels.silu_mul(kernels.linear(x, packed, pairs=True))
    assert torch.equal(got, want) and (want != 0).float().mean().item() > 0.9
    assert one_pass == (rows > 16 and kernels.amx_min_rows() > 0)


@pytest.mark.parametrize("kernels", ISAS[:2], indirect=True)
def test_gate_up_silu_names_what_it_cannot_take(kernels):
    x = torch.zeros(20, 64, dtype=torch.bfloat16)
    with pytest.raises(ValueError, match=r"gate_up_silu.*float32 \(20, 64\)"):
        kernels.gate_up_silu(x.float(), kernels.pack_pairs(torch.zeros(64, 64, dtype=torch.bfloat16)))
    with pytest.raises(ValueError, match=r"gate_up_silu.*\(48, 64\)"):
        kernels.gate_up_silu(x, torch.zeros(48, 64, dtype=torch.bfloat16))
    with pytest.raises(ValueError, match=r"gate_up_silu.*\(64, 32\)"):
        kernels.gate_up_silu(x, kernels.pack_pairs(torch.zeros(64, 32, dtype=torch.bfloat16)))


@pytest.mark.parametrize("kernels", ISAS, indirect=True)
def test_builds_without_amx_tiles_say_so(kernels):
    """Only the avx512bf16 build, on a CPU with AMX, has tiles to set; the others answer 0 whatever is asked."""
    if kernels.isa == "avx512bf16" and AMX_FLAGS <= FLAGS:
        assert kernels.amx_min_rows() > 0, "an AMX CPU whose tiles this build cannot use (Linux before 5.16?)"
    else:
        assert kernels.amx_min_rows() == 0 and kernels.amx_min_rows(4) == 0


@pytest.mark.parametrize("kernels", ISAS[:2], indirect=True)
def test_pair_panels_name_the_weights_they_cannot_lay_out(kernels):
    """An odd K, outputs not a multiple of 32, or float32: a ValueError with the shape, and no product."""
    assert not kernels.takes_pairs(torch.zeros(64, dtype=torch.bfloat16))
    for weight in (torch.zeros(64, 33, dtype=torch.bfloat16), torch.zeros(48, 64, dtype=torch.bfloat16),
                   torch.zeros(64, 64)):
        assert not kernels.takes_pairs(weight)
        with pytest.raises(ValueError, match=str(tuple(weight.shape)).replace("(", r"\(").replace(")", r"\)")):
            kernels.pack_pairs(weight)
    with pytest.raises(ValueError, match="pair panels"):
        kernels.linear(torch.zeros(2, 64, dtype=torch.bfloat16), torch.zeros(48, 64, dtype=torch.bfloat16),
                       pairs=True)


@pytest.mark.parametrize("kernels", ISAS, indirect=True)
def test_linear_reads_strided_rows_and_writes_into_a_given_tensor(kernels):
    gen = torch.Generator().manual_seed(1)
    wide = torch.randn(4, 200, generator=gen).to(torch.bfloat16)
    x = wide[:, 40:168]  # rows 200 elements apart
    w = torch.randn(50, 128, generator=gen).to(torch.bfloat16)
    out = torch.full((4, 60), 7.0, dtype=torch.bfloat16)[:, :50]
    assert kernels.linear(x, w, out=out).data_ptr() == out.data_ptr()
    assert_product(out, x, w)


def reference_attention(q, k_layer, v_layer, slots, lengths):
    heads, kv_heads, dim = q.shape[1], k_layer.shape[1], q.shape[2]
    rows = []
    for b, (slot, length) in enumerate(zip(slots.tolist(), lengths.tolist())):
        k = k_layer[slot, :, :length].double().repeat_interleave(heads // kv_heads, 0)
        v = v_layer[slot, :, :length].double().repeat_interleave(heads // kv_heads, 0)
        p = torch.softmax(q[b].double().unsqueeze(1) @ k.transpose(1, 2) * dim ** -0.5, -1)
        rows.append((p @ v).squeeze(1))
    return torch.stack(rows)


@pytest.mark.parametrize("kernels", ISAS, indirect=True)
@pytest.mark.parametrize("q_dtype, kv_dtype", [(torch.bfloat16, torch.bfloat16), (torch.bfloat16, torch.float32),
                                               (torch.float32, torch.float32), (torch.float32, torch.bfloat16)])
@pytest.mark.parametrize("heads, kv_heads, dim", [(12, 12, 64), (8, 4, 32), (32, 8, 128), (4, 1, 256), (16, 2, 128)])
def test_decode_attention_is_softmax_attention_over_each_rows_own_positions(kernels, q_dtype, kv_dtype, heads,
                                                                           kv_heads, dim):
    gen = torch.Generator().manual_seed(heads * dim + kv_heads)
    k_layer, v_layer = (torch.randn(5, kv_heads, 100, dim, generator=gen).to(kv_dtype) for _ in range(2))
    slots, lengths = torch.tensor([3, 0, 4]), torch.tensor([1, 100, 37])
    # the rows of the fused q/k/v product: q is the first ``heads`` of each row, rows further apart
    q = torch.randn(3, heads + 2 * kv_heads, dim, generator=gen).to(q_dtype)[:, :heads]
    got = kernels.decode_attention(q, k_layer, v_layer, slots, lengths, dim ** -0.5)
    assert got.shape == (3, heads, dim) and got.dtype == q_dtype
    want = reference_attention(q, k_layer, v_layer, slots, lengths)
    # outputs are averages of values of ~1: the error is the output dtype's rounding of them (float32: the
    # sums' and exp's rounding; an exp good to only 1e-5 of its value fails this)
    tolerance = 4 * ROUNDING[q_dtype] if q_dtype == torch.bfloat16 else 1e-6
    assert (got.double() - want).abs().max().item() <= tolerance
    assert torch.allclose(got[0].double(), v_layer[3, :, 0].double().repeat_interleave(heads // kv_heads, 0),
                          atol=tolerance)  # one position: its own value


@pytest.mark.parametrize("kernels", ISAS, indirect=True)
def test_decode_attention_softmax_is_stable_for_large_scores(kernels):
    """Scores in the hundreds: exp of the scores minus their max, never of the scores themselves."""
    k_layer, v_layer = torch.zeros(1, 1, 40, 32), torch.randn(1, 1, 40, 32)
    k_layer[0, 0, 7] = 30.0  # q . k = 30 * 32 * 30 / sqrt(32) ~ 5000 at position 7
    q = torch.full((1, 1, 32), 30.0)
    got = kernels.decode_attention(q, k_layer, v_layer, torch.tensor([0]), torch.tensor([40]), 32 ** -0.5)
    torch.testing.assert_close(got[0, 0], v_layer[0, 0, 7])


@pytest.mark.parametrize("kernels", ISAS, indirect=True)
def test_decode_attention_says_what_it_does_not_support(kernels):
    q, cache = torch.randn(1, 4, 48), torch.randn(1, 4, 8, 48)
    one = torch.tensor([0])
    with pytest.raises(ValueError, match="head_dim 48"):
        kernels.decode_attention(q, cache, cache, one, one + 1, 0.1)
    assert not kernels.supports_attention(torch.float32, torch.float32, 4, 4, 48)
    assert not kernels.supports_attention(torch.float16, torch.float32, 4, 4, 64)
    assert not kernels.supports_attention(torch.float32, torch.float32, 6, 4, 64)
    assert kernels.supports_attention(torch.bfloat16, torch.float32, 32, 8, 128)


def fused_qkv(tokens: int, heads: int, kv_heads: int, dim: int, seed: int, spread: float = 1.0):
    """q, k and v ``[tokens, heads, dim]`` as views of one fused product's rows (strided rows, as the backend has them)."""
    gen = torch.Generator().manual_seed(seed)
    qkv = torch.randn(tokens, heads + 2 * kv_heads, dim, generator=gen) * spread
    return qkv[:, :heads], qkv[:, heads:heads + kv_heads], qkv[:, heads + kv_heads:]


def causal_reference(q, k, v):
    """Query t (at position len(k) - len(q) + t) over keys 0..its position, in float64."""
    groups = q.shape[1] // k.shape[1]
    tokens, positions = q.shape[0], k.shape[0]
    q, k, v = (t.double().transpose(0, 1) for t in (q, k, v))  # [heads, tokens or positions, dim]
    k, v = k.repeat_interleave(groups, 0), v.repeat_interleave(groups, 0)
    scores = q @ k.transpose(1, 2) * q.shape[-1] ** -0.5
    scores.masked_fill_(torch.ones(tokens, positions, dtype=torch.bool).triu(positions - tokens + 1), float("-inf"))
    return (torch.softmax(scores, -1) @ v).transpose(0, 1)


def assert_attention(got, want, dtype, bound: float = 2e-5) -> None:
    """float32 sums and exp, a few units of 1e-7 each on averages of values of ~1; bf16 queries get their
    output rounded to bf16 besides."""
    assert got.dtype == dtype
    rounding = ROUNDING[dtype] * want.abs() if dtype == torch.bfloat16 else 0
    excess = (got.double() - want).abs() - rounding - bound
    assert excess.max().item() <= 0, f"off by up to {excess.max():.3g} past the bound"


@pytest.mark.parametrize("kernels", ISAS, indirect=True)
@pytest.mark.parametrize("q_dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("tokens, heads, kv_heads, dim", [(1, 2, 2, 16), (5, 4, 2, 32), (47, 12, 12, 64), (48, 4, 1, 64),
                                                          (49, 6, 3, 64), (100, 8, 2, 128), (257, 12, 12, 64),
                                                          (130, 2, 2, 256), (17, 3, 1, 48), (13, 4, 2, 32),
                                                          (33, 2, 1, 96)])
def test_prompt_attention_is_causal_softmax_attention_over_the_chunks_own_tokens(kernels, q_dtype, tokens, heads,
                                                                                 kv_heads, dim):
    """Row and position tails (not multiples of the 6- or 12-row micro-panels, the 16- or 32-position
    panels or the 48-query work items), GQA groups, head sizes from 16 to 256 (the AVX-512 builds'
    12 x 32 tile at multiples of 32, AVX2's 6 x 16 at 16 and 48), strided rows (keys' and values' apart
    or not: rotated keys are a tensor of their own), one and two threads, every build, float32
    queries over float32 keys and bf16 over bf16 (a bf16 model's fused product)."""
    q, k, v = (t.to(q_dtype) for t in fused_qkv(tokens, heads, kv_heads, dim, seed=tokens * dim + heads))
    want = causal_reference(q, k, v)
    threads = torch.get_num_threads()
    try:
        for count, keys in ((1, k), (2, k), (2, k.contiguous())):
            torch.set_num_threads(count)
            got = kernels.prompt_attention(q, keys, v, dim ** -0.5)
            assert got.shape == (tokens, heads, dim)
            assert_attention(got, want, q_dtype)
    finally:
        torch.set_num_threads(threads)
    groups = heads // kv_heads
    torch.testing.assert_close(got[0], v[0].repeat_interleave(groups, 0))  # the first token: its own value


@pytest.mark.parametrize("kernels", ISAS, indirect=True)
@pytest.mark.parametrize("q_dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("cache_dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("start, tokens, heads, kv_heads, dim", [(200, 100, 8, 2, 64), (1, 1, 2, 2, 16),
                                                                 (7, 50, 12, 12, 64), (300, 3, 4, 1, 128)])
def test_prompt_attention_of_a_later_chunk_reads_the_earlier_positions_from_the_cache(kernels, q_dtype, cache_dtype,
                                                                                      start, tokens, heads, kv_heads,
                                                                                      dim):
    """A chunk at positions [start, start + tokens) over its slot of a cache ``[slots, kv_heads, max_length,
    head_dim]`` that holds every position up to its last, float32 or bf16 (widened as read), for float32
    and bf16 queries."""
    gen = torch.Generator().manual_seed(start + tokens + dim)
    end = start + tokens
    k_layer, v_layer = (torch.randn(3, kv_heads, 400, dim, generator=gen).to(cache_dtype) for _ in range(2))
    q = torch.randn(tokens, heads + 2 * kv_heads, dim, generator=gen)[:, :heads].to(q_dtype)
    k, v = (c[1].transpose(0, 1)[:end] for c in (k_layer, v_layer))  # slot 1: [end, kv_heads, dim]
    got = kernels.prompt_attention(q, k, v, dim ** -0.5, start)
    assert got.shape == (tokens, heads, dim)
    assert_attention(got, causal_reference(q, k.float(), v.float()), q_dtype)
    with pytest.raises(ValueError, match=f"k must be float32 or bfloat16 \\[{end + 1}, kv_heads, {dim}\\]"):
        kernels.prompt_attention(q, k, v, dim ** -0.5, start + 1)


@pytest.mark.parametrize("kernels", ISAS, indirect=True)
def test_prompt_attention_softmax_is_stable_for_large_scores(kernels):
    q, k, v = fused_qkv(60, 2, 2, 32, seed=3, spread=30.0)  # scores in the thousands
    got = kernels.prompt_attention(q, k, v, 32 ** -0.5)
    assert torch.isfinite(got).all()
    assert (got.double() - causal_reference(q, k, v)).abs().max().item() <= 1e-4 * 30


@pytest.mark.parametrize("kernels", ISAS, indirect=True)
def test_prompt_attention_runs_on_every_build_and_says_what_it_does_not_run(kernels):
    q, k, v = fused_qkv(8, 4, 2, 64, seed=1)
    for dtype in (torch.float32, torch.bfloat16):
        for kv in (torch.float32, torch.bfloat16):
            assert kernels.supports_prompt_attention(dtype, kv, 4, 2, 64)
    for dtype, kv, heads, kv_heads, dim in ((torch.float16, torch.bfloat16, 4, 2, 64),
                                            (torch.float32, torch.float16, 4, 2, 64),
                                            (torch.float32, torch.float32, 4, 3, 64),
                                            (torch.float32, torch.float32, 4, 2, 40)):
        assert not kernels.supports_prompt_attention(dtype, kv, heads, kv_heads, dim)
    with pytest.raises(ValueError, match="v must be float32 or bfloat16 .* in k's dtype"):
        kernels.prompt_attention(q, k, v.to(torch.bfloat16), 0.125)
    with pytest.raises(ValueError, match="k must be float32 or bfloat16"):
        kernels.prompt_attention(q, k.half(), v.half(), 0.125)
    with pytest.raises(ValueError, match="q must be float32 or bfloat16 .* each token's heads contiguous"):
        kernels.prompt_attention(q.transpose(0, 1), k, v, 0.125)
    with pytest.raises(ValueError, match="q must be float32 or bfloat16"):
        kernels.prompt_attention(q.half(), k, v, 0.125)
    with pytest.raises(ValueError, match=f"unsupported on {kernels.isa} \\(4 heads over 3, head_dim 64\\)"):
        kernels.prompt_attention(q, torch.randn(8, 3, 64), torch.randn(8, 3, 64), 0.125)


def assert_tile_attention(got, q, k, v) -> None:
    """Attention on the tiles: float32 scores and sums, the softmax's weights rounded to bf16 (a relative 2^-9
    each, so at most 2^-9 of the largest value a row sees), then the output rounded to bf16."""
    want = causal_reference(q, k.float(), v.float())
    assert_attention(got, want, torch.bfloat16, bound=2 ** -9 * v.float().abs().max().item() + 2e-5)


@BF16_PRODUCTS
@ON_DOT_PRODUCTS
@pytest.mark.parametrize("kernels", ["avx512bf16"], indirect=True)
@pytest.mark.parametrize("tokens, heads, kv_heads, dim", [(1, 2, 2, 32), (15, 4, 2, 32), (47, 12, 12, 64),
                                                          (49, 6, 3, 64), (100, 8, 2, 128), (257, 12, 12, 64),
                                                          (130, 2, 2, 256), (33, 2, 1, 96)])
def test_prompt_attention_in_bf16_products_is_causal_softmax_attention(kernels, tokens, heads, kv_heads, dim,
                                                                       dot_products):
    """bf16 queries, keys and values in bf16 products (AMX's tiles, or AVX512_BF16's dot products): query tails
    (not multiples of the 16-row tiles or the 48-query work items), position tails (not multiples of the
    16-position panels or the 32-position steps), GQA groups, head sizes 32 to 256, strided rows, one and two
    threads. The weights are rounded to bf16, so the result differs from the float32 kernel's."""
    q, k, v = (t.to(torch.bfloat16) for t in fused_qkv(tokens, heads, kv_heads, dim, seed=tokens * dim + heads))
    assert kernels.supports_tile_attention(torch.bfloat16, torch.bfloat16, dim)
    threads = torch.get_num_threads()
    try:
        for count, keys in ((1, k), (2, k), (2, k.contiguous())):
            torch.set_num_threads(count)
            got = kernels.prompt_attention(q, keys, v, dim ** -0.5, tiles=True, dot_products=dot_products)
            assert got.shape == (tokens, heads, dim)
            assert_tile_attention(got, q, k, v)
    finally:
        torch.set_num_threads(threads)
    torch.testing.assert_close(got[0], v[0].repeat_interleave(heads // kv_heads, 0))  # the first token: its own value
    if tokens > 32:
        assert not torch.equal(got, kernels.prompt_attention(q, k, v, dim ** -0.5))


@BF16_PRODUCTS
@ON_DOT_PRODUCTS
@pytest.mark.parametrize("kernels", ["avx512bf16"], indirect=True)
@pytest.mark.parametrize("start, tokens, heads, kv_heads, dim", [(200, 100, 8, 2, 64), (1, 1, 2, 2, 32),
                                                                 (7, 50, 12, 12, 64), (300, 3, 4, 1, 128)])
def test_prompt_attention_in_bf16_products_of_a_later_chunk_reads_the_cache(kernels, start, tokens, heads, kv_heads,
                                                                             dim, dot_products):
    """A later chunk over its slot of a bf16 cache ``[slots, kv_heads, max_length, head_dim]`` in bf16 products."""
    gen = torch.Generator().manual_seed(start + tokens + dim)
    end = start + tokens
    k_layer, v_layer = (torch.randn(3, kv_heads, 400, dim, generator=gen).to(torch.bfloat16) for _ in range(2))
    q = torch.randn(tokens, heads + 2 * kv_heads, dim, generator=gen)[:, :heads].to(torch.bfloat16)
    k, v = (c[1].transpose(0, 1)[:end] for c in (k_layer, v_layer))
    got = kernels.prompt_attention(q, k, v, dim ** -0.5, start, tiles=True, dot_products=dot_products)
    assert got.shape == (tokens, heads, dim)
    assert_tile_attention(got, q, k, v)


@BF16_PRODUCTS
@ON_DOT_PRODUCTS
@pytest.mark.parametrize("kernels", ["avx512bf16"], indirect=True)
def test_prompt_attention_in_bf16_products_is_stable_for_large_scores(kernels, dot_products):
    q, k, v = (t.to(torch.bfloat16) for t in fused_qkv(60, 2, 2, 32, seed=3, spread=30.0))  # scores in thousands
    got = kernels.prompt_attention(q, k, v, 32 ** -0.5, tiles=True, dot_products=dot_products)
    assert torch.isfinite(got).all()
    assert_tile_attention(got, q, k, v)


@AMX_TILES
@pytest.mark.parametrize("kernels", ["avx512bf16"], indirect=True)
def test_amx_products_read_nothing_a_larger_call_left_in_their_buffers(kernels, tiles_from):
    """The tiles' scratch buffers are kept per thread and only grow: a call that needs less than the one before
    reads only what it writes itself, so the NaNs a larger call left there change none of its values."""
    tiles_from(1)
    gen = torch.Generator().manual_seed(5)
    x, w = torch.randn(33, 768, generator=gen).to(torch.bfloat16), torch.randn(64, 768, generator=gen)
    small = kernels.pack_pairs(w.to(torch.bfloat16))
    q, k, v = (t.to(torch.bfloat16) for t in fused_qkv(49, 6, 3, 64, seed=5))
    linear, attention = kernels.linear(x, small, pairs=True), kernels.prompt_attention(q, k, v, 0.125, tiles=True)
    nan = torch.full((100, 3072), float("nan"), dtype=torch.bfloat16)
    assert kernels.linear(nan, kernels.pack_pairs(torch.randn(64, 3072).to(torch.bfloat16)), pairs=True).isnan().all()
    big = torch.full((257, 12, 128), float("nan"), dtype=torch.bfloat16)
    assert kernels.prompt_attention(big, big, big, 0.125, tiles=True).isnan().all()
    assert torch.equal(kernels.linear(x, small, pairs=True), linear)
    assert torch.equal(kernels.prompt_attention(q, k, v, 0.125, tiles=True), attention)


@pytest.mark.parametrize("kernels", ISAS, indirect=True)
def test_prompt_attention_in_bf16_products_is_refused_where_they_do_not_run(kernels, monkeypatch):
    """bf16 products need the avx512bf16 build (an AMX CPU's tiles, or AVX512_BF16's dot products), bf16 q, k
    and v and a head size that is a multiple of 32; elsewhere the call raises, naming what it needs, and does
    not fall back silently."""
    q, k, v = (t.to(torch.bfloat16) for t in fused_qkv(8, 4, 2, 64, seed=1))
    tiles_here = kernels.isa == "avx512bf16"
    assert kernels.supports_tile_attention(torch.bfloat16, torch.bfloat16, 64) == tiles_here
    q48, k48, v48 = (t.to(torch.bfloat16) for t in fused_qkv(8, 4, 2, 48, seed=1))
    for args in [(q48, k48, v48), (q.float(), k.float(), v.float())] + ([] if tiles_here else [(q, k, v)]):
        assert not kernels.supports_tile_attention(args[0].dtype, args[1].dtype, args[0].shape[-1])
        with pytest.raises(ValueError, match="in bf16 products: needs the avx512bf16 build \\(here: "
                                             f"{kernels.isa}\\), bfloat16 q, k and v, a head_dim that is a "
                                             "multiple of 32"):
            kernels.prompt_attention(*args, 0.125, tiles=True)
    monkeypatch.setattr(kernels, "_bf16_prompt_products", lambda: 0)  # an avx512bf16 build without AMX's intrinsics
    assert not kernels.supports_tile_attention(torch.bfloat16, torch.bfloat16, 64)


def test_the_library_name_follows_the_source_and_the_flags(tmp_path, monkeypatch):
    names = {isa: cpu_kernels.library_name(isa) for isa in cpu_kernels.ISAS}
    assert len(set(names.values())) == len(names)
    edited = tmp_path / "cpu_kernels.cpp"
    edited.write_text(cpu_kernels.SOURCE.read_text() + "\n// edited\n")
    monkeypatch.setattr(cpu_kernels, "SOURCE", edited)
    assert all(cpu_kernels.library_name(isa) != name for isa, name in names.items())


@pytest.mark.parametrize("isa", ISAS)
def test_a_build_is_atomic_and_a_shipped_library_is_loaded_before_the_cache(isa, isolated, tmp_path, monkeypatch):
    shipped = tmp_path / "artifact"
    path = cpu_kernels.build(isa, shipped)
    assert path.name == cpu_kernels.library_name(isa) and [p.name for p in shipped.iterdir()] == [path.name]
    monkeypatch.setattr(cpu_kernels, "shipped_dir", lambda: shipped)
    monkeypatch.setenv(cpu_kernels.ENV, isa)
    monkeypatch.setenv("CXX", "/nonexistent/g++")  # nothing may be compiled now
    loaded = cpu_kernels.load()
    assert loaded is not None and loaded.path == path and loaded.isa == isa


def test_a_shipped_library_that_does_not_load_here_is_rebuilt_here(isolated, tmp_path, monkeypatch, caplog):
    """A library built for another host (a newer glibc, say) fails dlopen; the worker builds its own."""
    shipped = tmp_path / "artifact"
    shipped.mkdir()
    (shipped / cpu_kernels.library_name("avx2")).write_bytes(b"not an ELF file")
    monkeypatch.setattr(cpu_kernels, "shipped_dir", lambda: shipped)
    monkeypatch.setenv(cpu_kernels.CACHE_ENV, str(isolated / "cache"))
    monkeypatch.setenv(cpu_kernels.ENV, "avx2")
    with caplog.at_level(logging.WARNING, logger=cpu_kernels.__name__):
        loaded = cpu_kernels.load()
    assert loaded is not None and loaded.path == isolated / "cache" / cpu_kernels.library_name("avx2")
    assert "does not load here" in caplog.text


def glibc_imports(library: Path) -> dict:
    """The glibc symbols a shared library imports, with the version each binds to."""
    table = subprocess.run(["objdump", "-T", str(library)], capture_output=True, text=True, check=True).stdout
    return {name: tuple(int(n) for n in version.split("."))
            for version, name in re.findall(r"\*UND\*\s+\S+\s+\(GLIBC_([0-9.]+)\)\s+(\S+)", table)}


def built_with_its_object(isa: str, tmp_path: Path):
    """The kernels compiled to an object file, then linked with :func:`cpu_kernels.build`'s flags; returns
    the library and the external symbols the kernels' own code (the object file) calls."""
    obj, library = tmp_path / f"{isa}.o", tmp_path / f"{isa}.so"
    cxx, flags = cpu_kernels.compiler(), [*cpu_kernels.COMMON_FLAGS, *cpu_kernels.ISA_FLAGS[isa]]
    subprocess.run([cxx, *[f for f in flags if f != "-shared"], "-c", str(cpu_kernels.SOURCE), "-o", str(obj)],
                   check=True, capture_output=True)
    subprocess.run([cxx, *flags, str(obj), "-o", str(library)], check=True, capture_output=True)
    own = subprocess.run(["nm", "-u", "--format=just-symbols", str(obj)], capture_output=True, text=True,
                         check=True).stdout.split()
    return library, set(own)


@pytest.mark.skipif(not (shutil.which("objdump") and shutil.which("nm")), reason="needs binutils (objdump, nm)")
@pytest.mark.parametrize("isa", ISAS)
def test_the_kernels_own_code_needs_no_newer_glibc_than_torch(isa, tmp_path):
    """The build step ships the libraries to serving hosts that may run an older glibc than the build
    machine's. torch's wheels need glibc 2.28 (manylinux_2_28), so what the kernels' own code calls may
    bind to nothing newer (std::mutex's try_lock bound to 2.34's pthread_mutex_trylock). The C++
    runtime a toolchain links may ask for more: a shipped library that does not load is rebuilt."""
    library, own = built_with_its_object(isa, tmp_path)
    newer = {name: version for name, version in glibc_imports(library).items() if name in own and version > (2, 28)}
    assert not newer, newer


def test_without_a_compiler_the_backend_keeps_torchs_kernels_and_logs_why(isolated, monkeypatch, caplog):
    monkeypatch.setattr(cpu_kernels, "shipped_dir", lambda: isolated / "nothing-shipped")
    monkeypatch.setenv(cpu_kernels.CACHE_ENV, str(isolated / "empty-cache"))
    monkeypatch.setenv("CXX", "/nonexistent/g++")
    monkeypatch.setenv(cpu_kernels.ENV, "avx2")
    with caplog.at_level(logging.WARNING, logger=cpu_kernels.__name__):
        assert cpu_kernels.load(frozenset(cpu_kernels.ISA_NEEDS["avx2"])) is None
    assert "native CPU kernels unavailable" in caplog.text and "/nonexistent/g++" in caplog.text


def test_no_compiler_on_the_path_is_a_clear_build_error(tmp_path, monkeypatch):
    monkeypatch.delenv("CXX", raising=False)
    monkeypatch.setattr(shutil, "which", lambda name: None)
    with pytest.raises(cpu_kernels.KernelBuildError, match="no C.. compiler: install g.."):
        cpu_kernels.build("avx2", tmp_path)


def test_a_compiler_error_is_reported_with_its_output(tmp_path, monkeypatch):
    broken = tmp_path / "cpu_kernels.cpp"
    broken.write_text("this is not C++\n")
    monkeypatch.setattr(cpu_kernels, "SOURCE", broken)
    with pytest.raises(cpu_kernels.KernelBuildError, match="failed"):
        cpu_kernels.build("avx2", tmp_path / "out")
    assert not any((tmp_path / "out").iterdir())  # no partial library left behind


def test_the_switch_turns_the_kernels_off_or_names_what_this_cpu_runs(isolated, monkeypatch):
    monkeypatch.setenv(cpu_kernels.ENV, "0")
    assert cpu_kernels.load() is None
    monkeypatch.setenv(cpu_kernels.ENV, "avx512bf16")
    with pytest.raises(ValueError, match="cannot run 'avx512bf16'; use auto, 0, or one of avx2"):
        cpu_kernels.load(frozenset(cpu_kernels.ISA_NEEDS["avx2"]))
    monkeypatch.setenv(cpu_kernels.ENV, "auto")
    assert cpu_kernels.load(frozenset({"sse4_2"})) is None  # no AVX2: torch's kernels


def test_isa_for_picks_the_best_instruction_set_the_cpu_runs():
    assert cpu_kernels.isa_for(cpu_kernels.ISA_NEEDS["avx512bf16"] | {"amx_bf16"}) == "avx512bf16"
    assert cpu_kernels.isa_for(frozenset({"avx2", "fma", "f16c", "avx512f"})) == "avx2"
    skylake_sp = frozenset({"avx2", "fma", "f16c", "avx512f", "avx512bw", "avx512vl", "avx512dq", "avx512cd"})
    assert cpu_kernels.isa_for(skylake_sp) == "avx512"
    assert cpu_kernels.isa_for(skylake_sp | {"avx512_vnni"}) == "avx512"
    assert cpu_kernels.isa_for(skylake_sp | {"avx512_bf16"}) == "avx512bf16"
    assert cpu_kernels.isa_for(frozenset({"avx", "sse4_2"})) is None


@pytest.mark.skipif(not _loaded_libgomps(), reason="torch here runs no libgomp")
@pytest.mark.parametrize("isa", ISAS)
def test_the_kernels_bring_no_second_openmp_runtime(isa, isolated):
    """In a fresh process: loading and running the kernels maps no OpenMP runtime besides the one torch
    loaded (their threads are their own pool), so nothing else spins on torch's cores."""
    script = (
        "import os, torch\n"
        "from llama_engine.backends import cpu_kernels\n"
        "from llama_engine.cpu import _loaded_libgomps\n"
        "before = _loaded_libgomps()\n"
        f"os.environ[cpu_kernels.ENV] = {isa!r}\n"
        "kernels = cpu_kernels.load()\n"
        "kernels.linear(torch.ones(2, 64), torch.ones(256, 64))  # runs a parallel region\n"
        "print(before, _loaded_libgomps())\n")
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=300,
                          env={**os.environ, cpu_kernels.CACHE_ENV: str(isolated)})
    assert done.returncode == 0, done.stderr
    before, after = done.stdout.strip().split("] [")
    assert before + "]" == "[" + after and "torch" in after, done.stdout


def ulps_apart(got: torch.Tensor, want: torch.Tensor) -> torch.Tensor:
    """How many representable values of the dtype lie between ``got`` and ``want`` (same signs here)."""
    bits = {torch.bfloat16: torch.int16, torch.float32: torch.int32}[got.dtype]
    return (got.view(bits).long() - want.view(bits).long()).abs()


@pytest.mark.parametrize("kernels", ISAS, indirect=True)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("with_delta", [True, False])
def test_add_rmsnorm_is_the_residual_add_then_hfs_rmsnorm(kernels, dtype, with_delta):
    from transformers.models.llama.modeling_llama import LlamaRMSNorm

    gen = torch.Generator().manual_seed(3)
    norm = LlamaRMSNorm(200, eps=1e-6).to(dtype)
    norm.weight.data = torch.randn(200, generator=gen).to(dtype)
    hidden = (torch.randn(5, 200, generator=gen) * 4).to(dtype)
    delta = torch.randn(5, 200, generator=gen).to(dtype) if with_delta else None
    want_hidden = hidden + delta if with_delta else hidden.clone()
    with torch.inference_mode():
        want = norm(want_hidden)
        got = kernels.add_rmsnorm(hidden, delta, norm.weight, 1e-6)
    assert torch.equal(hidden, want_hidden)  # the residual add, in place, rounded as torch's
    # the same ops and roundings; only the order of the float32 sum of squares differs, which moves the
    # scale by an ulp or two: a bf16 result now and then by one, a float32 one by a few
    ulps = ulps_apart(got, want)
    if dtype == torch.bfloat16:
        assert ulps.max().item() <= 1 and (ulps > 0).float().mean().item() < 0.02
    else:
        assert ulps.max().item() <= 8


@pytest.mark.parametrize("kernels", ISAS, indirect=True)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_silu_mul_is_silu_of_the_gate_times_the_up_projection(kernels, dtype):
    gen = torch.Generator().manual_seed(4)
    gate_up = (torch.randn(3, 2 * 136, generator=gen) * 6).to(dtype)  # 136: vector and scalar tails
    with torch.inference_mode():
        gate, up = gate_up.split(136, dim=-1)
        want = torch.nn.functional.silu(gate) * up
        got = kernels.silu_mul(gate_up)
    # exp is the kernel's own (within 2 ulps of float32): an ulp of the rounded result now and then
    assert got.shape == want.shape and ulps_apart(got, want).max().item() <= (1 if dtype == torch.bfloat16 else 4)


@pytest.mark.parametrize("kernels", ISAS, indirect=True)
@pytest.mark.parametrize("dtype, kv_dtype", [(torch.bfloat16, torch.bfloat16), (torch.bfloat16, torch.float32),
                                             (torch.float32, torch.float32), (torch.float32, torch.bfloat16)])
@pytest.mark.parametrize("heads, kv_heads, dim", [(4, 2, 64), (3, 3, 32), (2, 1, 128)])
def test_rope_store_rotates_like_the_backend_and_writes_each_tokens_kv_at_its_slot_and_position(
        kernels, dtype, kv_dtype, heads, kv_heads, dim):
    from llama_engine.backends.torch_backend import _rotate, _signed_sin

    gen = torch.Generator().manual_seed(dim + heads)
    angles = torch.randn(50, dim // 2, generator=gen) * 20
    cos, sin = torch.cat([angles.cos()] * 2, -1).to(dtype), torch.cat([angles.sin()] * 2, -1).to(dtype)
    signed = _signed_sin(sin)
    width = (heads + 2 * kv_heads) * dim
    qkv = torch.randn(4, width + 8, generator=gen).to(dtype)[:, :width]  # rows further apart than a row
    positions, slots = torch.tensor([7, 0, 49, 8]), torch.tensor([2, 0, 1, 2])
    k_layer, v_layer = (torch.zeros(3, kv_heads, 50, dim, dtype=kv_dtype) for _ in range(2))
    per_head = qkv.reshape(4, heads + 2 * kv_heads, dim).clone()
    want = _rotate(per_head[:, :heads + kv_heads], cos[positions].unsqueeze(1), signed[positions].unsqueeze(1))
    kernels.rope_store(qkv, heads, kv_heads, cos, signed, positions, slots, k_layer, v_layer)
    got = qkv.reshape(4, heads + 2 * kv_heads, dim)
    assert torch.equal(got[:, :heads + kv_heads], want)
    assert torch.equal(got[:, heads + kv_heads:], per_head[:, heads + kv_heads:])  # v untouched
    for t in range(4):
        assert torch.equal(k_layer[slots[t], :, positions[t]], want[t, heads:].to(kv_dtype))
        assert torch.equal(v_layer[slots[t], :, positions[t]], per_head[t, heads + kv_heads:].to(kv_dtype))
    assert int((k_layer != 0).any(-1).sum()) == 4 * kv_heads  # nothing else written


def layer_by_layer(kernels, hidden, layers, k_cache, v_cache, cos, ssin, positions, slots, lengths, heads, kv_heads,
                   eps, pairs=False):
    """What the torch backend's fused forward does for a decode pass: each kernel called from Python."""
    dim = k_cache.shape[-1]
    delta = None
    linear = (lambda x, w: kernels.linear(x, w, pairs=True)) if pairs else kernels.linear
    for index, layer in enumerate(layers):
        normed = kernels.add_rmsnorm(hidden, delta, layer["input_norm"], eps)
        qkv = linear(normed, layer["qkv"])
        kernels.rope_store(qkv, heads, kv_heads, cos, ssin, positions, slots, k_cache[index], v_cache[index])
        q = qkv[:, :heads * dim].reshape(-1, heads, dim)
        attended = kernels.decode_attention(q, k_cache[index], v_cache[index], slots, lengths, dim ** -0.5)
        delta = linear(attended.reshape(len(hidden), -1), layer["o"])
        normed = kernels.add_rmsnorm(hidden, delta, layer["post_norm"], eps)
        delta = linear(kernels.silu_mul(linear(normed, layer["gate_up"])), layer["down"])
    return delta


def random_weight(rand, weight_dtype, rows, columns, scale=1.0):
    """A product's random weight ``[rows, columns]`` in ``weight_dtype`` (int8: quantized, its scales behind it)."""
    if weight_dtype == torch.int8:
        return int8_rows.quantize(rand(rows, columns, dt=torch.float32) * scale)
    return rand(rows, columns, dt=weight_dtype) * scale


def random_layers(rand, gen, weight_dtype, n_layers, heads, kv_heads, dim, width, inner, max_length):
    """``n_layers`` layers of random weights for :class:`cpu_kernels.DecodeLayers` (``rand(*shape, dt=...)``: norms
    in the activations' dtype, products in ``weight_dtype``), and the rotary tables in the activations' dtype."""
    def weight(rows, columns):
        return random_weight(rand, weight_dtype, rows, columns)

    layers = [{"input_norm": 1 + rand(width) * 0.1, "qkv": weight((heads + 2 * kv_heads) * dim, width),
               "o": weight(width, heads * dim), "post_norm": 1 + rand(width) * 0.1,
               "gate_up": weight(2 * inner, width), "down": weight(width, inner)}
              for _ in range(n_layers)]
    dtype = layers[0]["input_norm"].dtype
    angles = torch.randn(max_length, dim // 2, generator=gen)
    return layers, torch.cat([angles.cos()] * 2, -1).to(dtype), torch.cat([-angles.sin(), angles.sin()], -1).to(dtype)


@pytest.mark.parametrize("kernels", ISAS, indirect=True)
@pytest.mark.parametrize("dtype, weight_dtype, kv_dtype", sorted(cpu_kernels.DECODE_LAYERS_DTYPES, key=str))
@pytest.mark.parametrize("threads", [1, 2])
def test_decode_layers_in_one_call_compute_the_kernels_called_one_by_one_bit_for_bit(kernels, dtype, weight_dtype,
                                                                                      kv_dtype, threads):
    """Three rows in slots out of order, of different lengths (one at position 0), GQA heads: the same hidden
    state, last residual and K/V cache, bit for bit, as the kernels called one by one from Python."""
    gen = torch.Generator().manual_seed(7)
    heads, kv_heads, dim, width, inner, n_layers, max_length = 4, 2, 32, 64, 96, 3, 16
    rand = lambda *shape, dt=dtype: (torch.randn(*shape, generator=gen) * 0.5).to(dt)  # noqa: E731
    layers, cos, ssin = random_layers(rand, gen, weight_dtype, n_layers, heads, kv_heads, dim, width, inner, max_length)
    cache = rand(n_layers, 4, kv_heads, max_length, dim, dt=kv_dtype)
    positions, slots = torch.tensor([5, 0, 11]), torch.tensor([2, 0, 3])
    hidden = rand(3, width)
    step = cpu_kernels.DecodeLayers(kernels, layers, heads, kv_heads, dim, 1e-5)
    previous = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        want_hidden, want_k, want_v = hidden.clone(), cache.clone(), cache.clone()
        want = layer_by_layer(kernels, want_hidden, layers, want_k, want_v, cos, ssin, positions, slots, positions + 1,
                              heads, kv_heads, 1e-5)
        got_k, got_v = cache.clone(), cache.clone()
        got = step(hidden, got_k, got_v, cos, ssin, positions, slots, positions + 1)
    finally:
        torch.set_num_threads(previous)
    assert torch.equal(got, want) and torch.equal(hidden, want_hidden)
    assert torch.equal(got_k, want_k) and torch.equal(got_v, want_v)
    assert not torch.equal(got_k, cache)  # the step wrote its keys


@pytest.mark.parametrize("kernels", ISAS, indirect=True)
@pytest.mark.parametrize("dtype, weight_dtype", [(torch.float32, torch.float32), (torch.float32, torch.bfloat16),
                                                 (torch.bfloat16, torch.bfloat16), (torch.float32, torch.int8),
                                                 (torch.bfloat16, torch.int8)])
@pytest.mark.parametrize("threads", [1, 2])
def test_decode_layers_with_a_head_end_with_float32_logits_and_each_rows_greedy_pick(kernels, dtype, weight_dtype,
                                                                                   threads):
    """With the final norm and the LM head: the logits of those two kernels called after the layers, widened to
    float32, and each row's greedy pick (torch's first argmax and its log_softmax value) attached. A vocabulary
    that is no multiple of the vector width; a head of zeros ties every token, and the first one is picked."""
    gen = torch.Generator().manual_seed(5)
    heads, kv_heads, dim, width, inner, max_length, vocab = 4, 2, 32, 64, 96, 16, 100
    rand = lambda *shape, dt=dtype: (torch.randn(*shape, generator=gen) * 0.5).to(dt)  # noqa: E731
    layers, cos, ssin = random_layers(rand, gen, weight_dtype, 2, heads, kv_heads, dim, width, inner, max_length)
    norm, lm_head = 1 + rand(width) * 0.1, random_weight(rand, weight_dtype, vocab, width, scale=4)
    cache = rand(2, 4, kv_heads, max_length, dim)
    positions, slots, hidden = torch.tensor([5, 0, 11]), torch.tensor([2, 0, 3]), rand(3, width)
    previous = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        want_hidden = hidden.clone()
        delta = layer_by_layer(kernels, want_hidden, layers, cache.clone(), cache.clone(), cos, ssin, positions, slots,
                               positions + 1, heads, kv_heads, 1e-5)
        want = kernels.linear(kernels.add_rmsnorm(want_hidden, delta, norm, 1e-5), lm_head).float()
        got = cpu_kernels.DecodeLayers(kernels, layers, heads, kv_heads, dim, 1e-5, head=(norm, lm_head))(
            hidden.clone(), cache.clone(), cache.clone(), cos, ssin, positions, slots, positions + 1)
        tied = cpu_kernels.DecodeLayers(kernels, layers, heads, kv_heads, dim, 1e-5,
                                        head=(norm, random_weight(rand, weight_dtype, vocab, width, scale=0)))(
            hidden.clone(), cache.clone(), cache.clone(), cos, ssin, positions, slots, positions + 1)
    finally:
        torch.set_num_threads(previous)
    assert got.dtype == torch.float32 and torch.equal(got, want)
    tokens, logprobs = take_greedy_picks(got)
    assert tokens == want.argmax(-1).tolist() and len(set(tokens)) > 1
    assert logprobs == pytest.approx(want.log_softmax(-1).gather(1, want.argmax(-1, keepdim=True)).squeeze(1).tolist(),
                                     rel=1e-5, abs=1e-6)
    assert take_greedy_picks(tied) == ([0, 0, 0], pytest.approx([-math.log(vocab)] * 3, rel=1e-6))


@pytest.mark.parametrize("kernels", ISAS, indirect=True)
@pytest.mark.parametrize("dtype, weight_dtype", [(torch.float32, torch.bfloat16), (torch.bfloat16, torch.bfloat16)])
def test_a_decode_step_from_token_ids_is_the_call_over_their_embeddings(kernels, dtype, weight_dtype):
    """``decode_step``: the logits, picks and K/V cache of the call over ``embedding[ids]`` with lengths one past
    the positions, bit for bit; steps of 3, 1 and again 3 rows (its kept buffers), whose logits stay as they were
    returned; an id outside the vocabulary and a call without the head refused, naming what is wrong."""
    gen = torch.Generator().manual_seed(13)
    heads, kv_heads, dim, width, inner, max_length, vocab = 4, 2, 32, 64, 96, 16, 50
    rand = lambda *shape, dt=dtype: (torch.randn(*shape, generator=gen) * 0.5).to(dt)  # noqa: E731
    layers, cos, ssin = random_layers(rand, gen, weight_dtype, 2, heads, kv_heads, dim, width, inner, max_length)
    head = (1 + rand(width) * 0.1, rand(vocab, width, dt=weight_dtype) * 4)
    embedding, cache = rand(vocab, width), rand(2, 4, kv_heads, max_length, dim)
    step = cpu_kernels.DecodeLayers(kernels, layers, heads, kv_heads, dim, 1e-5, head=head, embedding=embedding)
    got_k, got_v, want_k, want_v = cache.clone(), cache.clone(), cache.clone(), cache.clone()
    kept = []
    for ids, positions, slots in (([7, 0, 49], [5, 0, 11], [2, 0, 3]), ([3], [6], [2]), ([8, 9, 1], [7, 1, 12],
                                                                                         [2, 0, 3])):
        got = step.decode_step(ids, positions, slots, got_k, got_v, cos, ssin)
        at = torch.tensor(positions)
        want = step(embedding[ids], want_k, want_v, cos, ssin, at, torch.tensor(slots), at + 1)
        assert torch.equal(got, want) and take_greedy_picks(got) == take_greedy_picks(want)
        kept.append((got, got.clone()))
    assert torch.equal(got_k, want_k) and torch.equal(got_v, want_v) and not torch.equal(got_k, cache)
    assert all(torch.equal(returned, copy) for returned, copy in kept)
    with pytest.raises(ValueError, match=r"token id out of range \[0, 50\)"):
        step.decode_step([50], [2], [1], got_k, got_v, cos, ssin)
    with pytest.raises(ValueError, match="decode_step needs the head"):
        cpu_kernels.DecodeLayers(kernels, layers, heads, kv_heads, dim, 1e-5, embedding=embedding).decode_step(
            [1], [2], [1], got_k, got_v, cos, ssin)


@pytest.mark.parametrize("kernels", ISAS[:2], indirect=True)
@pytest.mark.parametrize("dtype, kv_dtype", [(torch.bfloat16, torch.bfloat16), (torch.float32, torch.float32),
                                             (torch.float32, torch.bfloat16), (torch.bfloat16, torch.float32)])
@pytest.mark.parametrize("rows", [3, 14, 40])
def test_decode_layers_over_pair_panels_compute_the_kernels_called_one_by_one_bit_for_bit(kernels, dtype, kv_dtype,
                                                                                          rows):
    """bf16 weights in pair panels through one call (``pairs=True``): the numbers of the paired products called
    one by one, and close to the plain layout's (another order of summation). 14 rows take two tiles of 7."""
    gen = torch.Generator().manual_seed(11)
    heads, kv_heads, dim, width, inner, n_layers, max_length = 4, 2, 32, 64, 96, 2, 32
    rand = lambda *shape, dt=dtype: (torch.randn(*shape, generator=gen) * 0.5).to(dt)  # noqa: E731
    plain = [{"input_norm": 1 + rand(width) * 0.1, "qkv": rand((heads + 2 * kv_heads) * dim, width, dt=torch.bfloat16),
              "o": rand(width, heads * dim, dt=torch.bfloat16), "post_norm": 1 + rand(width) * 0.1,
              "gate_up": rand(2 * inner, width, dt=torch.bfloat16), "down": rand(width, inner, dt=torch.bfloat16)}
             for _ in range(n_layers)]
    paired = [{name: kernels.pack_pairs(t) if name in ("qkv", "o", "gate_up", "down") else t
               for name, t in layer.items()} for layer in plain]
    angles = torch.randn(max_length, dim // 2, generator=gen)
    cos = torch.cat([angles.cos()] * 2, -1).to(dtype)
    ssin = torch.cat([-angles.sin(), angles.sin()], -1).to(dtype)
    cache = rand(n_layers, rows, kv_heads, max_length, dim, dt=kv_dtype)
    positions = torch.randint(0, max_length, (rows,), generator=gen)
    slots = torch.randperm(rows, generator=gen)
    hidden = rand(rows, width)
    want_hidden, want_k, want_v = hidden.clone(), cache.clone(), cache.clone()
    want = layer_by_layer(kernels, want_hidden, paired, want_k, want_v, cos, ssin, positions, slots, positions + 1,
                          heads, kv_heads, 1e-5, pairs=True)
    got_k, got_v, got_hidden = cache.clone(), cache.clone(), hidden.clone()
    step = cpu_kernels.DecodeLayers(kernels, paired, heads, kv_heads, dim, 1e-5, pairs=True)
    got = step(got_hidden, got_k, got_v, cos, ssin, positions, slots, positions + 1)
    assert torch.equal(got, want) and torch.equal(got_hidden, want_hidden)
    assert torch.equal(got_k, want_k) and torch.equal(got_v, want_v)
    plain_hidden = hidden.clone()
    in_plain = cpu_kernels.DecodeLayers(kernels, plain, heads, kv_heads, dim, 1e-5)(
        plain_hidden, cache.clone(), cache.clone(), cos, ssin, positions, slots, positions + 1)
    scale = in_plain.float().abs().max().item()
    assert (got.float() - in_plain.float()).abs().max().item() <= 0.05 * scale


@pytest.mark.parametrize("kernels", ISAS[:2], indirect=True)
def test_decode_layers_over_pair_panels_refuse_shapes_the_panels_do_not_fit(kernels):
    width, dim = 48, 32  # o and down's 48 outputs are not whole pairs of panels
    layer = {"input_norm": torch.ones(width, dtype=torch.bfloat16), "post_norm": torch.ones(width, dtype=torch.bfloat16),
             "qkv": torch.zeros(6 * dim, width, dtype=torch.bfloat16), "o": torch.zeros(width, 2 * dim, dtype=torch.bfloat16),
             "gate_up": torch.zeros(64, width, dtype=torch.bfloat16), "down": torch.zeros(width, 32, dtype=torch.bfloat16)}
    step = cpu_kernels.DecodeLayers(kernels, [layer], 2, 2, dim, 1e-5, pairs=True)
    cache = torch.zeros(1, 1, 2, 8, dim, dtype=torch.bfloat16)
    one = torch.tensor([0])
    with pytest.raises(ValueError, match="pair panels"):
        step(torch.zeros(1, width, dtype=torch.bfloat16), cache, cache.clone(), torch.ones(8, dim, dtype=torch.bfloat16),
             torch.zeros(8, dim, dtype=torch.bfloat16), one, one, one + 1)


@pytest.mark.parametrize("kernels", ISAS[-1:], indirect=True)
def test_decode_layers_refuse_weights_they_cannot_point_at_and_name_dtypes_they_do_not_run(kernels):
    width, dim = 64, 32
    layer = {"input_norm": torch.ones(width), "qkv": torch.zeros(3 * dim * 2, width), "o": torch.zeros(width, 2 * dim),
             "post_norm": torch.ones(width), "gate_up": torch.zeros(64, width), "down": torch.zeros(width, 32)}
    with pytest.raises(ValueError, match="contiguous"):
        cpu_kernels.DecodeLayers(kernels, [dict(layer, o=layer["o"].T)], 2, 2, dim, 1e-5)
    step = cpu_kernels.DecodeLayers(kernels, [dict(layer, qkv=layer["qkv"].half())], 2, 2, dim, 1e-5)
    cache = torch.zeros(1, 1, 2, 8, dim)
    one = torch.tensor([0])
    with pytest.raises(ValueError, match="torch.float16 weights"):
        step(torch.zeros(1, width), cache, cache.clone(), torch.ones(8, dim), torch.zeros(8, dim), one, one, one + 1)


@pytest.mark.parametrize("kernels", ISAS[:1], indirect=True)
def test_the_kernels_thread_pool_gives_every_caller_its_own_right_answer(kernels):
    """Two Python threads call the kernels at once (ctypes drops the GIL: one gets the pool, the other runs
    alone), with pauses long enough for the helpers to fall asleep between some calls, and jobs of
    different chunk counts back to back: every result is the float64 product to bf16 rounding."""
    import threading
    import time

    gen = torch.Generator().manual_seed(5)
    shapes = [(1, 768, 2304), (3, 256, 100), (8, 3072, 768), (1, 64, 7)]
    cases = [(torch.randn(m, k, generator=gen).to(torch.bfloat16), torch.randn(n, k, generator=gen).to(torch.bfloat16))
             for m, k, n in shapes]
    wants = [x.double() @ w.double().T for x, w in cases]
    failures = []
    previous = torch.get_num_threads()
    torch.set_num_threads(2)

    def caller(seed):
        order = torch.randperm(200, generator=torch.Generator().manual_seed(seed)) % len(cases)
        for i, case in enumerate(order.tolist()):
            got = kernels.linear(*cases[case]).double()
            bound = ROUNDING[torch.bfloat16] * wants[case].abs() + ACCUMULATION * 4096
            if ((got - wants[case]).abs() > bound).any():
                failures.append((seed, i, case))
            if i % 50 == 49:
                time.sleep(0.01)  # past the helpers' spin: they sleep, and the next job wakes them

    try:
        threads = [threading.Thread(target=caller, args=(seed,)) for seed in (1, 2)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(timeout=120)
    finally:
        torch.set_num_threads(previous)
    assert not any(t.is_alive() for t in threads), "a call never returned"
    assert not failures, failures[:5]


@pytest.mark.parametrize("kernels", ISAS, indirect=True)
def test_the_pool_runs_every_chunk_of_every_job_exactly_once(kernels):
    """Hundreds of thousands of jobs of 1-64 chunks back to back, helpers late or early: each chunk of each
    job ran once before its job returned. (A helper that read the next job before its ticket opened once ran
    a chunk early, and a served worker crashed on it under load.)"""
    assert kernels.pool_check(jobs=200_000, max_chunks=64, threads=3) == 0
    assert kernels.pool_check(jobs=20_000, max_chunks=2, threads=2) == 0


def test_the_build_step_ships_every_instruction_set_or_says_why_not(tmp_path, monkeypatch, capsys):
    from scripts import build_archive

    monkeypatch.setenv(cpu_kernels.CACHE_ENV, str(tmp_path / "cache"))
    built = build_archive.ship_native_kernels(tmp_path / "with")
    assert sorted(p.name for p in built) == sorted(cpu_kernels.library_name(isa) for isa in cpu_kernels.ISAS)
    assert all(p.parent == tmp_path / "with" and p.stat().st_size > 0 for p in built)
    monkeypatch.setenv(cpu_kernels.CACHE_ENV, str(tmp_path / "empty-cache"))
    monkeypatch.setenv("CXX", "/nonexistent/g++")
    assert build_archive.ship_native_kernels(tmp_path / "without") == []
    assert "native CPU kernels not shipped" in capsys.readouterr().out
    assert not list((tmp_path / "without").glob("*.so"))


def test_a_second_build_ships_the_cached_libraries_without_compiling(tmp_path, monkeypatch):
    """The libraries compiled for one archive are copied into the next (same source and flags, same name)."""
    monkeypatch.setattr(cpu_kernels, "ISAS", ("avx2", "avx512"))  # two compile faster than three, and show it
    monkeypatch.setenv(cpu_kernels.CACHE_ENV, str(tmp_path / "cache"))
    first = cpu_kernels.build_all(tmp_path / "first")
    cached = {p.name: p.read_bytes() for p in (tmp_path / "cache").glob("*.so")}
    assert sorted(cached) == sorted(p.name for p in first)
    monkeypatch.setenv("CXX", "/nonexistent/g++")  # nothing may be compiled now
    second = cpu_kernels.build_all(tmp_path / "second")
    assert {p.name: p.read_bytes() for p in second} == cached
    assert all(p.parent == tmp_path / "second" for p in second)
    cpu_kernels.CpuKernels(second[0], "avx2")  # loads
    (tmp_path / "cache" / cpu_kernels.library_name("avx512")).unlink()  # one missing: it is compiled again
    with pytest.raises(cpu_kernels.KernelBuildError, match="/nonexistent/g.. .*-DLLK_AVX512 "):
        cpu_kernels.build_all(tmp_path / "third")


def test_an_unwritable_cache_compiles_into_the_archive(tmp_path, monkeypatch):
    monkeypatch.setattr(cpu_kernels, "ISAS", ("avx2",))
    blocked = tmp_path / "a-file"
    blocked.write_text("")
    monkeypatch.setenv(cpu_kernels.CACHE_ENV, str(blocked / "cache"))  # under a file: mkdir fails
    built = cpu_kernels.build_all(tmp_path / "archive")
    assert sorted(p.name for p in built) == sorted(cpu_kernels.library_name(isa) for isa in cpu_kernels.ISAS)
    assert all(p.parent == tmp_path / "archive" and p.stat().st_size > 0 for p in built)
