"""common.heap: a server process starts with cycle collection off, and once serving collects the
startup's cycles, freezes what survived and collects as usual again. Run in a child interpreter:
freezing the test process's own heap would change every test after this one."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

CHILD = """
import gc, weakref
from common.heap import defer_collection, freeze_startup_heap

class Node:
    pass

defer_collection()
assert not gc.isenabled()
cycle = Node(); cycle.me = cycle
dead = weakref.ref(cycle)
del cycle
kept = [Node() for _ in range(1000)]
assert dead() is not None  # no collection while starting
freeze_startup_heap()
assert gc.isenabled()
assert dead() is None  # the startup's cycles were collected before the freeze
assert gc.get_freeze_count() >= 1000  # the survivors are out of the collector's sight
print("ok")
"""


def test_startup_cycles_are_collected_then_the_heap_is_frozen() -> None:
    run = subprocess.run(
        [sys.executable, "-c", CHILD], cwd=ROOT, capture_output=True, text=True, timeout=60
    )
    assert run.returncode == 0 and run.stdout.strip() == "ok", run.stdout + run.stderr
