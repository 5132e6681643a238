"""The chaos soak (issues #8, #30): load through the gateway while faults are injected on a
schedule, every answer checked against a reference the system under test did not compute.

    python benchmarks/chaos.py                          # the 5-minute soak (`make chaos`)
    python benchmarks/chaos.py --duration 46 --fault-interval 6.5 --json-out /tmp/chaos.json

In order:

1. draw the prompt pool (``chaos_reference``: seeded windows of the docs as token ids, lengths
   covering every residue mod the block size 16 from 1 to a few hundred, n = 1 or 2) and
   compute each prompt's answer once with the offline engine (``LLM``, float32) in this
   process, while the system under test starts (greedy; one prompt in three sampled with a
   seed, which draws the same tokens on every route);
2. start ``pdserve up --restart --prefill 1 --decode 1 --port 0`` (real Redis, workers, router;
   its router streams the KV hand-off) as a child in its own session, with
   ``PDSERVE_KV_FAULTS`` (the prefill worker drops or corrupts a fraction of the KV pulls it
   serves, see ``kvtransfer/faults.py``), a short prefill lease and the run's unique marker in
   its environment, which every process it starts inherits; then a second router on the same
   workers with ``--no-stream-kv`` (the whole hand-off, after the prefill);
3. for ``--duration`` seconds, ``--concurrency`` clients send pool prompts through either
   router (streaming or not, ``logprobs: 0`` so that each generated token is named; a
   fraction of the streaming clients hang up after the first token on purpose; a request that
   fails is retried up to 4 times, after 1, 2, 4 and 8 s) while every ``--fault-interval``
   seconds the next fault kind, in round robin, is injected: SIGKILL of the prefill worker,
   of Redis, of the decode worker (``pdserve up --restart`` restarts all three), a burst of
   client disconnects, a hang (SIGSTOP, then SIGCONT after ``--hang-seconds``) of the prefill
   or decode worker, a stalled KV reader and lost leases (``chaos_kv``);
4. stop injecting; wait for recovery (``/ready``, every component up, every prompt of the pool
   answered right again through both routers) and for every worker's blocks in use, pins,
   pulls and KV readers to return to 0, while the stalled readers still hold their sockets;
5. stop both routers and ``pdserve up`` (SIGTERM) and look for processes left with the marker.

Every request ends as one of: completed (correct: every choice equal to the reference token
for token and as text; or wrong), failed with a clear error (an HTTP error with an OpenAI error
body, or an SSE error event; tokens streamed before the error, or before a hang-up on purpose,
must be a prefix of the reference, else the request counts as wrong), failed without one
(unclear), hung (no complete answer within ``--request-timeout``), or disconnected on purpose.
Prints a progress bar and a summary; ``--json-out`` writes the whole report. Exit status 1 when
a request hung, came back wrong or failed unclearly, a lost-lease PrefillStream never ended,
anything leaked, a process was orphaned, or the system did not recover; 2 when it could not
start.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import random
import shlex
import signal
import sys
import tempfile
import time
import uuid
from collections import Counter
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import httpx
from tqdm import tqdm

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "benchmarks"))

from chaos_client import OUTCOMES, Client, Outcome, error_key  # noqa: E402
from chaos_kv import PrefillPeer, Stall  # noqa: E402
from chaos_reference import Prompt, Reference, offline_references  # noqa: E402
from chaos_system import (  # noqa: E402
    ChaosConfig,
    UpProcess,
    WholeRouter,
    WorkerScraper,
    alive,
    orphans,
    rss_mb,
)

KV_FAULT_KINDS = ("kv_drop", "kv_corrupt")  # injected all along by the prefill worker
BAD_OUTCOMES = ("wrong", "failed_unclear", "hung")


# -- the soak ----------------------------------------------------------------------------------

WORKERS = ("prefill-0", "decode-0")
COMPONENTS = ("up", "redis", *WORKERS, "router")  # "up": the `pdserve up` launcher itself
KILL_TARGETS = {"prefill_kill": "prefill-0", "decode_kill": "decode-0", "redis_restart": "redis"}
SAMPLE_SECONDS = 2.0
LEAK_WAIT_SECONDS = 20.0  # several prefill leases: they free what no decode worker released
KV_PEER_FAULTS = ("stalled_reader", "lost_lease")  # a misbehaving peer of the prefill worker
PREFILL_WAIT_SECONDS = 30.0  # a KV peer fault waits this long for a restarting prefill worker
LONG_PROMPT_TOKENS = 640  # a stalled pull of 40 blocks (~28 MiB): more than socket buffers
STALL_VERDICTS = ("cut_off", "not_cut_off", "inconclusive", "not_started")
IDLE_COUNTERS = ("kv_blocks_used", "pinned_requests", "pulling_requests", "kv_readers")
# A client retries a failed call as OpenAI's clients do, after 1, 2, 4, 8 s: long enough to
# ride out a worker's restart, and an outage costs a few failed requests per client, not hundreds.
RETRIES = 4
FIRST_BACKOFF_SECONDS = 1.0


@dataclass
class Tally:
    """Outcomes counted by kind, failures grouped by error, a few examples of each bad kind."""

    counts: Counter[str] = field(default_factory=Counter)
    by_route: Counter[str] = field(default_factory=Counter)  # "streamed correct", ...
    errors: Counter[str] = field(default_factory=Counter)
    examples: dict[str, list[dict[str, Any]]] = field(default_factory=dict)

    def add(self, outcome: Outcome) -> None:
        self.counts[outcome.kind] += 1
        self.by_route[f"{outcome.route} {outcome.kind}"] += 1
        if outcome.kind.startswith("failed") or outcome.kind in BAD_OUTCOMES:
            self.errors[f"{outcome.kind}: {error_key(outcome.detail)}"] += 1
        if outcome.kind in BAD_OUTCOMES:
            examples = self.examples.setdefault(outcome.kind, [])
            if len(examples) < 10:
                examples.append(asdict(outcome))


class Soak:
    """References, then load with faults, then recovery and the leak check."""

    def __init__(self, config: ChaosConfig, up: UpProcess, client: Client, pool: list[Prompt]):
        self.config = config
        self.up = up
        self.client = client
        self.pool = pool
        self.rng = random.Random(config.seed)
        self.stalls: Counter[str] = Counter()  # stalled readers by verdict
        self.tally = Tally()  # the load's requests
        self.probes = Tally()  # the recovery checks' requests
        self.calls: Counter[str] = Counter()  # the load's calls by how their last request ended
        self.faults: Counter[str] = Counter()
        self.fault_log: list[dict[str, Any]] = []
        self.scraper = WorkerScraper()
        self.rss_start: dict[str, float | None] = {}  # MiB of each component
        self.rss_peak: dict[str, float] = {}
        self._t0 = 0.0
        self._bar: tqdm | None = None
        self._bursts: list[asyncio.Future[None]] = []
        self.peer_hung = 0  # lost-lease PrefillStreams that did not end in time

    async def baseline(self) -> None:
        """Before any fault: every worker idle (the leak check's baseline), and the RSS."""
        idle = await self.idle_counters(LEAK_WAIT_SECONDS)
        if not self._idle(idle):
            raise RuntimeError(f"the workers are not idle before the load: {idle}")
        self.rss_start = self.rss()

    def rss(self) -> dict[str, float | None]:
        return {name: rss_mb(self.up.pid(name)) for name in COMPONENTS}

    async def load(self) -> None:
        """``duration`` seconds of clients, with the fault schedule alongside."""
        cfg = self.config
        self._t0 = time.monotonic()
        stop_at = self._t0 + cfg.duration
        self._bar = tqdm(total=round(cfg.duration), unit="s", disable=not cfg.progress, ncols=100)
        background = [
            asyncio.ensure_future(c) for c in (self._inject_all(), self._sample(), self._tick())
        ]
        try:
            await asyncio.gather(*(self._client_loop(i, stop_at) for i in range(cfg.concurrency)))
            while pending := [task for task in self._bursts if not task.done()]:
                await asyncio.gather(*pending)  # each ends within its deadline; may add more
        finally:
            for task in [*background, *self._bursts]:  # the bursts are done unless interrupted
                task.cancel()
            await asyncio.gather(*background, *self._bursts, return_exceptions=True)
            self._bar.close()

    async def _client_loop(self, index: int, stop_at: float) -> None:
        cfg = self.config
        rng = random.Random(cfg.seed * 1000 + index)
        while time.monotonic() < stop_at:
            prompt, stream = rng.choice(self.pool), rng.random() < cfg.stream_fraction
            route = rng.choice(cfg.routes)
            hang_up = 1 if stream and rng.random() < cfg.disconnect_fraction else 0
            for attempt in range(RETRIES + 1):  # one call: the request and its retries
                outcome = await self.client.send(prompt, stream, route, hang_up_after=hang_up)
                self.tally.add(outcome)
                left = stop_at - time.monotonic()
                if not outcome.kind.startswith("failed") or attempt == RETRIES or left <= 0:
                    break
                await asyncio.sleep(min(FIRST_BACKOFF_SECONDS * 2**attempt, left))
            self.calls[outcome.kind] += 1

    async def _inject_all(self) -> None:
        for at, kind in self.config.schedule():
            await asyncio.sleep(max(0.0, self._t0 + at - time.monotonic()))
            await self._inject(kind)

    async def _inject(self, kind: str) -> None:
        """One fault; a target that is not up (still restarting) is skipped, and said so."""
        now = time.monotonic()
        entry: dict[str, Any] = {"t": round(now - self._t0, 1), "kind": kind, "at": now}
        self.fault_log.append(entry)
        if kind == "client_disconnect":  # in the background: the schedule keeps its times
            entry["requests"] = self.config.burst
            self.faults[kind] += 1
            self._bursts.append(asyncio.ensure_future(self._disconnect_burst()))
            return
        if kind in KV_PEER_FAULTS:  # in the background: it may wait for the worker's restart
            self._bursts.append(asyncio.ensure_future(self._kv_peer_fault(kind, entry)))
            return
        # A hang stops the prefill and the decode worker in turns.
        name = KILL_TARGETS.get(kind) or WORKERS[(self.config.seed + self.faults[kind]) % 2]
        pid = self.up.pid(name)
        entry |= {"target": name, "pid": pid}
        if not alive(pid):
            entry["skipped"] = "not running (restarting)"
            return
        assert pid is not None
        self.faults[kind] += 1
        self._say(f"{entry['t']:>6.1f} s  {kind}: {name} (pid {pid})")
        with contextlib.suppress(ProcessLookupError):  # it may have died since alive()
            if kind != "worker_hang":
                os.kill(pid, signal.SIGKILL)
                return
            os.kill(pid, signal.SIGSTOP)
            try:
                await asyncio.sleep(self.config.hang_seconds)
            finally:  # never leave a worker stopped, also when the soak is interrupted
                os.kill(pid, signal.SIGCONT)

    async def _disconnect_burst(self) -> None:
        """Clients that leave: streams closed after a few chunks, non-streaming requests
        abandoned before their answer. The workers must abort them and free their blocks."""
        sends = []
        for i in range(self.config.burst):
            prompt, route = self.rng.choice(self.pool), self.rng.choice(self.config.routes)
            if i % 2 == 0:
                hang_up = self.rng.randint(1, 4)
                sends.append(self.client.send(prompt, True, route, hang_up_after=hang_up))
            else:
                cancel = self.rng.uniform(0.2, 1.5)
                sends.append(self.client.send(prompt, False, route, cancel_after=cancel))
        self._say(
            f"{time.monotonic() - self._t0:>6.1f} s  client_disconnect: {len(sends)} requests"
        )
        for outcome in await asyncio.gather(*sends):
            self.tally.add(outcome)

    async def _kv_peer_fault(self, kind: str, entry: dict[str, Any]) -> None:
        """A stalled reader or lost leases on the prefill worker (``chaos_kv``); the lost
        PrefillStream is awaited in the background, as a burst is."""
        entry["target"] = "prefill-0"
        deadline = time.monotonic() + PREFILL_WAIT_SECONDS  # it may be restarting
        while True:
            pid = self.up.pid("prefill-0")
            address = await self._prefill_address(pid)
            if alive(pid) and address is not None:
                break
            if time.monotonic() > deadline:
                entry["skipped"] = "not running (restarting)"
                return
            await asyncio.sleep(0.5)
        assert pid is not None
        peer = PrefillPeer.of(pid, address)
        self.faults[kind] += 1
        long_ids = self._long_prompt()
        if kind == "stalled_reader":
            try:
                stall = await peer.stall_a_pull(long_ids)
            except Exception as exc:  # the worker died meanwhile: said in the log
                entry["detail"] = f"could not stall a pull: {type(exc).__name__}: {exc}"[:300]
                self.stalls["not_started"] += 1
            else:
                mib = stall.payload_len / 2**20
                entry["detail"] = f"{mib:.0f} MiB pull left unread for {self._stall_seconds:g} s"
                self._bursts.append(asyncio.ensure_future(self._check_stall(entry, stall, pid)))
        else:
            short_ids = list(self.rng.choice(self.pool).token_ids)
            lose = self._lose(peer, entry, short_ids, long_ids)
            self._bursts.append(asyncio.ensure_future(lose))
        self._say(f"{entry['t']:>6.1f} s  {kind}: prefill-0 {entry.get('detail', '')}")

    @property
    def _stall_seconds(self) -> float:
        """How long a stalled reader reads nothing: three leases (a sender whose sends have a
        deadline of one lease gives up well before)."""
        return 3 * self.config.lease_seconds

    async def _check_stall(self, entry: dict[str, Any], stall: Stall, pid: int) -> None:
        """After the stall, read on: the sender must have cut the reader off."""
        try:
            await asyncio.sleep(self._stall_seconds)
            if self.up.pid("prefill-0") != pid or not alive(pid):
                verdict, entry["check"] = "inconclusive", "the prefill worker restarted meanwhile"
            else:
                cut, entry["check"] = await asyncio.to_thread(PrefillPeer.resume, stall, 30.0)
                verdict = {True: "cut_off", False: "not_cut_off", None: "inconclusive"}[cut]
        finally:
            stall.sock.close()
        self.stalls[verdict] += 1
        self._say(f"{time.monotonic() - self._t0:>6.1f} s  stalled reader: {entry['check']}")

    async def _lose(
        self, peer: PrefillPeer, entry: dict[str, Any], short_ids: list[int], long_ids: list[int]
    ) -> None:
        try:
            other_ids = self._long_prompt()
            outcome, entry["detail"] = await peer.lose_leases(short_ids, long_ids, other_ids)
        except Exception as exc:  # a refused Prefill (the worker died): a clear failure
            outcome, entry["detail"] = "ended", f"{type(exc).__name__}: {exc}"[:300]
        self.peer_hung += outcome == "hung"

    async def _prefill_address(self, pid: int | None) -> str | None:
        """The gRPC address of the prefill worker ``pid`` once registered, from up's router."""
        try:
            answer = await self.client.http.get(self.client.urls["streamed"] + "/v1/workers")
            rows = answer.json()["data"]
        except (httpx.HTTPError, ValueError, KeyError):
            return None
        ours = (w for w in rows if w["role"] == "prefill" and w["pid"] == pid and w["healthy"])
        return next((w["grpc_address"] for w in ours), None)

    def _long_prompt(self) -> list[int]:
        """LONG_PROMPT_TOKENS token ids: pool prompts end to end in a random order (real text,
        and a new prompt each time: the prefix cache must not compute it at once)."""
        ids: list[int] = []
        for prompt in self.rng.sample(self.pool, len(self.pool)):
            ids += prompt.token_ids
        return ids[:LONG_PROMPT_TOKENS]

    async def _sample(self) -> None:
        """RSS peaks of every component and the workers' counters, every few seconds."""
        while True:
            await self._sample_once()
            await asyncio.sleep(SAMPLE_SECONDS)

    async def _sample_once(self) -> None:
        for name in COMPONENTS:
            mib = rss_mb(self.up.pid(name))
            if mib is not None:
                self.rss_peak[name] = max(self.rss_peak.get(name, 0.0), mib)
        for name in WORKERS:
            pid = self.up.pid(name)
            if alive(pid):
                assert pid is not None
                await asyncio.to_thread(self.scraper.scrape, pid)

    async def _tick(self) -> None:
        assert self._bar is not None
        while True:
            await asyncio.sleep(1.0)
            self._bar.update(1)
            c = self.tally.counts
            self._bar.set_postfix_str(
                f"ok {c['correct']} failed {c['failed_clear'] + c['failed_unclear']} "
                f"hung {c['hung']} wrong {c['wrong']} faults {sum(self.faults.values())}"
            )

    def _say(self, message: str) -> None:
        if self._bar is not None:
            self._bar.write(message)

    async def recover(self) -> dict[str, Any]:
        """Until every component is up and every prompt is answered again through every
        router (each length meets each hand-off at least here); a wrong answer is no outage to
        wait out: it is counted, and fails the run."""
        start = time.monotonic()
        attempts = 0
        while True:
            attempts += 1
            down = [name for name in COMPONENTS if not alive(self.up.pid(name))]
            if not down and await self._ready():
                stream = attempts % 2 == 0  # every prompt through every hand-off
                routes = self.config.routes
                sends = [self.client.send(p, stream, r) for p in self.pool for r in routes]
                outcomes = await asyncio.gather(*sends)
                for outcome in outcomes:
                    self.probes.add(outcome)
                if all(o.kind in ("correct", "wrong") for o in outcomes):  # wrong: counted
                    seconds = round(time.monotonic() - start, 1)
                    return {"recovered": True, "seconds": seconds, "attempts": attempts}
            if time.monotonic() - start > self.config.recovery_timeout:
                return {"recovered": False, "seconds": None, "attempts": attempts, "down": down}
            await asyncio.sleep(2.0)

    async def _ready(self) -> bool:
        """Every router answers /ready (its workers are registered): worth probing."""
        for url in {self.client.urls[route] for route in self.config.routes}:
            try:
                if (await self.client.http.get(url + "/ready")).status_code != 200:
                    return False
            except httpx.HTTPError:
                return False
        return True

    async def idle_counters(self, wait: float) -> dict[str, dict[str, int | None]]:
        """Each worker's IDLE_COUNTERS once they are all 0, or as they are after ``wait``
        seconds (None: not exported, or /metrics could not be read)."""
        deadline = time.monotonic() + wait
        while True:
            found: dict[str, dict[str, int | None]] = {}
            for name in WORKERS:
                pid = self.up.pid(name)
                values = await asyncio.to_thread(self.scraper.scrape, pid) if pid else None
                values = values or {}
                found[name] = {k: _int(values.get(k)) for k in IDLE_COUNTERS}
            if self._idle(found) or time.monotonic() > deadline:
                return found
            await asyncio.sleep(0.5)

    @staticmethod
    def _idle(found: dict[str, dict[str, int | None]]) -> bool:
        """Every counter 0 (None: a counter the worker's role does not export; a worker whose
        /metrics could not be read has no kv_blocks_used, and is not idle)."""
        return all(
            value == 0 or (value is None and key != "kv_blocks_used")
            for counters in found.values()
            for key, value in counters.items()
        )

    async def run(self) -> dict[str, Any]:
        """Every phase in order; what the report needs besides this object's counters."""
        phases: dict[str, float] = {}
        for phase, step in (("baseline", self.baseline), ("load", self.load)):
            start = time.monotonic()
            await step()
            phases[phase] = round(time.monotonic() - start, 1)
        start = time.monotonic()
        recovery = await self.recover()
        phases["recovery"] = round(time.monotonic() - start, 1)
        start = time.monotonic()
        idle = await self.idle_counters(LEAK_WAIT_SECONDS)
        phases["leak_check"] = round(time.monotonic() - start, 1)
        await self._sample_once()
        return {
            "recovery": recovery,
            "idle": idle,
            "rss_end": self.rss(),
            "seconds": phases,
        }


def _int(value: float | None) -> int | None:
    return None if value is None else int(value)


# -- the report --------------------------------------------------------------------------------


def build_report(
    config: ChaosConfig, soak: Soak, end: dict[str, Any], up: UpProcess, leftover: list[Any]
) -> dict[str, Any]:
    """Everything the run measured, and whether it passed (``problems`` says why not)."""
    counts, calls, idle = soak.tally.counts, soak.calls, end["idle"]
    unread = any(c["kv_blocks_used"] is None for c in idle.values())
    leaked = None if unread else sum(v or 0 for c in idle.values() for v in c.values())
    results = {
        "sent": sum(counts.values()),
        "completed": counts["correct"] + counts["wrong"],
        **{kind: counts[kind] for kind in OUTCOMES},
        "wrong_in_recovery_probes": soak.probes.counts["wrong"],
        "calls": sum(calls.values()),  # a client's request with its retries
        "calls_completed": calls["correct"] + calls["wrong"],
        "calls_given_up": calls["failed_clear"] + calls["failed_unclear"],
        "hung_kv_peer": soak.peer_hung,  # lost-lease PrefillStreams that never ended
        "stalled_readers_not_cut_off": soak.stalls["not_cut_off"],
        "leaked": leaked,  # blocks used + pins + pulls + readers left on the workers
        "orphans": len(leftover),
    }
    checked = [*BAD_OUTCOMES, "wrong_in_recovery_probes", "hung_kv_peer", "orphans"]
    checked.append("stalled_readers_not_cut_off")
    problems = [f"{key}: {results[key]}" for key in checked if results[key]]
    problems += [f"leaked: {idle}"] if leaked != 0 else []
    problems += [] if end["recovery"]["recovered"] else ["the system did not recover"]
    if up.proc is not None and up.proc.returncode != 0:
        problems.append(f"pdserve up exited with {up.proc.returncode} (see {up.log_path})")
    rss = {}
    for name in COMPONENTS:
        first, last = soak.rss_start.get(name), end["rss_end"][name]
        growth = None if first is None or last is None else round(last - first, 1)
        rss[name] = {"start_mib": first, "end_mib": last, "growth_mib": growth}
        rss[name] |= {"peak_mib": soak.rss_peak.get(name), "restarts": up.restarts[name]}
    faults = {kind: soak.faults[kind] for kind in config.kinds}
    return {
        "command": shlex.join([sys.executable, *sys.argv]),
        "config": asdict(config),
        "results": results,
        "passed": not problems,
        "problems": problems,
        "faults_injected": faults | {k: int(soak.scraper.total(k)) for k in KV_FAULT_KINDS},
        "fault_log": [_logged(entry, up) for entry in soak.fault_log],
        "seconds": end["seconds"],
        "kv_pulls": {
            k: int(soak.scraper.total(k))
            for k in ("pulls_pulled", "pulls_recomputed", "lease_expirations")
        },
        "restarts": dict(up.restarts),
        "recovery": end["recovery"],
        "idle_by_worker": idle,
        "stalled_readers": {k: soak.stalls[k] for k in STALL_VERDICTS},
        "by_route": dict(sorted(soak.tally.by_route.items())),
        "references": "offline engine (services.engine.llm.LLM, float32, 1 thread)",
        "pool": [{"key": p.key, "tokens": len(p.token_ids), "n": p.n} for p in soak.pool],
        "orphan_processes": leftover,
        "rss": rss,
        "errors": dict(soak.tally.errors.most_common()),
        "examples": soak.tally.examples
        | {f"probe_{k}": v for k, v in soak.probes.examples.items()},
        "up_exit_code": up.proc.returncode if up.proc is not None else None,
        "up_log": str(up.log_path),
    }


def _logged(entry: dict[str, Any], up: UpProcess) -> dict[str, Any]:
    """A fault log entry for the report: a restarted target says when it was ready again."""
    entry = dict(entry)
    at = entry.pop("at")
    if entry["kind"] in KILL_TARGETS and "skipped" not in entry:
        entry["ready_again_after_s"] = up.ready_after(entry["target"], at)
    return entry


def _describe(entry: dict[str, Any]) -> str:
    """'7.5 s  prefill_kill prefill-0 (ready again after 12.3 s)'."""
    text = f"{entry['t']:>6.1f} s  {entry['kind']} {entry.get('target', '')}".rstrip()
    if "skipped" in entry:
        return f"{text} skipped: {entry['skipped']}"
    for key in ("detail", "check"):
        text += f"; {entry[key]}" if entry.get(key) else ""
    if entry.get("ready_again_after_s") is not None:
        return f"{text} (ready again after {entry['ready_again_after_s']} s)"
    return text


def summary(report: dict[str, Any]) -> str:
    """The human-readable table."""
    cfg, res = report["config"], report["results"]
    sampling = "greedy and seeded" if cfg["sampled"] else "greedy"
    lines = [
        f"chaos soak: {cfg['duration']:g} s, {cfg['concurrency']} clients, a fault every "
        f"{cfg['fault_interval']:g} s, seed {cfg['seed']}, kv faults {cfg['kv_faults'] or 'off'}",
        f"  {len(report['pool'])} prompts of 1-{max(p['tokens'] for p in report['pool'])} "
        f"tokens (every length mod 16), n 1 or 2, {sampling}, hand-offs "
        f"{', '.join(cfg['routes'])}; references: {report['references']}",
        f"  requests sent               {res['sent']:>6}",
        f"    completed, correct        {res['correct']:>6}",
        f"    completed, wrong          {res['wrong']:>6}",
        f"    failed with clear error   {res['failed_clear']:>6}",
        f"    failed, unclear           {res['failed_unclear']:>6}",
        f"    hung                      {res['hung']:>6}",
        f"    disconnected on purpose   {res['disconnected']:>6}",
        f"  client calls (with retries) {res['calls']:>6}   completed {res['calls_completed']}, "
        f"gave up after {RETRIES} retries {res['calls_given_up']}",
        "  by hand-off                 "
        + ", ".join(f"{k} {v}" for k, v in report["by_route"].items()),
        f"  lost-lease streams hung     {res['hung_kv_peer']:>6}",
        f"  leaked (blocks, pins, pulls, readers) {res['leaked']!s:>4}   "
        f"{report['idle_by_worker']}",
        "  stalled readers             "
        + ", ".join(f"{k} {v}" for k, v in report["stalled_readers"].items()),
        f"  orphan processes            {res['orphans']:>6}",
        "  faults injected             "
        + ", ".join(f"{k} {v}" for k, v in report["faults_injected"].items()),
        "  restarts                    "
        + (", ".join(f"{k} {v}" for k, v in report["restarts"].items()) or "none"),
        f"  recovery                    {report['recovery']}",
        "  KV pulls                    "
        + ", ".join(f"{k.removeprefix('pulls_')} {v}" for k, v in report["kv_pulls"].items()),
        "  seconds                     "
        + ", ".join(f"{k.replace('_', ' ')} {v}" for k, v in report["seconds"].items()),
        "  fault log:",
        *(f"    {_describe(entry)}" for entry in report["fault_log"]),
        "  RSS MiB, start -> end (peak), restarts:",
    ]
    for name, r in report["rss"].items():
        lines.append(
            f"    {name:<10} {r['start_mib']!s:>7} -> {r['end_mib']!s:>7} "
            f"({r['growth_mib']:+} MiB, peak {r['peak_mib']}), restarted {r['restarts']}x"
            if r["growth_mib"] is not None
            else f"    {name:<10} {r['start_mib']} -> {r['end_mib']}"
        )
    lines.append("  failures by error:")
    lines += [f"    {n:>5}  {e}" for e, n in list(report["errors"].items())[:12]] or ["    none"]
    verdict = "PASS" if report["passed"] else "FAIL: " + "; ".join(report["problems"])
    return "\n".join([*lines, verdict])


def parse_args(argv: Sequence[str] | None) -> ChaosConfig:
    d = ChaosConfig()
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--duration", type=float, default=d.duration, help="seconds of load")
    p.add_argument("--seed", type=int, default=d.seed)
    p.add_argument("--concurrency", type=int, default=d.concurrency)
    p.add_argument("--fault-interval", type=float, default=d.fault_interval)
    p.add_argument("--faults", default=",".join(d.kinds), help="the round robin's kinds")
    p.add_argument("--kv-faults", default=d.kv_faults, help="PDSERVE_KV_FAULTS ('' for none)")
    p.add_argument("--hang-seconds", type=float, default=d.hang_seconds)
    p.add_argument("--request-timeout", type=float, default=d.request_timeout)
    p.add_argument("--max-tokens", type=int, default=d.max_tokens)
    p.add_argument("--disconnect-fraction", type=float, default=d.disconnect_fraction)
    p.add_argument("--burst", type=int, default=d.burst, help="requests per client_disconnect")
    p.add_argument("--num-blocks", type=int, default=d.num_blocks)
    p.add_argument("--lease-seconds", type=float, default=d.lease_seconds)
    p.add_argument("--routes", default=",".join(d.routes), help="hand-offs: streamed,whole")
    p.add_argument("--prompts-per-residue", type=int, default=d.prompts_per_residue)
    p.add_argument("--max-prompt-blocks", type=int, default=d.max_prompt_blocks)
    p.add_argument("--greedy-only", action="store_true", help="no seeded sampled prompts")
    p.add_argument("--recovery-timeout", type=float, default=d.recovery_timeout)
    p.add_argument("--startup-timeout", type=float, default=d.startup_timeout)
    p.add_argument("--json-out", default=None, help="write the report here")
    p.add_argument("--log-file", default=None, help="pdserve up's output (default: a temp file)")
    p.add_argument("--no-progress", action="store_true")
    a = p.parse_args(argv)
    return ChaosConfig(
        duration=a.duration,
        seed=a.seed,
        concurrency=a.concurrency,
        fault_interval=a.fault_interval,
        kinds=tuple(k for k in a.faults.split(",") if k),
        kv_faults=a.kv_faults,
        hang_seconds=a.hang_seconds,
        request_timeout=a.request_timeout,
        max_tokens=a.max_tokens,
        disconnect_fraction=a.disconnect_fraction,
        burst=a.burst,
        num_blocks=a.num_blocks,
        lease_seconds=a.lease_seconds,
        routes=tuple(r for r in a.routes.split(",") if r),
        prompts_per_residue=a.prompts_per_residue,
        max_prompt_blocks=a.max_prompt_blocks,
        sampled=not a.greedy_only,
        recovery_timeout=a.recovery_timeout,
        startup_timeout=a.startup_timeout,
        json_out=a.json_out,
        log_file=a.log_file,
        progress=not a.no_progress,
    )


async def _soak(
    config: ChaosConfig,
    up: UpProcess,
    whole: str,
    pool: list[Prompt],
    refs: dict[str, list[Reference]],
) -> tuple[Soak, dict[str, Any]]:
    models = httpx.get(up.url + "/v1/models", timeout=10).json()
    urls = {"streamed": up.url, "whole": whole}
    client = Client(urls, models["data"][0]["id"], config, refs)
    try:
        soak = Soak(config, up, client, pool)
        return soak, await soak.run()
    finally:
        await client.close()


def main(argv: Sequence[str] | None = None) -> int:
    from kvtransfer.faults import KVFaults  # here: it imports torch, which --help need not

    try:
        config = parse_args(argv)
        KVFaults.parse(config.kv_fault_spec)  # a bad spec now, not as workers that fail to start
    except ValueError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    if config.json_out:  # made now: a 5-minute soak must not end unable to save its report
        Path(config.json_out).parent.mkdir(parents=True, exist_ok=True)
    marker = uuid.uuid4().hex
    log_path = Path(config.log_file or tempfile.mkstemp(prefix="chaos-up-", suffix=".log")[1])
    up = UpProcess(config, marker, log_path)
    whole = WholeRouter(log_path.with_suffix(".whole-router.log"))
    print(f"starting: {shlex.join(up.command())}  (output: {log_path})", flush=True)
    print("meanwhile: the reference answers, from the offline engine", flush=True)
    started = time.monotonic()
    pool_args = (config.prompts_per_residue, config.max_prompt_blocks, config.sampled)
    with ThreadPoolExecutor(1) as executor:  # while the workers load: the same model
        computing = executor.submit(offline_references, config.seed, config.max_tokens, *pool_args)
        try:
            url = up.start()
            pool, refs = computing.result()
            whole_url = whole.start(up.pid("router") or 0, 60.0) if "whole" in config.routes else ""
        except RuntimeError as exc:
            print(f"error: {exc}", file=sys.stderr)
            whole.stop()
            up.stop()
            orphans(marker)
            return 2
    reference_seconds = round(time.monotonic() - started, 1)  # with the startup, at once
    print(f"up at {url} (streamed), {whole_url or '-'} (whole); {config.duration:g} s of load")
    try:
        soak, end = asyncio.run(_soak(config, up, whole_url, pool, refs))
    except RuntimeError as exc:  # not idle before the load: broken before any fault
        print(f"error: {exc}\n{up.tail()}", file=sys.stderr)
        return 2
    finally:
        stopping = time.monotonic()
        whole.stop()
        code = up.stop()
        print(f"pdserve up stopped (exit code {code})", flush=True)
    end["seconds"] |= {"startup_and_references": reference_seconds}
    end["seconds"] |= {"stop": round(time.monotonic() - stopping, 1)}
    report = build_report(config, soak, end, up, orphans(marker))
    print(summary(report))
    if config.json_out:
        Path(config.json_out).write_text(json.dumps(report, indent=2) + "\n")
        print(f"report: {config.json_out}")
    return 0 if report["passed"] else 1


if __name__ == "__main__":
    sys.exit(main())
