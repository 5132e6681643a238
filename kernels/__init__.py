"""Attention over the paged KV cache and the KV-cache write, dispatched by device or backend.

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


class Backend(Protocol):
    """The three operations, with the contracts of ``kernels.reference``'s functions."""

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
