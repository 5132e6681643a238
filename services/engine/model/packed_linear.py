"""Linear layers with weights pre-packed for oneDNN: the CPU fast path for the model's GEMMs.

``F.linear`` on CPU calls MKL's sgemm on the plain ``[out, in]`` weight. For the skinny GEMMs
of decoding (a handful to a few dozen rows) that repacks the weight on every call, and on AMD
CPUs MKL does not take its AVX-512 kernels. oneDNN reorders the weight once, into the blocked
layout its kernels read, and dispatches on the CPU's features: on the 2-core AMD EPYC VM the
model's four per-layer GEMMs run 2-4x faster (``docs/benchmarks.md``). Results differ from
``F.linear`` only by float rounding (the summation order differs).
"""

from __future__ import annotations

import functools

import torch
from torch import nn

_PACKABLE_DTYPES = (torch.float32, torch.bfloat16)


def can_pack(weight: torch.Tensor) -> bool:
    """Whether ``weight`` can take the oneDNN path (a CPU float32/bfloat16 matrix)."""
    return (
        weight.device.type == "cpu"
        and weight.dtype in _PACKABLE_DTYPES
        and weight.dim() == 2
        and onednn_supports(weight.dtype)
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
    """``y = x @ W.T + b`` with ``W`` held in oneDNN's blocked layout (inference only)."""

    def __init__(self, linear: nn.Linear):
        super().__init__()
        self.in_features, self.out_features = linear.in_features, linear.out_features
        with torch.no_grad():
            weight = linear.weight.detach().contiguous()
            self.packed_weight = torch.ops.mkldnn._reorder_linear_weight(weight, None)
            self.bias = None if linear.bias is None else linear.bias.detach().clone()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        shape = x.shape
        x = x.reshape(-1, self.in_features)
        if not x.is_contiguous():
            x = x.contiguous()
        y = torch.ops.mkldnn._linear_pointwise(x, self.packed_weight, self.bias, "none", [], "")
        return y.view(*shape[:-1], self.out_features)

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, packed=onednn"


def pack_linears(module: nn.Module) -> int:
    """Replace every packable ``nn.Linear`` under ``module`` by a ``PackedLinear``; returns the
    number replaced. A tied weight (the LM head sharing the embedding) gets its own packed copy;
    the embedding keeps the plain one."""
    count = 0
    for name, child in list(module.named_children()):
        if isinstance(child, nn.Linear) and can_pack(child.weight):
            setattr(module, name, PackedLinear(child))
            count += 1
        else:
            count += pack_linears(child)
    return count
