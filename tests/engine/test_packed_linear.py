"""oneDNN-packed linear layers (``services.engine.model.packed_linear``) against ``nn.Linear``."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from services.engine.model.packed_linear import (
    PackedLinear,
    can_pack,
    onednn_supports,
    pack_linears,
)

pytestmark = pytest.mark.skipif(
    not torch.backends.mkldnn.is_available(), reason="this torch build has no oneDNN (mkldnn)"
)


@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("rows", [1, 3, 64])
def test_matches_nn_linear_in_float32(bias: bool, rows: int) -> None:
    torch.manual_seed(rows)
    linear = nn.Linear(576, 960, bias=bias)
    packed = PackedLinear(linear)
    x = torch.randn(rows, 576)
    with torch.inference_mode():
        torch.testing.assert_close(packed(x), linear(x), atol=1e-5, rtol=1e-5)


@pytest.mark.skipif(
    not onednn_supports(torch.bfloat16),
    reason="oneDNN's bf16 path needs AVX-512 BW/VL/DQ or AVX-NE-CONVERT, which this CPU lacks",
)
def test_bfloat16_strided_and_batched_inputs() -> None:
    torch.manual_seed(0)
    linear = nn.Linear(64, 32, bias=True).to(torch.bfloat16)
    packed = PackedLinear(linear)
    x = torch.randn(2, 5, 128, dtype=torch.bfloat16)[..., ::2]  # non-contiguous, 3-D
    with torch.inference_mode():
        out = packed(x)
        assert out.shape == (2, 5, 32) and out.dtype == torch.bfloat16
        torch.testing.assert_close(out.float(), linear(x).float(), atol=2e-2, rtol=2e-2)


def test_pack_linears_replaces_every_linear_and_keeps_the_rest() -> None:
    model = nn.Sequential(nn.Embedding(10, 8), nn.Sequential(nn.Linear(8, 8), nn.ReLU()))
    model.append(nn.Linear(8, 4, bias=False))
    assert pack_linears(model) == 2
    assert isinstance(model[0], nn.Embedding)
    assert isinstance(model[1][0], PackedLinear) and isinstance(model[2], PackedLinear)
    assert pack_linears(model) == 0  # nothing left to pack


def test_only_cpu_float32_and_bfloat16_matrices_are_packable() -> None:
    assert can_pack(torch.zeros(4, 4))
    assert can_pack(torch.zeros(4, 4, dtype=torch.bfloat16)) == onednn_supports(torch.bfloat16)
    assert not can_pack(torch.zeros(4, 4, dtype=torch.float16))
    assert can_pack(torch.zeros(4, 4, dtype=torch.float16), torch.float32)  # widened
    assert not can_pack(torch.zeros(4))


def test_bfloat16_falls_back_to_plain_linear_where_onednn_cannot_run_it(monkeypatch) -> None:
    """A CPU without oneDNN's bf16 instructions keeps nn.Linear (CI once ran on such a VM) when
    told to compute natively; by default (``auto``) its weights are widened to float32."""
    import services.engine.model.packed_linear as packed_linear

    monkeypatch.setattr(packed_linear, "onednn_supports", lambda dtype: dtype == torch.float32)
    monkeypatch.setattr(packed_linear, "native_matmul", lambda dtype: dtype == torch.float32)
    model = nn.Sequential(nn.Linear(8, 8)).to(torch.bfloat16)
    assert pack_linears(model, "native") == 0 and isinstance(model[0], nn.Linear)
    assert pack_linears(model, "auto") == 1 and model[0].compute_dtype == torch.float32
