"""`asyncllm serve` on 127.0.0.1 against the official `openai` client: one server with the
embedded model for the API (greedy where answers are compared), and two with the
model-free executor: one behind an API key that is then stopped with SIGTERM mid-stream,
one whose engine core is killed."""

from __future__ import annotations

import contextlib
import json
import os
import re
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass
from http.client import HTTPConnection
from pathlib import Path
from urllib.parse import urlsplit

import pytest

from tests.entrypoints.procs import children
from tests.tool_defs import ASK, CALC, CLOCK

openai = pytest.importorskip("openai")  # (the test extra; the GPU machine lacks it)
parser = pytest.importorskip("prometheus_client.parser")
text_string_to_metric_families = parser.text_string_to_metric_families

ENGINE = ["--device", "cpu", "--max-model-len", "512"]
INSTANT = ["--distributed-executor-backend", "asyncllm.executor.instant:InstantExecutor"]
G = dict(temperature=0, extra_body={"ignore_eos": True})  # greedy, to the length asked
MODEL = "default"


@dataclass
class Answer:
    status_code: int
    headers: dict[str, str]
    text: str

    def json(self):
        return json.loads(self.text)


def _request(method: str, url: str, body: bytes | None, headers: dict[str, str]) -> HTTPConnection:
    parts = urlsplit(url)
    conn = HTTPConnection(parts.hostname, parts.port, timeout=60)
    conn.request(method, parts.path, body=body, headers=headers)
    return conn


def http(method: str, url: str, json_body=None, content: bytes | None = None) -> Answer:
    headers = {"content-type": "application/json"}
    body = (
        content
        if content is not None
        else (None if json_body is None else json.dumps(json_body).encode())
    )
    conn = _request(method, url, body, headers)
    resp = conn.getresponse()
    answer = Answer(resp.status, {k.lower(): v for k, v in resp.getheaders()}, resp.read().decode())
    conn.close()
    return answer


def get(url: str) -> Answer:
    return http("GET", url)


def post(url: str, json=None, content: bytes | None = None) -> Answer:
    return http("POST", url, json, content)


def stream_lines(
    url: str, json_body, headers: dict[str, str] | None = None
) -> tuple[HTTPConnection, Iterator[str]]:
    """A streaming POST: the connection (close it to leave) and its lines."""
    headers = {"content-type": "application/json", **(headers or {})}
    conn = _request("POST", url, json.dumps(json_body).encode(), headers)
    resp = conn.getresponse()
    assert resp.status == 200

    def lines() -> Iterator[str]:
        for raw in resp:
            line = raw.decode().rstrip("\n")
            if line:
                yield line

    return conn, lines()


class Server:
    def __init__(
        self, *flags: str, env: dict[str, str] | None = None, new_session: bool = False
    ) -> None:
        cmd = [sys.executable, "-m", "asyncllm.cli.main", "serve", "--port", "0", *ENGINE, *flags]
        self.proc = subprocess.Popen(
            cmd,
            stderr=subprocess.PIPE,
            text=True,
            env={**os.environ, **(env or {})},
            start_new_session=new_session,  # (its own process group, as a terminal's)
        )
        assert self.proc.stderr is not None
        for line in self.proc.stderr:  # until the server says where it listens
            m = re.search(r"serving '.*' on (https?://\S+)", line)
            if m:
                self.url = m.group(1)
                break
        else:
            raise RuntimeError(f"the server exited ({self.proc.wait()}) before serving")

    def client(self, api_key: str = "none", **kwargs) -> openai.OpenAI:
        return openai.OpenAI(base_url=self.url + "/v1", api_key=api_key, max_retries=0, **kwargs)

    def metrics(self) -> dict[str, float]:
        text = get(self.url + "/metrics").text
        out = {}
        for family in text_string_to_metric_families(text):
            for sample in family.samples:
                if not sample.labels:
                    out[sample.name] = sample.value
        return out

    def wait_for(self, cond, what: str, timeout: float = 60.0) -> None:
        deadline = time.monotonic() + timeout
        while not cond():
            if time.monotonic() > deadline:
                raise AssertionError(f"timed out waiting for {what}")
            time.sleep(0.05)

    def core_pids(self) -> list[int]:
        return children(self.proc.pid, "asyncllm.engine.core_main")

    def engine_pids(self) -> list[int]:
        """The core's and the tokenizer process's."""
        return children(self.proc.pid)

    def stop(self) -> int:
        """Its exit code, after SIGTERM if it still runs; what it wrote on stderr after
        the line that said where it listens is kept in `log`."""
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
        rc = self.proc.wait(timeout=60)
        assert self.proc.stderr is not None
        if not self.proc.stderr.closed:
            self.log = self.proc.stderr.read()
            self.proc.stderr.close()
        return rc


@pytest.fixture(scope="module")
def server() -> Iterator[Server]:
    s = Server("--max-num-seqs", "4", "--max-waiting-requests", "2")  # the embedded model
    try:
        yield s
    finally:
        assert s.stop() == 0


def test_models_and_health(server):
    models = server.client().models.list()
    assert [m.id for m in models.data] == [MODEL]
    assert get(server.url + "/health").status_code == 200


def test_chat_and_completions_match_the_engine(server):
    client = server.client()
    chat = client.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "Hi"}], max_tokens=5, **G
    )
    c = chat.choices[0]
    assert c.finish_reason == "length" and c.message.role == "assistant" and c.message.content
    assert chat.usage.completion_tokens == 5
    assert chat.usage.total_tokens == chat.usage.prompt_tokens + 5
    text = client.completions.create(model=MODEL, prompt="Hello", max_tokens=4, **G)
    assert text.choices[0].finish_reason == "length" and text.usage.completion_tokens == 4
    ids = client.completions.create(model=MODEL, prompt=[5, 6, 7], max_tokens=4, **G)  # token ids
    assert ids.usage.prompt_tokens == 3 and ids.usage.completion_tokens == 4
    # content as a list of text parts is the same conversation
    parts = client.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": [{"type": "text", "text": "Hi"}]}],
        max_tokens=5, **G,
    )  # fmt: skip
    assert parts.choices[0].message.content == c.message.content


def test_streaming_gives_the_same_text_and_usage(server):
    client = server.client()
    full = client.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "Tell me"}], max_tokens=8, **G
    )
    stream = client.chat.completions.create(
        model=MODEL,
        messages=[{"role": "user", "content": "Tell me"}],
        max_tokens=8,
        stream=True,
        stream_options={"include_usage": True},
        **G,
    )
    chunks = list(stream)
    assert chunks[0].choices[0].delta.role == "assistant"
    text = "".join(ch.choices[0].delta.content or "" for ch in chunks if ch.choices)
    assert text == full.choices[0].message.content
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 8
    reasons = [ch.choices[0].finish_reason for ch in chunks if ch.choices]
    assert reasons[-1] == "length" and all(r is None for r in reasons[:-1])
    done = post(
        server.url + "/v1/completions",
        json={"model": MODEL, "prompt": "Hello", "max_tokens": 3, "stream": True},
    )
    assert done.text.rstrip().endswith("data: [DONE]")


def test_stop_and_n(server):
    client = server.client()
    base = client.completions.create(model=MODEL, prompt="Count", max_tokens=12, **G)
    base = base.choices[0].text
    stop = base[len(base) // 2 :][:3]
    assert stop.strip()
    cut = client.completions.create(model=MODEL, prompt="Count", max_tokens=12, stop=[stop], **G)
    assert cut.choices[0].finish_reason == "stop"
    assert cut.choices[0].text == base[: base.index(stop)]
    two = client.completions.create(model=MODEL, prompt="Count", max_tokens=4, n=2, **G)
    assert sorted(ch.index for ch in two.choices) == [0, 1]
    assert two.usage.completion_tokens == 8


def _error(resp: Answer, status: int) -> dict:
    assert resp.status_code == status, resp.text
    err = resp.json()["error"]
    assert set(err) == {"message", "type", "param", "code"} and err["message"]
    return err


def test_bad_requests_get_openai_errors_and_the_server_serves_on(server):
    url = server.url + "/v1/completions"
    err = _error(post(url, content=b"{not json"), 400)
    assert "JSON" in err["message"]
    err = _error(post(url, json={"model": MODEL, "prompt": "x", "max_tokens": -1}), 400)
    assert err["param"] == "max_tokens"
    long_prompt = " ".join(["hello"] * 800)  # past max_model_len 512
    err = _error(post(url, json={"model": MODEL, "prompt": long_prompt}), 400)
    assert "max_model_len" in err["message"]
    err = _error(post(url, json={"model": "gpt-4", "prompt": "x"}), 404)
    assert err["code"] == "model_not_found"
    with pytest.raises(openai.BadRequestError):
        server.client().completions.create(model=MODEL, prompt="x", max_tokens=-3)
    ok = server.client().completions.create(model=MODEL, prompt="still", max_tokens=2)
    assert ok.usage.completion_tokens == 2


def test_overload_is_503_with_retry_after(server):
    # Four running and two waiting at most: a batch of 12 long prompts cannot all wait.
    resp = post(
        server.url + "/v1/completions",
        json={"model": MODEL, "prompt": [f"p{i}" for i in range(12)], "max_tokens": 200},
    )
    err = _error(resp, 503)
    assert resp.headers["retry-after"] == "1" and "max_waiting_requests" in err["message"]
    server.wait_for(lambda: server.metrics()["asyncllm_num_requests_running"] == 0, "idle")
    assert server.client().completions.create(model=MODEL, prompt="x", max_tokens=2).choices


def test_disconnect_mid_stream_aborts_the_request(server):
    conn, lines = stream_lines(
        server.url + "/v1/completions",
        {"model": MODEL, "prompt": "Go on", "max_tokens": 240, "stream": True},
    )
    assert next(line for line in lines if line.startswith("data: {"))
    conn.sock.shutdown(2)  # one chunk, then the client leaves
    conn.close()
    server.wait_for(
        lambda: (
            (m := server.metrics())["asyncllm_num_requests_running"] == 0
            and m["asyncllm_num_requests_waiting"] == 0
            and m["asyncllm_kv_cache_usage_perc"] == 0.0
        ),
        "the aborted request's blocks to come back",
    )


def test_a_client_that_leaves_before_its_answer_aborts_the_request(server):
    """Not streamed: the client closes its connection while the answer is generated;
    the request is aborted (far fewer tokens than asked are generated) and its blocks
    come back."""
    tokens = "asyncllm_generation_tokens_total"
    before = server.metrics()[tokens]
    body = {"model": MODEL, "prompt": "Go on", "max_tokens": 400, "ignore_eos": True}
    conn = _request(
        "POST", server.url + "/v1/completions", json.dumps(body).encode(),
        {"content-type": "application/json"},
    )  # fmt: skip
    server.wait_for(lambda: server.metrics()[tokens] > before, "the answer to start")
    conn.sock.shutdown(2)
    conn.close()
    server.wait_for(
        lambda: (
            (m := server.metrics())["asyncllm_num_requests_running"] == 0
            and m["asyncllm_kv_cache_usage_perc"] == 0.0
        ),
        "the aborted request's blocks to come back",
    )
    assert server.metrics()[tokens] - before < 400


def test_routes_sizes_and_nesting_errors_are_openai_errors(server):
    assert _error(get(server.url + "/v1/nope"), 404)["type"] == "not_found_error"
    _error(get(server.url + "/v1/completions"), 405)
    nested = b'{"model": "default", "prompt": ' + b"[" * 100_000 + b"]" * 100_000 + b"}"
    assert "nested" in _error(post(server.url + "/v1/completions", content=nested), 400)["message"]
    big = b'{"prompt": "' + b"x" * (33 << 20) + b'"}'
    err = _error(post(server.url + "/v1/completions", content=big), 413)
    assert err["code"] == "request_too_large"
    url = server.url + "/v1/completions"
    for field, value in (("min_p", "x"), ("repetition_penalty", [1]), ("stop_token_ids", [1.5])):
        assert _error(post(url, json={"prompt": "x", field: value}), 400)["param"] == field
    opts = {"prompt": "x", "stream": True, "stream_options": {"continuous_usage_stats": True}}
    assert _error(post(url, json=opts), 400)["param"] == "stream_options"
    ok = post(url, json={"prompt": "x", "max_tokens": 3, "temperature": 0, "stop_token_ids": [13]})
    assert ok.status_code == 200 and ok.json()["choices"][0]["finish_reason"] in ("stop", "length")


def test_metrics_parse(server):
    server.client().completions.create(model=MODEL, prompt="x", max_tokens=3)
    families = {
        f.name: f for f in text_string_to_metric_families(get(server.url + "/metrics").text)
    }
    for name in (
        "asyncllm_num_requests_running",
        "asyncllm_num_requests_waiting",
        "asyncllm_kv_cache_usage_perc",
        "asyncllm_prefix_cache_hit_rate",
        "asyncllm_time_to_first_token_seconds",
        "asyncllm_e2e_request_latency_seconds",
        "asyncllm_http_requests",
        # (speculative decoding's: zero on an engine without it)
        "asyncllm_spec_decode_num_drafts",
        "asyncllm_spec_decode_num_accepted_tokens",
        "asyncllm_spec_decode_acceptance_rate",
    ):
        assert name in families, name
    ttft = families["asyncllm_time_to_first_token_seconds"]
    count = next(s.value for s in ttft.samples if s.name.endswith("_count"))
    assert count >= 1
    http = families["asyncllm_http_requests"]
    assert any(s.labels == {"route": "/v1/completions", "status": "200"} for s in http.samples)


def test_api_key_then_sigterm_lets_a_stream_finish():
    """With a key, /v1 needs it (and /health does not); SIGTERM mid-stream lets the
    stream finish, then the server and its engine core exit."""
    s = Server(*INSTANT, "--grace-period", "30", env={"ASYNCLLM_API_KEY": "sekrit"})
    try:
        with pytest.raises(openai.AuthenticationError):
            s.client("wrong").models.list()
        err = _error(get(s.url + "/v1/models"), 401)
        assert err["code"] == "invalid_api_key"
        assert [m.id for m in s.client("sekrit").models.list().data] == [MODEL]
        assert get(s.url + "/health").status_code == 200
        engine = s.engine_pids()
        assert len(engine) == 2
        conn, lines = stream_lines(
            s.url + "/v1/completions",
            {"model": MODEL, "prompt": "Go", "max_tokens": 200, "stream": True},
            {"authorization": "Bearer sekrit"},
        )
        first = next(line for line in lines if line.startswith("data: {"))
        s.proc.send_signal(signal.SIGTERM)
        rest = [line for line in lines if line.startswith("data: ")]
        conn.close()
        chunks = [json.loads(x[6:]) for x in [first, *rest] if x != "data: [DONE]"]
        assert rest[-1] == "data: [DONE]"
        assert chunks[-1]["choices"][0]["finish_reason"] == "length"
        assert sum(len(c["choices"][0]["text"]) > 0 for c in chunks) > 1
        # More SIGTERMs while it shuts down (an impatient supervisor): still a clean
        # exit, the engine shut down first.
        deadline = time.monotonic() + 60
        while s.proc.poll() is None and time.monotonic() < deadline:
            s.proc.send_signal(signal.SIGTERM)
            with contextlib.suppress(subprocess.TimeoutExpired):
                s.proc.wait(timeout=0.01)  # (waits for the exit; signals again if not yet)
    finally:
        rc = s.stop()
    assert rc == 0 and len(engine) == 2
    assert not any(Path(f"/proc/{pid}").exists() for pid in engine)


def test_a_stream_still_open_when_the_grace_period_ends_gets_an_error_event():
    """SIGTERM with no grace period, mid-stream (480 tokens of the embedded model on the
    CPU): the stream ends with a 503 error event and [DONE], not a cut connection, one
    line on stderr names it, and the server and its engine exit cleanly."""
    s = Server("--grace-period", "0")
    try:
        engine = s.engine_pids()
        conn, lines = stream_lines(
            s.url + "/v1/completions",
            {"model": MODEL, "prompt": "Tell a long story.", "max_tokens": 480, "stream": True}
            | {"ignore_eos": True},
        )
        first = next(line for line in lines if line.startswith("data: {"))
        s.proc.send_signal(signal.SIGTERM)
        rest = [line for line in lines if line.startswith("data: ")]
        conn.close()
        assert json.loads(first[6:])["choices"][0]["text"]
        assert rest[-1] == "data: [DONE]"
        error = json.loads(rest[-2][6:])["error"]
        assert error["type"] == "service_unavailable" and "shut down" in error["message"]
    finally:
        rc = s.stop()
    rid = json.loads(first[6:])["id"]
    assert [line for line in s.log.splitlines() if "cut" in line] == [
        f"asyncllm: grace period over: stream {rid} cut (503)"
    ]
    assert "Traceback" not in s.log
    assert rc == 0
    assert not any(Path(f"/proc/{pid}").exists() for pid in engine)


def test_dead_engine_is_503_everywhere():
    s = Server(*INSTANT)
    try:
        (core,) = s.core_pids()
        os.kill(core, signal.SIGKILL)
        s.wait_for(lambda: get(s.url + "/health").status_code == 503, "/health to say 503")
        with pytest.raises(openai.InternalServerError) as dead:
            s.client().completions.create(model=MODEL, prompt="x")
        assert dead.value.status_code == 503
        assert _error(get(s.url + "/v1/models"), 503)["type"] == "service_unavailable"
    finally:
        s.stop()


def test_build_app_refuses_what_is_not_an_async_llm():
    from asyncllm.entrypoints.openai.app import build_app

    with pytest.raises(TypeError, match="AsyncLLM"):
        build_app(object())  # type: ignore[arg-type]


def test_logprobs(server):
    """Greedy, so each sampled token is the first of its top list."""
    client = server.client()
    lp = client.completions.create(
        model=MODEL, prompt="The capital of France is", max_tokens=4, logprobs=2, **G
    )
    got = lp.choices[0].logprobs
    assert len(got.tokens) == 4 and "".join(got.tokens) == lp.choices[0].text
    assert got.text_offset == [sum(len(t) for t in got.tokens[:i]) for i in range(4)]
    for tok, value, top in zip(got.tokens, got.token_logprobs, got.top_logprobs):
        assert len(top) == 2 and value <= 0.0
        assert max(top.values()) == pytest.approx(value) and top[tok] == pytest.approx(value)
    chat = client.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "Hi"}], max_tokens=3,
        logprobs=True, top_logprobs=2, **G,
    )  # fmt: skip
    content = chat.choices[0].logprobs.content
    assert (
        len(content) == 3 and "".join(t.token for t in content) == chat.choices[0].message.content
    )
    for t in content:
        assert [x.token for x in t.top_logprobs][0] == t.token
        assert t.bytes == list(t.token.encode())


def _valid_call(call, tools=(CALC, CLOCK)):
    jsonschema = pytest.importorskip("jsonschema")
    (fn,) = [t["function"] for t in tools if t["function"]["name"] == call.function.name]
    jsonschema.validate(json.loads(call.function.arguments), fn["parameters"])
    assert call.id.startswith("call_") and call.type == "function"


def test_response_format_json_schema_and_json_object(server):
    pytest.importorskip("xgrammar")
    jsonschema = pytest.importorskip("jsonschema")
    schema = {
        "type": "object",
        "properties": {
            "city": {"type": "string", "maxLength": 16},
            "population": {"type": "integer", "minimum": 0, "maximum": 100000000},
        },
        "required": ["city", "population"],
        "additionalProperties": False,
    }
    client = server.client()
    ask = [{"role": "user", "content": "Name a big city and its population as JSON."}]
    out = client.chat.completions.create(
        model=MODEL,
        messages=ask,
        max_tokens=48,
        temperature=0,
        response_format={"type": "json_schema", "json_schema": {"name": "city", "schema": schema}},
    )
    jsonschema.validate(json.loads(out.choices[0].message.content), schema)
    assert out.choices[0].finish_reason == "stop"
    obj = client.chat.completions.create(
        model=MODEL,
        messages=ask,
        max_tokens=48,
        temperature=0,
        response_format={"type": "json_object"},
    )
    assert isinstance(json.loads(obj.choices[0].message.content), dict)
    # vLLM's own field, on the legacy completions route too
    pick = client.completions.create(
        model=MODEL,
        prompt="The sky is",
        max_tokens=8,
        temperature=0,
        extra_body={"structured_outputs": {"choice": ["blue", "green"]}},
    )
    assert pick.choices[0].text in ("blue", "green")


def test_a_forced_tool_call_comes_back_as_tool_calls(server):
    pytest.importorskip("xgrammar")
    client = server.client()
    named = client.chat.completions.create(
        model=MODEL,
        messages=ASK,
        max_tokens=48,
        temperature=0,
        tools=[CALC, CLOCK],
        tool_choice={"type": "function", "function": {"name": "calculator"}},
    )
    choice = named.choices[0]
    (call,) = choice.message.tool_calls
    assert call.function.name == "calculator" and not choice.message.content
    _valid_call(call)
    assert choice.finish_reason == "stop"  # (vLLM: a named function's call ends 'stop')
    required = client.chat.completions.create(
        model=MODEL, messages=ASK, max_tokens=48, temperature=0, tools=[CLOCK],
        tool_choice="required",
    )  # fmt: skip
    (call,) = required.choices[0].message.tool_calls
    _valid_call(call)
    assert required.choices[0].finish_reason == "tool_calls"
    # the call and its result fed back: the fallback template renders both
    again = [
        *ASK,
        {"role": "assistant", "content": None, "tool_calls": [call.model_dump()]},
        {"role": "tool", "tool_call_id": call.id, "content": "12:00"},
    ]
    answer = client.chat.completions.create(
        model=MODEL, messages=again, max_tokens=8, temperature=0, tools=[CLOCK],
        tool_choice="none",
    )  # fmt: skip
    assert answer.choices[0].message.content and not answer.choices[0].message.tool_calls


def test_a_streamed_tool_call_arrives_as_delta_tool_calls(server):
    pytest.importorskip("xgrammar")
    stream = server.client().chat.completions.create(
        model=MODEL,
        messages=ASK,
        max_tokens=48,
        temperature=0,
        tools=[CALC, CLOCK],
        tool_choice="required",
        stream=True,
    )
    chunks = [ch for ch in stream if ch.choices]
    content = "".join(ch.choices[0].delta.content or "" for ch in chunks)
    calls = [tc for ch in chunks for tc in ch.choices[0].delta.tool_calls or []]
    assert content == "" and len(calls) == 1 and calls[0].index == 0
    _valid_call(calls[0])
    assert chunks[-1].choices[0].finish_reason == "tool_calls"
    assert all(ch.choices[0].finish_reason is None for ch in chunks[:-1])


def test_bad_tools_and_formats_are_400s_naming_the_field(server):
    url = server.url + "/v1/chat/completions"
    base = {"model": MODEL, "messages": ASK, "max_tokens": 4}
    cases = [
        ({"tool_choice": "required"}, "tool_choice"),  # no tools
        ({"tools": [{"type": "function"}]}, "tools"),
        ({"tools": [CALC], "tool_choice": {"type": "function", "function": {"name": "x"}}},
         "tool_choice"),
        ({"tools": [CALC], "tool_choice": "sometimes"}, "tool_choice"),
        ({"tools": [CALC], "parallel_tool_calls": "yes"}, "parallel_tool_calls"),
        ({"response_format": {"type": "yaml"}}, "response_format"),
        ({"response_format": {"type": "json_schema", "json_schema": {}}}, "response_format"),
        ({"response_format": {"type": "json_object"}, "structured_outputs": {"regex": "a"}},
         "response_format"),
        ({"structured_outputs": {"regex": "a", "choice": ["b"]}}, "structured_outputs"),
        ({"structured_outputs": {"pattern": "a"}}, "structured_outputs"),
        ({"tools": [CALC], "tool_choice": "required", "response_format": {"type": "json_object"}},
         "tool_choice"),
    ]  # fmt: skip
    for extra, param in cases:
        err = _error(post(url, json={**base, **extra}), 400)
        assert err["param"] == param, (extra, err)
    ok = server.client().chat.completions.create(model=MODEL, messages=ASK, max_tokens=2)
    assert ok.usage.completion_tokens == 2


def test_an_error_in_one_of_several_streams_is_the_one_reported():
    """Several prompts streamed: one request fails while another is still being read;
    the failure (not a complaint about closing the other stream) ends the merge, and
    every stream is closed."""
    import asyncio

    from asyncllm.entrypoints.openai.app import _merge
    from asyncllm.errors import RequestFailedError
    from asyncllm.outputs import RequestOutput

    closed = []

    async def stream(name: str, fail: bool):
        try:
            yield RequestOutput(name, None, [1], [], finished=False)
            if fail:
                await asyncio.sleep(0)
                raise RequestFailedError(f"request {name!r} failed: boom")
            await asyncio.Event().wait()  # (still being read when the other fails)
        finally:
            closed.append(name)

    async def main():
        streams = [stream("a", False), stream("b", True)]
        firsts = [await anext(s) for s in streams]
        with pytest.raises(RequestFailedError, match="boom"):
            async for _ in _merge(streams, firsts):
                pass

    asyncio.run(main())
    assert sorted(closed) == ["a", "b"]


def test_chat_logprob_bytes_rebuild_a_character_split_over_tokens(smollm_tokenizer):
    """A token that holds part of a character (an emoji is several byte-level tokens)
    gives its own bytes, as OpenAI's do: joined, they are the text's UTF-8."""
    from asyncllm.entrypoints.openai import responses as R
    from asyncllm.outputs import CompletionOutput, Logprob

    text = "ok 🎉🎉"
    ids = smollm_tokenizer.encode(text, add_special_tokens=False)
    assert len(ids) > len(text.split())  # (the emoji take more than one token each)
    positions = [{t: Logprob(-0.5, 1, smollm_tokenizer.decode([t]))} for t in ids]
    c = CompletionOutput(0, text, ids, logprobs=positions)
    content = R.chat_logprobs(smollm_tokenizer, c, 1)["content"]
    assert bytes(b for t in content for b in t["bytes"]) == text.encode()
    assert [t["top_logprobs"][0]["bytes"] for t in content] == [t["bytes"] for t in content]


HI = [{"role": "user", "content": "Hi"}]


def test_version_a_model_by_id_and_the_api_description(server):
    from importlib.metadata import version

    from asyncllm import AsyncLLM
    from asyncllm.entrypoints.openai.app import build_app

    assert get(server.url + "/version").json() == {"version": version("asyncllm")}
    client = server.client()
    assert client.models.retrieve(MODEL).id == MODEL
    with pytest.raises(openai.NotFoundError) as missing:
        client.models.retrieve("gpt-4")
    assert missing.value.body["param"] == "model"
    # every route of the app (but the description's own two) is described, each body's
    # schema is there
    doc = get(server.url + "/openapi.json").json()
    routes = {
        (r.path.replace(":path", ""), m.lower())
        for r in build_app(AsyncLLM()).routes
        for m in r.methods - {"HEAD"}
        if r.path not in ("/openapi.json", "/docs")
    }
    assert {(p, m) for p, ops in doc["paths"].items() for m in ops} == routes
    schemas = doc["components"]["schemas"]
    for ops in doc["paths"].values():
        for op in ops.values():
            if "requestBody" in op:
                ref = op["requestBody"]["content"]["application/json"]["schema"]["$ref"]
                assert ref.rsplit("/", 1)[1] in schemas
    chat = schemas["ChatCompletionRequest"]["properties"]
    assert {"messages", "top_logprobs", "max_completion_tokens", "add_generation_prompt"} <= set(
        chat
    )
    assert "servers" not in doc  # (no root path here)
    page = get(server.url + "/docs")
    assert page.headers["content-type"].startswith("text/html")
    assert "swagger-ui" in page.text and '"/openapi.json"' in page.text


def test_tokenize_and_detokenize_as_generation_sees_the_prompt(server):
    client = server.client()
    url = server.url
    text = post(url + "/tokenize", json={"prompt": "Hello world", "return_token_strs": True})
    got = text.json()
    assert got["count"] == len(got["tokens"]) and got["max_model_len"] == 512
    assert len(got["token_strs"]) == got["count"] and got["token_strs"][0] == "Hello"
    done = client.completions.create(model=MODEL, prompt="Hello world", max_tokens=1)
    assert done.usage.prompt_tokens == got["count"]
    chat = post(url + "/tokenize", json={"model": MODEL, "messages": HI}).json()
    assert chat["token_strs"] is None
    answer = client.chat.completions.create(model=MODEL, messages=HI, max_tokens=1)
    assert answer.usage.prompt_tokens == chat["count"]
    rendered = post(url + "/detokenize", json={"tokens": chat["tokens"]}).json()["prompt"]
    assert rendered.endswith("<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n")
    bare = post(url + "/tokenize", json={"messages": HI, "add_generation_prompt": False})
    assert bare.json()["count"] < chat["count"]
    # (SmolLM2's tokenizer adds no special tokens of its own: the same ids)
    both = post(url + "/tokenize", json={"messages": HI, "add_special_tokens": True})
    assert both.json()["tokens"] == chat["tokens"]
    assert _error(post(url + "/detokenize", json={"tokens": [1 << 40]}), 400)["param"] == "tokens"
    assert _error(post(url + "/tokenize", json={"prompt": 5}), 400)["param"] == "prompt"
    # the host asked the tokenizer process: it never built a tokenizer of its own
    maps = Path(f"/proc/{server.proc.pid}/maps").read_text()
    assert "tokenizers" not in maps and "libtorch" not in maps


def test_max_tokens_past_the_context_is_vllms_400(server):
    client = server.client()
    with pytest.raises(openai.BadRequestError) as too_many:
        client.chat.completions.create(model=MODEL, messages=HI, max_completion_tokens=600)
    assert too_many.value.body["param"] == "max_completion_tokens"
    assert too_many.value.body["message"] == (
        "max_completion_tokens=600 cannot be greater than max_model_len=512. "
        "Please request fewer output tokens."
    )
    n = post(server.url + "/tokenize", json={"prompt": "Hi"}).json()["count"]
    # the most that fits is taken (its first chunk read, then the client leaves)
    body = {"model": MODEL, "prompt": "Hi", "max_tokens": 512 - n, "stream": True}
    conn, lines = stream_lines(server.url + "/v1/completions", body)
    assert next(lines).startswith("data: {")
    conn.close()
    with pytest.raises(openai.BadRequestError) as past:
        client.completions.create(model=MODEL, prompt="Hi", max_tokens=513 - n)
    assert past.value.body["param"] == "input_tokens"
    assert past.value.body["message"] == (
        f"This model's maximum context length is 512 tokens. However, you requested "
        f"{513 - n} output tokens and your prompt contains {n} input tokens, for a total of "
        "513 tokens. Please reduce the length of the input prompt or the number of requested "
        "output tokens."
    )


def test_an_engine_refusal_names_the_request_field_that_set_it(server):
    url = server.url
    chat = {"model": MODEL, "messages": HI, "max_tokens": 2}
    err = _error(post(url + "/v1/chat/completions", json={**chat, "logprobs": True,
                                                          "top_logprobs": 50}), 400)  # fmt: skip
    assert err["param"] == "top_logprobs" and err["message"].startswith("top_logprobs is 50")
    err = _error(post(url + "/v1/completions", json={"prompt": "x", "logprobs": 50}), 400)
    assert err["param"] == "logprobs" and err["message"].startswith("logprobs is 50")
    long_chat = {**chat, "messages": [{"role": "user", "content": "hello " * 600}]}
    err = _error(post(url + "/v1/chat/completions", json=long_chat), 400)
    assert err["param"] == "messages" and "max_model_len=512" in err["message"]
    own = {**chat, "chat_template": "{{ messages }}"}
    assert _error(post(url + "/v1/chat/completions", json=own), 400)["param"] == "chat_template"
