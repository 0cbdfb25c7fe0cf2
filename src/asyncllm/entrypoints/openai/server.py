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
import math
import signal
import sys
from collections.abc import Iterator
from typing import Any

from asyncllm import envs
from asyncllm.config import EngineArgs

SIGNALS = (signal.SIGINT, signal.SIGTERM)  # each: stop accepting, finish, shut down


async def serve(
    args: EngineArgs,
    host: str = "127.0.0.1",
    port: int = 8000,
    api_key: str | None = None,
    served_model_name: str | None = None,
    grace_period: float = 10.0,
    log_level: str = "warning",
) -> None:
    import uvicorn

    from asyncllm.entrypoints.async_llm import AsyncLLM
    from asyncllm.entrypoints.openai.app import build_app

    if api_key is None:
        api_key = envs.api_key()
    llm = AsyncLLM.from_engine_args(args)
    await llm.start()
    try:
        app = build_app(llm, served_model_name, api_key)
        config = uvicorn.Config(
            app,
            host=host,
            port=port,
            lifespan="off",
            log_level=log_level,
            timeout_graceful_shutdown=math.ceil(grace_period),
        )
        server = _server_class(uvicorn, app.state.openai_server.model_name, host)(config)
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
