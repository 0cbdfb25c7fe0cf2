"""The steps an engine makes of a workload: its own scheduler, run with no model.

Every request ignores EOS and ends at its max_tokens, so the steps depend only on the
lengths, the scheduler's settings and the KV blocks, never on what a model samples: the
scheduler here is the engine's (`core/scheduler.py`), fed a made-up token wherever a step
samples. With async scheduling two steps are in flight, as in the engine core (the
next is scheduled before the last one's tokens are in).

Each step is recorded as what its cost depends on (`asyncllm.bench.roofline.step_cost`):
per request, the tokens it computes and the keys they attend to afterwards (prefix-cache
hits included), and how many requests sample.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass

from asyncllm.config import SchedulerConfig
from asyncllm.core.kv_cache_manager import KVCacheManager
from asyncllm.core.kv_cache_utils import BlockHasher
from asyncllm.core.request import Request
from asyncllm.core.scheduler import Scheduler
from asyncllm.model.kv_groups import KVCacheLayout
from asyncllm.sampling_params import SamplingParams
from asyncllm.step_io import ModelRunnerOutput, SchedulerOutput


@dataclass(frozen=True)
class PlannedStep:
    """One step: per scheduled request (in batch order), (tokens computed, keys after)."""

    rows: tuple[tuple[int, int], ...]
    sampled: int  # requests that sample a token

    @property
    def num_tokens(self) -> int:
        return sum(q for q, _ in self.rows)


@dataclass(frozen=True)
class WorkloadPlan:
    steps: list[PlannedStep]
    num_blocks: int
    num_preemptions: int
    prefix_cache_hits: int  # tokens


def blocks_for_all(
    prompts: Sequence[Sequence[int]], max_tokens: Sequence[int], block_size: int
) -> int:
    """KV blocks for every request at its full length at once (no preemption ever)."""
    return 1 + sum(-(-(len(p) + m) // block_size) for p, m in zip(prompts, max_tokens))


def plan_workload(
    prompts: Sequence[Sequence[int]],
    max_tokens: Sequence[int],
    config: SchedulerConfig,
    *,
    block_size: int = 16,
    num_blocks: int | None = None,
    enable_prefix_caching: bool = True,
    layout: KVCacheLayout | None = None,
    vocab_size: int = 32_000,
) -> WorkloadPlan:
    """The steps the scheduler makes of the requests (all queued at once, in order).
    `num_blocks` None: enough blocks for every request at its full length."""
    if len(prompts) != len(max_tokens):
        raise ValueError(f"{len(prompts)} prompts but {len(max_tokens)} max_tokens")
    if any(m < 1 for m in max_tokens):
        raise ValueError("every max_tokens must be at least 1")
    if num_blocks is None:
        num_blocks = blocks_for_all(prompts, max_tokens, block_size)
    kv = KVCacheManager(num_blocks, block_size, config.max_model_len, enable_prefix_caching, layout)
    scheduler = Scheduler(config, kv)
    hasher = BlockHasher(block_size) if enable_prefix_caching else None
    for i, (prompt, m) in enumerate(zip(prompts, max_tokens)):
        params = SamplingParams(max_tokens=m, ignore_eos=True)
        scheduler.add_request(
            Request(
                str(i), list(prompt), params, None, m, arrival_time=float(i), block_hasher=hasher
            )
        )
    depth = 2 if config.async_scheduling else 1
    in_flight: deque[tuple[SchedulerOutput, ModelRunnerOutput]] = deque()
    steps: list[PlannedStep] = []
    while scheduler.has_unfinished_requests() or in_flight:
        while scheduler.has_unfinished_requests() and len(in_flight) < depth:
            sched = scheduler.schedule()
            if sched.total_num_scheduled_tokens == 0:
                break
            steps.append(_record(scheduler, sched))
            in_flight.append((sched, _made_up_tokens(scheduler, sched, vocab_size)))
        if not in_flight:
            raise RuntimeError(
                f"the scheduler cannot go on with {num_blocks} KV blocks of {block_size} tokens "
                "(a request longer than the cache?)"
            )
        scheduler.update_from_output(*in_flight.popleft())
        errors = scheduler.take_error_outputs()
        if errors:
            raise RuntimeError(f"the scheduler refused a request: {errors[0]}")
    return WorkloadPlan(steps, num_blocks, scheduler.stats.num_preemptions, kv.stats.hits)


def _record(scheduler: Scheduler, sched: SchedulerOutput) -> PlannedStep:
    rows = tuple(
        (n, scheduler.requests[rid].num_computed_tokens)
        for rid, n in sched.num_scheduled_tokens.items()
    )
    return PlannedStep(rows, len(scheduler.sampling_requests(sched)))


def _made_up_tokens(scheduler: Scheduler, sched: SchedulerOutput, vocab: int) -> ModelRunnerOutput:
    """A token for each request that samples, distinct per request and position (so no
    two requests' outputs match in the prefix cache by chance)."""
    sampled = {}
    for rid in scheduler.sampling_requests(sched):
        req = scheduler.requests[rid]
        sampled[rid] = [(int(rid) * 1_000_003 + req.num_tokens * 7_919) % vocab]
    return ModelRunnerOutput(sampled_token_ids=sampled)
