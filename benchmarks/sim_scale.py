"""How long pdserve.sim takes for 10 to 1,000 workers (docs/simulator.md).

One preset trace per worker count (the load tester's requests for ``--preset`` and seed 0, at
``--rate-per-worker`` x workers req/s), run on a colocated layout and on a 1:3 prefill:decode
layout of that many workers, with the simulated H100 profile
(``benchmarks/profiles/sim-h100-llama3-8b.json``). Printed: wall seconds of the simulation
(trace generation and metrics apart), events, events per second, and the simulated goodput.

    python benchmarks/sim_scale.py [--requests 5000] [--workers 10,100,1000]
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from pdserve.sim.cluster import Layout, simulate  # noqa: E402
from pdserve.sim.results import metrics_of  # noqa: E402
from pdserve.sim.timing import timing_from_simulation_profile  # noqa: E402
from pdserve.sim.trace import preset_trace  # noqa: E402
from services.worker.simulation import load_profile  # noqa: E402


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=(__doc__ or "").split("\n\n")[0])
    parser.add_argument("--preset", default="chatbot")
    parser.add_argument("--requests", type=int, default=5000)
    parser.add_argument("--rate-per-worker", type=float, default=2.0)
    parser.add_argument("--workers", default="10,100,1000")
    parser.add_argument("--profile", default="sim-h100-llama3-8b")
    args = parser.parse_args(argv)
    timing = timing_from_simulation_profile(load_profile(args.profile))
    print(
        f"{args.requests} {args.preset} requests, {args.rate_per_worker:g} req/s per worker, "
        f"profile {args.profile}"
    )
    print(f"{'layout':24s} {'sim s':>7s} {'events':>9s} {'events/s':>9s} {'goodput':>8s}")
    for n in (int(x) for x in args.workers.split(",")):
        trace = preset_trace(args.preset, args.requests, args.rate_per_worker * n, seed=0)
        p = max(1, n // 4)
        for layout in (Layout(num_colocated=n), Layout(num_prefill=p, num_decode=n - p)):
            started = time.perf_counter()
            result = simulate(trace, layout, timing)
            seconds = time.perf_counter() - started
            m = metrics_of(trace, result, {"ttft": 500.0, "tpot": 50.0})
            print(
                f"{layout.name:24s} {seconds:7.2f} {result.num_events:9d} "
                f"{result.num_events / seconds:9.0f} {m.request_goodput or 0.0:8.1f}"
            )
    return 0


if __name__ == "__main__":
    sys.exit(main())
