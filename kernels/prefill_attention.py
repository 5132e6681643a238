"""The compiled prefill attention (``kernels/csrc/prefill_attention_cpu.c``): the prompt tokens of
a step attend causally to their sequences' contexts, read from the paged cache. Two compiled
paths compute it: ``avx512_bf16`` (VDPBF16PS) on CPUs with AVX-512 BF16, and ``amx``
(``prefill_attention_amx.c``: both products on AMX tiles) where the compiler and Linux also give
AMX. The library reports which it has (``paths``).

They take bfloat16 queries and caches, head_dim a multiple of 32 up to 256;
``PrefillAttention.__call__`` returns None for anything else, and the caller keeps
``kernels.reference.paged_attention_prefill`` (PyTorch's SDPA), which computes the same attention:
the scores and the softmax in float32 in all, the softmax weights rounded to bfloat16 before they
weigh the values, as PyTorch's CPU flash attention rounds them for a bfloat16 query.

Which is fastest depends on the CPU, so it is measured, not guessed: on a 2-core Zen 4 VM the
VDPBF16PS path ran a 2,048-token prompt 2.4x faster than SDPA; on an Emerald Rapids Xeon, where
VDPBF16PS issues at half rate, SDPA (on AMX tiles) was 2.8x faster than it and the AMX path
1.4-2.3x faster than SDPA (``benchmarks/cpu_kernels.py``, 512-4,096 tokens). ``measure`` times
SDPA and each path on a prompt of the model's shape once (the model runner does, at start), and
``use`` then names the compiled path that serves that shape (None: SDPA).
"""

from __future__ import annotations

import ctypes
import time
from collections.abc import Callable
from functools import partial

import torch

from kernels import reference

BAD_INDEX = 3  # its status for a block id outside the cache (nothing written)
NOT_BUILT = 4  # its status for a path this build or this OS does not have
PATHS = ("avx512_bf16", "amx")  # the compiled paths, named to the C entry by their index
SDPA = "sdpa"  # PyTorch's, in measure's answer
MAX_HEAD_DIM, DIM_MULTIPLE = 256, 32
MEASURE_TOKENS, MEASURE_CALLS = 1024, 3  # the prompt both are timed on; calls each, in turn
Shape = tuple[int, int, int, int]  # (num_heads, num_kv_heads, head_dim, torch threads)

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
    """The compiled paths of a loaded kernel library (``paths``: those it has; ``available``:
    any), and which of them, or SDPA, measured fastest per shape."""

    def __init__(self, lib: ctypes.CDLL) -> None:
        self._fn = lib.prefill_attention_bf16
        self._fn.argtypes = [ctypes.POINTER(_Job), ctypes.c_int, ctypes.c_int]
        self._fn.restype = ctypes.c_int
        self.paths = tuple(
            name
            for index, name in enumerate(PATHS)
            if self._fn(ctypes.byref(_Job()), 1, index) != NOT_BUILT
        )
        self.available = bool(self.paths)
        self._chosen: dict[Shape, str] = {}  # measured fastest: SDPA or a compiled path

    def measure(self, num_heads: int, num_kv_heads: int, head_dim: int) -> dict[str, float]:
        """Seconds of SDPA and of each compiled path (the fastest of ``MEASURE_CALLS`` each, in
        turn) on a fresh ``MEASURE_TOKENS``-token bfloat16 prompt of this shape at torch's
        thread count, by name; the fastest is remembered for ``use``. Empty where the compiled
        paths do not take the shape."""
        block_size, blocks = 16, MEASURE_TOKENS // 16
        shape = (blocks, block_size, num_kv_heads, head_dim)
        key, value = torch.randn(shape).bfloat16(), torch.randn(shape).bfloat16()
        query = torch.randn(MEASURE_TOKENS, num_heads, head_dim).bfloat16()
        tables = torch.arange(blocks, dtype=torch.int32)[None]
        starts, lens = torch.tensor([0, MEASURE_TOKENS]), torch.tensor([MEASURE_TOKENS])
        if not self.takes(query, key, value):
            return {}
        args = (query, key, value, tables, starts, lens, head_dim**-0.5)
        calls: dict[str, Callable[[], torch.Tensor | None]] = {
            SDPA: partial(reference.paged_attention_prefill, *args)
        }
        for name in self.paths:
            calls[name] = partial(self, *args, path=name)
        best = dict.fromkeys(calls, float("inf"))
        with torch.inference_mode():
            for round in range(MEASURE_CALLS + 1):  # round 0 warms each up, untimed
                for name, call in calls.items():
                    start = time.perf_counter()
                    call()
                    if round:
                        best[name] = min(best[name], time.perf_counter() - start)
        key_of = (num_heads, num_kv_heads, head_dim, torch.get_num_threads())
        self._chosen[key_of] = min(best, key=best.__getitem__)
        return best

    def use(self, query: torch.Tensor, key_cache: torch.Tensor) -> str | None:
        """The compiled path ``measure`` found fastest for this shape, or None (not measured, or
        SDPA was faster)."""
        if query.dim() != 3 or key_cache.dim() != 4:
            return None
        key = (query.shape[1], key_cache.shape[2], query.shape[2], torch.get_num_threads())
        chosen = self._chosen.get(key, SDPA)
        return None if chosen == SDPA else chosen

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
        path: str | None = None,
    ) -> torch.Tensor | None:
        """``kernels.reference.paged_attention_prefill``'s contract, by ``path`` (one of
        ``paths``; None: the one ``use`` names, else the last of ``paths``); None where
        ``takes`` is False. Raises IndexError for a block id outside the cache, ValueError for
        contexts shorter than their queries or a path this library does not have."""
        if not self.takes(query, key_cache, value_cache):
            return None
        path = path or self.use(query, key_cache) or self.paths[-1]
        if path not in self.paths:
            raise ValueError(f"prefill attention path {path!r}: this build has {self.paths}")
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
        status = self._fn(ctypes.byref(job), torch.get_num_threads(), PATHS.index(path))
        if status == BAD_INDEX:
            raise IndexError("a block table holds a block id outside the KV cache")
        if status == 1:
            raise ValueError("prefill attention: a context shorter than its query tokens")
        if status != 0:
            raise RuntimeError(f"CPU prefill attention kernel failed (status {status})")
        return out
