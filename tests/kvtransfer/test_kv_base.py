"""The transport-independent parts: layout adapter, checksums, metrics, the pinned source."""

from __future__ import annotations

import asyncio

import pytest
import torch
from prometheus_client import CollectorRegistry

from kvtransfer import (
    ChecksumError,
    KVLayout,
    TensorBlockSource,
    TransferError,
    TransferMetrics,
    adapt_layout,
    available_transports,
    block_checksums,
    default_transport,
    make_client,
    make_server,
    verify_checksums,
)

L16 = KVLayout(num_layers=3, num_kv_heads=2, head_dim=8, block_size=16, dtype="float32")
L8 = KVLayout(num_layers=3, num_kv_heads=2, head_dim=8, block_size=8, dtype="float32")


def _blocks(layout: KVLayout, num_blocks: int, seed: int = 0) -> torch.Tensor:
    generator = torch.Generator().manual_seed(seed)
    return torch.randn((num_blocks, *layout.block_shape), generator=generator).to(
        layout.torch_dtype
    )


def _token_major(blocks: torch.Tensor, num_tokens: int) -> torch.Tensor:
    """[L, 2, H, tokens, D] view of the first ``num_tokens`` tokens (reference re-blocking)."""
    n, layers, _, heads, bs, dim = blocks.shape
    return blocks.permute(1, 2, 3, 0, 4, 5).reshape(layers, 2, heads, n * bs, dim)[
        :, :, :, :num_tokens
    ]


def test_layout_properties_match_the_default_model():
    smollm = KVLayout(num_layers=30, num_kv_heads=3, head_dim=64, block_size=16)
    assert smollm.block_shape == (30, 2, 3, 16, 64)
    assert smollm.bytes_per_block == 737_280  # 30 x (K,V) x 3 x 16 x 64 x 4 B
    assert KVLayout(30, 3, 64, 16, "bfloat16").bytes_per_block == 368_640
    with pytest.raises(ValueError):
        KVLayout(30, 3, 64, 16, "float99")


@pytest.mark.parametrize("num_tokens", [1, 8, 37, 48])
def test_block_size_round_trip_16_8_16(num_tokens: int):
    src = _blocks(L16, 3)
    half = adapt_layout(src, L16, L8, num_tokens)
    assert half.shape == (-(-num_tokens // 8), *L8.block_shape)
    assert torch.equal(_token_major(half, num_tokens), _token_major(src, num_tokens))
    back = adapt_layout(half, L8, L16, num_tokens)
    assert back.shape == (-(-num_tokens // 16), *L16.block_shape)
    assert torch.equal(_token_major(back, num_tokens), _token_major(src, num_tokens))
    tail = _token_major(back, back.shape[0] * 16)[:, :, :, num_tokens:]
    assert not tail.any(), "slots past num_tokens must be zero"


def test_dtype_round_trip_float32_bfloat16():
    bf16 = KVLayout(3, 2, 8, 16, "bfloat16")
    src = _blocks(L16, 2)
    low = adapt_layout(src, L16, bf16, 32)
    assert low.dtype == torch.bfloat16
    back = adapt_layout(low, bf16, L16, 32)
    torch.testing.assert_close(back, src, rtol=2**-8, atol=1e-6)
    mixed = adapt_layout(src, L16, KVLayout(3, 2, 8, 8, "bfloat16"), 20)
    torch.testing.assert_close(
        _token_major(mixed, 20).float(), _token_major(src, 20), rtol=2**-8, atol=1e-6
    )


def test_layout_adapter_rejects_mismatches():
    src = _blocks(L16, 2)
    with pytest.raises(ValueError, match="heads"):
        adapt_layout(src, L16, KVLayout(3, 4, 8, 16), 16)
    with pytest.raises(ValueError):
        adapt_layout(src, L8, L16, 16)  # blocks are not in the claimed layout
    with pytest.raises(ValueError):
        adapt_layout(src, L16, L8, 33)  # more tokens than the blocks hold


def test_checksums_detect_the_first_bad_block():
    blocks = _blocks(L16, 4)
    sums = block_checksums(blocks)
    verify_checksums(blocks.clone(), sums)
    bad = blocks.clone()
    bad[2, 1, 0, 1, 5, 3] += 1.0
    bad[3, 0, 0, 0, 0, 0] += 1.0
    with pytest.raises(ChecksumError) as info:
        verify_checksums(bad, sums)
    assert info.value.block_index == 2 and isinstance(info.value, TransferError)
    with pytest.raises(ChecksumError):
        verify_checksums(blocks[:3], sums)
    bf16 = blocks.to(torch.bfloat16)
    assert block_checksums(bf16) != block_checksums(blocks)  # works on any dtype


def test_pinned_source_leases():
    now = [0.0]
    unpinned: list[str] = []
    kv = _blocks(L8, 6)
    source = TensorBlockSource(
        kv, lease_seconds=2.0, clock=lambda: now[0], on_unpin=unpinned.append
    )
    sums = source.pin("a", [1, 4])
    assert torch.equal(source.read_blocks("a", [4, 1]), kv[[4, 1]])
    assert sums == block_checksums(kv[[1, 4]])
    with pytest.raises(KeyError):
        source.read_blocks("a", [2])
    source.pin("runs", [0, 1, 2, 4, 5, 3])
    rows = source.block_rows("runs", [0, 1, 2, 4, 5, 3])
    assert [tuple(r.shape)[0] for r in rows] == [3, 2, 1]
    assert all(r.data_ptr() == kv[i].data_ptr() for r, i in zip(rows, (0, 4, 3)))
    assert source.release("runs")
    now[0] = 1.5
    assert source.renew_lease("a")
    now[0] = 3.0  # renewed at 1.5 -> expires at 3.5
    assert source.is_pinned("a") and source.expire() == []
    now[0] = 3.6
    assert not source.renew_lease("a")
    with pytest.raises(KeyError):
        source.read_blocks("a", [1])
    assert source.expire() == ["a"] and unpinned == ["runs", "a"]
    assert not source.release("a")


def test_metrics_are_shared_by_many_endpoints_and_count_per_registry():
    registry = CollectorRegistry()
    metrics = TransferMetrics(registry)
    kv = _blocks(L8, 4)
    source = TensorBlockSource(kv)
    source.pin("r", [0, 1])

    async def run() -> None:
        servers = [make_server("tcp", source, L8, "k", metrics=metrics) for _ in "ab"]
        addresses = [await s.start() for s in servers]
        client = make_client("tcp", token="k", metrics=metrics)
        for address in addresses:
            await client.pull(address, "r", [0, 1], L8, 5.0)
        with pytest.raises(TransferError):
            await client.pull(addresses[0], "missing", [0], L8, 5.0)
        await client.close()
        for server in servers:
            await server.stop()

    asyncio.run(run())
    nbytes = 2 * 2 * L8.bytes_per_block
    labels = {"transport": "tcp", "direction": "received"}
    assert registry.get_sample_value("pdserve_kv_transfer_bytes_total", labels) == nbytes
    labels["direction"] = "sent"
    assert registry.get_sample_value("pdserve_kv_transfer_bytes_total", labels) == nbytes
    fails = {"transport": "tcp", "reason": "unknown_request"}
    # counted once by the server and once by the client
    assert registry.get_sample_value("pdserve_kv_transfer_failures_total", fails) == 2
    count = registry.get_sample_value("pdserve_kv_transfer_seconds_count", {"transport": "tcp"})
    assert count == 4
    make_server("tcp", source, L8)  # private registries: no duplicate-registration crash
    make_server("tcp", source, L8)


def test_factory():
    assert "tcp" in available_transports() and "torch" in available_transports()
    assert default_transport("cpu") == "tcp"
    assert default_transport("cuda:0") in ("ucx", "torch")
    with pytest.raises(ValueError, match="unknown KV transport"):
        make_client("carrier-pigeon")
