"""Suite-wide settings: offline hub, a shared model cache, bounded threads, no stray children."""

from __future__ import annotations

import os
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
os.environ["HF_HUB_OFFLINE"] = "1"
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
if "PYTEST_XDIST_WORKER_COUNT" in os.environ:
    # A worker of `make test`'s parallel run (pytest-xdist, one per CPU) takes its share
    # of the CPUs, for its torch and the processes it starts (engine cores, grammar
    # processes); the controller's own setting, which it inherits, counts for nothing:
    # two workers of two threads each on two CPUs ran the suite at half the speed.
    _workers = int(os.environ["PYTEST_XDIST_WORKER_COUNT"])
    os.environ["OMP_NUM_THREADS"] = str(max(1, min(4, (os.cpu_count() or 1) // _workers)))
os.environ.setdefault("OMP_NUM_THREADS", str(min(4, os.cpu_count() or 1)))
# Converted models are shared by all runs of the suite on this checkout.
os.environ.setdefault("ASYNCLLM_CACHE", str(ROOT / ".cache" / "asyncllm-test"))
# Dozens of engines start in one test process: a full collection at each start would
# cost seconds in all (test_frontend.py checks the freeze itself).
os.environ.setdefault("ASYNCLLM_GC_FREEZE", "0")
# The grammar process splits a step of 32 constrained rows or more over 2 threads, as it
# does on a machine of 4 CPUs or more (a 2-CPU machine's default is 1).
os.environ.setdefault("ASYNCLLM_GRAMMAR_THREADS", "2")

import pytest  # noqa: E402
import pytest_asyncio  # noqa: E402
import torch  # noqa: E402

if not torch.cuda.is_available():
    # Triton kernels run under the interpreter; `triton.jit` reads this when a kernel
    # module is imported, so it must be set before any test imports one.
    os.environ["TRITON_INTERPRET"] = "1"

torch.set_num_threads(int(os.environ["OMP_NUM_THREADS"]))


@pytest.fixture(scope="module", autouse=True)
def _torch_threads_restored():
    """An in-process engine given `cpu_threads` sets this process's torch threads; the
    next module gets the suite's count back (one thread would slow every later test)."""
    yield
    if torch.get_num_threads() != int(os.environ["OMP_NUM_THREADS"]):
        torch.set_num_threads(int(os.environ["OMP_NUM_THREADS"]))


def children(pid: int) -> list[int]:
    out = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            stat = (entry / "stat").read_text()
        except OSError:
            continue
        # The ppid is the second field after the parenthesised command name.
        if int(stat.rsplit(")", 1)[1].split()[1]) == pid:
            out.append(int(entry.name))
    return out


@pytest.fixture(scope="session", autouse=True)
def no_child_outlives_the_suite():
    yield
    if not Path("/proc").is_dir():
        return
    import time

    deadline = time.monotonic() + 10
    while (left := children(os.getpid())) and time.monotonic() < deadline:
        time.sleep(0.2)
    assert not left, f"child processes outlived the suite: {left}"


def pytest_xdist_make_scheduler(config, log):
    """Parallel workers (`make test`) take whole modules, so module fixtures are built
    once; the distributed tests, whose processes and shared-memory queues other tests'
    checks would see, run one after another in one worker."""
    from xdist.scheduler import LoadScopeScheduling

    class ModuleScheduling(LoadScopeScheduling):
        def _split_scope(self, nodeid: str) -> str:
            path = nodeid.split("::", 1)[0]
            return "tests/distributed" if path.startswith("tests/distributed/") else path

    return ModuleScheduling(config, log)


def pytest_collection_modifyitems(config, items):
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs CUDA")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


# --- SmolLM2: our model (paged, torch-native) and the reference ---------------------
# The reference is transformers reading the GGUF file itself, never our converted copy.
LONG_TEXT = (
    "The history of computing is a story of abstraction. Early machines were programmed by "
    "rewiring panels; then came stored programs, assemblers, compilers and operating systems. "
    "Each layer hid the one beneath it and let people think about larger problems. Networks "
    "joined the machines together, and the web turned them into a library for everyone. "
    "Today language models read and write text, translate between languages, answer questions "
    "and write code. Serving them efficiently means batching many requests, caching the "
    "attention keys and values of every token in fixed-size blocks, reusing shared prefixes, "
    "and keeping the accelerator busy while the host prepares the next step. "
)


@pytest.fixture(scope="session")
def smollm_config():
    from asyncllm.config import EngineArgs
    from asyncllm.engine.core_config import create_model_config

    return create_model_config(EngineArgs(device="cpu"))


@pytest.fixture(scope="session")
def smollm_model(smollm_config):
    from asyncllm.model.attention.torch_native import TorchNativeBackend
    from asyncllm.model.loader import load_model

    return load_model(smollm_config, TorchNativeBackend())


@pytest.fixture(scope="session")
def smollm_tokenizer(smollm_config):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(smollm_config.path))


@pytest.fixture(scope="session")
def hf_smollm():
    from transformers import AutoModelForCausalLM

    from asyncllm.model.source import embedded_gguf_path

    path = embedded_gguf_path()
    model = AutoModelForCausalLM.from_pretrained(
        str(path.parent), gguf_file=path.name, dtype=torch.float32
    )
    return model.eval()


@pytest.fixture(scope="session")
def smollm_prompts(smollm_tokenizer) -> list[list[int]]:
    """Nine prompts of 1 to 300 tokens: plain text, a chat turn, long context."""
    tok = smollm_tokenizer
    long_ids = tok(LONG_TEXT * 4).input_ids
    chat = tok.apply_chat_template(
        [{"role": "user", "content": "Give me three tips for writing clear Python code."}],
        add_generation_prompt=True,
        tokenize=True,
    )
    if not isinstance(chat, list):
        chat = chat["input_ids"]
    prompts = [
        tok("Hello").input_ids[:1],
        tok("The capital of France is").input_ids,
        tok('def fibonacci(n):\n    """Return the n-th Fibonacci number."""\n').input_ids,
        list(chat),
        tok("Once upon a time, in a small village by the sea, there lived").input_ids,
        long_ids[:77],
        long_ids[:150],
        long_ids[:231],
        long_ids[:300],
    ]
    assert len(prompts[0]) == 1 and len(prompts[-1]) == 300
    return prompts


EXTRA_TEXTS = [
    "Translate to French: The weather is nice today.",
    "日本の首都はどこですか？東京について教えてください。",
    "List the planets of the solar system in order:",
    "import numpy as np\n\ndef normalize(v):\n",
    "Q: What is the boiling point of water at sea level?\nA:",
    "🎉 Party time! Here are some ideas for a birthday celebration:",
    "In 1969, the first humans landed on the Moon. The mission was called",
]


@pytest.fixture(scope="session")
def smollm_prompts16(smollm_prompts, smollm_tokenizer) -> list[list[int]]:
    """Sixteen prompts of 1 to 300 tokens: the nine above and seven more (Japanese, emoji, code)."""
    prompts = list(smollm_prompts) + [smollm_tokenizer(t).input_ids for t in EXTRA_TEXTS]
    assert len(prompts) == 16 and min(map(len, prompts)) == 1 and max(map(len, prompts)) == 300
    return prompts


@pytest.fixture(scope="session")
def hf_greedy_cache(hf_smollm):
    """transformers' greedy continuations (EOS off), each computed once for the session."""
    from tests.model.helpers import HFGreedyCache

    return HFGreedyCache(hf_smollm)


@pytest.fixture(scope="session")
def llm():
    """The engine with default settings on the CPU, shared by the engine tests."""
    from asyncllm import LLM

    engine = LLM(device="cpu")
    yield engine
    engine.shutdown()


SERVING_ARGS = dict(device="cpu", max_model_len=1024, kv_cache_memory_bytes=512 << 20)


@pytest_asyncio.fixture(scope="session", loop_scope="session")
async def allm():
    """One AsyncLLM (an engine-core process with SmolLM2) on the session's event loop,
    shared by the tests marked `pytest.mark.asyncio(loop_scope="session")`."""
    from asyncllm import AsyncLLM

    async with AsyncLLM(**SERVING_ARGS) as engine:
        yield engine
