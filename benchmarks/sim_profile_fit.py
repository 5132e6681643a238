"""Fit a simulated worker's profile (docs/simulation.md) to a measured worker profile.

Input: a profile measured with the real engine by ``pdserve plan --measure --save-profile FILE``
(prefill time per prompt length, decode step time per batch size and context, the KV transfer's
latency and bandwidth; see ``pdserve/profile.py``). Output: a ``--simulate`` profile whose step
model (``services/engine/simulation_profile.py``) is the least-squares fit, with non-negative
coefficients, of

    prefill of N tokens:          base + prefill_token * N + prefill_pair * N (N + 1) / 2
    decode of b sequences of c:   base + decode_seq * b + decode_context * b * c

to every measured point of one thread count, each number carrying its source. The relative
error of the fit at each point is printed (and kept in the file) so the fit's quality is on
record.

Run:

    python benchmarks/sim_profile_fit.py benchmarks/profiles/epyc-2core.json --threads 2 \\
        --name epyc-2core-smollm2-135m --out benchmarks/profiles/sim-epyc-2core-smollm2.json
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # run as a script from anywhere

from pdserve.profile import ThreadProfile, WorkerProfile  # noqa: E402
from services.engine.simulation_profile import StepTimeModel  # noqa: E402

FIELDS = list(StepTimeModel.__dataclass_fields__)  # base, prefill_token, pair, seq, context


def design(curves: ThreadProfile) -> tuple[np.ndarray, np.ndarray, list[str]]:
    """One row per measured point: its features in FIELDS' order, its seconds, its name."""
    rows, times, names = [], [], []
    for n, seconds in zip(curves.prefill_tokens, curves.prefill_seconds):
        rows.append([1.0, n, n * (n + 1) / 2, 0.0, 0.0])
        times.append(seconds)
        names.append(f"prefill {n}")
    for p in curves.decode:
        rows.append([1.0, 0.0, 0.0, p.batch_size, p.batch_size * p.context])
        times.append(p.seconds)
        names.append(f"decode b={p.batch_size} c={p.context}")
    return np.array(rows), np.array(times), names


def fit_nonnegative(x: np.ndarray, y: np.ndarray) -> np.ndarray:
    """Least squares in relative error (each row divided by its time), dropping the feature of
    the most negative coefficient until none is negative (a small active-set NNLS)."""
    weights = 1.0 / y
    active = list(range(x.shape[1]))
    while True:
        coef, *_ = np.linalg.lstsq(x[:, active] * weights[:, None], y * weights, rcond=None)
        if (coef >= 0).all():
            full = np.zeros(x.shape[1])
            full[active] = coef
            return full
        active.pop(int(np.argmin(coef)))


def machine_of(machine: dict) -> str:
    """Where a profile was measured, from its ``machine`` record."""
    if "gpu" in machine:
        return f"one {machine['gpu']} ({machine.get('cores', '?')} CPU cores)"
    return f"a {machine.get('cores', '?')}-core {machine.get('cpu', 'CPU')} (shared: noisy)"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("measured", type=Path, help="a profile of `pdserve plan --measure`")
    parser.add_argument("--threads", type=int, default=2, help="which thread count's curves")
    parser.add_argument("--name", required=True)
    parser.add_argument("--out", type=Path, required=True)
    args = parser.parse_args()
    measured = WorkerProfile.load(args.measured)
    curves = next(t for t in measured.threads if t.num_threads == args.threads)
    x, y, names = design(curves)
    coef = fit_nonnegative(x, y)
    errors = {name: round(float(e), 3) for name, e in zip(names, (x @ coef - y) / y)}
    where = machine_of(measured.machine)
    source = (
        f"least-squares fit (benchmarks/sim_profile_fit.py) to {args.measured.name}: "
        f"{len(y)} points measured with the real engine at {args.threads} torch threads by "
        f"`pdserve plan --measure` on {where}"
    )
    per_token = measured.kv_bytes_per_token
    profile = {
        "name": args.name,
        "description": f"{measured.model} on {where}, {args.threads} torch threads",
        "step": {k: {"value": float(v), "source": source} for k, v in zip(FIELDS, coef)},
        "kv_bytes_per_token": {
            "value": per_token,
            "source": f"{args.measured.name}: layers x 2 x KV heads x head dim x the dtype's bytes",
        },
        "kv_pool_tokens": {
            "value": measured.kv_pool_tokens,
            "source": f"{args.measured.name}: the KV pool it was measured with",
        },
        "transfer_latency_s": {
            "value": measured.transfer_latency_s,
            "source": f"{args.measured.name}: tcp pulls over loopback, fitted",
        },
        "transfer_bytes_per_s": {
            "value": measured.transfer_gbps * 1e9,
            "source": f"{args.measured.name}: tcp pulls over loopback, fitted",
        },
        "fit_relative_errors": errors,
    }
    args.out.write_text(json.dumps(profile, indent=1) + "\n")
    worst = max(errors.values(), key=abs)
    print(f"wrote {args.out}: {dict(zip(FIELDS, coef.round(6)))}; worst point {worst:+.0%}")
    for name, err in errors.items():
        print(f"  {name:24s} {err:+.1%}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
