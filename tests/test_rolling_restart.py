"""A rolling restart of `pdserve up` under steady traffic loses no request (issue #31).

`pdserve up` (1 prefill + 1 decode) gets SIGUSR1 while `pdserve-loadtest` sends streamed greedy
completions at a constant rate: the router, the prefill and the decode worker are replaced one
at a time (each replacement ready before the old one drains). Then: not one request failed,
every answer equals the reference for its prompt (asked before the restart, unstreamed: another
path through the router), the new workers' KV pools are idle again (nothing leaked), and a stop
leaves no process behind, old or new.

While the router is replaced, a second client also asks /v1/models as fast as it can over 16
keep-alive connections: none of its requests may fail either. (A router that closes its idle
connections at once on SIGTERM, as uvicorn's shutdown does, fails about one such request per
replacement: one written on a connection just as it was closed. This part catches that often,
not always.)
"""

from __future__ import annotations

import asyncio
import json
import re
import signal
import subprocess
import sys
import threading
import time
import urllib.request
from pathlib import Path

import httpx
import openai
import pytest
from prometheus_client.parser import text_string_to_metric_families

from tests.test_up import Up, assert_stopped_cleanly, start_up, stop

BASE = (
    "pdserve serves a language model with prefill and decode in separate worker processes; "
    "the router speaks the OpenAI API and the decode workers pull the KV cache blocks from the "
    "prefill workers. "
)
# Prompt lengths from a few tokens to several 16-token blocks: some hand-offs move KV blocks.
PROMPTS = ["The capital of France is", BASE[:60], BASE, "Once upon a time, in a village,", BASE * 2]
MAX_TOKENS = 12
RATE = 1.5  # requests/s: steady, below what the 2-core machine serves while workers load
LEAD_SECONDS = 3.0  # traffic before the first replacement starts
TAIL_SECONDS = 4.0  # traffic after the last old component has exited
ROLL_TIMEOUT = 150.0
# What must be 0 on an idle worker (as benchmarks/chaos.py's leak check reads them).
IDLE_SAMPLES = {
    "kv_blocks_used": ("pdserve_kv_blocks", {"state": "used"}),
    "pinned_requests": ("pdserve_pinned_requests", {}),
    "pulling_requests": ("pdserve_pulling_requests", {}),
    "kv_readers": ("pdserve_kv_readers", {}),
}


def references(url: str, model: str) -> list[str]:
    """Each prompt's greedy answer, unstreamed, before any restart."""
    client = openai.OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0, timeout=60)
    answers = []
    for prompt in PROMPTS:
        reply = client.completions.create(
            model=model,
            prompt=prompt,
            max_tokens=MAX_TOKENS,
            temperature=0,
            extra_body={"ignore_eos": True},
        )
        assert reply.usage is not None and reply.usage.completion_tokens == MAX_TOKENS
        answers.append(reply.choices[0].text)
    return answers


def start_load(url: str, model: str, tmp_path: Path) -> subprocess.Popen[str]:
    """`pdserve-loadtest` cycling through PROMPTS at RATE until interrupted (SIGINT)."""
    dataset = tmp_path / "prompts.jsonl"
    records = [{"prompt": p, "max_tokens": MAX_TOKENS} for p in PROMPTS]
    dataset.write_text("".join(json.dumps(r) + "\n" for r in records))
    command = [sys.executable, "-m", "loadtest", "--base-url", url, "--model", model]
    command += ["--dataset-name", "custom", "--dataset-path", str(dataset)]
    command += ["--ignore-eos", "--temperature", "0"]
    command += ["--request-rate", str(RATE), "--burstiness", "inf", "--duration", "600"]
    command += ["--save-result", "--no-plots", "--result-dir", str(tmp_path)]
    command += ["--result-filename", "load.json", "--disable-tqdm"]
    return subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)


class Hammer:
    """GET /v1/models over 16 keep-alive connections, in a loop, in a thread of its own."""

    def __init__(self, url: str):
        self.url = url + "/v1/models"
        self.ok = 0
        self.errors: list[str] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=asyncio.run, args=(self._run(),), daemon=True)
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(timeout=30)
        assert not self._thread.is_alive()

    async def _run(self) -> None:
        limits = httpx.Limits(max_connections=16, max_keepalive_connections=16)
        async with httpx.AsyncClient(limits=limits, timeout=30, trust_env=False) as client:
            await asyncio.gather(*(self._ask(client) for _ in range(16)))

    async def _ask(self, client: httpx.AsyncClient) -> None:
        while not self._stop.is_set():
            try:
                answer = await client.get(self.url)
                if answer.status_code == 200:
                    self.ok += 1
                else:
                    self.errors.append(f"{answer.status_code} {answer.text[:200]}")
            except httpx.HTTPError as exc:
                self.errors.append(repr(exc))


def idle_counters(port: int) -> dict[str, float]:
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5) as answer:
        text = answer.read().decode()
    values = dict.fromkeys(IDLE_SAMPLES, 0.0)
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            for key, (name, labels) in IDLE_SAMPLES.items():
                if sample.name == name and labels.items() <= sample.labels.items():
                    values[key] += sample.value
    return values


def assert_idle(port: int) -> None:
    """The worker at metrics ``port`` holds no block, pin, pull or reader (within 10 s)."""
    deadline = time.monotonic() + 10
    while any((values := idle_counters(port)).values()) and time.monotonic() < deadline:
        time.sleep(0.2)
    assert not any(values.values()), values


def replacement(up: Up, name: str) -> tuple[int, int | None]:
    """The pid and metrics port of ``name``'s replacement: up prints its summary line again."""
    lines = re.findall(rf"^  {name} +pid (\d+)(?:.* metrics :(\d+))?", up.output, re.M)
    assert len(lines) == 2, up.output  # the summary's, then the replacement's
    pid, port = lines[-1]
    assert pid != lines[0][0], up.output
    return int(pid), int(port) if port else None


@pytest.mark.timeout(300)
def test_rolling_restart_under_load_loses_no_request(tmp_path: Path) -> None:
    up = start_up("--log-file", str(tmp_path / "up.log"))
    url = up.find(r"^pdserve is up: (http://\S+)")
    model = up.find(r"^pdserve is up: \S+ \(model (.+)\)$")
    pids = set(up.summary_pids.values())
    load = None
    try:
        expected = references(url, model)
        load = start_load(url, model, tmp_path)
        time.sleep(LEAD_SECONDS)
        assert load.poll() is None, load.communicate()[0]
        hammer = Hammer(url)
        up.proc.send_signal(signal.SIGUSR1)
        try:
            up.wait_for(r"^\[up\] (replaced router) in", ROLL_TIMEOUT)
        finally:
            hammer.stop()
        assert not hammer.errors and hammer.ok > 100, (hammer.ok, hammer.errors[:5])
        up.wait_for(r"^\[up\] (rolling restart done) in", ROLL_TIMEOUT)
        time.sleep(TAIL_SECONDS)
        load.send_signal(signal.SIGINT)  # stops sending; cancels what is in flight
        report = load.communicate(timeout=60)[0]
        for name in ("router", "prefill-0", "decode-0"):
            assert f"[up] replaced {name} in" in up.output, up.output
        assert "rolling restart stopped" not in up.output, up.output
        new = {name: replacement(up, name) for name in ("router", "prefill-0", "decode-0")}
        pids |= {pid for pid, _ in new.values()}

        result = json.loads((tmp_path / "load-interrupted.json").read_text())
        errors = [e for e in result["errors"] if e]
        assert result["failed"] == 0 and not errors, f"{errors}\n{report}\n{up.output}"
        texts = result["generated_texts"]
        assert result["completed"] == len(texts) >= 20, report
        for index, text in enumerate(texts):  # the load tester cycles through PROMPTS
            assert text == expected[index % len(PROMPTS)], (index, text, report)

        for name in ("prefill-0", "decode-0"):
            port = new[name][1]
            assert port is not None, up.output
            assert_idle(port)
        print(report)
        print(f"/v1/models while the router was replaced: {hammer.ok} answered, 0 failed")
        print("\n".join(line for line in up.lines if line.startswith("[up] replaced")))
    finally:
        if load is not None and load.poll() is None:
            load.kill()
            load.wait()
        code = stop(up, signal.SIGINT)
    assert_stopped_cleanly(up, code, pids, url)
