"""Start a worker as a child process and wait until it is ready (for `pdserve up` and tests).

The child prints ``PDSERVE_READY {json}`` once it listens; its other output is kept (the last
lines, for error messages) and optionally echoed with a prefix. The child dies with its parent
(PR_SET_PDEATHSIG on Linux), so a crashed launcher leaves no orphan behind: the child sets it
itself, first thing (``die_with_parent_if_asked``), because setting it between fork and exec (a
``preexec_fn``) makes Python fork() instead of vfork(), and gRPC's fork handlers then restart
its pollers in the child, which sometimes died there ("epoll_wait error: Bad file descriptor").
"""

from __future__ import annotations

import collections
import ctypes
import json
import os
import signal
import subprocess
import sys
import threading
import time
from typing import Any, TextIO

from common.ready import READY_PREFIX

PARENT_PID_ENV = "PDSERVE_DIE_WITH_PARENT"  # set for the child: its launcher's pid


def die_with_parent_if_asked() -> None:
    """In a child this module started: be killed when the launcher's thread exits, and exit
    now if the launcher is gone already (it may have died before this ran)."""
    parent = os.environ.pop(PARENT_PID_ENV, "")
    if not parent:
        return
    try:
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
    except OSError:
        return
    if os.getppid() != int(parent):
        os._exit(1)


class WorkerProcess:
    """``pdserve <role> <args>`` in a child process."""

    def __init__(
        self,
        role: str,
        args: list[str],
        env: dict[str, str] | None = None,
        echo_prefix: str | None = None,
        new_session: bool = False,
        cpus: set[int] | None = None,
        python_args: list[str] | None = None,
        echo_to: TextIO | None = None,
    ):
        self.role = role
        self.new_session = new_session  # a terminal's Ctrl-C then reaches only the launcher
        self.cpus = cpus  # CPU affinity of the child (and so of every thread it starts)
        self.python_args = python_args or ["-m", "pdserve.cli"]  # what runs `<role> <args>`
        self.args = args
        self.env = {**os.environ, **(env or {})}
        self.echo_prefix = echo_prefix
        self.echo_to = echo_to  # where echoed lines go (None: stdout)
        self.pass_fds: tuple[int, ...] = ()  # descriptors the child inherits (a listening socket)
        self.info: dict[str, Any] = {}
        self.proc: subprocess.Popen[str] | None = None
        self._lines: collections.deque[str] = collections.deque(maxlen=200)
        self._ready = threading.Event()

    def start(self, timeout: float = 180.0) -> dict[str, Any]:
        """Spawn and wait for the ready line; raises RuntimeError with the output tail."""
        self.spawn()
        return self.wait_ready(timeout)

    def spawn(self) -> None:
        """Start the child without waiting (start several, then ``wait_ready`` each).

        Call it from the thread that lives as long as the child should: Linux delivers the
        parent-death signal when the spawning *thread* exits. Spawning again (a restart) waits
        for the new run's ready line.
        """
        self.info = {}
        self._ready.clear()
        self.proc = subprocess.Popen(
            [sys.executable, *self.python_args, self.role, *self.args],
            stdin=subprocess.DEVNULL,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
            env={**self.env, PARENT_PID_ENV: str(os.getpid())},
            start_new_session=self.new_session,
            pass_fds=self.pass_fds,
        )
        if self.cpus is not None:  # before the child starts its threads (they inherit it)
            os.sched_setaffinity(self.proc.pid, self.cpus)
        threading.Thread(target=self._pump, daemon=True).start()

    def wait_ready(self, timeout: float = 180.0) -> dict[str, Any]:
        assert self.proc is not None, "spawn() first"
        deadline = time.monotonic() + timeout
        while not self._ready.wait(0.1):
            if self.proc.poll() is not None or time.monotonic() > deadline:
                self.kill()
                raise RuntimeError(f"{self.role} worker did not start:\n{self.output_tail()}")
        return self.info

    def _pump(self) -> None:
        assert self.proc is not None and self.proc.stdout is not None
        for line in self.proc.stdout:
            line = line.rstrip("\n")
            self._lines.append(line)
            if line.startswith(READY_PREFIX):
                self.info = json.loads(line[len(READY_PREFIX) :])
                self._ready.set()
            elif self.echo_prefix is not None:
                print(f"{self.echo_prefix} {line}", file=self.echo_to, flush=True)

    def output_tail(self, num_lines: int = 40) -> str:
        return "\n".join(list(self._lines)[-num_lines:])

    @property
    def pid(self) -> int:
        assert self.proc is not None
        return self.proc.pid

    def is_alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    @property
    def exit_code(self) -> int | None:
        """The child's exit code (negative: the signal that killed it); None while it runs."""
        return self.proc.poll() if self.proc is not None else None

    def terminate(self, timeout: float = 30.0) -> int | None:
        """SIGTERM (drain), then SIGKILL after ``timeout``; returns the exit code."""
        if self.proc is None:
            return None
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        return self.proc.returncode

    def kill(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()

    def signal(self, sig: int) -> None:
        assert self.proc is not None
        self.proc.send_signal(sig)
