"""The PyTorch reference prefill attention (``kernels.reference.paged_attention_prefill``), which
serves every float32 prefill on CPU and bfloat16 wherever the compiled kernel measured slower:
over drawn batches of sequences of very different lengths (so that they are split into several
padded calls), it equals attention computed one sequence at a time in float64, and its length
groups never pad more than ``PADDING_WASTE`` allows.
"""

from __future__ import annotations

import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kernels import reference


def one_at_a_time(
    query: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    tables: torch.Tensor,
    starts: torch.Tensor,
    lens: torch.Tensor,
    scale: float,
) -> torch.Tensor:
    """Each sequence's queries over its own keys, by the definition, in float64."""
    block_size, num_kv_heads = key_cache.shape[1], key_cache.shape[2]
    group = query.shape[1] // num_kv_heads
    out = torch.empty(query.shape, dtype=torch.float64)
    for s in range(lens.shape[0]):
        first, last, length = int(starts[s]), int(starts[s + 1]), int(lens[s])
        slots = [
            int(tables[s, t // block_size]) * block_size + t % block_size for t in range(length)
        ]
        keys = key_cache.flatten(0, 1)[slots].double().repeat_interleave(group, dim=1)
        values = value_cache.flatten(0, 1)[slots].double().repeat_interleave(group, dim=1)
        q = query[first:last].double()  # [q, H, D], the last q of the sequence's positions
        scores = torch.einsum("qhd,khd->hqk", q, keys) * scale
        positions = torch.arange(length - (last - first), length)
        scores.masked_fill_(torch.arange(length)[None, :] > positions[:, None], float("-inf"))
        out[first:last] = torch.einsum("hqk,khd->qhd", scores.softmax(-1), values)
    return out


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    data=st.data(),
    num_kv_heads=st.integers(1, 3),
    group=st.integers(1, 3),
    block_size=st.sampled_from([4, 16]),
)
def test_mixed_lengths_equal_attention_one_sequence_at_a_time(
    data: st.DataObject, num_kv_heads: int, group: int, block_size: int
) -> None:
    # Lengths from 1 to 200: a long one beside short ones is split off into its own call.
    queries = data.draw(st.lists(st.integers(1, 200), min_size=1, max_size=8), label="queries")
    prefixes = data.draw(
        st.lists(st.sampled_from([0, 0, 1, 17, 90]), min_size=len(queries), max_size=len(queries)),
        label="prefixes",
    )
    lens = [q + p for q, p in zip(queries, prefixes)]
    max_blocks = max(-(-n // block_size) for n in lens)
    num_blocks = len(lens) * max_blocks + 3
    gen = torch.Generator().manual_seed(data.draw(st.integers(0, 2**31 - 1), label="seed"))
    head_dim = 32
    shape = (num_blocks, block_size, num_kv_heads, head_dim)
    key_cache, value_cache = torch.randn(shape, generator=gen), torch.randn(shape, generator=gen)
    order = torch.randperm(num_blocks, generator=gen)[: len(lens) * max_blocks]
    tables = order.view(len(lens), max_blocks).to(torch.int32)
    query = torch.randn(sum(queries), num_kv_heads * group, head_dim, generator=gen)
    starts = torch.tensor([0, *torch.tensor(queries).cumsum(0).tolist()], dtype=torch.int32)
    args = (query, key_cache, value_cache, tables, starts, torch.tensor(lens), head_dim**-0.5)

    got = reference.paged_attention_prefill(*args)

    assert got.dtype == torch.float32 and got.shape == query.shape
    torch.testing.assert_close(got.double(), one_at_a_time(*args), rtol=1e-4, atol=1e-5)


@given(
    st.lists(
        st.tuples(st.integers(1, 2048), st.integers(0, 2048)).map(lambda qp: (qp[0], sum(qp))),
        min_size=1,
        max_size=64,
    )
)
def test_length_groups_cover_every_sequence_once_within_the_padding_bound(
    lengths: list[tuple[int, int]],
) -> None:
    q_lens, context_lens = [q for q, _ in lengths], [c for _, c in lengths]
    groups = reference.length_groups(q_lens, context_lens)
    assert sorted(s for group in groups for s in group) == list(range(len(lengths)))
    for group in groups:
        padded = max(q_lens[s] for s in group) * max(context_lens[s] for s in group)
        smallest = min(q_lens[s] * context_lens[s] for s in group)
        assert len(group) == 1 or padded <= reference.PADDING_WASTE * smallest, group


def test_prompts_of_one_length_share_one_call() -> None:
    """The online burst's case (many fresh prompts of one length): one group, no padding."""
    assert reference.length_groups([256] * 8, [256] * 8) == [list(range(8))]
    assert reference.length_groups([1024, 100, 120, 90], [1024, 100, 120, 90]) == [[0], [2, 1, 3]]
