"""Device steps (structured outputs with async scheduling on CUDA): the device hands the
grammar process a step's tokens through shared memory and waits for the next bitmask's
flag itself. Here on the CPU: the grammar process's side, with the test writing what
the device writes, and the engine's whole path with a runner whose handshake does on
the host what the device does (the CUDA stream operations are tested on the GPU)."""

from __future__ import annotations

import os
import re
import time

import numpy as np
import pytest

from asyncllm import LLM, SamplingParams, StructuredOutputsParams
from asyncllm.step_io import MASK_FLAG, TOKENS_FLAG, flag_reached
from tests.engine.test_structured_outputs import (
    CHOICES,
    PROMPT,
    REGEXES,
    SCHEMAS,
    _all_kinds,
    _check_json,
    _idle,
)

pytest.importorskip("xgrammar")
S = StructuredOutputsParams


def _flags(manager) -> np.ndarray:
    return manager.device_buffers()[1].numpy().view(np.uint32)


def test_a_device_step_gets_its_tokens_and_sets_its_flag_through_shared_memory():
    """The step waits in the grammar process until the tokens flag reaches its number,
    accepts the shared tokens after its other accepts (-1: that matcher takes none),
    names a refused token by its key, fills the bitmask (a row a stop token ended allows
    every token), then sets the mask flag. A job whose step never launched lets the
    process go on (`release_tokens`); a job that fails sets the mask flag itself, its
    rows allowing every token (a device waiting for them goes on)."""
    from transformers import AutoTokenizer

    from asyncllm.model.source import embedded_model_path
    from asyncllm.structured.grammar_process import GrammarProcessError
    from asyncllm.structured.manager import StructuredOutputManager

    path = str(embedded_model_path())
    tok = AutoTokenizer.from_pretrained(path)
    manager = StructuredOutputManager(path, vocab_size=len(tok), max_rows=4)
    try:
        a, b = (manager.request(S(regex=r"[0-9]+")) for _ in range(2))
        d, e = manager.request(S(regex=r"[0-9]")), manager.request(S(regex=r"[a-z]+"))
        for r in (a, d, e):
            r.future.result()
        assert a.ready() and b.ready() and d.ready() and e.ready()
        (seven,), (x,) = tok.encode("7"), tok.encode("x")
        stop = min(manager.stop_token_ids)
        assert manager.accept([("d", d, seven)]) == []  # (d may only end now)
        tokens, flags = manager.device_buffers()[0], _flags(manager)
        bitmask = manager.take_bitmask(3)[1]
        bitmask.fill_(0)
        rows = [(0, a), (1, b), (2, d)]
        ahead = [("b", b), ("e", e), ("d", d)]
        job = manager.start_fill(bitmask, rows, [("a", a, seven)], ahead, device=True)
        assert job.seq and job.ahead_keys is None
        # (the process waits for the flag: it has filled nothing)
        assert not flag_reached(int(flags[MASK_FLAG]), job.seq)
        assert (bitmask == 0).all()
        tokens[:3] = tokens.new_tensor([x, -1, stop])
        flags[TOKENS_FLAG] = job.seq  # (what the device writes last)
        assert job.wait() == ["b"]
        assert flag_reached(int(flags[MASK_FLAG]), job.seq)

        def allowed(row: int) -> list[int]:
            return [(int(bitmask[row, t // 32]) >> (t % 32)) & 1 for t in (seven, x)]

        assert allowed(0) == allowed(1) == [1, 0]
        assert (bitmask[2] == -1).all()  # (d ended: its row allows every token)

        bitmask.fill_(0)
        job = manager.start_fill(bitmask, [(0, e)], [], [("e", e)], device=True)
        job.release_tokens()  # (its step did not launch: e takes no token)
        assert job.wait() == [] and allowed(0) == [0, 1]

        job = manager.start_fill(bitmask, [(0, a)], [], [("a", a)], device=True)
        process = manager._process
        assert process is not None
        process.proc.kill()
        with pytest.raises(GrammarProcessError, match="has ended"):
            job.wait()
        assert flag_reached(int(flags[MASK_FLAG]), job.seq) and (bitmask[0] == -1).all()
    finally:
        manager.shutdown()


def _cpu_seconds(pid: int) -> float:
    """A process's CPU time (user and system) from /proc."""
    fields = open(f"/proc/{pid}/stat").read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


@pytest.mark.skipif(not os.path.exists("/proc/self/stat"), reason="needs /proc")
def test_a_device_step_waiting_for_its_tokens_does_not_hold_a_core():
    """The grammar process looks at the tokens flag between short naps. A device step's
    message comes about a step before its tokens (the device's forward runs meanwhile),
    so a process that spun would hold a core from the engine's step thread all along:
    over steps that wait 2 ms each for their tokens it uses a small share of one core."""
    from transformers import AutoTokenizer

    from asyncllm.model.source import embedded_model_path
    from asyncllm.structured.manager import StructuredOutputManager

    path = str(embedded_model_path())
    tok = AutoTokenizer.from_pretrained(path)
    manager = StructuredOutputManager(path, vocab_size=len(tok), max_rows=2)
    try:
        a = manager.request(S(regex=r"[0-9]+"))
        a.future.result()
        assert a.ready()  # (its matcher is made with the next message)
        bitmask = manager.take_bitmask(1)[1]
        tokens, flags = manager.device_buffers()[0], _flags(manager)
        cpu0 = t0 = 0.0
        for i in range(160):
            if i == 10:  # (after the process's start and first steps)
                process = manager._process
                assert process is not None
                cpu0, t0 = _cpu_seconds(process.proc.pid), time.monotonic()
            job = manager.start_fill(bitmask, [(0, a)], [], [("a", a)], device=True)
            time.sleep(0.002)  # (the device's forward, before its tokens)
            assert not flag_reached(int(flags[MASK_FLAG]), job.seq)
            tokens[:1] = -1  # (the matcher takes none)
            flags[TOKENS_FLAG] = job.seq
            assert job.wait() == []
        share = (_cpu_seconds(process.proc.pid) - cpu0) / (time.monotonic() - t0)
        assert share < 0.6, f"the waiting grammar process used {share:.0%} of a core"
    finally:
        manager.shutdown()


class HostHandshake:
    """The runner's GrammarHandshake, done on the host at once: the CPU's forward has
    run when the step's tokens are handed over, and the wait for the bitmask blocks."""

    def __init__(self) -> None:
        self.events: list[tuple[str, int]] = []

    def give_tokens(self, sync, sampled, rows, start=None) -> None:
        if start is not None:  # (the rows are in line: the runner says where they start)
            assert rows.tolist() == list(range(start, start + len(rows)))
        self.events.append(("tokens", sync.seq))
        if len(rows):
            sync.tokens[: len(rows)] = sampled.index_select(0, rows)
        sync.flags.numpy().view(np.uint32)[TOKENS_FLAG] = sync.seq

    def wait_for_masks(self, sync) -> None:
        flags = sync.flags.numpy().view(np.uint32)
        deadline = time.monotonic() + 60
        while not flag_reached(int(flags[MASK_FLAG]), sync.seq):
            assert time.monotonic() < deadline, "the grammar process never filled the bitmask"
            time.sleep(0.0001)
        self.events.append(("masks", sync.seq))

    def wait_on_host(self, sync) -> None:
        self.wait_for_masks(sync)


def test_device_steps_keep_every_constraint_and_match_the_host_steps():
    """An engine whose constrained steps are device steps (the runner's handshake on the
    host): every kind of constraint holds, beside unconstrained requests; greedy tokens
    equal those of the host steps; the engine ends idle with every block back, and each
    device step's answer was read (none left pending)."""
    with LLM(device="cpu", max_model_len=256, multiprocess=False) as llm:
        core = llm.engine.client.core
        runner = core.executor.worker.runner
        schemas, regexes = SCHEMAS[::4], REGEXES[::3]
        kinds, n = _all_kinds(), len(SCHEMAS)  # (these, a choice, a grammar, a free one)
        params = [kinds[i] for i in [*range(0, n, 4), *range(n, n + len(REGEXES), 3)]]
        params += kinds[-3:]
        host = llm.generate([PROMPT] * len(params), params, use_tqdm=False)
        assert core._device_steps is False
        core._device_steps = True
        runner.grammar.handshake = handshake = HostHandshake()
        syncs = []
        launch = core.executor.execute_model_async

        def logged(sched):
            if sched.grammar_seq:
                syncs.append(sched.grammar_seq)
            return launch(sched)

        core.executor.execute_model_async = logged
        device = llm.generate([PROMPT] * len(params), params, use_tqdm=False)
        texts = [o.outputs[0].text for o in device]
        for text, schema in zip(texts, schemas):
            _check_json(text, schema)
        for text, regex in zip(texts[len(schemas) :], regexes):
            assert re.fullmatch(regex, text), (regex, text)
        assert texts[-3] in CHOICES and re.fullmatch(r"The answer is [0-9]\.", texts[-2])
        assert [o.outputs[0].token_ids for o in device] == [o.outputs[0].token_ids for o in host]
        assert len(syncs) >= 10 and syncs == sorted(set(syncs))
        # each device step handed its tokens over, then waited for its bitmask
        assert handshake.events == [(kind, seq) for seq in syncs for kind in ("tokens", "masks")]
        assert not core.structured._pending
        _idle(llm)
        plain = SamplingParams(max_tokens=4, temperature=0.0)
        assert llm.generate([PROMPT], plain, use_tqdm=False)[0].outputs[0].token_ids

        # A device step of which the runner holds no request still hands its tokens
        # over (-1: none) and waits for its masks (the next step's tokens come after).
        import torch

        from asyncllm.step_io import CachedRequestData, GrammarSync, SchedulerOutput

        tokens, flags = torch.zeros(2, dtype=torch.int64), torch.zeros(32, dtype=torch.int32)
        flags[MASK_FLAG] = 7  # (the grammar process's answer, already in)
        ghost = SchedulerOutput([], CachedRequestData(), {"ghost": 1}, 1, set())
        ghost.grammar_seq, ghost.grammar_ahead_req_ids = 7, ["ghost"]

        class GhostMemory:  # (the runner finds the handshake's memory by the step's seq)
            def sync(self, seq, ahead_req_ids):
                return GrammarSync(seq, ahead_req_ids, tokens, flags)

        handshake.events.clear()
        memory, runner.grammar.memory = runner.grammar.memory, GhostMemory()
        try:
            assert not runner.execute_model_async(ghost).result().sampled_token_ids
        finally:
            runner.grammar.memory = memory
        assert handshake.events == [("tokens", 7), ("masks", 7)]
        assert tokens[0] == -1 and flags[TOKENS_FLAG] == 7

        # A launch that fails once the device's hand-over is queued (here: held back,
        # as a device behind its queue would be) leaves the tokens to the device: the
        # host sets no flag and writes no -1 over them.
        class QueuedHandshake(HostHandshake):
            def give_tokens(self, sync, sampled, rows, start=None) -> None:
                self.events.append(("queued", sync.seq))

        runner.grammar.handshake = queued = QueuedHandshake()
        run_model = runner._run_model

        def failing(*args, **kwargs):
            if queued.events:
                raise RuntimeError("the forward failed")
            return run_model(*args, **kwargs)

        runner._run_model = failing
        flags_np = _flags(core.structured)
        core.structured.device_buffers()[0].fill_(5)
        llm.engine.add_request("after", PROMPT, params[0])
        try:
            with pytest.raises(RuntimeError, match="the forward failed"):
                for _ in range(50):
                    core.step()
        finally:
            runner._run_model = run_model
        ((_, seq),) = queued.events
        assert not flag_reached(int(flags_np[TOKENS_FLAG]), seq)
        assert (core.structured.device_buffers()[0] == 5).all()
        flags_np[TOKENS_FLAG] = seq  # (what the device would write; the fill then answers)


def test_a_device_left_waiting_by_a_lost_grammar_process_is_let_go(monkeypatch):
    """The step's thread may be blocked behind the device (it reads no answer) while the
    device waits for a fill: the watchdog lets the device go if the grammar process
    dies, or leaves a device job unanswered past STEP_TIMEOUT_S (it is killed then). The
    job's rows allow every token, its mask flag is set, and waiting for it says the
    process was lost."""
    from transformers import AutoTokenizer

    from asyncllm.model.source import embedded_model_path
    from asyncllm.structured import grammar_process
    from asyncllm.structured.grammar_process import GrammarProcessError
    from asyncllm.structured.manager import StructuredOutputManager

    path = str(embedded_model_path())
    manager = StructuredOutputManager(path, vocab_size=len(AutoTokenizer.from_pretrained(path)))

    def let_go(job) -> None:
        deadline = time.monotonic() + 30
        while not flag_reached(int(_flags(manager)[MASK_FLAG]), job.seq):
            assert time.monotonic() < deadline, "the device was never let go"
            time.sleep(0.01)

    try:
        a = manager.request(S(regex=r"[0-9]+"))
        a.future.result()
        assert a.ready()
        bitmask = manager.take_bitmask(1)[1]
        bitmask.fill_(0)
        # (its tokens never come: the process waits for them)
        job = manager.start_fill(bitmask, [(0, a)], [], [("a", a)], device=True)
        process = manager._process
        assert process is not None
        process.proc.kill()
        let_go(job)
        assert (bitmask[0] == -1).all()
        with pytest.raises(GrammarProcessError, match="has ended"):
            job.wait()
        manager.reset()

        monkeypatch.setattr(grammar_process, "STEP_TIMEOUT_S", 1.0)
        b = manager.request(S(regex=r"[0-9]+"))
        assert b.ready()  # (a new process)
        bitmask.fill_(0)
        job = manager.start_fill(bitmask, [(0, b)], [], [("b", b)], device=True)
        hung = manager._process
        assert hung is not None and hung is not process
        let_go(job)
        assert hung.proc.wait(timeout=10) is not None  # (killed)
        assert (bitmask[0] == -1).all()
        with pytest.raises(GrammarProcessError):
            job.wait()
    finally:
        manager.shutdown()


def test_a_device_step_whose_runner_lacks_a_constrained_request_gathers_on_the_host(
    monkeypatch,
):
    """Two constrained requests join a batch of constrained requests that decode (the
    step is a device step); the runner cannot take the first of the two, so its masks
    are not the runner's rows in order. The step waits on the host for its masks
    (`wait_on_host`), gathers the rows of the requests the runner holds, and each of
    them keeps its constraint; the lacking request alone fails, and every block comes
    back."""
    from asyncllm.errors import RequestFailedError

    regex = r"([0-9]{2}-){6}[0-9]{2}"
    params = SamplingParams(temperature=0.0, max_tokens=40, structured_outputs=S(regex=regex))

    class OnHost(HostHandshake):
        def wait_on_host(self, sync) -> None:
            self.events.append(("on host", sync.seq))
            super().wait_on_host(sync)

    letters = params.clone(structured_outputs=S(regex=r"[a-z]{30}"))
    with LLM(device="cpu", max_model_len=256, multiprocess=False) as llm:
        core, engine = llm.engine.client.core, llm.engine
        runner = core.executor.worker.runner
        for p in (params, letters):  # (both grammars compiled: no request waits for one)
            llm.generate([PROMPT], p.clone(max_tokens=1), use_tqdm=False)
        core._device_steps = True
        runner.grammar.handshake = handshake = OnHost()
        check = runner._check_new_request

        def refuse_bad(new) -> None:
            if new.req_id == "bad":
                raise ValueError("refused by the test")
            check(new)

        monkeypatch.setattr(runner, "_check_new_request", refuse_bad)
        for rid in ("a", "b"):
            engine.add_request(rid, PROMPT, params)
        texts: dict[str, str] = {}
        failed: list[str] = []

        def step() -> None:
            try:
                for out in engine.step():
                    if out.finished:
                        texts[out.request_id] = out.outputs[0].text
            except RequestFailedError as e:
                failed.append(str(e))

        for _ in range(3):  # (a and b decode, a token in flight each step)
            step()
        assert not texts and ("tokens", core.structured._seq) in handshake.events
        # (admitted in one step, in this order; bad's row would let c write letters)
        engine.add_request("bad", PROMPT, letters)
        engine.add_request("c", PROMPT, params)
        while engine.has_unfinished_requests():
            step()
        assert any(kind == "on host" for kind, _ in handshake.events)
        assert len(failed) == 1 and "could not take it" in failed[0], failed
        assert sorted(texts) == ["a", "b", "c"]
        for text in texts.values():
            assert re.fullmatch(regex, text), text
        _idle(llm)
