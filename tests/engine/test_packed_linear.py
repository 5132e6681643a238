"""oneDNN-packed linear layers (``services.engine.model.packed_linear``) against ``nn.Linear``."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from kernels.cpu_ops import PairedWeight, TiledWeight
from services.engine.model.packed_linear import (
    PackedLinear,
    can_run,
    candidate_paths,
    onednn_rows,
    onednn_supports,
    pack_linears,
    weight_format,
)

pytestmark = pytest.mark.skipif(
    not torch.backends.mkldnn.is_available(), reason="this torch build has no oneDNN (mkldnn)"
)


@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("rows", [1, 3, 64])
def test_matches_nn_linear_in_float32(bias: bool, rows: int) -> None:
    torch.manual_seed(rows)
    linear = nn.Linear(576, 960, bias=bias)
    packed = PackedLinear(linear)
    x = torch.randn(rows, 576)
    with torch.inference_mode():
        torch.testing.assert_close(packed(x), linear(x), atol=1e-5, rtol=1e-5)


@pytest.mark.skipif(
    not onednn_supports(torch.bfloat16),
    reason="oneDNN's bf16 path needs AVX-512 BW/VL/DQ or AVX-NE-CONVERT, which this CPU lacks",
)
def test_bfloat16_strided_and_batched_inputs() -> None:
    torch.manual_seed(0)
    linear = nn.Linear(64, 32, bias=True).to(torch.bfloat16)
    packed = PackedLinear(linear)
    x = torch.randn(2, 5, 128, dtype=torch.bfloat16)[..., ::2]  # non-contiguous, 3-D
    with torch.inference_mode():
        out = packed(x)
        assert out.shape == (2, 5, 32) and out.dtype == torch.bfloat16
        torch.testing.assert_close(out.float(), linear(x).float(), atol=2e-2, rtol=2e-2)


def test_onednn_runs_a_bounded_set_of_row_counts_padding_at_most_a_sixteenth() -> None:
    """oneDNN builds a kernel per row count: the grid keeps a server's row counts (up to the
    8,192-token step of a large ``max_num_batched_tokens``) to about a hundred per shape, each
    padded by at most 7 rows or a sixteenth."""
    grid = [onednn_rows(rows) for rows in range(1, 8193)]
    assert grid[:16] == list(range(1, 17))  # decode batches of up to 16: exact
    rows = (17, 32, 33, 256, 257, 511, 512, 513, 2047, 2049)
    expected = (24, 32, 40, 256, 272, 512, 512, 544, 2048, 2176)
    assert tuple(onednn_rows(r) for r in rows) == expected
    assert all(rows <= padded <= rows + max(rows // 16, 7) for rows, padded in enumerate(grid, 1))
    assert all(onednn_rows(padded) == padded for padded in grid)
    assert len(set(grid[:2048])) == 94 and len(set(grid)) == 126


def test_pack_linears_replaces_every_linear_and_keeps_the_rest() -> None:
    model = nn.Sequential(nn.Embedding(10, 8), nn.Sequential(nn.Linear(8, 8), nn.ReLU()))
    model.append(nn.Linear(8, 4, bias=False))
    assert pack_linears(model) == 2
    assert isinstance(model[0], nn.Embedding)
    assert isinstance(model[1][0], PackedLinear) and isinstance(model[2], PackedLinear)
    assert pack_linears(model) == 0  # nothing left to pack


def test_which_paths_run_which_weights() -> None:
    assert can_run("native", torch.zeros(4, 4)) and can_run("mkl", torch.zeros(4, 4))
    bf16 = torch.zeros(4, 16, dtype=torch.bfloat16)
    assert can_run("native", bf16) == onednn_supports(torch.bfloat16)
    assert not can_run("native", torch.zeros(4, 4, dtype=torch.float16))
    assert can_run("float32", torch.zeros(4, 4, dtype=torch.float16))  # widened
    assert can_run("small-batch", bf16, has_small_batch=True)
    assert can_run("small-batch-4", bf16, has_small_batch=True)
    assert can_run("small-batch-dot", bf16, True) == torch.cpu._is_avx512_bf16_supported()
    assert not can_run("small-batch", bf16) and not can_run("small-batch", torch.zeros(4, 16), True)
    assert not can_run("mkl", torch.zeros(4))
    assert candidate_paths(torch.zeros(4, 16)) == ("native", "mkl")  # float32 is native here
    with pytest.raises(ValueError, match="GEMM path must be one of"):
        can_run("fast", bf16)


def test_forcing_native_keeps_plain_linear_where_onednn_cannot_run_it(monkeypatch) -> None:
    """A CPU without oneDNN's bf16 instructions keeps nn.Linear (CI once ran on such a VM) when
    told to compute natively, and native bf16 is no candidate where the CPU only emulates it."""
    import services.engine.model.packed_linear as packed_linear

    monkeypatch.setattr(packed_linear, "onednn_supports", lambda dtype: dtype == torch.float32)
    monkeypatch.setattr(packed_linear, "native_matmul", lambda dtype: dtype == torch.float32)
    model = nn.Sequential(nn.Linear(16, 8)).to(torch.bfloat16)
    assert pack_linears(model, "native") == 0 and isinstance(model[0], nn.Linear)
    assert candidate_paths(model[0].weight) == ("float32", "mkl")
    assert pack_linears(model, "float32") == 1 and model[0].paths[0] == "float32"


def reference(linear: nn.Linear, x: torch.Tensor) -> torch.Tensor:
    """float32 math on the layer's values."""
    bias = None if linear.bias is None else linear.bias.float()
    return torch.nn.functional.linear(x.float(), linear.weight.float(), bias)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("rows", [1, 3, 16, 100, 300])
def test_every_path_computes_the_same_layer(dtype: torch.dtype, rows: int) -> None:
    """Each path this CPU runs (the small-batch kernel: tests/kernels/test_linear_bf16.py) gives
    the float32 result on the same values, to the rounding of the output dtype."""
    torch.manual_seed(rows)
    linear = nn.Linear(96, 80, bias=True).to(dtype)
    x = torch.randn(rows, 96).to(dtype)
    expected = reference(linear, x)
    paths = [p for p in ("native", "float32", "mkl") if can_run(p, linear.weight)]
    assert "mkl" in paths and "float32" in paths
    tolerance = 1e-5 if dtype == torch.float32 else 2e-2
    with torch.inference_mode():
        for path in paths:
            out = PackedLinear(linear, path)(x)
            assert out.dtype == dtype and out.shape == (rows, 80)
            torch.testing.assert_close(out.float(), expected, atol=tolerance, rtol=tolerance)


def test_a_layer_runs_each_bucket_on_its_own_path() -> None:
    """A table of one path per bucket: the layer's rows pick the GEMM (counted by a kernel
    standing in for small-batch) and every bucket gives the same result."""
    linear = nn.Linear(32, 16).to(torch.bfloat16)
    calls: list[tuple[int, int]] = []

    def kernel(x, weight, bias):  # type: ignore[no-untyped-def]
        calls.append((len(x), weight.kernel_tile))
        return reference(linear, x).to(torch.bfloat16)

    paths = ("small-batch-4", "small-batch", "small-batch-dot", "mkl", "float32", "mkl")
    layer = PackedLinear(linear, paths, kernel)
    with torch.inference_mode():
        for rows in (1, 4, 5, 8, 9, 64, 65, 300):
            x = torch.randn(rows, 32).to(torch.bfloat16)
            torch.testing.assert_close(layer(x).float(), reference(linear, x), atol=2e-2, rtol=2e-2)
    # each small-batch path reads its own tiles: 4 rows, 8, 4 with dot products
    assert calls == [(1, 4), (4, 8), (5, -4), (8, -4)]
    for small in ("small-batch", "small-batch-4", "small-batch-dot"):
        with pytest.raises(ValueError, match=f"{small} serves"):
            PackedLinear(linear, small, kernel)
    with pytest.raises(ValueError, match="small-batch-4 serves 1-4 rows: not 5-8"):
        PackedLinear(linear, ("small-batch-4",) * 3 + ("mkl",) * 3, kernel)
    with pytest.raises(ValueError, match="small-batch-dot serves 2-16 rows: not 1"):
        PackedLinear(linear, ("small-batch-dot",) * 3 + ("mkl",) * 3, kernel)


def test_the_dot_products_read_the_four_row_tiles_copy() -> None:
    """small-batch-4 and small-batch-dot in one layer hold one tiled copy of the weight, and
    the chooser counts them as one format."""
    linear = nn.Linear(32, 16).to(torch.bfloat16)
    seen: list[TiledWeight] = []

    def kernel(x, weight, bias):  # type: ignore[no-untyped-def]
        seen.append(weight)
        return reference(linear, x).to(torch.bfloat16)

    paths = ("small-batch-4", "small-batch-dot", "small-batch-dot", "mkl", "mkl", "mkl")
    layer = PackedLinear(linear, paths, kernel)
    with torch.inference_mode():
        layer(torch.randn(1, 32).to(torch.bfloat16))
        layer(torch.randn(3, 32).to(torch.bfloat16))
    assert [w.dot for w in seen] == [False, True]
    assert seen[0].data.data_ptr() == seen[1].data.data_ptr()
    assert weight_format("small-batch-dot") == weight_format("small-batch-4") == "small-batch-4"


def test_the_pair_order_serves_every_row_count_and_is_the_fallback() -> None:
    """pairs-dot above the small-batch rows: its own copy of the weight (pair order), and where
    the small-batch kernel declines an input the pair order (never declining) computes it. The
    fused decode layers read both kernels' weights."""
    linear = nn.Linear(32, 16).to(torch.bfloat16)
    seen: list[tuple[int, str]] = []

    def kernel(x, weight, bias):  # type: ignore[no-untyped-def]
        seen.append((len(x), type(weight).__name__))
        if isinstance(weight, TiledWeight) and len(x) == 2:
            return None  # declined: the fallback runs
        return reference(linear, x).to(torch.bfloat16)

    paths = ("small-batch-4", "small-batch-4") + ("pairs-dot",) * 4
    layer = PackedLinear(linear, paths, kernel)
    with torch.inference_mode():
        for rows in (1, 2, 5, 64, 300):
            x = torch.randn(rows, 32).to(torch.bfloat16)
            torch.testing.assert_close(layer(x).float(), reference(linear, x), atol=2e-2, rtol=2e-2)
    assert seen == [
        (1, "TiledWeight"),
        (2, "TiledWeight"),
        (2, "PairedWeight"),
        (5, "PairedWeight"),
        (64, "PairedWeight"),
        (300, "PairedWeight"),
    ]
    assert isinstance(layer.fusable_gemm(1).weight, TiledWeight)
    assert isinstance(layer.fusable_gemm(300).weight, PairedWeight)
    assert layer.fusable_gemm(0) is None
    assert weight_format("pairs-dot") == "pairs-dot"
    bf16 = torch.zeros(32, 16, dtype=torch.bfloat16)
    assert can_run("pairs-dot", bf16, True) == torch.cpu._is_avx512_bf16_supported()
    assert not can_run("pairs-dot", bf16) and not can_run("pairs-dot", bf16[:24], True)
    assert not can_run("pairs-dot", torch.zeros(32, 16), True)  # float32 weights
