"""What one `schedule()` call hands out (StepPlan), and how the scheduler records each
request of a step it scheduled (Scheduled), for the step's update and the grammar fill."""

from __future__ import annotations

from asyncllm.core.request import Request

# One request of a scheduled step, as it was when scheduled: the request, its computed
# tokens before the step, whether the step samples a token for it (it reaches the end
# of its tokens), and its preemption count (a later preemption voids the step's result).
Scheduled = tuple[Request, int, bool, int]


class StepPlan:
    """What one `schedule()` call has handed out so far: parallel lists, in batch order."""

    __slots__ = (
        "budget",
        "reqs",
        "num_tokens",
        "computed_before",
        "new_block_ids",
        "preempted",
        "drafts",
    )

    def __init__(self, budget: int) -> None:
        self.budget = budget  # tokens left this step
        self.reqs: list[Request] = []
        self.num_tokens: list[int] = []  # tokens each computes this step
        self.computed_before: list[int] = []  # tokens each had computed before
        # A running request's blocks new this step; None for one admitted from the
        # waiting queue this step (the runner gets all of its data).
        self.new_block_ids: list[list[list[int]] | None] = []
        self.preempted = False
        self.drafts: dict[str, list[int]] = {}  # request id -> the drafts it verifies

    def add(
        self, req: Request, n: int, num_computed: int, new_block_ids: list[list[int]] | None
    ) -> None:
        """`req` computes `n` tokens this step, after `num_computed`."""
        self.reqs.append(req)
        self.num_tokens.append(n)
        self.computed_before.append(num_computed)
        self.new_block_ids.append(new_block_ids)
        self.budget -= n

    def take_back(self, req: Request) -> None:
        """Undoes `add` for a request preempted later in the same step."""
        for i, r in enumerate(self.reqs):
            if r is req:
                self.budget += self.num_tokens[i]
                for column in (self.reqs, self.num_tokens, self.computed_before):
                    del column[i]
                del self.new_block_ids[i]
                self.drafts.pop(req.request_id, None)
                return
