"""int8 weights and activations (W8A8) for the decoder layers' linears: ``--quantization int8``.

- **Weights**: per output channel, symmetric, quantized once at load: row ``j`` of the ``[out,
  in]`` weight becomes ``q_j * s_j`` with ``s_j = max|w_j| / 127``. Half the bytes of bfloat16,
  a quarter of float32: the weight read that bounds a decode step at small batches shrinks with it.
- **Activations**: per token, at every call (dynamic): each row of ``x`` gets its own scale the
  same way, so one outlier token does not flatten the others' resolution.
- **The GEMM**: ``torch._int_mm`` (oneDNN: int8 dot products accumulated in int32, VNNI's
  ``VPDPBUSD`` where the CPU has it), between the two compiled passes of
  ``kernels/csrc/int8_cpu.c`` (or their PyTorch reference): quantize the rows before it, apply
  both scales and the bias in one pass after it. ``y = (x_q @ w_q.T) * s_x * s_w + b``. At 1-4
  rows (a decode step of a few sequences) one compiled call does all three, reading the int8
  weights in place with VNNI (``CpuKernels.int8_small_batch``): same bits, a third of the calls.

The LM head and the embedding stay in ``--dtype``: the logits' precision decides greedy ties,
and the head's weight is the embedding's on tied models. How far the outputs move from bfloat16
is measured, not assumed: ``benchmarks/int8_quality.py``, docs/benchmarks.md.
"""

from __future__ import annotations

from typing import Protocol, runtime_checkable

import torch
from torch import nn

from kernels import reference

SMALL_BATCH_MAX_ROWS = 4  # kernels.cpu_ops.INT8_MAX_ROWS (the compiled kernel's own check)


@runtime_checkable
class Int8Ops(Protocol):
    """The two passes around the GEMM, with ``kernels.reference``'s contracts (that module, or
    the compiled ``kernels.cpu_ops.CpuKernels``)."""

    def quantize_rows_int8(self, x: torch.Tensor, /) -> tuple[torch.Tensor, torch.Tensor]: ...

    def dequantize_int32(
        self,
        products: torch.Tensor,
        row_scales: torch.Tensor,
        col_scales: torch.Tensor,
        bias: torch.Tensor | None,
        dtype: torch.dtype,
        /,
    ) -> torch.Tensor: ...


class Int8Linear(nn.Module):
    """``y = x @ W.T + b`` (inference only) with ``W`` in int8 per output channel and ``x``
    quantized per row at each call; the output has the input's dtype."""

    def __init__(self, linear: nn.Linear, ops: Int8Ops = reference):
        super().__init__()
        self.in_features, self.out_features = linear.in_features, linear.out_features
        self.ops = ops
        with torch.no_grad():
            weight, scale = reference.quantize_rows_int8(linear.weight.detach())
            bias = None if linear.bias is None else linear.bias.detach().float()
        self.weight: torch.Tensor  # [out, in] int8: read as [in, out] by the GEMM
        self.weight_scale: torch.Tensor  # [out] float32
        self.bias: torch.Tensor | None  # [out] float32
        self.weight_sums: torch.Tensor  # [out] int32: the small-batch kernel's offset term
        self.register_buffer("weight", weight)
        self.register_buffer("weight_sums", weight.sum(dim=1, dtype=torch.int32))
        self.register_buffer("weight_scale", scale)
        self.register_buffer("bias", bias)
        # 1-4 rows in one call where the ops have it (the compiled kernel, on VNNI CPUs).
        bind = getattr(ops, "int8_small_batch", None)
        self.small_batch = bind and bind(weight, self.weight_sums, scale, bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.small_batch is not None and x.dim() == 2 and len(x) <= SMALL_BATCH_MAX_ROWS:
            y = self.small_batch(x)  # the decode step's own [rows, in]: nothing to reshape
            if y is not None:
                return y
        shape, dtype = x.shape, x.dtype
        rows = x.reshape(-1, self.in_features)
        if not rows.is_contiguous():
            rows = rows.contiguous()
        q, row_scales = self.ops.quantize_rows_int8(rows)
        products = torch._int_mm(q, self.weight.t())
        y = self.ops.dequantize_int32(products, row_scales, self.weight_scale, self.bias, dtype)
        return y.view(*shape[:-1], self.out_features)

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, int8 W8A8"


def quantize_linears(module: nn.Module, ops: Int8Ops = reference) -> int:
    """Replace every ``nn.Linear`` under ``module`` by an ``Int8Linear``; returns how many."""
    count = 0
    for name, child in list(module.named_children()):
        if isinstance(child, nn.Linear):
            setattr(module, name, Int8Linear(child, ops))
            count += 1
        else:
            count += quantize_linears(child, ops)
    return count
