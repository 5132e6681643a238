"""What `pdserve up` starts (`UpConfig`): its own settings, the router's and the engine's it
hands to those components, and the command line of each."""

from __future__ import annotations

import os
import time
from dataclasses import dataclass, field, replace
from pathlib import Path

from common.settings import same_setting, setting, shared_with, to_flags
from common.shared_settings import ClusterSettings, TracingSettings
from router.config import RouterConfig
from services.engine.config import EngineConfig, default_num_threads
from services.worker.config import TRANSPORTS

# Router settings `up` decides itself (addresses, the registry, tracing, secrets) or hands over
# otherwise (the API key goes by environment, not by a flag visible in `ps`).
ROUTER_OWN = (
    "host",
    "port",
    "redis_url",
    "redis_password",
    "redis_prefix",
    "trace_file",
    "otlp_endpoint",
    "cluster_token",
    "insecure",
)
# The router's settings that are the engine's (the model, its cache, the context length): given
# to `up` once, as engine settings, and handed to the router as well as to the workers.
ROUTER_FROM_ENGINE = shared_with(RouterConfig, EngineConfig)
ROUTER_SKIP = (*ROUTER_OWN, *ROUTER_FROM_ENGINE)  # no flags of their own in `up`


@dataclass(frozen=True)
class UpConfig:
    """What `pdserve up` starts; its own settings, plus the router's and the engine's settings it
    hands to those components. Built once from the command line."""

    prefill: int | None = setting(None, "prefill workers (none: 1, or 0 with --colocated)")
    decode: int | None = setting(None, "decode workers (none: 1, or 0 with --colocated)")
    colocated: int = setting(
        0, "colocated workers instead of prefill + decode (the flag alone: 1)", const=1
    )
    host: str = setting(
        "127.0.0.1",
        "the router's bind address (0.0.0.0: every interface); Redis and the workers stay on "
        "127.0.0.1",
    )
    port: int = setting(8000, "the router's HTTP port (0: any free port)")
    transport: str = setting("tcp", "the workers' KV transport", choices=TRANSPORTS)
    threads: int | None = setting(
        None, "torch threads per worker (none: the cores split between the workers)"
    )
    ready_timeout: float = setting(180.0, "seconds to wait for the router's /ready")
    restart: bool = setting(False, "restart a component that exits, with a growing backoff")
    insecure: bool = same_setting(ClusterSettings, "insecure", note="and Redis without a password")
    trace_file: str | None = same_setting(
        TracingSettings, "trace_file", note="one file for every component"
    )
    step_log: str | None = same_setting(
        TracingSettings, "step_log", note="one file for every worker"
    )
    verbose: bool = setting(False, "show every component's log lines here, not in --log-file")
    log_file: str | None = setting(
        None, "where the components' log lines go (none: ~/.cache/pdserve/logs/up-TIME.log)"
    )
    simulate: str | None = setting(
        None,
        "simulated workers with this profile (docs/simulation.md): one process per role hosts "
        "all of that role's workers, so --prefill 16 --decode 48 fits on 2 cores",
    )
    engine: EngineConfig = field(default_factory=EngineConfig)
    router: RouterConfig = field(default_factory=RouterConfig)

    def __post_init__(self) -> None:
        if self.colocated < 0:
            raise ValueError(f"--colocated must be >= 0, got {self.colocated}")
        if self.colocated and (self.prefill or self.decode):
            raise ValueError("--colocated replaces --prefill/--decode: give one or the other")
        for name in ("num_prefill", "num_decode"):
            value = getattr(self, name)
            if not self.colocated and value < 1:
                flag = "--" + name.removeprefix("num_")
                raise ValueError(f"{flag} must be >= 1 (or use --colocated), got {value}")
        if not 0 <= self.port <= 65535:
            raise ValueError(f"--port must be in 0..65535, got {self.port}")
        if self.threads is not None and self.threads < 1:
            raise ValueError(f"--threads must be >= 1, got {self.threads}")
        if self.ready_timeout <= 0:
            raise ValueError(f"--ready-timeout must be > 0, got {self.ready_timeout}")
        if self.simulate is not None and self.transport != "tcp":
            raise ValueError("simulated workers move their KV over tcp (--transport tcp)")

    @property
    def num_prefill(self) -> int:
        return 0 if self.colocated else (1 if self.prefill is None else self.prefill)

    @property
    def num_decode(self) -> int:
        return 0 if self.colocated else (1 if self.decode is None else self.decode)

    @property
    def counts(self) -> dict[str, int]:
        """Workers per role."""
        return {"prefill": self.num_prefill, "decode": self.num_decode, "colocated": self.colocated}

    @property
    def workers(self) -> list[tuple[str, str]]:
        """(role, name) of every worker process: prefill-0.., decode-0.. or colocated-0..;
        simulated: one per role (prefill-x16: sixteen workers in one process)."""
        if self.simulate is not None:
            return [(role, f"{role}-x{n}") for role, n in self.counts.items() if n]
        return [(role, f"{role}-{i}") for role, n in self.counts.items() for i in range(n)]

    def role_args(self, role: str) -> list[str]:
        """Flags of one role's worker processes beyond ``worker_args``: a simulated pool's."""
        if self.simulate is None:
            return []
        return ["--simulate", self.simulate, "--simulated-workers", str(self.counts[role])]

    @property
    def threads_per_worker(self) -> int:
        """--threads, else the cores split evenly (oversubscribed torch pools run much slower)."""
        if self.threads is not None:
            return self.threads
        if self.simulate is not None:  # simulated steps compute nothing
            return 1
        return max(1, default_num_threads() // len(self.workers))

    def worker_args(self, redis_url: str) -> list[str]:
        """Command-line flags of every worker: addresses, transport, threads, and every engine
        setting given to `up` (the rest keep the workers' own defaults)."""
        args = ["--host", "127.0.0.1", "--redis-url", redis_url]
        args += ["--kv-transport", self.transport, "--threads", str(self.threads_per_worker)]
        args += to_flags(self.engine, skip=("num_threads",))
        if self.step_log:
            args += ["--step-log", os.path.abspath(self.step_log)]
        return args + self._trace_args()

    def _trace_args(self) -> list[str]:
        """One file for every component, wherever each one runs from."""
        return ["--trace-file", os.path.abspath(self.trace_file)] if self.trace_file else []

    def router_args(self, redis_url: str, port: int | None = None) -> list[str]:
        """Command-line flags of the router (the API key goes by environment, not in `ps`);
        ``port`` replaces ``--port`` (a restarted router keeps the port it had)."""
        port = self.port if port is None else port
        args = ["--host", self.host, "--port", str(port), "--redis-url", redis_url]
        router = replace(self.router, **{n: getattr(self.engine, n) for n in ROUTER_FROM_ENGINE})
        args += to_flags(router, skip=(*ROUTER_OWN, "api_key"))
        return args + self._trace_args()


def default_log_path(cache_dir: Path) -> Path:
    """Where a quiet `pdserve up` writes its components' log lines."""
    return cache_dir / "logs" / f"up-{time.strftime('%Y%m%d-%H%M%S')}.log"
