"""The compiled passes around the int8 GEMM (``CpuKernels.quantize_rows_int8``,
``dequantize_int32``) against the PyTorch reference: the same float32 operations in the same
order, so the same bits, in float32 and bfloat16."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from kernels import cpu_ops, reference
from services.engine.model.int8_linear import Int8Linear

DTYPES = [torch.float32, torch.bfloat16]


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("rows", [1, 3, 64])  # 64 x 960 takes the multithreaded path
def test_quantize_rows_is_bit_identical_to_the_reference(
    kernel: cpu_ops.CpuKernels, dtype: torch.dtype, rows: int
) -> None:
    torch.manual_seed(rows)
    x = (torch.randn(rows, 960) * torch.logspace(-3, 2, rows)[:, None]).to(dtype)
    x[-1, :] = 0  # a row of zeros: scale 0, all q 0
    q, scales = kernel.quantize_rows_int8(x)
    want_q, want_scales = reference.quantize_rows_int8(x)
    assert q.dtype == torch.int8 and scales.dtype == torch.float32
    assert torch.equal(q, want_q) and torch.equal(scales, want_scales)
    assert scales[-1] == 0 and not q[-1].any()
    assert (q[:-1].abs().amax(dim=1) == 127).all()  # each row's largest value is +-127
    assert q.min() >= -127  # symmetric: -128 never appears


def test_quantize_rows_rounds_halves_to_even(kernel: cpu_ops.CpuKernels) -> None:
    """127 / 127 scales by 1: x.5 lands on a half and goes to the even neighbour."""
    x = torch.tensor([[127.0, 0.5, 1.5, 2.5, -0.5, -1.5, 126.5] + [0.0] * 9])
    q, scales = kernel.quantize_rows_int8(x)
    assert scales.tolist() == [1.0]
    assert q[0, :7].tolist() == [127, 0, 2, 2, 0, -2, 126]
    assert torch.equal(q, reference.quantize_rows_int8(x)[0])


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("with_bias", [False, True])
@pytest.mark.parametrize("rows", [1, 64])
def test_dequantize_is_bit_identical_to_the_reference(
    kernel: cpu_ops.CpuKernels, dtype: torch.dtype, with_bias: bool, rows: int
) -> None:
    torch.manual_seed(rows)
    products = torch.randint(-(2**24), 2**24, (rows, 2560), dtype=torch.int32)
    row_scales, col_scales = torch.rand(rows) / 100, torch.rand(2560) / 100
    bias = torch.randn(2560) if with_bias else None
    got = kernel.dequantize_int32(products, row_scales, col_scales, bias, dtype)
    want = reference.dequantize_int32(products, row_scales, col_scales, bias, dtype)
    assert got.dtype == dtype and torch.equal(got, want)


def test_inputs_the_kernels_do_not_take_go_to_the_reference(kernel: cpu_ops.CpuKernels) -> None:
    """A row length or column count not a multiple of 16, float16, mismatched scales: the
    reference's own result (or its error), never a read past the end."""
    x = torch.randn(2, 40)
    assert all(
        torch.equal(a, b)
        for a, b in zip(kernel.quantize_rows_int8(x), reference.quantize_rows_int8(x))
    )
    products = torch.randint(-100, 100, (2, 40), dtype=torch.int32)
    rows, cols = torch.rand(2), torch.rand(40)
    assert torch.equal(
        kernel.dequantize_int32(products, rows, cols, None, torch.float16),
        reference.dequantize_int32(products, rows, cols, None, torch.float16),
    )
    with pytest.raises(RuntimeError):  # 32 columns, 40 scales: the reference's shape error
        kernel.dequantize_int32(products[:, :32].contiguous(), rows, cols, None, torch.float32)


def test_keeps_the_input_dtype_and_leading_shape(kernel: cpu_ops.CpuKernels) -> None:
    """bfloat16 activations in [batch, tokens, in] (the compiled passes): bfloat16 out, same
    leading shape, the same values as the reference passes."""
    torch.manual_seed(0)
    linear = nn.Linear(64, 32, bias=True).to(torch.bfloat16)
    x = torch.randn(2, 3, 64, dtype=torch.bfloat16)
    with torch.inference_mode():
        compiled, plain = Int8Linear(linear, kernel)(x), Int8Linear(linear)(x)
    assert compiled.dtype == torch.bfloat16 and compiled.shape == (2, 3, 32)
    assert torch.equal(compiled, plain)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("rows", [1, 2, 3, 4, 5])  # 5: past the kernel, the three-call path
def test_the_small_batch_kernel_is_bit_identical_to_the_three_call_path(
    kernel: cpu_ops.CpuKernels, dtype: torch.dtype, bias: bool, rows: int
) -> None:
    """1-4 rows in one VNNI call (quantize, dot products offset by 128, the offset taken off,
    scales and bias) against quantize + torch._int_mm + dequantize; 972 outputs: a tail after
    the last tile of 8."""
    if not kernel.int8_vnni:
        pytest.skip("this CPU has no AVX512-VNNI: the small-batch int8 kernel is not built")
    torch.manual_seed(rows)
    linear = nn.Linear(576, 972, bias=bias).to(dtype)
    fused, plain = Int8Linear(linear, kernel), Int8Linear(linear)
    assert fused.small_batch is not None and plain.small_batch is None
    x = (torch.randn(rows, 576) * 3).to(dtype)
    with torch.inference_mode():
        assert torch.equal(fused(x), plain(x))


def test_the_small_batch_kernel_declines_what_it_does_not_take(
    kernel: cpu_ops.CpuKernels,
) -> None:
    """An input size not a multiple of 64 gets no kernel; a strided x or float16 is declined
    per call (the layer then takes the three-call path)."""
    assert Int8Linear(nn.Linear(80, 16), kernel).small_batch is None
    layer = Int8Linear(nn.Linear(128, 16), kernel)
    if layer.small_batch is None:
        pytest.skip("this CPU has no AVX512-VNNI: the small-batch int8 kernel is not built")
    strided = torch.randn(2, 256)[:, ::2]
    assert layer.small_batch(strided) is None
    assert layer.small_batch(torch.randn(2, 128, dtype=torch.float16)) is None
    assert layer.small_batch(torch.randn(0, 128)) is None
    assert torch.equal(layer(strided), layer(strided.contiguous()))  # the three-call path
