"""A decode worker checks KV handles against the record of the prefill worker each one names,
read from Redis when a handle names it and cached for ttl_seconds (services/worker/handles.py):
an idle decode worker reads no records at all, however many are registered (it used to re-read
every record every heartbeat, a cost that grew as decode workers x all workers), while a handle
of a registered worker is still accepted and one of an unregistered worker refused. Against a
real Redis; the first test against a real (simulated) decode worker process."""

from __future__ import annotations

import asyncio
import dataclasses
import time
import uuid
from typing import Any

import redis

from protos import pdserve_pb2 as pb
from services.redis_server import RedisServer
from services.registry import Fingerprint, RegistryConfig, WorkerRecord, WorkerRegistration
from services.worker.handles import HandleChecker, PeerRecords
from services.worker.launcher import WorkerProcess
from tests.services.test_registry import fast_config, run

FP = Fingerprint("m", "ab" * 8, "cd" * 8, 16, "float32", 30, 3, 64)
NUM_RECORDS = 300
HEARTBEAT = 0.2
READS = ("get", "mget", "smembers", "scan", "keys")  # any way to read records


def record(worker_id: str, port: int) -> WorkerRecord:
    return WorkerRecord(
        worker_id=worker_id,
        role="prefill",
        grpc_address=f"127.0.0.1:{port}",
        kv_address=f"tcp://127.0.0.1:{port + 1}",
        kv_transport="tcp",
        model=FP.model_id,
        fingerprint=FP,
    )


def handle(r: WorkerRecord) -> pb.KVHandle:
    return pb.KVHandle(
        prefill_worker_id=r.worker_id,
        address=r.kv_address,
        release_address=r.grpc_address,
        fingerprint=FP.key(),
    )


def command_calls(client: redis.Redis) -> dict[str, int]:
    """Calls of each command so far (INFO commandstats), by lower-case name."""
    stats = client.info("commandstats")
    return {name.removeprefix("cmdstat_"): int(v["calls"]) for name, v in stats.items()}


def test_an_idle_decode_worker_reads_no_records_however_many_are_registered() -> None:
    """300 records in the registry, a simulated decode worker heartbeating every 0.2 s: over
    ~10 heartbeats it reads no record and Redis sends it a few bytes per beat (the old view
    sent it all 300 records, ~150 KB, every beat)."""
    with RedisServer() as server:
        client = redis.Redis.from_url(server.url)
        prefix = f"s{uuid.uuid4().hex[:6]}:"
        cfg = RegistryConfig(redis_url=server.url, prefix=prefix)
        for i in range(NUM_RECORDS):
            r = record(f"prefill-{i}", 20_000 + 2 * i)
            client.set(cfg.worker_key(r.worker_id), r.to_json(), px=120_000)
            client.sadd(cfg.index_key, r.worker_id)
        args = ["--simulate", "h100-llama3-8b", "--num-blocks", "64", "--metrics-port", "-1"]
        args += ["--redis-url", server.url, "--redis-prefix", prefix]
        args += ["--heartbeat-seconds", str(HEARTBEAT), "--ttl-seconds", "2"]
        decode = WorkerProcess("decode", args)
        try:
            decode.start(timeout=120)
            time.sleep(3 * HEARTBEAT)  # past start-up
            calls, sent = command_calls(client), client.info("stats")["total_net_output_bytes"]
            time.sleep(10 * HEARTBEAT)
            after = command_calls(client)
            sent = client.info("stats")["total_net_output_bytes"] - sent
            assert decode.is_alive(), decode.output_tail()
        finally:
            decode.terminate(timeout=30)
    reads = {c: after.get(c, 0) - calls.get(c, 0) for c in READS}
    beats = after.get("set", 0) - calls.get("set", 0)  # one SET of its record per heartbeat
    assert beats >= 5, after
    assert not any(reads.values()), reads
    # INFO's own answers (~2 KB each) included; 300 records are ~150 KB.
    assert sent < 20_000, sent


def test_a_registered_worker_is_read_once_and_an_unregistered_one_refused(
    redis_server: Any,
) -> None:
    cfg = fast_config(redis_server.url)
    client = redis.Redis.from_url(redis_server.url)

    async def main() -> None:
        peers = PeerRecords(cfg)
        checker = HandleChecker(FP.key(), peers)
        later = record("p-later", 30_000)
        # Not registered yet: refused, and nothing is remembered of the refusal.
        assert "no registered prefill worker" in (await checker.rejection(handle(later)) or "")
        async with WorkerRegistration(cfg, later) as reg:
            gets = command_calls(client).get("get", 0)
            for _ in range(5):
                assert await checker.rejection(handle(reg.record)) is None
            assert command_calls(client).get("get", 0) - gets == 1  # then from the cache
            # Another worker id, an address it did not register, another fingerprint: refused.
            assert await checker.rejection(handle(record("p-other", 30_000))) is not None
            moved = dataclasses.replace(reg.record, grpc_address="127.0.0.1:1")
            assert await checker.rejection(handle(moved)) is not None
            wrong_fp = handle(reg.record)
            wrong_fp.fingerprint = "0" * 16
            assert await checker.rejection(wrong_fp) is not None
        # Deregistered: accepted from the cache for at most ttl_seconds, then refused.
        deadline = time.monotonic() + cfg.ttl_seconds + 1.0
        while await checker.rejection(handle(later)) is None:
            assert time.monotonic() < deadline, "still accepted after ttl_seconds"
            await asyncio.sleep(0.1)
        await peers.close()

    run(main())


def test_a_worker_registered_anew_at_other_addresses_is_read_again(redis_server: Any) -> None:
    cfg = fast_config(redis_server.url, ttl_seconds=30.0, heartbeat_seconds=0.2)

    async def main() -> None:
        peers = PeerRecords(cfg)
        checker = HandleChecker(FP.key(), peers)
        first = record("p-restarted", 31_000)
        async with WorkerRegistration(cfg, first):
            assert await checker.rejection(handle(first)) is None
        again = record("p-restarted", 32_000)  # the same id, restarted on other ports
        async with WorkerRegistration(cfg, again):
            assert await checker.rejection(handle(again)) is None  # not the cached record
            assert checker.live_addresses(60.0) == {again.grpc_address}
        await peers.close()

    run(main())


def test_while_redis_is_down_cached_workers_are_accepted_and_unknown_ones_refused() -> None:
    with RedisServer() as server:
        cfg = fast_config(server.url, ttl_seconds=1.0, heartbeat_seconds=0.2)
        known, unknown = record("p-known", 33_000), record("p-unknown", 34_000)

        async def main() -> None:
            peers = PeerRecords(cfg)
            checker = HandleChecker(FP.key(), peers)
            async with WorkerRegistration(cfg, known):
                assert await checker.rejection(handle(known)) is None
                server.stop()
                await asyncio.sleep(cfg.ttl_seconds)  # the cached record is due to be read again
                assert await checker.rejection(handle(known)) is None
                assert await checker.rejection(handle(unknown)) is not None
            await peers.close()

        run(main())


def test_after_a_redis_restart_cached_workers_count_while_they_register_again() -> None:
    """A restarted Redis lost every record: the workers in use are still accepted for
    ttl_seconds (they register again within a heartbeat), then refused if they did not."""
    with RedisServer() as server:
        cfg = fast_config(server.url, ttl_seconds=1.0, heartbeat_seconds=0.2)
        client = redis.Redis.from_url(server.url)
        known, unknown = record("p-known", 35_000), record("p-unknown", 36_000)
        client.set(cfg.worker_key(known.worker_id), known.to_json(), px=60_000)  # no heartbeat

        async def main() -> None:
            peers = PeerRecords(cfg)
            checker = HandleChecker(FP.key(), peers)
            assert await checker.rejection(handle(known)) is None
            server.restart()
            await asyncio.sleep(cfg.ttl_seconds)  # the cached record is due to be read again
            assert await checker.rejection(handle(known)) is None  # Redis lost it: grace
            assert await checker.rejection(handle(unknown)) is not None
            await asyncio.sleep(cfg.ttl_seconds)
            assert await checker.rejection(handle(known)) is not None  # it never came back
            await peers.close()

        run(main())
