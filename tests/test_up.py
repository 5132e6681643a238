"""`pdserve up` as a user runs it: real Redis, real workers on the default model, the real router,
the official OpenAI client; then a signal must stop everything and leave nothing behind."""

from __future__ import annotations

import os
import re
import signal
import socket
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

import openai
import pytest
import redis

from pdserve.supervisor import Backoff, Supervisor

CLI = [sys.executable, "-m", "pdserve.cli", "up"]
SMALL = ["--port", "0", "--num-blocks", "128"]
API_KEY = "test-key-123"


@dataclass
class Up:
    """A running `pdserve up` and what it printed."""

    proc: subprocess.Popen[str]
    lines: list[str] = field(default_factory=list)
    summary_done: threading.Event = field(default_factory=threading.Event)
    reader: threading.Thread | None = None

    def pump(self) -> None:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            self.lines.append(line.rstrip("\n"))
            if line.startswith("Ctrl-C stops everything"):
                self.summary_done.set()

    @property
    def output(self) -> str:
        return "\n".join(self.lines)

    def find(self, pattern: str) -> str:
        match = re.search(pattern, self.output, re.MULTILINE)
        assert match, f"{pattern!r} not in the output:\n{self.output}"
        return match.group(1)

    def wait_for(self, pattern: str, timeout: float) -> str:
        """``find`` once the pattern has been printed."""
        deadline = time.monotonic() + timeout
        while not re.search(pattern, self.output, re.MULTILINE) and time.monotonic() < deadline:
            time.sleep(0.1)
        return self.find(pattern)

    @property
    def summary_pids(self) -> dict[str, int]:
        """Component name -> pid, from the summary."""
        found = re.findall(r"^  (\S+) +pid (\d+)", self.output, re.MULTILINE)
        return {name: int(pid) for name, pid in found}


def start_up(*args: str, command: list[str] | None = None) -> Up:
    """Start `pdserve up` (or ``command``) and wait for its summary (the router's /ready
    answered 200)."""
    command = command or [*CLI, *SMALL, *args]
    proc = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    up = Up(proc)
    up.reader = threading.Thread(target=up.pump, daemon=True)
    up.reader.start()
    deadline = time.monotonic() + 180
    while not up.summary_done.wait(0.2):
        if proc.poll() is not None or time.monotonic() > deadline:
            stop(up, signal.SIGTERM)
            pytest.fail(f"{command[3]} did not come up (exit {proc.returncode}):\n{up.output}")
    return up


def stop(up: Up, sig: int) -> int:
    """Signal `pdserve up` and wait for it; kill it if it hangs (its children die with it)."""
    if up.proc.poll() is None:
        up.proc.send_signal(sig)
    try:
        code = up.proc.wait(timeout=90)
    except subprocess.TimeoutExpired:
        up.proc.kill()
        up.proc.wait()
        pytest.fail(f"pdserve up did not stop within 90 s:\n{up.output}")
    assert up.reader is not None
    up.reader.join(timeout=5)  # the last lines
    return code


def is_gone(pid: int) -> bool:
    """No such process (or only a zombie about to be reaped)."""
    try:
        with open(f"/proc/{pid}/stat") as stat:
            return stat.read().rpartition(")")[2].split()[0] == "Z"
    except FileNotFoundError:
        return True


def can_listen(port: int) -> bool:
    with socket.socket() as sock:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # TIME_WAIT is not a listener
        try:
            sock.bind(("127.0.0.1", port))
            sock.listen()
        except OSError:
            return False
    return True


@pytest.mark.timeout(300)
@pytest.mark.parametrize(
    ("sig", "extra"),
    [
        (signal.SIGINT, []),  # 1 prefill + 1 decode, Ctrl-C
        # 1 colocated, behind a key, its components' lines shown
        (signal.SIGTERM, ["--colocated", "--api-key", API_KEY, "--verbose"]),
    ],
    ids=["prefill-decode-sigint", "colocated-sigterm"],
)
def test_up_serves_a_chat_completion_then_stops_cleanly(sig: int, extra: list[str]) -> None:
    up = start_up(*extra)
    try:
        url = up.find(r"^pdserve is up: (http://\S+)")
        model = up.find(r"^pdserve is up: \S+ \(model (.+)\)$")
        pids = {int(pid) for pid in re.findall(r"^  \S+ +pid (\d+)", up.output, re.MULTILINE)}
        roles = ["colocated-0"] if extra else ["prefill-0", "decode-0"]
        assert len(pids) == len(roles) + 2, up.output  # + redis and router
        if extra:  # --verbose: every component's log lines, each with its name
            logs = up.output
        else:  # quiet: they go to the log file the summary names, not to the terminal
            assert not re.search(r"^\[(redis|prefill-0|decode-0|router)\] ", up.output, re.M)
            assert "overcommit" not in up.output and "Redis version" not in up.output
            logs = Path(up.find(r"^Component logs: (\S+)")).read_text()
        for name in ["redis", *roles]:
            assert re.search(rf"^\[{name}\] ", logs, re.MULTILINE), logs
        assert "curl " + url + "/v1/chat/completions" in up.output
        assert_redis_requires_the_password(up, roles)

        key = API_KEY if extra else "unused"
        client = openai.OpenAI(base_url=url + "/v1", api_key=key, max_retries=0, timeout=60)
        reply = client.chat.completions.create(
            model=model,
            messages=[{"role": "user", "content": "What is the capital of France?"}],
            max_tokens=8,
            temperature=0,
        )
        choice = reply.choices[0]
        assert choice.message.content and choice.message.content.strip()
        assert choice.finish_reason in ("stop", "length")
        assert reply.usage is not None and reply.usage.prompt_tokens > 0
        assert 0 < reply.usage.completion_tokens <= 8
        assert reply.usage.total_tokens == reply.usage.prompt_tokens + reply.usage.completion_tokens
        if extra:  # --api-key reached the router
            anonymous = openai.OpenAI(base_url=url + "/v1", api_key="wrong", max_retries=0)
            with pytest.raises(openai.AuthenticationError):
                anonymous.models.list()
    finally:
        code = stop(up, sig)
    assert_stopped_cleanly(up, code, pids, url)


def assert_redis_requires_the_password(up: Up, workers: list[str]) -> None:
    """Redis, at the address the summary prints (without a password), refuses a client with no
    password or a wrong one; the password every component got by environment (never in its
    command line or up's output) opens it, and the registry there holds the workers."""
    address = up.find(r"^  redis +pid \d+ +(redis://\S+)$")
    assert re.fullmatch(r"redis://127\.0\.0\.1:\d+/0", address), address
    with redis.Redis.from_url(address, socket_timeout=5) as anonymous:
        with pytest.raises(redis.AuthenticationError, match="(?i)auth"):
            anonymous.ping()
        with pytest.raises(redis.AuthenticationError):
            anonymous.keys("*")
    with pytest.raises(redis.AuthenticationError):
        redis.Redis.from_url(address, password="wrong", socket_timeout=5).ping()
    passwords = set()
    for name in ["router", *workers]:
        pid = up.summary_pids[name]
        environ = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
        given = [v for v in environ if v.startswith(b"PDSERVE_REDIS_PASSWORD=")]
        assert len(given) == 1, f"{name} got no Redis password by environment"
        password = given[0].partition(b"=")[2].decode()
        cmdline = Path(f"/proc/{pid}/cmdline").read_bytes().decode(errors="replace")
        assert "--redis-password" not in cmdline and password not in cmdline, name
        passwords.add(password)
    assert len(passwords) == 1, "the components got different Redis passwords"
    password = passwords.pop()
    assert len(password) >= 32 and password not in up.output
    redis_cmdline = Path(f"/proc/{up.summary_pids['redis']}/cmdline").read_bytes().decode()
    assert password not in redis_cmdline  # requirepass is in its config file
    with redis.Redis.from_url(address, password=password, socket_timeout=5) as client:
        assert client.ping()
        registered = sorted(client.smembers("pdserve:workers"))  # type: ignore[arg-type]
    assert len(registered) == len(workers), registered


def ask(client: openai.OpenAI, model: str) -> str:
    """One short chat completion; its text."""
    reply = client.chat.completions.create(
        model=model,
        messages=[{"role": "user", "content": "What is the capital of France?"}],
        max_tokens=8,
        temperature=0,
    )
    return reply.choices[0].message.content or ""


def assert_stopped_cleanly(up: Up, code: int, pids: set[int], url: str) -> None:
    assert code == 0, up.output
    assert up.lines[-1] == "[up] stopped", up.output
    deadline = time.monotonic() + 5
    while not all(is_gone(pid) for pid in pids) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert [pid for pid in pids if not is_gone(pid)] == [], up.output
    assert can_listen(int(url.rpartition(":")[2]))


@pytest.mark.timeout(300)
def test_restart_brings_a_killed_decode_worker_back() -> None:
    up = start_up("--restart")
    pids = set(up.summary_pids.values())
    url = up.find(r"^pdserve is up: (http://\S+)")
    try:
        assert "--restart is on" in up.output
        model = up.find(r"^pdserve is up: \S+ \(model (.+)\)$")
        client = openai.OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0, timeout=30)
        assert ask(client, model).strip()

        os.kill(up.summary_pids["decode-0"], signal.SIGKILL)
        up.wait_for(r"^\[up\] (decode-0 exited \(killed by SIGKILL\); restarting)", 10)
        new_pid = int(up.wait_for(r"^\[up\] restarted decode-0: pid (\d+)", 10))
        pids.add(new_pid)
        assert new_pid not in up.summary_pids.values()
        # 503s until the new decode worker has loaded and registered (the dead one may stay
        # in the registry for its TTL, but it is the only decode worker: nothing to retry on).
        deadline = time.monotonic() + 60
        while True:
            try:
                assert ask(client, model).strip()
                break
            except (openai.APIStatusError, openai.APIConnectionError):
                assert time.monotonic() < deadline, f"no answer after the restart:\n{up.output}"
                time.sleep(0.5)
        assert "[up] decode-0 is ready again" in up.output
        assert up.proc.poll() is None  # the rest of the system never stopped
    finally:
        code = stop(up, signal.SIGINT)
    assert_stopped_cleanly(up, code, pids, url)


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--prefill", "0"], "error: --prefill must be >= 1"),
        (["--colocated", "2", "--decode", "1"], "error: --colocated replaces --prefill/--decode"),
    ],
)
def test_bad_flags_are_a_message_not_a_traceback(args: list[str], message: str) -> None:
    proc = subprocess.run([*CLI, *args], capture_output=True, text=True, timeout=60)
    assert proc.returncode == 2
    assert message in proc.stderr
    assert "Traceback" not in proc.stderr
    assert "[up]" not in proc.stdout  # nothing was started


def test_an_unknown_model_is_one_message_naming_what_is_accepted(tmp_path) -> None:  # type: ignore[no-untyped-def]
    args = [*SMALL, "--model", str(tmp_path / "no-such-model"), "--log-file", str(tmp_path / "log")]
    proc = subprocess.run([*CLI, *args], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 1
    everything = proc.stdout + proc.stderr
    assert everything.count("does not exist: give --model a Hugging Face model directory") == 1
    assert "Traceback" not in proc.stderr


class FakeUnit:
    """A component for the supervisor: alive or not, ready or not, respawns counted."""

    def __init__(self, name: str = "decode-0"):
        self.name = name
        self.alive = True
        self.ready = True
        self.pid = 100

    def is_alive(self) -> bool:
        return self.alive

    def is_ready(self) -> bool:
        return self.ready

    def exit_reason(self) -> str:
        return "killed by SIGKILL"

    def respawn(self) -> int:
        self.alive, self.ready, self.pid = True, False, self.pid + 1
        return self.pid

    def kill(self) -> None:
        self.alive = False


def test_backoff_doubles_up_to_a_cap_and_resets_once_stable() -> None:
    backoff = Backoff()
    assert [backoff.next_delay(0) for _ in range(7)] == [1, 2, 4, 8, 16, 30, 30]
    assert backoff.next_delay(59) == 30  # up less than a minute: still crashing
    assert backoff.next_delay(60) == 1  # up a minute: a new incident


def test_supervisor_restarts_after_the_backoff_without_waiting_for_ready() -> None:
    now = [0.0]
    said: list[str] = []
    unit = FakeUnit()
    supervisor = Supervisor([unit], said.append, ready_timeout=20, clock=lambda: now[0])
    supervisor.poll()
    assert said == []

    unit.alive = False
    supervisor.poll()
    assert said == ["decode-0 exited (killed by SIGKILL); restarting in 1 s (restart 1)"]
    now[0] = 0.5
    supervisor.poll()  # still backing off
    assert unit.pid == 100
    now[0] = 1.0
    supervisor.poll()
    assert said[-1] == "restarted decode-0: pid 101"
    now[0] = 1.5
    supervisor.poll()  # not ready yet: nothing to say, nothing blocks
    assert len(said) == 2
    unit.ready = True
    supervisor.poll()
    assert said[-1] == "decode-0 is ready again"

    unit.alive = False  # crashes again within a minute of being ready: a longer wait
    supervisor.poll()
    assert said[-1] == "decode-0 exited (killed by SIGKILL); restarting in 2 s (restart 2)"
    assert supervisor.restarts("decode-0") == 2


def test_supervisor_kills_a_restarted_unit_that_never_gets_ready() -> None:
    now = [0.0]
    said: list[str] = []
    unit = FakeUnit()
    supervisor = Supervisor([unit], said.append, ready_timeout=20, clock=lambda: now[0])
    unit.alive = False
    supervisor.poll()
    now[0] = 1.0
    supervisor.poll()  # respawned, not ready
    now[0] = 21.5
    supervisor.poll()
    assert "printed no ready line within 20 s" in said[-1]
    assert not unit.alive
    supervisor.poll()
    assert said[-1] == "decode-0 exited (killed by SIGKILL); restarting in 2 s (restart 2)"
