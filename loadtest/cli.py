"""``pdserve-loadtest`` / ``python -m loadtest``: the command line (``vllm bench serve``'s flag
names where the idea is the same).

A run goes: check the flags and build the workload (local mistakes first), check the server
(``loadtest.preflight``), send (Ctrl-C stops, ``loadtest.control``), print the summary, save.
Every user mistake ends in one ``error:`` line naming what to change, exit status 2.
"""

from __future__ import annotations

import argparse
import asyncio
import math
import sys
from dataclasses import replace
from pathlib import Path
from typing import Any, NoReturn

from loadtest import __version__
from loadtest.arrivals import Schedule, parse_rates
from loadtest.client import CHAT, COMPLETIONS, ClientConfig, RunOutput, run
from loadtest.control import Stop, sigint_stops
from loadtest.datasets import (
    DATASETS,
    DatasetConfig,
    describe,
    length_ranges,
    load,
    token_counter,
)
from loadtest.metrics import METRICS, Metrics, compute, parse_goodput
from loadtest.output import Outputs
from loadtest.report import compare, load_json, summary_table
from loadtest.slo import RunSpec, search, sweep

DEFAULT_NUM_PROMPTS = 1000
EXIT_INTERRUPTED = 130


class Parser(argparse.ArgumentParser):
    """argparse with a one-line error (not the 30-line usage) pointing at ``--help``."""

    def error(self, message: str) -> NoReturn:
        self.exit(2, f"{self.prog}: error: {message} (see {self.prog} --help)\n")


def _number(kind: type, low: float, inclusive: bool, what: str) -> Any:
    def parse(text: str) -> Any:
        try:
            value = kind(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{what}, got {text!r}") from None
        if math.isnan(value) or value < low or (value == low and not inclusive):
            raise argparse.ArgumentTypeError(f"{what}, got {text!r}")
        return value

    return parse


POSITIVE_INT = _number(int, 0, False, "must be a whole number above 0")
COUNT = _number(int, 0, True, "must be a whole number, 0 or more")
POSITIVE = _number(float, 0.0, False, "must be a number above 0 (inf allowed)")
FRACTION = _number(float, 0.0, False, "must be a fraction in (0, 1]")


def parser() -> argparse.ArgumentParser:
    p = Parser(
        prog="pdserve-loadtest",
        description="Load-test an OpenAI-compatible endpoint (completions or chat). "
        "Ctrl-C stops a run and keeps its partial result.",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    p.add_argument("--version", action="version", version=f"%(prog)s {__version__}")
    g = p.add_argument_group("endpoint")
    g.add_argument("--base-url", default="http://127.0.0.1:8000", help="server root URL")
    g.add_argument("--endpoint", default=COMPLETIONS, help=f"{COMPLETIONS} or {CHAT}")
    g.add_argument("--model", help="model name (None: the first one /v1/models lists)")
    g.add_argument("--api-key", help="sent as 'Authorization: Bearer <key>'")
    g.add_argument(
        "--stream",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="stream the answers (without a stream only E2EL is observable)",
    )
    g.add_argument("--ignore-eos", action="store_true", help="generate exactly max_tokens")
    g.add_argument("--temperature", type=float, default=0.0, help="sampling temperature")
    g.add_argument("--request-timeout", type=POSITIVE, default=600.0, help="seconds per request")
    g = p.add_argument_group("load")
    g.add_argument(
        "--num-prompts",
        type=POSITIVE_INT,
        help=f"requests to send (None: {DEFAULT_NUM_PROMPTS}, or unlimited with --duration)",
    )
    g.add_argument("--duration", type=POSITIVE, help="stop sending after this many seconds")
    g.add_argument(
        "--request-rate",
        type=POSITIVE,
        default=math.inf,
        help="requests/s; inf sends them all at once",
    )
    g.add_argument(
        "--burstiness",
        type=POSITIVE,
        default=1.0,
        help="gamma shape of the gaps: 1 Poisson, <1 burstier, inf constant",
    )
    g.add_argument("--max-concurrency", type=POSITIVE_INT, help="cap on requests in flight")
    g.add_argument("--ramp-up-start-rate", type=POSITIVE, help="linear ramp: first rate (req/s)")
    g.add_argument("--ramp-up-end-rate", type=POSITIVE, help="linear ramp: last rate (req/s)")
    g.add_argument("--sweep-rates", help="comma-separated rates, one run each, e.g. 1,2,4")
    g.add_argument(
        "--slo-search",
        action="store_true",
        help="find the highest rate meeting --goodput for --slo-attainment",
    )
    g.add_argument(
        "--slo-attainment",
        type=FRACTION,
        default=0.95,
        help="--slo-search: the fraction of requests that must meet --goodput",
    )
    g.add_argument("--slo-search-start-rate", type=POSITIVE, default=1.0, help="first probe")
    g.add_argument(
        "--slo-search-tolerance",
        type=FRACTION,
        default=0.05,
        help="stop when the bracket is this narrow (relative)",
    )
    g.add_argument("--slo-search-max-probes", type=POSITIVE_INT, default=12, help="run budget")
    g.add_argument("--num-warmups", type=COUNT, default=0, help="untimed requests first")
    g.add_argument("--seed", type=int, default=0, help="workload and arrival times")
    g = p.add_argument_group("dataset")
    g.add_argument("--dataset-name", default="random", choices=DATASETS, help="the workload")
    g.add_argument("--dataset-path", help="sharegpt JSON/JSONL or custom JSONL file")
    g.add_argument("--random-input-len", type=POSITIVE_INT, default=1024, help="random: ISL")
    g.add_argument("--random-output-len", type=POSITIVE_INT, default=128, help="random: OSL")
    g.add_argument(
        "--random-range-ratio",
        type=float,
        default=0.0,
        help="random: lengths uniform in [L(1-r), L(1+r)]",
    )
    g.add_argument(
        "--random-prefix-len",
        type=COUNT,
        default=0,
        help="random: common prefix; prefix: system prompt length",
    )
    g.add_argument("--num-prefixes", type=POSITIVE_INT, default=4, help="prefix: system prompts")
    g.add_argument("--num-turns", type=POSITIVE_INT, default=3, help="multiturn: user turns")
    g.add_argument("--multi-turn", action="store_true", help="sharegpt: send every turn")
    g.add_argument("--sharegpt-output-len", type=POSITIVE_INT, help="override the file's OSLs")
    g.add_argument("--tokenizer", help="tokenizer.json (or hub name) for exact token counts")
    g = p.add_argument_group("results")
    g.add_argument(
        "--goodput", nargs="+", help="SLOs in ms, e.g. ttft:500 tpot:50 e2el:5000 itl_p99:200"
    )
    g.add_argument("--percentile-metrics", default="ttft,tpot,itl", help="metrics in the table")
    g.add_argument("--metric-percentiles", default="99", help="percentiles, e.g. 50,90,99.9")
    g.add_argument("--save-result", action="store_true", help="JSON + per-request CSV + plots")
    g.add_argument("--result-dir", default=".", help="where --save-result writes")
    g.add_argument("--result-filename", help="None: <backend>-<rate>qps-<model>-<date>.json")
    g.add_argument("--no-plots", action="store_true", help="--save-result without the PNGs")
    g.add_argument("--disable-tqdm", action="store_true", help="no progress bar")
    p.add_argument(
        "--compare",
        nargs=2,
        metavar=("A.json", "B.json"),
        help="print two saved runs' differences and exit",
    )
    return p


def _settings(args: argparse.Namespace, dataset: DatasetConfig, slos: dict) -> dict[str, Any]:
    """What the saved results' ``config`` records beyond the endpoint: workload, seed, SLOs."""
    return {
        "dataset": describe(dataset) | {"num_prompts": args.num_prompts},
        "seed": args.seed,
        "slos_ms": slos,
        "duration_limit_s": args.duration,
        "percentiles": args.metric_percentiles,
        "tool": f"pdserve-loadtest {__version__}",
    }


async def _main(args: argparse.Namespace) -> int:
    slos = parse_goodput(args.goodput)
    percentiles = tuple(float(p) for p in args.metric_percentiles.split(",") if p.strip())
    selected = tuple(m.strip() for m in args.percentile_metrics.split(",") if m.strip())
    if bad := [m for m in selected if m not in METRICS]:
        raise ValueError(f"--percentile-metrics: unknown {bad}; choose from {', '.join(METRICS)}")
    if args.slo_search and not slos:
        raise ValueError("--slo-search needs limits: --goodput ttft:<ms> tpot:<ms>")
    ramp = (args.ramp_up_start_rate, args.ramp_up_end_rate)
    if (ramp[0] is None) != (ramp[1] is None):
        raise ValueError("--ramp-up-start-rate and --ramp-up-end-rate go together")
    rates = parse_rates(args.sweep_rates) if args.sweep_rates else None
    if args.save_result:  # before the run, not after it
        try:
            Path(args.result_dir).mkdir(parents=True, exist_ok=True)
        except OSError as exc:
            raise ValueError(f"--result-dir {args.result_dir}: cannot create it ({exc})") from None
    num_prompts = args.num_prompts
    if num_prompts is None and args.duration is None:
        num_prompts = DEFAULT_NUM_PROMPTS
    unlimited = num_prompts is None and math.isinf(args.request_rate) and ramp[0] is None
    if unlimited and not args.max_concurrency and not rates and not args.slo_search:
        raise ValueError("--duration with --request-rate inf needs --max-concurrency")
    dataset = DatasetConfig(
        name=args.dataset_name,
        path=args.dataset_path,
        num_prompts=num_prompts or DEFAULT_NUM_PROMPTS,  # a pool, cycled when --duration
        input_len=args.random_input_len,
        output_len=args.random_output_len,
        range_ratio=args.random_range_ratio,
        prefix_len=args.random_prefix_len,
        num_prefixes=args.num_prefixes,
        num_turns=args.num_turns,
        multi_turn=args.multi_turn,
        output_len_override=args.sharegpt_output_len,
        tokenizer=args.tokenizer,
        seed=args.seed,
    )
    samples = load(dataset)
    if not samples:
        raise ValueError(f"--dataset-path {args.dataset_path}: no usable records in it")
    count = token_counter(args.tokenizer) if args.tokenizer else None
    schedule = Schedule(args.request_rate, args.burstiness, *ramp)
    cfg = ClientConfig(
        base_url=args.base_url,
        model=args.model or "",
        endpoint=args.endpoint,
        api_key=args.api_key,
        stream=args.stream,
        ignore_eos=args.ignore_eos,
        temperature=args.temperature,
        max_concurrency=args.max_concurrency,
        request_timeout=args.request_timeout,
        num_warmups=args.num_warmups,
        disable_tqdm=args.disable_tqdm,
    )
    from loadtest.preflight import preflight

    cfg = replace(cfg, model=preflight(cfg, args.model))
    amount = f"{num_prompts} requests" if num_prompts else "requests"
    limit = f" for {args.duration:g} s" if args.duration else ""
    print(
        f"{cfg.url}  model={cfg.model}  dataset={args.dataset_name}: {amount}{limit} at "
        f"{schedule.describe()} (Ctrl-C stops and keeps the partial result)"
    )
    stop = Stop()
    spec = RunSpec(
        cfg,
        samples,
        schedule,
        num_prompts,
        args.duration,
        args.seed,
        slos,
        percentiles,
        count,
        stop,
        _settings(args, dataset, slos),
    )
    outputs = Outputs(args, cfg, spec.settings, slos, length_ranges(dataset))
    with sigint_stops(stop):  # also while the results are written: Ctrl-C again quits
        if rates:
            return await _sweep(outputs, spec, rates, selected)
        if args.slo_search:
            return await _search(outputs, spec, args)
        out = await run(cfg, samples, schedule, num_prompts, args.duration, args.seed, count, stop)
        m = compute(out, slos, percentiles)
        print(summary_table(cfg, out, m, selected, slos))
        outputs.save_run(out, m)
    return _status(out, m)


def _status(out: RunOutput, m: Metrics) -> int:
    if out.stopped:
        return EXIT_INTERRUPTED if "SIGINT" in out.stopped else 1
    return 0 if m.completed else 1


async def _sweep(outputs: Outputs, spec: RunSpec, rates: list[float], selected: tuple) -> int:
    def on_run(rate: float, out: RunOutput, m: Metrics) -> None:
        print(summary_table(spec.cfg, out, m, selected, spec.slos))
        outputs.save_run(out, m, suffix=f"-rate{rate:g}", plots=False)

    points = await sweep(spec, rates, on_run)
    print(outputs.sweep_table(points))
    outputs.save_sweep(points)
    if spec.stop is not None and spec.stop.reason:
        return EXIT_INTERRUPTED if "SIGINT" in spec.stop.reason else 1
    return 0


async def _search(outputs: Outputs, spec: RunSpec, args: argparse.Namespace) -> int:
    def on_probe(probe: Any) -> None:
        print(outputs.probe_line(probe))

    result = await search(
        spec,
        args.slo_attainment,
        args.slo_search_start_rate,
        args.slo_search_tolerance,
        args.slo_search_max_probes,
        on_probe,
    )
    state = "converged" if result.converged else "not converged (probe limit)"
    if result.stopped:
        state = f"stopped early: {result.stopped}"
    print(
        f"max rate meeting {spec.slos} for {args.slo_attainment:.0%} of requests: "
        f"{result.max_rate:.3f} req/s ({state})"
    )
    outputs.save_search(result.to_dict())
    if result.stopped:
        return EXIT_INTERRUPTED if "SIGINT" in result.stopped else 1
    return 0 if result.max_rate > 0 else 1


def main(argv: list[str] | None = None) -> int:
    args = parser().parse_args(argv)
    try:
        if args.compare:
            a, b = args.compare
            print(compare(load_json(a), load_json(b), Path(a).stem, Path(b).stem))
            return 0
        return asyncio.run(_main(args))
    except ValueError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    except OSError as exc:  # e.g. --result-dir not writable
        print(f"error: {exc.filename or ''}: {exc.strerror or exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:  # Ctrl-C outside a run (before the handler is installed)
        print("interrupted", file=sys.stderr)
        return EXIT_INTERRUPTED


if __name__ == "__main__":
    sys.exit(main())
