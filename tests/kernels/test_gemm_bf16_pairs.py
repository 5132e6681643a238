"""The compiled bfloat16 GEMM over weights in pair order (``CpuKernels.gemm_bf16_pairs``,
``kernels/csrc/gemm_bf16_cpu.c``; the ``pairs-dot`` path of ``packed_linear``), on CPUs with
AVX-512 BF16.

The reference is float32 arithmetic on the same bfloat16 values, rounded to bfloat16 once: what
the kernel promises (its products are exact, its sums float32 in another order: within one
bfloat16 step, plus 1e-5 near zero). A row's result must not depend on the rows beside it: the
fused decode layers split rows between threads, and a request's tokens must not depend on its
batch.
"""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from kernels import cpu_ops
from kernels.cpu_ops import PairedWeight
from tests.kernels.test_linear_bf16 import assert_within_one_ulp, reference


@pytest.fixture(autouse=True)
def needs_bf16_dot(kernel: cpu_ops.CpuKernels) -> None:
    if not kernel.bf16_dot:
        pytest.skip("the pair-order GEMM needs AVX-512 BF16, which this CPU lacks")


@settings(max_examples=40, deadline=None)
@given(
    rows=st.one_of(st.integers(1, 20), st.integers(21, 300)),
    groups=st.integers(1, 70),  # 16 output features each: 1-3 groups per register block
    pairs=st.sampled_from([1, 8, 288, 768]),  # in_features 2, 16, 576, 1536
    bias=st.booleans(),
    seed=st.integers(0, 2**16),
)
def test_matches_float32_math_on_bfloat16_values(
    kernel: cpu_ops.CpuKernels, rows: int, groups: int, pairs: int, bias: bool, seed: int
) -> None:
    generator = torch.Generator().manual_seed(seed)
    out_features, in_features = 16 * groups, 2 * pairs
    x = torch.randn(rows, in_features, generator=generator).to(torch.bfloat16)
    weight = (torch.randn(out_features, in_features, generator=generator) * 0.05).bfloat16()
    b = torch.randn(out_features, generator=generator) if bias else None
    y = kernel.gemm_bf16_pairs(x, PairedWeight.of(weight), b)
    assert y is not None
    assert_within_one_ulp(y, reference(x, weight, b))
    for row in {0, rows // 2, rows - 1}:  # a row's result does not depend on the rows beside it
        alone = kernel.gemm_bf16_pairs(x[row : row + 1], PairedWeight.of(weight), b)
        assert torch.equal(alone, y[row : row + 1])


def test_linear_bf16_sends_a_paired_weight_here(kernel: cpu_ops.CpuKernels) -> None:
    x, weight = torch.randn(40, 64).bfloat16(), torch.randn(48, 64).bfloat16()
    paired = PairedWeight.of(weight)
    assert torch.equal(kernel.linear_bf16(x, paired, None), kernel.gemm_bf16_pairs(x, paired, None))


def test_reads_rows_with_a_stride(kernel: cpu_ops.CpuKernels) -> None:
    """x may be a column slice of a wider tensor (each row ``ldx`` elements apart)."""
    wide = torch.randn(9, 80).bfloat16()
    weight = torch.randn(32, 64).bfloat16()
    y = kernel.gemm_bf16_pairs(wide[:, :64], PairedWeight.of(weight), None)
    assert torch.equal(
        y, kernel.gemm_bf16_pairs(wide[:, :64].contiguous(), PairedWeight.of(weight), None)
    )


@pytest.mark.parametrize("out_features", [16, 48, 80])
def test_pair_order_round_trips(out_features: int) -> None:
    """Each group of 16 rows is stored as [in / 2][16][2]: the group's first 32 stored values
    are the first pair of inputs of each of its rows."""
    weight = torch.arange(out_features * 6, dtype=torch.float32).view(out_features, 6).bfloat16()
    paired = PairedWeight.of(weight)
    assert paired.data.shape == weight.shape and torch.equal(paired.unpaired(), weight)
    first = paired.data.reshape(-1)[:32].view(16, 2)
    assert torch.equal(first, weight[:16, :2])
    assert PairedWeight.takes(weight) and not PairedWeight.takes(weight[:8])


def test_pair_order_needs_whole_groups_and_pairs() -> None:
    with pytest.raises(ValueError, match="multiple of 16 and even"):
        PairedWeight.of(torch.zeros(24, 8))
    with pytest.raises(ValueError, match="multiple of 16 and even"):
        PairedWeight.of(torch.zeros(16, 7))


def test_declines_what_it_does_not_take(kernel: cpu_ops.CpuKernels) -> None:
    """None (the layer then casts or falls back) for what the kernel would misread."""
    weight = PairedWeight.of(torch.randn(32, 64))
    x = torch.randn(3, 64).bfloat16()
    assert kernel.gemm_bf16_pairs(x, weight, None) is not None
    assert kernel.gemm_bf16_pairs(x.float(), weight, None) is None  # float32 input
    assert kernel.gemm_bf16_pairs(x[:, :32], weight, None) is None  # 32 inputs for 64
    assert kernel.gemm_bf16_pairs(x[:0], weight, None) is None  # no rows
    assert kernel.gemm_bf16_pairs(x.t().contiguous().t(), weight, None) is None  # columns strided
    bias = torch.randn(32, 2)
    assert kernel.gemm_bf16_pairs(x, weight, bias[:, 0]) is None  # a strided bias
    assert kernel.gemm_bf16_pairs(x, weight, torch.randn(16)) is None  # a bias of 16 for 32
    assert kernel.gemm_bf16_pairs(x, weight, torch.randn(32).double()) is None
    strided = PairedWeight(torch.randn(64, 32).bfloat16().t())  # [32, 64], not contiguous
    assert kernel.gemm_bf16_pairs(x, strided, None) is None


def test_nan_and_rounding_to_nearest_even(kernel: cpu_ops.CpuKernels) -> None:
    weight = torch.zeros(16, 16, dtype=torch.bfloat16)
    weight[:, 0] = 1.0
    x = torch.zeros(1, 16, dtype=torch.bfloat16)
    # 1 + 2^-8 lies halfway between two bfloat16 values (1 and 1 + 2^-7): even is 1.
    bias = torch.zeros(16)
    bias[:3] = torch.tensor([1 + 2.0**-8, 1 + 3 * 2.0**-8, float("nan")])
    y = kernel.gemm_bf16_pairs(x, PairedWeight.of(weight), bias)
    assert y[0, 0].item() == 1.0 and y[0, 1].item() == 1 + 2.0**-6 and y[0, 2].isnan()
