"""How much longer an engine step runs when a request arrives at, or finishes on, the same host
meanwhile: the simulator's host-work figures (``pdserve.sim.host_work``, issue #32).

On the recorded sweep's 2-core machine the router, Redis and the load tester share the cores
with the workers. This starts ``benchmarks/goodput.py``'s deployments (``1xcoloc``: one
2-thread worker; ``2xcoloc`` and ``disagg``: two 1-thread workers, each pinned to its core) with
every worker's ``--step-log`` and the router's ``--trace-file``, and sends the chatbot preset
(the sweep's lengths and trace) at a few rates. A request arrives when the router's span for it
starts, and finishes when that span ends. Then, per worker and per decode batch size, it compares
the decode-only steps that held exactly one arrival (and no finish) with those that held neither,
and likewise for one finish. The differences are averaged, weighted by the number of steps that
held the event, over the workers of each thread count. Decode-only steps are used because their
time depends only on the batch; a prompt step's time depends on its prompts. Written to
``--out``, and read by ``benchmarks/sim_accuracy.py --host-work``.

    python benchmarks/host_work.py [--rates 2,4] [--configs 1xcoloc 2xcoloc disagg]
        [--out benchmarks/profiles/zen4-host-work.json]

Run it with nothing else on the machine: other processes' CPU would count as the serving work.
"""

from __future__ import annotations

import argparse
import json
import shlex
import statistics
import sys
import tempfile
import time
from collections import defaultdict
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks"))

import goodput  # noqa: E402  (benchmarks/goodput.py: the sweep's deployments and trace)
from machine import machine_info  # noqa: E402
from tqdm import tqdm  # noqa: E402

from services.redis_server import RedisServer  # noqa: E402
from services.worker.step_log import StepLine, read_step_log  # noqa: E402

PRESET = "chatbot"  # short prompts: many arrivals and finishes per second
ROUTER_SPAN = "POST /v1/completions"
MIN_STEPS = 3  # a (batch, event) group with fewer steps says nothing
# worker thread count -> "arrival" / "finish" -> (extra ms, steps) of each worker measured
Figures = dict[int, dict[str, list[tuple[float, int]]]]


@dataclass(frozen=True)
class Events:
    """When requests reached the router and when their answers ended (unix seconds)."""

    arrivals: list[float]
    finishes: list[float]

    @classmethod
    def from_trace(cls, path: Path) -> Events:
        spans = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
        mine = [s for s in spans if s["name"] == ROUTER_SPAN]
        return cls(
            sorted(s["start_unix_ns"] / 1e9 for s in mine),
            sorted(s["end_unix_ns"] / 1e9 for s in mine),
        )

    def within(self, step: StepLine) -> tuple[int, int]:
        """How many requests arrived, and how many finished, while ``step`` computed."""

        def count(times: list[float]) -> int:
            return sum(1 for t in times if step.start <= t < step.end)

        return count(self.arrivals), count(self.finishes)


def extra_ms(steps: list[StepLine], events: Events) -> dict[str, tuple[float, int]]:
    """``arrival`` and ``finish`` -> (the mean extra ms of a decode step holding one such event,
    weighted over the batch sizes; the number of such steps)."""
    groups: dict[tuple[int, int, int], list[float]] = defaultdict(list)
    for step in steps:
        if step.prompt_tokens:
            continue
        arrived, finished = events.within(step)
        key = (step.decode_sequences, min(arrived, 2), min(finished, 2))
        groups[key].append((step.end - step.start) * 1000)
    result = {}
    for name, with_event in (("arrival", (1, 0)), ("finish", (0, 1))):
        total, count = 0.0, 0
        for (batch, a, f), times in groups.items():
            quiet = groups.get((batch, 0, 0), [])
            if (a, f) != with_event or len(times) < MIN_STEPS or len(quiet) < MIN_STEPS:
                continue
            total += (statistics.fmean(times) - statistics.fmean(quiet)) * len(times)
            count += len(times)
        result[name] = (total / count if count else 0.0, count)
    return result


def measure(config: str, rates: list[float], redis_url: str, workdir: Path) -> Figures:
    """One deployment of ``config``, the chatbot preset at each rate: the step logs and the
    router's spans. Returns per worker thread count the step-weighted extra ms and counts."""
    trace, log = workdir / f"{config}.trace.jsonl", workdir / f"{config}.steps.jsonl"
    samples = goodput.preset_workload(PRESET, 48, 0.25, 0.1, 0)
    warm = goodput.preset_workload(PRESET, 3, 0.25, 0.1, 1)
    with goodput.deployed(
        config, redis_url, ["--trace-file", str(trace)], ["--step-log", str(log)]
    ) as d:
        goodput.baseline(d.url, warm)  # untimed: the first steps of a fresh process
        started = time.time()
        for rate in rates:
            goodput.at_rate(d.url, samples, rate, 0)
    # the router has exited: its shutdown flushed every span to the file
    events = Events.from_trace(trace)
    steps = [s for s in read_step_log(str(log)) if s.start >= started]
    threads = {role: t for role, _, t in goodput.CONFIGS[config]}
    by_threads: Figures = defaultdict(lambda: defaultdict(list))
    for worker in sorted({s.worker for s in steps}):
        mine = [s for s in steps if s.worker == worker]
        for name, figure in extra_ms(mine, events).items():
            by_threads[threads[mine[0].role]][name].append(figure)
    return by_threads


def combine(figures: list[tuple[float, int]]) -> tuple[float, int]:
    count = sum(n for _, n in figures)
    return (sum(ms * n for ms, n in figures) / count if count else 0.0, count)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=(__doc__ or "").split("\n\n")[0])
    parser.add_argument("--rates", default="2,4", help="comma-separated req/s")
    parser.add_argument(
        "--configs", nargs="+", default=["1xcoloc", "2xcoloc", "disagg"], choices=goodput.CONFIGS
    )
    parser.add_argument(
        "--out", type=Path, default=ROOT / "benchmarks/profiles/zen4-host-work.json"
    )
    args = parser.parse_args(argv)
    rates = [float(r) for r in args.rates.split(",")]
    machine = machine_info(1)
    print(
        f"machine: {machine['cpu']}, {machine['cores']} cores, "
        f"load avg {machine['load_avg_1m_at_start']}"
    )
    pooled: Figures = defaultdict(lambda: defaultdict(list))
    per_config: dict[str, dict[str, list[float]]] = {}
    with RedisServer() as redis, tempfile.TemporaryDirectory(prefix="host-work-") as tmp:
        for config in tqdm(args.configs, unit="deployment", file=sys.stderr):
            found = measure(config, rates, redis.url, Path(tmp))
            per_config[config] = {}
            for threads, figures in found.items():
                for name, values in figures.items():
                    pooled[threads][name] += values
                    ms, n = combine(values)
                    per_config[config][f"{name}_ms ({threads} thread)"] = [round(ms, 2), n]
                    print(
                        f"{config:8s} {threads} thread(s): {name:7s} +{ms:5.2f} ms over {n} steps"
                    )
    result = {}
    for threads, figures in sorted(pooled.items()):
        arrival, n_a = combine(figures["arrival"])
        finish, n_f = combine(figures["finish"])
        result[str(threads)] = {
            "arrival_s": round(max(arrival, 0.0) / 1000, 5),
            "finish_s": round(max(finish, 0.0) / 1000, 5),
            "steps": {"arrival": n_a, "finish": n_f},
        }
        print(
            f"{threads} thread(s): arrival +{arrival:.2f} ms ({n_a} steps), "
            f"finish +{finish:.2f} ms ({n_f} steps)"
        )
    command = "python " + shlex.join(
        ["benchmarks/host_work.py", *(argv if argv is not None else sys.argv[1:])]
    )
    args.out.write_text(
        json.dumps(
            {
                "description": "decode steps lengthened by a request arriving or finishing on "
                "the same host meanwhile (benchmarks/host_work.py; pdserve.sim.host_work)",
                "command": command,
                "machine": machine,
                "preset": PRESET,
                "rates": rates,
                "threads": result,
                "per_config": per_config,
            },
            indent=2,
        )
        + "\n"
    )
    print(f"saved {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
