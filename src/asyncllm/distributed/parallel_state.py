"""Process groups of a distributed run: the world, tensor-parallel (TP) and
pipeline-parallel (PP) groups, each behind a `GroupCoordinator`.

Nothing here runs until a process asks: with no initialization every getter returns a
coordinator of one rank, whose collectives return their input untouched, so a
single-process engine never initializes torch.distributed and never runs a collective.

How a worker process uses it (one process per rank; `rank` in [0, world_size)):

1. `init_distributed_environment(world_size, rank, init_method, local_rank)` first,
   before anything touches the device: it joins the world (`init_method` is a
   `tcp://host:port` or `file://path` every rank names alike), picks NCCL on CUDA and
   gloo otherwise (`backend=` overrides, e.g. "gloo" for a CPU model on a CUDA host),
   sets the CUDA device to `local_rank` for NCCL and builds the world group.
2. `initialize_model_parallel(tensor_parallel_size, pipeline_parallel_size)`, on every
   rank with the same numbers (world_size = TP x PP). Ranks are laid out as vLLM lays
   them out: a TP group is TP contiguous ranks, a PP group strides by the TP size
   (world 4 = TP 2 x PP 2: TP groups [0, 1] and [2, 3], PP groups [0, 2] and [1, 3]);
   so global rank r is TP rank `r % tp` of pipeline stage `r // tp`. `group_layout`
   computes this without processes.
3. Build the model only then: the sharded layers (`model/layers/linear.py`,
   `embedding.py`) read `get_tp_group()` in their constructors and keep it; they use its
   `rank_in_group` and `world_size` to size and load their shard, `all_reduce`
   (row-parallel linear, vocabulary embedding) and `all_gather(x, -1)` (column-parallel
   with `gather_output`, the LM head's logits). Pipeline stages use `get_pp_group()`:
   `send_tensor_dict` / `recv_tensor_dict` pass hidden states and residuals to the next
   stage, `is_first_rank` / `is_last_rank` say which end a rank holds.
4. Teardown: `destroy_model_parallel()` then `destroy_distributed_environment()` (the
   latter calls the former if needed): every process group is destroyed and the getters
   return the one-rank default again, so a process may initialize anew (a fresh
   `init_method`: a TCP port may still be held a while, a file must not exist).

Every rank must call the initializers and collectives in the same order (torch's rule
for `new_group` and for collectives). Each coordinator holds a device group (the chosen
backend) for tensors and a gloo CPU group for metadata and objects; with gloo both are
one group. Objects cross as msgspec msgpack bytes, never pickles.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from datetime import timedelta
from typing import Any

import msgspec
import torch
import torch.distributed as dist

__all__ = [
    "GroupCoordinator",
    "destroy_distributed_environment",
    "destroy_model_parallel",
    "get_pp_group",
    "get_tp_group",
    "get_world_group",
    "group_layout",
    "init_distributed_environment",
    "initialize_model_parallel",
    "model_parallel_is_initialized",
]


def group_layout(
    world_size: int, tensor_parallel_size: int, pipeline_parallel_size: int
) -> tuple[list[list[int]], list[list[int]]]:
    """(TP groups, PP groups) as lists of global ranks: TP groups are contiguous ranks,
    PP groups stride by the TP size."""
    tp, pp = tensor_parallel_size, pipeline_parallel_size
    if tp < 1 or pp < 1:
        raise ValueError(
            f"tensor_parallel_size ({tp}) and pipeline_parallel_size ({pp}) must be at least 1"
        )
    if world_size != tp * pp:
        raise ValueError(
            f"world size ({world_size}) is not tensor_parallel_size ({tp}) x "
            f"pipeline_parallel_size ({pp}) = {tp * pp}"
        )
    tp_groups = [list(range(stage * tp, (stage + 1) * tp)) for stage in range(pp)]
    pp_groups = [list(range(i, world_size, tp)) for i in range(tp)]
    return tp_groups, pp_groups


_OBJECT_ENCODER = msgspec.msgpack.Encoder()
_META_DECODER = msgspec.msgpack.Decoder(list[tuple[str, str, list[int], bool]])


def _dtype(name: str) -> torch.dtype:
    dtype = getattr(torch, name.removeprefix("torch."), None)
    if not isinstance(dtype, torch.dtype):
        raise ValueError(f"unknown dtype {name!r} in a tensor dict's metadata")
    return dtype


@dataclass(eq=False)
class GroupCoordinator:
    """One group of ranks and its collectives.

    `ranks` are global ranks, `rank` this process's global rank, `rank_in_group` its
    index in `ranks`. Collectives take and return ranks within the group (`src`, `dst`
    index `ranks`). With one rank each collective returns its input and touches no
    process group (the groups may then be None).
    """

    name: str
    ranks: list[int]
    rank: int
    local_rank: int = 0
    device_group: dist.ProcessGroup | None = None
    cpu_group: dist.ProcessGroup | None = None
    device: torch.device = field(default_factory=lambda: torch.device("cpu"))

    def __post_init__(self) -> None:
        if self.rank not in self.ranks:
            raise ValueError(f"rank {self.rank} is not in group {self.name!r} {self.ranks}")
        self.rank_in_group = self.ranks.index(self.rank)
        self.world_size = len(self.ranks)

    # --- where this rank sits ---------------------------------------------------
    @property
    def first_rank(self) -> int:
        return self.ranks[0]

    @property
    def last_rank(self) -> int:
        return self.ranks[-1]

    @property
    def is_first_rank(self) -> bool:
        return self.rank_in_group == 0

    @property
    def is_last_rank(self) -> bool:
        return self.rank_in_group == self.world_size - 1

    @property
    def next_rank(self) -> int:
        """The next rank in the group (by index, wrapping), as a global rank."""
        return self.ranks[(self.rank_in_group + 1) % self.world_size]

    @property
    def prev_rank(self) -> int:
        return self.ranks[(self.rank_in_group - 1) % self.world_size]

    def _global(self, index: int, what: str) -> int:
        if not 0 <= index < self.world_size:
            raise ValueError(
                f"{what} {index} is outside group {self.name!r} of {self.world_size} ranks"
            )
        return self.ranks[index]

    # --- tensor collectives (device group) ----------------------------------------
    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        """The sum over the group; in place when `x` is contiguous. Use the result."""
        if self.world_size == 1:
            return x
        if not x.is_contiguous():
            x = x.contiguous()
        dist.all_reduce(x, group=self.device_group)
        return x

    def all_gather(self, x: torch.Tensor, dim: int = -1) -> torch.Tensor:
        """Every rank's `x` concatenated along `dim`, in group order, on every rank."""
        if self.world_size == 1:
            return x
        if not -x.dim() <= dim < x.dim():
            raise ValueError(f"dim {dim} is out of range for a tensor of {x.dim()} dims")
        dim %= x.dim()
        # Flat buffers: gloo wants the output as the inputs laid end to end.
        out = torch.empty(self.world_size * x.numel(), dtype=x.dtype, device=x.device)
        _all_gather_flat(out, x.contiguous().view(-1), group=self.device_group)
        return _merge_first_into(out.view(self.world_size, *x.shape), dim)

    def gather(self, x: torch.Tensor, dst: int = 0, dim: int = -1) -> torch.Tensor | None:
        """Every rank's `x` concatenated along `dim` on the group's rank `dst`; None on
        the other ranks."""
        if self.world_size == 1:
            return x
        if not -x.dim() <= dim < x.dim():
            raise ValueError(f"dim {dim} is out of range for a tensor of {x.dim()} dims")
        self._global(dst, "dst")
        parts = (
            [torch.empty_like(x, memory_format=torch.contiguous_format) for _ in self.ranks]
            if self.rank_in_group == dst
            else None
        )
        dist.gather(x.contiguous(), parts, group=self.device_group, group_dst=dst)
        return torch.cat(parts, dim=dim) if parts is not None else None

    def broadcast(self, x: torch.Tensor, src: int = 0) -> torch.Tensor:
        """The group's rank `src`'s `x`, written into `x` on every rank (contiguous)."""
        if self.world_size == 1:
            return x
        self._global(src, "src")
        if not x.is_contiguous():
            raise ValueError("broadcast writes in place: the tensor must be contiguous")
        dist.broadcast(x, group=self.device_group, group_src=src)
        return x

    # --- objects and metadata (CPU group) -----------------------------------------
    def broadcast_object(self, obj: Any = None, src: int = 0, as_type: Any = Any) -> Any:
        """Rank `src`'s `obj` on every rank, sent as msgspec msgpack over the CPU group.

        `obj` is plain data (None, numbers, strings, bytes, lists, dicts) or msgspec
        structs; other ranks decode it as `as_type` (Any: plain data, so a tuple comes back
        a list). Rank `src` gets its own `obj` back.
        """
        if self.world_size == 1:
            return obj
        self._global(src, "src")
        if self.rank_in_group == src:
            data = _OBJECT_ENCODER.encode(obj)
            size = torch.tensor([len(data)], dtype=torch.int64)
            dist.broadcast(size, group=self.cpu_group, group_src=src)
            dist.broadcast(_bytes_tensor(data), group=self.cpu_group, group_src=src)
            return obj
        size = torch.empty(1, dtype=torch.int64)
        dist.broadcast(size, group=self.cpu_group, group_src=src)
        buf = torch.empty(int(size.item()), dtype=torch.uint8)
        dist.broadcast(buf, group=self.cpu_group, group_src=src)
        return msgspec.msgpack.decode(buf.numpy().tobytes(), type=as_type)

    def send_tensor_dict(self, tensors: dict[str, torch.Tensor], dst: int | None = None) -> None:
        """Sends named tensors to the group's rank `dst` (default: the next rank):
        names, dtypes and shapes over the CPU group, then each tensor over the device
        group (a CPU tensor over the CPU group). `recv_tensor_dict` on `dst` takes them."""
        if self.world_size == 1:
            raise RuntimeError(f"group {self.name!r} has one rank: nothing to send to")
        peer = (self.rank_in_group + 1) % self.world_size if dst is None else dst
        self._global(peer, "dst")
        if peer == self.rank_in_group:
            raise ValueError("a rank cannot send a tensor dict to itself")
        meta = []
        for key, t in tensors.items():
            if not isinstance(t, torch.Tensor):
                raise TypeError(f"tensor dict value {key!r} is a {type(t).__name__}, not a tensor")
            meta.append((key, str(t.dtype), list(t.shape), t.device.type == "cpu"))
        data = _OBJECT_ENCODER.encode(meta)
        dist.send(
            torch.tensor([len(data)], dtype=torch.int64), group=self.cpu_group, group_dst=peer
        )
        dist.send(_bytes_tensor(data), group=self.cpu_group, group_dst=peer)
        for t in tensors.values():
            if t.numel():
                group = self.cpu_group if t.device.type == "cpu" else self.device_group
                dist.send(t.contiguous(), group=group, group_dst=peer)

    def recv_tensor_dict(self, src: int | None = None) -> dict[str, torch.Tensor]:
        """The tensors the group's rank `src` (default: the previous rank) sent; those
        sent from the device land on this rank's device, CPU ones on the CPU."""
        if self.world_size == 1:
            raise RuntimeError(f"group {self.name!r} has one rank: nothing to receive")
        peer = (self.rank_in_group - 1) % self.world_size if src is None else src
        self._global(peer, "src")
        if peer == self.rank_in_group:
            raise ValueError("a rank cannot receive a tensor dict from itself")
        size = torch.empty(1, dtype=torch.int64)
        dist.recv(size, group=self.cpu_group, group_src=peer)
        buf = torch.empty(int(size.item()), dtype=torch.uint8)
        dist.recv(buf, group=self.cpu_group, group_src=peer)
        out: dict[str, torch.Tensor] = {}
        for key, dtype, shape, on_cpu in _META_DECODER.decode(buf.numpy().tobytes()):
            device = torch.device("cpu") if on_cpu else self.device
            t = torch.empty(shape, dtype=_dtype(dtype), device=device)
            if t.numel():
                group = self.cpu_group if on_cpu else self.device_group
                dist.recv(t, group=group, group_src=peer)
            out[key] = t
        return out

    def barrier(self) -> None:
        """Returns once every rank of the group has reached it (over the CPU group)."""
        if self.world_size == 1:
            return
        dist.barrier(group=self.cpu_group)

    def destroy(self) -> None:
        """Destroys the group's process groups; the coordinator is unusable after."""
        groups = {id(g): g for g in (self.device_group, self.cpu_group) if g is not None}
        for g in groups.values():
            if g is not dist.group.WORLD:
                dist.destroy_process_group(g)
        self.device_group = self.cpu_group = None


# torch 2.13 renamed all_gather_into_tensor (an older torch on a GPU host has only that).
_all_gather_flat = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor


def _merge_first_into(out: torch.Tensor, dim: int) -> torch.Tensor:
    """[world, *shape] -> shape with dimension `dim` world times as long (rank-major)."""
    if dim == 0:
        return out.reshape(-1, *out.shape[2:])
    shape = list(out.shape[1:])
    shape[dim] *= out.shape[0]
    return out.movedim(0, dim).reshape(shape)


def _bytes_tensor(data: bytes) -> torch.Tensor:
    return torch.frombuffer(bytearray(data), dtype=torch.uint8)


def _solo(name: str) -> GroupCoordinator:
    return GroupCoordinator(name=name, ranks=[0], rank=0)


# The one-rank defaults: what every getter returns until a world is initialized.
_SOLO_WORLD = _solo("world")
_SOLO_TP = _solo("tp")
_SOLO_PP = _solo("pp")

_WORLD: GroupCoordinator | None = None
_TP: GroupCoordinator | None = None
_PP: GroupCoordinator | None = None
_BACKEND: str = "gloo"
_TIMEOUT: timedelta | None = None
_OWNS_DEFAULT_GROUP = False


def get_world_group() -> GroupCoordinator:
    return _WORLD if _WORLD is not None else _SOLO_WORLD


def get_tp_group() -> GroupCoordinator:
    return _TP if _TP is not None else _SOLO_TP


def get_pp_group() -> GroupCoordinator:
    return _PP if _PP is not None else _SOLO_PP


def model_parallel_is_initialized() -> bool:
    return _TP is not None and _PP is not None


def _device_for(backend: str, local_rank: int) -> torch.device:
    return torch.device("cuda", local_rank) if backend == "nccl" else torch.device("cpu")


def init_distributed_environment(
    world_size: int,
    rank: int,
    init_method: str,
    local_rank: int | None = None,
    backend: str | None = None,
    timeout: timedelta | float | None = None,
) -> GroupCoordinator:
    """Joins (or, for rank 0 of a TCP init, opens) the world and builds its group.

    `local_rank` (default: `rank`) is the device index on this machine; `backend`
    None picks NCCL when CUDA and NCCL are there, gloo otherwise; `timeout` (seconds or
    a timedelta) bounds every collective, so a rank whose peer died fails instead of
    waiting for torch's default of minutes.
    """
    global _WORLD, _BACKEND, _TIMEOUT, _OWNS_DEFAULT_GROUP
    if not 0 <= rank < world_size:
        raise ValueError(f"rank {rank} is outside a world of {world_size}")
    if _WORLD is not None:
        raise RuntimeError(
            "the distributed environment is already initialized: "
            "call destroy_distributed_environment() first"
        )
    if dist.is_initialized():  # by a launcher (torchrun): its backend
        backend = str(dist.get_backend())
    elif backend is None:
        backend = "nccl" if torch.cuda.is_available() and dist.is_nccl_available() else "gloo"
    if local_rank is None:
        local_rank = rank
    if isinstance(timeout, int | float):
        timeout = timedelta(seconds=timeout)
    if backend == "nccl":
        torch.cuda.set_device(local_rank)
    if dist.is_initialized():  # adopt the launcher's world
        if dist.get_world_size() != world_size or dist.get_rank() != rank:
            raise RuntimeError(
                f"torch.distributed is already initialized as rank {dist.get_rank()} of "
                f"{dist.get_world_size()}, not rank {rank} of {world_size}"
            )
        _OWNS_DEFAULT_GROUP = False
    else:
        dist.init_process_group(
            backend=backend,
            init_method=init_method,
            world_size=world_size,
            rank=rank,
            timeout=timeout,
        )
        _OWNS_DEFAULT_GROUP = True
    _BACKEND, _TIMEOUT = backend, timeout
    ranks = list(range(world_size))
    cpu_group = dist.group.WORLD
    if backend != "gloo" and world_size > 1:
        cpu_group = dist.new_group(ranks, backend="gloo", timeout=timeout)
    _WORLD = GroupCoordinator(
        name="world",
        ranks=ranks,
        rank=rank,
        local_rank=local_rank,
        device_group=dist.group.WORLD,
        cpu_group=cpu_group,
        device=_device_for(backend, local_rank),
    )
    return _WORLD


def _new_coordinator(name: str, group_ranks: Sequence[list[int]]) -> GroupCoordinator:
    """The coordinator of this rank's group among `group_ranks`. Every rank creates every
    group, in the same order (torch's rule); groups of one rank get no process group."""
    world = get_world_group()
    mine: list[int] | None = None
    device_group = cpu_group = None
    for ranks in group_ranks:
        if len(ranks) > 1:
            dg = dist.new_group(ranks, backend=_BACKEND, timeout=_TIMEOUT)
            cg = dg
            if _BACKEND != "gloo":
                cg = dist.new_group(ranks, backend="gloo", timeout=_TIMEOUT)
            if world.rank in ranks:
                device_group, cpu_group = dg, cg
        if world.rank in ranks:
            mine = list(ranks)
    if mine is None:
        raise RuntimeError(f"rank {world.rank} is in no {name} group of {list(group_ranks)}")
    return GroupCoordinator(
        name=name,
        ranks=mine,
        rank=world.rank,
        local_rank=world.local_rank,
        device_group=device_group,
        cpu_group=cpu_group,
        device=world.device,
    )


def initialize_model_parallel(
    tensor_parallel_size: int = 1, pipeline_parallel_size: int = 1
) -> None:
    """Builds the TP and PP groups over the initialized world (TP x PP must be the
    world's size). With no world initialized, TP = PP = 1 keeps the one-rank defaults."""
    global _TP, _PP
    tp, pp = tensor_parallel_size, pipeline_parallel_size
    if _WORLD is None:
        if tp == pp == 1:
            return
        raise RuntimeError(
            f"tensor_parallel_size {tp} x pipeline_parallel_size {pp} needs "
            "init_distributed_environment() first"
        )
    if model_parallel_is_initialized():
        raise RuntimeError(
            "model parallel groups are already initialized: call destroy_model_parallel() first"
        )
    tp_groups, pp_groups = group_layout(_WORLD.world_size, tp, pp)
    tp_group = _new_coordinator("tp", tp_groups)
    pp_group = _new_coordinator("pp", pp_groups)
    _TP, _PP = tp_group, pp_group


def destroy_model_parallel() -> None:
    """Destroys the TP and PP groups; the getters return one-rank groups again."""
    global _TP, _PP
    for group in (_TP, _PP):
        if group is not None:
            group.destroy()
    _TP = _PP = None


def destroy_distributed_environment() -> None:
    """Destroys every group and leaves torch.distributed uninitialized (unless a
    launcher had initialized it), so the process may initialize again."""
    global _WORLD, _OWNS_DEFAULT_GROUP
    destroy_model_parallel()
    world, _WORLD = _WORLD, None
    if world is not None:
        world.destroy()
        if _OWNS_DEFAULT_GROUP and dist.is_initialized():
            dist.destroy_process_group()
    _OWNS_DEFAULT_GROUP = False
