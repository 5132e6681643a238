"""What a benchmark prints and saves about the machine it ran on, and how it times a call
(shared by the scripts here)."""

from __future__ import annotations

import os
import platform
import statistics
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


def machine_info(threads: int, **extra: Any) -> dict[str, Any]:
    """CPU, cores, torch threads, versions and the load when the run started."""
    return {
        "cpu": cpu_name(),
        "cores": os.cpu_count(),
        "usable_cores": default_num_threads(),
        "torch_threads": threads,
        "python": platform.python_version(),
        "torch": torch.__version__,
        "load_avg_1m_at_start": round(os.getloadavg()[0], 2),
        **extra,
    }


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
