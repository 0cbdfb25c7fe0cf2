"""Block hashes: each full block's hash chains its parent's hash and its token ids.

sha256 over a fixed byte encoding, so hashes are the same in every process and run
(Python's `hash()` is salted per process and collides far too easily).
"""

from __future__ import annotations

import hashlib
from array import array
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from asyncllm.core.request import Request

BlockHash = bytes
ROOT_HASH: BlockHash = hashlib.sha256(b"asyncllm/kv-block-root/v1").digest()


def hash_block_tokens(parent: BlockHash | None, token_ids: Sequence[int]) -> BlockHash:
    """The hash of one block: equal hashes mean equal token prefixes up to the block's
    end, because the parent's hash (ROOT_HASH for the first block) is chained in."""
    h = hashlib.sha256(parent or ROOT_HASH)
    h.update(array("q", token_ids).tobytes())
    return h.digest()


def make_block_hasher(block_size: int) -> Callable[[Request], list[BlockHash]]:
    """A hasher for `Request`: it returns the hashes of the request's full blocks that
    `request.block_hashes` does not cover yet (usually none), for the request to append."""

    def hasher(request: Request) -> list[BlockHash]:
        start = len(request.block_hashes)
        if len(request.all_token_ids) < (start + 1) * block_size:
            return []  # no new full block (most steps)
        parent = request.block_hashes[-1] if start else None
        new = []
        tokens = request.all_token_ids
        for i in range(start, len(tokens) // block_size):
            parent = hash_block_tokens(parent, tokens[i * block_size : (i + 1) * block_size])
            new.append(parent)
        return new

    return hasher
