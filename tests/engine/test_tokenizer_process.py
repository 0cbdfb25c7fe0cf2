"""The tokenizer process and the host's byte-table detokenization: the same ids and text
as the transformers tokenizer itself, and no tokenizer built in AsyncLLM's host."""

from __future__ import annotations

import random

import pytest

from asyncllm import AsyncLLM, SamplingParams
from asyncllm.engine.tokenizer_process import ProcessTokenizer, TokenizerProcessError
from asyncllm.frontend.token_bytes import ByteTableDecoder, byte_table

TEXTS = ["Hello there", "héllo wörld 🙂 日本語のテキスト", "", "  spaced\n\ttabs", "<|im_start|>x"]


@pytest.fixture(scope="module")
def table_decoder(smollm_tokenizer) -> ByteTableDecoder:
    table = byte_table(smollm_tokenizer)
    assert table is not None  # SmolLM2 is byte-level BPE
    return ByteTableDecoder(*table)


@pytest.fixture(scope="module")
def process_tokenizer(smollm_config):
    tok = ProcessTokenizer(str(smollm_config.path)).wait_ready()
    yield tok
    tok.close()


def test_byte_table_decodes_as_the_tokenizer(smollm_tokenizer, table_decoder):
    """Random id runs over the whole vocabulary (special tokens and ids that split a
    UTF-8 character included), with and without special tokens skipped."""
    backend = smollm_tokenizer.backend_tokenizer
    n = backend.get_vocab_size(with_added_tokens=True)
    rng = random.Random(0)
    specials = sorted(table_decoder.special)
    assert specials  # (SmolLM2 has <|im_start|> and others)
    for _ in range(400):
        ids = [rng.randrange(n) for _ in range(rng.randint(1, 12))]
        if rng.random() < 0.3:
            ids.insert(rng.randrange(len(ids) + 1), rng.choice(specials))
        for skip in (False, True):
            assert table_decoder.decode(ids, skip) == backend.decode(ids, skip_special_tokens=skip)
    for text in TEXTS:
        ids = smollm_tokenizer(text).input_ids
        for k in range(len(ids) + 1):  # every prefix: partial characters included
            part = ids[:k]
            assert table_decoder.decode(part, True) == backend.decode(
                part, skip_special_tokens=True
            )
    hello = smollm_tokenizer("hello").input_ids
    assert table_decoder.decode([n + 5, -1, *hello]) == "hello"  # unknown ids are skipped
    assert backend.decode([n + 5, *hello], skip_special_tokens=False) == "hello"


def test_byte_table_refuses_other_tokenizers():
    """A tokenizer whose decoding is not byte-level BPE has no table (the host then
    decodes with a tokenizer of its own)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {"[UNK]": 0, "hello": 1, "##lo": 2, "hel": 3}
    inner = Tokenizer(models.WordPiece(vocab, unk_token="[UNK]"))
    inner.pre_tokenizer = pre_tokenizers.Whitespace()
    inner.decoder = decoders.WordPiece()
    wrapped = PreTrainedTokenizerFast(tokenizer_object=inner, unk_token="[UNK]")
    assert byte_table(wrapped) is None


def test_process_tokenizer_matches_the_tokenizer(smollm_tokenizer, process_tokenizer):
    tok = process_tokenizer
    assert tok.eos_token_id == smollm_tokenizer.eos_token_id
    assert tok.chat_template == smollm_tokenizer.chat_template
    assert tok(TEXTS).input_ids == [smollm_tokenizer(t).input_ids for t in TEXTS]
    assert tok("x y", add_special_tokens=False).input_ids == smollm_tokenizer("x y").input_ids
    conv = [{"role": "user", "content": "What is 2 + 2?"}]
    want = smollm_tokenizer.apply_chat_template(conv, add_generation_prompt=True, tokenize=False)
    assert tok.apply_chat_template(conv, add_generation_prompt=True, tokenize=False) == want
    ids = tok.apply_chat_template(conv, add_generation_prompt=True, tokenize=True)
    assert ids["input_ids"] if isinstance(ids, dict) else ids
    ids = smollm_tokenizer("Ça va? 🙂").input_ids
    assert tok.decode(ids) == smollm_tokenizer.decode(ids)
    vocab = smollm_tokenizer.get_vocab()
    assert tok.max_token_bytes == max(len(t.encode()) for t in vocab)


def test_process_tokenizer_errors_name_their_cause(process_tokenizer):
    from jinja2 import TemplateError

    conv = [{"role": "user", "content": "hi"}]
    with pytest.raises(TemplateError, match="no way"):
        process_tokenizer.apply_chat_template(
            conv, chat_template="{{ raise_exception('no way') }}", tokenize=False
        )
    with pytest.raises(TemplateError):  # (a subclass: jinja's UndefinedError)
        process_tokenizer.apply_chat_template(
            conv, chat_template="{{ nothing.here }}", tokenize=False
        )
    with pytest.raises(TypeError):
        process_tokenizer.apply_chat_template([{"role": "user", "content": object()}])
    with pytest.raises(TypeError):  # (a lone surrogate cannot be sent)
        process_tokenizer(["bad \ud800 text"])
    # arrays asked for come back as lists
    ids = process_tokenizer.apply_chat_template(conv, tokenize=True, return_tensors="np")
    assert isinstance(ids, list | dict)
    # the process keeps serving after both
    assert process_tokenizer(["ok"]).input_ids == [process_tokenizer("ok").input_ids]


def test_process_tokenizer_reports_a_bad_path_and_a_dead_process(tmp_path):
    bad = ProcessTokenizer(str(tmp_path / "no-such-model"))
    with pytest.raises((TokenizerProcessError, ValueError, TypeError)):
        bad.wait_ready()
    bad.close()


def test_a_killed_tokenizer_process_fails_calls_clearly(smollm_config):
    tok = ProcessTokenizer(str(smollm_config.path)).wait_ready()
    tok.proc.kill()
    tok.proc.wait()
    with pytest.raises(TokenizerProcessError, match="exited"):
        tok(["hello"])
    tok.close()


async def test_async_llm_builds_no_tokenizer_in_the_host(monkeypatch):
    """Start-up and text requests work with the host unable to build a tokenizer: the
    tokenizer lives in its own process, and the host decodes from the byte table."""
    import transformers

    def refuse(*args, **kwargs):
        raise AssertionError("the host built a tokenizer")

    monkeypatch.setattr(transformers.AutoTokenizer, "from_pretrained", refuse)
    instant = dict(
        device="cpu",
        max_model_len=1024,
        distributed_executor_backend="asyncllm.executor.instant:InstantExecutor",
    )
    async with AsyncLLM(**instant) as llm:
        tok = llm.tokenizer
        assert isinstance(tok, ProcessTokenizer) and tok.proc.poll() is None
        params = SamplingParams(max_tokens=4, ignore_eos=True)
        outs = [o async for o in llm.generate("Hello there", params)]
        assert outs[-1].prompt_token_ids == tok("Hello there").input_ids
        assert outs[-1].outputs[0].text == tok.decode(outs[-1].outputs[0].token_ids, True)
        chat = [o async for o in llm.chat([{"role": "user", "content": "hi"}], params)]
        assert chat[-1].finished
    assert tok.proc.poll() is not None  # shut down with the engine


def test_other_tokenizer_attributes_come_from_a_local_tokenizer(
    smollm_tokenizer, process_tokenizer
):
    ids = smollm_tokenizer("Hello there").input_ids
    assert process_tokenizer.convert_ids_to_tokens(ids) == smollm_tokenizer.convert_ids_to_tokens(
        ids
    )
    with pytest.raises(AttributeError):
        process_tokenizer._no_such_thing  # noqa: B018
    assert len(process_tokenizer) == len(smollm_tokenizer)
    got = process_tokenizer("Hello there", return_attention_mask=True)
    assert got.attention_mask == [1] * len(ids)
    assert process_tokenizer.decode(ids, clean_up_tokenization_spaces=True) == (
        smollm_tokenizer.decode(ids, clean_up_tokenization_spaces=True)
    )
