"""How long a simulated worker's steps and KV transfers take, and what it holds.

A :class:`WorkerTiming` is what :mod:`pdserve.sim` knows about one worker: a step cost (seconds
of one engine step from the prefill chunks and decode sequences in it), its KV pool in blocks,
its scheduler limits, and the link its KV is pulled over. It is built from either profile
format the project has:

- a measured :class:`~pdserve.profile.WorkerProfile` (``pdserve plan --measure``, e.g.
  ``benchmarks/profiles/epyc-2core.json``): :class:`CurveStepCost` reads its curves at one
  thread count, as ``pdserve plan``'s closed-form model does;
- a :class:`~services.engine.simulation_profile.SimulationProfile` (the simulated workers'
  ``benchmarks/profiles/sim-*.json``, #32 item 1): its linear :class:`StepTimeModel` is used as
  it is, so the simulator and a simulated-worker cluster time a step alike.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

from pdserve.profile import ThreadProfile, WorkerProfile, interpolate
from services.engine.simulation_profile import SimulationProfile


class StepCost(Protocol):
    def seconds(self, prefill_chunks: list[tuple[int, int]], decode_contexts: list[int]) -> float:
        """``prefill_chunks``: (tokens already computed, tokens computed now) per prompt;
        ``decode_contexts``: each decoding sequence's context, its new token included."""
        ...


class CurveStepCost:
    """A step's seconds from a measured profile's curves at one thread count.

    A step costs its fixed part ``F = D(1, 0)`` (a one-token step) once, plus what each part adds
    to it: a decode batch ``D(B, mean context) - F``, a prefill chunk of ``n`` tokens after
    ``start`` computed ones ``P(start + n) - P(start)``, where ``P`` is the profile's prefill
    curve with ``P(0) = F`` (linear up to its first point). So a prompt alone costs ``P(n)``, a
    decode batch alone ``D``, and a mixed step the sum less the fixed part counted twice, as
    ``pdserve.plan.marginal_prefill`` has it.
    """

    def __init__(self, curve: ThreadProfile):
        self.curve = curve
        self.fixed = curve.decode_step_time(1, 0)
        self._xs = [0.0, *(float(n) for n in curve.prefill_tokens)]
        self._ys = [self.fixed, *curve.prefill_seconds]
        self._decode: dict[tuple[int, int], float] = {}  # (batch, context // 16) -> seconds

    def prefill(self, tokens: int) -> float:
        return interpolate(float(tokens), self._xs, self._ys)

    def decode(self, batch: int, context: float) -> float:
        key = (batch, int(context) // 16)
        if key not in self._decode:  # a lookup per step is the simulator's hot path
            self._decode[key] = self.curve.decode_step_time(batch, key[1] * 16 + 8)
        return self._decode[key]

    def seconds(self, prefill_chunks: list[tuple[int, int]], decode_contexts: list[int]) -> float:
        if not prefill_chunks and not decode_contexts:
            return 0.0
        total = self.fixed
        if decode_contexts:
            mean = sum(decode_contexts) / len(decode_contexts)
            total += max(self.decode(len(decode_contexts), mean) - self.fixed, 0.0)
        for start, n in prefill_chunks:
            total += max(self.prefill(start + n) - self.prefill(start), 0.0)
        return total


@dataclass(frozen=True)
class WorkerTiming:
    """One simulated worker: step cost, KV pool, scheduler limits, KV link."""

    name: str
    step: StepCost
    block_size: int
    num_blocks: int
    max_num_seqs: int
    max_num_batched_tokens: int
    kv_bytes_per_token: float
    transfer_latency_s: float
    transfer_bytes_per_s: float
    prefill_first: bool = False  # steps with prompts carry no decodes (vLLM v0's scheduler)

    def blocks_for(self, tokens: int) -> int:
        return -(-tokens // self.block_size)

    def transfer_seconds(self, num_blocks: int) -> float:
        """A pull of ``num_blocks`` blocks: latency + bytes / bandwidth."""
        if num_blocks <= 0:
            return 0.0
        num_bytes = num_blocks * self.block_size * self.kv_bytes_per_token
        return self.transfer_latency_s + num_bytes / self.transfer_bytes_per_s


def timing_from_worker_profile(
    profile: WorkerProfile, threads: int = 1, max_num_batched_tokens: int | None = None
) -> WorkerTiming:
    """A worker of ``threads`` torch threads as ``profile`` measured it."""
    return WorkerTiming(
        name=f"{profile.model} ({threads} thread{'s' if threads > 1 else ''})",
        step=CurveStepCost(profile.for_threads(threads)),
        block_size=profile.block_size,
        num_blocks=profile.kv_pool_tokens // profile.block_size,
        max_num_seqs=profile.max_num_seqs,
        max_num_batched_tokens=max_num_batched_tokens or profile.max_num_batched_tokens,
        kv_bytes_per_token=profile.kv_bytes_per_token,
        transfer_latency_s=profile.transfer_latency_s,
        transfer_bytes_per_s=profile.transfer_gbps * 1e9,
    )


def timing_from_simulation_profile(
    profile: SimulationProfile,
    block_size: int = 16,
    max_num_seqs: int = 64,
    max_num_batched_tokens: int = 2048,
) -> WorkerTiming:
    """A worker as a simulated worker with ``profile`` runs it (the engine's default limits)."""
    return WorkerTiming(
        name=profile.name,
        step=profile.step,
        block_size=block_size,
        num_blocks=profile.num_blocks(block_size),
        max_num_seqs=max_num_seqs,
        max_num_batched_tokens=max_num_batched_tokens,
        kv_bytes_per_token=profile.kv_bytes_per_token,
        transfer_latency_s=profile.transfer_latency_s,
        transfer_bytes_per_s=profile.transfer_bytes_per_s,
    )


def with_limits(
    timing: WorkerTiming,
    num_blocks: int | None = None,
    max_num_seqs: int | None = None,
    max_num_batched_tokens: int | None = None,
) -> WorkerTiming:
    """``timing`` with another KV pool or scheduler limits (None: unchanged)."""
    from dataclasses import replace

    limits = {
        "num_blocks": num_blocks or timing.num_blocks,
        "max_num_seqs": max_num_seqs or timing.max_num_seqs,
        "max_num_batched_tokens": max_num_batched_tokens or timing.max_num_batched_tokens,
    }
    if min(limits.values()) < 1:
        raise ValueError(f"limits must be >= 1, got {limits}")
    return replace(
        timing,
        num_blocks=limits["num_blocks"],
        max_num_seqs=limits["max_num_seqs"],
        max_num_batched_tokens=limits["max_num_batched_tokens"],
    )
