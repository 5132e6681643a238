"""Vectorized PyTorch reference kernels: the CPU path, and the oracle the Triton kernels match.

Cache layout (one layer's view): ``key_cache``/``value_cache`` are ``[num_blocks, block_size,
num_kv_heads, head_dim]``, possibly strided (the engine keeps all layers of a block together so a
block moves as one contiguous piece). Token ``t`` of a sequence lives in block
``block_table[t // block_size]`` at offset ``t % block_size``; a *slot* is
``block_id * block_size + offset``.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F


def write_kv(
    key: torch.Tensor,
    value: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
) -> None:
    """Store ``key``/``value`` ``[num_tokens, num_kv_heads, head_dim]`` at their slots."""
    block_size = key_cache.shape[1]
    blocks = torch.div(slot_mapping, block_size, rounding_mode="floor")
    offsets = slot_mapping - blocks * block_size
    key_cache[blocks, offsets] = key.to(key_cache.dtype)
    value_cache[blocks, offsets] = value.to(value_cache.dtype)


def gather_blocks(cache: torch.Tensor, block_tables: torch.Tensor, num_blocks: int) -> torch.Tensor:
    """``[num_seqs, num_blocks, num_kv_heads, block_size, head_dim]``: each sequence's blocks.

    Heads-major inside a block is how the engine stores a block, so for its cache this is one
    contiguous copy per block (``index_select`` is several times faster than fancy indexing).
    """
    num_seqs = block_tables.shape[0]
    heads_major = cache.transpose(1, 2)  # [N, kvh, bs, hd]
    ids = block_tables[:, :num_blocks].reshape(-1).long()
    return torch.index_select(heads_major, 0, ids).view(
        num_seqs, num_blocks, *heads_major.shape[1:]
    )


def gather_kv(cache: torch.Tensor, block_tables: torch.Tensor, max_len: int) -> torch.Tensor:
    """``[num_seqs, num_kv_heads, max_len, head_dim]``: each sequence's tokens, padded."""
    block_size = cache.shape[1]
    blocks = gather_blocks(cache, block_tables, -(-max_len // block_size))
    num_seqs, num_blocks, num_kv_heads, _, head_dim = blocks.shape
    tokens = blocks.transpose(1, 2).reshape(
        num_seqs, num_kv_heads, num_blocks * block_size, head_dim
    )
    return tokens[:, :, :max_len]


def paged_attention_decode(
    query: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    block_tables: torch.Tensor,
    context_lens: torch.Tensor,
    scale: float,
    max_context_len: int | None = None,
) -> torch.Tensor:
    """One query token per sequence attends to its whole context.

    query ``[num_seqs, num_heads, head_dim]``; block_tables ``[num_seqs, max_blocks]`` (padding
    entries must be valid block ids; they are masked); context_lens ``[num_seqs]`` (including
    the query token, whose KV is already written). Returns ``[num_seqs, num_heads, head_dim]``.

    Scores are computed block by block on the gathered blocks as they lie, with no transposed
    copy of the keys or values, and the softmax spans all blocks of a sequence. The products run
    in the cache's dtype: the query is cast to it and the probabilities rounded to it (a float32
    query on a bfloat16 cache is rounded here); the compiled kernel computes in float32 whatever
    the dtypes, so tests compare it with float32 math on the same values, not with these roundings.
    """
    num_seqs, num_heads, head_dim = query.shape
    block_size, num_kv_heads = key_cache.shape[1], key_cache.shape[2]
    max_len = int(context_lens.max()) if max_context_len is None else max_context_len
    num_blocks = -(-max_len // block_size)
    keys = gather_blocks(key_cache, block_tables, num_blocks)  # [S, nb, kvh, bs, hd]
    values = gather_blocks(value_cache, block_tables, num_blocks)
    group = num_heads // num_kv_heads
    q = query.view(num_seqs, 1, num_kv_heads, group, head_dim).to(keys.dtype)
    scores = torch.matmul(q, keys.transpose(-1, -2)).float() * scale  # [S, nb, kvh, g, bs]
    # Keys at or past the context length (or past max_len, which may cap it) are masked.
    positions = torch.arange(num_blocks * block_size, device=query.device)
    limit = context_lens.clamp(max=max_len).view(-1, 1, 1)
    pad = positions.view(num_blocks, block_size)[None] >= limit
    scores.masked_fill_(pad[:, :, None, None, :], float("-inf"))
    scores = (scores - scores.amax(dim=(1, 4), keepdim=True)).exp_()
    probs = scores / scores.sum(dim=(1, 4), keepdim=True)
    out = torch.matmul(probs.to(values.dtype), values).sum(dim=1)  # [S, kvh, g, hd]
    return out.reshape(num_seqs, num_heads, head_dim).to(query.dtype)


# A sequence padded into a call with others computes at most this many times the scores it
# needs: in one call, a 1,024-token prompt made each of six neighbours of 96-192 tokens 1,024 x
# 1,024 (float32 step 6.5 s, grouped 2.5: benchmarks/prefill_attention_paths.py --mixed).
PADDING_WASTE = 2.0


def length_groups(q_lens: list[int], context_lens: list[int]) -> list[list[int]]:
    """The sequences (indices) in groups that are padded together: by context length, longest
    first, a group taking the next sequence while the padded area (longest query x longest
    context) stays within ``PADDING_WASTE`` times every member's own (query x context)."""
    order = sorted(range(len(q_lens)), key=lambda s: (-context_lens[s], -q_lens[s]))
    groups: list[list[int]] = []
    longest_q = smallest = 0
    for s in order:
        area = q_lens[s] * context_lens[s]
        if groups:
            padded = max(longest_q, q_lens[s]) * context_lens[groups[-1][0]]
            if padded <= PADDING_WASTE * min(smallest, area):
                groups[-1].append(s)
                longest_q, smallest = max(longest_q, q_lens[s]), min(smallest, area)
                continue
        groups.append([s])
        longest_q, smallest = q_lens[s], area
    return groups


def paged_attention_prefill(
    query: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    block_tables: torch.Tensor,
    query_start_loc: torch.Tensor,
    context_lens: torch.Tensor,
    scale: float,
) -> torch.Tensor:
    """Prefill (or a chunk of it) over a cached prefix, for several sequences packed together.

    query ``[num_tokens, num_heads, head_dim]`` holds sequence ``i``'s queries at
    ``query_start_loc[i]:query_start_loc[i+1]``; they are the last tokens of its
    ``context_lens[i]`` tokens, all of whose KV is already in the cache. Sequences of similar
    lengths are padded into one attention call (``length_groups``), one call per group.
    """
    q_lens = (query_start_loc[1:] - query_start_loc[:-1]).tolist()
    groups = length_groups(q_lens, context_lens.tolist())
    args = (key_cache, value_cache, block_tables, query_start_loc, context_lens, scale)
    if len(groups) == 1:
        return _padded_prefill(query, *args)
    out = torch.empty_like(query)
    starts = query_start_loc.tolist()
    device = query.device
    for group in groups:
        tokens = torch.cat([torch.arange(starts[s], starts[s + 1], device=device) for s in group])
        members = torch.tensor(group, device=device)
        lens = torch.tensor([0] + [q_lens[s] for s in group]).cumsum(0).to(query_start_loc)
        out[tokens] = _padded_prefill(
            query[tokens],
            key_cache,
            value_cache,
            block_tables[members],
            lens,
            context_lens[members],
            scale,
        )
    return out


def _padded_prefill(
    query: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    block_tables: torch.Tensor,
    query_start_loc: torch.Tensor,
    context_lens: torch.Tensor,
    scale: float,
) -> torch.Tensor:
    """``paged_attention_prefill`` in one attention call, every sequence padded to the longest
    query and context."""
    num_seqs = context_lens.shape[0]
    q_lens = query_start_loc[1:] - query_start_loc[:-1]
    max_q, max_ctx = int(q_lens.max()), int(context_lens.max())
    keys = gather_kv(key_cache, block_tables, max_ctx).to(query.dtype)  # [S, kvh, C, hd]
    values = gather_kv(value_cache, block_tables, max_ctx).to(query.dtype)
    if max_q == max_ctx and bool((q_lens == max_q).all() & (context_lens == max_q).all()):
        # Fresh prompts of one length: plain causal attention, no padding and no mask.
        batch = query.reshape(num_seqs, max_q, *query.shape[1:]).transpose(1, 2)
        out = F.scaled_dot_product_attention(
            batch, keys, values, is_causal=True, scale=scale, enable_gqa=True
        )
        return out.transpose(1, 2).reshape(query.shape)
    seq_of_token = torch.repeat_interleave(torch.arange(num_seqs, device=query.device), q_lens)
    row_of_token = torch.arange(query.shape[0], device=query.device) - query_start_loc[seq_of_token]
    padded = query.new_zeros(num_seqs, max_q, *query.shape[1:])
    padded[seq_of_token, row_of_token] = query
    # Query row i of sequence s sits at position ctx_s - q_s + i and sees keys up to there.
    # Padding rows (i >= q_s) see only real keys, so no row is fully masked.
    q_pos = (context_lens - q_lens)[:, None] + torch.arange(max_q, device=query.device)
    k_pos = torch.arange(max_ctx, device=query.device)
    mask = (k_pos[None, None, :] <= q_pos[:, :, None]) & (
        k_pos[None, None, :] < context_lens[:, None, None]
    )
    out = F.scaled_dot_product_attention(
        padded.transpose(1, 2),
        keys,
        values,
        attn_mask=mask[:, None],
        scale=scale,
        enable_gqa=True,
    )  # [S, H, max_q, hd]
    return out.transpose(1, 2)[seq_of_token, row_of_token]


# The per-token glue of a decoder layer (the compiled CPU path fuses each into one call).

Rotary = tuple[torch.Tensor, torch.Tensor]  # cos, sin [num_tokens, 1, head_dim] of one step


def add_rms_norm(
    x: torch.Tensor, delta: torch.Tensor | None, weight: torch.Tensor, eps: float
) -> torch.Tensor:
    """RMSNorm of ``x`` ``[num_tokens, hidden]`` after adding ``delta`` (None: nothing) into it in
    place: ``x`` is the residual stream. Arithmetic as Hugging Face's Llama: statistics in
    float32, the weight applied in ``x``'s dtype."""
    if delta is not None:
        x.add_(delta)
    h = x.float()
    h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)
    return weight * h.to(x.dtype)


def apply_rotary(rotary: Rotary, x: torch.Tensor) -> torch.Tensor:
    """Rotate-half RoPE of ``x`` ``[num_tokens, heads, head_dim]`` with one step's tables."""
    cos, sin = rotary
    half = x.shape[-1] // 2
    return x * cos + torch.cat((-x[..., half:], x[..., :half]), dim=-1) * sin


def split_rotated(
    qkv: torch.Tensor, rotary: Rotary, num_heads: int, num_kv_heads: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Queries and keys rotated, and values, ``[num_tokens, heads, head_dim]`` each, of ``qkv``
    ``[num_tokens, (num_heads + 2 num_kv_heads) * head_dim]`` (queries, keys, values)."""
    num_tokens, head_dim = qkv.shape[0], rotary[0].shape[-1]
    q, k, v = qkv.view(num_tokens, num_heads + 2 * num_kv_heads, head_dim).split(
        [num_heads, num_kv_heads, num_kv_heads], dim=1
    )
    return apply_rotary(rotary, q), apply_rotary(rotary, k), v


def rotary_write_kv(
    qkv: torch.Tensor,
    rotary: Rotary,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
    num_heads: int,
    num_kv_heads: int,
) -> torch.Tensor:
    """``split_rotated``, then keys and values stored at their slots (``write_kv``); returns the
    rotated queries."""
    q, k, v = split_rotated(qkv, rotary, num_heads, num_kv_heads)
    write_kv(k, v, key_cache, value_cache, slot_mapping)
    return q


def silu_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """``silu(gate) * up`` of ``gate_up`` ``[num_tokens, 2 * size]`` (gate, then up, per row)."""
    gate, up = gate_up.chunk(2, dim=-1)
    return F.silu(gate) * up


def argmax_rows(logits: torch.Tensor) -> torch.Tensor:
    """Greedy sampling's tokens: the index of each row's first maximum in ``logits``
    ``[rows, vocab]`` (int64 ``[rows]``), a NaN counting as above every number."""
    return logits.max(dim=-1).indices  # argmax's first maximum, 1.6x faster on CPU here


_MASK32 = 0xFFFFFFFF
# lowbias32's multipliers as int32 (the same bits): int32 products wrap modulo 2^32, as the
# vectorized multiply of PyTorch's CPU and CUDA kernels does.
_MIX_FIRST, _MIX_SECOND = 0x7FEB352D, 0x846CA68B - 2**32
_NOISE_ROWS = 8  # rows hashed at a time: their int32 temporaries stay in the core's cache


def _as_int32(x: torch.Tensor) -> torch.Tensor:
    """int64 values holding uint32 bits, as int32 with the same bits."""
    return torch.where(x >= 2**31, x - 2**32, x).to(torch.int32)


def _mix32_(x: torch.Tensor) -> torch.Tensor:
    """lowbias32 (kernels/csrc/sampling_cpu.c's mix32), in place on int32 holding uint32 bits
    (a right shift of int32 is arithmetic, so its sign copies are masked off)."""
    x ^= (x >> 16) & 0xFFFF
    x *= _MIX_FIRST
    x ^= (x >> 15) & 0x1FFFF
    x *= _MIX_SECOND
    x ^= (x >> 16) & 0xFFFF
    return x


def race_noise(keys: torch.Tensor, n: int) -> torch.Tensor:
    """The race's uniform numbers ``[rows, n]`` (float32, in (0, 1)): for row r and column i,
    ``((mix32(mix32(i ^ key_low) ^ key_high) >> 9) + 0.5) / 2^23``, keys int64 ``[rows]``
    holding uint64 bits, split in 32-bit halves."""
    low, high = _as_int32(keys & _MASK32), _as_int32((keys >> 32) & _MASK32)
    column = torch.arange(n, dtype=torch.int32)
    out = torch.empty(keys.shape[0], n)
    for first in range(0, keys.shape[0], _NOISE_ROWS):
        rows = slice(first, first + _NOISE_ROWS)
        bits = _mix32_(column[None, :] ^ low[rows, None])
        bits ^= high[rows, None]
        bits = (_mix32_(bits) >> 9) & 0x7FFFFF
        torch.add(bits.float(), 0.5, out=out[rows]).mul_(1.0 / 8388608.0)
    return out


def race_rows(
    logits: torch.Tensor,
    scale: torch.Tensor,
    keys: torch.Tensor,
    floors: torch.Tensor | None = None,
) -> torch.Tensor:
    """Sampling's draw (int64 ``[rows]``) from ``logits`` ``[rows, vocab]``: a row with scale > 0
    draws from softmax(logits * scale) over its logits >= ``floors`` (``filter_floors``; None:
    all) by the exponential race, the first maximum of ``logits * scale - log(-log U)`` with U
    from ``race_noise`` keyed by the row's ``keys`` (a NaN score never wins); a row with
    scale <= 0 takes its argmax (``argmax_rows``)."""
    if logits.shape[0] == 0:
        return torch.empty(0, dtype=torch.int64)
    x = logits.float()
    if floors is not None:
        x = x.masked_fill(x < floors.float()[:, None], float("-inf"))
    noise = torch.log(-torch.log(race_noise(keys.to(torch.int64), x.shape[1])))
    score = x * scale.float()[:, None] - noise
    score = score.masked_fill(score.isnan(), float("-inf"))
    tokens = score.max(dim=-1).indices
    greedy = scale <= 0
    if bool(greedy.any()):
        tokens[greedy] = argmax_rows(logits[greedy])
    return tokens


def filter_floors(
    logits: torch.Tensor,
    scale: torch.Tensor,
    top_k: torch.Tensor,
    top_p: torch.Tensor,
    min_p: torch.Tensor,
) -> torch.Tensor:
    """Each row's floor (float32 ``[rows]``): the smallest logit its top-k, top-p and min-p
    filters keep, -inf where they drop nothing; the filters keep exactly the logits >= it.

    Judged on y = logits * scale (logits / temperature) with w = exp(y - max y): top-k (k > 0)
    keeps the k largest logits and any equal to the k-th; top-p (< 1) keeps a token while the
    mass of the strictly larger logits within top-k's set is below top_p times that set's mass
    (the most likely token always stays; equal logits stay or go together); min-p (> 0) keeps
    w >= min_p. A NaN counts as -inf. By a sort of each row (kernels/csrc/sampling_cpu.c finds
    the same floors without one)."""
    x = logits.float()
    x = x.masked_fill(x.isnan(), float("-inf"))
    rows, n = x.shape
    xs = x.sort(dim=-1, descending=True).values
    y = xs * scale.float()[:, None]
    w = torch.exp(y - y[:, :1]).nan_to_num(0.0)  # a row of -inf: nothing to keep or drop
    k = torch.where((top_k > 0) & (top_k < n), top_k, n).to(torch.int64)[:, None]
    in_k = xs >= xs.gather(1, k - 1)
    w_k = torch.where(in_k, w, 0.0)
    before = w_k.cumsum(dim=-1) - w_k
    starts = torch.ones_like(in_k)
    starts[:, 1:] = xs[:, 1:] != xs[:, :-1]
    first_equal = torch.where(starts, torch.arange(n), 0).cummax(dim=-1).values
    above = before.gather(1, first_equal)  # the mass of the strictly larger logits
    target = top_p.float()[:, None] * w_k.sum(dim=-1, keepdim=True)
    keep = in_k & ((above < target) | (top_p[:, None] >= 1)) & (w >= min_p.float()[:, None])
    kept = keep.long().cumprod(dim=-1).sum(dim=-1, keepdim=True).clamp(min=1)
    floors = xs.gather(1, kept - 1)[:, 0]
    filtering = ((top_k > 0) & (top_k < n)) | (top_p < 1) | (min_p > 0)
    return torch.where(filtering & (xs[:, 0] > float("-inf")), floors, float("-inf"))


INT8_LEVELS = 127.0  # symmetric int8: -127 .. 127


def quantize_rows_int8(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Each row of ``x`` ``[rows, size]`` to int8 with a scale of its own (dynamic, per token):
    ``scale = max|x| / 127``, ``q = round(clamp(x * (127 / max|x|), -127, 127))`` to nearest
    even; a row of zeros gets scale 0. Returns ``(q int8 [rows, size], scale float32 [rows])``."""
    x = x.float()
    amax = x.abs().amax(dim=-1)
    # A true division (``127 / tensor`` would be a reciprocal times 127: rounded twice).
    levels = torch.full_like(amax, INT8_LEVELS)
    inverse = torch.where(amax > 0, levels / amax, torch.zeros_like(amax))
    q = torch.round((x * inverse[:, None]).clamp_(-INT8_LEVELS, INT8_LEVELS)).to(torch.int8)
    return q, amax / INT8_LEVELS


def dequantize_int32(
    products: torch.Tensor,
    row_scales: torch.Tensor,
    col_scales: torch.Tensor,
    bias: torch.Tensor | None,
    dtype: torch.dtype,
) -> torch.Tensor:
    """The int32 products ``[rows, cols]`` of an int8 GEMM back to ``dtype``:
    ``(products * row_scales[:, None]) * col_scales + bias``, in float32 (scales and bias
    float32)."""
    out = (products.float() * row_scales[:, None]) * col_scales
    if bias is not None:
        out += bias
    return out.to(dtype)
