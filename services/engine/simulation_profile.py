"""A simulated worker's profile: how long its steps and KV transfers take, and its KV pool.

A simulated worker (``pdserve prefill|decode|colocated --simulate PROFILE``) runs the real
engine, scheduler, block pool and hand-off, with the model replaced by
``services.engine.model.simulated.SimulatedModel``, which waits for the step time this profile
gives and produces deterministic tokens. The profile is a small JSON file (see
``benchmarks/profiles/sim-*.json`` and docs/simulation.md); every number in it may be written as
``{"value": x, "source": "where x comes from"}``, and the sources are kept.

The step-time model is linear in what a step computes, as in Vidur's and Dynamo's mocker's
fitted models (a step of a batched engine costs a fixed part, a part per token and a part per
attended (query, key) pair)::

    seconds = base_s
            + prefill_token_s * (prefill tokens in the step)
            + prefill_pair_s  * (attention pairs of the prefill chunks: sum n * (start + (n+1)/2))
            + decode_seq_s    * (decode sequences in the step)
            + decode_context_s * (context tokens the decode sequences attend to)

A KV transfer of ``b`` blocks takes ``transfer_latency_s + b * block bytes / transfer_bytes_per_s``
(block bytes: ``kv_bytes_per_token * block_size``, the real model's, not the simulated blocks').
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any


@dataclass(frozen=True)
class StepTimeModel:
    """Seconds of one engine step from the work in it (the module doc gives the formula)."""

    base_s: float
    prefill_token_s: float
    prefill_pair_s: float
    decode_seq_s: float
    decode_context_s: float

    def seconds(self, prefill_chunks: list[tuple[int, int]], decode_contexts: list[int]) -> float:
        """``prefill_chunks``: (tokens already computed, tokens computed now) per prefill;
        ``decode_contexts``: each decode sequence's context length, its new token included."""
        if not prefill_chunks and not decode_contexts:
            return 0.0
        tokens = sum(n for _, n in prefill_chunks)
        pairs = sum(n * (start + (n + 1) / 2) for start, n in prefill_chunks)
        return (
            self.base_s
            + self.prefill_token_s * tokens
            + self.prefill_pair_s * pairs
            + self.decode_seq_s * len(decode_contexts)
            + self.decode_context_s * sum(decode_contexts)
        )


@dataclass(frozen=True)
class SimulationProfile:
    """What a simulated worker imitates: a model on a machine (see the module doc)."""

    name: str
    step: StepTimeModel
    kv_bytes_per_token: float
    kv_pool_tokens: int
    transfer_latency_s: float
    transfer_bytes_per_s: float
    sources: dict[str, str] = field(default_factory=dict)  # "step.base_s" -> its source

    def __post_init__(self) -> None:
        if self.transfer_bytes_per_s <= 0 or self.kv_bytes_per_token <= 0:
            raise ValueError("transfer_bytes_per_s and kv_bytes_per_token must be > 0")
        if self.kv_pool_tokens <= 0:
            raise ValueError("kv_pool_tokens must be > 0")

    def num_blocks(self, block_size: int) -> int:
        """The KV pool of the simulated worker, in blocks of ``block_size`` tokens."""
        return max(1, self.kv_pool_tokens // block_size)

    def transfer_seconds(self, num_blocks: int, block_size: int) -> float:
        """Seconds to move ``num_blocks`` blocks of the real model's KV (none: no time)."""
        if num_blocks <= 0:
            return 0.0
        num_bytes = num_blocks * block_size * self.kv_bytes_per_token
        return self.transfer_latency_s + num_bytes / self.transfer_bytes_per_s

    @classmethod
    def from_dict(cls, raw: dict[str, Any]) -> SimulationProfile:
        """Parse the JSON form; a number may be ``{"value": x, "source": "..."}``."""
        sources: dict[str, str] = {}

        def number(key: str, value: Any) -> float:
            if isinstance(value, dict):
                if "source" in value:
                    sources[key] = str(value["source"])
                value = value["value"]
            if not isinstance(value, int | float) or isinstance(value, bool):
                raise ValueError(f"profile field {key!r} must be a number, got {value!r}")
            return float(value)

        try:
            steps = raw["step"]
            step = StepTimeModel(
                **{k: number(f"step.{k}", steps[k]) for k in StepTimeModel.__dataclass_fields__}
            )
            return cls(
                name=str(raw["name"]),
                step=step,
                kv_bytes_per_token=number("kv_bytes_per_token", raw["kv_bytes_per_token"]),
                kv_pool_tokens=int(number("kv_pool_tokens", raw["kv_pool_tokens"])),
                transfer_latency_s=number("transfer_latency_s", raw["transfer_latency_s"]),
                transfer_bytes_per_s=number("transfer_bytes_per_s", raw["transfer_bytes_per_s"]),
                sources=sources,
            )
        except KeyError as exc:
            raise ValueError(f"profile {raw.get('name', '?')!r} lacks the field {exc}") from exc
