"""Loading a model's Hugging Face tokenizer, one way for every process that needs it.

`AutoTokenizer.from_pretrained` reads the model's config to choose a class, and that
import chain pulls in torch: about 3 s of CPU on a 2-core machine, against 0.9 s for
building the same tokenizer directly. Where the folder's tokenizer_config.json names
transformers' generic fast tokenizer (what converted and most recent checkpoints name),
that class is built directly; any other goes through AutoTokenizer.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

# transformers' generic tokenizer over a tokenizer.json (5.x's name, and 4.x's)
GENERIC_TOKENIZER_CLASSES = frozenset({"TokenizersBackend", "PreTrainedTokenizerFast"})


def tokenizer_class_named(path: str) -> str | None:
    """The class a local folder's tokenizer_config.json names; None for a hub id, a
    folder without one, or a file that cannot be read."""
    try:
        fields = json.loads((Path(path) / "tokenizer_config.json").read_text())
    except (OSError, ValueError):
        return None
    name = fields.get("tokenizer_class") if isinstance(fields, dict) else None
    return name if isinstance(name, str) else None


def load_hf_tokenizer(path: str) -> Any:
    """The tokenizer AutoTokenizer would build for `path` (a folder or a hub id)."""
    if tokenizer_class_named(path) in GENERIC_TOKENIZER_CLASSES:
        from transformers import PreTrainedTokenizerFast  # (no torch)

        return PreTrainedTokenizerFast.from_pretrained(path)
    from transformers import AutoTokenizer  # imported when needed: it takes seconds

    return AutoTokenizer.from_pretrained(path)
