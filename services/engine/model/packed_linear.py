"""Linear layers with weights pre-packed for oneDNN: the CPU fast path for the model's GEMMs.

``F.linear`` on CPU calls MKL's sgemm on the plain ``[out, in]`` weight. For the skinny GEMMs
of decoding (a handful to a few dozen rows) that repacks the weight on every call, and on AMD
CPUs MKL does not take its AVX-512 kernels. oneDNN reorders the weight once, into the blocked
layout its kernels read, and dispatches on the CPU's features: on the 2-core AMD EPYC VM the
model's four per-layer GEMMs run 2-4x faster (``docs/benchmarks.md``). Results differ from
``F.linear`` only by float rounding (the summation order differs).

Half-precision weights on a CPU without native dot products for them (bfloat16 needs AVX512-BF16
or AMX; float16 AMX-FP16) would run oneDNN's emulation, about 3.5x slower than float32 at a
decode batch of 64 on an AVX-512 Xeon VM (``docs/benchmarks.md``). There the weights are widened
to float32 once, at packing: every GEMM then multiplies the same bf16 values in float32 and
rounds its output back to the activations' dtype, which is what oneDNN's bf16 kernels compute
(float32 accumulation) at twice the weight memory. ``matmul_dtype`` makes that choice.

A decode step of a few sequences is bound by the weight read, not by the multiplications: there
a ``SmallBatchLinear`` (the compiled ``kernels.cpu_ops.CpuKernels.linear_bf16``) reads the
bfloat16 weights in place, whatever the GEMMs compute in. Against widened weights it reads half
the bytes; against oneDNN's bfloat16 GEMM it saves the per-call overhead that dominates at one
row of these small matrices (single-stream decode 40 -> 59 tok/s on the Xeon VM with
``--cpu-matmul native``). The model then holds the plain bfloat16 weights beside the packed ones.
"""

from __future__ import annotations

import functools
from collections.abc import Callable

import torch
from torch import nn

# (x [rows, in], weight [out, in], float32 bias or None) -> y [rows, out], or None where the
# kernel does not take these inputs (then the packed GEMM runs).
SmallBatchLinear = Callable[[torch.Tensor, torch.Tensor, torch.Tensor | None], torch.Tensor | None]

_PACKABLE_DTYPES = (torch.float32, torch.bfloat16)
MATMUL_MODES = ("auto", "native", "float32")


def native_matmul(dtype: torch.dtype) -> bool:
    """Whether this CPU has dot-product instructions for ``dtype`` (float32: always)."""
    if dtype == torch.bfloat16:
        return torch.cpu._is_avx512_bf16_supported() or torch.cpu._is_amx_tile_supported()
    if dtype == torch.float16:
        return torch.cpu._is_amx_fp16_supported()
    return True


def matmul_dtype(weight_dtype: torch.dtype, mode: str = "auto") -> torch.dtype:
    """The dtype the GEMMs of ``weight_dtype`` weights compute in: the weights' own (``native``),
    float32 (``float32``: weights widened once), or ``auto``: native where ``native_matmul``."""
    if mode not in MATMUL_MODES:
        raise ValueError(f"matmul mode must be one of {MATMUL_MODES}, got {mode!r}")
    if mode == "native" or (mode == "auto" and native_matmul(weight_dtype)):
        return weight_dtype
    return torch.float32


def can_pack(weight: torch.Tensor, compute_dtype: torch.dtype | None = None) -> bool:
    """Whether ``weight`` can take the oneDNN path computing in ``compute_dtype`` (None: the
    weight's own): a CPU matrix, computed in float32 or bfloat16."""
    compute_dtype = compute_dtype or weight.dtype
    return (
        weight.device.type == "cpu"
        and weight.is_floating_point()
        and compute_dtype in _PACKABLE_DTYPES
        and weight.dim() == 2
        and onednn_supports(compute_dtype)
    )


@functools.cache
def onednn_supports(dtype: torch.dtype) -> bool:
    """Whether this torch build and CPU run oneDNN's packed linear in ``dtype``. Asked once per
    dtype by packing a tiny matrix: oneDNN's bf16 path needs AVX-512 BW/VL/DQ (or AVX-NE-CONVERT),
    which some VMs hide from the guest; those fall back to ``F.linear``."""
    mkldnn = torch.ops.mkldnn
    if not torch.backends.mkldnn.is_available() or not hasattr(mkldnn, "_linear_pointwise"):
        return False
    try:
        packed = torch.ops.mkldnn._reorder_linear_weight(torch.zeros(16, 16, dtype=dtype), None)
        x = torch.zeros(1, 16, dtype=dtype)
        torch.ops.mkldnn._linear_pointwise(x, packed, None, "none", [], "")
    except RuntimeError:
        return False
    return True


class PackedLinear(nn.Module):
    """``y = x @ W.T + b`` with ``W`` held in oneDNN's blocked layout (inference only), computed
    in ``compute_dtype`` (None: the weight's dtype); the output has the input's dtype.

    ``small_batch``: for bfloat16 weights, a kernel that reads them in place for inputs of a
    few rows (see the module's docstring); the plain weight tensor is then kept beside the
    packed one."""

    def __init__(
        self,
        linear: nn.Linear,
        compute_dtype: torch.dtype | None = None,
        small_batch: SmallBatchLinear | None = None,
    ):
        super().__init__()
        self.in_features, self.out_features = linear.in_features, linear.out_features
        self.compute_dtype = compute_dtype or linear.weight.dtype
        # The compiled kernel reads bfloat16 weights only; others keep the packed GEMM.
        self.small_batch = small_batch if linear.weight.dtype == torch.bfloat16 else None
        with torch.no_grad():
            weight = linear.weight.detach().to(self.compute_dtype).contiguous()
            self.packed_weight = torch.ops.mkldnn._reorder_linear_weight(weight, None)
            bias = linear.bias
            self.bias = None if bias is None else bias.detach().to(self.compute_dtype).clone()
            # The kernel reads the plain weight (oneDNN's packed one is opaque) and adds a float32
            # bias. A tied weight (the LM head's) stays shared with the embedding: no extra memory.
            self.weight = linear.weight.detach().contiguous() if self.small_batch else None
            self.small_batch_bias = (
                None if bias is None or self.small_batch is None else bias.detach().float()
            )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        shape, dtype = x.shape, x.dtype
        x = x.reshape(-1, self.in_features)
        if self.small_batch is not None and self.weight is not None:
            y = self.small_batch(x, self.weight, self.small_batch_bias)
            if y is not None:
                return y.view(*shape[:-1], self.out_features)
        if dtype != self.compute_dtype:
            x = x.to(self.compute_dtype)  # a copy, so contiguous
        elif not x.is_contiguous():
            x = x.contiguous()
        y = torch.ops.mkldnn._linear_pointwise(x, self.packed_weight, self.bias, "none", [], "")
        return y.to(dtype).view(*shape[:-1], self.out_features)

    def extra_repr(self) -> str:
        return (
            f"in_features={self.in_features}, out_features={self.out_features}, packed=onednn, "
            f"compute_dtype={self.compute_dtype}, small_batch={self.small_batch is not None}"
        )


def pack_linears(
    module: nn.Module, mode: str = "auto", small_batch: SmallBatchLinear | None = None
) -> int:
    """Replace every packable ``nn.Linear`` under ``module`` by a ``PackedLinear`` computing in
    ``matmul_dtype(weight dtype, mode)`` (with ``small_batch`` where its weights are bfloat16);
    returns the number replaced. A tied weight (the LM head sharing the embedding) gets its own
    packed copy; the embedding keeps the plain one."""
    count = 0
    for name, child in list(module.named_children()):
        if isinstance(child, nn.Linear):
            compute = matmul_dtype(child.weight.dtype, mode)
            if can_pack(child.weight, compute):
                setattr(module, name, PackedLinear(child, compute, small_batch))
                count += 1
        else:
            count += pack_linears(child, mode, small_batch)
    return count
