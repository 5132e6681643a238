"""docker-compose.yml with simulated workers, for real (#32: the ``--simulate`` flag works in the
compose file, so an operator can rehearse a large layout on a small machine).

``PDSERVE_SIMULATE`` names a committed profile (``benchmarks/profiles``, mounted read-only into
the worker containers) and ``PDSERVE_SIMULATED_WORKERS=3`` has each worker container host three
workers; ``--scale decode=2`` makes 3 prefill + 6 decode simulated workers behind the real router
and Redis, in their containers. Tests in order:

1. the router counts 9 healthy workers, each with its own id;
2. a short prompt (computed on a decode worker) and a long one (over
   ``PDSERVE_LOCAL_PREFILL_TOKENS``: prefilled on a prefill worker, its KV pulled across
   containers) answer with the text an offline simulated engine gives for the same token ids,
   and the router counted one decision of each kind;
3. ``down -v`` leaves no container, network or volume of the project behind.
"""

from __future__ import annotations

import re
import urllib.request
from collections.abc import Iterator

import pytest
from openai import OpenAI

from common.sampling_params import SamplingParams
from services.engine.config import EngineConfig
from services.engine.llm_engine import LLMEngine
from services.worker.simulation import load_profile
from tests.deploy.compose import Stack, docker_unavailable, started_stack, wait_for

pytestmark = [
    pytest.mark.compose,
    pytest.mark.skipif(docker_unavailable() is not None, reason=str(docker_unavailable())),
]

PROFILE = "h100-llama3-8b"  # benchmarks/profiles/sim-h100-llama3-8b.json: short steps
PER_CONTAINER, LOCAL_PREFILL_TOKENS, MAX_TOKENS = 3, 64, 12
SHORT = [1000 + 37 * i for i in range(20)]
LONG = [2000 + 53 * i for i in range(180)]  # over LOCAL_PREFILL_TOKENS: pulled


@pytest.fixture(scope="module")
def stack(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Stack]:
    env = {
        "PDSERVE_SIMULATE": f"/opt/pdserve/profiles/sim-{PROFILE}.json",
        "PDSERVE_SIMULATED_WORKERS": str(PER_CONTAINER),
        "PDSERVE_LOCAL_PREFILL_TOKENS": str(LOCAL_PREFILL_TOKENS),
    }
    up = ("--scale", "prefill=1", "--scale", "decode=2")
    with started_stack(tmp_path_factory.mktemp("secrets"), env, up) as system:
        yield system


@pytest.fixture(scope="module")
def client(stack: Stack) -> OpenAI:
    return OpenAI(base_url=stack.api, api_key="unused", max_retries=0, timeout=120)


def offline_text(prompt: list[int]) -> str:
    """The text a simulated engine in this process gives for ``prompt`` (greedy)."""
    engine = LLMEngine(EngineConfig(num_threads=1), simulation=load_profile(PROFILE))
    engine.add_request("offline", prompt, SamplingParams(max_tokens=MAX_TOKENS, temperature=0))
    text = ""
    while engine.has_unfinished_requests():
        for out in engine.step():
            text += out.outputs[0].text  # each output carries what is new since the last
    return text


def decisions(stack: Stack) -> dict[str, float]:
    """The router's ``pdserve_router_disaggregation_decisions_total`` as ``decision:reason``."""
    url = stack.api.removesuffix("/v1") + "/metrics"
    with urllib.request.urlopen(url, timeout=10) as response:
        text = response.read().decode()
    counts = {}
    for labels, value in re.findall(
        r"^pdserve_router_disaggregation_decisions_total\{([^}]*)\} (\S+)$", text, re.MULTILINE
    ):
        label = dict(re.findall(r'(\w+)="([^"]*)"', labels))
        counts[f"{label['decision']}:{label['reason']}"] = float(value)
    return counts


def test_every_hosted_worker_registers_with_its_own_id(stack: Stack) -> None:
    def all_healthy() -> bool:
        return (
            len(stack.healthy("prefill")) == PER_CONTAINER
            and len(stack.healthy("decode")) == 2 * PER_CONTAINER
        )

    wait_for(f"{3 * PER_CONTAINER} healthy simulated workers", all_healthy, timeout=120)
    ids = [w["id"] for w in stack.workers() if w["healthy"]]
    assert len(ids) == len(set(ids)) == 3 * PER_CONTAINER


def test_both_routes_give_the_offline_simulated_text(stack: Stack, client: OpenAI) -> None:
    model = client.models.list().data[0].id
    before = decisions(stack)
    for prompt in (SHORT, LONG):
        reply = client.completions.create(
            model=model, prompt=prompt, max_tokens=MAX_TOKENS, temperature=0
        )
        assert reply.usage is not None and reply.usage.completion_tokens == MAX_TOKENS
        assert reply.choices[0].text == offline_text(prompt), len(prompt)
    after = decisions(stack)
    grew = {k: v - before.get(k, 0.0) for k, v in after.items() if v > before.get(k, 0.0)}
    assert sorted(k.split(":")[0] for k in grew) == ["local", "remote"], after
    assert all(v == 1 for v in grew.values()), grew


def test_down_leaves_nothing_behind(stack: Stack) -> None:
    assert stack.take_down() == {"container": [], "network": [], "volume": []}
