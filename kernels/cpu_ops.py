"""The compiled CPU path: paged decode attention that reads KV blocks in place, and the
small-batch linear layer that reads bfloat16 weights in place.

``kernels/csrc/*.c`` are built once per machine, into one library, with the system C compiler
(``-O3 -march=native``) into a build directory and loaded with ctypes; nothing is compiled at
install time, so a wheel or image built on one CPU still runs on another. ``load(build_dir)``
returns the library as a kernel backend (``CpuKernels``) to pass as ``backend=`` to the
``kernels`` functions, or None where no compiler is found or the build fails; the caller then
keeps the vectorized PyTorch reference, which computes the same attention. The engine decides
(``EngineConfig.cpu_kernels``, ``cache_dir``, ``cpu_kernels_cc``); nothing here reads the
environment.

Of attention, only decode is compiled: it runs every step for every sequence and, done with
PyTorch ops, copies each sequence's whole context out of the cache (``reference.gather_blocks``)
per layer. Prefill and the KV write are reference ops here. ``CpuKernels.linear_bf16`` serves the
model's linear layers (``services.engine.model.packed_linear``) at decode batches of a few rows on
CPUs without bfloat16 dot products.
"""

from __future__ import annotations

import ctypes
import hashlib
import logging
import os
import platform
import shutil
import subprocess
import tempfile
from functools import cache
from pathlib import Path

import torch

from kernels import reference

logger = logging.getLogger(__name__)

SOURCES = [
    Path(__file__).parent / "csrc" / f"{name}.c"
    for name in ("paged_attention_cpu", "linear_bf16_cpu")
]
FLAGS = ["-O3", "-march=native", "-fopenmp", "-fPIC", "-shared"]
MAX_GROUP = 64  # query heads per KV head the C kernel accepts
LANES, MAX_HEAD_DIM = 16, 256  # head_dim: a multiple of the kernel's vector width, at most this
COMPILERS = ("cc", "gcc", "clang")  # tried in this order when none is named


def _cpu_signature() -> str:
    """What ``-march=native`` depends on: the CPU model and its feature flags."""
    try:
        lines = Path("/proc/cpuinfo").read_text().splitlines()
        keep = [ln for ln in lines if ln.startswith(("model name", "flags"))][:2]
        return "\n".join(keep)
    except OSError:
        return platform.processor() or platform.machine()


def find_compiler(preferred: str | None = None) -> str | None:
    """``preferred`` where it is on PATH (a warning where it is not), else the first of
    ``COMPILERS`` that is, else None."""
    if preferred:
        if shutil.which(preferred):
            return preferred
        logger.warning("C compiler %r not found: trying %s", preferred, ", ".join(COMPILERS))
    return next((name for name in COMPILERS if shutil.which(name)), None)


def build(compiler: str, out_dir: Path) -> Path:
    """Compile the kernels (once: the file name hashes the sources, flags and CPU)."""
    source = b"".join(path.read_bytes() for path in SOURCES)
    key = hashlib.sha256(source + " ".join(FLAGS).encode() + _cpu_signature().encode())
    target = out_dir / f"pdserve_cpu-{key.hexdigest()[:16]}.so"
    if target.exists():
        return target
    out_dir.mkdir(parents=True, exist_ok=True)
    # Build beside the target, then rename: processes starting together never load half a file.
    with tempfile.TemporaryDirectory(dir=out_dir) as tmp:
        partial = Path(tmp) / target.name
        subprocess.run(
            [compiler, *FLAGS, *map(str, SOURCES), "-o", str(partial), "-lm"],
            check=True,
            capture_output=True,
            text=True,
            timeout=120,
        )
        os.replace(partial, target)
    return target


@cache
def load(build_dir: Path, compiler: str | None = None) -> CpuKernels | None:
    """The kernel built under ``build_dir`` (compiled there on first use) with ``compiler`` (None:
    the first of ``COMPILERS`` on PATH), or None where it cannot be built (the reason is logged).

    Memoized per (directory, compiler): a loaded shared library stays for the process's life, so
    each is loaded once and shared by every engine that names it.
    """
    found = find_compiler(compiler)
    if found is None:
        logger.warning("no C compiler found: CPU decode attention uses the PyTorch reference")
        return None
    try:
        library = build(found, Path(build_dir))
        return CpuKernels(ctypes.CDLL(str(library)), library)
    except (OSError, subprocess.SubprocessError) as exc:
        detail = getattr(exc, "stderr", "") or exc
        logger.warning("CPU attention kernel not built (%s): using the PyTorch reference", detail)
        return None


CACHE_DTYPES = (torch.float32, torch.bfloat16)  # a kernel each; the math is float32 in both
LINEAR_MAX_ROWS = 4  # rows of x linear_bf16 takes (MAX_ROWS in linear_bf16_cpu.c)


def supports(query: torch.Tensor, key_cache: torch.Tensor, value_cache: torch.Tensor) -> bool:
    """Whether the compiled kernel takes these tensors (float32 or bfloat16 CPU caches of one
    dtype sharing strides, head_dim a multiple of 16 up to 256)."""
    num_heads, num_kv_heads, head_dim = query.shape[1], key_cache.shape[2], query.shape[2]
    return (
        query.device.type == "cpu"
        and key_cache.dtype == value_cache.dtype
        and key_cache.dtype in CACHE_DTYPES
        and key_cache.stride() == value_cache.stride()
        and key_cache.stride(3) == 1
        and num_heads % num_kv_heads == 0
        and num_heads // num_kv_heads <= MAX_GROUP
        and head_dim % LANES == 0
        and head_dim <= MAX_HEAD_DIM
    )


class CpuKernels:
    """A loaded kernel library as a ``kernels`` backend: decode attention compiled for float32
    and bfloat16 caches (other dtypes and layouts, see ``supports``, go to the reference), the KV
    write and prefill the reference."""

    write_kv = staticmethod(reference.write_kv)
    paged_attention_prefill = staticmethod(reference.paged_attention_prefill)

    def __init__(self, lib: ctypes.CDLL, path: Path) -> None:
        self.lib, self.path = lib, path
        i64, i32, ptr = ctypes.c_int64, ctypes.c_int32, ctypes.c_void_p
        self._decode = {}
        for dtype, name in ((torch.float32, "f32"), (torch.bfloat16, "bf16")):
            fn = getattr(lib, f"paged_attention_decode_{name}")
            fn.argtypes = [ptr, ptr, ptr, i64, i64, i64, ptr, i64, ptr, i32, i32, i32, i32, i32]
            fn.argtypes += [i32, ctypes.c_float, ptr, i32]
            fn.restype = ctypes.c_int
            self._decode[dtype] = fn
        self._checked: tuple[torch.Tensor, torch.Tensor, int, int, int] | None = None
        self._linear = lib.linear_bf16
        self._linear.argtypes = [ptr, ptr, ptr, ptr, ctypes.c_int, ctypes.c_int, ctypes.c_int]
        self._linear.argtypes += [ctypes.c_int]
        self._linear.restype = ctypes.c_int

    def __repr__(self) -> str:
        return f"CpuKernels({str(self.path)!r})"

    def _check_indices(
        self,
        tables: torch.Tensor,
        lens: torch.Tensor,
        max_len: int,
        block_size: int,
        num_blocks: int,
    ) -> None:
        """The C kernel trusts its indices: check them here rather than read out of bounds. All
        layers of a step pass the same table and length tensors: those are checked once (the
        last pair checked is held, so a new tensor can never reuse its identity)."""
        last = self._checked
        key = (max_len, block_size, num_blocks)
        if last and last[0] is tables and last[1] is lens and last[2:] == key:
            return
        if len(lens) and int(lens.clamp(max=max_len).max()) > tables.shape[-1] * block_size:
            raise ValueError("block_tables has fewer blocks than the context lengths need")
        if tables.numel() and not 0 <= int(tables.min()) <= int(tables.max()) < num_blocks:
            raise ValueError(f"block_tables holds a block id outside [0, {num_blocks})")
        self._checked = (tables, lens, *key)

    def paged_attention_decode(
        self,
        query: torch.Tensor,
        key_cache: torch.Tensor,
        value_cache: torch.Tensor,
        block_tables: torch.Tensor,
        context_lens: torch.Tensor,
        scale: float,
        max_context_len: int | None = None,
    ) -> torch.Tensor:
        """Same contract as ``reference.paged_attention_decode``."""
        if not supports(query, key_cache, value_cache):
            return reference.paged_attention_decode(
                query, key_cache, value_cache, block_tables, context_lens, scale, max_context_len
            )
        num_seqs, num_heads, head_dim = query.shape
        q = query.to(torch.float32).contiguous()
        tables = block_tables.to(torch.int32).contiguous()
        lens = context_lens.to(torch.int32).contiguous()
        max_len = (
            int(lens.max()) if max_context_len is None and num_seqs else (max_context_len or 0)
        )
        block_size, num_blocks = key_cache.shape[1], key_cache.shape[0]
        self._check_indices(tables, lens, max_len, block_size, num_blocks)
        out = torch.empty(num_seqs, num_heads, head_dim, dtype=torch.float32)
        block_stride, token_stride, head_stride, _ = key_cache.stride()
        status = self._decode[key_cache.dtype](
            q.data_ptr(),
            key_cache.data_ptr(),
            value_cache.data_ptr(),
            block_stride,
            token_stride,
            head_stride,
            tables.data_ptr(),
            tables.shape[-1],
            lens.data_ptr(),
            max_len,
            num_seqs,
            num_heads,
            key_cache.shape[2],
            head_dim,
            block_size,
            scale,
            out.data_ptr(),
            torch.get_num_threads(),
        )
        if status != 0:
            raise RuntimeError(f"CPU paged attention kernel failed (status {status})")
        return out.to(query.dtype)

    def linear_bf16(
        self, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None
    ) -> torch.Tensor | None:
        """``x @ weight.T + bias`` in bfloat16 with float32 sums, the weight read in place; None
        where the kernel does not take the inputs (more than ``LINEAR_MAX_ROWS`` rows of x, an
        input size not a multiple of 16, not bfloat16 CPU tensors, a non-contiguous weight).
        ``bias``: float32 or None."""
        rows, in_features = x.shape
        out_features = weight.shape[0]
        if (
            not 1 <= rows <= LINEAR_MAX_ROWS
            or in_features % LANES
            or x.dtype != torch.bfloat16
            or weight.dtype != torch.bfloat16
            or x.device.type != "cpu"
            or not weight.is_contiguous()
            or (bias is not None and bias.dtype != torch.float32)
        ):
            return None
        x = x.contiguous()
        out = torch.empty(rows, out_features, dtype=torch.bfloat16)
        status = self._linear(
            x.data_ptr(),
            weight.data_ptr(),
            None if bias is None else bias.data_ptr(),
            out.data_ptr(),
            rows,
            in_features,
            out_features,
            torch.get_num_threads(),
        )
        if status != 0:
            raise RuntimeError(f"CPU bfloat16 linear kernel failed (status {status})")
        return out
