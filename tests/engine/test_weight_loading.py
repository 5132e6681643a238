"""``LlamaModel.load_hf_state_dict``: the parameters hold the checkpoint's values (q/k/v and
gate/up fused, other dtypes converted), a tied LM head stays the embedding, and a bad checkpoint
gets a clear error naming the weight."""

from __future__ import annotations

import pytest
import torch

from services.engine.config import ModelConfig
from services.engine.model.llama import LlamaModel
from services.engine.model.loader import materialize
from tests.conftest import tiny_model_config


def tiny_config(tied: bool = True) -> ModelConfig:
    return tiny_model_config(
        hidden_size=32,
        intermediate_size=48,
        head_dim=8,
        rms_norm_eps=1e-5,
        tie_word_embeddings=tied,
    )


def hf_checkpoint(cfg: ModelConfig, dtype: torch.dtype = torch.float32) -> dict[str, torch.Tensor]:
    """Random weights under Hugging Face's names, as a converted checkpoint holds them."""
    gen = torch.Generator().manual_seed(0)
    kv = cfg.num_kv_heads * cfg.head_dim

    def rand(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=gen).to(dtype)

    weights = {
        "model.embed_tokens.weight": rand(cfg.vocab_size, cfg.hidden_size),
        "model.norm.weight": rand(cfg.hidden_size),
    }
    if not cfg.tie_word_embeddings:
        weights["lm_head.weight"] = rand(cfg.vocab_size, cfg.hidden_size)
    for i in range(cfg.num_layers):
        p = f"model.layers.{i}."
        weights |= {
            p + "self_attn.q_proj.weight": rand(cfg.num_heads * cfg.head_dim, cfg.hidden_size),
            p + "self_attn.k_proj.weight": rand(kv, cfg.hidden_size),
            p + "self_attn.v_proj.weight": rand(kv, cfg.hidden_size),
            p + "self_attn.o_proj.weight": rand(cfg.hidden_size, cfg.num_heads * cfg.head_dim),
            p + "mlp.gate_proj.weight": rand(cfg.intermediate_size, cfg.hidden_size),
            p + "mlp.up_proj.weight": rand(cfg.intermediate_size, cfg.hidden_size),
            p + "mlp.down_proj.weight": rand(cfg.hidden_size, cfg.intermediate_size),
            p + "input_layernorm.weight": rand(cfg.hidden_size),
            p + "post_attention_layernorm.weight": rand(cfg.hidden_size),
        }
    return weights


def built(cfg: ModelConfig) -> LlamaModel:
    """As the loader builds it: on the meta device, then uninitialized CPU tensors."""
    with torch.device("meta"):
        model = LlamaModel(cfg)
    materialize(model)
    return model


def test_parameters_hold_the_checkpoint_and_a_tied_head_stays_the_embedding() -> None:
    cfg = tiny_config(tied=True)
    weights = hf_checkpoint(cfg)
    model = built(cfg)
    model.load_hf_state_dict(weights)
    assert torch.equal(model.embed_tokens.weight, weights["model.embed_tokens.weight"])
    assert model.lm_head.weight is model.embed_tokens.weight  # one Parameter: still tied
    layer = model.layers[1]
    q, k, v = (weights[f"model.layers.1.self_attn.{n}_proj.weight"] for n in "qkv")
    assert torch.equal(layer.self_attn.qkv_proj.weight, torch.cat([q, k, v]))
    gate, up = (weights[f"model.layers.1.mlp.{n}_proj.weight"] for n in ("gate", "up"))
    assert torch.equal(layer.mlp.gate_up_proj.weight, torch.cat([gate, up]))
    assert all(isinstance(p, torch.nn.Parameter) for p in model.parameters())


def test_an_untied_head_is_its_own_weight_and_other_dtypes_are_converted() -> None:
    cfg = tiny_config(tied=False)
    weights = hf_checkpoint(cfg, dtype=torch.bfloat16)  # the model's parameters are float32
    model = built(cfg)
    model.load_hf_state_dict(weights)
    assert model.lm_head.weight is not model.embed_tokens.weight
    assert model.lm_head.weight.dtype == torch.float32
    assert torch.equal(model.lm_head.weight, weights["lm_head.weight"].float())
    assert torch.equal(model.norm.weight, weights["model.norm.weight"].float())


def test_a_weight_of_the_wrong_shape_or_a_missing_one_is_named() -> None:
    cfg = tiny_config()
    weights = hf_checkpoint(cfg)
    weights["model.norm.weight"] = torch.zeros(cfg.hidden_size + 1)
    with pytest.raises(ValueError, match=r"weight norm.weight: shape \(33,\) does not match"):
        built(cfg).load_hf_state_dict(weights)
    weights = hf_checkpoint(cfg)
    del weights["model.layers.0.mlp.down_proj.weight"]
    with pytest.raises(ValueError, match="model.layers.0.mlp.down_proj.weight is missing"):
        built(cfg).load_hf_state_dict(weights)
