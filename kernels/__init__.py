"""Attention over the paged KV cache and the KV-cache write, dispatched by device.

CPU tensors take ``kernels.cpu_ops`` (decode attention compiled from C at first use; the rest,
and any machine without a C compiler, the vectorized PyTorch reference ``kernels.reference``);
CUDA tensors take the Triton kernels (``kernels.triton_ops``). ``backend="reference"``, ``"cpu"``
or ``"triton"`` forces one (tests run the Triton kernels on CPU under ``TRITON_INTERPRET=1``).
"""

from __future__ import annotations

from types import ModuleType

import torch

from kernels import cpu_ops, reference


def _backend(tensor: torch.Tensor, backend: str | None) -> ModuleType:
    if backend is None:
        backend = "triton" if tensor.is_cuda else "cpu"
    if backend == "reference":
        return reference
    if backend == "cpu":
        return cpu_ops
    if backend == "triton":
        from kernels import triton_ops  # imported lazily: triton is optional on CPU hosts

        return triton_ops
    raise ValueError(f"unknown kernel backend {backend!r} (use 'reference', 'cpu' or 'triton')")


def write_kv(
    key: torch.Tensor,
    value: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
    backend: str | None = None,
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
    backend: str | None = None,
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
    backend: str | None = None,
) -> torch.Tensor:
    """Packed prefill chunks, causal, over each sequence's cached prefix plus the chunk."""
    return _backend(query, backend).paged_attention_prefill(
        query, key_cache, value_cache, block_tables, query_start_loc, context_lens, scale
    )
