"""The docs' references to the code, checked (`make check-refs`; `make test` runs it
through tests/docs/test_refs.py):

- every backticked `asyncllm.…` or `asyncllm_kernels.…` name in README.md and docs/
  resolves (its module imports, its attributes exist);
- every backticked repository path (a name with a slash and a file extension, or ending
  in a slash) names a file or folder of the repository, from its root or as the tail of
  a tracked path (`model/kv_groups.py`), unless git ignores it (what a build or a
  download creates: `site/`, `.whl_a/`);
- docs/glossary.md is what its term list gives now: every symbol exists and its source
  line range is current, and no "not yet" symbol exists yet.

Prints each problem with its page and line; exits 1 if there is any.
"""

from __future__ import annotations

import re
import subprocess
import sys
from collections.abc import Iterable
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import asyncllm_docs  # noqa: E402

ROOT = asyncllm_docs.ROOT
CODE_SPAN = re.compile(r"`([^`\n]+)`")
NAME = re.compile(r"^(asyncllm(?:_kernels)?(?:\.[A-Za-z_]\w*)+)(?:\(\))?$")
PATH = re.compile(
    r"^[\w.-]+(?:/[\w.-]+)*(?:/|\.(?:py|md|sh|json|toml|txt|tsv|yml|yaml|cfg|ipynb))$"
)


def pages() -> list[Path]:
    """README.md and the docs' Markdown pages (the generated glossary aside)."""
    docs = sorted(p for p in (ROOT / "docs").rglob("*.md") if "_ext" not in p.parts)
    return [ROOT / "README.md", *(p for p in docs if p != asyncllm_docs.GLOSSARY)]


def tracked_files() -> list[str]:
    out = subprocess.run(
        ["git", "ls-files"], cwd=ROOT, capture_output=True, text=True, check=True
    ).stdout
    return out.splitlines()


def spans(page: Path) -> Iterable[tuple[int, str]]:
    """(line, text) of each inline code span outside fenced blocks."""
    fenced = False
    for number, line in enumerate(page.read_text(encoding="utf-8").splitlines(), 1):
        if line.lstrip().startswith(("```", "~~~")):
            fenced = not fenced
            continue
        if not fenced:
            for m in CODE_SPAN.finditer(line):
                yield number, m.group(1).strip()


def path_exists(text: str, files: list[str]) -> bool:
    target = text.removeprefix("./")
    if (ROOT / target).exists():
        return True
    if target.endswith("/"):
        return any(f.startswith(target) or f"/{target}" in f for f in files)
    return any(f == target or f.endswith("/" + target) for f in files)


def git_ignores(path: str) -> bool:
    """Whether git ignores the path (what a build or a download creates)."""
    out = subprocess.run(["git", "check-ignore", "-q", "--no-index", path], cwd=ROOT)
    return out.returncode == 0


def check_page(page: Path, files: list[str]) -> list[str]:
    problems = []
    where = page.relative_to(ROOT) if page.is_relative_to(ROOT) else page
    for number, text in spans(page):
        name = NAME.match(text)
        if name:
            try:
                asyncllm_docs.resolve(name.group(1))
            except LookupError as e:
                problems.append(f"{where}:{number}: `{text}` does not resolve ({e})")
            continue
        if PATH.match(text) and "/" in text and not path_exists(text, files):
            if not git_ignores(text):  # (a generated path: site/, .venv/, downloads)
                problems.append(f"{where}:{number}: `{text}` is no file of the repository")
    return problems


def check_glossary(glossary: Path = asyncllm_docs.GLOSSARY) -> list[str]:
    problems = []
    terms = asyncllm_docs.read_terms()
    for t in terms:
        if t.pending:
            name = t.symbol[len(asyncllm_docs.NOT_YET) :]
            try:
                asyncllm_docs.resolve(name)
            except LookupError:
                continue
            problems.append(f"glossary: {t.en}: `{name}` exists now; give its row the symbol")
    try:
        want = asyncllm_docs.glossary_markdown(terms)
    except LookupError as e:
        return [*problems, f"glossary: {e}"]
    if glossary.read_text(encoding="utf-8") != want:
        where = glossary.relative_to(ROOT) if glossary.is_relative_to(ROOT) else glossary
        problems.append(
            f"{where} is stale (a symbol moved or the term list "
            "changed): run python docs/_ext/asyncllm_docs.py --write-glossary"
        )
    return problems


def check_all() -> list[str]:
    files = tracked_files()
    problems = []
    for page in pages():
        problems += check_page(page, files)
    return problems + check_glossary()


def main() -> int:
    problems = check_all()
    for p in problems:
        print(p)
    print(f"check-refs: {len(problems)} problem(s) in {len(pages())} pages and the glossary")
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main())
