"""What a benchmark prints and saves about the machine it ran on, and how it times a call
(shared by the scripts here)."""

from __future__ import annotations

import json
import os
import platform
import statistics
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from services.engine.config import default_num_threads


def cpu_name() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def machine_info(threads: int, probe_cores: bool = False, **extra: Any) -> dict[str, Any]:
    """CPU, cores, torch threads, versions and the load when the run started; with
    ``probe_cores``, how the read bandwidth scales over the cores now (:func:`read_scaling`)."""
    info = {
        "cpu": cpu_name(),
        "cores": os.cpu_count(),
        "usable_cores": default_num_threads(),
        "torch_threads": threads,
        "python": platform.python_version(),
        "torch": torch.__version__,
        "load_avg_1m_at_start": round(os.getloadavg()[0], 2),
        **extra,
    }
    if probe_cores:
        info["read_scaling"] = read_scaling()
    return info


# A child's read bandwidth on one thread, then on every usable core: torch.sum over a buffer far
# larger than any L3 here. In a child, so that no OpenMP team is started in the caller's process
# (kernels/openmp.py says why a second team there would slow an engine's steps).
_READ_SCALING = """
import json, statistics, sys, time, torch
size, cores = int(sys.argv[1]), int(sys.argv[2])
data = torch.ones(size // 4)
rates = {}
for threads in (1, cores):
    torch.set_num_threads(threads)
    data.sum()
    times = []
    for _ in range(7):
        start = time.perf_counter()
        data.sum()
        times.append(time.perf_counter() - start)
    rates[threads] = size / 2**30 / statistics.median(times)
print(json.dumps([rates[1], rates[cores]]))
"""


def read_scaling(num_bytes: int = 256 << 20) -> dict[str, float] | None:
    """The read bandwidth of one core and of all usable cores, and what the others add.

    On this project's VMs the host may run our two vCPUs on the two hardware threads of one
    physical core, or on two cores, and may move them while a benchmark runs: measured
    2026-11-27 on the Zen 4 VM, one thread read 25 GiB/s and two 30-32 (the second adding
    ~20%) for long stretches, and 47-53 GiB/s at another time in another process, where the
    single-stream decode step took 7.0 ms against 8.7-9.8. Every figure a benchmark prints
    moves with that state, so the benchmarks that time the engine record it here (about 2 s).
    None where it cannot be measured."""
    cores = default_num_threads()
    try:
        done = subprocess.run(
            [sys.executable, "-c", _READ_SCALING, str(num_bytes), str(cores)],
            capture_output=True,
            text=True,
            timeout=120,
            check=True,
        )
        one, every = json.loads(done.stdout.splitlines()[-1])
    except (OSError, subprocess.SubprocessError, ValueError, IndexError):
        return None
    return {
        "read_gib_s_1_core": round(one, 1),
        f"read_gib_s_{cores}_cores": round(every, 1),
        "other_cores_add": round(every / one - 1, 2),
    }


def describe_read_scaling(scaling: dict[str, float] | None) -> str:
    """One line for a benchmark's header."""
    if scaling is None:
        return "read scaling: not measured"
    one, every = (v for k, v in scaling.items() if k.startswith("read_gib_s"))
    return (
        f"read bandwidth: 1 core {one:.1f} GiB/s, all {every:.1f} GiB/s "
        f"(the other cores add {scaling['other_cores_add']:.0%})"
    )


def placement_changed(before: dict[str, float] | None, after: dict[str, float] | None) -> bool:
    """Whether what the other cores add moved by more than half between two probes (the host
    put the vCPUs on other physical cores meanwhile, :func:`read_scaling`)."""
    if before is None or after is None:
        return False
    low, high = sorted((before["other_cores_add"], after["other_cores_add"]))
    return high - low > 0.5 * max(high, 0.1)


def median_seconds(fn: Callable[[], object], repeats: int, warmup: int = 1) -> float:
    """Median wall time of ``repeats`` calls of ``fn`` after ``warmup`` untimed ones."""
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times)
