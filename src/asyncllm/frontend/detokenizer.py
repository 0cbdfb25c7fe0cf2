"""Incremental detokenization and stop strings.

Text is produced by decoding a short window of tokens (from `prefix_offset`) and
emitting what the newest tokens added beyond the window's older part. A window that
decodes to a trailing U+FFFD is an unfinished UTF-8 character: nothing is emitted
until the next tokens complete it, so the replacement character never reaches users.
"""

from __future__ import annotations

from typing import Any

_CONTEXT = 5  # prompt tokens of context, so the first output token's spacing is right


class IncrementalDetokenizer:
    def __init__(
        self,
        tokenizer: Any,
        prompt_token_ids: list[int],
        skip_special_tokens: bool = True,
        stop: list[str] | None = None,
        include_stop_str_in_output: bool = False,
    ) -> None:
        self.tokenizer = tokenizer
        self.skip_special_tokens = skip_special_tokens
        self.stop = stop or []
        self.include_stop = include_stop_str_in_output
        self.tokens = list(prompt_token_ids[-_CONTEXT:])
        self.prefix_offset = 0
        self.read_offset = len(self.tokens)
        self.output_text = ""
        self.stop_string: str | None = None  # the stop string that ended the text

        # The Rust tokenizer directly (10x cheaper per call than the Python wrapper) when
        # the wrapper would add nothing (no clean-up of tokenization spaces).
        backend = getattr(tokenizer, "backend_tokenizer", None)
        if backend is not None and not getattr(tokenizer, "clean_up_tokenization_spaces", False):
            self._decoder = backend
        else:
            self._decoder = tokenizer

    def _decode(self, ids: list[int]) -> str:
        return self._decoder.decode(ids, skip_special_tokens=self.skip_special_tokens)

    def update(self, new_token_ids: list[int]) -> str | None:
        """Adds tokens; returns the stop string if one now ends the text."""
        for token in new_token_ids:
            self.tokens.append(token)
            prefix = self._decode(self.tokens[self.prefix_offset : self.read_offset])
            full = self._decode(self.tokens[self.prefix_offset :])
            if len(full) > len(prefix) and not full.endswith("\ufffd"):
                before = len(self.output_text)
                self.output_text += full[len(prefix) :]
                self.prefix_offset, self.read_offset = self.read_offset, len(self.tokens)
                if self.stop and self._check_stop(before):
                    return self.stop_string
        return None

    def _check_stop(self, new_from: int) -> bool:
        longest = max(len(s) for s in self.stop)
        start = max(0, new_from - longest + 1)
        best: tuple[int, str] | None = None
        for s in self.stop:
            i = self.output_text.find(s, start)
            if i != -1 and (best is None or i < best[0]):
                best = (i, s)
        if best is None:
            return False
        i, s = best
        self.output_text = self.output_text[: i + len(s) if self.include_stop else i]
        self.stop_string = s
        return True

    def holdback(self) -> int:
        """Characters at the end that may start a stop string: not shown until known."""
        if not self.stop or self.stop_string is not None:
            return 0
        text = self.output_text
        best = 0
        for s in self.stop:
            for k in range(min(len(s) - 1, len(text)), best, -1):
                if text.endswith(s[:k]):
                    best = k
                    break
        return best
