"""`pdserve up --simulate PROFILE --prefill N --decode M`: one process per role hosts that role's
simulated workers; the router lists all of them, answers the OpenAI API through them, and a
signal stops everything (docs/simulation.md)."""

from __future__ import annotations

import json
import signal
import urllib.request

import openai

from tests.test_up import is_gone, start_up, stop

NUM_PREFILL, NUM_DECODE = 2, 6


def test_up_simulate_starts_a_pool_per_role_and_serves() -> None:
    up = start_up(
        "--simulate", "h100-llama3-8b", "--prefill", str(NUM_PREFILL), "--decode", str(NUM_DECODE)
    )
    try:
        pids = up.summary_pids
        assert {"prefill-x2", "decode-x6", "router"} <= set(pids), up.output
        url = up.find(r"^pdserve is up: (http://\S+)")
        model = up.find(r"^pdserve is up: \S+ \(model (.+)\)$")
        with urllib.request.urlopen(url + "/v1/workers", timeout=10) as response:
            listed = json.loads(response.read())["data"]
        roles = sorted(w["role"] for w in listed if w["healthy"])
        assert roles == ["decode"] * NUM_DECODE + ["prefill"] * NUM_PREFILL, listed
        client = openai.OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0, timeout=60)
        messages = [{"role": "user", "content": "Hello from a simulated cluster!"}]
        answers = [
            client.chat.completions.create(
                model=model,
                messages=messages,  # type: ignore[arg-type]
                max_tokens=6,
                temperature=0,
            )
            for _ in range(3)
        ]
        texts = {a.choices[0].message.content for a in answers}
        assert len(texts) == 1 and texts != {""}  # deterministic, on whichever worker
        assert all(a.usage is not None and a.usage.completion_tokens == 6 for a in answers)
    finally:
        code = stop(up, signal.SIGTERM)
    assert code == 0, up.output
    assert all(is_gone(pid) for pid in pids.values())
