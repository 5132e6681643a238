"""Settings more than one component reads, each declared once, here.

The router and the workers (and `pdserve up`) take these fields into their own configs with
``same_setting`` (``common.settings``), so every one keeps the same flag, ``PDSERVE_*`` variable,
help and default: ``redis_url: str = same_setting(RegistrySettings, "redis_url")``. They stay
flat fields of those configs (``config.redis_url``), not nested ones; a component adds to the
help what it alone does with a setting, or gives it another default.

These classes are where the declarations live; the components never build them.
"""

from __future__ import annotations

from dataclasses import dataclass

from common.settings import secret, setting


@dataclass(frozen=True)
class RegistrySettings:
    """The Redis registry the workers register in and the router watches (services.registry)."""

    redis_url: str = setting(
        "redis://127.0.0.1:6379/0", "the registry (redis://[:PASSWORD@]HOST:PORT/DB)"
    )
    redis_password: str | None = secret("the Redis password", "--redis-password-file")
    redis_prefix: str = setting("pdserve:", "namespace of the registry's keys")
    ttl_seconds: float = setting(
        5.0, "seconds a worker's registry record outlives its last heartbeat"
    )


@dataclass(frozen=True)
class ClusterSettings:
    """The internal plane's authentication: the token every router and worker shares."""

    cluster_token: str | None = secret(
        "the shared secret of router and workers", "--cluster-token-file"
    )
    insecure: bool = setting(
        False,
        "run the internal plane (gRPC, KV transfer) without a cluster token (anyone who "
        "reaches it may use it)",
    )


@dataclass(frozen=True)
class TracingSettings:
    """Where a component's OpenTelemetry spans go (common.tracing); none: tracing is off. And
    where a worker's engine steps go (services/worker/step_log.py; `pdserve up` hands it on)."""

    trace_file: str | None = setting(
        None, "append finished OpenTelemetry spans to this file as JSON lines"
    )
    otlp_endpoint: str | None = setting(
        None,
        "export spans with OTLP/gRPC to this collector",
        fallback_env="OTEL_EXPORTER_OTLP_ENDPOINT",
    )
    step_log: str | None = setting(
        None,
        "append one JSON line per engine step to this file: when it computed and what it held "
        "(services/worker/step_log.py)",
    )
