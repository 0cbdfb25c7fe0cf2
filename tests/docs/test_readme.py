"""Every code block of README.md, run as written (or as its marker says: tests/docs/blocks.py).

The test ids name each block's line, e.g. `L16-python`, or `L97-sh+L103-python` for a
server and its client.
"""

from __future__ import annotations

import re
import subprocess

import pytest

from tests.docs import blocks

README = blocks.ROOT / "README.md"
CASES = blocks.plan(README)


@pytest.mark.parametrize("case", CASES, ids=[c.id for c in CASES])
def test_readme_block(case: blocks.Case):
    outcome = blocks.run_case(case)
    if outcome.skipped:
        pytest.skip(outcome.skipped)


def test_make_demo_runs_the_quickstart_example():
    """README's `make demo` is examples/quickstart.py (which tests/examples/
    test_quickstart.py runs), and its `make test` the pytest suite."""
    for target, recipe in (("demo", r"\bexamples/quickstart\.py$"), ("test", r"-m pytest\b")):
        out = subprocess.run(
            ["make", "-n", "--no-print-directory", target],
            cwd=blocks.ROOT,
            env=blocks.block_env(),
            capture_output=True,
            text=True,
            timeout=60,
        )
        assert out.returncode == 0, out.stderr
        assert re.search(recipe, out.stdout.strip().splitlines()[-1]), out.stdout


def test_readme_links_resolve():
    """Each relative link of README.md names a file or folder of the repository."""
    text = README.read_text()
    links = re.findall(r"\]\(([^)#\s]+)(?:#[^)]*)?\)", text)
    assert links
    missing = [link for link in links if "://" not in link and not (blocks.ROOT / link).exists()]
    assert not missing, f"README links to missing paths: {missing}"
