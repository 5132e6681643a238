"""A snapshot of an engine's state and counters: what its worker publishes in the registry and
exports on ``/metrics`` (one definition of each number, read in one place)."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class EngineStats:
    num_running: int = 0  # sequences in the running batch
    num_waiting: int = 0  # queued, swapped out, or (decode) waiting for their pulled KV
    num_pulling: int = 0  # decode: requests waiting for room to pull their KV, or pulling it
    num_pinned: int = 0  # prefill: requests whose blocks wait to be pulled
    kv_blocks_total: int = 0
    kv_blocks_used: int = 0  # referenced by a sequence
    kv_blocks_cached: int = 0  # not referenced, holding a reusable prefix (evicted on demand)
    kv_blocks_free: int = 0  # holding nothing
    num_prefix_blocks: int = 0  # full blocks indexed in the prefix cache, referenced or not
    prefix_cache_queries: int = 0  # prompt tokens looked up in the prefix cache, since start
    prefix_cache_hits: int = 0  # of those, tokens found cached
    num_preemptions: int = 0  # since start
