"""`asyncllm serve`'s options beside vLLM's, on one model-free server: TLS, CORS, a root
path behind a proxy and a chat template of its own, then Ctrl-C to its whole process
group mid-stream; and a taken port, refused before any engine starts."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.entrypoints.test_openai_server import ENGINE, INSTANT, MODEL, Server

openai = pytest.importorskip("openai")
httpx = pytest.importorskip("httpx2")

ORIGIN = "https://app.example"
TEMPLATE = (
    "{% for m in messages %}[{{ m['role'] }}] {{ m['content'] }}\n{% endfor %}"
    "{% if add_generation_prompt %}[assistant]{% endif %}"
)
HI = [{"role": "user", "content": "Hi"}]


class Proxied:
    """The server, and an HTTPS client that trusts its self-signed certificate."""

    def __init__(self, tmp: Path) -> None:
        key, cert = tmp / "key.pem", tmp / "cert.pem"
        subprocess.run(
            ["/usr/bin/openssl", "req", "-x509", "-newkey", "ec", "-pkeyopt",
             "ec_paramgen_curve:prime256v1", "-nodes", "-days", "1", "-subj", "/CN=localhost",
             "-addext", "subjectAltName=IP:127.0.0.1", "-keyout", key, "-out", cert],
            check=True, capture_output=True,
        )  # fmt: skip
        (tmp / "template.jinja").write_text(TEMPLATE)
        self.server = Server(
            *INSTANT, "--max-model-len", "2048", "--grace-period", "30",
            "--allowed-origins", ORIGIN,
            "--chat-template", str(tmp / "template.jinja"), "--root-path", "/api",
            "--ssl-keyfile", str(key), "--ssl-certfile", str(cert),
            new_session=True,
        )  # fmt: skip
        self.url = self.server.url
        self.http = httpx.Client(verify=str(cert), base_url=self.url)
        self.client = self.server.client(http_client=self.http)


@pytest.fixture(scope="module")
def proxied(tmp_path_factory) -> Iterator[Proxied]:
    p = Proxied(tmp_path_factory.mktemp("tls"))
    try:
        yield p
    finally:
        p.http.close()
        p.server.stop()


def test_tls_cors_root_path_and_chat_template(proxied):
    assert proxied.url.startswith("https://127.0.0.1:")
    assert [m.id for m in proxied.client.models.list().data] == [MODEL]  # over TLS
    http = proxied.http
    # CORS: the origin allowed, and only it
    ask = {
        "access-control-request-method": "POST",
        "access-control-request-headers": "content-type",
    }
    ok = http.options("/v1/chat/completions", headers={"origin": ORIGIN, **ask})
    assert ok.status_code == 200 and ok.headers["access-control-allow-origin"] == ORIGIN
    other = http.options("/v1/chat/completions", headers={"origin": "https://evil.example", **ask})
    assert other.status_code == 400 and "access-control-allow-origin" not in other.headers
    simple = http.get("/version", headers={"origin": ORIGIN})
    assert simple.headers["access-control-allow-origin"] == ORIGIN
    # the proxy strips /api; the description links through it
    assert http.get("/openapi.json").json()["servers"] == [{"url": "/api"}]
    assert '"/api/openapi.json"' in http.get("/docs").text
    # the server's template renders chat completions and /tokenize messages
    ids = http.post("/tokenize", json={"messages": HI}).json()["tokens"]
    assert http.post("/detokenize", json={"tokens": ids}).json() == {
        "prompt": "[user] Hi\n[assistant]"
    }
    answer = proxied.client.chat.completions.create(model=MODEL, messages=HI, max_tokens=2)
    assert answer.usage.prompt_tokens == len(ids)


def test_ctrl_c_to_the_process_group_lets_a_stream_finish(proxied):
    """SIGINT to the server's whole process group (a terminal's Ctrl-C reaches the engine
    core and the tokenizer process too) after a stream's first chunk (2,000 tokens: ~0.6 s
    more of the model-free executor): the stream finishes, not cut, then the server and
    its children exit cleanly."""
    s = proxied.server
    engine = s.engine_pids()
    assert len(engine) == 2
    stream = proxied.client.completions.create(
        model=MODEL, prompt="Go", max_tokens=2000, stream=True
    )
    chunks = iter(stream)
    first = next(chunks)
    os.killpg(os.getpgid(s.proc.pid), signal.SIGINT)
    rest = list(chunks)
    assert first.choices[0].finish_reason is None and rest
    assert rest[-1].choices[0].finish_reason == "length"
    assert s.stop() == 0  # (SIGINT made it exit: stop() only waits)
    assert "cut" not in s.log and "Traceback" not in s.log
    assert not any(Path(f"/proc/{pid}").exists() for pid in engine)


def test_a_taken_port_fails_at_once_before_any_engine_starts():
    """The port is bound before the engine starts: a taken one is a one-line error. The
    model does not exist either, which only the engine would find: that error never
    comes, so no engine started."""
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        cmd = [sys.executable, "-m", "asyncllm.cli.main", "serve", "--port", str(port), *ENGINE]
        done = subprocess.run(
            [*cmd, "--model", "/no/such/model"], capture_output=True, text=True, timeout=120
        )
    assert done.returncode != 0
    (line,) = done.stderr.splitlines()
    assert line.startswith("asyncllm: ")
    assert line.endswith(f"cannot listen on 127.0.0.1:{port}: Address already in use")


def test_a_chat_template_is_a_file_or_the_template_itself(tmp_path):
    from asyncllm.entrypoints.openai.server import load_chat_template

    path = tmp_path / "t.jinja"
    path.write_text(TEMPLATE)
    assert load_chat_template(str(path)) == TEMPLATE
    inline = "{{ messages[0]['content'] }} é → 🎉\\n"  # (a backslash and n: a line break)
    assert load_chat_template(inline) == "{{ messages[0]['content'] }} é → 🎉\n"
    with pytest.raises(ValueError, match="chat_template"):
        load_chat_template(str(tmp_path / "missing.jinja"))
    assert load_chat_template(None) is None
