"""The Ctrl-C handler in-process: a second SIGINT that arrives while the first is still being
handled (Python runs signal handlers between any two bytecodes, so also inside the first
handler's print) must exit, not start stopping a second time."""

from __future__ import annotations

import asyncio
import io
import os
import signal

import pytest

from loadtest import control


class SigintOnFirstWrite(io.StringIO):
    """stderr that receives a second SIGINT while the first message is being written, as a
    user pressing Ctrl-C twice in a row (or the operator test reading that message) does."""

    def __init__(self) -> None:
        super().__init__()
        self.fired = False

    def write(self, text: str) -> int:
        written = super().write(text)
        if not self.fired and text.strip():
            self.fired = True
            os.kill(os.getpid(), signal.SIGINT)
            for _ in range(1000):  # the handler runs at one of these bytecodes
                pass
        return written


def test_a_second_sigint_during_the_first_exits(monkeypatch: pytest.MonkeyPatch) -> None:
    stderr = SigintOnFirstWrite()
    monkeypatch.setattr(control.sys, "stderr", stderr)

    def exit_(status: int) -> None:
        raise SystemExit(status)

    monkeypatch.setattr(control.os, "_exit", exit_)

    async def run() -> control.Stop:
        stop = control.Stop()
        with control.sigint_stops(stop):
            os.kill(os.getpid(), signal.SIGINT)
            for _ in range(1000):
                pass
        return stop

    with pytest.raises(SystemExit) as exited:
        asyncio.run(run())
    assert exited.value.code == 130
    assert stderr.getvalue().count("interrupted: stopping") == 1
    assert "interrupted again: exiting without saving" in stderr.getvalue()
