"""All decoder layers of a small bfloat16 decode step in one compiled call
(``kernels/csrc/decode_layers_cpu.c``).

At one sequence a layer is nine kernel calls (two norms, four small-batch GEMVs, rotary with the
KV write, attention, SiLU-and-multiply), and on a two-core Zen 4 their dispatch and the pauses
between them in the weight stream cost ~4 ms of a 15 ms step. ``DecodeLayers`` prepares, once,
every layer's weight and cache pointers; each step is then one call, in which the threads wait
for each other only where a result is needed by all of them. What it computes is bit for bit
what the separate kernels compute (``tests/kernels/test_decode_layers.py``).

It takes 1-4 sequences (the widening small-batch GEMV's rows; 1-16 where every linear is read
with dot products, ``LINEAR_DOT_MAX_ROWS``; up to ``PAIRS_MAX_ROWS`` where every linear is in
pair order, ``PairedWeight``), bfloat16 weights, activations and cache, and weights in the
order a compiled GEMM reads (bfloat16 ``[out, in]``, contiguous, a float32 bias or none on qkv
only). Which layers to hand it, and when, is the model's business
(``services.engine.model.fused_decode``).
"""

from __future__ import annotations

import ctypes
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from kernels.cpu_ops import (
    BAD_INDEX,
    LINEAR_ROW_TILES,
    CpuKernels,
    PairedWeight,
    TiledWeight,
)

_ptr, _i32, _i64 = ctypes.c_void_p, ctypes.c_int32, ctypes.c_int64


class _Layer(ctypes.Structure):
    _fields_ = [
        ("input_norm", _ptr),
        ("post_norm", _ptr),
        ("qkv", _ptr),
        ("o", _ptr),
        ("gate_up", _ptr),
        ("down", _ptr),
        ("qkv_bias", _ptr),
        ("key_cache", _ptr),
        ("value_cache", _ptr),
        ("qkv_tile", _i32),
        ("o_tile", _i32),
        ("gate_up_tile", _i32),
        ("down_tile", _i32),
    ]


class _Shape(ctypes.Structure):
    _fields_ = [
        ("hidden", _i32),
        ("intermediate", _i32),
        ("num_heads", _i32),
        ("num_kv_heads", _i32),
        ("head_dim", _i32),
        ("eps", ctypes.c_float),
        ("scale", ctypes.c_float),
        ("block_stride", _i64),
        ("token_stride", _i64),
        ("head_stride", _i64),
        ("block_size", _i64),
        ("num_blocks", _i64),
    ]


class _Step(ctypes.Structure):
    _fields_ = [
        ("rows", _i32),
        ("cos", _ptr),
        ("sin", _ptr),
        ("slots", _ptr),
        ("block_tables", _ptr),
        ("max_blocks", _i64),
        ("context_lens", _ptr),
        ("max_context_len", _i32),
    ]


@dataclass(frozen=True)
class LayerWeights:
    """One decoder layer as the compiled call reads it: the linears' weights in the order a
    compiled GEMM reads (``TiledWeight``, each with its own row tile: the same result; or
    ``PairedWeight``)."""

    input_norm: torch.Tensor  # [hidden]
    post_norm: torch.Tensor  # [hidden]
    qkv: TiledWeight | PairedWeight  # [(heads + 2 kv_heads) * head_dim, hidden]
    qkv_bias: torch.Tensor | None  # float32, or None
    o: TiledWeight | PairedWeight  # [hidden, heads * head_dim]
    gate_up: TiledWeight | PairedWeight  # [2 intermediate, hidden]: gate rows, then up rows
    down: TiledWeight | PairedWeight  # [hidden, intermediate]
    key_cache: torch.Tensor  # [num_blocks, block_size, kv_heads, head_dim], any strides
    value_cache: torch.Tensor  # same shape and strides


@dataclass(frozen=True)
class ModelShape:
    hidden: int
    intermediate: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    eps: float  # the RMSNorms'
    scale: float  # attention's


class DecodeLayers:
    """``layers`` prepared for one call per step; raises ValueError for weights or caches the
    compiled call does not take. Holds the tensors: their memory must not move."""

    def __init__(self, kernels: CpuKernels, shape: ModelShape, layers: Sequence[LayerWeights]):
        if not layers:
            raise ValueError("no layers")
        self._shape_check(shape, layers)
        linears = [linear for w in layers for linear in (w.qkv, w.o, w.gate_up, w.down)]
        dots = [isinstance(x, PairedWeight) or x.dot for x in linears]
        if any(dots) and not kernels.bf16_dot:
            raise ValueError("dot-product weights on a kernel built without AVX-512 BF16")
        # The rows a step may have: the fewest any linear's kernel takes.
        self.max_rows = min(linear.max_rows for linear in linears)
        self.layers = tuple(layers)  # keeps every pointer below alive
        self._fn = kernels.lib.decode_layers_bf16
        self._fn.argtypes = [_ptr, _i32, _ptr, _ptr, _ptr, _ptr, _i32, _i32]
        self._fn.restype = ctypes.c_int
        self._layers = (_Layer * len(layers))(*(self._layer(w) for w in layers))
        cache = layers[0].key_cache
        self.num_blocks, self.block_size = cache.shape[0], cache.shape[1]
        self._shape = _Shape(
            shape.hidden,
            shape.intermediate,
            shape.num_heads,
            shape.num_kv_heads,
            shape.head_dim,
            shape.eps,
            shape.scale,
            *cache.stride()[:3],
            self.block_size,
            self.num_blocks,
        )
        self.hidden = shape.hidden

    @staticmethod
    def _shape_check(shape: ModelShape, layers: Sequence[LayerWeights]) -> None:
        q_size, dim = shape.num_heads * shape.head_dim, shape.head_dim
        qkv_size = q_size + 2 * shape.num_kv_heads * dim
        sizes = {
            "qkv": (qkv_size, shape.hidden),
            "o": (shape.hidden, q_size),
            "gate_up": (2 * shape.intermediate, shape.hidden),
            "down": (shape.hidden, shape.intermediate),
            "input_norm": (shape.hidden,),
            "post_norm": (shape.hidden,),
        }
        strides = layers[0].key_cache.stride()
        cache_shape = layers[0].key_cache.shape
        for index, layer in enumerate(layers):
            for name, size in sizes.items():
                field = getattr(layer, name)
                tensor = field.data if isinstance(field, (TiledWeight, PairedWeight)) else field
                if isinstance(field, TiledWeight) and field.row_tile not in LINEAR_ROW_TILES:
                    raise ValueError(f"layer {index}: {name} has row tile {field.row_tile}")
                if (
                    tensor.shape != size
                    or tensor.dtype != torch.bfloat16
                    or not tensor.is_cpu
                    or not tensor.is_contiguous()
                ):
                    raise ValueError(f"layer {index}: {name} is not a bfloat16 {size} CPU matrix")
            bias = layer.qkv_bias
            if bias is not None and (
                bias.shape != (qkv_size,) or bias.dtype != torch.float32 or not bias.is_contiguous()
            ):
                raise ValueError(f"layer {index}: qkv_bias is not float32 [{qkv_size}]")
            for cache in (layer.key_cache, layer.value_cache):
                if (
                    cache.dtype != torch.bfloat16
                    or cache.shape != cache_shape
                    or cache.shape[2:] != (shape.num_kv_heads, dim)
                    or cache.stride() != strides
                    or cache.stride(3) != 1
                ):
                    raise ValueError(f"layer {index}: a KV cache of another shape or layout")

    @staticmethod
    def _layer(w: LayerWeights) -> _Layer:
        bias = None if w.qkv_bias is None else w.qkv_bias.data_ptr()
        linears = (w.qkv, w.o, w.gate_up, w.down)
        return _Layer(
            w.input_norm.data_ptr(),
            w.post_norm.data_ptr(),
            *(linear.data.data_ptr() for linear in linears),
            bias,
            w.key_cache.data_ptr(),
            w.value_cache.data_ptr(),
            *(linear.kernel_tile for linear in linears),
        )

    def run(
        self,
        x: torch.Tensor,
        delta: torch.Tensor | None,
        rotary: tuple[torch.Tensor, torch.Tensor],
        slot_mapping: torch.Tensor,
        block_tables: torch.Tensor,
        context_lens: torch.Tensor,
        max_context_len: int,
    ) -> torch.Tensor | None:
        """Every layer over ``x`` ``[rows, hidden]`` (the residual stream, updated in place)
        after adding ``delta`` (the previous layer's MLP output, or None); returns the last
        layer's MLP output, not yet added to ``x``. None where it does not take the inputs
        (rows outside 1-``max_rows``, not bfloat16 contiguous CPU tensors of these sizes)."""
        rows = x.shape[0]
        cos, sin = rotary
        if (
            not 1 <= rows <= self.max_rows
            or x.shape != (rows, self.hidden)
            or x.dtype != torch.bfloat16
            or not x.is_contiguous()
            or (delta is not None and (delta.shape != x.shape or not delta.is_contiguous()))
            or (delta is not None and delta.dtype != torch.bfloat16)
            or cos.dtype != torch.bfloat16
            or sin.dtype != torch.bfloat16
            or cos.shape != sin.shape
            or cos.numel() != rows * self._shape.head_dim
            or not (cos.is_contiguous() and sin.is_contiguous())
            or slot_mapping.dtype != torch.int64
            or block_tables.dtype != torch.int32
            or context_lens.dtype != torch.int32
            or len(block_tables) != rows
            or context_lens.shape != (rows,)
            or slot_mapping.shape != (rows,)
        ):
            return None
        # Held in locals until the call returns: the struct keeps only their addresses.
        tables, slots = block_tables.contiguous(), slot_mapping.contiguous()
        lens = context_lens.contiguous()
        out = torch.empty_like(x) if delta is None else delta
        step = _Step(
            rows,
            cos.data_ptr(),
            sin.data_ptr(),
            slots.data_ptr(),
            tables.data_ptr(),
            tables.shape[1],
            lens.data_ptr(),
            max_context_len,
        )
        status = self._fn(
            self._layers,
            len(self.layers),
            ctypes.byref(self._shape),
            ctypes.byref(step),
            x.data_ptr(),
            out.data_ptr(),
            delta is not None,
            torch.get_num_threads(),
        )
        if status == BAD_INDEX:
            raise ValueError(
                "a slot or block table outside the cache, or tables shorter than the context"
            )
        if status != 0:
            raise RuntimeError(f"CPU kernel decode_layers_bf16 failed (status {status})")
        return out
