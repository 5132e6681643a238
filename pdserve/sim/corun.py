"""Steps slowed by another worker computing on the same host at the same time (issue #32).

A profile times each step with the rest of the machine idle. Two 1-thread workers on one 2-core
host (the recorded sweep's ``2xcoloc`` and ``disagg``) share its memory bandwidth and L3: a
decode step, bound by the weights' read, takes longer while the other core reads its own
weights too. ``benchmarks/corun_slowdown.py`` measures that as co-run / alone step times, by the
step's phase (decode-only, or with a prompt chunk) and by what the other worker does; the
factors are kept in a profile file such as ``benchmarks/profiles/zen4-corun.json``.

The rule, kept simple: a step started while another worker of the deployment is inside a step
lasts ``factor(own phase, that step's phase)`` times its profiled time (with several busy
neighbours, the largest factor: only pairs were measured). It is decided when the step starts:
a step that began with the host idle keeps its time when a neighbour starts later, and one that
began beside a busy neighbour keeps the factor when that neighbour stops. Without factors
(``CoRun()``, every factor 1) nothing changes.

A prompt step of few tokens reads all the weights for few rows, as a decode step does, so a
decoding neighbour slows it more than a long prompt's compute-bound step. Where the profile
measured prompt steps of several sizes (``corun_slowdown.py --chunks 16,32,...``),
``CoRun.load(path, by_prompt_tokens=True)`` takes ``prefill_vs_decode`` from that curve at the
step's prompt tokens (interpolated in their logarithm, held flat past the ends).
"""

from __future__ import annotations

import json
import math
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path

from pdserve.sim.worker import StepPlan


def phase(plan: StepPlan) -> str:
    """``prefill`` for a step with a prompt chunk in it, ``decode`` for a decode-only step."""
    return "prefill" if plan.chunks else "decode"


@dataclass(frozen=True)
class CoRun:
    """Step-time factors while a neighbour computes: ``<own phase>_vs_<neighbour's phase>``."""

    decode_vs_decode: float = 1.0
    decode_vs_prefill: float = 1.0
    prefill_vs_decode: float = 1.0
    prefill_vs_prefill: float = 1.0
    # (prompt tokens, factor) ascending: a prompt step beside a decoding neighbour, by its size
    prefill_vs_decode_by_tokens: tuple[tuple[int, float], ...] = ()

    @classmethod
    def load(cls, path: Path, by_prompt_tokens: bool = False) -> CoRun:
        """The ``factors`` of a file written by ``benchmarks/corun_slowdown.py``; with
        ``by_prompt_tokens``, also its prompt steps' ratios beside a decoding neighbour."""
        data = json.loads(Path(path).read_text())
        factors = {k: float(v) for k, v in data["factors"].items()}
        curve: tuple[tuple[int, float], ...] = ()
        if by_prompt_tokens:
            curve = tuple(
                sorted(
                    (int(case.split()[1]), float(row["ratio_decode"]))
                    for case, row in data["summary"].items()
                    if case.startswith("prefill ")
                )
            )
        return cls(**factors, prefill_vs_decode_by_tokens=curve)

    @property
    def slows(self) -> bool:
        """Whether any step is slowed at all (``CoRun()``: none is)."""
        factors = [self.decode_vs_decode, self.decode_vs_prefill]
        factors += [self.prefill_vs_decode, self.prefill_vs_prefill]
        factors += [factor for _, factor in self.prefill_vs_decode_by_tokens]
        return any(factor != 1.0 for factor in factors)

    def factor(self, own: StepPlan, neighbours: Iterable[StepPlan]) -> float:
        """How much longer ``own`` takes beside the steps ``neighbours`` are computing."""
        factors = [self._pair(own, n) for n in neighbours]
        return max(factors, default=1.0)

    def _pair(self, own: StepPlan, neighbour: StepPlan) -> float:
        mine, theirs = phase(own), phase(neighbour)
        if mine == "prefill" and theirs == "decode" and self.prefill_vs_decode_by_tokens:
            return self._by_tokens(sum(tokens for _, _, tokens in own.chunks))
        return float(getattr(self, f"{mine}_vs_{theirs}"))

    def _by_tokens(self, tokens: int) -> float:
        curve = self.prefill_vs_decode_by_tokens
        if tokens <= curve[0][0]:
            return curve[0][1]
        for (x0, y0), (x1, y1) in zip(curve, curve[1:]):
            if tokens <= x1:
                where = math.log(tokens / x0) / math.log(x1 / x0)
                return y0 + where * (y1 - y0)
        return curve[-1][1]
