"""`asyncllm serve`: the OpenAI-compatible app on uvicorn, with the engine's life cycle.

The port is bound first (a port that is taken fails at once, before the engine loads),
then the engine starts and the port opens. SIGTERM or Ctrl-C (SIGINT, to the process or
its whole group) stops accepting connections and lets responses in flight finish for up
to `grace_period` seconds; each one still open then is cut (a line on stderr names it; a
stream gets a 503 error event, then [DONE]) and the engine shuts down. A second Ctrl-C
ends the grace period at once; signals that come once the engine is down are ignored
while the process exits. It binds to 127.0.0.1 unless told otherwise; port 0 takes a
free port, and the line `asyncllm: serving '<name>' on http(s)://<host>:<port>` on
stderr says which.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import math
import signal
import socket
import sys
from collections.abc import Awaitable, Callable, Iterator
from typing import Any

from asyncllm import envs
from asyncllm.config import EngineArgs

SIGNALS = (signal.SIGINT, signal.SIGTERM)  # each: stop accepting, finish, shut down
LOG_LEVELS = ("critical", "error", "warning", "info", "debug", "trace")
STALLED_S = 5  # after the cut, how long a client that does not read its end is waited for


@dataclasses.dataclass
class ServerArgs:
    """The server's own settings (`asyncllm serve` makes one flag of each field)."""

    host: str = "127.0.0.1"
    """the address to listen on"""
    port: int = 8000
    """the port to listen on (0: a free one, named on stderr)"""
    api_key: str | None = None
    """require this bearer key on /v1 (or the ASYNCLLM_API_KEY environment variable)"""
    served_model_name: str | None = None
    """the model's name in the API (default: the model's path, "default" for the embedded one)"""
    grace_period: float = 10.0
    """seconds that open streams may finish after SIGTERM or Ctrl-C"""
    log_level: str = "warning"
    """uvicorn's log level: critical, error, warning, info, debug or trace"""
    allowed_origins: list[str] = dataclasses.field(default_factory=lambda: ["*"])
    """CORS: the origins browsers may call the API from ("*", the default: any)"""
    allowed_methods: list[str] = dataclasses.field(default_factory=lambda: ["*"])
    """CORS: the methods allowed from other origins ("*", the default: any)"""
    allowed_headers: list[str] = dataclasses.field(default_factory=lambda: ["*"])
    """CORS: the request headers allowed from other origins ("*", the default: any)"""
    allow_credentials: bool = False
    """CORS: let other origins send credentials (cookies, authorization)"""
    chat_template: str | None = None
    """the chat template for chat completions and /tokenize: a file's path, or the Jinja
    template itself (default: the model's)"""
    root_path: str = ""
    """the path prefix a proxy serves the API under, which it strips (ASGI root_path):
    /docs and /openapi.json link through it"""
    ssl_keyfile: str | None = None
    """TLS: the private key's file (PEM)"""
    ssl_certfile: str | None = None
    """TLS: the certificate chain's file (PEM); with it the server speaks https"""

    def __post_init__(self) -> None:
        g = self.grace_period
        if isinstance(g, bool) or not isinstance(g, int | float) or not math.isfinite(g) or g < 0:
            raise ValueError(f"grace_period must be a finite number of seconds >= 0, got {g}")
        if self.log_level not in LOG_LEVELS:
            raise ValueError(
                f"log_level must be one of {', '.join(LOG_LEVELS)}, got {self.log_level!r}"
            )
        if not 0 <= self.port <= 65535:
            raise ValueError(f"port must be in 0..65535, got {self.port}")
        for name in ("allowed_origins", "allowed_methods", "allowed_headers"):
            value = getattr(self, name)
            if not isinstance(value, list | tuple) or not all(isinstance(v, str) for v in value):
                raise ValueError(f"{name} must be a list of str, got {value!r}")
        if self.root_path and (not self.root_path.startswith("/") or self.root_path.endswith("/")):
            raise ValueError(
                f"root_path must start with '/' and not end with one, got {self.root_path!r}"
            )
        if self.ssl_keyfile is not None and self.ssl_certfile is None:
            raise ValueError("ssl_keyfile needs ssl_certfile")


def load_chat_template(value: str | None) -> str | None:
    """The template `--chat-template` names: a file's contents or, if no file opens and
    the text looks like a template (it has braces or a line break), the text itself with
    its backslash escapes read (as vLLM does)."""
    if value is None:
        return None
    try:
        with open(value, encoding="utf-8") as f:
            return f.read()
    except OSError as e:
        if not any(c in value for c in "{}\n"):
            raise ValueError(f"chat_template {value!r} is no file that opens: {e}") from None
    # (a character past Latin-1 goes through as an escape of its own)
    return value.encode("latin-1", "backslashreplace").decode("unicode_escape")


def bind(host: str, port: int) -> socket.socket:
    """A socket bound to host:port, not yet listening (connections are refused until
    the engine is up); ValueError naming host:port if it cannot be."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind((host, port))
    except OSError as e:
        sock.close()
        raise ValueError(f"cannot listen on {host}:{port}: {e.strerror or e}") from None
    return sock


async def serve(args: EngineArgs, server_args: ServerArgs | None = None) -> None:
    sa = server_args or ServerArgs()
    import uvicorn
    from starlette.middleware.cors import CORSMiddleware

    from asyncllm.entrypoints.async_llm import AsyncLLM
    from asyncllm.entrypoints.openai.app import build_app

    api_key = sa.api_key if sa.api_key is not None else envs.api_key()
    llm = AsyncLLM.from_engine_args(args)
    app = build_app(
        llm, sa.served_model_name, api_key, chat_template=load_chat_template(sa.chat_template)
    )
    app.add_middleware(
        CORSMiddleware,
        allow_origins=sa.allowed_origins,
        allow_methods=sa.allowed_methods,
        allow_headers=sa.allowed_headers,
        allow_credentials=sa.allow_credentials,
    )
    config = uvicorn.Config(
        app,
        lifespan="off",
        log_level=sa.log_level,
        root_path=sa.root_path,
        ssl_keyfile=sa.ssl_keyfile,
        ssl_certfile=sa.ssl_certfile,
        # (the cut, below, ends what is left at the grace period's end; this is for a
        # client that does not read its answer's end)
        timeout_graceful_shutdown=math.ceil(sa.grace_period) + STALLED_S,
    )
    try:
        config.load()  # (the TLS files are read here: before the engine loads)
    except OSError as e:
        raise ValueError(f"ssl_certfile / ssl_keyfile cannot be used: {e}") from None
    sock = bind(sa.host, sa.port)
    openai_server = app.state.openai_server

    async def cut() -> None:
        """The grace period is over: what is still open is cut, a line each."""
        for rid, kind in sorted(openai_server.open.items()):
            print(f"asyncllm: grace period over: {kind} {rid} cut (503)", file=sys.stderr)
        sys.stderr.flush()
        await llm.shutdown()  # (each generation fails: the streams send their error event)

    try:
        await llm.start()
        try:
            scheme = "https" if sa.ssl_certfile else "http"
            where = f"{scheme}://[{sa.host}]" if ":" in sa.host else f"{scheme}://{sa.host}"
            server = _server_class(uvicorn, openai_server.model_name, where, sa.grace_period, cut)
            await server(config).serve(sockets=[sock])
        finally:
            await llm.shutdown()
            # The server captured the signals until now (see _server_class); with the
            # engine down there is nothing left to stop: the exiting process ignores them.
            loop = asyncio.get_running_loop()
            for sig in SIGNALS:
                if loop.remove_signal_handler(sig):
                    signal.signal(sig, signal.SIG_IGN)
    finally:
        sock.close()


def _server_class(
    uvicorn: Any, name: str, where: str, grace: float, cut: Callable[[], Awaitable[None]]
) -> type:
    """uvicorn's Server, with SIGINT/SIGTERM handled on the loop and not raised again
    after its graceful shutdown (uvicorn's own handlers do, which would end the process
    before the engine is shut down), which says where it listens once it does and cuts
    what is still open when the grace period ends (or at a second Ctrl-C)."""

    class Server(uvicorn.Server):
        should_exit: bool  # (uvicorn's)

        def __init__(self, config: Any) -> None:
            super().__init__(config)
            self.grace_over = asyncio.Event()  # (set early by a second Ctrl-C)

        async def startup(self, sockets: Any = None) -> None:
            await super().startup(sockets)
            if self.servers:  # (port 0: the one the system chose)
                port = self.servers[0].sockets[0].getsockname()[1]
                print(f"asyncllm: serving {name!r} on {where}:{port}", file=sys.stderr, flush=True)

        def handle_exit(self, sig: int, frame: Any) -> None:
            if self.should_exit and sig == signal.SIGINT:  # a second Ctrl-C
                self.grace_over.set()
            self.should_exit = True

        async def shutdown(self, sockets: Any = None) -> None:
            cutter = asyncio.ensure_future(self._cut_when_over())
            try:
                await super().shutdown(sockets)
            finally:
                if self.grace_over.is_set():
                    await cutter  # (cutting: the engine's shutdown goes on to its end)
                else:
                    cutter.cancel()

        async def _cut_when_over(self) -> None:
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self.grace_over.wait(), grace)
            self.grace_over.set()
            await cut()

        @contextlib.contextmanager
        def capture_signals(self) -> Iterator[None]:
            # Left in place when serving ends: `serve()` removes them once the engine
            # is shut down, so that a signal repeated meanwhile cannot end the process
            # with the engine still up.
            loop = asyncio.get_running_loop()
            for sig in SIGNALS:
                loop.add_signal_handler(sig, self.handle_exit, sig, None)
            yield

    return Server
