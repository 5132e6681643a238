"""``pdserve-loadtest`` / ``python -m loadtest``: the command line (``vllm bench serve``'s flag
names where the idea is the same)."""

from __future__ import annotations

import argparse
import asyncio
import math
import sys
from pathlib import Path

import httpx

from loadtest.arrivals import Schedule, parse_rates
from loadtest.client import CHAT, COMPLETIONS, ClientConfig, RunOutput, run
from loadtest.datasets import DATASETS, DatasetConfig, load, token_counter
from loadtest.metrics import METRICS, Metrics, compute, parse_goodput
from loadtest.report import (
    compare,
    default_filename,
    load_json,
    result_dict,
    save_csv,
    save_json,
    summary_table,
)

DEFAULT_NUM_PROMPTS = 1000


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="pdserve-loadtest",
        description="Load-test an OpenAI-compatible endpoint (completions or chat).",
    )
    a = p.add_argument
    g = p.add_argument_group("endpoint")
    g.add_argument("--base-url", default="http://127.0.0.1:8000", help="server root URL")
    g.add_argument("--endpoint", default=COMPLETIONS, help=f"{COMPLETIONS} or {CHAT}")
    g.add_argument("--model", help="model name (default: the first one /v1/models lists)")
    g.add_argument("--api-key", help="sent as 'Authorization: Bearer <key>'")
    g.add_argument("--stream", action=argparse.BooleanOptionalAction, default=True)
    g.add_argument("--ignore-eos", action="store_true", help="generate exactly max_tokens")
    g.add_argument("--temperature", type=float, default=0.0)
    g.add_argument("--request-timeout", type=float, default=600.0, help="seconds per request")
    g = p.add_argument_group("load")
    g.add_argument(
        "--num-prompts",
        type=int,
        help=f"requests to send (default {DEFAULT_NUM_PROMPTS} unless --duration is given)",
    )
    g.add_argument("--duration", type=float, help="stop sending after this many seconds")
    g.add_argument("--request-rate", type=float, default=math.inf, help="req/s; inf = all at once")
    g.add_argument(
        "--burstiness",
        type=float,
        default=1.0,
        help="gamma shape of the gaps: 1 Poisson, <1 burstier, inf constant",
    )
    g.add_argument("--max-concurrency", type=int, help="cap on requests in flight")
    g.add_argument("--ramp-up-start-rate", type=float, help="linear ramp: first rate (req/s)")
    g.add_argument("--ramp-up-end-rate", type=float, help="linear ramp: last rate (req/s)")
    g.add_argument("--sweep-rates", help="comma-separated rates, one run each, e.g. 1,2,4")
    g.add_argument(
        "--slo-search",
        action="store_true",
        help="find the highest rate meeting --goodput for --slo-attainment",
    )
    g.add_argument("--slo-attainment", type=float, default=0.95)
    g.add_argument("--slo-search-start-rate", type=float, default=1.0)
    g.add_argument("--slo-search-tolerance", type=float, default=0.05)
    g.add_argument("--slo-search-max-probes", type=int, default=12)
    g.add_argument("--num-warmups", type=int, default=0)
    g.add_argument("--seed", type=int, default=0)
    g = p.add_argument_group("dataset")
    g.add_argument("--dataset-name", default="random", choices=DATASETS)
    g.add_argument("--dataset-path", help="sharegpt JSON/JSONL or custom JSONL file")
    g.add_argument("--random-input-len", type=int, default=1024)
    g.add_argument("--random-output-len", type=int, default=128)
    g.add_argument("--random-range-ratio", type=float, default=0.0)
    g.add_argument(
        "--random-prefix-len",
        type=int,
        default=0,
        help="random: common prefix; prefix: system prompt length",
    )
    g.add_argument("--num-prefixes", type=int, default=4, help="prefix: distinct system prompts")
    g.add_argument("--num-turns", type=int, default=3, help="multiturn: user turns each")
    g.add_argument("--multi-turn", action="store_true", help="sharegpt: send every turn")
    g.add_argument("--sharegpt-output-len", type=int, help="override the dataset's output lens")
    g.add_argument("--tokenizer", help="tokenizer.json (or hub name) for exact token counts")
    g = p.add_argument_group("results")
    g.add_argument(
        "--goodput", nargs="+", help="SLOs in ms, e.g. ttft:500 tpot:50 e2el:5000 itl_p99:200"
    )
    g.add_argument("--percentile-metrics", default="ttft,tpot,itl")
    g.add_argument("--metric-percentiles", default="99")
    g.add_argument("--save-result", action="store_true", help="JSON + per-request CSV + plots")
    g.add_argument("--result-dir", default=".")
    g.add_argument("--result-filename")
    g.add_argument("--no-plots", action="store_true")
    g.add_argument("--disable-tqdm", action="store_true")
    a("--compare", nargs=2, metavar=("A.json", "B.json"), help="print two saved runs' differences")
    return p


def discover_model(base_url: str, api_key: str | None) -> str:
    """The first model the server lists (as ``vllm bench serve`` does without --model)."""
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    response = httpx.get(base_url.rstrip("/") + "/v1/models", headers=headers, timeout=10)
    response.raise_for_status()
    return str(response.json()["data"][0]["id"])


def _stem(args: argparse.Namespace, cfg: ClientConfig, out: RunOutput, suffix: str = "") -> Path:
    name = args.result_filename or default_filename(cfg, out)
    path = Path(args.result_dir) / name
    stem = path.with_suffix("") if path.suffix == ".json" else path
    return stem.with_name(stem.name + suffix)


def _save(  # type: ignore[no-untyped-def]
    args: argparse.Namespace,
    cfg: ClientConfig,
    out: RunOutput,
    m: Metrics,
    suffix: str = "",
    plots: bool = True,
):
    """The JSON, the CSV and (unless --no-plots) the PNGs of one run, side by side."""
    stem = _stem(args, cfg, out, suffix)
    written = [save_json(result_dict(cfg, out, m), stem.with_suffix(".json"))]
    written.append(save_csv(out, stem.with_name(stem.name + "_requests.csv")))
    if plots and not args.no_plots:
        from loadtest.plots import plot_run

        written += plot_run(out, stem)
    for path in written:
        print(f"wrote {path}")
    return stem


async def _main(args: argparse.Namespace) -> int:
    slos = parse_goodput(args.goodput)
    percentiles = tuple(float(p) for p in args.metric_percentiles.split(",") if p.strip())
    selected = tuple(m.strip() for m in args.percentile_metrics.split(",") if m.strip())
    if bad := [m for m in selected if m not in METRICS]:
        raise SystemExit(f"--percentile-metrics: unknown {bad}; choose from {METRICS}")
    num_prompts = args.num_prompts
    if num_prompts is None and args.duration is None:
        num_prompts = DEFAULT_NUM_PROMPTS
    model = args.model or discover_model(args.base_url, args.api_key)
    cfg = ClientConfig(
        base_url=args.base_url,
        model=model,
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
    count = token_counter(args.tokenizer) if args.tokenizer else None
    ramp = args.ramp_up_start_rate is not None or args.ramp_up_end_rate is not None
    if ramp and (args.ramp_up_start_rate is None or args.ramp_up_end_rate is None):
        raise SystemExit("--ramp-up-start-rate and --ramp-up-end-rate go together")
    schedule = Schedule(
        rate=args.request_rate,
        burstiness=args.burstiness,
        ramp_start_rate=args.ramp_up_start_rate,
        ramp_end_rate=args.ramp_up_end_rate,
    )
    print(f"{cfg.url}  model={model}  dataset={args.dataset_name}  {len(samples)} samples")

    if args.sweep_rates or args.slo_search:
        from loadtest.slo import RunSpec, search, sweep

        spec = RunSpec(
            cfg, samples, schedule, num_prompts, args.duration, args.seed, slos, percentiles, count
        )
        if args.sweep_rates:
            return await _sweep(args, spec, parse_rates(args.sweep_rates), selected, sweep)
        return await _search(args, spec, search)

    out = await run(cfg, samples, schedule, num_prompts, args.duration, args.seed, count)
    m = compute(out, slos, percentiles)
    print(summary_table(cfg, out, m, selected))
    if args.save_result:
        _save(args, cfg, out, m)
    return 0 if m.completed else 1


async def _sweep(args, spec, rates, selected, sweep) -> int:  # type: ignore[no-untyped-def]
    def on_run(rate: float, out: RunOutput, m: Metrics) -> None:
        print(summary_table(spec.cfg, out, m, selected))
        if args.save_result:  # per-rate JSON and CSV; the sweep's plot is the latency curve
            _save(args, spec.cfg, out, m, suffix=f"-rate{rate:g}", plots=False)

    points = await sweep(spec, rates, on_run)
    print(f"{'rate':>8}{'req/s':>10}{'tok/s':>10}{'p50 TTFT':>10}{'p50 TPOT':>10}{'attain':>8}")
    for p in points:
        att = "" if p["slo_attainment"] is None else f"{p['slo_attainment']:.3f}"
        print(
            f"{p['request_rate']!s:>8}{p['request_throughput']:>10.2f}"
            f"{p['output_throughput']:>10.1f}{p['median_ttft_ms']:>10.1f}"
            f"{p['median_tpot_ms']:>10.2f}{att:>8}"
        )
    if args.save_result:
        stem = Path(args.result_dir) / Path(args.result_filename or "sweep").stem
        print(f"wrote {save_json({'runs': points}, stem.with_name(stem.name + '_sweep.json'))}")
        if not args.no_plots:
            from loadtest.plots import plot_sweep

            key = f"p{args.metric_percentiles.split(',')[0].strip()}".replace(".0", "")
            print(f"wrote {plot_sweep(points, stem.with_name(stem.name + '_sweep.png'), key)}")
    return 0


async def _search(args, spec, search) -> int:  # type: ignore[no-untyped-def]
    def on_probe(probe) -> None:  # type: ignore[no-untyped-def]
        s = probe.summary
        print(
            f"rate {probe.rate:9.3f} req/s  attainment {probe.attainment:.3f}  "
            f"p50 TTFT {s['median_ttft_ms']:.1f} ms  p50 TPOT {s['median_tpot_ms']:.2f} ms  "
            f"failed {s['failed']}"
        )

    result = await search(
        spec,
        args.slo_attainment,
        args.slo_search_start_rate,
        args.slo_search_tolerance,
        args.slo_search_max_probes,
        on_probe,
    )
    state = "converged" if result.converged else "not converged (probe limit)"
    print(
        f"max rate meeting {spec.slos} for {args.slo_attainment:.0%} of requests: "
        f"{result.max_rate:.3f} req/s ({state})"
    )
    if args.save_result:
        stem = Path(args.result_dir) / Path(args.result_filename or "slo_search").stem
        print(f"wrote {save_json(result.to_dict(), stem.with_name(stem.name + '_slo.json'))}")
    return 0 if result.max_rate > 0 else 1


def main(argv: list[str] | None = None) -> int:
    args = parser().parse_args(argv)
    if args.compare:
        a, b = args.compare
        print(compare(load_json(a), load_json(b), Path(a).stem, Path(b).stem))
        return 0
    try:
        return asyncio.run(_main(args))
    except ValueError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
