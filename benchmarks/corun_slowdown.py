"""How much a 1-thread engine's steps slow down while a second 1-thread engine computes on the
other core of the same machine (issue #32: the sweep's ``2xcoloc`` and ``disagg`` configs run two
such workers on a 2-core host; the simulator times each step as if the neighbour core were idle).

What is measured: a float32, 1-thread ``LLMEngine`` (as the sweep's workers: ``--threads 1``,
no prefix caching) pinned to core 0 times
- decode-only steps at batch sizes --batch-sizes (default 1, 4, 16; prompts of --context tokens),
- single-chunk prefill steps of --chunks tokens (default 256 and 1,024; one new request each),
in three arrangements, interleaved case by case and round by round so all three see the same
minutes of the machine: the neighbour core idle; a second process pinned to core 1 decoding
continuously (--neighbour-batch sequences); the same process prefilling continuously (prompts of
--neighbour-chunk tokens, one step each). The neighbours are two processes started once and
paused/resumed with SIGSTOP/SIGCONT, so the measured engine's steps are the same in all three.

Reported: per case and arrangement the median step time, and the ratio co-run / alone. With
--write-profile PATH the ratios (by own phase, decode or prefill, and by what the neighbour does,
the median over the cases) go into a profile file the simulator reads
(``pdserve/sim/corun.py``), with the command and machine.

    python benchmarks/corun_slowdown.py [--rounds 3] [--chunks 256,1024] \
        [--write-profile benchmarks/profiles/zen4-corun.json]
    python benchmarks/corun_slowdown.py --pool RUN1/corun_slowdown.json RUN2/... \
        [--write-profile ...]   # runs of the same cases pooled: each case's medians over all

About 1.5 minutes on the Zen 4 VM (2 cores); needs 2 usable cores and a quiet machine.
Writes benchmarks/results/corun_slowdown.json.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import shlex
import signal
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import torch
from machine import (
    describe_read_scaling,
    machine_info,
)  # benchmarks/machine.py (this folder is on sys.path)

TEXT = (
    "Paged attention stores the key and value cache of every sequence in fixed-size blocks, "
    "so memory is allocated on demand and shared between sequences with a common prefix. "
    "A continuous-batching scheduler decides at every step which sequences run, admitting new "
    "requests as soon as others finish. "
)
MAX_BATCHED_TOKENS = 2048  # the workers' default step budget: every chunk here is one step
NEIGHBOURS = ("idle", "decode", "prefill")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        description=__doc__.splitlines()[0],
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    parser.add_argument("--batch-sizes", default="1,4,16", help="decode batch sizes")
    parser.add_argument("--chunks", default="256,1024", help="prefill chunk sizes (tokens)")
    parser.add_argument("--context", type=int, default=256, help="decode prompt length")
    parser.add_argument("--rounds", type=int, default=3, help="rounds over all cases")
    parser.add_argument("--decode-steps", type=int, default=6, help="per case, round, neighbour")
    parser.add_argument("--neighbour-batch", type=int, default=4)
    parser.add_argument("--neighbour-chunk", type=int, default=512)
    parser.add_argument("--write-profile", type=Path, default=None)
    parser.add_argument("--out-dir", type=Path, default=Path("benchmarks/results"))
    parser.add_argument(
        "--pool",
        type=Path,
        nargs="+",
        default=None,
        help="measure nothing: pool the step times of earlier runs' corun_slowdown.json (each "
        "case's medians over all their rounds) and report and write them as one run",
    )
    parser.add_argument("--neighbour", choices=["decode", "prefill"], help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    args.batch_sizes = [int(n) for n in args.batch_sizes.split(",")]
    args.chunks = [int(n) for n in args.chunks.split(",")]
    return args


def load_engine(max_num_seqs: int, num_blocks: int) -> Any:
    from pdserve import LLM

    return LLM(
        dtype="float32",
        block_size=16,
        num_blocks=num_blocks,
        enable_prefix_caching=False,
        max_num_seqs=max_num_seqs,
        max_num_batched_tokens=MAX_BATCHED_TOKENS,
        num_threads=1,
    ).engine


class Prompts:
    """Distinct prompts of a given length (shifted windows of TEXT), so no two share a prefix."""

    def __init__(self, engine: Any) -> None:
        self.piece = engine.tokenizer.encode(TEXT)
        self.count = 0

    def next(self, length: int) -> list[int]:
        self.count += 1
        shift = self.count % len(self.piece)
        stream = self.piece * (-(-(length + shift) // len(self.piece)) + 1)
        return stream[shift : shift + length]


def run_neighbour(kind: str, args: argparse.Namespace) -> None:
    """Compute forever on this process's core: decode --neighbour-batch sequences (re-added as
    they finish) or prefill one --neighbour-chunk prompt per step."""
    from pdserve import SamplingParams

    engine = load_engine(max(args.neighbour_batch, 1), 2048)
    prompts = Prompts(engine)
    decode = SamplingParams(temperature=0, max_tokens=200, ignore_eos=True)
    prefill = SamplingParams(temperature=0, max_tokens=1, ignore_eos=True)
    print("ready", flush=True)
    while True:
        if kind == "decode":
            while len(engine.scheduler.running) + len(engine.scheduler.waiting) < (
                args.neighbour_batch
            ):
                engine.add_request(f"n{prompts.count}", prompts.next(args.context), decode)
        elif not engine.has_unfinished_requests():
            engine.add_request(f"n{prompts.count}", prompts.next(args.neighbour_chunk), prefill)
        engine.step()


class Neighbours:
    """The two neighbour processes on core 1, paused except while their arrangement is timed."""

    def __init__(self, args: argparse.Namespace) -> None:
        self.procs: dict[str, subprocess.Popen[str]] = {}
        base = [sys.executable, __file__, *sys.argv[1:]]
        for kind in NEIGHBOURS[1:]:
            proc = subprocess.Popen(
                [*base, "--neighbour", kind],
                stdout=subprocess.PIPE,
                text=True,
                preexec_fn=lambda: os.sched_setaffinity(0, {1}),
            )
            self.procs[kind] = proc
        for kind, proc in self.procs.items():
            assert proc.stdout is not None
            if proc.stdout.readline().strip() != "ready":
                raise RuntimeError(f"neighbour {kind} did not start")
            time.sleep(2.0)  # a few of its steps first (warm)
            proc.send_signal(signal.SIGSTOP)

    def run(self, kind: str) -> None:
        if kind in self.procs:
            self.procs[kind].send_signal(signal.SIGCONT)
            time.sleep(0.3)  # it is mid-step when the timing starts

    def pause(self, kind: str) -> None:
        if kind in self.procs:
            self.procs[kind].send_signal(signal.SIGSTOP)

    def close(self) -> None:
        for proc in self.procs.values():
            proc.send_signal(signal.SIGCONT)
            proc.kill()
            proc.wait()


def timed_step(engine: Any) -> float:
    started = time.perf_counter()
    engine.step()
    return time.perf_counter() - started


def measure(args: argparse.Namespace) -> dict[str, dict[str, list[float]]]:
    """Per case ("decode B=4", "prefill 256") and neighbour arrangement: step times in s."""
    from pdserve import SamplingParams

    steps_per_seq = args.rounds * len(NEIGHBOURS) * (args.decode_steps + 1) + 16
    blocks = -(-(args.context + steps_per_seq) // 16) * max(args.batch_sizes) + max(args.chunks)
    engine = load_engine(max(args.batch_sizes), blocks)
    prompts = Prompts(engine)
    neighbours = Neighbours(args)
    times: dict[str, dict[str, list[float]]] = {}
    try:
        decoding = SamplingParams(temperature=0, max_tokens=steps_per_seq, ignore_eos=True)
        one_token = SamplingParams(temperature=0, max_tokens=1, ignore_eos=True)
        for batch in args.batch_sizes:
            case = times.setdefault(f"decode B={batch}", {k: [] for k in NEIGHBOURS})
            ids = [f"d{batch}-{i}" for i in range(batch)]
            for request_id in ids:
                engine.add_request(request_id, prompts.next(args.context), decoding)
            while engine.scheduler.waiting or any(
                s.num_computed_tokens < args.context for s in engine.scheduler.running
            ):
                engine.step()
            for _ in range(3):
                engine.step()  # warm-up
            for _ in range(args.rounds):
                for kind in NEIGHBOURS:
                    neighbours.run(kind)
                    case[kind] += [timed_step(engine) for _ in range(args.decode_steps)]
                    neighbours.pause(kind)
            for request_id in ids:
                engine.abort_request(request_id)
        for chunk in args.chunks:
            case = times.setdefault(f"prefill {chunk}", {k: [] for k in NEIGHBOURS})
            repeats = max(1, 1024 // chunk)
            for round_ in range(args.rounds + 1):  # round 0: warm-up, untimed
                for kind in NEIGHBOURS:
                    neighbours.run(kind)
                    for _ in range(repeats):
                        engine.add_request(f"p{prompts.count}", prompts.next(chunk), one_token)
                        seconds = timed_step(engine)
                        while engine.has_unfinished_requests():
                            engine.step()
                        if round_:
                            case[kind].append(seconds)
                    neighbours.pause(kind)
    finally:
        neighbours.close()
    return times


def pooled(paths: list[Path]) -> tuple[dict[str, dict[str, list[float]]], list[str]]:
    """The step times of earlier runs, case by case and arrangement by arrangement, together;
    and their commands. Only the cases every run has."""
    runs = [json.loads(path.read_text()) for path in paths]
    cases = [c for c in runs[0]["times_s"] if all(c in run["times_s"] for run in runs)]
    times = {
        case: {kind: [t for run in runs for t in run["times_s"][case][kind]] for kind in NEIGHBOURS}
        for case in cases
    }
    return times, [run["command"] for run in runs]


def summarize(times: dict[str, dict[str, list[float]]]) -> dict[str, dict[str, float]]:
    summary = {}
    for case, by_kind in times.items():
        medians = {k: statistics.median(v) for k, v in by_kind.items()}
        summary[case] = {
            **{f"{k}_ms": round(m * 1e3, 2) for k, m in medians.items()},
            **{f"ratio_{k}": round(medians[k] / medians["idle"], 3) for k in NEIGHBOURS[1:]},
        }
    return summary


def factors(summary: dict[str, dict[str, float]]) -> dict[str, float]:
    """Own phase x neighbour's phase -> the median ratio over that phase's cases."""
    out = {}
    for phase in ("decode", "prefill"):
        for kind in NEIGHBOURS[1:]:
            ratios = [s[f"ratio_{kind}"] for c, s in summary.items() if c.startswith(phase)]
            out[f"{phase}_vs_{kind}"] = round(statistics.median(ratios), 3)
    return out


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    torch.set_num_threads(1)
    if args.neighbour:
        run_neighbour(args.neighbour, args)
        return 0
    command = "python " + shlex.join(sys.argv)
    pooled_from: list[str] = []
    if args.pool:
        times, pooled_from = pooled(args.pool)
        machine = json.loads(args.pool[0].read_text())["machine"]
        print(f"$ {command}\npooled from:\n  " + "\n  ".join(pooled_from))
    else:
        if not {0, 1} <= os.sched_getaffinity(0):
            raise SystemExit("needs cores 0 and 1")
        machine = machine_info(1, probe_cores=True)
        print(f"$ {command}\nmachine: {machine['cpu']}, load avg {machine['load_avg_1m_at_start']}")
        print(describe_read_scaling(machine["read_scaling"]))
        os.sched_setaffinity(0, {0})
        times = measure(args)
    summary = summarize(times)
    print(
        f"\n{'case':<16}{'idle ms':>9}{'+decode ms':>12}{'ratio':>7}{'+prefill ms':>13}{'ratio':>7}"
    )
    for case, s in summary.items():
        print(
            f"{case:<16}{s['idle_ms']:>9.1f}{s['decode_ms']:>12.1f}{s['ratio_decode']:>7.3f}"
            f"{s['prefill_ms']:>13.1f}{s['ratio_prefill']:>7.3f}"
        )
    result = {
        "command": command,
        "date": datetime.date.today().isoformat(),
        "machine": machine,
        "factors": factors(summary),
        **({"pooled_from": pooled_from} if pooled_from else {}),
        "summary": summary,
        "times_s": times,
    }
    print(f"factors (own phase vs neighbour's, median over cases): {result['factors']}")
    args.out_dir.mkdir(parents=True, exist_ok=True)
    (args.out_dir / "corun_slowdown.json").write_text(json.dumps(result, indent=1))
    if args.write_profile:
        keys = ("command", "date", "factors", "pooled_from", "summary")
        profile = {k: result[k] for k in keys if k in result}
        profile["machine"] = f"{machine['cpu']}, 2 cores; 1-thread float32 engines on cores 0 and 1"
        args.write_profile.write_text(json.dumps(profile, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
