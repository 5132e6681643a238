"""Goodput of four ways to spend the same 2 cores: disaggregated (always, or per request), two
colocated, one colocated.

The same workload (the loadtest's presets, Poisson arrivals at each rate of a sweep, streamed
completions with ``ignore_eos`` so output lengths are exact) is sent through the real router
(``pdserve router``, a real Redis registry) to each of:

- ``disagg``: 1 prefill + 1 decode worker, pinned to core 0 and core 1, ``--threads 1`` each,
  KV moved over loopback tcp and streamed while the prompt computes; every prompt goes through
  the prefill worker (``--disaggregation always``);
- ``disagg-cond``: the same workers, the router deciding per request (``--disaggregation
  conditional``, the default): short or mostly cached prompts are computed on the decode worker;
- ``2xcoloc``: two colocated workers, one per core, ``--threads 1`` each;
- ``1xcoloc``: one colocated worker on both cores, ``--threads 2``, chunked prefill with a
  256-token step budget (prefill chunks ride along with the decode steps);
- ``disagg-whole`` (not run by default): ``disagg`` with the KV pulled once the prefill is done.

The router, Redis and this client are not pinned: they share the two cores with the workers,
alike for every configuration. Workers start once per configuration and serve every preset and
rate. Preset input/output lengths are scaled by ``--input-scale``/``--output-scale`` (the
presets' ISL 2000-4000 would take seconds of prefill each on this CPU).

Before the sweep, each configuration serves ``--baseline-prompts`` requests one at a time: its
unloaded latencies. SLOs (unless given): TTFT 5x, TPOT 3x the best configuration's unloaded
mean, and each request's own ITL p99 at most 3x the best unloaded ITL p99 (a stall bound: users
feel stalls, not means). Measured per configuration, preset and rate: goodput (req/s completed
within all three SLOs), SLO attainment (good / sent), TTFT/TPOT/ITL p50/p99, output tokens/s;
per configuration and preset, the max rate under SLO (attainment >= 0.9, interpolated between
the swept rates). Then, per configuration, the interference experiment of
``benchmarks/interference.py``: ITL of running streams while 1024-token prompts arrive.

    python benchmarks/goodput.py [--quick] [--presets chatbot mixed] [--rates 0.5,1,2]
        [--num-prompts 30] [--configs disagg disagg-cond 2xcoloc 1xcoloc] [--no-interference]

Prints the command, the machine, the SLOs and a table per preset; writes goodput.json,
goodput.png (goodput, TTFT p99, TPOT p99 and ITL p99 vs rate) and interference.png to
--out-dir (default benchmarks/results/). The default (four configurations, three presets) takes
about 40 minutes.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import pickle
import secrets
import shlex
import sys
import time
import uuid
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
import numpy as np
from tqdm import tqdm

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks"))

import interference  # noqa: E402  (benchmarks/interference.py)
import ttft_phases  # noqa: E402  (benchmarks/ttft_phases.py)
from machine import describe_read_scaling, machine_info  # noqa: E402  (benchmarks/machine.py)

from loadtest.arrivals import Schedule  # noqa: E402
from loadtest.client import ClientConfig, RunOutput, run  # noqa: E402
from loadtest.datasets import MIXED, PRESETS, Sample, random_samples  # noqa: E402
from loadtest.metrics import Metrics, compute  # noqa: E402
from services.worker.launcher import WorkerProcess  # noqa: E402

MODEL = "SmolLM2-135M-Instruct"
# name -> workers as (role, cores, torch threads)
PAIR = [("prefill", {0}, 1), ("decode", {1}, 1)]
CONFIGS: dict[str, list[tuple[str, set[int], int]]] = {
    "disagg": PAIR,
    "disagg-cond": PAIR,
    "2xcoloc": [("colocated", {0}, 1), ("colocated", {1}, 1)],
    "1xcoloc": [("colocated", {0, 1}, 2)],
    "disagg-whole": PAIR,
}
DEFAULT_CONFIGS = ["disagg", "disagg-cond", "2xcoloc", "1xcoloc"]
ROUTER_FLAGS = {
    "disagg": ["--disaggregation", "always"],
    "disagg-cond": ["--disaggregation", "conditional"],
    "disagg-whole": ["--disaggregation", "always", "--no-stream-kv"],
}
# (c) is the chunked-prefill configuration: a 256-token budget per step splits a long prompt
# over several steps, so running streams still get a token per step (the default budget, 2048,
# would take most prompts whole and stall every stream for the length of the prefill).
CONFIG_FLAGS = {"1xcoloc": ["--max-num-batched-tokens", "256"]}
DEFAULT_RATES = {
    "chatbot": [1.0, 2.0, 4.0],
    "mixed": [0.25, 0.5, 0.75],
    "summarization": [0.125, 0.25],
    "codegen": [0.25, 0.5, 1.0],
}
# Requests per rate: fewer for the long presets keeps one invocation of all three under 30 min.
DEFAULT_NUM_PROMPTS = {"chatbot": 24, "mixed": 16, "summarization": 10, "codegen": 16}
PERCENTILES = (50.0, 90.0, 99.0)  # of TTFT, TPOT and ITL in every row
ATTAINMENT_TARGET = 0.9  # "under SLO": at least this share of requests meets both SLOs
# Prefix caching off: every rate resends the same prompts, which would otherwise skip prefill.
WORKER_FLAGS = ["--heartbeat-seconds", "0.5", "--ttl-seconds", "2", "--kv-transport", "tcp"]
WORKER_FLAGS += ["--no-prefix-caching"]
TTFT_FACTOR, TPOT_FACTOR, ITL_FACTOR = 5.0, 3.0, 3.0

# -- the workload -------------------------------------------------------------------------------


def scaled(lo: int, hi: int, scale: float) -> tuple[int, int]:
    return max(1, round(lo * scale)), max(1, round(hi * scale))


def preset_workload(
    name: str, n: int, input_scale: float, output_scale: float, seed: int, even: bool = False
) -> list[Sample]:
    """``n`` requests of a preset (or ``mixed``) with its lengths scaled, reproducibly; with
    ``even``, ``mixed`` takes its kinds in turn (a baseline that holds each of them)."""
    rng = np.random.default_rng(seed)
    kinds = [name] * n
    if name == "mixed":
        picks = range(n) if even else rng.choice(len(MIXED), size=n)
        kinds = [MIXED[k % len(MIXED)] for k in picks]
    out = []
    for kind in kinds:
        (ilo, ihi), (olo, ohi) = PRESETS[kind]
        ilo, ihi = scaled(ilo, ihi, input_scale)
        olo, ohi = scaled(olo, ohi, output_scale)
        ins = rng.integers(ilo, ihi + 1, size=1)
        outs = rng.integers(max(olo, 2), max(ohi, 2) + 1, size=1)
        out += random_samples(1, ins, outs, rng, kind=kind)
    return out


# -- the processes ------------------------------------------------------------------------------


# Every process of one benchmark run shares a cluster token, as in production (the internal plane
# refuses to start open).
PROCESS_ENV = {"PYTHONPATH": str(ROOT), "PDSERVE_CLUSTER_TOKEN": secrets.token_hex(16)}


def pinned_worker(role: str, args: list[str], cores: set[int]) -> WorkerProcess:
    """``pdserve <role>`` whose process (and so every thread it starts) runs on ``cores``."""
    return WorkerProcess(role, args, env=PROCESS_ENV, cpus=cores)


@dataclass
class Deployment:
    """One configuration's workers and router, registered under their own Redis prefix."""

    name: str
    url: str = ""
    processes: list[WorkerProcess] = field(default_factory=list)


def wait_workers(url: str, count: int, timeout: float = 60.0) -> None:
    """Until the router is ready and sees ``count`` healthy workers."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            if httpx.get(url + "/ready", timeout=5).status_code == 200:
                data = httpx.get(url + "/v1/workers", timeout=5).json()["data"]
                if sum(1 for w in data if w["healthy"]) == count:
                    return
        except httpx.HTTPError:
            pass
        time.sleep(0.2)
    raise TimeoutError(f"router at {url} did not see {count} healthy workers")


@contextmanager
def deployed(
    name: str, redis_url: str, router_extra: list[str], worker_extra: Sequence[str] = ()
) -> Iterator[Deployment]:
    """Start the workers of configuration ``name`` and a router (with ``router_extra`` flags,
    and ``worker_extra`` for every worker); stop them all afterwards."""
    prefix = f"goodput{uuid.uuid4().hex[:6]}:"
    registry = ["--redis-url", redis_url, "--redis-prefix", prefix]
    deployment = Deployment(name)
    try:
        workers = [
            pinned_worker(
                role,
                [*WORKER_FLAGS, *CONFIG_FLAGS.get(name, []), "--threads", str(threads)]
                + [*worker_extra, *registry],
                cores,
            )
            for role, cores, threads in CONFIGS[name]
        ]
        for w in workers:
            w.spawn()
            deployment.processes.append(w)
        for w in workers:
            w.wait_ready()
        flags = [*ROUTER_FLAGS.get(name, []), *router_extra]
        router_args = ["--port", "0", "--ttl-seconds", "2", *flags, *registry]
        router = WorkerProcess("router", router_args, PROCESS_ENV)
        deployment.processes.append(router)
        router.start()
        deployment.url = str(router.info["url"])
        wait_workers(deployment.url, len(workers))
        yield deployment
    except BaseException:
        for p in deployment.processes:
            print(f"--- {p.role} ---\n{p.output_tail()}", file=sys.stderr)
        raise
    finally:
        for p in reversed(deployment.processes):
            p.terminate(timeout=15)


# -- the runs -----------------------------------------------------------------------------------


def client_config(url: str, max_concurrency: int | None = None) -> ClientConfig:
    return ClientConfig(
        base_url=url,
        model=MODEL,
        ignore_eos=True,
        max_concurrency=max_concurrency,
        request_timeout=300.0,
        disable_tqdm=True,
    )


def baseline(url: str, samples: list[Sample]) -> RunOutput:
    """``samples`` one at a time (after one untimed request): the unloaded latencies."""
    cfg = client_config(url, max_concurrency=1)
    cfg.num_warmups = 1
    return asyncio.run(run(cfg, samples, Schedule(rate=math.inf), len(samples)))


def at_rate(url: str, samples: list[Sample], rate: float, seed: int) -> RunOutput:
    """``samples`` sent with Poisson arrivals at ``rate`` req/s (same seed: same gaps)."""
    return asyncio.run(
        run(client_config(url), samples, Schedule(rate=rate), len(samples), seed=seed)
    )


@dataclass
class Plan:
    """What to run: configurations, presets with their rates, the samples of each preset."""

    configs: list[str]
    rates: dict[str, list[float]]
    samples: dict[str, list[Sample]]
    base_samples: dict[str, list[Sample]]
    seed: int
    interference: bool = True
    router_args: list[str] = field(default_factory=list)  # for every configuration's router

    @property
    def num_runs(self) -> int:
        per_config = sum(len(r) + 1 for r in self.rates.values()) + int(self.interference)
        return len(self.configs) * per_config


def save_partial(out: dict[str, Any], path: Path = Path("/tmp/goodput_partial.pickle")) -> None:
    """The raw runs so far (a crash late in a long run loses nothing measured)."""
    path.write_bytes(pickle.dumps(out))


Phases = dict[str, dict[str, dict[str, dict[str, Any]]]]  # [config][preset][rate]


def measure(
    plan: Plan,
) -> tuple[
    dict[str, dict[str, dict[str, RunOutput]]], dict[str, interference.InterferenceResult], Phases
]:
    """out[config][preset]["base" or rate] = the run's output, every configuration in turn; each
    configuration's interference experiment; and where each rate's TTFT went (the router's
    phase histograms, KV sources and disaggregation decisions during that run)."""
    from services.redis_server import RedisServer

    out: dict[str, dict[str, dict[str, RunOutput]]] = {}
    phases: Phases = {}
    hol: dict[str, interference.InterferenceResult] = {}
    bar = tqdm(total=plan.num_runs, unit="run", dynamic_ncols=True, file=sys.stderr)
    with RedisServer() as redis:
        for name in plan.configs:
            bar.set_description(f"{name}: starting")
            with deployed(name, redis.url, plan.router_args) as d:
                out[name], phases[name] = {}, {}
                for preset, rates in plan.rates.items():
                    bar.set_description(f"{name} {preset} baseline")
                    runs = {"base": baseline(d.url, plan.base_samples[preset])}
                    bar.update(1)
                    phases[name][preset] = {}
                    for rate in rates:
                        bar.set_description(f"{name} {preset} {rate:g} req/s")
                        before = ttft_phases.scrape(d.url)
                        runs[f"{rate:g}"] = at_rate(d.url, plan.samples[preset], rate, plan.seed)
                        after = ttft_phases.scrape(d.url)
                        phases[name][preset][f"{rate:g}"] = ttft_phases.difference(before, after)
                        bar.update(1)
                    out[name][preset] = runs
                if plan.interference:
                    bar.set_description(f"{name} interference")
                    hol[name] = asyncio.run(interference.measure(d.url))
                    bar.update(1)
            save_partial(out)
    bar.close()
    return out, hol, phases


# -- the results --------------------------------------------------------------------------------


def slos_for(
    runs: dict[str, dict[str, RunOutput]], args: argparse.Namespace, preset: str
) -> dict[str, float]:
    """TTFT/TPOT/ITL-p99 limits in ms: given, a recorded sweep's for ``preset`` (``--slos-from``:
    two sweeps judged by the same limits can be compared row by row), or a multiple of the
    best configuration's unloaded figure (mean TTFT, mean TPOT, p99 ITL)."""
    if args.slos_from is not None:
        recorded = json.loads(args.slos_from.read_text())["presets"]
        if preset not in recorded:
            raise SystemExit(f"{args.slos_from} has no {preset} preset to take the SLOs of")
        return dict(recorded[preset]["slos_ms"])
    unloaded = {
        name: compute(by_key["base"], percentiles=(99.0,)).stats for name, by_key in runs.items()
    }

    def best(key: str) -> float:
        values = [s[key] for s in unloaded.values()]
        known = [v for v in values if v is not None]
        if len(known) < len(values):  # an unloaded run that served nothing
            raise SystemExit(f"no {key} in an unloaded run: see its errors above")
        return min(known)

    ttft = best("mean_ttft_ms") * TTFT_FACTOR
    tpot = best("mean_tpot_ms") * TPOT_FACTOR
    itl = best("p99_itl_ms") * ITL_FACTOR
    return {
        "ttft": args.slo_ttft_ms or round(ttft, 1),
        "tpot": args.slo_tpot_ms or round(tpot, 1),
        "itl_p99": args.slo_itl_p99_ms or round(itl, 1),
    }


def max_rate_under_slo(rows: dict[str, dict[str, float | None]]) -> tuple[float, str]:
    """The highest rate whose attainment stays >= ATTAINMENT_TARGET, linearly interpolated
    between the last passing and the first failing swept rate; with how it was bounded."""
    points = sorted((float(rate), row["attainment"] or 0.0) for rate, row in rows.items())
    last_rate, last_att = 0.0, 1.0  # an idle system meets its SLOs (they are multiples of it)
    for rate, att in points:
        if att < ATTAINMENT_TARGET:
            share = (last_att - ATTAINMENT_TARGET) / (last_att - att)
            estimate = last_rate + share * (rate - last_rate)
            return round(estimate, 3), "below the lowest rate" if last_rate == 0 else "interpolated"
        last_rate, last_att = rate, att
    return last_rate, "at least (every swept rate met it)"


def row_of(m: Metrics) -> dict[str, float | None]:
    s = m.stats
    return {
        "goodput": m.request_goodput or 0.0,
        "attainment": m.slo_attainment or 0.0,
        "req_per_s": m.request_throughput,
        "out_tok_per_s": m.output_throughput,
        "failed": m.failed,
        **{
            f"{q}_{k}_ms": s[f"{'median' if q == 'p50' else q}_{k}_ms"]
            for k in ("ttft", "tpot", "itl")
            for q in ("p50", "p90", "p99")
        },
    }


def summarize(
    out: dict[str, dict[str, dict[str, RunOutput]]],
    plan: Plan,
    args: argparse.Namespace,
    phases: Phases,
) -> dict[str, Any]:
    """Per preset: the SLOs, each configuration's unloaded latencies, a row per rate and where
    each rate's TTFT went."""
    summary: dict[str, Any] = {}
    for preset, rates in plan.rates.items():
        runs = {name: out[name][preset] for name in out}
        slos = slos_for(runs, args, preset)
        unloaded = {
            name: {k: r[k] for k in ("p50_ttft_ms", "p50_tpot_ms")}
            for name, r in (
                (n, row_of(compute(by["base"], None, PERCENTILES))) for n, by in runs.items()
            )
        }
        table = {
            name: {
                f"{rate:g}": row_of(compute(by[f"{rate:g}"], slos, PERCENTILES)) for rate in rates
            }
            for name, by in runs.items()
        }
        max_rates = {name: max_rate_under_slo(rows) for name, rows in table.items()}
        summary[preset] = {
            "slos_ms": slos,
            "unloaded": unloaded,
            "rows": table,
            "max_rate_under_slo": {n: {"rate": r, "how": how} for n, (r, how) in max_rates.items()},
            "ttft_phases": {name: phases[name][preset] for name in runs},
        }
    return summary


def print_preset(preset: str, result: dict[str, Any]) -> None:
    slos = result["slos_ms"]
    print(
        f"\n{preset}: SLOs TTFT <= {slos['ttft']:.0f} ms, TPOT <= {slos['tpot']:.1f} ms, "
        f"each request's ITL p99 <= {slos['itl_p99']:.0f} ms"
    )
    for name, u in result["unloaded"].items():
        print(
            f"  unloaded {name:<8} TTFT p50 {u['p50_ttft_ms']:7.1f} ms"
            f"  TPOT p50 {u['p50_tpot_ms']:6.1f} ms"
        )
    head = f"{'config':<9}{'rate':>6}{'goodput':>9}{'attain':>8}{'TTFT p50':>10}{'p99':>9}"
    print(head + f"{'TPOT p50':>10}{'p99':>8}{'ITL p50':>9}{'p99':>8}{'tok/s':>8}{'fail':>5}")
    for name, rows in result["rows"].items():
        for rate, r in rows.items():
            print(
                f"{name:<9}{rate:>6}{r['goodput']:>9.3f}{r['attainment']:>8.2f}"
                f"{r['p50_ttft_ms']:>10.0f}{r['p99_ttft_ms']:>9.0f}{r['p50_tpot_ms']:>10.1f}"
                f"{r['p99_tpot_ms']:>8.1f}{r['p50_itl_ms']:>9.1f}{r['p99_itl_ms']:>8.1f}"
                f"{r['out_tok_per_s']:>8.1f}{r['failed']:>5}"
            )
    print("TTFT phases, mean ms per request that went through each (router metrics):")
    print("  " + ttft_phases.header())
    for name, by_rate in result["ttft_phases"].items():
        for rate, phases in by_rate.items():
            print("  " + ttft_phases.format_row(name, rate, phases))
    print("best per rate (goodput, then attainment):")
    rates = next(iter(result["rows"].values())).keys()
    for rate in rates:
        ranked = sorted(
            result["rows"],
            key=lambda n: (
                -result["rows"][n][rate]["goodput"],
                -result["rows"][n][rate]["attainment"],
            ),
        )
        cells = ", ".join(f"{n} {result['rows'][n][rate]['goodput']:.3f}" for n in ranked)
        print(f"  {rate:>5} req/s: {ranked[0]}  ({cells})")
    print(f"max rate with SLO attainment >= {ATTAINMENT_TARGET:g}:")
    for name, best in result["max_rate_under_slo"].items():
        print(f"  {name:<9}{best['rate']:>7.3f} req/s  ({best['how']})")


def save_plot(path: Path, summary: dict[str, Any], title: str) -> bool:
    try:
        import matplotlib
    except ImportError:
        return False
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    panels = [
        ("goodput", "goodput, req/s"),
        ("p99_ttft_ms", "TTFT p99, ms"),
        ("p99_tpot_ms", "TPOT p99, ms"),
        ("p99_itl_ms", "ITL p99 (all gaps), ms"),
    ]
    limits = {"p99_ttft_ms": "ttft", "p99_tpot_ms": "tpot", "p99_itl_ms": "itl_p99"}
    fig, axes = plt.subplots(len(summary), 4, figsize=(17, 3.6 * len(summary)), squeeze=False)
    for row, (preset, result) in enumerate(summary.items()):
        for col, (key, label) in enumerate(panels):
            ax = axes[row][col]
            for name, rows in result["rows"].items():
                xs = [float(r) for r in rows]
                ax.plot(xs, [rows[r][key] for r in rows], marker="o", label=name)
            if key != "goodput":
                limit = result["slos_ms"][limits[key]]
                ax.axhline(limit, color="grey", linestyle="--", linewidth=1, label="SLO")
                ax.set_yscale("log")
            ax.set_xlabel("request rate, req/s")
            ax.set_ylabel(label)
            ax.set_title(preset, fontsize=9)
            ax.grid(True, alpha=0.3)
            ax.legend(fontsize=7)
    fig.suptitle(title, fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return True


def print_interference(hol: dict[str, interference.InterferenceResult]) -> None:
    if not hol:
        return
    print("\ninterference: ITL of running streams, quiet vs while long prompts are in flight")
    print(f"{'config':<9}{'quiet p50':>10}{'p99':>8}{'loaded p50':>11}{'p99':>8}{'max':>8}  TTFT")
    for name, result in hol.items():
        s = result.summary()
        cells = [s[k] or 0.0 for k in ("itl_quiet_p50_ms", "itl_quiet_p99_ms")]
        cells += [s[k] or 0.0 for k in ("itl_loaded_p50_ms", "itl_loaded_p99_ms")]
        cells.append(s["itl_loaded_max_ms"] or 0.0)
        ttfts = ", ".join(f"{t:.0f}" for t in s["long_prompt_ttft_ms"])
        print(
            f"{name:<9}{cells[0]:>10.1f}{cells[1]:>8.1f}{cells[2]:>11.1f}{cells[3]:>8.1f}"
            f"{cells[4]:>8.1f}  {ttfts} ms"
        )


# -- the command line ---------------------------------------------------------------------------


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--configs", nargs="+", default=DEFAULT_CONFIGS, choices=list(CONFIGS))
    p.add_argument("--presets", nargs="+", default=list(DEFAULT_RATES), choices=list(DEFAULT_RATES))
    p.add_argument("--rates", help="comma-separated req/s for every preset (default: per preset)")
    p.add_argument(
        "--num-prompts", type=int, help=f"requests per rate (default {DEFAULT_NUM_PROMPTS})"
    )
    p.add_argument(
        "--prompts-factor",
        type=float,
        default=1.0,
        help="x the default requests per rate of every preset (less noise, longer sweep)",
    )
    p.add_argument(
        "--no-interference", action="store_true", help="skip the ITL-under-long-prompts runs"
    )
    p.add_argument("--baseline-prompts", type=int, default=3, help="unloaded requests per preset")
    p.add_argument("--input-scale", type=float, default=0.25, help="x the presets' input lengths")
    p.add_argument("--output-scale", type=float, default=0.1, help="x the presets' output lengths")
    p.add_argument("--slo-ttft-ms", type=float, help=f"default {TTFT_FACTOR:g}x unloaded TTFT")
    p.add_argument("--slo-tpot-ms", type=float, help=f"default {TPOT_FACTOR:g}x unloaded TPOT")
    p.add_argument("--slo-itl-p99-ms", type=float, help=f"default {ITL_FACTOR:g}x unloaded ITL p99")
    p.add_argument(
        "--slos-from",
        type=Path,
        help="every preset's SLOs as a recorded goodput.json has them (overrides the above)",
    )
    p.add_argument("--quick", action="store_true", help="~5 min: 10 prompts, 2 rates, 3 baseline")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument(
        "--router-args",
        default="",
        help="extra flags for every router, e.g. '--local-prefill-tokens 64' (one string)",
    )
    p.add_argument("--out-dir", type=Path, default=ROOT / "benchmarks" / "results")
    p.add_argument(
        "--from-raw",
        type=Path,
        help="re-summarize the raw runs a sweep saved (/tmp/goodput_partial.pickle)",
    )
    args = p.parse_args(argv)
    if args.quick:
        args.num_prompts, args.baseline_prompts = 10, 3
    return args


def num_prompts(args: argparse.Namespace, preset: str) -> int:
    return int(args.num_prompts or round(DEFAULT_NUM_PROMPTS[preset] * args.prompts_factor))


def make_plan(args: argparse.Namespace) -> Plan:
    rates = {}
    for preset in args.presets:
        given = [float(r) for r in args.rates.split(",")] if args.rates else None
        rates[preset] = given or DEFAULT_RATES[preset]
        if args.quick and not given:
            rates[preset] = [rates[preset][0], rates[preset][-1]]

    def workload(preset: str, n: int, seed: int, even: bool = False) -> list[Sample]:
        return preset_workload(preset, n, args.input_scale, args.output_scale, seed, even)

    return Plan(
        configs=args.configs,
        rates=rates,
        samples={p: workload(p, num_prompts(args, p), args.seed) for p in args.presets},
        base_samples={
            p: workload(p, args.baseline_prompts, args.seed + 1, even=True) for p in args.presets
        },
        seed=args.seed,
        interference=not args.no_interference,
        router_args=shlex.split(args.router_args),
    )


def describe_workload(plan: Plan, args: argparse.Namespace) -> str:
    lines = [f"workload (lengths x{args.input_scale:g} in, x{args.output_scale:g} out):"]
    for preset, samples in plan.samples.items():
        ins = [s.prompt_len for s in samples]
        outs = [s.max_tokens for s in samples]
        lines.append(
            f"  {preset}: {len(samples)} requests per rate, input {min(ins)}-{max(ins)} "
            f"(mean {np.mean(ins):.0f}), output {min(outs)}-{max(outs)} (mean {np.mean(outs):.0f}) "
            f"tokens; rates {plan.rates[preset]} req/s"
        )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    machine = machine_info(1, probe_cores=True)
    command = "python " + shlex.join(sys.argv)
    print(f"$ {command}")
    print(
        f"machine: {machine['cpu']}, {machine['cores']} cores ({machine['usable_cores']} usable, "
        f"load avg {machine['load_avg_1m_at_start']}), python {machine['python']}"
    )
    print(describe_read_scaling(machine["read_scaling"]))
    plan = make_plan(args)
    print(describe_workload(plan, args))
    started = time.monotonic()
    hol: dict[str, interference.InterferenceResult]
    if args.from_raw:
        out, hol = pickle.loads(args.from_raw.read_bytes()), {}
        phases: Phases = {name: {preset: {} for preset in plan.rates} for name in out}
    else:
        out, hol, phases = measure(plan)
    elapsed = time.monotonic() - started
    summary = summarize(out, plan, args, phases)
    for preset, result in summary.items():
        print_preset(preset, result)
    print_interference(hol)
    print(f"\nmeasured in {elapsed / 60:.1f} min")
    args.out_dir.mkdir(parents=True, exist_ok=True)
    config = {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items()}
    config["num_prompts_by_preset"] = {p: num_prompts(args, p) for p in args.presets}
    data = {"command": command, "machine": machine, "config": config, "elapsed_s": elapsed}
    path = args.out_dir / "goodput.json"
    hol_json = interference.to_json(hol, interference.InterferenceConfig()) if hol else None
    path.write_text(
        json.dumps({**data, "presets": summary, "interference": hol_json}, indent=2) + "\n"
    )
    plot = args.out_dir / "goodput.png"
    title = (
        f"goodput on {machine['cores']} cores: disaggregated (always / per request) vs "
        "2 colocated vs 1 colocated (2 threads)"
    )
    saved = [path] + ([plot] if save_plot(plot, summary, title) else [])
    hol_plot = args.out_dir / "interference.png"
    hol_title = "inter-token gaps of running streams while 1024-token prompts arrive"
    if hol and interference.save_plot(hol_plot, hol, hol_title):
        saved.append(hol_plot)
    print("saved " + " and ".join(str(p) for p in saved))
    return 0


if __name__ == "__main__":
    sys.exit(main())
