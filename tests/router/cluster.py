"""Real pdserve clusters for the gateway tests: real Redis, real workers, a real router process
serving real HTTP, driven with the official ``openai`` client."""

from __future__ import annotations

import json
import re
import time
import urllib.error
import urllib.request
import uuid
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

from openai import OpenAI

from services.worker.launcher import WorkerProcess
from tests.services.workers import SMALL, metric, stop_all

MODEL = "SmolLM2-135M-Instruct"
# The gateway tests exercise the disaggregated flow: every prompt through a prefill worker
# (tests/router/test_disaggregation.py covers the conditional default, which a later flag
# overrides).
ROUTER_ARGS = ["--port", "0", "--ttl-seconds", "2", "--disaggregation", "always"]


@dataclass
class Cluster:
    """Workers and routers sharing one Redis key prefix."""

    redis_url: str
    prefix: str = field(default_factory=lambda: f"t{uuid.uuid4().hex[:8]}:")
    workers: list[WorkerProcess] = field(default_factory=list)
    routers: list[WorkerProcess] = field(default_factory=list)
    owns_workers: bool = True  # False: a module's view of the shared pair (``pd_pair``)

    def worker_args(self, *extra: str) -> list[str]:
        return ["--redis-url", self.redis_url, "--redis-prefix", self.prefix, *extra]

    def add_workers(self, *roles: str, extra: tuple[str, ...] = ()) -> list[WorkerProcess]:
        """Start workers of ``roles`` together (their model loads overlap) and wait for all."""
        started = [WorkerProcess(r, [*SMALL, *self.worker_args(*extra)]) for r in roles]
        for w in started:
            w.spawn()
        for w in started:
            self.workers.append(w)
            w.wait_ready()
        return started

    def add_router(self, *extra: str) -> Router:
        args = [*ROUTER_ARGS, *self.worker_args(*extra)]
        process = WorkerProcess("router", args)
        self.routers.append(process)
        process.start()
        return Router(process)

    def with_own_routers(self) -> Cluster:
        """These workers (and their prefix) with a list of routers of its own: ``stop()`` stops
        those routers and leaves the workers running (a test module's view of ``pd_pair``)."""
        return Cluster(self.redis_url, self.prefix, list(self.workers), owns_workers=False)

    def stop(self) -> None:
        """SIGTERM to the routers, then to every worker at once: each drains in ~2 s on 2 cores,
        together rather than one after another."""
        stop_all(self.routers)
        stop_all(self.workers if self.owns_workers else [])

    def dump(self) -> None:
        for process in [*self.routers, *self.workers]:
            print(f"--- {process.role} {process.info.get('worker_id', '')} ---")
            print(process.output_tail())


@dataclass
class Router:
    process: WorkerProcess

    @property
    def url(self) -> str:
        return str(self.process.info["url"])

    def client(self, api_key: str = "unused", **kwargs: Any) -> OpenAI:
        return OpenAI(base_url=self.url + "/v1", api_key=api_key, max_retries=0, **kwargs)

    def get(self, path: str, headers: dict[str, str] | None = None) -> tuple[int, Any]:
        request = urllib.request.Request(self.url + path, headers=headers or {})
        try:
            with urllib.request.urlopen(request, timeout=10) as response:
                body = response.read()
                status = response.status
        except urllib.error.HTTPError as exc:
            body, status = exc.read(), exc.code
        try:
            return status, json.loads(body)
        except ValueError:
            return status, body.decode()

    def wait_ready(self, num_workers: int | None = None, timeout: float = 30.0) -> None:
        """Until /ready is 200 (and the view holds ``num_workers`` healthy workers)."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            status, _ = self.get("/ready")
            if status == 200 and (num_workers is None or self.num_healthy() == num_workers):
                return
            time.sleep(0.1)
        raise TimeoutError(f"router not ready: {self.get('/ready')} {self.get('/v1/workers')}")

    def num_healthy(self) -> int:
        _, body = self.get("/v1/workers")
        return sum(1 for w in body["data"] if w["healthy"])

    def metric(self, name: str, labels: str = "") -> float:
        """One sample of the router's own /metrics (0 when absent)."""
        text = urllib.request.urlopen(self.url + "/metrics", timeout=5).read().decode()
        label = r"\{" + re.escape(labels) + r"\}" if labels else ""
        match = re.search(rf"^{re.escape(name)}{label} (\S+)$", text, re.MULTILINE)
        return float(match.group(1)) if match else 0.0


def blocks_in_use(worker: WorkerProcess) -> float:
    """KV blocks held by live requests, pins and reservations (the worker's own /metrics)."""
    return metric(worker, "pdserve_kv_blocks", 'state="used"')


def wait_until(predicate, timeout: float = 10.0, interval: float = 0.1) -> bool:  # type: ignore[no-untyped-def]
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():
            return True
        time.sleep(interval)
    return bool(predicate())


@contextmanager
def cluster(
    redis_url: str, roles: tuple[str, ...], *router_args: str
) -> Iterator[tuple[Cluster, Router]]:
    """Workers of ``roles`` and one router, stopped afterwards (outputs printed on failure)."""
    c = Cluster(redis_url)
    try:
        c.add_workers(*roles)
        router = c.add_router(*router_args)
        router.wait_ready(num_workers=len(roles))
        yield c, router
    except BaseException:
        c.dump()
        raise
    finally:
        c.stop()


@contextmanager
def own_routers(pair: Cluster) -> Iterator[Cluster]:
    """A test module's routers in front of ``pair`` (the shared prefill + decode workers):
    they stop at the end, and every KV block of the pair must be back by then (the next module
    starts from the same baseline); the processes' output is printed on failure."""
    c = pair.with_own_routers()
    try:
        yield c
        prefill, decode = c.workers
        assert wait_until(lambda: blocks_in_use(decode) == 0 and blocks_in_use(prefill) == 0), (
            f"blocks leaked: prefill {blocks_in_use(prefill)}, decode {blocks_in_use(decode)}"
        )
    except BaseException:
        c.dump()
        raise
    finally:
        c.stop()


def spawn_workers(c: Cluster, *roles: str) -> list[WorkerProcess]:
    """Like ``Cluster.add_workers`` without waiting: ``wait_ready()`` each one later, so that
    routers can start while the workers load their model."""
    started = [WorkerProcess(r, [*SMALL, *c.worker_args()]) for r in roles]
    for w in started:
        w.spawn()
        c.workers.append(w)
    return started


def spawn_router(c: Cluster, *extra: str) -> Router:
    """Like ``Cluster.add_router`` without waiting: ``router.process.wait_ready()`` later."""
    args = [*ROUTER_ARGS, *c.worker_args(*extra)]
    process = WorkerProcess("router", args)
    c.routers.append(process)
    process.spawn()
    return Router(process)
