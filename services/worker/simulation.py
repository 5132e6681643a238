"""What ``--simulate PROFILE`` turns on in a worker: the profile, read once at start-up, and the
KV client whose pulls take the profile's link time (docs/simulation.md)."""

from __future__ import annotations

import json
from pathlib import Path

from kvtransfer.base import KVTransferClient
from kvtransfer.metrics import TransferMetrics
from kvtransfer.simulated_link import SimulatedLinkClient
from services.engine.simulation_profile import SimulationProfile

# The profiles committed with the source (absent from an installed copy: pass a path there).
PROFILES_DIR = Path(__file__).resolve().parents[2] / "benchmarks" / "profiles"


def profile_path(spec: str) -> Path:
    """``spec`` as a file: a path, or a profile's name in ``benchmarks/profiles`` (with or
    without its ``sim-`` prefix and ``.json`` suffix)."""
    path = Path(spec)
    if path.is_file():
        return path
    stem = spec.removesuffix(".json")
    for name in (f"{stem}.json", f"sim-{stem}.json"):
        if (PROFILES_DIR / name).is_file():
            return PROFILES_DIR / name
    known = sorted(p.stem for p in PROFILES_DIR.glob("sim-*.json"))
    raise ValueError(f"--simulate {spec}: no such file or profile (known: {', '.join(known)})")


def load_profile(spec: str) -> SimulationProfile:
    path = profile_path(spec)
    try:
        return SimulationProfile.from_dict(json.loads(path.read_text()))
    except (json.JSONDecodeError, ValueError, TypeError) as exc:
        raise ValueError(f"--simulate {spec}: {path} is not a valid profile: {exc}") from exc


def simulated_link_client(
    profile: SimulationProfile,
    block_size: int,
    token: str | None,
    metrics: TransferMetrics | None = None,
) -> KVTransferClient:
    """The decode side's KV client: tcp, each pull followed by the profile's link time."""
    per_block = profile.transfer_seconds(1, block_size) - profile.transfer_latency_s
    return SimulatedLinkClient(
        token,
        metrics=metrics,
        latency_s=profile.transfer_latency_s,
        seconds_per_block=per_block,
    )
