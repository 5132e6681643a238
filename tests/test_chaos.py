"""The short chaos run (issue #8): `benchmarks/chaos.py` as a user runs it, ~80 s of load on
`pdserve up --restart` with every fault kind injected once, then its report is checked."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "benchmarks" / "chaos.py"
KINDS = ["prefill_kill", "redis_restart", "decode_kill", "client_disconnect", "worker_hang"]
# 80 s at one fault every 15 s: faults at 7.5, 22.5, 37.5, 52.5 and 67.5 s, one of each kind.
SHORT = ["--duration", "80", "--fault-interval", "15", "--seed", "0"]
# Higher KV fault rates than the soak's default, so that a short run surely draws both kinds.
KV_FAULTS = ["--kv-faults", "drop=0.1,corrupt=0.1"]


@pytest.mark.timeout(400)
def test_short_chaos_run_loses_nothing(tmp_path: Path) -> None:
    report_path = tmp_path / "chaos.json"
    command = [sys.executable, str(SCRIPT), *SHORT, *KV_FAULTS, "--no-progress"]
    command += ["--json-out", str(report_path), "--log-file", str(tmp_path / "up.log")]
    run = subprocess.run(command, cwd=ROOT, capture_output=True, text=True, timeout=380)
    output = run.stdout + run.stderr
    assert report_path.exists(), f"no report (exit {run.returncode}):\n{output}"
    report = json.loads(report_path.read_text())
    results, faults = report["results"], report["faults_injected"]

    for kind in KINDS:
        assert faults[kind] >= 1, f"{kind} was never injected:\n{output}"
    assert faults["kv_drop"] >= 1 and faults["kv_corrupt"] >= 1, output
    assert report["restarts"].get("prefill-0", 0) >= 1, output  # --restart brought them back
    assert report["restarts"].get("decode-0", 0) >= 1, output
    assert report["restarts"].get("redis", 0) >= 1, output

    assert results["hung"] == 0, output
    assert results["wrong"] == 0 and results["wrong_in_recovery_probes"] == 0, output
    assert results["failed_unclear"] == 0, output
    assert results["leaked_blocks"] == 0, output
    assert results["orphans"] == 0, output
    assert report["recovery"]["recovered"], output
    # Most calls complete (a client retries a failed request 4 times over 15 s, as OpenAI's
    # clients do); the others are disconnected on purpose or gave up during an outage.
    assert results["calls_completed"] >= 0.8 * results["calls"], output
    assert report["passed"] and run.returncode == 0, output
