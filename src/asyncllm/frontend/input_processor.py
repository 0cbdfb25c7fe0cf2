"""Turns a user's prompt and sampling params into a validated engine-core request.

Everything that can be wrong with a request is caught here, with an error naming the
field, before the engine sees it: a bad request never harms the others.
"""

from __future__ import annotations

import time
from typing import Any

from asyncllm.messages import EngineCoreRequest, ResolvedConfig
from asyncllm.request_checks import check_params_for_model, check_prompt_token_ids
from asyncllm.sampling_params import INT64_MAX, INT64_MIN, SamplingParams

PromptType = str | list[int] | dict[str, Any]


def check_token_ids(ids: Any, vocab_size: int | None) -> list[int]:
    """`ids` as a list of token ids in [0, vocab_size): TypeError or ValueError naming
    the first that is not (any number of them, none included)."""
    if not isinstance(ids, list | tuple) or not all(type(t) is int for t in ids):
        raise TypeError("token ids must be a list of int")
    bad = [t for t in ids if t < 0 or (vocab_size is not None and t >= vocab_size)]
    if bad:
        raise ValueError(f"token id {bad[0]} is outside the vocabulary [0, {vocab_size})")
    return list(ids)


def vocab_max_token_bytes(vocab: dict[str, int]) -> int:
    """The longest entry of a vocabulary, in UTF-8 bytes (at least 1)."""
    return max((len(t.encode("utf-8")) for t in vocab), default=1)


class InputProcessor:
    def __init__(self, config: ResolvedConfig, tokenizer: Any | None) -> None:
        self.config = config
        self.tokenizer = tokenizer
        self.max_model_len = config.max_model_len
        self.vocab_size = config.vocab_size
        gen_eos = config.eos_token_id
        if tokenizer is not None and tokenizer.eos_token_id is not None:
            gen_eos = tokenizer.eos_token_id
        self.eos_token_id: int | None = gen_eos
        self._max_token_bytes: int | None = None  # read from the vocabulary when needed

    def max_token_bytes(self) -> int:
        """An upper bound on the bytes of text one token covers: the longest entry of the
        vocabulary in UTF-8 (a byte-level or SentencePiece entry spells each byte it
        covers with at least one byte)."""
        if self._max_token_bytes is None:
            known = getattr(self.tokenizer, "max_token_bytes", None)  # (ProcessTokenizer)
            if isinstance(known, int):
                self._max_token_bytes = known
            else:
                vocab = self.tokenizer.get_vocab() if self.tokenizer is not None else {}
                self._max_token_bytes = vocab_max_token_bytes(vocab)
        return self._max_token_bytes

    def _refuse_if_surely_too_long(self, text: str) -> None:
        """Refuses, without tokenizing it, text too long for any tokenization to fit:
        more bytes than max_model_len tokens of the longest entry could cover."""
        if len(text) <= self.max_model_len:
            return  # (at least a byte a token: it may fit)
        nbytes = len(text.encode("utf-8", "surrogatepass"))
        limit = self.max_model_len * self.max_token_bytes()
        if nbytes > limit:
            raise ValueError(
                f"prompt is {nbytes} bytes of text: more than max_model_len={self.max_model_len} "
                f"tokens of at most {self.max_token_bytes()} bytes each can hold"
            )

    def tokenize_prompt(self, prompt: PromptType) -> tuple[str | None, list[int]]:
        """(prompt text or None, token ids) for any accepted prompt form."""
        result = self.tokenize_prompts([prompt])[0]
        if isinstance(result, Exception):
            raise result
        return result

    def tokenize_prompts(
        self, prompts: list[PromptType]
    ) -> list[tuple[str | None, list[int]] | Exception]:
        """`tokenize_prompt` of each prompt, the texts in one tokenizer call; a bad prompt
        gets its ValueError/TypeError in its place and does not affect the others."""
        results: list[tuple[str | None, list[int]] | Exception | None] = [None] * len(prompts)
        texts: list[str] = []
        where: list[int] = []
        for i, prompt in enumerate(prompts):
            try:
                text, ids = self._resolve(prompt)
            except (ValueError, TypeError) as e:
                results[i] = e
                continue
            if ids is None:
                texts.append(text)  # type: ignore[arg-type]
                where.append(i)
            else:
                results[i] = (text, ids)
        if texts:
            assert self.tokenizer is not None  # (_resolve refuses text without one)
            try:
                encoded: list[Any] = self.tokenizer(texts, add_special_tokens=True).input_ids
            except Exception:
                if len(texts) == 1:
                    raise
                encoded = [self._encode_one(text) for text in texts]  # to find which failed
            for i, text, ids in zip(where, texts, encoded):
                try:
                    if isinstance(ids, Exception):
                        raise ids
                    results[i] = (text, self._check_ids(ids))
                except Exception as e:
                    results[i] = e
        return results  # type: ignore[return-value]

    def _encode_one(self, text: str) -> list[int] | Exception:
        assert self.tokenizer is not None
        try:
            return list(self.tokenizer(text, add_special_tokens=True).input_ids)
        except Exception as e:
            return e

    def _resolve(self, prompt: PromptType) -> tuple[str | None, list[int] | None]:
        """(text, checked ids), or (text, None) for text that still needs tokenizing."""
        if isinstance(prompt, dict):
            unknown = set(prompt) - {"prompt", "prompt_token_ids"}
            if unknown:
                raise ValueError(f"prompt dict has unknown keys {sorted(unknown)}")
            if "prompt_token_ids" in prompt:
                return prompt.get("prompt"), self._check_ids(prompt["prompt_token_ids"])
            if "prompt" in prompt:
                return self._resolve(prompt["prompt"])
            raise ValueError("prompt dict needs 'prompt' or 'prompt_token_ids'")
        if isinstance(prompt, str):
            if not prompt:
                raise ValueError("prompt must not be empty")
            if self.tokenizer is None:
                raise ValueError(
                    "prompt is text but the tokenizer was skipped (skip_tokenizer_init)"
                )
            self._refuse_if_surely_too_long(prompt)
            return prompt, None
        if isinstance(prompt, list | tuple):
            return None, self._check_ids(prompt)
        raise TypeError(
            f"prompt must be a str, a list of token ids or a dict, got {type(prompt).__name__}"
        )

    def _check_ids(self, ids: Any) -> list[int]:
        return check_prompt_token_ids(ids, self.vocab_size, self.max_model_len)

    def check_params(self, params: Any) -> SamplingParams:
        if params is None:
            return SamplingParams()
        if not isinstance(params, SamplingParams):
            raise TypeError(
                f"sampling_params must be a SamplingParams, got {type(params).__name__}"
            )
        check_params_for_model(params, self.vocab_size, self.config.max_logprobs)
        if params.stop and self.tokenizer is None:
            raise ValueError("stop strings need the tokenizer (skip_tokenizer_init is set)")
        if params.structured_outputs is not None and self.tokenizer is None:
            # (the core checks whether the constraint can be enforced)
            raise ValueError("structured_outputs need the tokenizer (skip_tokenizer_init is set)")
        return params

    def process(
        self,
        request_id: str,
        prompt: PromptType,
        params: SamplingParams,
        priority: int = 0,
        prompt_ids: list[int] | None = None,
    ) -> EngineCoreRequest:
        if not isinstance(request_id, str) or not request_id:
            raise TypeError("request_id must be a non-empty str")
        if not isinstance(priority, int) or isinstance(priority, bool):
            raise TypeError(f"priority must be an int, got {type(priority).__name__}")
        if not INT64_MIN <= priority <= INT64_MAX:
            what = priority if abs(priority).bit_length() <= 100 else "a larger int"
            raise ValueError(f"priority must fit in int64 ([-2**63, 2**63 - 1]), got {what}")
        if prompt_ids is None:
            _, prompt_ids = self.tokenize_prompt(prompt)
        return EngineCoreRequest(
            request_id=request_id,
            prompt_token_ids=prompt_ids,
            sampling_params=params,
            eos_token_id=self.eos_token_id,
            max_tokens=params.max_tokens,
            arrival_time=time.monotonic(),
            priority=priority,
        )
