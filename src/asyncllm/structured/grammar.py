"""A request's StructuredOutputsParams as an xgrammar grammar, and its cache key.

`check()` runs when a request is submitted (in the frontend, and again in the core):
a schema, regex or grammar xgrammar cannot build or enforce raises ValueError naming
the field, so no request runs with a constraint that is silently ignored.
"""

from __future__ import annotations

import functools
import json
import re
from typing import Any

from asyncllm.sampling_params import StructuredOutputsParams

GrammarKey = tuple[str, str, bool]
_LOG_PREFIX = re.compile(
    r"^\[[^\]]*\]\s*\S+:\d+:\s*"
)  # xgrammar's "[time] file.cc:94: "  # (kind, its text, any whitespace)


def xgrammar_module() -> Any:
    try:
        import xgrammar
    except ImportError as e:
        raise ValueError(
            "structured_outputs needs the xgrammar package: pip install 'asyncllm[structured]'"
        ) from e
    return xgrammar


def grammar_key(so: StructuredOutputsParams) -> GrammarKey:
    """What identifies the compiled grammar: equal keys share one compilation."""
    ws = not so.disable_any_whitespace
    if so.json is not None:
        # (not sorted: the properties' order is the order they are generated in)
        text = so.json if isinstance(so.json, str) else json.dumps(so.json)
        return ("json", text, ws)
    if so.regex is not None:
        return ("regex", so.regex, False)
    if so.choice is not None:
        return (
            "grammar",
            "root ::= " + " | ".join(json.dumps(c, ensure_ascii=False) for c in so.choice),
            False,
        )
    if so.grammar is not None:
        return ("grammar", so.grammar, False)
    return ("json_object", "", ws)


def build_grammar(key: GrammarKey) -> Any:
    """The xgrammar Grammar for `key`; ValueError naming the field if it cannot be built."""
    xgr = xgrammar_module()
    kind, text, ws = key
    field = {"json": "json", "regex": "regex", "grammar": "grammar", "json_object": "json"}[kind]
    try:
        if kind == "json":
            json.loads(text)  # (a clear error for text that is not JSON at all)
            return xgr.Grammar.from_json_schema(text, any_whitespace=ws, strict_mode=True)
        if kind == "json_object":
            return xgr.Grammar.from_json_schema('{"type": "object"}', any_whitespace=ws)
        if kind == "regex":
            return xgr.Grammar.from_regex(text)
        return xgr.Grammar.from_ebnf(text)
    except (RuntimeError, ValueError, TypeError) as e:
        text = str(e).strip()
        message = _LOG_PREFIX.sub("", text.splitlines()[0]) if text else type(e).__name__
        raise ValueError(f"structured_outputs.{field} cannot be enforced: {message}") from None


def check(so: StructuredOutputsParams) -> None:
    """ValueError unless the constraint is well-formed and xgrammar can enforce it (a
    key that passed is remembered: a batch of requests with one schema builds it once)."""
    so.verify()
    _check_key(grammar_key(so))


@functools.lru_cache(maxsize=256)
def _check_key(key: GrammarKey) -> None:
    build_grammar(key)  # (a key that fails raises, and is not remembered)
