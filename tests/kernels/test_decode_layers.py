"""The fused decode layers (``kernels.decode_layers``, ``services.engine.model.fused_decode``):
a decode step of 1-4 sequences (1-8 here with dot products, any number up to 256 with the pair
order) through every layer in one compiled call gives, bit for bit, the hidden states and KV
cache of the same step through the separate kernels, and declines (runs nothing) whatever it
does not take.

The model is a small random one (GQA, a qkv bias, several blocks of context), in bfloat16 with its
linears on the small-batch kernel at 1-4 rows, as the engine packs them on a CPU where that kernel
is the fastest: the widening kernel's two tiles, or (on CPUs with AVX-512 BF16) its dot-product
variant, or the dot products at 2-4 rows and the pair-order GEMM above.
"""

from __future__ import annotations

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kernels import cpu_ops
from services.engine.model.fused_decode import FusedDecode
from services.engine.model.llama import AttentionMetadata, LlamaModel
from services.engine.model.packed_linear import NUM_BUCKETS, pack_linears
from services.engine.model_runner import ModelRunner
from tests.conftest import tiny_model_config

BLOCK_SIZE, NUM_BLOCKS, MAX_CONTEXT = 16, 512, 100
CONFIG = tiny_model_config(
    vocab_size=96,
    hidden_size=128,
    intermediate_size=224,
    num_layers=3,
    head_dim=32,
    max_position=256,
    attention_bias=True,
)


def small_batch_paths(one_row: str, few_rows: str) -> tuple[str, ...]:
    return (one_row, few_rows) + ("native",) * (NUM_BUCKETS - 2)


# Paths for rows 1, 2-4, 5-8 ... (then oneDNN), and the rows the fused call then serves.
TABLES = {
    "widened": (("small-batch-4", "small-batch", "native"), {1, 2, 3, 4}),
    "dot": (("small-batch-4", "small-batch-dot", "small-batch-dot"), set(range(1, 9))),
    "pairs": (
        ("small-batch-4", "small-batch-dot", *("pairs-dot",) * (NUM_BUCKETS - 2)),
        set(range(1, 257)),
    ),
}


@pytest.fixture(scope="module", params=list(TABLES))
def runner(kernel: cpu_ops.CpuKernels, request: pytest.FixtureRequest) -> ModelRunner:
    """A bfloat16 model whose linears run the 4-row tile at one row and the 8-row tile at 2-4
    rows (both tiles, in one model), or the 4-row tile at one row and the dot products at 2-8
    rows, with the runner that owns its cache (and builds the fused call over it)."""
    if request.param in ("dot", "pairs") and not kernel.bf16_dot:
        pytest.skip("the dot products and the pair order need AVX-512 BF16, which this CPU lacks")
    torch.manual_seed(0)
    model = LlamaModel(CONFIG).eval()
    with torch.no_grad():
        for p in model.parameters():
            p.copy_(torch.randn_like(p) * 0.2)
    model = model.to(torch.bfloat16)
    small, _ = TABLES[request.param]
    paths = small + ("native",) * (NUM_BUCKETS - len(small))
    assert pack_linears(model, lambda name, linear: paths, kernel.linear_bf16) == 13
    runner = ModelRunner(model, NUM_BLOCKS, BLOCK_SIZE, torch.bfloat16, attention=kernel)
    with torch.no_grad():
        runner.kv_cache.copy_(torch.randn_like(runner.kv_cache.float()).to(torch.bfloat16))
    return runner


def decode_meta(
    kernel: cpu_ops.CpuKernels, lens: list[int], tables: list[list[int]]
) -> AttentionMetadata:
    """A decode-only step: each sequence's new token at position len - 1."""
    width = max(len(t) for t in tables)
    slots = [
        t[(n - 1) // BLOCK_SIZE] * BLOCK_SIZE + (n - 1) % BLOCK_SIZE for t, n in zip(tables, lens)
    ]
    empty = torch.zeros(0, 0, dtype=torch.int32)
    return AttentionMetadata(
        slot_mapping=torch.tensor(slots),
        num_decode_tokens=len(lens),
        decode_block_tables=torch.tensor(
            [t + [0] * (width - len(t)) for t in tables], dtype=torch.int32
        ),
        decode_context_lens=torch.tensor(lens, dtype=torch.int32),
        decode_max_context_len=max(lens),
        prefill_block_tables=empty,
        prefill_query_start_loc=torch.zeros(1, dtype=torch.int32),
        prefill_context_lens=torch.zeros(0, dtype=torch.int32),
        backend=kernel,
    )


def forward(
    runner: ModelRunner, ids: list[int], lens: list[int], meta: AttentionMetadata, fused: bool
):
    """Hidden states and the cache after one step, fused or not; the cache is restored after."""
    model = runner.model
    saved_cache, saved_fused = runner.kv_cache.clone(), model.fused_decode
    model.fused_decode = saved_fused if fused else None
    try:
        with torch.inference_mode():
            positions = torch.tensor([n - 1 for n in lens])
            hidden = model.forward(torch.tensor(ids), positions, runner.layer_caches, meta)
        return hidden, runner.kv_cache.clone()
    finally:
        model.fused_decode = saved_fused
        runner.kv_cache.copy_(saved_cache)


@settings(
    max_examples=25, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(data=st.data(), rows=st.one_of(st.integers(1, 8), st.integers(9, 40)))
def test_fused_step_equals_the_separate_kernels(
    kernel: cpu_ops.CpuKernels, runner: ModelRunner, data: st.DataObject, rows: int
) -> None:
    lens = data.draw(st.lists(st.integers(1, MAX_CONTEXT), min_size=rows, max_size=rows))
    blocks = data.draw(st.permutations(range(NUM_BLOCKS)))
    tables, used = [], 0
    for n in lens:  # each sequence its own blocks, anywhere in the pool
        count = -(-n // BLOCK_SIZE)
        tables.append(list(blocks[used : used + count]))
        used += count
    if used > NUM_BLOCKS:
        return  # more than the pool holds
    ids = data.draw(st.lists(st.integers(0, CONFIG.vocab_size - 1), min_size=rows, max_size=rows))
    meta = decode_meta(kernel, lens, tables)
    fused = runner.model.fused_decode
    assert fused is not None and fused.by_rows.keys() in [TABLES[t][1] for t in TABLES]
    if rows not in fused.by_rows:
        return  # the widening kernel's table: 1-4 rows
    fused_hidden, fused_cache = forward(runner, ids, lens, meta, fused=True)
    hidden, cache = forward(runner, ids, lens, meta, fused=False)
    assert torch.equal(fused_hidden, hidden)
    assert torch.equal(fused_cache, cache)
    assert not torch.equal(cache, runner.kv_cache)  # the step wrote its keys and values


def test_declines_what_it_does_not_take(kernel: cpu_ops.CpuKernels, runner: ModelRunner) -> None:
    fused = runner.model.fused_decode
    assert fused is not None
    x = torch.zeros(1, CONFIG.hidden_size, dtype=torch.bfloat16)
    rotary = runner.model.rope.tables(torch.tensor([4]), torch.bfloat16)
    meta = decode_meta(kernel, [5], [[3]])
    other_caches = list(runner.layer_caches)
    assert fused.run(x, rotary, other_caches, meta) is None  # not the cache it was built for
    prefill = decode_meta(kernel, [5], [[3]])
    prefill.num_decode_tokens = 0
    assert fused.run(x, rotary, runner.layer_caches, prefill) is None
    more = max(fused.by_rows) + 1  # 5, 9 with the dot products, 257 past the pair order's
    many = torch.zeros(more, CONFIG.hidden_size, dtype=torch.bfloat16)
    rotary_many = runner.model.rope.tables(torch.full((more,), 4), torch.bfloat16)
    meta_many = decode_meta(kernel, [5] * more, [[i] for i in range(more)])
    assert fused.run(many, rotary_many, runner.layer_caches, meta_many) is None


def test_a_slot_outside_the_cache_is_refused_before_anything_is_written(
    kernel: cpu_ops.CpuKernels, runner: ModelRunner
) -> None:
    fused = runner.model.fused_decode
    assert fused is not None
    before = runner.kv_cache.clone()
    x = torch.zeros(1, CONFIG.hidden_size, dtype=torch.bfloat16)
    rotary = runner.model.rope.tables(torch.tensor([4]), torch.bfloat16)
    meta = decode_meta(kernel, [5], [[3]])
    meta.slot_mapping = torch.tensor([NUM_BLOCKS * BLOCK_SIZE])
    with pytest.raises(ValueError, match="outside the cache"):
        fused.run(x, rotary, runner.layer_caches, meta)
    meta = decode_meta(kernel, [5], [[NUM_BLOCKS]])  # a block past the pool
    meta.slot_mapping = torch.tensor([4])
    with pytest.raises(ValueError, match="outside the cache"):
        fused.run(x, rotary, runner.layer_caches, meta)
    assert torch.equal(runner.kv_cache, before)


def test_not_built_where_a_linear_is_not_on_the_small_batch_kernel(
    kernel: cpu_ops.CpuKernels,
) -> None:
    """float32 weights (no small-batch kernel) and a model whose one-row path is oneDNN: no
    fused call at the row counts it would not serve."""
    torch.manual_seed(1)
    model = LlamaModel(CONFIG).eval()
    runner = ModelRunner(model, 8, BLOCK_SIZE, torch.float32, attention=kernel)
    assert model.fused_decode is None
    model = LlamaModel(CONFIG).eval().to(torch.bfloat16)
    paths = small_batch_paths("native", "small-batch-4")
    pack_linears(model, lambda name, linear: paths, kernel.linear_bf16)
    runner = ModelRunner(model, 8, BLOCK_SIZE, torch.bfloat16, attention=kernel)
    assert isinstance(model.fused_decode, FusedDecode)
    assert model.fused_decode.by_rows.keys() == {2, 3, 4}
    runner = ModelRunner(model, 8, BLOCK_SIZE, torch.bfloat16, attention="reference")
    assert model.fused_decode is None  # the compiled kernels are off
    del runner
