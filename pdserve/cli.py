"""The ``pdserve`` command line.

Every engine flag also reads an environment variable (``--max-num-seqs`` reads
``PDSERVE_MAX_NUM_SEQS``); a flag on the command line wins. Environment variables are read
here, at the entry point, and nowhere else.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from collections.abc import Sequence
from typing import Any

from services.engine.config import CacheConfig, EngineConfig, SchedulerConfig, default_num_threads
from services.worker.config import WorkerConfig

DEMO_PROMPTS = [
    "The capital of France is",
    "Write a haiku about paged attention:",
    "def fibonacci(n):",
    "Three reasons to split prefill from decode:",
]


def _env(name: str, default: Any) -> Any:
    """The flag's default from ``PDSERVE_<NAME>`` (argparse applies the flag's type to it)."""
    value = os.environ.get("PDSERVE_" + name.upper())
    if value is None:
        return default
    if isinstance(default, bool):
        return value.lower() in ("1", "true", "yes", "on")
    return value


def add_engine_args(parser: argparse.ArgumentParser) -> None:
    """Flags that build an EngineConfig (shared by every command that runs the engine)."""
    g = parser.add_argument_group("engine")
    g.add_argument(
        "--model",
        default=_env("model", None),
        help="HF directory or GGUF file (default: SmolLM2-135M-Instruct)",
    )
    g.add_argument(
        "--dtype", default=_env("dtype", "float32"), choices=["float32", "bfloat16", "float16"]
    )
    g.add_argument(
        "--device",
        default=_env("device", "cpu"),
        help="torch device for the model and KV cache: cpu, cuda, cuda:1 ...",
    )
    g.add_argument(
        "--threads",
        type=int,
        default=_env("threads", default_num_threads()),
        help="torch threads for this process (default: the cores it may run on)",
    )
    g.add_argument("--block-size", type=int, default=_env("block_size", 16))
    g.add_argument(
        "--num-blocks",
        type=int,
        default=_env("num_blocks", None),
        help="KV blocks in the pool (default: from --kv-cache-memory)",
    )
    g.add_argument(
        "--kv-cache-memory",
        type=int,
        default=_env("kv_cache_memory", 1 << 30),
        help="bytes for the KV pool when --num-blocks is not given",
    )
    g.add_argument(
        "--num-swap-blocks",
        type=int,
        default=_env("num_swap_blocks", 0),
        help="host-memory blocks for swap preemption",
    )
    g.add_argument(
        "--no-prefix-caching", action="store_true", default=_env("no_prefix_caching", False)
    )
    g.add_argument("--max-num-seqs", type=int, default=_env("max_num_seqs", 64))
    g.add_argument(
        "--max-num-batched-tokens", type=int, default=_env("max_num_batched_tokens", 2048)
    )
    g.add_argument(
        "--no-chunked-prefill", action="store_true", default=_env("no_chunked_prefill", False)
    )
    g.add_argument(
        "--preemption-mode",
        choices=["recompute", "swap"],
        default=_env("preemption_mode", "recompute"),
    )
    g.add_argument("--max-model-len", type=int, default=_env("max_model_len", None))
    g.add_argument("--seed", type=int, default=_env("seed", 0))
    g.add_argument(
        "--cache-dir",
        default=_env("cache_dir", None),
        help="where converted models are cached (default: ~/.cache/pdserve)",
    )


def engine_config_from_args(args: argparse.Namespace) -> EngineConfig:
    return EngineConfig(
        model=args.model,
        dtype=args.dtype,
        device=args.device,
        num_threads=args.threads,
        max_model_len=args.max_model_len,
        seed=args.seed,
        cache=CacheConfig(
            block_size=args.block_size,
            num_blocks=args.num_blocks,
            kv_cache_memory_bytes=args.kv_cache_memory,
            enable_prefix_caching=not args.no_prefix_caching,
            num_swap_blocks=args.num_swap_blocks,
        ),
        scheduler=SchedulerConfig(
            max_num_seqs=args.max_num_seqs,
            max_num_batched_tokens=args.max_num_batched_tokens,
            enable_chunked_prefill=not args.no_chunked_prefill,
            preemption_mode=args.preemption_mode,
        ),
    )


def add_worker_args(parser: argparse.ArgumentParser) -> None:
    """Flags of a prefill / decode / colocated worker process."""
    g = parser.add_argument_group("worker")
    g.add_argument(
        "--host", default=_env("host", "127.0.0.1"), help="bind address (0.0.0.0 in containers)"
    )
    g.add_argument(
        "--advertise-host",
        default=_env("advertise_host", None),
        help="address peers use to reach this worker (default: --host, or this host's address "
        "when --host is 0.0.0.0 / ::)",
    )
    g.add_argument("--grpc-port", type=int, default=_env("grpc_port", 0), help="0: any free port")
    g.add_argument(
        "--metrics-port",
        type=int,
        default=_env("metrics_port", 0),
        help="Prometheus /metrics port; 0: any free port, -1: off",
    )
    g.add_argument(
        "--kv-transport",
        default=_env("kv_transport", "tcp"),
        choices=["tcp", "torch", "ucx", "shm"],
        help="how KV blocks move (shm: peers on the same host only)",
    )
    g.add_argument(
        "--redis-url",
        default=_env("redis_url", None),
        help="registry; without it the worker does not register",
    )
    g.add_argument("--redis-prefix", default=_env("redis_prefix", "pdserve:"))
    g.add_argument("--heartbeat-seconds", type=float, default=_env("heartbeat_seconds", 1.0))
    g.add_argument("--ttl-seconds", type=float, default=_env("ttl_seconds", 5.0))
    g.add_argument("--worker-id", default=_env("worker_id", None))
    g.add_argument("--lease-seconds", type=float, default=_env("lease_seconds", 5.0))
    g.add_argument("--pull-timeout-seconds", type=float, default=_env("pull_timeout_seconds", 10.0))
    g.add_argument(
        "--on-pull-failure",
        choices=["recompute", "fail"],
        default=_env("on_pull_failure", "recompute"),
    )
    g.add_argument(
        "--no-verify-checksums", action="store_true", default=_env("no_verify_checksums", False)
    )
    g.add_argument("--max-pending-requests", type=int, default=_env("max_pending_requests", 256))
    g.add_argument("--drain-seconds", type=float, default=_env("drain_seconds", 30.0))
    g.add_argument(
        "--kv-faults",
        default=_env("kv_faults", None),
        help="testing only: fail served KV pulls on purpose, e.g. 'drop=0.1,corrupt=0.1'",
    )
    add_observability_args(parser)


def worker_config_from_args(role: str, args: argparse.Namespace) -> WorkerConfig:
    return WorkerConfig(
        role=role,
        engine=engine_config_from_args(args),
        host=args.host,
        advertise_host=args.advertise_host,
        grpc_port=args.grpc_port,
        metrics_port=args.metrics_port,
        kv_transport=args.kv_transport,
        redis_url=args.redis_url,
        redis_prefix=args.redis_prefix,
        heartbeat_seconds=args.heartbeat_seconds,
        ttl_seconds=args.ttl_seconds,
        worker_id=args.worker_id,
        cluster_token=os.environ.get("PDSERVE_CLUSTER_TOKEN") or None,
        lease_seconds=args.lease_seconds,
        pull_timeout_seconds=args.pull_timeout_seconds,
        on_pull_failure=args.on_pull_failure,
        verify_checksums=not args.no_verify_checksums,
        max_pending_requests=args.max_pending_requests,
        drain_seconds=args.drain_seconds,
        trace_file=args.trace_file,
        otlp_endpoint=args.otlp_endpoint or None,
        kv_faults=args.kv_faults or None,
    )


def add_observability_args(parser: argparse.ArgumentParser) -> None:
    """Tracing flags (router and workers)."""
    g = parser.add_argument_group("observability")
    g.add_argument(
        "--trace-file",
        default=_env("trace_file", None),
        help="append finished OpenTelemetry spans to this file as JSON lines",
    )
    g.add_argument(
        "--otlp-endpoint",
        default=_env("otlp_endpoint", os.environ.get("OTEL_EXPORTER_OTLP_ENDPOINT")),
        help="export spans with OTLP/gRPC here (default: $OTEL_EXPORTER_OTLP_ENDPOINT)",
    )


def add_router_args(parser: argparse.ArgumentParser) -> None:
    """Flags of the gateway/router (`pdserve router`)."""
    from router.config import POLICY_NAMES

    g = parser.add_argument_group("router")
    g.add_argument("--host", default=_env("host", "127.0.0.1"), help="bind address")
    g.add_argument("--port", type=int, default=_env("port", 8000), help="0: any free port")
    g.add_argument("--redis-url", default=_env("redis_url", "redis://127.0.0.1:6379/0"))
    g.add_argument("--redis-prefix", default=_env("redis_prefix", "pdserve:"))
    g.add_argument(
        "--model",
        default=_env("model", None),
        help="the model the workers serve (tokenizer, chat template); default SmolLM2",
    )
    g.add_argument("--served-model-name", default=_env("served_model_name", None))
    g.add_argument("--cache-dir", default=_env("cache_dir", None))
    g.add_argument(
        "--api-key",
        default=_env("api_key", None),
        help="require 'Authorization: Bearer KEY' on /v1/* (env PDSERVE_API_KEY)",
    )
    for pool, default in (
        ("prefill", "prefix_aware"),
        ("decode", "least_loaded"),
        ("colocated", "prefix_aware"),
    ):
        g.add_argument(
            f"--{pool}-policy", choices=POLICY_NAMES, default=_env(f"{pool}_policy", default)
        )
    g.add_argument("--prefix-load-weight", type=float, default=_env("prefix_load_weight", 0.5))
    g.add_argument("--max-concurrency", type=int, default=_env("max_concurrency", 512))
    g.add_argument("--max-body-bytes", type=int, default=_env("max_body_bytes", 4 << 20))
    g.add_argument("--max-model-len", type=int, default=_env("max_model_len", None))
    g.add_argument("--max-attempts", type=int, default=_env("max_attempts", 3))
    g.add_argument(
        "--request-timeout-seconds", type=float, default=_env("request_timeout_seconds", 600.0)
    )
    g.add_argument("--ttl-seconds", type=float, default=_env("ttl_seconds", 5.0))
    g.add_argument(
        "--log-requests",
        action="store_true",
        default=_env("log_requests", False),
        help="log each prompt's text (off by default: prompts may be private)",
    )
    g.add_argument(
        "--ttft-slo-seconds",
        type=float,
        default=_env("ttft_slo_seconds", None),
        help="time-to-first-token SLO: export the share of recent requests meeting it "
        "(pdserve_router_slo_attainment) and count those over it (default: off)",
    )
    g.add_argument(
        "--itl-slo-seconds",
        type=float,
        default=_env("itl_slo_seconds", None),
        help="inter-token latency SLO, on each request's mean time between tokens after the "
        "first (TPOT); exported like --ttft-slo-seconds (default: off)",
    )
    add_observability_args(parser)


def router_config_from_args(args: argparse.Namespace):  # type: ignore[no-untyped-def]
    from router.config import RouterConfig

    return RouterConfig(
        host=args.host,
        port=args.port,
        redis_url=args.redis_url,
        redis_prefix=args.redis_prefix,
        model=args.model,
        served_model_name=args.served_model_name,
        cache_dir=args.cache_dir,
        api_key=args.api_key or None,
        cluster_token=os.environ.get("PDSERVE_CLUSTER_TOKEN") or None,
        prefill_policy=args.prefill_policy,
        decode_policy=args.decode_policy,
        colocated_policy=args.colocated_policy,
        prefix_load_weight=args.prefix_load_weight,
        max_concurrency=args.max_concurrency,
        max_body_bytes=args.max_body_bytes,
        max_model_len=args.max_model_len,
        max_attempts=args.max_attempts,
        request_timeout_seconds=args.request_timeout_seconds,
        ttl_seconds=args.ttl_seconds,
        trace_file=args.trace_file,
        otlp_endpoint=args.otlp_endpoint or None,
        log_requests=args.log_requests,
        ttft_slo_seconds=args.ttft_slo_seconds,
        itl_slo_seconds=args.itl_slo_seconds,
    )


def cmd_router(args: argparse.Namespace) -> int:
    from router.server import run_router

    run_router(router_config_from_args(args))
    return 0


def add_up_args(parser: argparse.ArgumentParser) -> None:
    """Flags of `pdserve up` (Redis, workers and router on this machine)."""
    g = parser.add_argument_group("up")
    g.add_argument("--prefill", type=int, default=_env("prefill", None), help="workers (default 1)")
    g.add_argument("--decode", type=int, default=_env("decode", None), help="workers (default 1)")
    g.add_argument(
        "--colocated",
        type=int,
        nargs="?",
        const=1,
        default=_env("colocated", 0),
        help="K colocated workers instead of prefill + decode (alone: 1)",
    )
    g.add_argument("--model", default=_env("model", None), help="default: SmolLM2-135M-Instruct")
    g.add_argument("--port", type=int, default=_env("port", 8000), help="router; 0: any free port")
    g.add_argument(
        "--transport",
        choices=["tcp", "shm", "torch", "ucx"],
        default=_env("transport", "tcp"),
        help="the workers' --kv-transport",
    )
    g.add_argument(
        "--threads",
        type=int,
        default=_env("threads", None),
        help="torch threads per worker (default: the cores split between the workers)",
    )
    g.add_argument("--num-blocks", type=int, default=_env("num_blocks", None))
    g.add_argument("--kv-cache-memory", type=int, default=_env("kv_cache_memory", None))
    g.add_argument("--cache-dir", default=_env("cache_dir", None))
    g.add_argument("--api-key", default=_env("api_key", None), help="the router's --api-key")
    g.add_argument(
        "--ready-timeout",
        type=float,
        default=_env("ready_timeout", 180.0),
        help="seconds to wait for the router's /ready",
    )
    g.add_argument(
        "--restart",
        action="store_true",
        default=_env("restart", False),
        help="restart a component that exits, with a growing backoff (default: stop everything)",
    )
    g.add_argument(
        "--trace-file",
        default=_env("trace_file", None),
        help="every component appends its OpenTelemetry spans to this file as JSON lines",
    )


def cmd_up(args: argparse.Namespace) -> int:
    from pdserve.up import UpConfig, run_up

    return run_up(UpConfig.from_args(args))


def cmd_worker(args: argparse.Namespace) -> int:
    from pathlib import Path

    from services.worker.server import run_worker

    cache_dir = Path(args.cache_dir) if args.cache_dir else None
    run_worker(worker_config_from_args(args.command, args), cache_dir)
    return 0


def _build_llm(args: argparse.Namespace):  # type: ignore[no-untyped-def]
    from pathlib import Path

    from services.engine.llm import LLM

    cache_dir = Path(args.cache_dir) if args.cache_dir else None
    return LLM.from_config(engine_config_from_args(args), cache_dir)


def cmd_generate(args: argparse.Namespace) -> int:
    from services.engine.sampling_params import SamplingParams

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


def add_plan_args(parser: argparse.ArgumentParser) -> None:
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
    g.add_argument("--model", default=_env("model", None), help="default: SmolLM2-135M-Instruct")
    g.add_argument("--cache-dir", default=_env("cache_dir", None))
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
        profile = WorkerProfile.load(Path(args.profile))
    plan = make_plan(profile, workload, slo, args.cores, args.rate, args.shared_cores)
    print(json.dumps(plan_dict(plan), indent=2) if args.json else format_plan(plan))
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="pdserve", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)

    gen = sub.add_parser("generate", help="complete prompts offline and print the results")
    gen.add_argument("prompt", nargs="*", help="prompts (default: one per line of stdin)")
    gen.add_argument("--max-tokens", type=int, default=64)
    gen.add_argument("--temperature", type=float, default=0.0)
    gen.add_argument("--top-p", type=float, default=1.0)
    gen.add_argument("--top-k", type=int, default=0)
    gen.add_argument("--n", type=int, default=1)
    gen.add_argument("--stop", action="append", help="a stop string (repeatable)")
    gen.add_argument("--ignore-eos", action="store_true")
    gen.add_argument("--sample-seed", type=int, default=None, help="per-request sampling seed")
    gen.add_argument("--json", action="store_true", help="one JSON line per prompt, with token ids")
    add_engine_args(gen)
    gen.set_defaults(func=cmd_generate)

    demo = sub.add_parser("demo", help="the offline engine on a few prompts (what `make up` runs)")
    add_engine_args(demo)
    demo.set_defaults(func=lambda a: cmd_generate(_demo_args(a)))

    for role, text in (
        ("prefill", "a prefill worker: computes prompts, serves their KV blocks"),
        ("decode", "a decode worker: pulls KV blocks, runs the continuous batch"),
        ("colocated", "a worker doing both phases in one process (baseline and fallback)"),
    ):
        worker = sub.add_parser(role, help=text)
        add_worker_args(worker)
        add_engine_args(worker)
        worker.set_defaults(func=cmd_worker)

    router = sub.add_parser("router", help="the OpenAI-compatible gateway in front of the workers")
    add_router_args(router)
    router.set_defaults(func=cmd_router)

    up = sub.add_parser("up", help="Redis, workers and the router on this machine (`make up`)")
    add_up_args(up)
    up.set_defaults(func=cmd_up)

    plan = sub.add_parser("plan", help="recommend a deployment from a measured worker profile")
    add_plan_args(plan)
    plan.set_defaults(func=cmd_plan)

    args = parser.parse_args(argv)
    try:
        return int(args.func(args))
    except ValueError as exc:  # bad input: a clear message, not a traceback
        print(f"error: {exc}", file=sys.stderr)
        return 2


def _demo_args(args: argparse.Namespace) -> argparse.Namespace:
    args.prompt = DEMO_PROMPTS
    args.max_tokens, args.temperature, args.top_p, args.top_k, args.n = 48, 0.0, 1.0, 0, 1
    args.stop, args.ignore_eos, args.sample_seed, args.json = None, False, None, False
    return args


if __name__ == "__main__":
    sys.exit(main())
