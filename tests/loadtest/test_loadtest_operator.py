"""What an operator touches (#20): Ctrl-C keeps a partial run, mistakes get one line, the server
is checked first, ``n/a`` for metrics without samples, honest ``--compare``, help with defaults.
Every test runs the real command (a child process where signals or exit paths matter) against
the stand-in server over HTTP."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from loadtest import __version__
from loadtest.cli import main
from loadtest.report import compare
from tests.loadtest.standin import MODEL, standin

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def server():  # type: ignore[no-untyped-def]
    with standin(ttft=0.01, itl=0.01, capacity=1000, check_model=True) as url:
        yield url


def tool(*args: str) -> list[str]:
    return [sys.executable, "-m", "loadtest", *args]


def small(url: str, n: int = 8, out_len: int = 4) -> list[str]:
    return [
        "--base-url",
        url,
        "--num-prompts",
        str(n),
        "--request-rate",
        "200",
        "--random-input-len",
        "8",
        "--random-output-len",
        str(out_len),
        "--disable-tqdm",
    ]


def start(args: list[str], cwd: Path) -> subprocess.Popen:
    return subprocess.Popen(
        tool(*args),
        cwd=cwd,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env={**os.environ, "PYTHONPATH": str(ROOT)},
    )


def wait_for_requests(proc: subprocess.Popen, seconds: float) -> None:
    """Let the run get going (the first line is printed after the server check)."""
    assert proc.stdout is not None
    assert "model=" in proc.stdout.readline()
    time.sleep(seconds)


def test_sigint_keeps_the_partial_run(server, tmp_path) -> None:  # type: ignore[no-untyped-def]
    # 400 requests of 0.2-3.8 s (20-380 tokens 10 ms apart) at 40 req/s: Ctrl-C after 2.5 s
    # finds short ones done and many in flight.
    args = [
        *small(server, n=400, out_len=200),
        "--request-rate",
        "40",
        "--random-range-ratio",
        "0.9",
        "--save-result",
        "--result-filename",
        "run.json",
        "--goodput",
        "ttft:500",
    ]
    proc = start(args, tmp_path)
    wait_for_requests(proc, 2.5)
    proc.send_signal(signal.SIGINT)
    out, err = proc.communicate(timeout=60)
    assert proc.returncode == 130, err
    assert "Traceback" not in err and "interrupted: stopping" in err
    assert "PARTIAL Result" in out and "Stopped early: interrupted (SIGINT)" in out
    assert "Cancelled in flight" in out
    doc = json.loads((tmp_path / "run-interrupted.json").read_text())
    assert doc["config"]["interrupted"] and doc["config"]["stopped"] == "interrupted (SIGINT)"
    assert doc["config"]["num_cancelled"] > 0
    assert 0 < doc["completed"] < 400 and doc["num_prompts"] < 400  # sending stopped
    for name in ("_requests.csv", "_latency_cdf.png", "_timeline.png", "_workload.png"):
        assert (tmp_path / f"run-interrupted{name}").stat().st_size > 0


def test_a_second_sigint_exits_at_once(server, tmp_path) -> None:  # type: ignore[no-untyped-def]
    args = [*small(server, n=400, out_len=200), "--request-rate", "40", "--save-result"]
    proc = start(args, tmp_path)
    wait_for_requests(proc, 1.0)
    proc.send_signal(signal.SIGINT)
    assert proc.stderr is not None
    first = ""  # wait until the first is being handled (cancelling, summing up, plotting)
    while "interrupted: stopping" not in first:
        line = proc.stderr.readline()
        assert line, f"exited before the second Ctrl-C: {first!r}"
        first += line
    proc.send_signal(signal.SIGINT)
    began = time.monotonic()
    _, err = proc.communicate(timeout=30)
    assert proc.returncode == 130 and time.monotonic() - began < 5
    assert "Traceback" not in err and "interrupted again" in err, first + err


def test_mistakes_get_one_line(server, tmp_path) -> None:  # type: ignore[no-untyped-def]
    cases = {
        ("--base-url", "http://127.0.0.1:9"): "--base-url http://127.0.0.1:9",
        ("--base-url", server, "--model", "nope"): "`nope` does not exist",
        ("--base-url", server, "--endpoint", "/v1/nope"): "--endpoint",
        ("--num-prompts", "-1"): "--num-prompts",
        ("--num-prompts", "0"): "--num-prompts",
        ("--request-rate", "0"): "--request-rate",
        ("--dataset-name", "sharegpt", "--dataset-path", "missing.json"): "missing.json",
        ("--dataset-name", "custom"): "--dataset-path",
        ("--compare", "missing.json", "other.json"): "missing.json",
        ("--goodput", "ttfx:5"): "--goodput",
        ("--sweep-rates", "1,x"): "--sweep-rates",
        ("--duration", "5"): "--max-concurrency",
    }
    for args, named in cases.items():
        proc = subprocess.run(
            tool(*args),
            cwd=tmp_path,
            capture_output=True,
            text=True,
            timeout=60,
            env={**os.environ, "PYTHONPATH": str(ROOT)},
        )
        lines = proc.stderr.strip().splitlines()
        assert proc.returncode == 2 and len(lines) == 1, (args, proc.stderr)
        assert named in lines[0] and "Traceback" not in proc.stderr, (args, lines)
    # The wrong model: the server's own message, and what it serves.
    proc = subprocess.run(
        tool("--base-url", server, "--model", "nope"),
        capture_output=True,
        text=True,
        timeout=60,
        env={**os.environ, "PYTHONPATH": str(ROOT)},
    )
    assert "answered 404" in proc.stderr and f"the server serves {MODEL}" in proc.stderr


def test_no_samples_read_n_a(server, capsys) -> None:  # type: ignore[no-untyped-def]
    assert main([*small(server), "--no-stream", "--percentile-metrics", "ttft,tpot,itl"]) == 0
    out = capsys.readouterr().out
    assert "Median TPOT (ms):" in out
    for line in out.splitlines():
        if "TPOT (ms)" in line or "ITL (ms)" in line:
            assert line.split()[-1] == "n/a", line


def test_compare_is_honest(server, tmp_path, capsys) -> None:  # type: ignore[no-untyped-def]
    # "run.8-requests.json": a name with dots is kept whole (the JSON once lost what followed one)
    common = ["--result-dir", str(tmp_path), "--save-result", "--no-plots", "--goodput", "ttft:900"]
    assert main([*small(server, n=8), *common, "--result-filename", "run.8-requests.json"]) == 0
    assert (
        main(
            [
                *small(server, n=5),
                *common,
                "--result-filename",
                "five-requests.json",
                "--endpoint",
                "/v1/chat/completions",
            ]
        )
        == 0
    )
    capsys.readouterr()
    argv = [
        "--compare",
        str(tmp_path / "run.8-requests.json"),
        str(tmp_path / "five-requests.json"),
    ]
    assert main(argv) == 0
    table = capsys.readouterr().out
    assert "warning: the runs differ" in table
    assert "num_prompts: 8 vs 5" in table and "backend: openai vs openai-chat" in table
    header = next(line for line in table.splitlines() if line.startswith("metric"))
    assert "run.8-requests" in header and "five-requests" in header  # full names
    completed = next(line for line in table.splitlines() if line.startswith("completed "))
    assert "worse" not in completed and "better" not in completed
    # Values are never cut: a long number prints in full.
    doc = json.loads((tmp_path / "run.8-requests.json").read_text())
    other = {**doc, "request_goodput": 0.0004740534027827}
    line = next(x for x in compare(doc, other).splitlines() if x.startswith("request_goodput"))
    assert "0.000474" in line


def test_help_shows_defaults_and_version() -> None:
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    text = subprocess.run(tool("--help"), capture_output=True, text=True, check=True, env=env)
    help_text = " ".join(text.stdout.split())
    for shown in (
        "(default: http://127.0.0.1:8000)",
        "(default: inf)",
        "(default: 1024)",
        "(default: random)",
        "(default: 1.0)",
        "(default: 600.0)",
    ):
        assert shown in help_text, shown
    version = subprocess.run(tool("--version"), capture_output=True, text=True, env=env)
    assert version.returncode == 0 and version.stdout.strip() == f"pdserve-loadtest {__version__}"
