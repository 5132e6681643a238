"""The model of a simulated worker: the profile's step time, deterministic tokens, tiny KV.

It stands where ``LlamaModel`` stands, inside the real ``ModelRunner``: the runner packs the
batch, performs the block copies and writes pulled blocks as for the real model; the scheduler,
block pool, prefix cache and KV hand-off never know the difference.

Tokens. Each position's "KV" is a 24-bit state chained over the tokens so far,
``state(p) = mix(state(p - 1), token(p))``, stored as three bytes in the key (and value) lanes
of a one-layer, one-head KV cache (exact in every KV dtype: bytes are small integers). The
token after position ``p`` is a hash of ``state(p)``. So a token depends on every token before
it and on nothing else: a prompt gives the same tokens computed here, on a prefill worker whose
KV is pulled, or out of the prefix cache; KV that arrives wrong gives other tokens. The logits
are one row per sampled sequence with that token far above the rest, so greedy sampling, seeded
sampling at moderate temperatures and the real sampler's masks all work on them; the token is
never an end-of-sequence one, so a request runs to its ``max_tokens`` like a load test asks.

Time. ``forward`` sleeps until the profile's step time for the batch has passed since it began
(the engine's own scheduling and sampling come on top, as on a real worker).
"""

from __future__ import annotations

import dataclasses
import time

import torch
from torch import nn

from services.engine.config import ModelConfig
from services.engine.model.llama import AttentionMetadata
from services.engine.simulation_profile import SimulationProfile

STATE_BITS = 24
SEED_STATE = 0x5EED01  # the state before a sequence's first token
LOGIT_GAP = 30.0  # the chosen token's logit above the others'
_MASK64 = (1 << 64) - 1


def _splitmix64(x: int) -> int:
    x = (x + 0x9E3779B97F4A7C15) & _MASK64
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & _MASK64
    return x ^ (x >> 31)


def next_state(state: int, token: int) -> int:
    """The state after ``token`` follows a position whose state is ``state``."""
    return _splitmix64((state << 32) | token) & ((1 << STATE_BITS) - 1)


def simulated_kv_config(config: ModelConfig) -> ModelConfig:
    """``config`` with the KV geometry of the simulation: one layer, one head, three lanes
    (a state's bytes). The vocabulary, end tokens and context length stay the real model's."""
    return dataclasses.replace(config, num_layers=1, num_kv_heads=1, head_dim=3)


class SimulatedModel(nn.Module):
    """A stand-in for ``LlamaModel`` with the profile's timing (see the module doc)."""

    def __init__(self, config: ModelConfig, profile: SimulationProfile):
        super().__init__()
        self.config = simulated_kv_config(config)
        self.profile = profile
        # Tokens drawn from [low, vocab): above the special tokens of common vocabularies.
        self.low = min(1000, config.vocab_size // 2)
        self.end_tokens = frozenset(config.eos_token_ids)
        self.num_steps = 0
        self.busy_seconds = 0.0  # the sum of the step times slept for

    def next_token(self, state: int) -> int:
        """The token that follows a position of ``state``: never an end token."""
        span = self.config.vocab_size - self.low
        token = self.low + _splitmix64(state ^ 0xA5A5A5A5) % span
        while token in self.end_tokens:
            token = self.low + (token + 1 - self.low) % span
        return token

    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        layer_caches: list[tuple[torch.Tensor, torch.Tensor]],
        meta: AttentionMetadata,
    ) -> torch.Tensor:
        """The chained states of the batch's tokens (``[num_tokens, 1]``, int64), written to
        the KV cache at their slots; sleeps until the step's profile time has passed."""
        start = time.perf_counter()
        spans, prefill_chunks, decode_contexts = _spans(meta)
        keys, values = layer_caches[0]
        bs = keys.shape[1]
        slots = meta.slot_mapping.tolist()
        tokens = input_ids.tolist()
        states = [0] * len(tokens)
        for row, begin, num, table in spans:  # a sequence's new tokens: rows [row, row + num)
            state = SEED_STATE if begin == 0 else _read_state(keys, table, begin - 1)
            for i in range(row, row + num):
                state = next_state(state, tokens[i])
                states[i] = state
        if slots:
            index = torch.tensor(slots)
            lanes = torch.tensor([[(s >> 16) & 255, (s >> 8) & 255, s & 255] for s in states])
            lanes = lanes.to(keys.dtype)
            keys[index // bs, index % bs, 0] = lanes
            values[index // bs, index % bs, 0] = lanes
        seconds = self.profile.step.seconds(prefill_chunks, decode_contexts)
        self.num_steps += 1
        self.busy_seconds += seconds
        time.sleep(max(0.0, start + seconds - time.perf_counter()))
        return torch.tensor(states, dtype=torch.int64).view(-1, 1)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """One row per state: ``LOGIT_GAP`` at its next token, 0 elsewhere."""
        logits = torch.zeros(len(hidden), self.config.vocab_size)
        if len(hidden):
            chosen = [self.next_token(int(s)) for s in hidden.view(-1).tolist()]
            logits[torch.arange(len(hidden)), torch.tensor(chosen)] = LOGIT_GAP
        return logits


def _read_state(keys: torch.Tensor, table: list[int], position: int) -> int:
    """The state stored for ``position`` of the sequence whose block table is ``table``."""
    bs = keys.shape[1]
    lanes = keys[table[position // bs], position % bs, 0].tolist()
    return (int(lanes[0]) << 16) | (int(lanes[1]) << 8) | int(lanes[2])


def _spans(
    meta: AttentionMetadata,
) -> tuple[list[tuple[int, int, int, list[int]]], list[tuple[int, int]], list[int]]:
    """(first row, first position, tokens, block table) per sequence, decodes first (the
    runner's order); the prefill chunks as (computed, new); the decode contexts."""
    decode_contexts = meta.decode_context_lens.tolist()
    decode_tables = meta.decode_block_tables.tolist()
    prefill_tables = meta.prefill_block_tables.tolist()
    spans = [(i, ctx - 1, 1, decode_tables[i]) for i, ctx in enumerate(decode_contexts)]
    starts = meta.prefill_query_start_loc.tolist()
    ends = meta.prefill_context_lens.tolist()
    chunks: list[tuple[int, int]] = []
    for j, end in enumerate(ends):
        num = starts[j + 1] - starts[j]
        chunks.append((end - num, num))
        spans.append((len(decode_contexts) + starts[j], end - num, num, prefill_tables[j]))
    return spans, chunks, decode_contexts
