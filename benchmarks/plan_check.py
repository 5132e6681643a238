"""Does ``pdserve plan``'s recommendation reach 90% of the best goodput the sweep found?

Reads a goodput sweep (``benchmarks/goodput.py``'s goodput.json) and a worker profile
(``pdserve plan --measure --save-profile``), asks the planner for each preset of the sweep with
the sweep's own SLOs, scaling and core count, and scores the recommended deployment by the
highest goodput the sweep measured for it, against the highest goodput of any configuration.

    python benchmarks/plan_check.py --sweep benchmarks/results/goodput.json \
        --profile benchmarks/profiles/epyc-2core.json [--shared-cores]

Pure computation over the two files (no model is loaded); prints a table, exits 1 when a preset
falls under --target (default 0.9).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from pdserve.plan import SLO, Deployment, make_plan, preset_workload  # noqa: E402
from pdserve.profile import WorkerProfile  # noqa: E402

# The sweep's configuration names for the planner's deployments of 2 cores. A 1P+1D deployment
# runs the router's default, per-request disaggregation: "disagg-cond" where the sweep has it.
SWEEP_NAME = {
    Deployment(num_prefill=1, num_decode=1): "disagg-cond",
    Deployment(num_colocated=2): "2xcoloc",
    Deployment(num_colocated=1, threads=2): "1xcoloc",
}


def best_goodput(rows: dict[str, dict[str, float]]) -> tuple[float, str]:
    """The highest goodput over the swept rates, and at which rate."""
    rate, row = max(rows.items(), key=lambda kv: kv[1]["goodput"])
    return row["goodput"], rate


def check_preset(
    preset: str,
    result: dict[str, Any],
    config: dict[str, Any],
    profile: WorkerProfile,
    shared: bool,
) -> dict[str, Any]:
    slos = result["slos_ms"]
    workload = preset_workload(preset, config["input_scale"], config["output_scale"])
    # The planner models TTFT and TPOT; the sweep's per-request ITL p99 bound is not modelled
    # (stalls depend on arrival coincidences), so a recommendation is scored by goodput measured
    # under all three.
    slo = SLO(slos["ttft"] / 1e3, slos["tpot"] / 1e3, "p90")
    plan = make_plan(profile, workload, slo, cores=2, shared_cores=shared)
    chosen = SWEEP_NAME[plan.best.deployment]
    if chosen not in result["rows"]:  # a sweep from before per-request disaggregation
        chosen = "disagg"
    per_config = {name: best_goodput(rows) for name, rows in result["rows"].items()}
    top = max(per_config, key=lambda n: per_config[n][0])
    ours = per_config[chosen][0]
    share = ours / per_config[top][0] if per_config[top][0] > 0 else 1.0
    return {
        "preset": preset,
        "recommended": chosen,
        "predicted_max_rate": plan.best.max_rate,
        "its_goodput": ours,
        "best": top,
        "best_goodput": per_config[top][0],
        "best_rate": per_config[top][1],
        "share": share,
    }


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--sweep", type=Path, default=ROOT / "benchmarks/results/goodput.json")
    p.add_argument("--profile", type=Path, default=ROOT / "benchmarks/profiles/epyc-2core.json")
    p.add_argument("--shared-cores", action="store_true", help="as pdserve plan --shared-cores")
    p.add_argument("--target", type=float, default=0.9)
    args = p.parse_args(argv)

    sweep = json.loads(args.sweep.read_text())
    profile = WorkerProfile.load(args.profile)
    rows = [
        check_preset(preset, result, sweep["config"], profile, args.shared_cores)
        for preset, result in sweep["presets"].items()
    ]
    flag = " --shared-cores" if args.shared_cores else ""
    print(f"pdserve plan{flag} against {args.sweep} (profile {args.profile})")
    print(f"{'preset':<15}{'recommended':<13}{'goodput':>9}  {'best in sweep':<22}{'share':>7}")
    for r in rows:
        best = f"{r['best']} {r['best_goodput']:.3f} @{r['best_rate']}"
        print(
            f"{r['preset']:<15}{r['recommended']:<13}{r['its_goodput']:>9.3f}  {best:<22}"
            f"{r['share']:>6.0%}"
        )
    short = [r["preset"] for r in rows if r["share"] < args.target]
    if short:
        print(f"under {args.target:.0%} of the best: {', '.join(short)}")
        return 1
    print(f"every preset at or above {args.target:.0%} of the best goodput")
    return 0


if __name__ == "__main__":
    sys.exit(main())
