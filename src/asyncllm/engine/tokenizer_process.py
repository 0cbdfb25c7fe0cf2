"""The tokenizer in its own process, for AsyncLLM: the host's event loop never waits on
building it.

Building a transformers tokenizer holds the GIL for 100-200 ms at a time (the tokenizers
library parses its JSON and builds the vocabulary and merges in one call), which stalls
every other task of the host's loop however it is threaded. So AsyncLLM starts this
process next to the engine core: it loads the tokenizer, sends back what the host needs
to turn tokens into text (each token's bytes, for a byte-level BPE tokenizer) and then
encodes text and renders chat templates on request. The host's side,
`ProcessTokenizer`, offers the few tokenizer calls the frontend makes (`__call__`,
`apply_chat_template`, `decode`, `eos_token_id`, `chat_template`); its blocking calls run
in AsyncLLM's setup thread, which waits on the pipe without the GIL.

A tokenizer that is not byte-level BPE cannot be decoded from a table: then the host
also builds the tokenizer itself to decode with (while the engine starts; that stall
remains for such tokenizers).

Frames on the pipes: a 4-byte big-endian length, then msgpack. The child's stdin
carries requests `[method, args]`; its real stdout (stdout itself is pointed at stderr,
so stray prints cannot corrupt the stream) carries `["ok", result]` or
`["error", exception type, message]`. EOF on stdin (the host is gone) ends it.
"""

from __future__ import annotations

import os
import subprocess
import sys
import threading
from types import SimpleNamespace
from typing import IO, Any

import msgspec

from asyncllm import envs

_HEADER = 4


def _write(stream: IO[bytes], obj: Any) -> None:
    body = msgspec.msgpack.encode(obj)
    stream.write(len(body).to_bytes(_HEADER, "big") + body)
    stream.flush()


def _read(stream: IO[bytes]) -> Any:
    header = stream.read(_HEADER)
    if len(header) < _HEADER:
        raise EOFError
    size = int.from_bytes(header, "big")
    body = stream.read(size)
    if len(body) < size:
        raise EOFError
    return msgspec.msgpack.decode(body)


# -- the child -----------------------------------------------------------------------


def _chat_result(result: Any) -> Any:
    if isinstance(result, str | list):
        return result
    return {"input_ids": list(result["input_ids"])}


def _serve(tokenizer: Any, inp: IO[bytes], out: IO[bytes]) -> None:
    while True:
        try:
            method, args = _read(inp)
        except EOFError:
            return
        try:
            if method == "encode":
                texts, add_special_tokens = args
                result: Any = [
                    list(ids)
                    for ids in tokenizer(texts, add_special_tokens=add_special_tokens).input_ids
                ]
            elif method == "chat":
                conversation, kwargs = args
                result = _chat_result(tokenizer.apply_chat_template(conversation, **kwargs))
            else:
                raise ValueError(f"unknown tokenizer call {method!r}")
        except Exception as e:  # noqa: BLE001 (sent back; the host raises it)
            _write(out, ["error", type(e).__name__, str(e)])
            continue
        _write(out, ["ok", result])


def _hello(tokenizer: Any) -> dict[str, Any]:
    from asyncllm.frontend.input_processor import vocab_max_token_bytes
    from asyncllm.frontend.token_bytes import byte_table

    table = byte_table(tokenizer)
    template = getattr(tokenizer, "chat_template", None)
    return {
        "eos_token_id": tokenizer.eos_token_id,
        "chat_template": template if isinstance(template, str | dict) else None,
        "max_token_bytes": vocab_max_token_bytes(tokenizer.get_vocab()),
        "table": None if table is None else table[0],
        "special": [] if table is None else table[1],
    }


def main() -> None:
    out = os.fdopen(os.dup(1), "wb")
    os.dup2(2, 1)  # prints from libraries go to stderr, not into the frame stream
    inp = sys.stdin.buffer
    # Tokenizing needs no torch, and importing it would double this process's start
    # (2.5 s -> 5.7 s on a 2-core machine) while it competes with the core's.
    sys.modules["torch"] = None  # type: ignore[assignment]
    os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")  # (no "PyTorch not found")
    try:
        (path,) = _read(inp)
        from transformers import AutoTokenizer

        tokenizer = AutoTokenizer.from_pretrained(path)
        hello = _hello(tokenizer)
    except EOFError:
        return
    except Exception as e:  # noqa: BLE001 (the host's start-up raises it)
        _write(out, ["error", type(e).__name__, str(e)])
        return
    _write(out, ["ok", hello])
    _serve(tokenizer, inp, out)


# -- the host's side -----------------------------------------------------------------


class TokenizerProcessError(RuntimeError):
    """The tokenizer process failed or is gone."""


def _raise(kind: str, message: str) -> None:
    if kind == "TemplateError":
        from jinja2 import TemplateError

        raise TemplateError(message)
    if kind in ("ValueError", "TypeError"):
        raise {"ValueError": ValueError, "TypeError": TypeError}[kind](message)
    raise TokenizerProcessError(f"{kind}: {message}")


class ProcessTokenizer:
    """The host's handle on the tokenizer process. `start()` spawns it at once;
    `wait_ready()` (blocking) takes its answer; then the tokenizer calls below work.
    Calls that cross the pipe are serialized; `decode` is local."""

    backend_tokenizer = None  # (the detokenizer then calls `decode`)
    clean_up_tokenization_spaces = False

    def __init__(self, path: str) -> None:
        self.path = path
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "asyncllm.engine.tokenizer_process"],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            env=envs.child_process_env(),
            close_fds=True,
        )
        self._lock = threading.Lock()
        self._decoder: Any = None
        self.eos_token_id: int | None = None
        self.chat_template: Any = None
        self.max_token_bytes = 1
        assert self.proc.stdin is not None
        _write(self.proc.stdin, [path])

    def wait_ready(self) -> ProcessTokenizer:
        """Waits for the process to load the tokenizer (seconds; off the event loop).
        Raises TokenizerProcessError (or the loader's ValueError/TypeError) if it
        cannot."""
        hello = self._call(None)
        self.eos_token_id = hello["eos_token_id"]
        self.chat_template = hello["chat_template"]
        self.max_token_bytes = int(hello["max_token_bytes"])
        if hello["table"] is not None:
            from asyncllm.frontend.token_bytes import ByteTableDecoder

            self._decoder = ByteTableDecoder(hello["table"], hello["special"])
        else:  # not byte-level BPE: the host decodes with a tokenizer of its own
            from transformers import AutoTokenizer

            self._decoder = AutoTokenizer.from_pretrained(self.path)
        return self

    def _call(self, request: list[Any] | None) -> Any:
        with self._lock:
            stdin, stdout = self.proc.stdin, self.proc.stdout
            assert stdin is not None and stdout is not None
            try:
                if request is not None:
                    _write(stdin, request)
                answer = _read(stdout)
            except (EOFError, BrokenPipeError, ValueError, OSError):
                code = self.proc.poll()
                raise TokenizerProcessError(
                    f"the tokenizer process exited (code {code})"
                    if code is not None
                    else "the tokenizer process stopped answering"
                ) from None
        if answer[0] == "error":
            _raise(answer[1], answer[2])
        return answer[1]

    # -- the tokenizer calls the frontend makes ------------------------------------------

    def __call__(self, texts: str | list[str], add_special_tokens: bool = True) -> Any:
        one = isinstance(texts, str)
        ids = self._call(["encode", [[texts] if one else list(texts), add_special_tokens]])
        return SimpleNamespace(input_ids=ids[0] if one else ids)

    def apply_chat_template(self, conversation: list[Any], **kwargs: Any) -> Any:
        return self._call(["chat", [conversation, kwargs]])

    def decode(self, ids: list[int], skip_special_tokens: bool = False) -> str:
        return str(self._decoder.decode(ids, skip_special_tokens=skip_special_tokens))

    def local_tokenizer(self) -> Any:
        """The transformers tokenizer itself, built in this process on first use: it
        blocks the calling thread (and, holding the GIL, an event loop) ~0.2-0.4 s."""
        local = self.__dict__.get("_local")
        if local is None:
            from asyncllm.frontend.token_bytes import ByteTableDecoder

            if self._decoder is None or isinstance(self._decoder, ByteTableDecoder):
                from transformers import AutoTokenizer

                local = AutoTokenizer.from_pretrained(self.path)
            else:
                local = self._decoder  # (already built to decode with)
            self.__dict__["_local"] = local
        return local

    def __getattr__(self, name: str) -> Any:
        """Any other tokenizer attribute (`convert_ids_to_tokens`, `vocab_size`, ...):
        from `local_tokenizer()`."""
        if name.startswith("_") or name in ("proc", "path"):
            raise AttributeError(name)
        return getattr(self.local_tokenizer(), name)

    def close(self) -> None:
        """Ends the process (it exits on EOF; killed if it does not)."""
        if self.proc.stdin is not None:
            try:
                self.proc.stdin.close()
            except OSError:
                pass
        try:
            self.proc.wait(5)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
        if self.proc.stdout is not None:
            self.proc.stdout.close()


if __name__ == "__main__":
    main()
