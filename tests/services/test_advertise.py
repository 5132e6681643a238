"""A worker bound to every interface (0.0.0.0, as in a container) advertises an address peers
can dial, not the wildcard: for its gRPC server and for its KV transport, in its ready line and in
its Redis record."""

from __future__ import annotations

import asyncio
import socket
from pathlib import Path
from typing import Any

import grpc
import psutil
import pytest
import redis
import torch
from grpc_health.v1 import health_pb2, health_pb2_grpc

import kvtransfer
from kvtransfer import KVLayout, TensorBlockSource, make_server
from kvtransfer.framing import parse_address
from pdserve import SamplingParams
from services.registry import WorkerRecord
from services.worker import config as worker_config
from services.worker.config import WILDCARD_HOSTS, WorkerConfig, reachable_host
from tests.services.workers import disaggregated, run, running

LAYOUT = KVLayout(num_layers=2, num_kv_heads=1, head_dim=4, block_size=4, dtype="float32")


def _addrinfo(*addresses: str) -> list[tuple[Any, ...]]:
    """What socket.getaddrinfo returns for ``addresses``."""
    infos = []
    for address in addresses:
        family = socket.AF_INET6 if ":" in address else socket.AF_INET
        sockaddr = (address, 0, 0, 0) if family == socket.AF_INET6 else (address, 0)
        infos.append((family, socket.SOCK_STREAM, 6, "", sockaddr))
    return infos


@pytest.fixture
def resolver(monkeypatch: pytest.MonkeyPatch) -> dict[str, Any]:
    """Replaces the host's name and its resolution; records the family asked for."""
    state: dict[str, Any] = {"name": "worker-7", "answer": [], "families": []}

    def getaddrinfo(host: str, port: Any, family: int = 0, *args: Any) -> list[tuple[Any, ...]]:
        assert host == state["name"]
        state["families"].append(family)
        if isinstance(state["answer"], Exception):
            raise state["answer"]
        return state["answer"]

    monkeypatch.setattr(worker_config.socket, "gethostname", lambda: state["name"])
    monkeypatch.setattr(worker_config.socket, "getaddrinfo", getaddrinfo)
    return state


def test_a_specific_bind_address_is_advertised_as_is(resolver: dict[str, Any]) -> None:
    assert reachable_host("127.0.0.1") == "127.0.0.1"
    assert reachable_host("10.1.2.3") == "10.1.2.3"
    assert resolver["families"] == []  # nothing resolved


def test_a_wildcard_becomes_the_hosts_non_loopback_address(resolver: dict[str, Any]) -> None:
    # Debian maps the hostname to 127.0.1.1; Docker puts the container's address in /etc/hosts.
    resolver["answer"] = _addrinfo("127.0.1.1", "172.18.0.5")
    assert reachable_host("0.0.0.0") == "172.18.0.5"
    assert resolver["families"] == [socket.AF_INET]  # a 0.0.0.0 socket takes IPv4 only
    resolver["answer"] = _addrinfo("fe80::1", "fd00::5", "172.18.0.5")
    assert reachable_host("::") == "fd00::5"  # dual-stack: either family; never link-local
    assert resolver["families"][-1] == socket.AF_UNSPEC


def test_a_wildcard_falls_back_to_loopback_then_to_the_name(resolver: dict[str, Any]) -> None:
    resolver["answer"] = _addrinfo("127.0.0.1")
    assert reachable_host("0.0.0.0") == "127.0.0.1"  # a machine alone: loopback is reachable
    resolver["answer"] = socket.gaierror(socket.EAI_NONAME, "Name or service not known")
    assert reachable_host("0.0.0.0") == "worker-7"  # peers may still resolve it (DNS)


def test_advertise_host_wins(resolver: dict[str, Any]) -> None:
    resolver["answer"] = _addrinfo("172.18.0.5")
    assert WorkerConfig("prefill", host="0.0.0.0").public_host == "172.18.0.5"
    config = WorkerConfig("prefill", host="0.0.0.0", advertise_host="prefill-0.prefill")
    assert config.public_host == "prefill-0.prefill"
    assert WorkerConfig("decode").public_host == "127.0.0.1"


@pytest.mark.parametrize("transport", ["tcp", "shm", "torch", "ucx"])
def test_kv_servers_bound_to_a_wildcard_advertise_the_given_host(
    transport: str, tmp_path: Path
) -> None:
    if transport not in kvtransfer.available_transports():
        pytest.skip(f"KV transport {transport!r} cannot run on this machine")
    options = {"path": str(tmp_path / "kv")} if transport == "shm" else {}
    kv = torch.zeros((2, *LAYOUT.block_shape), dtype=LAYOUT.torch_dtype)
    source = TensorBlockSource(kv)

    async def addresses() -> tuple[str, str]:
        advertised = make_server(transport, source, LAYOUT, **options)
        plain = make_server(transport, source, LAYOUT, **options)
        try:
            return await advertised.start("0.0.0.0", "10.1.2.3"), await plain.start("127.0.0.1")
        finally:
            await advertised.stop()
            await plain.stop()

    advertised, plain = asyncio.run(addresses())
    assert parse_address(advertised, transport)[0] == "10.1.2.3"  # never dialled here
    assert parse_address(plain, transport)[0] == "127.0.0.1"


@pytest.mark.parametrize("transport", ["tcp", "ucx"])
def test_kv_servers_listen_on_their_own_host_only(transport: str) -> None:
    """The port a KV address names is bound to the worker's host, not every interface (ucx:
    its rendezvous socket; ucxx's own listener, which binds every interface, is not used)."""
    if transport not in kvtransfer.available_transports():
        pytest.skip(f"KV transport {transport!r} cannot run on this machine")
    kv = torch.zeros((2, *LAYOUT.block_shape), dtype=LAYOUT.torch_dtype)

    async def listening() -> list[str]:
        server = make_server(transport, TensorBlockSource(kv), LAYOUT)
        try:
            port = parse_address(await server.start("127.0.0.1"), transport)[1]
            sockets = psutil.Process().net_connections(kind="inet")
            return [c.laddr.ip for c in sockets if c.status == "LISTEN" and c.laddr.port == port]
        finally:
            await server.stop()

    assert asyncio.run(listening()) == ["127.0.0.1"]


def _host(address: str) -> str:
    """The host of ``host:port`` or ``scheme://host:port?query``."""
    rest = address.partition("://")[2] or address
    return rest.partition("?")[0].rpartition(":")[0].strip("[]")


def test_a_worker_bound_to_0000_registers_reachable_addresses(redis_server: Any) -> None:
    prefix = "advertise:"
    args = ["--host", "0.0.0.0", "--redis-url", redis_server.url, "--redis-prefix", prefix]
    expected = reachable_host("0.0.0.0")
    assert expected not in WILDCARD_HOSTS
    with running([("prefill", args), ("decode", args)]) as (prefill, decode):
        client = redis.Redis.from_url(redis_server.url)
        for worker in (prefill, decode):
            info = worker.info
            # The ready line names the resolved address, never the wildcard ...
            assert _host(info["grpc_address"]) == expected
            # ... and so does the record the router reads.
            raw = client.get(f"{prefix}worker:{info['worker_id']}")
            assert raw is not None
            record = WorkerRecord.from_json(raw)
            assert record.grpc_address == info["grpc_address"]
            assert record.kv_address == info["kv_address"]
            # Reachable: gRPC health answers SERVING at the advertised address.
            with grpc.insecure_channel(info["grpc_address"]) as channel:
                stub = health_pb2_grpc.HealthStub(channel)
                reply = stub.Check(health_pb2.HealthCheckRequest(), timeout=10)
            assert reply.status == health_pb2.HealthCheckResponse.SERVING
        kv_host, kv_port, _ = parse_address(prefill.info["kv_address"], "tcp")
        assert kv_host == expected
        socket.create_connection((kv_host, kv_port), timeout=5).close()
        # And the decode worker pulls the prompt's KV blocks from that advertised address.
        prompt = list(range(100, 140))
        result = run(
            disaggregated(
                prefill.info["grpc_address"],
                decode.info["grpc_address"],
                "advertise-1",
                prompt,
                SamplingParams(temperature=0, max_tokens=4),
            )
        )
        assert result.kv_source == "pulled" and len(result.token_ids) == 4
