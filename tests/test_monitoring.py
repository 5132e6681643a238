"""monitoring/: Prometheus config, rules and alerts, and the Grafana dashboard users open.

- promtool (Debian's `prometheus` package; .ci/ensure-tools.sh installs it) checks the scrape
  config and the rules and runs the rules' unit tests for real; those tests skip, saying so,
  only where no promtool can be found;
- every alert has a unit test where it fires and one where it stays silent;
- every PromQL expression (rules, dashboard panels and variables, the prometheus-adapter rules
  of k8s/README.md) names only metrics docs/metrics.md lists, which tests/test_metrics_reference.py
  keeps equal to what pdserve exports (a histogram's _bucket, _sum and _count series count as
  the histogram), or series the rules record;
- the scrape config finds the compose services on the ports they serve /metrics on;
- the dashboard is well-formed: every panel has a title, a Prometheus datasource and queries,
  and together they show what an operator looks at first.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
from pathlib import Path
from typing import Any

import pytest
import yaml

ROOT = Path(__file__).resolve().parents[1]
MONITORING = ROOT / "monitoring"
PROMETHEUS_DIR = MONITORING / "prometheus"
GRAFANA_DIR = MONITORING / "grafana"
DASHBOARD = GRAFANA_DIR / "dashboards" / "pdserve.json"
METRICS_DOC = ROOT / "docs" / "metrics.md"
COMPOSE = ROOT / "docker-compose.yml"
PROMTOOL = os.environ.get("PROMTOOL") or shutil.which("promtool")
needs_promtool = pytest.mark.skipif(
    PROMTOOL is None,
    reason="no promtool (PROMTOOL or PATH; Debian's prometheus package): .ci/ensure-tools.sh",
)
HISTOGRAM_SERIES = ("_bucket", "_sum", "_count")
# PromQL words that are neither metrics nor functions.
KEYWORDS = {"and", "or", "unless", "offset", "bool", "inf", "nan"}
# Grafana's variables in queries -> what stands in for them when promtool parses a query.
GRAFANA_VARIABLES = {"$__rate_interval": "5m", "$namespace": ".*"}
Object = dict[str, Any]


def exported_metrics() -> dict[str, str]:
    """docs/metrics.md's metrics -> their type (counter, gauge, histogram)."""
    rows = re.findall(r"^\| `(pdserve_\w+)` \| (\w+) \|", METRICS_DOC.read_text(), re.MULTILINE)
    assert len(rows) > 30, "docs/metrics.md's tables did not parse"
    return dict(rows)


def metric_names(expr: str) -> set[str]:
    """The metric (and recorded series) names a PromQL expression selects: every identifier
    that is not a function or aggregation (followed by "("), a keyword, a label name (in a
    matcher or a by / without / on / ignoring / group_left / group_right list), a string or a
    duration."""
    expr = re.sub(r'"(?:[^"\\]|\\.)*"', '""', expr)  # strings first: they may hold { } ( )
    expr = re.sub(r"\{[^}]*\}", " ", expr)  # label matchers
    expr = re.sub(r"\[[^\]]*\]", " ", expr)  # ranges and subqueries
    expr = re.sub(r"\b(by|without|on|ignoring|group_left|group_right)\s*\([^)]*\)", " ", expr)
    names = set()
    for match in re.finditer(r"(?<![\w.:$])[A-Za-z_:][A-Za-z0-9_:]*", expr):
        if expr[match.end() :].lstrip().startswith("("):
            continue  # a function or an aggregation
        if match.group(0).lower() not in KEYWORDS:
            names.add(match.group(0))
    return names


def rules_file() -> Object:
    rules: Object = yaml.safe_load((PROMETHEUS_DIR / "rules.yml").read_text())
    return rules


def recorded_series() -> set[str]:
    return {r["record"] for g in rules_file()["groups"] for r in g["rules"] if "record" in r}


def alerts() -> dict[str, Object]:
    return {r["alert"]: r for g in rules_file()["groups"] for r in g["rules"] if "alert" in r}


def dashboard() -> Object:
    board: Object = json.loads(DASHBOARD.read_text())
    return board


def dashboard_queries() -> dict[str, str]:
    """Every PromQL query of the dashboard (panel targets and query variables), by where."""
    board = dashboard()
    queries = {
        f"panel {p['title']!r} {t['refId']}": t["expr"]
        for p in board["panels"]
        for t in p.get("targets", [])
    }
    for variable in board["templating"]["list"]:
        if variable["type"] == "query":
            inner = re.fullmatch(r"label_values\((.+),\s*\w+\)", variable["query"]["query"])
            assert inner, variable["query"]
            queries[f"variable {variable['name']}"] = inner.group(1)
    return queries


def unknown_metrics(expr: str, exported: dict[str, str], recorded: set[str]) -> set[str]:
    """The names ``expr`` selects that pdserve does not export and no rule records."""
    unknown = set()
    for name in metric_names(expr):
        if name in recorded or name in exported:
            continue
        base = next(
            (name[: -len(s)] for s in HISTOGRAM_SERIES if name.endswith(s)),
            None,
        )
        if base is None or exported.get(base) != "histogram":
            unknown.add(name)
    return unknown


def promtool(*args: str, cwd: Path) -> subprocess.CompletedProcess[str]:
    assert PROMTOOL is not None
    return subprocess.run(
        [PROMTOOL, *args], cwd=cwd, capture_output=True, text=True, timeout=120, check=False
    )


# --- the PromQL name parser the checks below rely on -------------------------------------------


def test_metric_names_finds_metrics_and_nothing_else() -> None:
    expr = (
        'sum by (namespace, le) (rate(pdserve_a_bucket{x="y}{(", le!="1"}[5m] offset 1h))'
        " / on (job, instance) group_left (pool) pdserve_b * 1e3 > bool 0.5"
        " and ignoring(x) pdserve:c:ratio or absent(pdserve_d) unless label_replace(pdserve_e,"
        ' "a", "$1", "b", "(.*)")'
    )
    assert metric_names(expr) == {
        "pdserve_a_bucket",
        "pdserve_b",
        "pdserve:c:ratio",
        "pdserve_d",
        "pdserve_e",
    }
    exported = {"pdserve_a": "histogram", "pdserve_b": "gauge", "pdserve_c_total": "counter"}
    assert unknown_metrics("pdserve_a_count + pdserve_b_count", exported, set()) == {
        "pdserve_b_count"  # a gauge has no _count series
    }
    assert unknown_metrics("pdserve:x + pdserve_c + up", exported, {"pdserve:x"}) == {
        "pdserve_c",
        "up",
    }


# --- Prometheus ---------------------------------------------------------------------------------


@needs_promtool
def test_promtool_accepts_the_scrape_config(tmp_path: Path) -> None:
    for name in ("prometheus.yml", "rules.yml"):  # check config also loads the rule files
        shutil.copy(PROMETHEUS_DIR / name, tmp_path / name)
    result = promtool("check", "config", "prometheus.yml", cwd=tmp_path)
    assert result.returncode == 0, result.stdout + result.stderr
    assert "SUCCESS: 1 rule files found" in result.stdout


@needs_promtool
def test_promtool_accepts_the_rules() -> None:
    result = promtool("check", "rules", "rules.yml", cwd=PROMETHEUS_DIR)
    assert result.returncode == 0, result.stdout + result.stderr
    count = sum(len(g["rules"]) for g in rules_file()["groups"])
    assert f"SUCCESS: {count} rules found" in result.stdout


@needs_promtool
def test_rules_unit_tests_pass() -> None:
    result = promtool("test", "rules", "rules_test.yml", cwd=PROMETHEUS_DIR)
    assert result.returncode == 0, result.stdout + result.stderr
    assert "SUCCESS" in result.stdout


@needs_promtool
def test_rules_unit_tests_fail_on_a_broken_rule(tmp_path: Path) -> None:
    """The unit tests hold the thresholds: an alert that fires too late fails them."""
    shutil.copy(PROMETHEUS_DIR / "rules_test.yml", tmp_path)
    rules = (PROMETHEUS_DIR / "rules.yml").read_text()
    assert "pdserve:kv_blocks_used:ratio > 0.95" in rules
    (tmp_path / "rules.yml").write_text(rules.replace("ratio > 0.95", "ratio > 0.97"))
    result = promtool("test", "rules", "rules_test.yml", cwd=tmp_path)
    assert result.returncode != 0
    assert "alertname: PdserveKVPoolNearFull" in result.stdout + result.stderr


def test_the_alerts_operators_page_on_exist() -> None:
    """Latency over SLO, a full KV pool, failed pulls and recomputes, an empty pool and lease
    expiries, each on the metric that measures it."""
    expected = {
        "PdserveTTFTOverSLO": "pdserve:router_ttft_seconds:p99_5m",
        "PdserveITLOverSLO": "pdserve:router_itl_seconds:p99_5m",
        "PdserveKVPoolNearFull": "pdserve:kv_blocks_used:ratio",
        "PdserveKVPullsFailing": "pdserve_kv_pulls_total",
        "PdserveKVRecomputes": "pdserve:kv_pulls_recomputed:ratio_rate5m",
        "PdservePoolNoLiveWorker": "pdserve_router_workers",
        "PdserveLeaseExpirations": "pdserve_lease_expirations_total",
    }
    found = alerts()
    for alert, metric in expected.items():
        assert metric in metric_names(found[alert]["expr"]), alert
    for name, rule in found.items():
        assert rule["labels"]["severity"] in ("critical", "warning"), name
        assert rule["annotations"]["summary"] and rule["annotations"]["description"], name


def test_every_alert_has_a_firing_and_a_silent_unit_test() -> None:
    tests = yaml.safe_load((PROMETHEUS_DIR / "rules_test.yml").read_text())
    assert tests["rule_files"] == ["rules.yml"]
    firing: set[str] = set()
    silent: set[str] = set()
    for group in tests["tests"]:
        for case in group.get("alert_rule_test", []):
            (firing if case["exp_alerts"] else silent).add(case["alertname"])
    assert set(alerts()) - firing == set(), "alerts never shown firing"
    assert set(alerts()) - silent == set(), "alerts never shown silent"


def test_rules_name_only_exported_metrics() -> None:
    exported, recorded = exported_metrics(), recorded_series()
    for group in rules_file()["groups"]:
        for rule in group["rules"]:
            name = rule.get("record") or rule["alert"]
            assert metric_names(rule["expr"]), name
            assert unknown_metrics(rule["expr"], exported, recorded) == set(), name
            if "record" in rule:  # level:metric:operations, on pdserve's own prefix
                assert re.fullmatch(r"pdserve:[a-z0-9_]+:[a-z0-9_]+", rule["record"]), name


def test_adapter_rules_of_the_k8s_readme_name_exported_metrics() -> None:
    """The prometheus-adapter rules the HPAs of k8s/ depend on (k8s/README.md's YAML blocks)."""
    exported = exported_metrics()
    readme = (ROOT / "k8s" / "README.md").read_text()
    checked = 0
    for block in re.findall(r"```yaml\n(.*?)```", readme, re.DOTALL):
        document = yaml.safe_load(block)
        for kind in ("rules", "externalRules"):
            for rule in document.get(kind, []) if isinstance(document, dict) else []:
                for field in ("seriesQuery", "metricsQuery"):
                    # <<.Series>> is the seriesQuery's metric; other templates are matchers.
                    query = rule[field].replace("<<.Series>>", "pdserve_router_workers")
                    query = re.sub(r"<<[^>]*>>", "", query)
                    assert unknown_metrics(query, exported, set()) == set(), rule[field]
                    checked += 1
    assert checked >= 8


def test_scrape_config_finds_every_compose_service_where_it_serves_metrics() -> None:
    """Router and both worker pools, by Docker DNS (every replica of a scaled service), on the
    port each serves /metrics on inside its container (docker-compose.yml's environment)."""
    config = yaml.safe_load((PROMETHEUS_DIR / "prometheus.yml").read_text())
    services = yaml.safe_load(COMPOSE.read_text())["services"]
    assert config["rule_files"] == ["rules.yml"]
    jobs = {job["job_name"]: job for job in config["scrape_configs"]}
    assert set(jobs) == {"router", "prefill", "decode"}
    for name, job in jobs.items():
        (discovery,) = job["dns_sd_configs"]
        assert "static_configs" not in job  # a fixed list would miss scaled replicas
        assert discovery["type"] == "A"
        assert discovery["names"][0] == name
        for service_name in discovery["names"]:
            service = services[service_name]
            env = service["environment"]
            port = env["PDSERVE_PORT"] if name == "router" else env["PDSERVE_METRICS_PORT"]
            assert discovery["port"] == int(port), (name, service_name)
            # the router service runs the keeper, which serves through its router child
            assert service["command"] == [name if name != "router" else "router-keeper"]
    # Every compose service that runs a pdserve worker is scraped.
    workers = {n for n, s in services.items() if s.get("command") in (["prefill"], ["decode"])}
    assert workers == {n for j in jobs.values() for n in j["dns_sd_configs"][0]["names"]} - {
        "router"
    }


# --- Grafana ------------------------------------------------------------------------------------


def test_dashboard_is_well_formed() -> None:
    board = dashboard()
    assert board["uid"] == "pdserve" and board["title"]
    variables = {v["name"]: v for v in board["templating"]["list"]}
    assert variables["datasource"]["type"] == "datasource"
    assert variables["datasource"]["query"] == "prometheus"
    datasource = {"type": "prometheus", "uid": "${datasource}"}
    ids: set[int] = set()
    cells: set[tuple[int, int]] = set()
    for panel in board["panels"]:
        assert panel["title"], panel
        assert panel["id"] not in ids, panel["title"]
        ids.add(panel["id"])
        grid = panel["gridPos"]
        assert grid["x"] >= 0 and grid["w"] > 0 and grid["x"] + grid["w"] <= 24, panel["title"]
        area = {
            (x, y)
            for x in range(grid["x"], grid["x"] + grid["w"])
            for y in range(grid["y"], grid["y"] + grid["h"])
        }
        assert not area & cells, f"{panel['title']} overlaps another panel"
        cells |= area
        if panel["type"] == "row":
            continue
        assert panel["datasource"] == datasource, panel["title"]
        assert panel["targets"], panel["title"]
        ref_ids = [t["refId"] for t in panel["targets"]]
        assert len(set(ref_ids)) == len(ref_ids), panel["title"]
        for target in panel["targets"]:
            assert target["datasource"] == datasource, panel["title"]
            assert target["expr"].strip(), panel["title"]
        assert panel["fieldConfig"]["defaults"]["unit"], panel["title"]


def test_dashboard_queries_name_only_exported_metrics() -> None:
    exported, recorded = exported_metrics(), recorded_series()
    for where, expr in dashboard_queries().items():
        assert metric_names(expr), where
        assert unknown_metrics(expr, exported, recorded) == set(), where
        if where.startswith("panel"):
            # Every selector follows the namespace variable (All: every deployment, or compose).
            for selector in re.findall(r"\bpdserve[\w:]*(\{[^}]*\})?", expr):
                assert 'namespace=~"$namespace"' in selector, (where, expr)


@needs_promtool
def test_dashboard_queries_parse(tmp_path: Path) -> None:
    """promtool parses each query (as a recording rule), Grafana's variables stood in for."""
    rules = []
    for index, expr in enumerate(dashboard_queries().values()):
        for variable, value in GRAFANA_VARIABLES.items():
            expr = expr.replace(variable, value)
        assert "$" not in expr.replace("$1", ""), expr  # no variable left unknown
        rules.append({"record": f"dashboard:query_{index}:check", "expr": expr})
    (tmp_path / "queries.yml").write_text(
        yaml.safe_dump({"groups": [{"name": "q", "rules": rules}]})
    )
    result = promtool("check", "rules", "queries.yml", cwd=tmp_path)
    assert result.returncode == 0, result.stdout + result.stderr


def test_dashboard_shows_what_operators_look_at() -> None:
    """Request rate, TTFT / ITL / E2E percentiles, KV use per pool, transfer bytes and time,
    queue depths, disaggregation decisions: each on a panel, by the metric that measures it."""
    panels = {
        p["title"]: set().union(*(metric_names(t["expr"]) for t in p["targets"]))
        for p in dashboard()["panels"]
        if p["type"] != "row"
    }
    expected = {
        "Request rate": {"pdserve_router_requests_total"},
        "Time to first token": {"pdserve_router_ttft_seconds_bucket"},
        "Inter-token latency": {"pdserve_router_itl_seconds_bucket"},
        "End-to-end latency": {"pdserve_router_e2e_seconds_bucket"},
        "KV blocks in use": {"pdserve_kv_blocks", "pdserve_kv_blocks_capacity"},
        "KV bytes per second": {"pdserve_kv_transfer_bytes_total"},
        "KV transfer time": {"pdserve_kv_transfer_seconds_bucket"},
        "Waiting sequences": {"pdserve_num_waiting", "pdserve_worker_info"},
        "Disaggregation decisions": {"pdserve_router_disaggregation_decisions_total"},
    }
    for title, metrics in expected.items():
        assert metrics <= panels[title], title
    for title, query in (
        ("Time to first token", "histogram_quantile(0.99"),
        ("KV blocks in use", "by (pool)"),
        ("Waiting sequences", "by (pool)"),
        ("Disaggregation decisions", "by (decision, reason)"),
    ):
        panel = next(p for p in dashboard()["panels"] if p["title"] == title)
        assert any(query in t["expr"] for t in panel["targets"]), title


def test_grafana_provisioning_points_at_prometheus_and_the_dashboards() -> None:
    provisioning = GRAFANA_DIR / "provisioning"
    (source,) = yaml.safe_load((provisioning / "datasources" / "prometheus.yml").read_text())[
        "datasources"
    ]
    assert source["type"] == "prometheus" and source["url"] == "http://prometheus:9090"
    # The dashboard's datasource variable defaults to this datasource.
    variable = dashboard()["templating"]["list"][0]
    assert variable["current"]["value"] == source["uid"] and source["isDefault"] is True
    (provider,) = yaml.safe_load((provisioning / "dashboards" / "pdserve.yml").read_text())[
        "providers"
    ]
    assert provider["type"] == "file" and provider["options"]["path"] == GRAFANA_DASHBOARDS_PATH
    assert [p.name for p in (GRAFANA_DIR / "dashboards").glob("*.json")] == ["pdserve.json"]


# Where compose mounts monitoring/grafana/dashboards in the Grafana container (the provider's
# path) and monitoring/grafana/provisioning (Grafana's default provisioning folder).
GRAFANA_DASHBOARDS_PATH = "/var/lib/grafana/dashboards"
GRAFANA_PROVISIONING_PATH = "/etc/grafana/provisioning"


def test_compose_mounts_the_monitoring_files_where_they_are_read() -> None:
    services = yaml.safe_load(COMPOSE.read_text())["services"]
    assert {"grafana", "prometheus"} <= set(services), "compose lost its monitoring services"

    def mounts(service: str) -> dict[str, str]:
        """Container path -> host path (relative to the compose file) of bind mounts."""
        found = {}
        for volume in services[service].get("volumes", []):
            if isinstance(volume, dict):
                source, target = volume["source"], volume["target"]
            else:
                source, target = volume.split(":")[:2]
            found[target] = os.path.normpath(source)
        return found

    grafana = mounts("grafana")
    assert grafana[GRAFANA_DASHBOARDS_PATH] == "monitoring/grafana/dashboards"
    assert grafana[GRAFANA_PROVISIONING_PATH] == "monitoring/grafana/provisioning"
    assert "monitoring/prometheus" in mounts("prometheus").values()
