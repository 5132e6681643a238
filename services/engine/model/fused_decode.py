"""The decoder layers of a decode step as one compiled call, where the model allows it.

At a decode batch of 1-4 sequences the layers' linears run a small-batch kernel (a GEMV bound by
the weight read), and what else a layer does costs more in dispatch than in arithmetic; at 64
the calls and their glue are still a tenth of the step. ``kernels.decode_layers`` runs every
layer in one call instead of nine per layer. Its result is the separate kernels' bit for bit, so
this is a speed choice with nothing else to it.

``FusedDecode.build`` prepares it once, for the KV cache its owner (the model runner) hands it,
and for each row count at which every linear of every layer runs a compiled path it can read
(``PackedLinear.fusable_gemm``): bfloat16 weights on CPU with the compiled kernels loaded; at
5-16 rows only the dot products and the pair order serve, past 16 the pair order alone (CPUs
with AVX-512 BF16). Any other step (prefill tokens, more rows, another cache) goes through the
layers one by one.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, cast

import torch

from kernels.cpu_ops import PAIRS_MAX_ROWS, CpuKernels
from kernels.decode_layers import DecodeLayers, LayerWeights, ModelShape
from services.engine.model.packed_linear import PackedLinear, bucket_of

if TYPE_CHECKING:
    from services.engine.model.llama import AttentionMetadata, DecoderLayer, LlamaModel

KvCaches = list[tuple[torch.Tensor, torch.Tensor]]


def _layer_weights(
    layer: DecoderLayer, rows: int, kv_cache: tuple[torch.Tensor, torch.Tensor]
) -> LayerWeights | None:
    """What the compiled call reads of ``layer`` at ``rows`` rows, or None where a linear of it
    does not run a compiled kernel the fused call reads there."""
    attn, mlp = layer.self_attn, layer.mlp
    gemms = []
    for linear in (attn.qkv_proj, attn.o_proj, mlp.gate_up_proj, mlp.down_proj):
        gemm = linear.fusable_gemm(rows) if isinstance(linear, PackedLinear) else None
        if gemm is None:
            return None
        gemms.append(gemm)
    qkv, o, gate_up, down = gemms
    return LayerWeights(
        input_norm=layer.input_layernorm.weight.detach(),
        post_norm=layer.post_attention_layernorm.weight.detach(),
        qkv=qkv.weight,
        qkv_bias=qkv.bias,
        o=o.weight,
        gate_up=gate_up.weight,
        down=down.weight,
        key_cache=kv_cache[0],
        value_cache=kv_cache[1],
    )


class FusedDecode:
    """The prepared call per row count (up to ``PAIRS_MAX_ROWS``) for ``kv_caches``; see
    ``run``."""

    def __init__(
        self, kernels: CpuKernels, kv_caches: KvCaches, by_rows: dict[int, DecodeLayers]
    ) -> None:
        self.kernels, self.kv_caches, self.by_rows = kernels, kv_caches, by_rows

    @classmethod
    def build(cls, model: LlamaModel, backend: object, kv_caches: KvCaches) -> FusedDecode | None:
        """The fused call for ``model`` over ``kv_caches`` with ``backend`` (the runner's
        attention kernels), or None where no row count can take it."""
        if not isinstance(backend, CpuKernels) or not model.layers:
            return None
        cfg = model.config
        shape = ModelShape(
            hidden=cfg.hidden_size,
            intermediate=cfg.intermediate_size,
            num_heads=cfg.num_heads,
            num_kv_heads=cfg.num_kv_heads,
            head_dim=cfg.head_dim,
            eps=cfg.rms_norm_eps,
            scale=cfg.head_dim**-0.5,  # Attention.scale
        )
        # A linear's GEMM is one per row bucket, so the layers are looked at once per bucket (at
        # its first row count); buckets served by the same weight copies share a call.
        prepared: dict[tuple[int, ...], DecodeLayers] = {}
        by_bucket: dict[int, DecodeLayers | None] = {}
        by_rows: dict[int, DecodeLayers] = {}
        for rows in range(1, PAIRS_MAX_ROWS + 1):
            bucket = bucket_of(rows)
            if bucket not in by_bucket:
                by_bucket[bucket] = cls._prepare(model, rows, kv_caches, backend, shape, prepared)
            layers = by_bucket[bucket]
            if layers is not None and rows <= layers.max_rows:
                by_rows[rows] = layers
        return cls(backend, kv_caches, by_rows) if by_rows else None

    @staticmethod
    def _prepare(
        model: LlamaModel,
        rows: int,
        kv_caches: KvCaches,
        backend: CpuKernels,
        shape: ModelShape,
        prepared: dict[tuple[int, ...], DecodeLayers],
    ) -> DecodeLayers | None:
        """The call over the weights ``model``'s linears read at ``rows`` rows (from
        ``prepared`` where one reads the same copies), or None where some linear does not run a
        fusable path there or the call does not take them."""
        weights = [
            _layer_weights(cast("DecoderLayer", layer), rows, kv)
            for layer, kv in zip(model.layers, kv_caches)
        ]
        if any(w is None for w in weights):
            return None
        key = tuple(
            id(linear)
            for w in weights
            for linear in (w.qkv, w.o, w.gate_up, w.down)  # type: ignore[union-attr]
        )
        if key not in prepared:
            try:
                prepared[key] = DecodeLayers(backend, shape, weights)  # type: ignore[arg-type]
            except ValueError:
                return None  # a dtype or cache layout it does not take
        return prepared[key]

    def run(
        self,
        x: torch.Tensor,
        rotary: tuple[torch.Tensor, torch.Tensor],
        kv_caches: KvCaches,
        meta: AttentionMetadata,
    ) -> torch.Tensor | None:
        """Every layer over ``x`` (the residual stream after the embedding, updated in place);
        returns the last layer's MLP output, not yet added to ``x``. None (nothing done) unless
        this is a decode-only step of a prepared row count over this call's caches."""
        rows = x.shape[0]
        layers = self.by_rows.get(rows)
        if (
            layers is None
            or kv_caches is not self.kv_caches
            or meta.num_decode_tokens != rows
            or meta.backend is not self.kernels
        ):
            return None
        cos, sin = rotary
        return layers.run(
            x,
            None,
            (cos.reshape(rows, -1), sin.reshape(rows, -1)),
            meta.slot_mapping,
            meta.decode_block_tables,
            meta.decode_context_lens,
            meta.decode_max_context_len,
        )
