"""The processes `pdserve up` runs, as it and its supervisor see them: a worker or router child
(`Component`), the Redis server (`RedisUnit`), and the echo of their output (`LineWriter`,
`LogTail`)."""

from __future__ import annotations

import io
import signal
import threading
import time
from pathlib import Path
from typing import TextIO

from services.redis_server import RedisServer, RedisServerError
from services.worker.launcher import WorkerProcess


class UpError(RuntimeError):
    """A component could not start or died; the message says which and shows its last output."""


def exit_reason(code: int | None) -> str:
    """'killed by SIGKILL', 'exit code 1', or '' when unknown."""
    if code is None:
        return ""
    return f"killed by {signal.Signals(-code).name}" if code < 0 else f"exit code {code}"


class LineWriter(io.TextIOBase):
    """stdout shared by threads: whole lines only, and a closed reader is not an error.

    ``print`` writes the text and the newline separately, so two echo threads could mix their
    lines; this keeps each thread's partial line until its newline and writes whole lines under
    a lock. If the reader goes away (``pdserve up | head``) output is dropped, so the echo
    threads keep draining the children's pipes and the children never block on a full pipe."""

    def __init__(self, stream: TextIO):
        self.stream = stream
        self._lock = threading.Lock()
        self._local = threading.local()
        self._broken = False

    def write(self, text: str) -> int:
        pending = getattr(self._local, "pending", "") + text
        lines, newline, self._local.pending = pending.rpartition("\n")
        if newline:
            with self._lock:
                if not self._broken:
                    try:
                        self.stream.write(lines + newline)
                        self.stream.flush()
                    except (BrokenPipeError, ValueError):  # reader gone, or stream closed
                        self._broken = True
        return len(text)

    def flush(self) -> None:
        pass  # write() flushes every whole line


class Component(WorkerProcess):
    """A `pdserve <role>` child in its own session, its output echoed as ``[name] line`` to
    ``log`` (the log file, or stdout with --verbose)."""

    def __init__(
        self,
        name: str,
        role: str,
        args: list[str],
        env: dict[str, str] | None = None,
        log: TextIO | None = None,
    ):
        # A session of its own: the terminal's Ctrl-C is ours to handle, so the stop order holds.
        super().__init__(
            role, args, env=env, echo_prefix=f"[{name}]", new_session=True, echo_to=log
        )
        self.name = name

    def is_ready(self) -> bool:
        return bool(self.info)

    def exit_reason(self) -> str:
        return exit_reason(self.proc.returncode if self.proc is not None else None)

    def twin(self) -> Component:
        """A second process of this component, same command and environment, not started."""
        twin = Component(self.name, self.role, self.args, log=self.echo_to)
        twin.env, twin.pass_fds = self.env, self.pass_fds
        return twin

    def respawn(self) -> int:
        """The same command again (call it from the main thread); its ready line comes later."""
        try:
            self.spawn()
        except OSError as exc:
            raise UpError(f"could not restart {self.name}: {exc}") from exc
        return self.pid

    def describe(self) -> str:
        """One summary line: name, pid and where it listens."""
        info = self.info
        where = [info.get("url", "")]
        if "grpc_address" in info:
            where = [f"grpc {info['grpc_address']}"]
            where += [f"kv {info['kv_address']}"] if info.get("kv_address") else []
            where += [f"metrics :{info['metrics_port']}"] if info.get("metrics_port") else []
        return f"  {self.name:<12} pid {self.pid:<8} {'  '.join(where)}"


class RedisUnit:
    """The Redis server as the supervisor sees it: restarted on the same port (the workers'
    --redis-url) with empty data, in the same folder (its log keeps being echoed)."""

    name = "redis"

    def __init__(self, redis: RedisServer):
        self.redis = redis

    def is_alive(self) -> bool:
        return self.redis.is_running

    def is_ready(self) -> bool:
        return self.redis.is_running  # respawn() returns once it answers

    def exit_reason(self) -> str:
        return ""  # RedisServer keeps the code to itself; its log is echoed as [redis]

    def respawn(self) -> int:
        try:
            self.redis.restart()  # blocks until it answers: milliseconds
        except RedisServerError as exc:
            raise UpError(f"could not restart redis-server: {exc}") from exc
        assert self.redis.pid is not None
        return self.redis.pid

    def kill(self) -> None:
        pass  # never called: it is ready as soon as respawn() returns


class LogTail:
    """Echo the lines appended to a file with a prefix (Redis logs to a file) to ``out``."""

    def __init__(self, path: Path, prefix: str, out: TextIO | None = None):
        self.path = path
        self.prefix = prefix
        self.out = out
        self._done = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def stop(self) -> None:
        """Echo what is left, then stop."""
        self._done.set()
        self._thread.join(timeout=2)

    def _run(self) -> None:
        partial = ""
        with open(self.path, errors="replace") as file:
            while True:
                chunk = file.readline()
                if chunk:
                    partial += chunk
                    if partial.endswith("\n"):
                        print(f"{self.prefix} {partial.rstrip()}", file=self.out, flush=True)
                        partial = ""
                elif self._done.is_set():
                    return
                else:
                    time.sleep(0.1)
