"""KV fault injection (kvtransfer.faults): real transfer servers in other processes drop and
corrupt pulls on purpose; the client must fail fast or catch the corruption by checksum, and
through real prefill + decode workers the output must not change and no block may leak."""

from __future__ import annotations

import asyncio
import time
from collections import Counter
from collections.abc import Iterator

import pytest
import torch

from kvtransfer import (
    KVFaults,
    KVLayout,
    TransferError,
    available_transports,
    block_checksums,
    make_client,
    make_server,
)
from kvtransfer.server_process import ServerProcess, ServerSpec, make_kv_cache
from kvtransfer.source import TensorBlockSource
from pdserve import SamplingParams
from tests.conftest import PROMPTS
from tests.services.workers import disaggregated, metric, run, running, used_blocks

LAYOUT = KVLayout(num_layers=2, num_kv_heads=2, head_dim=16, block_size=8, dtype="float32")
NUM_BLOCKS = 32
SEED = 99
BLOCK_IDS = [3, 4, 5, 17]  # a run and a lone block: two zero-copy views on tcp
NUM_PULLS = 24
FAST_SECONDS = 2.0  # a dropped pull must fail well before the pull timeout below
PULL_TIMEOUT = 20.0


def test_spec_parsing() -> None:
    faults = KVFaults.parse(" drop=0.1, corrupt=0.05,seed=7")
    assert faults == KVFaults(drop=0.1, corrupt=0.05, seed=7)
    for off in (None, "", "drop=0,corrupt=0", "seed=3"):
        assert KVFaults.parse(off) is None
    for bad, why in (
        ("drop", "cannot read"),
        ("lose=0.1", "cannot read"),
        ("drop=abc", "not a number"),
        ("drop=1.5", "not a probability"),
        ("drop=0.6,corrupt=0.6", "> 1"),
    ):
        with pytest.raises(ValueError, match=why):
            KVFaults.parse(bad)


def test_draws_follow_the_seed_and_corruption_leaves_the_original_alone() -> None:
    def draws(seed: int) -> list[str | None]:
        faults = KVFaults(drop=0.25, corrupt=0.25, seed=seed)
        return [faults.draw() for _ in range(400)]

    assert draws(1) == draws(1) != draws(2)
    counts = Counter(draws(1))
    assert set(counts) == {"drop", "corrupt", None}
    assert 60 < counts["drop"] < 140 and 60 < counts["corrupt"] < 140
    assert KVFaults(drop=1.0).draw() == "drop" and KVFaults(corrupt=1.0).draw() == "corrupt"

    original = torch.randn(3, 5)
    before = original.clone()
    bad = KVFaults(corrupt=1.0, seed=0).corrupted(original)
    assert torch.equal(original, before)
    differing = (bad.view(torch.uint8) != before.view(torch.uint8)).sum().item()
    assert differing == 1


def test_shm_refuses_corruption_it_cannot_inject() -> None:
    source = TensorBlockSource(make_kv_cache(LAYOUT, 4, SEED))
    with pytest.raises(ValueError, match="cannot inject 'corrupt'"):
        make_server("shm", source, LAYOUT, path="/dev/shm/unused", faults=KVFaults(corrupt=0.1))


def _faults_for(transport: str) -> KVFaults:
    # Every outcome shows up in NUM_PULLS draws (fixed by the seed); shm can only drop.
    if transport == "shm":
        return KVFaults(drop=0.4, seed=SEED)
    return KVFaults(drop=0.3, corrupt=0.3, seed=SEED)


def _transports() -> list[object]:
    found = available_transports()
    return [
        pytest.param(
            name,
            marks=pytest.mark.skipif(
                name not in found,
                reason=f"the {name} KV transport cannot run on this machine "
                "(not in kvtransfer.available_transports())",
            ),
        )
        for name in ("tcp", "torch", "ucx", "shm")
    ]


@pytest.fixture(scope="module", params=_transports())
def faulty_server(request: pytest.FixtureRequest) -> Iterator[ServerProcess]:
    transport = request.param
    spec = ServerSpec(
        transport,
        LAYOUT,
        NUM_BLOCKS,
        SEED,
        pins={"req": BLOCK_IDS},
        options={"faults": _faults_for(transport)},
    )
    with ServerProcess(spec) as proc:
        yield proc


def _pull_many(transport: str, address: str) -> list[tuple[str, float, torch.Tensor | None]]:
    """NUM_PULLS verified pulls on one client: (outcome, seconds, blocks when ok)."""
    expected = block_checksums(make_kv_cache(LAYOUT, NUM_BLOCKS, SEED)[BLOCK_IDS])

    async def go() -> list[tuple[str, float, torch.Tensor | None]]:
        client = make_client(transport)
        outcomes: list[tuple[str, float, torch.Tensor | None]] = []
        try:
            for _ in range(NUM_PULLS):
                start = time.monotonic()
                try:
                    blocks = await client.pull_verified(
                        address, "req", BLOCK_IDS, LAYOUT, PULL_TIMEOUT, expected
                    )
                    outcomes.append(("ok", time.monotonic() - start, blocks))
                except TransferError as exc:
                    outcomes.append((exc.reason, time.monotonic() - start, None))
        finally:
            await client.close()
        return outcomes

    return asyncio.run(go())


def test_dropped_pulls_fail_fast_and_corrupted_ones_fail_their_checksum(
    faulty_server: ServerProcess,
) -> None:
    transport = faulty_server.spec.transport
    outcomes = _pull_many(transport, faulty_server.address)
    kinds = Counter(outcome for outcome, _, _ in outcomes)
    injected = faulty_server.stats()["injected"]
    wanted = {"ok", "connection_lost"} | ({"checksum"} if transport != "shm" else set())
    assert set(kinds) == wanted, kinds
    for outcome, seconds, _ in outcomes:
        if outcome == "connection_lost":
            assert seconds < FAST_SECONDS, f"a dropped pull took {seconds:.1f}s"
    if transport == "shm":
        # The client retries once when a pooled connection turns out closed, so a drop on a
        # reused connection may be absorbed by the retry: at least one drop per lost pull.
        assert injected["drop"] >= kinds["connection_lost"]
        assert "corrupt" not in injected
    else:
        assert injected == {"drop": kinds["connection_lost"], "corrupt": kinds["checksum"]}
    good = make_kv_cache(LAYOUT, NUM_BLOCKS, SEED)[BLOCK_IDS]
    for outcome, _, blocks in outcomes:  # the pulls that drew no fault are untouched
        if outcome == "ok":
            assert blocks is not None and torch.equal(blocks, good)


def test_faults_off_serves_every_pull_untouched() -> None:
    spec = ServerSpec("tcp", LAYOUT, NUM_BLOCKS, SEED, pins={"req": BLOCK_IDS})
    with ServerProcess(spec) as server:
        outcomes = _pull_many("tcp", server.address)
        stats = server.stats()
    assert [outcome for outcome, _, _ in outcomes] == ["ok"] * NUM_PULLS
    assert stats["injected"] == {} and stats["failures"] == {}


GREEDY = SamplingParams(temperature=0, max_tokens=12)


def test_workers_recompute_around_faulty_pulls_and_leak_nothing(llm) -> None:  # type: ignore[no-untyped-def]
    """Every pull is dropped or corrupted (seeded: both kinds among 4 prompts); the decode
    worker recomputes each prompt and the tokens equal the offline engine's greedy ones."""
    prompts = PROMPTS[:4]
    expected = [o.outputs[0].token_ids for o in llm.generate(prompts, GREEDY)]
    tokenizer = llm.get_tokenizer()
    args = ["--kv-faults", "drop=0.5,corrupt=0.5,seed=3"]
    with running([("prefill", args), ("decode", [])]) as (p, d):
        for i, prompt in enumerate(prompts):
            result = run(
                disaggregated(
                    p.info["grpc_address"],
                    d.info["grpc_address"],
                    f"fault-{i}",
                    tokenizer.encode(prompt),
                    GREEDY,
                )
            )
            assert result.kv_source == "recomputed"
            assert result.token_ids == expected[i]

        def injected(kind: str) -> float:
            labels = f'kind="{kind}",transport="tcp"'
            return metric(p, "pdserve_kv_transfer_faults_injected_total", labels)

        def failed(reason: str) -> float:
            labels = f'reason="{reason}",transport="tcp"'
            return metric(d, "pdserve_kv_transfer_failures_total", labels)

        assert injected("drop") >= 1 and injected("corrupt") >= 1
        assert injected("drop") + injected("corrupt") == len(prompts)
        assert failed("connection_lost") == injected("drop")
        assert failed("checksum") == injected("corrupt")
        assert metric(d, "pdserve_kv_pulls_total", 'outcome="recomputed"') == len(prompts)
        deadline = time.monotonic() + 10  # past the 5 s lease, the backstop of a lost Release
        while (used_blocks(p), used_blocks(d)) != (0, 0) and time.monotonic() < deadline:
            time.sleep(0.1)
        assert (used_blocks(p), used_blocks(d)) == (0, 0)
