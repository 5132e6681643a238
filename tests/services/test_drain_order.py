"""A draining prefill worker stays registered until the KV handles it gave out are done with.

A decode worker accepts a handle only from a registered prefill worker (services/worker/
handles.py). A prefill worker that deregistered at SIGTERM, before the pins of its last
answers were pulled, made the decode worker refuse those handles: requests in flight during a
rolling restart failed (400 "no registered prefill worker"). Here the Generate call comes after
the prefill worker got SIGTERM, as it does when the router hands over a moment later: the pull
must succeed from the draining worker, which exits once its pin ended.
"""

from __future__ import annotations

import asyncio
import signal

import pytest

from common.sampling_params import SamplingParams
from tests.conftest import PROMPTS
from tests.services.workers import disaggregated, run, running, used_blocks

GREEDY = SamplingParams(temperature=0, max_tokens=12)


@pytest.fixture(scope="module")
def tokenizer(llm):  # type: ignore[no-untyped-def]
    return llm.get_tokenizer()


def test_a_handle_given_out_before_sigterm_is_still_pulled(redis_server, llm, tokenizer):  # type: ignore[no-untyped-def]
    expected = llm.generate(PROMPTS[:1], GREEDY)[0].outputs[0].token_ids
    args = ["--redis-url", redis_server.url, "--redis-prefix", "drain-order:"]
    with running([("prefill", args), ("decode", args)]) as (p, d):

        async def sigterm_prefill(answer) -> None:  # type: ignore[no-untyped-def]
            assert len(answer.kv.block_ids) > 0  # blocks to pull
            p.signal(signal.SIGTERM)
            await asyncio.sleep(1.5)  # past the decode worker's registry refresh (0.5 s)
            assert p.is_alive()  # draining: its pin is not done with

        result = run(
            disaggregated(
                p.info["grpc_address"],
                d.info["grpc_address"],
                "drain-order",
                tokenizer.encode(PROMPTS[0]),
                GREEDY,
                before_generate=sigterm_prefill,
            )
        )
        assert result.kv_source == "pulled", result
        assert result.token_ids == expected
        assert p.proc is not None and p.proc.wait(timeout=20) == 0
        assert used_blocks(d) == 0
