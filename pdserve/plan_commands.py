"""The commands that run a ``pdserve plan`` layout: ``pdserve up``, Docker Compose, Kubernetes.

Pure functions (no I/O): a :class:`~pdserve.plan.Deployment` and the router's settings in,
command lines out. The names are the real ones, and tests/test_plan.py checks each against its
source: ``pdserve up``'s flags (its parser), docker-compose.yml's services and the variables it
hands to them, and k8s/base's autoscalers, Deployments and ConfigMap.

- ``pdserve up``: the pools (``--prefill``/``--decode`` or ``--colocated``), ``--threads``, and
  the router's settings as flags.
- Compose: ``--scale`` of the ``prefill`` and ``decode`` services; the threads and the router's
  settings as ``PDSERVE_*`` variables of the shell, which docker-compose.yml passes on. It has
  no colocated service.
- Kubernetes: each pool's autoscaler pinned to the size (min = max replicas; the Deployments
  set no ``replicas``, see k8s/README.md), the CPU request (a worker runs as many threads as
  it requests cores), and the router's settings in the ``pdserve-config`` ConfigMap, read at
  the router's restart. It has no colocated Deployment either.
"""

from __future__ import annotations

import json
import shlex

from common.settings import env_name
from pdserve.plan import SLO, Deployment, DisaggregationThresholds

K8S_NAMESPACE = "pdserve"
K8S_CONFIG_MAP = "pdserve-config"
K8S_ROUTER = "router"


def router_flags(
    deployment: Deployment, slo: SLO, thresholds: DisaggregationThresholds | None
) -> list[str]:
    """The router's settings for ``deployment``: the per-request disaggregation thresholds (a
    layout with a prefill pool) and the SLOs, so that its ``/metrics`` report their attainment."""
    flags = thresholds.router_flags() if deployment.is_disaggregated and thresholds else []
    return [*flags, "--ttft-slo-seconds", f"{slo.ttft_s:g}", "--itl-slo-seconds", f"{slo.tpot_s:g}"]


def flag_values(flags: list[str]) -> dict[str, str]:
    """``["--a", "1", "--b", "2"]`` as ``{"PDSERVE_A": "1", "PDSERVE_B": "2"}``."""
    return {env_name(flag): value for flag, value in zip(flags[::2], flags[1::2])}


def up_command(deployment: Deployment, flags: list[str]) -> str:
    """``pdserve up`` with the pools, their threads and the router's ``flags``."""
    d = deployment
    if d.is_disaggregated:
        pools = ["--prefill", str(d.num_prefill), "--decode", str(d.num_decode)]
    else:
        pools = ["--colocated", str(d.num_colocated)]
    return shlex.join(["pdserve", "up", *pools, "--threads", str(d.threads), *flags])


def compose_command(deployment: Deployment, flags: list[str]) -> str:
    """``docker compose up`` scaling the two pools (a disaggregated ``deployment`` only)."""
    d = deployment
    if not d.is_disaggregated:
        raise ValueError("docker-compose.yml has no colocated service")
    env = {"PDSERVE_THREADS": str(d.threads), **flag_values(flags)}
    assignments = [f"{k}={shlex.quote(v)}" for k, v in env.items()]
    scale = ["--scale", f"prefill={d.num_prefill}", "--scale", f"decode={d.num_decode}"]
    return " ".join([*assignments, shlex.join(["docker", "compose", "up", "-d", *scale])])


def kubectl(*args: str) -> str:
    return shlex.join(["kubectl", "-n", K8S_NAMESPACE, *args])


def k8s_commands(deployment: Deployment, flags: list[str]) -> list[str]:
    """``kubectl`` lines that size the pools of a disaggregated ``deployment`` and give the
    router its settings."""
    d = deployment
    if not d.is_disaggregated:
        raise ValueError("k8s/ has no colocated Deployment")
    lines = []
    for pool, replicas in (("prefill", d.num_prefill), ("decode", d.num_decode)):
        size = {"spec": {"minReplicas": replicas, "maxReplicas": replicas}}
        lines.append(kubectl("patch", "hpa", pool, "-p", json.dumps(size)))
    lines.append(
        kubectl(
            "set",
            "resources",
            "deployment/prefill",
            "deployment/decode",
            f"--requests=cpu={d.threads}",
        )
    )
    data = {"data": flag_values(flags)}
    lines.append(kubectl("patch", "configmap", K8S_CONFIG_MAP, "-p", json.dumps(data)))
    lines.append(kubectl("rollout", "restart", f"deployment/{K8S_ROUTER}"))
    return lines
