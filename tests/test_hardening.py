"""Disaggregated edge cases on a real `pdserve up` (real Redis, two prefill workers and a decode
worker with small pools, the router), driven over real HTTP:

- a stop string that starts in the first token is held back exactly as a colocated worker
  would hold it back (the first token comes from the prefill worker, the rest from the decode
  worker);
- logprobs stay aligned with their tokens when the client reads slowly;
- a streaming client that leaves before its first token cancels the prefill;
- a decode pool too full to take a pull keeps the prefill worker's lease alive meanwhile, so no
  prefill is thrown away and recomputed (the prefill workers' leases are 1 s here, as long as
  the decode worker's renew interval: it must renew by the lease in the handle, not its own
  clock; every component traces to one file, to see the waits);
- one prefill worker killed while requests are in flight does not take the system down: the
  router moves what it was computing to the other one; the last one gone, `up` stops with a
  message naming the empty pool.

Every test ends with the workers holding no KV blocks.
"""

from __future__ import annotations

import json
import os
import re
import signal
import socket
import subprocess
import sys
import threading
import time
import urllib.request
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import pytest

from tests.test_up import Up, is_gone

MODEL = "SmolLM2-135M-Instruct"
PROMPT = "The capital of France is"
ARGS = ["--port", "0", "--prefill", "2", "--decode", "1", "--threads", "1"]
ARGS += ["--num-blocks", "48", "--max-num-batched-tokens", "64", "--disaggregation", "always"]


LEASE_SECONDS = 1.0
LEASE_RENEW_SECONDS = 1.0  # the default: renewals must follow the lease, not this interval


@pytest.fixture(scope="module")
def trace_file(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("traces") / "spans.jsonl"


@pytest.fixture(scope="module")
def up(trace_file: Path) -> Iterator[Up]:
    env = {
        **os.environ,
        "PDSERVE_LEASE_SECONDS": str(LEASE_SECONDS),
        "PDSERVE_LEASE_RENEW_SECONDS": str(LEASE_RENEW_SECONDS),
    }
    proc = subprocess.Popen(
        [sys.executable, "-m", "pdserve.cli", "up", *ARGS, "--trace-file", str(trace_file)],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        env=env,
    )
    system = Up(proc)
    system.reader = threading.Thread(target=system.pump, daemon=True)
    system.reader.start()
    deadline = time.monotonic() + 240
    while not system.summary_done.wait(0.2):
        if proc.poll() is not None or time.monotonic() > deadline:
            proc.kill()
            pytest.fail(f"pdserve up did not come up:\n{system.output}")
    yield system
    if proc.poll() is None:
        proc.send_signal(signal.SIGINT)
        proc.wait(timeout=90)


def url(up: Up) -> str:
    return up.find(r"pdserve is up: (http://\S+)")


def metrics_port(up: Up, name: str) -> int:
    return int(up.find(rf"^  {name} +pid \d+ .*metrics :(\d+)"))


def scrape(address: str) -> str:
    return urllib.request.urlopen(address + "/metrics", timeout=10).read().decode()


def sample(text: str, metric: str, labels: str = "", required: bool = False) -> float:
    """One sample of a Prometheus text page (0 when absent, unless ``required``)."""
    pattern = re.escape(metric) + (r"\{" + re.escape(labels) + r"\}" if labels else "") + r" (\S+)"
    match = re.search("^" + pattern + "$", text, re.MULTILINE)
    assert match or not required, f"{metric} {labels} is not exported"
    return float(match.group(1)) if match else 0.0


def worker_metric(
    up: Up, name: str, metric: str, labels: str = "", required: bool = False
) -> float:
    return sample(scrape(f"http://127.0.0.1:{metrics_port(up, name)}"), metric, labels, required)


def router_metric(up: Up, metric: str, labels: str = "") -> float:
    return sample(scrape(url(up)), metric, labels)


def retries(up: Up, pool: str = "") -> float:
    """Calls the router moved to another worker or asked again, of ``pool`` (all: "")."""
    labels = rf'pool="{pool}",.*' if pool else ".*"
    pattern = rf"^pdserve_router_retries_total\{{{labels}\}} (\S+)$"
    return sum(float(v) for v in re.findall(pattern, scrape(url(up)), re.M))


def no_blocks_in_use(
    up: Up, workers: tuple[str, ...] = ("prefill-0", "prefill-1", "decode-0")
) -> bool:
    deadline = time.monotonic() + 15
    while time.monotonic() < deadline:
        used = [worker_metric(up, w, "pdserve_kv_blocks", 'state="used"') for w in workers]
        if not any(used):
            return True
        time.sleep(0.2)
    return False


def complete(up: Up, **fields: object) -> httpx.Response:
    body = {"model": MODEL, "prompt": PROMPT, "temperature": 0, **fields}
    return httpx.post(url(up) + "/v1/completions", json=body, timeout=120)


def stream_events(response: httpx.Response) -> list[dict]:
    events = []
    for line in response.iter_lines():
        if line.startswith("data: ") and line != "data: [DONE]":
            events.append(json.loads(line[len("data: ") :]))
    return events


def test_a_stop_string_starting_in_the_first_token_is_held_back(up: Up) -> None:
    whole = complete(up, max_tokens=12).json()["choices"][0]["text"]
    first = complete(up, max_tokens=1).json()["choices"][0]["text"]
    assert whole.startswith(first) and len(first) >= 2
    stop = whole[: len(first) + 2]  # begins in the first token, ends in the second or third
    plain = complete(up, max_tokens=12, stop=[stop]).json()["choices"][0]
    assert plain["text"] == "" and plain["finish_reason"] == "stop"
    with httpx.stream(
        "POST",
        url(up) + "/v1/completions",
        json={
            "model": MODEL,
            "prompt": PROMPT,
            "temperature": 0,
            "max_tokens": 12,
            "stop": [stop],
            "stream": True,
        },
        timeout=120,
    ) as response:
        events = stream_events(response)
    streamed = "".join(e["choices"][0]["text"] for e in events if e["choices"])
    assert streamed == "" and events[-1]["choices"][0]["finish_reason"] == "stop"
    assert no_blocks_in_use(up)


def test_logprobs_stay_aligned_when_the_client_lags(up: Up) -> None:
    body = {
        "model": MODEL,
        "prompt": PROMPT,
        "temperature": 0,
        "max_tokens": 24,
        "ignore_eos": True,
        "logprobs": 2,
        "stream": True,
    }
    tokens = 0
    with httpx.stream("POST", url(up) + "/v1/completions", json=body, timeout=120) as response:
        for line in response.iter_lines():
            if not line.startswith("data: {"):
                continue
            time.sleep(0.15)  # a slow reader: the worker merges what it has not read yet
            choice = json.loads(line[len("data: ") :])["choices"][0]
            logprobs = choice["logprobs"]
            if logprobs is None:
                continue
            assert len(logprobs["tokens"]) == len(logprobs["token_logprobs"])
            assert len(logprobs["top_logprobs"]) == len(logprobs["tokens"])
            tokens += len(logprobs["tokens"])
    assert tokens == 24
    assert no_blocks_in_use(up)


def test_a_client_leaving_before_the_first_token_cancels_the_prefill(up: Up) -> None:
    long_prompt = "Tell me everything about the history of paged attention. " * 60  # ~660 tokens
    pinned = [
        worker_metric(up, f"prefill-{i}", "pdserve_requests_total", 'outcome="pinned"')
        for i in (0, 1)
    ]
    body = json.dumps({"model": MODEL, "prompt": long_prompt, "max_tokens": 4, "stream": True})
    host, port = url(up).removeprefix("http://").split(":")
    with socket.create_connection((host, int(port))) as sock:  # headers come with token 1
        head = f"POST /v1/completions HTTP/1.1\r\nHost: {host}\r\n"
        head += f"Content-Type: application/json\r\nContent-Length: {len(body)}\r\n\r\n"
        sock.sendall(head.encode() + body.encode())
        time.sleep(0.3)  # the prefill is running (11 chunks of 64 tokens); leave now

    def settled() -> bool:
        """The router serves nothing and neither prefill worker runs or queues a request: a
        prefill not cancelled would have ended (and been counted) by then."""
        if router_metric(up, "pdserve_router_requests_in_flight"):
            return False
        names = ("pdserve_num_running", "pdserve_num_waiting")
        return not any(worker_metric(up, f"prefill-{i}", m) for i in (0, 1) for m in names)

    deadline = time.monotonic() + 30
    while not settled():  # instead of a fixed 3 s, which a slow prefill could outlast
        assert time.monotonic() < deadline, "the prefill workers never settled"
        time.sleep(0.1)
    after = [
        worker_metric(up, f"prefill-{i}", "pdserve_requests_total", 'outcome="pinned"')
        for i in (0, 1)
    ]
    assert after == pinned, "the prefill ran to the end although its client had left"
    assert no_blocks_in_use(up)


def spans(trace_file: Path, name: str, trace_ids: set[str], count: int) -> list[dict]:
    """The ``count`` spans called ``name`` of these traces, once every component exported them."""
    found: list[dict] = []
    deadline = time.monotonic() + 20
    while time.monotonic() < deadline:
        lines = trace_file.read_text().splitlines() if trace_file.exists() else []
        records = [json.loads(line) for line in lines if line]
        found = [r for r in records if r["name"] == name and r["trace_id"] in trace_ids]
        if len(found) >= count:
            break
        time.sleep(0.5)
    return found


def lease_counters(up: Up) -> dict[str, float]:
    """What would show a lease lost or a prefill thrown away, and the pulls that went well."""
    counters = {
        f"{p} lease expirations": worker_metric(
            up, p, "pdserve_lease_expirations_total", required=True
        )
        for p in ("prefill-0", "prefill-1")
    }
    for outcome in ("pulled", "recomputed", "failed"):
        value = worker_metric(up, "decode-0", "pdserve_kv_pulls_total", f'outcome="{outcome}"')
        counters[f"decode {outcome}"] = value
    for source in ("pulled", "recomputed"):
        labels = f'source="{source}"'
        counters[f"router {source}"] = router_metric(up, "pdserve_router_kv_sources_total", labels)
    counters["router retries"] = retries(up)
    return counters


def test_a_full_decode_pool_keeps_the_prefill_lease_alive(up: Up, trace_file: Path) -> None:
    """Six prompts that share no prefix, 64 tokens each: 48 decode blocks take at most four at
    once, so some wait for room (their decode.reserve spans) longer than the prefill workers'
    1 s lease, which the decode worker renews meanwhile. Every request still pulls its KV: no
    lease runs out, nothing is recomputed or fails, no call is retried."""
    before = lease_counters(up)
    # ~145 tokens each, different from the first block on: no prefix is shared in the decode
    # worker's cache, so each takes 10 blocks of its own, 14 once its tokens are generated
    prompts = [
        f"Story {i}: " + "Write a long story about a robot who learns to cook. " * 12
        for i in range(6)
    ]
    with ThreadPoolExecutor(6) as pool:
        answers = list(
            pool.map(lambda p: complete(up, prompt=p, max_tokens=64, ignore_eos=True), prompts)
        )
    assert all(a.status_code == 200 for a in answers), [a.text for a in answers]
    trace_ids = {a.headers["x-pdserve-trace-id"] for a in answers}
    waits = spans(trace_file, "decode.reserve", trace_ids, 6)
    waited = sorted(round(s["duration_ms"]) for s in waits)
    after = lease_counters(up)
    shown = f"waits for room (ms): {waited}; counters before {before}, after {after}"
    assert len(waits) == 6, shown
    assert waited[-1] > 1500 * LEASE_SECONDS, shown  # a wait the lease alone would not survive
    usages = [a.json()["usage"] for a in answers]
    assert all(u["completion_tokens"] == 64 for u in usages)
    sources = [t["kv_source"] for u in usages for t in u["pdserve_timings"]]
    assert sources == ["pulled"] * 6, shown
    pulled = {key: before[key] + 6 for key in ("decode pulled", "router pulled")}
    assert after == {**before, **pulled}, shown
    assert no_blocks_in_use(up)


def test_one_dead_prefill_worker_does_not_stop_the_system(up: Up) -> None:
    """Runs last: it kills the prefill workers. prefill-0 is killed while 16 requests are in
    flight, some being computed there, two or more computed there and waiting for room on the
    decode worker. Every request completes: the router moves the prefills that died to
    prefill-1 (retries), and the decode worker computes itself the prompts whose KV it can no
    longer pull (kv_source "recomputed"). Requests sent afterwards are served too; with
    prefill-1 killed as well, `up` stops with a message naming the empty pool."""
    pids = up.summary_pids
    finished = worker_metric(up, "prefill-0", "pdserve_requests_total", 'outcome="pinned"')
    recomputed = router_metric(up, "pdserve_router_kv_sources_total", 'source="recomputed"')
    moved = retries(up, "prefill")
    # ~200 tokens each (13 blocks: a worker holds 3 of them), none sharing a prefix; 64 tokens
    # to generate keep the decode worker full (2 at a time), so computed prompts wait
    prompts = [f"Request {i}: " + "Tell me about the history of Paris. " * 24 for i in range(16)]

    def handed_over_and_busy() -> bool:
        """prefill-0 holds two computed prompts the decode worker has no room for yet, and
        computes another one."""
        done = worker_metric(up, "prefill-0", "pdserve_requests_total", 'outcome="pinned"')
        held = worker_metric(up, "prefill-0", "pdserve_pinned_requests")
        busy = worker_metric(up, "prefill-0", "pdserve_num_running")
        full = worker_metric(up, "decode-0", "pdserve_num_waiting")
        return done >= finished + 2 and held >= 2 and busy >= 1 and full >= 1

    with ThreadPoolExecutor(len(prompts)) as pool:
        futures = [
            pool.submit(complete, up, prompt=p, max_tokens=64, ignore_eos=True) for p in prompts
        ]
        deadline = time.monotonic() + 90
        while not handed_over_and_busy():
            assert time.monotonic() < deadline, "prefill-0 never held prompts while busy"
            time.sleep(0.02)
        in_flight = sum(not f.done() for f in futures)
        os.kill(pids["prefill-0"], signal.SIGKILL)
        answers = [f.result() for f in futures]
    failed = [(i, a.status_code, a.text) for i, a in enumerate(answers) if a.status_code != 200]
    assert not failed, f"{len(failed)} of the {in_flight} requests in flight failed: {failed}"
    assert in_flight >= 12, f"only {in_flight} requests were in flight when prefill-0 died"
    for answer in answers:
        choice, usage = answer.json()["choices"][0], answer.json()["usage"]
        assert choice["finish_reason"] == "length" and usage["completion_tokens"] == 64
    assert retries(up, "prefill") > moved, "no prefill was moved off prefill-0"
    again = router_metric(up, "pdserve_router_kv_sources_total", 'source="recomputed"')
    assert again > recomputed, "no computed prompt of prefill-0 was waiting for the decode worker"
    up.wait_for(r"(prefill-0 .*killed by SIGKILL.*)", timeout=30)
    for _ in range(4):
        assert complete(up, max_tokens=4).status_code == 200
    assert up.proc.poll() is None, up.output
    assert no_blocks_in_use(up, ("prefill-1", "decode-0"))
    os.kill(pids["prefill-1"], signal.SIGKILL)
    assert up.proc.wait(timeout=90) == 1
    assert "no prefill worker is left" in up.output, up.output
    assert all(is_gone(pid) for pid in pids.values()), up.output
