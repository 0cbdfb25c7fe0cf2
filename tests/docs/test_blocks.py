"""The docs harness itself (tests/docs/blocks.py), on small pages of its own: no engine."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

from tests.docs import blocks

PAGE = blocks.ROOT / "docs" / "example.md"  # never written: the text is passed in


def plan(text: str) -> list[blocks.Case]:
    return blocks.plan(PAGE, text)


def run(text: str) -> list[blocks.Outcome]:
    return [blocks.run_case(case) for case in plan(text)]


def test_blocks_their_lines_languages_and_markers():
    text = (
        "# Title\n"
        "\n"
        "```python\n"
        "print('a')\n"
        "```\n"
        '<!-- docs: skip reason="needs a GPU" -->\n'
        "\n"
        "~~~~ Bash extra words\n"
        "```\n"
        "nvidia-smi\n"
        "~~~~\n"
        "  ```\n"
        "  indented\n"
        "  ```\n"
    )
    found, markers = blocks.find_blocks(PAGE, text)
    assert [(b.line, b.lang) for b in found] == [(3, "python"), (8, "bash"), (12, "")]
    assert found[0].code == "print('a')\n" and found[0].marker is None
    assert found[1].code == "```\nnvidia-smi\n"  # a shorter fence of the other kind is text
    assert found[1].marker == markers[0] and markers[0].options == {"reason": "needs a GPU"}
    assert found[2].code == "indented\n"


def test_a_block_without_a_runner_or_a_marker_is_refused():
    (case,) = plan("text\n\n```json\n{}\n```\n")
    assert case.id == "L3-json"
    with pytest.raises(blocks.BlockError, match=r"docs/example\.md:3: a json block has no runner"):
        blocks.run_case(case)
    (case,) = plan("```\nplain\n```\n")
    assert case.problem and "a plain block has no runner" in case.problem


@pytest.mark.parametrize(
    "marker, problem",
    [
        ("<!-- docs: skip -->", "skip needs reason="),
        ('<!-- docs: skip reason="" -->', "skip needs reason="),
        ("<!-- docs: ignore -->", "unknown verb 'ignore'"),
        ("<!-- docs: run retries=3 -->", "not 'retries=3'"),
        ("<!-- docs: run timeout=soon -->", "timeout must be a number"),
        ('<!-- docs: server url="http://x" -->', "server needs ready="),
        ('<!-- docs: server ready="up" url="http://x" -->', "url= needs a group"),
        ('<!-- docs: skip reason="open -->', "No closing quotation"),
    ],
)
def test_bad_markers_are_refused(marker, problem):
    (case,) = plan(f"{marker}\n```python\npass\n```\n")
    assert case.problem and problem in case.problem
    assert case.problem.startswith("docs/example.md:2: the docs marker at line 1")


def test_a_marker_must_stand_right_above_a_fence():
    cases = plan('<!-- docs: skip reason="x" -->\nSome prose.\n\n```python\npass\n```\n')
    assert [c.id for c in cases] == ["L1-marker", "L4-python"]
    assert cases[0].problem == "docs/example.md:1: a docs marker with no fence after it"
    assert cases[1].problem is None and cases[1].blocks[0].marker is None
    # A marker may span lines; inline mentions of one in prose are not markers.
    text = '<!-- docs: skip\n  reason="over two lines" -->\n```json\n{}\n```\n'
    (case,) = plan(text + "Write `<!-- docs: skip -->` above it.\n")
    assert case.problem is None
    assert case.blocks[0].marker.options == {"reason": "over two lines"}


def test_skip_names_its_reason_and_checks_what_covers_it():
    (outcome,) = run('<!-- docs: skip reason="needs a GPU" -->\n```sh\nnvidia-smi\n```\n')
    assert outcome.skipped == "docs/example.md:2: needs a GPU"
    ok = "tests/docs/test_blocks.py::test_skip_names_its_reason_and_checks_what_covers_it"
    (outcome,) = run(f'<!-- docs: skip reason="r" covered-by="{ok}" -->\n```sh\nx\n```\n')
    assert outcome.skipped
    for ref, error in [
        ("tests/nowhere.py", "tests/nowhere.py, which does not exist"),
        ("tests/docs/test_blocks.py::test_gone", "which tests/docs/test_blocks.py does not define"),
    ]:
        with pytest.raises(blocks.BlockError, match=error):
            run(f'<!-- docs: skip reason="r" covered-by="{ref}" -->\n```sh\nx\n```\n')


def test_shell_commands_split_by_line_continuation_and_quotes():
    text = (
        "```sh\n"
        "# a comment\n"
        "echo one  # and a comment after\n"
        "\n"
        "echo two \\\n"
        "  three\n"
        "echo 'four\n"
        "five'\n"
        "```\n"
    )
    (block,), _ = blocks.find_blocks(PAGE, text)
    assert blocks.shell_commands(block) == [
        (3, "echo one  # and a comment after"),
        (5, "echo two \\\n  three"),
        (7, "echo 'four\nfive'"),
    ]
    (outcome,) = run(text)
    assert outcome.outputs == ["one\n", "two three\n", "four\nfive\n"]
    (case,) = plan("```sh\necho 'open\n```\n")
    assert case.problem == 'docs/example.md:2: this command does not end: "echo \'open"'


def test_console_blocks_run_their_prompt_lines_only():
    (outcome,) = run("```console\n$ echo hi\nhi\n$ echo a \\\n  b\nthe output\n```\n")
    assert outcome.outputs == ["hi\n", "a b\n"]


def test_shell_blocks_find_the_environments_commands_first():
    (outcome,) = run("```sh\ncommand -v python\n```\n")
    assert outcome.outputs == [f"{Path(sys.executable).parent}/python\n"]


def test_a_failing_block_names_its_page_line():
    with pytest.raises(blocks.BlockError, match=r"docs/example\.md:4: `false` exited with 1"):
        run("```sh\ntrue\n\nfalse\necho never\n```\n")
    text = "intro\n\n```python\nimport sys\n\nsys.exit('bad')\n```\n"
    with pytest.raises(blocks.BlockError) as e:
        run(text)
    assert "docs/example.md:3: the python block exited with 1" in str(e.value)
    assert "example_L3.py is line 3+N of the page" in str(e.value) and "bad" in str(e.value)


def test_a_block_past_its_timeout_is_stopped():
    with pytest.raises(blocks.BlockError, match=r"docs/example\.md:3: still running after 0\.2 s"):
        run("<!-- docs: run timeout=0.2 -->\n```sh\necho started; sleep 30\n```\n")


def test_dry_run_takes_make_commands_and_fails_on_a_missing_target():
    (outcome,) = run("<!-- docs: dry-run -->\n```sh\nmake lint  # the linters\n```\n")
    assert "ruff check" in outcome.outputs[0]
    with pytest.raises(blocks.BlockError, match=r"make -n no-such-target` exited with 2"):
        run("<!-- docs: dry-run -->\n```sh\nmake no-such-target\n```\n")
    with pytest.raises(blocks.BlockError, match="dry-run takes make commands only"):
        run("<!-- docs: dry-run -->\n```sh\nrm -rf .venv\n```\n")


# A stand-in server: says where it listens once up (after a line of other output), and
# exits with the status given when SIGTERM comes.
FAKE_SERVER = (
    'python -c "import signal, sys; signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGTERM}); '
    "print('starting', flush=True); "
    "print('serving x on http://127.0.0.1:1234', file=sys.stderr, flush=True); "
    'signal.sigwait({signal.SIGTERM}); sys.exit(%d)"'
)
READY = 'ready="serving .* on (http://[^ ]+)"'


def server_page(
    status: int = 0, client: str = "test http://localhost:8000/v1 = http://127.0.0.1:1234/v1"
) -> str:
    marker = f'<!-- docs: server {READY} url="http://localhost:8000" -->'
    return f"{marker}\n```sh\n{FAKE_SERVER % status}  # a comment\n```\n\n```sh\n{client}\n```\n"


def test_a_server_block_runs_its_client_against_the_address_it_prints():
    (case,) = plan(server_page())
    assert case.id == "L2-sh+L6-sh"
    outcome = blocks.run_case(case)
    assert "starting\nserving x on http://127.0.0.1:1234\n" == outcome.outputs[0]


def test_a_server_that_fails_its_client_or_its_stop_fails_the_case():
    with pytest.raises(
        blocks.BlockError,
        match=r"docs/example\.md:7: `false http://127\.0\.0\.1:1234` exited with 1",
    ):
        run(server_page(client="false http://localhost:8000"))
    with pytest.raises(blocks.BlockError, match=r"docs/example\.md:3: exited with 3 after SIGTERM"):
        run(server_page(status=3))
    with pytest.raises(
        blocks.BlockError, match=r"`bash -c 'exit 2'` exited with 2 before a line matching"
    ):
        run(f'<!-- docs: server {READY} -->\n```sh\nbash -c "exit 2"\n```\n```sh\ntrue\n```\n')
    with pytest.raises(
        blocks.BlockError, match="the client block never names http://localhost:8000"
    ):
        run(server_page(client="true"))


def test_a_server_block_needs_one_command_and_a_client():
    (case,) = plan(f"<!-- docs: server {READY} -->\n```sh\nserve\n```\n")
    assert case.problem == "docs/example.md:2: a server block needs a client block after it"
    case, client = plan(
        f"<!-- docs: server {READY} -->\n```sh\nserve\nserve\n```\n```sh\ntrue\n```\n"
    )
    assert case.problem == "docs/example.md:2: a server block holds one command, not 2"
    assert client.problem is None  # (runs on its own then)
