"""The load tester installs on its own: `pip install ./loadtest` builds a wheel holding only the
`loadtest` package, whose dependencies do not include torch or any part of pdserve."""

from __future__ import annotations

import subprocess
import sys
import zipfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_loadtest_builds_a_wheel_of_its_own(tmp_path: Path) -> None:
    subprocess.run(
        [
            sys.executable,
            "-m",
            "pip",
            "wheel",
            "--no-deps",
            "--no-build-isolation",
            "-q",
            "-w",
            str(tmp_path),
            str(ROOT / "loadtest"),
        ],
        check=True,
        capture_output=True,
        timeout=120,
    )
    (wheel,) = tmp_path.glob("pdserve_loadtest-*.whl")
    with zipfile.ZipFile(wheel) as archive:
        names = archive.namelist()
        metadata = next(archive.read(n).decode() for n in names if n.endswith("METADATA"))
    modules = {n for n in names if n.endswith(".py")}
    assert {"loadtest/cli.py", "loadtest/client.py", "loadtest/metrics.py"} <= modules
    assert all(n.startswith("loadtest/") for n in modules)
    requires = [line for line in metadata.splitlines() if line.startswith("Requires-Dist:")]
    assert any("httpx" in r for r in requires)
    assert not any(word in r for r in requires for word in ("torch", "pdserve", "grpcio"))
