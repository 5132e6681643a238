"""Helpers of the hand-off phase sweep (test_handoff_sweep.py): the router's side of one request
driven by hand over real gRPC, the phase marks a fault waits for, the faults, the pools' counters
read from the workers' real /metrics, and the table of the sweep.

Phases (where a fault strikes):

- ``queued``: the request waits at P behind another prompt (P's ``num_waiting``), no handle yet;
- ``chunk-first`` / ``chunk-half``: streamed; D has pulled at least one block / half the prompt's
  blocks (P's sent or D's received KV bytes) while P still computes (no answer yet);
- ``pinned``: whole (``--no-stream-kv``); P answered and pinned the blocks, D not called yet;
- ``pull-release``: whole, from a P whose every served pull pauses before it lets the blocks go
  (``--kv-faults pause=``; tcp sends a contiguous run of blocks in one piece, then pauses): D
  has the KV and decodes (its first chunk came) while P's transfer still holds the blocks;
- ``first-step``: streamed; D's first chunk (its first decode step) has come;
- ``mid-decode``: streamed; D has sent ``MID_CHUNKS`` chunks and is still decoding.

Faults: ``cancel`` (the client's calls are cancelled), ``kill-p`` / ``kill-d`` (SIGKILL),
``stall`` (a raw tcp reader pulls every block of the request and stops reading), ``lease`` (no
one renews until P reaps the lease: the client sits on the handle, or D is SIGSTOPped), and
``none`` (the control: the flow itself gives the reference tokens).
"""

from __future__ import annotations

import asyncio
import os
import signal
import socket
import time
import urllib.request
from collections.abc import Callable
from dataclasses import dataclass, field

import grpc

from common.sampling_params import SamplingParams
from common.wire import params_to_proto
from kvtransfer import framing
from protos import pdserve_pb2 as pb
from protos import pdserve_pb2_grpc as pb_grpc
from services.worker.convert import layout_from_proto
from services.worker.launcher import WorkerProcess
from tests.services.workers import AUTH, SMALL

LEASE_S = 2.0  # P's --lease-seconds
BACK_S = LEASE_S + 1.0  # counters back to baseline this long after a request ended (+ reaper)
DEADLINE_S = 20.0  # every request ends within this (a normal one: 1 to 4 s, 8 s under load)
PAUSE_S = 2.0  # the pull-release phase's P holds its blocks this long in every transfer
MID_CHUNKS = 5  # mid-decode: chunks D has sent when the fault strikes
STEP_TOKENS = 16  # P computes this many prompt tokens a step: streamed chunks are observable
PHASE_WAIT_S = 15.0  # a phase not reached by then fails the case (it tested nothing)
STALL_RCVBUF = 4096  # the stalled reader's receive buffer: the sender's buffer fills quickly

PHASES = (
    "queued",
    "chunk-first",
    "chunk-half",
    "pinned",
    "pull-release",
    "first-step",
    "mid-decode",
)
FAULTS = ("none", "cancel", "kill-p", "kill-d", "stall", "lease")
STREAMED_PHASES = ("queued", "chunk-first", "chunk-half", "first-step", "mid-decode")


# -- workers ---------------------------------------------------------------------------------


class Slot:
    """One worker role of a pool; a killed worker is replaced by a fresh start (before the next
    case: a model loading meanwhile would starve the case of CPU)."""

    def __init__(self, role: str, args: list[str]):
        self.role, self.args = role, [*SMALL, *args]
        self.worker = self._spawn()

    def _spawn(self) -> WorkerProcess:
        worker = WorkerProcess(self.role, self.args)
        worker.spawn()  # from the test's main thread: the child dies with the thread
        return worker

    def ready(self) -> WorkerProcess:
        """Wait for the worker; one that died starting is started once more (a fork from this
        process, which has used gRPC, rarely fails: "epoll_wait error: Bad file descriptor")."""
        try:
            self.worker.wait_ready()
        except RuntimeError as exc:
            print(f"{self.role} worker did not start; starting it again: {exc}")
            self.worker = self._spawn()
            self.worker.wait_ready()
        return self.worker

    def replace(self) -> None:
        """The current worker is dead (or must go): a new one takes over."""
        self.worker.kill()
        self.worker = self._spawn()
        self.ready()

    def close(self) -> None:
        self.worker.kill()


class Pool:
    """The workers of one transport: P (STEP_TOKENS a step, a short lease), D, and on tcp
    a P whose served pulls pause before letting go (the pull-release phase)."""

    def __init__(self, transport: str):
        self.transport = transport
        common = ["--kv-transport", transport]
        p_args = [
            *common,
            "--max-num-batched-tokens",
            str(STEP_TOKENS),
            "--lease-seconds",
            str(LEASE_S),
        ]
        self.slots = {
            "p": Slot("prefill", p_args),
            "d": Slot("decode", common),
        }
        if transport == "tcp":
            pause = ["--kv-faults", f"pause={PAUSE_S}"]
            self.slots["p_pause"] = Slot("prefill", [*p_args, *pause])
        for slot in self.slots.values():
            slot.ready()

    def worker(self, name: str) -> WorkerProcess:
        return self.slots[name].worker

    def live(self) -> dict[str, WorkerProcess]:
        return {name: s.worker for name, s in self.slots.items() if s.worker.is_alive()}

    def replace_dead(self) -> list[str]:
        dead = [name for name, slot in self.slots.items() if not slot.worker.is_alive()]
        for name in dead:
            self.slots[name].replace()
        return dead

    def close(self) -> None:
        for slot in self.slots.values():
            slot.close()


# -- counters --------------------------------------------------------------------------------

# What each pool exports of its hand-off state; all 0 at baseline (cached prefix blocks are not
# "used"). Not exported: P's pinned *blocks* and lease entries still held by a reader, and the
# active KV readers per pin (kvtransfer.source._Pin.readers): a reader holding a released pin
# shows only as P's used blocks.
COUNTERS = {
    "prefill": (
        ("used", "pdserve_kv_blocks", 'state="used"'),
        ("pinned", "pdserve_pinned_requests", ""),
        ("running", "pdserve_num_running", ""),
        ("waiting", "pdserve_num_waiting", ""),
    ),
    "decode": (
        ("used", "pdserve_kv_blocks", 'state="used"'),
        ("pulling", "pdserve_pulling_requests", ""),
        ("running", "pdserve_num_running", ""),
        ("waiting", "pdserve_num_waiting", ""),
    ),
}


def scrape(worker: WorkerProcess) -> dict[str, float]:
    """Every sample of one /metrics scrape, by name with its labels."""
    url = f"http://127.0.0.1:{worker.info['metrics_port']}/metrics"
    text = urllib.request.urlopen(url, timeout=5).read().decode()
    lines = (line.rpartition(" ") for line in text.splitlines() if not line.startswith("#"))
    return {name: float(value) for name, _, value in lines if name}


USED = ("pdserve_kv_blocks", 'state="used"')


def sample(samples: dict[str, float], name: str, labels: str = "") -> float:
    return samples.get(f"{name}{{{labels}}}" if labels else name, 0.0)


def off_baseline(workers: dict[str, WorkerProcess]) -> dict[str, float]:
    """The counters of live ``workers`` that are not at baseline (0), e.g. {"p.used": 4}."""
    off: dict[str, float] = {}
    for name, worker in workers.items():
        try:
            samples = scrape(worker)
        except OSError:  # it died meanwhile: the caller replaces it
            continue
        for label, metric, labels in COUNTERS[worker.role]:
            value = sample(samples, metric, labels)
            if value:
                off[f"{name}.{label}"] = value
    return off


def kv_bytes(worker: WorkerProcess, transport: str, direction: str) -> float:
    labels = f'direction="{direction}",transport="{transport}"'
    return sample(scrape(worker), "pdserve_kv_transfer_bytes_total", labels)


async def back_to_baseline(
    workers: Callable[[], dict[str, WorkerProcess]], within: float
) -> tuple[float | None, dict[str, float]]:
    """Seconds until every counter is at baseline (None: not within ``within``) and what was
    still off at the end."""
    start = time.monotonic()
    while True:
        off = await asyncio.to_thread(off_baseline, workers())
        elapsed = time.monotonic() - start
        if not off:
            return elapsed, {}
        if elapsed > within:
            return None, off
        await asyncio.sleep(0.1)


# -- the flow ----------------------------------------------------------------------------------


@dataclass
class Flow:
    """The router's side of one request over real gRPC, with the marks the phases wait for.
    Streamed: PrefillStream on P, Generate on D with the streaming handle at once, P's first
    token first; D answering ABORTED (its pull failed before the first token came) is asked
    again with the first token, as the router does. Whole: Prefill on P, then (once ``hold`` is
    set) Generate on D with the first token and handle."""

    p_address: str
    d_address: str
    request_id: str
    prompt: list[int]
    params: SamplingParams
    streamed: bool
    deadline: float  # time.monotonic() by which every call of the request has ended
    hold: asyncio.Event = field(default_factory=asyncio.Event)
    handle: pb.KVHandle | None = None
    answer: pb.PrefillResponse | None = None
    decoded: list[int] = field(default_factory=list)
    num_chunks: int = 0  # D's chunks so far
    finished: str = ""  # the finish reason
    kv_source: str = ""
    decode_started: bool = False
    stage: str = "not started"  # where the request is, as the client sees it (for hangs)

    def __post_init__(self) -> None:
        self.answered = asyncio.Event()
        if self.streamed:
            self.hold.set()

    @property
    def tokens(self) -> list[int]:
        first = [self.answer.first_token] if self.answer is not None else []
        return first + self.decoded

    def timeout(self) -> float:
        return max(0.05, self.deadline - time.monotonic())

    def _request(self) -> pb.GenerateRequest:
        return pb.GenerateRequest(
            request_id=f"{self.request_id}-d0",
            prompt_token_ids=self.prompt,
            sampling=params_to_proto(self.params),
        )

    async def run(self) -> None:
        async with (
            grpc.aio.insecure_channel(self.p_address) as p,
            grpc.aio.insecure_channel(self.d_address) as d,
        ):
            if self.streamed:
                await self._streamed(pb_grpc.PrefillServiceStub(p), pb_grpc.DecodeServiceStub(d))
            else:
                await self._whole(pb_grpc.PrefillServiceStub(p), pb_grpc.DecodeServiceStub(d))

    async def _whole(self, p: pb_grpc.PrefillServiceStub, d: pb_grpc.DecodeServiceStub) -> None:
        request = pb.PrefillRequest(
            request_id=self.request_id,
            token_ids=self.prompt,
            sampling=params_to_proto(self.params),
        )
        self.stage = "waiting for Prefill"
        self.answer = await p.Prefill(request, timeout=self.timeout(), metadata=AUTH)
        self.handle = self.answer.kv
        self.answered.set()
        if self.answer.finish_reason:
            self.finished = self.answer.finish_reason
            return
        await self.hold.wait()
        generate = self._request()
        generate.first_token = self.answer.first_token
        generate.kv.CopyFrom(self.answer.kv)
        await self._decode(d, generate)

    async def _streamed(self, p: pb_grpc.PrefillServiceStub, d: pb_grpc.DecodeServiceStub) -> None:
        request = pb.PrefillRequest(
            request_id=self.request_id,
            token_ids=self.prompt,
            sampling=params_to_proto(self.params),
        )
        call = p.PrefillStream(request, timeout=self.timeout(), metadata=AUTH)
        decoding: asyncio.Task[None] | None = None
        self.stage = "waiting for PrefillStream's handle"
        try:
            async for event in call:
                if event.HasField("kv") and decoding is None:
                    self.handle = event.kv
                    generate = self._request()
                    generate.kv.CopyFrom(event.kv)
                    decoding = asyncio.create_task(self._decode(d, generate))
                    self.stage = "waiting for PrefillStream's answer"
                elif event.HasField("done"):
                    self.answer = event.done
                    self.answered.set()
                    break
            if self.answer is None or decoding is None:
                raise RuntimeError("PrefillStream ended without a handle and an answer")
        except BaseException:
            if decoding is not None:
                decoding.cancel()
                await asyncio.gather(decoding, return_exceptions=True)
            raise
        finally:
            call.cancel()  # a no-op once finished
        if self.answer.finish_reason:
            self.finished = self.answer.finish_reason
            decoding.cancel()
            await asyncio.gather(decoding, return_exceptions=True)
            return
        self.stage = "waiting for Generate"
        await decoding

    async def _decode(self, d: pb_grpc.DecodeServiceStub, request: pb.GenerateRequest) -> None:
        for attempt in range(2):
            request.request_id = f"{self.request_id}-d{attempt}"
            self.decode_started = True
            try:
                async for chunk in d.Generate(request, timeout=self.timeout(), metadata=AUTH):
                    self.decoded += chunk.token_ids
                    self.num_chunks += 1
                    self.kv_source = chunk.kv_source or self.kv_source
                    self.finished = chunk.finish_reason or self.finished
                return
            except grpc.aio.AioRpcError as exc:
                if exc.code() != grpc.StatusCode.ABORTED or attempt or self.num_chunks:
                    raise
                self.stage = "Generate ABORTED; waiting for the first token to ask again"
                await self.answered.wait()  # the router asks again with the first token
                assert self.answer is not None
                request.first_token = self.answer.first_token


# -- phases ------------------------------------------------------------------------------------


async def until(predicate: Callable[[], bool], timeout: float) -> bool:
    end = time.monotonic() + timeout
    while not predicate():
        if time.monotonic() > end:
            return False
        await asyncio.sleep(0.01)
    return True


async def until_scraped(predicate: Callable[[], bool], timeout: float) -> bool:
    """``until`` for a predicate that scrapes /metrics (blocking): off the event loop."""
    end = time.monotonic() + timeout
    while not await asyncio.to_thread(predicate):
        if time.monotonic() > end:
            return False
        await asyncio.sleep(0.02)
    return True


async def reach(phase: str, flow: Flow, task: asyncio.Task[None], pool: Pool, p_name: str) -> str:
    """Wait for ``flow`` to be at ``phase``; "" when it is, else why it is not."""
    p, d, transport = pool.worker(p_name), pool.worker("d"), pool.transport
    bytes_before = kv_bytes(p, transport, "sent"), kv_bytes(d, transport, "received")
    if phase == "queued":
        ok = await until_scraped(
            lambda: flow.handle is None and sample(scrape(p), "pdserve_num_waiting") >= 1,
            PHASE_WAIT_S,
        )
        return "" if ok and flow.handle is None else "never seen queued at P"
    if phase in ("chunk-first", "chunk-half"):
        if not await until(lambda: flow.handle is not None or task.done(), PHASE_WAIT_S):
            return "no streaming handle"
        if flow.handle is None:
            return "no streaming handle"
        layout = layout_from_proto(flow.handle.layout)
        blocks = 1 if phase == "chunk-first" else len(flow.handle.block_ids) // 2
        wanted = blocks * layout.bytes_per_block

        def pulled() -> bool:
            sent = kv_bytes(p, transport, "sent") - bytes_before[0]
            received = kv_bytes(d, transport, "received") - bytes_before[1]
            return max(sent, received) >= wanted or flow.answer is not None or task.done()

        await until_scraped(pulled, PHASE_WAIT_S)
        if flow.answer is not None or task.done():
            return "P answered before D had pulled the part"
        return ""
    if phase == "pinned":
        ok = await until(lambda: flow.answer is not None or task.done(), PHASE_WAIT_S)
        return "" if ok and not task.done() else "P never answered"
    if phase == "pull-release":
        flow.hold.set()
        await until(lambda: flow.num_chunks >= 1 or task.done(), PHASE_WAIT_S)
        if task.done() or not flow.num_chunks:
            return "D never decoded"
        used = await asyncio.to_thread(lambda: sample(scrape(p), *USED))
        return "" if used else "P had let the blocks go already"
    wanted_chunks = 1 if phase == "first-step" else MID_CHUNKS
    await until(lambda: flow.num_chunks >= wanted_chunks or task.done(), PHASE_WAIT_S)
    return "" if not task.done() else f"the request ended before D's chunk {wanted_chunks}"


# -- faults ------------------------------------------------------------------------------------


class StalledReader:
    """A raw tcp KV client that asks for every block of a pinned request and reads nothing of
    the payload (a decode worker frozen mid-pull); ``refused``: the server's answer when it
    did not start the transfer."""

    def __init__(self, handle: pb.KVHandle, token: str):
        host, port, _ = framing.parse_address(handle.address, "tcp")
        self.sock = socket.socket()
        self.sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, STALL_RCVBUF)
        self.sock.settimeout(5.0)
        self.sock.connect((host, port))
        layout = layout_from_proto(handle.layout)
        request = framing.Request(
            framing.OP_PULL,
            token,
            handle.request_id,
            list(handle.block_ids),
            layout.bytes_per_block,
        )
        self.sock.sendall(framing.encode_request(request))
        header = self._recv(framing.REPLY_HEADER.size)
        body = self._recv(framing.REPLY_HEADER.unpack(header)[3])
        status, message, _ = framing.parse_reply(header + body)
        self.refused = "" if status == framing.STATUS_OK else framing.STATUS_REASONS[status]

    def _recv(self, size: int) -> bytes:
        buf = b""
        while len(buf) < size:
            chunk = self.sock.recv(size - len(buf))
            if not chunk:
                raise ConnectionResetError("the KV server closed the connection")
            buf += chunk
        return buf

    def close(self) -> None:
        self.sock.close()


def lease_expirations(p: WorkerProcess) -> float:
    return sample(scrape(p), "pdserve_lease_expirations_total")


async def lease_runs_out(p: WorkerProcess, freeze: WorkerProcess | None) -> bool:
    """Wait until P reaps a lease (its ``lease_expirations`` counter moves), ``freeze`` (D)
    SIGSTOPped meanwhile: it renews nothing and reads nothing; False if none ran out within
    two leases and a second."""
    before = await asyncio.to_thread(lease_expirations, p)
    if freeze is not None:
        os.kill(freeze.pid, signal.SIGSTOP)
    try:
        moved = lambda: lease_expirations(p) > before  # noqa: E731
        return await until_scraped(moved, 2 * LEASE_S + 1.0)
    finally:
        if freeze is not None:
            os.kill(freeze.pid, signal.SIGCONT)


# -- the table -----------------------------------------------------------------------------------


@dataclass
class Row:
    """One case of the sweep as it ran."""

    transport: str
    phase: str
    fault: str
    outcome: str = ""  # ok | wrong tokens | error CODE: detail | cancelled | hung
    end_s: float = 0.0  # request start -> its end (the client's view)
    back_s: float | None = None  # its end -> every live pool's counters at baseline
    left: dict[str, float] = field(default_factory=dict)  # counters still off at BACK_S
    note: str = ""
    problems: list[str] = field(default_factory=list)
    tokens: list[int] = field(default_factory=list)  # what the client got
    kv_source: str = ""

    def cells(self) -> list[str]:
        back = (
            f"{self.back_s:.1f} s"
            if self.back_s is not None
            else "NO: " + ", ".join(f"{k}={v:g}" for k, v in self.left.items())
        )
        verdict = "pass" if not self.problems else "FAIL: " + "; ".join(self.problems)
        return [
            self.transport,
            self.phase,
            self.fault,
            self.outcome if len(self.outcome) <= 90 else self.outcome[:87] + "...",
            f"{self.end_s:.1f} s",
            back,
            self.note,
            verdict,
        ]


HEADER = ["transport", "phase", "fault", "outcome", "ended after", "counters back", "note", ""]


def write_table(path: str, rows: list[Row], not_run: list[tuple[str, str, str]]) -> None:
    """docs/handoff-sweep.md: the rows in sweep order, then the combinations not run and why."""
    order = {name: i for i, name in enumerate((*PHASES, *FAULTS))}
    rows = sorted(rows, key=lambda r: (r.transport != "tcp", r.transport, order[r.phase],
                                       order[r.fault]))  # fmt: skip
    lines = [
        "# The hand-off phase sweep",
        "",
        "Generated by `PDSERVE_WRITE_SWEEP_TABLE=1 pytest tests/services/test_handoff_sweep.py`"
        f" ({time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}); what each phase and fault",
        "is: the docstrings of `tests/services/test_handoff_sweep.py` and",
        "`tests/services/handoff_sweep.py`. Real prefill (P) and decode (D) worker processes",
        "driven over gRPC as the router drives them; greedy tokens compared with the offline",
        f"engine's; P's lease {LEASE_S} s, each request's deadline {DEADLINE_S:g} s.",
        "*ended after*: the request's start to its end as the client saw it; *counters back*: its",
        "end to every live worker's used blocks, pinned, pulling, running and waiting requests",
        f"at 0 (must be within {BACK_S:g} s: one lease, the reaper's period, scrape slack).",
        "",
        "| " + " | ".join(HEADER) + " |",
        "|" + "---|" * len(HEADER),
    ]
    lines += ["| " + " | ".join(row.cells()) + " |" for row in rows]
    if not_run:
        lines += ["", "Not run:", ""]
        lines += [f"- {phase} x {fault}: {why}" for phase, fault, why in not_run]
    lines += ["", "Defects this sweep caught before #30's fixes: see the test's module docstring."]
    with open(path, "w") as f:
        f.write("\n".join(lines) + "\n")
