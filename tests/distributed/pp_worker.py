"""One rank of test_pipeline_stages.py's two-process checks: pipeline stages at PP = 2.

Run as `python -m tests.distributed.pp_worker RANK WORLD INIT_METHOD OUT_DIR`. Every rank
builds the same tiny random Llamas from fixed seeds: first whole (one stage, before the
pipeline group exists: the reference), then its own stage of each. Stage 0 runs its
layers and sends the hidden states and residual with `send_tensor_dict`; stage 1
receives them, runs the rest and computes logits, which must equal the whole model's
for a prefill of three sequences and two decode steps through the paged KV cache.

The models: 3 layers with an untied LM head, split evenly (stage 0 gets the extra
layer: 2 + 1); 4 layers with the LM head tied to the embedding, split "1,3" by
ASYNCLLM_PP_LAYER_PARTITION (the last stage holds the table as its LM head).
"""

from __future__ import annotations

import os
import sys
from collections.abc import Callable
from pathlib import Path
from types import SimpleNamespace

import torch
from torch import nn

from asyncllm.distributed import parallel_state as ps
from asyncllm.model.attention.torch_native import TorchNativeBackend
from asyncllm.model.interface import KVCacheSpec
from asyncllm.model.models.llama import LlamaForCausalLM
from asyncllm.model.pipeline import PP_LAYER_PARTITION_ENV
from tests.distributed.ranks import run_checks
from tests.model.paged_decoder import PagedDecoder

PP = 2
TOL = 1e-5
HEAD_DIM = 16
PROMPT_LENS = (5, 19, 11)  # the second crosses a block of 16
DECODE_STEPS = 2


def tiny_llama_config(num_layers: int, tied: bool) -> SimpleNamespace:
    """A Llama config as the model reads it (no transformers import: it costs seconds)."""
    return SimpleNamespace(
        vocab_size=384,
        hidden_size=64,
        intermediate_size=160,
        num_hidden_layers=num_layers,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=1024,
        rms_norm_eps=1e-6,
        rope_theta=10000.0,
        hidden_act="silu",
        tie_word_embeddings=tied,
    )


def tiny_llama_checkpoint(config: SimpleNamespace, seed: int) -> dict[str, torch.Tensor]:
    """Random weights under a Hugging Face Llama checkpoint's names."""
    gen = torch.Generator().manual_seed(seed)
    h, inter, kv = config.hidden_size, config.intermediate_size, 2 * HEAD_DIM

    def rand(*shape: int, scale: float = 0.25) -> torch.Tensor:
        return torch.randn(*shape, generator=gen) * scale

    def norm() -> torch.Tensor:
        return 1 + rand(h, scale=0.1)

    ckpt = {"model.embed_tokens.weight": rand(config.vocab_size, h)}
    for i in range(config.num_hidden_layers):
        p = f"model.layers.{i}."
        ckpt |= {
            p + "self_attn.q_proj.weight": rand(h, h),
            p + "self_attn.k_proj.weight": rand(kv, h),
            p + "self_attn.v_proj.weight": rand(kv, h),
            p + "self_attn.o_proj.weight": rand(h, h),
            p + "mlp.gate_proj.weight": rand(inter, h),
            p + "mlp.up_proj.weight": rand(inter, h),
            p + "mlp.down_proj.weight": rand(h, inter),
            p + "input_layernorm.weight": norm(),
            p + "post_attention_layernorm.weight": norm(),
        }
    ckpt["model.norm.weight"] = norm()
    if not config.tie_word_embeddings:
        ckpt["lm_head.weight"] = rand(config.vocab_size, h)
    return ckpt


def build(config: SimpleNamespace, weights: dict[str, torch.Tensor]) -> LlamaForCausalLM:
    """The model of this process's stage, loaded from the whole checkpoint."""
    model = LlamaForCausalLM(config, TorchNativeBackend())
    loaded = model.load_weights(weights.items())
    assert loaded == model.expected_parameters(), sorted(model.expected_parameters() - loaded)
    return model.eval()


def stage_names(names: set[str], layers: range, embedding: bool, last: bool) -> set[str]:
    """The names among `names` a stage of `layers` holds."""

    def held(name: str) -> bool:
        if name.startswith("model.layers."):
            return int(name.split(".")[2]) in layers
        if name.startswith("model.embed_tokens."):
            return embedding
        return last  # model.norm, lm_head

    return {n for n in names if held(n)}


class StageDriver(nn.Module):
    """A pipeline stage as PagedDecoder drives a model: a stage after the first
    receives its input from the previous one, a stage before the last sends its output
    on (and gives PagedDecoder placeholder rows to take no logits from)."""

    def __init__(self, model: LlamaForCausalLM) -> None:
        super().__init__()
        self.model, self.pp = model, ps.get_pp_group()

    def kv_cache_spec(self) -> KVCacheSpec:
        return self.model.kv_cache_spec()

    def forward(self, input_ids, positions, kv_caches, attn_metadata):
        received = None if self.pp.is_first_rank else self.pp.recv_tensor_dict()
        out = self.model(input_ids, positions, kv_caches, attn_metadata, received)
        if self.pp.is_last_rank:
            assert isinstance(out, torch.Tensor)
            return out
        assert isinstance(out, dict) and set(out) == {"hidden_states", "residual"}, out
        self.pp.send_tensor_dict(out)
        return torch.zeros(len(input_ids), 1)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.model.compute_logits(hidden) if self.pp.is_last_rank else hidden


def run_steps(model: nn.Module) -> list[torch.Tensor]:
    """Every logit row of a prefill of PROMPT_LENS sequences, then of DECODE_STEPS
    decode steps (fixed tokens, so every stage knows them)."""
    gen = torch.Generator().manual_seed(7)
    dec = PagedDecoder(model, TorchNativeBackend(), num_blocks=16)  # type: ignore[arg-type]
    sids = [dec.add_sequence() for _ in PROMPT_LENS]
    prompts = [torch.randint(0, 384, (n,), generator=gen).tolist() for n in PROMPT_LENS]
    steps = [dec.step(dict(zip(sids, prompts, strict=True)), all_logits=True)]
    for _ in range(DECODE_STEPS):
        tokens = torch.randint(0, 384, (len(sids),), generator=gen).tolist()
        steps.append(dec.step({s: [t] for s, t in zip(sids, tokens, strict=True)}))
    assert len(dec.kv_caches) == model.kv_cache_spec().num_layers  # type: ignore[operator]
    return [torch.cat([step[s] for s in sids]) for step in steps]


# --- the checks, in order ---------------------------------------------------------------
CASES = {
    # name: (config, partition, stage 0's layers, stage 1's layers)
    "untied": (tiny_llama_config(3, tied=False), None, range(0, 2), range(2, 3)),
    "tied": (tiny_llama_config(4, tied=True), "1,3", range(0, 1), range(1, 4)),
}
REFERENCE: dict[str, tuple[LlamaForCausalLM, dict[str, torch.Tensor], list[torch.Tensor]]] = {}
STAGES: dict[str, LlamaForCausalLM] = {}
CHECKS: list[tuple[str, Callable[[], None]]] = []
OUT_DIR = Path(".")


def check(fn: Callable[[], None]) -> Callable[[], None]:
    CHECKS.append((fn.__name__, fn))
    return fn


def pp_rank() -> int:
    return ps.get_pp_group().rank_in_group


@check
def reference_models_at_one_stage() -> None:
    assert ps.get_pp_group().world_size == 1  # no pipeline group yet
    for seed, (case, (config, _, _, _)) in enumerate(CASES.items()):
        weights = tiny_llama_checkpoint(config, seed)
        model = build(config, weights)
        assert model.kv_cache_spec() == KVCacheSpec(config.num_hidden_layers, 2, HEAD_DIM)
        REFERENCE[case] = (model, weights, run_steps(model))
    ps.initialize_model_parallel(tensor_parallel_size=1, pipeline_parallel_size=PP)
    assert ps.get_pp_group().world_size == PP


def build_stage(case: str) -> LlamaForCausalLM:
    config, partition, *_ = CASES[case]
    if partition is not None:
        os.environ[PP_LAYER_PARTITION_ENV] = partition
    try:
        return build(config, REFERENCE[case][1])  # the whole checkpoint: others' skipped
    finally:
        os.environ.pop(PP_LAYER_PARTITION_ENV, None)


def check_stage_holds_only_its_own(case: str) -> None:
    config, _, *layer_ranges = CASES[case]
    ref, weights, _ = REFERENCE[case]
    rank, layers = pp_rank(), layer_ranges[pp_rank()]
    model = STAGES[case] = build_stage(case)
    first, last = rank == 0, rank == PP - 1
    assert model.stage.layers == layers, (model.stage, layers)
    embedding = first or (config.tie_word_embeddings and last)
    names = set(dict(model.named_parameters()))
    assert names == stage_names(set(dict(ref.named_parameters())), layers, embedding, last), names
    assert model.expected_parameters() == names
    ref_params = dict(ref.named_parameters())
    for name, p in model.named_parameters():
        assert torch.equal(p, ref_params[name]), name
    if config.tie_word_embeddings and last:
        assert model.lm_head.weight is model.model.embed_tokens.weight  # the table as LM head
    assert model.kv_cache_spec() == KVCacheSpec(len(layers), 2, HEAD_DIM, layers.start)
    assert model.kv_cache_spec().layers == layers
    # The loader reads only this stage's tensors from a checkpoint folder.
    from safetensors.torch import save_file

    from asyncllm.model.loader import DefaultModelLoader

    folder = OUT_DIR / f"{case}-rank{rank}"
    folder.mkdir()
    save_file(weights, str(folder / "model.safetensors"))
    read = dict(DefaultModelLoader().weights(folder, torch.device("cpu"), model.holds_weight))
    assert set(read) == stage_names(set(weights), layers, embedding, last), sorted(read)
    assert model.load_weights(read.items()) == names


def check_logits_equal_one_stage(case: str) -> None:
    outs = run_steps(StageDriver(STAGES[case]))
    if pp_rank() != PP - 1:
        return
    for i, (ours, ref) in enumerate(zip(outs, REFERENCE[case][2], strict=True)):
        assert ours.shape == ref.shape, (i, ours.shape, ref.shape)
        err = (ours - ref).abs().max().item()
        assert err <= TOL, f"step {i}: max abs error {err:.3g} > {TOL}"


@check
def untied_stage_holds_only_its_own() -> None:
    check_stage_holds_only_its_own("untied")


@check
def untied_logits_equal_one_stage() -> None:
    check_logits_equal_one_stage("untied")


@check
def tied_stage_holds_only_its_own() -> None:
    check_stage_holds_only_its_own("tied")


@check
def tied_logits_equal_one_stage() -> None:
    check_logits_equal_one_stage("tied")


@check
def teardown() -> None:
    ps.destroy_distributed_environment()
    assert ps.get_pp_group().world_size == 1


CHECK_NAMES = [name for name, _ in CHECKS]


def main() -> None:
    global OUT_DIR
    rank, world, init_method, out_dir = sys.argv[1:5]
    torch.set_num_threads(1)
    OUT_DIR = Path(out_dir)
    ps.init_distributed_environment(int(world), int(rank), init_method, timeout=20)
    run_checks(CHECKS, OUT_DIR / f"rank{rank}.json", int(rank))


if __name__ == "__main__":
    main()
