"""The docs' references to the code (docs/_ext/check_refs.py, `make check-refs`), the
generated glossary and configuration reference, and the checks failing where they
should."""

from __future__ import annotations

import dataclasses
import sys

import pytest

from tests.docs import blocks

sys.path.insert(0, str(blocks.ROOT / "docs" / "_ext"))

import asyncllm_docs  # noqa: E402
import check_refs  # noqa: E402


def test_every_reference_in_readme_and_docs_holds():
    assert check_refs.check_all() == []


def test_a_missing_symbol_a_missing_path_and_a_stale_line_range_fail(tmp_path):
    page = tmp_path / "page.md"
    page.write_text(
        "Real: `asyncllm.core.scheduler.Scheduler` and `src/asyncllm/core/scheduler.py`.\n"
        "Not: `asyncllm.core.scheduler.Scheduler.no_such_method` and `core/no_such.py`.\n"
        "```python\nignored = '`asyncllm.nothing`'\n```\n"
    )
    problems = check_refs.check_page(page, check_refs.tracked_files())
    assert len(problems) == 2, problems
    assert (
        "page.md:2: `asyncllm.core.scheduler.Scheduler.no_such_method` does not resolve"
        in (problems[0])
    )
    assert "`core/no_such.py` is no file of the repository" in problems[1]
    # The glossary with one line range off by one: stale.
    text = asyncllm_docs.GLOSSARY.read_text(encoding="utf-8")
    stale = tmp_path / "glossary.md"
    first = text.index("#L") + 2
    line = int(text[first:].split("-", 1)[0])
    stale.write_text(text[:first] + str(line + 1) + text[first + len(str(line)) :])
    assert any("is stale" in p for p in check_refs.check_glossary(stale))


def test_a_not_yet_row_fails_once_its_symbol_exists(monkeypatch):
    term = asyncllm_docs.Term("x", "X", "", "not yet: asyncllm.core.scheduler.Scheduler", "y")
    monkeypatch.setattr(asyncllm_docs, "read_terms", lambda path=None: [term])
    problems = check_refs.check_glossary()
    assert problems[0] == (
        "glossary: X: `asyncllm.core.scheduler.Scheduler` exists now; give its row the symbol"
    )


def test_every_term_has_a_row_with_its_japanese_name():
    terms = asyncllm_docs.read_terms()
    assert len(terms) == 40 and len({t.en for t in terms}) == 40
    rows = [
        line.split(" | ")
        for line in asyncllm_docs.GLOSSARY.read_text(encoding="utf-8").splitlines()
        if line.startswith("| ") and not line.startswith(("| term", "| ---"))
    ]
    assert [(r[0].removeprefix("| "), r[1]) for r in rows] == [(t.ja, t.en) for t in terms]


def test_the_configuration_reference_has_every_field_and_flag():
    from asyncllm import EngineArgs, SamplingParams
    from asyncllm.cli.args import field_docs
    from asyncllm.cli.main import build_parser

    text = asyncllm_docs.configuration_markdown()
    for cls in (EngineArgs, SamplingParams):
        docs = field_docs(cls)
        for f in dataclasses.fields(cls):
            default = f.default if f.default is not dataclasses.MISSING else None
            assert f"| `{f.name}` |" in text, f"{cls.__name__}.{f.name} missing"
            assert f.name in docs, f"{cls.__name__}.{f.name} has no docstring to show"
            if default is not None:
                assert f"`{asyncllm_docs._cell(repr(default))}`" in text
    for sub in asyncllm_docs._subparsers(build_parser()).values():
        for action in sub._actions:
            if action.option_strings and action.dest != "help":
                assert f"`{', '.join(action.option_strings)}`" in text, action.option_strings


# The docs pages with code blocks; their blocks run here (README.md's in test_readme.py).
PAGES = ("quickstart.md", "guide.md", "distributed.md", "server.md", "cli.md", "development.md",
         "architecture.md")  # fmt: skip
CASES = [case for page in PAGES for case in blocks.plan(blocks.ROOT / "docs" / page)]


@pytest.mark.parametrize("case", CASES, ids=[f"{c.blocks[0].page.name}:{c.id}" for c in CASES])
def test_docs_block(case: blocks.Case):
    outcome = blocks.run_case(case)
    if outcome.skipped:
        pytest.skip(outcome.skipped)
