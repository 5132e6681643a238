"""docs/metrics.md is the metrics reference: every metric a real router and real prefill,
decode and colocated workers export is listed there with its type, for the components that
export it, and nothing is listed that they do not export. No ``_created`` series; probes are not
counted as requests."""

from __future__ import annotations

import re
import urllib.request
from pathlib import Path

import pytest

from tests.router.cluster import Cluster

DOC = Path(__file__).resolve().parents[1] / "docs" / "metrics.md"
SECTIONS = {  # doc section -> the components that export its metrics
    "Router": {"router"},
    "Every worker": {"prefill", "decode", "colocated"},
    "Prefill (and colocated) workers": {"prefill", "colocated"},
    "Decode (and colocated) workers": {"decode", "colocated"},
}
PROBES = ("/health", "/ping", "/ready", "/version", "/v1/workers", "/metrics")


def documented() -> dict[str, dict[str, str]]:
    """component -> {metric name: type}, from the doc's tables."""
    found: dict[str, dict[str, str]] = {c: {} for cs in SECTIONS.values() for c in cs}
    section = ""
    for line in DOC.read_text().splitlines():
        if line.startswith("## "):
            section = line[3:].strip()
        match = re.match(r"^\| `(pdserve_\w+)` \| (\w+) \|", line)
        if match and section in SECTIONS:
            for component in SECTIONS[section]:
                found[component][match.group(1)] = match.group(2)
    return found


def exported(url: str) -> tuple[dict[str, str], str]:
    """{metric name as queried (counters with _total): type} and the raw text."""
    text = urllib.request.urlopen(url, timeout=10).read().decode()
    families = {}
    for name, kind in re.findall(r"^# TYPE (\S+) (\S+)$", text, re.MULTILINE):
        counter = kind == "counter" and not name.endswith("_total")
        families[name + "_total" if counter else name] = kind
    return families, text


@pytest.fixture(scope="module")
def scrapes(redis_server) -> dict[str, tuple[dict[str, str], str]]:  # type: ignore[no-untyped-def]
    c = Cluster(redis_server.url)
    try:
        c.add_workers("prefill", "decode")
        colocated = Cluster(redis_server.url)
        colocated.add_workers("colocated")
        c.workers += colocated.workers
        router = c.add_router("--ttft-slo-seconds", "1", "--itl-slo-seconds", "0.1")
        router.wait_ready(num_workers=2)
        for path in PROBES:
            router.get(path)
        client = router.client()
        client.completions.create(model="SmolLM2-135M-Instruct", prompt="Hi", max_tokens=2)
        result = {"router": exported(router.url + "/metrics")}
        for worker in c.workers:
            url = f"http://127.0.0.1:{worker.info['metrics_port']}/metrics"
            result[worker.role] = exported(url)
        return result
    finally:
        c.stop()


@pytest.mark.parametrize("component", ["router", "prefill", "decode", "colocated"])
def test_exported_metrics_are_exactly_the_documented_ones(scrapes, component: str) -> None:  # type: ignore[no-untyped-def]
    families, text = scrapes[component]
    docs = documented()[component]
    assert set(families) - set(docs) == set(), "exported but not in docs/metrics.md"
    assert set(docs) - set(families) == set(), "in docs/metrics.md but not exported"
    assert {name: families[name] for name in docs} == docs, "types differ from the doc"
    assert "_created" not in text


def test_probes_are_not_counted_as_requests(scrapes) -> None:  # type: ignore[no-untyped-def]
    _, text = scrapes["router"]
    counted = re.findall(r'^pdserve_router_requests_total\{endpoint="([^"]+)"', text, re.MULTILINE)
    assert "/v1/completions" in counted
    assert not set(PROBES) & set(counted)


def step_counts(text: str) -> dict[str, float]:
    """``pdserve_engine_step_seconds_count`` by ``kind``."""
    pattern = r'^pdserve_engine_step_seconds_count\{kind="(\w+)"\} (\S+)$'
    return {kind: float(n) for kind, n in re.findall(pattern, text, re.MULTILINE)}


def test_engine_steps_are_counted_by_kind(scrapes) -> None:  # type: ignore[no-untyped-def]
    """The fixture's one 2-token request: one step computed its prompt (on whichever worker the
    router chose) and one decoded its second token on the decode worker; the prefill worker
    never decodes, and the idle colocated worker counted nothing. Every kind is exported from
    the start."""
    counts = {c: step_counts(scrapes[c][1]) for c in ("prefill", "decode", "colocated")}
    assert all(set(v) == {"prompt", "decode", "mixed"} for v in counts.values())
    assert counts["colocated"] == {"prompt": 0, "decode": 0, "mixed": 0}
    assert counts["prefill"]["decode"] == counts["prefill"]["mixed"] == 0
    assert counts["prefill"]["prompt"] + counts["decode"]["prompt"] == 1
    assert counts["decode"]["decode"] == 1 and counts["decode"]["mixed"] == 0
