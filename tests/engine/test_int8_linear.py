"""``--quantization int8``: the W8A8 linear layer, the loader that puts it in the decoder layers,
and the setting at the edge. How far its outputs move from bfloat16 is a measurement
(benchmarks/int8_quality.py), not a test; here: what it computes and where it is used."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from kernels import reference
from services.engine.config import EngineConfig
from services.engine.model.int8_linear import Int8Linear, quantize_linears


def exact_w8a8(x: torch.Tensor, linear: nn.Linear) -> torch.Tensor:
    """What W8A8 computes, in float64 from the quantized integers: the layer must equal it up
    to float32 rounding (the int32 products are exact)."""
    wq, ws = reference.quantize_rows_int8(linear.weight.detach())
    xq, xs = reference.quantize_rows_int8(x)
    out = (xq.double() @ wq.double().T) * xs.double()[:, None] * ws.double()
    return out + (0 if linear.bias is None else linear.bias.detach().double())


@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("rows", [1, 5, 64])
def test_computes_w8a8_exactly_and_stays_near_the_float_layer(bias: bool, rows: int) -> None:
    torch.manual_seed(rows)
    linear = nn.Linear(576, 960, bias=bias)
    layer = Int8Linear(linear)
    x = torch.randn(rows, 576)
    with torch.inference_mode():
        y, full = layer(x), linear(x)
    assert y.dtype == torch.float32 and y.shape == (rows, 960)
    torch.testing.assert_close(y.double(), exact_w8a8(x, linear), rtol=1e-5, atol=1e-5)
    # 8 bits each side: about 1% of the output's scale, far from a wrong layer's ~100%.
    relative = (y - full).norm() / full.norm()
    assert relative < 0.02, relative


def test_weights_are_int8_per_output_channel_and_a_quarter_of_float32() -> None:
    linear = nn.Linear(128, 64, bias=False)
    with torch.no_grad():
        linear.weight[3] *= 100  # one loud output channel keeps its own scale
    layer = Int8Linear(linear)
    assert layer.weight.dtype == torch.int8 and layer.weight.shape == (64, 128)
    assert layer.weight_scale.shape == (64,)
    assert layer.weight_scale[3] > 50 * layer.weight_scale[4]
    assert layer.weight.abs().amax(dim=1).eq(127).all()
    assert layer.weight.nbytes * 4 == linear.weight.nbytes


def test_quantize_linears_replaces_every_linear_below_the_module() -> None:
    model = nn.Sequential(nn.Linear(16, 16), nn.Sequential(nn.ReLU(), nn.Linear(16, 32)))
    assert quantize_linears(model) == 2
    assert isinstance(model[0], Int8Linear) and isinstance(model[1][1], Int8Linear)


def test_the_engine_quantizes_the_decoder_layers_keeps_the_head_and_still_answers() -> None:
    """The default model in int8: every decoder linear is int8, the LM head is not, and greedy
    decoding still completes a fact the float model knows (wrong scales or a transposed weight
    give noise), with every KV block back in the pool."""
    from pdserve import LLM, SamplingParams
    from tests.conftest import assert_no_leaks

    llm = LLM(dtype="bfloat16", quantization="int8", num_blocks=64, num_threads=2)
    model = llm.engine.model
    for layer in model.layers:
        for linear in (layer.self_attn.qkv_proj, layer.self_attn.o_proj):
            assert isinstance(linear, Int8Linear)
        for linear in (layer.mlp.gate_up_proj, layer.mlp.down_proj):
            assert isinstance(linear, Int8Linear)
    assert not isinstance(model.lm_head, Int8Linear)
    [out] = llm.generate(["The capital of France is"], SamplingParams(temperature=0, max_tokens=3))
    assert out.outputs[0].text.startswith(" Paris")
    assert_no_leaks(llm.engine)


def test_an_unknown_quantization_or_a_gpu_is_refused_with_the_reason() -> None:
    with pytest.raises(ValueError, match=r"quantization must be one of \('none', 'int8'\)"):
        EngineConfig(quantization="fp8")
    with pytest.raises(ValueError, match="--quantization int8 runs on the CPU only, not on 'cuda'"):
        EngineConfig(quantization="int8", device="cuda")
