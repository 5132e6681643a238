"""Settings of one worker process (prefill, decode or colocated), built once by the CLI."""

from __future__ import annotations

import ipaddress
import socket
from dataclasses import dataclass, field

from services.engine.config import EngineConfig

ROLES = ("prefill", "decode", "colocated")
READY_PREFIX = "PDSERVE_READY "  # the line a worker prints once it listens
WILDCARD_HOSTS = ("0.0.0.0", "::", "")  # bind to every interface: not an address to dial


def reachable_host(bind_host: str) -> str:
    """The address peers use for a socket bound to ``bind_host``.

    A specific address is its own answer. A wildcard bind (a container's 0.0.0.0) is not
    dialable from another machine, so it becomes this host's name resolved to an address (in a
    container: the container's address on its network), a non-loopback one when there is one;
    the name itself when it does not resolve.
    """
    if bind_host not in WILDCARD_HOSTS:
        return bind_host
    name = socket.gethostname()
    # A 0.0.0.0 socket accepts IPv4 only; a :: socket is dual-stack and takes either.
    family = socket.AF_INET if bind_host == "0.0.0.0" else socket.AF_UNSPEC
    try:
        infos = socket.getaddrinfo(name, None, family, socket.SOCK_STREAM)
    except OSError:
        return name
    addresses = [str(info[4][0]) for info in infos]
    for address in addresses:
        ip = ipaddress.ip_address(address)
        if not (ip.is_loopback or ip.is_link_local):  # fe80:: would need a scope id
            return address
    return addresses[0] if addresses else name


@dataclass(frozen=True)
class WorkerConfig:
    role: str
    engine: EngineConfig = field(default_factory=EngineConfig)
    host: str = "127.0.0.1"  # bind address; 0.0.0.0 in containers
    advertise_host: str | None = None  # the address peers use (default: reachable_host(host))
    grpc_port: int = 0  # 0: ephemeral
    metrics_port: int = 0  # Prometheus /metrics over HTTP; 0: ephemeral, -1: off
    kv_transport: str = "tcp"
    redis_url: str | None = None  # None: no registration (tests, single process)
    redis_prefix: str = "pdserve:"
    heartbeat_seconds: float = 1.0
    ttl_seconds: float = 5.0
    worker_id: str | None = None
    cluster_token: str | None = None
    lease_seconds: float = 5.0  # prefill: pinned blocks are freed this long after the answer
    pull_timeout_seconds: float = 10.0  # decode: a pull taking longer counts as failed
    on_pull_failure: str = "recompute"  # decode: "recompute" the prompt locally, or "fail"
    verify_checksums: bool = True
    max_pending_requests: int = 256  # requests admitted but not finished; more get UNAVAILABLE
    drain_seconds: float = 30.0  # SIGTERM: how long in-flight requests may take to finish
    trace_file: str | None = None  # append finished spans here as JSON lines
    otlp_endpoint: str | None = None  # export spans with OTLP/gRPC to this collector
    kv_faults: str | None = None  # fault injection on served KV pulls, "drop=0.1,corrupt=0.1"

    def __post_init__(self) -> None:
        if self.role not in ROLES:
            raise ValueError(f"role must be one of {ROLES}, got {self.role!r}")
        if self.on_pull_failure not in ("recompute", "fail"):
            raise ValueError(
                f"on_pull_failure must be 'recompute' or 'fail', got {self.on_pull_failure!r}"
            )
        if self.lease_seconds <= 0:
            raise ValueError(f"lease_seconds must be > 0, got {self.lease_seconds}")

    @property
    def public_host(self) -> str:
        """The host this worker registers for its gRPC and KV addresses (resolved on each call:
        read it once)."""
        return self.advertise_host or reachable_host(self.host)
