"""MultiprocExecutor: one worker process per rank, each step broadcast to all of them
through shared memory.

Process layout. The engine core (this process) starts `world_size` workers as
`python -m asyncllm.executor.multiproc_worker` (never a fork of the core, never
multiprocessing's re-import of `__main__`), from the thread that builds the executor
(the core's main thread), with a terminal's SIGINT/SIGHUP blocked and then ignored (they
are the host's; as `engine.host_launcher.start_child`). Worker `r` is global rank `r`:
it joins the torch.distributed world (gloo on the CPU, NCCL on CUDA, over
`tcp://127.0.0.1:<free port>`), builds the TP/PP groups, then its `Worker` (the model
built after the groups, so each layer holds its shard; on CUDA device `cuda:<first + r>`).

Channels, per worker:
- stdin, a pipe whose write end only the core holds: the startup message (length-prefixed
  msgpack: `WorkerStartup`, the resolved `EngineConfig` as plain data), then nothing. Its
  EOF (the core died) ends the worker at once; so does `PR_SET_PDEATHSIG` (SIGKILL, set
  first thing), which fires when the core's spawning thread ends.
- a reply pipe (worker -> core, length-prefixed msgpack): `WorkerReady` once built,
  `WorkerReply` to each control call, `WorkerError` before a worker exits on an error.
And shared by all:
- the step queue (`distributed.shm_queue.ShmQueue`, the core its writer, one local
  reader per rank): each step's `SchedulerOutput` in one broadcast, `[STEP, bitmask,
  *StepEncoder frames]` (msgpack and raw numpy buffers, never pickle; the step's grammar
  bitmask rows copied in, so no worker needs the structured manager's memory), and the
  control calls `[CONTROL, ControlCall]` (determine_num_blocks, initialize_cache,
  startup_seconds, flush, shutdown), which every rank runs and answers on its pipe.
- the result queue (a ShmQueue whose writer is rank 0 of the last pipeline stage, the
  core its one reader): each step's `ModelRunnerOutput`, in launch order.

A worker runs the step it is given at once and sends its result when the next step
arrives, so that the device runs step N+1 while the core applies step N (the core keeps
two steps in flight); a step whose result the core waits for with nothing launched
after it is released by a FLUSH call. Every rank follows the same order, so each
runner's state, and each rank's sampling (the LM head gathers the logits to every rank,
and the seeds are the same), stays identical.

Failures. A monitor thread waits on the workers' pid file descriptors: a worker that
exits while the engine runs is an engine failure (`WorkerDiedError`, with the reason the
worker sent, if any): the queues are marked closed (a core waiting on one wakes at
once), the surviving workers are killed (they would wait in a collective until gloo's
or NCCL's timeout), and the callback the core registered makes an idle core end as
dead. A step whose result does not come within ASYNCLLM_EXECUTE_MODEL_TIMEOUT_S is one
too (`StepTimeoutError`). `shutdown()`: a SHUTDOWN call (each worker releases its model,
its process groups and its queues, and exits), a wait, then SIGKILL for any left, and
the queues closed: no process is left. Nor anything in /dev/shm or /tmp: each queue's
writer removes the names of its segment and socket once its readers have attached (at
start-up: `wait_for_readers`), after which the mappings live on unnamed, so a SIGKILL
anywhere leaves nothing behind (the core removes the result queue's names itself if its
writer died before).
"""

from __future__ import annotations

import contextlib
import itertools
import logging
import os
import select
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import IO, Any

import msgspec

from asyncllm import envs
from asyncllm.child_process import start_child
from asyncllm.config import EngineConfig
from asyncllm.distributed.shm_queue import DEFAULT_SPIN_S, QueueClosed, QueueHandle, ShmQueue
from asyncllm.engine.serial import StepDecoder, StepEncoder
from asyncllm.executor.base import Executor, StepFuture
from asyncllm.executor.multiproc_messages import (
    CONTROL,
    ENCODER,
    LEN_BYTES,
    MESSAGE_DECODER,
    STEP,
    ControlCall,
    WorkerError,
    WorkerReady,
    WorkerReply,
    WorkerStartup,
    config_to_plain,
    frame,
)
from asyncllm.executor.worker_handles import (
    WorkerDiedError,
    WorkerHandle,
    WorkerProc,
    exit_reason,
    free_port,
    rebuild_error,
)
from asyncllm.step_io import GrammarMemory, ModelRunnerOutput, SchedulerOutput

logger = logging.getLogger(__name__)

GRACEFUL_EXIT_S = 3.0  # how long shutdown waits for the workers to leave by themselves
KILL_WAIT_S = 5.0
QUEUE_CLOSED_WAIT_S = 5.0  # for a worker whose queue closed to be seen ending
READERS_TIMEOUT_S = 60.0  # for a queue's readers to attach, once they have said they did
STEP_QUEUE_CHUNKS = 8
STEP_QUEUE_CHUNK_BYTES = 1 << 20  # larger steps go over the queue's ZMQ socket
RESULT_QUEUE_CHUNKS = 4
CPU_SPIN_S = 1e-4  # a short spin: on the CPU the ranks often outnumber the cores
WORKER_MODULE = "asyncllm.executor.multiproc_worker"


class WorkerStartTimeoutError(TimeoutError):
    """Not every worker started within ASYNCLLM_WORKER_START_TIMEOUT_S."""


class StepTimeoutError(TimeoutError):
    """No result came for a model step within ASYNCLLM_EXECUTE_MODEL_TIMEOUT_S."""


class _StepFuture:
    """A step sent to the workers; `result()` reads the result queue (in launch order)."""

    def __init__(self, executor: MultiprocExecutor, seq: int) -> None:
        self._executor = executor
        self._seq = seq

    def result(self) -> ModelRunnerOutput:
        return self._executor._result(self._seq)

    def finish_launch(self) -> None:
        return None


class MultiprocExecutor(Executor):
    """One worker process per rank (see the module docstring)."""

    splits_launch = False  # the bitmask is filled before a step is sent, and sent with it

    def __init__(self, config: EngineConfig) -> None:
        super().__init__(config)
        parallel = config.parallel
        self.world_size = parallel.world_size
        self.tp_size = parallel.tensor_parallel_size
        # Rank 0 of the last pipeline stage has the sampled tokens.
        self.result_rank = self.world_size - self.tp_size
        self._lock = threading.Lock()
        self._pipe_lock = threading.Lock()
        self._failure: BaseException | None = None
        self._callbacks: list[Any] = []
        self._stopping = False
        self._workers: list[Any] = []  # WorkerHandle, by rank
        self._steps: ShmQueue | None = None
        self._results: ShmQueue | None = None
        self._result_handle: QueueHandle | None = None
        self._monitor: threading.Thread | None = None
        self._wake_r, self._wake_w = os.pipe()
        self._encoder = StepEncoder()
        self._decoder = StepDecoder()
        self._call_ids = itertools.count()
        self._grammar: GrammarMemory | None = None
        self._launched = 0  # steps sent
        self._next_result = 0  # the step whose result is next on the result queue
        self._flushed = 0  # steps before this one have been flushed
        self._received: dict[int, ModelRunnerOutput] = {}
        self._startup: dict[str, float] = {}
        self._ready = False  # every worker has started
        try:
            self._start_workers()
        except BaseException:
            self.shutdown()
            raise

    # -- start-up ------------------------------------------------------------------------

    def _start_workers(self) -> None:
        """Starts one worker per rank and waits until every one has built its model and
        attached to the step queue; then the result queue is attached and the monitor
        started. The placement (`_local_ranks`, `_queue_host`, `_init_method`) and the
        launch (`_launch`) are the subclass's to change."""
        t0 = time.monotonic()
        config = self.config
        device = config.model.device
        cuda = device.type == "cuda"
        world = self.world_size
        local = self._local_ranks()
        self._steps = ShmQueue(
            len(local),
            world - len(local),
            name="steps",
            n_chunks=STEP_QUEUE_CHUNKS,
            chunk_bytes=STEP_QUEUE_CHUNK_BYTES,
            remote_host=self._queue_host() if len(local) < world else None,
            spin_s=DEFAULT_SPIN_S if cuda else CPU_SPIN_S,
        )
        readers = local + [r for r in range(world) if r not in local]
        plain = config_to_plain(config)
        init_method = self._init_method()
        steps = self._steps.export_handle()
        startups = [
            WorkerStartup(
                rank=rank,
                world_size=world,
                tensor_parallel_size=self.tp_size,
                pipeline_parallel_size=config.parallel.pipeline_parallel_size,
                local_rank=self._device_index(rank),
                init_method=init_method,
                backend="nccl" if cuda else "gloo",
                result_rank=self.result_rank,
                steps=steps,
                steps_reader=readers.index(rank),
                results_host=None if self.result_rank in local else self._worker_host(rank),
                config=plain,
                threads=self._threads(),
            )
            for rank in range(world)
        ]
        self._launch(startups)
        ready = self._collect(WorkerReady, None, starting=True)
        handle = ready[self.result_rank].results
        if handle is None:
            raise WorkerDiedError(f"worker rank {self.result_rank} sent no result queue")
        self._result_handle = handle
        self._results = ShmQueue.attach(handle, 0)
        # Every worker has attached: the step queue's names go from /dev/shm and /tmp
        # (the mapping lives on), so nothing is left there whatever dies from now on.
        self._steps.wait_for_readers(timeout=READERS_TIMEOUT_S)
        self._ready = True
        self._start_monitor()
        self._startup["start workers"] = time.monotonic() - t0
        logger.info(
            "%d workers started in %.1f s (%s, %d torch thread(s) each)",
            world,
            time.monotonic() - t0,
            "NCCL" if cuda else "gloo",
            startups[0].threads,
        )

    # -- placement and launch (what a subclass changes) ------------------------------------

    def _local_ranks(self) -> list[int]:
        """The ranks whose workers share this machine (they read the step queue's shared
        memory; the others its TCP socket): all of them here."""
        return list(range(self.world_size))

    def _queue_host(self) -> str:
        """The address remote readers reach this process at."""
        raise NotImplementedError("every worker of the multiprocess executor is local")

    def _worker_host(self, rank: int) -> str:
        """The address of the machine worker `rank` runs on, as this process reaches it."""
        raise NotImplementedError("every worker of the multiprocess executor is local")

    def _init_method(self) -> str:
        """torch.distributed's rendezvous (rank 0 serves it)."""
        return f"tcp://127.0.0.1:{free_port()}"

    def _device_index(self, rank: int) -> int:
        """Worker `rank`'s CUDA device index (its local rank): the engine's device's
        index plus its rank, here."""
        device = self.config.model.device
        return (device.index or 0) + rank if device.type == "cuda" else 0

    def _threads(self) -> int:
        """torch's intra-op threads per worker: the CPUs here shared out."""
        return self.config.cpu_threads or max(1, len(envs.available_cpus()) // self.world_size)

    def _launch(self, startups: list[WorkerStartup]) -> None:
        """Starts worker `startups[r].rank` for each, as `python -m
        asyncllm.executor.multiproc_worker`, and hands it its startup message."""
        env = envs.child_process_env()
        env["OMP_NUM_THREADS"] = str(startups[0].threads)
        if "GLOO_SOCKET_IFNAME" not in env and Path("/sys/class/net/lo").exists():
            env["GLOO_SOCKET_IFNAME"] = "lo"  # every rank is on this machine
        for startup in startups:
            rank = startup.rank
            read_end, write_end = os.pipe()
            try:
                proc = start_child(
                    [
                        sys.executable,
                        "-m",
                        WORKER_MODULE,
                        "--rank",
                        str(rank),
                        "--reply-fd",
                        str(write_end),
                        "--parent-pid",
                        str(os.getpid()),
                    ],
                    stdin=subprocess.PIPE,
                    pass_fds=(write_end,),
                    env=env,
                    close_fds=True,
                )
            except BaseException:
                os.close(read_end)
                raise
            finally:
                os.close(write_end)
            os.set_blocking(read_end, False)
            self._workers.append(WorkerProc(rank, proc=proc, replies=read_end))
            stdin: IO[bytes] | None = proc.stdin
            assert stdin is not None
            try:
                stdin.write(frame(startup))
                stdin.flush()
            except OSError:
                pass  # (it died at once: the wait for it says why)

    def _release_workers(self) -> None:
        """What is left of the workers once they are gone (shutdown): their pipes."""
        for w in self._workers:
            if w.proc.stdin is not None:
                with contextlib.suppress(OSError):
                    w.proc.stdin.close()
            for fd in (w.replies, w.pidfd):
                if fd is not None:
                    with contextlib.suppress(OSError):
                        os.close(fd)

    def _start_monitor(self) -> None:
        for w in self._workers:
            with contextlib.suppress(OSError, AttributeError):
                w.pidfd = os.pidfd_open(w.proc.pid)
        self._monitor = threading.Thread(
            target=self._watch_workers, name="asyncllm-worker-monitor", daemon=True
        )
        self._monitor.start()

    # -- the reply pipes -------------------------------------------------------------------

    def _drain(self, w: Any) -> None:
        """Reads what worker `w` has written to its pipe into its inbox (no wait)."""
        with self._pipe_lock:
            while not w.eof:
                try:
                    data = os.read(w.replies, 1 << 16)
                except BlockingIOError:
                    break
                except OSError:
                    data = b""
                if not data:
                    w.eof = True
                    break
                w.pending += data
            while len(w.pending) >= LEN_BYTES:
                size = int.from_bytes(w.pending[:LEN_BYTES], "big")
                if len(w.pending) < LEN_BYTES + size:
                    break
                body = bytes(w.pending[LEN_BYTES : LEN_BYTES + size])
                del w.pending[: LEN_BYTES + size]
                self._deliver(body, w)

    def _deliver(self, body: bytes, w: WorkerHandle | None = None) -> None:
        """A reply into its worker's inbox (`w`, or the rank it names); the error a
        worker sends as it exits is kept apart."""
        try:
            msg = MESSAGE_DECODER.decode(body)
        except msgspec.DecodeError as e:
            logger.warning("a worker sent a malformed reply: %s", e)
            return
        if w is None:
            if not 0 <= msg.rank < len(self._workers):
                logger.warning("a reply from an unknown worker rank %d", msg.rank)
                return
            w = self._workers[msg.rank]
        if isinstance(msg, WorkerError) and msg.call_id is None:
            w.error = msg
        else:
            w.inbox.append(msg)

    def _wait_for_replies(self, waiting: list[Any], timeout: float) -> None:
        """Returns when one of `waiting` may have written, or after `timeout` s."""
        fds = [w.replies for w in waiting if not w.eof]
        select.select(fds, [], [], timeout)

    def _death(self, w: Any, starting: bool = False) -> WorkerDiedError:
        """The error for worker `w`'s exit, with the reason it sent (if any)."""
        self._drain(w)
        code = w.poll()
        what = "while starting" if starting else ""
        reason = f"worker rank {w.rank} ({w.describe()}) died {what}".rstrip()
        reason += f": {exit_reason(code)}"
        if w.error is not None:
            reason += f"; it reported {w.error.error_type}: {w.error.message}"
        return WorkerDiedError(reason)

    def _collect(self, kind: type, call_id: int | None, starting: bool = False) -> dict[int, Any]:
        """Every rank's answer of type `kind` (to call `call_id`): rank -> the message
        (WorkerReady) or its value (WorkerReply). An error answer raises at once; so
        does a worker's death, or the executor's failure."""
        out: dict[int, Any] = {}
        deadline = time.monotonic() + envs.worker_start_timeout_s() if starting else None
        while len(out) < len(self._workers):
            if not starting:
                self._raise_if_failed()
            elif deadline is not None and time.monotonic() > deadline:
                late = [w.rank for w in self._workers if w.rank not in out]
                raise WorkerStartTimeoutError(
                    f"worker rank(s) {late} did not start within "
                    f"ASYNCLLM_WORKER_START_TIMEOUT_S={envs.worker_start_timeout_s():g} s (a "
                    "rendezvous that never completes, or a model load that stalled)"
                )
            waiting = [w for w in self._workers if w.rank not in out]
            for w in waiting:
                self._drain(w)
                while w.inbox:
                    msg = w.inbox.popleft()
                    if isinstance(msg, WorkerError) and msg.call_id == call_id:
                        error = rebuild_error(msg.error_type, msg.message)
                        raise error from WorkerDiedError(
                            f"worker rank {w.rank}: {msg.error_type}: {msg.message}"
                        )
                    if kind is WorkerReady and isinstance(msg, WorkerReady):
                        out[w.rank] = msg
                    elif kind is WorkerReply and isinstance(msg, WorkerReply):
                        if msg.call_id == call_id:
                            out[w.rank] = msg.value
                if w.rank in out:
                    continue
                if w.error is not None or w.eof or w.poll() is not None:
                    # (it is on its way out, or gone: a moment to finish, then say why)
                    w.wait(1.0)
                    if starting and w.error is not None:
                        e = w.error
                        raise rebuild_error(
                            e.error_type, f"worker rank {w.rank} failed to start: {e.message}"
                        )
                    raise self._death(w, starting)
            if len(out) < len(self._workers):
                self._wait_for_replies([w for w in self._workers if w.rank not in out], 0.1)
        return out

    def _call(self, method: str, *args: Any) -> dict[int, Any]:
        """Runs `method` on every rank (a control message on the step queue); each
        rank's answer."""
        call_id = next(self._call_ids)
        self._send([CONTROL, ENCODER.encode(ControlCall(call_id, method, list(args)))])
        return self._collect(WorkerReply, call_id)

    # -- failures --------------------------------------------------------------------------

    def _watch_workers(self) -> None:
        """The monitor thread: a worker that exits while the engine runs fails it."""
        while self._wait_for_exit() and not self._stopping:
            if self._fail_for_ended_workers():
                return

    def _fail_for_ended_workers(self) -> bool:
        """Fails the executor if a worker has ended (True), naming a worker killed by a
        signal first: its peers' errors (a collective whose peer is gone) follow from it."""
        dead = [w for w in self._workers if w.poll() is not None]
        if not dead or self._stopping:
            return bool(dead)
        dead.sort(key=lambda w: (int(w.poll() or 0) >= 0, w.rank))
        error = self._death(dead[0])
        if len(dead) > 1:
            others = ", ".join(f"rank {w.rank} {exit_reason(w.poll())}" for w in dead[1:])
            error = WorkerDiedError(f"{error} (also ended: {others})")
        self._fail(error)
        return True

    def _wait_for_exit(self, timeout: float | None = None) -> bool:
        """Returns when a worker may have ended (True), or when the monitor must stop
        (False: woken by shutdown), or after `timeout` s (True)."""
        pidfds = [w.pidfd for w in self._workers if w.pidfd is not None]
        if len(pidfds) < len(self._workers):
            timeout = 0.2 if timeout is None else min(timeout, 0.2)
        try:
            ready = select.select([self._wake_r, *pidfds], [], [], timeout)[0]
        except (OSError, ValueError):
            return False  # (closed under us: shutting down)
        return self._wake_r not in ready

    def _fail(self, error: BaseException) -> None:
        """The executor has failed for good: wake anything waiting on a queue, kill the
        workers left, and tell the core."""
        with self._lock:
            if self._failure is not None:
                return
            self._failure = error
            stopping = self._stopping
        if not stopping:
            logger.error("%s: stopping the workers", error)
        for q in (self._steps, self._results):
            if q is not None:
                with contextlib.suppress(Exception):
                    q.mark_closed()
        self._kill_workers()
        if not stopping:
            for callback in list(self._callbacks):
                try:
                    callback(error)
                except Exception:  # noqa: BLE001 (the others still hear)
                    logger.exception("an executor failure callback failed")

    def _kill_workers(self) -> None:
        for w in self._workers:
            w.kill()

    def _raise_if_failed(self) -> None:
        failure = self._failure
        if failure is not None:
            raise type(failure)(str(failure)) from None
        if self._stopping:
            raise WorkerDiedError("the multiprocess executor is shut down")

    def register_failure_callback(self, callback: Any) -> None:
        self._callbacks.append(callback)
        if self._failure is not None and not self._stopping:
            callback(self._failure)

    # -- steps -----------------------------------------------------------------------------

    def _send(self, frames: list[Any]) -> None:
        self._raise_if_failed()
        assert self._steps is not None
        timeout = envs.execute_model_timeout_s()
        with self._queue_op("the workers took no message", timeout):
            self._steps.enqueue_frames(frames, timeout=timeout)

    @contextlib.contextmanager
    def _queue_op(self, what: str, timeout: float) -> Iterator[None]:
        """A step or result queue operation: a closed queue raises the executor's
        failure (or the closure itself); a timeout stops the workers and raises a
        StepTimeoutError saying `what` did not happen in time."""
        try:
            yield
        except QueueClosed:
            # A worker's end closes its queue, maybe before the monitor has seen it end
            # (a peer of a killed worker fails its collective and exits while the kill
            # is still being carried out): wait a little for the end, to name its cause.
            deadline = time.monotonic() + QUEUE_CLOSED_WAIT_S
            while self._failure is None and not self._fail_for_ended_workers():
                left = deadline - time.monotonic()
                if left <= 0 or not self._wait_for_exit(left):
                    break
            self._raise_if_failed()
            raise
        except TimeoutError:
            self._fail(
                StepTimeoutError(
                    f"{what} within ASYNCLLM_EXECUTE_MODEL_TIMEOUT_S={timeout:g} s: a worker "
                    "is stuck (in a collective, or a model step); the workers were stopped"
                )
            )
            self._raise_if_failed()

    def _bitmask_frame(self, so: SchedulerOutput) -> Any:
        """The step's grammar bitmask rows (int32), copied into the message: the workers
        never read the structured manager's memory, so its buffer may be written again
        as soon as the step is sent."""
        if so.grammar_buffer is None:
            return b""
        if so.grammar_seq or so.grammar_bitmask_later:
            raise RuntimeError("the multiprocess executor runs no device steps nor split launches")
        if self._grammar is None:
            raise RuntimeError("a step with a grammar bitmask, but no grammar memory attached")
        rows = self._grammar.bitmask(so.grammar_buffer, so.grammar_rows()[0])
        return memoryview(rows.numpy()).cast("B")

    def execute_model_async(self, scheduler_output: SchedulerOutput) -> StepFuture:
        frames = [STEP, self._bitmask_frame(scheduler_output)]
        frames += self._encoder.encode(scheduler_output)
        self._send(frames)
        seq = self._launched
        self._launched += 1
        return _StepFuture(self, seq)

    def execute_model(self, scheduler_output: SchedulerOutput) -> ModelRunnerOutput:
        return self.execute_model_async(scheduler_output).result()

    def _result(self, seq: int) -> ModelRunnerOutput:
        """Step `seq`'s output: read off the result queue in order (those of earlier
        steps kept for their futures)."""
        if seq in self._received:
            return self._received.pop(seq)
        if seq < self._next_result:
            raise RuntimeError(f"the result of step {seq} was already taken")
        self._raise_if_failed()
        if seq >= self._flushed and seq == self._launched - 1:
            # Nothing launched after it: the workers hold its result until told.
            self._send([CONTROL, ENCODER.encode(ControlCall(-1, "flush"))])
            self._flushed = self._launched
        assert self._results is not None
        timeout = envs.execute_model_timeout_s()
        deadline = time.monotonic() + timeout
        while True:
            with self._queue_op(f"no result for model step {seq}", timeout):
                frames = self._results.dequeue_frames(timeout=max(0.0, deadline - time.monotonic()))
            _, output = self._decoder.decode(frames)
            got = self._next_result
            self._next_result += 1
            if got == seq:
                return output
            self._received[got] = output

    # -- the Executor interface ------------------------------------------------------------

    def determine_num_blocks(self) -> int:
        """The minimum over the ranks: each holds its own KV heads' share of each block."""
        blocks = self._call("determine_num_blocks")
        num_blocks = min(int(b) for b in blocks.values())
        logger.info("KV cache blocks per rank: %s; using %d", blocks, num_blocks)
        return num_blocks

    def initialize_cache(self, num_blocks: int) -> None:
        self._call("initialize_cache", num_blocks)

    def attach_grammar_memory(self, memory: GrammarMemory) -> None:
        self._grammar = memory

    def startup_seconds(self) -> dict[str, float]:
        seconds = dict(self._startup)
        report = self._call("startup_seconds")[self.result_rank]
        load = float(report.get("load weights", 0.0))
        if "start workers" in seconds:  # (its loading, on its own line)
            seconds["start workers"] = max(0.0, seconds["start workers"] - load)
        seconds.update({k: float(v) for k, v in report.items()})
        return seconds

    @property
    def worker_pids(self) -> list[int]:
        return [w.pid for w in self._workers]

    def shutdown(self) -> None:
        """Graceful (a SHUTDOWN call, then a wait), then forced (SIGKILL); the queues and
        pipes are closed and nothing is left behind. Idempotent."""
        with self._lock:
            if self._stopping:
                return
            self._stopping = True
            failed = self._failure is not None or not self._ready
        alive = [w for w in self._workers if w.poll() is None]
        if alive and not failed and self._steps is not None and not self._steps.closed:
            try:
                message = ControlCall(next(self._call_ids), "shutdown")
                self._steps.enqueue_frames([CONTROL, ENCODER.encode(message)], timeout=1.0)
            except Exception:  # noqa: BLE001 (then they are killed)
                pass
        deadline = time.monotonic() + (0 if failed else GRACEFUL_EXIT_S)
        for w in self._workers:
            w.wait(max(0.0, deadline - time.monotonic()))
        left = [w.rank for w in self._workers if w.poll() is None]
        if left and not failed:
            logger.warning(
                "worker rank(s) %s did not exit in %.0f s: killed", left, GRACEFUL_EXIT_S
            )
        self._kill_workers()
        for w in self._workers:
            w.wait(KILL_WAIT_S)
        with contextlib.suppress(OSError):
            os.write(self._wake_w, b"x")
        if self._monitor is not None and self._monitor is not threading.current_thread():
            self._monitor.join(KILL_WAIT_S)
        self._release_workers()
        if self._results is not None:
            self._results.close(unlink=True)  # (its writer, killed, may not have)
        handle = self._result_handle
        if (
            handle is not None
            and handle.local_address
            and handle.local_address.startswith("ipc://")
        ):
            with contextlib.suppress(OSError):
                os.unlink(handle.local_address.removeprefix("ipc://"))
        if self._steps is not None:
            self._steps.close()
        for fd in (self._wake_r, self._wake_w):
            with contextlib.suppress(OSError):
                os.close(fd)
