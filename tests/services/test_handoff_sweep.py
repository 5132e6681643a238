"""The hand-off phase sweep (issue #30): for each phase of the prefill -> decode hand-off and each
fault, on real worker processes and real KV transports, the request ends within its deadline
with the offline engine's greedy tokens or a clear gRPC error, and within one lease every
worker's counters (read from its real /metrics) are back to baseline.

Phases and faults: tests/services/handoff_sweep.py. What runs, to fit ~3 minutes on 2 cores:

- tcp: every phase x every fault, except where the fault has nothing to act on: ``queued`` x
  ``stall`` / ``lease`` (no block is pinned and no lease granted before P reserves the blocks),
  ``first-step`` / ``mid-decode`` x ``lease`` (D released P's blocks after its pull: no lease is
  left to run out); plus two controls (fault ``none``, a prompt one token over a multiple of
  the block size: streamed and whole);
- torch, ucx, shm (those of ``kvtransfer.available_transports()``): the streamed control and one
  case of each kind of fault across the streamed phases (``REDUCED``). ``stall`` speaks tcp's
  wire only, and the ``pull-release`` phase needs a second prefill worker: tcp only.

Workers are started once per transport (P: 16 prompt tokens a step so the streamed chunks are
observable, a 2 s lease; D; on tcp a P whose served pulls pause before letting the blocks go),
reused across cases; a killed one is started again before the next case. Prompts are random
token ids, a new one per case (no prefix-cache hit between cases): 96 tokens; 192 (12 blocks,
more than the socket buffers hold) in the chunk phases and for the stalled reader; 1024 (64 steps
of P) where a lease must run out while P computes; 193 in the controls (13 steps of P: with 97, 7
steps, D's first pull came after P's answer in 1 of 9 suite runs, and the phase was missed).

``PDSERVE_WRITE_SWEEP_TABLE=1`` writes the table of the sweep to docs/handoff-sweep.md.

On the tree before #30's fixes (788ff44) it fails three ways: ``tcp-chunk-first-none`` gives
wrong tokens from the first decoded one (97 then = 6 blocks + 1: the streamed pull reserved one
token too few); ``tcp-chunk-first-lease`` hangs to its deadline (the lease ran out while P
computed: PrefillStream never answered, so the ABORTED Generate was never asked again);
``tcp-pinned-stall`` leaves P's 12 blocks and its pinned request held (a tcp reader that stops
reading kept the sender waiting forever).
"""

from __future__ import annotations

import asyncio
import os
import random
import time
import zlib
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

import grpc
import pytest

import kvtransfer
from common.wire import params_to_proto
from pdserve import SamplingParams
from protos import pdserve_pb2 as pb
from protos import pdserve_pb2_grpc as pb_grpc
from services.worker.launcher import WorkerProcess
from tests.services.handoff_sweep import (
    BACK_S,
    DEADLINE_S,
    FAULTS,
    PHASES,
    STREAMED_PHASES,
    Flow,
    Pool,
    Row,
    StalledReader,
    back_to_baseline,
    lease_runs_out,
    reach,
    sample,
    scrape,
    until_scraped,
    write_table,
)
from tests.services.workers import AUTH

PARAMS = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)
# Prompt lengths (one block: 16 tokens, one step of P, 737 KB): a stalled reader's payload must
# overflow the socket buffers (4 MB): LONG; a lease must run out while P computes: LEASE_LONG;
# RESIDUE: one token over a multiple of the block size.
LONG, LEASE_LONG, SHORT, RESIDUE = 192, 1024, 96, 193
TABLE = Path(__file__).parents[2] / "docs" / "handoff-sweep.md"
CLEAR = (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.ABORTED)

NOT_APPLICABLE = {
    ("queued", "stall"): "no block is pinned before P reserves the prompt's blocks",
    ("queued", "lease"): "no lease is granted before P reserves the prompt's blocks",
    ("pull-release", "lease"): "D released P's blocks when its pull ended: no lease left",
    ("first-step", "lease"): "D released P's blocks after its pull: no lease left to run out",
    ("mid-decode", "lease"): "D released P's blocks after its pull: no lease left to run out",
}
REDUCED = [  # a kill last: the next pool needs no restart of it
    ("chunk-first", "none"),
    ("chunk-half", "cancel"),
    ("first-step", "kill-d"),
    ("chunk-half", "kill-p"),
]
# The request itself must still get the right answer: its KV is in D already, or D can
# recompute the prompt with the first token it was given, or the fault hit another reader.
MUST_ANSWER = {
    ("pinned", "kill-p"),
    ("pull-release", "kill-p"),
    ("first-step", "kill-p"),
    ("mid-decode", "kill-p"),
    ("pinned", "lease"),
}


@dataclass(frozen=True)
class Case:
    transport: str
    phase: str
    fault: str

    @property
    def id(self) -> str:
        return f"{self.transport}-{self.phase}-{self.fault}"

    @property
    def prompt(self) -> list[int]:
        """Random token ids, a new prompt per case (seeded by its id)."""
        length = LONG if self.phase.startswith("chunk") or self.fault == "stall" else SHORT
        if self.phase.startswith("chunk") and self.fault == "lease":
            length = LEASE_LONG
        if self.fault == "none":
            length = RESIDUE
        rng = random.Random(zlib.crc32(self.id.encode()))
        return [rng.randrange(1000, 30000) for _ in range(length)]


def _cases() -> list[Case]:
    found = kvtransfer.available_transports()
    cases = [Case("tcp", "chunk-first", "none"), Case("tcp", "pinned", "none")]
    cases += [
        Case("tcp", phase, fault)
        for phase in PHASES
        for fault in FAULTS
        if fault != "none" and (phase, fault) not in NOT_APPLICABLE
    ]
    for transport in ("torch", "ucx", "shm"):
        if transport in found:
            cases += [Case(transport, phase, fault) for phase, fault in REDUCED]
    return cases


CASES = _cases()


def _not_run() -> list[tuple[str, str, str]]:
    rows = [(phase, fault, why) for (phase, fault), why in NOT_APPLICABLE.items()]
    reduced = ", ".join(f"{phase} x {fault}" for phase, fault in REDUCED)
    rows.append(("torch, ucx, shm", "*", f"only {reduced} (time); stall speaks tcp's wire"))
    missing = sorted({"tcp", "torch", "ucx", "shm"} - set(kvtransfer.available_transports()))
    if missing:
        rows.append(("*", "*", f"transports not available here: {', '.join(missing)}"))
    return rows


@pytest.fixture(scope="module")
def table() -> Iterator[list[Row]]:
    rows: list[Row] = []
    yield rows
    if os.environ.get("PDSERVE_WRITE_SWEEP_TABLE") == "1" and rows:
        write_table(str(TABLE), rows, _not_run())


@pytest.fixture(scope="module")
def reference(llm, request: pytest.FixtureRequest) -> Callable[[Case], list[int]]:  # type: ignore[no-untyped-def]
    """The offline engine's greedy tokens for a case's prompt: for every case this session
    runs, in one batch (a few seconds; one prompt at a time took 3 s each on a busy machine)."""
    cache: dict[str, list[int]] = {}

    def get(case: Case) -> list[int]:
        if case.id not in cache:
            items = request.session.items
            selected = [i.callspec.params.get("case") for i in items if hasattr(i, "callspec")]
            cases = [c for c in selected if isinstance(c, Case) and c.id not in cache]
            cases = cases if case in cases else [case]
            outputs = llm.generate([c.prompt for c in cases], PARAMS)
            for c, out in zip(cases, outputs):
                cache[c.id] = list(out.outputs[0].token_ids)
        return cache[case.id]

    return get


@pytest.fixture(scope="module")
def pools() -> Iterator[Callable[[str], Pool]]:
    """The pool of a transport, started on first use; the previous transport's is closed."""
    current: list[Pool] = []

    def get(transport: str) -> Pool:
        if current and current[0].transport == transport:
            return current[0]
        while current:
            current.pop().close()
        current.append(Pool(transport))
        warm_up = Case(transport, "first-step", "none")  # D's first pull opens its connection
        asyncio.run(sweep_case(current[0], warm_up))
        return current[0]

    yield get
    for pool in current:
        pool.close()


@pytest.mark.parametrize("case", CASES, ids=[case.id for case in CASES])
def test_handoff_phase_fault(case: Case, pools, reference, table) -> None:  # type: ignore[no-untyped-def]
    pool = pools(case.transport)
    pool.replace_dead()  # here, on the main thread: a worker dies with the thread that spawned it
    row = asyncio.run(sweep_case(pool, case))
    if row.outcome == "completed":
        _compare(row, row.tokens, reference(case))
    table.append(row)
    print(" | ".join(row.cells()))
    if row.problems:  # the workers' own words explain most failures
        for name, worker in pool.live().items():
            print(f"--- {name} ({worker.role}) output ---\n{worker.output_tail(15)}")
    assert not row.problems, f"{case.id}: {row.problems} (outcome {row.outcome}; {row.note})"


async def sweep_case(pool: Pool, case: Case) -> Row:
    row = Row(case.transport, case.phase, case.fault)
    p_name = "p_pause" if case.phase == "pull-release" else "p"
    p, d = pool.worker(p_name), pool.worker("d")
    blocker = None
    if case.phase == "queued":  # another prompt P computes first
        blocker = asyncio.create_task(_block(p, f"block-{case.id}-{time.time()}"))
        running = lambda: sample(scrape(p), "pdserve_num_running") >= 1  # noqa: E731
        await until_scraped(running, DEADLINE_S)
    start = time.monotonic()
    flow = Flow(
        p.info["grpc_address"],
        d.info["grpc_address"],
        f"{case.id}-{time.time()}",
        case.prompt,
        PARAMS,
        streamed=case.phase in STREAMED_PHASES,
        deadline=start + DEADLINE_S,
    )
    task = asyncio.create_task(flow.run())
    missed = await reach(case.phase, flow, task, pool, p_name)
    reader: StalledReader | None = None
    if missed:
        row.problems.append(f"phase not reached: {missed}")
    else:
        reader, row.note = await _strike(case, flow, task, p, d)
        if row.note == "no lease ran out":
            row.problems.append("the fault did not happen: no lease ran out")
    flow.hold.set()
    row.outcome = await _ended(task, flow)
    row.tokens, row.kv_source = flow.tokens, flow.kv_source
    row.end_s = time.monotonic() - start
    if blocker is not None:
        await blocker
    row.back_s, row.left = await back_to_baseline(pool.live, BACK_S)
    _judge(case, row)
    await _clean_up(pool, reader)
    return row


async def _block(p: WorkerProcess, request_id: str) -> None:
    """A prefill on P (the queued phase waits behind it), released once answered."""
    rng = random.Random(request_id)
    prompt = [rng.randrange(1000, 30000) for _ in range(SHORT)]
    try:
        async with grpc.aio.insecure_channel(p.info["grpc_address"]) as channel:
            stub = pb_grpc.PrefillServiceStub(channel)
            request = pb.PrefillRequest(
                request_id=request_id, token_ids=prompt, sampling=params_to_proto(PARAMS)
            )
            answer = await stub.Prefill(request, timeout=DEADLINE_S, metadata=AUTH)
            release = pb.ReleaseRequest(request_id=answer.kv.request_id)
            await stub.Release(release, timeout=5, metadata=AUTH)
    except grpc.aio.AioRpcError:  # P was killed: nothing left to release
        pass


async def _strike(
    case: Case, flow: Flow, task: asyncio.Task[None], p: WorkerProcess, d: WorkerProcess
) -> tuple[StalledReader | None, str]:
    """Apply the case's fault now; the stalled reader (to close later) and a note."""
    fault = case.fault
    if fault == "cancel":
        task.cancel()
    elif fault == "kill-p":
        await asyncio.to_thread(p.kill)
    elif fault == "kill-d":
        await asyncio.to_thread(d.kill)
    elif fault == "stall":
        assert flow.handle is not None
        token = os.environ["PDSERVE_CLUSTER_TOKEN"]
        reader = await asyncio.to_thread(StalledReader, flow.handle, token)
        return reader, f"reader refused: {reader.refused}" if reader.refused else "reader stalled"
    elif fault == "lease":  # the client sits on the handle (pinned), or D freezes
        computing = flow.answer is None
        expired = await lease_runs_out(p, None if case.phase == "pinned" else d)
        if not expired:
            return None, "no lease ran out"
        return None, "lease ran out while P computed" if computing and flow.answer is None else ""
    return None, ""


async def _ended(task: asyncio.Task[None], flow: Flow) -> str:
    """How the request ended, as the client saw it."""
    try:
        await asyncio.wait_for(task, timeout=max(0.1, flow.deadline - time.monotonic()) + 2)
    except asyncio.CancelledError:
        return "cancelled"
    except asyncio.TimeoutError:
        return f"hung ({flow.stage}; {flow.num_chunks} chunks from D)"
    except grpc.aio.AioRpcError as exc:
        if exc.code() == grpc.StatusCode.DEADLINE_EXCEEDED:
            return f"hung ({flow.stage}; {flow.num_chunks} chunks from D; {exc.details()})"
        return f"error {exc.code().name}: {exc.details()}"
    except RuntimeError as exc:
        return f"error: {exc}"
    return "completed"  # its tokens are compared with the reference (_compare)


def _compare(row: Row, tokens: list[int], reference: list[int]) -> None:
    """Judge a completed request's tokens."""
    if tokens == reference:
        row.outcome = "ok"
        row.note = ", ".join(filter(None, [row.note, f"kv {row.kv_source}"]))
        return
    same = next((i for i, (a, b) in enumerate(zip(tokens, reference)) if a != b), None)
    row.outcome = f"wrong tokens (from token {same} of {len(reference)}; kv {row.kv_source})"
    row.problems.insert(0, "wrong tokens")


def _judge(case: Case, row: Row) -> None:
    key = (case.phase, case.fault)
    outcome = row.outcome
    if outcome.startswith("hung"):
        row.problems.append(outcome.split(" (")[0])
    elif outcome == "cancelled" and case.fault != "cancel":
        row.problems.append("cancelled by no one")
    elif outcome.startswith("error"):
        clear = any(outcome.startswith(f"error {code.name}: ") for code in CLEAR)
        if not clear or outcome.endswith(": "):
            row.problems.append("unclear error")
        elif case.fault in ("none", "stall") or key in MUST_ANSWER:
            row.problems.append("an error where the answer was still possible")
    if row.end_s > DEADLINE_S + 0.5:
        row.problems.append(f"ended after its deadline ({DEADLINE_S:g} s)")
    if row.back_s is None:
        row.problems.append(f"counters not back within {BACK_S:g} s")


async def _clean_up(pool: Pool, reader: StalledReader | None) -> None:
    """Leave the pool as the next case expects it: no reader, counters at baseline, every
    worker alive (a worker whose counters never come back is replaced)."""
    if reader is not None:
        reader.close()
    _, left = await back_to_baseline(pool.live, 10.0)
    for name in {key.split(".")[0] for key in left}:
        pool.worker(name).kill()  # replaced before the next case
