"""Detokenization from a table of each token's bytes, for byte-level BPE tokenizers
(GPT-2's scheme: SmolLM2, Llama 3, Qwen, Mistral's Tekken and most current models).

Decoding such a tokenizer is the concatenation of its tokens' bytes, read as UTF-8 with
each invalid sequence replaced by U+FFFD: the table is all a host needs to turn tokens
into text, with no tokenizer object at all (building one holds the GIL 100-200 ms).
The tokenizer process (`tokenizer_process`) builds the table where the tokenizer is; the
host decodes with it.
"""

from __future__ import annotations

import json
from typing import Any


def _byte_level_chars() -> dict[str, int]:
    """GPT-2's byte-level alphabet: the character each byte is spelled with, inverted.
    Printable Latin-1 bytes stand for themselves; the others (controls, space, ...)
    take the code points from 256 on, in byte order."""
    direct = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1)]
    direct += range(ord("®"), ord("ÿ") + 1)
    chars = {chr(b): b for b in direct}
    extra = 0
    for b in range(256):
        if b not in direct:
            chars[chr(256 + extra)] = b
            extra += 1
    return chars


def _is_byte_level(decoder: dict[str, Any] | None) -> bool:
    if decoder is None:
        return False
    if decoder.get("type") == "Sequence":
        parts = decoder.get("decoders") or []
        return bool(parts) and all(_is_byte_level(d) for d in parts)
    return decoder.get("type") == "ByteLevel"


def byte_table(tokenizer: Any) -> tuple[list[bytes], list[int]] | None:
    """(each id's bytes, the special ids) of a transformers fast tokenizer whose decoding
    is byte-level BPE and nothing else; None for any other tokenizer. A token spelled
    wholly in the byte-level alphabet stands for those bytes; any other (an added token
    such as "<|im_start|>" written with a space) for its own UTF-8, as the tokenizers
    library's decoder has it."""
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is None or getattr(tokenizer, "clean_up_tokenization_spaces", False):
        return None
    spec = json.loads(backend.to_str())
    if not _is_byte_level(spec.get("decoder")):
        return None
    chars = _byte_level_chars()
    table: list[bytes] = []
    size = max(backend.get_vocab(with_added_tokens=True).values(), default=-1) + 1
    for i in range(size):  # (ids may have gaps: a count of tokens could fall short)
        token = backend.id_to_token(i)
        if token is None:
            table.append(b"")
            continue
        try:
            table.append(bytes([chars[c] for c in token]))
        except KeyError:
            table.append(token.encode("utf-8"))
    special = sorted(t["id"] for t in spec.get("added_tokens", []) if t.get("special"))
    return table, special


class ByteTableDecoder:
    """`decode(ids, skip_special_tokens)` from the table: the same text as the tokenizer's
    own decoding (ids it does not know are skipped, as there)."""

    def __init__(self, table: list[bytes], special: list[int]) -> None:
        self.table = table
        self.special = frozenset(special)

    def token_bytes(self, ids: list[int], skip_special_tokens: bool = False) -> bytes:
        table, n = self.table, len(self.table)
        if ids and (min(ids) < 0 or max(ids) >= n):
            ids = [i for i in ids if 0 <= i < n]
        if skip_special_tokens and self.special:
            special = self.special
            return b"".join([table[i] for i in ids if i not in special])
        return b"".join([table[i] for i in ids])

    def decode(self, ids: list[int], skip_special_tokens: bool = False) -> str:
        return self.token_bytes(ids, skip_special_tokens).decode("utf-8", "replace")
