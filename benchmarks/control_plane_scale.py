"""Control-plane scale (#32 item 2): the real router and a real Redis in front of 10 to 300
simulated workers, and how the router's and the registry's costs grow with the worker count.

For each count in ``--workers`` (split 1:3 prefill:decode), a fresh Redis, the workers
(``pdserve prefill|decode --simulate PROFILE --simulated-workers K``, at most
``--per-process`` workers per process; the default profile is the one with the shortest steps,
so that the simulated steps are not what 2 cores run out of) and one router
(``--disaggregation always``: every request takes both pools and the KV hand-off) are started;
then, measured:

- idle, over ``--idle-seconds``: the CPU of the router, of each worker-host process and of
  Redis, and Redis's commands per second (INFO ``total_commands_processed``);
- after a burst that reaches every worker (the router's channels opened), a burst of
  ``--requests`` small completions (a ~35-token prompt, ``--max-tokens`` tokens) at
  ``--concurrency``, from httpx: the router's CPU seconds per request (``/proc/<pid>/stat``),
  requests per second, Redis commands per second, and per request (beyond the idle rate);
- ``--ttft-requests`` streamed small requests one at a time: TTFT p50, and the router's added
  latency, TTFT p50 minus the profile's own prefill step for the prompt;
- a decode worker joining (one more process hosting one worker): seconds from its registration
  (its ready line) until the router counts it routable (its ``pdserve_router_workers`` gauge);
- that worker lost (SIGKILL): seconds until its record expired in Redis and until the router
  stopped counting it (both bounded by the record's TTL, ``--ttl-seconds``).

Then the first thing that breaks as the count grows, and why (``verdict``). Every process this
script starts is stopped at the end of its count, on failure and on Ctrl-C (and dies with it:
the workers and Redis ask for SIGKILL when their parent dies).

    python benchmarks/control_plane_scale.py [--workers 10,30,100,300] [--requests 200]

Runtime: about 5-8 minutes for the default counts on 2 cores (start-up grows with the workers,
~0.2 s each; each count then measures for about a minute). Prints the command, the machine and
the table; writes control_plane_scale.json to --out-dir (default benchmarks/results/).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import os
import re
import secrets
import shlex
import signal
import statistics
import subprocess
import sys
import time
import uuid
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import httpx
import redis
from tqdm import tqdm

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks"))

from machine import machine_info  # noqa: E402

from services.redis_server import RedisServer  # noqa: E402
from services.worker.launcher import WorkerProcess  # noqa: E402
from services.worker.simulation import load_profile  # noqa: E402

# A small request: the router's own work is what is left. Over two full KV blocks, so that
# the prefix-aware prefill policy looks its blocks up in the registry as with real prompts.
PROMPT = (
    "You are a helpful assistant. Answer in one short sentence. Question: which river flows "
    "through the capital of France, and which sea does it reach in the end?"
)
STEPS = 6  # progress steps per worker count


@dataclass(frozen=True)
class ScaleConfig:
    """One run's settings, built once from the command line."""

    workers: tuple[int, ...] = (10, 30, 100, 300)
    profile: str = "sim-h100-llama3-8b"
    per_process: int = 75  # simulated workers one process hosts, at most
    num_blocks: int = 512  # KV blocks per worker (small: 300 workers share the memory)
    requests: int = 200
    concurrency: int = 16
    max_tokens: int = 4
    ttft_requests: int = 20
    idle_seconds: float = 5.0
    heartbeat_seconds: float = 1.0  # the workers' default
    ttl_seconds: float = 5.0  # the default of workers and router
    start_timeout: float = 300.0


@dataclass
class Row:
    """What one worker count measured (times in seconds unless named otherwise)."""

    workers: int
    prefill: int
    decode: int
    host_processes: int
    start_s: float = 0.0
    idle_router_cores: float = 0.0
    idle_hosts_cores: float = 0.0
    idle_busiest_host_cores: float = 0.0
    idle_redis_cores: float = 0.0
    idle_redis_ops_per_s: float = 0.0
    burst_requests_per_s: float = 0.0
    burst_failed: int = 0
    router_cpu_ms_per_request: float = 0.0
    burst_redis_ops_per_s: float = 0.0
    burst_redis_ops_per_request: float = 0.0
    ttft_p50_ms: float = 0.0
    added_latency_ms: float = 0.0
    join_s: float = math.nan
    loss_record_expired_s: float = math.nan
    loss_router_dropped_s: float = math.nan
    host_rss_mb_per_worker: float = 0.0


# -- processes ---------------------------------------------------------------------------------


def cpu_seconds(pid: int) -> float:
    """User + system CPU seconds of a process so far (Linux /proc)."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def rss_mb(pid: int) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    return 0.0


def split(total: int, per_process: int) -> list[int]:
    """``total`` workers over as few processes of at most ``per_process`` as fit, evenly."""
    num = max(1, math.ceil(total / per_process))
    return [total // num + (1 if i < total % num else 0) for i in range(num)]


@dataclass
class Cluster:
    """One worker count's Redis, worker hosts, router and the extra worker; ``stop()`` ends
    every one of them."""

    config: ScaleConfig
    redis: RedisServer
    prefix: str = field(default_factory=lambda: f"cps{uuid.uuid4().hex[:6]}:")
    # As pdserve up: records signed with it, and the router checks every proof on every refresh.
    env: dict[str, str] = field(
        default_factory=lambda: {"PDSERVE_CLUSTER_TOKEN": secrets.token_hex(32)}
    )
    hosts: list[WorkerProcess] = field(default_factory=list)
    router: WorkerProcess | None = None
    extra: WorkerProcess | None = None

    def registry_args(self) -> list[str]:
        return ["--redis-url", self.redis.url, "--redis-prefix", self.prefix]

    def worker_args(self, count: int) -> list[str]:
        cfg = self.config
        args = ["--simulate", cfg.profile, "--threads", "1", "--metrics-port", "-1"]
        args += ["--num-blocks", str(cfg.num_blocks), *self.registry_args()]
        args += ["--heartbeat-seconds", str(cfg.heartbeat_seconds)]
        args += ["--ttl-seconds", str(cfg.ttl_seconds)]
        return args + (["--simulated-workers", str(count)] if count > 1 else [])

    def start(self, num_prefill: int, num_decode: int) -> None:
        cfg = self.config
        for role, total in (("prefill", num_prefill), ("decode", num_decode)):
            for count in split(total, cfg.per_process):
                self.hosts.append(WorkerProcess(role, self.worker_args(count), self.env))
        router_args = ["--port", "0", "--disaggregation", "always", *self.registry_args()]
        router_args += ["--ttl-seconds", str(cfg.ttl_seconds)]
        self.router = WorkerProcess("router", router_args, self.env)
        for process in [*self.hosts, self.router]:
            process.spawn()
        for process in [*self.hosts, self.router]:
            process.wait_ready(cfg.start_timeout)

    @property
    def url(self) -> str:
        assert self.router is not None
        return str(self.router.info["url"])

    def stop(self) -> None:
        """SIGTERM to all (they drain at once), SIGKILL to what is left after 30 s."""
        processes = [p for p in (self.router, self.extra, *self.hosts) if p is not None]
        live = [p for p in processes if p.is_alive()]
        for process in live:
            process.signal(signal.SIGTERM)
        deadline = time.monotonic() + 30
        for process in live:
            assert process.proc is not None
            try:
                process.proc.wait(max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                process.kill()
        self.redis.stop()


@contextmanager
def cluster(config: ScaleConfig, num_prefill: int, num_decode: int) -> Iterator[Cluster]:
    server = RedisServer().start()
    c = Cluster(config, server)
    try:
        c.start(num_prefill, num_decode)
        yield c
    except BaseException:
        for process in [c.router, c.extra, *c.hosts]:
            if process is not None and not process.is_alive():
                print(f"--- {process.role} exited ---\n{process.output_tail(15)}", file=sys.stderr)
        raise
    finally:
        c.stop()


# -- what the router sees ----------------------------------------------------------------------


def routable(url: str, client: httpx.Client) -> dict[str, int]:
    """The router's ``pdserve_router_workers`` gauge: routable workers per pool."""
    text = client.get(url + "/metrics", timeout=10).text
    found = re.findall(r'^pdserve_router_workers\{pool="(\w+)"\} (\S+)$', text, re.M)
    return {pool: int(float(value)) for pool, value in found}


def wait_for(predicate: Any, timeout: float, interval: float = 0.02) -> float:
    """Seconds until ``predicate()`` holds (NaN if it did not within ``timeout``)."""
    started = time.monotonic()
    while time.monotonic() - started < timeout:
        if predicate():
            return time.monotonic() - started
        time.sleep(interval)
    return math.nan


# -- the measurements --------------------------------------------------------------------------


@dataclass
class Meter:
    """CPU seconds of some processes and Redis's command count, between two readings."""

    pids: dict[str, int]
    db: redis.Redis

    def read(self) -> tuple[float, dict[str, float], int]:
        cpu = {name: cpu_seconds(pid) for name, pid in self.pids.items()}
        return time.monotonic(), cpu, int(self.db.info("stats")["total_commands_processed"])

    @staticmethod
    def delta(
        before: tuple[float, dict[str, float], int], after: tuple[float, dict[str, float], int]
    ) -> tuple[float, dict[str, float], int]:
        seconds = after[0] - before[0]
        cpu = {k: after[1][k] - before[1][k] for k in before[1]}
        return seconds, cpu, after[2] - before[2]


def probe(url: str, http: httpx.Client) -> tuple[str, int]:
    """The served model's name and the prompt's length in tokens (one request)."""
    model = str(http.get(url + "/v1/models", timeout=10).json()["data"][0]["id"])
    body = {"model": model, "prompt": PROMPT, "max_tokens": 1}
    answer = http.post(url + "/v1/completions", json=body, timeout=60)
    answer.raise_for_status()
    return model, int(answer.json()["usage"]["prompt_tokens"])


async def burst(url: str, model: str, cfg: ScaleConfig, num: int) -> tuple[float, int]:
    """``num`` small completions at ``cfg.concurrency``: (seconds, failures)."""
    body = {"model": model, "prompt": PROMPT, "max_tokens": cfg.max_tokens, "temperature": 0}
    queue = iter(range(num))
    failed = 0
    limits = httpx.Limits(max_connections=cfg.concurrency)

    async with httpx.AsyncClient(base_url=url, timeout=60, limits=limits) as client:

        async def loop() -> None:
            nonlocal failed
            for _ in queue:
                try:
                    response = await client.post("/v1/completions", json=body)
                    failed += response.status_code != 200
                except httpx.HTTPError:
                    failed += 1

        started = time.monotonic()
        await asyncio.gather(*(loop() for _ in range(cfg.concurrency)))
        return time.monotonic() - started, failed


async def ttfts(url: str, model: str, cfg: ScaleConfig) -> list[float]:
    """Seconds to the first streamed token of ``cfg.ttft_requests`` requests, one at a time."""
    body = {"model": model, "prompt": PROMPT, "max_tokens": 2, "stream": True, "temperature": 0}
    times = []
    async with httpx.AsyncClient(base_url=url, timeout=60) as client:
        for _ in range(cfg.ttft_requests):
            started = time.perf_counter()
            async with client.stream("POST", "/v1/completions", json=body) as response:
                async for line in response.aiter_lines():
                    if line.startswith("data: {"):
                        times.append(time.perf_counter() - started)
                        break
    return times


def measure(cfg: ScaleConfig, total: int, progress: tqdm) -> Row:
    num_prefill = max(1, total // 4)
    num_decode = total - num_prefill
    row = Row(total, num_prefill, num_decode, 0)
    started = time.monotonic()
    with cluster(cfg, num_prefill, num_decode) as c, httpx.Client() as http:
        assert c.router is not None
        row.host_processes = len(c.hosts)
        want = {"prefill": num_prefill, "decode": num_decode}
        seen = wait_for(lambda: routable(c.url, http).items() >= want.items(), 60, 0.2)
        if math.isnan(seen):
            raise RuntimeError(f"the router sees {routable(c.url, http)}, not {want}")
        row.start_s = time.monotonic() - started
        progress.update()

        db = redis.Redis.from_url(c.redis.url)
        pids = {"router": c.router.pid, "redis": c.redis.pid or 0}
        pids |= {f"host{i}": h.pid for i, h in enumerate(c.hosts)}
        meter = Meter(pids, db)
        time.sleep(2.0)  # past the start-up's last registrations and first channels
        before = meter.read()
        time.sleep(cfg.idle_seconds)
        seconds, cpu, commands = Meter.delta(before, meter.read())
        hosts = [v / seconds for k, v in cpu.items() if k.startswith("host")]
        row.idle_router_cores = cpu["router"] / seconds
        row.idle_redis_cores = cpu["redis"] / seconds
        row.idle_hosts_cores = sum(hosts)
        row.idle_busiest_host_cores = max(hosts)
        row.idle_redis_ops_per_s = commands / seconds
        row.host_rss_mb_per_worker = sum(rss_mb(h.pid) for h in c.hosts) / total
        progress.update()

        model, prompt_tokens = probe(c.url, http)
        # First a burst that reaches every worker: the router's channels to them are opened
        # outside the measured one (a one-off cost, at start-up or when a worker joins).
        asyncio.run(burst(c.url, model, cfg, max(2 * cfg.concurrency, total)))
        before = meter.read()
        seconds, row.burst_failed = asyncio.run(burst(c.url, model, cfg, cfg.requests))
        window, cpu, commands = Meter.delta(before, meter.read())
        row.burst_requests_per_s = cfg.requests / seconds
        row.router_cpu_ms_per_request = 1000 * cpu["router"] / cfg.requests
        row.burst_redis_ops_per_s = commands / window
        # What the requests added to the heartbeats' and refreshes' steady load.
        added = commands - row.idle_redis_ops_per_s * window
        row.burst_redis_ops_per_request = max(0.0, added) / cfg.requests
        progress.update()

        times = asyncio.run(ttfts(c.url, model, cfg))
        prefill_s = load_profile(cfg.profile).step.seconds([(0, prompt_tokens)], [])
        row.ttft_p50_ms = 1000 * statistics.median(times)
        row.added_latency_ms = row.ttft_p50_ms - 1000 * prefill_s
        progress.update()

        row.join_s = join(c, http, num_decode)
        progress.update()
        row.loss_record_expired_s, row.loss_router_dropped_s = lose(c, http, db, num_decode)
        progress.update()
    return row


def join(c: Cluster, http: httpx.Client, num_decode: int) -> float:
    """One more decode worker (its own process): seconds from its registration to routable."""
    c.extra = WorkerProcess("decode", c.worker_args(1), c.env)
    c.extra.start(c.config.start_timeout)  # the ready line comes right after it registered
    return wait_for(lambda: routable(c.url, http).get("decode") == num_decode + 1, 30)


def lose(c: Cluster, http: httpx.Client, db: redis.Redis, num_decode: int) -> tuple[float, float]:
    """SIGKILL the extra worker: seconds until its record expired, and until the router
    stopped counting it routable."""
    assert c.extra is not None
    key = f"{c.prefix}worker:{c.extra.info['worker_id']}"
    c.extra.kill()
    started = time.monotonic()
    expired = dropped = math.nan
    deadline = started + 4 * c.config.ttl_seconds
    while (math.isnan(expired) or math.isnan(dropped)) and time.monotonic() < deadline:
        if math.isnan(expired) and not db.exists(key):
            expired = time.monotonic() - started
        if math.isnan(dropped) and routable(c.url, http).get("decode") == num_decode:
            dropped = time.monotonic() - started
        time.sleep(0.02)
    return expired, dropped


# -- the verdict -------------------------------------------------------------------------------


def verdict(rows: list[Row], cfg: ScaleConfig) -> str:
    """The first thing that breaks as the count grows, and why (or what grows fastest)."""
    base = rows[0]
    for row in rows:
        n = row.workers
        if row.burst_failed:
            return f"at {n} workers: {row.burst_failed} of {cfg.requests} burst requests failed"
        if row.idle_busiest_host_cores > 0.5:
            return (
                f"at {n} workers: the worker-host processes. Idle, the busiest of them used "
                f"{row.idle_busiest_host_cores:.0%} of a core for heartbeats, load and prefix "
                "reports and gRPC/asyncio housekeeping of its simulated workers, so their "
                "simulated steps no longer keep the profile's time: a limit of hosting many "
                "simulated workers on few cores, not of the router or Redis"
            )
        if row.idle_router_cores > 0.25:
            return (
                f"at {n} workers: the router's idle work. It re-reads and validates every "
                f"record every refresh (0.5 s): {row.idle_router_cores:.0%} of a core idle"
            )
        if row.router_cpu_ms_per_request > 2 * base.router_cpu_ms_per_request + 1.0:
            now, then = row.router_cpu_ms_per_request, base.router_cpu_ms_per_request
            return (
                f"at {n} workers: the router's CPU per request, {now:.1f} ms against "
                f"{then:.1f} ms at {base.workers}: a per-request cost grows with the workers"
            )
        if row.added_latency_ms > 2 * base.added_latency_ms + 5.0:
            return (
                f"at {n} workers: the added latency, {row.added_latency_ms:.1f} ms against "
                f"{base.added_latency_ms:.1f} ms at {base.workers}"
            )
        if row.loss_router_dropped_s > cfg.ttl_seconds + 2.0 or row.join_s > 2.0:
            return (
                f"at {n} workers: membership. A join took {row.join_s:.2f} s, a loss "
                f"{row.loss_router_dropped_s:.2f} s (the record's TTL is {cfg.ttl_seconds:g} s)"
            )
    last = rows[-1]
    growth = last.idle_hosts_cores / base.idle_hosts_cores if base.idle_hosts_cores else 0.0
    return (
        f"nothing broke up to {last.workers} workers; what grows is the worker hosts' idle CPU "
        f"({growth:.1f}x from {base.workers} to {last.workers} workers, linear in the workers: "
        "each heartbeats once a second) and Redis's idle commands "
        f"({base.idle_redis_ops_per_s:.0f}/s -> {last.idle_redis_ops_per_s:.0f}/s, a few per "
        "worker per heartbeat), and Redis commands per request "
        f"({base.burst_redis_ops_per_request:.1f} -> {last.burst_redis_ops_per_request:.1f}: the "
        "prefix-aware prefill policy looks the prompt up on each prefill worker that publishes "
        "cached blocks); the router's CPU per request "
        f"({base.router_cpu_ms_per_request:.1f} -> {last.router_cpu_ms_per_request:.1f} ms) and "
        f"the membership times (join {last.join_s:.2f} s, loss {last.loss_router_dropped_s:.2f} s "
        f"at {last.workers}) stay within bounds"
    )


# -- output ------------------------------------------------------------------------------------

COLUMNS = [
    ("workers", "workers", "{:d}"),
    ("P+D", None, "{}"),
    ("procs", "host_processes", "{:d}"),
    ("up s", "start_s", "{:.0f}"),
    ("rtr ms/req", "router_cpu_ms_per_request", "{:.2f}"),
    ("req/s", "burst_requests_per_s", "{:.0f}"),
    ("TTFT ms", "ttft_p50_ms", "{:.1f}"),
    ("added ms", "added_latency_ms", "{:.1f}"),
    ("redis/s idle", "idle_redis_ops_per_s", "{:.0f}"),
    ("redis/s burst", "burst_redis_ops_per_s", "{:.0f}"),
    ("redis/req", "burst_redis_ops_per_request", "{:.1f}"),
    ("join s", "join_s", "{:.2f}"),
    ("expire s", "loss_record_expired_s", "{:.2f}"),
    ("drop s", "loss_router_dropped_s", "{:.2f}"),
    ("rtr idle", "idle_router_cores", "{:.1%}"),
    ("hosts idle", "idle_hosts_cores", "{:.0%}"),
    ("busiest", "idle_busiest_host_cores", "{:.0%}"),
    ("MB/wkr", "host_rss_mb_per_worker", "{:.0f}"),
]


def table(rows: list[Row]) -> str:
    cells = [[name for name, _, _ in COLUMNS]]
    for row in rows:
        values = asdict(row)
        cells.append(
            [
                f"{row.prefill}+{row.decode}" if key is None else fmt.format(values[key])
                for _, key, fmt in COLUMNS
            ]
        )
    widths = [max(len(line[i]) for line in cells) for i in range(len(COLUMNS))]
    return "\n".join(" ".join(c.rjust(w) for c, w in zip(line, widths)) for line in cells)


def parse_args(argv: list[str] | None) -> tuple[ScaleConfig, Path]:
    parser = argparse.ArgumentParser(description=(__doc__ or "").split("\n\n")[0])
    defaults = ScaleConfig()
    parser.add_argument("--workers", default=",".join(map(str, defaults.workers)))
    parser.add_argument("--profile", default=defaults.profile)
    parser.add_argument("--per-process", type=int, default=defaults.per_process)
    parser.add_argument("--num-blocks", type=int, default=defaults.num_blocks)
    parser.add_argument("--requests", type=int, default=defaults.requests)
    parser.add_argument("--concurrency", type=int, default=defaults.concurrency)
    parser.add_argument("--max-tokens", type=int, default=defaults.max_tokens)
    parser.add_argument("--ttft-requests", type=int, default=defaults.ttft_requests)
    parser.add_argument("--idle-seconds", type=float, default=defaults.idle_seconds)
    parser.add_argument("--heartbeat-seconds", type=float, default=defaults.heartbeat_seconds)
    parser.add_argument("--ttl-seconds", type=float, default=defaults.ttl_seconds)
    parser.add_argument("--out-dir", type=Path, default=ROOT / "benchmarks" / "results")
    args = vars(parser.parse_args(argv))
    out_dir = args.pop("out_dir")
    args["workers"] = tuple(int(n) for n in args["workers"].split(","))
    return ScaleConfig(**args), out_dir


def main(argv: list[str] | None = None) -> int:
    cfg, out_dir = parse_args(argv)
    # SIGTERM ends the run as Ctrl-C does (and SIGINT does even where a shell ignored it for a
    # background job): the `finally`s stop every process started.
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, signal.default_int_handler)
    command = shlex.join([sys.executable, *sys.argv])
    machine = machine_info(1, note="shared machines inflate every figure")
    print(command)
    print(json.dumps(machine))
    rows: list[Row] = []
    try:
        with tqdm(total=STEPS * len(cfg.workers), unit="step", file=sys.stderr) as progress:
            for total in cfg.workers:
                progress.set_description(f"{total} workers")
                rows.append(measure(cfg, total, progress))
                tqdm.write(table(rows[-1:]), file=sys.stderr)
    except KeyboardInterrupt:
        print("interrupted; every process this run started is stopped", file=sys.stderr)
        return 130
    first = verdict(rows, cfg)
    print(table(rows))
    print("first to break:", first)
    out_dir.mkdir(parents=True, exist_ok=True)
    result = {
        "command": command,
        "machine": machine,
        "config": asdict(cfg),
        "rows": [asdict(r) for r in rows],
        "first_to_break": first,
    }
    path = out_dir / "control_plane_scale.json"
    path.write_text(json.dumps(result, indent=1, default=str) + "\n")
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
