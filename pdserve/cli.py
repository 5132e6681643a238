"""The ``pdserve`` command line.

The flags of the engine, the workers, the router and ``up`` are generated from their config
dataclasses' fields (``common.settings``): each also reads an environment variable
(``--max-num-seqs`` reads ``PDSERVE_MAX_NUM_SEQS``), and a flag on the command line wins.
Environment variables are read here, at the entry point, and nowhere else; ``--help`` shows
every default and variable.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from collections.abc import Mapping, Sequence
from importlib.metadata import PackageNotFoundError, version

from common.settings import HelpFormatter, add_settings, build
from services.engine.config import EngineConfig, default_num_threads
from services.worker.config import WorkerConfig

DEMO_PROMPTS = [
    "The capital of France is",
    "Write a haiku about paged attention:",
    "def fibonacci(n):",
    "Three reasons to split prefill from decode:",
]


def add_engine_args(parser: argparse.ArgumentParser, env: Mapping[str, str]) -> None:
    """The engine's settings (every command that runs the engine), in a group of their own."""
    add_settings(parser.add_argument_group("engine"), EngineConfig, env)


def engine_config_from_args(args: argparse.Namespace) -> EngineConfig:
    return build(EngineConfig, args)


def add_worker_args(parser: argparse.ArgumentParser, env: Mapping[str, str]) -> None:
    """A prefill / decode / colocated worker's settings, then its engine's."""
    defaults = {"otlp_endpoint": env.get("OTEL_EXPORTER_OTLP_ENDPOINT")}
    worker = parser.add_argument_group("worker")
    add_settings(worker, WorkerConfig, env, defaults=defaults, nested=False)
    add_settings(parser.add_argument_group("engine"), EngineConfig, env, prefix="engine.")


def worker_config_from_args(role: str, args: argparse.Namespace) -> WorkerConfig:
    return build(WorkerConfig, args, role=role)


def add_router_args(parser: argparse.ArgumentParser, env: Mapping[str, str]) -> None:
    """The gateway's settings (`pdserve router`)."""
    from router.config import RouterConfig

    defaults = {"otlp_endpoint": env.get("OTEL_EXPORTER_OTLP_ENDPOINT")}
    add_settings(parser.add_argument_group("router"), RouterConfig, env, defaults=defaults)


def router_config_from_args(args: argparse.Namespace):  # type: ignore[no-untyped-def]
    from router.config import RouterConfig

    return build(RouterConfig, args)


def cmd_router(args: argparse.Namespace) -> int:
    from router.server import run_router

    run_router(router_config_from_args(args))
    return 0


def add_up_args(parser: argparse.ArgumentParser, env: Mapping[str, str]) -> None:
    """`pdserve up`'s own settings, then the router's and the engine's it hands on."""
    from pdserve.up import ROUTER_SKIP, UpConfig
    from router.config import RouterConfig

    add_settings(parser.add_argument_group("up"), UpConfig, env, nested=False)
    add_settings(
        parser.add_argument_group("router"), RouterConfig, env, prefix="router.", skip=ROUTER_SKIP
    )
    engine = parser.add_argument_group("engine (every worker)")
    add_settings(engine, EngineConfig, env, prefix="engine.", skip=("num_threads",))


def up_config_from_args(args: argparse.Namespace):  # type: ignore[no-untyped-def]
    from pdserve.up import UpConfig

    return build(UpConfig, args)


def cmd_up(args: argparse.Namespace) -> int:
    from pdserve.up import run_up

    return run_up(up_config_from_args(args))


def cmd_worker(args: argparse.Namespace) -> int:
    from services.server import run_worker

    run_worker(worker_config_from_args(args.command, args))
    return 0


def _build_llm(args: argparse.Namespace):  # type: ignore[no-untyped-def]
    from services.engine.llm import LLM

    return LLM.from_config(engine_config_from_args(args))


def cmd_generate(args: argparse.Namespace) -> int:
    from common.sampling_params import SamplingParams

    prompts = args.prompt or [line.rstrip("\n") for line in sys.stdin if line.strip()]
    if not prompts:
        print("error: give prompts as arguments or on standard input", file=sys.stderr)
        return 2
    params = SamplingParams(
        temperature=args.temperature,
        top_p=args.top_p,
        top_k=args.top_k,
        max_tokens=args.max_tokens,
        seed=args.sample_seed,
        n=args.n,
        stop=args.stop or [],
        ignore_eos=args.ignore_eos,
    )
    llm = _build_llm(args)
    start = time.perf_counter()
    outputs = llm.generate(prompts, params, use_tqdm=not args.json)
    elapsed = time.perf_counter() - start
    for out in outputs:
        if args.json:
            print(
                json.dumps(
                    {
                        "prompt": out.prompt,
                        "prompt_token_ids": out.prompt_token_ids,
                        "outputs": [
                            {
                                "index": o.index,
                                "text": o.text,
                                "token_ids": o.token_ids,
                                "finish_reason": o.finish_reason,
                            }
                            for o in out.outputs
                        ],
                    }
                )
            )
        else:
            for o in out.outputs:
                print(
                    f"\n>>> {out.prompt}\n{o.text}\n[{o.finish_reason}, {len(o.token_ids)} tokens]"
                )
    if not args.json:
        total = sum(len(o.token_ids) for out in outputs for o in out.outputs)
        print(f"\n{total} tokens in {elapsed:.2f}s ({total / elapsed:.1f} tokens/s)")
    return 0


def add_plan_args(parser: argparse.ArgumentParser, env: Mapping[str, str]) -> None:
    """Flags of `pdserve plan` (profile source, workload, SLOs, core budget)."""
    g = parser.add_argument_group("profile")
    source = g.add_mutually_exclusive_group(required=True)
    source.add_argument("--profile", help="a worker profile JSON (saved by --save-profile)")
    source.add_argument(
        "--measure", action="store_true", help="measure the profile now (~1.5 min on 2 cores)"
    )
    g.add_argument("--save-profile", help="with --measure: write the profile to this file")
    g.add_argument(
        "--profile-threads",
        type=int,
        nargs="+",
        help="torch thread counts to profile (default: 1 and the cores this process may use)",
    )
    g.add_argument("--prefill-tokens", type=int, nargs="+", help="prompt lengths to time")
    g.add_argument("--batch-sizes", type=int, nargs="+", help="decode batch sizes to time")
    g.add_argument("--contexts", type=int, nargs="+", help="decode context lengths to time")
    g.add_argument("--transfer-tokens", type=int, nargs="+", help="KV pull sizes to time")
    g.add_argument("--repeats", type=int, default=3, help="runs per point (the median is kept)")
    g.add_argument(
        "--model", default=env.get("PDSERVE_MODEL"), help="default: SmolLM2-135M-Instruct"
    )
    g.add_argument("--cache-dir", default=env.get("PDSERVE_CACHE_DIR"))
    w = parser.add_argument_group("workload")
    w.add_argument("--preset", choices=["chatbot", "summarization", "mixed", "codegen"])
    w.add_argument("--isl", type=int, help="input tokens of every request (with --osl)")
    w.add_argument("--osl", type=int, help="output tokens of every request (with --isl)")
    w.add_argument("--input-scale", type=float, default=1.0, help="x the preset's input lengths")
    w.add_argument("--output-scale", type=float, default=1.0, help="x the preset's output lengths")
    w.add_argument("--rate", type=float, help="target req/s: latency at it and pool sizes for it")
    s = parser.add_argument_group("SLOs and budget")
    s.add_argument("--ttft-slo", type=float, required=True, help="TTFT limit, ms")
    s.add_argument("--tpot-slo", type=float, required=True, help="TPOT limit, ms")
    s.add_argument(
        "--slo-stat",
        default="p90",
        help="per-request statistic the SLOs bound: pNN (percentile) or mean (default p90)",
    )
    s.add_argument(
        "--cores",
        type=int,
        default=default_num_threads(),
        help="core budget (default: the cores this process may use)",
    )
    s.add_argument(
        "--shared-cores",
        action="store_true",
        help="the router, Redis or clients run on the workers' cores: recommend one-thread "
        "workers only (see docs/planning.md)",
    )
    s.add_argument("--json", action="store_true", help="print the plan as JSON")


def cmd_plan(args: argparse.Namespace) -> int:
    from pathlib import Path

    from pdserve.plan import SLO, fixed_workload, make_plan, preset_workload
    from pdserve.plan_report import format_plan, plan_dict
    from pdserve.profile import ProfileConfig, WorkerProfile, measure_profile

    lengths_given = (args.isl is not None, args.osl is not None)
    if (
        (args.preset is None) != (lengths_given == (True, True))
        or any(lengths_given)
        and (args.preset or not all(lengths_given))
    ):
        raise ValueError("give either --preset or --isl and --osl")
    if args.preset:
        workload = preset_workload(args.preset, args.input_scale, args.output_scale)
    else:
        workload = fixed_workload(args.isl, args.osl)
    slo = SLO(args.ttft_slo / 1e3, args.tpot_slo / 1e3, args.slo_stat)
    if args.measure:
        lengths = {
            k: tuple(v)
            for k in ("prefill_tokens", "batch_sizes", "contexts", "transfer_tokens")
            if (v := getattr(args, k))
        }
        threads = args.profile_threads or sorted({1, default_num_threads()})
        config = ProfileConfig(
            threads=tuple(threads),
            repeats=args.repeats,
            model=args.model,
            cache_dir=Path(args.cache_dir) if args.cache_dir else None,
            **lengths,  # type: ignore[arg-type]
        )
        profile = measure_profile(config)
        if args.save_profile:
            profile.save(Path(args.save_profile))
    else:
        path = Path(args.profile)
        if not path.is_file():
            raise ValueError(
                f"--profile {args.profile}: no such file; make one with `pdserve plan --measure "
                "--save-profile FILE ...`, or use the committed benchmarks/profiles/epyc-2core.json"
            )
        profile = WorkerProfile.load(path)
    plan = make_plan(profile, workload, slo, args.cores, args.rate, args.shared_cores)
    print(json.dumps(plan_dict(plan), indent=2) if args.json else format_plan(plan))
    return 0


def make_parser(env: Mapping[str, str]) -> argparse.ArgumentParser:
    """The whole command line; ``env`` gives the flags' defaults (``PDSERVE_*``)."""
    parser = argparse.ArgumentParser(prog="pdserve", description=__doc__)
    parser.add_argument("--version", action="version", version=f"pdserve {_version()}")
    sub = parser.add_subparsers(dest="command", required=True)

    def command(name: str, text: str) -> argparse.ArgumentParser:
        return sub.add_parser(name, help=text, description=text, formatter_class=HelpFormatter)

    gen = command("generate", "complete prompts offline and print the results")
    gen.add_argument("prompt", nargs="*", help="prompts (default: one per line of stdin)")
    gen.add_argument("--max-tokens", type=int, default=64, help="new tokens per prompt")
    gen.add_argument("--temperature", type=float, default=0.0, help="0: greedy")
    gen.add_argument("--top-p", type=float, default=1.0, help="nucleus sampling")
    gen.add_argument("--top-k", type=int, default=0, help="0: off")
    gen.add_argument("--n", type=int, default=1, help="sequences per prompt")
    gen.add_argument("--stop", action="append", help="a stop string (repeatable)")
    gen.add_argument("--ignore-eos", action="store_true", help="generate exactly --max-tokens")
    gen.add_argument("--sample-seed", type=int, default=None, help="per-request sampling seed")
    gen.add_argument("--json", action="store_true", help="one JSON line per prompt, with token ids")
    add_engine_args(gen, env)
    gen.set_defaults(func=cmd_generate)

    demo = command("demo", "the offline engine on a few prompts")
    add_engine_args(demo, env)
    demo.set_defaults(func=lambda a: cmd_generate(_demo_args(a)))

    for role, text in (
        ("prefill", "a prefill worker: computes prompts, serves their KV blocks"),
        ("decode", "a decode worker: pulls KV blocks, runs the continuous batch"),
        ("colocated", "a worker doing both phases in one process (baseline and fallback)"),
    ):
        worker = command(role, text)
        add_worker_args(worker, env)
        worker.set_defaults(func=cmd_worker)

    router = command("router", "the OpenAI-compatible gateway in front of the workers")
    add_router_args(router, env)
    router.set_defaults(func=cmd_router)

    up = command("up", "Redis, workers and the router on this machine (what `make up` runs)")
    add_up_args(up, env)
    up.set_defaults(func=cmd_up)

    plan = command("plan", "recommend a deployment from a measured worker profile")
    add_plan_args(plan, env)
    plan.set_defaults(func=cmd_plan)
    return parser


def parse(argv: Sequence[str], env: Mapping[str, str]) -> argparse.Namespace:
    """``argv`` parsed as the ``pdserve`` command parses it (tests use this)."""
    return make_parser(env).parse_args(argv)


def main(argv: Sequence[str] | None = None) -> int:
    try:
        args = make_parser(os.environ).parse_args(argv)
        return int(args.func(args))
    except ValueError as exc:  # bad input: a clear message, not a traceback
        print(f"error: {exc}", file=sys.stderr)
        return 2


def _version() -> str:
    try:
        return version("pdserve")
    except PackageNotFoundError:  # running from a checkout that was not installed
        return "unknown"


def _demo_args(args: argparse.Namespace) -> argparse.Namespace:
    args.prompt = DEMO_PROMPTS
    args.max_tokens, args.temperature, args.top_p, args.top_k, args.n = 48, 0.0, 1.0, 0, 1
    args.stop, args.ignore_eos, args.sample_seed, args.json = None, False, None, False
    return args


if __name__ == "__main__":
    sys.exit(main())
