"""The compiled prefill attention (``kernels/csrc/prefill_attention_cpu.c``), each of its paths
(VDPBF16PS; AMX tiles where the CPU and Linux give them), against the float32 reference on the
same bfloat16 values, over drawn batches: sequences with and without a cached prefix (contexts
long enough to cross several of the AMX path's 256-key spans), GQA groups, head sizes, block
sizes and block tables anywhere in the pool.

Its arithmetic differs from float32 math by the softmax weights' rounding to bfloat16 (as
PyTorch's CPU flash attention rounds them for a bfloat16 query) and the output's: the bound is
PyTorch's own bfloat16 SDPA's error on the same inputs, with a margin.
"""

from __future__ import annotations

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kernels import cpu_ops, reference
from kernels.prefill_attention import PATHS, SDPA


@pytest.fixture(scope="module")
def compiled(kernel: cpu_ops.CpuKernels) -> cpu_ops.CpuKernels:
    if not kernel.prefill.available:
        pytest.skip("the compiled prefill attention needs AVX-512 BF16, which this CPU lacks")
    return kernel


def batch(
    data: st.DataObject, head_dim: int, num_kv_heads: int, group: int, block_size: int
) -> tuple[torch.Tensor, ...]:
    """Query, caches, tables, query starts and context lengths of a drawn batch."""
    queries = data.draw(st.lists(st.integers(1, 70), min_size=1, max_size=3), label="queries")
    prefixes = data.draw(
        st.lists(st.integers(0, 700), min_size=len(queries), max_size=len(queries)),
        label="prefixes",
    )
    lens = [q + p for q, p in zip(queries, prefixes)]
    max_blocks = max(-(-n // block_size) for n in lens)
    num_blocks = len(lens) * max_blocks + data.draw(st.integers(0, 8), label="spare blocks")
    seed = data.draw(st.integers(0, 2**31 - 1), label="seed")
    gen = torch.Generator().manual_seed(seed)
    shape = (num_blocks, block_size, num_kv_heads, head_dim)
    key_cache = torch.randn(shape, generator=gen).to(torch.bfloat16)
    value_cache = torch.randn(shape, generator=gen).to(torch.bfloat16)
    order = torch.randperm(num_blocks, generator=gen)[: len(lens) * max_blocks]
    tables = order.view(len(lens), max_blocks).to(torch.int32)
    query = torch.randn(sum(queries), num_kv_heads * group, head_dim, generator=gen)
    starts = torch.tensor([0, *torch.tensor(queries).cumsum(0).tolist()], dtype=torch.int32)
    return (
        query.to(torch.bfloat16),
        key_cache,
        value_cache,
        tables,
        starts,
        torch.tensor(lens, dtype=torch.int32),
    )


@pytest.mark.parametrize("path", PATHS)
@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    data=st.data(),
    head_dim=st.sampled_from([32, 64, 96, 128]),
    num_kv_heads=st.integers(1, 3),
    group=st.integers(1, 4),
    block_size=st.sampled_from([8, 16]),
)
def test_matches_float32_attention_as_closely_as_pytorch_does(
    compiled: cpu_ops.CpuKernels,
    path: str,
    data: st.DataObject,
    head_dim: int,
    num_kv_heads: int,
    group: int,
    block_size: int,
) -> None:
    if path not in compiled.prefill.paths:
        pytest.skip(f"this CPU (or Linux, or the compiler) gives no {path} path")
    args = batch(data, head_dim, num_kv_heads, group, block_size)
    query, key_cache, value_cache, *rest = args
    scale = head_dim**-0.5
    exact = reference.paged_attention_prefill(
        query.float(), key_cache.float(), value_cache.float(), *rest, scale
    )
    pytorch = reference.paged_attention_prefill(*args, scale).float()
    ours = compiled.prefill(*args, scale, path=path)
    assert ours is not None and ours.dtype == torch.bfloat16 and ours.shape == query.shape
    error, pytorch_error = (ours.float() - exact).abs(), (pytorch - exact).abs()
    assert error.max() <= 2 * pytorch_error.max() + 2e-3
    assert error.mean() <= 1.5 * pytorch_error.mean() + 1e-4
    # The backend's entry point runs what was measured fastest for this shape (default: SDPA).
    chosen = compiled.prefill.use(query, key_cache)
    expected = pytorch.to(torch.bfloat16) if chosen is None else compiled.prefill(*args, scale)
    assert torch.equal(compiled.paged_attention_prefill(*args, scale), expected)


def test_the_fastest_is_measured_and_then_used(compiled: cpu_ops.CpuKernels) -> None:
    """Before ``measure`` the backend keeps SDPA; after it, the fastest of SDPA and the compiled
    paths for that shape and thread count; other shapes are not affected."""
    prefill = compiled.prefill
    query = torch.randn(3, 4, 64).bfloat16()
    cache = torch.randn(1, 16, 2, 64).bfloat16()
    args = (torch.tensor([[0]]), torch.tensor([0, 3]), torch.tensor([3]), 0.125)
    fresh = type(prefill)(compiled.lib)  # a new decision table: nothing measured yet
    assert fresh.use(query, cache) is None
    seconds = fresh.measure(4, 2, 64)
    assert set(seconds) == {SDPA, *fresh.paths}
    assert all(0 < s < float("inf") for s in seconds.values())
    fastest = min(seconds, key=seconds.__getitem__)
    assert fresh.use(query, cache) == (None if fastest == SDPA else fastest)
    assert fresh.use(torch.randn(3, 8, 64).bfloat16(), cache) is None  # another shape
    assert fresh.measure(4, 2, 48) == {}  # one it does not take
    compiled.prefill, before = fresh, prefill
    try:
        if fastest == SDPA:
            expected = reference.paged_attention_prefill(query, cache, cache, *args)
        else:
            expected = fresh(query, cache, cache, *args, path=fastest)
        assert torch.equal(compiled.paged_attention_prefill(query, cache, cache, *args), expected)
    finally:
        compiled.prefill = before


def test_a_path_this_build_lacks_is_refused(compiled: cpu_ops.CpuKernels) -> None:
    query = torch.randn(4, 2, 64).to(torch.bfloat16)
    cache = torch.randn(1, 16, 2, 64).to(torch.bfloat16)
    args = (torch.tensor([[0]]), torch.tensor([0, 4]), torch.tensor([4]), 0.125)
    with pytest.raises(ValueError, match="prefill attention path 'tpu'"):
        compiled.prefill(query, cache, cache, *args, path="tpu")


def test_declines_what_it_does_not_take(compiled: cpu_ops.CpuKernels) -> None:
    """None for float32, a head size not a multiple of 32, or mixed dtypes; the backend then
    computes the reference's attention exactly."""
    query = torch.randn(4, 2, 64)
    cache = torch.randn(2, 16, 2, 64)
    tables = torch.tensor([[0]], dtype=torch.int32)
    starts, lens = torch.tensor([0, 4]), torch.tensor([4])
    args = (query, cache, cache, tables, starts, lens, 0.125)
    assert compiled.prefill(*args) is None
    assert torch.equal(
        compiled.paged_attention_prefill(*args), reference.paged_attention_prefill(*args)
    )
    half = cache[..., :48].to(torch.bfloat16)
    assert compiled.prefill(query[..., :48].to(torch.bfloat16), half, half, *args[3:]) is None
    bf16 = cache.to(torch.bfloat16)
    assert compiled.prefill(query, bf16, bf16, *args[3:]) is None  # a float32 query


def test_refuses_bad_tables_and_lengths_before_reading(compiled: cpu_ops.CpuKernels) -> None:
    query = torch.randn(4, 2, 64).to(torch.bfloat16)
    cache = torch.randn(2, 16, 2, 64).to(torch.bfloat16)
    starts = torch.tensor([0, 4])
    with pytest.raises(IndexError, match="outside the KV cache"):
        compiled.prefill(query, cache, cache, torch.tensor([[2]]), starts, torch.tensor([4]), 0.1)
    with pytest.raises(ValueError, match="shorter than its query"):
        compiled.prefill(query, cache, cache, torch.tensor([[0]]), starts, torch.tensor([3]), 0.1)


def test_the_amx_path_is_offered_exactly_where_the_cpu_has_amx(
    compiled: cpu_ops.CpuKernels,
) -> None:
    """With ``-march=native`` the build has AMX where the CPU's flags name it (and Linux grants
    tiles to a process that asks); without, asking for it answers 'not built', never a crash."""
    flags = set(cpu_ops.cpu_signature().split())
    assert ("amx" in compiled.prefill.paths) == ({"amx_bf16", "amx_tile"} <= flags)
