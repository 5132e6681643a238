"""lm-eval through the gateway next to lm-eval's own transformers backend, on the same weights.

Runs lm-evaluation-harness's multiple-choice task ``pdserve_mc`` (benchmarks/lm_eval_task: 155
questions made here, no dataset hub) twice: with ``--model local-completions`` against a
``pdserve up`` (1 prefill + 1 decode worker, float32), which scores each choice from an ``echo:
true, logprobs: 1`` completion, and with ``--model hf`` on the Hugging Face directory pdserve
converted the default model's GGUF into (the same weights, float32). Prints both accuracies
(acc, acc_norm), how often the two chose the same answer, and the largest difference between
the two log-likelihoods of a choice; exits 1 when any chosen answer differs.

    python -m benchmarks.lm_eval_gateway                  # all 155 questions
    python -m benchmarks.lm_eval_gateway --limit 40       # the first 40

lm-eval lives in its own virtual environment (``--venv``, made on first use from the package
registry: lm-eval, the torch and transformers of this one), so its dependencies never touch
pdserve's. Run from the repository root.
"""

from __future__ import annotations

import argparse
import importlib.metadata
import json
import os
import re
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

LM_EVAL = "lm-eval[api,hf]==0.4.13"
TASK = "pdserve_mc"
TASK_DIR = "benchmarks/lm_eval_task"
UP_READY = "Ctrl-C stops everything"


@dataclass(frozen=True)
class Run:
    """One backend's answers: its accuracies and each question's log-likelihoods."""

    name: str
    acc: float
    acc_norm: float
    logliks: dict[int, list[float]]  # doc id -> one per choice
    choices: dict[int, list[str]]

    def picks(self, norm: bool) -> dict[int, int]:
        """The chosen answer per question, as lm-eval picks it (acc_norm: per character)."""
        picked = {}
        for doc, values in self.logliks.items():
            scores = [v / len(c) if norm else v for v, c in zip(values, self.choices[doc])]
            picked[doc] = max(range(len(scores)), key=scores.__getitem__)
        return picked


def ensure_venv(venv: Path) -> Path:
    """The venv's ``lm_eval``, installed first if missing (torch and transformers pinned to
    this environment's versions: torch==2.13.0 is a local CPU wheel here)."""
    lm_eval = venv / "bin" / "lm_eval"
    if lm_eval.exists():
        return lm_eval
    print(f"making {venv} for {LM_EVAL} (once)", flush=True)
    subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True)
    pip = [str(venv / "bin" / "python"), "-m", "pip", "install", "-q"]
    subprocess.run([*pip, pinned("torch")], check=True)  # first: unpinned pulls CUDA's
    subprocess.run([*pip, LM_EVAL, pinned("transformers"), pinned("tokenizers")], check=True)
    return lm_eval


def pinned(package: str) -> str:
    """``package==`` this environment's version (torch's without its ``+cpu``)."""
    return f"{package}=={importlib.metadata.version(package).split('+')[0]}"


def model_dir() -> Path:
    """The Hugging Face directory of the default model (its GGUF converted once, cached): what
    pdserve's workers load, and so what lm-eval's transformers backend must load too."""
    from services.engine.config import EngineConfig
    from services.engine.model.source import resolve_model_dir

    config = EngineConfig()
    return resolve_model_dir(config.model, config.cache_path)


def start_up(disaggregation: str) -> tuple[subprocess.Popen[str], str, str]:
    """``pdserve up`` on a free port; its process, URL and model id once it is ready."""
    command = [sys.executable, "-m", "pdserve.cli", "up", "--port", "0", "--dtype", "float32"]
    command += ["--disaggregation", disaggregation]
    up = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    assert up.stdout is not None
    lines = []
    for line in up.stdout:
        lines.append(line)
        if line.startswith(UP_READY):
            found = re.search(r"^pdserve is up: (\S+) \(model (.+)\)$", "".join(lines), re.M)
            assert found, "".join(lines)
            return up, found.group(1), found.group(2)
    raise RuntimeError(f"pdserve up exited ({up.wait()}):\n{''.join(lines)}")


def stop_up(up: subprocess.Popen[str]) -> None:
    up.send_signal(signal.SIGINT)  # as Ctrl-C: it stops the workers, router and Redis
    try:
        up.wait(timeout=90)
    except subprocess.TimeoutExpired:
        up.kill()
        up.wait()


def lm_eval_run(lm_eval: Path, model: str, model_args: str, out: Path, limit: int | None) -> Run:
    """One ``lm_eval run`` of the task (its own progress bars on stderr), read back from its
    results and per-question samples."""
    command = [str(lm_eval), "run", "--model", model, "--model_args", model_args]
    command += ["--include_path", TASK_DIR, "--tasks", TASK, "--device", "cpu"]
    command += ["--output_path", str(out), "--log_samples"]
    if limit is not None:
        command += ["--limit", str(limit)]
    print("$ " + " ".join(command), flush=True)
    # One torch thread, as each pdserve worker has on 2 cores: with more, OpenMP's spinning
    # threads on a busy machine made each forward 25x slower (4 s for 20 tokens, measured).
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1", "OMP_NUM_THREADS": "1"}
    subprocess.run(command, check=True, env=env, stdout=sys.stderr)
    results = json.loads(newest(out, "results_*.json").read_text())["results"][TASK]
    logliks, choices = {}, {}
    for line in newest(out, f"samples_{TASK}_*.jsonl").read_text().splitlines():
        sample = json.loads(line)
        logliks[sample["doc_id"]] = [float(r[0]) for r in sample["filtered_resps"]]
        choices[sample["doc_id"]] = sample["doc"]["choices"]
    return Run(model, results["acc,none"], results["acc_norm,none"], logliks, choices)


def through_gateway(lm_eval: Path, weights: Path, out: Path, args: argparse.Namespace) -> Run:
    """The task through a ``pdserve up`` started for it (stopped before transformers runs, so
    the two never share the cores), lm-eval tokenizing with the same tokenizer.json."""
    up, url, served = start_up(args.disaggregation)
    try:
        model_args = (
            f"base_url={url}/v1/completions,model={served},tokenizer={weights},"
            f"tokenizer_backend=huggingface,num_concurrent={args.num_concurrent},max_retries=1,"
            f"tokenized_requests={not args.text_prompts}"
        )
        return lm_eval_run(lm_eval, "local-completions", model_args, out, args.limit)
    finally:
        stop_up(up)


def newest(folder: Path, pattern: str) -> Path:
    """The last file lm-eval wrote by that name (an --output folder keeps earlier runs')."""
    return max(folder.rglob(pattern), key=lambda path: path.stat().st_mtime)


def report(gateway: Run, hf: Run) -> bool:
    """Print the comparison; whether both chose the same answer to every question."""
    docs = sorted(gateway.logliks)
    assert docs == sorted(hf.logliks), "the two runs scored different questions"
    print(f"\n{len(docs)} questions, {sum(len(hf.choices[d]) for d in docs)} choices")
    print(f"{'':>28} {'acc':>7} {'acc_norm':>9}")
    for run, label in ((gateway, "gateway (local-completions)"), (hf, "transformers (hf)")):
        print(f"{label:>28} {run.acc:7.4f} {run.acc_norm:9.4f}")
    print(f"{'difference':>28} {gateway.acc - hf.acc:+7.4f} {gateway.acc_norm - hf.acc_norm:+9.4f}")
    num_same = 0
    for norm, metric in ((False, "acc"), (True, "acc_norm")):
        a, b = gateway.picks(norm), hf.picks(norm)
        same = sum(a[d] == b[d] for d in docs)
        print(f"same answer chosen ({metric}): {same}/{len(docs)}")
        num_same += same
    worst = max(abs(x - y) for d in docs for x, y in zip(gateway.logliks[d], hf.logliks[d]))
    print(f"largest log-likelihood difference: {worst:.2e}")
    return num_same == 2 * len(docs)


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--limit", type=int, default=None, help="questions (default: all)")
    parser.add_argument("--venv", type=Path, default=Path(".venv-lmeval"), help="lm-eval's venv")
    parser.add_argument(
        "--disaggregation",
        choices=["always", "conditional"],
        default="always",
        help="the router's: always computes every prompt on the prefill worker (its logprobs "
        "come back through the hand-off); conditional lets the decode worker compute short ones",
    )
    parser.add_argument("--num-concurrent", type=int, default=2, help="lm-eval's requests at once")
    parser.add_argument(
        "--output", type=Path, default=None, help="keep lm-eval's results and samples here"
    )
    parser.add_argument(
        "--text-prompts",
        action="store_true",
        help="send prompts as text (lm-eval's tokenized_requests=False): the gateway tokenizes "
        "them, and must cut them where lm-eval's tokenizer did (default: token ids)",
    )
    args = parser.parse_args()
    from benchmarks.machine import machine_info

    print(json.dumps(machine_info(1, lm_eval=LM_EVAL, command=sys.argv[1:])), flush=True)
    lm_eval = ensure_venv(args.venv)
    weights = model_dir()
    with tempfile.TemporaryDirectory(prefix="lm-eval-") as scratch:
        tmp = args.output or Path(scratch)
        started = time.monotonic()
        gateway = through_gateway(lm_eval, weights, Path(tmp, "gateway"), args)
        print(f"gateway run: {time.monotonic() - started:.0f} s", flush=True)
        started = time.monotonic()
        hf_args = f"pretrained={weights},dtype=float32"
        hf = lm_eval_run(lm_eval, "hf", hf_args, Path(tmp, "hf"), args.limit)
        print(f"transformers run: {time.monotonic() - started:.0f} s", flush=True)
    if not report(gateway, hf):
        sys.exit("the gateway and transformers chose different answers")


if __name__ == "__main__":
    main()
