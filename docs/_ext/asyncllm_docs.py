"""The documentation's generated parts, and the Sphinx extension that writes them.

- The configuration reference (`docs/reference/configuration.md`, written at every
  build, never by hand): every field of `EngineArgs` and `SamplingParams` with its type,
  default and docstring, read from the dataclasses; every flag of the `asyncllm` command
  (its `serve` included) read from its argument parser.
- The glossary (`docs/glossary.md`, kept in the repository so it reads on any forge):
  one row per term of `docs/glossary-terms.tsv` with the symbol that implements it here
  and its source lines (`python docs/_ext/asyncllm_docs.py --write-glossary` rewrites
  it; `check_refs.py` fails while it is stale).
"""

from __future__ import annotations

import argparse
import csv
import dataclasses
import importlib
import inspect
import sys
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[2]
DOCS = ROOT / "docs"
TERMS = DOCS / "glossary-terms.tsv"
GLOSSARY = DOCS / "glossary.md"
CONFIGURATION = DOCS / "reference" / "configuration.md"
NOT_YET = "not yet: "

for _path in (ROOT / "src", ROOT / "kernels"):
    if str(_path) not in sys.path:
        sys.path.insert(0, str(_path))


# -- names in the code ------------------------------------------------------------------


def resolve(name: str) -> Any:
    """The object a dotted name (`asyncllm.core.scheduler.Scheduler.schedule`) names:
    its longest importable module prefix, then attributes. LookupError if none."""
    parts = name.split(".")
    for cut in range(len(parts), 0, -1):
        try:
            obj = importlib.import_module(".".join(parts[:cut]))
        except ImportError:
            continue
        for attr in parts[cut:]:
            if not hasattr(obj, attr):
                raise LookupError(f"{name}: {'.'.join(parts[:cut])} has no {attr!r}")
            obj = getattr(obj, attr)
        return obj
    raise LookupError(f"{name}: no such module")


def source_lines(obj: Any) -> tuple[str, int, int]:
    """(repository path, first line, last line) of an object's source."""
    target = inspect.unwrap(obj)
    path = Path(inspect.getsourcefile(target) or "").resolve()
    lines, first = inspect.getsourcelines(target)
    first = max(first, 1)
    return path.relative_to(ROOT).as_posix(), first, first + len(lines) - 1


# -- the glossary -----------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class Term:
    ja: str
    en: str
    vllm: str
    symbol: str  # a dotted name, or "not yet: <the name it will have>"
    what: str

    @property
    def pending(self) -> bool:
        return self.symbol.startswith(NOT_YET)


def read_terms(path: Path = TERMS) -> list[Term]:
    with path.open(encoding="utf-8", newline="") as f:
        rows = list(csv.DictReader(f, delimiter="\t"))
    return [Term(r["ja"], r["en"], r["vllm"], r["asyncllm"], r["what"]) for r in rows]


def glossary_markdown(terms: list[Term] | None = None) -> str:
    """docs/glossary.md from the term list (a term whose symbol is missing raises)."""
    terms = read_terms() if terms is None else terms
    out = [
        "# Glossary",
        "",
        "The terms of the vLLM v0.25.1 design this project follows, each with the part of",
        "asyncllm that does its job and where that part's source lines are. Generated from",
        "`docs/glossary-terms.tsv` by `python docs/_ext/asyncllm_docs.py --write-glossary`;",
        "`make check-refs` (part of `make test`) fails when a line range goes stale or a",
        '"not yet" symbol comes to exist.',
        "",
        "| term | English | vLLM | asyncllm | source | what it does here |",
        "| --- | --- | --- | --- | --- | --- |",
    ]
    for t in terms:
        if t.pending:
            symbol, source = f"not yet (`{t.symbol[len(NOT_YET) :]}`)", ""
        else:
            path, first, last = source_lines(resolve(t.symbol))
            where = f"{path}#L{first}-L{last}"
            symbol, source = f"`{t.symbol}`", f"[{where}](../{where})"
        vllm = f"`{t.vllm}`" if t.vllm else ""
        out.append(f"| {t.ja} | {t.en} | {vllm} | {symbol} | {source} | {_cell(t.what)} |")
    return "\n".join(out) + "\n"


# -- the configuration reference ----------------------------------------------------------


def dataclass_rows(cls: type) -> list[tuple[str, str, str, str]]:
    """(name, type, default, meaning) of each field of a dataclass, in order: the type as
    written (the modules postpone annotations) and the docstring the CLI's flags show."""
    from asyncllm.cli.args import field_docs

    docs = field_docs(cls)
    rows = []
    for f in dataclasses.fields(cls):
        if f.default is not dataclasses.MISSING:
            default = repr(f.default)
        elif f.default_factory is not dataclasses.MISSING:
            default = repr(f.default_factory())
        else:
            default = "(required)"
        rows.append((f.name, str(f.type), default, docs.get(f.name, "")))
    return rows


def parser_rows(parser: argparse.ArgumentParser) -> list[tuple[str, str, str]]:
    """(flags, default, help) of a parser's options and positionals."""
    rows = []
    for action in parser._actions:
        if isinstance(action, (argparse._HelpAction, argparse._SubParsersAction)):
            continue
        flags = ", ".join(action.option_strings) or action.dest
        default = "" if action.default in (None, argparse.SUPPRESS) else repr(action.default)
        rows.append((flags, default, (action.help or "") % {"default": action.default}))
    return rows


def _subparsers(parser: argparse.ArgumentParser) -> dict[str, argparse.ArgumentParser]:
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            return dict(action.choices)
    return {}


def _cell(text: str) -> str:
    return " ".join(text.split()).replace("|", "\\|")


def configuration_markdown() -> str:
    from asyncllm import EngineArgs, SamplingParams
    from asyncllm.cli.main import build_parser

    out = [
        "# Configuration reference",
        "",
        "Generated from the code at every build of the docs (`docs/_ext/asyncllm_docs.py`):",
        "the fields of the dataclasses and the flags of the `asyncllm` command's parser.",
        "",
    ]
    for cls in (EngineArgs, SamplingParams):
        out += [f"## `{cls.__module__}.{cls.__qualname__}`", ""]
        out += [_cell(inspect.cleandoc(cls.__doc__ or "")), ""]
        out += ["| field | type | default | meaning |", "| --- | --- | --- | --- |"]
        for name, typ, default, doc in dataclass_rows(cls):
            out.append(f"| `{name}` | `{_cell(typ)}` | `{_cell(default)}` | {_cell(doc)} |")
        out.append("")
    parser = build_parser()
    out += ["## The `asyncllm` command", ""]
    for name, sub in _subparsers(parser).items():
        out += [f"### `asyncllm {name}`", "", _cell(sub.description or ""), ""]
        out += ["| flag | default | meaning |", "| --- | --- | --- |"]
        for flags, default, text in parser_rows(sub):
            shown = f"`{_cell(default)}`" if default else ""
            out.append(f"| `{_cell(flags)}` | {shown} | {_cell(text)} |")
        out.append("")
    return "\n".join(out)


def write_if_changed(path: Path, text: str) -> bool:
    if path.exists() and path.read_text(encoding="utf-8") == text:
        return False
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text, encoding="utf-8")
    return True


# -- the Sphinx extension -------------------------------------------------------------------


def _generate(app: Any) -> None:
    write_if_changed(CONFIGURATION, configuration_markdown())


def setup(app: Any) -> dict[str, Any]:
    app.connect("builder-inited", _generate)
    return {"parallel_read_safe": True, "parallel_write_safe": True}


if __name__ == "__main__":
    cli = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    cli.add_argument("--write-glossary", action="store_true", help="rewrite docs/glossary.md")
    cli.add_argument("--write-configuration", action="store_true")
    args = cli.parse_args()
    if args.write_glossary:
        write_if_changed(GLOSSARY, glossary_markdown())
    if args.write_configuration:
        write_if_changed(CONFIGURATION, configuration_markdown())
