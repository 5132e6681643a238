"""docker-compose.yml run for real: images built, containers started, requests served.

Runs where a Docker engine answers and ``docker-compose`` is on PATH (``make test-compose``
installs both from Debian and starts ``dockerd``); skips with the reason otherwise. The images
are built by ``docker/build-images.sh`` from a local Debian base, no registry needed; Docker's
layer cache makes a second run fast (cold and warm timings: docs/deploy.md).

One Compose project for the module, tests in order:
1. chat and text completions through the router with the official ``openai`` client, and
   Prometheus scraping the router and every worker with pdserve's rules loaded;
2. ``--scale prefill=2 --scale decode=2`` while requests flow: none fails;
3. a prefill container killed (SIGKILL from the host, like the OOM killer) while requests flow:
   none fails (the decode worker retries on the other prefill), the registry drops the dead
   worker, and Compose's restart policy brings the container back;
4. a rolling restart of each worker pool (every container in turn, SIGTERM and drain) while
   requests flow: none fails;
5. a rolling restart of the router, twice, inside its container (SIGUSR1 to its keeper: a new
   router on the same listening socket, then the old one drains) while requests flow: none
   fails;
6. ``down -v`` leaves no container, network or volume of the project behind.
"""

from __future__ import annotations

import functools
import subprocess
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass, field

import pytest
from openai import OpenAI

from tests.deploy.compose import Stack, docker_unavailable, get_json, run, started_stack, wait_for

pytestmark = [
    pytest.mark.compose,
    pytest.mark.skipif(docker_unavailable() is not None, reason=str(docker_unavailable())),
]


@dataclass
class Traffic:
    """Requests in a loop on ``threads`` threads, each a short chat completion; counts outcomes."""

    client: OpenAI
    model: str
    threads: int = 2
    ok: int = 0
    errors: list[str] = field(default_factory=list)
    _stop: threading.Event = field(default_factory=threading.Event)
    _workers: list[threading.Thread] = field(default_factory=list)
    _lock: threading.Lock = field(default_factory=threading.Lock)

    def _loop(self, index: int) -> None:
        turn = 0
        while not self._stop.is_set():
            turn += 1
            try:
                reply = self.client.chat.completions.create(
                    model=self.model,
                    messages=[{"role": "user", "content": f"Count to {index + turn}."}],
                    max_tokens=8,
                    temperature=0,
                )
                assert reply.usage is not None and reply.usage.completion_tokens >= 1
                with self._lock:
                    self.ok += 1
            except Exception as exc:  # noqa: BLE001 - every failure is a finding
                with self._lock:
                    self.errors.append(repr(exc))

    def __enter__(self) -> Traffic:
        for index in range(self.threads):
            thread = threading.Thread(target=self._loop, args=(index,), daemon=True)
            thread.start()
            self._workers.append(thread)
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        for thread in self._workers:
            thread.join(timeout=120)


@pytest.fixture(scope="module")
def stack(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Stack]:
    with started_stack(tmp_path_factory.mktemp("secrets")) as system:
        yield system


@pytest.fixture(scope="module")
def client(stack: Stack) -> OpenAI:
    return OpenAI(base_url=stack.api, api_key="unused", max_retries=0, timeout=120)


@pytest.fixture(scope="module")
def model(client: OpenAI) -> str:
    return client.models.list().data[0].id


def test_chat_and_completion_through_the_router(stack: Stack, client: OpenAI, model: str) -> None:
    chat = client.chat.completions.create(
        model=model,
        messages=[{"role": "user", "content": "What is the capital of France?"}],
        max_tokens=8,
        temperature=0,
    )
    assert chat.choices[0].message.content
    completion = client.completions.create(
        model=model, prompt="The capital of France is", max_tokens=4, temperature=0
    )
    assert completion.choices[0].text and completion.usage is not None
    assert completion.usage.completion_tokens == 4
    # The workers registered their container addresses: the router reached both over the bridge.
    assert {w["role"] for w in stack.workers() if w["healthy"]} == {"prefill", "decode"}


def test_prometheus_scrapes_every_component_with_the_rules_loaded(stack: Stack) -> None:
    prometheus = f"http://127.0.0.1:{stack.prometheus_port}/api/v1"

    def all_up() -> bool:
        targets = get_json(prometheus + "/targets")["data"]["activeTargets"]
        jobs = {t["labels"]["job"] for t in targets if t["health"] == "up"}
        return len(targets) >= 3 and all(t["health"] == "up" for t in targets) and len(jobs) >= 3

    wait_for("Prometheus targets up", all_up, timeout=120, interval=2)
    groups = get_json(prometheus + "/rules")["data"]["groups"]
    assert any(rule["type"] == "alerting" for group in groups for rule in group["rules"])
    series = get_json(prometheus + "/label/__name__/values")["data"]
    assert any(name.startswith("pdserve_router_") for name in series), series[:20]
    assert any(name.startswith("pdserve_kv_blocks") for name in series), series[:20]


def test_scaling_pools_while_requests_flow_loses_none(
    stack: Stack, client: OpenAI, model: str
) -> None:
    with Traffic(client, model) as traffic:
        time.sleep(2)
        stack.compose("up", "-d", "--no-recreate", "--scale", "prefill=2", "--scale", "decode=2")
        took = wait_for(
            "2 healthy prefill + 2 healthy decode workers",
            lambda: len(stack.healthy("prefill")) == 2 and len(stack.healthy("decode")) == 2,
            timeout=240,
        )
        time.sleep(3)  # traffic on the scaled pools
    print(f"scaled to 2+2 in {took:.0f}s; {traffic.ok} requests meanwhile")
    assert traffic.errors == [], traffic.errors[:5]
    assert traffic.ok > 0
    assert len(stack.containers("prefill")) == 2 and len(stack.containers("decode")) == 2


def test_a_killed_worker_container_loses_no_request_and_comes_back(
    stack: Stack, client: OpenAI, model: str
) -> None:
    container = stack.containers("prefill")[0]
    before = {w["id"] for w in stack.healthy("prefill")}
    assert len(before) == 2
    pid = run("docker", "inspect", "-f", "{{.State.Pid}}", container).strip()
    with Traffic(client, model) as traffic:
        time.sleep(2)
        run("kill", "-KILL", pid)  # the container's init: a crash, not a `docker stop`
        dropped = wait_for(
            "the registry to drop the killed worker",
            lambda: len(before & {w["id"] for w in stack.workers()}) == 1,
            timeout=60,
            interval=0.5,
        )
        back = wait_for(
            "the restarted prefill container to register",
            lambda: len(stack.healthy("prefill")) == 2,
            timeout=240,
        )
    print(f"dropped after {dropped:.1f}s, back after {back:.0f}s more; {traffic.ok} requests")
    restarts = run("docker", "inspect", "-f", "{{.RestartCount}}", container).strip()
    assert int(restarts) >= 1, "Compose's restart policy did not restart the container"
    assert traffic.errors == [], traffic.errors[:5]
    assert traffic.ok > 0
    assert len({w["id"] for w in stack.healthy("prefill")} - before) == 1  # a new registration


def test_a_rolling_restart_of_each_worker_pool_loses_no_request(
    stack: Stack, client: OpenAI, model: str
) -> None:
    """Each prefill and decode container in turn, while requests flow: `docker restart` stops it
    with SIGTERM (it drains: in-flight requests end, its KV handles are pulled, it deregisters),
    then starts it again; the other container of its pool serves meanwhile. None fails. (The
    router is rolled inside its container instead: the next test.)"""
    took: dict[str, float] = {}
    with Traffic(client, model) as traffic:
        for service in ("prefill", "decode"):
            for container in stack.containers(service):
                before = {w["id"] for w in stack.healthy(service)}
                assert len(before) == 2, (service, before)
                started = time.monotonic()
                run("docker", "restart", "-t", "45", container, timeout=120)
                wait_for(
                    f"the restarted {service} container to register",
                    functools.partial(replaced_one, stack, service, before),
                    timeout=240,
                )
                took[container[:12]] = time.monotonic() - started
    print(f"rolled {took} (seconds each); {traffic.ok} requests meanwhile")
    if traffic.errors:  # the router's account of its retries says where they went
        print(stack.logs("router", tail=300))
    assert traffic.errors == [], traffic.errors[:5]
    assert traffic.ok > 0


def test_a_rolling_restart_of_the_router_loses_no_request(
    stack: Stack, client: OpenAI, model: str
) -> None:
    """The router twice, in place, while requests flow: SIGUSR1 to its container's keeper
    (`pdserve router-keeper`, PID 1) starts a second router on the same listening socket, and
    once it is ready the old one drains. The published port never closes; none fails."""
    (container,) = stack.containers("router")
    took: list[float] = []
    with Traffic(client, model) as traffic:
        for turn in (1, 2):
            time.sleep(2)  # requests on the current router's connections
            started = time.monotonic()
            run("docker", "kill", "-s", "USR1", container)
            wait_for(
                f"router replacement {turn}",
                lambda turn=turn: len(router_replacements(container)) == turn,
                timeout=120,
                interval=0.5,
            )
            took.append(time.monotonic() - started)
        time.sleep(3)  # traffic on the last router while the old one finishes its drain
    replaced = router_replacements(container)
    print(f"router replaced twice ({took} s each): {replaced}; {traffic.ok} requests meanwhile")
    assert traffic.errors == [], traffic.errors[:5]
    assert traffic.ok > 0
    pids = [line.split()[-1] for line in replaced]  # "... pid A -> pid B (ready after ..)"
    assert len(set(pids)) == 2, replaced
    assert run("docker", "inspect", "-f", "{{.RestartCount}}", container).strip() == "0"
    assert stack.ready()


def router_replacements(container: str) -> list[str]:
    """The keeper's 'router replaced: pid A -> pid B' lines, "pid A -> pid B" of each."""
    proc = subprocess.run(
        ["docker", "logs", container], capture_output=True, text=True, check=True, timeout=30
    )
    lines = (proc.stdout + proc.stderr).splitlines()
    return [
        line.partition("router replaced: ")[2].partition(" (")[0]
        for line in lines
        if "router replaced: " in line
    ]


def replaced_one(stack: Stack, service: str, before: set[str]) -> bool:
    """Two healthy workers of ``service`` again, one of them new."""
    now = {w["id"] for w in stack.healthy(service)}
    return len(now) == 2 and now != before


def test_down_leaves_nothing_behind(stack: Stack) -> None:
    assert stack.take_down() == {"container": [], "network": [], "volume": []}
