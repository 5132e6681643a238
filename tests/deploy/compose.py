"""What the real compose tests share: Docker's presence, commands that fail loudly, polling
with a deadline, and one Compose project of docker-compose.yml on free host ports, started
(images built first: Docker's layer cache makes that fast the second time) and taken down."""

from __future__ import annotations

import json
import os
import secrets
import shutil
import subprocess
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from services.redis_server import free_port

ROOT = Path(__file__).resolve().parents[2]
BASE_IMAGE = "pdserve-base:bookworm"


def docker_unavailable() -> str | None:
    """Why the real compose test cannot run here, or None."""
    if shutil.which("docker") is None or shutil.which("docker-compose") is None:
        return "docker and docker-compose are not on PATH (make test-compose installs them)"
    info = subprocess.run(["docker", "info"], capture_output=True, text=True, check=False)
    if info.returncode != 0:
        return "no Docker engine answers (make test-compose starts dockerd)"
    return None


def run(*argv: str, env: dict[str, str] | None = None, timeout: float = 120) -> str:
    """Run a command, fail the test with its output if it fails, return its stdout."""
    proc = subprocess.run(
        argv, cwd=ROOT, env=env, capture_output=True, text=True, timeout=timeout, check=False
    )
    assert proc.returncode == 0, f"{' '.join(argv)}: {proc.stdout[-3000:]}{proc.stderr[-3000:]}"
    return proc.stdout


def get_json(url: str) -> Any:
    with urllib.request.urlopen(url, timeout=10) as response:
        return json.loads(response.read())


def wait_for(what: str, check: Callable[[], bool], timeout: float, interval: float = 1.0) -> float:
    """Poll ``check`` until it is true; return the seconds it took."""
    started = time.monotonic()
    while True:
        try:
            if check():
                return time.monotonic() - started
        except OSError:
            pass  # not listening yet
        if time.monotonic() - started > timeout:
            raise AssertionError(f"timed out after {timeout:.0f}s waiting for {what}")
        time.sleep(interval)


@dataclass
class Stack:
    """One Compose project of docker-compose.yml, on free host ports."""

    project: str
    env: dict[str, str]
    router_port: int
    prometheus_port: int
    down_done: bool = False

    def compose(self, *args: str, timeout: float = 300) -> str:
        return run("docker-compose", "-p", self.project, *args, env=self.env, timeout=timeout)

    @property
    def api(self) -> str:
        return f"http://127.0.0.1:{self.router_port}/v1"

    def ready(self) -> bool:
        """The router's /ready: a compatible prefill + decode pair is registered and alive."""
        url = self.api.removesuffix("/v1") + "/ready"
        try:
            with urllib.request.urlopen(url, timeout=5) as response:
                return response.status == 200
        except urllib.error.HTTPError:
            return False

    def workers(self) -> list[dict[str, Any]]:
        return get_json(self.api + "/workers")["data"]  # type: ignore[no-any-return]

    def healthy(self, role: str) -> list[dict[str, Any]]:
        return [w for w in self.workers() if w["role"] == role and w["healthy"]]

    def containers(self, service: str) -> list[str]:
        return self.compose("ps", "-q", service).split()

    def take_down(self) -> dict[str, list[str]]:
        """``down -v``; what of the project is left afterwards (nothing, when all is well)."""
        assert any(self.leftovers().values())  # the project is up before
        self.compose("down", "-v", "--remove-orphans", timeout=180)
        self.down_done = True
        return self.leftovers()

    def leftovers(self) -> dict[str, list[str]]:
        label = f"label=com.docker.compose.project={self.project}"
        return {
            kind: run("docker", kind, "ls", "-q", "--filter", label, *extra).split()
            for kind, extra in (("container", ["-a"]), ("network", []), ("volume", []))
        }

    def logs(self, *services: str, tail: int = 40) -> str:
        """The last ``tail`` lines of each of ``services`` (all: none named)."""
        proc = subprocess.run(
            ["docker-compose", "-p", self.project, "logs", "--no-color", "--tail", str(tail)]
            + list(services),
            cwd=ROOT,
            env=self.env,
            capture_output=True,
            text=True,
            check=False,
        )
        return proc.stdout[-12000:]


@contextmanager
def started_stack(
    secrets_dir: Path, extra_env: dict[str, str] | None = None, up_args: tuple[str, ...] = ()
) -> Iterator[Stack]:
    """A Compose project of docker-compose.yml (``extra_env`` over the test's defaults, ``up -d
    *up_args``), ready once the router's /ready answers; taken down (``-v``) on the way out
    unless a test did it."""
    for name in ("cluster-token", "redis-password"):
        path = secrets_dir / name
        path.write_text(secrets.token_hex(32))
        path.chmod(0o644)  # bind-mounted into containers that run as a non-root user
    env = {
        **os.environ,
        "PDSERVE_BASE_IMAGE": os.environ.get("PDSERVE_BASE_IMAGE", BASE_IMAGE),
        "PDSERVE_SECRETS_DIR": str(secrets_dir),
        "PDSERVE_ROUTER_PORT": str(free_port()),
        "PDSERVE_PROMETHEUS_PORT": str(free_port()),
        "PDSERVE_THREADS": "1",  # four workers share this machine's cores
        "PDSERVE_KV_CACHE_MEMORY": "128M",
        **(extra_env or {}),
    }
    started = time.monotonic()
    run(str(ROOT / "docker" / "build-images.sh"), env=env, timeout=1800)
    print(f"images built in {time.monotonic() - started:.0f}s")
    system = Stack(
        project=f"pdserve-test-{secrets.token_hex(3)}",
        env=env,
        router_port=int(env["PDSERVE_ROUTER_PORT"]),
        prometheus_port=int(env["PDSERVE_PROMETHEUS_PORT"]),
    )
    try:
        system.compose("up", "-d", *up_args)
        wait_for("the router's /ready", system.ready, timeout=300)
        yield system
    except BaseException:
        print(system.logs())
        raise
    finally:
        if not system.down_done:
            system.compose("down", "-v", "--remove-orphans", timeout=180)
