"""The committed gRPC stubs are exactly what `make protos` generates from protos/pdserve.proto,
and every declaration of that contract is commented."""

from __future__ import annotations

import re
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


# The contract lives in the .proto's comments: each message, service, rpc and field says what it
# means and what its receiver does. A declaration without one is how the contract goes stale.
DECLARATION = re.compile(
    r"^\s*(?:(?:message|service|oneof)\s+\w+\s*\{"
    r"|rpc\s+\w+\s*\("
    r"|(?:optional\s+|repeated\s+)?[\w.]+\s+\w+\s*=\s*\d+\s*;)"
)


def uncommented(proto: str) -> list[str]:
    """The declarations of ``proto`` with no ``//`` comment on their line or right above it."""
    lines = proto.splitlines()
    missing = []
    for number, line in enumerate(lines):
        if not DECLARATION.match(line) or "//" in line:
            continue
        above = number - 1
        if above < 0 or not lines[above].strip().startswith("//"):
            missing.append(f"line {number + 1}: {line.strip()}")
    return missing


def test_every_declaration_of_the_contract_is_commented():
    proto = (ROOT / "protos" / "pdserve.proto").read_text()
    assert uncommented(proto) == [], "protos/pdserve.proto: say what these mean and who acts"


def test_the_comment_check_sees_what_is_missing():
    proto = """\
// A handle.
message KVHandle {
  string request_id = 1;  // whose blocks
  // where
  string address = 4;
  repeated int32 block_ids = 5;

  bool streaming = 13;
  optional int32 first_token = 6;
  oneof event {
    KVHandle kv = 1;  // the handle
  }
}
message Bare {
}
service S {
  // Commented.
  rpc A(KVHandle) returns (KVHandle);
  rpc B(KVHandle) returns (stream KVHandle);
}
"""
    assert uncommented(proto) == [
        "line 6: repeated int32 block_ids = 5;",
        "line 8: bool streaming = 13;",
        "line 9: optional int32 first_token = 6;",
        "line 10: oneof event {",
        "line 14: message Bare {",
        "line 16: service S {",
        "line 19: rpc B(KVHandle) returns (stream KVHandle);",
    ]
