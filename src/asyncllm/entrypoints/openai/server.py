"""`asyncllm serve`: the OpenAI-compatible app on uvicorn, with the engine's life cycle.

The engine starts before the port opens; SIGTERM or Ctrl-C stops accepting connections,
lets streams in flight finish for up to `grace_period` seconds, then shuts the engine
down (a second Ctrl-C cuts the grace period short; signals that come once the engine is
down are ignored while the process exits). It binds to 127.0.0.1 unless told otherwise;
port 0 takes a free port, and the line `asyncllm: serving '<name>' on
http://<host>:<port>` on stderr says which.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import math
import signal
import sys
from collections.abc import Iterator
from typing import Any

from asyncllm import envs
from asyncllm.config import EngineArgs

SIGNALS = (signal.SIGINT, signal.SIGTERM)  # each: stop accepting, finish, shut down
LOG_LEVELS = ("critical", "error", "warning", "info", "debug", "trace")


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


async def serve(args: EngineArgs, server_args: ServerArgs | None = None) -> None:
    sa = server_args or ServerArgs()
    import uvicorn

    from asyncllm.entrypoints.async_llm import AsyncLLM
    from asyncllm.entrypoints.openai.app import build_app

    api_key = sa.api_key if sa.api_key is not None else envs.api_key()
    llm = AsyncLLM.from_engine_args(args)
    await llm.start()
    try:
        app = build_app(llm, sa.served_model_name, api_key)
        config = uvicorn.Config(
            app,
            host=sa.host,
            port=sa.port,
            lifespan="off",
            log_level=sa.log_level,
            timeout_graceful_shutdown=math.ceil(sa.grace_period),
        )
        server = _server_class(uvicorn, app.state.openai_server.model_name, sa.host)(config)
        await server.serve()
    finally:
        await llm.shutdown()
        # The server captured the signals until now (see _server_class); with the
        # engine down there is nothing left to stop: the exiting process ignores them.
        loop = asyncio.get_running_loop()
        for sig in SIGNALS:
            if loop.remove_signal_handler(sig):
                signal.signal(sig, signal.SIG_IGN)


def _server_class(uvicorn: Any, name: str, host: str) -> type:
    """uvicorn's Server, with SIGINT/SIGTERM handled on the loop and not raised again
    after its graceful shutdown (uvicorn's own handlers do, which would end the process
    before the engine is shut down), that says where it listens once it does."""

    class Server(uvicorn.Server):
        async def startup(self, sockets: Any = None) -> None:
            await super().startup(sockets)
            if self.servers:  # (port 0: the one the system chose)
                port = self.servers[0].sockets[0].getsockname()[1]
                print(
                    f"asyncllm: serving {name!r} on http://{host}:{port}",
                    file=sys.stderr,
                    flush=True,
                )

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
