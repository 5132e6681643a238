"""Llama-family decoder (Llama, SmolLM2, Qwen2; GQA/MQA) over the paged KV cache.

Tokens of all scheduled sequences are packed into one flat batch ``[num_tokens]``: the first
``num_decode_tokens`` are decode tokens (one per sequence), the rest prefill chunks. Each layer
writes its new keys/values to their cache slots, then attends over the cache. The arithmetic
follows Hugging Face's LlamaForCausalLM so that greedy outputs match token for token in float32.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

import kernels
from services.engine.config import ModelConfig
from services.engine.model.fused_decode import FusedDecode
from services.engine.model.gemm_choice import GemmTable


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


class RMSNorm(nn.Module):
    """RMSNorm that first adds the previous sublayer's output into the residual stream."""

    def __init__(self, size: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(size))
        self.eps = eps

    def forward(
        self,
        x: torch.Tensor,
        delta: torch.Tensor | None = None,
        backend: str | kernels.Backend | None = None,
    ) -> torch.Tensor:
        """The norm of ``x + delta``; ``x`` (the residual stream) is updated in place."""
        return kernels.add_rms_norm(x, delta, self.weight, self.eps, backend=backend)


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

    def tables(self, positions: torch.Tensor, dtype: torch.dtype) -> kernels.Rotary:
        """cos and sin ``[T, 1, D]`` at ``positions``: looked up once per step, for all layers."""
        cos = self.cos[positions].unsqueeze(1).to(dtype)
        return cos, self.sin[positions].unsqueeze(1).to(dtype)


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
        rotary: kernels.Rotary,
        kv_cache: tuple[torch.Tensor, torch.Tensor],
        meta: AttentionMetadata,
    ) -> torch.Tensor:
        num_tokens = x.shape[0]
        key_cache, value_cache = kv_cache
        q = kernels.rotary_write_kv(
            self.qkv_proj.forward(x),
            rotary,
            key_cache,
            value_cache,
            meta.slot_mapping,
            self.num_heads,
            self.num_kv_heads,
            backend=meta.backend,
        )
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
        return self.o_proj.forward(out.reshape(num_tokens, self.q_size))


class MLP(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.gate_up_proj = nn.Linear(cfg.hidden_size, 2 * cfg.intermediate_size, bias=False)
        self.down_proj = nn.Linear(cfg.intermediate_size, cfg.hidden_size, bias=False)

    def forward(self, x: torch.Tensor, backend: str | kernels.Backend | None) -> torch.Tensor:
        return self.down_proj.forward(
            kernels.silu_mul(self.gate_up_proj.forward(x), backend=backend)
        )


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
        delta: torch.Tensor | None,
        rotary: kernels.Rotary,
        kv_cache: tuple[torch.Tensor, torch.Tensor],
        meta: AttentionMetadata,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """``x``: the residual stream, updated in place; ``delta``: the previous layer's MLP
        output, not yet added to it (None for the first layer). Returns ``x`` and this layer's
        MLP output: each residual add is fused into the norm that follows it."""
        h = self.input_layernorm.forward(x, delta, meta.backend)
        h = self.post_attention_layernorm.forward(
            x, self.self_attn.forward(h, rotary, kv_cache, meta), meta.backend
        )
        return x, self.mlp.forward(h, meta.backend)


class LlamaModel(nn.Module):
    """Embedding, decoder layers, final norm and LM head."""

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.config = cfg
        # Its weight given, not initialized: the loader builds the model on the meta device,
        # where nn.Embedding's normal_() imports torch._dynamo, 2-3 s of every worker's start.
        weight = torch.empty(cfg.vocab_size, cfg.hidden_size)
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size, _weight=weight)
        self.layers = nn.ModuleList(DecoderLayer(cfg) for _ in range(cfg.num_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.rope = RotaryEmbedding(cfg.head_dim, cfg.max_position, cfg.rope_theta)
        self.lm_head = nn.Linear(cfg.hidden_size, cfg.vocab_size, bias=False)
        if cfg.tie_word_embeddings:
            self.lm_head.weight = self.embed_tokens.weight
        self.gemm_table: GemmTable | None = None  # the linears' GEMM paths (the loader's)
        # All layers of a small decode step in one compiled call: set by the KV cache's owner
        # (the model runner), over that cache only.
        self.fused_decode: FusedDecode | None = None

    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        kv_caches: list[tuple[torch.Tensor, torch.Tensor]],
        meta: AttentionMetadata,
    ) -> torch.Tensor:
        """Hidden states ``[num_tokens, hidden]`` after the final norm."""
        x = self.embed_tokens(input_ids)  # a new tensor: the residual stream, updated in place
        rotary = self.rope.tables(positions, x.dtype)
        if self.fused_decode is not None:
            delta = self.fused_decode.run(x, rotary, kv_caches, meta)
            if delta is not None:
                return self.norm(x, delta, meta.backend)
        delta = None
        # The layers and their parts are called through ``forward``: nn.Module's ``__call__``
        # (hooks, which nothing here sets) costs ~3 us a call, ~270 calls a step: 5-8% of a
        # one-token bfloat16 step on a Zen 4 core pair (benchmarks/step_breakdown.py).
        for layer, kv_cache in zip(self.layers, kv_caches):
            x, delta = layer.forward(x, delta, rotary, kv_cache, meta)
        return self.norm(x, delta, meta.backend)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """Logits in the model's dtype: the sampler widens them where it needs float32."""
        return self.lm_head(hidden)

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
