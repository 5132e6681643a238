"""Many simulated workers in one process each (``--simulated-workers N``): every one registers
with its own id and ports, the real router spreads requests over them, and stopping the process
deregisters them all (docs/simulation.md)."""

from __future__ import annotations

import concurrent.futures
import dataclasses
import re
import urllib.request

import httpx
import pytest

from services.worker.config import WorkerConfig
from services.worker_pool import pool_configs
from tests.router.cluster import MODEL, Cluster, Router, wait_until

NUM_PREFILL, NUM_DECODE = 2, 8


def pool_args(count: int) -> tuple[str, ...]:
    return ("--simulate", "h100-llama3-8b", "--simulated-workers", str(count))


def finished(metrics_port: int) -> float:
    """Requests a hosted worker finished (its own /metrics)."""
    url = f"http://127.0.0.1:{metrics_port}/metrics"
    text = urllib.request.urlopen(url, timeout=5).read().decode()
    match = re.search(r'^pdserve_requests_total\{outcome="finished"\} (\S+)$', text, re.M)
    return float(match.group(1)) if match else 0.0


def roles(router: Router) -> list[str]:
    _, body = router.get("/v1/workers")
    return sorted(w["role"] for w in body["data"] if w["healthy"])


def test_many_workers_in_one_process_register_serve_and_leave(redis_server) -> None:  # type: ignore[no-untyped-def]
    c = Cluster(redis_server.url)
    try:
        [prefill] = c.add_workers("prefill", extra=pool_args(NUM_PREFILL))
        [decode] = c.add_workers("decode", extra=pool_args(NUM_DECODE))
        hosted = decode.info["workers"]
        assert len(hosted) == NUM_DECODE and len(prefill.info["workers"]) == NUM_PREFILL
        for key in ("worker_id", "grpc_address", "metrics_port"):
            assert len({w[key] for w in hosted}) == NUM_DECODE, key
        assert {w["pid"] for w in hosted} == {decode.info["pid"]}

        router = c.add_router("--disaggregation", "always", "--decode-policy", "round_robin")
        router.wait_ready(num_workers=NUM_PREFILL + NUM_DECODE)
        _, body = router.get("/v1/workers")
        assert len({w["id"] for w in body["data"]}) == NUM_PREFILL + NUM_DECODE

        def complete(i: int) -> str:
            body = {"model": MODEL, "prompt": f"Request {i}: hello", "max_tokens": 4}
            response = httpx.post(router.url + "/v1/completions", json=body, timeout=60)
            assert response.status_code == 200, response.text
            return str(response.json()["choices"][0]["text"])

        with concurrent.futures.ThreadPoolExecutor(8) as pool:
            texts = list(pool.map(complete, range(2 * NUM_DECODE)))
        assert len(set(texts)) > 1
        served = [finished(w["metrics_port"]) for w in hosted]
        assert sum(served) == 2 * NUM_DECODE
        assert sum(1 for n in served if n) >= NUM_DECODE // 2, served  # spread over the pool

        decode.terminate(timeout=30)  # SIGTERM: all of them drain and deregister
        assert decode.exit_code == 0, decode.output_tail()
        assert wait_until(lambda: roles(router) == ["prefill"] * NUM_PREFILL, timeout=5)
    except BaseException:
        c.dump()
        raise
    finally:
        c.stop()


def test_the_first_hosted_worker_keeps_the_fixed_ports() -> None:
    """In a container the probes and the scrape find the first worker at the fixed ports."""
    config = WorkerConfig(
        role="decode", simulate="h100-llama3-8b", simulated_workers=3, grpc_port=50051,
        metrics_port=9100, worker_id="d",
    )  # fmt: skip
    hosted = pool_configs(config)
    assert [c.worker_id for c in hosted] == ["d-0", "d-1", "d-2"]
    assert [(c.grpc_port, c.metrics_port) for c in hosted] == [(50051, 9100), (0, 0), (0, 0)]
    assert {c.simulated_workers for c in hosted} == {1}
    quiet = pool_configs(dataclasses.replace(config, metrics_port=-1))
    assert [c.metrics_port for c in quiet] == [-1, -1, -1]
    with pytest.raises(ValueError, match="--simulate"):
        WorkerConfig(role="decode", simulated_workers=2)
