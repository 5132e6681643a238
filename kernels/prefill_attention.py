"""The compiled prefill attention (``kernels/csrc/prefill_attention_cpu.c``): the prompt tokens of
a step attend causally to their sequences' contexts, read from the paged cache, with VDPBF16PS.

It takes bfloat16 queries and caches on CPUs with AVX-512 BF16 (the library reports a build
without it), head_dim a multiple of 32 up to 256; ``PrefillAttention.__call__`` returns None for
anything else, and the caller keeps ``kernels.reference.paged_attention_prefill`` (PyTorch's
SDPA), which computes the same attention: the scores and the softmax in float32 in both, the
softmax weights rounded to bfloat16 before they weigh the values here, as PyTorch's CPU flash
attention rounds them for a bfloat16 query.
"""

from __future__ import annotations

import ctypes

import torch

BAD_INDEX = 3  # its status for a block id outside the cache (nothing written)
NOT_BUILT = 4  # its status where compiled without AVX-512 BF16
MAX_HEAD_DIM, DIM_MULTIPLE = 256, 32

_ptr, _i32, _i64 = ctypes.c_void_p, ctypes.c_int32, ctypes.c_int64


class _Job(ctypes.Structure):
    """``PrefillJob`` of the C file, field for field."""

    _fields_ = [
        ("query", _ptr),
        ("key_cache", _ptr),
        ("value_cache", _ptr),
        ("block_stride", _i64),
        ("token_stride", _i64),
        ("head_stride", _i64),
        ("block_tables", _ptr),
        ("max_blocks", _i64),
        ("num_blocks", _i64),
        ("query_start", _ptr),
        ("context_lens", _ptr),
        ("num_seqs", _i32),
        ("num_heads", _i32),
        ("num_kv_heads", _i32),
        ("head_dim", _i32),
        ("block_size", _i32),
        ("scale", ctypes.c_float),
        ("out", _ptr),
    ]


class PrefillAttention:
    """The compiled call of a loaded kernel library; ``available`` is False where it was built
    without AVX-512 BF16."""

    def __init__(self, lib: ctypes.CDLL) -> None:
        self._fn = lib.prefill_attention_bf16
        self._fn.argtypes = [ctypes.POINTER(_Job), ctypes.c_int]
        self._fn.restype = ctypes.c_int
        self.available = self._fn(ctypes.byref(_Job()), 1) != NOT_BUILT

    def takes(
        self, query: torch.Tensor, key_cache: torch.Tensor, value_cache: torch.Tensor
    ) -> bool:
        """Whether the compiled call computes this attention (else the caller's reference)."""
        if not self.available or query.dim() != 3 or key_cache.dim() != 4:
            return False
        num_heads, head_dim, num_kv_heads = query.shape[1], query.shape[2], key_cache.shape[2]
        return (
            query.dtype == key_cache.dtype == value_cache.dtype == torch.bfloat16
            and query.is_cpu
            and key_cache.is_cpu
            and value_cache.is_cpu
            and key_cache.shape == value_cache.shape
            and key_cache.shape[3] == head_dim
            and key_cache.stride() == value_cache.stride()
            and key_cache.stride(3) == 1
            and num_heads % num_kv_heads == 0
            and head_dim % DIM_MULTIPLE == 0
            and head_dim <= MAX_HEAD_DIM
        )

    def __call__(
        self,
        query: torch.Tensor,
        key_cache: torch.Tensor,
        value_cache: torch.Tensor,
        block_tables: torch.Tensor,
        query_start_loc: torch.Tensor,
        context_lens: torch.Tensor,
        scale: float,
    ) -> torch.Tensor | None:
        """``kernels.reference.paged_attention_prefill``'s contract; None where ``takes`` is
        False. Raises IndexError for a block id outside the cache, ValueError for contexts
        shorter than their queries."""
        if not self.takes(query, key_cache, value_cache):
            return None
        if context_lens.numel() == 0 or query.shape[0] == 0:
            return torch.empty_like(query)
        query = query.contiguous()
        tables = block_tables.to(torch.int32).contiguous()
        starts = query_start_loc.to(torch.int64).contiguous()
        lens = context_lens.to(torch.int64).contiguous()
        out = torch.empty_like(query)
        job = _Job(
            query.data_ptr(),
            key_cache.data_ptr(),
            value_cache.data_ptr(),
            *key_cache.stride()[:3],
            tables.data_ptr(),
            tables.shape[1] if tables.dim() == 2 else 0,
            key_cache.shape[0],
            starts.data_ptr(),
            lens.data_ptr(),
            lens.shape[0],
            query.shape[1],
            key_cache.shape[2],
            query.shape[2],
            key_cache.shape[1],
            scale,
            out.data_ptr(),
        )
        status = self._fn(ctypes.byref(job), torch.get_num_threads())
        if status == BAD_INDEX:
            raise IndexError("a block table holds a block id outside the KV cache")
        if status == 1:
            raise ValueError("prefill attention: a context shorter than its query tokens")
        if status != 0:
            raise RuntimeError(f"CPU prefill attention kernel failed (status {status})")
        return out
