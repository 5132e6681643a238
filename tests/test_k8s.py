"""k8s/: the rendered manifests are valid Kubernetes objects and agree with the processes they run.

Every build (the base and each overlay) is rendered by the real kustomize, `kubectl kustomize
DIR` (kubectl ships kustomize v5; .ci/ensure-tools.sh installs kubectl where it is missing; the
tests skip, saying so, only where no kubectl can be found), then:

- every object validates against the Kubernetes OpenAPI schemas in strict mode (no unknown
  fields), offline, with the schemas the ``kubernetes-validate`` package ships; the
  prometheus-operator objects of the monitoring component (ServiceMonitor, PrometheusRule), whose
  CRD schemas that package does not have, get a structural check of their own instead;
- each HorizontalPodAutoscaler scales the Deployment of its own pool, on metrics that exist:
  worker gauges in services/worker/metrics.py, router series read from a real router's /metrics
  route, each served by a prometheus-adapter rule of k8s/README.md;
- each probe names a port the container declares, and the container's environment, parsed by
  pdserve's own CLI, makes the process listen there; HTTP probe paths are routes of the router;
- termination leaves time for the worker's drain; pods run as non-root with resource requests;
  every Deployment has a PodDisruptionBudget; the GPU overlay puts the pools on different nodes.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import re
import shutil
import subprocess
from collections.abc import Iterator
from pathlib import Path
from types import SimpleNamespace
from typing import Any
from urllib.parse import urlparse

import kubernetes_validate
import pytest
import yaml
from kubernetes_validate.utils import latest_version

from common.settings import env_name
from pdserve import cli
from services.engine.simulation_profile import SimulationProfile

ROOT = Path(__file__).resolve().parents[1]
K8S = ROOT / "k8s"
BUILDS = {
    "base": K8S / "base",
    "cpu": K8S / "overlays" / "cpu",
    "gpu": K8S / "overlays" / "gpu",
    "custom-metrics": K8S / "overlays" / "custom-metrics",
    "router-metrics": K8S / "overlays" / "router-metrics",
    "monitoring": K8S / "overlays" / "monitoring",
    "simulated": K8S / "overlays" / "simulated",
}
GPU_BUILDS = ("gpu", "custom-metrics", "router-metrics")
# Builds that scale the worker pools on pdserve's own metrics -> the HPA metric type they use.
METRIC_BUILDS = {"custom-metrics": "Pods", "router-metrics": "External"}
# Builds with the monitoring component (Prometheus Operator objects, headless worker Services).
MONITORING_BUILDS = ("monitoring",)
# API groups whose objects kubernetes-validate has no schema for (CRDs): checked structurally.
OPERATOR_GROUP = "monitoring.coreos.com"
RULES_FILE = ROOT / "monitoring" / "prometheus" / "rules.yml"
# Oldest Kubernetes the manifests promise (native gRPC probes are GA since 1.27; 1.30 is the
# oldest release still maintained upstream) and the newest the schema package ships.
K8S_VERSIONS = ("1.30", ".".join(latest_version().split(".")[:2]))
NAMESPACE = "pdserve"
POOLS = ("router", "prefill", "decode")
WORKER_ROLES = ("prefill", "decode", "colocated")
ROUTER_PROBE_PATHS = {"/health", "/ready"}
POD_IP = "10.1.2.3"  # what the downward API's status.podIP stands for here
# Pods metrics the custom-metrics HPAs use -> the worker gauge each is computed from.
DERIVED_METRICS = {"pdserve_kv_blocks_used_ratio": "pdserve_kv_blocks"}
# Router series the External HPAs use -> how the adapter must combine the router replicas'
# series: each router counts only its own requests (add them up), while a figure every router
# reads from the same registry must be taken once (a sum would count it once per replica).
ROUTER_AGGREGATION = {
    "pdserve_router_pool_requests_in_flight": "sum",
    "pdserve_router_pool_kv_blocks_used_ratio": "max",
}
Series = tuple[str, frozenset[tuple[str, str]]]  # a sample's name and labels
Object = dict[str, Any]


KUBECTL = os.environ.get("KUBECTL") or shutil.which("kubectl")
pytestmark = pytest.mark.skipif(
    KUBECTL is None,
    reason="no kubectl (KUBECTL or PATH) for `kubectl kustomize`: .ci/ensure-tools.sh installs it",
)


def kustomize(directory: Path) -> list[Object]:
    """The objects `kubectl kustomize directory` prints."""
    assert KUBECTL is not None
    result = subprocess.run(
        [KUBECTL, "kustomize", str(directory)], capture_output=True, text=True, timeout=120
    )
    assert result.returncode == 0, f"kubectl kustomize {directory} failed:\n{result.stderr}"
    return [doc for doc in yaml.safe_load_all(result.stdout) if doc is not None]


@pytest.fixture(scope="module")
def builds() -> dict[str, list[Object]]:
    return {name: kustomize(path) for name, path in BUILDS.items()}


@pytest.fixture(scope="module")
def router_series() -> set[Series]:
    """The series a router's /metrics route serves, the router built from `pdserve router`
    flags as its process builds it (SLOs set). Offline: no request is made, the registry view
    stays empty, and no Redis is needed."""
    from fastapi.testclient import TestClient
    from prometheus_client.parser import text_string_to_metric_families

    from router.app import create_app
    from router.gateway import Gateway, ModelInfo

    args = command_parser("router", {}).parse_args(
        ["--ttft-slo-seconds", "1", "--itl-slo-seconds", "0.1"]
    )
    config = cli.router_config_from_args(args)
    # The routes that matter here never tokenize; the app reads only the chat template.
    tokenizer = SimpleNamespace(chat_template=None)
    model = ModelInfo(
        "m", "m", tokenizer=tokenizer, tokenizer_hash="", max_model_len=1, longest_token_bytes=1
    )  # type: ignore[arg-type]
    response = TestClient(create_app(Gateway(config, model))).get("/metrics")
    assert response.status_code == 200
    return {
        (sample.name, frozenset(sample.labels.items()))
        for family in text_string_to_metric_families(response.text)
        for sample in family.samples
    }


def adapter_rules() -> dict[str, dict[str, Object]]:
    """The prometheus-adapter rules in k8s/README.md's YAML blocks, by kind (``rules``,
    ``externalRules``) and by the metric name they serve (``name.as``)."""
    found: dict[str, dict[str, Object]] = {"rules": {}, "externalRules": {}}
    readme = (K8S / "README.md").read_text()
    for block in re.findall(r"```yaml\n(.*?)```", readme, re.DOTALL):
        document = yaml.safe_load(block)
        for kind, rules in found.items():
            for rule in document.get(kind, []) if isinstance(document, dict) else []:
                rules[rule["name"]["as"]] = rule
    return found


def objects_of(objects: list[Object], kind: str) -> dict[str, Object]:
    return {o["metadata"]["name"]: o for o in objects if o["kind"] == kind}


def pod_spec(deployment: Object) -> Object:
    spec: Object = deployment["spec"]["template"]["spec"]
    return spec


def pdserve_containers(objects: list[Object]) -> Iterator[tuple[Object, Object]]:
    """(Deployment, container) for every container running a `pdserve` command."""
    for deployment in objects_of(objects, "Deployment").values():
        for container in pod_spec(deployment)["containers"]:
            if container["image"].split(":")[0] == "pdserve":
                yield deployment, container


def all_containers(objects: list[Object]) -> Iterator[tuple[Object, Object]]:
    for deployment in objects_of(objects, "Deployment").values():
        for container in pod_spec(deployment)["containers"]:
            yield deployment, container


def quantity(value: str | int | float) -> float:
    """A Kubernetes quantity as a number (the suffixes used here: m, Ki, Mi, Gi)."""
    text = str(value)
    for suffix, factor in (("Ki", 2**10), ("Mi", 2**20), ("Gi", 2**30), ("m", 1e-3)):
        if text.endswith(suffix):
            return float(text[: -len(suffix)]) * factor
    return float(text)


def container_port(container: Object, port: int | str) -> int:
    """The containerPort a probe or Service names (by number or by name); fails if undeclared."""
    for declared in container.get("ports", []):
        if port in (declared["containerPort"], declared.get("name")):
            return int(declared["containerPort"])
    raise AssertionError(f"{container['name']}: port {port!r} is not a declared containerPort")


def container_env(container: Object, pod: Object, objects: list[Object]) -> dict[str, str]:
    """The environment the kubelet gives ``container`` (downward API values stood in for)."""
    configmaps = objects_of(objects, "ConfigMap")
    env: dict[str, str] = {}
    for source in container.get("envFrom", []):
        env.update(configmaps[source["configMapRef"]["name"]]["data"])
    for var in container.get("env", []):
        if "value" in var:
            env[var["name"]] = var["value"]
            continue
        ref = var["valueFrom"]
        if "fieldRef" in ref:
            env[var["name"]] = {"status.podIP": POD_IP}[ref["fieldRef"]["fieldPath"]]
        elif "resourceFieldRef" in ref:
            resource = ref["resourceFieldRef"]["resource"]
            section, name = resource.split(".")
            amount = quantity(container["resources"][section][name])
            env[var["name"]] = str(math.ceil(amount / quantity(ref["resourceFieldRef"]["divisor"])))
        elif "secretKeyRef" in ref:
            # The Secret is created by the operator (k8s/README.md): a stand-in value here.
            env[var["name"]] = f"secret:{ref['secretKeyRef']['key']}"
        else:
            raise AssertionError(f"unexpected env source {ref}")
    return env


def command_parser(command: str, env: dict[str, str]) -> argparse.ArgumentParser:
    """The parser `pdserve <command>` builds, with ``env`` as the whole process environment."""
    assert command == "router" or command in WORKER_ROLES, command
    parser = cli.make_parser(env)
    subparsers = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    return subparsers.choices[command]


def parsed_command(container: Object, env: dict[str, str]) -> argparse.Namespace:
    command, *args = container["args"]
    return command_parser(command, env).parse_args(args)


def flag_variables(command: str) -> set[str]:
    """The PDSERVE_* variables `pdserve <command>` reads (one per flag, plus the secrets)."""
    parser = command_parser(command, {})
    flags = [o for a in parser._actions for o in a.option_strings if o.startswith("--")]
    secrets = {"PDSERVE_CLUSTER_TOKEN", "PDSERVE_REDIS_PASSWORD"}
    return {env_name(flag) for flag in flags} | secrets  # secrets are no flags


def pre_stop_seconds(container: Object) -> float:
    command = container["lifecycle"]["preStop"]["exec"]["command"]
    assert command[0] == "sleep" and len(command) == 2, command
    return float(command[1])


def test_builds_contain_every_component(builds: dict[str, list[Object]]) -> None:
    for name, objects in builds.items():
        kinds = {(o["kind"], o["metadata"]["name"]) for o in objects}
        assert len(kinds) == len(objects), f"{name}: duplicate objects"
        assert set(objects_of(objects, "Deployment")) == {"router", "prefill", "decode", "redis"}
        services = {"router", "redis"} | (
            {"prefill", "decode"} if name in MONITORING_BUILDS else set()
        )
        assert set(objects_of(objects, "Service")) == services, name
        assert set(objects_of(objects, "HorizontalPodAutoscaler")) == set(POOLS)
        profiles = {"pdserve-profiles"} if name == "simulated" else set()
        assert set(objects_of(objects, "ConfigMap")) == {"pdserve-config"} | profiles
        for obj in objects:
            if obj["kind"] != "Namespace":
                assert obj["metadata"]["namespace"] == NAMESPACE, (name, obj["metadata"])
            assert obj["metadata"]["labels"]["app.kubernetes.io/part-of"] == "pdserve"


@pytest.mark.parametrize("version", K8S_VERSIONS)
@pytest.mark.parametrize("build_name", BUILDS)
def test_every_object_validates_against_the_kubernetes_schema(
    builds: dict[str, list[Object]], build_name: str, version: str
) -> None:
    errors = []
    for obj in builds[build_name]:
        if obj["apiVersion"].split("/")[0] == OPERATOR_GROUP:
            continue  # no schema here: test_prometheus_operator_objects_* check them
        try:
            kubernetes_validate.validate(obj, version, strict=True)
        except kubernetes_validate.ValidationError as exc:
            where = "/".join(str(p) for p in exc.path)
            errors.append(f"{obj['kind']}/{obj['metadata']['name']} at {where}: {exc.message}")
    assert not errors, "\n".join(errors)


def test_hpas_scale_their_own_pools_deployment(builds: dict[str, list[Object]]) -> None:
    for name, objects in builds.items():
        deployments = objects_of(objects, "Deployment")
        for pool, hpa in objects_of(objects, "HorizontalPodAutoscaler").items():
            target = hpa["spec"]["scaleTargetRef"]
            assert (target["apiVersion"], target["kind"]) == ("apps/v1", "Deployment")
            deployment = deployments[target["name"]]  # exists in the same build
            labels = deployment["spec"]["template"]["metadata"]["labels"]
            assert labels["app.kubernetes.io/component"] == pool, (name, pool, target)
            # An applied replica count would fight the autoscaler on every `kubectl apply`.
            assert "replicas" not in deployment["spec"], (name, pool)
            assert 1 <= hpa["spec"]["minReplicas"] <= hpa["spec"]["maxReplicas"]
            for metric in hpa["spec"]["metrics"]:
                if metric["type"] == "Resource":
                    resource = metric["resource"]["name"]
                    for container in pod_spec(deployment)["containers"]:
                        # Utilisation is usage over request: undefined without a request.
                        assert resource in container["resources"]["requests"], (name, pool)


def test_default_hpas_use_cpu_and_custom_ones_use_real_worker_metrics(
    builds: dict[str, list[Object]],
) -> None:
    metrics_source = (ROOT / "services" / "worker" / "metrics.py").read_text()
    rules = adapter_rules()["rules"]
    for name, objects in builds.items():
        for pool, hpa in objects_of(objects, "HorizontalPodAutoscaler").items():
            types = {m["type"] for m in hpa["spec"]["metrics"]}
            if name not in METRIC_BUILDS or pool == "router":
                assert hpa["spec"]["metrics"] == [
                    {
                        "type": "Resource",
                        "resource": {
                            "name": "cpu",
                            "target": {"type": "Utilization", "averageUtilization": 70},
                        },
                    }
                ], (name, pool)
                continue
            assert types == {METRIC_BUILDS[name]}, (name, pool)
            if METRIC_BUILDS[name] != "Pods":
                continue  # the router's metrics: the next test
            for metric in hpa["spec"]["metrics"]:
                metric_name = metric["pods"]["metric"]["name"]
                source = DERIVED_METRICS.get(metric_name, metric_name)
                assert f'"{source}"' in metrics_source, f"{metric_name}: no worker metric {source}"
                assert metric_name in rules, f"{metric_name}: no prometheus-adapter rule"


def test_external_hpas_use_series_the_router_exports_for_their_pool(
    builds: dict[str, list[Object]], router_series: set[Series]
) -> None:
    rules = adapter_rules()["externalRules"]
    used = set()
    for name, objects in builds.items():
        for pool, hpa in objects_of(objects, "HorizontalPodAutoscaler").items():
            for metric in hpa["spec"]["metrics"]:
                if metric["type"] != "External":
                    continue
                where = (name, pool)
                metric_name = metric["external"]["metric"]["name"]
                selector = metric["external"]["metric"]["selector"]["matchLabels"]
                used.add(metric_name)
                # The HPA's own pool, and a series the router really serves with that label.
                assert selector == {"pool": pool}, where
                assert any(
                    series == metric_name and selector.items() <= labels
                    for series, labels in router_series
                ), f"{where}: the router exports no {metric_name}{selector}"
                # An adapter rule serves it, per namespace, combining the router replicas right.
                rule = rules.get(metric_name)
                assert rule is not None, f"{metric_name}: no prometheus-adapter externalRule"
                assert rule["seriesQuery"].startswith(metric_name + "{"), rule
                assert rule["resources"]["overrides"]["namespace"] == {"resource": "namespace"}
                aggregation = ROUTER_AGGREGATION[metric_name]
                assert rule["metricsQuery"].startswith(f"{aggregation}(<<.Series>>"), rule
                assert "<<.LabelMatchers>>" in rule["metricsQuery"], rule
    assert used == set(ROUTER_AGGREGATION), used  # the router-metrics overlay uses them all


def test_probes_name_declared_ports_and_router_routes(builds: dict[str, list[Object]]) -> None:
    app_source = (ROOT / "router" / "app.py").read_text()
    for path in ROUTER_PROBE_PATHS | {"/metrics"}:
        assert f'@app.get("{path}")' in app_source, f"router/app.py serves no {path}"
    for name, objects in builds.items():
        for _, container in all_containers(objects):
            probes = {
                kind: container.get(f"{kind}Probe") for kind in ("startup", "readiness", "liveness")
            }
            assert probes["readiness"] and probes["liveness"], (name, container["name"])
            for probe in filter(None, probes.values()):
                if "grpc" in probe:  # grpc.health.v1, served by every worker
                    container_port(container, probe["grpc"]["port"])
                    assert container["args"][0] in WORKER_ROLES, container["name"]
                elif "httpGet" in probe:
                    container_port(container, probe["httpGet"]["port"])
                    assert container["args"][0] == "router", container["name"]
                    assert probe["httpGet"]["path"] in ROUTER_PROBE_PATHS, probe
                else:
                    container_port(container, probe["tcpSocket"]["port"])
            if container.get("args", [""])[0] == "router":
                assert probes["liveness"]["httpGet"]["path"] == "/health"
                assert probes["readiness"]["httpGet"]["path"] == "/ready"


def test_processes_listen_where_probes_services_and_scrapers_look(
    builds: dict[str, list[Object]],
) -> None:
    for name, objects in builds.items():
        services = objects_of(objects, "Service")
        deployments = objects_of(objects, "Deployment")
        for deployment, container in pdserve_containers(objects):
            pod = pod_spec(deployment)
            env = container_env(container, pod, objects)
            args = parsed_command(container, env)
            annotations = deployment["spec"]["template"]["metadata"]["annotations"]
            assert annotations["prometheus.io/scrape"] == "true"
            assert annotations["prometheus.io/path"] == "/metrics"
            scraped = container_port(container, int(annotations["prometheus.io/port"]))
            assert args.host == "0.0.0.0", (name, container["name"])  # reachable from peers
            if container["args"][0] == "router":
                config = cli.router_config_from_args(args)
                assert config.port == container_port(container, "http") == scraped
                for probe in ("startup", "readiness", "liveness"):
                    probed = container[f"{probe}Probe"]["httpGet"]["port"]
                    assert container_port(container, probed) == config.port
                service = services["router"]["spec"]["ports"][0]
                assert service["port"] == 80
                assert container_port(container, service["targetPort"]) == config.port
            else:
                config = cli.worker_config_from_args(container["args"][0], args)
                assert config.grpc_port == container_port(container, "grpc")
                for probe in ("startup", "readiness", "liveness"):
                    assert container[f"{probe}Probe"]["grpc"]["port"] == config.grpc_port
                assert config.metrics_port == container_port(container, "metrics") == scraped
                assert config.public_host == POD_IP  # registered address: the pod's own IP
                # torch threads follow the CPU request (the default would see the whole node).
                cpu = quantity(container["resources"]["requests"]["cpu"])
                assert config.engine.num_threads == math.ceil(cpu)
                # GPU pods run the engine on their GPU; the others on the CPU.
                device = "cuda" if name in GPU_BUILDS else "cpu"
                assert config.engine.device == device, (name, container["name"])
            # The registry URL names the Redis Service, whose port reaches the Redis container.
            redis_url = urlparse(config.redis_url)
            assert redis_url.hostname == "redis"
            redis_port = next(
                p for p in services["redis"]["spec"]["ports"] if p["port"] == redis_url.port
            )
            redis_container = pod_spec(deployments["redis"])["containers"][0]
            assert container_port(redis_container, redis_port["targetPort"]) == 6379


def test_services_select_their_deployments_pods(builds: dict[str, list[Object]]) -> None:
    for objects in builds.values():
        deployments = objects_of(objects, "Deployment")
        for name, service in objects_of(objects, "Service").items():
            labels = deployments[name]["spec"]["template"]["metadata"]["labels"]
            assert service["spec"]["selector"].items() <= labels.items(), name


def test_pdserve_variables_are_flags_of_the_command_that_reads_them(
    builds: dict[str, list[Object]],
) -> None:
    router_vars, worker_vars = flag_variables("router"), flag_variables("prefill")
    for name, objects in builds.items():
        for key in objects_of(objects, "ConfigMap")["pdserve-config"]["data"]:
            assert key in router_vars | worker_vars, f"{name}: {key} is read by no command"
        for _, container in pdserve_containers(objects):
            known = flag_variables(container["args"][0])
            for var in container.get("env", []):
                if var["name"].startswith("PDSERVE_"):
                    assert var["name"] in known, f"{name}/{container['name']}: {var['name']}"
        for deployment in objects_of(objects, "Deployment").values():
            # Service links would inject PDSERVE_<SERVICE>_PORT=tcp://... into the pods.
            assert pod_spec(deployment)["enableServiceLinks"] is False


def test_termination_grace_covers_prestop_and_drain(builds: dict[str, list[Object]]) -> None:
    server_source = (ROOT / "router" / "server.py").read_text()
    router_shutdown = re.search(r"timeout_graceful_shutdown=(\d+)", server_source)
    router_drain = re.search(r"^DRAIN_SECONDS = ([\d.]+)", server_source, re.MULTILINE)
    assert router_shutdown is not None and router_drain is not None
    for name, objects in builds.items():
        for deployment, container in pdserve_containers(objects):
            pod = pod_spec(deployment)
            grace = pod["terminationGracePeriodSeconds"]
            args = parsed_command(container, container_env(container, pod, objects))
            if container["args"][0] == "router":
                needed = pre_stop_seconds(container) + float(router_drain.group(1))
                needed += float(router_shutdown.group(1))
            else:
                # The kubelet counts the preStop hook against the grace period.
                needed = pre_stop_seconds(container) + args.drain_seconds + 10
            assert grace >= needed, (name, container["name"], grace, needed)


def test_pods_run_as_non_root_with_requests(builds: dict[str, list[Object]]) -> None:
    """What the namespace's "restricted" Pod Security Standard demands, and resource requests."""
    for name, objects in builds.items():
        namespace = objects_of(objects, "Namespace")[NAMESPACE]
        assert namespace["metadata"]["labels"]["pod-security.kubernetes.io/enforce"] == "restricted"
        for deployment, container in all_containers(objects):
            pod = pod_spec(deployment)
            where = (name, container["name"])
            assert pod["securityContext"]["runAsNonRoot"] is True, where
            assert pod["securityContext"]["runAsUser"] > 0, where
            assert pod["securityContext"]["seccompProfile"] == {"type": "RuntimeDefault"}, where
            assert pod["automountServiceAccountToken"] is False, where
            security = container["securityContext"]
            assert security["allowPrivilegeEscalation"] is False, where
            assert security["readOnlyRootFilesystem"] is True, where
            assert security["capabilities"]["drop"] == ["ALL"], where
            requests = container["resources"]["requests"]
            limits = container["resources"]["limits"]
            assert quantity(requests["cpu"]) > 0 and quantity(requests["memory"]) > 0, where
            assert quantity(limits["memory"]) >= quantity(requests["memory"]), where
            for resource, amount in {**requests, **limits}.items():
                if "/" in resource:  # extended resources (GPUs): requests must equal limits
                    assert requests.get(resource) == limits.get(resource) == amount, where
        for _, container in pdserve_containers(objects):
            mounts = {m["mountPath"] for m in container["volumeMounts"]}
            assert {"/tmp", "/home/pdserve"} <= mounts, (name, container["name"])  # writable
            tag = "cuda" if name in GPU_BUILDS else "latest"  # the Dockerfile's two builds
            assert container["image"] == f"pdserve:{tag}", (name, container["name"])


def _selects(selector: Object, labels: dict[str, str]) -> bool:
    """Whether a LabelSelector (matchLabels, matchExpressions with In) selects ``labels``."""
    if not selector.get("matchLabels", {}).items() <= labels.items():
        return False
    for expression in selector.get("matchExpressions", []):
        assert expression["operator"] == "In", expression
        if labels.get(expression["key"]) not in expression["values"]:
            return False
    return True


def _who_reaches(policies: list[Object], pod: dict[str, str], peer: dict[str, str], port: str):  # type: ignore[no-untyped-def]
    """Whether a pod labelled ``peer`` may open ``port`` (a port name) on pods labelled ``pod``:
    allowed by some policy that selects the pod (deny when one selects it and none allows)."""
    rules = [
        r
        for p in policies
        if _selects(p["spec"]["podSelector"], pod)
        for r in p["spec"].get("ingress", [])
    ]
    for rule in rules:
        peers_ok = "from" not in rule or any(
            "podSelector" in f and _selects(f["podSelector"], peer) for f in rule["from"]
        )
        ports_ok = "ports" not in rule or any(p["port"] == port for p in rule["ports"])
        if peers_ok and ports_ok:
            return True
    return False


def test_the_internal_plane_needs_the_secret_and_only_pdserve_pods_reach_it(
    builds: dict[str, list[Object]],
) -> None:
    """Token and Redis password from the secret (required, so a pod without them never
    starts); Redis runs with requirepass; NetworkPolicies let only the router and the workers
    reach the workers' gRPC/KV ports and Redis, and anyone reach the API and /metrics."""
    for name, objects in builds.items():
        for _, container in pdserve_containers(objects):
            env = {v["name"]: v for v in container["env"]}
            for var, key in (
                ("PDSERVE_CLUSTER_TOKEN", "cluster-token"),
                ("PDSERVE_REDIS_PASSWORD", "redis-password"),
            ):
                ref = env[var]["valueFrom"]["secretKeyRef"]
                assert ref == {"name": "pdserve-secrets", "key": key}, (name, container["name"])
            assert "PDSERVE_INSECURE" not in env
        redis_container = pod_spec(objects_of(objects, "Deployment")["redis"])["containers"][0]
        assert redis_container["args"][-2:] == ["--requirepass", "$(REDIS_PASSWORD)"]
        ref = redis_container["env"][0]["valueFrom"]["secretKeyRef"]
        assert ref == {"name": "pdserve-secrets", "key": "redis-password"}

        policies = list(objects_of(objects, "NetworkPolicy").values())
        pods = {
            c: {"app.kubernetes.io/name": "pdserve", "app.kubernetes.io/component": c}
            for c in ("router", "prefill", "decode", "redis")
        }
        stranger = {"app": "anything-else"}
        for worker in ("prefill", "decode"):
            for port in ("grpc", "kv"):
                assert not _who_reaches(policies, pods[worker], stranger, port), (name, worker)
                for peer in ("router", "prefill", "decode"):
                    assert _who_reaches(policies, pods[worker], pods[peer], port), (name, peer)
            assert _who_reaches(policies, pods[worker], stranger, "metrics")
        assert not _who_reaches(policies, pods["redis"], stranger, "redis")
        assert _who_reaches(policies, pods["redis"], pods["router"], "redis")
        assert _who_reaches(policies, pods["router"], stranger, "http")
        assert not _who_reaches(policies, pods["router"], stranger, "anything")


def test_every_deployment_has_a_disruption_budget(builds: dict[str, list[Object]]) -> None:
    for name, objects in builds.items():
        budgets = objects_of(objects, "PodDisruptionBudget").values()
        for deployment_name, deployment in objects_of(objects, "Deployment").items():
            labels = deployment["spec"]["template"]["metadata"]["labels"]
            matching = [
                b for b in budgets if b["spec"]["selector"]["matchLabels"].items() <= labels.items()
            ]
            assert len(matching) == 1, (name, deployment_name)
            # maxUnavailable lets node drains evict a single-replica pool (minAvailable would not).
            assert matching[0]["spec"]["maxUnavailable"] == 1, (name, deployment_name)


def test_gpu_overlay_puts_each_pool_on_its_own_node_class(
    builds: dict[str, list[Object]],
) -> None:
    for name, objects in builds.items():
        deployments = objects_of(objects, "Deployment")
        gpus = {
            deployment_name: sum(
                int(c["resources"]["limits"].get("nvidia.com/gpu", 0))
                for c in pod_spec(deployment)["containers"]
            )
            for deployment_name, deployment in deployments.items()
        }
        selectors = {n: pod_spec(d).get("nodeSelector") for n, d in deployments.items()}
        if name not in GPU_BUILDS:
            assert set(gpus.values()) == {0} and set(selectors.values()) == {None}, name
            continue
        assert gpus == {"prefill": 1, "decode": 1, "router": 0, "redis": 0}, name
        assert selectors["prefill"] and selectors["decode"], name
        assert selectors["prefill"] != selectors["decode"], name
        assert selectors["router"] is None and selectors["redis"] is None, name
        for pool in ("prefill", "decode"):
            tolerations = pod_spec(deployments[pool])["tolerations"]
            assert {"key": "nvidia.com/gpu", "operator": "Exists", "effect": "NoSchedule"} in (
                tolerations
            )


# Fields of the Prometheus Operator's CRDs (monitoring.coreos.com/v1) that k8s/ may use: a
# structural stand-in for the CRD schemas, which kubernetes-validate does not ship.
SERVICE_MONITOR_SPEC = {"selector", "endpoints", "namespaceSelector", "jobLabel"}
SERVICE_MONITOR_ENDPOINT = {"port", "path", "interval", "scrapeTimeout", "scheme"}
RULE_GROUP = {"name", "interval", "rules"}
RULE = {"record", "alert", "expr", "for", "labels", "annotations"}
DURATION = re.compile(r"^(\d+(ms|s|m|h))+$")


def operator_objects(objects: list[Object]) -> dict[str, list[Object]]:
    """The build's Prometheus Operator objects by kind; nothing else of that API group."""
    found: dict[str, list[Object]] = {}
    for obj in objects:
        if obj["apiVersion"].split("/")[0] == OPERATOR_GROUP:
            assert obj["apiVersion"] == f"{OPERATOR_GROUP}/v1", obj["apiVersion"]
            assert obj["kind"] in ("ServiceMonitor", "PrometheusRule"), obj["kind"]
            assert set(obj) == {"apiVersion", "kind", "metadata", "spec"}, set(obj)
            found.setdefault(obj["kind"], []).append(obj)
    return found


def test_prometheus_operator_objects_only_in_the_monitoring_build(
    builds: dict[str, list[Object]],
) -> None:
    for name, objects in builds.items():
        kinds = operator_objects(objects)
        if name in MONITORING_BUILDS:
            assert len(kinds["ServiceMonitor"]) == 2 and len(kinds["PrometheusRule"]) == 1, name
        else:
            assert kinds == {}, name


def test_service_monitors_scrape_every_pdserve_pod_where_it_serves_metrics(
    builds: dict[str, list[Object]],
) -> None:
    """Each ServiceMonitor selects Services of the build by label; each endpoint names a port of
    the Services it selects, whose targetPort is the container port the pod's process serves
    /metrics on (the prometheus.io/port annotation, which the test above ties to the process's
    own flags); together they cover the router and both worker pools."""
    for name in MONITORING_BUILDS:
        objects = builds[name]
        services = objects_of(objects, "Service")
        deployments = objects_of(objects, "Deployment")
        scraped: set[str] = set()
        for monitor in operator_objects(objects)["ServiceMonitor"]:
            spec = monitor["spec"]
            assert set(spec) <= SERVICE_MONITOR_SPEC, set(spec) - SERVICE_MONITOR_SPEC
            selected = [
                s for s in services.values() if _selects(spec["selector"], s["metadata"]["labels"])
            ]
            assert selected, f"{monitor['metadata']['name']} selects no Service"
            assert "namespaceSelector" not in spec  # its own namespace: where the Services are
            for endpoint in spec["endpoints"]:
                assert set(endpoint) <= SERVICE_MONITOR_ENDPOINT, endpoint
                assert DURATION.match(endpoint["interval"]), endpoint
                for service in selected:
                    port = next(
                        p for p in service["spec"]["ports"] if p.get("name") == endpoint["port"]
                    )  # the Service names the port the endpoint scrapes
                    component = service["spec"]["selector"]["app.kubernetes.io/component"]
                    deployment = deployments[component]
                    annotations = deployment["spec"]["template"]["metadata"]["annotations"]
                    (container,) = pod_spec(deployment)["containers"]
                    assert container_port(container, port["targetPort"]) == int(
                        annotations["prometheus.io/port"]
                    ), (monitor["metadata"]["name"], service["metadata"]["name"])
                    assert endpoint["path"] == annotations["prometheus.io/path"] == "/metrics"
                    scraped.add(component)
        assert scraped == set(POOLS), scraped
        # Headless: nothing connects through the worker Services; they only list the pods.
        for pool in ("prefill", "decode"):
            assert services[pool]["spec"]["clusterIP"] == "None"
            assert [p["name"] for p in services[pool]["spec"]["ports"]] == ["metrics"]


def test_prometheus_rule_carries_the_rules_file(builds: dict[str, list[Object]]) -> None:
    """The PrometheusRule's groups are monitoring/prometheus/rules.yml's, which promtool checks
    and unit-tests (tests/test_monitoring.py): one file of rules for compose and Kubernetes."""
    rules_file = yaml.safe_load(RULES_FILE.read_text())
    for name in MONITORING_BUILDS:
        (rule,) = operator_objects(builds[name])["PrometheusRule"]
        assert rule["spec"] == rules_file, "run: python monitoring/prometheusrule.py"
        for group in rule["spec"]["groups"]:
            assert set(group) <= RULE_GROUP and group["rules"], group.get("name")
            for entry in group["rules"]:
                assert set(entry) <= RULE and entry["expr"], entry
                assert ("record" in entry) != ("alert" in entry), entry
                if "for" in entry:
                    assert DURATION.match(entry["for"]), entry


def test_simulated_overlay_mounts_the_profile_its_workers_simulate(
    builds: dict[str, list[Object]],
) -> None:
    """k8s/overlays/simulated (docs/simulation.md): its profile is the repository's, mounted
    where the workers' PDSERVE_SIMULATE points; 2 + 6 pods of 8 workers each."""
    objects = builds["simulated"]
    profiles = objects_of(objects, "ConfigMap")["pdserve-profiles"]["data"]
    for name, text in profiles.items():
        assert text == (ROOT / "benchmarks" / "profiles" / name).read_text(), f"{name}: stale copy"
        SimulationProfile.from_dict(json.loads(text))
    deployments = objects_of(objects, "Deployment")
    autoscalers = objects_of(objects, "HorizontalPodAutoscaler")
    for role, num_pods in (("prefill", 2), ("decode", 6)):
        pod = deployments[role]["spec"]["template"]["spec"]
        [container] = pod["containers"]
        config = cli.worker_config_from_args(
            role, parsed_command(container, container_env(container, pod, objects))
        )
        assert config.simulate is not None and config.simulated_workers == 8
        [mount] = [m for m in container["volumeMounts"] if m["name"] == "profiles"]
        [volume] = [v for v in pod["volumes"] if v["name"] == "profiles"]
        assert volume["configMap"]["name"] == "pdserve-profiles"
        assert str(Path(config.simulate).parent) == mount["mountPath"]
        assert Path(config.simulate).name in profiles
        spec = autoscalers[role]["spec"]
        assert spec["minReplicas"] == spec["maxReplicas"] == num_pods
