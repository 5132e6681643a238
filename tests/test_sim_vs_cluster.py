"""The simulator (pdserve.sim) agrees with a simulated-worker cluster on the same trace (#32).

A small instance of ``benchmarks/sim_vs_cluster.py``: ``pdserve up --simulate`` with one
prefill and one decode worker (the real router, Redis, gRPC, tcp KV pulls and leases; each
engine step sleeps the profile's time) is driven by the load tester, then the simulator runs
the same requests (the prompt lengths the server counted, the send times the client recorded)
with the same profile and no calibration. A change that breaks either side's model of a step,
the hand-off or the batching moves them apart and fails here.
"""

from __future__ import annotations

import signal
import sys
from pathlib import Path

from tests.loadtest.standin import timing_sensitive
from tests.test_up import start_up, stop

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))

import sim_vs_cluster  # noqa: E402  (benchmarks/sim_vs_cluster.py)

PROFILE = "sim-epyc-1thread-smollm2"
# The sweep's chatbot SLOs (ms); only the latencies are compared, the SLOs make goodput defined.
SLOS = {"ttft": 492.0, "tpot": 153.3, "itl_p99": 180.0}
# The script's recorded agreement is within 18% (docs/simulator.md); a shared CI machine adds
# its own stalls to the cluster's side only, hence the margin (a wrong profile: -35%).
BOUND = 0.25


@timing_sensitive
def test_simulator_agrees_with_a_simulated_cluster() -> None:
    up = start_up("--simulate", PROFILE, "--prefill", "1", "--decode", "1", "--no-prefix-caching")
    try:
        url = up.find(r"^pdserve is up: (http://\S+)")
        model = up.find(r"^pdserve is up: \S+ \(model (.+)\)$")
        out = sim_vs_cluster.measured(url, model, "chatbot", 24, 2.0)
    finally:
        code = stop(up, signal.SIGTERM)
    assert code == 0, up.output
    assert not [r.error for r in out.results if not r.ok]
    real = sim_vs_cluster.compute(out, SLOS, (50.0, 90.0, 99.0)).stats
    layout = sim_vs_cluster.LAYOUTS["1p1d"][1]
    sim = sim_vs_cluster.simulated(out, layout, PROFILE, SLOS).stats
    for key in ("p50_ttft_ms", "p90_ttft_ms", "p50_tpot_ms"):
        error = abs(sim[key] - real[key]) / real[key]
        assert error < BOUND, f"{key}: simulator {sim[key]:.0f} vs cluster {real[key]:.0f} ms"
