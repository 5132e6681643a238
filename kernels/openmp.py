"""Keep a process's OpenMP parallel work on one thread.

libgomp (torch's and our kernels' OpenMP runtime: one copy per process) gives every thread that
starts a parallel region its own team of worker threads, kept for that thread's life, and counts
all of them. Once the count exceeds the CPUs it may use, every team's idle workers stop spinning
between regions and sleep (its "throttled" spin count, about 100 spins), so each of the
hundreds of small regions of an engine step pays a futex wake-up. A 2-thread engine built on one
thread and stepped on another ran its decode steps 1.6x slower on 2 cores, 33 -> 53 ms
(``benchmarks/step_contention.py``), the same as with ``OMP_WAIT_POLICY=passive``.

So a worker process computes on one thread only, its engine thread, and every other thread that
may touch tensors (the event loop, KV copy pools, checksum and grammar threads) calls
:func:`serial_thread` first: its regions then run on itself, with no team.
"""

from __future__ import annotations

import ctypes
import functools
from pathlib import Path

import torch

_RUNTIMES = ("libgomp", "libiomp", "libomp")


@functools.cache
def _openmp_runtime() -> ctypes.CDLL | None:
    """The OpenMP runtime torch loaded (found by path: a second copy loaded by name would be a
    second runtime, whose settings torch's regions never read); None if there is none."""
    torch.get_num_threads()  # torch is imported, so its runtime is mapped
    for line in Path("/proc/self/maps").read_text().splitlines():
        path = line.split()[-1] if "/" in line else ""
        if Path(path).name.startswith(_RUNTIMES):
            return ctypes.CDLL(path)
    return None


def serial_thread() -> None:
    """Make the calling thread's torch ops and OpenMP regions run on itself alone (thread
    pools: pass it as ``initializer``). Idempotent; other threads keep their settings."""
    # torch sets a thread's OpenMP thread count on its first parallel op (from the process-wide
    # torch.set_num_threads): trigger that first, or it would undo the line after.
    torch.get_num_threads()
    runtime = _openmp_runtime()
    if runtime is not None:
        runtime.omp_set_num_threads(1)
