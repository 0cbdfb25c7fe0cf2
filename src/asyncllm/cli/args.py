"""Command-line flags generated from a dataclass: one flag per field, its help text the
field's docstring (the string literal under it in the class body), its default shown."""

from __future__ import annotations

import argparse
import ast
import dataclasses
import inspect
import textwrap
from functools import cache
from typing import Any


@cache
def field_docs(cls: type) -> dict[str, str]:
    """{field name: its docstring} from the class's source."""
    tree = ast.parse(textwrap.dedent(inspect.getsource(cls)))
    body = tree.body[0].body  # type: ignore[attr-defined]
    docs = {}
    for node, after in zip(body, body[1:]):
        if (
            isinstance(node, ast.AnnAssign)
            and isinstance(node.target, ast.Name)
            and isinstance(after, ast.Expr)
            and isinstance(after.value, ast.Constant)
            and isinstance(after.value.value, str)
        ):
            docs[node.target.id] = " ".join(after.value.value.split())
    return docs


_SCALARS: dict[str, Any] = {"bool": bool, "int": int, "float": float, "str": str}


def _flag_type(annotation: str) -> tuple[Any, bool]:
    """(the element type argparse converts to, whether it is a list) from a field's
    annotation as written (`int | None`, `list[int] | None`, `str | torch.dtype`), read
    without evaluating it, so torch is not imported for --help."""
    kinds = [k.strip() for k in annotation.split("|") if k.strip() != "None"]
    for k in kinds:
        if k.startswith("list[") and k.endswith("]"):
            return _SCALARS.get(k[5:-1], str), True
    for k in kinds:
        if k in _SCALARS:
            return _SCALARS[k], False
    return str, False


def add_dataclass_flags(
    parser: argparse.ArgumentParser | Any, cls: type, skip: tuple[str, ...] = ()
) -> None:
    """One flag per field of `cls`: --field-name (booleans get --no-field-name too)."""
    docs = field_docs(cls)
    for f in dataclasses.fields(cls):
        if f.name in skip:
            continue
        flag = "--" + f.name.replace("_", "-")
        doc = docs.get(f.name, "")
        kind, is_list = _flag_type(str(f.type))
        if f.default is not dataclasses.MISSING:
            default = f.default
        elif f.default_factory is not dataclasses.MISSING:
            default = f.default_factory()
        else:
            default = None
        if kind is bool:
            parser.add_argument(
                flag,
                dest=f.name,
                action=argparse.BooleanOptionalAction,
                default=argparse.SUPPRESS,
                help=f"{doc} (default: {'on' if default else 'off'})",
            )
            continue
        parser.add_argument(
            flag,
            dest=f.name,
            type=kind,
            nargs="+" if is_list else None,
            default=argparse.SUPPRESS,
            metavar=f.name.upper(),
            help=f"{doc} (default: {default})",
        )


def dataclass_kwargs(ns: argparse.Namespace, cls: type) -> dict[str, Any]:
    """The fields of `cls` given on the command line (the rest keep their defaults)."""
    names = {f.name for f in dataclasses.fields(cls)}
    return {k: v for k, v in vars(ns).items() if k in names}
