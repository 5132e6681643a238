"""`pdserve up`: the whole system on one machine, the embedded default that `make up` runs.

Starts a real Redis, N prefill + M decode workers (or K colocated ones) on 127.0.0.1 and the
OpenAI-compatible router (on 127.0.0.1 too, unless ``--host``), waits until the router's
``/ready`` answers 200, prints the URL and a curl example, then watches::

    start: redis -> workers and router (spawned together, so model loads overlap)
           -> every ready line -> router /ready == 200 -> summary
    stop (Ctrl-C, SIGTERM, SIGHUP, or a component died):
           router (SIGTERM) -> workers (SIGTERM, all at once: they deregister and drain) -> redis

Each component's output is echoed with a prefix (``[redis]``, ``[prefill-0]``, ``[decode-0]``,
``[router]``). Children run in their own sessions, so a terminal's Ctrl-C reaches this process
alone and the stop order holds; if this process is killed they die with it (PR_SET_PDEATHSIG).
A second signal during the stop kills what is left at once.

Without ``--restart`` a component that dies stops everything (exit 1). With ``--restart``, once
the system is up, a worker, the router or Redis that exits (other than by our own stop) is
reported and started again with the same arguments, after a backoff that grows while it keeps
crashing (`pdserve.supervisor`); the router comes back on the same port, so the printed URL stays
valid. A death during the start is still fatal: it is almost always a configuration error, and
restarting would only repeat it until ``--ready-timeout``.

Rolling restart (SIGUSR1 to this process: ``kill -USR1 <pid>``, the pid is in the summary):
every component is replaced, one at a time, without a failed request::

    router:  start a second router on the same listening socket -> its ready line -> SIGTERM
             the old one (it stops accepting, answers what its connections still send with
             ``Connection: close``, exits; see `router.server`)
    worker:  start a second worker with the same arguments -> its ready line (it is registered)
             -> the router lists it -> SIGTERM the old one (marked draining, it refuses new
             calls, which the router retries on the new one, finishes those in flight, waits
             for the KV blocks it handed out to be pulled, then deregisters; `services.server`)

The router's port is bound here, once, and handed to every router this process starts (an
inherited descriptor, ``PDSERVE_LISTEN_FD``): connections wait in the one accept queue while
routers come and go, and a restarted router (--restart) can never find its port taken. A
replacement that dies or is not ready within --ready-timeout is killed and ends the rolling
restart; the component it was to replace keeps serving. While a replacement starts, its pool
has one member more (its memory and threads too).

Redis is restarted too, on the same port: it holds only soft state. The registry is rewritten by
the workers' heartbeats, which re-register by themselves once Redis answers again (within their
2 s backoff), and the router keeps its last view of the workers meanwhile (`services.registry`);
persisting Redis's data would only bring back stale records. Failing to restart it (its port
taken meanwhile) is fatal.
"""

from __future__ import annotations

import json
import os
import secrets
import signal
import socket
import sys
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Callable
from pathlib import Path
from types import FrameType
from typing import Any, TextIO

from pdserve.handover import ROUTER_STOP_SECONDS, hand_over, listen
from pdserve.supervisor import Restartable, Supervisor
from pdserve.up_components import Component, LineWriter, LogTail, RedisUnit, UpError
from pdserve.up_config import UpConfig, default_log_path
from services.redis_server import RedisServer, RedisServerError

WORKER_STOP_SECONDS = 40.0  # the workers' default drain (30 s) plus their own shutdown
POLL_SECONDS = 0.2
STOP_SIGNALS = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)
ROLL_SIGNAL = signal.SIGUSR1  # replace every component, one at a time


class _ForceStop(BaseException):
    """A second signal arrived while stopping: kill instead of waiting."""


def _exit_text(code: int | None) -> str:
    """'exited with code 1' or 'was killed by SIGKILL'."""
    if code is not None and code < 0:
        return f"was killed by {signal.Signals(-code).name}"
    return f"exited with code {code}"


def _listen(host: str, port: int) -> socket.socket:
    """The router's listening socket, bound here at once (before any model loads) and handed
    to every router started (`pdserve.handover`)."""
    try:
        return listen(host, port)
    except OSError as exc:
        raise UpError(
            f"cannot listen on {host} port {port} ({exc.strerror}): use --host, --port (0: any)"
        ) from exc


def _say(message: str) -> None:
    print(f"[up] {message}", flush=True)


class UpSystem:
    """Redis, the workers and the router, started and stopped in order."""

    def __init__(self, config: UpConfig):
        self.config = config
        # One token and one Redis password per run, handed to every component by environment.
        self.secrets: dict[str, str] = {}
        if not config.insecure:
            self.secrets = {
                "PDSERVE_CLUSTER_TOKEN": secrets.token_hex(32),
                "PDSERVE_REDIS_PASSWORD": secrets.token_hex(32),
            }
        self.redis = RedisServer(password=self.secrets.get("PDSERVE_REDIS_PASSWORD"))
        self.redis_pid: int | None = None  # the first server's (redis.pid is None once it died)
        self.workers: list[Component] = []
        self.router: Component | None = None
        self.listener: socket.socket | None = None  # the router's port, bound here
        # Outside those lists during a rolling restart: a replacement starting, an old one
        # draining (stopped with the others should a stop signal come meanwhile).
        self.extra: list[Component] = []
        self._supervisor: Supervisor | None = None  # with --restart, once up
        self._reported: set[str] = set()  # dead workers reported (without --restart)
        self._roll_requested = threading.Event()
        self._redis_log: LogTail | None = None
        self.log_path = Path(config.log_file or default_log_path(config.engine.cache_path))
        self.log: TextIO | None = None  # the components' lines (None: stdout, --verbose)
        self._stop_requested = threading.Event()
        self._stopping = False
        self._killing = False
        self._last_ready_answer = ""
        self._signal_name = ""  # the first stop signal's

    @property
    def components(self) -> list[Component]:
        return self.workers + ([self.router] if self.router is not None else [])

    @property
    def url(self) -> str:
        assert self.router is not None
        return str(self.router.info["url"])

    # -- signals -------------------------------------------------------------------------------

    def on_signal(self, signum: int, frame: FrameType | None) -> None:
        """First signal: stop in order. Second one, while stopping: kill what is left.

        Prints nothing: the main thread may be inside a write (stdout is not reentrant)."""
        if self._stopping and not self._killing:
            self._killing = True
            raise _ForceStop
        self._signal_name = self._signal_name or signal.Signals(signum).name
        self._stop_requested.set()

    def on_roll_signal(self, signum: int, frame: FrameType | None) -> None:
        """SIGUSR1: a rolling restart, started by the watch loop (a second one waits for it)."""
        self._roll_requested.set()

    # -- start ---------------------------------------------------------------------------------

    def start(self) -> bool:
        """Start everything and wait for the router's /ready; False if a stop signal came first.

        Raises UpError when a component dies or the whole start takes over ``ready_timeout``."""
        deadline = time.monotonic() + self.config.ready_timeout
        # before the model loads, not after
        self.listener = _listen(self.config.host, self.config.port)
        if not self.config.verbose:
            self.log_path.parent.mkdir(parents=True, exist_ok=True)
            self.log = open(self.log_path, "a", buffering=1)  # noqa: SIM115 (closed in stop)
            _say(f"component logs: {self.log_path} (--verbose to see them here)")
        self._start_redis()
        cfg = self.config
        _say(
            f"starting {', '.join(name for _, name in cfg.workers)} "
            f"(--threads {cfg.threads_per_worker} --kv-transport {cfg.transport} each) "
            "and the router"
        )
        insecure = ["--insecure"] if cfg.insecure else []
        worker_args = cfg.worker_args(self.redis.address) + insecure
        env = dict(self.secrets)
        self.workers = [
            Component(name, role, worker_args + cfg.role_args(role), env, self.log)
            for role, name in cfg.workers
        ]
        if cfg.router.api_key:
            env["PDSERVE_API_KEY"] = cfg.router.api_key
        port = self.listener.getsockname()[1]  # --port 0: the one picked
        router_args = cfg.router_args(self.redis.address, port) + insecure
        self.router = Component("router", "router", router_args, env, self.log)
        hand_over(self.router, self.listener)
        for component in self.components:
            if self._stop_requested.is_set():
                return False
            try:
                component.spawn()
            except OSError as exc:
                raise UpError(f"could not start {component.name}: {exc}") from exc
        started = self._wait(
            lambda: all(c.info for c in self.components), "the ready lines", deadline
        )
        return started and self._wait(self._router_ready, "the router's /ready", deadline)

    def _start_redis(self) -> None:
        try:
            self.redis.start()
        except RedisServerError as exc:
            raise UpError(str(exc)) from exc
        self.redis_pid = self.redis.pid
        assert self.redis.log_path is not None
        self._redis_log = LogTail(self.redis.log_path, "[redis]", self.log)
        _say(f"redis-server pid {self.redis_pid} on {self.redis.address}")

    def _router_ready(self) -> bool:
        try:
            with urllib.request.urlopen(self.url + "/ready", timeout=2) as answer:
                return bool(answer.status == 200)
        except urllib.error.HTTPError as exc:  # 503 until the workers are registered
            self._last_ready_answer = f"{exc.code} {exc.read()[:500]!r}"
        except (urllib.error.URLError, OSError) as exc:
            self._last_ready_answer = str(exc)
        return False

    def _wait(self, done: Callable[[], bool], what: str, deadline: float | None) -> bool:
        """Poll ``done`` until it holds (True) or a stop signal comes (False).

        Raises UpError when a component dies, or at ``deadline``."""
        while not self._stop_requested.is_set():
            self._check_alive()
            if done():
                return True
            if deadline is not None and time.monotonic() > deadline:
                raise self._timeout(what)
            self._stop_requested.wait(POLL_SECONDS)
        return False

    def _check_alive(self) -> None:
        if not self.redis.is_running:
            raise UpError(
                f"redis-server (pid {self.redis_pid}) exited; its log:\n{self.redis.log_tail()}"
            )
        for c in self.components:
            if not c.is_alive():
                time.sleep(0.3)  # let the echo thread read the last lines
                code = c.proc.returncode if c.proc is not None else None
                raise UpError(
                    f"{c.name} (pid {c.pid}) {_exit_text(code)}; its last output:\n"
                    f"{c.output_tail()}"
                )

    def _check_pools(self, reported: set[str]) -> None:
        """Report each worker death once; UpError when Redis, the router or a pool is gone."""
        if not self.redis.is_running or (self.router is not None and not self.router.is_alive()):
            self._check_alive()  # raises, with the dead component's last output
        for worker in self.workers:
            if worker.is_alive() or worker.name in reported:
                continue
            reported.add(worker.name)
            time.sleep(0.3)  # let the echo thread read its last lines
            pool = [w for w in self.workers if w.role == worker.role and w.is_alive()]
            _say(
                f"WARNING: {worker.name} (pid {worker.pid}) {_exit_text(worker.exit_code)}; "
                f"{len(pool)} {worker.role} worker(s) left serving (--restart would restart it). "
                f"Its last output:\n{worker.output_tail(20)}"
            )
            if not pool:
                raise UpError(
                    f"no {worker.role} worker is left: {worker.name} "
                    f"{_exit_text(worker.exit_code)}, and the rest of its pool before it"
                )

    def _timeout(self, what: str) -> UpError:
        timeout = self.config.ready_timeout
        lines = [f"not up after {timeout:g}s (--ready-timeout): still waiting for {what}"]
        for c in self.components:
            if not c.info:
                tail = c.output_tail(20) or "(none)"
                lines.append(f"{c.name} has not printed its ready line; its last output:\n{tail}")
        if self._last_ready_answer:
            lines.append(f"the router's last /ready answer: {self._last_ready_answer}")
        return UpError("\n".join(lines))

    # -- running -------------------------------------------------------------------------------

    def summary(self) -> str:
        """What runs where, and a request to try."""
        from services.engine.model.source import model_name

        assert self.router is not None  # the router's ready line names the served model
        name = str(self.router.info.get("model") or model_name(self.config.engine.model))
        body = {"model": name, "messages": [{"role": "user", "content": "Hello!"}]}
        auth = " -H 'Authorization: Bearer <your --api-key>'" if self.config.router.api_key else ""
        lines = [
            f"pdserve is up: {self.url} (model {name})",
            f"  {'redis':<12} pid {self.redis_pid!s:<8} {self.redis.address}",
            *(c.describe() for c in self.components),
            "",
            f"  curl {self.url}/v1/chat/completions -H 'Content-Type: application/json'{auth} \\",
            f"    -d '{json.dumps({**body, 'max_tokens': 32, 'temperature': 0})}'",
            "",
            *(
                ["--restart is on: a component that exits is reported and started again."]
                if self.config.restart
                else []
            ),
            f"Rolling restart (one component at a time, no request lost): kill -USR1 {os.getpid()}",
            *([] if self.log is None else [f"Component logs: {self.log_path} (--verbose: here)"]),
            "Ctrl-C stops everything.",
        ]
        return "\n".join(lines)

    def watch(self) -> None:
        """Return when a stop signal comes. A component that dies: with --restart it is started
        again (UpError only if Redis cannot be). Without, a dead worker is reported and the rest
        keeps serving while its pool has live members; UpError when Redis, the router or a
        whole pool is gone. SIGUSR1: a rolling restart (``roll``)."""
        if self.config.restart:
            units: list[Restartable] = [RedisUnit(self.redis), *self.components]
            self._supervisor = Supervisor(units, _say, self.config.ready_timeout)
        while not self._stop_requested.is_set():
            self._tick()
            if self._roll_requested.is_set():
                self._roll_requested.clear()
                self.roll()
            self._stop_requested.wait(POLL_SECONDS)

    def _tick(self) -> None:
        """One look at the components; on the main thread (see Supervisor)."""
        if self._supervisor is not None:
            self._supervisor.poll()
        else:
            self._check_pools(self._reported)

    # -- rolling restart -----------------------------------------------------------------------

    def roll(self) -> None:
        """Replace the router, then each worker, one at a time (the module docstring). Ends at
        the first replacement that fails; the component it was to replace keeps serving."""
        order = [c for c in self.components if c.role == "router"] + self.workers
        _say(f"rolling restart: {', '.join(c.name for c in order)}, one at a time")
        start = time.monotonic()
        for old in order:
            if self._stop_requested.is_set():
                return
            if not old.is_alive():
                _say(f"rolling restart: {old.name} is not running, left to --restart")
                continue
            try:
                self._replace(old)
            except UpError as exc:
                _say(f"rolling restart stopped: {exc}")
                return
        _say(f"rolling restart done in {time.monotonic() - start:.1f} s")

    def _replace(self, old: Component) -> None:
        """Start ``old``'s twin, wait until it serves, then stop ``old`` (it drains)."""
        start = time.monotonic()
        new = old.twin()
        self.extra.append(new)
        try:
            new.spawn()
            self._until(lambda: bool(new.info), new, "its ready line")
            if new.role != "router":
                worker_id = str(new.info["worker_id"])
                self._until(lambda: self._router_lists(worker_id), new, "the router to list it")
        except (UpError, OSError) as exc:
            new.kill()
            self.extra.remove(new)
            raise UpError(f"the replacement of {old.name} failed: {exc}") from exc
        self.extra.remove(new)
        self._swap(old, new)
        ready = time.monotonic() - start
        _say(f"{new.name}: pid {new.pid} ready after {ready:.1f} s; pid {old.pid} drains")
        self._retire(old)
        total = time.monotonic() - start
        _say(f"replaced {new.name} in {total:.1f} s (the old one drained in {total - ready:.1f} s)")
        print(new.describe(), flush=True)

    def _retire(self, old: Component) -> None:
        """SIGTERM ``old`` and wait while it drains (watching the rest); killed if it takes
        longer than a stop may. Left to ``stop`` should a stop signal come meanwhile."""
        self.extra.append(old)
        old.signal(signal.SIGTERM)
        seconds = ROUTER_STOP_SECONDS if old.role == "router" else WORKER_STOP_SECONDS
        deadline = time.monotonic() + seconds
        while old.is_alive() and not self._stop_requested.is_set():
            if time.monotonic() > deadline:
                old.kill()
                break
            self._tick()
            self._stop_requested.wait(POLL_SECONDS)
        if not old.is_alive():
            self.extra.remove(old)
            self._report(old, old.exit_code)

    def _until(self, done: Callable[[], bool], new: Component, what: str) -> None:
        """Wait for ``done`` while watching the rest; UpError if ``new`` dies or at the
        deadline, or a stop signal comes."""
        deadline = time.monotonic() + self.config.ready_timeout
        while not done():
            if self._stop_requested.is_set():
                raise UpError("a stop signal came")
            if not new.is_alive():
                time.sleep(0.3)  # let the echo thread read the last lines
                raise UpError(f"it {_exit_text(new.exit_code)}; its output:\n{new.output_tail(20)}")
            if time.monotonic() > deadline:
                raise UpError(f"not ready after {self.config.ready_timeout:g} s: waited for {what}")
            self._tick()
            self._stop_requested.wait(POLL_SECONDS)

    def _router_lists(self, worker_id: str) -> bool:
        """Whether the router's view holds ``worker_id``, healthy (/v1/workers)."""
        request = urllib.request.Request(self.url + "/v1/workers")
        router = self.config.router
        token = self.secrets.get("PDSERVE_CLUSTER_TOKEN") if router.ops_need_token else None
        if token or router.api_key:
            request.add_header("Authorization", f"Bearer {token or router.api_key}")
        try:
            with urllib.request.urlopen(request, timeout=2) as answer:
                rows = json.load(answer)["data"]
        except urllib.error.HTTPError as exc:
            if exc.code != 401:
                return False
            # Keys only in --api-keys-file: it is registered, the router sees it within a
            # refresh period or two.
            time.sleep(2 * router.refresh_seconds + 0.5)
            return True
        except (urllib.error.URLError, OSError, ValueError, KeyError):
            return False
        return any(row.get("id") == worker_id and row.get("healthy") for row in rows)

    def _swap(self, old: Component, new: Component) -> None:
        """``new`` takes ``old``'s place: in the lists, and under the supervisor."""
        if old is self.router:
            self.router = new
        else:
            self.workers[self.workers.index(old)] = new
        if self._supervisor is not None:
            self._supervisor.replace(old, new)

    # -- stop ----------------------------------------------------------------------------------

    def stop(self) -> None:
        """Router, then workers (SIGTERM: they drain in parallel), then Redis; a second signal
        kills what is left. Leaves no process behind."""
        self._stopping = True
        if self._signal_name:
            _say(f"{self._signal_name}: stopping (again to kill at once)")
        try:
            self._stop_in_order()
        except _ForceStop:
            _say("killing what is left")
            for c in [*self.extra, *self.components]:
                c.kill()
            self.redis.stop()
        finally:
            self._killing = True  # from here on a signal only sets the (already set) flag
            if self._redis_log is not None:
                self._redis_log.stop()
            if self.log is not None:
                self.log.close()
        _say("stopped")

    def _stop_in_order(self) -> None:
        routers = [c for c in [*self.extra, *self.components] if c.role == "router"]
        for router in routers:
            if router.is_alive():  # not: dead, awaiting a restart
                _say("stopping the router")
                self._report(router, router.terminate(ROUTER_STOP_SECONDS))
        if self.listener is not None:
            self.listener.close()
        running = [w for w in [*self.extra, *self.workers] if w.is_alive()]
        if running:
            _say(f"stopping {len(running)} worker(s): they deregister and drain")
            for w in running:
                w.signal(signal.SIGTERM)
            for w in running:
                self._report(w, w.terminate(WORKER_STOP_SECONDS))
        if self.redis.is_running:
            _say("stopping redis")
        self.redis.stop()

    @staticmethod
    def _report(component: Component, code: int | None) -> None:
        if code == -signal.SIGKILL:
            _say(f"warning: {component.name} did not stop in time and was killed")
        elif code not in (0, None, -signal.SIGTERM):
            _say(f"warning: {component.name} {_exit_text(code)}")


def run_up(config: UpConfig) -> int:
    """Run the system until a signal (exit 0) or a component failure (exit 1, with a message).

    Must run on the main thread: it owns the signal handlers, and the children's parent-death
    signal is tied to the thread that spawned them."""
    system = UpSystem(config)
    previous: dict[int, Any] = {s: signal.signal(s, system.on_signal) for s in STOP_SIGNALS}
    previous[ROLL_SIGNAL] = signal.signal(ROLL_SIGNAL, system.on_roll_signal)
    stdout, sys.stdout = sys.stdout, LineWriter(sys.stdout)
    try:
        if system.start():
            print(system.summary(), flush=True)
            system.watch()
        return 0
    except UpError as exc:
        print(f"error: {exc}", file=sys.stderr, flush=True)
        return 1
    finally:
        system.stop()
        sys.stdout = stdout
        for sig, handler in previous.items():
            signal.signal(sig, handler)
