"""`pdserve up` as a user runs it: real Redis, real workers on the default model, the real router,
the official OpenAI client; then a signal must stop everything and leave nothing behind."""

from __future__ import annotations

import re
import signal
import socket
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, field

import openai
import pytest

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


def start_up(*args: str) -> Up:
    """Start `pdserve up` and wait for its summary (the router's /ready answered 200)."""
    proc = subprocess.Popen(
        [*CLI, *SMALL, *args], stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True
    )
    up = Up(proc)
    up.reader = threading.Thread(target=up.pump, daemon=True)
    up.reader.start()
    deadline = time.monotonic() + 180
    while not up.summary_done.wait(0.2):
        if proc.poll() is not None or time.monotonic() > deadline:
            stop(up, signal.SIGTERM)
            pytest.fail(f"pdserve up did not come up (exit {proc.returncode}):\n{up.output}")
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
        (signal.SIGTERM, ["--colocated", "--api-key", API_KEY]),  # 1 colocated, behind a key
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
        for name in ["redis", *roles]:  # every component's log lines carry its name
            assert re.search(rf"^\[{name}\] ", up.output, re.MULTILINE), up.output
        assert "curl " + url + "/v1/chat/completions" in up.output

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

    assert code == 0, up.output
    assert up.lines[-1] == "[up] stopped", up.output
    deadline = time.monotonic() + 5
    while not all(is_gone(pid) for pid in pids) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert [pid for pid in pids if not is_gone(pid)] == [], up.output
    assert can_listen(int(url.rpartition(":")[2]))


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
