"""RayDistributedExecutor: the multiprocess executor's workers as Ray actors, so that a
model's ranks may span machines (`distributed_executor_backend="ray"`, the optional
extra `asyncllm[ray]`).

Ray places and supervises; it carries no step. Everything else is the multiprocess
executor's (executor/multiproc.py): each step goes to every worker in one broadcast on
the step queue, shared memory for the workers on the engine core's node and TCP for the
others (`ShmQueue`'s remote readers); results come back on the result queue of the last
stage's first rank (shared memory when it is on the core's node, TCP otherwise); the
control calls are the same. What differs:

- Ray. If this process is not connected yet, it joins the cluster `RAY_ADDRESS` names
  (`ray start --head` on one machine, `ray start --address=...` on the others), or
  else starts a local one of its own, bound to 127.0.0.1, without dashboard or usage
  statistics and with a small object store, which it stops at shutdown.
- Placement. One placement group per pipeline stage, one bundle per rank (a GPU on
  CUDA, a CPU otherwise), STRICT_PACK: the ranks of one tensor-parallel group share a
  node (their all-reduces stay on it), while stages may sit on different nodes. A world
  larger than the cluster's devices, or a tensor-parallel size larger than its largest
  node's, is refused at once, naming the numbers; a placement that does not come within
  PLACEMENT_TIMEOUT_S (devices in use) is an error too, never a silent wait.
- Workers. A `RayWorker` actor per rank runs `multiproc_worker.serve` (the same rank
  life as a worker process's) in its `run` call; the environment variables that shape
  a rank (ASYNCLLM_*, GLOO_*, NCCL_*) go with it. Replies (ready, control answers,
  errors) come over one ZMQ PUSH/PULL socket on the core's node, not pipes. On CUDA, Ray
  gives each actor its one GPU (as `cuda:0` there).
- Supervision. The monitor thread waits on the actors' `run` calls: one that ends while
  the engine runs (an error, or the actor's death) fails the engine, and the others are
  killed (`ray.kill`), as the multiprocess executor kills its processes. Shutdown is
  the same graceful-then-forced sequence, then the placement groups go, and the local
  Ray this executor started stops.

The model's path must name the same files on every node (a shared or copied cache).
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import os
import threading
import time
from typing import Any

import msgspec
import zmq

from asyncllm import envs
from asyncllm.config import EngineConfig
from asyncllm.executor.multiproc import MultiprocExecutor
from asyncllm.executor.multiproc_messages import WorkerStartup
from asyncllm.executor.worker_handles import WorkerDiedError, WorkerHandle, free_port

logger = logging.getLogger(__name__)

INSTALL_HINT = "pip install 'asyncllm[ray]'"
PLACEMENT_TIMEOUT_S = 60.0
LOCAL_OBJECT_STORE_BYTES = 80 << 20  # (Ray's floor is 75 MiB; steps never use it)
MONITOR_POLL_S = 0.5
# Environment variables a rank needs from the core's environment (not a whole copy: the
# nodes' paths differ).
FORWARDED_ENV_PREFIXES = ("ASYNCLLM_", "GLOO_", "NCCL_")
_ENCODER = msgspec.msgpack.Encoder()


def import_ray() -> Any:
    """The `ray` module, or an ImportError that says how to install it."""
    try:
        import ray
    except ImportError:
        raise ImportError(
            f"distributed_executor_backend='ray' needs Ray, which is not installed: {INSTALL_HINT}"
        ) from None
    return ray


def connect_ray(ray: Any) -> bool:
    """Connects this process to Ray (see the module docstring); whether it started a
    local Ray of its own (to stop at shutdown)."""
    if ray.is_initialized():
        return False
    address = os.environ.get("RAY_ADDRESS")
    if address:
        logger.info("joining the Ray cluster at %s", address)
        ray.init(address=address, logging_level=logging.WARNING)
        return False
    os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
    logger.info("starting a local Ray (127.0.0.1, no dashboard)")
    ray.init(
        include_dashboard=False,
        _node_ip_address="127.0.0.1",
        object_store_memory=LOCAL_OBJECT_STORE_BYTES,
        logging_level=logging.WARNING,
    )
    return True


class RayWorker:
    """One rank, in a Ray actor (`ray.remote(RayWorker)`)."""

    def info(self) -> tuple[str, int, int]:
        """(its node id, its pid, a free TCP port on its node)."""
        import ray

        return ray.get_runtime_context().get_node_id(), os.getpid(), free_port("")

    def run(self, startup: bytes, reply_address: str, env: dict[str, str]) -> int:
        """The rank's whole life (`multiproc_worker.serve`): returns when it is shut
        down (0) or failed (1, the error sent on the reply socket first)."""
        import torch

        from asyncllm import envs
        from asyncllm.executor.multiproc_worker import serve

        os.environ.update(env)
        logging.basicConfig(level=envs.log_level())
        msg = msgspec.msgpack.decode(startup, type=WorkerStartup)
        if msg.threads:
            torch.set_num_threads(msg.threads)
        replies = SocketReplies(reply_address)
        try:
            return serve(msg, replies)
        finally:
            replies.close()


class SocketReplies:
    """A Ray worker's replies to the core: a ZMQ PUSH socket to its PULL."""

    def __init__(self, address: str) -> None:
        self._ctx = zmq.Context()
        self._sock = self._ctx.socket(zmq.PUSH)
        self._sock.setsockopt(zmq.LINGER, 2000)  # (an error sent as the rank exits gets out)
        self._sock.connect(address)

    def send(self, msg: Any) -> None:
        self._sock.send(_ENCODER.encode(msg))

    def close(self) -> None:
        self._sock.close()
        self._ctx.term()


@dataclasses.dataclass(eq=False)
class _RayWorker(WorkerHandle):
    """The core's side of one actor: `run_ref` is its `run` call."""

    ray: Any
    actor: Any
    node_id: str
    node_ip: str
    actor_pid: int
    run_ref: Any = None
    code: int | None = None

    @property
    def pid(self) -> int:
        return self.actor_pid

    def describe(self) -> str:
        return f"pid {self.actor_pid} on {self.node_ip}"

    def poll(self) -> int | None:
        if self.code is not None:
            return self.code
        if self.run_ref is None:
            return None
        ready, _ = self.ray.wait([self.run_ref], timeout=0)
        if not ready:
            return None
        try:
            self.code = int(self.ray.get(self.run_ref))
        except self.ray.exceptions.RayActorError:
            self.code = -9  # (the actor died: killed, or its process ended)
        except Exception:  # noqa: BLE001 (an error in `run` itself)
            self.code = 1
        return self.code

    def wait(self, timeout: float) -> None:
        if self.run_ref is not None and self.code is None:
            self.ray.wait([self.run_ref], timeout=max(0.0, timeout))

    def kill(self) -> None:
        with contextlib.suppress(Exception):
            self.ray.kill(self.actor, no_restart=True)


class RayDistributedExecutor(MultiprocExecutor):
    """Workers as Ray actors (see the module docstring)."""

    def __init__(self, config: EngineConfig) -> None:
        self._ray = import_ray()
        self._started_ray = False
        self._groups: list[Any] = []
        self._reply_ctx: zmq.Context[zmq.Socket[bytes]] | None = None
        self._reply_sock: zmq.Socket[bytes] | None = None
        self._core_ip = "127.0.0.1"
        self._placed: list[_RayWorker] = []  # by rank
        self._rank0_port = 0
        super().__init__(config)

    # -- placement ---------------------------------------------------------------------

    def _start_workers(self) -> None:
        ray = self._ray
        self._started_ray = connect_ray(ray)
        nodes = {n["NodeID"]: n for n in ray.nodes() if n.get("Alive")}
        self._check_resources(nodes)
        core_node = ray.get_runtime_context().get_node_id()
        self._core_ip = (
            nodes[core_node]["NodeManagerAddress"] if core_node in nodes else "127.0.0.1"
        )
        self._place(nodes)
        self._reply_ctx = zmq.Context()
        self._reply_sock = self._reply_ctx.socket(zmq.PULL)
        port = self._reply_sock.bind_to_random_port(f"tcp://{self._core_ip}")
        self._reply_address = f"tcp://{self._core_ip}:{port}"
        self._core_node = core_node
        super()._start_workers()

    def _check_resources(self, nodes: dict[str, Any]) -> None:
        """Refuses at once what the cluster can never place."""
        tp, world = self.tp_size, self.world_size
        kind = "GPU" if self.config.model.device.type == "cuda" else "CPU"
        per_node = sorted((int(n["Resources"].get(kind, 0)) for n in nodes.values()), reverse=True)
        what = (
            f"tensor_parallel_size={tp} x pipeline_parallel_size="
            f"{self.config.parallel.pipeline_parallel_size}"
        )
        if world > sum(per_node):
            raise ValueError(
                f"{what} needs {world} {kind}s, but the Ray cluster has {sum(per_node)} "
                f"({len(per_node)} node(s): {per_node})"
            )
        if tp > per_node[0]:
            raise ValueError(
                f"{what}: the {tp} ranks of a tensor-parallel group must share a node, but the "
                f"largest node of the Ray cluster has {per_node[0]} {kind}s"
            )

    def _place(self, nodes: dict[str, Any]) -> None:
        """A placement group per stage, an actor per bundle; ranks by stage."""
        ray = self._ray
        from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

        cuda = self.config.model.device.type == "cuda"
        bundle = {"GPU": 1.0} if cuda else {"CPU": 1.0}
        stages = self.config.parallel.pipeline_parallel_size
        self._groups = [
            ray.util.placement_group([bundle] * self.tp_size, strategy="STRICT_PACK")
            for _ in range(stages)
        ]
        ready, _ = ray.wait([g.ready() for g in self._groups], num_returns=stages, timeout=0)
        if len(ready) < stages:
            ready, _ = ray.wait(
                [g.ready() for g in self._groups], num_returns=stages, timeout=PLACEMENT_TIMEOUT_S
            )
        if len(ready) < stages:
            raise TimeoutError(
                f"the Ray cluster placed {len(ready)} of {stages} stage(s) of {self.tp_size} "
                f"{'GPU' if cuda else 'CPU'} bundle(s) in {PLACEMENT_TIMEOUT_S:g} s: its devices "
                "are in use (ray status shows them)"
            )
        remote = ray.remote(RayWorker)
        actors = []
        for group in self._groups:
            for i in range(self.tp_size):
                actors.append(
                    remote.options(
                        num_cpus=0 if cuda else 1,
                        num_gpus=1 if cuda else 0,
                        scheduling_strategy=PlacementGroupSchedulingStrategy(
                            placement_group=group, placement_group_bundle_index=i
                        ),
                    ).remote()
                )
        infos = ray.get([a.info.remote() for a in actors], timeout=envs.worker_start_timeout_s())
        for rank, (actor, (node, pid, port)) in enumerate(zip(actors, infos, strict=True)):
            ip = nodes[node]["NodeManagerAddress"] if node in nodes else "127.0.0.1"
            w = _RayWorker(rank, ray=ray, actor=actor, node_id=node, node_ip=ip, actor_pid=pid)
            self._placed.append(w)
            if rank == 0:
                self._rank0_port = port

    def _local_ranks(self) -> list[int]:
        return [w.rank for w in self._placed if w.node_id == self._core_node]

    def _queue_host(self) -> str:
        return self._core_ip

    def _worker_host(self, rank: int) -> str:
        return self._placed[rank].node_ip

    def _init_method(self) -> str:
        return f"tcp://{self._placed[0].node_ip}:{self._rank0_port}"

    def _threads(self) -> int:
        return self.config.cpu_threads or 1  # (a bundle is one CPU)

    def _device_index(self, rank: int) -> int:
        return 0  # (Ray shows each actor its one GPU)

    def _launch(self, startups: list[WorkerStartup]) -> None:
        env = {k: v for k, v in os.environ.items() if k.startswith(FORWARDED_ENV_PREFIXES)}
        for startup, w in zip(startups, self._placed, strict=True):
            body = _ENCODER.encode(startup)
            w.run_ref = w.actor.run.remote(body, self._reply_address, env)
            self._workers.append(w)

    # -- replies and supervision ---------------------------------------------------------

    def _drain(self, w: Any) -> None:
        """Every reply on the socket into its worker's inbox (no wait)."""
        sock = self._reply_sock
        if sock is None:
            return
        with self._pipe_lock:
            while True:
                try:
                    body = sock.recv(zmq.NOBLOCK)
                except zmq.Again:
                    return
                except zmq.ZMQError:
                    return  # (closed: shutting down)
                self._deliver(body)

    def _wait_for_replies(self, waiting: list[Any], timeout: float) -> None:
        sock = self._reply_sock
        if sock is None:
            time.sleep(timeout)
            return
        with self._pipe_lock:
            sock.poll(int(timeout * 1000), zmq.POLLIN)

    def _start_monitor(self) -> None:
        self._monitor = threading.Thread(
            target=self._watch_workers, name="asyncllm-ray-monitor", daemon=True
        )
        self._monitor.start()

    def _wait_for_exit(self, timeout: float | None = None) -> bool:
        refs = [w.run_ref for w in self._workers if w.run_ref is not None]
        wait_s = MONITOR_POLL_S if timeout is None else min(timeout, MONITOR_POLL_S)
        try:
            self._ray.wait(refs, num_returns=1, timeout=wait_s)
        except Exception:  # noqa: BLE001 (Ray shut down under us)
            return False
        return not self._stopping

    def _death(self, w: Any, starting: bool = False) -> WorkerDiedError:
        error = super()._death(w, starting)
        if w.poll() == -9 and w.error is None:
            return WorkerDiedError(f"{error} (its Ray actor died)")
        return error

    def _release_workers(self) -> None:
        ray = self._ray
        for w in self._placed:
            w.kill()
        if self._reply_sock is not None:
            with self._pipe_lock:
                self._reply_sock.close(linger=0)
                self._reply_sock = None
        if self._reply_ctx is not None:
            self._reply_ctx.term()
            self._reply_ctx = None
        for group in self._groups:
            with contextlib.suppress(Exception):
                ray.util.remove_placement_group(group)
        self._groups = []
        if self._started_ray:
            self._started_ray = False
            with contextlib.suppress(Exception):
                ray.shutdown()
