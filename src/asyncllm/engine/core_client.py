"""How a frontend talks to an engine core. One interface; the in-process client here,
process-separated clients beside it."""

from __future__ import annotations

import asyncio
import itertools
import time
from abc import ABC, abstractmethod
from collections import deque
from collections.abc import Callable
from typing import Any

import msgspec
import zmq
import zmq.asyncio

from asyncllm.config import EngineArgs, EngineConfig
from asyncllm.engine.core import EngineCore
from asyncllm.engine.host_launcher import CoreProcess, startup_message
from asyncllm.engine.serial import Decoder, Encoder
from asyncllm.errors import EngineDeadError, EngineStartupError
from asyncllm.messages import (
    FROM_CORE,
    AbortRequests,
    EngineCoreOutputs,
    EngineCoreRequest,
    EngineDead,
    EngineReady,
    MsgKind,
    SchedulerStats,
    UtilityCall,
    UtilityResult,
)

POLL_S = 0.25  # how often a waiting client checks that the core process lives


class EngineCoreClient(ABC):
    """How LLMEngine drives an engine core: in this process or in its own."""

    @abstractmethod
    def __init__(self, config: EngineConfig, args: EngineArgs) -> None: ...

    @abstractmethod
    def add_request(self, request: EngineCoreRequest) -> None: ...

    @abstractmethod
    def abort_requests(self, request_ids: list[str]) -> None: ...

    @abstractmethod
    def get_output(self) -> EngineCoreOutputs: ...

    def settle(self) -> None:  # noqa: B027 (an optional hook)
        """Called when the frontend has no request left: a core in this process applies
        its steps still in flight (of requests that have ended), so their blocks come
        back although nothing steps it. A core in its own process does so itself."""

    @abstractmethod
    def get_stats(self) -> SchedulerStats: ...

    @abstractmethod
    def reset_prefix_cache(self) -> bool: ...

    @abstractmethod
    def shutdown(self) -> None: ...


class InprocClient(EngineCoreClient):
    """The engine core in this process: `get_output` runs one step."""

    def __init__(self, config: EngineConfig, args: EngineArgs | None = None) -> None:
        self.core = EngineCore(config)  # `args` is for the process clients: all is in config

    def add_request(self, request: EngineCoreRequest) -> None:
        self.core.add_request(request)

    def abort_requests(self, request_ids: list[str]) -> None:
        if request_ids:
            self.core.abort_requests(request_ids)

    def get_output(self) -> EngineCoreOutputs:
        return self.core.step()

    def settle(self) -> None:
        self.core.apply_steps_in_flight()

    def get_stats(self) -> SchedulerStats:
        return self.core.get_stats()

    def reset_prefix_cache(self) -> bool:
        return self.core.reset_prefix_cache()

    def shutdown(self) -> None:
        self.core.shutdown()


class _MPClientBase:
    """What both process clients share: the process, the input socket, the codec.

    Both bind the output socket with no receive high-water mark: a PULL socket at its
    limit stops reading its unix socket, and when the core exits then (closing its end),
    libzmq drops the connection with whatever was still unread in it, so the core's last
    outputs and its EngineDead vanish (seen in about 1 of 50 stops mid-stream). Unlimited,
    everything the core sent is read in before the connection ends."""

    def __init__(self, config: EngineConfig, args: EngineArgs) -> None:
        self.args = args
        self.hf_fields = config.model.hf_config.to_dict()  # (the core reads no config.json)
        self.process = CoreProcess()
        self.zmq_ctx = zmq.Context()
        self.input = self.zmq_ctx.socket(zmq.PUSH)
        self.input.setsockopt(zmq.SNDHWM, 0)  # sends never block the caller
        self.input.setsockopt(zmq.LINGER, 0)
        self.input.bind(self.process.input_addr)
        self.encoder = Encoder()
        self.decoder = Decoder(FROM_CORE)
        self.info: EngineReady | None = None
        self.dead_reason: str | None = None
        self._call_ids = itertools.count()

    def _send(self, msg: EngineCoreRequest | AbortRequests | UtilityCall) -> None:
        """Never blocks: a PUSH socket only refuses when the core is not connected,
        which after startup means it is gone."""
        if self.dead_reason is not None:
            raise EngineDeadError(self.dead_reason)
        frames = self.encoder.encode(msg)
        for _ in range(100):
            try:
                self.input.send_multipart(frames, copy=False, flags=zmq.NOBLOCK)
                return
            except zmq.Again:
                self._check_process()
                time.sleep(0.001)
        raise EngineDeadError("the engine core does not take input")

    def _try_send_config(self) -> bool:
        """The engine arguments, once the core has connected (a PUSH socket cannot queue
        before its peer exists, and a blocking send would stall the caller)."""
        self._check_process()
        try:
            self.input.send_multipart(
                self.encoder.encode(startup_message(self.args, self.hf_fields)),
                flags=zmq.NOBLOCK,
            )
            return True
        except zmq.Again:
            return False

    def add_request(self, request: EngineCoreRequest) -> None:
        self._send(request)

    def abort_requests(self, request_ids: list[str]) -> None:
        if request_ids and self.dead_reason is None:
            self._send(AbortRequests(list(request_ids)))

    def _check_process(self) -> None:
        if self.dead_reason is None and not self.process.alive():
            self.dead_reason = f"engine core process exited (code {self.process.exit_code()})"
        if self.dead_reason is not None:
            raise EngineDeadError(self.dead_reason)

    def _on_message(self, kind: MsgKind, obj: Any) -> None:
        if isinstance(obj, EngineDead):
            self.dead_reason = obj.reason
            raise EngineDeadError(obj.reason)

    def _close_sockets(self) -> None:
        self.input.close(linger=0)


class SyncMPClient(_MPClientBase, EngineCoreClient):
    """The engine core in its own process, driven by blocking calls (the `LLM` class)."""

    def __init__(
        self, config: EngineConfig, args: EngineArgs, ready_timeout: float = 600.0
    ) -> None:
        super().__init__(config, args)
        self.output = self.zmq_ctx.socket(zmq.PULL)
        self.output.setsockopt(zmq.LINGER, 0)
        self.output.setsockopt(zmq.RCVHWM, 0)  # never stop reading: see _MPClientBase
        self.output.bind(self.process.output_addr)
        self.pending: deque[EngineCoreOutputs] = deque()
        self.results: dict[int, UtilityResult] = {}
        self.process.start()
        try:
            while not self._try_send_config():
                time.sleep(0.01)
            self.info = self._wait_for(lambda k, o: k is MsgKind.READY, ready_timeout)
        except BaseException as e:  # (a Ctrl-C too: no core process or socket is left)
            self.shutdown()
            if isinstance(e, EngineDeadError | TimeoutError):
                raise EngineStartupError(str(e)) from e
            raise

    def _recv(self, timeout: float) -> tuple[MsgKind, Any] | None:
        if self.output.poll(int(timeout * 1000)):
            kind, obj = self.decoder.decode(self.output.recv_multipart())
            self._on_message(kind, obj)
            return kind, obj
        self._check_process()
        return None

    def _wait_for(self, match: Callable[[MsgKind, Any], bool], timeout: float) -> Any:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            msg = self._recv(POLL_S)
            if msg is None:
                continue
            kind, obj = msg
            if match(kind, obj):
                return obj
            if kind is MsgKind.OUTPUTS:
                self.pending.append(obj)
            elif kind is MsgKind.UTILITY_RESULT:
                self.results[obj.call_id] = obj
        raise TimeoutError(f"no answer from the engine core within {timeout:.0f} s")

    def get_output(self) -> EngineCoreOutputs:
        if self.pending:
            return self.pending.popleft()
        return self._wait_for(lambda k, o: k is MsgKind.OUTPUTS, float("inf"))

    def call_utility(self, method: str, *args: Any, timeout: float = 60.0) -> Any:
        call_id = next(self._call_ids)
        self._send(UtilityCall(call_id, method, list(args)))
        if call_id in self.results:
            result = self.results.pop(call_id)
        else:
            result = self._wait_for(
                lambda k, o: k is MsgKind.UTILITY_RESULT and o.call_id == call_id, timeout
            )
        if result.error:
            raise RuntimeError(f"engine core {method}: {result.error}")
        return result.result

    def get_stats(self) -> SchedulerStats:
        return msgspec.convert(self.call_utility("get_stats"), SchedulerStats)

    def reset_prefix_cache(self) -> bool:
        return bool(self.call_utility("reset_prefix_cache"))

    def shutdown(self) -> None:
        self.process.stop()
        self.output.close(linger=0)
        self._close_sockets()
        self.zmq_ctx.term()


class AsyncMPClient(_MPClientBase):
    """The engine core in its own process, for asyncio: sends never block the loop; an
    output-handler task receives outputs and hands them to `on_outputs`. TrioMPClient
    below is the same client under trio: it overrides only the loop-specific hooks
    (the output socket, sleeping, the clock, futures, the handler task)."""

    def __init__(self, config: EngineConfig, args: EngineArgs) -> None:
        super().__init__(config, args)
        self.output = self._output_socket()
        self.output.setsockopt(zmq.LINGER, 0)
        self.output.setsockopt(zmq.RCVHWM, 0)  # never stop reading: see _MPClientBase
        self.output.bind(self.process.output_addr)
        self.calls: dict[int, Any] = {}  # call id -> the loop's future for its result
        self.handler: asyncio.Task | None = None

    # -- the loop-specific hooks (asyncio here) -------------------------------------------

    def _output_socket(self) -> Any:
        self.actx = zmq.asyncio.Context.shadow(self.zmq_ctx)
        return self.actx.socket(zmq.PULL)

    async def _recv_frames(self, timeout: float) -> list[Any] | None:
        if await self.output.poll(int(timeout * 1000)):
            frames: list[Any] = await self.output.recv_multipart()
            return frames
        return None

    async def _sleep(self, seconds: float) -> None:
        await asyncio.sleep(seconds)

    def _future(self) -> Any:
        return asyncio.get_running_loop().create_future()

    async def _wait_result(self, fut: Any, timeout: float) -> UtilityResult:
        result: UtilityResult = await asyncio.wait_for(fut, timeout)
        return result

    def _spawn_handler(self, run: Callable[[], Any], nursery: Any) -> None:
        self.handler = asyncio.get_running_loop().create_task(run(), name="asyncllm-output-handler")

    async def _stop_handler(self) -> None:
        if self.handler is not None:
            self.handler.cancel()
            try:
                await self.handler
            except (asyncio.CancelledError, Exception):  # noqa: BLE001
                pass

    async def _to_thread(self, fn: Callable[[], Any]) -> None:
        await asyncio.to_thread(fn)

    # -- shared ----------------------------------------------------------------------------

    async def start(self, ready_timeout: float = 600.0) -> None:
        self.process.start()
        deadline = time.monotonic() + ready_timeout
        try:
            while not self._try_send_config():
                await self._sleep(0.01)
        except EngineDeadError as e:
            raise EngineStartupError(str(e)) from e
        while True:
            try:
                msg = await self._recv(POLL_S)
            except EngineDeadError as e:
                raise EngineStartupError(str(e)) from e
            if msg is not None and msg[0] is MsgKind.READY:
                self.info = msg[1]
                return
            if time.monotonic() > deadline:
                raise EngineStartupError(
                    f"the engine core did not start within {ready_timeout:.0f} s"
                )

    async def _recv(self, timeout: float) -> tuple[MsgKind, Any] | None:
        frames = await self._recv_frames(timeout)
        if frames is not None:
            kind, obj = self.decoder.decode(frames)
            self._on_message(kind, obj)
            return kind, obj
        self._check_process()
        return None

    def run_output_handler(
        self,
        on_outputs: Callable[[EngineCoreOutputs], None],
        on_dead: Callable[[str], None],
        nursery: Any = None,
    ) -> None:
        """Receives the core's messages in a background task (under trio, in `nursery`)
        until the core dies or `shutdown()`."""

        async def loop() -> None:
            try:
                while True:
                    msg = await self._recv(POLL_S)
                    if msg is None:
                        continue
                    kind, obj = msg
                    if kind is MsgKind.OUTPUTS:
                        on_outputs(obj)
                    elif kind is MsgKind.UTILITY_RESULT:
                        fut = self.calls.pop(obj.call_id, None)
                        if fut is not None and not fut.done():
                            fut.set_result(obj)
            except EngineDeadError as e:
                self._fail_calls(str(e))
                on_dead(str(e))
            except Exception as e:  # noqa: BLE001 (a bug here must not hang requests)
                self.dead_reason = f"output handler failed: {type(e).__name__}: {e}"
                self._fail_calls(self.dead_reason)
                on_dead(self.dead_reason)

        self._spawn_handler(loop, nursery)

    def _fail_calls(self, reason: str) -> None:
        for fut in self.calls.values():
            if not fut.done():
                fut.set_exception(EngineDeadError(reason))
        self.calls.clear()

    async def call_utility(self, method: str, *args: Any, timeout: float = 60.0) -> Any:
        call_id = next(self._call_ids)
        fut = self._future()
        self.calls[call_id] = fut
        self._send(UtilityCall(call_id, method, list(args)))
        try:
            result = await self._wait_result(fut, timeout)
        finally:
            self.calls.pop(call_id, None)
        if result.error:
            raise RuntimeError(f"engine core {method}: {result.error}")
        return result.result

    async def shutdown(self) -> None:
        await self._stop_handler()
        self._fail_calls("the engine was shut down")
        await self._to_thread(self.process.stop)
        self.output.close(linger=0)
        self._close_sockets()
        self.zmq_ctx.term()


class TrioMPClient(AsyncMPClient):
    """AsyncMPClient under trio. The output socket is a plain ZMQ socket whose readiness
    descriptor trio waits on. That descriptor is edge-triggered: it signals once when
    messages arrive, however many, so the socket's own event flags are read before every
    wait and messages are taken while they say one is there (else a stream stalls with
    messages queued), each after a checkpoint (else a busy socket starves the streams).
    The handler runs in the caller's nursery, in its own cancel scope."""

    def __init__(self, config: EngineConfig, args: EngineArgs) -> None:
        import trio

        self._trio = trio
        self._scope: Any = None  # the handler's cancel scope, and its end
        self._ended: Any = None
        super().__init__(config, args)

    def _output_socket(self) -> Any:
        return self.zmq_ctx.socket(zmq.PULL)

    async def _recv_frames(self, timeout: float) -> list[Any] | None:
        with self._trio.move_on_after(timeout):
            # (a checkpoint even when a message is there: trio switches tasks only at
            # one, and the streams' consumers must run between messages)
            await self._trio.lowlevel.checkpoint()
            while not self.output.getsockopt(zmq.EVENTS) & zmq.POLLIN:
                await self._trio.lowlevel.wait_readable(self.output.getsockopt(zmq.FD))
            frames: list[Any] = self.output.recv_multipart(zmq.NOBLOCK)
            return frames
        return None

    async def _sleep(self, seconds: float) -> None:
        await self._trio.sleep(seconds)

    def _future(self) -> Any:
        from asyncllm.aio import Slot

        return Slot()

    async def _wait_result(self, fut: Any, timeout: float) -> UtilityResult:
        try:
            with self._trio.fail_after(timeout):
                result: UtilityResult = await fut
                return result
        except self._trio.TooSlowError:
            raise TimeoutError(f"no answer within {timeout} s") from None

    def _spawn_handler(self, run: Callable[[], Any], nursery: Any) -> None:
        if nursery is None:
            raise RuntimeError("under trio the output handler needs a nursery")
        scope = self._scope = self._trio.CancelScope()
        ended = self._ended = self._trio.Event()

        async def in_scope() -> None:
            try:
                with scope:
                    await run()
            finally:
                ended.set()

        nursery.start_soon(in_scope, name="asyncllm-output-handler")

    async def _stop_handler(self) -> None:
        if self._scope is not None:
            self._scope.cancel()
            await self._ended.wait()  # (it no longer waits on the socket, which closes next)

    async def _to_thread(self, fn: Callable[[], Any]) -> None:
        await self._trio.to_thread.run_sync(fn)
