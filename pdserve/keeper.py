"""`pdserve router-keeper`: a router whose process can be replaced without a lost request, for a
container (docker-compose.yml), where one published port cannot be shared by two containers.

The keeper binds the router's port, starts ``pdserve router`` as its child on that socket
(`pdserve.handover`) and re-prints the child's ready line, so it stands in for ``pdserve router``::

    SIGUSR1 (``docker kill -s USR1 <container>``): start a second router on the same socket ->
            its ready line -> log ``router replaced: pid OLD -> pid NEW`` -> SIGTERM the old one
            (it stops accepting and drains, `router.server`); the new one serves meanwhile
    SIGTERM, SIGINT (``docker stop``): forwarded to the router, which drains; the keeper exits
            with it (a second signal kills it)
    the router exits on its own: the keeper exits with its code, so a restart policy applies

A replacement that dies or is not ready within READY_SECONDS is killed and the old router
keeps serving. Signals reach only the container's PID 1, this process: its handlers are set, so
the kernel delivers them (PID 1 ignores signals it has no handler for). It loads no model and no
torch: a few MiB beside the router.
"""

from __future__ import annotations

import signal
import socket
import subprocess
import sys
import time
from dataclasses import dataclass, field
from types import FrameType

from common.ready import announce_ready
from pdserve.handover import ROUTER_STOP_SECONDS, hand_over, listen
from services.worker.launcher import WorkerProcess

POLL_SECONDS = 0.1
READY_SECONDS = 180.0  # a router starts in seconds (it loads a tokenizer, no weights)
STOP_SIGNALS = (signal.SIGTERM, signal.SIGINT)
ROLL_SIGNAL = signal.SIGUSR1


def _say(message: str) -> None:
    print(f"[keeper] {message}", flush=True)


@dataclass
class Keeper:
    """The current router child, a replacement while one starts, and the old ones draining."""

    sock: socket.socket
    router_args: list[str]
    ready_timeout: float = READY_SECONDS
    router: WorkerProcess | None = None
    draining: list[WorkerProcess] = field(default_factory=list)
    stop_signals: int = 0
    roll_requested: bool = False

    def on_stop(self, signum: int, frame: FrameType | None) -> None:
        self.stop_signals += 1
        if self.stop_signals > 1:  # the second one: no more waiting
            for child in [*self.draining, *([self.router] if self.router else [])]:
                if child.is_alive():
                    child.signal(signal.SIGKILL)

    def on_roll(self, signum: int, frame: FrameType | None) -> None:
        self.roll_requested = True

    def spawn(self) -> WorkerProcess:
        router = WorkerProcess("router", self.router_args, echo_prefix="[router]")
        hand_over(router, self.sock)
        router.spawn()
        return router

    def run(self) -> int:
        """Until the router exits (its code) or a stop signal (the drained router's code)."""
        self.router = self.spawn()
        if not self._until_ready(self.router):
            return self._stop() if self.stop_signals else self._exit_code(self.router)
        announce_ready(self.router.info)  # for launchers that wait for `pdserve router`'s
        _say(f"router pid {self.router.pid} serves; SIGUSR1 replaces it")
        while not self.stop_signals and self.router.is_alive():
            if self.roll_requested:
                self.roll_requested = False
                self.replace()
            self._reap()
            time.sleep(POLL_SECONDS)
        if self.stop_signals:
            return self._stop()
        _say(f"router pid {self.router.pid} exited with code {self.router.exit_code}")
        return self._exit_code(self.router)

    def replace(self) -> None:
        """A new router on the socket; once it is ready the old one drains."""
        assert self.router is not None
        start = time.monotonic()
        new = self.spawn()
        if not self._until_ready(new):
            new.kill()
            _say(f"replacement failed, pid {self.router.pid} keeps serving:\n{new.output_tail(20)}")
            return
        old, self.router = self.router, new
        old.signal(signal.SIGTERM)
        self.draining.append(old)
        took = time.monotonic() - start
        _say(f"router replaced: pid {old.pid} -> pid {new.pid} (ready after {took:.1f} s)")

    def _until_ready(self, router: WorkerProcess) -> bool:
        """Wait for ``router``'s ready line; False if it dies, times out or a stop comes."""
        deadline = time.monotonic() + self.ready_timeout
        while not router.info:
            if self.stop_signals or not router.is_alive() or time.monotonic() > deadline:
                return False
            self._reap()
            time.sleep(POLL_SECONDS)
        return True

    def _reap(self) -> None:
        """Forget the old routers that have drained (their codes collected by poll)."""
        for old in list(self.draining):
            if not old.is_alive():
                self.draining.remove(old)
                _say(f"pid {old.pid} drained and exited with code {old.exit_code}")

    def _stop(self) -> int:
        """SIGTERM every router (they drain in parallel); the current one's exit code."""
        assert self.router is not None
        routers = [*self.draining, self.router]
        _say(f"stopping: router pid(s) {', '.join(str(r.pid) for r in routers)} drain")
        for router in routers:
            if router.is_alive():
                router.signal(signal.SIGTERM)
        for router in routers:
            _wait_or_kill(router, ROUTER_STOP_SECONDS)
        code = self.router.exit_code
        return 0 if code in (0, -signal.SIGTERM) else self._exit_code(self.router)

    @staticmethod
    def _exit_code(router: WorkerProcess) -> int:
        code = router.exit_code
        if code is None:
            router.kill()
            return 1
        return 128 - code if code < 0 else code  # killed by signal N: 128 + N, as a shell says


def _wait_or_kill(router: WorkerProcess, seconds: float) -> None:
    """Wait for a signalled router to exit (a second SIGTERM would cut its drain short)."""
    assert router.proc is not None
    try:
        router.proc.wait(seconds)
    except subprocess.TimeoutExpired:
        router.kill()


def run_keeper(host: str, port: int, router_args: list[str]) -> int:
    """Entry point of ``pdserve router-keeper``: bind, then keep a router on the socket."""
    try:
        sock = listen(host, port)
    except OSError as exc:
        print(f"error: cannot listen on {host}:{port}: {exc.strerror}", file=sys.stderr)
        return 2
    keeper = Keeper(sock, router_args)
    for sig in STOP_SIGNALS:
        signal.signal(sig, keeper.on_stop)
    signal.signal(ROLL_SIGNAL, keeper.on_roll)
    try:
        return keeper.run()
    finally:
        sock.close()
