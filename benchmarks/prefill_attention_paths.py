"""The engine's two prefill attention paths, timed: one fresh prompt alone in a step (causal
SDPA) against two prompts of different lengths in one step (padded into one batch under an
explicit mask; fresh prompts of one length take the causal path together).

What is measured: the time of ``kernels.reference.paged_attention_prefill`` (the CPU engine's
prefill attention; wrapped with a timer from this script, the engine unchanged), summed over
the layers of one real engine step, for a prompt of N tokens alone and for prompts of N and N - 1
in one step (prefix caching off, one output token each). Printed: the medians over --repeats, the
cost per query-key pair on each path (N (N + 1) / 2 causal pairs; 2 x N x N padded pairs) and
their ratio, which ``pdserve.sim.padded_prefill`` uses (``PADDED_PAIR_RATIO``). A ratio of two
times measured back to back, so a machine slowed alike for both (a shared one) still gives it.

    python benchmarks/prefill_attention_paths.py [--threads 1] [--tokens 768] [--repeats 5]

``--mixed 1024,192,192,96,96,97`` instead times one step of prompts of those lengths with the
engine's length groups (``kernels.reference.length_groups``) against all of them padded into one
call (the engine before), alternating, and prints both and their ratio.

About 30 s at 1 thread and 768 tokens. Pin it for a steadier figure (``taskset -c 1``).
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import kernels.cpu_ops as cpu_ops  # noqa: E402
import kernels.reference as reference  # noqa: E402

TEXT = "The quick brown fox jumps over the lazy dog while the cat sleeps. " * 200


class AttentionTimer:
    """Sums the time of every prefill attention call while installed."""

    def __init__(self) -> None:
        self.seconds = 0.0
        self.original = reference.paged_attention_prefill

    def __call__(self, *args: Any) -> Any:
        started = time.perf_counter()
        out = self.original(*args)
        self.seconds += time.perf_counter() - started
        return out

    def install(self) -> None:
        # both the compiled CPU backend and the reference backend call the reference's prefill
        cpu_ops.CpuKernels.paged_attention_prefill = staticmethod(self)  # type: ignore[assignment,arg-type]
        reference.paged_attention_prefill = self  # type: ignore[assignment]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=(__doc__ or "").split("\n\n")[0])
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--tokens", type=int, default=768, help="N, each prompt's length")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--mixed", help="prompt lengths of one step, comma-separated (see above)")
    args = parser.parse_args(argv)
    timer = AttentionTimer()
    timer.install()
    from pdserve import LLM, SamplingParams

    engine = LLM(
        num_threads=args.threads, enable_prefix_caching=False, max_num_batched_tokens=2048
    ).engine
    tokens = engine.tokenizer.encode(TEXT)
    params = SamplingParams(temperature=0, max_tokens=1, ignore_eos=True)
    sent = 0

    def step_of(lengths: list[int]) -> tuple[float, float]:
        """The attention's seconds and the whole step's, of one step with these prompts."""
        nonlocal sent
        for n in lengths:
            sent += 1  # a different window of the text each time: nothing shared
            engine.add_request(f"r{sent}", tokens[sent : sent + n], params)
        timer.seconds = 0.0
        started = time.perf_counter()
        engine.step()
        step_s, seconds = time.perf_counter() - started, timer.seconds
        while engine.has_unfinished_requests():
            engine.step()
        return seconds, step_s

    def attention_of_one_step(lengths: list[int]) -> float:
        return step_of(lengths)[0]

    attention_of_one_step([64])  # warm-up
    if args.mixed:
        return compare_grouping([int(n) for n in args.mixed.split(",")], args.repeats, step_of)
    n = args.tokens
    alone, two = [], []
    for _ in range(args.repeats):
        alone.append(attention_of_one_step([n]))
        two.append(attention_of_one_step([n, n - 1]))  # padded to N x N each
    a, b = statistics.median(alone), statistics.median(two)
    causal, padded = a / (n * (n + 1) / 2), b / (2 * n * n)
    print(f"threads {args.threads}, N {n}: prefill attention of one prompt alone {a * 1e3:.0f} ms,")
    print(f"  of two in one step {b * 1e3:.0f} ms ({b / (2 * a):.2f}x the two apart)")
    print(f"  per causal pair {causal * 1e9:.1f} ns, per padded pair {padded * 1e9:.1f} ns")
    print(f"  padded / causal cost per pair: {padded / causal:.2f}")
    return 0


def compare_grouping(lengths: list[int], repeats: int, step_of: Any) -> int:
    """One step of ``lengths``, with the engine's length groups and with one padded call."""
    if sum(lengths) > 2048:
        raise SystemExit("--mixed: at most 2,048 tokens, one step's budget")
    grouped = reference.length_groups

    def one_call(q_lens: list[int], _: list[int]) -> list[list[int]]:
        return [list(range(len(q_lens)))]

    times: dict[str, list[tuple[float, float]]] = {"grouped": [], "one call": []}
    for _ in range(repeats):
        for name, groups in (("grouped", grouped), ("one call", one_call)):
            reference.length_groups = groups  # type: ignore[assignment]
            times[name].append(step_of(lengths))
    reference.length_groups = grouped  # type: ignore[assignment]
    print(f"prompts {lengths} in one step, groups {grouped(lengths, lengths)}:")
    medians = {}
    for name, runs in times.items():
        medians[name] = [statistics.median(r[i] for r in runs) for i in (0, 1)]
        attention, step = medians[name]
        print(f"  {name:8s}: attention {attention * 1e3:7.0f} ms, step {step * 1e3:7.0f} ms")
    (ga, gs), (oa, os_) = medians["grouped"], medians["one call"]
    print(f"  grouped / one call: attention {ga / oa:.2f}x, step {gs / os_:.2f}x")
    return 0


if __name__ == "__main__":
    sys.exit(main())
