"""The restart policy of `pdserve up --restart`: report a component that exits, start it again.

`Supervisor.poll()` is called every fraction of a second by the watch loop, on the main thread
(a child's parent-death signal is tied to the thread that spawned it, so restarts must come from
the thread that lives as long as `pdserve up`). It never waits for a restarted component to be
ready: it only checks, at each poll, whether its ready line has come, so the other components
are watched all along and a stop signal is seen at once. Per component::

    up --exits--> report; wait its backoff --due--> respawn --ready line--> up
                                                     |--no ready line within ready_timeout--> kill
                                                        (seen as an exit at the next poll)

A rolling restart (`pdserve up`'s SIGUSR1) starts a component's replacement itself and hands it
over once ready (``replace``): the old one's exit, which it asked for, is not a crash.

The backoff grows for a component that keeps crashing (1 s, 2 s, 4 s ... at most 30 s), so a crash
loop does not spin the CPU, and starts over once the component has stayed up a minute.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Protocol

BACKOFF_FIRST_SECONDS = 1.0
BACKOFF_MAX_SECONDS = 30.0
STABLE_SECONDS = 60.0  # up (ready) this long: the next exit is a new incident, the backoff resets


class Restartable(Protocol):
    """A component the supervisor can watch and start again."""

    name: str

    def is_alive(self) -> bool: ...

    def is_ready(self) -> bool:
        """Whether the current run is ready (printed its ready line)."""
        ...

    def exit_reason(self) -> str:
        """Why the last run ended: 'killed by SIGKILL', 'exit code 1', or '' if unknown."""
        ...

    def respawn(self) -> int:
        """Start again with the same arguments; returns the new pid. May raise to stop it all."""
        ...

    def kill(self) -> None: ...


@dataclass
class Backoff:
    """The delay before a restart: doubles with each crash in a row, from ``first`` to ``cap``."""

    first: float = BACKOFF_FIRST_SECONDS
    cap: float = BACKOFF_MAX_SECONDS
    stable: float = STABLE_SECONDS
    streak: int = 0  # crashes in a row (without ``stable`` seconds up in between)

    def next_delay(self, up_seconds: float) -> float:
        """The delay after an exit that followed ``up_seconds`` of being ready (0: never ready)."""
        if up_seconds >= self.stable:
            self.streak = 0
        delay = min(self.cap, self.first * 2**self.streak)
        self.streak += 1
        return delay


@dataclass
class _Slot:
    unit: Restartable
    backoff: Backoff
    ready_since: float | None  # None while starting (or waiting to restart)
    restarts: int = 0
    restart_at: float | None = None  # set while waiting out the backoff
    ready_by: float | None = None  # set while a restarted run has not printed its ready line


class Supervisor:
    """Restarts the components that exit; see the module docstring."""

    def __init__(
        self,
        units: Sequence[Restartable],
        say: Callable[[str], None],
        ready_timeout: float,
        clock: Callable[[], float] = time.monotonic,
        backoff: Callable[[], Backoff] = Backoff,
    ):
        self._say = say
        self._ready_timeout = ready_timeout
        self._clock = clock
        now = clock()  # every unit is up and ready when supervision starts
        self._slots = [_Slot(unit, backoff(), ready_since=now) for unit in units]

    def restarts(self, name: str) -> int:
        """How many times ``name`` was started again."""
        return next(s.restarts for s in self._slots if s.unit.name == name)

    def replace(self, old: Restartable, new: Restartable) -> None:
        """``new`` (started and ready) takes ``old``'s place (a rolling restart): ``old``'s exit
        is not ours to see; ``new``'s will be."""
        slot = next(s for s in self._slots if s.unit is old)
        slot.unit, slot.ready_since = new, self._clock()
        slot.restart_at = slot.ready_by = None

    def poll(self) -> None:
        """Report exits, restart what is due, notice restarted units that became ready."""
        now = self._clock()
        for slot in self._slots:
            if slot.restart_at is not None:
                if now >= slot.restart_at:
                    self._respawn(slot, now)
            elif not slot.unit.is_alive():
                self._on_exit(slot, now)
            elif slot.ready_by is not None:
                self._check_ready(slot, now)

    def _on_exit(self, slot: _Slot, now: float) -> None:
        up = 0.0 if slot.ready_since is None else now - slot.ready_since
        delay = slot.backoff.next_delay(up)
        slot.restarts += 1
        slot.restart_at, slot.ready_by, slot.ready_since = now + delay, None, None
        reason = slot.unit.exit_reason()
        self._say(
            f"{slot.unit.name} exited{f' ({reason})' if reason else ''}; "
            f"restarting in {delay:g} s (restart {slot.restarts})"
        )

    def _respawn(self, slot: _Slot, now: float) -> None:
        slot.restart_at = None
        pid = slot.unit.respawn()
        slot.ready_by = now + self._ready_timeout
        self._say(f"restarted {slot.unit.name}: pid {pid}")
        self._check_ready(slot, now)  # a unit that is ready once started (Redis) is up now

    def _check_ready(self, slot: _Slot, now: float) -> None:
        assert slot.ready_by is not None
        if slot.unit.is_ready():
            slot.ready_by, slot.ready_since = None, now
            self._say(f"{slot.unit.name} is ready again")
        elif now > slot.ready_by:
            self._say(
                f"{slot.unit.name} printed no ready line within {self._ready_timeout:g} s "
                "(--ready-timeout) of its restart: killing it"
            )
            slot.unit.kill()  # the next poll sees the exit and backs off further
