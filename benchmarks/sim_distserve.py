"""DistServe's headline chatbot comparison, reproduced with pdserve.sim (docs/simulator.md).

The study: DistServe (Zhong et al., OSDI 2024), Fig. 8a - OPT-13B in fp16 on A100-SXM-80GB
GPUs, ShareGPT chatbot requests with Poisson arrivals, SLOs TTFT 0.25 s and TPOT 0.1 s, a
request good when it meets both; the figure compared is the highest **per-GPU** rate at which
90% of requests are good. DistServe ran one prefill instance on 2 GPUs (tensor parallel 2) and
one decode instance on 1 GPU; the baseline, vLLM, one colocated instance on 1 GPU. Every number
taken from the study is in ``PAPER`` with its source.

Here the same comparison runs on the simulator: ``Layout(num_prefill=1, num_decode=1,
disaggregation="always")`` with ``sim-a100-opt13b-tp2`` timing the prefill worker and
``sim-a100-opt13b-tp1`` the decode worker (3 GPUs), against colocated workers timed by
``sim-a100-opt13b-tp1`` (1 GPU as in the paper, and 3 GPUs, the disaggregated layout's count).
Both profiles are rooflines from published figures (benchmarks/profiles/). Scheduler limits
are the study's launch flags (``LIMITS``). Each layout runs the same requests over a grid of
per-GPU rates with the study's protocol - 100 requests per GPU per rate (its client scripts:
vLLM 100, DistServe 300) - repeated over ``--seeds`` request sets and arrival draws and pooled;
the 90% crossing is interpolated as the study's plotting script does. ``--requests-per-gpu
1000`` shows the steady state the study's short runs do not reach.

The trace is synthetic: ShareGPT is not on this machine. ``sharegpt_like`` follows the study's
own sampling (a prompt is the first k messages of a conversation of 3 or more, the answer the
next message, prompt + answer < 2048 tokens) on messages whose mean lengths are the published
ShareGPT figures, with two labelled assumptions (the spread of a message's length and the
number of rounds). ``--prompt-scale`` scales the prompts to show how much the ratio depends on
them; ``--colocated-scheduler mixed`` gives vLLM mixed prefill/decode steps.

    python benchmarks/sim_distserve.py [--requests-per-gpu 100] [--seeds 5] [--prompt-scale 1]
        [--colocated-scheduler prefill-first|mixed] [--plot docs/img/sim_distserve.png]
        [--json benchmarks/results/sim_distserve.json]

About 20 s with the defaults on 2 shared cores (13 rates x 3 layouts x 5 seeds, 195 runs).
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from dataclasses import asdict, dataclass, replace
from pathlib import Path

import numpy as np
from tqdm import tqdm

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from loadtest.arrivals import Schedule  # noqa: E402
from loadtest.datasets import Sample  # noqa: E402
from loadtest.metrics import meets  # noqa: E402
from pdserve.sim.cluster import Layout, simulate  # noqa: E402
from pdserve.sim.results import run_output  # noqa: E402
from pdserve.sim.timing import WorkerTiming, timing_from_simulation_profile  # noqa: E402
from pdserve.sim.trace import trace_from_samples  # noqa: E402
from services.worker.simulation import load_profile  # noqa: E402

ARTIFACT = "https://github.com/LLMServe/DistServe"
PAPER = {
    "slo_ttft_ms": (
        250.0,
        "Table 1 (OSDI version); evaluation/2-benchmark-serving/plot.ipynb "
        "and evaluation/ae-scripts/e2e/_plot.py use 0.25 s for opt-13b-sharegpt",
    ),
    "slo_tpot_ms": (100.0, "Table 1; the same scripts: 0.1 s"),
    "attainment_goal": (0.90, "Sec. 6.1 Metrics; the vertical lines of Fig. 8"),
    "distserve_gpus": (
        3,
        "Appendix B / Table 3: prefill tensor parallel 2, decode 1; "
        "evaluation/2-benchmark-serving/2-start-api-server.py: opt-13b (2, 1, 1, 1)",
    ),
    "vllm_gpus": (1, "Sec. 6.1 Baseline: intra-op 1 for OPT-13B; the same script: vllm 1"),
    "distserve_per_gpu_rate": (
        2.3,
        "Fig. 8a, 90% crossing: 4.6 x vLLM's 0.5 (plot.ipynb cell 2 "
        "prints the ratio; the crossing read off its figure)",
    ),
    "vllm_per_gpu_rate": (
        0.5,
        "Fig. 8a: vLLM's attainment 90, 90, 85, 81, 71, 70, 68, 55% at "
        "0.25 .. 3 req/s per GPU (plot.ipynb cell 3 prints it), crossing at 0.5",
    ),
    "ratio": (
        4.6,
        "Sec. 6.2: 2.0x-4.6x over vLLM for OPT-13B/66B/175B chatbot; plot.ipynb "
        "cell 2: 4.6 for OPT-13B, 2.75 for 66B, 1.99 for 175B",
    ),
    "ratio_arxiv_v2": (
        2.15,
        "arXiv v2 (2401.09670v2) Table 2, real system, OPT-13B ShareGPT: "
        "vLLM 97.0/65.5% at 1.0/1.5 req/s, DistServe-Low 99.3/87.3% at 2.0/2.5 "
        "-> crossings 1.11 and 2.39 (that version: TTFT SLO 0.2 s)",
    ),
}
PAPER_VLLM_CURVE = ([0.25, 0.5, 1, 1.5, 2, 2.25, 2.5, 3], [90, 90, 85, 81, 71, 70, 68, 55])
# DistServe's own points, read off the figure plot.ipynb holds (about +-1 point):
PAPER_DISTSERVE_CURVE = (
    [0.25, 0.5, 1, 1.5, 2, 2.25, 2.5, 3],
    [100, 100, 99.7, 99.7, 93.5, 91.5, 85, 74.5],
)

# Scheduler limits from the study's launch flags (2-start-api-server.py): vLLM
# --max-num-batched-tokens 16384 --max-num-seqs 1024 --block-size 16; DistServe context
# max batch 128 and 8192 tokens per batch, decoding max batch 1024.
LIMITS = {
    "colocated": ("sim-a100-opt13b-tp1", 1024, 16384),
    "prefill": ("sim-a100-opt13b-tp2", 128, 8192),
    "decode": ("sim-a100-opt13b-tp1", 1024, 16384),
}

# ShareGPT message lengths: mean input 161.31 and output 337.99 tokens (OPT tokenizer) in the
# vLLM paper (Kwon et al., SOSP 2023, Sec. 6.1, Fig. 11a); the spread and the rounds are ours.
HUMAN_MEAN_TOKENS, GPT_MEAN_TOKENS = 161.31, 337.99
LENGTH_SIGMA = 1.0  # assumption: a message's length is lognormal with this sigma
MEAN_ROUNDS = 3.5  # assumption: rounds (a human and a gpt message) per conversation, geometric
MAX_CONTEXT = 2048  # OPT's positions; the study drops prompt + answer >= 2048
RATES = (0.25, 0.5, 0.75, 1, 1.25, 1.5, 1.75, 2, 2.25, 2.5, 2.75, 3, 3.5)  # per GPU, req/s


@dataclass(frozen=True)
class Point:
    per_gpu_rate: float
    attainment: float  # both SLOs
    ttft_only: float
    tpot_only: float


@dataclass(frozen=True)
class System:
    name: str
    layout: Layout
    num_gpus: int


SYSTEMS = (
    System(
        "DistServe: 1 prefill (TP2) + 1 decode",
        Layout(num_prefill=1, num_decode=1, disaggregation="always"),
        3,
    ),
    System("vLLM: 1 colocated (paper's baseline)", Layout(num_colocated=1), 1),
    System("vLLM: 3 colocated (same GPUs)", Layout(num_colocated=3), 3),
)


def message_tokens(rng: np.random.Generator, mean: float) -> int:
    mu = math.log(mean) - LENGTH_SIGMA**2 / 2  # so that the lognormal's mean is ``mean``
    return max(1, round(rng.lognormal(mu, LENGTH_SIGMA)))


def sharegpt_like(num: int, seed: int = 0, prompt_scale: float = 1.0) -> list[Sample]:
    """``num`` requests sampled as the study samples ShareGPT (0-prepare-dataset.py): keep
    conversations of 3+ messages, pick k in 1..T-1, the prompt is the first k messages joined by
    newlines, the answer message k; drop prompt + answer >= 2048 tokens."""
    rng = np.random.default_rng(seed)
    samples: list[Sample] = []
    while len(samples) < num:
        rounds = int(rng.geometric(1 / MEAN_ROUNDS))
        means = [HUMAN_MEAN_TOKENS, GPT_MEAN_TOKENS] * rounds
        lengths = [message_tokens(rng, m) for m in means]
        if len(lengths) < 3:
            continue
        k = int(rng.integers(1, len(lengths)))
        prompt = round((sum(lengths[:k]) + k - 1) * prompt_scale)
        answer = lengths[k]
        if (prompt < 4 and answer < 4) or prompt + answer >= MAX_CONTEXT:
            continue
        samples.append(Sample("", max(1, prompt), answer, kind="sharegpt-like"))
    return samples


def worker_timings(colocated_scheduler: str = "prefill-first") -> dict[str, WorkerTiming]:
    """Each role's profile and scheduler limits (``LIMITS``). The colocated worker schedules as
    the study's vLLM did (``prefill-first``: a step with prompts has no decodes, vLLM v0) or
    mixes decodes and prompts in one step (``mixed``: pdserve's and vLLM v1's rule)."""
    timings = {
        role: timing_from_simulation_profile(
            load_profile(name), block_size=16, max_num_seqs=seqs, max_num_batched_tokens=tokens
        )
        for role, (name, seqs, tokens) in LIMITS.items()
    }
    if colocated_scheduler not in ("prefill-first", "mixed"):
        raise ValueError(f"colocated_scheduler: prefill-first or mixed, got {colocated_scheduler}")
    first = colocated_scheduler == "prefill-first"
    timings["colocated"] = replace(timings["colocated"], prefill_first=first)
    return timings


def run_point(
    system: System,
    timings: dict[str, WorkerTiming],
    per_gpu_rate: float,
    requests_per_gpu: int = 100,
    seeds: int = 1,
    prompt_scale: float = 1.0,
) -> Point:
    """``requests_per_gpu`` x GPUs requests at ``per_gpu_rate`` x GPUs req/s (Poisson), once
    per seed (its own requests and gaps): the share of all of them within both SLOs, within the
    TTFT one and within the TPOT one."""
    rate = per_gpu_rate * system.num_gpus
    results = []
    for seed in range(seeds):
        samples = sharegpt_like(requests_per_gpu * system.num_gpus, seed, prompt_scale)
        trace = trace_from_samples(samples, Schedule(rate=rate), seed)
        result = simulate(trace, system.layout, timings["colocated"], timings)
        results += run_output(trace, result).results
    ttft, tpot = PAPER["slo_ttft_ms"][0], PAPER["slo_tpot_ms"][0]

    def share(slos: dict[str, float]) -> float:
        return sum(meets(r, slos) for r in results) / len(results)

    return Point(
        per_gpu_rate,
        share({"ttft": ttft, "tpot": tpot}),
        share({"ttft": ttft}),
        share({"tpot": tpot}),
    )


def crossing(rates: list[float], attainments: list[float], goal: float) -> float | None:
    """The first rate where attainment crosses ``goal``, linearly interpolated (as the study's
    _plot.py finds its vertical lines); 0.0 when already below it at the lowest rate, None when
    never below it (the rate is beyond the grid)."""
    points = list(zip(rates, attainments, strict=True))
    if points and points[0][1] < goal:
        return 0.0
    for (x0, y0), (x1, y1) in zip(points, points[1:], strict=False):
        if (y0 < goal) != (y1 < goal):
            return x0 + (goal - y0) * (x1 - x0) / (y1 - y0)
    return None


def sweep(
    system: System,
    timings: dict[str, WorkerTiming],
    rates: list[float],
    requests_per_gpu: int = 100,
    seeds: int = 1,
    prompt_scale: float = 1.0,
    progress: tqdm | None = None,
) -> list[Point]:
    points = []
    for rate in rates:
        points.append(run_point(system, timings, rate, requests_per_gpu, seeds, prompt_scale))
        if progress is not None:
            progress.update(1)
    return points


def max_per_gpu_rate(points: list[Point], goal: float) -> float | None:
    return crossing([p.per_gpu_rate for p in points], [p.attainment for p in points], goal)


def describe_samples(samples: list[Sample]) -> dict[str, float]:
    prompts = np.array([s.prompt_len for s in samples])
    answers = np.array([s.max_tokens for s in samples])
    return {
        "prompt_mean": float(prompts.mean()),
        "prompt_median": float(np.median(prompts)),
        "prompt_p90": float(np.percentile(prompts, 90)),
        "answer_mean": float(answers.mean()),
        "answer_median": float(np.median(answers)),
        "answer_p90": float(np.percentile(answers, 90)),
    }


def plot(path: Path, curves: dict[str, list[Point]], goal: float) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7.5, 4.2))
    colors = {SYSTEMS[0].name: "C0", SYSTEMS[1].name: "C1", SYSTEMS[2].name: "C2"}
    for name, points in curves.items():
        ax.plot(
            [p.per_gpu_rate for p in points],
            [100 * p.attainment for p in points],
            marker="o",
            color=colors.get(name),
            label=f"pdserve.sim - {name}",
        )
    ax.plot(
        *PAPER_DISTSERVE_CURVE,
        "--",
        marker="s",
        color="C0",
        alpha=0.6,
        label="DistServe paper (Fig. 8a, read off)",
    )
    ax.plot(
        *PAPER_VLLM_CURVE,
        "--",
        marker="s",
        color="C1",
        alpha=0.6,
        label="vLLM in the paper (Fig. 8a)",
    )
    ax.axhline(100 * goal, color="grey", linestyle=":")
    ax.set_xlabel("per-GPU rate (req/s)")
    ax.set_ylabel("SLO attainment (%)")
    ax.set_ylim(0, 105)
    ax.set_title("OPT-13B, ShareGPT-like chatbot, TTFT 0.25 s / TPOT 0.1 s")
    ax.legend(fontsize=7, loc="lower left")
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)


def print_table(rates: list[float], curves: dict[str, list[Point]]) -> None:
    ttft, tpot = PAPER["slo_ttft_ms"][0], PAPER["slo_tpot_ms"][0]
    print(
        f"\nSLO attainment % per GPU rate (TTFT {ttft:g} ms, TPOT {tpot:g} ms): both (ttft, tpot)"
    )
    print(f"{'rate/GPU':>8s} " + " ".join(f"{s.name[:30]:>30s}" for s in SYSTEMS))
    for i, rate in enumerate(rates):
        cells = [curves[s.name][i] for s in SYSTEMS]
        text = [
            f"{100 * p.attainment:5.1f} ({100 * p.ttft_only:3.0f}, {100 * p.tpot_only:3.0f})"
            for p in cells
        ]
        print(f"{rate:8.2f} " + " ".join(f"{t:>30s}" for t in text))


def compare(best: dict[str, float | None], goal: float) -> dict[str, float | None]:
    """Print ours beside the paper's; returns the two ratios."""
    dist, vllm1, vllm3 = (best[s.name] for s in SYSTEMS)
    ratio1 = dist / vllm1 if dist and vllm1 else None
    ratio3 = dist / vllm3 if dist and vllm3 else None
    rows = [
        ("DistServe (3 GPUs)", dist, f"{PAPER['distserve_per_gpu_rate'][0]:.2f}"),
        ("vLLM (1 GPU)", vllm1, f"{PAPER['vllm_per_gpu_rate'][0]:.2f}"),
        ("vLLM (3 GPUs, least loaded)", vllm3, "-"),
        ("ratio DistServe / vLLM x1", ratio1, f"{PAPER['ratio'][0]:.2f}"),
        ("ratio DistServe / vLLM x3", ratio3, "-"),
    ]
    print(f"\nmax per-GPU rate at {goal:.0%} attainment   ours   paper")
    for name, ours, theirs in rows:
        print(f"  {name:34s} {fmt(ours):>5s}  {theirs:>6s}")
    print(f"  (the paper's arXiv v2: {PAPER['ratio_arxiv_v2'][0]:.2f}x)")
    return {"ratio_vs_vllm_x1": ratio1, "ratio_vs_vllm_x3": ratio3}


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=(__doc__ or "").split("\n\n")[0])
    parser.add_argument(
        "--requests-per-gpu", type=int, default=100, help="per rate and seed (the study: 100)"
    )
    parser.add_argument("--seeds", type=int, default=5, help="runs per rate, pooled")
    parser.add_argument("--prompt-scale", type=float, default=1.0)
    parser.add_argument("--rates", default=",".join(map(str, RATES)), help="per-GPU req/s")
    parser.add_argument("--json", type=Path, default=ROOT / "benchmarks/results/sim_distserve.json")
    parser.add_argument("--plot", type=Path, default=None)
    parser.add_argument(
        "--colocated-scheduler",
        choices=("prefill-first", "mixed"),
        default="prefill-first",
        help="vLLM v0's (the study's) or mixed steps",
    )
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    command = "python benchmarks/sim_distserve.py " + " ".join(
        sys.argv[1:] if argv is None else argv
    )
    print(f"$ {command}")
    goal = PAPER["attainment_goal"][0]
    rates = [float(r) for r in args.rates.split(",")]
    lengths = describe_samples(sharegpt_like(10_000, 0, args.prompt_scale))
    print("trace: " + ", ".join(f"{k} {v:.0f}" for k, v in lengths.items()))
    timings = worker_timings(args.colocated_scheduler)
    curves: dict[str, list[Point]] = {}
    with tqdm(total=len(rates) * len(SYSTEMS), unit="run", file=sys.stderr) as progress:
        for system in SYSTEMS:
            curves[system.name] = sweep(
                system,
                timings,
                rates,
                args.requests_per_gpu,
                args.seeds,
                args.prompt_scale,
                progress,
            )
    print_table(rates, curves)
    best = {name: max_per_gpu_rate(points, goal) for name, points in curves.items()}
    ratios = compare(best, goal)
    report = {
        "command": command,
        "paper": {k: {"value": v, "source": s} for k, (v, s) in PAPER.items()},
        "colocated_scheduler": args.colocated_scheduler,
        "trace": {"requests_per_gpu": args.requests_per_gpu, "seeds": args.seeds, **lengths},
        "prompt_scale": args.prompt_scale,
        "curves": {name: [asdict(p) for p in points] for name, points in curves.items()},
        "max_per_gpu_rate": best,
        **ratios,
    }
    args.json.parent.mkdir(parents=True, exist_ok=True)
    args.json.write_text(json.dumps(report, indent=1) + "\n")
    print(f"wrote {args.json}")
    if args.plot:
        plot(args.plot, curves, goal)
        print(f"wrote {args.plot}")
    return 0


def fmt(value: float | None) -> str:
    return "-" if value is None else f"{value:.2f}"


if __name__ == "__main__":
    sys.exit(main())
