"""The compiled layer glue (``CpuKernels.add_rms_norm``, ``rotary_write_kv``, ``silu_mul``)
against the PyTorch reference (``kernels.reference``), in float32 and bfloat16.

Rotary and the KV write round where PyTorch rounds, so they must match bit for bit. RMSNorm sums
its squares in another order and SiLU uses its own exp: they may differ in the last bit of a
float32, which in bfloat16 can move a value that lies near a rounding boundary by one unit.
"""

from __future__ import annotations

import pytest
import torch

from kernels import cpu_ops, reference
from tests.kernels.test_cpu_ops import BLOCK_SIZE, engine_layer_caches

DTYPES = [torch.float32, torch.bfloat16]


def ulps(a: torch.Tensor, b: torch.Tensor) -> int:
    """The largest distance between ``a`` and ``b`` in units of their dtype's last place."""
    assert a.dtype == b.dtype and a.shape == b.shape
    bits = torch.int16 if a.dtype == torch.bfloat16 else torch.int32
    return int((a.view(bits).int() - b.view(bits).int()).abs().max()) if a.numel() else 0


def close_to_reference(got: torch.Tensor, want: torch.Tensor) -> None:
    """float32: within a few units in the last place (a sum of 576 squares in another order);
    bfloat16: within one, and equal for almost every element."""
    if got.dtype == torch.float32:
        assert ulps(got, want) <= 8
    else:
        assert ulps(got, want) <= 1
        assert (got != want).float().mean() < 0.02


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("rows", [1, 3, 256])  # 256 x 576 takes the multithreaded path
@pytest.mark.parametrize("with_delta", [True, False])
def test_add_rms_norm_matches_the_reference(
    kernel: cpu_ops.CpuKernels, dtype: torch.dtype, rows: int, with_delta: bool
) -> None:
    x = (torch.randn(rows, 576) * 3).to(dtype)
    delta = torch.randn(rows, 576).to(dtype) if with_delta else None
    weight = torch.rand(576).to(dtype) + 0.5
    x_ref = x.clone()
    want = reference.add_rms_norm(x_ref, delta, weight, 1e-5)
    got = kernel.add_rms_norm(x, delta, weight, 1e-5)
    assert torch.equal(x, x_ref)  # the residual add is exact: one rounding, as PyTorch's
    close_to_reference(got, want)


def test_bfloat16_rounding_of_edge_values_is_pytorchs(kernel: cpu_ops.CpuKernels) -> None:
    """The residual add rounds each sum to bfloat16 as PyTorch does, on every CPU: ties go to
    even, denormal sums stay denormal (the CPU's own bf16 conversion, where the kernels use it,
    reads them as zero: a vector holding one must take the exact path), infinities stay, NaN
    stays NaN. Row 0 mixes denormals into a vector of normal values; row 1 has none."""
    tiny = 2.0**-130  # a float32 denormal, and a bfloat16 one
    edges = [tiny, -tiny, 3 * tiny, 2.0**-126, 1.0, 1.0 + 2.0**-7, 65504.0, 3e38]
    edges += [float("inf"), float("-inf"), float("nan"), 0.0, -0.0, 1e-20, -7.5, 0.1]
    deltas = [tiny, tiny, -tiny, -(2.0**-127), 2.0**-8, 2.0**-8, 2.0**4, 3e38]
    deltas += [1.0, -1.0, 1.0, tiny, -0.0, 1e-20, 2.0**-6, 0.2]
    row = torch.tensor(edges * 36).reshape(1, 576)
    delta_row = torch.tensor(deltas * 36).reshape(1, 576)
    x = torch.cat([row, row.clamp(-10, 10).nan_to_num() + 1.0]).bfloat16()
    delta = torch.cat([delta_row, delta_row.clamp(-10, 10) * 3]).bfloat16()
    weight = torch.ones(576, dtype=torch.bfloat16)
    x_ref = x.clone()
    reference.add_rms_norm(x_ref, delta, weight, 1e-5)
    kernel.add_rms_norm(x, delta, weight, 1e-5)
    assert torch.equal(x.isnan(), x_ref.isnan())
    assert torch.equal(x.view(torch.int16)[~x.isnan()], x_ref.view(torch.int16)[~x_ref.isnan()])
    assert (x_ref[0, :4].float().abs() < 2.0**-126).all()  # the denormal sums were exercised


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("num_tokens", [1, 5, 200])  # 200 tokens take the multithreaded path
@pytest.mark.parametrize("heads", [(9, 3, 64), (8, 2, 128), (4, 4, 32)])
def test_rotary_write_kv_is_bit_identical_to_the_reference(
    kernel: cpu_ops.CpuKernels, dtype: torch.dtype, num_tokens: int, heads: tuple[int, int, int]
) -> None:
    num_heads, num_kv_heads, head_dim = heads
    num_blocks = -(-num_tokens // BLOCK_SIZE) * 2 + 1
    qkv = torch.randn(num_tokens, (num_heads + 2 * num_kv_heads) * head_dim).to(dtype)
    positions = torch.randint(0, 4096, (num_tokens,))
    angles = positions[:, None].float() * torch.rand(head_dim // 2).repeat(2)[None]
    rotary = (angles.cos()[:, None].to(dtype), angles.sin()[:, None].to(dtype))
    slots = torch.randperm(num_blocks * BLOCK_SIZE)[:num_tokens]
    key_cache, value_cache = engine_layer_caches(num_blocks, num_kv_heads, head_dim, dtype)
    key_ref, value_ref = key_cache.clone(), value_cache.clone()
    want = reference.rotary_write_kv(
        qkv, rotary, key_ref, value_ref, slots, num_heads, num_kv_heads
    )
    got = kernel.rotary_write_kv(
        qkv, rotary, key_cache, value_cache, slots, num_heads, num_kv_heads
    )
    assert torch.equal(got, want)
    assert torch.equal(key_cache, key_ref)  # the other slots are untouched too
    assert torch.equal(value_cache, value_ref)


@pytest.mark.parametrize("slots", [[0, 64], [-1, 3], [1, 2, 3]])
def test_rotary_write_kv_refuses_slots_outside_the_cache(
    kernel: cpu_ops.CpuKernels, slots: list[int]
) -> None:
    key_cache, value_cache = engine_layer_caches(4, 3, 64)  # 4 blocks of 16: slots 0..63
    rotary = (torch.ones(2, 1, 64), torch.zeros(2, 1, 64))
    with pytest.raises(ValueError, match="slot"):
        kernel.rotary_write_kv(
            torch.randn(2, 15 * 64), rotary, key_cache, value_cache, torch.tensor(slots), 9, 3
        )


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("rows", [1, 4, 64])  # 64 x 1536 takes the multithreaded path
def test_silu_mul_matches_the_reference(
    kernel: cpu_ops.CpuKernels, dtype: torch.dtype, rows: int
) -> None:
    gate_up = (torch.randn(rows, 2 * 1536) * 4).to(dtype)
    close_to_reference(kernel.silu_mul(gate_up), reference.silu_mul(gate_up))


@pytest.mark.parametrize("dtype", DTYPES)
def test_silu_mul_at_the_edges_of_exp(kernel: cpu_ops.CpuKernels, dtype: torch.dtype) -> None:
    """Inputs whose exp under- or overflows, zeros, infinities and NaN: PyTorch's results (-0.0
    for -3e38: its exp overflows to inf; NaN for -inf)."""
    edges = [-3e38, -1e4, -100.0, -88.0, -20.0, -0.0, 0.0, 1e-30, 20.0, 88.0, 100.0, 1e4, 3e38]
    edges += [float("-inf"), float("inf"), float("nan")]
    gate = torch.tensor(edges + [0.0] * (32 - len(edges))).to(dtype)
    gate_up = torch.cat([gate, torch.full_like(gate, 1.5)])[None]
    got, want = kernel.silu_mul(gate_up), reference.silu_mul(gate_up)
    assert torch.equal(got.isnan(), want.isnan()) and torch.equal(got.isinf(), want.isinf())
    assert torch.allclose(got.float(), want.float(), rtol=1e-6, atol=1e-30, equal_nan=True)


def test_unsupported_inputs_take_the_reference(kernel: cpu_ops.CpuKernels) -> None:
    """float16, a size not a multiple of 16, or a strided input: the reference's own result."""
    x16 = torch.randn(2, 64, dtype=torch.float16)
    weight16 = torch.ones(64, dtype=torch.float16)
    want = reference.add_rms_norm(x16.clone(), None, weight16, 1e-6)
    assert torch.equal(kernel.add_rms_norm(x16, None, weight16, 1e-6), want)
    odd = torch.randn(3, 2 * 40)
    assert torch.equal(kernel.silu_mul(odd), reference.silu_mul(odd))
    strided = torch.randn(64, 8).t()  # [8, 64], not contiguous
    ones = torch.ones(64)
    want = reference.add_rms_norm(strided.clone(), None, ones, 1e-6)
    assert torch.equal(kernel.add_rms_norm(strided, None, ones, 1e-6), want)


def test_rotary_write_kv_takes_only_caches_of_the_layer_it_is_told(
    kernel: cpu_ops.CpuKernels,
) -> None:
    """Caches whose heads, head size or blocks disagree with the call go to the reference (which
    refuses them); nothing is written past the views the kernel was given."""
    qkv, slots = torch.randn(1, (2 + 2 * 2) * 32), torch.tensor([63])
    rotary = (torch.randn(1, 1, 32), torch.randn(1, 1, 32))
    keys, values = torch.zeros(5, BLOCK_SIZE, 1, 32), torch.zeros(5, BLOCK_SIZE, 2, 32)
    cases = {
        "one kv head, told two": (keys[:4], torch.zeros(4, BLOCK_SIZE, 1, 32)),
        "fewer value blocks": (torch.zeros(8, BLOCK_SIZE, 2, 32), values[:2]),
    }
    for key_cache, value_cache in cases.values():
        with pytest.raises((RuntimeError, IndexError)):
            reference.rotary_write_kv(qkv, rotary, key_cache, value_cache, slots, 2, 2)
        with pytest.raises((RuntimeError, IndexError)):
            kernel.rotary_write_kv(qkv, rotary, key_cache, value_cache, slots, 2, 2)
    assert not keys[4].any() and not values[2:].any(), "written outside a cache view"
    wide = (torch.randn(1, 1, 64), torch.randn(1, 1, 64))  # head size 64, caches of 32
    two_heads = torch.zeros(5, BLOCK_SIZE, 2, 32)
    cache = two_heads[:4]
    with pytest.raises(RuntimeError):
        kernel.rotary_write_kv(torch.randn(1, 6 * 64), wide, cache, cache.clone(), slots, 2, 2)
    assert not two_heads[4].any()


def test_a_zero_size_last_dimension_gives_the_reference_result(kernel: cpu_ops.CpuKernels) -> None:
    assert kernel.silu_mul(torch.randn(3, 0)).shape == (3, 0)
    x, weight = torch.randn(3, 0), torch.randn(0)
    assert kernel.add_rms_norm(x, None, weight, 1e-5).shape == (3, 0)
