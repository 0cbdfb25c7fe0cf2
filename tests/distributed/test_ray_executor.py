"""RayDistributedExecutor end to end on the CPU: TP=2 on a local Ray the executor starts
(and stops) itself, and PP=2 with its stages on two Ray nodes of this machine
(`ray.cluster_utils.Cluster`), joined through RAY_ADDRESS, so the step queue's TCP path
(a remote reader) and a result queue served over TCP run; then one of its actors is
killed, and the engine must fail at once; and what the cluster can never place. Against the one-process executor (the TP=1
reference of conftest.py)."""

from __future__ import annotations

import os
import signal
import time

import pytest

from asyncllm import LLM, EngineArgs, EngineDeadError
from tests.distributed.engines import GREEDY, PROMPTS, TINY, as_inputs, token_ids

ray = pytest.importorskip("ray")

OBJECT_STORE = 80 << 20


def _executor(llm: LLM):
    return llm.engine.client.core.executor


def test_tp2_on_a_local_ray_the_executor_starts_equals_tp1(tiny_models, reference, monkeypatch):
    _, ref = reference
    monkeypatch.delenv("RAY_ADDRESS", raising=False)
    assert not ray.is_initialized()
    with LLM(
        str(tiny_models["llama3"]),
        multiprocess=False,
        tensor_parallel_size=2,
        distributed_executor_backend="ray",
        num_gpu_blocks_override=64,
        **TINY,
    ) as llm:
        executor = _executor(llm)
        assert type(executor).__name__ == "RayDistributedExecutor"
        assert ray.is_initialized() and executor._started_ray
        assert executor._local_ranks() == [0, 1]  # (one node: shared memory only)
        outs = llm.generate(as_inputs(PROMPTS), GREEDY, use_tqdm=False)
    assert not ray.is_initialized()  # (the local Ray it started is stopped)
    from tests.distributed.engines import assert_equal_under_tie_rule

    assert_equal_under_tie_rule(ref["llama3"], outs, "llama3 TP=2 on Ray")


@pytest.fixture
def two_nodes(monkeypatch):
    """A Ray cluster of two nodes (one CPU each) on this machine, this process its
    driver through RAY_ADDRESS (as after `ray start --head` and `ray start --address`)."""
    from ray.cluster_utils import Cluster

    monkeypatch.setenv("RAY_USAGE_STATS_ENABLED", "0")
    cluster = Cluster(
        initialize_head=True,
        head_node_args=dict(num_cpus=1, include_dashboard=False, object_store_memory=OBJECT_STORE),
    )
    try:
        cluster.add_node(num_cpus=1, object_store_memory=OBJECT_STORE)
        monkeypatch.setenv("RAY_ADDRESS", cluster.address)
        yield cluster
    finally:
        ray.shutdown()
        cluster.shutdown()


def test_pp2_stages_on_two_ray_nodes_and_a_killed_actor(tiny_models, reference, two_nodes):
    """First what the cluster (two nodes of one CPU) can never place, refused at once
    with the numbers; then PP=2, a stage a node."""
    from asyncllm.engine.core_config import create_engine_config
    from asyncllm.executor.ray_distributed import RayDistributedExecutor

    _, ref = reference
    path = str(tiny_models["llama3"])
    for sizes, refusal in (
        (dict(tensor_parallel_size=2, pipeline_parallel_size=2), r"needs 4 CPUs, but the Ray "),
        (dict(tensor_parallel_size=2), r"must share a node, but the largest node .* has 1 CPU"),
    ):
        args = EngineArgs(path, distributed_executor_backend="ray", **sizes, **TINY)
        t0 = time.monotonic()
        with pytest.raises(ValueError, match=refusal):
            RayDistributedExecutor(create_engine_config(args))
        assert time.monotonic() - t0 < 10
    llm = LLM(
        str(tiny_models["llama3"]),
        multiprocess=False,
        pipeline_parallel_size=2,
        distributed_executor_backend="ray",
        num_gpu_blocks_override=16,
        **TINY,
    )
    try:
        executor = _executor(llm)
        assert not executor._started_ray  # (it joined the cluster)
        nodes = [w.node_id for w in executor._placed]
        assert len(set(nodes)) == 2, nodes  # one stage a node
        assert len(executor._local_ranks()) == 1  # the other stage reads over TCP
        outs = llm.generate(as_inputs(PROMPTS), GREEDY, use_tqdm=False)
        assert token_ids(outs) == token_ids(ref["llama3"])  # (no sum is split: exact)
        assert llm.get_stats()["num_preemptions"] > 0
        os.kill(executor.worker_pids[1], signal.SIGKILL)
        t0 = time.monotonic()
        with pytest.raises(EngineDeadError, match="worker rank 1"):
            llm.generate(as_inputs(PROMPTS), GREEDY, use_tqdm=False)
        assert time.monotonic() - t0 < 10
    finally:
        llm.shutdown()


def test_ray_without_ray_installed_says_how_to_install_it(monkeypatch):
    import importlib.util

    real = importlib.util.find_spec
    monkeypatch.setattr(
        importlib.util, "find_spec", lambda name, *a: None if name == "ray" else real(name, *a)
    )
    with pytest.raises(ValueError, match=r"'ray' needs Ray.*pip install 'asyncllm\[ray\]'"):
        EngineArgs(tensor_parallel_size=2, distributed_executor_backend="ray")
