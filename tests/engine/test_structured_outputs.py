"""Structured outputs on the embedded SmolLM2 (CPU): JSON schemas, regexes, choices and
grammars hold for every output, greedy and seeded, with async scheduling on and off,
under preemption, with n = 3, and through AsyncLLM with cancellations; bad constraints
are refused for their request only."""

from __future__ import annotations

import asyncio
import json
import random
import re

import pytest

from asyncllm import LLM, RequestOutputKind, SamplingParams, StructuredOutputsParams

pytest.importorskip("xgrammar")
jsonschema = pytest.importorskip("jsonschema")

S = StructuredOutputsParams
NAME = {"type": "string", "maxLength": 12}
SCHEMAS = [
    {"type": "object", "properties": {"name": NAME}, "required": ["name"], "additionalProperties": False},
    {"type": "object", "properties": {"age": {"type": "integer", "minimum": 0, "maximum": 120}}, "required": ["age"], "additionalProperties": False},
    {"type": "object", "properties": {"color": {"enum": ["red", "green", "blue"]}}, "required": ["color"], "additionalProperties": False},
    {"type": "object", "properties": {"ok": {"type": "boolean"}}, "required": ["ok"], "additionalProperties": False},
    {"type": "object", "properties": {"tags": {"type": "array", "items": NAME, "maxItems": 3}}, "required": ["tags"], "additionalProperties": False},
    {"type": "object", "properties": {"x": {"type": "number", "minimum": -10, "maximum": 10}}, "required": ["x"], "additionalProperties": False},
    {"type": "object", "properties": {"p": {"type": "object", "properties": {"first": NAME, "last": NAME}, "required": ["first", "last"], "additionalProperties": False}}, "required": ["p"], "additionalProperties": False},
    {"type": "array", "items": {"type": "integer", "minimum": 0, "maximum": 9}, "maxItems": 4},
    {"type": "object", "properties": {"city": NAME, "zip": {"type": "string", "pattern": "^[0-9]{5}$"}}, "required": ["city", "zip"], "additionalProperties": False},
    {"type": "object", "properties": {"level": {"type": "integer", "enum": [1, 2, 3]}}, "required": ["level"], "additionalProperties": False},
    {"type": "object", "properties": {"title": NAME, "year": {"type": "integer", "minimum": 1900, "maximum": 2100}}, "required": ["title", "year"], "additionalProperties": False},
    {"type": "object", "properties": {"items": {"type": "array", "items": {"type": "object", "properties": {"id": {"type": "integer", "minimum": 0, "maximum": 99}}, "required": ["id"], "additionalProperties": False}, "maxItems": 2}}, "required": ["items"], "additionalProperties": False},
    {"type": "object", "properties": {"answer": {"type": "string", "enum": ["yes", "no"]}, "why": NAME}, "required": ["answer", "why"], "additionalProperties": False},
    {"type": "object", "properties": {"score": {"type": "number", "minimum": 0, "maximum": 1}}, "required": ["score"], "additionalProperties": False},
    {"type": "object", "properties": {"a": {"type": "integer", "minimum": 0, "maximum": 5}, "b": {"type": "integer", "minimum": 0, "maximum": 5}}, "required": ["a", "b"], "additionalProperties": False},
    {"type": "string", "maxLength": 16},
    {"type": "integer", "minimum": 10, "maximum": 20},
    {"type": "object", "properties": {"flags": {"type": "array", "items": {"type": "boolean"}, "maxItems": 3}, "name": NAME}, "required": ["flags", "name"], "additionalProperties": False},
    {"type": "object", "properties": {"m": {"type": "object", "properties": {"n": {"type": "object", "properties": {"v": {"type": "integer", "minimum": 0, "maximum": 3}}, "required": ["v"], "additionalProperties": False}}, "required": ["n"], "additionalProperties": False}}, "required": ["m"], "additionalProperties": False},
    {"type": "object", "properties": {"unit": {"enum": ["kg", "g"]}, "value": {"type": "integer", "minimum": 0, "maximum": 1000}}, "required": ["unit", "value"], "additionalProperties": False},
]  # fmt: skip
REGEXES = [
    r"\d{3}-\d{4}",
    r"[a-z]{3,8}",
    r"(yes|no|maybe)",
    r"[A-Z][a-z]{2,6} [A-Z][a-z]{2,6}",
    r"0x[0-9a-f]{4}",
    r"\d{4}-\d{2}-\d{2}",
    r"(red|green|blue)-\d",
    r"[a-z]{2,8}@[a-z]{2,8}\.com",
    r"\(\d{2}\)",
    r"v\d\.\d\.\d",
]
CHOICES = ["sunny", "rainy", "cloudy"]
GRAMMAR = 'root ::= "The answer is " digit "."\ndigit ::= [0-9]'
PROMPT = "Answer in the requested format. Tell me about a person, a city or a number."


def _json_params(schema, **kw):
    return SamplingParams(**{"max_tokens": 64, **kw}, structured_outputs=S(json=schema))


def _check_json(text: str, schema) -> None:
    jsonschema.validate(json.loads(text), schema)


GREEDY: dict[bool, list[list[int]]] = {}  # async_scheduling -> the first test's token ids


@pytest.fixture(scope="module")
def sync_engine():
    """An engine without async scheduling, its core in this process (the shared engine
    covers the core's own process)."""
    with LLM(device="cpu", max_model_len=512, async_scheduling=False, multiprocess=False) as llm:
        yield llm


@pytest.fixture(scope="module")
def inproc_engine():
    """An engine with async scheduling, its core in this process."""
    with LLM(device="cpu", max_model_len=256, multiprocess=False) as llm:
        yield llm


def _digits(n: int, max_tokens: int) -> SamplingParams:
    return SamplingParams(
        max_tokens=max_tokens, temperature=0.0, structured_outputs=S(regex=f"[0-9]{{{n}}}")
    )


def _run_until_done(core, outs: dict, steps: int = 200) -> None:
    for _ in range(steps):
        if not core.has_unfinished_requests() and not core.has_pending_outputs():
            return
        for o in core.step().outputs:
            outs.setdefault(o.request_id, []).append(o)
    raise AssertionError(f"requests still unfinished after {steps} steps: {outs.keys()}")


@pytest.fixture(scope="module", params=[True, False], ids=["async", "sync"])
def engine(request):
    """The suite's shared engine (async scheduling, its default), or one without."""
    llm = request.getfixturevalue("llm" if request.param else "sync_engine")
    assert _async(llm) == request.param
    return llm


def _async(llm: LLM) -> bool:
    return llm.engine.config.async_scheduling


def _all_kinds() -> list[SamplingParams]:
    params = [_json_params(s, temperature=0.0) for s in SCHEMAS]
    params += [
        SamplingParams(max_tokens=32, temperature=0.0, structured_outputs=S(regex=r))
        for r in REGEXES
    ]
    params.append(
        SamplingParams(max_tokens=8, temperature=0.0, structured_outputs=S(choice=CHOICES))
    )
    params.append(
        SamplingParams(max_tokens=16, temperature=0.0, structured_outputs=S(grammar=GRAMMAR))
    )
    params.append(SamplingParams(max_tokens=24, temperature=0.0))  # unconstrained beside them
    return params


def check_all_kinds(texts: list[str]) -> None:
    """Each text of `_all_kinds()`'s requests holds its constraint."""
    for text, schema in zip(texts, SCHEMAS):
        _check_json(text, schema)
    for text, regex in zip(texts[len(SCHEMAS) :], REGEXES):
        assert re.fullmatch(regex, text), (regex, text)
    assert texts[-3] in CHOICES
    assert re.fullmatch(r"The answer is [0-9]\.", texts[-2])


def _idle(llm: LLM) -> None:
    stats = llm.engine.get_stats()
    assert stats["num_running"] == 0 and stats["num_waiting"] == 0
    assert stats["num_free_blocks"] == stats["num_blocks"]


def test_twenty_schemas_ten_regexes_a_choice_and_a_grammar(engine):
    params = _all_kinds()
    outs = engine.generate([PROMPT] * len(params), params, use_tqdm=False)
    check_all_kinds([o.outputs[0].text for o in outs])
    assert all(o.outputs[0].finish_reason == "stop" for o in outs[:-1])
    GREEDY[_async(engine)] = [o.outputs[0].token_ids for o in outs]
    _idle(engine)


def test_seeded_sampling_n3_and_logprobs_stay_valid(engine):
    schema = SCHEMAS[10]
    params = _json_params(schema, temperature=1.0, seed=7, n=3, logprobs=2)
    outs = engine.generate([PROMPT], params, use_tqdm=False)[0].outputs
    assert len(outs) == 3
    for c in outs:
        _check_json(c.text, schema)
        assert len(c.logprobs) == len(c.token_ids)
    again = engine.generate([PROMPT], params, use_tqdm=False)[0].outputs
    assert [c.token_ids for c in again] == [c.token_ids for c in outs]  # seeded


def test_max_tokens_still_ends_early(engine):
    out = engine.generate(
        [PROMPT], _json_params(SCHEMAS[6], temperature=0.0, max_tokens=3), use_tqdm=False
    )
    c = out[0].outputs[0]
    assert c.finish_reason == "length" and len(c.token_ids) == 3


def test_min_tokens_yields_to_a_grammar_at_its_end(engine):
    """A grammar that is complete allows only its end: min_tokens, which blocks the end
    tokens, then leaves nothing, and the row stops rather than draw a token at random
    (which the grammar would refuse). Before the grammar's end, min_tokens holds."""
    short = [
        SamplingParams(max_tokens=12, min_tokens=6, temperature=t, seed=3, structured_outputs=S(choice=["yes", "no"]))
        for t in (0.0, 1.0)
    ]  # fmt: skip
    free = SamplingParams(max_tokens=8, min_tokens=8, temperature=0.0)
    outs = engine.generate([PROMPT] * 3, [*short, free], use_tqdm=False)
    for out in outs[:2]:
        c = out.outputs[0]
        assert c.text in ("yes", "no") and c.finish_reason == "stop", (c.text, c.finish_reason)
    assert len(outs[2].outputs[0].token_ids) == 8


def test_bad_constraints_fail_alone_and_the_engine_serves_on(engine):
    for so, field in [
        (S(regex="(unclosed"), "regex"),
        (S(json={"type": "no-such-type"}), "json"),
        (S(json="{not json"), "json"),
        (S(grammar="root ::= missing_rule"), "grammar"),
    ]:
        with pytest.raises(ValueError, match=f"structured_outputs.{field}"):
            engine.generate([PROMPT], SamplingParams(structured_outputs=so), use_tqdm=False)
    with pytest.raises(ValueError, match="exactly one"):
        S(regex="a", choice=["a"]).verify()
    with pytest.raises(ValueError, match="exactly one"):
        SamplingParams(structured_outputs=S())
    plain = SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True)
    out = engine.generate([PROMPT], plain, use_tqdm=False)
    assert len(out[0].outputs[0].token_ids) == 4
    _idle(engine)


def test_greedy_equal_with_async_scheduling_on_and_off():
    """The first test's greedy outputs under both modes (run here if it did not run)."""
    for mode in (True, False):
        if mode not in GREEDY:
            llm = LLM(device="cpu", max_model_len=512, async_scheduling=mode)
            try:
                outs = llm.generate([PROMPT] * len(_all_kinds()), _all_kinds(), use_tqdm=False)
                GREEDY[mode] = [o.outputs[0].token_ids for o in outs]
            finally:
                llm.shutdown()
    assert GREEDY[True] == GREEDY[False]


def test_preemption_with_a_tiny_kv_cache():
    """Three constrained requests, each needing most of a 4-block cache: they preempt
    one another (their grammars roll back with them) and each still ends valid."""
    llm = LLM(
        device="cpu",
        multiprocess=False,
        max_model_len=64,
        num_gpu_blocks_override=4,
        block_size=16,
        enable_prefix_caching=False,
    )
    word = {"type": "string", "maxLength": 4}
    two = {
        "type": "object",
        "properties": {"a": word, "b": word},
        "required": ["a", "b"],
        "additionalProperties": False,
    }
    try:
        prompts = [f"{PROMPT} Request number {i} of three, give two words." for i in range(3)]
        params = [_json_params(two, temperature=0.0, max_tokens=32)] * 3
        outs = llm.generate(prompts, params, use_tqdm=False)
        for o in outs:
            _check_json(o.outputs[0].text, two)
        assert llm.engine.get_stats()["num_preemptions"] > 0
        _idle(llm)
    finally:
        llm.shutdown()


@pytest.mark.asyncio(loop_scope="session")
async def test_64_concurrent_streams_with_cancellations(allm):
    rng = random.Random(0)
    llm = allm

    async def one(i: int):
        constrained = i % 2 == 0
        schema = SCHEMAS[i % len(SCHEMAS)]
        params = SamplingParams(
            max_tokens=24,
            temperature=0.8,
            seed=i,
            output_kind=RequestOutputKind.DELTA,
            structured_outputs=S(json=schema) if constrained else None,
        )
        text, finish = "", None
        cancel_after = rng.randint(1, 4) if rng.random() < 0.3 else None
        seen = 0
        async for out in llm.generate(PROMPT, params):
            text += out.outputs[0].text
            finish = out.outputs[0].finish_reason
            seen += 1
            if cancel_after is not None and seen >= cancel_after:
                return None  # leaves the stream: aborted in the engine
        if constrained and finish == "stop":
            _check_json(text, schema)
        return finish

    results = await asyncio.gather(*[one(i) for i in range(64)])
    assert any(r is None for r in results) and any(r == "stop" for r in results)
    for _ in range(600):  # (waits for a condition: the aborts reach the core)
        stats = await llm.get_stats()
        if stats["num_running"] == 0 and stats["num_free_blocks"] == stats["num_blocks"]:
            break
        await asyncio.sleep(0.05)
    assert stats["num_running"] == 0 and stats["num_waiting"] == 0
    assert stats["num_free_blocks"] == stats["num_blocks"]


def test_a_grammar_that_fails_in_the_core_ends_only_its_request(sync_engine, monkeypatch):
    """A request straight to the core whose regex cannot be enforced is refused by the
    core's admission check; one that gets past it (the check skipped here) and cannot
    compile gets an error output; so does one whose matcher refuses a token it sampled
    (made to, here: the mask never allows such a token); the request beside them
    finishes, and every block comes back."""
    import time

    import asyncllm.engine.core as engine_core
    from asyncllm.messages import EngineCoreRequest
    from asyncllm.structured.manager import FillJob

    wait = FillJob.wait

    def refusing_wait(self):  # (a step's accepts: their keys are the requests)
        refused = wait(self)
        return refused + [req for req in self._keys if req.request_id == "refused"]

    monkeypatch.setattr(FillJob, "wait", refusing_wait)
    core = sync_engine.engine.client.core

    def request(rid, so):
        params = SamplingParams(max_tokens=8, temperature=0.0, structured_outputs=so)
        return EngineCoreRequest(rid, [1, 2, 3, 4], params, 2, 8, time.monotonic())

    with pytest.raises(ValueError, match="structured_outputs.regex cannot be enforced"):
        core.add_request(request("bad", S(regex="(unclosed")))
    monkeypatch.setattr(engine_core, "check_structured", lambda so: None)
    core.add_request(request("bad", S(regex="(unclosed")))
    core.add_request(request("good", S(choice=CHOICES)))
    core.add_request(request("refused", S(choice=CHOICES)))
    outs: dict[str, list] = {"bad": [], "good": [], "refused": []}
    for _ in range(200):
        if not core.has_unfinished_requests():
            break
        for o in core.step().outputs:
            outs[o.request_id].append(o)
    assert outs["bad"][-1].error is not None and "compiled" in outs["bad"][-1].error.message
    assert outs["good"][-1].finish_reason == "stop" and outs["good"][-1].error is None
    refused = outs["refused"][-1]
    assert refused.error is not None and "breaks its grammar" in refused.error.message
    assert core.kv_cache_manager.num_free_blocks == core.num_blocks


def test_the_bitmask_masks_what_a_plain_loop_says():
    import torch

    from asyncllm.sample.ops import apply_token_bitmask

    gen = torch.Generator().manual_seed(0)
    vocab, rows = 70, 3  # (70 tokens: three words, the last one partly used)
    bitmask = torch.randint(-(2**31), 2**31 - 1, (rows, 3), generator=gen, dtype=torch.int64)
    bitmask = bitmask.to(torch.int32)
    logits = torch.randn(5, vocab, generator=gen)
    expected = logits.clone()
    target = [4, 0, 2]
    for i, row in enumerate(target):
        for t in range(vocab):
            word = int(bitmask[i, t // 32]) & 0xFFFFFFFF
            if not (word >> (t % 32)) & 1:
                expected[row, t] = float("-inf")
    apply_token_bitmask(logits, torch.tensor(target), bitmask)
    assert torch.equal(logits, expected)


def test_a_bitmask_buffer_is_written_again_only_after_its_copy_ran():
    """The scheduler's two bitmask buffers alternate, named to the runner by index;
    before one is given to a new step, the manager waits (through the executor's
    `wait_bitmask_copied`) for the event the runner recorded after copying it for its
    last step, unless it has run (a step the runner copied synchronously has none)."""
    from asyncllm.structured.manager import StructuredOutputManager

    waited: list[str] = []

    class Copied:
        def __init__(self, name: str, done: bool = False) -> None:
            self.name, self.done = name, done

        def query(self) -> bool:
            return self.done

        def synchronize(self) -> None:
            waited.append(self.name)

    copied: list = [None, None]  # (the runner's, by buffer)

    def wait_bitmask_copied(k: int) -> None:  # (as GrammarRows.wait_bitmask_copied)
        if copied[k] is not None and not copied[k].query():
            copied[k].synchronize()

    manager = StructuredOutputManager(None, vocab_size=70)
    manager.wait_bitmask_copied = wait_bitmask_copied
    k, a = manager.take_bitmask(2)
    assert a.shape == (2, 3) and k == 0
    assert manager.memory().bitmask(k, 2).data_ptr() == a.data_ptr()  # (the runner's view)
    copied[0] = Copied("first")
    assert manager.take_bitmask(2)[0] == 1  # (the other buffer: nothing to wait for)
    assert waited == []
    k, again = manager.take_bitmask(2)  # the first buffer, after its copy
    assert waited == ["first"] and k == 0 and again.data_ptr() == a.data_ptr()
    copied[1] = None  # its last step was copied synchronously
    manager.take_bitmask(2)
    assert waited == ["first"]
    copied[0] = Copied("third", done=True)
    manager.take_bitmask(2)  # (its copy has run: nothing to wait for)
    assert waited == ["first"]
    manager.shutdown()


def test_a_constrained_request_decodes_every_step(llm):
    """With async scheduling (the shared engine's default), a constrained request gets
    a token each step (the step after a token in flight is launched first and masked
    once that token is in), not one every other step."""
    engine = llm
    assert _async(engine)
    before = engine.get_stats()["num_steps"]
    params = SamplingParams(
        temperature=0.0, max_tokens=16, structured_outputs=S(regex=r"[0-9]{12}")
    )
    (out,) = engine.generate([PROMPT], params, use_tqdm=False)
    n = len(out.outputs[0].token_ids)
    assert re.fullmatch(r"[0-9]{12}", out.outputs[0].text) and n >= 6, out.outputs[0]
    # one prefill step (its first token), then one step per further token; every other
    # step would take 2n - 1
    assert engine.get_stats()["num_steps"] - before <= n + 1


def test_the_next_fill_starts_before_a_steps_results_are_applied(inproc_engine):
    """With async scheduling, the matchers get a step's tokens (and the next mask's
    fill starts, in the grammar process) before the scheduler applies that step, and
    before the step whose masks they are is launched: each constrained token is accepted
    once, and before its update. The fill is sent as soon as its step is scheduled,
    before the fill in flight is waited for, and its tokens follow before the step's
    launch. Requests that end by
    their grammar (a choice, a regex) and by max_tokens keep their constraints."""
    from asyncllm.structured.manager import FillJob

    llm = inproc_engine
    core = llm.engine.client.core
    events: list[tuple[str, list[int]]] = []
    start_fill, update = core.structured.start_fill, core.scheduler.update_from_output
    plan, launch = core.scheduler.plan_grammar_fill, core.executor.execute_model_async
    give_tokens, wait = FillJob.give_tokens, FillJob.wait
    # ("plan" | "launch", id of the step) and ("tokens" | "wait", id of the step whose
    # fill gets the tokens ahead of it | is waited for)
    order: list[tuple[str, int]] = []
    steps = []  # (kept alive: their ids stay theirs)
    step_of: dict[int, int] = {}  # id(job) -> id(its step)

    def logged_plan(sched, *args, **kwargs):
        steps.append(sched)
        order.append(("plan", id(sched)))
        job = plan(sched, *args, **kwargs)
        if job is not None:
            steps.append(job)
            step_of[id(job)] = id(sched)
        return job

    def logged_launch(sched):
        if sched.grammar_bitmask_later:
            order.append(("launch", id(sched)))
        return launch(sched)

    def logged_start_fill(bitmask, rows, accepts, *args):
        events.append(("accept", [t for _, _, t in accepts]))
        return start_fill(bitmask, rows, accepts, *args)

    def logged_give_tokens(job, tokens):
        events.append(("accept", [t for toks in tokens for t in toks]))
        order.append(("tokens", step_of.get(id(job), 0)))
        return give_tokens(job, tokens)

    def logged_wait(job):
        order.append(("wait", step_of.get(id(job), 0)))
        return wait(job)

    def logged_update(sched, runner):
        outputs = update(sched, runner)
        rids = set(sched.structured_req_ids)  # (the tokens kept: dropped ones have no output)
        events.append(
            ("update", [t for o in outputs if o.request_id in rids for t in o.new_token_ids])
        )
        return outputs

    core.structured.start_fill = logged_start_fill
    core.scheduler.update_from_output = logged_update
    core.scheduler.plan_grammar_fill = logged_plan
    core.executor.execute_model_async = logged_launch
    FillJob.give_tokens, FillJob.wait = logged_give_tokens, logged_wait
    params = [
        SamplingParams(max_tokens=16, temperature=0.0, structured_outputs=S(regex=r"[0-9]{10}")),
        SamplingParams(max_tokens=8, temperature=0.0, structured_outputs=S(choice=CHOICES)),
        _json_params(SCHEMAS[0], temperature=0.0, max_tokens=6),
    ]
    try:
        outs = llm.generate([PROMPT] * 3, params, use_tqdm=False)
        assert re.fullmatch(r"[0-9]{10}", outs[0].outputs[0].text), outs[0].outputs[0]
        assert outs[1].outputs[0].text in CHOICES
        assert outs[2].outputs[0].finish_reason == "length"
        _idle(llm)
    finally:
        FillJob.give_tokens, FillJob.wait = give_tokens, wait
        del core.structured.start_fill, core.scheduler.update_from_output
        del core.scheduler.plan_grammar_fill, core.executor.execute_model_async
    accepted, updated, ahead = 0, 0, []
    for kind, tokens in events:
        if kind == "accept":
            accepted += len(tokens)
        elif tokens:
            updated += len(tokens)
            ahead.append(accepted >= updated)
    kept = sum(len(o.outputs[0].token_ids) for o in outs)
    assert accepted <= updated == kept
    # every step's tokens but the last's (no fill follows it) went to the matchers first
    assert ahead[:-1] and all(ahead[:-1]), ahead
    # each step launched split had its fill sent before its launch
    launched = [step for kind, step in order if kind == "launch"]
    assert len(launched) >= 5, order
    for step in launched:
        assert order.index(("plan", step)) < order.index(("launch", step)), order
    # and before the fill of the split step before it was waited for
    for before, step in zip(launched, launched[1:]):
        assert order.index(("plan", step)) < order.index(("wait", before)), order
    # and the tokens ahead of it went to its fill before its launch (whose host work,
    # the input preparation, would otherwise delay the fill)
    for step in launched[1:]:
        assert order.index(("tokens", step)) < order.index(("launch", step)), order


def test_properties_are_generated_in_the_schema_order(llm):
    # (the order is the schema's meaning for a tool call: the name before the arguments)
    schema = {
        "type": "object",
        "properties": {"zeta": {"type": "integer", "minimum": 0, "maximum": 9}, "alpha": NAME},
        "required": ["zeta", "alpha"],
        "additionalProperties": False,
    }
    (out,) = llm.generate([PROMPT], _json_params(schema, temperature=0.0), use_tqdm=False)
    text = out.outputs[0].text
    _check_json(text, schema)
    assert text.startswith('{"zeta"'), text


def test_matchers_accept_a_steps_tokens_at_once_and_name_each_refused_one():
    """In the grammar process: the batched accept before a fill (one xgrammar call) says
    which tokens their grammar refused; a matcher with two tokens takes them in order; a
    refused token leaves no trace, and the mask then allows what the grammar does. A step
    sent with its accepts and fill at once gives the refused keys when waited for."""
    from transformers import AutoTokenizer

    from asyncllm.model.source import embedded_model_path
    from asyncllm.structured.manager import StructuredOutputManager

    path = str(embedded_model_path())
    tok = AutoTokenizer.from_pretrained(path)
    manager = StructuredOutputManager(path, vocab_size=len(tok), max_rows=4)
    try:
        a, b, c = (manager.request(S(regex=r"[0-9]+")) for _ in range(3))
        a.future.result()
        assert a.ready() and b.ready() and c.ready()
        (seven,), (x,) = tok.encode("7"), tok.encode("x")
        assert manager.accept([("a", a, seven), ("b", b, x), ("c", c, seven)]) == ["b"]
        assert manager.accept([("a", a, seven), ("a2", a, x), ("c", c, seven)]) == ["a2"]
        assert manager.accept([("b", b, seven)]) == []
        bitmask = manager.take_bitmask(3)[1]
        bitmask.fill_(0)
        job = manager.start_fill(bitmask, [(0, a), (1, b), (2, c)], [("c", c, x)])
        assert job.wait() == ["c"]
        allowed = [
            [(int(bitmask[i, t // 32]) >> (t % 32)) & 1 for t in (seven, x)] for i in range(3)
        ]
        assert allowed == [[1, 0]] * 3
        with pytest.raises(ValueError, match="max_rows"):
            manager.take_bitmask(5)[1]
    finally:
        manager.shutdown()


def _manager():
    """A structured output manager for the embedded model's tokenizer."""
    from transformers import AutoTokenizer

    from asyncllm.model.source import embedded_model_path
    from asyncllm.structured.manager import StructuredOutputManager

    path = str(embedded_model_path())
    return StructuredOutputManager(path, vocab_size=len(AutoTokenizer.from_pretrained(path)))


def test_the_matchers_of_ended_requests_are_freed_in_the_grammar_process():
    """A request's matcher is let go in the grammar process once the request is gone
    (its id goes with the next message), whatever steps were sent meanwhile."""
    import copy
    import gc

    manager = _manager()
    sent: list = []
    try:
        made: list[int] = []
        for _ in range(3):  # (requests made, stepped and dropped, over several steps)
            reqs = [manager.request(S(regex=r"[0-9]+")) for _ in range(4)]
            reqs[0].future.result()
            assert all(r.ready() for r in reqs)
            made += [r.matcher_id for r in reqs]
            if not sent:
                process = manager._get_process()
                send = process.send
                process.send = lambda msg, send=send: (sent.append(copy.deepcopy(msg)), send(msg))[
                    1
                ]
            bitmask = manager.take_bitmask(4)[1]
            manager.start_fill(bitmask, list(enumerate(reqs)), []).wait()
            del reqs
            gc.collect()
        manager.start_fill(
            manager.take_bitmask(1)[1], [], [("x", manager.request(S(regex="a")), 0)]
        )
        freed = [mid for msg in sent if msg[0] == "matchers" for mid in msg[2]]
        assert sorted(freed) == sorted(made)
    finally:
        manager.shutdown()


def test_compiled_grammars_are_kept_up_to_a_bound_and_matchers_outlive_them(monkeypatch):
    """The compiled grammars are an LRU of GRAMMAR_CACHE keys, here and in the grammar
    process: an evicted grammar is dropped there, its matchers still fill, and a request
    for its key again compiles it again."""
    import copy

    from transformers import AutoTokenizer

    from asyncllm.model.source import embedded_model_path
    from asyncllm.structured import manager as manager_module

    monkeypatch.setattr(manager_module, "GRAMMAR_CACHE", 2)
    path = str(embedded_model_path())
    tok = AutoTokenizer.from_pretrained(path)
    manager = manager_module.StructuredOutputManager(path, vocab_size=len(tok))
    sent: list = []
    try:
        first = manager.request(S(regex=r"[0-9]+"))
        first.future.result()
        assert first.ready()
        process = manager._get_process()
        send = process.send
        process.send = lambda msg: (sent.append(copy.deepcopy(msg)), send(msg))[1]
        for pattern in (r"[a-z]+", r"[A-Z]+", r"[0-9]+"):  # (the first is evicted, then back)
            req = manager.request(S(regex=pattern))
            req.future.result()
            assert req.ready()
        assert len(manager._cache) == 2 and req.future is not first.future
        bitmask = manager.take_bitmask(2)[1]
        (seven,), (x,) = tok.encode("7"), tok.encode("x")
        job = manager.start_fill(bitmask, [(0, first), (1, req)], [("f", first, seven)])
        assert job.wait() == []
        (matchers,) = [m for m in sent if m[0] == "matchers"]
        assert matchers[3] == [0, 1]  # ([0-9]+ then [a-z]+ evicted: dropped there)
        assert [m[1] for m in sent if m[0] == "grammar"] == [1, 2, 3]  # ([0-9]+ sent anew)
        assert [(int(bitmask[i, t // 32]) >> (t % 32)) & 1 for i in (0, 1) for t in (seven, x)] == [
            1,
            0,
            1,
            0,
        ]
        # A key evicted while it compiled: its matcher is made, and its grammar dropped
        late = manager.request(S(regex=r"[x-z]+"))
        for pattern in (r"[a-c]+", r"[d-f]+"):
            manager.request(S(regex=pattern))
        late.future.result()
        assert late.ready() and late.key not in manager._grammar_ids
        assert manager._dropped and manager._dropped[-1] == manager._next_grammar - 1
    finally:
        manager.shutdown()


def test_after_an_answer_times_out_no_later_answer_is_read_as_another_steps():
    """An answer that did not come in time fails its step and every step sent after it
    (a late answer would be read as the next step's); the manager's caller resets once:
    each failed step says it is news until then, and stale after."""

    from asyncllm.structured.grammar_process import GrammarProcessError

    manager = _manager()
    try:
        req = manager.request(S(regex=r"[0-9]+"))
        req.future.result()
        assert req.ready()
        process = manager._get_process()
        answer, calls = process.answer, []

        def late_once(timeout=None):
            calls.append(timeout)
            if len(calls) == 1:  # (the answer is on its way, but too late)
                raise GrammarProcessError("the grammar process has not answered in 60 s")
            return answer(timeout)

        process.answer = late_once
        first = manager.start_fill(manager.take_bitmask(1)[1], [(0, req)], [])
        second = manager.start_fill(manager.take_bitmask(1)[1], [(0, req)], [])
        with pytest.raises(GrammarProcessError, match="not answered"):
            second.wait()
        with pytest.raises(GrammarProcessError, match="not answered"):
            first.wait()
        assert len(calls) == 1 and not first.stale and not second.stale
        manager.reset()
        assert first.stale and second.stale
    finally:
        manager.shutdown()


def test_an_interrupt_while_an_answer_is_awaited_leaves_it_to_be_read_in_turn():
    """Ctrl-C while the step's thread waits for a step's answer: the answer is still
    unread, so that step stays pending and the next wait reads it as that step's (before,
    it was read as the next step's: its refused tokens named the wrong requests)."""
    manager = _manager()
    try:
        good, bad = manager.request(S(regex=r"[0-9]+")), manager.request(S(regex=r"[a-z]+"))
        for req in (good, bad):
            req.future.result()
            assert req.ready()
        process = manager._get_process()
        answer, calls = process.answer, []

        def interrupted_once(timeout=None):
            calls.append(timeout)
            if len(calls) == 1:  # (the answer is on its way: the wait is cut)
                raise KeyboardInterrupt
            return answer(timeout)

        process.answer = interrupted_once
        from transformers import AutoTokenizer

        t = AutoTokenizer.from_pretrained(manager.tokenizer_path)
        one, letter = t.convert_tokens_to_ids("1"), t.convert_tokens_to_ids("a")
        first = manager.start_fill(None, [], [("first", bad, one)])  # (refused)
        second = manager.start_fill(None, [], [("second", good, one)])  # (accepted)
        with pytest.raises(KeyboardInterrupt):
            second.wait()
        assert second.wait() == [] and first.wait() == ["first"]
        assert manager.start_fill(None, [], [("third", bad, letter)]).wait() == []
    finally:
        manager.shutdown()


def test_a_step_sent_before_its_tokens_waits_for_them_in_the_grammar_process():
    """A step sent with `ahead` accepts (the engine sends it before the tokens of the
    step in flight are known) runs once `give_tokens` brings them: they are accepted
    after the step's other accepts, a refused one is named by its key, and a row whose
    matcher a stop token ended allows every token. Until then the job cannot be waited
    for, no other step may be sent, and other messages (a new grammar) still go through."""
    from transformers import AutoTokenizer

    from asyncllm.model.source import embedded_model_path
    from asyncllm.structured.manager import StructuredOutputManager

    path = str(embedded_model_path())
    tok = AutoTokenizer.from_pretrained(path)
    manager = StructuredOutputManager(path, vocab_size=len(tok), max_rows=4)
    try:
        a, b = (manager.request(S(regex=r"[0-9]+")) for _ in range(2))
        d = manager.request(S(regex=r"[0-9]"))
        a.future.result(), d.future.result()
        assert a.ready() and b.ready() and d.ready()
        (seven,), (x,) = tok.encode("7"), tok.encode("x")
        stop = min(manager.stop_token_ids)
        assert manager.accept([("d", d, seven)]) == []  # (d may only end now)
        bitmask = manager.take_bitmask(3)[1]
        bitmask.fill_(0)
        rows = [(0, a), (1, b), (2, d)]
        job = manager.start_fill(bitmask, rows, [("a", a, seven)], ahead=[("b", b), ("d", d)])
        assert job.ahead_keys == ["b", "d"]
        with pytest.raises(RuntimeError, match="waiting for its tokens"):
            job.wait()
        with pytest.raises(RuntimeError, match="still waits for its tokens"):
            manager.start_fill(bitmask, [(0, a)], [])
        e = manager.request(S(regex=r"[a-z]+"))
        e.future.result()
        assert e.ready()  # (its grammar is sent to the process now, while the step waits)
        with pytest.raises(ValueError, match="2 accepts"):
            job.give_tokens([[x]])
        job.give_tokens([[x], [stop]])
        assert job.wait() == ["b"]

        def allowed(row: int) -> list[int]:
            return [(int(bitmask[row, t // 32]) >> (t % 32)) & 1 for t in (seven, x)]

        assert allowed(0) == allowed(1) == [1, 0]
        assert (bitmask[2] == -1).all()  # (d ended: its row allows every token)
        bitmask.fill_(0)
        job = manager.start_fill(bitmask, [(0, e)], [], ahead=[("e", e)])
        job.give_tokens([[x]])
        assert job.wait() == []
        assert allowed(0) == [0, 1]
    finally:
        manager.shutdown()


def test_a_dead_or_hung_grammar_process_fails_the_step_with_a_clear_error(monkeypatch):
    """A terminal's Ctrl-C (SIGINT) leaves the grammar process serving; if it stops
    answering or ends, the step that needs it raises GrammarProcessError saying so (no
    wait without end), and after `reset()` the next matcher starts a new process."""
    import os
    import signal

    from asyncllm.structured import grammar_process
    from asyncllm.structured.grammar_process import GrammarProcessError

    manager = _manager()
    try:
        a = manager.request(S(regex=r"[0-9]+"))
        a.future.result()
        assert a.ready()
        bitmask = manager.take_bitmask(1)[1]
        manager.fill_bitmask(bitmask, [(0, a)])
        first = manager._process
        assert first is not None
        os.kill(first.proc.pid, signal.SIGINT)
        manager.fill_bitmask(bitmask, [(0, a)])
        assert first.proc.poll() is None
        os.kill(first.proc.pid, signal.SIGSTOP)  # (alive, but it answers nothing)
        monkeypatch.setattr(grammar_process, "STEP_TIMEOUT_S", 1.0)
        with pytest.raises(GrammarProcessError, match="not answered in 1 s"):
            manager.fill_bitmask(bitmask, [(0, a)])
        assert (bitmask == -1).all()  # (the step's rows allow every token)
        manager.reset()
        assert first.proc.poll() is not None
        b = manager.request(S(regex=r"[0-9]+"))
        assert b.ready()  # (its grammar is cached: its matcher starts a new process)
        manager.fill_bitmask(bitmask, [(0, b)])
        second = manager._process
        assert second is not None and second is not first
        second.proc.kill()
        second.proc.wait()
        with pytest.raises(GrammarProcessError, match="grammar process has ended"):
            manager.fill_bitmask(bitmask, [(0, b)])
    finally:
        manager.shutdown()


def test_a_lost_grammar_process_ends_only_the_requests_it_held(sync_engine):
    """The grammar process dies mid-decode: the constrained request whose matcher it held
    ends with an error saying so, the unconstrained one beside it finishes, a constrained
    request submitted afterwards gets a new process and completes its grammar, and every
    block comes back."""
    import time

    from asyncllm.messages import EngineCoreRequest

    core = sync_engine.engine.client.core
    array = {"type": "array", "items": {"type": "string"}}

    def request(rid, so, max_tokens):
        params = SamplingParams(
            max_tokens=max_tokens, temperature=0.0, ignore_eos=so is None, structured_outputs=so
        )
        return EngineCoreRequest(rid, [1, 2, 3, 4], params, 2, max_tokens, time.monotonic())

    outs: dict[str, list] = {}
    core.add_request(request("free", None, 40))
    core.add_request(request("held", S(json=array), 40))
    while len(outs.get("held", [])) < 2:  # (decoding under its grammar)
        for o in core.step().outputs:
            outs.setdefault(o.request_id, []).append(o)
    process = core.structured._process
    assert process is not None
    process.proc.kill()
    process.proc.wait()
    _run_until_done(core, outs, steps=400)
    held = outs["held"][-1]
    assert held.error is not None and "grammar process has ended" in held.error.message
    assert outs["free"][-1].finish_reason == "length" and outs["free"][-1].error is None
    assert sum(len(o.new_token_ids) for o in outs["free"]) == 40
    core.add_request(request("after", S(choice=CHOICES), 16))
    _run_until_done(core, outs, steps=400)
    assert outs["after"][-1].finish_reason == "stop" and outs["after"][-1].error is None
    assert core.structured._process is not None and core.structured._process is not process
    assert core.kv_cache_manager.num_free_blocks == core.num_blocks


def test_a_lone_request_whose_grammar_process_dies_still_gets_its_error(inproc_engine):
    """With async scheduling, the grammar process dies while the only request decodes:
    the error that ends it comes from a fill's answer, after the step's schedule, and
    still reaches it (the engine has nothing left to schedule), its blocks freed."""
    core = inproc_engine.engine.client.core
    update, kills = core.scheduler.update_from_output, []

    def update_then_kill(sched, runner):
        out = update(sched, runner)
        if len(kills) < 1 and any(o.request_id == "lone" for o in out):
            if sum(len(o.new_token_ids) for o in out) and core.structured._process:
                process = core.structured._process
                process.proc.kill()
                process.proc.wait()
                kills.append(process)
        return out

    core.scheduler.update_from_output = update_then_kill
    outs: dict = {}
    try:
        inproc_engine.engine.add_request("lone", "Give digits", _digits(30, 40))
        _run_until_done(core, outs)
    finally:
        core.scheduler.update_from_output = update
    assert kills
    last = outs["lone"][-1]
    assert last.error is not None and "grammar process has ended" in last.error.message, last
    assert core.kv_cache_manager.num_free_blocks == core.num_blocks


def test_a_process_lost_while_a_fill_waits_for_its_tokens_is_reset_once(inproc_engine):
    """The grammar process stops answering with one step's fill sent and the next one's
    sent ahead of its tokens, then dies: both fills fail and the request ends, but the
    process is reset once; a request that comes next gets a new process that the second
    fill's (stale) failure leaves alone, and completes its grammar."""
    import os
    import signal

    from asyncllm.structured.manager import FillJob

    core = inproc_engine.engine.client.core
    manager, scheduler = core.structured, core.scheduler
    give, finish, reset = FillJob.give_tokens, scheduler.grammar.finish_fill, manager.reset
    state: dict = {"gives": 0, "stopped": None, "killed": False, "resets": 0}

    def give_then_stop(job, tokens):
        state["gives"] += 1
        if state["gives"] == 3 and state["stopped"] is None:  # (it answers nothing more)
            state["stopped"] = manager._process
            os.kill(state["stopped"].proc.pid, signal.SIGSTOP)
        give(job, tokens)

    def kill_then_finish(job):
        p = state["stopped"]
        waiting = manager._pending and manager._pending[-1].ahead_keys is not None
        if p is not None and not state["killed"] and waiting:
            os.kill(p.proc.pid, signal.SIGKILL)
            os.kill(p.proc.pid, signal.SIGCONT)
            p.proc.wait()
            state["killed"] = True
        return finish(job)

    def counted_reset():
        state["resets"] += 1
        reset()

    FillJob.give_tokens = give_then_stop
    scheduler.grammar.finish_fill = kill_then_finish
    manager.reset = counted_reset
    outs: dict = {}
    try:
        inproc_engine.engine.add_request("first", "Give digits", _digits(30, 40))
        for _ in range(100):
            if state["killed"]:
                break
            for o in core.step().outputs:
                outs.setdefault(o.request_id, []).append(o)
        assert state["killed"]
        inproc_engine.engine.add_request("next", "Give digits", _digits(8, 16))
        _run_until_done(core, outs)
    finally:
        FillJob.give_tokens, scheduler.grammar.finish_fill = give, finish
        del manager.reset
    assert outs["first"][-1].error is not None, outs["first"][-1]
    assert outs["next"][-1].error is None, outs["next"][-1]
    assert outs["next"][-1].finish_reason == "stop"
    assert re.fullmatch(r"[0-9]{8}", _decoded(inproc_engine, outs["next"]))
    assert state["resets"] == 1
    assert core.kv_cache_manager.num_free_blocks == core.num_blocks


def _decoded(llm: LLM, outs: list) -> str:
    ids = [t for o in outs for t in o.new_token_ids]
    return llm.get_tokenizer().decode(ids, skip_special_tokens=True)


def test_an_interrupt_while_a_fill_waits_for_its_tokens_leaves_the_grammar_process_free():
    """A KeyboardInterrupt (or any error) in a step between a fill's message and its
    tokens: the grammar process is given no tokens for it (rather than waiting for them
    for good), so the next fill goes through; the step scheduled but never launched is
    retired in the scheduler (its blocks come back, no step stays in flight there), and
    the engine serves on."""
    with LLM(device="cpu", max_model_len=256, multiprocess=False) as llm:
        core = llm.engine.client.core
        manager, scheduler = core.structured, core.scheduler
        finish, calls = scheduler.grammar.finish_fill, []

        def interrupted(job):
            if manager._pending and manager._pending[-1].ahead_keys is not None:
                calls.append(job)
                if len(calls) == 3:
                    raise KeyboardInterrupt
            return finish(job)

        scheduler.grammar.finish_fill = interrupted
        try:
            with pytest.raises(KeyboardInterrupt):
                llm.generate(["Give digits"], _digits(15, 20), use_tqdm=False)
        finally:
            scheduler.grammar.finish_fill = finish
        assert len(calls) == 3
        assert manager._pending and not any(j.ahead_keys is not None for j in manager._pending)
        req = manager.request(S(regex=r"[0-9]+"))
        req.future.result()
        assert req.ready()
        bitmask = manager.take_bitmask(1)[1]
        manager.fill_bitmask(bitmask, [(0, req)])  # (answered: the process serves)
        assert (bitmask != 0).any() and not (bitmask == -1).all()
        assert scheduler.num_steps_in_flight == len(core._in_flight)
        (out,) = llm.generate(["Give digits"], _digits(5, 10), use_tqdm=False)
        assert re.fullmatch(r"[0-9]{5}", out.outputs[0].text)
        assert scheduler.num_steps_in_flight == len(core._in_flight) == 0
        assert core.kv_cache_manager.num_free_blocks == core.num_blocks


def _interrupting(fn, nth: int):
    """`fn`, raising KeyboardInterrupt instead of running at its `nth` call."""
    calls = 0

    def wrapper(*args, **kwargs):
        nonlocal calls
        calls += 1
        if calls == nth:
            raise KeyboardInterrupt
        return fn(*args, **kwargs)

    return wrapper


def _idle_and_serving(llm: LLM, outs: dict) -> None:
    """The in-process core has no step in flight and every block back, and a new
    constrained request (id 'after') still gets a valid answer."""
    import time

    from asyncllm.messages import EngineCoreRequest

    core = llm.engine.client.core
    assert core.scheduler.num_steps_in_flight == len(core._in_flight) == 0
    assert core.kv_cache_manager.num_free_blocks == core.num_blocks
    core.add_request(
        EngineCoreRequest("after", [1, 2, 3, 4], _digits(5, 10), 2, 8, time.monotonic())
    )
    _run_until_done(core, outs)
    assert outs["after"][-1].finish_reason == "stop"
    assert re.fullmatch(r"[0-9]{5}", _decoded(llm, outs["after"]))


@pytest.mark.parametrize("structured", [False, True], ids=["free", "constrained"])
def test_a_step_that_fails_before_its_launch_is_retired(inproc_engine, monkeypatch, structured):
    """An error while a scheduled step is launched: the core's step raises it, the
    outputs it had gathered come with the next step, the scheduler retires the step
    (its request fails with an error, no step stays in flight) and every block comes
    back; the engine serves on."""
    import time

    from asyncllm.messages import EngineCoreRequest

    core = inproc_engine.engine.client.core
    launch, calls = core.executor.execute_model_async, []

    def failing(sched):
        calls.append(sched)
        if len(calls) == 3:
            sched.finished_req_ids.add("ended-before")  # (the runner is to forget it)
            raise RuntimeError("the launch failed")
        return launch(sched)

    monkeypatch.setattr(core.executor, "execute_model_async", failing)
    so = S(regex="[0-9]{30}") if structured else None
    params = SamplingParams(max_tokens=30, temperature=0.0, ignore_eos=True, structured_outputs=so)
    core.add_request(EngineCoreRequest("doomed", [1, 2, 3, 4], params, 2, 8, time.monotonic()))
    outs: dict[str, list] = {}
    with pytest.raises(RuntimeError, match="launch failed"):
        _run_until_done(core, outs)
    monkeypatch.setattr(core.executor, "execute_model_async", launch)
    assert core.scheduler.num_steps_in_flight == len(core._in_flight)
    assert "ended-before" in core.scheduler.finished_req_ids  # (told with the next step)
    _run_until_done(core, outs)
    final = outs["doomed"][-1]
    assert final.error is not None and "interrupted" in final.error.message
    assert len([t for o in outs["doomed"] for t in o.new_token_ids]) < 30
    _idle_and_serving(inproc_engine, outs)


@pytest.mark.parametrize("structured", [False, True], ids=["free", "constrained"])
def test_an_interrupt_while_a_step_is_awaited_leaves_it_in_flight(
    inproc_engine, monkeypatch, structured
):
    """A Ctrl-C while the core waits for a step's tokens: the step stays in flight (in
    the core and the runner) and a later step applies it once, and every block comes
    back. Free, the wait is the apply of the oldest step, and the request finishes whole;
    constrained, it is the wait for the tokens the next step's fill needs, during that
    step's launch: that step is retired, and the request ends with its error."""
    import time

    from asyncllm.messages import EngineCoreRequest
    from asyncllm.worker.step_result import StepResult

    core = inproc_engine.engine.client.core
    monkeypatch.setattr(StepResult, "apply", _interrupting(StepResult.apply, 3))
    so = S(regex="[0-9]{12}") if structured else None
    params = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True, structured_outputs=so)
    core.add_request(EngineCoreRequest("waited", [1, 2, 3, 4], params, 2, 12, time.monotonic()))
    outs: dict[str, list] = {}
    with pytest.raises(KeyboardInterrupt):
        _run_until_done(core, outs)
    assert core.scheduler.num_steps_in_flight == len(core._in_flight) > 0
    # (the step in flight gave no tokens to the fill: its matchers take them when applied)
    assert not core.scheduler.grammar.has_accepted_ahead
    _run_until_done(core, outs)
    final = outs["waited"][-1]
    tokens = [t for o in outs["waited"] for t in o.new_token_ids]
    if structured:
        assert final.error is not None and "interrupted" in final.error.message
        assert 0 < len(tokens) < 12 and re.fullmatch(
            "[0-9]+", _decoded(inproc_engine, outs["waited"])
        )
    else:
        assert final.error is None and final.finish_reason == "length" and len(tokens) == 12
    assert core.scheduler.num_steps_in_flight == len(core._in_flight) == 0
    assert core.kv_cache_manager.num_free_blocks == core.num_blocks


def test_an_interrupt_while_prompt_logprobs_are_read_applies_the_step_once(
    inproc_engine, monkeypatch
):
    """A Ctrl-C while a step's prompt logprobs are read to lists (milliseconds for a
    long prompt): the step stays in flight and is applied once later, so the request's
    tokens are those of a run without the interrupt."""
    import time

    from asyncllm.messages import EngineCoreRequest
    from asyncllm.worker.step_result import PendingLogprobs

    core = inproc_engine.engine.client.core
    params = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True, prompt_logprobs=2)
    prompt = [1, 504, 3437, 314, 260, 1345, 30, 2, 3, 4]
    outs: dict[str, list] = {}
    core.add_request(EngineCoreRequest("whole", prompt, params, 2, 8, time.monotonic()))
    _run_until_done(core, outs)
    monkeypatch.setattr(PendingLogprobs, "read", _interrupting(PendingLogprobs.read, 1))
    core.add_request(EngineCoreRequest("cut", prompt, params, 2, 8, time.monotonic()))
    with pytest.raises(KeyboardInterrupt):
        _run_until_done(core, outs)
    _run_until_done(core, outs)
    tokens = {rid: [t for o in outs[rid] for t in o.new_token_ids] for rid in ("whole", "cut")}
    assert len(tokens["whole"]) == 8 and tokens["cut"] == tokens["whole"]
    assert outs["cut"][-1].error is None
    _idle_and_serving(inproc_engine, outs)


@pytest.mark.parametrize("structured", [False, True], ids=["free", "constrained"])
def test_an_interrupt_while_a_launched_step_is_sampled_fails_its_requests(
    inproc_engine, monkeypatch, structured
):
    """A Ctrl-C once a step's forward is queued, while its sampling is (a constrained
    step's sampling waits for its masks, so it runs later than its launch): the step's
    requests end with an error saying so, rather than being left without their tokens,
    no step stays in flight, and every block comes back."""
    import time

    from asyncllm.messages import EngineCoreRequest
    from asyncllm.worker.model_runner import ModelRunner

    core = inproc_engine.engine.client.core
    monkeypatch.setattr(ModelRunner, "_sample", _interrupting(ModelRunner._sample, 3))
    so = S(regex="[0-9]{12}") if structured else None
    params = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True, structured_outputs=so)
    core.add_request(EngineCoreRequest("sampled", [1, 2, 3, 4], params, 2, 12, time.monotonic()))
    outs: dict[str, list] = {}
    with pytest.raises(KeyboardInterrupt):
        _run_until_done(core, outs)
    _run_until_done(core, outs)
    final = outs["sampled"][-1]
    assert final.error is not None and "interrupted" in final.error.message
    tokens = [t for o in outs["sampled"] for t in o.new_token_ids]
    assert 0 < len(tokens) < 12
    if structured:
        assert re.fullmatch("[0-9]+", _decoded(inproc_engine, outs["sampled"]))
    _idle_and_serving(inproc_engine, outs)


def test_an_interrupt_once_a_steps_tokens_went_ahead_keeps_that_step(inproc_engine, monkeypatch):
    """A Ctrl-C just after the step in flight gave its tokens to the next fill: that
    step stays in flight and is applied once (its tokens not accepted again), the step
    being launched is retired, every block comes back, and the grammar process serves
    the next request."""
    import time

    from asyncllm.messages import EngineCoreRequest

    core = inproc_engine.engine.client.core
    give, calls = core.scheduler.grammar.give_grammar_tokens, []

    def interrupted(job, runner):
        give(job, runner)
        if job is not None and runner is not None:
            calls.append(job)
            if len(calls) == 2:
                raise KeyboardInterrupt

    monkeypatch.setattr(core.scheduler.grammar, "give_grammar_tokens", interrupted)
    params = _digits(12, 12)
    core.add_request(EngineCoreRequest("cut", [1, 2, 3, 4], params, 2, 12, time.monotonic()))
    outs: dict[str, list] = {}
    with pytest.raises(KeyboardInterrupt):
        _run_until_done(core, outs)
    monkeypatch.setattr(core.scheduler.grammar, "give_grammar_tokens", give)
    assert core.scheduler.num_steps_in_flight == len(core._in_flight) > 0
    _run_until_done(core, outs)
    final = outs["cut"][-1]
    assert final.error is not None and "interrupted" in final.error.message
    assert re.fullmatch("[0-9]+", _decoded(inproc_engine, outs["cut"]))
    _idle_and_serving(inproc_engine, outs)


def test_a_logits_processor_beside_split_constrained_steps_loses_no_token():
    """A user logits processor (it reads the output ids, so the steps in flight are
    applied before each sampling) with constrained requests whose steps are split (the
    step is in flight while it waits for its masks): every token arrives."""
    with LLM(
        device="cpu",
        max_model_len=256,
        multiprocess=False,
        logits_processors=["tests.engine.processors:NoRepeat"],
    ) as llm:
        outs = llm.generate(["Give digits", "More digits please"], _digits(8, 12), use_tqdm=False)
    for out in outs:
        assert re.fullmatch(r"[0-9]{8}", out.outputs[0].text), out.outputs[0]
        assert out.outputs[0].finish_reason == "stop"


def test_a_step_split_over_threads_fills_and_refuses_as_one_call():
    """The grammar process's StepThreads: a step's accepts and fill split over threads
    (every k-th row, with its matcher's accepts) leave the same bitmask and name the same
    refused positions as one thread doing all in order, for 56 rows of two grammars, a
    matcher taking two tokens, a refused token and an accept whose matcher has no row."""
    import torch
    import xgrammar as xgr
    from transformers import AutoTokenizer

    from asyncllm.model.source import embedded_model_path
    from asyncllm.structured.grammar import build_grammar, grammar_key
    from asyncllm.structured.grammar_process import MIN_ROWS_PER_THREAD, StepThreads

    tok = AutoTokenizer.from_pretrained(str(embedded_model_path()))
    info = xgr.TokenizerInfo.from_huggingface(tok, vocab_size=len(tok))
    compiler = xgr.GrammarCompiler(info, max_threads=1)
    grammars = [
        compiler.compile_grammar(build_grammar(grammar_key(S(json=SCHEMAS[4])))),
        compiler.compile_grammar(build_grammar(grammar_key(S(regex=r"[0-9]{2,30}")))),
    ]
    rows = 56
    assert rows // MIN_ROWS_PER_THREAD >= 3  # (three parts)
    texts = ['{"tags": ["ab', "12345"]
    steps = [tok.encode(t) for t in texts]

    def run(threads: StepThreads) -> tuple[torch.Tensor, list[list[int]]]:
        matchers = [xgr.GrammarMatcher(grammars[i % 2]) for i in range(rows + 1)]
        bitmask = torch.zeros(rows, -(-len(tok) // 32), dtype=torch.int32)
        fills = [(rows - 1 - i, m, [], 0) for i, m in enumerate(matchers[:rows])]  # (reversed)
        refused_each = []
        for step in range(max(map(len, steps))):
            accepts = []
            for i, m in enumerate(matchers):
                ids = steps[i % 2]
                if step < len(ids):
                    accepts.append((m, ids[step]))
            accepts.append((matchers[1], tok.encode("x")[0]))  # (refused: not a digit)
            if step == 0:  # (a matcher with two tokens, in order)
                accepts.append((matchers[3], tok.encode("7")[0]))
            refused_each.append(threads.run(accepts, fills, bitmask))
        return bitmask, refused_each

    one, refused_one = run(StepThreads(1, xgr))
    three, refused_three = run(StepThreads(3, xgr))
    assert torch.equal(one, three)
    assert refused_one == refused_three
    assert all(r for r in refused_one)  # (the "x" each step)
    assert bool((one != 0).any(dim=1).all())  # (every row filled)


def test_the_frontend_check_builds_each_grammar_once(monkeypatch):
    """`check` (run for each submitted request) builds a key's grammar once; a key that
    cannot be enforced is refused every time, with the field named."""
    from asyncllm.structured import grammar

    built: list = []
    build = grammar.build_grammar

    def counted(key):
        built.append(key)
        return build(key)

    monkeypatch.setattr(grammar, "build_grammar", counted)
    grammar._check_key.cache_clear()
    schema = {"type": "object", "properties": {"n": {"type": "integer"}}, "required": ["n"]}
    for _ in range(3):
        grammar.check(StructuredOutputsParams(json=schema))
    assert len(built) == 1
    for _ in range(2):
        with pytest.raises(ValueError, match="structured_outputs.regex"):
            grammar.check(StructuredOutputsParams(regex="(unclosed"))
    assert len(built) == 3


def test_a_constrained_prefix_reader_of_a_refused_request_keeps_its_grammar_in_step():
    """A (refused by the runner: a logits processor rejects its arguments) and B
    (constrained, the same prompt: A's blocks are a prefix-cache hit) share a step. B
    computes its prefix again and drops that step's token, which async scheduling had
    already given its matcher for the next fill: its matcher is rebuilt from the tokens
    B kept, so B's text still matches its regex, as it does alone."""
    regex = r"([0-9]{2}-){6}[0-9]{2}"
    good = SamplingParams(temperature=0.0, max_tokens=40, structured_outputs=S(regex=regex))
    bad = SamplingParams(temperature=0.0, max_tokens=5, extra_args={"force_token": "oops"})
    prompt = "A prompt about rivers, mountains and long forgotten towns. " * 6
    with LLM(
        device="cpu",
        max_model_len=512,
        multiprocess=False,
        logits_processors=["tests.engine.processors:ForceToken"],
    ) as llm:
        engine, core = llm.engine, llm.engine.client.core
        assert _async(llm)
        llm.generate(["Anything else"], good, use_tqdm=False)  # (B's grammar, compiled)

        def run(a: str, b: str, prompt: str) -> tuple[dict, list]:
            engine.add_request(a, prompt, bad)
            engine.add_request(b, prompt, good)
            done, errors = {}, []
            for _ in range(200):
                if not engine.has_unfinished_requests():
                    return done, errors
                try:
                    done.update((o.request_id, o) for o in engine.step() if o.finished)
                except Exception as e:  # noqa: BLE001 (A's error: raised by the step ending it)
                    errors.append(e)
            raise AssertionError(f"still unfinished after 200 steps: {errors[-3:]}")

        done, errors = run("A", "B", prompt)
        assert core.scheduler.stats.num_preemptions >= 1  # (B computed its prefix again)
        assert len(errors) == 1 and "request 'A' failed" in str(errors[0])
        text = done["B"].outputs[0].text
        (alone,) = llm.generate([prompt], good, use_tqdm=False)
        assert re.fullmatch(regex, text), text
        assert text == alone.outputs[0].text
        assert core.kv_cache_manager.num_free_blocks == core.num_blocks

        # the new matcher cannot be made (the grammar process is lost): B ends with that
        from asyncllm.structured.grammar_process import GrammarProcessError

        def lost(old):
            raise GrammarProcessError("the grammar process has ended (test)")

        core.structured.renew = lost
        done, errors = run("A2", "B2", "Another prompt, about harbours and their ships. " * 6)
        assert {str(e).split(":")[0] for e in errors} >= {"request 'A2' failed"}
        assert any("B2" in str(e) and "has ended (test)" in str(e) for e in errors), errors
        assert core.kv_cache_manager.num_free_blocks == core.num_blocks
        del core.structured.renew
        (after,) = llm.generate([prompt], good, use_tqdm=False)
        assert after.outputs[0].text == alone.outputs[0].text


def test_a_steps_tokens_go_ahead_to_the_matchers_once(inproc_engine):
    """A step in flight gives its tokens ahead to the next fill's matchers once: a
    device step whose launch failed after its hand-over was queued left them given, and
    the next fill must not send them again (its matchers would take each twice)."""
    core = inproc_engine.engine.client.core
    inproc_engine.engine.add_request("once", PROMPT, _digits(8, 8))
    outs: dict = {}
    for _ in range(50):
        for o in core.step().outputs:
            outs.setdefault(o.request_id, []).append(o)
        if core._in_flight:
            break
    last = core._in_flight[-1][0]
    sched = core.scheduler
    record = sched._in_flight[id(last)][1]
    assert [r.request_id for r, _ in sched.grammar.ahead_accepts(last, record)] == ["once"]
    assert sched.grammar.ahead_accepts(last, record) == []  # (given already)
    sched.grammar.accept_when_applied(last)  # (the fill never got them: its update accepts them)
    _run_until_done(core, outs)
    text = inproc_engine.get_tokenizer().decode([t for o in outs["once"] for t in o.new_token_ids])
    assert re.fullmatch(r"[0-9]{8}", text), text
