"""A tiny config-only model folder for the benchmark runs."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]

# Prompt ids go up to 10000, so the vocabulary is larger than that.
TINY_CONFIG = {
    "architectures": ["LlamaForCausalLM"],
    "model_type": "llama",
    "hidden_size": 64,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "intermediate_size": 128,
    "vocab_size": 10240,
    "max_position_embeddings": 4096,
    "rms_norm_eps": 1e-5,
    "rope_theta": 10000.0,
    "hidden_act": "silu",
    "tie_word_embeddings": False,
    "bos_token_id": 1,
    "eos_token_id": 2,
}


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory) -> Path:
    folder = tmp_path_factory.mktemp("tiny-llama-config")
    (folder / "config.json").write_text(json.dumps(TINY_CONFIG))
    return folder


@pytest.fixture
def engine_flags(tiny_model_dir) -> list[str]:
    return [
        "--model",
        str(tiny_model_dir),
        "--load-format",
        "dummy",
        "--skip-tokenizer-init",
        "--dtype",
        "float32",
        "--device",
        "cpu",
        "--kv-cache-memory-bytes",
        str(16 << 20),
    ]
