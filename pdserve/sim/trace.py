"""The simulator's input: when each request arrives, its prompt length and output length.

A trace is built the way the load tester sends one, so the same seeds give the same requests:
the samples come from ``loadtest.datasets`` (``load(DatasetConfig)``, or any list of
``Sample``), the send times from ``loadtest.arrivals.offsets(Schedule, n, default_rng(seed))``,
exactly as ``loadtest.client.run`` draws them. Outputs are exact lengths (``ignore_eos``), as in
the project's benchmarks.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from loadtest.arrivals import Schedule, offsets
from loadtest.datasets import DatasetConfig, Sample, load


@dataclass(frozen=True)
class TraceRequest:
    index: int
    arrival_s: float  # from the first send
    prompt_tokens: int
    output_tokens: int


@dataclass(frozen=True)
class Trace:
    requests: tuple[TraceRequest, ...]
    schedule: Schedule

    @property
    def num_requests(self) -> int:
        return len(self.requests)


def trace_from_samples(samples: list[Sample], schedule: Schedule, seed: int = 0) -> Trace:
    """``samples`` sent on ``schedule`` with the load tester's arrival draw for ``seed``."""
    times = offsets(schedule, len(samples), np.random.default_rng(seed))
    requests = tuple(
        TraceRequest(i, t, max(1, s.prompt_len), max(1, s.max_tokens))
        for i, (s, t) in enumerate(zip(samples, times, strict=True))
    )
    return Trace(requests, schedule)


def scale_samples(samples: list[Sample], input_scale: float, output_scale: float) -> list[Sample]:
    """Lengths scaled as ``pdserve plan --input-scale/--output-scale`` scale a preset's."""
    return [
        Sample(
            "",
            max(1, round(s.prompt_len * input_scale)),
            max(1, round(s.max_tokens * output_scale)),
        )
        for s in samples
    ]


def preset_trace(
    preset: str,
    num_requests: int,
    rate: float,
    seed: int = 0,
    input_scale: float = 1.0,
    output_scale: float = 1.0,
    burstiness: float = 1.0,
) -> Trace:
    """A loadtest dataset (a preset, ``mixed`` or ``random``) at ``rate`` req/s: the requests
    ``pdserve-loadtest --dataset-name PRESET --num-prompts N --seed SEED`` sends."""
    samples = load(DatasetConfig(name=preset, num_prompts=num_requests, seed=seed))
    if (input_scale, output_scale) != (1.0, 1.0):
        samples = scale_samples(samples, input_scale, output_scale)
    return trace_from_samples(samples, Schedule(rate=rate, burstiness=burstiness), seed)
