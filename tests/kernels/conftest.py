"""The compiled CPU kernels, built once per test session (shared by the kernel tests)."""

from __future__ import annotations

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
