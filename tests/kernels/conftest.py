"""The compiled CPU kernels, built once per test session (shared by the kernel tests)."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest

from kernels import cpu_ops


@pytest.fixture(scope="session")
def kernel(tmp_path_factory: pytest.TempPathFactory) -> cpu_ops.CpuKernels:
    """The kernel built once for the session, in a directory of its own (not ~/.cache)."""
    if cpu_ops.find_compiler() is None:
        pytest.skip("no C compiler (cc/gcc/clang) on PATH to build the kernel")
    loaded = cpu_ops.load(tmp_path_factory.mktemp("kernels"))
    assert loaded is not None, "a C compiler is on PATH but the kernel did not build"
    return loaded


def seed_cache(kernel: cpu_ops.CpuKernels, cache_dir: Path) -> Path:
    """``cache_dir``'s kernels folder holding a copy of the session's build, under the name a
    build there would give it: a test of where the engine looks then loads it instead of
    compiling it again (~8 s each on 2 cores)."""
    folder = cache_dir / "kernels"
    folder.mkdir(parents=True, exist_ok=True)
    return Path(shutil.copy2(kernel.path, folder / kernel.path.name))
