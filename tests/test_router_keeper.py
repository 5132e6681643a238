"""`pdserve router-keeper` (the compose router's command): a real keeper and real routers.

SIGUSR1 replaces the router on the keeper's socket while a client asks /v1/models over 16
keep-alive connections: no request fails, and each replacement is a new router process. The
keeper exits with its router (a restart policy then applies) and drains it on SIGTERM.
"""

from __future__ import annotations

import os
import re
import secrets
import signal
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import pytest

from services.redis_server import RedisServer, free_port
from services.worker.launcher import WorkerProcess
from tests.test_rolling_restart import Hammer

REPLACED = re.compile(r"router replaced: pid (\d+) -> pid (\d+)")


@pytest.fixture
def keeper(redis_server: RedisServer, tmp_path: Path) -> Iterator[WorkerProcess]:
    args = ["--port", str(free_port()), "--redis-url", redis_server.address, "--insecure"]
    args += ["--redis-prefix", secrets.token_hex(4)]
    with open(tmp_path / "keeper.log", "w", buffering=1) as log:  # every line: access logs too
        process = WorkerProcess("router-keeper", args, echo_prefix="", echo_to=log)
        process.start(timeout=120)  # the keeper re-prints its router's ready line
        yield process
        process.kill()


def replacements(keeper: WorkerProcess) -> list[tuple[int, int]]:
    assert keeper.echo_to is not None
    text = Path(keeper.echo_to.name).read_text()
    return [(int(a), int(b)) for a, b in REPLACED.findall(text)]


def wait_until(what: str, done: object, timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while not done():  # type: ignore[operator]
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.1)


def test_sigusr1_replaces_the_router_without_a_failed_request(keeper: WorkerProcess) -> None:
    url = keeper.info["url"]
    first = keeper.info["pid"]
    hammer = Hammer(url)
    try:
        for turn in (1, 2):
            time.sleep(1)  # requests on the current router's keep-alive connections
            keeper.signal(signal.SIGUSR1)
            wait_until(
                f"replacement {turn}",
                lambda t=turn: len(replacements(keeper)) == t,
                60,
            )
        time.sleep(1)
    finally:
        hammer.stop()
    assert hammer.errors == [], hammer.errors[:5]
    assert hammer.ok > 0
    (a, b), (c, d) = replacements(keeper)
    assert (a, c) == (first, b) and len({a, b, d}) == 3, replacements(keeper)
    wait_until("the old routers to exit", lambda: not any(alive(p) for p in (a, b)), 30)
    # The router exits on its own (a crash): the keeper exits with it, 128 + SIGKILL.
    os.kill(d, signal.SIGKILL)
    assert keeper.proc is not None and keeper.proc.wait(timeout=10) == 128 + signal.SIGKILL


def test_sigterm_drains_the_router_and_exits_cleanly(keeper: WorkerProcess) -> None:
    with urllib.request.urlopen(keeper.info["url"] + "/v1/models", timeout=10) as answer:
        assert answer.status == 200
    keeper.signal(signal.SIGTERM)
    assert keeper.proc is not None and keeper.proc.wait(timeout=30) == 0, keeper.output_tail()
    assert not alive(keeper.info["pid"])


def alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True
