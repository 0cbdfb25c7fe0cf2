"""`load_hf_tokenizer`: the tokenizer AutoTokenizer builds, without AutoTokenizer's
reading of the model's config (which imports torch and takes seconds) where the folder
names transformers' generic fast tokenizer."""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap

from asyncllm.hf_tokenizer import load_hf_tokenizer, tokenizer_class_named

TEXTS = ["Hello, world!", "日本語のテキスト 🎉", "def f(x):\n    return x * 2\n", ""]


def test_the_direct_path_builds_what_auto_tokenizer_builds(smollm_config, smollm_tokenizer):
    path = str(smollm_config.path)
    assert tokenizer_class_named(path) == "TokenizersBackend"
    ours, auto = load_hf_tokenizer(path), smollm_tokenizer  # (AutoTokenizer's)
    assert type(ours) is type(auto)
    assert [ours(t).input_ids for t in TEXTS] == [auto(t).input_ids for t in TEXTS]
    assert ours.all_special_ids == auto.all_special_ids and ours.eos_token == auto.eos_token
    chat = [{"role": "user", "content": "Hi"}]
    assert ours.apply_chat_template(chat, tokenize=False) == auto.apply_chat_template(
        chat, tokenize=False
    )


def test_the_direct_path_imports_no_torch(smollm_config):
    code = textwrap.dedent(
        f"""
        import sys
        from asyncllm.hf_tokenizer import load_hf_tokenizer
        tok = load_hf_tokenizer({str(smollm_config.path)!r})
        assert tok("hi").input_ids
        print("torch" in sys.modules)
        """
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False", out.stderr


def test_other_classes_and_unreadable_configs_go_through_auto_tokenizer(tmp_path):
    assert tokenizer_class_named(str(tmp_path)) is None  # no tokenizer_config.json
    (tmp_path / "tokenizer_config.json").write_text("{not json")
    assert tokenizer_class_named(str(tmp_path)) is None
    (tmp_path / "tokenizer_config.json").write_text(json.dumps({"tokenizer_class": "T5Tokenizer"}))
    assert tokenizer_class_named(str(tmp_path)) == "T5Tokenizer"
    assert tokenizer_class_named("HuggingFaceTB/SmolLM2-135M-Instruct") is None  # a hub id
