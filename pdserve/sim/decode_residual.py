"""The measured decode steps a linear step model cannot follow, put back into the simulator.

A simulated worker's :class:`~services.engine.simulation_profile.StepTimeModel` is a
least-squares line through a measured profile's points (``benchmarks/sim_profile_fit.py``). On
the Zen 4 VM the real engine's decode step is not linear in the batch at small batches: at 1
thread and 32 tokens of context, 1 sequence takes 48.0 ms, 2 take 55.0 ms, 3 take 43.2 ms, 4
40.7 ms and 6 41.4 ms (``benchmarks/profiles/zen4-2core.json``; the same dip at 1,024 tokens and
at 2 threads: the small-batch GEMM kernel's row tiles). The line puts 1-2 sequences 16-25% too
low and 4-6 sequences 7-20% too high. Every batch of 1-8 is measured: a batch between two
measured ones is interpolated, and 3 sequences sit far below the 2-to-4 line.

That error did not stay where it was: ``benchmarks/sim_accuracy.py`` calibrates the decode side
on the sweep's unloaded rows, one sequence at a time, so it took the line's -15% at one
sequence for the machine being slower and added it to every step; a loaded worker, running 4-8
sequences where the line is already too high, then came out 20-35% slow (``disagg-cond`` at
chatbot 4 req/s: TPOT 98 ms against 72 measured).

:class:`DecodeResidualCost` adds to a decode-only step the line's residual at the measured
points (measured - line), piecewise-linear in the batch at each measured context and linear in
the context between them (held beyond the last). Steps with prompt tokens are left as the line
has them: the profile measured no mixed step, and with a prompt chunk in it a step's linears run
more rows than the small-batch path takes (at most 4).
"""

from __future__ import annotations

from dataclasses import dataclass, replace

from pdserve.profile import DecodePoint, interpolate
from pdserve.sim.timing import StepCost, WorkerTiming
from services.engine.simulation_profile import StepTimeModel


@dataclass(frozen=True)
class DecodeResiduals:
    """Measured minus modelled seconds of decode-only steps, per measured context."""

    by_context: dict[int, tuple[list[float], list[float]]]  # context -> (batches, seconds)

    @classmethod
    def of(cls, points: list[DecodePoint], model: StepTimeModel) -> DecodeResiduals:
        by_context: dict[int, list[tuple[float, float]]] = {}
        for p in sorted(points, key=lambda p: (p.context, p.batch_size)):
            modelled = model.seconds([], [p.context] * p.batch_size)
            by_context.setdefault(p.context, []).append((float(p.batch_size), p.seconds - modelled))
        if not by_context:
            raise ValueError("no measured decode points")
        return cls({c: ([b for b, _ in v], [r for _, r in v]) for c, v in by_context.items()})

    def at(self, batch: int, context: float) -> float:
        """The residual of a step of ``batch`` sequences of mean ``context`` tokens."""
        contexts = sorted(self.by_context)
        values = [self._in_batch(c, batch) for c in contexts]
        if context <= contexts[0] or len(contexts) == 1:
            return values[0]
        if context >= contexts[-1]:
            return values[-1]
        return interpolate(context, [float(c) for c in contexts], values)

    def _in_batch(self, context: int, batch: int) -> float:
        batches, seconds = self.by_context[context]
        if batch >= batches[-1]:  # held: the line's slope is fitted out there
            return seconds[-1]
        return interpolate(float(batch), batches, seconds)


class DecodeResidualCost:
    """``inner``'s step cost plus ``residuals`` on decode-only steps (see the module doc)."""

    def __init__(self, inner: StepCost, residuals: DecodeResiduals):
        self.inner, self.residuals = inner, residuals
        self._cache: dict[tuple[int, int], float] = {}  # (batch, context) -> seconds

    def residual(self, batch: int, context: float) -> float:
        key = (batch, round(context))  # a lookup per step: the simulator's hot path
        if key not in self._cache:
            self._cache[key] = self.residuals.at(*key)
        return self._cache[key]

    def seconds(self, prefill_chunks: list[tuple[int, int]], decode_contexts: list[int]) -> float:
        total = self.inner.seconds(prefill_chunks, decode_contexts)
        if prefill_chunks or not decode_contexts:
            return total
        mean = sum(decode_contexts) / len(decode_contexts)
        return max(total + self.residual(len(decode_contexts), mean), 0.0)


def with_decode_residuals(timing: WorkerTiming, residuals: DecodeResiduals) -> WorkerTiming:
    """``timing`` whose decode-only steps take the measured points' time."""
    return replace(timing, step=DecodeResidualCost(timing.step, residuals))
