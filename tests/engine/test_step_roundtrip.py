"""What the engine core hands its executor is plain data: every SchedulerOutput of a real
run (prefill chunks beside decodes, constrained rows, preempted and finished requests)
goes through the step wire (engine/serial.py's StepEncoder) and back, and the decoded
copy, run on a second model runner (its own persistent batch and KV cache, the same
weights and the structured manager's shared memory, found by index), gives the same
tokens as the original; so does the runner's output through the wire."""

from __future__ import annotations

import re

import pytest

from asyncllm import LLM, SamplingParams, StructuredOutputsParams
from asyncllm.engine.serial import StepDecoder, StepEncoder, StepKind
from asyncllm.step_io import ModelRunnerOutput, SchedulerOutput

pytest.importorskip("xgrammar")


def test_a_runs_steps_go_through_the_wire_and_run_the_same():
    from asyncllm.worker.model_runner import ModelRunner

    # A small KV pool (preemptions) and a small token budget (prefill chunks beside
    # decodes); one step at a time, so each bitmask is filled before its launch.
    with LLM(
        device="cpu",
        max_model_len=64,
        multiprocess=False,
        async_scheduling=False,
        num_gpu_blocks_override=5,
        max_num_batched_tokens=32,
    ) as llm:
        core = llm.engine.client.core
        runner = core.executor.worker.runner
        shadow = ModelRunner(runner.config)
        shadow.model = runner.model  # (the same weights, its own batch and cache)
        shadow.initialize_kv_cache(core.num_blocks)
        shadow.grammar.memory = runner.grammar.memory
        encoder, decoder = StepEncoder(), StepDecoder()
        launch = core.executor.execute_model_async
        seen: list[SchedulerOutput] = []
        compared = 0

        def through_the_wire(sched):
            nonlocal compared
            frames = encoder.encode(sched)
            assert all(isinstance(f, bytes | memoryview) for f in frames)
            kind, copy = decoder.decode([bytes(f) for f in frames])
            assert kind is StepKind.SCHEDULER_OUTPUT and copy == sched and copy is not sched
            mirrored = shadow.execute_model(copy)
            future = launch(sched)
            result = future.result

            def compared_result() -> ModelRunnerOutput:
                nonlocal compared
                out = result()
                assert mirrored.sampled_token_ids == out.sampled_token_ids, sched
                assert mirrored.failed == out.failed
                _, back = decoder.decode([bytes(f) for f in encoder.encode(out)])
                assert back == out
                compared += 1
                return out

            future.result = compared_result
            seen.append(copy)
            return future

        run_now = core.executor.execute_model

        def forget_through_the_wire(sched):  # (a step with only ids to forget)
            _, copy = decoder.decode([bytes(f) for f in encoder.encode(sched)])
            shadow.execute_model(copy)
            return run_now(sched)

        core.executor.execute_model_async = through_the_wire
        core.executor.execute_model = forget_through_the_wire
        digits = StructuredOutputsParams(regex=r"[0-9]{8}")
        params = [
            SamplingParams(max_tokens=10, temperature=0.0, structured_outputs=digits),
            SamplingParams(max_tokens=10, temperature=0.0, ignore_eos=True),
            SamplingParams(
                max_tokens=6,
                temperature=0.0,
                structured_outputs=StructuredOutputsParams(choice=["sunny", "rainy"]),
            ),
            SamplingParams(max_tokens=10, temperature=0.8, seed=7, ignore_eos=True),
            SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True),
        ]
        topics = ["a person", "a city", "the weather", "a river", "a number"]  # (no shared prefix)
        prompts = [
            f"{t.capitalize()}: tell me about {t}, in the format asked. " * 2 for t in topics
        ]
        try:
            outs = llm.generate(prompts, params, use_tqdm=False)
        finally:
            del core.executor.execute_model_async, core.executor.execute_model
        assert re.fullmatch(r"[0-9]{8}", outs[0].outputs[0].text), outs[0].outputs[0]
        assert outs[2].outputs[0].text in ("sunny", "rainy")
        assert compared == len(seen) > 0
        assert core.scheduler.stats.num_preemptions > 0, core.scheduler.stats

        def mixed(s: SchedulerOutput) -> bool:
            return s.num_prefill_tokens > 0 and s.num_decode_tokens > 0

        admitted: dict[str, int] = {}
        for s in seen:
            for n in s.scheduled_new_reqs:
                admitted[n.req_id] = admitted.get(n.req_id, 0) + 1
        assert max(admitted.values()) > 1, "no preempted request came back"
        assert any(mixed(s) and s.structured_req_ids for s in seen)
        assert any(s.finished_req_ids for s in seen)
        assert all(s.grammar_buffer in (0, 1) for s in seen if s.structured_req_ids)
