"""Llama-family decoder (Llama, SmolLM2, Qwen2; GQA/MQA) over the paged KV cache.

Tokens of all scheduled sequences are packed into one flat batch ``[num_tokens]``: the first
``num_decode_tokens`` are decode tokens (one per sequence), the rest prefill chunks. Each layer
writes its new keys/values to their cache slots, then attends over the cache. The arithmetic
follows Hugging Face's LlamaForCausalLM so that greedy outputs match token for token in float32.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

import kernels
from services.engine.config import ModelConfig


@dataclass
class AttentionMetadata:
    """Where each token's KV goes and what each sequence attends to, for one step."""

    slot_mapping: torch.Tensor  # [num_tokens]
    num_decode_tokens: int
    decode_block_tables: torch.Tensor  # [num_decodes, max_blocks]
    decode_context_lens: torch.Tensor  # [num_decodes]
    decode_max_context_len: int
    prefill_block_tables: torch.Tensor  # [num_prefills, max_blocks]
    prefill_query_start_loc: torch.Tensor  # [num_prefills + 1], relative to the prefill part
    prefill_context_lens: torch.Tensor  # [num_prefills]
    # Which kernels compute it (``kernels``' ``backend``): None by device; the model runner
    # passes the compiled CPU decode attention when its config turns that on.
    backend: str | kernels.Backend | None = None


Rotary = tuple[torch.Tensor, torch.Tensor]  # cos, sin [num_tokens, 1, head_dim] of one step


class RMSNorm(nn.Module):
    def __init__(self, size: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(size))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        dtype = x.dtype
        x = x.float()
        x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * x.to(dtype)


class RotaryEmbedding(nn.Module):
    """Rotate-half RoPE with cos/sin tables precomputed for every position."""

    def __init__(self, head_dim: int, max_position: int, theta: float):
        super().__init__()
        self.head_dim, self.max_position, self.theta = head_dim, max_position, theta
        self.register_buffer("cos", torch.empty(0), persistent=False)
        self.register_buffer("sin", torch.empty(0), persistent=False)
        self.build()

    def build(self, device: torch.device | str = "cpu") -> None:
        """(Re)compute the tables; needed after the model was created on the meta device."""
        steps = torch.arange(0, self.head_dim, 2, dtype=torch.int64, device=device)
        inv_freq = 1.0 / (self.theta ** (steps.float() / self.head_dim))
        positions = torch.arange(self.max_position, dtype=torch.float32, device=device)
        emb = torch.cat([torch.outer(positions, inv_freq)] * 2, dim=-1)
        self.cos = emb.cos()
        self.sin = emb.sin()

    def tables(self, positions: torch.Tensor, dtype: torch.dtype) -> Rotary:
        """cos and sin ``[T, 1, D]`` at ``positions``: looked up once per step, for all layers."""
        cos = self.cos[positions].unsqueeze(1).to(dtype)
        return cos, self.sin[positions].unsqueeze(1).to(dtype)


def apply_rotary(
    rotary: Rotary, q: torch.Tensor, k: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """Rotate-half RoPE of queries and keys with one step's ``RotaryEmbedding.tables``."""
    cos, sin = rotary
    return q * cos + _rotate_half(q) * sin, k * cos + _rotate_half(k) * sin


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


class Attention(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.num_heads, self.num_kv_heads, self.head_dim = (
            cfg.num_heads,
            cfg.num_kv_heads,
            cfg.head_dim,
        )
        self.q_size = cfg.num_heads * cfg.head_dim
        self.kv_size = cfg.num_kv_heads * cfg.head_dim
        # q, k and v share one matmul.
        self.qkv_proj = nn.Linear(
            cfg.hidden_size, self.q_size + 2 * self.kv_size, cfg.attention_bias
        )
        self.o_proj = nn.Linear(self.q_size, cfg.hidden_size, bias=False)
        self.scale = cfg.head_dim**-0.5

    def forward(
        self,
        x: torch.Tensor,
        rotary: Rotary,
        kv_cache: tuple[torch.Tensor, torch.Tensor],
        meta: AttentionMetadata,
    ) -> torch.Tensor:
        num_tokens = x.shape[0]
        q, k, v = self.qkv_proj(x).split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        q = q.view(num_tokens, self.num_heads, self.head_dim)
        k = k.view(num_tokens, self.num_kv_heads, self.head_dim)
        v = v.view(num_tokens, self.num_kv_heads, self.head_dim)
        q, k = apply_rotary(rotary, q, k)
        key_cache, value_cache = kv_cache
        kernels.write_kv(k, v, key_cache, value_cache, meta.slot_mapping, backend=meta.backend)
        nd = meta.num_decode_tokens
        parts = []
        if nd:
            parts.append(
                kernels.paged_attention_decode(
                    q[:nd],
                    key_cache,
                    value_cache,
                    meta.decode_block_tables,
                    meta.decode_context_lens,
                    self.scale,
                    meta.decode_max_context_len,
                    backend=meta.backend,
                )
            )
        if nd < num_tokens:
            parts.append(
                kernels.paged_attention_prefill(
                    q[nd:],
                    key_cache,
                    value_cache,
                    meta.prefill_block_tables,
                    meta.prefill_query_start_loc,
                    meta.prefill_context_lens,
                    self.scale,
                    backend=meta.backend,
                )
            )
        out = parts[0] if len(parts) == 1 else torch.cat(parts)
        return self.o_proj(out.reshape(num_tokens, self.q_size))


class MLP(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.gate_up_proj = nn.Linear(cfg.hidden_size, 2 * cfg.intermediate_size, bias=False)
        self.down_proj = nn.Linear(cfg.intermediate_size, cfg.hidden_size, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = self.gate_up_proj(x).chunk(2, dim=-1)
        return self.down_proj(F.silu(gate) * up)


class DecoderLayer(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.self_attn = Attention(cfg)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.mlp = MLP(cfg)

    def forward(
        self,
        x: torch.Tensor,
        rotary: Rotary,
        kv_cache: tuple[torch.Tensor, torch.Tensor],
        meta: AttentionMetadata,
    ) -> torch.Tensor:
        x = x + self.self_attn(self.input_layernorm(x), rotary, kv_cache, meta)
        return x + self.mlp(self.post_attention_layernorm(x))


class LlamaModel(nn.Module):
    """Embedding, decoder layers, final norm and LM head."""

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.config = cfg
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.layers = nn.ModuleList(DecoderLayer(cfg) for _ in range(cfg.num_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.rope = RotaryEmbedding(cfg.head_dim, cfg.max_position, cfg.rope_theta)
        self.lm_head = nn.Linear(cfg.hidden_size, cfg.vocab_size, bias=False)
        if cfg.tie_word_embeddings:
            self.lm_head.weight = self.embed_tokens.weight

    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        kv_caches: list[tuple[torch.Tensor, torch.Tensor]],
        meta: AttentionMetadata,
    ) -> torch.Tensor:
        """Hidden states ``[num_tokens, hidden]`` after the final norm."""
        x = self.embed_tokens(input_ids)
        rotary = self.rope.tables(positions, x.dtype)
        for layer, kv_cache in zip(self.layers, kv_caches):
            x = layer(x, rotary, kv_cache, meta)
        return self.norm(x)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.lm_head(hidden).float()

    def load_hf_state_dict(self, weights: dict[str, torch.Tensor]) -> None:
        """Copy Hugging Face-named weights in, fusing q/k/v and gate/up as this module does."""
        if self.config.tie_word_embeddings:  # to_empty() may have untied them
            self.lm_head.weight = self.embed_tokens.weight
        own = self.state_dict()
        loaded: set[str] = set()

        def put(name: str, tensor: torch.Tensor) -> None:
            if own[name].shape != tensor.shape:
                raise ValueError(
                    f"weight {name}: shape {tuple(tensor.shape)} does not match the config's "
                    f"{tuple(own[name].shape)}"
                )
            own[name].copy_(tensor)
            loaded.add(name)

        def get(name: str) -> torch.Tensor:
            if name not in weights:
                raise ValueError(f"weight {name} is missing from the checkpoint")
            return weights[name]

        put("embed_tokens.weight", get("model.embed_tokens.weight"))
        put("norm.weight", get("model.norm.weight"))
        if not self.config.tie_word_embeddings:
            put("lm_head.weight", get("lm_head.weight"))
        for i in range(self.config.num_layers):
            src, dst = f"model.layers.{i}.", f"layers.{i}."
            attn = src + "self_attn."
            put(
                dst + "self_attn.qkv_proj.weight",
                torch.cat([get(attn + f"{p}_proj.weight") for p in "qkv"]),
            )
            if self.config.attention_bias:
                put(
                    dst + "self_attn.qkv_proj.bias",
                    torch.cat([get(attn + f"{p}_proj.bias") for p in "qkv"]),
                )
            put(dst + "self_attn.o_proj.weight", get(attn + "o_proj.weight"))
            mlp = src + "mlp."
            put(
                dst + "mlp.gate_up_proj.weight",
                torch.cat([get(mlp + "gate_proj.weight"), get(mlp + "up_proj.weight")]),
            )
            put(dst + "mlp.down_proj.weight", get(mlp + "down_proj.weight"))
            put(dst + "input_layernorm.weight", get(src + "input_layernorm.weight"))
            put(
                dst + "post_attention_layernorm.weight",
                get(src + "post_attention_layernorm.weight"),
            )
        missing = (
            set(own) - loaded - ({"lm_head.weight"} if self.config.tie_word_embeddings else set())
        )
        if missing:
            raise ValueError(f"weights not loaded: {sorted(missing)[:5]}")
