"""Where the registry lives (`RegistryConfig`), a Redis client with bounded waits (`connect`),
and one line for any Redis failure (`describe_error`), without the password."""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable
from dataclasses import dataclass, field
from typing import Any, TypeVar
from urllib.parse import urlsplit, urlunsplit

import redis.asyncio as aioredis
from redis.asyncio.retry import Retry
from redis.backoff import NoBackoff
from redis.exceptions import AuthenticationError, RedisError

REDIS_ERRORS: tuple[type[BaseException], ...] = (RedisError, OSError, asyncio.TimeoutError)
_T = TypeVar("_T")


class RegistryError(RuntimeError):
    """Registering with Redis failed (unreachable, wrong password, ...); the message says why."""


@dataclass(frozen=True)
class RegistryConfig:
    """Where the registry lives and how fast it reacts; built once at the entry point."""

    redis_url: str = "redis://127.0.0.1:6379/0"
    password: str | None = field(default=None, repr=False)  # else the URL's, if any
    prefix: str = "pdserve:"
    ttl_seconds: float = 5.0
    heartbeat_seconds: float = 1.0
    socket_timeout_seconds: float = 1.0
    connect_timeout_seconds: float = 1.0
    max_backoff_seconds: float = 2.0
    max_prefix_hashes: int = 65_536
    # Workers sign their record with it; views list only records signed with it (None: neither).
    cluster_token: str | None = field(default=None, repr=False)

    def __post_init__(self) -> None:
        if not 0 < self.heartbeat_seconds < self.ttl_seconds:
            raise ValueError(
                f"need 0 < heartbeat_seconds ({self.heartbeat_seconds}) "
                f"< ttl_seconds ({self.ttl_seconds})"
            )

    @property
    def ttl_ms(self) -> int:
        return max(1, int(self.ttl_seconds * 1000))

    @property
    def command_timeout_seconds(self) -> float:
        """Upper bound for one Redis call or pipeline, reconnect included."""
        return 2 * (self.socket_timeout_seconds + self.connect_timeout_seconds)

    @property
    def redacted_url(self) -> str:
        """``redis_url`` with the password replaced by ``***`` (for logs and errors)."""
        return redact_url(self.redis_url)

    def worker_key(self, worker_id: str) -> str:
        return f"{self.prefix}worker:{worker_id}"

    def prefix_key(self, worker_id: str) -> str:
        return f"{self.prefix}prefix:{worker_id}"

    @property
    def index_key(self) -> str:
        return f"{self.prefix}workers"


def redact_url(url: str) -> str:
    parts = urlsplit(url)
    if parts.password is None:
        return url
    host = parts.hostname or ""
    host = f"[{host}]" if ":" in host else host
    netloc = f"{parts.username or ''}:***@{host}" + (f":{parts.port}" if parts.port else "")
    return urlunsplit(parts._replace(netloc=netloc))


def connect(config: RegistryConfig) -> aioredis.Redis:
    """An asyncio Redis client with bounded timeouts and one immediate retry (a new connection)."""
    options: dict[str, Any] = {"password": config.password} if config.password else {}
    client: aioredis.Redis = aioredis.Redis.from_url(
        config.redis_url,
        **options,
        decode_responses=True,
        encoding_errors="replace",  # a value that is not UTF-8 fails validation, not the read
        socket_timeout=config.socket_timeout_seconds,
        socket_connect_timeout=config.connect_timeout_seconds,
        retry=Retry(NoBackoff(), 1),
    )
    return client


def describe_error(exc: BaseException, config: RegistryConfig) -> str:
    """One line saying what went wrong talking to Redis, without the password."""
    text = str(exc) or type(exc).__name__
    url = config.redacted_url
    if isinstance(exc, AuthenticationError) or text.startswith(("NOAUTH", "WRONGPASS")):
        return (
            f"Redis at {url} rejected authentication ({text}); "
            "give it as PDSERVE_REDIS_PASSWORD, --redis-password-file, or in the URL: "
            "redis://:PASSWORD@HOST:PORT/0"
        )
    if isinstance(exc, asyncio.TimeoutError):
        return f"Redis at {url} did not answer within {config.command_timeout_seconds:.1f}s"
    what = "unavailable" if isinstance(exc, REDIS_ERRORS) else "call failed"
    return f"Redis at {url} {what}: {type(exc).__name__}: {text}"


async def bounded(awaitable: Awaitable[_T], config: RegistryConfig) -> _T:
    """``awaitable``, given at most the config's command timeout (asyncio.TimeoutError)."""
    return await asyncio.wait_for(awaitable, config.command_timeout_seconds)
