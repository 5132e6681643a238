"""Greedy sampling's compiled argmax (``CpuKernels.argmax_rows``) against PyTorch's
(``reference.argmax_rows``): the same index for every row, ties (the first maximum), NaN (the
first NaN) and -inf included, in float32 and bfloat16, on one thread and on several."""

from __future__ import annotations

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kernels import cpu_ops, reference

DTYPES = [torch.float32, torch.bfloat16]


def logits_of(seed: int, rows: int, vocab: int, dtype: torch.dtype, values: str) -> torch.Tensor:
    """Rows drawn so that ties are common (few distinct values) or rare, with some NaN and
    all--inf rows mixed in."""
    gen = torch.Generator().manual_seed(seed)
    if values == "few":  # many ties for the maximum
        x = torch.randint(-3, 3, (rows, vocab), generator=gen).to(dtype)
    else:
        x = torch.randn(rows, vocab, generator=gen).to(dtype)
    for row in range(rows):
        kind = int(torch.randint(6, (), generator=gen))
        if kind == 0:
            x[row, torch.randint(vocab, (2,), generator=gen)] = float("nan")
        elif kind == 1:
            x[row] = float("-inf")
        elif kind == 2:
            x[row, torch.randint(vocab, (), generator=gen)] = float("inf")
    return x


@settings(
    max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(
    seed=st.integers(0, 2**31 - 1),
    rows=st.integers(1, 9),
    vocab=st.integers(1, 200),
    dtype=st.sampled_from(DTYPES),
    values=st.sampled_from(["few", "many"]),
)
def test_argmax_rows_gives_torchs_index(
    kernel: cpu_ops.CpuKernels, seed: int, rows: int, vocab: int, dtype: torch.dtype, values: str
) -> None:
    x = logits_of(seed, rows, vocab, dtype, values)
    assert torch.equal(kernel.argmax_rows(x), reference.argmax_rows(x))


@pytest.mark.parametrize("dtype", DTYPES)
def test_argmax_rows_of_a_decode_batch_on_several_threads(
    kernel: cpu_ops.CpuKernels, dtype: torch.dtype
) -> None:
    """64 rows of a 49,152-token vocabulary: the threaded path, the size it is used at."""
    x = logits_of(7, 64, 49_152, dtype, "few")
    assert torch.equal(kernel.argmax_rows(x), reference.argmax_rows(x))


def test_argmax_rows_gives_other_layouts_and_dtypes_to_the_reference(
    kernel: cpu_ops.CpuKernels,
) -> None:
    x = torch.randn(8, 100)
    for other in (x.t(), x.half(), x.double(), x[0]):
        assert torch.equal(kernel.argmax_rows(other), reference.argmax_rows(other))
