"""`pdserve up` in several variants under `peer_vllm.py --online`'s burst, alternated round by
round: for comparing router or worker settings, or two revisions of the code, on a VM whose speed
drifts (only runs alternated in one session compare).

A variant is ``NAME=FLAGS`` (extra flags for `pdserve up`, may be empty) or ``NAME@REV=FLAGS``
(the same, run from a git worktree of revision REV, made for the run and removed after). Each
round starts every variant in turn and sends it the burst (96 random 256-token prompts -> 64
tokens, all at once) with each load tester: vLLM's `vllm bench serve` from the peer venv
(`peer_vllm.py` installs it) and/or `pdserve-loadtest`. Printed per run: output tok/s, TTFT p50,
ITL p50 and p99, the burst's length, the CPU seconds of each process and the router's
disaggregation decisions in that burst.

    python benchmarks/burst_ab.py --variant old@eb830a6= --variant new= [--rounds 2]
        [--testers vllm,pdserve] [--colocated]

Writes burst_ab.json to --out-dir. Run it with nothing else on the machine.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shlex
import subprocess
import sys
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import psutil
from peer_vllm import (  # benchmarks/ (on sys.path)
    DEFAULT_VENV,
    ROOT,
    cpu_seconds,
    ensure_peer,
    free_port,
    load_commands,
    model_dir,
    peer_env,
    stop,
    wait_http,
)

DECISION = re.compile(
    r'pdserve_router_disaggregation_decisions_total\{decision="(\w+)",reason="(\w+)"\} ([0-9.e+]+)'
)


@dataclass(frozen=True)
class Variant:
    name: str
    flags: list[str]
    revision: str | None  # None: this checkout

    @classmethod
    def parse(cls, text: str) -> Variant:
        head, sep, flags = text.partition("=")
        if not sep or not head:
            raise argparse.ArgumentTypeError(f"{text!r}: give NAME=FLAGS or NAME@REV=FLAGS")
        name, _, revision = head.partition("@")
        return cls(name, shlex.split(flags), revision or None)


@contextmanager
def trees(variants: list[Variant]) -> Iterator[dict[str, Path]]:
    """Each variant's source tree: this checkout, or a worktree of its revision."""
    made: list[Path] = []
    paths: dict[str, Path] = {}
    try:
        for v in variants:
            if v.revision is None:
                paths[v.name] = ROOT
                continue
            path = Path(tempfile.mkdtemp(prefix=f"burst-ab-{v.name}-"))
            git = ["git", "-C", str(ROOT), "worktree", "add", "-f", "--detach", str(path)]
            subprocess.run([*git, v.revision], check=True, capture_output=True)
            made.append(path)
            paths[v.name] = path
        yield paths
    finally:
        for path in made:
            remove = ["git", "-C", str(ROOT), "worktree", "remove", "--force", str(path)]
            subprocess.run(remove, check=False, capture_output=True)


def decisions(url: str) -> dict[str, float]:
    """The router's disaggregation counters so far, as ``label:reason`` -> count."""
    text = httpx.get(url + "/metrics", timeout=10).text
    return {f"{a}:{b}": float(n) for a, b, n in DECISION.findall(text)}


def burst(args: argparse.Namespace, peer: Path, tree: Path, flags: list[str]) -> list[dict]:
    """Start `pdserve up` from ``tree``, send it the burst with each tester, stop it."""
    port = free_port()
    command = [sys.executable, "-m", "pdserve.cli", "up", "--dtype", "bfloat16"]
    command += ["--port", str(port), *(["--colocated"] if args.colocated else []), *flags]
    env = {**os.environ, "PYTHONPATH": str(tree)}
    work = Path(tempfile.mkdtemp(prefix="burst-ab-"))
    runs = []
    with open(work / "up.log", "w") as log:
        server = subprocess.Popen(command, cwd=tree, env=env, stdout=log, stderr=log)
        try:
            url = f"http://127.0.0.1:{port}"
            wait_http(url + "/ready", server)
            for tester, load in load_commands(args, peer, url, work / "r").items():
                if tester.split()[0].split("-")[0] not in args.testers:  # vllm, pdserve
                    continue
                cpu_before, seen = cpu_seconds(psutil.Process(server.pid)), decisions(url)
                tester_env = peer_env(args.peer_venv) if "vllm" in tester else None
                done = subprocess.run(load, env=tester_env, cwd=ROOT, capture_output=True)
                if done.returncode != 0:
                    raise SystemExit(f"{tester} failed:\n{done.stderr.decode()[-2000:]}")
                cpu = cpu_seconds(psutil.Process(server.pid))
                now = decisions(url)
                name = "r.vllm.json" if "vllm" in tester else "r.pdserve.json"
                data = json.loads((work / name).read_text())
                runs.append(
                    {
                        "tester": tester,
                        "output_tok_s": data["output_throughput"],
                        "ttft_p50_ms": data["median_ttft_ms"],
                        "itl_p50_ms": data["median_itl_ms"],
                        "itl_p99_ms": data["p99_itl_ms"],
                        "duration_s": data["duration"],
                        "cpu_s": {k: round(v - cpu_before.get(k, 0.0), 1) for k, v in cpu.items()},
                        "decisions": {
                            k: v - seen.get(k, 0.0) for k, v in now.items() if v > seen.get(k, 0.0)
                        },
                    }
                )
        finally:
            stop(server)
    return runs


def show(round_: int, name: str, run: dict[str, Any]) -> None:
    cpu = ", ".join(f"{k} {v}" for k, v in sorted(run["cpu_s"].items()) if v >= 0.5)
    made = ", ".join(f"{k} {v:.0f}" for k, v in sorted(run["decisions"].items()))
    print(
        f"round {round_} {name:<12} {run['tester']:<18} {run['output_tok_s']:7.1f} tok/s  "
        f"TTFT p50 {run['ttft_p50_ms']:6.0f} ms  ITL p50 {run['itl_p50_ms']:5.0f} / p99 "
        f"{run['itl_p99_ms']:5.0f} ms  {run['duration_s']:5.1f} s  cpu: {cpu}  {made}",
        flush=True,
    )


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--variant", type=Variant.parse, action="append", required=True)
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--testers", default="vllm,pdserve", help="vllm and/or pdserve")
    p.add_argument("--colocated", action="store_true", help="`pdserve up --colocated`")
    p.add_argument("--num-prompts", type=int, default=96)
    p.add_argument("--peer-venv", type=Path, default=DEFAULT_VENV)
    p.add_argument("--out-dir", type=Path, default=ROOT / "benchmarks" / "results")
    args = p.parse_args(argv)
    args.testers = args.testers.split(",")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    print("$ python " + shlex.join(sys.argv))
    peer = ensure_peer(args.peer_venv) if "vllm" in args.testers else Path(sys.executable)
    args.model = model_dir()
    results: list[dict[str, Any]] = []
    with trees(args.variant) as paths:
        for round_ in range(args.rounds):
            for v in args.variant:
                for run in burst(args, peer, paths[v.name], v.flags):
                    show(round_, v.name, run)
                    results.append({"round": round_, "variant": v.name, **run})
    args.out_dir.mkdir(parents=True, exist_ok=True)
    path = args.out_dir / "burst_ab.json"
    path.write_text(json.dumps({"command": " ".join(sys.argv), "runs": results}, indent=2) + "\n")
    print(f"saved {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
