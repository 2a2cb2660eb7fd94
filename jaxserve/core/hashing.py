"""Stable, chained hashes of KV blocks for the prefix cache.

A full block's hash covers its parent's hash, its token ids and extra keys (the
request's `cache_salt` on the first block), so equal hashes mean equal prefixes. The
hash is BLAKE2b (stable across processes, unlike Python's randomized `hash`).
"""

from __future__ import annotations

import hashlib
from array import array
from collections.abc import Sequence

BlockHash = bytes


def hash_block_tokens(parent: BlockHash | None, token_ids: Sequence[int],
                      extra_key: str | None = None) -> BlockHash:
    h = hashlib.blake2b(digest_size=16)
    h.update(parent or b"\x00" * 16)
    h.update(array("q", token_ids).tobytes())
    if extra_key is not None:
        h.update(b"\x01salt:")
        h.update(extra_key.encode("utf-8"))
    return h.digest()
