"""Settings of one worker process (prefill, decode or colocated), built once by the CLI."""

from __future__ import annotations

import dataclasses
import ipaddress
import socket
from dataclasses import dataclass, field

from common.settings import same_setting, setting
from common.shared_settings import ClusterSettings, RegistrySettings, TracingSettings
from services.engine.config import EngineConfig

ROLES = ("prefill", "decode", "colocated")
# A decode worker's steps beside its streams compute at most this many prompt tokens (unless
# --max-prompt-tokens-beside-decodes says otherwise): one local prompt of the router's
# --local-prefill-tokens in one step, a longer one in chunks, so no stream waits for a
# 2,048-token step (on one Zen 4 core: ~0.2 s a step against ~2.5 s).
DECODE_PROMPT_TOKENS = 256
TRANSPORTS = ("tcp", "shm", "torch", "ucx")
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
    """One worker process: its role, engine, addresses, registry, leases and timeouts."""

    role: str
    engine: EngineConfig = field(default_factory=EngineConfig)
    host: str = setting("127.0.0.1", "bind address (0.0.0.0 in containers)")
    advertise_host: str | None = setting(
        None,
        "address peers use to reach this worker (none: --host, or this host's address when "
        "--host is 0.0.0.0 / ::)",
    )
    grpc_port: int = setting(0, "gRPC port (0: any free port)")
    metrics_port: int = setting(0, "Prometheus /metrics port (0: any free port, -1: off)")
    kv_transport: str = setting(
        "tcp", "how KV blocks move (shm: peers on the same host only)", choices=TRANSPORTS
    )
    redis_url: str | None = same_setting(
        RegistrySettings, "redis_url", default=None, note="none: the worker does not register"
    )
    redis_password: str | None = same_setting(RegistrySettings, "redis_password")
    redis_prefix: str = same_setting(RegistrySettings, "redis_prefix")
    heartbeat_seconds: float = setting(1.0, "seconds between registry heartbeats")
    ttl_seconds: float = same_setting(RegistrySettings, "ttl_seconds")
    worker_id: str | None = setting(None, "this worker's id (none: role + random suffix)")
    cluster_token: str | None = same_setting(ClusterSettings, "cluster_token")
    insecure: bool = same_setting(ClusterSettings, "insecure")
    lease_seconds: float = setting(
        5.0, "prefill: pinned KV blocks are freed this long after the answer unless renewed"
    )
    pull_timeout_seconds: float = setting(10.0, "decode: a KV pull taking longer has failed")
    lease_renew_seconds: float = setting(
        1.0,
        "decode: while a request waits for room to pull its KV, renew the prefill worker's "
        "lease this often (keep it well under the prefill workers' --lease-seconds)",
    )
    on_pull_failure: str = setting(
        "recompute",
        "decode: after a failed pull, compute the prompt here (recompute) or fail the request",
        choices=("recompute", "fail"),
    )
    verify_checksums: bool = setting(
        True, "decode: verify the checksums of pulled KV blocks", flag="--no-verify-checksums"
    )
    max_pending_requests: int = setting(
        256, "requests admitted but not finished, at most; more are refused (UNAVAILABLE)"
    )
    drain_seconds: float = setting(
        30.0, "on SIGTERM: how long in-flight requests may take to finish"
    )
    trace_file: str | None = same_setting(TracingSettings, "trace_file")
    otlp_endpoint: str | None = same_setting(TracingSettings, "otlp_endpoint")
    step_log: str | None = same_setting(TracingSettings, "step_log")
    kv_faults: str | None = setting(
        None, "testing only: fail served KV pulls on purpose, e.g. 'drop=0.1,corrupt=0.1'"
    )
    simulate: str | None = setting(
        None,
        "run a simulated worker: no weights, the step and KV-transfer times of this profile (a "
        "JSON file, or the name of one in benchmarks/profiles, e.g. sim-h100-llama3-8b) and "
        "deterministic tokens; KV moves over tcp (docs/simulation.md)",
    )
    simulated_workers: int = setting(
        1,
        "with --simulate: how many simulated workers this one process hosts, each with its own "
        "worker id and registry record; the first takes --grpc-port and --metrics-port, the "
        "others any free ports",
    )

    def __post_init__(self) -> None:
        if self.role not in ROLES:
            raise ValueError(f"role must be one of {ROLES}, got {self.role!r}")
        if self.on_pull_failure not in ("recompute", "fail"):
            raise ValueError(
                f"on_pull_failure must be 'recompute' or 'fail', got {self.on_pull_failure!r}"
            )
        if self.lease_seconds <= 0:
            raise ValueError(f"lease_seconds must be > 0, got {self.lease_seconds}")
        if self.simulate is not None and self.kv_transport != "tcp":
            raise ValueError("a simulated worker moves its KV over tcp (--kv-transport tcp)")
        if self.simulated_workers < 1:
            raise ValueError(f"simulated_workers must be >= 1, got {self.simulated_workers}")
        if self.simulated_workers > 1 and self.simulate is None:
            raise ValueError("--simulated-workers hosts simulated workers: give --simulate too")

    @property
    def role_engine(self) -> EngineConfig:
        """The engine's settings with this role's defaults (``DECODE_PROMPT_TOKENS``)."""
        scheduler = self.engine.scheduler
        if self.role != "decode" or scheduler.max_prompt_tokens_beside_decodes is not None:
            return self.engine
        capped = dataclasses.replace(
            scheduler, max_prompt_tokens_beside_decodes=DECODE_PROMPT_TOKENS
        )
        return dataclasses.replace(self.engine, scheduler=capped)

    @property
    def public_host(self) -> str:
        """The host this worker registers for its gRPC and KV addresses (resolved on each call:
        read it once)."""
        return self.advertise_host or reachable_host(self.host)
