"""The README's serving examples, pasted as a user would, against a live server.

`pdserve serve --host 127.0.0.1 --port P` (what `make up` runs, under the flags a `vllm serve`
user types) starts on a free port; every fenced block after a ``<!-- readme-example: NAME -->``
line runs as written but for that port (bash with the real curl, Python with the real openai
client), and its output must be what the block after ``<!-- readme-output: NAME -->`` shows (a
``...`` there stands for the rest of the line).
"""

from __future__ import annotations

import json
import re
import signal
import socket
import subprocess
import sys
from pathlib import Path

import pytest

from tests.test_up import start_up, stop

README = Path(__file__).resolve().parent.parent / "README.md"
BLOCK = r"<!-- readme-{kind}: (\S+) -->\n```(\w+)\n(.*?)```"
EXAMPLES = {"chat-stream", "openai"}  # the README must keep these, marked
README_URL = "127.0.0.1:8000"


def marked(kind: str) -> dict[str, tuple[str, str]]:
    """NAME -> (language, text) of the README's blocks marked ``readme-<kind>: NAME``."""
    found = re.findall(BLOCK.format(kind=kind), README.read_text(), re.DOTALL)
    return {name: (lang, text) for name, lang, text in found}


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


@pytest.fixture(scope="module")
def url():  # type: ignore[no-untyped-def]
    port = free_port()
    command = [sys.executable, "-m", "pdserve.cli", "serve", "--host", "127.0.0.1"]
    command += ["--port", str(port), "--num-blocks", "128"]
    up = start_up(command=command)
    assert f"pdserve is up: http://127.0.0.1:{port} " in up.output, up.output
    yield f"127.0.0.1:{port}"
    assert stop(up, signal.SIGINT) == 0, up.output


def run_example(name: str, url: str) -> str:
    lang, code = marked("example")[name]
    assert README_URL in code, f"example {name} does not name {README_URL}"
    code = code.replace(README_URL, url)
    command = {"bash": ["bash", "-c", code], "python": [sys.executable, "-c", code]}[lang]
    done = subprocess.run(command, capture_output=True, text=True, timeout=60, check=False)
    assert done.returncode == 0, f"example {name} failed:\n{done.stdout}\n{done.stderr}"
    return done.stdout


def shown(name: str) -> str:
    """What the README shows as the output of example ``name``."""
    return marked("output")[name][1].rstrip("\n")


def test_the_readme_marks_its_examples_and_their_output() -> None:
    assert set(marked("example")) == EXAMPLES
    assert set(marked("output")) == EXAMPLES


def test_the_streamed_chat_example_reads_as_the_readme_shows(url: str) -> None:
    events = [line[6:] for line in run_example("chat-stream", url).splitlines() if line]
    assert events[-1] == "[DONE]"
    chunks = [json.loads(event) for event in events[:-1]]
    text = "".join(c["choices"][0]["delta"].get("content", "") for c in chunks)
    assert text == shown("chat-stream")
    assert "Paris" in text
    assert [c["choices"][0]["finish_reason"] for c in chunks][-1] == "stop"


def test_the_openai_example_prints_what_the_readme_shows(url: str) -> None:
    printed = run_example("openai", url).rstrip("\n")
    expected = shown("openai")
    head, ellipsis, _ = expected.partition("...")
    assert printed.startswith(head) if ellipsis else printed == expected, printed
