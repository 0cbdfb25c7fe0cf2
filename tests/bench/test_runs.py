"""Each benchmark end to end on the CPU: a tiny config-only model with dummy weights,
token-id prompts, no tokenizer, a few requests."""

from __future__ import annotations

import json
import runpy
from pathlib import Path

import pytest

from asyncllm.bench import latency, serving, throughput
from asyncllm.bench.common import check_output_tokens, make_workload, workload_from_args

ROOT = Path(__file__).resolve().parents[2]

WORKLOAD = ["--max-input-len", "48", "--max-output-len", "24"]


def last_json_line(capsys) -> dict:
    out = capsys.readouterr().out
    lines = out.strip().splitlines()
    assert len(lines) >= 3  # a title, a table, the JSON line
    return json.loads(lines[-1])


def test_throughput(capsys, engine_flags):
    result = throughput.main([*engine_flags, "--num-prompts", "6", *WORKLOAD])
    assert last_json_line(capsys) == result
    prompts, max_tokens = make_workload(6, max_input_len=48, max_output_len=24)
    assert result["benchmark"] == "throughput" and result["num_prompts"] == 6
    assert result["output_tokens"] == sum(max_tokens)
    assert result["prompt_tokens"] == sum(map(len, prompts))
    assert result["output_tok_s"] > 0 and result["total_tok_s"] > result["output_tok_s"]
    engine = result["engine"]
    assert engine["dtype"] == "float32" and engine["device"] == "cpu"
    assert (engine["max_model_len"], engine["max_num_seqs"]) == (4096, 256)
    assert engine["max_num_batched_tokens"] == 16384


@pytest.mark.parametrize("kind", ["prefill", "shared-prefix"])
def test_throughput_on_a_fixed_workload(capsys, engine_flags, kind):
    flags = ["--workload", kind, "--num-prompts", "4", "--prompt-len", "40", "--output-len", "3"]
    result = throughput.main([*engine_flags, *flags])
    assert last_json_line(capsys) == result
    tail = 64 if kind == "shared-prefix" else 0
    assert result["workload"] == kind and result["temperature"] == 0.0
    assert result["prompt_tokens"] == 4 * (40 + tail) and result["output_tokens"] == 12


def test_latency(capsys, engine_flags):
    args = ["--input-len", "16", "--output-len", "8", "--iters", "2", "--hbm-bandwidth", "1e10"]
    result = latency.main([*engine_flags, *args])
    assert last_json_line(capsys) == result
    assert result["benchmark"] == "latency" and result["output_len"] == 8
    assert result["tok_s"] > 0 and result["prefill_ms"] > 0 and len(result["wall_s_all"]) == 2
    assert result["tok_s"] == pytest.approx(8 / result["wall_s"], rel=1e-4)
    floor = result["floor"]
    # Untied: everything but the 10240 x 64 embedding table, in float32.
    assert result["parameters"] == result["streamed_parameters"] + 10240 * 64
    assert floor["weight_bytes"] == result["streamed_parameters"] * 4
    assert floor["kv_bytes"] == (16 + 4) * 2 * 2 * 2 * 16 * 4
    assert floor["floor_tok_s"] == pytest.approx(1e10 / floor["bytes_per_step"], rel=1e-4)
    assert result["engine"]["max_num_seqs"] == 128  # the engine's default: flags not set


def test_serving(capsys, engine_flags):
    result = serving.main([*engine_flags, "--num-requests", "6", *WORKLOAD, "--rates", "100"])
    assert last_json_line(capsys) == result
    (row,) = result["rates"]
    _, max_tokens = workload_from_args(
        serving.parse_args([*engine_flags, "--num-requests", "6", *WORKLOAD]), 6
    )
    assert row["rate"] == 100 and row["num_requests"] == 6
    assert row["output_tokens"] == result["output_tokens_per_rate"] == sum(max_tokens)
    for key in ("request_throughput", "output_tok_s", "ttft_ms_p50", "ttft_ms_p99"):
        assert row[key] > 0, key
    assert 0 < row["tpot_ms_p50"] <= row["tpot_ms_p99"]
    assert row["ttft_ms_p50"] <= row["e2e_ms_p50"]


def test_a_wrong_token_count_is_caught():
    with pytest.raises(AssertionError, match="produced 133965 .* asked for 133966"):
        check_output_tokens(133_965, 133_966)


def test_the_hf_baseline_has_help(capsys):
    module = runpy.run_path(str(ROOT / "benchmarks" / "hf_baseline.py"))
    with pytest.raises(SystemExit) as exit_info:
        module["main"](["--help"])
    assert exit_info.value.code == 0
    assert "--batch-size" in capsys.readouterr().out


def test_step_profile(capsys, engine_flags, tmp_path):
    from asyncllm.bench import step_profile

    stats = tmp_path / "steps.prof"
    args = ["--batch", "1", "3", "--input-len", "8", "--steps", "5", "--cprofile", str(stats)]
    result = step_profile.main([*engine_flags, *args])
    assert last_json_line(capsys) == result
    assert [r["batch"] for r in result["rows"]] == [1, 3]
    for r in result["rows"]:
        stages = [r[s] for s in step_profile.STAGES]
        # The core's steps, as its process runs them: the frontend is another process's;
        # no grammar masks without --structured.
        idle = ("frontend", "fill", "mask")
        assert all(r[s] == 0 for s in idle) and all(
            r[s] > 0 for s in step_profile.STAGES if s not in idle
        ), r
        assert r["step"] == pytest.approx(sum(stages) + r["other"])
        assert r["gpu"] is None and r["graphs"] is False  # (the CPU: no kernels, no graphs)
    import pstats

    assert pstats.Stats(str(stats)).total_calls > 0


def test_step_profile_of_mixed_steps_at_two_context_lengths(capsys, engine_flags):
    from asyncllm.bench import step_profile

    args = ["--batch", "2", "--input-len", "8", "24", "--steps", "3", "--mixed", "20"]
    result = step_profile.main([*engine_flags, *args])
    rows = result["rows"]
    assert [(r["batch"], r["input_len"], r["mixed"]) for r in rows] == [(2, 8, 20), (2, 24, 20)]
    for r in rows:
        assert r["mixed_steps"] == 3  # (a prefill beside the decodes in every timed step)
        # each step: the 20-token prompt and the 2 decodes (a mixed request ends at once)
        assert r["tokens_per_step"] == 20 + 2
        assert r["step"] == pytest.approx(sum(r[s] for s in step_profile.STAGES) + r["other"])
        assert "classes" not in r and "floors" not in r  # (the CPU: no trace, no card)


def test_startup(capsys, engine_flags, monkeypatch):
    """A warm start, every stage measured (here in this interpreter: a fresh one, as the
    benchmark runs it, would only add the imports' seconds)."""
    from asyncllm.bench import startup

    monkeypatch.setattr(startup, "run_once", lambda kw, cache=None: startup._child(kw))
    result = startup.main(engine_flags)
    assert last_json_line(capsys) == result
    run = result["runs"]["warm start"]
    stages = run["stages"]
    for name in (
        "from asyncllm import AsyncLLM",
        "AsyncLLM.start()",
        "core: engine config",
        "core: load weights",
        "core: allocate KV cache",
        "core: process start, imports, messages",
        "first request: first token",
    ):
        assert stages[name] > 0, name
    assert startup.TOKENIZER_WAIT not in stages  # (the flags skip the tokenizer)
    assert stages["first request: 16 tokens"] >= stages["first request: first token"]
    assert stages["AsyncLLM.start()"] > stages["core: load weights"]
    assert run["loop_lag_ms_max"] >= run["loop_lag_ms_p99"] >= 0


def test_device_gaps_on_a_synthetic_trace():
    from asyncllm.bench.step_profile import STEP_MARK, device_gaps

    events = []

    def step(ts, dur):
        events.append(
            {"name": STEP_MARK, "ph": "X", "cat": "user_annotation", "ts": ts, "dur": dur}
        )

    def kernel(corr, launch, ts, dur, cat="kernel"):
        events.append(
            {
                "cat": "cuda_runtime",
                "ph": "X",
                "ts": launch,
                "dur": 1,
                "args": {"correlation": corr},
            }
        )
        events.append({"cat": cat, "ph": "X", "ts": ts, "dur": dur, "args": {"correlation": corr}})

    # Three steps on the host; the device runs 100-150 and 155-200 (step 0), 210-300
    # (step 1, a copy then a kernel), 300-390 (step 2). A kernel launched outside every
    # step is not counted.
    step(0, 50), step(60, 50), step(120, 50)
    kernel(1, 10, 100, 50), kernel(2, 20, 155, 45)
    kernel(3, 70, 210, 40, cat="gpu_memcpy"), kernel(4, 80, 250, 50)
    kernel(5, 130, 300, 90)
    kernel(6, 500, 400, 10)
    gaps = device_gaps(events)
    assert gaps["steps"] == 3
    assert gaps["between_us"] == pytest.approx((10 + 0) / 2)
    assert gaps["between_frac"] == pytest.approx(10 / 290)
    assert gaps["idle_frac"] == pytest.approx((5 + 10) / 290)
    assert device_gaps(events[:2])["steps"] == 0


def test_spec(capsys):
    """Speculation on and off on the embedded model (its tokenizer builds the chat
    prompts), both engines one after the other, in this process."""
    from asyncllm.bench import spec

    flags = ["--device", "cpu", "--batch-sizes", "2", "--output-len", "6", "--long-chars", "100"]
    result = spec.main([*flags, "--workloads", "long", "--num-speculative-tokens", "3"])
    assert last_json_line(capsys) == result
    assert result["benchmark"] == "spec" and result["num_speculative_tokens"] == 3
    cases = result["cases"]
    assert [(c["workload"], c["batch"]) for c in cases] == [("long", 2)]
    for c in cases:  # (greedy: the same tokens with drafts)
        assert c["same_outputs"] == c["batch"] and c["on_decode_tok_s"] > 0
    assert spec.workload_messages("open")[0][0]["role"] == "user"
    long = spec.workload_messages("long", 20_000)[0][0]["content"]
    # The grounded task after 20,000 characters of source.
    assert long.endswith(spec.workload_messages("grounded")[0][0]["content"])
    assert len(long) > 20_000 and spec._long_context(20_000) in long
