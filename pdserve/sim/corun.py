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
"""

from __future__ import annotations

import json
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

    @classmethod
    def load(cls, path: Path) -> CoRun:
        """The ``factors`` of a file written by ``benchmarks/corun_slowdown.py``."""
        factors = json.loads(Path(path).read_text())["factors"]
        return cls(**{k: float(v) for k, v in factors.items()})

    def factor(self, own: StepPlan, neighbours: Iterable[StepPlan]) -> float:
        """How much longer ``own`` takes beside the steps ``neighbours`` are computing."""
        factors = [getattr(self, f"{phase(own)}_vs_{phase(n)}") for n in neighbours]
        return max(factors, default=1.0)
