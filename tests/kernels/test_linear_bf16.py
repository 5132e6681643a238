"""The compiled small-batch linear layer (``CpuKernels.linear_bf16``) and the packed linear layers
that use it (``services.engine.model.packed_linear``) where bfloat16 weights compute in float32.

The reference is float32 arithmetic on the same bfloat16 values, rounded to bfloat16 once: what
the kernel promises. Float32 sums in another order differ by about 1e-6, which may move a result
across a bfloat16 rounding boundary: hence the tolerance of one unit in the last place (plus 1e-5
for results near zero, whose last place is finer than the float32 sums' error).
"""

from __future__ import annotations

import pytest
import torch
from torch import nn

from kernels import cpu_ops
from kernels.cpu_ops import TiledWeight
from services.engine.model.packed_linear import (
    PackedLinear,
    onednn_supports,
    pack_linears,
)

# Native bfloat16 GEMMs (oneDNN's bf16 path) need AVX-512 BW/VL/DQ or AVX-NE-CONVERT: an AVX2-only
# CPU (e.g. AMD Zen 2) has neither, and pdserve then computes bfloat16 weights in float32.
NATIVE = pytest.mark.skipif(
    not onednn_supports(torch.bfloat16),
    reason="oneDNN's bf16 path needs AVX-512 BW/VL/DQ or AVX-NE-CONVERT, which this CPU lacks",
)


def needs_dot(kernel: cpu_ops.CpuKernels) -> None:
    if not kernel.bf16_dot:
        pytest.skip("the dot-product variant needs AVX-512 BF16, which this CPU lacks")


def reference(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    y = x.float() @ weight.float().T
    return (y if bias is None else y + bias).to(torch.bfloat16)


def assert_within_one_ulp(actual: torch.Tensor, expected: torch.Tensor) -> None:
    assert actual.dtype == torch.bfloat16 and actual.shape == expected.shape
    ulp = expected.float().abs() * 2.0**-7  # at least one bfloat16 step (8 significant bits)
    assert bool(((actual.float() - expected.float()).abs() <= ulp + 1e-5).all())


@pytest.mark.parametrize("rows", [1, 2, 3, 4])
@pytest.mark.parametrize("out_features", [960, 1001])  # 1001: 1 feature past the 8- and 4-row tiles
@pytest.mark.parametrize("bias", [False, True])
def test_matches_float32_math_on_bfloat16_values(
    kernel: cpu_ops.CpuKernels, rows: int, out_features: int, bias: bool
) -> None:
    """Within one bfloat16 step of float32 math, and bit-identical whichever number of weight
    rows is read together (each output's sum runs over the input in the same order)."""
    torch.manual_seed(rows + out_features)
    x = torch.randn(rows, 576).to(torch.bfloat16)
    weight = (torch.randn(out_features, 576) * 0.05).to(torch.bfloat16)
    b = torch.randn(out_features) if bias else None
    eight = kernel.linear_bf16(x, TiledWeight.of(weight, 8), b)
    assert_within_one_ulp(eight, reference(x, weight, b))
    assert torch.equal(kernel.linear_bf16(x, TiledWeight.of(weight, 4), b), eight)


@pytest.mark.parametrize("rows", [1, 2, 3, 4, 5, 6, 7, 8, 11, 13, 16])
@pytest.mark.parametrize("in_features", [576, 1536])
@pytest.mark.parametrize("out_features", [960, 1001])  # 1001: one feature past the 4-row tiles
@pytest.mark.parametrize("bias", [False, True])
def test_dot_products_match_float32_math_on_bfloat16_values(
    kernel: cpu_ops.CpuKernels, rows: int, in_features: int, out_features: int, bias: bool
) -> None:
    """The dot-product variant, 1-16 rows in passes of up to six: within one bfloat16 step of
    float32 math (its sums run in another order than the widening kernel's)."""
    needs_dot(kernel)
    torch.manual_seed(rows + in_features + out_features)
    x = torch.randn(rows, in_features).to(torch.bfloat16)
    weight = (torch.randn(out_features, in_features) * 0.05).to(torch.bfloat16)
    b = torch.randn(out_features) if bias else None
    y = kernel.linear_bf16(x, TiledWeight.of(weight, 4, dot=True), b)
    assert y is not None
    assert_within_one_ulp(y, reference(x, weight, b))
    for row in (0, rows - 1):  # a row's result does not depend on the rows beside it
        alone = kernel.linear_bf16(x[row : row + 1], TiledWeight.of(weight, 4, dot=True), b)
        assert torch.equal(alone, y[row : row + 1])


@pytest.mark.parametrize("row_tile", [4, 8])
@pytest.mark.parametrize("out_features", [8, 13, 64])
def test_tiled_order_round_trips(row_tile: int, out_features: int) -> None:
    """The tiled copy holds every weight once, in the kernel's order: a tile's first 16
    inputs of each of its rows in turn, then the next 16; the rows past the last tile plain."""
    weight = torch.arange(out_features * 32, dtype=torch.float32).view(out_features, 32)
    tiled = TiledWeight.of(weight.to(torch.bfloat16), row_tile)
    assert tiled.data.shape == weight.shape and tiled.data.is_contiguous()
    assert torch.equal(tiled.untiled(), weight.to(torch.bfloat16))
    flat = tiled.data.view(-1)
    assert torch.equal(flat[16:32], weight[1, :16].to(torch.bfloat16))  # row 1, inputs 0-15
    assert torch.equal(flat[row_tile * 16 : row_tile * 16 + 16], weight[0, 16:].bfloat16())
    tail = out_features % row_tile
    if tail:
        assert torch.equal(tiled.data[-tail:], weight[-tail:].to(torch.bfloat16))
    with pytest.raises(ValueError, match="row_tile must be one of"):
        TiledWeight.of(weight, 5)
    with pytest.raises(ValueError, match="4 with dot products"):
        TiledWeight.of(weight, 8, dot=True)
    with pytest.raises(ValueError, match="multiple of 16"):
        TiledWeight.of(weight[:, :24], 4)


def test_declines_what_it_does_not_take(kernel: cpu_ops.CpuKernels) -> None:
    plain = torch.randn(32, 64).to(torch.bfloat16)
    weight = TiledWeight.of(plain, 8)
    x = torch.randn(5, 64).to(torch.bfloat16)
    assert kernel.linear_bf16(x, weight, None) is None  # more rows than LINEAR_MAX_ROWS
    assert kernel.linear_bf16(x[:1].float(), weight, None) is None  # float32 input
    assert kernel.linear_bf16(x[:1, :48], TiledWeight.of(plain[:, :48], 8), None) is not None
    forty = TiledWeight(plain[:, :40].contiguous(), 8)
    assert kernel.linear_bf16(x[:1, :40], forty, None) is None  # 40 % 16
    assert kernel.linear_bf16(x[:1, :32], TiledWeight(plain[:, :32], 8), None) is None  # strided
    assert kernel.linear_bf16(x[:1], TiledWeight(weight.data, 5), None) is None  # no such tile
    if kernel.bf16_dot:  # the dot products take 16 rows, not 17
        dot = TiledWeight.of(plain, 4, dot=True)
        assert kernel.linear_bf16(torch.randn(16, 64).bfloat16(), dot, None) is not None
        assert kernel.linear_bf16(torch.randn(17, 64).bfloat16(), dot, None) is None


def test_nan_and_rounding_to_nearest_even(kernel: cpu_ops.CpuKernels) -> None:
    weight = torch.zeros(8, 16, dtype=torch.bfloat16)
    weight[:, 0] = 1.0
    x = torch.zeros(1, 16, dtype=torch.bfloat16)
    # 1 + 2^-8 lies halfway between two bfloat16 values (1 and 1 + 2^-7): even is 1.
    bias = torch.tensor([1 + 2.0**-8, 1 + 3 * 2.0**-8, float("nan"), 0, 0, 0, 0, 0])
    y = kernel.linear_bf16(x, TiledWeight.of(weight, 8), bias)
    assert y[0, 0].item() == 1.0 and y[0, 1].item() == 1 + 2.0**-6 and y[0, 2].isnan()
    if kernel.bf16_dot:  # the dot products' sums are rounded the same way
        dot = kernel.linear_bf16(x, TiledWeight.of(weight, 4, dot=True), bias)
        assert torch.equal(dot.view(torch.int16), y.view(torch.int16))  # NaN's bits too


def test_linear_declines_shapes_that_disagree(kernel: cpu_ops.CpuKernels) -> None:
    """None (the packed GEMM then runs, and raises what ``F.linear`` raises) for a weight that
    is not [out, in], a bias not [out] or strided, or no output features: the kernel would read
    past them."""
    x, weight = torch.randn(1, 64).to(torch.bfloat16), torch.randn(16, 64).to(torch.bfloat16)
    bias = torch.randn(16, 2)
    assert kernel.linear_bf16(x, TiledWeight.of(weight, 8), bias[:, 0].contiguous()) is not None
    for bad_weight, bad_bias in [
        (torch.randn(16, 32).to(torch.bfloat16), None),  # 32 inputs for x's 64
        (weight, torch.randn(4)),
        (weight, bias[:, 0]),  # strided
        (torch.randn(0, 64).to(torch.bfloat16), None),
        (torch.randn(2, 16, 64).to(torch.bfloat16), None),
    ]:
        assert kernel.linear_bf16(x, TiledWeight(bad_weight, 8), bad_bias) is None


@pytest.mark.parametrize("rows", [1, 4, 64])  # 1, 4: the kernel; 64: the oneDNN GEMM
@pytest.mark.parametrize("large", ["float32", pytest.param("native", marks=NATIVE)])
def test_packed_bf16_linear_matches_float32_math(
    kernel: cpu_ops.CpuKernels, rows: int, large: str
) -> None:
    """The engine's table for bfloat16 weights: the kernel for 1-4 rows, oneDNN above."""
    torch.manual_seed(rows)
    linear = nn.Linear(576, 960, bias=True).to(torch.bfloat16)
    calls: list[int] = []

    def counted(x, w, b):  # type: ignore[no-untyped-def]
        calls.append(len(x))
        return kernel.linear_bf16(x, w, b)

    packed = PackedLinear(linear, ("small-batch", "small-batch") + (large,) * 4, counted)
    x = torch.randn(rows, 576).to(torch.bfloat16)
    with torch.inference_mode():
        out = packed(x)
    assert calls == ([rows] if rows <= 4 else [])
    bias = linear.bias.detach().float()
    assert_within_one_ulp(out, reference(x, linear.weight.detach(), bias))


def test_a_tied_head_computes_from_the_embedding(kernel: cpu_ops.CpuKernels) -> None:
    """A head tied to the embedding reads a tiled copy of the embedding's weight (the embedding
    keeps its own rows for lookups): the logits are the embedding's."""
    embedding = nn.Embedding(64, 32).to(torch.bfloat16)
    head = nn.Linear(32, 64, bias=False).to(torch.bfloat16)
    head.weight = embedding.weight
    model = nn.ModuleDict({"embed": embedding, "head": head})
    paths = ("small-batch", "small-batch", "float32", "float32", "float32", "float32")
    assert pack_linears(model, lambda name, linear: paths, kernel.linear_bf16) == 1
    x = torch.randn(1, 32).to(torch.bfloat16)
    with torch.inference_mode():
        logits = model["head"](x)
    assert_within_one_ulp(logits, reference(x, embedding.weight.detach(), None))
