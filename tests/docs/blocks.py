"""The fenced code blocks of a Markdown page: found, planned and run.

Every page whose blocks the suite runs (README.md; docs/ pages as they join) goes through
this one harness. A block's language picks its runner:

- `python` (`py`, `python3`): the block as a script, run by this interpreter in a fresh
  process from the repository root; it must exit 0.
- `sh`, `bash`, `shell`: command by command (a command may go on over several lines: a
  trailing backslash or an open quote), each by bash from the repository root with this
  interpreter's folder (the virtual environment's `bin/`, where the `asyncllm` command
  lives) first on PATH; each must exit 0.
- `console`: the same for its `$ ` lines; the other lines are output, not checked.

A block that the suite cannot run as written says how it is exercised instead, in a
marker comment above its fence (blank lines may come between; the comment may span
lines). Values with spaces are quoted as in a shell:

    <!-- docs: skip reason="..." covered-by="tests/x.py tests/y.py::test_name" -->
        Not run. The reason becomes the test's skip message; each `covered-by` path must
        exist (and, with `::name`, define `name`).
    <!-- docs: dry-run covered-by="..." -->
        `make` commands only: each runs as `make -n ...`, which prints the recipe
        without running it, so a target that does not exist fails. (make still runs
        the recipe lines that call `$(MAKE)`: not for targets such as `test-gpu`.)
    <!-- docs: server ready="REGEX" append="--port 0" url="http://localhost:8000" -->
        A block of one long-running command. It starts (with `append`'s words added) in
        a session of its own until a line of its output matches `ready`. Then the next
        block, its client, runs, with each `url` in it replaced by the regex's first
        group. Then the command gets SIGTERM. It must exit 0 within `stop-timeout`
        seconds (default 30) and leave no process of its session behind.
    <!-- docs: run timeout=60 -->
        The block's own runner, with options.

`timeout` (seconds for each command, default 120) is taken by every verb but `skip`;
`note` (words for the reader, not read by the harness) by every verb.
The harness refuses, by failing the block's case with the page and line named: a block
with neither a runner nor a marker, a marker with an unknown verb or option, a `skip`
without a reason, and a marker that no fence follows.

By hand: `python -m tests.docs.blocks docs/guide.md [--line N ...]`.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import re
import shlex
import signal
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
PYTHON_LANGS = frozenset({"python", "py", "python3"})
SHELL_LANGS = frozenset({"sh", "bash", "shell", "console"})
VERBS: dict[str, frozenset[str]] = {
    "run": frozenset({"timeout", "note"}),
    "skip": frozenset({"reason", "covered-by", "note"}),
    "dry-run": frozenset({"timeout", "covered-by", "note"}),
    "server": frozenset({"timeout", "ready", "append", "url", "stop-timeout", "note"}),
}
DEFAULT_TIMEOUT = 120.0
DEFAULT_STOP_TIMEOUT = 30.0
TAIL = 4000  # characters of a failed command's output kept in the message

_FENCE = re.compile(r"^( {0,3})(`{3,}|~{3,})(.*)$")
_MARKER_START = re.compile(r"^\s*<!--\s*docs:")
_MARKER = re.compile(r"<!--\s*docs:(.*?)-->", re.S)


class BlockError(AssertionError):
    """A block that failed or that the harness refuses; the message names page and line."""


@dataclass(frozen=True)
class Marker:
    line: int
    verb: str
    options: dict[str, str]
    problem: str | None = None

    def timeout(self, key: str = "timeout", default: float = DEFAULT_TIMEOUT) -> float:
        return float(self.options[key]) if key in self.options else default


@dataclass(frozen=True)
class Block:
    page: Path
    line: int  # the opening fence's line, counted from 1
    lang: str  # the info string's first word, lower case ("" when none)
    code: str
    marker: Marker | None = None

    @property
    def where(self) -> str:
        return f"{_rel(self.page)}:{self.line}"


@dataclass(frozen=True)
class Case:
    """What one test runs: a block, or a server block with its client."""

    id: str
    line: int
    blocks: tuple[Block, ...]
    problem: str | None = None


@dataclass
class Outcome:
    skipped: str | None = None
    outputs: list[str] = field(default_factory=list)  # each command's stdout and stderr


def _rel(page: Path) -> str:
    try:
        return str(page.resolve().relative_to(ROOT))
    except ValueError:
        return str(page)


# --- finding ----------------------------------------------------------------------------


def find_blocks(page: Path, text: str | None = None) -> tuple[list[Block], list[Marker]]:
    """The page's fenced blocks, each with the marker just above it, and every marker."""
    lines = (page.read_text() if text is None else text).splitlines()
    blocks: list[Block] = []
    markers: list[Marker] = []
    pending: Marker | None = None  # a marker waiting for its fence
    i = 0
    while i < len(lines):
        m = _FENCE.match(lines[i])
        if m and not (m.group(2)[0] == "`" and "`" in m.group(3)):
            indent, fence, info = len(m.group(1)), m.group(2), m.group(3)
            body, j = [], i + 1
            while j < len(lines):
                c = _FENCE.match(lines[j])
                if (
                    c
                    and c.group(2)[0] == fence[0]
                    and len(c.group(2)) >= len(fence)
                    and not c.group(3).strip()
                ):
                    break
                line = lines[j]
                body.append(line[min(indent, len(line) - len(line.lstrip(" "))) :])
                j += 1
            lang = info.split()[0].lower() if info.strip() else ""
            code = "\n".join(body) + "\n" if body else ""
            blocks.append(Block(page, i + 1, lang, code, pending))
            pending = None
            i = j + 1
            continue
        if _MARKER_START.match(lines[i]):
            j = i
            while "-->" not in lines[j] and j + 1 < len(lines):
                j += 1
            found = _MARKER.search("\n".join(lines[i : j + 1]))
            if found:
                pending = _parse_marker(i + 1, found.group(1))
                markers.append(pending)
                i = j + 1
                continue
        if lines[i].strip():
            pending = None  # prose between a marker and the next fence: the marker is loose
        i += 1
    return blocks, markers


def _parse_marker(line: int, text: str) -> Marker:
    def bad(problem: str, verb: str = "") -> Marker:
        return Marker(line, verb, {}, f"the docs marker at line {line}: {problem}")

    try:
        words = shlex.split(text)
    except ValueError as e:
        return bad(str(e))
    if not words:
        return bad("no verb")
    verb, options = words[0], {}
    if verb not in VERBS:
        return bad(f"unknown verb {verb!r} (known: {', '.join(VERBS)})")
    for word in words[1:]:
        key, eq, value = word.partition("=")
        if not eq or key not in VERBS[verb]:
            known = ", ".join(sorted(VERBS[verb]))
            return bad(f"{verb} takes key=value options ({known}), not {word!r}", verb)
        options[key] = value
    for key in ("timeout", "stop-timeout"):
        if key in options:
            try:
                if float(options[key]) <= 0:
                    raise ValueError
            except ValueError:
                return bad(f"{key} must be a number of seconds, not {options[key]!r}", verb)
    if verb == "skip" and not options.get("reason", "").strip():
        return bad('skip needs reason="..." (what exercises the block, or why nothing can)')
    if verb == "server" and not options.get("ready"):
        return bad('server needs ready="REGEX" (the line that says it is ready)', verb)
    if verb == "server":
        try:
            ready = re.compile(options["ready"])
        except re.error as e:
            return bad(f"ready is not a regex: {e}", verb)
        if "url" in options and ready.groups < 1:
            return bad("url= needs a group in ready= (the address to put in its place)", verb)
    return Marker(line, verb, options)


def shell_commands(block: Block, code: str | None = None) -> list[tuple[int, str]]:
    """(page line, command) for each command of a shell block: comment lines and blank
    lines are skipped; a command goes on while a line ends with a backslash or a quote
    is open; in a `console` block only `$ ` lines (and their continuations) count."""
    out: list[tuple[int, str]] = []
    buf: list[str] = []
    start = 0
    for n, line in enumerate((block.code if code is None else code).splitlines()):
        if not buf:
            if block.lang == "console":
                if not line.startswith("$ "):
                    continue  # output
                line = line[2:]
            if not line.strip() or line.lstrip().startswith("#"):
                continue
            start = block.line + 1 + n
        buf.append(line)
        text = "\n".join(buf)
        if text.endswith("\\") or not _complete(text):
            continue
        out.append((start, text))
        buf = []
    if buf:
        raise BlockError(f"{_rel(block.page)}:{start}: this command does not end: {buf[0]!r}")
    return out


def _complete(text: str) -> bool:
    try:
        shlex.split(text, comments=True)
    except ValueError:  # "No closing quotation"
        return False
    return True


# --- planning ---------------------------------------------------------------------------


def _runnable(lang: str) -> bool:
    return lang in PYTHON_LANGS or lang in SHELL_LANGS


def plan(page: Path, text: str | None = None) -> list[Case]:
    """One case per block (a server block and its client make one), in page order; a
    block the harness refuses is a case whose `problem` says why."""
    blocks, markers = find_blocks(page, text)
    rel = _rel(page)
    attached = {b.marker.line for b in blocks if b.marker is not None}
    cases = [
        Case(f"L{mk.line}-marker", mk.line, (), f"{rel}:{mk.line}: a docs marker with no fence after it")
        for mk in markers
        if mk.line not in attached
    ]  # fmt: skip
    i = 0
    while i < len(blocks):
        b, mk = blocks[i], blocks[i].marker
        case_id = f"L{b.line}-{b.lang or 'text'}"
        problem = None
        verb = mk.verb if mk is not None else "run"
        if mk is not None and mk.problem:
            problem = f"{b.where}: {mk.problem}"
        elif verb == "run" and not _runnable(b.lang):
            problem = (
                f"{b.where}: a {b.lang or 'plain'} block has no runner (python, sh, bash, "
                "shell or console have one); say how it is exercised in a marker above it, "
                'e.g. <!-- docs: skip reason="..." --> (tests/docs/blocks.py lists them)'
            )
        elif verb in ("dry-run", "server") and b.lang not in SHELL_LANGS:
            problem = f"{b.where}: {verb} takes a shell block, not {b.lang or 'a plain one'}"
        if problem is None and b.lang in SHELL_LANGS:
            try:
                commands = shell_commands(b)
            except BlockError as e:
                problem = str(e)
            else:
                if verb == "server" and len(commands) != 1:
                    problem = f"{b.where}: a server block holds one command, not {len(commands)}"
        if problem is None and verb == "server":
            client = blocks[i + 1] if i + 1 < len(blocks) else None
            if client is None:
                problem = f"{b.where}: a server block needs a client block after it"
            elif (client.marker is not None and client.marker.verb != "run") or not _runnable(
                client.lang
            ):
                problem = f"{client.where}: the block after a server block is its client: it must be runnable"
            else:
                cid = f"{case_id}+L{client.line}-{client.lang}"
                cases.append(Case(cid, b.line, (b, client)))
                i += 2
                continue
        cases.append(Case(case_id, b.line, (b,), problem))
        i += 1
    return sorted(cases, key=lambda c: c.line)


# --- running ----------------------------------------------------------------------------


MAKE_VARS = ("MAKEFLAGS", "MFLAGS", "MAKELEVEL", "MAKEOVERRIDES")


def block_env() -> dict[str, str]:
    """This process's environment, with this interpreter's folder first on PATH, less
    what an enclosing `make test` passes down (a block's make runs as a reader's would)."""
    env = {k: v for k, v in os.environ.items() if k not in MAKE_VARS}
    env["PATH"] = str(Path(sys.executable).parent) + os.pathsep + env.get("PATH", "")
    return env


def _run(argv: list[str], timeout: float, where: str) -> tuple[int, str]:
    """Runs argv from the repository root in a session of its own (so a timeout ends
    whatever it started too); its return code and its stdout and stderr, merged."""
    proc = subprocess.Popen(
        argv, cwd=ROOT, env=block_env(), stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT, text=True, start_new_session=True,
    )  # fmt: skip
    try:
        out, _ = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        _kill_session(proc.pid)
        out, _ = proc.communicate()
        raise BlockError(f"{where}: still running after {timeout:g} s:\n{out[-TAIL:]}") from None
    return proc.returncode, out


def run_block(block: Block, timeout: float = DEFAULT_TIMEOUT, code: str | None = None) -> list[str]:
    """Runs a python or shell block (`code` in place of its own, if given); the outputs."""
    code = block.code if code is None else code
    if block.lang in PYTHON_LANGS:
        with tempfile.TemporaryDirectory(prefix="asyncllm-docs-") as tmp:
            script = Path(tmp) / f"{block.page.stem}_L{block.line}.py"
            script.write_text(code)
            rc, out = _run([sys.executable, str(script)], timeout, block.where)
        if rc != 0:
            raise BlockError(
                f"{block.where}: the python block exited with {rc} (line N of "
                f"{script.name} is line {block.line}+N of the page):\n{out[-TAIL:]}"
            )
        return [out]
    if block.lang in SHELL_LANGS:
        outputs = []
        for line, command in shell_commands(block, code):
            where = f"{_rel(block.page)}:{line}"
            rc, out = _run(["bash", "-c", command], timeout, where)
            if rc != 0:
                raise BlockError(f"{where}: `{command}` exited with {rc}:\n{out[-TAIL:]}")
            outputs.append(out)
        return outputs
    raise BlockError(f"{block.where}: no runner for a {block.lang or 'plain'} block")


def run_case(case: Case) -> Outcome:
    """Runs one case as its marker says; raises BlockError naming the page and line."""
    if case.problem:
        raise BlockError(case.problem)
    block = case.blocks[0]
    mk = block.marker
    verb = mk.verb if mk is not None else "run"
    if mk is not None:
        _check_covered(block, mk)
    if verb == "skip":
        assert mk is not None
        return Outcome(skipped=f"{block.where}: {mk.options['reason']}")
    timeout = mk.timeout() if mk is not None else DEFAULT_TIMEOUT
    if verb == "dry-run":
        return Outcome(outputs=_dry_run(block, timeout))
    if verb == "server":
        return _run_server(block, case.blocks[1], timeout)
    return Outcome(outputs=run_block(block, timeout))


def _check_covered(block: Block, mk: Marker) -> None:
    for ref in mk.options.get("covered-by", "").split():
        path, _, name = ref.partition("::")
        file = ROOT / path
        if not file.is_file():
            raise BlockError(f"{block.where}: covered-by names {path}, which does not exist")
        if name and not re.search(
            rf"^\s*(async\s+)?def {re.escape(name)}\(", file.read_text(), re.M
        ):
            raise BlockError(f"{block.where}: covered-by names {ref}, which {path} does not define")


def _dry_run(block: Block, timeout: float) -> list[str]:
    outputs = []
    for line, command in shell_commands(block):
        where = f"{_rel(block.page)}:{line}"
        argv = shlex.split(command, comments=True)
        if argv[:1] != ["make"]:
            raise BlockError(f"{where}: dry-run takes make commands only, not `{command}`")
        rc, out = _run(["make", "-n", *argv[1:]], timeout, where)
        if rc != 0:
            raise BlockError(f"{where}: `make -n {shlex.join(argv[1:])}` exited with {rc}:\n{out}")
        outputs.append(out)
    return outputs


def _run_server(block: Block, client: Block, timeout: float) -> Outcome:
    mk = block.marker
    assert mk is not None
    ((line, command),) = shell_commands(block)
    argv = shlex.split(command, comments=True) + shlex.split(mk.options.get("append", ""))
    where = f"{_rel(block.page)}:{line}"
    ready = re.compile(mk.options["ready"])
    proc = subprocess.Popen(
        argv, cwd=ROOT, env=block_env(), stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT, text=True, start_new_session=True,
    )  # fmt: skip
    seen: list[str] = []
    found: list[re.Match[str]] = []
    done = threading.Event()

    def read() -> None:
        assert proc.stdout is not None
        for out_line in proc.stdout:
            seen.append(out_line)
            if not found and (m := ready.search(out_line.rstrip("\r\n"))):
                found.append(m)
                done.set()
        done.set()

    reader = threading.Thread(target=read, name="docs-server-output", daemon=True)
    reader.start()

    def server_output() -> str:
        return f"\n--- the server's output ({where}) ---\n{''.join(seen)[-TAIL:]}"

    try:
        done.wait(timeout)
        if not found:
            if not reader.is_alive():  # its output ended: it has exited or soon will
                with contextlib.suppress(subprocess.TimeoutExpired):
                    proc.wait(5)
            if proc.poll() is None:
                state = f"printed no line matching {ready.pattern!r} within {timeout:g} s"
            else:
                state = f"exited with {proc.returncode} before a line matching {ready.pattern!r}"
            raise BlockError(f"{where}: `{shlex.join(argv)}` {state}{server_output()}")
        code = client.code
        if "url" in mk.options:
            if mk.options["url"] not in code:
                raise BlockError(
                    f"{client.where}: the client block never names {mk.options['url']}"
                )
            code = code.replace(mk.options["url"], found[0].group(1))
        try:
            outputs = run_block(client, client.marker.timeout() if client.marker else timeout, code)
        except BlockError as e:
            raise BlockError(f"{e}{server_output()}") from None
    finally:
        rc, left = _stop(proc, mk.timeout("stop-timeout", DEFAULT_STOP_TIMEOUT))
        reader.join(5)
    if rc is None:
        raise BlockError(
            f"{where}: still running {mk.timeout('stop-timeout', DEFAULT_STOP_TIMEOUT):g} s after SIGTERM{server_output()}"
        )
    if rc != 0:
        raise BlockError(f"{where}: exited with {rc} after SIGTERM{server_output()}")
    if left:
        raise BlockError(f"{where}: processes of its session outlived it: {left}{server_output()}")
    return Outcome(outputs=["".join(seen), *outputs])


def _stop(proc: subprocess.Popen[str], stop_timeout: float) -> tuple[int | None, list[int]]:
    """SIGTERM to the command alone (its children are its own to stop), then its exit
    status (None past the timeout: then the whole session is killed) and the pids of
    its session still alive 10 s after it exited (then killed)."""
    if proc.poll() is None:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(stop_timeout)
        except subprocess.TimeoutExpired:
            _kill_session(proc.pid)
            proc.wait()
            return None, []
    deadline = time.monotonic() + 10
    while (left := _session(proc.pid)) and time.monotonic() < deadline:
        time.sleep(0.1)
    if left:
        _kill_session(proc.pid)
    return proc.returncode, left


def _session(sid: int) -> list[int]:
    """The live (not zombie) processes of session `sid`, read from /proc (Linux)."""
    if not Path("/proc").is_dir():
        return []
    out = []
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        if fields[0] != "Z" and int(fields[3]) == sid:
            out.append(int(stat.parent.name))
    return out


def _kill_session(sid: int) -> None:
    try:
        os.killpg(sid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass


# --- by hand ----------------------------------------------------------------------------


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description="Run the code blocks of a Markdown page.")
    ap.add_argument("page", type=Path)
    ap.add_argument("--line", type=int, action="append", help="only the case at this line")
    ns = ap.parse_args(argv)
    failed = 0
    for case in plan(ns.page):
        if ns.line and case.line not in ns.line:
            continue
        start = time.perf_counter()
        try:
            outcome = run_case(case)
        except BlockError as e:
            failed += 1
            print(f"FAIL {case.id} ({time.perf_counter() - start:.1f} s)\n{e}\n", flush=True)
            continue
        took = f"({time.perf_counter() - start:.1f} s)"
        if outcome.skipped:
            print(f"SKIP {case.id} {took}: {outcome.skipped}", flush=True)
        else:
            print(f"PASS {case.id} {took}", flush=True)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
