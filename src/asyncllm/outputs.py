"""What a request gives back: RequestOutput with one CompletionOutput per sample."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class Logprob:
    logprob: float
    rank: int  # 1 = the most likely token
    decoded_token: str | None = None


# One dict per position: token id -> Logprob (the sampled/prompt token plus the top-n).
PositionLogprobs = dict[int, Logprob]


@dataclass
class ToolCall:
    """One tool call a model made, as OpenAI's API gives it: `arguments` is JSON text."""

    id: str
    name: str
    arguments: str
    type: str = "function"


@dataclass
class CompletionOutput:
    index: int
    text: str
    token_ids: list[int]
    cumulative_logprob: float | None = None
    logprobs: list[PositionLogprobs] | None = None
    finish_reason: str | None = None  # "stop", "length", "abort" or None while running
    stop_reason: int | str | None = None  # the stop token id or stop string that ended it
    delta: str = ""  # text since the previous output of this request
    # chat with tools: the calls parsed from the finished text (which keeps the rest)
    tool_calls: list[ToolCall] | None = None

    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclass
class RequestOutput:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    finished: bool
    prompt_logprobs: list[PositionLogprobs | None] | None = None
    num_cached_tokens: int = 0
    metrics: dict[str, float] = field(default_factory=dict)
