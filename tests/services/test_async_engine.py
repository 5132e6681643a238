"""The async step loop on the real default model: what a slow or stalled consumer costs, and what
a duplicate request id does (nothing, to the request that has it)."""

from __future__ import annotations

import asyncio
import threading
import time

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


def record_steps(engine, monkeypatch, label: str, when) -> list[str]:  # type: ignore[no-untyped-def]
    """The engine's steps, recorded: ``label`` when a schedule() returns a batch ``when``
    selects, "computed" when a step has run; each step takes 0.2 s more, room for the waiters
    of what the schedule sent out to run while the step computes."""
    events: list[str] = []
    schedule, run_batch = engine.schedule, engine.run

    def recording_schedule():  # type: ignore[no-untyped-def]
        batch = schedule()
        if when(batch):
            events.append(label)
        return batch

    def slow_run(batch):  # type: ignore[no-untyped-def]
        time.sleep(0.2)
        outputs = run_batch(batch)
        events.append("computed")
        return outputs

    monkeypatch.setattr(engine, "schedule", recording_schedule)
    monkeypatch.setattr(engine, "run", slow_run)
    return events


def test_a_pull_plan_goes_out_before_the_step_that_admitted_it_computes(llm, monkeypatch):
    """The pull then runs beside that step, and its request can join the next one: one step
    less between the first token (the prefill worker's) and the second."""
    engine = llm.engine
    prompt = engine.tokenizer.encode(PROMPTS[2])
    events = record_steps(engine, monkeypatch, "admitted", lambda batch: bool(batch.pulls))

    async def run() -> None:
        loop = AsyncEngine(engine)
        loop.start()
        try:
            running, _ = await loop.add_request("running", prompt, LONG)
            await running.get()  # its prompt is computed: now it decodes, step after step
            _, _, pulled = await loop.add_prefilled("pulled", prompt, 1, LONG, None)
            await loop.pull_plan("pulled", timeout=10)
            events.append("plan")
            await loop.recompute_pull("pulled")  # no prefill worker here: compute it after all
            for rid, stream in (("running", running), ("pulled", pulled)):
                async for _ in loop.outputs(rid, stream):
                    pass
        finally:
            await loop.stop()

    asyncio.run(run())
    admitted = events.index("admitted")
    assert events[admitted + 1] == "plan", events[admitted : admitted + 3]
    assert_no_leaks(engine)


def test_a_prefill_admission_goes_out_before_the_step_that_computes_the_prompt(llm, monkeypatch):
    """Its KV handle then reaches the decode worker while the prompt computes, so the decode
    worker is admitted and waiting on the streamed pull when the prompt is done (the hand-off
    2.6 -> 1.8-1.9 decode steps, docs/benchmarks.md)."""
    engine = llm.engine
    prompt = engine.tokenizer.encode(PROMPTS[2])
    events = record_steps(engine, monkeypatch, "scheduled", lambda batch: bool(batch.prefills))

    async def run() -> None:
        loop = AsyncEngine(engine)
        loop.start()
        try:
            stream, _ = await loop.add_request("p", prompt, LONG, pin_blocks=True)
            await loop.prefill_admitted("p")
            events.append("admission")
            [output] = [o async for o in loop.outputs("p", stream, False)]
            assert output.finished
            assert await loop.release_pinned("p")  # what the lease's end does
        finally:
            await loop.stop()

    asyncio.run(run())
    scheduled = events.index("scheduled")
    assert events[scheduled + 1] == "admission", events
    assert_no_leaks(engine)


def test_build_makes_the_engine_on_the_thread_that_runs_its_steps(llm):
    """The one thread with an OpenMP team is the step thread (``kernels.openmp``): the engine's
    build, and every step after it, run there and not on the event loop's thread."""
    engine = llm.engine
    threads: dict[str, set[int]] = {"build": set(), "steps": set()}

    def make():
        threads["build"].add(threading.get_ident())
        return engine

    run_step = engine.run

    def recorded(batch):
        threads["steps"].add(threading.get_ident())
        return run_step(batch)

    async def run() -> None:
        loop = AsyncEngine.build(make)
        loop.start()
        try:
            stream, _ = await loop.add_request("built", engine.tokenizer.encode(PROMPTS[0]), LONG)
            outputs = [o async for o in loop.outputs("built", stream)]
            assert outputs[-1].finished
        finally:
            await loop.stop()

    engine.run = recorded
    try:
        asyncio.run(run())
    finally:
        del engine.run
    assert len(threads["build"]) == 1 and threads["steps"] == threads["build"]
    assert threading.get_ident() not in threads["build"]
    assert_no_leaks(engine)
