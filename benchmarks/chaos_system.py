"""The chaos soak's system under test and its processes (see ``benchmarks/chaos.py``).

``ChaosConfig`` (the soak's settings, read here and by ``chaos_client.Client``); ``UpProcess``,
``pdserve up --restart`` as a child in its own session; ``WholeRouter``, a second router on the
same workers that hands the KV off after the prefill (``--no-stream-kv``) where up's streams it;
process inspection (``alive``, ``rss_mb``, ``processes_with_marker``, ``orphans``);
``WorkerScraper``, the workers' /metrics.
"""

from __future__ import annotations

import ctypes
import json
import os
import re
import signal
import subprocess
import sys
import threading
import time
import urllib.request
from collections import Counter, deque
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import psutil
from prometheus_client.parser import text_string_to_metric_families

from services.worker.launcher import PARENT_PID_ENV

LISTEN_FD = "PDSERVE_LISTEN_FD"  # router.server.LISTEN_FD_ENV

ROOT = Path(__file__).resolve().parents[1]
READY_PREFIX = "PDSERVE_READY "  # common/ready.py: a component's line once it listens

# The round robin's default order: the kills first, then the KV peer's faults, whose checks
# (three leases) end before the next kill at a fault every 6 s or more; the last fault, a
# hang, needs no restart before the recovery.
FAULT_KINDS = (
    "prefill_kill",
    "decode_kill",
    "stalled_reader",
    "lost_lease",
    "redis_restart",
    "client_disconnect",
    "worker_hang",
)
ROUTES = ("streamed", "whole")  # up's router streams the KV hand-off; the second one does not
MARKER_ENV = "PDSERVE_CHAOS_MARKER"  # read by nothing in pdserve: it only tags the processes


@dataclass(frozen=True)
class ChaosConfig:
    """One soak's settings; built once from the command line."""

    duration: float = 300.0  # seconds of load with faults
    seed: int = 0
    concurrency: int = 6  # clients sending back to back
    fault_interval: float = 30.0  # seconds between two scheduled faults
    kinds: tuple[str, ...] = FAULT_KINDS  # the round robin, in this order
    kv_faults: str = "drop=0.05,corrupt=0.05"  # the prefill worker's PDSERVE_KV_FAULTS
    hang_seconds: float = 5.0  # SIGSTOP -> SIGCONT (more than the 2 s registry TTL)
    request_timeout: float = 60.0  # no complete answer by then: hung
    max_tokens: int = 16
    stream_fraction: float = 0.5
    disconnect_fraction: float = 0.1  # of the streaming requests, hang up after the first token
    burst: int = 4  # requests of a client_disconnect fault
    num_blocks: int = 256  # KV blocks per worker
    lease_seconds: float = 3.0  # the prefill worker's --lease-seconds (short: leases run out)
    routes: tuple[str, ...] = ROUTES  # hand-offs the clients use, each through its own router
    prompts_per_residue: int = 2  # prompts of each length mod 16 in the pool
    max_prompt_blocks: int = 20  # prompt lengths up to 16 times this
    sampled: bool = True  # one prompt in three sampled with a seed (else all greedy)
    recovery_timeout: float = 180.0
    startup_timeout: float = 300.0
    json_out: str | None = None
    log_file: str | None = None  # pdserve up's output (default: a temporary file)
    progress: bool = True

    def __post_init__(self) -> None:
        unknown = set(self.kinds) - set(FAULT_KINDS)
        if unknown or not self.kinds:
            raise ValueError(f"--faults must name some of {FAULT_KINDS}, got {self.kinds}")
        if min(self.duration, self.fault_interval, self.request_timeout) <= 0:
            raise ValueError("--duration, --fault-interval and --request-timeout must be > 0")
        if self.concurrency < 1 or self.max_tokens < 1:
            raise ValueError("--concurrency and --max-tokens must be >= 1")
        if not self.routes or set(self.routes) - set(ROUTES):
            raise ValueError(f"--routes must name some of {ROUTES}, got {self.routes}")
        if self.prompts_per_residue < 1 or self.max_prompt_blocks < 2:
            raise ValueError("--prompts-per-residue must be >= 1, --max-prompt-blocks >= 2")

    @property
    def kv_fault_spec(self) -> str:
        """PDSERVE_KV_FAULTS, seeded by --seed so a run repeats its draws."""
        return f"{self.kv_faults},seed={self.seed}" if self.kv_faults else ""

    def schedule(self) -> list[tuple[float, str]]:
        """(seconds into the load, kind): the first fault half an interval in, then one per
        interval, none in the last half interval (so the last one is seen under load)."""
        times, t = [], self.fault_interval / 2
        while t <= self.duration - self.fault_interval / 2:
            times.append(t)
            t += self.fault_interval
        return [(t, self.kinds[i % len(self.kinds)]) for i, t in enumerate(times)]


# -- the system under test ---------------------------------------------------------------------


class UpProcess:
    """``pdserve up --restart`` in its own session; its output goes to a log file and tells the
    current pid of each component (summary lines, then ``[up] restarted NAME: pid N``)."""

    def __init__(self, config: ChaosConfig, marker: str, log_path: Path):
        self.config = config
        self.marker = marker
        self.log_path = log_path
        self.url = ""
        self.pids: dict[str, int] = {}  # component name -> current pid
        self.restarts: Counter[str] = Counter()
        self.ready_again: list[tuple[float, str]] = []  # (monotonic time, name) after a restart
        self.proc: subprocess.Popen[str] | None = None
        self._tail: deque[str] = deque(maxlen=60)
        self._up = threading.Event()
        self._lock = threading.Lock()

    def command(self) -> list[str]:
        cfg = self.config
        args = ["up", "--restart", "--prefill", "1", "--decode", "1", "--port", "0"]
        args += ["--threads", "1", "--num-blocks", str(cfg.num_blocks), "--transport", "tcp"]
        args += ["--ready-timeout", str(int(cfg.startup_timeout))]
        args += ["--disaggregation", "always"]  # every prompt crosses the faulty KV transfer
        return [sys.executable, "-m", "pdserve.cli", *args]

    def environment(self) -> dict[str, str]:
        """Faster failure detection than the defaults (a dead worker leaves the registry in 2 s),
        the KV faults for the workers, and the marker for the orphan check."""
        env = {
            **os.environ,
            MARKER_ENV: self.marker,
            "PDSERVE_KV_FAULTS": self.config.kv_fault_spec,
        }
        env |= {"PDSERVE_HEARTBEAT_SECONDS": "0.5", "PDSERVE_TTL_SECONDS": "2"}
        env |= {
            "PDSERVE_DRAIN_SECONDS": "10",
            "PDSERVE_LEASE_SECONDS": str(self.config.lease_seconds),
        }
        return env

    def start(self) -> str:
        """Spawn and wait for "pdserve is up: URL"; RuntimeError with the output tail if not."""
        self.proc = subprocess.Popen(
            self.command(),
            cwd=ROOT,
            env=self.environment(),
            stdin=subprocess.DEVNULL,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
            start_new_session=True,  # our Ctrl-C is ours: the soak stops it in order
            preexec_fn=_stop_with_parent if sys.platform == "linux" else None,
        )
        self.pids["up"] = self.proc.pid
        threading.Thread(target=self._pump, daemon=True).start()
        deadline = time.monotonic() + self.config.startup_timeout
        while not self._up.wait(0.2):
            if self.proc.poll() is not None or time.monotonic() > deadline:
                self.stop()
                raise RuntimeError(f"pdserve up did not come up:\n{self.tail()}")
        return self.url

    def _pump(self) -> None:
        assert self.proc is not None and self.proc.stdout is not None
        start = time.monotonic()
        with open(self.log_path, "w") as log:
            for line in self.proc.stdout:
                log.write(f"{time.monotonic() - start:8.2f} {line}")  # when, for reading it later
                log.flush()
                self._parse(line.rstrip("\n"))

    def _parse(self, line: str) -> None:
        with self._lock:
            if match := re.match(r"^\[up\] (\S+) is ready again", line):
                self.ready_again.append((time.monotonic(), match[1]))
            self._tail.append(line)
            if match := re.match(r"^  (\S+) +pid (\d+)", line):  # the summary
                self.pids[match[1]] = int(match[2])
            elif match := re.match(r"^\[up\] restarted (\S+): pid (\d+)", line):
                self.pids[match[1]] = int(match[2])
                self.restarts[match[1]] += 1
            elif match := re.match(r"^pdserve is up: (\S+)", line):
                self.url = match[1]
            elif line.startswith("Ctrl-C stops everything"):
                self._up.set()

    def pid(self, name: str) -> int | None:
        with self._lock:
            return self.pids.get(name)

    def ready_after(self, name: str, since: float) -> float | None:
        """Seconds from ``since`` until ``name`` was reported ready again, if it was."""
        with self._lock:
            times = [t for t, n in self.ready_again if n == name and t >= since]
        return round(min(times) - since, 1) if times else None

    def tail(self, num_lines: int = 40) -> str:
        with self._lock:
            return "\n".join(list(self._tail)[-num_lines:])

    def stop(self, timeout: float = 90.0) -> int | None:
        """SIGTERM (it stops router, workers, Redis in order); SIGKILL if it takes too long."""
        if self.proc is None:
            return None
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        return self.proc.returncode


class WholeRouter:
    """A second router over up's Redis and workers, as up's router but with ``--no-stream-kv``
    and any free port: the same workers then serve both hand-offs at once. Its command and
    environment (the run's token, Redis password and marker) are copied from up's router."""

    def __init__(self, log_path: Path):
        self.log_path = log_path
        self.proc: subprocess.Popen[str] | None = None
        self.url = ""

    def start(self, router_pid: int, timeout: float) -> str:
        """Spawn and wait for its ready line; RuntimeError if it does not come."""
        source = psutil.Process(router_pid)
        args = source.cmdline()
        args[args.index("--port") + 1] = "0"
        self.proc = subprocess.Popen(
            [*args, "--no-stream-kv"],
            cwd=ROOT,
            # Not up's child: drop the launcher's die-with-parent marker (it names up's pid) and
            # the listening socket up hands its router (this one binds its own port).
            env={k: v for k, v in source.environ().items() if k not in (PARENT_PID_ENV, LISTEN_FD)},
            stdin=subprocess.DEVNULL,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
            start_new_session=True,
            preexec_fn=_stop_with_parent if sys.platform == "linux" else None,
        )
        found = threading.Event()
        threading.Thread(target=self._pump, args=(found,), daemon=True).start()
        if not found.wait(timeout):
            self.stop()
            raise RuntimeError(f"the second router did not start (see {self.log_path})")
        return self.url

    def _pump(self, found: threading.Event) -> None:
        assert self.proc is not None and self.proc.stdout is not None
        with open(self.log_path, "w") as log:
            for line in self.proc.stdout:
                log.write(line)
                log.flush()
                if line.startswith(READY_PREFIX) and not found.is_set():
                    self.url = json.loads(line[len(READY_PREFIX) :])["url"]
                    found.set()

    @property
    def pid(self) -> int | None:
        return self.proc.pid if self.proc is not None else None

    def stop(self, timeout: float = 30.0) -> int | None:
        if self.proc is None:
            return None
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        return self.proc.returncode


def _stop_with_parent() -> None:
    """In the child before exec: SIGTERM it (an orderly stop) if the soak itself dies."""
    ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG


def alive(pid: int | None) -> bool:
    """A running (or stopped) process, not a zombie."""
    if pid is None:
        return False
    try:
        return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
    except psutil.Error:
        return False


def rss_mb(pid: int | None) -> float | None:
    try:
        return round(psutil.Process(pid).memory_info().rss / 2**20, 1) if pid else None
    except psutil.Error:
        return None


def processes_with_marker(marker: str) -> list[psutil.Process]:
    """Live processes whose environment carries ``marker`` (zombies excluded)."""
    found = []
    for proc in psutil.process_iter():
        try:
            if proc.environ().get(MARKER_ENV) == marker and proc.status() != psutil.STATUS_ZOMBIE:
                found.append(proc)
        except psutil.Error:
            continue
    return found


def orphans(marker: str, wait: float = 10.0) -> list[dict[str, Any]]:
    """Processes of this run still alive after `pdserve up` exited (then killed: ours)."""
    deadline = time.monotonic() + wait
    while processes_with_marker(marker) and time.monotonic() < deadline:
        time.sleep(0.2)
    found = []
    for proc in processes_with_marker(marker):
        try:
            found.append({"pid": proc.pid, "cmdline": " ".join(proc.cmdline())[:200]})
            proc.kill()
        except psutil.Error:
            continue
    return found


# -- worker metrics ----------------------------------------------------------------------------

SAMPLES = {  # name in the report -> (Prometheus sample, labels it must carry)
    "kv_blocks_used": ("pdserve_kv_blocks", {"state": "used"}),
    "pinned_requests": ("pdserve_pinned_requests", {}),  # prefill: pins waiting to be pulled
    "pulling_requests": ("pdserve_pulling_requests", {}),  # decode: waiting for room or pulling
    "kv_readers": ("pdserve_kv_readers", {}),  # prefill: transfers reading pinned blocks
    "lease_expirations": ("pdserve_lease_expirations_total", {}),
    "kv_drop": ("pdserve_kv_transfer_faults_injected_total", {"kind": "drop"}),
    "kv_corrupt": ("pdserve_kv_transfer_faults_injected_total", {"kind": "corrupt"}),
    "pulls_pulled": ("pdserve_kv_pulls_total", {"outcome": "pulled"}),
    "pulls_recomputed": ("pdserve_kv_pulls_total", {"outcome": "recomputed"}),
}


class WorkerScraper:
    """Reads workers' /metrics by pid. A restarted worker listens on new ports, which `pdserve
    up` does not print, so the port is found among the pid's listening sockets."""

    def __init__(self) -> None:
        self._ports: dict[int, int] = {}
        self.last: dict[int, dict[str, float]] = {}  # pid -> its last scrape (counters survive
        # the process in here: the sum over pids is what all runs of a worker counted)

    def scrape(self, pid: int) -> dict[str, float] | None:
        port = self._ports.get(pid) or self._find_port(pid)
        text = _get(f"http://127.0.0.1:{port}/metrics") if port else None
        if text is None:
            return None
        values: dict[str, float] = {}  # a sample the worker does not export stays out
        for family in text_string_to_metric_families(text):
            for sample in family.samples:
                for key, (name, labels) in SAMPLES.items():
                    if sample.name == name and labels.items() <= sample.labels.items():
                        values[key] = values.get(key, 0.0) + sample.value
        self.last[pid] = values
        return values

    def _find_port(self, pid: int) -> int | None:
        try:
            sockets = psutil.Process(pid).net_connections(kind="tcp")
        except psutil.Error:
            return None
        for conn in sockets:
            if conn.status == psutil.CONN_LISTEN:
                text = _get(f"http://127.0.0.1:{conn.laddr.port}/metrics")
                if text is not None and "pdserve_kv_blocks" in text:
                    self._ports[pid] = conn.laddr.port
                    return conn.laddr.port
        return None

    def total(self, key: str) -> float:
        return sum(values.get(key, 0.0) for values in self.last.values())


def _get(url: str, timeout: float = 2.0) -> str | None:
    """The body of a 200 answer, else None (the gRPC and KV ports refuse HTTP/1.1)."""
    try:
        with urllib.request.urlopen(url, timeout=timeout) as answer:
            return str(answer.read().decode())
    except Exception:  # anything: refused, reset, not HTTP, timeout
        return None
