"""Sampling's compiled exponential race (``CpuKernels.race_rows``) against PyTorch's
(``reference.race_rows``): the same noise bits, so the same token per row (their logarithms may
differ in the last bit, which could move a token only at a near-tie: none in these draws);
greedy rows (scale 0) take argmax_rows' index; and the draws follow the distribution."""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from common.sampling_params import SamplingParams
from kernels import cpu_ops, reference
from services.engine.sampler import Sampler
from services.engine.sequence import Sequence

DTYPES = [torch.float32, torch.bfloat16]


def keys_of(gen: torch.Generator, rows: int) -> torch.Tensor:
    return torch.randint(-(2**63), 2**63 - 1, (rows,), generator=gen)


@settings(
    max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(
    seed=st.integers(0, 2**31 - 1),
    rows=st.integers(1, 9),
    vocab=st.integers(1, 300),
    dtype=st.sampled_from(DTYPES),
    spread=st.sampled_from([0.1, 3.0, 30.0]),
)
def test_race_rows_draws_the_references_token(
    kernel: cpu_ops.CpuKernels, seed: int, rows: int, vocab: int, dtype: torch.dtype, spread
) -> None:
    """Any vocabulary size (the last partial vector too), flat to peaked rows, -inf entries,
    greedy rows among sampled ones, with and without floors."""
    gen = torch.Generator().manual_seed(seed)
    x = (torch.randn(rows, vocab, generator=gen) * spread).to(dtype)
    x[torch.rand(rows, vocab, generator=gen) < 0.2] = float("-inf")
    scale = torch.rand(rows, generator=gen) * 2 + 0.05
    scale[torch.rand(rows, generator=gen) < 0.3] = 0.0
    keys = keys_of(gen, rows)
    assert torch.equal(kernel.race_rows(x, scale, keys), reference.race_rows(x, scale, keys))
    # Floors at one of each row's own logits (or none): the compiled race skips whole vectors
    # below them.
    picked = x.float().gather(1, torch.randint(vocab, (rows, 1), generator=gen))[:, 0]
    floors = torch.where(torch.rand(rows, generator=gen) < 0.7, picked, float("-inf"))
    assert torch.equal(
        kernel.race_rows(x, scale, keys, floors), reference.race_rows(x, scale, keys, floors)
    )


@pytest.mark.parametrize("dtype", DTYPES)
def test_race_rows_of_a_decode_batch_on_several_threads(
    kernel: cpu_ops.CpuKernels, dtype: torch.dtype
) -> None:
    """96 rows of a 49,152-token vocabulary: the threaded path, the size it is used at."""
    gen = torch.Generator().manual_seed(3)
    x = (torch.randn(96, 49_152, generator=gen) * 3).to(dtype)
    scale, keys = torch.rand(96, generator=gen) + 0.5, keys_of(gen, 96)
    scale[::7] = 0.0
    tokens = kernel.race_rows(x, scale, keys)
    assert torch.equal(tokens, reference.race_rows(x, scale, keys))
    assert torch.equal(tokens[::7], reference.argmax_rows(x[::7]))


def test_race_rows_of_an_all_minus_inf_row_and_a_nan(kernel: cpu_ops.CpuKernels) -> None:
    x = torch.full((2, 40), float("-inf"))
    x[1, 5], x[1, 9] = float("nan"), 2.0
    keys = torch.tensor([1, 2])
    assert kernel.race_rows(x, torch.ones(2), keys).tolist() == [0, 9]
    assert reference.race_rows(x, torch.ones(2), keys).tolist() == [0, 9]


def test_race_rows_follows_the_distribution(kernel: cpu_ops.CpuKernels) -> None:
    """200,000 draws of one row, each with its own key (consecutive keys: the hash must mix
    them): every token's frequency within 5 standard errors of its probability at scale 1 and
    at scale 2 (a temperature of 0.5)."""
    row = torch.tensor([1.0, 2.0, 0.5, -1.0, 3.0, float("-inf"), 2.5])
    draws = 200_000
    for scale in (1.0, 2.0):
        probs = torch.softmax(row * scale, dim=0)
        x = row.repeat(draws, 1).contiguous()
        tokens = kernel.race_rows(x, torch.full((draws,), scale), torch.arange(draws))
        freq = torch.bincount(tokens, minlength=row.numel()).double() / draws
        for f, p in zip(freq.tolist(), probs.tolist()):
            assert abs(f - p) <= 5 * math.sqrt(p * (1 - p) / draws) + 1e-12, (scale, f, p)


def test_race_rows_gives_other_layouts_and_dtypes_to_the_reference(
    kernel: cpu_ops.CpuKernels,
) -> None:
    gen = torch.Generator().manual_seed(5)
    x = torch.randn(8, 100, generator=gen)
    scale, keys = torch.ones(8), keys_of(gen, 8)
    for other in (x.t().contiguous().t(), x.half(), x.double()):
        assert torch.equal(
            kernel.race_rows(other, scale, keys), reference.race_rows(other, scale, keys)
        )


def test_a_seeded_row_draws_the_same_on_every_path_of_the_sampler(
    kernel: cpu_ops.CpuKernels,
) -> None:
    """A seeded row with a temperature only: raced alone on its bfloat16 logits (the plain
    path), beside a row that asks for logprobs (the float32 path), and with the reference race:
    the same token each time. Top-p rows the same, alone and beside a penalised row."""
    gen = torch.Generator().manual_seed(11)
    logits = (torch.randn(200, 3000, generator=gen) * 2).bfloat16()
    other = SamplingParams(temperature=1.0, logprobs=2)
    compiled = Sampler(argmax=kernel.argmax_rows, race=kernel.race_rows)
    for params in (
        [SamplingParams(temperature=0.7, seed=s) for s in range(100)],
        [SamplingParams(temperature=1.3, top_p=0.8, seed=s) for s in range(100)],
    ):
        alone, beside, by_reference = [], [], []
        for i, p in enumerate(params):
            seq = Sequence(i, "r", [1], p)
            row = logits[i : i + 1]
            alone += compiled(row, [seq]).token_ids
            pair = torch.cat([row, logits[i + 100 : i + 101]])
            beside += compiled(pair, [seq, Sequence(999, "o", [1], other)]).token_ids[:1]
            by_reference += Sampler()(row, [seq]).token_ids
        assert alone == beside == by_reference
        assert len(set(alone)) > 50, "sampled, not greedy"


@settings(
    max_examples=80, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(
    filters=st.lists(
        st.tuples(
            st.sampled_from([0.01, 0.3, 1.0, 4.0]),  # logit spread: flat to peaked
            st.one_of(st.just(0), st.integers(1, 40), st.integers(900, 2500)),  # top_k
            st.one_of(st.just(1.0), st.floats(0.05, 0.999)),  # top_p
            st.one_of(st.just(0.0), st.floats(0.0001, 0.5)),  # min_p
            st.sampled_from([0.5, 1.0, 2.0]),  # scale: 1 / temperature
        ),
        min_size=1,
        max_size=6,
    ),
    vocab=st.sampled_from([7, 100, 3000]),
    dtype=st.sampled_from(DTYPES),
    seed=st.integers(0, 2**31 - 1),
)
def test_filter_floors_are_the_references_without_a_sort(
    kernel: cpu_ops.CpuKernels, filters, vocab: int, dtype: torch.dtype, seed: int
) -> None:
    """The same floor per row as the sort, for peaked and flat rows, bfloat16 ties, -inf and
    NaN entries, top_k past the vocabulary, rows without filters (floor -inf) among them."""
    gen = torch.Generator().manual_seed(seed)
    spread = torch.tensor([f[0] for f in filters])[:, None]
    x = (torch.randn(len(filters), vocab, generator=gen) * spread * 10).to(dtype)
    x[torch.rand(x.shape, generator=gen) < 0.05] = float("-inf")
    x[torch.rand(x.shape, generator=gen) < 0.01] = float("nan")
    args = [torch.tensor([f[i] for f in filters]) for i in (4, 1, 2, 3)]
    assert torch.equal(kernel.filter_floors(x, *args), reference.filter_floors(x, *args))


def test_filter_floors_of_rows_of_minus_inf_and_without_filters(kernel: cpu_ops.CpuKernels):
    x = torch.full((3, 50), float("-inf"))
    x[1:, :3] = torch.tensor([2.0, 1.0, 0.0])
    args = [torch.ones(3), torch.tensor([1, 0, 0]), torch.ones(3), torch.zeros(3)]
    args[1][1] = 1
    expected = torch.tensor([float("-inf"), 2.0, float("-inf")])
    assert torch.equal(kernel.filter_floors(x, *args), expected)
    assert torch.equal(reference.filter_floors(x, *args), expected)


def test_the_race_draws_only_what_the_floors_keep(kernel: cpu_ops.CpuKernels) -> None:
    """Top-p 0.75 over (0.45, 0.25, 0.15, 0.1, 0.05): 2,000 draws of tokens 0-2 only, each of
    them drawn; the reference race the same tokens."""
    probs = torch.tensor([0.45, 0.25, 0.15, 0.1, 0.05])
    rows = 2000
    x = probs.log().repeat(rows, 1).contiguous()
    scale, keys = torch.ones(rows), torch.arange(rows)
    floors = kernel.filter_floors(x, scale, torch.zeros(rows), torch.full((rows,), 0.75), scale * 0)
    tokens = kernel.race_rows(x, scale, keys, floors)
    assert set(tokens.tolist()) == {0, 1, 2}
    assert torch.equal(tokens, reference.race_rows(x, scale, keys, floors))
