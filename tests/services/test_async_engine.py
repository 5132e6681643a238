"""The async step loop on the real default model: what a slow or stalled consumer costs, and what
a duplicate request id does (nothing, to the request that has it)."""

from __future__ import annotations

import asyncio

import pytest

from common.sampling_params import SamplingParams
from services.worker.async_engine import AsyncEngine
from tests.conftest import PROMPTS, assert_no_leaks

LONG = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True, logprobs=1)


def test_a_stalled_consumer_finds_one_merged_output_not_a_queue(llm):
    """The step loop never waits for a consumer and never queues per step for it: a request
    whose consumer reads nothing for 40 steps has one pending output, holding every token and
    logprob it missed, in order."""
    engine = llm.engine
    [expected] = llm.generate(PROMPTS[0], LONG)

    async def run() -> None:
        loop = AsyncEngine(engine)
        loop.start()
        try:
            stream, _ = await loop.add_request("stalled", engine.tokenizer.encode(PROMPTS[0]), LONG)
            while engine.has_unfinished_requests():  # the consumer reads nothing meanwhile
                await asyncio.sleep(0.05)
            assert stream._pending is not None and stream._pending.finished
            outputs = [o async for o in loop.outputs("stalled", stream)]
            assert len(outputs) == 1
            [out] = outputs[0].outputs
            assert out.token_ids == expected.outputs[0].token_ids
            assert out.text == expected.outputs[0].text
            assert out.logprobs is not None and len(out.logprobs) == len(out.token_ids) == 40
        finally:
            await loop.stop()

    asyncio.run(run())
    assert_no_leaks(engine)


def test_a_duplicate_request_id_is_refused_without_touching_the_first(llm):
    engine = llm.engine
    [expected] = llm.generate(PROMPTS[1], LONG)
    prompt = engine.tokenizer.encode(PROMPTS[1])

    async def run() -> None:
        loop = AsyncEngine(engine)
        loop.start()
        try:
            stream, _ = await loop.add_request("same", prompt, LONG)
            for _ in range(3):
                with pytest.raises(ValueError, match="request_id 'same' is already in use"):
                    await loop.add_request("same", prompt, LONG)
                with pytest.raises(ValueError, match="already in use"):
                    await loop.add_prefilled("same", prompt, 1, LONG, None)
            merged = None
            async for output in loop.outputs("same", stream):
                if merged is None:
                    merged = output
                else:
                    merged.merge(output)
            assert (
                merged is not None and merged.outputs[0].token_ids == expected.outputs[0].token_ids
            )
        finally:
            await loop.stop()

    asyncio.run(run())
    assert_no_leaks(engine)
