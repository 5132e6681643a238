"""The ``pdserve`` command line.

Every flag of every command is generated from a config dataclass's fields (``common.settings``):
the engine's, the workers', the router's, ``up``'s, ``plan``'s and ``generate``'s. Each also
reads an environment variable (``--max-num-seqs`` reads ``PDSERVE_MAX_NUM_SEQS``), and a flag on
the command line wins. Environment variables are read here, at the entry point, and nowhere
else; ``--help`` shows every default and variable.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from importlib.metadata import PackageNotFoundError, version
from typing import TYPE_CHECKING

from common.heap import defer_collection
from common.settings import HelpFormatter, add_settings, build, setting
from pdserve.profile import ProfileConfig  # numpy-free: its flags are plan's
from services.engine.config import EngineConfig, default_num_threads
from services.worker.config import WorkerConfig
from services.worker.launcher import die_with_parent_if_asked

if TYPE_CHECKING:
    from common.sampling_params import SamplingParams
    from pdserve.plan import SLO, Workload

DEMO_PROMPTS = [
    "The capital of France is",
    "Write a haiku about paged attention:",
    "def fibonacci(n):",
    "Three reasons to split prefill from decode:",
]
DESCRIPTION = (
    "Serve a language model with prefill and decode on separate workers, behind an "
    "OpenAI-compatible router. Every flag also reads an environment variable (--max-num-seqs "
    "reads PDSERVE_MAX_NUM_SEQS); a flag on the command line wins. `pdserve COMMAND --help` "
    "shows a command's flags, their defaults and variables."
)
PRESETS = ("chatbot", "summarization", "mixed", "codegen")  # loadtest.datasets' and "mixed"


@dataclass(frozen=True)
class GenerateConfig:
    """`pdserve generate`: how every prompt is sampled, and how the results are printed."""

    max_tokens: int = setting(64, "new tokens per prompt")
    temperature: float = setting(0.0, "sampling temperature (0: greedy)")
    top_p: float = setting(1.0, "nucleus sampling: the top tokens of this much probability")
    top_k: int = setting(0, "sample from the k most likely tokens (0: off)")
    n: int = setting(1, "sequences per prompt")
    stop: tuple[str, ...] = setting((), "a stop string (repeatable)", repeat=True)
    ignore_eos: bool = setting(False, "generate exactly --max-tokens")
    sample_seed: int | None = setting(None, "per-request sampling seed")
    json: bool = setting(False, "one JSON line per prompt, with token ids")

    def sampling_params(self) -> SamplingParams:
        from common.sampling_params import SamplingParams

        return SamplingParams(
            temperature=self.temperature,
            top_p=self.top_p,
            top_k=self.top_k,
            max_tokens=self.max_tokens,
            seed=self.sample_seed,
            n=self.n,
            stop=list(self.stop),
            ignore_eos=self.ignore_eos,
        )


@dataclass(frozen=True)
class PlanConfig:
    """`pdserve plan`: the profile (a file, or measured now), the workload, the SLOs and the
    core budget."""

    ttft_slo: float = setting(help="TTFT limit, ms")
    tpot_slo: float = setting(help="TPOT limit, ms")
    profile: str | None = setting(None, "a worker profile JSON (saved by --save-profile)")
    measure: bool = setting(False, "measure the profile now (~1.5 min on 2 cores)")
    save_profile: str | None = setting(None, "with --measure: write the profile to this file")
    measuring: ProfileConfig = field(default_factory=ProfileConfig)
    preset: str | None = setting(
        None, "request lengths of a loadtest preset (mixed: the others, equally)", choices=PRESETS
    )
    isl: int | None = setting(None, "input tokens of every request (with --osl)")
    osl: int | None = setting(None, "output tokens of every request (with --isl)")
    input_scale: float = setting(1.0, "x the preset's input lengths")
    output_scale: float = setting(1.0, "x the preset's output lengths")
    rate: float | None = setting(None, "target req/s: latency at it and pool sizes for it")
    slo_stat: str = setting("p90", "per-request statistic the SLOs bound: pNN (percentile) or mean")
    cores: int = setting(
        help="core budget (the cores this process may use, unless given)",
        default_factory=default_num_threads,
    )
    shared_cores: bool = setting(
        False,
        "the router, Redis or clients run on the workers' cores: recommend one-thread "
        "workers only (see docs/planning.md)",
    )
    json: bool = setting(False, "print the plan as JSON")
    simulate: bool = setting(
        False,
        "check the best layouts and search the router's thresholds with the discrete-event "
        "simulator (docs/simulator.md) at --rate",
    )
    sim_requests: int = setting(400, "with --simulate: requests in the simulated trace")
    sim_seed: int = setting(0, "with --simulate: the trace's seed (the load tester's --seed)")

    def __post_init__(self) -> None:
        if (self.profile is None) == (not self.measure):
            raise ValueError(
                "give either --profile FILE (a measured profile: benchmarks/profiles/ has this "
                "project's, e.g. zen4-2core.json) or --measure (measures this machine, ~1.5 min)"
            )
        lengths = (self.isl is not None, self.osl is not None)
        if (self.preset is None) != (lengths == (True, True)) or (
            any(lengths) and (self.preset or not all(lengths))
        ):
            raise ValueError("give either --preset or --isl and --osl")

    @property
    def workload(self) -> Workload:
        from pdserve.plan import fixed_workload, preset_workload

        if self.preset:
            return preset_workload(self.preset, self.input_scale, self.output_scale)
        assert self.isl is not None and self.osl is not None
        return fixed_workload(self.isl, self.osl)

    @property
    def slo(self) -> SLO:
        from pdserve.plan import SLO

        return SLO(self.ttft_slo / 1e3, self.tpot_slo / 1e3, self.slo_stat)


# `pdserve plan --help`'s sections: the dotted paths of PlanConfig's settings in each.
PLAN_GROUPS = {
    "profile": ("profile", "measure", "save_profile", "measuring"),
    "workload": ("preset", "isl", "osl", "input_scale", "output_scale", "rate"),
    "SLOs and budget": ("ttft_slo", "tpot_slo", "slo_stat", "cores", "shared_cores", "json"),
    "simulation": ("simulate", "sim_requests", "sim_seed"),
}


def add_engine_args(parser: argparse.ArgumentParser, env: Mapping[str, str]) -> None:
    """The engine's settings (every command that runs the engine), in a group of their own."""
    add_settings(parser.add_argument_group("engine"), EngineConfig, env)


def engine_config_from_args(args: argparse.Namespace) -> EngineConfig:
    return build(EngineConfig, args)


def add_worker_args(parser: argparse.ArgumentParser, env: Mapping[str, str]) -> None:
    """A prefill / decode / colocated worker's settings, then its engine's."""
    add_settings(parser.add_argument_group("worker"), WorkerConfig, env, nested=False)
    add_settings(parser.add_argument_group("engine"), EngineConfig, env, prefix="engine.")


def worker_config_from_args(role: str, args: argparse.Namespace) -> WorkerConfig:
    return build(WorkerConfig, args, role=role)


def add_router_args(parser: argparse.ArgumentParser, env: Mapping[str, str]) -> None:
    """The gateway's settings (`pdserve router`)."""
    from router.config import RouterConfig

    add_settings(parser.add_argument_group("router"), RouterConfig, env)


def router_config_from_args(args: argparse.Namespace):  # type: ignore[no-untyped-def]
    from router.config import RouterConfig

    return build(RouterConfig, args)


def cmd_router(args: argparse.Namespace) -> int:
    defer_collection()
    from router.server import run_router

    run_router(router_config_from_args(args))
    return 0


def cmd_router_keeper(args: argparse.Namespace) -> int:
    from pdserve.keeper import run_keeper

    config = router_config_from_args(args)  # the flags checked here, before any child starts
    router_args = args.argv[args.argv.index("router-keeper") + 1 :]
    return run_keeper(config.host, config.port, router_args)


def add_up_args(parser: argparse.ArgumentParser, env: Mapping[str, str]) -> None:
    """`pdserve up`'s (and `serve`'s) own settings, then the router's and the engine's it hands
    on, then vllm serve's flags that have no meaning here (refused, each with its reason)."""
    from pdserve.up_config import ROUTER_SKIP, UpConfig
    from pdserve.vllm_flags import add_refused_flags
    from router.config import RouterConfig

    parser.add_argument(
        "model_path",
        nargs="?",
        metavar="MODEL",
        help="the model, as --model: a Hugging Face directory or a .gguf file, a local path "
        "(default: SmolLM2-135M-Instruct)",
    )
    add_settings(parser.add_argument_group("up"), UpConfig, env, nested=False)
    add_settings(
        parser.add_argument_group("router"), RouterConfig, env, prefix="router.", skip=ROUTER_SKIP
    )
    engine = parser.add_argument_group("engine (every worker)")
    add_settings(engine, EngineConfig, env, prefix="engine.", skip=("num_threads",))
    add_refused_flags(parser)


def up_config_from_args(args: argparse.Namespace):  # type: ignore[no-untyped-def]
    from pdserve.up_config import UpConfig

    positional, flag = getattr(args, "model_path", None), getattr(args, "engine.model")
    if positional is not None and flag is not None and positional != flag:
        raise ValueError(f"two models: {positional} and --model {flag}; give one")
    if positional is not None:
        setattr(args, "engine.model", positional)
    return build(UpConfig, args)


def cmd_up(args: argparse.Namespace) -> int:
    from pdserve.up import run_up

    return run_up(up_config_from_args(args))


def cmd_worker(args: argparse.Namespace) -> int:
    defer_collection()  # before torch is imported
    from services.worker_pool import run_workers

    run_workers(worker_config_from_args(args.command, args))
    return 0


def cmd_generate(args: argparse.Namespace) -> int:
    prompts = args.prompt or [line.rstrip("\n") for line in sys.stdin if line.strip()]
    if not prompts:
        print("error: give prompts as arguments or on standard input", file=sys.stderr)
        return 2
    return generate(prompts, build(GenerateConfig, args), engine_config_from_args(args))


def cmd_demo(args: argparse.Namespace) -> int:
    return generate(DEMO_PROMPTS, GenerateConfig(max_tokens=48), engine_config_from_args(args))


def generate(prompts: list[str], config: GenerateConfig, engine: EngineConfig) -> int:
    """Complete ``prompts`` offline and print the results."""
    from services.engine.llm import LLM

    params = config.sampling_params()
    llm = LLM.from_config(engine)
    start = time.perf_counter()
    outputs = llm.generate(prompts, params, use_tqdm=not config.json)
    elapsed = time.perf_counter() - start
    for out in outputs:
        if config.json:
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
    if not config.json:
        total = sum(len(o.token_ids) for out in outputs for o in out.outputs)
        print(f"\n{total} tokens in {elapsed:.2f}s ({total / elapsed:.1f} tokens/s)")
    return 0


def add_plan_args(parser: argparse.ArgumentParser, env: Mapping[str, str]) -> None:
    """`pdserve plan`'s settings (PlanConfig's, the profile's to measure included), by section."""
    for title, paths in PLAN_GROUPS.items():
        add_settings(parser.add_argument_group(title), PlanConfig, env, only=paths)


def cmd_plan(args: argparse.Namespace) -> int:
    from pathlib import Path

    from pdserve.plan import make_plan
    from pdserve.plan_report import format_plan, plan_dict
    from pdserve.profile import WorkerProfile, measure_profile

    config = build(PlanConfig, args)
    workload, slo = config.workload, config.slo  # bad input fails before a measurement
    if config.measure:
        profile = measure_profile(config.measuring)
        if config.save_profile:
            profile.save(Path(config.save_profile))
    else:
        assert config.profile is not None
        path = Path(config.profile)
        if not path.is_file():
            raise ValueError(
                f"--profile {config.profile}: no such file; make one with `pdserve plan --measure "
                "--save-profile FILE ...`, or use the committed benchmarks/profiles/epyc-2core.json"
            )
        profile = WorkerProfile.load(path)
    plan = make_plan(profile, workload, slo, config.cores, config.rate, config.shared_cores)
    out = plan_dict(plan) if config.json else format_plan(plan)
    if config.simulate:
        from pdserve.sim.search import TraceSpec, check_dict, check_plan, format_check

        spec = TraceSpec(
            preset=config.preset,
            isl=config.isl,
            osl=config.osl,
            input_scale=config.input_scale,
            output_scale=config.output_scale,
            num_requests=config.sim_requests,
            seed=config.sim_seed,
        )
        check = check_plan(profile, plan, spec)
        if isinstance(out, dict):
            out["simulation"] = check_dict(check)
        else:
            out = "\n".join([out, *format_check(check, plan)])
    print(json.dumps(out, indent=2) if isinstance(out, dict) else out)
    return 0


def make_parser(env: Mapping[str, str]) -> argparse.ArgumentParser:
    """The whole command line; ``env`` gives the flags' defaults (``PDSERVE_*``)."""
    parser = argparse.ArgumentParser(prog="pdserve", description=DESCRIPTION)
    parser.add_argument("--version", action="version", version=f"pdserve {_version()}")
    sub = parser.add_subparsers(dest="command", required=True)

    def command(name: str, text: str) -> argparse.ArgumentParser:
        parser = sub.add_parser(name, help=text, description=text, formatter_class=HelpFormatter)
        parser.set_defaults(parser=parser)  # an unknown flag is refused with this usage
        return parser

    gen = command("generate", "complete prompts offline and print the results")
    gen.add_argument("prompt", nargs="*", help="prompts (default: one per line of stdin)")
    add_settings(gen.add_argument_group("sampling and output"), GenerateConfig, env)
    add_engine_args(gen, env)
    gen.set_defaults(func=cmd_generate)

    demo = command("demo", "the offline engine on a few prompts")
    add_engine_args(demo, env)
    demo.set_defaults(func=cmd_demo)

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

    keeper = command(
        "router-keeper",
        "a router on a port this process keeps: SIGUSR1 replaces the router without a lost "
        "request (for a container, docker-compose.yml); same flags as `router`",
    )
    add_router_args(keeper, env)
    keeper.set_defaults(func=cmd_router_keeper)

    up = command("up", "Redis, workers and the router on this machine (what `make up` runs)")
    add_up_args(up, env)
    up.set_defaults(func=cmd_up)

    serve = command(
        "serve",
        "`vllm serve MODEL` for one machine: what `up` runs (Redis, a prefill and a decode "
        "worker, the router), with the flags a vllm serve user types (see docs/vllm-serve.md)",
    )
    add_up_args(serve, env)
    serve.set_defaults(func=cmd_up)

    plan = command("plan", "recommend a deployment from a measured worker profile")
    add_plan_args(plan, env)
    plan.set_defaults(func=cmd_plan)
    return parser


def parse(argv: Sequence[str], env: Mapping[str, str]) -> argparse.Namespace:
    """``argv`` parsed as the ``pdserve`` command parses it (tests use this). An unknown flag
    exits with its command's usage, not the top-level one."""
    args, unknown = make_parser(env).parse_known_args(argv)
    if unknown:
        args.parser.error(f"unrecognized arguments: {' '.join(unknown)}")
    return args


def main(argv: Sequence[str] | None = None) -> int:
    die_with_parent_if_asked()  # a child of `pdserve up` or a test: never outlive it
    try:
        argv = sys.argv[1:] if argv is None else list(argv)
        args = parse(argv, os.environ)
        args.argv = argv  # router-keeper hands its flags on to its router
        return int(args.func(args))
    except ValueError as exc:  # bad input: a clear message, not a traceback
        print(f"error: {exc}", file=sys.stderr)
        return 2


def _version() -> str:
    try:
        return version("pdserve")
    except PackageNotFoundError:  # running from a checkout that was not installed
        return "unknown"


if __name__ == "__main__":
    sys.exit(main())
