"""The import rules of docs/architecture.md, checked by reading every module with `ast`.

Imports inside functions count. A module may import from its own package, from any layer
below its own, and (leaves only) from other leaves; never from a layer above or beside
it, and no set of modules may import each other in a circle.
"""

from __future__ import annotations

import ast
import os
import re
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
SOURCE_ROOTS = [ROOT / "src", ROOT / "kernels"]
DOC = ROOT / "docs" / "architecture.md"


def read_layers() -> list[list[str]]:
    """The layer table between the `layer order` markers: one numbered line per layer,
    top first, each naming its packages or modules."""
    text = DOC.read_text()
    block = re.search(r"<!-- layer order -->(.*?)<!-- /layer order -->", text, re.S)
    assert block, f"{DOC} has no layer order block"
    layers = []
    for line in block.group(1).splitlines():
        m = re.match(r"\s*\d+\.\s+(.*?)\s*(?:#.*)?$", line)
        if m:
            layers.append(re.findall(r"`([\w.]+)`", m.group(1)))
    assert len(layers) >= 5 and all(layers)
    return layers


def all_modules() -> dict[str, Path]:
    mods = {}
    for root in SOURCE_ROOTS:
        for path in root.rglob("*.py"):
            parts = list(path.relative_to(root).with_suffix("").parts)
            if parts[-1] == "__init__":
                parts.pop()
            mods[".".join(parts)] = path
    return mods


def walk_outside_functions(tree: ast.AST):
    """ast.walk, not entering function bodies (classes, ifs and trys are entered)."""
    todo = [tree]
    while todo:
        node = todo.pop()
        yield node
        if not isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
            todo.extend(ast.iter_child_nodes(node))


def imports_of(
    name: str, path: Path, modules: dict[str, Path], module_level_only: bool = False
) -> set[str]:
    """Our modules that `name` imports, anywhere in its body (or outside functions)."""
    is_pkg = path.name == "__init__.py"
    package = name if is_pkg else name.rpartition(".")[0]
    found = set()
    tree = ast.parse(path.read_text(), str(path))
    for node in walk_outside_functions(tree) if module_level_only else ast.walk(tree):
        targets: list[str] = []
        if isinstance(node, ast.Import):
            targets = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                up = package.split(".")
                up = up[: len(up) - (node.level - 1)]
                base = ".".join(up + ([node.module] if node.module else []))
            targets = [
                f"{base}.{a.name}" if f"{base}.{a.name}" in modules else base for a in node.names
            ]
        for t in targets:
            while t and t not in modules:
                t = t.rpartition(".")[0]
            if t and t != name:
                found.add(t)
    return found


MODULES = all_modules()
GRAPH = {name: imports_of(name, path, MODULES) for name, path in MODULES.items()}


def unit_of(module: str, layers: list[list[str]]) -> tuple[int, str]:
    """(layer index, the listed package or module that holds `module`)."""
    best: tuple[int, str] | None = None
    for i, names in enumerate(layers):
        for n in names:
            # The package root `asyncllm` (its __init__) holds only itself.
            if module == n or (n != "asyncllm" and module.startswith(n + ".")):
                if best is None or len(n) > len(best[1]):
                    best = (i, n)
    assert best is not None, f"{module} is in no layer of docs/architecture.md"
    return best


def test_every_module_has_a_layer():
    layers = read_layers()
    for m in MODULES:
        unit_of(m, layers)


def test_no_import_goes_up_or_sideways():
    layers = read_layers()
    leaves = len(layers) - 1
    bad = []
    for src, targets in GRAPH.items():
        i, unit = unit_of(src, layers)
        for dst in targets:
            j, dst_unit = unit_of(dst, layers)
            if unit == dst_unit or j > i or (i == j == leaves):
                continue
            bad.append(f"{src} (layer {i + 1}) imports {dst} (layer {j + 1})")
    assert not bad, "imports against the layer order:\n" + "\n".join(sorted(bad))


def strongly_connected(graph: dict[str, set[str]]) -> list[list[str]]:
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    out: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in graph.get(v, ()):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                out.append(sorted(comp))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return out


def test_no_import_cycles():
    # A package importing its own submodules (re-exports) is not a cycle of concern.
    graph = {
        s: {t for t in ts if not s.startswith(t + ".") and not t.startswith(s + ".")}
        for s, ts in GRAPH.items()
    }
    assert strongly_connected(graph) == []


def test_the_checker_sees_imports_inside_functions(tmp_path):
    f = tmp_path / "m.py"
    f.write_text("def f():\n    from asyncllm.engine import core\n    import asyncllm.config\n")
    assert imports_of("asyncllm.x", f, MODULES) == {"asyncllm.engine.core", "asyncllm.config"}


def test_the_cycle_finder_finds_cycles():
    assert strongly_connected({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]


ENV_READERS = {
    "get",
    "getenv",
    "pop",
    "setdefault",
    "environ",
    "_switch",
}  # (_switch: envs.py's 0/1 reader)


def env_reads(path: Path) -> list[str]:
    """The ASYNCLLM_* names a module reads from the environment."""
    found = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        arg: ast.AST | None = None
        if isinstance(node, ast.Call) and node.args:
            func = node.func
            name = func.attr if isinstance(func, ast.Attribute) else getattr(func, "id", "")
            if name in ENV_READERS:
                arg = node.args[0]
        elif isinstance(node, ast.Subscript):
            arg = node.slice
        if isinstance(arg, ast.Constant) and str(arg.value).startswith("ASYNCLLM_"):
            found.append(arg.value)
    return found


def test_asyncllm_environment_is_read_only_in_envs():
    readers = {name: env_reads(path) for name, path in MODULES.items() if name != "asyncllm.envs"}
    assert {n: r for n, r in readers.items() if r} == {}
    assert env_reads(MODULES["asyncllm.envs"])  # the checker finds the reads that exist


def test_every_asyncllm_variable_is_documented_in_envs():
    from asyncllm import envs

    read = set(env_reads(MODULES["asyncllm.envs"]))
    assert read == set(envs.VARIABLES)
    assert all(v in (envs.__doc__ or "") for v in read)


def test_core_and_the_leaves_import_without_torch():
    # DESIGN: the scheduler and KV cache manager are pure Python, tested without a model;
    # the wire types and the public data types come with them.
    mods = [m for m in MODULES if m.startswith("asyncllm.core")] + [
        "asyncllm",
        "asyncllm.config",
        "asyncllm.envs",
        "asyncllm.errors",
        "asyncllm.messages",
        "asyncllm.outputs",
        "asyncllm.sampling_params",
        "asyncllm.step_io",
        "asyncllm.engine.serial",
    ]
    code = f"import sys\nfor m in {mods!r}:\n    __import__(m)\nprint(sorted(k for k in sys.modules if k.split('.')[0] in ('torch', 'transformers')))"
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(str(r) for r in SOURCE_ROOTS)}
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "[]"


# -- the two sides -------------------------------------------------------------------


def read_modules_block(marker: str) -> list[str]:
    text = DOC.read_text()
    block = re.search(rf"<!-- {marker} -->(.*?)<!-- /{marker} -->", text, re.S)
    assert block, f"{DOC} has no {marker} block"
    return re.findall(r"`([\w.]+)`", block.group(1))


def read_lazy_paths() -> set[tuple[str, str]]:
    """(host module, core-side module) pairs named in the lazy-imports block."""
    text = DOC.read_text()
    block = re.search(r"<!-- lazy core imports -->(.*?)<!-- /lazy core imports -->", text, re.S)
    assert block, f"{DOC} has no lazy core imports block"
    pairs = re.findall(r"`([\w.]+)`\s*->\s*`([\w.]+)`", block.group(1))
    assert pairs
    return set(pairs)


def side_of(module: str) -> str | None:
    """'host', 'core' or 'tools': the side whose listed name holds `module` most
    closely (so `asyncllm.engine`, the package file, is host and its core_* modules
    core); None if no list names it."""
    best: tuple[int, str] | None = None
    for side, units in SIDES.items():
        for u in units:
            if module == u or (u != "asyncllm" and module.startswith(u + ".")):
                if best is None or len(u) > best[0]:
                    best = (len(u), side)
    return best[1] if best else None


def function_level_imports(path: Path, modules: dict[str, Path], name: str) -> set[str]:
    """Our modules that `name` imports only inside a function body."""
    everywhere = imports_of(name, path, modules)
    return everywhere - imports_of(name, path, modules, module_level_only=True)


SIDES = {
    "host": read_modules_block("host side"),
    "core": read_modules_block("core side"),
    "tools": ["asyncllm.bench"],  # benchmarks measure both sides
}


def test_every_module_is_on_a_side():
    assert [m for m in MODULES if side_of(m) is None] == []


def test_the_host_side_never_imports_the_core_side():
    """The host process stays light: its modules import nothing of the core side, inside
    functions neither, except the named lazy in-process paths (inside a function)."""
    lazy = read_lazy_paths()
    bad = []
    for src, targets in GRAPH.items():
        if side_of(src) != "host":
            continue
        for dst in targets:
            if side_of(dst) != "core":
                continue
            if (src, dst) in lazy and dst in function_level_imports(MODULES[src], MODULES, src):
                continue
            bad.append(f"{src} imports {dst}")
    assert not bad, "host-side imports of the core side:\n" + "\n".join(sorted(bad))
    for src, dst in lazy:  # the exceptions name real modules on the right sides
        assert side_of(src) == "host" and side_of(dst) == "core", (src, dst)


def test_the_side_checker_tells_function_level_imports(tmp_path):
    f = tmp_path / "m.py"
    f.write_text(
        "import asyncllm.config\n\ndef f():\n    from asyncllm.engine import core_inproc\n"
    )
    assert function_level_imports(f, MODULES, "asyncllm.x") == {"asyncllm.engine.core_inproc"}


def test_every_module_is_in_the_architecture_tree():
    """docs/architecture.md's tree names every module (by its file name, or its path
    below its package), so the map of the code cannot fall behind it."""
    text = DOC.read_text()
    start = text.index("```")
    tree = text[start : text.index("```", start + 3)]
    missing = []
    for name, path in MODULES.items():
        if path.name == "__init__.py":
            continue
        below = "/".join(path.parts[-2:])
        if not re.search(rf"(?<![\w/]){re.escape(path.name)}\b", tree) and below not in tree:
            missing.append(name)
    assert missing == [], f"modules missing from {DOC}'s tree: {missing}"
