"""What the three benchmarks share: the engine flags, the workloads, the report.

Engine flags map one to one onto `EngineArgs` fields; only those the user set (or the
benchmark's own defaults) reach the engine, so the engine's defaults apply otherwise.
"""

from __future__ import annotations

import argparse
import functools
import json
import math
import platform
import random
import time
from collections.abc import Callable, Sequence
from typing import Any

from asyncllm.messages import ResolvedConfig
from asyncllm.sampling_params import SamplingParams

# The offline workload of nano-vllm's bench.py: with random.seed(0), 256 prompts of
# 100-1024 random token ids, then one max_tokens draw of 100-1024 per prompt.
NUM_PROMPTS = 256
MAX_INPUT_LEN = 1024
MAX_OUTPUT_LEN = 1024
MIN_LEN = 100
MAX_TOKEN_ID = 10000
# sum(max_tokens) of that workload: every run of it must produce exactly this many tokens.
DEFAULT_WORKLOAD_OUTPUT_TOKENS = 133_966

# The constrained workload (structured_throughput, step_profile --structured): a JSON
# array of 64 short strings, long enough that max_tokens ends most requests first.
ARRAY_SCHEMA = {
    "type": "array",
    "items": {"type": "string", "maxLength": 16},
    "minItems": 64,
    "maxItems": 64,
}

# (flag, EngineArgs field, type, help); every default is None: "not set".
_ENGINE_FLAGS: list[tuple[str, str, Any, str]] = [
    (
        "--dtype",
        "dtype",
        str,
        "auto (bfloat16 on CUDA, float32 on the CPU), float32, float16, bfloat16",
    ),
    ("--load-format", "load_format", str, "auto, safetensors, pt, gguf, dummy (random weights)"),
    ("--max-model-len", "max_model_len", int, "longest prompt + output"),
    ("--max-num-seqs", "max_num_seqs", int, "most requests in one step"),
    ("--max-num-batched-tokens", "max_num_batched_tokens", int, "token budget of one step"),
    ("--gpu-memory-utilization", "gpu_memory_utilization", float, "share of GPU memory to use"),
    ("--device", "device", str, "auto, cpu, cuda, cuda:N"),
    (
        "--attention-backend",
        "attention_backend",
        str,
        "auto, triton (CUDA), flashinfer (CUDA, the flashinfer extra), flashinfer_prefill "
        "(Triton decodes, FlashInfer prefill chunks), flash_attn (the flash-attn extra), "
        "torch_native, "
        "triton_mla / torch_mla (latent attention), or a registered name",
    ),
    ("--ubatch", "ubatch", str, "micro-batches of eager steps: off, auto or N (2 or more)"),
    ("--tensor-parallel-size", "tensor_parallel_size", int, "ranks a layer is split over"),
    (
        "--distributed-executor-backend",
        "distributed_executor_backend",
        str,
        "uni (in the engine core), mp (a worker process per rank) or module:Class",
    ),
]


def wrap_timed(obj: Any, name: str, record: Callable[[float, float], None]) -> Callable[[], None]:
    """Wraps `obj.name` so each call reports its start and end (perf_counter seconds)
    to `record`, returning or raising as before; returns the undo."""
    fn: Callable[..., Any] = getattr(obj, name)

    @functools.wraps(fn)
    def timed(*args: Any, **kwargs: Any) -> Any:
        t0 = time.perf_counter()
        try:
            return fn(*args, **kwargs)
        finally:
            record(t0, time.perf_counter())

    setattr(obj, name, timed)
    return lambda: setattr(obj, name, fn)


def _int_or_float(text: str) -> int:
    """An int that may be written as 4e9."""
    try:
        return int(text)
    except ValueError:
        value = float(text)
        if not value.is_integer():
            raise argparse.ArgumentTypeError(f"{text!r} is not a whole number") from None
        return int(value)


def add_engine_args(parser: argparse.ArgumentParser, **defaults: Any) -> None:
    """The engine flags; `defaults` (EngineArgs field -> value) are this benchmark's own."""
    g = parser.add_argument_group("engine")
    g.add_argument(
        "--model",
        default=None,
        help="a model folder (a config.json alone is enough with --load-format dummy), a "
        ".gguf file or a hub id; default: the embedded SmolLM2-135M-Instruct",
    )
    for flag, dest, typ, text in _ENGINE_FLAGS:
        default = defaults.get(dest)
        shown = f" (default: {default})" if default is not None else ""
        g.add_argument(flag, dest=dest, type=typ, default=default, help=text + shown)
    g.add_argument(
        "--kv-cache-memory-bytes",
        dest="kv_cache_memory_bytes",
        type=_int_or_float,
        default=defaults.get("kv_cache_memory_bytes"),
        help="KV cache size in bytes (4e9 is accepted); overrides --gpu-memory-utilization",
    )
    g.add_argument(
        "--skip-tokenizer-init",
        dest="skip_tokenizer_init",
        action="store_true",
        default=None,
        help="load no tokenizer (prompts are token ids; outputs carry no text)",
    )
    g.add_argument(
        "--enforce-eager",
        dest="enforce_eager",
        action="store_true",
        default=None,
        help="no CUDA graphs (accepted for vLLM compatibility)",
    )
    g.add_argument(
        "--disable-hybrid-kv-cache-manager",
        dest="disable_hybrid_kv_cache_manager",
        action="store_true",
        default=None,
        help="every layer keeps every token's KV, windowed ones too",
    )
    g.add_argument(
        "--no-async-scheduling",
        dest="async_scheduling",
        action="store_false",
        default=None,
        help="one step at a time (default: the host schedules step N+1 while step N runs)",
    )


def benchmark_parser(name: str, doc: str | None, **defaults: Any) -> argparse.ArgumentParser:
    """A benchmark's parser: `python -m asyncllm.bench.<name>`, its module docstring as
    the description, and the engine flags (`defaults`: this benchmark's own)."""
    parser = argparse.ArgumentParser(
        prog=f"python -m asyncllm.bench.{name}",
        description=doc,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    add_engine_args(parser, **defaults)
    return parser


def engine_kwargs(args: argparse.Namespace) -> dict[str, Any]:
    """EngineArgs fields for `LLM(**kw)` / `AsyncLLM(**kw)`: the flags that were set."""
    names = ["model", "kv_cache_memory_bytes", "skip_tokenizer_init", "enforce_eager"]
    names += ["async_scheduling", "disable_hybrid_kv_cache_manager"]
    names += [dest for _, dest, _, _ in _ENGINE_FLAGS]
    kw = {name: getattr(args, name) for name in names if getattr(args, name) is not None}
    kw.setdefault("model", None)
    return kw


def add_workload_args(
    parser: argparse.ArgumentParser, count_flag: str, count: int | None, count_help: str = ""
) -> None:
    g = parser.add_argument_group("workload")
    g.add_argument(
        count_flag,
        type=int,
        default=count,
        help=count_help or f"how many prompts (default {count})",
    )
    g.add_argument("--seed", type=int, default=0, help="the workload's random seed (default 0)")
    for kind, default in (("input", MAX_INPUT_LEN), ("output", MAX_OUTPUT_LEN)):
        g.add_argument(
            f"--max-{kind}-len",
            type=int,
            default=default,
            help=f"longest {kind} (default {default})",
        )
        g.add_argument(
            f"--min-{kind}-len",
            type=int,
            default=None,
            help=f"shortest {kind} (default: {MIN_LEN}/{default} of --max-{kind}-len)",
        )
    g.add_argument(
        "--max-token-id",
        type=int,
        default=MAX_TOKEN_ID,
        help=f"prompt ids are drawn from [0, this] (default {MAX_TOKEN_ID})",
    )


def add_warmup_arg(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--warmup-requests",
        type=int,
        default=None,
        help="short requests run before timing, with max_tokens 1..N (default: max_num_seqs, "
        "at most 256, on CUDA; 1 on the CPU, where nothing is compiled on first use)",
    )


def warmup_requests(
    n: int, temperature: float
) -> tuple[list[dict[str, list[int]]], list[SamplingParams]]:
    """n requests of 16 tokens (no shared prefix) with max_tokens 1..n: the decode batch
    shrinks from n to 1, one request a step, so the kernels of every batch shape a run
    will meet are compiled before it is timed (on a cold Triton cache that costs ~2 s of
    an 8 s throughput run on an H200)."""
    prompts = [{"prompt_token_ids": [1 + i % 1000] * 15 + [1 + i // 1000]} for i in range(n)]
    params = [
        SamplingParams(temperature=temperature, ignore_eos=True, max_tokens=i + 1) for i in range(n)
    ]
    return prompts, params


def num_warmup_requests(args: argparse.Namespace, config: ResolvedConfig) -> int:
    if args.warmup_requests is not None:
        return max(0, args.warmup_requests)
    if not config.device.startswith("cuda"):
        return 1
    return min(config.max_num_seqs, 256)


def _min_len(min_len: int | None, max_len: int, full: int) -> int:
    if min_len is None:  # keep the default workload's proportions
        min_len = max(1, round(max_len * MIN_LEN / full))
    return min(min_len, max_len)


def make_workload(
    num_prompts: int = NUM_PROMPTS,
    seed: int = 0,
    max_input_len: int = MAX_INPUT_LEN,
    max_output_len: int = MAX_OUTPUT_LEN,
    min_input_len: int | None = None,
    min_output_len: int | None = None,
    max_token_id: int = MAX_TOKEN_ID,
) -> tuple[list[list[int]], list[int]]:
    """(prompts as token-id lists, max_tokens of each). With the defaults this is
    nano-vllm's workload draw for draw: every prompt first (its length, then its ids),
    then every max_tokens; sum(max_tokens) is 133,966."""
    if num_prompts < 1 or max_input_len < 1 or max_output_len < 1 or max_token_id < 0:
        raise ValueError("the workload needs at least one prompt and positive lengths")
    lo_in = _min_len(min_input_len, max_input_len, MAX_INPUT_LEN)
    lo_out = _min_len(min_output_len, max_output_len, MAX_OUTPUT_LEN)
    if lo_in < 1 or lo_out < 1:
        raise ValueError("minimum lengths must be at least 1")
    rng = random.Random(seed)  # the same stream as random.seed(seed)
    prompts = [
        [rng.randint(0, max_token_id) for _ in range(rng.randint(lo_in, max_input_len))]
        for _ in range(num_prompts)
    ]
    max_tokens = [rng.randint(lo_out, max_output_len) for _ in range(num_prompts)]
    return prompts, max_tokens


# The workloads of `asyncllm.bench.throughput --workload`: name -> (prompts, prompt
# tokens (a shared-prefix workload: the prefix), distinct tail tokens, output tokens,
# temperature); None for nano-vllm's (its own draws, `make_workload`).
FIXED_WORKLOADS: dict[str, tuple[int, int, int, int, float]] = {
    # Prefill-heavy: 256 distinct prompts of 3,000 ids, 16 greedy tokens each.
    "prefill": (256, 3000, 0, 16, 0.0),
    # One 2,048-token prefix shared by 512 prompts, each ending in 64 ids of its own;
    # 64 greedy tokens each (the prefix cache serves the prefix after its first prefill).
    "shared-prefix": (512, 2048, 64, 64, 0.0),
}


def make_fixed_workload(
    kind: str,
    num_prompts: int | None = None,
    prompt_len: int | None = None,
    output_len: int | None = None,
    seed: int = 0,
    max_token_id: int = MAX_TOKEN_ID,
) -> tuple[list[list[int]], list[int], float]:
    """(prompts, max_tokens of each, temperature) of a FIXED_WORKLOADS entry; the counts
    override its prompts, its prompt (or prefix) length and its output tokens. The ids
    are random (a shared-prefix prompt's tail too), so prompts share nothing by chance."""
    if kind not in FIXED_WORKLOADS:
        raise ValueError(f"unknown workload {kind!r} (known: {', '.join(FIXED_WORKLOADS)})")
    n, length, tail, out, temperature = FIXED_WORKLOADS[kind]
    n = n if num_prompts is None else num_prompts
    length = length if prompt_len is None else prompt_len
    out = out if output_len is None else output_len
    if n < 1 or length < 1 or out < 1 or max_token_id < 1:
        raise ValueError("the workload needs at least one prompt and positive lengths")
    rng = random.Random(seed)
    if tail:
        prefix = [rng.randint(0, max_token_id) for _ in range(length)]
        prompts = [prefix + [rng.randint(0, max_token_id) for _ in range(tail)] for _ in range(n)]
    else:
        prompts = [[rng.randint(0, max_token_id) for _ in range(length)] for _ in range(n)]
    return prompts, [out] * n, temperature


def workload_from_args(
    args: argparse.Namespace, num_prompts: int
) -> tuple[list[list[int]], list[int]]:
    prompts, max_tokens = make_workload(
        num_prompts=num_prompts,
        seed=args.seed,
        max_input_len=args.max_input_len,
        max_output_len=args.max_output_len,
        min_input_len=args.min_input_len,
        min_output_len=args.min_output_len,
        max_token_id=args.max_token_id,
    )
    default = (
        num_prompts == NUM_PROMPTS
        and args.seed == 0
        and args.max_input_len == MAX_INPUT_LEN
        and args.max_output_len == MAX_OUTPUT_LEN
        and args.min_input_len in (None, MIN_LEN)
        and args.min_output_len in (None, MIN_LEN)
        and args.max_token_id == MAX_TOKEN_ID
    )
    if default and sum(max_tokens) != DEFAULT_WORKLOAD_OUTPUT_TOKENS:
        raise AssertionError(
            f"the default workload asks for {sum(max_tokens)} output tokens, not "
            f"{DEFAULT_WORKLOAD_OUTPUT_TOKENS}: make_workload no longer draws nano-vllm's "
            "workload (the order of the random draws changed?)"
        )
    return prompts, max_tokens


def add_throughput_workload_args(parser: argparse.ArgumentParser) -> None:
    """`--workload` and its sizes: nano-vllm's (the default) or a FIXED_WORKLOADS one."""
    add_workload_args(
        parser,
        "--num-prompts",
        None,
        f"how many prompts (default: the workload's, {NUM_PROMPTS} for nano-vllm's)",
    )
    g = parser.add_argument_group("fixed workloads")
    g.add_argument(
        "--workload",
        choices=["nano-vllm", *FIXED_WORKLOADS],
        default="nano-vllm",
        help="which workload (default nano-vllm's; see above)",
    )
    g.add_argument("--prompt-len", type=int, default=None, help="prefill / shared-prefix: ids")
    g.add_argument("--output-len", type=int, default=None, help="prefill / shared-prefix: tokens")
    parser.add_argument(
        "--temperature",
        type=float,
        default=None,
        help="sampling temperature (default 0.6 for nano-vllm's workload, 0 for the others)",
    )


def check_throughput_workload_args(
    parser: argparse.ArgumentParser, args: argparse.Namespace
) -> None:
    if args.workload == "nano-vllm" and (args.prompt_len or args.output_len):
        parser.error(
            "--prompt-len and --output-len are for the prefill and shared-prefix workloads"
        )


def throughput_workload(args: argparse.Namespace) -> tuple[list[list[int]], list[int], float]:
    """(prompts, max_tokens, temperature) of the workload the arguments name."""
    if args.workload == "nano-vllm":
        prompts, max_tokens = workload_from_args(args, args.num_prompts or NUM_PROMPTS)
        temperature = 0.6
    else:
        prompts, max_tokens, temperature = make_fixed_workload(
            args.workload,
            args.num_prompts,
            args.prompt_len,
            args.output_len,
            seed=args.seed,
            max_token_id=args.max_token_id,
        )
    return prompts, max_tokens, temperature if args.temperature is None else args.temperature


def add_peak_rate_args(parser: argparse.ArgumentParser) -> None:
    """The card's attainable rates for a floor (default: asyncllm.bench.roofline's table
    by the device's name)."""
    g = parser.add_argument_group("roofline")
    g.add_argument(
        "--hbm-bandwidth",
        type=float,
        default=None,
        help="attainable memory bandwidth, bytes/s (default: 90%% of the card's datasheet "
        "figure, for the cards the roofline knows)",
    )
    g.add_argument(
        "--peak-flops",
        type=float,
        default=None,
        help="attainable dense GEMM rate, FLOP/s (default: 80%% of the card's bf16 peak)",
    )


def check_output_tokens(produced: int, expected: int) -> None:
    """Every request ignores EOS, so the engine must produce exactly sum(max_tokens)."""
    if produced != expected:
        raise AssertionError(
            f"the engine produced {produced} output tokens but the requests asked for "
            f"{expected} (sum of max_tokens, EOS ignored): the figures would be wrong"
        )


def _cpu_name() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.partition(":")[2].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def describe_engine(config: ResolvedConfig) -> dict[str, Any]:
    """What the figures were measured on (a benchmark's host may import torch: it names
    the GPU and the torch version)."""
    import torch

    device = config.device
    if device.startswith("cuda"):
        device_name = torch.cuda.get_device_name(torch.device(device))
    else:
        device_name = _cpu_name()
    return {
        "model": config.model if config.model is not None else "(embedded default)",
        "model_path": config.model_path,
        "architecture": config.architecture,
        "load_format": config.load_format,
        "dtype": config.dtype,
        "device": device,
        "device_name": device_name,
        "torch": torch.__version__,
        "max_model_len": config.max_model_len,
        "max_num_seqs": config.max_num_seqs,
        "max_num_batched_tokens": config.max_num_batched_tokens,
        "enforce_eager": config.enforce_eager,
        "async_scheduling": config.async_scheduling,
        "attention_backend": config.attention_backend,
    }


def percentile(values: Sequence[float], q: float) -> float:
    """The q-th percentile (0-100), linear between ranks (numpy's default); NaN if empty."""
    if not values:
        return math.nan
    xs = sorted(values)
    pos = (len(xs) - 1) * q / 100
    lo = math.floor(pos)
    hi = min(lo + 1, len(xs) - 1)
    return xs[lo] + (xs[hi] - xs[lo]) * (pos - lo)


def _clean(value: Any) -> Any:
    """JSON-safe: NaN and infinities become null."""
    if isinstance(value, float):
        return value if math.isfinite(value) else None
    if isinstance(value, dict):
        return {k: _clean(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [_clean(v) for v in value]
    return value


def format_table(header: Sequence[str], rows: Sequence[Sequence[Any]]) -> str:
    def cell(v: Any) -> str:
        if isinstance(v, float):
            if not math.isfinite(v):
                return "-"
            if v == 0 or abs(v) >= 1000:
                return f"{v:,.0f}"
            return f"{v:.2f}" if abs(v) >= 1 else f"{v:.3g}"
        if isinstance(v, int) and not isinstance(v, bool):
            return f"{v:,}"
        return str(v)

    cells = [[cell(v) for v in row] for row in rows]
    widths = [max(len(str(h)), *(len(r[i]) for r in cells)) for i, h in enumerate(header)]
    lines = ["  ".join(str(h).ljust(w) for h, w in zip(header, widths))]
    lines.append("  ".join("-" * w for w in widths))
    for r in cells:
        lines.append(
            "  ".join(c.rjust(w) if i else c.ljust(w) for i, (c, w) in enumerate(zip(r, widths)))
        )
    return "\n".join(lines)


def report(title: str, table: str, result: dict[str, Any]) -> dict[str, Any]:
    """Prints the title, the table and then the result as one JSON line (the last line of
    stdout); returns the JSON-safe result."""
    clean = _clean(result)
    print(title)
    print(table, flush=True)
    print(json.dumps(clean, allow_nan=False), flush=True)
    return clean
