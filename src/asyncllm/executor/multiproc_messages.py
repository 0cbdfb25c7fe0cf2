"""What goes between the multiprocess executor and its workers: msgspec structs, plain
data (no pickle). A worker's start-up message and its replies travel length-prefixed
(`frame`) over its pipes; steps and control calls over the step queue, each a list of
frames whose first says which (`STEP`, `CONTROL`)."""

from __future__ import annotations

import dataclasses
from typing import Any

import msgspec

from asyncllm.config import EngineConfig
from asyncllm.distributed.shm_queue import QueueHandle

# The first frame of a message on the step queue.
STEP = b"S"
CONTROL = b"C"

LEN_BYTES = 4  # the length prefix of a framed message


class WorkerStartup(msgspec.Struct, kw_only=True):
    """The core -> worker startup message, on the worker's stdin."""

    rank: int
    world_size: int
    tensor_parallel_size: int
    pipeline_parallel_size: int
    local_rank: int
    init_method: str
    backend: str  # "gloo" or "nccl"
    result_rank: int  # the rank that writes the result queue
    steps: QueueHandle
    steps_reader: int  # this worker's reader index on the step queue
    # None: the core reads the result queue over shared memory (it shares the result
    # rank's machine); else the result rank's address, where it serves it over TCP.
    results_host: str | None = None
    config: dict[str, Any]  # `config_to_plain`
    threads: int  # torch's intra-op threads


class ControlCall(msgspec.Struct, array_like=True):
    call_id: int
    method: str
    args: list[Any] = []


class WorkerReady(msgspec.Struct, tag="ready", kw_only=True):
    rank: int
    results: QueueHandle | None  # the result queue, from the rank that writes it


class WorkerReply(msgspec.Struct, tag="reply", kw_only=True):
    rank: int
    call_id: int
    value: Any = None


class WorkerError(msgspec.Struct, tag="error", kw_only=True):
    rank: int
    error_type: str
    message: str
    call_id: int | None = None  # the call it answers; None: the worker is exiting


WorkerMessage = WorkerReady | WorkerReply | WorkerError
ENCODER = msgspec.msgpack.Encoder()
MESSAGE_DECODER = msgspec.msgpack.Decoder(WorkerMessage)


def frame(msg: Any) -> bytes:
    """A length-prefixed msgpack message (the pipes' framing)."""
    body = ENCODER.encode(msg)
    return len(body).to_bytes(LEN_BYTES, "big") + body


def config_to_plain(config: EngineConfig) -> dict[str, Any]:
    """The resolved configuration as plain data (msgpack-able; the worker rebuilds it
    with `multiproc_worker.config_from_plain`): torch dtypes and devices by their names,
    paths as strings, the model's config as its dict, enums by value."""
    out: dict[str, Any] = {}
    for f in dataclasses.fields(config):
        value = getattr(config, f.name)
        if dataclasses.is_dataclass(value) and not isinstance(value, type):
            part = {g.name: getattr(value, g.name) for g in dataclasses.fields(value)}
            if f.name == "model":
                part["path"] = str(part["path"])
                part["hf_config"] = part["hf_config"].to_dict()
                part["dtype"] = str(part["dtype"]).removeprefix("torch.")
                part["device"] = str(part["device"])
            value = part
        out[f.name] = value
    return out
