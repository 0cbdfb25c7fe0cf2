"""Converts a Llama-architecture GGUF file into a Hugging Face model folder, once.

The folder (config.json, model.safetensors, tokenizer files with the chat template,
generation_config.json) is written under a temporary name and renamed into place, so
concurrent converters never see a half-written model: the first rename wins and the
others discard their copy. Tensors are dequantized with the `gguf` package to float32;
the q/k projection rows, which GGUF stores interleaved for its rotary layout, are
put back into the Hugging Face (half-split) order.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

import numpy as np

from asyncllm import envs
from asyncllm.model.progress import progress

logger = logging.getLogger(__name__)

CONVERTER_VERSION = 1

_LAYER_NAMES = {
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
    "attn_norm": "input_layernorm",
    "ffn_norm": "post_attention_layernorm",
}
_GLOBAL_NAMES = {
    "token_embd.weight": "model.embed_tokens.weight",
    "output_norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
}


def hf_tensor_name(gguf_name: str) -> str:
    if gguf_name in _GLOBAL_NAMES:
        return _GLOBAL_NAMES[gguf_name]
    parts = gguf_name.split(".")
    if len(parts) == 4 and parts[0] == "blk" and parts[2] in _LAYER_NAMES:
        return f"model.layers.{parts[1]}.{_LAYER_NAMES[parts[2]]}.{parts[3]}"
    raise ValueError(f"GGUF tensor {gguf_name!r} has no Llama counterpart")


def unpermute_rotary_rows(w: np.ndarray, n_head: int) -> np.ndarray:
    """GGUF interleaves each head's rotary pairs; Hugging Face splits them in halves."""
    half = w.shape[0] // n_head // 2
    return w.reshape(n_head, half, 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def _field(reader: Any, key: str, default: Any = None) -> Any:
    f = reader.fields.get(key)
    if f is None:
        return default
    return f.contents()


def gguf_config(reader: Any) -> dict[str, Any]:
    arch = _field(reader, "general.architecture")
    if arch != "llama":
        raise ValueError(f"GGUF architecture {arch!r} is not supported (only 'llama')")
    p = "llama."
    n_head = int(_field(reader, p + "attention.head_count"))
    hidden = int(_field(reader, p + "embedding_length"))
    names = {t.name for t in reader.tensors}
    vocab = _field(reader, p + "vocab_size") or len(reader.fields["tokenizer.ggml.tokens"].data)
    cfg = {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "hidden_size": hidden,
        "intermediate_size": int(_field(reader, p + "feed_forward_length")),
        "num_hidden_layers": int(_field(reader, p + "block_count")),
        "num_attention_heads": n_head,
        "num_key_value_heads": int(_field(reader, p + "attention.head_count_kv", n_head)),
        "head_dim": int(_field(reader, p + "rope.dimension_count", hidden // n_head)),
        "max_position_embeddings": int(_field(reader, p + "context_length")),
        "rms_norm_eps": float(_field(reader, p + "attention.layer_norm_rms_epsilon")),
        "vocab_size": int(vocab),
        "rope_theta": float(_field(reader, p + "rope.freq_base", 10000.0)),
        "tie_word_embeddings": "output.weight" not in names,
        "hidden_act": "silu",
        "attention_bias": False,
        "mlp_bias": False,
    }
    for key, name in (
        ("bos_token_id", "bos"),
        ("eos_token_id", "eos"),
        ("pad_token_id", "padding"),
    ):
        value = _field(reader, f"tokenizer.ggml.{name}_token_id")
        if value is not None:
            cfg[key] = int(value)
    return cfg


def iter_gguf_tensors(reader: Any, cfg: dict[str, Any]):
    """(hf_name, float32 array) for every tensor, dequantized and un-permuted."""
    from gguf import dequantize

    for t in reader.tensors:
        name = hf_tensor_name(t.name)
        w = np.array(dequantize(t.data, t.tensor_type), dtype=np.float32)  # a writable copy
        if ".attn_q." in t.name:
            w = unpermute_rotary_rows(w, cfg["num_attention_heads"])
        elif ".attn_k." in t.name:
            w = unpermute_rotary_rows(w, cfg["num_key_value_heads"])
        yield name, w


def fingerprint(path: Path) -> str:
    """Identity of a GGUF file without reading it all: size, first and last MiB, converter version."""
    h = hashlib.sha256()
    size = path.stat().st_size
    h.update(f"{size}:{CONVERTER_VERSION}".encode())
    with path.open("rb") as f:
        h.update(f.read(1 << 20))
        if size > 1 << 20:
            f.seek(-(1 << 20), os.SEEK_END)
            h.update(f.read(1 << 20))
    return h.hexdigest()[:16]


_ERROR_FILE = ".conversion-error.json"  # the child's exception, for the host to raise


def _write_folder(gguf_path: Path, out: Path) -> None:
    """Writes the folder in a child process (`python -m asyncllm.model.gguf_convert`):
    reading and dequantizing hold the GIL for up to ~0.7 s at a time, which would stall
    the event loop of a host that starts an engine. Its exception, if any, is raised here
    (ValueError/TypeError/FileNotFoundError as such, others as RuntimeError)."""
    cmd = [sys.executable, "-m", "asyncllm.model.gguf_convert", str(gguf_path), str(out)]
    proc = subprocess.run(cmd, env=envs.child_process_env(), check=False)
    if proc.returncode == 0:
        return
    error = out / _ERROR_FILE
    if not error.is_file():
        raise RuntimeError(f"converting {gguf_path} failed (exit code {proc.returncode})")
    kind, message = json.loads(error.read_text())
    types = {
        "ValueError": ValueError,
        "TypeError": TypeError,
        "FileNotFoundError": FileNotFoundError,
    }
    raise types.get(kind, RuntimeError)(f"converting {gguf_path}: {message}")


def _write_folder_here(gguf_path: Path, out: Path) -> None:
    import torch
    from gguf import GGUFReader
    from safetensors.torch import save_file
    from transformers import AutoTokenizer, GenerationConfig, LlamaConfig

    reader = GGUFReader(str(gguf_path))
    cfg = gguf_config(reader)
    items = progress(iter_gguf_tensors(reader, cfg), "converting", total=len(reader.tensors))
    tensors = {name: torch.from_numpy(w) for name, w in items}
    save_file(tensors, str(out / "model.safetensors"), metadata={"format": "pt"})
    del tensors
    config = LlamaConfig(**{k: v for k, v in cfg.items() if k != "model_type"})
    config.save_pretrained(out)
    gen = {k: cfg[k] for k in ("bos_token_id", "eos_token_id", "pad_token_id") if k in cfg}
    GenerationConfig(**gen).save_pretrained(out)
    tokenizer = AutoTokenizer.from_pretrained(str(gguf_path.parent), gguf_file=gguf_path.name)
    template = _field(reader, "tokenizer.chat_template")
    if template and not getattr(tokenizer, "chat_template", None):
        tokenizer.chat_template = template
    tokenizer.save_pretrained(out)
    (out / "asyncllm-source.json").write_text(
        json.dumps({"gguf": str(gguf_path), "converter_version": CONVERTER_VERSION}) + "\n"
    )


def convert_gguf(gguf_path: str | os.PathLike, cache_dir: str | os.PathLike) -> Path:
    """Returns the converted folder for `gguf_path`, converting it first if needed."""
    gguf_path = Path(gguf_path)
    if not gguf_path.is_file():
        raise FileNotFoundError(f"GGUF file {str(gguf_path)!r} does not exist")
    models = Path(cache_dir) / "models"
    final = models / f"{gguf_path.stem}-{fingerprint(gguf_path)}"
    if final.is_dir():
        return final
    models.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{final.name}.", dir=models))
    try:
        logger.info("converting %s into %s (once)", gguf_path, final)
        _write_folder(gguf_path, tmp)
        try:
            os.rename(tmp, final)
        except OSError:
            if not final.is_dir():  # not a lost race: a real failure
                raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return final


def main() -> None:
    """The child of `_write_folder`: converts argv[1] into the folder argv[2]."""
    gguf_path, out = Path(sys.argv[1]), Path(sys.argv[2])
    try:
        _write_folder_here(gguf_path, out)
    except Exception as e:
        (out / _ERROR_FILE).write_text(json.dumps([type(e).__name__, str(e)]))
        raise SystemExit(1) from None


if __name__ == "__main__":
    main()
