"""Chained hashes of full KV blocks: one key for the prefix cache, KV transfer and routing.

A block's hash covers its parent's hash and its own token ids, so equal hashes mean equal prefixes.
blake2b (not Python's ``hash``) keeps the value identical across processes and machines.
"""

from __future__ import annotations

import hashlib
from array import array
from collections.abc import Sequence

ROOT_HASH = 0


def hash_block(parent_hash: int, token_ids: Sequence[int]) -> int:
    """The 63-bit chained hash of one full block (fits a signed int64 in protobuf and Redis)."""
    digest = hashlib.blake2b(
        parent_hash.to_bytes(8, "little") + array("q", token_ids).tobytes(), digest_size=8
    ).digest()
    return int.from_bytes(digest, "little") >> 1


def hash_full_blocks(
    token_ids: Sequence[int], block_size: int, known: Sequence[int] = ()
) -> list[int]:
    """Hashes of every full block of ``token_ids``, reusing the already ``known`` leading ones."""
    hashes = list(known)
    parent = hashes[-1] if hashes else ROOT_HASH
    for start in range(len(hashes) * block_size, len(token_ids) - block_size + 1, block_size):
        parent = hash_block(parent, token_ids[start : start + block_size])
        hashes.append(parent)
    return hashes
