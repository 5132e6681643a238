"""The compiled CPU decode attention (``kernels.cpu_ops``) against the PyTorch reference.

The kernel is built with the machine's C compiler on first use; these tests fail (not skip) if
it cannot be built where a compiler exists, since the CPU path would then silently be slower.
They build it in temporary directories, passed as arguments (``EngineConfig.cache_dir`` for the
engine), never in the user's cache.
"""

from __future__ import annotations

import argparse
import logging
import shutil
from pathlib import Path

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import kernels
from common.sampling_params import SamplingParams
from common.settings import add_settings, build
from kernels import cpu_ops, reference
from services.engine.config import EngineConfig
from services.engine.model.llama import LlamaModel
from services.engine.model_runner import ModelRunner, attention_backend
from services.engine.scheduler import ScheduledBatch
from services.engine.sequence import Sequence
from tests.conftest import tiny_model_config
from tests.kernels.conftest import seed_cache

BLOCK_SIZE = 16
NUM_LAYERS = 3
LAYER = 1
# (num_heads, num_kv_heads, head_dim): the default model's GQA group of 3, MHA, a group of 4.
HEAD_SHAPES = [(9, 3, 64), (4, 4, 32), (8, 2, 128)]

needs_compiler = pytest.mark.skipif(
    cpu_ops.find_compiler() is None,
    reason="no C compiler (cc/gcc/clang) on PATH to build the kernel",
)


def engine_layer_caches(
    num_blocks: int, kv_heads: int, head_dim: int, dtype: torch.dtype = torch.float32
) -> tuple[torch.Tensor, torch.Tensor]:
    """One layer's key/value views exactly as ``ModelRunner`` makes them (heads-major blocks)."""
    kv = torch.randn(num_blocks, NUM_LAYERS, 2, kv_heads, BLOCK_SIZE, head_dim).to(dtype)
    return kv[:, LAYER, 0].transpose(1, 2), kv[:, LAYER, 1].transpose(1, 2)


def shuffled_block_tables(
    context_lens: list[int], num_blocks: int, block_size: int = BLOCK_SIZE
) -> torch.Tensor:
    """Disjoint random blocks per sequence, padded with a valid foreign block id."""
    needed = [-(-n // block_size) for n in context_lens]
    perm = torch.randperm(num_blocks).tolist()
    width, rows, used = max(needed) + 1, [], 0
    for n in needed:
        rows.append(perm[used : used + n] + [perm[-1]] * (width - n))
        used += n
    return torch.tensor(rows, dtype=torch.int32)


def test_kernel_builds_and_is_passed_as_the_backend(kernel: cpu_ops.CpuKernels) -> None:
    assert kernel.path.exists()
    assert kernels._backend(torch.zeros(1), kernel) is kernel
    assert kernels._backend(torch.zeros(1), None) is reference  # CPU, none given: the reference
    with pytest.raises(ValueError, match="unknown kernel backend 'cpu'"):
        kernels._backend(torch.zeros(1), "cpu")  # the compiled path needs its loaded library


@pytest.mark.parametrize("num_heads, num_kv_heads, head_dim", HEAD_SHAPES)
@pytest.mark.parametrize("context_lens", [[1], [16, 17, 5, 40], [1, 130, 64, 33, 2, 97]])
def test_decode_matches_reference(
    kernel: cpu_ops.CpuKernels,
    num_heads: int,
    num_kv_heads: int,
    head_dim: int,
    context_lens: list[int],
) -> None:
    torch.manual_seed(len(context_lens) * head_dim)
    key_cache, value_cache = engine_layer_caches(48, num_kv_heads, head_dim)
    tables = shuffled_block_tables(context_lens, 48)
    lens = torch.tensor(context_lens, dtype=torch.int32)
    query = torch.randn(len(context_lens), num_heads, head_dim)
    scale = head_dim**-0.5
    assert cpu_ops.supports(query, key_cache, value_cache)
    expected = reference.paged_attention_decode(query, key_cache, value_cache, tables, lens, scale)
    actual = kernels.paged_attention_decode(
        query, key_cache, value_cache, tables, lens, scale, backend=kernel
    )
    assert actual.shape == expected.shape and actual.dtype == torch.float32
    torch.testing.assert_close(actual, expected, atol=1e-5, rtol=1e-5)


@settings(
    max_examples=40, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(
    seed=st.integers(0, 2**31 - 1),
    group=st.sampled_from([1, 2, 3, 4, 5, 8]),  # 1-4: outputs in registers; more: 16 rows at a time
    num_kv_heads=st.integers(1, 3),
    head_dim=st.sampled_from([32, 64, 96]),
    block_size=st.sampled_from([1, 8, 16, 24, 32]),  # blocks that do not split into 16 rows too
    context_lens=st.lists(st.integers(1, 150), min_size=1, max_size=5),
    dtype=st.sampled_from([torch.float32, torch.bfloat16]),
)
def test_decode_matches_reference_for_any_block_size_group_and_length(
    kernel: cpu_ops.CpuKernels,
    seed: int,
    group: int,
    num_kv_heads: int,
    head_dim: int,
    block_size: int,
    context_lens: list[int],
    dtype: torch.dtype,
) -> None:
    """Score rows are padded to whole vectors and the softmax's division comes after the values'
    sum: any block size, GQA group and context length gives the reference's attention."""
    torch.manual_seed(seed)
    num_blocks = sum(-(-n // block_size) for n in context_lens) + 1
    kv = torch.randn(num_blocks, 2, num_kv_heads, block_size, head_dim).to(dtype)
    key_cache, value_cache = kv[:, 0].transpose(1, 2), kv[:, 1].transpose(1, 2)
    tables = shuffled_block_tables(context_lens, num_blocks, block_size)
    lens = torch.tensor(context_lens, dtype=torch.int32)
    query = torch.randn(len(context_lens), group * num_kv_heads, head_dim).to(dtype)
    args = (query, key_cache, value_cache, tables, lens, head_dim**-0.5)
    actual = kernel.paged_attention_decode(*args)
    expected = reference.paged_attention_decode(
        *(a.float() if a.is_floating_point() else a for a in args[:5]), args[5]
    )
    tolerance = 1e-5 if dtype == torch.float32 else 1e-2  # bfloat16: the output rounded once
    torch.testing.assert_close(actual.float(), expected, atol=tolerance, rtol=tolerance)


def test_decode_caps_context_at_max_context_len(kernel: cpu_ops.CpuKernels) -> None:
    torch.manual_seed(1)
    key_cache, value_cache = engine_layer_caches(16, 3, 64)
    tables = shuffled_block_tables([40, 20], 16)
    lens = torch.tensor([40, 20], dtype=torch.int32)
    query = torch.randn(2, 9, 64)
    args = (query, key_cache, value_cache, tables, lens, 0.1, 24)
    expected = reference.paged_attention_decode(*args)
    actual = kernel.paged_attention_decode(*args)
    torch.testing.assert_close(actual, expected, atol=1e-5, rtol=1e-5)
    uncapped = kernel.paged_attention_decode(query, key_cache, value_cache, tables, lens, 0.1)
    assert not torch.allclose(actual[0], uncapped[0])  # the cap really cut sequence 0
    torch.testing.assert_close(actual[1], uncapped[1])


def test_token_major_layout_matches_reference(kernel: cpu_ops.CpuKernels) -> None:
    """A cache laid out ``[block, token, head, dim]`` (other strides) works too."""
    torch.manual_seed(2)
    kv = torch.randn(20, NUM_LAYERS, 2, BLOCK_SIZE, 2, 32)
    key_cache, value_cache = kv[:, LAYER, 0], kv[:, LAYER, 1]
    tables = shuffled_block_tables([33, 7], 20)
    lens = torch.tensor([33, 7], dtype=torch.int32)
    query = torch.randn(2, 4, 32)
    expected = reference.paged_attention_decode(query, key_cache, value_cache, tables, lens, 0.2)
    actual = kernel.paged_attention_decode(query, key_cache, value_cache, tables, lens, 0.2)
    torch.testing.assert_close(actual, expected, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("num_heads, num_kv_heads, head_dim", HEAD_SHAPES)
def test_bfloat16_cache_matches_float32_math_on_the_same_values(
    kernel: cpu_ops.CpuKernels, num_heads: int, num_kv_heads: int, head_dim: int
) -> None:
    """A bfloat16 cache is widened exactly, and the math is float32: the kernel equals the
    float32 reference on the same (bfloat16-rounded) keys and values."""
    torch.manual_seed(head_dim)
    context_lens = [1, 130, 64, 33]
    key_cache, value_cache = engine_layer_caches(48, num_kv_heads, head_dim, torch.bfloat16)
    tables = shuffled_block_tables(context_lens, 48)
    lens = torch.tensor(context_lens, dtype=torch.int32)
    query = torch.randn(len(context_lens), num_heads, head_dim)
    assert cpu_ops.supports(query, key_cache, value_cache)
    widened = (key_cache.float(), value_cache.float())
    expected = reference.paged_attention_decode(query, *widened, tables, lens, 0.125)
    actual = kernel.paged_attention_decode(query, key_cache, value_cache, tables, lens, 0.125)
    assert actual.dtype == torch.float32
    torch.testing.assert_close(actual, expected, atol=1e-5, rtol=1e-5)
    # The engine's bfloat16 query: answered in bfloat16, as the reference does, within rounding.
    query16 = query.to(torch.bfloat16)
    ours = kernel.paged_attention_decode(query16, key_cache, value_cache, tables, lens, 0.125)
    theirs = reference.paged_attention_decode(query16, key_cache, value_cache, tables, lens, 0.125)
    assert ours.dtype == torch.bfloat16
    torch.testing.assert_close(ours.float(), theirs.float(), atol=2e-2, rtol=2e-2)
    # The kernel reads the bfloat16 query itself and rounds its float32 output once. Without
    # AVX-512 BF16 that is the float32 query's result, rounded. With it the scores come from
    # VDPBF16PS (the same exact products, summed in another order) and, where a group's sums fit
    # in registers, so do the weighted values, over probabilities rounded to bfloat16 (flash
    # attention's P): an output is then off float32 math on the same values by at most the
    # rounding of the output (2^-9 of it) and of the probabilities (2^-9 of the largest value).
    wide = kernel.paged_attention_decode(
        query16.float(), key_cache, value_cache, tables, lens, 0.125
    )
    if not torch.cpu._is_avx512_bf16_supported():
        assert torch.equal(ours, wide.to(torch.bfloat16))
    exact = reference.paged_attention_decode(query16.float(), *widened, tables, lens, 0.125)
    bound = 2.0**-9 * (exact.abs() + value_cache.float().abs().max()) * 1.01 + 1e-6
    assert bool(((ours.float() - exact).abs() <= bound).all())


def test_other_dtypes_and_head_dims_are_not_supported() -> None:
    key_cache, value_cache = engine_layer_caches(8, 2, 16, torch.float16)
    query = torch.randn(1, 4, 16, dtype=torch.float16)
    assert not cpu_ops.supports(query, key_cache, value_cache)
    mixed = (key_cache.to(torch.bfloat16), value_cache.float())
    assert not cpu_ops.supports(query, *mixed)  # one dtype for both caches
    odd_dim = engine_layer_caches(8, 2, 24)
    assert not cpu_ops.supports(torch.randn(1, 4, 24), *odd_dim)  # not a multiple of 16 lanes


def test_other_dtypes_take_the_reference(kernel: cpu_ops.CpuKernels) -> None:
    torch.manual_seed(3)
    key_cache, value_cache = engine_layer_caches(8, 2, 16, torch.float16)
    query = torch.randn(1, 4, 16, dtype=torch.float16)
    tables, lens = shuffled_block_tables([20], 8), torch.tensor([20], dtype=torch.int32)
    expected = reference.paged_attention_decode(query, key_cache, value_cache, tables, lens, 0.3)
    actual = kernel.paged_attention_decode(query, key_cache, value_cache, tables, lens, 0.3)
    assert torch.equal(actual, expected)


def test_bad_block_tables_raise_instead_of_reading_out_of_bounds(
    kernel: cpu_ops.CpuKernels,
) -> None:
    key_cache, value_cache = engine_layer_caches(8, 3, 64)
    query = torch.randn(1, 9, 64)
    lens = torch.tensor([40], dtype=torch.int32)
    with pytest.raises(ValueError, match="fewer blocks than the context lengths need"):
        kernel.paged_attention_decode(
            query, key_cache, value_cache, torch.tensor([[0, 1]], dtype=torch.int32), lens, 0.1
        )
    with pytest.raises(ValueError, match=r"block id outside \[0, 8\)"):
        kernel.paged_attention_decode(
            query, key_cache, value_cache, torch.tensor([[0, 1, 8]], dtype=torch.int32), lens, 0.1
        )
    # Checked at every call, by the kernel: a table changed in place after a good call too.
    table = torch.tensor([[0, 1, 2]], dtype=torch.int32)
    kernel.paged_attention_decode(query, key_cache, value_cache, table, lens, 0.1)
    table[0, 0] = 3000
    with pytest.raises(ValueError, match=r"block id outside \[0, 8\)"):
        kernel.paged_attention_decode(query, key_cache, value_cache, table, lens, 0.1)


def test_decode_needs_a_table_row_and_a_length_per_sequence(kernel: cpu_ops.CpuKernels) -> None:
    key_cache, value_cache = engine_layer_caches(8, 3, 64)
    query, tables = torch.randn(3, 9, 64), torch.zeros(3, 2, dtype=torch.int32)
    lens = torch.full((3,), 20, dtype=torch.int32)
    with pytest.raises(ValueError, match="one block-table row and one context length per seq"):
        kernel.paged_attention_decode(query, key_cache, value_cache, tables[:1], lens[:1], 0.1)
    with pytest.raises(ValueError, match="one block-table row and one context length per seq"):
        kernel.paged_attention_decode(query, key_cache, value_cache, tables, lens[:2], 0.1)


def test_decode_gives_caches_that_disagree_with_the_query_to_the_reference(
    kernel: cpu_ops.CpuKernels,
) -> None:
    """A head size or a block count the caches do not share: the reference's own error (the
    kernel would read past them)."""
    query, lens = torch.randn(1, 4, 64), torch.tensor([20], dtype=torch.int32)
    tables = torch.tensor([[0, 7]], dtype=torch.int32)
    narrow = torch.randn(8, BLOCK_SIZE, 2, 32)  # head size 32 for a query of 64
    values = torch.full((8, BLOCK_SIZE, 2, 64), 1e6)
    for key_cache, value_cache in [
        (narrow, narrow),
        (torch.randn(8, BLOCK_SIZE, 2, 64), values[:2]),
    ]:
        with pytest.raises((RuntimeError, IndexError)):
            reference.paged_attention_decode(query, key_cache, value_cache, tables, lens, 0.1)
        with pytest.raises((RuntimeError, IndexError)):
            kernel.paged_attention_decode(query, key_cache, value_cache, tables, lens, 0.1)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_a_key_far_below_the_others_gets_exactly_no_weight(
    kernel: cpu_ops.CpuKernels, dtype: torch.dtype
) -> None:
    """Its softmax weight underflows to 0, as in PyTorch, however large its value."""
    key_cache, value_cache = torch.zeros(1, BLOCK_SIZE, 1, 32), torch.ones(1, BLOCK_SIZE, 1, 32)
    key_cache[0, 1], value_cache[0, 1] = -1e3, 1e38  # the second key scores -1e4 below the first
    query = torch.full((1, 1, 32), 10.0 / 32)
    tables, lens = torch.zeros(1, 1, dtype=torch.int32), torch.tensor([2], dtype=torch.int32)
    args = (query.to(dtype), key_cache.to(dtype), value_cache.to(dtype), tables, lens, 1.0)
    got, want = kernel.paged_attention_decode(*args), reference.paged_attention_decode(*args)
    assert torch.equal(got, want) and torch.equal(got, torch.ones_like(got))


def test_kernel_shares_torchs_openmp_runtime(kernel: cpu_ops.CpuKernels) -> None:
    """One libgomp in the process: the kernel runs on torch's threads, not a second pool."""
    maps = Path("/proc/self/maps")
    if not maps.exists():
        pytest.skip("no /proc/self/maps on this platform to list loaded libraries")
    paths = {line.split()[-1] for line in maps.read_text().splitlines() if "libgomp" in line}
    assert len(paths) == 1, paths


@needs_compiler
def test_build_is_cached_per_source_and_cpu(kernel: cpu_ops.CpuKernels) -> None:
    """``kernel`` is the session's build into an empty folder (the compile this test would
    otherwise repeat, ~10 s)."""
    folder = kernel.path.parent
    built = list(folder.glob("pdserve_cpu-*.so"))
    assert built == [kernel.path]
    stamp = built[0].stat().st_mtime_ns
    assert cpu_ops.build(cpu_ops.find_compiler() or "cc", folder) == built[0]
    assert built[0].stat().st_mtime_ns == stamp  # not rebuilt
    assert cpu_ops.load(folder) is kernel  # loaded once per directory


def test_failed_build_falls_back_with_a_warning(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    false = shutil.which("false")
    if false is None:
        pytest.skip("no `false` command to stand in for a broken compiler")
    with caplog.at_level(logging.WARNING, logger="kernels.cpu_ops"):
        assert cpu_ops.load(tmp_path / "kernels", false) is None
    assert "CPU attention kernel not built" in caplog.text
    config = EngineConfig(cache_dir=str(tmp_path / "other"), cpu_kernels_cc=false)
    assert attention_backend(config) == "reference"


def test_a_missing_compiler_is_named_in_a_warning(caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level(logging.WARNING, logger="kernels.cpu_ops"):
        found = cpu_ops.find_compiler("no-such-cc-for-pdserve")
    assert "'no-such-cc-for-pdserve' not found" in caplog.text
    assert found in (*cpu_ops.COMPILERS, None)


# ----- the engine's config decides -------------------------------------------------------------
@needs_compiler
def test_engine_config_cache_dir_places_the_kernel(
    tmp_path: Path, kernel: cpu_ops.CpuKernels
) -> None:
    seed_cache(kernel, tmp_path)  # the session's build, where one built here would go
    backend = attention_backend(EngineConfig(cache_dir=str(tmp_path)))
    assert isinstance(backend, cpu_ops.CpuKernels)
    assert backend.path.parent == tmp_path / "kernels"
    assert list((tmp_path / "kernels").glob("pdserve_cpu-*.so")) == [backend.path]


def test_cpu_kernels_off_gives_the_reference(tmp_path: Path) -> None:
    config = EngineConfig(cache_dir=str(tmp_path), cpu_kernels=False)
    assert attention_backend(config) == "reference"
    assert not (tmp_path / "kernels").exists()  # nothing compiled
    gpu = EngineConfig(cache_dir=str(tmp_path), device="cuda")
    assert attention_backend(gpu) is None  # by device: Triton, and no C build
    assert not (tmp_path / "kernels").exists()


@pytest.mark.parametrize(
    "env, argv, expected",
    [
        ({}, [], True),
        ({"PDSERVE_CPU_KERNELS": "0"}, [], False),
        ({"PDSERVE_CPU_KERNELS": "1"}, [], True),
        ({}, ["--no-cpu-kernels"], False),
        ({"PDSERVE_CPU_KERNELS": "0"}, ["--cpu-kernels"], True),  # the flag wins
    ],
)
def test_cpu_kernels_switch_from_environment_and_flags(
    env: dict[str, str], argv: list[str], expected: bool
) -> None:
    parser = argparse.ArgumentParser()
    add_settings(parser, EngineConfig, env)
    config = build(EngineConfig, parser.parse_args(argv))
    assert config.cpu_kernels is expected


@needs_compiler
def test_model_runner_runs_the_configured_kernel(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, kernel: cpu_ops.CpuKernels
) -> None:
    """A decode step through ``ModelRunner`` and the model takes the compiled kernel the config
    chose, and gives the reference's logits."""
    torch.manual_seed(4)
    cfg = tiny_model_config()
    model = LlamaModel(cfg).eval()

    def decode_logits(attention: str | kernels.Backend | None) -> torch.Tensor:
        runner = ModelRunner(model, 8, BLOCK_SIZE, torch.float32, attention=attention)
        seq = Sequence(0, "r", list(range(3, 23)), SamplingParams())
        seq.block_table = [5, 2]
        prefill = ScheduledBatch()
        prefill.add(seq, seq.num_tokens)
        runner.execute(prefill)
        seq.num_computed_tokens = seq.num_tokens
        seq.token_ids.append(7)
        decode = ScheduledBatch()
        decode.add(seq, 1)
        logits, seqs = runner.execute(decode)
        assert seqs == [seq]
        return logits

    expected = decode_logits("reference")
    seed_cache(kernel, tmp_path)
    backend = attention_backend(EngineConfig(cache_dir=str(tmp_path)))
    assert isinstance(backend, cpu_ops.CpuKernels)

    def not_the_reference(*args: object) -> torch.Tensor:
        raise AssertionError("decode attention took the reference, not the compiled kernel")

    monkeypatch.setattr(reference, "paged_attention_decode", not_the_reference)
    torch.testing.assert_close(decode_logits(backend), expected, atol=1e-5, rtol=1e-5)


def test_the_engine_decodes_with_the_compiled_kernel_and_without_it_when_told(llm) -> None:  # type: ignore[no-untyped-def]
    """The engine's model runner gets the kernel its config asks for: the compiled one by
    default (``--cpu-kernels``), the reference with ``--no-cpu-kernels``; same greedy tokens."""
    from services.engine.llm import LLM

    assert isinstance(llm.engine.runner.attention, cpu_ops.CpuKernels)
    plain = LLM(cpu_kernels=False, num_blocks=32, num_threads=1)
    assert plain.engine.runner.attention == "reference"
    params = SamplingParams(temperature=0, max_tokens=8)
    prompt = "The capital of France is"
    compiled = llm.generate([prompt], params)[0].outputs[0].token_ids
    assert plain.generate([prompt], params)[0].outputs[0].token_ids == compiled
