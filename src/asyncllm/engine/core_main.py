"""EngineCoreProc: the engine core's side of the process boundary (its own process).

Started as `python -m asyncllm.engine.core_main --input ADDR --output ADDR` by a client
(never by multiprocessing re-importing the caller's __main__), so user scripts need no
`if __name__ == "__main__"` guard. The first message is EngineStartup (the engine
arguments); the process answers EngineReady (or EngineDead with the reason) once the
model is loaded. `host_launcher` is the other side: it starts this process.

Threads: one decodes input frames into a queue (malformed frames are logged and
dropped), one encodes and sends outputs, and the main thread steps the core while work
exists and blocks on the queue when idle. The process exits when its parent dies (its
stdin, a pipe from the parent, reaches EOF) and on SIGTERM/SIGINT; an exception in the
loop is sent to the client as DEAD before the process exits.
"""

from __future__ import annotations

import argparse
import logging
import os
import queue
import signal
import sys
import threading
from typing import Any

import zmq

from asyncllm import envs
from asyncllm.config import EngineArgs
from asyncllm.engine.arg_utils import create_engine_config
from asyncllm.engine.core import EngineCore
from asyncllm.engine.serial import Decoder, Encoder
from asyncllm.messages import (
    TO_CORE,
    AbortRequests,
    DeadKind,
    EngineCoreOutput,
    EngineCoreOutputs,
    EngineCoreRequest,
    EngineDead,
    EngineReady,
    EngineStartup,
    ErrorKind,
    MsgKind,
    RequestError,
    UtilityCall,
    UtilityResult,
)

logger = logging.getLogger("asyncllm.engine_core")


def _watch_parent() -> None:
    """The parent holds the write end of our stdin; EOF means it is gone."""
    try:
        while sys.stdin.buffer.read(1 << 16):
            pass
    except Exception:  # noqa: BLE001 (any failure to read means the same)
        pass
    os._exit(0)


class _Stop(Exception):
    """SIGTERM or SIGINT arrived: leave the busy loop and exit in order."""


class _Reported(Exception):
    """A failure already sent to the client."""


def _on_signal(signum, frame) -> None:
    # Once: a second signal must not interrupt the orderly exit of the first.
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    raise _Stop(signal.Signals(signum).name)


class EngineCoreProc:
    def __init__(self, input_addr: str, output_addr: str) -> None:
        self.ctx = zmq.Context()
        self.input = self.ctx.socket(zmq.PULL)
        self.input.connect(input_addr)
        self.output = self.ctx.socket(zmq.PUSH)
        self.output.setsockopt(zmq.LINGER, 2000)
        self.output.connect(output_addr)
        self.encoder = Encoder()
        self.in_q: queue.Queue = queue.Queue()
        self.out_q: queue.Queue = queue.Queue()
        self.core: EngineCore | None = None
        self._input_thread: threading.Thread | None = None
        self._output_thread: threading.Thread | None = None

    def send_now(self, msg: Any) -> None:
        self.output.send_multipart(self.encoder.encode(msg), copy=False)

    def start(self) -> EngineCore:
        decoder = Decoder(TO_CORE)
        kind, startup = decoder.decode(self.input.recv_multipart(copy=False))
        if not isinstance(startup, EngineStartup):
            raise RuntimeError(f"expected the engine arguments first, got {kind.name}")
        try:
            engine_args: dict[str, Any] = dict(startup.engine_args)
            config = create_engine_config(EngineArgs(**engine_args))
            core = self.core = EngineCore(config)
        except BaseException as e:  # noqa: BLE001 (every failure goes to the client)
            self.report_death(
                DeadKind.STARTUP_FAILED, f"engine core failed to start: {type(e).__name__}: {e}"
            )
            raise _Reported() from e
        self.send_now(
            EngineReady(
                max_model_len=config.model.max_model_len,
                num_blocks=core.num_blocks,
                block_size=config.cache.block_size,
                vocab_size=int(config.model.hf_config.vocab_size),
            )
        )
        threading.Thread(
            target=self._input_loop, args=(decoder,), daemon=True, name="core-input"
        ).start()
        threading.Thread(target=self._output_loop, daemon=True, name="core-output").start()
        return core

    def _input_loop(self, decoder: Decoder) -> None:
        while True:
            try:
                frames = self.input.recv_multipart(copy=False)
            except zmq.ContextTerminated:
                self.input.close(linger=0)
                return
            try:
                self.in_q.put(decoder.decode([f.buffer for f in frames]))
            except ValueError as e:
                logger.warning("dropped a malformed message: %s", e)

    def _output_loop(self) -> None:
        encoder = Encoder()
        while True:
            item = self.out_q.get()
            if item is None:  # the process is ending: the main thread takes the socket back
                return
            self.output.send_multipart(encoder.encode(item), copy=False)

    def report_death(self, kind: DeadKind, reason: str) -> None:
        """Sends EngineDead behind any pending outputs, then stops the output thread."""
        if self._output_thread is None:
            self.send_now(EngineDead(kind, reason))
            return
        self.out_q.put(EngineDead(kind, reason))
        self.out_q.put(None)
        self._output_thread.join(timeout=5.0)

    def close(self) -> None:
        """Flushes what was sent (linger) before the process exits. A socket still in use
        by a stuck thread is left alone: the process exits regardless."""
        if self._output_thread is not None and self._output_thread.is_alive():
            return
        self.output.close(linger=2000)
        if self._input_thread is None:
            self.input.close(linger=0)
        self.ctx.term()

    def _handle(self, core: EngineCore, kind: MsgKind, obj: Any) -> None:
        if isinstance(obj, EngineCoreRequest):
            try:
                core.add_request(obj)
            except (ValueError, TypeError) as e:
                error = RequestError(ErrorKind.INVALID, str(e))
                err = EngineCoreOutput(obj.request_id, [], finish_reason="abort", error=error)
                self.out_q.put(EngineCoreOutputs(outputs=[err]))
        elif isinstance(obj, AbortRequests):
            core.abort_requests(obj.request_ids)
        elif isinstance(obj, UtilityCall):
            self.out_q.put(self._utility(core, obj))
        else:
            logger.warning("ignored a %s message", kind.name)

    def _utility(self, core: EngineCore, call: UtilityCall) -> UtilityResult:
        try:
            if call.method == "ping":
                return UtilityResult(call.call_id, "pong")
            if call.method == "get_stats":
                return UtilityResult(call.call_id, core.get_stats())
            if call.method == "reset_prefix_cache":
                return UtilityResult(call.call_id, core.reset_prefix_cache())
            return UtilityResult(call.call_id, error=f"unknown utility {call.method!r}")
        except Exception as e:  # noqa: BLE001 (reported to the caller)
            return UtilityResult(call.call_id, error=f"{type(e).__name__}: {e}")

    def run_busy_loop(self, core: EngineCore) -> None:
        while True:
            if not core.has_unfinished_requests() and not core.has_pending_outputs():
                self._handle(core, *self.in_q.get())
            while True:
                try:
                    self._handle(core, *self.in_q.get_nowait())
                except queue.Empty:
                    break
            if core.has_unfinished_requests() or core.has_pending_outputs():
                self.out_q.put(core.step())


def main() -> None:
    parser = argparse.ArgumentParser(description="asyncllm engine core process")
    parser.add_argument("--input", required=True)
    parser.add_argument("--output", required=True)
    args = parser.parse_args()
    logging.basicConfig(
        level=envs.log_level(),
        stream=sys.stderr,
        format="%(asctime)s engine-core %(levelname)s %(message)s",
    )
    threading.Thread(target=_watch_parent, daemon=True, name="parent-watch").start()
    signal.signal(signal.SIGTERM, _on_signal)
    signal.signal(signal.SIGINT, _on_signal)
    proc = EngineCoreProc(args.input, args.output)
    code = 0
    try:
        proc.run_busy_loop(proc.start())
    except _Stop as e:
        proc.report_death(DeadKind.STOPPED, f"engine core stopped by {e}")
    except _Reported:
        code = 1
    except BaseException as e:  # noqa: BLE001
        logger.exception("engine core failed")
        proc.report_death(DeadKind.CRASHED, f"engine core died: {type(e).__name__}: {e}")
        code = 1
    finally:
        try:
            proc.close()
        finally:
            os._exit(code)


if __name__ == "__main__":
    main()
