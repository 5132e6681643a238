"""The committed gRPC stubs are exactly what `make protos` generates from protos/pdserve.proto."""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
GENERATED = ["pdserve_pb2.py", "pdserve_pb2.pyi", "pdserve_pb2_grpc.py"]


def test_committed_stubs_are_fresh(tmp_path):
    (tmp_path / "protos").mkdir()
    shutil.copy(ROOT / "protos" / "pdserve.proto", tmp_path / "protos")
    subprocess.run(
        [
            sys.executable,
            "-m",
            "grpc_tools.protoc",
            "-I.",
            "--python_out=.",
            "--grpc_python_out=.",
            "--pyi_out=.",
            "protos/pdserve.proto",
        ],
        cwd=tmp_path,
        check=True,
    )
    for name in GENERATED:
        fresh = (tmp_path / "protos" / name).read_text()
        committed = (ROOT / "protos" / name).read_text()
        assert fresh == committed, f"protos/{name} is stale: run `make protos`"
