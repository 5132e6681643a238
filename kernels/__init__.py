"""Attention over the paged KV cache, the KV-cache write, and the per-token glue of a decoder
layer (residual add with RMSNorm, rotary with the KV write, SiLU-and-multiply), dispatched by
device or backend.

``backend`` picks the implementation: None dispatches by device (CUDA tensors take the Triton
kernels, ``kernels.triton_ops``; CPU tensors the vectorized PyTorch reference,
``kernels.reference``); ``"reference"`` or ``"triton"`` forces one (tests run the Triton kernels
on CPU under ``TRITON_INTERPRET=1``); any other ``Backend`` object is used as it is, such as the
compiled CPU decode attention that ``kernels.cpu_ops.load(build_dir)`` returns (the engine's
model runner loads it, or not, from its config and passes it down).
"""

from __future__ import annotations

from typing import Protocol

import torch

from kernels import reference
from kernels.reference import Rotary

__all__ = [
    "Backend",
    "Rotary",
    "add_rms_norm",
    "paged_attention_decode",
    "paged_attention_prefill",
    "rotary_write_kv",
    "silu_mul",
    "write_kv",
]


class Backend(Protocol):
    """The operations, with the contracts of ``kernels.reference``'s functions."""

    def write_kv(
        self,
        key: torch.Tensor,
        value: torch.Tensor,
        key_cache: torch.Tensor,
        value_cache: torch.Tensor,
        slot_mapping: torch.Tensor,
        /,
    ) -> None: ...

    def paged_attention_decode(
        self,
        query: torch.Tensor,
        key_cache: torch.Tensor,
        value_cache: torch.Tensor,
        block_tables: torch.Tensor,
        context_lens: torch.Tensor,
        scale: float,
        max_context_len: int | None = None,
        /,
    ) -> torch.Tensor: ...

    def paged_attention_prefill(
        self,
        query: torch.Tensor,
        key_cache: torch.Tensor,
        value_cache: torch.Tensor,
        block_tables: torch.Tensor,
        query_start_loc: torch.Tensor,
        context_lens: torch.Tensor,
        scale: float,
        /,
    ) -> torch.Tensor: ...

    def add_rms_norm(
        self, x: torch.Tensor, delta: torch.Tensor | None, weight: torch.Tensor, eps: float, /
    ) -> torch.Tensor: ...

    def rotary_write_kv(
        self,
        qkv: torch.Tensor,
        rotary: Rotary,
        key_cache: torch.Tensor,
        value_cache: torch.Tensor,
        slot_mapping: torch.Tensor,
        num_heads: int,
        num_kv_heads: int,
        /,
    ) -> torch.Tensor: ...

    def silu_mul(self, gate_up: torch.Tensor, /) -> torch.Tensor: ...


def _backend(tensor: torch.Tensor, backend: str | Backend | None) -> Backend:
    if backend is None:
        backend = "triton" if tensor.is_cuda else "reference"
    if not isinstance(backend, str):
        return backend
    if backend == "reference":
        return reference
    if backend == "triton":
        from kernels import triton_ops  # imported lazily: triton is optional on CPU hosts

        return triton_ops
    raise ValueError(
        f"unknown kernel backend {backend!r} (use 'reference' or 'triton', or a loaded backend "
        "such as kernels.cpu_ops.load(build_dir))"
    )


def write_kv(
    key: torch.Tensor,
    value: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
    backend: str | Backend | None = None,
) -> None:
    """Store each token's key/value at its slot (see ``kernels.reference.write_kv``)."""
    _backend(key, backend).write_kv(key, value, key_cache, value_cache, slot_mapping)


def paged_attention_decode(
    query: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    block_tables: torch.Tensor,
    context_lens: torch.Tensor,
    scale: float,
    max_context_len: int | None = None,
    backend: str | Backend | None = None,
) -> torch.Tensor:
    """One query token per sequence over its paged context."""
    return _backend(query, backend).paged_attention_decode(
        query, key_cache, value_cache, block_tables, context_lens, scale, max_context_len
    )


def paged_attention_prefill(
    query: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    block_tables: torch.Tensor,
    query_start_loc: torch.Tensor,
    context_lens: torch.Tensor,
    scale: float,
    backend: str | Backend | None = None,
) -> torch.Tensor:
    """Packed prefill chunks, causal, over each sequence's cached prefix plus the chunk."""
    return _backend(query, backend).paged_attention_prefill(
        query, key_cache, value_cache, block_tables, query_start_loc, context_lens, scale
    )


def add_rms_norm(
    x: torch.Tensor,
    delta: torch.Tensor | None,
    weight: torch.Tensor,
    eps: float,
    backend: str | Backend | None = None,
) -> torch.Tensor:
    """RMSNorm of the residual stream ``x`` after adding ``delta`` into it (in place)."""
    return _backend(x, backend).add_rms_norm(x, delta, weight, eps)


def rotary_write_kv(
    qkv: torch.Tensor,
    rotary: Rotary,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
    num_heads: int,
    num_kv_heads: int,
    backend: str | Backend | None = None,
) -> torch.Tensor:
    """Rotated queries of a fused q/k/v projection; its rotated keys and values go to the cache."""
    return _backend(qkv, backend).rotary_write_kv(
        qkv, rotary, key_cache, value_cache, slot_mapping, num_heads, num_kv_heads
    )


def silu_mul(gate_up: torch.Tensor, backend: str | Backend | None = None) -> torch.Tensor:
    """``silu(gate) * up`` of a fused gate/up projection."""
    return _backend(gate_up, backend).silu_mul(gate_up)
