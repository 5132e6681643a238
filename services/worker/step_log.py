"""``--step-log FILE``: one JSON line per engine step, for finding where a step's time went.

Each line holds the worker, its role, when the step computed (unix seconds, so the lines line up
with the router's trace spans and with other processes' logs), and what it held::

    {"worker": "colocated-vm-1-ab12", "role": "colocated", "start": 1795819095.6225,
     "end": 1795819095.6561, "prompt_tokens": 0, "decode_sequences": 3}

Several workers may append to one file: each line is a single ``write`` on an ``O_APPEND``
descriptor, so lines never interleave. ``benchmarks/host_work.py`` reads it to measure how much
longer a step runs when a request arrives at, or finishes on, the same host meanwhile (the
simulator's ``pdserve.sim.host_work``). Off by default: it costs one small write per step.
"""

from __future__ import annotations

import json
import os
import time
from dataclasses import dataclass

from services.worker.async_engine import AsyncEngine


@dataclass(frozen=True)
class StepLine:
    """One line of the log, as written and as read back."""

    worker: str
    role: str
    start: float  # unix seconds
    end: float
    prompt_tokens: int
    decode_sequences: int

    @classmethod
    def parse(cls, line: str) -> StepLine:
        return cls(**json.loads(line))


class StepLog:
    """Writes ``engine.last_step`` after every step (register ``record`` with ``on_step``)."""

    def __init__(self, path: str, worker: str, role: str, engine: AsyncEngine):
        self._fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
        self._worker, self._role, self._engine = worker, role, engine

    def record(self) -> None:
        step = self._engine.last_step
        if step is None:  # the step failed: nothing to time
            return
        to_unix = time.time() - time.monotonic()
        line = StepLine(
            self._worker,
            self._role,
            round(step.started + to_unix, 6),
            round(step.ended + to_unix, 6),
            step.prompt_tokens,
            step.decode_sequences,
        )
        os.write(self._fd, (json.dumps(line.__dict__) + "\n").encode())

    def close(self) -> None:
        os.close(self._fd)


def read_step_log(path: str) -> list[StepLine]:
    """Every line of a step log, in the order written."""
    with open(path) as f:
        return [StepLine.parse(line) for line in f if line.strip()]
