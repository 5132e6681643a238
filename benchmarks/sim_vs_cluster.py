"""The simulator against a simulated-worker cluster on the same trace (#32's accuracy proof).

Starts ``pdserve up --simulate PROFILE`` (the real router, Redis, workers, gRPC, KV pulls over
tcp and leases; the model's step replaced by the profile's time, docs/simulation.md), drives it
with the load tester as ``benchmarks/goodput.py`` does (its ``preset_workload``, Poisson
arrivals, streamed completions, ``ignore_eos``), then runs the simulator (pdserve.sim) on the
same requests - the prompt lengths the server counted, the send times the client recorded - with
the same profile, and prints both runs' metrics side by side.

    python benchmarks/sim_vs_cluster.py [--layout 1p1d|2coloc] [--preset chatbot] [--rate 2]
"""

from __future__ import annotations

import argparse
import asyncio
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks"))

from goodput import preset_workload  # noqa: E402

from loadtest.arrivals import Schedule  # noqa: E402
from loadtest.client import ClientConfig, RunOutput, run  # noqa: E402
from loadtest.metrics import Metrics, compute  # noqa: E402
from pdserve.sim.cluster import Layout, simulate  # noqa: E402
from pdserve.sim.results import metrics_of  # noqa: E402
from pdserve.sim.timing import timing_from_simulation_profile  # noqa: E402
from pdserve.sim.trace import Trace, TraceRequest  # noqa: E402
from services.worker.simulation import load_profile  # noqa: E402

LAYOUTS = {
    "1p1d": (["--prefill", "1", "--decode", "1"], Layout(num_prefill=1, num_decode=1)),
    "2coloc": (["--colocated", "2"], Layout(num_colocated=2)),
}
SLOS = {"chatbot": (492.0, 153.3, 180.0), "mixed": (2243.0, 157.3, 186.0)}


def start(profile: str, pools: list[str]) -> tuple[subprocess.Popen, str, str]:
    cmd = [sys.executable, "-m", "pdserve.cli", "up", "--port", "0", "--simulate", profile]
    cmd += [*pools, "--no-prefix-caching"]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    assert proc.stdout is not None
    deadline = time.monotonic() + 240
    for line in proc.stdout:
        found = re.match(r"^pdserve is up: (http://\S+) \(model (.+)\)$", line.strip())
        if found:
            return proc, found.group(1), found.group(2)
        if time.monotonic() > deadline:
            break
    proc.send_signal(signal.SIGTERM)
    raise RuntimeError("pdserve up did not come up")


def measured(url: str, model: str, preset: str, n: int, rate: float) -> RunOutput:
    samples = preset_workload(preset, n, 0.25, 0.1, 0)
    cfg = ClientConfig(
        base_url=url, model=model, ignore_eos=True, request_timeout=300.0, disable_tqdm=True
    )
    return asyncio.run(run(cfg, samples, Schedule(rate=rate), n, seed=0))


def simulated(out: RunOutput, layout: Layout, profile: str, slos: dict[str, float]) -> Metrics:
    """The same requests: the prompt lengths the server counted, the recorded send times."""
    t0 = min(r.start for r in out.results)
    requests = tuple(
        TraceRequest(i, r.start - t0, r.prompt_len, r.output_len)
        for i, r in enumerate(sorted(out.results, key=lambda r: r.start))
    )
    trace = Trace(requests, out.schedule)
    timing = timing_from_simulation_profile(load_profile(profile))
    return metrics_of(trace, simulate(trace, layout, timing), slos)


def row(name: str, m: Metrics) -> str:
    s = m.stats
    return (
        f"{name:10s} {s['p50_ttft_ms']:8.0f} {s['p90_ttft_ms']:8.0f} {s['p99_ttft_ms']:8.0f} "
        f"{s['p50_tpot_ms']:8.1f} {s['p99_itl_ms']:8.0f} {m.request_goodput or 0.0:8.3f} "
        f"{m.slo_attainment or 0.0:7.2f}"
    )


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=(__doc__ or "").split("\n\n")[0])
    parser.add_argument("--layout", choices=sorted(LAYOUTS), default="1p1d")
    parser.add_argument("--preset", choices=sorted(SLOS), default="chatbot")
    parser.add_argument("--rate", type=float, default=2.0)
    parser.add_argument("--requests", type=int, default=48)
    parser.add_argument("--profile", default="sim-epyc-1thread-smollm2")
    args = parser.parse_args(argv)
    pools, layout = LAYOUTS[args.layout]
    proc, url, model = start(args.profile, pools)
    try:
        out = measured(url, model, args.preset, args.requests, args.rate)
    finally:
        proc.send_signal(signal.SIGTERM)
        proc.wait(timeout=90)
    ttft, tpot, itl = SLOS[args.preset]
    slos = {"ttft": ttft, "tpot": tpot, "itl_p99": itl}
    real = compute(out, slos, (50.0, 90.0, 99.0))
    sim = simulated(out, layout, args.profile, slos)
    print(
        f"{args.preset} x0.25/x0.1, {args.requests} requests at {args.rate:g} req/s, "
        f"{layout.name}, profile {args.profile}"
    )
    print(
        f"{'':10s} {'TTFT p50':>8s} {'p90':>8s} {'p99':>8s} {'TPOT p50':>8s} {'ITL p99':>8s} "
        f"{'goodput':>8s} {'attain':>7s}"
    )
    print(row("cluster", real))
    print(row("simulator", sim))
    return 0


if __name__ == "__main__":
    sys.exit(main())
