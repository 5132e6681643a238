"""The compiled CPU decode attention (``kernels.cpu_ops``) against the PyTorch reference.

The kernel is built with the machine's C compiler on first use; these tests fail (not skip) if
it cannot be built where a compiler exists, since the CPU path would then silently be slower.
"""

from __future__ import annotations

import logging
import shutil
from pathlib import Path

import pytest
import torch

import kernels
from kernels import cpu_ops, reference

BLOCK_SIZE = 16
NUM_LAYERS = 3
LAYER = 1
# (num_heads, num_kv_heads, head_dim): the default model's GQA group of 3, MHA, a group of 4.
HEAD_SHAPES = [(9, 3, 64), (4, 4, 32), (8, 2, 128)]

needs_compiler = pytest.mark.skipif(
    cpu_ops._compiler() is None, reason="no C compiler (cc/gcc/clang) on PATH to build the kernel"
)


def engine_layer_caches(
    num_blocks: int, kv_heads: int, head_dim: int, dtype: torch.dtype = torch.float32
) -> tuple[torch.Tensor, torch.Tensor]:
    """One layer's key/value views exactly as ``ModelRunner`` makes them (heads-major blocks)."""
    kv = torch.randn(num_blocks, NUM_LAYERS, 2, kv_heads, BLOCK_SIZE, head_dim).to(dtype)
    return kv[:, LAYER, 0].transpose(1, 2), kv[:, LAYER, 1].transpose(1, 2)


def shuffled_block_tables(context_lens: list[int], num_blocks: int) -> torch.Tensor:
    """Disjoint random blocks per sequence, padded with a valid foreign block id."""
    needed = [-(-n // BLOCK_SIZE) for n in context_lens]
    perm = torch.randperm(num_blocks).tolist()
    width, rows, used = max(needed) + 1, [], 0
    for n in needed:
        rows.append(perm[used : used + n] + [perm[-1]] * (width - n))
        used += n
    return torch.tensor(rows, dtype=torch.int32)


@needs_compiler
def test_kernel_builds_and_cpu_tensors_dispatch_to_it() -> None:
    assert cpu_ops.load() is not None
    assert kernels._backend(torch.zeros(1), None) is cpu_ops


@needs_compiler
@pytest.mark.parametrize("num_heads, num_kv_heads, head_dim", HEAD_SHAPES)
@pytest.mark.parametrize("context_lens", [[1], [16, 17, 5, 40], [1, 130, 64, 33, 2, 97]])
def test_decode_matches_reference(
    num_heads: int, num_kv_heads: int, head_dim: int, context_lens: list[int]
) -> None:
    torch.manual_seed(len(context_lens) * head_dim)
    key_cache, value_cache = engine_layer_caches(48, num_kv_heads, head_dim)
    tables = shuffled_block_tables(context_lens, 48)
    lens = torch.tensor(context_lens, dtype=torch.int32)
    query = torch.randn(len(context_lens), num_heads, head_dim)
    scale = head_dim**-0.5
    assert cpu_ops.supports(query, key_cache, value_cache)
    expected = reference.paged_attention_decode(query, key_cache, value_cache, tables, lens, scale)
    actual = cpu_ops.paged_attention_decode(query, key_cache, value_cache, tables, lens, scale)
    assert actual.shape == expected.shape and actual.dtype == torch.float32
    torch.testing.assert_close(actual, expected, atol=1e-5, rtol=1e-5)


@needs_compiler
def test_decode_caps_context_at_max_context_len() -> None:
    torch.manual_seed(1)
    key_cache, value_cache = engine_layer_caches(16, 3, 64)
    tables = shuffled_block_tables([40, 20], 16)
    lens = torch.tensor([40, 20], dtype=torch.int32)
    query = torch.randn(2, 9, 64)
    args = (query, key_cache, value_cache, tables, lens, 0.1, 24)
    expected = reference.paged_attention_decode(*args)
    actual = cpu_ops.paged_attention_decode(*args)
    torch.testing.assert_close(actual, expected, atol=1e-5, rtol=1e-5)
    uncapped = cpu_ops.paged_attention_decode(query, key_cache, value_cache, tables, lens, 0.1)
    assert not torch.allclose(actual[0], uncapped[0])  # the cap really cut sequence 0
    torch.testing.assert_close(actual[1], uncapped[1])


@needs_compiler
def test_token_major_layout_matches_reference() -> None:
    """A cache laid out ``[block, token, head, dim]`` (other strides) works too."""
    torch.manual_seed(2)
    kv = torch.randn(20, NUM_LAYERS, 2, BLOCK_SIZE, 2, 32)
    key_cache, value_cache = kv[:, LAYER, 0], kv[:, LAYER, 1]
    tables = shuffled_block_tables([33, 7], 20)
    lens = torch.tensor([33, 7], dtype=torch.int32)
    query = torch.randn(2, 4, 32)
    expected = reference.paged_attention_decode(query, key_cache, value_cache, tables, lens, 0.2)
    actual = cpu_ops.paged_attention_decode(query, key_cache, value_cache, tables, lens, 0.2)
    torch.testing.assert_close(actual, expected, atol=1e-5, rtol=1e-5)


def test_other_dtypes_and_head_dims_take_the_reference() -> None:
    torch.manual_seed(3)
    key_cache, value_cache = engine_layer_caches(8, 2, 16, torch.bfloat16)
    query = torch.randn(1, 4, 16, dtype=torch.bfloat16)
    assert not cpu_ops.supports(query, key_cache, value_cache)
    tables, lens = shuffled_block_tables([20], 8), torch.tensor([20], dtype=torch.int32)
    expected = reference.paged_attention_decode(query, key_cache, value_cache, tables, lens, 0.3)
    actual = cpu_ops.paged_attention_decode(query, key_cache, value_cache, tables, lens, 0.3)
    assert torch.equal(actual, expected)
    odd_dim = engine_layer_caches(8, 2, 24)
    assert not cpu_ops.supports(torch.randn(1, 4, 24), *odd_dim)  # not a multiple of 16 lanes


@needs_compiler
def test_bad_block_tables_raise_instead_of_reading_out_of_bounds() -> None:
    key_cache, value_cache = engine_layer_caches(8, 3, 64)
    query = torch.randn(1, 9, 64)
    lens = torch.tensor([40], dtype=torch.int32)
    with pytest.raises(ValueError, match="fewer blocks than the context lengths need"):
        cpu_ops.paged_attention_decode(
            query, key_cache, value_cache, torch.tensor([[0, 1]], dtype=torch.int32), lens, 0.1
        )
    with pytest.raises(ValueError, match=r"block id outside \[0, 8\)"):
        cpu_ops.paged_attention_decode(
            query, key_cache, value_cache, torch.tensor([[0, 1, 8]], dtype=torch.int32), lens, 0.1
        )


@needs_compiler
def test_kernel_shares_torchs_openmp_runtime() -> None:
    """One libgomp in the process: the kernel runs on torch's threads, not a second pool."""
    maps = Path("/proc/self/maps")
    if not maps.exists():
        pytest.skip("no /proc/self/maps on this platform to list loaded libraries")
    assert cpu_ops.load() is not None
    paths = {line.split()[-1] for line in maps.read_text().splitlines() if "libgomp" in line}
    assert len(paths) == 1, paths


@pytest.fixture
def fresh_load(monkeypatch: pytest.MonkeyPatch, tmp_path: Path):
    """``cpu_ops.load`` with an empty cache directory, its memo cleared before and after."""
    monkeypatch.setenv("PDSERVE_CACHE_DIR", str(tmp_path))
    cpu_ops.load.cache_clear()
    yield cpu_ops.load
    cpu_ops.load.cache_clear()


def test_disabled_by_environment(fresh_load, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("PDSERVE_CPU_KERNELS", "0")
    assert fresh_load() is None


def test_failed_build_falls_back_with_a_warning(
    fresh_load, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    false = shutil.which("false")
    if false is None:
        pytest.skip("no `false` command to stand in for a broken compiler")
    monkeypatch.setenv("CC", false)
    with caplog.at_level(logging.WARNING, logger="kernels.cpu_ops"):
        assert fresh_load() is None
    assert "CPU attention kernel not built" in caplog.text


@needs_compiler
def test_build_is_cached_per_source_and_cpu(fresh_load, tmp_path: Path) -> None:
    assert fresh_load() is not None
    built = list((tmp_path / "kernels").glob("paged_attention_cpu-*.so"))
    assert len(built) == 1
    stamp = built[0].stat().st_mtime_ns
    assert cpu_ops.build(cpu_ops._compiler() or "cc", tmp_path / "kernels") == built[0]
    assert built[0].stat().st_mtime_ns == stamp  # not rebuilt
