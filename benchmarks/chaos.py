"""The chaos soak (issue #8): load through the gateway while faults are injected on a schedule.

    python benchmarks/chaos.py                          # the 5-minute soak (`make chaos`)
    python benchmarks/chaos.py --duration 80 --fault-interval 15 --json-out /tmp/chaos.json

In order:

1. start ``pdserve up --restart --prefill 1 --decode 1 --port 0`` (real Redis, workers, router)
   as a child in its own session, with ``PDSERVE_KV_FAULTS`` set (the prefill worker drops or
   corrupts a fraction of the KV pulls it serves, see ``kvtransfer/faults.py``) and the run's
   unique marker in its environment, which every process it starts inherits;
2. compute the greedy reference output (temperature 0) of each prompt of a fixed pool through
   the healthy system;
3. for ``--duration`` seconds, ``--concurrency`` clients send requests from the pool
   (completions and chat, streaming or not; a fraction of the streaming clients hang up after
   the first token on purpose; a request that fails is retried up to 4 times, after 1, 2, 4 and
   8 s) while every ``--fault-interval`` seconds the next fault kind, in round robin, is
   injected: SIGKILL of the prefill worker, SIGKILL of Redis, SIGKILL of the
   decode worker (``pdserve up --restart`` restarts all three), a burst of client disconnects,
   and a hang (SIGSTOP, then SIGCONT after ``--hang-seconds``) of the prefill or decode worker;
4. stop injecting; wait for recovery (``/ready``, every component up, every prompt of the pool
   answered right again) and for every worker's KV blocks in use to return to 0;
5. stop ``pdserve up`` (SIGTERM) and look for processes left with the run's marker.

Every request ends as one of: completed (right, or wrong against the reference), failed with a
clear error (an HTTP error with an OpenAI error body, or an SSE error event; text streamed
before the error must be a prefix of the reference, else the request counts as wrong), failed
without one (unclear), hung (no complete answer within ``--request-timeout``), or disconnected
on purpose. Prints a progress bar and a summary; ``--json-out`` writes the whole report. Exit
status 1 when a request hung, came back wrong or failed unclearly, blocks leaked, a process was
orphaned, or the system did not recover; 2 when it could not start.
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
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import httpx
from tqdm import tqdm

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "benchmarks"))

from chaos_client import OUTCOMES, Client, Outcome, error_key, prompt_pool  # noqa: E402
from chaos_system import ChaosConfig, UpProcess, WorkerScraper, alive, orphans, rss_mb  # noqa: E402

KV_FAULT_KINDS = ("kv_drop", "kv_corrupt")  # injected all along by the prefill worker
BAD_OUTCOMES = ("wrong", "failed_unclear", "hung")


# -- the soak ----------------------------------------------------------------------------------

WORKERS = ("prefill-0", "decode-0")
COMPONENTS = ("up", "redis", *WORKERS, "router")  # "up": the `pdserve up` launcher itself
KILL_TARGETS = {"prefill_kill": "prefill-0", "decode_kill": "decode-0", "redis_restart": "redis"}
SAMPLE_SECONDS = 2.0
LEAK_WAIT_SECONDS = 20.0  # the prefill worker's 5 s lease frees what no decode worker released
# A client retries a failed call as OpenAI's clients do, after 1, 2, 4, 8 s: long enough to
# ride out a worker's restart, and an outage costs a few failed requests per client, not hundreds.
RETRIES = 4
FIRST_BACKOFF_SECONDS = 1.0


@dataclass
class Tally:
    """Outcomes counted by kind, failures grouped by error, a few examples of each bad kind."""

    counts: Counter[str] = field(default_factory=Counter)
    errors: Counter[str] = field(default_factory=Counter)
    examples: dict[str, list[dict[str, Any]]] = field(default_factory=dict)

    def add(self, outcome: Outcome) -> None:
        self.counts[outcome.kind] += 1
        if outcome.kind.startswith("failed") or outcome.kind in BAD_OUTCOMES:
            self.errors[f"{outcome.kind}: {error_key(outcome.detail)}"] += 1
        if outcome.kind in BAD_OUTCOMES:
            examples = self.examples.setdefault(outcome.kind, [])
            if len(examples) < 10:
                examples.append(asdict(outcome))


class Soak:
    """References, then load with faults, then recovery and the leak check."""

    def __init__(self, config: ChaosConfig, up: UpProcess, client: Client):
        self.config = config
        self.up = up
        self.client = client
        self.pool = prompt_pool()
        self.rng = random.Random(config.seed)
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

    async def references(self) -> None:
        """The greedy answer of every prompt, from the healthy system (before any fault)."""
        outcomes = await asyncio.gather(*(self.client.send(p, stream=False) for p in self.pool))
        for prompt, outcome in zip(self.pool, outcomes):
            if outcome.kind != "completed" or not outcome.text:
                raise RuntimeError(f"no reference for {prompt.key}: {outcome}")
            self.client.references[prompt.key] = outcome.text
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
            await asyncio.gather(*self._bursts)  # each ends within its request timeout
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
            hang_up = 1 if stream and rng.random() < cfg.disconnect_fraction else 0
            for attempt in range(RETRIES + 1):  # one call: the request and its retries
                outcome = await self.client.send(prompt, stream, hang_up_after=hang_up)
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
            prompt = self.rng.choice(self.pool)
            if i % 2 == 0:
                sends.append(self.client.send(prompt, True, hang_up_after=self.rng.randint(1, 4)))
            else:
                sends.append(
                    self.client.send(prompt, False, cancel_after=self.rng.uniform(0.2, 1.5))
                )
        self._say(
            f"{time.monotonic() - self._t0:>6.1f} s  client_disconnect: {len(sends)} requests"
        )
        for outcome in await asyncio.gather(*sends):
            self.tally.add(outcome)

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
        """Until every component is up and every prompt is answered right again."""
        start = time.monotonic()
        attempts = 0
        while True:
            attempts += 1
            down = [name for name in COMPONENTS if not alive(self.up.pid(name))]
            if not down:
                sends = (self.client.send(p, stream=attempts % 2 == 0) for p in self.pool)
                outcomes = await asyncio.gather(*sends)
                for outcome in outcomes:
                    self.probes.add(outcome)
                if all(o.kind == "correct" for o in outcomes):
                    seconds = round(time.monotonic() - start, 1)
                    return {"recovered": True, "seconds": seconds, "attempts": attempts}
            if time.monotonic() - start > self.config.recovery_timeout:
                return {"recovered": False, "seconds": None, "attempts": attempts, "down": down}
            await asyncio.sleep(2.0)

    async def leaks(self) -> dict[str, int | None]:
        """KV blocks in use on each worker once idle (None: its /metrics could not be read)."""
        deadline = time.monotonic() + LEAK_WAIT_SECONDS
        while True:
            used: dict[str, int | None] = {}
            for name in WORKERS:
                pid = self.up.pid(name)
                values = await asyncio.to_thread(self.scraper.scrape, pid) if pid else None
                used[name] = int(values["kv_blocks_used"]) if values else None
            if all(v == 0 for v in used.values()) or time.monotonic() > deadline:
                return used
            await asyncio.sleep(0.5)

    async def run(self) -> dict[str, Any]:
        """Every phase in order; what the report needs besides this object's counters."""
        phases: dict[str, float] = {}
        for phase, step in (("references", self.references), ("load", self.load)):
            start = time.monotonic()
            await step()
            phases[phase] = round(time.monotonic() - start, 1)
        start = time.monotonic()
        recovery = await self.recover()
        phases["recovery"] = round(time.monotonic() - start, 1)
        start = time.monotonic()
        leaked = await self.leaks()
        phases["leak_check"] = round(time.monotonic() - start, 1)
        await self._sample_once()
        return {
            "recovery": recovery,
            "leaked_blocks": leaked,
            "rss_end": self.rss(),
            "seconds": phases,
        }


# -- the report --------------------------------------------------------------------------------


def build_report(
    config: ChaosConfig, soak: Soak, end: dict[str, Any], up: UpProcess, leftover: list[Any]
) -> dict[str, Any]:
    """Everything the run measured, and whether it passed (``problems`` says why not)."""
    counts, calls, leaked = soak.tally.counts, soak.calls, end["leaked_blocks"]
    results = {
        "sent": sum(counts.values()),
        "completed": counts["correct"] + counts["wrong"],
        **{kind: counts[kind] for kind in OUTCOMES},
        "wrong_in_recovery_probes": soak.probes.counts["wrong"],
        "calls": sum(calls.values()),  # a client's request with its retries
        "calls_completed": calls["correct"] + calls["wrong"],
        "calls_given_up": calls["failed_clear"] + calls["failed_unclear"],
        "leaked_blocks": None if None in leaked.values() else sum(leaked.values()),
        "orphans": len(leftover),
    }
    checked = (*BAD_OUTCOMES, "wrong_in_recovery_probes", "orphans")
    problems = [f"{key}: {results[key]}" for key in checked if results[key]]
    problems += [f"leaked blocks: {leaked}"] if results["leaked_blocks"] != 0 else []
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
        "kv_pulls": {k: int(soak.scraper.total(k)) for k in ("pulls_pulled", "pulls_recomputed")},
        "restarts": dict(up.restarts),
        "recovery": end["recovery"],
        "leaked_blocks_by_worker": leaked,
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
    if entry.get("ready_again_after_s") is not None:
        return f"{text} (ready again after {entry['ready_again_after_s']} s)"
    return text


def summary(report: dict[str, Any]) -> str:
    """The human-readable table."""
    cfg, res = report["config"], report["results"]
    lines = [
        f"chaos soak: {cfg['duration']:g} s, {cfg['concurrency']} clients, a fault every "
        f"{cfg['fault_interval']:g} s, seed {cfg['seed']}, kv faults {cfg['kv_faults'] or 'off'}",
        f"  requests sent               {res['sent']:>6}",
        f"    completed, correct        {res['correct']:>6}",
        f"    completed, wrong          {res['wrong']:>6}",
        f"    failed with clear error   {res['failed_clear']:>6}",
        f"    failed, unclear           {res['failed_unclear']:>6}",
        f"    hung                      {res['hung']:>6}",
        f"    disconnected on purpose   {res['disconnected']:>6}",
        f"  client calls (with retries) {res['calls']:>6}   completed {res['calls_completed']}, "
        f"gave up after {RETRIES} retries {res['calls_given_up']}",
        f"  leaked KV blocks            {res['leaked_blocks']!s:>6}   "
        f"{report['leaked_blocks_by_worker']}",
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
        recovery_timeout=a.recovery_timeout,
        startup_timeout=a.startup_timeout,
        json_out=a.json_out,
        log_file=a.log_file,
        progress=not a.no_progress,
    )


async def _soak(config: ChaosConfig, up: UpProcess) -> tuple[Soak, dict[str, Any]]:
    models = httpx.get(up.url + "/v1/models", timeout=10).json()
    client = Client(up.url, models["data"][0]["id"], config)
    try:
        soak = Soak(config, up, client)
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
    print(f"starting: {shlex.join(up.command())}  (output: {log_path})", flush=True)
    started = time.monotonic()
    try:
        url = up.start()
    except RuntimeError as exc:
        print(f"error: {exc}", file=sys.stderr)
        orphans(marker)
        return 2
    started_up = time.monotonic()
    print(f"up at {url}; computing the reference outputs, then {config.duration:g} s of load")
    try:
        soak, end = asyncio.run(_soak(config, up))
    except RuntimeError as exc:  # no reference outputs: the system is broken before any fault
        print(f"error: {exc}\n{up.tail()}", file=sys.stderr)
        return 2
    finally:
        stopping = time.monotonic()
        code = up.stop()
        print(f"pdserve up stopped (exit code {code})", flush=True)
    end["seconds"] |= {"startup": round(started_up - started, 1)}
    end["seconds"] |= {"stop": round(time.monotonic() - stopping, 1)}
    report = build_report(config, soak, end, up, orphans(marker))
    print(summary(report))
    if config.json_out:
        Path(config.json_out).write_text(json.dumps(report, indent=2) + "\n")
        print(f"report: {config.json_out}")
    return 0 if report["passed"] else 1


if __name__ == "__main__":
    sys.exit(main())
