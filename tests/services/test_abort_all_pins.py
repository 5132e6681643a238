"""Abort-all (an engine step that failed) goes through the pins' owner: a prefill-only request's
blocks stay allocated while a transfer reads them, and are freed once, when its pin is dropped
and the last reader left (the real default model, the real step loop and pin owner)."""

from __future__ import annotations

import asyncio

from common.sampling_params import SamplingParams
from kvtransfer.source import TensorBlockSource, pin_key
from services.worker.async_engine import AsyncEngine
from tests.conftest import PROMPTS, assert_no_leaks

PARAMS = SamplingParams(temperature=0, max_tokens=4)


def test_a_failed_step_frees_no_block_under_a_transfer(engine_llm, monkeypatch):
    engine = engine_llm.engine
    real_run = engine.run
    failures = [RuntimeError("injected: the step failed")]

    def failing_run(batch):  # type: ignore[no-untyped-def]
        if failures:
            raise failures.pop()
        return real_run(batch)

    monkeypatch.setattr(engine, "run", failing_run)

    async def run() -> None:
        loop = asyncio.get_running_loop()
        async_engine = AsyncEngine(engine)
        freed: list[asyncio.Task[bool]] = []

        def on_unpin(request_id: str) -> None:  # what the worker wires (services/server.py)
            freed.append(loop.create_task(async_engine.release_pinned(request_id)))

        pins = TensorBlockSource(engine.kv_cache, lease_seconds=30, on_unpin=on_unpin)
        async_engine.start()
        try:
            prompt = engine.tokenizer.encode(PROMPTS[0])
            stream, _ = await async_engine.add_request("p", prompt, PARAMS, pin_blocks=True)
            blocks = await async_engine.prefill_admitted("p")
            key = pin_key("p")
            pins.pin(key, blocks, with_checksums=False, request_id="p")
            with pins.reading(key, blocks):  # a transfer reads them through the failure
                [output] = [o async for o in async_engine.outputs("p", stream, False)]
                assert output.finished and output.outputs[0].finish_reason == "abort"
                assert not failures  # the step did fail
                assert engine.pool.num_used_blocks == len(blocks)  # held for the reader
                assert pins.release(key)  # the service ends its pin ...
                await asyncio.sleep(0.1)
                assert engine.pool.num_used_blocks == len(blocks) and not freed  # ... read on
            assert len(freed) == 1 and await freed[0]  # the reader left: freed, once
            assert not pins.holds(key) and pins.num_readers == 0
        finally:
            await async_engine.stop()

    asyncio.run(run())
    assert engine.stats().num_pinned == 0
    assert_no_leaks(engine)
