"""Block hashes: each full block's hash chains its parent's hash and its token ids.

sha256 over a fixed byte encoding, so hashes are the same in every process and run
(Python's `hash()` is salted per process and collides far too easily).
"""

from __future__ import annotations

import hashlib
from array import array
from collections.abc import Sequence
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


class BlockHasher:
    """A hasher for `Request`: called, it returns the hashes of the request's full blocks
    that `request.block_hashes` does not cover yet (usually none), for the request to
    append. A request calls it only once its tokens reach the next block's end
    (`block_size` tells it where that is)."""

    def __init__(self, block_size: int) -> None:
        self.block_size = block_size

    def __call__(self, request: Request) -> list[BlockHash]:
        bs = self.block_size
        start = len(request.block_hashes)
        tokens = request.all_token_ids
        if len(tokens) < (start + 1) * bs:
            return []  # no new full block
        parent = request.block_hashes[-1] if start else None
        new = []
        for i in range(start, len(tokens) // bs):
            parent = hash_block_tokens(parent, tokens[i * bs : (i + 1) * bs])
            new.append(parent)
        return new
