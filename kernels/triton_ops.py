"""Triton kernels for the paged KV cache: the GPU path of ``kernels`` (dispatch in ``__init__``).

Same signatures and semantics as ``kernels.reference`` (the oracle the tests compare against):

* ``write_kv``: scatter each token's key/value into its cache slot.
* ``paged_attention_decode``: one query per sequence over its whole paged context.
* ``paged_attention_prefill``: packed variable-length causal chunks over a cached prefix.
* ``add_rms_norm``, ``rotary_write_kv``, ``silu_mul``: the reference's PyTorch ops (they run on
  the GPU as they are; their rotary's KV write goes through the Triton ``write_kv`` above).

Cache views are ``[num_blocks, block_size, num_kv_heads, head_dim]`` and may be strided (one layer
of ``[num_blocks, num_layers, 2, block_size, num_kv_heads, head_dim]``), so every kernel takes
explicit strides. Attention uses an online softmax (running max ``m``, running sum ``l``) in
float32 and writes the output in the query's dtype. Token ``n`` of a sequence lives in block
``block_table[n // BLOCK_SIZE]`` at offset ``n % BLOCK_SIZE``; a key tile may span several blocks,
so each row of a tile looks up its own block id.

Cache offsets are computed in int64: ``block_id * stride`` overflows int32 on a multi-GB cache.
"""

from __future__ import annotations

import functools

import torch
import triton
import triton.language as tl

from kernels import reference

_LOG2E = 1.4426950408889634  # softmax uses exp2; scores are pre-scaled by log2(e)


def _pow2(n: int, floor: int = 1) -> int:
    """Smallest power of two >= max(n, floor) (``tl.arange`` needs power-of-two sizes)."""
    return max(triton.next_power_of_2(max(int(n), 1)), floor)


def _check_cache(key_cache: torch.Tensor, value_cache: torch.Tensor) -> None:
    if key_cache.shape != value_cache.shape or key_cache.stride() != value_cache.stride():
        raise ValueError("key_cache and value_cache must have the same shape and strides")


# --------------------------------------------------------------------------------------------
# write_kv
# --------------------------------------------------------------------------------------------


@triton.jit
def _write_kv_kernel(
    key_ptr, value_ptr, key_cache_ptr, value_cache_ptr, slot_ptr,
    stride_kt, stride_kh, stride_kd,  # key [num_tokens, kvh, hd]
    stride_vt, stride_vh, stride_vd,  # value [num_tokens, kvh, hd]
    stride_cb, stride_co, stride_ch, stride_cd,  # caches [num_blocks, block_size, kvh, hd]
    num_kv_heads, head_dim,
    BLOCK_SIZE: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_D: tl.constexpr,
):
    """One program per token: store its [kvh, hd] key and value tiles at its slot."""
    token = tl.program_id(0).to(tl.int64)
    slot = tl.load(slot_ptr + token).to(tl.int64)
    if slot < 0:  # padding token (vLLM convention): nothing to store
        return
    block = slot // BLOCK_SIZE
    offset = slot % BLOCK_SIZE
    h = tl.arange(0, BLOCK_H)[:, None]
    d = tl.arange(0, BLOCK_D)[None, :]
    mask = (h < num_kv_heads) & (d < head_dim)
    dst = block * stride_cb + offset * stride_co + h * stride_ch + d * stride_cd
    key = tl.load(key_ptr + token * stride_kt + h * stride_kh + d * stride_kd, mask=mask)
    tl.store(key_cache_ptr + dst, key.to(key_cache_ptr.dtype.element_ty), mask=mask)
    value = tl.load(value_ptr + token * stride_vt + h * stride_vh + d * stride_vd, mask=mask)
    tl.store(value_cache_ptr + dst, value.to(value_cache_ptr.dtype.element_ty), mask=mask)


def write_kv(
    key: torch.Tensor,
    value: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
) -> None:
    """Store ``key``/``value`` ``[num_tokens, num_kv_heads, head_dim]`` at their slots.

    Slots below zero are skipped (padding tokens); the reference has no such convention.
    """
    _check_cache(key_cache, value_cache)
    num_tokens, num_kv_heads, head_dim = key.shape
    if num_tokens == 0:
        return
    _write_kv_kernel[(num_tokens,)](
        key, value, key_cache, value_cache, slot_mapping,
        *key.stride(), *value.stride(), *key_cache.stride(),
        num_kv_heads, head_dim,
        BLOCK_SIZE=key_cache.shape[1], BLOCK_H=_pow2(num_kv_heads), BLOCK_D=_pow2(head_dim),
    )


# --------------------------------------------------------------------------------------------
# Shared tile loader
# --------------------------------------------------------------------------------------------


@triton.jit
def _load_kv_tile(
    cache_ptr, table_row_ptr, stride_tb, n, n_mask, kv_head, d, d_mask,
    stride_cb, stride_co, stride_ch, stride_cd, BLOCK_SIZE: tl.constexpr,
):
    """Gather tokens ``n`` (a [BLOCK_N] vector) of one KV head as a [BLOCK_N, BLOCK_D] tile."""
    block = tl.load(table_row_ptr + (n // BLOCK_SIZE) * stride_tb, mask=n_mask, other=0)
    row = block.to(tl.int64) * stride_cb + (n % BLOCK_SIZE) * stride_co + kv_head * stride_ch
    ptrs = cache_ptr + row[:, None] + d[None, :] * stride_cd
    return tl.load(ptrs, mask=n_mask[:, None] & d_mask[None, :], other=0.0)


# --------------------------------------------------------------------------------------------
# Decode
# --------------------------------------------------------------------------------------------


@triton.jit
def _decode_kernel(
    q_ptr, k_cache_ptr, v_cache_ptr, table_ptr, ctx_ptr, out_ptr, part_ml_ptr, part_acc_ptr,
    stride_qs, stride_qh, stride_qd,
    stride_cb, stride_co, stride_ch, stride_cd,
    stride_ts, stride_tb,
    stride_os, stride_oh, stride_od,
    qk_scale, max_len, num_heads, group, head_dim, part_tokens, num_parts,
    BLOCK_SIZE: tl.constexpr, BLOCK_G: tl.constexpr, BLOCK_N: tl.constexpr,
    BLOCK_D: tl.constexpr, SPLIT: tl.constexpr,
):
    """One program per (sequence, KV head, context partition): its ``group`` query heads share
    each loaded KV tile.

    Decode has one query row per head, too few for ``tl.dot`` (needs >= 16 rows), so scores and
    outputs are broadcast-multiply-reduce over a [BLOCK_G, BLOCK_N, BLOCK_D] product in fp32.
    Without ``SPLIT`` the one partition is the whole context and the output is stored; with it,
    the partition's running max, sum and unnormalized output go to the partial buffers for
    ``_decode_reduce_kernel`` (a partition past a short sequence's end stores max -inf, sum 0).
    """
    seq = tl.program_id(0).to(tl.int64)
    kv_head = tl.program_id(1)
    part = tl.program_id(2)
    ctx = tl.minimum(tl.load(ctx_ptr + seq), max_len)  # reference attends to <= max_len tokens
    g = tl.arange(0, BLOCK_G)
    d = tl.arange(0, BLOCK_D)
    g_mask = g < group
    d_mask = d < head_dim
    heads = kv_head * group + g
    q_ptrs = q_ptr + seq * stride_qs + heads[:, None] * stride_qh + d[None, :] * stride_qd
    q_mask = g_mask[:, None] & d_mask[None, :]
    q = tl.load(q_ptrs, mask=q_mask, other=0.0).to(tl.float32) * qk_scale  # [G, D]

    m_i = tl.full([BLOCK_G], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_G], tl.float32)
    acc = tl.zeros([BLOCK_G, BLOCK_D], tl.float32)
    table_row = table_ptr + seq * stride_ts
    lo = part * part_tokens
    hi = tl.minimum(ctx, lo + part_tokens)
    for start in range(lo, hi, BLOCK_N):
        n = start + tl.arange(0, BLOCK_N)
        n_mask = n < hi
        k = _load_kv_tile(k_cache_ptr, table_row, stride_tb, n, n_mask, kv_head, d, d_mask,
                          stride_cb, stride_co, stride_ch, stride_cd, BLOCK_SIZE)
        v = _load_kv_tile(v_cache_ptr, table_row, stride_tb, n, n_mask, kv_head, d, d_mask,
                          stride_cb, stride_co, stride_ch, stride_cd, BLOCK_SIZE)
        s = tl.sum(q[:, None, :] * k.to(tl.float32)[None, :, :], axis=2)  # [G, N], log2 units
        s = tl.where(n_mask[None, :], s, float("-inf"))
        # Every tile holds >= 1 valid key (start < hi), so m_new is finite: no inf - inf.
        m_new = tl.maximum(m_i, tl.max(s, axis=1))
        alpha = tl.exp2(m_i - m_new)
        p = tl.exp2(s - m_new[:, None])
        l_i = l_i * alpha + tl.sum(p, axis=1)
        pv = tl.sum(p[:, :, None] * v.to(tl.float32)[None, :, :], axis=1)  # [G, D]
        acc = acc * alpha[:, None] + pv
        m_i = m_new

    if SPLIT:
        # Partial buffers: ml [seqs, heads, parts, 2] (max, sum); acc [seqs, heads, parts, D].
        row = (seq * num_heads + heads) * num_parts + part  # [G]
        tl.store(part_ml_ptr + row * 2, m_i, mask=g_mask)
        tl.store(part_ml_ptr + row * 2 + 1, l_i, mask=g_mask)
        acc_ptrs = part_acc_ptr + row[:, None] * head_dim + d[None, :]
        tl.store(acc_ptrs, acc, mask=q_mask)
    else:
        out = acc / l_i[:, None]
        o_ptrs = out_ptr + seq * stride_os + heads[:, None] * stride_oh + d[None, :] * stride_od
        tl.store(o_ptrs, out.to(out_ptr.dtype.element_ty), mask=q_mask)


@triton.jit
def _decode_reduce_kernel(
    part_ml_ptr, part_acc_ptr, out_ptr,
    stride_os, stride_oh, stride_od,
    num_heads, num_parts, head_dim,
    BLOCK_P: tl.constexpr, BLOCK_D: tl.constexpr,
):
    """One program per (sequence, head): the partitions' outputs rescaled to their common max
    and summed (partition 0 always holds keys, so the max is finite)."""
    seq = tl.program_id(0).to(tl.int64)
    head = tl.program_id(1)
    p = tl.arange(0, BLOCK_P)
    d = tl.arange(0, BLOCK_D)
    p_mask = p < num_parts
    d_mask = d < head_dim
    row = (seq * num_heads + head) * num_parts + p  # [P]
    m = tl.load(part_ml_ptr + row * 2, mask=p_mask, other=float("-inf"))
    total = tl.load(part_ml_ptr + row * 2 + 1, mask=p_mask, other=0.0)
    acc = tl.load(part_acc_ptr + row[:, None] * head_dim + d[None, :],
                  mask=p_mask[:, None] & d_mask[None, :], other=0.0)
    weight = tl.exp2(m - tl.max(m, axis=0))  # 0 for an empty partition (max -inf)
    out = tl.sum(acc * weight[:, None], axis=0) / tl.sum(total * weight, axis=0)
    o_ptrs = out_ptr + seq * stride_os + head * stride_oh + d * stride_od
    tl.store(o_ptrs, out.to(out_ptr.dtype.element_ty), mask=d_mask)


def _decode_tile_tokens(block_g: int, block_d: int) -> int:
    """Keys per tile: keep the [G, N, D] fp32 product near 4K elements (registers), N >= 16."""
    return max(_pow2(4096 // (block_g * block_d)), 16)


# Flash-decoding: a long context is split into partitions that run in parallel when there are
# too few (sequence, KV head) programs to fill the GPU (one program walking 2,048 keys alone
# took 275 us on an H100, 16 partitions 26 us; docs/benchmarks.md). Below SPLIT_FROM_TOKENS the
# walk costs less than the second launch the merge needs (~30 us of Python each, there).
SPLIT_FROM_TOKENS = 1024
MIN_PARTITION_TOKENS = 128
PROGRAMS_PER_SM = 4


@functools.cache
def _num_sms(device: torch.device) -> int:
    """The GPU's multiprocessors (asked once per device: this runs every layer of every step)."""
    return torch.cuda.get_device_properties(device).multi_processor_count


def _decode_partitions(num_seqs: int, num_kv_heads: int, max_len: int, device: torch.device) -> int:
    """Partitions per (sequence, KV head): enough programs for every SM, none below
    ``MIN_PARTITION_TOKENS`` keys; one for a context under ``SPLIT_FROM_TOKENS`` and on a CPU
    (where the interpreter runs these kernels)."""
    if device.type != "cuda" or max_len < SPLIT_FROM_TOKENS:
        return 1
    wanted = -(-PROGRAMS_PER_SM * _num_sms(device) // (num_seqs * num_kv_heads))
    return max(1, min(wanted, max_len // MIN_PARTITION_TOKENS))


def paged_attention_decode(
    query: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    block_tables: torch.Tensor,
    context_lens: torch.Tensor,
    scale: float,
    max_context_len: int | None = None,
    *,
    partitions: int | None = None,
) -> torch.Tensor:
    """One query token per sequence attends to its whole context (see the reference).

    ``max_context_len`` (if given) caps the attended length, as in the reference; it saves the
    host sync of ``context_lens.max()``, and lets a long context be split into ``partitions``
    that run in parallel (None: as many as fill the GPU; without ``max_context_len``, one).
    """
    _check_cache(key_cache, value_cache)
    num_seqs, num_heads, head_dim = query.shape
    block_size, num_kv_heads = key_cache.shape[1], key_cache.shape[2]
    if num_heads % num_kv_heads:
        raise ValueError(f"num_heads {num_heads} is not a multiple of {num_kv_heads} KV heads")
    out = torch.empty(query.shape, dtype=query.dtype, device=query.device)
    if num_seqs == 0:
        return out
    group = num_heads // num_kv_heads
    block_g, block_d = _pow2(group), _pow2(head_dim)
    block_n = _decode_tile_tokens(block_g, block_d)
    if max_context_len is None:
        if partitions not in (None, 1):
            raise ValueError("splitting the context into partitions needs max_context_len")
        max_len, partitions = 2**31 - 1, 1
    else:
        max_len = int(max_context_len)
        if partitions is None:
            partitions = _decode_partitions(num_seqs, num_kv_heads, max_len, query.device)
    if partitions > 1:  # whole tiles each: rounding up may leave fewer partitions than asked
        part_tokens = max(block_n, -(-max_len // (partitions * block_n)) * block_n)
        partitions = max(1, -(-max_len // part_tokens))
    else:
        part_tokens = max_len
    split = partitions > 1
    rows = (num_seqs, num_heads, partitions) if split else (0, 0, 0)
    part_ml = torch.empty((*rows, 2), dtype=torch.float32, device=query.device)
    part_acc = torch.empty((*rows, head_dim), dtype=torch.float32, device=query.device)
    _decode_kernel[(num_seqs, num_kv_heads, partitions)](
        query, key_cache, value_cache, block_tables, context_lens, out, part_ml, part_acc,
        *query.stride(), *key_cache.stride(), *block_tables.stride(), *out.stride(),
        scale * _LOG2E, max_len, num_heads, group, head_dim, part_tokens, partitions,
        BLOCK_SIZE=block_size, BLOCK_G=block_g, BLOCK_N=block_n, BLOCK_D=block_d, SPLIT=split,
    )
    if split:
        _decode_reduce_kernel[(num_seqs, num_heads)](
            part_ml, part_acc, out, *out.stride(), num_heads, partitions, head_dim,
            BLOCK_P=_pow2(partitions), BLOCK_D=block_d,
        )
    return out


# --------------------------------------------------------------------------------------------
# Prefill
# --------------------------------------------------------------------------------------------


@triton.jit
def _dot(a, b, PRECISION: tl.constexpr, UPCAST: tl.constexpr):
    """``tl.dot`` with an fp32 accumulator; ``UPCAST`` computes it from fp32 copies instead.

    ``UPCAST`` exists for the CPU interpreter only: it multiplies bfloat16 operands as their raw
    uint16 bit patterns (triton 3.x), so bf16 tiles are widened first (exactly) there.
    """
    if UPCAST:
        out = tl.dot(a.to(tl.float32), b.to(tl.float32), input_precision="ieee")
    else:
        out = tl.dot(a, b, input_precision=PRECISION)
    return out


@triton.jit
def _prefill_kernel(
    q_ptr, k_cache_ptr, v_cache_ptr, table_ptr, qstart_ptr, ctx_ptr, out_ptr,
    stride_qt, stride_qh, stride_qd,
    stride_cb, stride_co, stride_ch, stride_cd,
    stride_ts, stride_tb,
    stride_ot, stride_oh, stride_od,
    qk_scale, group, head_dim,
    BLOCK_SIZE: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    BLOCK_D: tl.constexpr, DOT_PRECISION: tl.constexpr, DOT_UPCAST: tl.constexpr,
):
    """One program per (sequence, tile of BLOCK_M queries, query head); causal online softmax.

    Query ``i`` of a sequence sits at position ``context_len - q_len + i`` and sees keys
    ``0..position``; the key loop stops at the tile's last position.
    """
    seq = tl.program_id(0)
    tile = tl.program_id(1)
    head = tl.program_id(2)
    q_start = tl.load(qstart_ptr + seq)
    q_len = tl.load(qstart_ptr + seq + 1) - q_start
    if tile * BLOCK_M >= q_len:  # the grid is sized for the longest chunk
        return
    ctx = tl.load(ctx_ptr + seq)
    kv_head = head // group
    rows = tile * BLOCK_M + tl.arange(0, BLOCK_M)  # query index within the chunk
    pos = ctx - q_len + rows  # absolute position of each query
    m_mask = rows < q_len
    d = tl.arange(0, BLOCK_D)
    d_mask = d < head_dim
    tokens = (q_start + rows).to(tl.int64)
    q_ptrs = q_ptr + tokens[:, None] * stride_qt + head * stride_qh + d[None, :] * stride_qd
    q_mask = m_mask[:, None] & d_mask[None, :]
    q = tl.load(q_ptrs, mask=q_mask, other=0.0)  # [M, D], input dtype for tl.dot

    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)
    table_row = table_ptr + seq.to(tl.int64) * stride_ts
    end = tl.minimum(ctx, ctx - q_len + tile * BLOCK_M + BLOCK_M)  # causal: last row's pos + 1
    for start in range(0, end, BLOCK_N):
        n = start + tl.arange(0, BLOCK_N)
        n_mask = n < ctx
        k = _load_kv_tile(k_cache_ptr, table_row, stride_tb, n, n_mask, kv_head, d, d_mask,
                          stride_cb, stride_co, stride_ch, stride_cd, BLOCK_SIZE)
        v = _load_kv_tile(v_cache_ptr, table_row, stride_tb, n, n_mask, kv_head, d, d_mask,
                          stride_cb, stride_co, stride_ch, stride_cd, BLOCK_SIZE)
        s = _dot(q, tl.trans(k.to(q.dtype)), DOT_PRECISION, DOT_UPCAST) * qk_scale
        visible = n_mask[None, :] & (n[None, :] <= pos[:, None])
        s = tl.where(visible, s, float("-inf"))
        # Key 0 is visible to every row (pos >= 0), so after the first tile m_new is finite.
        m_new = tl.maximum(m_i, tl.max(s, axis=1))
        alpha = tl.exp2(m_i - m_new)
        p = tl.exp2(s - m_new[:, None])
        l_i = l_i * alpha + tl.sum(p, axis=1)
        pv = _dot(p.to(v.dtype), v, DOT_PRECISION, DOT_UPCAST)  # P rounded like the reference
        acc = acc * alpha[:, None] + pv
        m_i = m_new

    out = acc / l_i[:, None]
    o_ptrs = out_ptr + tokens[:, None] * stride_ot + head * stride_oh + d[None, :] * stride_od
    tl.store(o_ptrs, out.to(out_ptr.dtype.element_ty), mask=q_mask)


def paged_attention_prefill(
    query: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    block_tables: torch.Tensor,
    query_start_loc: torch.Tensor,
    context_lens: torch.Tensor,
    scale: float,
) -> torch.Tensor:
    """Packed causal prefill chunks over each sequence's cached prefix (see the reference).

    One host sync (the longest chunk) sizes the grid.
    """
    _check_cache(key_cache, value_cache)
    num_tokens, num_heads, head_dim = query.shape
    block_size, num_kv_heads = key_cache.shape[1], key_cache.shape[2]
    if num_heads % num_kv_heads:
        raise ValueError(f"num_heads {num_heads} is not a multiple of {num_kv_heads} KV heads")
    out = torch.empty(query.shape, dtype=query.dtype, device=query.device)
    num_seqs = context_lens.shape[0]
    if num_tokens == 0 or num_seqs == 0:
        return out
    max_q_len = int((query_start_loc[1:] - query_start_loc[:-1]).max())
    block_m = 16 if max_q_len <= 16 else 64  # tl.dot needs >= 16 rows; short chunks waste less
    block_n = 32 if query.dtype == torch.float32 else 64  # fp32 tiles take twice the SRAM
    # fp32 inputs: exact products, like the reference (tl.dot would default to TF32 on GPU).
    precision = "ieee" if query.dtype == torch.float32 else "tf32"
    grid = (num_seqs, triton.cdiv(max_q_len, block_m), num_heads)
    _prefill_kernel[grid](
        query, key_cache, value_cache, block_tables, query_start_loc, context_lens, out,
        *query.stride(), *key_cache.stride(), *block_tables.stride(), *out.stride(),
        scale * _LOG2E, num_heads // num_kv_heads, head_dim,
        BLOCK_SIZE=block_size, BLOCK_M=block_m, BLOCK_N=block_n,
        BLOCK_D=_pow2(head_dim, floor=16), DOT_PRECISION=precision,
        DOT_UPCAST=query.dtype == torch.bfloat16 and not query.is_cuda,  # interpreter, see _dot
    )
    return out


add_rms_norm = reference.add_rms_norm
silu_mul = reference.silu_mul


def rotary_write_kv(
    qkv: torch.Tensor,
    rotary: reference.Rotary,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
    num_heads: int,
    num_kv_heads: int,
) -> torch.Tensor:
    """``reference.rotary_write_kv`` with this module's ``write_kv``."""
    q, k, v = reference.split_rotated(qkv, rotary, num_heads, num_kv_heads)
    write_kv(k, v, key_cache, value_cache, slot_mapping)
    return q
