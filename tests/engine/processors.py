"""A user logits processor loaded by import path in the tests."""

from __future__ import annotations

import torch

from asyncllm.sample.logits_processor import LogitsProcessor


class ForceToken(LogitsProcessor):
    """Requests with extra_args={'force_token': t} can only produce token t."""

    def __init__(self, vocab_size: int, device: torch.device) -> None:
        super().__init__(vocab_size, device)
        self.forced: dict[int, int] = {}

    def is_argmax_invariant(self) -> bool:
        return False

    def add_request(self, row, params, prompt_ids, output_ids) -> None:
        token = (params.extra_args or {}).get("force_token")
        if token is not None:
            self.forced[row] = int(token)

    def remove_request(self, row: int) -> None:
        self.forced.pop(row, None)

    def apply(self, logits: torch.Tensor, rows: list[int]) -> torch.Tensor:
        for i, row in enumerate(rows):
            if row in self.forced:
                keep = logits[i, self.forced[row]].clone()
                logits[i] = float("-inf")
                logits[i, self.forced[row]] = keep
        return logits


class NotAProcessor:
    pass


class NoRepeat(LogitsProcessor):
    """Requests with extra_args={'no_repeat': True} never repeat their last output token:
    it reads the live output ids, so it sees every token sampled before this step."""

    def __init__(self, vocab_size: int, device: torch.device) -> None:
        super().__init__(vocab_size, device)
        self.outputs: dict[int, list[int]] = {}

    def is_argmax_invariant(self) -> bool:
        return False

    def add_request(self, row, params, prompt_ids, output_ids) -> None:
        if (params.extra_args or {}).get("no_repeat"):
            self.outputs[row] = output_ids

    def remove_request(self, row: int) -> None:
        self.outputs.pop(row, None)

    def apply(self, logits: torch.Tensor, rows: list[int]) -> torch.Tensor:
        for i, row in enumerate(rows):
            out = self.outputs.get(row)
            if out:
                logits[i, out[-1]] = float("-inf")
        return logits


class CycleTokens(LogitsProcessor):
    """Requests with extra_args={'cycle': [a, b, ...]} produce the cycle's token at their
    output position's place in it (a bias of 1e4): what it gives depends on how many
    tokens the request has produced, read from the live output ids."""

    def __init__(self, vocab_size: int, device: torch.device) -> None:
        super().__init__(vocab_size, device)
        self.requests: dict[int, tuple[list[int], list[int]]] = {}

    def is_argmax_invariant(self) -> bool:
        return False

    def add_request(self, row, params, prompt_ids, output_ids) -> None:
        cycle = (params.extra_args or {}).get("cycle")
        if cycle:
            self.requests[row] = ([int(t) for t in cycle], output_ids)

    def remove_request(self, row: int) -> None:
        self.requests.pop(row, None)

    def apply(self, logits: torch.Tensor, rows: list[int]) -> torch.Tensor:
        for i, row in enumerate(rows):
            if row in self.requests:
                cycle, out = self.requests[row]
                logits[i, cycle[len(out) % len(cycle)]] += 1e4
        return logits


class RecordLogits(LogitsProcessor):
    """Changes nothing; keeps each logits row it sees (float32, on the host), keyed by
    the request's prompt and how many tokens it had produced: two engines' logits for
    the same positions can then be compared."""

    def __init__(self, vocab_size: int, device: torch.device) -> None:
        super().__init__(vocab_size, device)
        self.requests: dict[int, tuple[tuple[int, ...], list[int]]] = {}
        self.logits: dict[tuple[tuple[int, ...], int], torch.Tensor] = {}

    def is_argmax_invariant(self) -> bool:
        return False  # (so that greedy steps call it too)

    def add_request(self, row, params, prompt_ids, output_ids) -> None:
        self.requests[row] = (tuple(prompt_ids), output_ids)

    def remove_request(self, row: int) -> None:
        self.requests.pop(row, None)

    def apply(self, logits: torch.Tensor, rows: list[int]) -> torch.Tensor:
        host = logits.float().cpu()
        for i, row in enumerate(rows):
            prompt, output = self.requests[row]
            self.logits[(prompt, len(output))] = host[i].clone()
        return logits


class ForgetsBadly(LogitsProcessor):
    """Raises on forgetting a row it never tracked (a common bug in user processors)."""

    def __init__(self, vocab_size: int, device: torch.device) -> None:
        super().__init__(vocab_size, device)
        self.rows: dict[int, bool] = {}

    def is_argmax_invariant(self) -> bool:
        return True

    def add_request(self, row, params, prompt_ids, output_ids) -> None:
        if (params.extra_args or {}).get("tracked"):
            self.rows[row] = True

    def remove_request(self, row: int) -> None:
        del self.rows[row]

    def apply(self, logits: torch.Tensor, rows: list[int]) -> torch.Tensor:
        return logits


class BoostInPlace(LogitsProcessor):
    """extra_args={'boost': t}: adds 2.5 to token t's logit, in place; {'boom': True}:
    raises when applied (its request fails, the batch is sampled row by row)."""

    def __init__(self, vocab_size: int, device: torch.device) -> None:
        super().__init__(vocab_size, device)
        self.boost: dict[int, int] = {}
        self.boom: set[int] = set()

    def is_argmax_invariant(self) -> bool:
        return False

    def add_request(self, row, params, prompt_ids, output_ids) -> None:
        args = params.extra_args or {}
        if "boost" in args:
            self.boost[row] = int(args["boost"])
        if args.get("boom"):
            self.boom.add(row)

    def remove_request(self, row: int) -> None:
        self.boost.pop(row, None)
        self.boom.discard(row)

    def apply(self, logits: torch.Tensor, rows: list[int]) -> torch.Tensor:
        for i, row in enumerate(rows):
            if row in self.boom:
                raise RuntimeError("boom")
            if row in self.boost:
                logits[i, self.boost[row]] += 2.5
        return logits
