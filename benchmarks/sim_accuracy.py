"""The simulator (pdserve.sim) against the goodput sweep recorded in docs/benchmarks.md.

For every configuration and rate of ``benchmarks/goodput.py``'s run there (disagg,
disagg-cond, 2xcoloc, 1xcoloc; chatbot, mixed, summarization; lengths x0.25 in, x0.1 out), the
simulator runs the same trace (``goodput.preset_workload`` with seed 0, the load tester's
Poisson gaps for seed 0) on the same layout, and ``loadtest.metrics.compute`` scores it with
the same SLOs (TTFT, TPOT, each request's ITL p99). Printed: predicted vs recorded TTFT p50/p99,
TPOT p50, goodput, and the error in %.

The step times come from one of two profiles of this machine's kind (``--profile``):

- ``linear`` (the default): the simulated workers' fitted profiles,
  ``benchmarks/profiles/sim-epyc-1thread-smollm2.json`` (1-thread workers) and
  ``sim-epyc-2core-smollm2.json`` (the 2-thread worker of 1xcoloc);
- ``curves``: the measured ``benchmarks/profiles/epyc-2core.json`` read as ``pdserve plan``
  reads it (piecewise-linear, decode made monotone in the batch).

Two columns of predictions each:

- **raw**: the profile as it is. The sweep was measured on an Intel Xeon VM, the profiles on an
  AMD EPYC VM: their step times are not that machine's.
- **calibrated**: the profile's prefill and decode times scaled by two factors per thread count,
  fitted only on the sweep's *unloaded* rows (3 requests one at a time per configuration), never
  on the loaded rows it is then compared with.

    python benchmarks/sim_accuracy.py [--profile linear|curves] [--markdown]   # seconds
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from dataclasses import dataclass, replace
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks"))

from goodput import preset_workload  # noqa: E402  (benchmarks/goodput.py: the sweep's trace)

from loadtest.arrivals import Schedule  # noqa: E402
from pdserve.profile import ThreadProfile, WorkerProfile  # noqa: E402
from pdserve.sim.cluster import Layout, simulate  # noqa: E402
from pdserve.sim.results import metrics_of  # noqa: E402
from pdserve.sim.timing import (  # noqa: E402
    WorkerTiming,
    timing_from_simulation_profile,
    timing_from_worker_profile,
)
from pdserve.sim.trace import trace_from_samples  # noqa: E402
from services.engine.simulation_profile import SimulationProfile, StepTimeModel  # noqa: E402
from services.worker.simulation import load_profile  # noqa: E402

PROFILE = ROOT / "benchmarks" / "profiles" / "epyc-2core.json"
LINEAR = {1: "sim-epyc-1thread-smollm2", 2: "sim-epyc-2core-smollm2"}
NUM_PROMPTS = {"chatbot": 24, "mixed": 16, "summarization": 10}
# The SLOs of the recorded run (ms): TTFT, TPOT, each request's ITL p99.
SLOS = {
    "chatbot": (492.0, 153.3, 180.0),
    "mixed": (2243.0, 157.3, 186.0),
    "summarization": (5468.0, 164.8, 183.0),
}
# docs/benchmarks.md, "When disaggregation pays": unloaded TTFT p50, TPOT p50 (ms) per config.
UNLOADED = {
    ("chatbot", "disagg"): (136.4, 56.4),
    ("chatbot", "disagg-cond"): (110.7, 54.0),
    ("chatbot", "2xcoloc"): (117.6, 55.4),
    ("chatbot", "1xcoloc"): (86.4, 51.2),
    ("mixed", "disagg"): (179.9, 57.7),
    ("mixed", "disagg-cond"): (164.8, 56.4),
    ("mixed", "2xcoloc"): (179.0, 57.9),
    ("mixed", "1xcoloc"): (157.0, 51.6),
    ("summarization", "disagg"): (1675.5, 68.5),
    ("summarization", "disagg-cond"): (1587.8, 68.0),
    ("summarization", "2xcoloc"): (1528.9, 63.9),
    ("summarization", "1xcoloc"): (1048.8, 54.4),
}
# ... and the loaded rows: (preset, config, rate) -> goodput, TTFT p50, TTFT p99, TPOT p50.
RECORDED = {
    ("chatbot", "disagg", 1.0): (0.451, 141, 286, 66.8),
    ("chatbot", "disagg", 2.0): (0.758, 153, 312, 70.4),
    ("chatbot", "disagg", 4.0): (0.881, 150, 304, 75.6),
    ("chatbot", "disagg-cond", 1.0): (0.712, 157, 279, 62.3),
    ("chatbot", "disagg-cond", 2.0): (1.287, 180, 275, 72.4),
    ("chatbot", "disagg-cond", 4.0): (2.166, 197, 304, 83.0),
    ("chatbot", "2xcoloc", 1.0): (0.777, 140, 254, 59.1),
    ("chatbot", "2xcoloc", 2.0): (1.421, 153, 222, 61.3),
    ("chatbot", "2xcoloc", 4.0): (2.368, 193, 274, 70.3),
    ("chatbot", "1xcoloc", 1.0): (0.750, 146, 320, 62.1),
    ("chatbot", "1xcoloc", 2.0): (1.442, 150, 244, 64.5),
    ("chatbot", "1xcoloc", 4.0): (2.009, 174, 274, 71.8),
    ("mixed", "disagg", 0.25): (0.122, 249, 4186, 65.9),
    ("mixed", "disagg", 0.5): (0.142, 242, 4794, 69.6),
    ("mixed", "disagg", 0.75): (0.170, 287, 8603, 72.1),
    ("mixed", "disagg-cond", 0.25): (0.133, 245, 5224, 63.6),
    ("mixed", "disagg-cond", 0.5): (0.185, 242, 5292, 69.1),
    ("mixed", "disagg-cond", 0.75): (0.256, 270, 5221, 71.7),
    ("mixed", "2xcoloc", 0.25): (0.144, 236, 2220, 61.3),
    ("mixed", "2xcoloc", 0.5): (0.225, 226, 2954, 62.7),
    ("mixed", "2xcoloc", 0.75): (0.230, 244, 3172, 73.3),
    ("mixed", "1xcoloc", 0.25): (0.134, 227, 2726, 55.4),
    ("mixed", "1xcoloc", 0.5): (0.188, 259, 2955, 62.1),
    ("mixed", "1xcoloc", 0.75): (0.234, 240, 3541, 71.2),
    ("summarization", "disagg", 0.125): (0.101, 1891, 5106, 71.1),
    ("summarization", "disagg", 0.25): (0.218, 1974, 5291, 69.2),
    ("summarization", "disagg-cond", 0.125): (0.101, 1922, 5181, 70.5),
    ("summarization", "disagg-cond", 0.25): (0.191, 1981, 5228, 70.6),
    ("summarization", "2xcoloc", 0.125): (0.130, 1809, 2536, 66.5),
    ("summarization", "2xcoloc", 0.25): (0.219, 1890, 2812, 65.5),
    ("summarization", "1xcoloc", 0.125): (0.102, 1335, 3386, 58.1),
    ("summarization", "1xcoloc", 0.25): (0.195, 1437, 3668, 58.8),
}
CONFIGS = {
    "disagg": (Layout(num_prefill=1, num_decode=1, disaggregation="always"), 1),
    "disagg-cond": (Layout(num_prefill=1, num_decode=1), 1),
    "2xcoloc": (Layout(num_colocated=2), 1),
    "1xcoloc": (Layout(num_colocated=1), 2),  # --threads 2 --max-num-batched-tokens 256
}


def scaled_curve(curve: ThreadProfile, prefill: float, decode: float) -> ThreadProfile:
    points = [replace(p, seconds=p.seconds * decode) for p in curve.decode]
    seconds = [s * prefill for s in curve.prefill_seconds]
    return ThreadProfile(curve.num_threads, curve.prefill_tokens, seconds, points)


def scaled_linear(profile: SimulationProfile, prefill: float, decode: float) -> SimulationProfile:
    s = profile.step
    step = StepTimeModel(
        base_s=s.base_s * decode,
        prefill_token_s=s.prefill_token_s * prefill,
        prefill_pair_s=s.prefill_pair_s * prefill,
        decode_seq_s=s.decode_seq_s * decode,
        decode_context_s=s.decode_context_s * decode,
    )
    return replace(profile, step=step)


@dataclass(frozen=True)
class Profiles:
    """The step times: ``curves`` (a measured WorkerProfile) or ``linear`` (per thread count, a
    simulated worker's profile)."""

    kind: str
    curves: WorkerProfile
    linear: dict[int, SimulationProfile]

    @classmethod
    def load(cls, kind: str) -> Profiles:
        linear = {1: load_profile(LINEAR[1]), 2: load_profile(LINEAR[2])}
        return cls(kind, WorkerProfile.load(PROFILE), linear)


def timing(profiles: Profiles, config: str, scales: dict[int, tuple[float, float]]) -> WorkerTiming:
    threads = CONFIGS[config][1]
    a, b = scales.get(threads, (1.0, 1.0))
    budget = 256 if config == "1xcoloc" else None
    if profiles.kind == "linear":
        linear = scaled_linear(profiles.linear[threads], a, b)
        return timing_from_simulation_profile(linear, max_num_batched_tokens=budget or 2048)
    profile = profiles.curves
    curves = [scaled_curve(c, a, b) for c in profile.threads if c.num_threads == threads]
    return timing_from_worker_profile(replace(profile, threads=curves), threads, budget)


@dataclass
class Row:
    preset: str
    config: str
    rate: float
    goodput: float
    ttft_p50: float
    ttft_p99: float
    tpot_p50: float


def run(profiles: Profiles, preset: str, config: str, rate: float, scales: dict) -> Row:
    samples = preset_workload(preset, NUM_PROMPTS[preset], 0.25, 0.1, 0)
    trace = trace_from_samples(samples, Schedule(rate=rate), seed=0)
    result = simulate(trace, CONFIGS[config][0], timing(profiles, config, scales))
    ttft, tpot, itl = SLOS[preset]
    m = metrics_of(trace, result, {"ttft": ttft, "tpot": tpot, "itl_p99": itl})
    s = m.stats
    return Row(
        preset,
        config,
        rate,
        m.request_goodput or 0.0,
        s["p50_ttft_ms"] or 0.0,
        s["p99_ttft_ms"] or 0.0,
        s["p50_tpot_ms"] or 0.0,
    )


def unloaded(profiles: Profiles, preset: str, config: str, scales: dict) -> tuple[float, float]:
    """The sweep's baseline: 3 requests (seed 1, each kind of mixed) one at a time."""
    samples = preset_workload(preset, 3, 0.25, 0.1, 1, even=True)
    trace = trace_from_samples(samples, Schedule(rate=1e-3, burstiness=float("inf")), seed=1)
    m = metrics_of(trace, simulate(trace, CONFIGS[config][0], timing(profiles, config, scales)))
    return m.stats["median_ttft_ms"] or 0.0, m.stats["median_tpot_ms"] or 0.0


def calibrate(profiles: Profiles) -> dict[int, tuple[float, float]]:
    """Per thread count: median measured/simulated unloaded TTFT and TPOT over the configs."""
    ratios: dict[int, list[tuple[float, float]]] = {}
    for (preset, config), (ttft, tpot) in UNLOADED.items():
        sim_ttft, sim_tpot = unloaded(profiles, preset, config, {})
        ratios.setdefault(CONFIGS[config][1], []).append((ttft / sim_ttft, tpot / sim_tpot))
    return {
        t: (statistics.median(r[0] for r in rs), statistics.median(r[1] for r in rs))
        for t, rs in ratios.items()
    }


def error(predicted: float, measured: float) -> str:
    return f"{(predicted - measured) / measured * 100:+.0f}%" if measured else "-"


METRICS = ("goodput", "ttft_p50", "ttft_p99", "tpot_p50")


def compare(profiles: Profiles, scales: dict) -> list[tuple[tuple, tuple, Row, Row]]:
    """Per recorded row: its key, the recorded figures, the raw and the calibrated prediction."""
    return [
        (key, recorded, run(profiles, *key, {}), run(profiles, *key, scales))
        for key, recorded in RECORDED.items()
    ]


def median_errors(rows: list[tuple[tuple, tuple, Row, Row]]) -> dict[str, list[float]]:
    """``"<metric> raw|cal"`` -> the |relative error| of each row."""
    errors: dict[str, list[float]] = {}
    for _, recorded, raw, cal in rows:
        for k, name in enumerate(METRICS):
            for kind, row in (("raw", raw), ("cal", cal)):
                errors.setdefault(f"{name} {kind}", []).append(
                    abs(getattr(row, name) - recorded[k]) / recorded[k]
                )
    return errors


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=(__doc__ or "").split("\n\n")[0])
    parser.add_argument("--markdown", action="store_true", help="print the docs' table")
    parser.add_argument("--profile", choices=("linear", "curves"), default="linear")
    args = parser.parse_args(argv)
    started = time.perf_counter()
    profiles = Profiles.load(args.profile)
    scales = calibrate(profiles)
    print("calibration (prefill x, decode x) per thread count, from the unloaded rows only:")
    for threads, (a, b) in sorted(scales.items()):
        print(f"  {threads} thread(s): prefill x{a:.2f}, decode x{b:.2f}")
    head = "| preset | config | rate | goodput rec / raw / cal | TTFT p50 | TTFT p99 | TPOT p50 |"
    print(head if args.markdown else head.replace("|", " "))
    if args.markdown:
        print("|---|---|---|---|---|---|---|")
    rows = compare(profiles, scales)
    for (preset, config, rate), recorded, raw, cal in rows:
        cells = []
        for k, name in enumerate(METRICS):
            rec, r, c = recorded[k], getattr(raw, name), getattr(cal, name)
            fmt = "{:.3f}" if k == 0 else "{:.0f}"
            cells.append(
                f"{fmt.format(rec)} / {fmt.format(r)} ({error(r, rec)}) / "
                f"{fmt.format(c)} ({error(c, rec)})"
            )
        line = f"| {preset} | {config} | {rate:g} | " + " | ".join(cells) + " |"
        print(line if args.markdown else line.replace("|", " "))
    print("median |error| over the rows (and the share of rows within 15%):")
    for name, values in median_errors(rows).items():
        within = sum(v <= 0.15 for v in values) / len(values)
        print(f"  {name:14s} {statistics.median(values) * 100:5.1f}%   within 15%: {within:.0%}")
    print(f"simulated in {time.perf_counter() - started:.1f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
