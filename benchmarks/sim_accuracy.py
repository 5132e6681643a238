"""The simulator (pdserve.sim) against a recorded goodput sweep.

The sweep is ``benchmarks/goodput.py``'s JSON (``--sweep``, default
``benchmarks/recorded/goodput-zen4.json``: disagg, disagg-cond, 2xcoloc, 1xcoloc; chatbot, mixed,
summarization, codegen; lengths x0.25 in, x0.1 out; measured on this repo's AMD EPYC Zen 4 VM,
2 cores). For every configuration and rate in it, the simulator runs the same trace
(``goodput.preset_workload`` with seed 0, the load tester's Poisson gaps for seed 0) on the same
layout, and ``loadtest.metrics.compute`` scores it with the sweep's SLOs (TTFT, TPOT, each
request's ITL p99). Printed: predicted vs recorded goodput, TTFT p50/p90, TPOT p50, and the
error in %.

The step times come from one of two profiles of this machine's kind (``--profile``):

- ``linear`` (the default): the simulated workers' fitted profiles,
  ``benchmarks/profiles/sim-zen4-1thread-smollm2.json`` (1-thread workers) and
  ``sim-zen4-2core-smollm2.json`` (the 2-thread worker of 1xcoloc), fitted to
  ``zen4-2core.json`` (``pdserve plan --measure`` on the sweep's machine, quiet);
- ``curves``: the measured ``benchmarks/profiles/epyc-2core.json`` read as ``pdserve plan``
  reads it (piecewise-linear, decode made monotone in the batch).

Two columns of predictions each:

- **raw**: the profile as it is (measured alone, one engine step at a time: the sweep's steps
  share the cores with the router, Redis and the load generator);
- **calibrated**: two factors per thread count, fitted only on the sweep's *unloaded* rows (3
  requests one at a time per configuration), never on the loaded rows it is then compared with:
  the prompt part of a step scaled by the prefill factor, and (linear profiles, the default) the
  decode factor's extra time of a one-sequence step added to every step: a fixed cost per step,
  not per sequence (on a shared machine the unloaded step's extra is dispatch and the other
  processes' time slices; a scale charged it again for every sequence of a loaded step and put
  loaded TPOTs +20-50% over the measured ones). The measured curves are scaled.

    python benchmarks/sim_accuracy.py [--profile linear|curves] [--markdown] [--sweep FILE]
        [--linear ONE_THREAD_PROFILE TWO_THREAD_PROFILE] [--no-padded-prefill]
        [--decode-points MEASURED_PROFILE | --no-decode-residuals]
        [--corun FILE [--corun-one-prompt-factor] | --no-corun]
        [--host-work FILE | --no-host-work]
        [--per-deployment] [--decisions] [--repeatability]

``--repeatability`` (with ``--sweep A B``) also scores B's rows as a prediction of A's: how close
a second run of the same sweep comes, in the measure the simulator is held to. With three runs or
more, each is scored against the mean of the others.

``--per-deployment`` calibrates each configuration on its own unloaded rows instead of all of
them per thread count: ``goodput.py`` starts each configuration's workers once, and a process's
speed differs from one start to the next on the sweep's VM (docs/simulator.md).

Both workers of ``disagg``, ``disagg-cond`` and ``2xcoloc`` share the sweep's 2-core machine: a
step started while the other worker computes takes the co-run factor measured by
``benchmarks/corun_slowdown.py`` (``--corun``, default ``benchmarks/profiles/zen4-corun.json``;
``pdserve.sim.corun``): a prompt step beside a decoding one takes the ratio measured at its
prompt's size (``--corun-one-prompt-factor``: the median over the sizes for every prompt step);
``--no-corun`` times every step as if the other core were idle. The
router and the load tester share that machine too: each request's arrival and end lengthen the
steps in progress by what ``benchmarks/host_work.py`` measured there (``--host-work``, default
``benchmarks/profiles/zen4-host-work.json``; ``pdserve.sim.host_work``); ``--no-host-work``
leaves the steps as the profile has them. An idle host loses nothing, so the unloaded rows, and
the calibration fitted on them, do not change.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import statistics
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import TypeVar

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks"))

import numpy as np  # noqa: E402
from goodput import preset_workload  # noqa: E402  (benchmarks/goodput.py: the sweep's trace)

from loadtest.arrivals import Schedule  # noqa: E402
from pdserve.profile import ThreadProfile, WorkerProfile  # noqa: E402
from pdserve.sim.cluster import Layout, simulate  # noqa: E402
from pdserve.sim.corun import CoRun  # noqa: E402
from pdserve.sim.decode_residual import DecodeResiduals, with_decode_residuals  # noqa: E402
from pdserve.sim.host_work import HostWork  # noqa: E402
from pdserve.sim.overheads import Overheads  # noqa: E402
from pdserve.sim.padded_prefill import with_padded_prefill  # noqa: E402
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
# what the default linear profiles were fitted to: their decode residuals come from its points
MEASURED = ROOT / "benchmarks" / "profiles" / "zen4-2core.json"
# benchmarks/corun_slowdown.py on the sweep's machine: steps beside a computing neighbour
CORUN = ROOT / "benchmarks" / "profiles" / "zen4-corun.json"
# benchmarks/host_work.py on the sweep's machine: steps lengthened by arrivals and finishes
HOST_WORK = ROOT / "benchmarks" / "profiles" / "zen4-host-work.json"
LINEAR = {1: "sim-zen4-1thread-smollm2", 2: "sim-zen4-2core-smollm2"}
# benchmarks/goodput.py's output, kept: the run the simulator is checked against
SWEEP = ROOT / "benchmarks" / "recorded" / "goodput-zen4.json"
METRICS = ("goodput", "ttft_p50", "ttft_p90", "tpot_p50")
SWEEP_KEYS = {
    "goodput": "goodput",
    "ttft_p50": "p50_ttft_ms",
    "ttft_p90": "p90_ttft_ms",
    "tpot_p50": "p50_tpot_ms",
}


Key = TypeVar("Key")


@dataclass(frozen=True)
class Sweep:
    """A recorded ``benchmarks/goodput.py`` run: its workload, SLOs, unloaded and loaded rows."""

    input_scale: float
    output_scale: float
    num_prompts: dict[str, int]
    slos: dict[str, dict[str, float]]  # preset -> {"ttft", "tpot", "itl_p99"} in ms
    unloaded: dict[tuple[str, str], tuple[float, float]]  # (preset, config) -> TTFT, TPOT p50
    recorded: dict[tuple[str, str, float], tuple[float, ...]]  # (preset, config, rate) -> METRICS
    # (preset, config, rate) -> the router's disaggregation decisions ("local:short" -> count)
    decisions: dict[tuple[str, str, float], dict[str, int]] = field(default_factory=dict)

    @classmethod
    def load(cls, path: Path = SWEEP) -> Sweep:
        from goodput import DEFAULT_NUM_PROMPTS

        data = json.loads(path.read_text())
        config = data["config"]
        unloaded, recorded, decisions = {}, {}, {}
        for preset, result in data["presets"].items():
            for name, by_rate in result.get("ttft_phases", {}).items():
                for rate, phases in by_rate.items():
                    counts = {k: int(v) for k, v in phases.get("decisions", {}).items()}
                    decisions[(preset, name, float(rate))] = counts
            for name, u in result["unloaded"].items():
                unloaded[(preset, name)] = (u["p50_ttft_ms"], u["p50_tpot_ms"])
            for name, rows in result["rows"].items():
                for rate, row in rows.items():
                    values = tuple(row[SWEEP_KEYS[m]] for m in METRICS)
                    recorded[(preset, name, float(rate))] = values
        return cls(
            config["input_scale"],
            config["output_scale"],
            config.get("num_prompts_by_preset")
            or {p: config["num_prompts"] or DEFAULT_NUM_PROMPTS[p] for p in data["presets"]},
            {p: r["slos_ms"] for p, r in data["presets"].items()},
            unloaded,
            recorded,
            decisions,
        )

    @classmethod
    def mean(cls, sweeps: list[Sweep], median: bool = False) -> Sweep:
        """The row-by-row mean of sweeps of one workload judged by the same SLOs (goodput.py
        ``--slos-from``): each row's own noise divided by about the root of their number. With
        ``median``, the row-by-row median: one run whose deployment started slow moves it
        less (docs/simulator.md). The routing decisions are the first sweep's."""
        first = sweeps[0]
        for other in sweeps[1:]:
            same = (other.input_scale, other.output_scale, other.num_prompts, other.slos)
            if same != (first.input_scale, first.output_scale, first.num_prompts, first.slos):
                raise SystemExit("the sweeps differ in workload or SLOs: run with --slos-from")
        average = statistics.median if median else statistics.fmean
        tables = [{k: tuple(v) for k, v in s.unloaded.items()} for s in sweeps]
        unloaded = _row_averages(tables, average)
        return replace(
            first,
            unloaded={k: (ttft, tpot) for k, (ttft, tpot) in unloaded.items()},
            recorded=_row_averages([s.recorded for s in sweeps], average),
        )


def _row_averages(
    tables: list[dict[Key, tuple[float, ...]]],
    average: Callable[[list[float]], float] = statistics.fmean,
) -> dict[Key, tuple[float, ...]]:
    """Per key every table has, the average of each figure."""
    keys = [k for k in tables[0] if all(k in t for t in tables)]
    return {k: tuple(average(list(v)) for v in zip(*(t[k] for t in tables))) for k in keys}


# The sweeps were recorded before decode workers capped their steps' prompt tokens and the
# router's --decode-busy-sequences fell from 32 to 16 (2026-11-28).
RECORDED_PD = Layout(
    num_prefill=1, num_decode=1, decode_busy_sequences=32, decode_prompt_tokens=None
)
CONFIGS = {
    "disagg": (replace(RECORDED_PD, disaggregation="always"), 1),
    "disagg-cond": (RECORDED_PD, 1),
    "2xcoloc": (Layout(num_colocated=2), 1),
    "1xcoloc": (Layout(num_colocated=1), 2),  # --threads 2 --max-num-batched-tokens 256
}


def scaled_curve(curve: ThreadProfile, prefill: float, decode: float) -> ThreadProfile:
    """Both curves scaled (the measured curves' points are not a base plus a per-sequence part
    to add to: an added extra made their loaded TPOT worse, 44% -> 68% median error)."""
    points = [replace(p, seconds=p.seconds * decode) for p in curve.decode]
    seconds = [s * prefill for s in curve.prefill_seconds]
    return ThreadProfile(curve.num_threads, curve.prefill_tokens, seconds, points)


def scaled_linear(
    profile: SimulationProfile, prefill: float, decode: float, one_step_s: float | None = None
) -> SimulationProfile:
    """Prompt terms x ``prefill``; a one-sequence step's extra at x ``decode`` added to the base
    (``one_step_s``: that step's seconds at no context, the line's when not given)."""
    s = profile.step
    one = s.base_s + s.decode_seq_s if one_step_s is None else one_step_s
    step = StepTimeModel(
        base_s=s.base_s + (decode - 1) * one,
        prefill_token_s=s.prefill_token_s * prefill,
        prefill_pair_s=s.prefill_pair_s * prefill,
        decode_seq_s=s.decode_seq_s,
        decode_context_s=s.decode_context_s,
    )
    return replace(profile, step=step)


@dataclass(frozen=True)
class Profiles:
    """The step times: ``curves`` (a measured WorkerProfile) or ``linear`` (per thread count, a
    simulated worker's profile)."""

    kind: str
    curves: WorkerProfile
    linear: dict[int, SimulationProfile]
    padded_prefill: bool = (
        True  # the engine's padded prefill attention (pdserve.sim.padded_prefill)
    )
    # per thread count, the measured decode steps the linear profile misses
    # (pdserve.sim.decode_residual); empty: the lines as they are
    residuals: dict[int, DecodeResiduals] = field(default_factory=dict)
    corun: CoRun = CoRun()  # the sweep's workers share one host (pdserve.sim.corun)
    # per worker thread count: the router and clients share it too (pdserve.sim.host_work)
    host_work: dict[int, HostWork] = field(default_factory=dict)
    # The recorded sweep ran before the engine padded prefill per group of similar lengths
    # (kernels.reference.length_groups): all of a step's prompts in one call. A sweep since: True.
    grouped_prefill: bool = False

    @classmethod
    def load(
        cls,
        kind: str,
        linear_specs: tuple[str, str] = (LINEAR[1], LINEAR[2]),
        padded_prefill: bool = True,
        decode_points: Path | None = MEASURED,
        corun: Path | None = CORUN,
        host_work: Path | None = HOST_WORK,
    ) -> Profiles:
        linear = {1: load_profile(linear_specs[0]), 2: load_profile(linear_specs[1])}
        residuals = {}
        if decode_points is not None:
            measured = WorkerProfile.load(decode_points)
            residuals = {
                t: DecodeResiduals.of(measured.for_threads(t).decode, profile.step)
                for t, profile in linear.items()
            }
        return cls(
            kind,
            WorkerProfile.load(PROFILE),
            linear,
            padded_prefill,
            residuals,
            CoRun() if corun is None else CoRun.load(corun, by_prompt_tokens=True),
            {} if host_work is None else {t: HostWork.load(host_work, t) for t in linear},
        )


def timing(profiles: Profiles, config: str, scales: dict[int, tuple[float, float]]) -> WorkerTiming:
    threads = CONFIGS[config][1]
    a, b = scales.get(threads, (1.0, 1.0))
    budget = 256 if config == "1xcoloc" else None
    if profiles.kind == "linear":
        line = profiles.linear[threads].step
        residuals = profiles.residuals.get(threads)
        one = None  # a one-sequence step at no context: measured, where the points are given
        if residuals is not None:
            one = line.base_s + line.decode_seq_s + residuals.at(1, 0)
        linear = scaled_linear(profiles.linear[threads], a, b, one)
        worker = timing_from_simulation_profile(linear, max_num_batched_tokens=budget or 2048)
        if profiles.padded_prefill:
            worker = with_padded_prefill(worker, grouped=profiles.grouped_prefill)
        return worker if residuals is None else with_decode_residuals(worker, residuals)
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
    ttft_p90: float
    tpot_p50: float
    decisions: dict[str, int] = field(default_factory=dict)


Scales = dict[int, tuple[float, float]]  # threads -> (prefill x, decode x)


@dataclass(frozen=True)
class Calibration:
    """What the unloaded rows measure: per thread count the profile's prefill and decode scale,
    and the per-request cost outside the steps (``pdserve.sim.overheads``)."""

    scales: Scales = field(default_factory=dict)
    overheads: Overheads = Overheads()


RAW = Calibration()


def run(profiles: Profiles, sweep: Sweep, key: tuple[str, str, float], cal: Calibration) -> Row:
    preset, config, rate = key
    samples = preset_workload(
        preset, sweep.num_prompts[preset], sweep.input_scale, sweep.output_scale, 0
    )
    trace = trace_from_samples(samples, Schedule(rate=rate), seed=0)
    layout, worker = CONFIGS[config][0], timing(profiles, config, cal.scales)
    host_work = profiles.host_work.get(CONFIGS[config][1])
    result = simulate(
        trace, layout, worker, overheads=cal.overheads, corun=profiles.corun, host_work=host_work
    )
    m = metrics_of(trace, result, sweep.slos[preset])
    s = m.stats
    return Row(
        preset,
        config,
        rate,
        m.request_goodput or 0.0,
        s["median_ttft_ms"] or 0.0,
        s["p90_ttft_ms"] or 0.0,
        s["median_tpot_ms"] or 0.0,
        result.decisions,
    )


def unloaded(
    profiles: Profiles, sweep: Sweep, preset: str, config: str, scales: Scales
) -> tuple[float, float]:
    """The sweep's baseline: 3 requests (seed 1, each kind of mixed) one at a time."""
    samples = preset_workload(preset, 3, sweep.input_scale, sweep.output_scale, 1, even=True)
    trace = trace_from_samples(samples, Schedule(rate=1e-3, burstiness=float("inf")), seed=1)
    worker = timing(profiles, config, scales)
    m = metrics_of(trace, simulate(trace, CONFIGS[config][0], worker, corun=profiles.corun))
    return m.stats["median_ttft_ms"] or 0.0, m.stats["median_tpot_ms"] or 0.0


def calibrate(profiles: Profiles, sweep: Sweep) -> Calibration:
    """From the unloaded rows only. Decode: per thread count, the median measured/simulated
    TPOT. Then every unloaded TTFT is ``hop + base + prefill x P`` (``base``, ``P``: the
    simulated step's fixed and prompt parts, the decode scale applied): one least-squares fit
    gives the hop (shared: the router and HTTP do not depend on the worker's threads) and a
    prefill scale per thread count."""
    ratios: dict[int, list[float]] = {}
    for (preset, config), (_, tpot) in sweep.unloaded.items():
        _, sim_tpot = unloaded(profiles, sweep, preset, config, {})
        ratios.setdefault(CONFIGS[config][1], []).append(tpot / sim_tpot)
    decode = {t: statistics.median(rs) for t, rs in ratios.items()}
    threads = sorted(decode)
    rows, targets = [], []
    for (preset, config), (ttft, _) in sweep.unloaded.items():
        t = CONFIGS[config][1]
        full, half = (
            unloaded(profiles, sweep, preset, config, {t: (p, decode[t])})[0] for p in (1.0, 0.5)
        )
        prompt = 2 * (full - half)  # the step's prompt part, linear in the prefill scale
        rows.append([1.0] + [prompt if t == u else 0.0 for u in threads])
        targets.append(ttft - (full - prompt))
    a, b = np.array(rows), np.array(targets)
    solution = np.linalg.lstsq(a, b, rcond=None)[0]
    if solution[0] < 0:  # no time can be negative: the best fit with the hop at zero instead
        solution = np.concatenate([[0.0], np.linalg.lstsq(a[:, 1:], b, rcond=None)[0]])
    hop_ms = float(solution[0])
    scales = {t: (float(solution[1 + i]), decode[t]) for i, t in enumerate(threads)}
    return Calibration(scales, Overheads(request_s=hop_ms / 1000))


def error(predicted: float, measured: float) -> str:
    return f"{(predicted - measured) / measured * 100:+.0f}%" if measured else "-"


Compared = list[tuple[tuple[str, str, float], tuple[float, ...], Row, Row]]


def calibrate_per_deployment(profiles: Profiles, sweep: Sweep) -> dict[str, Calibration]:
    """One calibration per configuration, from its own unloaded rows only. ``goodput.py``
    starts each configuration's workers once and runs every preset on them, and on this VM a
    process's speed varies from one start to the next (the same 3 unloaded chatbot requests on
    1P+1D: TTFT p50 107-159 ms over 11 starts): each deployment's unloaded rows measure its
    own processes."""
    configs = sorted({config for _, config in sweep.unloaded})
    return {
        config: calibrate(
            profiles,
            dataclasses.replace(
                sweep, unloaded={k: v for k, v in sweep.unloaded.items() if k[1] == config}
            ),
        )
        for config in configs
    }


def compare(
    profiles: Profiles, sweep: Sweep, cal: Calibration | dict[str, Calibration]
) -> Compared:
    """Per recorded row: its key, the recorded figures, the raw and the calibrated prediction
    (``cal``: one calibration, or one per configuration)."""
    return [
        (
            key,
            recorded,
            run(profiles, sweep, key, RAW),
            run(profiles, sweep, key, cal[key[1]] if isinstance(cal, dict) else cal),
        )
        for key, recorded in sweep.recorded.items()
    ]


def relative_errors(rows: Compared) -> dict[str, list[float]]:
    """``"<metric> raw|cal"`` -> the |relative error| of each row."""
    errors: dict[str, list[float]] = {}
    for _, recorded, raw, cal in rows:
        for k, name in enumerate(METRICS):
            for kind, row in (("raw", raw), ("cal", cal)):
                errors.setdefault(f"{name} {kind}", []).append(
                    abs(getattr(row, name) - recorded[k]) / recorded[k] if recorded[k] else 0.0
                )
    return errors


BAR = 0.15  # #32's bar: a figure within 15% of the measured one


def share_within(errors: list[float]) -> float:
    """The share of rows whose |relative error| is within the bar."""
    return sum(e <= BAR for e in errors) / len(errors)


def repeatability(first: Sweep, second: Sweep) -> dict[str, list[float]]:
    """The measurement against itself: per row both sweeps have, ``|second - first| / first`` of
    each figure, the same measure as a prediction's error. A model cannot be held closer to
    one run than a second run of the same sweep comes."""
    errors: dict[str, list[float]] = {name: [] for name in METRICS}
    for key, a in first.recorded.items():
        b = second.recorded.get(key)
        if b is None:
            continue
        for name, x, y in zip(METRICS, a, b):
            errors[name].append(abs(y - x) / x if x else 0.0)
    return errors


def held_out(sweeps: list[Sweep]) -> list[dict[str, list[float]]]:
    """With three or more runs of a sweep: each run scored as a prediction of the mean of the
    others, as ``repeatability`` scores a second run against a first."""
    return [
        repeatability(Sweep.mean(sweeps[:i] + sweeps[i + 1 :]), sweep)
        for i, sweep in enumerate(sweeps)
    ]


def print_repeatability(paths: list[Path], sweeps: list[Sweep]) -> None:
    if len(sweeps) == 2:
        print(f"the measurement against itself: {paths[1].name} as a prediction of {paths[0].name}")
        scored = [(paths[1].name, repeatability(sweeps[0], sweeps[1]))]
    else:
        print("the measurement against itself: each run as a prediction of the others' mean")
        scored = [(path.name, errors) for path, errors in zip(paths, held_out(sweeps))]
    for label, errors in scored:
        if len(scored) > 1:
            print(f"  {label}")
        for name, values in errors.items():
            if values:
                within = share_within(values)
                median = statistics.median(values) * 100
                print(
                    f"  {name:14s} {median:5.1f}%   within 15%: {within:.0%} ({len(values)} rows)"
                )


def print_table(rows: Compared, markdown: bool) -> None:
    head = "| preset | config | rate | goodput rec / raw / cal | TTFT p50 | TTFT p90 | TPOT p50 |"
    print(head if markdown else head.replace("|", " "))
    if markdown:
        print("|---|---|---|---|---|---|---|")
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
        print(line if markdown else line.replace("|", " "))


def print_decisions(rows: Compared, sweep: Sweep) -> None:
    """Where the router computed each prompt (``local:short``, ``remote:long``, ...), in the
    calibrated run against the router's own counts in the sweep."""
    print("disaggregation decisions, simulated (calibrated) / recorded:")
    for key, _, _, cal in rows:
        recorded = sweep.decisions.get(key, {})
        if not cal.decisions and not recorded:
            continue
        names = sorted(set(cal.decisions) | set(recorded))
        cells = [f"{n} {cal.decisions.get(n, 0)}/{recorded.get(n, 0)}" for n in names]
        print(f"  {key[0]} {key[1]} {key[2]:g}: " + ", ".join(cells))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=(__doc__ or "").split("\n\n")[0])
    parser.add_argument("--markdown", action="store_true", help="print the docs' table")
    parser.add_argument("--profile", choices=("linear", "curves"), default="linear")
    parser.add_argument(
        "--sweep",
        type=Path,
        nargs="+",
        default=[SWEEP],
        help="goodput.py's JSON; several: their rows' mean (same workload and SLOs)",
    )
    parser.add_argument(
        "--linear",
        nargs=2,
        default=(LINEAR[1], LINEAR[2]),
        metavar=("ONE_THREAD", "TWO_THREADS"),
        help="the linear profiles (a name in benchmarks/profiles or a file) of 1 and 2 threads",
    )
    parser.add_argument(
        "--no-padded-prefill",
        action="store_true",
        help="time every prefill as the profiles' causal path (pdserve.sim.padded_prefill)",
    )
    parser.add_argument(
        "--grouped-prefill",
        action="store_true",
        help="pad prefill attention per group of similar lengths, as the engine has since the "
        "recorded sweep (kernels.reference.length_groups): for a sweep recorded since",
    )
    parser.add_argument(
        "--decode-points",
        type=Path,
        default=MEASURED,
        help="the measured profile the linear ones were fitted to: its decode steps correct "
        "theirs (pdserve.sim.decode_residual)",
    )
    parser.add_argument(
        "--decisions",
        action="store_true",
        help="also print each disaggregated row's routing decisions, simulated and recorded",
    )
    parser.add_argument(
        "--no-decode-residuals",
        action="store_true",
        help="time decode steps as the linear profiles' lines alone",
    )
    parser.add_argument(
        "--corun",
        type=Path,
        default=CORUN,
        help="co-run factors (benchmarks/corun_slowdown.py) for steps beside a busy worker",
    )
    parser.add_argument(
        "--no-corun", action="store_true", help="time every step as if the other core were idle"
    )
    parser.add_argument(
        "--corun-one-prompt-factor",
        action="store_true",
        help="every prompt step beside a decoding neighbour: the --corun file's median over its "
        "prompt sizes, not its ratio at the step's size (pdserve.sim.corun)",
    )
    parser.add_argument(
        "--host-work",
        type=Path,
        default=HOST_WORK,
        help="steps lengthened by each arrival and finish on the host (benchmarks/host_work.py)",
    )
    parser.add_argument(
        "--no-host-work",
        action="store_true",
        help="the router and clients take nothing from the steps",
    )
    parser.add_argument(
        "--row-median",
        action="store_true",
        help="with three sweeps or more: each row's median over them, not its mean",
    )
    parser.add_argument(
        "--repeatability",
        action="store_true",
        help="with two sweeps: also the second's rows against the first's, as a prediction "
        "(how close a second run of the sweep comes); with more, each against the others' mean",
    )
    parser.add_argument(
        "--per-deployment",
        action="store_true",
        help="calibrate each configuration on its own unloaded rows (its own worker processes)",
    )
    args = parser.parse_args(argv)
    started = time.perf_counter()
    linear = tuple(args.linear)
    points = None if args.no_decode_residuals else args.decode_points
    corun = None if args.no_corun else args.corun
    host_work = None if args.no_host_work else args.host_work
    profiles = Profiles.load(
        args.profile,
        linear,  # type: ignore[arg-type]
        not args.no_padded_prefill,
        points,
        corun,
        host_work,
    )
    profiles = replace(profiles, grouped_prefill=args.grouped_prefill)
    if args.corun_one_prompt_factor and corun is not None:
        profiles = replace(profiles, corun=CoRun.load(corun))
    sweeps = [Sweep.load(path) for path in args.sweep]
    if args.repeatability and len(sweeps) < 2:
        parser.error("--repeatability compares runs of a sweep: give --sweep FIRST SECOND ...")
    sweep = Sweep.mean(sweeps, median=args.row_median)
    cal: Calibration | dict[str, Calibration]
    if args.per_deployment:
        cal = calibrate_per_deployment(profiles, sweep)
        print("calibration per deployment (prefill x, decode x; per request outside the steps),")
        print("each from its own unloaded rows only:")
        for config, c in cal.items():
            (a, b), hop = next(iter(c.scales.values())), c.overheads.request_s * 1000
            print(f"  {config:12s} prefill x{a:.2f}, decode x{b:.2f}, {hop:.0f} ms")
    else:
        cal = calibrate(profiles, sweep)
        print("calibration (prefill x, decode x) per thread count, from the unloaded rows only:")
        for threads, (a, b) in sorted(cal.scales.items()):
            print(f"  {threads} thread(s): prefill x{a:.2f}, decode x{b:.2f}")
        print(f"  per request outside the steps: {cal.overheads.request_s * 1000:.0f} ms")
    print(f"co-run factors (a step beside a busy worker): {profiles.corun}")
    print(f"host work per worker thread count (per arrival / finish): {profiles.host_work}")
    rows = compare(profiles, sweep, cal)
    print_table(rows, args.markdown)
    if args.decisions:
        print_decisions(rows, sweep)
    print("median |error| over the rows (and the share of rows within 15%):")
    for name, values in relative_errors(rows).items():
        within = share_within(values)
        print(f"  {name:14s} {statistics.median(values) * 100:5.1f}%   within 15%: {within:.0%}")
    print("calibrated, per configuration: median |error| (share within 15%)")
    for config in CONFIGS:
        of_config = [row for row in rows if row[0][1] == config]
        if not of_config:  # a sweep of some configurations only
            continue
        errors = relative_errors(of_config)
        cells = [
            f"{m} {statistics.median(v) * 100:.0f}% ({share_within(v):.0%})"
            for m in METRICS
            for v in [errors[f"{m} cal"]]
        ]
        print(f"  {config:12s} " + "  ".join(cells))
    if args.repeatability:
        print_repeatability(args.sweep, sweeps)
    print(f"simulated in {time.perf_counter() - started:.1f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
