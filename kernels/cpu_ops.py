"""The compiled CPU path: paged decode attention that reads KV blocks in place, bfloat16 prefill
attention (``kernels.prefill_attention``), the small-batch linear layer over bfloat16 weights in
its own tiled order, the per-token glue of a decoder layer fused (``add_rms_norm``,
``rotary_write_kv``, ``silu_mul``), and sampling over the logits in the model's dtype: greedy
rows' argmax (``argmax_rows``), the exponential race with hashed noise (``race_rows``) and the
top-k / top-p / min-p floors found without a sort (``filter_floors``).

``kernels/csrc/*.c`` are built once per machine, into one library, with the system C compiler
(``-O3 -march=native``) into a build directory and loaded with ctypes; nothing is compiled at
install time, so a wheel or image built on one CPU still runs on another. ``load(build_dir)``
returns the library as a kernel backend (``CpuKernels``) to pass as ``backend=`` to the
``kernels`` functions, or None where no compiler is found or the build fails; the caller then
keeps the vectorized PyTorch reference, which computes the same attention. The engine decides
(``EngineConfig.cpu_kernels``, ``cache_dir``, ``cpu_kernels_cc``); nothing here reads the
environment.

Decode attention is compiled for float32 and bfloat16: it runs every step for every sequence
and, done with PyTorch ops, copies each sequence's whole context out of the cache
(``reference.gather_blocks``) per layer. Prefill attention is compiled for bfloat16 on CPUs with
AVX-512 BF16 and used where it measured faster than PyTorch's SDPA (twice its rate on a Zen 4
VM; slower than SDPA on AMX on a Sapphire Rapids-class Xeon); elsewhere prefill is the
reference. The KV write is part of ``rotary_write_kv``. The layer
glue is compiled because at a decode batch of one its twenty-odd PyTorch operators per layer cost
more in dispatch than in arithmetic (``kernels/csrc/layer_ops_cpu.c``). ``CpuKernels.linear_bf16``
serves the model's linear layers (``services.engine.model.packed_linear``) at decode batches of a
few rows, from weights copied once into the order it reads (``TiledWeight``): widened to float32
(1-4 rows), or on CPUs with AVX-512 BF16 with bfloat16 dot products (1-16 rows). Under
``--quantization int8`` (``services.engine.model.int8_linear``) ``quantize_rows_int8`` and
``dequantize_int32`` are the passes around oneDNN's int8 GEMM, and ``int8_small_batch`` the whole
layer at 1-4 rows (VNNI).
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
from dataclasses import dataclass
from functools import cache
from pathlib import Path
from typing import Any

import torch

from kernels import reference
from kernels.prefill_attention import PrefillAttention
from kernels.reference import Rotary

logger = logging.getLogger(__name__)

CSRC = Path(__file__).parent / "csrc"
SOURCES = [
    CSRC / f"{name}.c"
    for name in (
        "paged_attention_cpu",
        "linear_bf16_cpu",
        "gemm_bf16_cpu",
        "layer_ops_cpu",
        "int8_cpu",
        "decode_layers_cpu",
        "prefill_attention_cpu",
        "prefill_attention_amx",
        "sampling_cpu",
    )
]
HEADERS = [CSRC / "vec16.h", CSRC / "decode_parts.h", CSRC / "prefill_attention.h"]
FLAGS = ["-O3", "-march=native", "-fopenmp", "-fPIC", "-shared"]
if platform.machine().lower() in ("x86_64", "amd64"):
    # GCC prefers 256-bit vectors on many x86 CPUs and splits our 16-lane bf16 widening in two.
    FLAGS.insert(2, "-mprefer-vector-width=512")
MAX_GROUP = 64  # query heads per KV head the C kernel accepts
LANES, MAX_HEAD_DIM = 16, 256  # head_dim: a multiple of the kernel's vector width, at most this
COMPILERS = ("cc", "gcc", "clang")  # tried in this order when none is named


def cpu_signature() -> str:
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
    source = b"".join(path.read_bytes() for path in SOURCES + HEADERS)
    key = hashlib.sha256(source + " ".join(FLAGS).encode() + cpu_signature().encode())
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


# A kernel each; the sums are float32 in both (bfloat16 on AVX-512 BF16 rounds the attention
# probabilities to bfloat16 before weighing the values: paged_attention_cpu.c).
CACHE_DTYPES = (torch.float32, torch.bfloat16)
LINEAR_MAX_ROWS = 4  # rows of x linear_bf16 takes (MAX_ROWS in linear_bf16_cpu.c)
LINEAR_ROW_TILES = (8, 4)  # weight rows it reads together (its row_tile argument)
# The dot-product variant (CPUs with AVX-512 BF16): 4-row tiles, up to 16 rows of x
# (DOT_MAX_ROWS in linear_bf16_cpu.c); the fused decode layers name it by a row tile of -4.
LINEAR_DOT_MAX_ROWS = 16
LINEAR_DOT_TILE = -4
PAIRS_GROUP = 16  # output features per group of the pair order (gemm_bf16_cpu.c)
# The fused decode layers name the pair order by this tile (LINEAR_PAIRS_TILE in
# decode_parts.h) and take up to this many rows with it (PAIRS_MAX_ROWS, decode_layers_cpu.c).
LINEAR_PAIRS_TILE = -16
PAIRS_MAX_ROWS = 256
INT8_MAX_ROWS = 4  # rows of x linear_int8 takes (INT8_MAX_ROWS in int8_cpu.c)
NO_VNNI = 3  # linear_int8's status where it was compiled without AVX512-VNNI
INT32_MAX = 2**31 - 1
BAD_INDEX = 3  # the kernels' status for a block id or slot outside the cache (nothing written)


@dataclass(frozen=True)
class TiledWeight:
    """A bfloat16 ``[out, in]`` weight in the order ``linear_bf16`` reads (see
    ``kernels/csrc/linear_bf16_cpu.c``): each group of ``row_tile`` rows stored as
    ``[in / 16][row_tile][16]``, the last ``out % row_tile`` rows as they are, so that a thread
    reads its rows as one sequential stream. ``data`` has the weight's shape, not its order.
    ``dot``: read by the dot-product variant (4-row tiles), else by the float32 kernel."""

    data: torch.Tensor  # [out, in] bfloat16, contiguous, tiled
    row_tile: int
    dot: bool = False

    @classmethod
    def of(cls, weight: torch.Tensor, row_tile: int, dot: bool = False) -> TiledWeight:
        """``weight`` (``[out, in]``, ``in`` a multiple of 16) copied into the tiled order."""
        if row_tile not in LINEAR_ROW_TILES or (dot and row_tile != 4):
            raise ValueError(f"row_tile must be one of {LINEAR_ROW_TILES} (4 with dot products)")
        out, inp = weight.shape
        if inp % LANES:
            raise ValueError(f"in_features must be a multiple of {LANES}, got {inp}")
        whole = out // row_tile * row_tile
        tiles = weight[:whole].reshape(-1, row_tile, inp // LANES, LANES).transpose(1, 2)
        data = torch.cat([tiles.reshape(-1), weight[whole:].reshape(-1)]).view(out, inp)
        return cls(data.to(torch.bfloat16).contiguous(), row_tile, dot)

    @property
    def kernel_tile(self) -> int:
        """The row tile as the compiled calls take it: ``LINEAR_DOT_TILE`` for the dot products."""
        return LINEAR_DOT_TILE if self.dot else self.row_tile

    @property
    def max_rows(self) -> int:
        """The most rows of x its kernel takes."""
        return LINEAR_DOT_MAX_ROWS if self.dot else LINEAR_MAX_ROWS

    def untiled(self) -> torch.Tensor:
        """The weight in its own ``[out, in]`` order (a copy)."""
        out, inp = self.data.shape
        whole = out // self.row_tile * self.row_tile
        tiles = self.data[:whole].reshape(-1, inp // LANES, self.row_tile, LANES).transpose(1, 2)
        return torch.cat([tiles.reshape(whole, inp), self.data[whole:]])


@dataclass(frozen=True)
class PairedWeight:
    """A bfloat16 ``[out, in]`` weight in the order ``gemm_bf16_pairs`` reads (see
    ``kernels/csrc/gemm_bf16_cpu.c``): each group of 16 output features stored as
    ``[in / 2][16][2]``, so that one 64-byte vector holds a pair of inputs of each of the group's
    16 rows. ``data`` has the weight's shape, not its order."""

    data: torch.Tensor  # [out, in] bfloat16, contiguous, in pair order

    @classmethod
    def of(cls, weight: torch.Tensor) -> PairedWeight:
        """``weight`` (``[out, in]``: ``out`` a multiple of 16, ``in`` even) in pair order."""
        out, inp = weight.shape
        if out % PAIRS_GROUP or inp % 2:
            raise ValueError(
                f"the pair order needs out_features a multiple of {PAIRS_GROUP} and even "
                f"in_features, got {out} x {inp}"
            )
        grouped = weight.to(torch.bfloat16).reshape(out // PAIRS_GROUP, PAIRS_GROUP, inp // 2, 2)
        return cls(grouped.permute(0, 2, 1, 3).contiguous().view(out, inp))

    @property
    def kernel_tile(self) -> int:
        """How the fused decode layers name this order."""
        return LINEAR_PAIRS_TILE

    @property
    def max_rows(self) -> int:
        """The most rows of x the fused decode layers take with it."""
        return PAIRS_MAX_ROWS

    @staticmethod
    def takes(weight: torch.Tensor) -> bool:
        """Whether ``weight`` (2-D) has a shape the pair order holds."""
        return weight.shape[0] % PAIRS_GROUP == 0 and weight.shape[1] % 2 == 0

    def unpaired(self) -> torch.Tensor:
        """The weight in its own ``[out, in]`` order (a copy)."""
        out, inp = self.data.shape
        grouped = self.data.view(out // PAIRS_GROUP, inp // 2, PAIRS_GROUP, 2)
        return grouped.permute(0, 2, 1, 3).reshape(out, inp)


def supports(query: torch.Tensor, key_cache: torch.Tensor, value_cache: torch.Tensor) -> bool:
    """Whether the compiled kernel takes these tensors (float32 or bfloat16 CPU caches of one
    dtype, shape and strides, matching the query's head_dim, a multiple of 16 up to 256)."""
    if query.dim() != 3 or key_cache.dim() != 4:
        return False
    num_heads, num_kv_heads, head_dim = query.shape[1], key_cache.shape[2], query.shape[2]
    return (
        query.is_cpu
        and key_cache.is_cpu
        and value_cache.is_cpu
        and key_cache.shape == value_cache.shape
        and key_cache.shape[3] == head_dim
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
    """A loaded kernel library as a ``kernels`` backend: decode attention and the layer glue
    compiled for float32 and bfloat16 (other dtypes and layouts go to the reference: see
    ``supports`` and ``_glue_takes``), prefill attention compiled for bfloat16 on CPUs with
    AVX-512 BF16 (``kernels.prefill_attention``), the plain KV write the reference."""

    write_kv = staticmethod(reference.write_kv)

    def __init__(self, lib: ctypes.CDLL, path: Path) -> None:
        self.lib, self.path = lib, path
        self.prefill = PrefillAttention(lib)
        i64, i32, ptr = ctypes.c_int64, ctypes.c_int32, ctypes.c_void_p
        self._decode = {}
        for dtype, name in ((torch.float32, "f32"), (torch.bfloat16, "bf16")):
            fn = getattr(lib, f"paged_attention_decode_{name}")
            fn.argtypes = [ptr, ptr, ptr, i64, i64, i64, ptr, i64, ptr, i32, i32, i32, i32, i32]
            fn.argtypes += [i32, ctypes.c_float, ptr, i32, i64, i32]
            fn.restype = ctypes.c_int
            self._decode[dtype] = fn
        self._linear = lib.linear_bf16
        self._linear.argtypes = [ptr, ptr, ptr, ptr, ctypes.c_int, ctypes.c_int, ctypes.c_int]
        self._linear.argtypes += [ctypes.c_int, ctypes.c_int]
        self._linear.restype = ctypes.c_int
        self._linear_dot = lib.linear_bf16_dot
        self._linear_dot.argtypes = [ptr, ptr, ptr, ptr, ctypes.c_int, ctypes.c_int]
        self._linear_dot.argtypes += [ctypes.c_int, ctypes.c_int]
        self._linear_dot.restype = ctypes.c_int
        self.bf16_dot = bool(lib.linear_bf16_dot_available())  # built with AVX-512 BF16
        self._gemm_pairs = lib.gemm_bf16_pairs
        self._gemm_pairs.argtypes = [ptr, i64, ptr, ptr, ptr, i64, i64, i64, ctypes.c_int]
        self._gemm_pairs.restype = ctypes.c_int
        i64s = [i64] * 4
        self._norm = lib.add_rms_norm
        self._norm.argtypes = [ptr, ptr, ptr, ptr, i64, i64, ctypes.c_float, i32, i32]
        self._rotary = lib.rotary_write_kv
        self._rotary.argtypes = [ptr, ptr, ptr, ptr, ptr, ptr, *i64s, i64, ptr, *i64s, i32, i32]
        self._silu_mul = lib.silu_mul
        self._silu_mul.argtypes = [ptr, ptr, i64, i64, i32, i32]
        self._quantize = lib.quantize_rows_int8
        self._quantize.argtypes = [ptr, ptr, ptr, i64, i64, i32, i32]
        self._dequantize = lib.dequantize_int32
        self._dequantize.argtypes = [ptr, ptr, ptr, ptr, ptr, i64, i64, i32, i32]
        self._linear_int8 = lib.linear_int8
        self._linear_int8.argtypes = [ptr, ptr, ptr, ptr, ptr, ptr, i32, i64, i64, i32, i32]
        for fn in (self._norm, self._rotary, self._silu_mul, self._quantize, self._dequantize):
            fn.restype = ctypes.c_int
        self._linear_int8.restype = ctypes.c_int
        self._argmax = lib.argmax_rows
        self._argmax.argtypes = [ptr, ptr, i64, i64, i32, i32]
        self._argmax.restype = ctypes.c_int
        self._race = lib.race_rows
        self._race.argtypes = [ptr, ptr, ptr, ptr, ptr, i64, i64, i32, i32]
        self._race.restype = ctypes.c_int
        self._floors = lib.filter_floors
        self._floors.argtypes = [ptr, ptr, ptr, ptr, ptr, ptr, i64, i64, i32, i32]
        self._floors.restype = ctypes.c_int
        # No rows: 1 (arguments it does not take) from a VNNI build, NO_VNNI from another.
        self.int8_vnni = self._linear_int8(None, None, None, None, None, None, 0, 0, 0, 0, 1) != (
            NO_VNNI
        )

    def __repr__(self) -> str:
        return f"CpuKernels({str(self.path)!r})"

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
        if (
            block_tables.dim() != 2
            or len(block_tables) != num_seqs
            or context_lens.shape != (num_seqs,)
        ):
            raise ValueError(
                f"need one block-table row and one context length per sequence ({num_seqs}), "
                f"got tables {tuple(block_tables.shape)} and {tuple(context_lens.shape)} lengths"
            )
        # The kernel reads and writes float32 or bfloat16 rows itself: no conversion copies.
        q = (query if query.dtype in CACHE_DTYPES else query.float()).contiguous()
        tables = block_tables.to("cpu", torch.int32).contiguous()
        lens = context_lens.to("cpu", torch.int32).contiguous()
        max_len = (
            int(lens.max()) if max_context_len is None and num_seqs else (max_context_len or 0)
        )
        max_len = min(max_len, INT32_MAX)  # the lengths are int32: no more than that either
        block_size, num_blocks = key_cache.shape[1], key_cache.shape[0]
        out = torch.empty(num_seqs, num_heads, head_dim, dtype=q.dtype)
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
            q.dtype == torch.bfloat16,
            num_blocks,
            torch.get_num_threads(),
        )
        if status == BAD_INDEX:
            raise ValueError(
                "block_tables has fewer blocks than the context lengths need, or a block id "
                f"outside [0, {num_blocks})"
            )
        if status != 0:
            raise RuntimeError(f"CPU paged attention kernel failed (status {status})")
        return out if out.dtype == query.dtype else out.to(query.dtype)

    def paged_attention_prefill(
        self,
        query: torch.Tensor,
        key_cache: torch.Tensor,
        value_cache: torch.Tensor,
        block_tables: torch.Tensor,
        query_start_loc: torch.Tensor,
        context_lens: torch.Tensor,
        scale: float,
    ) -> torch.Tensor:
        """Same contract as ``reference.paged_attention_prefill``: compiled where
        ``PrefillAttention.takes`` the tensors and measured faster there (``use``), else the
        reference."""
        args = (query, key_cache, value_cache, block_tables, query_start_loc, context_lens)
        path = self.prefill.use(query, key_cache)
        out = self.prefill(*args, scale, path=path) if path else None
        return reference.paged_attention_prefill(*args, scale) if out is None else out

    def linear_bf16(
        self, x: torch.Tensor, weight: TiledWeight | PairedWeight, bias: torch.Tensor | None
    ) -> torch.Tensor | None:
        """``x @ W.T + bias`` in bfloat16 with float32 sums, W read in its tiled order; None
        where the kernel does not take the inputs (more rows of x than ``weight.max_rows``, an
        input size not a multiple of 16, not bfloat16 CPU tensors, dot products on a build
        without them). ``bias``: float32 or None. The float32 kernel's result does not depend
        on ``weight.row_tile``; the dot products sum in another order. A weight in pair order
        goes to ``gemm_bf16_pairs`` (any number of rows)."""
        if isinstance(weight, PairedWeight):
            return self.gemm_bf16_pairs(x, weight, bias)
        rows, in_features = x.shape
        data = weight.data
        out_features = data.shape[0]
        if (
            not 1 <= rows <= weight.max_rows
            or (weight.dot and not self.bf16_dot)
            or in_features % LANES
            or data.shape != (out_features, in_features)
            or out_features < 1
            or x.dtype != torch.bfloat16
            or data.dtype != torch.bfloat16
            or not (x.is_cpu and data.is_cpu)
            or not data.is_contiguous()
            or weight.row_tile not in LINEAR_ROW_TILES
            or not _bias_fits(bias, out_features)
        ):
            return None
        x = x.contiguous()
        out = torch.empty(rows, out_features, dtype=torch.bfloat16)
        args = (
            x.data_ptr(),
            data.data_ptr(),
            None if bias is None else bias.data_ptr(),
            out.data_ptr(),
            rows,
            in_features,
            out_features,
            torch.get_num_threads(),
        )
        if weight.dot:
            status = self._linear_dot(*args)
        else:
            status = self._linear(*args, weight.row_tile)
        if status != 0:
            raise RuntimeError(f"CPU bfloat16 linear kernel failed (status {status})")
        return out

    def gemm_bf16_pairs(
        self, x: torch.Tensor, weight: PairedWeight, bias: torch.Tensor | None
    ) -> torch.Tensor | None:
        """``x @ W.T + bias`` in bfloat16 with float32 sums, any number of rows, W in pair
        order; None where the kernel does not take the inputs (no AVX-512 BF16 in this build,
        not bfloat16 CPU tensors, shapes that do not match, rows not contiguous). ``bias``:
        float32 or None."""
        rows, in_features = x.shape
        data = weight.data
        out_features = data.shape[0]
        if (
            not self.bf16_dot
            or rows < 1
            or data.shape != (out_features, in_features)
            or x.dtype != torch.bfloat16
            or not (x.is_cpu and data.is_cpu)
            or not data.is_contiguous()
            or x.stride(1) != 1
            or not _bias_fits(bias, out_features)
        ):
            return None
        out = torch.empty(rows, out_features, dtype=torch.bfloat16)
        status = self._gemm_pairs(
            x.data_ptr(),
            x.stride(0),
            data.data_ptr(),
            None if bias is None else bias.data_ptr(),
            out.data_ptr(),
            rows,
            in_features,
            out_features,
            torch.get_num_threads(),
        )
        if status == 1:
            return None
        _check_status(status, "gemm_bf16_pairs")
        return out

    def add_rms_norm(
        self, x: torch.Tensor, delta: torch.Tensor | None, weight: torch.Tensor, eps: float
    ) -> torch.Tensor:
        """Same contract as ``reference.add_rms_norm``."""
        hidden = x.shape[-1]
        if (
            not _glue_takes(x, delta, weight)
            or weight.shape != (hidden,)
            or (delta is not None and delta.shape != x.shape)  # the reference broadcasts
        ):
            return reference.add_rms_norm(x, delta, weight, eps)
        out = torch.empty_like(x)
        status = self._norm(
            x.data_ptr(),
            None if delta is None else delta.data_ptr(),
            weight.data_ptr(),
            out.data_ptr(),
            x.numel() // hidden,
            hidden,
            eps,
            x.dtype == torch.bfloat16,
            torch.get_num_threads(),
        )
        _check_status(status, "add_rms_norm")
        return out

    def rotary_write_kv(
        self,
        qkv: torch.Tensor,
        rotary: Rotary,
        key_cache: torch.Tensor,
        value_cache: torch.Tensor,
        slot_mapping: torch.Tensor,
        num_heads: int,
        num_kv_heads: int,
    ) -> torch.Tensor:
        """Same contract as ``reference.rotary_write_kv``."""
        cos, sin = rotary
        num_tokens, head_dim = qkv.shape[0], cos.shape[-1]
        if (
            not _glue_takes(qkv, cos, sin, key_cache, value_cache, contiguous=3)
            or qkv.dim() != 2
            or key_cache.dim() != 4
            or key_cache.shape[2:] != (num_kv_heads, head_dim)
            or value_cache.shape != key_cache.shape
            or qkv.shape[1] != (num_heads + 2 * num_kv_heads) * head_dim
            or cos.shape != (num_tokens, 1, head_dim)
            or sin.shape != cos.shape
            or key_cache.stride() != value_cache.stride()
            or key_cache.stride(3) != 1
            or head_dim % (2 * LANES)
            or head_dim > MAX_HEAD_DIM
            or slot_mapping.dtype != torch.int64
            or not slot_mapping.is_cpu
        ):
            return reference.rotary_write_kv(
                qkv, rotary, key_cache, value_cache, slot_mapping, num_heads, num_kv_heads
            )
        slots = slot_mapping.contiguous()
        if slots.shape != (num_tokens,):
            raise ValueError(f"slot_mapping has {slots.shape[0]} slots for {num_tokens} tokens")
        query = qkv.new_empty(num_tokens, num_heads, head_dim)
        block_stride, token_stride, head_stride, _ = key_cache.stride()
        status = self._rotary(
            qkv.data_ptr(),
            cos.data_ptr(),
            sin.data_ptr(),
            slots.data_ptr(),
            key_cache.data_ptr(),
            value_cache.data_ptr(),
            block_stride,
            token_stride,
            head_stride,
            key_cache.shape[1],
            key_cache.shape[0],
            query.data_ptr(),
            num_tokens,
            num_heads,
            num_kv_heads,
            head_dim,
            qkv.dtype == torch.bfloat16,
            torch.get_num_threads(),
        )
        if status == BAD_INDEX:
            capacity = key_cache.shape[0] * key_cache.shape[1]
            raise ValueError(f"slot_mapping holds a slot outside [0, {capacity})")
        _check_status(status, "rotary_write_kv")
        return query

    def silu_mul(self, gate_up: torch.Tensor) -> torch.Tensor:
        """Same contract as ``reference.silu_mul``."""
        size = gate_up.shape[-1] // 2
        if not _glue_takes(gate_up) or gate_up.shape[-1] % (2 * LANES):
            return reference.silu_mul(gate_up)
        out = gate_up.new_empty(*gate_up.shape[:-1], size)
        status = self._silu_mul(
            gate_up.data_ptr(),
            out.data_ptr(),
            gate_up.numel() // (2 * size),
            size,
            gate_up.dtype == torch.bfloat16,
            torch.get_num_threads(),
        )
        _check_status(status, "silu_mul")
        return out

    def argmax_rows(self, logits: torch.Tensor) -> torch.Tensor:
        """Same contract as ``reference.argmax_rows``."""
        if (
            logits.dim() != 2
            or logits.shape[1] == 0
            or logits.dtype not in CACHE_DTYPES
            or not logits.is_cpu
            or not logits.is_contiguous()
        ):
            return reference.argmax_rows(logits)
        out = torch.empty(logits.shape[0], dtype=torch.int64)
        status = self._argmax(
            logits.data_ptr(),
            out.data_ptr(),
            logits.shape[0],
            logits.shape[1],
            logits.dtype == torch.bfloat16,
            torch.get_num_threads(),
        )
        _check_status(status, "argmax_rows")
        return out

    def race_rows(
        self,
        logits: torch.Tensor,
        scale: torch.Tensor,
        keys: torch.Tensor,
        floors: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """Same contract as ``reference.race_rows`` (the same noise bits; a token differs only
        where two scores tie to the last bit or so: the logarithms differ there)."""
        if not _sampling_takes(logits, scale, keys, floors):
            return reference.race_rows(logits, scale, keys, floors)
        rows, n = logits.shape
        scale = scale.to(torch.float32).contiguous()
        keys = keys.to(torch.int64).contiguous()
        floors = None if floors is None else floors.to(torch.float32).contiguous()
        out = torch.empty(rows, dtype=torch.int64)
        status = self._race(
            logits.data_ptr(),
            scale.data_ptr(),
            keys.data_ptr(),
            None if floors is None else floors.data_ptr(),
            out.data_ptr(),
            rows,
            n,
            logits.dtype == torch.bfloat16,
            torch.get_num_threads(),
        )
        _check_status(status, "race_rows")
        return out

    def filter_floors(
        self,
        logits: torch.Tensor,
        scale: torch.Tensor,
        top_k: torch.Tensor,
        top_p: torch.Tensor,
        min_p: torch.Tensor,
    ) -> torch.Tensor:
        """Same contract as ``reference.filter_floors``, without a sort (a floor differs only
        where a mass ties top_p to float32 rounding: the sums' order differs)."""
        if not _sampling_takes(logits, scale, top_k, top_p, min_p):
            return reference.filter_floors(logits, scale, top_k, top_p, min_p)
        rows, n = logits.shape
        args = [
            scale.to(torch.float32).contiguous(),
            top_k.to(torch.int64).contiguous(),
            top_p.to(torch.float32).contiguous(),
            min_p.to(torch.float32).contiguous(),
        ]
        out = torch.empty(rows, dtype=torch.float32)
        status = self._floors(
            logits.data_ptr(),
            *(a.data_ptr() for a in args),
            out.data_ptr(),
            rows,
            n,
            logits.dtype == torch.bfloat16,
            torch.get_num_threads(),
        )
        _check_status(status, "filter_floors")
        return out

    def quantize_rows_int8(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Same contract (and bits) as ``reference.quantize_rows_int8``."""
        if x.dim() != 2 or not _glue_takes(x):
            return reference.quantize_rows_int8(x)
        rows, size = x.shape
        q = torch.empty(rows, size, dtype=torch.int8)
        scales = torch.empty(rows, dtype=torch.float32)
        status = self._quantize(
            x.data_ptr(),
            q.data_ptr(),
            scales.data_ptr(),
            rows,
            size,
            x.dtype == torch.bfloat16,
            torch.get_num_threads(),
        )
        _check_status(status, "quantize_rows_int8")
        return q, scales

    def int8_small_batch(
        self,
        weight: torch.Tensor,
        weight_sums: torch.Tensor,
        weight_scale: torch.Tensor,
        bias: torch.Tensor | None,
    ) -> Int8SmallBatch | None:
        """``Int8Linear``'s GEMM for 1-4 rows of x in one call, its int8 weights read in place
        with VNNI dot products: bit-identical to quantize, ``torch._int_mm``, dequantize. Returns
        a function of ``x`` ``[rows, in]`` (float32 or bfloat16, contiguous) that gives ``y`` or
        None for inputs it does not take (more rows, other dtypes or layouts). The weights are
        checked, and their addresses taken, once here: at one row the call's Python costs as
        much as the GEMM. None where the weights do not suit it (``in`` not a multiple of 64) or
        the CPU has no AVX512-VNNI. ``weight`` ``[out, in]`` int8, ``weight_sums`` its row sums
        (int32), ``weight_scale`` and ``bias`` float32 ``[out]``."""
        out_features, in_features = weight.shape
        vectors = (weight_scale,) if bias is None else (weight_scale, bias)
        if (
            not self.int8_vnni
            or in_features % 64
            or weight.dtype != torch.int8
            or not weight.is_contiguous()
            or weight_sums.dtype != torch.int32
            or weight_sums.shape != (out_features,)
            or any(v.dtype != torch.float32 or v.shape != (out_features,) for v in vectors)
            or not all(v.is_contiguous() for v in (weight_sums, *vectors))
        ):
            return None
        return Int8SmallBatch(self._linear_int8, weight, weight_sums, weight_scale, bias)

    def dequantize_int32(
        self,
        products: torch.Tensor,
        row_scales: torch.Tensor,
        col_scales: torch.Tensor,
        bias: torch.Tensor | None,
        dtype: torch.dtype,
    ) -> torch.Tensor:
        """Same contract (and bits) as ``reference.dequantize_int32``."""
        float_args = (row_scales, col_scales) if bias is None else (row_scales, col_scales, bias)
        if (
            products.dim() != 2
            or products.dtype != torch.int32
            or not products.is_contiguous()
            or products.shape[1] % LANES
            or dtype not in CACHE_DTYPES
            or any(t.dtype != torch.float32 or not t.is_contiguous() for t in float_args)
            or row_scales.shape != products.shape[:1]
            or col_scales.shape != products.shape[1:]
            or (bias is not None and bias.shape != products.shape[1:])
        ):
            return reference.dequantize_int32(products, row_scales, col_scales, bias, dtype)
        rows, cols = products.shape
        out = torch.empty(rows, cols, dtype=dtype)
        status = self._dequantize(
            products.data_ptr(),
            row_scales.data_ptr(),
            col_scales.data_ptr(),
            None if bias is None else bias.data_ptr(),
            out.data_ptr(),
            rows,
            cols,
            dtype == torch.bfloat16,
            torch.get_num_threads(),
        )
        _check_status(status, "dequantize_int32")
        return out


class Int8SmallBatch:
    """``CpuKernels.linear_int8`` bound to one layer's weights: their addresses are taken once
    (the tensors are kept alive here), so a call checks and converts only ``x``."""

    def __init__(
        self,
        kernel: Any,
        weight: torch.Tensor,
        weight_sums: torch.Tensor,
        weight_scale: torch.Tensor,
        bias: torch.Tensor | None,
    ) -> None:
        self.kernel = kernel
        self.out_features, self.in_features = weight.shape
        self.kept = (weight, weight_sums, weight_scale, bias)
        self.addresses = [None if t is None else t.data_ptr() for t in self.kept]

    def __call__(self, x: torch.Tensor) -> torch.Tensor | None:
        rows = x.shape[0]
        if not 1 <= rows <= INT8_MAX_ROWS or x.dtype not in CACHE_DTYPES:
            return None
        if x.shape[1] != self.in_features or not x.is_contiguous():
            return None
        out = torch.empty(rows, self.out_features, dtype=x.dtype)
        status = self.kernel(
            x.data_ptr(),
            *self.addresses,
            out.data_ptr(),
            rows,
            self.in_features,
            self.out_features,
            x.dtype == torch.bfloat16,
            torch.get_num_threads(),
        )
        _check_status(status, "linear_int8")
        return out


def _sampling_takes(logits: torch.Tensor, *per_row: torch.Tensor | None) -> bool:
    """Whether the compiled sampling kernels take these: contiguous float32 or bfloat16 rows on
    the CPU, fewer than 2^32 columns, a value per row in each of ``per_row`` (None: absent)."""
    if logits.dim() != 2:
        return False
    rows, n = logits.shape
    return (
        0 < n < 2**32
        and logits.dtype in CACHE_DTYPES
        and logits.is_cpu
        and logits.is_contiguous()
        and all(t is None or t.shape == (rows,) for t in per_row)
    )


def _bias_fits(bias: torch.Tensor | None, out_features: int) -> bool:
    """Whether a linear kernel reads ``bias`` as it is: none, or float32 ``[out]`` contiguous
    on the CPU."""
    if bias is None:
        return True
    return (
        bias.dtype == torch.float32
        and bias.shape == (out_features,)
        and bias.is_cpu
        and bias.is_contiguous()
    )


def _glue_takes(*tensors: torch.Tensor | None, contiguous: int = 99) -> bool:
    """Whether the compiled layer glue takes these tensors (None: absent): CPU, one dtype
    (float32 or bfloat16), the first one's last dimension a multiple of 16; contiguous, the
    first ``contiguous`` of them (a KV cache is a strided view of the engine's cache). Plain
    loops: at one token this check is a good part of the call's cost."""
    dtype = tensors[0].dtype  # type: ignore[union-attr]
    last = tensors[0].shape[-1]  # type: ignore[union-attr]
    if dtype not in CACHE_DTYPES or last == 0 or last % LANES:
        return False
    for index, tensor in enumerate(tensors):
        if tensor is None:
            continue
        if tensor.dtype != dtype or not tensor.is_cpu:
            return False
        if index < contiguous and not tensor.is_contiguous():
            return False
    return True


def _check_status(status: int, name: str) -> None:
    if status != 0:
        raise RuntimeError(f"CPU kernel {name} failed (status {status})")
