"""Disaggregated edge cases on a real `pdserve up` (real Redis, two prefill workers and a decode
worker with small pools, the router), driven over real HTTP:

- a stop string that starts in the first token is held back exactly as a colocated worker
  would hold it back (the first token comes from the prefill worker, the rest from the decode
  worker);
- logprobs stay aligned with their tokens when the client reads slowly;
- a streaming client that leaves before its first token cancels the prefill;
- a decode pool too full to take a pull keeps the prefill worker's lease alive meanwhile, so no
  prefill is thrown away and recomputed (the prefill workers' leases are 1 s here);
- one prefill worker killed does not take the system down while the other serves; the last one
  gone, `up` stops with a message naming the empty pool.

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

import httpx
import pytest

from tests.test_up import Up, is_gone

MODEL = "SmolLM2-135M-Instruct"
PROMPT = "The capital of France is"
ARGS = ["--port", "0", "--prefill", "2", "--decode", "1", "--threads", "1"]
ARGS += ["--num-blocks", "48", "--max-num-batched-tokens", "64", "--disaggregation", "always"]


@pytest.fixture(scope="module")
def up() -> Iterator[Up]:
    env = {**os.environ, "PDSERVE_LEASE_SECONDS": "1"}
    proc = subprocess.Popen(
        [sys.executable, "-m", "pdserve.cli", "up", *ARGS],
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


def worker_metric(up: Up, name: str, metric: str, labels: str = "") -> float:
    text = (
        urllib.request.urlopen(f"http://127.0.0.1:{metrics_port(up, name)}/metrics", timeout=10)
        .read()
        .decode()
    )
    pattern = re.escape(metric) + (r"\{" + re.escape(labels) + r"\}" if labels else "") + r" (\S+)"
    match = re.search("^" + pattern + "$", text, re.MULTILINE)
    return float(match.group(1)) if match else 0.0


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
    time.sleep(3)
    after = [
        worker_metric(up, f"prefill-{i}", "pdserve_requests_total", 'outcome="pinned"')
        for i in (0, 1)
    ]
    assert after == pinned, "the prefill ran to the end although its client had left"
    assert no_blocks_in_use(up)


def test_a_full_decode_pool_keeps_the_prefill_lease_alive(up: Up) -> None:
    """48 decode blocks hold 2-3 of these requests at once; the others wait longer than the
    prefill workers' 1 s lease for room, renewing it, and still pull their KV."""
    recomputed = worker_metric(up, "decode-0", "pdserve_kv_pulls_total", 'outcome="recomputed"')
    prompt = "Write a long story about a robot who learns to cook. " * 12  # ~145 tokens
    with ThreadPoolExecutor(6) as pool:
        answers = list(
            pool.map(
                lambda i: complete(up, prompt=prompt + str(i), max_tokens=64, ignore_eos=True),
                range(6),
            )
        )
    assert all(a.status_code == 200 for a in answers), [a.text for a in answers]
    assert all(a.json()["usage"]["completion_tokens"] == 64 for a in answers)
    after = worker_metric(up, "decode-0", "pdserve_kv_pulls_total", 'outcome="recomputed"')
    assert after == recomputed, "a prefill was thrown away while the decode pool was full"
    assert no_blocks_in_use(up)


def test_one_dead_prefill_worker_does_not_stop_the_system(up: Up) -> None:
    """Runs last: it kills the prefill workers."""
    pids = up.summary_pids
    os.kill(pids["prefill-0"], signal.SIGKILL)
    up.wait_for(r"(prefill-0 .*killed by SIGKILL.*)", timeout=30)
    for _ in range(4):
        assert complete(up, max_tokens=4).status_code == 200
    assert up.proc.poll() is None, up.output
    assert no_blocks_in_use(up, ("prefill-1", "decode-0"))
    os.kill(pids["prefill-1"], signal.SIGKILL)
    assert up.proc.wait(timeout=90) == 1
    assert "no prefill worker is left" in up.output, up.output
    assert all(is_gone(pid) for pid in pids.values()), up.output
