"""The tokenizer in its own process, for AsyncLLM: the host's event loop never waits on
building it.

Building a transformers tokenizer holds the GIL for 100-200 ms at a time (the tokenizers
library parses its JSON and builds the vocabulary and merges in one call), which stalls
every other task of the host's loop however it is threaded. So AsyncLLM starts this
process next to the engine core: it loads the tokenizer, sends back what the host needs
to turn tokens into text (each token's bytes, for a byte-level BPE tokenizer) and then
encodes text and renders chat templates on request. The host's side,
`ProcessTokenizer`, offers the few tokenizer calls the host makes (`__call__`,
`apply_chat_template`, `convert_ids_to_tokens`, `decode`, `eos_token_id`,
`chat_template`); its blocking calls run
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
from asyncllm.child_process import ignore_terminal_signals, start_child
from asyncllm.hf_tokenizer import load_hf_tokenizer

_HEADER = 4


def _send(stream: IO[bytes], body: bytes) -> None:
    """One frame of an encoded message."""
    stream.write(len(body).to_bytes(_HEADER, "big") + body)
    stream.flush()


def _write(stream: IO[bytes], obj: Any) -> None:
    _send(stream, msgspec.msgpack.encode(obj))  # (encoding raises before a byte is sent)


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


def _plain(value: Any) -> Any:
    """Token ids as lists of ints (a template asked for arrays gives arrays)."""
    return value.tolist() if hasattr(value, "tolist") else value


def _chat_result(result: Any) -> Any:
    if isinstance(result, str):
        return result
    if isinstance(result, list):
        return [_plain(x) for x in result]
    return {"input_ids": _plain(result["input_ids"])}


def _error_kind(e: BaseException) -> str:
    """The class the host raises for `e`: what the frontend tells apart."""
    from jinja2 import TemplateError

    if isinstance(e, TemplateError):
        return "TemplateError"
    for kind in (ValueError, TypeError):
        if isinstance(e, kind):
            return kind.__name__
    return type(e).__name__


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
            elif method == "tokens":
                (ids,) = args
                result = [str(t) for t in tokenizer.convert_ids_to_tokens(ids)]
            else:
                raise ValueError(f"unknown tokenizer call {method!r}")
            answer = msgspec.msgpack.encode(["ok", result])
        except Exception as e:  # noqa: BLE001 (sent back; the host raises it)
            answer = msgspec.msgpack.encode(["error", _error_kind(e), str(e)])
        _send(out, answer)


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
    ignore_terminal_signals()  # (a terminal's Ctrl-C and hang-up are the host's)
    out = os.fdopen(os.dup(1), "wb")
    os.dup2(2, 1)  # prints from libraries go to stderr, not into the frame stream
    inp = sys.stdin.buffer
    # Tokenizing needs no torch, and importing it would double this process's start
    # (2.5 s -> 5.7 s on a 2-core machine) while it competes with the core's.
    sys.modules["torch"] = None  # type: ignore[assignment]
    os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")  # (no "PyTorch not found")
    try:
        (path,) = _read(inp)
        tokenizer = load_hf_tokenizer(path)
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
        self.proc = start_child(
            [sys.executable, "-m", "asyncllm.engine.tokenizer_process"],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            env=envs.child_process_env(),
            close_fds=True,
        )
        self._lock = threading.Lock()
        self._local_lock = threading.Lock()
        self._local: Any = None  # the transformers tokenizer, where built in this process
        self._decoder: Any = None
        self.eos_token_id: int | None = None
        self.chat_template: Any = None
        self.max_token_bytes = 1
        self._ready = False
        assert self.proc.stdin is not None
        try:
            _write(self.proc.stdin, [path])
        except BaseException:
            self.close()
            raise

    def wait_ready(self) -> ProcessTokenizer:
        """Waits for the process to load the tokenizer (seconds; off the event loop).
        Raises TokenizerProcessError (or the loader's ValueError/TypeError) if it
        cannot."""
        hello = self._call(None)
        self._ready = True
        self.eos_token_id = hello["eos_token_id"]
        self.chat_template = hello["chat_template"]
        self.max_token_bytes = int(hello["max_token_bytes"])
        if hello["table"] is not None:
            from asyncllm.frontend.token_bytes import ByteTableDecoder

            self._decoder = ByteTableDecoder(hello["table"], hello["special"])
        else:  # not byte-level BPE: the host decodes with a tokenizer of its own
            local = load_hf_tokenizer(self.path)
            self._local = local
            backend = getattr(local, "backend_tokenizer", None)  # (10x cheaper a call)
            clean = getattr(local, "clean_up_tokenization_spaces", False)
            self._decoder = backend if backend is not None and not clean else local
        return self

    def _call(self, request: list[Any] | None) -> Any:
        try:
            body = None if request is None else msgspec.msgpack.encode(request)
        except (TypeError, ValueError) as e:  # (an object or a string it cannot carry)
            raise TypeError(f"the tokenizer cannot take this input: {e}") from None
        with self._lock:
            stdin, stdout = self.proc.stdin, self.proc.stdout
            assert stdin is not None and stdout is not None
            try:
                if body is not None:
                    _send(stdin, body)
                answer = _read(stdout)
            except (EOFError, OSError, msgspec.DecodeError):
                code = self.proc.poll()
                raise TokenizerProcessError(
                    f"the tokenizer process exited (code {code})"
                    if code is not None
                    else "the tokenizer process stopped answering"
                ) from None
        if answer[0] == "error":
            _raise(answer[1], answer[2])
        return answer[1]

    # -- the tokenizer calls the host makes ----------------------------------------------

    def __call__(
        self, texts: str | list[str], add_special_tokens: bool = True, **kwargs: Any
    ) -> Any:
        """`.input_ids` of the text(s); with any other argument (`return_tensors`, ...),
        the local tokenizer's own call."""
        if kwargs:
            return self.local_tokenizer()(texts, add_special_tokens=add_special_tokens, **kwargs)
        one = isinstance(texts, str)
        ids = self._call(["encode", [[texts] if one else list(texts), add_special_tokens]])
        return SimpleNamespace(input_ids=ids[0] if one else ids)

    def apply_chat_template(self, conversation: list[Any], **kwargs: Any) -> Any:
        return self._call(["chat", [conversation, kwargs]])

    def convert_ids_to_tokens(self, ids: list[int]) -> list[str]:
        """Each id's entry in the vocabulary (the server's /tokenize `token_strs`)."""
        tokens: list[str] = self._call(["tokens", [list(ids)]])
        return tokens

    def decode(self, ids: list[int], skip_special_tokens: bool = False, **kwargs: Any) -> str:
        """The text of `ids`; with any other argument, the local tokenizer's decode."""
        if kwargs:
            local = self.local_tokenizer()
            return str(local.decode(ids, skip_special_tokens=skip_special_tokens, **kwargs))
        return str(self._decoder.decode(ids, skip_special_tokens=skip_special_tokens))

    def __len__(self) -> int:
        return len(self.local_tokenizer())

    def local_tokenizer(self) -> Any:
        """The transformers tokenizer itself, built in this process on first use: it
        blocks the calling thread (and, holding the GIL, an event loop) ~0.2-0.4 s."""
        with self._local_lock:
            if self._local is None:
                self._local = load_hf_tokenizer(self.path)
        return self._local

    def __getattr__(self, name: str) -> Any:
        """Any other tokenizer attribute (`convert_ids_to_tokens`, `vocab_size`, ...):
        from `local_tokenizer()`."""
        if name.startswith("_") or name in ("proc", "path"):
            raise AttributeError(name)
        return getattr(self.local_tokenizer(), name)

    def close(self) -> None:
        """Ends the process (it exits on EOF; killed if it does not)."""
        if not self._ready:  # (it may be blocked writing its answer: no EOF would reach it)
            self.proc.kill()
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
