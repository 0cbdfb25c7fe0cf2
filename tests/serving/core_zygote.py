"""A warm parent for engine-core processes: it imports what the core imports once, then
forks a real core process (`core_main.main`, signals, parent watch and exit code included)
per request, so a test can run many full process lifetimes without paying the
interpreter's imports each time.

Protocol, one line each way: `start IN OUT` -> `pid N`; `wait N` -> `exit CODE`.
"""

from __future__ import annotations

import os
import sys

from asyncllm.config import EngineArgs
from asyncllm.engine import core_main
from asyncllm.engine.core_config import create_engine_config
from asyncllm.executor.instant import InstantExecutor  # noqa: F401


def _start(input_addr: str, output_addr: str) -> int:
    r, w = os.pipe()  # the child's stdin: EOF when this process dies (its parent watch)
    pid = os.fork()
    if pid == 0:
        os.close(w)
        os.dup2(r, 0)
        os.close(r)
        sys.stdin = open(0, closefd=False)  # nothing of our command buffer
        core_main.main(["--input", input_addr, "--output", output_addr])  # os._exit()s
    os.close(r)
    _pipes[pid] = w
    return pid


_pipes: dict[int, int] = {}


def serve() -> None:
    # Once here, not per child: transformers' lazy config modules and the model folder.
    create_engine_config(EngineArgs(device="cpu", max_model_len=1024))
    print("ready", flush=True)
    for line in sys.stdin:
        cmd, *args = line.split()
        if cmd == "start":
            print(f"pid {_start(*args)}", flush=True)
        elif cmd == "wait":
            pid = int(args[0])
            _, status = os.waitpid(pid, 0)
            os.close(_pipes.pop(pid))
            print(f"exit {os.waitstatus_to_exitcode(status)}", flush=True)


if __name__ == "__main__":
    serve()
