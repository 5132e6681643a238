"""Chained hashes of full KV blocks: one key for the prefix cache, KV transfer and routing.

A block's hash covers its parent's hash and its own token ids, so equal hashes mean equal prefixes.
blake2b (not Python's ``hash``) keeps the value identical across processes and machines.

A request's ``cache_salt`` (a tenant's secret, or a key derived from its API key) goes into the
first block's hash, so every block of a salted prompt differs from the same tokens' blocks under
another salt or none: one tenant's cached blocks are never another's hits, nor can it find out
that they exist. The salt is appended after the block's fixed-size token bytes, so a salted
block's input never equals an unsalted one's.
"""

from __future__ import annotations

import hashlib
from array import array
from collections.abc import Sequence

ROOT_HASH = 0
MAX_CACHE_SALT_CHARS = 256  # what a request may carry (the router and the engine check it)


def hash_block(parent_hash: int, token_ids: Sequence[int], salt: str | None = None) -> int:
    """The 63-bit chained hash of one full block (fits a signed int64 in protobuf and Redis);
    ``salt`` only for a prompt's first block."""
    data = parent_hash.to_bytes(8, "little") + array("q", token_ids).tobytes()
    if salt is not None:
        data += b"\x00cache_salt\x00" + salt.encode("utf-8")
    digest = hashlib.blake2b(data, digest_size=8).digest()
    return int.from_bytes(digest, "little") >> 1


def hash_full_blocks(
    token_ids: Sequence[int],
    block_size: int,
    known: Sequence[int] = (),
    salt: str | None = None,
) -> list[int]:
    """Hashes of every full block of ``token_ids``, reusing the already ``known`` leading ones;
    ``salt`` (the request's ``cache_salt``) is mixed into the first block's hash."""
    hashes = list(known)
    parent = hashes[-1] if hashes else ROOT_HASH
    for start in range(len(hashes) * block_size, len(token_ids) - block_size + 1, block_size):
        block_salt = salt if start == 0 else None
        parent = hash_block(parent, token_ids[start : start + block_size], block_salt)
        hashes.append(parent)
    return hashes


def check_cache_salt(salt: str | None) -> None:
    """ValueError unless ``salt`` is None or a non-empty text of at most MAX_CACHE_SALT_CHARS."""
    if salt is None:
        return
    if not isinstance(salt, str) or not salt:
        raise ValueError("cache_salt must be a non-empty string")
    if len(salt) > MAX_CACHE_SALT_CHARS:
        raise ValueError(f"cache_salt must be at most {MAX_CACHE_SALT_CHARS} characters")
