"""Triton kernels (``kernels.triton_ops``) against the PyTorch reference (``kernels.reference``).

Without a GPU the kernels run under the Triton interpreter (``TRITON_INTERPRET=1``, which must be
set before triton is imported); shapes stay tiny so the interpreter is fast.
"""

from __future__ import annotations

import os

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

pytest.importorskip("triton", reason="triton is not installed (pip install -e '.[gpu]')")

import kernels  # noqa: E402
from kernels import reference, triton_ops  # noqa: E402

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
BLOCK_SIZE = 16
NUM_LAYERS = 2
LAYER = 1
TOLERANCE = {torch.float32: 1e-4, torch.float16: 5e-3, torch.bfloat16: 2e-2}
DTYPES = [torch.float32, torch.float16, torch.bfloat16]
# (num_heads, num_kv_heads, head_dim): GQA with a power-of-two and a non-power-of-two group.
HEAD_SHAPES = [(4, 2, 16), (6, 2, 32)]


def make_kv(num_blocks: int, kv_heads: int, head_dim: int, dtype: torch.dtype) -> torch.Tensor:
    """Random KV storage in the engine layout ``[nb, layers, 2, block_size, kvh, hd]``."""
    shape = (num_blocks, NUM_LAYERS, 2, BLOCK_SIZE, kv_heads, head_dim)
    return torch.randn(shape, device=DEVICE).to(dtype)


def layer_caches(kv: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """One layer's strided (non-contiguous) key and value cache views."""
    key_cache, value_cache = kv[:, LAYER, 0], kv[:, LAYER, 1]
    assert not key_cache.is_contiguous()
    return key_cache, value_cache


def make_block_tables(context_lens: list[int], num_blocks: int) -> torch.Tensor:
    """Disjoint shuffled blocks per sequence, padded with a valid (foreign) block id."""
    needed = [-(-n // BLOCK_SIZE) for n in context_lens]
    perm = torch.randperm(num_blocks).tolist()
    assert sum(needed) < num_blocks
    width, rows, used = max(needed) + 1, [], 0
    for n in needed:
        rows.append(perm[used : used + n] + [perm[-1]] * (width - n))
        used += n
    return torch.tensor(rows, dtype=torch.int32, device=DEVICE)


def assert_close(actual: torch.Tensor, expected: torch.Tensor, dtype: torch.dtype) -> None:
    assert actual.dtype == expected.dtype == dtype
    assert actual.shape == expected.shape
    assert torch.isfinite(actual).all()
    tol = TOLERANCE[dtype]
    torch.testing.assert_close(actual.float(), expected.float(), atol=tol, rtol=tol)


# --------------------------------------------------------------------------------------------
# write_kv
# --------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "key_dtype, cache_dtype",
    [
        (torch.float32, torch.float32),
        (torch.bfloat16, torch.bfloat16),
        (torch.float32, torch.float16),  # the store casts (rounded like torch, also interpreted)
    ],
)
def test_write_kv_matches_reference_on_strided_cache(
    key_dtype: torch.dtype, cache_dtype: torch.dtype
) -> None:
    torch.manual_seed(0)
    num_blocks, kv_heads, head_dim, num_tokens = 6, 2, 16, 21
    kv = make_kv(num_blocks, kv_heads, head_dim, cache_dtype)
    expected = kv.clone()
    slots = torch.randperm(num_blocks * BLOCK_SIZE, device=DEVICE)[:num_tokens]
    key = torch.randn(num_tokens, kv_heads, head_dim, device=DEVICE).to(key_dtype)
    value = torch.randn(num_tokens, kv_heads, head_dim, device=DEVICE).to(key_dtype)

    triton_ops.write_kv(key, value, *layer_caches(kv), slots)
    reference.write_kv(key, value, *layer_caches(expected), slots)

    # The whole storage matches: right slots written, other layers and K/V halves untouched.
    assert torch.equal(kv, expected)
    blocks, offsets = slots // BLOCK_SIZE, slots % BLOCK_SIZE
    assert torch.equal(kv[blocks, LAYER, 0, offsets], key.to(cache_dtype))
    assert torch.equal(kv[blocks, LAYER, 1, offsets], value.to(cache_dtype))


def test_write_kv_casts_float32_to_bfloat16() -> None:
    torch.manual_seed(0)
    kv = make_kv(3, 2, 16, torch.bfloat16)
    before, expected = kv.clone(), kv.clone()
    slots = torch.tensor([0, 17, 40, 47], device=DEVICE)
    key, value = torch.randn(2, 4, 2, 16, device=DEVICE)
    triton_ops.write_kv(key, value, *layer_caches(kv), slots)
    reference.write_kv(key, value, *layer_caches(expected), slots)
    # The interpreter truncates fp32 -> bf16 where the GPU (and torch) round to nearest even:
    # allow one bf16 ulp there, demand bit equality on a GPU.
    tol = 0.0 if DEVICE == "cuda" else 2.0**-7
    torch.testing.assert_close(kv.float(), expected.float(), atol=0.0, rtol=tol)
    assert (kv != before).sum() > 0.9 * 2 * key.numel()  # it wrote (nearly every value changed)


def test_write_kv_skips_negative_slots() -> None:
    kv = make_kv(2, 1, 16, torch.float32)
    expected = kv.clone()
    key = torch.ones(2, 1, 16, device=DEVICE)
    triton_ops.write_kv(key, 2 * key, *layer_caches(kv), torch.tensor([-1, 3], device=DEVICE))
    expected[0, LAYER, 0, 3], expected[0, LAYER, 1, 3] = 1.0, 2.0
    assert torch.equal(kv, expected)


def test_rotary_write_kv_uses_the_triton_write() -> None:
    """The layer glue is the reference's PyTorch ops on the GPU; rotary's KV write is Triton's."""
    torch.manual_seed(0)
    num_heads, num_kv_heads, head_dim, num_tokens = 4, 2, 16, 5
    kv = make_kv(3, num_kv_heads, head_dim, torch.float32)
    expected = kv.clone()
    qkv = torch.randn(num_tokens, (num_heads + 2 * num_kv_heads) * head_dim, device=DEVICE)
    angles = torch.rand(num_tokens, 1, head_dim, device=DEVICE)
    rotary = (angles.cos(), angles.sin())
    slots = torch.tensor([0, 5, 17, 33, 40], device=DEVICE)
    args = (qkv, rotary)
    query = kernels.rotary_write_kv(
        *args, *layer_caches(kv), slots, num_heads, num_kv_heads, backend="triton"
    )
    want = reference.rotary_write_kv(*args, *layer_caches(expected), slots, num_heads, num_kv_heads)
    assert torch.equal(query, want)
    assert torch.equal(kv, expected)


# --------------------------------------------------------------------------------------------
# Decode
# --------------------------------------------------------------------------------------------


def decode_inputs(
    context_lens: list[int], heads: tuple[int, int, int], dtype: torch.dtype
) -> tuple[torch.Tensor, ...]:
    num_heads, kv_heads, head_dim = heads
    num_blocks = sum(-(-n // BLOCK_SIZE) for n in context_lens) + 2
    kv = make_kv(num_blocks, kv_heads, head_dim, dtype)
    query = torch.randn(len(context_lens), num_heads, head_dim, device=DEVICE).to(dtype)
    tables = make_block_tables(context_lens, num_blocks)
    lens = torch.tensor(context_lens, dtype=torch.int32, device=DEVICE)
    return (query, *layer_caches(kv), tables, lens)


@pytest.mark.parametrize("heads", HEAD_SHAPES)
@pytest.mark.parametrize("dtype", DTYPES)
def test_decode_matches_reference(dtype: torch.dtype, heads: tuple[int, int, int]) -> None:
    torch.manual_seed(1)
    # 1 token, exactly one block, ragged lengths, and a context spanning several key tiles.
    inputs = decode_inputs([1, 16, 37, 5, 70], heads, dtype)
    scale = heads[2] ** -0.5
    actual = triton_ops.paged_attention_decode(*inputs, scale)
    assert_close(actual, reference.paged_attention_decode(*inputs, scale), dtype)


def test_decode_max_context_len_and_strided_query() -> None:
    torch.manual_seed(2)
    query, *rest = decode_inputs([9, 40, 23], (4, 2, 16), torch.float32)
    wide = torch.randn(query.shape[0], query.shape[1], 3 * query.shape[2], device=DEVICE)
    wide[..., 16:32] = query
    query = wide[..., 16:32]  # a slice of a fused QKV projection: non-contiguous
    for max_len in (40, 64, 17):  # exact, padded, and a cap below some context lengths
        actual = triton_ops.paged_attention_decode(query, *rest, 0.3, max_len)
        expected = reference.paged_attention_decode(query, *rest, 0.3, max_len)
        assert_close(actual, expected, torch.float32)


@pytest.mark.parametrize("partitions", [2, 3, 7])
def test_decode_split_into_partitions_matches_reference(partitions: int) -> None:
    """Flash-decoding: partitions of the context run apart and are merged; a sequence shorter
    than one partition leaves the others empty (max -inf, sum 0), which must weigh nothing."""
    torch.manual_seed(4)
    inputs = decode_inputs([1, 130, 37, 200, 16], (6, 2, 32), torch.float32)
    actual = triton_ops.paged_attention_decode(*inputs, 0.2, 200, partitions=partitions)
    assert_close(actual, reference.paged_attention_decode(*inputs, 0.2, 200), torch.float32)
    capped = triton_ops.paged_attention_decode(*inputs, 0.2, 100, partitions=partitions)
    assert_close(capped, reference.paged_attention_decode(*inputs, 0.2, 100), torch.float32)


def test_decode_partitions_need_max_context_len() -> None:
    inputs = decode_inputs([5, 9], (4, 2, 16), torch.float32)
    with pytest.raises(ValueError, match="partitions needs max_context_len"):
        triton_ops.paged_attention_decode(*inputs, 0.25, partitions=2)


def test_decode_through_dispatcher() -> None:
    torch.manual_seed(3)
    inputs = decode_inputs([3, 33, 18], (4, 2, 32), torch.bfloat16)
    actual = kernels.paged_attention_decode(*inputs, 0.125, backend="triton")
    expected = kernels.paged_attention_decode(*inputs, 0.125, backend="reference")
    assert_close(actual, expected, torch.bfloat16)


# --------------------------------------------------------------------------------------------
# Prefill
# --------------------------------------------------------------------------------------------

# (q_len, context_len) per sequence: full prompts, length 1, cached prefixes (q_len < context),
# a chunk spanning two 64-query tiles, and lengths that are not multiples of the block size.
PREFILL_SEQS = [(5, 5), (1, 1), (7, 40), (20, 20), (67, 83), (1, 18)]


def prefill_inputs(
    seqs: list[tuple[int, int]], heads: tuple[int, int, int], dtype: torch.dtype
) -> tuple[torch.Tensor, ...]:
    num_heads, kv_heads, head_dim = heads
    context_lens = [ctx for _, ctx in seqs]
    num_blocks = sum(-(-n // BLOCK_SIZE) for n in context_lens) + 2
    kv = make_kv(num_blocks, kv_heads, head_dim, dtype)
    q_lens = torch.tensor([0] + [q for q, _ in seqs])
    query_start_loc = torch.cumsum(q_lens, 0).to(torch.int32).to(DEVICE)
    query = torch.randn(int(q_lens.sum()), num_heads, head_dim, device=DEVICE).to(dtype)
    tables = make_block_tables(context_lens, num_blocks)
    lens = torch.tensor(context_lens, dtype=torch.int32, device=DEVICE)
    return (query, *layer_caches(kv), tables, query_start_loc, lens)


@pytest.mark.parametrize("heads", HEAD_SHAPES)
@pytest.mark.parametrize("dtype", DTYPES)
def test_prefill_matches_reference(dtype: torch.dtype, heads: tuple[int, int, int]) -> None:
    torch.manual_seed(4)
    inputs = prefill_inputs(PREFILL_SEQS, heads, dtype)
    scale = heads[2] ** -0.5
    actual = triton_ops.paged_attention_prefill(*inputs, scale)
    assert_close(actual, reference.paged_attention_prefill(*inputs, scale), dtype)


def test_prefill_is_causal_and_agrees_with_decode() -> None:
    """A chunk's last query sees the same context as decode; earlier queries see less."""
    torch.manual_seed(5)
    query, key_cache, value_cache, tables, starts, lens = prefill_inputs(
        [(6, 30), (4, 4)], (4, 2, 16), torch.float32
    )
    out = kernels.paged_attention_prefill(
        query, key_cache, value_cache, tables, starts, lens, 0.25, backend="triton"
    )
    last = (starts[1:] - 1).long()
    decode = triton_ops.paged_attention_decode(
        query[last], key_cache, value_cache, tables, lens, 0.25
    )
    assert_close(out[last], decode, torch.float32)
    # Query 0 of sequence 0 sits at position 24: it must not see keys 25..29.
    first = triton_ops.paged_attention_decode(
        query[:1], key_cache, value_cache, tables[:1], lens[:1] - 5, 0.25
    )
    assert_close(out[:1], first, torch.float32)
    assert not torch.allclose(out[0], out[5], atol=1e-3)
