"""How the host talks to an engine core: one interface (EngineCoreClient), and the
clients of a core in its own process (SyncMPClient for LLM, AsyncMPClient and
TrioMPClient for AsyncLLM). The host side: no torch, nothing of the core side
(`engine.core_inproc` holds the in-process client, imported only when asked for).

Start-up, for every client: the core resolves the engine arguments and sends a
ResolvedConfig first (the host starts its tokenizer then), then EngineReady once the
model is loaded (`wait_ready`)."""

from __future__ import annotations

import asyncio
import builtins
import itertools
import time
from abc import ABC, abstractmethod
from collections import deque
from collections.abc import Callable
from typing import Any

import msgspec
import zmq
import zmq.asyncio

from asyncllm.config import EngineArgs
from asyncllm.engine.heap import trim_heap
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
    ResolvedConfig,
    SchedulerStats,
    UtilityCall,
    UtilityResult,
)

POLL_S = 0.25  # how often a waiting client checks that the core process lives


class EngineCoreClient(ABC):
    """How LLMEngine drives an engine core: in this process or in its own. Made from
    the engine arguments; `config` is set once the core has resolved them (when the
    constructor returns), `wait_ready()` returns once the core serves."""

    config: ResolvedConfig

    @abstractmethod
    def __init__(self, args: EngineArgs) -> None: ...

    def wait_ready(self) -> None:  # noqa: B027 (a core in this process is ready at once)
        """Blocks until the core has loaded its model and serves."""

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


class _MPClientBase:
    """What both process clients share: the process, the input socket, the codec.
    `config` is the core's first answer.

    Both bind the output socket with no receive high-water mark: a PULL socket at its
    limit stops reading its unix socket, and when the core exits then (closing its end),
    libzmq drops the connection with whatever was still unread in it, so the core's last
    outputs and its EngineDead vanish (seen in about 1 of 50 stops mid-stream). Unlimited,
    everything the core sent is read in before the connection ends."""

    config: ResolvedConfig

    def __init__(self, args: EngineArgs) -> None:
        self.args = args
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
        self.dead_error_type: str | None = None
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
                self.encoder.encode(startup_message(self.args)),
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
            self.dead_error_type = obj.error_type
            raise EngineDeadError(obj.reason)

    def startup_cause(self, e: Exception) -> BaseException:
        """The cause a failed start's EngineStartupError chains: the core's exception
        rebuilt where its class is a builtin (FileNotFoundError for a missing model),
        else `e` itself."""
        cls = getattr(builtins, self.dead_error_type or "", None)
        if isinstance(cls, type) and issubclass(cls, Exception):
            return cls(str(e))
        return e

    def _close_sockets(self) -> None:
        self.input.close(linger=0)


class SyncMPClient(_MPClientBase, EngineCoreClient):
    """The engine core in its own process, driven by blocking calls (the `LLM` class)."""

    def __init__(self, args: EngineArgs, ready_timeout: float = 600.0) -> None:
        super().__init__(args)
        self.ready_timeout = ready_timeout
        self.output = self.zmq_ctx.socket(zmq.PULL)
        self.output.setsockopt(zmq.LINGER, 0)
        self.output.setsockopt(zmq.RCVHWM, 0)  # never stop reading: see _MPClientBase
        self.output.bind(self.process.output_addr)
        self.pending: deque[EngineCoreOutputs] = deque()
        self.results: dict[int, UtilityResult] = {}
        self.process.start()
        self._starting(self._send_startup_and_wait_config)

    def _starting(self, step: Callable[[], None]) -> None:
        try:
            step()
        except BaseException as e:  # (a Ctrl-C too: no core process or socket is left)
            self.shutdown()
            if isinstance(e, EngineDeadError | TimeoutError):
                raise EngineStartupError(str(e)) from self.startup_cause(e)
            raise

    def _send_startup_and_wait_config(self) -> None:
        while not self._try_send_config():
            time.sleep(0.01)
        self.config = self._wait_for(lambda k, o: k is MsgKind.CONFIG, self.ready_timeout)

    def wait_ready(self) -> None:
        if self.info is None:
            self._starting(self._wait_ready)

    def _wait_ready(self) -> None:
        self.info = self._wait_for(lambda k, o: k is MsgKind.READY, self.ready_timeout)

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

    def __init__(self, args: EngineArgs) -> None:
        super().__init__(args)
        self.output = self._output_socket()
        self.output.setsockopt(zmq.LINGER, 0)
        self.output.setsockopt(zmq.RCVHWM, 0)  # never stop reading: see _MPClientBase
        self.output.bind(self.process.output_addr)
        self.calls: dict[int, Any] = {}  # call id -> the loop's future for its result
        self.handler: asyncio.Task | None = None
        self.heap_trims = 0  # how often the output handler has trimmed the host's heap
        self._trim_waiters: list[Any] = []  # futures for `wait_for_heap_trim`
        self._deadline = 0.0  # (start-up's, set by `start`)

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

    async def start(self, ready_timeout: float = 600.0) -> ResolvedConfig:
        """Starts the core process and sends it the engine arguments; returns the
        configuration it resolved (before its model loads: `wait_ready` waits for that)."""
        self.process.start()
        self._deadline = time.monotonic() + ready_timeout
        try:
            while not self._try_send_config():
                await self._sleep(0.01)
        except EngineDeadError as e:
            raise EngineStartupError(str(e)) from self.startup_cause(e)
        config: ResolvedConfig = await self._wait_startup(MsgKind.CONFIG)
        self.config = config
        return config

    async def wait_ready(self) -> None:
        self.info = await self._wait_startup(MsgKind.READY)

    async def _wait_startup(self, kind: MsgKind) -> Any:
        while True:
            try:
                msg = await self._recv(POLL_S)
            except EngineDeadError as e:
                raise EngineStartupError(str(e)) from self.startup_cause(e)
            if msg is not None and msg[0] is kind:
                return msg[1]
            if time.monotonic() > self._deadline:
                raise EngineStartupError("the engine core did not start in time")

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
        idle: Callable[[], bool] = lambda: False,
    ) -> None:
        """Receives the core's messages in a background task (under trio, in `nursery`)
        until the core dies or `shutdown()`. Once nothing came for POLL_S after some
        traffic and `idle()` says no request is open, the host's freed C heap goes back
        to the system (`trim_heap`, in a thread): a burst of requests otherwise leaves
        the host tens of MB larger for good."""

        async def loop() -> None:
            traffic = False  # messages since the last trim
            try:
                while True:
                    msg = await self._recv(POLL_S)
                    if msg is None:
                        if traffic and idle():
                            traffic = False
                            await self._to_thread(trim_heap)
                            self.heap_trims += 1
                            waiters, self._trim_waiters = self._trim_waiters, []
                            for fut in waiters:
                                if not fut.done():
                                    fut.set_result(None)
                        continue
                    traffic = True
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

    async def wait_for_heap_trim(self, after: int, timeout: float = 30.0) -> None:
        """Waits until the output handler has trimmed the heap more than `after` times
        (it does once no request is open and the core has been quiet for POLL_S);
        TimeoutError if it has not within `timeout`."""
        while self.heap_trims <= after:
            fut = self._future()
            self._trim_waiters.append(fut)
            await self._wait_result(fut, timeout)

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

    def __init__(self, args: EngineArgs) -> None:
        import trio

        self._trio = trio
        self._scope: Any = None  # the handler's cancel scope, and its end
        self._ended: Any = None
        super().__init__(args)

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
