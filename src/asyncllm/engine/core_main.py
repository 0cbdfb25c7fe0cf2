"""EngineCoreProc: the engine core's side of the process boundary (its own process).

Started as `python -m asyncllm.engine.core_main --input ADDR --output ADDR` by a client
(never by multiprocessing re-importing the caller's __main__), so user scripts need no
`if __name__ == "__main__"` guard. The first message is EngineStartup (the engine
arguments); the process resolves them (the model's folder and config, the device, the
dtype: the host imports none of what that takes) and answers ResolvedConfig, then
EngineReady once the model is loaded (or EngineDead with the reason, at any point). `host_launcher` is the other side: it starts this process.

Threads: one decodes input frames into a queue (a malformed frame is logged and dropped;
one for a request or a utility call whose id can still be read ends that request or call
with an error), one encodes and sends outputs, and the main thread steps the core while
work exists and blocks on the queue when idle. The process exits when its parent dies (its
stdin, a pipe from the parent, reaches EOF) and on SIGTERM; a terminal's SIGINT and SIGHUP
are the host's and ignored here (see `host_launcher.start_child`). An exception in the
loop or in either I/O thread is sent to the client as DEAD before the process exits, so
the core never lives on half dead; so is an executor's failure reported from its own
thread (a worker process died: `Executor.register_failure_callback`), which wakes an
idle loop. On the way out the I/O threads are stopped and joined before their sockets
close, the engine core is shut down (an executor's workers end), and the private folder
holding the sockets is removed.
"""

from __future__ import annotations

import argparse
import dataclasses
import logging
import os
import queue
import signal
import sys
import threading
import time
from typing import Any

import zmq

from asyncllm import envs
from asyncllm.child_process import ignore_terminal_signals
from asyncllm.config import EngineArgs
from asyncllm.engine.core import EngineCore
from asyncllm.engine.core_config import create_engine_config, resolved_config
from asyncllm.engine.heap import freeze_startup_objects, trim_heap, unfreeze_objects
from asyncllm.engine.host_launcher import remove_private_ipc_dir
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


def _watch_parent(proc: EngineCoreProc) -> None:
    """The parent holds the write end of our stdin; EOF means it is gone. Nobody is left
    to hear from us: remove the socket folder and exit at once."""
    try:
        while sys.stdin.buffer.read(1 << 16):
            pass
    except Exception:  # noqa: BLE001 (any failure to read means the same)
        pass
    proc.remove_ipc_dir()
    os._exit(0)


class _Stop(Exception):
    """SIGTERM arrived: leave the busy loop and exit in order."""


class _Reported(Exception):
    """A failure already sent to the client."""


class _IOThreadFailed(Exception):
    """An input or output thread died: the core cannot serve and must say so."""


@dataclasses.dataclass(frozen=True)
class _Control:
    """Put on the input queue by a signal or a failed I/O thread, for the main thread."""

    reason: str
    failed: bool  # an I/O thread died (else: a signal asked us to stop)
    error: BaseException | None = None  # the executor failed (a worker died): raised as is


@dataclasses.dataclass(frozen=True)
class _Undecodable:
    """A request or utility call whose message could not be decoded, by its id."""

    ident: str | int
    reason: str


JOIN_S = 3.0  # how long shutdown waits for each I/O thread (the host kills us after 5 s)
_WAKE_ADDR = "inproc://core-input-wake"
TRIM_EVERY_STEPS = 2000  # heap trims while the core never goes idle (see heap.trim_heap)
# An idle core trims its heap once no work came for this long: a trim takes milliseconds
# and holds the allocator's locks, so work that comes back sooner (the next burst, the
# output thread still sending the last step) does not wait behind one.
TRIM_AFTER_IDLE_S = 0.5


class EngineCoreProc:
    def __init__(self, input_addr: str, output_addr: str) -> None:
        self.input_addr, self.output_addr = input_addr, output_addr
        self.ctx = zmq.Context()
        self.input = self.ctx.socket(zmq.PULL)
        self.input.connect(input_addr)
        self.output = self.ctx.socket(zmq.PUSH)
        self.output.setsockopt(zmq.LINGER, 2000)
        self.output.connect(output_addr)
        # The main thread wakes the input thread through this pair to stop it; each end
        # is used by one thread only.
        self._wake_rx = self.ctx.socket(zmq.PAIR)
        self._wake_rx.bind(_WAKE_ADDR)
        self._wake_tx = self.ctx.socket(zmq.PAIR)
        self._wake_tx.connect(_WAKE_ADDR)
        self.encoder = Encoder()
        # A SimpleQueue: its put is reentrant, so a signal handler may put on it while
        # the main thread is inside get.
        self.in_q: queue.SimpleQueue = queue.SimpleQueue()
        self.out_q: queue.Queue = queue.Queue()
        self.core: EngineCore | None = None
        self._input_thread: threading.Thread | None = None
        self._output_thread: threading.Thread | None = None
        self._runner: threading.Thread | None = None  # the thread in run()
        self._serving = False  # the I/O threads run: stop requests go through the queue
        self._output_failed = False
        self._closed = False
        # A failed start is being reported: the host, told, sends SIGTERM, which must not
        # interrupt the way out (report_death, shutdown) of the thread it would run in.
        self._start_failed = False

    # -- life cycle --------------------------------------------------------------------

    def send_now(self, msg: Any) -> None:
        """Sends from the calling thread: only while no output thread uses the socket."""
        assert self._output_thread is None or not self._output_thread.is_alive()
        self.output.send_multipart(self.encoder.encode(msg), copy=False)

    def start(self) -> EngineCore:
        decoder = Decoder(TO_CORE)
        kind, startup = decoder.decode(self.input.recv_multipart(copy=False))
        if not isinstance(startup, EngineStartup):
            raise RuntimeError(f"expected the engine arguments first, got {kind.name}")
        try:
            t0 = time.monotonic()
            engine_args: dict[str, Any] = dict(startup.engine_args)
            config = create_engine_config(EngineArgs(**engine_args))
            self.send_now(resolved_config(config))  # the host starts its tokenizer now
            t1 = time.monotonic()
            core = self.core = EngineCore(config)
            stages = {"core: engine config": t1 - t0}
            worker = core.executor.startup_seconds()
            stages.update({f"core: {k}": v for k, v in worker.items()})
            stages["core: the rest of EngineCore()"] = time.monotonic() - t1 - sum(worker.values())
        except _Stop:
            raise
        except BaseException as e:  # noqa: BLE001 (every failure goes to the client)
            self._start_failed = True
            self.report_death(
                DeadKind.STARTUP_FAILED,
                f"engine core failed to start: {type(e).__name__}: {e}",
                type(e).__name__,
            )
            raise _Reported() from e
        self._input_thread = threading.Thread(
            target=self._input_loop, args=(decoder,), daemon=True, name="core-input"
        )
        self._output_thread = threading.Thread(
            target=self._output_loop, daemon=True, name="core-output"
        )
        self._input_thread.start()
        self._output_thread.start()
        # An executor that loses a worker while the core is idle wakes the loop to die.
        core.executor.register_failure_callback(
            lambda e: self.in_q.put(_Control(str(e), failed=True, error=e))
        )
        self._serving = True
        self.out_q.put(EngineReady(num_blocks=core.num_blocks, startup_seconds=stages))
        return core

    def run(self) -> int:
        """Starts the core, serves until stopped or failed, then shuts down in order;
        the process's exit code."""
        self._runner = threading.current_thread()
        code = 0
        try:
            core = self.start()
            freeze_startup_objects()
            self.run_busy_loop(core)
        except _Stop as e:
            self.report_death(DeadKind.STOPPED, f"engine core stopped by {e}")
        except _Reported:
            code = 1
        except BaseException as e:  # noqa: BLE001
            logger.exception("engine core failed")
            self.report_death(DeadKind.CRASHED, f"engine core died: {type(e).__name__}: {e}")
            code = 1
        finally:
            try:
                self.shutdown()
            finally:
                self.shutdown_core()
                unfreeze_objects()
                self.remove_ipc_dir()
        return code

    def shutdown_core(self) -> None:
        """Releases the engine core: its executor's workers, the grammar process."""
        if self.core is None:
            return
        try:
            self.core.shutdown()
        except Exception:  # noqa: BLE001 (the exit goes on)
            logger.exception("the engine core's shutdown failed")

    def on_signal(self, signum: int, frame: Any) -> None:
        # Once: a second signal must not interrupt the orderly exit of the first.
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
        self.request_stop(signal.Signals(signum).name)

    def request_stop(self, reason: str) -> None:
        """Leaves the busy loop in order; from any thread, or from a signal handler, which
        runs in the thread that runs the core: there, before the I/O threads exist (while
        the model loads), it interrupts what that thread does (unless a failed start is
        on its way out already)."""
        if self._start_failed:
            return
        if not self._serving and threading.current_thread() is self._runner:
            raise _Stop(reason)
        self.in_q.put(_Control(reason, failed=False))

    def report_death(self, kind: DeadKind, reason: str, error_type: str | None = None) -> None:
        """Sends EngineDead behind any pending outputs (through the output thread while it
        lives, as its last message); never raises: the exit must go on."""
        try:
            out = self._output_thread
            if out is not None and not self._output_failed and out.is_alive():
                self.out_q.put(EngineDead(kind, reason, error_type))
                self.out_q.put(None)
                return
            if out is not None:
                out.join(JOIN_S)  # a failed output thread is on its way out
            self.send_now(EngineDead(kind, reason, error_type))
        except Exception:  # noqa: BLE001
            logger.exception("could not report the engine core's death")

    def shutdown(self) -> None:
        """Stops the I/O threads and joins them, then closes the sockets and ends the
        context (flushing what was sent, within the output socket's linger). A socket a
        stuck thread still uses is left alone: the process exits regardless."""
        if self._closed:
            return
        self._closed = True
        self.out_q.put(None)
        try:
            self._wake_tx.send(b"", flags=zmq.NOBLOCK)
        except zmq.ZMQError:
            pass
        stuck = []
        for t in (self._input_thread, self._output_thread):
            if t is not None:
                t.join(JOIN_S)
                if t.is_alive():
                    stuck.append(t.name)
        if stuck:
            logger.warning("I/O thread(s) %s did not stop; sockets left open", stuck)
            return
        for sock in (self.input, self._wake_rx, self._wake_tx):
            sock.close(linger=0)
        self.output.close(linger=2000)
        self.ctx.term()

    def remove_ipc_dir(self) -> None:
        """Removes the host's private socket folder (the host may be gone: killed hosts
        clean nothing up); a folder that does not look like ours is left alone."""
        try:
            remove_private_ipc_dir(self.input_addr, self.output_addr)
        except Exception:  # noqa: BLE001
            logger.exception("could not remove the socket folder")

    # -- I/O threads -------------------------------------------------------------------

    def _input_loop(self, decoder: Decoder) -> None:
        """Decodes frames into the queue until woken to stop. A frame that cannot be
        decoded is dropped (its request or call answered with an error when its id can
        be read); any other failure here kills the engine, loudly."""
        try:
            poller = zmq.Poller()
            poller.register(self.input, zmq.POLLIN)
            poller.register(self._wake_rx, zmq.POLLIN)
            while True:
                ready = dict(poller.poll())
                if self._wake_rx in ready:
                    return
                while True:
                    try:
                        frames = self.input.recv_multipart(flags=zmq.NOBLOCK, copy=False)
                    except zmq.Again:
                        break
                    item = self._decode(decoder, frames)
                    if item is not None:
                        self.in_q.put(item)
        except BaseException as e:  # noqa: BLE001 (reported, then the core exits)
            logger.exception("the engine core's input thread failed")
            self.in_q.put(_Control(f"input thread failed: {type(e).__name__}: {e}", True))

    @staticmethod
    def _decode(decoder: Decoder, frames: list[zmq.Frame]) -> Any:
        try:
            return decoder.decode([f.buffer for f in frames])
        except Exception as e:  # noqa: BLE001 (whatever a hostile frame makes decoding raise)
            ident = getattr(e, "ident", None)
            if ident is None:
                logger.warning("dropped a malformed message: %s", e)
                return None
            logger.warning("refused a malformed message for %r: %s", ident, e)
            return e.kind, _Undecodable(ident, str(e))  # type: ignore[attr-defined]

    def _output_loop(self) -> None:
        """Encodes and sends until given None. If it fails, the main thread learns of it
        and reports the death itself (this thread is gone by then)."""
        encoder = Encoder()
        try:
            while True:
                item = self.out_q.get()
                if item is None:
                    return
                self.output.send_multipart(encoder.encode(item), copy=False)
        except BaseException as e:  # noqa: BLE001 (reported, then the core exits)
            logger.exception("the engine core's output thread failed")
            self._output_failed = True  # before the main thread hears of it
            self.in_q.put(_Control(f"output thread failed: {type(e).__name__}: {e}", True))

    # -- the busy loop -----------------------------------------------------------------

    def _handle(self, core: EngineCore, item: Any) -> None:
        if isinstance(item, _Control):
            if item.error is not None:
                raise item.error
            if item.failed:
                raise _IOThreadFailed(item.reason)
            raise _Stop(item.reason)
        kind, obj = item
        if isinstance(obj, EngineCoreRequest):
            try:
                core.add_request(obj)
            except (ValueError, TypeError) as e:
                self._refuse(obj.request_id, str(e))
        elif isinstance(obj, _Undecodable):
            if kind is MsgKind.ADD:
                self._refuse(str(obj.ident), obj.reason)
            else:
                self.out_q.put(UtilityResult(int(obj.ident), error=obj.reason))
        elif isinstance(obj, AbortRequests):
            core.abort_requests(obj.request_ids)
        elif isinstance(obj, UtilityCall):
            self.out_q.put(self._utility(core, obj))
        else:
            logger.warning("ignored a %s message", kind.name)

    def _refuse(self, request_id: str, reason: str) -> None:
        error = RequestError(ErrorKind.INVALID, reason)
        err = EngineCoreOutput(request_id, [], finish_reason="abort", error=error)
        self.out_q.put(EngineCoreOutputs(outputs=[err]))

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
        steps = 0
        while True:
            if not core.has_unfinished_requests() and not core.has_pending_outputs():
                item = None
                if steps:  # idle after work: return freed heap memory if it stays idle
                    try:
                        item = self.in_q.get(timeout=TRIM_AFTER_IDLE_S)
                    except queue.Empty:
                        trim_heap()
                        steps = 0
                self._handle(core, self.in_q.get() if item is None else item)
            while True:
                try:
                    self._handle(core, self.in_q.get_nowait())
                except queue.Empty:
                    break
            if core.has_unfinished_requests() or core.has_pending_outputs():
                self.out_q.put(core.step())
                steps += 1
                if steps % TRIM_EVERY_STEPS == 0:  # never idle: trim now and then anyway
                    trim_heap()


def main(argv: list[str] | None = None) -> None:
    ignore_terminal_signals()
    parser = argparse.ArgumentParser(description="asyncllm engine core process")
    parser.add_argument("--input", required=True)
    parser.add_argument("--output", required=True)
    args = parser.parse_args(argv)
    logging.basicConfig(
        level=envs.log_level(),
        stream=sys.stderr,
        format="%(asctime)s engine-core %(levelname)s %(message)s",
    )
    proc = EngineCoreProc(args.input, args.output)
    threading.Thread(target=_watch_parent, args=(proc,), daemon=True, name="parent-watch").start()
    signal.signal(signal.SIGTERM, proc.on_signal)
    code = 1
    try:
        code = proc.run()
    finally:
        os._exit(code)


if __name__ == "__main__":
    main()
