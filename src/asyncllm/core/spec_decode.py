"""The scheduler's speculative decoding (`SchedulerConfig.speculative`): which requests
draft, how many drafts a decoding request gets in a step, and what a verifying step
gives back. The scheduler allocates, records and applies the steps; this decides.

A request speculates if fewer than `disable_by_batch_size` requests were in the engine
when it was added (decided once, for its life). A constrained request's drafts are
checked by its grammar with its step's bitmask (core/grammar_fill.py). No request drafts
in a step while that many are running: verifying drafts would cost more than they
save. Outputs never depend on either: verification keeps a draft only where it equals
the token the model samples there.
"""

from __future__ import annotations

from asyncllm.config import SpeculativeConfig
from asyncllm.core.ngram_proposer import NgramProposer
from asyncllm.core.request import Request
from asyncllm.messages import SchedulerStats

# The most decode steps a request drafts nothing after its drafts were all rejected.
MAX_DRAFT_BACKOFF = 32
NO_CAP = 1 << 30


class Speculation:
    def __init__(self, config: SpeculativeConfig, max_model_len: int) -> None:
        self.limit = config.disable_by_batch_size
        self.max_model_len = max_model_len
        self.proposer = NgramProposer(
            config.prompt_lookup_min, config.prompt_lookup_max, config.num_speculative_tokens
        )

    def admit(self, request: Request, num_requests: int) -> None:
        """Decides, once, whether `request` (added beside `num_requests`) speculates."""
        request.speculates = num_requests < self.limit

    def forget(self, request: Request) -> None:
        if request.speculates:
            self.proposer.forget(request.request_id)

    def drafts(self, req: Request, pending: int, budget: int, num_running: int) -> list[int]:
        """A decoding request's draft tokens for this step (see core/ngram_proposer.py):
        none while the batch is at the limit or the request backs off; no more than its
        cap, the budget left after its own token, its max_tokens after this step's token,
        or max_model_len allow. With its last token still in flight (async scheduling),
        the lookup runs over the tokens known and skips the one it predicts for that
        token: the drafts follow it. (Verification is exact either way: a draft after
        a wrongly predicted token is simply rejected.)"""
        if not req.speculates or num_running >= self.limit:
            return []
        if req.draft_pause:
            req.draft_pause -= 1
            return []
        room = min(
            req.draft_cap,
            budget - 1,
            req.max_tokens - len(req.output_token_ids) - pending - 1,
            self.max_model_len - req.num_tokens - pending - 1,
        )
        if room <= 0:
            return []
        return self.proposer.propose(req.request_id, req.all_token_ids, room, skip=pending)

    def verified(
        self,
        req: Request,
        num_tokens: int,
        computed_before: int,
        num_drafts: int,
        stats: SchedulerStats,
    ) -> None:
        """A request that verified `num_drafts` drafts got `num_tokens` back: the drafts
        the model agreed with and one token of its own. The positions of the rejected
        drafts were computed in vain (their slots are written again by the next step),
        so its computed tokens end after the accepted ones. (It is not scheduled while
        in flight: nothing came after.) Its next drafts adapt: after a partial
        acceptance at most one more than it kept; after a rejection of all, none for 1,
        2, 4, ... MAX_DRAFT_BACKOFF decode steps (then one draft), until drafts are kept
        again."""
        if not 1 <= num_tokens <= 1 + num_drafts:
            return  # (nothing sampled: the step's update handles it as it is)
        req.num_computed_tokens = computed_before + num_tokens
        kept = num_tokens - 1
        stats.spec_num_accepted_tokens += kept
        if kept == 0:  # (all rejected: draft nothing for a while, longer each time)
            req.draft_backoff = min(max(1, 2 * req.draft_backoff), MAX_DRAFT_BACKOFF)
            req.draft_pause, req.draft_cap = req.draft_backoff, 1
        else:
            req.draft_backoff = 0
            req.draft_cap = kept + 1 if kept < num_drafts else NO_CAP
