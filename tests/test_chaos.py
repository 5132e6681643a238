"""The short chaos run (issues #8, #30): `benchmarks/chaos.py` as a user runs it, ~40 s of load
on `pdserve up --restart` through a streaming and a whole-hand-off router, with every fault kind
injected once, every answer compared token for token with the offline engine's; then its report
is checked: 0 wrong, 0 hung, 0 leaked."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "benchmarks" / "chaos.py"
KINDS = [
    "prefill_kill",
    "decode_kill",
    "stalled_reader",
    "lost_lease",
    "redis_restart",
    "client_disconnect",
    "worker_hang",
]
# 42 s at one fault every 6 s: faults at 3, 9, ..., 39 s, one of each kind. 4 clients, and 18
# prompts (one per length mod 16, plus 1 and 16) up to 12 blocks: the machine has 2 cores.
SHORT = ["--duration", "42", "--fault-interval", "6", "--seed", "0", "--concurrency", "4"]
SHORT += ["--prompts-per-residue", "1", "--max-prompt-blocks", "12"]
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

    # What was exercised: every length mod 16, both hand-offs, every fault.
    lengths = {p["tokens"] for p in report["pool"]}
    assert {length % 16 for length in lengths} == set(range(16)) and {1, 16} <= lengths
    assert {p["n"] for p in report["pool"]} == {1, 2}
    routes = {key.split()[0] for key in report["by_route"] if key.endswith("correct")}
    assert routes == {"streamed", "whole"}, output
    for kind in KINDS:
        assert faults[kind] >= 1, f"{kind} was never injected:\n{output}"
    assert faults["kv_drop"] >= 1 and faults["kv_corrupt"] >= 1, output
    assert report["stalled_readers"]["cut_off"] >= 1, output  # a stall that was checked
    for name in ("prefill-0", "decode-0", "redis"):
        assert report["restarts"].get(name, 0) >= 1, output  # --restart brought them back

    assert results["wrong"] == 0 and results["wrong_in_recovery_probes"] == 0, output
    assert results["hung"] == 0 and results["hung_kv_peer"] == 0, output
    assert results["leaked"] == 0, output
    assert results["stalled_readers_not_cut_off"] == 0, output
    assert results["failed_unclear"] == 0, output
    assert results["orphans"] == 0, output
    assert report["recovery"]["recovered"], output
    assert report["passed"] and run.returncode == 0, output
