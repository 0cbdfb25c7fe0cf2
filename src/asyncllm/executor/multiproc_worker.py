"""A worker process of `MultiprocExecutor` (executor/multiproc.py): one rank.

Started as `python -m asyncllm.executor.multiproc_worker --rank R --reply-fd FD
--parent-pid PID` by the engine core. First thing, it asks the kernel for SIGKILL when
the core's spawning thread ends (`PR_SET_PDEATHSIG`) and ignores a terminal's
SIGINT/SIGHUP (the host's to act on). It reads its `WorkerStartup` from stdin, then
watches stdin in a thread: EOF means the core is gone, and the worker exits at once
(whatever its main thread waits for, a collective included). Then it joins the
distributed world, builds the TP/PP groups and its `Worker` (the model sharded by the
groups), attaches to the step queue (the rank that writes results creates the result
queue) and answers `WorkerReady` on its reply pipe.

The loop: each step queue message is a step (run at once; the result of the step before
is sent, by the result rank only, once this one is launched, so the device is never idle
while the core applies a step) or a control call (the steps held are sent first; every
rank runs the call and answers on its pipe). An error ends the worker: it is logged,
sent on the pipe as a `WorkerError`, and the worker exits with code 1 (the core's
monitor turns its exit into the engine's failure). SHUTDOWN (or the queue closed by the
core) releases the model, the process groups and the queues, and exits with code 0.
"""

from __future__ import annotations

import argparse
import ctypes
import logging
import os
import signal
import sys
import threading
from collections import deque
from pathlib import Path
from typing import Any

from asyncllm.child_process import ignore_terminal_signals

logger = logging.getLogger("asyncllm.worker_process")

PR_SET_PDEATHSIG = 1


def die_with_parent(parent_pid: int) -> None:
    """SIGKILL for this process when the thread that spawned it ends (Linux; elsewhere
    the stdin watch alone ends it), and an exit now if that parent is already gone."""
    if sys.platform.startswith("linux"):
        try:
            libc = ctypes.CDLL(None, use_errno=True)
            if libc.prctl(PR_SET_PDEATHSIG, int(signal.SIGKILL), 0, 0, 0) != 0:
                logger.warning("prctl(PR_SET_PDEATHSIG) failed: errno %d", ctypes.get_errno())
        except (OSError, AttributeError):
            pass
    if os.getppid() != parent_pid:  # (it died before the prctl)
        os._exit(1)


def _read_exact(fd: int, n: int) -> bytes:
    data = bytearray()
    while len(data) < n:
        chunk = os.read(fd, n - len(data))
        if not chunk:
            raise EOFError
        data += chunk
    return bytes(data)


def _watch_stdin(fd: int) -> None:
    """The core holds the write end of our stdin; EOF means it is gone."""
    try:
        while os.read(fd, 1 << 12):
            pass
    except OSError:
        pass
    os._exit(0)


class ReplyPipe:
    """The worker's end of its reply pipe (from the main thread only)."""

    def __init__(self, fd: int) -> None:
        self.fd = fd

    def send(self, msg: Any) -> None:
        from asyncllm.executor.multiproc_messages import frame

        view = memoryview(frame(msg))
        while view:
            view = view[os.write(self.fd, view) :]


def config_from_plain(plain: dict[str, Any]) -> Any:
    """`multiproc_messages.config_to_plain`'s inverse: the EngineConfig the core resolved."""
    import torch

    from asyncllm.config import (
        CacheConfig,
        EngineConfig,
        HFConfig,
        ModelConfig,
        ParallelConfig,
        SchedulerConfig,
        SchedulingPolicy,
    )

    model = dict(plain["model"])
    model["path"] = Path(model["path"])
    model["hf_config"] = HFConfig(dict(model["hf_config"]))
    dtype = getattr(torch, model["dtype"])
    if not isinstance(dtype, torch.dtype):
        raise ValueError(f"unknown dtype {model['dtype']!r}")
    model["dtype"] = dtype
    model["device"] = torch.device(model["device"])
    scheduler = dict(plain["scheduler"])
    scheduler["policy"] = SchedulingPolicy(scheduler["policy"])
    rest = {k: v for k, v in plain.items() if k not in ("model", "cache", "scheduler", "parallel")}
    return EngineConfig(
        model=ModelConfig(**model),
        cache=CacheConfig(**plain["cache"]),
        scheduler=SchedulerConfig(**scheduler),
        parallel=ParallelConfig(**plain["parallel"]),
        **rest,
    )


class _StepMasks:
    """The runner's `GrammarMemory` here: each step's bitmask rows came with the step
    (the structured manager's memory is the core's); device steps never come."""

    def __init__(self) -> None:
        self.current: Any = None
        self._kept: deque[Any] = deque(maxlen=2)  # (a copy queued on CUDA may read it)

    def set(self, masks: Any) -> None:
        self.current = masks
        if masks is not None:
            self._kept.append(masks)

    def bitmask(self, index: int, rows: int) -> Any:
        masks = self.current
        if masks is None or masks.shape[0] != rows:
            raise RuntimeError(f"the step's bitmask has no {rows} rows")
        return masks

    def sync(self, seq: int, ahead_req_ids: list[str]) -> Any:
        raise RuntimeError("device steps run only with the model in the engine core's process")


class WorkerProc:
    """One rank: its groups, its Worker, its ends of the queues."""

    def __init__(self, startup: Any, replies: ReplyPipe) -> None:
        import torch

        from asyncllm.distributed import parallel_state as ps
        from asyncllm.distributed.shm_queue import DEFAULT_SPIN_S, ShmQueue
        from asyncllm.engine.serial import StepDecoder, StepEncoder
        from asyncllm.executor.multiproc import (
            CPU_SPIN_S,
            READERS_TIMEOUT_S,
            RESULT_QUEUE_CHUNKS,
            STEP_QUEUE_CHUNK_BYTES,
        )
        from asyncllm.executor.multiproc_messages import WorkerReady
        from asyncllm.worker.worker import Worker

        self.rank = startup.rank
        self.replies = replies
        self.results: Any = None
        self.steps: Any = None
        torch.set_num_threads(startup.threads)
        ps.init_distributed_environment(
            startup.world_size,
            startup.rank,
            startup.init_method,
            local_rank=startup.local_rank,
            backend=startup.backend,
        )
        ps.initialize_model_parallel(startup.tensor_parallel_size, startup.pipeline_parallel_size)
        config = config_from_plain(startup.config)
        cuda = config.model.device.type == "cuda"
        if cuda:
            config.model.device = torch.device("cuda", startup.local_rank)
        self.worker = Worker(config)
        self.worker.load_model()
        self.masks = _StepMasks()
        self.worker.runner.grammar.memory = self.masks
        self.encoder = StepEncoder()
        self.decoder = StepDecoder()
        self.steps = ShmQueue.attach(startup.steps, startup.steps_reader)
        handle = None
        if startup.rank == startup.result_rank:
            remote = startup.results_host is not None  # (the core is on another machine)
            self.results = ShmQueue(
                0 if remote else 1,
                1 if remote else 0,
                remote_host=startup.results_host,
                name="results",
                n_chunks=RESULT_QUEUE_CHUNKS,
                chunk_bytes=STEP_QUEUE_CHUNK_BYTES,
                spin_s=DEFAULT_SPIN_S if cuda else CPU_SPIN_S,
            )
            handle = self.results.export_handle()
        self.torch = torch
        replies.send(WorkerReady(rank=self.rank, results=handle))
        if self.results is not None:  # (the core attaches now: then its names can go)
            self.results.wait_for_readers(timeout=READERS_TIMEOUT_S)

    def _send_result(self, step: Any) -> None:
        output = step.result()
        if self.results is not None:
            self.results.enqueue_frames(self.encoder.encode(output))

    def _step(self, frames: list[bytes]) -> Any:
        _, so = self.decoder.decode(frames[2:])
        masks = None
        if frames[1]:
            rows = so.grammar_rows()[0]  # (drafts of constrained requests have rows too)
            words = len(frames[1]) // 4 // max(1, rows)
            masks = self.torch.frombuffer(bytearray(frames[1]), dtype=self.torch.int32)
            masks = masks.view(rows, words)
        self.masks.set(masks)
        return self.worker.execute_model_async(so)

    def run(self) -> None:
        """Serves steps and calls until SHUTDOWN or the queue's close."""
        import msgspec

        from asyncllm.distributed.shm_queue import QueueClosed
        from asyncllm.executor.multiproc_messages import (
            CONTROL,
            STEP,
            ControlCall,
            WorkerError,
            WorkerReply,
        )

        call_decoder = msgspec.msgpack.Decoder(ControlCall)
        in_flight: deque[Any] = deque()
        while True:
            try:
                frames = self.steps.dequeue_frames()
            except QueueClosed:
                return
            kind = frames[0]
            if kind == STEP:
                in_flight.append(self._step(frames))
                while len(in_flight) > 1:  # (the next one is launched: send the last)
                    self._send_result(in_flight.popleft())
                continue
            if kind != CONTROL:
                raise RuntimeError(f"unknown step queue message {kind[:8]!r}")
            call = call_decoder.decode(frames[1])
            while in_flight:
                self._send_result(in_flight.popleft())
            if call.method == "flush":
                continue
            if call.method == "shutdown":
                return
            try:
                value = self._control(call.method, call.args)
            except Exception as e:  # noqa: BLE001 (the core raises it)
                logger.info("%s failed: %s: %s", call.method, type(e).__name__, e)
                self.replies.send(
                    WorkerError(
                        rank=self.rank,
                        error_type=type(e).__name__,
                        message=str(e),
                        call_id=call.call_id,
                    )
                )
                continue
            self.replies.send(WorkerReply(rank=self.rank, call_id=call.call_id, value=value))

    def _control(self, method: str, args: list[Any]) -> Any:
        if method == "determine_num_blocks":
            return self.worker.determine_num_blocks()
        if method == "initialize_cache":
            self.worker.initialize_cache(int(args[0]))
            return None
        if method == "startup_seconds":
            return dict(self.worker.report.seconds)
        raise ValueError(f"unknown worker call {method!r}")

    def close(self) -> None:
        """Releases the model, the process groups and the queues (the result queue's
        segment is unlinked here, its writer's)."""
        from asyncllm.distributed import parallel_state as ps

        try:
            self.worker.shutdown()
            ps.destroy_distributed_environment()
        finally:
            self.close_queues()

    def close_queues(self) -> None:
        for q in (self.results, self.steps):
            if q is not None:
                try:
                    q.close()
                except Exception:  # noqa: BLE001 (the process exits regardless)
                    logger.exception("worker rank %d: closing %r failed", self.rank, q)


def serve(startup: Any, replies: Any) -> int:
    """One rank's life once started: its groups and model, the step loop, the release;
    an error is logged and sent on `replies` (a `WorkerError`). The exit code: 0 after
    SHUTDOWN (or the queue's close), 1 after an error."""
    from asyncllm.executor.multiproc import WorkerError

    proc: WorkerProc | None = None
    try:
        proc = WorkerProc(startup, replies)
        proc.run()
    except BaseException as e:  # noqa: BLE001 (reported, then the worker exits)
        logger.exception("worker rank %d failed", startup.rank)
        try:
            replies.send(
                WorkerError(rank=startup.rank, error_type=type(e).__name__, message=str(e))
            )
        except OSError:
            pass
        if proc is not None:  # (no collective: the peers may be stuck in one)
            proc.close_queues()
        return 1
    try:
        proc.close()
    except Exception:  # noqa: BLE001
        logger.exception("worker rank %d: release failed", startup.rank)
        return 1
    return 0


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description="asyncllm worker process")
    parser.add_argument("--rank", type=int, required=True)
    parser.add_argument("--reply-fd", type=int, required=True)
    parser.add_argument("--parent-pid", type=int, required=True)
    args = parser.parse_args(argv)
    die_with_parent(args.parent_pid)
    ignore_terminal_signals()
    from asyncllm import envs

    logging.basicConfig(
        level=envs.log_level(),
        stream=sys.stderr,
        format=f"%(asctime)s worker-{args.rank} %(levelname)s %(message)s",
    )
    replies = ReplyPipe(args.reply_fd)
    code = 1
    try:
        import msgspec

        from asyncllm.executor.multiproc import WorkerStartup

        stdin = sys.stdin.fileno()
        try:
            size = int.from_bytes(_read_exact(stdin, 4), "big")
            startup = msgspec.msgpack.decode(_read_exact(stdin, size), type=WorkerStartup)
        except EOFError:
            os._exit(0)  # (the core is gone already)
        threading.Thread(target=_watch_stdin, args=(stdin,), daemon=True, name="core-watch").start()
        code = serve(startup, replies)
    finally:
        sys.stderr.flush()
        os._exit(code)


if __name__ == "__main__":
    main()
